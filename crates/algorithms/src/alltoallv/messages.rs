//! Checks of posts and peers, the messages from peers (announcements and
//! acks), the abort and the completion of local ranks.

use super::*;

impl<K: Clone + fmt::Debug + PartialEq> Alltoallv<K> {
    pub(super) fn validate_post(&self, post: &Post<K>) -> Result<(), PostError> {
        let p = post.members.len();
        let rank = post.rank;
        PostError::check_served(&post.members, rank, self.core.me)?;
        let vectors: [(&'static str, &Vec<u64>); 4] = [
            ("send_counts", &post.own.send_counts),
            ("send_displs", &post.own.send_displs),
            ("recv_counts", &post.recv_counts),
            ("recv_displs", &post.recv_displs),
        ];
        for (field, v) in vectors {
            if v.len() != p {
                return Err(PostError::LengthMismatch {
                    field,
                    len: v.len(),
                    expected: p,
                });
            }
        }
        if let Some(m) = &self.members {
            if *m != post.members {
                return Err(PostError::MembersDisagree);
            }
        }
        if self.core.ranks.contains_key(&rank) {
            return Err(PostError::DuplicatePost { rank });
        }
        if self.core.lost_unposted.contains(&rank) {
            return Err(PostError::RankLost { rank });
        }
        let pairs = [
            ("send", &post.own.send_displs, &post.own.send_counts),
            ("recv", &post.recv_displs, &post.recv_counts),
        ];
        for (field, displs, counts) in pairs {
            if let Some(index) = (0..p).find(|&i| displs[i].checked_add(counts[i]).is_none()) {
                return Err(PostError::Overflow { rank, field, index });
            }
        }
        Ok(())
    }

    pub(super) fn learn_membership(&mut self, members: Vec<SpId>) {
        let me = self.core.me;
        let p = members.len();
        self.local_count = members.iter().filter(|&&s| s == me).count();
        // Announcements queued blindly are validated now.
        let queued = std::mem::take(&mut self.queued);
        for ((dst, src), q) in queued {
            let ok = (dst as usize) < p
                && (src as usize) < p
                && members[dst as usize] == me
                && members[src as usize] == q.from;
            if ok {
                self.queued.insert((dst, src), q);
            } else {
                self.core.stats.discarded_announcements += 1;
            }
        }
        self.core
            .lost_unposted
            .retain(|&r| (r as usize) < p && members[r as usize] == me);
        let peer_lost = self.core.lost_sps.iter().any(|s| members.contains(s));
        self.members = Some(members);
        if peer_lost {
            self.enter_abort(Status::PeerFailed);
        } else if self.core.abort.is_some() {
            self.maybe_broadcast_abort();
        }
    }

    pub(super) fn member(&self, rank: Rank) -> SpId {
        self.members.as_ref().expect("membership known")[rank as usize]
    }

    crate::common::v_internal_send!();

    pub(super) fn process(&mut self, from: SpId, msg: Msg<K>) -> Result<(), MsgError> {
        match msg {
            Msg::Announce {
                src,
                dst,
                key,
                offset,
                len,
            } => self.on_announce(Ann {
                from,
                src,
                dst,
                key,
                offset,
                len,
            }),
            Msg::Ack { src, dst, status } => self.on_ack(from, src, dst, status),
            Msg::Abort { status } => {
                if let Some(m) = &self.members {
                    if !m.contains(&from) {
                        return Err(MsgError::NotMember { sp: from });
                    }
                }
                self.abort_instance(status, false);
                Ok(())
            }
        }
    }

    /// A message from `from` about `src`'s block for `dst` (membership
    /// known): an announcement (`to_dst`: `dst` must be served by this SP,
    /// `src` by `from`) or an ack (the other way round).
    pub(super) fn check_block(
        &self,
        from: SpId,
        src: Rank,
        dst: Rank,
        to_dst: bool,
    ) -> Result<(), MsgError> {
        let size = self.members.as_ref().map_or(0, Vec::len);
        if let Some(rank) = [src, dst].into_iter().find(|&r| r as usize >= size) {
            return Err(MsgError::RankOutOfRange { rank, size });
        }
        let (local, remote) = if to_dst { (dst, src) } else { (src, dst) };
        if self.member(local) != self.core.me {
            return Err(MsgError::NotLocal { rank: local });
        }
        let expected = self.member(remote);
        if expected != from {
            return Err(MsgError::WrongSender {
                rank: remote,
                expected,
                got: from,
            });
        }
        Ok(())
    }

    pub(super) fn on_announce(&mut self, ann: Ann<K>) -> Result<(), MsgError> {
        let (from, src, dst) = (ann.from, ann.src, ann.dst);
        if ann.offset.checked_add(ann.len).is_none() {
            return Err(MsgError::Overflow { src, dst });
        }
        if self.members.is_none() {
            if let Some(status) = self.core.abort.status {
                // Cannot validate, but the sender must not wait for us; make
                // sure its SP learns about the abort too.
                self.send(from, Msg::Ack { src, dst, status });
                self.notify_abort(from);
                return Ok(());
            }
            return self.queue_announce(ann);
        }
        self.check_block(from, src, dst, true)?;
        self.deliver_announce(ann)
    }

    /// Keeps an announcement whose destination cannot take it yet (membership
    /// unknown, or `dst` has not posted): a late arrival.
    pub(super) fn queue_announce(&mut self, ann: Ann<K>) -> Result<(), MsgError> {
        let (src, dst) = (ann.src, ann.dst);
        if self.queued.contains_key(&(dst, src)) {
            return Err(MsgError::DuplicateAnnounce { src, dst });
        }
        self.queued.insert((dst, src), ann);
        self.core.stats.late_announcements += 1;
        Ok(())
    }

    /// A validated announcement (membership known, `dst` local, `from`
    /// serves `src`).
    pub(super) fn deliver_announce(&mut self, ann: Ann<K>) -> Result<(), MsgError> {
        let (from, src, dst, len) = (ann.from, ann.src, ann.dst, ann.len);
        let abort = self.core.abort.status;
        let Some(st) = self.core.ranks.get_mut(&dst) else {
            if let Some(status) = abort {
                self.send(from, Msg::Ack { src, dst, status });
                return Ok(());
            }
            return self.queue_announce(ann);
        };
        let s = src as usize;
        if st.recv[s] != RecvState::Waiting {
            return Err(MsgError::DuplicateAnnounce { src, dst });
        }
        let ack = if let Some(status) = abort {
            status
        } else if len != st.buf.counts[s] {
            st.out.set_error(Status::CountMismatch);
            Status::CountMismatch
        } else if len == 0 {
            Status::Ok
        } else {
            // (`st` borrows `ranks`: no `core.new_id()` here)
            let id = CopyId(self.core.next_id);
            self.core.next_id += 1;
            st.recv[s] = RecvState::Copying;
            st.buf.writes += 1;
            let copy = Copy {
                id,
                seg: (),
                src_rank: src,
                src_key: ann.key,
                src_offset: ann.offset,
                dst_rank: dst,
                dst_key: st.buf.key.clone(),
                dst_offset: st.buf.displs[s],
                len,
            };
            self.core.copies.insert(id.0, (dst, src));
            self.core.actions.push_back(Action::Copy(copy));
            return Ok(());
        };
        st.recv[s] = RecvState::Done;
        st.buf.pending -= 1;
        self.send(
            from,
            Msg::Ack {
                src,
                dst,
                status: ack,
            },
        );
        self.check_complete(dst);
        Ok(())
    }

    pub(super) fn on_ack(
        &mut self,
        from: SpId,
        src: Rank,
        dst: Rank,
        status: Status,
    ) -> Result<(), MsgError> {
        if self.members.is_none() {
            return Err(MsgError::UnexpectedAck { src, dst });
        }
        self.check_block(from, src, dst, false)?;
        let Some(st) = self.core.ranks.get_mut(&src) else {
            return Err(MsgError::UnexpectedAck { src, dst });
        };
        let d = dst as usize;
        if st.send[d] != SendState::Pending {
            return Err(MsgError::UnexpectedAck { src, dst });
        }
        st.send[d] = SendState::Acked;
        st.send_pending -= 1;
        st.out.set_error(status);
        self.check_complete(src);
        Ok(())
    }

    /// Aborts with `status` (`Ok`: `Aborted`), broadcasting it.
    pub(super) fn enter_abort(&mut self, status: Status) {
        self.abort_instance(status, true);
    }

    /// Aborts with `status`; `local`: the abort started here and is to be
    /// broadcast (else it came with a peer's `Abort`).
    pub(super) fn abort_instance(&mut self, status: Status, local: bool) {
        let (_, status) = self.core.abort.enter(status);
        self.abort_local |= local;
        fail_pending(self.core.ranks.values_mut().map(|st| &mut st.out), status);
        // Nobody will read into a rank that has not posted: release senders.
        let queued = std::mem::take(&mut self.queued);
        let blind = self.members.is_none();
        for ((dst, src), q) in queued {
            self.send(q.from, Msg::Ack { src, dst, status });
            if blind {
                self.notify_abort(q.from);
            }
        }
        self.finish_abort();
    }

    crate::common::v_abort_broadcast!(|s| s.members.as_ref());

    crate::common::notify_abort!();

    crate::common::v_check_complete!(|st| st.buf.writes > 0 || st.send_pending > 0);
}
