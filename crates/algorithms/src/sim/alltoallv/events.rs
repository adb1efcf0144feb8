//! Inputs of the SPs, the actions of their instances executed, the
//! checkers, the final checks and the report.

use super::*;
use crate::sim::shared::{check_buffers_open, deliver, due_completion};

impl<'a> Sim<'a> {
    pub(super) fn process_input(&mut self, sp: SpId, input: Input) -> Result<(), SimFailure> {
        let now = self.core.now;
        let mut touched: Vec<usize> = Vec::new();
        match input {
            Input::Post { op, rank } => {
                let o = &mut self.ops[op];
                let r = rank as usize;
                o.post_ns[r] = Some(now);
                let post = Post {
                    rank,
                    members: o.members.clone(),
                    send_key: SimKey::send(op, rank),
                    recv_key: SimKey::recv(op, rank),
                    recv_counts: o.recv_counts[r].clone(),
                    recv_displs: o.recv_displs[r].clone(),
                    own: Own {
                        send_counts: o.send_counts[r].clone(),
                        send_displs: o.send_displs[r].clone(),
                    },
                };
                if let Err(e) = self.instance(sp, op).handle_post(now, post) {
                    return Err(self.fail(format!(
                        "op {op} rank {rank} on SP {sp}: post rejected: {e}"
                    )));
                }
                touched.push(op);
            }
            Input::Msg {
                from,
                msg: (key, msg),
            } => {
                // Demultiplex by CollKey, as the SP does.
                let Some(&op) = self.by_key.get(&key) else {
                    return Err(self.fail(format!("message for unknown collective {key:?}")));
                };
                if self.core.sps[sp as usize].known_lost.contains(&from) {
                    return Ok(()); // the connection to `from` is gone
                }
                deliver(self.instance(sp, op), now, (op, sp, from), msg)
                    .map_err(|e| self.fail(e))?;
                touched.push(op);
            }
            Input::CopyDone { op, copy, fail } => {
                self.check_buffers_open(op, &copy, "finished")?;
                let status = if fail {
                    Status::AccessError
                } else {
                    self.do_copy(op, &copy)?;
                    Status::Ok
                };
                self.core.sps[sp as usize].limiter.finished();
                self.instance(sp, op).handle_copy_done(now, copy.id, status);
                touched.push(op);
            }
            Input::PeerLost { lost } => {
                self.core.sps[sp as usize].known_lost.insert(lost);
                for op in 0..self.ops.len() {
                    let o = &self.ops[op];
                    if o.sps.contains(&sp) && o.sps.contains(&lost) {
                        self.loss_notified.insert((op, sp));
                        self.instance(sp, op).handle_peer_lost(now, lost);
                        touched.push(op);
                    }
                }
            }
            Input::Landed { op, .. } | Input::Timer { op } => {
                return Err(self.core.fail(format!("op {op}: no fabric or timers here")));
            }
            Input::RankLost { world } => {
                for (op, rank) in self.rank_ops[world as usize].clone() {
                    self.instance(sp, op).handle_rank_lost(now, rank);
                    touched.push(op);
                }
            }
        }
        self.finish_input(sp, now, touched)
    }

    crate::sim::shared::finish_input!();

    pub(super) fn drain(&mut self, sp: SpId, op: usize, out: Nanos) -> Result<(), SimFailure> {
        while let Some(action) = self.instance(sp, op).poll_action() {
            match action {
                Action::Send { to, msg } => {
                    let (key, wire) = (self.ops[op].key, Self::msg_bytes(&msg));
                    self.core.send(op, sp, to, wire, out, (key, msg))?;
                }
                Action::Copy(copy) => {
                    let o = &self.ops[op];
                    if o.members.get(copy.dst_rank as usize) != Some(&sp) {
                        return Err(self.fail(format!(
                            "op {op}: SP {sp} emitted a copy into rank {} it does not serve",
                            copy.dst_rank
                        )));
                    }
                    self.core.sps[sp as usize].limiter.push((op, copy));
                }
                Action::Complete { rank, status } => self.complete(sp, op, rank, status, out)?,
            }
        }
        Ok(())
    }

    /// Size of the message's fields on the wire (the SimKey standing in for
    /// a 16-byte remote key descriptor).
    pub(super) fn msg_bytes(msg: &Msg<SimKey>) -> u64 {
        match msg {
            Msg::Announce { .. } => 4 + 4 + 16 + 8 + 8,
            Msg::Ack { .. } => 4 + 4 + 1,
            Msg::Abort { .. } => 1,
        }
    }

    pub(super) fn complete(
        &mut self,
        sp: SpId,
        op: usize,
        rank: Rank,
        status: Status,
        at: Nanos,
    ) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let r = rank as usize;
        if o.members.get(r) != Some(&sp) {
            return Err(self.fail(format!(
                "op {op}: SP {sp} completed rank {rank} it does not serve"
            )));
        }
        if o.post_ns[r].is_none() {
            return Err(self.fail(format!("op {op}: rank {rank} completed without posting")));
        }
        if let Some((t, s)) = o.done[r] {
            return Err(self.fail(format!(
                "op {op}: rank {rank} completed twice (first at {t}ns with {s}, now {status})"
            )));
        }
        let w = o.world[r];
        self.ops[op].done[r] = Some((at, status));
        if status.is_ok() && self.loss_notified.contains(&(op, sp)) {
            return Err(self.fail(format!(
                "op {op}: rank {rank} completed Ok after SP {sp} learned of a lost peer"
            )));
        }
        // Back to back: the host posts its next collective.
        if !self.cfg.overlap_ops && !self.core.host_dead[w as usize] {
            let list = &self.rank_ops[w as usize];
            if let Some(k) = list.iter().position(|&(i, _)| i == op) {
                if let Some(&(next, next_rank)) = list.get(k + 1) {
                    let t = at + self.post_delay(w);
                    self.core.schedule_post(t, w, next, next_rank);
                }
            }
        }
        Ok(())
    }

    /// Start every copy the SP's limiter admits.
    pub(super) fn pump(&mut self, sp: SpId, at: Nanos) -> Result<(), SimFailure> {
        while let Some((op, copy)) = self.core.next_copy(sp)? {
            self.check_copy(op, &copy)?;
            self.check_buffers_open(op, &copy, "started")?;
            let src_world = self.ops[op].world[copy.src_rank as usize];
            let src_node = self.core.rank_node[src_world as usize];
            let cost = self.core.copy_cost(src_node, sp, copy.len);
            let ppm = self.cfg.faults.copy_error_ppm as u64;
            let fail = ppm > 0 && self.core.rng.chance(ppm, 1_000_000);
            if fail {
                let o = &mut self.ops[op];
                o.disturbed = true;
                o.forced_error.insert(copy.src_rank);
                o.forced_error.insert(copy.dst_rank);
            }
            self.core.schedule(
                at + cost,
                Ev::Input {
                    sp,
                    input: Input::CopyDone { op, copy, fail },
                },
            );
        }
        Ok(())
    }

    /// Keys, ranks and bounds of a copy.
    pub(super) fn check_copy(&self, op: usize, c: &Copy<SimKey>) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let p = o.world.len();
        if c.src_rank as usize >= p || c.dst_rank as usize >= p {
            return Err(self.fail(format!("op {op}: copy with rank out of range: {c:?}")));
        }
        let want_src = SimKey::send(op, c.src_rank);
        let want_dst = SimKey::recv(op, c.dst_rank);
        if c.src_key != want_src || c.dst_key != want_dst {
            return Err(self.fail(format!("op {op}: copy with foreign keys: {c:?}")));
        }
        let src_len = o.send_buf[c.src_rank as usize].len() as u64;
        let dst_len = o.recv_buf[c.dst_rank as usize].len() as u64;
        let src_ok = c
            .src_offset
            .checked_add(c.len)
            .is_some_and(|e| e <= src_len);
        let dst_ok = c
            .dst_offset
            .checked_add(c.len)
            .is_some_and(|e| e <= dst_len);
        if !src_ok || !dst_ok {
            return Err(self.fail(format!(
                "op {op}: copy out of bounds (send buffer {src_len} bytes, receive buffer {dst_len} bytes): {c:?}"
            )));
        }
        Ok(())
    }

    pub(super) fn check_buffers_open(
        &self,
        op: usize,
        c: &Copy<SimKey>,
        when: &str,
    ) -> Result<(), SimFailure> {
        let bufs = [(c.src_rank, "send"), (c.dst_rank, "receive")];
        check_buffers_open(&self.core, (op, c.id.0), bufs, &self.ops[op].done, when)
    }

    pub(super) fn do_copy(&mut self, op: usize, c: &Copy<SimKey>) -> Result<(), SimFailure> {
        self.check_copy(op, c)?;
        let o = &mut self.ops[op];
        let (so, d, len) = (c.src_offset as usize, c.dst_offset as usize, c.len as usize);
        let src = &o.send_buf[c.src_rank as usize][so..so + len];
        o.recv_buf[c.dst_rank as usize][d..d + len].copy_from_slice(src);
        let (src, dst) = (o.world[c.src_rank as usize], o.world[c.dst_rank as usize]);
        self.core.count_copy(src, dst, c.len);
        Ok(())
    }

    pub(super) fn final_checks(&mut self) -> Result<(), SimFailure> {
        let crashed: BTreeSet<SpId> = self.core.crashed.iter().copied().collect();
        for (i, o) in self.ops.iter().enumerate() {
            let p = o.world.len();
            for r in 0..p {
                let w = o.world[r];
                let sp = o.members[r];
                let what = format!("op {i} ({:?}) rank {r} (world {w}, SP {sp})", o.key);
                // A rank of a crashed SP may never complete; a dead host
                // that never posted has nothing to complete.
                let exempt = crashed.contains(&sp)
                    || (self.core.host_dead[w as usize] && o.post_ns[r].is_none());
                let due = due_completion(
                    &self.core,
                    &self.inst,
                    (i, sp),
                    &what,
                    (o.done[r], exempt),
                    o.post_ns[r],
                )?;
                let Some((_, status)) = due else {
                    self.check_recv_buffer(i, r, false)?;
                    continue;
                };
                let rank = r as Rank;
                let expected = if o.disturbed {
                    None // anything, but see forced_error below
                } else if o.mismatch.contains(&rank) {
                    Some(Status::CountMismatch)
                } else {
                    Some(Status::Ok)
                };
                if expected.is_some_and(|e| e != status) {
                    return Err(self.fail(format!(
                        "{what}: {status}, expected {} (mismatched ranks: {:?})",
                        expected.unwrap_or(Status::Ok),
                        o.mismatch
                    )));
                }
                if status.is_ok() && o.forced_error.contains(&rank) {
                    return Err(self.fail(format!("{what}: Ok despite a fault on its blocks")));
                }
                let exact = matches!(o.done[r], Some((_, Status::Ok)));
                self.check_recv_buffer(i, r, exact)?;
            }
        }
        for (&(sp, op), a) in &self.inst {
            if crashed.contains(&sp) {
                continue;
            }
            if a.members().is_some() && !a.is_finished() {
                return Err(self.fail(format!(
                    "op {op}: instance on live SP {sp} is not finished at the end"
                )));
            }
        }
        Ok(())
    }

    /// Compare a receive buffer with the reference alltoallv. `exact`:
    /// every block must be right; otherwise each block must be either right
    /// or untouched. Bytes outside blocks must keep the sentinel.
    pub(super) fn check_recv_buffer(
        &self,
        op: usize,
        d: usize,
        exact: bool,
    ) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let buf = &o.recv_buf[d];
        let mut covered = vec![false; buf.len()];
        for s in 0..o.world.len() {
            let len = o.recv_counts[d][s] as usize;
            let at = o.recv_displs[d][s] as usize;
            let got = &buf[at..at + len];
            let matches = o.send_counts[s][d] as usize == len;
            let expected = if matches {
                let so = o.send_displs[s][d] as usize;
                Some(&o.send_buf[s][so..so + len])
            } else {
                None
            };
            let right = expected.is_some_and(|e| e == got);
            let untouched = got.iter().enumerate().all(|(i, &b)| b == sentinel(at + i));
            if exact && !right {
                return Err(self.fail(format!(
                    "op {op}: rank {d} completed Ok but its block from rank {s} ({len} bytes at {at}) is wrong"
                )));
            }
            if !right && !untouched {
                return Err(self.fail(format!(
                    "op {op}: rank {d}: block from rank {s} ({len} bytes at {at}) is neither right nor untouched"
                )));
            }
            covered[at..at + len].iter_mut().for_each(|c| *c = true);
        }
        if let Some(i) = (0..buf.len()).find(|&i| !covered[i] && buf[i] != sentinel(i)) {
            return Err(self.fail(format!(
                "op {op}: rank {d}: byte {i} outside every block was overwritten"
            )));
        }
        Ok(())
    }

    pub(super) fn report(&self) -> SimReport {
        let ops: Vec<OpReport> = self
            .ops
            .iter()
            .map(|o| OpReport {
                key: o.key,
                world_ranks: o.world.clone(),
                post_ns: o.post_ns.clone(),
                completion_ns: o.done.iter().map(|d| d.map(|(t, _)| t)).collect(),
                status: o.done.iter().map(|d| d.map(|(_, s)| s)).collect(),
                done_ns: o.done.iter().filter_map(|d| d.map(|(t, _)| t)).max(),
            })
            .collect();
        let error_completions = self
            .ops
            .iter()
            .flat_map(|o| o.done.iter())
            .filter(|d| matches!(d, Some((_, s)) if !s.is_ok()))
            .count() as u64;
        SimReport {
            outcome: self.core.outcome(error_completions),
            end_ns: ops.iter().filter_map(|o| o.done_ns).max().unwrap_or(0),
            ops,
            copies: self.core.copies,
            bytes_copied_intra_node: self.core.bytes_intra,
            bytes_copied_inter_node: self.core.bytes_inter,
            late_announcements: self
                .inst
                .values()
                .map(|a| a.stats().late_announcements)
                .sum(),
        }
    }
}
