//! Messages from peers, copy completions, the abort, and `settle`: what
//! every input made possible (the barrier, the sequencer, the multicasts,
//! the fetch ring, the final handshake, completions).

use super::*;

/// Messages one SP sends another before the receiver can have a view, at
/// most (`Open`, `Ready`, `Abort`, with room to spare).
const EARLY_PER_SP: usize = 4;

impl<K: Clone + fmt::Debug + PartialEq> McastAllgather<K> {
    /// A message from `from`. An aborted SP answers every accepted message
    /// (but an `Abort`) with its abort, once per SP.
    pub(super) fn process(&mut self, from: SpId, msg: Msg<K>) -> Result<(), MsgError> {
        let is_abort = matches!(msg, Msg::Abort { .. });
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
        let shape = v.shape;
        let (left, right, prev) = (v.left(), v.right(), v.chain_prev);
        let (is_coord, coord) = (v.is_coordinator(), v.coordinator());
        match msg {
            Msg::Open { shape: s } => {
                if from != coord || is_coord {
                    // Another SP thinks it coordinates: another ring.
                    self.enter_abort(Status::InvalidPost);
                    return Ok(());
                }
                if self.open_seen {
                    return Err(MsgError::Duplicate { sp: from });
                }
                self.open_seen = true;
                if let Some(st) = shape.disagreement(&s) {
                    self.enter_abort(st);
                }
            }
            Msg::Ready { shape: s } => {
                if self.ready_from.contains(&from) {
                    return Err(MsgError::Duplicate { sp: from });
                }
                // At an SP that is not the coordinator in its own view: the
                // sender has another ring.
                let status = if is_coord {
                    shape.disagreement(&s)
                } else {
                    Some(Status::InvalidPost)
                };
                match status {
                    Some(st) => self.enter_abort(st),
                    None => {
                        self.ready_from.insert(from);
                    }
                }
            }
            Msg::Start { shape: s } => {
                if let Some(st) = shape.disagreement(&s) {
                    self.enter_abort(st);
                    return Ok(());
                }
                if from != coord || is_coord {
                    return Err(MsgError::NotCoordinator { sp: from });
                }
                if self.start_seen {
                    return Err(MsgError::Duplicate { sp: from });
                }
                self.start_seen = true;
                if self.core.abort.is_none() {
                    self.begin();
                }
            }
            Msg::Go { shape: s } => {
                if let Some(st) = shape.disagreement(&s) {
                    self.enter_abort(st);
                    return Ok(());
                }
                if Some(from) != prev {
                    return Err(MsgError::UnexpectedGo { sp: from });
                }
                if self.go_in {
                    return Err(MsgError::Duplicate { sp: from });
                }
                self.go_in = true;
            }
            Msg::FetchReq { shape: s, ranges } => {
                if let Some(st) = shape.disagreement(&s) {
                    self.enter_abort(st);
                    return Ok(());
                }
                let from_right = Some(from) == right
                    || (mutated(Mutation::FetchFromRight) && Some(from) == left);
                let total = self.view.as_ref().unwrap().total();
                let sorted = ranges.windows(2).all(|w| w[0].1 <= w[1].0);
                let in_range = ranges.iter().all(|&(a, b)| a < b && b <= total);
                if !from_right || self.req_seen || ranges.is_empty() || !sorted || !in_range {
                    return Err(MsgError::BadFetch { sp: from });
                }
                self.req_seen = true;
                if self.core.abort.is_none() && !self.final_from_right {
                    self.serve = Some(ranges);
                    self.serve_fresh = true;
                    self.serve_ready.clear();
                }
            }
            Msg::FetchAck { key, ranges } => {
                let Some(f) = self.fetch.as_ref().filter(|f| f.from == from) else {
                    return Err(MsgError::UnexpectedAck { sp: from });
                };
                let asked =
                    |&(a, b): &(u64, u64)| a < b && f.ranges.iter().any(|&(x, y)| x <= a && b <= y);
                if ranges.is_empty() || !ranges.iter().all(asked) {
                    return Err(MsgError::UnexpectedAck { sp: from });
                }
                self.core.stats.fetch_acks_received += 1;
                if self.core.abort.is_some() || self.final_sent {
                    self.core.stats.stale_acks += 1;
                } else {
                    for r in ranges {
                        self.fetch_copies(&key, r);
                    }
                }
            }
            Msg::Final { shape: s } => {
                if let Some(st) = shape.disagreement(&s) {
                    self.enter_abort(st);
                    return Ok(());
                }
                if Some(from) != right {
                    return Err(MsgError::UnexpectedFinal { sp: from });
                }
                if self.final_from_right {
                    return Err(MsgError::Duplicate { sp: from });
                }
                self.final_from_right = true;
                // It will not read: what it asked for and did not get is
                // void.
                self.serve = None;
            }
            Msg::Abort { .. } => unreachable!("handled above"),
        }
        Ok(())
    }

    /// The barrier is complete here: arm the cutoff timer.
    fn begin(&mut self) {
        self.started = true;
        let v = self.view.as_ref().unwrap();
        if v.ring.len() > 1 {
            let n = v.p * v.shape.len;
            let wire = n.div_ceil(self.cfg.link_bytes_per_ns);
            self.deadline = Some(self.core.now + wire + self.cfg.alpha_ns);
        }
    }

    /// The neighbour's buffer `key` holds the run `(a, e)`: what of it is
    /// still missing here is read once, into the first local rank's
    /// receive buffer, then copied from there into the others' (one remote
    /// read per run, not one per local rank).
    fn fetch_copies(&mut self, key: &K, (a, e): (u64, u64)) {
        let runs = self.runs((a, e), false);
        let first = self.local[0];
        let Some(dst) = self.core.ranks.get(&first).map(|st| st.recv.clone()) else {
            return;
        };
        for run in runs {
            let v = self.view.as_ref().expect("a fetch needs a view");
            let (from, mut to) = v.bytes(run);
            if mutated(Mutation::SkipLastChunk) {
                // The last chunk of the run is not read.
                to = to.min(v.at(run.1 - 1)).max(from);
            }
            let f = self.fetch.as_mut().unwrap();
            let group = f.next_group;
            f.next_group += 1;
            f.groups.insert(
                group,
                Group {
                    run,
                    bytes: (from, to),
                    left: 0,
                    fanned: false,
                },
            );
            let id = self.core.new_id();
            let c = Copy {
                id: CopyId(id),
                rank: first,
                src: key.clone(),
                src_offset: from,
                dst: dst.clone(),
                dst_offset: from,
                len: to - from,
            };
            let kind = CopyKind::Fetch {
                group,
                rank: first,
                fan: false,
            };
            if self.start_copy(kind, c) {
                let f = self.fetch.as_mut().unwrap();
                f.groups.get_mut(&group).unwrap().left += 1;
                f.copies += 1;
                self.core.ranks.get_mut(&first).unwrap().writes += 1;
            } else {
                self.fan_out(group);
            }
        }
    }

    /// Run `group` is in the first local rank's receive buffer: copy it
    /// into the other local ranks' (its bits are set once all are done).
    fn fan_out(&mut self, group: usize) {
        let first = self.local[0];
        let src = self.core.ranks[&first].recv.clone();
        let f = self.fetch.as_mut().unwrap();
        let g = f.groups.get_mut(&group).unwrap();
        g.fanned = true;
        let ((a, e), (from, to)) = (g.run, g.bytes);
        // Landed meanwhile in every local rank: nothing to fan out.
        let landed = self.runs((a, e), false).is_empty();
        let others: Vec<(Rank, K)> = self
            .local
            .iter()
            .filter(|&&r| r != first && !landed)
            .filter_map(|r| self.core.ranks.get(r).map(|st| (*r, st.recv.clone())))
            .collect();
        for (rank, dst) in others {
            let id = self.core.new_id();
            let c = Copy {
                id: CopyId(id),
                rank,
                src: src.clone(),
                src_offset: from,
                dst,
                dst_offset: from,
                len: to - from,
            };
            let kind = CopyKind::Fetch {
                group,
                rank,
                fan: true,
            };
            if self.start_copy(kind, c) {
                let f = self.fetch.as_mut().unwrap();
                f.groups.get_mut(&group).unwrap().left += 1;
                f.copies += 1;
                self.core.ranks.get_mut(&rank).unwrap().writes += 1;
                self.core.ranks.get_mut(&first).unwrap().reads += 1;
            }
        }
        if self.fetch.as_ref().unwrap().groups[&group].left == 0 {
            self.run_fetched(group);
        }
    }

    /// Every copy of fetched run `group` finished `Ok`: its bits are set.
    fn run_fetched(&mut self, group: usize) {
        let f = self.fetch.as_mut().unwrap();
        let g = f.groups.remove(&group).unwrap();
        let (a, e) = g.run;
        for psn in a..e {
            if self.set_bit(psn) {
                self.core.stats.chunks_fetched += 1;
            }
        }
        let (from, to) = self.view.as_ref().unwrap().bytes((a, e));
        self.core.stats.bytes_fetched += to - from;
    }

    /// The cutoff: scan the bitmap, ask the left neighbour for the missing
    /// runs.
    pub(super) fn scan(&mut self) {
        self.scanned = true;
        self.deadline = None;
        let missing = self.missing();
        let Some(v) = &self.view else { return };
        if missing.is_empty() || v.ring.len() == 1 {
            return;
        }
        self.core.stats.cutoffs_missing += 1;
        let from = if mutated(Mutation::FetchFromRight) {
            v.right()
        } else {
            v.left()
        }
        .expect("more than one SP");
        let shape = v.shape;
        self.fetch = Some(Fetch {
            from,
            ranges: missing.clone(),
            groups: BTreeMap::new(),
            next_group: 0,
            copies: 0,
        });
        self.core.stats.fetch_requests += 1;
        self.send(
            from,
            Msg::FetchReq {
                shape,
                ranges: missing,
            },
        );
    }

    pub(super) fn copy_finished(&mut self, id: u64, status: Status) {
        let copies = &mut self.core.copies;
        let Some(kind) = take_finished(copies, id, &mut self.core.stats.unknown_done) else {
            return;
        };
        let ok = status.is_ok();
        match kind {
            CopyKind::Local { block, rank } => {
                self.core.ranks.get_mut(&block).unwrap().reads -= 1;
                self.core.ranks.get_mut(&rank).unwrap().writes -= 1;
                if ok {
                    self.local_copy_done(block);
                }
            }
            CopyKind::Fetch { group, rank, fan } => {
                self.core.ranks.get_mut(&rank).unwrap().writes -= 1;
                if fan {
                    let first = self.local[0];
                    self.core.ranks.get_mut(&first).unwrap().reads -= 1;
                }
                let f = self.fetch.as_mut().unwrap();
                f.copies -= 1;
                let g = f.groups.get_mut(&group).unwrap();
                g.left -= 1;
                if g.left == 0 {
                    if !ok || self.core.abort.is_some() {
                        f.groups.remove(&group);
                    } else if g.fanned {
                        self.run_fetched(group);
                    } else {
                        self.fan_out(group);
                    }
                }
            }
            CopyKind::Multicast { block, psns, bytes } => {
                self.mcasts_in_flight -= 1;
                self.core.ranks.get_mut(&block).unwrap().reads -= 1;
                if ok {
                    self.core.stats.chunks_multicast += psns;
                    self.core.stats.bytes_multicast += bytes;
                }
                if ok && self.mcasts_in_flight == 0 && self.core.abort.is_none() {
                    self.multicasts_done();
                }
            }
        }
        if !ok {
            self.enter_abort(status);
        }
    }

    /// One local copy of local `block` finished: once all did, its bits
    /// are set.
    fn local_copy_done(&mut self, block: Rank) {
        let left = self.block_left.get_mut(&block).unwrap();
        *left -= 1;
        if *left == 0 {
            let n = self.view.as_ref().unwrap().n;
            let b = u64::from(block);
            for psn in b * n..(b + 1) * n {
                self.set_bit(psn);
            }
        }
    }

    /// Every multicast of this SP is done: the activation signal goes to
    /// the next SP of the chain.
    fn multicasts_done(&mut self) {
        self.mcast_done = true;
        let v = self.view.as_ref().unwrap();
        let shape = v.shape;
        if let Some(next) = v.chain_next {
            self.send(next, Msg::Go { shape });
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
            // The SP where the abort began tells the whole ring; every
            // aborted SP tells its neighbours and those waiting for it.
            let ring = self.view.as_ref().map(|v| v.ring.clone());
            if self
                .core
                .abort
                .start_broadcast(self.abort_local && ring.is_some())
            {
                for sp in ring.unwrap() {
                    self.notify_abort(sp);
                }
            }
            if let Some(v) = &self.view {
                for sp in [v.left(), v.right()].into_iter().flatten() {
                    self.notify_abort(sp);
                }
            }
            let waiting: Vec<SpId> = self.early.keys().copied().collect();
            for sp in waiting {
                self.notify_abort(sp);
            }
        } else if self.view.is_some() {
            self.progress();
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

    /// The barrier, the local copies and the multicast, as far as they
    /// can go.
    fn progress(&mut self) {
        if !self.ready_sent && self.core.ranks.len() == self.local.len() {
            self.get_ready();
        }
        let v = self.view.as_ref().unwrap();
        let (shape, ring_len) = (v.shape, v.ring.len());
        if v.is_coordinator() && !self.open_sent {
            self.open_sent = true;
            let others: Vec<SpId> = v.ring[1..].to_vec();
            for sp in others {
                self.send(sp, Msg::Open { shape });
            }
        }
        let v = self.view.as_ref().unwrap();
        if v.is_coordinator() && self.ready_sent && !self.started {
            let others: Vec<SpId> = v.ring[1..].to_vec();
            if others.iter().all(|s| self.ready_from.contains(s)) {
                for sp in others {
                    self.send(sp, Msg::Start { shape });
                }
                self.begin();
            }
        }
        let v = self.view.as_ref().unwrap();
        let head = v.chain_prev.is_none();
        if !self.started || self.mcast_started || !(head || self.go_in) {
            return;
        }
        self.mcast_started = true;
        if ring_len == 1 {
            self.multicasts_done();
            return;
        }
        let (n, p) = (v.n, v.p);
        let runs = subgroup_runs(n, shape.subgroups);
        for block in self.local.clone() {
            let key = self.core.ranks[&block].send.clone();
            let b = u64::from(block);
            for (g, &(first, end)) in runs.iter().enumerate() {
                if first == end {
                    continue;
                }
                let at = |i: u64| (i * shape.mtu).min(shape.len);
                let (from, to) = (at(first), at(end));
                let id = self.core.new_id();
                let kind = CopyKind::Multicast {
                    block,
                    psns: end - first,
                    bytes: to - from,
                };
                self.core.copies.insert(id, kind);
                self.mcasts_in_flight += 1;
                self.core.ranks.get_mut(&block).unwrap().reads += 1;
                self.core.actions.push_back(Action::Multicast(Multicast {
                    id: CopyId(id),
                    key: key.clone(),
                    block,
                    subgroup: g as u16,
                    first_psn: b * n + first,
                    psns: end - first,
                    offset: from,
                    len: to - from,
                    mtu: shape.mtu,
                    chunks: p * n,
                }));
            }
        }
        if self.mcasts_in_flight == 0 {
            // No local rank (cannot happen: every SP of the ring serves
            // one), nothing to send.
            self.multicasts_done();
        }
    }

    /// Every local rank posted: register, start the local copies, tell the
    /// coordinator.
    fn get_ready(&mut self) {
        self.ready_sent = true;
        let v = self.view.as_ref().unwrap();
        let (shape, n, p) = (v.shape, v.n, v.p);
        let (coord, is_coord, alone) = (v.coordinator(), v.is_coordinator(), v.ring.len() == 1);
        let keys: Vec<(Rank, K)> = self
            .core
            .ranks
            .iter()
            .map(|(&r, st)| (r, st.recv.clone()))
            .collect();
        if !alone {
            self.registered = true;
            self.core.actions.push_back(Action::Register(Register {
                blocks: p,
                chunks: n,
                mtu: shape.mtu,
                len: shape.len,
                subgroups: shape.subgroups,
                keys: keys.clone(),
            }));
        }
        for block in self.local.clone() {
            self.block_left.insert(block, keys.len());
            let src = self.core.ranks[&block].send.clone();
            for (rank, dst) in &keys {
                let id = self.core.new_id();
                let c = Copy {
                    id: CopyId(id),
                    rank: *rank,
                    src: src.clone(),
                    src_offset: 0,
                    dst: dst.clone(),
                    dst_offset: u64::from(block) * shape.len,
                    len: shape.len,
                };
                if self.start_copy(CopyKind::Local { block, rank: *rank }, c) {
                    self.core.stats.local_copies += 1;
                    self.core.ranks.get_mut(&block).unwrap().reads += 1;
                    self.core.ranks.get_mut(rank).unwrap().writes += 1;
                } else {
                    self.local_copy_done(block);
                }
            }
        }
        if !is_coord {
            self.send(coord, Msg::Ready { shape });
        }
    }

    /// Acknowledges to the right neighbour the requested runs that are
    /// here now.
    fn serve_fetch(&mut self) {
        let Some(asked) = &self.serve else { return };
        if self.core.abort.is_some() {
            self.serve = None;
            self.serve_ready.clear();
            return;
        }
        if self.serve_fresh {
            self.serve_fresh = false;
            self.serve_ready = asked.iter().flat_map(|&r| self.runs(r, true)).collect();
            self.serve_left = asked.iter().map(|&(a, b)| b - a).sum();
        }
        let ready: u64 = self.serve_ready.iter().map(|&(a, b)| b - a).sum();
        if ready == 0 || (mutated(Mutation::WholeAcks) && ready < self.serve_left) {
            return;
        }
        self.serve_left -= ready;
        let here = std::mem::take(&mut self.serve_ready);
        if self.serve_left == 0 {
            self.serve = None;
        }
        let v = self.view.as_ref().unwrap();
        let to = if mutated(Mutation::FetchFromRight) {
            v.left()
        } else {
            v.right()
        };
        // Any local rank's receive buffer: all hold what the bits say.
        let holder = self.local[0];
        let (Some(st), Some(to)) = (self.core.ranks.get(&holder), to) else {
            return;
        };
        let key = st.recv.clone();
        self.acked_right = true;
        self.core.stats.fetch_acks_sent += 1;
        self.send(to, Msg::FetchAck { key, ranges: here });
    }

    /// Sends `Final` to the left neighbour once this SP will never read it
    /// again: every chunk is in (or it aborted after asking it for chunks)
    /// and no fetch copy is in flight.
    fn send_final(&mut self) {
        let Some(v) = &self.view else { return };
        if self.final_sent || v.ring.len() == 1 {
            return;
        }
        let copies = self.fetch.as_ref().map_or(0, |f| f.copies);
        let aborted = self.core.abort.is_some();
        let done = self.has_all() || (aborted && self.fetch.is_some());
        if copies > 0 || !done || (!aborted && !self.unregistered) {
            return;
        }
        let shape = v.shape;
        let left = v.left().unwrap();
        self.final_sent = true;
        self.send(left, Msg::Final { shape });
    }

    /// Completes local `rank` once nothing touches its buffers and its
    /// part is done (see the module docs).
    fn check_complete(&mut self, rank: Rank) {
        let Some(v) = &self.view else { return };
        let st = &self.core.ranks[&rank];
        if st.out.completed || st.reads > 0 || st.writes > 0 {
            return;
        }
        if self.registered && !self.unregistered {
            return;
        }
        let released = self.final_from_right || self.right_lost || v.ring.len() == 1;
        let ready = if self.core.abort.is_some() || !st.out.status.is_ok() {
            !self.acked_right || released
        } else {
            // A fetched run in flight may still fan out into any local
            // rank, even once every bit is set (landed meanwhile).
            let fetching = self.fetch.as_ref().is_some_and(|f| !f.groups.is_empty());
            self.has_all()
                && !fetching
                && self.mcast_done
                && (released || mutated(Mutation::CompleteBeforeFinal))
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
