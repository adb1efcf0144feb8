//! The per-SP state of one instance, its constructor and its inputs.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Have {
    Missing,
    Copying,
    Done,
}

#[derive(Clone, Debug)]
pub(super) struct LocalRank<K> {
    pub(super) buf: VRecv<K>,
    pub(super) have: Vec<Have>,
    /// Outstanding readers of its buffers: pending remote acks plus pending
    /// `SegmentDone`s for segments it holds.
    pub(super) readers: usize,
    /// Segments held (landed here).
    pub(super) held: usize,
    pub(super) out: Outcome,
}

/// A segment available on this node, as seen by this SP.
#[derive(Clone, Debug)]
pub(super) struct Seg<K> {
    pub(super) seg: Segment<K>,
    /// Copies of it into local ranks in flight.
    pub(super) copying: usize,
    pub(super) done_sent: bool,
}

#[derive(Clone, Debug)]
pub(super) struct Topo {
    pub(super) members: Vec<SpId>,
    pub(super) nodes: Vec<u32>,
    pub(super) my_node: u32,
    /// Nodes with members, sorted.
    pub(super) node_list: Vec<u32>,
    pub(super) node_sps: BTreeMap<u32, Vec<SpId>>,
    /// Index of each rank among its node's ranks (ascending comm rank).
    pub(super) node_index: Vec<u32>,
    pub(super) local: Vec<Rank>,
}

thread_local! {
    /// The topology built last on this thread: a communicator's calls follow each other with
    /// the same members and nodes, and the build (maps and vectors per instance) is most of
    /// what a post of a small allgatherv costs. A pure function's last result, kept: the
    /// machine behaves the same with or without it.
    static LAST_TOPO: std::cell::RefCell<Option<(SpId, std::sync::Arc<Topo>)>> =
        const { std::cell::RefCell::new(None) };
}

impl Topo {
    /// [`Topo::build`], or the same topology built last on this thread for the same SP,
    /// members and nodes.
    pub(super) fn shared(
        me: SpId,
        members: &[SpId],
        nodes: &[u32],
    ) -> Result<std::sync::Arc<Topo>, PostError> {
        let hit = LAST_TOPO.with(|c| {
            c.borrow()
                .as_ref()
                .filter(|(m, t)| *m == me && t.members == members && t.nodes == nodes)
                .map(|(_, t)| t.clone())
        });
        if let Some(t) = hit {
            return Ok(t);
        }
        let t = std::sync::Arc::new(Topo::build(me, members, nodes)?);
        LAST_TOPO.with(|c| *c.borrow_mut() = Some((me, t.clone())));
        Ok(t)
    }

    pub(super) fn build(me: SpId, members: &[SpId], nodes: &[u32]) -> Result<Topo, PostError> {
        let sp_node = sp_nodes(members, nodes).map_err(|sp| PostError::SpOnTwoNodes { sp })?;
        let mut node_sps: BTreeMap<u32, BTreeSet<SpId>> = BTreeMap::new();
        let mut counts: BTreeMap<u32, u32> = BTreeMap::new();
        let mut node_index = Vec::with_capacity(members.len());
        for (&sp, &n) in members.iter().zip(nodes) {
            node_sps.entry(n).or_default().insert(sp);
            let c = counts.entry(n).or_insert(0);
            node_index.push(*c);
            *c += 1;
        }
        Ok(Topo {
            members: members.to_vec(),
            nodes: nodes.to_vec(),
            my_node: sp_node[&me],
            node_list: node_sps.keys().copied().collect(),
            node_sps: node_sps
                .into_iter()
                .map(|(n, s)| (n, s.into_iter().collect()))
                .collect(),
            node_index,
            local: (0..members.len() as Rank)
                .filter(|&r| members[r as usize] == me)
                .collect(),
        })
    }

    pub(super) fn my_sps(&self) -> &[SpId] {
        &self.node_sps[&self.my_node]
    }
}

pub(super) enum CopyKind<K> {
    /// Inter-node landing of `ann.src` into local `holder`.
    Land { ann: Announcement<K>, holder: Rank },
    /// Intra-node distribution of segment `seg` into local `dst`.
    Dist { seg: Rank, dst: Rank },
}

/// The per-SP state machine of one hierarchical `Allgatherv` instance.
pub struct Allgatherv<K> {
    pub(super) core: Core<LocalRank<K>, CopyKind<K>, Action<K>, Stats>,
    pub(super) topo: Option<std::sync::Arc<Topo>>,
    /// Announcements parked here, and since when.
    pub(super) parked: Vec<(Announcement<K>, Nanos)>,
    /// Sibling SPs known to have a posted rank.
    pub(super) ready_siblings: BTreeSet<SpId>,
    pub(super) ready_sent: bool,
    /// Segments on this node, by source rank.
    pub(super) segs: BTreeMap<Rank, Seg<K>>,
    /// Segments held by local ranks: src -> (holder, SPs owing SegmentDone).
    pub(super) held: BTreeMap<Rank, (Rank, BTreeSet<SpId>)>,
    /// Remote acks owed to local source ranks: (src, node).
    pub(super) acks: BTreeSet<(Rank, u32)>,
    /// Acks being released after a peer loss: the live SPs of the node
    /// that have not acked yet.
    pub(super) releasing: BTreeMap<(Rank, u32), BTreeSet<SpId>>,
    /// Acks settled after a peer loss (a late ack for them is ignored).
    pub(super) settled: BTreeSet<(Rank, u32)>,
    /// Announcements received (to detect duplicates).
    pub(super) announced: BTreeSet<Rank>,
    pub(super) abort_local: bool,
    pub(super) internal: VecDeque<Msg<K>>,
}

common_api!(Allgatherv, Msg<K>, settle = run_internal);

impl<K: Clone + fmt::Debug + PartialEq> Allgatherv<K> {
    /// Create an instance; the driver may do so on the first event of any
    /// kind for `key`.
    pub fn new(key: CollKey, cfg: Config) -> Self {
        Allgatherv {
            core: Core::new(key, cfg.me),
            topo: None,
            parked: Vec::new(),
            ready_siblings: BTreeSet::new(),
            ready_sent: false,
            segs: BTreeMap::new(),
            held: BTreeMap::new(),
            acks: BTreeSet::new(),
            releasing: BTreeMap::new(),
            settled: BTreeSet::new(),
            announced: BTreeSet::new(),
            abort_local: false,
            internal: VecDeque::new(),
        }
    }

    /// The SP of each comm rank, once a local rank has posted.
    pub fn members(&self) -> Option<&[SpId]> {
        self.topo.as_ref().map(|t| t.members.as_slice())
    }

    pub fn copies_in_flight(&self) -> usize {
        self.core.copies.len()
    }

    /// Announcements currently parked here.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// A local rank posted its part of the collective.
    pub fn handle_post(&mut self, now: Nanos, post: Post<K>) -> Result<(), PostError> {
        self.core.now = now;
        if let Some(topo) = self.validate_post(&post)? {
            self.learn_topology(topo);
        }
        let p = post.members.len();
        let rank = post.rank;
        let mut st = LocalRank {
            buf: VRecv::new(post.recv_key, post.recv_counts, post.recv_displs, p),
            have: vec![Have::Missing; p],
            readers: 0,
            held: 0,
            out: Outcome::new(),
        };
        if let Some(status) = self.core.abort.status {
            st.out.set_error(status);
            self.core.ranks.insert(rank, st);
            self.check_complete(rank);
            self.run_internal();
            return Ok(());
        }
        let mismatch = st.buf.counts[rank as usize] != post.own.send_len;
        let topo = self.topo.as_ref().expect("topology known");
        let my_node = topo.my_node;
        let r = rank as usize;
        // Announcements to the other nodes, ring order after this node.
        let pos = topo.node_list.iter().position(|&n| n == my_node).unwrap();
        let k = topo.node_list.len();
        let mut sends = Vec::new();
        for i in 1..k {
            let n = topo.node_list[(pos + i) % k];
            let sps = &topo.node_sps[&n];
            let to = sps[(topo.node_index[r] as usize + n as usize) % sps.len()];
            sends.push((
                to,
                n,
                Msg::Announce(Announcement {
                    src: rank,
                    origin: self.core.me,
                    key: post.send_key.clone(),
                    offset: 0,
                    len: post.own.send_len,
                    node: n,
                    node_sps: sps.clone(),
                }),
            ));
        }
        // The topology is shared (`Topo::shared`): a handle, not a copy of the SPs.
        let topo = topo.clone();
        st.readers = sends.len();
        self.core.ranks.insert(rank, st);
        for (to, n, msg) in sends {
            self.acks.insert((rank, n));
            self.send(to, msg);
        }
        self.publish(Segment {
            src: rank,
            holder: rank,
            holder_sp: self.core.me,
            key: post.send_key.clone(),
            offset: 0,
            len: post.own.send_len,
            from_send: true,
        });
        if !self.ready_sent {
            self.ready_sent = true;
            for &sp in topo.my_sps() {
                if sp != self.core.me {
                    self.send(sp, Msg::RankReady);
                }
            }
        }
        self.run_internal();
        // Segments already known on this node, in source order (walked, not collected: this
        // runs once per post).
        let mut next = self.segs.keys().next().copied();
        while let Some(s) = next {
            self.dist_one(s, rank);
            next = self
                .segs
                .range((Excluded(s), Unbounded))
                .next()
                .map(|(&s, _)| s);
        }
        // Parked announcements can be served now.
        for (ann, since) in std::mem::take(&mut self.parked) {
            self.core.stats.parked_wait_ns += now.saturating_sub(since);
            self.serve(ann);
        }
        if mismatch {
            self.enter_abort(Status::CountMismatch);
        }
        self.run_internal();
        self.check_complete(rank);
        Ok(())
    }

    /// The copy `id` finished with `status`.
    pub(super) fn copy_finished(&mut self, id: u64, status: Status) {
        let copies = &mut self.core.copies;
        let Some(kind) = take_finished(copies, id, &mut self.core.stats.unknown_copy_done) else {
            return;
        };
        if !status.is_ok() {
            self.enter_abort(status);
        }
        match kind {
            CopyKind::Land { ann, holder } => {
                let st = self.core.posted(holder, "holder posted");
                st.buf.writes -= 1;
                st.out.set_error(status);
                let s = ann.src as usize;
                st.have[s] = Have::Done;
                st.buf.pending -= 1;
                let ack = self.core.abort.status.unwrap_or(Status::Ok);
                self.ack(&ann, ack);
                if self.core.abort.is_none() {
                    self.publish_landed(ann.src, holder, ann.len);
                }
                self.check_complete(holder);
            }
            CopyKind::Dist { seg, dst } => {
                if let Some(st) = self.core.ranks.get_mut(&dst) {
                    st.buf.writes -= 1;
                    st.out.set_error(status);
                    st.have[seg as usize] = Have::Done;
                    st.buf.pending -= 1;
                }
                if let Some(e) = self.segs.get_mut(&seg) {
                    e.copying -= 1;
                }
                self.check_seg(seg);
                self.check_complete(dst);
            }
        }
    }

    /// SP `sp` died: abort with `PeerFailed` if it serves a member; its
    /// pending `SegmentDone`s are dropped and the live SPs of its node are
    /// asked to `Release` the announcements still unacked there. Messages
    /// from `sp` are ignored from now on.
    pub fn handle_peer_lost(&mut self, now: Nanos, sp: SpId) {
        self.core.now = now;
        if sp == self.core.me || !self.core.lost_sps.insert(sp) {
            return;
        }
        self.ready_siblings.remove(&sp);
        if self.topo.is_none() {
            return; // applied when the topology becomes known
        }
        self.apply_peer_lost(sp);
        self.run_internal();
    }

    /// Every local rank completed (or was lost before posting), nothing is
    /// in flight, parked or owed, and every action was polled.
    pub fn is_finished(&self) -> bool {
        self.topo
            .as_ref()
            .is_some_and(|t| self.core.completed + self.core.lost_unposted.len() == t.local.len())
            && self.core.copies.is_empty()
            && self.parked.is_empty()
            && self.segs.values().all(|e| e.done_sent)
            && self.core.actions.is_empty()
    }
}
