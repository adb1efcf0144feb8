//! Finished copies, written units, the abort and its stop handshake, and
//! the completion of local ranks.

use super::*;

impl<K: Clone + fmt::Debug + PartialEq> StagedAllgather<K> {
    pub(super) fn copy_finished(&mut self, id: u64, status: Status) {
        let Some((kind, ok)) = self.take_copy(id, status) else {
            return;
        };
        match kind {
            CopyKind::Read {
                slot,
                rank,
                chunk,
                len,
            } => {
                let st = self.core.posted(rank, "read from a posted rank");
                st.reads_in_flight -= 1;
                st.out.set_error(status);
                if ok {
                    st.reads_done += 1;
                    self.core.stats.chunk_reads += 1;
                    self.core.stats.bytes_staged += len;
                    self.slots[slot] = Slot::Full(Held {
                        block: rank,
                        chunk,
                        len,
                        epoch: self.epoch,
                        cur: 0,
                        blocked_sps: BTreeSet::new(),
                        blocked_ranks: BTreeSet::new(),
                        writing: 0,
                    });
                } else {
                    self.slots[slot] = Slot::Free;
                }
            }
            CopyKind::Write { slot, sp, rank } => {
                match &mut self.slots[slot] {
                    Slot::Full(h) if h.writing > 0 => h.writing -= 1,
                    _ => debug_assert!(
                        mutated(Mutation::FreeWhileWriting),
                        "write from a slot that changed"
                    ),
                }
                self.tgts[sp].unit.in_flight -= 1;
                if status.is_ok() {
                    self.core.stats.chunk_writes += 1;
                }
                match rank {
                    Some(r) => {
                        let t = &mut self.rtgts[r as usize].unit;
                        t.in_flight -= 1;
                        if ok {
                            t.done += 1;
                            self.check_unit(Unit::Rank(r));
                        }
                    }
                    None => {
                        if ok {
                            self.tgts[sp].unit.done += 1;
                            self.check_unit(Unit::Region(sp));
                        }
                    }
                }
            }
        }
    }

    /// Sends (or records, for this SP) `Written` for `u` once every chunk
    /// of every local block is in it.
    pub(super) fn check_unit(&mut self, u: Unit) {
        if self.core.abort.is_some() {
            return;
        }
        let v = self.view.as_ref().unwrap();
        if self.local_posted < v.local.len() {
            return;
        }
        let need = v.n * v.local.len() as u64;
        let me = self.core.me;
        match u {
            Unit::Rank(r) => {
                let t = &mut self.rtgts[r as usize];
                if t.key.is_none() || !t.unit.complete(need) {
                    return;
                }
                t.unit.sent = true;
                self.units_sent += 1;
                let b = v.members[r as usize];
                if b == me {
                    self.core
                        .posted(r, "own key known: posted")
                        .written_from
                        .insert(me);
                } else {
                    self.pending_written.entry(b).or_default().push(r);
                }
            }
            Unit::Region(b) => {
                let t = &mut self.tgts[b];
                if t.mode != Some(Mode::Region) || !t.unit.complete(need) {
                    return;
                }
                t.unit.sent = true;
                self.units_sent += 1;
                if b == v.mine {
                    t.wrote_region = true;
                    self.region_writers += 1;
                } else {
                    let to = v.sps[b];
                    self.core.stats.written_msgs += 1;
                    self.send(to, Msg::WrittenRegion);
                }
            }
        }
    }

    pub(super) fn enter_abort(&mut self, status: Status) {
        let (first, status) = self.core.abort.enter(status);
        fail_pending(self.core.ranks.values_mut().map(|st| &mut st.out), status);
        if first {
            self.read_queue.clear();
            self.pending_written.clear();
            self.schedule_notices();
        }
    }

    /// After an abort: every SP of the view and every SP heard from is
    /// owed a `Stopped`.
    pub(super) fn schedule_notices(&mut self) {
        let mut all: BTreeSet<SpId> = self.contacts.clone();
        if let Some(v) = &self.view {
            all.extend(v.sps.iter().copied());
        }
        for sp in all {
            self.schedule_notice(sp);
        }
    }

    pub(super) fn schedule_notice(&mut self, sp: SpId) {
        if sp == self.core.me || self.core.lost_sps.contains(&sp) {
            return;
        }
        if !self.notices.get(&sp).is_some_and(|n| n.stopped_sent) {
            self.notify_todo.insert(sp);
        }
    }

    /// Sends the abort notices that are due.
    pub(super) fn notify(&mut self) {
        let Some(status) = self.core.abort.status else {
            return;
        };
        for sp in std::mem::take(&mut self.notify_todo) {
            if self.core.lost_sps.contains(&sp) {
                continue;
            }
            let busy = self
                .view
                .as_ref()
                .and_then(|v| v.idx(sp))
                .is_some_and(|b| self.tgts[b].unit.in_flight > 0);
            let n = self.notices.entry(sp).or_default();
            if !busy {
                n.stopped_sent = true;
                self.core.actions.push_back(Action::Send {
                    to: sp,
                    msg: Msg::Stopped { status },
                });
            } else {
                if !n.abort_sent {
                    n.abort_sent = true;
                    self.core.actions.push_back(Action::Send {
                        to: sp,
                        msg: Msg::Abort { status },
                    });
                }
                self.notify_todo.insert(sp);
            }
        }
    }
}

impl<K: Clone + fmt::Debug + PartialEq> StagedAllgather<K> {
    pub(super) fn check_complete(&mut self, rank: Rank) {
        let Some(v) = &self.view else { return };
        let st = &self.core.ranks[&rank];
        if st.out.completed {
            return;
        }
        let aborted = self.core.abort.is_some();
        let reads_busy =
            st.reads_in_flight > 0 && !(aborted && mutated(Mutation::IgnoreReadsOnAbort));
        if reads_busy {
            return;
        }
        let mode = self.tgts[v.mine].mode;
        let hier = mode == Some(Mode::Region);
        // Only an SP that sent keys (`Key`s or its `Region`) can have writers.
        let exposed = matches!(mode, Some(Mode::Flat | Mode::Region));
        let wait = if aborted {
            let own_busy = self.tgts[v.mine].unit.in_flight > 0;
            own_busy
                || (exposed
                    && !mutated(Mutation::SkipStopHandshake)
                    && !v.sps.iter().enumerate().all(|(b, &w)| {
                        w == self.core.me
                            || self.core.lost_sps.contains(&w)
                            || self.stopped_from.contains(&w)
                            || if hier {
                                self.tgts[b].wrote_region
                            } else {
                                st.written_from.contains(&w)
                            }
                    }))
        } else if mode.is_none() {
            true
        } else if mode == Some(Mode::Covered) {
            st.reads_done < v.n || self.region_done.is_none()
        } else {
            let all = v.sps.len();
            let writers = if hier {
                self.region_writers
            } else {
                st.written_from.len()
            };
            let need = if mutated(Mutation::CompleteEarly) && !hier {
                all.div_ceil(2)
            } else {
                all
            };
            st.reads_done < v.n || writers < need
        };
        if wait {
            return;
        }
        self.complete_rank(
            rank,
            aborted,
            matches!(mode, Some(Mode::Region | Mode::Covered)),
        );
    }
}
