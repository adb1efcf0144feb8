//! The simulator's state: collectives and SPs' instances; its setup.

use super::*;

// ---------------------------------------------------------------------------

pub(super) struct Op {
    pub(super) key: CollKey,
    pub(super) world: Vec<u32>,
    pub(super) members: Vec<SpId>,
    pub(super) sps: BTreeSet<SpId>,
    pub(super) send_counts: Vec<Vec<u64>>,
    pub(super) send_displs: Vec<Vec<u64>>,
    pub(super) recv_counts: Vec<Vec<u64>>,
    pub(super) recv_displs: Vec<Vec<u64>>,
    pub(super) send_buf: Vec<Vec<u8>>,
    pub(super) recv_buf: Vec<Vec<u8>>,
    pub(super) post_ns: Vec<Option<Nanos>>,
    pub(super) done: Vec<Option<(Nanos, Status)>>,
    /// Ranks that must not complete Ok (count mismatch, failed copy).
    pub(super) forced_error: BTreeSet<Rank>,
    /// Ranks that must complete with exactly `CountMismatch` if nothing
    /// else went wrong in this collective.
    pub(super) mismatch: BTreeSet<Rank>,
    /// A fault other than a count mismatch touched this collective.
    pub(super) disturbed: bool,
}

pub(super) type Input = driver::Input<(CollKey, Msg<SimKey>), Copy<SimKey>>;
pub(super) type Ev = driver::Ev<(CollKey, Msg<SimKey>), Copy<SimKey>>;

pub(super) struct Sim<'a> {
    pub(super) cfg: &'a SimConfig,
    pub(super) core: Core<(CollKey, Msg<SimKey>), Copy<SimKey>>,
    pub(super) ops: Vec<Op>,
    pub(super) inst: BTreeMap<(SpId, usize), Alltoallv<SimKey>>,
    pub(super) by_key: BTreeMap<CollKey, usize>,
    /// Per world rank: (op, comm rank) in op order.
    pub(super) rank_ops: Vec<Vec<(usize, Rank)>>,
    pub(super) late: Vec<bool>,
    /// (op, sp) pairs where the SP was told about a lost member SP.
    pub(super) loss_notified: BTreeSet<(usize, SpId)>,
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
    pub(super) fn new(cfg: &'a SimConfig) -> Result<Sim<'a>, SimFailure> {
        let (core, mut setup) = cfg.core()?;
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
        cfg.schedule_faults(&mut sim.core, &mut setup);
        Ok(sim)
    }

    pub(super) fn make_op(
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
    pub(super) fn random_layout(rng: &mut Rng, counts: &[u64]) -> (Vec<u64>, u64) {
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

    pub(super) fn layout_recv(rng: &mut Rng, op: &mut Op, d: usize) {
        let (displs, len) = Self::random_layout(rng, &op.recv_counts[d]);
        op.recv_displs[d] = displs;
        op.recv_buf[d] = (0..len as usize).map(sentinel).collect();
    }

    pub(super) fn post_delay(&mut self, world: u32) -> Nanos {
        let late = if self.late[world as usize] {
            self.cfg.late_delay_ns
        } else {
            0
        };
        self.core.rng.range(0, self.cfg.arrival_skew_ns) + late
    }

    pub(super) fn fail(&self, what: impl Into<String>) -> SimFailure {
        self.core.fail(what)
    }

    pub(super) fn instance(&mut self, sp: SpId, op: usize) -> &mut Alltoallv<SimKey> {
        let key = self.ops[op].key;
        self.inst
            .entry((sp, op))
            .or_insert_with(|| Alltoallv::new(key, Config { me: sp }))
    }
}
