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

use alias_mkey::mover::{DynMover, Mover, MoverConfig};
use alias_mkey::{AccessError, AliasKey};
use crossbeam_channel::{Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

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
        for i in 0..threads {
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
                    for job in rx {
                        let result =
                            mover.copy(&job.src, job.src_offset, &job.dst, job.dst_offset, job.len);
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
        })
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
    fn drop(&mut self) {
        self.jobs.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
