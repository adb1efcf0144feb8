//! The staged allgather's public types: posts, messages (and the refusal
//! of a finished instance), copies, actions, errors and counters.

use super::*;

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

/// Output of the state machine (it has no moves). `Complete`'s
/// `from_segment` is for every rank, which copies `P * len` bytes out of
/// the region.
pub type Action<K> = crate::staged::Action<Msg<K>, Copy<K>, std::convert::Infallible>;

crate::common::post_error! {
    own {
        /// One SP serves ranks on two nodes.
        SpOnTwoNodes { sp: SpId },
        /// `Design::Hier` without a `shared_key`.
        MissingSharedKey { rank: Rank },
        /// `P * len` overflows `u64`.
        Overflow { rank: Rank },
    }
    display(f) {
        PostError::SpOnTwoNodes { sp } => write!(f, "SP {sp} serves ranks on two nodes"),
        PostError::MissingSharedKey { rank } => {
            write!(f, "rank {rank}: hierarchical allgather without a shared segment")
        }
        PostError::Overflow { rank } => {
            write!(f, "rank {rank}: comm size times block length overflows")
        }
    }
}

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

crate::common::debug_error!(MsgError);

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

crate::staged::stats_absorb!(Stats {
    sum: bytes_staged, chunk_reads, chunk_writes, writes_waited_for_key, keys_before_post,
        written_msgs, regions_shared, unknown_done, ignored_from_lost_sp;
    max: max_slots_in_use
});

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
