//! `coll-bench fft`: an application proxy, the transpose loop of a slab-decomposed 3D FFT of
//! several fields (the pipelined multi-variable scheme of P3DFFT++'s nb-mv branch that the
//! MIMOSA authors offloaded), see `coll-bench fft --help`.
//!
//! Per field, a complex N^3 grid, `[x][y][z]`; rank r owns the x-planes of [`slab`] (blocks of
//! ceil(N / P) planes: uneven when P does not divide N, empty on the last ranks when
//! P * ceil(N / P) - N >= ceil(N / P)). A 3D FFT of one field is
//! 1. stage 1 (local): 1D FFTs along z, then along y, of every owned x-plane, then the pack:
//!    the block for rank d (owned x, d's y-slab, all z) made contiguous;
//! 2. the transpose: `MPI_Ialltoallv` (counts nx_me * ny_d * N complex numbers, as
//!    `MPI_Type_contiguous(2, MPI_DOUBLE)`; zero for an empty slab on either side), after which
//!    rank r holds `[x][y in its y-slab][z]` for all x;
//! 3. stage 2 (local): 1D FFTs along x.
//!
//! The pipelined loop over the F fields posts the transpose of field k, runs stage 1 of field
//! k + 1, waits for field k, runs its stage 2. A 1D FFT is [`Fft`]: mixed radix, any length.

use crate::run::{self, fail};
use clap::Args;
use coll_bench::fft_math::{as_bytes, as_bytes_mut, dft_point, input, slab, Fft, C64};
use coll_bench::mpi::{wtime, Comm, Datatype, Mpi, MpiError, Request};
use mpi_ffi::consts;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct FftArgs {
    /// Comma-separated grid sizes N (an N x N x N complex grid per field).
    #[arg(long, value_delimiter = ',', default_value = "64")]
    pub n: Vec<usize>,

    /// Fields transformed per iteration (the pipeline's depth: the transpose of one field runs
    /// during the stage 1 of the next).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub fields: u32,

    /// Timed iterations per phase.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: u32,

    /// Untimed iterations before each phase.
    #[arg(long, default_value_t = 2)]
    pub warmup: u32,

    /// Seed of the input grids (printed).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Output points per field and rank checked against a direct 3D DFT.
    #[arg(long, default_value_t = 2)]
    pub spot_checks: u32,

    /// Also write one JSON object per N per line (JSON Lines) to FILE (rank 0 only).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Test hook (hidden): rank 0 flips one received byte of the last field in the last
    /// pipelined iteration, so the run must report a validation failure and exit 1.
    #[arg(long, hide = true)]
    pub self_test_corrupt: bool,
}

/// The decomposition of one N on this communicator, and the transpose's counts (in complex
/// numbers).
struct Layout {
    n: usize,
    ranks: usize,
    /// My x-slab (before the transpose) and y-slab (after).
    x0: usize,
    nx: usize,
    y0: usize,
    ny: usize,
    scounts: Vec<i32>,
    sdispls: Vec<i32>,
    rcounts: Vec<i32>,
    rdispls: Vec<i32>,
}

impl Layout {
    fn new(n: usize, me: usize, ranks: usize) -> Result<Layout, String> {
        let (x0, nx) = slab(n, ranks, me);
        let (y0, ny) = (x0, nx);
        let int = |v: usize| i32::try_from(v).map_err(|_| format!("N={n}: counts overflow int"));
        let (mut scounts, mut sdispls, mut rcounts, mut rdispls) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut sat, mut rat) = (0, 0);
        for d in 0..ranks {
            let other = slab(n, ranks, d).1;
            let (s, r) = (nx * other * n, other * ny * n);
            scounts.push(int(s)?);
            sdispls.push(int(sat)?);
            rcounts.push(int(r)?);
            rdispls.push(int(rat)?);
            sat += s;
            rat += r;
        }
        Ok(Layout {
            n,
            ranks,
            x0,
            nx,
            y0,
            ny,
            scounts,
            sdispls,
            rcounts,
            rdispls,
        })
    }

    /// Complex numbers of my slab (before and after the transpose: nx * N * N, N * ny * N).
    fn slab_len(&self) -> usize {
        self.nx * self.n * self.n
    }

    fn recv_len(&self) -> usize {
        self.n * self.ny * self.n
    }
}

/// One field's buffers. Never empty (MPI refuses sendbuf == recvbuf, and two empty Vecs may
/// share an address).
struct Field {
    grid: Vec<C64>,
    send: Vec<C64>,
    recv: Vec<C64>,
    out: Vec<C64>,
}

struct Proxy {
    l: Layout,
    fft: Fft,
    ty: Datatype,
    pristine: Vec<Vec<C64>>,
    fields: Vec<Field>,
    scratch: Vec<C64>,
    line: Vec<C64>,
}

impl Proxy {
    fn new(l: Layout, nfields: usize, seed: u64) -> Result<Proxy, MpiError> {
        let n = l.n;
        let pristine: Vec<Vec<C64>> = (0..nfields)
            .map(|f| {
                let mut g = Vec::with_capacity(l.slab_len());
                for x in l.x0..l.x0 + l.nx {
                    for y in 0..n {
                        for z in 0..n {
                            g.push(input(seed, f, n, (x, y, z)));
                        }
                    }
                }
                g
            })
            .collect();
        let fields = (0..nfields)
            .map(|_| Field {
                grid: vec![C64::default(); l.slab_len().max(1)],
                send: vec![C64::default(); l.slab_len().max(1)],
                recv: vec![C64::default(); l.recv_len().max(1)],
                out: vec![C64::default(); l.recv_len().max(1)],
            })
            .collect();
        Ok(Proxy {
            ty: Datatype::contiguous(2, &Datatype::double()?)?,
            fft: Fft::new(n),
            l,
            pristine,
            fields,
            scratch: Vec::new(),
            line: vec![C64::default(); n],
        })
    }

    /// Every field back to its input (untimed).
    fn reset(&mut self) {
        for (f, p) in self.fields.iter_mut().zip(&self.pristine) {
            f.grid[..p.len()].copy_from_slice(p);
        }
    }

    /// Stage 1 of field `k`: FFTs along z and y of the owned x-planes, then the pack.
    fn stage1(&mut self, k: usize) {
        stage1_of(
            &self.l,
            &self.fft,
            &mut self.fields[k],
            &mut self.line,
            &mut self.scratch,
        );
    }

    /// Stage 2 of field `k`: FFTs along x of the received `[x][y local][z]`, into `out`.
    fn stage2(&mut self, k: usize) {
        let (n, ny) = (self.l.n, self.l.ny);
        let f = &mut self.fields[k];
        for y in 0..ny {
            for z in 0..n {
                for x in 0..n {
                    self.line[x] = f.recv[(x * ny + y) * n + z];
                }
                self.fft.run(&mut self.line, &mut self.scratch);
                for x in 0..n {
                    f.out[(x * ny + y) * n + z] = self.line[x];
                }
            }
        }
    }

    /// Posts the transpose of field `k`.
    fn post<'a>(
        world: Comm,
        l: &'a Layout,
        ty: &Datatype,
        f: &'a mut Field,
    ) -> Result<Request<'a>, MpiError> {
        world.ialltoallv(
            as_bytes(&f.send),
            &l.scounts,
            &l.sdispls,
            as_bytes_mut(&mut f.recv),
            &l.rcounts,
            &l.rdispls,
            ty,
        )
    }

    /// The transpose alone, every field: (post; wait) in turn.
    fn comm_only(&mut self, world: Comm) -> Result<(), MpiError> {
        for f in self.fields.iter_mut() {
            Self::post(world, &self.l, &self.ty, f)?.wait()?;
        }
        Ok(())
    }

    /// The compute alone, every field (stage 2 on whatever the receive buffer holds).
    fn compute_only(&mut self) {
        for k in 0..self.fields.len() {
            self.stage1(k);
            self.stage2(k);
        }
    }

    /// The pipelined loop; returns the time in the post and in the wait calls.
    fn pipelined(&mut self, world: Comm) -> Result<(f64, f64), MpiError> {
        let (mut post_s, mut wait_s) = (0.0, 0.0);
        let nf = self.fields.len();
        self.stage1(0);
        for k in 0..nf {
            let t0 = wtime();
            let (done, rest) = self.fields.split_at_mut(k + 1);
            let req = Self::post(world, &self.l, &self.ty, &mut done[k])?;
            let t1 = wtime();
            if k + 1 < nf {
                // Stage 1 of the next field while field k moves (its buffers are in `rest`).
                stage1_of(
                    &self.l,
                    &self.fft,
                    &mut rest[0],
                    &mut self.line,
                    &mut self.scratch,
                );
            }
            let t2 = wtime();
            req.wait()?;
            let t3 = wtime();
            post_s += t1 - t0;
            wait_s += t3 - t2;
            self.stage2(k);
        }
        Ok((post_s, wait_s))
    }

    /// The same computation with the transpose done natively and without overlap: per field,
    /// stage 1, then MPI_Isend/MPI_Irecv of every block (point-to-point calls, which the shim
    /// does not intercept), wait for all, stage 2. Fills `recv` and `out` of every field.
    fn reference(&mut self, world: Comm) -> Result<(), MpiError> {
        let ranks = self.l.ranks;
        for k in 0..self.fields.len() {
            self.stage1(k);
            let f = &mut self.fields[k];
            let send = as_bytes(&f.send);
            let mut reqs = Vec::new();
            let mut recv = as_bytes_mut(&mut f.recv);
            let mut rest_at = 0usize;
            let b = 16;
            for s in 0..ranks {
                let len = self.l.rcounts[s] as usize * b;
                let skip = self.l.rdispls[s] as usize * b - rest_at;
                let (_, tail) = std::mem::take(&mut recv).split_at_mut(skip);
                let (mine, tail) = tail.split_at_mut(len);
                recv = tail;
                rest_at += skip + len;
                if len > 0 {
                    reqs.push(world.irecv(mine, s as i32, 28)?);
                }
            }
            for d in 0..ranks {
                let len = self.l.scounts[d] as usize * b;
                let at = self.l.sdispls[d] as usize * b;
                if len > 0 {
                    reqs.push(world.isend(&send[at..at + len], d as i32, 28)?);
                }
            }
            Request::wait_all(reqs)?;
            self.stage2(k);
        }
        Ok(())
    }
}

/// Stage 1 of field `f`: FFTs along z and y of the owned x-planes, then the pack (for rank d:
/// `[x owned][y in d's slab][z]` at `sdispls[d]`). A free function so that it can borrow one
/// field while another field's buffers are lent to MPI.
fn stage1_of(l: &Layout, fft: &Fft, f: &mut Field, line: &mut [C64], scratch: &mut Vec<C64>) {
    let n = l.n;
    for x in 0..l.nx {
        let plane = &mut f.grid[x * n * n..(x + 1) * n * n];
        for row in plane.chunks_exact_mut(n) {
            fft.run(row, scratch);
        }
        for z in 0..n {
            for y in 0..n {
                line[y] = plane[y * n + z];
            }
            fft.run(line, scratch);
            for y in 0..n {
                plane[y * n + z] = line[y];
            }
        }
    }
    for d in 0..l.ranks {
        let (dy0, dny) = slab(n, l.ranks, d);
        let at = l.sdispls[d] as usize;
        for x in 0..l.nx {
            let from = (x * n + dy0) * n;
            let to = at + x * dny * n;
            f.send[to..to + dny * n].copy_from_slice(&f.grid[from..from + dny * n]);
        }
    }
}

struct Row {
    n: usize,
    /// Largest transpose of one field over the ranks: bytes a rank sends to other ranks.
    max_sent_bytes: u64,
    comm_us: f64,
    compute_us: f64,
    pipelined_us: f64,
    /// The fastest iteration of each phase (the largest over ranks): less exposed to the
    /// preemptions of a shared machine than the means.
    comm_min_us: f64,
    compute_min_us: f64,
    pipelined_min_us: f64,
    post_us: f64,
    wait_us: f64,
    overlap_pct: f64,
    /// The overlap formula on the fastest iterations.
    overlap_min_pct: f64,
    validated: bool,
    moved_bitwise: bool,
    spot_checked: u32,
}

/// A phase's times per iteration on this rank: the mean and the fastest iteration, and the
/// mean time in the post and wait calls.
struct Phase {
    mean: f64,
    min: f64,
    post: f64,
    wait: f64,
}

fn timed_phase(
    world: Comm,
    iters: u32,
    warmup: u32,
    p: &mut Proxy,
    mut body: impl FnMut(&mut Proxy) -> Result<(f64, f64), MpiError>,
) -> Result<Phase, MpiError> {
    let (mut total, mut min, mut post, mut wait) = (0.0, f64::INFINITY, 0.0, 0.0);
    for it in 0..warmup + iters {
        p.reset();
        world.barrier()?;
        let t0 = wtime();
        let (ps, ws) = body(p)?;
        let t = wtime() - t0;
        if it >= warmup {
            total += t;
            min = min.min(t);
            post += ps;
            wait += ws;
        }
    }
    let k = iters as f64;
    Ok(Phase {
        mean: total / k,
        min,
        post: post / k,
        wait: wait / k,
    })
}

fn run_n(world: Comm, n: usize, args: &FftArgs) -> Result<Row, MpiError> {
    let me = world.rank()? as usize;
    let ranks = world.size()? as usize;
    let l = Layout::new(n, me, ranks).unwrap_or_else(|e| {
        eprintln!("coll-bench fft: {e}");
        Mpi::abort(2)
    });
    let sent: u64 = (0..ranks)
        .filter(|&d| d != me)
        .map(|d| l.scounts[d] as u64 * 16)
        .sum();
    let max_sent = world.allreduce_u64(sent, consts::OP_MAX())?;
    let nf = args.fields as usize;
    let mut p = Proxy::new(l, nf, args.seed)?;
    let max = |v: f64| world.allreduce_f64(v, consts::OP_MAX());

    let comm = timed_phase(world, args.iters, args.warmup, &mut p, |p| {
        p.comm_only(world).map(|_| (0.0, 0.0))
    })?;
    let compute = timed_phase(world, args.iters, args.warmup, &mut p, |p| {
        p.compute_only();
        Ok((0.0, 0.0))
    })?;
    let pipe = timed_phase(world, args.iters, args.warmup, &mut p, |p| {
        p.pipelined(world)
    })?;
    if args.self_test_corrupt && me == 0 {
        let f = p.fields.last_mut().expect("at least one field");
        as_bytes_mut(&mut f.recv)[0] ^= 0x01;
    }
    let got: Vec<(Vec<C64>, Vec<C64>)> = p
        .fields
        .iter()
        .map(|f| (f.recv.clone(), f.out.clone()))
        .collect();

    // The reference: same computation, native point-to-point transpose, no overlap.
    p.reset();
    p.reference(world)?;
    let mut ok = true;
    for (k, (f, (recv, out))) in p.fields.iter().zip(&got).enumerate() {
        let (a, b) = (as_bytes(recv), as_bytes(&f.recv));
        if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
            eprintln!(
                "coll-bench fft: VALIDATION FAILED: N={n} rank={me} field={k}: received byte {i} \
                 is 0x{:02x}, the native transpose gave 0x{:02x}",
                a[i], b[i]
            );
            ok = false;
        } else if as_bytes(out) != as_bytes(&f.out) {
            eprintln!(
                "coll-bench fft: VALIDATION FAILED: N={n} rank={me} field={k}: output differs"
            );
            ok = false;
        }
    }
    let moved_bitwise = world.all_true(ok)?;

    // Independent of both runs: a few output points against a direct 3D DFT of the input.
    let mut spot = 0;
    let (y0, ny) = (p.l.y0, p.l.ny);
    if ny > 0 {
        let mut pick = args.seed ^ (me as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for (k, (_, out)) in got.iter().enumerate() {
            for _ in 0..args.spot_checks {
                pick = pick
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let h = (pick >> 17) as usize;
                let (kx, yl, kz) = (h % n, (h / n) % ny, (h / n / ny) % n);
                let want = dft_point(args.seed, k, &p.fft, (kx, y0 + yl, kz));
                let have = out[(kx * ny + yl) * n + kz];
                let tol = 1e-9 * (n * n * n) as f64;
                if (have - want).abs() > tol {
                    eprintln!(
                        "coll-bench fft: VALIDATION FAILED: N={n} rank={me} field={k}: point \
                         ({kx},{},{kz}) is {have:?}, a direct DFT gives {want:?}",
                        y0 + yl
                    );
                    ok = false;
                }
                spot += 1;
            }
        }
    }
    let validated = world.all_true(ok)?;
    let spot_checked = world.allreduce_u64(spot, consts::OP_SUM())? as u32;
    let overlap = |comm: f64, compute: f64, pipe: f64| {
        if comm > 0.0 {
            (100.0 - 100.0 * (pipe - compute) / comm).clamp(0.0, 100.0)
        } else {
            0.0
        }
    };
    let (comm_min, compute_min, pipe_min) = (max(comm.min)?, max(compute.min)?, max(pipe.min)?);
    let (comm, compute, post, wait, pipe) = (
        max(comm.mean)?,
        max(compute.mean)?,
        max(pipe.post)?,
        max(pipe.wait)?,
        max(pipe.mean)?,
    );
    Ok(Row {
        n,
        max_sent_bytes: max_sent,
        comm_us: comm * 1e6,
        compute_us: compute * 1e6,
        pipelined_us: pipe * 1e6,
        comm_min_us: comm_min * 1e6,
        compute_min_us: compute_min * 1e6,
        pipelined_min_us: pipe_min * 1e6,
        post_us: post * 1e6,
        wait_us: wait * 1e6,
        overlap_pct: overlap(comm, compute, pipe),
        overlap_min_pct: overlap(comm_min, compute_min, pipe_min),
        validated,
        moved_bitwise,
        spot_checked,
    })
}

pub fn fft(args: FftArgs) -> i32 {
    let nodes = match run::nodes() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("coll-bench: {e}");
            return 2;
        }
    };
    let Some(mpi) = run::init() else {
        return 1;
    };
    let world = mpi.world();
    let me = world.rank().unwrap_or_else(|e| fail(e));
    let ranks = world.size().unwrap_or_else(|e| fail(e)) as usize;
    if let Some(bad) = args.n.iter().find(|&&n| n == 0) {
        if me == 0 {
            eprintln!("coll-bench fft: N must be at least 1, not {bad}");
        }
        let _ = mpi.finalize();
        return 2;
    }
    let mode = run::mode();
    let mut json = None;
    if me == 0 {
        json = run::create_json(&args.json).map(BufWriter::new);
        println!(
            "# coll-bench fft: ranks={ranks} nodes={nodes} mode={mode} fields={} iters={} seed={}",
            args.fields, args.iters, args.seed
        );
        println!(
            "{:>5} {:>12} {:>11} {:>11} {:>13} {:>9} {:>9} {:>11} {:>9}",
            "N",
            "max_sent_B",
            "comm_us",
            "compute_us",
            "pipelined_us",
            "post_us",
            "wait_us",
            "overlap_pct",
            "validated"
        );
    }
    let mut all_ok = true;
    for &n in &args.n {
        let row = run_n(world, n, &args).unwrap_or_else(|e| fail(e));
        all_ok &= row.validated;
        if me == 0 {
            println!(
                "{:>5} {:>12} {:>11.1} {:>11.1} {:>13.1} {:>9.1} {:>9.1} {:>11.1} {:>9}",
                row.n,
                row.max_sent_bytes,
                row.comm_us,
                row.compute_us,
                row.pipelined_us,
                row.post_us,
                row.wait_us,
                row.overlap_pct,
                row.validated
            );
            let _ = std::io::stdout().flush();
            if let Some(w) = json.as_mut() {
                let line = serde_json::json!({
                    "bench": "fft",
                    "n": row.n,
                    "ranks": ranks,
                    "nodes": nodes,
                    "fields": args.fields,
                    "iters": args.iters,
                    "seed": args.seed,
                    "max_sent_bytes": row.max_sent_bytes,
                    "comm_us": row.comm_us,
                    "compute_us": row.compute_us,
                    "pipelined_us": row.pipelined_us,
                    "comm_min_us": row.comm_min_us,
                    "compute_min_us": row.compute_min_us,
                    "pipelined_min_us": row.pipelined_min_us,
                    "overlap_min_pct": row.overlap_min_pct,
                    "post_us": row.post_us,
                    "wait_us": row.wait_us,
                    "overlap_pct": row.overlap_pct,
                    "moved_bitwise": row.moved_bitwise,
                    "spot_checked": row.spot_checked,
                    "validated": row.validated,
                    "mode": mode,
                });
                if let Err(e) = writeln!(w, "{line}").and_then(|_| w.flush()) {
                    eprintln!("coll-bench: writing JSON: {e}");
                    Mpi::abort(2);
                }
            }
        }
    }
    if me == 0 && !all_ok {
        eprintln!("coll-bench fft: validation failed (see messages above)");
    }
    run::finish(mpi, all_ok)
}
