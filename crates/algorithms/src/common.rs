//! Pieces shared by the collectives' state machines.

use std::collections::BTreeMap;

use crate::SpId;

/// The node of every SP serving a member (`members[r]` serves comm rank `r`
/// on node `nodes[r]`), or the first SP found serving ranks on two nodes.
pub(crate) fn sp_nodes(members: &[SpId], nodes: &[u32]) -> Result<BTreeMap<SpId, u32>, SpId> {
    let mut sp_node: BTreeMap<SpId, u32> = BTreeMap::new();
    for (&sp, &n) in members.iter().zip(nodes) {
        if *sp_node.entry(sp).or_insert(n) != n {
            return Err(sp);
        }
    }
    Ok(sp_node)
}
