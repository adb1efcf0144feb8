//! An SP that lives for many jobs, and one that is stopped: real SPs (`service-process serve`)
//! whose ranks reach them over TCP with `ucx` grants (as from another machine: the SPs make UCX
//! endpoints to every rank they copy from or to), real `mpirun` jobs one after the other, and
//! SPs stopped by SIGTERM, directly and through the `mpirun` that started them.

#[path = "../../crates/service-process/tests/tcp/mod.rs"]
mod tcp;

use integration_tests::*;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
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
        wait_ready(&sps.cluster_path, nodes * k);
        Served {
            sps,
            children,
            stdout: vec![String::new(); stderr.len()],
            stderr,
            lines,
        }
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
