//! The SPs take placement from the ranks, not from a layout: real SP processes, this test
//! process playing host ranks placed irregularly (as the shim places them from MPI), hellos
//! checked against the SP's own node and index, and locality (the inter/intra-node byte
//! counters) from what the job's hellos and descriptors said.
#![allow(clippy::needless_range_loop)]

mod common;

use algorithms::CommId;
use bootstrap::mailbox::STATUS_OK;
use bootstrap::placement::place_ranks;
use bootstrap::testing::hinted_reports;
use bootstrap::wire::{self, ErrorCode, Hello, HostHello};
use bootstrap::{Layout, Placement};
use common::alltoallv::make_op;
use common::*;
use std::time::Duration;

/// Every rank's placement for a node-of-rank map, as the shim computes it.
fn placed(set: &SpSet, nodes: &[u32]) -> Vec<Placement> {
    place_ranks(&set.cluster, &hinted_reports(nodes)).unwrap()
}

/// Irregular node maps (3+1, 1+2+1 interleaved, a node without ranks) that no layout of
/// the description gives: alltoallvs through real SPs match the reference byte for byte, each
/// SP posts exactly for its ranks, and the byte counters split inter- and intra-node bytes
/// exactly as the ranks' nodes say.
#[test]
fn irregular_placements_are_served_and_counted_by_the_ranks_nodes() {
    let seed = test_seed();
    let mut rng = Rng(seed);
    for (k, nodes_of_ranks) in [
        (1u32, vec![0u32, 0, 0, 1]),
        (2, vec![1, 0, 2, 1]),
        (2, vec![2, 2, 0, 2, 2, 0]),
    ] {
        // A layout of 1 rank per node: every map above contradicts it.
        let mut set = SpSet::start(3, k, 1, Layout::Block);
        let job = new_job();
        let size = nodes_of_ranks.len() as u32;
        let places = placed(&set, &nodes_of_ranks);
        let mut hosts: Vec<Host> = (0..size)
            .map(|r| Host::connect_placed(&set, job, r, size, places[r as usize]))
            .collect();
        let (mut inter, mut intra) = (0u64, 0u64);
        let rounds = 4;
        for seq in 0..rounds {
            let comm = CommId { leader: 0, id: 1 };
            let op = make_op(&mut rng, comm, seq, (0..size).collect(), 300);
            let posted = op.post(&mut hosts, &|w| w as usize, seq as u32);
            assert_completed(&hosts, &posted, STATUS_OK, "irregular alltoallv");
            op.check();
            for s in 0..size as usize {
                for d in 0..size as usize {
                    if nodes_of_ranks[s] == nodes_of_ranks[d] {
                        intra += op.counts[s][d];
                    } else {
                        inter += op.counts[s][d];
                    }
                }
            }
        }
        let stats = set.stats_after_goodbyes(hosts);
        for (id, st) in stats.iter().enumerate() {
            let ranks = places.iter().filter(|p| p.sp as usize == id).count() as u64;
            assert_eq!(
                st["posts"],
                ranks * rounds,
                "SP {id} of {nodes_of_ranks:?}: {st}"
            );
            assert_eq!(st["errors_sent"], 0, "{st}");
            assert_eq!(st["hellos_refused"], 0, "{st}");
        }
        assert_eq!(
            sum(&stats, "bytes_inter_node"),
            inter,
            "{nodes_of_ranks:?} K={k}"
        );
        assert_eq!(
            sum(&stats, "bytes_intra_node"),
            intra,
            "{nodes_of_ranks:?} K={k}"
        );
        eprintln!("{nodes_of_ranks:?} K={k}: {inter} inter-node, {intra} intra-node bytes");
    }
}

/// Says hello to SP `sp` as `rank` of `size` placed at `node` / `local_rank`; the answer.
fn hello(set: &SpSet, sp: u32, rank: u32, size: u32, node: u32, local_rank: u32) -> Hello {
    let path = &set.cluster.sp(sp).unwrap().host_socket;
    let s = std::os::unix::net::UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut ch = wire::Channel::new(s);
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let credential = bootstrap::auth::JobCredential::issue(&set.key, new_job(), uid, size);
    ch.send_hello(&Hello::Host(HostHello {
        credential: credential.encode(),
        world_rank: rank,
        world_size: size,
        node,
        local_rank,
        pid: std::process::id(),
    }))
    .unwrap();
    ch.recv_hello().unwrap()
}

#[test]
fn a_hello_must_name_the_sps_node_and_index() {
    let set = SpSet::start(2, 2, 1, Layout::Block);
    // SP 3 is index 1 of node 1: local ranks 1, 3, 5... of node 1, whatever the world rank.
    for (rank, node, local) in [(0, 1, 1), (5, 1, 3), (2, 1, 7)] {
        let got = hello(&set, 3, rank, 8, node, local);
        assert_eq!(
            got,
            Hello::Welcome { sp: 3 },
            "rank {rank} node {node} local {local}"
        );
    }
    for (node, local, says) in [(0, 1, "index 1 of node 0"), (1, 2, "index 0 of node 1")] {
        match hello(&set, 3, 4, 8, node, local) {
            Hello::Reject { reason } => {
                assert!(
                    reason.contains(says) && reason.contains("not this SP 3 (index 1 of node 1)"),
                    "{reason}"
                )
            }
            other => panic!("node {node} local {local}: expected a refusal, got {other:?}"),
        }
    }
}

/// A descriptor that gives a rank another SP than its hello (or an earlier descriptor) did is
/// refused; the job goes on.
#[test]
fn a_descriptor_cannot_move_a_rank_to_another_sp() {
    let set = SpSet::start(2, 1, 1, Layout::Block);
    let job = new_job();
    // Ranks 0 and 1 on node 0 (SP 0), rank 2 on node 1 (SP 1).
    let places = placed(&set, &[0, 0, 1]);
    let mut hosts: Vec<Host> = (0..3)
        .map(|r| Host::connect_placed(&set, job, r, 3, places[r as usize]))
        .collect();
    let mut rng = Rng(test_seed());
    let comm = CommId { leader: 0, id: 1 };
    let op = make_op(&mut rng, comm, 0, vec![0, 1, 2], 64);
    // Rank 0 says rank 1 is SP 1's: SP 0 heard rank 1's hello.
    let d = op.desc_for(&mut hosts[0], &[0, 1, 1], 0, 0);
    hosts[0].post(d);
    let message = refusal(hosts[0].recv(), ErrorCode::BadDescriptor, "a wrong SP");
    assert!(
        message.contains("world rank 1) is said to be served by SP 1, but it is SP 0's"),
        "{message}"
    );
    // The true placement still works on another communicator.
    let comm = CommId { leader: 0, id: 2 };
    let op = make_op(&mut rng, comm, 0, vec![0, 1, 2], 64);
    let posted = op.post(&mut hosts, &|w| w as usize, 1);
    assert_completed(&hosts, &posted, STATUS_OK, "the true placement");
    op.check();
    // Once a descriptor's members and ranks were learned (SP 0 skips its lookups for a post
    // that names the same lists again), one that moves a rank is refused just the same.
    let comm = CommId { leader: 0, id: 3 };
    let op = make_op(&mut rng, comm, 0, vec![0, 1, 2], 64);
    let d = op.desc_for(&mut hosts[0], &[0, 1, 1], 0, 0);
    hosts[0].post(d);
    let message = refusal(
        hosts[0].recv(),
        ErrorCode::BadDescriptor,
        "a wrong SP, later",
    );
    assert!(
        message.contains("world rank 1) is said to be served by SP 1, but it is SP 0's"),
        "{message}"
    );
}
