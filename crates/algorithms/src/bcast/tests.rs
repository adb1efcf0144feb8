use super::*;
use crate::sim::testnet::{Machine, Out};
use crate::test_util::*;

type Tag = (char, Rank);

crate::sim::testnet::staged_test_basics!(Bcast, comm: 7);

/// A copy or a move, as the test network executes them.
#[derive(Clone, Debug)]
enum Work {
    C(Copy<Tag>),
    M(Move),
}

/// The machine plus the `Chunk` messages of finished moves (the
/// driver's job), which `poll` hands out first.
struct Tb {
    m: Bcast<Tag>,
    out: VecDeque<Out<Msg, Work>>,
}

impl Machine for Tb {
    type Post = Post<Tag>;
    type Msg = Msg;
    type Copy = Work;

    fn create(sp: SpId) -> Self {
        Tb {
            m: new_machine(sp),
            out: VecDeque::new(),
        }
    }

    forward_inputs!(m);

    fn copy_done(&mut self, now: Nanos, w: &Work, status: Status) {
        match w {
            Work::C(c) => self.m.handle_copy_done(now, c.id, status),
            Work::M(mv) => {
                if status.is_ok() {
                    self.out.push_back(Out::Send {
                        to: mv.to,
                        msg: mv.chunk_msg(),
                    });
                }
                self.m.handle_move_done(now, mv.id, status);
            }
        }
    }

    fn poll(&mut self) -> Option<Out<Msg, Work>> {
        if let Some(o) = self.out.pop_front() {
            return Some(o);
        }
        Some(match self.m.poll_action()? {
            Action::Send { to, msg } => Out::Send { to, msg },
            Action::Copy(c) => Out::Copy(Work::C(c)),
            Action::Move(m) => Out::Copy(Work::M(m)),
            Action::Complete { rank, status, .. } => Out::Complete { rank, status },
        })
    }

    fn check_copy(&self, _sp: SpId, w: &Work) {
        match w {
            Work::C(c) => assert!(c.len > 0 && c.len <= CHUNK, "{c:?}"),
            Work::M(m) => assert!(m.len > 0 && m.len <= CHUNK, "{m:?}"),
        }
    }
}

instance!(Tb, m);

type Net = crate::sim::testnet::Net<Tb>;

fn post(rank: Rank, root: Rank, len: u64, members: &[SpId], nodes: &[u32]) -> Post<Tag> {
    Post {
        rank,
        root,
        members: members.to_vec(),
        nodes: nodes.to_vec(),
        key: ('b', rank),
        len,
        design: Design::Flat,
        shared_key: None,
        shared_at: 0,
    }
}

fn moves(net: &Net) -> Vec<Move> {
    net.copied
        .iter()
        .filter_map(|w| match w {
            Work::M(m) => Some(*m),
            Work::C(_) => None,
        })
        .collect()
}

fn copies(net: &Net) -> Vec<Copy<Tag>> {
    net.copied
        .iter()
        .filter_map(|w| match w {
            Work::C(c) => Some(c.clone()),
            Work::M(_) => None,
        })
        .collect()
}

/// Every rank posts a flat 10-byte broadcast from rank 0 on `sps` SPs;
/// the net runs until quiet and every rank completed `Ok`.
fn all_post_and_succeed(members: &[SpId], nodes: &[u32], sps: u32) -> Net {
    let ranks = 0..members.len() as Rank;
    let mut net = posted(sps, members, ranks, |r| post(r, 0, 10, members, nodes));
    run_all_ok(&mut net, members.len());
    net
}

/// The instance of SP `me` with its own chunk size and staging slots.
fn machine(me: SpId, chunk_bytes: u64, staging_slots: u32) -> Bcast<Tag> {
    Bcast::new(
        KEY,
        Config {
            me,
            chunk_bytes,
            staging_slots,
        },
    )
}

#[test]
fn tree_starts_at_the_root_sp_then_nodes_in_ring_order() {
    // Node 0: SPs 0, 1; node 1: SPs 2, 3; node 2: SP 4.
    let members = [0, 1, 2, 3, 4, 3, 2];
    let nodes = [0, 0, 1, 1, 2, 1, 1];
    let tree = |root| std::sync::Arc::new(build_tree(&members, &nodes, root).unwrap());
    assert_eq!(*tree(3), [vec![3, 2], vec![4], vec![0, 1]]);
    assert_eq!(*tree(4), [vec![4], vec![0, 1], vec![2, 3]]);
    assert_eq!(*tree(1), [vec![1, 0], vec![2, 3], vec![4]]);
    assert_eq!(
        build_tree(&[0, 0], &[0, 1], 0),
        Err(PostError::SpOnTwoNodes { sp: 0 })
    );
    // Leaders chain from node to node and fan out within their node.
    let v = View::new(3, 3, 8, 4, tree(3)).unwrap();
    assert!(v.is_top());
    assert_eq!((v.parent(), v.children()), (None, vec![4, 2]));
    let v = View::new(2, 3, 8, 4, tree(3)).unwrap();
    assert_eq!((v.parent(), v.children()), (Some(3), vec![]));
    let v = View::new(0, 3, 8, 4, tree(3)).unwrap();
    assert_eq!((v.parent(), v.children()), (Some(4), vec![1]));
    let v = View::new(1, 3, 8, 4, tree(3)).unwrap();
    assert_eq!((v.parent(), v.children()), (Some(0), vec![]));
}

#[test]
fn the_tree_kept_from_the_last_build_is_used_only_for_the_same_members_nodes_and_root() {
    use std::sync::Arc;
    let (members, nodes) = ([0, 1, 2, 3, 4, 3, 2], [0, 0, 1, 1, 2, 1, 1]);
    let a = shared_tree(&members, &nodes, 3).unwrap();
    let b = shared_tree(&members, &nodes, 3).unwrap();
    assert!(
        Arc::ptr_eq(&a, &b),
        "the same communicator and root reuse the build"
    );
    for (m, n, root) in [
        (&members[..], &nodes[..], 4),
        (&members[..], &nodes[..], 2),
        (&[0, 1, 2, 3, 4, 3, 3][..], &nodes[..], 3),
        (&members[..], &[0, 0, 1, 1, 3, 1, 1][..], 3),
        (&members[..6], &nodes[..6], 3),
    ] {
        let c = shared_tree(m, n, root).unwrap();
        assert!(!Arc::ptr_eq(&a, &c), "{m:?} {n:?} root {root}");
        assert_eq!(
            *c,
            build_tree(m, n, root).unwrap(),
            "what is kept is what a build gives"
        );
    }
    // An SP on two nodes is refused whether or not a tree is kept.
    assert!(shared_tree(&members, &[0, 0, 1, 1, 2, 2, 1], 3).is_err());
    assert!(shared_tree(&members, &nodes, 3).is_ok());
    assert!(shared_tree(&members, &[0, 0, 1, 1, 2, 2, 1], 3).is_err());
}

#[test]
fn a_node_leader_fans_out_to_its_nodes_other_sps() {
    // Node 0: SPs 0, 1; node 1: SPs 2, 3 (one rank each).
    let mut net = all_post_and_succeed(&[0, 1, 2, 3], &[0, 0, 1, 1], 4);
    // 3 chunks to each of SPs 1, 2 (both from SP 0) and 3 (from SP 2).
    let mv = moves(&net);
    assert_eq!(mv.len(), 9);
    for to in 1..4 {
        assert_eq!(mv.iter().filter(|m| m.to == to).count(), 3, "to SP {to}");
    }
    assert_eq!(net.sp(0).m.stats().chunks_forwarded, 6);
    assert_eq!(net.sp(2).m.stats().chunks_forwarded, 3);
    assert_eq!(net.sp(1).m.stats().chunks_forwarded, 0);
    assert_eq!(net.sp(3).m.stats().chunks_forwarded, 0);
    assert_eq!(net.sp(3).m.tree(), Some(&[vec![0, 1], vec![2, 3]][..]));
    all_finished(&mut net, &[0, 1, 2, 3]);
}

#[test]
fn flat_pipeline_delivers_every_chunk_once_per_hop() {
    // Node 0: SP 0 (ranks 0, 3), node 1: SP 1 (rank 1), SP 2 (rank 2).
    let mut net = all_post_and_succeed(&[0, 1, 2, 0], &[0, 1, 1, 0], 3);
    // 3 chunks (4 + 4 + 2 bytes), two hops.
    let mv = moves(&net);
    assert_eq!(mv.len(), 6);
    assert_eq!(mv.iter().filter(|m| m.to == 1).count(), 3);
    assert_eq!(mv.iter().filter(|m| m.to == 2).count(), 3);
    assert_eq!(mv.iter().map(|m| m.len).sum::<u64>(), 20);
    let c = copies(&net);
    // Three reads from the root, three writes into each non-root rank.
    assert_eq!(c.iter().filter(|c| c.rank == 0).count(), 3);
    for r in 1..4 {
        let into: Vec<_> = c.iter().filter(|c| c.rank == r).collect();
        assert_eq!(into.len(), 3, "rank {r}");
        assert!(into.iter().all(|c| matches!(
            c.dst,
            Loc::Host { key: ('b', k), offset } if k == r && offset == c.chunk * CHUNK
        )));
    }
    for sp in 0..3 {
        let s = net.sp(sp).m.stats();
        assert!(s.max_slots_in_use as usize <= SLOTS as usize, "{s:?}");
        assert_eq!(s.bytes_staged, 10);
    }
    assert_eq!(net.sp(0).m.stats().chunks_forwarded, 3);
    assert_eq!(net.sp(2).m.stats().chunks_forwarded, 0);
    all_finished(&mut net, &[0, 1, 2]);
}

/// Three SPs on three nodes, rank `r` alone on SP `r` and node `r`.
const CHAIN: [u32; 3] = [0, 1, 2];

/// On [`CHAIN`], ranks 0 and 2 post (in the order `order`) a broadcast of
/// `len` bytes from rank 0, and the net runs until quiet; rank 1 has not
/// posted.
fn chain_but_rank_1(order: [Rank; 2], len: u64) -> Net {
    let mut net: Net = posted(3, &CHAIN, order, |r| post(r, 0, len, &CHAIN, &CHAIN));
    net.run();
    net
}

#[test]
fn late_sp_forwards_what_fits_in_staging_and_catches_up() {
    // Chain 0 -> 1 -> 2 (one SP per node); SP 1's rank posts last.
    let mut net = chain_but_rank_1([2, 0], 10);
    // SP 1 learned the tree from SP 0's Open and forwarded the two
    // chunks its two slots hold; the root's SP read all three.
    assert_eq!(net.sp(1).m.tree(), Some(&[vec![0], vec![1], vec![2]][..]));
    assert_eq!(net.sp(1).m.stats().chunks_forwarded, 2);
    assert_eq!(net.sp(1).m.slots_in_use(), 2);
    assert_eq!(net.status(0), Some(Status::Ok));
    assert_eq!(net.status(2), None);
    net.post(1, post(1, 0, 10, &CHAIN, &CHAIN));
    net.run();
    net.expect_status(&[1, 2], Some(Status::Ok));
    all_finished(&mut net, &[0, 1, 2]);
}

#[test]
fn a_one_chunk_message_passes_an_sp_whose_rank_has_not_posted() {
    let mut net = chain_but_rank_1([0, 2], 3);
    net.expect_status(&[0, 2], Some(Status::Ok));
    assert_eq!(net.status(1), None);
    net.post(1, post(1, 0, 3, &CHAIN, &CHAIN));
    net.run();
    assert_eq!(net.status(1), Some(Status::Ok));
    all_finished(&mut net, &[0, 1, 2]);
}

#[test]
fn hier_writes_each_chunk_once_into_the_writers_segment() {
    // SP 0: root 0 and rank 3; SP 1: ranks 1, 2, 4.
    let (members, nodes) = ([0, 1, 1, 0, 1], [0, 1, 1, 0, 1]);
    let mut net: Net = posted(2, &members, [4, 2, 0, 3, 1], |r| {
        hier(post(r, 0, 9, &members, &nodes))
    });
    run_all_ok(&mut net, members.len());
    let c = copies(&net);
    let writes: Vec<_> = c.iter().filter(|c| c.rank != 0).collect();
    // SP 0 writes into rank 3's segment, SP 1 into rank 1's: 3 chunks each.
    assert_eq!(writes.len(), 6);
    assert!(writes.iter().all(|c| matches!(
        c.dst,
        Loc::Host { key: ('h', k), .. } if k == c.rank && (k == 1 || k == 3)
    )));
    all_finished(&mut net, &[0, 1]);
}

#[test]
fn a_hier_leader_writes_the_node_region_once_and_seals_it_for_its_nodes_other_sps() {
    // Node 0: SP 0 (root 0, rank 3), SP 1 (ranks 1, 4); node 1: SP 2
    // (rank 2), SP 3 (rank 5).
    let (members, nodes) = ([0, 1, 2, 0, 1, 3], [0, 0, 1, 0, 0, 1]);
    let mut net: Net = posted(4, &members, [5, 4, 2, 1, 3, 0], |r| {
        hier(post(r, 0, 20, &members, &nodes))
    });
    run_all_ok(&mut net, members.len());
    // Only the chain of leaders moves chunks: 5 chunks, SP 0 -> SP 2.
    let mv = moves(&net);
    assert_eq!(mv.len(), 5, "{mv:?}");
    assert!(mv.iter().all(|m| m.to == 2));
    // Each leader writes each chunk once, into its region; the other SPs
    // write nothing.
    let w: Vec<_> = copies(&net)
        .into_iter()
        .filter(|c| matches!(c.dst, Loc::Host { .. }))
        .map(|c| c.dst)
        .collect();
    for leader in [3, 2] {
        let into = w
            .iter()
            .filter(|d| matches!(d, Loc::Host { key: ('h', k), .. } if *k == leader));
        assert_eq!(into.count(), 5, "leader rank {leader}");
    }
    assert_eq!(w.len(), 10, "{w:?}");
    // The other SPs' ranks copy out of their leader's region.
    assert_eq!(net.sp(1).m.segment_source(), Some((0, 0, 20)));
    assert_eq!(net.sp(3).m.segment_source(), Some((2, 200, 20)));
    assert_eq!(net.sp(0).m.segment_source(), Some((0, 0, 20)));
    for sp in [0, 2] {
        assert_eq!(net.sp(sp).m.stats().regions_shared, 1, "SP {sp}");
    }
    all_finished(&mut net, &[0, 1, 2, 3]);
}

#[test]
fn a_root_alone_on_its_sp_writes_the_region_through_its_own_grant() {
    // SP 0 serves only the root; SP 1, same node, ranks 1 and 2.
    let (members, nodes) = ([0, 1, 1], [0, 0, 0]);
    let mut net: Net = posted(2, &members, [1, 2, 0], |r| {
        hier(post(r, 0, 9, &members, &nodes))
    });
    run_all_ok(&mut net, members.len());
    let w: Vec<_> = copies(&net)
        .into_iter()
        .filter(|c| matches!(c.dst, Loc::Host { .. }))
        .collect();
    assert_eq!(w.len(), 3);
    assert!(w.iter().all(|c| c.dst
        == Loc::Host {
            key: ('h', 0),
            offset: c.chunk * 4
        }));
    assert!(moves(&net).is_empty());
    assert_eq!(net.sp(1).m.segment_source(), Some((0, 0, 9)));
    all_finished(&mut net, &[0, 1]);
}

#[test]
fn a_flat_leader_feeds_its_nodes_hier_sps_chunk_by_chunk() {
    // The leader had no segment room (its driver posts flat); SP 1 is
    // hierarchical: it gets the chunks and writes its ranks' buffers.
    let (members, nodes) = ([0, 1, 1], [0, 0, 0]);
    let mut net: Net = posted(2, &members, [1, 2, 0], |r| {
        let p = post(r, 0, 9, &members, &nodes);
        if r == 0 {
            p
        } else {
            hier(p)
        }
    });
    run_all_ok(&mut net, members.len());
    assert_eq!(moves(&net).len(), 3);
    let w: Vec<_> = copies(&net)
        .into_iter()
        .filter(|c| matches!(c.dst, Loc::Host { .. }))
        .collect();
    assert_eq!(w.len(), 6);
    assert!(w.iter().all(|c| matches!(
        c.dst,
        Loc::Host {
            key: ('b', 1 | 2),
            ..
        }
    )));
    assert_eq!(net.sp(1).m.segment_source(), None);
    all_finished(&mut net, &[0, 1]);
}

#[test]
fn a_flat_post_after_its_leader_sealed_aborts() {
    let (members, nodes) = ([0, 0, 1], [0, 0, 0]);
    let mut m = machine(1, 8, 2);
    let open = Msg::Open {
        root: 0,
        len: 5,
        chunk_bytes: 8,
        tree: vec![vec![0, 1]],
    };
    m.handle_msg(0, 0, open).unwrap();
    assert_eq!(
        m.handle_msg(1, 2, Msg::Sealed { at: 7 }),
        Err(MsgError::UnexpectedSeal { sp: 2 }),
        "only the leader seals"
    );
    m.handle_msg(1, 0, Msg::Sealed { at: 7 }).unwrap();
    assert_eq!(m.slots_in_use(), 0, "the grants to the leader are void");
    assert_eq!(
        m.handle_msg(1, 0, Msg::Sealed { at: 7 }),
        Err(MsgError::UnexpectedSeal { sp: 0 })
    );
    m.handle_post(2, post(2, 0, 5, &members, &nodes)).unwrap();
    let acts: Vec<_> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(
        acts.contains(&Action::Complete {
            rank: 2,
            status: Status::InvalidPost,
            from_segment: false
        }),
        "{acts:?}"
    );
}

#[test]
fn hier_completions_say_copy_from_the_segment() {
    let (members, nodes) = ([0, 1, 1], [0, 1, 1]);
    let mut m = machine(1, 8, 1);
    m.handle_post(0, hier(post(2, 0, 5, &members, &nodes)))
        .unwrap();
    m.handle_msg(
        1,
        0,
        Msg::Open {
            root: 0,
            len: 5,
            chunk_bytes: 8,
            tree: vec![vec![0], vec![1]],
        },
    )
    .unwrap();
    let mut acts: Vec<_> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(
        matches!(&acts[..], [Action::Send { to: 0, msg: Msg::Credit { slots, .. } }] if slots == &[SlotId(0)])
    );
    assert!(m.may_fill(0, SlotId(0)));
    assert!(!m.may_fill(2, SlotId(0)) && !m.may_fill(0, SlotId(1)));
    m.handle_msg(
        2,
        0,
        Msg::Chunk {
            index: 0,
            slot: SlotId(0),
            len: 5,
        },
    )
    .unwrap();
    // The writer (rank 1) has not posted: the chunk waits in staging.
    assert!(m.poll_action().is_none());
    assert!(!m.may_fill(0, SlotId(0)), "the slot holds a chunk");
    assert_eq!(m.slots_in_use(), 1);
    m.handle_post(3, hier(post(1, 0, 5, &members, &nodes)))
        .unwrap();
    acts = std::iter::from_fn(|| m.poll_action()).collect();
    let [Action::Copy(c)] = &acts[..] else {
        panic!("{acts:?}")
    };
    assert_eq!(
        (c.rank, &c.src, &c.dst),
        (
            1,
            &Loc::Stage {
                slot: SlotId(0),
                offset: 0
            },
            &Loc::Host {
                key: ('h', 1),
                offset: 0
            }
        )
    );
    m.handle_copy_done(4, c.id, Status::Ok);
    acts = std::iter::from_fn(|| m.poll_action()).collect();
    assert_eq!(
        acts,
        [
            Action::Complete {
                rank: 1,
                status: Status::Ok,
                from_segment: true
            },
            Action::Complete {
                rank: 2,
                status: Status::Ok,
                from_segment: true
            }
        ]
    );
    assert!(m.is_finished());
}

#[test]
fn zero_bytes_still_pass_the_tree_without_copies() {
    let (members, nodes) = ([0, 1, 2, 2], [0, 1, 1, 1]);
    let mut net: Net = zero_bytes_without_copies(3, &members, |r| post(r, 2, 0, &members, &nodes));
    all_finished(&mut net, &[0, 1, 2]);
}

#[test]
fn a_length_mismatch_aborts_everyone() {
    let (members, lens) = ([0, 1, 2], [10, 10, 11]);
    let net = rank_2_length_mismatch(|r| post(r, 0, lens[r as usize], &members, &members));
    // SP 2 never wrote into the rank whose length disagrees.
    assert!(!copies(&net).iter().any(|c| c.rank == 2));
}

/// Ranks 0 and 1 name root 0, ranks 2 and 3 root 2: the two views'
/// trees (on one node: 0 leading 1 2 3, and 2 leading 3 0 1; on two:
/// 0 1 then 2 3, and 2 3 then 0 1) meet only where an Open or a Credit
/// crosses.
#[test]
fn disagreeing_roots_are_detected_without_a_hang() {
    let members = [0, 1, 2, 3];
    for nodes in [[0, 0, 0, 0], [0, 0, 1, 1]] {
        let mut net = Net::new(4);
        for r in 0..4 {
            let root = if r < 2 { 0 } else { 2 };
            net.post(r, post(r, root, 6, &members, &nodes));
        }
        net.run();
        for r in 0..4 {
            let s = net.status(r).unwrap_or_else(|| panic!("rank {r} hangs"));
            // Rank 1 may complete Ok: its post agrees with root 0's.
            assert!(r == 1 || !s.is_ok(), "nodes {nodes:?} rank {r}: {s}");
        }
        all_finished(&mut net, &[0, 1, 2, 3]);
    }
}

#[test]
fn rank_lost_before_posting_fails_every_rank() {
    let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
    rank_1_lost_before_posting::<Tb>(|r| post(r, 0, 10, &members, &nodes));
}

#[test]
fn middle_sp_lost_mid_pipeline() {
    let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
    let mut net: Net = posted(3, &members, 0..3, |r| post(r, 0, 30, &members, &nodes));
    // Let a few chunks through, then SP 1 dies.
    for _ in 0..6 {
        net.deliver_all();
        net.finish_copy(Status::Ok);
    }
    lose_sp(&mut net, 1, &[0, 2]);
}

#[test]
fn failed_move_gives_the_slot_back() {
    let (members, nodes) = ([0, 1], [0, 1]);
    let mut net: Net = posted(2, &members, 0..2, |r| post(r, 0, 8, &members, &nodes));
    net.deliver_all();
    // The read, then the move, fails.
    assert!(net.finish_copy(Status::Ok));
    net.deliver_all();
    assert!(copy_first(&mut net, |(_, w)| matches!(w, Work::M(_))));
    fail_a_copy(&mut net);
}

#[test]
fn credits_never_exceed_the_chunks_expected() {
    let mut m = machine(1, 100, 8);
    m.handle_post(0, post(1, 0, 150, &[0, 1], &[0, 1])).unwrap();
    let acts: Vec<_> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(
        matches!(&acts[..], [Action::Send { to: 0, msg: Msg::Credit { root: 0, len: 150, chunk_bytes: 100, slots } }] if slots.len() == 2),
        "{acts:?}"
    );
}

#[test]
fn invalid_posts_are_rejected() {
    let mut m = new_machine(0);
    let two = |rank, root| post(rank, root, 4, &[0, 1], &[0, 1]);
    let no_shared_key = Post {
        design: Design::Hier,
        ..two(0, 0)
    };
    let not_mine = PostError::NotMine {
        rank: 1,
        served_by: 1,
    };
    for (p, err) in [
        (no_shared_key, PostError::MissingSharedKey { rank: 0 }),
        (two(0, 2), PostError::RootOutOfRange { root: 2, size: 2 }),
        (two(1, 0), not_mine),
    ] {
        assert_eq!(m.handle_post(0, p), Err(err));
    }
    assert!(m.members().is_none() && m.poll_action().is_none());
}
