//! The per-SP state of one instance, its constructor and its inputs.

use super::*;

#[derive(Clone, Debug)]
pub(super) struct LocalRank<K> {
    pub(super) send: K,
    pub(super) recv: K,
    /// Copies and multicasts reading its buffers.
    pub(super) reads: usize,
    /// Copies writing into its receive buffer.
    pub(super) writes: usize,
    pub(super) out: Outcome,
}

/// What a copy or multicast in flight does.
#[derive(Clone, Copy, Debug)]
pub(super) enum CopyKind {
    /// Local `block`'s send buffer into local `rank`'s receive buffer.
    Local {
        block: Rank,
        rank: Rank,
    },
    /// Acknowledged run `group` of the fetch into local `rank`: read from
    /// the neighbour (into the first local rank), or, `fan`, from the first
    /// local rank's receive buffer into another's.
    Fetch {
        group: usize,
        rank: Rank,
        fan: bool,
    },
    Multicast {
        block: Rank,
        psns: u64,
        bytes: u64,
    },
}

/// One SP's view: the shape, the ring and its place in it, its chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct View {
    pub(super) shape: Shape,
    pub(super) ring: Vec<SpId>,
    /// This SP's place in `ring` (0: the coordinator).
    pub(super) pos: usize,
    /// Chunks per block, and ranks (blocks).
    pub(super) n: u64,
    pub(super) p: u64,
    /// The SPs before and after this one in its chain.
    pub(super) chain_prev: Option<SpId>,
    pub(super) chain_next: Option<SpId>,
}

impl View {
    pub(super) fn new(members: &[SpId], me: SpId, shape_of: impl Fn(usize) -> Shape) -> View {
        let ring = build_ring(members);
        let k = ring.len();
        let pos = ring
            .iter()
            .position(|&s| s == me)
            .expect("we serve a member");
        let shape = shape_of(k);
        let (first, end) = chain_bounds(k, shape.chains as usize)
            .into_iter()
            .find(|&(a, b)| a <= pos && pos < b)
            .expect("every position is in a chain");
        View {
            n: shape.len.div_ceil(shape.mtu).max(1),
            p: members.len() as u64,
            chain_prev: (pos > first).then(|| ring[pos - 1]),
            chain_next: (pos + 1 < end).then(|| ring[pos + 1]),
            shape,
            ring,
            pos,
        }
    }

    pub(super) fn coordinator(&self) -> SpId {
        self.ring[0]
    }

    pub(super) fn is_coordinator(&self) -> bool {
        self.pos == 0
    }

    /// The left neighbour (the last for position 0); `None` alone.
    pub(super) fn left(&self) -> Option<SpId> {
        let k = self.ring.len();
        (k > 1).then(|| self.ring[(self.pos + k - 1) % k])
    }

    pub(super) fn right(&self) -> Option<SpId> {
        let k = self.ring.len();
        (k > 1).then(|| self.ring[(self.pos + 1) % k])
    }

    /// Global PSNs in all.
    pub(super) fn total(&self) -> u64 {
        self.p * self.n
    }

    /// Offset of global PSN `g` in a receive buffer (`g` may be the end of
    /// a range: the runs of consecutive PSNs are contiguous bytes).
    pub(super) fn at(&self, g: u64) -> u64 {
        let (b, i) = (g / self.n, g % self.n);
        b * self.shape.len + (i * self.shape.mtu).min(self.shape.len)
    }

    /// Bytes `[from, to)` of the receive buffer of PSNs `[a, e)`.
    pub(super) fn bytes(&self, (a, e): (u64, u64)) -> (u64, u64) {
        (self.at(a), self.at(e))
    }
}

/// One acknowledged run being fetched.
#[derive(Clone, Debug)]
pub(super) struct Group {
    pub(super) run: (u64, u64),
    /// Its bytes in a receive buffer (the copies').
    pub(super) bytes: (u64, u64),
    /// Copies of it in flight.
    pub(super) left: usize,
    /// The remote read is done; the fan-out to the other local ranks runs.
    pub(super) fanned: bool,
}

/// This SP's fetch from its left neighbour.
#[derive(Clone, Debug)]
pub(super) struct Fetch {
    pub(super) from: SpId,
    /// The ranges asked for.
    pub(super) ranges: Vec<(u64, u64)>,
    /// The acknowledged runs being copied.
    pub(super) groups: BTreeMap<usize, Group>,
    pub(super) next_group: usize,
    /// Copies in flight.
    pub(super) copies: usize,
}

/// The per-SP state machine of one multicast `Iallgather` instance.
///
/// Drive it like the other collectives: feed inputs through `handle_*`,
/// then drain `poll_action` and re-read `poll_timeout` after every input.
pub struct McastAllgather<K> {
    pub(super) core: Core<LocalRank<K>, CopyKind, Action<K>, Stats>,
    pub(super) cfg: Config,
    pub(super) members: Option<Vec<SpId>>,
    /// Ranks served here, ascending (known with `members`).
    pub(super) local: Vec<Rank>,
    pub(super) view: Option<View>,
    /// Messages that came before the view, per sender (bounded).
    pub(super) early: BTreeMap<SpId, Vec<Msg<K>>>,
    /// The abort began here (it is broadcast once the ring is known).
    pub(super) abort_local: bool,
    pub(super) registered: bool,
    pub(super) unregistered: bool,
    pub(super) ready_sent: bool,
    /// Coordinator: `Open` sent; others: `Open` came.
    pub(super) open_sent: bool,
    pub(super) open_seen: bool,
    /// Coordinator: SPs that sent a matching `Ready`.
    pub(super) ready_from: BTreeSet<SpId>,
    /// The barrier is complete (`Start` came, or sent by the coordinator).
    pub(super) started: bool,
    pub(super) start_seen: bool,
    pub(super) go_in: bool,
    pub(super) mcast_started: bool,
    pub(super) mcasts_in_flight: usize,
    pub(super) mcast_done: bool,
    /// Local copies not finished per local block.
    pub(super) block_left: BTreeMap<Rank, usize>,
    /// The bitmap and how many bits are set.
    pub(super) have: Vec<u64>,
    pub(super) have_count: u64,
    pub(super) deadline: Option<Nanos>,
    /// When a receive worker last landed a chunk new here (the cutoff waits
    /// while chunks keep landing).
    pub(super) last_landed: Option<Nanos>,
    pub(super) scanned: bool,
    pub(super) fetch: Option<Fetch>,
    /// The right neighbour's requested runs not acknowledged yet.
    pub(super) serve: Option<Vec<(u64, u64)>>,
    /// `serve` was just asked: what of it is here is looked up once.
    pub(super) serve_fresh: bool,
    /// Chunks of `serve` not acknowledged yet, and the runs of them that
    /// came in since the last acknowledgement (collected as bits are set, so
    /// that a landing costs a search of `serve`, not a scan of it).
    pub(super) serve_left: u64,
    pub(super) serve_ready: Vec<(u64, u64)>,
    pub(super) req_seen: bool,
    pub(super) acked_right: bool,
    pub(super) final_sent: bool,
    pub(super) final_from_right: bool,
    pub(super) right_lost: bool,
}

common_api!(McastAllgather, Msg<K>, settle = settle, own_timers);

impl<K: Clone + fmt::Debug + PartialEq> McastAllgather<K> {
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
        McastAllgather {
            core: Core::new(key, cfg.me),
            cfg,
            members: None,
            local: Vec::new(),
            view: None,
            early: BTreeMap::new(),
            abort_local: false,
            registered: false,
            unregistered: false,
            ready_sent: false,
            open_sent: false,
            open_seen: false,
            ready_from: BTreeSet::new(),
            started: false,
            start_seen: false,
            go_in: false,
            mcast_started: false,
            mcasts_in_flight: 0,
            mcast_done: false,
            block_left: BTreeMap::new(),
            have: Vec::new(),
            have_count: 0,
            deadline: None,
            last_landed: None,
            scanned: false,
            fetch: None,
            serve: None,
            serve_fresh: false,
            serve_left: 0,
            serve_ready: Vec::new(),
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

    /// The ring of SPs (coordinator first), once a local rank posted.
    pub fn ring(&self) -> Option<&[SpId]> {
        self.view.as_ref().map(|v| v.ring.as_slice())
    }

    /// This SP's chain neighbours `(before, after)`, once a local rank
    /// posted.
    pub fn chain_neighbours(&self) -> Option<(Option<SpId>, Option<SpId>)> {
        self.view.as_ref().map(|v| (v.chain_prev, v.chain_next))
    }

    /// Copies and multicasts started and not reported done.
    pub fn copies_in_flight(&self) -> usize {
        self.core.copies.len()
    }

    /// Every chunk of every block is in every local rank's receive buffer.
    pub fn has_all(&self) -> bool {
        self.view
            .as_ref()
            .is_some_and(|v| self.have_count == v.total())
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
        let mut st = LocalRank {
            send: post.send_key.clone(),
            recv: post.recv_key.clone(),
            reads: 0,
            writes: 0,
            out: Outcome::new(),
        };
        if let Some(status) = self.core.abort.status {
            st.out.set_error(status);
        }
        self.core.ranks.insert(post.rank, st);
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
                if v.shape.len != post.len {
                    self.enter_abort(Status::CountMismatch);
                }
            }
        }
        self.settle();
        Ok(())
    }

    /// The SP's receive workers landed global PSN `psn` in every local
    /// rank's receive buffer (ignored, counted, after `Unregister`, out of
    /// range, or of a local block).
    pub fn handle_landed(&mut self, now: Nanos, psn: u64) {
        self.handle_landed_many(now, &[psn])
    }

    /// [`Self::handle_landed`] for many chunks at once (what the receive
    /// workers landed since the driver last looked), settled once.
    pub fn handle_landed_many(&mut self, now: Nanos, psns: &[u64]) {
        self.input(now, |s| {
            let total = s.view.as_ref().map_or(0, |v| v.total());
            for &psn in psns {
                let own = s.is_local_psn(psn);
                if !s.registered || s.unregistered || psn >= total || own {
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

    fn validate_post(&self, post: &Post<K>) -> Result<(), PostError> {
        PostError::check_served(&post.members, post.rank, self.core.me)?;
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
        let cfg = self.cfg;
        let digest = members_digest(&post.members);
        let v = View::new(&post.members, self.core.me, |k| Shape {
            len: post.len,
            mtu: cfg.mtu,
            subgroups: cfg.subgroups,
            chains: match cfg.chains {
                0 => default_chains(k),
                m => (m as usize).min(k),
            } as u32,
            members: digest,
        });
        let lost = v.ring.iter().any(|s| self.core.lost_sps.contains(s));
        self.right_lost = v.right().is_some_and(|r| self.core.lost_sps.contains(&r));
        self.have = vec![0; v.total().div_ceil(64) as usize];
        self.view = Some(v);
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

    /// Whether global PSN `psn` is of a block of a local rank.
    pub(super) fn is_local_psn(&self, psn: u64) -> bool {
        match (&self.view, &self.members) {
            (Some(v), Some(m)) => m.get((psn / v.n) as usize) == Some(&self.core.me),
            _ => false,
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
        if !self.serve_fresh
            && self
                .serve
                .as_ref()
                .is_some_and(|r| crate::mcast_bcast::in_runs(r, psn))
        {
            match self.serve_ready.last_mut() {
                Some(run) if run.1 == psn => run.1 += 1,
                _ => self.serve_ready.push((psn, psn + 1)),
            }
        }
        true
    }

    pub(super) fn has(&self, psn: u64) -> bool {
        self.have_count == self.view.as_ref().map_or(0, |v| v.total())
            || self.have[(psn / 64) as usize] & (1 << (psn % 64)) != 0
    }

    /// The runs of `[a, e)` whose chunks are all here (`want`) or not.
    pub(super) fn runs(&self, (a, e): (u64, u64), want: bool) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut i = a;
        while i < e {
            if self.has(i) != want {
                i += 1;
                continue;
            }
            let first = i;
            while i < e && self.has(i) == want {
                i += 1;
            }
            out.push((first, i));
        }
        out
    }

    /// The runs of missing chunks of other SPs' blocks.
    pub(super) fn missing(&self) -> Vec<(u64, u64)> {
        let Some(v) = &self.view else {
            return Vec::new();
        };
        let members = self.members.as_ref().unwrap();
        let mut out: Vec<(u64, u64)> = Vec::new();
        for b in 0..v.p {
            if members[b as usize] == self.core.me {
                continue;
            }
            for (a, e) in self.runs((b * v.n, (b + 1) * v.n), false) {
                match out.last_mut() {
                    Some(last) if last.1 == a => last.1 = e,
                    _ => out.push((a, e)),
                }
            }
        }
        out
    }

    pub(super) fn send(&mut self, to: SpId, msg: Msg<K>) {
        debug_assert_ne!(
            to, self.core.me,
            "the multicast allgather never messages itself"
        );
        if to != self.core.me && !self.core.lost_sps.contains(&to) {
            self.core.actions.push_back(Action::Send { to, msg });
        }
    }

    /// A copy (a zero-length one finishes at once, never reaching the
    /// driver): whether it was emitted.
    pub(super) fn start_copy(&mut self, kind: CopyKind, c: Copy<K>) -> bool {
        if c.len == 0 {
            return false;
        }
        self.core.copies.insert(c.id.0, kind);
        self.core.actions.push_back(Action::Copy(c));
        true
    }
}
