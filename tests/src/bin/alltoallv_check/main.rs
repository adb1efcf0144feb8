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

#[macro_use]
mod fail;
mod checker;
mod completion;
mod inst;
mod rng;
mod types;

use checker::Checker;
use clap::Parser;
use completion::{post, Completion, Slot, METHODS};
use fail::CURRENT_OP;
use fail::WORLD_RANK;
use inst::{build_inst, Inst, Kind, Plan};
use mpi_ffi::consts as c;
use mpi_ffi::MPI_Request;
use rng::{Rng, S_COMMS, S_OP, S_RANK, S_RING};
use std::os::raw::c_int;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use types::{comm_info, dup, free_comm, make_types, pick_type, split, CommInfo, Ty};

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

/// One op's point-to-point exchange on world: from the left neighbour, to the right one.
struct RingBufs {
    send: Vec<u8>,
    recv: Vec<u8>,
    left: usize,
    right: usize,
    tag: c_int,
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
        let tag = 1000 + (op % 30000) as c_int;
        let mut ring_bufs = RingBufs {
            send: ring_data(seed, op, wrank),
            recv: vec![0u8; ring_len(seed, op, left)],
            left,
            right: (wrank + 1) % p,
            tag,
        };

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
        // The ring goes before instance `ring_at`, or after the last one.
        for i in 0..=ninst {
            if ring && i == ring_at {
                self.post_ring(&mut ring_bufs, &mut reqs, &mut slots);
            }
            let Some(inst) = insts.get_mut(i) else {
                break;
            };
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
            if exp != ring_bufs.recv {
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

    /// Posts the ring's Irecv and Isend (in that order) into `reqs`. The buffers of `ring` must
    /// stay put until both complete.
    fn post_ring(&self, ring: &mut RingBufs, reqs: &mut Vec<MPI_Request>, slots: &mut Vec<Slot>) {
        let w = self.world.comm;
        let (mut rr, mut sr) = (c::REQUEST_NULL(), c::REQUEST_NULL());
        mpi!(MPI_Irecv(
            ring.recv.as_mut_ptr().cast(),
            ring.recv.len() as c_int,
            c::BYTE(),
            ring.left as c_int,
            ring.tag,
            w,
            &mut rr
        ));
        mpi!(MPI_Isend(
            ring.send.as_ptr().cast(),
            ring.send.len() as c_int,
            c::BYTE(),
            ring.right as c_int,
            ring.tag,
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
