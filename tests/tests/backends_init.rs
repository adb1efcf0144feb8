//! What a rank learns at `MPI_Init` and decides there, before any collective, in real `mpirun`
//! jobs against real SPs (started one by one, as a site's tools would):
//!
//! - a description without `hosts` places ranks by its layout, which only knows one machine:
//!   a job whose ranks' host names differ (each rank here in a UTS namespace of its own, named
//!   from a printed seed) runs natively, with one line for the job that says what is missing;
//!   ranks that share one host name are still placed by the layout and offloaded;
//! - the SP's answer to the registration lists the grant backends it serves the rank: ranks
//!   over TCP from another machine (which grant through `ucx`) at an SP started with
//!   `--ucx=off` run the whole job natively, with one line, instead of failing (or hanging) at
//!   the first collective; ranks that asked for `ucx` (`SPOFF_BACKEND`) at SPs without it take
//!   `cma`, which the SPs serve, and stay offloaded.
//!
//! Every job is `alltoallv_check`, which compares each intercepted call byte for byte with
//! `PMPI_*`, and must end within [`JOB_BOUND`].

#[path = "../../crates/service-process/tests/tcp/mod.rs"]
mod tcp;

use integration_tests::*;
use std::process::Command;
use std::time::Duration;
use tcp::TcpSps;

/// Longest a 4-rank job of 40 operations may take, offloaded or not (it takes seconds).
const JOB_BOUND: Duration = Duration::from_secs(60);
/// When `run` kills a job as hung.
const HANG: Duration = Duration::from_secs(120);
const OPS: &str = "40";

fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// 2 nodes x 1 SP (2 ranks per node, block layout, no `hosts`), SP `i` started with
/// `args[i]`, all ready.
fn sps(args: [&[&str]; 2]) -> TcpSps {
    let mut sps = TcpSps::describe(&service_process(), 2, 1, 2);
    assert!(sps.cluster.hosts.is_empty());
    for (id, a) in args.iter().enumerate() {
        sps.start(id as u32, a);
    }
    let ready = service_process::launch::wait_ready(
        &mut sps.sps,
        &sps.lines,
        Duration::from_secs(30),
        None,
    );
    assert!(matches!(ready, Ok(true)), "SPs not ready: {ready:?}");
    sps
}

/// The environment of a job's ranks: none of the caller's `SPOFF_*` settings leak in.
fn clean(cmd: &mut Command) {
    for v in [
        "SPOFF_NODE",
        "SPOFF_OFFLOAD",
        "SPOFF_BACKEND",
        "SPOFF_HOSTS_SAME_KERNEL",
        "SPOFF_HOST_TRANSPORT",
        "SPOFF_MAILBOX_SLOTS",
    ] {
        cmd.env_remove(v);
    }
    cmd.args(["-x", "SPOFF_VERBOSE"]).env("SPOFF_VERBOSE", "1");
}

/// Runs the job, checks that it ended well within the bound with every result right.
fn finish(cmd: Command, seed: u64, what: &str) -> Finished {
    let job = run(cmd, HANG);
    eprintln!("{what}: {:?}\n{}", job.elapsed, job.stderr);
    job.assert_ok(what);
    assert!(
        job.elapsed < JOB_BOUND,
        "{what}: took {:?} (bound {JOB_BOUND:?})",
        job.elapsed
    );
    assert!(
        job.stdout.contains(&format!("{OPS} ops, 0 mismatches")),
        "seed {seed}: {what}: no clean summary line\n{}",
        job.stdout
    );
    job
}

/// The lines of the shim that contain `needle`.
fn lines<'a>(job: &'a Finished, needle: &str) -> Vec<&'a str> {
    job.stderr.lines().filter(|l| l.contains(needle)).collect()
}

fn posts(stats: &[serde_json::Value]) -> u64 {
    stats.iter().map(|s| s["posts"].as_u64().unwrap()).sum()
}

/// A wrapper that runs each rank in a UTS namespace of its own, named by its world rank's
/// entry in `SPOFF_TEST_HOSTS`, with the shim preloaded only into the program itself.
fn host_wrapper(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("as-host.sh");
    std::fs::write(
        &p,
        "#!/bin/sh\n\
         set -e\n\
         name=$(echo \"$SPOFF_TEST_HOSTS\" | cut -d' ' -f$((OMPI_COMM_WORLD_RANK + 1)))\n\
         exec unshare --uts sh -c 'hostname \"$0\" && exec env LD_PRELOAD=\"$SPOFF_TEST_SHIM\" \"$@\"' \"$name\" \"$@\"\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// 4 ranks, rank r with host name `hosts[r]`, Unix sockets to SPs of a description without
/// `hosts` (placed by its layout).
fn job_with_host_names(sps: &TcpSps, hosts: &[String], seed: u64, what: &str) -> Finished {
    let cred = bootstrap::auth::JobCredential::issue_new(&sps.key, uid(), 4).encode();
    let mut cmd = Command::new("mpirun");
    cmd.args(["--oversubscribe", "--bind-to", "none", "-np", "4"]);
    clean(&mut cmd);
    for (k, v) in [
        ("SPOFF_CLUSTER", sps.cluster_path.display().to_string()),
        ("SPOFF_JOB_CREDENTIAL", cred),
        ("SPOFF_HOST_TRANSPORT", "unix".to_string()),
        ("SPOFF_TEST_HOSTS", hosts.join(" ")),
        ("SPOFF_TEST_SHIM", shim().display().to_string()),
    ] {
        cmd.args(["-x", k]).env(k, v);
    }
    cmd.env_remove("LD_PRELOAD")
        .arg(host_wrapper(&sps.run_dir))
        .arg(artifact("alltoallv_check"))
        .args(["--ops", OPS, "--seed", &seed.to_string()]);
    finish(cmd, seed, what)
}

/// Issue 25: a multi-host job with a description without `hosts` was placed by block layout
/// silently (a rank was served by another node's DPU). Ranks whose host names differ now run
/// natively, said once for the job; ranks of one host name are placed by the layout as before.
#[test]
fn mpi_layout_placement_of_ranks_on_several_hosts_is_refused_once() {
    let seed = seed();
    let mut rng = Rng(seed);
    let mut sps = sps([&[], &[]]);
    let tag = rng.below(1_000_000);

    // One host name for every rank (one machine, the emulated cluster): the layout places
    // them and the job is offloaded.
    let one = vec![format!("spoff-one-{tag}"); 4];
    let job = job_with_host_names(&sps, &one, seed, "one host name");
    for r in 0..4 {
        let line = lines(&job, &format!("rank {r}: offload active"));
        assert_eq!(line.len(), 1, "rank {r} not offloaded\n{}", job.stderr);
        assert!(
            line[0].contains("placed by the description's layout"),
            "{}",
            line[0]
        );
    }
    assert!(lines(&job, "offload is off").is_empty(), "{}", job.stderr);

    // Ranks on 2 or 3 host names, in a random order (at least two differ).
    let n = 2 + rng.below(2);
    let mut hosts: Vec<String> = (0..4)
        .map(|_| format!("spoff-h{}-{tag}", rng.below(n)))
        .collect();
    if hosts.iter().all(|h| *h == hosts[0]) {
        let i = 1 + rng.below(3) as usize;
        hosts[i] = format!("spoff-hx-{tag}");
    }
    eprintln!("host names of ranks 0..3: {hosts:?}");
    let job = job_with_host_names(&sps, &hosts, seed, "several host names");
    let said = lines(&job, "offload is off for this job");
    assert_eq!(said.len(), 1, "not said once for the job\n{}", job.stderr);
    let first_other = hosts.iter().position(|h| *h != hosts[0]).unwrap();
    for part in [
        "the cluster description names no hosts".to_string(),
        format!("world ranks 0 and {first_other} run on two hosts"),
        "list the nodes' host names in the description's hosts (or give each rank SPOFF_NODE)"
            .to_string(),
        "running natively".to_string(),
    ] {
        assert!(said[0].contains(&part), "{:?} lacks {part:?}", said[0]);
    }
    assert!(lines(&job, "offload active").is_empty(), "{}", job.stderr);
    let stats = sps.stop_and_stats();
    // Only the first job posted anything.
    assert!(posts(&stats) > 0, "{stats:?}");
    for st in &stats {
        assert_eq!(st["errors_sent"], 0, "{st}");
    }
}

/// 4 ranks over TCP to `sps` with the shim, `env` exported to them.
fn job_over_tcp(sps: &TcpSps, env: &[(&str, &str)], seed: u64, what: &str) -> Finished {
    let cred = bootstrap::auth::JobCredential::issue_new(&sps.key, uid(), 4).encode();
    let mut cmd = mpirun_offloaded(4, &sps.cluster_path, cred);
    clean(&mut cmd);
    for (k, v) in env {
        cmd.args(["-x", k]).env(k, v);
    }
    cmd.arg(artifact("alltoallv_check"))
        .args(["--ops", OPS, "--seed", &seed.to_string()]);
    finish(cmd, seed, what)
}

/// Issue 25: an SP started with `--ucx=off` and ranks that reach it over TCP from another
/// machine (they grant through ucx): the first collective was refused and the job aborted (or,
/// under plain mpirun, hung). Now the ranks learn at `MPI_Init` what their SP serves and the
/// whole job runs natively, said once. One SP or both without UCX, at random.
#[test]
fn mpi_ranks_over_tcp_at_an_sp_without_ucx_run_natively_said_once() {
    let seed = seed();
    let mut rng = Rng(seed);
    // Which SPs run without UCX: 1 (SP 0), 2 (SP 1) or 3 (both).
    let off = 1 + rng.below(3);
    let arg = |sp: u64| -> &[&str] {
        if off & (1 << sp) != 0 {
            &["--ucx=off"]
        } else {
            &["--ucx=on"]
        }
    };
    eprintln!("SPs without UCX (bits): {off}");
    let mut sps = sps([arg(0), arg(1)]);
    let job = job_over_tcp(&sps, &[], seed, "ucx-less SPs over TCP");
    let said = lines(&job, "offload is off for this job");
    assert_eq!(said.len(), 1, "not said once for the job\n{}", job.stderr);
    // The lowest rank at an SP without UCX says it: rank 0 at SP 0, else rank 2 at SP 1.
    let (rank, sp) = if off & 1 != 0 { (0, 0) } else { (2, 1) };
    let addr = sps.host_addr(sp);
    for part in [
        format!("world rank {rank}: SP {sp} at tcp:{addr} does not serve ucx grants"),
        "UCX is off on it: see serve --ucx".into(),
        "serves this rank no grant backend".into(),
        "over TCP from another machine grants memory through ucx".into(),
        "running natively".into(),
    ] {
        assert!(said[0].contains(&part), "{:?} lacks {part:?}", said[0]);
    }
    assert!(lines(&job, "offload active").is_empty(), "{}", job.stderr);
    let stats = sps.stop_and_stats();
    assert_eq!(posts(&stats), 0, "{stats:?}");
    for st in &stats {
        assert_eq!(st["errors_sent"], 0, "{st}");
        assert!(st["host_conns_tcp"].as_u64().unwrap() >= 2, "{st}");
    }
}

/// `SPOFF_BACKEND=ucx` at SPs without UCX: the ranks learn at `MPI_Init` that their SPs serve
/// only `cma` and grant through it (said once for the job), offloaded, instead of the first
/// collective being refused.
#[test]
fn mpi_asked_ucx_at_sps_without_it_takes_cma_said_once() {
    let seed = seed();
    let mut sps = sps([&["--ucx=off"], &["--ucx=off"]]);
    let job = job_over_tcp(
        &sps,
        &[("SPOFF_BACKEND", "ucx"), ("SPOFF_HOST_TRANSPORT", "unix")],
        seed,
        "SPOFF_BACKEND=ucx, SPs without UCX",
    );
    let said = lines(&job, "SPOFF_BACKEND=ucx:");
    assert_eq!(said.len(), 1, "not said once for the job\n{}", job.stderr);
    for part in [
        "SP 0 at ",
        "does not serve ucx grants (UCX is off on it: see serve --ucx)",
        "it serves this rank cma",
        "grant through cma",
    ] {
        assert!(said[0].contains(part), "{:?} lacks {part:?}", said[0]);
    }
    for r in 0..4 {
        assert_eq!(
            lines(&job, &format!("rank {r}: offload active")).len(),
            1,
            "rank {r} not offloaded\n{}",
            job.stderr
        );
    }
    assert!(lines(&job, "ucx grants, memory events").is_empty());
    let stats = sps.stop_and_stats();
    assert!(posts(&stats) > 0, "{stats:?}");
    for st in &stats {
        assert_eq!(st["errors_sent"], 0, "{st}");
        assert_eq!(st["completions"], st["posts"], "{st}");
    }
}

/// `SPOFF_BACKEND=ucx` where one SP of the job serves ucx and the other does not: the ranks of
/// the first grant through ucx, which the second could not reach when it copies for its own
/// ranks. The whole job runs natively, said once by the lowest rank at the SP without UCX.
#[test]
fn mpi_ucx_grants_and_an_sp_of_the_job_without_ucx_run_natively_said_once() {
    let seed = seed();
    let mut sps = sps([&["--ucx=on"], &["--ucx=off"]]);
    let job = job_over_tcp(
        &sps,
        &[("SPOFF_BACKEND", "ucx"), ("SPOFF_HOST_TRANSPORT", "unix")],
        seed,
        "SPOFF_BACKEND=ucx, one SP without UCX",
    );
    let said = lines(&job, "offload is off for this job");
    assert_eq!(said.len(), 1, "not said once for the job\n{}", job.stderr);
    for part in [
        "ranks grant memory through ucx, which SP 1 (world rank 2's, at ",
        "does not serve (UCX is off on it: see serve --ucx); running natively",
    ] {
        assert!(said[0].contains(part), "{:?} lacks {part:?}", said[0]);
    }
    assert!(
        lines(&job, "SPOFF_BACKEND=ucx:").is_empty(),
        "{}",
        job.stderr
    );
    assert!(lines(&job, "offload active").is_empty(), "{}", job.stderr);
    let stats = sps.stop_and_stats();
    assert_eq!(posts(&stats), 0, "{stats:?}");
    for st in &stats {
        assert_eq!(st["errors_sent"], 0, "{st}");
    }
}
