//! Inputs of the SPs, and the actions of their instances executed.

use std::convert::Infallible;

use super::*;
use crate::sim::shared::deliver;

impl<'a> Sim<'a> {
    pub(super) fn process_input(&mut self, sp: SpId, input: Input) -> Result<(), SimFailure> {
        let now = self.core.now;
        let mut touched = Vec::new();
        match input {
            driver::Input::Post { op, rank } => {
                if self.finished(sp, op) {
                    return Err(self.fail(format!(
                        "op {op}: rank {rank} posts to a finished instance on SP {sp}"
                    )));
                }
                let r = rank as usize;
                let design = self.ops[op].design[sp as usize];
                let (members, nodes) = self.ops[op].post_comm[r]
                    .clone()
                    .unwrap_or_else(|| (self.core.rank_sp.clone(), self.core.rank_node.clone()));
                let len = self.ops[op].post_len[r];
                let key = |kind| SimKey {
                    op: op as u32,
                    rank,
                    kind,
                };
                let post = Post {
                    rank,
                    members,
                    nodes,
                    send_key: key(KeyKind::Send),
                    recv_key: key(KeyKind::Recv),
                    len,
                    design,
                    shared_key: (design == Design::Hier).then(|| key(KeyKind::Shared)),
                    shared_at: region_at(sp),
                };
                if let Err(e) = self.instance(sp, op).handle_post(now, post) {
                    return Err(self.fail(format!("op {op} rank {rank}: post rejected: {e}")));
                }
                let o = &mut self.ops[op];
                o.post_ns[r] = Some(now);
                if design == Design::Hier && o.region[sp as usize].is_none() {
                    let size = self.cfg.world_size() as u64 * len + PAD;
                    o.region[sp as usize] = Some((rank, Mem::new(size, Src::Init)));
                }
                touched.push(op);
            }
            driver::Input::Msg {
                from,
                msg: (op, msg),
            } => {
                if self.core.sps[sp as usize].known_lost.contains(&from) {
                    return Ok(());
                }
                if matches!(msg, Msg::Abort { .. } | Msg::Stopped { .. }) {
                    self.ops[op].notified.insert(sp);
                }
                if self.finished(sp, op) {
                    // The engine forgets finished instances.
                    if self.cfg.faults.inconsistent_comm > 0 {
                        if let Some(reply) = refusal(&msg, Status::RankFailed) {
                            self.after_finish_refused += 1;
                            let out = now + self.cfg.cost.msg_proc_ns;
                            let wire = msg_bytes(&reply);
                            self.core.send(op, sp, from, wire, out, (op, reply))?;
                            return Ok(());
                        }
                    }
                    self.after_finish_dropped += 1;
                    return Ok(());
                }
                deliver(self.instance(sp, op), now, (op, sp, from), msg)
                    .map_err(|e| self.fail(e))?;
                touched.push(op);
            }
            driver::Input::CopyDone { op, copy, fail } => {
                let status = if fail {
                    Status::AccessError
                } else {
                    Status::Ok
                };
                self.check_open(op, &copy, "finished")?;
                self.finish_copy(op, sp, &copy, !fail)?;
                self.core.sps[sp as usize].limiter.finished();
                self.instance(sp, op).handle_copy_done(now, copy.id, status);
                touched.push(op);
            }
            driver::Input::PeerLost { lost } => {
                self.core.sps[sp as usize].known_lost.insert(lost);
                if self.member_sps.contains(&sp) {
                    for op in 0..self.ops.len() {
                        if self.member_sps.contains(&lost) {
                            self.ops[op].notified.insert(sp);
                        }
                        if !self.finished(sp, op) {
                            self.instance(sp, op).handle_peer_lost(now, lost);
                            touched.push(op);
                        }
                    }
                }
            }
            driver::Input::Landed { op, .. } | driver::Input::Timer { op } => {
                return Err(self.core.fail(format!("op {op}: no fabric or timers here")));
            }
            driver::Input::RankLost { world } => {
                for op in 0..self.ops.len() {
                    if self.ops[op].done[world as usize].is_none() {
                        self.ops[op].notified.insert(sp);
                    }
                    if !self.finished(sp, op) {
                        self.instance(sp, op).handle_rank_lost(now, world);
                        touched.push(op);
                    }
                }
            }
        }
        self.finish_input(sp, now, touched)
    }

    crate::sim::shared::finish_input!();

    crate::sim::staged_common::staged_drain!(send: |op, msg| (op, msg), copy: |c| c);

    /// The allgather emits no moves.
    fn start_move(&mut self, _: usize, _: SpId, m: Infallible, _: Nanos) -> Result<(), SimFailure> {
        match m {}
    }

    /// Starts the copies the SP's limiter admits.
    pub(super) fn pump(&mut self, sp: SpId, at: Nanos) -> Result<(), SimFailure> {
        while let Some((op, c)) = self.core.next_copy(sp)? {
            self.check_open(op, &c, "started")?;
            if let Loc::Stage { slot, .. } = c.src {
                if !self.shadow(op, sp, slot.0)?.begin_read() {
                    return Err(self.fail(format!(
                        "op {op}: a write reads staging slot {} of SP {sp} while it is being filled",
                        slot.0
                    )));
                }
            }
            if let Loc::Stage { slot, .. } = c.dst {
                if let Err((r, w)) = self.shadow(op, sp, slot.0)?.begin_write() {
                    return Err(self.fail(format!(
                        "op {op}: a read fills staging slot {} of SP {sp} while {r} writes out of it and {w} reads into it are in flight",
                        slot.0
                    )));
                }
            }
            let node = self.core.sp_node(sp);
            let done_at = match &c.dst {
                Loc::Host { key, .. } => {
                    let to = self.core.rank_sp[key.rank as usize];
                    if self.core.sp_node(to) == node {
                        at + self.core.copy_cost(node, sp, c.len)
                    } else {
                        let start = at + self.cfg.cost.copy_fixed_inter_ns;
                        let bw = self.cfg.cost.inter_node_bytes_per_ns.max(1);
                        *self
                            .link_busy
                            .entry((node, self.core.sp_node(to)))
                            .or_default() += c.len.div_ceil(bw);
                        self.core.transfer(sp, to, c.len, start)
                    }
                }
                Loc::Stage { .. } => at + self.core.copy_cost(node, sp, c.len),
            };
            let ppm = self.cfg.faults.copy_error_ppm as u64;
            let fail = ppm > 0 && self.core.rng.chance(ppm, 1_000_000);
            if fail {
                self.ops[op].disturbed = true;
            }
            self.core.schedule(
                done_at,
                Ev::Input {
                    sp,
                    input: driver::Input::CopyDone { op, copy: c, fail },
                },
            );
        }
        Ok(())
    }
}
