//! What the shim says to users, in real `mpirun` jobs: once per job, never once per rank, and
//! never nothing.
//!
//! - A job with the shim preloaded but `SPOFF_CLUSTER` or `SPOFF_JOB_CREDENTIAL` missing on
//!   every rank says so in one line (naming what is missing) and runs natively; with
//!   `SPOFF_OFFLOAD=0` it says nothing.
//! - Ranks that cannot use their SP (none listening, or a real SP refusing their credential):
//!   one job-wide line, "N of M ranks ...", with the first one's reason; per-rank detail only
//!   with `SPOFF_VERBOSE=1`.
//! - The README's example for SPs started another way runs offloaded as written (real SPs
//!   started with `service-process serve`, the README's own command line run by `sh`).
//! - A job whose app contexts do not all preload the shim (Open MPI's `-x NAME=value` is per
//!   app context) ends within a bound with one line saying what is wrong (aborted: it cannot
//!   run natively either, see `lifecycle::every_rank_runs_the_shim`), instead of hanging
//!   silently.

mod common;

use bootstrap::auth::{ClusterKey, JobCredential};
use bootstrap::cluster::{Cluster, Layout, SpEntry};
use common::*;
use integration_tests::{run, seed, service_process, shim, Finished, Rng};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A job that hangs is one that takes longer than this.
const BOUND: Duration = Duration::from_secs(60);

fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

fn count(lines: &[&str], needle: &str) -> usize {
    lines.iter().filter(|l| l.contains(needle)).count()
}

fn all(run: &Finished) -> String {
    format!("--- stdout\n{}\n--- stderr\n{}", run.stdout, run.stderr)
}

/// What a job has set, what its line must name, what it must not name.
type Case<'a> = (Vec<(&'a str, &'a str)>, &'a [&'a str], &'a [&'a str]);

#[test]
fn preloaded_shim_without_cluster_or_credential_says_so_once_per_job() {
    let _serial = serial();
    let prog = prog("a2a_check");
    let mut rng = Rng(seed());
    let cluster = std::env::temp_dir().join("spoff-notices-cluster.json");
    let cluster = cluster.to_str().unwrap();
    let cred = some_credential();
    let mut cases: Vec<Case> = vec![
        (vec![], &["SPOFF_CLUSTER", "SPOFF_JOB_CREDENTIAL"], &[]),
        (
            vec![("SPOFF_CLUSTER", cluster)],
            &["SPOFF_JOB_CREDENTIAL"],
            &["SPOFF_CLUSTER "],
        ),
        (
            vec![("SPOFF_JOB_CREDENTIAL", &cred)],
            &["SPOFF_CLUSTER"],
            &["SPOFF_JOB_CREDENTIAL "],
        ),
    ];
    for (env, names, not) in cases.iter_mut() {
        // Verbose or not, the job says it once (rank 0), not once per rank.
        let verbose = rng.below(2) == 1;
        if verbose {
            env.push(("SPOFF_VERBOSE", "1"));
        }
        let run = mpirun_preloaded_within(&[&prog, "1"], env, BOUND);
        verdict(&run, "a2a_check");
        let lines = shim_lines(&run.stderr);
        eprintln!("{env:?}: {lines:?}");
        assert_eq!(lines.len(), 1, "one line per job\n{}", all(&run));
        let line = lines[0];
        assert!(
            line.contains("offload is off for this job: ")
                && line.contains(&format!("on none of its {NP} ranks"))
                && line.contains("running natively"),
            "{}",
            all(&run)
        );
        for n in names.iter() {
            assert!(line.contains(n), "the line must name {n}\n{}", all(&run));
        }
        for n in not.iter() {
            assert!(!line.contains(n), "{n} was set\n{}", all(&run));
        }
    }
    // Deliberately off: not a word.
    let run = mpirun_preloaded_within(&[&prog, "1"], &[("SPOFF_OFFLOAD", "0")], BOUND);
    verdict(&run, "a2a_check");
    assert!(shim_lines(&run.stderr).is_empty(), "{}", all(&run));
    // Except about a bound that is not a number (once, from rank 0).
    let run = mpirun_preloaded_within(
        &[&prog, "1"],
        &[("SPOFF_OFFLOAD", "0"), ("SPOFF_INIT_TIMEOUT_MS", "10s")],
        BOUND,
    );
    verdict(&run, "a2a_check");
    assert_eq!(
        shim_lines(&run.stderr),
        ["host-shim: SPOFF_INIT_TIMEOUT_MS=10s is not a number of milliseconds; using 10000"],
        "{}",
        all(&run)
    );
}

#[test]
fn ranks_without_a_service_process_are_reported_in_one_job_wide_line() {
    let _serial = serial();
    let prog = prog("a2a_check");
    let dir = std::env::temp_dir().join(format!("spoff-notices-nosp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sps = (0..2)
        .map(|i| SpEntry {
            id: i,
            node: i,
            index: 0,
            peer_addr: "127.0.0.1:9".parse().unwrap(),
            host_socket: dir.join(format!("absent-{i}.sock")),
            host_addr: None,
        })
        .collect();
    let cluster: PathBuf = dir.join("cluster.json");
    Cluster::new(2, 1, None, Layout::Block, sps)
        .unwrap()
        .save(&cluster)
        .unwrap();
    let cred = some_credential();
    for verbose in ["0", "1"] {
        let run = mpirun_preloaded_within(
            &[&prog, "1"],
            &[
                ("SPOFF_CLUSTER", cluster.to_str().unwrap()),
                ("SPOFF_JOB_CREDENTIAL", &cred),
                ("SPOFF_VERBOSE", verbose),
            ],
            BOUND,
        );
        verdict(&run, "a2a_check");
        let lines = shim_lines(&run.stderr);
        eprintln!("SPOFF_VERBOSE={verbose}: {lines:?}");
        let job = format!(
            "offload is off for this job: {NP} of {NP} ranks could not use their service \
             process (rank 0: no service process reachable at {}",
            dir.join("absent-0.sock").display()
        );
        assert_eq!(count(&lines, &job), 1, "{}", all(&run));
        let per_rank = count(&lines, ": no service process reachable at ");
        if verbose == "1" {
            // The job's line, and each rank's own detail.
            assert_eq!(lines.len(), 1 + NP as usize, "{}", all(&run));
            assert_eq!(per_rank, 1 + NP as usize, "{}", all(&run));
            for r in 0..NP {
                let mine = format!("host-shim: rank {r}: no service process reachable at ");
                assert_eq!(count(&lines, &mine), 1, "rank {r}\n{}", all(&run));
            }
        } else {
            assert_eq!(lines.len(), 1, "one line per job\n{}", all(&run));
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Real SPs of 2 nodes x 1, started with `service-process serve` from a description and a key
/// of their own (as a site's tools would), stopped with SIGTERM on drop.
struct Served {
    dir: PathBuf,
    cluster: PathBuf,
    key: PathBuf,
    children: Vec<Child>,
}

impl Served {
    fn start() -> Served {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("spoff-notices-sps-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("cluster.key");
        ClusterKey::create(&key).unwrap();
        let sps = (0..2)
            .map(|i| {
                // A free port now (the SP binds it a moment later).
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                SpEntry::numbered(
                    i,
                    1,
                    l.local_addr().unwrap(),
                    dir.join(format!("sp-{i}.sock")),
                )
            })
            .collect();
        let cluster = dir.join("cluster.json");
        Cluster::new(2, 1, None, Layout::Block, sps)
            .unwrap()
            .save(&cluster)
            .unwrap();
        let children = (0..2)
            .map(|i| {
                Command::new(service_process())
                    .arg("serve")
                    .arg("--cluster")
                    .arg(&cluster)
                    .arg("--key")
                    .arg(&key)
                    .args(["--sp-id", &i.to_string()])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let served = Served {
            dir,
            cluster,
            key,
            children,
        };
        let mut wait = Command::new(service_process());
        wait.arg("wait-ready")
            .arg("--cluster")
            .arg(&served.cluster)
            .arg("--key")
            .arg(&served.key)
            .args(["--timeout-secs", "30"]);
        run(wait, BOUND).assert_ok("wait-ready");
        served
    }

    fn credential(&self, world: u32) -> String {
        let key = ClusterKey::load(&self.key).unwrap();
        JobCredential::issue_new(&key, uid(), world).encode()
    }

    /// Posts served by both SPs so far.
    fn posts(&self) -> u64 {
        let mut cmd = Command::new(service_process());
        cmd.arg("stats")
            .arg("--cluster")
            .arg(&self.cluster)
            .arg("--key")
            .arg(&self.key)
            .arg("--json");
        let out = run(cmd, BOUND);
        out.assert_ok("stats");
        out.stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .map(|v| v["posts"].as_u64().unwrap())
            .sum()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        for c in &mut self.children {
            // SAFETY: kill(2) of a child we started and have not reaped.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        for c in &mut self.children {
            let _ = c.wait();
        }
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// An MPMD command line of the test's MPI: one app context per entry `(ranks, env)`, each
/// running `program` with its own `env` (`-x K=V` under Open MPI, `-env K V` under Hydra),
/// and `global` passed by name to every context from the launcher's environment.
fn mpmd(
    global: &[(&str, String)],
    contexts: &[(u32, Vec<(&str, String)>)],
    program: &[&str],
) -> Command {
    let mut cmd = match mpi() {
        Mpi::OpenMpi => {
            let mut c = Command::new("mpirun");
            c.args(["--oversubscribe", "--bind-to", "none"]);
            for (k, _) in global {
                c.args(["-x", k]);
            }
            c
        }
        Mpi::Mpich => {
            let mut c = Command::new("mpiexec.mpich");
            c.args(["-bind-to", "none"]);
            if !global.is_empty() {
                let names: Vec<&str> = global.iter().map(|(k, _)| *k).collect();
                c.arg("-genvlist").arg(names.join(","));
            }
            c
        }
    };
    for (i, (n, env)) in contexts.iter().enumerate() {
        if i > 0 {
            cmd.arg(":");
        }
        cmd.args(["-np", &n.to_string()]);
        for (k, v) in env {
            match mpi() {
                Mpi::OpenMpi => cmd.arg("-x").arg(format!("{k}={v}")),
                Mpi::Mpich => cmd.args(["-env", k, v]),
            };
        }
        cmd.args(program);
    }
    let mut cmd = with_env(cmd, &[]);
    cmd.env_remove("SPOFF_NODE").env_remove("LD_PRELOAD");
    for (k, v) in global {
        cmd.env(k, v);
    }
    cmd
}

#[test]
fn ranks_refused_by_their_sp_are_reported_in_one_job_wide_line() {
    let _serial = serial();
    let prog = prog("a2a_check");
    let mut rng = Rng(seed());
    let sps = Served::start();
    let good = sps.credential(NP as u32);
    // The same job, but MACed with another key: the real SP refuses it.
    let job = JobCredential::decode(&good).unwrap().job;
    let forged = JobCredential::issue(&ClusterKey::generate(), job, uid(), NP as u32).encode();
    // Which node's two ranks present the forged credential.
    let bad = rng.below(2) as u32;
    for verbose in ["0", "1"] {
        let contexts: Vec<(u32, Vec<(&str, String)>)> = (0..2)
            .map(|node| {
                let cred = if node == bad { &forged } else { &good };
                (
                    2,
                    vec![
                        ("SPOFF_NODE", node.to_string()),
                        ("SPOFF_JOB_CREDENTIAL", cred.clone()),
                    ],
                )
            })
            .collect();
        let global = vec![
            ("LD_PRELOAD", mpi_shim().display().to_string()),
            ("SPOFF_CLUSTER", sps.cluster.display().to_string()),
            ("SPOFF_VERBOSE", verbose.to_string()),
        ];
        let run = run(mpmd(&global, &contexts, &[&prog, "1"]), BOUND);
        verdict(&run, "a2a_check");
        let lines = shim_lines(&run.stderr);
        eprintln!("forged on node {bad}, SPOFF_VERBOSE={verbose}: {lines:?}");
        let first = 2 * bad;
        let job = format!(
            "offload is off for this job: 2 of {NP} ranks could not use their service process \
             (rank {first}: service process at {} refused this rank: ",
            sps.dir.join(format!("sp-{bad}.sock")).display()
        );
        assert_eq!(count(&lines, &job), 1, "{}", all(&run));
        assert!(lines.iter().any(|l| l.ends_with("; running natively")));
        if verbose == "1" {
            for r in [first, first + 1] {
                let mine = format!("host-shim: rank {r}: service process at ");
                assert_eq!(count(&lines, &mine), 1, "rank {r}\n{}", all(&run));
            }
            assert_eq!(count(&lines, "refused this rank"), 3, "{}", all(&run));
            assert_eq!(count(&lines, "offload active"), 0, "{}", all(&run));
        } else {
            assert_eq!(lines.len(), 1, "one line per job\n{}", all(&run));
        }
    }
    assert_eq!(sps.posts(), 0, "the job ran natively");
}

/// The README's command for SPs started another way, exactly as written there.
fn readme_example() -> String {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
            .unwrap();
    let after = readme
        .split_once("another way (`service-process serve`):")
        .expect("the README's example for SPs started another way")
        .1;
    let block = after
        .split_once("```sh\n")
        .and_then(|(_, b)| b.split_once("```"))
        .expect("a sh block after it")
        .0;
    block.to_string()
}

#[test]
fn readme_example_for_sps_started_another_way_runs_offloaded() {
    // The example is Open MPI's command line, whatever MPI the other tests of the file use:
    // its program is built with Open MPI's mpicc here.
    let _serial = serial();
    let example = readme_example();
    eprintln!("README:\n{example}");
    let sps = Served::start();
    // The README's working directory: target/release/libhost_shim.so, cluster.json, ./prog.
    let cwd = sps.dir.join("cwd");
    std::fs::create_dir_all(cwd.join("target/release")).unwrap();
    std::os::unix::fs::symlink(shim(), cwd.join("target/release/libhost_shim.so")).unwrap();
    std::os::unix::fs::symlink(&sps.cluster, cwd.join("cluster.json")).unwrap();
    let bin = sps.dir.join("a2a_check");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/progs/a2a_check.c");
    let st = Command::new("mpicc")
        .args(["-O1", "-Wall", "-pthread", "-o"])
        .arg(&bin)
        .arg(&src)
        .status()
        .expect("mpicc (Open MPI)");
    assert!(st.success());
    std::os::unix::fs::symlink(&bin, cwd.join("prog")).unwrap();
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(&example).current_dir(&cwd);
    let mut cmd = with_env(cmd, &[]);
    cmd.env_remove("LD_PRELOAD")
        .env_remove("SPOFF_NODE")
        .env("PWD", &cwd)
        .env("SPOFF_JOB_CREDENTIAL", sps.credential(4))
        // 4 ranks on however many cores, as the tests' own mpirun lines say it.
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("OMPI_MCA_hwloc_base_binding_policy", "none");
    let run = run(cmd, BOUND);
    eprintln!("README example: {:?}\n{}", run.elapsed, run.stderr);
    let eligible = verdict(&run, "a2a_check");
    assert!(shim_lines(&run.stderr).is_empty(), "{}", all(&run));
    assert_eq!(
        sps.posts(),
        4 * eligible,
        "every rank of both app contexts offloaded every eligible call\n{}",
        all(&run)
    );
}

#[test]
fn a_job_with_the_shim_in_some_app_contexts_only_says_so_and_ends() {
    let _serial = serial();
    let prog = prog("a2a_check");
    let mut rng = Rng(seed());
    let sps = Served::start();
    // 1+3, 2+2 or 3+1 ranks; the shim in the first context or in the second.
    let first = 1 + rng.below(3) as u32;
    let with_shim = rng.below(2) as usize;
    let sizes = [first, NP as u32 - first];
    let contexts: Vec<(u32, Vec<(&str, String)>)> = (0..2)
        .map(|i| {
            let mut env = vec![("SPOFF_NODE", i.to_string())];
            if i == with_shim {
                env.push(("LD_PRELOAD", mpi_shim().display().to_string()));
            }
            (sizes[i], env)
        })
        .collect();
    let global = vec![
        ("SPOFF_CLUSTER", sps.cluster.display().to_string()),
        ("SPOFF_JOB_CREDENTIAL", sps.credential(NP as u32)),
    ];
    let run = run(mpmd(&global, &contexts, &[&prog, "1"]), BOUND);
    eprintln!(
        "contexts {sizes:?}, shim in context {with_shim}: {} after {:?}\n{}",
        run.status, run.elapsed, run.stderr
    );
    // Ended by the shim's ranks (within the start-up bound of 10 s and mpirun's teardown),
    // with a failure status: the job could not run natively either.
    assert!(!run.ok(), "{}", all(&run));
    assert!(run.elapsed < Duration::from_secs(40), "{:?}", run.elapsed);
    assert!(
        !run.stdout.contains("a2a_check: all ok"),
        "the program did not run past MPI_Init\n{}",
        all(&run)
    );
    let lines = shim_lines(&run.stderr);
    let said = format!(
        "host-shim: not all of this job's {NP} ranks reached the shim's start-up within 10 s: \
         is the shim preloaded in every app context?"
    );
    // Open MPI tells each rank its app context: the context's first rank says it. Hydra does
    // not: each rank with the shim says it, unless the first one's MPI_Abort ended it before.
    let expect = match mpi() {
        Mpi::OpenMpi => 1..=1,
        Mpi::Mpich => 1..=sizes[with_shim] as usize,
    };
    assert!(
        expect.contains(&count(&lines, &said)),
        "{expect:?} lines\n{}",
        all(&run)
    );
    assert_eq!(lines.len(), count(&lines, &said), "{}", all(&run));
    assert!(lines.iter().all(|l| l.contains("aborting the job")));
    assert_eq!(sps.posts(), 0, "no rank reached an SP");

    // The bound is SPOFF_INIT_TIMEOUT_MS.
    let mut global = global;
    global.push(("SPOFF_INIT_TIMEOUT_MS", "2500".to_string()));
    let run = integration_tests::run(mpmd(&global, &contexts, &[&prog, "1"]), BOUND);
    eprintln!("with a 2.5 s bound: {} after {:?}", run.status, run.elapsed);
    assert!(!run.ok(), "{}", all(&run));
    assert!(run.elapsed < Duration::from_secs(10), "{:?}", run.elapsed);
    assert!(
        shim_lines(&run.stderr)
            .iter()
            .any(|l| l.contains("start-up within 2.5 s: is the shim preloaded")),
        "{}",
        all(&run)
    );
}
