//! What every simulator's configuration and report have: [`Common`] (the
//! cluster, the posts' schedule, the cost model, the run's bounds), embedded
//! in each `SimConfig`, the faults the driver injects, declared once in each
//! simulator's `Faults` by [`sim_faults!`], and [`Outcome`] (what every
//! run reports), embedded in each `SimReport`. Also the placement and cost
//! types [`Common`] holds.

use std::fmt::{self, Debug};

use serde::{Deserialize, Serialize};

use crate::{Nanos, SpId};

/// Placement of world ranks on nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Layout {
    /// node = rank / ranks_per_node.
    Block,
    /// node = rank % nodes.
    Cyclic,
}

/// Virtual-time costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CostModel {
    /// One-way latency of a message between SPs on different nodes.
    pub inter_node_latency_ns: Nanos,
    /// One-way latency of a message between SPs of the same node.
    pub intra_node_latency_ns: Nanos,
    /// SP time spent on each input (post, message, copy completion, ...).
    pub msg_proc_ns: Nanos,
    /// Fixed cost of a copy whose source is on another node.
    pub copy_fixed_inter_ns: Nanos,
    /// Fixed cost of a copy within a node.
    pub copy_fixed_intra_ns: Nanos,
    /// Bandwidth between nodes (bytes per ns, at least 1), for copies and
    /// for messages (each directed node-to-node link sends one message at a
    /// time; copies do not contend with each other).
    pub inter_node_bytes_per_ns: u64,
    /// Bandwidth within a node (bytes per ns, at least 1), likewise.
    pub intra_node_bytes_per_ns: u64,
    /// Wire size of a message on top of its fields (CollKey, framing).
    pub msg_header_bytes: u64,
    /// Time from a rank's call to its SP taking the post (the host-to-SP
    /// hop; 0 by default: the post reaches the SP's inbox at the call).
    #[serde(default)]
    pub post_ns: Nanos,
    /// Bytes each byte of a simulated buffer stands for in the cost of
    /// copies and bulk transfers (1 by default). The simulators keep real
    /// buffers and check every byte; a weight above 1 prices large blocks
    /// while the buffers stay small.
    #[serde(default = "one")]
    pub byte_weight: u64,
}

fn one() -> u64 {
    1
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            inter_node_latency_ns: 1_500,
            intra_node_latency_ns: 200,
            msg_proc_ns: 100,
            copy_fixed_inter_ns: 2_000,
            copy_fixed_intra_ns: 400,
            inter_node_bytes_per_ns: 12,
            intra_node_bytes_per_ns: 48,
            msg_header_bytes: 32,
            post_ns: 0,
            byte_weight: 1,
        }
    }
}

/// The parameters every simulator has. Each simulator's `SimConfig` embeds
/// one as `common` and reads as it (`cfg.nodes`, `cfg.world_size()`)
/// through `Deref`; its `Debug` shows these fields as the config's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Common {
    pub seed: u64,
    pub nodes: u32,
    pub ranks_per_node: u32,
    /// SP of a rank = node * sps_per_node + local_rank % sps_per_node.
    pub sps_per_node: u32,
    pub layout: Layout,
    /// Copies in flight per SP (CopyLimiter bound; 0 is clamped to 1).
    pub max_inflight_reads: usize,
    /// Collectives, each posted at `i * op_gap_ns` + skew by every rank.
    pub ops: u32,
    pub op_gap_ns: Nanos,
    /// Each post happens a uniform `0..=arrival_skew_ns` late.
    pub arrival_skew_ns: Nanos,
    /// World ranks that are always `late_delay_ns` later.
    pub late_ranks: u32,
    pub late_delay_ns: Nanos,
    pub cost: CostModel,
    /// The run fails if it processes more events than this ...
    pub max_events: u64,
    /// ... or virtual time passes this.
    pub max_virtual_ns: Nanos,
}

/// Network faults of their own (all off by default), for simulators whose
/// collective uses the multicast fabric or wants the SP-to-SP channel
/// disturbed: the driver's `Core::set_net` takes them. Datagrams (see
/// `Core::multicast`) may be lost, duplicated or reordered and are dropped
/// when the receiving SP's staging is full (a receiver-not-ready drop); the
/// SP-to-SP channel (a reliable, TCP-like stream) may be partitioned for a
/// while: what is sent across the cut during the partition arrives after
/// it heals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetFaults {
    /// Each datagram is lost with this probability (parts per million).
    pub loss_ppm: u32,
    /// Each datagram that is not lost arrives twice with this probability
    /// (parts per million).
    pub dup_ppm: u32,
    /// Each datagram (each copy of a duplicate) is delayed by an extra
    /// uniform `0..=reorder_ns` (this reorders datagrams).
    pub reorder_ns: Nanos,
    /// Datagrams an SP's receive staging holds (0: unbounded); one that
    /// arrives when it is full is dropped (receiver not ready).
    pub rx_staging: u32,
    /// Time a receive worker takes per datagram (staging to the buffers);
    /// the SP's worker takes them one at a time.
    pub rx_drain_ns: Nanos,
    /// A partition of the SP-to-SP channel between nodes below
    /// `partition_cut` and the others, from `partition_from_ns` until
    /// `partition_heal_ns` (off when the heal is not after the start).
    pub partition_cut: u32,
    pub partition_from_ns: Nanos,
    pub partition_heal_ns: Nanos,
}

impl NetFaults {
    /// When something leaving node `a` for node `b` at `t` can go: at `t`,
    /// or when the partition heals if it separates them at `t`.
    pub fn departure(&self, (a, b): (u32, u32), t: Nanos) -> Nanos {
        let cut = self.partition_cut;
        let active = self.partition_from_ns <= t && t < self.partition_heal_ns;
        if active && ((a < cut) != (b < cut)) {
            self.partition_heal_ns
        } else {
            t
        }
    }
}

/// What every simulator's report has. Each simulator's `SimReport` embeds
/// one as `outcome` and reads as it (`r.events`) through `Deref`; its
/// `Debug` shows these fields as the report's own.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    pub seed: u64,
    pub world_size: u32,
    pub sps: u32,
    pub events: u64,
    /// SP-to-SP messages sent (deliveries inside one SP are not messages).
    pub messages: u64,
    /// Highest number of copies in flight observed on any SP.
    pub max_in_flight: usize,
    /// Completions with a status other than `Ok`.
    pub error_completions: u64,
    pub crashed_sps: Vec<SpId>,
    pub dead_ranks: Vec<u32>,
}

/// A config's or a report's own fields shown with `Debug`, by name.
pub(crate) type Fields<'a> = &'a [(&'static str, &'a dyn Debug)];

/// Writes `name { .. }` with `Debug`, the fields of `parts` in turn, as
/// `#[derive(Debug)]` on a struct with those fields would.
fn debug_flat(f: &mut fmt::Formatter<'_>, name: &str, parts: &[Fields<'_>]) -> fmt::Result {
    let mut d = f.debug_struct(name);
    for (name, value) in parts.iter().copied().flatten() {
        d.field(name, value);
    }
    d.finish()
}

impl Outcome {
    /// Writes a simulator's `SimReport` with `Debug` as if these fields
    /// were its own: its fields `[own, after_messages, after_in_flight,
    /// after_errors]` after `sps`, `messages`, `max_in_flight` and
    /// `error_completions` (the order the reports have always shown).
    pub(crate) fn fmt_report(
        &self,
        f: &mut fmt::Formatter<'_>,
        [own, after_messages, after_in_flight, after_errors]: [Fields<'_>; 4],
    ) -> fmt::Result {
        debug_flat(
            f,
            "SimReport",
            &[
                &[
                    ("seed", &self.seed),
                    ("world_size", &self.world_size),
                    ("sps", &self.sps),
                ],
                own,
                &[("events", &self.events), ("messages", &self.messages)],
                after_messages,
                &[("max_in_flight", &self.max_in_flight)],
                after_in_flight,
                &[("error_completions", &self.error_completions)],
                after_errors,
                &[
                    ("crashed_sps", &self.crashed_sps),
                    ("dead_ranks", &self.dead_ranks),
                ],
            ],
        )
    }
}

impl Common {
    /// 8 nodes x 32 ranks, 4 SPs per node, block layout, 4 copies in flight
    /// per SP, one collective, 20 us skew, 4 ranks 100 us late, the default
    /// costs, bounds of 10^8 events and 100 s.
    pub fn new(seed: u64) -> Common {
        Common {
            seed,
            nodes: 8,
            ranks_per_node: 32,
            sps_per_node: 4,
            layout: Layout::Block,
            max_inflight_reads: 4,
            ops: 1,
            op_gap_ns: 0,
            arrival_skew_ns: 20_000,
            late_ranks: 4,
            late_delay_ns: 100_000,
            cost: CostModel::default(),
            max_events: 100_000_000,
            max_virtual_ns: 100_000_000_000,
        }
    }

    /// [`Common::new`] scaled down for the staged simulators: 4 nodes x 8
    /// ranks, 2 SPs per node, two collectives 2 us apart, 2 late ranks.
    pub fn staged(seed: u64) -> Common {
        Common {
            nodes: 4,
            ranks_per_node: 8,
            sps_per_node: 2,
            ops: 2,
            op_gap_ns: 2_000,
            late_ranks: 2,
            ..Common::new(seed)
        }
    }

    /// `nodes * ranks_per_node`.
    pub fn world_size(&self) -> u32 {
        self.nodes * self.ranks_per_node
    }

    /// `nodes * sps_per_node`.
    pub fn sp_count(&self) -> u32 {
        self.nodes * self.sps_per_node
    }

    /// Writes a simulator's `SimConfig` with `Debug` as if these fields were
    /// its own: its fields `[own, after_ops, after_gap, after_cost]` after
    /// `max_inflight_reads`, `ops`, `op_gap_ns` and `cost` (the order the
    /// reports have always shown).
    pub(crate) fn fmt_config(
        &self,
        f: &mut fmt::Formatter<'_>,
        [own, after_ops, after_gap, after_cost]: [Fields<'_>; 4],
    ) -> fmt::Result {
        debug_flat(
            f,
            "SimConfig",
            &[
                &[
                    ("seed", &self.seed),
                    ("nodes", &self.nodes),
                    ("ranks_per_node", &self.ranks_per_node),
                    ("sps_per_node", &self.sps_per_node),
                    ("layout", &self.layout),
                    ("max_inflight_reads", &self.max_inflight_reads),
                ],
                own,
                &[("ops", &self.ops)],
                after_ops,
                &[("op_gap_ns", &self.op_gap_ns)],
                after_gap,
                &[
                    ("arrival_skew_ns", &self.arrival_skew_ns),
                    ("late_ranks", &self.late_ranks),
                    ("late_delay_ns", &self.late_delay_ns),
                    ("cost", &self.cost),
                ],
                after_cost,
                &[
                    ("max_events", &self.max_events),
                    ("max_virtual_ns", &self.max_virtual_ns),
                ],
            ],
        )
    }
}

/// Declares a simulator's `Faults` (all off by default): the faults the
/// driver injects (message jitter, SP crashes and their detection, host
/// rank deaths), then the simulator's own fields given. Declared rather than
/// embedded so that each `Faults` keeps its fields flat (`Faults {
/// msg_jitter_ns: 1_000, ..Faults::default() }`).
macro_rules! sim_faults {
    ($($(#[$doc:meta])* pub $field:ident: $ty:ty,)*) => {
        /// Injected faults (all off by default).
        #[derive(
            Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize,
        )]
        pub struct Faults {
            /// Each message is delayed by an extra uniform
            /// `0..=msg_jitter_ns` (this reorders messages between a pair of
            /// SPs).
            pub msg_jitter_ns: $crate::Nanos,
            /// SPs that crash (at least one SP always survives) at uniform
            /// times in `0..=crash_window_ns`.
            pub sp_crashes: u32,
            pub crash_window_ns: $crate::Nanos,
            /// Every other SP learns of a crash after `detect_delay_ns` plus
            /// a uniform `0..=detect_delay_ns`; messages from the crashed SP
            /// that arrive later are dropped.
            pub detect_delay_ns: $crate::Nanos,
            /// Host ranks that die at uniform times in `0..=death_window_ns`;
            /// their SP gets `handle_rank_lost`.
            pub rank_deaths: u32,
            pub death_window_ns: $crate::Nanos,
            $($(#[$doc])* pub $field: $ty,)*
        }
    };
}
pub(crate) use sim_faults;

/// In a simulator's module, whose `SimConfig` embeds [`Common`] as `common`
/// and has `faults`, and whose `SimReport` embeds [`Outcome`] as `outcome`:
/// `SimConfig` and `SimReport` read as what they embed (`Deref`) and show
/// with `Debug` as flat structs (their own fields, given in lists, placed as
/// [`Common::fmt_config`] and [`Outcome::fmt_report`] say, `faults` last),
/// `SimConfig::core` (the driver's [`Core`](super::driver::Core) for it),
/// `SimConfig::schedule_faults` (SP crashes and rank deaths, drawn from
/// `setup` after everything else), and `run` (which builds `Sim::new(cfg)`,
/// runs its events, then `final_checks` and `report`).
macro_rules! sim_config {
    (
        config: $([$($config:ident),* $(,)?]),*;
        report: $([$($report:ident),* $(,)?]),*;
    ) => {
        $crate::sim::config::embeds!(
            SimConfig.common: $crate::sim::Common => fmt_config($([$($config),*],)* [faults]);
            SimReport.outcome: $crate::sim::Outcome => fmt_report($([$($report),*]),*);
        );

        impl SimConfig {
            /// The driver's core for this config, and the setup generator.
            pub(crate) fn core<M, C>(
                &self,
            ) -> Result<($crate::sim::driver::Core<M, C>, $crate::sim::rng::Rng), SimFailure> {
                $crate::sim::driver::Core::new(
                    self.common,
                    (self.faults.msg_jitter_ns, self.faults.detect_delay_ns),
                )
            }

            /// Schedules the faults (SP crashes, rank deaths), drawn from
            /// `setup` after everything else.
            pub(crate) fn schedule_faults<M, C>(
                &self,
                core: &mut $crate::sim::driver::Core<M, C>,
                setup: &mut $crate::sim::rng::Rng,
            ) {
                let f = &self.faults;
                core.schedule_faults(
                    setup,
                    (f.sp_crashes, f.crash_window_ns),
                    (f.rank_deaths, f.death_window_ns),
                );
            }
        }

        /// Run one simulation; `Err` carries the seed and what went wrong.
        pub fn run(cfg: &SimConfig) -> Result<SimReport, SimFailure> {
            let mut sim = Sim::new(cfg)?;
            $crate::sim::driver::run_events(&mut sim)?;
            sim.final_checks()?;
            Ok(sim.report())
        }
    };
}
pub(crate) use sim_config;

/// In a simulator whose collectives are all on the world communicator:
/// `SimConfig::schedule_world`, the posts of every rank (`ops` collectives
/// `op_gap_ns` apart, skew, late ranks) and then the faults.
macro_rules! world_schedule {
    () => {
        impl SimConfig {
            /// Schedules every rank's posts, then the faults.
            pub(crate) fn schedule_world<M, C>(
                &self,
                core: &mut $crate::sim::driver::Core<M, C>,
                setup: &mut $crate::sim::rng::Rng,
            ) {
                core.schedule_world_posts(setup);
                self.schedule_faults(core, setup);
            }
        }
    };
}
pub(crate) use world_schedule;

/// Each `$ty`, which embeds a `$common` as `$field`, reads as it (`Deref`,
/// `DerefMut`) and shows with `Debug` as one flat struct: `$common::$fmt`
/// places `$ty`'s own fields, given in lists, among its own.
macro_rules! embeds {
    ($($ty:ident.$field:ident: $common:ty => $fmt:ident($([$($own:ident),*]),*);)*) => {$(
        impl std::ops::Deref for $ty {
            type Target = $common;

            fn deref(&self) -> &$common {
                &self.$field
            }
        }

        impl std::ops::DerefMut for $ty {
            fn deref_mut(&mut self) -> &mut $common {
                &mut self.$field
            }
        }

        impl std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.$field.$fmt(
                    f,
                    [$(&[$((stringify!($own), &self.$own as &dyn std::fmt::Debug)),*]),*],
                )
            }
        }
    )*};
}
pub(crate) use embeds;
