//! Messages from peers, copy completions, the abort, and `settle`: what
//! every input made possible (the barrier, the multicast, the fetch ring,
//! the final handshake, completions).

use super::*;

/// Messages one SP sends another before the receiver can have a view, at
/// most (`Open`, `Ready`, `FetchReq`, `Final`, with room to spare).
const EARLY_PER_SP: usize = 6;

impl<K: Clone + fmt::Debug + PartialEq> McastBcast<K> {
    /// A message from `from`. An aborted SP answers every accepted message
    /// (but an `Abort`) with its abort, once per SP: an SP that cannot
    /// broadcast its abort (no view, or it learned it from a peer) still
    /// reaches everyone who waits for it.
    pub(super) fn process(&mut self, from: SpId, msg: Msg<K>) -> Result<(), MsgError> {
        let is_abort = matches!(msg, Msg::Abort { .. });
        if let (Msg::Open { ring, .. }, None) = (&msg, &self.view) {
            if ring.contains(&self.core.me) && ring.contains(&from) {
                self.ring_hint.get_or_insert_with(|| ring.clone());
            }
        }
        self.process_msg(from, msg)?;
        if !is_abort && self.core.abort.is_some() {
            self.notify_abort(from);
        }
        Ok(())
    }

    fn process_msg(&mut self, from: SpId, msg: Msg<K>) -> Result<(), MsgError> {
        if let Msg::Abort { status } = msg {
            if self.view.as_ref().is_some_and(|v| !v.ring.contains(&from)) {
                return Err(MsgError::NotMember { sp: from });
            }
            self.abort_instance(status, false);
            return Ok(());
        }
        let Some(v) = &self.view else {
            let q = self.early.entry(from).or_default();
            if q.len() >= EARLY_PER_SP {
                return Err(MsgError::TooEarly { sp: from });
            }
            q.push(msg);
            return Ok(());
        };
        if !v.ring.contains(&from) {
            return Err(MsgError::NotMember { sp: from });
        }
        let (root_sp, left, right) = (v.root_sp(), v.left(), v.right());
        let is_root_sp = v.is_root_sp();
        match msg {
            Msg::Open {
                root,
                len,
                mtu,
                subgroups,
                ring,
            } => {
                if ring.first() != Some(&from) {
                    return Err(MsgError::NotRoot { sp: from });
                }
                if !self.opened_by.insert(from) {
                    return Err(MsgError::Duplicate { sp: from });
                }
                let status = if from != root_sp {
                    // Another SP thinks it serves the root.
                    Some(Status::CountMismatch)
                } else {
                    v.disagreement(root, len, mtu)
                        .or((subgroups != v.subgroups || ring != v.ring)
                            .then_some(Status::InvalidPost))
                };
                if let Some(s) = status {
                    self.enter_abort(s);
                }
            }
            Msg::Ready { root, len, mtu } => {
                if self.ready_from.contains(&from) {
                    return Err(MsgError::Duplicate { sp: from });
                }
                // To an SP that is not the root's in its own view: the
                // sender names another root.
                let status = if is_root_sp {
                    v.disagreement(root, len, mtu)
                } else {
                    Some(Status::CountMismatch)
                };
                match status {
                    Some(s) => self.enter_abort(s),
                    None => {
                        self.ready_from.insert(from);
                    }
                }
            }
            Msg::Sent { root, len, mtu } => {
                if let Some(s) = v.disagreement(root, len, mtu) {
                    // Another view: the sender serves another root.
                    self.enter_abort(s);
                    return Ok(());
                }
                if from != root_sp || is_root_sp {
                    return Err(MsgError::NotRoot { sp: from });
                }
                if self.sent_seen {
                    return Err(MsgError::Duplicate { sp: from });
                }
                self.sent_seen = true;
                if let Some(s) = v.disagreement(root, len, mtu) {
                    self.enter_abort(s);
                } else if !self.scanned && self.deadline.is_some() {
                    // Every datagram is on the wire.
                    self.deadline = Some(self.core.now + self.cfg.alpha_ns);
                }
            }
            Msg::FetchReq {
                root,
                len,
                mtu,
                ranges,
            } => {
                let from_right = Some(from) == right
                    || (mutated(Mutation::FetchFromRight) && Some(from) == left);
                if let Some(s) = v.disagreement(root, len, mtu) {
                    // Another view: another ring, another chunk count.
                    self.enter_abort(s);
                    return Ok(());
                }
                let n = v.n;
                let sorted = ranges.windows(2).all(|w| w[0].1 <= w[1].0);
                let in_range = ranges.iter().all(|&(a, b)| a < b && b <= n);
                if !from_right || self.req_seen || ranges.is_empty() || !sorted || !in_range {
                    return Err(MsgError::BadFetch { sp: from });
                }
                self.req_seen = true;
                if let Some(s) = v.disagreement(root, len, mtu) {
                    self.enter_abort(s);
                } else if self.core.abort.is_none() && !self.final_from_right {
                    self.serve_missing = ranges
                        .iter()
                        .map(|&(a, b)| (a..b).filter(|&i| !self.has(i)).count() as u64)
                        .sum();
                    let lacking = self.serve_missing > 0;
                    self.serve = Some(ranges);
                    let landing = self
                        .last_landed
                        .is_some_and(|t| t + self.cfg.alpha_ns > self.core.now);
                    if lacking && self.sent_seen && !self.scanned && !is_root_sp && !landing {
                        // Recurse towards the root now: the multicast is over (and
                        // nothing landed here lately; else the cutoff decides).
                        self.core.stats.scans_on_request += 1;
                        self.scan();
                    }
                }
            }
            Msg::FetchAck { key } => {
                let Some(f) = self.fetch.as_mut().filter(|f| f.from == from && !f.acked) else {
                    return Err(MsgError::UnexpectedAck { sp: from });
                };
                f.acked = true;
                if self.core.abort.is_some() || self.final_sent {
                    self.core.stats.stale_acks += 1;
                } else {
                    self.fetch_copies(key);
                }
            }
            Msg::Final { root, len, mtu } => {
                if let Some(s) = v.disagreement(root, len, mtu) {
                    self.enter_abort(s);
                    return Ok(());
                }
                if Some(from) != right {
                    return Err(MsgError::UnexpectedFinal { sp: from });
                }
                if self.final_from_right {
                    return Err(MsgError::Duplicate { sp: from });
                }
                self.final_from_right = true;
                // It will not read: a request not answered yet is void.
                self.serve = None;
                if let Some(s) = v.disagreement(root, len, mtu) {
                    self.enter_abort(s);
                }
            }
            Msg::Abort { .. } => unreachable!("handled above"),
        }
        Ok(())
    }

    /// The neighbour's buffer `key` holds what the fetch asked for: copy it
    /// into every local rank.
    fn fetch_copies(&mut self, key: K) {
        let v = self.view.as_ref().expect("a fetch needs a view");
        let ranges = self.fetch.as_ref().unwrap().ranges.clone();
        let bytes: Vec<(u64, u64)> = ranges.iter().map(|&r| v.bytes(r)).collect();
        let ranks: Vec<(Rank, K)> = self
            .local
            .iter()
            .filter_map(|r| self.core.ranks.get(r).map(|st| (*r, st.key.clone())))
            .collect();
        for (i, (from, to)) in bytes.into_iter().enumerate() {
            for (rank, dst) in &ranks {
                let id = self.core.new_id();
                let c = Copy {
                    id: CopyId(id),
                    rank: *rank,
                    src: key.clone(),
                    dst: dst.clone(),
                    offset: from,
                    len: to - from,
                };
                if self
                    .start_copy(
                        CopyKind::Fetch {
                            range: i,
                            rank: *rank,
                        },
                        c,
                    )
                    .is_some()
                {
                    let f = self.fetch.as_mut().unwrap();
                    f.left[i] += 1;
                    f.copies += 1;
                    self.core.ranks.get_mut(rank).unwrap().writes += 1;
                }
            }
            let f = self.fetch.as_ref().unwrap();
            if f.left[i] == 0 {
                self.range_fetched(i);
            }
        }
    }

    /// Every copy of fetched range `i` finished `Ok`: its bits are set
    /// (and, once the whole fetch is in, those of `sets`).
    fn range_fetched(&mut self, i: usize) {
        let f = self.fetch.as_ref().unwrap();
        let (a, b) = f.ranges[i];
        let all_in = f.left.iter().all(|&l| l == 0) && f.copies == 0;
        let sets = f.sets.clone();
        for psn in a..b {
            if self.set_bit(psn) {
                self.core.stats.chunks_fetched += 1;
            }
        }
        let (from, to) = self.view.as_ref().unwrap().bytes((a, b));
        self.core.stats.bytes_fetched += to - from;
        if all_in {
            for (a, b) in sets {
                for psn in a..b {
                    self.set_bit(psn);
                }
            }
        }
    }

    /// The cutoff: scan the bitmap, fetch the missing runs from the left
    /// neighbour.
    pub(super) fn scan(&mut self) {
        self.scanned = true;
        self.deadline = None;
        let missing = self.missing();
        let Some(v) = &self.view else { return };
        if missing.is_empty() || v.is_root_sp() {
            return;
        }
        self.core.stats.cutoffs_missing += 1;
        let from = if mutated(Mutation::FetchFromRight) {
            v.right()
        } else {
            v.left()
        }
        .expect("a leaf has neighbours");
        let (root, len, mtu) = (v.root, v.len, v.mtu);
        let mut ranges = missing.clone();
        if mutated(Mutation::SkipLastRange) && ranges.len() > 1 {
            ranges.pop();
        }
        self.fetch = Some(Fetch {
            from,
            left: vec![0; ranges.len()],
            ranges: ranges.clone(),
            sets: missing,
            acked: false,
            copies: 0,
        });
        self.core.stats.fetch_requests += 1;
        self.send(
            from,
            Msg::FetchReq {
                root,
                len,
                mtu,
                ranges,
            },
        );
    }

    pub(super) fn copy_finished(&mut self, id: u64, status: Status) {
        let copies = &mut self.core.copies;
        let Some(kind) = take_finished(copies, id, &mut self.core.stats.unknown_done) else {
            return;
        };
        let ok = status.is_ok();
        let root = self.view.as_ref().map(|v| v.root);
        match kind {
            CopyKind::Local { rank } => {
                if let Some(r) = root.and_then(|r| self.core.ranks.get_mut(&r)) {
                    r.reads -= 1;
                }
                let st = self.core.ranks.get_mut(&rank).unwrap();
                st.writes -= 1;
                st.copied = ok;
            }
            CopyKind::Fetch { range, rank } => {
                self.core.ranks.get_mut(&rank).unwrap().writes -= 1;
                let f = self.fetch.as_mut().unwrap();
                f.left[range] -= 1;
                f.copies -= 1;
                if ok && self.core.abort.is_none() && f.left[range] == 0 {
                    self.range_fetched(range);
                }
            }
            CopyKind::Multicast { psns } => {
                self.mcasts_in_flight -= 1;
                if ok {
                    self.core.stats.chunks_multicast += psns;
                }
                if ok && self.mcasts_in_flight == 0 && self.core.abort.is_none() {
                    self.mcast_done = true;
                    let v = self.view.as_ref().unwrap();
                    let (root, len, mtu) = (v.root, v.len, v.mtu);
                    let others: Vec<SpId> = v.ring[1..].to_vec();
                    for sp in others {
                        self.send(sp, Msg::Sent { root, len, mtu });
                    }
                }
            }
        }
        if !ok {
            self.enter_abort(status);
        }
    }

    /// Aborts with `status` (`Ok`: `Aborted`), broadcast to the ring.
    pub(super) fn enter_abort(&mut self, status: Status) {
        self.abort_instance(status, true);
    }

    /// Aborts with `status`; `local`: the abort began here and is to be
    /// broadcast (else it came with a peer's `Abort`).
    pub(super) fn abort_instance(&mut self, status: Status, local: bool) {
        let (_, status) = self.core.abort.enter(status);
        self.abort_local |= local;
        fail_pending(self.core.ranks.values_mut().map(|st| &mut st.out), status);
        self.serve = None;
        self.deadline = None;
    }

    crate::common::notify_abort!();

    /// Does what the inputs so far made possible; runs after every input.
    pub(super) fn settle(&mut self) {
        if self.core.abort.is_some() {
            // The SP where the abort began tells the whole ring (it learns
            // the ring from its first post or the root's `Open`); every
            // aborted SP tells its neighbours (a ring gossip: it reaches
            // everyone even when the originator knows no ring).
            let ring = self
                .view
                .as_ref()
                .map(|v| &v.ring)
                .or(self.ring_hint.as_ref());
            let known = ring.is_some();
            if self.core.abort.start_broadcast(self.abort_local && known) {
                for sp in ring.unwrap().clone() {
                    self.notify_abort(sp);
                }
            }
            if let Some(v) = &self.view {
                for sp in [v.left(), v.right()].into_iter().flatten() {
                    self.notify_abort(sp);
                }
            }
            // Those whose messages wait for a view here wait for this SP.
            let waiting: Vec<SpId> = self.early.keys().copied().collect();
            for sp in waiting {
                self.notify_abort(sp);
            }
        } else if self.view.as_ref().is_some_and(|v| v.is_root_sp()) {
            self.root_progress();
        } else if self.view.is_some() {
            self.leaf_progress();
        }
        if self.registered && !self.unregistered && (self.core.abort.is_some() || self.has_all()) {
            self.unregistered = true;
            self.core.actions.push_back(Action::Unregister);
        }
        self.serve_fetch();
        self.send_final();
        let ranks: Vec<Rank> = self.core.ranks.keys().copied().collect();
        for r in ranks {
            self.check_complete(r);
        }
    }

    /// The root's SP: `Open`, local copies, and the multicast once every
    /// other SP is ready.
    fn root_progress(&mut self) {
        let v = self.view.as_ref().unwrap();
        let (root, len, mtu, n) = (v.root, v.len, v.mtu, v.n);
        let others: Vec<SpId> = v.ring[1..].to_vec();
        let Some(root_key) = self.core.ranks.get(&root).map(|st| st.key.clone()) else {
            return;
        };
        if !self.open_sent {
            self.open_sent = true;
            let open = Msg::Open {
                root,
                len,
                mtu,
                subgroups: v.subgroups,
                ring: v.ring.clone(),
            };
            for &sp in &others {
                self.send(sp, open.clone());
            }
        }
        let waiting: Vec<Rank> = self
            .core
            .ranks
            .iter()
            .filter(|(&r, st)| r != root && !st.copy_started)
            .map(|(&r, _)| r)
            .collect();
        for rank in waiting {
            let id = self.core.new_id();
            let st = self.core.ranks.get_mut(&rank).unwrap();
            st.copy_started = true;
            let c = Copy {
                id: CopyId(id),
                rank,
                src: root_key.clone(),
                dst: st.key.clone(),
                offset: 0,
                len,
            };
            if self.start_copy(CopyKind::Local { rank }, c).is_some() {
                self.core.stats.local_copies += 1;
                self.core.ranks.get_mut(&rank).unwrap().writes += 1;
                self.core.ranks.get_mut(&root).unwrap().reads += 1;
            } else {
                self.core.ranks.get_mut(&rank).unwrap().copied = true;
            }
        }
        if self.mcast_started || !others.iter().all(|s| self.ready_from.contains(s)) {
            return;
        }
        self.mcast_started = true;
        if others.is_empty() {
            self.mcast_done = true;
            return;
        }
        let subgroups = self.cfg.subgroups;
        for (g, (first, end)) in subgroup_runs(n, subgroups).into_iter().enumerate() {
            if first == end {
                continue;
            }
            let (from, to) = self.view.as_ref().unwrap().bytes((first, end));
            let id = self.core.new_id();
            self.core
                .copies
                .insert(id, CopyKind::Multicast { psns: end - first });
            self.mcasts_in_flight += 1;
            self.core.actions.push_back(Action::Multicast(Multicast {
                id: CopyId(id),
                key: root_key.clone(),
                subgroup: g as u16,
                first_psn: first,
                psns: end - first,
                offset: from,
                len: to - from,
                mtu,
                chunks: n,
            }));
        }
        // The root's SP never reads another SP's buffer.
        let left = self.view.as_ref().unwrap().left().unwrap();
        self.final_sent = true;
        self.send(left, Msg::Final { root, len, mtu });
    }

    /// A leaf: register and `Ready` once every local rank posted.
    fn leaf_progress(&mut self) {
        if self.ready_sent || self.core.ranks.len() < self.local.len() {
            return;
        }
        let v = self.view.as_ref().unwrap();
        let (root, len, mtu, n, root_sp) = (v.root, v.len, v.mtu, v.n, v.root_sp());
        self.ready_sent = true;
        self.registered = true;
        let keys = self
            .core
            .ranks
            .iter()
            .map(|(&r, st)| (r, st.key.clone()))
            .collect();
        self.core.actions.push_back(Action::Register(Register {
            chunks: n,
            mtu,
            len,
            subgroups: self.cfg.subgroups,
            keys,
        }));
        self.send(root_sp, Msg::Ready { root, len, mtu });
        let wire = len.div_ceil(self.cfg.link_bytes_per_ns);
        self.deadline = Some(self.core.now + wire + self.cfg.alpha_ns);
    }

    /// Answers the right neighbour's request once every chunk it asked for
    /// is here.
    fn serve_fetch(&mut self) {
        let Some(ranges) = &self.serve else { return };
        if self.core.abort.is_some() {
            self.serve = None;
            return;
        }
        // The root's SP has every chunk once its root posted (no bits set).
        let all_here = self.serve_missing == 0 || self.has_all();
        debug_assert_eq!(
            all_here,
            ranges.iter().all(|&(a, b)| (a..b).all(|i| self.has(i)))
        );
        if !all_here {
            return;
        }
        let v = self.view.as_ref().unwrap();
        // The root's buffer at its SP; else any local rank's (all hold it).
        let holder = if v.is_root_sp() {
            v.root
        } else {
            self.local[0]
        };
        let to = if mutated(Mutation::FetchFromRight) {
            self.fetch_requester()
        } else {
            v.right()
        };
        let (Some(st), Some(to)) = (self.core.ranks.get(&holder), to) else {
            return;
        };
        let key = st.key.clone();
        self.serve = None;
        self.acked_right = true;
        self.core.stats.fetches_served += 1;
        self.send(to, Msg::FetchAck { key });
    }

    /// Under `Mutation::FetchFromRight`, requests come from the left.
    fn fetch_requester(&self) -> Option<SpId> {
        self.view.as_ref().and_then(|v| v.left())
    }

    /// A leaf sends `Final` to its left neighbour once it will never read
    /// it again: every chunk is in (or it aborted after asking it for
    /// chunks) and no fetch copy is in flight.
    fn send_final(&mut self) {
        let Some(v) = &self.view else { return };
        if self.final_sent || v.is_root_sp() {
            return;
        }
        let copies = self.fetch.as_ref().map_or(0, |f| f.copies);
        let aborted = self.core.abort.is_some();
        let done = self.has_all() || (aborted && self.fetch.is_some());
        if copies > 0 || !done || (!aborted && !self.unregistered) {
            return;
        }
        let (root, len, mtu) = (v.root, v.len, v.mtu);
        let left = v.left().unwrap();
        self.final_sent = true;
        self.send(left, Msg::Final { root, len, mtu });
    }

    /// Completes local `rank` once nothing touches its buffer and its
    /// part is done (see the module docs).
    fn check_complete(&mut self, rank: Rank) {
        let Some(v) = &self.view else { return };
        let st = &self.core.ranks[&rank];
        if st.out.completed || st.reads > 0 || st.writes > 0 {
            return;
        }
        let is_root = v.is_root_sp() && rank == v.root;
        if (is_root && self.mcasts_in_flight > 0) || (self.registered && !self.unregistered) {
            return;
        }
        let released = self.final_from_right || self.right_lost || v.ring.len() == 1;
        let ready = if self.core.abort.is_some() || !st.out.status.is_ok() {
            !self.acked_right || released
        } else if is_root {
            // The root's buffer is its SP's only source: every other local
            // rank, even one posting late, copies out of it first.
            let served = self.core.ranks.len() == self.local.len()
                && self
                    .core
                    .ranks
                    .iter()
                    .all(|(&r, st)| r == rank || st.copied);
            self.mcast_done && released && served
        } else if v.is_root_sp() {
            st.copied
        } else {
            self.has_all() && (released || mutated(Mutation::CompleteBeforeFinal))
        };
        if !ready {
            return;
        }
        let st = self.core.ranks.get_mut(&rank).unwrap();
        st.out.completed = true;
        self.core.completed += 1;
        let status = st.out.status;
        self.core
            .actions
            .push_back(Action::Complete { rank, status });
    }
}
