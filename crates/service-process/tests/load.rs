//! Issue 24, item 9: an SP pair must survive a stalled transfer and a slow machine.
//!
//! Real SP processes, this test process playing the host ranks (as `bcast.rs` does):
//! - an SP whose UCX transfers to a peer stall (the peer is stopped with `SIGSTOP` for longer
//!   than the mover waits for a transfer, 10 s, shorter than the peer timeout) keeps its event
//!   loop going (its ranks hear its heartbeats), fails at most the collective whose transfer
//!   timed out, and the same SPs serve the next collectives with the right bytes; neither SP
//!   declares the other lost;
//! - an SP held at its start for longer than one mesh handshake may take (5 s) delays the
//!   mesh: its peer tries again instead of exiting.
//!
//! The same collectives through MPI programs on a machine whose cores are saturated are in
//! `tests/tests/load.rs` (the integration tests).

mod common;

use algorithms::CommId;
use alias_mkey::Rights;
use bootstrap::mailbox::STATUS_OK;
use bootstrap::wire::{CollKind, PostDesc, SpToHost, Staged, StagedDesign};
use bootstrap::Layout;
use common::*;
use std::time::{Duration, Instant};

const SENTINEL: u8 = 0x3C;

/// A bcast's buffers (by rank), its data and its posts, before posting.
type Prepared = (Vec<Vec<u8>>, Vec<u8>, Vec<PostDesc>);

/// A flat bcast post of `buf` by world rank `r` (= comm rank) of a world communicator.
#[allow(clippy::too_many_arguments)]
fn bcast_desc(
    hosts: &mut [Host],
    set: &SpSet,
    comm: u32,
    seq: u64,
    r: usize,
    root: u32,
    buf: &[u8],
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
        comm: CommId {
            leader: 0,
            id: comm,
        },
        seq,
        comm_rank: r as u32,
        world_ranks: hosts.iter().map(|h| h.world_rank).collect(),
        members,
        nodes,
        slot: Some((comm % 8) * 8 + (seq % 8) as u32),
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
            design: StagedDesign::Flat,
            segment: None,
        }),
    }
}

/// Posts a flat bcast of `len` bytes from `root` on every host and returns the buffers, the
/// data and what was posted.
#[allow(clippy::type_complexity)]
fn post_bcast(
    hosts: &mut [Host],
    set: &SpSet,
    seq: u64,
    root: u32,
    len: usize,
) -> (Vec<Vec<u8>>, Vec<u8>, Vec<(usize, u32, u64)>) {
    post_bcast_on(hosts, set, 1, seq, root, len)
}

/// As `post_bcast`, on communicator `comm` (a duplicate of the world's).
#[allow(clippy::type_complexity)]
fn post_bcast_on(
    hosts: &mut [Host],
    set: &SpSet,
    comm: u32,
    seq: u64,
    root: u32,
    len: usize,
) -> (Vec<Vec<u8>>, Vec<u8>, Vec<(usize, u32, u64)>) {
    let data: Vec<u8> = (0..len).map(|i| (i * 31 + seq as usize) as u8).collect();
    let bufs: Vec<Vec<u8>> = (0..hosts.len())
        .map(|r| {
            if r == root as usize {
                data.clone()
            } else {
                vec![SENTINEL; len]
            }
        })
        .collect();
    let descs = (0..hosts.len())
        .map(|r| bcast_desc(hosts, set, comm, seq, r, root, &bufs[r]))
        .collect();
    let posted = post_all(hosts, descs);
    (bufs, data, posted)
}

/// Posts `descs[i]` on `hosts[i]`; returns (host, slot, token) of each.
fn post_all(hosts: &mut [Host], descs: Vec<PostDesc>) -> Vec<(usize, u32, u64)> {
    descs
        .into_iter()
        .enumerate()
        .map(|(i, d)| {
            let (slot, token) = hosts[i].post(d);
            (i, slot, token)
        })
        .collect()
}

/// Waits for a posted bcast; asserts the bytes of every rank that completed Ok.
fn finish_bcast(
    hosts: &mut [Host],
    bufs: &[Vec<u8>],
    data: &[u8],
    posted: &[(usize, u32, u64)],
    what: &str,
) -> Vec<Option<u32>> {
    let got = wait_done(hosts, posted, Duration::from_secs(40));
    for (r, g) in got.iter().enumerate() {
        if *g == Some(STATUS_OK) {
            assert!(read_back(&bufs[r]) == data, "{what}: rank {r}: wrong bytes");
        }
    }
    got
}

/// Reads what the SPs sent the hosts so far: heartbeats (an SP sends them to a host with
/// posts outstanding; counted in `beats`, by host) and errors are fine, anything else is not
/// expected here.
fn drain_counting(hosts: &mut [Host], beats: &mut [u32]) {
    use std::os::fd::AsRawFd;
    for (i, h) in hosts.iter_mut().enumerate() {
        loop {
            let mut pfd = libc::pollfd {
                fd: h.ch.get_ref().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, no timeout.
            if unsafe { libc::poll(&mut pfd, 1, 0) } <= 0 || pfd.revents & libc::POLLIN == 0 {
                break;
            }
            match h.ch.recv::<SpToHost>() {
                Ok(SpToHost::Heartbeat) => beats[i] += 1,
                Ok(SpToHost::Error { message, .. }) => {
                    eprintln!("rank {}: error from its SP: {message}", h.world_rank)
                }
                Ok(other) => panic!("rank {}: unexpected {other:?}", h.world_rank),
                Err(_) => break,
            }
        }
    }
}

fn drain(hosts: &mut [Host]) {
    let mut beats = vec![0; hosts.len()];
    drain_counting(hosts, &mut beats);
}

/// Waits for every (host, slot, token) of `posted`, reading the hosts' messages meanwhile;
/// returns each status (None: timed out).
fn wait_done(
    hosts: &mut [Host],
    posted: &[(usize, u32, u64)],
    timeout: Duration,
) -> Vec<Option<u32>> {
    let t = Instant::now();
    let mut got: Vec<Option<u32>> = vec![None; posted.len()];
    while t.elapsed() < timeout && got.iter().any(|g| g.is_none()) {
        drain(hosts);
        for (i, &(h, slot, token)) in posted.iter().enumerate() {
            if got[i].is_none() {
                got[i] = hosts[h].poll_done(slot, token);
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    got
}

fn signal(set: &SpSet, sp: usize, sig: libc::c_int) {
    let pid = set.sps[sp].child.id() as libc::pid_t;
    // SAFETY: kill with a pid of a child this test started and still holds (not reaped).
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

/// Two nodes of one SP each (2 ranks per node), `max_inflight` copies at once per SP, more
/// `serve` arguments for both (as `SpSet::start_with`, which fixes the copies at 2).
fn start_sps(max_inflight: usize, serve_args: &[&str]) -> SpSet {
    use service_process::launch;
    let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_service-process"));
    let run_dir = launch::new_run_dir().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let spec = launch::SpSetSpec {
        extra_args: serve_args.iter().map(|a| a.to_string()).collect(),
        max_inflight_reads: max_inflight,
        ..sp_set_spec(2, 1, 2, Layout::Block)
    };
    let (path, mut sps) = launch::spawn_sps(&exe, &spec, &run_dir, tx).unwrap();
    launch::wait_ready(&mut sps, &rx, Duration::from_secs(30), None).unwrap();
    SpSet {
        sps,
        cluster: bootstrap::Cluster::load(&path).unwrap(),
        key: bootstrap::auth::ClusterKey::load(&launch::key_path(&path)).unwrap(),
        cluster_path: path,
        run_dir,
        lines: rx,
    }
}

/// The counter `field` of SP `sp`'s stats.
fn stat(stats: &[serde_json::Value], sp: usize, field: &str) -> u64 {
    stats[sp][field]
        .as_u64()
        .unwrap_or_else(|| panic!("no {field} in {}", stats[sp]))
}

#[test]
fn a_stalled_transfer_holds_neither_the_event_loop_nor_the_sp_pair() {
    // One datapath thread for up to 8 copies at once (a setting of hand-started SPs), UCX on,
    // and a peer timeout above the UCX mover's 10 s wait, so that the stall below is a
    // stalled transfer and not a lost peer.
    let mut set = start_sps(
        8,
        &[
            "--ucx=on",
            "--datapath-threads=1",
            "--peer-timeout-ms=30000",
        ],
    );
    let mut hosts = Host::connect_all(&set, new_job(), 4);
    // Warm up: UCX endpoints and slot grants in both directions.
    for (seq, root) in [(0u64, 0u32), (1, 2)] {
        let (bufs, data, posted) = post_bcast(&mut hosts, &set, seq, root, 600_000);
        let got = finish_bcast(&mut hosts, &bufs, &data, &posted, "warm-up");
        assert!(
            got.iter().all(|&g| g == Some(STATUS_OK)),
            "warm-up: {got:?}"
        );
    }
    // Long bcasts from node 0 on 8 communicators at once: SP 0 puts chunk after chunk into SP
    // 1's staging. SP 1 stops while they flow, for longer than the mover waits for a
    // transfer: SP 0's puts stall, and its one datapath thread with them, while SP 0's gate
    // admits 8 copies.
    // Every buffer is filled first, then everything is posted at once.
    let len = 64 << 20;
    let data: Vec<u8> = (0..len).map(|i| (i * 31) as u8).collect();
    let stalled: Vec<Prepared> = (2..10)
        .map(|comm| {
            let mut bufs = vec![data.clone()];
            bufs.extend((1..hosts.len()).map(|_| vec![SENTINEL; len]));
            let descs = (0..hosts.len())
                .map(|r| bcast_desc(&mut hosts, &set, comm, 0, r, 0, &bufs[r]))
                .collect();
            (bufs, data.clone(), descs)
        })
        .collect();
    let stalled: Vec<_> = stalled
        .into_iter()
        .map(|(bufs, data, descs)| (bufs, data, post_all(&mut hosts, descs)))
        .collect();
    std::thread::sleep(Duration::from_millis(30));
    signal(&set, 1, libc::SIGSTOP);
    let stopped = Instant::now();
    let mut beats = vec![0u32; hosts.len()];
    while stopped.elapsed() < Duration::from_secs(12) {
        drain_counting(&mut hosts, &mut beats);
        std::thread::sleep(Duration::from_millis(5));
    }
    signal(&set, 1, libc::SIGCONT);
    // Meanwhile SP 0's loop went on: its ranks (0 and 1, posts outstanding) heard its
    // heartbeat every second (`--heartbeat-ms` 1000), some 12 times.
    eprintln!("heartbeats per rank while SP 1 was stopped: {beats:?}");
    for r in [0, 1] {
        assert!(
            beats[r] >= 6,
            "rank {r} heard {} heartbeats from SP 0 in 12 s: its event loop was held by the \
             stalled transfer",
            beats[r]
        );
    }
    // The stalled bcast ends on every rank (an error where its bytes did not arrive in time),
    // with the right bytes wherever it says Ok.
    for (bufs, data, posted) in &stalled {
        let got = finish_bcast(&mut hosts, bufs, data, posted, "stalled");
        eprintln!("a bcast during the stall: {got:?}");
        assert!(
            got.iter().all(|g| g.is_some()),
            "stalled bcast hangs: {got:?}"
        );
    }
    // The same SPs serve the next collectives, both ways.
    for (seq, root) in [(3u64, 0u32), (4, 3), (5, 1), (6, 2)] {
        let (bufs, data, posted) = post_bcast(&mut hosts, &set, seq, root, 600_000);
        let got = finish_bcast(&mut hosts, &bufs, &data, &posted, "after");
        assert!(
            got.iter().all(|&g| g == Some(STATUS_OK)),
            "bcast {seq} from {root} after the stall: {got:?}"
        );
    }
    let stats = set.stats_after_goodbyes(hosts);
    let (pass, gap) = (
        stat(&stats, 0, "loop_pass_max_us"),
        stat(&stats, 0, "timer_gap_max_ms"),
    );
    eprintln!("SP 0: longest loop pass {pass} us, longest gap between clock checks {gap} ms");
    assert!(pass < 1_000_000, "SP 0's event loop was held {pass} us");
    assert_zero(&stats, &["peers_silent", "instances_at_exit"]);
}

#[test]
fn a_slow_peer_delays_the_mesh_instead_of_failing_it() {
    // SP 0 is held (SIGSTOP) from its start for longer than one handshake may take (5 s):
    // SP 1 connects (SP 0's listener is bound by the launcher, so the connection is queued),
    // says its hello and hears nothing. It must try again until its deadline (30 s), not exit;
    // once SP 0 runs, the mesh forms and serves.
    use service_process::launch;
    let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_service-process"));
    let run_dir = launch::new_run_dir().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let spec = sp_set_spec(2, 1, 2, Layout::Block);
    let (path, listeners) = launch::write_cluster(&spec, &run_dir).unwrap();
    let args = vec![
        "--max-inflight-reads".to_string(),
        spec.max_inflight_reads.to_string(),
    ];
    let mut sps = Vec::new();
    for (i, l) in listeners.into_iter().enumerate() {
        let sp = launch::spawn_sp(&exe, &path, i as u32, l, &args, None, tx.clone()).unwrap();
        if i == 0 {
            // SAFETY: kill with the pid of a child just started and not reaped.
            assert_eq!(
                unsafe { libc::kill(sp.child.id() as i32, libc::SIGSTOP) },
                0
            );
        }
        sps.push(sp);
    }
    std::thread::sleep(Duration::from_secs(8));
    // SAFETY: as above.
    assert_eq!(
        unsafe { libc::kill(sps[0].child.id() as i32, libc::SIGCONT) },
        0
    );
    let ready = launch::wait_ready(&mut sps, &rx, Duration::from_secs(30), None);
    let mut set = SpSet {
        sps,
        cluster: bootstrap::Cluster::load(&path).unwrap(),
        key: bootstrap::auth::ClusterKey::load(&launch::key_path(&path)).unwrap(),
        cluster_path: path,
        run_dir,
        lines: rx,
    };
    if let Err(e) = ready {
        panic!("the mesh did not form after SP 0 was held 8 s: {e:#}");
    }
    let mut hosts = Host::connect_all(&set, new_job(), 4);
    for (seq, root) in [(0u64, 0u32), (1, 3)] {
        let (bufs, data, posted) = post_bcast(&mut hosts, &set, seq, root, 600_000);
        let got = finish_bcast(&mut hosts, &bufs, &data, &posted, "after a slow start");
        assert!(
            got.iter().all(|&g| g == Some(STATUS_OK)),
            "bcast {seq}: {got:?}"
        );
    }
    let stats = set.stats_after_goodbyes(hosts);
    assert_zero(&stats, &["peers_silent", "instances_at_exit"]);
}
