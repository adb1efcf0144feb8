//! Deterministic simulation of the multicast [`McastBcast`] on the world
//! communicator, over a model of the multicast fabric.
//!
//! Shares placement, cost model, generator and the event driver with the
//! other simulators; the fabric is the driver's (`Core::multicast`,
//! [`NetFaults`](super::NetFaults)): the root's SP's send worker puts each
//! datagram on the wire at the link's rate; each receiving SP gets it after
//! the latency, unless it is lost, maybe twice, maybe reordered; it waits
//! in the SP's finite receive staging (full: a receiver-not-ready drop)
//! until the SP's receive worker drains it; the worker lands it in every
//! buffer the instance registered (real bytes) and the instance hears of it
//! (`handle_landed`) through the SP's inbox. Copies (the root's SP's
//! host-to-host copies, the fetch ring's RDMA reads of a neighbour's host
//! buffer) go through the SP's [`CopyLimiter`](crate::sched::CopyLimiter),
//! read their source when they start and write it when they finish; a copy
//! from a buffer whose SP crashed fails. The cutoff timers run on the
//! driver's clock (`poll_timeout`, `Input::Timer`). A partition of the
//! SP-to-SP channel holds messages (and remote reads) across the cut until
//! it heals: the channel is reliable (TCP), so a partition that heals only
//! delays; one that does not is an SP loss, which the crash faults cover.
//!
//! Checkers (all outside the algorithm):
//! * every rank that completes `Ok` holds the root's bytes exactly; with
//!   injected inconsistent posts, its post agrees with that of the rank it
//!   names as root, which names itself, and it holds that rank's bytes;
//!   bytes past a rank's posted length are never touched; the root's
//!   buffer is never written; a collective no fault touched completes `Ok`
//!   everywhere;
//! * each posted rank completes exactly once, by its own SP, never `Ok`
//!   after its SP learned of a fault touching the collective;
//! * no buffer is read or written after its rank completed: no copy starts
//!   or finishes on it, no multicast reads it, no datagram lands in it, and
//!   a rank completes only once no copy or multicast touching its buffer is
//!   in flight and its SP no longer lands chunks (so a neighbour's fetch
//!   cannot read a released buffer: the final handshake's purpose);
//! * shape: the root's SP multicasts the root's buffer, each subgroup run
//!   once; leaves register every local rank's buffer; local copies only at
//!   the root's SP out of the root's buffer; fetches read only a buffer of
//!   the SP's left neighbour in the ring (computed here independently),
//!   into the SP's own ranks, whole chunks;
//! * the run ends within the event/time bound, every posted rank of a live
//!   SP completes, every instance of a live SP that saw a post is finished;
//! * fault-free (no crash, rank death or failed copy): each non-empty
//!   subgroup run multicast once, `n * (sps - 1)` datagrams on the wire.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::driver::{self, Core, FabricCounts};
use super::rng::splitmix64;
use super::shared::{draw_len, world_key};
use super::{sentinel, Common, Outcome, SimFailure};
use crate::mcast_bcast::{
    subgroup_runs, Action, Config, Copy, McastBcast, Msg, Multicast, Post, Stats,
};
use crate::{CollKey, Nanos, Rank, SpId, Status};

mod checks;
mod events;
#[cfg(test)]
mod tests;

/// Untouched bytes after the message in every buffer.
const PAD: usize = 3;

super::config::sim_faults!(
    /// Probability (parts per million) that a copy or a multicast fails
    /// with `AccessError`.
    pub copy_error_ppm: u32,
    /// The fabric's and the SP-to-SP channel's faults.
    pub net: super::NetFaults,
    /// The first SP that answers a fetch request crashes right after its
    /// `FetchAck` left (an SP crash during the fetch phase).
    pub crash_fetch_server: bool,
    /// Non-root (collective, rank) posts made inconsistent on purpose: a
    /// length off by one or another root (possibly the rank itself).
    pub inconsistent_posts: u32,
);

/// Everything a run depends on.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimConfig {
    #[serde(flatten)]
    pub common: Common,
    pub mtu: u64,
    pub subgroups: u16,
    /// The cutoff timer's `alpha` and `B_link` (bytes per ns).
    pub alpha_ns: Nanos,
    pub link_bytes_per_ns: u64,
    /// Root of every collective; `None`: uniform per collective.
    pub root: Option<Rank>,
    /// Message length of every collective; `None`: per collective 0 or 1
    /// (10% each), a multiple of `mtu` (15%), else uniform in
    /// `0..=max_len_bytes`.
    pub len_bytes: Option<u64>,
    pub max_len_bytes: u64,
    pub faults: Faults,
}

impl SimConfig {
    /// [`Common::staged`] (4 nodes x 8 ranks, 2 SPs per node, two
    /// collectives), 64-byte chunks over 3 subgroups, lengths up to 2000
    /// bytes, `alpha` 150 us (the posts' skew and the late ranks), the
    /// inter-node bandwidth as `B_link`, no faults.
    pub fn new(seed: u64) -> SimConfig {
        let common = Common::staged(seed);
        SimConfig {
            mtu: 64,
            subgroups: 3,
            alpha_ns: 150_000,
            link_bytes_per_ns: common.cost.inter_node_bytes_per_ns,
            root: None,
            len_bytes: None,
            max_len_bytes: 2_000,
            faults: Faults::default(),
            common,
        }
    }
}

/// Key material: the buffer of `rank` in collective `op`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SimKey {
    pub op: u32,
    pub rank: Rank,
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
    /// Instance counters summed.
    pub stats: Stats,
}

super::config::sim_config! {
    config: [mtu, subgroups, alpha_ns, link_bytes_per_ns, root, len_bytes, max_len_bytes], [], [];
    report: [end_ns], [fabric, unregistered_drops], [copies, bytes_copied], [stats];
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
    pub(super) root: Rank,
    pub(super) len: u64,
    pub(super) n: u64,
    /// The ring the simulator expects (computed here).
    pub(super) ring: Vec<SpId>,
    pub(super) data: Vec<u8>,
    /// What each rank posted (differs from `root`/`len` for inconsistent
    /// posts); its buffer holds `post_len + PAD` bytes.
    pub(super) post_root: Vec<Rank>,
    pub(super) post_len: Vec<u64>,
    pub(super) inconsistent: bool,
    pub(super) buf: Vec<Vec<u8>>,
    pub(super) post_ns: Vec<Option<Nanos>>,
    pub(super) done: Vec<Option<Done>>,
    pub(super) disturbed: bool,
    /// SPs that learned of a fault touching this collective.
    pub(super) notified: BTreeSet<SpId>,
    /// Active registrations: the ranks whose buffers chunks land in.
    pub(super) registered: BTreeMap<SpId, Vec<Rank>>,
    /// Per rank: copies and multicasts reading / writing its buffer.
    pub(super) reads: Vec<u32>,
    pub(super) writes: Vec<u32>,
    /// The buffer multicast (its rank and length), once it is.
    pub(super) mcast_src: Option<(Rank, u64)>,
    /// Subgroup runs multicast (at most once each).
    pub(super) runs_sent: BTreeSet<u16>,
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
    pub(super) inst: BTreeMap<(SpId, usize), McastBcast<SimKey>>,
    pub(super) member_sps: BTreeSet<SpId>,
    /// Per SP: its ranks, ascending.
    pub(super) local: BTreeMap<SpId, Vec<Rank>>,
    /// Per (SP, op): the timer scheduled last.
    pub(super) timers: BTreeMap<(SpId, usize), Nanos>,
    /// Per (op, SP, copy id): the source and destination ranks of a copy
    /// emitted and not finished (void when its SP crashes).
    pub(super) pending: BTreeMap<(usize, SpId, u64), (Rank, Rank)>,
    /// Per (op, SP, copy id): what a copy read when it started.
    pub(super) read_at_start: BTreeMap<(usize, SpId, u64), Vec<u8>>,
    pub(super) crashed_fetch_server: bool,
    pub(super) unregistered_drops: u64,
    pub(super) copies: u64,
    pub(super) bytes_copied: u64,
}

/// The ring the simulator expects, computed independently of the
/// algorithm: the SPs serving members, in id order, from the root's SP,
/// wrapping.
pub(super) fn expected_ring(rank_sp: &[SpId], root: Rank) -> Vec<SpId> {
    let sps: BTreeSet<SpId> = rank_sp.iter().copied().collect();
    let mut v: Vec<SpId> = sps.iter().copied().collect();
    let at = v.iter().position(|&s| s == rank_sp[root as usize]).unwrap();
    v.rotate_left(at);
    v
}

impl<'a> Sim<'a> {
    pub(super) fn new(cfg: &'a SimConfig) -> Result<Sim<'a>, SimFailure> {
        let (mut core, mut setup) = cfg.core()?;
        core.set_net(cfg.faults.net);
        let w = cfg.world_size();
        let p = w as usize;
        if cfg.root.is_some_and(|r| r >= w) {
            return Err(core.fail("root out of range"));
        }
        let mtu = cfg.mtu.max(1);
        let mut local: BTreeMap<SpId, Vec<Rank>> = BTreeMap::new();
        for r in 0..w {
            local.entry(core.rank_sp[r as usize]).or_default().push(r);
        }
        let mut ops = Vec::new();
        for i in 0..cfg.ops as usize {
            let root = cfg.root.unwrap_or_else(|| setup.below(w as u64) as Rank);
            let len = draw_len(&mut setup, cfg.len_bytes, mtu, 4, cfg.max_len_bytes);
            let base = splitmix64(cfg.seed ^ splitmix64(i as u64 + 1));
            let data: Vec<u8> = (0..len)
                .map(|b| splitmix64(base.wrapping_add(b)) as u8)
                .collect();
            ops.push(Op {
                key: world_key(i),
                root,
                len,
                n: len.div_ceil(mtu).max(1),
                ring: expected_ring(&core.rank_sp, root),
                data,
                post_root: vec![root; p],
                post_len: vec![len; p],
                inconsistent: false,
                buf: Vec::new(),
                post_ns: vec![None; p],
                done: vec![None; p],
                disturbed: false,
                notified: BTreeSet::new(),
                registered: BTreeMap::new(),
                reads: vec![0; p],
                writes: vec![0; p],
                mcast_src: None,
                runs_sent: BTreeSet::new(),
                datagrams: 0,
            });
        }
        // Inconsistent posts: a non-root rank names another length or root.
        if w > 1 && !ops.is_empty() {
            for _ in 0..cfg.faults.inconsistent_posts {
                let i = setup.below(ops.len() as u64) as usize;
                let o = &mut ops[i];
                let mut r = setup.below(w as u64) as Rank;
                if r == o.root {
                    r = (r + 1) % w;
                }
                if setup.chance(1, 2) {
                    let l = o.len;
                    o.post_len[r as usize] = if l > 0 && setup.chance(1, 2) {
                        l - 1
                    } else {
                        l + 1
                    };
                } else {
                    o.post_root[r as usize] = (o.root + 1 + setup.below(w as u64 - 1) as Rank) % w;
                }
                o.inconsistent = true;
                o.disturbed = true;
            }
        }
        for o in ops.iter_mut() {
            o.buf = (0..p)
                .map(|r| {
                    let mut b: Vec<u8> = (0..o.post_len[r] as usize + PAD).map(sentinel).collect();
                    if r == o.root as usize {
                        b[..o.len as usize].copy_from_slice(&o.data);
                    }
                    b
                })
                .collect();
        }
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
        };
        cfg.schedule_world(&mut sim.core, &mut setup);
        Ok(sim)
    }

    pub(super) fn fail(&self, what: impl Into<String>) -> SimFailure {
        self.core.fail(what)
    }

    pub(super) fn instance(&mut self, sp: SpId, op: usize) -> &mut McastBcast<SimKey> {
        let key = self.ops[op].key;
        let c = self.cfg;
        let cfg = Config {
            me: sp,
            mtu: c.mtu,
            subgroups: c.subgroups,
            link_bytes_per_ns: c.link_bytes_per_ns,
            alpha_ns: c.alpha_ns,
        };
        self.inst
            .entry((sp, op))
            .or_insert_with(|| McastBcast::new(key, cfg))
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
            o.reads[src as usize] -= 1;
            o.writes[dst as usize] -= 1;
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
