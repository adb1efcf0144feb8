//! A hand-driven network of SPs running one collective instance each, for
//! the unit tests of the state machines: messages are delivered in order,
//! copies finish when the test says so, and every output is checked.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::{Nanos, Rank, SpId, Status};

/// An output of a state machine, as the harness sees it.
pub(crate) enum Out<M, C> {
    Send { to: SpId, msg: M },
    Copy(C),
    Complete { rank: Rank, status: Status },
}

/// A collective state machine driven by [`Net`] (the handlers panic on a
/// rejected input).
pub(crate) trait Machine: Sized {
    type Post;
    type Msg;
    type Copy;

    /// The instance of SP `sp`.
    fn create(sp: SpId) -> Self;
    fn post(&mut self, now: Nanos, post: Self::Post);
    fn msg(&mut self, now: Nanos, from: SpId, msg: Self::Msg);
    fn copy_done(&mut self, now: Nanos, copy: &Self::Copy, status: Status);
    fn poll(&mut self) -> Option<Out<Self::Msg, Self::Copy>>;
    /// Checks a copy emitted by SP `sp`.
    fn check_copy(&self, _sp: SpId, _copy: &Self::Copy) {}
}

pub(crate) struct Net<A: Machine> {
    pub sps: BTreeMap<SpId, A>,
    /// SPs whose inputs are dropped (as are those of SPs removed from `sps`).
    pub dead: BTreeSet<SpId>,
    pub msgs: VecDeque<(SpId, SpId, A::Msg)>,
    pub copies: VecDeque<(SpId, A::Copy)>,
    pub copied: Vec<A::Copy>,
    pub completes: Vec<(SpId, Rank, Status)>,
    /// Advances by 10 on each post and by 1 on each delivered message.
    pub now: Nanos,
}

impl<A: Machine> Net<A> {
    pub fn new(n: u32) -> Net<A> {
        Net {
            sps: (0..n).map(|sp| (sp, A::create(sp))).collect(),
            dead: BTreeSet::new(),
            msgs: VecDeque::new(),
            copies: VecDeque::new(),
            copied: Vec::new(),
            completes: Vec::new(),
            now: 0,
        }
    }

    pub fn sp(&mut self, sp: SpId) -> &mut A {
        self.sps.get_mut(&sp).unwrap()
    }

    fn live(&mut self, sp: SpId) -> Option<&mut A> {
        if self.dead.contains(&sp) {
            return None;
        }
        self.sps.get_mut(&sp)
    }

    /// Take every output of SP `sp`.
    pub fn collect(&mut self, sp: SpId) {
        while let Some(a) = self.sp(sp).poll() {
            match a {
                Out::Send { to, msg } => {
                    assert_ne!(to, sp, "send to self");
                    self.msgs.push_back((sp, to, msg));
                }
                Out::Copy(c) => {
                    self.sps[&sp].check_copy(sp, &c);
                    self.copies.push_back((sp, c));
                }
                Out::Complete { rank, status } => {
                    assert!(
                        !self.completes.iter().any(|&(_, r, _)| r == rank),
                        "rank {rank} completed twice"
                    );
                    self.completes.push((sp, rank, status));
                }
            }
        }
    }

    pub fn post(&mut self, sp: SpId, p: A::Post) {
        self.now += 10;
        let now = self.now;
        self.sp(sp).post(now, p);
        self.collect(sp);
    }

    pub fn deliver_one(&mut self) -> bool {
        let Some((from, to, msg)) = self.msgs.pop_front() else {
            return false;
        };
        self.now += 1;
        let now = self.now;
        if let Some(a) = self.live(to) {
            a.msg(now, from, msg);
            self.collect(to);
        }
        true
    }

    pub fn deliver_all(&mut self) {
        while self.deliver_one() {}
    }

    /// Finish the oldest copy in flight with `status`.
    pub fn finish_copy(&mut self, status: Status) -> bool {
        let Some((sp, c)) = self.copies.pop_front() else {
            return false;
        };
        let now = self.now;
        if let Some(a) = self.live(sp) {
            a.copy_done(now, &c, status);
            self.collect(sp);
            self.copied.push(c);
        }
        true
    }

    /// Deliver everything and finish every copy with `Ok`.
    pub fn run(&mut self) {
        loop {
            self.deliver_all();
            if !self.finish_copy(Status::Ok) {
                break;
            }
        }
    }

    pub fn status(&self, rank: Rank) -> Option<Status> {
        self.completes
            .iter()
            .find(|&&(_, r, _)| r == rank)
            .map(|&(_, _, s)| s)
    }

    /// Asserts that every rank of `ranks` ended with `want` (`None`: it
    /// never completed).
    pub fn expect_status(&self, ranks: &[Rank], want: Option<Status>) {
        for &r in ranks {
            assert_eq!(self.status(r), want, "rank {r}");
        }
    }
}

/// In a staged collective's tests: `KEY` (comm id `$comm`), `CHUNK`,
/// `SLOTS`, `new_machine(sp)` (`$machine` with those) and `hier(post)`
/// (hierarchical; the SP places its region at `100 * sp`).
macro_rules! staged_test_basics {
    ($machine:ident, comm: $comm:expr) => {
        const KEY: CollKey = CollKey {
            job: 1,
            comm: crate::CommId {
                leader: 0,
                id: $comm,
            },
            seq: 0,
        };
        const CHUNK: u64 = 4;
        const SLOTS: u32 = 2;

        fn new_machine(sp: SpId) -> $machine<Tag> {
            $machine::new(
                KEY,
                Config {
                    me: sp,
                    chunk_bytes: CHUNK,
                    staging_slots: SLOTS,
                },
            )
        }

        /// Hierarchical; the SP places its region at `100 * sp`.
        fn hier(mut p: Post<Tag>) -> Post<Tag> {
            p.design = Design::Hier;
            p.shared_key = Some(('h', p.rank));
            p.shared_at = 100 * u64::from(p.members[p.rank as usize]);
            p
        }
    };
}
pub(crate) use staged_test_basics;
