//! Deterministic simulators driving the state machines of this crate.
//!
//! Everything is derived from a seed: virtual time lives in the driver, the
//! state machines only see `now` arguments, and randomness comes from the
//! small generator in [`rng`]. Checkers live here, outside the algorithm
//! code.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{Nanos, SpId};

pub use config::{Common, Outcome};

pub mod allgatherv;
pub mod alltoallv;
pub mod bcast;
mod config;
mod driver;
pub mod rng;
mod shared;
pub mod staged_allgather;
mod staged_common;
#[cfg(test)]
pub(crate) mod testnet;

/// A failed simulation run. `Display` always starts with the seed so a
/// failing test prints how to reproduce it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimFailure {
    pub seed: u64,
    pub what: String,
}

impl fmt::Display for SimFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seed={:#018x} : {}", self.seed, self.what)
    }
}

impl std::error::Error for SimFailure {}

/// Placement of world ranks on nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Layout {
    /// node = rank / ranks_per_node.
    Block,
    /// node = rank % nodes.
    Cyclic,
}

/// Virtual-time costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CostModel {
    /// One-way latency of a message between SPs on different nodes.
    pub inter_node_latency_ns: Nanos,
    /// One-way latency of a message between SPs of the same node.
    pub intra_node_latency_ns: Nanos,
    /// SP time spent on each input (post, message, copy completion, ...).
    pub msg_proc_ns: Nanos,
    /// Fixed cost of a copy whose source is on another node.
    pub copy_fixed_inter_ns: Nanos,
    /// Fixed cost of a copy within a node.
    pub copy_fixed_intra_ns: Nanos,
    /// Bandwidth between nodes (bytes per ns, at least 1), for copies and
    /// for messages (each directed node-to-node link sends one message at a
    /// time; copies do not contend with each other).
    pub inter_node_bytes_per_ns: u64,
    /// Bandwidth within a node (bytes per ns, at least 1), likewise.
    pub intra_node_bytes_per_ns: u64,
    /// Wire size of a message on top of its fields (CollKey, framing).
    pub msg_header_bytes: u64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            inter_node_latency_ns: 1_500,
            intra_node_latency_ns: 200,
            msg_proc_ns: 100,
            copy_fixed_inter_ns: 2_000,
            copy_fixed_intra_ns: 400,
            inter_node_bytes_per_ns: 12,
            intra_node_bytes_per_ns: 48,
            msg_header_bytes: 32,
        }
    }
}

/// (node, SP) of world rank `r`: block or cyclic placement on nodes, and
/// SP = node * sps_per_node + (index of the rank on its node) % sps_per_node.
pub fn place_rank(
    layout: Layout,
    nodes: u32,
    ranks_per_node: u32,
    sps_per_node: u32,
    r: u32,
) -> (u32, SpId) {
    let (node, local) = match layout {
        Layout::Block => (r / ranks_per_node, r % ranks_per_node),
        Layout::Cyclic => (r % nodes, r / nodes),
    };
    (node, node * sps_per_node + local % sps_per_node)
}

/// Byte pattern of untouched receive-buffer bytes.
pub(crate) fn sentinel(pos: usize) -> u8 {
    (pos as u8).wrapping_mul(31) ^ 0xA5
}
