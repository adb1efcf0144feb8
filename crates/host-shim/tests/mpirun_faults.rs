//! Failures in real `mpirun` jobs: a real SP killed mid-job (the program with
//! `MPI_ERRORS_RETURN`, and with the default `MPI_ERRORS_ARE_FATAL`, which must abort the job
//! as a native failure would), and a fake SP that refuses every post (the mailbox slots all end
//! quarantined).

mod common;

use bootstrap::cluster::{Cluster, Layout, SpEntry};
use common::*;
use integration_tests::{cmdline, launch_cmd, parent, pids_matching, run, Finished};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Polls `f` every 50 ms until it gives a value, for at most 60 s.
fn poll<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> Result<T, String> {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if t.elapsed() > Duration::from_secs(60) {
            return Err(format!("{what} did not happen within 60 s"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits for the launcher this test process started and its job, lets the ranks offload for
/// a while, then kills SP 1 of that job. Returns the job's marker (the run directory prefix,
/// in every process of the job) and when the SP died. Interrupts the launcher if it cannot.
fn kill_sp_1_mid_job() -> Result<(String, Instant), String> {
    let me = std::process::id();
    let launcher = poll("the launcher start", || {
        pids_matching("")
            .into_iter()
            .find(|&p| parent(p) == Some(me) && cmdline(p).contains("service-process launch "))
    })?;
    let marker = format!("spoff-{launcher}-");
    let killed = (|| {
        // 2 SPs, mpirun and 4 ranks carry the run directory (command line or environment).
        poll("the job start", || {
            (pids_matching(&marker).len() >= 7).then_some(())
        })?;
        std::thread::sleep(Duration::from_millis(1500));
        let sp = pids_matching(&marker)
            .into_iter()
            .find(|&p| {
                let c = cmdline(p);
                c.contains(" serve ") && c.contains(" --sp-id 1 ") && c.contains(&marker)
            })
            .ok_or("SP 1 is not running")?;
        // SAFETY: kill(2) on a process of the job this test started.
        unsafe { libc::kill(sp as i32, libc::SIGKILL) };
        Ok(Instant::now())
    })();
    if killed.is_err() {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(launcher as i32, libc::SIGINT) };
    }
    killed.map(|t| (marker, t))
}

/// `a2a_check ROUNDS extra...` on 2 nodes x 2 ranks, SP 1 killed mid-job. Rounds enough to
/// outlast the test; the program stops after the first round that failed. The launcher's grace
/// after an SP death is longer than the bounds the tests check: the job must end because its
/// collectives fail, not because the launcher killed it. Returns the run, the job's marker and
/// how long after the kill the job ended.
fn run_and_kill_sp_1(extra: &[&str]) -> (Finished, String, Duration) {
    run_and_kill_sp_1_of("a2a_check", extra, &[])
}

/// [`run_and_kill_sp_1`] of program `name` (`name ROUNDS extra...`) with `env`.
fn run_and_kill_sp_1_of(
    name: &'static str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Finished, String, Duration) {
    let prog = prog(name);
    let mut program = vec![prog.as_str(), "1000000"];
    program.extend_from_slice(extra);
    let cmd = launch_cmd(
        &[
            "--nodes",
            "2",
            "--ranks-per-node",
            "2",
            "--fault-grace-secs",
            "60",
        ],
        &program,
    );
    let killer = std::thread::spawn(kill_sp_1_mid_job);
    let run = run(with_env(cmd, env), TIMEOUT);
    let (marker, killed_at) = killer.join().unwrap().unwrap_or_else(|e| {
        panic!(
            "{e}\n--- stdout\n{}\n--- stderr\n{}",
            run.stdout, run.stderr
        )
    });
    let took = killed_at.elapsed();
    eprintln!("the job ended {took:?} after SP 1 was killed");
    (run, marker, took)
}

/// Every process of the job is gone within 5 s.
fn assert_nothing_left(marker: &str) {
    let t = Instant::now();
    loop {
        let left = pids_matching(marker);
        if left.is_empty() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "processes left behind: {:?}",
            left.iter().map(|&p| cmdline(p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// With `MPI_ERRORS_RETURN` the program sees the failed collectives' codes and ends itself.
#[test]
fn a_killed_sp_fails_collectives_and_ends_the_job_with_an_error() {
    let _serial = serial();
    let (run, marker, took) = run_and_kill_sp_1(&["return"]);
    let all = format!("--- stdout\n{}\n--- stderr\n{}", run.stdout, run.stderr);
    assert!(!run.ok(), "a job that lost an SP reported success\n{all}");
    assert!(took < Duration::from_secs(20), "took {took:?}\n{all}");
    assert!(
        !run.stderr.contains("did not end after an SP failure"),
        "{all}"
    );
    assert!(
        run.stdout.contains("a2a_check: ") && run.stdout.contains(" failures"),
        "{all}"
    );
    // Ranks 2 and 3 lost their SP: one of them at least says so, naming its socket (whether it
    // found the connection closed while reading or broken while posting). Not necessarily
    // both: once one of them ends with an error, mpirun may stop the other before it looks.
    assert!(
        [2, 3].iter().any(|r| shim_lines(&run.stderr)
            .iter()
            .any(|l| l.contains(&format!("rank {r}: ")) && l.contains("/sp-1.sock"))),
        "no rank of SP 1 reported the lost SP\n{all}"
    );
    // SP 0 served posts before the failure and reported at exit.
    assert_eq!(run.sp_stats().len(), 1, "{all}");
    assert!(run.sp_total("posts") > 0, "{all}");
    assert_nothing_left(&marker);
}

/// Under the default `MPI_ERRORS_ARE_FATAL` the first failed collective aborts the job through
/// the error handler, as a native failure does: the program never gets to count failures (with
/// unfilled receive buffers) and print its verdict.
#[test]
fn a_killed_sp_aborts_a_job_under_errors_are_fatal() {
    let _serial = serial();
    let (run, marker, took) = run_and_kill_sp_1(&[]);
    let all = format!("--- stdout\n{}\n--- stderr\n{}", run.stdout, run.stderr);
    assert!(!run.ok(), "a job that lost an SP reported success\n{all}");
    assert!(took < Duration::from_secs(20), "took {took:?}\n{all}");
    assert!(
        !run.stdout.contains(" failures") && !run.stdout.contains("all ok"),
        "the program went on after a failed collective\n{all}"
    );
    // Open MPI's "*** MPI_ERRORS_ARE_FATAL" lines come from the aborting rank and can be lost
    // when mpirun tears the job down first: logged, not required.
    eprintln!(
        "errors-are-fatal notice seen: {}",
        run.stderr.contains("MPI_ERRORS_ARE_FATAL")
    );
    assert!(
        !run.stderr.contains("did not end after an SP failure"),
        "{all}"
    );
    assert_nothing_left(&marker);
}

/// The SP-tree allreduce loses an SP mid-job (`allreduce_check`, blocking and nonblocking
/// allreduces on the world and a split half, SP 1 killed): the surviving SP aborts the
/// instances whose tree it was in (`PeerFailed`), its ranks' collectives fail, and the job
/// ends with an error well within the bound: no rank hangs in an allreduce.
#[test]
fn mpi_a_killed_sp_fails_sp_tree_allreduces_and_ends_the_job() {
    let _serial = serial();
    let (run, marker, took) = run_and_kill_sp_1_of(
        "allreduce_check",
        &["1"],
        &[("SPOFF_ALLREDUCE_DESIGN", "sp-tree")],
    );
    let all = format!("--- stdout\n{}\n--- stderr\n{}", run.stdout, run.stderr);
    assert!(!run.ok(), "a job that lost an SP reported success\n{all}");
    assert!(took < Duration::from_secs(20), "took {took:?}\n{all}");
    assert!(!run.stdout.contains("all ok"), "{all}");
    assert!(
        !run.stderr.contains("did not end after an SP failure"),
        "{all}"
    );
    // SP 0 served allreduce posts before the failure and reported at exit.
    assert!(run.sp_total("posts") > 0, "{all}");
    // The ranks of SP 0 fail with PeerFailed; mpirun may stop them before they say so (once
    // the ranks of SP 1 aborted): logged, not required.
    eprintln!(
        "a rank of SP 0 reported its allreduce failed by the lost peer: {}",
        run.stderr.contains("a peer service process failed")
    );
    assert_nothing_left(&marker);
}

/// A stand-in for the SPs of a 2-node cluster: registers every rank, then refuses every post by
/// message (as an SP refuses a bad descriptor), so the shim quarantines each post's slot.
/// Returns the cluster description; the listeners serve until the test process ends.
fn refusing_sps(dir: &Path) -> PathBuf {
    use bootstrap::wire::{Channel, ErrorCode, Hello, HostToSp, SpToHost};
    use std::os::unix::net::{UnixListener, UnixStream};
    fn serve(stream: UnixStream, sp: u32) {
        let mut ch = Channel::new(stream);
        let Ok(Hello::Host(_)) = ch.recv_hello() else {
            return;
        };
        if ch.send_hello(&Hello::Welcome { sp }).is_err() {
            return;
        }
        while let Ok(msg) = ch.recv::<HostToSp>() {
            let reply = match msg {
                HostToSp::Register { .. } => SpToHost::Registered {
                    sp,
                    segment: format!("/spoff-fake-{}-{sp}", std::process::id()),
                    serves: bootstrap::wire::Serves {
                        cma: true,
                        ..Default::default()
                    },
                    mcast_off: Some("the test's fake SP".into()),
                    canary_off: Some("the test's fake SP".into()),
                    post_ring_off: Some("the test's fake SP".into()),
                    arena_off: Some("the test's fake SP".into()),
                },
                HostToSp::Post(d) => SpToHost::Error {
                    comm: Some(d.comm),
                    seq: Some(d.seq),
                    code: ErrorCode::BadDescriptor,
                    message: "refused by the test's fake SP".into(),
                },
                // Never asks for copies, so never gets answers to them.
                HostToSp::Goodbye | HostToSp::CopyDone { .. } => return,
            };
            if ch.send(&reply).is_err() {
                return;
            }
        }
    }
    std::fs::create_dir_all(dir).unwrap();
    let sps = (0..2)
        .map(|i| {
            let sock = dir.join(format!("fake-{i}.sock"));
            let _ = std::fs::remove_file(&sock);
            let l = UnixListener::bind(&sock).unwrap();
            std::thread::spawn(move || {
                for s in l.incoming().flatten() {
                    std::thread::spawn(move || serve(s, i));
                }
            });
            SpEntry {
                id: i,
                node: i,
                index: 0,
                peer_addr: "127.0.0.1:9".parse().unwrap(),
                host_socket: sock,
                host_addr: None,
            }
        })
        .collect();
    let cluster = dir.join("cluster.json");
    Cluster::new(2, 1, None, Layout::Block, sps)
        .unwrap()
        .save(&cluster)
        .unwrap();
    cluster
}

/// One mailbox slot, every post refused: after the first refusal the only slot is quarantined
/// for good; every later collective is still posted (without a slot: the SP would complete it
/// by a message) and fails with the refusal, never waits for a slot.
#[test]
fn refused_posts_fail_even_once_every_mailbox_slot_is_quarantined() {
    let _serial = serial();
    let prog = prog("a2a_check");
    let dir = std::env::temp_dir().join(format!("host-shim-quarantine-{}", std::process::id()));
    let cluster = refusing_sps(&dir);
    let cred = some_credential();
    let run = mpirun_preloaded_within(
        &[&prog, "1", "return"],
        &[
            ("SPOFF_CLUSTER", cluster.to_str().unwrap()),
            ("SPOFF_JOB_CREDENTIAL", &cred),
            ("SPOFF_MAILBOX_SLOTS", "1"),
        ],
        Duration::from_secs(60),
    );
    let all = format!("--- stdout\n{}\n--- stderr\n{}", run.stdout, run.stderr);
    assert!(!run.ok(), "refused collectives reported success\n{all}");
    let failures: u64 = run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("a2a_check: "))
        .and_then(|l| l.strip_suffix(" failures"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no failure count\n{all}"));
    // Every collective of the run failed, not only the first: each was posted and refused.
    assert!(failures >= 2, "{all}");
    for r in 0..NP {
        let refused = shim_lines(&run.stderr)
            .iter()
            .filter(|l| {
                l.contains(&format!("rank {r}: ")) && l.contains("refused by the test's fake SP")
            })
            .count();
        assert!(refused >= 2, "rank {r} saw {refused} refusals\n{all}");
    }
    // The same run with the default error handler aborts at the first refused collective.
    let run = mpirun_preloaded_within(
        &[&prog, "1"],
        &[
            ("SPOFF_CLUSTER", cluster.to_str().unwrap()),
            ("SPOFF_JOB_CREDENTIAL", &cred),
            ("SPOFF_MAILBOX_SLOTS", "1"),
        ],
        Duration::from_secs(60),
    );
    std::fs::remove_dir_all(&dir).ok();
    let all = format!("--- stdout\n{}\n--- stderr\n{}", run.stdout, run.stderr);
    assert!(!run.ok(), "{all}");
    assert!(
        !run.stdout.contains("a2a_check: "),
        "the program went on\n{all}"
    );
    // Open MPI's "*** MPI_ERRORS_ARE_FATAL" lines come from the aborting rank and can be lost
    // when mpirun tears the job down first: logged, not required.
    eprintln!(
        "errors-are-fatal notice seen: {}",
        run.stderr.contains("MPI_ERRORS_ARE_FATAL")
    );
}
