//! The simulator's state: staging shadows, collectives, SPs' instances;
//! its setup.

use super::*;

// ---- the simulator ----------------------------------------------------------

/// A staging slot as the simulator sees it.
pub(super) type Shadow = crate::sim::staged_common::Shadow<Mem>;

pub(super) use crate::sim::staged_common::{Done, OpRecord};

pub(super) struct Op {
    pub(super) key: CollKey,
    pub(super) len: u64,
    pub(super) n: u64,
    pub(super) post_len: Vec<u64>,
    /// Per rank: `members`/`nodes` it posts instead of the real ones.
    pub(super) post_comm: Vec<Option<(Vec<SpId>, Vec<u32>)>>,
    pub(super) inconsistent: bool,
    /// Per SP.
    pub(super) design: Vec<Design>,
    pub(super) recv: Vec<Mem>,
    /// Per SP: the rank whose shared key names the region, and the region.
    pub(super) region: Vec<Option<(Rank, Mem)>>,
    /// Per SP: first completion of one of its ranks.
    pub(super) sealed: Vec<Option<Nanos>>,
    pub(super) rec: OpRecord<Mem>,
    pub(super) reads: u64,
    pub(super) writes_rank: Vec<u64>,
    pub(super) writes_region: Vec<u64>,
}

crate::sim::staged_common::op_record_deref!(Mem);

pub(super) type Env = (usize, Msg<SimKey>);
pub(super) type Input = driver::Input<Env, Copy<SimKey>>;

pub(super) struct Sim<'a> {
    pub(super) cfg: &'a SimConfig,
    pub(super) core: Core<Env, Copy<SimKey>>,
    pub(super) ops: Vec<Op>,
    pub(super) inst: BTreeMap<(SpId, usize), StagedAllgather<SimKey>>,
    /// SPs serving at least one rank.
    pub(super) member_sps: BTreeSet<SpId>,
    /// Per SP: the owner of its node on the world communicator (its lowest
    /// member SP), computed once: the checkers ask for every write.
    pub(super) owners: Vec<SpId>,
    pub(super) reads: u64,
    pub(super) writes: u64,
    pub(super) after_finish_dropped: u64,
    pub(super) after_finish_refused: u64,
    /// Directed node link -> time its writes kept it busy.
    pub(super) link_busy: BTreeMap<(u32, u32), Nanos>,
}

crate::sim::shared::world_collective!(Env, Copy<SimKey>);

impl<'a> Sim<'a> {
    pub(super) fn new(cfg: &'a SimConfig) -> Result<Sim<'a>, SimFailure> {
        let (core, mut setup) = cfg.core()?;
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
            let len = draw_len(&mut setup, cfg.len_bytes, chunk, 3, cfg.max_len_bytes);
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
                key: world_key(i),
                len,
                n: if len == 0 { 0 } else { len.div_ceil(chunk) },
                post_len: vec![len; p],
                post_comm: vec![None; p],
                inconsistent: false,
                design,
                recv: Vec::new(),
                region: vec![None; sp_count],
                sealed: vec![None; sp_count],
                rec: OpRecord::new(p),
                reads: 0,
                writes_rank: vec![0; p],
                writes_region: vec![0; sp_count],
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
        cfg.schedule_world(&mut sim.core, &mut setup);
        Ok(sim)
    }

    crate::sim::staged_common::staged_sim_basics!(StagedAllgather, |size| Mem::new(
        size,
        Src::Garbage
    ));

    pub(super) fn finished(&self, sp: SpId, op: usize) -> bool {
        self.inst.get(&(sp, op)).is_some_and(|a| a.is_finished())
    }
}
