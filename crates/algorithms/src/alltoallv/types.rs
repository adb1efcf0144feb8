//! The alltoallv's public types: posts, messages, copies, actions,
//! errors and counters.

use super::*;

/// What one local rank posted.
pub type Post<K> = crate::direct::Post<K, Own>;

/// The alltoallv's own part of a [`Post`]: where its block for each comm
/// rank is in its send buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Own {
    pub send_counts: Vec<u64>,
    pub send_displs: Vec<u64>,
}

/// SP-to-SP messages of this collective (the driver adds the `CollKey`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg<K> {
    /// `src`'s block for `dst` is ready at (`key`, `offset`, `len`).
    Announce {
        src: Rank,
        dst: Rank,
        key: K,
        offset: u64,
        len: u64,
    },
    /// `dst`'s SP is done with `src`'s block (read it, or decided not to).
    Ack {
        src: Rank,
        dst: Rank,
        status: Status,
    },
    /// The collective failed; stop and complete everyone with `status`.
    Abort { status: Status },
}

impl<K> Msg<K> {
    /// The memory keys the message carries (an SP checks where a peer's keys point).
    pub fn keys(&self) -> Vec<&K> {
        match self {
            Msg::Announce { key, .. } => vec![key],
            Msg::Ack { .. } | Msg::Abort { .. } => Vec::new(),
        }
    }
}

/// Copy `len` bytes from `src_rank`'s send buffer to `dst_rank`'s receive
/// buffer (no segment: `seg` is `()`).
pub type Copy<K> = crate::direct::Copy<K>;

/// Output of the state machine.
pub type Action<K> = crate::direct::Action<Msg<K>, Copy<K>>;

crate::common::post_error! {
    own {
        /// `members` differs from an earlier post of this instance.
        MembersDisagree,
        /// `displs[index] + counts[index]` overflows `u64`.
        Overflow {
            rank: Rank,
            field: &'static str,
            index: usize,
        },
    }
    display(f) {
        PostError::MembersDisagree => {
            write!(f, "members differ from an earlier post of this collective")
        }
        PostError::Overflow { rank, field, index } => {
            write!(f, "rank {rank}: {field} displacement+count overflows at {index}")
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
    /// The rank the message is about is not served by this SP.
    NotLocal {
        rank: Rank,
    },
    /// The message came from an SP that does not serve `rank`.
    WrongSender {
        rank: Rank,
        expected: SpId,
        got: SpId,
    },
    /// An abort from an SP outside the communicator.
    NotMember {
        sp: SpId,
    },
    DuplicateAnnounce {
        src: Rank,
        dst: Rank,
    },
    /// Ack for a block that was not announced or is already acknowledged.
    UnexpectedAck {
        src: Rank,
        dst: Rank,
    },
    /// `offset + len` overflows `u64`.
    Overflow {
        src: Rank,
        dst: Rank,
    },
}

impl fmt::Display for MsgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MsgError::RankOutOfRange { rank, size } => {
                write!(f, "rank {rank} out of range for comm size {size}")
            }
            MsgError::NotLocal { rank } => write!(f, "rank {rank} is not served by this SP"),
            MsgError::WrongSender {
                rank,
                expected,
                got,
            } => write!(
                f,
                "message about rank {rank} from SP {got}, rank is served by SP {expected}"
            ),
            MsgError::NotMember { sp } => write!(f, "SP {sp} is not part of the communicator"),
            MsgError::DuplicateAnnounce { src, dst } => {
                write!(f, "duplicate announcement {src}->{dst}")
            }
            MsgError::UnexpectedAck { src, dst } => write!(f, "unexpected ack {src}->{dst}"),
            MsgError::Overflow { src, dst } => {
                write!(f, "announcement {src}->{dst}: offset+len overflows")
            }
        }
    }
}

impl std::error::Error for MsgError {}

/// Counters for drivers, tests and the simulator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Announcements queued because their destination rank had not posted
    /// (or the membership was not known) when they arrived.
    pub late_announcements: u64,
    /// Announcements queued before the membership was known that turned out
    /// to be invalid once it was (protocol violations that could not be
    /// reported as `MsgError`).
    pub discarded_announcements: u64,
    /// `handle_copy_done` calls for unknown copy ids (ignored).
    pub unknown_copy_done: u64,
    /// Messages ignored because their sender was declared lost.
    pub ignored_from_lost_sp: u64,
}
