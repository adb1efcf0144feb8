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
use super::{sentinel, SimFailure};
pub use super::{CostModel, Layout};
use crate::alltoallv::{Action, Alltoallv, Config, Copy, Msg, Post};

use crate::{CollKey, CommId, Nanos, Rank, SpId, Status};

mod events;
mod state;

use state::*;

/// Injected faults (all off by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Faults {
    /// Each message is delayed by an extra uniform `0..=msg_jitter_ns`
    /// (this reorders messages between a pair of SPs).
    pub msg_jitter_ns: Nanos,
    /// Number of SPs that crash (at least one SP always survives).
    pub sp_crashes: u32,
    /// Crashes happen at uniform times in `0..=crash_window_ns`.
    pub crash_window_ns: Nanos,
    /// Every other SP learns of a crash after `detect_delay_ns` plus a
    /// uniform `0..=detect_delay_ns`; messages from the crashed SP that
    /// arrive later are dropped.
    pub detect_delay_ns: Nanos,
    /// Number of host ranks that die; their SP gets `handle_rank_lost` for
    /// every collective the rank belongs to.
    pub rank_deaths: u32,
    /// Deaths happen at uniform times in `0..=death_window_ns`.
    pub death_window_ns: Nanos,
    /// Number of (collective, dst, src) receive counts made wrong on purpose.
    pub count_mismatches: u32,
    /// Probability (parts per million) that a copy fails with `AccessError`.
    pub copy_error_ppm: u32,
}

/// Everything a run depends on; the run is a pure function of this.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimConfig {
    pub seed: u64,
    pub nodes: u32,
    pub ranks_per_node: u32,
    /// SP of a rank = node * sps_per_node + local_rank % sps_per_node.
    pub sps_per_node: u32,
    pub layout: Layout,
    /// Copies in flight per SP (CopyLimiter bound; 0 is clamped to 1).
    pub max_inflight_reads: usize,
    /// Block sizes are uniform in `0..=max_block_bytes` ...
    pub max_block_bytes: u64,
    /// ... except that this share (percent) of blocks is forced to 0.
    pub zero_block_percent: u32,
    /// Number of collectives.
    pub ops: u32,
    /// true: each rank posts collective i at `i * op_gap_ns` + skew, without
    /// waiting (several outstanding at once); false: back to back, a rank
    /// posts the next one a skew after its previous one completed.
    pub overlap_ops: bool,
    pub op_gap_ns: Nanos,
    /// 0: every collective runs on the world communicator. k > 0: k random
    /// sub-communicators (random subset of world ranks, random comm-rank
    /// order); collective i runs on communicator `(i + 1) % (k + 1)` where
    /// 0 is the world.
    pub sub_comms: u32,
    /// Each post happens a uniform `0..=arrival_skew_ns` late.
    pub arrival_skew_ns: Nanos,
    /// Number of world ranks that are always `late_delay_ns` later.
    pub late_ranks: u32,
    pub late_delay_ns: Nanos,
    pub cost: CostModel,
    pub faults: Faults,
    /// The run fails if it processes more events than this ...
    pub max_events: u64,
    /// ... or virtual time passes this.
    pub max_virtual_ns: Nanos,
}

impl SimConfig {
    /// 8 nodes x 32 ranks, 4 SPs per node, block layout, tiny blocks, one
    /// collective, no faults.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            nodes: 8,
            ranks_per_node: 32,
            sps_per_node: 4,
            layout: Layout::Block,
            max_inflight_reads: 4,
            max_block_bytes: 64,
            zero_block_percent: 30,
            ops: 1,
            overlap_ops: true,
            op_gap_ns: 0,
            sub_comms: 0,
            arrival_skew_ns: 20_000,
            late_ranks: 4,
            late_delay_ns: 100_000,
            cost: CostModel::default(),
            faults: Faults::default(),
            max_events: 100_000_000,
            max_virtual_ns: 100_000_000_000,
        }
    }
}

/// Key material in the simulation: which buffer of which rank of which
/// collective (checked on every copy, so a mixed-up instance is caught).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SimKey {
    pub op: u32,
    pub rank: Rank,
    pub send: bool,
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
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimReport {
    pub seed: u64,
    pub world_size: u32,
    pub sps: u32,
    pub ops: Vec<OpReport>,
    /// Last completion over all collectives.
    pub end_ns: Nanos,
    pub events: u64,
    /// SP-to-SP messages sent (deliveries inside one SP are not messages).
    pub messages: u64,
    pub copies: u64,
    pub bytes_copied_intra_node: u64,
    pub bytes_copied_inter_node: u64,
    /// Highest number of copies in flight observed on any SP.
    pub max_in_flight: usize,
    /// Announcements that arrived before their destination rank posted.
    pub late_announcements: u64,
    /// Completions with a status other than `Ok`.
    pub error_completions: u64,
    pub crashed_sps: Vec<SpId>,
    pub dead_ranks: Vec<u32>,
}

super::shared::sim_config!();
