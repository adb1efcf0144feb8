//! Hierarchical, load-balanced `Allgatherv` progressed by service processes
//! (after NVIDIA's MIMOSA design). `Allgather` is the special case with
//! equal counts.
//!
//! One [`Allgatherv`] object exists per collective instance ([`CollKey`]) per
//! SP. Every SP serves ranks of exactly one node. The *segment* of comm rank
//! `s` is its send block; every rank needs every segment in its receive
//! buffer at its own displacement.
//!
//! # Protocol
//!
//! *Source side.* When rank `s` posts at SP `a` (node `n`), `a`
//! 1. sends `Announce` (address of `s`'s send buffer) to ONE SP on every
//!    other node that has members, nodes in ring order starting after `n`;
//!    the SP is chosen by `s`'s index among its node's ranks (plus the node
//!    number) modulo the node's SP count, which spreads sources evenly for
//!    block and cyclic layouts. The announcement carries the list of the
//!    target node's SPs, so it can be routed by SPs that have not seen a
//!    post yet;
//! 2. publishes the segment on its own node: `Segment` (holder `s`, its send
//!    buffer) to every SP of node `n`, itself included (internally).
//!
//! *Landing.* An SP holding an announcement (the target, or an SP it was
//! passed to) with a local rank that posted and has not completed picks the
//! one holding the fewest segments and copies the data there (the only
//! inter-node copy of segment `s` into this node). When the copy is done it
//! `Ack`s the announcing SP and publishes `Segment` (holder = that rank, its
//! receive buffer) to every SP of its node. Without a ready local rank:
//! * if it knows a ready sibling SP (see `RankReady`), it `Pass`es the
//!   announcement straight there;
//! * else it `Pass`es it to the next SP in the node's ring (the sorted list
//!   of the node's SPs); the pass carries how many SPs remain unvisited;
//! * the SP where the ring ends (every SP visited) *parks* it.
//!
//! `RankReady`: when an SP's first rank posts, it tells every other SP of
//! its node. An SP forwards everything it has parked to the first ready
//! sibling it hears of (and serves it itself if one of its own ranks posts
//! first), and from then on never parks. Completeness: an announcement is
//! always in exactly one place (in flight, landing, or parked at `x`); `x`
//! parks only while it knows no ready SP of its node; every SP that becomes
//! ready tells `x`; a ready SP stays ready until the collective completes
//! there (its ranks need this very segment), or aborts (then it acks).
//! So if any rank of the node ever posts, the announcement lands; if none
//! does, the collective aborts (rank loss) and the holder acks it.
//!
//! *Intra-node distribution.* Each SP copies every published segment of its
//! node into each of its ranks that needs it (all its ranks for a send
//! buffer segment, all but the holder for a landed one), as they post. When
//! all its ranks have it (or on abort, once its copies of it are done) it
//! sends `SegmentDone` to the holder's SP.
//!
//! *Completion.* A rank completes when its receive buffer has every segment
//! (or the instance aborted), no copy writes into it, every other node acked
//! its send buffer, and every SP of its node sent `SegmentDone` for every
//! segment it holds (send or receive buffer). Every announcement and every
//! `Segment` is answered exactly once (`Ack` / `SegmentDone`), also after an
//! abort (then without copying); answers to `Release` (below) are extra
//! `Ack`s.
//!
//! Failure handling follows [`crate::alltoallv`]: local abort, rank loss and
//! peer loss abort the instance and broadcast `Abort`; every SP that learns
//! of an abort re-broadcasts it once (the SP where it started may not know
//! the membership, and it is only contacted by some SPs); a lost SP's pending
//! `SegmentDone`s are dropped (its copies die with it, and `SegmentDone`s
//! are per SP, so no other SP's reads are covered by them).
//!
//! *Release after a peer loss.* When SP `d` of node `n` is lost, an unacked
//! announcement of a local source `s` to `n` may be at `d` (gone with it),
//! or at, or in a `Pass` to, a live SP of `n` (`d` may have passed it on
//! just before dying). The SP of `s` therefore sends `Release` to every live
//! SP of `n` and settles the ack (`s` stops waiting for `n`) only when every
//! one of them has acked since, or was lost too. An SP that gets `Release`
//! aborts, and answers with `Ack` at once unless a landing copy of `s` is
//! in flight there; then the `Ack` that the finished copy sends anyway is
//! the answer. Completeness: an `Ack` from a live SP `y` means either
//! (a) `y` finished the announcement (landing copy done or dropped): it is
//! in exactly one place, so it is gone for good, or (b) `y` answered
//! `Release`: `y` is aborted, has no landing copy of `s`, and an aborted SP
//! never starts one (`serve` runs only without an abort; every
//! announcement or pass reaching an aborted SP is acked without copying),
//! so a `Pass` still on its way to `y` is harmless. Only live SPs may read,
//! a lost SP is removed from every waiting set, and acks are created only
//! before the instance aborts (a post after the abort announces nothing),
//! so once the set is empty no SP will read `s`'s send buffer for `n`.
//! Late or duplicate acks (e.g. a parked announcement acked by the abort,
//! then the `Release` answer) are ignored.
//!
//! Count mismatches (a rank's `recv_counts[s]` differs from `s`'s send
//! length) abort the instance with `CountMismatch`; a failed copy aborts it
//! with the copy's status.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::abort::{fail_pending, lose_rank, Abort, Outcome};
use crate::common::common_api;
use crate::common::sp_nodes;
use crate::{CollKey, Nanos, Rank, SpId, Status};

/// Static configuration of one instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Config {
    /// The SP running this instance.
    pub me: SpId,
}

/// What one local rank posted (sizes in bytes, already checked by the
/// driver against the rank's buffers). The SPs of each node are derived
/// from `members` and `nodes`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Post<K> {
    pub rank: Rank,
    /// SP serving each comm rank; its length is the comm size P.
    pub members: Vec<SpId>,
    /// Node of each comm rank.
    pub nodes: Vec<u32>,
    pub send_key: K,
    /// The send block starts at offset 0 of `send_key`.
    pub send_len: u64,
    pub recv_key: K,
    pub recv_counts: Vec<u64>,
    pub recv_displs: Vec<u64>,
}

/// SP-to-SP messages of this collective (the driver adds the `CollKey`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg<K> {
    /// `src`'s segment is at (`key`, `offset`, `len`); land it on `node`
    /// (whose SPs are `node_sps`); ack to `origin` (the SP of `src`).
    Announce {
        src: Rank,
        origin: SpId,
        key: K,
        offset: u64,
        len: u64,
        node: u32,
        node_sps: Vec<SpId>,
    },
    /// An announcement passed between SPs of its node. `remaining`: SPs of
    /// the ring still to visit after the receiver (0: park if not ready).
    /// `parked`: it was parked before.
    Pass {
        src: Rank,
        origin: SpId,
        key: K,
        offset: u64,
        len: u64,
        node: u32,
        node_sps: Vec<SpId>,
        remaining: u32,
        parked: bool,
    },
    /// The announcement of `src` to `node` is done with.
    Ack {
        src: Rank,
        node: u32,
        status: Status,
    },
    /// The sender has a posted rank (sent once, to the node's other SPs).
    RankReady,
    /// `src`'s segment is on this node in `holder`'s buffer (`from_send`:
    /// its send buffer, else its receive buffer), served by `holder_sp`.
    Segment {
        src: Rank,
        holder: Rank,
        holder_sp: SpId,
        key: K,
        offset: u64,
        len: u64,
        from_send: bool,
    },
    /// The sender's ranks will not read `src`'s segment from its holder any
    /// more.
    SegmentDone { src: Rank, status: Status },
    /// The collective failed; stop and complete everyone with `status`.
    Abort { status: Status },
    /// Sent by the SP of `src` to every live SP of `node` after an SP of
    /// `node` was lost while `src`'s announcement there was unacked: the
    /// receiver aborts with `status` (so it never starts a landing copy
    /// again) and answers with `Ack { src, node }` once no landing copy of
    /// `src` is in flight there.
    Release {
        src: Rank,
        node: u32,
        status: Status,
    },
}

impl<K> Msg<K> {
    /// The memory keys the message carries (an SP checks where a peer's keys point).
    pub fn keys(&self) -> Vec<&K> {
        match self {
            Msg::Announce { key, .. } | Msg::Pass { key, .. } | Msg::Segment { key, .. } => {
                vec![key]
            }
            Msg::Ack { .. }
            | Msg::RankReady
            | Msg::SegmentDone { .. }
            | Msg::Abort { .. }
            | Msg::Release { .. } => Vec::new(),
        }
    }
}

/// Identifies a copy within one instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CopyId(pub u64);

/// Copy `len` bytes of segment `seg` from `src_rank`'s buffer (`src_key`:
/// its send buffer, or its receive buffer holding `seg`) into `dst_rank`'s
/// receive buffer (`dst_rank` is always served by this SP).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copy<K> {
    pub id: CopyId,
    pub seg: Rank,
    pub src_rank: Rank,
    pub src_key: K,
    pub src_offset: u64,
    pub dst_rank: Rank,
    pub dst_key: K,
    pub dst_offset: u64,
    pub len: u64,
}

/// Output of the state machine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action<K> {
    /// Send `msg` to SP `to` (never this SP itself).
    Send { to: SpId, msg: Msg<K> },
    /// Start this copy and report it with `handle_copy_done`.
    Copy(Copy<K>),
    /// Local `rank` is done; emitted exactly once per posted rank.
    Complete { rank: Rank, status: Status },
}

/// A rejected post; the instance is unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PostError {
    RankOutOfRange {
        rank: Rank,
        size: usize,
    },
    NotMine {
        rank: Rank,
        served_by: SpId,
    },
    LengthMismatch {
        field: &'static str,
        len: usize,
        expected: usize,
    },
    /// `members`/`nodes` differ from an earlier post of this instance.
    MembersDisagree,
    /// One SP serves ranks on two nodes.
    SpOnTwoNodes {
        sp: SpId,
    },
    DuplicatePost {
        rank: Rank,
    },
    RankLost {
        rank: Rank,
    },
    /// `recv_displs[index] + recv_counts[index]` overflows `u64`.
    Overflow {
        rank: Rank,
        index: usize,
    },
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PostError::RankOutOfRange { rank, size } => {
                write!(f, "rank {rank} out of range for comm size {size}")
            }
            PostError::NotMine { rank, served_by } => {
                write!(f, "rank {rank} is served by SP {served_by}, not this SP")
            }
            PostError::LengthMismatch {
                field,
                len,
                expected,
            } => write!(f, "{field} has {len} entries, comm size is {expected}"),
            PostError::MembersDisagree => {
                write!(f, "members/nodes differ from an earlier post")
            }
            PostError::SpOnTwoNodes { sp } => write!(f, "SP {sp} serves ranks on two nodes"),
            PostError::DuplicatePost { rank } => write!(f, "rank {rank} posted twice"),
            PostError::RankLost { rank } => write!(f, "rank {rank} was declared lost"),
            PostError::Overflow { rank, index } => {
                write!(
                    f,
                    "rank {rank}: receive displacement+count overflows at {index}"
                )
            }
        }
    }
}

impl std::error::Error for PostError {}

/// A protocol violation by a peer; the instance is unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MsgError {
    RankOutOfRange {
        rank: Rank,
        size: usize,
    },
    /// The message names an SP that does not serve `rank`.
    WrongSp {
        rank: Rank,
        got: SpId,
    },
    /// An announcement for another node than this SP's.
    WrongNode {
        node: u32,
    },
    NotMember {
        sp: SpId,
    },
    Duplicate {
        src: Rank,
    },
    Unexpected {
        src: Rank,
    },
    Overflow {
        src: Rank,
    },
}

impl fmt::Display for MsgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

impl std::error::Error for MsgError {}

/// Counters for drivers, tests and the simulator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Announcements that found no ready local rank at their target SP.
    pub no_ready_rank: u64,
    /// Of those, served by another SP of the node without being parked
    /// (the pass path; counted at the serving SP).
    pub served_after_pass: u64,
    /// Announcements parked (the node's pending list).
    pub parked: u64,
    /// Total time announcements spent parked (ns of `now`).
    pub parked_wait_ns: u64,
    /// `handle_copy_done` calls for unknown copy ids (ignored).
    pub unknown_copy_done: u64,
    /// Messages ignored because their sender was declared lost.
    pub ignored_from_lost_sp: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Have {
    Missing,
    Copying,
    Done,
}

#[derive(Clone, Debug)]
struct LocalRank<K> {
    recv_key: K,
    recv_counts: Vec<u64>,
    recv_displs: Vec<u64>,
    have: Vec<Have>,
    recv_pending: usize,
    /// Copies writing into this rank's receive buffer.
    writes: usize,
    /// Outstanding readers of its buffers: pending remote acks plus pending
    /// `SegmentDone`s for segments it holds.
    readers: usize,
    /// Segments held (landed here).
    held: usize,
    out: Outcome,
}

/// An announcement waiting at this SP.
#[derive(Clone, Debug)]
struct Ann<K> {
    src: Rank,
    origin: SpId,
    key: K,
    offset: u64,
    len: u64,
    node: u32,
    node_sps: Vec<SpId>,
    since: Nanos,
}

/// A segment available on this node, as seen by this SP.
#[derive(Clone, Debug)]
struct Seg<K> {
    holder: Rank,
    holder_sp: SpId,
    key: K,
    offset: u64,
    len: u64,
    from_send: bool,
    copying: usize,
    done_sent: bool,
}

#[derive(Clone, Debug)]
struct Topo {
    members: Vec<SpId>,
    nodes: Vec<u32>,
    my_node: u32,
    /// Nodes with members, sorted.
    node_list: Vec<u32>,
    node_sps: BTreeMap<u32, Vec<SpId>>,
    /// Index of each rank among its node's ranks (ascending comm rank).
    node_index: Vec<u32>,
    local: Vec<Rank>,
}

impl Topo {
    fn build(me: SpId, members: &[SpId], nodes: &[u32]) -> Result<Topo, PostError> {
        let sp_node = sp_nodes(members, nodes).map_err(|sp| PostError::SpOnTwoNodes { sp })?;
        let mut node_sps: BTreeMap<u32, BTreeSet<SpId>> = BTreeMap::new();
        let mut counts: BTreeMap<u32, u32> = BTreeMap::new();
        let mut node_index = Vec::with_capacity(members.len());
        for (&sp, &n) in members.iter().zip(nodes) {
            node_sps.entry(n).or_default().insert(sp);
            let c = counts.entry(n).or_insert(0);
            node_index.push(*c);
            *c += 1;
        }
        Ok(Topo {
            members: members.to_vec(),
            nodes: nodes.to_vec(),
            my_node: sp_node[&me],
            node_list: node_sps.keys().copied().collect(),
            node_sps: node_sps
                .into_iter()
                .map(|(n, s)| (n, s.into_iter().collect()))
                .collect(),
            node_index,
            local: (0..members.len() as Rank)
                .filter(|&r| members[r as usize] == me)
                .collect(),
        })
    }

    fn my_sps(&self) -> &[SpId] {
        &self.node_sps[&self.my_node]
    }
}

enum CopyKind {
    /// Inter-node landing of `src` into local `holder`.
    Land { ann: Ann<()>, holder: Rank },
    /// Intra-node distribution of segment `seg` into local `dst`.
    Dist { seg: Rank, dst: Rank },
}

/// The per-SP state machine of one hierarchical `Allgatherv` instance.
pub struct Allgatherv<K> {
    key: CollKey,
    me: SpId,
    topo: Option<Topo>,
    ranks: BTreeMap<Rank, LocalRank<K>>,
    completed: usize,
    lost_unposted: BTreeSet<Rank>,
    /// Announcements parked here.
    parked: Vec<Ann<K>>,
    /// Sibling SPs known to have a posted rank.
    ready_siblings: BTreeSet<SpId>,
    ready_sent: bool,
    /// Segments on this node, by source rank.
    segs: BTreeMap<Rank, Seg<K>>,
    /// Segments held by local ranks: src -> (holder, SPs owing SegmentDone).
    held: BTreeMap<Rank, (Rank, BTreeSet<SpId>)>,
    /// Remote acks owed to local source ranks: (src, node).
    acks: BTreeSet<(Rank, u32)>,
    /// Acks being released after a peer loss: the live SPs of the node
    /// that have not acked yet.
    releasing: BTreeMap<(Rank, u32), BTreeSet<SpId>>,
    /// Acks settled after a peer loss (a late ack for them is ignored).
    settled: BTreeSet<(Rank, u32)>,
    /// Announcements received (to detect duplicates).
    announced: BTreeSet<Rank>,
    copies: BTreeMap<u64, CopyKind>,
    next_copy: u64,
    abort: Abort,
    abort_local: bool,
    lost_sps: BTreeSet<SpId>,
    actions: VecDeque<Action<K>>,
    internal: VecDeque<Msg<K>>,
    now: Nanos,
    stats: Stats,
}

common_api!(Allgatherv);

impl<K: Clone + fmt::Debug + PartialEq> Allgatherv<K> {
    /// Create an instance; the driver may do so on the first event of any
    /// kind for `key`.
    pub fn new(key: CollKey, cfg: Config) -> Self {
        Allgatherv {
            key,
            me: cfg.me,
            topo: None,
            ranks: BTreeMap::new(),
            completed: 0,
            lost_unposted: BTreeSet::new(),
            parked: Vec::new(),
            ready_siblings: BTreeSet::new(),
            ready_sent: false,
            segs: BTreeMap::new(),
            held: BTreeMap::new(),
            acks: BTreeSet::new(),
            releasing: BTreeMap::new(),
            settled: BTreeSet::new(),
            announced: BTreeSet::new(),
            copies: BTreeMap::new(),
            next_copy: 0,
            abort: Abort::default(),
            abort_local: false,
            lost_sps: BTreeSet::new(),
            actions: VecDeque::new(),
            internal: VecDeque::new(),
            now: 0,
            stats: Stats::default(),
        }
    }

    /// The SP of each comm rank, once a local rank has posted.
    pub fn members(&self) -> Option<&[SpId]> {
        self.topo.as_ref().map(|t| t.members.as_slice())
    }

    pub fn copies_in_flight(&self) -> usize {
        self.copies.len()
    }

    /// Announcements currently parked here.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// A local rank posted its part of the collective.
    pub fn handle_post(&mut self, now: Nanos, post: Post<K>) -> Result<(), PostError> {
        self.now = now;
        self.validate_post(&post)?;
        if self.topo.is_none() {
            let topo = Topo::build(self.me, &post.members, &post.nodes)?;
            self.learn_topology(topo);
        }
        let p = post.members.len();
        let rank = post.rank;
        let mut st = LocalRank {
            recv_key: post.recv_key,
            recv_counts: post.recv_counts,
            recv_displs: post.recv_displs,
            have: vec![Have::Missing; p],
            recv_pending: p,
            writes: 0,
            readers: 0,
            held: 0,
            out: Outcome::new(),
        };
        if let Some(status) = self.abort.status {
            st.out.set_error(status);
            self.ranks.insert(rank, st);
            self.check_complete(rank);
            self.run_internal();
            return Ok(());
        }
        let mismatch = st.recv_counts[rank as usize] != post.send_len;
        let topo = self.topo.as_ref().expect("topology known");
        let my_node = topo.my_node;
        let r = rank as usize;
        // Announcements to the other nodes, ring order after this node.
        let pos = topo.node_list.iter().position(|&n| n == my_node).unwrap();
        let k = topo.node_list.len();
        let mut sends = Vec::new();
        for i in 1..k {
            let n = topo.node_list[(pos + i) % k];
            let sps = &topo.node_sps[&n];
            let to = sps[(topo.node_index[r] as usize + n as usize) % sps.len()];
            sends.push((
                to,
                n,
                Msg::Announce {
                    src: rank,
                    origin: self.me,
                    key: post.send_key.clone(),
                    offset: 0,
                    len: post.send_len,
                    node: n,
                    node_sps: sps.clone(),
                },
            ));
        }
        let my_sps = topo.my_sps().to_vec();
        st.readers = sends.len() + my_sps.len();
        self.ranks.insert(rank, st);
        for (to, n, msg) in sends {
            self.acks.insert((rank, n));
            self.send(to, msg);
        }
        self.held
            .insert(rank, (rank, my_sps.iter().copied().collect()));
        for &sp in &my_sps {
            self.send(
                sp,
                Msg::Segment {
                    src: rank,
                    holder: rank,
                    holder_sp: self.me,
                    key: post.send_key.clone(),
                    offset: 0,
                    len: post.send_len,
                    from_send: true,
                },
            );
        }
        if !self.ready_sent {
            self.ready_sent = true;
            for &sp in &my_sps {
                if sp != self.me {
                    self.send(sp, Msg::RankReady);
                }
            }
        }
        self.run_internal();
        // Segments already known on this node.
        let known: Vec<Rank> = self.segs.keys().copied().collect();
        for s in known {
            self.dist_one(s, rank);
        }
        // Parked announcements can be served now.
        for ann in std::mem::take(&mut self.parked) {
            self.stats.parked_wait_ns += now.saturating_sub(ann.since);
            self.serve(ann);
        }
        if mismatch {
            self.enter_abort(Status::CountMismatch, true);
        }
        self.run_internal();
        self.check_complete(rank);
        Ok(())
    }

    /// A message from SP `from` for this instance.
    pub fn handle_msg(&mut self, now: Nanos, from: SpId, msg: Msg<K>) -> Result<(), MsgError> {
        self.now = now;
        let res = self.process(from, msg);
        self.run_internal();
        res
    }

    /// The copy `id` finished with `status`.
    pub fn handle_copy_done(&mut self, now: Nanos, id: CopyId, status: Status) {
        self.now = now;
        let Some(kind) = self.copies.remove(&id.0) else {
            self.stats.unknown_copy_done += 1;
            return;
        };
        if !status.is_ok() {
            self.enter_abort(status, true);
        }
        match kind {
            CopyKind::Land { ann, holder } => {
                let st = self.ranks.get_mut(&holder).expect("holder posted");
                st.writes -= 1;
                st.out.set_error(status);
                let s = ann.src as usize;
                st.have[s] = Have::Done;
                st.recv_pending -= 1;
                let ack = self.abort.status.unwrap_or(Status::Ok);
                self.send(
                    ann.origin,
                    Msg::Ack {
                        src: ann.src,
                        node: ann.node,
                        status: ack,
                    },
                );
                if self.abort.is_none() {
                    self.publish(ann.src, holder, ann.len);
                }
                self.check_complete(holder);
            }
            CopyKind::Dist { seg, dst } => {
                if let Some(st) = self.ranks.get_mut(&dst) {
                    st.writes -= 1;
                    st.out.set_error(status);
                    st.have[seg as usize] = Have::Done;
                    st.recv_pending -= 1;
                }
                if let Some(e) = self.segs.get_mut(&seg) {
                    e.copying -= 1;
                }
                self.check_seg(seg);
                self.check_complete(dst);
            }
        }
        self.run_internal();
    }

    /// SP `sp` died: abort with `PeerFailed` if it serves a member; its
    /// pending `SegmentDone`s are dropped and the live SPs of its node are
    /// asked to `Release` the announcements still unacked there. Messages
    /// from `sp` are ignored from now on.
    pub fn handle_peer_lost(&mut self, now: Nanos, sp: SpId) {
        self.now = now;
        if sp == self.me || !self.lost_sps.insert(sp) {
            return;
        }
        self.ready_siblings.remove(&sp);
        if self.topo.is_none() {
            return; // applied when the topology becomes known
        }
        self.apply_peer_lost(sp);
        self.run_internal();
    }

    /// Local abort; `Status::Ok` becomes `Status::Aborted`.
    pub fn abort(&mut self, now: Nanos, status: Status) {
        self.now = now;
        self.enter_abort(status, true);
        self.run_internal();
    }

    /// Local host `rank` died: aborts with `RankFailed` unless it completed.
    pub fn handle_rank_lost(&mut self, now: Nanos, rank: Rank) {
        self.now = now;
        if let Some(t) = &self.topo {
            if t.members.get(rank as usize) != Some(&self.me) {
                return;
            }
        }
        let out = self.ranks.get_mut(&rank).map(|st| &mut st.out);
        if !lose_rank(out, &mut self.lost_unposted, rank) {
            return;
        }
        self.enter_abort(Status::RankFailed, true);
        self.run_internal();
    }

    /// Every local rank completed (or was lost before posting), nothing is
    /// in flight, parked or owed, and every action was polled.
    pub fn is_finished(&self) -> bool {
        self.topo
            .as_ref()
            .is_some_and(|t| self.completed + self.lost_unposted.len() == t.local.len())
            && self.copies.is_empty()
            && self.parked.is_empty()
            && self.segs.values().all(|e| e.done_sent)
            && self.actions.is_empty()
    }

    // ---- internals -------------------------------------------------------

    fn validate_post(&self, post: &Post<K>) -> Result<(), PostError> {
        let p = post.members.len();
        let rank = post.rank;
        if rank as usize >= p {
            return Err(PostError::RankOutOfRange { rank, size: p });
        }
        let served_by = post.members[rank as usize];
        if served_by != self.me {
            return Err(PostError::NotMine { rank, served_by });
        }
        for (field, len) in [
            ("nodes", post.nodes.len()),
            ("recv_counts", post.recv_counts.len()),
            ("recv_displs", post.recv_displs.len()),
        ] {
            if len != p {
                return Err(PostError::LengthMismatch {
                    field,
                    len,
                    expected: p,
                });
            }
        }
        if let Some(t) = &self.topo {
            if t.members != post.members || t.nodes != post.nodes {
                return Err(PostError::MembersDisagree);
            }
        } else {
            Topo::build(self.me, &post.members, &post.nodes)?;
        }
        if self.ranks.contains_key(&rank) {
            return Err(PostError::DuplicatePost { rank });
        }
        if self.lost_unposted.contains(&rank) {
            return Err(PostError::RankLost { rank });
        }
        if let Some(index) = (0..p).find(|&i| {
            post.recv_displs[i]
                .checked_add(post.recv_counts[i])
                .is_none()
        }) {
            return Err(PostError::Overflow { rank, index });
        }
        Ok(())
    }

    fn learn_topology(&mut self, topo: Topo) {
        let me = self.me;
        self.lost_unposted
            .retain(|&r| topo.members.get(r as usize) == Some(&me));
        let lost: Vec<SpId> = self.lost_sps.iter().copied().collect();
        self.topo = Some(topo);
        for sp in lost {
            self.apply_peer_lost(sp);
        }
        if self.abort.is_some() {
            self.maybe_broadcast_abort();
        }
    }

    fn apply_peer_lost(&mut self, sp: SpId) {
        let topo = self.topo.as_ref().expect("topology known");
        if !topo.members.contains(&sp) {
            return;
        }
        let lost_node = topo
            .node_sps
            .iter()
            .find(|(_, sps)| sps.contains(&sp))
            .map(|(&n, _)| n);
        let mut released = Vec::new();
        for (_, (holder, pending)) in self.held.iter_mut() {
            if pending.remove(&sp) {
                released.push(*holder);
            }
        }
        // Pending acks from the lost SP's node: the announcement may be at
        // the lost SP (gone with it) or at, or on its way to, a live SP of
        // that node. Ask every live SP of the node to release it.
        let mut settle = Vec::new();
        let mut ask = Vec::new();
        if let Some(n) = lost_node {
            let live: BTreeSet<SpId> = topo.node_sps[&n]
                .iter()
                .filter(|s| !self.lost_sps.contains(s))
                .copied()
                .collect();
            for &a in self.acks.iter().filter(|&&(_, m)| m == n) {
                match self.releasing.get_mut(&a) {
                    Some(waiting) => {
                        waiting.remove(&sp);
                        if waiting.is_empty() {
                            settle.push(a);
                        }
                    }
                    None if live.is_empty() => settle.push(a),
                    None => {
                        self.releasing.insert(a, live.clone());
                        ask.push((a, live.clone()));
                    }
                }
            }
        }
        for r in released {
            if let Some(st) = self.ranks.get_mut(&r) {
                st.readers -= 1;
            }
        }
        self.enter_abort(Status::PeerFailed, true);
        let status = self.abort.status.expect("aborted");
        for ((src, node), live) in ask {
            for to in live {
                self.send(to, Msg::Release { src, node, status });
            }
        }
        for a in settle {
            self.settle(a);
        }
    }

    /// No live SP will read the send buffer of `a.0` for node `a.1` any
    /// more.
    fn settle(&mut self, a: (Rank, u32)) {
        self.acks.remove(&a);
        self.releasing.remove(&a);
        self.settled.insert(a);
        if let Some(st) = self.ranks.get_mut(&a.0) {
            st.readers -= 1;
        }
        self.check_complete(a.0);
    }

    fn send(&mut self, to: SpId, msg: Msg<K>) {
        if to == self.me {
            self.internal.push_back(msg);
        } else if !self.lost_sps.contains(&to) {
            self.actions.push_back(Action::Send { to, msg });
        }
    }

    fn run_internal(&mut self) {
        while let Some(msg) = self.internal.pop_front() {
            let me = self.me;
            let res = self.process(me, msg);
            debug_assert!(res.is_ok(), "internal message rejected: {res:?}");
        }
    }

    fn size(&self) -> usize {
        self.topo.as_ref().map_or(0, |t| t.members.len())
    }

    fn check_rank(&self, rank: Rank) -> Result<(), MsgError> {
        let size = self.size();
        if rank as usize >= size {
            return Err(MsgError::RankOutOfRange { rank, size });
        }
        Ok(())
    }

    fn process(&mut self, from: SpId, msg: Msg<K>) -> Result<(), MsgError> {
        if self.lost_sps.contains(&from) {
            self.stats.ignored_from_lost_sp += 1;
            return Ok(());
        }
        match msg {
            Msg::Announce {
                src,
                origin,
                key,
                offset,
                len,
                node,
                node_sps,
            } => {
                if origin != from {
                    return Err(MsgError::WrongSp {
                        rank: src,
                        got: from,
                    });
                }
                let ann = Ann {
                    src,
                    origin,
                    key,
                    offset,
                    len,
                    node,
                    node_sps,
                    since: self.now,
                };
                self.on_announce(ann, None)
            }
            Msg::Pass {
                src,
                origin,
                key,
                offset,
                len,
                node,
                node_sps,
                remaining,
                parked,
            } => {
                let ann = Ann {
                    src,
                    origin,
                    key,
                    offset,
                    len,
                    node,
                    node_sps,
                    since: self.now,
                };
                self.on_announce(ann, Some((remaining, parked)))
            }
            Msg::Ack { src, node, status } => {
                if self.settled.contains(&(src, node)) {
                    return Ok(()); // settled on a peer loss; late but fine
                }
                if self.topo.is_none() || !self.acks.contains(&(src, node)) {
                    return Err(MsgError::Unexpected { src });
                }
                if let Some(waiting) = self.releasing.get_mut(&(src, node)) {
                    // Either `from` finished with the announcement or it
                    // answers our `Release`: it will not read again.
                    if waiting.remove(&from) && waiting.is_empty() {
                        self.settle((src, node));
                    }
                    if let Some(st) = self.ranks.get_mut(&src) {
                        st.out.set_error(status);
                    }
                    return Ok(());
                }
                self.acks.remove(&(src, node));
                let st = self.ranks.get_mut(&src).expect("ack for a posted rank");
                st.readers -= 1;
                st.out.set_error(status);
                self.check_complete(src);
                Ok(())
            }
            Msg::RankReady => {
                if from != self.me {
                    self.ready_siblings.insert(from);
                    if self.ranks.is_empty() {
                        for mut ann in std::mem::take(&mut self.parked) {
                            self.stats.parked_wait_ns += self.now.saturating_sub(ann.since);
                            ann.since = self.now;
                            self.pass(from, ann, 0, true);
                        }
                    }
                }
                Ok(())
            }
            Msg::Segment {
                src,
                holder,
                holder_sp,
                key,
                offset,
                len,
                from_send,
            } => {
                if self.segs.contains_key(&src) {
                    return Err(MsgError::Duplicate { src });
                }
                if self.topo.is_some() {
                    self.check_rank(src)?;
                    self.check_rank(holder)?;
                }
                if offset.checked_add(len).is_none() {
                    return Err(MsgError::Overflow { src });
                }
                self.segs.insert(
                    src,
                    Seg {
                        holder,
                        holder_sp,
                        key,
                        offset,
                        len,
                        from_send,
                        copying: 0,
                        done_sent: false,
                    },
                );
                if self.abort.is_some() {
                    if self.topo.is_none() {
                        self.notify_abort(holder_sp);
                    }
                } else {
                    let locals: Vec<Rank> = self.ranks.keys().copied().collect();
                    for r in locals {
                        self.dist_one(src, r);
                    }
                }
                self.check_seg(src);
                Ok(())
            }
            Msg::SegmentDone { src, status } => {
                let Some((holder, pending)) = self.held.get_mut(&src) else {
                    return Err(MsgError::Unexpected { src });
                };
                if !pending.remove(&from) {
                    return Err(MsgError::Unexpected { src });
                }
                let holder = *holder;
                let st = self.ranks.get_mut(&holder).expect("holder posted");
                st.readers -= 1;
                st.out.set_error(status);
                self.check_complete(holder);
                Ok(())
            }
            Msg::Release { src, node, status } => {
                if let Some(t) = &self.topo {
                    self.check_rank(src)?;
                    if t.members[src as usize] != from {
                        return Err(MsgError::WrongSp {
                            rank: src,
                            got: from,
                        });
                    }
                    if t.my_node != node || t.nodes[src as usize] == node {
                        return Err(MsgError::WrongNode { node });
                    }
                }
                // From now on no landing copy starts here (an aborted SP
                // acks every announcement without copying).
                self.enter_abort(status, true);
                let landing = self
                    .copies
                    .values()
                    .any(|k| matches!(k, CopyKind::Land { ann, .. } if ann.src == src));
                if !landing {
                    let status = self.abort.status.expect("aborted");
                    self.send(from, Msg::Ack { src, node, status });
                }
                // Else the landing copy acks `from` when it finishes.
                Ok(())
            }
            Msg::Abort { status } => {
                if let Some(t) = &self.topo {
                    if !t.members.contains(&from) {
                        return Err(MsgError::NotMember { sp: from });
                    }
                }
                // Re-broadcast: the SP where the abort started may not know
                // the membership (a rank lost before any local post).
                self.enter_abort(status, true);
                Ok(())
            }
        }
    }

    /// An announcement (or pass) arrived here.
    fn on_announce(&mut self, ann: Ann<K>, pass: Option<(u32, bool)>) -> Result<(), MsgError> {
        if ann.offset.checked_add(ann.len).is_none() {
            return Err(MsgError::Overflow { src: ann.src });
        }
        if !ann.node_sps.contains(&self.me) {
            return Err(MsgError::WrongNode { node: ann.node });
        }
        if let Some(t) = &self.topo {
            self.check_rank(ann.src)?;
            if t.members[ann.src as usize] != ann.origin {
                return Err(MsgError::WrongSp {
                    rank: ann.src,
                    got: ann.origin,
                });
            }
            if t.my_node != ann.node || t.nodes[ann.src as usize] == t.my_node {
                return Err(MsgError::WrongNode { node: ann.node });
            }
        }
        if !self.announced.insert(ann.src) {
            return Err(MsgError::Duplicate { src: ann.src });
        }
        if let Some(status) = self.abort.status {
            let origin = ann.origin;
            self.send(
                origin,
                Msg::Ack {
                    src: ann.src,
                    node: ann.node,
                    status,
                },
            );
            self.notify_abort(origin);
            return Ok(());
        }
        let ready_here = self.ranks.values().any(|r| !r.out.completed);
        let (remaining, was_parked) = match pass {
            None => {
                if !ready_here {
                    self.stats.no_ready_rank += 1;
                }
                (ann.node_sps.len() as u32 - 1, false)
            }
            Some(p) => p,
        };
        if ready_here {
            if pass.is_some() && !was_parked {
                self.stats.served_after_pass += 1;
            }
            self.serve(ann);
        } else if let Some(&y) = self.ready_siblings.iter().next() {
            self.pass(y, ann, 0, was_parked);
        } else if remaining == 0 {
            self.stats.parked += 1;
            self.parked.push(ann);
        } else {
            let i = ann.node_sps.iter().position(|&s| s == self.me).unwrap();
            let next = ann.node_sps[(i + 1) % ann.node_sps.len()];
            self.pass(next, ann, remaining - 1, was_parked);
        }
        Ok(())
    }

    fn pass(&mut self, to: SpId, ann: Ann<K>, remaining: u32, parked: bool) {
        if self.lost_sps.contains(&to) {
            // Cannot happen without an abort in progress; keep it here.
            self.parked.push(ann);
            return;
        }
        self.announced.remove(&ann.src);
        self.send(
            to,
            Msg::Pass {
                src: ann.src,
                origin: ann.origin,
                key: ann.key,
                offset: ann.offset,
                len: ann.len,
                node: ann.node,
                node_sps: ann.node_sps,
                remaining,
                parked,
            },
        );
    }

    /// Land an announcement in a ready local rank (one exists, no abort).
    fn serve(&mut self, ann: Ann<K>) {
        let holder = self
            .ranks
            .iter()
            .filter(|(_, r)| !r.out.completed)
            .min_by_key(|(&rank, r)| (r.held, rank))
            .map(|(&rank, _)| rank)
            .expect("a ready local rank");
        let s = ann.src as usize;
        let st = self.ranks.get_mut(&holder).unwrap();
        if st.recv_counts[s] != ann.len || st.have[s] != Have::Missing {
            let origin = ann.origin;
            self.send(
                origin,
                Msg::Ack {
                    src: ann.src,
                    node: ann.node,
                    status: Status::CountMismatch,
                },
            );
            self.enter_abort(Status::CountMismatch, true);
            return;
        }
        st.held += 1;
        st.have[s] = Have::Copying;
        st.writes += 1;
        let id = self.next_copy;
        self.next_copy += 1;
        let copy = Copy {
            id: CopyId(id),
            seg: ann.src,
            src_rank: ann.src,
            src_key: ann.key.clone(),
            src_offset: ann.offset,
            dst_rank: holder,
            dst_key: st.recv_key.clone(),
            dst_offset: st.recv_displs[s],
            len: ann.len,
        };
        let bare = Ann {
            src: ann.src,
            origin: ann.origin,
            key: (),
            offset: ann.offset,
            len: ann.len,
            node: ann.node,
            node_sps: Vec::new(),
            since: ann.since,
        };
        self.copies.insert(id, CopyKind::Land { ann: bare, holder });
        if ann.len == 0 {
            self.handle_copy_done_internal(id);
        } else {
            self.actions.push_back(Action::Copy(copy));
        }
    }

    fn handle_copy_done_internal(&mut self, id: u64) {
        let now = self.now;
        self.handle_copy_done(now, CopyId(id), Status::Ok);
    }

    /// Publish the landed segment `src` (in `holder`'s receive buffer) to
    /// every SP of this node.
    fn publish(&mut self, src: Rank, holder: Rank, len: u64) {
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
    fn dist_one(&mut self, s: Rank, r: Rank) {
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
    fn check_seg(&mut self, s: Rank) {
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

    fn enter_abort(&mut self, status: Status, local: bool) {
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
        self.maybe_broadcast_abort();
        let ranks: Vec<Rank> = self.ranks.keys().copied().collect();
        for r in ranks {
            self.check_complete(r);
        }
    }

    fn maybe_broadcast_abort(&mut self) {
        if !self
            .abort
            .start_broadcast(self.abort_local && self.topo.is_some())
        {
            return;
        }
        let t = self.topo.as_ref().unwrap();
        let sps: BTreeSet<SpId> = t.members.iter().copied().collect();
        for sp in sps {
            self.notify_abort(sp);
        }
    }

    fn notify_abort(&mut self, sp: SpId) {
        if let Some(status) = self.abort.notice_for(self.me, &self.lost_sps, sp) {
            self.actions.push_back(Action::Send {
                to: sp,
                msg: Msg::Abort { status },
            });
        }
    }

    fn check_complete(&mut self, rank: Rank) {
        let aborted = self.abort.is_some();
        let Some(st) = self.ranks.get_mut(&rank) else {
            return;
        };
        if st.out.completed || st.writes > 0 || st.readers > 0 {
            return;
        }
        if !aborted && st.recv_pending > 0 {
            return;
        }
        st.out.completed = true;
        self.completed += 1;
        self.actions.push_back(Action::Complete {
            rank,
            status: st.out.status,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::testnet::{Machine, Out};
    use crate::CommId;

    type Tag = (char, Rank);

    const KEY: CollKey = CollKey {
        job: 1,
        comm: CommId { leader: 0, id: 9 },
        seq: 0,
    };

    /// Comm rank r has a block of `lens[r]` bytes; receive displacements
    /// are prefix sums.
    fn post(rank: Rank, members: &[SpId], nodes: &[u32], lens: &[u64]) -> Post<Tag> {
        let mut at = 0;
        let displs = lens
            .iter()
            .map(|l| {
                let d = at;
                at += l;
                d
            })
            .collect();
        Post {
            rank,
            members: members.to_vec(),
            nodes: nodes.to_vec(),
            send_key: ('s', rank),
            send_len: lens[rank as usize],
            recv_key: ('r', rank),
            recv_counts: lens.to_vec(),
            recv_displs: displs,
        }
    }

    type Net = crate::sim::testnet::Net<Allgatherv<Tag>>;

    impl Machine for Allgatherv<Tag> {
        type Post = Post<Tag>;
        type Msg = Msg<Tag>;
        type Copy = Copy<Tag>;

        fn create(sp: SpId) -> Self {
            Allgatherv::new(KEY, Config { me: sp })
        }

        fn post(&mut self, now: Nanos, post: Post<Tag>) {
            self.handle_post(now, post).unwrap();
        }

        fn msg(&mut self, now: Nanos, from: SpId, msg: Msg<Tag>) {
            self.handle_msg(now, from, msg).unwrap();
        }

        fn copy_done(&mut self, now: Nanos, copy: &Copy<Tag>, status: Status) {
            self.handle_copy_done(now, copy.id, status);
        }

        fn poll(&mut self) -> Option<Out<Msg<Tag>, Copy<Tag>>> {
            Some(match self.poll_action()? {
                Action::Send { to, msg } => Out::Send { to, msg },
                Action::Copy(c) => Out::Copy(c),
                Action::Complete { rank, status } => Out::Complete { rank, status },
            })
        }
    }

    #[test]
    fn late_arrival_is_parked_then_served() {
        let (members, nodes, lens) = ([0, 1], [0, 1], [3, 5]);
        let mut net = Net::new(2);
        net.post(0, post(0, &members, &nodes, &lens));
        net.run();
        assert_eq!(net.sp(1).parked(), 1);
        assert_eq!(net.sp(1).stats().no_ready_rank, 1);
        assert_eq!(net.sp(1).stats().parked, 1);
        assert!(net.completes.is_empty(), "rank 0 waits for its reader");
        net.post(1, post(1, &members, &nodes, &lens));
        net.run();
        assert_eq!(net.status(0), Some(Status::Ok));
        assert_eq!(net.status(1), Some(Status::Ok));
        assert!(net.sp(1).stats().parked_wait_ns > 0);
        // Two self copies, two inter-node landings.
        assert_eq!(net.copied.len(), 4);
        assert!(net.sp(0).is_finished() && net.sp(1).is_finished());
    }

    #[test]
    fn announcement_passes_to_a_ready_sibling_and_is_distributed() {
        // Node 0: SP 0 (rank 0). Node 1: SP 1 (rank 1), SP 2 (rank 2).
        let (members, nodes, lens) = ([0, 1, 2], [0, 1, 1], [4, 2, 6]);
        let mut net = Net::new(3);
        net.post(1, post(1, &members, &nodes, &lens));
        net.post(0, post(0, &members, &nodes, &lens));
        net.run();
        // Rank 0's announcement went to SP 2 (no rank yet) and was passed.
        assert_eq!(net.sp(2).stats().no_ready_rank, 1);
        assert_eq!(net.sp(1).stats().served_after_pass, 1);
        assert_eq!(net.sp(2).parked() + net.sp(1).parked(), 0);
        assert!(net.completes.is_empty());
        net.post(2, post(2, &members, &nodes, &lens));
        net.run();
        for r in 0..3 {
            assert_eq!(net.status(r), Some(Status::Ok), "rank {r}");
        }
        // Rank 0's block enters node 1 once, then an intra-node copy.
        let inter: Vec<_> = net
            .copied
            .iter()
            .filter(|c| nodes[c.src_rank as usize] != nodes[c.dst_rank as usize])
            .collect();
        assert_eq!(inter.len(), 3, "{inter:?}");
        let into_2 = net
            .copied
            .iter()
            .find(|c| c.seg == 0 && c.dst_rank == 2)
            .unwrap();
        assert_eq!((into_2.src_rank, into_2.src_key), (1, ('r', 1)));
        for sp in 0..3 {
            assert!(net.sp(sp).is_finished(), "sp {sp}");
        }
    }

    #[test]
    fn zero_length_blocks_complete_without_copies() {
        let (members, nodes, lens) = ([0, 1, 1], [0, 1, 1], [0, 0, 0]);
        let mut net = Net::new(2);
        for r in 0..3 {
            net.post(members[r as usize], post(r, &members, &nodes, &lens));
        }
        net.run();
        assert!(net.copied.is_empty());
        for r in 0..3 {
            assert_eq!(net.status(r), Some(Status::Ok));
        }
    }

    #[test]
    fn abort_acks_parked_announcements_and_completes_everyone() {
        let (members, nodes, lens) = ([0, 1, 2], [0, 1, 1], [4, 2, 6]);
        let mut net = Net::new(3);
        net.post(0, post(0, &members, &nodes, &lens));
        net.run();
        assert_eq!(net.sp(1).parked() + net.sp(2).parked(), 1);
        net.sp(0).abort(100, Status::Aborted);
        net.collect(0);
        net.run();
        assert_eq!(net.status(0), Some(Status::Aborted));
        net.post(1, post(1, &members, &nodes, &lens));
        net.post(2, post(2, &members, &nodes, &lens));
        net.run();
        assert_eq!(net.status(1), Some(Status::Aborted));
        assert_eq!(net.status(2), Some(Status::Aborted));
        for sp in 0..3 {
            assert!(net.sp(sp).is_finished(), "sp {sp}");
        }
    }

    #[test]
    fn rank_lost_before_any_post_reaches_every_sp() {
        // SP 2 only serves rank 2, which dies before posting.
        let (members, nodes, lens) = ([0, 1, 2], [0, 1, 1], [1, 1, 1]);
        let mut net = Net::new(3);
        net.sp(2).handle_rank_lost(0, 2);
        net.collect(2);
        net.post(0, post(0, &members, &nodes, &lens));
        net.post(1, post(1, &members, &nodes, &lens));
        net.run();
        assert_eq!(net.status(0), Some(Status::RankFailed));
        assert_eq!(net.status(1), Some(Status::RankFailed));
        assert_eq!(net.status(2), None);
        assert!(net.sp(0).is_finished() && net.sp(1).is_finished());
    }

    /// Node 0: SP 0 (rank 0). Node 1: SP 1 (rank 1), SP 2 (rank 2). Rank 0's announcement to
    /// node 1 reaches SP 2, which passes it to SP 1; SP 2 then dies and SP 0 learns it. Returns
    /// the network and the pass, still in flight (not delivered).
    fn pass_in_flight_then_sp_2_lost() -> (Net, (SpId, SpId, Msg<Tag>)) {
        let (members, nodes, lens) = ([0, 1, 2], [0, 1, 1], [4, 2, 6]);
        let mut net = Net::new(3);
        net.post(1, post(1, &members, &nodes, &lens));
        net.deliver_all();
        net.post(0, post(0, &members, &nodes, &lens));
        let i = net
            .msgs
            .iter()
            .position(|(_, to, m)| *to == 2 && matches!(m, Msg::Announce { .. }))
            .unwrap();
        let (from, to, msg) = net.msgs.remove(i).unwrap();
        net.sp(to).handle_msg(100, from, msg).unwrap();
        net.collect(to);
        let pass = net
            .msgs
            .iter()
            .position(|(f, to, m)| (*f, *to) == (2, 1) && matches!(m, Msg::Pass { .. }))
            .unwrap();
        let pass = net.msgs.remove(pass).unwrap();
        // SP 2 dies; SP 0 must not settle rank 0's ack to node 1 yet.
        net.msgs.retain(|(f, t, _)| *f != 2 && *t != 2);
        net.sps.remove(&2);
        net.sp(0).handle_peer_lost(200, 2);
        net.collect(0);
        (net, pass)
    }

    #[test]
    fn lost_sp_passed_the_announcement_on_source_waits_for_release() {
        // Node 0: SP 0 (rank 0). Node 1: SP 1 (rank 1), SP 2 (rank 2).
        let (mut net, pass) = pass_in_flight_then_sp_2_lost();
        // The pass overtakes the release (and SP 1 has not noticed the
        // loss yet): SP 1 starts landing rank 0's block.
        net.sp(1).handle_msg(300, pass.0, pass.2).unwrap();
        net.collect(1);
        assert!(net
            .copies
            .iter()
            .any(|(sp, c)| *sp == 1 && c.seg == 0 && c.src_rank == 0));
        net.deliver_all();
        assert!(
            net.status(0).is_none(),
            "rank 0 completed while SP 1 reads its send buffer"
        );
        net.run();
        assert_eq!(net.status(0), Some(Status::PeerFailed));
        net.sp(1).handle_peer_lost(400, 2);
        net.collect(1);
        net.run();
        assert_eq!(net.status(1), Some(Status::PeerFailed));
        assert!(net.sp(0).is_finished() && net.sp(1).is_finished());
    }

    #[test]
    fn release_before_the_pass_arrives_blocks_the_landing() {
        let (mut net, pass) = pass_in_flight_then_sp_2_lost();
        // SP 1 gets the release (and everything else) before the pass.
        net.run();
        assert!(net.status(0).is_some(), "SP 1 answered the release");
        net.sp(1).handle_msg(300, pass.0, pass.2).unwrap();
        net.collect(1);
        assert!(
            !net.copies.iter().any(|(_, c)| c.src_rank == 0),
            "an aborted SP started a landing copy"
        );
        net.sp(1).handle_peer_lost(400, 2);
        net.collect(1);
        net.run();
        assert_eq!(net.status(1), Some(Status::PeerFailed));
        assert!(net.sp(0).is_finished() && net.sp(1).is_finished());
    }

    #[test]
    fn invalid_posts_are_rejected() {
        let mut a: Allgatherv<Tag> = Allgatherv::new(KEY, Config { me: 0 });
        assert_eq!(
            a.handle_post(0, post(0, &[0, 0], &[0, 1], &[1, 1])),
            Err(PostError::SpOnTwoNodes { sp: 0 })
        );
        let mut p = post(0, &[0, 1], &[0, 1], &[1, 1]);
        p.nodes.pop();
        assert_eq!(
            a.handle_post(0, p),
            Err(PostError::LengthMismatch {
                field: "nodes",
                len: 1,
                expected: 2
            })
        );
        assert!(a.members().is_none());
    }
}
