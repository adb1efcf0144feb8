use super::*;
use crate::sim::testnet::{Machine, Out};
use crate::test_util::*;

/// Key material in the tests: (buffer kind, rank).
type Tag = (char, Rank);

const KEY: CollKey = test_key(7, 3);

fn prefix(counts: &[u64]) -> Vec<u64> {
    let mut at = 0;
    counts
        .iter()
        .map(|c| {
            let d = at;
            at += c + 1; // a gap between blocks
            d
        })
        .collect()
}

fn post(rank: Rank, members: &[SpId], send: Vec<u64>, recv: Vec<u64>) -> Post<Tag> {
    Post {
        rank,
        members: members.to_vec(),
        send_key: ('s', rank),
        recv_key: ('r', rank),
        recv_displs: prefix(&recv),
        recv_counts: recv,
        own: Own {
            send_displs: prefix(&send),
            send_counts: send,
        },
    }
}

/// Counts where rank s sends `m[s][d]` bytes to d.
fn matrix_post(rank: Rank, members: &[SpId], m: &[Vec<u64>]) -> Post<Tag> {
    let r = rank as usize;
    let recv = (0..m.len()).map(|s| m[s][r]).collect();
    post(rank, members, m[r].clone(), recv)
}

type Net = crate::sim::testnet::Net<Alltoallv<Tag>>;

plain_machine!(
    Alltoallv,
    fn check_copy(&self, sp: SpId, c: &Copy<Tag>) {
        assert_eq!(self.members().unwrap()[c.dst_rank as usize], sp);
    }
);

#[test]
fn two_sps_three_ranks_all_blocks_copied_once() {
    let members = [0, 1, 0];
    let m = vec![vec![3, 0, 5], vec![2, 4, 0], vec![0, 1, 6]];
    let mut net: Net = posted(2, &members, 0..3, |r| matrix_post(r, &members, &m));
    run_all_ok(&mut net, members.len());
    let mut blocks: Vec<(Rank, Rank, u64, u64, u64)> = net
        .copied
        .iter()
        .map(|c| {
            assert_eq!(c.src_key, ('s', c.src_rank));
            assert_eq!(c.dst_key, ('r', c.dst_rank));
            (c.src_rank, c.dst_rank, c.src_offset, c.dst_offset, c.len)
        })
        .collect();
    blocks.sort();
    let mut expected = Vec::new();
    for s in 0..3 {
        for d in 0..3 {
            if m[s][d] > 0 {
                let sd = prefix(&m[s])[d];
                let col: Vec<u64> = (0..3).map(|x| m[x][d]).collect();
                let dd = prefix(&col)[s];
                expected.push((s as Rank, d as Rank, sd, dd, m[s][d]));
            }
        }
    }
    assert_eq!(blocks, expected);
    for sp in 0..2 {
        assert!(net.sp(sp).is_finished());
        assert_eq!(net.sp(sp).poll_timeout(), None);
    }
}

#[test]
fn ring_order_starts_with_self() {
    let members = [0, 1, 2, 3];
    let mut net = Net::new(4);
    net.post(2, post(2, &members, vec![1; 4], vec![1; 4]));
    let dsts: Vec<Rank> = net
        .msgs
        .iter()
        .map(|(_, _, m)| match m {
            Msg::Announce { dst, .. } => *dst,
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    // The self block (2 -> 2) is delivered internally and copied.
    assert_eq!(dsts, vec![3, 0, 1]);
    assert_eq!(net.copies.len(), 1);
    assert_eq!(net.copies[0].1.src_rank, 2);
    assert_eq!(net.copies[0].1.dst_rank, 2);
}

#[test]
fn late_arrival_is_queued_then_served() {
    let members = [0, 1];
    let m = vec![vec![1, 2], vec![3, 4]];
    let mut net = Net::new(2);
    net.post(0, matrix_post(0, &members, &m));
    net.run();
    // SP 1 learned about the collective from a message only.
    assert_eq!(net.sp(1).members(), None);
    assert_eq!(net.sp(1).stats().late_announcements, 1);
    assert!(net.completes.is_empty());
    assert!(!net.sp(0).is_finished());
    net.post(1, matrix_post(1, &members, &m));
    run_all_ok(&mut net, members.len());
    assert_eq!(net.copied.len(), 4);
    all_finished(&mut net, &[0, 1]);
}

#[test]
fn zero_length_blocks_complete_without_copies() {
    let members = [0, 1, 1];
    let m = vec![vec![0; 3]; 3];
    zero_bytes_without_copies::<Alltoallv<Tag>>(2, &members, |r| matrix_post(r, &members, &m));
}

#[test]
fn single_rank_self_block() {
    let mut net = Net::new(1);
    net.post(0, post(0, &[0], vec![8], vec![8]));
    assert!(net.msgs.is_empty());
    assert_eq!(net.copies.len(), 1);
    assert!(
        net.completes.is_empty(),
        "complete while own copy in flight"
    );
    net.run();
    assert_eq!(net.status(0), Some(Status::Ok));

    let mut net = Net::new(1);
    net.post(0, post(0, &[0], vec![0], vec![0]));
    assert_eq!(net.status(0), Some(Status::Ok));
    assert!(net.sp(0).is_finished());
}

#[test]
fn count_mismatch_fails_both_sides_without_hanging() {
    let members = [0, 1, 2];
    let m = vec![vec![1, 4, 1], vec![1, 1, 1], vec![1, 1, 1]];
    let mut net = Net::new(3);
    for r in 0..3 {
        let mut p = matrix_post(r, &members, &m);
        if r == 1 {
            p.recv_counts[0] = 5; // rank 1 expects 5 bytes from rank 0, gets 4
        }
        net.post(r, p);
    }
    net.run();
    net.expect_status(&[0, 1], Some(Status::CountMismatch));
    assert_eq!(net.status(2), Some(Status::Ok));
    assert!(!net
        .copied
        .iter()
        .any(|c| c.src_rank == 0 && c.dst_rank == 1));
    assert_eq!(net.copied.len(), 8);
}

#[test]
fn failed_copy_reports_error_to_both_sides() {
    let members = [0, 1];
    let m = vec![vec![0, 4], vec![0, 0]];
    let mut net: Net = posted(2, &members, 0..2, |r| matrix_post(r, &members, &m));
    net.deliver_all();
    assert!(net.finish_copy(Status::AccessError));
    net.run();
    net.expect_status(&[0, 1], Some(Status::AccessError));
}

/// Asserts that `a` rejects each message `(from, msg)` of `cases` with its
/// error.
fn rejects(a: &mut Alltoallv<Tag>, cases: Vec<(SpId, Msg<Tag>, MsgError)>) {
    for (from, msg, err) in cases {
        let what = format!("{msg:?} from SP {from}");
        assert_eq!(a.handle_msg(0, from, msg), Err(err), "{what}");
    }
}

#[test]
fn protocol_violations_are_errors_and_change_nothing() {
    use MsgError::*;
    let members = [0, 1];
    let mut a: Alltoallv<Tag> = Alltoallv::new(KEY, Config { me: 1 });
    let ann = |src, dst, offset| Msg::Announce {
        src,
        dst,
        key: ('s', src),
        offset,
        len: 2,
    };
    let ack = || Msg::Ack {
        src: 1,
        dst: 0,
        status: Status::Ok,
    };
    // Before membership: queued, duplicates still detected.
    a.handle_msg(0, 0, ann(0, 1, 0)).unwrap();
    rejects(
        &mut a,
        vec![
            (0, ann(0, 1, 0), DuplicateAnnounce { src: 0, dst: 1 }),
            (0, ack(), UnexpectedAck { src: 1, dst: 0 }),
        ],
    );
    a.handle_post(0, post(1, &members, vec![2, 3], vec![2, 3]))
        .unwrap();
    let mut copies = 0;
    while let Some(act) = a.poll_action() {
        copies += matches!(act, Action::Copy(_)) as usize;
    }
    assert_eq!(copies, 2, "queued announce and self block");
    let wrong_sender = WrongSender {
        rank: 0,
        expected: 0,
        got: 7,
    };
    rejects(
        &mut a,
        vec![
            (0, ann(0, 1, 0), DuplicateAnnounce { src: 0, dst: 1 }),
            (0, ann(5, 1, 0), RankOutOfRange { rank: 5, size: 2 }),
            (0, ann(0, 0, 0), NotLocal { rank: 0 }),
            (7, ann(0, 1, 0), wrong_sender),
            (0, ann(0, 1, u64::MAX), Overflow { src: 0, dst: 1 }),
        ],
    );
    // Ack for a block never announced to rank 0 ... rank 1 announced to
    // 0 already; a second ack is unexpected.
    a.handle_msg(0, 0, ack()).unwrap();
    let abort = Msg::Abort {
        status: Status::Aborted,
    };
    rejects(
        &mut a,
        vec![
            (0, ack(), UnexpectedAck { src: 1, dst: 0 }),
            (9, abort, NotMember { sp: 9 }),
        ],
    );
    assert_eq!(a.abort_status(), None);
    assert!(a.poll_action().is_none());
    // Unknown copy ids are counted and ignored.
    a.handle_copy_done(0, CopyId(999), Status::Ok);
    assert_eq!(a.stats().unknown_copy_done, 1);
}

#[test]
fn invalid_posts_are_rejected() {
    let mut a: Alltoallv<Tag> = Alltoallv::new(KEY, Config { me: 0 });
    let m = [0, 1];
    assert_eq!(
        a.handle_post(0, post(2, &m, vec![0; 2], vec![0; 2])),
        Err(PostError::RankOutOfRange { rank: 2, size: 2 })
    );
    assert_eq!(
        a.handle_post(0, post(1, &m, vec![0; 2], vec![0; 2])),
        Err(PostError::NotMine {
            rank: 1,
            served_by: 1
        })
    );
    assert_eq!(
        a.handle_post(0, post(0, &m, vec![0; 3], vec![0; 2])),
        Err(PostError::LengthMismatch {
            field: "send_counts",
            len: 3,
            expected: 2
        })
    );
    let mut p = post(0, &m, vec![0; 2], vec![0; 2]);
    p.recv_displs[1] = u64::MAX;
    p.recv_counts[1] = 1;
    assert_eq!(
        a.handle_post(0, p),
        Err(PostError::Overflow {
            rank: 0,
            field: "recv",
            index: 1
        })
    );
    assert_eq!(a.members(), None, "rejected posts leave no trace");
    a.handle_post(0, post(0, &[0, 0, 1], vec![0; 3], vec![0; 3]))
        .unwrap();
    assert_eq!(
        a.handle_post(0, post(0, &[0, 0, 1], vec![0; 3], vec![0; 3])),
        Err(PostError::DuplicatePost { rank: 0 })
    );
    assert_eq!(
        a.handle_post(0, post(1, &[0, 0, 0], vec![0; 3], vec![0; 3])),
        Err(PostError::MembersDisagree)
    );
}

#[test]
fn abort_before_any_post() {
    let members = [0, 1, 1];
    let m = vec![vec![2; 3]; 3];
    let mut net = Net::new(2);
    // SP 1 aborts before knowing anything about the collective.
    net.sp(1).abort(0, Status::Aborted);
    net.collect(1);
    assert!(
        net.msgs.is_empty(),
        "membership unknown: nobody to tell yet"
    );
    net.post(0, matrix_post(0, &members, &m));
    net.run();
    // SP 1 answered the announcements and told SP 0 about the abort.
    assert_eq!(net.status(0), Some(Status::Aborted));
    assert!(net.sp(0).is_finished());
    post_ranks(&mut net, &members, 1..3, |r| matrix_post(r, &members, &m));
    net.run();
    net.expect_status(&[1, 2], Some(Status::Aborted));
    all_finished(&mut net, &[1]);
    // Only the self block of rank 0 may have been copied.
    assert!(net
        .copied
        .iter()
        .all(|c| c.src_rank == 0 && c.dst_rank == 0));
}

/// Three SPs, rank `r` on SP `r`, where every block is `len` bytes: the post
/// of rank `r`.
fn uniform_post(r: Rank, len: u64) -> Post<Tag> {
    matrix_post(r, &[0, 1, 2], &vec![vec![len; 3]; 3])
}

/// [`uniform_post`]s of the ranks `ranks`, on a net of the three SPs.
fn uniform_posts(len: u64, ranks: std::ops::Range<Rank>) -> Net {
    posted(3, &[0, 1, 2], ranks, |r| uniform_post(r, len))
}

#[test]
fn abort_after_post_waits_for_copies_in_flight() {
    let mut net = uniform_posts(3, 0..2);
    net.deliver_all();
    // Copies into ranks 0 and 1 are in flight; rank 2 never posts.
    let in_flight = net.copies.len();
    assert!(in_flight >= 2);
    net.sp(0).abort(0, Status::RankFailed);
    net.collect(0);
    net.deliver_all();
    for sp in 1..3 {
        assert_eq!(net.sp(sp).abort_status(), Some(Status::RankFailed));
    }
    assert!(
        net.completes.is_empty(),
        "nobody completes while copies touching its buffers run"
    );
    net.run();
    net.expect_status(&[0, 1], Some(Status::RankFailed));
    assert_eq!(net.copied.len(), in_flight, "no new copies after the abort");
    net.post(2, uniform_post(2, 3));
    net.run();
    assert_eq!(net.status(2), Some(Status::RankFailed));
    all_finished(&mut net, &[0, 1, 2]);
}

#[test]
fn abort_from_peer_completes_later_posts_immediately() {
    let members = [0, 1];
    let mut a: Alltoallv<Tag> = Alltoallv::new(KEY, Config { me: 1 });
    // A second abort is harmless.
    for status in [Status::Aborted, Status::PeerFailed] {
        a.handle_msg(0, 0, Msg::Abort { status }).unwrap();
    }
    a.handle_post(0, post(1, &members, vec![1, 1], vec![1, 1]))
        .unwrap();
    assert_eq!(
        a.poll_action(),
        Some(Action::Complete {
            rank: 1,
            status: Status::Aborted
        })
    );
    assert_eq!(
        a.poll_action(),
        None,
        "peer-originated abort is not re-broadcast"
    );
    assert!(a.is_finished());
}

#[test]
fn peer_lost_fails_ranks_and_settles_blocks_to_it() {
    let mut net = uniform_posts(1, 0..3);
    // SP 2 dies before processing anything.
    net.dead.insert(2);
    net.run();
    assert!(net.completes.is_empty());
    tell_peer_lost(&mut net, 0, 2, &[0, 1]);
    net.run();
    net.expect_status(&[0, 1], Some(Status::PeerFailed));
    assert_eq!(net.status(2), None);
    all_finished(&mut net, &[0, 1]);
    // Repeated or irrelevant loss notifications are harmless.
    net.sp(0).handle_peer_lost(0, 2);
    net.sp(0).handle_peer_lost(0, 0);
    net.collect(0);
    assert!(net.msgs.is_empty());
}

#[test]
fn peer_lost_before_membership_is_applied_on_post() {
    let mut a: Alltoallv<Tag> = Alltoallv::new(KEY, Config { me: 0 });
    a.handle_peer_lost(0, 5); // not in the communicator
    a.handle_peer_lost(0, 1);
    a.handle_post(0, post(0, &[0, 1, 2], vec![1; 3], vec![1; 3]))
        .unwrap();
    let acts: Vec<_> = std::iter::from_fn(|| a.poll_action()).collect();
    assert_eq!(
        acts,
        vec![
            Action::Send {
                to: 2,
                msg: Msg::Abort {
                    status: Status::PeerFailed
                }
            },
            Action::Complete {
                rank: 0,
                status: Status::PeerFailed
            },
        ]
    );
}

#[test]
fn rank_lost_before_post_lets_instance_finish() {
    let members = [0, 0, 1];
    let m = vec![vec![1; 3]; 3];
    let mut net = Net::new(2);
    net.post(0, matrix_post(0, &members, &m));
    net.post(1, matrix_post(2, &members, &m));
    net.deliver_all();
    net.sp(0).handle_rank_lost(0, 1);
    net.collect(0);
    net.run();
    assert_eq!(net.status(0), Some(Status::RankFailed));
    assert_eq!(net.status(1), None, "never posted: no completion");
    assert_eq!(net.status(2), Some(Status::RankFailed));
    all_finished(&mut net, &[0, 1]);
    assert_eq!(
        net.sp(0).handle_post(0, matrix_post(1, &members, &m)),
        Err(PostError::RankLost { rank: 1 })
    );
}

#[test]
fn rank_lost_after_it_completed_changes_nothing() {
    let mut net = Net::new(1);
    net.post(0, post(0, &[0, 0], vec![0, 0], vec![0, 0]));
    assert_eq!(net.status(0), None);
    net.post(0, post(1, &[0, 0], vec![0, 0], vec![0, 0]));
    assert_eq!(net.status(0), Some(Status::Ok));
    net.sp(0).handle_rank_lost(0, 0);
    assert_eq!(net.sp(0).abort_status(), None);
    assert!(net.sp(0).is_finished());
}

#[test]
fn messages_serialize_with_serde_derive() {
    fn assert_serde<T: Serialize + for<'de> Deserialize<'de>>() {}
    assert_serde::<Msg<Tag>>();
    assert_serde::<Action<Tag>>();
    assert_serde::<Post<Tag>>();
}
