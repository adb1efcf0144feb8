//! Issue 24, items 5 and 6: clients that never authenticate must not starve those that do.
//! Real SP processes; the attacker is a separate process (this test binary run again, see
//! [`attacker_process`]) under uid `nobody`, holding its connections while the test's
//! legitimate clients say hello.
//!
//! - Idle connections without a hello, more than the SP keeps, over TCP and on the Unix
//!   socket: every legitimate hello is still answered at once.
//! - Connections that send most of a large frame before any hello: the SP's memory stays
//!   bounded, and legitimate hellos still pass.
//! - Silent connections to the peer listeners while the SPs start: the mesh forms anyway,
//!   within its normal time.

mod common;
mod tcp;

#[path = "security/attacker.rs"]
#[allow(dead_code)]
mod attacker;

use attacker::{attack_spawn, Running};
use bootstrap::auth::JobCredential;
use bootstrap::wire::{Channel, Hello, HostHello};
use common::{new_job, procfs};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tcp::TcpSps;

const NOBODY: u32 = 65534;

/// The entry point of the attacker subprocess (not a test of its own: the other tests run it).
#[test]
#[ignore = "the attacker subprocess of the other tests; does nothing on its own"]
fn attacker_process() {
    attacker::run();
}

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_service-process"))
}

fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

fn need_root() {
    assert_eq!(
        uid(),
        0,
        "this test runs its attacker as uid {NOBODY}: run it as root"
    );
}

/// One SP (1 node, 1 SP) with a host TCP address, its Unix socket open to every user (as a
/// site daemon's), its run directory searchable by `nobody`.
fn shared_sp(args: &[&str]) -> TcpSps {
    use std::os::unix::fs::PermissionsExt;
    let mut sps = TcpSps::describe(&exe(), 1, 1, 16);
    let mut all = vec!["--socket-mode=666"];
    all.extend_from_slice(args);
    sps.start_all(&all);
    std::fs::set_permissions(&sps.run_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    sps
}

fn unix_target(sps: &TcpSps) -> String {
    format!("unix:{}", sps.cluster.sps[0].host_socket.display())
}

fn tcp_target(sps: &TcpSps) -> String {
    format!("tcp:{}", sps.host_addr(0))
}

/// A stream the legitimate clients use, Unix or TCP alike.
trait Stream: Read + Write {}
impl<T: Read + Write> Stream for T {}

/// A legitimate rank of job `job` (`size` ranks) says hello as `rank` of node 0 at `target`;
/// the answer (or why none came within 5 s) and how long it took. The connection stays open
/// (a duplicate of it is kept in `keep`).
fn legit_hello(
    sps: &TcpSps,
    target: &str,
    job: u64,
    rank: u32,
    size: u32,
    keep: &mut Vec<Box<dyn std::any::Any>>,
) -> (Result<Hello, String>, Duration) {
    let t = Instant::now();
    let answer = send_legit_hello(sps, target, job, rank, size, keep)
        .and_then(|mut ch| ch.recv_hello().map_err(|e| e.to_string()));
    (answer, t.elapsed())
}

/// The first half of [`legit_hello`]: connected, and the hello sent; the answer is left to
/// be read from the channel.
fn send_legit_hello(
    sps: &TcpSps,
    target: &str,
    job: u64,
    rank: u32,
    size: u32,
    keep: &mut Vec<Box<dyn std::any::Any>>,
) -> Result<Channel<Box<dyn Stream>>, String> {
    let s: Box<dyn Stream> = if let Some(p) = target.strip_prefix("unix:") {
        let s = std::os::unix::net::UnixStream::connect(p).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        keep.push(Box::new(s.try_clone().unwrap()));
        Box::new(s)
    } else {
        let s = std::net::TcpStream::connect(target.strip_prefix("tcp:").unwrap()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        keep.push(Box::new(s.try_clone().unwrap()));
        Box::new(s)
    };
    let mut ch = Channel::new(s);
    let credential = JobCredential::issue(&sps.key, job, uid(), size).encode();
    ch.send_hello(&Hello::Host(HostHello {
        credential,
        world_rank: rank,
        world_size: size,
        node: 0,
        local_rank: rank,
        pid: std::process::id(),
    }))
    .map_err(|e| format!("send: {e}"))?;
    Ok(ch)
}

/// Starts the `flood` attacker as `nobody` with `vars`; returns it once it said `READY`, and
/// how many connections it opened.
fn flood(vars: &[(&str, String)]) -> (Running, usize) {
    let a = attack_spawn("flood", vars, Some(NOBODY));
    let line = a
        .line(Duration::from_secs(60))
        .expect("the attacker opened its connections");
    let n = line
        .strip_prefix("READY ")
        .unwrap_or_else(|| panic!("attacker: {line}"))
        .parse()
        .unwrap();
    (a, n)
}

/// `n` legitimate ranks of a new job say hello at `target` while the attacker holds its
/// connections; each must be welcomed, within `within`. `Err`: what went wrong (printed).
fn all_welcomed(
    sps: &TcpSps,
    target: &str,
    n: u32,
    within: Duration,
    what: &str,
) -> Result<(), String> {
    let job = new_job();
    let mut keep = vec![];
    let mut report = vec![];
    let mut welcomed = 0;
    for r in 0..n {
        let (answer, took) = legit_hello(sps, target, job, r, n, &mut keep);
        let ok = matches!(answer, Ok(Hello::Welcome { sp: 0 })) && took < within;
        welcomed += ok as u32;
        report.push(format!("rank {r}: {answer:?} in {} ms", took.as_millis()));
        std::thread::sleep(Duration::from_millis(50));
    }
    let summary = format!(
        "{what}: {welcomed} of {n} legitimate hellos welcomed within {within:?}\n  {}",
        report.join("\n  ")
    );
    eprintln!("{summary}");
    if welcomed == n {
        Ok(())
    } else {
        Err(summary)
    }
}

/// Item 5: 300 idle connections without a credential (the attacker reopens each one the SP
/// closes) over TCP, then on the Unix socket: every legitimate hello is still welcomed, each
/// within a second.
#[test]
fn idle_connections_without_a_hello_do_not_starve_legitimate_hellos() {
    need_root();
    let mut sps = shared_sp(&[]);
    let mut failed = vec![];
    for (target, n) in [(tcp_target(&sps), 8), (unix_target(&sps), 10)] {
        let (attacker, opened) = flood(&[
            ("TARGETS", target.clone()),
            ("CONNS", "300".into()),
            ("REFILL", "1".into()),
            ("HOLD_MS", "3000".into()),
        ]);
        assert!(opened >= 256, "the attacker opened only {opened}");
        // Let the SP take them all in.
        std::thread::sleep(Duration::from_millis(300));
        failed.extend(all_welcomed(&sps, &target, n, Duration::from_secs(1), &target).err());
        let _ = attacker.finish();
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    let stats = sps.stop_and_stats();
    eprintln!(
        "hellos_evicted {} hosts_refused {} hellos_timed_out {}",
        stats[0]["hellos_evicted"], stats[0]["hosts_refused"], stats[0]["hellos_timed_out"]
    );
    assert!(
        stats[0]["hellos_evicted"].as_u64().unwrap_or(0) > 0,
        "evictions are counted: {}",
        stats[0]
    );
}

/// Item 5, the order behind it: a hello that is already waiting when a burst of connections
/// without one arrives is read before the burst can evict its connection. The SP is stopped
/// (SIGSTOP) with its 256 places for connections without a hello full (idle TCP connections
/// from the same address as the rank's); a rank connects and sends its hello; 300 more idle
/// connections queue behind it; the SP resumes and must welcome the rank. (The SP used to
/// accept the whole queue in one go, closing the oldest waiting connection for each: after
/// 256 of them, the rank's.)
#[test]
fn a_hello_already_sent_is_not_evicted_by_the_connections_queued_behind_it() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    need_root();
    let mut sps = shared_sp(&[]);
    let addr = sps.host_addr(0);
    // Each connection completes in the kernel's backlog while the SP is stopped (the SP asks
    // for a deep one: the standard library's 128 would hold back the queue).
    let idle = |n| -> Vec<std::net::TcpStream> {
        (0..n)
            .map(|i| {
                std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))
                    .unwrap_or_else(|e| panic!("idle connection {i}: {e}"))
            })
            .collect()
    };
    let first = idle(256);
    // Let the SP take them in: its places are full before it stops.
    std::thread::sleep(Duration::from_millis(300));
    let sp = Pid::from_raw(sps.sps[0].child.id() as i32);
    kill(sp, Signal::SIGSTOP).unwrap();
    let (job, mut keep) = (new_job(), vec![]);
    let sent = send_legit_hello(&sps, &tcp_target(&sps), job, 0, 1, &mut keep);
    let queued = idle(300);
    kill(sp, Signal::SIGCONT).unwrap();
    let answer = sent.and_then(|mut ch| ch.recv_hello().map_err(|e| e.to_string()));
    // Let the SP take the rest of the queue, evicting as it goes, before its counters are read.
    std::thread::sleep(Duration::from_millis(300));
    drop((first, queued, keep));
    let stats = sps.stop_and_stats();
    eprintln!(
        "answer {answer:?}; hellos_evicted {} hosts_refused {}",
        stats[0]["hellos_evicted"], stats[0]["hosts_refused"]
    );
    assert_eq!(answer, Ok(Hello::Welcome { sp: 0 }));
    assert!(
        stats[0]["hellos_evicted"].as_u64().unwrap_or(0) >= 256,
        "the burst evicts the 256 connections that waited before it (and would have \
         evicted the rank's, were its hello not read first): {}",
        stats[0]
    );
}

/// Item 5: 256 connections (half over TCP, half on the Unix socket) each send the length of
/// a 4 MiB frame and 1 MiB of it, and 256 more the length of a 60 KiB frame and 59 KiB of it,
/// before any hello: the SP's resident memory grows by less than 64 MiB (it grew by about
/// 1 GiB for 256 such 4 MiB frames), and legitimate hellos are still welcomed.
#[test]
fn partial_frames_before_a_hello_are_bounded() {
    need_root();
    let mut sps = shared_sp(&[]);
    let pid = sps.sps[0].child.id();
    let before = procfs::rss_kib(pid).unwrap();
    let both = format!("{},{}", tcp_target(&sps), unix_target(&sps));
    let mut attackers = vec![];
    for (header, send) in [((4u64 << 20) - 1, 1u64 << 20), (60 << 10, 59 << 10)] {
        let (a, opened) = flood(&[
            ("TARGETS", both.clone()),
            ("CONNS", "128".into()),
            ("HEADER", header.to_string()),
            ("SEND", send.to_string()),
            ("HOLD_MS", "8000".into()),
        ]);
        assert_eq!(opened, 256, "the attacker opened only {opened}");
        attackers.push(a);
    }
    // Let the SP read what it will.
    std::thread::sleep(Duration::from_millis(500));
    let during = procfs::rss_kib(pid).unwrap();
    let second = Duration::from_secs(1);
    let welcomed = [
        all_welcomed(&sps, &tcp_target(&sps), 4, second, "tcp"),
        all_welcomed(&sps, &unix_target(&sps), 4, second, "unix"),
    ];
    let after = procfs::rss_kib(pid).unwrap();
    let grew = during.max(after).saturating_sub(before);
    eprintln!(
        "SP RSS: {before} KiB before, {during} KiB under the flood, {after} KiB after the \
         hellos: +{grew} KiB"
    );
    assert!(
        grew < 64 << 10,
        "the SP grew by {grew} KiB for connections that never said hello"
    );
    for w in welcomed {
        w.unwrap();
    }
    drop(attackers);
    let stats = sps.stop_and_stats();
    eprintln!("hosts_refused {}", stats[0]["hosts_refused"]);
}

/// Item 6: silent connections (uid `nobody`) to the peer listeners of 3 SPs, opened before
/// the SPs start and more of them every 100 ms while they start: the mesh forms anyway, in
/// less than the 5 s a would-be peer is given to finish its handshake.
#[test]
fn silent_connections_to_the_peer_listeners_do_not_stop_the_mesh() {
    need_root();
    let mut sps = TcpSps::describe(&exe(), 3, 1, 1);
    let targets: Vec<String> = sps
        .cluster
        .sps
        .iter()
        .map(|e| format!("tcp:{}", e.peer_addr))
        .collect();
    let (attacker, opened) = flood(&[
        ("TARGETS", targets.join(",")),
        ("CONNS", "4".into()),
        ("GROW", "1".into()),
        ("HOLD_MS", "12000".into()),
    ]);
    assert_eq!(opened, 12);
    let t = Instant::now();
    for id in 0..3 {
        sps.start(id, &[]);
    }
    let ready = service_process::launch::wait_ready(
        &mut sps.sps,
        &sps.lines,
        Duration::from_secs(20),
        None,
    );
    let took = t.elapsed();
    eprintln!("mesh: {ready:?} after {} ms", took.as_millis());
    drop(attacker);
    assert!(
        ready.as_ref().is_ok_and(|r| *r),
        "the mesh did not form: {ready:?}"
    );
    assert!(
        took < Duration::from_secs(4),
        "the mesh formed only after {took:?}"
    );
    // The SPs serve: a rank is welcomed.
    let job = new_job();
    let mut keep = vec![];
    let (answer, _) = legit_hello(&sps, &tcp_target(&sps), job, 0, 3, &mut keep);
    assert_eq!(answer, Ok(Hello::Welcome { sp: 0 }));
}
