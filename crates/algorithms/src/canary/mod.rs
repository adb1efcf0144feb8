//! Canary: congestion-aware in-network allreduce with dynamic trees (De Sensi et al., the
//! paper in `shared/papers/canary-innetwork-allreduce.txt`), as sans-IO state machines.
//!
//! - [`packet`]: the wire format (§4.1), with a decoder that refuses any other bytes.
//! - [`switch`]: the switch (§3.1–§3.2, §3.5): a fixed descriptor table indexed by a hash of
//!   the block id, best-effort aggregation in a time window, remembered children,
//!   collisions forwarded to the leader and restored (§3.2.1), the up-port chosen by queue
//!   occupancy (§5.2), soft state.
//! - [`host`]: a member, sender of its vector and leader of its share of the blocks (§3.1.3,
//!   §3.1.4, §3.3): contributions counted per block, restart of a block that cannot be
//!   completed, retransmission on request, an abort after too many attempts.
//! - [`sim`]: a packet-level discrete-event simulator of the paper's two-level fat tree
//!   (§5.2) driving these machines, with the baselines (host ring, static trees) and faults.
//!
//! Nothing here reads a clock or touches a socket: every call takes `now`, every machine
//! tells its next deadline, outputs are packets (with their output port, for a switch).
//! Each module says what it simplifies against the paper.

pub mod host;
pub mod packet;
pub mod sim;
pub mod switch;

pub use host::{BlockSource, Host, HostConfig, HostError, HostEvent, HostStats};
pub use packet::{DecodeError, Head, Packet};
pub use switch::{PortLoad, Switch, SwitchConfig, SwitchStats, TreeRule, ANY_COLL};

/// A network address (host or switch), as the packets carry it.
pub type Addr = u32;
/// A switch port number.
pub type Port = u16;

/// The id of one block of one allreduce: the paper's id (§3.4: application and packet)
/// plus the attempt, bumped when the leader restarts the block (§3.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId {
    /// The allreduce (unique among the concurrent ones).
    pub coll: u32,
    pub block: u32,
    pub attempt: u16,
}

#[cfg(test)]
mod tests;
