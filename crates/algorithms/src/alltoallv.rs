//! Ring `Ialltoallv` progressed by service processes (after NVIDIA's MIMOSA
//! design).
//!
//! One [`Alltoallv`] object exists per collective instance ([`CollKey`]) per
//! SP. Each local rank that posts announces its send blocks to the SPs of
//! the destination ranks, in ring order starting with itself. The SP of a
//! destination rank reads ("RDMA-read") each announced block straight from
//! the source host buffer into the destination host buffer and acknowledges
//! it. A rank completes once all blocks into its receive buffer are done and
//! all blocks out of its send buffer are acknowledged.
//!
//! Failure handling. Every announcement is answered by exactly one `Ack`,
//! also after an abort (then without copying), so a sender always learns
//! when nobody will read its send buffer any more; blocks announced to ranks
//! of a lost SP are settled by [`Alltoallv::handle_peer_lost`]. A rank is
//! never reported complete while a copy reading its send buffer or writing
//! its receive buffer may still be running, not even after an abort. A local
//! abort (or peer loss, or rank loss) is broadcast to every other SP of the
//! communicator with `Msg::Abort`; an aborted instance that does not know the
//! membership yet answers each announcing SP with an `Abort`.
//!
//! Driver obligations: route `Action::Send` messages (tagged with the
//! `CollKey`), execute `Action::Copy` (through a
//! [`CopyLimiter`](crate::sched::CopyLimiter)) and report each with
//! `handle_copy_done`, report every `Action::Complete` to the host. After an
//! abort the driver should remember the `CollKey` for a while after dropping
//! the instance, so late messages do not create a fresh instance that would
//! wait forever.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::abort::{fail_pending, lose_rank, Abort, Outcome};
use crate::common::common_api;
use crate::{CollKey, Nanos, Rank, SpId, Status};

/// Static configuration of one instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Config {
    /// The SP running this instance.
    pub me: SpId,
}

/// What one local rank posted. Counts and displacements are in bytes and
/// have already been checked by the driver against the rank's buffers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Post<K> {
    pub rank: Rank,
    /// SP serving each comm rank; its length is the comm size P.
    pub members: Vec<SpId>,
    pub send_key: K,
    pub recv_key: K,
    pub send_counts: Vec<u64>,
    pub send_displs: Vec<u64>,
    pub recv_counts: Vec<u64>,
    pub recv_displs: Vec<u64>,
}

/// SP-to-SP messages of this collective (the driver adds the `CollKey`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg<K> {
    /// `src`'s block for `dst` is ready at (`key`, `offset`, `len`).
    Announce {
        src: Rank,
        dst: Rank,
        key: K,
        offset: u64,
        len: u64,
    },
    /// `dst`'s SP is done with `src`'s block (read it, or decided not to).
    Ack {
        src: Rank,
        dst: Rank,
        status: Status,
    },
    /// The collective failed; stop and complete everyone with `status`.
    Abort { status: Status },
}

impl<K> Msg<K> {
    /// The memory keys the message carries (an SP checks where a peer's keys point).
    pub fn keys(&self) -> Vec<&K> {
        match self {
            Msg::Announce { key, .. } => vec![key],
            Msg::Ack { .. } | Msg::Abort { .. } => Vec::new(),
        }
    }
}

/// Identifies a copy within one instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CopyId(pub u64);

/// Copy `len` bytes from `src_rank`'s send buffer to `dst_rank`'s receive
/// buffer (`dst_rank` is always served by this SP).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copy<K> {
    pub id: CopyId,
    pub src_rank: Rank,
    pub src_key: K,
    pub src_offset: u64,
    pub dst_rank: Rank,
    pub dst_key: K,
    pub dst_offset: u64,
    pub len: u64,
}

/// Output of the state machine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action<K> {
    /// Send `msg` to SP `to` (never this SP itself).
    Send { to: SpId, msg: Msg<K> },
    /// Start this copy and report it with `handle_copy_done`.
    Copy(Copy<K>),
    /// Local `rank` is done with the collective; emitted exactly once per
    /// posted rank.
    Complete { rank: Rank, status: Status },
}

/// A rejected post; the instance is unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PostError {
    /// `rank >= members.len()` (also for an empty `members`).
    RankOutOfRange { rank: Rank, size: usize },
    /// `members[rank]` is another SP.
    NotMine { rank: Rank, served_by: SpId },
    /// A count/displacement vector does not have P entries.
    LengthMismatch {
        field: &'static str,
        len: usize,
        expected: usize,
    },
    /// `members` differs from an earlier post of this instance.
    MembersDisagree,
    /// This rank already posted to this instance.
    DuplicatePost { rank: Rank },
    /// This rank was declared lost (`handle_rank_lost`) before posting.
    RankLost { rank: Rank },
    /// `displs[index] + counts[index]` overflows `u64`.
    Overflow {
        rank: Rank,
        field: &'static str,
        index: usize,
    },
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PostError::RankOutOfRange { rank, size } => {
                write!(f, "rank {rank} out of range for comm size {size}")
            }
            PostError::NotMine { rank, served_by } => {
                write!(f, "rank {rank} is served by SP {served_by}, not this SP")
            }
            PostError::LengthMismatch {
                field,
                len,
                expected,
            } => write!(f, "{field} has {len} entries, comm size is {expected}"),
            PostError::MembersDisagree => {
                write!(f, "members differ from an earlier post of this collective")
            }
            PostError::DuplicatePost { rank } => write!(f, "rank {rank} posted twice"),
            PostError::RankLost { rank } => write!(f, "rank {rank} was declared lost"),
            PostError::Overflow { rank, field, index } => {
                write!(
                    f,
                    "rank {rank}: {field} displacement+count overflows at {index}"
                )
            }
        }
    }
}

impl std::error::Error for PostError {}

/// A protocol violation by a peer; the instance is unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MsgError {
    RankOutOfRange {
        rank: Rank,
        size: usize,
    },
    /// The rank the message is about is not served by this SP.
    NotLocal {
        rank: Rank,
    },
    /// The message came from an SP that does not serve `rank`.
    WrongSender {
        rank: Rank,
        expected: SpId,
        got: SpId,
    },
    /// An abort from an SP outside the communicator.
    NotMember {
        sp: SpId,
    },
    DuplicateAnnounce {
        src: Rank,
        dst: Rank,
    },
    /// Ack for a block that was not announced or is already acknowledged.
    UnexpectedAck {
        src: Rank,
        dst: Rank,
    },
    /// `offset + len` overflows `u64`.
    Overflow {
        src: Rank,
        dst: Rank,
    },
}

impl fmt::Display for MsgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MsgError::RankOutOfRange { rank, size } => {
                write!(f, "rank {rank} out of range for comm size {size}")
            }
            MsgError::NotLocal { rank } => write!(f, "rank {rank} is not served by this SP"),
            MsgError::WrongSender {
                rank,
                expected,
                got,
            } => write!(
                f,
                "message about rank {rank} from SP {got}, rank is served by SP {expected}"
            ),
            MsgError::NotMember { sp } => write!(f, "SP {sp} is not part of the communicator"),
            MsgError::DuplicateAnnounce { src, dst } => {
                write!(f, "duplicate announcement {src}->{dst}")
            }
            MsgError::UnexpectedAck { src, dst } => write!(f, "unexpected ack {src}->{dst}"),
            MsgError::Overflow { src, dst } => {
                write!(f, "announcement {src}->{dst}: offset+len overflows")
            }
        }
    }
}

impl std::error::Error for MsgError {}

/// Counters for drivers, tests and the simulator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Announcements queued because their destination rank had not posted
    /// (or the membership was not known) when they arrived.
    pub late_announcements: u64,
    /// Announcements queued before the membership was known that turned out
    /// to be invalid once it was (protocol violations that could not be
    /// reported as `MsgError`).
    pub discarded_announcements: u64,
    /// `handle_copy_done` calls for unknown copy ids (ignored).
    pub unknown_copy_done: u64,
    /// Messages ignored because their sender was declared lost.
    pub ignored_from_lost_sp: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RecvState {
    /// Not announced yet.
    Waiting,
    /// A copy into the receive buffer is in flight.
    Copying,
    /// Copied, or decided without copying.
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SendState {
    /// Never announced (posted after an abort).
    NotSent,
    /// Announced, not acknowledged: the block may be read at any time.
    Pending,
    Acked,
    /// Announced to a rank of a lost SP: nobody will read it.
    Abandoned,
}

#[derive(Clone, Debug)]
struct LocalRank<K> {
    send_key: K,
    recv_key: K,
    send_counts: Vec<u64>,
    send_displs: Vec<u64>,
    recv_counts: Vec<u64>,
    recv_displs: Vec<u64>,
    recv: Vec<RecvState>,
    send: Vec<SendState>,
    /// Sources whose block is not `Done`.
    recv_pending: usize,
    /// Destinations whose block is `Pending`.
    send_pending: usize,
    /// Copies writing into this rank's receive buffer.
    copies_in_flight: usize,
    out: Outcome,
}

#[derive(Clone, Debug)]
struct Queued<K> {
    from: SpId,
    key: K,
    offset: u64,
    len: u64,
}

/// The per-SP state machine of one ring `Ialltoallv` instance.
#[derive(Clone, Debug)]
pub struct Alltoallv<K> {
    key: CollKey,
    me: SpId,
    members: Option<Vec<SpId>>,
    /// Number of comm ranks served by this SP (valid once `members` is known).
    local_count: usize,
    /// Posted local ranks.
    ranks: BTreeMap<Rank, LocalRank<K>>,
    /// Posted local ranks that completed.
    completed: usize,
    /// Local ranks declared lost before they posted.
    lost_unposted: BTreeSet<Rank>,
    /// Announcements waiting for their destination to post, by (dst, src).
    queued: BTreeMap<(Rank, Rank), Queued<K>>,
    /// Copies in flight: id -> (dst, src).
    copies: BTreeMap<u64, (Rank, Rank)>,
    next_copy: u64,
    abort: Abort,
    /// The abort originated here (local abort, peer loss, rank loss) and
    /// must be broadcast to the communicator.
    abort_local: bool,
    lost_sps: BTreeSet<SpId>,
    actions: VecDeque<Action<K>>,
    /// Messages to this SP itself, processed before returning to the driver.
    internal: VecDeque<Msg<K>>,
    stats: Stats,
}

common_api!(Alltoallv);

impl<K: Clone + fmt::Debug + PartialEq> Alltoallv<K> {
    /// Create an instance; the driver may do so on the first event of any
    /// kind for `key` (a peer message can arrive before any local post).
    pub fn new(key: CollKey, cfg: Config) -> Self {
        Alltoallv {
            key,
            me: cfg.me,
            members: None,
            local_count: 0,
            ranks: BTreeMap::new(),
            completed: 0,
            lost_unposted: BTreeSet::new(),
            queued: BTreeMap::new(),
            copies: BTreeMap::new(),
            next_copy: 0,
            abort: Abort::default(),
            abort_local: false,
            lost_sps: BTreeSet::new(),
            actions: VecDeque::new(),
            internal: VecDeque::new(),
            stats: Stats::default(),
        }
    }

    /// The SP of each comm rank, once a local rank has posted.
    pub fn members(&self) -> Option<&[SpId]> {
        self.members.as_deref()
    }

    /// The abort status, if the instance was aborted.
    /// Copies emitted and not yet reported done.
    pub fn copies_in_flight(&self) -> usize {
        self.copies.len()
    }

    /// A local rank posted its part of the collective.
    pub fn handle_post(&mut self, _now: Nanos, post: Post<K>) -> Result<(), PostError> {
        self.validate_post(&post)?;
        let Post {
            rank,
            members,
            send_key,
            recv_key,
            send_counts,
            send_displs,
            recv_counts,
            recv_displs,
        } = post;
        let p = members.len();
        if self.members.is_none() {
            self.learn_membership(members);
        }
        let aborted = self.abort.status;
        let mut st = LocalRank {
            send_key,
            recv_key,
            send_counts,
            send_displs,
            recv_counts,
            recv_displs,
            recv: vec![RecvState::Waiting; p],
            send: vec![SendState::NotSent; p],
            recv_pending: p,
            send_pending: 0,
            copies_in_flight: 0,
            out: Outcome::new(),
        };
        if let Some(status) = aborted {
            // Nothing will be exchanged: complete right away, no announcements.
            st.out.set_error(status);
            self.ranks.insert(rank, st);
        } else {
            let r = rank as usize;
            let mut announces = Vec::with_capacity(p);
            for i in 0..p {
                let d = (r + i) % p;
                st.send[d] = SendState::Pending;
                announces.push((
                    d,
                    Msg::Announce {
                        src: rank,
                        dst: d as Rank,
                        key: st.send_key.clone(),
                        offset: st.send_displs[d],
                        len: st.send_counts[d],
                    },
                ));
            }
            st.send_pending = p;
            self.ranks.insert(rank, st);
            for (d, msg) in announces {
                let to = self.member(d as Rank);
                self.send(to, msg);
            }
            // Serve the announcements that arrived before this rank posted.
            let waiting: Vec<(Rank, Rank)> = self
                .queued
                .range((rank, 0)..=(rank, Rank::MAX))
                .map(|(k, _)| *k)
                .collect();
            for (dst, src) in waiting {
                if let Some(q) = self.queued.remove(&(dst, src)) {
                    let res = self.deliver_announce(q.from, src, dst, q.key, q.offset, q.len);
                    debug_assert!(res.is_ok(), "queued announcement rejected: {res:?}");
                }
            }
        }
        self.run_internal();
        self.check_complete(rank);
        Ok(())
    }

    /// A message from SP `from` for this instance.
    pub fn handle_msg(&mut self, _now: Nanos, from: SpId, msg: Msg<K>) -> Result<(), MsgError> {
        let res = self.process(from, msg);
        self.run_internal();
        res
    }

    /// The copy `id` finished with `status` (anything but `Ok` means the
    /// receive buffer content of that block is undefined).
    pub fn handle_copy_done(&mut self, _now: Nanos, id: CopyId, status: Status) {
        let Some((dst, src)) = self.copies.remove(&id.0) else {
            self.stats.unknown_copy_done += 1;
            return;
        };
        if let Some(r) = self.ranks.get_mut(&dst) {
            r.recv[src as usize] = RecvState::Done;
            r.recv_pending -= 1;
            r.copies_in_flight -= 1;
            r.out.set_error(status);
        }
        let to = self.member(src);
        self.send(to, Msg::Ack { src, dst, status });
        self.check_complete(dst);
        self.run_internal();
    }

    /// SP `sp` died. If it serves a rank of this communicator, every local
    /// rank not yet complete completes with `PeerFailed` (once no copy
    /// touches its buffers) and the abort is broadcast to the other SPs.
    /// Blocks announced to ranks of `sp` are considered never read.
    /// Messages from `sp` are ignored from now on.
    pub fn handle_peer_lost(&mut self, _now: Nanos, sp: SpId) {
        if sp == self.me || !self.lost_sps.insert(sp) {
            return;
        }
        self.queued.retain(|_, q| q.from != sp);
        let Some(members) = &self.members else {
            return; // checked when the membership becomes known
        };
        if !members.contains(&sp) {
            return;
        }
        for st in self.ranks.values_mut() {
            for (d, s) in st.send.iter_mut().enumerate() {
                if *s == SendState::Pending && members[d] == sp {
                    *s = SendState::Abandoned;
                    st.send_pending -= 1;
                }
            }
        }
        self.enter_abort(Status::PeerFailed, true);
        self.run_internal();
    }

    /// Local abort: every local rank not yet complete completes with
    /// `status` (once no copy touches its buffers), ranks posting later
    /// complete immediately, and every other SP of the communicator is sent
    /// an `Abort` (as soon as the membership is known). `Status::Ok` is
    /// replaced by `Status::Aborted`.
    pub fn abort(&mut self, _now: Nanos, status: Status) {
        self.enter_abort(status, true);
        self.run_internal();
    }

    /// Local host `rank` died (extension of `abort`): if it already completed
    /// nothing happens; otherwise the instance aborts with `RankFailed`. If
    /// the rank had posted it still gets its `Complete`; if not, it will
    /// never post and no longer keeps the instance from finishing. Ignored
    /// if `rank` is known not to be served by this SP.
    pub fn handle_rank_lost(&mut self, _now: Nanos, rank: Rank) {
        if let Some(members) = &self.members {
            if members.get(rank as usize) != Some(&self.me) {
                return;
            }
        }
        let out = self.ranks.get_mut(&rank).map(|st| &mut st.out);
        if !lose_rank(out, &mut self.lost_unposted, rank) {
            return;
        }
        self.enter_abort(Status::RankFailed, true);
        self.run_internal();
    }

    /// The membership is known, every local rank completed (or was lost
    /// before posting), no copy is in flight and every action was polled:
    /// the driver may drop the instance.
    pub fn is_finished(&self) -> bool {
        self.members.is_some()
            && self.completed + self.lost_unposted.len() == self.local_count
            && self.copies.is_empty()
            && self.actions.is_empty()
    }

    // ---- internals -------------------------------------------------------

    fn validate_post(&self, post: &Post<K>) -> Result<(), PostError> {
        let p = post.members.len();
        let rank = post.rank;
        if rank as usize >= p {
            return Err(PostError::RankOutOfRange { rank, size: p });
        }
        let served_by = post.members[rank as usize];
        if served_by != self.me {
            return Err(PostError::NotMine { rank, served_by });
        }
        let vectors: [(&'static str, &Vec<u64>); 4] = [
            ("send_counts", &post.send_counts),
            ("send_displs", &post.send_displs),
            ("recv_counts", &post.recv_counts),
            ("recv_displs", &post.recv_displs),
        ];
        for (field, v) in vectors {
            if v.len() != p {
                return Err(PostError::LengthMismatch {
                    field,
                    len: v.len(),
                    expected: p,
                });
            }
        }
        if let Some(m) = &self.members {
            if *m != post.members {
                return Err(PostError::MembersDisagree);
            }
        }
        if self.ranks.contains_key(&rank) {
            return Err(PostError::DuplicatePost { rank });
        }
        if self.lost_unposted.contains(&rank) {
            return Err(PostError::RankLost { rank });
        }
        let pairs = [
            ("send", &post.send_displs, &post.send_counts),
            ("recv", &post.recv_displs, &post.recv_counts),
        ];
        for (field, displs, counts) in pairs {
            if let Some(index) = (0..p).find(|&i| displs[i].checked_add(counts[i]).is_none()) {
                return Err(PostError::Overflow { rank, field, index });
            }
        }
        Ok(())
    }

    fn learn_membership(&mut self, members: Vec<SpId>) {
        let me = self.me;
        let p = members.len();
        self.local_count = members.iter().filter(|&&s| s == me).count();
        // Announcements queued blindly are validated now.
        let queued = std::mem::take(&mut self.queued);
        for ((dst, src), q) in queued {
            let ok = (dst as usize) < p
                && (src as usize) < p
                && members[dst as usize] == me
                && members[src as usize] == q.from;
            if ok {
                self.queued.insert((dst, src), q);
            } else {
                self.stats.discarded_announcements += 1;
            }
        }
        self.lost_unposted
            .retain(|&r| (r as usize) < p && members[r as usize] == me);
        let peer_lost = self.lost_sps.iter().any(|s| members.contains(s));
        self.members = Some(members);
        if peer_lost {
            self.enter_abort(Status::PeerFailed, true);
        } else if self.abort.is_some() {
            self.maybe_broadcast_abort();
        }
    }

    fn member(&self, rank: Rank) -> SpId {
        self.members.as_ref().expect("membership known")[rank as usize]
    }

    fn send(&mut self, to: SpId, msg: Msg<K>) {
        if to == self.me {
            self.internal.push_back(msg);
        } else if !self.lost_sps.contains(&to) {
            self.actions.push_back(Action::Send { to, msg });
        }
    }

    fn run_internal(&mut self) {
        while let Some(msg) = self.internal.pop_front() {
            let me = self.me;
            let res = self.process(me, msg);
            debug_assert!(res.is_ok(), "internal message rejected: {res:?}");
        }
    }

    fn process(&mut self, from: SpId, msg: Msg<K>) -> Result<(), MsgError> {
        if self.lost_sps.contains(&from) {
            self.stats.ignored_from_lost_sp += 1;
            return Ok(());
        }
        match msg {
            Msg::Announce {
                src,
                dst,
                key,
                offset,
                len,
            } => self.on_announce(from, src, dst, key, offset, len),
            Msg::Ack { src, dst, status } => self.on_ack(from, src, dst, status),
            Msg::Abort { status } => {
                if let Some(m) = &self.members {
                    if !m.contains(&from) {
                        return Err(MsgError::NotMember { sp: from });
                    }
                }
                self.enter_abort(status, false);
                Ok(())
            }
        }
    }

    fn check_ranks(&self, ranks: [Rank; 2]) -> Result<(), MsgError> {
        let size = self.members.as_ref().map_or(0, Vec::len);
        match ranks.into_iter().find(|&r| r as usize >= size) {
            Some(rank) => Err(MsgError::RankOutOfRange { rank, size }),
            None => Ok(()),
        }
    }

    fn on_announce(
        &mut self,
        from: SpId,
        src: Rank,
        dst: Rank,
        key: K,
        offset: u64,
        len: u64,
    ) -> Result<(), MsgError> {
        if offset.checked_add(len).is_none() {
            return Err(MsgError::Overflow { src, dst });
        }
        if self.members.is_none() {
            if let Some(status) = self.abort.status {
                // Cannot validate, but the sender must not wait for us; make
                // sure its SP learns about the abort too.
                self.send(from, Msg::Ack { src, dst, status });
                self.notify_abort(from);
                return Ok(());
            }
            return self.queue_announce(from, src, dst, key, offset, len);
        }
        self.check_ranks([src, dst])?;
        if self.member(dst) != self.me {
            return Err(MsgError::NotLocal { rank: dst });
        }
        let expected = self.member(src);
        if expected != from {
            return Err(MsgError::WrongSender {
                rank: src,
                expected,
                got: from,
            });
        }
        self.deliver_announce(from, src, dst, key, offset, len)
    }

    /// Keeps an announcement whose destination cannot take it yet (membership
    /// unknown, or `dst` has not posted): a late arrival.
    fn queue_announce(
        &mut self,
        from: SpId,
        src: Rank,
        dst: Rank,
        key: K,
        offset: u64,
        len: u64,
    ) -> Result<(), MsgError> {
        if self.queued.contains_key(&(dst, src)) {
            return Err(MsgError::DuplicateAnnounce { src, dst });
        }
        let q = Queued {
            from,
            key,
            offset,
            len,
        };
        self.queued.insert((dst, src), q);
        self.stats.late_announcements += 1;
        Ok(())
    }

    /// A validated announcement (membership known, `dst` local, `from`
    /// serves `src`).
    fn deliver_announce(
        &mut self,
        from: SpId,
        src: Rank,
        dst: Rank,
        key: K,
        offset: u64,
        len: u64,
    ) -> Result<(), MsgError> {
        let abort = self.abort.status;
        let Some(st) = self.ranks.get_mut(&dst) else {
            if let Some(status) = abort {
                self.send(from, Msg::Ack { src, dst, status });
                return Ok(());
            }
            return self.queue_announce(from, src, dst, key, offset, len);
        };
        let s = src as usize;
        if st.recv[s] != RecvState::Waiting {
            return Err(MsgError::DuplicateAnnounce { src, dst });
        }
        let ack = if let Some(status) = abort {
            status
        } else if len != st.recv_counts[s] {
            st.out.set_error(Status::CountMismatch);
            Status::CountMismatch
        } else if len == 0 {
            Status::Ok
        } else {
            let id = CopyId(self.next_copy);
            self.next_copy += 1;
            st.recv[s] = RecvState::Copying;
            st.copies_in_flight += 1;
            let copy = Copy {
                id,
                src_rank: src,
                src_key: key,
                src_offset: offset,
                dst_rank: dst,
                dst_key: st.recv_key.clone(),
                dst_offset: st.recv_displs[s],
                len,
            };
            self.copies.insert(id.0, (dst, src));
            self.actions.push_back(Action::Copy(copy));
            return Ok(());
        };
        st.recv[s] = RecvState::Done;
        st.recv_pending -= 1;
        self.send(
            from,
            Msg::Ack {
                src,
                dst,
                status: ack,
            },
        );
        self.check_complete(dst);
        Ok(())
    }

    fn on_ack(&mut self, from: SpId, src: Rank, dst: Rank, status: Status) -> Result<(), MsgError> {
        if self.members.is_none() {
            return Err(MsgError::UnexpectedAck { src, dst });
        }
        self.check_ranks([src, dst])?;
        if self.member(src) != self.me {
            return Err(MsgError::NotLocal { rank: src });
        }
        let expected = self.member(dst);
        if expected != from {
            return Err(MsgError::WrongSender {
                rank: dst,
                expected,
                got: from,
            });
        }
        let Some(st) = self.ranks.get_mut(&src) else {
            return Err(MsgError::UnexpectedAck { src, dst });
        };
        let d = dst as usize;
        if st.send[d] != SendState::Pending {
            return Err(MsgError::UnexpectedAck { src, dst });
        }
        st.send[d] = SendState::Acked;
        st.send_pending -= 1;
        st.out.set_error(status);
        self.check_complete(src);
        Ok(())
    }

    fn enter_abort(&mut self, status: Status, local: bool) {
        let (_, status) = self.abort.enter(status);
        self.abort_local |= local;
        fail_pending(self.ranks.values_mut().map(|st| &mut st.out), status);
        // Nobody will read into a rank that has not posted: release senders.
        let queued = std::mem::take(&mut self.queued);
        let blind = self.members.is_none();
        for ((dst, src), q) in queued {
            self.send(q.from, Msg::Ack { src, dst, status });
            if blind {
                self.notify_abort(q.from);
            }
        }
        self.maybe_broadcast_abort();
        let ranks: Vec<Rank> = self.ranks.keys().copied().collect();
        for r in ranks {
            self.check_complete(r);
        }
    }

    fn maybe_broadcast_abort(&mut self) {
        if !self
            .abort
            .start_broadcast(self.abort_local && self.members.is_some())
        {
            return;
        }
        let members = self.members.as_ref().unwrap();
        let sps: BTreeSet<SpId> = members.iter().copied().collect();
        for sp in sps {
            self.notify_abort(sp);
        }
    }

    fn notify_abort(&mut self, sp: SpId) {
        if let Some(status) = self.abort.notice_for(self.me, &self.lost_sps, sp) {
            self.actions.push_back(Action::Send {
                to: sp,
                msg: Msg::Abort { status },
            });
        }
    }

    fn check_complete(&mut self, rank: Rank) {
        let aborted = self.abort.is_some();
        let Some(st) = self.ranks.get_mut(&rank) else {
            return;
        };
        if st.out.completed || st.copies_in_flight > 0 || st.send_pending > 0 {
            return;
        }
        if !aborted && st.recv_pending > 0 {
            return;
        }
        st.out.completed = true;
        self.completed += 1;
        self.actions.push_back(Action::Complete {
            rank,
            status: st.out.status,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::testnet::{Machine, Out};
    use crate::CommId;

    /// Key material in the tests: (buffer kind, rank).
    type Tag = (char, Rank);

    const KEY: CollKey = CollKey {
        job: 1,
        comm: CommId { leader: 0, id: 7 },
        seq: 3,
    };

    fn prefix(counts: &[u64]) -> Vec<u64> {
        let mut at = 0;
        counts
            .iter()
            .map(|c| {
                let d = at;
                at += c + 1; // a gap between blocks
                d
            })
            .collect()
    }

    fn post(rank: Rank, members: &[SpId], send: Vec<u64>, recv: Vec<u64>) -> Post<Tag> {
        Post {
            rank,
            members: members.to_vec(),
            send_key: ('s', rank),
            recv_key: ('r', rank),
            send_displs: prefix(&send),
            send_counts: send,
            recv_displs: prefix(&recv),
            recv_counts: recv,
        }
    }

    /// Counts where rank s sends `m[s][d]` bytes to d.
    fn matrix_post(rank: Rank, members: &[SpId], m: &[Vec<u64>]) -> Post<Tag> {
        let r = rank as usize;
        let recv = (0..m.len()).map(|s| m[s][r]).collect();
        post(rank, members, m[r].clone(), recv)
    }

    type Net = crate::sim::testnet::Net<Alltoallv<Tag>>;

    impl Machine for Alltoallv<Tag> {
        type Post = Post<Tag>;
        type Msg = Msg<Tag>;
        type Copy = Copy<Tag>;

        fn create(sp: SpId) -> Self {
            Alltoallv::new(KEY, Config { me: sp })
        }

        fn post(&mut self, now: Nanos, post: Post<Tag>) {
            self.handle_post(now, post).unwrap();
        }

        fn msg(&mut self, now: Nanos, from: SpId, msg: Msg<Tag>) {
            self.handle_msg(now, from, msg).unwrap();
        }

        fn copy_done(&mut self, now: Nanos, copy: &Copy<Tag>, status: Status) {
            self.handle_copy_done(now, copy.id, status);
        }

        fn poll(&mut self) -> Option<Out<Msg<Tag>, Copy<Tag>>> {
            Some(match self.poll_action()? {
                Action::Send { to, msg } => Out::Send { to, msg },
                Action::Copy(c) => Out::Copy(c),
                Action::Complete { rank, status } => Out::Complete { rank, status },
            })
        }

        fn check_copy(&self, sp: SpId, c: &Copy<Tag>) {
            assert_eq!(self.members().unwrap()[c.dst_rank as usize], sp);
        }
    }

    #[test]
    fn two_sps_three_ranks_all_blocks_copied_once() {
        let members = [0, 1, 0];
        let m = vec![vec![3, 0, 5], vec![2, 4, 0], vec![0, 1, 6]];
        let mut net = Net::new(2);
        for r in 0..3 {
            net.post(members[r as usize], matrix_post(r, &members, &m));
        }
        net.run();
        for r in 0..3 {
            assert_eq!(net.status(r), Some(Status::Ok), "rank {r}");
        }
        let mut blocks: Vec<(Rank, Rank, u64, u64, u64)> = net
            .copied
            .iter()
            .map(|c| {
                assert_eq!(c.src_key, ('s', c.src_rank));
                assert_eq!(c.dst_key, ('r', c.dst_rank));
                (c.src_rank, c.dst_rank, c.src_offset, c.dst_offset, c.len)
            })
            .collect();
        blocks.sort();
        let mut expected = Vec::new();
        for s in 0..3 {
            for d in 0..3 {
                if m[s][d] > 0 {
                    let sd = prefix(&m[s])[d];
                    let col: Vec<u64> = (0..3).map(|x| m[x][d]).collect();
                    let dd = prefix(&col)[s];
                    expected.push((s as Rank, d as Rank, sd, dd, m[s][d]));
                }
            }
        }
        assert_eq!(blocks, expected);
        for sp in 0..2 {
            assert!(net.sp(sp).is_finished());
            assert_eq!(net.sp(sp).poll_timeout(), None);
        }
    }

    #[test]
    fn ring_order_starts_with_self() {
        let members = [0, 1, 2, 3];
        let mut net = Net::new(4);
        net.post(2, post(2, &members, vec![1; 4], vec![1; 4]));
        let dsts: Vec<Rank> = net
            .msgs
            .iter()
            .map(|(_, _, m)| match m {
                Msg::Announce { dst, .. } => *dst,
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        // The self block (2 -> 2) is delivered internally and copied.
        assert_eq!(dsts, vec![3, 0, 1]);
        assert_eq!(net.copies.len(), 1);
        assert_eq!(net.copies[0].1.src_rank, 2);
        assert_eq!(net.copies[0].1.dst_rank, 2);
    }

    #[test]
    fn late_arrival_is_queued_then_served() {
        let members = [0, 1];
        let m = vec![vec![1, 2], vec![3, 4]];
        let mut net = Net::new(2);
        net.post(0, matrix_post(0, &members, &m));
        net.run();
        // SP 1 learned about the collective from a message only.
        assert_eq!(net.sp(1).members(), None);
        assert_eq!(net.sp(1).stats().late_announcements, 1);
        assert!(net.completes.is_empty());
        assert!(!net.sp(0).is_finished());
        net.post(1, matrix_post(1, &members, &m));
        net.run();
        assert_eq!(net.status(0), Some(Status::Ok));
        assert_eq!(net.status(1), Some(Status::Ok));
        assert_eq!(net.copied.len(), 4);
        assert!(net.sp(0).is_finished() && net.sp(1).is_finished());
    }

    #[test]
    fn zero_length_blocks_complete_without_copies() {
        let members = [0, 1, 1];
        let m = vec![vec![0; 3]; 3];
        let mut net = Net::new(2);
        for r in 0..3 {
            net.post(members[r as usize], matrix_post(r, &members, &m));
        }
        net.run();
        assert!(net.copied.is_empty());
        for r in 0..3 {
            assert_eq!(net.status(r), Some(Status::Ok));
        }
    }

    #[test]
    fn single_rank_self_block() {
        let mut net = Net::new(1);
        net.post(0, post(0, &[0], vec![8], vec![8]));
        assert!(net.msgs.is_empty());
        assert_eq!(net.copies.len(), 1);
        assert!(
            net.completes.is_empty(),
            "complete while own copy in flight"
        );
        net.run();
        assert_eq!(net.status(0), Some(Status::Ok));

        let mut net = Net::new(1);
        net.post(0, post(0, &[0], vec![0], vec![0]));
        assert_eq!(net.status(0), Some(Status::Ok));
        assert!(net.sp(0).is_finished());
    }

    #[test]
    fn count_mismatch_fails_both_sides_without_hanging() {
        let members = [0, 1, 2];
        let m = vec![vec![1, 4, 1], vec![1, 1, 1], vec![1, 1, 1]];
        let mut net = Net::new(3);
        for r in 0..3 {
            let mut p = matrix_post(r, &members, &m);
            if r == 1 {
                p.recv_counts[0] = 5; // rank 1 expects 5 bytes from rank 0, gets 4
            }
            net.post(r, p);
        }
        net.run();
        assert_eq!(net.status(0), Some(Status::CountMismatch));
        assert_eq!(net.status(1), Some(Status::CountMismatch));
        assert_eq!(net.status(2), Some(Status::Ok));
        assert!(!net
            .copied
            .iter()
            .any(|c| c.src_rank == 0 && c.dst_rank == 1));
        assert_eq!(net.copied.len(), 8);
    }

    #[test]
    fn failed_copy_reports_error_to_both_sides() {
        let members = [0, 1];
        let m = vec![vec![0, 4], vec![0, 0]];
        let mut net = Net::new(2);
        net.post(0, matrix_post(0, &members, &m));
        net.post(1, matrix_post(1, &members, &m));
        net.deliver_all();
        assert!(net.finish_copy(Status::AccessError));
        net.run();
        assert_eq!(net.status(0), Some(Status::AccessError));
        assert_eq!(net.status(1), Some(Status::AccessError));
    }

    #[test]
    fn protocol_violations_are_errors_and_change_nothing() {
        let members = [0, 1];
        let mut a: Alltoallv<Tag> = Alltoallv::new(KEY, Config { me: 1 });
        let ann = |src, dst, len| Msg::Announce {
            src,
            dst,
            key: ('s', src),
            offset: 0,
            len,
        };
        // Before membership: queued, duplicates still detected.
        a.handle_msg(0, 0, ann(0, 1, 2)).unwrap();
        assert_eq!(
            a.handle_msg(0, 0, ann(0, 1, 2)),
            Err(MsgError::DuplicateAnnounce { src: 0, dst: 1 })
        );
        assert_eq!(
            a.handle_msg(
                0,
                0,
                Msg::Ack {
                    src: 1,
                    dst: 0,
                    status: Status::Ok
                }
            ),
            Err(MsgError::UnexpectedAck { src: 1, dst: 0 })
        );
        a.handle_post(0, post(1, &members, vec![2, 3], vec![2, 3]))
            .unwrap();
        let mut copies = 0;
        while let Some(act) = a.poll_action() {
            copies += matches!(act, Action::Copy(_)) as usize;
        }
        assert_eq!(copies, 2, "queued announce and self block");
        assert_eq!(
            a.handle_msg(0, 0, ann(0, 1, 2)),
            Err(MsgError::DuplicateAnnounce { src: 0, dst: 1 })
        );
        assert_eq!(
            a.handle_msg(0, 0, ann(5, 1, 2)),
            Err(MsgError::RankOutOfRange { rank: 5, size: 2 })
        );
        assert_eq!(
            a.handle_msg(0, 0, ann(0, 0, 2)),
            Err(MsgError::NotLocal { rank: 0 })
        );
        assert_eq!(
            a.handle_msg(0, 7, ann(0, 1, 2)),
            Err(MsgError::WrongSender {
                rank: 0,
                expected: 0,
                got: 7
            })
        );
        assert_eq!(
            a.handle_msg(
                0,
                0,
                Msg::Announce {
                    src: 0,
                    dst: 1,
                    key: ('s', 0),
                    offset: u64::MAX,
                    len: 2
                }
            ),
            Err(MsgError::Overflow { src: 0, dst: 1 })
        );
        // Ack for a block never announced to rank 0 ... rank 1 announced to
        // 0 already; a second ack is unexpected.
        a.handle_msg(
            0,
            0,
            Msg::Ack {
                src: 1,
                dst: 0,
                status: Status::Ok,
            },
        )
        .unwrap();
        assert_eq!(
            a.handle_msg(
                0,
                0,
                Msg::Ack {
                    src: 1,
                    dst: 0,
                    status: Status::Ok
                }
            ),
            Err(MsgError::UnexpectedAck { src: 1, dst: 0 })
        );
        assert_eq!(
            a.handle_msg(
                0,
                9,
                Msg::Abort {
                    status: Status::Aborted
                }
            ),
            Err(MsgError::NotMember { sp: 9 })
        );
        assert_eq!(a.abort_status(), None);
        assert!(a.poll_action().is_none());
        // Unknown copy ids are counted and ignored.
        a.handle_copy_done(0, CopyId(999), Status::Ok);
        assert_eq!(a.stats().unknown_copy_done, 1);
    }

    #[test]
    fn invalid_posts_are_rejected() {
        let mut a: Alltoallv<Tag> = Alltoallv::new(KEY, Config { me: 0 });
        let m = [0, 1];
        assert_eq!(
            a.handle_post(0, post(2, &m, vec![0; 2], vec![0; 2])),
            Err(PostError::RankOutOfRange { rank: 2, size: 2 })
        );
        assert_eq!(
            a.handle_post(0, post(1, &m, vec![0; 2], vec![0; 2])),
            Err(PostError::NotMine {
                rank: 1,
                served_by: 1
            })
        );
        assert_eq!(
            a.handle_post(0, post(0, &m, vec![0; 3], vec![0; 2])),
            Err(PostError::LengthMismatch {
                field: "send_counts",
                len: 3,
                expected: 2
            })
        );
        let mut p = post(0, &m, vec![0; 2], vec![0; 2]);
        p.recv_displs[1] = u64::MAX;
        p.recv_counts[1] = 1;
        assert_eq!(
            a.handle_post(0, p),
            Err(PostError::Overflow {
                rank: 0,
                field: "recv",
                index: 1
            })
        );
        assert_eq!(a.members(), None, "rejected posts leave no trace");
        a.handle_post(0, post(0, &[0, 0, 1], vec![0; 3], vec![0; 3]))
            .unwrap();
        assert_eq!(
            a.handle_post(0, post(0, &[0, 0, 1], vec![0; 3], vec![0; 3])),
            Err(PostError::DuplicatePost { rank: 0 })
        );
        assert_eq!(
            a.handle_post(0, post(1, &[0, 0, 0], vec![0; 3], vec![0; 3])),
            Err(PostError::MembersDisagree)
        );
    }

    #[test]
    fn abort_before_any_post() {
        let members = [0, 1, 1];
        let m = vec![vec![2; 3]; 3];
        let mut net = Net::new(2);
        // SP 1 aborts before knowing anything about the collective.
        net.sp(1).abort(0, Status::Aborted);
        net.collect(1);
        assert!(
            net.msgs.is_empty(),
            "membership unknown: nobody to tell yet"
        );
        net.post(0, matrix_post(0, &members, &m));
        net.run();
        // SP 1 answered the announcements and told SP 0 about the abort.
        assert_eq!(net.status(0), Some(Status::Aborted));
        assert!(net.sp(0).is_finished());
        net.post(1, matrix_post(1, &members, &m));
        net.post(1, matrix_post(2, &members, &m));
        net.run();
        assert_eq!(net.status(1), Some(Status::Aborted));
        assert_eq!(net.status(2), Some(Status::Aborted));
        assert!(net.sp(1).is_finished());
        // Only the self block of rank 0 may have been copied.
        assert!(net
            .copied
            .iter()
            .all(|c| c.src_rank == 0 && c.dst_rank == 0));
    }

    #[test]
    fn abort_after_post_waits_for_copies_in_flight() {
        let members = [0, 1, 2];
        let m = vec![vec![3; 3]; 3];
        let mut net = Net::new(3);
        net.post(0, matrix_post(0, &members, &m));
        net.post(1, matrix_post(1, &members, &m));
        net.deliver_all();
        // Copies into ranks 0 and 1 are in flight; rank 2 never posts.
        let in_flight = net.copies.len();
        assert!(in_flight >= 2);
        net.sp(0).abort(0, Status::RankFailed);
        net.collect(0);
        net.deliver_all();
        assert_eq!(net.sp(1).abort_status(), Some(Status::RankFailed));
        assert_eq!(net.sp(2).abort_status(), Some(Status::RankFailed));
        assert!(
            net.completes.is_empty(),
            "nobody completes while copies touching its buffers run"
        );
        net.run();
        assert_eq!(net.status(0), Some(Status::RankFailed));
        assert_eq!(net.status(1), Some(Status::RankFailed));
        assert_eq!(net.copied.len(), in_flight, "no new copies after the abort");
        net.post(2, matrix_post(2, &members, &m));
        net.run();
        assert_eq!(net.status(2), Some(Status::RankFailed));
        for sp in 0..3 {
            assert!(net.sp(sp).is_finished(), "sp {sp}");
        }
    }

    #[test]
    fn abort_from_peer_completes_later_posts_immediately() {
        let members = [0, 1];
        let mut a: Alltoallv<Tag> = Alltoallv::new(KEY, Config { me: 1 });
        a.handle_msg(
            0,
            0,
            Msg::Abort {
                status: Status::Aborted,
            },
        )
        .unwrap();
        // A second abort is harmless.
        a.handle_msg(
            0,
            0,
            Msg::Abort {
                status: Status::PeerFailed,
            },
        )
        .unwrap();
        a.handle_post(0, post(1, &members, vec![1, 1], vec![1, 1]))
            .unwrap();
        assert_eq!(
            a.poll_action(),
            Some(Action::Complete {
                rank: 1,
                status: Status::Aborted
            })
        );
        assert_eq!(
            a.poll_action(),
            None,
            "peer-originated abort is not re-broadcast"
        );
        assert!(a.is_finished());
    }

    #[test]
    fn peer_lost_fails_ranks_and_settles_blocks_to_it() {
        let members = [0, 1, 2];
        let m = vec![vec![1; 3]; 3];
        let mut net = Net::new(3);
        for r in 0..3 {
            net.post(r, matrix_post(r, &members, &m));
        }
        // SP 2 dies before processing anything.
        net.dead.insert(2);
        net.run();
        assert!(net.completes.is_empty());
        for sp in 0..2 {
            net.sp(sp).handle_peer_lost(0, 2);
            net.collect(sp);
        }
        net.run();
        assert_eq!(net.status(0), Some(Status::PeerFailed));
        assert_eq!(net.status(1), Some(Status::PeerFailed));
        assert_eq!(net.status(2), None);
        assert!(net.sp(0).is_finished() && net.sp(1).is_finished());
        // Repeated or irrelevant loss notifications are harmless.
        net.sp(0).handle_peer_lost(0, 2);
        net.sp(0).handle_peer_lost(0, 0);
        net.collect(0);
        assert!(net.msgs.is_empty());
    }

    #[test]
    fn peer_lost_before_membership_is_applied_on_post() {
        let mut a: Alltoallv<Tag> = Alltoallv::new(KEY, Config { me: 0 });
        a.handle_peer_lost(0, 5); // not in the communicator
        a.handle_peer_lost(0, 1);
        a.handle_post(0, post(0, &[0, 1, 2], vec![1; 3], vec![1; 3]))
            .unwrap();
        let acts: Vec<_> = std::iter::from_fn(|| a.poll_action()).collect();
        assert_eq!(
            acts,
            vec![
                Action::Send {
                    to: 2,
                    msg: Msg::Abort {
                        status: Status::PeerFailed
                    }
                },
                Action::Complete {
                    rank: 0,
                    status: Status::PeerFailed
                },
            ]
        );
    }

    #[test]
    fn rank_lost_before_post_lets_instance_finish() {
        let members = [0, 0, 1];
        let m = vec![vec![1; 3]; 3];
        let mut net = Net::new(2);
        net.post(0, matrix_post(0, &members, &m));
        net.post(1, matrix_post(2, &members, &m));
        net.deliver_all();
        net.sp(0).handle_rank_lost(0, 1);
        net.collect(0);
        net.run();
        assert_eq!(net.status(0), Some(Status::RankFailed));
        assert_eq!(net.status(1), None, "never posted: no completion");
        assert_eq!(net.status(2), Some(Status::RankFailed));
        assert!(net.sp(0).is_finished() && net.sp(1).is_finished());
        assert_eq!(
            net.sp(0).handle_post(0, matrix_post(1, &members, &m)),
            Err(PostError::RankLost { rank: 1 })
        );
    }

    #[test]
    fn rank_lost_after_it_completed_changes_nothing() {
        let mut net = Net::new(1);
        net.post(0, post(0, &[0, 0], vec![0, 0], vec![0, 0]));
        assert_eq!(net.status(0), None);
        net.post(0, post(1, &[0, 0], vec![0, 0], vec![0, 0]));
        assert_eq!(net.status(0), Some(Status::Ok));
        net.sp(0).handle_rank_lost(0, 0);
        assert_eq!(net.sp(0).abort_status(), None);
        assert!(net.sp(0).is_finished());
    }

    #[test]
    fn messages_serialize_with_serde_derive() {
        fn assert_serde<T: Serialize + for<'de> Deserialize<'de>>() {}
        assert_serde::<Msg<Tag>>();
        assert_serde::<Action<Tag>>();
        assert_serde::<Post<Tag>>();
    }
}
