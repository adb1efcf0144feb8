//! The findings of the security review, one test each, with real SP processes and the
//! attacker in a separate process (this test binary run again with `SPOFF_ATTACK` set, see
//! [`attacker_process`]), under a second uid (`nobody`) where the finding needs one. Each test
//! failed on the main branch before the fixes (job ids taken from the client's hello, no uid
//! check, no bounds, no mesh authentication, ...).
#![allow(clippy::needless_range_loop)]

mod common;

#[path = "security/attacker.rs"]
mod attacker;

use algorithms::CommId;
use alias_mkey::Rights;
use attacker::{attack, attack_hello};
use bootstrap::auth::{ClusterKey, JobCredential};
use bootstrap::mailbox::STATUS_OK;
use bootstrap::wire::ErrorCode;
use bootstrap::Layout;
use common::*;
use std::time::{Duration, Instant};
const NOBODY: u32 = 65534;

/// The entry point of the attacker subprocess (not a test of its own: the other tests run it).
#[test]
#[ignore = "the attacker subprocess of the other tests; does nothing on its own"]
fn attacker_process() {
    attacker::run();
}

// ---- helpers of the tests ---------------------------------------------------------------

/// Runs the attacker `mode` as a rank of a new job of `world` ranks of this uid, at SP 0's
/// socket (`SOCK`, `CRED`), with `vars` besides.
fn attack_at_sp0(set: &SpSet, mode: &str, world: u32, vars: &[(&str, String)]) -> Vec<String> {
    let cred = JobCredential::issue(&set.key, new_job(), my_uid(), world).encode();
    let mut all = vec![("SOCK", socket_of(set, 0)), ("CRED", cred)];
    all.extend_from_slice(vars);
    attack(mode, &all, None)
}

// ---- the findings -----------------------------------------------------------------------

/// Findings 1 and 2: a client cannot join another job by naming its id (the job comes from a
/// credential MAC'd with the cluster key), cannot post as another rank of its own job, and a
/// client refused at hello that closes without goodbye does not fail the job it named.
#[test]
fn another_jobs_ranks_cannot_be_joined_impersonated_or_killed() {
    let set = SpSet::start(2, 1, 2, Layout::Block);
    let victim = new_job();
    let mut hosts = Host::connect_all(&set, victim, 4);
    let comm = CommId { leader: 0, id: 1 };
    let sock = socket_of(&set, 0);
    // The victim's job id with a MAC of another key; the victim's id with a MAC of garbage.
    let foreign = JobCredential::issue(&ClusterKey::generate(), victim, my_uid(), 4);
    let garbled = format!("spoffjob1:{victim:016x}:{}:4:{}", my_uid(), "00".repeat(32));
    for cred in [foreign.encode(), garbled] {
        let out = attack_hello(&sock, cred, 1, 4, None);
        assert!(
            out[0].starts_with("REJECT") && out[0].contains("credential"),
            "{out:?}"
        );
    }
    // The victim's own credential for a rank that is connected already.
    let own = JobCredential::issue(&set.key, victim, my_uid(), 4).encode();
    let out = attack_hello(&sock, own, 1, 4, None);
    assert!(out[0].contains("already connected"), "{out:?}");
    // A rank posting as another comm rank of its communicator is refused, without an abort
    // of the collective the real rank will post.
    let members: Vec<u32> = hosts.iter().map(|h| h.sp).collect();
    let buf = vec![0u8; 32];
    let g = hosts[0].grant(&buf, Rights::READ_WRITE);
    let d = desc(
        comm,
        0,
        1,
        members,
        1,
        g.clone(),
        g,
        (
            vec![8; 4],
            vec![0, 8, 16, 24],
            vec![8; 4],
            vec![0, 8, 16, 24],
        ),
    );
    hosts[0].post(d);
    let message = refusal(hosts[0].recv(), ErrorCode::UnknownComm, "a post as rank 1");
    assert!(
        message.contains("this connection is world rank 0"),
        "{message}"
    );
    // The victim job runs as if nothing happened.
    let got = checked_alltoallv(&mut hosts, comm, 0);
    assert_eq!(got, vec![Some(STATUS_OK); 4]);
    let got = checked_alltoallv(&mut hosts, comm, 1);
    assert_eq!(got, vec![Some(STATUS_OK); 4]);
}

/// Finding 3: a post refused with an error, on a connection that is gone by the time the SP
/// answers, must not crash the SP.
#[test]
fn a_refused_post_on_a_connection_that_closed_does_not_crash_the_sp() {
    let set = SpSet::start(1, 1, 1, Layout::Block);
    let out = attack_at_sp0(&set, "bad-post-then-close", 1, &[("TIMES", "200".into())]);
    assert_eq!(out, ["DONE"]);
    std::thread::sleep(Duration::from_millis(200));
    let mut set = set;
    assert!(set.alive(0), "the SP died");
    let s = query(&set, 0);
    assert!(s["errors_sent"].as_u64().unwrap() >= 1, "{s}");
    // And it still serves a job.
    let mut hosts = vec![Host::connect(&set, new_job(), 0, 1)];
    let got = checked_alltoallv(&mut hosts, CommId { leader: 0, id: 1 }, 0);
    assert_eq!(got, vec![Some(STATUS_OK)]);
}

/// Finding 4: a hello with a world of 2^32 - 1 ranks (even with a valid credential) is
/// refused at once and freezes nothing.
#[test]
fn a_huge_world_size_is_refused_at_once() {
    let set = SpSet::start(1, 1, 1, Layout::Block);
    let huge = JobCredential::issue(&set.key, new_job(), my_uid(), u32::MAX).encode();
    let t = Instant::now();
    let out = attack_hello(&socket_of(&set, 0), huge, 0, u32::MAX, None);
    assert!(
        out[0].starts_with("REJECT") && out[0].contains("outside"),
        "{out:?}"
    );
    let s = query(&set, 0);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(s["hellos_refused"], 1, "{s}");
}

/// Finding 5: posts that can never complete are bounded per rank; the SP's memory stays
/// small, and their state goes with the connection.
#[test]
fn posts_that_never_complete_are_bounded() {
    let mut set = SpSet::start_with(2, 1, 1, Layout::Block, &["--max-posts-per-rank=2000"]);
    let pid = set.sps[0].child.id();
    let before = rss_kib(pid);
    let out = attack_at_sp0(
        &set,
        "flood-posts",
        2,
        &[
            ("POSTS", "30000".into()),
            ("SOCK1", socket_of(&set, 1)),
            ("OTHER_SP", "1".into()),
        ],
    );
    let refused: u64 = out[0].strip_prefix("REFUSED ").unwrap().parse().unwrap();
    assert!(refused >= 28_000, "{out:?}");
    let grown = rss_kib(pid).saturating_sub(before);
    assert!(grown < 200 * 1024, "the SP grew by {grown} KiB");
    // The attacker is gone: its job's instances go too.
    std::thread::sleep(Duration::from_millis(500));
    let s = query(&set, 0);
    assert_eq!(s["instances_at_exit"], 0, "{s}");
    assert!(s["posts_refused"].as_u64().unwrap() >= 28_000, "{s}");
    let stats = set.stop_and_stats();
    assert_eq!(stats[0]["jobs_at_exit"], 0);
}

/// Collectives a job opens and never completes are bounded per job as well
/// (`--max-instances-per-job`, checked at every new post from a per-job count): past the limit
/// its posts are refused with an error that names the limit, another job at the same time
/// has its own count, and a job's instances (and its count) go with it, so that a later job
/// again gets the whole limit.
#[test]
fn collectives_a_job_leaves_open_are_bounded() {
    let set = SpSet::start_with(
        2,
        1,
        1,
        Layout::Block,
        &["--max-instances-per-job=300", "--max-posts-per-rank=100000"],
    );
    // Each run a job of its own (what `attack_at_sp0` does, made here: the set stays here).
    let vars = || {
        vec![
            ("SOCK", socket_of(&set, 0)),
            (
                "CRED",
                JobCredential::issue(&set.key, new_job(), my_uid(), 2).encode(),
            ),
            ("POSTS", "2000".to_string()),
            ("SOCK1", socket_of(&set, 1)),
            ("OTHER_SP", "1".into()),
        ]
    };
    let flood = |vars: Vec<(&str, String)>| attack("flood-posts", &vars, None);
    let check = |out: Vec<String>| {
        let refused: u64 = out[0].strip_prefix("REFUSED ").unwrap().parse().unwrap();
        assert_eq!(refused, 1700, "{out:?}");
        assert!(
            out[1].contains("the job has 300 collectives open on SP 0 (limit 300"),
            "{out:?}"
        );
    };
    // Two jobs at once (each holds its 300 until its attacker leaves, half a second after
    // its last post), then a third once both are gone.
    let (va, vb) = (vars(), vars());
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| flood(va));
        let b = s.spawn(|| flood(vb));
        (a.join().unwrap(), b.join().unwrap())
    });
    check(a);
    check(b);
    std::thread::sleep(Duration::from_millis(500));
    check(flood(vars()));
    std::thread::sleep(Duration::from_millis(500));
    let s = query(&set, 0);
    assert_eq!(s["instances_at_exit"], 0, "{s}");
    assert_eq!(s["posts_refused"], 3 * 1700, "{s}");
    let mut set = set;
    let stats = set.stop_and_stats();
    assert_eq!(stats[0]["jobs_at_exit"], 0);
}

/// Finding 6: another user can neither reach the SP's socket (private run directory and
/// socket mode) nor, where the socket is open to all, use a credential issued to another uid;
/// and a registered process that exits while a child keeps its connection is dropped (its pid
/// would name another process once recycled).
#[test]
fn other_users_and_exited_processes_are_refused() {
    assert_eq!(
        my_uid(),
        0,
        "this test switches to uid {NOBODY}: run it as root"
    );
    let set = SpSet::start(1, 1, 1, Layout::Block);
    let job = new_job();
    let for_root = JobCredential::issue(&set.key, job, 0, 1).encode();
    let sock = socket_of(&set, 0);
    let hello = |cred: String| attack_hello(&sock, cred, 0, 1, Some(NOBODY));
    let out = hello(for_root.clone());
    assert!(out[0].starts_with("CONNECT-FAILED"), "{out:?}");
    drop(set);
    // A daemon shared by several users: the socket open to all, the credential decides.
    let set = SpSet::start_with(1, 1, 1, Layout::Block, &["--socket-mode=666"]);
    let sock = socket_of(&set, 0);
    {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::path::Path::new(&sock).parent().unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let hello = |cred: String| attack_hello(&sock, cred, 0, 1, Some(NOBODY));
    let for_root = JobCredential::issue(&set.key, job, 0, 1).encode();
    let out = hello(for_root);
    assert!(
        out[0].contains("for uid 0, but this process runs as uid 65534"),
        "{out:?}"
    );
    let for_nobody = JobCredential::issue(&set.key, job, NOBODY, 1).encode();
    assert_eq!(hello(for_nobody), ["WELCOME"]);
    // The parent registers and exits; its child keeps the socket.
    let out_file = std::env::temp_dir().join(format!("spoff-fork-{}", std::process::id()));
    let out = attack(
        "fork-and-exit",
        &[
            ("SOCK", sock.clone()),
            (
                "CRED",
                JobCredential::issue(&set.key, new_job(), 0, 1).encode(),
            ),
            ("OUT", out_file.display().to_string()),
        ],
        None,
    );
    assert_eq!(out, ["PARENT-EXITS"]);
    let t = Instant::now();
    let verdict = loop {
        if let Ok(v) = std::fs::read_to_string(&out_file) {
            break v;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the child never reported"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = std::fs::remove_file(&out_file);
    assert_eq!(
        verdict, "CLOSED",
        "the SP kept serving a connection whose process exited"
    );
}

/// Finding 7: a process that read the cluster description cannot join the SP mesh as an SP,
/// and does not keep the real SP from joining.
#[test]
fn an_impostor_cannot_join_the_sp_mesh() {
    let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_service-process"));
    let run_dir = service_process::launch::new_run_dir().unwrap();
    let spec = sp_set_spec(2, 1, 1, Layout::Block);
    let (path, mut listeners) = service_process::launch::write_cluster(&spec, &run_dir).unwrap();
    let cluster = bootstrap::Cluster::load(&path).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let l1 = listeners.pop().unwrap();
    let l0 = listeners.pop().unwrap();
    let sp0 = service_process::launch::spawn_sp(&exe, &path, 0, l0, &[], None, tx.clone()).unwrap();
    // SP 0 accepts SP 1; the impostor gets there first.
    let out = attack(
        "impostor-sp",
        &[
            ("ADDR", cluster.sp(0).unwrap().peer_addr.to_string()),
            ("AS_SP", "1".into()),
            ("FINGERPRINT", cluster.fingerprint().to_string()),
        ],
        None,
    );
    assert!(
        out[0].starts_with("REJECT") && out[0].contains("did not prove"),
        "{out:?}"
    );
    let sp1 = service_process::launch::spawn_sp(&exe, &path, 1, l1, &[], None, tx).unwrap();
    let mut sps = vec![sp0, sp1];
    let ready = service_process::launch::wait_ready(&mut sps, &rx, WAIT, None);
    service_process::launch::stop_sps(&mut sps, Duration::from_secs(3));
    let _ = std::fs::remove_dir_all(&run_dir);
    assert!(matches!(ready, Ok(true)), "{ready:?}");
}

/// Finding 8: leftovers and disclosure. Stale segments of the cluster go when its SPs start;
/// counters need the key; client-caused log lines are bounded; a connection without a hello
/// is closed after the timeout and beyond a cap; UCX listens on the SP network only.
#[test]
fn leftovers_disclosure_logs_and_idle_connections_are_bounded() {
    // A segment left by a killed SP of this cluster, before its SPs start.
    let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_service-process"));
    let run_dir = service_process::launch::new_run_dir().unwrap();
    let key_file = run_dir.join("cluster.key");
    let key = ClusterKey::create(&key_file).unwrap();
    let stale = std::path::Path::new("/dev/shm").join(format!(
        "{}stale",
        &service_process::access::segment_prefix(&key)[1..]
    ));
    std::fs::write(&stale, b"left behind").unwrap();
    let spec = sp_set_spec(1, 1, 1, Layout::Block);
    let (path, mut listeners) = service_process::launch::write_cluster(&spec, &run_dir).unwrap();
    let log = run_dir.join("sp-0.log");
    let (tx, rx) = std::sync::mpsc::channel();
    let mut sps = vec![service_process::launch::spawn_sp(
        &exe,
        &path,
        0,
        listeners.pop().unwrap(),
        &["--hello-timeout-ms=300".into()],
        Some(std::fs::File::create(&log).unwrap()),
        tx,
    )
    .unwrap()];
    assert!(matches!(
        service_process::launch::wait_ready(&mut sps, &rx, WAIT, None),
        Ok(true)
    ));
    assert!(
        !stale.exists(),
        "a stale segment of the cluster survived the SP's start"
    );
    let cluster = bootstrap::Cluster::load(&path).unwrap();
    let sock = cluster.sp(0).unwrap().host_socket.display().to_string();
    // Counters only for the key's holders.
    let out = attack("stats-without-key", &[("SOCK", sock.clone())], None);
    assert!(out[0].starts_with("REJECT"), "{out:?}");
    let stats = service_process::stats::query_within(cluster.sp(0).unwrap(), &key, WAIT).unwrap();
    assert_eq!(stats["hellos_refused"], 1);
    // Log flood: 20000 bad frames and 500 bad hellos make a bounded number of lines.
    let cred = JobCredential::issue(&key, 5, my_uid(), 1).encode();
    let out = attack(
        "log-flood",
        &[
            ("SOCK", sock.clone()),
            ("CRED", cred),
            ("FRAMES", "20000".into()),
            ("HELLOS", "500".into()),
        ],
        None,
    );
    assert_eq!(out, ["DONE"]);
    // A silent connection is closed after the hello timeout (300 ms here).
    let out = attack("silent", &[("SOCK", sock.clone())], None);
    let ms: u64 = out[0]
        .strip_prefix("CLOSED-AFTER-MS ")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{out:?}"));
    assert!((250..3000).contains(&ms), "closed after {ms} ms");
    // More silent connections than the cap (256): the extra ones are dropped at once.
    let out = attack(
        "many-silent",
        &[("SOCK", sock.clone()), ("CONNS", "320".into())],
        None,
    );
    let closed: u64 = out[0].strip_prefix("CLOSED ").unwrap().parse().unwrap();
    assert!(closed >= 60, "{out:?}");
    // UCX listens on loopback only (the SP network here), not on every interface.
    let pid = sps[0].child.id();
    let addrs = listening_addrs(pid);
    assert!(!addrs.is_empty());
    assert!(
        addrs.iter().all(|a| a.is_loopback()),
        "SP listens on {addrs:?}"
    );
    service_process::launch::stop_sps(&mut sps, Duration::from_secs(3));
    let text = std::fs::read_to_string(&log).unwrap();
    let lines = text.lines().count();
    let _ = std::fs::remove_dir_all(&run_dir);
    assert!(
        lines < 200,
        "{lines} log lines:\n{}",
        &text[..text.len().min(4000)]
    );
}

/// The addresses of the TCP sockets process `pid` listens on (from /proc).
fn listening_addrs(pid: u32) -> Vec<std::net::IpAddr> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| {
            l.to_string_lossy()
                .strip_prefix("socket:[")
                .and_then(|r| r.strip_suffix(']'))
                .map(String::from)
        })
        .collect();
    let mut out = vec![];
    for (file, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        for l in text.lines().skip(1) {
            let f: Vec<&str> = l.split_whitespace().collect();
            // local_address, st (0A = LISTEN), ..., inode (field 9).
            if f.len() < 10 || f[3] != "0A" || !inodes.contains(f[9]) {
                continue;
            }
            let hex = f[1].split(':').next().unwrap();
            let ip = if v6 {
                let mut b = [0u8; 16];
                for i in 0..4 {
                    let w = u32::from_str_radix(&hex[8 * i..8 * i + 8], 16).unwrap();
                    b[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
                }
                std::net::IpAddr::from(b)
            } else {
                let w = u32::from_str_radix(hex, 16).unwrap();
                std::net::IpAddr::from(w.to_le_bytes())
            };
            out.push(ip);
        }
    }
    out
}

/// One polling root SP whose host socket (and its directory) any user may reach
/// (`--socket-mode=666`): the set, and the socket's path.
fn shared_polling_root_sp() -> (SpSet, String) {
    let set = SpSet::start_with(
        1,
        1,
        1,
        Layout::Block,
        &["--socket-mode=666", "--poll-us", "20"],
    );
    let sock = socket_of(&set, 0);
    use std::os::unix::fs::PermissionsExt;
    let dir = std::path::Path::new(&sock).parent().unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    (set, sock)
}

/// The post ring for another user's rank at a shared root SP (`--socket-mode=666`, polling):
/// the rank (uid nobody) passes its memfd, its post goes through the ring, the SP copies its
/// bytes as that user and writes the completion into the mailbox inside the ring; a rank of
/// another user is served as one of the SP's own.
#[test]
fn another_users_rank_posts_through_its_ring_at_a_root_sp() {
    assert_eq!(
        my_uid(),
        0,
        "this test switches to uid {NOBODY}: run it as root"
    );
    let (mut set, sock) = shared_polling_root_sp();
    let seed = test_seed();
    let cred = JobCredential::issue(&set.key, new_job(), NOBODY, 1).encode();
    let out = attack(
        "ring-post",
        &[("SOCK", sock), ("CRED", cred), ("SEED", seed.to_string())],
        Some(NOBODY),
    );
    assert_eq!(out, ["RING-DONE status 0 same true"], "{out:?}");
    let stats = set.stop_and_stats();
    assert_eq!(stats[0]["ring_posts"], 1, "{}", stats[0]);
    assert_eq!(stats[0]["ring_completions"], 1, "{}", stats[0]);
    assert_eq!(stats[0]["copies_failed"], 0, "{}", stats[0]);
}

/// Another user's rank at a shared root SP says its post ring is mapped where it has nothing
/// (`rank_base`): its grant inside that claimed arena is served from its own memfd (the bytes
/// it wrote there, through the SP's mapping of it) and written into its buffer as that user,
/// and a grant straddling the claimed arena's start stays an ordinary grant of memory the rank
/// does not have: the copy fails and the rank is told. Nothing else is reached either way.
#[test]
fn a_rank_that_lies_about_where_its_arena_is_reaches_only_its_own_memfd() {
    assert_eq!(
        my_uid(),
        0,
        "this test switches to uid {NOBODY}: run it as root"
    );
    let (mut set, sock) = shared_polling_root_sp();
    let seed = test_seed() | 1;
    let cred = JobCredential::issue(&set.key, new_job(), NOBODY, 1).encode();
    let out = attack(
        "arena-lie",
        &[("SOCK", sock), ("CRED", cred), ("SEED", seed.to_string())],
        Some(NOBODY),
    );
    assert_eq!(out.len(), 1, "{out:?}");
    let (first, second) = out[0].split_once("; ").expect("two posts");
    assert_eq!(first, "post 0 status 0 got its-memfd", "{out:?}");
    assert!(
        second.starts_with("post 1 status ") && second.ends_with(" got nothing"),
        "{out:?}"
    );
    assert_ne!(second, "post 1 status 0 got nothing", "{out:?}");
    let stats = set.stop_and_stats();
    assert_eq!(stats[0]["arena_sides"], 1, "{}", stats[0]);
    assert_eq!(stats[0]["copies_failed"], 1, "{}", stats[0]);
}
