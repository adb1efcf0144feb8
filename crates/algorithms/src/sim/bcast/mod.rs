//! Deterministic simulation of the staged [`Bcast`] on
//! the world communicator, flat or hierarchical.
//!
//! Shares placement, cost model, generator and the event driver with the
//! other simulators. Real bytes everywhere: every rank's buffer, the root's
//! data, each SP's region of its node segment (hierarchical) and each SP's staging slots
//! are byte vectors, and every `Copy` and `Move` really moves bytes. A move
//! takes the directed node link (in turn with messages) and its `Chunk`
//! message arrives with the last byte; copies go through the SP's
//! [`CopyLimiter`](crate::sched::CopyLimiter) and cost what
//! [`CostModel`](super::CostModel) says for a copy within the node. A `from_segment`
//! completion is the host's copy out of the segment, done at completion
//! time (and costed in `SimReport::end_ns`).
//!
//! Checkers (all outside the algorithm):
//! * every rank that completes `Ok` holds the root's bytes exactly, and its
//!   post agrees with the root's (root and length) (with injected
//!   inconsistent posts: with those of the rank it names as root, which
//!   must name itself); bytes past the message are never touched; the root's buffer is never written; fault-free
//!   collectives complete `Ok` everywhere (`from_segment` exactly for the
//!   hierarchical non-root ranks, each reading the region its node's leader
//!   wrote, at the place the leader's driver gave it);
//! * each posted rank completes exactly once, by its own SP; a rank never
//!   completes `Ok` after its SP learned of a fault touching the collective
//!   (peer loss, loss of a rank that had not completed, an `Abort`);
//! * no copy starts or finishes on the buffer of a rank that completed (so
//!   the root's buffer is not read after the root completed), and no
//!   segment write starts or finishes after a rank of the node completed
//!   `from_segment` out of that region;
//! * staging: every slot id is below `staging_slots`; a slot is never
//!   written (read from the root, or filled by a move) while anything else
//!   reads or writes it, and never read while it is written; each SP's
//!   `max_slots_in_use` stays within the bound;
//! * shape: reads only from the buffer of a rank that named itself root, on
//!   its SP; writes only into the SP's own ranks at `chunk * chunk_bytes`;
//!   hierarchical writes only by node leaders, through the shared key of
//!   the SP's lowest non-root rank (the root's if it is the SP's only rank
//!   and the node has other SPs); moves only to the SP's children in the
//!   tree (the SPs grouped by node: the root's node first, its SPs from the
//!   root's SP on, then the other nodes in ring order; a node's first SP is
//!   its leader, whose children are the next node's leader and, flat, its
//!   own node's other SPs);
//! * the run ends within the event/time bound, every posted rank of a live
//!   SP completes, every instance of a live SP that saw a post is finished;
//! * fault-free: exactly `len * (nodes - 1)` bytes cross node boundaries
//!   (each chunk crosses each boundary once), one move per chunk per tree
//!   edge (hierarchical: per edge between leaders), each chunk written once
//!   per target (hierarchical: once per node, into the leader's region),
//!   one `Sealed` per non-leader SP (hierarchical).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::driver::{self, Core, Ev};
use super::rng::splitmix64;
use super::shared::{draw_len, world_key};
use super::{sentinel, Common, Outcome, SimFailure};
use crate::bcast::{Action, Bcast, Config, Copy, Design, Loc, Move, Msg, Post, Stats};
use crate::{CollKey, Nanos, Rank, SpId, Status};

mod checks;
mod events;
mod state;
#[cfg(test)]
mod tests;

use checks::*;
use state::*;

/// Untouched bytes after the message in every buffer and segment.
const PAD: usize = 3;

super::config::sim_faults!(
    /// Probability (parts per million) that a copy or a move fails with
    /// `AccessError`.
    pub copy_error_ppm: u32,
    /// Non-root (collective, rank) posts made inconsistent on purpose: a
    /// length off by one or another root (possibly the rank itself).
    pub inconsistent_posts: u32,
    /// The root of every collective dies before posting (nobody can
    /// complete `Ok`).
    pub kill_roots: bool,
);

/// Everything a run depends on.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimConfig {
    #[serde(flatten)]
    pub common: Common,
    pub design: Design,
    pub chunk_bytes: u64,
    pub staging_slots: u32,
    /// Root of every collective; `None`: uniform per collective.
    pub root: Option<Rank>,
    /// Message length of every collective; `None`: per collective 0 or 1
    /// (10% each), a multiple of `chunk_bytes` (15%), else uniform in
    /// `0..=max_len_bytes`.
    pub len_bytes: Option<u64>,
    pub max_len_bytes: u64,
    pub faults: Faults,
}

impl SimConfig {
    /// [`Common::staged`], flat, 16-byte chunks, 3 slots, random roots and
    /// lengths up to 100 bytes, no faults.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            common: Common::staged(seed),
            design: Design::Flat,
            chunk_bytes: 16,
            staging_slots: 3,
            root: None,
            len_bytes: None,
            max_len_bytes: 100,
            faults: Faults::default(),
        }
    }
}

/// Key material: a rank's buffer, or the segment it can read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SimKey {
    pub op: u32,
    pub rank: Rank,
    pub shared: bool,
}

/// Outcome of a successful run.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimReport {
    #[serde(flatten)]
    pub outcome: Outcome,
    /// Latest time a rank had the message in its own buffer: its
    /// completion, plus the host's copy out of the segment for
    /// `from_segment` completions.
    pub end_ns: Nanos,
    /// Latest completion emitted by an SP.
    pub sp_end_ns: Nanos,
    pub moves: u64,
    pub copies: u64,
    pub bytes_moved_inter_node: u64,
    pub bytes_moved_intra_node: u64,
    /// Sum over collectives of `len * (nodes - 1)`.
    pub min_inter_node_bytes: u64,
    /// Bytes copied by SPs (reads from roots, writes to buffers/segments).
    pub bytes_copied: u64,
    /// Instance counters summed (`max_slots_in_use`: the maximum).
    pub stats: Stats,
}

super::config::sim_config! {
    config: [design, chunk_bytes, staging_slots, root, len_bytes, max_len_bytes], [], [];
    report:
        [end_ns, sp_end_ns],
        [
            moves,
            copies,
            bytes_moved_inter_node,
            bytes_moved_intra_node,
            min_inter_node_bytes,
            bytes_copied,
        ],
        [stats],
        [];
}
super::config::world_schedule!();
