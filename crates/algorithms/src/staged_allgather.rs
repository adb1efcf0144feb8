//! Staged `Iallgather` progressed by service processes (after the BluesMPI
//! BlueField-2 designs: each DPU gathers its node's send blocks into DPU
//! memory with RDMA reads, then RDMA-writes them into every rank's receive
//! buffer (*flat*) or once into each node's shared segment that the hosts
//! copy from in `MPI_Wait` (*hierarchical*)).
//!
//! Every comm rank sends `len` bytes; the block of comm rank `s` lands at
//! offset `s * len` of every receive buffer (`P * len` bytes, P the comm
//! size). One [`StagedAllgather`] object exists per collective instance
//! ([`CollKey`]) per SP. The algorithm never holds bytes: data live in host
//! grants (keys `K`) and in the SP's *staging slots*, `Config::staging_slots`
//! buffers of `Config::chunk_bytes` each, named by [`SlotId`]s. Both numbers
//! come from the configuration, never from a user count.
//!
//! # Protocol
//!
//! *View.* An SP forms its view `(len, members, nodes, design)` from its
//! first local post. The *member SPs* are the SPs serving comm ranks; the
//! *local ranks* of an SP are those it serves. A block is cut into
//! `n = ceil(len / chunk_bytes)` chunks (none for `len == 0`); chunk `i` of
//! block `s` covers bytes `i * chunk_bytes ..` of the block and lands at
//! `s * len + i * chunk_bytes`. The comm is summarised by [`comm_digest`]
//! of `members` and `nodes`.
//!
//! *Announcing where data go.* How an SP receives follows from its posts
//! ([`Design`]; the engine may fall back to flat on one SP when it has no
//! segment room, so designs may mix across SPs). A node's *owner* is its
//! lowest member SP; it holds the node's region in the hierarchical design:
//! * flat: when a local rank posts, its SP sends `Key { rank, key }` (the
//!   rank's receive buffer) to every other member SP;
//! * hierarchical, at an owner: with its first local post the SP sends
//!   `Region { rank, key }` once to every other member SP, `key` being the
//!   `shared_key` of that rank: its region of the node segment of `P * len`
//!   bytes (at `shared_at` in the segment), laid out like a receive buffer,
//!   which every rank of the node reads;
//! * hierarchical, at another SP of a node: it waits for its owner's
//!   announcement (every SP that is not its node's owner sends the owner
//!   `Waiting` with its first local post, whatever its design, so that an
//!   owner that aborts before it announces anything still owes it a
//!   `Stopped`, and an owner finishes only after every such message). A
//!   `Region` makes it *covered*: it sends `Covered` to
//!   every other member SP, and nobody writes into its ranks (they read
//!   the owner's region). A `Key` (the owner delivers flat) makes it flat:
//!   it sends the `Key`s of its ranks. So in the hierarchical design a
//!   node's ranks wait for their owner's first post.
//!
//! Both carry `len` and the comm digest, which every receiver checks
//! against its view. Keys that arrive before the receiver has a view wait
//! (checked when it forms one).
//!
//! *Gather.* Each SP reads its posted local ranks' send blocks chunk by
//! chunk into free slots ([`Action::Copy`] from [`Loc::Host`] (send key) to
//! [`Loc::Stage`]); reads stop while no slot is free.
//!
//! *Write.* A staged chunk is written into every *target unit*: every rank
//! of a flat SP and the region of every owner (a covered SP has none),
//! this SP's own included ([`Loc::Stage`] to [`Loc::Host`] at `s * len + i *
//! chunk_bytes`). The writer visits the nodes round-robin starting at its
//! own node, one unit of each node in turn (a node's units: SP by SP, its
//! SPs rotated by the writer's index on its own node; a hierarchical SP is
//! one unit), so that writers on different nodes target different nodes,
//! and one writer's concurrent writes go to different nodes, at any time.
//! A unit whose key is not known yet (the rank, or every rank of its SP,
//! has not posted) is skipped and remembered on the chunk; the write is
//! issued as soon as the key arrives (*late arrival*). The slot is freed
//! when every unit has the chunk: the slots of a chunk stalled by a late
//! rank stay full, and once all are full reads stop, until that rank
//! posts. A hierarchical SP's region takes every block as soon as its
//! first rank posted, whatever its other ranks do.
//!
//! *Written.* Only a writer knows when its copies finished. Once an SP has
//! written every chunk of every local block into a unit, it tells the
//! unit's SP: `Written { ranks }` (flat; one message per writer SP and
//! target rank, batched when several finish together) or `WrittenRegion`
//! (hierarchical: per writer SP and target SP). A writer never writes into
//! a unit after that.
//!
//! *Completion.* A local rank completes `Ok` when its own send block was
//! read completely (no read in flight: MPI lets it reuse the send buffer)
//! and, flat, every member SP (this one included) reported `Written` for
//! it, or, at an owner, every member SP reported `WrittenRegion` for this
//! SP, or, at a covered SP, its owner sent `RegionDone { at }` (which it
//! does, to each covered SP of its node, once every member SP reported
//! `WrittenRegion`): then it completes with `from_segment: true` and the
//! host copies `P * len` bytes out of the owner's region
//! ([`StagedAllgather::segment_source`]) into its receive buffer in
//! `MPI_Wait`. The driver keeps an owner's region until the ranks of the
//! covered SPs copied out of it.
//!
//! *Progress (no deadlock).* Nothing an SP does waits for another SP's
//! progress, only for posts: a read waits for a free slot, a slot for the
//! writes of its chunk, a write for its unit's key, and a key is sent when
//! its rank (flat) or its SP's first rank (hierarchical) posts. So once
//! every rank posted, every key reaches every member SP, every staged chunk
//! is written everywhere and freed, every block gets read, every `Written`
//! is sent and every rank completes. A late rank stalls each SP after it
//! filled its slots; its post unblocks them. Staging is bounded by
//! `staging_slots * chunk_bytes` per instance per SP, whatever `len` or P.
//!
//! *Consistency of posts.* Local posts are checked against the view:
//! another `len` aborts with `CountMismatch`; other `members`/`nodes` or
//! another design abort with `InvalidPost` (such a post is accepted, so its
//! rank completes with the error; structurally invalid posts are rejected
//! with a [`PostError`]). Every `Key`/`Region` is checked on arrival: `len`
//! (`CountMismatch`), digest, sender serving the rank in the receiver's
//! view, one design per SP (`InvalidPost`); `Covered` and `Waiting` are
//! checked alike (`len`, digest, sender a member SP that is not an owner,
//! and for `Waiting` of the receiver's node). A flat rank completes `Ok`
//! only with `Written` from every SP of its view, an owner's rank only with
//! `WrittenRegion` from every SP of its view, and an SP sends either only
//! after it checked the target's `Key` or `Region` against its own view and
//! after all its own local ranks posted in agreement with that view. A
//! covered rank completes `Ok` only with `RegionDone`, which its owner
//! sends only once its own ranks could complete `Ok` (every `WrittenRegion`
//! in), and only to an SP whose `Covered` it checked; the covered SP in
//! turn checked the owner's `Region`, and its own `WrittenRegion` to the
//! owner is among those. So an `Ok` rank proves that every member SP had
//! the same view and that every rank of the comm posted in agreement with
//! it: its buffer holds the right blocks at the right places. Once every SP involved has a post, a
//! disagreement is always detected by some SP: an SP with view V sends
//! keys to every SP of V, and an SP of V that holds another view aborts on
//! them (a rank that never posts leaves nobody `Ok` anyway).
//!
//! # Failure handling and the stop handshake
//!
//! Local abort, loss of a local rank that has not completed, loss of a
//! member SP, a failed copy and disagreeing posts abort the instance with
//! the matching [`Status`]. An aborted SP never starts a read or write
//! again and sends no keys. Writers are remote, so a rank cannot complete
//! with an error as soon as its SP aborts: some other SP may still be
//! writing into it. Hence *Stopped*: an aborted SP sends
//! `Stopped { status }` to every SP of its view and to every SP it heard
//! from, once none of its own writes into that SP's ranks or region is in
//! flight (if some are, it sends `Abort` at once, `Stopped` when they
//! finished). `Stopped` means: "aborted, no write of mine into your ranks
//! or region is in flight, and none will start". Receiving `Abort` or
//! `Stopped` aborts the receiver, which in turn informs everybody, so an
//! abort reaches every live SP of the view. An SP without a view (no local
//! post yet) has no keys, hence no writes: it answers at once. A rank that
//! posts at an aborted SP sends no key and completes after the handshake.
//! Nothing here relies on messages between two SPs arriving in order.
//!
//! An aborted SP completes a posted local rank (with the abort status) once
//! (1) no read of its send buffer and no write of this SP into its buffer
//! or into this SP's region is in flight, and (2) every other SP `w` of the
//! view has sent `Stopped`, or has sent `Written` for that rank (flat) /
//! `WrittenRegion` (hierarchical), or was lost. (2) is void for an SP that
//! sent no `Key` or `Region` (covered, or still waiting for its owner):
//! nobody has a key to write into its ranks.
//!
//! *Why nothing writes into a buffer after its rank completed.* Only a
//! copy issued by an SP writes, and an SP writes into a rank's buffer (a
//! region) only through the key that rank's SP sent it, which that SP sends
//! only to the SPs of its view. Take a rank `r` of SP `a` that completes
//! and any SP `w != a` of `a`'s view. If `w` sent `Written` for `r`: all its
//! writes into `r` finished before, and it issues each (chunk, unit) write
//! once, so it never writes into `r` again. If `w` sent `Stopped`: it was
//! aborted when it sent it, had no write into `a`'s ranks in flight, and an
//! aborted SP never starts one. If `w` was lost: its copies die with it
//! (a copy is executed by the SP that issues it). `a`'s own writes are
//! covered by (1) and, on the `Ok` path, by its own `Written`. SPs outside
//! `a`'s view never got `a`'s keys. Reads of a send buffer are done only by
//! the rank's own SP, which waits for them. The same argument covers the
//! region of a hierarchical SP: all its ranks complete under the same
//! condition.
//!
//! *Why every posted rank completes (bounded time).* Without a fault, by
//! the progress argument. With one, every live SP of the view aborts (an
//! abort is announced to every SP of the aborting SP's view and to every SP
//! it heard from, and every SP that aborts does the same), drains the
//! copies it has in flight (bounded), then sends `Stopped` to every SP that
//! can be waiting for it; lost SPs count as stopped. A finished SP that
//! completed `Ok` sent `Written` for every unit, so nobody waits for its
//! `Stopped`; a finished aborted SP sent `Stopped` to all SPs of its view.
//! Only an SP that is *not* in the finished SP's view (different comms
//! posted under one key) may later send it a `Key` or `Abort` that needs an
//! answer: see [`refusal`].
//!
//! # Driver obligations
//!
//! Route `Action::Send` (tagged with the `CollKey`; `Key`/`Region` carry
//! keys `K` that must be usable by the receiving SP); execute every
//! `Action::Copy` and report it exactly once with `handle_copy_done` (a
//! dropped copy with an error status); keep each instance's staging
//! (`staging_slots * chunk_bytes` bytes) and a hierarchical SP's region
//! until the instance `is_finished` and its hosts copied out; check every
//! post against the rank's grants before `handle_post` (`send_key` holds
//! `len` bytes, `recv_key` and, hierarchical, `shared_key` `P * len`).
//! A message that reaches an SP where the instance is finished or gone is
//! answered with [`refusal`]. This is needed only when ranks posted
//! different comms under one key: with agreeing posts, whatever reaches a
//! finished instance (a late `Abort` or `Stopped`) may be dropped, and the
//! simulator runs that way. Chunk sizes may differ between SPs.

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
/// driver against the rank's grants).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Post<K> {
    pub rank: Rank,
    /// SP serving each comm rank; its length is the comm size P.
    pub members: Vec<SpId>,
    /// Node of each comm rank.
    pub nodes: Vec<u32>,
    /// The send block: `len` bytes at offset 0.
    pub send_key: K,
    /// The receive buffer: `P * len` bytes, block `s` at `s * len`.
    pub recv_key: K,
    /// Bytes sent by every rank (the block size).
    pub len: u64,
    pub design: Design,
    /// `Design::Hier`: this SP's region of the node segment (`P * len`
    /// bytes), written through this rank's grant; required at a node's
    /// owner, ignored elsewhere and for flat.
    pub shared_key: Option<K>,
    /// Where `shared_key`'s region starts in the node segment (what the
    /// node's ranks are told to copy from).
    pub shared_at: u64,
}

/// SP-to-SP messages of this collective (the driver adds the `CollKey`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg<K> {
    /// Flat: write every block into `key`, the receive buffer of `rank`
    /// (served by the sender). `len` and `comm` ([`comm_digest`]) are the
    /// sender's view, for the consistency check.
    Key {
        rank: Rank,
        len: u64,
        comm: u64,
        key: K,
    },
    /// Hierarchical: write every block once into `key`, the sender's
    /// region (the `shared_key` of its local `rank`), laid out like a
    /// receive buffer.
    Region {
        rank: Rank,
        len: u64,
        comm: u64,
        key: K,
    },
    /// From an SP that is not its node's owner, to the owner, with its
    /// first local post (any design): a hierarchical one waits for the
    /// owner's announcement.
    Waiting { len: u64, comm: u64 },
    /// Hierarchical, from an SP that is not its node's owner, after the
    /// owner's `Region`: write nothing into the sender's ranks (they read
    /// the owner's region). `len` and `comm` as in `Key`.
    Covered { len: u64, comm: u64 },
    /// From an owner to a covered SP of its node: every member SP wrote
    /// everything into the owner's region, which starts at `at` of the
    /// node segment.
    RegionDone { at: u64 },
    /// The sender wrote every block of its local ranks into these ranks of
    /// the receiver, and will never write into them again.
    Written { ranks: Vec<Rank> },
    /// The sender wrote every block of its local ranks into the receiver's
    /// region, and will never write into it again.
    WrittenRegion,
    /// The collective failed; stop (a `Stopped` follows).
    Abort { status: Status },
    /// The sender aborted with `status`, none of its writes into the
    /// receiver's ranks or region is in flight, and none will start.
    Stopped { status: Status },
}

impl<K> Msg<K> {
    /// The memory keys the message carries (an SP checks where a peer's keys point).
    pub fn keys(&self) -> Vec<&K> {
        match self {
            Msg::Key { key, .. } | Msg::Region { key, .. } => vec![key],
            Msg::Waiting { .. }
            | Msg::Covered { .. }
            | Msg::RegionDone { .. }
            | Msg::Written { .. }
            | Msg::WrittenRegion
            | Msg::Abort { .. }
            | Msg::Stopped { .. } => Vec::new(),
        }
    }
}

/// Copy `len` bytes of chunk `chunk` of the block of comm rank `block`
/// from `src` to `dst`, on this SP. Either a read from the send buffer of
/// local rank `rank == block` into a slot, or a write from a slot into the
/// receive buffer of rank `rank` (any comm rank, flat) or into the region of
/// SP `sp` named by the `shared_key` of its rank `rank` (hierarchical).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copy<K> {
    pub id: CopyId,
    /// The rank whose grant is the `Loc::Host` end.
    pub rank: Rank,
    /// The SP serving `rank` (this SP for reads).
    pub sp: SpId,
    /// The comm rank whose block the bytes are.
    pub block: Rank,
    pub chunk: u64,
    pub src: Loc<K>,
    pub dst: Loc<K>,
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
    /// `from_segment` (only with `Status::Ok`, hierarchical design): the
    /// data are in the region, not in the rank's buffer; the host copies
    /// `P * len` bytes from offset 0 of its `shared_key` region into its
    /// receive buffer before returning from the wait.
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
    NotMine {
        rank: Rank,
        served_by: SpId,
    },
    LengthMismatch {
        field: &'static str,
        len: usize,
        expected: usize,
    },
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
    /// `P * len` overflows `u64`.
    Overflow {
        rank: Rank,
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
            PostError::SpOnTwoNodes { sp } => write!(f, "SP {sp} serves ranks on two nodes"),
            PostError::DuplicatePost { rank } => write!(f, "rank {rank} posted twice"),
            PostError::RankLost { rank } => write!(f, "rank {rank} was declared lost"),
            PostError::MissingSharedKey { rank } => {
                write!(
                    f,
                    "rank {rank}: hierarchical allgather without a shared segment"
                )
            }
            PostError::Overflow { rank } => {
                write!(f, "rank {rank}: comm size times block length overflows")
            }
        }
    }
}

impl std::error::Error for PostError {}

/// A protocol violation by a peer; the instance is unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MsgError {
    /// A second `Key` for the same rank, or `Region` from the same SP.
    Duplicate { sp: SpId },
    /// A `Written`/`WrittenRegion` this SP cannot have asked for (no view,
    /// not a posted flat local rank, not hierarchical, twice, or from an SP
    /// outside the view).
    Unexpected { sp: SpId },
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
    /// Bytes read from local send buffers into staging.
    pub bytes_staged: u64,
    /// Chunk reads finished `Ok`.
    pub chunk_reads: u64,
    /// Chunk writes (into buffers or regions) finished `Ok`.
    pub chunk_writes: u64,
    /// Most staging slots in use at once (being read, or holding a chunk);
    /// never above `Config::staging_slots`.
    pub max_slots_in_use: u32,
    /// Writes that waited for a late key: the chunk was staged before its
    /// unit's key (rank or region) was known here.
    pub writes_waited_for_key: u64,
    /// `Key`/`Region`/`Covered` messages that arrived before any local post.
    pub keys_before_post: u64,
    /// `Written` messages sent (each may name several ranks), plus
    /// `WrittenRegion` messages.
    pub written_msgs: u64,
    /// `RegionDone` sent: covered SPs of this owner's node whose ranks
    /// copied out of its region.
    pub regions_shared: u64,
    /// `handle_copy_done` calls for unknown ids (ignored).
    pub unknown_done: u64,
    /// Messages ignored because their sender was declared lost.
    pub ignored_from_lost_sp: u64,
}

/// Deliberately broken variants, switched on per test thread by the
/// simulator's tests to show that its checkers catch them. Compiled out of
/// non-test builds.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mutation {
    /// Free a slot once all its writes were issued, not finished.
    FreeWhileWriting,
    /// Flat ranks complete with `Written` from half of the SPs.
    CompleteEarly,
    /// Aborted ranks complete without waiting for remote writers' `Stopped`
    /// (only for their SP's own copies).
    SkipStopHandshake,
    /// Aborted ranks complete without waiting for reads of their send
    /// buffer.
    IgnoreReadsOnAbort,
    /// Ranks complete `Ok` after an abort.
    OkAfterAbort,
}

mutation_switch!(Mutation);

/// Digest of a communicator's `members` and `nodes` (FNV-1a over their
/// little-endian bytes and lengths), the same on every SP.
pub fn comm_digest(members: &[SpId], nodes: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(members.len() as u64);
    for &m in members {
        eat(m as u64);
    }
    eat(nodes.len() as u64);
    for &n in nodes {
        eat(n as u64);
    }
    h
}

/// The owner of `sp`'s node in a communicator: the lowest SP serving a
/// member on that node (`None` if `sp` serves none or an SP serves two
/// nodes).
pub fn node_owner(members: &[SpId], nodes: &[u32], sp: SpId) -> Option<SpId> {
    let sp_node = sp_nodes(members, nodes).ok()?;
    let node = *sp_node.get(&sp)?;
    sp_node
        .iter()
        .filter(|&(_, &n)| n == node)
        .map(|(&s, _)| s)
        .min()
}

/// The answer an SP sends back to the sender of `msg` when the instance is
/// finished or gone there (its ranks will never post or have all
/// completed, so it writes nothing): `Stopped { status }` for `Key`,
/// `Region` and `Abort`, nothing for the others.
pub fn refusal<K>(msg: &Msg<K>, status: Status) -> Option<Msg<K>> {
    let status = if status.is_ok() {
        Status::Aborted
    } else {
        status
    };
    match msg {
        Msg::Key { .. }
        | Msg::Region { .. }
        | Msg::Waiting { .. }
        | Msg::Covered { .. }
        | Msg::Abort { .. } => Some(Msg::Stopped { status }),
        Msg::Written { .. } | Msg::WrittenRegion | Msg::RegionDone { .. } | Msg::Stopped { .. } => {
            None
        }
    }
}

/// What the first local post told about the communicator.
#[derive(Clone, Debug)]
struct View {
    len: u64,
    /// Chunks per block.
    n: u64,
    digest: u64,
    members: Vec<SpId>,
    design: Design,
    /// Ranks served here, ascending.
    local: Vec<Rank>,
    /// Member SPs, ascending (this SP included).
    sps: Vec<SpId>,
    /// Per member SP: its ranks, ascending.
    sp_ranks: Vec<Vec<Rank>>,
    /// Write order (see the module docs): (index into `sps`, rank), every
    /// comm rank once; `first[i]`: `order[i]` is the first entry of its SP.
    order: Vec<(usize, Rank)>,
    first: Vec<bool>,
    /// This SP's index in `sps`.
    mine: usize,
    /// Per member SP: the index of its node's owner (lowest member SP).
    owner: Vec<usize>,
}

impl View {
    fn build(me: SpId, chunk: u64, post: &Post<impl Sized>) -> Result<View, PostError> {
        let sp_node =
            sp_nodes(&post.members, &post.nodes).map_err(|sp| PostError::SpOnTwoNodes { sp })?;
        let sps: Vec<SpId> = sp_node.keys().copied().collect();
        let idx = |sp: SpId| sps.binary_search(&sp).expect("a member SP");
        let mut sp_ranks = vec![Vec::new(); sps.len()];
        for (r, &sp) in post.members.iter().enumerate() {
            sp_ranks[idx(sp)].push(r as Rank);
        }
        let mine = idx(me);
        let my_node = sp_node[&me];
        let mut node_sps: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, sp) in sps.iter().enumerate() {
            node_sps.entry(sp_node[sp]).or_default().push(i);
        }
        let nodes: Vec<u32> = node_sps.keys().copied().collect();
        let at = nodes.iter().position(|&n| n == my_node).unwrap();
        let rot = node_sps[&my_node].iter().position(|&i| i == mine).unwrap();
        // Per node in ring order from this one: its ranks, SP by SP (the
        // SPs rotated by this SP's index on its node); then one entry of
        // each node in turn.
        let lists: Vec<Vec<(usize, Rank)>> = (0..nodes.len())
            .map(|k| {
                let list = &node_sps[&nodes[(at + k) % nodes.len()]];
                let start = rot % list.len();
                list[start..]
                    .iter()
                    .chain(&list[..start])
                    .flat_map(|&b| sp_ranks[b].iter().map(move |&r| (b, r)))
                    .collect()
            })
            .collect();
        let longest = lists.iter().map(Vec::len).max().unwrap_or(0);
        let mut order = Vec::with_capacity(post.members.len());
        for k in 0..longest {
            order.extend(lists.iter().filter_map(|l| l.get(k)));
        }
        let mut seen = vec![false; sps.len()];
        let first = order
            .iter()
            .map(|&(b, _)| !std::mem::replace(&mut seen[b], true))
            .collect();
        let n = if post.len == 0 {
            0
        } else {
            post.len.div_ceil(chunk)
        };
        let owner = sps.iter().map(|sp| node_sps[&sp_node[sp]][0]).collect();
        Ok(View {
            len: post.len,
            n,
            digest: comm_digest(&post.members, &post.nodes),
            members: post.members.clone(),
            design: post.design,
            local: sp_ranks[mine].clone(),
            sps,
            sp_ranks,
            order,
            first,
            mine,
            owner,
        })
    }

    fn is_owner(&self) -> bool {
        self.owner[self.mine] == self.mine
    }

    fn idx(&self, sp: SpId) -> Option<usize> {
        self.sps.binary_search(&sp).ok()
    }

    fn chunk_len(&self, chunk_bytes: u64, i: u64) -> u64 {
        (self.len - (i * chunk_bytes).min(self.len)).min(chunk_bytes)
    }
}

/// How a member SP receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
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
struct Tgt<K> {
    /// How it receives; `None` until its first `Key`/`Region`/`Covered`.
    mode: Option<Mode>,
    /// Hierarchical: (rank, shared key) of its region.
    region: Option<(Rank, K)>,
    /// When `mode` became known (see `Stats::writes_waited_for_key`).
    epoch: u64,
    /// This SP's writes into its ranks or region, in flight.
    in_flight: u32,
    /// Hierarchical: chunks written into its region, and whether
    /// `WrittenRegion` went out.
    done: u64,
    sent: bool,
    /// It reported `WrittenRegion` for this SP's region.
    wrote_region: bool,
}

/// A comm rank as a flat target.
#[derive(Clone, Debug)]
struct RankTgt<K> {
    key: Option<K>,
    epoch: u64,
    in_flight: u32,
    done: u64,
    sent: bool,
}

#[derive(Clone, Debug)]
struct LocalRank<K> {
    send_key: K,
    recv_key: K,
    /// The post agrees with the view.
    in_view: bool,
    next_read: u64,
    reads_in_flight: u32,
    reads_done: u64,
    /// Flat: SPs that reported `Written` for it (this SP included).
    written_from: BTreeSet<SpId>,
    out: Outcome,
}

/// A chunk held in a slot, with the progress of its writes.
#[derive(Clone, Debug)]
struct Held {
    block: Rank,
    chunk: u64,
    len: u64,
    /// `epoch` when it was staged.
    epoch: u64,
    /// Next entry of `View::order` to write.
    cur: usize,
    /// Target SPs (indices into `View::sps`) of unknown mode, and flat
    /// ranks of unknown key, skipped by the cursor.
    blocked_sps: BTreeSet<usize>,
    blocked_ranks: BTreeSet<Rank>,
    /// Writes in flight.
    writing: u32,
}

#[derive(Clone, Copy, Debug)]
enum CopyKind {
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
enum Unit {
    Rank(Rank),
    Region(usize),
}

/// Abort notices to one SP.
#[derive(Clone, Copy, Debug, Default)]
struct Notice {
    abort_sent: bool,
    stopped_sent: bool,
}

/// The per-SP state machine of one staged `Iallgather` instance.
///
/// Drive it like the other collectives: feed inputs through `handle_*`,
/// then drain `poll_action` after every input.
pub struct StagedAllgather<K> {
    key: CollKey,
    me: SpId,
    chunk_bytes: u64,
    view: Option<View>,
    /// Per member SP (index into `View::sps`).
    tgts: Vec<Tgt<K>>,
    /// Per comm rank.
    rtgts: Vec<RankTgt<K>>,
    ranks: BTreeMap<Rank, LocalRank<K>>,
    /// The keys of `ranks`, in post order.
    posted: Vec<Rank>,
    /// View-local ranks that posted (agreeing or not).
    local_posted: usize,
    completed: usize,
    lost_unposted: BTreeSet<Rank>,
    slots: Slots<Held>,
    /// Local ranks with chunks left to read, in post order.
    read_queue: VecDeque<Rank>,
    copies: BTreeMap<u64, CopyKind>,
    next_id: u64,
    /// Bumped whenever a key becomes known.
    epoch: u64,
    /// Resolved since the last pump: flat ranks, SPs (indices).
    new_ranks: Vec<Rank>,
    new_sps: Vec<usize>,
    modes_unresolved: usize,
    units_total: usize,
    units_sent: usize,
    /// SPs (this one included) that wrote everything into this SP's region.
    region_writers: usize,
    /// An owner: where its region starts in the node segment, and the
    /// covered SPs (indices) it sent `RegionDone`.
    region_at: u64,
    done_sent: BTreeSet<usize>,
    /// A covered SP: where its owner's region starts, after `RegionDone`.
    region_done: Option<u64>,
    /// An owner: the SPs of its node (indices) that sent `Waiting`.
    waiting_from: BTreeSet<usize>,
    pending_written: BTreeMap<SpId, Vec<Rank>>,
    /// Keys and regions received before the view, in arrival order.
    early: Vec<(SpId, Msg<K>)>,
    early_seen: BTreeSet<(SpId, Option<Rank>)>,
    contacts: BTreeSet<SpId>,
    lost_sps: BTreeSet<SpId>,
    stopped_from: BTreeSet<SpId>,
    abort: Abort,
    notices: BTreeMap<SpId, Notice>,
    /// SPs still owed a `Stopped`.
    notify_todo: BTreeSet<SpId>,
    actions: VecDeque<Action<K>>,
    now: Nanos,
    stats: Stats,
}

common_api!(StagedAllgather, staged, Msg<K>);

impl<K: Clone + fmt::Debug + PartialEq> StagedAllgather<K> {
    /// Create an instance; the driver may do so on the first event of any
    /// kind for `key`.
    pub fn new(key: CollKey, cfg: Config) -> Self {
        StagedAllgather {
            key,
            me: cfg.me,
            chunk_bytes: cfg.chunk_bytes.max(1),
            view: None,
            tgts: Vec::new(),
            rtgts: Vec::new(),
            ranks: BTreeMap::new(),
            posted: Vec::new(),
            local_posted: 0,
            completed: 0,
            lost_unposted: BTreeSet::new(),
            slots: Slots::new(cfg.staging_slots),
            read_queue: VecDeque::new(),
            copies: BTreeMap::new(),
            next_id: 0,
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
            lost_sps: BTreeSet::new(),
            stopped_from: BTreeSet::new(),
            abort: Abort::default(),
            notices: BTreeMap::new(),
            notify_todo: BTreeSet::new(),
            actions: VecDeque::new(),
            now: 0,
            stats: Stats::default(),
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
            Mode::Region => Some((self.me, self.region_at, total)),
            Mode::Covered => Some((v.sps[v.owner[v.mine]], self.region_done?, total)),
            Mode::Flat => None,
        }
    }

    /// Copies started and not reported done.
    pub fn copies_in_flight(&self) -> usize {
        self.copies.len()
    }

    /// A local rank posted its part of the collective.
    pub fn handle_post(&mut self, now: Nanos, post: Post<K>) -> Result<(), PostError> {
        self.now = now;
        self.validate_post(&post)?;
        let rank = post.rank;
        let first = self.view.is_none();
        if first {
            let view = View::build(self.me, self.chunk_bytes, &post)?;
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
        let in_view_local = v.members.get(rank as usize) == Some(&self.me);
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
        if let Some(status) = self.abort.status.or(disagreement) {
            st.out.set_error(status);
        }
        self.ranks.insert(rank, st);
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
        } else if self.abort.is_none() {
            let v = self.view.as_ref().unwrap();
            let (len, comm) = (v.len, v.digest);
            let to: Vec<SpId> = v.sps.iter().copied().filter(|&s| s != self.me).collect();
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
        self.now = now;
        if sp == self.me || !self.lost_sps.insert(sp) {
            return;
        }
        self.early.retain(|(f, _)| *f != sp);
        self.notify_todo.remove(&sp);
        if self.view.as_ref().is_some_and(|v| v.idx(sp).is_some()) {
            self.enter_abort(Status::PeerFailed);
        }
        self.pump();
    }

    /// Local host `rank` died: aborts with `RankFailed` unless it completed.
    pub fn handle_rank_lost(&mut self, now: Nanos, rank: Rank) {
        self.now = now;
        if let Some(v) = &self.view {
            if v.members.get(rank as usize) != Some(&self.me) && !self.ranks.contains_key(&rank) {
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

    /// Every local rank completed (or was lost before posting), no copy is
    /// in flight, no slot is in use, every action was polled, and either
    /// every `Written`/`WrittenRegion` went out or (aborted) every SP of the
    /// view and every SP heard from got `Stopped`. An SP none of whose
    /// ranks ever posts never finishes (the driver drops such instances
    /// with the job).
    pub fn is_finished(&self) -> bool {
        let Some(v) = &self.view else { return false };
        let tail = match self.abort.status {
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
        self.completed == self.ranks.len()
            && self.local_posted + self.lost_unposted.len() >= v.local.len()
            && self.copies.is_empty()
            && self.slots.all_free()
            && self.actions.is_empty()
            && tail
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
        if self.ranks.contains_key(&rank) {
            return Err(PostError::DuplicatePost { rank });
        }
        if self.lost_unposted.contains(&rank) {
            return Err(PostError::RankLost { rank });
        }
        let owner = node_owner(&post.members, &post.nodes, self.me) == Some(self.me);
        if post.design == Design::Hier && owner && post.shared_key.is_none() {
            return Err(PostError::MissingSharedKey { rank });
        }
        Ok(())
    }

    /// This SP has a view for the first time.
    fn form_view(&mut self, view: View) {
        let me = self.me;
        let p = view.members.len();
        self.tgts = (0..view.sps.len())
            .map(|_| Tgt {
                mode: None,
                region: None,
                epoch: 0,
                in_flight: 0,
                done: 0,
                sent: false,
                wrote_region: false,
            })
            .collect();
        self.rtgts = (0..p)
            .map(|_| RankTgt {
                key: None,
                epoch: 0,
                in_flight: 0,
                done: 0,
                sent: false,
            })
            .collect();
        self.modes_unresolved = view.sps.len();
        self.lost_unposted
            .retain(|&r| view.members.get(r as usize) == Some(&me));
        let lost = view.sps.iter().any(|s| self.lost_sps.contains(s));
        self.view = Some(view);
        if lost {
            self.enter_abort(Status::PeerFailed);
        }
        if self.abort.is_some() {
            self.schedule_notices();
        }
        for (from, msg) in std::mem::take(&mut self.early) {
            match msg {
                Msg::Key {
                    rank,
                    len,
                    comm,
                    key,
                } => {
                    if self.on_key(from, rank, len, comm, key).is_err() {
                        self.enter_abort(Status::InvalidPost);
                    }
                }
                Msg::Region {
                    rank,
                    len,
                    comm,
                    key,
                } => {
                    if self.on_region(from, rank, len, comm, key).is_err() {
                        self.enter_abort(Status::InvalidPost);
                    }
                }
                Msg::Covered { len, comm } => {
                    if self.on_covered(from, len, comm).is_err() {
                        self.enter_abort(Status::InvalidPost);
                    }
                }
                Msg::Waiting { len, comm } => {
                    if self.on_waiting(from, len, comm).is_err() {
                        self.enter_abort(Status::InvalidPost);
                    }
                }
                _ => unreachable!("only keys wait for the view"),
            }
        }
    }

    /// SP `b` (index) receives per `mode` from now on.
    fn resolve_sp(&mut self, b: usize, mode: Mode) {
        let v = self.view.as_ref().unwrap();
        let t = &mut self.tgts[b];
        debug_assert!(t.mode.is_none());
        t.mode = Some(mode);
        self.epoch += 1;
        t.epoch = self.epoch;
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
    fn settle(&mut self) {
        let Some(v) = &self.view else { return };
        if v.design != Design::Hier || v.is_owner() || self.abort.is_some() {
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
        let to: Vec<SpId> = v.sps.iter().copied().filter(|&s| s != self.me).collect();
        if mode == Mode::Covered {
            for sp in to {
                self.send(sp, Msg::Covered { len, comm });
            }
            return;
        }
        let keys: Vec<(Rank, K)> = self
            .posted
            .iter()
            .filter(|r| self.ranks[r].in_view)
            .map(|&r| (r, self.ranks[&r].recv_key.clone()))
            .collect();
        for (rank, key) in keys {
            self.share_rank_key(rank, key, &to);
        }
    }

    /// A flat SP: learns a local rank's receive key and sends it to the view's SPs `to`,
    /// which write their blocks through it.
    fn share_rank_key(&mut self, rank: Rank, key: K, to: &[SpId]) {
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
    fn owed_region_done(&self) -> Vec<usize> {
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
    fn send_region_done(&mut self) {
        let Some(v) = &self.view else { return };
        let full =
            self.tgts[v.mine].mode == Some(Mode::Region) && self.region_writers == v.sps.len();
        if !full || self.abort.is_some() {
            return;
        }
        for b in self.owed_region_done() {
            self.done_sent.insert(b);
            self.stats.regions_shared += 1;
            let to = self.view.as_ref().unwrap().sps[b];
            self.send(to, Msg::RegionDone { at: self.region_at });
        }
    }

    fn learn_rank_key(&mut self, rank: Rank, key: K) {
        self.epoch += 1;
        let t = &mut self.rtgts[rank as usize];
        t.key = Some(key);
        t.epoch = self.epoch;
        self.new_ranks.push(rank);
        self.check_unit(Unit::Rank(rank));
    }

    /// A view-local rank posted in agreement.
    fn on_local_posted(&mut self) {
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

    fn send(&mut self, to: SpId, msg: Msg<K>) {
        debug_assert_ne!(to, self.me, "never messages itself");
        if to != self.me && !self.lost_sps.contains(&to) {
            self.actions.push_back(Action::Send { to, msg });
        }
    }

    fn process(&mut self, from: SpId, msg: Msg<K>) -> Result<(), MsgError> {
        if self.lost_sps.contains(&from) {
            self.stats.ignored_from_lost_sp += 1;
            return Ok(());
        }
        if from == self.me {
            return Err(MsgError::Unexpected { sp: from });
        }
        if self.contacts.insert(from) && self.abort.is_some() {
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
                    self.stats.keys_before_post += 1;
                }
                self.early.push((from, msg));
                return Ok(());
            }
        }
        match msg {
            Msg::Key {
                rank,
                len,
                comm,
                key,
            } => self.on_key(from, rank, len, comm, key),
            Msg::Region {
                rank,
                len,
                comm,
                key,
            } => self.on_region(from, rank, len, comm, key),
            // The sender of `Waiting` is a contact now (owed a `Stopped`
            // if this SP aborts) and learns this SP's mode from its
            // announcement.
            Msg::Waiting { len, comm } => self.on_waiting(from, len, comm),
            Msg::Covered { len, comm } => self.on_covered(from, len, comm),
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
                    match self.ranks.get(r) {
                        Some(st) if st.in_view && !st.written_from.contains(&from) => {}
                        _ => return bad,
                    }
                }
                if ranks.iter().collect::<BTreeSet<_>>().len() != ranks.len() {
                    return bad;
                }
                for r in ranks {
                    self.ranks.get_mut(&r).unwrap().written_from.insert(from);
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
    fn key_disagreement(&self, from: SpId, rank: Rank, len: u64, comm: u64) -> Option<Status> {
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
    fn key_sender(&mut self, from: SpId, rank: Rank, len: u64, comm: u64) -> Option<usize> {
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

    fn on_key(
        &mut self,
        from: SpId,
        rank: Rank,
        len: u64,
        comm: u64,
        key: K,
    ) -> Result<(), MsgError> {
        let Some(b) = self.key_sender(from, rank, len, comm) else {
            return Ok(());
        };
        if matches!(self.tgts[b].mode, Some(Mode::Region | Mode::Covered)) {
            self.enter_abort(Status::InvalidPost);
            return Ok(());
        }
        if self.rtgts[rank as usize].key.is_some() {
            return Err(MsgError::Duplicate { sp: from });
        }
        if self.abort.is_some() {
            return Ok(());
        }
        if self.tgts[b].mode.is_none() {
            self.resolve_sp(b, Mode::Flat);
        }
        self.learn_rank_key(rank, key);
        Ok(())
    }

    fn on_region(
        &mut self,
        from: SpId,
        rank: Rank,
        len: u64,
        comm: u64,
        key: K,
    ) -> Result<(), MsgError> {
        let Some(b) = self.key_sender(from, rank, len, comm) else {
            return Ok(());
        };
        if self.view.as_ref().unwrap().owner[b] != b {
            // Same members (the digest matched), so the same owners: only
            // an owner announces a region.
            return Err(MsgError::Unexpected { sp: from });
        }
        if self.first_mode(b, from, Mode::Region)? {
            self.tgts[b].region = Some((rank, key));
            self.resolve_sp(b, Mode::Region);
        }
        Ok(())
    }

    /// SP `b` (`from`) announced that it receives per `mode` (`Region` or
    /// `Covered`, each sent once): a second one is a duplicate, one that
    /// contradicts what it announced before aborts. True if `mode` is to be
    /// resolved now (first announcement, instance not aborted).
    fn first_mode(&mut self, b: usize, from: SpId, mode: Mode) -> Result<bool, MsgError> {
        match self.tgts[b].mode {
            Some(m) if m == mode => Err(MsgError::Duplicate { sp: from }),
            Some(_) => {
                self.enter_abort(Status::InvalidPost);
                Ok(false)
            }
            None => Ok(self.abort.is_none()),
        }
    }

    /// The view index of `from`, which sent `Waiting` or `Covered` with
    /// `(len, comm)`; `None` if it is no member SP or the message disagrees
    /// with the view (the instance aborted).
    fn member_sender(&mut self, from: SpId, len: u64, comm: u64) -> Option<usize> {
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
    fn on_waiting(&mut self, from: SpId, len: u64, comm: u64) -> Result<(), MsgError> {
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
    fn on_covered(&mut self, from: SpId, len: u64, comm: u64) -> Result<(), MsgError> {
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
            CopyKind::Read {
                slot,
                rank,
                chunk,
                len,
            } => {
                let st = self.ranks.get_mut(&rank).expect("read from a posted rank");
                st.reads_in_flight -= 1;
                st.out.set_error(status);
                if ok {
                    st.reads_done += 1;
                    self.stats.chunk_reads += 1;
                    self.stats.bytes_staged += len;
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
                self.tgts[sp].in_flight -= 1;
                if status.is_ok() {
                    self.stats.chunk_writes += 1;
                }
                match rank {
                    Some(r) => {
                        let t = &mut self.rtgts[r as usize];
                        t.in_flight -= 1;
                        if ok {
                            t.done += 1;
                            self.check_unit(Unit::Rank(r));
                        }
                    }
                    None => {
                        if ok {
                            self.tgts[sp].done += 1;
                            self.check_unit(Unit::Region(sp));
                        }
                    }
                }
            }
        }
    }

    /// Sends (or records, for this SP) `Written` for `u` once every chunk
    /// of every local block is in it.
    fn check_unit(&mut self, u: Unit) {
        if self.abort.is_some() {
            return;
        }
        let v = self.view.as_ref().unwrap();
        if self.local_posted < v.local.len() {
            return;
        }
        let need = v.n * v.local.len() as u64;
        let me = self.me;
        match u {
            Unit::Rank(r) => {
                let t = &mut self.rtgts[r as usize];
                if t.sent || t.key.is_none() || t.in_flight > 0 || t.done != need {
                    return;
                }
                t.sent = true;
                self.units_sent += 1;
                let b = v.members[r as usize];
                if b == me {
                    self.ranks
                        .get_mut(&r)
                        .expect("own key known: posted")
                        .written_from
                        .insert(me);
                } else {
                    self.pending_written.entry(b).or_default().push(r);
                }
            }
            Unit::Region(b) => {
                let t = &mut self.tgts[b];
                if t.sent || t.mode != Some(Mode::Region) || t.in_flight > 0 || t.done != need {
                    return;
                }
                t.sent = true;
                self.units_sent += 1;
                if b == v.mine {
                    t.wrote_region = true;
                    self.region_writers += 1;
                } else {
                    let to = v.sps[b];
                    self.stats.written_msgs += 1;
                    self.send(to, Msg::WrittenRegion);
                }
            }
        }
    }

    fn enter_abort(&mut self, status: Status) {
        let (first, status) = self.abort.enter(status);
        fail_pending(self.ranks.values_mut().map(|st| &mut st.out), status);
        if first {
            self.read_queue.clear();
            self.pending_written.clear();
            self.schedule_notices();
        }
    }

    /// After an abort: every SP of the view and every SP heard from is
    /// owed a `Stopped`.
    fn schedule_notices(&mut self) {
        let mut all: BTreeSet<SpId> = self.contacts.clone();
        if let Some(v) = &self.view {
            all.extend(v.sps.iter().copied());
        }
        for sp in all {
            self.schedule_notice(sp);
        }
    }

    fn schedule_notice(&mut self, sp: SpId) {
        if sp == self.me || self.lost_sps.contains(&sp) {
            return;
        }
        if !self.notices.get(&sp).is_some_and(|n| n.stopped_sent) {
            self.notify_todo.insert(sp);
        }
    }

    /// Sends the abort notices that are due.
    fn notify(&mut self) {
        let Some(status) = self.abort.status else {
            return;
        };
        for sp in std::mem::take(&mut self.notify_todo) {
            if self.lost_sps.contains(&sp) {
                continue;
            }
            let busy = self
                .view
                .as_ref()
                .and_then(|v| v.idx(sp))
                .is_some_and(|b| self.tgts[b].in_flight > 0);
            let n = self.notices.entry(sp).or_default();
            if !busy {
                n.stopped_sent = true;
                self.actions.push_back(Action::Send {
                    to: sp,
                    msg: Msg::Stopped { status },
                });
            } else {
                if !n.abort_sent {
                    n.abort_sent = true;
                    self.actions.push_back(Action::Send {
                        to: sp,
                        msg: Msg::Abort { status },
                    });
                }
                self.notify_todo.insert(sp);
            }
        }
    }

    /// Do everything that can be done now; called at the end of every
    /// input.
    fn pump(&mut self) {
        self.settle();
        if self.view.is_some() {
            loop {
                let mut progress = self.retry_blocked();
                progress |= self.advance_all();
                progress |= self.free_slots();
                progress |= self.start_reads();
                if !progress {
                    break;
                }
            }
            for (to, ranks) in std::mem::take(&mut self.pending_written) {
                self.stats.written_msgs += 1;
                self.send(to, Msg::Written { ranks });
            }
            self.send_region_done();
        }
        self.notify();
        if self.completed < self.posted.len() {
            for i in 0..self.posted.len() {
                self.check_complete(self.posted[i]);
            }
        }
        let in_use = self.slots_in_use() as u32;
        self.stats.max_slots_in_use = self.stats.max_slots_in_use.max(in_use);
    }

    /// Issues the writes that waited for keys resolved since the last call.
    fn retry_blocked(&mut self) -> bool {
        if self.new_ranks.is_empty() && self.new_sps.is_empty() {
            return false;
        }
        let sps = std::mem::take(&mut self.new_sps);
        let ranks = std::mem::take(&mut self.new_ranks);
        if self.abort.is_some() {
            return false;
        }
        let mut progress = false;
        for i in 0..self.slots.len() {
            if !matches!(self.slots[i], Slot::Full(_)) {
                continue;
            }
            let Slot::Full(mut h) = std::mem::replace(&mut self.slots[i], Slot::Free) else {
                unreachable!()
            };
            for &b in &sps {
                if h.blocked_sps.remove(&b) {
                    progress = true;
                    self.write_sp(i, &mut h, b);
                }
            }
            for &r in &ranks {
                if h.blocked_ranks.remove(&r) {
                    progress = true;
                    let b = self.sp_of(r);
                    self.emit_write(i, &mut h, b, Some(r));
                }
            }
            self.slots[i] = Slot::Full(h);
        }
        progress
    }

    fn sp_of(&self, r: Rank) -> usize {
        let v = self.view.as_ref().unwrap();
        v.idx(v.members[r as usize]).unwrap()
    }

    /// Moves every chunk's cursor as far as the known keys allow.
    fn advance_all(&mut self) -> bool {
        if self.abort.is_some() {
            return false;
        }
        let order_len = self.view.as_ref().unwrap().order.len();
        let mut progress = false;
        for i in 0..self.slots.len() {
            if !matches!(&self.slots[i], Slot::Full(h) if h.cur < order_len) {
                continue;
            }
            let Slot::Full(mut h) = std::mem::replace(&mut self.slots[i], Slot::Free) else {
                unreachable!()
            };
            while h.cur < order_len {
                let v = self.view.as_ref().unwrap();
                let ((b, r), first) = (v.order[h.cur], v.first[h.cur]);
                match self.tgts[b].mode {
                    None if first => {
                        h.blocked_sps.insert(b);
                    }
                    Some(Mode::Region) if first => self.emit_write(i, &mut h, b, None),
                    None | Some(Mode::Region | Mode::Covered) => {}
                    Some(Mode::Flat) => {
                        if self.rtgts[r as usize].key.is_some() {
                            self.emit_write(i, &mut h, b, Some(r));
                        } else {
                            h.blocked_ranks.insert(r);
                        }
                    }
                }
                h.cur += 1;
            }
            self.slots[i] = Slot::Full(h);
            progress = true;
        }
        progress
    }

    /// Writes chunk `h` (slot `i`) into SP `b`'s units, or marks them
    /// blocked (SP `b` became known after the chunk's cursor passed it).
    fn write_sp(&mut self, i: usize, h: &mut Held, b: usize) {
        match self.tgts[b].mode {
            None => {
                h.blocked_sps.insert(b);
            }
            Some(Mode::Region) => self.emit_write(i, h, b, None),
            Some(Mode::Covered) => {}
            Some(Mode::Flat) => {
                let n = self.view.as_ref().unwrap().sp_ranks[b].len();
                for k in 0..n {
                    let r = self.view.as_ref().unwrap().sp_ranks[b][k];
                    if self.rtgts[r as usize].key.is_some() {
                        self.emit_write(i, h, b, Some(r));
                    } else {
                        h.blocked_ranks.insert(r);
                    }
                }
            }
        }
    }

    fn emit_write(&mut self, slot: usize, h: &mut Held, b: usize, rank: Option<Rank>) {
        let v = self.view.as_ref().unwrap();
        let offset = h.block as u64 * v.len + h.chunk * self.chunk_bytes;
        let (key_rank, key, known_at) = match rank {
            Some(r) => {
                let t = &self.rtgts[r as usize];
                (r, t.key.clone().expect("known"), t.epoch)
            }
            None => {
                let t = &self.tgts[b];
                let (r, k) = t.region.clone().expect("known with the mode");
                (r, k, t.epoch)
            }
        };
        let sp = v.sps[b];
        if known_at > h.epoch {
            self.stats.writes_waited_for_key += 1;
        }
        h.writing += 1;
        self.tgts[b].in_flight += 1;
        if let Some(r) = rank {
            self.rtgts[r as usize].in_flight += 1;
        }
        let id = self.new_id();
        self.copies
            .insert(id, CopyKind::Write { slot, sp: b, rank });
        self.actions.push_back(Action::Copy(Copy {
            id: CopyId(id),
            rank: key_rank,
            sp,
            block: h.block,
            chunk: h.chunk,
            src: Loc::Stage {
                slot: SlotId(slot as u32),
                offset: 0,
            },
            dst: Loc::Host { key, offset },
            len: h.len,
        }));
    }

    fn free_slots(&mut self) -> bool {
        let aborted = self.abort.is_some();
        let order_len = self.view.as_ref().map_or(0, |v| v.order.len());
        let mut progress = false;
        for s in self.slots.iter_mut() {
            let Slot::Full(h) = s else { continue };
            let writes_done = h.writing == 0 || mutated(Mutation::FreeWhileWriting);
            let free = if aborted {
                h.writing == 0
            } else {
                writes_done
                    && h.cur == order_len
                    && h.blocked_sps.is_empty()
                    && h.blocked_ranks.is_empty()
            };
            if free {
                *s = Slot::Free;
                progress = true;
            }
        }
        progress
    }

    /// Reads local send blocks, chunk by chunk, into free slots.
    fn start_reads(&mut self) -> bool {
        if self.abort.is_some() {
            return false;
        }
        let mut progress = false;
        while let Some(&rank) = self.read_queue.front() {
            let Some(slot) = self.slots.first_free() else {
                break;
            };
            let v = self.view.as_ref().unwrap();
            let chunk = self.ranks[&rank].next_read;
            let (n, len) = (v.n, v.chunk_len(self.chunk_bytes, chunk));
            let st = self.ranks.get_mut(&rank).expect("queued at post");
            st.next_read += 1;
            st.reads_in_flight += 1;
            let key = st.send_key.clone();
            if st.next_read == n {
                self.read_queue.pop_front();
            }
            self.slots[slot] = Slot::Reading;
            let id = self.new_id();
            self.copies.insert(
                id,
                CopyKind::Read {
                    slot,
                    rank,
                    chunk,
                    len,
                },
            );
            self.actions.push_back(Action::Copy(Copy {
                id: CopyId(id),
                rank,
                sp: self.me,
                block: rank,
                chunk,
                src: Loc::Host {
                    key,
                    offset: chunk * self.chunk_bytes,
                },
                dst: Loc::Stage {
                    slot: SlotId(slot as u32),
                    offset: 0,
                },
                len,
            }));
            progress = true;
        }
        progress
    }

    fn check_complete(&mut self, rank: Rank) {
        let Some(v) = &self.view else { return };
        let st = &self.ranks[&rank];
        if st.out.completed {
            return;
        }
        let aborted = self.abort.is_some();
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
            let own_busy = self.tgts[v.mine].in_flight > 0;
            own_busy
                || (exposed
                    && !mutated(Mutation::SkipStopHandshake)
                    && !v.sps.iter().enumerate().all(|(b, &w)| {
                        w == self.me
                            || self.lost_sps.contains(&w)
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
            from_segment: matches!(mode, Some(Mode::Region | Mode::Covered)) && status.is_ok(),
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
    const CHUNK: u64 = 4;
    const SLOTS: u32 = 2;

    struct Tb {
        m: StagedAllgather<Tag>,
        /// (rank, from_segment) of every completion.
        segs: Vec<(Rank, bool)>,
    }

    impl Machine for Tb {
        type Post = Post<Tag>;
        type Msg = Msg<Tag>;
        type Copy = Copy<Tag>;

        fn create(sp: SpId) -> Self {
            Tb {
                m: StagedAllgather::new(
                    KEY,
                    Config {
                        me: sp,
                        chunk_bytes: CHUNK,
                        staging_slots: SLOTS,
                    },
                ),
                segs: Vec::new(),
            }
        }

        fn post(&mut self, now: Nanos, post: Post<Tag>) {
            self.m.handle_post(now, post).unwrap();
        }

        fn msg(&mut self, now: Nanos, from: SpId, msg: Msg<Tag>) {
            self.m.handle_msg(now, from, msg).unwrap();
        }

        fn copy_done(&mut self, now: Nanos, c: &Copy<Tag>, status: Status) {
            self.m.handle_copy_done(now, c.id, status);
        }

        fn poll(&mut self) -> Option<Out<Msg<Tag>, Copy<Tag>>> {
            Some(match self.m.poll_action()? {
                Action::Send { to, msg } => Out::Send { to, msg },
                Action::Copy(c) => Out::Copy(c),
                Action::Complete {
                    rank,
                    status,
                    from_segment,
                } => {
                    self.segs.push((rank, from_segment));
                    Out::Complete { rank, status }
                }
            })
        }

        fn check_copy(&self, _sp: SpId, c: &Copy<Tag>) {
            assert!(c.len > 0 && c.len <= CHUNK, "{c:?}");
        }
    }

    type Net = crate::sim::testnet::Net<Tb>;

    fn post(rank: Rank, len: u64, members: &[SpId], nodes: &[u32]) -> Post<Tag> {
        Post {
            rank,
            members: members.to_vec(),
            nodes: nodes.to_vec(),
            send_key: ('s', rank),
            recv_key: ('r', rank),
            len,
            design: Design::Flat,
            shared_key: None,
            shared_at: 0,
        }
    }

    /// Hierarchical; an owner places its region at `100 * sp`.
    fn hier(mut p: Post<Tag>) -> Post<Tag> {
        p.design = Design::Hier;
        p.shared_key = Some(('h', p.rank));
        p.shared_at = 100 * u64::from(p.members[p.rank as usize]);
        p
    }

    fn writes(net: &Net) -> Vec<Copy<Tag>> {
        net.copied
            .iter()
            .filter(|c| matches!(c.src, Loc::Stage { .. }))
            .cloned()
            .collect()
    }

    fn all_finished(net: &mut Net, sps: &[SpId]) {
        for &sp in sps {
            assert!(net.sp(sp).m.is_finished(), "sp {sp} not finished");
        }
    }

    fn sent(net: &Net, from: SpId, to: SpId) -> Vec<Msg<Tag>> {
        // Messages still queued (delivered ones are gone).
        net.msgs
            .iter()
            .filter(|(f, t, _)| *f == from && *t == to)
            .map(|(_, _, m)| m.clone())
            .collect()
    }

    #[test]
    fn flat_writes_every_chunk_into_every_rank_once() {
        // Node 0: SP 0 (ranks 0, 3); node 1: SP 1 (rank 1), SP 2 (rank 2).
        let (members, nodes) = ([0, 1, 2, 0], [0, 1, 1, 0]);
        let mut net = Net::new(3);
        for r in [2, 0, 3, 1] {
            net.post(members[r as usize], post(r, 6, &members, &nodes));
        }
        net.run();
        for r in 0..4 {
            assert_eq!(net.status(r), Some(Status::Ok), "rank {r}");
        }
        // 4 blocks x 2 chunks (4 + 2 bytes) into 4 ranks.
        let w = writes(&net);
        assert_eq!(w.len(), 32);
        for r in 0..4 {
            for s in 0..4 {
                let mut into: Vec<(u64, u64)> = w
                    .iter()
                    .filter(|c| c.rank == r && c.block == s)
                    .map(|c| match c.dst {
                        Loc::Host { key, offset } => {
                            assert_eq!(key, ('r', r));
                            (offset, c.len)
                        }
                        Loc::Stage { .. } => unreachable!(),
                    })
                    .collect();
                into.sort();
                assert_eq!(into, [(s as u64 * 6, 4), (s as u64 * 6 + 4, 2)]);
            }
        }
        for sp in 0..3 {
            let st = net.sp(sp).m.stats();
            assert!(st.max_slots_in_use <= SLOTS, "{st:?}");
        }
        assert_eq!(net.sp(0).m.stats().bytes_staged, 12);
        assert_eq!(net.sp(0).m.stats().chunk_writes, 16);
        all_finished(&mut net, &[0, 1, 2]);
    }

    #[test]
    fn writers_start_at_their_own_node_and_go_round() {
        // Nodes 0, 1, 2 with one SP and one rank each; SP 1 writes rank 1,
        // then rank 2, then rank 0.
        let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
        let mut net = Net::new(3);
        for r in 0..3 {
            net.post(r, post(r, 3, &members, &nodes));
        }
        net.deliver_all();
        // Finish the reads only.
        while net
            .copies
            .iter()
            .any(|(_, c)| matches!(c.dst, Loc::Stage { .. }))
        {
            let i = net
                .copies
                .iter()
                .position(|(_, c)| matches!(c.dst, Loc::Stage { .. }))
                .unwrap();
            let w = net.copies.remove(i).unwrap();
            net.copies.push_front(w);
            net.finish_copy(Status::Ok);
        }
        let order: Vec<Rank> = net
            .copies
            .iter()
            .filter(|(sp, _)| *sp == 1)
            .map(|(_, c)| c.rank)
            .collect();
        assert_eq!(order, [1, 2, 0]);
        net.run();
        for r in 0..3 {
            assert_eq!(net.status(r), Some(Status::Ok));
        }
        all_finished(&mut net, &[0, 1, 2]);
    }

    #[test]
    fn writers_take_one_unit_of_each_node_in_turn() {
        // Nodes 0, 1, 2 with one SP and ranks {0, 3}, {1, 4}, {2, 5}.
        let (members, nodes) = ([0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 1, 2]);
        let mut net = Net::new(3);
        for r in 0..6 {
            net.post(members[r as usize], post(r, 2, &members, &nodes));
        }
        net.deliver_all();
        let i = net
            .copies
            .iter()
            .position(|(sp, c)| *sp == 1 && matches!(c.dst, Loc::Stage { .. }))
            .unwrap();
        let w = net.copies.remove(i).unwrap();
        net.copies.push_front(w);
        net.finish_copy(Status::Ok);
        let order: Vec<Rank> = net
            .copies
            .iter()
            .filter(|(sp, c)| *sp == 1 && matches!(c.src, Loc::Stage { .. }))
            .map(|(_, c)| c.rank)
            .collect();
        assert_eq!(order, [1, 2, 0, 4, 5, 3]);
        net.run();
        for r in 0..6 {
            assert_eq!(net.status(r), Some(Status::Ok));
        }
        all_finished(&mut net, &[0, 1, 2]);
    }

    #[test]
    fn a_late_rank_stalls_reads_then_everything_resumes() {
        // SP 0 serves ranks 0 and 2, SP 1 rank 1; 2 chunks per block, 2 slots.
        let (members, nodes) = ([0, 1, 0], [0, 1, 0]);
        let mut net = Net::new(2);
        net.post(0, post(0, 8, &members, &nodes));
        net.post(0, post(2, 8, &members, &nodes));
        net.run();
        let m = &net.sp(0).m;
        // Both slots hold chunks written into ranks 0 and 2 but not into
        // rank 1, whose key is unknown: reads stopped.
        assert_eq!(m.slots_in_use(), 2);
        assert_eq!(m.stats().chunk_reads, 2);
        assert_eq!(m.stats().chunk_writes, 4);
        assert_eq!(net.status(0), None);
        // SP 1 knew the keys of ranks 0 and 2 before its rank posted.
        assert_eq!(net.sp(1).m.stats().keys_before_post, 2);
        net.post(1, post(1, 8, &members, &nodes));
        net.run();
        for r in 0..3 {
            assert_eq!(net.status(r), Some(Status::Ok), "rank {r}");
        }
        assert_eq!(net.sp(0).m.stats().writes_waited_for_key, 2);
        assert_eq!(net.sp(0).m.stats().chunk_writes, 12);
        all_finished(&mut net, &[0, 1]);
    }

    #[test]
    fn hier_writes_each_chunk_once_per_node_into_its_owners_region() {
        // Node 0: SP 0 (ranks 0, 5), SP 1 (ranks 1, 4); node 1: SP 2 (rank
        // 2), SP 3 (rank 3). SPs 0 and 2 own their nodes' regions.
        let (members, nodes) = ([0, 1, 2, 3, 1, 0], [0, 0, 1, 1, 0, 0]);
        let mut net = Net::new(4);
        for r in [4, 3, 5, 1, 2, 0] {
            net.post(members[r as usize], hier(post(r, 6, &members, &nodes)));
        }
        net.run();
        for r in 0..6 {
            assert_eq!(net.status(r), Some(Status::Ok), "rank {r}");
        }
        // 6 blocks x 2 chunks into 2 regions (one per node), through the
        // shared key of the first rank that posted at each owner (5 on SP
        // 0, 2 on SP 2); nothing into any rank's buffer.
        let w = writes(&net);
        assert_eq!(w.len(), 24, "{w:?}");
        for c in &w {
            let Loc::Host { key, offset } = c.dst else {
                unreachable!()
            };
            assert!(key == ('h', 5) || key == ('h', 2), "{c:?}");
            assert_eq!(offset, c.block as u64 * 6 + c.chunk * CHUNK);
        }
        // Every rank copies out of its owner's region.
        for (sp, owner) in [(0, 0), (1, 0), (2, 2), (3, 2)] {
            assert!(net.sp(sp).segs.iter().all(|&(_, seg)| seg), "SP {sp}");
            assert_eq!(
                net.sp(sp).m.segment_source(),
                Some((owner, 100 * u64::from(owner), 36)),
                "SP {sp}"
            );
        }
        assert_eq!(net.sp(0).m.stats().regions_shared, 1);
        assert_eq!(net.sp(2).m.stats().regions_shared, 1);
        all_finished(&mut net, &[0, 1, 2, 3]);
    }

    #[test]
    fn a_flat_owner_makes_its_nodes_hier_sps_flat() {
        // SP 0 owns node 0 but delivers flat (no segment room); SP 1, same
        // node, is hierarchical: it announces its ranks' keys after SP 0's.
        let (members, nodes) = ([0, 1, 1], [0, 0, 0]);
        let mut net = Net::new(2);
        net.post(1, hier(post(1, 3, &members, &nodes)));
        net.post(1, hier(post(2, 3, &members, &nodes)));
        net.run();
        assert!(writes(&net).is_empty(), "SP 1 waits for its owner");
        net.post(0, post(0, 3, &members, &nodes));
        net.run();
        for r in 0..3 {
            assert_eq!(net.status(r), Some(Status::Ok), "rank {r}");
        }
        let w = writes(&net);
        assert_eq!(w.len(), 9, "3 blocks into 3 buffers: {w:?}");
        assert!(w
            .iter()
            .all(|c| matches!(c.dst, Loc::Host { key: ('r', _), .. })));
        assert_eq!(net.sp(1).segs, [(1, false), (2, false)]);
        assert_eq!(net.sp(1).m.segment_source(), None);
        all_finished(&mut net, &[0, 1]);
    }

    #[test]
    fn an_owner_that_fails_before_it_posts_stops_its_nodes_waiting_sps() {
        // SP 0 owns the node; its only rank dies before posting, so SP 0
        // never announces anything, and no other node's SP tells SP 1 about
        // it. SP 1's hierarchical ranks must not wait forever: its `Waiting`
        // makes SP 0 owe it a `Stopped`.
        let (members, nodes) = ([0, 1, 1], [0, 0, 0]);
        let mut net = Net::new(2);
        net.sp(0).m.handle_rank_lost(0, 0);
        for r in 1..3 {
            net.post(1, hier(post(r, 4, &members, &nodes)));
        }
        net.run();
        for r in 1..3 {
            assert_eq!(net.status(r), Some(Status::RankFailed), "rank {r}");
        }
        all_finished(&mut net, &[1]);
    }

    #[test]
    fn designs_may_differ_per_sp() {
        // SP 0 flat (ranks 0, 2), SP 1 hierarchical (ranks 1, 3).
        let (members, nodes) = ([0, 1, 0, 1], [0, 1, 0, 1]);
        let mut net = Net::new(2);
        for r in 0..4 {
            let p = post(r, 3, &members, &nodes);
            net.post(members[r as usize], if r % 2 == 1 { hier(p) } else { p });
        }
        net.run();
        for r in 0..4 {
            assert_eq!(net.status(r), Some(Status::Ok), "rank {r}");
        }
        let w = writes(&net);
        // 4 blocks into ranks 0 and 2 each, and once into SP 1's region.
        assert_eq!(w.iter().filter(|c| c.sp == 0).count(), 8);
        assert_eq!(w.iter().filter(|c| c.sp == 1).count(), 4);
        assert_eq!(net.sp(0).segs, [(0, false), (2, false)]);
        assert!(net.sp(1).segs.iter().all(|&(_, s)| s));
        all_finished(&mut net, &[0, 1]);
    }

    #[test]
    fn zero_length_blocks_complete_without_copies() {
        let (members, nodes) = ([0, 1, 1], [0, 1, 1]);
        for design in [Design::Flat, Design::Hier] {
            let mut net = Net::new(2);
            for r in 0..3 {
                let mut p = post(r, 0, &members, &nodes);
                if design == Design::Hier {
                    p = hier(p);
                }
                net.post(members[r as usize], p);
            }
            net.run();
            assert!(net.copied.is_empty());
            for r in 0..3 {
                assert_eq!(net.status(r), Some(Status::Ok));
            }
            all_finished(&mut net, &[0, 1]);
        }
    }

    #[test]
    fn a_length_mismatch_aborts_everyone_without_writing_there() {
        let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
        let mut net = Net::new(3);
        net.post(0, post(0, 6, &members, &nodes));
        net.post(1, post(1, 6, &members, &nodes));
        net.post(2, post(2, 7, &members, &nodes));
        net.run();
        for r in 0..3 {
            assert!(!net.status(r).unwrap().is_ok(), "rank {r}");
        }
        assert_eq!(net.status(2), Some(Status::CountMismatch));
        assert!(!writes(&net).iter().any(|c| c.rank == 2));
        all_finished(&mut net, &[0, 1, 2]);
    }

    #[test]
    fn another_comm_aborts_with_invalid_post() {
        // Rank 2 posts with ranks 0 and 1 swapped (SPs and nodes).
        let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
        let mut net = Net::new(3);
        net.post(0, post(0, 4, &members, &nodes));
        net.post(1, post(1, 4, &members, &nodes));
        net.post(2, post(2, 4, &[1, 0, 2], &[1, 0, 2]));
        net.run();
        for r in 0..3 {
            assert_eq!(net.status(r), Some(Status::InvalidPost), "rank {r}");
        }
        all_finished(&mut net, &[0, 1, 2]);
    }

    /// SP 1 aborts while SP 0's write into rank 1 is in flight: rank 1
    /// completes only after SP 0 reports `Stopped`, which it does once the
    /// write finished.
    #[test]
    fn an_aborted_rank_waits_for_remote_writers_to_stop() {
        let (members, nodes) = ([0, 1], [0, 1]);
        let mut net = Net::new(2);
        net.post(0, post(0, 4, &members, &nodes));
        net.post(1, post(1, 4, &members, &nodes));
        net.deliver_all();
        assert!(net.finish_copy(Status::Ok) && net.finish_copy(Status::Ok));
        // Hold SP 0's write into rank 1.
        let i = net
            .copies
            .iter()
            .position(|(sp, c)| *sp == 0 && c.rank == 1)
            .unwrap();
        let held = net.copies.remove(i).unwrap();
        net.sp(1).m.abort(100, Status::Aborted);
        net.collect(1);
        net.run();
        assert_eq!(net.status(0), Some(Status::Aborted));
        assert_eq!(net.status(1), None, "SP 0 still writes into rank 1");
        assert!(!net.sp(1).m.is_finished());
        assert_eq!(net.sp(0).m.copies_in_flight(), 1);
        net.copies.push_back(held);
        assert!(net.finish_copy(Status::Ok));
        assert!(matches!(
            &sent(&net, 0, 1)[..],
            [Msg::Stopped {
                status: Status::Aborted
            }]
        ));
        net.run();
        assert_eq!(net.status(1), Some(Status::Aborted));
        all_finished(&mut net, &[0, 1]);
    }

    #[test]
    fn a_lost_writer_counts_as_stopped() {
        let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
        let mut net = Net::new(3);
        for r in 0..3 {
            net.post(r, post(r, 4, &members, &nodes));
        }
        net.deliver_all();
        net.dead.insert(2);
        for sp in [0, 1] {
            net.sp(sp).m.handle_peer_lost(100, 2);
            net.collect(sp);
        }
        net.run();
        assert_eq!(net.status(0), Some(Status::PeerFailed));
        assert_eq!(net.status(1), Some(Status::PeerFailed));
        all_finished(&mut net, &[0, 1]);
    }

    #[test]
    fn a_rank_lost_before_posting_fails_every_rank() {
        let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
        let mut net = Net::new(3);
        net.sp(1).m.handle_rank_lost(0, 1);
        net.post(0, post(0, 8, &members, &nodes));
        net.post(2, post(2, 8, &members, &nodes));
        net.run();
        assert_eq!(net.status(0), Some(Status::RankFailed));
        assert_eq!(net.status(2), Some(Status::RankFailed));
        assert_eq!(net.status(1), None);
        // SP 1 never sees a post: it answered the keys with `Stopped` and
        // is dropped with the job.
        all_finished(&mut net, &[0, 2]);
    }

    #[test]
    fn a_failed_write_aborts_with_access_error() {
        let (members, nodes) = ([0, 1], [0, 1]);
        let mut net = Net::new(2);
        for r in 0..2 {
            net.post(r, post(r, 4, &members, &nodes));
        }
        net.deliver_all();
        assert!(net.finish_copy(Status::Ok) && net.finish_copy(Status::Ok));
        net.deliver_all();
        assert!(net.finish_copy(Status::AccessError));
        net.run();
        assert_eq!(net.status(0), Some(Status::AccessError));
        assert_eq!(net.status(1), Some(Status::AccessError));
        all_finished(&mut net, &[0, 1]);
    }

    #[test]
    fn refusals_answer_what_waits_for_an_answer() {
        let s = Status::RankFailed;
        let key = Msg::Key {
            rank: 0,
            len: 1,
            comm: 2,
            key: ('r', 0),
        };
        assert_eq!(refusal(&key, s), Some(Msg::Stopped { status: s }));
        assert_eq!(
            refusal(&Msg::<Tag>::Abort { status: s }, Status::Ok),
            Some(Msg::Stopped {
                status: Status::Aborted
            })
        );
        assert_eq!(refusal(&Msg::<Tag>::WrittenRegion, s), None);
        assert_eq!(refusal(&Msg::<Tag>::Written { ranks: vec![1] }, s), None);
        assert_eq!(refusal(&Msg::<Tag>::Stopped { status: s }, s), None);
    }

    #[test]
    fn invalid_posts_and_messages_are_rejected() {
        let mut m: StagedAllgather<Tag> = StagedAllgather::new(
            KEY,
            Config {
                me: 0,
                chunk_bytes: 4,
                staging_slots: 2,
            },
        );
        let mut p = post(0, 4, &[0, 1], &[0, 1]);
        p.design = Design::Hier;
        assert_eq!(
            m.handle_post(0, p),
            Err(PostError::MissingSharedKey { rank: 0 })
        );
        assert_eq!(
            m.handle_post(0, post(1, 4, &[0, 1], &[0, 1])),
            Err(PostError::NotMine {
                rank: 1,
                served_by: 1
            })
        );
        assert_eq!(
            m.handle_post(0, post(0, 4, &[0, 0], &[0, 1])),
            Err(PostError::SpOnTwoNodes { sp: 0 })
        );
        assert_eq!(
            m.handle_post(0, post(0, u64::MAX, &[0, 1], &[0, 1])),
            Err(PostError::Overflow { rank: 0 })
        );
        assert!(m.members().is_none() && m.poll_action().is_none());
        assert_eq!(
            m.handle_msg(0, 1, Msg::WrittenRegion),
            Err(MsgError::Unexpected { sp: 1 })
        );
        let key = Msg::Key {
            rank: 1,
            len: 4,
            comm: comm_digest(&[0, 1], &[0, 1]),
            key: ('r', 1),
        };
        m.handle_msg(0, 1, key.clone()).unwrap();
        assert_eq!(m.handle_msg(0, 1, key), Err(MsgError::Duplicate { sp: 1 }));
        m.handle_post(0, post(0, 4, &[0, 1], &[0, 1])).unwrap();
        assert_eq!(
            m.handle_post(0, post(0, 4, &[0, 1], &[0, 1])),
            Err(PostError::DuplicatePost { rank: 0 })
        );
        assert_eq!(
            m.handle_msg(0, 1, Msg::Written { ranks: vec![1] }),
            Err(MsgError::Unexpected { sp: 1 })
        );
    }
}
