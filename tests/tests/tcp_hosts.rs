//! Real `mpirun` jobs whose ranks reach their SPs over TCP (each SP's `host_addr` on
//! loopback), with the SPs started one by one as a site's tools would and waited for with
//! `service-process wait-ready`, never through `launch`. Every offloaded result is compared
//! byte for byte with `PMPI_*` inside `alltoallv_check`; the SPs' own counters prove the
//! offload and that every rank came over TCP.
//!
//! Two deployments: hosts on the SP's kernel (`--hosts-same-kernel`, `cma` grants and
//! mailboxes, as in the namespace emulation) and hosts as if on another machine (`ucx` grants,
//! no mailbox, completions by message, as on a real DPU).

#[path = "../../crates/service-process/tests/tcp/mod.rs"]
mod tcp;

use integration_tests::*;
use std::process::Command;
use std::time::Duration;
use tcp::TcpSps;

const JOB_TIMEOUT: Duration = Duration::from_secs(240);

fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// 2 nodes x 1 SP (2 ranks per node), SPs started with `serve_args` and waited for with
/// `wait-ready`; `alltoallv_check` on 4 ranks with `env` (exported to the ranks); returns the
/// job and the SPs' counters at exit.
fn job_over_tcp(serve_args: &[&str], env: &[(&str, &str)]) -> (Finished, Vec<serde_json::Value>) {
    let mut sps = TcpSps::describe(&service_process(), 2, 1, 2);
    for sp in 0..2 {
        sps.start(sp, serve_args);
    }
    let ready = run(
        {
            let mut c = Command::new(service_process());
            c.args(["wait-ready", "--timeout-secs", "30", "--cluster"])
                .arg(&sps.cluster_path);
            c
        },
        Duration::from_secs(60),
    );
    ready.assert_ok("service-process wait-ready");
    assert!(
        ready.stdout.contains("ready: all 2 SPs answer"),
        "{}",
        ready.stdout
    );

    let seed = seed().to_string();
    let cred = bootstrap::auth::JobCredential::issue_new(&sps.key, uid(), 4).encode();
    let mut cmd = mpirun_offloaded(4, &sps.cluster_path, cred);
    cmd.env_remove("SPOFF_BACKEND")
        .env_remove("SPOFF_HOSTS_SAME_KERNEL")
        .env_remove("SPOFF_HOST_TRANSPORT")
        .args(["-x", "SPOFF_VERBOSE"])
        .env("SPOFF_VERBOSE", "1");
    for (k, v) in env {
        cmd.args(["-x", k]).env(k, v);
    }
    cmd.arg(artifact("alltoallv_check"))
        .args(["--ops", "60", "--seed", &seed]);
    let job = run(cmd, JOB_TIMEOUT);
    job.assert_ok("alltoallv_check over TCP");
    assert!(
        job.stdout.contains("60 ops, 0 mismatches"),
        "seed {seed}: no clean summary line\n{}",
        job.stdout
    );
    // Every rank says where its SP is: over TCP.
    for (rank, sp) in [(0, 0), (1, 0), (2, 1), (3, 1)] {
        let at = format!("rank {rank}: offload active");
        let line = job
            .stderr
            .lines()
            .find(|l| l.contains(&at))
            .unwrap_or_else(|| panic!("rank {rank} not offloaded\n{}", job.stderr));
        let addr = sps.host_addr(sp);
        assert!(line.contains(&format!("SP {sp} at tcp:{addr}")), "{line}");
    }
    let stats = sps.stop_and_stats();
    for (sp, st) in stats.iter().enumerate() {
        assert!(!st.is_null(), "SP {sp} printed no counters");
        // Its 2 ranks and the wait-ready request(s), all over TCP.
        assert!(st["host_conns_tcp"].as_u64().unwrap() >= 3, "SP {sp}: {st}");
        assert_eq!(st["host_conns_unix"], 0, "SP {sp}: {st}");
        assert_eq!(st["errors_sent"], 0, "SP {sp}: {st}");
        assert_eq!(st["copies_failed"], 0, "SP {sp}: {st}");
        assert_eq!(st["completions"], st["posts"], "SP {sp}: {st}");
        assert_eq!(st["jobs_at_exit"], 0, "SP {sp}: {st}");
    }
    let posts: u64 = stats.iter().map(|s| s["posts"].as_u64().unwrap()).sum();
    assert!(posts > 0, "nothing was offloaded\n{}", job.stderr);
    eprintln!("{posts} posts offloaded over TCP in {:?}", job.elapsed);
    (job, stats)
}

#[test]
fn mpirun_over_tcp_on_the_sps_kernel_matches_native() {
    let (job, stats) = job_over_tcp(
        &["--hosts-same-kernel"],
        &[("SPOFF_HOSTS_SAME_KERNEL", "1")],
    );
    // cma grants and a mailbox: the ranks' lines name their slots.
    assert!(job.stderr.contains("1024 mailbox slots"), "{}", job.stderr);
    let copies: u64 = stats
        .iter()
        .map(|s| s["copies_started"].as_u64().unwrap())
        .sum();
    assert!(copies > 0);
}

#[test]
fn mpirun_over_tcp_from_another_machine_uses_ucx_and_no_mailbox() {
    let (job, stats) = job_over_tcp(&["--ucx=on"], &[]);
    assert!(job.stderr.contains(" 0 mailbox slots"), "{}", job.stderr);
    for r in 0..4 {
        assert!(
            job.stderr
                .contains(&format!("rank {r}: ucx grants, memory events")),
            "rank {r} did not default to ucx grants\n{}",
            job.stderr
        );
    }
    // No copy of a ucx grant runs inline on the SP's loop (those are cma copies).
    for st in &stats {
        assert_eq!(st["copies_inline"], 0, "{st}");
    }
}

/// The per-job deployment line itself: `mpirun --map-by ppr:2:node service-process serve
/// --sp-id auto` starts the SPs of this node (each takes its id from the host name and
/// Open MPI's local rank), `wait-ready` waits for them, a job runs over TCP, `stats` reads
/// their counters over TCP, and a SIGTERM to that mpirun stops them all.
#[test]
fn sps_started_by_mpirun_serve_a_job_over_tcp() {
    let mut sps = TcpSps::describe(&service_process(), 1, 2, 4);
    sps.cluster.hosts = vec![service_process::deploy::host_name().unwrap()];
    sps.cluster.save(&sps.cluster_path).unwrap();
    sps.release_listeners();
    let key = service_process::launch::key_path(&sps.cluster_path);
    let mut launcher = {
        use std::os::unix::process::CommandExt;
        let mut c = Command::new("mpirun");
        c.args(["--oversubscribe", "--bind-to", "none", "-np", "2"])
            .args(["--map-by", "ppr:2:node"])
            .arg(service_process())
            .args([
                "serve",
                "--sp-id",
                "auto",
                "--hosts-same-kernel",
                "--cluster",
            ])
            .arg(&sps.cluster_path)
            .arg("--key")
            .arg(&key)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .process_group(0);
        c.spawn().expect("cannot run mpirun")
    };
    let stdout = launcher.stdout.take().unwrap();
    let lines = std::thread::spawn(move || {
        use std::io::Read;
        let mut s = String::new();
        let _ = { stdout }.read_to_string(&mut s);
        s
    });
    let ready = run(
        {
            let mut c = Command::new(service_process());
            c.args(["wait-ready", "--timeout-secs", "60", "--cluster"])
                .arg(&sps.cluster_path);
            c
        },
        Duration::from_secs(90),
    );
    let stop = |launcher: &mut std::process::Child| {
        // SAFETY: kill(2) on the process group made for the launcher.
        unsafe { libc::kill(-(launcher.id() as i32), libc::SIGTERM) };
        let t = std::time::Instant::now();
        while launcher.try_wait().unwrap().is_none() {
            if t.elapsed() > Duration::from_secs(20) {
                // SAFETY: as above.
                unsafe { libc::kill(-(launcher.id() as i32), libc::SIGKILL) };
                panic!("the SPs' mpirun did not stop within 20 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    if !ready.ok() {
        stop(&mut launcher);
        panic!(
            "wait-ready failed\n{}\n--- SPs' mpirun\n{}",
            ready.stderr,
            lines.join().unwrap()
        );
    }

    let seed = seed().to_string();
    let cred = bootstrap::auth::JobCredential::issue_new(&sps.key, uid(), 4).encode();
    let mut cmd = mpirun_offloaded(4, &sps.cluster_path, cred);
    cmd.args(["-x", "SPOFF_HOSTS_SAME_KERNEL"])
        .env("SPOFF_HOSTS_SAME_KERNEL", "1")
        .env_remove("SPOFF_HOST_TRANSPORT")
        .arg(artifact("alltoallv_check"))
        .args(["--ops", "40", "--seed", &seed]);
    let job = run(cmd, JOB_TIMEOUT);
    let stats = run(
        {
            let mut c = Command::new(service_process());
            c.args(["stats", "--json", "--cluster"])
                .arg(&sps.cluster_path);
            c
        },
        Duration::from_secs(30),
    );
    stop(&mut launcher);
    let sp_out = lines.join().unwrap();
    job.assert_ok("alltoallv_check on SPs started by mpirun");
    assert!(
        job.stdout.contains("40 ops, 0 mismatches"),
        "{}",
        job.stdout
    );
    stats.assert_ok("service-process stats over TCP");
    let per_sp: Vec<serde_json::Value> = stats
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(per_sp.len(), 2, "{}", stats.stdout);
    for st in &per_sp {
        assert!(
            st["posts"].as_u64().unwrap() > 0,
            "an SP offloaded nothing: {st}"
        );
        assert_eq!(st["completions"], st["posts"], "{st}");
        assert!(st["host_conns_tcp"].as_u64().unwrap() >= 2, "{st}");
        assert_eq!(st["host_conns_unix"], 0, "{st}");
    }
    // Each SP took the id of its local rank, and stopped cleanly on the SIGTERM.
    for sp in 0..2 {
        assert!(sp_out.contains(&format!("READY sp={sp}")), "{sp_out}");
    }
    assert_eq!(sp_out.matches("STATS {").count(), 2, "{sp_out}");
    let left = pids_matching(&sps.cluster_path.display().to_string());
    assert!(left.is_empty(), "SP processes left behind: {left:?}");
}
