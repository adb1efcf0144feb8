//! Deterministic simulation of ring `Ialltoallv` across a cluster of SPs.
//!
//! The simulator owns virtual time, an event queue, one
//! [`Alltoallv`](crate::alltoallv::Alltoallv) per (SP, collective) created on
//! the first event that concerns it, one [`CopyLimiter`] per SP, and real
//! (small) host buffers: every `Copy` really moves bytes, with bounds checks.
//! Checkers (all outside the algorithm):
//!
//! * every receive buffer matches a reference alltoallv computed from the
//!   send buffers, byte for byte, sentinel outside received blocks (ranks
//!   that completed with an error: every block is either right or untouched);
//! * each posted rank completes exactly once per instance, and only ranks
//!   that posted complete;
//! * no copy starts or finishes on a buffer whose rank already completed;
//! * the run ends within `max_events`/`max_virtual_ns`, and when the event
//!   queue drains every rank that can complete did (no deadlock); every
//!   instance on a live SP is `is_finished`;
//! * no `CopyLimiter` exceeds its bound; no `PostError`/`MsgError` occurs;
//! * fault-free collectives complete `Ok`; injected faults give the statuses
//!   they must give (count mismatch on both sides, copy errors on both
//!   sides, `PeerFailed`-type errors after an SP learned of a lost peer).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::driver::{self, run_events, Collective, Core, Params};
use super::rng::{splitmix64, Rng};
use super::{sentinel, SimFailure};
pub use super::{CostModel, Layout};
use crate::alltoallv::{Action, Alltoallv, Config, Copy, Msg, Post};

use crate::{CollKey, CommId, Nanos, Rank, SpId, Status};

/// Injected faults (all off by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Faults {
    /// Each message is delayed by an extra uniform `0..=msg_jitter_ns`
    /// (this reorders messages between a pair of SPs).
    pub msg_jitter_ns: Nanos,
    /// Number of SPs that crash (at least one SP always survives).
    pub sp_crashes: u32,
    /// Crashes happen at uniform times in `0..=crash_window_ns`.
    pub crash_window_ns: Nanos,
    /// Every other SP learns of a crash after `detect_delay_ns` plus a
    /// uniform `0..=detect_delay_ns`; messages from the crashed SP that
    /// arrive later are dropped.
    pub detect_delay_ns: Nanos,
    /// Number of host ranks that die; their SP gets `handle_rank_lost` for
    /// every collective the rank belongs to.
    pub rank_deaths: u32,
    /// Deaths happen at uniform times in `0..=death_window_ns`.
    pub death_window_ns: Nanos,
    /// Number of (collective, dst, src) receive counts made wrong on purpose.
    pub count_mismatches: u32,
    /// Probability (parts per million) that a copy fails with `AccessError`.
    pub copy_error_ppm: u32,
}

/// Everything a run depends on; the run is a pure function of this.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimConfig {
    pub seed: u64,
    pub nodes: u32,
    pub ranks_per_node: u32,
    /// SP of a rank = node * sps_per_node + local_rank % sps_per_node.
    pub sps_per_node: u32,
    pub layout: Layout,
    /// Copies in flight per SP (CopyLimiter bound; 0 is clamped to 1).
    pub max_inflight_reads: usize,
    /// Block sizes are uniform in `0..=max_block_bytes` ...
    pub max_block_bytes: u64,
    /// ... except that this share (percent) of blocks is forced to 0.
    pub zero_block_percent: u32,
    /// Number of collectives.
    pub ops: u32,
    /// true: each rank posts collective i at `i * op_gap_ns` + skew, without
    /// waiting (several outstanding at once); false: back to back, a rank
    /// posts the next one a skew after its previous one completed.
    pub overlap_ops: bool,
    pub op_gap_ns: Nanos,
    /// 0: every collective runs on the world communicator. k > 0: k random
    /// sub-communicators (random subset of world ranks, random comm-rank
    /// order); collective i runs on communicator `(i + 1) % (k + 1)` where
    /// 0 is the world.
    pub sub_comms: u32,
    /// Each post happens a uniform `0..=arrival_skew_ns` late.
    pub arrival_skew_ns: Nanos,
    /// Number of world ranks that are always `late_delay_ns` later.
    pub late_ranks: u32,
    pub late_delay_ns: Nanos,
    pub cost: CostModel,
    pub faults: Faults,
    /// The run fails if it processes more events than this ...
    pub max_events: u64,
    /// ... or virtual time passes this.
    pub max_virtual_ns: Nanos,
}

impl SimConfig {
    /// 8 nodes x 32 ranks, 4 SPs per node, block layout, tiny blocks, one
    /// collective, no faults.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            nodes: 8,
            ranks_per_node: 32,
            sps_per_node: 4,
            layout: Layout::Block,
            max_inflight_reads: 4,
            max_block_bytes: 64,
            zero_block_percent: 30,
            ops: 1,
            overlap_ops: true,
            op_gap_ns: 0,
            sub_comms: 0,
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

/// Key material in the simulation: which buffer of which rank of which
/// collective (checked on every copy, so a mixed-up instance is caught).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SimKey {
    pub op: u32,
    pub rank: Rank,
    pub send: bool,
}

/// Outcome of one collective.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpReport {
    pub key: CollKey,
    /// comm rank -> world rank.
    pub world_ranks: Vec<u32>,
    /// Virtual time each comm rank posted (None: never).
    pub post_ns: Vec<Option<Nanos>>,
    /// Virtual time each comm rank completed (None: never).
    pub completion_ns: Vec<Option<Nanos>>,
    pub status: Vec<Option<Status>>,
    /// Last completion of this collective.
    pub done_ns: Option<Nanos>,
}

/// Outcome of a successful (all checks passed) run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimReport {
    pub seed: u64,
    pub world_size: u32,
    pub sps: u32,
    pub ops: Vec<OpReport>,
    /// Last completion over all collectives.
    pub end_ns: Nanos,
    pub events: u64,
    /// SP-to-SP messages sent (deliveries inside one SP are not messages).
    pub messages: u64,
    pub copies: u64,
    pub bytes_copied_intra_node: u64,
    pub bytes_copied_inter_node: u64,
    /// Highest number of copies in flight observed on any SP.
    pub max_in_flight: usize,
    /// Announcements that arrived before their destination rank posted.
    pub late_announcements: u64,
    /// Completions with a status other than `Ok`.
    pub error_completions: u64,
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

// ---------------------------------------------------------------------------

struct Op {
    key: CollKey,
    world: Vec<u32>,
    members: Vec<SpId>,
    sps: BTreeSet<SpId>,
    send_counts: Vec<Vec<u64>>,
    send_displs: Vec<Vec<u64>>,
    recv_counts: Vec<Vec<u64>>,
    recv_displs: Vec<Vec<u64>>,
    send_buf: Vec<Vec<u8>>,
    recv_buf: Vec<Vec<u8>>,
    post_ns: Vec<Option<Nanos>>,
    done: Vec<Option<(Nanos, Status)>>,
    /// Ranks that must not complete Ok (count mismatch, failed copy).
    forced_error: BTreeSet<Rank>,
    /// Ranks that must complete with exactly `CountMismatch` if nothing
    /// else went wrong in this collective.
    mismatch: BTreeSet<Rank>,
    /// A fault other than a count mismatch touched this collective.
    disturbed: bool,
}

type Input = driver::Input<(CollKey, Msg<SimKey>), Copy<SimKey>>;
type Ev = driver::Ev<(CollKey, Msg<SimKey>), Copy<SimKey>>;

struct Sim<'a> {
    cfg: &'a SimConfig,
    core: Core<(CollKey, Msg<SimKey>), Copy<SimKey>>,
    ops: Vec<Op>,
    inst: BTreeMap<(SpId, usize), Alltoallv<SimKey>>,
    by_key: BTreeMap<CollKey, usize>,
    /// Per world rank: (op, comm rank) in op order.
    rank_ops: Vec<Vec<(usize, Rank)>>,
    late: Vec<bool>,
    /// (op, sp) pairs where the SP was told about a lost member SP.
    loss_notified: BTreeSet<(usize, SpId)>,
}

impl Collective for Sim<'_> {
    type Msg = (CollKey, Msg<SimKey>);
    type Copy = Copy<SimKey>;

    fn core(&mut self) -> &mut Core<Self::Msg, Self::Copy> {
        &mut self.core
    }

    fn world_of(&self, op: usize, rank: Rank) -> u32 {
        self.ops[op].world[rank as usize]
    }

    fn on_crash(&mut self, sp: SpId) {
        for op in self.ops.iter_mut() {
            if op.sps.contains(&sp) {
                op.disturbed = true;
            }
        }
    }

    fn on_rank_death(&mut self, world: u32) {
        for &(op, rank) in &self.rank_ops[world as usize] {
            let o = &mut self.ops[op];
            if o.done[rank as usize].is_none() {
                o.disturbed = true;
            }
        }
    }

    fn process(&mut self, sp: SpId, input: Input) -> Result<(), SimFailure> {
        self.process_input(sp, input)
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
        // Communicators: 0 is the world.
        let mut comms: Vec<Vec<u32>> = vec![(0..w).collect()];
        for _ in 0..cfg.sub_comms {
            let mut all: Vec<u32> = (0..w).collect();
            setup.shuffle(&mut all);
            let size = setup.range(2.min(w as u64), w as u64) as usize;
            all.truncate(size);
            comms.push(all);
        }
        let mut seqs = vec![0u64; comms.len()];
        let mut ops = Vec::new();
        let mut rank_ops = vec![Vec::new(); w as usize];
        for i in 0..cfg.ops as usize {
            let c = (i + 1) % comms.len();
            let world = comms[c].clone();
            let key = CollKey {
                job: 1,
                comm: CommId {
                    leader: *world.iter().min().expect("non-empty comm"),
                    id: c as u32,
                },
                seq: seqs[c],
            };
            seqs[c] += 1;
            for (cr, &wr) in world.iter().enumerate() {
                rank_ops[wr as usize].push((i, cr as Rank));
            }
            ops.push(Self::make_op(cfg, &mut setup, i, key, world, &core.rank_sp));
        }
        // Count mismatches.
        for _ in 0..cfg.faults.count_mismatches {
            if ops.is_empty() {
                break;
            }
            let i = setup.below(ops.len() as u64) as usize;
            let op = &mut ops[i];
            let p = op.world.len() as u64;
            let (d, s) = (setup.below(p) as usize, setup.below(p) as usize);
            let c = op.recv_counts[d][s];
            op.recv_counts[d][s] = if c > 0 && setup.chance(1, 2) {
                c - 1
            } else {
                c + 1
            };
            Self::layout_recv(&mut setup, op, d);
        }
        if cfg.faults.count_mismatches > 0 {
            // From the counts themselves: two changes of one block may cancel.
            for op in ops.iter_mut() {
                let p = op.world.len();
                for d in 0..p {
                    for s in 0..p {
                        if op.recv_counts[d][s] != op.send_counts[s][d] {
                            for r in [d as Rank, s as Rank] {
                                op.forced_error.insert(r);
                                op.mismatch.insert(r);
                            }
                        }
                    }
                }
            }
        }
        let late_set: BTreeSet<u32> = {
            let mut all: Vec<u32> = (0..w).collect();
            setup.shuffle(&mut all);
            all.into_iter().take(cfg.late_ranks as usize).collect()
        };
        let late = (0..w).map(|r| late_set.contains(&r)).collect();
        let mut sim = Sim {
            cfg,
            core,
            ops,
            inst: BTreeMap::new(),
            by_key: BTreeMap::new(),
            rank_ops,
            late,
            loss_notified: BTreeSet::new(),
        };
        sim.by_key = sim
            .ops
            .iter()
            .enumerate()
            .map(|(i, o)| (o.key, i))
            .collect();
        // Posts.
        for wr in 0..w {
            let mut last = 0;
            let list = sim.rank_ops[wr as usize].clone();
            for (k, &(op, rank)) in list.iter().enumerate() {
                if !cfg.overlap_ops && k > 0 {
                    break;
                }
                let base = if cfg.overlap_ops {
                    op as Nanos * cfg.op_gap_ns
                } else {
                    0
                };
                let t = (base + sim.post_delay(wr)).max(last);
                last = t;
                sim.core.schedule_post(t, wr, op, rank);
            }
        }
        // Faults.
        let f = &cfg.faults;
        sim.core.schedule_faults(
            &mut setup,
            (f.sp_crashes, f.crash_window_ns),
            (f.rank_deaths, f.death_window_ns),
        );
        Ok(sim)
    }

    fn make_op(
        cfg: &SimConfig,
        rng: &mut Rng,
        index: usize,
        key: CollKey,
        world: Vec<u32>,
        rank_sp: &[SpId],
    ) -> Op {
        let p = world.len();
        let members: Vec<SpId> = world.iter().map(|&w| rank_sp[w as usize]).collect();
        let mut send_counts = vec![vec![0u64; p]; p];
        for row in send_counts.iter_mut() {
            for c in row.iter_mut() {
                if !rng.chance(cfg.zero_block_percent as u64, 100) {
                    *c = rng.range(0, cfg.max_block_bytes);
                }
            }
        }
        let recv_counts: Vec<Vec<u64>> = (0..p)
            .map(|d| (0..p).map(|s| send_counts[s][d]).collect())
            .collect();
        let mut send_displs = Vec::with_capacity(p);
        let mut send_buf = Vec::with_capacity(p);
        for (s, counts) in send_counts.iter().enumerate() {
            let (displs, len) = Self::random_layout(rng, counts);
            let base = splitmix64(cfg.seed ^ splitmix64(((index as u64) << 32) | s as u64));
            send_buf.push(
                (0..len)
                    .map(|i| splitmix64(base.wrapping_add(i)) as u8)
                    .collect(),
            );
            send_displs.push(displs);
        }
        let mut op = Op {
            key,
            members: members.clone(),
            sps: members.iter().copied().collect(),
            world,
            send_counts,
            send_displs,
            recv_counts,
            recv_displs: vec![Vec::new(); p],
            send_buf,
            recv_buf: vec![Vec::new(); p],
            post_ns: vec![None; p],
            done: vec![None; p],
            forced_error: BTreeSet::new(),
            mismatch: BTreeSet::new(),
            disturbed: false,
        };
        for d in 0..p {
            Self::layout_recv(rng, &mut op, d);
        }
        op
    }

    /// Blocks in a random order with random gaps, plus random slack.
    fn random_layout(rng: &mut Rng, counts: &[u64]) -> (Vec<u64>, u64) {
        let mut order: Vec<usize> = (0..counts.len()).collect();
        rng.shuffle(&mut order);
        let mut displs = vec![0; counts.len()];
        let mut at = 0;
        for i in order {
            at += rng.range(0, 3);
            displs[i] = at;
            at += counts[i];
        }
        (displs, at + rng.range(0, 3))
    }

    fn layout_recv(rng: &mut Rng, op: &mut Op, d: usize) {
        let (displs, len) = Self::random_layout(rng, &op.recv_counts[d]);
        op.recv_displs[d] = displs;
        op.recv_buf[d] = (0..len as usize).map(sentinel).collect();
    }

    fn post_delay(&mut self, world: u32) -> Nanos {
        let late = if self.late[world as usize] {
            self.cfg.late_delay_ns
        } else {
            0
        };
        self.core.rng.range(0, self.cfg.arrival_skew_ns) + late
    }

    fn fail(&self, what: impl Into<String>) -> SimFailure {
        self.core.fail(what)
    }

    fn instance(&mut self, sp: SpId, op: usize) -> &mut Alltoallv<SimKey> {
        let key = self.ops[op].key;
        self.inst
            .entry((sp, op))
            .or_insert_with(|| Alltoallv::new(key, Config { me: sp }))
    }

    fn process_input(&mut self, sp: SpId, input: Input) -> Result<(), SimFailure> {
        let now = self.core.now;
        let mut touched: Vec<usize> = Vec::new();
        match input {
            Input::Post { op, rank } => {
                let o = &mut self.ops[op];
                let r = rank as usize;
                o.post_ns[r] = Some(now);
                let post = Post {
                    rank,
                    members: o.members.clone(),
                    send_key: SimKey {
                        op: op as u32,
                        rank,
                        send: true,
                    },
                    recv_key: SimKey {
                        op: op as u32,
                        rank,
                        send: false,
                    },
                    send_counts: o.send_counts[r].clone(),
                    send_displs: o.send_displs[r].clone(),
                    recv_counts: o.recv_counts[r].clone(),
                    recv_displs: o.recv_displs[r].clone(),
                };
                if let Err(e) = self.instance(sp, op).handle_post(now, post) {
                    return Err(self.fail(format!(
                        "op {op} rank {rank} on SP {sp}: post rejected: {e}"
                    )));
                }
                touched.push(op);
            }
            Input::Msg {
                from,
                msg: (key, msg),
            } => {
                // Demultiplex by CollKey, as the SP does.
                let Some(&op) = self.by_key.get(&key) else {
                    return Err(self.fail(format!("message for unknown collective {key:?}")));
                };
                if self.core.sps[sp as usize].known_lost.contains(&from) {
                    return Ok(()); // the connection to `from` is gone
                }
                let shown = msg.clone();
                if let Err(e) = self.instance(sp, op).handle_msg(now, from, msg) {
                    return Err(self.fail(format!(
                        "op {op}: SP {sp} rejected {shown:?} from SP {from}: {e}"
                    )));
                }
                touched.push(op);
            }
            Input::CopyDone { op, copy, fail } => {
                self.check_buffers_open(op, &copy, "finished")?;
                let status = if fail {
                    Status::AccessError
                } else {
                    self.do_copy(op, &copy)?;
                    Status::Ok
                };
                self.core.sps[sp as usize].limiter.finished();
                self.instance(sp, op).handle_copy_done(now, copy.id, status);
                touched.push(op);
            }
            Input::PeerLost { lost } => {
                self.core.sps[sp as usize].known_lost.insert(lost);
                for op in 0..self.ops.len() {
                    let o = &self.ops[op];
                    if o.sps.contains(&sp) && o.sps.contains(&lost) {
                        self.loss_notified.insert((op, sp));
                        self.instance(sp, op).handle_peer_lost(now, lost);
                        touched.push(op);
                    }
                }
            }
            Input::RankLost { world } => {
                for (op, rank) in self.rank_ops[world as usize].clone() {
                    self.instance(sp, op).handle_rank_lost(now, rank);
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
                    let (key, wire) = (self.ops[op].key, Self::msg_bytes(&msg));
                    self.core.send(op, sp, to, wire, out, (key, msg))?;
                }
                Action::Copy(copy) => {
                    let o = &self.ops[op];
                    if o.members.get(copy.dst_rank as usize) != Some(&sp) {
                        return Err(self.fail(format!(
                            "op {op}: SP {sp} emitted a copy into rank {} it does not serve",
                            copy.dst_rank
                        )));
                    }
                    self.core.sps[sp as usize].limiter.push((op, copy));
                }
                Action::Complete { rank, status } => self.complete(sp, op, rank, status, out)?,
            }
        }
        Ok(())
    }

    /// Size of the message's fields on the wire (the SimKey standing in for
    /// a 16-byte remote key descriptor).
    fn msg_bytes(msg: &Msg<SimKey>) -> u64 {
        match msg {
            Msg::Announce { .. } => 4 + 4 + 16 + 8 + 8,
            Msg::Ack { .. } => 4 + 4 + 1,
            Msg::Abort { .. } => 1,
        }
    }

    fn complete(
        &mut self,
        sp: SpId,
        op: usize,
        rank: Rank,
        status: Status,
        at: Nanos,
    ) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let r = rank as usize;
        if o.members.get(r) != Some(&sp) {
            return Err(self.fail(format!(
                "op {op}: SP {sp} completed rank {rank} it does not serve"
            )));
        }
        if o.post_ns[r].is_none() {
            return Err(self.fail(format!("op {op}: rank {rank} completed without posting")));
        }
        if let Some((t, s)) = o.done[r] {
            return Err(self.fail(format!(
                "op {op}: rank {rank} completed twice (first at {t}ns with {s}, now {status})"
            )));
        }
        let w = o.world[r];
        self.ops[op].done[r] = Some((at, status));
        if status.is_ok() && self.loss_notified.contains(&(op, sp)) {
            return Err(self.fail(format!(
                "op {op}: rank {rank} completed Ok after SP {sp} learned of a lost peer"
            )));
        }
        // Back to back: the host posts its next collective.
        if !self.cfg.overlap_ops && !self.core.host_dead[w as usize] {
            let list = &self.rank_ops[w as usize];
            if let Some(k) = list.iter().position(|&(i, _)| i == op) {
                if let Some(&(next, next_rank)) = list.get(k + 1) {
                    let t = at + self.post_delay(w);
                    self.core.schedule_post(t, w, next, next_rank);
                }
            }
        }
        Ok(())
    }

    /// Start every copy the SP's limiter admits.
    fn pump(&mut self, sp: SpId, at: Nanos) -> Result<(), SimFailure> {
        while let Some((op, copy)) = self.core.next_copy(sp)? {
            self.check_copy(op, &copy)?;
            self.check_buffers_open(op, &copy, "started")?;
            let src_world = self.ops[op].world[copy.src_rank as usize];
            let src_node = self.core.rank_node[src_world as usize];
            let cost = self.core.copy_cost(src_node, sp, copy.len);
            let ppm = self.cfg.faults.copy_error_ppm as u64;
            let fail = ppm > 0 && self.core.rng.chance(ppm, 1_000_000);
            if fail {
                let o = &mut self.ops[op];
                o.disturbed = true;
                o.forced_error.insert(copy.src_rank);
                o.forced_error.insert(copy.dst_rank);
            }
            self.core.schedule(
                at + cost,
                Ev::Input {
                    sp,
                    input: Input::CopyDone { op, copy, fail },
                },
            );
        }
        Ok(())
    }

    /// Keys, ranks and bounds of a copy.
    fn check_copy(&self, op: usize, c: &Copy<SimKey>) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let p = o.world.len();
        if c.src_rank as usize >= p || c.dst_rank as usize >= p {
            return Err(self.fail(format!("op {op}: copy with rank out of range: {c:?}")));
        }
        let want_src = SimKey {
            op: op as u32,
            rank: c.src_rank,
            send: true,
        };
        let want_dst = SimKey {
            op: op as u32,
            rank: c.dst_rank,
            send: false,
        };
        if c.src_key != want_src || c.dst_key != want_dst {
            return Err(self.fail(format!("op {op}: copy with foreign keys: {c:?}")));
        }
        let src_len = o.send_buf[c.src_rank as usize].len() as u64;
        let dst_len = o.recv_buf[c.dst_rank as usize].len() as u64;
        let src_ok = c
            .src_offset
            .checked_add(c.len)
            .is_some_and(|e| e <= src_len);
        let dst_ok = c
            .dst_offset
            .checked_add(c.len)
            .is_some_and(|e| e <= dst_len);
        if !src_ok || !dst_ok {
            return Err(self.fail(format!(
                "op {op}: copy out of bounds (send buffer {src_len} bytes, receive buffer {dst_len} bytes): {c:?}"
            )));
        }
        Ok(())
    }

    fn check_buffers_open(
        &self,
        op: usize,
        c: &Copy<SimKey>,
        when: &str,
    ) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        for (rank, what) in [(c.src_rank, "send"), (c.dst_rank, "receive")] {
            if let Some((t, _)) = o.done[rank as usize] {
                return Err(self.fail(format!(
                    "op {op}: copy {} {when} on the {what} buffer of rank {rank}, which completed at {t}ns",
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
        let src = &o.send_buf[c.src_rank as usize][so..so + len];
        o.recv_buf[c.dst_rank as usize][d..d + len].copy_from_slice(src);
        let (src, dst) = (o.world[c.src_rank as usize], o.world[c.dst_rank as usize]);
        self.core.count_copy(src, dst, c.len);
        Ok(())
    }

    fn final_checks(&mut self) -> Result<(), SimFailure> {
        let crashed: BTreeSet<SpId> = self.core.crashed.iter().copied().collect();
        for (i, o) in self.ops.iter().enumerate() {
            let p = o.world.len();
            for r in 0..p {
                let w = o.world[r];
                let sp = o.members[r];
                let what = format!("op {i} ({:?}) rank {r} (world {w}, SP {sp})", o.key);
                // A rank of a crashed SP may never complete; a dead host
                // that never posted has nothing to complete.
                let exempt = crashed.contains(&sp)
                    || (self.core.host_dead[w as usize] && o.post_ns[r].is_none());
                let status = match o.done[r] {
                    Some((_, st)) => st,
                    None if exempt => {
                        self.check_recv_buffer(i, r, false)?;
                        continue;
                    }
                    None => {
                        let inst = self.inst.get(&(sp, i));
                        return Err(self.fail(format!(
                            "{what} never completed (posted: {:?}, instance: {}) -- deadlock",
                            o.post_ns[r],
                            inst.map_or("none".to_string(), |a| format!(
                                "abort={:?} copies_in_flight={} stats={:?}",
                                a.abort_status(),
                                a.copies_in_flight(),
                                a.stats()
                            )),
                        )));
                    }
                };
                let rank = r as Rank;
                let expected = if o.disturbed {
                    None // anything, but see forced_error below
                } else if o.mismatch.contains(&rank) {
                    Some(Status::CountMismatch)
                } else {
                    Some(Status::Ok)
                };
                if expected.is_some_and(|e| e != status) {
                    return Err(self.fail(format!(
                        "{what}: {status}, expected {} (mismatched ranks: {:?})",
                        expected.unwrap_or(Status::Ok),
                        o.mismatch
                    )));
                }
                if status.is_ok() && o.forced_error.contains(&rank) {
                    return Err(self.fail(format!("{what}: Ok despite a fault on its blocks")));
                }
                let exact = matches!(o.done[r], Some((_, Status::Ok)));
                self.check_recv_buffer(i, r, exact)?;
            }
        }
        for (&(sp, op), a) in &self.inst {
            if crashed.contains(&sp) {
                continue;
            }
            if a.members().is_some() && !a.is_finished() {
                return Err(self.fail(format!(
                    "op {op}: instance on live SP {sp} is not finished at the end"
                )));
            }
        }
        Ok(())
    }

    /// Compare a receive buffer with the reference alltoallv. `exact`:
    /// every block must be right; otherwise each block must be either right
    /// or untouched. Bytes outside blocks must keep the sentinel.
    fn check_recv_buffer(&self, op: usize, d: usize, exact: bool) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let buf = &o.recv_buf[d];
        let mut covered = vec![false; buf.len()];
        for s in 0..o.world.len() {
            let len = o.recv_counts[d][s] as usize;
            let at = o.recv_displs[d][s] as usize;
            let got = &buf[at..at + len];
            let matches = o.send_counts[s][d] as usize == len;
            let expected = if matches {
                let so = o.send_displs[s][d] as usize;
                Some(&o.send_buf[s][so..so + len])
            } else {
                None
            };
            let right = expected.is_some_and(|e| e == got);
            let untouched = got.iter().enumerate().all(|(i, &b)| b == sentinel(at + i));
            if exact && !right {
                return Err(self.fail(format!(
                    "op {op}: rank {d} completed Ok but its block from rank {s} ({len} bytes at {at}) is wrong"
                )));
            }
            if !right && !untouched {
                return Err(self.fail(format!(
                    "op {op}: rank {d}: block from rank {s} ({len} bytes at {at}) is neither right nor untouched"
                )));
            }
            covered[at..at + len].iter_mut().for_each(|c| *c = true);
        }
        if let Some(i) = (0..buf.len()).find(|&i| !covered[i] && buf[i] != sentinel(i)) {
            return Err(self.fail(format!(
                "op {op}: rank {d}: byte {i} outside every block was overwritten"
            )));
        }
        Ok(())
    }

    fn report(&self) -> SimReport {
        let ops: Vec<OpReport> = self
            .ops
            .iter()
            .map(|o| OpReport {
                key: o.key,
                world_ranks: o.world.clone(),
                post_ns: o.post_ns.clone(),
                completion_ns: o.done.iter().map(|d| d.map(|(t, _)| t)).collect(),
                status: o.done.iter().map(|d| d.map(|(_, s)| s)).collect(),
                done_ns: o.done.iter().filter_map(|d| d.map(|(t, _)| t)).max(),
            })
            .collect();
        let error_completions = self
            .ops
            .iter()
            .flat_map(|o| o.done.iter())
            .filter(|d| matches!(d, Some((_, s)) if !s.is_ok()))
            .count() as u64;
        SimReport {
            seed: self.cfg.seed,
            world_size: self.cfg.world_size(),
            sps: self.cfg.sp_count(),
            end_ns: ops.iter().filter_map(|o| o.done_ns).max().unwrap_or(0),
            ops,
            events: self.core.events,
            messages: self.core.messages,
            copies: self.core.copies,
            bytes_copied_intra_node: self.core.bytes_intra,
            bytes_copied_inter_node: self.core.bytes_inter,
            max_in_flight: self.core.max_in_flight,
            late_announcements: self
                .inst
                .values()
                .map(|a| a.stats().late_announcements)
                .sum(),
            error_completions,
            crashed_sps: self.core.crashed.clone(),
            dead_ranks: self.core.dead.clone(),
        }
    }
}
