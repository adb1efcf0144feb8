//! The simulator's state: staging shadows, collectives, SPs' instances;
//! its setup.

use super::*;

/// A staging slot as the simulator sees it.
pub(super) type Shadow = crate::sim::staged_common::Shadow<Vec<u8>>;

pub(super) use crate::sim::staged_common::{Done, OpRecord};

pub(super) struct Op {
    pub(super) key: CollKey,
    pub(super) root: Rank,
    pub(super) len: u64,
    pub(super) n: u64,
    /// The SPs grouped by node, in tree order.
    pub(super) tree: Vec<Vec<SpId>>,
    pub(super) data: Vec<u8>,
    pub(super) post_len: Vec<u64>,
    pub(super) post_root: Vec<Rank>,
    pub(super) inconsistent: bool,
    pub(super) buf: Vec<Vec<u8>>,
    /// Per SP: its region of the node segment (hierarchical).
    pub(super) seg: Vec<Vec<u8>>,
    /// Per SP: first `from_segment` completion out of its region.
    pub(super) seg_sealed: Vec<Option<Nanos>>,
    pub(super) seg_writes: Vec<u64>,
    pub(super) buf_writes: Vec<u64>,
    pub(super) rec: OpRecord<Vec<u8>>,
    pub(super) moves: u64,
}

crate::sim::staged_common::op_record_deref!(Vec<u8>);

/// A copy or a move in the driver's hands.
#[derive(Clone, Debug)]
pub(super) enum Work {
    Copy(Copy<SimKey>),
    Move(Move),
}

/// A message with the bytes a `Chunk` carries.
pub(super) type Env = (usize, Msg, Vec<u8>);
pub(super) type Input = driver::Input<Env, Work>;

pub(super) struct Sim<'a> {
    pub(super) cfg: &'a SimConfig,
    pub(super) core: Core<Env, Work>,
    pub(super) ops: Vec<Op>,
    pub(super) inst: BTreeMap<(SpId, usize), Bcast<SimKey>>,
    /// SPs serving at least one rank.
    pub(super) member_sps: BTreeSet<SpId>,
    /// Per SP: its ranks, ascending.
    pub(super) local: BTreeMap<SpId, Vec<Rank>>,
    pub(super) bytes_copied: u64,
}

crate::sim::shared::world_collective!(Env, Work);

/// The tree the simulator expects (computed here independently of the
/// algorithm), as groups per node: the root's node first with the root's SP
/// leading and the node's other SPs in id order after it, then the other
/// nodes in ring order with their SPs in id order.
pub(super) fn expected_tree(rank_sp: &[SpId], rank_node: &[u32], root: Rank) -> Vec<Vec<SpId>> {
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
pub(super) fn tree_children(tree: &[Vec<SpId>], sp: SpId) -> Vec<SpId> {
    let Some(g) = tree.iter().position(|grp| grp[0] == sp) else {
        return Vec::new();
    };
    let mut out: Vec<SpId> = tree.get(g + 1).map(|n| n[0]).into_iter().collect();
    out.extend(&tree[g][1..]);
    out
}

impl<'a> Sim<'a> {
    pub(super) fn new(cfg: &'a SimConfig) -> Result<Sim<'a>, SimFailure> {
        let (mut core, mut setup) = cfg.core()?;
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
            let len = draw_len(&mut setup, cfg.len_bytes, chunk, 4, cfg.max_len_bytes);
            let base = splitmix64(cfg.seed ^ splitmix64(i as u64 + 1));
            let data: Vec<u8> = (0..len)
                .map(|b| splitmix64(base.wrapping_add(b)) as u8)
                .collect();
            let n = if len == 0 { 1 } else { len.div_ceil(chunk) };
            ops.push(Op {
                key: world_key(i),
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
                rec: OpRecord::new(p),
                moves: 0,
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
        cfg.schedule_world(&mut sim.core, &mut setup);
        Ok(sim)
    }

    crate::sim::staged_common::staged_sim_basics!(Bcast, |size| vec![0xEE; size as usize]);

    /// Start writing slot `slot` of `sp` (nothing else may touch it).
    pub(super) fn begin_write(
        &mut self,
        (op, sp, slot): (usize, SpId, u32),
        what: &str,
    ) -> Result<(), SimFailure> {
        if let Err((r, w)) = self.shadow(op, sp, slot)?.begin_write() {
            return Err(self.fail(format!(
                "op {op}: {what} writes staging slot {slot} of SP {sp} while {r} reads and {w} writes are in flight on it"
            )));
        }
        Ok(())
    }

    /// Start reading slot `slot` of `sp` (no write may be in flight).
    pub(super) fn begin_read(
        &mut self,
        (op, sp, slot): (usize, SpId, u32),
        what: &str,
    ) -> Result<(), SimFailure> {
        if !self.shadow(op, sp, slot)?.begin_read() {
            return Err(self.fail(format!(
                "op {op}: {what} reads staging slot {slot} of SP {sp} while it is being written"
            )));
        }
        Ok(())
    }
}
