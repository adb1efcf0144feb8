//! Deterministic simulation of the hierarchical
//! [`Allgatherv`](crate::allgatherv::Allgatherv) on the world communicator.
//!
//! Shares placement, cost model, sentinel and generator with
//! [`super::alltoallv`]. Real small buffers; checkers outside the algorithm:
//! every receive buffer equals native allgatherv (sentinel outside blocks;
//! after an error every block is right or untouched), each posted rank
//! completes exactly once, no copy starts or finishes on a buffer whose rank
//! completed, the run ends (no deadlock, every live instance finished), the
//! copy limiter bound holds, and fault-free runs move each rank's data into
//! each other node exactly once (minimal inter-node bytes).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use super::rng::{splitmix64, Rng};
use super::{place_rank, sentinel, CostModel, Layout, SimFailure};
use crate::allgatherv::{Action, Allgatherv, Config, Copy, Msg, Post, Stats};
use crate::sched::CopyLimiter;
use crate::{CollKey, CommId, Nanos, Rank, SpId, Status};

/// Injected faults (all off by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Faults {
    /// Extra uniform `0..=msg_jitter_ns` per message.
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
    /// Per-rank block sizes uniform in `0..=max_block_bytes` ...
    pub max_block_bytes: u64,
    /// ... except this share (percent) forced to 0.
    pub zero_block_percent: u32,
    /// true: all blocks have the same size (Allgather).
    pub equal_counts: bool,
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
    /// 8 nodes x 32 ranks, 4 SPs per node, block layout, one collective.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            nodes: 8,
            ranks_per_node: 32,
            sps_per_node: 4,
            layout: Layout::Block,
            max_inflight_reads: 4,
            max_block_bytes: 64,
            zero_block_percent: 10,
            equal_counts: false,
            ops: 1,
            op_gap_ns: 0,
            arrival_skew_ns: 20_000,
            late_ranks: 4,
            late_delay_ns: 100_000,
            cost: CostModel::default(),
            faults: Faults::default(),
            max_events: 100_000_000,
            max_virtual_ns: 100_000_000_000,
        }
    }

    pub fn world_size(&self) -> u32 {
        self.nodes * self.ranks_per_node
    }

    pub fn sp_count(&self) -> u32 {
        self.nodes * self.sps_per_node
    }
}

/// Key material: which buffer of which rank of which collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SimKey {
    pub op: u32,
    pub rank: Rank,
    pub send: bool,
}

/// Outcome of a successful run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimReport {
    pub seed: u64,
    pub world_size: u32,
    pub sps: u32,
    pub end_ns: Nanos,
    pub events: u64,
    pub messages: u64,
    pub copies: u64,
    pub bytes_copied_intra_node: u64,
    pub bytes_copied_inter_node: u64,
    /// Sum over ops of each rank's block size times (nodes - 1).
    pub min_inter_node_bytes: u64,
    pub max_in_flight: usize,
    /// Sum of every instance's counters (pass path, pending path, ...).
    pub stats: Stats,
    pub error_completions: u64,
    pub crashed_sps: Vec<SpId>,
    pub dead_ranks: Vec<u32>,
}

/// Run one simulation; `Err` carries the seed and what went wrong.
pub fn run(cfg: &SimConfig) -> Result<SimReport, SimFailure> {
    let mut sim = Sim::new(cfg)?;
    sim.run_events()?;
    sim.final_checks()?;
    Ok(sim.report())
}

struct Op {
    key: CollKey,
    send_buf: Vec<Vec<u8>>,
    recv_displs: Vec<Vec<u64>>,
    recv_buf: Vec<Vec<u8>>,
    post_ns: Vec<Option<Nanos>>,
    done: Vec<Option<(Nanos, Status)>>,
    disturbed: bool,
}

enum Input {
    Post {
        op: usize,
        rank: Rank,
    },
    Msg {
        from: SpId,
        op: usize,
        msg: Msg<SimKey>,
    },
    CopyDone {
        op: usize,
        copy: Copy<SimKey>,
    },
    PeerLost {
        lost: SpId,
    },
    RankLost {
        world: u32,
    },
}

enum Ev {
    Input { sp: SpId, input: Input },
    SpRun { sp: SpId },
    Crash { sp: SpId },
    RankDeath { world: u32 },
}

struct SpState {
    alive: bool,
    busy_until: Nanos,
    run_scheduled: bool,
    inbox: VecDeque<Input>,
    limiter: CopyLimiter<(usize, Copy<SimKey>)>,
    known_lost: BTreeSet<SpId>,
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    rng: Rng,
    now: Nanos,
    seq: u64,
    events: u64,
    queue: BTreeMap<(Nanos, u64), Ev>,
    sps: Vec<SpState>,
    ops: Vec<Op>,
    inst: BTreeMap<(SpId, usize), Allgatherv<SimKey>>,
    link_free: BTreeMap<(u32, u32), Nanos>,
    rank_node: Vec<u32>,
    rank_sp: Vec<SpId>,
    host_dead: Vec<bool>,
    crashed: Vec<SpId>,
    dead: Vec<u32>,
    messages: u64,
    copies: u64,
    bytes_intra: u64,
    bytes_inter: u64,
    max_in_flight: usize,
}

impl<'a> Sim<'a> {
    fn new(cfg: &'a SimConfig) -> Result<Sim<'a>, SimFailure> {
        if cfg.nodes == 0 || cfg.ranks_per_node == 0 || cfg.sps_per_node == 0 {
            return Err(SimFailure {
                seed: cfg.seed,
                what: "invalid config: nodes, ranks_per_node, sps_per_node must be > 0".into(),
            });
        }
        let mut setup = Rng::new(cfg.seed);
        let rng = setup.fork();
        let w = cfg.world_size();
        let (mut rank_node, mut rank_sp) = (Vec::new(), Vec::new());
        for r in 0..w {
            let (n, sp) = place_rank(
                cfg.layout,
                cfg.nodes,
                cfg.ranks_per_node,
                cfg.sps_per_node,
                r,
            );
            rank_node.push(n);
            rank_sp.push(sp);
        }
        let p = w as usize;
        let mut ops = Vec::new();
        for i in 0..cfg.ops as usize {
            let equal = setup.range(0, cfg.max_block_bytes);
            let counts: Vec<u64> = (0..p)
                .map(|_| {
                    if cfg.equal_counts {
                        equal
                    } else if setup.chance(cfg.zero_block_percent as u64, 100) {
                        0
                    } else {
                        setup.range(0, cfg.max_block_bytes)
                    }
                })
                .collect();
            let send_buf = (0..p)
                .map(|s| {
                    let base = splitmix64(cfg.seed ^ splitmix64(((i as u64) << 32) | s as u64));
                    (0..counts[s])
                        .map(|b| splitmix64(base.wrapping_add(b)) as u8)
                        .collect()
                })
                .collect();
            let mut recv_displs = Vec::new();
            let mut recv_buf = Vec::new();
            for _ in 0..p {
                let mut order: Vec<usize> = (0..p).collect();
                setup.shuffle(&mut order);
                let mut displs = vec![0; p];
                let mut at = 0;
                for s in order {
                    at += setup.range(0, 3);
                    displs[s] = at;
                    at += counts[s];
                }
                at += setup.range(0, 3);
                recv_displs.push(displs);
                recv_buf.push((0..at as usize).map(sentinel).collect());
            }
            ops.push(Op {
                key: CollKey {
                    job: 1,
                    comm: CommId { leader: 0, id: 0 },
                    seq: i as u64,
                },
                send_buf,
                recv_displs,
                recv_buf,
                post_ns: vec![None; p],
                done: vec![None; p],
                disturbed: false,
            });
        }
        let late: BTreeSet<u32> = {
            let mut all: Vec<u32> = (0..w).collect();
            setup.shuffle(&mut all);
            all.into_iter().take(cfg.late_ranks as usize).collect()
        };
        let sps = (0..cfg.sp_count())
            .map(|_| SpState {
                alive: true,
                busy_until: 0,
                run_scheduled: false,
                inbox: VecDeque::new(),
                limiter: CopyLimiter::new(cfg.max_inflight_reads),
                known_lost: BTreeSet::new(),
            })
            .collect();
        let mut sim = Sim {
            cfg,
            rng,
            now: 0,
            seq: 0,
            events: 0,
            queue: BTreeMap::new(),
            sps,
            ops,
            inst: BTreeMap::new(),
            link_free: BTreeMap::new(),
            rank_node,
            rank_sp,
            host_dead: vec![false; p],
            crashed: Vec::new(),
            dead: Vec::new(),
            messages: 0,
            copies: 0,
            bytes_intra: 0,
            bytes_inter: 0,
            max_in_flight: 0,
        };
        for op in 0..cfg.ops as usize {
            for r in 0..w {
                let late_ns = if late.contains(&r) {
                    cfg.late_delay_ns
                } else {
                    0
                };
                let t = op as Nanos * cfg.op_gap_ns + setup.range(0, cfg.arrival_skew_ns) + late_ns;
                let sp = sim.rank_sp[r as usize];
                sim.schedule(
                    t,
                    Ev::Input {
                        sp,
                        input: Input::Post { op, rank: r },
                    },
                );
            }
        }
        let crashes = (cfg.faults.sp_crashes as usize).min(cfg.sp_count() as usize - 1);
        let mut all_sps: Vec<SpId> = (0..cfg.sp_count()).collect();
        setup.shuffle(&mut all_sps);
        for &sp in all_sps.iter().take(crashes) {
            let t = setup.range(0, cfg.faults.crash_window_ns);
            sim.schedule(t, Ev::Crash { sp });
        }
        let mut all_ranks: Vec<u32> = (0..w).collect();
        setup.shuffle(&mut all_ranks);
        for &world in all_ranks.iter().take(cfg.faults.rank_deaths as usize) {
            let t = setup.range(0, cfg.faults.death_window_ns);
            sim.schedule(t, Ev::RankDeath { world });
        }
        Ok(sim)
    }

    fn fail(&self, what: impl Into<String>) -> SimFailure {
        SimFailure {
            seed: self.cfg.seed,
            what: format!("t={}ns: {}", self.now, what.into()),
        }
    }

    fn schedule(&mut self, at: Nanos, ev: Ev) {
        self.seq += 1;
        self.queue.insert((at, self.seq), ev);
    }

    fn sp_node(&self, sp: SpId) -> u32 {
        sp / self.cfg.sps_per_node
    }

    fn run_events(&mut self) -> Result<(), SimFailure> {
        while let Some(((t, _), ev)) = self.queue.pop_first() {
            self.now = t;
            self.events += 1;
            if self.events > self.cfg.max_events || t > self.cfg.max_virtual_ns {
                return Err(self.fail("no termination within the event/time bound"));
            }
            match ev {
                Ev::Input { sp, input } => {
                    if let Input::Post { rank, .. } = &input {
                        if self.host_dead[*rank as usize] {
                            continue;
                        }
                    }
                    let s = &mut self.sps[sp as usize];
                    if !s.alive {
                        continue;
                    }
                    s.inbox.push_back(input);
                    if !s.run_scheduled {
                        s.run_scheduled = true;
                        let at = s.busy_until.max(t);
                        self.schedule(at, Ev::SpRun { sp });
                    }
                }
                Ev::SpRun { sp } => {
                    let s = &mut self.sps[sp as usize];
                    s.run_scheduled = false;
                    if !s.alive {
                        continue;
                    }
                    let Some(input) = s.inbox.pop_front() else {
                        continue;
                    };
                    s.busy_until = t + self.cfg.cost.msg_proc_ns;
                    if !s.inbox.is_empty() {
                        s.run_scheduled = true;
                        let at = s.busy_until;
                        self.schedule(at, Ev::SpRun { sp });
                    }
                    self.process(sp, input)?;
                }
                Ev::Crash { sp } => {
                    let s = &mut self.sps[sp as usize];
                    s.alive = false;
                    s.inbox.clear();
                    s.limiter.clear_queued().for_each(drop);
                    self.crashed.push(sp);
                    for o in self.ops.iter_mut() {
                        o.disturbed = true;
                    }
                    let delay = self.cfg.faults.detect_delay_ns;
                    for other in 0..self.cfg.sp_count() {
                        if other != sp && self.sps[other as usize].alive {
                            let at = t + delay + self.rng.range(0, delay);
                            self.schedule(
                                at,
                                Ev::Input {
                                    sp: other,
                                    input: Input::PeerLost { lost: sp },
                                },
                            );
                        }
                    }
                }
                Ev::RankDeath { world } => {
                    self.host_dead[world as usize] = true;
                    self.dead.push(world);
                    for o in self.ops.iter_mut() {
                        if o.done[world as usize].is_none() {
                            o.disturbed = true;
                        }
                    }
                    let sp = self.rank_sp[world as usize];
                    self.schedule(
                        t,
                        Ev::Input {
                            sp,
                            input: Input::RankLost { world },
                        },
                    );
                }
            }
        }
        Ok(())
    }

    fn instance(&mut self, sp: SpId, op: usize) -> &mut Allgatherv<SimKey> {
        let key = self.ops[op].key;
        self.inst
            .entry((sp, op))
            .or_insert_with(|| Allgatherv::new(key, Config { me: sp }))
    }

    fn process(&mut self, sp: SpId, input: Input) -> Result<(), SimFailure> {
        let now = self.now;
        let mut touched = Vec::new();
        match input {
            Input::Post { op, rank } => {
                let o = &mut self.ops[op];
                let r = rank as usize;
                o.post_ns[r] = Some(now);
                let post = Post {
                    rank,
                    members: self.rank_sp.clone(),
                    nodes: self.rank_node.clone(),
                    send_key: SimKey {
                        op: op as u32,
                        rank,
                        send: true,
                    },
                    send_len: o.send_buf[r].len() as u64,
                    recv_key: SimKey {
                        op: op as u32,
                        rank,
                        send: false,
                    },
                    recv_counts: o.send_buf.iter().map(|b| b.len() as u64).collect(),
                    recv_displs: o.recv_displs[r].clone(),
                };
                if let Err(e) = self.instance(sp, op).handle_post(now, post) {
                    return Err(self.fail(format!("op {op} rank {rank}: post rejected: {e}")));
                }
                touched.push(op);
            }
            Input::Msg { from, op, msg } => {
                if self.sps[sp as usize].known_lost.contains(&from) {
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
            Input::CopyDone { op, copy } => {
                self.check_open(op, &copy, "finished")?;
                self.do_copy(op, &copy)?;
                self.sps[sp as usize].limiter.finished();
                self.instance(sp, op)
                    .handle_copy_done(now, copy.id, Status::Ok);
                touched.push(op);
            }
            Input::PeerLost { lost } => {
                self.sps[sp as usize].known_lost.insert(lost);
                for op in 0..self.ops.len() {
                    self.instance(sp, op).handle_peer_lost(now, lost);
                    touched.push(op);
                }
            }
            Input::RankLost { world } => {
                for op in 0..self.ops.len() {
                    self.instance(sp, op).handle_rank_lost(now, world);
                    touched.push(op);
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
        while let Some(action) = self.instance(sp, op).poll_action() {
            match action {
                Action::Send { to, msg } => {
                    if to == sp || to >= self.cfg.sp_count() {
                        return Err(self.fail(format!("op {op}: SP {sp} sent to SP {to}")));
                    }
                    self.messages += 1;
                    let link = (self.sp_node(sp), self.sp_node(to));
                    let c = &self.cfg.cost;
                    let (lat, bw) = if link.0 == link.1 {
                        (c.intra_node_latency_ns, c.intra_node_bytes_per_ns)
                    } else {
                        (c.inter_node_latency_ns, c.inter_node_bytes_per_ns)
                    };
                    let wire = c.msg_header_bytes + 48;
                    let free = self.link_free.entry(link).or_insert(0);
                    let departed = (*free).max(out) + wire.div_ceil(bw.max(1));
                    *free = departed;
                    let jitter = self.rng.range(0, self.cfg.faults.msg_jitter_ns);
                    self.schedule(
                        departed + lat + jitter,
                        Ev::Input {
                            sp: to,
                            input: Input::Msg { from: sp, op, msg },
                        },
                    );
                }
                Action::Copy(copy) => {
                    if self.rank_sp.get(copy.dst_rank as usize) != Some(&sp) {
                        return Err(self.fail(format!(
                            "op {op}: SP {sp} copies into rank {} it does not serve",
                            copy.dst_rank
                        )));
                    }
                    self.sps[sp as usize].limiter.push((op, copy));
                }
                Action::Complete { rank, status } => {
                    let r = rank as usize;
                    let o = &self.ops[op];
                    if self.rank_sp[r] != sp || o.post_ns[r].is_none() {
                        return Err(self.fail(format!(
                            "op {op}: SP {sp} completed rank {rank} (not its own or not posted)"
                        )));
                    }
                    if let Some((t, s)) = o.done[r] {
                        return Err(self.fail(format!(
                            "op {op}: rank {rank} completed twice (at {t}ns with {s}, now {status})"
                        )));
                    }
                    self.ops[op].done[r] = Some((out, status));
                }
            }
        }
        Ok(())
    }

    fn pump(&mut self, sp: SpId, at: Nanos) -> Result<(), SimFailure> {
        while let Some((op, copy)) = self.sps[sp as usize].limiter.pop_startable() {
            let lim = &self.sps[sp as usize].limiter;
            if lim.in_flight() > lim.max_inflight() {
                return Err(self.fail(format!("SP {sp}: {} copies in flight", lim.in_flight())));
            }
            self.max_in_flight = self.max_in_flight.max(lim.in_flight());
            self.check_copy(op, &copy)?;
            self.check_open(op, &copy, "started")?;
            let c = &self.cfg.cost;
            let (fixed, bw) = if self.rank_node[copy.src_rank as usize] == self.sp_node(sp) {
                (c.copy_fixed_intra_ns, c.intra_node_bytes_per_ns)
            } else {
                (c.copy_fixed_inter_ns, c.inter_node_bytes_per_ns)
            };
            let cost = fixed + copy.len.div_ceil(bw.max(1));
            self.schedule(
                at + cost,
                Ev::Input {
                    sp,
                    input: Input::CopyDone { op, copy },
                },
            );
        }
        Ok(())
    }

    /// Keys, segment and bounds: the source is segment `seg` either in the
    /// send buffer of `seg` or in the receive buffer of `src_rank`.
    fn check_copy(&self, op: usize, c: &Copy<SimKey>) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let p = o.send_buf.len();
        let bad = |what: &str| Err(self.fail(format!("op {op}: {what}: {c:?}")));
        if [c.seg, c.src_rank, c.dst_rank]
            .iter()
            .any(|&r| r as usize >= p)
        {
            return bad("rank out of range");
        }
        let from_send = c.src_key.send;
        if c.src_key.op != op as u32
            || c.src_key.rank != c.src_rank
            || (from_send && c.src_rank != c.seg)
            || c.dst_key
                != (SimKey {
                    op: op as u32,
                    rank: c.dst_rank,
                    send: false,
                })
        {
            return bad("wrong keys");
        }
        let s = c.seg as usize;
        let len = o.send_buf[s].len() as u64;
        let want_src = if from_send {
            0
        } else {
            o.recv_displs[c.src_rank as usize][s]
        };
        if c.len != len
            || c.src_offset != want_src
            || c.dst_offset != o.recv_displs[c.dst_rank as usize][s]
        {
            return bad("wrong offsets or length");
        }
        Ok(())
    }

    fn check_open(&self, op: usize, c: &Copy<SimKey>, when: &str) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        for (rank, what) in [(c.src_rank, "source"), (c.dst_rank, "receive")] {
            if let Some((t, _)) = o.done[rank as usize] {
                return Err(self.fail(format!(
                    "op {op}: copy {} {when} on the {what} buffer of rank {rank}, completed at {t}ns",
                    c.id.0
                )));
            }
        }
        Ok(())
    }

    fn do_copy(&mut self, op: usize, c: &Copy<SimKey>) -> Result<(), SimFailure> {
        self.check_copy(op, c)?;
        let o = &mut self.ops[op];
        let (so, d, len) = (c.src_offset as usize, c.dst_offset as usize, c.len as usize);
        let data: Vec<u8> = if c.src_key.send {
            o.send_buf[c.src_rank as usize][so..so + len].to_vec()
        } else {
            o.recv_buf[c.src_rank as usize][so..so + len].to_vec()
        };
        o.recv_buf[c.dst_rank as usize][d..d + len].copy_from_slice(&data);
        if self.rank_node[c.src_rank as usize] == self.rank_node[c.dst_rank as usize] {
            self.bytes_intra += c.len;
        } else {
            self.bytes_inter += c.len;
        }
        self.copies += 1;
        Ok(())
    }

    fn min_inter(&self) -> u64 {
        let nodes: BTreeSet<u32> = self.rank_node.iter().copied().collect();
        let others = nodes.len() as u64 - 1;
        self.ops
            .iter()
            .flat_map(|o| o.send_buf.iter())
            .map(|b| b.len() as u64 * others)
            .sum()
    }

    fn final_checks(&mut self) -> Result<(), SimFailure> {
        let crashed: BTreeSet<SpId> = self.crashed.iter().copied().collect();
        let mut any_disturbed = false;
        for (i, o) in self.ops.iter().enumerate() {
            any_disturbed |= o.disturbed;
            let p = o.send_buf.len();
            for r in 0..p {
                let sp = self.rank_sp[r];
                let exempt = crashed.contains(&sp) || (self.host_dead[r] && o.post_ns[r].is_none());
                let status = match o.done[r] {
                    Some((_, st)) => st,
                    None if exempt => {
                        self.check_recv(i, r, false)?;
                        continue;
                    }
                    None => {
                        let inst = self.inst.get(&(sp, i));
                        return Err(self.fail(format!(
                            "op {i} rank {r} (SP {sp}) never completed (posted {:?}; instance: {}) -- deadlock",
                            o.post_ns[r],
                            inst.map_or("none".into(), |a| format!(
                                "abort={:?} copies={} parked={} stats={:?}",
                                a.abort_status(),
                                a.copies_in_flight(),
                                a.parked(),
                                a.stats()
                            ))
                        )));
                    }
                };
                if !o.disturbed && !status.is_ok() {
                    return Err(self.fail(format!("op {i} rank {r}: {status} without a fault")));
                }
                self.check_recv(i, r, status.is_ok())?;
            }
        }
        for (&(sp, op), a) in &self.inst {
            if !crashed.contains(&sp) && a.members().is_some() && !a.is_finished() {
                return Err(self.fail(format!(
                    "op {op}: instance on live SP {sp} not finished at the end"
                )));
            }
        }
        if !any_disturbed && self.bytes_inter != self.min_inter() {
            return Err(self.fail(format!(
                "inter-node bytes {} != minimum {}",
                self.bytes_inter,
                self.min_inter()
            )));
        }
        Ok(())
    }

    fn check_recv(&self, op: usize, d: usize, exact: bool) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let buf = &o.recv_buf[d];
        let mut covered = vec![false; buf.len()];
        for (s, want) in o.send_buf.iter().enumerate() {
            let at = o.recv_displs[d][s] as usize;
            let got = &buf[at..at + want.len()];
            let right = got == &want[..];
            let untouched = got.iter().enumerate().all(|(i, &b)| b == sentinel(at + i));
            if !right && (exact || !untouched) {
                return Err(self.fail(format!(
                    "op {op}: rank {d}: block of rank {s} ({} bytes at {at}) is wrong (completed ok: {exact})",
                    want.len()
                )));
            }
            covered[at..at + want.len()]
                .iter_mut()
                .for_each(|c| *c = true);
        }
        if let Some(i) = (0..buf.len()).find(|&i| !covered[i] && buf[i] != sentinel(i)) {
            return Err(self.fail(format!(
                "op {op}: rank {d}: byte {i} outside every block was overwritten"
            )));
        }
        Ok(())
    }

    fn report(&self) -> SimReport {
        let mut stats = Stats::default();
        for a in self.inst.values() {
            let s = a.stats();
            stats.no_ready_rank += s.no_ready_rank;
            stats.served_after_pass += s.served_after_pass;
            stats.parked += s.parked;
            stats.parked_wait_ns += s.parked_wait_ns;
            stats.unknown_copy_done += s.unknown_copy_done;
            stats.ignored_from_lost_sp += s.ignored_from_lost_sp;
        }
        let done = self.ops.iter().flat_map(|o| o.done.iter()).flatten();
        SimReport {
            seed: self.cfg.seed,
            world_size: self.cfg.world_size(),
            sps: self.cfg.sp_count(),
            end_ns: done.clone().map(|&(t, _)| t).max().unwrap_or(0),
            events: self.events,
            messages: self.messages,
            copies: self.copies,
            bytes_copied_intra_node: self.bytes_intra,
            bytes_copied_inter_node: self.bytes_inter,
            min_inter_node_bytes: self.min_inter(),
            max_in_flight: self.max_in_flight,
            stats,
            error_completions: done.filter(|(_, s)| !s.is_ok()).count() as u64,
            crashed_sps: self.crashed.clone(),
            dead_ranks: self.dead.clone(),
        }
    }
}
