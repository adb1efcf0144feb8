//! Staged, pipelined `Ibcast` progressed by service processes (after the
//! BluesMPI BlueField-2 designs: the root's DPU reads the root's buffer into
//! DPU memory, the DPUs pass it on among themselves, and each writes it back
//! to its hosts, either into every rank's buffer (*flat*) or once into a
//! node shared segment that the hosts copy from in `MPI_Wait`
//! (*hierarchical*)).
//!
//! One [`Bcast`] object exists per collective instance ([`CollKey`]) per SP.
//! The algorithm never holds bytes: data lives in host buffers (named by
//! keys `K`) and in the SP's *staging slots*, `Config::staging_slots` buffers
//! of `Config::chunk_bytes` each, owned by the SP for this instance and named
//! by [`SlotId`]s `0..staging_slots`. Both numbers come from the
//! configuration, never from a user count, so an instance's staging memory is
//! bounded whatever the message size.
//!
//! # Protocol
//!
//! *The tree.* The message (`len` bytes at offset 0 of every rank's buffer)
//! is cut into `n = max(1, ceil(len / chunk_bytes))` chunks; chunk `i` covers
//! bytes `i * chunk_bytes ..` (a 0-byte message is one 0-byte chunk, so the
//! SPs still agree on it). Every SP serving a member of the communicator
//! takes part, grouped by node: the root's node first, then the nodes with
//! members in ring order (ascending node number, wrapping). In the root's
//! group the root's SP comes first, then the node's other SPs in id order
//! (wrapping around after the root's SP); in the other groups the SPs are in
//! id order. The first SP of a group is its node's *leader*. The chunks flow
//! down a tree: a pipelined chain of the leaders, one SP per node, in group
//! order, and within each node from the leader to the node's other SPs. An
//! SP's *parent* is the previous group's leader (for a leader) or its own
//! leader; its *children* are the next group's leader and, for a leader, the
//! other SPs of its group. Each chunk therefore crosses each node boundary
//! exactly once, and the path from the root's SP to any SP has at most one
//! intra-node hop at its end, however many SPs a node runs. An SP's *view*
//! is `(root, len, chunk_bytes, tree)`; it forms it from its first local
//! post, or from the `Open` of its parent, whichever comes first.
//!
//! *Opening.* When an SP forms its view it sends `Open` (the view) to each
//! child and a first `Credit` to its parent. So an SP whose ranks have not
//! posted yet still learns the tree and takes part in forwarding: a late SP
//! never blocks the tree beyond its staging.
//!
//! *Credits.* A receiving SP grants free slots to its parent (`Credit {
//! slots }`), never more than the chunks it still expects. The parent moves
//! a chunk only into a slot that child granted: [`Action::Move`] asks the
//! driver to copy `len` bytes from a local slot to the child's slot and then
//! to deliver `Msg::Chunk { index, slot, len }` there ([`Move::chunk_msg`]);
//! the driver reports the end of the transfer on the sending side with
//! [`Bcast::handle_move_done`]. A granted slot stays reserved until the
//! chunk arrives in it, the parent gives it back (`Return`, after an abort
//! or a failed move) or the parent is lost, so no peer writes into staging
//! that was reused or released.
//!
//! *Per SP.* The root's SP reads chunks from the root's buffer into free slots
//! ([`Action::Copy`] from [`Loc::Host`] to [`Loc::Stage`]);
//! other SPs receive them. A chunk in a slot is forwarded to every
//! *receiving* child (to each strictly in index order) and written to the
//! SP's *targets*:
//! * flat: every local rank except the root ([`Loc::Stage`] to
//!   [`Loc::Host`] at offset `i * chunk_bytes` of the rank's `key`);
//! * hierarchical, at a node leader: only the node segment, through the
//!   `shared_key` of the SP's lowest local non-root rank (the *writer*; the
//!   root if it is the SP's only rank and the node has other SPs), once per
//!   chunk: its region at `shared_at` in the segment the whole node maps;
//! * hierarchical, at a node's other SP: every local non-root rank, as flat,
//!   for chunks its leader sends (only when the leader delivers flat).
//!
//! A leader's receiving children are the next leader and, when its own
//! design is flat, its node's other SPs. With its design hierarchical they
//! get no chunk: once the region holds all `n` chunks the leader sends each
//! of them `Sealed { at: shared_at }` (after its first `Credit`, which it
//! checked as any credit; the slots granted to the leader are void then).
//! A leader whose ranks have not posted yet does not know its design and
//! forwards to its node's other SPs nothing until one does; the region is
//! written through the writer's grant, so in the hierarchical design a
//! node's ranks wait for the post of their leader's writer rank.
//!
//! The slot is freed when every receiving child has the chunk and every target has
//! it. Targets are known from the members list of the
//! first local post (how many ranks this SP serves), so a chunk stays in
//! staging until ranks that have not posted yet got it: a rank that posts
//! late is served from staging, and staging slots, not local posts, bound
//! the pipeline (a late rank stalls its SP's intake once its slots are full,
//! and with it the tree upstream, but never deadlocks it: forwarding does
//! not wait for local posts).
//!
//! *Completion.* The root completes when every chunk was read out of its
//! buffer (only its own SP reads it; nothing else ever touches it), and, if
//! it is the writer, the region holds every chunk. Flat: a rank completes
//! when all `n` chunks were written into its buffer. Hier: a leader's
//! non-root ranks complete together when the region holds all `n` chunks,
//! the ranks of the node's other SPs when their SP gets `Sealed` (a rank
//! posting later completes at once), with `from_segment: true`: the host
//! then copies `len` bytes out of the region ([`Bcast::segment_source`])
//! into its buffer in `MPI_Wait`. The root's buffer is never written. The
//! driver keeps a leader's region until the ranks of its node's other SPs
//! copied out of it.
//!
//! *Completeness.* The SPs form a tree, so there is no cyclic wait: the
//! root's SP reads whenever a slot is free; an SP frees a slot once each
//! child granted one (which it does once its own slot is free, by induction
//! from the leaves, which only wait for their local writes) and its local
//! writes are done (which needs only its local ranks to post). So once every
//! rank posted, every chunk reaches every SP and every rank.
//!
//! *Consistency of posts.* Posts of one instance must agree on root and
//! length (MPI requires it). Each SP checks its local posts against its
//! view, and every `Open` and `Credit` it receives (both carry root, length
//! and chunk size) against its view: a disagreement aborts the instance with
//! `CountMismatch` (root or length) or `InvalidPost` (tree, chunk size,
//! design). Detection is complete: every SP with a view sends its view to
//! its children (`Open`) and its root, length and chunk size to its parent
//! (`Credit`) in the tree *of that view*; a parent checks that a credit
//! comes from one of its own children, then its own `Open` reaches that
//! child, who compares the trees. So if no check fails, the SPs holding any
//! given view form a set closed under parent and children of that view's
//! tree, i.e. the whole tree, so all views are equal. A rank completes `Ok`
//! only after its own chunks arrived, which were read under a view equal to
//! its post's (checked hop by hop), so an
//! `Ok` rank's post agrees with the root's and holds the root's data. Ranks
//! that already completed `Ok` when another SP detects a disagreement keep
//! that; all others complete with the error. (A rank whose post wrongly
//! names itself root is the root of its SP's view: its buffer is only read,
//! and it completes `Ok` once it was, as any root may; the SPs whose views
//! differ abort.) Detection needs no extra message and no global round: a
//! global agreement before any completion would make every rank wait for
//! the last one to post, which the late-arrival design exists to avoid.
//!
//! # Failure handling
//!
//! Local abort, rank loss (of a rank that has not completed), peer loss (of
//! an SP in the tree), a failed copy or move, and disagreeing posts abort
//! the instance: every SP that enters the abort broadcasts `Abort` once to
//! every SP of its tree (an SP that has no view yet tells the SPs that
//! granted it credits, who know the tree). An aborted SP stops reading,
//! forwarding, writing and granting; gives back every grant it holds
//! (`Return`); frees slots as their copies and moves finish; answers later
//! credits with `Return` and drops later chunks. A rank completes with the
//! error once no copy into (or, for the root, out of) its buffer is in
//! flight, so nothing writes into a rank's buffer after it completed and the
//! root's buffer is not read after the root completed: every buffer is
//! touched only by its own SP's copies, so no cross-SP handshake is needed.
//!
//! # Driver obligations
//!
//! Route `Action::Send` (tagged with the `CollKey`); execute every
//! `Action::Copy` (e.g. through a [`CopyLimiter`](crate::sched::CopyLimiter))
//! and report it with `handle_copy_done`; execute every `Action::Move` and
//! report it exactly once with `handle_move_done` (with an error status if
//! the bytes did not land, e.g. the peer is gone: then the `Chunk` message
//! must not be delivered); deliver the `Chunk` message of a successful move
//! only after its bytes are in the peer's slot; keep each instance's staging
//! (`staging_slots * chunk_bytes` bytes) until the instance `is_finished`;
//! on the receiving side, write an incoming chunk's bytes only where
//! [`Bcast::may_fill`] allows (the slot is granted to that sender).
//! Zero-length copies and moves never reach the driver (a zero-length move
//! is a plain `Send` of its `Chunk`). All SPs of a job must use the same
//! `chunk_bytes` (a mismatch aborts with `InvalidPost`).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::abort::{fail_pending, lose_rank, Abort, Outcome};
use crate::common::common_api;
use crate::common::sp_nodes;
use crate::staged::{mutation_switch, Slots};
pub use crate::staged::{Config, CopyId, Design, Loc, SlotId};
type Slot = crate::staged::Slot<Held>;
use crate::{CollKey, Nanos, Rank, SpId, Status};

/// What one local rank posted (sizes in bytes, already checked by the
/// driver against the rank's grants: `key` holds at least `len` bytes, and
/// so does `shared_key` for `Design::Hier`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Post<K> {
    pub rank: Rank,
    pub root: Rank,
    /// SP serving each comm rank; its length is the comm size P.
    pub members: Vec<SpId>,
    /// Node of each comm rank.
    pub nodes: Vec<u32>,
    /// The rank's buffer (message at offset 0): read at the root, written
    /// elsewhere (flat design).
    pub key: K,
    pub len: u64,
    pub design: Design,
    /// `Design::Hier`: this SP's region of the node segment, which the SP
    /// writes through this rank's grant (required at a node leader; ignored
    /// elsewhere and for `Design::Flat`).
    pub shared_key: Option<K>,
    /// Where `shared_key`'s region starts in the node segment (what the
    /// node's ranks are told to copy from).
    pub shared_at: u64,
}

/// SP-to-SP messages of this collective (the driver adds the `CollKey`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// To each child in `tree`, once: the sender's view. `tree` holds the
    /// SPs grouped by node in tree order, each group led by its node's
    /// leader (see the module docs).
    Open {
        root: Rank,
        len: u64,
        chunk_bytes: u64,
        tree: Vec<Vec<SpId>>,
    },
    /// To the parent: it may move one chunk into each of `slots`. Root,
    /// length and chunk size travel along for the consistency check.
    Credit {
        root: Rank,
        len: u64,
        chunk_bytes: u64,
        slots: Vec<SlotId>,
    },
    /// Chunk `index` (`len` bytes) is in the receiver's `slot` (delivered by
    /// the driver after the bytes of a [`Move`]).
    Chunk { index: u64, slot: SlotId, len: u64 },
    /// The sender will not fill these slots the receiver granted it.
    Return { slots: Vec<SlotId> },
    /// From a node leader to an SP of its node (hierarchical design): the
    /// message is complete in the leader's region at `at` of the node
    /// segment; no chunk follows, and the slots granted to the leader are
    /// void.
    Sealed { at: u64 },
    /// The collective failed; stop and complete everyone with `status`.
    Abort { status: Status },
}

/// Identifies a move within one instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MoveId(pub u64);

/// Copy `len` bytes of chunk `chunk` from `src` to `dst`, on this SP.
/// Either a read from the root's buffer into a slot (`rank` is the root),
/// or a write from a slot into the buffer (flat) or segment (hier, through
/// the writer's `shared_key`) of local rank `rank`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copy<K> {
    pub id: CopyId,
    /// The local rank whose grant is `src` or `dst`.
    pub rank: Rank,
    pub chunk: u64,
    pub src: Loc<K>,
    pub dst: Loc<K>,
    pub len: u64,
}

/// Move `len` bytes (chunk `chunk`) from this SP's `src_slot` into SP
/// `to`'s `dst_slot`, then deliver [`Move::chunk_msg`] to `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    pub id: MoveId,
    pub to: SpId,
    pub chunk: u64,
    pub src_slot: SlotId,
    pub dst_slot: SlotId,
    pub len: u64,
}

impl Move {
    /// The message the driver delivers to `to` once the bytes landed.
    pub fn chunk_msg(&self) -> Msg {
        Msg::Chunk {
            index: self.chunk,
            slot: self.dst_slot,
            len: self.len,
        }
    }
}

/// Output of the state machine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action<K> {
    /// Send `msg` to SP `to` (never this SP itself).
    Send { to: SpId, msg: Msg },
    /// Start this copy and report it with `handle_copy_done`.
    Copy(Copy<K>),
    /// Start this move and report it with `handle_move_done`.
    Move(Move),
    /// Local `rank` is done; emitted exactly once per posted rank.
    /// `from_segment` (only with `Status::Ok`, hierarchical design, non-root
    /// ranks): the message is in the node segment, not in the rank's
    /// buffer; the host copies `len` bytes from offset 0 of its
    /// `shared_key` segment into its buffer before returning from the wait.
    Complete {
        rank: Rank,
        status: Status,
        from_segment: bool,
    },
}

/// A rejected post; the instance is unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PostError {
    RankOutOfRange {
        rank: Rank,
        size: usize,
    },
    RootOutOfRange {
        root: Rank,
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
    /// `Design::Hier` without a `shared_key`.
    MissingSharedKey {
        rank: Rank,
    },
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PostError::RankOutOfRange { rank, size } => {
                write!(f, "rank {rank} out of range for comm size {size}")
            }
            PostError::RootOutOfRange { root, size } => {
                write!(f, "root {root} out of range for comm size {size}")
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
            PostError::MissingSharedKey { rank } => {
                write!(
                    f,
                    "rank {rank}: hierarchical bcast without a shared segment"
                )
            }
        }
    }
}

impl std::error::Error for PostError {}

/// A protocol violation by a peer; the instance is unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MsgError {
    /// An `Open` whose tree does not make the sender this SP's parent (or
    /// names an SP twice).
    NotParent { sp: SpId },
    /// A second `Open` from the same SP.
    DuplicateOpen { sp: SpId },
    /// A chunk or return for a slot not granted to the sender.
    SlotNotGranted { slot: SlotId },
    /// A chunk index out of range, received twice, or of the wrong length.
    BadChunk { index: u64 },
    /// An `Abort` from an SP outside the tree.
    NotMember { sp: SpId },
    /// A `Sealed` from another SP than this SP's leader, twice, or after
    /// chunks.
    UnexpectedSeal { sp: SpId },
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
    /// Chunks moved to children (moves reported done `Ok`).
    pub chunks_forwarded: u64,
    /// Bytes that entered staging (reads from the root, chunks received).
    pub bytes_staged: u64,
    /// Chunks that arrived before any local rank had posted (the SP knew
    /// the tree from its parent's `Open`).
    pub chunks_before_post: u64,
    /// Most staging slots in use at once (granted, being read, or holding
    /// a chunk); never above `Config::staging_slots`.
    pub max_slots_in_use: u32,
    /// `handle_copy_done` / `handle_move_done` calls for unknown ids
    /// (ignored).
    pub unknown_done: u64,
    /// Messages ignored because their sender was declared lost.
    pub ignored_from_lost_sp: u64,
    /// `Sealed` sent: SPs of this node whose ranks copy out of this SP's
    /// region instead of receiving chunks.
    pub regions_shared: u64,
}

/// Deliberately broken variants, switched on per test thread by the
/// simulator's tests to show that its checkers catch them. Compiled out of
/// non-test builds.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mutation {
    /// Free a slot once its moves started, not once they finished.
    FreeWhileMoving,
    /// Flat ranks complete one chunk early.
    CompleteOneChunkEarly,
    /// The root completes as soon as its last read started.
    RootCompletesBeforeReads,
    /// A rank that posts late gets no chunk that was already staged.
    SkipStagedForLateRank,
    /// Ranks complete `Ok` after an abort.
    OkAfterAbort,
}

mutation_switch!(Mutation);

/// `(root, len, chunk_bytes, tree)` as one SP sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct View {
    root: Rank,
    len: u64,
    chunk_bytes: u64,
    tree: Vec<Vec<SpId>>,
    /// This SP's group in `tree`, and its place in that group.
    group: usize,
    at: usize,
    /// Number of chunks.
    n: u64,
}

impl View {
    fn new(me: SpId, root: Rank, len: u64, chunk_bytes: u64, tree: Vec<Vec<SpId>>) -> Option<View> {
        let (group, at) = tree
            .iter()
            .enumerate()
            .find_map(|(g, sps)| sps.iter().position(|&s| s == me).map(|a| (g, a)))?;
        let n = if len == 0 {
            1
        } else {
            len.div_ceil(chunk_bytes)
        };
        Some(View {
            root,
            len,
            chunk_bytes,
            tree,
            group,
            at,
            n,
        })
    }

    /// The root's SP: the first SP of the first group.
    fn is_top(&self) -> bool {
        self.group == 0 && self.at == 0
    }

    fn parent(&self) -> Option<SpId> {
        tree_parent(&self.tree, self.group, self.at)
    }

    /// The next group's leader first (the critical path), then, for a
    /// leader, the other SPs of its group.
    fn children(&self) -> Vec<SpId> {
        if self.at > 0 {
            return Vec::new();
        }
        let next = self.tree.get(self.group + 1).map(|g| g[0]);
        next.into_iter()
            .chain(self.tree[self.group][1..].iter().copied())
            .collect()
    }

    fn contains(&self, sp: SpId) -> bool {
        self.tree.iter().any(|g| g.contains(&sp))
    }

    /// For a leader, the other SPs of its node; else none.
    fn siblings(&self) -> &[SpId] {
        if self.at == 0 {
            &self.tree[self.group][1..]
        } else {
            &[]
        }
    }

    fn all(&self) -> Vec<SpId> {
        self.tree.iter().flatten().copied().collect()
    }

    fn offset(&self, i: u64) -> u64 {
        i * self.chunk_bytes
    }

    fn chunk_len(&self, i: u64) -> u64 {
        (self.len - self.offset(i).min(self.len)).min(self.chunk_bytes)
    }

    /// The abort status if `(root, len, chunk_bytes, tree)` disagrees.
    fn disagreement(
        &self,
        root: Rank,
        len: u64,
        chunk_bytes: u64,
        tree: Option<&[Vec<SpId>]>,
    ) -> Option<Status> {
        if root != self.root || len != self.len {
            Some(Status::CountMismatch)
        } else if chunk_bytes != self.chunk_bytes || tree.is_some_and(|t| t != self.tree) {
            Some(Status::InvalidPost)
        } else {
            None
        }
    }
}

/// The parent of the SP at `tree[group][at]`.
fn tree_parent(tree: &[Vec<SpId>], group: usize, at: usize) -> Option<SpId> {
    if at > 0 {
        Some(tree[group][0])
    } else {
        group.checked_sub(1).map(|g| tree[g][0])
    }
}

/// The SPs of a broadcast from `root`, grouped by node in tree order (see
/// the module docs); the first SP of each group is its node's leader.
pub fn build_tree(
    members: &[SpId],
    nodes: &[u32],
    root: Rank,
) -> Result<Vec<Vec<SpId>>, PostError> {
    let sp_node = sp_nodes(members, nodes).map_err(|sp| PostError::SpOnTwoNodes { sp })?;
    let mut node_sps: BTreeMap<u32, BTreeSet<SpId>> = BTreeMap::new();
    for (&sp, &n) in &sp_node {
        node_sps.entry(n).or_default().insert(sp);
    }
    let (root_sp, root_node) = (members[root as usize], nodes[root as usize]);
    let node_list: Vec<u32> = node_sps.keys().copied().collect();
    let start = node_list.iter().position(|&n| n == root_node).unwrap();
    let mut tree = Vec::with_capacity(node_list.len());
    for k in 0..node_list.len() {
        let n = node_list[(start + k) % node_list.len()];
        let sps: Vec<SpId> = node_sps[&n].iter().copied().collect();
        let first = if n == root_node {
            sps.iter().position(|&s| s == root_sp).unwrap()
        } else {
            0
        };
        tree.push(sps[first..].iter().chain(&sps[..first]).copied().collect());
    }
    Ok(tree)
}

/// What the first local post told about the communicator.
#[derive(Clone, Debug)]
struct Topo {
    members: Vec<SpId>,
    nodes: Vec<u32>,
    /// Ranks served here, ascending.
    local: Vec<Rank>,
    design: Design,
}

#[derive(Clone, Debug)]
struct LocalRank<K> {
    key: K,
    shared_key: Option<K>,
    shared_at: u64,
    /// Chunks written into this rank's buffer (flat) or, for the writer,
    /// into the segment (hier).
    written: u64,
    /// Copies writing into its buffer / segment.
    writes: usize,
    /// Reads from its buffer (the root).
    reads: usize,
    /// Chunks staged here when it posted (see `Mutation`).
    staged_at_post: u64,
    out: Outcome,
}

/// A chunk held in a slot.
#[derive(Clone, Debug)]
struct Held {
    index: u64,
    len: u64,
    /// Children that have it (their moves reported done `Ok`).
    forwarded: BTreeSet<SpId>,
    /// Children it is being moved to.
    moving: BTreeSet<SpId>,
    /// Targets that have it.
    done: BTreeSet<Rank>,
    /// Targets with a copy in flight.
    writing: BTreeSet<Rank>,
}

#[derive(Clone, Copy, Debug)]
enum CopyKind {
    Read { slot: usize, index: u64, len: u64 },
    Write { slot: usize, index: u64, rank: Rank },
}

#[derive(Clone, Copy, Debug)]
struct MoveSt {
    slot: usize,
    index: u64,
    to: SpId,
    dst: SlotId,
}

/// Credits received before this SP had a view.
#[derive(Clone, Debug)]
struct EarlyCredit {
    from: SpId,
    root: Rank,
    len: u64,
    chunk_bytes: u64,
    slots: Vec<SlotId>,
}

/// The per-SP state machine of one `Ibcast` instance.
///
/// Drive it like the other collectives: feed inputs through `handle_*`,
/// then drain `poll_action` after every input.
pub struct Bcast<K> {
    key: CollKey,
    me: SpId,
    chunk_bytes: u64,
    topo: Option<Topo>,
    view: Option<View>,
    /// SPs that sent an `Open` (bounded by the tree's size).
    opened_by: BTreeSet<SpId>,
    /// Targets of this SP (known once topology and view are).
    targets: Option<Vec<Rank>>,
    ranks: BTreeMap<Rank, LocalRank<K>>,
    completed: usize,
    lost_unposted: BTreeSet<Rank>,
    slots: Slots<Held>,
    /// Chunk index -> slot holding it (Full).
    by_index: BTreeMap<u64, usize>,
    /// Root's SP: next chunk to read, reads finished.
    next_read: u64,
    reads_done: u64,
    /// Other SPs: every chunk below `recv_low` arrived, and these above.
    recv_low: u64,
    recv_above: BTreeSet<u64>,
    /// Per child: the next chunk to forward to it (in index order).
    next_fwd: BTreeMap<SpId, u64>,
    /// Per child: slots it granted that are still unused.
    grants: BTreeMap<SpId, VecDeque<SlotId>>,
    early_credits: Vec<EarlyCredit>,
    /// A leader: its node's other SPs whose first credit it accepted, and
    /// those it sent `Sealed`.
    credited: BTreeSet<SpId>,
    sealed_to: BTreeSet<SpId>,
    /// A node's other SP: where its leader's region is, once `Sealed`.
    sealed: Option<u64>,
    copies: BTreeMap<u64, CopyKind>,
    moves: BTreeMap<u64, MoveSt>,
    next_id: u64,
    zero_copies: VecDeque<u64>,
    zero_moves: VecDeque<u64>,
    abort: Abort,
    lost_sps: BTreeSet<SpId>,
    actions: VecDeque<Action<K>>,
    now: Nanos,
    stats: Stats,
}

common_api!(Bcast, staged, Msg);

impl<K: Clone + fmt::Debug + PartialEq> Bcast<K> {
    /// Create an instance; the driver may do so on the first event of any
    /// kind for `key`.
    pub fn new(key: CollKey, cfg: Config) -> Self {
        Bcast {
            key,
            me: cfg.me,
            chunk_bytes: cfg.chunk_bytes.max(1),
            topo: None,
            view: None,
            opened_by: BTreeSet::new(),
            targets: None,
            ranks: BTreeMap::new(),
            completed: 0,
            lost_unposted: BTreeSet::new(),
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
            copies: BTreeMap::new(),
            moves: BTreeMap::new(),
            next_id: 0,
            zero_copies: VecDeque::new(),
            zero_moves: VecDeque::new(),
            abort: Abort::default(),
            lost_sps: BTreeSet::new(),
            actions: VecDeque::new(),
            now: 0,
            stats: Stats::default(),
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
        Some((self.me, self.ranks.get(writer)?.shared_at, v.len))
    }

    /// Copies and moves started and not reported done.
    pub fn copies_in_flight(&self) -> usize {
        self.copies.len() + self.moves.len()
    }

    /// A local rank posted its part of the collective.
    pub fn handle_post(&mut self, now: Nanos, post: Post<K>) -> Result<(), PostError> {
        self.now = now;
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
        if let Some(status) = self.abort.status {
            st.out.set_error(status);
        }
        self.ranks.insert(rank, st);
        let first = self.topo.is_none();
        if first {
            let me = self.me;
            self.lost_unposted
                .retain(|&r| post.members.get(r as usize) == Some(&me));
            self.topo = Some(Topo {
                local: (0..post.members.len() as Rank)
                    .filter(|&r| post.members[r as usize] == self.me)
                    .collect(),
                members: post.members,
                nodes: post.nodes,
                design: post.design,
            });
        }
        let design_differs = self.topo.as_ref().unwrap().design != post.design;
        match &self.view {
            None => {
                let view = View::new(self.me, post.root, post.len, self.chunk_bytes, tree)
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
            if self.abort.is_some() {
                self.maybe_broadcast_abort();
            }
        }
        self.pump();
        Ok(())
    }

    /// The move `id` finished with `status` (`Ok`: the bytes are in the
    /// peer's slot and its `Chunk` message is on its way).
    pub fn handle_move_done(&mut self, now: Nanos, id: MoveId, status: Status) {
        self.now = now;
        self.move_finished(id.0, status);
        self.pump();
    }

    /// SP `sp` died: abort with `PeerFailed` if it is in the tree; slots
    /// granted to it are free again and its grants are dropped. Messages
    /// from `sp` are ignored from now on. Moves to it still in flight must
    /// be reported by the driver (`handle_move_done`).
    pub fn handle_peer_lost(&mut self, now: Nanos, sp: SpId) {
        self.now = now;
        if sp == self.me || !self.lost_sps.insert(sp) {
            return;
        }
        self.early_credits.retain(|c| c.from != sp);
        self.apply_peer_lost(sp);
        self.pump();
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
        self.enter_abort(Status::RankFailed);
        self.pump();
    }

    /// Every local rank completed (or was lost before posting), no copy or
    /// move is in flight, no slot is granted or holds a chunk, no grant is
    /// held, and every action was polled. An SP none of whose ranks ever
    /// posts never finishes (the driver drops such instances with the job).
    pub fn is_finished(&self) -> bool {
        self.topo
            .as_ref()
            .is_some_and(|t| self.completed + self.lost_unposted.len() == t.local.len())
            && self.copies.is_empty()
            && self.moves.is_empty()
            && self.slots.all_free()
            && self.grants.values().all(|g| g.is_empty())
            && self.early_credits.is_empty()
            && self.actions.is_empty()
            && (self.abort.is_some() || self.sealing().is_none_or(|s| s.is_empty()))
    }

    // ---- internals -------------------------------------------------------

    /// Checks a post; returns the tree it implies.
    fn validate_post(&self, post: &Post<K>) -> Result<Vec<Vec<SpId>>, PostError> {
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
        if served_by != self.me {
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
        let tree = build_tree(&post.members, &post.nodes, post.root)?;
        if self.ranks.contains_key(&rank) {
            return Err(PostError::DuplicatePost { rank });
        }
        if self.lost_unposted.contains(&rank) {
            return Err(PostError::RankLost { rank });
        }
        let leader = tree.iter().any(|g| g[0] == self.me);
        if post.design == Design::Hier && leader && post.shared_key.is_none() {
            return Err(PostError::MissingSharedKey { rank });
        }
        Ok(tree)
    }

    /// This SP has a view for the first time.
    fn form_view(&mut self, view: View) {
        debug_assert!(self.view.is_none());
        let children = view.children();
        let open = Msg::Open {
            root: view.root,
            len: view.len,
            chunk_bytes: view.chunk_bytes,
            tree: view.tree.clone(),
        };
        let lost = view.all().iter().any(|s| self.lost_sps.contains(s));
        for &c in &children {
            self.next_fwd.insert(c, 0);
            self.grants.insert(c, VecDeque::new());
        }
        self.view = Some(view);
        if lost {
            self.enter_abort(Status::PeerFailed);
        }
        if self.abort.is_some() {
            self.maybe_broadcast_abort();
        } else {
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
    fn learn_targets(&mut self) {
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

    fn apply_peer_lost(&mut self, sp: SpId) {
        self.slots.release_granted(sp);
        if let Some(g) = self.grants.get_mut(&sp) {
            g.clear();
        }
        if self.view.as_ref().is_some_and(|v| v.contains(sp)) {
            self.enter_abort(Status::PeerFailed);
        }
    }

    fn send(&mut self, to: SpId, msg: Msg) {
        debug_assert_ne!(to, self.me, "bcast never messages itself");
        if to != self.me && !self.lost_sps.contains(&to) {
            self.actions.push_back(Action::Send { to, msg });
        }
    }

    fn process(&mut self, from: SpId, msg: Msg) -> Result<(), MsgError> {
        if self.lost_sps.contains(&from) {
            self.stats.ignored_from_lost_sp += 1;
            return Ok(());
        }
        match msg {
            Msg::Open {
                root,
                len,
                chunk_bytes,
                tree,
            } => {
                let me = self.me;
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
                        let view = View::new(me, root, len, self.chunk_bytes, tree)
                            .expect("checked above");
                        self.form_view(view);
                        self.learn_targets();
                        if mismatch {
                            self.enter_abort(Status::InvalidPost);
                        }
                    }
                }
                if self.abort.is_some() {
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
                if self.view.is_none() && self.abort.is_none() {
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
                if self.abort.is_some() {
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
                self.stats.bytes_staged += len;
                if self.topo.is_none() {
                    self.stats.chunks_before_post += 1;
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
                if self.abort.is_some() {
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
    fn sealing(&self) -> Option<Vec<SpId>> {
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
    fn receivers(&self) -> Vec<SpId> {
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
    fn seal(&mut self) {
        if self.abort.is_some() {
            return;
        }
        let Some(todo) = self.sealing() else { return };
        let v = self.view.as_ref().expect("sealing needs a view");
        let n = v.n;
        let writer = self.targets.as_ref().and_then(|t| t.first());
        let Some(w) = writer.and_then(|w| self.ranks.get(w)) else {
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
            self.stats.regions_shared += 1;
            self.send(s, Msg::Sealed { at });
        }
    }

    /// A credit from `c.from`, with a view here or after an abort.
    fn on_credit(&mut self, c: EarlyCredit) {
        if self.sealed_to.contains(&c.from) {
            // Sent before our `Sealed` reached it: those slots are void.
            return;
        }
        if self.abort.is_none() {
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

    fn new_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn copy_finished(&mut self, id: u64, status: Status) {
        let Some(kind) = self.copies.remove(&id) else {
            self.stats.unknown_done += 1;
            return;
        };
        if !status.is_ok() {
            self.enter_abort(status);
        }
        let ok = status.is_ok() && self.abort.is_none();
        match kind {
            CopyKind::Read { slot, index, len } => {
                let root = self.view.as_ref().unwrap().root;
                if let Some(st) = self.ranks.get_mut(&root) {
                    st.reads -= 1;
                    st.out.set_error(status);
                }
                if ok {
                    self.reads_done += 1;
                    self.stats.bytes_staged += len;
                    self.slots[slot] = Slot::Full(Held::new(index, len));
                    self.by_index.insert(index, slot);
                } else {
                    self.slots[slot] = Slot::Free;
                }
            }
            CopyKind::Write { slot, index, rank } => {
                let st = self.ranks.get_mut(&rank).expect("write into a posted rank");
                st.writes -= 1;
                st.out.set_error(status);
                if ok {
                    st.written += 1;
                }
                match &mut self.slots[slot] {
                    Slot::Full(h) if h.index == index => {
                        h.writing.remove(&rank);
                        if ok {
                            h.done.insert(rank);
                        }
                    }
                    _ => debug_assert!(false, "write from a slot that changed"),
                }
            }
        }
    }

    fn move_finished(&mut self, id: u64, status: Status) {
        let Some(m) = self.moves.remove(&id) else {
            self.stats.unknown_done += 1;
            return;
        };
        if !status.is_ok() {
            self.enter_abort(status);
            // The bytes did not land and no chunk follows: give the slot
            // back so the peer can finish.
            self.send(m.to, Msg::Return { slots: vec![m.dst] });
        }
        if let Slot::Full(h) = &mut self.slots[m.slot] {
            if h.index == m.index {
                h.moving.remove(&m.to);
                if status.is_ok() {
                    h.forwarded.insert(m.to);
                }
            }
        }
        if status.is_ok() {
            self.stats.chunks_forwarded += 1;
        }
    }

    fn enter_abort(&mut self, status: Status) {
        let (first, status) = self.abort.enter(status);
        fail_pending(self.ranks.values_mut().map(|st| &mut st.out), status);
        if first {
            let held: Vec<(SpId, Vec<SlotId>)> = self
                .grants
                .iter_mut()
                .filter(|(_, g)| !g.is_empty())
                .map(|(&c, g)| (c, g.drain(..).collect()))
                .collect();
            for (child, slots) in held {
                self.send(child, Msg::Return { slots });
            }
            for c in std::mem::take(&mut self.early_credits) {
                self.on_credit(c);
            }
        }
        self.maybe_broadcast_abort();
    }

    fn maybe_broadcast_abort(&mut self) {
        if !self.abort.start_broadcast(self.view.is_some()) {
            return;
        }
        for sp in self.view.as_ref().unwrap().all() {
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

    /// Do everything that can be done now; called at the end of every
    /// input.
    fn pump(&mut self) {
        loop {
            let mut progress = false;
            while let Some(id) = self.zero_copies.pop_front() {
                self.copy_finished(id, Status::Ok);
                progress = true;
            }
            while let Some(id) = self.zero_moves.pop_front() {
                self.move_finished(id, Status::Ok);
                progress = true;
            }
            progress |= self.free_slots();
            progress |= self.start_reads();
            progress |= self.forward();
            progress |= self.write_targets();
            if !progress {
                break;
            }
        }
        self.seal();
        self.grant();
        let ranks: Vec<Rank> = self.ranks.keys().copied().collect();
        for r in ranks {
            self.check_complete(r);
        }
        let in_use = self.slots_in_use() as u32;
        self.stats.max_slots_in_use = self.stats.max_slots_in_use.max(in_use);
    }

    fn free_slots(&mut self) -> bool {
        let aborted = self.abort.is_some();
        let children = self.receivers();
        let mut progress = false;
        for i in 0..self.slots.len() {
            let Slot::Full(h) = &self.slots[i] else {
                continue;
            };
            let free = if aborted {
                h.moving.is_empty() && h.writing.is_empty()
            } else {
                let forwarded = if mutated(Mutation::FreeWhileMoving) {
                    children
                        .iter()
                        .all(|c| h.forwarded.contains(c) || h.moving.contains(c))
                } else {
                    h.moving.is_empty() && children.iter().all(|c| h.forwarded.contains(c))
                };
                h.writing.is_empty()
                    && forwarded
                    && self
                        .targets
                        .as_ref()
                        .is_some_and(|t| t.iter().all(|r| h.done.contains(r)))
            };
            if free {
                self.by_index.remove(&h.index);
                self.slots[i] = Slot::Free;
                progress = true;
            }
        }
        progress
    }

    fn free_slot(&self) -> Option<usize> {
        self.slots.first_free()
    }

    /// The root's SP reads chunks from the root's buffer into free slots.
    fn start_reads(&mut self) -> bool {
        let Some(v) = &self.view else { return false };
        if self.abort.is_some() || !v.is_top() {
            return false;
        }
        let (root, n) = (v.root, v.n);
        let Some(st) = self.ranks.get(&root) else {
            return false;
        };
        if st.out.completed {
            return false;
        }
        let key = st.key.clone();
        let mut progress = false;
        while self.next_read < n {
            let Some(slot) = self.free_slot() else { break };
            let v = self.view.as_ref().unwrap();
            let (index, offset, len) = (
                self.next_read,
                v.offset(self.next_read),
                v.chunk_len(self.next_read),
            );
            self.next_read += 1;
            self.slots[slot] = Slot::Reading;
            self.ranks.get_mut(&root).unwrap().reads += 1;
            let id = self.new_id();
            self.copies.insert(id, CopyKind::Read { slot, index, len });
            if len == 0 {
                self.zero_copies.push_back(id);
            } else {
                self.actions.push_back(Action::Copy(Copy {
                    id: CopyId(id),
                    rank: root,
                    chunk: index,
                    src: Loc::Host {
                        key: key.clone(),
                        offset,
                    },
                    dst: Loc::Stage {
                        slot: SlotId(slot as u32),
                        offset: 0,
                    },
                    len,
                }));
            }
            progress = true;
        }
        progress
    }

    /// Move chunks, to each child in index order, into the slots it
    /// granted.
    fn forward(&mut self) -> bool {
        let Some(v) = &self.view else { return false };
        if self.abort.is_some() {
            return false;
        }
        let n = v.n;
        let mut progress = false;
        for to in self.receivers() {
            loop {
                let next = self.next_fwd[&to];
                if next >= n || self.grants[&to].is_empty() {
                    break;
                }
                let Some(&slot) = self.by_index.get(&next) else {
                    break;
                };
                let Slot::Full(h) = &mut self.slots[slot] else {
                    unreachable!("by_index names a full slot")
                };
                debug_assert!(!h.moving.contains(&to) && !h.forwarded.contains(&to));
                h.moving.insert(to);
                let (index, len) = (h.index, h.len);
                let dst = self.grants.get_mut(&to).unwrap().pop_front().unwrap();
                self.next_fwd.insert(to, next + 1);
                let id = self.new_id();
                self.moves.insert(
                    id,
                    MoveSt {
                        slot,
                        index,
                        to,
                        dst,
                    },
                );
                let mv = Move {
                    id: MoveId(id),
                    to,
                    chunk: index,
                    src_slot: SlotId(slot as u32),
                    dst_slot: dst,
                    len,
                };
                if len == 0 {
                    self.send(to, mv.chunk_msg());
                    self.zero_moves.push_back(id);
                } else {
                    self.actions.push_back(Action::Move(mv));
                }
                progress = true;
            }
        }
        progress
    }

    /// Write staged chunks into the targets that have posted.
    fn write_targets(&mut self) -> bool {
        if self.abort.is_some() {
            return false;
        }
        let (Some(targets), Some(v), Some(t)) = (&self.targets, &self.view, &self.topo) else {
            return false;
        };
        let hier = t.design == Design::Hier && v.at == 0;
        let mut todo = Vec::new();
        for (&index, &slot) in &self.by_index {
            let Slot::Full(h) = &self.slots[slot] else {
                continue;
            };
            for &r in targets {
                let Some(st) = self.ranks.get(&r) else {
                    continue;
                };
                if st.out.completed || h.done.contains(&r) || h.writing.contains(&r) {
                    continue;
                }
                if mutated(Mutation::SkipStagedForLateRank) && index < st.staged_at_post {
                    continue;
                }
                let key = if hier {
                    st.shared_key.clone().expect("checked at post")
                } else {
                    st.key.clone()
                };
                todo.push((slot, index, r, key, v.offset(index), h.len));
            }
        }
        let progress = !todo.is_empty();
        for (slot, index, rank, key, offset, len) in todo {
            let Slot::Full(h) = &mut self.slots[slot] else {
                unreachable!()
            };
            h.writing.insert(rank);
            self.ranks.get_mut(&rank).unwrap().writes += 1;
            let id = self.new_id();
            self.copies
                .insert(id, CopyKind::Write { slot, index, rank });
            if len == 0 {
                self.zero_copies.push_back(id);
            } else {
                self.actions.push_back(Action::Copy(Copy {
                    id: CopyId(id),
                    rank,
                    chunk: index,
                    src: Loc::Stage {
                        slot: SlotId(slot as u32),
                        offset: 0,
                    },
                    dst: Loc::Host { key, offset },
                    len,
                }));
            }
        }
        progress
    }

    /// Grant free slots to the parent, never more than the chunks still
    /// expected.
    fn grant(&mut self) {
        let Some(v) = &self.view else { return };
        let Some(parent) = v.parent() else { return };
        if self.abort.is_some() || self.lost_sps.contains(&parent) || self.sealed.is_some() {
            return;
        }
        let (root, len, chunk_bytes, n) = (v.root, v.len, v.chunk_bytes, v.n);
        let arrived = self.recv_low + self.recv_above.len() as u64;
        let granted = self
            .slots
            .iter()
            .filter(|s| matches!(s, Slot::Granted(_)))
            .count() as u64;
        let mut want = n.saturating_sub(arrived + granted);
        let mut slots = Vec::new();
        for (i, s) in self.slots.iter_mut().enumerate() {
            if want == 0 {
                break;
            }
            if matches!(s, Slot::Free) {
                *s = Slot::Granted(parent);
                slots.push(SlotId(i as u32));
                want -= 1;
            }
        }
        if !slots.is_empty() {
            self.send(
                parent,
                Msg::Credit {
                    root,
                    len,
                    chunk_bytes,
                    slots,
                },
            );
        }
    }

    fn check_complete(&mut self, rank: Rank) {
        let aborted = self.abort.is_some();
        let st = &self.ranks[&rank];
        let reads = st.reads > 0 && !mutated(Mutation::RootCompletesBeforeReads);
        if st.out.completed || st.writes > 0 || reads {
            return;
        }
        let (done, from_segment) = if aborted {
            (true, false)
        } else {
            let (Some(v), Some(t)) = (&self.view, &self.topo) else {
                return;
            };
            let writer = self.targets.as_ref().and_then(|t| t.first());
            let region_full = writer
                .and_then(|w| self.ranks.get(w))
                .is_some_and(|w| w.written == v.n);
            let leader_hier = t.design == Design::Hier && v.at == 0;
            if rank == v.root {
                let reads = if mutated(Mutation::RootCompletesBeforeReads) {
                    self.next_read
                } else {
                    self.reads_done
                };
                // The root as the writer stays until its grant was last used.
                let writes = !leader_hier || writer != Some(&rank) || region_full;
                (reads == v.n && writes, false)
            } else if leader_hier {
                (region_full, true)
            } else if self.sealed.is_some() {
                (true, true)
            } else {
                // Flat, or a node's other SP fed chunks by a flat leader.
                let need = if mutated(Mutation::CompleteOneChunkEarly) && v.n > 1 {
                    v.n - 1
                } else {
                    v.n
                };
                (st.written >= need, false)
            }
        };
        if !done {
            return;
        }
        let st = self.ranks.get_mut(&rank).unwrap();
        let mut status = st.out.status;
        if aborted && mutated(Mutation::OkAfterAbort) {
            status = Status::Ok;
        }
        st.out.completed = true;
        self.completed += 1;
        self.actions.push_back(Action::Complete {
            rank,
            status,
            from_segment: from_segment && status.is_ok(),
        });
    }
}

impl Held {
    fn new(index: u64, len: u64) -> Held {
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
        !self.lost_sps.contains(&from) && self.slots.granted_to(slot.0 as usize, from)
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
        comm: CommId { leader: 0, id: 7 },
        seq: 0,
    };
    const CHUNK: u64 = 4;
    const SLOTS: u32 = 2;

    /// A copy or a move, as the test network executes them.
    #[derive(Clone, Debug)]
    enum Work {
        C(Copy<Tag>),
        M(Move),
    }

    /// The machine plus the `Chunk` messages of finished moves (the
    /// driver's job), which `poll` hands out first.
    struct Tb {
        m: Bcast<Tag>,
        out: VecDeque<Out<Msg, Work>>,
    }

    impl Machine for Tb {
        type Post = Post<Tag>;
        type Msg = Msg;
        type Copy = Work;

        fn create(sp: SpId) -> Self {
            Tb {
                m: Bcast::new(
                    KEY,
                    Config {
                        me: sp,
                        chunk_bytes: CHUNK,
                        staging_slots: SLOTS,
                    },
                ),
                out: VecDeque::new(),
            }
        }

        fn post(&mut self, now: Nanos, post: Post<Tag>) {
            self.m.handle_post(now, post).unwrap();
        }

        fn msg(&mut self, now: Nanos, from: SpId, msg: Msg) {
            self.m.handle_msg(now, from, msg).unwrap();
        }

        fn copy_done(&mut self, now: Nanos, w: &Work, status: Status) {
            match w {
                Work::C(c) => self.m.handle_copy_done(now, c.id, status),
                Work::M(mv) => {
                    if status.is_ok() {
                        self.out.push_back(Out::Send {
                            to: mv.to,
                            msg: mv.chunk_msg(),
                        });
                    }
                    self.m.handle_move_done(now, mv.id, status);
                }
            }
        }

        fn poll(&mut self) -> Option<Out<Msg, Work>> {
            if let Some(o) = self.out.pop_front() {
                return Some(o);
            }
            Some(match self.m.poll_action()? {
                Action::Send { to, msg } => Out::Send { to, msg },
                Action::Copy(c) => Out::Copy(Work::C(c)),
                Action::Move(m) => Out::Copy(Work::M(m)),
                Action::Complete { rank, status, .. } => Out::Complete { rank, status },
            })
        }

        fn check_copy(&self, _sp: SpId, w: &Work) {
            match w {
                Work::C(c) => assert!(c.len > 0 && c.len <= CHUNK, "{c:?}"),
                Work::M(m) => assert!(m.len > 0 && m.len <= CHUNK, "{m:?}"),
            }
        }
    }

    type Net = crate::sim::testnet::Net<Tb>;

    fn post(rank: Rank, root: Rank, len: u64, members: &[SpId], nodes: &[u32]) -> Post<Tag> {
        Post {
            rank,
            root,
            members: members.to_vec(),
            nodes: nodes.to_vec(),
            key: ('b', rank),
            len,
            design: Design::Flat,
            shared_key: None,
            shared_at: 0,
        }
    }

    /// Hierarchical; the SP places its region at `100 * sp`.
    fn hier(mut p: Post<Tag>) -> Post<Tag> {
        p.design = Design::Hier;
        p.shared_key = Some(('h', p.rank));
        p.shared_at = 100 * u64::from(p.members[p.rank as usize]);
        p
    }

    fn moves(net: &Net) -> Vec<Move> {
        net.copied
            .iter()
            .filter_map(|w| match w {
                Work::M(m) => Some(*m),
                Work::C(_) => None,
            })
            .collect()
    }

    fn copies(net: &Net) -> Vec<Copy<Tag>> {
        net.copied
            .iter()
            .filter_map(|w| match w {
                Work::C(c) => Some(c.clone()),
                Work::M(_) => None,
            })
            .collect()
    }

    /// Every rank posts a flat 10-byte broadcast from rank 0 on `sps` SPs;
    /// the net runs until quiet and every rank completed `Ok`.
    fn all_post_and_succeed(members: &[SpId], nodes: &[u32], sps: u32) -> Net {
        let mut net = Net::new(sps);
        for r in 0..members.len() as Rank {
            net.post(members[r as usize], post(r, 0, 10, members, nodes));
        }
        net.run();
        for r in 0..members.len() as Rank {
            assert_eq!(net.status(r), Some(Status::Ok), "rank {r}");
        }
        net
    }

    fn all_finished(net: &mut Net, sps: &[SpId]) {
        for &sp in sps {
            assert!(net.sp(sp).m.is_finished(), "sp {sp} not finished");
        }
    }

    #[test]
    fn tree_starts_at_the_root_sp_then_nodes_in_ring_order() {
        // Node 0: SPs 0, 1; node 1: SPs 2, 3; node 2: SP 4.
        let members = [0, 1, 2, 3, 4, 3, 2];
        let nodes = [0, 0, 1, 1, 2, 1, 1];
        let tree = |root| build_tree(&members, &nodes, root).unwrap();
        assert_eq!(tree(3), [vec![3, 2], vec![4], vec![0, 1]]);
        assert_eq!(tree(4), [vec![4], vec![0, 1], vec![2, 3]]);
        assert_eq!(tree(1), [vec![1, 0], vec![2, 3], vec![4]]);
        assert_eq!(
            build_tree(&[0, 0], &[0, 1], 0),
            Err(PostError::SpOnTwoNodes { sp: 0 })
        );
        // Leaders chain from node to node and fan out within their node.
        let v = View::new(3, 3, 8, 4, tree(3)).unwrap();
        assert!(v.is_top());
        assert_eq!((v.parent(), v.children()), (None, vec![4, 2]));
        let v = View::new(2, 3, 8, 4, tree(3)).unwrap();
        assert_eq!((v.parent(), v.children()), (Some(3), vec![]));
        let v = View::new(0, 3, 8, 4, tree(3)).unwrap();
        assert_eq!((v.parent(), v.children()), (Some(4), vec![1]));
        let v = View::new(1, 3, 8, 4, tree(3)).unwrap();
        assert_eq!((v.parent(), v.children()), (Some(0), vec![]));
    }

    #[test]
    fn a_node_leader_fans_out_to_its_nodes_other_sps() {
        // Node 0: SPs 0, 1; node 1: SPs 2, 3 (one rank each).
        let mut net = all_post_and_succeed(&[0, 1, 2, 3], &[0, 0, 1, 1], 4);
        // 3 chunks to each of SPs 1, 2 (both from SP 0) and 3 (from SP 2).
        let mv = moves(&net);
        assert_eq!(mv.len(), 9);
        for to in 1..4 {
            assert_eq!(mv.iter().filter(|m| m.to == to).count(), 3, "to SP {to}");
        }
        assert_eq!(net.sp(0).m.stats().chunks_forwarded, 6);
        assert_eq!(net.sp(2).m.stats().chunks_forwarded, 3);
        assert_eq!(net.sp(1).m.stats().chunks_forwarded, 0);
        assert_eq!(net.sp(3).m.stats().chunks_forwarded, 0);
        assert_eq!(net.sp(3).m.tree(), Some(&[vec![0, 1], vec![2, 3]][..]));
        all_finished(&mut net, &[0, 1, 2, 3]);
    }

    #[test]
    fn flat_pipeline_delivers_every_chunk_once_per_hop() {
        // Node 0: SP 0 (ranks 0, 3), node 1: SP 1 (rank 1), SP 2 (rank 2).
        let mut net = all_post_and_succeed(&[0, 1, 2, 0], &[0, 1, 1, 0], 3);
        // 3 chunks (4 + 4 + 2 bytes), two hops.
        let mv = moves(&net);
        assert_eq!(mv.len(), 6);
        assert_eq!(mv.iter().filter(|m| m.to == 1).count(), 3);
        assert_eq!(mv.iter().filter(|m| m.to == 2).count(), 3);
        assert_eq!(mv.iter().map(|m| m.len).sum::<u64>(), 20);
        let c = copies(&net);
        // Three reads from the root, three writes into each non-root rank.
        assert_eq!(c.iter().filter(|c| c.rank == 0).count(), 3);
        for r in 1..4 {
            let into: Vec<_> = c.iter().filter(|c| c.rank == r).collect();
            assert_eq!(into.len(), 3, "rank {r}");
            assert!(into.iter().all(|c| matches!(
                c.dst,
                Loc::Host { key: ('b', k), offset } if k == r && offset == c.chunk * CHUNK
            )));
        }
        for sp in 0..3 {
            let s = net.sp(sp).m.stats();
            assert!(s.max_slots_in_use as usize <= SLOTS as usize, "{s:?}");
            assert_eq!(s.bytes_staged, 10);
        }
        assert_eq!(net.sp(0).m.stats().chunks_forwarded, 3);
        assert_eq!(net.sp(2).m.stats().chunks_forwarded, 0);
        all_finished(&mut net, &[0, 1, 2]);
    }

    #[test]
    fn late_sp_forwards_what_fits_in_staging_and_catches_up() {
        // Chain 0 -> 1 -> 2 (one SP per node); SP 1's rank posts last.
        let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
        let mut net = Net::new(3);
        net.post(2, post(2, 0, 10, &members, &nodes));
        net.post(0, post(0, 0, 10, &members, &nodes));
        net.run();
        // SP 1 learned the tree from SP 0's Open and forwarded the two
        // chunks its two slots hold; the root's SP read all three.
        assert_eq!(net.sp(1).m.tree(), Some(&[vec![0], vec![1], vec![2]][..]));
        assert_eq!(net.sp(1).m.stats().chunks_forwarded, 2);
        assert_eq!(net.sp(1).m.slots_in_use(), 2);
        assert_eq!(net.status(0), Some(Status::Ok));
        assert_eq!(net.status(2), None);
        net.post(1, post(1, 0, 10, &members, &nodes));
        net.run();
        assert_eq!(net.status(1), Some(Status::Ok));
        assert_eq!(net.status(2), Some(Status::Ok));
        all_finished(&mut net, &[0, 1, 2]);
    }

    #[test]
    fn a_one_chunk_message_passes_an_sp_whose_rank_has_not_posted() {
        let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
        let mut net = Net::new(3);
        net.post(0, post(0, 0, 3, &members, &nodes));
        net.post(2, post(2, 0, 3, &members, &nodes));
        net.run();
        assert_eq!(net.status(0), Some(Status::Ok));
        assert_eq!(net.status(2), Some(Status::Ok));
        assert_eq!(net.status(1), None);
        net.post(1, post(1, 0, 3, &members, &nodes));
        net.run();
        assert_eq!(net.status(1), Some(Status::Ok));
        all_finished(&mut net, &[0, 1, 2]);
    }

    #[test]
    fn hier_writes_each_chunk_once_into_the_writers_segment() {
        // SP 0: root 0 and rank 3; SP 1: ranks 1, 2, 4.
        let (members, nodes) = ([0, 1, 1, 0, 1], [0, 1, 1, 0, 1]);
        let mut net = Net::new(2);
        for r in [4, 2, 0, 3, 1] {
            net.post(members[r as usize], hier(post(r, 0, 9, &members, &nodes)));
        }
        net.run();
        for r in 0..5 {
            assert_eq!(net.status(r), Some(Status::Ok), "rank {r}");
        }
        let c = copies(&net);
        let writes: Vec<_> = c.iter().filter(|c| c.rank != 0).collect();
        // SP 0 writes into rank 3's segment, SP 1 into rank 1's: 3 chunks each.
        assert_eq!(writes.len(), 6);
        assert!(writes.iter().all(|c| matches!(
            c.dst,
            Loc::Host { key: ('h', k), .. } if k == c.rank && (k == 1 || k == 3)
        )));
        all_finished(&mut net, &[0, 1]);
    }

    #[test]
    fn a_hier_leader_writes_the_node_region_once_and_seals_it_for_its_nodes_other_sps() {
        // Node 0: SP 0 (root 0, rank 3), SP 1 (ranks 1, 4); node 1: SP 2
        // (rank 2), SP 3 (rank 5).
        let (members, nodes) = ([0, 1, 2, 0, 1, 3], [0, 0, 1, 0, 0, 1]);
        let mut net = Net::new(4);
        for r in [5, 4, 2, 1, 3, 0] {
            net.post(members[r as usize], hier(post(r, 0, 20, &members, &nodes)));
        }
        net.run();
        for r in 0..6 {
            assert_eq!(net.status(r), Some(Status::Ok), "rank {r}");
        }
        // Only the chain of leaders moves chunks: 5 chunks, SP 0 -> SP 2.
        let mv = moves(&net);
        assert_eq!(mv.len(), 5, "{mv:?}");
        assert!(mv.iter().all(|m| m.to == 2));
        // Each leader writes each chunk once, into its region; the other SPs
        // write nothing.
        let w: Vec<_> = copies(&net)
            .into_iter()
            .filter(|c| matches!(c.dst, Loc::Host { .. }))
            .map(|c| c.dst)
            .collect();
        assert_eq!(
            w.iter()
                .filter(|d| matches!(d, Loc::Host { key: ('h', 3), .. }))
                .count(),
            5
        );
        assert_eq!(
            w.iter()
                .filter(|d| matches!(d, Loc::Host { key: ('h', 2), .. }))
                .count(),
            5
        );
        assert_eq!(w.len(), 10, "{w:?}");
        // The other SPs' ranks copy out of their leader's region.
        assert_eq!(net.sp(1).m.segment_source(), Some((0, 0, 20)));
        assert_eq!(net.sp(3).m.segment_source(), Some((2, 200, 20)));
        assert_eq!(net.sp(0).m.segment_source(), Some((0, 0, 20)));
        assert_eq!(net.sp(0).m.stats().regions_shared, 1);
        assert_eq!(net.sp(2).m.stats().regions_shared, 1);
        all_finished(&mut net, &[0, 1, 2, 3]);
    }

    #[test]
    fn a_root_alone_on_its_sp_writes_the_region_through_its_own_grant() {
        // SP 0 serves only the root; SP 1, same node, ranks 1 and 2.
        let (members, nodes) = ([0, 1, 1], [0, 0, 0]);
        let mut net = Net::new(2);
        for r in [1, 2, 0] {
            net.post(members[r as usize], hier(post(r, 0, 9, &members, &nodes)));
        }
        net.run();
        for r in 0..3 {
            assert_eq!(net.status(r), Some(Status::Ok), "rank {r}");
        }
        let w: Vec<_> = copies(&net)
            .into_iter()
            .filter(|c| matches!(c.dst, Loc::Host { .. }))
            .collect();
        assert_eq!(w.len(), 3);
        assert!(w.iter().all(|c| c.dst
            == Loc::Host {
                key: ('h', 0),
                offset: c.chunk * 4
            }));
        assert!(moves(&net).is_empty());
        assert_eq!(net.sp(1).m.segment_source(), Some((0, 0, 9)));
        all_finished(&mut net, &[0, 1]);
    }

    #[test]
    fn a_flat_leader_feeds_its_nodes_hier_sps_chunk_by_chunk() {
        // The leader had no segment room (its driver posts flat); SP 1 is
        // hierarchical: it gets the chunks and writes its ranks' buffers.
        let (members, nodes) = ([0, 1, 1], [0, 0, 0]);
        let mut net = Net::new(2);
        net.post(1, hier(post(1, 0, 9, &members, &nodes)));
        net.post(1, hier(post(2, 0, 9, &members, &nodes)));
        net.post(0, post(0, 0, 9, &members, &nodes));
        net.run();
        for r in 0..3 {
            assert_eq!(net.status(r), Some(Status::Ok), "rank {r}");
        }
        assert_eq!(moves(&net).len(), 3);
        let w: Vec<_> = copies(&net)
            .into_iter()
            .filter(|c| matches!(c.dst, Loc::Host { .. }))
            .collect();
        assert_eq!(w.len(), 6);
        assert!(w.iter().all(|c| matches!(
            c.dst,
            Loc::Host {
                key: ('b', 1 | 2),
                ..
            }
        )));
        assert_eq!(net.sp(1).m.segment_source(), None);
        all_finished(&mut net, &[0, 1]);
    }

    #[test]
    fn a_flat_post_after_its_leader_sealed_aborts() {
        let (members, nodes) = ([0, 0, 1], [0, 0, 0]);
        let mut m: Bcast<Tag> = Bcast::new(
            KEY,
            Config {
                me: 1,
                chunk_bytes: 8,
                staging_slots: 2,
            },
        );
        let open = Msg::Open {
            root: 0,
            len: 5,
            chunk_bytes: 8,
            tree: vec![vec![0, 1]],
        };
        m.handle_msg(0, 0, open).unwrap();
        assert_eq!(
            m.handle_msg(1, 2, Msg::Sealed { at: 7 }),
            Err(MsgError::UnexpectedSeal { sp: 2 }),
            "only the leader seals"
        );
        m.handle_msg(1, 0, Msg::Sealed { at: 7 }).unwrap();
        assert_eq!(m.slots_in_use(), 0, "the grants to the leader are void");
        assert_eq!(
            m.handle_msg(1, 0, Msg::Sealed { at: 7 }),
            Err(MsgError::UnexpectedSeal { sp: 0 })
        );
        m.handle_post(2, post(2, 0, 5, &members, &nodes)).unwrap();
        let acts: Vec<_> = std::iter::from_fn(|| m.poll_action()).collect();
        assert!(
            acts.contains(&Action::Complete {
                rank: 2,
                status: Status::InvalidPost,
                from_segment: false
            }),
            "{acts:?}"
        );
    }

    #[test]
    fn hier_completions_say_copy_from_the_segment() {
        let (members, nodes) = ([0, 1, 1], [0, 1, 1]);
        let mut m: Bcast<Tag> = Bcast::new(
            KEY,
            Config {
                me: 1,
                chunk_bytes: 8,
                staging_slots: 1,
            },
        );
        m.handle_post(0, hier(post(2, 0, 5, &members, &nodes)))
            .unwrap();
        m.handle_msg(
            1,
            0,
            Msg::Open {
                root: 0,
                len: 5,
                chunk_bytes: 8,
                tree: vec![vec![0], vec![1]],
            },
        )
        .unwrap();
        let mut acts: Vec<_> = std::iter::from_fn(|| m.poll_action()).collect();
        assert!(
            matches!(&acts[..], [Action::Send { to: 0, msg: Msg::Credit { slots, .. } }] if slots == &[SlotId(0)])
        );
        assert!(m.may_fill(0, SlotId(0)));
        assert!(!m.may_fill(2, SlotId(0)) && !m.may_fill(0, SlotId(1)));
        m.handle_msg(
            2,
            0,
            Msg::Chunk {
                index: 0,
                slot: SlotId(0),
                len: 5,
            },
        )
        .unwrap();
        // The writer (rank 1) has not posted: the chunk waits in staging.
        assert!(m.poll_action().is_none());
        assert!(!m.may_fill(0, SlotId(0)), "the slot holds a chunk");
        assert_eq!(m.slots_in_use(), 1);
        m.handle_post(3, hier(post(1, 0, 5, &members, &nodes)))
            .unwrap();
        acts = std::iter::from_fn(|| m.poll_action()).collect();
        let [Action::Copy(c)] = &acts[..] else {
            panic!("{acts:?}")
        };
        assert_eq!(
            (c.rank, &c.src, &c.dst),
            (
                1,
                &Loc::Stage {
                    slot: SlotId(0),
                    offset: 0
                },
                &Loc::Host {
                    key: ('h', 1),
                    offset: 0
                }
            )
        );
        m.handle_copy_done(4, c.id, Status::Ok);
        acts = std::iter::from_fn(|| m.poll_action()).collect();
        assert_eq!(
            acts,
            [
                Action::Complete {
                    rank: 1,
                    status: Status::Ok,
                    from_segment: true
                },
                Action::Complete {
                    rank: 2,
                    status: Status::Ok,
                    from_segment: true
                }
            ]
        );
        assert!(m.is_finished());
    }

    #[test]
    fn zero_bytes_still_pass_the_tree_without_copies() {
        let (members, nodes) = ([0, 1, 2, 2], [0, 1, 1, 1]);
        let mut net = Net::new(3);
        for r in 0..4 {
            net.post(members[r as usize], post(r, 2, 0, &members, &nodes));
        }
        net.run();
        assert!(net.copied.is_empty());
        for r in 0..4 {
            assert_eq!(net.status(r), Some(Status::Ok));
        }
        all_finished(&mut net, &[0, 1, 2]);
    }

    #[test]
    fn a_length_mismatch_aborts_everyone() {
        let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
        let mut net = Net::new(3);
        net.post(0, post(0, 0, 10, &members, &nodes));
        net.post(1, post(1, 0, 10, &members, &nodes));
        net.post(2, post(2, 0, 11, &members, &nodes));
        net.run();
        assert_eq!(net.status(2), Some(Status::CountMismatch));
        for r in 0..3 {
            assert!(net.status(r).is_some(), "rank {r}");
        }
        // SP 2 never wrote into the rank whose length disagrees.
        assert!(!copies(&net).iter().any(|c| c.rank == 2));
        all_finished(&mut net, &[0, 1, 2]);
    }

    /// Ranks 0 and 1 name root 0, ranks 2 and 3 root 2: the two views'
    /// trees (on one node: 0 leading 1 2 3, and 2 leading 3 0 1; on two:
    /// 0 1 then 2 3, and 2 3 then 0 1) meet only where an Open or a Credit
    /// crosses.
    #[test]
    fn disagreeing_roots_are_detected_without_a_hang() {
        let members = [0, 1, 2, 3];
        for nodes in [[0, 0, 0, 0], [0, 0, 1, 1]] {
            let mut net = Net::new(4);
            for r in 0..4 {
                let root = if r < 2 { 0 } else { 2 };
                net.post(r, post(r, root, 6, &members, &nodes));
            }
            net.run();
            for r in 0..4 {
                let s = net.status(r).unwrap_or_else(|| panic!("rank {r} hangs"));
                // Rank 1 may complete Ok: its post agrees with root 0's.
                assert!(r == 1 || !s.is_ok(), "nodes {nodes:?} rank {r}: {s}");
            }
            all_finished(&mut net, &[0, 1, 2, 3]);
        }
    }

    #[test]
    fn rank_lost_before_posting_fails_every_rank() {
        let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
        let mut net = Net::new(3);
        net.sp(1).m.handle_rank_lost(0, 1);
        net.post(0, post(0, 0, 10, &members, &nodes));
        net.post(2, post(2, 0, 10, &members, &nodes));
        net.run();
        assert_eq!(net.status(0), Some(Status::RankFailed));
        assert_eq!(net.status(2), Some(Status::RankFailed));
        assert_eq!(net.status(1), None);
        all_finished(&mut net, &[0, 2]);
    }

    #[test]
    fn middle_sp_lost_mid_pipeline() {
        let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
        let mut net = Net::new(3);
        for r in 0..3 {
            net.post(r, post(r, 0, 30, &members, &nodes));
        }
        // Let a few chunks through, then SP 1 dies.
        for _ in 0..6 {
            net.deliver_all();
            net.finish_copy(Status::Ok);
        }
        net.dead.insert(1);
        for sp in [0, 2] {
            net.sp(sp).m.handle_peer_lost(100, 1);
            net.collect(sp);
        }
        net.run();
        assert_eq!(net.status(0), Some(Status::PeerFailed));
        assert_eq!(net.status(2), Some(Status::PeerFailed));
        all_finished(&mut net, &[0, 2]);
    }

    #[test]
    fn failed_move_gives_the_slot_back() {
        let (members, nodes) = ([0, 1], [0, 1]);
        let mut net = Net::new(2);
        for r in 0..2 {
            net.post(r, post(r, 0, 8, &members, &nodes));
        }
        net.deliver_all();
        // The read, then the move, fails.
        assert!(net.finish_copy(Status::Ok));
        net.deliver_all();
        let i = net
            .copies
            .iter()
            .position(|(_, w)| matches!(w, Work::M(_)))
            .unwrap();
        let w = net.copies.remove(i).unwrap();
        net.copies.push_front(w);
        assert!(net.finish_copy(Status::AccessError));
        net.run();
        assert_eq!(net.status(0), Some(Status::AccessError));
        assert_eq!(net.status(1), Some(Status::AccessError));
        all_finished(&mut net, &[0, 1]);
    }

    #[test]
    fn credits_never_exceed_the_chunks_expected() {
        let mut m: Bcast<Tag> = Bcast::new(
            KEY,
            Config {
                me: 1,
                chunk_bytes: 100,
                staging_slots: 8,
            },
        );
        m.handle_post(0, post(1, 0, 150, &[0, 1], &[0, 1])).unwrap();
        let acts: Vec<_> = std::iter::from_fn(|| m.poll_action()).collect();
        assert!(
            matches!(&acts[..], [Action::Send { to: 0, msg: Msg::Credit { root: 0, len: 150, chunk_bytes: 100, slots } }] if slots.len() == 2),
            "{acts:?}"
        );
    }

    #[test]
    fn invalid_posts_are_rejected() {
        let mut m: Bcast<Tag> = Bcast::new(
            KEY,
            Config {
                me: 0,
                chunk_bytes: 4,
                staging_slots: 2,
            },
        );
        let mut p = post(0, 0, 4, &[0, 1], &[0, 1]);
        p.design = Design::Hier;
        assert_eq!(
            m.handle_post(0, p),
            Err(PostError::MissingSharedKey { rank: 0 })
        );
        assert_eq!(
            m.handle_post(0, post(0, 2, 4, &[0, 1], &[0, 1])),
            Err(PostError::RootOutOfRange { root: 2, size: 2 })
        );
        assert_eq!(
            m.handle_post(0, post(1, 0, 4, &[0, 1], &[0, 1])),
            Err(PostError::NotMine {
                rank: 1,
                served_by: 1
            })
        );
        assert!(m.members().is_none() && m.poll_action().is_none());
    }
}
