//! Deterministic simulation of the staged [`Bcast`] on
//! the world communicator, flat or hierarchical.
//!
//! Shares placement, cost model, generator and the event driver with the
//! other simulators. Real bytes everywhere: every rank's buffer, the root's
//! data, each SP's region of its node segment (hierarchical) and each SP's staging slots
//! are byte vectors, and every `Copy` and `Move` really moves bytes. A move
//! takes the directed node link (in turn with messages) and its `Chunk`
//! message arrives with the last byte; copies go through the SP's
//! [`CopyLimiter`](crate::sched::CopyLimiter) and cost what
//! [`CostModel`] says for a copy within the node. A `from_segment`
//! completion is the host's copy out of the segment, done at completion
//! time (and costed in `SimReport::end_ns`).
//!
//! Checkers (all outside the algorithm):
//! * every rank that completes `Ok` holds the root's bytes exactly, and its
//!   post agrees with the root's (root and length) (with injected
//!   inconsistent posts: with those of the rank it names as root, which
//!   must name itself); bytes past the message are never touched; the root's buffer is never written; fault-free
//!   collectives complete `Ok` everywhere (`from_segment` exactly for the
//!   hierarchical non-root ranks, each reading the region its node's leader
//!   wrote, at the place the leader's driver gave it);
//! * each posted rank completes exactly once, by its own SP; a rank never
//!   completes `Ok` after its SP learned of a fault touching the collective
//!   (peer loss, loss of a rank that had not completed, an `Abort`);
//! * no copy starts or finishes on the buffer of a rank that completed (so
//!   the root's buffer is not read after the root completed), and no
//!   segment write starts or finishes after a rank of the node completed
//!   `from_segment` out of that region;
//! * staging: every slot id is below `staging_slots`; a slot is never
//!   written (read from the root, or filled by a move) while anything else
//!   reads or writes it, and never read while it is written; each SP's
//!   `max_slots_in_use` stays within the bound;
//! * shape: reads only from the buffer of a rank that named itself root, on
//!   its SP; writes only into the SP's own ranks at `chunk * chunk_bytes`;
//!   hierarchical writes only by node leaders, through the shared key of
//!   the SP's lowest non-root rank (the root's if it is the SP's only rank
//!   and the node has other SPs); moves only to the SP's children in the
//!   tree (the SPs grouped by node: the root's node first, its SPs from the
//!   root's SP on, then the other nodes in ring order; a node's first SP is
//!   its leader, whose children are the next node's leader and, flat, its
//!   own node's other SPs);
//! * the run ends within the event/time bound, every posted rank of a live
//!   SP completes, every instance of a live SP that saw a post is finished;
//! * fault-free: exactly `len * (nodes - 1)` bytes cross node boundaries
//!   (each chunk crosses each boundary once), one move per chunk per tree
//!   edge (hierarchical: per edge between leaders), each chunk written once
//!   per target (hierarchical: once per node, into the leader's region),
//!   one `Sealed` per non-leader SP (hierarchical).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::driver::{self, run_events, Collective, Core, Ev, Params};
use super::rng::splitmix64;
use super::{sentinel, CostModel, Layout, SimFailure};
use crate::bcast::{Action, Bcast, Config, Copy, Design, Loc, Move, Msg, Post, Stats};
use crate::{CollKey, CommId, Nanos, Rank, SpId, Status};

/// Untouched bytes after the message in every buffer and segment.
const PAD: usize = 3;

/// Injected faults (all off by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Faults {
    /// Extra uniform `0..=msg_jitter_ns` per message (chunks included).
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
    /// Probability (parts per million) that a copy or a move fails with
    /// `AccessError`.
    pub copy_error_ppm: u32,
    /// Non-root (collective, rank) posts made inconsistent on purpose: a
    /// length off by one or another root (possibly the rank itself).
    pub inconsistent_posts: u32,
    /// The root of every collective dies before posting (nobody can
    /// complete `Ok`).
    pub kill_roots: bool,
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
    pub design: Design,
    pub chunk_bytes: u64,
    pub staging_slots: u32,
    /// Root of every collective; `None`: uniform per collective.
    pub root: Option<Rank>,
    /// Message length of every collective; `None`: per collective 0 or 1
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
    /// 4 nodes x 8 ranks, 2 SPs per node, block layout, flat, 16-byte
    /// chunks, 3 slots, random roots and lengths up to 100 bytes, two
    /// collectives, no faults.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            nodes: 4,
            ranks_per_node: 8,
            sps_per_node: 2,
            layout: Layout::Block,
            max_inflight_reads: 4,
            design: Design::Flat,
            chunk_bytes: 16,
            staging_slots: 3,
            root: None,
            len_bytes: None,
            max_len_bytes: 100,
            ops: 2,
            op_gap_ns: 2_000,
            arrival_skew_ns: 20_000,
            late_ranks: 2,
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

/// Key material: a rank's buffer, or the segment it can read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SimKey {
    pub op: u32,
    pub rank: Rank,
    pub shared: bool,
}

/// Outcome of a successful run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimReport {
    pub seed: u64,
    pub world_size: u32,
    pub sps: u32,
    /// Latest time a rank had the message in its own buffer: its
    /// completion, plus the host's copy out of the segment for
    /// `from_segment` completions.
    pub end_ns: Nanos,
    /// Latest completion emitted by an SP.
    pub sp_end_ns: Nanos,
    pub events: u64,
    pub messages: u64,
    pub moves: u64,
    pub copies: u64,
    pub bytes_moved_inter_node: u64,
    pub bytes_moved_intra_node: u64,
    /// Sum over collectives of `len * (nodes - 1)`.
    pub min_inter_node_bytes: u64,
    /// Bytes copied by SPs (reads from roots, writes to buffers/segments).
    pub bytes_copied: u64,
    pub max_in_flight: usize,
    /// Instance counters summed (`max_slots_in_use`: the maximum).
    pub stats: Stats,
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

/// A staging slot as the simulator sees it.
#[derive(Clone, Debug, Default)]
struct Shadow {
    data: Vec<u8>,
    readers: u32,
    writers: u32,
}

#[derive(Clone, Copy, Debug)]
struct Done {
    at: Nanos,
    status: Status,
    from_segment: bool,
    /// When the data is in the rank's own buffer.
    host_at: Nanos,
}

struct Op {
    key: CollKey,
    root: Rank,
    len: u64,
    n: u64,
    /// The SPs grouped by node, in tree order.
    tree: Vec<Vec<SpId>>,
    data: Vec<u8>,
    post_len: Vec<u64>,
    post_root: Vec<Rank>,
    inconsistent: bool,
    buf: Vec<Vec<u8>>,
    /// Per SP: its region of the node segment (hierarchical).
    seg: Vec<Vec<u8>>,
    /// Per SP: first `from_segment` completion out of its region.
    seg_sealed: Vec<Option<Nanos>>,
    seg_writes: Vec<u64>,
    buf_writes: Vec<u64>,
    staging: BTreeMap<SpId, Vec<Shadow>>,
    post_ns: Vec<Option<Nanos>>,
    done: Vec<Option<Done>>,
    disturbed: bool,
    /// SPs that learned of a fault touching this collective.
    notified: BTreeSet<SpId>,
    moves: u64,
    bytes_inter: u64,
    bytes_intra: u64,
}

/// A copy or a move in the driver's hands.
#[derive(Clone, Debug)]
enum Work {
    Copy(Copy<SimKey>),
    Move(Move),
}

/// A message with the bytes a `Chunk` carries.
type Env = (usize, Msg, Vec<u8>);
type Input = driver::Input<Env, Work>;

struct Sim<'a> {
    cfg: &'a SimConfig,
    core: Core<Env, Work>,
    ops: Vec<Op>,
    inst: BTreeMap<(SpId, usize), Bcast<SimKey>>,
    /// SPs serving at least one rank.
    member_sps: BTreeSet<SpId>,
    /// Per SP: its ranks, ascending.
    local: BTreeMap<SpId, Vec<Rank>>,
    bytes_copied: u64,
}

impl Collective for Sim<'_> {
    type Msg = Env;
    type Copy = Work;

    fn core(&mut self) -> &mut Core<Env, Work> {
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

    fn over_budget(core: &Core<Env, Work>) -> SimFailure {
        core.fail("no termination within the event/time bound")
    }
}

/// The tree the simulator expects (computed here independently of the
/// algorithm), as groups per node: the root's node first with the root's SP
/// leading and the node's other SPs in id order after it, then the other
/// nodes in ring order with their SPs in id order.
fn expected_tree(rank_sp: &[SpId], rank_node: &[u32], root: Rank) -> Vec<Vec<SpId>> {
    let mut by_node: BTreeMap<u32, BTreeSet<SpId>> = BTreeMap::new();
    for (&sp, &n) in rank_sp.iter().zip(rank_node) {
        by_node.entry(n).or_default().insert(sp);
    }
    let (rsp, rnode) = (rank_sp[root as usize], rank_node[root as usize]);
    let mut first: Vec<SpId> = by_node[&rnode]
        .iter()
        .copied()
        .filter(|&s| s >= rsp)
        .collect();
    first.extend(by_node[&rnode].iter().copied().filter(|&s| s < rsp));
    let nodes: Vec<u32> = by_node.keys().copied().collect();
    let at = nodes.iter().position(|&n| n == rnode).unwrap();
    let mut tree = vec![first];
    for k in 1..nodes.len() {
        tree.push(
            by_node[&nodes[(at + k) % nodes.len()]]
                .iter()
                .copied()
                .collect(),
        );
    }
    tree
}

/// The SPs `sp` may move chunks to in `tree`: for a node's leader, the next
/// node's leader and its own node's other SPs; nobody for the others.
fn tree_children(tree: &[Vec<SpId>], sp: SpId) -> Vec<SpId> {
    let Some(g) = tree.iter().position(|grp| grp[0] == sp) else {
        return Vec::new();
    };
    let mut out: Vec<SpId> = tree.get(g + 1).map(|n| n[0]).into_iter().collect();
    out.extend(&tree[g][1..]);
    out
}

impl<'a> Sim<'a> {
    fn new(cfg: &'a SimConfig) -> Result<Sim<'a>, SimFailure> {
        let (mut core, mut setup) = Core::new(Params {
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
        if cfg.root.is_some_and(|r| r >= w) {
            return Err(core.fail("root out of range"));
        }
        let mut local: BTreeMap<SpId, Vec<Rank>> = BTreeMap::new();
        for r in 0..w {
            local.entry(core.rank_sp[r as usize]).or_default().push(r);
        }
        let sp_count = cfg.sp_count() as usize;
        let mut ops = Vec::new();
        for i in 0..cfg.ops as usize {
            let root = cfg.root.unwrap_or_else(|| setup.below(w as u64) as Rank);
            let len = cfg.len_bytes.unwrap_or_else(|| {
                let pick = setup.below(100);
                if pick < 10 {
                    0
                } else if pick < 20 {
                    1
                } else if pick < 35 {
                    chunk * setup.range(1, 4)
                } else {
                    setup.range(0, cfg.max_len_bytes)
                }
            });
            let base = splitmix64(cfg.seed ^ splitmix64(i as u64 + 1));
            let data: Vec<u8> = (0..len)
                .map(|b| splitmix64(base.wrapping_add(b)) as u8)
                .collect();
            let n = if len == 0 { 1 } else { len.div_ceil(chunk) };
            ops.push(Op {
                key: CollKey {
                    job: 1,
                    comm: CommId { leader: 0, id: 0 },
                    seq: i as u64,
                },
                root,
                len,
                n,
                tree: expected_tree(&core.rank_sp, &core.rank_node, root),
                data,
                post_len: vec![len; p],
                post_root: vec![root; p],
                inconsistent: false,
                buf: Vec::new(),
                seg: vec![Vec::new(); sp_count],
                seg_sealed: vec![None; sp_count],
                seg_writes: vec![0; sp_count],
                buf_writes: vec![0; p],
                staging: BTreeMap::new(),
                post_ns: vec![None; p],
                done: vec![None; p],
                disturbed: false,
                notified: BTreeSet::new(),
                moves: 0,
                bytes_inter: 0,
                bytes_intra: 0,
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
        let longest = ops
            .iter()
            .flat_map(|o| o.post_len.iter())
            .max()
            .map_or(0, |&l| l as usize + PAD);
        let fresh: Vec<u8> = (0..longest).map(sentinel).collect();
        for o in ops.iter_mut() {
            o.buf = (0..p)
                .map(|r| {
                    let mut b = fresh[..o.post_len[r] as usize + PAD].to_vec();
                    if r == o.root as usize {
                        b[..o.len as usize].copy_from_slice(&o.data);
                    }
                    b
                })
                .collect();
            if cfg.design == Design::Hier {
                let longest = o.post_len.iter().copied().max().unwrap_or(0).max(o.len);
                for (&sp, _) in local.iter() {
                    o.seg[sp as usize] = fresh[..longest as usize + PAD].to_vec();
                }
            }
        }
        if cfg.faults.kill_roots {
            // Scheduled before the posts: processed first at time 0.
            let roots: BTreeSet<Rank> = ops.iter().map(|o| o.root).collect();
            for world in roots {
                core.schedule(0, Ev::RankDeath { world });
            }
        }
        let mut sim = Sim {
            cfg,
            core,
            ops,
            inst: BTreeMap::new(),
            member_sps: local.keys().copied().collect(),
            local,
            bytes_copied: 0,
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

    fn instance(&mut self, sp: SpId, op: usize) -> &mut Bcast<SimKey> {
        let key = self.ops[op].key;
        let cfg = Config {
            me: sp,
            chunk_bytes: self.cfg.chunk_bytes,
            staging_slots: self.cfg.staging_slots,
        };
        self.inst
            .entry((sp, op))
            .or_insert_with(|| Bcast::new(key, cfg))
    }

    fn slots(&self) -> usize {
        self.cfg.staging_slots.max(1) as usize
    }

    fn shadow(&mut self, op: usize, sp: SpId, slot: u32) -> Result<&mut Shadow, SimFailure> {
        let size = self.cfg.chunk_bytes.max(1) as usize;
        let fresh = || Shadow {
            data: vec![0xEE; size],
            ..Shadow::default()
        };
        let slots = self.slots();
        let staging = &mut self.ops[op].staging;
        self.core
            .staging_slot(staging, (op, sp, slot), slots, fresh)
    }

    /// Start writing slot `slot` of `sp` (nothing else may touch it).
    fn begin_write(
        &mut self,
        op: usize,
        sp: SpId,
        slot: u32,
        what: &str,
    ) -> Result<(), SimFailure> {
        let s = self.shadow(op, sp, slot)?;
        if s.readers > 0 || s.writers > 0 {
            let (r, w) = (s.readers, s.writers);
            return Err(self.fail(format!(
                "op {op}: {what} writes staging slot {slot} of SP {sp} while {r} reads and {w} writes are in flight on it"
            )));
        }
        s.writers = 1;
        Ok(())
    }

    /// Start reading slot `slot` of `sp` (no write may be in flight).
    fn begin_read(&mut self, op: usize, sp: SpId, slot: u32, what: &str) -> Result<(), SimFailure> {
        let s = self.shadow(op, sp, slot)?;
        if s.writers > 0 {
            return Err(self.fail(format!(
                "op {op}: {what} reads staging slot {slot} of SP {sp} while it is being written"
            )));
        }
        s.readers += 1;
        Ok(())
    }

    fn process_input(&mut self, sp: SpId, input: Input) -> Result<(), SimFailure> {
        let now = self.core.now;
        let mut touched = Vec::new();
        match input {
            Input::Post { op, rank } => {
                let o = &mut self.ops[op];
                let r = rank as usize;
                o.post_ns[r] = Some(now);
                let design = self.cfg.design;
                let key = |shared| SimKey {
                    op: op as u32,
                    rank,
                    shared,
                };
                let post = Post {
                    rank,
                    root: o.post_root[r],
                    members: self.core.rank_sp.clone(),
                    nodes: self.core.rank_node.clone(),
                    key: key(false),
                    len: o.post_len[r],
                    design,
                    shared_key: (design == Design::Hier).then(|| key(true)),
                    shared_at: region_at(sp),
                };
                if let Err(e) = self.instance(sp, op).handle_post(now, post) {
                    return Err(self.fail(format!("op {op} rank {rank}: post rejected: {e}")));
                }
                touched.push(op);
            }
            Input::Msg {
                from,
                msg: (op, msg, payload),
            } => {
                // Zero-length chunks come as plain messages, without a move.
                let chunk = match msg {
                    Msg::Chunk { slot, len, .. } if len > 0 => Some((slot.0, len)),
                    _ => None,
                };
                if self.core.sps[sp as usize].known_lost.contains(&from) {
                    // The connection is gone: the chunk never lands.
                    if let Some((slot, _)) = chunk {
                        self.shadow(op, sp, slot)?.writers = 0;
                    }
                    return Ok(());
                }
                if let Some((slot, len)) = chunk {
                    let s = self.shadow(op, sp, slot)?;
                    if s.writers != 1 || s.readers != 0 || payload.len() as u64 != len {
                        return Err(self.fail(format!(
                            "op {op}: chunk into slot {slot} of SP {sp} without its move"
                        )));
                    }
                    s.data[..len as usize].copy_from_slice(&payload);
                    s.writers = 0;
                }
                if matches!(msg, Msg::Abort { .. }) {
                    self.ops[op].notified.insert(sp);
                }
                let shown = format!("{msg:?}");
                if let Err(e) = self.instance(sp, op).handle_msg(now, from, msg) {
                    return Err(self.fail(format!(
                        "op {op}: SP {sp} rejected {shown} from SP {from}: {e}"
                    )));
                }
                touched.push(op);
            }
            Input::CopyDone { op, copy, fail } => {
                let status = if fail {
                    Status::AccessError
                } else {
                    Status::Ok
                };
                match copy {
                    Work::Copy(c) => {
                        self.check_open(op, sp, &c, "finished")?;
                        self.finish_copy(op, sp, &c, !fail)?;
                        self.core.sps[sp as usize].limiter.finished();
                        self.instance(sp, op).handle_copy_done(now, c.id, status);
                    }
                    Work::Move(m) => {
                        self.shadow(op, sp, m.src_slot.0)?.readers -= 1;
                        self.instance(sp, op).handle_move_done(now, m.id, status);
                    }
                }
                touched.push(op);
            }
            Input::PeerLost { lost } => {
                self.core.sps[sp as usize].known_lost.insert(lost);
                if self.member_sps.contains(&sp) {
                    for op in 0..self.ops.len() {
                        if self.member_sps.contains(&lost) {
                            self.ops[op].notified.insert(sp);
                        }
                        self.instance(sp, op).handle_peer_lost(now, lost);
                        touched.push(op);
                    }
                }
            }
            Input::RankLost { world } => {
                for op in 0..self.ops.len() {
                    if self.ops[op].done[world as usize].is_none() {
                        self.ops[op].notified.insert(sp);
                    }
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
                    let wire = msg_bytes(&msg);
                    self.core
                        .send(op, sp, to, wire, out, (op, msg, Vec::new()))?;
                }
                Action::Copy(c) => {
                    self.check_copy(op, sp, &c)?;
                    self.core.sps[sp as usize].limiter.push((op, Work::Copy(c)));
                }
                Action::Move(m) => self.start_move(op, sp, m, out)?,
                Action::Complete {
                    rank,
                    status,
                    from_segment,
                } => self.complete(op, sp, rank, status, from_segment, out)?,
            }
        }
        Ok(())
    }

    fn start_move(&mut self, op: usize, sp: SpId, m: Move, out: Nanos) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        let want = tree_children(&o.tree, sp);
        if (!o.inconsistent && !want.contains(&m.to))
            || m.len == 0
            || m.len > self.cfg.chunk_bytes.max(1)
            || (!o.inconsistent && m.chunk >= o.n)
        {
            return Err(self.fail(format!(
                "op {op}: SP {sp} emitted a bad move {m:?} (its children: {want:?})"
            )));
        }
        self.begin_read(op, sp, m.src_slot.0, "a move")?;
        let payload = self.shadow(op, sp, m.src_slot.0)?.data[..m.len as usize].to_vec();
        let ppm = self.cfg.faults.copy_error_ppm as u64;
        let fail = ppm > 0 && self.core.rng.chance(ppm, 1_000_000);
        if fail {
            self.ops[op].disturbed = true;
        } else {
            self.begin_write(op, m.to, m.dst_slot.0, "an incoming move")?;
        }
        let inter = self.core.sp_node(sp) != self.core.sp_node(m.to);
        let c = &self.cfg.cost;
        let fixed = if inter {
            c.copy_fixed_inter_ns
        } else {
            c.copy_fixed_intra_ns
        };
        let o = &mut self.ops[op];
        o.moves += 1;
        if inter {
            o.bytes_inter += m.len;
        } else {
            o.bytes_intra += m.len;
        }
        let landed = self.core.transfer(sp, m.to, m.len, out + fixed);
        self.core.schedule(
            landed,
            Ev::Input {
                sp,
                input: Input::CopyDone {
                    op,
                    copy: Work::Move(m),
                    fail,
                },
            },
        );
        if !fail {
            self.core.messages += 1;
            let jitter = self.core.rng.range(0, self.cfg.faults.msg_jitter_ns);
            self.core.schedule(
                landed + jitter,
                Ev::Input {
                    sp: m.to,
                    input: Input::Msg {
                        from: sp,
                        msg: (op, m.chunk_msg(), payload),
                    },
                },
            );
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
        if from_segment {
            if !status.is_ok() || self.cfg.design != Design::Hier || o.post_root[r] == rank {
                return Err(self.fail(format!(
                    "op {op}: rank {rank} completed from the segment ({status}, {:?})",
                    self.cfg.design
                )));
            }
            // The host copies the message out of its node leader's region in
            // its wait: the SP says where that is. With inconsistent posts the
            // SPs may disagree on the root, so on the tree and its leaders: any
            // region of the node will do here, and the final check compares the
            // bytes with those of the root the rank named.
            let leader = o.tree.iter().find(|g| g.contains(&sp)).map(|g| g[0]);
            let src = self.inst.get(&(sp, op)).and_then(|a| a.segment_source());
            let node = self.core.sp_node(sp);
            let leads = |owner: SpId| {
                Some(owner) == leader || (o.inconsistent && self.core.sp_node(owner) == node)
            };
            let owner = match src {
                Some((owner, at, len)) if leads(owner) && at == region_at(owner) => {
                    if len != o.len && !o.inconsistent {
                        return Err(self.fail(format!(
                            "op {op}: rank {rank}: region of {len} bytes for a {}-byte message",
                            o.len
                        )));
                    }
                    owner
                }
                _ => {
                    return Err(self.fail(format!(
                        "op {op}: rank {rank} of SP {sp} copies from {src:?}, not from its \
                         leader {leader:?}'s region"
                    )))
                }
            };
            let n = (o.post_len[r] as usize).min(o.len as usize);
            let data = self.ops[op].seg[owner as usize][..n].to_vec();
            let o = &mut self.ops[op];
            o.buf[r][..n].copy_from_slice(&data);
            o.seg_sealed[owner as usize].get_or_insert(at);
            let node = self.core.sp_node(sp);
            host_at = at + self.core.copy_cost(node, sp, n as u64);
        }
        self.ops[op].done[r] = Some(Done {
            at,
            status,
            from_segment,
            host_at,
        });
        Ok(())
    }

    fn pump(&mut self, sp: SpId, at: Nanos) -> Result<(), SimFailure> {
        while let Some((op, work)) = self.core.next_copy(sp)? {
            let Work::Copy(c) = work else {
                return Err(self.fail("a move in the copy limiter"));
            };
            self.check_open(op, sp, &c, "started")?;
            if let Loc::Stage { slot, .. } = c.src {
                self.begin_read(op, sp, slot.0, "a copy")?;
            }
            if let Loc::Stage { slot, .. } = c.dst {
                self.begin_write(op, sp, slot.0, "a read from the root")?;
            }
            let node = self.core.sp_node(sp);
            let cost = self.core.copy_cost(node, sp, c.len);
            let ppm = self.cfg.faults.copy_error_ppm as u64;
            let fail = ppm > 0 && self.core.rng.chance(ppm, 1_000_000);
            if fail {
                self.ops[op].disturbed = true;
            }
            self.core.schedule(
                at + cost,
                Ev::Input {
                    sp,
                    input: Input::CopyDone {
                        op,
                        copy: Work::Copy(c),
                        fail,
                    },
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
        if c.len == 0 || c.len > chunk || (!o.inconsistent && c.chunk >= o.n) {
            return bad("bad chunk or length");
        }
        if c.rank as usize >= o.buf.len() || self.core.rank_sp[c.rank as usize] != sp {
            return bad("a rank this SP does not serve");
        }
        let (host, stage_is_dst) = match (&c.src, &c.dst) {
            (Loc::Host { key, offset }, Loc::Stage { offset: 0, .. }) => ((key, offset), true),
            (Loc::Stage { offset: 0, .. }, Loc::Host { key, offset }) => ((key, offset), false),
            _ => return bad("not host<->stage at slot offset 0"),
        };
        let (key, &offset) = host;
        if key.op != op as u32 || key.rank != c.rank || offset != c.chunk * chunk {
            return bad("wrong key or offset");
        }
        if stage_is_dst {
            // A read: only from a rank that named itself root.
            if key.shared || o.post_root[c.rank as usize] != c.rank {
                return bad("read from a rank that is not the root");
            }
        } else {
            if o.post_root[c.rank as usize] == c.rank && !key.shared {
                return bad("write into the root's buffer");
            }
            if key.shared != (self.cfg.design == Design::Hier) {
                return bad("write into the wrong kind of buffer");
            }
            if key.shared && !o.inconsistent {
                let group = o.tree.iter().find(|g| g.contains(&sp));
                if group.is_none_or(|g| g[0] != sp) {
                    return bad("segment write by an SP that is not its node's leader");
                }
                let siblings = group.is_some_and(|g| g.len() > 1);
                let local = &self.local[&sp];
                let writer = local
                    .iter()
                    .copied()
                    .find(|&r| r != o.root)
                    .or((siblings && local.contains(&o.root)).then_some(o.root));
                if writer != Some(c.rank) {
                    return bad("segment write through another rank than the writer");
                }
            }
        }
        Ok(())
    }

    /// No copy touches a buffer whose rank completed, nor a segment after
    /// a `from_segment` completion.
    fn check_open(
        &self,
        op: usize,
        sp: SpId,
        c: &Copy<SimKey>,
        when: &str,
    ) -> Result<(), SimFailure> {
        let o = &self.ops[op];
        for loc in [&c.src, &c.dst] {
            let Loc::Host { key, .. } = loc else { continue };
            if key.shared {
                if let Some(t) = o.seg_sealed[sp as usize] {
                    return Err(self.fail(format!(
                        "op {op}: copy {} {when} on the segment of SP {sp}, read by a host since {t}ns",
                        c.id.0
                    )));
                }
            } else if let Some(d) = o.done[key.rank as usize] {
                return Err(self.fail(format!(
                    "op {op}: copy {} {when} on the buffer of rank {}, completed at {}ns",
                    c.id.0, key.rank, d.at
                )));
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
        let len = c.len as usize;
        let src: Vec<u8> = match &c.src {
            Loc::Host { key, offset } => {
                let b = &self.ops[op].buf[key.rank as usize];
                let end = *offset as usize + len;
                if end > self.ops[op].post_len[key.rank as usize] as usize {
                    return Err(self.fail(format!("op {op}: read past the posted length: {c:?}")));
                }
                b[*offset as usize..end].to_vec()
            }
            Loc::Stage { slot, .. } => {
                let s = self.shadow(op, sp, slot.0)?;
                s.readers -= 1;
                s.data[..len].to_vec()
            }
        };
        match &c.dst {
            Loc::Stage { slot, .. } => {
                let s = self.shadow(op, sp, slot.0)?;
                s.writers = 0;
                if ok {
                    s.data[..len].copy_from_slice(&src);
                }
            }
            Loc::Host { key, offset } => {
                let o = &mut self.ops[op];
                let (at, end) = (*offset as usize, *offset as usize + len);
                // A region holds the message as its SP sees it: with
                // inconsistent posts, the writer's post may be longer (its
                // driver sized the region from it).
                let limit = match (key.shared, o.inconsistent) {
                    (true, false) => o.len,
                    (true, true) => o.len.max(o.post_len[key.rank as usize]),
                    (false, _) => o.post_len[key.rank as usize],
                } as usize;
                if end > limit {
                    return Err(self.fail(format!("op {op}: write past the message: {c:?}")));
                }
                if ok {
                    if key.shared {
                        o.seg[sp as usize][at..end].copy_from_slice(&src);
                        o.seg_writes[sp as usize] += 1;
                    } else {
                        o.buf[key.rank as usize][at..end].copy_from_slice(&src);
                        o.buf_writes[key.rank as usize] += 1;
                    }
                }
            }
        }
        if ok {
            self.core.copies += 1;
            self.bytes_copied += c.len;
        }
        Ok(())
    }

    fn final_checks(&mut self) -> Result<(), SimFailure> {
        let crashed: BTreeSet<SpId> = self.core.crashed.iter().copied().collect();
        for (i, o) in self.ops.iter().enumerate() {
            let want = o.len as usize;
            for r in 0..o.buf.len() {
                let sp = self.core.rank_sp[r];
                let b = &o.buf[r];
                let plen = o.post_len[r] as usize;
                if let Some(j) = (plen..b.len()).find(|&j| b[j] != sentinel(j)) {
                    return Err(self.fail(format!(
                        "op {i}: rank {r}: byte {j} past the message was written"
                    )));
                }
                if r == o.root as usize && b[..want] != o.data[..] {
                    return Err(self.fail(format!("op {i}: the root's buffer changed")));
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
                    let seg = self.cfg.design == Design::Hier && r != o.root as usize;
                    if !d.status.is_ok() || d.from_segment != seg {
                        return Err(self.fail(format!(
                            "op {i} rank {r}: {} (from_segment {}) without a fault",
                            d.status, d.from_segment
                        )));
                    }
                }
                if d.status.is_ok() {
                    // Ok: the rank's post agrees with that of the rank it
                    // names as root, which names itself, and it holds that
                    // root's bytes (normally the real root; a rank that
                    // wrongly names itself root may complete Ok once its
                    // own buffer was read, as any root).
                    let x = o.post_root[r] as usize;
                    if o.post_root[x] as usize != x || o.post_len[x] != o.post_len[r] {
                        return Err(self.fail(format!(
                            "op {i} rank {r}: completed Ok with an inconsistent post (root {x}, {} bytes)",
                            o.post_len[r]
                        )));
                    }
                    let (src, n) = (&o.buf[x], plen);
                    if b[..n] != src[..n] {
                        let j = (0..n).find(|&j| b[j] != src[j]).unwrap();
                        return Err(self.fail(format!(
                            "op {i} rank {r}: completed Ok but byte {j} of {n} is wrong (chunk {})",
                            j as u64 / self.cfg.chunk_bytes.max(1)
                        )));
                    }
                }
            }
            if !o.disturbed {
                let nodes: BTreeSet<u32> = self.core.rank_node.iter().copied().collect();
                let min = o.len * (nodes.len() as u64 - 1);
                if o.bytes_inter != min {
                    return Err(self.fail(format!(
                        "op {i}: {} bytes crossed nodes, want {min}",
                        o.bytes_inter
                    )));
                }
                let hops = match self.cfg.design {
                    Design::Flat => o.tree.iter().map(Vec::len).sum::<usize>() as u64 - 1,
                    Design::Hier => o.tree.len() as u64 - 1,
                };
                let moves = if o.len == 0 { 0 } else { o.n * hops };
                if o.moves != moves {
                    return Err(self.fail(format!("op {i}: {} moves, want {moves}", o.moves)));
                }
                let per_target = if o.len == 0 { 0 } else { o.n };
                for (sp, ranks) in &self.local {
                    let targets: Vec<Rank> =
                        ranks.iter().copied().filter(|&r| r != o.root).collect();
                    let group = o.tree.iter().find(|g| g.contains(sp)).expect("in the tree");
                    let writes = group[0] == *sp && (!targets.is_empty() || group.len() > 1);
                    let got: Vec<u64> = match self.cfg.design {
                        Design::Flat => targets.iter().map(|&r| o.buf_writes[r as usize]).collect(),
                        Design::Hier if writes => vec![o.seg_writes[*sp as usize]],
                        Design::Hier => {
                            // Not written, and none of its ranks' buffers.
                            if o.seg_writes[*sp as usize] > 0
                                || targets.iter().any(|&r| o.buf_writes[r as usize] > 0)
                            {
                                return Err(self.fail(format!(
                                    "op {i}: SP {sp} is not its node's writer but wrote"
                                )));
                            }
                            vec![]
                        }
                    };
                    if got.iter().any(|&g| g != per_target) {
                        return Err(self.fail(format!(
                            "op {i}: SP {sp} wrote chunks {got:?} times, want {per_target} each"
                        )));
                    }
                }
            }
        }
        if self.cfg.design == Design::Hier {
            for (i, o) in self.ops.iter().enumerate().filter(|(_, o)| !o.disturbed) {
                let sealed: u64 = (0..self.cfg.sp_count())
                    .filter_map(|sp| self.inst.get(&(sp, i)))
                    .map(|a| a.stats().regions_shared)
                    .sum();
                let want = o.tree.iter().map(|g| g.len() as u64 - 1).sum::<u64>();
                if sealed != want {
                    return Err(self.fail(format!(
                        "op {i}: {sealed} regions sealed for other SPs, want {want}"
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

    fn report(&self) -> SimReport {
        let mut stats = Stats::default();
        for a in self.inst.values() {
            let s = a.stats();
            stats.chunks_forwarded += s.chunks_forwarded;
            stats.bytes_staged += s.bytes_staged;
            stats.chunks_before_post += s.chunks_before_post;
            stats.max_slots_in_use = stats.max_slots_in_use.max(s.max_slots_in_use);
            stats.unknown_done += s.unknown_done;
            stats.ignored_from_lost_sp += s.ignored_from_lost_sp;
            stats.regions_shared += s.regions_shared;
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
            moves: self.ops.iter().map(|o| o.moves).sum(),
            copies: self.core.copies,
            bytes_moved_inter_node: self.ops.iter().map(|o| o.bytes_inter).sum(),
            bytes_moved_intra_node: self.ops.iter().map(|o| o.bytes_intra).sum(),
            min_inter_node_bytes: {
                let nodes: BTreeSet<u32> = self.core.rank_node.iter().copied().collect();
                self.ops
                    .iter()
                    .map(|o| o.len * (nodes.len() as u64 - 1))
                    .sum()
            },
            bytes_copied: self.bytes_copied,
            max_in_flight: self.core.max_in_flight,
            stats,
            error_completions: done.filter(|d| !d.status.is_ok()).count() as u64,
            crashed_sps: self.core.crashed.clone(),
            dead_ranks: self.core.dead.clone(),
        }
    }
}

/// Size of a message's fields on the wire.
fn msg_bytes(msg: &Msg) -> u64 {
    match msg {
        Msg::Open { tree, .. } => {
            4 + 8 + 8 + 4 * tree.iter().map(|g| 1 + g.len() as u64).sum::<u64>()
        }
        Msg::Credit { slots, .. } => 4 + 8 + 8 + 4 * slots.len() as u64,
        Msg::Chunk { .. } => 8 + 4 + 8,
        Msg::Return { slots } => 4 * slots.len() as u64,
        Msg::Abort { .. } => 1,
        Msg::Sealed { .. } => 8,
    }
}

/// Where the driver of SP `sp` places its hierarchical region in its node
/// segment (any value works; distinct ones let the checker see that ranks
/// copy from the place their leader named).
fn region_at(sp: SpId) -> u64 {
    4096 * (u64::from(sp) + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bcast::{set_mutation, Mutation};

    fn cfg(seed: u64) -> SimConfig {
        let mut c = SimConfig::new(seed);
        c.len_bytes = Some(70);
        c.faults.msg_jitter_ns = 2_000;
        c
    }

    #[test]
    fn a_run_moves_and_copies_real_bytes() {
        for design in [Design::Flat, Design::Hier] {
            let mut c = cfg(5);
            c.design = design;
            let r = run(&c).unwrap();
            eprintln!("{r:?}");
            assert_eq!(r.error_completions, 0);
            assert_eq!(r.bytes_moved_inter_node, r.min_inter_node_bytes);
            assert!(r.moves > 0 && r.copies > 0);
            assert_eq!(r.stats.chunks_forwarded, r.moves);
            assert!(r.stats.max_slots_in_use >= 2, "{:?}", r.stats);
        }
    }

    /// Runs `c` under `m` for a few seeds; every seed must fail with a
    /// message containing one of `want`. Returns the first failure.
    fn caught(m: Mutation, c: SimConfig, want: &[&str]) -> String {
        driver::caught(m, set_mutation, |seed| SimConfig { seed, ..c }, run, want)
    }

    #[test]
    fn checkers_catch_a_slot_freed_while_its_move_reads_it() {
        // One rank per SP: the root's SP has no local writes to wait for.
        let mut c = cfg(0);
        c.ranks_per_node = 2;
        caught(Mutation::FreeWhileMoving, c, &["writes staging slot"]);
    }

    #[test]
    fn checkers_catch_ranks_completing_a_chunk_early() {
        caught(
            Mutation::CompleteOneChunkEarly,
            cfg(0),
            &["on the buffer of rank", "is wrong"],
        );
    }

    #[test]
    fn checkers_catch_the_root_completing_before_its_reads_finished() {
        let mut c = cfg(0);
        c.design = Design::Hier;
        caught(
            Mutation::RootCompletesBeforeReads,
            c,
            &["on the buffer of rank"],
        );
    }

    #[test]
    fn checkers_catch_a_late_rank_missing_staged_chunks() {
        let mut c = cfg(0);
        c.late_ranks = 6;
        c.late_delay_ns = 1_000_000;
        caught(
            Mutation::SkipStagedForLateRank,
            c,
            &["never completed", "not finished"],
        );
    }

    #[test]
    fn checkers_catch_ok_completions_after_an_abort() {
        let mut c = cfg(0);
        c.faults.inconsistent_posts = 2;
        c.faults.rank_deaths = 1;
        c.faults.death_window_ns = 10_000;
        caught(
            Mutation::OkAfterAbort,
            c,
            &["learned of a fault", "inconsistent post"],
        );
    }
}
