//! What each collective kind is, in one table read by every side: the host shim (how it lays
//! out and grants a post, the design variable it reads, its messages), the SP (the layout
//! checks of a descriptor in `validate`, the rights its grants need, staging, host copies,
//! its messages), the fuzzer's post builders and the tests. A fact of a kind is written here
//! once, as a field of its [`KindFacts`]; what depends on it reads `kind.facts()`. What only
//! the SP's engine needs of a kind (how to make an instance, its messages' meaning to the
//! engine) stays in the SP's `drivers::KindSpec`.
//!
//! Adding a kind: a `CollKind` variant (`wire.rs`), its `KindFacts` here (a `static`, an arm in
//! [`CollKind::facts`] and an entry in [`KINDS`]), and an arm in [`CollMsg::kind`]. The
//! compiler asks for the arms; `tests` checks that [`KINDS`] lists every variant in order.

use crate::wire::{CollKind, CollMsg, PostDesc};
use alias_mkey::Rights;

/// How a kind's instances move their bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Copies from one rank's grant straight into another's; no staging, no root or design in
    /// the post (`PostDesc::staged` is `None`).
    Direct,
    /// Through staging slots of the SPs (instances take slots from the SP's budget); the post
    /// names its root and design (`PostDesc::staged`), flat or hierarchical (a node segment).
    Staged,
    /// Over the SPs' multicast fabric, landed by their receive workers (their own staging,
    /// not the budget's slots); the post names its root in `PostDesc::staged` (design `Flat`).
    Multicast,
    /// Aggregated in the network by Canary switches (the SP's socket on its leaf link, its
    /// worker thread); no root or design in the post (`PostDesc::staged` is `None`).
    InNetwork,
}

/// How many blocks one side of a post lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocks {
    /// One block, at offset 0 of its grant.
    One,
    /// One block per comm rank.
    PerRank,
}

impl Blocks {
    /// The entries of a side's counts and displacements on a communicator of `p` ranks.
    pub fn entries(self, p: usize) -> usize {
        match self {
            Blocks::One => 1,
            Blocks::PerRank => p,
        }
    }
}

/// Everything about a collective kind that more than one side of the system relies on.
#[derive(Debug)]
pub struct KindFacts {
    pub kind: CollKind,
    /// The kind in messages (`cannot post {name} #3 ...`).
    pub name: &'static str,
    pub family: Family,
    /// The blocks of the send and the receive side.
    pub send_blocks: Blocks,
    pub recv_blocks: Blocks,
    /// The receive blocks are equal and in rank order (block `i` at `i * len`, `len` the send
    /// block): the shim packs a receive side laid out otherwise.
    pub recv_rank_ordered: bool,
    /// The post's root (`Staged::root`) counts: the root's receive side is empty, every other
    /// rank's send side is (the root only sends, the others only receive).
    pub rooted: bool,
    /// The post lists the node of every comm rank (`PostDesc::nodes`): the kind routes by node.
    pub lists_nodes: bool,
    /// The rights the receive grant gives (the send grant's are always `READ`), and why when
    /// that is more than writing (said in the SP's refusal).
    pub recv_rights: Rights,
    pub recv_rights_why: &'static str,
    /// A rank waiting in a blocking call copies the data already on its node itself when the
    /// SP asks it to (`PostDesc::host_copies`, unless `SPOFF_HOST_COPIES=0`).
    pub host_copies: bool,
    /// The environment variable that chooses the kind's design (`flat`, `hier`, `auto`), for
    /// a staged kind.
    pub design_var: Option<&'static str>,
    /// The post carries its reduction (`PostDesc::reduce`: the operation and element type the
    /// SPs combine the ranks' blocks with).
    pub reduces: bool,
    /// Ranks on one node from which `auto` picks the hierarchical design (the reasons are in
    /// docs/BENCHMARKS.md, section G and its notes: measured here, flat mostly costs less at
    /// 1, 2 and 4 ranks per node for both staged kinds; in the simulator at 32 nodes with 1 SP
    /// per node the hierarchical Iallgather wins clearly from 8 ranks per node, the
    /// hierarchical Ibcast only from 32). Unused by a direct kind.
    pub hier_min_ranks: usize,
}

/// The ring Alltoallv: a block per rank each way.
pub static ALLTOALLV: KindFacts = KindFacts {
    kind: CollKind::Alltoallv,
    name: "alltoallv",
    family: Family::Direct,
    send_blocks: Blocks::PerRank,
    recv_blocks: Blocks::PerRank,
    recv_rank_ordered: false,
    rooted: false,
    lists_nodes: false,
    recv_rights: Rights::WRITE,
    recv_rights_why: "",
    host_copies: false,
    design_var: None,
    reduces: false,
    hier_min_ranks: 0,
};

/// The hierarchical, load-balanced Allgather(v): this rank's block, every rank's block back.
pub static ALLGATHERV: KindFacts = KindFacts {
    kind: CollKind::Allgatherv,
    name: "allgatherv",
    family: Family::Direct,
    send_blocks: Blocks::One,
    recv_blocks: Blocks::PerRank,
    recv_rank_ordered: false,
    rooted: false,
    lists_nodes: true,
    // Once a segment landed in one rank of a node, the node's other ranks copy it from that
    // rank's receive buffer.
    recv_rights: Rights::READ_WRITE,
    recv_rights_why: " (the node's other ranks copy segments out of it)",
    host_copies: true,
    design_var: None,
    reduces: false,
    hier_min_ranks: 0,
};

/// The staged Bcast, flat or hierarchical: one block each way, the root's to send.
pub static BCAST: KindFacts = KindFacts {
    kind: CollKind::Bcast,
    name: "bcast",
    family: Family::Staged,
    send_blocks: Blocks::One,
    recv_blocks: Blocks::One,
    recv_rank_ordered: false,
    rooted: true,
    lists_nodes: true,
    recv_rights: Rights::WRITE,
    recv_rights_why: "",
    host_copies: false,
    design_var: Some("SPOFF_BCAST_DESIGN"),
    reduces: false,
    hier_min_ranks: 32,
};

/// The staged Iallgather, flat or hierarchical: equal blocks in rank order.
pub static STAGED_ALLGATHER: KindFacts = KindFacts {
    kind: CollKind::StagedAllgather,
    name: "staged allgather",
    family: Family::Staged,
    send_blocks: Blocks::One,
    recv_blocks: Blocks::PerRank,
    recv_rank_ordered: true,
    rooted: false,
    lists_nodes: true,
    recv_rights: Rights::WRITE,
    recv_rights_why: "",
    host_copies: false,
    design_var: Some("SPOFF_IALLGATHER_DESIGN"),
    reduces: false,
    hier_min_ranks: 8,
};

/// The multicast Bcast: laid out as the staged Bcast; chosen by `SPOFF_BCAST_DESIGN=mcast`.
pub static MCAST_BCAST: KindFacts = KindFacts {
    kind: CollKind::McastBcast,
    name: "mcast bcast",
    family: Family::Multicast,
    send_blocks: Blocks::One,
    recv_blocks: Blocks::One,
    recv_rank_ordered: false,
    rooted: true,
    lists_nodes: false,
    // The next SP of the ring reads the chunks this rank's SP lacked out of this buffer.
    recv_rights: Rights::READ_WRITE,
    recv_rights_why: " (the next SP of the multicast ring fetches missing chunks out of it)",
    host_copies: false,
    design_var: None,
    reduces: false,
    hier_min_ranks: 0,
};

/// The SP-tree Allreduce: one block each way, reduced in SP memory; chosen by
/// `SPOFF_ALLREDUCE_DESIGN=sp-tree` (or `auto`).
pub static ALLREDUCE: KindFacts = KindFacts {
    kind: CollKind::Allreduce,
    name: "allreduce",
    family: Family::Direct,
    send_blocks: Blocks::One,
    recv_blocks: Blocks::One,
    recv_rank_ordered: false,
    rooted: false,
    lists_nodes: false,
    recv_rights: Rights::WRITE,
    recv_rights_why: "",
    host_copies: false,
    design_var: None,
    reduces: true,
    hier_min_ranks: 0,
};

/// The multicast Allgather: laid out as the staged Iallgather; chosen by
/// `SPOFF_IALLGATHER_DESIGN=mcast` (for `MPI_Allgather` and `MPI_Iallgather`).
pub static MCAST_ALLGATHER: KindFacts = KindFacts {
    kind: CollKind::McastAllgather,
    name: "mcast allgather",
    family: Family::Multicast,
    send_blocks: Blocks::One,
    recv_blocks: Blocks::PerRank,
    recv_rank_ordered: true,
    rooted: false,
    lists_nodes: false,
    recv_rights: Rights::READ_WRITE,
    recv_rights_why: " (the next SP of the multicast ring fetches missing chunks out of it)",
    host_copies: false,
    design_var: None,
    reduces: false,
    hier_min_ranks: 0,
};

/// The Canary allreduce: laid out as the SP-tree one; chosen by
/// `SPOFF_ALLREDUCE_DESIGN=canary` (or `auto`, on a cluster whose SPs have Canary links).
pub static CANARY_ALLREDUCE: KindFacts = KindFacts {
    kind: CollKind::CanaryAllreduce,
    name: "canary allreduce",
    family: Family::InNetwork,
    ..ALLREDUCE
};

/// Every kind, in the order of `CollKind`'s variants (checked by the tests).
pub static KINDS: [&KindFacts; 8] = [
    &ALLTOALLV,
    &ALLGATHERV,
    &BCAST,
    &STAGED_ALLGATHER,
    &MCAST_BCAST,
    &MCAST_ALLGATHER,
    &ALLREDUCE,
    &CANARY_ALLREDUCE,
];

impl CollKind {
    /// The kind's facts.
    pub fn facts(self) -> &'static KindFacts {
        match self {
            CollKind::Alltoallv => &ALLTOALLV,
            CollKind::Allgatherv => &ALLGATHERV,
            CollKind::Bcast => &BCAST,
            CollKind::StagedAllgather => &STAGED_ALLGATHER,
            CollKind::McastBcast => &MCAST_BCAST,
            CollKind::McastAllgather => &MCAST_ALLGATHER,
            CollKind::Allreduce => &ALLREDUCE,
            CollKind::CanaryAllreduce => &CANARY_ALLREDUCE,
        }
    }

    /// Whether a small call of this kind may go through the rank's arena (`crate::post_ring`),
    /// which the shim and the SP must agree on: the kinds whose work at an SP that serves
    /// every rank is plain copies between the ranks' sides on the SP's loop thread (not the
    /// reductions, not the multicast fabric's workers; a node segment is ruled out per call).
    pub fn takes_arena(self) -> bool {
        matches!(
            self,
            CollKind::Alltoallv
                | CollKind::Allgatherv
                | CollKind::Bcast
                | CollKind::StagedAllgather
        )
    }

    /// Every kind, in the order of the variants.
    pub fn all() -> impl Iterator<Item = CollKind> {
        KINDS.iter().map(|f| f.kind)
    }
}

impl CollMsg {
    /// The kind a peer message belongs to.
    pub fn kind(&self) -> CollKind {
        match self {
            CollMsg::Alltoallv(_) => CollKind::Alltoallv,
            CollMsg::Allgatherv(_) => CollKind::Allgatherv,
            CollMsg::Bcast(_) => CollKind::Bcast,
            CollMsg::StagedAllgather(_) => CollKind::StagedAllgather,
            CollMsg::McastBcast(_) => CollKind::McastBcast,
            CollMsg::McastAllgather(_) => CollKind::McastAllgather,
            CollMsg::Allreduce(_) => CollKind::Allreduce,
            CollMsg::CanaryAllreduce(_) => CollKind::CanaryAllreduce,
        }
    }
}

impl KindFacts {
    /// A staged kind: its instances hold staging slots from the SP's budget, and its post
    /// chooses a design (flat or hierarchical).
    pub fn is_staged(&self) -> bool {
        self.family == Family::Staged
    }

    /// The post carries `PostDesc::staged` (its root, its design): the staged and multicast
    /// ones (a multicast kind's design is always `Flat`).
    pub fn posts_staged_fields(&self) -> bool {
        matches!(self.family, Family::Staged | Family::Multicast)
    }

    /// The layout of descriptor `d` (of this kind, on a communicator of `d.members.len() >= 1`
    /// ranks, `d.comm_rank` inside it) as the kind's facts require it: its blocks and where
    /// they start, its staged fields, its root, its node list. The SP runs it on every post
    /// (`validate::check_post`); the rights of the grants and their bounds are checked there.
    pub fn check_layout(&self, d: &PostDesc) -> Result<(), String> {
        let p = d.members.len();
        let name = self.name;
        for (field, v, want) in [
            ("send_counts", &d.send_counts, self.send_blocks),
            ("send_displs", &d.send_displs, self.send_blocks),
            ("recv_counts", &d.recv_counts, self.recv_blocks),
            ("recv_displs", &d.recv_displs, self.recv_blocks),
        ] {
            let want = want.entries(p);
            if v.len() != want {
                return Err(format!(
                    "{field} has {} entries, expected {want} ({name})",
                    v.len()
                ));
            }
        }
        for (side, blocks, displs) in [
            ("send", self.send_blocks, &d.send_displs),
            ("receive", self.recv_blocks, &d.recv_displs),
        ] {
            if blocks == Blocks::One && displs[0] != 0 {
                return Err(format!(
                    "the {name} {side} block must start at offset 0 of its grant"
                ));
            }
        }
        if self.reduces != d.reduce.is_some() {
            return Err(if self.reduces {
                format!("a {name} post without its operation and type")
            } else {
                format!("a {name} post names a reduction")
            });
        }
        if self.lists_nodes && d.nodes.len() != p {
            return Err(format!("nodes has {} entries for {p} ranks", d.nodes.len()));
        }
        match (&d.staged, self.family) {
            (Some(_), Family::Direct | Family::InNetwork) => {
                return Err(format!("{name} is not a staged collective"));
            }
            (None, Family::Staged | Family::Multicast) => {
                return Err(format!(
                    "a {name} post without its {}",
                    if self.rooted {
                        "root and design"
                    } else {
                        "design"
                    }
                ));
            }
            _ => {}
        }
        if self.rooted {
            let root = d.staged.as_ref().map_or(0, |st| st.root);
            if root as usize >= p {
                return Err(format!("root {root} outside a communicator of {p}"));
            }
            let is_root = root == d.comm_rank;
            // The side that is not the data (one block each: `Blocks::One` on both sides).
            let empty = if is_root {
                d.recv_counts.iter().sum::<u64>()
            } else {
                d.send_counts.iter().sum::<u64>()
            };
            if empty != 0 {
                return Err(format!(
                    "a {name} {} sends nothing else: {empty} bytes on its other side",
                    if is_root { "root" } else { "receiver" }
                ));
            }
        }
        if self.recv_rank_ordered {
            let len = d.send_counts.first().copied().unwrap_or(0);
            let ordered = d.recv_counts.len() == p
                && (0..p as u64).all(|i| {
                    d.recv_counts[i as usize] == len
                        && i.checked_mul(len) == Some(d.recv_displs[i as usize])
                });
            if !ordered || len.checked_mul(p as u64).is_none() {
                return Err(format!(
                    "a {name} needs {p} blocks of {len} bytes in rank order"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `KINDS` lists every variant of `CollKind`, in the order of the variants (a variant's
    /// index on the wire is its position): a variant without an entry, or two entries for one
    /// kind, fails here.
    #[test]
    fn the_table_lists_every_kind_once_in_wire_order() {
        for (i, f) in KINDS.iter().enumerate() {
            assert_eq!(
                crate::wire::decode::<CollKind>(&[i as u8]).ok(),
                Some(f.kind),
                "KINDS[{i}] is {:?}",
                f.kind
            );
            assert!(std::ptr::eq(f.kind.facts(), *f), "{:?}", f.kind);
        }
        assert!(
            crate::wire::decode::<CollKind>(&[KINDS.len() as u8]).is_err(),
            "a CollKind variant is missing from KINDS"
        );
        let mut names: Vec<&str> = KINDS.iter().map(|f| f.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), KINDS.len(), "two kinds share a name");
    }

    /// Facts that only make sense together.
    #[test]
    fn the_facts_of_each_kind_fit_together() {
        for f in KINDS {
            let k = f.kind;
            // A staged kind chooses its design; a direct kind has none.
            assert_eq!(f.design_var.is_some(), f.is_staged(), "{k:?}");
            assert_eq!(f.hier_min_ranks > 0, f.is_staged(), "{k:?}");
            // A root sends one block and receives one: the rest of the post is empty.
            if f.rooted {
                assert!(
                    f.posts_staged_fields(),
                    "{k:?}: a root is carried in the staged fields"
                );
                assert_eq!((f.send_blocks, f.recv_blocks), (Blocks::One, Blocks::One));
            }
            // Rank order is the order of a block per rank, of the one send block's length.
            if f.recv_rank_ordered {
                assert_eq!(
                    (f.send_blocks, f.recv_blocks),
                    (Blocks::One, Blocks::PerRank)
                );
            }
            // The receive grant is always written; reading it is said why.
            assert!(f.recv_rights.contains(Rights::WRITE), "{k:?}");
            assert_eq!(
                f.recv_rights.contains(Rights::READ),
                !f.recv_rights_why.is_empty(),
                "{k:?}"
            );
        }
    }
}
