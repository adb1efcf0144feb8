//! Deterministic simulation of the staged [`StagedAllgather`] on the world
//! communicator: flat, hierarchical, or a random design per SP.
//!
//! Shares placement, cost model, generator and the event driver with the
//! other simulators. Copies go through the SP's
//! [`CopyLimiter`](crate::sched::CopyLimiter); a read (local send buffer
//! into staging) costs what [`CostModel`] says for a copy within the node; a
//! write into a buffer or region on another node costs the fixed inter-node
//! copy cost and then takes the directed node link in turn with messages
//! (so flat writers of one node load their links P times per chunk,
//! hierarchical ones once per SP); a write within the node costs an
//! intra-node copy. A `from_segment` completion is the host's copy of
//! `P * len` bytes out of the region, done at completion time and costed in
//! `SimReport::end_ns`.
//!
//! *Exact bytes at any size.* Every byte is tracked by provenance rather
//! than by value: each buffer, region and staging slot is a list of extents
//! "these bytes are bytes `base..` of the send block of rank `s`" (or
//! untouched, or garbage after a failed copy), split and merged as copies
//! land. A receive buffer is right iff, for every `s`, bytes `s * len ..
//! (s + 1) * len` are bytes `0..len` of rank `s`'s block: byte-exact, and
//! cheap enough for 1 MiB blocks on 1024 ranks.
//!
//! Checkers (all outside the algorithm):
//! * every rank that completes `Ok` holds every block at its place, and
//!   every rank of the collective posted, with the same length and comm
//!   (so a rank never completes `Ok` with an inconsistent post around);
//!   bytes past `P * len` are never touched; without faults every rank
//!   completes `Ok` (`from_segment` exactly on hierarchical SPs, each
//!   reading its node owner's region at the place the owner's driver gave
//!   it);
//! * each posted rank completes exactly once, by its own SP; a rank never
//!   completes `Ok` after its SP learned of a fault touching the collective
//!   (peer loss, loss of a rank that had not completed, an `Abort` or
//!   `Stopped`);
//! * no copy starts or finishes on the receive buffer or the send buffer of
//!   a rank that completed, nor on a region some rank already copied out
//!   of (or, at its owner, completed); nothing is written into a rank
//!   before it posted;
//! * staging: every slot id is below `staging_slots`; a slot is never
//!   written while anything else reads or writes it, and never read while
//!   it is written; each SP's `max_slots_in_use` stays within the bound;
//! * shape: reads only from the SP's own ranks' send buffers at `chunk *
//!   chunk_bytes`, writes only of the SP's own ranks' blocks at `block *
//!   len + chunk * chunk_bytes`, into receive buffers of ranks of flat SPs
//!   or the region of node owners (hierarchical, through the shared key of
//!   the rank that posted first there), never into the ranks of a covered
//!   SP (hierarchical, not its node's owner, whose owner is hierarchical);
//! * the run ends within the event/time bound, every posted rank of a live
//!   SP completes, every instance of a live SP that saw a post is finished;
//! * without faults: every block is read once, each chunk written exactly
//!   once into every rank of a flat SP and into the region of every
//!   hierarchical owner, exactly the bytes that this implies cross nodes,
//!   and one `RegionDone` per covered SP.
//!
//! A message reaching an SP whose instance is finished is dropped, as the
//! SP engine does, except in runs with posts of different comms, where it
//! is answered with [`refusal`] (see the module docs of the algorithm).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::driver::{self, run_events, Collective, Core, Ev, Params};
use super::{CostModel, Layout, SimFailure};
use crate::staged_allgather::{
    node_owner, refusal, Action, Config, Copy, Design, Loc, Msg, Post, StagedAllgather, Stats,
};
use crate::{CollKey, CommId, Nanos, Rank, SpId, Status};

/// How an SP receives (see the algorithm's module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SimMode {
    Flat,
    /// A hierarchical node owner: into its region.
    Region,
    /// Hierarchical, not the owner, whose owner is hierarchical: its ranks
    /// read the owner's region.
    Covered,
}

/// Where the driver of SP `sp` places its region in its node segment (any
/// value works; distinct ones let the checker see that ranks copy from the
/// place their owner named).
fn region_at(sp: SpId) -> u64 {
    4096 * (u64::from(sp) + 1)
}

/// Untouched bytes after the data in every buffer and region.
const PAD: u64 = 3;

/// Injected faults (all off by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Faults {
    /// Extra uniform `0..=msg_jitter_ns` per message (reorders them).
    pub msg_jitter_ns: Nanos,
    /// SPs that crash at uniform times in `0..=crash_window_ns`.
    pub sp_crashes: u32,
    pub crash_window_ns: Nanos,
    /// Others learn of a crash after `detect_delay_ns` + uniform
    /// `0..=detect_delay_ns`.
    pub detect_delay_ns: Nanos,
    /// Host ranks that die at uniform times in `0..=death_window_ns`.
    pub rank_deaths: u32,
    pub death_window_ns: Nanos,
    /// Probability (parts per million) that a copy fails with
    /// `AccessError` (its destination bytes become garbage).
    pub copy_error_ppm: u32,
    /// (collective, rank) posts with a length off by one.
    pub inconsistent_len: u32,
    /// (collective, rank) posts naming another comm: two other ranks of
    /// different SPs (neither the poster's) swapped in `members`/`nodes`.
    pub inconsistent_comm: u32,
}

/// Everything a run depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimConfig {
    pub seed: u64,
    pub nodes: u32,
    pub ranks_per_node: u32,
    pub sps_per_node: u32,
    pub layout: Layout,
    pub max_inflight_reads: usize,
    /// Design of every SP, unless `mixed_designs`.
    pub design: Design,
    /// Each SP picks its design at random per collective (as the engine
    /// does when an SP has no segment room and delivers flat).
    pub mixed_designs: bool,
    pub chunk_bytes: u64,
    pub staging_slots: u32,
    /// Block length of every collective; `None`: per collective 0 or 1
    /// (10% each), a multiple of `chunk_bytes` (15%), else uniform in
    /// `0..=max_len_bytes`.
    pub len_bytes: Option<u64>,
    pub max_len_bytes: u64,
    /// Collectives, each posted at `i * op_gap_ns` + skew by every rank.
    pub ops: u32,
    pub op_gap_ns: Nanos,
    pub arrival_skew_ns: Nanos,
    /// World ranks that are always `late_delay_ns` later.
    pub late_ranks: u32,
    pub late_delay_ns: Nanos,
    pub cost: CostModel,
    pub faults: Faults,
    pub max_events: u64,
    pub max_virtual_ns: Nanos,
}

impl SimConfig {
    /// 4 nodes x 4 ranks, 2 SPs per node, block layout, flat, 16-byte
    /// chunks, 3 slots, random block lengths up to 50 bytes, two
    /// collectives, no faults.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            nodes: 4,
            ranks_per_node: 4,
            sps_per_node: 2,
            layout: Layout::Block,
            max_inflight_reads: 4,
            design: Design::Flat,
            mixed_designs: false,
            chunk_bytes: 16,
            staging_slots: 3,
            len_bytes: None,
            max_len_bytes: 50,
            ops: 2,
            op_gap_ns: 2_000,
            arrival_skew_ns: 20_000,
            late_ranks: 2,
            late_delay_ns: 100_000,
            cost: CostModel::default(),
            faults: Faults::default(),
            max_events: 200_000_000,
            max_virtual_ns: 1_000_000_000_000,
        }
    }

    pub fn world_size(&self) -> u32 {
        self.nodes * self.ranks_per_node
    }

    pub fn sp_count(&self) -> u32 {
        self.nodes * self.sps_per_node
    }
}

/// Which grant of a rank a key names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum KeyKind {
    Send,
    Recv,
    /// The region of the rank's SP (hierarchical).
    Shared,
}

/// Key material: one grant of one rank in one collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SimKey {
    pub op: u32,
    pub rank: Rank,
    pub kind: KeyKind,
}

/// Outcome of a successful run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimReport {
    pub seed: u64,
    pub world_size: u32,
    pub sps: u32,
    /// Latest time a rank had the data in its own buffer: its completion,
    /// plus the host's copy out of the region for `from_segment`
    /// completions.
    pub end_ns: Nanos,
    /// Latest completion emitted by an SP.
    pub sp_end_ns: Nanos,
    pub events: u64,
    pub messages: u64,
    /// Chunk reads and writes that finished `Ok`.
    pub reads: u64,
    pub writes: u64,
    /// Bytes written into buffers/regions on another node / the same node.
    pub bytes_inter_node: u64,
    pub bytes_intra_node: u64,
    /// What a fault-free run must move across nodes (sum over collectives).
    pub expected_inter_node_bytes: u64,
    /// Busy time of the busiest directed node link (writes only): a lower
    /// bound of the run under this cost model.
    pub max_link_busy_ns: Nanos,
    pub max_in_flight: usize,
    /// Instance counters summed (`max_slots_in_use`: the maximum).
    pub stats: Stats,
    pub error_completions: u64,
    /// Messages that reached a finished instance: dropped, or answered.
    pub after_finish_dropped: u64,
    pub after_finish_refused: u64,
    pub crashed_sps: Vec<SpId>,
    pub dead_ranks: Vec<u32>,
}

/// Run one simulation; `Err` carries the seed and what went wrong.
pub fn run(cfg: &SimConfig) -> Result<SimReport, SimFailure> {
    let mut sim = Sim::new(cfg)?;
    run_events(&mut sim)?;
    sim.final_checks()?;
    Ok(sim.report())
}

// ---- provenance memory ----------------------------------------------------

/// Where the bytes of an extent come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Src {
    /// Never written: byte at position `p` is `sentinel(p)`.
    Init,
    /// The send block of this rank.
    Send(Rank),
    /// Unknown (a failed copy, or staging never filled).
    Garbage,
}

/// `len` bytes equal to bytes `base..base + len` of `src`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ext {
    len: u64,
    src: Src,
    base: u64,
}

impl Ext {
    fn continued_by(&self, next: &Ext) -> bool {
        self.src == next.src && (self.src == Src::Garbage || self.base + self.len == next.base)
    }
}

/// A buffer of `size` bytes as extents keyed by their start.
#[derive(Clone, Debug)]
struct Mem {
    size: u64,
    ext: BTreeMap<u64, Ext>,
}

impl Mem {
    fn new(size: u64, src: Src) -> Mem {
        let mut ext = BTreeMap::new();
        if size > 0 {
            ext.insert(
                0,
                Ext {
                    len: size,
                    src,
                    base: 0,
                },
            );
        }
        Mem { size, ext }
    }

    /// Make an extent start at `at`.
    fn split(&mut self, at: u64) {
        if at == 0 || at >= self.size {
            return;
        }
        let (&start, &e) = self.ext.range(..=at).next_back().expect("covered");
        if start == at {
            return;
        }
        let left = at - start;
        self.ext.insert(start, Ext { len: left, ..e });
        self.ext.insert(
            at,
            Ext {
                len: e.len - left,
                src: e.src,
                base: e.base + left,
            },
        );
    }

    /// The extents of bytes `at..at + len` (`at + len <= size`).
    fn read(&self, at: u64, len: u64) -> Vec<Ext> {
        let end = at + len;
        let mut out = Vec::new();
        if len == 0 {
            return out;
        }
        let first = *self.ext.range(..=at).next_back().expect("covered").0;
        for (&s, e) in self.ext.range(first..end) {
            let (lo, hi) = (s.max(at), (s + e.len).min(end));
            out.push(Ext {
                len: hi - lo,
                src: e.src,
                base: if e.src == Src::Garbage {
                    0
                } else {
                    e.base + (lo - s)
                },
            });
        }
        out
    }

    /// Overwrite bytes from `at` with `pieces`.
    fn write(&mut self, at: u64, pieces: &[Ext]) {
        let mut ps: Vec<Ext> = Vec::with_capacity(pieces.len());
        for p in pieces.iter().filter(|p| p.len > 0) {
            match ps.last_mut() {
                Some(l) if l.continued_by(p) => l.len += p.len,
                _ => ps.push(*p),
            }
        }
        let len: u64 = ps.iter().map(|p| p.len).sum();
        let end = at + len;
        assert!(end <= self.size, "write past the end of a buffer");
        if len == 0 {
            return;
        }
        // Cut `at..end` out.
        let (&s, &e) = self.ext.range(..=at).next_back().expect("covered");
        if s + e.len >= end {
            // One extent covers it (the common case): keep its ends.
            if end < s + e.len {
                let base = if e.src == Src::Garbage {
                    0
                } else {
                    e.base + (end - s)
                };
                self.ext.insert(
                    end,
                    Ext {
                        len: s + e.len - end,
                        src: e.src,
                        base,
                    },
                );
            }
            if at > s {
                self.ext.get_mut(&s).unwrap().len = at - s;
            } else {
                self.ext.remove(&s);
            }
        } else {
            self.split(at);
            self.split(end);
            while let Some((&k, _)) = self.ext.range(at..end).next() {
                self.ext.remove(&k);
            }
        }
        // Put the pieces in, merged with their neighbours.
        let (mut pos, mut skip, mut last) = (at, 0, None);
        if let Some((&k, pred)) = self.ext.range_mut(..at).next_back() {
            if pred.continued_by(&ps[0]) {
                pred.len += ps[0].len;
                pos += ps[0].len;
                skip = 1;
                last = Some(k);
            }
        }
        for p in &ps[skip..] {
            self.ext.insert(pos, *p);
            last = Some(pos);
            pos += p.len;
        }
        let last = last.expect("something was written");
        if let Some(&succ) = self.ext.get(&end) {
            if self.ext[&last].continued_by(&succ) {
                self.ext.remove(&end);
                self.ext.get_mut(&last).unwrap().len += succ.len;
            }
        }
    }

    /// First byte at or after `from` that is not untouched.
    fn touched_from(&self, from: u64) -> Option<u64> {
        if from >= self.size {
            return None;
        }
        let mut pos = from;
        for e in self.read(from, self.size - from) {
            if e.src != Src::Init || e.base != pos {
                return Some(pos);
            }
            pos += e.len;
        }
        None
    }

    /// First byte of `0..p * len` that is not byte `j % len` of the block of
    /// rank `j / len`.
    fn wrong_block_byte(&self, p: u64, len: u64) -> Option<u64> {
        let mut pos = 0;
        for e in self.read(0, p * len) {
            let s = pos / len;
            let ok = e.src == Src::Send(s as Rank)
                && e.base == pos - s * len
                && (pos + e.len - 1) / len == s;
            if !ok {
                return Some(pos);
            }
            pos += e.len;
        }
        None
    }
}

// ---- the simulator ----------------------------------------------------------

/// A staging slot as the simulator sees it.
#[derive(Clone, Debug)]
struct Shadow {
    mem: Mem,
    readers: u32,
    writers: u32,
}

#[derive(Clone, Copy, Debug)]
struct Done {
    at: Nanos,
    status: Status,
    from_segment: bool,
    /// When the data are in the rank's own buffer.
    host_at: Nanos,
}

struct Op {
    key: CollKey,
    len: u64,
    n: u64,
    post_len: Vec<u64>,
    /// Per rank: `members`/`nodes` it posts instead of the real ones.
    post_comm: Vec<Option<(Vec<SpId>, Vec<u32>)>>,
    inconsistent: bool,
    /// Per SP.
    design: Vec<Design>,
    recv: Vec<Mem>,
    /// Per SP: the rank whose shared key names the region, and the region.
    region: Vec<Option<(Rank, Mem)>>,
    /// Per SP: first completion of one of its ranks.
    sealed: Vec<Option<Nanos>>,
    staging: BTreeMap<SpId, Vec<Shadow>>,
    post_ns: Vec<Option<Nanos>>,
    done: Vec<Option<Done>>,
    disturbed: bool,
    /// SPs that learned of a fault touching this collective.
    notified: BTreeSet<SpId>,
    reads: u64,
    writes_rank: Vec<u64>,
    writes_region: Vec<u64>,
    bytes_inter: u64,
    bytes_intra: u64,
}

type Env = (usize, Msg<SimKey>);
type Input = driver::Input<Env, Copy<SimKey>>;

struct Sim<'a> {
    cfg: &'a SimConfig,
    core: Core<Env, Copy<SimKey>>,
    ops: Vec<Op>,
    inst: BTreeMap<(SpId, usize), StagedAllgather<SimKey>>,
    /// SPs serving at least one rank.
    member_sps: BTreeSet<SpId>,
    /// Per SP: the owner of its node on the world communicator (its lowest
    /// member SP), computed once: the checkers ask for every write.
    owners: Vec<SpId>,
    reads: u64,
    writes: u64,
    after_finish_dropped: u64,
    after_finish_refused: u64,
    /// Directed node link -> time its writes kept it busy.
    link_busy: BTreeMap<(u32, u32), Nanos>,
}

impl Collective for Sim<'_> {
    type Msg = Env;
    type Copy = Copy<SimKey>;

    fn core(&mut self) -> &mut Core<Env, Copy<SimKey>> {
        &mut self.core
    }

    fn on_crash(&mut self, _sp: SpId) {
        for o in self.ops.iter_mut() {
            o.disturbed = true;
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

    fn over_budget(core: &Core<Env, Copy<SimKey>>) -> SimFailure {
        core.fail("no termination within the event/time bound")
    }
}

impl<'a> Sim<'a> {
    fn new(cfg: &'a SimConfig) -> Result<Sim<'a>, SimFailure> {
        let (core, mut setup) = Core::new(Params {
            seed: cfg.seed,
            nodes: cfg.nodes,
            ranks_per_node: cfg.ranks_per_node,
            sps_per_node: cfg.sps_per_node,
            layout: cfg.layout,
            max_inflight_reads: cfg.max_inflight_reads,
            cost: cfg.cost,
            msg_jitter_ns: cfg.faults.msg_jitter_ns,
            detect_delay_ns: cfg.faults.detect_delay_ns,
            max_events: cfg.max_events,
            max_virtual_ns: cfg.max_virtual_ns,
        })?;
        let w = cfg.world_size();
        let p = w as usize;
        let chunk = cfg.chunk_bytes.max(1);
        let sp_count = cfg.sp_count() as usize;
        let member_sps: BTreeSet<SpId> = core.rank_sp.iter().copied().collect();
        let owners: Vec<SpId> = (0..cfg.sp_count())
            .map(|sp| node_owner(&core.rank_sp, &core.rank_node, sp).unwrap_or(sp))
            .collect();
        let mut ops = Vec::new();
        for i in 0..cfg.ops as usize {
            let len = cfg.len_bytes.unwrap_or_else(|| {
                let pick = setup.below(100);
                if pick < 10 {
                    0
                } else if pick < 20 {
                    1
                } else if pick < 35 {
                    chunk * setup.range(1, 3)
                } else {
                    setup.range(0, cfg.max_len_bytes)
                }
            });
            let design = (0..sp_count)
                .map(|_| {
                    if !cfg.mixed_designs {
                        cfg.design
                    } else if setup.chance(1, 2) {
                        Design::Hier
                    } else {
                        Design::Flat
                    }
                })
                .collect();
            ops.push(Op {
                key: CollKey {
                    job: 1,
                    comm: CommId { leader: 0, id: 0 },
                    seq: i as u64,
                },
                len,
                n: if len == 0 { 0 } else { len.div_ceil(chunk) },
                post_len: vec![len; p],
                post_comm: vec![None; p],
                inconsistent: false,
                design,
                recv: Vec::new(),
                region: vec![None; sp_count],
                sealed: vec![None; sp_count],
                staging: BTreeMap::new(),
                post_ns: vec![None; p],
                done: vec![None; p],
                disturbed: false,
                notified: BTreeSet::new(),
                reads: 0,
                writes_rank: vec![0; p],
                writes_region: vec![0; sp_count],
                bytes_inter: 0,
                bytes_intra: 0,
            });
        }
        if !ops.is_empty() && w > 1 {
            for _ in 0..cfg.faults.inconsistent_len {
                let i = setup.below(ops.len() as u64) as usize;
                let o = &mut ops[i];
                let r = setup.below(w as u64) as usize;
                o.post_len[r] = if o.len > 0 && setup.chance(1, 2) {
                    o.len - 1
                } else {
                    o.len + 1
                };
                o.inconsistent = true;
            }
            for _ in 0..cfg.faults.inconsistent_comm {
                let i = setup.below(ops.len() as u64) as usize;
                let r = setup.below(w as u64) as usize;
                let sp_r = core.rank_sp[r];
                // Two other ranks of two other, different SPs.
                let mut found = None;
                for _ in 0..32 {
                    let x = setup.below(w as u64) as usize;
                    let y = setup.below(w as u64) as usize;
                    let (sx, sy) = (core.rank_sp[x], core.rank_sp[y]);
                    if x != r && y != r && sx != sy && sx != sp_r && sy != sp_r {
                        found = Some((x, y));
                        break;
                    }
                }
                let Some((x, y)) = found else { continue };
                let (mut m, mut nd) = (core.rank_sp.clone(), core.rank_node.clone());
                m.swap(x, y);
                nd.swap(x, y);
                let o = &mut ops[i];
                o.post_comm[r] = Some((m, nd));
                o.inconsistent = true;
            }
        }
        for o in ops.iter_mut() {
            o.recv = (0..p)
                .map(|r| Mem::new(w as u64 * o.post_len[r] + PAD, Src::Init))
                .collect();
            if o.inconsistent {
                o.disturbed = true;
            }
        }
        let mut sim = Sim {
            cfg,
            core,
            ops,
            inst: BTreeMap::new(),
            owners,
            member_sps,
            reads: 0,
            writes: 0,
            after_finish_dropped: 0,
            after_finish_refused: 0,
            link_busy: BTreeMap::new(),
        };
        sim.core.schedule_world_posts(
            &mut setup,
            cfg.ops,
            cfg.op_gap_ns,
            cfg.arrival_skew_ns,
            (cfg.late_ranks, cfg.late_delay_ns),
        );
        let f = &cfg.faults;
        sim.core.schedule_faults(
            &mut setup,
            (f.sp_crashes, f.crash_window_ns),
            (f.rank_deaths, f.death_window_ns),
        );
        Ok(sim)
    }

    fn fail(&self, what: impl Into<String>) -> SimFailure {
        self.core.fail(what)
    }

    fn instance(&mut self, sp: SpId, op: usize) -> &mut StagedAllgather<SimKey> {
        let key = self.ops[op].key;
        let cfg = Config {
            me: sp,
            chunk_bytes: self.cfg.chunk_bytes,
            staging_slots: self.cfg.staging_slots,
        };
        self.inst
            .entry((sp, op))
            .or_insert_with(|| StagedAllgather::new(key, cfg))
    }

    fn finished(&self, sp: SpId, op: usize) -> bool {
        self.inst.get(&(sp, op)).is_some_and(|a| a.is_finished())
    }

    fn slots(&self) -> usize {
        self.cfg.staging_slots.max(1) as usize
    }

    fn shadow(&mut self, op: usize, sp: SpId, slot: u32) -> Result<&mut Shadow, SimFailure> {
        let size = self.cfg.chunk_bytes.max(1);
        let fresh = || Shadow {
            mem: Mem::new(size, Src::Garbage),
            readers: 0,
            writers: 0,
        };
        let slots = self.slots();
        let staging = &mut self.ops[op].staging;
        self.core
            .staging_slot(staging, (op, sp, slot), slots, fresh)
    }

    fn process_input(&mut self, sp: SpId, input: Input) -> Result<(), SimFailure> {
        let now = self.core.now;
        let mut touched = Vec::new();
        match input {
            driver::Input::Post { op, rank } => {
                if self.finished(sp, op) {
                    return Err(self.fail(format!(
                        "op {op}: rank {rank} posts to a finished instance on SP {sp}"
                    )));
                }
                let r = rank as usize;
                let design = self.ops[op].design[sp as usize];
                let (members, nodes) = self.ops[op].post_comm[r]
                    .clone()
                    .unwrap_or_else(|| (self.core.rank_sp.clone(), self.core.rank_node.clone()));
                let len = self.ops[op].post_len[r];
                let key = |kind| SimKey {
                    op: op as u32,
                    rank,
                    kind,
                };
                let post = Post {
                    rank,
                    members,
                    nodes,
                    send_key: key(KeyKind::Send),
                    recv_key: key(KeyKind::Recv),
                    len,
                    design,
                    shared_key: (design == Design::Hier).then(|| key(KeyKind::Shared)),
                    shared_at: region_at(sp),
                };
                if let Err(e) = self.instance(sp, op).handle_post(now, post) {
                    return Err(self.fail(format!("op {op} rank {rank}: post rejected: {e}")));
                }
                let o = &mut self.ops[op];
                o.post_ns[r] = Some(now);
                if design == Design::Hier && o.region[sp as usize].is_none() {
                    let size = self.cfg.world_size() as u64 * len + PAD;
                    o.region[sp as usize] = Some((rank, Mem::new(size, Src::Init)));
                }
                touched.push(op);
            }
            driver::Input::Msg {
                from,
                msg: (op, msg),
            } => {
                if self.core.sps[sp as usize].known_lost.contains(&from) {
                    return Ok(());
                }
                if matches!(msg, Msg::Abort { .. } | Msg::Stopped { .. }) {
                    self.ops[op].notified.insert(sp);
                }
                if self.finished(sp, op) {
                    // The engine forgets finished instances.
                    if self.cfg.faults.inconsistent_comm > 0 {
                        if let Some(reply) = refusal(&msg, Status::RankFailed) {
                            self.after_finish_refused += 1;
                            let out = now + self.cfg.cost.msg_proc_ns;
                            let wire = msg_bytes(&reply);
                            self.core.send(op, sp, from, wire, out, (op, reply))?;
                            return Ok(());
                        }
                    }
                    self.after_finish_dropped += 1;
                    return Ok(());
                }
                let shown = format!("{msg:?}");
                if let Err(e) = self.instance(sp, op).handle_msg(now, from, msg) {
                    return Err(self.fail(format!(
                        "op {op}: SP {sp} rejected {shown} from SP {from}: {e}"
                    )));
                }
                touched.push(op);
            }
            driver::Input::CopyDone { op, copy, fail } => {
                let status = if fail {
                    Status::AccessError
                } else {
                    Status::Ok
                };
                self.check_open(op, &copy, "finished")?;
                self.finish_copy(op, sp, &copy, !fail)?;
                self.core.sps[sp as usize].limiter.finished();
                self.instance(sp, op).handle_copy_done(now, copy.id, status);
                touched.push(op);
            }
            driver::Input::PeerLost { lost } => {
                self.core.sps[sp as usize].known_lost.insert(lost);
                if self.member_sps.contains(&sp) {
                    for op in 0..self.ops.len() {
                        if self.member_sps.contains(&lost) {
                            self.ops[op].notified.insert(sp);
                        }
                        if !self.finished(sp, op) {
                            self.instance(sp, op).handle_peer_lost(now, lost);
                            touched.push(op);
                        }
                    }
                }
            }
            driver::Input::RankLost { world } => {
                for op in 0..self.ops.len() {
                    if self.ops[op].done[world as usize].is_none() {
                        self.ops[op].notified.insert(sp);
                    }
                    if !self.finished(sp, op) {
                        self.instance(sp, op).handle_rank_lost(now, world);
                        touched.push(op);
                    }
                }
            }
        }
        let out = now + self.cfg.cost.msg_proc_ns;
        for op in touched {
            self.drain(sp, op, out)?;
        }
        self.pump(sp, out)
    }

    fn drain(&mut self, sp: SpId, op: usize, out: Nanos) -> Result<(), SimFailure> {
        while let Some(action) = self.inst.get_mut(&(sp, op)).and_then(|a| a.poll_action()) {
            match action {
                Action::Send { to, msg } => {
                    let wire = msg_bytes(&msg);
                    self.core.send(op, sp, to, wire, out, (op, msg))?;
                }
                Action::Copy(c) => {
                    self.check_copy(op, sp, &c)?;
                    self.core.sps[sp as usize].limiter.push((op, c));
                }
                Action::Complete {
                    rank,
                    status,
                    from_segment,
                } => self.complete(op, sp, rank, status, from_segment, out)?,
            }
        }
        Ok(())
    }

    /// Starts the copies the SP's limiter admits.
    fn pump(&mut self, sp: SpId, at: Nanos) -> Result<(), SimFailure> {
        while let Some((op, c)) = self.core.next_copy(sp)? {
            self.check_open(op, &c, "started")?;
            if let Loc::Stage { slot, .. } = c.src {
                let s = self.shadow(op, sp, slot.0)?;
                if s.writers > 0 {
                    return Err(self.fail(format!(
                        "op {op}: a write reads staging slot {} of SP {sp} while it is being filled",
                        slot.0
                    )));
                }
                s.readers += 1;
            }
            if let Loc::Stage { slot, .. } = c.dst {
                let s = self.shadow(op, sp, slot.0)?;
                if s.readers > 0 || s.writers > 0 {
                    let (r, w) = (s.readers, s.writers);
                    return Err(self.fail(format!(
                        "op {op}: a read fills staging slot {} of SP {sp} while {r} writes out of it and {w} reads into it are in flight",
                        slot.0
                    )));
                }
                s.writers = 1;
            }
            let node = self.core.sp_node(sp);
            let done_at = match &c.dst {
                Loc::Host { key, .. } => {
                    let to = self.core.rank_sp[key.rank as usize];
                    if self.core.sp_node(to) == node {
                        at + self.core.copy_cost(node, sp, c.len)
                    } else {
                        let start = at + self.cfg.cost.copy_fixed_inter_ns;
                        let bw = self.cfg.cost.inter_node_bytes_per_ns.max(1);
                        *self
                            .link_busy
                            .entry((node, self.core.sp_node(to)))
                            .or_default() += c.len.div_ceil(bw);
                        self.core.transfer(sp, to, c.len, start)
                    }
                }
                Loc::Stage { .. } => at + self.core.copy_cost(node, sp, c.len),
            };
            let ppm = self.cfg.faults.copy_error_ppm as u64;
            let fail = ppm > 0 && self.core.rng.chance(ppm, 1_000_000);
            if fail {
                self.ops[op].disturbed = true;
            }
            self.core.schedule(
                done_at,
                Ev::Input {
                    sp,
                    input: driver::Input::CopyDone { op, copy: c, fail },
                },
            );
        }
        Ok(())
    }

    /// The shape of a copy when the SP emits it.
    fn check_copy(&self, op: usize, sp: SpId, c: &Copy<SimKey>) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let bad = |what: &str| Err(self.fail(format!("op {op}: SP {sp}: {what}: {c:?}")));
        let chunk = self.cfg.chunk_bytes.max(1);
        let p = self.cfg.world_size() as u64;
        if c.len == 0 || c.len > chunk || (!o.inconsistent && c.chunk >= o.n) {
            return bad("bad chunk or length");
        }
        if c.block as u64 >= p || self.core.rank_sp[c.block as usize] != sp {
            return bad("a block of a rank this SP does not serve");
        }
        match (&c.src, &c.dst) {
            (Loc::Host { key, offset }, Loc::Stage { offset: 0, .. }) => {
                if key.op != op as u32
                    || key.kind != KeyKind::Send
                    || key.rank != c.block
                    || c.rank != c.block
                    || c.sp != sp
                    || *offset != c.chunk * chunk
                {
                    return bad("a read that is not of the block's own chunk");
                }
                if o.post_ns[c.block as usize].is_none() {
                    return bad("a read from a rank that has not posted");
                }
            }
            (Loc::Stage { offset: 0, .. }, Loc::Host { key, offset }) => {
                let r = key.rank as usize;
                if key.op != op as u32 || r as u64 >= p || c.rank != key.rank {
                    return bad("a write through a foreign key");
                }
                let to = self.core.rank_sp[r];
                if c.sp != to {
                    return bad("a write naming the wrong SP");
                }
                match key.kind {
                    KeyKind::Send => return bad("a write into a send buffer"),
                    KeyKind::Recv => {
                        if o.post_ns[r].is_none() {
                            return bad("a write into a rank that has not posted");
                        }
                        if !o.inconsistent && self.mode(o, to) != SimMode::Flat {
                            return bad("a write into a rank of a hierarchical SP");
                        }
                    }
                    KeyKind::Shared => {
                        let Some((first, _)) = &o.region[to as usize] else {
                            return bad("a write into the region of an SP without a post");
                        };
                        if !o.inconsistent
                            && (self.mode(o, to) != SimMode::Region || *first != key.rank)
                        {
                            return bad("a region write not through a node owner's first rank");
                        }
                    }
                }
                if !o.inconsistent && *offset != c.block as u64 * o.len + c.chunk * chunk {
                    return bad("a write at the wrong offset");
                }
            }
            _ => return bad("not host<->stage at slot offset 0"),
        }
        Ok(())
    }

    /// No copy touches the buffers of a rank that completed, nor the region
    /// of an SP one of whose ranks completed.
    fn check_open(&self, op: usize, c: &Copy<SimKey>, when: &str) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        for loc in [&c.src, &c.dst] {
            let Loc::Host { key, .. } = loc else { continue };
            let r = key.rank as usize;
            match key.kind {
                KeyKind::Shared => {
                    let to = self.core.rank_sp[r] as usize;
                    if let Some(t) = o.sealed[to] {
                        return Err(self.fail(format!(
                            "op {op}: copy {} {when} on the region of SP {to}, whose rank completed at {t}ns",
                            c.id.0
                        )));
                    }
                }
                KeyKind::Send | KeyKind::Recv => {
                    if let Some(d) = o.done[r] {
                        let what = if key.kind == KeyKind::Send {
                            "send"
                        } else {
                            "receive"
                        };
                        return Err(self.fail(format!(
                            "op {op}: copy {} {when} on the {what} buffer of rank {r}, completed at {}ns",
                            c.id.0, d.at
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    fn finish_copy(
        &mut self,
        op: usize,
        sp: SpId,
        c: &Copy<SimKey>,
        ok: bool,
    ) -> Result<(), SimFailure> {
        let src: Vec<Ext> = match &c.src {
            Loc::Host { key, offset } => {
                let end = offset + c.len;
                if end > self.ops[op].post_len[key.rank as usize] {
                    return Err(self.fail(format!("op {op}: read past the send block: {c:?}")));
                }
                vec![Ext {
                    len: c.len,
                    src: Src::Send(key.rank),
                    base: *offset,
                }]
            }
            Loc::Stage { slot, .. } => {
                let s = self.shadow(op, sp, slot.0)?;
                s.readers -= 1;
                s.mem.read(0, c.len)
            }
        };
        let pieces = if ok {
            src
        } else {
            vec![Ext {
                len: c.len,
                src: Src::Garbage,
                base: 0,
            }]
        };
        match &c.dst {
            Loc::Stage { slot, .. } => {
                let s = self.shadow(op, sp, slot.0)?;
                s.writers = 0;
                s.mem.write(0, &pieces);
                if ok {
                    self.reads += 1;
                    self.ops[op].reads += 1;
                }
            }
            Loc::Host { key, offset } => {
                let r = key.rank as usize;
                let to = self.core.rank_sp[r];
                let inter = self.core.sp_node(to) != self.core.sp_node(sp);
                let o = &mut self.ops[op];
                let mem = match key.kind {
                    KeyKind::Recv => &mut o.recv[r],
                    KeyKind::Shared => &mut o.region[to as usize].as_mut().expect("checked").1,
                    KeyKind::Send => unreachable!("checked"),
                };
                if offset + c.len > mem.size - PAD {
                    return Err(self.fail(format!("op {op}: write past the data: {c:?}")));
                }
                mem.write(*offset, &pieces);
                if ok {
                    self.writes += 1;
                    if key.kind == KeyKind::Recv {
                        o.writes_rank[r] += 1;
                    } else {
                        o.writes_region[to as usize] += 1;
                    }
                    if inter {
                        o.bytes_inter += c.len;
                    } else {
                        o.bytes_intra += c.len;
                    }
                }
            }
        }
        Ok(())
    }

    fn complete(
        &mut self,
        op: usize,
        sp: SpId,
        rank: Rank,
        status: Status,
        from_segment: bool,
        at: Nanos,
    ) -> Result<(), SimFailure> {
        let r = rank as usize;
        let o = &self.ops[op];
        self.core.check_completion(
            (op, sp, rank),
            status,
            o.post_ns[r].is_some(),
            o.done[r].map(|d| (d.at, d.status)),
            o.notified.contains(&sp),
        )?;
        let mut host_at = at;
        let mode = self.mode(o, sp);
        let mut read_from = None;
        if from_segment {
            if !status.is_ok() || mode == SimMode::Flat {
                return Err(self.fail(format!(
                    "op {op}: rank {rank} completed from the segment ({status}, {mode:?})"
                )));
            }
            // The host copies P * len bytes out of its node owner's region in
            // its wait: the SP says where that is.
            let p = self.cfg.world_size() as u64;
            let owner = self.owners[sp as usize];
            let src = self.inst.get(&(sp, op)).and_then(|a| a.segment_source());
            match src {
                Some((s, at, total))
                    if s == owner && at == region_at(owner) && total == p * o.len => {}
                _ if o.inconsistent => {}
                _ => {
                    return Err(self.fail(format!(
                        "op {op}: rank {rank} of SP {sp} copies from {src:?}, not from its \
                         owner {owner}'s region"
                    )))
                }
            }
            let Some((_, region)) = &o.region[owner as usize] else {
                return Err(self.fail(format!("op {op}: SP {sp} completed from no region")));
            };
            let n = (p * o.post_len[r]).min(region.size - PAD);
            let data = region.read(0, n);
            self.ops[op].recv[r].write(0, &data);
            let node = self.core.sp_node(sp);
            host_at = at + self.core.copy_cost(node, sp, n);
            read_from = Some(owner);
        }
        let o = &mut self.ops[op];
        // A region is sealed once a rank copied out of it, or once a rank of
        // its owner completed (the stop handshake then covers the region).
        if mode == SimMode::Region {
            o.sealed[sp as usize].get_or_insert(at);
        }
        if let Some(owner) = read_from {
            o.sealed[owner as usize].get_or_insert(at);
        }
        o.done[r] = Some(Done {
            at,
            status,
            from_segment,
            host_at,
        });
        Ok(())
    }

    fn final_checks(&mut self) -> Result<(), SimFailure> {
        let crashed: BTreeSet<SpId> = self.core.crashed.iter().copied().collect();
        let p = self.cfg.world_size() as u64;
        for (i, o) in self.ops.iter().enumerate() {
            for r in 0..p as usize {
                let sp = self.core.rank_sp[r];
                let b = &o.recv[r];
                if let Some(j) = b.touched_from(p * o.post_len[r]) {
                    return Err(self.fail(format!(
                        "op {i}: rank {r}: byte {j} past the data was written"
                    )));
                }
                let d = match o.done[r] {
                    Some(d) => d,
                    None if crashed.contains(&sp) || o.post_ns[r].is_none() => continue,
                    None => {
                        let inst = self.inst.get(&(sp, i));
                        return Err(self.fail(format!(
                            "op {i} rank {r} (SP {sp}) never completed (posted {:?}; instance: {}) -- deadlock",
                            o.post_ns[r],
                            inst.map_or("none".into(), |a| format!(
                                "abort={:?} in_flight={} slots={} stats={:?}",
                                a.abort_status(),
                                a.copies_in_flight(),
                                a.slots_in_use(),
                                a.stats()
                            ))
                        )));
                    }
                };
                if !o.disturbed {
                    let seg = self.mode(o, sp) != SimMode::Flat;
                    if !d.status.is_ok() || d.from_segment != seg {
                        return Err(self.fail(format!(
                            "op {i} rank {r}: {} (from_segment {}) without a fault",
                            d.status, d.from_segment
                        )));
                    }
                }
                if d.status.is_ok() {
                    // Every rank posted, all with this rank's length and
                    // comm (the injected lengths may happen to agree).
                    let len = o.post_len[r];
                    for x in 0..p as usize {
                        if o.post_ns[x].is_none()
                            || o.post_len[x] != len
                            || o.post_comm[x].is_some()
                        {
                            return Err(self.fail(format!(
                                "op {i} rank {r}: completed Ok although rank {x} did not post the same (posted {:?}, {} bytes, other comm {})",
                                o.post_ns[x],
                                o.post_len[x],
                                o.post_comm[x].is_some()
                            )));
                        }
                    }
                    if len > 0 {
                        if let Some(j) = b.wrong_block_byte(p, len) {
                            return Err(self.fail(format!(
                                "op {i} rank {r}: completed Ok but byte {j} is wrong (block {}, chunk {})",
                                j / len,
                                (j % len) / self.cfg.chunk_bytes.max(1)
                            )));
                        }
                    }
                }
            }
            if !o.disturbed {
                let want = p * o.n;
                if o.reads != want {
                    return Err(self.fail(format!("op {i}: {} chunk reads, want {want}", o.reads)));
                }
                for r in 0..p as usize {
                    let sp = self.core.rank_sp[r] as usize;
                    if self.mode(o, sp as SpId) == SimMode::Flat && o.writes_rank[r] != want {
                        return Err(self.fail(format!(
                            "op {i}: {} chunk writes into rank {r}, want {want}",
                            o.writes_rank[r]
                        )));
                    }
                }
                for &sp in &self.member_sps {
                    let got = o.writes_region[sp as usize];
                    let exp = if self.mode(o, sp) == SimMode::Region {
                        want
                    } else {
                        0
                    };
                    if got != exp {
                        return Err(self.fail(format!(
                            "op {i}: {got} chunk writes into the region of SP {sp}, want {exp}"
                        )));
                    }
                }
                let exp = self.expected_inter(o);
                if o.bytes_inter != exp {
                    return Err(self.fail(format!(
                        "op {i}: {} bytes crossed nodes, want {exp}",
                        o.bytes_inter
                    )));
                }
                let covered = self
                    .member_sps
                    .iter()
                    .filter(|&&sp| self.mode(o, sp) == SimMode::Covered)
                    .count() as u64;
                let done: u64 = self
                    .member_sps
                    .iter()
                    .filter_map(|&sp| self.inst.get(&(sp, i)))
                    .map(|a| a.stats().regions_shared)
                    .sum();
                if done != covered {
                    return Err(self.fail(format!(
                        "op {i}: {done} RegionDone sent, want {covered} (covered SPs)"
                    )));
                }
            }
        }
        for (&(sp, op), a) in &self.inst {
            if crashed.contains(&sp) {
                continue;
            }
            if a.stats().max_slots_in_use > self.cfg.staging_slots.max(1) {
                return Err(self.fail(format!(
                    "op {op}: SP {sp} used {} staging slots",
                    a.stats().max_slots_in_use
                )));
            }
            if a.members().is_some() && !a.is_finished() {
                return Err(self.fail(format!(
                    "op {op}: instance on live SP {sp} not finished at the end (abort={:?}, in flight {}, slots {})",
                    a.abort_status(),
                    a.copies_in_flight(),
                    a.slots_in_use()
                )));
            }
        }
        Ok(())
    }

    /// How SP `sp` receives in `o` (on the world communicator): a node
    /// owner by its own design, another SP flat if it or its owner is.
    fn mode(&self, o: &Op, sp: SpId) -> SimMode {
        let owner = self.owners[sp as usize];
        match (o.design[sp as usize], o.design[owner as usize]) {
            (Design::Flat, _) => SimMode::Flat,
            (Design::Hier, _) if owner == sp => SimMode::Region,
            (Design::Hier, Design::Hier) => SimMode::Covered,
            (Design::Hier, Design::Flat) => SimMode::Flat,
        }
    }

    /// Bytes a fault-free collective writes across nodes: every block into
    /// every rank of a flat SP, once into the region of a hierarchical one,
    /// on other nodes.
    fn expected_inter(&self, o: &Op) -> u64 {
        let mut per_node_units: BTreeMap<u32, u64> = BTreeMap::new();
        for &sp in &self.member_sps {
            let node = self.core.sp_node(sp);
            let units = match self.mode(o, sp) {
                SimMode::Region => 1,
                SimMode::Covered => 0,
                SimMode::Flat => self.core.rank_sp.iter().filter(|&&s| s == sp).count() as u64,
            };
            *per_node_units.entry(node).or_default() += units;
        }
        let total: u64 = per_node_units.values().sum();
        self.core
            .rank_node
            .iter()
            .map(|n| o.len * (total - per_node_units[n]))
            .sum()
    }

    fn report(&self) -> SimReport {
        let mut stats = Stats::default();
        for a in self.inst.values() {
            let s = a.stats();
            stats.bytes_staged += s.bytes_staged;
            stats.chunk_reads += s.chunk_reads;
            stats.chunk_writes += s.chunk_writes;
            stats.max_slots_in_use = stats.max_slots_in_use.max(s.max_slots_in_use);
            stats.writes_waited_for_key += s.writes_waited_for_key;
            stats.keys_before_post += s.keys_before_post;
            stats.written_msgs += s.written_msgs;
            stats.unknown_done += s.unknown_done;
            stats.ignored_from_lost_sp += s.ignored_from_lost_sp;
        }
        let done = self.ops.iter().flat_map(|o| o.done.iter()).flatten();
        SimReport {
            seed: self.cfg.seed,
            world_size: self.cfg.world_size(),
            sps: self.cfg.sp_count(),
            end_ns: done.clone().map(|d| d.host_at).max().unwrap_or(0),
            sp_end_ns: done.clone().map(|d| d.at).max().unwrap_or(0),
            events: self.core.events,
            messages: self.core.messages,
            reads: self.reads,
            writes: self.writes,
            bytes_inter_node: self.ops.iter().map(|o| o.bytes_inter).sum(),
            bytes_intra_node: self.ops.iter().map(|o| o.bytes_intra).sum(),
            expected_inter_node_bytes: self.ops.iter().map(|o| self.expected_inter(o)).sum(),
            max_link_busy_ns: self.link_busy.values().copied().max().unwrap_or(0),
            max_in_flight: self.core.max_in_flight,
            stats,
            error_completions: done.filter(|d| !d.status.is_ok()).count() as u64,
            after_finish_dropped: self.after_finish_dropped,
            after_finish_refused: self.after_finish_refused,
            crashed_sps: self.core.crashed.clone(),
            dead_ranks: self.core.dead.clone(),
        }
    }
}

/// Size of a message's fields on the wire (a key counts 16 bytes).
fn msg_bytes(msg: &Msg<SimKey>) -> u64 {
    match msg {
        Msg::Key { .. } | Msg::Region { .. } => 4 + 8 + 8 + 16,
        Msg::Written { ranks } => 4 * ranks.len() as u64,
        Msg::WrittenRegion | Msg::Abort { .. } | Msg::Stopped { .. } => 1,
        Msg::Covered { .. } | Msg::Waiting { .. } => 16,
        Msg::RegionDone { .. } => 8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::staged_allgather::{set_mutation, Mutation};

    #[test]
    fn provenance_memory_splits_and_merges() {
        let mut m = Mem::new(20, Src::Init);
        assert_eq!(m.touched_from(0), None);
        let a = Ext {
            len: 5,
            src: Src::Send(1),
            base: 0,
        };
        let b = Ext {
            len: 5,
            src: Src::Send(1),
            base: 5,
        };
        m.write(10, &[b]);
        m.write(5, &[a]);
        // Merged into one extent: bytes 0..10 of rank 1 at 5..15.
        assert_eq!(m.ext.len(), 3, "{m:?}");
        assert_eq!(
            m.read(7, 4),
            vec![Ext {
                len: 4,
                src: Src::Send(1),
                base: 2
            }]
        );
        assert_eq!(m.touched_from(15), None);
        assert_eq!(m.touched_from(0), Some(5));
        let mut g = Mem::new(6, Src::Init);
        g.write(0, &m.read(5, 3));
        g.write(3, &m.read(8, 3));
        assert_eq!(
            g.wrong_block_byte(2, 3),
            Some(0),
            "rank 1 bytes where rank 0 belongs"
        );
        let mut h = Mem::new(6, Src::Init);
        h.write(
            0,
            &[
                Ext {
                    len: 3,
                    src: Src::Send(0),
                    base: 0,
                },
                Ext {
                    len: 3,
                    src: Src::Send(1),
                    base: 0,
                },
            ],
        );
        assert_eq!(h.wrong_block_byte(2, 3), None);
        h.write(
            4,
            &[Ext {
                len: 1,
                src: Src::Garbage,
                base: 0,
            }],
        );
        assert_eq!(h.wrong_block_byte(2, 3), Some(4));
    }

    /// `Mem` against a model holding each byte's provenance.
    #[test]
    fn provenance_memory_matches_a_byte_model() {
        use crate::sim::rng::Rng;
        type Byte = (Src, u64);
        let mut rng = Rng::new(7);
        for _ in 0..200 {
            let size = rng.range(1, 40);
            let mut mems = [Mem::new(size, Src::Init), Mem::new(size, Src::Garbage)];
            let mut model: [Vec<Byte>; 2] = [
                (0..size).map(|p| (Src::Init, p)).collect(),
                (0..size).map(|_| (Src::Garbage, 0)).collect(),
            ];
            for _ in 0..30 {
                let (d, at) = (rng.below(2) as usize, rng.below(size));
                let len = rng.range(0, size - at);
                // Pieces: read from the other buffer, or fresh send bytes.
                let pieces: Vec<Ext> = if rng.chance(1, 2) {
                    let from = rng.below(size - len + 1);
                    mems[1 - d].read(from, len)
                } else {
                    let mut v = Vec::new();
                    let mut left = len;
                    while left > 0 {
                        let l = rng.range(1, left);
                        let src = match rng.below(3) {
                            0 => Src::Garbage,
                            1 => Src::Send(rng.below(2) as Rank),
                            _ => Src::Init,
                        };
                        let base = if src == Src::Garbage {
                            0
                        } else {
                            rng.below(50)
                        };
                        v.push(Ext { len: l, src, base });
                        left -= l;
                    }
                    v
                };
                let mut bytes = Vec::new();
                for p in &pieces {
                    for k in 0..p.len {
                        let b = if p.src == Src::Garbage { 0 } else { p.base + k };
                        bytes.push((p.src, b));
                    }
                }
                mems[d].write(at, &pieces);
                model[d][at as usize..(at + len) as usize].copy_from_slice(&bytes);
                for (m, want) in mems.iter().zip(&model) {
                    let mut got = Vec::new();
                    let mut end = 0;
                    for (&s, e) in &m.ext {
                        assert_eq!(s, end, "extents tile the buffer: {m:?}");
                        end = s + e.len;
                        for k in 0..e.len {
                            got.push((e.src, if e.src == Src::Garbage { 0 } else { e.base + k }));
                        }
                    }
                    assert_eq!(end, m.size);
                    assert_eq!(&got, want);
                    // Maximal merging: no two neighbours continue each other.
                    let v: Vec<&Ext> = m.ext.values().collect();
                    assert!(v.windows(2).all(|w| !w[0].continued_by(w[1])), "{m:?}");
                }
            }
        }
    }

    fn cfg(seed: u64) -> SimConfig {
        let mut c = SimConfig::new(seed);
        c.len_bytes = Some(40);
        c.faults.msg_jitter_ns = 2_000;
        c
    }

    #[test]
    fn a_run_writes_every_block_everywhere() {
        for design in [Design::Flat, Design::Hier] {
            let mut c = cfg(5);
            c.design = design;
            let r = run(&c).unwrap();
            eprintln!("{r:?}");
            assert_eq!(r.error_completions, 0);
            assert_eq!(r.bytes_inter_node, r.expected_inter_node_bytes);
            assert!(r.reads > 0 && r.writes > 0);
            assert!(r.stats.max_slots_in_use >= 2, "{:?}", r.stats);
            assert_eq!(r.after_finish_dropped, 0);
        }
    }

    /// Runs `c` under `m` for a few seeds; every seed must fail with a
    /// message containing one of `want`. Returns the first failure.
    fn caught(m: Mutation, c: SimConfig, want: &[&str]) -> String {
        driver::caught(m, set_mutation, |seed| SimConfig { seed, ..c }, run, want)
    }

    #[test]
    fn checkers_catch_a_slot_freed_while_its_writes_read_it() {
        caught(
            Mutation::FreeWhileWriting,
            cfg(0),
            &["while 1 writes out of it", "writes out of it"],
        );
    }

    #[test]
    fn checkers_catch_ranks_completing_before_every_writer_is_done() {
        caught(
            Mutation::CompleteEarly,
            cfg(0),
            &["on the receive buffer of rank", "is wrong"],
        );
    }

    /// SP crashes and copy errors abort while remote writes are in flight.
    fn aborting(c: SimConfig) -> SimConfig {
        let mut c = c;
        c.len_bytes = Some(64);
        c.chunk_bytes = 16;
        c.late_ranks = 0;
        c.arrival_skew_ns = 2_000;
        c.faults.copy_error_ppm = 30_000;
        c
    }

    #[test]
    fn checkers_catch_a_skipped_stop_handshake() {
        let mut c = aborting(cfg(0));
        c.design = Design::Flat;
        caught(
            Mutation::SkipStopHandshake,
            c,
            &["on the receive buffer of rank", "on the region of SP"],
        );
    }

    #[test]
    fn checkers_catch_a_skipped_stop_handshake_hier() {
        let mut c = aborting(cfg(0));
        c.design = Design::Hier;
        caught(Mutation::SkipStopHandshake, c, &["on the region of SP"]);
    }

    #[test]
    fn checkers_catch_send_buffers_read_after_an_abort_completed_them() {
        let mut c = aborting(cfg(0));
        c.faults.copy_error_ppm = 0;
        c.faults.rank_deaths = 1;
        c.faults.death_window_ns = 3_000;
        c.staging_slots = 8;
        c.max_inflight_reads = 16;
        caught(
            Mutation::IgnoreReadsOnAbort,
            c,
            &["on the send buffer of rank"],
        );
    }

    #[test]
    fn checkers_catch_ok_completions_after_an_abort() {
        let mut c = cfg(0);
        c.faults.inconsistent_len = 1;
        c.faults.rank_deaths = 1;
        c.faults.death_window_ns = 10_000;
        caught(
            Mutation::OkAfterAbort,
            c,
            &["learned of a fault", "did not post the same"],
        );
    }
}
