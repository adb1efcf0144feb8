//! What the simulators' modules share beyond the driver: their configs are
//! different types with the same driver fields (`seed`, `nodes`,
//! `ranks_per_node`, `sps_per_node`, `layout`, `max_inflight_reads`, `ops`,
//! `op_gap_ns`, `arrival_skew_ns`, `late_ranks`, `late_delay_ns`, `cost`,
//! `faults.{msg_jitter_ns, detect_delay_ns, sp_crashes, crash_window_ns,
//! rank_deaths, death_window_ns}`, `max_events`, `max_virtual_ns`), so
//! what reads those fields is a macro expanded in each simulator's module,
//! where `SimConfig`, `SimReport`, `Sim` and `SimFailure` are that
//! simulator's. What does not read them is a plain function.

use super::rng::Rng;
use crate::{CollKey, CommId};

/// In a simulator's module: `SimConfig::{world_size, sp_count, params}` and
/// `run` (which builds `Sim::new(cfg)`, runs its events, then
/// `final_checks` and `report`).
macro_rules! sim_config {
    () => {
        impl SimConfig {
            /// `nodes * ranks_per_node`.
            pub fn world_size(&self) -> u32 {
                self.nodes * self.ranks_per_node
            }

            /// `nodes * sps_per_node`.
            pub fn sp_count(&self) -> u32 {
                self.nodes * self.sps_per_node
            }

            /// The part of this config the driver needs.
            pub(crate) fn params(&self) -> $crate::sim::driver::Params {
                $crate::sim::driver::Params {
                    seed: self.seed,
                    nodes: self.nodes,
                    ranks_per_node: self.ranks_per_node,
                    sps_per_node: self.sps_per_node,
                    layout: self.layout,
                    max_inflight_reads: self.max_inflight_reads,
                    cost: self.cost,
                    msg_jitter_ns: self.faults.msg_jitter_ns,
                    detect_delay_ns: self.faults.detect_delay_ns,
                    max_events: self.max_events,
                    max_virtual_ns: self.max_virtual_ns,
                }
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
                core.schedule_world_posts(
                    setup,
                    self.ops,
                    self.op_gap_ns,
                    self.arrival_skew_ns,
                    (self.late_ranks, self.late_delay_ns),
                );
                self.schedule_faults(core, setup);
            }
        }
    };
}
pub(crate) use world_schedule;

/// The [`Collective`](super::driver::Collective) impl of a `Sim` whose
/// collectives are all on the world communicator, each an `Op` with
/// `disturbed` and per-rank `done`: a crash disturbs every collective, a
/// rank death those the rank had not completed; inputs go to
/// `Sim::process_input`.
macro_rules! world_collective {
    ($msg:ty, $copy:ty) => {
        impl $crate::sim::driver::Collective for Sim<'_> {
            type Msg = $msg;
            type Copy = $copy;

            fn core(&mut self) -> &mut $crate::sim::driver::Core<$msg, $copy> {
                &mut self.core
            }

            fn on_crash(&mut self, _sp: SpId) {
                for o in self.ops.iter_mut() {
                    o.disturbed = true;
                }
            }

            fn on_rank_death(&mut self, world: u32) {
                for o in self.ops.iter_mut() {
                    if o.done[world as usize].is_none() {
                        o.disturbed = true;
                    }
                }
            }

            fn process(
                &mut self,
                sp: SpId,
                input: $crate::sim::driver::Input<$msg, $copy>,
            ) -> Result<(), SimFailure> {
                self.process_input(sp, input)
            }

            fn over_budget(core: &$crate::sim::driver::Core<$msg, $copy>) -> SimFailure {
                core.fail("no termination within the event/time bound")
            }
        }
    };
}
pub(crate) use world_collective;

/// The key of the `i`th collective on the world communicator.
pub(crate) fn world_key(i: usize) -> CollKey {
    CollKey {
        job: 1,
        comm: CommId { leader: 0, id: 0 },
        seq: i as u64,
    }
}

/// A staged collective's length: `fixed`, else drawn from `setup`: 0 or 1
/// (10% each), `chunk` times `1..=max_chunks` (15%), else uniform in
/// `0..=max_len`.
pub(crate) fn draw_len(
    setup: &mut Rng,
    fixed: Option<u64>,
    chunk: u64,
    max_chunks: u64,
    max_len: u64,
) -> u64 {
    fixed.unwrap_or_else(|| {
        let pick = setup.below(100);
        if pick < 10 {
            0
        } else if pick < 20 {
            1
        } else if pick < 35 {
            chunk * setup.range(1, max_chunks)
        } else {
            setup.range(0, max_len)
        }
    })
}

/// In a simulator's `impl Sim`: `finish_input`, the end of every input of
/// SP `sp` at `now`: after the processing time, the actions of every
/// collective the input `touched` (`drain`), then the copies the SP's
/// limiter admits (`pump`).
macro_rules! finish_input {
    () => {
        fn finish_input(
            &mut self,
            sp: SpId,
            now: Nanos,
            touched: Vec<usize>,
        ) -> Result<(), SimFailure> {
            let out = now + self.cfg.cost.msg_proc_ns;
            for op in touched {
                self.drain(sp, op, out)?;
            }
            self.pump(sp, out)
        }
    };
}
pub(crate) use finish_input;
