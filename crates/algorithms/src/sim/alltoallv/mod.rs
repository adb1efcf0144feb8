//! Deterministic simulation of ring `Ialltoallv` across a cluster of SPs.
//!
//! The simulator owns virtual time, an event queue, one
//! [`Alltoallv`](crate::alltoallv::Alltoallv) per (SP, collective) created on
//! the first event that concerns it, one [`CopyLimiter`] per SP, and real
//! (small) host buffers: every `Copy` really moves bytes, with bounds checks.
//! Checkers (all outside the algorithm):
//!
//! * every receive buffer matches a reference alltoallv computed from the
//!   send buffers, byte for byte, sentinel outside received blocks (ranks
//!   that completed with an error: every block is either right or untouched);
//! * each posted rank completes exactly once per instance, and only ranks
//!   that posted complete;
//! * no copy starts or finishes on a buffer whose rank already completed;
//! * the run ends within `max_events`/`max_virtual_ns`, and when the event
//!   queue drains every rank that can complete did (no deadlock); every
//!   instance on a live SP is `is_finished`;
//! * no `CopyLimiter` exceeds its bound; no `PostError`/`MsgError` occurs;
//! * fault-free collectives complete `Ok`; injected faults give the statuses
//!   they must give (count mismatch on both sides, copy errors on both
//!   sides, `PeerFailed`-type errors after an SP learned of a lost peer).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::driver::{self, Collective, Core};
use super::rng::{splitmix64, Rng};
pub use super::shared::SimKey;
use super::{sentinel, Common, Outcome, SimFailure};
pub use super::{CostModel, Layout};
use crate::alltoallv::{Action, Alltoallv, Config, Copy, Msg, Own, Post};

use crate::{CollKey, CommId, Nanos, Rank, SpId, Status};

mod events;
mod state;

use state::*;

super::config::sim_faults!(
    /// Number of (collective, dst, src) receive counts made wrong on purpose.
    pub count_mismatches: u32,
    /// Probability (parts per million) that a copy fails with `AccessError`.
    pub copy_error_ppm: u32,
);

/// Everything a run depends on; the run is a pure function of this.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimConfig {
    #[serde(flatten)]
    pub common: Common,
    /// Block sizes are uniform in `0..=max_block_bytes` ...
    pub max_block_bytes: u64,
    /// ... except that this share (percent) of blocks is forced to 0.
    pub zero_block_percent: u32,
    /// true: each rank posts collective i at `i * op_gap_ns` + skew, without
    /// waiting (several outstanding at once); false: back to back, a rank
    /// posts the next one a skew after its previous one completed.
    pub overlap_ops: bool,
    /// 0: every collective runs on the world communicator. k > 0: k random
    /// sub-communicators (random subset of world ranks, random comm-rank
    /// order); collective i runs on communicator `(i + 1) % (k + 1)` where
    /// 0 is the world.
    pub sub_comms: u32,
    pub faults: Faults,
}

impl SimConfig {
    /// [`Common::new`], tiny blocks (30% empty), overlapping collectives on
    /// the world communicator, no faults.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            common: Common::new(seed),
            max_block_bytes: 64,
            zero_block_percent: 30,
            overlap_ops: true,
            sub_comms: 0,
            faults: Faults::default(),
        }
    }
}

/// Outcome of one collective.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpReport {
    pub key: CollKey,
    /// comm rank -> world rank.
    pub world_ranks: Vec<u32>,
    /// Virtual time each comm rank posted (None: never).
    pub post_ns: Vec<Option<Nanos>>,
    /// Virtual time each comm rank completed (None: never).
    pub completion_ns: Vec<Option<Nanos>>,
    pub status: Vec<Option<Status>>,
    /// Last completion of this collective.
    pub done_ns: Option<Nanos>,
}

/// Outcome of a successful (all checks passed) run.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimReport {
    #[serde(flatten)]
    pub outcome: Outcome,
    pub ops: Vec<OpReport>,
    /// Last completion over all collectives.
    pub end_ns: Nanos,
    pub copies: u64,
    pub bytes_copied_intra_node: u64,
    pub bytes_copied_inter_node: u64,
    /// Announcements that arrived before their destination rank posted.
    pub late_announcements: u64,
}

super::config::sim_config! {
    config: [max_block_bytes, zero_block_percent], [overlap_ops], [sub_comms];
    report:
        [ops, end_ns],
        [copies, bytes_copied_intra_node, bytes_copied_inter_node],
        [late_announcements],
        [];
}
