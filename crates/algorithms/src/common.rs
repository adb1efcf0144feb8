//! Pieces shared by the collectives' state machines.

use std::collections::BTreeMap;

use crate::SpId;

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
/// `common_api!(Machine, Msg, settle = f, clock = now)` (fields `key`,
/// `me`, `abort`, `stats`, `actions`, `lost_sps`, `ranks` with an `out`
/// each, `lost_unposted`; methods `process`, `copy_finished`,
/// `enter_abort`, `members`). Every input runs through `input`: it records
/// `now` in the field `clock` (a machine without one ignores the time),
/// then calls the method `settle` (doing what the input made possible).
/// With `staged`, also what the staged collectives have alike (field
/// `next_id`, `copies` of `CopyKind`s, `slots`, `completed`; settle with
/// `pump`, clock `now`).
macro_rules! common_api {
    ($machine:ident, $msg:ty, settle = $settle:ident $(, clock = $now:ident)?) => {
        impl<K: Clone + fmt::Debug + PartialEq> $machine<K> {
            pub fn key(&self) -> CollKey {
                self.key
            }

            pub fn me(&self) -> SpId {
                self.me
            }

            pub fn abort_status(&self) -> Option<Status> {
                self.abort.status
            }

            pub fn stats(&self) -> Stats {
                self.stats
            }

            /// This algorithm has no timers.
            pub fn handle_timeout(&mut self, _now: Nanos) {}

            pub fn poll_action(&mut self) -> Option<Action<K>> {
                self.actions.pop_front()
            }

            /// This algorithm has no timers: always `None`.
            pub fn poll_timeout(&self) -> Option<Nanos> {
                None
            }

            /// Records the time of an input.
            pub(super) fn set_clock(&mut self, now: Nanos) {
                let _ = now;
                $(self.$now = now;)?
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
            pub fn handle_msg(&mut self, now: Nanos, from: SpId, msg: $msg) -> Result<(), MsgError> {
                self.input(now, |s| {
                    if s.lost_sps.contains(&from) {
                        s.stats.ignored_from_lost_sp += 1;
                        return Ok(());
                    }
                    s.process(from, msg)
                })
            }

            /// The copy `id` finished with `status` (anything but `Ok`
            /// aborts the instance).
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
                let me = self.me;
                let foreign = self
                    .members()
                    .is_some_and(|m| m.get(rank as usize) != Some(&me));
                if foreign && !self.ranks.contains_key(&rank) {
                    return;
                }
                let out = self.ranks.get_mut(&rank).map(|st| &mut st.out);
                if lose_rank(out, &mut self.lost_unposted, rank) {
                    self.input(now, |s| s.enter_abort(Status::RankFailed));
                }
            }
        }
    };
    ($machine:ident, $msg:ty, staged) => {
        common_api!($machine, $msg, settle = pump, clock = now);

        impl<K: Clone + fmt::Debug + PartialEq> $machine<K> {
            /// Staging slots granted, being read, or holding a chunk.
            pub fn slots_in_use(&self) -> usize {
                self.slots.in_use()
            }

            pub(super) fn new_id(&mut self) -> u64 {
                let id = self.next_id;
                self.next_id += 1;
                id
            }

            /// The copy `id` that finished with `status` (`None`, counted,
            /// for an unknown id; a failure aborts), and whether its bytes
            /// count (`Ok` and not aborted).
            pub(super) fn take_copy(
                &mut self,
                id: u64,
                status: Status,
            ) -> Option<(CopyKind, bool)> {
                let kind = take_finished(&mut self.copies, id, &mut self.stats.unknown_done)?;
                if !status.is_ok() {
                    self.enter_abort(status);
                }
                Some((kind, status.is_ok() && self.abort.is_none()))
            }

            /// Completes local `rank` with its outcome (`from_segment` if
            /// it reads the region and succeeds).
            pub(super) fn complete_rank(&mut self, rank: Rank, aborted: bool, from_segment: bool) {
                let st = self.ranks.get_mut(&rank).unwrap();
                let mut status = st.out.status;
                if aborted && mutated(Mutation::OkAfterAbort) {
                    status = Status::Ok;
                }
                st.out.completed = true;
                self.completed += 1;
                self.actions.push_back(Action::Complete {
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
            if let Some(status) = self.abort.notice_for(self.me, &self.lost_sps, sp) {
                self.actions.push_back(Action::Send {
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
            let aborted = self.abort.is_some();
            let Some($st) = self.ranks.get_mut(&rank) else {
                return;
            };
            if $st.out.completed || $busy {
                return;
            }
            if !aborted && $st.recv_pending > 0 {
                return;
            }
            $st.out.completed = true;
            self.completed += 1;
            self.actions.push_back(Action::Complete {
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
            if !self.abort.start_broadcast(self.abort_local && known) {
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
            let ranks: Vec<Rank> = self.ranks.keys().copied().collect();
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
            if to == self.me {
                self.internal.push_back(msg);
            } else if !self.lost_sps.contains(&to) {
                self.actions.push_back(Action::Send { to, msg });
            }
        }

        pub(super) fn run_internal(&mut self) {
            while let Some(msg) = self.internal.pop_front() {
                let me = self.me;
                let res = self.process(me, msg);
                debug_assert!(res.is_ok(), "internal message rejected: {res:?}");
            }
        }
    };
}
pub(crate) use v_internal_send;
