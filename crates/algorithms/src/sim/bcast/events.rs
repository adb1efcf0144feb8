//! Inputs of the SPs, and the actions of their instances executed.

use super::*;
use crate::sim::shared::deliver;
use crate::sim::staged_common::chunk_fits;

impl<'a> Sim<'a> {
    pub(super) fn process_input(&mut self, sp: SpId, input: Input) -> Result<(), SimFailure> {
        let now = self.core.now;
        let mut touched = Vec::new();
        match input {
            Input::Post { op, rank } => {
                let o = &mut self.ops[op];
                let r = rank as usize;
                o.post_ns[r] = Some(now);
                let design = self.cfg.design;
                let key = |shared| SimKey {
                    op: op as u32,
                    rank,
                    shared,
                };
                let post = Post {
                    rank,
                    root: o.post_root[r],
                    members: self.core.rank_sp.clone(),
                    nodes: self.core.rank_node.clone(),
                    key: key(false),
                    len: o.post_len[r],
                    design,
                    shared_key: (design == Design::Hier).then(|| key(true)),
                    shared_at: region_at(sp),
                };
                if let Err(e) = self.instance(sp, op).handle_post(now, post) {
                    return Err(self.fail(format!("op {op} rank {rank}: post rejected: {e}")));
                }
                touched.push(op);
            }
            Input::Msg {
                from,
                msg: (op, msg, payload),
            } => {
                // Zero-length chunks come as plain messages, without a move.
                let chunk = match msg {
                    Msg::Chunk { slot, len, .. } if len > 0 => Some((slot.0, len)),
                    _ => None,
                };
                if self.core.sps[sp as usize].known_lost.contains(&from) {
                    // The connection is gone: the chunk never lands.
                    if let Some((slot, _)) = chunk {
                        self.shadow(op, sp, slot)?.end_write();
                    }
                    return Ok(());
                }
                if let Some((slot, len)) = chunk {
                    let s = self.shadow(op, sp, slot)?;
                    if s.writers != 1 || s.readers != 0 || payload.len() as u64 != len {
                        return Err(self.fail(format!(
                            "op {op}: chunk into slot {slot} of SP {sp} without its move"
                        )));
                    }
                    s.end_write()[..len as usize].copy_from_slice(&payload);
                }
                if matches!(msg, Msg::Abort { .. }) {
                    self.ops[op].notified.insert(sp);
                }
                deliver(self.instance(sp, op), now, (op, sp, from), msg)
                    .map_err(|e| self.fail(e))?;
                touched.push(op);
            }
            Input::CopyDone { op, copy, fail } => {
                let status = if fail {
                    Status::AccessError
                } else {
                    Status::Ok
                };
                match copy {
                    Work::Copy(c) => {
                        self.check_open(op, sp, &c, "finished")?;
                        self.finish_copy(op, sp, &c, !fail)?;
                        self.core.sps[sp as usize].limiter.finished();
                        self.instance(sp, op).handle_copy_done(now, c.id, status);
                    }
                    Work::Move(m) => {
                        self.shadow(op, sp, m.src_slot.0)?.end_read();
                        self.instance(sp, op).handle_move_done(now, m.id, status);
                    }
                }
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
            Input::Landed { op, .. } | Input::Timer { op } => {
                return Err(self.core.fail(format!("op {op}: no fabric or timers here")));
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
        }
        self.finish_input(sp, now, touched)
    }

    crate::sim::shared::finish_input!();

    crate::sim::staged_common::staged_drain!(
        send: |op, msg| (op, msg, Vec::new()),
        copy: |c| Work::Copy(c)
    );

    pub(super) fn start_move(
        &mut self,
        op: usize,
        sp: SpId,
        m: Move,
        out: Nanos,
    ) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let want = tree_children(&o.tree, sp);
        let chunk = self.cfg.chunk_bytes.max(1);
        if (!o.inconsistent && !want.contains(&m.to))
            || !chunk_fits((m.len, m.chunk), chunk, o.n, o.inconsistent)
        {
            return Err(self.fail(format!(
                "op {op}: SP {sp} emitted a bad move {m:?} (its children: {want:?})"
            )));
        }
        self.begin_read((op, sp, m.src_slot.0), "a move")?;
        let payload = self.shadow(op, sp, m.src_slot.0)?.data[..m.len as usize].to_vec();
        let ppm = self.cfg.faults.copy_error_ppm as u64;
        let fail = ppm > 0 && self.core.rng.chance(ppm, 1_000_000);
        if fail {
            self.ops[op].disturbed = true;
        } else {
            self.begin_write((op, m.to, m.dst_slot.0), "an incoming move")?;
        }
        let inter = self.core.sp_node(sp) != self.core.sp_node(m.to);
        let c = &self.cfg.cost;
        let fixed = if inter {
            c.copy_fixed_inter_ns
        } else {
            c.copy_fixed_intra_ns
        };
        let o = &mut self.ops[op];
        o.moves += 1;
        o.count_bytes(inter, m.len);
        let landed = self.core.transfer(sp, m.to, m.len, out + fixed);
        self.core.schedule(
            landed,
            Ev::Input {
                sp,
                input: Input::CopyDone {
                    op,
                    copy: Work::Move(m),
                    fail,
                },
            },
        );
        if !fail {
            self.core.messages += 1;
            let jitter = self.core.rng.range(0, self.cfg.faults.msg_jitter_ns);
            self.core.schedule(
                landed + jitter,
                Ev::Input {
                    sp: m.to,
                    input: Input::Msg {
                        from: sp,
                        msg: (op, m.chunk_msg(), payload),
                    },
                },
            );
        }
        Ok(())
    }

    /// The host's side of a completion the checks admitted: with
    /// `from_segment`, the rank's copy out of the region (checked, done,
    /// costed); returns when the data are in the rank's buffer.
    fn host_copy(
        &mut self,
        (op, sp, rank): (usize, SpId, Rank),
        status: Status,
        from_segment: bool,
        at: Nanos,
    ) -> Result<Nanos, SimFailure> {
        let r = rank as usize;
        let o = &self.ops[op];
        let mut host_at = at;
        if from_segment {
            if !status.is_ok() || self.cfg.design != Design::Hier || o.post_root[r] == rank {
                return Err(self.fail(format!(
                    "op {op}: rank {rank} completed from the segment ({status}, {:?})",
                    self.cfg.design
                )));
            }
            // The host copies the message out of its node leader's region in
            // its wait: the SP says where that is. With inconsistent posts the
            // SPs may disagree on the root, so on the tree and its leaders: any
            // region of the node will do here, and the final check compares the
            // bytes with those of the root the rank named.
            let leader = o.tree.iter().find(|g| g.contains(&sp)).map(|g| g[0]);
            let src = self.inst.get(&(sp, op)).and_then(|a| a.segment_source());
            let node = self.core.sp_node(sp);
            let leads = |owner: SpId| {
                Some(owner) == leader || (o.inconsistent && self.core.sp_node(owner) == node)
            };
            let owner = match src {
                Some((owner, at, len)) if leads(owner) && at == region_at(owner) => {
                    if len != o.len && !o.inconsistent {
                        return Err(self.fail(format!(
                            "op {op}: rank {rank}: region of {len} bytes for a {}-byte message",
                            o.len
                        )));
                    }
                    owner
                }
                _ => {
                    return Err(self.fail(format!(
                        "op {op}: rank {rank} of SP {sp} copies from {src:?}, not from its \
                         leader {leader:?}'s region"
                    )))
                }
            };
            let n = (o.post_len[r] as usize).min(o.len as usize);
            let data = self.ops[op].seg[owner as usize][..n].to_vec();
            let o = &mut self.ops[op];
            o.buf[r][..n].copy_from_slice(&data);
            o.seg_sealed[owner as usize].get_or_insert(at);
            let node = self.core.sp_node(sp);
            host_at = at + self.core.copy_cost(node, sp, n as u64);
        }
        Ok(host_at)
    }

    crate::sim::staged_common::staged_complete!();

    pub(super) fn pump(&mut self, sp: SpId, at: Nanos) -> Result<(), SimFailure> {
        while let Some((op, work)) = self.core.next_copy(sp)? {
            let Work::Copy(c) = work else {
                return Err(self.fail("a move in the copy limiter"));
            };
            self.check_open(op, sp, &c, "started")?;
            if let Loc::Stage { slot, .. } = c.src {
                self.begin_read((op, sp, slot.0), "a copy")?;
            }
            if let Loc::Stage { slot, .. } = c.dst {
                self.begin_write((op, sp, slot.0), "a read from the root")?;
            }
            let node = self.core.sp_node(sp);
            let cost = self.core.copy_cost(node, sp, c.len);
            let ppm = self.cfg.faults.copy_error_ppm as u64;
            let fail = ppm > 0 && self.core.rng.chance(ppm, 1_000_000);
            if fail {
                self.ops[op].disturbed = true;
            }
            self.core.schedule(
                at + cost,
                Ev::Input {
                    sp,
                    input: Input::CopyDone {
                        op,
                        copy: Work::Copy(c),
                        fail,
                    },
                },
            );
        }
        Ok(())
    }
}
