//! Deterministic simulation of the multicast [`McastAllgather`] on the
//! world communicator, over the model of the multicast fabric the
//! multicast bcast's simulator uses.
//!
//! Shares placement, cost model, generator, the event driver and the
//! fabric (`Core::multicast`, [`NetFaults`](super::NetFaults)) with the
//! other simulators: an SP's send worker puts each datagram of its ranks'
//! blocks on the wire at the link's rate; each other SP gets it after the
//! latency, unless it is lost, maybe twice, maybe reordered; it waits in
//! the SP's finite receive staging (full: a receiver-not-ready drop) until
//! the SP's receive worker drains it and lands it in every receive buffer
//! the instance registered (real bytes), and the instance hears of it
//! (`handle_landed`). Copies (local blocks into the local receive buffers,
//! the fetch ring's RDMA reads of the left neighbour's receive buffer) go
//! through the SP's [`CopyLimiter`](crate::sched::CopyLimiter), read their
//! source when they start and write it when they finish; a read from a
//! crashed SP's buffer fails, and one across a partition waits for it to
//! heal (as SP-to-SP messages do).
//!
//! Checkers (all outside the algorithm):
//! * every rank that completes `Ok` holds the concatenation of every
//!   rank's block, in rank order, byte for byte; send buffers are never
//!   written; bytes past a receive buffer's posted length are never
//!   touched; with inconsistent posts (a length off by one) no rank
//!   completes `Ok`; a collective no fault touched completes `Ok`
//!   everywhere;
//! * each posted rank completes exactly once, by its own SP, never `Ok`
//!   after its SP learned of a fault touching the collective;
//! * no buffer is read or written after its rank completed: no copy starts
//!   or finishes on it, no multicast reads it, no datagram lands in it, and
//!   a rank completes only once nothing touching its buffers is in flight
//!   and its SP no longer lands chunks (so a neighbour's fetch cannot read a
//!   released buffer: the final handshake's purpose);
//! * shape: each SP multicasts only its own ranks' blocks out of their send
//!   buffers, each (block, subgroup run) once, only after every other SP of
//!   the ring registered (the RNR barrier) and, unless it heads its chain,
//!   after its chain predecessor's multicasts were all done (the
//!   sequencer; chains computed here independently); receive buffers are
//!   registered by their own SP; local copies move a local block whole to
//!   its place; fetches read only the receive buffer of the SP's left
//!   neighbour (computed here independently), whole chunks, into the same
//!   place of the SP's own ranks' receive buffers (or, fanning a fetched
//!   run out, another local rank's receive buffer);
//! * the run ends within the event/time bound, every posted rank of a live
//!   SP completes, every instance of a live SP that saw a post is finished;
//! * fault-free: every block multicast exactly once, `P * n * (K - 1)`
//!   datagrams on the wire (K SPs, `n` chunks per block).
//!
//! Traffic ([`Traffic`]): payload multicast per rank's block, and per node
//! the bytes it injects into the fabric and receives from it (wire bytes:
//! datagrams with their headers, counted once per datagram on the sender
//! and once per receiving node, as a switch replicates them; fetch reads
//! across nodes; SP-to-SP messages across nodes). [`paper_model`] is the
//! paper's model of the same (§II, Fig. 2, Appendix B).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::driver::{self, Core, FabricCounts};
use super::rng::splitmix64;
use super::shared::{draw_len, world_key, Instance, SimKey};
use super::{sentinel, Common, Outcome, SimFailure};
use crate::mcast_allgather::{
    subgroup_runs, Action, Config, Copy, McastAllgather, Msg, MsgError, Multicast, Post, Stats,
};
use crate::{CollKey, Nanos, Rank, SpId, Status};

mod checks;
mod events;
#[cfg(test)]
mod tests;

/// Untouched bytes after the receive buffer.
const PAD: usize = 3;

super::config::sim_faults!(
    /// Probability (parts per million) that a copy or a multicast fails
    /// with `AccessError`.
    pub copy_error_ppm: u32,
    /// The fabric's and the SP-to-SP channel's faults.
    pub net: super::NetFaults,
    /// The first SP that answers a fetch request crashes right after its
    /// first `FetchAck` left (an SP crash during the fetch phase).
    pub crash_fetch_server: bool,
    /// (collective, rank) posts made inconsistent on purpose: a block
    /// length off by one.
    pub inconsistent_posts: u32,
);

/// Everything a run depends on.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimConfig {
    #[serde(flatten)]
    pub common: Common,
    pub mtu: u64,
    pub subgroups: u16,
    /// Broadcast chains (0: the algorithm's default).
    pub chains: u32,
    /// The cutoff timer's `alpha` and `B_link` (bytes per ns).
    pub alpha_ns: Nanos,
    pub link_bytes_per_ns: u64,
    /// Block length of every collective; `None`: per collective 0 or 1
    /// (10% each), a multiple of `mtu` (15%), else uniform in
    /// `0..=max_len_bytes`.
    pub len_bytes: Option<u64>,
    pub max_len_bytes: u64,
    /// Move and check real bytes (off: traffic-only runs at scales whose
    /// receive buffers would not fit in memory; every other check stays).
    pub check_bytes: bool,
    pub faults: Faults,
}

impl SimConfig {
    /// [`Common::staged`] (4 nodes x 8 ranks, 2 SPs per node, two
    /// collectives), 64-byte chunks over 3 subgroups, the default chains,
    /// blocks up to 300 bytes, `alpha` 150 us (the posts' skew and the late
    /// ranks), the inter-node bandwidth as `B_link`, bytes checked, no
    /// faults.
    pub fn new(seed: u64) -> SimConfig {
        let common = Common::staged(seed);
        SimConfig {
            mtu: 64,
            subgroups: 3,
            chains: 0,
            alpha_ns: 150_000,
            link_bytes_per_ns: common.cost.inter_node_bytes_per_ns,
            len_bytes: None,
            max_len_bytes: 300,
            check_bytes: true,
            faults: Faults::default(),
            common,
        }
    }
}

impl SimConfig {
    /// The paper's setting for the traffic figures: `nodes` participants,
    /// one rank and one SP per node (a node is a participant), `block`
    /// bytes per rank in 4 KiB chunks (the IB UD MTU) over 4 subgroups,
    /// one collective, no faults; bytes checked if `check_bytes` (off for
    /// scales whose receive buffers do not fit in memory).
    pub fn traffic(seed: u64, nodes: u32, block: u64, check_bytes: bool) -> SimConfig {
        let mut c = SimConfig::new(seed);
        c.common = Common::new(seed);
        c.nodes = nodes;
        c.ranks_per_node = 1;
        c.sps_per_node = 1;
        c.mtu = 4_096;
        c.subgroups = 4;
        c.len_bytes = Some(block);
        c.check_bytes = check_bytes;
        c
    }
}

/// What crossed the fabric (wire bytes; see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Traffic {
    /// Payload multicast out of each rank's block (world rank order).
    pub mcast_payload_per_rank: Vec<u64>,
    /// Fetch bytes read out of each rank's receive buffer by another SP.
    pub fetched_from_rank: Vec<u64>,
    /// Per node: bytes it put into the fabric / got out of it.
    pub injected_per_node: Vec<u64>,
    pub received_per_node: Vec<u64>,
    /// Of those: SP-to-SP messages across nodes (both directions counted
    /// once, at the sender).
    pub control_bytes: u64,
}

impl Traffic {
    /// Bytes injected plus received, over every node.
    pub fn fabric_total(&self) -> u64 {
        self.injected_per_node.iter().sum::<u64>() + self.received_per_node.iter().sum::<u64>()
    }
}

/// The paper's model of fabric traffic (§II, Fig. 2, Appendix B, eq. 2)
/// for `p` participants (nodes) with `n` bytes each: `(multicast, ring)`
/// bytes injected plus received over all nodes. Multicast: each node
/// injects its `n` once and receives `(p - 1) * n`; ring: each sends and
/// receives `(p - 1) * n`. Their ratio, the traffic cut, is `2 - 2/p`.
pub fn paper_model(p: u64, n: u64) -> (u64, u64) {
    let mc = p * (n + (p - 1) * n);
    let ring = p * 2 * (p - 1) * n;
    (mc, ring)
}

/// Outcome of a successful run.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimReport {
    #[serde(flatten)]
    pub outcome: Outcome,
    /// Latest completion.
    pub end_ns: Nanos,
    /// What the fabric did.
    pub fabric: FabricCounts,
    /// Datagrams drained at an SP that had not registered (yet, or any
    /// more): dropped.
    pub unregistered_drops: u64,
    /// Copies done (local copies and fetches) and their bytes.
    pub copies: u64,
    pub bytes_copied: u64,
    pub traffic: Traffic,
    /// Instance counters summed.
    pub stats: Stats,
}

super::config::sim_config! {
    config: [mtu, subgroups, chains, alpha_ns, link_bytes_per_ns, len_bytes, max_len_bytes, check_bytes], [], [];
    report: [end_ns], [fabric, unregistered_drops], [copies, bytes_copied], [traffic, stats];
}
super::config::world_schedule!();

/// A rank's completion as recorded.
#[derive(Clone, Copy, Debug)]
pub(super) struct Done {
    pub(super) at: Nanos,
    pub(super) status: Status,
}

pub(super) struct Op {
    pub(super) key: CollKey,
    pub(super) len: u64,
    pub(super) n: u64,
    /// The ring the simulator expects (computed here), and each SP's
    /// chain predecessor.
    pub(super) ring: Vec<SpId>,
    pub(super) chain_prev: BTreeMap<SpId, Option<SpId>>,
    /// What each rank posted as its block length (differs from `len` for
    /// inconsistent posts).
    pub(super) post_len: Vec<u64>,
    pub(super) inconsistent: bool,
    /// Send buffers (`post_len` bytes) and receive buffers (`P * post_len
    /// + PAD`); empty without `check_bytes`.
    pub(super) send: Vec<Vec<u8>>,
    pub(super) recv: Vec<Vec<u8>>,
    pub(super) post_ns: Vec<Option<Nanos>>,
    pub(super) done: Vec<Option<Done>>,
    pub(super) disturbed: bool,
    /// SPs that learned of a fault touching this collective.
    pub(super) notified: BTreeSet<SpId>,
    /// Active registrations: the ranks whose buffers chunks land in; and
    /// every SP that ever registered.
    pub(super) registered: BTreeMap<SpId, Vec<Rank>>,
    pub(super) ever_registered: BTreeSet<SpId>,
    /// Per rank: copies and multicasts reading its send buffer, reading
    /// its receive buffer, writing its receive buffer.
    pub(super) reads_send: Vec<u32>,
    pub(super) reads_recv: Vec<u32>,
    pub(super) writes: Vec<u32>,
    /// (block, subgroup) runs multicast (at most once each).
    pub(super) runs_sent: BTreeSet<(Rank, u16)>,
    /// Per SP: multicasts in flight, and whether all it emitted are done.
    pub(super) mcasts_in_flight: BTreeMap<SpId, u32>,
    pub(super) datagrams: u64,
}

/// A copy or a multicast in the driver's hands.
#[derive(Clone, Debug)]
pub(super) enum Work {
    Copy(Copy<SimKey>),
    Mcast(Multicast<SimKey>),
}

pub(super) type Env = (usize, Msg<SimKey>);
pub(super) type Input = driver::Input<Env, Work>;

pub(super) struct Sim<'a> {
    pub(super) cfg: &'a SimConfig,
    pub(super) core: Core<Env, Work>,
    pub(super) ops: Vec<Op>,
    pub(super) inst: BTreeMap<(SpId, usize), McastAllgather<SimKey>>,
    pub(super) member_sps: BTreeSet<SpId>,
    /// Per SP: its ranks, ascending.
    pub(super) local: BTreeMap<SpId, Vec<Rank>>,
    /// Per (SP, op): the timer scheduled last.
    pub(super) timers: BTreeMap<(SpId, usize), Nanos>,
    /// Per (op, SP, copy id): the source and destination buffers of a copy
    /// emitted and not finished (void when its SP crashes).
    pub(super) pending: BTreeMap<(usize, SpId, u64), (SimKey, SimKey)>,
    /// Per (op, SP, copy id): what a copy read when it started.
    pub(super) read_at_start: BTreeMap<(usize, SpId, u64), Vec<u8>>,
    pub(super) crashed_fetch_server: bool,
    pub(super) unregistered_drops: u64,
    pub(super) copies: u64,
    pub(super) bytes_copied: u64,
    pub(super) traffic: Traffic,
}

/// The chains the simulator expects, computed independently of the
/// algorithm: `m` (0: `round(sqrt(k))`; at most `k`) contiguous runs of
/// the ring, run `c` the positions `[c*k/m, (c+1)*k/m)`. Returns each SP's
/// predecessor in its chain.
pub(super) fn expected_chains(ring: &[SpId], chains: u32) -> BTreeMap<SpId, Option<SpId>> {
    let k = ring.len();
    let m = if chains == 0 {
        ((k as f64).sqrt().round() as usize).max(1)
    } else {
        chains as usize
    }
    .min(k);
    let mut prev = BTreeMap::new();
    for c in 0..m {
        let (a, e) = (c * k / m, (c + 1) * k / m);
        for i in a..e {
            prev.insert(ring[i], (i > a).then(|| ring[i - 1]));
        }
    }
    prev
}

impl<'a> Sim<'a> {
    pub(super) fn new(cfg: &'a SimConfig) -> Result<Sim<'a>, SimFailure> {
        let (mut core, mut setup) = cfg.core()?;
        core.set_net(cfg.faults.net);
        let w = cfg.world_size();
        let p = w as usize;
        let mtu = cfg.mtu.max(1);
        let mut local: BTreeMap<SpId, Vec<Rank>> = BTreeMap::new();
        for r in 0..w {
            local.entry(core.rank_sp[r as usize]).or_default().push(r);
        }
        let ring: Vec<SpId> = local.keys().copied().collect();
        let chain_prev = expected_chains(&ring, cfg.chains);
        let mut ops = Vec::new();
        for i in 0..cfg.ops as usize {
            let len = draw_len(&mut setup, cfg.len_bytes, mtu, 4, cfg.max_len_bytes);
            ops.push(Op {
                key: world_key(i),
                len,
                n: len.div_ceil(mtu).max(1),
                ring: ring.clone(),
                chain_prev: chain_prev.clone(),
                post_len: vec![len; p],
                inconsistent: false,
                send: Vec::new(),
                recv: Vec::new(),
                post_ns: vec![None; p],
                done: vec![None; p],
                disturbed: false,
                notified: BTreeSet::new(),
                registered: BTreeMap::new(),
                ever_registered: BTreeSet::new(),
                reads_send: vec![0; p],
                reads_recv: vec![0; p],
                writes: vec![0; p],
                runs_sent: BTreeSet::new(),
                mcasts_in_flight: BTreeMap::new(),
                datagrams: 0,
            });
        }
        // Inconsistent posts need two ranks to disagree.
        if w > 1 && !ops.is_empty() {
            for _ in 0..cfg.faults.inconsistent_posts {
                let i = setup.below(ops.len() as u64) as usize;
                let o = &mut ops[i];
                let r = setup.below(w as u64) as usize;
                let l = o.len;
                o.post_len[r] = if l > 0 && setup.chance(1, 2) {
                    l - 1
                } else {
                    l + 1
                };
                o.inconsistent = true;
                o.disturbed = true;
            }
        }
        if cfg.check_bytes {
            for (i, o) in ops.iter_mut().enumerate() {
                let base = splitmix64(cfg.seed ^ splitmix64(i as u64 + 1));
                o.send = (0..p)
                    .map(|r| {
                        (0..o.post_len[r])
                            .map(|b| splitmix64(base ^ ((r as u64) << 40) ^ b) as u8)
                            .collect()
                    })
                    .collect();
                o.recv = (0..p)
                    .map(|r| {
                        (0..p * o.post_len[r] as usize + PAD)
                            .map(sentinel)
                            .collect()
                    })
                    .collect();
            }
        }
        let nodes = cfg.nodes as usize;
        let mut sim = Sim {
            cfg,
            core,
            ops,
            inst: BTreeMap::new(),
            member_sps: local.keys().copied().collect(),
            local,
            timers: BTreeMap::new(),
            pending: BTreeMap::new(),
            read_at_start: BTreeMap::new(),
            crashed_fetch_server: false,
            unregistered_drops: 0,
            copies: 0,
            bytes_copied: 0,
            traffic: Traffic {
                mcast_payload_per_rank: vec![0; p],
                fetched_from_rank: vec![0; p],
                injected_per_node: vec![0; nodes],
                received_per_node: vec![0; nodes],
                control_bytes: 0,
            },
        };
        cfg.schedule_world(&mut sim.core, &mut setup);
        Ok(sim)
    }

    pub(super) fn fail(&self, what: impl Into<String>) -> SimFailure {
        self.core.fail(what)
    }

    pub(super) fn instance(&mut self, sp: SpId, op: usize) -> &mut McastAllgather<SimKey> {
        let key = self.ops[op].key;
        let c = self.cfg;
        let cfg = Config {
            me: sp,
            mtu: c.mtu,
            subgroups: c.subgroups,
            chains: c.chains,
            link_bytes_per_ns: c.link_bytes_per_ns,
            alpha_ns: c.alpha_ns,
        };
        self.inst
            .entry((sp, op))
            .or_insert_with(|| McastAllgather::new(key, cfg))
    }
}

impl<K: Clone + std::fmt::Debug + PartialEq> Instance for McastAllgather<K> {
    type Msg = Msg<K>;
    type Error = MsgError;
    fn handle_msg(&mut self, now: Nanos, from: SpId, msg: Msg<K>) -> Result<(), MsgError> {
        McastAllgather::handle_msg(self, now, from, msg)
    }
    fn describe(&self) -> String {
        format!(
            "abort={:?} in_flight={} has_all={} chain={:?} stats={:?}",
            self.abort_status(),
            self.copies_in_flight(),
            self.has_all(),
            self.chain_neighbours(),
            self.stats()
        )
    }
}

impl driver::Collective for Sim<'_> {
    type Msg = Env;
    type Copy = Work;

    fn core(&mut self) -> &mut Core<Env, Work> {
        &mut self.core
    }

    fn on_crash(&mut self, sp: SpId) {
        for o in self.ops.iter_mut() {
            o.disturbed = true;
        }
        // Its copies die with it: they neither finish nor touch a buffer
        // any more.
        let gone: Vec<(usize, SpId, u64)> =
            self.pending.keys().filter(|k| k.1 == sp).copied().collect();
        for k in gone {
            let (src, dst) = self.pending.remove(&k).unwrap();
            self.read_at_start.remove(&k);
            let o = &mut self.ops[k.0];
            if src.send {
                o.reads_send[src.rank as usize] -= 1;
            } else {
                o.reads_recv[src.rank as usize] -= 1;
            }
            o.writes[dst.rank as usize] -= 1;
        }
    }

    fn on_rank_death(&mut self, world: u32) {
        for o in self.ops.iter_mut() {
            if o.done[world as usize].is_none() {
                o.disturbed = true;
            }
        }
    }

    fn process(&mut self, sp: SpId, input: Input) -> Result<(), SimFailure> {
        self.process_input(sp, input)
    }

    fn on_datagram(&mut self, sp: SpId, op: usize, psn: u64) -> Result<(), SimFailure> {
        self.land(sp, op, psn)
    }

    fn over_budget(core: &Core<Env, Work>) -> SimFailure {
        core.fail("no termination within the event/time bound")
    }
}
