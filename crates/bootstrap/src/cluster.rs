//! The cluster description: nodes, the host name of each node, SPs per node (K), where each SP
//! listens (for its peers, and for the host ranks of its node: a Unix socket on its own kernel
//! and/or a TCP address over the host-DPU network).
//!
//! Written by `service-process launch` for an emulated cluster, or by the administrator
//! (`service-process cluster init`, checked with `service-process cluster check`) for a real
//! one; read by every SP and every host shim. Where a world rank runs is not part of it: the
//! shim learns it at `MPI_Init` (see [`crate::placement`]): a rank's node from its host name
//! (or a launcher's `SPOFF_NODE` hint), its local rank from its position among the ranks of its
//! node, and its SP is SP `local_rank % K` of its node.
//!
//! `layout` and `ranks_per_node` only describe an emulation on one machine: where `launch`
//! puts the ranks of each emulated node (block: rank `r` on node `r / R`; cyclic: on `r % N`),
//! and where a rank goes when a description without host names gets no hint.

use algorithms::SpId;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    Block,
    Cyclic,
}

crate::from_word!(Layout, ["block" => Layout::Block, "cyclic" => Layout::Cyclic], |s, words| {
    format!("unknown layout {s:?} (expected {words})")
});

/// `impl FromStr for $t` (a command-line choice): one of the words of its table, each naming
/// a value; anything else is the error `$err`, with `$s` the string given and `$words` the
/// table's words as in "a, b or c" (see [`parse_word`]).
#[macro_export]
macro_rules! from_word {
    ($t:ty, [$($w:literal => $v:expr),+ $(,)?], |$s:ident, $words:ident| $err:expr) => {
        impl std::str::FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                $crate::cluster::parse_word(s, &[$(($w, $v)),+], |$s, $words| $err)
            }
        }
    };
}

/// `s` as one of the words of `table`, or the error `err(s, words)` where `words` lists the
/// table's words as in "a, b or c".
pub fn parse_word<T: Copy>(
    s: &str,
    table: &[(&str, T)],
    err: impl FnOnce(&str, &str) -> String,
) -> Result<T, String> {
    if let Some(&(_, v)) = table.iter().find(|(w, _)| *w == s) {
        return Ok(v);
    }
    let words: Vec<&str> = table.iter().map(|(w, _)| *w).collect();
    let words = match words.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => words.concat(),
    };
    Err(err(s, &words))
}

/// One SP of the cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpEntry {
    pub id: SpId,
    pub node: u32,
    /// Index of this SP among its node's SPs.
    pub index: u32,
    /// TCP address other SPs connect to.
    pub peer_addr: SocketAddr,
    /// Unix socket host ranks of this node connect to (hosts on the SP's own kernel).
    pub host_socket: PathBuf,
    /// TCP address host ranks of this node connect to over the host-DPU network (real
    /// clusters); when absent, hosts use `host_socket`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_addr: Option<SocketAddr>,
}

impl SpEntry {
    /// SP `id` of a cluster of `sps_per_node` SPs per node, numbered as a description numbers
    /// them (SP `k` of node `n` has id `n * sps_per_node + k`); without a host TCP address.
    pub fn numbered(
        id: SpId,
        sps_per_node: u32,
        peer_addr: SocketAddr,
        host_socket: PathBuf,
    ) -> Self {
        SpEntry {
            id,
            node: id / sps_per_node,
            index: id % sps_per_node,
            peer_addr,
            host_socket,
            host_addr: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cluster {
    pub nodes: u32,
    pub sps_per_node: u32,
    /// Emulation only: ranks per node of the layout; when absent, `ceil(world size / nodes)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks_per_node: Option<u32>,
    /// Emulation only: how `launch` spreads world ranks over emulated nodes (absent: block).
    #[serde(default = "block")]
    pub layout: Layout,
    /// Indexed by SP id: `sps[i].id == i`, SP `k` of node `n` has id `n * sps_per_node + k`.
    pub sps: Vec<SpEntry>,
    /// Host name of each node, indexed by node (what `MPI_Get_processor_name` says on the
    /// node's host). Empty for an emulated cluster on one machine.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    /// Host name of each node's DPU, indexed by node (what `hostname` says on the DPU, where
    /// `serve --sp-id auto` runs). Optional.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dpus: Vec<String>,
    /// The ports UCX's TCP transport listens on, in the ranks and in the SPs
    /// (`UCX_TCP_PORT_RANGE`, set by both before UCX starts unless the environment sets it):
    /// what a firewall opens for the `ucx` grants over TCP. Absent: ports the kernel picks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ucx_tcp_port_range: Option<PortRange>,
    /// The multicast fabric of the multicast collectives: the group addresses (`A.B.C.D/N`,
    /// an address per communicator slot and subgroup) and the first UDP port (a port per
    /// slot, 256 of them). Absent: 239.255.0.0/16 (administratively scoped) from port 47000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcast_groups: Option<McastGroups>,
    /// The Canary fabric of the in-network allreduce (`SPOFF_ALLREDUCE_DESIGN=canary`): each
    /// SP's link to its leaf switch. Absent: the cluster has no aggregating switches (the
    /// allreduce's `auto` design is then the SP tree).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<CanaryFabric>,
}

/// The SPs' links to the Canary switches (`Cluster::canary`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CanaryFabric {
    /// One per SP that has a link, any order; an SP without one runs no Canary allreduce
    /// (its jobs then take the SP tree).
    pub links: Vec<CanaryLink>,
    /// How the SPs run the Canary machines (defaults when absent).
    #[serde(default)]
    pub params: CanaryParams,
}

/// The SPs' Canary settings, the same for every SP of a cluster (`algorithms::canary::host`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CanaryParams {
    /// Bytes per packet (whole elements; at most 8192). The paper's 1 KiB fits a 1500-byte
    /// link MTU. Larger blocks are much faster through software switches (they pay per
    /// datagram and wait an aggregation window per block: a 1 MiB allreduce 3.5x faster with
    /// 8 KiB on a loopback tree, which `launch` therefore uses), but on 1500-byte links the
    /// kernel fragments them, and through a shaped (200 Mbit/s) link the loss of fragments
    /// made a static tree's allreduces fail (docs/BENCHMARKS.md, section S): raise it only
    /// where the links' MTU carries a block whole.
    pub block_bytes: u32,
    /// Blocks each SP has in flight per chunk (up to 4 chunks run at once). With the sockets'
    /// receive buffers at 4 MiB (`switch --rcvbuf-kib`, the SPs' planes) 16 to 32 of 8 KiB
    /// blocks run without loss on loopback; with the kernel's default buffers a window past 8
    /// overflowed them and retransmissions (after `retx_timeout_us`) dominated.
    pub window: u32,
    /// A block not answered in this time is asked for again from its leader.
    pub retx_timeout_us: u64,
    /// Unanswered requests before the allreduce fails (`NetworkFailed`): with
    /// `retx_timeout_us` and `retx_backoff`, the bound on a dead fabric.
    pub max_requests: u32,
    /// After the k-th unanswered request an SP waits `retx_timeout_us << min(k, retx_backoff)`
    /// before the next (at most 6), for links whose queues hold answers longer than
    /// `retx_timeout_us`; a dead fabric then fails a chunk later (with 3 and the other
    /// defaults: 30 + 60 + 120 + 6 x 240 ms = 1.65 s). 0, the default: a constant timeout
    /// (the first wait and 8 requests: 9 x 30 ms = 270 ms), the paper's; in the namespace tree's runs a shaped link loaded
    /// 10 x over its rate failed no allreduce with either (docs/BENCHMARKS.md, section S).
    pub retx_backoff: u32,
    /// A block's leader gives it up after this many attempts. Its restarts back off (doubling
    /// up to 64 x 20 ms) while a member is late, so the default, 1000, waits for a member
    /// about 21 minutes late before the allreduce fails (`NetworkFailed`).
    pub max_attempts: u16,
    /// How long an SP keeps an ended chunk to answer late members' requests.
    pub linger_ms: u64,
    /// The paper's baseline instead of Canary: K static trees installed in the switches
    /// (`canary-tree --static-trees K`), block b on tree b mod K. Only for allreduces that
    /// span every SP of the fabric (the switches' rules count every member).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub static_trees: Option<u8>,
}

impl Default for CanaryParams {
    fn default() -> Self {
        CanaryParams {
            block_bytes: 1024,
            window: 8,
            retx_timeout_us: 30_000,
            max_requests: 8,
            retx_backoff: 0,
            max_attempts: 1000,
            linger_ms: 10_000,
            static_trees: None,
        }
    }
}

/// One SP's link to its leaf switch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CanaryLink {
    pub sp: SpId,
    /// The SP's Canary address (what the switches route by; unique in the fabric).
    pub addr: u32,
    /// The SP's UDP socket on the link.
    pub local: SocketAddr,
    /// The leaf switch's port at the other end.
    pub leaf: SocketAddr,
    /// Emulation on one machine: the network namespace (`/run/netns/NAME`) the link is in,
    /// where the SP opens its socket while it runs outside (`launch --canary-netns`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
}

impl CanaryFabric {
    /// SP `sp`'s link, if it has one.
    pub fn link(&self, sp: SpId) -> Option<&CanaryLink> {
        self.links.iter().find(|l| l.sp == sp)
    }
}

/// Where the multicast collectives' groups live (`Cluster::mcast_groups`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct McastGroups {
    /// `A.B.C.D/N`: a multicast range (224.0.0.0/4).
    pub range: McastRange,
    pub port_base: u16,
}

/// A range of IPv4 multicast addresses, written `A.B.C.D/N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct McastRange {
    pub base: std::net::Ipv4Addr,
    pub prefix: u8,
}

impl std::fmt::Display for McastRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.base, self.prefix)
    }
}

impl std::str::FromStr for McastRange {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not a multicast range (A.B.C.D/N, e.g. 239.255.0.0/16)");
        let (a, n) = s.split_once('/').ok_or_else(bad)?;
        let base: std::net::Ipv4Addr = a.trim().parse().map_err(|_| bad())?;
        let prefix: u8 = n.trim().parse().map_err(|_| bad())?;
        if !(4..=30).contains(&prefix) {
            return Err(format!("{s:?}: the prefix must be 4 to 30 bits"));
        }
        if !base.is_multicast() {
            return Err(format!("{s:?} is not in the multicast range 224.0.0.0/4"));
        }
        Ok(McastRange { base, prefix })
    }
}

impl TryFrom<String> for McastRange {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<McastRange> for String {
    fn from(r: McastRange) -> String {
        r.to_string()
    }
}

/// An inclusive range of TCP ports, written `FIRST-LAST` (UCX's own syntax).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }
}

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl std::str::FromStr for PortRange {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not a port range (FIRST-LAST, e.g. 40000-40999)");
        let (a, b) = s.split_once('-').ok_or_else(bad)?;
        let (first, last): (u16, u16) = (
            a.trim().parse().map_err(|_| bad())?,
            b.trim().parse().map_err(|_| bad())?,
        );
        if first == 0 {
            return Err(format!("{s:?} starts at port 0"));
        }
        if first > last {
            return Err(format!("{s:?} has its first port above the last"));
        }
        Ok(PortRange { first, last })
    }
}

impl TryFrom<String> for PortRange {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<PortRange> for String {
    fn from(r: PortRange) -> String {
        r.to_string()
    }
}

fn block() -> Layout {
    Layout::Block
}

/// Where a world rank lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub node: u32,
    pub local_rank: u32,
    pub sp: SpId,
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cannot read cluster description {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cluster description {path} is not valid: {field}{source}")]
    Parse {
        path: PathBuf,
        /// The field the error is about (`sps[2].peer_addr: `), or empty.
        field: String,
        source: serde_json::Error,
    },
    #[error("invalid cluster description: {0}")]
    Invalid(String),
}

impl Cluster {
    /// Builds and validates a description.
    pub fn new(
        nodes: u32,
        sps_per_node: u32,
        ranks_per_node: Option<u32>,
        layout: Layout,
        sps: Vec<SpEntry>,
    ) -> Result<Self, ClusterError> {
        let c = Cluster {
            nodes,
            sps_per_node,
            ranks_per_node,
            layout,
            sps,
            hosts: Vec::new(),
            dpus: Vec::new(),
            ucx_tcp_port_range: None,
            mcast_groups: None,
            canary: None,
        };
        c.validate()?;
        Ok(c)
    }

    pub fn load(path: &Path) -> Result<Self, ClusterError> {
        let text = std::fs::read_to_string(path).map_err(|source| ClusterError::Io {
            path: path.into(),
            source,
        })?;
        let de = &mut serde_json::Deserializer::from_str(&text);
        let c: Cluster = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            ClusterError::Parse {
                path: path.into(),
                field: if field == "." {
                    String::new()
                } else {
                    format!("{field}: ")
                },
                source: e.into_inner(),
            }
        })?;
        c.validate()?;
        Ok(c)
    }

    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).expect("a cluster always serialises");
        std::fs::write(path, text)
    }

    pub fn validate(&self) -> Result<(), ClusterError> {
        let bad = |m: String| Err(ClusterError::Invalid(m));
        if self.nodes == 0 || self.sps_per_node == 0 {
            return bad("nodes and sps_per_node must be at least 1".into());
        }
        if self.ranks_per_node == Some(0) {
            return bad("ranks_per_node must be at least 1".into());
        }
        let want = self.nodes as u64 * self.sps_per_node as u64;
        if self.sps.len() as u64 != want {
            return bad(format!(
                "{} SP entries for {} nodes x {} SPs per node",
                self.sps.len(),
                self.nodes,
                self.sps_per_node
            ));
        }
        for (i, sp) in self.sps.iter().enumerate() {
            let expect = (sp.node * self.sps_per_node + sp.index) as usize;
            if sp.id as usize != i || expect != i || sp.index >= self.sps_per_node {
                return bad(format!(
                    "SP entry {i} has id {} node {} index {}: expected id {i} = node * {} + index",
                    sp.id, sp.node, sp.index, self.sps_per_node
                ));
            }
        }
        for (list, what) in [(&self.hosts, "host"), (&self.dpus, "DPU")] {
            if list.is_empty() {
                continue;
            }
            if list.len() as u64 != self.nodes as u64 {
                return bad(format!(
                    "{} {what} names for {} nodes",
                    list.len(),
                    self.nodes
                ));
            }
            for (n, h) in list.iter().enumerate() {
                if h.is_empty() || h.chars().any(char::is_whitespace) {
                    return bad(format!("node {n} has {what} name {h:?}"));
                }
                if let Some(m) = list[..n].iter().position(|o| o == h) {
                    return bad(format!("nodes {m} and {n} have the same {what} name {h:?}"));
                }
            }
        }
        if let Some(d) = self.dpus.iter().find(|d| self.hosts.contains(d)) {
            return bad(format!("{d:?} is both a host name and a DPU name"));
        }
        if let Some(f) = &self.canary {
            let p = f.params;
            if !(8..=8192).contains(&p.block_bytes)
                || p.window == 0
                || p.retx_timeout_us == 0
                || p.max_requests == 0
                || p.max_attempts == 0
                || p.static_trees == Some(0)
                || p.retx_backoff > 6
            {
                return bad(format!(
                    "canary params {p:?}: block_bytes from 8 to 8192, retx_backoff at most 6, \
                     the rest at least 1"
                ));
            }
            for (i, l) in f.links.iter().enumerate() {
                if l.sp as u64 >= want {
                    return bad(format!("canary link {i} names SP {}, of {want}", l.sp));
                }
                if let Some(o) = f.links[..i]
                    .iter()
                    .find(|o| o.sp == l.sp || o.addr == l.addr || o.local == l.local)
                {
                    return bad(format!(
                        "canary links of SPs {} and {} share an SP, an address or a socket",
                        o.sp, l.sp
                    ));
                }
            }
        }
        Ok(())
    }

    pub fn sp(&self, id: SpId) -> Option<&SpEntry> {
        self.sps.get(id as usize)
    }

    pub fn sp_id(&self, node: u32, index: u32) -> SpId {
        node * self.sps_per_node + index
    }

    /// Ranks per node for a job of `world_size` ranks.
    pub fn ranks_per_node_for(&self, world_size: u32) -> u32 {
        self.ranks_per_node
            .unwrap_or_else(|| world_size.div_ceil(self.nodes))
            .max(1)
    }

    /// Where the emulation layout (`layout`, `ranks_per_node`) puts `world_rank` of a job of
    /// `world_size` ranks: what `launch` tells each rank, and the node of a rank that got no
    /// hint from a description without host names. Real placement is
    /// [`crate::placement::place_ranks`].
    pub fn placement(&self, world_rank: u32, world_size: u32) -> Result<Placement, ClusterError> {
        if world_rank >= world_size {
            return Err(ClusterError::Invalid(format!(
                "rank {world_rank} out of range for {world_size} ranks"
            )));
        }
        let r = self.ranks_per_node_for(world_size);
        let (node, local_rank) = match self.layout {
            Layout::Block => (world_rank / r, world_rank % r),
            Layout::Cyclic => (world_rank % self.nodes, world_rank / self.nodes),
        };
        if node >= self.nodes {
            return Err(ClusterError::Invalid(format!(
                "rank {world_rank} of {world_size} falls on node {node}, but the cluster has {} \
                 nodes of {r} ranks",
                self.nodes
            )));
        }
        let sp = self.sp_id(node, local_rank % self.sps_per_node);
        Ok(Placement {
            node,
            local_rank,
            sp,
        })
    }

    /// A fingerprint of the description; SPs refuse peers that were given a different one.
    pub fn fingerprint(&self) -> u64 {
        // FNV-1a over the canonical JSON: stable across processes and builds.
        let text = serde_json::to_string(self).expect("a cluster always serialises");
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in text.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(nodes: u32, k: u32, layout: Layout) -> Cluster {
        crate::testing::cluster(nodes, k, layout, &[])
    }

    #[test]
    fn canary_params_out_of_range_are_refused() {
        let mut c = cluster(2, 1, Layout::Block);
        c.canary = Some(CanaryFabric {
            links: vec![],
            params: CanaryParams::default(),
        });
        assert!(c.validate().is_ok());
        let with = |f: &dyn Fn(&mut CanaryParams)| {
            let mut c = c.clone();
            f(&mut c.canary.as_mut().unwrap().params);
            c.validate()
        };
        assert!(with(&|p| p.retx_backoff = 6).is_ok());
        assert!(with(&|p| p.retx_backoff = 0).is_ok());
        for bad in [
            &(|p: &mut CanaryParams| p.retx_backoff = 7) as &dyn Fn(&mut CanaryParams),
            &|p| p.block_bytes = 8200,
            &|p| p.window = 0,
            &|p| p.max_requests = 0,
        ] {
            let e = with(bad).unwrap_err().to_string();
            assert!(e.contains("canary params"), "{e}");
        }
    }

    #[test]
    fn block_and_cyclic_placement() {
        let b = cluster(2, 2, Layout::Block);
        let p: Vec<_> = (0..4).map(|r| b.placement(r, 4).unwrap()).collect();
        assert_eq!(p.iter().map(|p| p.node).collect::<Vec<_>>(), [0, 0, 1, 1]);
        assert_eq!(p.iter().map(|p| p.sp).collect::<Vec<_>>(), [0, 1, 2, 3]);
        let c = cluster(2, 1, Layout::Cyclic);
        let p: Vec<_> = (0..4).map(|r| c.placement(r, 4).unwrap()).collect();
        assert_eq!(p.iter().map(|p| p.node).collect::<Vec<_>>(), [0, 1, 0, 1]);
        assert_eq!(
            p.iter().map(|p| p.local_rank).collect::<Vec<_>>(),
            [0, 0, 1, 1]
        );
        assert_eq!(p.iter().map(|p| p.sp).collect::<Vec<_>>(), [0, 1, 0, 1]);
    }

    #[test]
    fn every_sp_serves_the_ranks_of_its_node() {
        for layout in [Layout::Block, Layout::Cyclic] {
            let c = cluster(4, 3, layout);
            for size in [1u32, 5, 12, 13, 40] {
                for r in 0..size {
                    match c.placement(r, size) {
                        Ok(p) => assert_eq!(c.sp(p.sp).unwrap().node, p.node),
                        Err(e) => assert!(layout == Layout::Block && size == 13, "{e}"),
                    }
                }
            }
        }
    }

    #[test]
    fn invalid_descriptions_are_refused() {
        let mut c = cluster(2, 2, Layout::Block);
        c.sps.pop();
        assert!(c.validate().is_err());
        let mut c = cluster(2, 2, Layout::Block);
        c.sps[1].index = 0;
        assert!(c.validate().is_err());
        assert!(cluster(1, 1, Layout::Block).placement(3, 2).is_err());
    }

    /// `c` is refused with an error that says `why`.
    fn invalid_because(c: &Cluster, why: &str) {
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains(why), "{e}");
    }

    #[test]
    fn host_names_are_one_per_node_and_distinct() {
        let mut c = cluster(2, 1, Layout::Block);
        c.hosts = vec!["n1".into(), "n2".into()];
        c.validate().unwrap();
        c.hosts = vec!["n1".into()];
        invalid_because(&c, "1 host names for 2 nodes");
        c.hosts = vec!["n1".into(), "n1".into()];
        invalid_because(&c, "same host name");
        c.hosts = vec!["n1".into(), "".into()];
        assert!(c.validate().is_err());
        c.hosts = vec!["n1".into(), "n2".into()];
        c.dpus = vec!["n1-dpu".into(), "n2-dpu".into()];
        c.validate().unwrap();
        c.dpus = vec!["n1-dpu".into(), "n1-dpu".into()];
        invalid_because(&c, "same DPU name");
        c.dpus = vec!["n2".into(), "n1-dpu".into()];
        invalid_because(&c, "both a host name and a DPU");
        c.dpus.clear();
        // Absent fields read as none: descriptions written before them still load.
        let mut v = serde_json::to_value(cluster(1, 1, Layout::Block)).unwrap();
        assert!(v.get("hosts").is_none() && v["sps"][0].get("host_addr").is_none());
        v["hosts"] = serde_json::json!(["a"]);
        v["sps"][0]["host_addr"] = serde_json::json!("10.0.0.1:7000");
        let d: Cluster = serde_json::from_value(v).unwrap();
        d.validate().unwrap();
        assert_eq!(d.sps[0].host_addr, Some("10.0.0.1:7000".parse().unwrap()));
    }

    #[test]
    fn roundtrip_and_fingerprint() {
        let c = cluster(2, 2, Layout::Cyclic);
        let dir = std::env::temp_dir().join(format!("cluster-test-{}", std::process::id()));
        c.save(&dir).unwrap();
        let d = Cluster::load(&dir).unwrap();
        std::fs::remove_file(&dir).ok();
        assert_eq!(c, d);
        assert_eq!(c.fingerprint(), d.fingerprint());
        assert_ne!(c.fingerprint(), cluster(2, 1, Layout::Cyclic).fingerprint());
    }
}
