//! The datapath: worker threads that execute copies between granted regions, standing in for
//! the DPU's DMA engine / DPA kernels.
//!
//! The event loop never blocks on a copy. It hands a [`CopyJob`] to the pool over a crossbeam
//! channel; a worker performs it with its own [`Mover`] and sends the [`CopyDone`] back, then
//! wakes the loop through its `mio::Waker`. How many copies are active at once is decided by
//! the engine (the per-SP `max_inflight_reads` gate), not here, and that gate is also what
//! bounds the channel: it is unbounded so that handing over a job never waits, even when the
//! workers are fewer than the copies the gate admits (`--datapath-threads` below
//! `--max-inflight-reads`) and each of them waits out a stalled UCX transfer (up to the mover's
//! timeout, 10 s). A bounded channel made the loop wait there, and an event loop that waits
//! sends no heartbeats: its peers then declared it stuck.
//!
//! Each worker's UCX mover keeps an endpoint to every process it copied from or to. When a job
//! ends here, or a rank's connection closes, the loop tells every worker ([`Datapath::close`],
//! on a channel of its own, served before its next copy) to close the endpoints of those
//! processes: left open, UCX found them failed once the processes were gone and logged an error
//! for each (no error handler was installed either; now one is, see `ucx_sys::Endpoint`).
//! The workers publish their endpoint counters ([`Datapath::ucx_endpoints`]).

use crate::staging::STAGE_OWNER_RANK;
use alias_mkey::mover::{DynMover, Mover, MoverConfig};
use alias_mkey::{AccessError, AliasKey, Owner};
use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Parts of a split copy start at multiples of this many bytes from the copy's start, so that
/// each part's two ends keep the alignment of the whole copy's (a page).
pub const SPLIT_ALIGN: u64 = 64 * 1024;

/// Large copies split into parts, one per datapath thread at most, so that the threads copy
/// one collective's large block side by side (the "large copies split across movers";
/// on a DPU, the SP's cores). The parts are ordinary jobs with tickets of their own; their
/// completions are joined back into one for the whole copy, which fails if any part failed
/// (with the first error seen). The engine sees one copy, counted once by its in-flight gate.
pub struct Splits {
    /// Smallest part (0: never split), and most parts (the datapath threads).
    part_bytes: u64,
    threads: usize,
    /// Part ticket -> the whole copy's ticket.
    part_of: std::collections::HashMap<u64, u64>,
    /// Whole copy's ticket -> parts not done yet, and the first error of a part.
    left: std::collections::HashMap<u64, (usize, Option<AccessError>)>,
}

impl Splits {
    /// Copies of at least twice `part_bytes` (rounded up to a multiple of [`SPLIT_ALIGN`])
    /// split in up to `threads` parts (0: never split).
    pub fn new(part_bytes: u64, threads: usize) -> Splits {
        Splits {
            // A part size past the largest multiple of the unit: no copy is that long.
            part_bytes: part_bytes
                .checked_next_multiple_of(SPLIT_ALIGN)
                .unwrap_or(u64::MAX),
            threads,
            part_of: Default::default(),
            left: Default::default(),
        }
    }

    /// The jobs that perform `job`: itself, or, when it is at least twice the part size long
    /// and there are at least 2 threads, as many parts as fit, one per thread at most, none
    /// shorter than the part size: the copy's whole [`SPLIT_ALIGN`] units shared out as
    /// evenly as they go (parts differ by one unit at most), the last part also taking the
    /// bytes past the last whole unit; each with a ticket from `ticket`.
    pub fn split(&mut self, job: CopyJob, mut ticket: impl FnMut() -> u64) -> Vec<CopyJob> {
        let parts = job
            .len
            .checked_div(self.part_bytes)
            .map_or(1, |n| n.min(self.threads as u64));
        if parts < 2 {
            return vec![job];
        }
        // `parts` is at most `len / part_bytes` and the part size a whole number of units, so
        // every part gets at least the part size's units.
        let units = job.len / SPLIT_ALIGN;
        let (base, extra) = (units / parts, units % parts);
        let mut out = Vec::with_capacity(parts as usize);
        let mut at = 0;
        for i in 0..parts {
            let len = if i + 1 == parts {
                job.len - at
            } else {
                (base + (i < extra) as u64) * SPLIT_ALIGN
            };
            let t = ticket();
            self.part_of.insert(t, job.ticket);
            out.push(CopyJob {
                ticket: t,
                src: job.src.clone(),
                src_offset: job.src_offset + at,
                dst: job.dst.clone(),
                dst_offset: job.dst_offset + at,
                len,
            });
            at += len;
        }
        self.left.insert(job.ticket, (out.len(), None));
        out
    }

    /// A datapath completion: a whole copy's (unsplit, or its last part), or `None` for a part
    /// while others of its copy are still running.
    pub fn join(&mut self, done: CopyDone) -> Option<CopyDone> {
        let Some(whole) = self.part_of.remove(&done.ticket) else {
            return Some(done);
        };
        let entry = self
            .left
            .get_mut(&whole)
            .expect("a split copy's parts are counted");
        entry.0 -= 1;
        if let Err(e) = done.result {
            // The first error, unless a later one says the process's image changed: that one
            // also ends the old image's connections (`feed_copies_done`), so it must not be
            // hidden behind another part's error.
            let image = matches!(e, AccessError::ImageChanged { .. });
            match &entry.1 {
                None => entry.1 = Some(e),
                Some(AccessError::ImageChanged { .. }) => {}
                Some(_) if image => entry.1 = Some(e),
                Some(_) => {}
            }
        }
        if entry.0 > 0 {
            return None;
        }
        let (_, err) = self.left.remove(&whole).expect("just seen");
        Some(CopyDone {
            ticket: whole,
            result: err.map_or(Ok(()), Err),
        })
    }

    /// Split copies with parts still running.
    pub fn in_flight(&self) -> usize {
        self.left.len()
    }
}

/// Processes whose UCX endpoints every worker closes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closing {
    /// Every process of the job (it ended here).
    Job(u64),
    /// One rank's process (its connection to this SP closed).
    Rank { job: u64, world_rank: u32, pid: u32 },
}

impl Closing {
    /// Whether the endpoint reaching `owner`'s process is to be closed. Endpoints to other
    /// SPs' staging (owner rank [`STAGE_OWNER_RANK`]) stay: those SPs outlive the job.
    fn covers(&self, owner: &Owner) -> bool {
        if owner.world_rank == STAGE_OWNER_RANK {
            return false;
        }
        match *self {
            Closing::Job(job) => owner.job == job,
            Closing::Rank {
                job,
                world_rank,
                pid,
            } => owner.job == job && owner.world_rank == world_rank && owner.pid == pid,
        }
    }
}

/// The UCX endpoint counters of every worker, summed (see `alias_mkey::mover::UcxMoverStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointCounters {
    pub opened: u64,
    pub closed: u64,
    pub closes_unfinished: u64,
    pub errors: u64,
}

/// One worker's counters, as it last published them.
#[derive(Default)]
struct Published {
    opened: AtomicU64,
    closed: AtomicU64,
    closes_unfinished: AtomicU64,
    errors: AtomicU64,
}

impl Published {
    fn publish(&self, mover: &mut DynMover) {
        if let Some(u) = mover.ucx() {
            let s = u.stats();
            self.opened.store(s.endpoints_opened, Ordering::Relaxed);
            self.closed.store(s.endpoints_closed, Ordering::Relaxed);
            self.closes_unfinished
                .store(s.endpoint_closes_unfinished, Ordering::Relaxed);
            self.errors.store(s.endpoint_errors, Ordering::Relaxed);
        }
    }
}

/// How long dropping the datapath waits for its workers to end. A worker inside a copy that
/// waits on UCX (up to the mover's timeout) is not waited for: it is left to end with the
/// process, which is what drops a datapath (an SP that stops).
pub const JOIN_BOUND: Duration = Duration::from_millis(150);

/// One copy to perform.
#[derive(Debug)]
pub struct CopyJob {
    /// Opaque to the pool: the engine's handle for routing the completion.
    pub ticket: u64,
    pub src: AliasKey,
    pub src_offset: u64,
    pub dst: AliasKey,
    pub dst_offset: u64,
    pub len: u64,
}

#[derive(Debug)]
pub struct CopyDone {
    pub ticket: u64,
    pub result: Result<(), AccessError>,
}

pub struct Datapath {
    jobs: Option<Sender<CopyJob>>,
    done: Receiver<CopyDone>,
    workers: Vec<JoinHandle<()>>,
    /// Each worker's own channel of [`Closing`]s, and its published counters.
    closing: Vec<Sender<Closing>>,
    published: Vec<Arc<Published>>,
}

impl Datapath {
    /// Starts `threads` workers, each with its own mover built from `movers` (a UCX worker is
    /// single-threaded, so every thread has its own). `wake` is called after every completion is
    /// queued. Fails if a mover cannot be built (e.g. UCX cannot initialise).
    pub fn start(
        threads: usize,
        movers: MoverConfig,
        wake: Arc<mio::Waker>,
    ) -> Result<Self, alias_mkey::AccessError> {
        let threads = threads.max(1);
        let (job_tx, job_rx) = crossbeam_channel::unbounded::<CopyJob>();
        let (done_tx, done_rx) = crossbeam_channel::unbounded::<CopyDone>();
        let mut workers = Vec::new();
        let mut closing = Vec::new();
        let mut published = Vec::new();
        for i in 0..threads {
            let (close_tx, close_rx) = crossbeam_channel::unbounded::<Closing>();
            let counters = Arc::new(Published::default());
            closing.push(close_tx);
            published.push(Arc::clone(&counters));
            let rx = job_rx.clone();
            let tx = done_tx.clone();
            let wake = wake.clone();
            let cfg = movers.clone();
            let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
            let worker = std::thread::Builder::new()
                .name(format!("datapath-{i}"))
                .spawn(move || {
                    let mut mover = match DynMover::new(&cfg) {
                        Ok(m) => {
                            let _ = ready_tx.send(Ok(()));
                            m
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let close =
                        |mover: &mut DynMover, c: Closing| mover.close_endpoints(|o| c.covers(o));
                    loop {
                        // Closings first: they were decided before any copy still queued.
                        while let Ok(c) = close_rx.try_recv() {
                            let _ = close(&mut mover, c);
                        }
                        counters.publish(&mut mover);
                        crossbeam_channel::select! {
                            recv(close_rx) -> c => match c {
                                Ok(c) => {
                                    close(&mut mover, c);
                                }
                                Err(_) => return,
                            },
                            recv(rx) -> job => {
                                let Ok(job) = job else { return };
                                let result = mover.copy(
                                    &job.src,
                                    job.src_offset,
                                    &job.dst,
                                    job.dst_offset,
                                    job.len,
                                );
                                if tx
                                    .send(CopyDone {
                                        ticket: job.ticket,
                                        result,
                                    })
                                    .is_err()
                                {
                                    return;
                                }
                                let _ = wake.wake();
                            }
                        }
                    }
                })
                .expect("spawning a datapath thread");
            workers.push(worker);
            let ready = ready_rx
                .recv()
                .unwrap_or(Err(alias_mkey::AccessError::Unsupported(
                    "datapath thread died at start",
                )));
            if let Err(e) = ready {
                drop(job_tx);
                for w in workers {
                    let _ = w.join();
                }
                return Err(e);
            }
        }
        Ok(Datapath {
            jobs: Some(job_tx),
            done: done_rx,
            workers,
            closing,
            published,
        })
    }

    /// Has every worker close the UCX endpoints of the processes `c` names (before its next
    /// copy). Never waits.
    pub fn close(&self, c: Closing) {
        for tx in &self.closing {
            let _ = tx.send(c);
        }
    }

    /// The workers' UCX endpoint counters, summed, as they last published them (after each
    /// copy and each closing).
    pub fn ucx_endpoints(&self) -> EndpointCounters {
        let mut t = EndpointCounters::default();
        for p in &self.published {
            t.opened += p.opened.load(Ordering::Relaxed);
            t.closed += p.closed.load(Ordering::Relaxed);
            t.closes_unfinished += p.closes_unfinished.load(Ordering::Relaxed);
            t.errors += p.errors.load(Ordering::Relaxed);
        }
        t
    }

    /// Queues a copy; never waits (the engine's gate bounds how many are queued).
    pub fn submit(&self, job: CopyJob) {
        self.jobs
            .as_ref()
            .expect("datapath used after shutdown")
            .send(job)
            .expect("datapath workers exited");
    }

    /// Completions ready now.
    pub fn drain(&self) -> impl Iterator<Item = CopyDone> + '_ {
        self.done.try_iter()
    }
}

impl Drop for Datapath {
    /// Ends the workers: each finishes the copy it is in and exits (dropping its mover). Waits
    /// at most [`JOIN_BOUND`] in all; a worker still busy then is left running (detached).
    fn drop(&mut self) {
        self.jobs.take();
        self.closing.clear();
        let deadline = Instant::now() + JOIN_BOUND;
        for w in self.workers.drain(..) {
            while !w.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if w.is_finished() {
                let _ = w.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alias_mkey::Rights;

    /// A key the splitting only carries along (never used to copy).
    fn key() -> AliasKey {
        crate::staging::own_key(1, 1, 0x10000, 1 << 30, Rights::READ)
    }

    fn job(ticket: u64, src_offset: u64, dst_offset: u64, len: u64) -> CopyJob {
        CopyJob {
            ticket,
            src: key(),
            src_offset,
            dst: key(),
            dst_offset,
            len,
        }
    }

    /// Random lengths, part sizes and thread counts (seed printed): the parts cover the copy
    /// exactly once, in order, each end shifted alike; there are at most `threads` of them,
    /// each but the last a multiple of the alignment and none shorter than asked unless
    /// the copy is not split; completions in any order give exactly one whole completion,
    /// after the last part, failed if any part failed.
    #[test]
    fn a_split_copy_is_covered_once_and_completes_once() {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        println!("seed {seed}");
        let mut x = seed | 1;
        let mut rnd = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n.max(1)
        };
        let mut next = 1000u64;
        for round in 0..500 {
            let len = match rnd(3) {
                0 => rnd(1 << 16),
                1 => rnd(1 << 21),
                _ => rnd(1 << 24),
            };
            let asked: u64 = [0, 4096, 65536, 100_000, 256 << 10, 1 << 20][rnd(6) as usize];
            let part = asked.next_multiple_of(SPLIT_ALIGN);
            let threads = 1 + rnd(8) as usize;
            let (so, doff) = (rnd(1 << 20), rnd(1 << 20));
            let mut splits = Splits::new(asked, threads);
            let parts = splits.split(job(round, so, doff, len), || {
                next += 1;
                next
            });
            let whole = parts.len() == 1 && parts[0].ticket == round;
            assert!(parts.len() <= threads.max(1), "{len} {part} {threads}");
            let mut at = 0;
            for (i, p) in parts.iter().enumerate() {
                assert_eq!(p.src_offset, so + at);
                assert_eq!(p.dst_offset, doff + at);
                if !whole {
                    assert!(p.len >= part, "part {i} of {len}: {}", p.len);
                    let units = p.len / SPLIT_ALIGN;
                    let first = parts[0].len / SPLIT_ALIGN;
                    assert!(
                        units == first || units + 1 == first,
                        "part {i} of {len}: {} units against {first}",
                        units
                    );
                    if i + 1 < parts.len() {
                        assert_eq!(p.len % SPLIT_ALIGN, 0);
                    }
                }
                at += p.len;
            }
            assert_eq!(at, len, "the parts cover the copy");
            if part > 0 && threads >= 2 && len >= 2 * part {
                let want = (len / part).min(threads as u64) as usize;
                assert_eq!(
                    parts.len(),
                    want,
                    "{len} bytes, parts of {part}, {threads} threads"
                );
            }
            // Completions in a random order; maybe one part failed, maybe another with the
            // process's image changed (that error wins whatever the order).
            let fail = rnd(3) == 0;
            let image = fail && parts.len() > 1 && rnd(2) == 0;
            let mut done: Vec<CopyDone> = parts
                .iter()
                .enumerate()
                .map(|(i, p)| CopyDone {
                    ticket: p.ticket,
                    result: if fail && i == 0 {
                        Err(AccessError::Unsupported("test"))
                    } else if image && i == 1 {
                        Err(AccessError::ImageChanged { pid: 7 })
                    } else {
                        Ok(())
                    },
                })
                .collect();
            for i in (1..done.len()).rev() {
                done.swap(i, rnd(i as u64 + 1) as usize);
            }
            let n = done.len();
            let mut got = Vec::new();
            for (i, d) in done.into_iter().enumerate() {
                let out = splits.join(d);
                assert_eq!(
                    out.is_some(),
                    i + 1 == n,
                    "a whole completion only after the last part"
                );
                got.extend(out);
            }
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].ticket, round);
            assert_eq!(got[0].result.is_err(), fail);
            if image {
                assert!(
                    matches!(got[0].result, Err(AccessError::ImageChanged { pid: 7 })),
                    "{:?}",
                    got[0].result
                );
            }
            assert_eq!(splits.in_flight(), 0);
        }
    }
}
