//! Where each world rank runs, from what the ranks found out at `MPI_Init`, never from a
//! launcher's layout.
//!
//! Every rank says which node it is on ([`NodeSource`]): from the `SPOFF_NODE` hint (an
//! emulated node given by a launcher, a node index or a host name of the description), from
//! its host name (`MPI_Get_processor_name`) matched against the description's `hosts`, or, for
//! an emulated description without host names, from the description's layout. The shim gathers
//! one [`NodeReport`] per rank on every rank (one allgather), together with the shared-memory
//! group the rank belongs to (`MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`, named by its lowest
//! world rank), and [`place_ranks`] turns them into placements, identically on every rank:
//! the local rank of a rank is its position among the world ranks of its node in world-rank
//! order, and its SP is `local rank mod K` of its node. So any mapping works: uneven ranks per
//! node, any `--map-by`, rankfiles, a node with one rank.
//!
//! Host names are checked against the machines MPI sees: the ranks of one shared-memory group
//! (one machine) must name one node, and one node must not be named from two machines (two
//! hosts with the same name). A hint or the layout is the emulation's word and is not
//! checked against shared memory (every emulated node is on one machine).
//!
//! The layout only stands for one machine: a job placed by it whose ranks' host names differ
//! (a description without `hosts` used on a real cluster) is refused, since the layout would
//! serve ranks by another node's SP. Each report carries a hash of its rank's host name for
//! that.

use crate::cluster::{Cluster, Placement};

/// How a rank found its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeSource {
    /// `SPOFF_NODE`.
    Hint = 1,
    /// Its host name, matched against the description's `hosts`.
    HostName = 2,
    /// The layout of an emulated description without host names.
    Layout = 3,
}

/// What one rank found out about where it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeReport {
    /// Its node, or `None` when it could not tell (it says why itself).
    pub node: Option<u32>,
    /// The lowest world rank of its shared-memory group (its machine).
    pub machine: u32,
    pub source: NodeSource,
    /// [`host_hash`] of its host name (`MPI_Get_processor_name`); 0 when it has none.
    pub host: u64,
}

/// Words per rank in the gathered array of [`NodeReport::encode`].
pub const REPORT_WORDS: usize = 5;

/// A host name as a report carries it (FNV-1a, 64 bits; never 0).
pub fn host_hash(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h.max(1)
}

impl NodeReport {
    pub fn encode(&self) -> [u32; REPORT_WORDS] {
        [
            self.node.unwrap_or(u32::MAX),
            self.machine,
            self.source as u32,
            self.host as u32,
            (self.host >> 32) as u32,
        ]
    }

    /// A report gathered from another rank; a garbled one reads as "could not tell".
    pub fn decode(w: [u32; REPORT_WORDS]) -> NodeReport {
        let source = match w[2] {
            1 => NodeSource::Hint,
            2 => NodeSource::HostName,
            _ => NodeSource::Layout,
        };
        NodeReport {
            node: (w[0] != u32::MAX).then_some(w[0]),
            machine: w[1],
            source,
            host: w[3] as u64 | (w[4] as u64) << 32,
        }
    }
}

/// The node a host name names: the description's entry equal to it, or else the one whose
/// short name (up to the first dot) equals its short name (`node01` for `node01.cluster`).
pub fn node_named(cluster: &Cluster, name: &str) -> Option<u32> {
    if let Some(n) = cluster.hosts.iter().position(|h| h == name) {
        return Some(n as u32);
    }
    let short = |s: &str| s.split('.').next().unwrap_or(s).to_string();
    let want = short(name);
    let found: Vec<usize> = (0..cluster.hosts.len())
        .filter(|&n| short(&cluster.hosts[n]) == want)
        .collect();
    match found.as_slice() {
        [n] => Some(*n as u32),
        _ => None,
    }
}

/// The node a `SPOFF_NODE` hint names: a node index, or a host name of the description.
pub fn node_of_hint(cluster: &Cluster, hint: &str) -> Result<u32, String> {
    let hint = hint.trim();
    if let Ok(n) = hint.parse::<u32>() {
        if n < cluster.nodes {
            return Ok(n);
        }
        return Err(format!(
            "SPOFF_NODE={hint} is not a node of the cluster description ({} nodes: 0..={})",
            cluster.nodes,
            cluster.nodes - 1
        ));
    }
    node_named(cluster, hint).ok_or_else(|| {
        format!(
            "SPOFF_NODE={hint:?} names no node of the cluster description (a node index or \
             one of its host names: {})",
            shown_hosts(cluster)
        )
    })
}

/// The node of a rank whose host name is `name`, when no hint is given.
pub fn node_of_host(cluster: &Cluster, name: &str) -> Result<u32, String> {
    node_named(cluster, name).ok_or_else(|| {
        format!(
            "this host, {name:?}, is not in the cluster description's hosts ({}); set SPOFF_NODE \
             or add it",
            shown_hosts(cluster)
        )
    })
}

fn shown_hosts(cluster: &Cluster) -> String {
    if cluster.hosts.is_empty() {
        return "it names none".into();
    }
    let mut s: Vec<&str> = cluster.hosts.iter().take(8).map(String::as_str).collect();
    if cluster.hosts.len() > 8 {
        s.push("...");
    }
    s.join(", ")
}

/// Every rank's placement from every rank's report (indexed by world rank). The same on every
/// rank for the same reports; an error names the first problem.
pub fn place_ranks(cluster: &Cluster, reports: &[NodeReport]) -> Result<Vec<Placement>, String> {
    let k = cluster.sps_per_node;
    let mut per_node = vec![0u32; cluster.nodes as usize];
    // For host-name placement: the machine that first named each node, and the node each
    // machine named.
    let mut machine_of_node: Vec<Option<(u32, u32)>> = vec![None; cluster.nodes as usize];
    let mut node_of_machine = std::collections::HashMap::new();
    let host = |n: u32| {
        cluster
            .hosts
            .get(n as usize)
            .map_or(String::new(), |h| format!(" ({h})"))
    };
    let mut out = Vec::with_capacity(reports.len());
    for (r, rep) in reports.iter().enumerate() {
        let r = r as u32;
        let Some(node) = rep.node else {
            return Err(format!(
                "world rank {r} could not tell its node (see its message)"
            ));
        };
        if node >= cluster.nodes {
            return Err(format!(
                "world rank {r} says it is on node {node}, but the cluster has {} nodes",
                cluster.nodes
            ));
        }
        if rep.source == NodeSource::HostName {
            if let Some((m, r0)) = node_of_machine.get(&rep.machine).copied() {
                if m != node {
                    return Err(format!(
                        "world ranks {r0} and {r} share memory (one machine) but their host \
                         names name node {m}{} and node {node}{}",
                        host(m),
                        host(node)
                    ));
                }
            }
            node_of_machine.insert(rep.machine, (node, r));
            match machine_of_node[node as usize] {
                Some((machine, r0)) if machine != rep.machine => {
                    return Err(format!(
                        "world ranks {r0} and {r} are on two machines (no shared memory) that \
                         both call themselves node {node}{}: two hosts with one name?",
                        host(node)
                    ));
                }
                Some(_) => {}
                None => machine_of_node[node as usize] = Some((rep.machine, r)),
            }
        }
        let local_rank = per_node[node as usize];
        per_node[node as usize] += 1;
        out.push(Placement {
            node,
            local_rank,
            sp: cluster.sp_id(node, local_rank % k),
        });
    }
    layout_on_one_host(reports)?;
    Ok(out)
}

/// A layout places ranks of one machine: refused when a rank is placed by it and the ranks'
/// host names differ (ranks whose host name is unknown are not counted).
fn layout_on_one_host(reports: &[NodeReport]) -> Result<(), String> {
    if !reports.iter().any(|r| r.source == NodeSource::Layout) {
        return Ok(());
    }
    let mut named = reports.iter().enumerate().filter(|(_, r)| r.host != 0);
    let Some((r0, first)) = named.next() else {
        return Ok(());
    };
    match named.find(|(_, r)| r.host != first.host) {
        None => Ok(()),
        Some((r1, _)) => Err(format!(
            "the cluster description names no hosts, so its layout placed the ranks, but world \
             ranks {r0} and {r1} run on two hosts (their host names differ): a layout only \
             places the ranks of one machine, and would have ranks served by another node's \
             SP; list the nodes' host names in the description's hosts (or give each rank \
             SPOFF_NODE)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Layout;

    fn cluster(nodes: u32, k: u32, hosts: &[&str]) -> Cluster {
        crate::testing::cluster(nodes, k, Layout::Block, hosts)
    }

    fn by_name(nodes: &[u32]) -> Vec<NodeReport> {
        // One machine per node: the machine is the node's first rank.
        nodes
            .iter()
            .map(|&n| NodeReport {
                node: Some(n),
                machine: nodes.iter().position(|&m| m == n).unwrap() as u32,
                source: NodeSource::HostName,
                host: host_hash(&format!("host{n}")),
            })
            .collect()
    }

    #[test]
    fn local_ranks_follow_world_rank_order_on_each_node() {
        let c = cluster(3, 2, &["a", "b", "c"]);
        // Interleaved and uneven: 1 + 4 + 2 ranks.
        let nodes = [1, 0, 1, 2, 1, 2, 1];
        let p = place_ranks(&c, &by_name(&nodes)).unwrap();
        let local: Vec<u32> = p.iter().map(|p| p.local_rank).collect();
        assert_eq!(local, [0, 0, 1, 0, 2, 1, 3]);
        let sps: Vec<u32> = p.iter().map(|p| p.sp).collect();
        // SP = node * K + local % K.
        assert_eq!(sps, [2, 0, 3, 4, 2, 5, 3]);
        for (pl, &n) in p.iter().zip(&nodes) {
            assert_eq!(pl.node, n);
            assert_eq!(c.sp(pl.sp).unwrap().node, n);
        }
    }

    #[test]
    fn a_node_without_ranks_and_a_node_with_one_are_fine() {
        let c = cluster(4, 1, &["a", "b", "c", "d"]);
        let p = place_ranks(&c, &by_name(&[0, 0, 0, 3])).unwrap();
        assert_eq!(p[3].sp, 3);
        assert_eq!(p[3].local_rank, 0);
    }

    #[test]
    fn placement_matches_the_layout_when_ranks_say_what_the_layout_says() {
        for layout in [Layout::Block, Layout::Cyclic] {
            let mut c = cluster(3, 2, &[]);
            c.layout = layout;
            let size = 9;
            let reports: Vec<NodeReport> = (0..size)
                .map(|r| NodeReport {
                    node: Some(c.placement(r, size).unwrap().node),
                    machine: 0,
                    source: NodeSource::Layout,
                    host: host_hash("one"),
                })
                .collect();
            let p = place_ranks(&c, &reports).unwrap();
            for r in 0..size {
                assert_eq!(
                    p[r as usize],
                    c.placement(r, size).unwrap(),
                    "{layout:?} {r}"
                );
            }
        }
    }

    #[test]
    fn host_names_must_agree_with_shared_memory() {
        let c = cluster(2, 1, &["a", "b"]);
        // Ranks 0 and 1 on one machine, naming two nodes.
        let mut reps = by_name(&[0, 1]);
        reps[1].machine = 0;
        let e = place_ranks(&c, &reps).unwrap_err();
        assert!(
            e.contains("share memory") && e.contains("(a)") && e.contains("(b)"),
            "{e}"
        );
        // Two machines naming one node.
        let mut reps = by_name(&[0, 0]);
        reps[1].machine = 1;
        let e = place_ranks(&c, &reps).unwrap_err();
        assert!(e.contains("two machines"), "{e}");
        // Hints are the emulation's word: one machine, several nodes.
        let reps = crate::testing::hinted_reports(&[0, 1, 0]);
        assert_eq!(place_ranks(&c, &reps).unwrap()[2].local_rank, 1);
    }

    #[test]
    fn a_rank_without_a_node_or_outside_the_cluster_fails_every_rank() {
        let c = cluster(2, 1, &["a", "b"]);
        let mut reps = by_name(&[0, 1]);
        reps[1].node = None;
        assert!(place_ranks(&c, &reps).unwrap_err().contains("world rank 1"));
        reps[1].node = Some(2);
        assert!(place_ranks(&c, &reps).unwrap_err().contains("2 nodes"));
        for r in &reps {
            assert_eq!(NodeReport::decode(r.encode()), *r);
        }
        let none = NodeReport {
            node: None,
            machine: 3,
            source: NodeSource::Hint,
            host: u64::MAX - 5,
        };
        assert_eq!(NodeReport::decode(none.encode()), none);
    }

    #[test]
    fn names_and_hints_resolve_to_nodes() {
        let c = cluster(3, 1, &["node01.cl", "node02", "gpu7"]);
        assert_eq!(node_of_host(&c, "node02").unwrap(), 1);
        // Short names match either way.
        assert_eq!(node_of_host(&c, "node01").unwrap(), 0);
        assert_eq!(node_of_host(&c, "node02.cl").unwrap(), 1);
        let e = node_of_host(&c, "node03").unwrap_err();
        assert!(e.contains("node03") && e.contains("gpu7"), "{e}");
        assert_eq!(node_of_hint(&c, "2").unwrap(), 2);
        assert_eq!(node_of_hint(&c, "gpu7").unwrap(), 2);
        assert!(node_of_hint(&c, "3").unwrap_err().contains("3 nodes"));
        assert!(node_of_hint(&c, "x").is_err());
        // An ambiguous short name matches nothing.
        let d = cluster(2, 1, &["n1.a", "n1.b"]);
        assert!(node_named(&d, "n1").is_none());
        assert_eq!(node_named(&d, "n1.b"), Some(1));
    }
}
