//! Checks of a host's descriptor against itself, the cluster and its grants: every number a
//! host sends is untrusted. Pure (no state of the SP but what the caller passes), so the
//! fuzzer drives it directly.

use algorithms::SpId;
use alias_mkey::{BackendData, Rights};
use bootstrap::wire::{ErrorCode, PostDesc, StagedDesign};
use bootstrap::Cluster;
use std::collections::HashSet;

/// Who posts: the SP it posts to, and the rank its connection said hello as.
#[derive(Clone, Copy, Debug)]
pub struct Poster {
    pub sp: SpId,
    pub world_rank: u32,
    pub world_size: u32,
}

/// Checks `d` from `poster` against the `cluster` (`ucx`: this SP serves `ucx` grants;
/// `shape`: the communicator as the instance's first local post described it, if any).
pub fn check_post(
    d: &PostDesc,
    poster: &Poster,
    cluster: &Cluster,
    ucx: bool,
    shape: Option<(&[SpId], &[u32])>,
) -> Result<(), (ErrorCode, String)> {
    let (world_rank, world_size) = (poster.world_rank, poster.world_size);
    let bad = |m: String| Err((ErrorCode::BadDescriptor, m));
    let p = d.members.len();
    if p == 0 || d.comm_rank as usize >= p {
        return bad(format!(
            "comm rank {} outside a communicator of {p}",
            d.comm_rank
        ));
    }
    // Who posts: only as itself. (Not a bad descriptor, which would abort the instance
    // for its members: a post under another rank's name must not affect that rank.)
    if d.world_ranks.len() != p {
        return bad(format!(
            "world_ranks has {} entries for {p} ranks",
            d.world_ranks.len()
        ));
    }
    let claimed = d.world_ranks[d.comm_rank as usize];
    if claimed != world_rank {
        return Err((
            ErrorCode::UnknownComm,
            format!(
                "this connection is world rank {world_rank}; comm rank {} is world rank \
                 {claimed}",
                d.comm_rank
            ),
        ));
    }
    // The kind's layout of the descriptor: its blocks, its staged fields, its root, its nodes
    // (as its facts say), then whatever more its driver checks.
    let facts = d.kind.facts();
    facts.check_layout(d).or_else(bad)?;
    (crate::drivers::spec(d.kind).check_desc)(d).or_else(bad)?;
    if let Some(st) = d
        .staged
        .as_ref()
        .filter(|st| st.design == StagedDesign::Hier)
    {
        let Some(seg) = &st.segment else {
            return bad("a hierarchical staged collective without its segment".into());
        };
        if seg.backend != BackendData::Cma
            || !seg.rights.contains(Rights::READ_WRITE)
            || seg.addr.checked_add(seg.len).is_none()
        {
            return bad(format!(
                "the segment grant ({} bytes, {}) must be read-write through cma",
                seg.len, seg.rights
            ));
        }
    }
    let n_sps = cluster.sps.len() as SpId;
    if let Some(sp) = d.members.iter().find(|&&sp| sp >= n_sps) {
        return Err((
            ErrorCode::UnknownComm,
            format!("member SP {sp} does not exist"),
        ));
    }
    if !d.nodes.is_empty() {
        // The node of each rank must be the node of its SP: the hierarchical collectives
        // route by node.
        for (r, (&sp, &node)) in d.members.iter().zip(&d.nodes).enumerate() {
            let sp_node = cluster.sp(sp).map(|e| e.node);
            if sp_node != Some(node) {
                return bad(format!(
                    "comm rank {r} is said to be on node {node}, but its SP {sp} is on \
                     node {sp_node:?}"
                ));
            }
        }
    }
    // Which SP serves a world rank is the job's (the ranks place themselves at `MPI_Init`):
    // the SP checks it against what its hellos and earlier descriptors said (server/post.rs).
    let mut seen = HashSet::with_capacity(p);
    for (r, &w) in d.world_ranks.iter().enumerate() {
        if w >= world_size || !seen.insert(w) {
            return bad(format!(
                "comm rank {r} is world rank {w}: outside the job's {world_size} ranks or \
                 named twice"
            ));
        }
    }
    if let Some((members, world_ranks)) = shape {
        if members != d.members.as_slice() || world_ranks != d.world_ranks.as_slice() {
            return bad(
                "the ranks of this collective describe its communicator differently".into(),
            );
        }
    }
    if d.members[d.comm_rank as usize] != poster.sp {
        return Err((
            ErrorCode::UnknownComm,
            format!(
                "comm rank {} is served by SP {}, not by SP {}",
                d.comm_rank, d.members[d.comm_rank as usize], poster.sp
            ),
        ));
    }
    let (recv_needs, recv_why) = (facts.recv_rights, facts.recv_rights_why);
    for (grant, need, counts, displs, what) in [
        (
            &d.send,
            Rights::READ,
            &d.send_counts,
            &d.send_displs,
            "send",
        ),
        (
            &d.recv,
            recv_needs,
            &d.recv_counts,
            &d.recv_displs,
            "receive",
        ),
    ] {
        if !grant.rights.contains(need) {
            let why = if what == "receive" { recv_why } else { "" };
            return bad(format!(
                "the {what} grant gives {} rights, {:?} needs {need}{why}",
                grant.rights, d.kind
            ));
        }
        match grant.backend {
            BackendData::Cma => {}
            BackendData::Ucx { .. } if ucx => {}
            BackendData::Ucx { .. } => {
                return bad(format!(
                    "the {what} grant is for the ucx backend, which this SP does not serve \
                     (UCX is off on it: see serve --ucx)"
                ))
            }
            BackendData::UcxExport { .. } if ucx => {}
            BackendData::UcxExport { .. } => {
                return bad(format!(
                    "the {what} grant is for the ucx-export backend, which this SP does not \
                     serve (UCX is off on it: see serve --ucx)"
                ))
            }
        }
        if grant.addr.checked_add(grant.len).is_none() {
            return bad(format!("the {what} grant wraps the address space"));
        }
        for (i, (&c, &o)) in counts.iter().zip(displs.iter()).enumerate() {
            match o.checked_add(c) {
                None => return bad(format!("{what} block {i}: {o} + {c} overflows")),
                Some(end) if end > grant.len => {
                    return bad(format!(
                        "{what} block {i} [{o}, {end}) lies outside the {} granted bytes",
                        grant.len
                    ))
                }
                Some(_) => {}
            }
        }
    }
    Ok(())
}
