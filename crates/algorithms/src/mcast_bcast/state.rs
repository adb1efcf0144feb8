//! The per-SP state of one instance, its constructor and its inputs.

use super::*;

#[derive(Clone, Debug)]
pub(super) struct LocalRank<K> {
    pub(super) key: K,
    /// Copies writing into its buffer.
    pub(super) writes: usize,
    /// Copies reading its buffer (the root's, at its own SP).
    pub(super) reads: usize,
    /// At the root's SP, a non-root rank: the root's bytes are in.
    pub(super) copied: bool,
    /// At the root's SP, a non-root rank: its copy was emitted.
    pub(super) copy_started: bool,
    pub(super) out: Outcome,
}

/// What a copy or multicast in flight does.
#[derive(Clone, Copy, Debug)]
pub(super) enum CopyKind {
    /// Root's buffer into local `rank`'s, at the root's SP.
    Local {
        rank: Rank,
    },
    /// Range `range` of the fetch into local `rank`.
    Fetch {
        range: usize,
        rank: Rank,
    },
    Multicast {
        psns: u64,
    },
}

/// `(root, len, mtu, subgroups, ring)` as one SP sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct View {
    pub(super) root: Rank,
    pub(super) len: u64,
    pub(super) mtu: u64,
    pub(super) subgroups: u16,
    pub(super) ring: Vec<SpId>,
    /// This SP's place in `ring` (0: the root's SP).
    pub(super) pos: usize,
    /// Number of chunks.
    pub(super) n: u64,
}

impl View {
    pub(super) fn is_root_sp(&self) -> bool {
        self.pos == 0
    }

    /// Towards the root (the root's SP: the last of the ring); `None` alone.
    pub(super) fn left(&self) -> Option<SpId> {
        let k = self.ring.len();
        (k > 1).then(|| self.ring[(self.pos + k - 1) % k])
    }

    pub(super) fn right(&self) -> Option<SpId> {
        let k = self.ring.len();
        (k > 1).then(|| self.ring[(self.pos + 1) % k])
    }

    pub(super) fn root_sp(&self) -> SpId {
        self.ring[0]
    }

    /// Bytes `[from, to)` of chunks `[first, end)`.
    pub(super) fn bytes(&self, (first, end): (u64, u64)) -> (u64, u64) {
        let at = |i: u64| i.saturating_mul(self.mtu).min(self.len);
        (at(first), at(end))
    }

    /// The abort status if `(root, len, mtu)` disagrees with this view.
    pub(super) fn disagreement(&self, root: Rank, len: u64, mtu: u64) -> Option<Status> {
        if root != self.root || len != self.len {
            Some(Status::CountMismatch)
        } else if mtu != self.mtu {
            Some(Status::InvalidPost)
        } else {
            None
        }
    }
}

/// A leaf's fetch from its neighbour.
#[derive(Clone, Debug)]
pub(super) struct Fetch {
    pub(super) from: SpId,
    /// The ranges asked for.
    pub(super) ranges: Vec<(u64, u64)>,
    /// The ranges whose bits are set once every copy finished (those asked
    /// for; see `Mutation::SkipLastRange`).
    pub(super) sets: Vec<(u64, u64)>,
    pub(super) acked: bool,
    /// Per range of `ranges`: copies not finished.
    pub(super) left: Vec<usize>,
    /// Copies in flight.
    pub(super) copies: usize,
}

/// The per-SP state machine of one multicast `Ibcast` instance.
///
/// Drive it like the other collectives: feed inputs through `handle_*`,
/// then drain `poll_action` and re-read `poll_timeout` after every input.
pub struct McastBcast<K> {
    pub(super) core: Core<LocalRank<K>, CopyKind, Action<K>, Stats>,
    pub(super) cfg: Config,
    pub(super) members: Option<Vec<SpId>>,
    /// Ranks served here, ascending (known with `members`).
    pub(super) local: Vec<Rank>,
    pub(super) view: Option<View>,
    /// The ring as the root's `Open` named it, before this SP had a view
    /// (to broadcast an abort that began here).
    pub(super) ring_hint: Option<Vec<SpId>>,
    /// Messages that came before the view, per sender (bounded).
    pub(super) early: BTreeMap<SpId, Vec<Msg<K>>>,
    /// The abort began here (it is broadcast once the ring is known).
    pub(super) abort_local: bool,
    pub(super) registered: bool,
    pub(super) unregistered: bool,
    pub(super) ready_sent: bool,
    /// Root's SP: SPs that sent a matching `Ready`.
    pub(super) ready_from: BTreeSet<SpId>,
    pub(super) open_sent: bool,
    /// SPs that sent an `Open` (more than one: they disagree on the root).
    pub(super) opened_by: BTreeSet<SpId>,
    pub(super) mcast_started: bool,
    pub(super) mcasts_in_flight: usize,
    pub(super) mcast_done: bool,
    pub(super) sent_seen: bool,
    /// The bitmap (leaves) and how many bits are set.
    pub(super) have: Vec<u64>,
    pub(super) have_count: u64,
    pub(super) deadline: Option<Nanos>,
    /// When a receive worker last landed a chunk new here (the cutoff waits
    /// while chunks keep landing).
    pub(super) last_landed: Option<Nanos>,
    pub(super) scanned: bool,
    pub(super) fetch: Option<Fetch>,
    /// The right neighbour's request, until answered.
    pub(super) serve: Option<Vec<(u64, u64)>>,
    /// Chunks of `serve` not here yet (counted down as bits are set, so that
    /// a landing costs a search of `serve`, not a scan of it).
    pub(super) serve_missing: u64,
    pub(super) req_seen: bool,
    pub(super) acked_right: bool,
    pub(super) final_sent: bool,
    pub(super) final_from_right: bool,
    pub(super) right_lost: bool,
}

common_api!(McastBcast, Msg<K>, settle = settle, own_timers);

impl<K: Clone + fmt::Debug + PartialEq> McastBcast<K> {
    /// A fresh instance for `key`; the driver may create it on the first
    /// event of any kind for `key` (a peer message can come before any
    /// local post).
    pub fn new(key: CollKey, cfg: Config) -> Self {
        let cfg = Config {
            mtu: cfg.mtu.max(1),
            subgroups: cfg.subgroups.max(1),
            link_bytes_per_ns: cfg.link_bytes_per_ns.max(1),
            ..cfg
        };
        McastBcast {
            core: Core::new(key, cfg.me),
            cfg,
            members: None,
            local: Vec::new(),
            view: None,
            ring_hint: None,
            early: BTreeMap::new(),
            abort_local: false,
            registered: false,
            unregistered: false,
            ready_sent: false,
            ready_from: BTreeSet::new(),
            open_sent: false,
            opened_by: BTreeSet::new(),
            mcast_started: false,
            mcasts_in_flight: 0,
            mcast_done: false,
            sent_seen: false,
            have: Vec::new(),
            have_count: 0,
            deadline: None,
            last_landed: None,
            scanned: false,
            fetch: None,
            serve: None,
            serve_missing: 0,
            req_seen: false,
            acked_right: false,
            final_sent: false,
            final_from_right: false,
            right_lost: false,
        }
    }

    /// The SP of each comm rank, once a local rank has posted.
    pub fn members(&self) -> Option<&[SpId]> {
        self.members.as_deref()
    }

    /// The ring of SPs, root's SP first, once a local rank posted.
    pub fn ring(&self) -> Option<&[SpId]> {
        self.view.as_ref().map(|v| v.ring.as_slice())
    }

    /// Copies and multicasts started and not reported done.
    pub fn copies_in_flight(&self) -> usize {
        self.core.copies.len()
    }

    /// Every chunk is in every local rank's buffer (at the root's SP: the
    /// root posted).
    pub fn has_all(&self) -> bool {
        self.view.as_ref().is_some_and(|v| self.have_count == v.n)
    }

    /// The next deadline of the cutoff timer: `None` once the bitmap was
    /// scanned, everything is in, or the instance aborted.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        if self.core.abort.is_some() || self.scanned || self.has_all() {
            return None;
        }
        self.deadline
    }

    /// The cutoff timer: at or after the deadline, the bitmap is scanned
    /// and what is missing fetched (earlier calls do nothing).
    pub fn handle_timeout(&mut self, now: Nanos) {
        self.input(now, |s| {
            if s.poll_timeout().is_some_and(|d| d <= now) {
                match s.last_landed.map(|t| t + s.cfg.alpha_ns) {
                    // Chunks are still landing: the multicast is not over
                    // here, only slower than the timer assumed.
                    Some(quiet) if quiet > now => {
                        s.deadline = Some(quiet);
                        s.core.stats.cutoffs_extended += 1;
                    }
                    _ => s.scan(),
                }
            }
        })
    }

    /// A local rank posted its part of the collective.
    pub fn handle_post(&mut self, now: Nanos, post: Post<K>) -> Result<(), PostError> {
        self.set_clock(now);
        self.validate_post(&post)?;
        let rank = post.rank;
        let mut st = LocalRank {
            key: post.key.clone(),
            writes: 0,
            reads: 0,
            copied: false,
            copy_started: false,
            out: Outcome::new(),
        };
        if let Some(status) = self.core.abort.status {
            st.out.set_error(status);
        }
        self.core.ranks.insert(rank, st);
        if self.members.is_none() {
            let me = self.core.me;
            self.core
                .lost_unposted
                .retain(|&r| post.members.get(r as usize) == Some(&me));
            self.local = (0..post.members.len() as Rank)
                .filter(|&r| post.members[r as usize] == me)
                .collect();
            self.members = Some(post.members.clone());
        }
        match &self.view {
            None => self.form_view(&post),
            Some(v) => {
                if let Some(status) = v.disagreement(post.root, post.len, self.cfg.mtu) {
                    self.enter_abort(status);
                }
            }
        }
        if self
            .view
            .as_ref()
            .is_some_and(|v| v.root == rank && v.is_root_sp())
        {
            // The root's buffer holds every chunk.
            self.have_count = self.view.as_ref().unwrap().n;
        }
        self.settle();
        Ok(())
    }

    /// The SP's receive workers landed chunk `psn` in every local rank's
    /// buffer (ignored, counted, after `Unregister` or out of range).
    pub fn handle_landed(&mut self, now: Nanos, psn: u64) {
        self.handle_landed_many(now, &[psn])
    }

    /// [`Self::handle_landed`] for many chunks at once (what the receive
    /// workers landed since the driver last looked), settled once.
    pub fn handle_landed_many(&mut self, now: Nanos, psns: &[u64]) {
        self.input(now, |s| {
            let n = s.view.as_ref().map_or(0, |v| v.n);
            for &psn in psns {
                if !s.registered || s.unregistered || psn >= n {
                    s.core.stats.landed_ignored += 1;
                } else if s.set_bit(psn) {
                    s.core.stats.chunks_landed += 1;
                    s.last_landed = Some(now);
                } else {
                    s.core.stats.landed_again += 1;
                }
            }
        })
    }

    /// SP `sp` died: abort with `PeerFailed` if it is in the ring (once
    /// known). Its messages are ignored from now on; if it is the right
    /// neighbour, nobody reads this SP's buffers any more.
    pub fn handle_peer_lost(&mut self, now: Nanos, sp: SpId) {
        self.set_clock(now);
        if sp == self.core.me || !self.core.lost_sps.insert(sp) {
            return;
        }
        self.early.remove(&sp);
        if let Some(v) = &self.view {
            if v.right() == Some(sp) {
                self.right_lost = true;
            }
            if v.ring.contains(&sp) {
                self.enter_abort(Status::PeerFailed);
            }
        }
        self.settle();
    }

    /// Every local rank completed (or was lost before posting), no copy or
    /// multicast is in flight, and every action was polled. An SP none of
    /// whose ranks ever posts never finishes (the driver drops such
    /// instances with the job).
    pub fn is_finished(&self) -> bool {
        self.members.is_some()
            && self.core.completed + self.core.lost_unposted.len() == self.local.len()
            && self.core.copies.is_empty()
            && self.core.actions.is_empty()
    }

    pub(super) fn validate_post(&self, post: &Post<K>) -> Result<(), PostError> {
        let p = post.members.len();
        PostError::check_served(&post.members, post.rank, self.core.me)?;
        if post.root as usize >= p {
            return Err(PostError::RootOutOfRange {
                root: post.root,
                size: p,
            });
        }
        if self.members.as_ref().is_some_and(|m| *m != post.members) {
            return Err(PostError::MembersDisagree);
        }
        if self.core.ranks.contains_key(&post.rank) {
            return Err(PostError::DuplicatePost { rank: post.rank });
        }
        if self.core.lost_unposted.contains(&post.rank) {
            return Err(PostError::RankLost { rank: post.rank });
        }
        Ok(())
    }

    /// The first local post gives this SP its view; messages that came
    /// before are handled now.
    fn form_view(&mut self, post: &Post<K>) {
        let ring = build_ring(&post.members, post.root);
        let me = self.core.me;
        let pos = ring
            .iter()
            .position(|&s| s == me)
            .expect("we serve a member");
        let mtu = self.cfg.mtu;
        let n = post.len.div_ceil(mtu).max(1);
        let lost = ring.iter().any(|s| self.core.lost_sps.contains(s));
        let right_lost = {
            let k = ring.len();
            k > 1 && self.core.lost_sps.contains(&ring[(pos + 1) % k])
        };
        self.view = Some(View {
            root: post.root,
            len: post.len,
            mtu,
            subgroups: self.cfg.subgroups,
            ring,
            pos,
            n,
        });
        self.have = vec![0; n.div_ceil(64) as usize];
        self.right_lost = right_lost;
        if lost {
            self.enter_abort(Status::PeerFailed);
        }
        for (from, msgs) in std::mem::take(&mut self.early) {
            for m in msgs {
                // A peer's mistake: the message is dropped, as it would
                // have been had it come later.
                let _ = self.process(from, m);
            }
        }
    }

    /// Sets bit `psn`: whether it was clear.
    pub(super) fn set_bit(&mut self, psn: u64) -> bool {
        let (w, b) = ((psn / 64) as usize, psn % 64);
        if self.have[w] & (1 << b) != 0 {
            return false;
        }
        self.have[w] |= 1 << b;
        self.have_count += 1;
        if self.serve.as_ref().is_some_and(|r| in_runs(r, psn)) {
            self.serve_missing -= 1;
        }
        true
    }

    pub(super) fn has(&self, psn: u64) -> bool {
        self.have_count == self.view.as_ref().map_or(0, |v| v.n)
            || self.have[(psn / 64) as usize] & (1 << (psn % 64)) != 0
    }

    /// The runs of missing chunks.
    pub(super) fn missing(&self) -> Vec<(u64, u64)> {
        let n = self.view.as_ref().map_or(0, |v| v.n);
        let mut out = Vec::new();
        let mut i = 0;
        while i < n {
            if self.has(i) {
                i += 1;
                continue;
            }
            let first = i;
            while i < n && !self.has(i) {
                i += 1;
            }
            out.push((first, i));
        }
        out
    }

    pub(super) fn send(&mut self, to: SpId, msg: Msg<K>) {
        debug_assert_ne!(
            to, self.core.me,
            "the multicast bcast never messages itself"
        );
        if to != self.core.me && !self.core.lost_sps.contains(&to) {
            self.core.actions.push_back(Action::Send { to, msg });
        }
    }

    /// A copy (a zero-length one finishes at once, never reaching the
    /// driver): its id, or `None` for zero length.
    pub(super) fn start_copy(&mut self, kind: CopyKind, c: Copy<K>) -> Option<u64> {
        if c.len == 0 {
            return None;
        }
        let id = c.id.0;
        self.core.copies.insert(id, kind);
        self.core.actions.push_back(Action::Copy(c));
        Some(id)
    }
}

/// Whether `psn` is in one of `runs` (sorted, disjoint).
pub(crate) fn in_runs(runs: &[(u64, u64)], psn: u64) -> bool {
    let i = runs.partition_point(|&(_, b)| b <= psn);
    runs.get(i).is_some_and(|&(a, _)| a <= psn)
}
