//! `service-process mcast-bench`: how many chunks per second the receive workers of one SP
//! land, against the number of workers and the chunk size (issue 26, "Receive-worker
//! scaling"), and what each landed chunk costs a worker in CPU time (the figure that maps to a
//! DPA thread's budget). One sender thread multicasts as fast as it can over the subgroups (a
//! subgroup per worker) on loopback; each worker lands every chunk it gets into a staging ring
//! (a copy of the payload, as the DPA's receive path writes staging). Datagrams the kernel
//! dropped because a worker's socket buffer was full are counted (the receiver was not
//! ready), not hidden. The copy from staging into a rank's buffer (the mover) is not part of
//! it.
//!
//! On a machine with fewer cores than sender + workers the threads share cores: the figures
//! are then what those cores do, not what more cores or a DPA would.

use super::fabric::{self, FabricConfig};
use super::worker::{Event, Injection, RecvWorker, Registration, Sink, WorkerStats};
use super::{datagram, subgroup_of};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The options of `service-process mcast-bench` (its `--help` is made of these comments).
#[derive(Clone, Debug, clap::Args)]
pub struct McastBenchOpts {
    /// Comma-separated receive-worker counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub workers: Vec<u16>,
    /// Comma-separated chunk (datagram payload) sizes in bytes, at most 65467.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "64,1024,4096,16384,65467"
    )]
    pub chunk_bytes: Vec<usize>,
    /// Seconds of sending per point.
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    /// Receive buffer of each worker's socket, in bytes (the kernel doubles it and caps it at
    /// net.core.rmem_max).
    #[arg(long, default_value_t = 4 << 20)]
    pub rcvbuf: usize,
    /// First UDP port of the groups (one port per point).
    #[arg(long, default_value_t = 46_000)]
    pub port_base: u16,
    /// One JSON object per point instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One measured point.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    pub workers: u16,
    pub chunk_bytes: usize,
    pub seconds: f64,
    pub sent: u64,
    pub landed: u64,
    /// Dropped by the kernel for want of room in a worker's socket buffer.
    pub overflow_drops: u64,
    /// Sent but neither landed nor counted by a socket: lost on the way (e.g. the loopback
    /// device's backlog, `net.core.netdev_max_backlog`).
    pub lost_elsewhere: u64,
    pub landed_per_sec: f64,
    pub landed_mib_per_sec: f64,
    /// CPU time of the workers (all together) per landed chunk, in ns.
    pub worker_ns_per_chunk: f64,
    /// CPU time of the sender per datagram sent, in ns.
    pub sender_ns_per_chunk: f64,
}

/// A staging ring the chunks are copied into.
struct Ring {
    slots: Vec<Mutex<Vec<u8>>>,
    next: AtomicU64,
}

impl Sink for Ring {
    fn land(&self, _psn: u32, payload: &[u8]) -> Result<(), String> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) as usize % self.slots.len();
        let mut s = self.slots[i].lock().unwrap_or_else(|e| e.into_inner());
        s[..payload.len()].copy_from_slice(payload);
        Ok(())
    }
}

/// CPU time of thread `tid` of this process so far, in ns (`/proc/self/task/TID/schedstat`).
fn thread_cpu_ns(tid: i32) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .with_context(|| format!("reading the schedstat of thread {tid}"))?;
    s.split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .context("schedstat without a CPU time")
}

/// Measures one point: `workers` workers (a subgroup each), `chunk` bytes a datagram.
pub fn measure(workers: u16, chunk: usize, opts: &McastBenchOpts, port: u16) -> Result<Point> {
    if chunk == 0 || chunk > datagram::MAX_PAYLOAD {
        bail!("--chunk-bytes {chunk}: from 1 to {}", datagram::MAX_PAYLOAD);
    }
    if workers == 0 {
        bail!("--workers 0: at least one receive worker");
    }
    let cfg = FabricConfig {
        port_base: port,
        ..FabricConfig::default()
    };
    let (tx, events) = crossbeam_channel::unbounded::<Event>();
    // The events are not needed here: drained so that they do not pile up.
    let drainer = std::thread::spawn(move || for _ in events {});
    let ring = Arc::new(Ring {
        slots: (0..64).map(|_| Mutex::new(vec![0; chunk])).collect(),
        next: AtomicU64::new(0),
    });
    // A collective with more chunks than any run sends: one registration, no wrap.
    let chunks = u32::MAX;
    let (coll, tag) = (1, 0x6d63_6173_7462_6e63);
    let ws: Vec<RecvWorker> = (0..workers)
        .map(|g| {
            let w = RecvWorker::start(&format!("mcast-rx-{g}"), tx.clone(), Injection::default())?;
            w.add_socket(fabric::receiver(
                cfg.group(0, g, workers),
                cfg.interface,
                opts.rcvbuf,
            )?);
            w.register(Registration {
                coll,
                tag,
                chunks,
                sink: ring.clone(),
                skip: vec![],
            });
            Ok(w)
        })
        .collect::<Result<_>>()?;
    drop(tx);
    let groups: Vec<_> = (0..workers).map(|g| cfg.group(0, g, workers)).collect();
    let sock = fabric::sender(&cfg)?;
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let sender = std::thread::spawn(move || -> Result<(u64, u64)> {
        let tid = nix::unistd::gettid().as_raw();
        let cpu0 = thread_cpu_ns(tid)?;
        let payload = vec![0x5a; chunk];
        let mut out = Vec::with_capacity(datagram::HEADER_BYTES + chunk);
        let mut psn = 0u32;
        // Spread over the subgroups as a buffer of 2^20 chunks would be.
        let span = 1u32 << 20;
        while !st.load(Ordering::Relaxed) {
            let sub = subgroup_of(psn % span, span, groups.len() as u16);
            let h = datagram::Header {
                subgroup: sub,
                coll,
                tag,
                psn,
                chunks,
            };
            datagram::encode(&h, &payload, &mut out);
            match sock.send_to(&out, groups[sub as usize]) {
                Ok(_) => psn += 1,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => std::thread::yield_now(),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => return Err(e.into()),
            }
        }
        Ok((u64::from(psn), thread_cpu_ns(tid)? - cpu0))
    });
    // The workers' threads: their ids, found by name in /proc/self/task.
    let tids = worker_tids(workers)?;
    let cpu0: u64 = tids
        .iter()
        .map(|t| thread_cpu_ns(*t))
        .sum::<Result<u64>>()?;
    let t0 = Instant::now();
    let landed0 = sum(&ws, |s| &s.landed);
    std::thread::sleep(Duration::from_secs_f64(opts.seconds));
    stop.store(true, Ordering::Relaxed);
    let (sent, sender_cpu) = sender
        .join()
        .map_err(|_| anyhow::anyhow!("the sender panicked"))??;
    // Let the workers take what is still queued.
    let mut last = sum(&ws, |s| &s.landed);
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let now = sum(&ws, |s| &s.landed);
        if now == last {
            break;
        }
        last = now;
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu1: u64 = tids
        .iter()
        .map(|t| thread_cpu_ns(*t))
        .sum::<Result<u64>>()?;
    // Each worker reads its kernel drop count whenever its socket runs dry: poke them once.
    std::thread::sleep(Duration::from_millis(150));
    let landed = sum(&ws, |s| &s.landed) - landed0;
    let overflow = sum(&ws, |s| &s.overflow_drops);
    drop(ws);
    let _ = drainer.join();
    Ok(Point {
        workers,
        chunk_bytes: chunk,
        seconds: secs,
        sent,
        landed,
        overflow_drops: overflow,
        lost_elsewhere: sent.saturating_sub(landed + overflow),
        landed_per_sec: landed as f64 / secs,
        landed_mib_per_sec: landed as f64 * chunk as f64 / secs / (1 << 20) as f64,
        worker_ns_per_chunk: (cpu1 - cpu0) as f64 / landed.max(1) as f64,
        sender_ns_per_chunk: sender_cpu as f64 / sent.max(1) as f64,
    })
}

fn sum(ws: &[RecvWorker], f: impl Fn(&WorkerStats) -> &AtomicU64) -> u64 {
    ws.iter().map(|w| WorkerStats::get(f(&w.stats))).sum()
}

/// The ids of this process's threads named `mcast-rx-*` (the `workers` just started).
fn worker_tids(workers: u16) -> Result<Vec<i32>> {
    let t = Instant::now();
    loop {
        let mut v = vec![];
        for e in std::fs::read_dir("/proc/self/task")?.flatten() {
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            if comm.trim_end().starts_with("mcast-rx-") {
                if let Some(tid) = e.file_name().to_str().and_then(|s| s.parse().ok()) {
                    v.push(tid);
                }
            }
        }
        if v.len() == workers as usize {
            return Ok(v);
        }
        if t.elapsed() > Duration::from_secs(5) {
            bail!("found {} receive-worker threads, not {workers}", v.len());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs every point of `opts` and prints them.
pub fn run(opts: &McastBenchOpts) -> Result<()> {
    if !(opts.seconds > 0.0 && opts.seconds <= 600.0) {
        bail!("--seconds {}: from above 0 to 600", opts.seconds);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if !opts.json {
        println!(
            "# receive workers of one SP on loopback multicast, a subgroup each, one sender thread; \
             {cores} cores here (sender and workers share them when fewer than workers + 1)"
        );
        println!(
            "{:>7} {:>7} {:>11} {:>11} {:>10} {:>10} {:>9} {:>11} {:>9} {:>9}",
            "workers",
            "chunk",
            "sent",
            "landed",
            "overflow",
            "elsewhere",
            "MiB/s",
            "chunks/s",
            "worker ns",
            "sender ns"
        );
    }
    let mut port = opts.port_base;
    for &w in &opts.workers {
        for &c in &opts.chunk_bytes {
            let p = measure(w, c, opts, port)?;
            port = port.wrapping_add(1);
            if opts.json {
                println!("{}", serde_json::to_string(&p)?);
            } else {
                println!(
                    "{:>7} {:>7} {:>11} {:>11} {:>10} {:>10} {:>9.1} {:>11.0} {:>9.0} {:>9.0}",
                    p.workers,
                    p.chunk_bytes,
                    p.sent,
                    p.landed,
                    p.overflow_drops,
                    p.lost_elsewhere,
                    p.landed_mib_per_sec,
                    p.landed_per_sec,
                    p.worker_ns_per_chunk,
                    p.sender_ns_per_chunk
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The benchmark's accounting: every datagram sent is landed, dropped by a socket or lost
    /// elsewhere, and it measures something (not a timing assertion).
    #[test]
    fn a_short_point_accounts_for_every_datagram() {
        let opts = McastBenchOpts {
            workers: vec![2],
            chunk_bytes: vec![512],
            seconds: 0.2,
            rcvbuf: 1 << 20,
            port_base: 45_000 + (std::process::id() % 500) as u16,
            json: true,
        };
        let p = measure(2, 512, &opts, opts.port_base).unwrap();
        assert!(p.sent > 0 && p.landed > 0, "{p:?}");
        assert_eq!(
            p.landed + p.overflow_drops + p.lost_elsewhere,
            p.sent,
            "{p:?}"
        );
        assert!(p.worker_ns_per_chunk > 0.0, "{p:?}");
        assert!(measure(0, 512, &opts, opts.port_base).is_err());
        assert!(measure(1, 70_000, &opts, opts.port_base).is_err());
    }
}
