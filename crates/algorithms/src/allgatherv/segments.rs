//! Finished copies, segments and their distribution to local ranks, the
//! abort and the completion of local ranks.

use super::*;

impl<K: Clone + fmt::Debug + PartialEq> Allgatherv<K> {
    pub(super) fn handle_copy_done_internal(&mut self, id: u64) {
        let now = self.now;
        self.handle_copy_done(now, CopyId(id), Status::Ok);
    }

    /// Publish the landed segment `src` (in `holder`'s receive buffer) to
    /// every SP of this node.
    pub(super) fn publish(&mut self, src: Rank, holder: Rank, len: u64) {
        let my_sps = self.topo.as_ref().unwrap().my_sps().to_vec();
        let st = &self.ranks[&holder];
        let (key, offset) = (st.recv_key.clone(), st.recv_displs[src as usize]);
        self.ranks.get_mut(&holder).unwrap().readers += my_sps.len();
        self.held
            .insert(src, (holder, my_sps.iter().copied().collect()));
        for sp in my_sps {
            self.send(
                sp,
                Msg::Segment {
                    src,
                    holder,
                    holder_sp: self.me,
                    key: key.clone(),
                    offset,
                    len,
                    from_send: false,
                },
            );
        }
    }

    /// Copy segment `s` into local rank `r` if it needs it.
    pub(super) fn dist_one(&mut self, s: Rank, r: Rank) {
        if self.abort.is_some() {
            return;
        }
        let Some(e) = self.segs.get(&s) else { return };
        if r == e.holder && !e.from_send {
            return;
        }
        let Some(st) = self.ranks.get_mut(&r) else {
            return;
        };
        let i = s as usize;
        if st.out.completed || st.have[i] != Have::Missing {
            return;
        }
        if st.recv_counts[i] != e.len {
            self.enter_abort(Status::CountMismatch, true);
            return;
        }
        let id = self.next_copy;
        self.next_copy += 1;
        st.have[i] = Have::Copying;
        st.writes += 1;
        let copy = Copy {
            id: CopyId(id),
            seg: s,
            src_rank: e.holder,
            src_key: e.key.clone(),
            src_offset: e.offset,
            dst_rank: r,
            dst_key: st.recv_key.clone(),
            dst_offset: st.recv_displs[i],
            len: e.len,
        };
        let zero = e.len == 0;
        self.segs.get_mut(&s).unwrap().copying += 1;
        self.copies.insert(id, CopyKind::Dist { seg: s, dst: r });
        if zero {
            self.handle_copy_done_internal(id);
        } else {
            self.actions.push_back(Action::Copy(copy));
        }
    }

    /// Send `SegmentDone` for `s` once no local rank will read it any more.
    pub(super) fn check_seg(&mut self, s: Rank) {
        let Some(e) = self.segs.get(&s) else { return };
        if e.done_sent || e.copying > 0 {
            return;
        }
        if self.abort.is_none() {
            let Some(t) = &self.topo else { return };
            for &r in &t.local {
                if r == e.holder && !e.from_send {
                    continue;
                }
                match self.ranks.get(&r) {
                    Some(st) if st.have[s as usize] == Have::Done => {}
                    _ => return,
                }
            }
        }
        let e = self.segs.get_mut(&s).unwrap();
        e.done_sent = true;
        let to = e.holder_sp;
        let status = self.abort.status.unwrap_or(Status::Ok);
        self.send(to, Msg::SegmentDone { src: s, status });
    }

    pub(super) fn enter_abort(&mut self, status: Status, local: bool) {
        let (_, status) = self.abort.enter(status);
        self.abort_local |= local;
        fail_pending(self.ranks.values_mut().map(|st| &mut st.out), status);
        let blind = self.topo.is_none();
        for ann in std::mem::take(&mut self.parked) {
            self.stats.parked_wait_ns += self.now.saturating_sub(ann.since);
            self.send(
                ann.origin,
                Msg::Ack {
                    src: ann.src,
                    node: ann.node,
                    status,
                },
            );
            if blind {
                self.notify_abort(ann.origin);
            }
        }
        let segs: Vec<Rank> = self.segs.keys().copied().collect();
        for s in segs {
            if blind {
                let sp = self.segs[&s].holder_sp;
                self.notify_abort(sp);
            }
            self.check_seg(s);
        }
        self.finish_abort();
    }

    crate::common::v_abort_broadcast!(|s| s.topo.as_ref().map(|t| &t.members));

    crate::common::notify_abort!();

    crate::common::v_check_complete!(|st| st.writes > 0 || st.readers > 0);
}
