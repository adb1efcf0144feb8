//! What the two staged simulators (`bcast`, `staged_allgather`) share:
//! the record of a rank's completion, and the checks of completions and
//! instances that do not depend on the collective.

use std::collections::{BTreeMap, BTreeSet};

use super::driver::Core;
use super::shared::{due_completion, Instance};
use super::SimFailure;
use crate::bcast::Bcast;
use crate::staged_allgather::StagedAllgather;
use crate::{Nanos, Rank, SpId, Status};

/// A rank's completion as the simulator recorded it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Done {
    pub(crate) at: Nanos,
    pub(crate) status: Status,
    pub(crate) from_segment: bool,
    /// When the data are in the rank's own buffer.
    pub(crate) host_at: Nanos,
}

/// Whether a copy or move of chunk `index`, `len` bytes, has the shape of
/// one of the `n` chunks of `chunk` bytes of a collective: not empty, not
/// longer than a chunk, and (unless the posts were inconsistent, when the
/// SPs may disagree on `n`) in range.
pub(crate) fn chunk_fits((len, index): (u64, u64), chunk: u64, n: u64, inconsistent: bool) -> bool {
    len > 0 && len <= chunk && (inconsistent || index < n)
}

/// What both staged simulators record of each collective besides their
/// own: the staging shadows of every SP (`D` a slot's contents), every
/// rank's post and completion, whether a fault touched it, and the bytes
/// it wrote across nodes and within them. A simulator's `Op` embeds one
/// and reads as it (`o.done`) through `Deref`.
pub(crate) struct OpRecord<D> {
    pub(crate) staging: BTreeMap<SpId, Vec<Shadow<D>>>,
    pub(crate) post_ns: Vec<Option<Nanos>>,
    pub(crate) done: Vec<Option<Done>>,
    pub(crate) disturbed: bool,
    /// SPs that learned of a fault touching this collective.
    pub(crate) notified: BTreeSet<SpId>,
    pub(crate) bytes_inter: u64,
    pub(crate) bytes_intra: u64,
}

impl<D> OpRecord<D> {
    /// Nothing posted, staged or written yet, for `p` ranks.
    pub(crate) fn new(p: usize) -> OpRecord<D> {
        OpRecord {
            staging: BTreeMap::new(),
            post_ns: vec![None; p],
            done: vec![None; p],
            disturbed: false,
            notified: BTreeSet::new(),
            bytes_inter: 0,
            bytes_intra: 0,
        }
    }

    /// `len` bytes written across nodes (`inter`) or within one.
    pub(crate) fn count_bytes(&mut self, inter: bool, len: u64) {
        if inter {
            self.bytes_inter += len;
        } else {
            self.bytes_intra += len;
        }
    }
}

/// `Deref` of a simulator's `Op` to its [`OpRecord`] field `rec`.
macro_rules! op_record_deref {
    ($data:ty) => {
        impl std::ops::Deref for Op {
            type Target = $crate::sim::staged_common::OpRecord<$data>;
            fn deref(&self) -> &Self::Target {
                &self.rec
            }
        }

        impl std::ops::DerefMut for Op {
            fn deref_mut(&mut self) -> &mut Self::Target {
                &mut self.rec
            }
        }
    };
}
pub(crate) use op_record_deref;

/// What the checks ask of a staged instance.
pub(crate) trait StagedInstance {
    fn abort_status(&self) -> Option<Status>;
    fn copies_in_flight(&self) -> usize;
    fn slots_in_use(&self) -> usize;
    fn max_slots_in_use(&self) -> u32;
    /// It learned its members (a local rank posted, or a peer told it).
    fn has_members(&self) -> bool;
    fn is_finished(&self) -> bool;
}

macro_rules! staged_instance {
    ($machine:ident) => {
        impl<K: Clone + std::fmt::Debug + PartialEq> StagedInstance for $machine<K> {
            fn abort_status(&self) -> Option<Status> {
                $machine::abort_status(self)
            }
            fn copies_in_flight(&self) -> usize {
                $machine::copies_in_flight(self)
            }
            fn slots_in_use(&self) -> usize {
                $machine::slots_in_use(self)
            }
            fn max_slots_in_use(&self) -> u32 {
                self.stats().max_slots_in_use
            }
            fn has_members(&self) -> bool {
                self.members().is_some()
            }
            fn is_finished(&self) -> bool {
                $machine::is_finished(self)
            }
        }
    };
}
staged_instance!(Bcast);
staged_instance!(StagedAllgather);

/// Checks a completion of `rank` of collective `op` by SP `sp` against what
/// the simulator recorded for the rank (`post_ns`, `done`) and whether `sp`
/// learned of a fault touching the collective (`notified`).
pub(crate) fn check_completion<M, C>(
    core: &Core<M, C>,
    at: (usize, SpId, Rank),
    status: Status,
    post_ns: Option<Nanos>,
    done: Option<Done>,
    notified: bool,
) -> Result<(), SimFailure> {
    let before = done.map(|d| (d.at, d.status));
    core.check_completion(at, status, post_ns.is_some(), before, notified)
}

/// A completion of a collective no fault touched: `Ok`, and from the
/// segment exactly when `seg`.
fn check_clean_completion<M, C>(
    core: &Core<M, C>,
    (i, r): (usize, usize),
    d: Done,
    seg: bool,
) -> Result<(), SimFailure> {
    if !d.status.is_ok() || d.from_segment != seg {
        return Err(core.fail(format!(
            "op {i} rank {r}: {} (from_segment {}) without a fault",
            d.status, d.from_segment
        )));
    }
    Ok(())
}

/// Rank `r` of collective `i` at the end of a staged run: its completion,
/// `None` if none was due (its SP crashed or it never posted), or a
/// deadlock failure ([`due_completion`]); with `clean: Some(seg)` (no fault
/// touched the collective) also [`check_clean_completion`].
pub(crate) fn due_rank<M, C, I: Instance>(
    core: &Core<M, C>,
    inst: &BTreeMap<(SpId, usize), I>,
    crashed: &BTreeSet<SpId>,
    (i, r): (usize, usize),
    (done, post_ns): (Option<Done>, Option<Nanos>),
    clean: Option<bool>,
) -> Result<Option<Done>, SimFailure> {
    let sp = core.rank_sp[r];
    let exempt = crashed.contains(&sp) || post_ns.is_none();
    let who = format_args!("op {i} rank {r} (SP {sp})");
    let due = due_completion(core, inst, (i, sp), who, (done, exempt), post_ns)?;
    if let (Some(d), Some(seg)) = (due, clean) {
        check_clean_completion(core, (i, r), d, seg)?;
    }
    Ok(due)
}

/// Every instance of a live SP at the end: within `staging_slots` (at
/// least 1), and finished if it learned its members.
pub(crate) fn check_instances_at_end<M, C, I: StagedInstance>(
    core: &Core<M, C>,
    inst: &BTreeMap<(SpId, usize), I>,
    crashed: &BTreeSet<SpId>,
    staging_slots: u32,
) -> Result<(), SimFailure> {
    for (&(sp, op), a) in inst {
        if crashed.contains(&sp) {
            continue;
        }
        if a.max_slots_in_use() > staging_slots.max(1) {
            return Err(core.fail(format!(
                "op {op}: SP {sp} used {} staging slots",
                a.max_slots_in_use()
            )));
        }
        if a.has_members() && !a.is_finished() {
            return Err(core.fail(format!(
                "op {op}: instance on live SP {sp} not finished at the end (abort={:?}, in flight {}, slots {})",
                a.abort_status(),
                a.copies_in_flight(),
                a.slots_in_use()
            )));
        }
    }
    Ok(())
}

/// Over every recorded completion: the latest time a rank had the data in
/// its own buffer, the latest completion by an SP, and the completions
/// that were not `Ok`.
pub(crate) fn completion_summary<'a>(
    done: impl Iterator<Item = &'a Done> + Clone,
) -> (Nanos, Nanos, u64) {
    (
        done.clone().map(|d| d.host_at).max().unwrap_or(0),
        done.clone().map(|d| d.at).max().unwrap_or(0),
        done.filter(|d| !d.status.is_ok()).count() as u64,
    )
}

/// A staging slot as the simulator sees it: its contents and the copies or
/// moves in flight on it.
#[derive(Clone, Debug)]
pub(crate) struct Shadow<D> {
    pub(crate) data: D,
    pub(crate) readers: u32,
    pub(crate) writers: u32,
}

impl<D> Shadow<D> {
    pub(crate) fn new(data: D) -> Shadow<D> {
        Shadow {
            data,
            readers: 0,
            writers: 0,
        }
    }

    /// A read out of the slot ended: its contents.
    pub(crate) fn end_read(&mut self) -> &D {
        self.readers -= 1;
        &self.data
    }

    /// The fill of the slot ended (or will never land): its contents.
    pub(crate) fn end_write(&mut self) -> &mut D {
        self.writers = 0;
        &mut self.data
    }

    /// Starts filling the slot; nothing else may be in flight on it (else
    /// `Err((readers, writers))`).
    pub(crate) fn begin_write(&mut self) -> Result<(), (u32, u32)> {
        if self.readers > 0 || self.writers > 0 {
            return Err((self.readers, self.writers));
        }
        self.writers = 1;
        Ok(())
    }

    /// Starts reading the slot; no write may be in flight on it (else
    /// `false`).
    pub(crate) fn begin_read(&mut self) -> bool {
        if self.writers > 0 {
            return false;
        }
        self.readers += 1;
        true
    }
}

/// In a staged simulator's `impl Sim`: `fail`, `instance` (the `$machine`
/// of SP `sp` in collective `op`, made on first use), `slots` and `shadow`
/// (staging slot `slot` of `sp` in `op`, made as `Shadow::new($fresh)` with
/// `$size` the chunk size).
macro_rules! staged_sim_basics {
    ($machine:ident, |$size:ident| $fresh:expr) => {
        pub(super) fn fail(&self, what: impl Into<String>) -> SimFailure {
            self.core.fail(what)
        }

        pub(super) fn instance(&mut self, sp: SpId, op: usize) -> &mut $machine<SimKey> {
            let key = self.ops[op].key;
            let cfg = Config {
                me: sp,
                chunk_bytes: self.cfg.chunk_bytes,
                staging_slots: self.cfg.staging_slots,
            };
            self.inst
                .entry((sp, op))
                .or_insert_with(|| $machine::new(key, cfg))
        }

        pub(super) fn slots(&self) -> usize {
            self.cfg.staging_slots.max(1) as usize
        }

        pub(super) fn shadow(
            &mut self,
            op: usize,
            sp: SpId,
            slot: u32,
        ) -> Result<&mut Shadow, SimFailure> {
            let $size = self.cfg.chunk_bytes.max(1);
            let fresh = || Shadow::new($fresh);
            let slots = self.slots();
            let staging = &mut self.ops[op].staging;
            self.core
                .staging_slot(staging, (op, sp, slot), slots, fresh)
        }
    };
}
pub(crate) use staged_sim_basics;

/// In a staged simulator's `impl Sim`: `complete`, SP `sp` completing
/// `rank` of collective `op` at `at`: [`check_completion`], then the
/// simulator's `host_copy` (the host's side), then the record.
macro_rules! staged_complete {
    () => {
        pub(super) fn complete(
            &mut self,
            (op, sp, rank): (usize, SpId, Rank),
            (status, from_segment): (Status, bool),
            at: Nanos,
        ) -> Result<(), SimFailure> {
            let r = rank as usize;
            let o = &self.ops[op];
            let notified = o.notified.contains(&sp);
            $crate::sim::staged_common::check_completion(
                &self.core,
                (op, sp, rank),
                status,
                o.post_ns[r],
                o.done[r],
                notified,
            )?;
            let host_at = self.host_copy((op, sp, rank), status, from_segment, at)?;
            self.ops[op].done[r] = Some(Done {
                at,
                status,
                from_segment,
                host_at,
            });
            Ok(())
        }
    };
}
pub(crate) use staged_complete;

/// In a staged simulator's `impl Sim`: `drain`, the actions of SP `sp`'s
/// instance of collective `op`, emitted at `out`, in turn: a message goes
/// out (`msg_bytes` on the wire, `$env` what travels), a copy is checked
/// (`check_copy`, also defined here) and queued in the SP's limiter as
/// `$work`, a move starts
/// (`start_move`), a completion is checked and recorded (`complete`).
macro_rules! staged_drain {
    (send: |$op:ident, $msg:ident| $env:expr, copy: |$c:ident| $work:expr) => {
        pub(super) fn drain(&mut self, sp: SpId, $op: usize, out: Nanos) -> Result<(), SimFailure> {
            while let Some(action) = self.inst.get_mut(&(sp, $op)).and_then(|a| a.poll_action()) {
                match action {
                    Action::Send { to, msg: $msg } => {
                        let wire = msg_bytes(&$msg);
                        self.core.send($op, sp, to, wire, out, $env)?;
                    }
                    Action::Copy($c) => {
                        self.check_copy($op, sp, &$c)?;
                        self.core.sps[sp as usize].limiter.push(($op, $work));
                    }
                    Action::Move(m) => self.start_move($op, sp, m, out)?,
                    Action::Complete {
                        rank,
                        status,
                        from_segment,
                    } => self.complete(($op, sp, rank), (status, from_segment), out)?,
                }
            }
            Ok(())
        }

        /// The shape of a copy when the SP emits it: one chunk
        /// ([`chunk_fits`]) read or written where the simulator's
        /// `copy_places` allows.
        pub(super) fn check_copy(
            &self,
            op: usize,
            sp: SpId,
            c: &Copy<SimKey>,
        ) -> Result<(), SimFailure> {
            let o = &self.ops[op];
            let chunk = self.cfg.chunk_bytes.max(1);
            let fits = $crate::sim::staged_common::chunk_fits(
                (c.len, c.chunk),
                chunk,
                o.n,
                o.inconsistent,
            );
            let placed = if fits {
                self.copy_places(op, sp, c, chunk)
            } else {
                Err("bad chunk or length")
            };
            placed.map_err(|what| self.fail(format!("op {op}: SP {sp}: {what}: {c:?}")))
        }
    };
}
pub(crate) use staged_drain;

/// Runs the config `cfg(design)` gives for each design, flat then
/// hierarchical: each run must pass its checks without an error completion.
/// The reports, each shown on stderr.
#[cfg(test)]
pub(crate) fn clean_by_design<C, R>(
    cfg: impl Fn(crate::staged::Design) -> C,
    run: fn(&C) -> Result<R, SimFailure>,
) -> Vec<R>
where
    R: std::fmt::Debug + std::ops::Deref<Target = super::Outcome>,
{
    use crate::staged::Design;
    [Design::Flat, Design::Hier]
        .into_iter()
        .map(|design| {
            let r = run(&cfg(design)).unwrap();
            eprintln!("{r:?}");
            assert_eq!(r.error_completions, 0);
            r
        })
        .collect()
}
