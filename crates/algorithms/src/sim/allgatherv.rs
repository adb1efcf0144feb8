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

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::driver::{self, Core, Ev};
use super::rng::{splitmix64, Rng};
pub use super::shared::SimKey;
use super::shared::{check_buffers_open, deliver, due_completion, world_key};
use super::{sentinel, Common, Outcome, SimFailure};
use crate::allgatherv::{Action, Allgatherv, Config, Copy, Msg, Own, Post, Stats};
use crate::{CollKey, Nanos, SpId, Status};

super::config::sim_faults!();

/// Everything a run depends on.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimConfig {
    #[serde(flatten)]
    pub common: Common,
    /// Per-rank block sizes uniform in `0..=max_block_bytes` ...
    pub max_block_bytes: u64,
    /// ... except this share (percent) forced to 0.
    pub zero_block_percent: u32,
    /// true: all blocks have the same size (Allgather).
    pub equal_counts: bool,
    pub faults: Faults,
}

impl SimConfig {
    /// [`Common::new`], blocks up to 64 bytes (10% empty), no faults.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            common: Common::new(seed),
            max_block_bytes: 64,
            zero_block_percent: 10,
            equal_counts: false,
            faults: Faults::default(),
        }
    }
}

/// Outcome of a successful run.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimReport {
    #[serde(flatten)]
    pub outcome: Outcome,
    pub end_ns: Nanos,
    /// The latest time a rank called the collective (its post reached its
    /// SP `cost.post_ns` later); `end_ns - last_arrival_ns` is the tail
    /// after the last arrival.
    pub last_arrival_ns: Nanos,
    pub copies: u64,
    pub bytes_copied_intra_node: u64,
    pub bytes_copied_inter_node: u64,
    /// Sum over ops of each rank's block size times (nodes - 1).
    pub min_inter_node_bytes: u64,
    /// Sum of every instance's counters (pass path, pending path, ...).
    pub stats: Stats,
}

super::config::sim_config! {
    config: [max_block_bytes, zero_block_percent, equal_counts], [], [];
    report:
        [end_ns, last_arrival_ns],
        [copies, bytes_copied_intra_node, bytes_copied_inter_node, min_inter_node_bytes],
        [stats],
        [];
}
super::config::world_schedule!();

/// One collective: every rank's block and receive buffer (also the
/// baseline's, [`super::host_ring`]).
pub(super) struct Op {
    key: CollKey,
    pub(super) send_buf: Vec<Vec<u8>>,
    pub(super) recv_displs: Vec<Vec<u64>>,
    pub(super) recv_buf: Vec<Vec<u8>>,
    post_ns: Vec<Option<Nanos>>,
    pub(super) done: Vec<Option<(Nanos, Status)>>,
    disturbed: bool,
}

/// The collectives of `cfg`: blocks and receive layouts drawn from `setup`
/// (the first draws of a run).
pub(super) fn make_ops(cfg: &SimConfig, setup: &mut Rng) -> Vec<Op> {
    let p = cfg.world_size() as usize;
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
            key: world_key(i),
            send_buf,
            recv_displs,
            recv_buf,
            post_ns: vec![None; p],
            done: vec![None; p],
            disturbed: false,
        });
    }
    ops
}

/// Whether rank `d`'s receive buffer of `o` is what native allgatherv
/// leaves (`exact`), or else every block right or untouched; and no byte
/// outside the blocks written.
pub(super) fn check_recv_of(o: &Op, op: usize, d: usize, exact: bool) -> Result<(), String> {
    let buf = &o.recv_buf[d];
    let mut covered = vec![false; buf.len()];
    for (s, want) in o.send_buf.iter().enumerate() {
        let at = o.recv_displs[d][s] as usize;
        let got = &buf[at..at + want.len()];
        let right = got == &want[..];
        let untouched = got.iter().enumerate().all(|(i, &b)| b == sentinel(at + i));
        if !right && (exact || !untouched) {
            return Err(format!(
                "op {op}: rank {d}: block of rank {s} ({} bytes at {at}) is wrong (completed ok: {exact})",
                want.len()
            ));
        }
        covered[at..at + want.len()]
            .iter_mut()
            .for_each(|c| *c = true);
    }
    if let Some(i) = (0..buf.len()).find(|&i| !covered[i] && buf[i] != sentinel(i)) {
        return Err(format!(
            "op {op}: rank {d}: byte {i} outside every block was overwritten"
        ));
    }
    Ok(())
}

type Input = driver::Input<(usize, Msg<SimKey>), Copy<SimKey>>;

struct Sim<'a> {
    cfg: &'a SimConfig,
    core: Core<(usize, Msg<SimKey>), Copy<SimKey>>,
    ops: Vec<Op>,
    inst: BTreeMap<(SpId, usize), Allgatherv<SimKey>>,
}

super::shared::world_collective!((usize, Msg<SimKey>), Copy<SimKey>);

impl<'a> Sim<'a> {
    fn new(cfg: &'a SimConfig) -> Result<Sim<'a>, SimFailure> {
        let (core, mut setup) = cfg.core()?;
        let ops = make_ops(cfg, &mut setup);
        let mut sim = Sim {
            cfg,
            core,
            ops,
            inst: BTreeMap::new(),
        };
        cfg.schedule_world(&mut sim.core, &mut setup);
        Ok(sim)
    }

    fn fail(&self, what: impl Into<String>) -> SimFailure {
        self.core.fail(what)
    }

    fn instance(&mut self, sp: SpId, op: usize) -> &mut Allgatherv<SimKey> {
        let key = self.ops[op].key;
        self.inst
            .entry((sp, op))
            .or_insert_with(|| Allgatherv::new(key, Config { me: sp }))
    }

    fn process_input(&mut self, sp: SpId, input: Input) -> Result<(), SimFailure> {
        let now = self.core.now;
        let mut touched = Vec::new();
        match input {
            Input::Post { op, rank } => {
                let o = &mut self.ops[op];
                let r = rank as usize;
                o.post_ns[r] = Some(now);
                let post = Post {
                    rank,
                    members: self.core.rank_sp.clone(),
                    send_key: SimKey::send(op, rank),
                    recv_key: SimKey::recv(op, rank),
                    recv_counts: o.send_buf.iter().map(|b| b.len() as u64).collect(),
                    recv_displs: o.recv_displs[r].clone(),
                    own: Own {
                        nodes: self.core.rank_node.clone(),
                        send_len: o.send_buf[r].len() as u64,
                    },
                };
                if let Err(e) = self.instance(sp, op).handle_post(now, post) {
                    return Err(self.fail(format!("op {op} rank {rank}: post rejected: {e}")));
                }
                touched.push(op);
            }
            Input::Msg {
                from,
                msg: (op, msg),
            } => {
                if self.core.sps[sp as usize].known_lost.contains(&from) {
                    return Ok(());
                }
                deliver(self.instance(sp, op), now, (op, sp, from), msg)
                    .map_err(|e| self.fail(e))?;
                touched.push(op);
            }
            Input::CopyDone { op, copy, .. } => {
                self.check_open(op, &copy, "finished")?;
                self.do_copy(op, &copy)?;
                self.core.sps[sp as usize].limiter.finished();
                self.instance(sp, op)
                    .handle_copy_done(now, copy.id, Status::Ok);
                touched.push(op);
            }
            Input::PeerLost { lost } => {
                self.core.sps[sp as usize].known_lost.insert(lost);
                for op in 0..self.ops.len() {
                    self.instance(sp, op).handle_peer_lost(now, lost);
                    touched.push(op);
                }
            }
            Input::Landed { op, .. } | Input::Timer { op } => {
                return Err(self.core.fail(format!("op {op}: no fabric or timers here")));
            }
            Input::RankLost { world } => {
                for op in 0..self.ops.len() {
                    self.instance(sp, op).handle_rank_lost(now, world);
                    touched.push(op);
                }
            }
        }
        self.finish_input(sp, now, touched)
    }

    crate::sim::shared::finish_input!();

    fn drain(&mut self, sp: SpId, op: usize, out: Nanos) -> Result<(), SimFailure> {
        while let Some(action) = self.instance(sp, op).poll_action() {
            match action {
                Action::Send { to, msg } => self.core.send(op, sp, to, 48, out, (op, msg))?,
                Action::Copy(copy) => {
                    if self.core.rank_sp.get(copy.dst_rank as usize) != Some(&sp) {
                        return Err(self.fail(format!(
                            "op {op}: SP {sp} copies into rank {} it does not serve",
                            copy.dst_rank
                        )));
                    }
                    self.core.sps[sp as usize].limiter.push((op, copy));
                }
                Action::Complete { rank, status } => {
                    let r = rank as usize;
                    let o = &self.ops[op];
                    self.core.check_completion(
                        (op, sp, rank),
                        status,
                        o.post_ns[r].is_some(),
                        o.done[r],
                        false,
                    )?;
                    self.ops[op].done[r] = Some((out, status));
                }
            }
        }
        Ok(())
    }

    fn pump(&mut self, sp: SpId, at: Nanos) -> Result<(), SimFailure> {
        while let Some((op, copy)) = self.core.next_copy(sp)? {
            self.check_copy(op, &copy)?;
            self.check_open(op, &copy, "started")?;
            let src_node = self.core.rank_node[copy.src_rank as usize];
            let cost = self.core.copy_cost(src_node, sp, copy.len);
            self.core.schedule(
                at + cost,
                Ev::Input {
                    sp,
                    input: Input::CopyDone {
                        op,
                        copy,
                        fail: false,
                    },
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
            || c.dst_key != SimKey::recv(op, c.dst_rank)
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
        let bufs = [(c.src_rank, "source"), (c.dst_rank, "receive")];
        check_buffers_open(&self.core, (op, c.id.0), bufs, &self.ops[op].done, when)
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
        self.core.count_copy(c.src_rank, c.dst_rank, c.len);
        Ok(())
    }

    fn min_inter(&self) -> u64 {
        let nodes: BTreeSet<u32> = self.core.rank_node.iter().copied().collect();
        let others = nodes.len() as u64 - 1;
        self.ops
            .iter()
            .flat_map(|o| o.send_buf.iter())
            .map(|b| b.len() as u64 * others)
            .sum()
    }

    fn final_checks(&mut self) -> Result<(), SimFailure> {
        let crashed: BTreeSet<SpId> = self.core.crashed.iter().copied().collect();
        let mut any_disturbed = false;
        for (i, o) in self.ops.iter().enumerate() {
            any_disturbed |= o.disturbed;
            let p = o.send_buf.len();
            for r in 0..p {
                let sp = self.core.rank_sp[r];
                let exempt =
                    crashed.contains(&sp) || (self.core.host_dead[r] && o.post_ns[r].is_none());
                let due = due_completion(
                    &self.core,
                    &self.inst,
                    (i, sp),
                    format_args!("op {i} rank {r} (SP {sp})"),
                    (o.done[r], exempt),
                    o.post_ns[r],
                )?;
                let Some((_, status)) = due else {
                    self.check_recv(i, r, false)?;
                    continue;
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
        if !any_disturbed && self.core.bytes_inter != self.min_inter() {
            return Err(self.fail(format!(
                "inter-node bytes {} != minimum {}",
                self.core.bytes_inter,
                self.min_inter()
            )));
        }
        Ok(())
    }

    fn check_recv(&self, op: usize, d: usize, exact: bool) -> Result<(), SimFailure> {
        check_recv_of(&self.ops[op], op, d, exact).map_err(|e| self.fail(e))
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
            outcome: self
                .core
                .outcome(done.clone().filter(|(_, s)| !s.is_ok()).count() as u64),
            end_ns: done.map(|&(t, _)| t).max().unwrap_or(0),
            last_arrival_ns: self.core.last_arrival_ns,
            copies: self.core.copies,
            bytes_copied_intra_node: self.core.bytes_intra,
            bytes_copied_inter_node: self.core.bytes_inter,
            min_inter_node_bytes: self.min_inter(),
            stats,
        }
    }
}
