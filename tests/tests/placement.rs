//! Placement from MPI, not from the launcher: real SPs started on their own (not by
//! `launch`), MPI jobs started by plain `mpirun` with irregular mappings (3+1 ranks, 1+2+1, a
//! rankfile with interleaved ranks), each rank learning its node at `MPI_Init` from the
//! `SPOFF_NODE` hint of its mpirun app context (every emulated node is this one machine) or
//! from its host name. Every job's results are compared byte for byte with `PMPI_*` by the
//! program itself (`ag_check`, `bcast_check`; `a2a_check` against the pattern), offload is
//! proven by the SPs' counters (each SP posted exactly the eligible calls of the ranks the
//! placement gives it), and each rank's placement is read from its own verbose line.
//!
//! The binaries come from the workspace's target directory (`make test` builds them); `mpicc`
//! and `mpirun` must be installed: a missing one is a failure, never a skip.

use integration_tests::{run, seed, service_process, shim, Finished};
use service_process::launch::{self, Sp, SpSetSpec};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(120);

/// One job at a time (the machine has few cores).
static SERIAL: Mutex<()> = Mutex::new(());

/// `crates/host-shim/tests/progs/<name>.c` built with mpicc (once per test process).
fn prog(name: &str) -> String {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("placement-progs");
    let out = dir.join(name);
    if !built.iter().any(|b| b == name) {
        std::fs::create_dir_all(&dir).unwrap();
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("../crates/host-shim/tests/progs/{name}.c"));
        let tmp = dir.join(format!("{name}.{}", std::process::id()));
        let st = Command::new("mpicc")
            .args(["-O1", "-Wall", "-pthread", "-o"])
            .arg(&tmp)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("cannot run mpicc (install Open MPI: `make deps`): {e}"));
        assert!(st.success(), "mpicc failed on {}", src.display());
        std::fs::rename(&tmp, &out).unwrap();
        built.push(name.to_string());
    }
    out.display().to_string()
}

/// This machine's host name (what `MPI_Get_processor_name` says under Open MPI).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_string()
}

/// Real SPs of `nodes` x `k`, started on their own; `hosts`: the description's host names.
struct Sps {
    dir: PathBuf,
    cluster: PathBuf,
    key: bootstrap::auth::ClusterKey,
    k: u32,
    children: Vec<Sp>,
}

impl Sps {
    fn start(nodes: u32, k: u32, hosts: &[&str]) -> Sps {
        let dir = launch::new_run_dir().unwrap();
        let spec = SpSetSpec {
            nodes,
            sps_per_node: k,
            // Only the emulation layout's default; no rank of these jobs uses it.
            ranks_per_node: 1,
            layout: bootstrap::Layout::Block,
            sp_cpus: None,
            max_inflight_reads: 4,
            extra_args: vec![],
            sp_args: vec![],
        };
        let (cluster, listeners) = launch::write_cluster(&spec, &dir).unwrap();
        let mut c = bootstrap::Cluster::load(&cluster).unwrap();
        c.hosts = hosts.iter().map(|h| h.to_string()).collect();
        c.save(&cluster).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let exe = service_process();
        let mut children: Vec<Sp> = listeners
            .into_iter()
            .enumerate()
            .map(|(i, l)| launch::spawn_sp(&exe, &cluster, i as u32, l, &[], None, tx.clone()))
            .collect::<Result<_, _>>()
            .unwrap();
        let ready = launch::wait_ready(&mut children, &rx, Duration::from_secs(30), None);
        assert!(matches!(ready, Ok(true)), "SPs not ready: {ready:?}");
        let key = bootstrap::auth::ClusterKey::load(&launch::key_path(&cluster)).unwrap();
        Sps {
            dir,
            cluster,
            key,
            k,
            children,
        }
    }

    /// Every SP's counters now, by SP id.
    /// Posts served by all SPs together.
    fn posts(&self) -> u64 {
        self.stats()
            .iter()
            .map(|s| s["posts"].as_u64().unwrap())
            .sum()
    }

    fn stats(&self) -> Vec<serde_json::Value> {
        let c = bootstrap::Cluster::load(&self.cluster).unwrap();
        c.sps
            .iter()
            .map(|sp| {
                service_process::stats::query_within(sp, &self.key, Duration::from_secs(5))
                    .unwrap_or_else(|e| panic!("stats of SP {}: {e:#}", sp.id))
            })
            .collect()
    }

    /// Runs `program` under plain `mpirun` with one app context per `(ranks, SPOFF_NODE)`
    /// entry (no hint: `None`), the shim preloaded, verbose.
    fn mpirun(
        &self,
        contexts: &[(u32, Option<&str>)],
        mpirun_args: &[&str],
        program: &[&str],
    ) -> Finished {
        let world: u32 = contexts.iter().map(|c| c.0).sum();
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        let cred = bootstrap::auth::JobCredential::issue_new(&self.key, uid, world);
        let mut cmd = Command::new("mpirun");
        cmd.arg("--oversubscribe").args(mpirun_args);
        for v in [
            "LD_PRELOAD",
            "SPOFF_CLUSTER",
            "SPOFF_JOB_CREDENTIAL",
            "SPOFF_VERBOSE",
        ] {
            cmd.args(["-x", v]);
        }
        for (i, (n, hint)) in contexts.iter().enumerate() {
            if i > 0 {
                cmd.arg(":");
            }
            cmd.args(["-np", &n.to_string()]);
            if let Some(h) = hint {
                cmd.args(["-x", &format!("SPOFF_NODE={h}")]);
            }
            cmd.args(program);
        }
        cmd.env("LD_PRELOAD", shim())
            .env("SPOFF_CLUSTER", &self.cluster)
            .env("SPOFF_JOB_CREDENTIAL", cred.encode())
            .env("SPOFF_VERBOSE", "1");
        let designs = bootstrap::kinds::KINDS.iter().filter_map(|f| f.design_var);
        for v in [
            "SPOFF_NODE",
            "SPOFF_OFFLOAD",
            "SPOFF_BACKEND",
            "SPOFF_MAILBOX_SLOTS",
            "SPOFF_HOST_COPIES",
        ]
        .into_iter()
        .chain(designs)
        {
            cmd.env_remove(v);
        }
        let run = run(cmd, TIMEOUT);
        eprintln!("{program:?} with contexts {contexts:?}: {:?}", run.elapsed);
        run
    }
}

impl Drop for Sps {
    fn drop(&mut self) {
        launch::stop_sps(&mut self.children, Duration::from_secs(5));
        service_process::access::remove_stale_segments(&self.key);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The placement a node-of-rank map must give: local rank = position among the ranks of the
/// node in world-rank order, SP = node * K + local mod K.
fn expected(nodes_of_ranks: &[u32], k: u32) -> Vec<(u32, u32, u32)> {
    nodes_of_ranks
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            let local = nodes_of_ranks[..r].iter().filter(|&&m| m == n).count() as u32;
            (n, local, n * k + local % k)
        })
        .collect()
}

/// The eligible calls per rank from the program's verdict line.
fn eligible(run: &Finished, prog: &str) -> u64 {
    run.assert_ok(prog);
    let ok = format!("{prog}: all ok (");
    run.stdout
        .lines()
        .find_map(|l| l.strip_prefix(&ok))
        .and_then(|l| l.strip_suffix(" eligible calls per rank)"))
        .and_then(|l| l.rsplit([' ', '(']).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no verdict\n{}\n{}", run.stdout, run.stderr))
}

/// The job passed; every rank says it was placed as `nodes_of_ranks` implies; every SP posted
/// exactly the eligible calls of its ranks and completed them without error.
fn assert_placed_and_offloaded(
    sps: &Sps,
    run: &Finished,
    prog: &str,
    nodes_of_ranks: &[u32],
    placed_by: &str,
) -> Vec<serde_json::Value> {
    let e = eligible(run, prog);
    let want = expected(nodes_of_ranks, sps.k);
    for (r, (node, local, sp)) in want.iter().enumerate() {
        let line = format!("host-shim: rank {r}: offload active: job ");
        let said = run
            .stderr
            .lines()
            .find(|l| l.starts_with(&line))
            .unwrap_or_else(|| panic!("rank {r} did not offload\n{}", run.stderr));
        let placed = format!(", node {node}, local rank {local}, SP {sp} at ");
        assert!(
            said.contains(&placed),
            "rank {r}: want {placed:?}, got {said:?}"
        );
        let by = format!("placed by {placed_by}");
        assert!(said.ends_with(&by), "rank {r}: want {by:?}, got {said:?}");
    }
    let stats = sps.stats();
    let mut total = 0;
    for (id, s) in stats.iter().enumerate() {
        let ranks = want.iter().filter(|w| w.2 as usize == id).count() as u64;
        let n = |f: &str| s[f].as_u64().unwrap_or(u64::MAX);
        assert_eq!(n("posts"), ranks * e, "SP {id} serves {ranks} ranks: {s}");
        assert_eq!(n("completions"), n("posts"), "SP {id}: {s}");
        for f in [
            "copies_failed",
            "errors_sent",
            "hellos_refused",
            "posts_refused",
        ] {
            assert_eq!(n(f), 0, "SP {id} {f}: {s}");
        }
        total += n("posts");
    }
    assert_eq!(total, nodes_of_ranks.len() as u64 * e);
    let nodes_used = {
        let mut v = nodes_of_ranks.to_vec();
        v.sort_unstable();
        v.dedup();
        v.len()
    };
    let inter: u64 = stats
        .iter()
        .map(|s| s["bytes_inter_node"].as_u64().unwrap_or(0))
        .sum();
    if nodes_used > 1 {
        assert!(
            inter > 0,
            "ranks on {nodes_used} nodes, no byte crossed nodes"
        );
    } else {
        assert_eq!(inter, 0, "every rank on one node, yet bytes crossed nodes");
    }
    eprintln!("{prog}: {total} posts, {inter} inter-node bytes");
    stats
}

#[test]
fn three_plus_one_ranks_on_two_nodes() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let sps = Sps::start(2, 1, &[]);
    let s = seed().to_string();
    let ag = prog("ag_check");
    let run = sps.mpirun(
        &[(3, Some("0")), (1, Some("1"))],
        &["--bind-to", "none"],
        &[&ag, "4", &s],
    );
    assert_placed_and_offloaded(&sps, &run, "ag_check", &[0, 0, 0, 1], "SPOFF_NODE");
}

#[test]
fn one_plus_two_plus_one_ranks_on_three_nodes_with_two_sps_each() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = seed().to_string();
    for (name, args) in [
        ("bcast_check", vec!["4", s.as_str()]),
        ("a2a_check", vec!["1"]),
    ] {
        let sps = Sps::start(3, 2, &[]);
        let p = prog(name);
        let mut program = vec![p.as_str()];
        program.extend(&args);
        let run = sps.mpirun(
            &[(1, Some("0")), (2, Some("1")), (1, Some("2"))],
            &["--bind-to", "none"],
            &program,
        );
        assert_placed_and_offloaded(&sps, &run, name, &[0, 1, 1, 2], "SPOFF_NODE");
    }
}

#[test]
fn a_rankfile_with_interleaved_ranks() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Ranks 0..5 on emulated nodes 1, 0, 1, 1, 0: one app context per rank says its node, the
    // rankfile pins each to a slot of this machine (all "nodes" are here).
    let nodes = [1u32, 0, 1, 1, 0];
    let sps = Sps::start(2, 2, &[]);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rankfile = sps.dir.join("rankfile");
    let lines: String = (0..nodes.len())
        .map(|r| format!("rank {r}=localhost slot={}\n", r % cores))
        .collect();
    std::fs::write(&rankfile, lines).unwrap();
    let hints: Vec<String> = nodes.iter().map(u32::to_string).collect();
    let contexts: Vec<(u32, Option<&str>)> = hints.iter().map(|h| (1, Some(h.as_str()))).collect();
    let s = seed().to_string();
    let ag = prog("ag_check");
    let rf = rankfile.display().to_string();
    let run = sps.mpirun(&contexts, &["--rankfile", &rf], &[&ag, "3", &s, "late"]);
    assert_placed_and_offloaded(&sps, &run, "ag_check", &nodes, "SPOFF_NODE");
}

#[test]
fn host_names_place_ranks_without_any_hint() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // A description naming this machine as node 1 (node 0 is another host that runs no rank):
    // plain mpirun, no hint, no layout: the host name decides.
    let me = host_name();
    let sps = Sps::start(2, 2, &["elsewhere-spoff-test", &me]);
    let ag = prog("ag_check");
    let s = seed().to_string();
    let run = sps.mpirun(&[(3, None)], &["--bind-to", "none"], &[&ag, "2", &s]);
    assert_placed_and_offloaded(
        &sps,
        &run,
        "ag_check",
        &[1, 1, 1],
        &format!("host name {me}"),
    );
}

#[test]
fn a_rank_that_cannot_place_itself_sends_every_rank_native() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let a2a = prog("a2a_check");
    // One rank names a node the cluster does not have.
    let sps = Sps::start(2, 1, &[]);
    let run = sps.mpirun(
        &[(2, Some("0")), (1, Some("7"))],
        &["--bind-to", "none"],
        &[&a2a, "1"],
    );
    eligible(&run, "a2a_check");
    // The job's line, with rank 2's reason (broadcast from it), and rank 2's own (verbose).
    assert!(
        run.stderr.contains(
            "offload is off for this job: 1 of 3 ranks could not tell their node (rank 2: \
             SPOFF_NODE=7 is not a node of the cluster description"
        ),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr
            .contains("host-shim: rank 2: SPOFF_NODE=7 is not a node of the cluster description"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("offload active"), "{}", run.stderr);
    assert_eq!(sps.posts(), 0);
    drop(sps);

    // The host names of the description do not include this machine.
    let sps = Sps::start(2, 1, &["elsewhere-a", "elsewhere-b"]);
    let run = sps.mpirun(&[(2, None)], &["--bind-to", "none"], &[&a2a, "1"]);
    eligible(&run, "a2a_check");
    assert!(
        run.stderr
            .contains("is not in the cluster description's hosts (elsewhere-a, elsewhere-b)"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("offload active"), "{}", run.stderr);
    assert_eq!(sps.posts(), 0);
}
