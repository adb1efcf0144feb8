use super::*;
use crate::sim::testnet::{Machine, Out};
use crate::test_util::*;

type Tag = (char, Rank);

crate::sim::testnet::staged_test_basics!(StagedAllgather, comm: 9);

struct Tb {
    m: StagedAllgather<Tag>,
    /// (rank, from_segment) of every completion.
    segs: Vec<(Rank, bool)>,
}

impl Machine for Tb {
    type Post = Post<Tag>;
    type Msg = Msg<Tag>;
    type Copy = Copy<Tag>;

    fn create(sp: SpId) -> Self {
        Tb {
            m: new_machine(sp),
            segs: Vec::new(),
        }
    }

    forward_inputs!(m);

    fn copy_done(&mut self, now: Nanos, c: &Copy<Tag>, status: Status) {
        self.m.handle_copy_done(now, c.id, status);
    }

    fn poll(&mut self) -> Option<Out<Msg<Tag>, Copy<Tag>>> {
        Some(match self.m.poll_action()? {
            Action::Send { to, msg } => Out::Send { to, msg },
            Action::Copy(c) => Out::Copy(c),
            Action::Complete {
                rank,
                status,
                from_segment,
            } => {
                self.segs.push((rank, from_segment));
                Out::Complete { rank, status }
            }
        })
    }

    fn check_copy(&self, _sp: SpId, c: &Copy<Tag>) {
        assert!(c.len > 0 && c.len <= CHUNK, "{c:?}");
    }
}

instance!(Tb, m);

type Net = crate::sim::testnet::Net<Tb>;

fn post(rank: Rank, len: u64, members: &[SpId], nodes: &[u32]) -> Post<Tag> {
    Post {
        rank,
        members: members.to_vec(),
        nodes: nodes.to_vec(),
        send_key: ('s', rank),
        recv_key: ('r', rank),
        len,
        design: Design::Flat,
        shared_key: None,
        shared_at: 0,
    }
}

fn writes(net: &Net) -> Vec<Copy<Tag>> {
    net.copied
        .iter()
        .filter(|c| matches!(c.src, Loc::Stage { .. }))
        .cloned()
        .collect()
}

fn sent(net: &Net, from: SpId, to: SpId) -> Vec<Msg<Tag>> {
    // Messages still queued (delivered ones are gone).
    net.msgs
        .iter()
        .filter(|(f, t, _)| *f == from && *t == to)
        .map(|(_, _, m)| m.clone())
        .collect()
}

#[test]
fn flat_writes_every_chunk_into_every_rank_once() {
    // Node 0: SP 0 (ranks 0, 3); node 1: SP 1 (rank 1), SP 2 (rank 2).
    let (members, nodes) = ([0, 1, 2, 0], [0, 1, 1, 0]);
    let mut net: Net = posted(3, &members, [2, 0, 3, 1], |r| post(r, 6, &members, &nodes));
    run_all_ok(&mut net, members.len());
    // 4 blocks x 2 chunks (4 + 2 bytes) into 4 ranks.
    let w = writes(&net);
    assert_eq!(w.len(), 32);
    for r in 0..4 {
        for s in 0..4 {
            let mut into: Vec<(u64, u64)> = w
                .iter()
                .filter(|c| c.rank == r && c.block == s)
                .map(|c| match c.dst {
                    Loc::Host { key, offset } => {
                        assert_eq!(key, ('r', r));
                        (offset, c.len)
                    }
                    Loc::Stage { .. } => unreachable!(),
                })
                .collect();
            into.sort();
            assert_eq!(into, [(s as u64 * 6, 4), (s as u64 * 6 + 4, 2)]);
        }
    }
    for sp in 0..3 {
        let st = net.sp(sp).m.stats();
        assert!(st.max_slots_in_use <= SLOTS, "{st:?}");
    }
    assert_eq!(net.sp(0).m.stats().bytes_staged, 12);
    assert_eq!(net.sp(0).m.stats().chunk_writes, 16);
    all_finished(&mut net, &[0, 1, 2]);
}

#[test]
fn writers_start_at_their_own_node_and_go_round() {
    // Nodes 0, 1, 2 with one SP and one rank each; SP 1 writes rank 1,
    // then rank 2, then rank 0.
    let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
    let mut net: Net = posted(3, &members, 0..3, |r| post(r, 3, &members, &nodes));
    net.deliver_all();
    // Finish the reads only.
    while copy_first(&mut net, |(_, c)| matches!(c.dst, Loc::Stage { .. })) {
        net.finish_copy(Status::Ok);
    }
    let order: Vec<Rank> = net
        .copies
        .iter()
        .filter(|(sp, _)| *sp == 1)
        .map(|(_, c)| c.rank)
        .collect();
    assert_eq!(order, [1, 2, 0]);
    run_all_ok(&mut net, members.len());
    all_finished(&mut net, &[0, 1, 2]);
}

#[test]
fn writers_take_one_unit_of_each_node_in_turn() {
    // Nodes 0, 1, 2 with one SP and ranks {0, 3}, {1, 4}, {2, 5}.
    let (members, nodes) = ([0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 1, 2]);
    let mut net: Net = posted(3, &members, 0..6, |r| post(r, 2, &members, &nodes));
    net.deliver_all();
    let read_on_1 = |(sp, c): &(SpId, Copy<Tag>)| *sp == 1 && matches!(c.dst, Loc::Stage { .. });
    assert!(copy_first(&mut net, read_on_1));
    net.finish_copy(Status::Ok);
    let order: Vec<Rank> = net
        .copies
        .iter()
        .filter(|(sp, c)| *sp == 1 && matches!(c.src, Loc::Stage { .. }))
        .map(|(_, c)| c.rank)
        .collect();
    assert_eq!(order, [1, 2, 0, 4, 5, 3]);
    run_all_ok(&mut net, members.len());
    all_finished(&mut net, &[0, 1, 2]);
}

#[test]
fn a_late_rank_stalls_reads_then_everything_resumes() {
    // SP 0 serves ranks 0 and 2, SP 1 rank 1; 2 chunks per block, 2 slots.
    let (members, nodes) = ([0, 1, 0], [0, 1, 0]);
    let mut net: Net = posted(2, &members, [0, 2], |r| post(r, 8, &members, &nodes));
    net.run();
    let m = &net.sp(0).m;
    // Both slots hold chunks written into ranks 0 and 2 but not into
    // rank 1, whose key is unknown: reads stopped.
    assert_eq!(m.slots_in_use(), 2);
    assert_eq!(m.stats().chunk_reads, 2);
    assert_eq!(m.stats().chunk_writes, 4);
    assert_eq!(net.status(0), None);
    // SP 1 knew the keys of ranks 0 and 2 before its rank posted.
    assert_eq!(net.sp(1).m.stats().keys_before_post, 2);
    net.post(1, post(1, 8, &members, &nodes));
    run_all_ok(&mut net, members.len());
    assert_eq!(net.sp(0).m.stats().writes_waited_for_key, 2);
    assert_eq!(net.sp(0).m.stats().chunk_writes, 12);
    all_finished(&mut net, &[0, 1]);
}

#[test]
fn hier_writes_each_chunk_once_per_node_into_its_owners_region() {
    // Node 0: SP 0 (ranks 0, 5), SP 1 (ranks 1, 4); node 1: SP 2 (rank
    // 2), SP 3 (rank 3). SPs 0 and 2 own their nodes' regions.
    let (members, nodes) = ([0, 1, 2, 3, 1, 0], [0, 0, 1, 1, 0, 0]);
    let mut net: Net = posted(4, &members, [4, 3, 5, 1, 2, 0], |r| {
        hier(post(r, 6, &members, &nodes))
    });
    run_all_ok(&mut net, members.len());
    // 6 blocks x 2 chunks into 2 regions (one per node), through the
    // shared key of the first rank that posted at each owner (5 on SP
    // 0, 2 on SP 2); nothing into any rank's buffer.
    let w = writes(&net);
    assert_eq!(w.len(), 24, "{w:?}");
    for c in &w {
        let Loc::Host { key, offset } = c.dst else {
            unreachable!()
        };
        assert!(key == ('h', 5) || key == ('h', 2), "{c:?}");
        assert_eq!(offset, c.block as u64 * 6 + c.chunk * CHUNK);
    }
    // Every rank copies out of its owner's region.
    for (sp, owner) in [(0, 0), (1, 0), (2, 2), (3, 2)] {
        assert!(net.sp(sp).segs.iter().all(|&(_, seg)| seg), "SP {sp}");
        assert_eq!(
            net.sp(sp).m.segment_source(),
            Some((owner, 100 * u64::from(owner), 36)),
            "SP {sp}"
        );
    }
    for sp in [0, 2] {
        assert_eq!(net.sp(sp).m.stats().regions_shared, 1, "SP {sp}");
    }
    all_finished(&mut net, &[0, 1, 2, 3]);
}

#[test]
fn a_flat_owner_makes_its_nodes_hier_sps_flat() {
    // SP 0 owns node 0 but delivers flat (no segment room); SP 1, same
    // node, is hierarchical: it announces its ranks' keys after SP 0's.
    let (members, nodes) = ([0, 1, 1], [0, 0, 0]);
    let mut net: Net = posted(2, &members, [1, 2], |r| hier(post(r, 3, &members, &nodes)));
    net.run();
    assert!(writes(&net).is_empty(), "SP 1 waits for its owner");
    net.post(0, post(0, 3, &members, &nodes));
    run_all_ok(&mut net, members.len());
    let w = writes(&net);
    assert_eq!(w.len(), 9, "3 blocks into 3 buffers: {w:?}");
    assert!(w
        .iter()
        .all(|c| matches!(c.dst, Loc::Host { key: ('r', _), .. })));
    assert_eq!(net.sp(1).segs, [(1, false), (2, false)]);
    assert_eq!(net.sp(1).m.segment_source(), None);
    all_finished(&mut net, &[0, 1]);
}

#[test]
fn an_owner_that_fails_before_it_posts_stops_its_nodes_waiting_sps() {
    // SP 0 owns the node; its only rank dies before posting, so SP 0
    // never announces anything, and no other node's SP tells SP 1 about
    // it. SP 1's hierarchical ranks must not wait forever: its `Waiting`
    // makes SP 0 owe it a `Stopped`.
    let (members, nodes) = ([0, 1, 1], [0, 0, 0]);
    let mut net = Net::new(2);
    net.sp(0).m.handle_rank_lost(0, 0);
    post_ranks(&mut net, &members, 1..3, |r| {
        hier(post(r, 4, &members, &nodes))
    });
    net.run();
    net.expect_status(&[1, 2], Some(Status::RankFailed));
    all_finished(&mut net, &[1]);
}

#[test]
fn designs_may_differ_per_sp() {
    // SP 0 flat (ranks 0, 2), SP 1 hierarchical (ranks 1, 3).
    let (members, nodes) = ([0, 1, 0, 1], [0, 1, 0, 1]);
    let mut net: Net = posted(2, &members, 0..4, |r| {
        let p = post(r, 3, &members, &nodes);
        if r % 2 == 1 {
            hier(p)
        } else {
            p
        }
    });
    run_all_ok(&mut net, members.len());
    let w = writes(&net);
    // 4 blocks into ranks 0 and 2 each, and once into SP 1's region.
    assert_eq!(w.iter().filter(|c| c.sp == 0).count(), 8);
    assert_eq!(w.iter().filter(|c| c.sp == 1).count(), 4);
    assert_eq!(net.sp(0).segs, [(0, false), (2, false)]);
    assert!(net.sp(1).segs.iter().all(|&(_, s)| s));
    all_finished(&mut net, &[0, 1]);
}

#[test]
fn zero_length_blocks_complete_without_copies() {
    let (members, nodes) = ([0, 1, 1], [0, 1, 1]);
    for design in [Design::Flat, Design::Hier] {
        let mut net: Net = zero_bytes_without_copies(2, &members, |r| {
            let p = post(r, 0, &members, &nodes);
            if design == Design::Hier {
                hier(p)
            } else {
                p
            }
        });
        all_finished(&mut net, &[0, 1]);
    }
}

#[test]
fn a_length_mismatch_aborts_everyone_without_writing_there() {
    let (members, lens) = ([0, 1, 2], [6, 6, 7]);
    let net = rank_2_length_mismatch(|r| post(r, lens[r as usize], &members, &members));
    for r in 0..3 {
        assert!(!net.status(r).unwrap().is_ok(), "rank {r}");
    }
    assert!(!writes(&net).iter().any(|c| c.rank == 2));
}

#[test]
fn another_comm_aborts_with_invalid_post() {
    // Rank 2 posts with ranks 0 and 1 swapped (SPs and nodes).
    let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
    let mut net: Net = posted(3, &members, 0..2, |r| post(r, 4, &members, &nodes));
    net.post(2, post(2, 4, &[1, 0, 2], &[1, 0, 2]));
    net.run();
    net.expect_status(&[0, 1, 2], Some(Status::InvalidPost));
    all_finished(&mut net, &[0, 1, 2]);
}

/// Two SPs on two nodes, one rank each, posting one-chunk blocks: both
/// reads finished, the writes are in flight.
fn both_reads_done() -> Net {
    let (members, nodes) = ([0, 1], [0, 1]);
    let mut net: Net = posted(2, &members, 0..2, |r| post(r, 4, &members, &nodes));
    net.deliver_all();
    assert!(net.finish_copy(Status::Ok) && net.finish_copy(Status::Ok));
    net
}

/// SP 1 aborts while SP 0's write into rank 1 is in flight: rank 1
/// completes only after SP 0 reports `Stopped`, which it does once the
/// write finished.
#[test]
fn an_aborted_rank_waits_for_remote_writers_to_stop() {
    let mut net = both_reads_done();
    // Hold SP 0's write into rank 1.
    let i = net
        .copies
        .iter()
        .position(|(sp, c)| *sp == 0 && c.rank == 1)
        .unwrap();
    let held = net.copies.remove(i).unwrap();
    net.sp(1).m.abort(100, Status::Aborted);
    net.collect(1);
    net.run();
    assert_eq!(net.status(0), Some(Status::Aborted));
    assert_eq!(net.status(1), None, "SP 0 still writes into rank 1");
    assert!(!net.sp(1).m.is_finished());
    assert_eq!(net.sp(0).m.copies_in_flight(), 1);
    net.copies.push_back(held);
    assert!(net.finish_copy(Status::Ok));
    assert!(matches!(
        &sent(&net, 0, 1)[..],
        [Msg::Stopped {
            status: Status::Aborted
        }]
    ));
    net.run();
    assert_eq!(net.status(1), Some(Status::Aborted));
    all_finished(&mut net, &[0, 1]);
}

#[test]
fn a_lost_writer_counts_as_stopped() {
    let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
    let mut net: Net = posted(3, &members, 0..3, |r| post(r, 4, &members, &nodes));
    net.deliver_all();
    lose_sp(&mut net, 2, &[0, 1]);
}

#[test]
fn a_rank_lost_before_posting_fails_every_rank() {
    // SP 1 never sees a post: it answered the keys with `Stopped` and
    // is dropped with the job.
    let (members, nodes) = ([0, 1, 2], [0, 1, 2]);
    rank_1_lost_before_posting::<Tb>(|r| post(r, 8, &members, &nodes));
}

#[test]
fn a_failed_write_aborts_with_access_error() {
    let mut net = both_reads_done();
    net.deliver_all();
    fail_a_copy(&mut net);
}

#[test]
fn refusals_answer_what_waits_for_an_answer() {
    let s = Status::RankFailed;
    let key = Msg::Key {
        rank: 0,
        len: 1,
        comm: 2,
        key: ('r', 0),
    };
    assert_eq!(refusal(&key, s), Some(Msg::Stopped { status: s }));
    assert_eq!(
        refusal(&Msg::<Tag>::Abort { status: s }, Status::Ok),
        Some(Msg::Stopped {
            status: Status::Aborted
        })
    );
    assert_eq!(refusal(&Msg::<Tag>::WrittenRegion, s), None);
    assert_eq!(refusal(&Msg::<Tag>::Written { ranks: vec![1] }, s), None);
    assert_eq!(refusal(&Msg::<Tag>::Stopped { status: s }, s), None);
}

#[test]
fn invalid_posts_and_messages_are_rejected() {
    let mut m = new_machine(0);
    let two = |rank, len| post(rank, len, &[0, 1], &[0, 1]);
    let no_shared_key = Post {
        design: Design::Hier,
        ..two(0, 4)
    };
    let not_mine = PostError::NotMine {
        rank: 1,
        served_by: 1,
    };
    for (p, err) in [
        (no_shared_key, PostError::MissingSharedKey { rank: 0 }),
        (two(1, 4), not_mine),
        (
            post(0, 4, &[0, 0], &[0, 1]),
            PostError::SpOnTwoNodes { sp: 0 },
        ),
        (two(0, u64::MAX), PostError::Overflow { rank: 0 }),
    ] {
        assert_eq!(m.handle_post(0, p), Err(err));
    }
    assert!(m.members().is_none() && m.poll_action().is_none());
    assert_eq!(
        m.handle_msg(0, 1, Msg::WrittenRegion),
        Err(MsgError::Unexpected { sp: 1 })
    );
    let key = Msg::Key {
        rank: 1,
        len: 4,
        comm: comm_digest(&[0, 1], &[0, 1]),
        key: ('r', 1),
    };
    m.handle_msg(0, 1, key.clone()).unwrap();
    assert_eq!(m.handle_msg(0, 1, key), Err(MsgError::Duplicate { sp: 1 }));
    m.handle_post(0, two(0, 4)).unwrap();
    assert_eq!(
        m.handle_post(0, two(0, 4)),
        Err(PostError::DuplicatePost { rank: 0 })
    );
    assert_eq!(
        m.handle_msg(0, 1, Msg::Written { ranks: vec![1] }),
        Err(MsgError::Unexpected { sp: 1 })
    );
}
