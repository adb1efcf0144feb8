//! Abort and completion bookkeeping shared by every collective's state
//! machine: the status a posted rank will complete with, and the instance's
//! abort (its status, and the SPs already told about it).

use std::collections::BTreeSet;

use crate::{SpId, Status};

/// How one posted local rank stands.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Outcome {
    /// What it completes with (the first error wins).
    pub status: Status,
    /// Its `Complete` was emitted.
    pub completed: bool,
}

impl Outcome {
    /// A rank that just posted: `Ok` so far, not completed.
    pub fn new() -> Outcome {
        Outcome {
            status: Status::Ok,
            completed: false,
        }
    }

    /// First error wins.
    pub fn set_error(&mut self, status: Status) {
        if self.status.is_ok() && !status.is_ok() {
            self.status = status;
        }
    }
}

/// Every rank in `outcomes` that has not completed gets `status`.
pub(crate) fn fail_pending<'a>(outcomes: impl Iterator<Item = &'a mut Outcome>, status: Status) {
    for o in outcomes {
        if !o.completed {
            o.set_error(status);
        }
    }
}

/// The abort of one instance.
#[derive(Clone, Debug, Default)]
pub(crate) struct Abort {
    /// `Some` once aborted: the status every rank that has not completed
    /// gets.
    pub status: Option<Status>,
    /// The abort went out to every SP of the instance.
    pub broadcast_done: bool,
    /// SPs sent an `Abort`.
    pub notified: BTreeSet<SpId>,
}

impl Abort {
    pub fn is_some(&self) -> bool {
        self.status.is_some()
    }

    pub fn is_none(&self) -> bool {
        self.status.is_none()
    }

    /// Record an abort with `status` (`Ok` becomes `Aborted`; an earlier
    /// abort's status stays): whether it is the first, and the status in
    /// force.
    pub fn enter(&mut self, status: Status) -> (bool, Status) {
        let status = if status.is_ok() {
            Status::Aborted
        } else {
            status
        };
        let first = self.status.is_none();
        (first, *self.status.get_or_insert(status))
    }

    /// The status to send SP `sp` in an `Abort`, once per SP, if aborted
    /// (never to `me` nor to a lost SP).
    pub fn notice_for(&mut self, me: SpId, lost: &BTreeSet<SpId>, sp: SpId) -> Option<Status> {
        let status = self.status?;
        if sp == me || lost.contains(&sp) || !self.notified.insert(sp) {
            return None;
        }
        Some(status)
    }

    /// Whether the abort is to be broadcast now (aborted, and not done
    /// yet; `can` says whether the instance knows its SPs): marks it done.
    pub fn start_broadcast(&mut self, can: bool) -> bool {
        if self.status.is_none() || self.broadcast_done || !can {
            return false;
        }
        self.broadcast_done = true;
        true
    }
}

/// Local `rank` was lost: false if it already completed (nothing changes);
/// else it completes with `RankFailed` if it posted (`out`), or is
/// recorded in `lost_unposted`.
pub(crate) fn lose_rank(
    out: Option<&mut Outcome>,
    lost_unposted: &mut std::collections::BTreeSet<crate::Rank>,
    rank: crate::Rank,
) -> bool {
    match out {
        Some(o) if o.completed => return false,
        Some(o) => o.set_error(Status::RankFailed),
        None => {
            lost_unposted.insert(rank);
        }
    }
    true
}
