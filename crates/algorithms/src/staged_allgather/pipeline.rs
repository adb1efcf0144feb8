//! Reads into the staging slots and writes out of them, in write order,
//! waiting for late keys.

use super::*;

impl<K: Clone + fmt::Debug + PartialEq> StagedAllgather<K> {
    /// Do everything that can be done now; called at the end of every
    /// input.
    pub(super) fn pump(&mut self) {
        self.settle();
        if self.view.is_some() {
            loop {
                let mut progress = self.retry_blocked();
                progress |= self.advance_all();
                progress |= self.free_slots();
                progress |= self.start_reads();
                if !progress {
                    break;
                }
            }
            for (to, ranks) in std::mem::take(&mut self.pending_written) {
                self.core.stats.written_msgs += 1;
                self.send(to, Msg::Written { ranks });
            }
            self.send_region_done();
        }
        self.notify();
        if self.core.completed < self.posted.len() {
            for i in 0..self.posted.len() {
                self.check_complete(self.posted[i]);
            }
        }
        let in_use = self.slots_in_use() as u32;
        self.core.stats.max_slots_in_use = self.core.stats.max_slots_in_use.max(in_use);
    }

    /// Issues the writes that waited for keys resolved since the last call.
    pub(super) fn retry_blocked(&mut self) -> bool {
        if self.new_ranks.is_empty() && self.new_sps.is_empty() {
            return false;
        }
        let sps = std::mem::take(&mut self.new_sps);
        let ranks = std::mem::take(&mut self.new_ranks);
        if self.core.abort.is_some() {
            return false;
        }
        let mut progress = false;
        for i in 0..self.slots.len() {
            if !matches!(self.slots[i], Slot::Full(_)) {
                continue;
            }
            let Slot::Full(mut h) = std::mem::replace(&mut self.slots[i], Slot::Free) else {
                unreachable!()
            };
            for &b in &sps {
                if h.blocked_sps.remove(&b) {
                    progress = true;
                    self.write_sp(i, &mut h, b);
                }
            }
            for &r in &ranks {
                if h.blocked_ranks.remove(&r) {
                    progress = true;
                    let b = self.sp_of(r);
                    self.emit_write(i, &mut h, b, Some(r));
                }
            }
            self.slots[i] = Slot::Full(h);
        }
        progress
    }

    pub(super) fn sp_of(&self, r: Rank) -> usize {
        let v = self.view.as_ref().unwrap();
        v.idx(v.members[r as usize]).unwrap()
    }

    /// Moves every chunk's cursor as far as the known keys allow.
    pub(super) fn advance_all(&mut self) -> bool {
        if self.core.abort.is_some() {
            return false;
        }
        let order_len = self.view.as_ref().unwrap().order.len();
        let mut progress = false;
        for i in 0..self.slots.len() {
            if !matches!(&self.slots[i], Slot::Full(h) if h.cur < order_len) {
                continue;
            }
            let Slot::Full(mut h) = std::mem::replace(&mut self.slots[i], Slot::Free) else {
                unreachable!()
            };
            while h.cur < order_len {
                let v = self.view.as_ref().unwrap();
                let ((b, r), first) = (v.order[h.cur], v.first[h.cur]);
                match self.tgts[b].mode {
                    None if first => {
                        h.blocked_sps.insert(b);
                    }
                    Some(Mode::Region) if first => self.emit_write(i, &mut h, b, None),
                    None | Some(Mode::Region | Mode::Covered) => {}
                    Some(Mode::Flat) => {
                        if self.rtgts[r as usize].key.is_some() {
                            self.emit_write(i, &mut h, b, Some(r));
                        } else {
                            h.blocked_ranks.insert(r);
                        }
                    }
                }
                h.cur += 1;
            }
            self.slots[i] = Slot::Full(h);
            progress = true;
        }
        progress
    }

    /// Writes chunk `h` (slot `i`) into SP `b`'s units, or marks them
    /// blocked (SP `b` became known after the chunk's cursor passed it).
    pub(super) fn write_sp(&mut self, i: usize, h: &mut Held, b: usize) {
        match self.tgts[b].mode {
            None => {
                h.blocked_sps.insert(b);
            }
            Some(Mode::Region) => self.emit_write(i, h, b, None),
            Some(Mode::Covered) => {}
            Some(Mode::Flat) => {
                let n = self.view.as_ref().unwrap().sp_ranks[b].len();
                for k in 0..n {
                    let r = self.view.as_ref().unwrap().sp_ranks[b][k];
                    if self.rtgts[r as usize].key.is_some() {
                        self.emit_write(i, h, b, Some(r));
                    } else {
                        h.blocked_ranks.insert(r);
                    }
                }
            }
        }
    }

    pub(super) fn emit_write(&mut self, slot: usize, h: &mut Held, b: usize, rank: Option<Rank>) {
        let v = self.view.as_ref().unwrap();
        let offset = h.block as u64 * v.len + h.chunk * self.chunk_bytes;
        let (key_rank, key, known_at) = match rank {
            Some(r) => {
                let t = &self.rtgts[r as usize];
                (r, t.key.clone().expect("known"), t.unit.epoch)
            }
            None => {
                let t = &self.tgts[b];
                let (r, k) = t.region.clone().expect("known with the mode");
                (r, k, t.unit.epoch)
            }
        };
        let sp = v.sps[b];
        if known_at > h.epoch {
            self.core.stats.writes_waited_for_key += 1;
        }
        h.writing += 1;
        self.tgts[b].unit.in_flight += 1;
        if let Some(r) = rank {
            self.rtgts[r as usize].unit.in_flight += 1;
        }
        let id = self.core.new_id();
        self.core
            .copies
            .insert(id, CopyKind::Write { slot, sp: b, rank });
        self.core.actions.push_back(Action::Copy(Copy {
            id: CopyId(id),
            rank: key_rank,
            sp,
            block: h.block,
            chunk: h.chunk,
            src: Loc::slot_start(slot),
            dst: Loc::Host { key, offset },
            len: h.len,
        }));
    }

    pub(super) fn free_slots(&mut self) -> bool {
        let aborted = self.core.abort.is_some();
        let order_len = self.view.as_ref().map_or(0, |v| v.order.len());
        let mut progress = false;
        for s in self.slots.iter_mut() {
            let Slot::Full(h) = s else { continue };
            let writes_done = h.writing == 0 || mutated(Mutation::FreeWhileWriting);
            let free = if aborted {
                h.writing == 0
            } else {
                writes_done
                    && h.cur == order_len
                    && h.blocked_sps.is_empty()
                    && h.blocked_ranks.is_empty()
            };
            if free {
                *s = Slot::Free;
                progress = true;
            }
        }
        progress
    }

    /// Reads local send blocks, chunk by chunk, into free slots.
    pub(super) fn start_reads(&mut self) -> bool {
        if self.core.abort.is_some() {
            return false;
        }
        let mut progress = false;
        while let Some(&rank) = self.read_queue.front() {
            let Some(slot) = self.slots.first_free() else {
                break;
            };
            let v = self.view.as_ref().unwrap();
            let chunk = self.core.ranks[&rank].next_read;
            let (n, len) = (v.n, v.chunk_len(self.chunk_bytes, chunk));
            let st = self.core.posted(rank, "queued at post");
            st.next_read += 1;
            st.reads_in_flight += 1;
            let key = st.send_key.clone();
            if st.next_read == n {
                self.read_queue.pop_front();
            }
            self.slots[slot] = Slot::Reading;
            let id = self.core.new_id();
            self.core.copies.insert(
                id,
                CopyKind::Read {
                    slot,
                    rank,
                    chunk,
                    len,
                },
            );
            self.core.actions.push_back(Action::Copy(Copy {
                id: CopyId(id),
                rank,
                sp: self.core.me,
                block: rank,
                chunk,
                src: Loc::Host {
                    key,
                    offset: chunk * self.chunk_bytes,
                },
                dst: Loc::slot_start(slot),
                len,
            }));
            progress = true;
        }
        progress
    }
}
