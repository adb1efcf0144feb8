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
