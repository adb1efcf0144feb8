//! The shim and the SP agree on every collective kind: for each `CollKind` (every one in
//! `bootstrap::kinds::KINDS`, so a new kind is in it the day it is added), posts built as the
//! shim builds them (`post::lay_out`, `post::Draft::grant` and `post::Draft::view`, which
//! read the kind's facts) on random communicators, buffers, roots, designs and packings pass
//! the SP's checks
//! (`service_process::validate::check_post`), and the same post broken in one fact of its kind
//! (its node list, its receive rights, its staged fields, its root's empty side, its rank
//! order) is refused by them. A fact written twice, once where the shim reads it and once
//! where the SP does, in a way that can disagree (a kind's driver checking more than its facts
//! say, or the shim laying out a post otherwise than the facts say) fails here.
//!
//! Random, with the seed printed (`SPOFF_KINDS_SEED=N` replays one).

use crate::comm::CommInfo;
use crate::layout::TypeGeometry;
use crate::post::{lay_out, Draft, Side};
use crate::recycle::Recycled;
use algorithms::CommId;
use alias_mkey::{BackendData, Grant, Rights};
use bootstrap::kinds::{Blocks, KindFacts};
use bootstrap::wire::{PostDesc, StagedDesign};
use bootstrap::{Cluster, Layout};
use service_process::validate::{check_post, Poster};
use std::sync::atomic::AtomicU64;

/// A small xorshift generator: the tests need no more.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

/// 3 nodes x 2 SPs (nothing listens: only the shape matters to the checks).
fn cluster() -> Cluster {
    let sps = (0..6)
        .map(|i| bootstrap::cluster::SpEntry {
            id: i,
            node: i / 2,
            index: i % 2,
            peer_addr: "127.0.0.1:9".parse().unwrap(),
            host_socket: std::path::PathBuf::from(format!("/nonexistent/sp-{i}.sock")),
            host_addr: None,
        })
        .collect();
    Cluster::new(3, 2, None, Layout::Block, sps).expect("a valid fixed cluster")
}

/// Bytes: what the shim reads of `MPI_BYTE`.
const BYTES: TypeGeometry = TypeGeometry {
    size: 1,
    lb: 0,
    extent: 1,
    true_lb: 0,
    true_extent: 1,
    run: true,
};

/// A side of `counts` bytes at `displs` of a buffer at `buf` (`copy`: through the shim's
/// staging, as the send side of an `MPI_IN_PLACE` call).
fn side(buf: u64, counts: Vec<u64>, displs: Vec<u64>, copy: bool) -> Side {
    Side {
        buf: buf as *const std::os::raw::c_void,
        counts: Recycled::collect(counts.into_iter().map(|c| c as i64)),
        displs: Recycled::collect(displs.into_iter().map(|d| d as i64)),
        // SAFETY: a handle the layout never reads (only the packing does, not run here).
        ty: unsafe { std::mem::zeroed() },
        geo: BYTES,
        copy,
    }
}

/// Displacements of `counts` one after another in a random order with random gaps, or in
/// rank order without gaps (`ordered`).
fn displs(rng: &mut Rng, counts: &[u64], ordered: bool) -> Vec<u64> {
    let mut order: Vec<usize> = (0..counts.len()).collect();
    if !ordered {
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
    }
    let mut at = 0;
    let mut d = vec![0; counts.len()];
    for i in order {
        at += if ordered { 0 } else { rng.below(3) * 8 };
        d[i] = at;
        at += counts[i];
    }
    d
}

/// One random post of `f`'s kind as the shim builds it, and who posts it.
fn shim_post(rng: &mut Rng, f: &KindFacts) -> (PostDesc, Poster) {
    let p = 1 + rng.below(6) as usize;
    let me = rng.below(p as u64) as usize;
    let members: Vec<u32> = (0..p).map(|_| rng.below(6) as u32).collect();
    let nodes: Vec<u32> = members.iter().map(|sp| sp / 2).collect();
    let mut world_ranks: Vec<u32> = (0..p as u32).collect();
    for i in (1..p).rev() {
        world_ranks.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let info = CommInfo {
        id: CommId {
            leader: world_ranks[0],
            id: 1 + rng.below(9) as u32,
        },
        comm_rank: me as u32,
        members: members.clone(),
        world_ranks: world_ranks.clone(),
        max_per_node: 1,
        nodes,
        next_seq: AtomicU64::new(0),
    };
    // The message: a block per rank (equal ones where the kind wants rank order).
    let len = rng.below(40);
    let counts: Vec<u64> = (0..p)
        .map(|_| {
            if f.recv_rank_ordered {
                len
            } else {
                rng.below(40)
            }
        })
        .collect();
    let root = f.rooted.then(|| rng.below(p as u64) as u32);
    let is_root = root == Some(me as u32);
    // A side as the shim's interception gives it: a block per rank, or this rank's one block
    // (a rooted kind's data on the root's send side and the others' receive side, the other
    // side empty).
    let blocks = |rng: &mut Rng, b: Blocks, data: bool, ordered: bool| match b {
        Blocks::PerRank => (counts.clone(), displs(rng, &counts, ordered)),
        Blocks::One if !data => (vec![0], vec![0]),
        Blocks::One => (vec![counts[me]], vec![0]),
    };
    let (sc, sd) = blocks(rng, f.send_blocks, !f.rooted || is_root, false);
    let (rc, rd) = blocks(
        rng,
        f.recv_blocks,
        !f.rooted || !is_root,
        f.recv_rank_ordered,
    );
    let (send_buf, recv_buf) = (0x10_0000 + rng.below(64) * 8, 0x80_0000 + rng.below(64) * 8);
    let send = side(send_buf, sc, sd, rng.coin());
    let recv = side(recv_buf, rc, rd, false);
    let (s, r) = (
        lay_out(&send, false).expect("valid counts"),
        lay_out(&recv, f.recv_rank_ordered).expect("valid counts"),
    );
    let design = f.posts_staged_fields().then(|| {
        if f.is_staged() && rng.coin() {
            StagedDesign::Hier
        } else {
            StagedDesign::Flat
        }
    });
    let staging = 0x4000_0000;
    let draft = Draft {
        kind: f.kind,
        seq: rng.below(1000),
        send: (s.bytes, s.direct.unwrap_or(staging), s.direct.is_none()),
        recv: (
            r.bytes,
            r.direct.unwrap_or(staging + 0x10_0000),
            r.direct.is_none(),
        ),
        blocking: rng.coin(),
        host_copies_enabled: rng.coin(),
        root,
        design,
        segment: (design == Some(StagedDesign::Hier)).then_some((0x7000_0000, 1 << 20)),
        // Bytes: any length is whole elements.
        reduce: f.reduces.then_some(algorithms::allreduce::Reduce {
            op: algorithms::allreduce::Op::Bor,
            elem: algorithms::allreduce::Elem::U8,
        }),
    };
    let mut region = 0;
    let grants = draft.grant(&info, |addr, len, rights, _segment| {
        region += 1;
        Grant {
            region,
            generation: 0,
            addr,
            len,
            rights,
            backend: BackendData::Cma,
        }
    });
    let d = draft
        .view(&info, &grants, Some(0), 1, Default::default())
        .to_desc();
    let poster = Poster {
        sp: members[me],
        world_rank: world_ranks[me],
        world_size: p as u32,
    };
    (d, poster)
}

/// What the SP says of `d` from `poster`.
fn sp_check(d: &PostDesc, poster: &Poster, cluster: &Cluster) -> Result<(), String> {
    check_post(d, poster, cluster, false, None).map_err(|(code, why)| format!("{code:?}: {why}"))
}

/// The same post broken in one fact of its kind, each with what was broken (those that apply
/// to this post).
fn broken(f: &KindFacts, d: &PostDesc) -> Vec<(&'static str, PostDesc)> {
    let mut out = vec![];
    let p = d.members.len();
    if f.lists_nodes {
        let mut b = d.clone();
        b.nodes.clear();
        out.push(("no node list", b));
    }
    if f.recv_rights != Rights::WRITE {
        let mut b = d.clone();
        b.recv.rights = Rights::WRITE;
        out.push(("receive grant write-only", b));
    }
    let mut b = d.clone();
    b.staged = match &d.staged {
        Some(_) => None,
        None => Some(bootstrap::wire::Staged {
            root: 0,
            design: StagedDesign::Flat,
            segment: None,
        }),
    };
    out.push(("staged fields flipped", b));
    let mut b = d.clone();
    b.reduce = match d.reduce {
        Some(_) => None,
        None => Some(algorithms::allreduce::Reduce {
            op: algorithms::allreduce::Op::Sum,
            elem: algorithms::allreduce::Elem::U8,
        }),
    };
    out.push(("reduction flipped", b));
    if f.rooted {
        let mut b = d.clone();
        let root = d.staged.as_ref().map_or(0, |st| st.root);
        let other = if root == d.comm_rank {
            &mut b.recv_counts
        } else {
            &mut b.send_counts
        };
        other[0] = 1;
        out.push(("root's other side not empty", b));
        let mut b = d.clone();
        if let Some(st) = b.staged.as_mut() {
            st.root = p as u32;
        }
        out.push(("root outside the communicator", b));
    }
    if f.recv_rank_ordered && p >= 2 && d.send_counts[0] > 0 {
        let mut b = d.clone();
        b.recv_displs.swap(0, 1);
        out.push(("receive blocks out of rank order", b));
    }
    let mut b = d.clone();
    b.send_counts.push(0);
    b.send_displs.push(0);
    out.push(("a send block too many", b));
    let mut b = d.clone();
    b.recv_counts.push(0);
    b.recv_displs.push(0);
    out.push(("a receive block too many", b));
    out
}

#[test]
fn shim_posts_of_every_kind_pass_the_sp_checks_and_broken_facts_do_not() {
    let seed = std::env::var("SPOFF_KINDS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("SPOFF_KINDS_SEED={seed}");
    let mut rng = Rng(seed);
    let cluster = cluster();
    let mut checked = 0;
    for f in bootstrap::kinds::KINDS {
        let mut refused = std::collections::BTreeSet::new();
        for round in 0..500 {
            let (d, poster) = shim_post(&mut rng, f);
            if let Err(why) = sp_check(&d, &poster, &cluster) {
                panic!(
                    "seed {seed}, {:?} round {round}: the SP refuses the shim's post: {why}\n{d:#?}",
                    f.kind
                );
            }
            for (what, b) in broken(f, &d) {
                assert!(
                    sp_check(&b, &poster, &cluster).is_err(),
                    "seed {seed}, {:?} round {round}: the SP takes a post with {what}\n{b:#?}",
                    f.kind
                );
                refused.insert(what);
            }
            checked += 1;
        }
        eprintln!("{:?} ({}): refused {refused:?}", f.kind, f.name);
    }
    eprintln!("{checked} shim posts checked by the SP");
}

/// The shim's descriptor says what the kind's facts say: its node list, its receive rights,
/// its staged fields and host copies (the second way of writing a fact: in the shim's code).
#[test]
fn shim_posts_say_what_their_facts_say() {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    for f in bootstrap::kinds::KINDS {
        for _ in 0..200 {
            let (d, _) = shim_post(&mut rng, f);
            assert_eq!(d.kind, f.kind);
            assert_eq!(!d.nodes.is_empty(), f.lists_nodes, "{:?}", f.kind);
            assert_eq!(d.recv.rights, f.recv_rights, "{:?}", f.kind);
            assert_eq!(d.send.rights, Rights::READ, "{:?}", f.kind);
            assert_eq!(d.staged.is_some(), f.posts_staged_fields(), "{:?}", f.kind);
            assert_eq!(d.send_counts.len(), f.send_blocks.entries(d.members.len()));
            assert_eq!(d.recv_counts.len(), f.recv_blocks.entries(d.members.len()));
            let hier = d
                .staged
                .as_ref()
                .is_some_and(|st| st.design == StagedDesign::Hier);
            if d.host_copies && !hier {
                assert!(f.host_copies, "{:?}: host copies it does not have", f.kind);
            }
        }
    }
}
