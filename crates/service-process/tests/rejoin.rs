//! An SP that restarts (or starts late) rejoins the running mesh: nobody else restarts, the
//! collectives that were in flight on it fail with an error, later jobs use it again, and a
//! job on other SPs never notices (issue 25). Real SP processes, killed with SIGKILL (a DPU
//! that reboots says nothing) and started again on the same address.

mod common;

use algorithms::CommId;
use alias_mkey::Rights;
use bootstrap::mailbox;
use bootstrap::{Layout, Placement};
use common::*;
use service_process::launch;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Heartbeats fast enough for a test; the restarted SP's peers see its old connection close
/// at once anyway (a killed process's sockets are closed by its kernel).
const SERVE_ARGS: [&str; 4] = ["--heartbeat-ms", "200", "--peer-timeout-ms", "2000"];

/// Two nodes of two SPs, one rank per SP for a 4-rank job (rank r at SP r).
fn start() -> SpSet {
    SpSet::start_with(2, 2, 2, Layout::Block, &SERVE_ARGS)
}

/// Starts SP `sp` of `set` again, on its address of the description, with `extra` more
/// `serve` arguments; returns its stdout lines (call [`await_ready`]).
fn respawn(set: &mut SpSet, sp: u32, extra: &[&str]) -> mpsc::Receiver<(u32, String)> {
    assert!(!set.alive(sp), "SP {sp} is still running");
    let addr = set.cluster.sp(sp).unwrap().peer_addr;
    let listener = bind_again(addr);
    let mut args: Vec<String> = SERVE_ARGS.iter().map(|a| a.to_string()).collect();
    args.extend(extra.iter().map(|a| a.to_string()));
    args.extend(["--max-inflight-reads".into(), "2".into()]);
    let (tx, rx) = mpsc::channel();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_service-process"));
    let new = launch::spawn_sp(&exe, &set.cluster_path, sp, listener, &args, None, tx).unwrap();
    drop(std::mem::replace(&mut set.sps[sp as usize], new));
    remap(rx, sp)
}

/// Binds a stopped SP's address again. `make test` once failed here with `AddrInUse`: the
/// launcher then took the description's ports from the kernel's ephemeral range, where any
/// bind to port 0 or outgoing connection of the tests running alongside (their SPs' UCX
/// listeners and connections) could be given the port while the SP was down. The launcher
/// now binds below that range (`launch::loopback_listener`), where only another explicit bind
/// of the same port can take it. Should that happen, the holder is named (`ss`) and waited
/// for, up to 10 s; past it the test fails, saying so.
fn bind_again(addr: std::net::SocketAddr) -> std::net::TcpListener {
    let t = Instant::now();
    let mut said = false;
    loop {
        match std::net::TcpListener::bind(addr) {
            Ok(l) => return l,
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && t.elapsed() < Duration::from_secs(10) =>
            {
                if !said {
                    said = true;
                    let holder = std::process::Command::new("ss")
                        .args(["-tanp", &format!("sport = :{}", addr.port())])
                        .output()
                        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                        .unwrap_or_else(|e| format!("(ss: {e})"));
                    eprintln!("{addr} was taken while its SP was down ({e}); waiting:\n{holder}");
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!(
                "binding {addr} again for its SP: {e} (after {:?})",
                t.elapsed()
            ),
        }
    }
}

/// Waits until the restarted SP `sp` is ready: it connected to every other SP that runs, or
/// waited `--connect-timeout-secs` for those that do not.
fn await_ready(set: &mut SpSet, sp: u32, lines: mpsc::Receiver<(u32, String)>, within: Duration) {
    let t = Instant::now();
    let one = std::slice::from_mut(&mut set.sps[sp as usize]);
    launch::wait_ready(one, &lines, within, None).unwrap();
    eprintln!("SP {sp} ready again after {:?}", t.elapsed());
}

fn restart(set: &mut SpSet, sp: u32, extra: &[&str], within: Duration) {
    let lines = respawn(set, sp, extra);
    await_ready(set, sp, lines, within);
}

/// `wait_ready` of one SP indexes its lines by position: SP `sp` becomes 0.
fn remap(rx: mpsc::Receiver<(u32, String)>, sp: u32) -> mpsc::Receiver<(u32, String)> {
    let (tx, out) = mpsc::channel();
    std::thread::spawn(move || {
        for (id, line) in rx {
            assert_eq!(id, sp);
            if tx.send((0, line)).is_err() {
                return;
            }
        }
    });
    out
}

/// Waits until every SP of `sps` counts `n` peers joined (its stats answer), bounded.
fn await_joined(set: &SpSet, sps: &[u32], n: u64) {
    let t = Instant::now();
    for &sp in sps {
        loop {
            let s = query(set, sp);
            let joined = s["peers_joined"]
                .as_u64()
                .expect("peers_joined in the stats");
            if joined >= n {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "SP {sp} counts {joined} peers joined, not {n}, 10 s after the restart"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A 2-rank job on the SPs of node `node` (its ranks at SPs 2·node and 2·node+1).
fn job_on_node(set: &SpSet, node: u32) -> Vec<Host> {
    let job = new_job();
    (0..2)
        .map(|i| {
            let p = Placement {
                node,
                local_rank: i,
                sp: 2 * node + i,
            };
            Host::connect_placed(set, job, i, 2, p)
        })
        .collect()
}

fn comm(id: u32) -> CommId {
    CommId { leader: 0, id }
}

/// Posts an alltoallv of `members` (comm rank i at SP members[i]) from the hosts in `posting`
/// (indices into `hosts`, which are comm ranks) only; returns what each posted.
fn post_partial(
    hosts: &mut [Host],
    members: &[u32],
    posting: &[usize],
    c: CommId,
    seq: u64,
    bufs: &mut Vec<Vec<u8>>,
) -> Vec<(usize, u32, u64)> {
    let p = members.len();
    let mut posted = vec![];
    for &r in posting {
        bufs.push(vec![r as u8; 8 * p]);
        let send = hosts[r].grant(bufs.last().unwrap(), Rights::READ);
        bufs.push(vec![0; 8 * p]);
        let recv = hosts[r].grant(bufs.last().unwrap(), Rights::WRITE);
        let counts = vec![8u64; p];
        let displs: Vec<u64> = (0..p as u64).map(|i| 8 * i).collect();
        let d = desc(
            c,
            seq,
            r as u32,
            members.to_vec(),
            (seq % 8) as u32,
            send,
            recv,
            (counts.clone(), displs.clone(), counts, displs),
        );
        let (slot, token) = hosts[r].post(d);
        posted.push((r, slot, token));
    }
    posted
}

/// Runs one checked alltoallv of job `hosts` and asserts that every rank completed it.
fn assert_alltoallv_ok(hosts: &mut [Host], c: CommId, seq: u64, what: &str) {
    let got = checked_alltoallv(hosts, c, seq);
    assert!(
        got.iter().all(|g| *g == Some(mailbox::STATUS_OK)),
        "{what}: statuses {got:?}"
    );
}

#[test]
fn a_killed_sp_rejoins_in_flight_collectives_fail_and_later_jobs_use_it() {
    let mut rng = Rng(test_seed());
    let mut set = start();
    let victim = rng.below(4) as u32;
    let others: Vec<u32> = (0..4).filter(|s| *s != victim).collect();
    eprintln!("victim: SP {victim}");
    // Job A on every SP; job B on the node without the victim.
    let mut a = Host::connect_all(&set, new_job(), 4);
    let other_node = 1 - victim / 2;
    let mut b = job_on_node(&set, other_node);
    assert_alltoallv_ok(&mut a, comm(1), 0, "job A before the kill");
    assert_alltoallv_ok(&mut b, comm(1), 0, "job B before the kill");

    // A collective of job A in flight when the victim dies: its other ranks posted, the
    // victim's did not.
    let members: Vec<u32> = (0..4).collect();
    let posting: Vec<usize> = others.iter().map(|&s| s as usize).collect();
    let mut bufs = vec![];
    let in_flight = post_partial(&mut a, &members, &posting, comm(1), 1, &mut bufs);
    std::thread::sleep(Duration::from_millis(50));
    set.kill(victim);
    let t = Instant::now();
    let got = wait_all_serving(&mut a, &in_flight, WAIT);
    for (i, g) in got.iter().enumerate() {
        assert!(
            g.is_some_and(|s| s != mailbox::STATUS_OK),
            "rank {} of job A: the collective in flight on the killed SP ended with {g:?}",
            in_flight[i].0
        );
    }
    eprintln!(
        "in-flight collective failed {:?} after the kill",
        t.elapsed()
    );
    assert_alltoallv_ok(&mut b, comm(1), 1, "job B while the SP is down");

    restart(&mut set, victim, &[], Duration::from_secs(20));
    // Every running SP took it back; the restarted one counts none (it formed its mesh).
    await_joined(&set, &others, 1);
    assert_eq!(query(&set, victim)["peers_joined"].as_u64(), Some(0));
    for s in 0..2 {
        assert_alltoallv_ok(&mut b, comm(1), 2 + s, "job B after the restart");
    }

    // Job A lost the SP: its later collectives that need it fail, with an error, at once.
    let posted = post_partial(&mut a, &members, &posting, comm(1), 2, &mut bufs);
    let got = wait_all_serving(&mut a, &posted, WAIT);
    assert!(
        got.iter()
            .all(|g| g.is_some_and(|s| s != mailbox::STATUS_OK)),
        "job A's collective after the restart: {got:?}"
    );

    // A new job uses the restarted SP again, and more than once.
    let mut c = Host::connect_all(&set, new_job(), 4);
    for seq in 0..3 {
        assert_alltoallv_ok(&mut c, comm(1), seq, "a new job after the restart");
    }
    let s = query(&set, victim);
    assert!(s["collectives_finished"].as_u64().unwrap() >= 3, "{s}");
    // Job B never saw an error.
    for (i, h) in b.iter().enumerate() {
        assert_eq!(h.sp, 2 * other_node + i as u32);
    }
    for sp in &others {
        assert_eq!(
            query(&set, *sp)["peers_silent"].as_u64(),
            Some(0),
            "SP {sp}"
        );
    }
}

#[test]
fn several_sps_restart_one_late_the_rest_go_on_and_all_rejoin() {
    let mut rng = Rng(test_seed());
    let mut set = start();
    // Two victims, one of each node.
    let v0 = rng.below(2) as u32;
    let v1 = 2 + rng.below(2) as u32;
    eprintln!("victims: SPs {v0} and {v1}");
    let survivors: Vec<u32> = (0..4).filter(|s| *s != v0 && *s != v1).collect();
    set.kill(v0);
    set.kill(v1);
    // The first comes back while the second is still down: it serves without it after its
    // start-up wait instead of failing.
    restart(
        &mut set,
        v0,
        &["--connect-timeout-secs", "2"],
        Duration::from_secs(20),
    );
    await_joined(&set, &survivors, 1);
    // Both survivors and the first victim take the second back.
    restart(&mut set, v1, &[], Duration::from_secs(20));
    await_joined(&set, &survivors, 2);
    await_joined(&set, &[v0], 1);
    let mut job = Host::connect_all(&set, new_job(), 4);
    for seq in 0..3 {
        assert_alltoallv_ok(&mut job, comm(1), seq, "a job across all four SPs");
    }
    // Killed and restarted again, both at once.
    set.kill(v0);
    set.kill(v1);
    drop(job);
    let l1 = respawn(&mut set, v1, &[]);
    let l0 = respawn(&mut set, v0, &[]);
    await_ready(&mut set, v1, l1, Duration::from_secs(20));
    await_ready(&mut set, v0, l0, Duration::from_secs(20));
    await_joined(&set, &survivors, 4);
    let mut job = Host::connect_all(&set, new_job(), 4);
    for seq in 0..3 {
        assert_alltoallv_ok(&mut job, comm(1), seq, "a job after both restarted at once");
    }
}

#[test]
fn an_sp_stopped_in_order_and_started_again_is_taken_back_once_by_each_peer() {
    let mut rng = Rng(test_seed());
    let mut set = start();
    let victim = rng.below(4) as u32;
    let others: Vec<u32> = (0..4).filter(|s| *s != victim).collect();
    eprintln!("victim: SP {victim}");
    // SIGTERM: the SP says goodbye to its peers and exits; they try to reach it again.
    let pid = set.sps[victim as usize].child.id() as i32;
    // SAFETY: kill(2) with a pid of our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let _ = set.sps[victim as usize].child.wait();
    // Let the peers retry a few times while it is down.
    std::thread::sleep(Duration::from_millis(800));
    restart(&mut set, victim, &[], Duration::from_secs(20));
    await_joined(&set, &others, 1);
    // Long enough for any further (spurious) join to show.
    std::thread::sleep(Duration::from_millis(1500));
    for sp in &others {
        let s = query(&set, *sp);
        assert_eq!(
            s["peers_joined"].as_u64(),
            Some(1),
            "SP {sp} counts {} joins for one restart of SP {victim}",
            s["peers_joined"]
        );
    }
    let mut job = Host::connect_all(&set, new_job(), 4);
    assert_alltoallv_ok(&mut job, comm(1), 0, "a job after the orderly restart");
}
