//! Deterministic simulators driving the state machines of this crate.
//!
//! Everything is derived from a seed: virtual time lives in the driver, the
//! state machines only see `now` arguments, and randomness comes from the
//! small generator in [`rng`]. Checkers live here, outside the algorithm
//! code.

use std::fmt;

use crate::SpId;

pub use config::{Common, CostModel, Layout, NetFaults, Outcome};
pub use driver::FabricCounts;

pub mod allgatherv;
pub mod alltoallv;
pub mod bcast;
mod config;
mod driver;
pub mod host_ring;
pub mod mcast_allgather;
pub mod mcast_bcast;
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
