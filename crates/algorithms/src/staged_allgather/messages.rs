//! Announcements (keys, regions, waiting, covered) and the other messages
//! from peers.

use super::*;

impl<K: Clone + fmt::Debug + PartialEq> StagedAllgather<K> {
    /// SP `b` (index) receives per `mode` from now on.
    pub(super) fn resolve_sp(&mut self, b: usize, mode: Mode) {
        let v = self.view.as_ref().unwrap();
        let t = &mut self.tgts[b];
        debug_assert!(t.mode.is_none());
        t.mode = Some(mode);
        self.epoch += 1;
        t.unit.epoch = self.epoch;
        self.modes_unresolved -= 1;
        self.units_total += match mode {
            Mode::Flat => v.sp_ranks[b].len(),
            Mode::Region => 1,
            Mode::Covered => 0,
        };
        self.new_sps.push(b);
        if mode == Mode::Region {
            self.check_unit(Unit::Region(b));
        }
    }

    /// A hierarchical SP that is not its node's owner, once the owner's
    /// announcement is here: covered by the owner's region (it says so to
    /// every other member SP), or flat like the owner (it sends the keys
    /// of its ranks that posted).
    pub(super) fn settle(&mut self) {
        let Some(v) = &self.view else { return };
        if v.design != Design::Hier || v.is_owner() || self.core.abort.is_some() {
            return;
        }
        let (mine, owner) = (v.mine, v.owner[v.mine]);
        if self.tgts[mine].mode.is_some() {
            return;
        }
        let mode = match self.tgts[owner].mode {
            Some(Mode::Region) => Mode::Covered,
            Some(Mode::Flat) => Mode::Flat,
            _ => return,
        };
        self.resolve_sp(mine, mode);
        let v = self.view.as_ref().unwrap();
        let (len, comm) = (v.len, v.digest);
        let to = v.others(self.core.me);
        if mode == Mode::Covered {
            for sp in to {
                self.send(sp, Msg::Covered { len, comm });
            }
            return;
        }
        let keys: Vec<(Rank, K)> = self
            .posted
            .iter()
            .filter(|r| self.core.ranks[r].in_view)
            .map(|&r| (r, self.core.ranks[&r].recv_key.clone()))
            .collect();
        for (rank, key) in keys {
            self.share_rank_key(rank, key, &to);
        }
    }

    /// A flat SP: learns a local rank's receive key and sends it to the view's SPs `to`,
    /// which write their blocks through it.
    pub(super) fn share_rank_key(&mut self, rank: Rank, key: K, to: &[SpId]) {
        let v = self
            .view
            .as_ref()
            .expect("keys are shared once the view is known");
        let (len, comm) = (v.len, v.digest);
        self.learn_rank_key(rank, key.clone());
        for &sp in to {
            self.send(
                sp,
                Msg::Key {
                    rank,
                    len,
                    comm,
                    key: key.clone(),
                },
            );
        }
    }

    /// An owner: the covered SPs of its node still owed a `RegionDone`.
    pub(super) fn owed_region_done(&self) -> Vec<usize> {
        let Some(v) = &self.view else {
            return Vec::new();
        };
        (0..v.sps.len())
            .filter(|&b| {
                b != v.mine
                    && v.owner[b] == v.mine
                    && self.tgts[b].mode == Some(Mode::Covered)
                    && !self.done_sent.contains(&b)
            })
            .collect()
    }

    /// An owner whose region every member SP wrote tells its node's covered
    /// SPs where it is.
    pub(super) fn send_region_done(&mut self) {
        let Some(v) = &self.view else { return };
        let full =
            self.tgts[v.mine].mode == Some(Mode::Region) && self.region_writers == v.sps.len();
        if !full || self.core.abort.is_some() {
            return;
        }
        for b in self.owed_region_done() {
            self.done_sent.insert(b);
            self.core.stats.regions_shared += 1;
            let to = self.view.as_ref().unwrap().sps[b];
            self.send(to, Msg::RegionDone { at: self.region_at });
        }
    }

    pub(super) fn learn_rank_key(&mut self, rank: Rank, key: K) {
        self.epoch += 1;
        let t = &mut self.rtgts[rank as usize];
        t.key = Some(key);
        t.unit.epoch = self.epoch;
        self.new_ranks.push(rank);
        self.check_unit(Unit::Rank(rank));
    }

    /// A view-local rank posted in agreement.
    pub(super) fn on_local_posted(&mut self) {
        let v = self.view.as_ref().unwrap();
        if self.local_posted < v.local.len() || v.n > 0 {
            return;
        }
        // Zero-length blocks: every unit whose key is known is done.
        for r in 0..self.rtgts.len() {
            self.check_unit(Unit::Rank(r as Rank));
        }
        for b in 0..self.tgts.len() {
            self.check_unit(Unit::Region(b));
        }
    }

    pub(super) fn send(&mut self, to: SpId, msg: Msg<K>) {
        debug_assert_ne!(to, self.core.me, "never messages itself");
        if to != self.core.me && !self.core.lost_sps.contains(&to) {
            self.core.actions.push_back(Action::Send { to, msg });
        }
    }

    pub(super) fn process(&mut self, from: SpId, msg: Msg<K>) -> Result<(), MsgError> {
        if from == self.core.me {
            return Err(MsgError::Unexpected { sp: from });
        }
        if self.contacts.insert(from) && self.core.abort.is_some() {
            self.schedule_notice(from);
        }
        if self.view.is_none() {
            // Announcements that come before the view wait for it (`form_view`), one per
            // sender and rank (`Region`/`Covered`: one per sender, `Waiting` apart).
            let mark = match &msg {
                Msg::Key { rank, .. } => Some((Some(*rank), true)),
                Msg::Region { .. } | Msg::Covered { .. } => Some((None, true)),
                Msg::Waiting { .. } => Some((Some(Rank::MAX), false)),
                _ => None,
            };
            if let Some((mark, announces)) = mark {
                if !self.early_seen.insert((from, mark)) {
                    return Err(MsgError::Duplicate { sp: from });
                }
                if announces {
                    self.core.stats.keys_before_post += 1;
                }
                self.early.push((from, msg));
                return Ok(());
            }
        }
        match msg {
            // The sender of `Waiting` is a contact now (owed a `Stopped`
            // if this SP aborts) and learns this SP's mode from its
            // announcement.
            Msg::Key { .. } | Msg::Region { .. } | Msg::Waiting { .. } | Msg::Covered { .. } => {
                self.on_announcement(from, msg)
            }
            Msg::RegionDone { at } => {
                let bad = Err(MsgError::Unexpected { sp: from });
                let Some(v) = &self.view else { return bad };
                let from_owner = v.sps[v.owner[v.mine]] == from;
                if !from_owner
                    || self.tgts[v.mine].mode != Some(Mode::Covered)
                    || self.region_done.is_some()
                {
                    return bad;
                }
                self.region_done = Some(at);
                Ok(())
            }
            Msg::Written { ranks } => {
                let bad = Err(MsgError::Unexpected { sp: from });
                let Some(v) = &self.view else { return bad };
                if self.tgts[v.mine].mode != Some(Mode::Flat) || v.idx(from).is_none() {
                    return bad;
                }
                for r in &ranks {
                    match self.core.ranks.get(r) {
                        Some(st) if st.in_view && !st.written_from.contains(&from) => {}
                        _ => return bad,
                    }
                }
                if ranks.iter().collect::<BTreeSet<_>>().len() != ranks.len() {
                    return bad;
                }
                for r in ranks {
                    self.core
                        .ranks
                        .get_mut(&r)
                        .unwrap()
                        .written_from
                        .insert(from);
                }
                Ok(())
            }
            Msg::WrittenRegion => {
                let bad = Err(MsgError::Unexpected { sp: from });
                let Some(v) = &self.view else { return bad };
                let Some(b) = v.idx(from) else { return bad };
                if self.tgts[v.mine].mode != Some(Mode::Region) || self.tgts[b].wrote_region {
                    return bad;
                }
                self.tgts[b].wrote_region = true;
                self.region_writers += 1;
                Ok(())
            }
            Msg::Abort { status } => {
                self.enter_abort(status);
                Ok(())
            }
            Msg::Stopped { status } => {
                self.stopped_from.insert(from);
                self.enter_abort(status);
                Ok(())
            }
        }
    }

    /// The status to abort with if a key's `(len, comm)` or sender
    /// disagrees with the view.
    pub(super) fn key_disagreement(
        &self,
        from: SpId,
        rank: Rank,
        len: u64,
        comm: u64,
    ) -> Option<Status> {
        let v = self.view.as_ref().unwrap();
        if len != v.len {
            Some(Status::CountMismatch)
        } else if comm != v.digest || v.members.get(rank as usize) != Some(&from) {
            Some(Status::InvalidPost)
        } else {
            None
        }
    }

    /// The view index of `from`, which sent a `Key` or `Region` for its
    /// `rank`; `None` if the message disagrees with the view (the instance
    /// aborted).
    pub(super) fn key_sender(
        &mut self,
        from: SpId,
        rank: Rank,
        len: u64,
        comm: u64,
    ) -> Option<usize> {
        if let Some(status) = self.key_disagreement(from, rank, len, comm) {
            self.enter_abort(status);
            return None;
        }
        Some(
            self.view
                .as_ref()
                .unwrap()
                .idx(from)
                .expect("serves a rank"),
        )
    }

    /// A `Key`, `Region`, `Waiting` or `Covered` from `from`, with the view
    /// known (on arrival, or kept until `form_view`). A `Key` or `Region`
    /// is checked against the view (`key_sender`), then names the receive
    /// key of `rank` (flat) or the region of its SP, an owner (through the
    /// shared key of `rank`).
    pub(super) fn on_announcement(&mut self, from: SpId, msg: Msg<K>) -> Result<(), MsgError> {
        let (rank, len, comm, key, region) = match msg {
            Msg::Key {
                rank,
                len,
                comm,
                key,
            } => (rank, len, comm, key, false),
            Msg::Region {
                rank,
                len,
                comm,
                key,
            } => (rank, len, comm, key, true),
            Msg::Waiting { len, comm } => return self.on_waiting(from, len, comm),
            Msg::Covered { len, comm } => return self.on_covered(from, len, comm),
            _ => unreachable!("not an announcement"),
        };
        let Some(b) = self.key_sender(from, rank, len, comm) else {
            return Ok(());
        };
        if region {
            if self.view.as_ref().unwrap().owner[b] != b {
                // Same members (the digest matched), so the same owners:
                // only an owner announces a region.
                return Err(MsgError::Unexpected { sp: from });
            }
            if self.first_mode(b, from, Mode::Region)? {
                self.tgts[b].region = Some((rank, key));
                self.resolve_sp(b, Mode::Region);
            }
            return Ok(());
        }
        if matches!(self.tgts[b].mode, Some(Mode::Region | Mode::Covered)) {
            self.enter_abort(Status::InvalidPost);
            return Ok(());
        }
        if self.rtgts[rank as usize].key.is_some() {
            return Err(MsgError::Duplicate { sp: from });
        }
        if self.core.abort.is_some() {
            return Ok(());
        }
        if self.tgts[b].mode.is_none() {
            self.resolve_sp(b, Mode::Flat);
        }
        self.learn_rank_key(rank, key);
        Ok(())
    }

    /// SP `b` (`from`) announced that it receives per `mode` (`Region` or
    /// `Covered`, each sent once): a second one is a duplicate, one that
    /// contradicts what it announced before aborts. True if `mode` is to be
    /// resolved now (first announcement, instance not aborted).
    pub(super) fn first_mode(
        &mut self,
        b: usize,
        from: SpId,
        mode: Mode,
    ) -> Result<bool, MsgError> {
        match self.tgts[b].mode {
            Some(m) if m == mode => Err(MsgError::Duplicate { sp: from }),
            Some(_) => {
                self.enter_abort(Status::InvalidPost);
                Ok(false)
            }
            None => Ok(self.core.abort.is_none()),
        }
    }

    /// The view index of `from`, which sent `Waiting` or `Covered` with
    /// `(len, comm)`; `None` if it is no member SP or the message disagrees
    /// with the view (the instance aborted).
    pub(super) fn member_sender(&mut self, from: SpId, len: u64, comm: u64) -> Option<usize> {
        let v = self.view.as_ref().unwrap();
        let status = match v.idx(from) {
            None => Status::InvalidPost,
            Some(_) if len != v.len => Status::CountMismatch,
            Some(_) if comm != v.digest => Status::InvalidPost,
            Some(b) => return Some(b),
        };
        self.enter_abort(status);
        None
    }

    /// SP `from` of this owner's node posted.
    pub(super) fn on_waiting(&mut self, from: SpId, len: u64, comm: u64) -> Result<(), MsgError> {
        let Some(b) = self.member_sender(from, len, comm) else {
            return Ok(());
        };
        let v = self.view.as_ref().unwrap();
        if v.owner[b] != v.mine || b == v.mine {
            self.enter_abort(Status::InvalidPost);
        } else if !self.waiting_from.insert(b) {
            return Err(MsgError::Duplicate { sp: from });
        }
        Ok(())
    }

    /// SP `from` is covered by its owner's region.
    pub(super) fn on_covered(&mut self, from: SpId, len: u64, comm: u64) -> Result<(), MsgError> {
        let Some(b) = self.member_sender(from, len, comm) else {
            return Ok(());
        };
        let v = self.view.as_ref().unwrap();
        if v.owner[b] == b {
            return Err(MsgError::Unexpected { sp: from });
        }
        if self.first_mode(b, from, Mode::Covered)? {
            self.resolve_sp(b, Mode::Covered);
        }
        Ok(())
    }
}
