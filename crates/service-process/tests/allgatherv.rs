//! The hierarchical Allgatherv through real SP processes, with this test process playing the
//! host ranks (as in `engine.rs`): bytes checked against a directly computed allgatherv, and
//! the late-arrival paths checked from the SPs' own counters.
#![allow(clippy::needless_range_loop)]

mod common;

use algorithms::CommId;
use alias_mkey::Rights;
use bootstrap::mailbox::STATUS_OK;
use bootstrap::wire::{CollKind, PostDesc};
use bootstrap::Layout;
use common::*;
use std::time::Duration;
const SENTINEL: u8 = 0x5A;

struct AgOp {
    comm: CommId,
    seq: u64,
    /// Comm rank -> world rank (= host index).
    members_world: Vec<u32>,
    counts: Vec<u64>,
    send: Vec<Vec<u8>>,
    recv: Vec<Vec<u8>>,
    recv_displs: Vec<Vec<u64>>,
}

fn make(rng: &mut Rng, comm: CommId, seq: u64, members_world: Vec<u32>, max: u64) -> AgOp {
    let p = members_world.len();
    let counts: Vec<u64> = (0..p)
        .map(|_| {
            if rng.below(4) == 0 {
                0
            } else {
                rng.below(max + 1)
            }
        })
        .collect();
    let send = counts
        .iter()
        .map(|&c| (0..c).map(|_| rng.next() as u8).collect())
        .collect();
    let mut recv = vec![];
    let mut recv_displs = vec![];
    for _ in 0..p {
        // Blocks in a random order with random gaps.
        let (d, off) = shuffled_layout(rng, &counts);
        recv.push(vec![SENTINEL; off as usize]);
        recv_displs.push(d);
    }
    AgOp {
        comm,
        seq,
        members_world,
        counts,
        send,
        recv,
        recv_displs,
    }
}

impl AgOp {
    fn desc(&self, hosts: &mut [Host], set: &SpSet, r: usize, slot: u32) -> PostDesc {
        let members: Vec<u32> = self
            .members_world
            .iter()
            .map(|&w| hosts[w as usize].sp)
            .collect();
        let nodes = members
            .iter()
            .map(|&sp| set.cluster.sp(sp).unwrap().node)
            .collect();
        let h = self.members_world[r] as usize;
        let send = hosts[h].grant(&self.send[r], Rights::READ);
        let recv = hosts[h].grant(&self.recv[r], Rights::READ_WRITE);
        PostDesc {
            kind: CollKind::Allgatherv,
            comm: self.comm,
            seq: self.seq,
            comm_rank: r as u32,
            world_ranks: self.members_world.clone(),
            members,
            nodes,
            slot: Some(slot),
            token: 0,
            send,
            recv,
            send_counts: vec![self.counts[r]],
            send_displs: vec![0],
            recv_counts: self.counts.clone(),
            recv_displs: self.recv_displs[r].clone(),
            host_copies: false,
            send_packed: false,
            recv_packed: false,
            reduce: None,
            stamps: Default::default(),
            staged: None,
        }
    }

    fn check(&self) {
        let p = self.members_world.len();
        for d in 0..p {
            let mut want = vec![SENTINEL; self.recv[d].len()];
            for s in 0..p {
                let o = self.recv_displs[d][s] as usize;
                want[o..o + self.counts[s] as usize].copy_from_slice(&self.send[s]);
            }
            let got = read_back(&self.recv[d]);
            if let Some(i) = (0..want.len()).find(|&i| want[i] != got[i]) {
                panic!(
                    "{:?} seq {} rank {d}: byte {i} is {:#x}, allgatherv puts {:#x}",
                    self.comm, self.seq, got[i], want[i]
                );
            }
        }
    }
}

/// Runs rounds of (possibly overlapping) allgathervs; `late` comm-rank positions post after
/// the others, `delay` later. Returns the SPs' counters.
fn run(
    sps_per_node: u32,
    layout: Layout,
    seed: u64,
    rounds: u64,
    late: &[u32],
    delay: Duration,
    host_copies: bool,
) -> Vec<serde_json::Value> {
    let (nodes, rpn) = (2u32, 2u32);
    let world = nodes * rpn;
    let (mut set, mut hosts) = SpSet::start_job(nodes, sps_per_node, rpn, layout);
    let mut rng = Rng(seed);
    for round in 0..rounds {
        let mut members: Vec<u32> = (0..world).collect();
        let sub = late.is_empty() && rng.below(3) == 0;
        if sub {
            members.retain(|_| rng.below(3) != 0);
            if members.is_empty() {
                members.push(0);
            }
        }
        let leader = *members.iter().min().unwrap();
        let comm = CommId {
            leader,
            id: if sub { 50 + round as u32 } else { 1 },
        };
        let seq = if sub { 0 } else { round };
        let op = make(&mut rng, comm, seq, members.clone(), 400);
        let mut posted = vec![];
        let (early, later): (Vec<usize>, Vec<usize>) =
            (0..members.len()).partition(|&r| !late.contains(&members[r]));
        for group in [early, later] {
            for r in group {
                let mut d = op.desc(&mut hosts, &set, r, (round % 8) as u32);
                d.host_copies = host_copies;
                let h = members[r] as usize;
                let (slot, token) = hosts[h].post(d);
                posted.push((h, slot, token));
            }
            std::thread::sleep(delay);
        }
        let got = wait_all_serving(&mut hosts, &posted, WAIT);
        assert!(
            got.iter().all(|&g| g == Some(STATUS_OK)),
            "seed {seed} round {round}: {got:?}"
        );
        op.check();
    }
    let served: u64 = hosts.iter().map(|h| h.copies_served).sum();
    if !host_copies {
        assert_eq!(
            served, 0,
            "no host asked for copies, yet some were handed over"
        );
    }
    let stats = set.stats_after_goodbyes(hosts);
    assert_zero(
        &stats,
        &["copies_failed", "errors_sent", "instances_at_exit"],
    );
    stats
}

#[test]
fn allgatherv_through_real_sps_matches_reference() {
    let seed = test_seed();
    for (k, layout) in [(1, Layout::Block), (2, Layout::Cyclic), (2, Layout::Block)] {
        let stats = run(k, layout, seed, 12, &[], Duration::ZERO, false);
        let posts = sum(&stats, "posts");
        assert!(posts > 0, "{stats:?}");
    }
}

#[test]
fn blocking_allgatherv_hosts_do_the_intra_node_copies() {
    // Posts with `host_copies` (what the shim sends for MPI_Allgatherv): every intra-node copy
    // is handed to the receiving host, so the SPs copy only what crosses nodes; the result
    // is the same. Late ranks too, so that segments land on one rank and the others copy
    // them from its receive buffer.
    let seed = test_seed();
    for (k, layout, late) in [
        (1, Layout::Block, &[][..]),
        (2, Layout::Cyclic, &[][..]),
        (2, Layout::Block, &[1][..]),
    ] {
        let delay = Duration::from_millis(if late.is_empty() { 0 } else { 30 });
        let stats = run(k, layout, seed, 8, late, delay, true);
        assert!(sum(&stats, "host_copies") > 0, "{stats:?}");
        assert_eq!(sum(&stats, "host_copies_failed"), 0, "{stats:?}");
        assert_eq!(
            sum(&stats, "bytes_intra_node"),
            0,
            "the SPs copied within a node: {stats:?}"
        );
    }
}

#[test]
fn allgatherv_inter_node_bytes_are_minimal_whatever_the_layout() {
    // Each rank's block must enter each other node exactly once: the SPs' own count of bytes
    // copied from another node equals sum(block) x (nodes - 1), for block and cyclic alike.
    let seed = test_seed();
    for (k, layout) in [
        (1, Layout::Block),
        (1, Layout::Cyclic),
        (2, Layout::Block),
        (2, Layout::Cyclic),
    ] {
        let (mut set, mut hosts) = SpSet::start_job(2, k, 2, layout);
        let mut rng = Rng(seed);
        let op = make(
            &mut rng,
            CommId { leader: 0, id: 1 },
            0,
            vec![0, 1, 2, 3],
            300,
        );
        let mut posted = vec![];
        for r in 0..4 {
            let d = op.desc(&mut hosts, &set, r, 0);
            let (slot, token) = hosts[r].post(d);
            posted.push((r, slot, token));
        }
        assert_completed(&hosts, &posted, STATUS_OK, &format!("seed {seed}"));
        op.check();
        let stats = set.stop_and_stats();
        let inter = sum(&stats, "bytes_inter_node");
        let nodes = 2u64;
        let min: u64 = op.counts.iter().sum::<u64>() * (nodes - 1);
        assert_eq!(inter, min, "seed {seed} {layout:?} x{k}: {stats:?}");
    }
}

#[test]
fn allgatherv_late_ranks_take_the_pass_and_park_paths() {
    let seed = test_seed();
    // Block layout, 2 SPs per node: world ranks 0 and 1 are node 0 with SPs 0 and 1. Rank 1
    // late: announcements reaching SP 1 find no ready rank and pass to SP 0 (rank 0 ready).
    let stats = run(
        2,
        Layout::Block,
        seed,
        4,
        &[1],
        Duration::from_millis(50),
        false,
    );
    assert!(sum(&stats, "no_ready_rank") > 0, "{stats:?}");
    assert!(sum(&stats, "served_after_pass") > 0, "{stats:?}");
    // Per job too: one job here, so its counters are the SP's.
    for s in &stats {
        let jobs = s["late_arrivals_by_job"].as_array().unwrap();
        let per_job: u64 = jobs
            .iter()
            .map(|j| j["no_ready_rank"].as_u64().unwrap())
            .sum();
        assert_eq!(per_job, s["no_ready_rank"].as_u64().unwrap(), "{s}");
        assert!(jobs.len() <= 1, "{s}");
    }
    // Both ranks of node 0 late: announcements to node 0 find nobody and are parked.
    let stats = run(
        2,
        Layout::Block,
        seed ^ 1,
        4,
        &[0, 1],
        Duration::from_millis(50),
        false,
    );
    assert!(sum(&stats, "parked") > 0, "{stats:?}");
    assert!(sum(&stats, "parked_wait_ns") > 0, "{stats:?}");
}

#[test]
fn host_copy_answers_are_checked_and_a_host_dying_with_copies_pending_fails_the_job() {
    let seed = test_seed();
    let (mut set, mut hosts) = SpSet::start_job(2, 1, 2, Layout::Block);
    // An answer to a copy that was never handed out is refused; the SP keeps serving.
    hosts[0]
        .ch
        .send(&bootstrap::wire::HostToSp::CopyDone {
            ticket: 12345,
            ok: true,
        })
        .unwrap();
    let message = refusal(
        hosts[0].recv(),
        bootstrap::wire::ErrorCode::BadDescriptor,
        "a CopyDone of an unknown ticket",
    );
    assert!(message.contains("12345"), "{message}");
    let mut rng = Rng(seed);
    // At least one block must be nonempty: every block lands once in node 0 and is copied to
    // its other rank, which is what leaves copies pending. With every count 0 (about one
    // seed in 250) the collective completes at once, before rank 1 dies.
    let op = loop {
        let op = make(
            &mut rng,
            CommId { leader: 0, id: 1 },
            0,
            vec![0, 1, 2, 3],
            300,
        );
        if op.counts.iter().any(|&c| c > 0) {
            break op;
        }
    };
    let mut posted = vec![];
    for r in 0..4 {
        let mut d = op.desc(&mut hosts, &set, r, 0);
        d.host_copies = true;
        posted.push((r, hosts[r].post(d)));
    }
    // World rank 1 never serves its copies and dies without a goodbye: nobody waits for it
    // forever, and rank 0 (its node: rank 1 was to copy out of rank 0's buffers) ends with an
    // error. Ranks of the other node may already have everything they need (then they end
    // well). Nothing is left at the SPs.
    std::thread::sleep(Duration::from_millis(100));
    let dead = hosts.remove(1);
    drop(dead);
    let live: Vec<(usize, u32, u64)> = posted
        .iter()
        .filter(|(r, _)| *r != 1)
        .map(|&(r, (slot, token))| (if r > 1 { r - 1 } else { r }, slot, token))
        .collect();
    let got = wait_all_serving(&mut hosts, &live, WAIT);
    assert!(got.iter().all(|g| g.is_some()), "seed {seed}: {got:?}");
    assert_ne!(got[0], Some(STATUS_OK), "seed {seed}: {got:?}");
    let stats = set.stats_after_goodbyes(hosts);
    assert_zero(&stats, &["instances_at_exit"]);
    let handed = sum(&stats, "host_copies");
    assert!(handed > 0, "{stats:?}");
}
