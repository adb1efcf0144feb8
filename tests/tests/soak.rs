//! Soak: the same SPs (started once, as a long-lived daemon would be) serve one job of many
//! collectives of every kind (`soak.c`, each result checked) and then many short jobs, while
//! a sampler reads every SP's resident memory, open descriptors, jobs and instances. What an
//! SP holds must not grow with what it has served: after the jobs, no job or instance is left,
//! the descriptors are as at the start, and the memory has stopped growing.
//!
//! `SOAK_COLLECTIVES` (default 3000) and `SOAK_JOBS` (default 8) in `make test`; `make soak`
//! runs 100 000 and 200, and with `SOAK_WRITE_DOCS=1` writes docs/SOAK.md and docs/soak.svg.

use integration_tests::{mpirun_offloaded, run};
use service_process::launch::{self, SpSetSpec};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
struct Sample {
    secs: f64,
    /// The job running (0: the long one; 1..: the short ones).
    job: usize,
    rss_kib: Vec<u64>,
    fds: Vec<u64>,
    instances: Vec<u64>,
    jobs: Vec<u64>,
}

fn env_num(k: &str, default: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn soak_prog() -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates/host-shim/tests/progs/soak.c");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("soak");
    let st = Command::new("mpicc")
        .args(["-O1", "-Wall", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .expect("mpicc runs (install Open MPI: make deps)");
    assert!(st.success(), "mpicc failed on {}", src.display());
    out
}

/// An SP's resident size; 0 once it is gone (a sample taken as it stops).
fn rss_kib(pid: u32) -> u64 {
    integration_tests::procfs::rss_kib(pid).unwrap_or(0)
}

/// Open descriptors of `pid` by kind ("socket", "anon_inode:[eventfd]", ...), for messages.
fn fd_kinds(pid: u32) -> std::collections::BTreeMap<String, u32> {
    let mut m = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let l = std::fs::read_link(e.path()).unwrap_or_default();
        let l = l.to_string_lossy();
        let k = if l.starts_with("anon_inode:") {
            l.to_string()
        } else if l.starts_with("/dev/shm/") {
            "/dev/shm".into()
        } else {
            l.split(':').next().unwrap_or("").to_string()
        };
        *m.entry(k).or_insert(0u32) += 1;
    }
    m
}

fn fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

#[test]
fn the_same_sps_serve_many_collectives_and_many_jobs_without_growing() {
    let collectives = env_num("SOAK_COLLECTIVES", 3000);
    let jobs = env_num("SOAK_JOBS", 8) as usize;
    let prog = soak_prog();
    let exe = integration_tests::service_process();
    let run_dir = launch::new_run_dir().unwrap();
    let spec = SpSetSpec {
        nodes: 2,
        sps_per_node: 1,
        ranks_per_node: 2,
        layout: bootstrap::Layout::Block,
        sp_cpus: None,
        max_inflight_reads: 4,
        extra_args: vec![],
        sp_args: vec![],
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let (cluster_path, mut sps) = launch::spawn_sps(&exe, &spec, &run_dir, tx).unwrap();
    assert!(matches!(
        launch::wait_ready(&mut sps, &rx, Duration::from_secs(30), None),
        Ok(true)
    ));
    let cluster = bootstrap::Cluster::load(&cluster_path).unwrap();
    let key = bootstrap::auth::ClusterKey::load(&launch::key_path(&cluster_path)).unwrap();
    let pids: Vec<u32> = sps.iter().map(|s| s.child.id()).collect();

    // The sampler.
    let samples = Arc::new(Mutex::new(Vec::<Sample>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    // While set, the sampler sends no stats request, so that no stats connection is open when
    // descriptors are counted.
    let quiet = Arc::new(AtomicBool::new(false));
    let job_now = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (samples, stop, job_now) = (samples.clone(), stop.clone(), job_now.clone());
        let quiet = quiet.clone();
        let (cluster, key, pids) = (cluster.clone(), key.clone(), pids.clone());
        std::thread::spawn(move || {
            let t0 = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                if quiet.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                let stats: Vec<serde_json::Value> = cluster
                    .sps
                    .iter()
                    .map(|sp| {
                        service_process::stats::query_within(sp, &key, Duration::from_secs(2))
                            .unwrap_or_default()
                    })
                    .collect();
                samples.lock().unwrap().push(Sample {
                    secs: t0.elapsed().as_secs_f64(),
                    job: job_now.load(Ordering::Relaxed),
                    rss_kib: pids.iter().map(|&p| rss_kib(p)).collect(),
                    fds: pids.iter().map(|&p| fds(p)).collect(),
                    instances: stats
                        .iter()
                        .map(|s| s["instances_at_exit"].as_u64().unwrap_or(u64::MAX))
                        .collect(),
                    jobs: stats
                        .iter()
                        .map(|s| s["jobs_at_exit"].as_u64().unwrap_or(u64::MAX))
                        .collect(),
                });
                std::thread::sleep(Duration::from_millis(250));
            }
        })
    };
    let fds_start: Vec<u64> = pids.iter().map(|&p| fds(p)).collect();

    let t0 = Instant::now();
    let run_job = |n: u64, seed: u64| {
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        let cred = bootstrap::auth::JobCredential::issue_new(&key, uid, 4).encode();
        let mut cmd = mpirun_offloaded(4, &cluster_path, cred);
        cmd.arg(&prog).args([n.to_string(), seed.to_string()]);
        let r = run(cmd, Duration::from_secs(600));
        r.assert_ok(&format!("soak job of {n} collectives (seed {seed})"));
        assert!(
            r.stdout.contains(&format!("soak: {n} collectives, ok")),
            "{}",
            r.stdout
        );
    };
    run_job(collectives, 1);
    let long_secs = t0.elapsed().as_secs_f64();
    // UCX sets up its descriptors (sockets, timers) at first use: count from here, once the
    // SPs dropped the pins of the job's exited processes (at their next heartbeat) and closed
    // the sampler's last stats connection.
    quiet.store(true, Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(1500));
    let fds_warm: Vec<u64> = pids.iter().map(|&p| fds(p)).collect();
    let kinds_warm: Vec<_> = pids.iter().map(|&p| fd_kinds(p)).collect();
    quiet.store(false, Ordering::Relaxed);
    for j in 1..=jobs {
        job_now.store(j, Ordering::Relaxed);
        run_job(100 + (j as u64 % 7) * 50, j as u64 + 1);
    }
    let total_secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let samples = samples.lock().unwrap().clone();
    // The SPs drop the pins of exited processes at their next heartbeat (every second); count
    // before this test's own stats request below opens a connection.
    std::thread::sleep(Duration::from_millis(1500));
    let fds_end: Vec<u64> = pids.iter().map(|&p| fds(p)).collect();
    let kinds_end: Vec<_> = pids.iter().map(|&p| fd_kinds(p)).collect();
    let stats = |sp: &bootstrap::cluster::SpEntry| {
        service_process::stats::query_within(sp, &key, Duration::from_secs(2)).unwrap()
    };
    let end: Vec<serde_json::Value> = cluster.sps.iter().map(stats).collect();
    launch::stop_sps(&mut sps, Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(&run_dir);

    // Every sample reached every SP (a stats request answered, even under load).
    assert!(
        samples
            .iter()
            .all(|s| !s.instances.contains(&u64::MAX) && !s.jobs.contains(&u64::MAX)),
        "an SP did not answer the sampler"
    );
    let peak_instances = samples
        .iter()
        .flat_map(|s| s.instances.iter())
        .max()
        .copied();
    // Nothing held for jobs that ended.
    for (i, s) in end.iter().enumerate() {
        assert_eq!(s["jobs_at_exit"], 0, "SP {i}: {s}");
        assert_eq!(s["instances_at_exit"], 0, "SP {i}: {s}");
    }
    assert_eq!(
        fds_end, fds_warm,
        "descriptors after the long job and at the end (warm: {kinds_warm:?}; end: {kinds_end:?})"
    );
    // Memory: once warm (the first quarter of the short jobs), flat within 8 MiB.
    let warm = samples
        .iter()
        .find(|s| s.job > jobs / 4)
        .unwrap_or(&samples[samples.len() / 2])
        .clone();
    let last = samples.last().unwrap();
    for i in 0..pids.len() {
        let grown = last.rss_kib[i].saturating_sub(warm.rss_kib[i]);
        assert!(
            grown < 8 * 1024,
            "SP {i} grew by {grown} KiB after warming up ({} -> {} KiB)",
            warm.rss_kib[i],
            last.rss_kib[i]
        );
    }
    let posts: u64 = end.iter().map(|s| s["posts"].as_u64().unwrap()).sum();
    let max_rss: Vec<u64> = (0..pids.len())
        .map(|i| samples.iter().map(|s| s.rss_kib[i]).max().unwrap_or(0))
        .collect();
    let summary = format!(
        "{collectives} collectives in one job ({long_secs:.0} s), then {jobs} jobs, {total_secs:.0} s \
         in all; {posts} posts served; RSS per SP at the start {:?} KiB, warm {:?}, end {:?}, \
         peak {max_rss:?}; descriptors {fds_start:?} at the start, {fds_warm:?} after the \
         long job, {fds_end:?} at the end; at most {} instances \
         open on an SP; {} samples",
        samples[0].rss_kib,
        warm.rss_kib,
        last.rss_kib,
        peak_instances.unwrap_or(0),
        samples.len()
    );
    eprintln!("soak: {summary}");
    if std::env::var("SOAK_WRITE_DOCS").is_ok_and(|v| v == "1") {
        write_docs(&samples, &summary, collectives, jobs);
    }
}

/// docs/soak.svg (RSS and descriptors per SP over time) and docs/SOAK.md.
fn write_docs(samples: &[Sample], summary: &str, collectives: u64, jobs: usize) {
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    let (w, h, pad) = (800.0, 220.0, 50.0);
    let t_max = samples.last().map_or(1.0, |s| s.secs).max(1.0);
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
    let mut svg = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{}' font-family='sans-serif' font-size='12'>\n",
        2.0 * h + 40.0
    );
    type Series = fn(&Sample, usize) -> f64;
    let panels: [(&str, Series); 2] = [
        ("resident memory per SP (MiB)", |s, i| {
            s.rss_kib[i] as f64 / 1024.0
        }),
        ("open descriptors per SP", |s, i| s.fds[i] as f64),
    ];
    for (p, (title, f)) in panels.iter().enumerate() {
        let top = p as f64 * (h + 20.0) + 20.0;
        let n_sp = samples.first().map_or(0, |s| s.rss_kib.len());
        let y_max = samples
            .iter()
            .flat_map(|s| (0..n_sp).map(|i| f(s, i)))
            .fold(1.0_f64, f64::max)
            * 1.15;
        svg += &format!(
            "<text x='{pad}' y='{}'>{title}; x: seconds (the long job, then {jobs} short ones)</text>\n",
            top - 4.0
        );
        svg += &format!(
            "<rect x='{pad}' y='{top}' width='{}' height='{}' fill='none' stroke='#888'/>\n",
            w - 2.0 * pad,
            h - 30.0
        );
        svg += &format!(
            "<text x='4' y='{}'>{y_max:.0}</text><text x='4' y='{}'>0</text>\n",
            top + 12.0,
            top + h - 30.0
        );
        for i in 0..n_sp {
            let pts: Vec<String> = samples
                .iter()
                .map(|s| {
                    let x = pad + (w - 2.0 * pad) * s.secs / t_max;
                    let y = top + (h - 30.0) * (1.0 - f(s, i) / y_max);
                    format!("{x:.1},{y:.1}")
                })
                .collect();
            svg += &format!(
                "<polyline fill='none' stroke='{}' points='{}'/>\n<text x='{}' y='{}' fill='{}'>SP {i}</text>\n",
                colors[i % colors.len()],
                pts.join(" "),
                w - pad + 4.0,
                top + 14.0 + 14.0 * i as f64,
                colors[i % colors.len()]
            );
        }
        svg += &format!(
            "<text x='{}' y='{}'>{t_max:.0} s</text>\n",
            w - pad - 30.0,
            top + h - 16.0
        );
    }
    svg += "</svg>\n";
    std::fs::write(docs.join("soak.svg"), svg).unwrap();
    let md = format!(
        "# Soak\n\nWritten by `make soak` (tests/tests/soak.rs) on {}. The same two SPs (2 emulated nodes, \
         1 SP each, started once like a long-lived daemon) serve one job of {collectives} collectives of \
         every intercepted kind (`crates/host-shim/tests/progs/soak.c`: Ialltoallv, Alltoall \
         (also in place and with a vector type the shim packs), Allgatherv, Iallgather (also in \
         place), Bcast, Ibcast, up to 8 outstanding; every element checked), then {jobs} short \
         jobs (4 ranks each, a new job credential each). A sampler reads every 250 ms each SP's \
         resident memory, open descriptors, and held jobs and instances (its stats).\n\n\
         Result: {summary}.\n\n\
         ![RSS and descriptors of each SP over the soak](soak.svg)\n\n\
         The test asserts: every job passes its own checks; at the end no job and no instance is \
         held, the descriptors are those after the long job (UCX opens its own at first use), \
         and no SP's memory grew by 8 MiB or more \
         after the first quarter of the short jobs (the staging pool and the allocator settle \
         during the long job).\n",
        today()
    );
    std::fs::write(docs.join("SOAK.md"), md).unwrap();
    eprintln!("wrote docs/SOAK.md and docs/soak.svg");
}

fn today() -> String {
    let out = Command::new("date").args(["-u", "+%Y-%m-%d"]).output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}
