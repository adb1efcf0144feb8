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
                    root: o.post_root[rank as usize],
                    members: self.core.rank_sp.clone(),
                    key: SimKey {
                        op: op as u32,
                        rank,
                    },
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
                    self.core.send(op, sp, to, wire, out, (op, msg))?;
                }
                Action::Register(r) => {
                    let o = &self.ops[op];
                    let mine = &self.local[&sp];
                    let keys: Vec<(Rank, SimKey)> = mine
                        .iter()
                        .map(|&rank| {
                            let key = SimKey {
                                op: op as u32,
                                rank,
                            };
                            (rank, key)
                        })
                        .collect();
                    // With inconsistent posts the SP's view is its first
                    // post's: one of its ranks' length, maybe another root.
                    let mtu = self.cfg.mtu.max(1);
                    let view_ok = if o.inconsistent {
                        mine.iter().any(|&q| o.post_len[q as usize] == r.len)
                            && r.chunks == r.len.div_ceil(mtu).max(1)
                    } else {
                        sp != o.ring[0] && r.chunks == o.n && r.len == o.len
                    };
                    if !view_ok || r.keys != keys || r.mtu != mtu || o.registered.contains_key(&sp)
                    {
                        return Err(self.fail(format!("op {op}: SP {sp}: bad registration {r:?}")));
                    }
                    self.ops[op].registered.insert(sp, mine.clone());
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
                    o.reads[c.src.rank as usize] += 1;
                    o.writes[c.dst.rank as usize] += 1;
                    self.pending
                        .insert((op, sp, c.id.0), (c.src.rank, c.dst.rank));
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

    /// The root's SP multicasts a subgroup run: checked, then each datagram
    /// put on the wire to every other SP of the ring.
    fn start_multicast(
        &mut self,
        op: usize,
        sp: SpId,
        m: Multicast<SimKey>,
        out: Nanos,
    ) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let mtu = self.cfg.mtu.max(1);
        // The root's buffer; with inconsistent posts, that of any rank
        // naming itself root (every SP's view agreed on it).
        let x = m.key.rank;
        let root_ok = if o.inconsistent {
            (x as usize) < o.buf.len()
                && o.post_root[x as usize] == x
                && self.core.rank_sp[x as usize] == sp
        } else {
            sp == o.ring[0] && x == o.root
        };
        let len = if root_ok {
            o.post_len[x as usize]
        } else {
            o.len
        };
        let n = len.div_ceil(mtu).max(1);
        let runs = subgroup_runs(n, self.cfg.subgroups.max(1));
        let want = runs.get(m.subgroup as usize).copied();
        let at = |i: u64| (i * mtu).min(len);
        let shape = root_ok
            && m.key.op == op as u32
            && want == Some((m.first_psn, m.first_psn + m.psns))
            && m.psns > 0
            && m.mtu == mtu
            && m.offset == at(m.first_psn)
            && m.len == at(m.first_psn + m.psns) - m.offset
            && !o.runs_sent.contains(&m.subgroup)
            && o.mcast_src.is_none_or(|(y, _)| y == x);
        if !shape {
            return Err(self.fail(format!("op {op}: SP {sp}: bad multicast {m:?}")));
        }
        if let Some(d) = o.done[x as usize] {
            return Err(self.fail(format!(
                "op {op}: multicast of the root's buffer, completed at {}ns",
                d.at
            )));
        }
        // Every other SP of the communicator joined the groups.
        let to: Vec<SpId> = self
            .member_sps
            .iter()
            .copied()
            .filter(|&s| s != sp)
            .collect();
        let o = &mut self.ops[op];
        o.mcast_src = Some((x, len));
        o.runs_sent.insert(m.subgroup);
        o.reads[x as usize] += 1;
        let ppm = self.cfg.faults.copy_error_ppm as u64;
        let fail = ppm > 0 && self.core.rng.chance(ppm, 1_000_000);
        let mut last = out + self.cfg.cost.copy_fixed_intra_ns;
        if fail {
            self.ops[op].disturbed = true;
        } else {
            for psn in m.first_psn..m.first_psn + m.psns {
                let bytes = at(psn + 1) - at(psn);
                self.ops[op].datagrams += to.len() as u64;
                last = self.core.multicast((op, sp, psn), bytes, &to, last);
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
        let p = o.buf.len() as u32;
        let bad = |what: &str| Err(self.fail(format!("op {op}: SP {sp}: {what}: {c:?}")));
        if c.src.op != op as u32 || c.dst.op != op as u32 || c.src.rank >= p || c.dst.rank >= p {
            return bad("a buffer of another collective");
        }
        if c.dst.rank != c.rank || self.core.rank_sp[c.rank as usize] != sp || c.rank == o.root {
            return bad("a write into a buffer that is not a local non-root rank's");
        }
        let fits = |r: Rank| c.offset + c.len <= o.post_len[r as usize];
        if c.len == 0
            || !c.offset.is_multiple_of(mtu)
            || (!o.inconsistent && c.offset + c.len > o.len)
            || !fits(c.src.rank)
            || !fits(c.dst.rank)
        {
            return bad("not whole chunks of the message");
        }
        let src_sp = self.core.rank_sp[c.src.rank as usize];
        let x = c.src.rank;
        if src_sp == sp {
            // With inconsistent posts, any rank naming itself root may be
            // the root of its SP's view.
            let root_here = if o.inconsistent {
                o.post_root[x as usize] == x && c.len == o.post_len[x as usize]
            } else {
                sp == o.ring[0] && x == o.root && c.len == o.len
            };
            if !root_here || c.offset != 0 {
                return bad("a local copy that is not the root's whole message at its SP");
            }
        } else {
            // With inconsistent posts, the SP's ring may start at any root
            // its ranks name.
            let rings: Vec<Vec<SpId>> = if o.inconsistent {
                self.local[&sp]
                    .iter()
                    .map(|&q| expected_ring(&self.core.rank_sp, o.post_root[q as usize]))
                    .collect()
            } else {
                vec![o.ring.clone()]
            };
            let left_of = |ring: &Vec<SpId>| {
                let i = ring.iter().position(|&s| s == sp).unwrap();
                (i > 0).then(|| ring[i - 1])
            };
            if !rings.iter().any(|ring| left_of(ring) == Some(src_sp)) {
                let i = o.ring.iter().position(|&s| s == sp).unwrap();
                return Err(self.fail(format!(
                    "op {op}: SP {sp} fetches from SP {src_sp}'s buffer (rank {}), not from its left neighbour {:?}'s",
                    c.src.rank,
                    i.checked_sub(1).map(|k| o.ring[k])
                )));
            }
        }
        Ok(())
    }

    /// No copy or multicast starts or finishes on a buffer whose rank
    /// completed.
    fn check_open(&self, op: usize, c: &Copy<SimKey>, when: &str) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        for (rank, what) in [(c.src.rank, "reads"), (c.dst.rank, "writes")] {
            if let Some(d) = o.done[rank as usize] {
                return Err(self.fail(format!(
                    "op {op}: copy {} {when}: it {what} the buffer of rank {rank}, completed at {}ns",
                    c.id.0, d.at
                )));
            }
        }
        Ok(())
    }

    /// Starts the copies SP `sp`'s limiter admits.
    pub(super) fn pump(&mut self, sp: SpId, at: Nanos) -> Result<(), SimFailure> {
        while let Some((op, work)) = self.core.next_copy(sp)? {
            let Work::Copy(c) = work else {
                return Err(self.fail("a multicast in the copy limiter"));
            };
            self.check_open(op, &c, "started")?;
            let (a, b) = (c.offset as usize, (c.offset + c.len) as usize);
            let bytes = self.ops[op].buf[c.src.rank as usize][a..b].to_vec();
            self.read_at_start.insert((op, sp, c.id.0), bytes);
            let src_node = self.core.rank_node[c.src.rank as usize];
            let src_sp = self.core.rank_sp[c.src.rank as usize];
            let node = self.core.sp_node(sp);
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
                self.ops[op].reads[m.key.rank as usize] -= 1;
                Ok(!fail)
            }
            Work::Copy(c) => {
                self.check_open(op, c, "finished")?;
                self.core.sps[sp as usize].limiter.finished();
                let bytes = self
                    .read_at_start
                    .remove(&(op, sp, c.id.0))
                    .expect("started");
                self.pending.remove(&(op, sp, c.id.0));
                let src_sp = self.core.rank_sp[c.src.rank as usize];
                let ok = !fail && self.core.is_alive(src_sp);
                let o = &mut self.ops[op];
                o.reads[c.src.rank as usize] -= 1;
                o.writes[c.dst.rank as usize] -= 1;
                if ok {
                    let a = c.offset as usize;
                    o.buf[c.dst.rank as usize][a..a + bytes.len()].copy_from_slice(&bytes);
                    self.copies += 1;
                    self.bytes_copied += c.len;
                } else {
                    o.disturbed = true;
                }
                Ok(ok)
            }
        }
    }

    /// SP `sp`'s receive worker lands datagram `psn` of `op` in every
    /// registered buffer and tells the instance.
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
        let mtu = self.cfg.mtu.max(1);
        let (x, len) = o.mcast_src.expect("a datagram was multicast");
        let (a, b) = (
            (psn * mtu).min(len) as usize,
            ((psn + 1) * mtu).min(len) as usize,
        );
        if let Some(&r) = ranks.iter().find(|&&r| b as u64 > o.post_len[r as usize]) {
            return Err(self.fail(format!(
                "op {op}: chunk {psn} landed past the posted length of rank {r}"
            )));
        }
        let ranks = ranks.clone();
        let o = &mut self.ops[op];
        let chunk = o.buf[x as usize][a..b].to_vec();
        for r in ranks {
            o.buf[r as usize][a..b].copy_from_slice(&chunk);
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
        if o.reads[r] > 0 || o.writes[r] > 0 {
            return Err(self.fail(format!(
                "op {op}: rank {rank} completed while {} reads and {} writes of its buffer are in flight",
                o.reads[r], o.writes[r]
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
    match msg {
        Msg::Open { ring, .. } => 4 + 8 + 8 + 2 + 4 * ring.len() as u64,
        Msg::Ready { .. } | Msg::Sent { .. } | Msg::Final { .. } => 4 + 8 + 8,
        Msg::FetchReq { ranges, .. } => 4 + 8 + 8 + 16 * ranges.len() as u64,
        Msg::FetchAck { .. } => 16,
        Msg::Abort { .. } => 1,
    }
}
