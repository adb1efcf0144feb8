//! Finished copies, segments and their distribution to local ranks, the
//! abort and the completion of local ranks.

use super::*;

impl<K: Clone + fmt::Debug + PartialEq> Allgatherv<K> {
    pub(super) fn handle_copy_done_internal(&mut self, id: u64) {
        let now = self.core.now;
        self.handle_copy_done(now, CopyId(id), Status::Ok);
    }

    /// Publish the landed segment `src` (in `holder`'s receive buffer) to
    /// every SP of this node.
    pub(super) fn publish_landed(&mut self, src: Rank, holder: Rank, len: u64) {
        let st = &self.core.ranks[&holder];
        self.publish(Segment {
            src,
            holder,
            holder_sp: self.core.me,
            key: st.buf.key.clone(),
            offset: st.buf.displs[src as usize],
            len,
            from_send: false,
        });
    }

    /// Publish `seg` (its holder is local) to every SP of this node, each
    /// of which answers with `SegmentDone`.
    pub(super) fn publish(&mut self, seg: Segment<K>) {
        // A handle on the shared topology, not a copy of its SPs.
        let topo = self.topo.clone().unwrap();
        let my_sps = topo.my_sps();
        self.core.ranks.get_mut(&seg.holder).unwrap().readers += my_sps.len();
        self.held
            .insert(seg.src, (seg.holder, my_sps.iter().copied().collect()));
        for &sp in my_sps {
            self.send(sp, Msg::Segment(seg.clone()));
        }
    }

    /// Copy segment `s` into local rank `r` if it needs it.
    pub(super) fn dist_one(&mut self, s: Rank, r: Rank) {
        if self.core.abort.is_some() {
            return;
        }
        let Some(e) = self.segs.get(&s) else { return };
        if r == e.seg.holder && !e.seg.from_send {
            return;
        }
        let Some(st) = self.core.ranks.get(&r) else {
            return;
        };
        let i = s as usize;
        if st.out.completed || st.have[i] != Have::Missing {
            return;
        }
        if st.buf.counts[i] != e.seg.len {
            self.enter_abort(Status::CountMismatch);
            return;
        }
        self.segs.get_mut(&s).unwrap().copying += 1;
        self.start_copy(CopyKind::Dist { seg: s, dst: r });
    }

    /// Starts the copy `kind` of a segment into a local rank's receive
    /// buffer; a zero-length one is done at once.
    pub(super) fn start_copy(&mut self, kind: CopyKind<K>) {
        let (seg, dst, src_rank, src_key, src_offset, len) = match &kind {
            CopyKind::Land { ann, holder } => (
                ann.src,
                *holder,
                ann.src,
                ann.key.clone(),
                ann.offset,
                ann.len,
            ),
            CopyKind::Dist { seg, dst } => {
                let e = &self.segs[seg].seg;
                (*seg, *dst, e.holder, e.key.clone(), e.offset, e.len)
            }
        };
        let id = self.core.new_id();
        let st = self.core.posted(dst, "copies go to posted ranks");
        st.have[seg as usize] = Have::Copying;
        st.buf.writes += 1;
        let copy = Copy {
            id: CopyId(id),
            seg,
            src_rank,
            src_key,
            src_offset,
            dst_rank: dst,
            dst_key: st.buf.key.clone(),
            dst_offset: st.buf.displs[seg as usize],
            len,
        };
        self.core.copies.insert(id, kind);
        if len == 0 {
            self.handle_copy_done_internal(id);
        } else {
            self.core.actions.push_back(Action::Copy(copy));
        }
    }

    /// Send `SegmentDone` for `s` once no local rank will read it any more.
    pub(super) fn check_seg(&mut self, s: Rank) {
        let Some(e) = self.segs.get(&s) else { return };
        if e.done_sent || e.copying > 0 {
            return;
        }
        if self.core.abort.is_none() {
            let Some(t) = &self.topo else { return };
            for &r in &t.local {
                if r == e.seg.holder && !e.seg.from_send {
                    continue;
                }
                match self.core.ranks.get(&r) {
                    Some(st) if st.have[s as usize] == Have::Done => {}
                    _ => return,
                }
            }
        }
        let e = self.segs.get_mut(&s).unwrap();
        e.done_sent = true;
        let to = e.seg.holder_sp;
        let status = self.core.abort.status.unwrap_or(Status::Ok);
        self.send(to, Msg::SegmentDone { src: s, status });
    }

    /// Aborts with `status` (`Ok`: `Aborted`); every abort is broadcast
    /// again from here (see the module docs).
    pub(super) fn enter_abort(&mut self, status: Status) {
        let (_, status) = self.core.abort.enter(status);
        self.abort_local = true;
        fail_pending(self.core.ranks.values_mut().map(|st| &mut st.out), status);
        let blind = self.topo.is_none();
        for (ann, since) in std::mem::take(&mut self.parked) {
            self.core.stats.parked_wait_ns += self.core.now.saturating_sub(since);
            self.ack(&ann, status);
            if blind {
                self.notify_abort(ann.origin);
            }
        }
        let segs: Vec<Rank> = self.segs.keys().copied().collect();
        for s in segs {
            if blind {
                let sp = self.segs[&s].seg.holder_sp;
                self.notify_abort(sp);
            }
            self.check_seg(s);
        }
        self.finish_abort();
    }

    crate::common::v_abort_broadcast!(|s| s.topo.as_ref().map(|t| &t.members));

    crate::common::notify_abort!();

    crate::common::v_check_complete!(|st| st.buf.writes > 0 || st.readers > 0);
}
