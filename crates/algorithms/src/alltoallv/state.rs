//! The per-SP state of one instance, its constructor and its inputs.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RecvState {
    /// Not announced yet.
    Waiting,
    /// A copy into the receive buffer is in flight.
    Copying,
    /// Copied, or decided without copying.
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SendState {
    /// Never announced (posted after an abort).
    NotSent,
    /// Announced, not acknowledged: the block may be read at any time.
    Pending,
    Acked,
    /// Announced to a rank of a lost SP: nobody will read it.
    Abandoned,
}

#[derive(Clone, Debug)]
pub(super) struct LocalRank<K> {
    pub(super) send_key: K,
    pub(super) send_counts: Vec<u64>,
    pub(super) send_displs: Vec<u64>,
    /// `pending`: the sources whose block is not `Done`.
    pub(super) buf: VRecv<K>,
    pub(super) recv: Vec<RecvState>,
    pub(super) send: Vec<SendState>,
    /// Destinations whose block is `Pending`.
    pub(super) send_pending: usize,
    pub(super) out: Outcome,
}

/// An announcement from SP `from`.
#[derive(Clone, Debug)]
pub(super) struct Ann<K> {
    pub(super) from: SpId,
    pub(super) src: Rank,
    pub(super) dst: Rank,
    pub(super) key: K,
    pub(super) offset: u64,
    pub(super) len: u64,
}

/// The per-SP state machine of one ring `Ialltoallv` instance.
#[derive(Clone, Debug)]
pub struct Alltoallv<K> {
    pub(super) core: Core<LocalRank<K>, (Rank, Rank), Action<K>, Stats>,
    pub(super) members: Option<Vec<SpId>>,
    /// Number of comm ranks served by this SP (valid once `members` is known).
    pub(super) local_count: usize,
    /// Announcements waiting for their destination to post, by (dst, src).
    pub(super) queued: BTreeMap<(Rank, Rank), Ann<K>>,
    /// The abort originated here (local abort, peer loss, rank loss) and
    /// must be broadcast to the communicator.
    pub(super) abort_local: bool,
    /// Messages to this SP itself, processed before returning to the driver.
    pub(super) internal: VecDeque<Msg<K>>,
}

common_api!(Alltoallv, Msg<K>, settle = run_internal);

impl<K: Clone + fmt::Debug + PartialEq> Alltoallv<K> {
    /// Create an instance; the driver may do so on the first event of any
    /// kind for `key` (a peer message can arrive before any local post).
    pub fn new(key: CollKey, cfg: Config) -> Self {
        Alltoallv {
            core: Core::new(key, cfg.me),
            members: None,
            local_count: 0,
            queued: BTreeMap::new(),
            abort_local: false,
            internal: VecDeque::new(),
        }
    }

    /// The SP of each comm rank, once a local rank has posted.
    pub fn members(&self) -> Option<&[SpId]> {
        self.members.as_deref()
    }

    /// The abort status, if the instance was aborted.
    /// Copies emitted and not yet reported done.
    pub fn copies_in_flight(&self) -> usize {
        self.core.copies.len()
    }

    /// A local rank posted its part of the collective.
    pub fn handle_post(&mut self, _now: Nanos, post: Post<K>) -> Result<(), PostError> {
        self.validate_post(&post)?;
        let rank = post.rank;
        let p = post.members.len();
        if self.members.is_none() {
            self.learn_membership(post.members);
        }
        let aborted = self.core.abort.status;
        let mut st = LocalRank {
            send_key: post.send_key,
            send_counts: post.own.send_counts,
            send_displs: post.own.send_displs,
            buf: VRecv::new(post.recv_key, post.recv_counts, post.recv_displs, p),
            recv: vec![RecvState::Waiting; p],
            send: vec![SendState::NotSent; p],
            send_pending: 0,
            out: Outcome::new(),
        };
        if let Some(status) = aborted {
            // Nothing will be exchanged: complete right away, no announcements.
            st.out.set_error(status);
            self.core.ranks.insert(rank, st);
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
            self.core.ranks.insert(rank, st);
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
            for k in waiting {
                if let Some(ann) = self.queued.remove(&k) {
                    let res = self.deliver_announce(ann);
                    debug_assert!(res.is_ok(), "queued announcement rejected: {res:?}");
                }
            }
        }
        self.run_internal();
        self.check_complete(rank);
        Ok(())
    }

    /// The copy `id` finished with `status` (anything but `Ok` means the
    /// receive buffer content of that block is undefined).
    pub(super) fn copy_finished(&mut self, id: u64, status: Status) {
        let copies = &mut self.core.copies;
        let Some((dst, src)) = take_finished(copies, id, &mut self.core.stats.unknown_copy_done)
        else {
            return;
        };
        if let Some(r) = self.core.ranks.get_mut(&dst) {
            r.recv[src as usize] = RecvState::Done;
            r.buf.pending -= 1;
            r.buf.writes -= 1;
            r.out.set_error(status);
        }
        let to = self.member(src);
        self.send(to, Msg::Ack { src, dst, status });
        self.check_complete(dst);
    }

    /// SP `sp` died. If it serves a rank of this communicator, every local
    /// rank not yet complete completes with `PeerFailed` (once no copy
    /// touches its buffers) and the abort is broadcast to the other SPs.
    /// Blocks announced to ranks of `sp` are considered never read.
    /// Messages from `sp` are ignored from now on.
    pub fn handle_peer_lost(&mut self, _now: Nanos, sp: SpId) {
        if sp == self.core.me || !self.core.lost_sps.insert(sp) {
            return;
        }
        self.queued.retain(|_, q| q.from != sp);
        let Some(members) = &self.members else {
            return; // checked when the membership becomes known
        };
        if !members.contains(&sp) {
            return;
        }
        for st in self.core.ranks.values_mut() {
            for (d, s) in st.send.iter_mut().enumerate() {
                if *s == SendState::Pending && members[d] == sp {
                    *s = SendState::Abandoned;
                    st.send_pending -= 1;
                }
            }
        }
        self.enter_abort(Status::PeerFailed);
        self.run_internal();
    }

    /// The membership is known, every local rank completed (or was lost
    /// before posting), no copy is in flight and every action was polled:
    /// the driver may drop the instance.
    pub fn is_finished(&self) -> bool {
        self.members.is_some()
            && self.core.completed + self.core.lost_unposted.len() == self.local_count
            && self.core.copies.is_empty()
            && self.core.actions.is_empty()
    }
}
