//! The per-SP state of one instance, its constructor and its inputs.

use super::*;

#[derive(Clone, Debug)]
pub(super) struct LocalRank<K> {
    pub(super) key: K,
    pub(super) shared_key: Option<K>,
    pub(super) shared_at: u64,
    /// Chunks written into this rank's buffer (flat) or, for the writer,
    /// into the segment (hier).
    pub(super) written: u64,
    /// Copies writing into its buffer / segment.
    pub(super) writes: usize,
    /// Reads from its buffer (the root).
    pub(super) reads: usize,
    /// Chunks staged here when it posted (see `Mutation`).
    pub(super) staged_at_post: u64,
    pub(super) out: Outcome,
}

/// A chunk held in a slot.
#[derive(Clone, Debug)]
pub(super) struct Held {
    pub(super) index: u64,
    pub(super) len: u64,
    /// Children that have it (their moves reported done `Ok`).
    pub(super) forwarded: BTreeSet<SpId>,
    /// Children it is being moved to.
    pub(super) moving: BTreeSet<SpId>,
    /// Targets that have it.
    pub(super) done: BTreeSet<Rank>,
    /// Targets with a copy in flight.
    pub(super) writing: BTreeSet<Rank>,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum CopyKind {
    Read { slot: usize, index: u64, len: u64 },
    Write { slot: usize, index: u64, rank: Rank },
}

#[derive(Clone, Copy, Debug)]
pub(super) struct MoveSt {
    pub(super) slot: usize,
    pub(super) index: u64,
    pub(super) to: SpId,
    pub(super) dst: SlotId,
}

/// Credits received before this SP had a view.
#[derive(Clone, Debug)]
pub(super) struct EarlyCredit {
    pub(super) from: SpId,
    pub(super) root: Rank,
    pub(super) len: u64,
    pub(super) chunk_bytes: u64,
    pub(super) slots: Vec<SlotId>,
}

/// The per-SP state machine of one `Ibcast` instance.
///
/// Drive it like the other collectives: feed inputs through `handle_*`,
/// then drain `poll_action` after every input.
pub struct Bcast<K> {
    pub(super) core: Core<LocalRank<K>, CopyKind, Action<K>, Stats>,
    pub(super) chunk_bytes: u64,
    pub(super) topo: Option<Topo>,
    pub(super) view: Option<View>,
    /// SPs that sent an `Open` (bounded by the tree's size).
    pub(super) opened_by: BTreeSet<SpId>,
    /// Targets of this SP (known once topology and view are).
    pub(super) targets: Option<Vec<Rank>>,
    pub(super) slots: Slots<Held>,
    /// Chunk index -> slot holding it (Full).
    pub(super) by_index: BTreeMap<u64, usize>,
    /// Root's SP: next chunk to read, reads finished.
    pub(super) next_read: u64,
    pub(super) reads_done: u64,
    /// Other SPs: every chunk below `recv_low` arrived, and these above.
    pub(super) recv_low: u64,
    pub(super) recv_above: BTreeSet<u64>,
    /// Per child: the next chunk to forward to it (in index order).
    pub(super) next_fwd: BTreeMap<SpId, u64>,
    /// Per child: slots it granted that are still unused.
    pub(super) grants: BTreeMap<SpId, VecDeque<SlotId>>,
    pub(super) early_credits: Vec<EarlyCredit>,
    /// A leader: its node's other SPs whose first credit it accepted, and
    /// those it sent `Sealed`.
    pub(super) credited: BTreeSet<SpId>,
    pub(super) sealed_to: BTreeSet<SpId>,
    /// A node's other SP: where its leader's region is, once `Sealed`.
    pub(super) sealed: Option<u64>,
    pub(super) moves: BTreeMap<u64, MoveSt>,
    pub(super) zero_copies: VecDeque<u64>,
    pub(super) zero_moves: VecDeque<u64>,
}

common_api!(Bcast, Msg, staged);

impl<K: Clone + fmt::Debug + PartialEq> Bcast<K> {
    /// kind for `key`.
    pub fn new(key: CollKey, cfg: Config) -> Self {
        Bcast {
            core: Core::new(key, cfg.me),
            chunk_bytes: cfg.chunk_bytes.max(1),
            topo: None,
            view: None,
            opened_by: BTreeSet::new(),
            targets: None,
            slots: Slots::new(cfg.staging_slots),
            by_index: BTreeMap::new(),
            next_read: 0,
            reads_done: 0,
            recv_low: 0,
            recv_above: BTreeSet::new(),
            next_fwd: BTreeMap::new(),
            grants: BTreeMap::new(),
            early_credits: Vec::new(),
            credited: BTreeSet::new(),
            sealed_to: BTreeSet::new(),
            sealed: None,
            moves: BTreeMap::new(),
            zero_copies: VecDeque::new(),
            zero_moves: VecDeque::new(),
        }
    }

    /// The SP of each comm rank, once a local rank has posted.
    pub fn members(&self) -> Option<&[SpId]> {
        self.topo.as_ref().map(|t| t.members.as_slice())
    }

    /// The SPs grouped by node in tree order, once this SP has a view (a
    /// local post or its parent's `Open`).
    pub fn tree(&self) -> Option<&[Vec<SpId>]> {
        self.view.as_ref().map(|v| v.tree.as_slice())
    }

    /// Hierarchical design: the SP whose region of the node segment this
    /// SP's ranks copy out of (this SP at a leader, the leader after its
    /// `Sealed` elsewhere), where the region starts and the message length.
    pub fn segment_source(&self) -> Option<(SpId, u64, u64)> {
        let v = self.view.as_ref()?;
        if let Some(at) = self.sealed {
            return Some((v.parent()?, at, v.len));
        }
        if v.at != 0 || self.topo.as_ref()?.design != Design::Hier {
            return None;
        }
        let writer = self.targets.as_ref()?.first()?;
        Some((self.core.me, self.core.ranks.get(writer)?.shared_at, v.len))
    }

    /// Copies and moves started and not reported done.
    pub fn copies_in_flight(&self) -> usize {
        self.core.copies.len() + self.moves.len()
    }

    /// A local rank posted its part of the collective.
    pub fn handle_post(&mut self, now: Nanos, post: Post<K>) -> Result<(), PostError> {
        self.core.now = now;
        let tree = self.validate_post(&post)?;
        let rank = post.rank;
        let mut st = LocalRank {
            key: post.key,
            shared_key: post.shared_key,
            shared_at: post.shared_at,
            written: 0,
            writes: 0,
            reads: 0,
            staged_at_post: self.by_index.keys().next_back().map_or(0, |i| i + 1),
            out: Outcome::new(),
        };
        if let Some(status) = self.core.abort.status {
            st.out.set_error(status);
        }
        self.core.ranks.insert(rank, st);
        let first = self.topo.is_none();
        if first {
            let me = self.core.me;
            self.core
                .lost_unposted
                .retain(|&r| post.members.get(r as usize) == Some(&me));
            self.topo = Some(Topo {
                local: (0..post.members.len() as Rank)
                    .filter(|&r| post.members[r as usize] == self.core.me)
                    .collect(),
                members: post.members,
                nodes: post.nodes,
                design: post.design,
            });
        }
        let design_differs = self.topo.as_ref().unwrap().design != post.design;
        match &self.view {
            None => {
                let view = View::new(self.core.me, post.root, post.len, self.chunk_bytes, tree)
                    .expect("this SP serves the posting rank");
                self.form_view(view);
            }
            Some(v) => {
                if let Some(status) =
                    v.disagreement(post.root, post.len, self.chunk_bytes, Some(&tree))
                {
                    self.enter_abort(status);
                }
            }
        }
        // A flat rank cannot copy out of the node segment its leader sealed.
        if design_differs || (self.sealed.is_some() && post.design == Design::Flat) {
            self.enter_abort(Status::InvalidPost);
        }
        if first {
            self.learn_targets();
            if self.core.abort.is_some() {
                self.maybe_broadcast_abort();
            }
        }
        self.pump();
        Ok(())
    }

    /// The move `id` finished with `status` (`Ok`: the bytes are in the
    /// peer's slot and its `Chunk` message is on its way).
    pub fn handle_move_done(&mut self, now: Nanos, id: MoveId, status: Status) {
        self.input(now, |s| s.move_finished(id.0, status))
    }

    /// SP `sp` died: abort with `PeerFailed` if it is in the tree; slots
    /// granted to it are free again and its grants are dropped. Messages
    /// from `sp` are ignored from now on. Moves to it still in flight must
    /// be reported by the driver (`handle_move_done`).
    pub fn handle_peer_lost(&mut self, now: Nanos, sp: SpId) {
        self.core.now = now;
        if sp == self.core.me || !self.core.lost_sps.insert(sp) {
            return;
        }
        self.early_credits.retain(|c| c.from != sp);
        self.apply_peer_lost(sp);
        self.pump();
    }

    /// Every local rank completed (or was lost before posting), no copy or
    /// move is in flight, no slot is granted or holds a chunk, no grant is
    /// held, and every action was polled. An SP none of whose ranks ever
    /// posts never finishes (the driver drops such instances with the job).
    pub fn is_finished(&self) -> bool {
        self.topo
            .as_ref()
            .is_some_and(|t| self.core.completed + self.core.lost_unposted.len() == t.local.len())
            && self.core.copies.is_empty()
            && self.moves.is_empty()
            && self.slots.all_free()
            && self.grants.values().all(|g| g.is_empty())
            && self.early_credits.is_empty()
            && self.core.actions.is_empty()
            && (self.core.abort.is_some() || self.sealing().is_none_or(|s| s.is_empty()))
    }
}

impl<K: Clone + fmt::Debug + PartialEq> Bcast<K> {
    /// Checks a post; returns the tree it implies.
    pub(super) fn validate_post(
        &self,
        post: &Post<K>,
    ) -> Result<std::sync::Arc<Vec<Vec<SpId>>>, PostError> {
        let p = post.members.len();
        let rank = post.rank;
        if rank as usize >= p {
            return Err(PostError::RankOutOfRange { rank, size: p });
        }
        if post.root as usize >= p {
            return Err(PostError::RootOutOfRange {
                root: post.root,
                size: p,
            });
        }
        let served_by = post.members[rank as usize];
        if served_by != self.core.me {
            return Err(PostError::NotMine { rank, served_by });
        }
        if post.nodes.len() != p {
            return Err(PostError::LengthMismatch {
                field: "nodes",
                len: post.nodes.len(),
                expected: p,
            });
        }
        if let Some(t) = &self.topo {
            if t.members != post.members || t.nodes != post.nodes {
                return Err(PostError::MembersDisagree);
            }
        }
        let tree = shared_tree(&post.members, &post.nodes, post.root)?;
        if self.core.ranks.contains_key(&rank) {
            return Err(PostError::DuplicatePost { rank });
        }
        if self.core.lost_unposted.contains(&rank) {
            return Err(PostError::RankLost { rank });
        }
        let leader = tree.iter().any(|g| g[0] == self.core.me);
        if post.design == Design::Hier && leader && post.shared_key.is_none() {
            return Err(PostError::MissingSharedKey { rank });
        }
        Ok(tree)
    }

    /// This SP has a view for the first time.
    pub(super) fn form_view(&mut self, view: View) {
        debug_assert!(self.view.is_none());
        let children = view.children();
        let open = (!children.is_empty()).then(|| Msg::Open {
            root: view.root,
            len: view.len,
            chunk_bytes: view.chunk_bytes,
            tree: view.tree.to_vec(),
        });
        let lost = view.all().any(|s| self.core.lost_sps.contains(&s));
        for &c in &children {
            self.next_fwd.insert(c, 0);
            self.grants.insert(c, VecDeque::new());
        }
        self.view = Some(view);
        if lost {
            self.enter_abort(Status::PeerFailed);
        }
        if self.core.abort.is_some() {
            self.maybe_broadcast_abort();
        } else if let Some(open) = open {
            for c in children {
                self.send(c, open.clone());
            }
        }
        // Credits that came before the view; the first own credit (to the
        // parent) goes out from `pump`.
        for c in std::mem::take(&mut self.early_credits) {
            self.on_credit(c);
        }
    }

    /// Once both the topology and the view are known: check that they
    /// agree and compute the targets.
    pub(super) fn learn_targets(&mut self) {
        let (Some(t), Some(v)) = (&self.topo, &self.view) else {
            return;
        };
        let mut non_root = t.local.iter().copied().filter(|&r| r != v.root);
        let targets: Vec<Rank> = match t.design {
            Design::Hier if v.at == 0 => {
                let root_writes = !v.siblings().is_empty() && t.local.contains(&v.root);
                non_root
                    .next()
                    .or(root_writes.then_some(v.root))
                    .into_iter()
                    .collect()
            }
            Design::Flat | Design::Hier => non_root.collect(),
        };
        self.targets = Some(targets);
    }

    pub(super) fn apply_peer_lost(&mut self, sp: SpId) {
        self.slots.release_granted(sp);
        if let Some(g) = self.grants.get_mut(&sp) {
            g.clear();
        }
        if self.view.as_ref().is_some_and(|v| v.contains(sp)) {
            self.enter_abort(Status::PeerFailed);
        }
    }

    pub(super) fn send(&mut self, to: SpId, msg: Msg) {
        debug_assert_ne!(to, self.core.me, "bcast never messages itself");
        if to != self.core.me && !self.core.lost_sps.contains(&to) {
            self.core.actions.push_back(Action::Send { to, msg });
        }
    }
}

impl Held {
    pub(super) fn new(index: u64, len: u64) -> Held {
        Held {
            index,
            len,
            forwarded: BTreeSet::new(),
            moving: BTreeSet::new(),
            done: BTreeSet::new(),
            writing: BTreeSet::new(),
        }
    }
}

impl<K> Bcast<K> {
    /// Whether a chunk from `from` may be written into staging slot `slot` now: the slot was
    /// granted to `from` and is waiting for its chunk. A driver checks this before it writes
    /// the bytes of an incoming chunk into the slot (then delivers the `Chunk` message), so
    /// that a confused peer cannot overwrite a chunk still in use.
    pub fn may_fill(&self, from: SpId, slot: SlotId) -> bool {
        !self.core.lost_sps.contains(&from) && self.slots.granted_to(slot.0 as usize, from)
    }
}
