//! What a simulation is given (the network, the allreduces, the background, the faults) and
//! what it reports.

use crate::canary::host::{HostError, HostStats};
use crate::canary::switch::SwitchStats;
use crate::Nanos;

/// Which allreduce runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    Ring,
    StaticTrees(u8),
    Canary,
}

impl core::fmt::Display for Algo {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Algo::Ring => write!(f, "ring"),
            Algo::StaticTrees(1) => write!(f, "1 static tree"),
            Algo::StaticTrees(k) => write!(f, "{k} static trees"),
            Algo::Canary => write!(f, "canary"),
        }
    }
}

/// Faults injected into a run (part 7 of issue 27).
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Canary packets lost, per million arrivals at any node.
    pub drop_ppm: u32,
    /// Kill this spine (index) at this time.
    pub kill_spine: Option<(usize, Nanos)>,
    /// At this time a host outside the job injects forged packets (the job's ids, another
    /// tag): reduce packets to leaders and results to members.
    pub forge_at: Option<Nanos>,
}

/// Network and protocol parameters.
#[derive(Clone, Debug)]
pub struct NetConfig {
    pub leaves: usize,
    pub hosts_per_leaf: usize,
    pub spines: usize,
    pub gbps: u64,
    /// Per hop, on top of serialisation.
    pub latency: Nanos,
    /// Input buffer (credits) per link, bytes; also the occupancy reference.
    pub buffer: u64,
    /// Header and framing bytes per packet (the paper's 57).
    pub header: usize,
    /// Payload bytes per packet (256 four-byte elements in the paper's simulations).
    pub payload: usize,
    /// Canary's aggregation window.
    pub timeout: Nanos,
    pub hold: Nanos,
    pub slots: usize,
    /// Blocks a member keeps in flight (Canary's, and the static trees' unless `tree_window`).
    pub window: usize,
    /// The static trees' members' window, when it differs from `window`: their round trip
    /// has no aggregation windows in it, so fewer blocks cover its bandwidth-delay product.
    pub tree_window: Option<usize>,
    pub retx_timeout: Nanos,
    pub max_requests: u32,
    pub restart_holdoff: Nanos,
    pub max_attempts: u16,
    /// Background message size.
    pub bg_msg: usize,
    /// Background and ring packets choose their up-port adaptively (the paper's rule, the
    /// default); `false` keeps them on the default port while its link is up (a what-if:
    /// deterministic `dest mod k` routing for everything but Canary).
    pub unicast_adaptive: bool,
    /// The output buffer the up-port rule reads, bytes (SST merlin's `output_buf_size`):
    /// `Some(b)`: a port's occupancy is its queued bytes capped at `b` and the rule's
    /// threshold is half of `b`, so ports whose queues are all past `b` look equal and the
    /// default port wins the tie (merlin keeps the backlog beyond its output buffer in its
    /// input buffers, which the rule does not see). `None` (the default): the whole queue,
    /// against `buffer`.
    pub out_buf: Option<u64>,
    /// Input FIFOs with head-of-line blocking (SST merlin's routers): a switch takes the
    /// packets of each input link in order, and a unicast (background, ring) packet at the
    /// head of its input moves to its output queue only while that queue holds fewer bytes
    /// than the output buffer (`out_buf`, else `buffer`); until then it holds back everything
    /// behind it on that link, whatever their outputs. The switch machine's packets are taken
    /// when they reach the head, their outputs queued at once. `false` (the default): every
    /// packet is routed on arrival to its output queue (no head-of-line blocking).
    pub hol: bool,
    /// How background hosts pick each message's destination.
    pub bg_pattern: BgPattern,
    /// Simulated time after which the run is declared hung.
    pub max_time: Nanos,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            leaves: 32,
            hosts_per_leaf: 32,
            spines: 32,
            gbps: 100,
            latency: 300,
            buffer: 64 * 1024,
            header: 57,
            payload: 1024,
            timeout: 10_000,
            hold: 1_000_000,
            slots: 1 << 16,
            window: 512,
            tree_window: None,
            retx_timeout: 2_000_000,
            max_requests: 8,
            restart_holdoff: 1_000_000,
            max_attempts: 6,
            bg_msg: 64 * 1024,
            unicast_adaptive: true,
            out_buf: None,
            hol: false,
            bg_pattern: BgPattern::Permutation,
            max_time: 1_000_000_000,
        }
    }
}

/// The destinations of the background hosts' messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BgPattern {
    /// Message `k` of every background host goes by the `k`-th random permutation of them:
    /// each host sends to one and receives from one (the default).
    Permutation,
    /// Every message goes to a background host drawn uniformly at random (never the sender),
    /// independently of the others' choices, so some hosts receive from two or more at once
    /// (congestion at the receivers' links).
    Uniform,
}

impl NetConfig {
    pub fn hosts(&self) -> usize {
        self.leaves * self.hosts_per_leaf
    }
}

/// One allreduce: its members (host indices) and its vector length in bytes.
#[derive(Clone, Debug)]
pub struct Job {
    pub members: Vec<u32>,
    pub len: usize,
}

/// A whole run.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub net: NetConfig,
    pub algo: Algo,
    pub jobs: Vec<Job>,
    /// Hosts generating background traffic.
    pub background: Vec<u32>,
    pub faults: Faults,
    pub seed: u64,
}

/// The outcome of one allreduce.
#[derive(Clone, Debug, Default)]
pub struct JobReport {
    /// Time the last member finished (ok or failed).
    pub runtime: Nanos,
    pub ok_hosts: usize,
    pub failed: Vec<(u32, HostError)>,
    /// Members that never finished (only when the run hit `max_time`).
    pub unfinished: usize,
    /// Received blocks that differ from the reference (must be 0).
    pub wrong_blocks: u64,
    pub checked_bytes: u64,
    /// `len * 8 / runtime`, Gb/s.
    pub goodput_gbps: f64,
}

/// The outcome of a run.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub jobs: Vec<JobReport>,
    pub events: u64,
    pub end: Nanos,
    pub hung: bool,
    pub switches: SwitchStats,
    pub hosts: HostStats,
    pub dropped: u64,
    /// Bytes sent per link direction, summed (for a mean utilisation).
    pub link_bytes: u64,
    pub links: usize,
    /// [`NetConfig::hol`]: times a head of an input FIFO had to wait for room in its output,
    /// and of those, times the packet right behind it was held back though it could have
    /// moved (its output had room, or it was the switch machine's).
    pub hol_waits: u64,
    pub hol_held: u64,
}

impl Report {
    /// Every job finished with every block right, or with an error on every member; none
    /// wrong, none hung.
    pub fn sound(&self) -> bool {
        !self.hung
            && self
                .jobs
                .iter()
                .all(|j| j.wrong_blocks == 0 && j.unfinished == 0)
    }

    /// Every member of every job finished with the right result.
    pub fn all_ok(&self) -> bool {
        self.sound()
            && self
                .jobs
                .iter()
                .all(|j| j.failed.is_empty() && j.checked_bytes > 0)
    }
}
