//! The allgatherv's public types: posts, messages, copies, actions,
//! errors and counters.

use super::*;

/// What one local rank posted. The SPs of each node are derived from
/// `members` and `own.nodes`.
pub type Post<K> = crate::direct::Post<K, Own>;

/// The allgatherv's own part of a [`Post`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Own {
    /// Node of each comm rank.
    pub nodes: Vec<u32>,
    /// The send block starts at offset 0 of `send_key`.
    pub send_len: u64,
}

/// `src`'s segment is at (`key`, `offset`, `len`); land it on `node`
/// (whose SPs are `node_sps`); ack to `origin` (the SP of `src`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Announcement<K> {
    pub src: Rank,
    pub origin: SpId,
    pub key: K,
    pub offset: u64,
    pub len: u64,
    pub node: u32,
    pub node_sps: Vec<SpId>,
}

/// `src`'s segment is on this node at (`key`, `offset`, `len`) in
/// `holder`'s buffer (`from_send`: its send buffer, else its receive
/// buffer), served by `holder_sp`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment<K> {
    pub src: Rank,
    pub holder: Rank,
    pub holder_sp: SpId,
    pub key: K,
    pub offset: u64,
    pub len: u64,
    pub from_send: bool,
}

/// SP-to-SP messages of this collective (the driver adds the `CollKey`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg<K> {
    /// From the SP of `src` to one SP of another node.
    Announce(Announcement<K>),
    /// An announcement passed between SPs of its node. `remaining`: SPs of
    /// the ring still to visit after the receiver (0: park if not ready).
    /// `parked`: it was parked before.
    Pass {
        ann: Announcement<K>,
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
    /// To every SP of the holder's node, itself included.
    Segment(Segment<K>),
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
            Msg::Announce(Announcement { key, .. })
            | Msg::Pass {
                ann: Announcement { key, .. },
                ..
            }
            | Msg::Segment(Segment { key, .. }) => vec![key],
            Msg::Ack { .. }
            | Msg::RankReady
            | Msg::SegmentDone { .. }
            | Msg::Abort { .. }
            | Msg::Release { .. } => Vec::new(),
        }
    }
}

/// Copy `len` bytes of segment `seg` from `src_rank`'s buffer (`src_key`:
/// its send buffer, or its receive buffer holding `seg`) into `dst_rank`'s
/// receive buffer.
pub type Copy<K> = crate::direct::Copy<K, Rank>;

/// Output of the state machine.
pub type Action<K> = crate::direct::Action<Msg<K>, Copy<K>>;

crate::common::post_error! {
    own {
        /// `members`/`nodes` differ from an earlier post of this instance.
        MembersDisagree,
        /// One SP serves ranks on two nodes.
        SpOnTwoNodes { sp: SpId },
        /// `recv_displs[index] + recv_counts[index]` overflows `u64`.
        Overflow { rank: Rank, index: usize },
    }
    display(f) {
        PostError::MembersDisagree => write!(f, "members/nodes differ from an earlier post"),
        PostError::SpOnTwoNodes { sp } => write!(f, "SP {sp} serves ranks on two nodes"),
        PostError::Overflow { rank, index } => {
            write!(f, "rank {rank}: receive displacement+count overflows at {index}")
        }
    }
}

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

crate::common::debug_error!(MsgError);

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
