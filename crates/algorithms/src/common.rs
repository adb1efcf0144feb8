//! Pieces shared by the collectives' state machines.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::abort::Abort;
use crate::{CollKey, Nanos, Rank, SpId};

/// The bookkeeping every collective's state machine keeps alike (its field
/// `core`): `R` is the state of a posted local rank, `C` what a copy in
/// flight does, `A` the machine's `Action` and `S` its `Stats`.
#[derive(Clone, Debug)]
pub(crate) struct Core<R, C, A, S> {
    pub(crate) key: CollKey,
    pub(crate) me: SpId,
    /// Posted local ranks.
    pub(crate) ranks: BTreeMap<Rank, R>,
    /// Posted local ranks that completed.
    pub(crate) completed: usize,
    /// Local ranks declared lost before they posted.
    pub(crate) lost_unposted: BTreeSet<Rank>,
    /// Copies in flight, by id.
    pub(crate) copies: BTreeMap<u64, C>,
    /// The id the next copy (or move) gets.
    pub(crate) next_id: u64,
    pub(crate) abort: Abort,
    pub(crate) lost_sps: BTreeSet<SpId>,
    pub(crate) actions: VecDeque<A>,
    /// The time of the latest input.
    pub(crate) now: Nanos,
    pub(crate) stats: S,
}

impl<R, C, A, S: Default> Core<R, C, A, S> {
    /// The posted local rank `rank`; `what` names the event that needs it
    /// posted (the panic message if it is not: a broken invariant).
    pub(crate) fn posted(&mut self, rank: Rank, what: &'static str) -> &mut R {
        self.ranks.get_mut(&rank).expect(what)
    }

    /// A fresh instance `key` at SP `me`.
    pub(crate) fn new(key: CollKey, me: SpId) -> Self {
        Core {
            key,
            me,
            ranks: BTreeMap::new(),
            completed: 0,
            lost_unposted: BTreeSet::new(),
            copies: BTreeMap::new(),
            next_id: 0,
            abort: Abort::default(),
            lost_sps: BTreeSet::new(),
            actions: VecDeque::new(),
            now: 0,
            stats: S::default(),
        }
    }
}

impl<R, C, A, S> Core<R, C, A, S> {
    /// A fresh copy (or move) id.
    pub(crate) fn new_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }
}

/// The node of every SP serving a member (`members[r]` serves comm rank `r`
/// on node `nodes[r]`), or the first SP found serving ranks on two nodes.
pub(crate) fn sp_nodes(members: &[SpId], nodes: &[u32]) -> Result<BTreeMap<SpId, u32>, SpId> {
    let mut sp_node: BTreeMap<SpId, u32> = BTreeMap::new();
    for (&sp, &n) in members.iter().zip(nodes) {
        if *sp_node.entry(sp).or_insert(n) != n {
            return Err(sp);
        }
    }
    Ok(sp_node)
}

/// A v-collective's posted rank's receive buffer: its key, the count and
/// displacement of each source's block in it, and its progress.
#[derive(Clone, Debug)]
pub(crate) struct VRecv<K> {
    pub(crate) key: K,
    pub(crate) counts: Vec<u64>,
    pub(crate) displs: Vec<u64>,
    /// Sources whose block is not in yet.
    pub(crate) pending: usize,
    /// Copies writing into it.
    pub(crate) writes: usize,
}

impl<K> VRecv<K> {
    /// The buffer of a rank that just posted, all `p` blocks to come.
    pub(crate) fn new(key: K, counts: Vec<u64>, displs: Vec<u64>, p: usize) -> Self {
        VRecv {
            key,
            counts,
            displs,
            pending: p,
            writes: 0,
        }
    }
}

/// Takes the copy or move `id` that finished out of `in_flight`; an
/// unknown id (a driver error, ignored) is counted in `unknown`.
pub(crate) fn take_finished<T>(
    in_flight: &mut BTreeMap<u64, T>,
    id: u64,
    unknown: &mut u64,
) -> Option<T> {
    let taken = in_flight.remove(&id);
    if taken.is_none() {
        *unknown += 1;
    }
    taken
}

/// The accessors and inputs every collective's state machine has alike:
/// `common_api!(Machine, Msg, settle = f)` (field `core`, a `Core` whose
/// `ranks` have an `out` each; methods `process`, `copy_finished`,
/// `enter_abort`, `members`; with `own_timers`, also `handle_timeout` and
/// `poll_timeout`, which the macro otherwise writes as "no timers"). Every
/// input runs through `input`: it records the time in `core.now`, then
/// calls the method `settle` (doing what the input made possible). With
/// `staged`, also what the staged collectives have alike (`core.copies` of
/// `CopyKind`s, field `slots`; settle with `pump`).
macro_rules! common_api {
    ($machine:ident, $msg:ty, settle = $settle:ident) => {
        common_api!($machine, $msg, settle = $settle, own_timers);

        impl<K: Clone + fmt::Debug + PartialEq> $machine<K> {
            /// This algorithm has no timers.
            pub fn handle_timeout(&mut self, _now: Nanos) {}

            /// This algorithm has no timers: always `None`.
            pub fn poll_timeout(&self) -> Option<Nanos> {
                None
            }
        }
    };
    // A machine with timers of its own writes `handle_timeout` and
    // `poll_timeout` itself.
    ($machine:ident, $msg:ty, settle = $settle:ident, own_timers) => {
        impl<K: Clone + fmt::Debug + PartialEq> $machine<K> {
            pub fn key(&self) -> CollKey {
                self.core.key
            }

            pub fn me(&self) -> SpId {
                self.core.me
            }

            pub fn abort_status(&self) -> Option<Status> {
                self.core.abort.status
            }

            pub fn stats(&self) -> Stats {
                self.core.stats
            }

            pub fn poll_action(&mut self) -> Option<Action<K>> {
                self.core.actions.pop_front()
            }

            /// Records the time of an input.
            pub(super) fn set_clock(&mut self, now: Nanos) {
                self.core.now = now;
            }

            /// Runs input `f` at time `now`, then settles.
            pub(super) fn input<T>(&mut self, now: Nanos, f: impl FnOnce(&mut Self) -> T) -> T {
                self.set_clock(now);
                let res = f(self);
                self.$settle();
                res
            }

            /// A message from SP `from` for this instance (ignored, and
            /// counted in `stats.ignored_from_lost_sp`, if `from` was
            /// declared lost).
            pub fn handle_msg(
                &mut self,
                now: Nanos,
                from: SpId,
                msg: $msg,
            ) -> Result<(), MsgError> {
                self.input(now, |s| {
                    if s.core.lost_sps.contains(&from) {
                        s.core.stats.ignored_from_lost_sp += 1;
                        return Ok(());
                    }
                    s.process(from, msg)
                })
            }

            /// The copy `id` finished with `status`. What a failed copy
            /// does is the collective's: the staged ones and allgatherv
            /// abort the instance; alltoallv fails the block's two ranks
            /// (the receiver's block is undefined) and goes on.
            pub fn handle_copy_done(&mut self, now: Nanos, id: CopyId, status: Status) {
                self.input(now, |s| s.copy_finished(id.0, status))
            }

            /// Local abort: every local rank not yet complete completes
            /// with `status` (once nothing touches its buffers), ranks
            /// posting later complete at once, and the other SPs learn of
            /// it. `Status::Ok` becomes `Status::Aborted`.
            pub fn abort(&mut self, now: Nanos, status: Status) {
                self.input(now, |s| s.enter_abort(status))
            }

            /// Local host `rank` died: aborts with `RankFailed` unless it
            /// completed; a rank that had posted still gets its `Complete`,
            /// one that had not no longer keeps the instance from
            /// finishing. Ignored for a rank known not to be served by this
            /// SP that did not post here.
            pub fn handle_rank_lost(&mut self, now: Nanos, rank: Rank) {
                self.set_clock(now);
                let me = self.core.me;
                let foreign = self
                    .members()
                    .is_some_and(|m| m.get(rank as usize) != Some(&me));
                if foreign && !self.core.ranks.contains_key(&rank) {
                    return;
                }
                let out = self.core.ranks.get_mut(&rank).map(|st| &mut st.out);
                if lose_rank(out, &mut self.core.lost_unposted, rank) {
                    self.input(now, |s| s.enter_abort(Status::RankFailed));
                }
            }
        }
    };
    ($machine:ident, $msg:ty, staged) => {
        common_api!($machine, $msg, settle = pump);

        impl<K: Clone + fmt::Debug + PartialEq> $machine<K> {
            /// Staging slots granted, being read, or holding a chunk.
            pub fn slots_in_use(&self) -> usize {
                self.slots.in_use()
            }

            /// The copy `id` that finished with `status` (`None`, counted,
            /// for an unknown id; a failure aborts), and whether its bytes
            /// count (`Ok` and not aborted).
            pub(super) fn take_copy(
                &mut self,
                id: u64,
                status: Status,
            ) -> Option<(CopyKind, bool)> {
                let kind =
                    take_finished(&mut self.core.copies, id, &mut self.core.stats.unknown_done)?;
                if !status.is_ok() {
                    self.enter_abort(status);
                }
                Some((kind, status.is_ok() && self.core.abort.is_none()))
            }

            /// Completes local `rank` with its outcome (`from_segment` if
            /// it reads the region and succeeds).
            pub(super) fn complete_rank(&mut self, rank: Rank, aborted: bool, from_segment: bool) {
                let st = self.core.ranks.get_mut(&rank).unwrap();
                let mut status = st.out.status;
                if aborted && mutated(Mutation::OkAfterAbort) {
                    status = Status::Ok;
                }
                st.out.completed = true;
                self.core.completed += 1;
                self.core.actions.push_back(Action::Complete {
                    rank,
                    status,
                    from_segment: from_segment && status.is_ok(),
                });
            }
        }
    };
}
pub(crate) use common_api;

/// A collective's `PostError` (a rejected post; the instance is unchanged):
/// the variants every collective has, then `$own` (variants with their doc
/// comments), with `Display` (the shared messages, then the `$arms` for
/// `$own`, written with the formatter `$f`) and `Error`. Also
/// `PostError::check_served`, the first check of every post.
macro_rules! post_error {
    (own { $($own:tt)* } display($f:ident) { $($arms:tt)* }) => {
        /// A rejected post; the instance is unchanged.
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub enum PostError {
            /// `rank >= members.len()` (also for an empty `members`).
            RankOutOfRange { rank: Rank, size: usize },
            /// `members[rank]` is another SP.
            NotMine { rank: Rank, served_by: SpId },
            /// A per-rank vector of the post does not have P entries.
            LengthMismatch {
                field: &'static str,
                len: usize,
                expected: usize,
            },
            /// This rank already posted to this instance.
            DuplicatePost { rank: Rank },
            /// This rank was declared lost (`handle_rank_lost`) before posting.
            RankLost { rank: Rank },
            $($own)*
        }

        impl PostError {
            /// `rank` is a rank of `members` served by `me` (the bcast checks
            /// its root between the two and does not use this).
            #[allow(dead_code)]
            pub(crate) fn check_served(
                members: &[SpId],
                rank: Rank,
                me: SpId,
            ) -> Result<(), PostError> {
                let size = members.len();
                if rank as usize >= size {
                    return Err(PostError::RankOutOfRange { rank, size });
                }
                let served_by = members[rank as usize];
                if served_by != me {
                    return Err(PostError::NotMine { rank, served_by });
                }
                Ok(())
            }
        }

        impl fmt::Display for PostError {
            fn fmt(&self, $f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self {
                    PostError::RankOutOfRange { rank, size } => {
                        write!($f, "rank {rank} out of range for comm size {size}")
                    }
                    PostError::NotMine { rank, served_by } => {
                        write!($f, "rank {rank} is served by SP {served_by}, not this SP")
                    }
                    PostError::LengthMismatch {
                        field,
                        len,
                        expected,
                    } => write!($f, "{field} has {len} entries, comm size is {expected}"),
                    PostError::DuplicatePost { rank } => write!($f, "rank {rank} posted twice"),
                    PostError::RankLost { rank } => write!($f, "rank {rank} was declared lost"),
                    $($arms)*
                }
            }
        }

        impl std::error::Error for PostError {}
    };
}
pub(crate) use post_error;

/// `Display` as `Debug`, and `Error`, for an error type.
macro_rules! debug_error {
    ($error:ident) => {
        impl fmt::Display for $error {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{self:?}")
            }
        }

        impl std::error::Error for $error {}
    };
}
pub(crate) use debug_error;

/// In a collective's `impl`: `notify_abort(sp)`, sending SP `sp` the abort
/// notice it is owed, if any (fields `abort`, `me`, `lost_sps`, `actions`;
/// a `Msg::Abort { status }`).
macro_rules! notify_abort {
    () => {
        pub(super) fn notify_abort(&mut self, sp: SpId) {
            if let Some(status) = self
                .core
                .abort
                .notice_for(self.core.me, &self.core.lost_sps, sp)
            {
                self.core.actions.push_back(Action::Send {
                    to: sp,
                    msg: Msg::Abort { status },
                });
            }
        }
    };
}
pub(crate) use notify_abort;

/// In a v-collective's `impl`: `check_complete(rank)`, completing local
/// `rank` (its state `$st` in `ranks`) once not `$busy` and, unless the
/// instance aborted, with nothing left to receive.
macro_rules! v_check_complete {
    (|$st:ident| $busy:expr) => {
        pub(super) fn check_complete(&mut self, rank: Rank) {
            let aborted = self.core.abort.is_some();
            let Some($st) = self.core.ranks.get_mut(&rank) else {
                return;
            };
            if $st.out.completed || $busy {
                return;
            }
            if !aborted && $st.buf.pending > 0 {
                return;
            }
            $st.out.completed = true;
            self.core.completed += 1;
            self.core.actions.push_back(Action::Complete {
                rank,
                status: $st.out.status,
            });
        }
    };
}
pub(crate) use v_check_complete;

/// In a v-collective's `impl`: `maybe_broadcast_abort`, sending every member
/// SP its abort notice once the instance aborted on its own and knows its
/// members (`$members`, with `$s` the instance: `Option<&Vec<SpId>>`); and
/// `finish_abort`, that broadcast then every local rank's completion check.
macro_rules! v_abort_broadcast {
    (|$s:ident| $members:expr) => {
        pub(super) fn maybe_broadcast_abort(&mut self) {
            let known = {
                let $s = &*self;
                $members.is_some()
            };
            if !self.core.abort.start_broadcast(self.abort_local && known) {
                return;
            }
            let sps: BTreeSet<SpId> = {
                let $s = &*self;
                $members.unwrap().iter().copied().collect()
            };
            for sp in sps {
                self.notify_abort(sp);
            }
        }

        pub(super) fn finish_abort(&mut self) {
            self.maybe_broadcast_abort();
            let ranks: Vec<Rank> = self.core.ranks.keys().copied().collect();
            for r in ranks {
                self.check_complete(r);
            }
        }
    };
}
pub(crate) use v_abort_broadcast;

/// In a v-collective's `impl`: `send(to, msg)` (to this SP itself: queued
/// in `internal`; to a lost SP: dropped) and `run_internal`, which
/// processes the queued messages as if from this SP.
macro_rules! v_internal_send {
    () => {
        pub(super) fn send(&mut self, to: SpId, msg: Msg<K>) {
            if to == self.core.me {
                self.internal.push_back(msg);
            } else if !self.core.lost_sps.contains(&to) {
                self.core.actions.push_back(Action::Send { to, msg });
            }
        }

        pub(super) fn run_internal(&mut self) {
            while let Some(msg) = self.internal.pop_front() {
                let me = self.core.me;
                let res = self.process(me, msg);
                debug_assert!(res.is_ok(), "internal message rejected: {res:?}");
            }
        }
    };
}
pub(crate) use v_internal_send;
