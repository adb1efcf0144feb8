//! Deterministic simulation of the staged [`StagedAllgather`] on the world
//! communicator: flat, hierarchical, or a random design per SP.
//!
//! Shares placement, cost model, generator and the event driver with the
//! other simulators. Copies go through the SP's
//! [`CopyLimiter`](crate::sched::CopyLimiter); a read (local send buffer
//! into staging) costs what [`CostModel`](super::CostModel) says for a copy within the node; a
//! write into a buffer or region on another node costs the fixed inter-node
//! copy cost and then takes the directed node link in turn with messages
//! (so flat writers of one node load their links P times per chunk,
//! hierarchical ones once per SP); a write within the node costs an
//! intra-node copy. A `from_segment` completion is the host's copy of
//! `P * len` bytes out of the region, done at completion time and costed in
//! `SimReport::end_ns`.
//!
//! *Exact bytes at any size.* Every byte is tracked by provenance rather
//! than by value: each buffer, region and staging slot is a list of extents
//! "these bytes are bytes `base..` of the send block of rank `s`" (or
//! untouched, or garbage after a failed copy), split and merged as copies
//! land. A receive buffer is right iff, for every `s`, bytes `s * len ..
//! (s + 1) * len` are bytes `0..len` of rank `s`'s block: byte-exact, and
//! cheap enough for 1 MiB blocks on 1024 ranks.
//!
//! Checkers (all outside the algorithm):
//! * every rank that completes `Ok` holds every block at its place, and
//!   every rank of the collective posted, with the same length and comm
//!   (so a rank never completes `Ok` with an inconsistent post around);
//!   bytes past `P * len` are never touched; without faults every rank
//!   completes `Ok` (`from_segment` exactly on hierarchical SPs, each
//!   reading its node owner's region at the place the owner's driver gave
//!   it);
//! * each posted rank completes exactly once, by its own SP; a rank never
//!   completes `Ok` after its SP learned of a fault touching the collective
//!   (peer loss, loss of a rank that had not completed, an `Abort` or
//!   `Stopped`);
//! * no copy starts or finishes on the receive buffer or the send buffer of
//!   a rank that completed, nor on a region some rank already copied out
//!   of (or, at its owner, completed); nothing is written into a rank
//!   before it posted;
//! * staging: every slot id is below `staging_slots`; a slot is never
//!   written while anything else reads or writes it, and never read while
//!   it is written; each SP's `max_slots_in_use` stays within the bound;
//! * shape: reads only from the SP's own ranks' send buffers at `chunk *
//!   chunk_bytes`, writes only of the SP's own ranks' blocks at `block *
//!   len + chunk * chunk_bytes`, into receive buffers of ranks of flat SPs
//!   or the region of node owners (hierarchical, through the shared key of
//!   the rank that posted first there), never into the ranks of a covered
//!   SP (hierarchical, not its node's owner, whose owner is hierarchical);
//! * the run ends within the event/time bound, every posted rank of a live
//!   SP completes, every instance of a live SP that saw a post is finished;
//! * without faults: every block is read once, each chunk written exactly
//!   once into every rank of a flat SP and into the region of every
//!   hierarchical owner, exactly the bytes that this implies cross nodes,
//!   and one `RegionDone` per covered SP.
//!
//! A message reaching an SP whose instance is finished is dropped, as the
//! SP engine does, except in runs with posts of different comms, where it
//! is answered with [`refusal`] (see the module docs of the algorithm).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::driver::{self, Core, Ev};
use super::shared::{draw_len, world_key};
use super::{Common, Outcome, SimFailure};
use crate::staged_allgather::{
    node_owner, refusal, Action, Config, Copy, Design, Loc, Msg, Post, StagedAllgather, Stats,
};
use crate::{CollKey, Nanos, Rank, SpId, Status};

mod checks;
mod events;
mod memory;
mod state;
#[cfg(test)]
mod tests;

use checks::*;
use memory::*;
use state::*;

/// How an SP receives (see the algorithm's module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SimMode {
    Flat,
    /// A hierarchical node owner: into its region.
    Region,
    /// Hierarchical, not the owner, whose owner is hierarchical: its ranks
    /// read the owner's region.
    Covered,
}

/// Where the driver of SP `sp` places its region in its node segment (any
/// value works; distinct ones let the checker see that ranks copy from the
/// place their owner named).
fn region_at(sp: SpId) -> u64 {
    4096 * (u64::from(sp) + 1)
}

/// Untouched bytes after the data in every buffer and region.
const PAD: u64 = 3;

super::config::sim_faults!(
    /// Probability (parts per million) that a copy fails with
    /// `AccessError` (its destination bytes become garbage).
    pub copy_error_ppm: u32,
    /// (collective, rank) posts with a length off by one.
    pub inconsistent_len: u32,
    /// (collective, rank) posts naming another comm: two other ranks of
    /// different SPs (neither the poster's) swapped in `members`/`nodes`.
    pub inconsistent_comm: u32,
);

/// Everything a run depends on.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimConfig {
    #[serde(flatten)]
    pub common: Common,
    /// Design of every SP, unless `mixed_designs`.
    pub design: Design,
    /// Each SP picks its design at random per collective (as the engine
    /// does when an SP has no segment room and delivers flat).
    pub mixed_designs: bool,
    pub chunk_bytes: u64,
    pub staging_slots: u32,
    /// Block length of every collective; `None`: per collective 0 or 1
    /// (10% each), a multiple of `chunk_bytes` (15%), else uniform in
    /// `0..=max_len_bytes`.
    pub len_bytes: Option<u64>,
    pub max_len_bytes: u64,
    pub faults: Faults,
}

impl SimConfig {
    /// [`Common::staged`] with 4 ranks per node and bounds of 2 * 10^8
    /// events and 1000 s, flat, 16-byte chunks, 3 slots, random block
    /// lengths up to 50 bytes, no faults.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            common: Common {
                ranks_per_node: 4,
                max_events: 200_000_000,
                max_virtual_ns: 1_000_000_000_000,
                ..Common::staged(seed)
            },
            design: Design::Flat,
            mixed_designs: false,
            chunk_bytes: 16,
            staging_slots: 3,
            len_bytes: None,
            max_len_bytes: 50,
            faults: Faults::default(),
        }
    }
}

/// Which grant of a rank a key names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum KeyKind {
    Send,
    Recv,
    /// The region of the rank's SP (hierarchical).
    Shared,
}

/// Key material: one grant of one rank in one collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SimKey {
    pub op: u32,
    pub rank: Rank,
    pub kind: KeyKind,
}

/// Outcome of a successful run.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimReport {
    #[serde(flatten)]
    pub outcome: Outcome,
    /// Latest time a rank had the data in its own buffer: its completion,
    /// plus the host's copy out of the region for `from_segment`
    /// completions.
    pub end_ns: Nanos,
    /// Latest completion emitted by an SP.
    pub sp_end_ns: Nanos,
    /// Chunk reads and writes that finished `Ok`.
    pub reads: u64,
    pub writes: u64,
    /// Bytes written into buffers/regions on another node / the same node.
    pub bytes_inter_node: u64,
    pub bytes_intra_node: u64,
    /// What a fault-free run must move across nodes (sum over collectives).
    pub expected_inter_node_bytes: u64,
    /// Busy time of the busiest directed node link (writes only): a lower
    /// bound of the run under this cost model.
    pub max_link_busy_ns: Nanos,
    /// Instance counters summed (`max_slots_in_use`: the maximum).
    pub stats: Stats,
    /// Messages that reached a finished instance: dropped, or answered.
    pub after_finish_dropped: u64,
    pub after_finish_refused: u64,
}

super::config::sim_config! {
    config: [design, mixed_designs, chunk_bytes, staging_slots, len_bytes, max_len_bytes], [], [];
    report:
        [end_ns, sp_end_ns],
        [
            reads,
            writes,
            bytes_inter_node,
            bytes_intra_node,
            expected_inter_node_bytes,
            max_link_busy_ns,
        ],
        [stats],
        [after_finish_dropped, after_finish_refused];
}
super::config::world_schedule!();
