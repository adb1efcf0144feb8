//! The mailbox slot pool: which completion slots are free.
//!
//! A slot is taken when a collective is posted and given back when its completion has been
//! observed (the request keeps its result, so the slot is free long before `MPI_Wait`). A slot
//! whose fate is unknown (the SP refused the post by message, so a late mailbox write may still
//! come) is quarantined: it stays taken for the rest of the run. Giving back a slot that is not
//! taken is a bug in the shim and panics (the boundary turns that into an MPI error).
//!
//! With no slot free a post goes without one (its completion then comes as a message:
//! `post.rs`), so the pool never makes anyone wait.

#[derive(Debug)]
pub struct SlotPool {
    /// Free slots, taken from the end (the most recently freed first: warm in cache).
    free: Vec<u32>,
    taken: Vec<bool>,
}

impl SlotPool {
    pub fn new(slots: u32) -> Self {
        SlotPool {
            free: (0..slots).rev().collect(),
            taken: vec![false; slots as usize],
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
        assert_eq!(p.take(), Some(1));
        assert_eq!(p.take(), None);
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
