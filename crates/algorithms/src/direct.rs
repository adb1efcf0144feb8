//! What the direct collectives ([`crate::allgatherv`] and
//! [`crate::alltoallv`]: copies between two ranks' buffers, no staging)
//! have alike: their configuration, posts, copy ids, copies and the actions they
//! emit.
//! Nothing here knows either protocol.

use serde::{Deserialize, Serialize};

use crate::{Rank, SpId, Status};

/// Static configuration of one instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Config {
    /// The SP running this instance.
    pub me: SpId,
}

/// Identifies a copy within one instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CopyId(pub u64);

/// What one local rank posts to a direct collective (sizes in bytes,
/// already checked by the driver against the rank's buffers); `O` is the
/// collective's own part.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Post<K, O> {
    pub rank: Rank,
    /// SP serving each comm rank; its length is the comm size P.
    pub members: Vec<SpId>,
    pub send_key: K,
    pub recv_key: K,
    /// Where each comm rank's block lands in the receive buffer.
    pub recv_counts: Vec<u64>,
    pub recv_displs: Vec<u64>,
    pub own: O,
}

/// Copy `len` bytes from `src_rank`'s buffer (`src_key`) into `dst_rank`'s
/// receive buffer (`dst_rank` is always served by this SP). `seg` is what a
/// collective that moves segments adds: the allgatherv's segment (a
/// [`Rank`]); the alltoallv copies a block and has none (`()`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copy<K, S = ()> {
    pub id: CopyId,
    pub seg: S,
    pub src_rank: Rank,
    pub src_key: K,
    pub src_offset: u64,
    pub dst_rank: Rank,
    pub dst_key: K,
    pub dst_offset: u64,
    pub len: u64,
}

/// Output of a direct state machine: `M` its messages, `C` its copies.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action<M, C> {
    /// Send `msg` to SP `to` (never this SP itself).
    Send { to: SpId, msg: M },
    /// Start this copy and report it with `handle_copy_done`.
    Copy(C),
    /// Local `rank` is done with the collective; emitted exactly once per
    /// posted rank.
    Complete { rank: Rank, status: Status },
}
