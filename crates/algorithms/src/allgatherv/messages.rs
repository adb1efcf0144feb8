//! Checks of posts and peers, and the messages from peers: announcements,
//! their passing, parking and serving.

use super::*;

impl<K: Clone + fmt::Debug + PartialEq> Allgatherv<K> {
    /// Checks `post`; the topology it implies, built here when none is known yet (the caller
    /// learns it: one build per instance).
    pub(super) fn validate_post(
        &self,
        post: &Post<K>,
    ) -> Result<Option<std::sync::Arc<Topo>>, PostError> {
        let p = post.members.len();
        let rank = post.rank;
        PostError::check_served(&post.members, rank, self.core.me)?;
        for (field, len) in [
            ("nodes", post.own.nodes.len()),
            ("recv_counts", post.recv_counts.len()),
            ("recv_displs", post.recv_displs.len()),
        ] {
            if len != p {
                return Err(PostError::LengthMismatch {
                    field,
                    len,
                    expected: p,
                });
            }
        }
        let built = match &self.topo {
            Some(t) => {
                if t.members != post.members || t.nodes != post.own.nodes {
                    return Err(PostError::MembersDisagree);
                }
                None
            }
            None => Some(Topo::shared(self.core.me, &post.members, &post.own.nodes)?),
        };
        if self.core.ranks.contains_key(&rank) {
            return Err(PostError::DuplicatePost { rank });
        }
        if self.core.lost_unposted.contains(&rank) {
            return Err(PostError::RankLost { rank });
        }
        if let Some(index) = (0..p).find(|&i| {
            post.recv_displs[i]
                .checked_add(post.recv_counts[i])
                .is_none()
        }) {
            return Err(PostError::Overflow { rank, index });
        }
        Ok(built)
    }

    pub(super) fn learn_topology(&mut self, topo: std::sync::Arc<Topo>) {
        let me = self.core.me;
        self.core
            .lost_unposted
            .retain(|&r| topo.members.get(r as usize) == Some(&me));
        let lost: Vec<SpId> = self.core.lost_sps.iter().copied().collect();
        self.topo = Some(topo);
        for sp in lost {
            self.apply_peer_lost(sp);
        }
        if self.core.abort.is_some() {
            self.maybe_broadcast_abort();
        }
    }

    pub(super) fn apply_peer_lost(&mut self, sp: SpId) {
        let topo = self.topo.as_ref().expect("topology known");
        if !topo.members.contains(&sp) {
            return;
        }
        let lost_node = topo
            .node_sps
            .iter()
            .find(|(_, sps)| sps.contains(&sp))
            .map(|(&n, _)| n);
        let mut released = Vec::new();
        for (_, (holder, pending)) in self.held.iter_mut() {
            if pending.remove(&sp) {
                released.push(*holder);
            }
        }
        // Pending acks from the lost SP's node: the announcement may be at
        // the lost SP (gone with it) or at, or on its way to, a live SP of
        // that node. Ask every live SP of the node to release it.
        let mut settle = Vec::new();
        let mut ask = Vec::new();
        if let Some(n) = lost_node {
            let live: BTreeSet<SpId> = topo.node_sps[&n]
                .iter()
                .filter(|s| !self.core.lost_sps.contains(s))
                .copied()
                .collect();
            for &a in self.acks.iter().filter(|&&(_, m)| m == n) {
                match self.releasing.get_mut(&a) {
                    Some(waiting) => {
                        waiting.remove(&sp);
                        if waiting.is_empty() {
                            settle.push(a);
                        }
                    }
                    None if live.is_empty() => settle.push(a),
                    None => {
                        self.releasing.insert(a, live.clone());
                        ask.push((a, live.clone()));
                    }
                }
            }
        }
        for r in released {
            if let Some(st) = self.core.ranks.get_mut(&r) {
                st.readers -= 1;
            }
        }
        self.enter_abort(Status::PeerFailed);
        let status = self.core.abort.status.expect("aborted");
        for ((src, node), live) in ask {
            for to in live {
                self.send(to, Msg::Release { src, node, status });
            }
        }
        for a in settle {
            self.settle(a);
        }
    }

    /// No live SP will read the send buffer of `a.0` for node `a.1` any
    /// more.
    pub(super) fn settle(&mut self, a: (Rank, u32)) {
        self.acks.remove(&a);
        self.releasing.remove(&a);
        self.settled.insert(a);
        if let Some(st) = self.core.ranks.get_mut(&a.0) {
            st.readers -= 1;
        }
        self.check_complete(a.0);
    }

    crate::common::v_internal_send!();

    pub(super) fn size(&self) -> usize {
        self.topo.as_ref().map_or(0, |t| t.members.len())
    }

    pub(super) fn check_rank(&self, rank: Rank) -> Result<(), MsgError> {
        let size = self.size();
        if rank as usize >= size {
            return Err(MsgError::RankOutOfRange { rank, size });
        }
        Ok(())
    }

    pub(super) fn process(&mut self, from: SpId, msg: Msg<K>) -> Result<(), MsgError> {
        match msg {
            Msg::Announce(ann) => {
                if ann.origin != from {
                    return Err(MsgError::WrongSp {
                        rank: ann.src,
                        got: from,
                    });
                }
                self.on_announce(ann, None)
            }
            Msg::Pass {
                ann,
                remaining,
                parked,
            } => self.on_announce(ann, Some((remaining, parked))),
            Msg::Ack { src, node, status } => {
                if self.settled.contains(&(src, node)) {
                    return Ok(()); // settled on a peer loss; late but fine
                }
                if self.topo.is_none() || !self.acks.contains(&(src, node)) {
                    return Err(MsgError::Unexpected { src });
                }
                if let Some(waiting) = self.releasing.get_mut(&(src, node)) {
                    // Either `from` finished with the announcement or it
                    // answers our `Release`: it will not read again.
                    if waiting.remove(&from) && waiting.is_empty() {
                        self.settle((src, node));
                    }
                    if let Some(st) = self.core.ranks.get_mut(&src) {
                        st.out.set_error(status);
                    }
                    return Ok(());
                }
                self.acks.remove(&(src, node));
                let st = self.core.posted(src, "ack for a posted rank");
                st.readers -= 1;
                st.out.set_error(status);
                self.check_complete(src);
                Ok(())
            }
            Msg::RankReady => {
                if from != self.core.me {
                    self.ready_siblings.insert(from);
                    if self.core.ranks.is_empty() {
                        for (ann, since) in std::mem::take(&mut self.parked) {
                            self.core.stats.parked_wait_ns += self.core.now.saturating_sub(since);
                            self.pass(from, ann, 0, true);
                        }
                    }
                }
                Ok(())
            }
            Msg::Segment(seg) => {
                let src = seg.src;
                if self.segs.contains_key(&src) {
                    return Err(MsgError::Duplicate { src });
                }
                if self.topo.is_some() {
                    self.check_rank(src)?;
                    self.check_rank(seg.holder)?;
                }
                if seg.offset.checked_add(seg.len).is_none() {
                    return Err(MsgError::Overflow { src });
                }
                let holder_sp = seg.holder_sp;
                let e = Seg {
                    seg,
                    copying: 0,
                    done_sent: false,
                };
                self.segs.insert(src, e);
                if self.core.abort.is_some() {
                    if self.topo.is_none() {
                        self.notify_abort(holder_sp);
                    }
                } else {
                    // The local ranks in order, walked (not collected: this runs per segment).
                    let mut next = self.core.ranks.keys().next().copied();
                    while let Some(r) = next {
                        self.dist_one(src, r);
                        next = self
                            .core
                            .ranks
                            .range((Excluded(r), Unbounded))
                            .next()
                            .map(|(&r, _)| r);
                    }
                }
                self.check_seg(src);
                Ok(())
            }
            Msg::SegmentDone { src, status } => {
                let Some((holder, pending)) = self.held.get_mut(&src) else {
                    return Err(MsgError::Unexpected { src });
                };
                if !pending.remove(&from) {
                    return Err(MsgError::Unexpected { src });
                }
                let holder = *holder;
                let st = self.core.posted(holder, "holder posted");
                st.readers -= 1;
                st.out.set_error(status);
                self.check_complete(holder);
                Ok(())
            }
            Msg::Release { src, node, status } => {
                if let Some(t) = &self.topo {
                    self.check_rank(src)?;
                    if t.members[src as usize] != from {
                        return Err(MsgError::WrongSp {
                            rank: src,
                            got: from,
                        });
                    }
                    if t.my_node != node || t.nodes[src as usize] == node {
                        return Err(MsgError::WrongNode { node });
                    }
                }
                // From now on no landing copy starts here (an aborted SP
                // acks every announcement without copying).
                self.enter_abort(status);
                let landing = self
                    .core
                    .copies
                    .values()
                    .any(|k| matches!(k, CopyKind::Land { ann, .. } if ann.src == src));
                if !landing {
                    let status = self.core.abort.status.expect("aborted");
                    self.send(from, Msg::Ack { src, node, status });
                }
                // Else the landing copy acks `from` when it finishes.
                Ok(())
            }
            Msg::Abort { status } => {
                if let Some(t) = &self.topo {
                    if !t.members.contains(&from) {
                        return Err(MsgError::NotMember { sp: from });
                    }
                }
                // Re-broadcast: the SP where the abort started may not know
                // the membership (a rank lost before any local post).
                self.enter_abort(status);
                Ok(())
            }
        }
    }

    /// An announcement (or pass) arrived here.
    pub(super) fn on_announce(
        &mut self,
        ann: Announcement<K>,
        pass: Option<(u32, bool)>,
    ) -> Result<(), MsgError> {
        if ann.offset.checked_add(ann.len).is_none() {
            return Err(MsgError::Overflow { src: ann.src });
        }
        if !ann.node_sps.contains(&self.core.me) {
            return Err(MsgError::WrongNode { node: ann.node });
        }
        if let Some(t) = &self.topo {
            self.check_rank(ann.src)?;
            if t.members[ann.src as usize] != ann.origin {
                return Err(MsgError::WrongSp {
                    rank: ann.src,
                    got: ann.origin,
                });
            }
            if t.my_node != ann.node || t.nodes[ann.src as usize] == t.my_node {
                return Err(MsgError::WrongNode { node: ann.node });
            }
        }
        if !self.announced.insert(ann.src) {
            return Err(MsgError::Duplicate { src: ann.src });
        }
        if let Some(status) = self.core.abort.status {
            self.ack(&ann, status);
            self.notify_abort(ann.origin);
            return Ok(());
        }
        let ready_here = self.core.ranks.values().any(|r| !r.out.completed);
        let (remaining, was_parked) = match pass {
            None => {
                if !ready_here {
                    self.core.stats.no_ready_rank += 1;
                }
                (ann.node_sps.len() as u32 - 1, false)
            }
            Some(p) => p,
        };
        if ready_here {
            if pass.is_some() && !was_parked {
                self.core.stats.served_after_pass += 1;
            }
            self.serve(ann);
        } else if let Some(&y) = self.ready_siblings.iter().next() {
            self.pass(y, ann, 0, was_parked);
        } else if remaining == 0 {
            self.core.stats.parked += 1;
            self.parked.push((ann, self.core.now));
        } else {
            let i = ann
                .node_sps
                .iter()
                .position(|&s| s == self.core.me)
                .unwrap();
            let next = ann.node_sps[(i + 1) % ann.node_sps.len()];
            self.pass(next, ann, remaining - 1, was_parked);
        }
        Ok(())
    }

    /// Acks `ann` to the SP of its source: this SP is done with it.
    pub(super) fn ack(&mut self, ann: &Announcement<K>, status: Status) {
        self.send(
            ann.origin,
            Msg::Ack {
                src: ann.src,
                node: ann.node,
                status,
            },
        );
    }

    pub(super) fn pass(&mut self, to: SpId, ann: Announcement<K>, remaining: u32, parked: bool) {
        if self.core.lost_sps.contains(&to) {
            // Cannot happen without an abort in progress; keep it here.
            self.parked.push((ann, self.core.now));
            return;
        }
        self.announced.remove(&ann.src);
        self.send(
            to,
            Msg::Pass {
                ann,
                remaining,
                parked,
            },
        );
    }

    /// Land an announcement in a ready local rank (one exists, no abort).
    pub(super) fn serve(&mut self, ann: Announcement<K>) {
        let holder = self
            .core
            .ranks
            .iter()
            .filter(|(_, r)| !r.out.completed)
            .min_by_key(|(&rank, r)| (r.held, rank))
            .map(|(&rank, _)| rank)
            .expect("a ready local rank");
        let s = ann.src as usize;
        let st = self.core.ranks.get_mut(&holder).unwrap();
        if st.buf.counts[s] != ann.len || st.have[s] != Have::Missing {
            self.ack(&ann, Status::CountMismatch);
            self.enter_abort(Status::CountMismatch);
            return;
        }
        st.held += 1;
        self.start_copy(CopyKind::Land { ann, holder });
    }
}
