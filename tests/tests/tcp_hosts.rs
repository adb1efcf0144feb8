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
