//! The findings of the security review, one test each, with real SP processes and the
//! attacker in a separate process (this test binary run again with `SPOFF_ATTACK` set, see
//! [`attacker_process`]), under a second uid (`nobody`) where the finding needs one. Each test
//! failed on the main branch before the fixes (job ids taken from the client's hello, no uid
//! check, no bounds, no mesh authentication, ...).
#![allow(clippy::needless_range_loop)]

mod common;

use algorithms::CommId;
use alias_mkey::Rights;
use bootstrap::auth::{self, ClusterKey, JobCredential};
use bootstrap::mailbox::{self, STATUS_OK};
use bootstrap::wire::{
    self, AdminHello, Channel, ErrorCode, Hello, HostHello, HostToSp, SpHello, SpToHost,
};
use bootstrap::Layout;
use common::*;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(20);
const NOBODY: u32 = 65534;

// ---- the attacker process -------------------------------------------------------------------

/// Runs this test binary again as an attacker: `mode` and `vars` in its environment, under
/// `uid` if given. Returns its `ATTACK:` lines.
fn attack(mode: &str, vars: &[(&str, String)], uid: Option<u32>) -> Vec<String> {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "attacker_process",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("SPOFF_ATTACK", mode);
    for (k, v) in vars {
        cmd.env(k, v);
    }
    if let Some(uid) = uid {
        cmd.uid(uid).gid(uid);
    }
    let out = cmd.output().expect("the attacker process runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<String> = stdout
        .lines()
        // The harness prints "test attacker_process ... " before the first line.
        .filter_map(|l| l.split_once("ATTACK: ").map(|(_, a)| a.to_string()))
        .collect();
    assert!(
        !lines.is_empty(),
        "the attacker ({mode}) said nothing\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    lines
}

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("attacker: {k} is not set"))
}

fn say(what: impl std::fmt::Display) {
    println!("ATTACK: {what}");
}

/// Connects to a host socket and says hello; the answer as a line.
fn hello_as(
    socket: &str,
    cred: String,
    rank: u32,
    size: u32,
) -> (Option<Channel<UnixStream>>, String) {
    let s = match UnixStream::connect(socket) {
        Ok(s) => s,
        Err(e) => return (None, format!("CONNECT-FAILED {e}")),
    };
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut ch = Channel::new(s);
    if let Err(e) = ch.send_hello(&Hello::Host(HostHello {
        credential: cred,
        world_rank: rank,
        world_size: size,
        node: 0,
        local_rank: rank,
    })) {
        return (None, format!("SEND-FAILED {e}"));
    }
    match ch.recv_hello() {
        Ok(Hello::Welcome { .. }) => (Some(ch), "WELCOME".into()),
        Ok(Hello::Reject { reason }) => (None, format!("REJECT {reason}")),
        Ok(other) => (None, format!("OTHER {other:?}")),
        Err(e) => (None, format!("CLOSED {e}")),
    }
}

/// Registers a mailbox of 4 slots on a welcomed connection.
fn register(ch: &mut Channel<UnixStream>) {
    let mb: &'static [u64] = Box::leak(vec![0u64; 64].into_boxed_slice());
    let grant = alias_mkey::host::Registrar::new().register(
        mb.as_ptr() as u64,
        4 * mailbox::SLOT_BYTES,
        Rights::READ_WRITE,
    );
    ch.send(&HostToSp::Register {
        cores: vec![],
        mailbox: grant,
        mailbox_slots: 4,
    })
    .unwrap();
    match ch.recv::<SpToHost>().unwrap() {
        SpToHost::Registered { .. } => {}
        other => panic!("attacker: register answered {other:?}"),
    }
}

/// A post of an alltoallv on a 2-rank communicator where the other rank never posts (rank 0
/// sends 8 bytes to rank 1 only, so nothing of it can start before rank 1 posts).
fn stuck_post(seq: u64, members: Vec<u32>, world: Vec<u32>) -> wire::PostDesc {
    let g = alias_mkey::host::Registrar::new().register(0x1000, 16, Rights::READ_WRITE);
    let mut d = desc(
        CommId { leader: 0, id: 77 },
        seq,
        0,
        members,
        0,
        g.clone(),
        g,
        (vec![0, 8], vec![0, 8], vec![0, 8], vec![0, 8]),
    );
    d.slot = None;
    d.world_ranks = world;
    d
}

/// The entry point of the attacker subprocess (not a test of its own: the other tests run it).
#[test]
#[ignore = "the attacker subprocess of the other tests; does nothing on its own"]
fn attacker_process() {
    let Ok(mode) = std::env::var("SPOFF_ATTACK") else {
        return;
    };
    let n = |k: &str| var(k).parse::<u64>().unwrap();
    match mode.as_str() {
        // Hello with the given credential, then close without goodbye.
        "hello" => {
            let (_, out) = hello_as(
                &var("SOCK"),
                var("CRED"),
                n("RANK") as u32,
                n("SIZE") as u32,
            );
            say(out);
        }
        // A bad post, and the connection closed at once, many times.
        "bad-post-then-close" => {
            for i in 0..n("TIMES") {
                let (ch, out) = hello_as(&var("SOCK"), var("CRED"), 0, 1);
                let Some(mut ch) = ch else {
                    say(out);
                    return;
                };
                register(&mut ch);
                let mut d = stuck_post(i, vec![0], vec![0]);
                d.send_counts = vec![1 << 40];
                ch.send(&HostToSp::Post(Box::new(d))).unwrap();
                drop(ch);
            }
            say("DONE");
        }
        // Posts that can never complete, as many as asked for: rank 1 of the job is connected
        // to its SP (so the job is there) and never posts.
        "flood-posts" => {
            let (ch, out) = hello_as(&var("SOCK"), var("CRED"), 0, 2);
            let Some(mut ch) = ch else {
                say(out);
                return;
            };
            register(&mut ch);
            let (other, out) = hello_as(&var("SOCK1"), var("CRED"), 1, 2);
            let Some(mut other) = other else {
                say(out);
                return;
            };
            register(&mut other);
            let other_sp = n("OTHER_SP") as u32;
            for i in 0..n("POSTS") {
                let d = stuck_post(i, vec![0, other_sp], vec![0, 1]);
                if ch.send(&HostToSp::Post(Box::new(d))).is_err() {
                    break;
                }
            }
            // Count the refusals that came back.
            ch.get_ref()
                .set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            let mut refused = 0;
            while let Ok(m) = ch.recv::<SpToHost>() {
                if matches!(m, SpToHost::Error { .. }) {
                    refused += 1;
                }
            }
            say(format!("REFUSED {refused}"));
        }
        // Register, fork a child that keeps the socket, exit: the SP must drop the connection
        // (the process it served is gone, and its pid may be another process's tomorrow).
        "fork-and-exit" => {
            let (ch, out) = hello_as(&var("SOCK"), var("CRED"), 0, 1);
            let Some(mut ch) = ch else {
                say(out);
                return;
            };
            register(&mut ch);
            // SAFETY: fork in this single-threaded attacker (the test harness runs one test,
            // on one thread); the child only uses the socket and exits.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // The child: wait for the parent to exit, then for the SP to close.
                std::thread::sleep(Duration::from_millis(200));
                let s = ch.get_ref();
                s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
                let mut b = [0u8; 64];
                let verdict = match (&*s).read(&mut b) {
                    Ok(0) => "CLOSED",
                    Ok(_) => "DATA",
                    Err(_) => "OPEN",
                };
                let _ = std::fs::write(var("OUT"), verdict);
                // SAFETY: leaves the forked child at once.
                unsafe { libc::_exit(0) };
            }
            say("PARENT-EXITS");
            // SAFETY: exit without dropping the connection (the child holds it).
            unsafe { libc::_exit(0) };
        }
        // Pose as a peer SP with the public fingerprint and a forged proof.
        "impostor-sp" => {
            let s = std::net::TcpStream::connect(var("ADDR")).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut ch = Channel::new(s);
            ch.send_hello(&Hello::Sp(SpHello {
                sp: n("AS_SP") as u32,
                cluster_fingerprint: n("FINGERPRINT"),
                nonce: auth::nonce(),
            }))
            .unwrap();
            match ch.recv_hello() {
                Ok(Hello::SpWelcome { .. }) => {
                    ch.send_hello(&Hello::SpProof { proof: [0x42; 32] })
                        .unwrap();
                    match ch.recv_hello() {
                        Ok(Hello::Reject { reason }) => say(format!("REJECT {reason}")),
                        Ok(other) => say(format!("ACCEPTED {other:?}")),
                        Err(e) => say(format!("CLOSED {e}")),
                    }
                }
                Ok(Hello::Reject { reason }) => say(format!("REJECT {reason}")),
                Ok(other) => say(format!("OTHER {other:?}")),
                Err(e) => say(format!("CLOSED {e}")),
            }
        }
        // An admin request without the key.
        "stats-without-key" => {
            let s = UnixStream::connect(var("SOCK")).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut ch = Channel::new(s);
            let (nonce, unix_secs) = (auth::nonce(), auth::unix_secs());
            ch.send_hello(&Hello::Admin(AdminHello {
                nonce,
                unix_secs,
                proof: auth::admin_proof(&ClusterKey::generate(), &nonce, unix_secs),
            }))
            .unwrap();
            match ch.recv_hello() {
                Ok(Hello::Reject { reason }) => say(format!("REJECT {reason}")),
                Ok(other) => say(format!("OTHER {other:?}")),
                Err(e) => say(format!("CLOSED-OR-DATA {e}")),
            }
        }
        // Undecodable frames after a good hello, and hellos that fail, many of them.
        "log-flood" => {
            let (ch, out) = hello_as(&var("SOCK"), var("CRED"), 0, 1);
            let Some(ch) = ch else {
                say(out);
                return;
            };
            let mut s = ch.get_ref().try_clone().unwrap();
            let junk = wire::frame(&[0xff; 16]);
            for _ in 0..n("FRAMES") {
                if s.write_all(&junk).is_err() {
                    break;
                }
            }
            for _ in 0..n("HELLOS") {
                let _ = hello_as(&var("SOCK"), "spoffjob1:1:0:1:00".into(), 0, 1);
            }
            say("DONE");
        }
        // Connect and say nothing: when does the SP close?
        "silent" => {
            let mut s = UnixStream::connect(var("SOCK")).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let t = Instant::now();
            let mut b = [0u8; 8];
            let r = s.read(&mut b);
            say(format!("CLOSED-AFTER-MS {} {r:?}", t.elapsed().as_millis()));
        }
        // Many connections without a hello at once: how many does the SP drop at once?
        "many-silent" => {
            let conns: Vec<UnixStream> = (0..n("CONNS"))
                .filter_map(|_| UnixStream::connect(var("SOCK")).ok())
                .collect();
            std::thread::sleep(Duration::from_millis(300));
            let mut closed = 0;
            for mut c in conns {
                c.set_nonblocking(true).unwrap();
                let mut b = [0u8; 8];
                if matches!(c.read(&mut b), Ok(0)) {
                    closed += 1;
                }
            }
            say(format!("CLOSED {closed}"));
        }
        other => panic!("unknown attack {other}"),
    }
}

// ---- helpers of the tests ---------------------------------------------------------------

fn socket_of(set: &SpSet, sp: u32) -> String {
    set.cluster
        .sp(sp)
        .unwrap()
        .host_socket
        .display()
        .to_string()
}

fn my_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// A 4-rank alltoallv of the world communicator of `hosts` (comm rank = world rank): 8 bytes
/// to every peer, checked; returns each rank's status.
fn alltoallv(hosts: &mut [Host], comm: CommId, seq: u64) -> Vec<Option<u32>> {
    let p = hosts.len();
    let members: Vec<u32> = hosts.iter().map(|h| h.sp).collect();
    let send: Vec<Vec<u8>> = (0..p)
        .map(|r| {
            (0..8 * p)
                .map(|i| (r * 31 + i + seq as usize) as u8)
                .collect()
        })
        .collect();
    let recv: Vec<Vec<u8>> = (0..p).map(|_| vec![0xEE; 8 * p]).collect();
    let mut posted = vec![];
    for r in 0..p {
        let s = hosts[r].grant(&send[r], Rights::READ);
        let d = hosts[r].grant(&recv[r], Rights::WRITE);
        let counts = vec![8u64; p];
        let displs: Vec<u64> = (0..p as u64).map(|i| 8 * i).collect();
        let d = desc(
            comm,
            seq,
            r as u32,
            members.clone(),
            (seq % 8) as u32,
            s,
            d,
            (counts.clone(), displs.clone(), counts, displs),
        );
        let (slot, token) = hosts[r].post(d);
        posted.push((r, slot, token));
    }
    let got = wait_all_serving(hosts, &posted, WAIT);
    for r in 0..p {
        if got[r] == Some(STATUS_OK) {
            for s in 0..p {
                for i in 0..8 {
                    // SAFETY-free: read back what the SP wrote through CMA.
                    let b = unsafe { std::ptr::read_volatile(&recv[r][8 * s + i]) };
                    assert_eq!(b, send[s][8 * r + i], "rank {r} from {s} byte {i}");
                }
            }
        }
    }
    got
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

fn query(set: &SpSet, sp: u32) -> serde_json::Value {
    service_process::stats::query_within(
        set.cluster.sp(sp).unwrap(),
        &set.key,
        Duration::from_secs(2),
    )
    .expect("the SP answers a stats request")
}

// ---- the findings -----------------------------------------------------------------------

/// Findings 1 and 2: a client cannot join another job by naming its id (the job comes from a
/// credential MAC'd with the cluster key), cannot post as another rank of its own job, and a
/// client refused at hello that closes without goodbye does not fail the job it named.
#[test]
fn another_jobs_ranks_cannot_be_joined_impersonated_or_killed() {
    let set = SpSet::start(2, 1, 2, Layout::Block);
    let victim = new_job();
    let mut hosts: Vec<Host> = (0..4).map(|r| Host::connect(&set, victim, r, 4)).collect();
    let comm = CommId { leader: 0, id: 1 };
    let sock = socket_of(&set, 0);
    // The victim's job id with a MAC of another key; the victim's id with a MAC of garbage.
    let foreign = JobCredential::issue(&ClusterKey::generate(), victim, my_uid(), 4);
    let garbled = format!("spoffjob1:{victim:016x}:{}:4:{}", my_uid(), "00".repeat(32));
    for cred in [foreign.encode(), garbled] {
        let out = attack(
            "hello",
            &[
                ("SOCK", sock.clone()),
                ("CRED", cred),
                ("RANK", "1".into()),
                ("SIZE", "4".into()),
            ],
            None,
        );
        assert!(
            out[0].starts_with("REJECT") && out[0].contains("credential"),
            "{out:?}"
        );
    }
    // The victim's own credential for a rank that is connected already.
    let own = JobCredential::issue(&set.key, victim, my_uid(), 4).encode();
    let out = attack(
        "hello",
        &[
            ("SOCK", sock.clone()),
            ("CRED", own),
            ("RANK", "1".into()),
            ("SIZE", "4".into()),
        ],
        None,
    );
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
    match hosts[0].recv() {
        SpToHost::Error { code, message, .. } => {
            assert_eq!(code, ErrorCode::UnknownComm, "{message}");
            assert!(
                message.contains("this connection is world rank 0"),
                "{message}"
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // The victim job runs as if nothing happened.
    let got = alltoallv(&mut hosts, comm, 0);
    assert_eq!(got, vec![Some(STATUS_OK); 4]);
    let got = alltoallv(&mut hosts, comm, 1);
    assert_eq!(got, vec![Some(STATUS_OK); 4]);
}

/// Finding 3: a post refused with an error, on a connection that is gone by the time the SP
/// answers, must not crash the SP.
#[test]
fn a_refused_post_on_a_connection_that_closed_does_not_crash_the_sp() {
    let set = SpSet::start(1, 1, 1, Layout::Block);
    let cred = JobCredential::issue(&set.key, new_job(), my_uid(), 1).encode();
    let out = attack(
        "bad-post-then-close",
        &[
            ("SOCK", socket_of(&set, 0)),
            ("CRED", cred),
            ("TIMES", "200".into()),
        ],
        None,
    );
    assert_eq!(out, ["DONE"]);
    std::thread::sleep(Duration::from_millis(200));
    let mut set = set;
    assert!(set.alive(0), "the SP died");
    let s = query(&set, 0);
    assert!(s["errors_sent"].as_u64().unwrap() >= 1, "{s}");
    // And it still serves a job.
    let mut hosts = vec![Host::connect(&set, new_job(), 0, 1)];
    let got = alltoallv(&mut hosts, CommId { leader: 0, id: 1 }, 0);
    assert_eq!(got, vec![Some(STATUS_OK)]);
}

/// Finding 4: a hello with a world of 2^32 - 1 ranks (even with a valid credential) is
/// refused at once and freezes nothing.
#[test]
fn a_huge_world_size_is_refused_at_once() {
    let set = SpSet::start(1, 1, 1, Layout::Block);
    let huge = JobCredential::issue(&set.key, new_job(), my_uid(), u32::MAX).encode();
    let t = Instant::now();
    let out = attack(
        "hello",
        &[
            ("SOCK", socket_of(&set, 0)),
            ("CRED", huge),
            ("RANK", "0".into()),
            ("SIZE", u32::MAX.to_string()),
        ],
        None,
    );
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
    let cred = JobCredential::issue(&set.key, new_job(), my_uid(), 2).encode();
    let out = attack(
        "flood-posts",
        &[
            ("SOCK", socket_of(&set, 0)),
            ("CRED", cred),
            ("POSTS", "30000".into()),
            ("SOCK1", socket_of(&set, 1)),
            ("OTHER_SP", "1".into()),
        ],
        None,
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
    let hello = |cred: String| {
        attack(
            "hello",
            &[
                ("SOCK", sock.clone()),
                ("CRED", cred),
                ("RANK", "0".into()),
                ("SIZE", "1".into()),
            ],
            Some(NOBODY),
        )
    };
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
    let hello = |cred: String| {
        attack(
            "hello",
            &[
                ("SOCK", sock.clone()),
                ("CRED", cred),
                ("RANK", "0".into()),
                ("SIZE", "1".into()),
            ],
            Some(NOBODY),
        )
    };
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
    let spec = service_process::launch::SpSetSpec {
        nodes: 2,
        sps_per_node: 1,
        ranks_per_node: 1,
        layout: Layout::Block,
        sp_cpus: None,
        max_inflight_reads: 2,
        extra_args: vec![],
        sp_args: vec![],
    };
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
    let spec = service_process::launch::SpSetSpec {
        nodes: 1,
        sps_per_node: 1,
        ranks_per_node: 1,
        layout: Layout::Block,
        sp_cpus: None,
        max_inflight_reads: 2,
        extra_args: vec![],
        sp_args: vec![],
    };
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
