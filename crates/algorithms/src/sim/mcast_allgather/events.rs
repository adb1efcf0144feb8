//! Inputs of the SPs, the actions of their instances executed (with the
//! checks of their shapes), the datagrams landed, the copies run.

use super::*;
use crate::sim::driver::Ev;
use crate::sim::shared::deliver;

impl<'a> Sim<'a> {
    pub(super) fn process_input(&mut self, sp: SpId, input: Input) -> Result<(), SimFailure> {
        let now = self.core.now;
        let mut touched = Vec::new();
        match input {
            Input::Post { op, rank } => {
                let o = &mut self.ops[op];
                o.post_ns[rank as usize] = Some(now);
                let post = Post {
                    rank,
                    members: self.core.rank_sp.clone(),
                    send_key: SimKey::send(op, rank),
                    recv_key: SimKey::recv(op, rank),
                    len: o.post_len[rank as usize],
                };
                if let Err(e) = self.instance(sp, op).handle_post(now, post) {
                    return Err(self.fail(format!("op {op} rank {rank}: post rejected: {e}")));
                }
                touched.push(op);
            }
            Input::Msg {
                from,
                msg: (op, msg),
            } => {
                if self.core.sps[sp as usize].known_lost.contains(&from) {
                    return Ok(());
                }
                if matches!(msg, Msg::Abort { .. }) {
                    self.ops[op].notified.insert(sp);
                }
                deliver(self.instance(sp, op), now, (op, sp, from), msg)
                    .map_err(|e| self.fail(e))?;
                touched.push(op);
            }
            Input::CopyDone { op, copy, fail } => {
                let status = match self.finish_work(op, sp, &copy, fail)? {
                    true => Status::Ok,
                    false => Status::AccessError,
                };
                let id = match copy {
                    Work::Copy(c) => c.id,
                    Work::Mcast(m) => m.id,
                };
                self.instance(sp, op).handle_copy_done(now, id, status);
                touched.push(op);
            }
            Input::PeerLost { lost } => {
                self.core.sps[sp as usize].known_lost.insert(lost);
                if self.member_sps.contains(&sp) {
                    for op in 0..self.ops.len() {
                        if self.member_sps.contains(&lost) {
                            self.ops[op].notified.insert(sp);
                        }
                        self.instance(sp, op).handle_peer_lost(now, lost);
                        touched.push(op);
                    }
                }
            }
            Input::RankLost { world } => {
                for op in 0..self.ops.len() {
                    if self.ops[op].done[world as usize].is_none() {
                        self.ops[op].notified.insert(sp);
                    }
                    self.instance(sp, op).handle_rank_lost(now, world);
                    touched.push(op);
                }
            }
            Input::Landed { op, psn } => {
                self.instance(sp, op).handle_landed(now, psn);
                touched.push(op);
            }
            Input::Timer { op } => {
                if self.timers.get(&(sp, op)) == Some(&now) {
                    self.timers.remove(&(sp, op));
                }
                self.instance(sp, op).handle_timeout(now);
                touched.push(op);
            }
        }
        self.finish_input(sp, now, touched)
    }

    crate::sim::shared::finish_input!();

    /// Executes every action of SP `sp`'s instance of `op`, leaving the SP
    /// at `out`, then schedules its timer.
    pub(super) fn drain(&mut self, sp: SpId, op: usize, out: Nanos) -> Result<(), SimFailure> {
        while let Some(action) = self.inst.get_mut(&(sp, op)).and_then(|a| a.poll_action()) {
            match action {
                Action::Send { to, msg } => {
                    if matches!(msg, Msg::FetchAck { .. })
                        && self.cfg.faults.crash_fetch_server
                        && !self.crashed_fetch_server
                    {
                        // It crashes while the neighbour reads its buffer.
                        self.crashed_fetch_server = true;
                        self.core.schedule(out + 1, Ev::Crash { sp });
                    }
                    let wire = msg_bytes(&msg);
                    let (a, b) = (self.core.sp_node(sp), self.core.sp_node(to));
                    if a != b {
                        let bytes = wire + self.cfg.cost.msg_header_bytes;
                        let t = &mut self.traffic;
                        t.control_bytes += bytes;
                        t.injected_per_node[a as usize] += bytes;
                        t.received_per_node[b as usize] += bytes;
                    }
                    self.core.send(op, sp, to, wire, out, (op, msg))?;
                }
                Action::Register(r) => {
                    let o = &self.ops[op];
                    let mine = &self.local[&sp];
                    let keys: Vec<(Rank, SimKey)> =
                        mine.iter().map(|&q| (q, SimKey::recv(op, q))).collect();
                    let mtu = self.cfg.mtu.max(1);
                    // With inconsistent posts the SP's view is its first
                    // post's length.
                    let len_ok = if o.inconsistent {
                        mine.iter().any(|&q| o.post_len[q as usize] == r.len)
                    } else {
                        r.len == o.len
                    };
                    let ok = len_ok
                        && r.chunks == r.len.div_ceil(mtu).max(1)
                        && r.blocks == o.post_len.len() as u64
                        && r.keys == keys
                        && r.mtu == mtu
                        && r.subgroups == self.cfg.subgroups.max(1)
                        && o.ring.len() > 1
                        && !o.registered.contains_key(&sp);
                    if !ok {
                        return Err(self.fail(format!("op {op}: SP {sp}: bad registration {r:?}")));
                    }
                    let o = &mut self.ops[op];
                    o.registered.insert(sp, mine.clone());
                    o.ever_registered.insert(sp);
                }
                Action::Unregister => {
                    if self.ops[op].registered.remove(&sp).is_none() {
                        return Err(self.fail(format!("op {op}: SP {sp} unregistered twice")));
                    }
                }
                Action::Multicast(m) => self.start_multicast(op, sp, m, out)?,
                Action::Copy(c) => {
                    self.check_copy(op, sp, &c)?;
                    let o = &mut self.ops[op];
                    if c.src.send {
                        o.reads_send[c.src.rank as usize] += 1;
                    } else {
                        o.reads_recv[c.src.rank as usize] += 1;
                    }
                    o.writes[c.dst.rank as usize] += 1;
                    self.pending.insert((op, sp, c.id.0), (c.src, c.dst));
                    self.core.sps[sp as usize].limiter.push((op, Work::Copy(c)));
                }
                Action::Complete { rank, status } => self.complete((op, sp, rank), status, out)?,
            }
        }
        if let Some(t) = self.inst.get(&(sp, op)).and_then(|a| a.poll_timeout()) {
            if self.timers.get(&(sp, op)) != Some(&t) {
                self.timers.insert((sp, op), t);
                let at = t.max(out);
                self.core.schedule_input(at, sp, Input::Timer { op });
            }
        }
        Ok(())
    }

    /// An SP multicasts a subgroup run of one of its blocks: checked, then
    /// each datagram put on the wire to every other SP of the ring.
    fn start_multicast(
        &mut self,
        op: usize,
        sp: SpId,
        m: Multicast<SimKey>,
        out: Nanos,
    ) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let mtu = self.cfg.mtu.max(1);
        let x = m.key.rank;
        let p = o.post_len.len() as u32;
        let own = x < p && m.key.send && m.block == x && self.core.rank_sp[x as usize] == sp;
        let (len, n) = (o.len, o.n);
        let runs = subgroup_runs(n, self.cfg.subgroups.max(1));
        let want = runs
            .get(m.subgroup as usize)
            .map(|&(a, e)| (u64::from(x) * n + a, u64::from(x) * n + e));
        let at = |i: u64| (i * mtu).min(len);
        let first = m.first_psn.wrapping_sub(u64::from(x) * n);
        let shape = own
            && !o.inconsistent
            && m.key.op == op as u32
            && want == Some((m.first_psn, m.first_psn + m.psns))
            && m.psns > 0
            && m.mtu == mtu
            && m.offset == at(first)
            && m.len == at(first + m.psns) - m.offset
            && !o.runs_sent.contains(&(x, m.subgroup));
        if !shape {
            return Err(self.fail(format!("op {op}: SP {sp}: bad multicast {m:?}")));
        }
        if let Some(d) = o.done[x as usize] {
            return Err(self.fail(format!(
                "op {op}: multicast of rank {x}'s block, completed at {}ns",
                d.at
            )));
        }
        // The RNR barrier: every other SP of the ring registered first.
        if let Some(s) = o
            .ring
            .iter()
            .find(|&&s| s != sp && !o.ever_registered.contains(&s))
        {
            return Err(self.fail(format!(
                "op {op}: SP {sp} multicasts before SP {s} registered (RNR barrier)"
            )));
        }
        // The sequencer: the chain predecessor's multicasts are all done.
        if let Some(prev) = o.chain_prev[&sp] {
            let done = o.mcasts_in_flight.get(&prev) == Some(&0);
            if !done {
                return Err(self.fail(format!(
                    "op {op}: SP {sp} multicasts before its chain predecessor SP {prev} is done"
                )));
            }
        }
        let to: Vec<SpId> = self
            .member_sps
            .iter()
            .copied()
            .filter(|&s| s != sp)
            .collect();
        let my_node = self.core.sp_node(sp);
        let rx_nodes: BTreeSet<u32> = to
            .iter()
            .map(|&s| self.core.sp_node(s))
            .filter(|&nd| nd != my_node)
            .collect();
        let o = &mut self.ops[op];
        o.runs_sent.insert((x, m.subgroup));
        *o.mcasts_in_flight.entry(sp).or_insert(0) += 1;
        o.reads_send[x as usize] += 1;
        let ppm = self.cfg.faults.copy_error_ppm as u64;
        let fail = ppm > 0 && self.core.rng.chance(ppm, 1_000_000);
        let mut last = out + self.cfg.cost.copy_fixed_intra_ns;
        if fail {
            self.ops[op].disturbed = true;
        } else {
            let header = self.cfg.cost.msg_header_bytes;
            for i in first..first + m.psns {
                let bytes = at(i + 1) - at(i);
                self.ops[op].datagrams += to.len() as u64;
                let g = u64::from(x) * n + i;
                last = self.core.multicast((op, sp, g), bytes, &to, last);
                let t = &mut self.traffic;
                t.mcast_payload_per_rank[x as usize] += bytes;
                t.injected_per_node[my_node as usize] += bytes + header;
                for &nd in &rx_nodes {
                    t.received_per_node[nd as usize] += bytes + header;
                }
            }
        }
        self.core.schedule_input(
            last,
            sp,
            Input::CopyDone {
                op,
                copy: Work::Mcast(m),
                fail,
            },
        );
        Ok(())
    }

    /// The shape of a copy when the SP emits it.
    fn check_copy(&self, op: usize, sp: SpId, c: &Copy<SimKey>) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let mtu = self.cfg.mtu.max(1);
        let p = o.post_len.len() as u32;
        let bad = |what: &str| Err(self.fail(format!("op {op}: SP {sp}: {what}: {c:?}")));
        if c.src.op != op as u32 || c.dst.op != op as u32 || c.src.rank >= p || c.dst.rank >= p {
            return bad("a buffer of another collective");
        }
        if c.dst.rank != c.rank || c.dst.send || self.core.rank_sp[c.rank as usize] != sp {
            return bad("a write into a buffer that is not a local receive buffer");
        }
        if c.len == 0 {
            return bad("an empty copy");
        }
        let src_sp = self.core.rank_sp[c.src.rank as usize];
        if c.src.send {
            // A local block, whole, to its place (with inconsistent posts
            // too: both ranks posted this length).
            let l = o.post_len[c.src.rank as usize];
            if src_sp != sp
                || c.src_offset != 0
                || c.len != l
                || o.post_len[c.dst.rank as usize] != l
                || c.dst_offset != u64::from(c.src.rank) * l
            {
                return bad("a local copy that is not a local block whole at its place");
            }
            return Ok(());
        }
        if o.inconsistent {
            return bad("a fetch though posts disagree");
        }
        let len = o.len;
        // A fetch: the left neighbour's receive buffer (or, fanning a
        // fetched run out, another local rank's), whole chunks, same place.
        let ring = &o.ring;
        let i = ring.iter().position(|&s| s == sp).unwrap();
        let left = ring[(i + ring.len() - 1) % ring.len()];
        let fan = src_sp == sp && c.src.rank != c.dst.rank;
        if (src_sp != left || src_sp == sp) && !fan {
            return Err(self.fail(format!(
                "op {op}: SP {sp} fetches from SP {src_sp}'s buffer (rank {}), not from its left neighbour {left}'s",
                c.src.rank
            )));
        }
        let boundary = |x: u64| {
            let total = u64::from(p) * len;
            x == total || (len > 0 && (x % len).is_multiple_of(mtu))
        };
        if c.src_offset != c.dst_offset
            || !boundary(c.src_offset)
            || !boundary(c.src_offset + c.len)
            || c.src_offset + c.len > u64::from(p) * len
        {
            return bad("a fetch that is not whole chunks in place");
        }
        Ok(())
    }

    /// No copy starts or finishes on a buffer whose rank completed.
    fn check_open(&self, op: usize, c: &Copy<SimKey>, when: &str) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        for (k, what) in [(c.src, "reads"), (c.dst, "writes")] {
            if let Some(d) = o.done[k.rank as usize] {
                return Err(self.fail(format!(
                    "op {op}: copy {} {when}: it {what} the buffer of rank {}, completed at {}ns",
                    c.id.0, k.rank, d.at
                )));
            }
        }
        Ok(())
    }

    fn buf(&mut self, op: usize, k: SimKey) -> &mut Vec<u8> {
        let o = &mut self.ops[op];
        if k.send {
            &mut o.send[k.rank as usize]
        } else {
            &mut o.recv[k.rank as usize]
        }
    }

    /// Starts the copies SP `sp`'s limiter admits.
    pub(super) fn pump(&mut self, sp: SpId, at: Nanos) -> Result<(), SimFailure> {
        while let Some((op, work)) = self.core.next_copy(sp)? {
            let Work::Copy(c) = work else {
                return Err(self.fail("a multicast in the copy limiter"));
            };
            self.check_open(op, &c, "started")?;
            if self.cfg.check_bytes {
                let (a, b) = (c.src_offset as usize, (c.src_offset + c.len) as usize);
                let bytes = self.buf(op, c.src)[a..b].to_vec();
                self.read_at_start.insert((op, sp, c.id.0), bytes);
            }
            let src_node = self.core.rank_node[c.src.rank as usize];
            let src_sp = self.core.rank_sp[c.src.rank as usize];
            let node = self.core.sp_node(sp);
            if src_sp != sp {
                self.traffic.fetched_from_rank[c.src.rank as usize] += c.len;
            }
            if src_node != node {
                let bytes = c.len + self.cfg.cost.msg_header_bytes;
                let t = &mut self.traffic;
                t.injected_per_node[src_node as usize] += bytes;
                t.received_per_node[node as usize] += bytes;
            }
            // A remote read crosses the partition only once it heals.
            let go = self.core.net.departure((src_node, node), at);
            let cost = self.core.copy_cost(src_node, sp, c.len);
            let ppm = self.cfg.faults.copy_error_ppm as u64;
            let dead = !self.core.is_alive(src_sp);
            let fail = dead || (ppm > 0 && self.core.rng.chance(ppm, 1_000_000));
            if fail {
                self.ops[op].disturbed = true;
            }
            self.core.schedule_input(
                go + cost,
                sp,
                Input::CopyDone {
                    op,
                    copy: Work::Copy(c),
                    fail,
                },
            );
        }
        Ok(())
    }

    /// A copy or multicast reported done: checked, its bytes written;
    /// whether it succeeded.
    fn finish_work(
        &mut self,
        op: usize,
        sp: SpId,
        w: &Work,
        fail: bool,
    ) -> Result<bool, SimFailure> {
        match w {
            Work::Mcast(m) => {
                let o = &mut self.ops[op];
                o.reads_send[m.key.rank as usize] -= 1;
                *o.mcasts_in_flight.get_mut(&sp).unwrap() -= 1;
                Ok(!fail)
            }
            Work::Copy(c) => {
                self.check_open(op, c, "finished")?;
                self.core.sps[sp as usize].limiter.finished();
                let bytes = self.read_at_start.remove(&(op, sp, c.id.0));
                self.pending.remove(&(op, sp, c.id.0));
                let src_sp = self.core.rank_sp[c.src.rank as usize];
                let ok = !fail && self.core.is_alive(src_sp);
                let o = &mut self.ops[op];
                if c.src.send {
                    o.reads_send[c.src.rank as usize] -= 1;
                } else {
                    o.reads_recv[c.src.rank as usize] -= 1;
                }
                o.writes[c.dst.rank as usize] -= 1;
                if ok {
                    if let Some(bytes) = bytes {
                        let a = c.dst_offset as usize;
                        self.buf(op, c.dst)[a..a + bytes.len()].copy_from_slice(&bytes);
                    }
                    self.copies += 1;
                    self.bytes_copied += c.len;
                } else {
                    self.ops[op].disturbed = true;
                }
                Ok(ok)
            }
        }
    }

    /// SP `sp`'s receive worker lands datagram `psn` (global) of `op` in
    /// every registered receive buffer and tells the instance.
    pub(super) fn land(&mut self, sp: SpId, op: usize, psn: u64) -> Result<(), SimFailure> {
        let now = self.core.now;
        let o = &self.ops[op];
        let Some(ranks) = o.registered.get(&sp) else {
            self.unregistered_drops += 1;
            return Ok(());
        };
        for &r in ranks {
            if let Some(d) = o.done[r as usize] {
                return Err(self.fail(format!(
                    "op {op}: chunk {psn} landed in the buffer of rank {r}, completed at {}ns",
                    d.at
                )));
            }
        }
        if self.cfg.check_bytes {
            let mtu = self.cfg.mtu.max(1);
            let (len, n) = (o.len, o.n);
            let (b, i) = (psn / n, psn % n);
            let (a, e) = (
                (i * mtu).min(len) as usize,
                ((i + 1) * mtu).min(len) as usize,
            );
            let off = (b * len) as usize;
            let ranks = ranks.clone();
            let o = &mut self.ops[op];
            let chunk = o.send[b as usize][a..e].to_vec();
            for r in ranks {
                o.recv[r as usize][off + a..off + e].copy_from_slice(&chunk);
            }
        }
        self.core.schedule_input(now, sp, Input::Landed { op, psn });
        Ok(())
    }

    /// SP `sp` completes `rank` of `op` at `at`: checked, recorded.
    fn complete(
        &mut self,
        (op, sp, rank): (usize, SpId, Rank),
        status: Status,
        at: Nanos,
    ) -> Result<(), SimFailure> {
        let r = rank as usize;
        let o = &self.ops[op];
        let notified = o.notified.contains(&sp);
        let before = o.done[r].map(|d| (d.at, d.status));
        self.core.check_completion(
            (op, sp, rank),
            status,
            o.post_ns[r].is_some(),
            before,
            notified,
        )?;
        let (rs, rr, w) = (o.reads_send[r], o.reads_recv[r], o.writes[r]);
        if rs + rr + w > 0 {
            return Err(self.fail(format!(
                "op {op}: rank {rank} completed while {} reads and {w} writes of its buffers are in flight",
                rs + rr
            )));
        }
        if o.registered.get(&sp).is_some_and(|v| v.contains(&rank)) {
            return Err(self.fail(format!(
                "op {op}: rank {rank} completed while SP {sp} still lands chunks in its buffer"
            )));
        }
        self.ops[op].done[r] = Some(Done { at, status });
        Ok(())
    }
}

/// Size of a message's fields on the wire.
pub(super) fn msg_bytes(msg: &Msg<SimKey>) -> u64 {
    const SHAPE: u64 = 8 + 8 + 2 + 4 + 8;
    match msg {
        Msg::Open { .. }
        | Msg::Ready { .. }
        | Msg::Start { .. }
        | Msg::Go { .. }
        | Msg::Final { .. } => SHAPE,
        Msg::FetchReq { ranges, .. } => SHAPE + 16 * ranges.len() as u64,
        Msg::FetchAck { ranges, .. } => 16 + 16 * ranges.len() as u64,
        Msg::Abort { .. } => 1,
    }
}
