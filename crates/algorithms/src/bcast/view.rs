//! An SP's view of the broadcast: the tree of SPs and the chunking.

use super::*;
use std::sync::Arc;

/// `(root, len, chunk_bytes, tree)` as one SP sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct View {
    pub(super) root: Rank,
    pub(super) len: u64,
    pub(super) chunk_bytes: u64,
    /// Shared with the tree cache (`shared_tree`) and the other views built from it.
    pub(super) tree: Arc<Vec<Vec<SpId>>>,
    /// This SP's group in `tree`, and its place in that group.
    pub(super) group: usize,
    pub(super) at: usize,
    /// Number of chunks.
    pub(super) n: u64,
}

impl View {
    pub(super) fn new(
        me: SpId,
        root: Rank,
        len: u64,
        chunk_bytes: u64,
        tree: Arc<Vec<Vec<SpId>>>,
    ) -> Option<View> {
        let (group, at) = tree
            .iter()
            .enumerate()
            .find_map(|(g, sps)| sps.iter().position(|&s| s == me).map(|a| (g, a)))?;
        let n = if len == 0 {
            1
        } else {
            len.div_ceil(chunk_bytes)
        };
        Some(View {
            root,
            len,
            chunk_bytes,
            tree,
            group,
            at,
            n,
        })
    }

    /// The root's SP: the first SP of the first group.
    pub(super) fn is_top(&self) -> bool {
        self.group == 0 && self.at == 0
    }

    pub(super) fn parent(&self) -> Option<SpId> {
        tree_parent(&self.tree, self.group, self.at)
    }

    /// The next group's leader first (the critical path), then, for a
    /// leader, the other SPs of its group.
    pub(super) fn children(&self) -> Vec<SpId> {
        if self.at > 0 {
            return Vec::new();
        }
        let next = self.tree.get(self.group + 1).map(|g| g[0]);
        next.into_iter()
            .chain(self.tree[self.group][1..].iter().copied())
            .collect()
    }

    pub(super) fn contains(&self, sp: SpId) -> bool {
        self.tree.iter().any(|g| g.contains(&sp))
    }

    /// For a leader, the other SPs of its node; else none.
    pub(super) fn siblings(&self) -> &[SpId] {
        if self.at == 0 {
            &self.tree[self.group][1..]
        } else {
            &[]
        }
    }

    pub(super) fn all(&self) -> impl Iterator<Item = SpId> + '_ {
        self.tree.iter().flatten().copied()
    }

    pub(super) fn offset(&self, i: u64) -> u64 {
        i * self.chunk_bytes
    }

    pub(super) fn chunk_len(&self, i: u64) -> u64 {
        (self.len - self.offset(i).min(self.len)).min(self.chunk_bytes)
    }

    /// The abort status if `(root, len, chunk_bytes, tree)` disagrees.
    pub(super) fn disagreement(
        &self,
        root: Rank,
        len: u64,
        chunk_bytes: u64,
        tree: Option<&[Vec<SpId>]>,
    ) -> Option<Status> {
        if root != self.root || len != self.len {
            Some(Status::CountMismatch)
        } else if chunk_bytes != self.chunk_bytes || tree.is_some_and(|t| t != self.tree.as_slice())
        {
            Some(Status::InvalidPost)
        } else {
            None
        }
    }
}

/// The parent of the SP at `tree[group][at]`.
pub(super) fn tree_parent(tree: &[Vec<SpId>], group: usize, at: usize) -> Option<SpId> {
    if at > 0 {
        Some(tree[group][0])
    } else {
        group.checked_sub(1).map(|g| tree[g][0])
    }
}

thread_local! {
    /// The tree built last on this thread, and what it was built from: a communicator's
    /// broadcasts follow each other with the same members, nodes and root, and building the
    /// tree (maps and vectors per instance) is a large part of what a small broadcast's post
    /// costs. A pure function's last result, kept: the machine behaves the same without it.
    #[allow(clippy::type_complexity)]
    static LAST_TREE: std::cell::RefCell<Option<(Vec<SpId>, Vec<u32>, Rank, Arc<Vec<Vec<SpId>>>)>> =
        const { std::cell::RefCell::new(None) };
}

/// [`build_tree`], or the same tree built last on this thread from the same members, nodes
/// and root.
pub(super) fn shared_tree(
    members: &[SpId],
    nodes: &[u32],
    root: Rank,
) -> Result<Arc<Vec<Vec<SpId>>>, PostError> {
    let hit = LAST_TREE.with(|c| {
        c.borrow()
            .as_ref()
            .filter(|(m, n, r, _)| *r == root && m == members && n == nodes)
            .map(|(_, _, _, t)| t.clone())
    });
    if let Some(t) = hit {
        return Ok(t);
    }
    let t = Arc::new(build_tree(members, nodes, root)?);
    LAST_TREE.with(|c| *c.borrow_mut() = Some((members.to_vec(), nodes.to_vec(), root, t.clone())));
    Ok(t)
}

/// The SPs of a broadcast from `root`, grouped by node in tree order (see
/// the module docs); the first SP of each group is its node's leader.
pub fn build_tree(
    members: &[SpId],
    nodes: &[u32],
    root: Rank,
) -> Result<Vec<Vec<SpId>>, PostError> {
    let sp_node = sp_nodes(members, nodes).map_err(|sp| PostError::SpOnTwoNodes { sp })?;
    let mut node_sps: BTreeMap<u32, BTreeSet<SpId>> = BTreeMap::new();
    for (&sp, &n) in &sp_node {
        node_sps.entry(n).or_default().insert(sp);
    }
    let (root_sp, root_node) = (members[root as usize], nodes[root as usize]);
    let node_list: Vec<u32> = node_sps.keys().copied().collect();
    let start = node_list.iter().position(|&n| n == root_node).unwrap();
    let mut tree = Vec::with_capacity(node_list.len());
    for k in 0..node_list.len() {
        let n = node_list[(start + k) % node_list.len()];
        let sps: Vec<SpId> = node_sps[&n].iter().copied().collect();
        let first = if n == root_node {
            sps.iter().position(|&s| s == root_sp).unwrap()
        } else {
            0
        };
        tree.push(sps[first..].iter().chain(&sps[..first]).copied().collect());
    }
    Ok(tree)
}

/// What the first local post told about the communicator.
#[derive(Clone, Debug)]
pub(super) struct Topo {
    pub(super) members: Vec<SpId>,
    pub(super) nodes: Vec<u32>,
    /// Ranks served here, ascending.
    pub(super) local: Vec<Rank>,
    pub(super) design: Design,
}
