//! The checkers of copies, moves and completions, the final checks and the
//! report.

use super::*;
use crate::sim::staged_common::{check_instances_at_end, completion_summary, due_rank};

impl<'a> Sim<'a> {
    /// Where a copy the SP emits reads and writes (its shape as a chunk is
    /// checked already, `chunk` the chunk size): `Err` what is wrong.
    pub(super) fn copy_places(
        &self,
        op: usize,
        sp: SpId,
        c: &Copy<SimKey>,
        chunk: u64,
    ) -> Result<(), &'static str> {
        let o = &self.ops[op];
        if c.rank as usize >= o.buf.len() || self.core.rank_sp[c.rank as usize] != sp {
            return Err("a rank this SP does not serve");
        }
        let (host, stage_is_dst) = match (&c.src, &c.dst) {
            (Loc::Host { key, offset }, Loc::Stage { offset: 0, .. }) => ((key, offset), true),
            (Loc::Stage { offset: 0, .. }, Loc::Host { key, offset }) => ((key, offset), false),
            _ => return Err("not host<->stage at slot offset 0"),
        };
        let (key, &offset) = host;
        if key.op != op as u32 || key.rank != c.rank || offset != c.chunk * chunk {
            return Err("wrong key or offset");
        }
        if stage_is_dst {
            // A read: only from a rank that named itself root.
            if key.shared || o.post_root[c.rank as usize] != c.rank {
                return Err("read from a rank that is not the root");
            }
        } else {
            if o.post_root[c.rank as usize] == c.rank && !key.shared {
                return Err("write into the root's buffer");
            }
            if key.shared != (self.cfg.design == Design::Hier) {
                return Err("write into the wrong kind of buffer");
            }
            if key.shared && !o.inconsistent {
                let group = o.tree.iter().find(|g| g.contains(&sp));
                if group.is_none_or(|g| g[0] != sp) {
                    return Err("segment write by an SP that is not its node's leader");
                }
                let siblings = group.is_some_and(|g| g.len() > 1);
                let local = &self.local[&sp];
                let writer = local
                    .iter()
                    .copied()
                    .find(|&r| r != o.root)
                    .or((siblings && local.contains(&o.root)).then_some(o.root));
                if writer != Some(c.rank) {
                    return Err("segment write through another rank than the writer");
                }
            }
        }
        Ok(())
    }

    /// No copy touches a buffer whose rank completed, nor a segment after
    /// a `from_segment` completion.
    pub(super) fn check_open(
        &self,
        op: usize,
        sp: SpId,
        c: &Copy<SimKey>,
        when: &str,
    ) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        for loc in [&c.src, &c.dst] {
            let Loc::Host { key, .. } = loc else { continue };
            if key.shared {
                if let Some(t) = o.seg_sealed[sp as usize] {
                    return Err(self.fail(format!(
                        "op {op}: copy {} {when} on the segment of SP {sp}, read by a host since {t}ns",
                        c.id.0
                    )));
                }
            } else if let Some(d) = o.done[key.rank as usize] {
                return Err(self.fail(format!(
                    "op {op}: copy {} {when} on the buffer of rank {}, completed at {}ns",
                    c.id.0, key.rank, d.at
                )));
            }
        }
        Ok(())
    }

    pub(super) fn finish_copy(
        &mut self,
        op: usize,
        sp: SpId,
        c: &Copy<SimKey>,
        ok: bool,
    ) -> Result<(), SimFailure> {
        let len = c.len as usize;
        let src: Vec<u8> = match &c.src {
            Loc::Host { key, offset } => {
                let b = &self.ops[op].buf[key.rank as usize];
                let end = *offset as usize + len;
                if end > self.ops[op].post_len[key.rank as usize] as usize {
                    return Err(self.fail(format!("op {op}: read past the posted length: {c:?}")));
                }
                b[*offset as usize..end].to_vec()
            }
            Loc::Stage { slot, .. } => self.shadow(op, sp, slot.0)?.end_read()[..len].to_vec(),
        };
        match &c.dst {
            Loc::Stage { slot, .. } => {
                let data = self.shadow(op, sp, slot.0)?.end_write();
                if ok {
                    data[..len].copy_from_slice(&src);
                }
            }
            Loc::Host { key, offset } => {
                let o = &mut self.ops[op];
                let (at, end) = (*offset as usize, *offset as usize + len);
                // A region holds the message as its SP sees it: with
                // inconsistent posts, the writer's post may be longer (its
                // driver sized the region from it).
                let limit = match (key.shared, o.inconsistent) {
                    (true, false) => o.len,
                    (true, true) => o.len.max(o.post_len[key.rank as usize]),
                    (false, _) => o.post_len[key.rank as usize],
                } as usize;
                if end > limit {
                    return Err(self.fail(format!("op {op}: write past the message: {c:?}")));
                }
                if ok {
                    if key.shared {
                        o.seg[sp as usize][at..end].copy_from_slice(&src);
                        o.seg_writes[sp as usize] += 1;
                    } else {
                        o.buf[key.rank as usize][at..end].copy_from_slice(&src);
                        o.buf_writes[key.rank as usize] += 1;
                    }
                }
            }
        }
        if ok {
            self.core.copies += 1;
            self.bytes_copied += c.len;
        }
        Ok(())
    }

    pub(super) fn final_checks(&mut self) -> Result<(), SimFailure> {
        let crashed: BTreeSet<SpId> = self.core.crashed.iter().copied().collect();
        for (i, o) in self.ops.iter().enumerate() {
            let want = o.len as usize;
            for r in 0..o.buf.len() {
                let b = &o.buf[r];
                let plen = o.post_len[r] as usize;
                if let Some(j) = (plen..b.len()).find(|&j| b[j] != sentinel(j)) {
                    return Err(self.fail(format!(
                        "op {i}: rank {r}: byte {j} past the message was written"
                    )));
                }
                if r == o.root as usize && b[..want] != o.data[..] {
                    return Err(self.fail(format!("op {i}: the root's buffer changed")));
                }
                let seg = self.cfg.design == Design::Hier && r != o.root as usize;
                let (done, clean) = ((o.done[r], o.post_ns[r]), (!o.disturbed).then_some(seg));
                let Some(d) = due_rank(&self.core, &self.inst, &crashed, (i, r), done, clean)?
                else {
                    continue;
                };
                if d.status.is_ok() {
                    // Ok: the rank's post agrees with that of the rank it
                    // names as root, which names itself, and it holds that
                    // root's bytes (normally the real root; a rank that
                    // wrongly names itself root may complete Ok once its
                    // own buffer was read, as any root).
                    let x = o.post_root[r] as usize;
                    if o.post_root[x] as usize != x || o.post_len[x] != o.post_len[r] {
                        return Err(self.fail(format!(
                            "op {i} rank {r}: completed Ok with an inconsistent post (root {x}, {} bytes)",
                            o.post_len[r]
                        )));
                    }
                    let (src, n) = (&o.buf[x], plen);
                    if b[..n] != src[..n] {
                        let j = (0..n).find(|&j| b[j] != src[j]).unwrap();
                        return Err(self.fail(format!(
                            "op {i} rank {r}: completed Ok but byte {j} of {n} is wrong (chunk {})",
                            j as u64 / self.cfg.chunk_bytes.max(1)
                        )));
                    }
                }
            }
            if !o.disturbed {
                let nodes: BTreeSet<u32> = self.core.rank_node.iter().copied().collect();
                let min = o.len * (nodes.len() as u64 - 1);
                if o.bytes_inter != min {
                    return Err(self.fail(format!(
                        "op {i}: {} bytes crossed nodes, want {min}",
                        o.bytes_inter
                    )));
                }
                let hops = match self.cfg.design {
                    Design::Flat => o.tree.iter().map(Vec::len).sum::<usize>() as u64 - 1,
                    Design::Hier => o.tree.len() as u64 - 1,
                };
                let moves = if o.len == 0 { 0 } else { o.n * hops };
                if o.moves != moves {
                    return Err(self.fail(format!("op {i}: {} moves, want {moves}", o.moves)));
                }
                let per_target = if o.len == 0 { 0 } else { o.n };
                for (sp, ranks) in &self.local {
                    let targets: Vec<Rank> =
                        ranks.iter().copied().filter(|&r| r != o.root).collect();
                    let group = o.tree.iter().find(|g| g.contains(sp)).expect("in the tree");
                    let writes = group[0] == *sp && (!targets.is_empty() || group.len() > 1);
                    let got: Vec<u64> = match self.cfg.design {
                        Design::Flat => targets.iter().map(|&r| o.buf_writes[r as usize]).collect(),
                        Design::Hier if writes => vec![o.seg_writes[*sp as usize]],
                        Design::Hier => {
                            // Not written, and none of its ranks' buffers.
                            if o.seg_writes[*sp as usize] > 0
                                || targets.iter().any(|&r| o.buf_writes[r as usize] > 0)
                            {
                                return Err(self.fail(format!(
                                    "op {i}: SP {sp} is not its node's writer but wrote"
                                )));
                            }
                            vec![]
                        }
                    };
                    if got.iter().any(|&g| g != per_target) {
                        return Err(self.fail(format!(
                            "op {i}: SP {sp} wrote chunks {got:?} times, want {per_target} each"
                        )));
                    }
                }
            }
        }
        if self.cfg.design == Design::Hier {
            for (i, o) in self.ops.iter().enumerate().filter(|(_, o)| !o.disturbed) {
                let sealed: u64 = (0..self.cfg.sp_count())
                    .filter_map(|sp| self.inst.get(&(sp, i)))
                    .map(|a| a.stats().regions_shared)
                    .sum();
                let want = o.tree.iter().map(|g| g.len() as u64 - 1).sum::<u64>();
                if sealed != want {
                    return Err(self.fail(format!(
                        "op {i}: {sealed} regions sealed for other SPs, want {want}"
                    )));
                }
            }
        }
        check_instances_at_end(&self.core, &self.inst, &crashed, self.cfg.staging_slots)
    }

    pub(super) fn report(&self) -> SimReport {
        let mut stats = Stats::default();
        for a in self.inst.values() {
            stats.absorb(&a.stats());
        }
        let done = self.ops.iter().flat_map(|o| o.done.iter()).flatten();
        let (end_ns, sp_end_ns, error_completions) = completion_summary(done);
        SimReport {
            outcome: self.core.outcome(error_completions),
            end_ns,
            sp_end_ns,
            moves: self.ops.iter().map(|o| o.moves).sum(),
            copies: self.core.copies,
            bytes_moved_inter_node: self.ops.iter().map(|o| o.bytes_inter).sum(),
            bytes_moved_intra_node: self.ops.iter().map(|o| o.bytes_intra).sum(),
            min_inter_node_bytes: {
                let nodes: BTreeSet<u32> = self.core.rank_node.iter().copied().collect();
                self.ops
                    .iter()
                    .map(|o| o.len * (nodes.len() as u64 - 1))
                    .sum()
            },
            bytes_copied: self.bytes_copied,
            stats,
        }
    }
}

/// Size of a message's fields on the wire.
pub(super) fn msg_bytes(msg: &Msg) -> u64 {
    match msg {
        Msg::Open { tree, .. } => {
            4 + 8 + 8 + 4 * tree.iter().map(|g| 1 + g.len() as u64).sum::<u64>()
        }
        Msg::Credit { slots, .. } => 4 + 8 + 8 + 4 * slots.len() as u64,
        Msg::Chunk { .. } => 8 + 4 + 8,
        Msg::Return { slots } => 4 * slots.len() as u64,
        Msg::Abort { .. } => 1,
        Msg::Sealed { .. } => 8,
    }
}

/// Where the driver of SP `sp` places its hierarchical region in its node
/// segment (any value works; distinct ones let the checker see that ranks
/// copy from the place their leader named).
pub(super) fn region_at(sp: SpId) -> u64 {
    4096 * (u64::from(sp) + 1)
}
