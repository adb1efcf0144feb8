//! The SP engine end to end with real SP processes, real sockets and real CMA copies, with this
//! test process playing the host ranks (no MPI here: that is `tests/` at the workspace root).
#![allow(clippy::needless_range_loop)]

mod common;

use algorithms::CommId;
use alias_mkey::Rights;
use bootstrap::mailbox::{self, STATUS_OK};
use bootstrap::wire::{self, ErrorCode, Hello, HostHello, SpToHost};
use bootstrap::Layout;
use common::*;
use std::io::Write;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(20);

/// One randomized alltoallv over `comm` (world ranks, in comm-rank order).
struct Op {
    comm: CommId,
    seq: u64,
    members_world: Vec<u32>,
    counts: Vec<Vec<u64>>, // counts[s][d], comm ranks
    send: Vec<Vec<u8>>,
    send_displs: Vec<Vec<u64>>,
    recv: Vec<Vec<u8>>,
    recv_displs: Vec<Vec<u64>>,
}

const SENTINEL: u8 = 0xA5;

fn layout(rng: &mut Rng, sizes: &[u64]) -> (Vec<u64>, u64) {
    let p = sizes.len();
    let mut order: Vec<usize> = (0..p).collect();
    for i in (1..p).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut displs = vec![0; p];
    let mut off = 0;
    for i in order {
        off += rng.below(3) * 8;
        displs[i] = off;
        off += sizes[i];
    }
    (displs, off + rng.below(2) * 16)
}

fn make_op(rng: &mut Rng, comm: CommId, seq: u64, members_world: Vec<u32>, max: u64) -> Op {
    let p = members_world.len();
    let all_zero = rng.below(10) == 0;
    let counts: Vec<Vec<u64>> = (0..p)
        .map(|_| {
            (0..p)
                .map(|_| {
                    if all_zero || rng.below(4) == 0 {
                        0
                    } else {
                        rng.below(max + 1)
                    }
                })
                .collect()
        })
        .collect();
    let mut op = Op {
        comm,
        seq,
        members_world,
        counts: counts.clone(),
        send: vec![],
        send_displs: vec![],
        recv: vec![],
        recv_displs: vec![],
    };
    for s in 0..p {
        let (d, len) = layout(rng, &counts[s]);
        op.send.push((0..len).map(|_| rng.next() as u8).collect());
        op.send_displs.push(d);
        let col: Vec<u64> = (0..p).map(|src| counts[src][s]).collect();
        let (d, len) = layout(rng, &col);
        op.recv.push(vec![SENTINEL; len as usize]);
        op.recv_displs.push(d);
    }
    op
}

impl Op {
    fn post(
        &self,
        hosts: &mut [Host],
        world_to_host: &dyn Fn(u32) -> usize,
        slot: u32,
    ) -> Vec<(usize, u32, u64)> {
        let members: Vec<u32> = self
            .members_world
            .iter()
            .map(|&w| hosts[world_to_host(w)].sp)
            .collect();
        let all: Vec<usize> = (0..self.members_world.len()).collect();
        self.post_ranks(hosts, world_to_host, &members, slot, &all)
    }

    /// Posts for the comm ranks in `ranks` only, naming `members` as the SP of each comm rank
    /// (so ranks that never post, or whose host is gone, can still be named). Returns
    /// (host index, slot, token) per post.
    fn post_ranks(
        &self,
        hosts: &mut [Host],
        world_to_host: &dyn Fn(u32) -> usize,
        members: &[u32],
        slot: u32,
        ranks: &[usize],
    ) -> Vec<(usize, u32, u64)> {
        let p = self.members_world.len();
        let mut posted = vec![];
        for &r in ranks {
            let h = world_to_host(self.members_world[r]);
            let send = hosts[h].grant(&self.send[r], Rights::READ);
            let recv = hosts[h].grant(&self.recv[r], Rights::WRITE);
            let d = desc(
                self.comm,
                self.seq,
                r as u32,
                members.to_vec(),
                slot,
                send,
                recv,
                (
                    self.counts[r].clone(),
                    self.send_displs[r].clone(),
                    (0..p).map(|s| self.counts[s][r]).collect(),
                    self.recv_displs[r].clone(),
                ),
            );
            let d = wire::PostDesc {
                world_ranks: self.members_world.clone(),
                ..d
            };
            let (slot, token) = hosts[h].post(d);
            posted.push((h, slot, token));
        }
        posted
    }

    fn check(&self) {
        let p = self.members_world.len();
        for r in 0..p {
            let mut want = vec![SENTINEL; self.recv[r].len()];
            for s in 0..p {
                let c = self.counts[s][r] as usize;
                let so = self.send_displs[s][r] as usize;
                let ro = self.recv_displs[r][s] as usize;
                want[ro..ro + c].copy_from_slice(&self.send[s][so..so + c]);
            }
            // SAFETY-free: the SP wrote through CMA; read through volatile loads.
            let got: Vec<u8> = self.recv[r]
                .iter()
                .map(|b| unsafe { std::ptr::read_volatile(b) })
                .collect();
            if let Some(i) = (0..want.len()).find(|&i| want[i] != got[i]) {
                panic!(
                    "comm {:?} seq {} rank {r}: byte {i} is {:#x}, native alltoallv puts {:#x}",
                    self.comm, self.seq, got[i], want[i]
                );
            }
        }
    }
}

fn run_random_ops(sps_per_node: u32, layout_kind: Layout, seed: u64) {
    let stats = run_random_ops_with(sps_per_node, layout_kind, seed, &[]);
    let inline: u64 = stats
        .iter()
        .map(|s| s["copies_inline"].as_u64().unwrap())
        .sum();
    assert!(inline > 0, "small copies should run inline: {stats:?}");
}

/// Runs randomized rounds and returns the SPs' counters.
fn run_random_ops_with(
    sps_per_node: u32,
    layout_kind: Layout,
    seed: u64,
    serve_args: &[&str],
) -> Vec<serde_json::Value> {
    let (nodes, rpn) = (2u32, 2u32);
    let world = nodes * rpn;
    let mut set = SpSet::start_with(nodes, sps_per_node, rpn, layout_kind, serve_args);
    let job = new_job();
    let mut hosts: Vec<Host> = (0..world)
        .map(|r| Host::connect(&set, job, r, world))
        .collect();
    let mut rng = Rng(seed);
    let mut seqs = std::collections::HashMap::new();
    for round in 0..12 {
        // Two to three collectives outstanding at once, on world or a random sub-communicator.
        let outstanding = 2 + rng.below(2) as usize;
        let mut ops = vec![];
        for k in 0..outstanding {
            let mut members: Vec<u32> = (0..world).collect();
            if rng.below(2) == 0 {
                members.retain(|_| rng.below(3) != 0);
                if members.is_empty() {
                    members.push(rng.below(world as u64) as u32);
                }
                for i in (1..members.len()).rev() {
                    members.swap(i, rng.below(i as u64 + 1) as usize);
                }
            }
            let leader = *members.iter().min().unwrap();
            let comm = CommId {
                leader,
                id: 1 + (members.len() as u32) * 100 + leader,
            };
            let seq = seqs.entry(comm).or_insert(0u64);
            let op = make_op(&mut rng, comm, *seq, members, 300);
            *seq += 1;
            ops.push((op, k as u32));
        }
        let mut all_posted = vec![];
        for (op, slot) in &ops {
            all_posted.push(op.post(&mut hosts, &|w| w as usize, *slot));
        }
        for (posted, (op, _)) in all_posted.iter().zip(&ops) {
            for &(h, slot, token) in posted {
                let st = hosts[h].wait(slot, token, WAIT);
                assert_eq!(
                    st,
                    Some(STATUS_OK),
                    "seed {seed} round {round}: rank {h} of {:?} got {st:?}",
                    op.comm
                );
            }
            op.check();
        }
    }
    let stats = set.stats_after_goodbyes(hosts);
    for s in &stats {
        assert_eq!(s["copies_failed"], 0, "{s}");
        assert_eq!(s["errors_sent"], 0, "{s}");
    }
    stats
}

#[test]
fn alltoallv_through_real_sps_matches_reference_block_1sp() {
    run_random_ops(1, Layout::Block, test_seed());
}

#[test]
fn alltoallv_through_real_sps_matches_reference_cyclic_2sp() {
    run_random_ops(2, Layout::Cyclic, test_seed());
}

#[test]
fn alltoallv_every_copy_on_datapath_threads() {
    // The other tests' small blocks are copied inline on the loop thread; this one sends every
    // copy through the datapath threads.
    let stats = run_random_ops_with(1, Layout::Block, test_seed(), &["--inline-copy-bytes", "0"]);
    let started: u64 = stats
        .iter()
        .map(|s| s["copies_started"].as_u64().unwrap())
        .sum();
    let inline: u64 = stats
        .iter()
        .map(|s| s["copies_inline"].as_u64().unwrap())
        .sum();
    assert!(started > 0 && inline == 0, "{stats:?}");
}

#[test]
fn alltoallv_block_2sp_and_cyclic_1sp() {
    let seed = test_seed();
    run_random_ops(2, Layout::Block, seed);
    run_random_ops(1, Layout::Cyclic, seed ^ 1);
}

/// Posts a valid 2-rank alltoallv on (hosts[a], hosts[b]) and checks it completes OK: the SP
/// still serves after whatever came before.
fn still_serves(hosts: &mut [Host], a: usize, b: usize, seq: u64) {
    let mut rng = Rng(seq);
    let comm = CommId {
        leader: a.min(b) as u32,
        id: 77,
    };
    let op = make_op(&mut rng, comm, seq, vec![a as u32, b as u32], 64);
    let posted = op.post(hosts, &|w| w as usize, 5);
    for (h, slot, token) in posted {
        assert_eq!(hosts[h].wait(slot, token, WAIT), Some(STATUS_OK));
    }
    op.check();
}

#[test]
fn hostile_descriptors_get_errors_and_the_sp_keeps_serving() {
    let mut set = SpSet::start(2, 1, 2, Layout::Block);
    let job = new_job();
    let mut hosts: Vec<Host> = (0..4).map(|r| Host::connect(&set, job, r, 4)).collect();
    let buf = vec![0u8; 64];
    let members = vec![hosts[0].sp, hosts[1].sp];
    let comm = CommId { leader: 0, id: 9 };

    let send = hosts[0].grant(&buf, Rights::READ);
    let recv = hosts[0].grant(&buf, Rights::WRITE);
    let cases: Vec<(&str, wire::PostDesc, ErrorCode)> = vec![
        (
            "block outside the grant",
            desc(
                comm,
                0,
                0,
                members.clone(),
                1,
                send.clone(),
                recv.clone(),
                (vec![8, 60], vec![0, 8], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::BadDescriptor,
        ),
        (
            "displacement + count overflows",
            desc(
                comm,
                1,
                0,
                members.clone(),
                1,
                send.clone(),
                recv.clone(),
                (vec![8, 2], vec![0, u64::MAX], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::BadDescriptor,
        ),
        (
            "send grant without read rights",
            desc(
                comm,
                2,
                0,
                members.clone(),
                1,
                recv.clone(),
                recv.clone(),
                (vec![8, 8], vec![0, 8], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::BadDescriptor,
        ),
        (
            "vector lengths disagree",
            desc(
                comm,
                3,
                0,
                members.clone(),
                1,
                send.clone(),
                recv.clone(),
                (vec![8], vec![0, 8], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::BadDescriptor,
        ),
        (
            "member SP that does not exist",
            desc(
                comm,
                4,
                0,
                vec![members[0], 999],
                1,
                send.clone(),
                recv.clone(),
                (vec![8, 8], vec![0, 8], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::UnknownComm,
        ),
        (
            "comm rank served by another SP",
            desc(
                comm,
                5,
                1,
                vec![members[0], members[0] + 1],
                1,
                send.clone(),
                recv.clone(),
                (vec![8, 8], vec![0, 8], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::UnknownComm,
        ),
        (
            "mailbox slot outside the mailbox",
            desc(
                comm,
                6,
                0,
                members.clone(),
                SLOTS + 5,
                send.clone(),
                recv.clone(),
                (vec![8, 8], vec![0, 8], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::BadDescriptor,
        ),
    ];
    for (what, d, code) in cases {
        let (slot, token) = hosts[0].post(d);
        match hosts[0].recv() {
            SpToHost::Error {
                code: got, message, ..
            } => {
                assert_eq!(got, code, "{what}: {message}");
                eprintln!("{what}: refused: {message}");
            }
            other => panic!("{what}: expected an error, got {other:?}"),
        }
        if slot < SLOTS {
            assert_eq!(
                hosts[0].wait(slot, token, WAIT),
                Some(mailbox::status_code(algorithms::Status::InvalidPost)),
                "{what}: the rank's request must complete with an error"
            );
        }
    }
    // Nothing was written into the buffers by any refused post.
    assert!(buf
        .iter()
        .all(|b| unsafe { std::ptr::read_volatile(b) } == 0));
    still_serves(&mut hosts, 2, 3, 100);
    still_serves(&mut hosts, 1, 2, 101);

    // An oversized frame closes that connection only.
    let p = set.cluster.placement(0, 4).unwrap();
    let path = &set.cluster.sp(p.sp).unwrap().host_socket;
    let mut raw = std::os::unix::net::UnixStream::connect(path).unwrap();
    raw.write_all(&u32::MAX.to_le_bytes()).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut sink = vec![];
    let _ = std::io::Read::read_to_end(&mut raw, &mut sink);
    // Garbage after a valid hello: an error reply, then the connection is closed.
    let mut h = Host::connect(&set, new_job(), 0, 4);
    h.ch.send_raw(&wire::frame(&[0xff; 32])).unwrap();
    assert!(matches!(
        h.recv(),
        SpToHost::Error {
            code: ErrorCode::BadDescriptor,
            ..
        }
    ));
    still_serves(&mut hosts, 0, 1, 102);
    // The refused posts left nothing behind once the ranks are gone.
    for host in hosts.into_iter().chain([h]) {
        host.goodbye();
    }
    std::thread::sleep(Duration::from_millis(200));
    for s in set.stop_and_stats() {
        assert_eq!(s["jobs_at_exit"], 0, "{s}");
        assert_eq!(s["instances_at_exit"], 0, "{s}");
    }
}

#[test]
fn wrong_protocol_version_is_refused_with_a_clear_reason() {
    let set = SpSet::start(1, 1, 1, Layout::Block);
    let path = &set.cluster.sp(0).unwrap().host_socket;
    let s = std::os::unix::net::UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut ch = wire::Channel::new(s);
    let hello = Hello::Host(HostHello {
        credential: String::new(),
        world_rank: 0,
        world_size: 1,
        node: 0,
        local_rank: 0,
    });
    ch.send_raw(&wire::frame(&wire::encode_hello_with_version(&hello, 99)))
        .unwrap();
    match ch.recv_hello().unwrap() {
        Hello::Reject { reason } => {
            assert!(
                reason.contains("99") && reason.contains("version"),
                "{reason}"
            )
        }
        other => panic!("expected a reject, got {other:?}"),
    }
    // A rank that belongs to another SP is refused too.
    let set2 = SpSet::start(2, 1, 1, Layout::Block);
    let s =
        std::os::unix::net::UnixStream::connect(&set2.cluster.sp(0).unwrap().host_socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut ch = wire::Channel::new(s);
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    ch.send_hello(&Hello::Host(HostHello {
        credential: bootstrap::auth::JobCredential::issue(&set2.key, 1, uid, 2).encode(),
        world_rank: 1,
        world_size: 2,
        node: 1,
        local_rank: 0,
    }))
    .unwrap();
    assert!(matches!(ch.recv_hello().unwrap(), Hello::Reject { .. }));
}

/// Posts without a mailbox slot (a host whose slots are all taken) complete by a message, with
/// the same bytes, many outstanding at once, on two communicators posted in opposite orders
/// by different ranks.
#[test]
fn posts_without_a_slot_complete_by_message() {
    let mut set = SpSet::start(2, 1, 2, Layout::Block);
    let job = new_job();
    let mut hosts: Vec<Host> = (0..4).map(|r| Host::connect(&set, job, r, 4)).collect();
    let mut rng = Rng(test_seed());
    let members: Vec<u32> = hosts.iter().map(|h| h.sp).collect();
    let comms = [CommId { leader: 0, id: 1 }, CommId { leader: 0, id: 2 }];
    const PER_COMM: u64 = 40;
    let ops: Vec<Vec<Op>> = comms
        .iter()
        .map(|&c| {
            (0..PER_COMM)
                .map(|seq| make_op(&mut rng, c, seq, vec![0, 1, 2, 3], 64))
                .collect()
        })
        .collect();
    let mut tokens = vec![vec![]; 4];
    for r in 0..4 {
        // Even ranks post communicator 1 first, odd ranks communicator 2 first.
        let order: [usize; 2] = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for c in order {
            for op in &ops[c] {
                let send = hosts[r].grant(&op.send[r], Rights::READ);
                let recv = hosts[r].grant(&op.recv[r], Rights::WRITE);
                let d = desc(
                    op.comm,
                    op.seq,
                    r as u32,
                    members.clone(),
                    0,
                    send,
                    recv,
                    (
                        op.counts[r].clone(),
                        op.send_displs[r].clone(),
                        (0..4).map(|s| op.counts[s][r]).collect(),
                        op.recv_displs[r].clone(),
                    ),
                );
                tokens[r].push(hosts[r].post_slotless(d));
            }
        }
    }
    for r in 0..4 {
        for &t in &tokens[r] {
            assert_eq!(
                hosts[r].wait_message(t),
                Some(STATUS_OK),
                "rank {r} token {t}"
            );
        }
    }
    for op in ops.iter().flatten() {
        op.check();
    }
    for s in set.stats_after_goodbyes(hosts) {
        assert_eq!(s["instances_at_exit"], 0, "{s}");
    }
}

#[test]
fn a_rank_that_dies_mid_collective_fails_it_everywhere() {
    let set = SpSet::start(2, 1, 2, Layout::Block);
    let job = new_job();
    let mut hosts: Vec<Host> = (0..4).map(|r| Host::connect(&set, job, r, 4)).collect();
    let mut rng = Rng(7);
    let comm = CommId { leader: 0, id: 1 };
    let op = make_op(&mut rng, comm, 0, vec![0, 1, 2, 3], 32);
    // Ranks 0..3 post; rank 3 "dies" (its connection drops) without posting.
    let p = op.members_world.len();
    let members: Vec<u32> = hosts.iter().map(|h| h.sp).collect();
    let posted = op.post_ranks(
        &mut hosts,
        &|w| w as usize,
        &members,
        0,
        &(0..p - 1).collect::<Vec<_>>(),
    );
    drop(hosts.pop());
    let failed = mailbox::status_code(algorithms::Status::RankFailed);
    for (r, slot, token) in posted {
        assert_eq!(hosts[r].wait(slot, token, WAIT), Some(failed), "rank {r}");
    }
    // The failed job's state goes once its ranks are gone.
    drop(hosts);
    std::thread::sleep(Duration::from_millis(200));
    let mut set = set;
    for s in set.stop_and_stats() {
        assert_eq!(s["jobs_at_exit"], 0, "{s}");
        assert_eq!(s["instances_at_exit"], 0, "{s}");
    }
}

#[test]
fn a_peer_sp_that_dies_fails_the_collectives_that_need_it() {
    let mut set = SpSet::start(2, 1, 2, Layout::Block);
    let job = new_job();
    let mut hosts: Vec<Host> = (0..4).map(|r| Host::connect(&set, job, r, 4)).collect();
    let mut rng = Rng(8);
    let comm = CommId { leader: 0, id: 1 };
    let op = make_op(&mut rng, comm, 0, vec![0, 1, 2, 3], 32);
    let members: Vec<u32> = hosts.iter().map(|h| h.sp).collect();
    let posted = op.post_ranks(&mut hosts, &|w| w as usize, &members, 0, &[0, 1]);
    set.kill(1);
    let failed = mailbox::status_code(algorithms::Status::PeerFailed);
    for (r, slot, token) in posted {
        assert_eq!(hosts[r].wait(slot, token, WAIT), Some(failed), "rank {r}");
    }
    assert!(set.alive(0), "the surviving SP keeps running");
}

#[test]
fn posts_after_a_peer_sp_died_fail_instead_of_waiting() {
    let mut set = SpSet::start(2, 1, 2, Layout::Block);
    let job = new_job();
    let mut hosts: Vec<Host> = (0..2).map(|r| Host::connect(&set, job, r, 4)).collect();
    set.kill(1);
    // Give SP 0 time to see the loss first: this is the path where the peer is already known
    // dead when the posts arrive.
    std::thread::sleep(Duration::from_millis(300));
    let mut rng = Rng(9);
    let comm = CommId { leader: 0, id: 1 };
    let op = make_op(&mut rng, comm, 0, vec![0, 1, 2, 3], 32);
    let members = vec![0, 0, 1, 1];
    let posted = op.post_ranks(&mut hosts, &|w| w as usize, &members, 0, &[0, 1]);
    let failed = mailbox::status_code(algorithms::Status::PeerFailed);
    for (r, slot, token) in posted {
        assert_eq!(hosts[r].wait(slot, token, WAIT), Some(failed), "rank {r}");
    }
}

#[test]
fn two_jobs_share_the_sps_and_leave_nothing_behind() {
    // Two jobs at once on the same SPs, with the same communicator ids and sequence numbers:
    // only the job id keeps them apart. After both say goodbye, the SPs hold nothing.
    let seed = test_seed();
    let mut set = SpSet::start(2, 1, 2, Layout::Block);
    let (job_a, job_b) = (new_job(), new_job());
    let mut a: Vec<Host> = (0..4).map(|r| Host::connect(&set, job_a, r, 4)).collect();
    let mut b: Vec<Host> = (0..4).map(|r| Host::connect(&set, job_b, r, 4)).collect();
    let mut rng = Rng(seed);
    let comm = CommId { leader: 0, id: 1 };
    for seq in 0..10 {
        let op_a = make_op(&mut rng, comm, seq, vec![0, 1, 2, 3], 200);
        let op_b = make_op(&mut rng, comm, seq, vec![3, 2, 1, 0], 200);
        let pa = op_a.post(&mut a, &|w| w as usize, (seq % 4) as u32);
        let pb = op_b.post(&mut b, &|w| w as usize, (seq % 4) as u32);
        for (hosts, posted) in [(&a, pa), (&b, pb)] {
            for (h, slot, token) in posted {
                assert_eq!(
                    hosts[h].wait(slot, token, WAIT),
                    Some(STATUS_OK),
                    "seed {seed}"
                );
            }
        }
        op_a.check();
        op_b.check();
    }
    for h in a.into_iter().chain(b) {
        h.goodbye();
    }
    std::thread::sleep(Duration::from_millis(200));
    for s in set.stop_and_stats() {
        assert_eq!(s["jobs_at_exit"], 0, "{s}");
        assert_eq!(s["instances_at_exit"], 0, "{s}");
        assert_eq!(s["posts"], 40, "{s}");
    }
}

#[test]
fn alltoallv_with_ucx_grants() {
    // Send and receive buffers granted through UCX (ucp_mem_map + packed rkey); the SPs copy
    // with ucp_get/put on their datapath threads. On this UCX the owner must progress its
    // worker, which the waiting hosts do.
    let seed = test_seed();
    let mut set = SpSet::start_with(2, 1, 2, Layout::Block, &["--ucx"]);
    let job = new_job();
    let ucx = std::rc::Rc::new(std::cell::RefCell::new(
        alias_mkey::host::UcxRegistrar::new().expect("UCX context"),
    ));
    let mut hosts: Vec<Host> = (0..4)
        .map(|r| {
            let mut h = Host::connect(&set, job, r, 4);
            h.ucx = Some(ucx.clone());
            h
        })
        .collect();
    let mut rng = Rng(seed);
    for seq in 0..4 {
        let comm = CommId { leader: 0, id: 3 };
        let op = make_op(&mut rng, comm, seq, vec![0, 1, 2, 3], 5000);
        let posted = op.post(&mut hosts, &|w| w as usize, 0);
        for (h, slot, token) in posted {
            assert_eq!(
                hosts[h].wait(slot, token, WAIT),
                Some(STATUS_OK),
                "seed {seed}"
            );
        }
        op.check();
    }
    let stats = set.stats_after_goodbyes(hosts);
    let started: u64 = stats
        .iter()
        .map(|s| s["copies_started"].as_u64().unwrap())
        .sum();
    let inline: u64 = stats
        .iter()
        .map(|s| s["copies_inline"].as_u64().unwrap())
        .sum();
    assert!(
        started > 0 && inline == 0,
        "ucx copies run on datapath threads: {stats:?}"
    );
}

#[test]
fn ucx_grants_are_refused_by_an_sp_without_ucx() {
    let set = SpSet::start_with(1, 1, 2, Layout::Block, &["--ucx=off"]);
    let mut hosts: Vec<Host> = (0..2)
        .map(|r| Host::connect(&set, new_job(), r, 2))
        .collect();
    let ucx = std::rc::Rc::new(std::cell::RefCell::new(
        alias_mkey::host::UcxRegistrar::new().expect("UCX context"),
    ));
    hosts[0].ucx = Some(ucx);
    let (sbuf, rbuf) = (vec![0u8; 16], vec![0u8; 16]);
    let s = hosts[0].grant(&sbuf, Rights::READ);
    let r = hosts[0].grant(&rbuf, Rights::WRITE);
    let d = desc(
        CommId { leader: 0, id: 1 },
        0,
        0,
        vec![0],
        0,
        s,
        r,
        (vec![8], vec![0], vec![8], vec![0]),
    );
    hosts[0].post(d);
    match hosts[0].recv() {
        SpToHost::Error {
            code: ErrorCode::BadDescriptor,
            message,
            ..
        } => {
            assert!(message.contains("ucx"), "{message}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_post_after_a_rank_died_fails_instead_of_waiting() {
    // Rank 0 dies without posting; its SP forgets the job. Rank 1 posts afterwards: its
    // announcement to rank 0's SP must still be answered, so rank 1 completes with an error.
    let set = SpSet::start(2, 1, 1, Layout::Block);
    let job = new_job();
    let mut hosts: Vec<Host> = (0..2).map(|r| Host::connect(&set, job, r, 2)).collect();
    let mut rng = Rng(11);
    let op = make_op(&mut rng, CommId { leader: 0, id: 1 }, 0, vec![0, 1], 32);
    let members = vec![hosts[0].sp, hosts[1].sp];
    // Rank 0's connection drops; give the SPs time to forget the job.
    let dead = std::mem::replace(&mut hosts[0], Host::connect(&set, new_job(), 0, 2));
    drop(dead);
    std::thread::sleep(Duration::from_millis(300));
    let posted = op.post_ranks(&mut hosts, &|w| w as usize, &members, 0, &[1]);
    let failed = mailbox::status_code(algorithms::Status::RankFailed);
    for (h, slot, token) in posted {
        assert_eq!(hosts[h].wait(slot, token, WAIT), Some(failed), "rank {h}");
    }
}

#[test]
fn a_completion_never_reaches_a_host_that_reused_a_dead_hosts_connection() {
    // Job 1 has ranks 0 and 1 on SP 0 and ranks 2 and 3 on SP 1. Rank 0 posts while SP 1 is
    // stopped, then dies; rank 1 stays, so SP 0 keeps the job and the instance. A rank of job 2
    // connects to SP 0 and may get the dead host's table entry. When SP 1 resumes, the dead
    // rank's instance completes: that completion must not land in job 2's mailbox.
    let mut set = SpSet::start(2, 1, 2, Layout::Block);
    let job1 = new_job();
    let mut hosts: Vec<Host> = (0..4).map(|r| Host::connect(&set, job1, r, 4)).collect();
    let mut rng = Rng(12);
    let op = make_op(
        &mut rng,
        CommId { leader: 0, id: 1 },
        0,
        vec![0, 1, 2, 3],
        32,
    );
    let members: Vec<u32> = hosts.iter().map(|h| h.sp).collect();
    let sp1 = set.sps[1].child.id() as i32;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(sp1, libc::SIGSTOP) };
    let posted = op.post_ranks(&mut hosts, &|w| w as usize, &members, 5, &[0]);
    let dead = std::mem::replace(&mut hosts[0], Host::connect(&set, new_job(), 1, 4));
    drop(dead);
    std::thread::sleep(Duration::from_millis(200));
    let newcomer = Host::connect(&set, new_job(), 0, 4);
    // SAFETY: as above.
    unsafe { libc::kill(sp1, libc::SIGCONT) };
    // The token the dead rank's post carried; the newcomer never posted anything.
    assert_eq!(
        newcomer.wait(5, posted[0].2, Duration::from_millis(1500)),
        None
    );
    drop(newcomer);
    drop(hosts);
    std::thread::sleep(Duration::from_millis(200));
    for s in set.stop_and_stats() {
        assert_eq!(s["jobs_at_exit"], 0, "{s}");
        assert_eq!(s["instances_at_exit"], 0, "{s}");
    }
}

#[test]
fn stats_command_reads_the_counters_of_running_sps() {
    let mut set = SpSet::start(2, 1, 2, Layout::Block);
    let job = new_job();
    let mut hosts: Vec<Host> = (0..4).map(|r| Host::connect(&set, job, r, 4)).collect();
    let mut rng = Rng(21);
    let op = make_op(
        &mut rng,
        CommId { leader: 0, id: 1 },
        0,
        vec![0, 1, 2, 3],
        64,
    );
    for (h, slot, token) in op.post(&mut hosts, &|w| w as usize, 0) {
        assert_eq!(hosts[h].wait(slot, token, WAIT), Some(STATUS_OK));
    }
    let stats = |set: &SpSet| {
        std::process::Command::new(env!("CARGO_BIN_EXE_service-process"))
            .args(["stats", "--json", "--cluster"])
            .arg(&set.cluster_path)
            .output()
            .unwrap()
    };
    let out = stats(&set);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["sp"], i, "{r}");
        assert_eq!(r["posts"], 2, "each SP served two ranks' posts: {r}");
        assert_eq!(r["jobs_at_exit"], 1, "the job is still connected: {r}");
    }
    // An SP that is gone is reported, and the command fails.
    set.kill(1);
    let out = stats(&set);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("SP 1"),
        "{out:?}"
    );
}

/// The node segment's name outlives no job: here SP 0's rank leaves while SP 1, on the same
/// node, never had a rank of the job connected (its rank never came). SP 0 must not wait for
/// SP 1 to say the job is gone there: SP 1 answers that it does not have the job.
#[test]
fn a_node_segment_name_is_removed_when_the_other_sp_never_had_the_job() {
    let set = SpSet::start(1, 2, 2, Layout::Block);
    let job = new_job();
    let name = service_process::access::segment_name(&set.key, job, 0);
    let path = std::path::Path::new("/dev/shm").join(name.trim_start_matches('/'));
    let c = std::ffi::CString::new(name.clone()).unwrap();
    // SAFETY: a valid C string; the fd is closed at once.
    let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT, 0o600) };
    assert!(fd >= 0, "shm_open {name}");
    // SAFETY: our fd.
    unsafe { libc::close(fd) };
    assert!(path.exists());
    // World rank 0 is SP 0's, rank 1 SP 1's; only rank 0 connects.
    let host = Host::connect(&set, job, 0, 2);
    host.goodbye();
    let t = std::time::Instant::now();
    while path.exists() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left = path.exists();
    // SAFETY: a valid C string (cleanup if the SPs did not).
    unsafe { libc::shm_unlink(c.as_ptr()) };
    assert!(!left, "{name} still there 10 s after the job ended on SP 0");
}
