//! Sans-IO state machines for the collectives that service processes (SPs)
//! progress on behalf of host MPI ranks, plus a deterministic simulator that
//! drives the very same objects. Every collective instance is a plain value:
//! the driver feeds it inputs through `handle_*(now, ...)` calls and pulls its
//! outputs (messages to other SPs, memory copies to perform, rank
//! completions) through `poll_*`, in the style of `quinn-proto`. This crate
//! never does I/O of any kind: no sockets, no threads, no clocks (time is
//! always an argument), no OS randomness (the simulator uses its own seeded
//! generator) and no printing.

use serde::{Deserialize, Serialize};

mod abort;
pub mod allgatherv;
pub mod allreduce;
pub mod alltoallv;
pub mod bcast;
pub mod canary;
mod common;
pub mod direct;
pub mod host_ring;
pub mod mcast_allgather;
pub mod mcast_bcast;
pub mod sched;
pub mod sim;
pub mod staged;
pub mod staged_allgather;
#[cfg(test)]
mod test_util;

/// Global index of a service process in the cluster.
pub type SpId = u32;
/// Rank within a communicator (`0..comm size`).
pub type Rank = u32;
/// Time in nanoseconds supplied by the driver: virtual in the simulator,
/// monotonic in the real SP.
pub type Nanos = u64;

/// Communicator identity agreed by all its members.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CommId {
    /// Lowest world rank of the communicator.
    pub leader: u32,
    /// Id chosen by the leader, unique among the communicators it leads.
    pub id: u32,
}

/// Identity of one collective instance; a different key is a different
/// state machine object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CollKey {
    pub job: u64,
    pub comm: CommId,
    /// Per-communicator collective sequence number.
    pub seq: u64,
}

/// The whole key in one write: a keyed SipHash (std's maps) pays for every write call and
/// for joining short ones, so the four fields written one by one cost about twice as many
/// instructions as their 24 bytes at once (an SP hashes keys a few dozen times per post).
impl std::hash::Hash for CollKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let mut b = [0u8; 24];
        b[..8].copy_from_slice(&self.job.to_le_bytes());
        b[8..12].copy_from_slice(&self.comm.leader.to_le_bytes());
        b[12..16].copy_from_slice(&self.comm.id.to_le_bytes());
        b[16..].copy_from_slice(&self.seq.to_le_bytes());
        state.write(&b);
    }
}

/// Outcome of a collective for one rank (also carried in acks and aborts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Status {
    Ok,
    /// A block's announced length differs from what the receiver expects.
    CountMismatch,
    /// A copy from/to a host buffer failed.
    AccessError,
    /// An SP serving a member of the communicator died.
    PeerFailed,
    /// A host rank of the communicator died.
    RankFailed,
    /// Aborted on request.
    Aborted,
    /// The host posted something invalid.
    InvalidPost,
    /// The aggregation outside the SPs failed (Canary: a block's leader unreachable, or the
    /// block given up after too many attempts).
    NetworkFailed,
}

impl Status {
    pub fn is_ok(self) -> bool {
        self == Status::Ok
    }
}

impl core::fmt::Display for Status {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        core::fmt::Debug::fmt(self, f)
    }
}
