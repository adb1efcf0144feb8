use super::*;
use crate::sim::testnet::{Machine, Out};
use crate::test_util::*;

type Tag = (char, Rank);

const KEY: CollKey = test_key(9, 0);

/// Comm rank r has a block of `lens[r]` bytes; receive displacements
/// are prefix sums.
fn post(rank: Rank, members: &[SpId], nodes: &[u32], lens: &[u64]) -> Post<Tag> {
    let mut at = 0;
    let displs = lens
        .iter()
        .map(|l| {
            let d = at;
            at += l;
            d
        })
        .collect();
    Post {
        rank,
        members: members.to_vec(),
        send_key: ('s', rank),
        recv_key: ('r', rank),
        recv_counts: lens.to_vec(),
        recv_displs: displs,
        own: Own {
            nodes: nodes.to_vec(),
            send_len: lens[rank as usize],
        },
    }
}

type Net = crate::sim::testnet::Net<Allgatherv<Tag>>;

plain_machine!(Allgatherv);

#[test]
fn late_arrival_is_parked_then_served() {
    let (members, nodes, lens) = ([0, 1], [0, 1], [3, 5]);
    let mut net = Net::new(2);
    net.post(0, post(0, &members, &nodes, &lens));
    net.run();
    assert_eq!(net.sp(1).parked(), 1);
    assert_eq!(net.sp(1).stats().no_ready_rank, 1);
    assert_eq!(net.sp(1).stats().parked, 1);
    assert!(net.completes.is_empty(), "rank 0 waits for its reader");
    net.post(1, post(1, &members, &nodes, &lens));
    net.run();
    assert_eq!(net.status(0), Some(Status::Ok));
    assert_eq!(net.status(1), Some(Status::Ok));
    assert!(net.sp(1).stats().parked_wait_ns > 0);
    // Two self copies, two inter-node landings.
    assert_eq!(net.copied.len(), 4);
    all_finished(&mut net, &[0, 1]);
}

#[test]
fn announcement_passes_to_a_ready_sibling_and_is_distributed() {
    // Node 0: SP 0 (rank 0). Node 1: SP 1 (rank 1), SP 2 (rank 2).
    let (members, nodes, lens) = ([0, 1, 2], [0, 1, 1], [4, 2, 6]);
    let mut net: Net = posted(3, &members, [1, 0], |r| post(r, &members, &nodes, &lens));
    net.run();
    // Rank 0's announcement went to SP 2 (no rank yet) and was passed.
    assert_eq!(net.sp(2).stats().no_ready_rank, 1);
    assert_eq!(net.sp(1).stats().served_after_pass, 1);
    assert_eq!(net.sp(2).parked() + net.sp(1).parked(), 0);
    assert!(net.completes.is_empty());
    net.post(2, post(2, &members, &nodes, &lens));
    run_all_ok(&mut net, members.len());
    // Rank 0's block enters node 1 once, then an intra-node copy.
    let inter: Vec<_> = net
        .copied
        .iter()
        .filter(|c| nodes[c.src_rank as usize] != nodes[c.dst_rank as usize])
        .collect();
    assert_eq!(inter.len(), 3, "{inter:?}");
    let into_2 = net
        .copied
        .iter()
        .find(|c| c.seg == 0 && c.dst_rank == 2)
        .unwrap();
    assert_eq!((into_2.src_rank, into_2.src_key), (1, ('r', 1)));
    all_finished(&mut net, &[0, 1, 2]);
}

#[test]
fn zero_length_blocks_complete_without_copies() {
    let (members, nodes, lens) = ([0, 1, 1], [0, 1, 1], [0, 0, 0]);
    zero_bytes_without_copies::<Allgatherv<Tag>>(2, &members, |r| post(r, &members, &nodes, &lens));
}

#[test]
fn abort_acks_parked_announcements_and_completes_everyone() {
    let (members, nodes, lens) = ([0, 1, 2], [0, 1, 1], [4, 2, 6]);
    let mut net = Net::new(3);
    net.post(0, post(0, &members, &nodes, &lens));
    net.run();
    assert_eq!(net.sp(1).parked() + net.sp(2).parked(), 1);
    net.sp(0).abort(100, Status::Aborted);
    net.collect(0);
    net.run();
    assert_eq!(net.status(0), Some(Status::Aborted));
    post_ranks(&mut net, &members, [1, 2], |r| {
        post(r, &members, &nodes, &lens)
    });
    net.run();
    net.expect_status(&[1, 2], Some(Status::Aborted));
    all_finished(&mut net, &[0, 1, 2]);
}

#[test]
fn rank_lost_before_any_post_reaches_every_sp() {
    // SP 2 only serves rank 2, which dies before posting.
    let (members, nodes, lens) = ([0, 1, 2], [0, 1, 1], [1, 1, 1]);
    let mut net = Net::new(3);
    net.sp(2).handle_rank_lost(0, 2);
    net.collect(2);
    post_ranks(&mut net, &members, [0, 1], |r| {
        post(r, &members, &nodes, &lens)
    });
    net.run();
    net.expect_status(&[0, 1], Some(Status::RankFailed));
    assert_eq!(net.status(2), None);
    all_finished(&mut net, &[0, 1]);
}

/// Node 0: SP 0 (rank 0). Node 1: SP 1 (rank 1), SP 2 (rank 2). Rank 0's announcement to
/// node 1 reaches SP 2, which passes it to SP 1; SP 2 then dies and SP 0 learns it. Returns
/// the network and the pass, still in flight (not delivered).
fn pass_in_flight_then_sp_2_lost() -> (Net, (SpId, SpId, Msg<Tag>)) {
    let (members, nodes, lens) = ([0, 1, 2], [0, 1, 1], [4, 2, 6]);
    let mut net = Net::new(3);
    net.post(1, post(1, &members, &nodes, &lens));
    net.deliver_all();
    net.post(0, post(0, &members, &nodes, &lens));
    let i = net
        .msgs
        .iter()
        .position(|(_, to, m)| *to == 2 && matches!(m, Msg::Announce { .. }))
        .unwrap();
    let (from, to, msg) = net.msgs.remove(i).unwrap();
    net.sp(to).handle_msg(100, from, msg).unwrap();
    net.collect(to);
    let pass = net
        .msgs
        .iter()
        .position(|(f, to, m)| (*f, *to) == (2, 1) && matches!(m, Msg::Pass { .. }))
        .unwrap();
    let pass = net.msgs.remove(pass).unwrap();
    // SP 2 dies; SP 0 must not settle rank 0's ack to node 1 yet.
    net.msgs.retain(|(f, t, _)| *f != 2 && *t != 2);
    net.sps.remove(&2);
    tell_peer_lost(&mut net, 200, 2, &[0]);
    (net, pass)
}

/// SP 1 learns of SP 2's loss at last: rank 1 fails with `PeerFailed` and SPs 0
/// and 1 finish.
fn sp_1_learns_the_loss(net: &mut Net) {
    tell_peer_lost(net, 400, 2, &[1]);
    net.run();
    assert_eq!(net.status(1), Some(Status::PeerFailed));
    all_finished(net, &[0, 1]);
}

#[test]
fn lost_sp_passed_the_announcement_on_source_waits_for_release() {
    // Node 0: SP 0 (rank 0). Node 1: SP 1 (rank 1), SP 2 (rank 2).
    let (mut net, pass) = pass_in_flight_then_sp_2_lost();
    // The pass overtakes the release (and SP 1 has not noticed the
    // loss yet): SP 1 starts landing rank 0's block.
    net.sp(1).handle_msg(300, pass.0, pass.2).unwrap();
    net.collect(1);
    assert!(net
        .copies
        .iter()
        .any(|(sp, c)| *sp == 1 && c.seg == 0 && c.src_rank == 0));
    net.deliver_all();
    assert!(
        net.status(0).is_none(),
        "rank 0 completed while SP 1 reads its send buffer"
    );
    net.run();
    assert_eq!(net.status(0), Some(Status::PeerFailed));
    sp_1_learns_the_loss(&mut net);
}

#[test]
fn release_before_the_pass_arrives_blocks_the_landing() {
    let (mut net, pass) = pass_in_flight_then_sp_2_lost();
    // SP 1 gets the release (and everything else) before the pass.
    net.run();
    assert!(net.status(0).is_some(), "SP 1 answered the release");
    net.sp(1).handle_msg(300, pass.0, pass.2).unwrap();
    net.collect(1);
    assert!(
        !net.copies.iter().any(|(_, c)| c.src_rank == 0),
        "an aborted SP started a landing copy"
    );
    sp_1_learns_the_loss(&mut net);
}

#[test]
fn invalid_posts_are_rejected() {
    let mut a: Allgatherv<Tag> = Allgatherv::new(KEY, Config { me: 0 });
    assert_eq!(
        a.handle_post(0, post(0, &[0, 0], &[0, 1], &[1, 1])),
        Err(PostError::SpOnTwoNodes { sp: 0 })
    );
    let mut p = post(0, &[0, 1], &[0, 1], &[1, 1]);
    p.own.nodes.pop();
    assert_eq!(
        a.handle_post(0, p),
        Err(PostError::LengthMismatch {
            field: "nodes",
            len: 1,
            expected: 2
        })
    );
    assert!(a.members().is_none());
}

#[test]
fn the_topology_kept_from_the_last_build_is_used_only_for_the_same_sp_members_and_nodes() {
    use super::state::Topo;
    use std::sync::Arc;
    let (members, nodes) = ([0, 1, 1, 2], [0, 0, 0, 1]);
    let a = Topo::shared(1, &members, &nodes).unwrap();
    let b = Topo::shared(1, &members, &nodes).unwrap();
    assert!(
        Arc::ptr_eq(&a, &b),
        "the same communicator reuses the build"
    );
    for (me, m, n) in [
        (0, &members[..], &nodes[..]),
        (1, &[0, 1, 1, 3][..], &nodes[..]),
        (1, &members[..], &[0, 1, 1, 2][..]),
        (1, &members[..3], &nodes[..3]),
    ] {
        let c = Topo::shared(me, m, n).unwrap();
        assert!(!Arc::ptr_eq(&a, &c), "{me} {m:?} {n:?}");
        assert_eq!(
            format!("{:?}", *c),
            format!("{:?}", Topo::build(me, m, n).unwrap()),
            "what is kept is what a build gives"
        );
    }
    // An SP on two nodes is refused whether or not a topology is kept.
    assert!(Topo::shared(1, &members, &[0, 0, 1, 1]).is_err());
}
