//! The mailbox slot pool: which completion slots are free.
//!
//! A slot is taken when a collective is posted and given back when its completion has been
//! observed (the request keeps its result, so the slot is free long before `MPI_Wait`). A slot
//! whose fate is unknown (the SP refused the post by message, so a late mailbox write may still
//! come) is quarantined: it stays taken for the rest of the run. Giving back a slot that is not
//! taken is a bug in the shim and panics (the boundary turns that into an MPI error).
//!
//! Once every slot is quarantined no slot can ever free up again: [`SlotPool::exhausted`]
//! says so, and posting fails instead of waiting for a slot forever (`coll.rs`).

#[derive(Debug)]
pub struct SlotPool {
    /// Free slots, taken from the end (the most recently freed first: warm in cache).
    free: Vec<u32>,
    taken: Vec<bool>,
    quarantined: u32,
}

impl SlotPool {
    pub fn new(slots: u32) -> Self {
        SlotPool {
            free: (0..slots).rev().collect(),
            taken: vec![false; slots as usize],
            quarantined: 0,
        }
    }

    pub fn take(&mut self) -> Option<u32> {
        let slot = self.free.pop()?;
        debug_assert!(!self.taken[slot as usize]);
        self.taken[slot as usize] = true;
        Some(slot)
    }

    pub fn give(&mut self, slot: u32) {
        let taken = &mut self.taken[slot as usize];
        assert!(*taken, "mailbox slot {slot} given back twice");
        *taken = false;
        self.free.push(slot);
    }

    /// Keeps a taken slot out of use for good.
    pub fn quarantine(&mut self, slot: u32) {
        assert!(
            self.taken[slot as usize],
            "quarantining free mailbox slot {slot}"
        );
        self.quarantined += 1;
    }

    /// No slot is free and none ever will be: every slot is quarantined (none belongs to an
    /// outstanding collective whose completion would give it back).
    pub fn exhausted(&self) -> bool {
        self.free.is_empty() && self.quarantined as usize >= self.taken.len()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn quarantined(&self) -> u32 {
        self.quarantined
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_until_empty_then_reuse() {
        let mut p = SlotPool::new(3);
        let got: Vec<u32> = std::iter::from_fn(|| p.take()).collect();
        assert_eq!(got, [0, 1, 2]);
        assert_eq!(p.take(), None);
        p.give(1);
        assert_eq!(p.free_count(), 1);
        assert_eq!(p.take(), Some(1));
    }

    #[test]
    fn quarantined_slots_never_come_back() {
        let mut p = SlotPool::new(2);
        let a = p.take().unwrap();
        p.quarantine(a);
        let b = p.take().unwrap();
        p.give(b);
        assert_eq!(p.take(), Some(b));
        assert_eq!(p.take(), None);
        assert_eq!(p.quarantined(), 1);
    }

    #[test]
    fn exhausted_only_when_every_slot_is_quarantined() {
        let mut p = SlotPool::new(2);
        assert!(!p.exhausted());
        let a = p.take().unwrap();
        let b = p.take().unwrap();
        // Both taken by outstanding collectives: they may still complete.
        assert!(!p.exhausted());
        p.quarantine(a);
        assert!(!p.exhausted());
        p.quarantine(b);
        assert!(p.exhausted());
        assert!(SlotPool::new(0).exhausted());
    }

    #[test]
    #[should_panic(expected = "given back twice")]
    fn double_give_is_a_bug() {
        let mut p = SlotPool::new(2);
        let a = p.take().unwrap();
        p.give(a);
        p.give(a);
    }

    #[test]
    fn empty_pool() {
        let mut p = SlotPool::new(0);
        assert_eq!(p.take(), None);
    }
}
