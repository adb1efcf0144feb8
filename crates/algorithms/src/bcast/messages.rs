//! Messages from peers: opens, credits, chunks, returns, seals and aborts.

use super::*;

impl<K: Clone + fmt::Debug + PartialEq> Bcast<K> {
    pub(super) fn process(&mut self, from: SpId, msg: Msg) -> Result<(), MsgError> {
        match msg {
            Msg::Open {
                root,
                len,
                chunk_bytes,
                tree,
            } => {
                let me = self.core.me;
                let place = tree
                    .iter()
                    .enumerate()
                    .find_map(|(g, sps)| sps.iter().position(|&s| s == me).map(|a| (g, a)));
                let count: usize = tree.iter().map(Vec::len).sum();
                let ok = place.is_some_and(|(g, a)| tree_parent(&tree, g, a) == Some(from))
                    && tree.iter().flatten().collect::<BTreeSet<_>>().len() == count;
                if !ok {
                    return Err(MsgError::NotParent { sp: from });
                }
                // Every SP sends one Open; Opens from several SPs (the
                // parents in different views) are a disagreement.
                if !self.opened_by.insert(from) {
                    return Err(MsgError::DuplicateOpen { sp: from });
                }
                match &self.view {
                    Some(v) => {
                        if let Some(status) = v.disagreement(root, len, chunk_bytes, Some(&tree)) {
                            self.enter_abort(status);
                        }
                    }
                    None => {
                        let mismatch = chunk_bytes != self.chunk_bytes;
                        let view = View::new(me, root, len, self.chunk_bytes, tree.into())
                            .expect("checked above");
                        self.form_view(view);
                        self.learn_targets();
                        if mismatch {
                            self.enter_abort(Status::InvalidPost);
                        }
                    }
                }
                if self.core.abort.is_some() {
                    self.notify_abort(from);
                }
                Ok(())
            }
            Msg::Credit {
                root,
                len,
                chunk_bytes,
                slots,
            } => {
                let c = EarlyCredit {
                    from,
                    root,
                    len,
                    chunk_bytes,
                    slots,
                };
                if self.view.is_none() && self.core.abort.is_none() {
                    self.early_credits.push(c);
                    return Ok(());
                }
                // From a non-child it means the trees differ (members
                // disagree): `on_credit` aborts.
                self.on_credit(c);
                Ok(())
            }
            Msg::Chunk { index, slot, len } => {
                let i = slot.0 as usize;
                if !self.slots.granted_to(i, from) {
                    return Err(MsgError::SlotNotGranted { slot });
                }
                if self.core.abort.is_some() {
                    self.slots[i] = Slot::Free;
                    return Ok(());
                }
                let v = self.view.as_ref().expect("granted under a view");
                if index >= v.n
                    || index < self.recv_low
                    || self.recv_above.contains(&index)
                    || len != v.chunk_len(index)
                {
                    return Err(MsgError::BadChunk { index });
                }
                if index == self.recv_low {
                    self.recv_low += 1;
                    while self.recv_above.remove(&self.recv_low) {
                        self.recv_low += 1;
                    }
                } else {
                    self.recv_above.insert(index);
                }
                self.core.stats.bytes_staged += len;
                if self.topo.is_none() {
                    self.core.stats.chunks_before_post += 1;
                }
                self.slots[i] = Slot::Full(Held::new(index, len));
                self.by_index.insert(index, i);
                Ok(())
            }
            Msg::Return { slots } => {
                for &slot in &slots {
                    let i = slot.0 as usize;
                    if !self.slots.granted_to(i, from) {
                        return Err(MsgError::SlotNotGranted { slot });
                    }
                }
                for slot in slots {
                    self.slots[slot.0 as usize] = Slot::Free;
                }
                Ok(())
            }
            Msg::Abort { status } => {
                if let Some(v) = &self.view {
                    if !v.contains(from) {
                        return Err(MsgError::NotMember { sp: from });
                    }
                }
                self.enter_abort(status);
                Ok(())
            }
            Msg::Sealed { at } => {
                let from_leader = self
                    .view
                    .as_ref()
                    .is_some_and(|v| v.at > 0 && v.parent() == Some(from));
                let no_chunks = self.recv_low == 0 && self.recv_above.is_empty();
                if !from_leader || self.sealed.is_some() || !no_chunks {
                    return Err(MsgError::UnexpectedSeal { sp: from });
                }
                // The leader holds none of our grants any more, whatever
                // happened here meanwhile.
                self.slots.release_granted(from);
                if self.core.abort.is_some() {
                    return Ok(());
                }
                self.sealed = Some(at);
                if self.topo.as_ref().is_some_and(|t| t.design == Design::Flat) {
                    self.enter_abort(Status::InvalidPost);
                }
                Ok(())
            }
        }
    }

    /// A hierarchical leader: its node's other SPs not sent `Sealed` yet.
    pub(super) fn sealing(&self) -> Option<Vec<SpId>> {
        let (v, t) = (self.view.as_ref()?, self.topo.as_ref()?);
        (t.design == Design::Hier).then(|| {
            v.siblings()
                .iter()
                .copied()
                .filter(|s| !self.sealed_to.contains(s))
                .collect()
        })
    }

    /// The children chunks are moved to: the next leader, and this leader's
    /// node's other SPs once it knows it delivers flat.
    pub(super) fn receivers(&self) -> Vec<SpId> {
        let Some(v) = &self.view else {
            return Vec::new();
        };
        let flat = self.topo.as_ref().is_some_and(|t| t.design == Design::Flat);
        let mut c = v.children();
        if !flat {
            c.retain(|s| !v.siblings().contains(s));
        }
        c
    }

    /// A hierarchical leader whose region holds every chunk seals it for
    /// the node's other SPs that credited it.
    pub(super) fn seal(&mut self) {
        if self.core.abort.is_some() {
            return;
        }
        let Some(todo) = self.sealing() else { return };
        let v = self.view.as_ref().expect("sealing needs a view");
        let n = v.n;
        let writer = self.targets.as_ref().and_then(|t| t.first());
        let Some(w) = writer.and_then(|w| self.core.ranks.get(w)) else {
            return;
        };
        if w.written < n {
            return;
        }
        let at = w.shared_at;
        for s in todo {
            if !self.credited.contains(&s) {
                continue;
            }
            self.sealed_to.insert(s);
            if let Some(g) = self.grants.get_mut(&s) {
                g.clear();
            }
            self.core.stats.regions_shared += 1;
            self.send(s, Msg::Sealed { at });
        }
    }

    /// A credit from `c.from`, with a view here or after an abort.
    pub(super) fn on_credit(&mut self, c: EarlyCredit) {
        if self.sealed_to.contains(&c.from) {
            // Sent before our `Sealed` reached it: those slots are void.
            return;
        }
        if self.core.abort.is_none() {
            let v = self.view.as_ref().expect("view known");
            let status = v
                .disagreement(c.root, c.len, c.chunk_bytes, None)
                .or((!self.grants.contains_key(&c.from)).then_some(Status::InvalidPost));
            match status {
                None => {
                    self.grants.entry(c.from).or_default().extend(c.slots);
                    self.credited.insert(c.from);
                    return;
                }
                Some(status) => self.enter_abort(status),
            }
        }
        if !c.slots.is_empty() {
            self.send(c.from, Msg::Return { slots: c.slots });
        }
        self.notify_abort(c.from);
    }
}
