//! The checkers of copies and completions, the final checks and the report.

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
        let p = self.cfg.world_size() as u64;
        if c.block as u64 >= p || self.core.rank_sp[c.block as usize] != sp {
            return Err("a block of a rank this SP does not serve");
        }
        match (&c.src, &c.dst) {
            (Loc::Host { key, offset }, Loc::Stage { offset: 0, .. }) => {
                if key.op != op as u32
                    || key.kind != KeyKind::Send
                    || key.rank != c.block
                    || c.rank != c.block
                    || c.sp != sp
                    || *offset != c.chunk * chunk
                {
                    return Err("a read that is not of the block's own chunk");
                }
                if o.post_ns[c.block as usize].is_none() {
                    return Err("a read from a rank that has not posted");
                }
            }
            (Loc::Stage { offset: 0, .. }, Loc::Host { key, offset }) => {
                let r = key.rank as usize;
                if key.op != op as u32 || r as u64 >= p || c.rank != key.rank {
                    return Err("a write through a foreign key");
                }
                let to = self.core.rank_sp[r];
                if c.sp != to {
                    return Err("a write naming the wrong SP");
                }
                match key.kind {
                    KeyKind::Send => return Err("a write into a send buffer"),
                    KeyKind::Recv => {
                        if o.post_ns[r].is_none() {
                            return Err("a write into a rank that has not posted");
                        }
                        if !o.inconsistent && self.mode(o, to) != SimMode::Flat {
                            return Err("a write into a rank of a hierarchical SP");
                        }
                    }
                    KeyKind::Shared => {
                        let Some((first, _)) = &o.region[to as usize] else {
                            return Err("a write into the region of an SP without a post");
                        };
                        if !o.inconsistent
                            && (self.mode(o, to) != SimMode::Region || *first != key.rank)
                        {
                            return Err("a region write not through a node owner's first rank");
                        }
                    }
                }
                if !o.inconsistent && *offset != c.block as u64 * o.len + c.chunk * chunk {
                    return Err("a write at the wrong offset");
                }
            }
            _ => return Err("not host<->stage at slot offset 0"),
        }
        Ok(())
    }

    /// No copy touches the buffers of a rank that completed, nor the region
    /// of an SP one of whose ranks completed.
    pub(super) fn check_open(
        &self,
        op: usize,
        c: &Copy<SimKey>,
        when: &str,
    ) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        for loc in [&c.src, &c.dst] {
            let Loc::Host { key, .. } = loc else { continue };
            let r = key.rank as usize;
            match key.kind {
                KeyKind::Shared => {
                    let to = self.core.rank_sp[r] as usize;
                    if let Some(t) = o.sealed[to] {
                        return Err(self.fail(format!(
                            "op {op}: copy {} {when} on the region of SP {to}, whose rank completed at {t}ns",
                            c.id.0
                        )));
                    }
                }
                KeyKind::Send | KeyKind::Recv => {
                    if let Some(d) = o.done[r] {
                        let what = if key.kind == KeyKind::Send {
                            "send"
                        } else {
                            "receive"
                        };
                        return Err(self.fail(format!(
                            "op {op}: copy {} {when} on the {what} buffer of rank {r}, completed at {}ns",
                            c.id.0, d.at
                        )));
                    }
                }
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
        let src: Vec<Ext> = match &c.src {
            Loc::Host { key, offset } => {
                let end = offset + c.len;
                if end > self.ops[op].post_len[key.rank as usize] {
                    return Err(self.fail(format!("op {op}: read past the send block: {c:?}")));
                }
                vec![Ext {
                    len: c.len,
                    src: Src::Send(key.rank),
                    base: *offset,
                }]
            }
            Loc::Stage { slot, .. } => self.shadow(op, sp, slot.0)?.end_read().read(0, c.len),
        };
        let pieces = if ok {
            src
        } else {
            vec![Ext {
                len: c.len,
                src: Src::Garbage,
                base: 0,
            }]
        };
        match &c.dst {
            Loc::Stage { slot, .. } => {
                self.shadow(op, sp, slot.0)?.end_write().write(0, &pieces);
                if ok {
                    self.reads += 1;
                    self.ops[op].reads += 1;
                }
            }
            Loc::Host { key, offset } => {
                let r = key.rank as usize;
                let to = self.core.rank_sp[r];
                let inter = self.core.sp_node(to) != self.core.sp_node(sp);
                let o = &mut self.ops[op];
                let mem = match key.kind {
                    KeyKind::Recv => &mut o.recv[r],
                    KeyKind::Shared => &mut o.region[to as usize].as_mut().expect("checked").1,
                    KeyKind::Send => unreachable!("checked"),
                };
                if offset + c.len > mem.size - PAD {
                    return Err(self.fail(format!("op {op}: write past the data: {c:?}")));
                }
                mem.write(*offset, &pieces);
                if ok {
                    self.writes += 1;
                    if key.kind == KeyKind::Recv {
                        o.writes_rank[r] += 1;
                    } else {
                        o.writes_region[to as usize] += 1;
                    }
                    o.count_bytes(inter, c.len);
                }
            }
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
        let mode = self.mode(o, sp);
        let mut read_from = None;
        if from_segment {
            if !status.is_ok() || mode == SimMode::Flat {
                return Err(self.fail(format!(
                    "op {op}: rank {rank} completed from the segment ({status}, {mode:?})"
                )));
            }
            // The host copies P * len bytes out of its node owner's region in
            // its wait: the SP says where that is.
            let p = self.cfg.world_size() as u64;
            let owner = self.owners[sp as usize];
            let src = self.inst.get(&(sp, op)).and_then(|a| a.segment_source());
            match src {
                Some((s, at, total))
                    if s == owner && at == region_at(owner) && total == p * o.len => {}
                _ if o.inconsistent => {}
                _ => {
                    return Err(self.fail(format!(
                        "op {op}: rank {rank} of SP {sp} copies from {src:?}, not from its \
                         owner {owner}'s region"
                    )))
                }
            }
            let Some((_, region)) = &o.region[owner as usize] else {
                return Err(self.fail(format!("op {op}: SP {sp} completed from no region")));
            };
            let n = (p * o.post_len[r]).min(region.size - PAD);
            let data = region.read(0, n);
            self.ops[op].recv[r].write(0, &data);
            let node = self.core.sp_node(sp);
            host_at = at + self.core.copy_cost(node, sp, n);
            read_from = Some(owner);
        }
        let o = &mut self.ops[op];
        // A region is sealed once a rank copied out of it, or once a rank of
        // its owner completed (the stop handshake then covers the region).
        if mode == SimMode::Region {
            o.sealed[sp as usize].get_or_insert(at);
        }
        if let Some(owner) = read_from {
            o.sealed[owner as usize].get_or_insert(at);
        }
        Ok(host_at)
    }

    crate::sim::staged_common::staged_complete!();

    pub(super) fn final_checks(&mut self) -> Result<(), SimFailure> {
        let crashed: BTreeSet<SpId> = self.core.crashed.iter().copied().collect();
        let p = self.cfg.world_size() as u64;
        for (i, o) in self.ops.iter().enumerate() {
            for r in 0..p as usize {
                let sp = self.core.rank_sp[r];
                let b = &o.recv[r];
                if let Some(j) = b.touched_from(p * o.post_len[r]) {
                    return Err(self.fail(format!(
                        "op {i}: rank {r}: byte {j} past the data was written"
                    )));
                }
                let seg = self.mode(o, sp) != SimMode::Flat;
                let (done, clean) = ((o.done[r], o.post_ns[r]), (!o.disturbed).then_some(seg));
                let Some(d) = due_rank(&self.core, &self.inst, &crashed, (i, r), done, clean)?
                else {
                    continue;
                };
                if d.status.is_ok() {
                    // Every rank posted, all with this rank's length and
                    // comm (the injected lengths may happen to agree).
                    let len = o.post_len[r];
                    for x in 0..p as usize {
                        if o.post_ns[x].is_none()
                            || o.post_len[x] != len
                            || o.post_comm[x].is_some()
                        {
                            return Err(self.fail(format!(
                                "op {i} rank {r}: completed Ok although rank {x} did not post the same (posted {:?}, {} bytes, other comm {})",
                                o.post_ns[x],
                                o.post_len[x],
                                o.post_comm[x].is_some()
                            )));
                        }
                    }
                    if len > 0 {
                        if let Some(j) = b.wrong_block_byte(p, len) {
                            return Err(self.fail(format!(
                                "op {i} rank {r}: completed Ok but byte {j} is wrong (block {}, chunk {})",
                                j / len,
                                (j % len) / self.cfg.chunk_bytes.max(1)
                            )));
                        }
                    }
                }
            }
            if !o.disturbed {
                let want = p * o.n;
                if o.reads != want {
                    return Err(self.fail(format!("op {i}: {} chunk reads, want {want}", o.reads)));
                }
                for r in 0..p as usize {
                    let sp = self.core.rank_sp[r] as usize;
                    if self.mode(o, sp as SpId) == SimMode::Flat && o.writes_rank[r] != want {
                        return Err(self.fail(format!(
                            "op {i}: {} chunk writes into rank {r}, want {want}",
                            o.writes_rank[r]
                        )));
                    }
                }
                for &sp in &self.member_sps {
                    let got = o.writes_region[sp as usize];
                    let exp = if self.mode(o, sp) == SimMode::Region {
                        want
                    } else {
                        0
                    };
                    if got != exp {
                        return Err(self.fail(format!(
                            "op {i}: {got} chunk writes into the region of SP {sp}, want {exp}"
                        )));
                    }
                }
                let exp = self.expected_inter(o);
                if o.bytes_inter != exp {
                    return Err(self.fail(format!(
                        "op {i}: {} bytes crossed nodes, want {exp}",
                        o.bytes_inter
                    )));
                }
                let covered = self
                    .member_sps
                    .iter()
                    .filter(|&&sp| self.mode(o, sp) == SimMode::Covered)
                    .count() as u64;
                let done: u64 = self
                    .member_sps
                    .iter()
                    .filter_map(|&sp| self.inst.get(&(sp, i)))
                    .map(|a| a.stats().regions_shared)
                    .sum();
                if done != covered {
                    return Err(self.fail(format!(
                        "op {i}: {done} RegionDone sent, want {covered} (covered SPs)"
                    )));
                }
            }
        }
        check_instances_at_end(&self.core, &self.inst, &crashed, self.cfg.staging_slots)
    }

    /// How SP `sp` receives in `o` (on the world communicator): a node
    /// owner by its own design, another SP flat if it or its owner is.
    pub(super) fn mode(&self, o: &Op, sp: SpId) -> SimMode {
        let owner = self.owners[sp as usize];
        match (o.design[sp as usize], o.design[owner as usize]) {
            (Design::Flat, _) => SimMode::Flat,
            (Design::Hier, _) if owner == sp => SimMode::Region,
            (Design::Hier, Design::Hier) => SimMode::Covered,
            (Design::Hier, Design::Flat) => SimMode::Flat,
        }
    }

    /// Bytes a fault-free collective writes across nodes: every block into
    /// every rank of a flat SP, once into the region of a hierarchical one,
    /// on other nodes.
    pub(super) fn expected_inter(&self, o: &Op) -> u64 {
        let mut per_node_units: BTreeMap<u32, u64> = BTreeMap::new();
        for &sp in &self.member_sps {
            let node = self.core.sp_node(sp);
            let units = match self.mode(o, sp) {
                SimMode::Region => 1,
                SimMode::Covered => 0,
                SimMode::Flat => self.core.rank_sp.iter().filter(|&&s| s == sp).count() as u64,
            };
            *per_node_units.entry(node).or_default() += units;
        }
        let total: u64 = per_node_units.values().sum();
        self.core
            .rank_node
            .iter()
            .map(|n| o.len * (total - per_node_units[n]))
            .sum()
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
            reads: self.reads,
            writes: self.writes,
            bytes_inter_node: self.ops.iter().map(|o| o.bytes_inter).sum(),
            bytes_intra_node: self.ops.iter().map(|o| o.bytes_intra).sum(),
            expected_inter_node_bytes: self.ops.iter().map(|o| self.expected_inter(o)).sum(),
            max_link_busy_ns: self.link_busy.values().copied().max().unwrap_or(0),
            stats,
            after_finish_dropped: self.after_finish_dropped,
            after_finish_refused: self.after_finish_refused,
        }
    }
}

/// Size of a message's fields on the wire (a key counts 16 bytes).
pub(super) fn msg_bytes(msg: &Msg<SimKey>) -> u64 {
    match msg {
        Msg::Key { .. } | Msg::Region { .. } => 4 + 8 + 8 + 16,
        Msg::Written { ranks } => 4 * ranks.len() as u64,
        Msg::WrittenRegion | Msg::Abort { .. } | Msg::Stopped { .. } => 1,
        Msg::Covered { .. } | Msg::Waiting { .. } => 16,
        Msg::RegionDone { .. } => 8,
    }
}
