//! The UCX ports of the `ucx` grants over TCP (issue 25): a cluster description that names
//! `ucx_tcp_port_range` confines the TCP listeners of the ranks' UCX (the shim's) and of the
//! SPs' UCX to it, in a real `mpirun` job whose ranks reach their SPs over TCP and grant their
//! buffers through UCX, as on a real cluster. The listeners and connections of the ranks and
//! the SPs are read from `/proc` while the job runs (and printed: the flows the guide lists).

#[path = "../../crates/service-process/tests/tcp/mod.rs"]
mod tcp;

use integration_tests::*;
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tcp::TcpSps;

/// The socket inodes a process holds.
fn socket_inodes(pid: u32) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return out;
    };
    for e in dir.flatten() {
        if let Ok(t) = std::fs::read_link(e.path()) {
            let t = t.to_string_lossy().to_string();
            if let Some(n) = t.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                if let Ok(n) = n.parse() {
                    out.insert(n);
                }
            }
        }
    }
    out
}

/// A TCP socket of /proc/PID/net/tcp{,6}: local port, remote address:port, state, inode.
struct TcpEntry {
    local_port: u16,
    remote: String,
    listen: bool,
    inode: u64,
}

fn tcp_table(pid: u32) -> Vec<TcpEntry> {
    let mut out = Vec::new();
    for f in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{f}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let w: Vec<&str> = line.split_whitespace().collect();
            if w.len() < 10 {
                continue;
            }
            let port = |a: &str| u16::from_str_radix(a.rsplit(':').next().unwrap(), 16).unwrap();
            let remote = w[2];
            let ip = remote.split(':').next().unwrap();
            let shown_ip = if ip.len() == 8 {
                let v = u32::from_str_radix(ip, 16).unwrap();
                std::net::Ipv4Addr::from(v.to_le_bytes()).to_string()
            } else {
                ip.to_string()
            };
            out.push(TcpEntry {
                local_port: port(w[1]),
                remote: format!("{shown_ip}:{}", port(remote)),
                listen: w[3] == "0A",
                inode: w[9].parse().unwrap_or(0),
            });
        }
    }
    out
}

/// What one process was seen doing on TCP: its listening ports and its connections (local
/// port -> remote).
#[derive(Default, Debug)]
struct Seen {
    listening: BTreeSet<u16>,
    connected: BTreeSet<(u16, String)>,
}

fn look(pid: u32, seen: &mut Seen) {
    let mine = socket_inodes(pid);
    for e in tcp_table(pid) {
        if !mine.contains(&e.inode) {
            continue;
        }
        if e.listen {
            seen.listening.insert(e.local_port);
        } else {
            seen.connected.insert((e.local_port, e.remote));
        }
    }
}

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

#[test]
fn mpirun_ucx_listeners_of_ranks_and_sps_stay_in_the_described_range() {
    let seed = seed();
    let mut rng = Rng(seed);
    let mut sps = TcpSps::describe(&service_process(), 2, 1, 1);
    // A random range of 100 ports clear of the SPs' own, below the kernel's ephemeral ports.
    let own: Vec<u16> = sps
        .cluster
        .sps
        .iter()
        .flat_map(|e| [Some(e.peer_addr.port()), e.host_addr.map(|a| a.port())])
        .flatten()
        .collect();
    let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let top = low.saturating_sub(16384).max(1024 + 6_100);
    let first = loop {
        // Below the ports the launchers of the tests alongside bind SPs on
        // (`launch::loopback_listener`: the 16 Ki ports under the ephemeral range), so that
        // this job's UCX listeners cannot take the port of an SP another test stopped and is
        // about to start again.
        let f = top - 6_100 + rng.below(6_000) as u16;
        if !own.iter().any(|p| (f..=f + 99).contains(p)) {
            break f;
        }
    };
    let (lo, hi) = (first, first + 99);
    eprintln!("ucx_tcp_port_range {lo}-{hi}");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&sps.cluster_path).unwrap()).unwrap();
    v["ucx_tcp_port_range"] = format!("{lo}-{hi}").into();
    std::fs::write(&sps.cluster_path, v.to_string()).unwrap();
    for sp in 0..2 {
        sps.start(sp, &["--ucx=on"]);
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
    let sp_pids: Vec<u32> = sps.sps.iter().map(|s| s.child.id()).collect();

    // Watch the ranks (alltoallv_check processes of this job) and the SPs while the job runs.
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let stop = stop.clone();
        let needle = sps.cluster_path.display().to_string();
        let sp_pids = sp_pids.clone();
        std::thread::spawn(move || {
            let mut ranks: BTreeMap<u32, Seen> = BTreeMap::new();
            let mut sps: BTreeMap<u32, Seen> = BTreeMap::new();
            while !stop.load(Ordering::Acquire) {
                for pid in pids_matching(&needle) {
                    if comm(pid) == "alltoallv_check" {
                        look(pid, ranks.entry(pid).or_default());
                    }
                }
                for &pid in &sp_pids {
                    look(pid, sps.entry(pid).or_default());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            (ranks, sps)
        })
    };
    let s = seed.to_string();
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let cred = bootstrap::auth::JobCredential::issue_new(&sps.key, uid, 2).encode();
    let mut cmd = mpirun_offloaded(2, &sps.cluster_path, cred);
    // MPI's own traffic in shared memory, so that the ranks' TCP listeners are the shim's UCX.
    cmd.args(["--mca", "btl", "self,vader", "--mca", "pml", "ob1"])
        .env_remove("SPOFF_BACKEND")
        .env_remove("SPOFF_HOSTS_SAME_KERNEL")
        .env_remove("SPOFF_HOST_TRANSPORT")
        .env_remove("UCX_TCP_PORT_RANGE")
        .args(["-x", "SPOFF_VERBOSE"])
        .env("SPOFF_VERBOSE", "1")
        .arg(artifact("alltoallv_check"))
        .args(["--ops", "200", "--seed", &s]);
    let job = run(cmd, Duration::from_secs(240));
    stop.store(true, Ordering::Release);
    let (ranks, sp_seen) = watcher.join().unwrap();
    job.assert_ok("alltoallv_check with ucx grants over TCP");
    assert!(
        job.stdout.contains("200 ops, 0 mismatches"),
        "{}",
        job.stdout
    );
    for r in 0..2 {
        assert!(
            job.stderr.contains(&format!("rank {r}: ucx grants")),
            "rank {r} does not grant through UCX\n{}",
            job.stderr
        );
    }
    let stats = sps.stop_and_stats();
    let posts: u64 = stats.iter().map(|s| s["posts"].as_u64().unwrap_or(0)).sum();
    assert!(posts > 0, "nothing was offloaded");

    assert!(
        !job.stderr.contains("invalid configuration"),
        "UCX did not take the port range:\n{}",
        job.stderr
    );
    let in_range = |p: &u16| (lo..=hi).contains(p);
    for e in &sps.cluster.sps {
        eprintln!(
            "SP {}: peer_addr {}, host_addr {}",
            e.id,
            e.peer_addr,
            e.host_addr.unwrap()
        );
    }
    eprintln!("ranks (pid: listening; connections local port -> remote):");
    for (pid, s) in &ranks {
        eprintln!("  {pid}: {:?}; {:?}", s.listening, s.connected);
    }
    eprintln!("SPs:");
    for (pid, s) in &sp_seen {
        eprintln!("  {pid}: {:?}; {:?}", s.listening, s.connected);
    }
    assert_eq!(ranks.len(), 2, "both ranks watched: {ranks:?}");
    for (pid, s) in &ranks {
        assert!(!s.listening.is_empty(), "rank {pid}: no TCP listener seen");
        let out: Vec<&u16> = s.listening.iter().filter(|p| !in_range(p)).collect();
        assert!(
            out.is_empty(),
            "rank {pid} listens outside {lo}-{hi}: {out:?} (all: {:?})",
            s.listening
        );
    }
    for (i, (pid, s)) in sp_seen.iter().enumerate() {
        let e = &sps.cluster.sps[i];
        let theirs = [e.peer_addr.port(), e.host_addr.unwrap().port()];
        let ucx: Vec<&u16> = s.listening.iter().filter(|p| !theirs.contains(p)).collect();
        assert!(!ucx.is_empty(), "SP {i} (pid {pid}): no UCX listener seen");
        assert!(
            ucx.iter().all(|p| in_range(p)),
            "SP {i} (pid {pid}) has UCX listeners outside {lo}-{hi}: {ucx:?}"
        );
    }
}
