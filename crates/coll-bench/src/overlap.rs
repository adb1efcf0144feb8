//! `coll-bench overlap`: communication/computation overlap of a nonblocking collective, OSU
//! method (see `coll-bench overlap --help`).

mod breakdown;
mod setup;

use crate::coll::{check_design, size_error, Coll, DataLayout, Design};
use crate::run::{self, fail};
use clap::Args;
use coll_bench::mpi::{wtime, Comm, Datatype, Mpi, MpiError};
use coll_bench::{compute, parse_size, strided};
use mpi_ffi::consts;
use setup::{Placed, Setup, Times};
use std::io::{BufWriter, Write};
use std::path::PathBuf;

const DEFAULT_SIZES: &str = "1K,4K,16K,64K,256K,1M,4M";

#[derive(Args, Debug)]
pub struct OverlapArgs {
    /// Collective to measure.
    #[arg(long, value_enum)]
    pub coll: Coll,

    /// Comma-separated sizes in bytes: per pair for the alltoalls (each rank sends SIZE bytes
    /// to every rank, itself included), per rank for the allgathers, the message for ibcast;
    /// K/M/G suffixes are 1024-based.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = DEFAULT_SIZES)]
    pub sizes: Vec<usize>,

    /// Timed iterations per phase and size [default: 16 MiB / SIZE, clamped to 10..=100].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    iters: Option<u32>,

    /// Untimed warmup iterations before each phase [default: iters / 10, at least 2].
    #[arg(long)]
    warmup: Option<u32>,

    /// Compute for this many microseconds of CPU time per iteration instead of t_pure (the OSU
    /// choice).
    /// A compute longer than the communication shows what the host still pays: post_us +
    /// wait_us.
    #[arg(long, value_name = "US")]
    compute_us: Option<u64>,

    /// Also write one JSON object per size per line (JSON Lines) to FILE (rank 0 only).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,

    /// Design of the offloaded collective, for ibcast (flat, hier, auto, mcast) and iallgather
    /// (flat, hier, lb, auto, mcast); the other collectives take only auto. Before MPI_Init this process sets
    /// SPOFF_BCAST_DESIGN (ibcast) or SPOFF_IALLGATHER_DESIGN (iallgather) to it, overriding
    /// the environment; the shim reads the variable when the collective is posted. It only
    /// matters when the host shim is preloaded (natively nothing reads it; a shim that does not
    /// know the variable ignores it). auto lets the shim choose by the number of ranks per
    /// service process. Recorded as `design` in the JSON lines.
    #[arg(long, value_enum, default_value_t = Design::Auto)]
    pub design: Design,

    /// How the data are described to MPI. byte: SIZE x MPI_BYTE, contiguous. strided: every 8
    /// bytes of data followed by an 8-byte hole (MPI_Type_create_resized of 8 contiguous
    /// bytes to an extent of 16; SIZE must be a multiple of 8), so the buffers are twice as
    /// long, the holes must stay untouched, and the offloaded path packs and unpacks the data
    /// on the host (the packing cost shows in post_us and wait_us). Recorded as `datatype` in
    /// the JSON lines.
    #[arg(long, value_enum, default_value_t = DataLayout::Byte)]
    datatype: DataLayout,

    /// Where the buffers start: the send buffer on a page boundary, the receive buffer this
    /// many bytes past one (0-4095). Copies between two buffers whose addresses differ by 1-31
    /// bytes within a cache line are several times slower on some CPUs (docs/BENCHMARKS.md, O,
    /// "Alignment"); natively and offloaded alike, this shows what such buffers cost.
    #[arg(long, value_name = "BYTES", default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..4096))]
    recv_offset: u16,

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
    /// The median per call of post + wait with compute (the slowest rank's).
    host_p50_us: f64,
    /// The same over the calls no involuntary context switch reached (the slowest rank's),
    /// and the share of calls one did reach (the largest over ranks).
    host_p50_quiet_us: Option<f64>,
    /// The medians of the post alone and of the wait alone over those calls (the slowest
    /// rank's each; `None` as above).
    quiet_post_wait_us: Option<(f64, f64)>,
    preempted_pct: f64,
    /// Wall-clock time per timed iteration of the compute phase, each iteration's setup and
    /// barrier included: the loop's own time to solution (where ranks share a core, the OSU
    /// per-rank times swing with how the scheduler interleaves the ranks; this moves in whole
    /// scheduler ticks).
    loop_us: f64,
    overlap_pct: f64,
    validated: bool,
    iters: u32,
    warmup: u32,
    /// Where rank 0's offloaded calls of the pure phase spent their time (`None`: no shim).
    breakdown: Option<breakdown::Stages>,
    /// One `process_vm_readv` of the size, on this machine (µs, median).
    readv_us: f64,
}

/// The median of `v` (the upper one of an even count; 0 for none).
fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn overlap_pct(pure: f64, overall: f64, compute: f64) -> f64 {
    if pure <= 0.0 {
        return 0.0;
    }
    (100.0 - 100.0 * (overall - compute) / pure).clamp(0.0, 100.0)
}

/// One phase (pure or with compute): warmup + timed iterations; returns the local means of the
/// times, and whether the last iteration's data was right.
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
    let mut host: Vec<f64> = Vec::with_capacity(iters as usize);
    let mut quiet: Vec<f64> = Vec::with_capacity(iters as usize);
    let mut quiet_post: Vec<f64> = Vec::with_capacity(iters as usize);
    let mut quiet_wait: Vec<f64> = Vec::with_capacity(iters as usize);
    let mut timed_from = wtime();
    for it in 0..total {
        if it == warmup {
            timed_from = wtime();
            if steps.is_none() {
                breakdown::reset();
            }
        }
        let iter_id = (phase_id << 32) | it as u64;
        if it + 1 == total {
            s.sentinel_recv();
        }
        s.prepare(iter_id);
        s.world.barrier()?;
        let switches = involuntary_switches();
        let t = s.run_once(steps)?;
        if it >= warmup && involuntary_switches() == switches {
            quiet.push(t.post + t.wait);
            quiet_post.push(t.post);
            quiet_wait.push(t.wait);
        }
        if it >= warmup {
            sum.total += t.total;
            sum.compute += t.compute;
            sum.post += t.post;
            sum.wait += t.wait;
            host.push(t.post + t.wait);
        }
    }
    let timed_to = wtime();
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
        iteration: (timed_to - timed_from) / n,
        host_p50: median(&mut host),
        preempted_pct: 100.0 * (host.len() - quiet.len()) as f64 / n,
        host_p50_quiet: if quiet.is_empty() {
            -1.0
        } else {
            median(&mut quiet)
        },
        post_p50_quiet: if quiet.is_empty() {
            -1.0
        } else {
            median(&mut quiet_post)
        },
        wait_p50_quiet: if quiet.is_empty() {
            -1.0
        } else {
            median(&mut quiet_wait)
        },
    };
    Ok((mean, ok))
}

/// The calling thread's involuntary context switches so far (the kernel took its CPU).
fn involuntary_switches() -> i64 {
    // SAFETY: an all-zero rusage is valid; getrusage writes into it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid `who` and out-pointer.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) } != 0 {
        return -1;
    }
    u.ru_nivcsw
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
    let (send_len, recv_len) = coll.buffer_lens(n, size);
    let strided = args.datatype == DataLayout::Strided;
    // Elements per block, and how much of a buffer the data of one byte take.
    let (count, ty, widen) = if strided {
        (size / strided::DATA, Datatype::strided()?, 2)
    } else {
        (size, Datatype::byte()?, 1)
    };
    let mut s = Setup {
        coll,
        world,
        me,
        n,
        size,
        // Never empty: two empty Vecs share one dangling address, and MPI rejects
        // sendbuf == recvbuf (that is what MPI_IN_PLACE is for) even for zero counts.
        send: Placed::new((send_len * widen).max(1), 0),
        recv: Placed::new((recv_len * widen).max(1), args.recv_offset as usize),
        counts: vec![count as i32; n],
        displs: (0..n).map(|j| (j * count) as i32).collect(),
        ty,
        strided,
        root: 0,
    };
    let (pure, ok_pure) = phase(&mut s, 1, iters, warmup, None, corrupt)?;
    let stages = breakdown::read();
    let readv_us = breakdown::readv_us(size, 50);
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
    let t_loop = world.allreduce_f64(with.iteration, consts::OP_MAX())?;
    let t_host_p50 = world.allreduce_f64(with.host_p50, consts::OP_MAX())?;
    // None when some rank had no call that preemption did not reach.
    let t_host_quiet = world.allreduce_f64(with.host_p50_quiet, consts::OP_MAX())?;
    let every_rank_quiet = world.allreduce_f64(with.host_p50_quiet, consts::OP_MIN())? >= 0.0;
    let quiet_post = world.allreduce_f64(with.post_p50_quiet, consts::OP_MAX())?;
    let quiet_wait = world.allreduce_f64(with.wait_p50_quiet, consts::OP_MAX())?;
    let preempted = world.allreduce_f64(with.preempted_pct, consts::OP_MAX())?;
    let validated = world.all_true(ok_pure && ok_compute)?;
    Ok(Row {
        bytes: size,
        pure_us: t_pure * 1e6,
        overall_us: t_overall * 1e6,
        compute_us: t_compute * 1e6,
        post_us: t_post * 1e6,
        wait_us: t_wait * 1e6,
        host_p50_us: t_host_p50 * 1e6,
        host_p50_quiet_us: every_rank_quiet.then_some(t_host_quiet * 1e6),
        quiet_post_wait_us: every_rank_quiet.then_some((quiet_post * 1e6, quiet_wait * 1e6)),
        preempted_pct: preempted,
        loop_us: t_loop * 1e6,
        overlap_pct: overlap_pct(t_pure, t_overall, t_compute),
        validated,
        iters,
        warmup,
        breakdown: stages,
        readv_us,
    })
}

/// One `overlap --json` line; `design` is null for collectives without a design choice.
fn json_line(
    coll: Coll,
    row: &Row,
    ranks: usize,
    nodes: u64,
    mode: &str,
    design: Option<&str>,
    datatype: DataLayout,
) -> String {
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
        "host_p50_us": row.host_p50_us,
        "host_p50_quiet_us": row.host_p50_quiet_us,
        "post_p50_quiet_us": row.quiet_post_wait_us.map(|p| p.0),
        "wait_p50_quiet_us": row.quiet_post_wait_us.map(|p| p.1),
        "preempted_pct": row.preempted_pct,
        "loop_us": row.loop_us,
        "overlap_pct": row.overlap_pct,
        "validated": row.validated,
        "iters": row.iters,
        "warmup": row.warmup,
        "mode": mode,
        "design": design,
        "datatype": datatype.name(),
        "readv_us": row.readv_us,
        "breakdown": row.breakdown.as_ref().map(breakdown::json),
    })
    .to_string()
}

pub fn overlap(args: OverlapArgs) -> i32 {
    let coll = args.coll;
    if let Err(e) = check_design(coll, args.design) {
        eprintln!("coll-bench: {e}");
        return 2;
    }
    if coll == Coll::Iallreduce && args.datatype == DataLayout::Strided {
        eprintln!(
            "coll-bench: --coll iallreduce sums contiguous 64-bit integers: --datatype byte only"
        );
        return 2;
    }
    let nodes = match run::nodes() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("coll-bench: {e}");
            return 2;
        }
    };
    // The shim reads the design once, at the first collective that needs it; set it before
    // MPI_Init, while this process has a single thread.
    let design = coll.design_env().map(|var| {
        std::env::set_var(var, args.design.name());
        args.design.name()
    });
    let Some(mpi) = run::init() else {
        return 1;
    };
    let world = mpi.world();
    let me = world.rank().unwrap_or_else(|e| fail(e));
    let ranks = world.size().unwrap_or_else(|e| fail(e)) as usize;
    let strided_size = (args.datatype == DataLayout::Strided)
        .then(|| args.sizes.iter().find(|&&s| s % strided::DATA != 0))
        .flatten()
        .map(|s| format!("--datatype strided needs sizes that are multiples of 8, not {s}"));
    if let Some(e) = strided_size.or_else(|| size_error(coll, &args.sizes, ranks)) {
        if me == 0 {
            eprintln!("coll-bench: {e}");
        }
        let _ = mpi.finalize();
        return 2;
    }
    let mode = run::mode();
    let mut json = None;
    if me == 0 {
        json = run::create_json(&args.json).map(BufWriter::new);
        println!(
            "# coll-bench overlap: coll={} ranks={ranks} nodes={nodes} mode={mode}{}{}",
            coll.name(),
            design.map_or(String::new(), |d| format!(" design={d}")),
            match args.recv_offset {
                0 => String::new(),
                o => format!(" recv_offset={o}"),
            }
        );
        println!(
            "{:>10} {:>12} {:>12} {:>12} {:>9} {:>9} {:>12} {:>11} {:>11} {:>9}",
            "bytes",
            "pure_us",
            "overall_us",
            "compute_us",
            "post_us",
            "wait_us",
            "loop_us",
            "overlap_pct",
            "host_p50_us",
            "validated"
        );
    }
    let mut all_ok = true;
    let mut stages = Vec::new();
    let mut quiet = Vec::new();
    for (k, &size) in args.sizes.iter().enumerate() {
        let corrupt = args.self_test_corrupt && Some(k) == args.sizes.iter().position(|&s| s > 0);
        let row = run_size(world, coll, size, &args, corrupt).unwrap_or_else(|e| fail(e));
        all_ok &= row.validated;
        if me == 0 {
            println!(
                "{:>10} {:>12.2} {:>12.2} {:>12.2} {:>9.2} {:>9.2} {:>12.1} {:>11.1} {:>11.2} {:>9}",
                row.bytes,
                row.pure_us,
                row.overall_us,
                row.compute_us,
                row.post_us,
                row.wait_us,
                row.loop_us,
                row.overlap_pct,
                row.host_p50_us,
                row.validated
            );
            let _ = std::io::stdout().flush();
            quiet.push((
                row.bytes,
                row.host_p50_quiet_us,
                row.quiet_post_wait_us,
                row.preempted_pct,
            ));
            if let Some(b) = row.breakdown {
                stages.push((row.bytes, b, row.readv_us));
            }
            if let Some(w) = json.as_mut() {
                let line = json_line(coll, &row, ranks, nodes, mode, design, args.datatype);
                if let Err(e) = writeln!(w, "{line}").and_then(|_| w.flush()) {
                    eprintln!("coll-bench: writing JSON: {e}");
                    Mpi::abort(2);
                }
            }
        }
    }
    if me == 0 && args.compute_us.is_some() {
        // With a fixed compute: how much of the host's time in MPI preemption explains.
        println!(
            "# host_p50_us over the calls no involuntary context switch reached (the rank's CPU \
             kept from the post to the end of the wait, the compute included), and the share \
             of calls one reached:"
        );
        for (bytes, us, split, pct) in quiet {
            let us = match (us, split) {
                (Some(us), Some((post, wait))) => {
                    format!("{us:.2} (post alone {post:.2}, wait alone {wait:.2})")
                }
                _ => "none (every call was reached)".into(),
            };
            println!("#   {bytes:>10} B: host_p50_quiet_us {us}, preempted {pct:.1} % of calls");
        }
    }
    if me == 0 && !stages.is_empty() {
        print!("{}", breakdown::table(&stages));
    }
    if me == 0 && !all_ok {
        eprintln!("coll-bench: validation failed for at least one size (see messages above)");
    }
    run::finish(mpi, all_ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value as Json;

    /// The count `host_p50_quiet_us` relies on sees preemption: two threads that spin on one
    /// CPU take it from each other, and the spinning thread's count grows.
    #[test]
    fn involuntary_switches_count_a_cpu_taken_away() {
        // The first CPU this process may use (CPU 0 may be outside a container's set).
        // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity writes inside it.
        let cpu = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(
                libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set),
                0
            );
            (0..libc::CPU_SETSIZE as usize)
                .find(|&c| libc::CPU_ISSET(c, &set))
                .expect("some CPU")
        };
        let pin_here = move || {
            // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(cpu, &mut set);
                assert_eq!(
                    libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set),
                    0
                );
            }
        };
        let spin = |ms: u64| {
            let t = std::time::Instant::now();
            while t.elapsed() < std::time::Duration::from_millis(ms) {
                std::hint::spin_loop();
            }
        };
        std::thread::scope(|sc| {
            pin_here();
            sc.spawn(move || {
                pin_here();
                spin(300);
            });
            let at = involuntary_switches();
            spin(300);
            let after = involuntary_switches();
            assert!(
                after > at,
                "300 ms sharing a CPU with a spinner: {at} -> {after}"
            );
        });
    }

    #[test]
    fn overlap_formula() {
        assert_eq!(overlap_pct(10.0, 10.0, 10.0), 100.0);
        assert_eq!(overlap_pct(10.0, 20.0, 10.0), 0.0);
        assert_eq!(overlap_pct(10.0, 15.0, 10.0), 50.0);
        assert_eq!(overlap_pct(10.0, 30.0, 10.0), 0.0);
        assert_eq!(overlap_pct(0.0, 1.0, 1.0), 0.0);
    }

    fn test_row() -> Row {
        Row {
            bytes: 1024,
            pure_us: 1.0,
            overall_us: 2.0,
            compute_us: 1.0,
            post_us: 0.5,
            wait_us: 0.5,
            host_p50_us: 1.0,
            host_p50_quiet_us: Some(1.0),
            quiet_post_wait_us: Some((0.4, 0.5)),
            preempted_pct: 0.0,
            loop_us: 3.0,
            overlap_pct: 0.0,
            validated: true,
            iters: 5,
            warmup: 2,
            breakdown: None,
            readv_us: 0.5,
        }
    }

    #[test]
    fn json_design_field() {
        let parse = |s: String| serde_json::from_str::<Json>(&s).unwrap();
        let v = parse(json_line(
            Coll::Ibcast,
            &test_row(),
            4,
            2,
            "native",
            Some("hier"),
            DataLayout::Strided,
        ));
        assert_eq!(v["design"], "hier");
        assert_eq!(v["datatype"], "strided");
        assert_eq!(v["coll"], "ibcast");
        assert_eq!(v["bytes"], 1024);
        let v = parse(json_line(
            Coll::Ialltoallv,
            &test_row(),
            4,
            2,
            "native",
            None,
            DataLayout::Byte,
        ));
        assert!(v["design"].is_null());
    }

    #[test]
    fn json_quiet_post_and_wait_are_null_when_no_call_was_quiet() {
        let parse = |s: String| serde_json::from_str::<Json>(&s).unwrap();
        let line = |row: &Row| {
            parse(json_line(
                Coll::Ialltoallv,
                row,
                2,
                1,
                "offload",
                None,
                DataLayout::Byte,
            ))
        };
        let v = line(&test_row());
        assert_eq!(v["post_p50_quiet_us"], 0.4);
        assert_eq!(v["wait_p50_quiet_us"], 0.5);
        let none = Row {
            host_p50_quiet_us: None,
            quiet_post_wait_us: None,
            ..test_row()
        };
        let v = line(&none);
        assert!(v["host_p50_quiet_us"].is_null());
        assert!(v["post_p50_quiet_us"].is_null() && v["wait_p50_quiet_us"].is_null());
    }
}
