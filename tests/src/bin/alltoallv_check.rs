//! `alltoallv_check`: randomized validation of MPI_(I)Alltoall(v) as seen by an ordinary MPI
//! program, run under mpirun natively or with the host shim LD_PRELOADed.
//!
//! Every operation is executed twice on the same inputs: first through the `MPI_*` entry points
//! (what the shim intercepts), with requests completed by a random member of the Wait/Test
//! family and mixed with point-to-point requests and `MPI_REQUEST_NULL`; then through `PMPI_*`
//! (never intercepted: the native reference). The two receive buffers, pre-filled with a
//! position-dependent sentinel so bytes outside the received blocks are compared too, must be
//! byte-identical. The reference is itself checked against a model computed from the seed (every
//! rank can regenerate every peer's send buffer), so a mistake in how this program describes its
//! buffers cannot make both sides agree on a wrong answer.
//!
//! All parameters come from a SplitMix64 stream: the parts every rank must agree on (which
//! communicator, which collective, counts) from (seed, op, ...), per-rank data and layouts from
//! (seed, op, ..., rank). A failure prints the seed; rerunning with it reproduces the run.
//!
//! Exit code: 0 only if there was no mismatch and no MPI error. An MPI error (every return code
//! is checked; the communicators use MPI_ERRORS_RETURN) prints the call and aborts the job with
//! code 3; a request that never completes aborts after a timeout instead of hanging.

use clap::Parser;
use mpi_ffi::consts as c;
use mpi_ffi::{MPI_Comm, MPI_Datatype, MPI_Request, MPI_Status};
use std::os::raw::c_int;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    name = "alltoallv_check",
    about = "Randomized check of MPI_(I)Alltoall(v) (intercepted MPI_* calls) against PMPI_* \
             (native reference) in the same run. Run under mpirun.",
    long_about = "Randomized check of MPI_(I)Alltoall(v) as called through MPI_* (what an \
                  LD_PRELOADed shim intercepts) against the same operation through PMPI_* (the \
                  native reference) in the same run, byte for byte, including bytes outside the \
                  received blocks. Covers zero counts, gapped and reversed displacements, \
                  overlapping send blocks, MPI_BYTE/INT/DOUBLE, a contiguous and a non-contiguous \
                  derived type, world/dup/split communicators (also created and freed per op), \
                  1-4 outstanding requests completed by Wait/Waitall/Waitany/Waitsome/Test/\
                  Testall/Testany/Testsome mixed with Isend/Irecv and MPI_REQUEST_NULL, and rank \
                  skew. Exit code 0 only if there was no mismatch and no MPI error (MPI errors \
                  abort the job with code 3)."
)]
struct Cli {
    /// Number of randomized operations (each posts 1-4 collectives).
    #[arg(long, default_value_t = 200)]
    ops: u64,

    /// Seed of the pseudo-random stream; the same seed and rank count reproduce a run.
    #[arg(long, default_value_t = 1)]
    seed: u64,

    /// Largest element count per peer in one collective.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(0..=1 << 20))]
    max_count: u32,

    /// Rank 0 prints the plan of every operation.
    #[arg(long)]
    verbose: bool,

    /// Test hook (hidden): rank 0 flips one byte of one MPI_* result before comparing, so the
    /// run must report a mismatch and exit non-zero.
    #[arg(long, hide = true)]
    self_test_corrupt: bool,
}

// ---------------------------------------------------------------------------------------------
// Error handling: every MPI call is checked; a failure aborts the job (the other ranks may be
// blocked in a collective, so carrying on could hang).

static WORLD_RANK: AtomicI64 = AtomicI64::new(-1);
static CURRENT_OP: AtomicI64 = AtomicI64::new(-1);

fn mpi_failed(call: &str, rc: c_int) -> ! {
    let mut buf = vec![0u8; mpi_ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: buffer of MPI_MAX_ERROR_STRING bytes.
    let text = if unsafe { mpi_ffi::PMPI_Error_string(rc, buf.as_mut_ptr().cast(), &mut len) }
        == c::SUCCESS()
    {
        String::from_utf8_lossy(&buf[..len.clamp(0, buf.len() as c_int) as usize]).into_owned()
    } else {
        "(no error string)".into()
    };
    eprintln!(
        "alltoallv_check: MPI ERROR: rank {} op {}: {call} returned {rc}: {text}",
        WORLD_RANK.load(Ordering::Relaxed),
        CURRENT_OP.load(Ordering::Relaxed)
    );
    abort(3)
}

fn abort(code: c_int) -> ! {
    // SAFETY: plain call; exit if it returns.
    unsafe { mpi_ffi::PMPI_Abort(c::COMM_WORLD(), code) };
    std::process::exit(code)
}

/// Calls an MPI (or PMPI) function and aborts with a message if it does not return success.
macro_rules! mpi {
    ($f:ident ( $($a:expr),* $(,)? )) => {{
        // SAFETY: the callers pass valid handles and buffers that outlive the operation.
        let rc = unsafe { mpi_ffi::$f($($a),*) };
        if rc != c::SUCCESS() {
            mpi_failed(stringify!($f), rc);
        }
    }};
}

// ---------------------------------------------------------------------------------------------
// SplitMix64.

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

struct Rng(u64);

// Stream tags: which decision a stream is for.
const S_OP: u64 = 1;
const S_COUNTS: u64 = 2;
const S_SLAYOUT: u64 = 3;
const S_SDATA: u64 = 4;
const S_RLAYOUT: u64 = 5;
const S_RANK: u64 = 6;
const S_RING: u64 = 7;
const S_COMMS: u64 = 8;

impl Rng {
    /// A stream determined by `parts` (e.g. `[seed, tag, op, rank]`).
    fn derive(parts: &[u64]) -> Rng {
        let mut s = 0x243f_6a88_85a3_08d3u64;
        for &p in parts {
            s = mix(s ^ mix(p.wrapping_add(GOLDEN)));
        }
        Rng(s)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    /// Uniform in `0..n` (0 for n = 0).
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Datatypes and communicators.

struct Ty {
    name: &'static str,
    dt: MPI_Datatype,
    extent: usize,
    /// (offset, length) of the bytes one element covers, within its extent.
    segs: Vec<(usize, usize)>,
    derived: bool,
}

fn make_types() -> Vec<Ty> {
    let mut contig = c::DATATYPE_NULL();
    mpi!(MPI_Type_contiguous(3, c::INT(), &mut contig));
    mpi!(MPI_Type_commit(&mut contig));
    let mut vector = c::DATATYPE_NULL();
    mpi!(MPI_Type_vector(2, 1, 2, c::INT(), &mut vector));
    mpi!(MPI_Type_commit(&mut vector));
    let types = vec![
        Ty {
            name: "MPI_BYTE",
            dt: c::BYTE(),
            extent: 1,
            segs: vec![(0, 1)],
            derived: false,
        },
        Ty {
            name: "MPI_INT",
            dt: c::INT(),
            extent: 4,
            segs: vec![(0, 4)],
            derived: false,
        },
        Ty {
            name: "MPI_DOUBLE",
            dt: c::DOUBLE(),
            extent: 8,
            segs: vec![(0, 8)],
            derived: false,
        },
        Ty {
            name: "contiguous(3,MPI_INT)",
            dt: contig,
            extent: 12,
            segs: vec![(0, 12)],
            derived: true,
        },
        Ty {
            name: "vector(2,1,2,MPI_INT)",
            dt: vector,
            extent: 12,
            segs: vec![(0, 4), (8, 4)],
            derived: true,
        },
    ];
    // The layouts above are what this program assumes; make sure the library agrees.
    for t in &types {
        let (mut lb, mut extent, mut size) = (0, 0, 0);
        mpi!(MPI_Type_get_extent(t.dt, &mut lb, &mut extent));
        mpi!(MPI_Type_size(t.dt, &mut size));
        let seg_bytes: usize = t.segs.iter().map(|s| s.1).sum();
        if lb != 0 || extent as usize != t.extent || size as usize != seg_bytes {
            eprintln!(
                "alltoallv_check: datatype {} has lb={lb} extent={extent} size={size}, expected 0/{}/{seg_bytes}",
                t.name, t.extent
            );
            abort(4);
        }
    }
    types
}

/// Picks a datatype: BYTE 25%, INT 20%, DOUBLE 20%, contiguous 20%, vector 15%.
fn pick_type(r: &mut Rng) -> usize {
    match r.below(100) {
        0..=24 => 0,
        25..=44 => 1,
        45..=64 => 2,
        65..=84 => 3,
        _ => 4,
    }
}

struct CommInfo {
    name: String,
    comm: MPI_Comm,
    rank: usize,
    size: usize,
    /// Identifies this rank's sub-communicator among those created by the same call (all its
    /// members agree on it), so data streams of different sub-communicators differ.
    color: u64,
}

fn comm_info(name: String, comm: MPI_Comm, color: u64) -> CommInfo {
    mpi!(MPI_Comm_set_errhandler(comm, c::ERRORS_RETURN()));
    let (mut rank, mut size) = (0, 0);
    mpi!(MPI_Comm_rank(comm, &mut rank));
    mpi!(MPI_Comm_size(comm, &mut size));
    CommInfo {
        name,
        comm,
        rank: rank as usize,
        size: size as usize,
        color,
    }
}

fn dup(base: &CommInfo, name: String) -> CommInfo {
    let mut comm = c::COMM_NULL();
    mpi!(MPI_Comm_dup(base.comm, &mut comm));
    comm_info(name, comm, base.color)
}

/// `MPI_Comm_split` of world with colors and keys drawn from `stream` (the same on all ranks).
fn split(world: &CommInfo, stream: &[u64], reversed_key: bool, label: &str) -> CommInfo {
    let p = world.size as u64;
    let ncolors = Rng::derive(stream).range(1, p.min(3));
    let color_of = |r: u64| {
        let mut s = stream.to_vec();
        s.push(r);
        Rng::derive(&s).below(ncolors)
    };
    let color = color_of(world.rank as u64);
    let key = if reversed_key {
        (p - world.rank as u64) as c_int
    } else {
        let mut s = stream.to_vec();
        s.extend([u64::MAX, world.rank as u64]);
        Rng::derive(&s).below(1000) as c_int
    };
    let mut comm = c::COMM_NULL();
    mpi!(MPI_Comm_split(world.comm, color as c_int, key, &mut comm));
    let keyname = if reversed_key { "reversed" } else { "random" };
    comm_info(
        format!("{label}(color={color},key={keyname})"),
        comm,
        mix(color ^ mix(stream[stream.len() - 1])),
    )
}

fn free_comm(ci: CommInfo) {
    let mut comm = ci.comm;
    mpi!(MPI_Comm_free(&mut comm));
}

// ---------------------------------------------------------------------------------------------
// One collective instance.

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Ialltoallv,
    Alltoallv,
    Ialltoall,
    Alltoall,
}

impl Kind {
    fn is_v(self) -> bool {
        matches!(self, Kind::Ialltoallv | Kind::Alltoallv)
    }

    fn is_nonblocking(self) -> bool {
        matches!(self, Kind::Ialltoallv | Kind::Ialltoall)
    }
}

/// Bytes after the last block of every buffer, compared like the rest.
const SLACK: usize = 16;

fn sentinel(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| 0xA5u8 ^ (i as u8).wrapping_mul(29) ^ (i >> 8) as u8)
        .collect()
}

/// Element displacements for blocks of `counts`: identity, reversed or shuffled peer order,
/// random gaps, a random start; with `allow_overlap`, sometimes all blocks at one place
/// (legal for send buffers only). Returns the displacements and the elements the buffer needs.
fn layout(r: &mut Rng, counts: &[i32], allow_overlap: bool) -> (Vec<i32>, usize) {
    let n = counts.len();
    let max = counts.iter().copied().max().unwrap_or(0).max(0) as usize;
    if allow_overlap && r.chance(1, 10) {
        let base = r.below(3) as usize;
        return (vec![base as i32; n], base + max);
    }
    let mut order: Vec<usize> = (0..n).collect();
    match r.below(10) {
        0..=3 => {}
        4..=6 => order.reverse(),
        _ => r.shuffle(&mut order),
    }
    let mut displs = vec![0i32; n];
    let mut pos = r.below(3) as usize;
    for j in order {
        if r.chance(1, 2) {
            pos += r.below(4) as usize;
        }
        displs[j] = i32::try_from(pos).unwrap_or_else(|_| {
            eprintln!("alltoallv_check: displacement overflows int; lower --max-count");
            abort(2)
        });
        pos += counts[j] as usize;
    }
    (displs, pos + r.below(2) as usize)
}

/// What every rank agrees on for one instance.
struct Plan {
    kind: Kind,
    comm: usize,
    ty: usize,
}

/// The counts matrix `m[i][j]` = elements comm rank i sends to comm rank j.
fn count_matrix(
    seed: u64,
    op: u64,
    inst: u64,
    color: u64,
    n: usize,
    kind: Kind,
    max_count: u64,
) -> Vec<Vec<i32>> {
    let mut r = Rng::derive(&[seed, S_COUNTS, op, inst, color, n as u64]);
    let draw = |r: &mut Rng| {
        if r.chance(1, 4) {
            0
        } else {
            r.range(1, max_count.max(1)) as i32
        }
    };
    if max_count == 0 {
        return vec![vec![0; n]; n];
    }
    if !kind.is_v() {
        let cnt = if r.chance(1, 10) {
            0
        } else {
            r.range(1, max_count) as i32
        };
        return vec![vec![cnt; n]; n];
    }
    let mode = r.below(100);
    if mode < 6 {
        return vec![vec![0; n]; n]; // nothing at all
    }
    let mut m: Vec<Vec<i32>> = (0..n)
        .map(|_| (0..n).map(|_| draw(&mut r)).collect())
        .collect();
    if mode < 20 {
        let s = r.below(n as u64) as usize; // a rank that sends nothing
        m[s].iter_mut().for_each(|x| *x = 0);
    }
    if (14..30).contains(&mode) {
        let d = r.below(n as u64) as usize; // a rank that receives nothing
        m.iter_mut().for_each(|row| row[d] = 0);
    }
    if r.chance(1, 5) {
        (0..n).for_each(|i| m[i][i] = 0); // nothing to self
    }
    m
}

/// Send displacements and send buffer of comm rank `r` (any rank can compute any rank's).
#[allow(clippy::too_many_arguments)]
fn send_side(
    seed: u64,
    op: u64,
    inst: u64,
    color: u64,
    r: usize,
    counts: &[i32],
    kind: Kind,
    ty: &Ty,
) -> (Vec<i32>, Vec<u8>) {
    let (displs, elems) = if kind.is_v() {
        layout(
            &mut Rng::derive(&[seed, S_SLAYOUT, op, inst, color, r as u64]),
            counts,
            true,
        )
    } else {
        let cnt = counts.first().copied().unwrap_or(0);
        (
            (0..counts.len()).map(|j| j as i32 * cnt).collect(),
            counts.len() * cnt as usize,
        )
    };
    let mut buf = vec![0u8; elems * ty.extent + SLACK];
    Rng::derive(&[seed, S_SDATA, op, inst, color, r as u64]).fill(&mut buf);
    (displs, buf)
}

struct Inst {
    plan_idx: usize,
    kind: Kind,
    comm: MPI_Comm,
    comm_name: String,
    ty: usize,
    me: usize,
    n: usize,
    scounts: Vec<i32>,
    sdispls: Vec<i32>,
    rcounts: Vec<i32>,
    rdispls: Vec<i32>,
    send: Vec<u8>,
    send_copy: Vec<u8>,
    recv: Vec<u8>,
    reference: Vec<u8>,
    model: Vec<u8>,
}

#[allow(clippy::too_many_arguments)]
fn build_inst(
    seed: u64,
    op: u64,
    idx: usize,
    plan: &Plan,
    ci: &CommInfo,
    types: &[Ty],
    max_count: u64,
    want_model: bool,
) -> Inst {
    let (n, me, inst) = (ci.size, ci.rank, idx as u64);
    let ty = &types[plan.ty];
    let m = count_matrix(seed, op, inst, ci.color, n, plan.kind, max_count);
    let scounts = m[me].clone();
    let rcounts: Vec<i32> = (0..n).map(|j| m[j][me]).collect();
    let (sdispls, send) = send_side(seed, op, inst, ci.color, me, &scounts, plan.kind, ty);
    let (rdispls, relems) = if plan.kind.is_v() {
        layout(
            &mut Rng::derive(&[seed, S_RLAYOUT, op, inst, ci.color, me as u64]),
            &rcounts,
            false,
        )
    } else {
        let cnt = rcounts.first().copied().unwrap_or(0);
        ((0..n).map(|j| j as i32 * cnt).collect(), n * cnt as usize)
    };
    let rlen = relems * ty.extent + SLACK;
    let mut model = sentinel(rlen);
    if want_model {
        for j in 0..n {
            if rcounts[j] == 0 {
                continue;
            }
            let (sd, sbuf) = send_side(seed, op, inst, ci.color, j, &m[j], plan.kind, ty);
            let src = sd[me] as usize * ty.extent;
            let dst = rdispls[j] as usize * ty.extent;
            for e in 0..rcounts[j] as usize {
                for &(o, l) in &ty.segs {
                    let (s0, d0) = (src + e * ty.extent + o, dst + e * ty.extent + o);
                    model[d0..d0 + l].copy_from_slice(&sbuf[s0..s0 + l]);
                }
            }
        }
    }
    Inst {
        plan_idx: idx,
        kind: plan.kind,
        comm: ci.comm,
        comm_name: ci.name.clone(),
        ty: plan.ty,
        me,
        n,
        scounts,
        sdispls,
        rcounts,
        rdispls,
        send_copy: send.clone(),
        send,
        recv: sentinel(rlen),
        reference: sentinel(rlen),
        model,
    }
}

/// Which peer's block holds byte `off` of the receive buffer, as text.
fn locate(inst: &Inst, ext: usize, off: usize) -> String {
    for j in 0..inst.n {
        let (start, cnt) = (inst.rdispls[j] as usize * ext, inst.rcounts[j] as usize);
        if cnt > 0 && off >= start && off < start + cnt * ext {
            let rel = off - start;
            return format!("peer={j} (elem {} byte {})", rel / ext, rel % ext);
        }
    }
    "peer=none (outside every received block)".into()
}

struct Checker {
    wrank: usize,
    mismatches: u64,
    printed: u64,
}

const PRINT_LIMIT: u64 = 200;
const PRINT_PER_BUFFER: u64 = 8;

impl Checker {
    fn report(&mut self, line: String) {
        self.mismatches += 1;
        if self.printed < PRINT_LIMIT {
            eprintln!("alltoallv_check: MISMATCH rank={} {line}", self.wrank);
            self.printed += 1;
            if self.printed == PRINT_LIMIT {
                eprintln!(
                    "alltoallv_check: rank {}: further mismatches counted, not printed",
                    self.wrank
                );
            }
        }
    }

    /// Compares two receive buffers of `inst` byte for byte.
    fn compare(&mut self, op: u64, inst: &Inst, types: &[Ty], what: &str, exp: &[u8], got: &[u8]) {
        let ty = &types[inst.ty];
        let mut shown = 0;
        for off in 0..exp.len().max(got.len()) {
            let (e, g) = (exp.get(off), got.get(off));
            if e == g {
                continue;
            }
            if shown < PRINT_PER_BUFFER {
                shown += 1;
                let fmt = |b: Option<&u8>| b.map_or("none".to_string(), |b| format!("0x{b:02x}"));
                self.report(format!(
                    "op={op} inst={} {:?} comm={} (rank {} of {}) type={} {what}: {} offset={off} expected={} got={}",
                    inst.plan_idx,
                    inst.kind,
                    inst.comm_name,
                    inst.me,
                    inst.n,
                    ty.name,
                    locate(inst, ty.extent, off),
                    fmt(e),
                    fmt(g)
                ));
            } else {
                self.mismatches += 1;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Posting and completing.

/// Posts (or, for the blocking kinds, runs) `inst` through MPI_* or PMPI_*. The caller keeps
/// `inst` alive and unmoved until a nonblocking request completes.
fn post(inst: &mut Inst, types: &[Ty], pmpi: bool, req: &mut MPI_Request) {
    let dt = types[inst.ty].dt;
    let (sb, rb) = (
        inst.send.as_ptr().cast(),
        if pmpi {
            inst.reference.as_mut_ptr()
        } else {
            inst.recv.as_mut_ptr()
        }
        .cast(),
    );
    let (sc, sd, rc, rd) = (
        inst.scounts.as_ptr(),
        inst.sdispls.as_ptr(),
        inst.rcounts.as_ptr(),
        inst.rdispls.as_ptr(),
    );
    let cnt = inst.scounts.first().copied().unwrap_or(0);
    let comm = inst.comm;
    match (inst.kind, pmpi) {
        (Kind::Ialltoallv, false) => {
            mpi!(MPI_Ialltoallv(sb, sc, sd, dt, rb, rc, rd, dt, comm, req))
        }
        (Kind::Ialltoallv, true) => {
            mpi!(PMPI_Ialltoallv(sb, sc, sd, dt, rb, rc, rd, dt, comm, req))
        }
        (Kind::Alltoallv, false) => mpi!(MPI_Alltoallv(sb, sc, sd, dt, rb, rc, rd, dt, comm)),
        (Kind::Alltoallv, true) => mpi!(PMPI_Alltoallv(sb, sc, sd, dt, rb, rc, rd, dt, comm)),
        (Kind::Ialltoall, false) => mpi!(MPI_Ialltoall(sb, cnt, dt, rb, cnt, dt, comm, req)),
        (Kind::Ialltoall, true) => mpi!(PMPI_Ialltoall(sb, cnt, dt, rb, cnt, dt, comm, req)),
        (Kind::Alltoall, false) => mpi!(MPI_Alltoall(sb, cnt, dt, rb, cnt, dt, comm)),
        (Kind::Alltoall, true) => mpi!(PMPI_Alltoall(sb, cnt, dt, rb, cnt, dt, comm)),
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Slot {
    Coll(usize),
    Send,
    Recv,
    Null,
}

#[derive(Clone, Copy, Debug)]
enum Method {
    Wait,
    Waitall,
    Waitany,
    Waitsome,
    Test,
    Testall,
    Testany,
    Testsome,
    TestThenWaitall,
}

const METHODS: [Method; 9] = [
    Method::Wait,
    Method::Waitall,
    Method::Waitany,
    Method::Waitsome,
    Method::Test,
    Method::Testall,
    Method::Testany,
    Method::Testsome,
    Method::TestThenWaitall,
];

/// A request that is still pending after this long is reported and the job aborted.
const STUCK: Duration = Duration::from_secs(60);

struct Completion<'a> {
    op: u64,
    reqs: Vec<MPI_Request>,
    slots: Vec<Slot>,
    done: Vec<bool>,
    ring_left: i32,
    ring_tag: i32,
    checker: &'a mut Checker,
    started: Instant,
}

impl Completion<'_> {
    fn completed(&mut self, i: usize, status: Option<&MPI_Status>) {
        if i >= self.slots.len() {
            self.checker.report(format!(
                "op={} completion reported index {i} out of range",
                self.op
            ));
            return;
        }
        if self.slots[i] == Slot::Null {
            self.checker.report(format!(
                "op={} completion reported MPI_REQUEST_NULL entry {i}",
                self.op
            ));
            return;
        }
        if std::mem::replace(&mut self.done[i], true) {
            self.checker.report(format!(
                "op={} request {i} ({:?}) completed twice",
                self.op, self.slots[i]
            ));
        }
        if let (Slot::Recv, Some(st)) = (self.slots[i], status) {
            if st.MPI_SOURCE != self.ring_left || st.MPI_TAG != self.ring_tag {
                self.checker.report(format!(
                    "op={} Irecv status source={} tag={}, expected source={} tag={}",
                    self.op, st.MPI_SOURCE, st.MPI_TAG, self.ring_left, self.ring_tag
                ));
            }
        }
    }

    fn check_stuck(&self, method: Method) {
        if self.started.elapsed() > STUCK {
            let pending: Vec<String> = (0..self.slots.len())
                .filter(|&i| self.slots[i] != Slot::Null && !self.done[i])
                .map(|i| format!("{i}:{:?}", self.slots[i]))
                .collect();
            eprintln!(
                "alltoallv_check: STUCK: rank {} op {} {method:?}: requests still pending after {:?}: {}",
                self.checker.wrank,
                self.op,
                STUCK,
                pending.join(", ")
            );
            abort(5);
        }
    }

    fn run(&mut self, method: Method, ignore: bool, r: &mut Rng) {
        let n = self.reqs.len();
        let nc = n as c_int;
        let mut sts = vec![MPI_Status::default(); n.max(1)];
        let mut st = MPI_Status::default();
        let one = |st: &mut MPI_Status| {
            if ignore {
                c::STATUS_IGNORE()
            } else {
                st as *mut _
            }
        };
        let many = |sts: &mut Vec<MPI_Status>| {
            if ignore {
                c::STATUSES_IGNORE()
            } else {
                sts.as_mut_ptr()
            }
        };
        let status_of = |i: usize, sts: &[MPI_Status]| if ignore { None } else { Some(sts[i]) };
        match method {
            Method::Wait => {
                let mut order: Vec<usize> = (0..n).collect();
                r.shuffle(&mut order);
                for i in order {
                    let was_null = self.slots[i] == Slot::Null;
                    mpi!(MPI_Wait(&mut self.reqs[i], one(&mut st)));
                    if !was_null {
                        self.completed(i, if ignore { None } else { Some(&st) });
                    }
                }
            }
            Method::Waitall => {
                mpi!(MPI_Waitall(nc, self.reqs.as_mut_ptr(), many(&mut sts)));
                for i in 0..n {
                    if self.slots[i] != Slot::Null {
                        self.completed(i, status_of(i, &sts).as_ref());
                    }
                }
            }
            Method::Waitany | Method::Testany => loop {
                let (mut idx, mut flag) = (0, 0);
                if matches!(method, Method::Waitany) {
                    mpi!(MPI_Waitany(
                        nc,
                        self.reqs.as_mut_ptr(),
                        &mut idx,
                        one(&mut st)
                    ));
                    flag = 1;
                } else {
                    mpi!(MPI_Testany(
                        nc,
                        self.reqs.as_mut_ptr(),
                        &mut idx,
                        &mut flag,
                        one(&mut st)
                    ));
                }
                if flag == 0 {
                    self.check_stuck(method);
                    continue;
                }
                if idx == c::UNDEFINED() {
                    break;
                }
                self.completed(idx as usize, if ignore { None } else { Some(&st) });
            },
            Method::Waitsome | Method::Testsome => loop {
                let mut out = 0;
                let mut idxs = vec![0 as c_int; n.max(1)];
                if matches!(method, Method::Waitsome) {
                    mpi!(MPI_Waitsome(
                        nc,
                        self.reqs.as_mut_ptr(),
                        &mut out,
                        idxs.as_mut_ptr(),
                        many(&mut sts)
                    ));
                } else {
                    mpi!(MPI_Testsome(
                        nc,
                        self.reqs.as_mut_ptr(),
                        &mut out,
                        idxs.as_mut_ptr(),
                        many(&mut sts)
                    ));
                }
                if out == c::UNDEFINED() {
                    break;
                }
                if out == 0 {
                    if matches!(method, Method::Waitsome) {
                        self.checker
                            .report(format!("op={} MPI_Waitsome returned outcount 0", self.op));
                    }
                    self.check_stuck(method);
                    continue;
                }
                for (k, &i) in idxs.iter().enumerate().take(out as usize) {
                    self.completed(i as usize, status_of(k, &sts).as_ref());
                }
            },
            Method::Test => {
                // Round-robin MPI_Test over the array; null entries are tested once too.
                let mut first = true;
                loop {
                    let mut pending = false;
                    for i in 0..n {
                        let is_null_slot = self.slots[i] == Slot::Null;
                        if (is_null_slot && !first) || (!is_null_slot && self.done[i]) {
                            continue;
                        }
                        let mut flag = 0;
                        mpi!(MPI_Test(&mut self.reqs[i], &mut flag, one(&mut st)));
                        if is_null_slot {
                            if flag == 0 {
                                self.checker.report(format!(
                                    "op={} MPI_Test on MPI_REQUEST_NULL gave flag=0",
                                    self.op
                                ));
                            }
                        } else if flag != 0 {
                            self.completed(i, if ignore { None } else { Some(&st) });
                        } else {
                            pending = true;
                        }
                    }
                    first = false;
                    if !pending {
                        break;
                    }
                    self.check_stuck(method);
                }
            }
            Method::Testall => loop {
                let mut flag = 0;
                mpi!(MPI_Testall(
                    nc,
                    self.reqs.as_mut_ptr(),
                    &mut flag,
                    many(&mut sts)
                ));
                if flag != 0 {
                    for i in 0..n {
                        if self.slots[i] != Slot::Null {
                            self.completed(i, status_of(i, &sts).as_ref());
                        }
                    }
                    break;
                }
                self.check_stuck(method);
            },
            Method::TestThenWaitall => {
                for i in 0..n {
                    let mut flag = 0;
                    mpi!(MPI_Test(&mut self.reqs[i], &mut flag, one(&mut st)));
                    if flag != 0 && self.slots[i] != Slot::Null {
                        self.completed(i, if ignore { None } else { Some(&st) });
                    }
                }
                let still: Vec<usize> = (0..n)
                    .filter(|&i| self.slots[i] != Slot::Null && !self.done[i])
                    .collect();
                mpi!(MPI_Waitall(nc, self.reqs.as_mut_ptr(), many(&mut sts)));
                for i in still {
                    self.completed(i, status_of(i, &sts).as_ref());
                }
            }
        }
        // Everything must be complete, once, and every handle reset to MPI_REQUEST_NULL.
        for i in 0..n {
            if self.slots[i] != Slot::Null && !self.done[i] {
                self.checker.report(format!(
                    "op={} {method:?}: request {i} ({:?}) never reported complete",
                    self.op, self.slots[i]
                ));
            }
            if self.reqs[i] != c::REQUEST_NULL() {
                self.checker.report(format!(
                    "op={} {method:?}: request {i} ({:?}) not set to MPI_REQUEST_NULL after completion",
                    self.op, self.slots[i]
                ));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------

struct Run {
    seed: u64,
    max_count: u64,
    verbose: bool,
    corrupt_pending: bool,
    ops: u64,
    world: CommInfo,
    comms: Vec<CommInfo>,
    types: Vec<Ty>,
    late_rank: usize,
    checker: Checker,
}

fn ring_len(seed: u64, op: u64, r: usize) -> usize {
    Rng::derive(&[seed, S_RING, op, r as u64]).below(257) as usize
}

fn ring_data(seed: u64, op: u64, r: usize) -> Vec<u8> {
    let mut v = vec![0u8; ring_len(seed, op, r)];
    Rng::derive(&[seed, S_RING, op, r as u64, 1]).fill(&mut v);
    v
}

impl Run {
    fn op(&mut self, op: u64) {
        CURRENT_OP.store(op as i64, Ordering::Relaxed);
        let (seed, wrank, p) = (self.seed, self.world.rank, self.world.size);
        let mut shared = Rng::derive(&[seed, S_OP, op]);
        let mut mine = Rng::derive(&[seed, S_RANK, op, wrank as u64]);

        // A communicator created (and freed) just for this op, sometimes.
        let fresh = match shared.below(12) {
            0 => Some(dup(&self.world, "fresh dup(world)".into())),
            1 => Some(split(
                &self.world,
                &[seed, S_COMMS, 100, op],
                shared.chance(1, 2),
                "fresh split",
            )),
            2 => {
                let base = &self.comms[2 + shared.below(2) as usize];
                Some(dup(base, format!("fresh dup({})", base.name)))
            }
            _ => None,
        };
        let ncomms = self.comms.len() + fresh.is_some() as usize;
        let ninst = shared.range(1, 4) as usize;
        let plans: Vec<Plan> = (0..ninst)
            .map(|_| {
                let kind = match shared.below(100) {
                    0..=54 => Kind::Ialltoallv,
                    55..=69 => Kind::Alltoallv,
                    70..=89 => Kind::Ialltoall,
                    _ => Kind::Alltoall,
                };
                let comm = if fresh.is_some() && shared.chance(1, 2) {
                    ncomms - 1
                } else {
                    shared.below(self.comms.len() as u64) as usize
                };
                Plan {
                    kind,
                    comm,
                    ty: pick_type(&mut shared),
                }
            })
            .collect();
        let ring = shared.chance(2, 5);
        let skew = shared.chance(1, 4);
        let nnull = shared.below(3) as usize;

        let comm_at = |k: usize| -> &CommInfo {
            if k < self.comms.len() {
                &self.comms[k]
            } else {
                fresh.as_ref().unwrap()
            }
        };
        if self.verbose && wrank == 0 {
            let desc: Vec<String> = plans
                .iter()
                .map(|pl| {
                    format!(
                        "{:?}/{}/{}",
                        pl.kind,
                        comm_at(pl.comm).name,
                        self.types[pl.ty].name
                    )
                })
                .collect();
            println!(
                "alltoallv_check: op {op}: {} ring={ring} skew={skew} nulls={nnull}",
                desc.join(", ")
            );
        }
        let mut insts: Vec<Inst> = plans
            .iter()
            .enumerate()
            .map(|(i, pl)| {
                build_inst(
                    seed,
                    op,
                    i,
                    pl,
                    comm_at(pl.comm),
                    &self.types,
                    self.max_count,
                    true,
                )
            })
            .collect();

        // Ring exchange on world, mixed into the same request array.
        let left = (wrank + p - 1) % p;
        let right = (wrank + 1) % p;
        let tag = 1000 + (op % 30000) as c_int;
        let ring_send = ring_data(seed, op, wrank);
        let mut ring_recv = vec![0u8; ring_len(seed, op, left)];

        let mut reqs: Vec<MPI_Request> = Vec::new();
        let mut slots: Vec<Slot> = Vec::new();
        if skew {
            let ms = if wrank == self.late_rank {
                3
            } else {
                mine.below(3)
            };
            std::thread::sleep(Duration::from_millis(ms));
        }
        let ring_at = mine.below(ninst as u64 + 1) as usize;
        for (i, inst) in insts.iter_mut().enumerate() {
            if ring && i == ring_at {
                self.post_ring(
                    &ring_send,
                    &mut ring_recv,
                    left,
                    right,
                    tag,
                    &mut reqs,
                    &mut slots,
                );
            }
            if skew && mine.chance(1, 3) {
                std::thread::sleep(Duration::from_micros(mine.below(1000)));
            }
            let mut req = c::REQUEST_NULL();
            // Buffers live in `insts` until the op ends, after every completion.
            post(inst, &self.types, false, &mut req);
            if inst.kind.is_nonblocking() {
                reqs.push(req);
                slots.push(Slot::Coll(i));
            }
        }
        if ring && ring_at == ninst {
            self.post_ring(
                &ring_send,
                &mut ring_recv,
                left,
                right,
                tag,
                &mut reqs,
                &mut slots,
            );
        }
        for _ in 0..nnull {
            let at = mine.below(reqs.len() as u64 + 1) as usize;
            reqs.insert(at, c::REQUEST_NULL());
            slots.insert(at, Slot::Null);
        }
        // Complete with a per-rank choice of method (ranks need not agree).
        let method = METHODS[mine.below(METHODS.len() as u64) as usize];
        let ignore = mine.chance(1, 3);
        if self.verbose && wrank == 0 {
            println!("alltoallv_check: op {op}: rank 0 completes {:?} with {method:?} ignore_status={ignore}", slots);
        }
        let n = reqs.len();
        let mut completion = Completion {
            op,
            reqs,
            slots,
            done: vec![false; n],
            ring_left: left as i32,
            ring_tag: tag,
            checker: &mut self.checker,
            started: Instant::now(),
        };
        completion.run(method, ignore, &mut mine);

        // Point-to-point payload and untouched send buffers.
        if ring {
            let exp = ring_data(seed, op, left);
            if exp != ring_recv {
                self.checker
                    .report(format!("op={op} ring Irecv from {left}: payload differs"));
            }
        }
        for inst in &insts {
            if inst.send != inst.send_copy {
                let off = inst
                    .send
                    .iter()
                    .zip(&inst.send_copy)
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                self.checker.report(format!(
                    "op={op} inst={} {:?} comm={}: send buffer modified at offset {off}",
                    inst.plan_idx, inst.kind, inst.comm_name
                ));
            }
        }

        // Native reference through PMPI, in the same order on every rank.
        for inst in insts.iter_mut() {
            let mut req = c::REQUEST_NULL();
            post(inst, &self.types, true, &mut req);
            if inst.kind.is_nonblocking() {
                mpi!(PMPI_Wait(&mut req, c::STATUS_IGNORE()));
            }
        }
        for inst in insts.iter_mut() {
            // Flip a received data byte (the first instance that has one); if the whole run
            // receives nothing on rank 0, a sentinel byte of the very last instance instead.
            let first_block = (0..inst.n).find(|&j| inst.rcounts[j] > 0);
            let last_chance = op + 1 == self.ops && inst.plan_idx + 1 == ninst;
            if self.corrupt_pending && wrank == 0 && (first_block.is_some() || last_chance) {
                let ty = &self.types[inst.ty];
                let off =
                    first_block.map_or(0, |j| inst.rdispls[j] as usize * ty.extent + ty.segs[0].0);
                inst.recv[off] ^= 0x40;
                self.corrupt_pending = false;
                eprintln!(
                    "alltoallv_check: --self-test-corrupt: flipped byte {off} of op {op} inst {} on rank 0",
                    inst.plan_idx
                );
            }
            self.checker.compare(
                op,
                inst,
                &self.types,
                "MPI_* vs PMPI_*",
                &inst.reference,
                &inst.recv,
            );
            self.checker.compare(
                op,
                inst,
                &self.types,
                "PMPI_* vs model",
                &inst.model,
                &inst.reference,
            );
        }
        drop(insts);
        if let Some(f) = fresh {
            free_comm(f);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn post_ring(
        &self,
        send: &[u8],
        recv: &mut [u8],
        left: usize,
        right: usize,
        tag: c_int,
        reqs: &mut Vec<MPI_Request>,
        slots: &mut Vec<Slot>,
    ) {
        let w = self.world.comm;
        let (mut rr, mut sr) = (c::REQUEST_NULL(), c::REQUEST_NULL());
        mpi!(MPI_Irecv(
            recv.as_mut_ptr().cast(),
            recv.len() as c_int,
            c::BYTE(),
            left as c_int,
            tag,
            w,
            &mut rr
        ));
        mpi!(MPI_Isend(
            send.as_ptr().cast(),
            send.len() as c_int,
            c::BYTE(),
            right as c_int,
            tag,
            w,
            &mut sr
        ));
        reqs.extend([rr, sr]);
        slots.extend([Slot::Recv, Slot::Send]);
    }
}

fn main() {
    let cli = Cli::parse();
    mpi!(MPI_Init(std::ptr::null_mut(), std::ptr::null_mut()));
    mpi!(MPI_Comm_set_errhandler(c::COMM_WORLD(), c::ERRORS_RETURN()));
    let world = comm_info("world".into(), c::COMM_WORLD(), 0);
    WORLD_RANK.store(world.rank as i64, Ordering::Relaxed);
    let (seed, p) = (cli.seed, world.size);
    if world.rank == 0 {
        println!("alltoallv_check: seed={seed} ops={} ranks={p}", cli.ops);
    }
    let types = make_types();
    let comms = vec![
        comm_info("world".into(), c::COMM_WORLD(), 0),
        dup(&world, "dup(world)".into()),
        split(&world, &[seed, S_COMMS, 1], false, "split"),
        split(&world, &[seed, S_COMMS, 2], true, "split"),
    ];
    let late_rank = Rng::derive(&[seed, S_COMMS, 3]).below(p as u64) as usize;
    let mut run = Run {
        seed,
        max_count: cli.max_count as u64,
        verbose: cli.verbose,
        corrupt_pending: cli.self_test_corrupt,
        ops: cli.ops,
        checker: Checker {
            wrank: world.rank,
            mismatches: 0,
            printed: 0,
        },
        world,
        comms,
        types,
        late_rank,
    };
    let t0 = Instant::now();
    for op in 0..cli.ops {
        run.op(op);
    }
    CURRENT_OP.store(-1, Ordering::Relaxed);

    // The verdict goes through PMPI so it cannot depend on the code under test.
    let local = run.checker.mismatches;
    let mut total = 0u64;
    mpi!(PMPI_Allreduce(
        (&local as *const u64).cast(),
        (&mut total as *mut u64).cast(),
        1,
        c::UINT64_T(),
        c::OP_SUM(),
        c::COMM_WORLD()
    ));
    if run.world.rank == 0 {
        println!("alltoallv_check: {} ops, {total} mismatches", cli.ops);
        println!("alltoallv_check: took {:.1} s", t0.elapsed().as_secs_f64());
    }
    for ci in run.comms.drain(1..) {
        free_comm(ci);
    }
    for t in run.types.drain(..) {
        if t.derived {
            let mut dt = t.dt;
            mpi!(MPI_Type_free(&mut dt));
        }
    }
    mpi!(MPI_Finalize());
    std::process::exit(if total == 0 { 0 } else { 1 });
}
