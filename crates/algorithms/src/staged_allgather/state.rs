//! The per-SP state of one instance, its constructor and its inputs.

use super::*;

/// How a member SP receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Into each rank's buffer (`Key`s).
    Flat,
    /// Into its region (an owner, `Region`).
    Region,
    /// Its ranks read their owner's region (`Covered`).
    Covered,
}

/// A member SP as a target of this SP's writes and as a writer into this
/// SP's ranks.
#[derive(Clone, Debug)]
pub(super) struct Tgt<K> {
    /// How it receives; `None` until its first `Key`/`Region`/`Covered`.
    pub(super) mode: Option<Mode>,
    /// Hierarchical: (rank, shared key) of its region.
    pub(super) region: Option<(Rank, K)>,
    /// `epoch`: when `mode` became known; `in_flight`: this SP's writes
    /// into its ranks or region; hierarchical, `done` and `sent`: its
    /// region as a unit.
    pub(super) unit: UnitWrites,
    /// It reported `WrittenRegion` for this SP's region.
    pub(super) wrote_region: bool,
}

/// A comm rank as a flat target.
#[derive(Clone, Debug)]
pub(super) struct RankTgt<K> {
    pub(super) key: Option<K>,
    pub(super) unit: UnitWrites,
}

/// This SP's writes into one unit (a rank's receive buffer or an SP's
/// region).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct UnitWrites {
    /// When its key became known (see `Stats::writes_waited_for_key`).
    pub(super) epoch: u64,
    /// Writes in flight.
    pub(super) in_flight: u32,
    /// Chunks written, and whether `Written`/`WrittenRegion` went out.
    pub(super) done: u64,
    pub(super) sent: bool,
}

impl UnitWrites {
    /// Every one of `need` chunks is written and the unit not reported yet.
    pub(super) fn complete(&self, need: u64) -> bool {
        !self.sent && self.in_flight == 0 && self.done == need
    }
}

#[derive(Clone, Debug)]
pub(super) struct LocalRank<K> {
    pub(super) send_key: K,
    pub(super) recv_key: K,
    /// The post agrees with the view.
    pub(super) in_view: bool,
    pub(super) next_read: u64,
    pub(super) reads_in_flight: u32,
    pub(super) reads_done: u64,
    /// Flat: SPs that reported `Written` for it (this SP included).
    pub(super) written_from: BTreeSet<SpId>,
    pub(super) out: Outcome,
}

/// A chunk held in a slot, with the progress of its writes.
#[derive(Clone, Debug)]
pub(super) struct Held {
    pub(super) block: Rank,
    pub(super) chunk: u64,
    pub(super) len: u64,
    /// `epoch` when it was staged.
    pub(super) epoch: u64,
    /// Next entry of `View::order` to write.
    pub(super) cur: usize,
    /// Target SPs (indices into `View::sps`) of unknown mode, and flat
    /// ranks of unknown key, skipped by the cursor.
    pub(super) blocked_sps: BTreeSet<usize>,
    pub(super) blocked_ranks: BTreeSet<Rank>,
    /// Writes in flight.
    pub(super) writing: u32,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum CopyKind {
    Read {
        slot: usize,
        rank: Rank,
        chunk: u64,
        len: u64,
    },
    /// Into SP `sp` (index into `View::sps`): rank `rank`, or its region.
    Write {
        slot: usize,
        sp: usize,
        rank: Option<Rank>,
    },
}

#[derive(Clone, Copy, Debug)]
pub(super) enum Unit {
    Rank(Rank),
    Region(usize),
}

/// Abort notices to one SP.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Notice {
    pub(super) abort_sent: bool,
    pub(super) stopped_sent: bool,
}

/// The per-SP state machine of one staged `Iallgather` instance.
///
/// Drive it like the other collectives: feed inputs through `handle_*`,
/// then drain `poll_action` after every input.
pub struct StagedAllgather<K> {
    pub(super) core: Core<LocalRank<K>, CopyKind, Action<K>, Stats>,
    pub(super) chunk_bytes: u64,
    pub(super) view: Option<View>,
    /// Per member SP (index into `View::sps`).
    pub(super) tgts: Vec<Tgt<K>>,
    /// Per comm rank.
    pub(super) rtgts: Vec<RankTgt<K>>,
    /// The keys of `ranks`, in post order.
    pub(super) posted: Vec<Rank>,
    /// View-local ranks that posted (agreeing or not).
    pub(super) local_posted: usize,
    pub(super) slots: Slots<Held>,
    /// Local ranks with chunks left to read, in post order.
    pub(super) read_queue: VecDeque<Rank>,
    /// Bumped whenever a key becomes known.
    pub(super) epoch: u64,
    /// Resolved since the last pump: flat ranks, SPs (indices).
    pub(super) new_ranks: Vec<Rank>,
    pub(super) new_sps: Vec<usize>,
    pub(super) modes_unresolved: usize,
    pub(super) units_total: usize,
    pub(super) units_sent: usize,
    /// SPs (this one included) that wrote everything into this SP's region.
    pub(super) region_writers: usize,
    /// An owner: where its region starts in the node segment, and the
    /// covered SPs (indices) it sent `RegionDone`.
    pub(super) region_at: u64,
    pub(super) done_sent: BTreeSet<usize>,
    /// A covered SP: where its owner's region starts, after `RegionDone`.
    pub(super) region_done: Option<u64>,
    /// An owner: the SPs of its node (indices) that sent `Waiting`.
    pub(super) waiting_from: BTreeSet<usize>,
    pub(super) pending_written: BTreeMap<SpId, Vec<Rank>>,
    /// Keys and regions received before the view, in arrival order.
    pub(super) early: Vec<(SpId, Msg<K>)>,
    pub(super) early_seen: BTreeSet<(SpId, Option<Rank>)>,
    pub(super) contacts: BTreeSet<SpId>,
    pub(super) stopped_from: BTreeSet<SpId>,
    pub(super) notices: BTreeMap<SpId, Notice>,
    /// SPs still owed a `Stopped`.
    pub(super) notify_todo: BTreeSet<SpId>,
}

common_api!(StagedAllgather, Msg<K>, staged);

impl<K: Clone + fmt::Debug + PartialEq> StagedAllgather<K> {
    /// Create an instance; the driver may do so on the first event of any
    /// kind for `key`.
    pub fn new(key: CollKey, cfg: Config) -> Self {
        StagedAllgather {
            core: Core::new(key, cfg.me),
            chunk_bytes: cfg.chunk_bytes.max(1),
            view: None,
            tgts: Vec::new(),
            rtgts: Vec::new(),
            posted: Vec::new(),
            local_posted: 0,
            slots: Slots::new(cfg.staging_slots),
            read_queue: VecDeque::new(),
            epoch: 0,
            new_ranks: Vec::new(),
            new_sps: Vec::new(),
            modes_unresolved: 0,
            units_total: 0,
            units_sent: 0,
            region_writers: 0,
            region_at: 0,
            done_sent: BTreeSet::new(),
            region_done: None,
            waiting_from: BTreeSet::new(),
            pending_written: BTreeMap::new(),
            early: Vec::new(),
            early_seen: BTreeSet::new(),
            contacts: BTreeSet::new(),
            stopped_from: BTreeSet::new(),
            notices: BTreeMap::new(),
            notify_todo: BTreeSet::new(),
        }
    }

    /// The SP of each comm rank, once a local rank has posted.
    pub fn members(&self) -> Option<&[SpId]> {
        self.view.as_ref().map(|v| v.members.as_slice())
    }

    /// This SP's design, once a local rank has posted.
    pub fn design(&self) -> Option<Design> {
        self.view.as_ref().map(|v| v.design)
    }

    /// Hierarchical design: the SP whose region of the node segment this
    /// SP's ranks copy out of (this SP at an owner, the owner after its
    /// `RegionDone` at a covered SP), where the region starts and its
    /// length (`P * len`).
    pub fn segment_source(&self) -> Option<(SpId, u64, u64)> {
        let v = self.view.as_ref()?;
        let total = v.len * v.members.len() as u64;
        match self.tgts.get(v.mine)?.mode? {
            Mode::Region => Some((self.core.me, self.region_at, total)),
            Mode::Covered => Some((v.sps[v.owner[v.mine]], self.region_done?, total)),
            Mode::Flat => None,
        }
    }

    /// Copies started and not reported done.
    pub fn copies_in_flight(&self) -> usize {
        self.core.copies.len()
    }

    /// A local rank posted its part of the collective.
    pub fn handle_post(&mut self, now: Nanos, post: Post<K>) -> Result<(), PostError> {
        self.core.now = now;
        self.validate_post(&post)?;
        let rank = post.rank;
        let first = self.view.is_none();
        if first {
            let view = View::build(self.core.me, self.chunk_bytes, &post)?;
            self.form_view(view);
        }
        let v = self.view.as_ref().expect("formed above");
        let disagreement = if post.members != v.members
            || comm_digest(&post.members, &post.nodes) != v.digest
            || post.design != v.design
        {
            Some(Status::InvalidPost)
        } else if post.len != v.len {
            Some(Status::CountMismatch)
        } else {
            None
        };
        let in_view_local = v.members.get(rank as usize) == Some(&self.core.me);
        let (n, design) = (v.n, v.design);
        let mut st = LocalRank {
            send_key: post.send_key,
            recv_key: post.recv_key.clone(),
            in_view: disagreement.is_none(),
            next_read: 0,
            reads_in_flight: 0,
            reads_done: 0,
            written_from: BTreeSet::new(),
            out: Outcome::new(),
        };
        if let Some(status) = self.core.abort.status.or(disagreement) {
            st.out.set_error(status);
        }
        self.core.ranks.insert(rank, st);
        self.posted.push(rank);
        if in_view_local {
            self.local_posted += 1;
        }
        let (mine, owner) = {
            let v = self.view.as_ref().unwrap();
            (v.mine, v.is_owner())
        };
        if first && design == Design::Hier && owner {
            // This SP's region: the shared key of its first posted rank.
            self.tgts[mine].region = post.shared_key.clone().map(|k| (rank, k));
            self.region_at = post.shared_at;
        }
        // A hierarchical SP that is not its node's owner takes its mode from
        // the owner's announcement (`settle`).
        if first && (design == Design::Flat || owner) {
            let mode = match design {
                Design::Flat => Mode::Flat,
                Design::Hier => Mode::Region,
            };
            self.resolve_sp(mine, mode);
        }
        if let Some(status) = disagreement {
            self.enter_abort(status);
        } else if self.core.abort.is_none() {
            let v = self.view.as_ref().unwrap();
            let (len, comm) = (v.len, v.digest);
            let to = v.others(self.core.me);
            match self.tgts[mine].mode {
                Some(Mode::Flat) => self.share_rank_key(rank, post.recv_key, &to),
                Some(Mode::Region) if first => {
                    let key = post.shared_key.expect("checked");
                    for sp in to {
                        self.send(
                            sp,
                            Msg::Region {
                                rank,
                                len,
                                comm,
                                key: key.clone(),
                            },
                        );
                    }
                }
                _ => {}
            }
            if first && !owner {
                let v = self.view.as_ref().unwrap();
                let to = v.sps[v.owner[mine]];
                self.send(to, Msg::Waiting { len, comm });
            }
            if n > 0 {
                self.read_queue.push_back(rank);
            }
            self.on_local_posted();
        }
        self.pump();
        Ok(())
    }

    /// SP `sp` died: abort with `PeerFailed` if it is a member SP. Messages
    /// from `sp` are ignored from now on; it counts as stopped. Copies into
    /// its ranks still in flight must be reported by the driver.
    pub fn handle_peer_lost(&mut self, now: Nanos, sp: SpId) {
        self.core.now = now;
        if sp == self.core.me || !self.core.lost_sps.insert(sp) {
            return;
        }
        self.early.retain(|(f, _)| *f != sp);
        self.notify_todo.remove(&sp);
        if self.view.as_ref().is_some_and(|v| v.idx(sp).is_some()) {
            self.enter_abort(Status::PeerFailed);
        }
        self.pump();
    }

    /// Every local rank completed (or was lost before posting), no copy is
    /// in flight, no slot is in use, every action was polled, and either
    /// every `Written`/`WrittenRegion` went out or (aborted) every SP of the
    /// view and every SP heard from got `Stopped`. An SP none of whose
    /// ranks ever posts never finishes (the driver drops such instances
    /// with the job).
    pub fn is_finished(&self) -> bool {
        let Some(v) = &self.view else { return false };
        let tail = match self.core.abort.status {
            Some(_) => self.notify_todo.is_empty(),
            None => {
                self.modes_unresolved == 0
                    && self.units_sent == self.units_total
                    && self.pending_written.is_empty()
                    && self.owed_region_done().is_empty()
                    && (0..v.sps.len()).all(|b| {
                        b == v.mine || v.owner[b] != v.mine || self.waiting_from.contains(&b)
                    })
            }
        };
        self.core.completed == self.core.ranks.len()
            && self.local_posted + self.core.lost_unposted.len() >= v.local.len()
            && self.core.copies.is_empty()
            && self.slots.all_free()
            && self.core.actions.is_empty()
            && tail
    }
}

impl<K: Clone + fmt::Debug + PartialEq> StagedAllgather<K> {
    // ---- internals -------------------------------------------------------

    pub(super) fn validate_post(&self, post: &Post<K>) -> Result<(), PostError> {
        let p = post.members.len();
        let rank = post.rank;
        PostError::check_served(&post.members, rank, self.core.me)?;
        if post.nodes.len() != p {
            return Err(PostError::LengthMismatch {
                field: "nodes",
                len: post.nodes.len(),
                expected: p,
            });
        }
        sp_nodes(&post.members, &post.nodes).map_err(|sp| PostError::SpOnTwoNodes { sp })?;
        if post.len.checked_mul(p as u64).is_none() {
            return Err(PostError::Overflow { rank });
        }
        if self.core.ranks.contains_key(&rank) {
            return Err(PostError::DuplicatePost { rank });
        }
        if self.core.lost_unposted.contains(&rank) {
            return Err(PostError::RankLost { rank });
        }
        let owner = node_owner(&post.members, &post.nodes, self.core.me) == Some(self.core.me);
        if post.design == Design::Hier && owner && post.shared_key.is_none() {
            return Err(PostError::MissingSharedKey { rank });
        }
        Ok(())
    }

    /// This SP has a view for the first time.
    pub(super) fn form_view(&mut self, view: View) {
        let me = self.core.me;
        let p = view.members.len();
        self.tgts = (0..view.sps.len())
            .map(|_| Tgt {
                mode: None,
                region: None,
                unit: UnitWrites::default(),
                wrote_region: false,
            })
            .collect();
        self.rtgts = (0..p)
            .map(|_| RankTgt {
                key: None,
                unit: UnitWrites::default(),
            })
            .collect();
        self.modes_unresolved = view.sps.len();
        self.core
            .lost_unposted
            .retain(|&r| view.members.get(r as usize) == Some(&me));
        let lost = view.sps.iter().any(|s| self.core.lost_sps.contains(s));
        self.view = Some(view);
        if lost {
            self.enter_abort(Status::PeerFailed);
        }
        if self.core.abort.is_some() {
            self.schedule_notices();
        }
        for (from, msg) in std::mem::take(&mut self.early) {
            if self.on_announcement(from, msg).is_err() {
                self.enter_abort(Status::InvalidPost);
            }
        }
    }
}
