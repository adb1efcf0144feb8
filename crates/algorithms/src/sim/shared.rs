//! What the simulators' modules share beyond the driver and the config
//! ([`super::config`]): macros expanded in each simulator's module, where
//! `Sim`, `Op` and `SimFailure` are that simulator's, and plain functions.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::driver::Core;
use super::rng::Rng;
use super::SimFailure;
use crate::{CollKey, CommId, Nanos, Rank, SpId};

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

/// What every simulator asks of its collective's instance beyond the
/// inputs it handles itself: messages (a rejection fails the run) and its
/// state, for a deadlock report.
pub(crate) trait Instance {
    type Msg: fmt::Debug;
    type Error: fmt::Display;
    fn handle_msg(&mut self, now: Nanos, from: SpId, msg: Self::Msg) -> Result<(), Self::Error>;
    /// Abort status, work in flight and counters, in one line.
    fn describe(&self) -> String;
}

/// `impl Instance for crate::$m::$machine<K>`: its `handle_msg` (the
/// module's `Msg`, generic or not, and `MsgError`), and `describe`, `$text`
/// of what its methods `$part` return (for a `staged` machine: its abort
/// status, copies in flight, slots in use and counters).
macro_rules! instance {
    ($m:ident::$machine:ident, Msg$(<$k:ident>)?, $text:literal, [$($part:ident),*]) => {
        impl<K: Clone + fmt::Debug + PartialEq> Instance for crate::$m::$machine<K> {
            type Msg = crate::$m::Msg$(<$k>)?;
            type Error = crate::$m::MsgError;
            fn handle_msg(
                &mut self,
                now: Nanos,
                from: SpId,
                msg: Self::Msg,
            ) -> Result<(), Self::Error> {
                crate::$m::$machine::handle_msg(self, now, from, msg)
            }
            fn describe(&self) -> String {
                format!($text, $(self.$part()),*)
            }
        }
    };
    ($m:ident::$machine:ident, Msg$(<$k:ident>)?, staged) => {
        instance!($m::$machine, Msg$(<$k>)?, "abort={:?} in_flight={} slots={} stats={:?}",
            [abort_status, copies_in_flight, slots_in_use, stats]);
    };
}

instance!(
    allgatherv::Allgatherv,
    Msg<K>,
    "abort={:?} copies={} parked={} stats={:?}",
    [abort_status, copies_in_flight, parked, stats]
);
instance!(
    alltoallv::Alltoallv,
    Msg<K>,
    "abort={:?} copies_in_flight={} stats={:?}",
    [abort_status, copies_in_flight, stats]
);
instance!(bcast::Bcast, Msg, staged);
instance!(
    mcast_bcast::McastBcast,
    Msg<K>,
    "abort={:?} in_flight={} has_all={} ring={:?} stats={:?}",
    [abort_status, copies_in_flight, has_all, ring, stats]
);
instance!(staged_allgather::StagedAllgather, Msg<K>, staged);

/// No copy `id` of collective `op` starts or finishes (`when`) on a buffer
/// of a rank that completed: `bufs`, its two buffers (rank and kind);
/// `done`, the completions of the collective's ranks.
pub(crate) fn check_buffers_open<M, C>(
    core: &Core<M, C>,
    (op, id): (usize, u64),
    bufs: [(Rank, &str); 2],
    done: &[Option<(Nanos, crate::Status)>],
    when: &str,
) -> Result<(), SimFailure> {
    for (rank, what) in bufs {
        if let Some((t, _)) = done[rank as usize] {
            return Err(core.fail(format!(
                "op {op}: copy {id} {when} on the {what} buffer of rank {rank}, completed at {t}ns"
            )));
        }
    }
    Ok(())
}

/// Hands `msg` from SP `from` at `now` to `inst`, the instance of
/// collective `op` on SP `sp`; `Err`: its rejection, described (the run
/// fails with it).
pub(crate) fn deliver<I: Instance>(
    inst: &mut I,
    now: Nanos,
    (op, sp, from): (usize, SpId, SpId),
    msg: I::Msg,
) -> Result<(), String> {
    let shown = format!("{msg:?}");
    inst.handle_msg(now, from, msg)
        .map_err(|e| format!("op {op}: SP {sp} rejected {shown} from SP {from}: {e}"))
}

/// Rank `who` (on SP `sp`) of collective `i` at the end of the run: its
/// completion `done`, `None` if none was due (`exempt`: e.g. its SP
/// crashed), or a deadlock failure naming the instance's state.
pub(crate) fn due_completion<M, C, D, I: Instance>(
    core: &Core<M, C>,
    inst: &BTreeMap<(SpId, usize), I>,
    (i, sp): (usize, SpId),
    who: impl fmt::Display,
    (done, exempt): (Option<D>, bool),
    post_ns: Option<Nanos>,
) -> Result<Option<D>, SimFailure> {
    match done {
        Some(d) => Ok(Some(d)),
        None if exempt => Ok(None),
        None => Err(core.fail(format!(
            "{who} never completed (posted {post_ns:?}; instance: {}) -- deadlock",
            inst.get(&(sp, i)).map_or("none".into(), |a| a.describe())
        ))),
    }
}
