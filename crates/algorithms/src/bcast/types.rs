//! The bcast's public types: posts, messages, copies and moves, actions,
//! errors and counters.

use super::*;

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

/// Output of the state machine. `Complete`'s `from_segment` is for
/// non-root ranks, which copy `len` bytes out of the segment.
pub type Action<K> = crate::staged::Action<Msg, Copy<K>, Move>;

crate::common::post_error! {
    own {
        /// `root >= members.len()`.
        RootOutOfRange { root: Rank, size: usize },
        /// `members`/`nodes` differ from an earlier post of this instance.
        MembersDisagree,
        /// One SP serves ranks on two nodes.
        SpOnTwoNodes { sp: SpId },
        /// `Design::Hier` without a `shared_key`.
        MissingSharedKey { rank: Rank },
    }
    display(f) {
        PostError::RootOutOfRange { root, size } => {
            write!(f, "root {root} out of range for comm size {size}")
        }
        PostError::MembersDisagree => write!(f, "members/nodes differ from an earlier post"),
        PostError::SpOnTwoNodes { sp } => write!(f, "SP {sp} serves ranks on two nodes"),
        PostError::MissingSharedKey { rank } => {
            write!(f, "rank {rank}: hierarchical bcast without a shared segment")
        }
    }
}

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

crate::common::debug_error!(MsgError);

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

crate::staged::stats_absorb!(Stats {
    sum: chunks_forwarded, bytes_staged, chunks_before_post, unknown_done,
        ignored_from_lost_sp, regions_shared;
    max: max_slots_in_use
});
