//! Reads, moves and writes of chunks through the staging slots; abort and
//! completion.

use super::*;

impl<K: Clone + fmt::Debug + PartialEq> Bcast<K> {
    pub(super) fn copy_finished(&mut self, id: u64, status: Status) {
        let Some((kind, ok)) = self.take_copy(id, status) else {
            return;
        };
        match kind {
            CopyKind::Read { slot, index, len } => {
                let root = self.view.as_ref().unwrap().root;
                if let Some(st) = self.core.ranks.get_mut(&root) {
                    st.reads -= 1;
                    st.out.set_error(status);
                }
                if ok {
                    self.reads_done += 1;
                    self.core.stats.bytes_staged += len;
                    self.slots[slot] = Slot::Full(Held::new(index, len));
                    self.by_index.insert(index, slot);
                } else {
                    self.slots[slot] = Slot::Free;
                }
            }
            CopyKind::Write { slot, index, rank } => {
                let st = self.core.posted(rank, "write into a posted rank");
                st.writes -= 1;
                st.out.set_error(status);
                if ok {
                    st.written += 1;
                }
                match &mut self.slots[slot] {
                    Slot::Full(h) if h.index == index => {
                        h.writing.remove(&rank);
                        if ok {
                            h.done.insert(rank);
                        }
                    }
                    _ => debug_assert!(false, "write from a slot that changed"),
                }
            }
        }
    }

    pub(super) fn move_finished(&mut self, id: u64, status: Status) {
        let Some(m) = take_finished(&mut self.moves, id, &mut self.core.stats.unknown_done) else {
            return;
        };
        if !status.is_ok() {
            self.enter_abort(status);
            // The bytes did not land and no chunk follows: give the slot
            // back so the peer can finish.
            self.send(m.to, Msg::Return { slots: vec![m.dst] });
        }
        if let Slot::Full(h) = &mut self.slots[m.slot] {
            if h.index == m.index {
                h.moving.remove(&m.to);
                if status.is_ok() {
                    h.forwarded.insert(m.to);
                }
            }
        }
        if status.is_ok() {
            self.core.stats.chunks_forwarded += 1;
        }
    }

    pub(super) fn enter_abort(&mut self, status: Status) {
        let (first, status) = self.core.abort.enter(status);
        fail_pending(self.core.ranks.values_mut().map(|st| &mut st.out), status);
        if first {
            let held: Vec<(SpId, Vec<SlotId>)> = self
                .grants
                .iter_mut()
                .filter(|(_, g)| !g.is_empty())
                .map(|(&c, g)| (c, g.drain(..).collect()))
                .collect();
            for (child, slots) in held {
                self.send(child, Msg::Return { slots });
            }
            for c in std::mem::take(&mut self.early_credits) {
                self.on_credit(c);
            }
        }
        self.maybe_broadcast_abort();
    }

    pub(super) fn maybe_broadcast_abort(&mut self) {
        if !self.core.abort.start_broadcast(self.view.is_some()) {
            return;
        }
        let tree = self.view.as_ref().unwrap().tree.clone();
        for sp in tree.iter().flatten().copied() {
            self.notify_abort(sp);
        }
    }

    crate::common::notify_abort!();

    /// Do everything that can be done now; called at the end of every
    /// input.
    pub(super) fn pump(&mut self) {
        loop {
            let mut progress = false;
            while let Some(id) = self.zero_copies.pop_front() {
                self.copy_finished(id, Status::Ok);
                progress = true;
            }
            while let Some(id) = self.zero_moves.pop_front() {
                self.move_finished(id, Status::Ok);
                progress = true;
            }
            progress |= self.free_slots();
            progress |= self.start_reads();
            progress |= self.forward();
            progress |= self.write_targets();
            if !progress {
                break;
            }
        }
        self.seal();
        self.grant();
        // In rank order, without collecting the ranks (this runs after every input).
        let mut next = self.core.ranks.keys().next().copied();
        while let Some(r) = next {
            self.check_complete(r);
            next = self
                .core
                .ranks
                .range((std::ops::Bound::Excluded(r), std::ops::Bound::Unbounded))
                .next()
                .map(|(&r, _)| r);
        }
        let in_use = self.slots_in_use() as u32;
        self.core.stats.max_slots_in_use = self.core.stats.max_slots_in_use.max(in_use);
    }

    pub(super) fn free_slots(&mut self) -> bool {
        let aborted = self.core.abort.is_some();
        let children = self.receivers();
        let mut progress = false;
        for i in 0..self.slots.len() {
            let Slot::Full(h) = &self.slots[i] else {
                continue;
            };
            let free = if aborted {
                h.moving.is_empty() && h.writing.is_empty()
            } else {
                let forwarded = if mutated(Mutation::FreeWhileMoving) {
                    children
                        .iter()
                        .all(|c| h.forwarded.contains(c) || h.moving.contains(c))
                } else {
                    h.moving.is_empty() && children.iter().all(|c| h.forwarded.contains(c))
                };
                h.writing.is_empty()
                    && forwarded
                    && self
                        .targets
                        .as_ref()
                        .is_some_and(|t| t.iter().all(|r| h.done.contains(r)))
            };
            if free {
                self.by_index.remove(&h.index);
                self.slots[i] = Slot::Free;
                progress = true;
            }
        }
        progress
    }

    pub(super) fn free_slot(&self) -> Option<usize> {
        self.slots.first_free()
    }

    /// The root's SP reads chunks from the root's buffer into free slots.
    pub(super) fn start_reads(&mut self) -> bool {
        let Some(v) = &self.view else { return false };
        if self.core.abort.is_some() || !v.is_top() {
            return false;
        }
        let (root, n) = (v.root, v.n);
        let Some(st) = self.core.ranks.get(&root) else {
            return false;
        };
        if st.out.completed {
            return false;
        }
        let key = st.key.clone();
        let mut progress = false;
        while self.next_read < n {
            let Some(slot) = self.free_slot() else { break };
            let v = self.view.as_ref().unwrap();
            let (index, offset, len) = (
                self.next_read,
                v.offset(self.next_read),
                v.chunk_len(self.next_read),
            );
            self.next_read += 1;
            self.slots[slot] = Slot::Reading;
            self.core.ranks.get_mut(&root).unwrap().reads += 1;
            let src = Loc::Host {
                key: key.clone(),
                offset,
            };
            let read = CopyKind::Read { slot, index, len };
            self.start_copy(read, root, index, (src, Loc::slot_start(slot)), len);
            progress = true;
        }
        progress
    }

    /// Move chunks, to each child in index order, into the slots it
    /// granted.
    pub(super) fn forward(&mut self) -> bool {
        let Some(v) = &self.view else { return false };
        if self.core.abort.is_some() {
            return false;
        }
        let n = v.n;
        let mut progress = false;
        for to in self.receivers() {
            loop {
                let next = self.next_fwd[&to];
                if next >= n || self.grants[&to].is_empty() {
                    break;
                }
                let Some(&slot) = self.by_index.get(&next) else {
                    break;
                };
                let Slot::Full(h) = &mut self.slots[slot] else {
                    unreachable!("by_index names a full slot")
                };
                debug_assert!(!h.moving.contains(&to) && !h.forwarded.contains(&to));
                h.moving.insert(to);
                let (index, len) = (h.index, h.len);
                let dst = self.grants.get_mut(&to).unwrap().pop_front().unwrap();
                self.next_fwd.insert(to, next + 1);
                let id = self.core.new_id();
                self.moves.insert(
                    id,
                    MoveSt {
                        slot,
                        index,
                        to,
                        dst,
                    },
                );
                let mv = Move {
                    id: MoveId(id),
                    to,
                    chunk: index,
                    src_slot: SlotId(slot as u32),
                    dst_slot: dst,
                    len,
                };
                if len == 0 {
                    self.send(to, mv.chunk_msg());
                    self.zero_moves.push_back(id);
                } else {
                    self.core.actions.push_back(Action::Move(mv));
                }
                progress = true;
            }
        }
        progress
    }

    /// Write staged chunks into the targets that have posted.
    pub(super) fn write_targets(&mut self) -> bool {
        if self.core.abort.is_some() {
            return false;
        }
        let (Some(targets), Some(v), Some(t)) = (&self.targets, &self.view, &self.topo) else {
            return false;
        };
        let hier = t.design == Design::Hier && v.at == 0;
        let mut todo = Vec::new();
        for (&index, &slot) in &self.by_index {
            let Slot::Full(h) = &self.slots[slot] else {
                continue;
            };
            for &r in targets {
                let Some(st) = self.core.ranks.get(&r) else {
                    continue;
                };
                if st.out.completed || h.done.contains(&r) || h.writing.contains(&r) {
                    continue;
                }
                if mutated(Mutation::SkipStagedForLateRank) && index < st.staged_at_post {
                    continue;
                }
                let key = if hier {
                    st.shared_key.clone().expect("checked at post")
                } else {
                    st.key.clone()
                };
                todo.push((slot, index, r, key, v.offset(index), h.len));
            }
        }
        let progress = !todo.is_empty();
        for (slot, index, rank, key, offset, len) in todo {
            let Slot::Full(h) = &mut self.slots[slot] else {
                unreachable!()
            };
            h.writing.insert(rank);
            self.core.ranks.get_mut(&rank).unwrap().writes += 1;
            let write = CopyKind::Write { slot, index, rank };
            let dst = Loc::Host { key, offset };
            self.start_copy(write, rank, index, (Loc::slot_start(slot), dst), len);
        }
        progress
    }

    /// Records copy `kind` under a new id and emits it: chunk `chunk` of
    /// `len` bytes between `rank`'s grant and a slot, `(src, dst)`. A
    /// zero-length copy is not emitted; it completes by itself
    /// (`zero_copies`).
    fn start_copy(
        &mut self,
        kind: CopyKind,
        rank: Rank,
        chunk: u64,
        (src, dst): (Loc<K>, Loc<K>),
        len: u64,
    ) {
        let id = self.core.new_id();
        self.core.copies.insert(id, kind);
        if len == 0 {
            self.zero_copies.push_back(id);
        } else {
            self.core.actions.push_back(Action::Copy(Copy {
                id: CopyId(id),
                rank,
                chunk,
                src,
                dst,
                len,
            }));
        }
    }

    /// Grant free slots to the parent, never more than the chunks still
    /// expected.
    pub(super) fn grant(&mut self) {
        let Some(v) = &self.view else { return };
        let Some(parent) = v.parent() else { return };
        if self.core.abort.is_some()
            || self.core.lost_sps.contains(&parent)
            || self.sealed.is_some()
        {
            return;
        }
        let (root, len, chunk_bytes, n) = (v.root, v.len, v.chunk_bytes, v.n);
        let arrived = self.recv_low + self.recv_above.len() as u64;
        let granted = self
            .slots
            .iter()
            .filter(|s| matches!(s, Slot::Granted(_)))
            .count() as u64;
        let mut want = n.saturating_sub(arrived + granted);
        let mut slots = Vec::new();
        for (i, s) in self.slots.iter_mut().enumerate() {
            if want == 0 {
                break;
            }
            if matches!(s, Slot::Free) {
                *s = Slot::Granted(parent);
                slots.push(SlotId(i as u32));
                want -= 1;
            }
        }
        if !slots.is_empty() {
            self.send(
                parent,
                Msg::Credit {
                    root,
                    len,
                    chunk_bytes,
                    slots,
                },
            );
        }
    }

    pub(super) fn check_complete(&mut self, rank: Rank) {
        let aborted = self.core.abort.is_some();
        let st = &self.core.ranks[&rank];
        let reads = st.reads > 0 && !mutated(Mutation::RootCompletesBeforeReads);
        if st.out.completed || st.writes > 0 || reads {
            return;
        }
        let (done, from_segment) = if aborted {
            (true, false)
        } else {
            let (Some(v), Some(t)) = (&self.view, &self.topo) else {
                return;
            };
            let writer = self.targets.as_ref().and_then(|t| t.first());
            let region_full = writer
                .and_then(|w| self.core.ranks.get(w))
                .is_some_and(|w| w.written == v.n);
            let leader_hier = t.design == Design::Hier && v.at == 0;
            if rank == v.root {
                let reads = if mutated(Mutation::RootCompletesBeforeReads) {
                    self.next_read
                } else {
                    self.reads_done
                };
                // The root as the writer stays until its grant was last used.
                let writes = !leader_hier || writer != Some(&rank) || region_full;
                (reads == v.n && writes, false)
            } else if leader_hier {
                (region_full, true)
            } else if self.sealed.is_some() {
                (true, true)
            } else {
                // Flat, or a node's other SP fed chunks by a flat leader.
                let need = if mutated(Mutation::CompleteOneChunkEarly) && v.n > 1 {
                    v.n - 1
                } else {
                    v.n
                };
                (st.written >= need, false)
            }
        };
        if !done {
            return;
        }
        self.complete_rank(rank, aborted, from_segment);
    }
}
