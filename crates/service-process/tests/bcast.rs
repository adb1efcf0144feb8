//! The staged broadcast through real SP processes, with this test process playing the host
//! ranks (as in `engine.rs`): hostile descriptors, the staging bound, and a peer SP that dies
//! while chunks flow. (MPI programs through the shim are in the host-shim tests.)

mod common;

use algorithms::{CommId, Status};
use alias_mkey::{Grant, Rights};
use bootstrap::mailbox::{self, STATUS_OK};
use bootstrap::wire::{CollKind, ErrorCode, PostDesc, Staged, StagedDesign};
use bootstrap::Layout;
use common::*;
use std::time::Duration;
const SENTINEL: u8 = 0x3C;

/// A bcast post of `buf` by world rank `r` (= comm rank) of a world communicator.
#[allow(clippy::too_many_arguments)]
fn bcast_desc(
    hosts: &mut [Host],
    set: &SpSet,
    comm: CommId,
    seq: u64,
    r: usize,
    root: u32,
    buf: &[u8],
    design: StagedDesign,
    segment: Option<Grant>,
) -> PostDesc {
    let members: Vec<u32> = hosts.iter().map(|h| h.sp).collect();
    let nodes = members
        .iter()
        .map(|&sp| set.cluster.sp(sp).unwrap().node)
        .collect();
    let len = buf.len() as u64;
    let is_root = r as u32 == root;
    let (send, recv) = if is_root {
        (
            hosts[r].grant(buf, Rights::READ),
            hosts[r].grant(&buf[..0], Rights::WRITE),
        )
    } else {
        (
            hosts[r].grant(&buf[..0], Rights::READ),
            hosts[r].grant(buf, Rights::WRITE),
        )
    };
    PostDesc {
        kind: CollKind::Bcast,
        comm,
        seq,
        comm_rank: r as u32,
        world_ranks: hosts.iter().map(|h| h.world_rank).collect(),
        members,
        nodes,
        slot: Some((seq % 8) as u32),
        token: 0,
        send,
        recv,
        send_counts: vec![if is_root { len } else { 0 }],
        send_displs: vec![0],
        recv_counts: vec![if is_root { 0 } else { len }],
        recv_displs: vec![0],
        host_copies: false,
        send_packed: false,
        recv_packed: false,
        reduce: None,
        stamps: Default::default(),
        staged: Some(Staged {
            root,
            design,
            segment,
        }),
    }
}

/// Flat bcast posts of rank r = 0, 1, ... with `bufs[r]`, from `root`.
fn flat_descs(
    hosts: &mut [Host],
    set: &SpSet,
    comm: CommId,
    seq: u64,
    root: u32,
    bufs: &[Vec<u8>],
) -> Vec<PostDesc> {
    (0..bufs.len())
        .map(|r| {
            let design = StagedDesign::Flat;
            bcast_desc(hosts, set, comm, seq, r, root, &bufs[r], design, None)
        })
        .collect()
}

/// Posts `descs[i]` on `hosts[i]`; returns (host index, slot, token) per post.
fn post_each(
    hosts: &mut [Host],
    descs: impl IntoIterator<Item = PostDesc>,
) -> Vec<(usize, u32, u64)> {
    descs
        .into_iter()
        .enumerate()
        .map(|(i, d)| {
            let (slot, token) = hosts[i].post(d);
            (i, slot, token)
        })
        .collect()
}

/// The buffers of `n` ranks for a bcast of `data` from `root`: the data on the root, the
/// sentinel elsewhere.
fn bcast_bufs(n: usize, root: usize, data: &[u8]) -> Vec<Vec<u8>> {
    (0..n)
        .map(|r| {
            if r == root {
                data.to_vec()
            } else {
                vec![SENTINEL; data.len()]
            }
        })
        .collect()
}

/// The ranks before `stay` say goodbye and leave; the others are returned.
fn leave_before(mut hosts: Vec<Host>, stay: usize) -> Vec<Host> {
    let staying = hosts.split_off(stay);
    for h in hosts {
        h.goodbye();
    }
    std::thread::sleep(Duration::from_millis(200));
    staying
}

/// A flat bcast of `len` bytes from `root` among all hosts; returns the statuses and checks
/// the bytes of those that completed Ok.
fn flat_bcast(
    hosts: &mut [Host],
    set: &SpSet,
    seq: u64,
    root: u32,
    len: usize,
) -> Vec<Option<u32>> {
    let comm = CommId { leader: 0, id: 1 };
    let data: Vec<u8> = (0..len).map(|i| (i * 31 + seq as usize) as u8).collect();
    let bufs = bcast_bufs(hosts.len(), root as usize, &data);
    let descs = flat_descs(hosts, set, comm, seq, root, &bufs);
    let posted = post_each(hosts, descs);
    let got = wait_all_serving(hosts, &posted, WAIT);
    for (r, g) in got.iter().enumerate() {
        if *g == Some(STATUS_OK) {
            assert!(
                read_back(&bufs[r]) == data,
                "seq {seq} rank {r}: wrong bytes"
            );
        }
    }
    got
}

#[test]
fn bcast_through_real_sps_and_hostile_descriptors() {
    let (mut set, mut hosts) = SpSet::start_job(2, 1, 2, Layout::Block);
    // Several sizes around the default 256 KiB chunk, every root.
    for (seq, (root, len)) in [(0, 0), (1, 1), (2, 262_144), (3, 700_001)]
        .into_iter()
        .enumerate()
    {
        let got = flat_bcast(&mut hosts, &set, seq as u64, root, len);
        assert!(got.iter().all(|&g| g == Some(STATUS_OK)), "{got:?}");
    }
    let buf = vec![0u8; 64];
    let comm = CommId { leader: 0, id: 9 };
    let good = |hosts: &mut [Host], seq: u64| {
        bcast_desc(hosts, &set, comm, seq, 1, 0, &buf, StagedDesign::Flat, None)
    };
    let ro_segment = hosts[1].grant(&buf, Rights::READ);
    let mut cases: Vec<(&str, PostDesc)> = vec![];
    let mut d = good(&mut hosts, 10);
    d.staged = None;
    cases.push(("no root and design", d));
    let mut d = good(&mut hosts, 11);
    d.staged.as_mut().unwrap().root = 4;
    cases.push(("root outside the communicator", d));
    let mut d = good(&mut hosts, 12);
    d.send_counts = vec![8];
    cases.push(("a receiver that also sends", d));
    let mut d = good(&mut hosts, 13);
    d.recv_counts = vec![65];
    cases.push(("a receive block beyond its grant", d));
    let mut d = good(&mut hosts, 14);
    d.staged.as_mut().unwrap().design = StagedDesign::Hier;
    cases.push(("hierarchical without a segment", d));
    let mut d = good(&mut hosts, 15);
    *d.staged.as_mut().unwrap() = Staged {
        root: 0,
        design: StagedDesign::Hier,
        segment: Some(ro_segment),
    };
    cases.push(("a segment the SP may not write", d));
    let mut d = good(&mut hosts, 16);
    d.recv_counts = vec![8, 8];
    cases.push(("two receive blocks", d));
    for (what, d) in cases {
        let (slot, token) = hosts[1].post(d);
        let message = refusal(hosts[1].recv(), ErrorCode::BadDescriptor, what);
        eprintln!("{what}: refused: {message}");
        assert_eq!(
            hosts[1].wait(slot, token, WAIT),
            Some(mailbox::status_code(Status::InvalidPost)),
            "{what}"
        );
    }
    assert!(read_back(&buf).iter().all(|&b| b == 0));
    // The SPs still serve the job (a new communicator: the refused ones aborted theirs).
    let got = flat_bcast(&mut hosts, &set, 20, 3, 5000);
    assert!(got.iter().all(|&g| g == Some(STATUS_OK)), "{got:?}");
    for s in set.stats_after_goodbyes(hosts) {
        assert_eq!(s["instances_at_exit"], 0, "{s}");
        assert_eq!(s["copies_failed"], 0, "{s}");
    }
}

/// The root and the other rank of its SP finish their part of a broadcast, say goodbye and
/// leave before the other node's ranks post (legal MPI: a rank may finalize once its own part
/// is done). Their SP still owes the message to the other node: it must forward it, and the
/// late ranks must get it. A rank that leaves without posting, on the other hand, fails the
/// collective of the ranks that wait for it, in bounded time.
#[test]
fn ranks_that_leave_once_their_part_is_done_fail_nobody() {
    let (mut set, mut hosts) = SpSet::start_job(2, 1, 2, Layout::Block);
    let comm = CommId { leader: 0, id: 1 };
    // Fits the root SP's staging: the root completes before node 1 posts anything.
    let len = 100_003;
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + 1) as u8).collect();
    let bufs = bcast_bufs(4, 0, &data);
    let mut descs = flat_descs(&mut hosts, &set, comm, 0, 0, &bufs);
    let late_descs = descs.split_off(2);
    let early = post_each(&mut hosts, descs);
    let got = wait_all_serving(&mut hosts, &early, WAIT);
    assert_eq!(got, [Some(STATUS_OK); 2]);
    let mut late_hosts = leave_before(hosts, 2);
    let late = post_each(&mut late_hosts, late_descs);
    let got = wait_all_serving(&mut late_hosts, &late, WAIT);
    assert_eq!(
        got,
        [Some(STATUS_OK); 2],
        "the late ranks must get the message"
    );
    for (r, buf) in bufs.iter().enumerate().skip(1) {
        assert!(read_back(buf) == data, "rank {r}: wrong bytes");
    }

    // A second job: node 0's ranks leave without posting; node 1's must fail, not hang.
    let job = new_job();
    let mut hosts = Host::connect_all(&set, job, 4);
    let descs = flat_descs(&mut hosts, &set, comm, 0, 0, &bufs);
    let mut late_hosts = leave_before(hosts, 2);
    let late = post_each(&mut late_hosts, descs.into_iter().skip(2));
    let got = wait_all_serving(&mut late_hosts, &late, WAIT);
    assert!(
        got.iter().all(|g| g.is_some_and(|s| s != STATUS_OK)),
        "ranks waiting for ranks that left without posting must fail: {got:?}"
    );
    for s in set.stats_after_goodbyes(late_hosts) {
        assert_eq!(s["instances_at_exit"], 0, "{s}");
    }
}

#[test]
fn sps_with_and_without_ucx_broadcast_together() {
    // SP 1 runs without UCX, SP 0 with it. SP 0 grants its slots through UCX to
    // SP 1, which cannot put, and SP 1 grants none that way: every chunk between them travels
    // as a frame, in both directions, and the bytes are right.
    let mut set = SpSet::start_each(
        2,
        1,
        2,
        Layout::Block,
        &[],
        &[(0, "--ucx=on"), (1, "--ucx=off")],
    );
    let job = new_job();
    let mut hosts = Host::connect_all(&set, job, 4);
    for (seq, root) in [0u32, 2, 1, 3].into_iter().enumerate() {
        let got = flat_bcast(&mut hosts, &set, seq as u64, root, 600_000);
        assert!(
            got.iter().all(|&g| g == Some(STATUS_OK)),
            "root {root}: {got:?}"
        );
    }
    let stats = set.stats_after_goodbyes(hosts);
    assert_zero(
        &stats,
        &["copies_failed", "chunks_moved_ucx", "instances_at_exit"],
    );
    // 600 000 bytes are 3 chunks of 256 KiB; each of the 4 broadcasts crosses once.
    let moved = sum(&stats, "chunks_moved");
    assert_eq!(moved, 12, "{stats:?}");
}

/// An instance takes the staging slots its message can fill and no more (4 configured, of
/// 256 KiB): one for a message of one chunk, three for three chunks, both on the root's SP,
/// whose instance a post makes, and on the other node's SP, whose instance its parent's
/// `Open` makes before its own ranks post.
#[test]
fn a_bcast_holds_the_staging_its_message_needs() {
    let (set, mut hosts) = SpSet::start_job(2, 1, 2, Layout::Block);
    let comm = CommId { leader: 0, id: 1 };
    for (seq, len, slots) in [(0u64, 100usize, 1u64), (1, 700_001, 3)] {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + seq as usize) as u8).collect();
        let bufs = bcast_bufs(4, 0, &data);
        let mut descs = flat_descs(&mut hosts, &set, comm, seq, 0, &bufs);
        let late = descs.split_off(2);
        // Node 0's ranks (SP 0, the root's) first: SP 1 learns the instance from SP 0's `Open`.
        let mut posted = post_each(&mut hosts[..2], descs);
        std::thread::sleep(Duration::from_millis(300));
        posted.extend(
            post_each(&mut hosts[2..], late)
                .into_iter()
                .map(|(i, slot, token)| (i + 2, slot, token)),
        );
        let got = wait_all_serving(&mut hosts, &posted, WAIT);
        assert_eq!(got, [Some(STATUS_OK); 4], "seq {seq}");
        for (r, b) in bufs.iter().enumerate() {
            assert!(read_back(b) == data, "seq {seq} rank {r}: wrong bytes");
        }
        for sp in 0..2 {
            let peak = query(&set, sp)["staging_peak_bytes"].as_u64().unwrap();
            assert_eq!(
                peak,
                slots * 262_144,
                "SP {sp} after a bcast of {len} bytes"
            );
        }
    }
    for h in hosts {
        h.goodbye();
    }
}

#[test]
fn a_bcast_beyond_the_staging_bound_fails_instead_of_allocating() {
    // 1 MiB of staging per SP, half of it a job's share; a message of 3 chunks of 512 KiB
    // takes 3 slots of 512 KiB per instance: no instance fits.
    let mut set = SpSet::start_with(
        2,
        1,
        2,
        Layout::Block,
        &["--staging-mib", "1", "--stage-chunk-bytes", "524288"],
    );
    let job = new_job();
    let mut hosts = Host::connect_all(&set, job, 4);
    let bufs = bcast_bufs(4, 0, &vec![9u8; 1_100_000]);
    let descs = flat_descs(&mut hosts, &set, CommId { leader: 0, id: 1 }, 0, 0, &bufs);
    let posted = post_each(&mut hosts, descs);
    // Each rank is told why (the job's share of the staging cannot hold an instance).
    for h in hosts.iter_mut() {
        let m = refusal(h.recv(), ErrorCode::BadDescriptor, "staging");
        assert!(m.contains("--staging-job-share"), "{m}");
    }
    let got: Vec<Option<u32>> = posted
        .iter()
        .map(|&(h, slot, token)| hosts[h].wait(slot, token, WAIT))
        .collect();
    assert!(got.iter().all(|g| g.is_some()), "{got:?}");
    assert!(
        got.iter().filter(|&&g| g != Some(STATUS_OK)).count() >= 3,
        "every rank but possibly the root fails: {got:?}"
    );
    let stats = set.stats_after_goodbyes(hosts);
    let refused = sum(&stats, "staging_refused");
    assert!(refused > 0, "{stats:?}");
    for s in &stats {
        assert_eq!(s["instances_at_exit"], 0, "{s}");
        assert!(s["staging_peak_bytes"].as_u64().unwrap() <= 1 << 20, "{s}");
    }
}

#[test]
fn a_peer_sp_that_dies_mid_bcast_fails_it_on_every_live_rank() {
    let (mut set, mut hosts) = SpSet::start_job(2, 1, 2, Layout::Block);
    let comm = CommId { leader: 0, id: 1 };
    let len = 4 << 20;
    let data = vec![7u8; len];
    let bufs: Vec<Vec<u8>> = (0..4)
        .map(|r| if r == 0 { data.clone() } else { vec![0; len] })
        .collect();
    // Ranks 0 and 1 (node 0, SP 0) post; node 1's ranks never do, so its SP holds chunks in
    // staging until it is killed.
    let descs = flat_descs(&mut hosts, &set, comm, 0, 0, &bufs[..2]);
    let posted = post_each(&mut hosts, descs);
    std::thread::sleep(Duration::from_millis(200));
    set.kill(1);
    let got = wait_all_serving(&mut hosts, &posted, WAIT);
    assert!(got.iter().all(|g| g.is_some()), "no rank may hang: {got:?}");
    assert_eq!(
        got[1],
        Some(mailbox::status_code(Status::PeerFailed)),
        "the receiver on the live SP: {got:?}"
    );
}
