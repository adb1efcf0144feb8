//! Integration tests with real processes: SPs started by the launcher, `mpirun` jobs of
//! unmodified MPI programs with the host shim preloaded. Every offloaded result is compared
//! byte for byte with the `PMPI_*` result computed in the same run (inside `alltoallv_check`),
//! and every test checks from the SPs' own counters that offload really happened (or really
//! did not, for the fallback cases).

use integration_tests::*;
use std::time::{Duration, Instant};

const JOB_TIMEOUT: Duration = Duration::from_secs(240);

fn check_prog() -> String {
    artifact("alltoallv_check").display().to_string()
}

fn alltoallv_matches_native(layout: &str, sps_per_node: &str) {
    let seed = seed().to_string();
    let prog = check_prog();
    let k = sps_per_node;
    let run = run(
        launch_cmd(
            &[
                "--nodes",
                "2",
                "--ranks-per-node",
                "2",
                "--sps-per-node",
                k,
                "--layout",
                layout,
            ],
            &[&prog, "--ops", "150", "--seed", &seed],
        ),
        JOB_TIMEOUT,
    );
    run.assert_ok("alltoallv_check under the launcher");
    assert!(
        run.stdout.contains("150 ops, 0 mismatches"),
        "seed {seed}: no clean summary line\n{}",
        run.stdout
    );
    let posts = run.sp_total("posts");
    assert!(
        posts > 0,
        "seed {seed}: the SPs saw no post: nothing was offloaded\n{}",
        run.stderr
    );
    assert_eq!(run.sp_total("copies_failed"), 0, "{}", run.stderr);
    assert_eq!(run.sp_total("errors_sent"), 0, "{}", run.stderr);
    assert_eq!(
        run.sp_stats().len(),
        2 * k.parse::<usize>().unwrap(),
        "every SP reported"
    );
    eprintln!(
        "{layout} x{k}: {posts} posts offloaded in {:?}",
        run.elapsed
    );
}

#[test]
fn mpi_alltoallv_matches_native_block_1sp() {
    alltoallv_matches_native("block", "1");
}

#[test]
fn mpi_alltoallv_matches_native_block_2sp() {
    alltoallv_matches_native("block", "2");
}

#[test]
fn mpi_alltoallv_matches_native_cyclic_1sp() {
    alltoallv_matches_native("cyclic", "1");
}

#[test]
fn mpi_alltoallv_matches_native_cyclic_2sp() {
    alltoallv_matches_native("cyclic", "2");
}

#[test]
fn mpi_checker_can_fail() {
    // The validation program must be able to report a mismatch, or its passes mean nothing.
    let prog = check_prog();
    let run = run(
        launch_cmd(
            &["--nodes", "2", "--ranks-per-node", "1"],
            &[&prog, "--ops", "5", "--seed", "1", "--self-test-corrupt"],
        ),
        JOB_TIMEOUT,
    );
    assert!(
        !run.ok(),
        "a corrupted result went unnoticed\n{}",
        run.stdout
    );
}

#[test]
fn mpi_no_sp_reachable_falls_back_to_native() {
    // A cluster description whose SP sockets do not exist: the shim says so once per rank and
    // the job runs natively with correct results.
    let dir = std::env::temp_dir().join(format!("spoff-nosp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sps = (0..2)
        .map(|i| bootstrap::cluster::SpEntry {
            id: i,
            node: i,
            index: 0,
            peer_addr: "127.0.0.1:9".parse().unwrap(),
            host_socket: dir.join(format!("absent-{i}.sock")),
            host_addr: None,
        })
        .collect();
    let cluster = bootstrap::Cluster::new(2, 1, Some(2), bootstrap::Layout::Block, sps).unwrap();
    let path = dir.join("cluster.json");
    cluster.save(&path).unwrap();
    let credential = bootstrap::auth::JobCredential::issue(
        &bootstrap::auth::ClusterKey::generate(),
        1,
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() },
        4,
    )
    .encode();
    let mut cmd = mpirun_offloaded(4, &path, credential);
    cmd.args([&check_prog(), "--ops", "40", "--seed", "3"]);
    let run = run(cmd, JOB_TIMEOUT);
    std::fs::remove_dir_all(&dir).ok();
    run.assert_ok("alltoallv_check with no SP");
    assert!(
        run.stdout.contains("40 ops, 0 mismatches"),
        "{}",
        run.stdout
    );
    let said = run
        .stderr
        .lines()
        .filter(|l| l.contains("running natively"))
        .count();
    assert!(
        (1..=4).contains(&said),
        "expected one fallback line per rank:\n{}",
        run.stderr
    );
}

#[test]
fn mpi_offload_disabled_by_environment_runs_natively() {
    let prog = check_prog();
    let mut cmd = launch_cmd(
        &["--nodes", "2", "--ranks-per-node", "2"],
        &[&prog, "--ops", "30", "--seed", "4"],
    );
    cmd.env("SPOFF_OFFLOAD", "0");
    let run = run(cmd, JOB_TIMEOUT);
    run.assert_ok("alltoallv_check with SPOFF_OFFLOAD=0");
    assert!(
        run.stdout.contains("30 ops, 0 mismatches"),
        "{}",
        run.stdout
    );
    assert_eq!(
        run.sp_total("posts"),
        0,
        "offload was disabled but the SPs saw posts"
    );
}

#[test]
fn mpi_coll_bench_overlap_validates_offloaded_and_native() {
    let bench = artifact("coll-bench").display().to_string();
    for native in [false, true] {
        let json =
            std::env::temp_dir().join(format!("spoff-bench-{}-{native}.json", std::process::id()));
        let json_s = json.display().to_string();
        let mut args = vec!["--nodes", "2", "--ranks-per-node", "1"];
        if native {
            args.push("--native");
        }
        let run = run(
            launch_cmd(
                &args,
                &[
                    &bench,
                    "overlap",
                    "--coll",
                    "ialltoallv",
                    "--sizes",
                    "1K,64K",
                    "--iters",
                    "4",
                    "--warmup",
                    "1",
                    "--json",
                    &json_s,
                ],
            ),
            JOB_TIMEOUT,
        );
        run.assert_ok("coll-bench overlap");
        let (text, rows) = take_json_lines(&json);
        assert_eq!(rows.len(), 2, "{text}");
        for r in &rows {
            assert_eq!(r["validated"], true, "{r}");
            assert_eq!(r["mode"], if native { "native" } else { "offload" }, "{r}");
            assert_eq!(r["nodes"], 2, "{r}");
            // An iteration of the loop is a barrier, a setup and the timed post-compute-wait.
            let (looped, overall) = (r["loop_us"].as_f64(), r["overall_us"].as_f64());
            assert!(
                matches!((looped, overall), (Some(l), Some(o)) if l >= o && o > 0.0),
                "{r}"
            );
        }
        if native {
            assert!(run.sp_stats().is_empty(), "--native must start no SP");
        } else {
            assert!(
                run.sp_total("posts") > 0,
                "nothing offloaded:\n{}",
                run.stderr
            );
        }
    }
}

/// The JSON Lines file a job wrote (its text and its rows), removed.
fn take_json_lines(path: &std::path::Path) -> (String, Vec<serde_json::Value>) {
    let text = std::fs::read_to_string(path).unwrap();
    std::fs::remove_file(path).ok();
    let rows = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (text, rows)
}

/// `coll-bench overlap` of the staged collectives at sizes `bcast_check`/`ag_check` do not
/// reach (up to 1 MiB per rank, sizes off the 256 KiB chunk, 0 and 1 byte), each design forced,
/// 2 nodes x 2 ranks: every row validated (the benchmark checks every byte), the SPs moved
/// chunks (bcast) or staged blocks (allgather) and finished everything.
#[test]
fn mpi_staged_collectives_validate_at_real_sizes() {
    let bench = artifact("coll-bench").display().to_string();
    for (coll, design) in [
        ("ibcast", "flat"),
        ("ibcast", "hier"),
        ("iallgather", "flat"),
        ("iallgather", "hier"),
    ] {
        let json = std::env::temp_dir().join(format!(
            "spoff-staged-{}-{coll}-{design}.json",
            std::process::id()
        ));
        let json_s = json.display().to_string();
        let run = run(
            launch_cmd(
                &["--nodes", "2", "--ranks-per-node", "2"],
                &[
                    &bench,
                    "overlap",
                    "--coll",
                    coll,
                    "--design",
                    design,
                    "--sizes",
                    "0,1,300001,1M",
                    "--iters",
                    "3",
                    "--warmup",
                    "1",
                    "--json",
                    &json_s,
                ],
            ),
            JOB_TIMEOUT,
        );
        run.assert_ok(&format!(
            "coll-bench overlap --coll {coll} --design {design}"
        ));
        let (text, rows) = take_json_lines(&json);
        assert_eq!(rows.len(), 4, "{text}");
        for r in &rows {
            assert_eq!(r["validated"], true, "{coll} {design}: {r}");
            assert_eq!(r["design"], design, "{r}");
        }
        assert!(
            run.sp_total("posts") > 0,
            "nothing offloaded:\n{}",
            run.stderr
        );
        assert_eq!(run.sp_total("copies_failed"), 0, "{}", run.stderr);
        assert_eq!(run.sp_total("instances_at_exit"), 0, "{}", run.stderr);
        if design == "hier" {
            assert!(run.sp_total("host_copies") > 0, "{}", run.stderr);
        }
        if coll == "ibcast" {
            assert!(run.sp_total("chunks_moved") > 0, "{}", run.stderr);
        } else {
            assert_eq!(
                run.sp_total("announces_received"),
                0,
                "not the staged design"
            );
        }
    }
}

thread_local! {
    static LONG_JOB_STDERR: std::cell::RefCell<Option<std::path::PathBuf>> =
        const { std::cell::RefCell::new(None) };
}

/// What the launcher of this thread's last long job wrote on stderr so far.
fn long_job_stderr() -> String {
    LONG_JOB_STDERR.with(|p| {
        p.borrow()
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    })
}

/// Starts a long job, waits until its SPs are serving, and returns (launcher, marker) where
/// the marker is a string found in every process of the job.
fn start_long_job(extra: &[&str]) -> (std::process::Child, String) {
    start_long_job_env(extra, &[])
}

/// [`start_long_job`] with `env` set for the launcher (and so for the ranks).
fn start_long_job_env(extra: &[&str], env: &[(&str, &str)]) -> (std::process::Child, String) {
    let prog = check_prog();
    let mut args = vec![
        "--nodes",
        "2",
        "--ranks-per-node",
        "2",
        "--fault-grace-secs",
        "20",
    ];
    args.extend_from_slice(extra);
    let mut cmd = launch_cmd(&args, &[&prog, "--ops", "1000000", "--seed", "5"]);
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    // The launcher's messages go to a file a test can read (see `long_job_stderr`).
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let err_path =
        std::env::temp_dir().join(format!("spoff-longjob-{}-{n}.err", std::process::id()));
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap());
    let child = cmd.spawn().unwrap();
    LONG_JOB_STDERR.with(|p| *p.borrow_mut() = Some(err_path));
    let marker = format!("spoff-{}-", child.id());
    // Wait until the ranks run (their environment names the run directory).
    let t = Instant::now();
    while pids_matching(&marker).len() < 2 + 4 {
        assert!(t.elapsed() < Duration::from_secs(60), "job did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(1500));
    (child, marker)
}

fn wait_exit(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            panic!("the launcher did not end within {limit:?} (hang)");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn assert_nothing_left(marker: &str) {
    let t = Instant::now();
    loop {
        let left = pids_matching(marker);
        if left.is_empty() {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "processes left behind: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn mpi_ctrl_c_stops_the_job_and_leaves_nothing() {
    let (mut child, marker) = start_long_job(&[]);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let st = wait_exit(&mut child, Duration::from_secs(20));
    assert_eq!(st.code(), Some(130), "{st}");
    assert_nothing_left(&marker);
}

#[test]
fn mpi_sp_killed_mid_job_ends_it_with_an_error() {
    let (mut child, marker) = start_long_job(&[]);
    let sp = sp_pid(&marker, 1);
    // SAFETY: killing a process of our own job.
    unsafe { libc::kill(sp as i32, libc::SIGKILL) };
    let st = wait_exit(&mut child, Duration::from_secs(60));
    assert!(
        !st.success(),
        "a job that lost an SP must not report success"
    );
    assert_nothing_left(&marker);
}

#[test]
fn mpi_rank_killed_mid_job_ends_it_with_an_error() {
    let (mut child, marker) = start_long_job(&[]);
    let rank = pids_matching(&marker)
        .into_iter()
        .find(|&p| {
            let env = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
            let env = String::from_utf8_lossy(&env).replace('\0', " ");
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            env.contains("OMPI_COMM_WORLD_RANK=1 ")
                && String::from_utf8_lossy(&cmd).contains("alltoallv_check")
        })
        .expect("rank 1 running");
    // SAFETY: killing a process of our own job.
    unsafe { libc::kill(rank as i32, libc::SIGKILL) };
    let st = wait_exit(&mut child, Duration::from_secs(60));
    assert!(!st.success());
    assert_nothing_left(&marker);
}

/// The pid of SP `sp` of the job with `marker`.
fn sp_pid(marker: &str, sp: u32) -> u32 {
    pids_matching(marker)
        .into_iter()
        .find(|&p| {
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            cmd.contains(" serve ") && cmd.contains(&format!("--sp-id {sp} "))
        })
        .unwrap_or_else(|| panic!("SP {sp} running"))
}

#[test]
fn mpi_stuck_sp_is_detected_by_heartbeats_without_a_watchdog() {
    // No launcher watchdog: a stopped SP is noticed by its peers (no heartbeat for 2 s) and by
    // its own ranks (nothing heard for 3 s while they wait), and the job fails, not hangs.
    let (mut child, marker) = start_long_job_env(
        &["--sp-watchdog-secs", "0", "--sp-arg=--peer-timeout-ms=2000"],
        &[("SPOFF_SP_TIMEOUT_MS", "3000")],
    );
    let sp = sp_pid(&marker, 1);
    let t = Instant::now();
    // SAFETY: stopping a process of our own job.
    unsafe { libc::kill(sp as i32, libc::SIGSTOP) };
    let st = wait_exit(&mut child, Duration::from_secs(60));
    let took = t.elapsed();
    assert!(
        !st.success(),
        "a job that lost an SP must not report success"
    );
    let err = long_job_stderr();
    assert!(
        !err.contains("has not answered"),
        "the watchdog acted:\n{err}"
    );
    assert!(
        err.contains("no message or heartbeat") || err.contains("no heartbeat"),
        "no heartbeat loss reported:\n{err}"
    );
    assert!(took < Duration::from_secs(40), "took {took:?}");
    assert_nothing_left(&marker);
}

#[test]
fn mpi_stuck_sp_is_killed_by_the_watchdog_and_the_job_ends() {
    // An SP that is alive but stopped answers nothing: the launcher's watchdog must notice
    // and kill it, after which the job fails like on an SP death, instead of hanging.
    let (mut child, marker) = start_long_job(&["--sp-watchdog-secs", "3"]);
    let sp = sp_pid(&marker, 1);
    // SAFETY: stopping a process of our own job.
    unsafe { libc::kill(sp as i32, libc::SIGSTOP) };
    let st = wait_exit(&mut child, Duration::from_secs(60));
    assert!(
        !st.success(),
        "a job that lost an SP must not report success"
    );
    let err = long_job_stderr();
    assert!(
        err.contains("SP 1 has not answered"),
        "no watchdog message:\n{err}"
    );
    assert_nothing_left(&marker);
}
