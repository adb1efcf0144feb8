//! `coll-bench late`: a blocking collective where one rank per node enters late.
//!
//! Per size and iteration: a barrier, then the late ranks sleep `--delay-ms` (sleeping, not
//! computing, so that on a small machine they do not take CPU from the SPs), every rank notes
//! its entry time, calls the collective and notes its exit time. All ranks run on one machine,
//! so `CLOCK_MONOTONIC` is one clock for all of them (`MPI_Wtime` is not: Open MPI counts it
//! from a per-process origin). Reported per size (means over iterations):
//! - `tail_us`: from the last rank's entry to the last rank's exit, i.e. how long the
//!   collective still takes once everybody has arrived (what a late rank costs everyone);
//! - `mean_in_call_us`: the mean over ranks of the time spent inside the call (early ranks wait
//!   there for the late one).
//!
//! The late rank of each node is its last local rank, from SPOFF_NODES,
//! SPOFF_RANKS_PER_NODE and SPOFF_LAYOUT (block or cyclic, as set by `service-process launch`);
//! without them every rank is its own node.

use crate::run::{self, fail};
use clap::{Args, ValueEnum};
use coll_bench::mpi::{Comm, Datatype, Mpi, MpiError};
use coll_bench::{parse_size, pattern};
use mpi_ffi::consts;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LateColl {
    /// MPI_Allgatherv, every rank contributes SIZE bytes
    Allgatherv,
    /// MPI_Allgather, every rank contributes SIZE bytes
    Allgather,
}

impl LateColl {
    fn name(self) -> &'static str {
        match self {
            LateColl::Allgatherv => "allgatherv",
            LateColl::Allgather => "allgather",
        }
    }
}

#[derive(Args, Debug)]
pub struct LateArgs {
    /// Collective to measure (blocking).
    #[arg(long, value_enum)]
    coll: LateColl,
    /// How late the late rank of every node enters the call, in milliseconds.
    #[arg(long, default_value_t = 10)]
    delay_ms: u64,
    /// Comma-separated sizes in bytes per rank; K/M suffixes are 1024-based.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "64K,1M")]
    sizes: Vec<usize>,
    /// Timed iterations per size.
    #[arg(long, default_value_t = 10)]
    iters: u32,
    /// Untimed iterations before them.
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// Also write one JSON object per size per line (rank 0 only).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// Seconds on the machine-wide monotonic clock (comparable between processes of one machine).
fn machine_time() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is valid for writes; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn env_u32(name: &str) -> Option<u32> {
    std::env::var(name)
        .ok()?
        .trim()
        .parse()
        .ok()
        .filter(|&n| n > 0)
}

/// Whether `rank` of `size` is the late rank of its node (its last local rank; a last node that
/// is not full has none).
fn is_late(rank: u32, size: u32) -> bool {
    let nodes = env_u32("SPOFF_NODES").unwrap_or(size);
    let per_node = env_u32("SPOFF_RANKS_PER_NODE").unwrap_or_else(|| size.div_ceil(nodes));
    let cyclic = std::env::var("SPOFF_LAYOUT").is_ok_and(|l| l.trim() == "cyclic");
    let local = if cyclic {
        rank / nodes
    } else {
        rank % per_node
    };
    local + 1 == per_node
}

struct Row {
    bytes: usize,
    tail_us: f64,
    mean_in_call_us: f64,
    validated: bool,
}

fn run_size(world: Comm, coll: LateColl, size: usize, args: &LateArgs) -> Result<Row, MpiError> {
    let me = world.rank()? as u32;
    let n = world.size()? as usize;
    let late = is_late(me, n as u32);
    let byte = Datatype::byte()?;
    let mut send = vec![0u8; size.max(1)];
    let mut recv = vec![0xA5u8; (n * size).max(1)];
    let counts = vec![size as i32; n];
    let displs: Vec<i32> = (0..n).map(|j| (j * size) as i32).collect();
    let (mut tail, mut in_call) = (0.0, 0.0);
    let total = args.warmup + args.iters;
    for it in 0..total {
        pattern::fill(&mut send[..size], me, u32::MAX, it as u64);
        world.barrier()?;
        if late && args.delay_ms > 0 {
            std::thread::sleep(Duration::from_millis(args.delay_ms));
        }
        let enter = machine_time();
        match coll {
            LateColl::Allgatherv => {
                world.allgatherv(&send, size as i32, &mut recv, &counts, &displs, &byte)?
            }
            LateColl::Allgather => world.allgather(&send, &mut recv, size as i32, &byte)?,
        }
        let exit = machine_time();
        let last_enter = world.allreduce_f64(enter, consts::OP_MAX())?;
        let last_exit = world.allreduce_f64(exit, consts::OP_MAX())?;
        let sum_in_call = world.allreduce_f64(exit - enter, consts::OP_SUM())?;
        if it >= args.warmup {
            tail += last_exit - last_enter;
            in_call += sum_in_call / n as f64;
        }
    }
    let last = total - 1;
    let mut ok = true;
    for peer in 0..n {
        let block = &recv[peer * size..(peer + 1) * size];
        if let Some((off, exp, got)) =
            pattern::first_mismatch(block, peer as u32, u32::MAX, last as u64)
        {
            eprintln!(
                "coll-bench late: VALIDATION FAILED: {} bytes={size} rank={me} peer={peer} \
                 offset={off} expected=0x{exp:02x} got=0x{got:02x}",
                coll.name()
            );
            ok = false;
        }
    }
    let iters = args.iters.max(1) as f64;
    Ok(Row {
        bytes: size,
        tail_us: tail / iters * 1e6,
        mean_in_call_us: in_call / iters * 1e6,
        validated: world.all_true(ok)?,
    })
}

pub fn late(args: LateArgs) -> i32 {
    let Some(mpi) = run::init() else {
        return 1;
    };
    let world = mpi.world();
    let me = world.rank().unwrap_or_else(|e| fail(e));
    let ranks = world.size().unwrap_or_else(|e| fail(e));
    let nodes = env_u32("SPOFF_NODES").unwrap_or(1);
    let mode = run::mode();
    let mut json = None;
    if me == 0 {
        json = run::create_json(&args.json);
        println!(
            "# coll-bench late: coll={} ranks={ranks} nodes={nodes} mode={mode} delay_ms={}",
            args.coll.name(),
            args.delay_ms
        );
        println!(
            "{:>10} {:>12} {:>16} {:>9}",
            "bytes", "tail_us", "mean_in_call_us", "validated"
        );
    }
    let mut all_ok = true;
    for &size in &args.sizes {
        let row = run_size(world, args.coll, size, &args).unwrap_or_else(|e| fail(e));
        all_ok &= row.validated;
        if me == 0 {
            println!(
                "{:>10} {:>12.2} {:>16.2} {:>9}",
                row.bytes, row.tail_us, row.mean_in_call_us, row.validated
            );
            if let Some(f) = json.as_mut() {
                let line = serde_json::json!({
                    "coll": args.coll.name(),
                    "bytes": row.bytes,
                    "ranks": ranks,
                    "nodes": nodes,
                    "delay_ms": args.delay_ms,
                    "tail_us": row.tail_us,
                    "mean_in_call_us": row.mean_in_call_us,
                    "validated": row.validated,
                    "mode": mode,
                });
                if writeln!(f, "{line}").is_err() {
                    eprintln!("coll-bench: writing JSON failed");
                    Mpi::abort(2);
                }
            }
        }
    }
    run::finish(mpi, all_ok)
}
