//! Machinery shared by the staged collectives ([`crate::bcast`] and
//! [`crate::staged_allgather`]): their configuration, the design choice,
//! the staging slots an instance owns on its SP, the places bytes are
//! copied between, the actions they emit, and the switch of deliberately
//! broken variants their simulator tests turn on. Nothing here knows
//! either protocol; both depend on this module, never the other way round.

use std::ops::{Deref, DerefMut};

use serde::{Deserialize, Serialize};

use crate::{Rank, SpId, Status};

/// Static configuration of one staged instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Config {
    /// The SP running this instance.
    pub me: SpId,
    /// Bytes per chunk and per staging slot (0 is clamped to 1). The
    /// broadcast needs the same value on every SP; the allgather does not.
    pub chunk_bytes: u64,
    /// Staging slots of this instance on this SP (0 is clamped to 1).
    pub staging_slots: u32,
}

/// How an SP delivers the data to its ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Design {
    /// Each chunk is written into every local non-root rank's buffer.
    Flat,
    /// Each chunk is written once into the node segment, by the node's
    /// leader; ranks complete with `from_segment` and copy from it
    /// themselves.
    Hier,
}

/// A staging slot of one SP's instance: `0..staging_slots`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SlotId(pub u32);

/// Identifies a copy within one instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CopyId(pub u64);

/// A place bytes are copied from or to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Loc<K> {
    /// A host grant (a rank's buffer or a node segment).
    Host { key: K, offset: u64 },
    /// This SP's staging slot of this instance.
    Stage { slot: SlotId, offset: u64 },
}

impl<K> Loc<K> {
    /// The start of this SP's staging slot `slot`, where a chunk sits.
    pub(crate) fn slot_start(slot: usize) -> Loc<K> {
        Loc::Stage {
            slot: SlotId(slot as u32),
            offset: 0,
        }
    }
}

/// Output of a staged state machine: `M` its messages, `C` its copies, `V`
/// its moves (the broadcast's; [`Infallible`](std::convert::Infallible) for
/// a collective without moves).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action<M, C, V> {
    /// Send `msg` to SP `to` (never this SP itself).
    Send { to: SpId, msg: M },
    /// Start this copy and report it with `handle_copy_done`.
    Copy(C),
    /// Start this move and report it with `handle_move_done`.
    Move(V),
    /// Local `rank` is done; emitted exactly once per posted rank.
    /// `from_segment` (only with `Status::Ok`, hierarchical design, ranks
    /// that receive): the data are in the node segment, not in the rank's
    /// buffer; the host copies them from offset 0 of its `shared_key`
    /// region into its buffer before returning from the wait (see the
    /// collective's docs for how many bytes).
    Complete {
        rank: Rank,
        status: Status,
        from_segment: bool,
    },
}

/// One staging slot; `H` is what the collective tracks about the chunk it
/// holds.
#[derive(Clone, Debug)]
pub(crate) enum Slot<H> {
    Free,
    /// Granted to this parent (broadcast); awaiting its chunk.
    Granted(SpId),
    /// A read of a host buffer into this slot is in flight.
    Reading,
    Full(H),
}

/// The staging slots of one instance (`Config::staging_slots`, at least
/// one).
#[derive(Clone, Debug)]
pub(crate) struct Slots<H>(Vec<Slot<H>>);

impl<H: Clone> Slots<H> {
    pub fn new(staging_slots: u32) -> Slots<H> {
        Slots(vec![Slot::Free; staging_slots.max(1) as usize])
    }
}

impl<H> Slots<H> {
    /// Slots granted, being read, or holding a chunk.
    pub fn in_use(&self) -> usize {
        self.0.iter().filter(|s| !matches!(s, Slot::Free)).count()
    }

    /// The lowest free slot.
    pub fn first_free(&self) -> Option<usize> {
        self.0.iter().position(|s| matches!(s, Slot::Free))
    }

    pub fn all_free(&self) -> bool {
        self.0.iter().all(|s| matches!(s, Slot::Free))
    }

    /// Whether slot `i` is granted to `sp`.
    pub fn granted_to(&self, i: usize, sp: SpId) -> bool {
        matches!(self.0.get(i), Some(Slot::Granted(g)) if *g == sp)
    }

    /// Every slot granted to `sp` is free again.
    pub fn release_granted(&mut self, sp: SpId) {
        for s in self.0.iter_mut() {
            if matches!(s, Slot::Granted(g) if *g == sp) {
                *s = Slot::Free;
            }
        }
    }
}

impl<H> Deref for Slots<H> {
    type Target = Vec<Slot<H>>;
    fn deref(&self) -> &Vec<Slot<H>> {
        &self.0
    }
}

impl<H> DerefMut for Slots<H> {
    fn deref_mut(&mut self) -> &mut Vec<Slot<H>> {
        &mut self.0
    }
}

/// Declares the per-thread switch of a collective's `Mutation` enum
/// (deliberately broken variants its simulator tests switch on to show
/// that the checkers catch them): `set_mutation` (test builds only) and
/// `mutated`, always `false` outside test builds.
macro_rules! mutation_switch {
    ($m:ty) => {
        #[cfg(test)]
        thread_local! {
            static MUTATION: std::cell::Cell<Option<$m>> = const { std::cell::Cell::new(None) };
        }

        /// Switch a [`Mutation`] on (or off) for the current thread.
        #[cfg(test)]
        pub(crate) fn set_mutation(m: Option<$m>) {
            MUTATION.with(|c| c.set(m));
        }

        #[inline]
        fn mutated(m: $m) -> bool {
            #[cfg(test)]
            {
                MUTATION.with(|c| c.get() == Some(m))
            }
            #[cfg(not(test))]
            {
                let _ = m;
                false
            }
        }
    };
}
pub(crate) use mutation_switch;

/// `impl Stats { fn absorb }` for a staged collective's counters:
/// `stats_absorb!(Stats { sum: a, b; max: c })` adds each counter named
/// after `sum` and keeps the larger high-water mark of each after `max`.
/// Every field must be named (the pattern is exhaustive).
macro_rules! stats_absorb {
    ($stats:ident { sum: $($sum:ident),+; max: $($max:ident),+ }) => {
        impl $stats {
            /// Adds `other`'s counters into these, as when totalling the
            /// counters of many instances.
            pub fn absorb(&mut self, other: &$stats) {
                let $stats { $($sum,)+ $($max,)+ } = *other;
                $(self.$sum += $sum;)+
                $(self.$max = self.$max.max($max);)+
            }
        }
    };
}
pub(crate) use stats_absorb;
