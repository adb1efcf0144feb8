//! The buffers of one size of `overlap`: filling them with the validation pattern, posting
//! the collective and checking what arrived.

use crate::coll::{bcast_root, Coll};
use coll_bench::mpi::{wtime, Comm, Datatype, MpiError};
use coll_bench::{compute, pattern, strided};
use std::time::Instant;

/// The "destination" of an allgather block in the data pattern: every rank gets the same one.
const ALL_PEERS: u32 = u32::MAX;
/// What a receive buffer holds before a collective (and its holes after it).
const SENTINEL: u8 = 0xA5;

/// Everything a size needs: buffers, counts, displacements and the datatype.
pub struct Setup {
    pub coll: Coll,
    pub world: Comm,
    pub me: usize,
    pub n: usize,
    pub size: usize,
    pub send: Placed,
    pub recv: Placed,
    pub counts: Vec<i32>,
    pub displs: Vec<i32>,
    /// MPI_BYTE, or the strided layout's element (`--datatype strided`).
    pub ty: Datatype,
    /// `--datatype strided`: each SIZE-byte block spans 2 x SIZE bytes of its buffer.
    pub strided: bool,
    /// Ibcast: the root of the iteration being run (set by [`Setup::prepare`]).
    pub root: usize,
}

/// A buffer of `len` bytes that starts `offset` bytes past a page boundary (`--recv-offset`).
pub struct Placed {
    mem: Vec<u8>,
    at: usize,
    len: usize,
}

impl Placed {
    pub fn new(len: usize, offset: usize) -> Placed {
        let mem = vec![0u8; len + offset + 4096];
        let at = mem.as_ptr().align_offset(4096) + offset;
        Placed { mem, at, len }
    }
}

impl std::ops::Deref for Placed {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.mem[self.at..self.at + self.len]
    }
}

impl std::ops::DerefMut for Placed {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.mem[self.at..self.at + self.len]
    }
}

impl Setup {
    /// Gets iteration `iter` ready: fills what this rank sends (for ibcast, on the root of the
    /// iteration, its one buffer; so call it after [`Setup::sentinel_recv`]).
    pub fn prepare(&mut self, iter: u64) {
        let size = self.size;
        self.root = bcast_root(iter, self.n);
        if size == 0 {
            return;
        }
        if self.coll == Coll::Iallreduce {
            let me = self.me as u64;
            for (i, v) in self.send.chunks_exact_mut(8).enumerate() {
                v.copy_from_slice(&reduce_term(me, i as u64, iter).to_ne_bytes());
            }
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

    pub fn sentinel_recv(&mut self) {
        self.recv.fill(SENTINEL);
    }

    /// Posts the collective and waits; returns the times of the whole (post + compute + wait),
    /// of the compute alone, of the post call and of the wait call.
    pub fn run_once(&mut self, compute_steps: Option<u64>) -> Result<Times, MpiError> {
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
            Coll::Iallreduce => {
                let n = (self.size / 8) as i32;
                self.world.iallreduce_sum_i64(send, recv, n)?
            }
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
            host_p50: 0.0,
            host_p50_quiet: 0.0,
            post_p50_quiet: 0.0,
            wait_p50_quiet: 0.0,
            preempted_pct: 0.0,
        })
    }

    /// Checks what every peer delivered in iteration `iter`; prints the first bad byte per peer.
    pub fn validate(&self, iter: u64, phase: &str) -> bool {
        if self.coll == Coll::Iallreduce {
            let n = self.n as u64;
            let bad = self.recv[..self.size]
                .chunks_exact(8)
                .enumerate()
                .map(|(i, b)| {
                    let want: i64 = (0..n).map(|r| reduce_term(r, i as u64, iter)).sum();
                    (i, want, i64::from_ne_bytes(b.try_into().unwrap()))
                })
                .find(|&(_, want, got)| want != got);
            if let Some((i, want, got)) = bad {
                eprintln!(
                    "coll-bench: VALIDATION FAILED: iallreduce bytes={} phase={phase} rank={} \
                     element={i} expected={want} got={got}",
                    self.size, self.me
                );
            }
            return bad.is_none();
        }
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

/// Rank `rank`'s element `i` of an iallreduce in iteration `iter`: signed, different per rank,
/// element and iteration, small enough that sums over any number of ranks do not overflow.
fn reduce_term(rank: u64, i: u64, iter: u64) -> i64 {
    let x = pattern_mix(rank.wrapping_mul(0x9E37_79B9) ^ i.wrapping_mul(0x85EB_CA6B) ^ iter);
    (x % (1 << 40)) as i64 - (1 << 39)
}

fn pattern_mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^ (x >> 33)
}

/// Times of one iteration, or means over a phase (seconds).
#[derive(Clone, Copy, Debug, Default)]
pub struct Times {
    pub total: f64,
    pub compute: f64,
    pub post: f64,
    pub wait: f64,
    /// A phase's mean: wall-clock time per timed iteration, from the start of the first timed
    /// iteration (its setup, then its barrier) to the end of the last one.
    pub iteration: f64,
    /// A phase's median over its calls of `post + wait` (the host's time in MPI per call),
    /// which a preemption of the rank in a few calls does not move as it moves the mean.
    pub host_p50: f64,
    /// The same median over the calls during which the kernel took the rank's CPU away not
    /// once (no involuntary context switch from the post to the end of the wait, the compute
    /// between them included), and the share of the calls where it did (%); the median is
    /// negative when every call was reached.
    pub host_p50_quiet: f64,
    /// The medians of the post alone and of the wait alone over those same calls (each its
    /// own median, so they need not add up to `host_p50_quiet`); negative as it is.
    pub post_p50_quiet: f64,
    pub wait_p50_quiet: f64,
    pub preempted_pct: f64,
}
