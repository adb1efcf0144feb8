//! An SP that lives for many jobs, and one that is stopped: real SPs (`service-process serve`)
//! whose ranks reach them over TCP with `ucx` grants (as from another machine: the SPs make UCX
//! endpoints to every rank they copy from or to), real `mpirun` jobs one after the other, and
//! SPs stopped by SIGTERM, directly and through the `mpirun` that started them.

#[path = "../../crates/service-process/tests/tcp/mod.rs"]
mod tcp;

use integration_tests::*;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tcp::TcpSps;

const JOB_TIMEOUT: Duration = Duration::from_secs(60);

fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// SPs of a [`TcpSps`] description started by hand (`serve --sp-id N`), their stderr in a
/// file each and their stdout lines on a channel.
struct Served {
    sps: TcpSps,
    children: Vec<Child>,
    stderr: Vec<PathBuf>,
    lines: mpsc::Receiver<(u32, String)>,
    /// Every stdout line of every SP read so far, by SP id (UCX logs to stdout).
    stdout: Vec<String>,
}

impl Served {
    fn start(nodes: u32, k: u32, ranks_per_node: u32, args: &[&str]) -> Served {
        let mut sps = TcpSps::describe(&service_process(), nodes, k, ranks_per_node);
        sps.release_listeners();
        let (tx, lines) = mpsc::channel();
        let mut children = vec![];
        let mut stderr = vec![];
        for id in 0..nodes * k {
            let path = sps.run_dir.join(format!("sp-{id}.stderr"));
            let mut c = sps.serve_cmd();
            c.args(["--sp-id", &id.to_string()])
                .args(args)
                .stderr(std::fs::File::create(&path).unwrap());
            let mut child = c.spawn().expect("starting an SP");
            let out = child.stdout.take().unwrap();
            let tx = tx.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(out).lines().map_while(Result::ok) {
                    if tx.send((id, l)).is_err() {
                        return;
                    }
                }
            });
            children.push(child);
            stderr.push(path);
        }
        // Made before the wait: if the SPs never get ready the test fails, and its drop still
        // kills them (they were left running otherwise).
        let served = Served {
            sps,
            children,
            stdout: vec![String::new(); stderr.len()],
            stderr,
            lines,
        };
        wait_ready(&served.sps.cluster_path, nodes * k);
        served
    }

    /// SIGTERM to every SP; waits (bounded) for each to exit; the counters each printed.
    fn stop(&mut self) -> Vec<serde_json::Value> {
        for c in &self.children {
            // SAFETY: kill(2) with a pid of our child and a signal number.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        let t = Instant::now();
        for c in &mut self.children {
            while c.try_wait().unwrap().is_none() {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "an SP did not stop within 10 s of SIGTERM"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let mut stats = vec![serde_json::Value::Null; self.children.len()];
        while let Ok((id, line)) = self.lines.recv_timeout(Duration::from_millis(300)) {
            if let Some(json) = line.strip_prefix("STATS ") {
                stats[id as usize] = serde_json::from_str(json).unwrap();
            }
            self.stdout[id as usize] += &line;
            self.stdout[id as usize].push('\n');
        }
        stats
    }

    /// What SP `sp` printed on stdout (read so far) and stderr.
    fn output_of(&self, sp: usize) -> String {
        std::fs::read_to_string(&self.stderr[sp]).unwrap_or_default() + &self.stdout[sp]
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        for c in &mut self.children {
            if c.try_wait().ok().flatten().is_none() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn wait_ready(cluster: &Path, n: u32) {
    let ready = run(
        {
            let mut c = Command::new(service_process());
            c.args(["wait-ready", "--timeout-secs", "30", "--cluster"])
                .arg(cluster);
            c
        },
        Duration::from_secs(60),
    );
    ready.assert_ok("service-process wait-ready");
    assert!(
        ready.stdout.contains(&format!("ready: all {n} SPs answer")),
        "{}",
        ready.stdout
    );
}

/// Every SP's counters now (`service-process stats --json`), by SP id.
fn stats_now(cluster: &Path) -> Vec<serde_json::Value> {
    let out = run(
        {
            let mut c = Command::new(service_process());
            c.args(["stats", "--json", "--cluster"]).arg(cluster);
            c
        },
        Duration::from_secs(30),
    );
    out.assert_ok("service-process stats");
    out.stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// UCX's own error and warning lines (`[time] [host:pid:tid] file:line UCX  ERROR ...`).
fn ucx_complaints(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains("UCX") && (l.contains(" ERROR ") || l.contains(" WARN ")))
        .collect()
}

/// One tiny job of 2 ranks (one per node) over TCP with ucx grants: the SPs make UCX endpoints
/// to both ranks.
fn tiny_job(sps: &TcpSps, seed: u64) -> Finished {
    let cred = bootstrap::auth::JobCredential::issue_new(&sps.key, uid(), 2).encode();
    let mut cmd = mpirun_offloaded(2, &sps.cluster_path, cred);
    cmd.env_remove("SPOFF_BACKEND")
        .env_remove("SPOFF_HOSTS_SAME_KERNEL")
        .env_remove("SPOFF_HOST_TRANSPORT")
        .arg(artifact("alltoallv_check"))
        .args([
            "--ops",
            "4",
            "--max-count",
            "256",
            "--seed",
            &seed.to_string(),
        ]);
    run(cmd, JOB_TIMEOUT)
}

/// Fifty short jobs against the same two SPs: the endpoints each SP made to a job's ranks are
/// closed when the job ends (the counters say every endpoint opened was closed, none is open),
/// and no SP's stderr holds a line of UCX's errors or warnings (before, every job left its
/// endpoints behind, and UCX logged "Endpoint timeout ... will not be handled since no error
/// callback is installed" for each once the ranks were gone).
#[test]
fn fifty_jobs_close_their_endpoints_and_leave_no_ucx_error() {
    let jobs: u32 = 50;
    let seed = seed();
    let mut served = Served::start(2, 1, 1, &["--ucx=on"]);
    let t = Instant::now();
    for j in 0..jobs {
        let job = tiny_job(&served.sps, seed + j as u64);
        job.assert_ok(&format!("job {j}"));
        assert!(
            job.stdout.contains("4 ops, 0 mismatches"),
            "job {j} (seed {}): {}",
            seed + j as u64,
            job.stdout
        );
        let complaints = ucx_complaints(&job.stderr);
        assert!(
            complaints.is_empty(),
            "job {j}: UCX complained in the ranks\n{}",
            complaints.join("\n")
        );
    }
    eprintln!("{jobs} jobs in {:?}", t.elapsed());
    // The last job's endpoints are closed as soon as its ranks have left (bounded wait).
    let t = Instant::now();
    let now = loop {
        let now = stats_now(&served.sps.cluster_path);
        let all_closed = now.iter().all(|st| {
            st["ucx_endpoints_open"] == 0 && st["ucx_endpoints_opened"].as_u64() > Some(0)
        });
        if all_closed || t.elapsed() > Duration::from_secs(5) {
            break now;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // Each job's end left a snapshot of the counters next to the socket (what an SP killed
    // outright leaves behind).
    for (sp, e) in served.sps.cluster.sps.iter().enumerate() {
        let snap = service_process::stopped::read(&e.host_socket)
            .unwrap_or_else(|| panic!("SP {sp} kept no counters next to its socket"));
        assert!(snap["as_of_unix"].as_u64().is_some(), "SP {sp}: {snap}");
        assert!(snap["posts"].as_u64() > Some(0), "SP {sp}: {snap}");
    }
    let stats = served.stop();
    for (sp, st) in now.iter().enumerate() {
        eprintln!(
            "SP {sp}: ucx endpoints opened {} closed {} open {} errors handled {} closes \
             unfinished {}",
            st["ucx_endpoints_opened"],
            st["ucx_endpoints_closed"],
            st["ucx_endpoints_open"],
            st["ucx_endpoint_errors"],
            st["ucx_endpoint_closes_unfinished"]
        );
    }
    for sp in 0..2 {
        let log = served.output_of(sp);
        let complaints = ucx_complaints(&log);
        assert!(
            complaints.is_empty(),
            "SP {sp}: {} lines of UCX errors or warnings after {jobs} jobs, e.g.\n{}",
            complaints.len(),
            complaints
                .iter()
                .take(5)
                .copied()
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    for (sp, (st, now)) in stats.iter().zip(&now).enumerate() {
        assert!(!st.is_null(), "SP {sp} printed no counters");
        assert!(st["posts"].as_u64().unwrap() > 0, "SP {sp}: {st}");
        let opened = now["ucx_endpoints_opened"].as_u64();
        assert!(
            opened.is_some_and(|n| n >= jobs as u64),
            "SP {sp}: fewer endpoints counted than jobs: {now}"
        );
        assert_eq!(
            now["ucx_endpoints_closed"], now["ucx_endpoints_opened"],
            "SP {sp}: endpoints left open after {jobs} jobs: {now}"
        );
        assert_eq!(now["ucx_endpoints_open"], 0, "SP {sp}: {now}");
        assert_eq!(st["jobs_at_exit"], 0, "SP {sp}: {st}");
    }
}

/// A job of `np` ranks that runs for a long time (until killed), started in its own process
/// group.
fn long_job(sps: &TcpSps, np: u32, same_kernel: bool) -> Child {
    use std::os::unix::process::CommandExt;
    let cred = bootstrap::auth::JobCredential::issue_new(&sps.key, uid(), np).encode();
    let mut cmd = mpirun_offloaded(np, &sps.cluster_path, cred);
    cmd.env_remove("SPOFF_BACKEND")
        .env_remove("SPOFF_HOST_TRANSPORT")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    if same_kernel {
        cmd.args(["-x", "SPOFF_HOSTS_SAME_KERNEL"])
            .env("SPOFF_HOSTS_SAME_KERNEL", "1");
    } else {
        cmd.env_remove("SPOFF_HOSTS_SAME_KERNEL");
    }
    cmd.arg(artifact("alltoallv_check"))
        .args(["--ops", "1000000", "--max-count", "4096", "--seed", "7"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
    cmd.spawn().expect("cannot run mpirun")
}

/// The pids of the `alltoallv_check` ranks of jobs of `cluster`.
fn ranks_of(cluster: &Path) -> Vec<u32> {
    pids_matching(&cluster.display().to_string())
        .into_iter()
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/exe"))
                .is_ok_and(|e| e.ends_with("alltoallv_check"))
        })
        .collect()
}

fn signal_all(pids: &[u32], sig: libc::c_int) {
    for &pid in pids {
        // SAFETY: kill(2) with a pid and a signal number.
        unsafe { libc::kill(pid as i32, sig) };
    }
}

fn kill_group(child: &mut Child) {
    // SAFETY: kill(2) on the process group we created for the child.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.wait();
}

/// Waits (bounded) until every SP of `cluster` counts posts: the job is in flight on all.
fn wait_posts(cluster: &Path, n: usize) {
    let t = Instant::now();
    loop {
        let st = stats_now(cluster);
        if st.len() == n && st.iter().all(|s| s["posts"].as_u64() > Some(0)) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the job did not reach every SP within 60 s: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `service-process stats --json` once SPs are gone: the records of the stopped SPs (those
/// it prints with `stopped_at_unix`), by SP id.
fn stopped_records(cluster: &Path) -> (Finished, Vec<Option<serde_json::Value>>, usize) {
    let out = run(
        {
            let mut c = Command::new(service_process());
            c.args(["stats", "--json", "--cluster"]).arg(cluster);
            c
        },
        Duration::from_secs(60),
    );
    let n = bootstrap::Cluster::load(cluster).unwrap().sps.len();
    let mut recs = vec![None; n];
    for l in out.stdout.lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        if v.get("stopped_at_unix").is_some() {
            let sp = v["sp"].as_u64().unwrap() as usize;
            recs[sp] = Some(v);
        }
    }
    (out, recs, n)
}

/// An SP with peers, serving a job in flight (copies running on its datapath, UCX endpoints
/// to the ranks), stops within 500 ms of SIGTERM; its counters are printed (`STATS`) and kept
/// next to its socket, where `service-process stats` finds them once it is gone ("stopped
/// at"), and its socket is removed. Every SP of the set is stopped so in turn (random order,
/// printed seed).
#[test]
fn an_sp_serving_a_job_stops_within_500ms_of_sigterm_and_keeps_its_counters() {
    const BOUND: Duration = Duration::from_millis(500);
    let seed = seed();
    let mut rng = Rng(seed);
    let mut served = Served::start(3, 1, 1, &["--ucx=on"]);
    let mut job = long_job(&served.sps, 3, false);
    wait_posts(&served.sps.cluster_path, 3);
    // The ranks stop where they are, as ranks busy computing do: a copy of their ucx grants
    // then waits in UCX (the host progresses its worker only inside MPI) until the mover's
    // timeout (10 s), and the SP must not wait for it.
    let ranks = ranks_of(&served.sps.cluster_path);
    assert_eq!(ranks.len(), 3, "ranks of the job: {ranks:?}");
    signal_all(&ranks, libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(500));
    let mut order: Vec<usize> = (0..3).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut took = vec![];
    for &sp in &order {
        let child = &mut served.children[sp];
        // SAFETY: kill(2) with a pid of our child and a signal number.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if t.elapsed() > Duration::from_secs(20) {
                kill_group(&mut job);
                panic!("SP {sp} did not stop within 20 s of SIGTERM (seed {seed})");
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        took.push((sp, t.elapsed(), status));
    }
    signal_all(&ranks, libc::SIGKILL);
    kill_group(&mut job);
    eprintln!("stop order and times: {took:?}");
    let stats = served.stop();
    for &(sp, elapsed, status) in &took {
        assert!(status.success(), "SP {sp} exited with {status}");
        assert!(
            elapsed < BOUND,
            "SP {sp} took {elapsed:?} to stop after SIGTERM (bound {BOUND:?}; order {order:?}, \
             seed {seed})"
        );
        assert!(!stats[sp].is_null(), "SP {sp} printed no counters");
        let socket = &served.sps.cluster.sps[sp].host_socket;
        assert!(
            !socket.exists(),
            "SP {sp} left its socket {}",
            socket.display()
        );
    }
    let (out, recs, n) = stopped_records(&served.sps.cluster_path);
    for (sp, rec) in recs.iter().enumerate().take(n) {
        let rec = rec.as_ref().unwrap_or_else(|| {
            panic!(
                "`stats` shows no counters of stopped SP {sp}\n--- stdout\n{}\n--- stderr\n{}",
                out.stdout, out.stderr
            )
        });
        assert!(rec["posts"].as_u64() > Some(0), "SP {sp}: {rec}");
        assert_eq!(rec["posts"], stats[sp]["posts"], "SP {sp}: {rec}");
    }
    assert!(
        out.stderr.contains("stopped at"),
        "`stats` does not say the SPs stopped\n{}",
        out.stderr
    );
}

/// SPs started by a real `mpirun` (the per-job deployment, `serve --sp-id auto`), serving a
/// job in flight, get SIGTERM through that mpirun (which SIGKILLs what is still running about
/// a second later): every SP's counters are readable afterwards (`service-process stats`, from
/// the files the SPs keep next to their sockets) and every socket is removed.
#[test]
fn sps_under_mpirun_keep_their_counters_and_remove_their_sockets_on_sigterm() {
    use std::os::unix::process::CommandExt;
    const K: u32 = 3;
    let mut sps = TcpSps::describe(&service_process(), 1, K, K);
    sps.cluster.hosts = vec![service_process::deploy::host_name().unwrap()];
    sps.cluster.save(&sps.cluster_path).unwrap();
    sps.release_listeners();
    let key = service_process::launch::key_path(&sps.cluster_path);
    let mut launcher = Command::new("mpirun")
        .args([
            "--oversubscribe",
            "--bind-to",
            "none",
            "-np",
            &K.to_string(),
        ])
        .args(["--map-by", &format!("ppr:{K}:node")])
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
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("cannot run mpirun");
    let out = launcher.stdout.take().unwrap();
    let err = launcher.stderr.take().unwrap();
    let read = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let (out, err) = (read(Box::new(out)), read(Box::new(err)));
    wait_ready(&sps.cluster_path, K);
    let mut job = long_job(&sps, K, true);
    wait_posts(&sps.cluster_path, K as usize);
    // SIGTERM to mpirun itself, as an admin (or a batch system ending the allocation) stops
    // the SP job.
    // SAFETY: kill(2) with the pid of our child and a signal number.
    unsafe { libc::kill(launcher.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    while launcher.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(20) {
            kill_group(&mut launcher);
            kill_group(&mut job);
            panic!("the SPs' mpirun did not stop within 20 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mpirun_took = t.elapsed();
    kill_group(&mut job);
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    eprintln!(
        "the SPs' mpirun stopped {mpirun_took:?} after SIGTERM; {} STATS lines came through it",
        out.matches("STATS {").count()
    );
    let left = pids_matching(&sps.cluster_path.display().to_string());
    assert!(left.is_empty(), "SP processes left behind: {left:?}");
    // Each SP printed its counters, whole, before mpirun's SIGKILL could come.
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("STATS ")).collect();
    assert_eq!(
        lines.len(),
        K as usize,
        "not every SP printed its counters through mpirun\n{out}"
    );
    for l in &lines {
        assert!(
            serde_json::from_str::<serde_json::Value>(&l["STATS ".len()..]).is_ok(),
            "a counters line came through broken: {l}"
        );
    }
    for e in &sps.cluster.sps {
        assert!(
            !e.host_socket.exists(),
            "SP {} left its socket {}\n--- mpirun stdout\n{out}\n--- stderr\n{err}",
            e.id,
            e.host_socket.display()
        );
    }
    let (st, recs, n) = stopped_records(&sps.cluster_path);
    for (sp, rec) in recs.iter().enumerate().take(n) {
        let rec = rec.as_ref().unwrap_or_else(|| {
            panic!(
                "the counters of SP {sp} are lost: `stats` shows none\n--- stats stdout\n{}\n\
                 --- stats stderr\n{}\n--- mpirun stdout\n{out}\n--- mpirun stderr\n{err}",
                st.stdout, st.stderr
            )
        });
        assert!(rec["posts"].as_u64() > Some(0), "SP {sp}: {rec}");
    }
}
