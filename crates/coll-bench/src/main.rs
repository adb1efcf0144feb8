//! `coll-bench`: see `coll-bench --help`.

use clap::{Args, Parser, Subcommand, ValueEnum};
use coll_bench::mpi::{wtime, Comm, Datatype, Mpi, MpiError};
use coll_bench::{compute, parse_size, pattern, strided};
use mpi_ffi::consts;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

const DEFAULT_SIZES: &str = "1K,4K,16K,64K,256K,1M,4M";
/// The "destination" of an allgather block in the data pattern: every rank gets the same one.
const ALL_PEERS: u32 = u32::MAX;
/// What a receive buffer holds before a collective (and its holes after it).
const SENTINEL: u8 = 0xA5;

#[derive(Parser, Debug)]
#[command(
    name = "coll-bench",
    version,
    about = "Benchmarks for MPI collectives (`overlap`, `late`, `traffic` run under mpirun).",
    long_about = "Benchmarks for MPI collectives. An ordinary MPI program: run `overlap`, \
                  `late` and `traffic` under mpirun (or `service-process launch`), natively or \
                  with the host shim LD_PRELOADed (the same binary serves both); `compare` puts \
                  a native result and one or more offloaded results side by side and `traffic-table` renders \
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
    /// compute for t_pure or --compute-us (a busy loop of arithmetic calibrated once per size
    /// to that much of the rank's CPU time, no MPI calls), wait; t_overall and t_compute (its
    /// wall-clock time) are the means (maximum over ranks), and so are post_us and wait_us,
    /// the time spent in the post call and in the wait call; loop_us is the wall-clock time per
    /// iteration of that phase, each iteration's setup (the send buffer refilled with the
    /// validation pattern) and barrier included (maximum over ranks).
    /// overlap_pct = 100 - 100 * (t_overall - t_compute) / t_pure, clamped to [0, 100].
    ///
    /// Every iteration sends a pattern derived from (sender, receiver, iteration, byte); the
    /// receive buffer is pre-filled with a sentinel and checked exactly after the last iteration
    /// of each phase. For ibcast the root is rank (iteration % ranks), so it rotates through
    /// every rank; the root's buffer carries the pattern and every rank, the root included,
    /// checks its buffer. A failed check prints rank, peer (root) and offset, and the exit code
    /// is 1 (after the table). Rank 0 prints the table; --json writes one JSON object per size
    /// per line with: coll, bytes, ranks, nodes (env SPOFF_NODES, default 1), pure_us,
    /// overall_us, compute_us, post_us, wait_us, loop_us, overlap_pct, validated, iters, warmup,
    /// mode ("offload" if LD_PRELOAD contains host_shim, else "native") and design (the --design
    /// given for ibcast and iallgather, e.g. "auto"; null for the other collectives, which have
    /// no design choice).
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

    /// Compares a native run with one or more offloaded runs (`overlap` or `late` --json).
    ///
    /// With one --offload: joins the two JSON Lines files on (coll, bytes, design) (and
    /// delay_ms for `late` rows) and prints, per row: pure_us, overall_us and overlap_pct of
    /// both, the pure-latency ratio native/offload (above 1 means the offload is faster), the
    /// host time of both and whether both runs validated. A design column is shown when some
    /// row has a design. An offload row whose design the native file lacks is joined with the
    /// native file's rows of that (coll, bytes) if they all have one design (the design changes
    /// nothing natively): one native run serves offloaded runs of several designs, e.g. an
    /// offload file holding a flat and a hier run. Rows present on only one side are listed too.
    ///
    /// With several --offload files (e.g. `--offload flat.json --offload hier.json`): one
    /// table, rows joined on (coll, bytes) (and delay_ms), design ignored: the native columns,
    /// then one column group per offload file, labelled by its design (by its file name if its
    /// rows do not share one design): LABEL_pure_us, LABEL_pure_ratio (native / LABEL),
    /// LABEL_overall_us, LABEL_overlap_pct, LABEL_host_us (`late`: LABEL_tail_us,
    /// LABEL_tail_ratio, LABEL_mean_in_call_us). A file with two rows for one (coll, bytes) is
    /// refused (exit code 2).
    ///
    /// Exit code 1 if a row did not validate or is missing on one side. Needs no MPI: run it
    /// directly, not under mpirun.
    Compare(CompareArgs),
}

#[derive(Args, Debug)]
struct CompareArgs {
    /// JSON Lines file of the native run.
    #[arg(long, value_name = "FILE")]
    native: PathBuf,

    /// JSON Lines file of an offloaded run; repeat for one column group per file.
    #[arg(long, value_name = "FILE", required = true)]
    offload: Vec<PathBuf>,

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

/// Collectives known to the command line.
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
    /// MPI_Ibcast, SIZE bytes (MPI_BYTE) from a root that rotates: rank (iteration % ranks)
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

    /// Allgather family: one send block of SIZE bytes, the same block goes to every rank.
    fn is_allgather(self) -> bool {
        matches!(self, Coll::Iallgatherv | Coll::Iallgather)
    }

    /// The environment variable through which the shim takes this collective's design, if it
    /// has a design choice.
    fn design_env(self) -> Option<&'static str> {
        match self {
            Coll::Ibcast => Some("SPOFF_BCAST_DESIGN"),
            Coll::Iallgather => Some("SPOFF_IALLGATHER_DESIGN"),
            _ => None,
        }
    }

    /// Bytes of the send and receive buffers for SIZE on `n` ranks (before the at-least-one
    /// rule of [`run_size`]). Ibcast has one buffer, here the receive buffer.
    fn buffer_lens(self, n: usize, size: usize) -> (usize, usize) {
        match self {
            Coll::Ibcast => (0, size),
            c if c.is_allgather() => (size, n * size),
            _ => (n * size, n * size),
        }
    }
}

/// How `overlap` describes its data to MPI (`--datatype`).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum DataLayout {
    /// contiguous MPI_BYTE
    Byte,
    /// 8 data bytes then an 8-byte hole per element
    Strided,
}

impl DataLayout {
    fn name(self) -> &'static str {
        match self {
            DataLayout::Byte => "byte",
            DataLayout::Strided => "strided",
        }
    }
}

/// Designs of an offloaded collective, as the shim names them.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Design {
    /// staged: the service processes write every rank's buffer from their staging memory
    Flat,
    /// staged, hierarchical: a service process writes each chunk once into a segment shared by
    /// the ranks it serves, which copy out of it in the wait
    Hier,
    /// iallgather only: the hierarchical allgather with load-balanced late arrivals (after
    /// MIMOSA)
    Lb,
    /// let the shim choose by the number of ranks per service process
    Auto,
}

impl Design {
    fn name(self) -> &'static str {
        match self {
            Design::Flat => "flat",
            Design::Hier => "hier",
            Design::Lb => "lb",
            Design::Auto => "auto",
        }
    }
}

/// Whether `coll` accepts `design`: ibcast flat|hier|auto, iallgather flat|hier|lb|auto, the
/// others only auto.
fn check_design(coll: Coll, design: Design) -> Result<(), String> {
    match (coll, design) {
        (_, Design::Auto) | (Coll::Iallgather, _) => Ok(()),
        (Coll::Ibcast, Design::Flat | Design::Hier) => Ok(()),
        (Coll::Ibcast, Design::Lb) => Err(
            "--design lb is the load-balanced allgather, only for --coll iallgather; \
             ibcast takes flat, hier or auto"
                .into(),
        ),
        (c, d) => Err(format!(
            "--design {} does not apply to --coll {}: only ibcast (flat|hier|auto) and \
             iallgather (flat|hier|lb|auto) have a design choice",
            d.name(),
            c.name()
        )),
    }
}

/// The root of a broadcast in iteration `iter`: it rotates through the ranks.
fn bcast_root(iter: u64, n: usize) -> usize {
    (iter % n.max(1) as u64) as usize
}

/// Why a size cannot be run on `ranks` ranks (counts and displacements are MPI ints in
/// elements of MPI_BYTE), or `None`.
fn size_error(coll: Coll, sizes: &[usize], ranks: usize) -> Option<String> {
    let max = i32::MAX as usize;
    if coll == Coll::Ibcast {
        let bad = sizes.iter().find(|&&s| s > max)?;
        return Some(format!(
            "size {bad} does not fit an MPI int count (at most {max} bytes)"
        ));
    }
    let bad = sizes
        .iter()
        .find(|&&s| !matches!(s.checked_mul(ranks), Some(t) if t <= max))?;
    Some(format!(
        "size {bad} x {ranks} ranks does not fit MPI int displacements \
         (at most {max} bytes per rank in total)"
    ))
}

#[derive(Args, Debug)]
struct OverlapArgs {
    /// Collective to measure.
    #[arg(long, value_enum)]
    coll: Coll,

    /// Comma-separated sizes in bytes: per pair for the alltoalls (each rank sends SIZE bytes
    /// to every rank, itself included), per rank for the allgathers, the message for ibcast;
    /// K/M/G suffixes are 1024-based.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = DEFAULT_SIZES)]
    sizes: Vec<usize>,

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

    /// Design of the offloaded collective, for ibcast (flat, hier, auto) and iallgather (flat,
    /// hier, lb, auto); the other collectives take only auto. Before MPI_Init this process sets
    /// SPOFF_BCAST_DESIGN (ibcast) or SPOFF_IALLGATHER_DESIGN (iallgather) to it, overriding
    /// the environment; the shim reads the variable when the collective is posted. It only
    /// matters when the host shim is preloaded (natively nothing reads it; a shim that does not
    /// know the variable ignores it). auto lets the shim choose by the number of ranks per
    /// service process. Recorded as `design` in the JSON lines.
    #[arg(long, value_enum, default_value_t = Design::Auto)]
    design: Design,

    /// How the data are described to MPI. byte: SIZE x MPI_BYTE, contiguous. strided: every 8
    /// bytes of data followed by an 8-byte hole (MPI_Type_create_resized of 8 contiguous
    /// bytes to an extent of 16; SIZE must be a multiple of 8), so the buffers are twice as
    /// long, the holes must stay untouched, and the offloaded path packs and unpacks the data
    /// on the host (the packing cost shows in post_us and wait_us). Recorded as `datatype` in
    /// the JSON lines.
    #[arg(long, value_enum, default_value_t = DataLayout::Byte)]
    datatype: DataLayout,

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
    /// Wall-clock time per timed iteration of the compute phase, each iteration's setup and
    /// barrier included: the loop's own time to solution (where ranks share a core, the OSU
    /// per-rank times swing with how the scheduler interleaves the ranks; this moves in whole
    /// scheduler ticks).
    loop_us: f64,
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
    /// MPI_BYTE, or the strided layout's element (`--datatype strided`).
    ty: Datatype,
    /// `--datatype strided`: each SIZE-byte block spans 2 x SIZE bytes of its buffer.
    strided: bool,
    /// Ibcast: the root of the iteration being run (set by [`Setup::prepare`]).
    root: usize,
}

impl Setup {
    /// Gets iteration `iter` ready: fills what this rank sends (for ibcast, on the root of the
    /// iteration, its one buffer; so call it after [`Setup::sentinel_recv`]).
    fn prepare(&mut self, iter: u64) {
        let size = self.size;
        self.root = bcast_root(iter, self.n);
        if size == 0 {
            return;
        }
        if self.coll == Coll::Ibcast {
            if self.me == self.root {
                let root = self.root as u32;
                self.fill_block(true, 0, root, ALL_PEERS, iter);
            }
            return;
        }
        let me = self.me as u32;
        if self.coll.is_allgather() {
            self.fill_block(false, 0, me, ALL_PEERS, iter);
            return;
        }
        for peer in 0..self.n {
            self.fill_block(false, peer, me, peer as u32, iter);
        }
    }

    /// Bytes a SIZE-byte block spans in its buffer.
    fn span(&self) -> usize {
        if self.strided {
            self.size / strided::DATA * strided::EXTENT
        } else {
            self.size
        }
    }

    /// Writes the pattern of (`src`, `dst`, `iter`) into block `index` of the receive buffer
    /// (`recv`: the ibcast's one buffer) or the send buffer.
    fn fill_block(&mut self, recv: bool, index: usize, src: u32, dst: u32, iter: u64) {
        let span = self.span();
        let buf = if recv { &mut self.recv } else { &mut self.send };
        let block = &mut buf[index * span..(index + 1) * span];
        if self.strided {
            let mut data = vec![0; self.size];
            pattern::fill(&mut data, src, dst, iter);
            strided::scatter(&data, block);
        } else {
            pattern::fill(block, src, dst, iter);
        }
    }

    /// The first wrong byte of receive block `index` against the pattern of (`src`, `dst`,
    /// `iter`), as (offset in the block's data, expected, got); with the strided layout a
    /// written hole is wrong too (offset in the buffer's span, expected the sentinel).
    fn block_mismatch(
        &self,
        index: usize,
        src: u32,
        dst: u32,
        iter: u64,
    ) -> Option<(usize, u8, u8)> {
        let span = self.span();
        let block = &self.recv[index * span..(index + 1) * span];
        if !self.strided {
            return pattern::first_mismatch(block, src, dst, iter);
        }
        let (data, hole) = strided::gather(block, SENTINEL);
        if let Some(at) = hole {
            return Some((at, SENTINEL, block[at]));
        }
        pattern::first_mismatch(&data, src, dst, iter)
    }

    fn sentinel_recv(&mut self) {
        self.recv.fill(SENTINEL);
    }

    /// Posts the collective and waits; returns the times of the whole (post + compute + wait),
    /// of the compute alone, of the post call and of the wait call.
    fn run_once(&mut self, compute_steps: Option<u64>) -> Result<Times, MpiError> {
        let count = self.counts[0];
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
                &self.ty,
            )?,
            Coll::Ialltoall => self.world.ialltoall(send, recv, count, &self.ty)?,
            Coll::Iallgatherv => {
                self.world
                    .iallgatherv(send, count, recv, &self.counts, &self.displs, &self.ty)?
            }
            Coll::Iallgather => self.world.iallgather(send, recv, count, &self.ty)?,
            Coll::Ibcast => self.world.ibcast(recv, count, &self.ty, self.root as i32)?,
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
            iteration: 0.0,
        })
    }

    /// Checks what every peer delivered in iteration `iter`; prints the first bad byte per peer.
    fn validate(&self, iter: u64, phase: &str) -> bool {
        if self.coll == Coll::Ibcast {
            let root = bcast_root(iter, self.n);
            let bad = self.block_mismatch(0, root as u32, ALL_PEERS, iter);
            if let Some((off, exp, got)) = bad {
                eprintln!(
                    "coll-bench: VALIDATION FAILED: {} bytes={} phase={phase} rank={} \
                     root={root} offset={off} expected=0x{exp:02x} got=0x{got:02x}",
                    self.coll.name(),
                    self.size,
                    self.me
                );
            }
            return bad.is_none();
        }
        let mut ok = true;
        for peer in 0..self.n {
            let dst = if self.coll.is_allgather() {
                ALL_PEERS
            } else {
                self.me as u32
            };
            if let Some((off, exp, got)) = self.block_mismatch(peer, peer as u32, dst, iter) {
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
    /// A phase's mean: wall-clock time per timed iteration, from the start of the first timed
    /// iteration (its setup, then its barrier) to the end of the last one.
    iteration: f64,
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
    let mut timed_from = wtime();
    for it in 0..total {
        if it == warmup {
            timed_from = wtime();
        }
        let iter_id = (phase_id << 32) | it as u64;
        if it + 1 == total {
            s.sentinel_recv();
        }
        s.prepare(iter_id);
        s.world.barrier()?;
        let t = s.run_once(steps)?;
        if it >= warmup {
            sum.total += t.total;
            sum.compute += t.compute;
            sum.post += t.post;
            sum.wait += t.wait;
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
        send: vec![0; (send_len * widen).max(1)],
        recv: vec![0; (recv_len * widen).max(1)],
        counts: vec![count as i32; n],
        displs: (0..n).map(|j| (j * count) as i32).collect(),
        ty,
        strided,
        root: 0,
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
    let t_loop = world.allreduce_f64(with.iteration, consts::OP_MAX())?;
    let validated = world.all_true(ok_pure && ok_compute)?;
    Ok(Row {
        bytes: size,
        pure_us: t_pure * 1e6,
        overall_us: t_overall * 1e6,
        compute_us: t_compute * 1e6,
        post_us: t_post * 1e6,
        wait_us: t_wait * 1e6,
        loop_us: t_loop * 1e6,
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
        "loop_us": row.loop_us,
        "overlap_pct": row.overlap_pct,
        "validated": row.validated,
        "iters": row.iters,
        "warmup": row.warmup,
        "mode": mode,
        "design": design,
        "datatype": datatype.name(),
    })
    .to_string()
}

fn overlap(args: OverlapArgs) -> i32 {
    let coll = args.coll;
    if let Err(e) = check_design(coll, args.design) {
        eprintln!("coll-bench: {e}");
        return 2;
    }
    let nodes = match nodes() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("coll-bench: {e}");
            return 2;
        }
    };
    // The shim reads the design once, at the first collective that needs it; set it before
    // MPI_Init, while
    // this process has a single thread.
    let design = coll.design_env().map(|var| {
        std::env::set_var(var, args.design.name());
        args.design.name()
    });
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
            "# coll-bench overlap: coll={} ranks={ranks} nodes={nodes} mode={mode}{}",
            coll.name(),
            design.map_or(String::new(), |d| format!(" design={d}"))
        );
        println!(
            "{:>10} {:>12} {:>12} {:>12} {:>9} {:>9} {:>12} {:>11} {:>9}",
            "bytes",
            "pure_us",
            "overall_us",
            "compute_us",
            "post_us",
            "wait_us",
            "loop_us",
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
                "{:>10} {:>12.2} {:>12.2} {:>12.2} {:>9.2} {:>9.2} {:>12.1} {:>11.1} {:>9}",
                row.bytes,
                row.pure_us,
                row.overall_us,
                row.compute_us,
                row.post_us,
                row.wait_us,
                row.loop_us,
                row.overlap_pct,
                row.validated
            );
            let _ = std::io::stdout().flush();
            if let Some(w) = json.as_mut() {
                let line = json_line(coll, &row, ranks, nodes, mode, design, args.datatype);
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

type Json = serde_json::Value;

/// A `compare` row key: (coll, bytes, delay_ms, design); delay_ms is 0 for `overlap` rows.
type Key = (String, u64, u64, Option<String>);

fn key_of(r: &Json) -> Key {
    (
        r["coll"].as_str().unwrap_or("?").to_string(),
        r["bytes"].as_u64().unwrap_or(0),
        r["delay_ms"].as_u64().unwrap_or(0),
        r["design"].as_str().map(String::from),
    )
}

/// The key without the design: the measured point.
fn point_of(k: &Key) -> (&str, u64, u64) {
    (&k.0, k.1, k.2)
}

fn num(r: Option<&Json>, f: &str) -> Option<f64> {
    r.and_then(|r| r[f].as_f64())
}

/// Time the host spent in the collective's calls while it had compute to do.
fn host_us(r: Option<&Json>) -> Option<f64> {
    Some(num(r, "post_us")? + num(r, "wait_us")?)
}

fn cell(v: Option<f64>, prec: usize) -> String {
    v.map_or("-".to_string(), |v| format!("{v:.prec$}"))
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn validated(r: Option<&Json>) -> bool {
    r.is_some_and(|r| r["validated"] == true)
}

/// Rows of `late` runs carry tail_us and a delay; rows of `overlap` runs do not.
fn is_late<'a>(rows: impl IntoIterator<Item = &'a Json>) -> bool {
    rows.into_iter().any(|r| r.get("tail_us").is_some())
}

/// "ranks=.. nodes=.. mode=.." of a file's first row.
fn run_context(rows: &[Json]) -> String {
    rows.first().map_or("-".to_string(), |r| {
        format!(
            "ranks={} nodes={} mode={}",
            r["ranks"],
            r["nodes"],
            r["mode"].as_str().unwrap_or("?")
        )
    })
}

/// The table: a line naming each side with its context, then the header and the lines, as
/// right-aligned plain text or as Markdown.
fn render_compare(
    sides: &[(String, String)],
    legend: &str,
    header: &[String],
    lines: &[Vec<String>],
    markdown: bool,
) -> String {
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    let sides = sides
        .iter()
        .map(|(name, ctx)| format!("{name}: {ctx}"))
        .collect::<Vec<_>>()
        .join("; ");
    if markdown {
        let mut chars = sides.chars();
        let first: String = chars
            .next()
            .map(|c| c.to_uppercase().collect())
            .unwrap_or_default();
        line(format!("{first}{}. {legend}", chars.as_str()));
        line(String::new());
        line(format!("| {} |", header.join(" | ")));
        line(format!(
            "|{}|",
            header.iter().map(|_| "---").collect::<Vec<_>>().join("|")
        ));
        for l in lines {
            line(format!("| {} |", l.join(" | ")));
        }
    } else {
        line(format!("# {sides}; {legend}"));
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
        let row = |cells: &[String]| {
            cells
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:>w$}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        line(row(header));
        for l in lines {
            line(row(l));
        }
    }
    out
}

/// One native and one offloaded file, joined on (coll, bytes, delay_ms, design); returns the
/// table and whether every row is on both sides and validated.
fn compare_one(native: &[Json], offload: &[Json], markdown: bool) -> (String, bool) {
    fn find<'a>(rows: &'a [Json], k: &Key) -> Option<&'a Json> {
        rows.iter().find(|r| key_of(r) == *k)
    }
    let late = is_late(native.iter().chain(offload));
    let show_design = native
        .iter()
        .chain(offload)
        .any(|r| r["design"].is_string());
    let mut offload_keys: Vec<Key> = offload.iter().map(key_of).collect();
    offload_keys.sort();
    offload_keys.dedup();
    // An offload key the native file lacks takes the native rows of the same point if they
    // have a single design (natively the design changes nothing).
    let stand_in = |k: &Key| {
        let mut same = native
            .iter()
            .filter(|r| point_of(&key_of(r)) == point_of(k));
        let first = same.next()?;
        let design = key_of(first).3;
        same.all(|r| key_of(r).3 == design).then_some(first)
    };
    let mut joined: Vec<(Key, Option<&Json>, Option<&Json>)> = Vec::new();
    let mut used: Vec<Key> = Vec::new();
    let mut stood_in = false;
    for k in &offload_keys {
        let n = find(native, k).or_else(|| {
            let r = stand_in(k)?;
            stood_in = true;
            Some(r)
        });
        if let Some(r) = n {
            used.push(key_of(r));
        }
        joined.push((k.clone(), n, find(offload, k)));
    }
    let mut native_keys: Vec<Key> = native.iter().map(key_of).collect();
    native_keys.sort();
    native_keys.dedup();
    for k in native_keys {
        if !used.contains(&k) && !offload_keys.contains(&k) {
            let n = find(native, &k);
            joined.push((k, n, None));
        }
    }
    joined.sort_by(|a, b| a.0.cmp(&b.0));

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
        "native_loop_us",
        "offload_loop_us",
        "validated",
    ];
    let mut header: Vec<String> = if late {
        &late_header[..]
    } else {
        &overlap_header[..]
    }
    .iter()
    .map(|h| h.to_string())
    .collect();
    // The design goes after the point's other coordinates.
    let design_at = if late { 3 } else { 2 };
    if show_design {
        header.insert(design_at, "design".into());
    }
    let mut lines: Vec<Vec<String>> = Vec::new();
    let mut ok = true;
    for (k, n, o) in &joined {
        let (n, o) = (*n, *o);
        let both_valid = validated(n) && validated(o);
        ok &= both_valid;
        let ratio_of = |f: &str| ratio(num(n, f), num(o, f));
        let valid = match (n, o) {
            (Some(_), Some(_)) => both_valid.to_string(),
            (None, _) => "no native row".into(),
            (_, None) => "no offload row".into(),
        };
        let mut l = if late {
            vec![
                k.0.clone(),
                k.1.to_string(),
                k.2.to_string(),
                cell(num(n, "tail_us"), 1),
                cell(num(o, "tail_us"), 1),
                cell(ratio_of("tail_us"), 2),
                cell(num(n, "mean_in_call_us"), 1),
                cell(num(o, "mean_in_call_us"), 1),
                valid,
            ]
        } else {
            vec![
                k.0.clone(),
                k.1.to_string(),
                cell(num(n, "pure_us"), 2),
                cell(num(o, "pure_us"), 2),
                cell(ratio_of("pure_us"), 2),
                cell(num(n, "overall_us"), 2),
                cell(num(o, "overall_us"), 2),
                cell(num(n, "overlap_pct"), 1),
                cell(num(o, "overlap_pct"), 1),
                cell(host_us(n), 1),
                cell(host_us(o), 1),
                cell(num(n, "loop_us"), 1),
                cell(num(o, "loop_us"), 1),
                valid,
            ]
        };
        if show_design {
            l.insert(design_at, k.3.clone().unwrap_or_else(|| "-".into()));
        }
        lines.push(l);
    }
    let mut legend = if late {
        "tail_us = time from the last rank's entry to the last rank's exit; tail_ratio = native \
         tail_us / offload tail_us (above 1: the offload finishes sooner after the last arrival)."
            .to_string()
    } else {
        "pure_ratio = native pure_us / offload pure_us; host_us = post_us + wait_us with compute \
         (time the host spent in MPI calls instead of computing); loop_us = wall-clock time per \
         iteration with compute, setup and barrier included."
            .to_string()
    };
    if stood_in {
        legend.push_str(
            " Where the native file lacks a design, its run of another design stands in (natively \
             the design changes nothing).",
        );
    }
    let sides = [
        ("native".to_string(), run_context(native)),
        ("offload".to_string(), run_context(offload)),
    ];
    (
        render_compare(&sides, &legend, &header, &lines, markdown),
        ok,
    )
}

/// The column-group label of an offload file: the design its rows share, else its file name.
fn offload_label(path: &Path, rows: &[Json]) -> String {
    let mut designs = rows.iter().map(|r| r["design"].as_str());
    match designs.next() {
        Some(Some(d)) if designs.all(|x| x == Some(d)) => d.to_string(),
        _ => path.file_stem().map_or_else(
            || path.display().to_string(),
            |s| s.to_string_lossy().into(),
        ),
    }
}

/// A measured point: (coll, bytes, delay_ms).
type Point = (String, u64, u64);

/// Rows by point; an error if a file has two rows for one point.
fn by_point<'a>(name: &str, rows: &'a [Json]) -> Result<Vec<(Point, &'a Json)>, String> {
    let mut out: Vec<(Point, &Json)> = Vec::new();
    for r in rows {
        let k = key_of(r);
        let p = (k.0, k.1, k.2);
        if out.iter().any(|(q, _)| *q == p) {
            return Err(format!(
                "{name} has more than one row for coll={} bytes={}{}: with several --offload \
                 files every file must hold one run per point (split it, or compare it alone)",
                p.0,
                p.1,
                if p.2 > 0 {
                    format!(" delay_ms={}", p.2)
                } else {
                    String::new()
                }
            ));
        }
        out.push((p, r));
    }
    Ok(out)
}

/// One native file and several offloaded ones, joined on (coll, bytes, delay_ms) with one
/// column group per offloaded file; returns the table and whether every row is in every file
/// and validated.
fn compare_many<'a>(
    native: &'a [Json],
    native_name: &str,
    offloads: &'a [(PathBuf, Vec<Json>)],
    markdown: bool,
) -> Result<(String, bool), String> {
    let late = is_late(native.iter().chain(offloads.iter().flat_map(|(_, r)| r)));
    let mut labels: Vec<String> = Vec::new();
    for (path, rows) in offloads {
        let base = offload_label(path, rows);
        let mut label = base.clone();
        let mut k = 2;
        while labels.contains(&label) || label == "native" {
            label = format!("{base}-{k}");
            k += 1;
        }
        labels.push(label);
    }
    let nat = by_point(native_name, native)?;
    let offs = offloads
        .iter()
        .map(|(path, rows)| by_point(&path.display().to_string(), rows))
        .collect::<Result<Vec<_>, _>>()?;
    let mut points: Vec<Point> = nat
        .iter()
        .chain(offs.iter().flatten())
        .map(|(p, _)| p.clone())
        .collect();
    points.sort();
    points.dedup();

    let mut header: Vec<String> = vec!["coll".into(), "bytes".into()];
    if late {
        header.extend(["delay_ms", "native_tail_us", "native_mean_in_call_us"].map(String::from));
    } else {
        header.extend(
            [
                "native_pure_us",
                "native_overall_us",
                "native_overlap_pct",
                "native_host_us",
                "native_loop_us",
            ]
            .map(String::from),
        );
    }
    for l in &labels {
        let cols: &[&str] = if late {
            &["tail_us", "tail_ratio", "mean_in_call_us"]
        } else {
            &[
                "pure_us",
                "pure_ratio",
                "overall_us",
                "overlap_pct",
                "host_us",
                "loop_us",
            ]
        };
        header.extend(cols.iter().map(|c| format!("{l}_{c}")));
    }
    header.push("validated".into());

    let find = |rows: &[(Point, &'a Json)], p: &Point| -> Option<&'a Json> {
        rows.iter().find(|(q, _)| q == p).map(|(_, r)| *r)
    };
    let mut lines = Vec::new();
    let mut ok = true;
    for p in &points {
        let n = find(&nat, p);
        let mut l = vec![p.0.clone(), p.1.to_string()];
        if late {
            l.extend([
                p.2.to_string(),
                cell(num(n, "tail_us"), 1),
                cell(num(n, "mean_in_call_us"), 1),
            ]);
        } else {
            l.extend([
                cell(num(n, "pure_us"), 2),
                cell(num(n, "overall_us"), 2),
                cell(num(n, "overlap_pct"), 1),
                cell(host_us(n), 1),
                cell(num(n, "loop_us"), 1),
            ]);
        }
        let mut missing = Vec::new();
        if n.is_none() {
            missing.push("no native row".to_string());
        }
        let mut all_valid = validated(n);
        for (rows, label) in offs.iter().zip(&labels) {
            let o = find(rows, p);
            if o.is_none() {
                missing.push(format!("no {label} row"));
            }
            all_valid &= validated(o);
            if late {
                l.extend([
                    cell(num(o, "tail_us"), 1),
                    cell(ratio(num(n, "tail_us"), num(o, "tail_us")), 2),
                    cell(num(o, "mean_in_call_us"), 1),
                ]);
            } else {
                l.extend([
                    cell(num(o, "pure_us"), 2),
                    cell(ratio(num(n, "pure_us"), num(o, "pure_us")), 2),
                    cell(num(o, "overall_us"), 2),
                    cell(num(o, "overlap_pct"), 1),
                    cell(host_us(o), 1),
                    cell(num(o, "loop_us"), 1),
                ]);
            }
        }
        ok &= all_valid;
        l.push(if missing.is_empty() {
            all_valid.to_string()
        } else {
            missing.join(", ")
        });
        lines.push(l);
    }
    let legend = if late {
        "tail_us = time from the last rank's entry to the last rank's exit; X_tail_ratio = native \
         tail_us / X tail_us (above 1: X finishes sooner after the last arrival)."
    } else {
        "X_pure_ratio = native pure_us / X pure_us (above 1: X is faster); host_us = post_us + \
         wait_us with compute (time the host spent in MPI calls instead of computing); loop_us = \
         wall-clock time per iteration with compute, setup and barrier included."
    };
    let mut sides = vec![("native".to_string(), run_context(native))];
    for ((_, rows), label) in offloads.iter().zip(&labels) {
        sides.push((label.clone(), run_context(rows)));
    }
    Ok((
        render_compare(&sides, legend, &header, &lines, markdown),
        ok,
    ))
}

fn compare(args: CompareArgs) -> i32 {
    let native = match read_rows(&args.native) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("coll-bench compare: {e}");
            return 2;
        }
    };
    let mut offloads = Vec::new();
    for path in &args.offload {
        match read_rows(path) {
            Ok(r) => offloads.push((path.clone(), r)),
            Err(e) => {
                eprintln!("coll-bench compare: {e}");
                return 2;
            }
        }
    }
    let result = match offloads.as_slice() {
        [(_, offload)] => Ok(compare_one(&native, offload, args.markdown)),
        _ => compare_many(
            &native,
            &args.native.display().to_string(),
            &offloads,
            args.markdown,
        ),
    };
    let (text, ok) = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("coll-bench compare: {e}");
            return 2;
        }
    };
    print!("{text}");
    let _ = std::io::stdout().flush();
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
        Command::Overlap(args) => overlap(args),
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

    fn overlap_args(extra: &[&str]) -> OverlapArgs {
        let mut argv = vec!["coll-bench", "overlap"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Overlap(a) => a,
            _ => panic!("not overlap"),
        }
    }

    #[test]
    fn design_option() {
        let a = overlap_args(&["--coll", "ibcast"]);
        assert_eq!((a.coll, a.design), (Coll::Ibcast, Design::Auto));
        let a = overlap_args(&["--coll", "iallgather", "--design", "lb"]);
        assert_eq!(a.design, Design::Lb);
        assert!(Cli::try_parse_from([
            "coll-bench",
            "overlap",
            "--coll",
            "ibcast",
            "--design",
            "ring"
        ])
        .is_err());
    }

    #[test]
    fn designs_per_collective() {
        use Design::*;
        for d in [Flat, Hier, Auto] {
            assert_eq!(check_design(Coll::Ibcast, d), Ok(()));
        }
        let e = check_design(Coll::Ibcast, Lb).unwrap_err();
        assert!(e.contains("only for --coll iallgather"), "{e}");
        for d in [Flat, Hier, Lb, Auto] {
            assert_eq!(check_design(Coll::Iallgather, d), Ok(()));
        }
        for c in [Coll::Ialltoallv, Coll::Ialltoall, Coll::Iallgatherv] {
            assert_eq!(check_design(c, Auto), Ok(()));
            for d in [Flat, Hier, Lb] {
                let e = check_design(c, d).unwrap_err();
                assert!(e.contains(c.name()) && e.contains(d.name()), "{e}");
            }
        }
        assert_eq!(Coll::Ibcast.design_env(), Some("SPOFF_BCAST_DESIGN"));
        assert_eq!(
            Coll::Iallgather.design_env(),
            Some("SPOFF_IALLGATHER_DESIGN")
        );
        assert_eq!(Coll::Iallgatherv.design_env(), None);
        assert_eq!(Coll::Ialltoallv.design_env(), None);
    }

    #[test]
    fn bcast_root_rotates_through_every_rank() {
        for n in 1..=5 {
            let phase = 2u64 << 32;
            let mut roots: Vec<usize> = (0..n as u64).map(|i| bcast_root(phase | i, n)).collect();
            roots.sort();
            assert_eq!(roots, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn buffers_and_size_limits() {
        assert_eq!(Coll::Ibcast.buffer_lens(4, 100), (0, 100));
        assert_eq!(Coll::Iallgather.buffer_lens(4, 100), (100, 400));
        assert_eq!(Coll::Ialltoallv.buffer_lens(4, 100), (400, 400));
        let big = 1usize << 30;
        assert_eq!(size_error(Coll::Ibcast, &[0, big], 4), None);
        assert!(size_error(Coll::Ibcast, &[1 << 31], 4).is_some());
        let e = size_error(Coll::Ialltoallv, &[1, big], 4).unwrap();
        assert!(e.starts_with("size 1073741824 x 4 ranks"), "{e}");
    }

    fn test_row() -> Row {
        Row {
            bytes: 1024,
            pure_us: 1.0,
            overall_us: 2.0,
            compute_us: 1.0,
            post_us: 0.5,
            wait_us: 0.5,
            loop_us: 3.0,
            overlap_pct: 0.0,
            validated: true,
            iters: 5,
            warmup: 2,
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

    fn row(coll: &str, bytes: u64, design: Option<&str>, pure_us: f64, mode: &str) -> Json {
        serde_json::json!({
            "coll": coll, "bytes": bytes, "ranks": 4, "nodes": 2, "mode": mode,
            "pure_us": pure_us, "overall_us": 2.0 * pure_us, "compute_us": pure_us,
            "post_us": 0.5, "wait_us": 1.5, "loop_us": 3.0 * pure_us, "overlap_pct": 50.0,
            "validated": true,
            "design": design,
        })
    }

    #[test]
    fn compare_without_designs_keeps_the_old_table() {
        let native = [row("ialltoallv", 1024, None, 10.0, "native")];
        let offload = [row("ialltoallv", 1024, None, 5.0, "offload")];
        let (text, ok) = compare_one(&native, &offload, false);
        assert!(ok);
        let expected = "\
# native: ranks=4 nodes=2 mode=native; offload: ranks=4 nodes=2 mode=offload; pure_ratio = native pure_us / offload pure_us; host_us = post_us + wait_us with compute (time the host spent in MPI calls instead of computing); loop_us = wall-clock time per iteration with compute, setup and barrier included.
      coll bytes native_pure_us offload_pure_us pure_ratio native_overall_us offload_overall_us native_overlap_pct offload_overlap_pct native_host_us offload_host_us native_loop_us offload_loop_us validated
ialltoallv  1024          10.00            5.00       2.00             20.00              10.00               50.0                50.0            2.0             2.0           30.0            15.0      true
";
        assert_eq!(text, expected);
        let (md, _) = compare_one(&native, &offload, true);
        assert!(md.starts_with("Native: ranks=4 nodes=2 mode=native; offload: ranks=4"));
        assert!(md.contains("\n| coll | bytes | native_pure_us |"));
        assert!(!md.contains("design"));
    }

    #[test]
    fn compare_joins_on_design() {
        // Native runs of both designs: each offload row meets its own.
        let native = [
            row("ibcast", 1024, Some("flat"), 10.0, "native"),
            row("ibcast", 1024, Some("hier"), 20.0, "native"),
        ];
        let offload = [
            row("ibcast", 1024, Some("hier"), 10.0, "offload"),
            row("ibcast", 1024, Some("flat"), 5.0, "offload"),
        ];
        let (text, ok) = compare_one(&native, &offload, false);
        assert!(ok, "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].contains(" design "), "{text}");
        assert_eq!(lines.len(), 4, "{text}");
        // flat: 10 / 5, hier: 20 / 10: both ratios 2.00, sorted by design.
        let cols = |l: &str| l.split_whitespace().map(String::from).collect::<Vec<_>>();
        assert_eq!(
            cols(lines[2])[..6],
            ["ibcast", "1024", "flat", "10.00", "5.00", "2.00"]
        );
        assert_eq!(
            cols(lines[3])[..6],
            ["ibcast", "1024", "hier", "20.00", "10.00", "2.00"]
        );
        assert!(!text.contains("stands in"));

        // One native run (design auto) serves both offload designs.
        let native = [row("ibcast", 1024, Some("auto"), 10.0, "native")];
        let (text, ok) = compare_one(&native, &offload, false);
        assert!(ok, "{text}");
        assert!(text.contains("stands in"), "{text}");
        assert_eq!(text.lines().count(), 4, "{text}");
        assert!(!text.contains("no offload row") && !text.contains("no native row"));

        // Native rows of two other designs: no stand-in, every row is missing a side.
        let native = [
            row("ibcast", 1024, Some("auto"), 10.0, "native"),
            row("ibcast", 1024, Some("lb"), 10.0, "native"),
        ];
        let (text, ok) = compare_one(&native, &offload, true);
        assert!(!ok);
        assert_eq!(text.matches("no native row").count(), 2, "{text}");
        assert_eq!(text.matches("no offload row").count(), 2, "{text}");
    }

    #[test]
    fn compare_many_puts_designs_side_by_side() {
        let native = vec![
            row("ibcast", 0, Some("auto"), 1.0, "native"),
            row("ibcast", 1024, Some("auto"), 10.0, "native"),
        ];
        let flat = vec![
            row("ibcast", 0, Some("flat"), 1.0, "offload"),
            row("ibcast", 1024, Some("flat"), 5.0, "offload"),
        ];
        let hier = vec![row("ibcast", 1024, Some("hier"), 4.0, "offload")];
        let files = vec![
            (PathBuf::from("x/flat-run.json"), flat.clone()),
            (PathBuf::from("x/hier-run.json"), hier),
        ];
        let (text, ok) = compare_many(&native, "n.json", &files, false).unwrap();
        assert!(!ok, "the hier file lacks size 0");
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("# native: ranks=4 nodes=2 mode=native; flat: "));
        assert!(lines[0].contains("; hier: ranks=4"));
        let header: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            header[2..7],
            [
                "native_pure_us",
                "native_overall_us",
                "native_overlap_pct",
                "native_host_us",
                "native_loop_us"
            ]
        );
        assert_eq!(header[7..9], ["flat_pure_us", "flat_pure_ratio"]);
        assert_eq!(header[12], "flat_loop_us");
        assert_eq!(header[13..15], ["hier_pure_us", "hier_pure_ratio"]);
        assert_eq!(*header.last().unwrap(), "validated");
        assert!(lines[2].ends_with("no hier row"), "{text}");
        let last: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(last[6], "30.0");
        assert_eq!(last[7..9], ["5.00", "2.00"]);
        assert_eq!(last[12], "15.0");
        assert_eq!(last[13..15], ["4.00", "2.50"]);
        assert_eq!(*last.last().unwrap(), "true");

        // Rows without one design are labelled by file name; equal labels get a suffix.
        let mixed = vec![row("ibcast", 0, None, 1.0, "offload")];
        assert_eq!(offload_label(Path::new("d/run1.json"), &mixed), "run1");
        let files = vec![
            (PathBuf::from("a.json"), flat.clone()),
            (PathBuf::from("b.json"), flat.clone()),
        ];
        let (text, _) = compare_many(&native, "n.json", &files, true).unwrap();
        assert!(text.contains("| flat_pure_us |") && text.contains("| flat-2_pure_us |"));

        // Two runs of one point in a file cannot be one column group.
        let mut both = flat.clone();
        both.push(row("ibcast", 0, Some("hier"), 1.0, "offload"));
        let files = vec![
            (PathBuf::from("both.json"), both),
            (PathBuf::from("f.json"), flat),
        ];
        let e = compare_many(&native, "n.json", &files, false).unwrap_err();
        assert!(
            e.contains("both.json has more than one row for coll=ibcast bytes=0"),
            "{e}"
        );
    }

    #[test]
    fn compare_takes_several_offload_files() {
        let cli = Cli::try_parse_from([
            "coll-bench",
            "compare",
            "--native",
            "n",
            "--offload",
            "a",
            "--offload",
            "b",
        ])
        .unwrap();
        let Command::Compare(a) = cli.command else {
            panic!("not compare")
        };
        assert_eq!(a.offload, [PathBuf::from("a"), PathBuf::from("b")]);
        assert!(Cli::try_parse_from(["coll-bench", "compare", "--native", "n"]).is_err());
    }
}
