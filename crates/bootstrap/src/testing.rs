//! Fixtures for the tests of this crate and of the crates using it (not for production code).

use crate::cluster::{Cluster, Layout, SpEntry};
use crate::placement::{NodeReport, NodeSource};
use std::net::SocketAddr;

/// A valid description: `nodes` x `sps_per_node` SPs, peer addresses on loopback where
/// nothing listens, host sockets in /tmp, `hosts` its host names (or none).
pub fn cluster(nodes: u32, sps_per_node: u32, layout: Layout, hosts: &[&str]) -> Cluster {
    let sps = (0..nodes * sps_per_node)
        .map(|i| {
            let peer_addr = SocketAddr::from(([127, 0, 0, 1], 1000 + i as u16));
            SpEntry::numbered(i, sps_per_node, peer_addr, format!("/tmp/sp{i}").into())
        })
        .collect();
    let mut c = Cluster::new(nodes, sps_per_node, None, layout, sps).unwrap();
    c.hosts = hosts.iter().map(|h| h.to_string()).collect();
    c.validate().unwrap();
    c
}

/// The reports of ranks on one machine (the emulation's), world rank `r` told by its hint
/// that it is on node `nodes[r]`.
pub fn hinted_reports(nodes: &[u32]) -> Vec<NodeReport> {
    nodes
        .iter()
        .map(|&n| NodeReport {
            node: Some(n),
            machine: 0,
            source: NodeSource::Hint,
            host: 0,
        })
        .collect()
}
