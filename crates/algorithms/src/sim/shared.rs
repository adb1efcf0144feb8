//! What the simulators' modules share beyond the driver and the config
//! ([`super::config`]): macros expanded in each simulator's module, where
//! `Sim`, `Op` and `SimFailure` are that simulator's, and plain functions.

use serde::{Deserialize, Serialize};

use super::rng::Rng;
use crate::{CollKey, CommId, Rank};

/// Key material of the v-collectives' simulators (`allgatherv`,
/// `alltoallv`): which buffer of which rank of which collective (checked on
/// every copy, so a mixed-up instance is caught).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SimKey {
    pub op: u32,
    pub rank: Rank,
    pub send: bool,
}

impl SimKey {
    /// The send buffer of `rank` in collective `op`.
    pub(crate) fn send(op: usize, rank: Rank) -> SimKey {
        SimKey {
            op: op as u32,
            rank,
            send: true,
        }
    }

    /// The receive buffer of `rank` in collective `op`.
    pub(crate) fn recv(op: usize, rank: Rank) -> SimKey {
        SimKey {
            op: op as u32,
            rank,
            send: false,
        }
    }
}

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
