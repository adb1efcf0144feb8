//! `coll-bench`: see `coll-bench --help`.

use clap::{Args, Parser, Subcommand, ValueEnum};
use coll_bench::mpi::{wtime, Comm, Datatype, Mpi, MpiError};
use coll_bench::{compute, parse_size, pattern};
use mpi_ffi::consts;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::time::Instant;

const DEFAULT_SIZES: &str = "1K,4K,16K,64K,256K,1M,4M";
/// The "destination" of an allgather block in the data pattern: every rank gets the same one.
const ALL_PEERS: u32 = u32::MAX;

#[derive(Parser, Debug)]
#[command(
    name = "coll-bench",
    version,
    about = "Benchmarks for MPI collectives (`overlap`, `late`, `traffic` run under mpirun).",
    long_about = "Benchmarks for MPI collectives. An ordinary MPI program: run `overlap`, \
                  `late` and `traffic` under mpirun (or `service-process launch`), natively or \
                  with the host shim LD_PRELOADed (the same binary serves both); `compare` puts \
                  a native and an offloaded result side by side and `traffic-table` renders \
                  traffic results; these two need no MPI."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Communication/computation overlap, OSU method.
    ///
    /// Per size: t_pure = mean time of (post; wait) after warmup, a barrier before every
    /// iteration, then the maximum over ranks of each rank's mean. Then per iteration: post,
    /// compute for t_pure or --compute-us (a busy loop of arithmetic calibrated once per size,
    /// no MPI calls), wait; t_overall and t_compute are the means (maximum over ranks), and so
    /// are post_us and wait_us, the time spent in the post call and in the wait call.
    /// overlap_pct = 100 - 100 * (t_overall - t_compute) / t_pure, clamped to [0, 100].
    ///
    /// Every iteration sends a pattern derived from (sender, receiver, iteration, byte); the
    /// receive buffer is pre-filled with a sentinel and checked exactly after the last iteration
    /// of each phase. A failed check prints rank, peer and offset, and the exit code is 1 (after
    /// the table). Rank 0 prints the table; --json writes one JSON object per size per line
    /// with: coll, bytes, ranks, nodes (env SPOFF_NODES, default 1), pure_us, overall_us,
    /// compute_us, post_us, wait_us, overlap_pct, validated, iters, warmup, mode ("offload" if LD_PRELOAD
    /// contains host_shim, else "native") and design (null).
    Overlap(OverlapArgs),

    /// A blocking collective where one rank per node enters late (see `late --help`).
    ///
    /// Reports, per size, `tail_us` (from the last rank's entry to the last rank's exit: how
    /// long the collective still takes once everybody arrived) and `mean_in_call_us` (mean
    /// time per rank inside the call). JSON fields: coll, bytes, ranks, nodes, delay_ms,
    /// tail_us, mean_in_call_us, validated, mode.
    Late(late::LateArgs),

    /// Inter-node bytes per call of an allgather: a ring vs the offloaded call vs the minimum.
    ///
    /// Run it under `service-process launch` (it reads SPOFF_CLUSTER, SPOFF_NODES,
    /// SPOFF_RANKS_PER_NODE and SPOFF_LAYOUT; the node of a world rank is the launcher's
    /// placement: r / ranks_per_node for block, r % nodes for cyclic; without these variables
    /// all ranks are on one node). Per size (bytes per rank, equal counts), --iters calls each:
    ///
    /// 1. ring: an allgatherv written here with MPI_Sendrecv (P - 1 steps; rank r sends to
    ///    r + 1 the block it received in the step before; not intercepted by the shim, so
    ///    native). Every rank counts the bytes it sent to a rank of another node; summed over
    ///    ranks (MPI_Allreduce).
    ///
    /// 2. offload: the ordinary MPI_Allgatherv (or MPI_Allgather); with the shim preloaded and
    ///    SPOFF_CLUSTER set it is offloaded. Rank 0 runs `service-process stats --cluster
    ///    $SPOFF_CLUSTER --json` before and after the calls (barriers around) and takes the
    ///    change of bytes_inter_node summed over all SPs (what the SPs copied from a rank of
    ///    another node). The binary is --service-process, else env SPOFF_SERVICE_PROCESS, else
    ///    `service-process` next to this executable. If the counters cannot be read, if the SPs
    ///    saw no posts, or if the shim is not active (launch --native, SPOFF_OFFLOAD=0), the
    ///    figure is null and offload_note says why; nothing is estimated.
    ///
    /// 3. min: computed, not measured: the sum over ranks of the block size times (number of
    ///    nodes with members - 1): every block enters every other node once.
    ///
    /// Both the ring's and the collective's results are checked byte for byte after every
    /// call (exit code 1 on a mismatch). Figures are per call (total / iters). Rank 0 prints a
    /// table; --json writes one object per size per line with: coll, bytes, ranks, nodes,
    /// layout, ring_inter_node_bytes, offload_inter_node_bytes, min_inter_node_bytes,
    /// validated, iters, mode, offload_posts (SP posts per call) and offload_note (null, or why the offload figures are null).
    Traffic(traffic_run::TrafficArgs),

    /// Renders `traffic --json` files as one table (plain text, or Markdown with --markdown).
    ///
    /// Columns: coll, ranks, nodes, layout, bytes, ring_B, offload_B, min_B (inter-node bytes
    /// per call), ring/min, offload/min, validated; a null figure shows as `-` with the
    /// row's offload_note under the table. Exit code 1 if a row did not validate. Needs no
    /// MPI.
    TrafficTable(TrafficTableArgs),

    /// Compares a native and an offloaded `overlap --json` run, size by size.
    ///
    /// Joins the two JSON Lines files on (coll, bytes) and prints, per size: pure_us,
    /// overall_us and overlap_pct of both, the pure-latency ratio native/offload (above 1 means
    /// the offload is faster) and whether both runs validated. Sizes present in only one file
    /// are listed too. Exit code 1 if a row did not validate or is missing on one side. Needs
    /// no MPI: run it directly, not under mpirun.
    Compare(CompareArgs),
}

#[derive(Args, Debug)]
struct CompareArgs {
    /// JSON Lines file of the native run.
    #[arg(long, value_name = "FILE")]
    native: PathBuf,

    /// JSON Lines file of the offloaded run.
    #[arg(long, value_name = "FILE")]
    offload: PathBuf,

    /// Print a Markdown table instead of plain text.
    #[arg(long)]
    markdown: bool,
}

#[derive(Args, Debug)]
struct TrafficTableArgs {
    /// JSON Lines files written by `coll-bench traffic --json`, rendered in order.
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,

    /// Print a Markdown table instead of plain text.
    #[arg(long)]
    markdown: bool,
}

/// Collectives known to the command line. Only the alltoall family is implemented so far; the
/// others are listed so the interface does not change when they are added.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Coll {
    /// MPI_Ialltoallv, every rank sends SIZE bytes to every rank (MPI_BYTE)
    Ialltoallv,
    /// MPI_Ialltoall, every rank sends SIZE bytes to every rank (MPI_BYTE)
    Ialltoall,
    /// MPI_Iallgatherv, every rank contributes SIZE bytes (MPI_BYTE)
    Iallgatherv,
    /// MPI_Iallgather, every rank contributes SIZE bytes (MPI_BYTE)
    Iallgather,
    /// not implemented yet (rejected with an error)
    Ibcast,
}

impl Coll {
    fn name(self) -> &'static str {
        match self {
            Coll::Ialltoallv => "ialltoallv",
            Coll::Ialltoall => "ialltoall",
            Coll::Iallgatherv => "iallgatherv",
            Coll::Iallgather => "iallgather",
            Coll::Ibcast => "ibcast",
        }
    }

    fn implemented(self) -> bool {
        matches!(
            self,
            Coll::Ialltoallv | Coll::Ialltoall | Coll::Iallgatherv | Coll::Iallgather
        )
    }

    /// Allgather family: one send block of SIZE bytes, the same block goes to every rank.
    fn is_allgather(self) -> bool {
        matches!(self, Coll::Iallgatherv | Coll::Iallgather)
    }
}

#[derive(Args, Debug)]
struct OverlapArgs {
    /// Collective to measure.
    #[arg(long, value_enum)]
    coll: Coll,

    /// Comma-separated sizes in bytes per pair (each rank sends SIZE bytes to every rank,
    /// itself included); K/M/G suffixes are 1024-based.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = DEFAULT_SIZES)]
    sizes: Vec<usize>,

    /// Timed iterations per phase and size [default: 16 MiB / SIZE, clamped to 10..=100].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    iters: Option<u32>,

    /// Untimed warmup iterations before each phase [default: iters / 10, at least 2].
    #[arg(long)]
    warmup: Option<u32>,

    /// Compute for this many microseconds per iteration instead of t_pure (the OSU choice).
    /// A compute longer than the communication shows what the host still pays: post_us +
    /// wait_us.
    #[arg(long, value_name = "US")]
    compute_us: Option<u64>,

    /// Also write one JSON object per size per line (JSON Lines) to FILE (rank 0 only).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,

    /// Test hook (hidden): rank 0 flips one received byte in the pure phase of the first non-zero size, so
    /// the run must report a validation failure and exit 1.
    #[arg(long, hide = true)]
    self_test_corrupt: bool,
}

fn default_iters(size: usize) -> u32 {
    ((16usize << 20) / size.max(1)).clamp(10, 100) as u32
}

fn default_warmup(iters: u32) -> u32 {
    (iters / 10).max(2)
}

struct Row {
    bytes: usize,
    pure_us: f64,
    overall_us: f64,
    compute_us: f64,
    /// Time in the post call and in the wait call, with compute (what the host did not spend
    /// computing, besides the compute itself).
    post_us: f64,
    wait_us: f64,
    overlap_pct: f64,
    validated: bool,
    iters: u32,
    warmup: u32,
}

fn overlap_pct(pure: f64, overall: f64, compute: f64) -> f64 {
    if pure <= 0.0 {
        return 0.0;
    }
    (100.0 - 100.0 * (overall - compute) / pure).clamp(0.0, 100.0)
}

/// Everything a size needs: buffers, counts, displacements and the datatype.
struct Setup {
    coll: Coll,
    world: Comm,
    me: usize,
    n: usize,
    size: usize,
    send: Vec<u8>,
    recv: Vec<u8>,
    counts: Vec<i32>,
    displs: Vec<i32>,
    byte: Datatype,
}

impl Setup {
    fn fill_send(&mut self, iter: u64) {
        let size = self.size;
        if size == 0 {
            return;
        }
        if self.coll.is_allgather() {
            pattern::fill(&mut self.send[..size], self.me as u32, ALL_PEERS, iter);
            return;
        }
        for (peer, block) in self.send.chunks_mut(size).enumerate().take(self.n) {
            pattern::fill(block, self.me as u32, peer as u32, iter);
        }
    }

    fn sentinel_recv(&mut self) {
        self.recv.fill(0xA5);
    }

    /// Posts the collective and waits; returns the times of the whole (post + compute + wait),
    /// of the compute alone, of the post call and of the wait call.
    fn run_once(&mut self, compute_steps: Option<u64>) -> Result<Times, MpiError> {
        let (send, recv) = (&self.send, &mut self.recv);
        let t0 = wtime();
        let req = match self.coll {
            Coll::Ialltoallv => self.world.ialltoallv(
                send,
                &self.counts,
                &self.displs,
                recv,
                &self.counts,
                &self.displs,
                &self.byte,
            )?,
            Coll::Ialltoall => self
                .world
                .ialltoall(send, recv, self.size as i32, &self.byte)?,
            Coll::Iallgatherv => self.world.iallgatherv(
                send,
                self.size as i32,
                recv,
                &self.counts,
                &self.displs,
                &self.byte,
            )?,
            Coll::Iallgather => self
                .world
                .iallgather(send, recv, self.size as i32, &self.byte)?,
            other => unreachable!("{} is rejected before MPI_Init", other.name()),
        };
        let t_posted = wtime();
        let mut compute = 0.0;
        if let Some(steps) = compute_steps {
            let c0 = Instant::now();
            std::hint::black_box(compute::busy(steps));
            compute = c0.elapsed().as_secs_f64();
        }
        let t_wait = wtime();
        req.wait()?;
        let t_end = wtime();
        Ok(Times {
            total: t_end - t0,
            compute,
            post: t_posted - t0,
            wait: t_end - t_wait,
        })
    }

    /// Checks what every peer delivered in iteration `iter`; prints the first bad byte per peer.
    fn validate(&self, iter: u64, phase: &str) -> bool {
        let mut ok = true;
        for peer in 0..self.n {
            let block = &self.recv[peer * self.size..(peer + 1) * self.size];
            let dst = if self.coll.is_allgather() {
                ALL_PEERS
            } else {
                self.me as u32
            };
            if let Some((off, exp, got)) = pattern::first_mismatch(block, peer as u32, dst, iter) {
                eprintln!(
                    "coll-bench: VALIDATION FAILED: {} bytes={} phase={phase} rank={} peer={peer} \
                     offset={off} expected=0x{exp:02x} got=0x{got:02x}",
                    self.coll.name(),
                    self.size,
                    self.me
                );
                ok = false;
            }
        }
        ok
    }
}

/// One phase (pure or with compute): warmup + timed iterations; returns the local means of the
/// total time and of the compute time, and whether the last iteration's data was right.
/// Times of one iteration, or means over a phase (seconds).
#[derive(Clone, Copy, Debug, Default)]
struct Times {
    total: f64,
    compute: f64,
    post: f64,
    wait: f64,
}

fn phase(
    s: &mut Setup,
    phase_id: u64,
    iters: u32,
    warmup: u32,
    steps: Option<u64>,
    corrupt: bool,
) -> Result<(Times, bool), MpiError> {
    let total = warmup + iters;
    let mut sum = Times::default();
    for it in 0..total {
        let iter_id = (phase_id << 32) | it as u64;
        s.fill_send(iter_id);
        if it + 1 == total {
            s.sentinel_recv();
        }
        s.world.barrier()?;
        let t = s.run_once(steps)?;
        if it >= warmup {
            sum.total += t.total;
            sum.compute += t.compute;
            sum.post += t.post;
            sum.wait += t.wait;
        }
    }
    if corrupt && s.me == 0 {
        let last = s.recv.len() - 1;
        s.recv[last] ^= 0x01;
    }
    let ok = s.validate(
        (phase_id << 32) | (total - 1) as u64,
        if steps.is_some() { "compute" } else { "pure" },
    );
    let n = iters as f64;
    let mean = Times {
        total: sum.total / n,
        compute: sum.compute / n,
        post: sum.post / n,
        wait: sum.wait / n,
    };
    Ok((mean, ok))
}

fn run_size(
    world: Comm,
    coll: Coll,
    size: usize,
    args: &OverlapArgs,
    corrupt: bool,
) -> Result<Row, MpiError> {
    let me = world.rank()? as usize;
    let n = world.size()? as usize;
    let iters = args.iters.unwrap_or_else(|| default_iters(size));
    let warmup = args.warmup.unwrap_or_else(|| default_warmup(iters));
    let mut s = Setup {
        coll,
        world,
        me,
        n,
        size,
        // Never empty: two empty Vecs share one dangling address, and MPI rejects
        // sendbuf == recvbuf (that is what MPI_IN_PLACE is for) even for zero counts.
        send: vec![0; (if coll.is_allgather() { size } else { n * size }).max(1)],
        recv: vec![0; (n * size).max(1)],
        counts: vec![size as i32; n],
        displs: (0..n).map(|j| (j * size) as i32).collect(),
        byte: Datatype::byte()?,
    };
    let (pure, ok_pure) = phase(&mut s, 1, iters, warmup, None, corrupt)?;
    let t_pure = world.allreduce_f64(pure.total, consts::OP_MAX())?;
    // Every rank calibrates for the same target: the slowest rank's t_pure (the OSU method),
    // or a fixed time given on the command line.
    let target = args.compute_us.map_or(t_pure, |us| us as f64 * 1e-6);
    let steps = compute::calibrate(target);
    let (with, ok_compute) = phase(&mut s, 2, iters, warmup, Some(steps), false)?;
    let t_overall = world.allreduce_f64(with.total, consts::OP_MAX())?;
    let t_compute = world.allreduce_f64(with.compute, consts::OP_MAX())?;
    let t_post = world.allreduce_f64(with.post, consts::OP_MAX())?;
    let t_wait = world.allreduce_f64(with.wait, consts::OP_MAX())?;
    let validated = world.all_true(ok_pure && ok_compute)?;
    Ok(Row {
        bytes: size,
        pure_us: t_pure * 1e6,
        overall_us: t_overall * 1e6,
        compute_us: t_compute * 1e6,
        post_us: t_post * 1e6,
        wait_us: t_wait * 1e6,
        overlap_pct: overlap_pct(t_pure, t_overall, t_compute),
        validated,
        iters,
        warmup,
    })
}

/// Reports a failed MPI call and aborts the job (other ranks may be blocked in a collective).
fn fail(e: MpiError) -> ! {
    eprintln!("coll-bench: {e}");
    Mpi::abort(1)
}

fn mode() -> &'static str {
    match std::env::var("LD_PRELOAD") {
        Ok(p) if p.contains("host_shim") => "offload",
        _ => "native",
    }
}

fn nodes() -> Result<u64, String> {
    match std::env::var("SPOFF_NODES") {
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("SPOFF_NODES={v:?} is not a positive integer")),
        Err(_) => Ok(1),
    }
}

fn json_line(coll: Coll, row: &Row, ranks: usize, nodes: u64, mode: &str) -> String {
    serde_json::json!({
        "coll": coll.name(),
        "bytes": row.bytes,
        "ranks": ranks,
        "nodes": nodes,
        "pure_us": row.pure_us,
        "overall_us": row.overall_us,
        "compute_us": row.compute_us,
        "post_us": row.post_us,
        "wait_us": row.wait_us,
        "overlap_pct": row.overlap_pct,
        "validated": row.validated,
        "iters": row.iters,
        "warmup": row.warmup,
        "mode": mode,
        "design": serde_json::Value::Null,
    })
    .to_string()
}

fn overlap(args: OverlapArgs) -> i32 {
    let coll = args.coll;
    let nodes = match nodes() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("coll-bench: {e}");
            return 2;
        }
    };
    let mpi = match Mpi::init() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("coll-bench: {e}");
            return 1;
        }
    };
    let world = mpi.world();
    let me = world.rank().unwrap_or_else(|e| fail(e));
    let ranks = world.size().unwrap_or_else(|e| fail(e)) as usize;
    // Displacements are ints in elements of MPI_BYTE: ranks * size must fit.
    if let Some(&bad) = args
        .sizes
        .iter()
        .find(|&&s| !matches!(s.checked_mul(ranks), Some(t) if t <= i32::MAX as usize))
    {
        if me == 0 {
            eprintln!(
                "coll-bench: size {bad} x {ranks} ranks does not fit MPI int displacements \
                 (at most {} bytes per rank in total)",
                i32::MAX
            );
        }
        let _ = mpi.finalize();
        return 2;
    }
    let mode = mode();
    let mut json = None;
    if me == 0 {
        if let Some(path) = &args.json {
            match File::create(path) {
                Ok(f) => json = Some(BufWriter::new(f)),
                Err(e) => {
                    eprintln!("coll-bench: cannot create {}: {e}", path.display());
                    Mpi::abort(2);
                }
            }
        }
        println!(
            "# coll-bench overlap: coll={} ranks={ranks} nodes={nodes} mode={mode}",
            coll.name()
        );
        println!(
            "{:>10} {:>12} {:>12} {:>12} {:>9} {:>9} {:>11} {:>9}",
            "bytes",
            "pure_us",
            "overall_us",
            "compute_us",
            "post_us",
            "wait_us",
            "overlap_pct",
            "validated"
        );
    }
    let mut all_ok = true;
    for (k, &size) in args.sizes.iter().enumerate() {
        let corrupt = args.self_test_corrupt && Some(k) == args.sizes.iter().position(|&s| s > 0);
        let row = run_size(world, coll, size, &args, corrupt).unwrap_or_else(|e| fail(e));
        all_ok &= row.validated;
        if me == 0 {
            println!(
                "{:>10} {:>12.2} {:>12.2} {:>12.2} {:>9.2} {:>9.2} {:>11.1} {:>9}",
                row.bytes,
                row.pure_us,
                row.overall_us,
                row.compute_us,
                row.post_us,
                row.wait_us,
                row.overlap_pct,
                row.validated
            );
            let _ = std::io::stdout().flush();
            if let Some(w) = json.as_mut() {
                let line = json_line(coll, &row, ranks, nodes, mode);
                if let Err(e) = writeln!(w, "{line}").and_then(|_| w.flush()) {
                    eprintln!("coll-bench: writing JSON: {e}");
                    Mpi::abort(2);
                }
            }
        }
    }
    if me == 0 && !all_ok {
        eprintln!("coll-bench: validation failed for at least one size (see messages above)");
    }
    if let Err(e) = mpi.finalize() {
        eprintln!("coll-bench: {e}");
        return 1;
    }
    if all_ok {
        0
    } else {
        1
    }
}

fn read_rows(path: &PathBuf) -> Result<Vec<serde_json::Value>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .map_err(|e| format!("{}:{}: not JSON: {e}", path.display(), i + 1))
        })
        .collect()
}

fn compare(args: CompareArgs) -> i32 {
    let (native, offload) = match (read_rows(&args.native), read_rows(&args.offload)) {
        (Ok(n), Ok(o)) => (n, o),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("coll-bench compare: {e}");
            return 2;
        }
    };
    // Rows of `late` runs carry tail_us and a delay; rows of `overlap` runs do not.
    let late = native
        .iter()
        .chain(&offload)
        .any(|r| r.get("tail_us").is_some());
    let key = |r: &serde_json::Value| {
        (
            r["coll"].as_str().unwrap_or("?").to_string(),
            r["bytes"].as_u64().unwrap_or(0),
            r["delay_ms"].as_u64().unwrap_or(0),
        )
    };
    let mut keys: Vec<(String, u64, u64)> = native.iter().chain(&offload).map(key).collect();
    keys.sort();
    keys.dedup();
    let find = |rows: &[serde_json::Value], k: &(String, u64, u64)| {
        rows.iter().find(|r| key(r) == *k).cloned()
    };
    let num = |r: &Option<serde_json::Value>, f: &str| r.as_ref().and_then(|r| r[f].as_f64());
    // Time the host spent in the collective's calls while it had compute to do.
    let host_us = |r: &Option<serde_json::Value>| Some(num(r, "post_us")? + num(r, "wait_us")?);
    let cell = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |v| format!("{v:.prec$}"));
    let late_header = [
        "coll",
        "bytes",
        "delay_ms",
        "native_tail_us",
        "offload_tail_us",
        "tail_ratio",
        "native_mean_in_call_us",
        "offload_mean_in_call_us",
        "validated",
    ];
    let overlap_header = [
        "coll",
        "bytes",
        "native_pure_us",
        "offload_pure_us",
        "pure_ratio",
        "native_overall_us",
        "offload_overall_us",
        "native_overlap_pct",
        "offload_overlap_pct",
        "native_host_us",
        "offload_host_us",
        "validated",
    ];
    let header: &[&str] = if late { &late_header } else { &overlap_header };
    let mut lines: Vec<Vec<String>> = Vec::new();
    let mut ok = true;
    for k in &keys {
        let (n, o) = (find(&native, k), find(&offload, k));
        let valid =
            |r: &Option<serde_json::Value>| r.as_ref().is_some_and(|r| r["validated"] == true);
        let both_valid = valid(&n) && valid(&o);
        ok &= both_valid;
        let ratio_of = |f: &str| match (num(&n, f), num(&o, f)) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        let validated = match (&n, &o) {
            (Some(_), Some(_)) => both_valid.to_string(),
            (None, _) => "no native row".into(),
            (_, None) => "no offload row".into(),
        };
        if late {
            lines.push(vec![
                k.0.clone(),
                k.1.to_string(),
                k.2.to_string(),
                cell(num(&n, "tail_us"), 1),
                cell(num(&o, "tail_us"), 1),
                cell(ratio_of("tail_us"), 2),
                cell(num(&n, "mean_in_call_us"), 1),
                cell(num(&o, "mean_in_call_us"), 1),
                validated,
            ]);
            continue;
        }
        lines.push(vec![
            k.0.clone(),
            k.1.to_string(),
            cell(num(&n, "pure_us"), 2),
            cell(num(&o, "pure_us"), 2),
            cell(ratio_of("pure_us"), 2),
            cell(num(&n, "overall_us"), 2),
            cell(num(&o, "overall_us"), 2),
            cell(num(&n, "overlap_pct"), 1),
            cell(num(&o, "overlap_pct"), 1),
            cell(host_us(&n), 1),
            cell(host_us(&o), 1),
            validated,
        ]);
    }
    let ctx = |rows: &[serde_json::Value]| {
        rows.first().map_or("-".to_string(), |r| {
            format!(
                "ranks={} nodes={} mode={}",
                r["ranks"],
                r["nodes"],
                r["mode"].as_str().unwrap_or("?")
            )
        })
    };
    let legend = if late {
        "tail_us = time from the last rank's entry to the last rank's exit; tail_ratio = native \
         tail_us / offload tail_us (above 1: the offload finishes sooner after the last arrival)."
    } else {
        "pure_ratio = native pure_us / offload pure_us; host_us = post_us + wait_us with compute \
         (time the host spent in MPI calls instead of computing)."
    };
    if args.markdown {
        println!(
            "Native: {}; offload: {}. {legend}",
            ctx(&native),
            ctx(&offload)
        );
        println!();
        println!("| {} |", header.join(" | "));
        println!(
            "|{}|",
            header.iter().map(|_| "---").collect::<Vec<_>>().join("|")
        );
        for l in &lines {
            println!("| {} |", l.join(" | "));
        }
    } else {
        println!(
            "# native: {}; offload: {}; {legend}",
            ctx(&native),
            ctx(&offload)
        );
        let widths: Vec<usize> = (0..header.len())
            .map(|i| {
                lines
                    .iter()
                    .map(|l| l[i].len())
                    .chain([header[i].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let row = |cells: Vec<&str>| {
            cells
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:>w$}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        println!("{}", row(header.to_vec()));
        for l in &lines {
            println!("{}", row(l.iter().map(String::as_str).collect()));
        }
    }
    if !ok {
        eprintln!("coll-bench compare: some sizes did not validate or are missing on one side");
        return 1;
    }
    0
}

fn traffic_table(args: TrafficTableArgs) -> i32 {
    let mut rows = Vec::new();
    for f in &args.files {
        match read_rows(f) {
            Ok(r) => rows.extend(r),
            Err(e) => {
                eprintln!("coll-bench traffic-table: {e}");
                return 2;
            }
        }
    }
    let (text, ok) = coll_bench::traffic::render_table(&rows, args.markdown);
    print!("{text}");
    if !ok {
        eprintln!("coll-bench traffic-table: some rows did not validate");
        return 1;
    }
    0
}

mod late;
mod traffic_run;

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Compare(args) => compare(args),
        Command::Late(args) => late::late(args),
        Command::Traffic(args) => traffic_run::traffic(args),
        Command::TrafficTable(args) => traffic_table(args),
        Command::Overlap(args) => {
            if !args.coll.implemented() {
                eprintln!(
                    "coll-bench: --coll {} is not implemented yet (implemented: ialltoallv, \
                     ialltoall, iallgatherv, iallgather)",
                    args.coll.name()
                );
                std::process::exit(2);
            }
            overlap(args)
        }
    };
    std::process::exit(code);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_formula() {
        assert_eq!(overlap_pct(10.0, 10.0, 10.0), 100.0);
        assert_eq!(overlap_pct(10.0, 20.0, 10.0), 0.0);
        assert_eq!(overlap_pct(10.0, 15.0, 10.0), 50.0);
        assert_eq!(overlap_pct(10.0, 30.0, 10.0), 0.0);
        assert_eq!(overlap_pct(0.0, 1.0, 1.0), 0.0);
    }

    #[test]
    fn cli_parses() {
        let cli = Cli::try_parse_from([
            "coll-bench",
            "overlap",
            "--coll",
            "ialltoallv",
            "--sizes",
            "1K,4M",
        ])
        .unwrap();
        let Command::Overlap(a) = cli.command else {
            panic!("not overlap")
        };
        assert_eq!(a.sizes, vec![1024, 4 << 20]);
        assert!(Cli::try_parse_from(["coll-bench", "overlap", "--coll", "nope"]).is_err());
        assert!(Cli::try_parse_from([
            "coll-bench",
            "overlap",
            "--coll",
            "ialltoall",
            "--iters",
            "0"
        ])
        .is_err());
    }
}
