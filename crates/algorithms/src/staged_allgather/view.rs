//! An SP's view of the communicator: member SPs, node owners, write order.

use super::*;

/// Digest of a communicator's `members` and `nodes` (FNV-1a over their
/// little-endian bytes and lengths), the same on every SP.
pub fn comm_digest(members: &[SpId], nodes: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(members.len() as u64);
    for &m in members {
        eat(m as u64);
    }
    eat(nodes.len() as u64);
    for &n in nodes {
        eat(n as u64);
    }
    h
}

/// The owner of `sp`'s node in a communicator: the lowest SP serving a
/// member on that node (`None` if `sp` serves none or an SP serves two
/// nodes).
pub fn node_owner(members: &[SpId], nodes: &[u32], sp: SpId) -> Option<SpId> {
    let sp_node = sp_nodes(members, nodes).ok()?;
    let node = *sp_node.get(&sp)?;
    sp_node
        .iter()
        .filter(|&(_, &n)| n == node)
        .map(|(&s, _)| s)
        .min()
}

/// What the first local post told about the communicator.
#[derive(Clone, Debug)]
pub(super) struct View {
    pub(super) len: u64,
    /// Chunks per block.
    pub(super) n: u64,
    pub(super) digest: u64,
    pub(super) members: Vec<SpId>,
    pub(super) design: Design,
    /// Ranks served here, ascending.
    pub(super) local: Vec<Rank>,
    /// Member SPs, ascending (this SP included).
    pub(super) sps: Vec<SpId>,
    /// Per member SP: its ranks, ascending.
    pub(super) sp_ranks: Vec<Vec<Rank>>,
    /// Write order (see the module docs): (index into `sps`, rank), every
    /// comm rank once; `first[i]`: `order[i]` is the first entry of its SP.
    pub(super) order: Vec<(usize, Rank)>,
    pub(super) first: Vec<bool>,
    /// This SP's index in `sps`.
    pub(super) mine: usize,
    /// Per member SP: the index of its node's owner (lowest member SP).
    pub(super) owner: Vec<usize>,
}

impl View {
    pub(super) fn build(me: SpId, chunk: u64, post: &Post<impl Sized>) -> Result<View, PostError> {
        let sp_node =
            sp_nodes(&post.members, &post.nodes).map_err(|sp| PostError::SpOnTwoNodes { sp })?;
        let sps: Vec<SpId> = sp_node.keys().copied().collect();
        let idx = |sp: SpId| sps.binary_search(&sp).expect("a member SP");
        let mut sp_ranks = vec![Vec::new(); sps.len()];
        for (r, &sp) in post.members.iter().enumerate() {
            sp_ranks[idx(sp)].push(r as Rank);
        }
        let mine = idx(me);
        let my_node = sp_node[&me];
        let mut node_sps: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, sp) in sps.iter().enumerate() {
            node_sps.entry(sp_node[sp]).or_default().push(i);
        }
        let nodes: Vec<u32> = node_sps.keys().copied().collect();
        let at = nodes.iter().position(|&n| n == my_node).unwrap();
        let rot = node_sps[&my_node].iter().position(|&i| i == mine).unwrap();
        // Per node in ring order from this one: its ranks, SP by SP (the
        // SPs rotated by this SP's index on its node); then one entry of
        // each node in turn.
        let lists: Vec<Vec<(usize, Rank)>> = (0..nodes.len())
            .map(|k| {
                let list = &node_sps[&nodes[(at + k) % nodes.len()]];
                let start = rot % list.len();
                list[start..]
                    .iter()
                    .chain(&list[..start])
                    .flat_map(|&b| sp_ranks[b].iter().map(move |&r| (b, r)))
                    .collect()
            })
            .collect();
        let longest = lists.iter().map(Vec::len).max().unwrap_or(0);
        let mut order = Vec::with_capacity(post.members.len());
        for k in 0..longest {
            order.extend(lists.iter().filter_map(|l| l.get(k)));
        }
        let mut seen = vec![false; sps.len()];
        let first = order
            .iter()
            .map(|&(b, _)| !std::mem::replace(&mut seen[b], true))
            .collect();
        let n = if post.len == 0 {
            0
        } else {
            post.len.div_ceil(chunk)
        };
        let owner = sps.iter().map(|sp| node_sps[&sp_node[sp]][0]).collect();
        Ok(View {
            len: post.len,
            n,
            digest: comm_digest(&post.members, &post.nodes),
            members: post.members.clone(),
            design: post.design,
            local: sp_ranks[mine].clone(),
            sps,
            sp_ranks,
            order,
            first,
            mine,
            owner,
        })
    }

    /// The member SPs but `me`, in view order.
    pub(super) fn others(&self, me: SpId) -> Vec<SpId> {
        self.sps.iter().copied().filter(|&s| s != me).collect()
    }

    pub(super) fn is_owner(&self) -> bool {
        self.owner[self.mine] == self.mine
    }

    pub(super) fn idx(&self, sp: SpId) -> Option<usize> {
        self.sps.binary_search(&sp).ok()
    }

    pub(super) fn chunk_len(&self, chunk_bytes: u64, i: u64) -> u64 {
        (self.len - (i * chunk_bytes).min(self.len)).min(chunk_bytes)
    }
}
