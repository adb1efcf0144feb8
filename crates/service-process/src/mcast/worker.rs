//! Receive workers: the stand-ins of the paper's DPA receive kernels
//! (`multicast-bcast-allgather-dpa.txt`, §III-B "Receive datapath" and Fig. 6, §IV
//! "Multicast subgroups"). Each worker is a thread of the SP that owns one or more subgroup
//! sockets and, per collective registered with it, a bitmap of the chunks it landed; for each
//! datagram it checks the header and the collective's tag, applies the injected faults (drop,
//! reorder; seeded, on the receive side before the bitmap, as a fabric would), sets the bit,
//! and hands the payload to the collective's [`Sink`] (staging, then the mover towards the
//! ranks' buffers, in the SP; a buffer in tests). What it did is counted in [`WorkerStats`]
//! and reported as [`Event`]s on the channel the SP drains.
//!
//! A datagram that is malformed, names no collective registered here, or carries another tag
//! is dropped and counted before anything is written; a duplicate (the bit is set) is counted
//! and dropped. The kernel's count of datagrams lost for want of socket buffer (`SO_MEMINFO`:
//! the receiver was not ready) is read whenever a socket runs dry and added to
//! `overflow_drops`.

use super::datagram::{self, HEADER_BYTES};
use super::fabric;
use crossbeam_channel::{Receiver, Sender};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::UdpSocket;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Where a collective's chunks go once landed.
pub trait Sink: Send + Sync {
    /// Chunk `psn` arrived with `payload`. An error is reported as [`Event::SinkFailed`].
    fn land(&self, psn: u32, payload: &[u8]) -> Result<(), String>;

    /// Chunks `first ..` arrived with `data`, `unit` bytes each (the last may be shorter): a
    /// run of consecutive chunks the worker gathered in its staging, written at once (one
    /// mover call per buffer instead of one per chunk). By default chunk by chunk.
    fn land_run(&self, first: u32, unit: usize, data: &[u8]) -> Result<(), String> {
        for (i, c) in data.chunks(unit.max(1)).enumerate() {
            self.land(first + i as u32, c)?;
        }
        Ok(())
    }
}

/// Consecutive chunks a worker gathers before it lands them as one run.
const RUN_CHUNKS: u32 = 64;

/// A run of consecutive chunks of one collective, gathered in the worker's staging.
struct Run {
    first: u32,
    count: u32,
    /// Bytes of each chunk but the last.
    unit: usize,
    data: Vec<u8>,
}

/// A collective a worker receives for: its id and tag on the fabric, its chunk count, where
/// its chunks go.
pub struct Registration {
    pub coll: u64,
    pub tag: u64,
    pub chunks: u32,
    pub sink: Arc<dyn Sink>,
    /// PSN runs `[first, end)` this SP multicast itself (an Allgather's local blocks): their
    /// datagrams come back to it (`IP_MULTICAST_LOOP`, for the other SPs of its host) and are
    /// dropped and counted (`own_echoes`), never landed.
    pub skip: Vec<(u32, u32)>,
}

/// What a worker reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Chunk `psn` of `coll` is in its sink.
    Landed { coll: u64, psn: u32 },
    /// The sink refused chunk `psn` of `coll` (its bit stays set: the collective fails).
    SinkFailed { coll: u64, psn: u32, why: String },
}

/// Faults injected on the receive side, before the bitmap (`serve --mcast-drop-rate`,
/// `--mcast-reorder`): each datagram is dropped with probability `drop_ppm` / 10^6, or held
/// back behind the next one with probability `reorder_ppm` / 10^6.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Injection {
    pub drop_ppm: u32,
    pub reorder_ppm: u32,
    pub seed: u64,
}

/// A worker's counters (read while it runs).
#[derive(Debug, Default)]
pub struct WorkerStats {
    pub datagrams: AtomicU64,
    pub bytes: AtomicU64,
    pub landed: AtomicU64,
    pub duplicates: AtomicU64,
    pub malformed: AtomicU64,
    pub unknown_coll: AtomicU64,
    pub bad_tag: AtomicU64,
    pub injected_drops: AtomicU64,
    pub reordered: AtomicU64,
    pub overflow_drops: AtomicU64,
    pub sink_failures: AtomicU64,
    pub own_echoes: AtomicU64,
}

impl WorkerStats {
    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// Called once a command took effect (on the worker's thread).
pub type Ack = Box<dyn FnOnce() + Send>;

enum Cmd {
    Socket(UdpSocket),
    Register(Registration, Ack),
    Unregister(u64, Ack),
    Stop,
}

/// Datagrams a worker takes in before it looks at its commands again: a registration waits
/// for at most this many landings, not for the sockets to run dry (under a steady stream they
/// may never).
const DRAIN_BUDGET: usize = 64;

/// A receive worker thread.
pub struct RecvWorker {
    cmds: Sender<Cmd>,
    wake: UnixStream,
    thread: Option<JoinHandle<()>>,
    pub stats: Arc<WorkerStats>,
}

struct Coll {
    tag: u64,
    chunks: u32,
    bitmap: Vec<u64>,
    sink: Arc<dyn Sink>,
    run: Option<Run>,
    skip: Vec<(u32, u32)>,
}

impl Coll {
    /// Sets bit `psn`; false if it was set.
    fn set(&mut self, psn: u32) -> bool {
        let (w, b) = ((psn / 64) as usize, psn % 64);
        let was = self.bitmap[w] & (1 << b) != 0;
        self.bitmap[w] |= 1 << b;
        !was
    }
}

/// SplitMix64: the injection's generator (deterministic from the seed).
fn next(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What a worker does with datagrams, without its sockets (the fuzzer drives it directly):
/// the registered collectives, the injection, the counters.
pub struct Intake {
    colls: HashMap<u64, Coll>,
    events: Sender<Event>,
    /// Called once events wait on the channel (the SP's loop waker), at most every
    /// [`WAKE_EVERY`] events and when the sockets run dry.
    wake: Option<Waker>,
    unwoken: u32,
    pub stats: Arc<WorkerStats>,
    inject: Injection,
    rng: u64,
    held: Option<Vec<u8>>,
}

struct Loop {
    socks: Vec<(UdpSocket, u32)>,
    intake: Intake,
    /// The socket a drain starts with (turns round, so that a busy one starves none).
    first: usize,
}

/// What a worker calls when it has queued events.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// Events a worker queues before it wakes the SP even though its sockets still have more.
const WAKE_EVERY: u32 = 32;

impl Intake {
    pub fn new(events: Sender<Event>, inject: Injection) -> Intake {
        Intake {
            colls: HashMap::new(),
            events,
            wake: None,
            unwoken: 0,
            stats: Arc::new(WorkerStats::default()),
            inject,
            rng: inject.seed,
            held: None,
        }
    }

    pub fn register(&mut self, r: Registration) {
        let words = (r.chunks as usize).div_ceil(64);
        self.colls.insert(
            r.coll,
            Coll {
                tag: r.tag,
                chunks: r.chunks,
                bitmap: vec![0; words],
                sink: r.sink,
                run: None,
                skip: r.skip,
            },
        );
    }

    /// Forgets a collective, after landing what it gathered (before the acknowledgement: the
    /// collective's buffers are still its own).
    pub fn unregister(&mut self, coll: u64) {
        self.land_run(coll);
        self.colls.remove(&coll);
    }

    /// Lets a datagram held back for reordering go (nothing more came behind it), and lands
    /// every gathered run.
    pub fn flush(&mut self) {
        if let Some(h) = self.held.take() {
            self.take(&h);
        }
        self.land_runs();
    }

    /// Lands every gathered run.
    fn land_runs(&mut self) {
        let colls: Vec<u64> = self
            .colls
            .iter()
            .filter(|(_, c)| c.run.is_some())
            .map(|(k, _)| *k)
            .collect();
        for coll in colls {
            self.land_run(coll);
        }
    }

    /// Lands the run `coll` gathered, then reports each of its chunks.
    fn land_run(&mut self, coll: u64) {
        let Some(c) = self.colls.get_mut(&coll) else {
            return;
        };
        let Some(run) = c.run.take() else { return };
        let result = c.sink.land_run(run.first, run.unit, &run.data);
        match result {
            Ok(()) => {
                WorkerStats::add(&self.stats.landed, u64::from(run.count));
                for psn in run.first..run.first + run.count {
                    let _ = self.events.send(Event::Landed { coll, psn });
                }
            }
            Err(why) => {
                WorkerStats::add(&self.stats.sink_failures, 1);
                let _ = self.events.send(Event::SinkFailed {
                    coll,
                    psn: run.first,
                    why,
                });
            }
        }
        self.unwoken += run.count;
        if self.unwoken >= WAKE_EVERY {
            self.wake_now();
        }
    }

    /// One datagram off the fabric: injection first (a fault of the fabric), then the checks.
    pub fn on_datagram(&mut self, d: Vec<u8>) {
        WorkerStats::add(&self.stats.datagrams, 1);
        WorkerStats::add(&self.stats.bytes, d.len() as u64);
        if self.inject.drop_ppm > 0
            && next(&mut self.rng) % 1_000_000 < u64::from(self.inject.drop_ppm)
        {
            WorkerStats::add(&self.stats.injected_drops, 1);
            return;
        }
        if self.inject.reorder_ppm > 0
            && self.held.is_none()
            && next(&mut self.rng) % 1_000_000 < u64::from(self.inject.reorder_ppm)
        {
            WorkerStats::add(&self.stats.reordered, 1);
            self.held = Some(d);
            return;
        }
        self.take(&d);
        if let Some(h) = self.held.take() {
            self.take(&h);
        }
    }

    fn take(&mut self, d: &[u8]) {
        let (h, payload) = match datagram::decode(d) {
            Ok(x) => x,
            Err(_) => return WorkerStats::add(&self.stats.malformed, 1),
        };
        let Some(c) = self.colls.get_mut(&h.coll) else {
            return WorkerStats::add(&self.stats.unknown_coll, 1);
        };
        if c.tag != h.tag || c.chunks != h.chunks {
            return WorkerStats::add(&self.stats.bad_tag, 1);
        }
        if c.skip.iter().any(|&(a, b)| (a..b).contains(&h.psn)) {
            return WorkerStats::add(&self.stats.own_echoes, 1);
        }
        if !c.set(h.psn) {
            return WorkerStats::add(&self.stats.duplicates, 1);
        }
        // Into the staging run: appended when it follows a run of full chunks, else the run
        // so far is landed and this chunk starts the next.
        if let Some(r) = &mut c.run {
            let follows = h.psn == r.first + r.count
                && r.count < RUN_CHUNKS
                && r.data.len() == r.count as usize * r.unit
                && payload.len() <= r.unit;
            if follows {
                r.data.extend_from_slice(payload);
                r.count += 1;
                return;
            }
        }
        let coll = h.coll;
        self.land_run(coll);
        let c = self.colls.get_mut(&coll).expect("still registered");
        c.run = Some(Run {
            first: h.psn,
            count: 1,
            unit: payload.len(),
            data: payload.to_vec(),
        });
        if payload.is_empty() {
            // A 0-byte message's one chunk: nothing can follow it.
            self.land_run(coll);
        }
    }

    /// Wakes the SP if events wait for it.
    fn wake_now(&mut self) {
        if self.unwoken > 0 {
            self.unwoken = 0;
            if let Some(w) = &self.wake {
                w();
            }
        }
    }
}

impl Loop {
    /// Reads the sockets, at most [`DRAIN_BUDGET`] datagrams in all; true if anything came.
    fn drain(&mut self, buf: &mut [u8]) -> bool {
        let mut any = false;
        let mut taken = 0;
        let n = self.socks.len();
        self.first = (self.first + 1) % n.max(1);
        for i in (0..n).map(|k| (self.first + k) % n) {
            loop {
                if taken >= DRAIN_BUDGET {
                    break;
                }
                match fabric::recv(&self.socks[i].0, buf) {
                    Ok(n) => {
                        any = true;
                        taken += 1;
                        let d = buf[..n].to_vec();
                        self.intake.on_datagram(d);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        WorkerStats::add(&self.intake.stats.malformed, 1);
                        break;
                    }
                }
            }
            // Dry: what the kernel dropped meanwhile (its count is cumulative per socket).
            if let Ok(total) = fabric::drops(&self.socks[i].0) {
                let seen = &mut self.socks[i].1;
                if total > *seen {
                    WorkerStats::add(&self.intake.stats.overflow_drops, u64::from(total - *seen));
                    *seen = total;
                }
            }
        }
        // Nothing more behind a held datagram: let it go (reordered, not lost). Gathered runs
        // are landed at the end of every pass (a pass is at most DRAIN_BUDGET datagrams).
        if !any {
            self.intake.flush();
        } else {
            self.intake.land_runs();
        }
        self.intake.wake_now();
        any
    }
}

impl RecvWorker {
    /// Starts a worker whose events go to `events`, with faults `inject`.
    pub fn start(name: &str, events: Sender<Event>, inject: Injection) -> io::Result<RecvWorker> {
        Self::start_waking(name, events, inject, None)
    }

    /// As [`RecvWorker::start`], calling `waker` whenever events wait on `events`.
    pub fn start_waking(
        name: &str,
        events: Sender<Event>,
        inject: Injection,
        waker: Option<Waker>,
    ) -> io::Result<RecvWorker> {
        let (cmds, rx): (Sender<Cmd>, Receiver<Cmd>) = crossbeam_channel::unbounded();
        let (wake, mut woken) = UnixStream::pair()?;
        woken.set_nonblocking(true)?;
        // The SP's loop writes a byte per command and must never wait for the worker: a worker
        // busy landing a flood reads `woken` only once the flood pauses, and a full pipe
        // already holds a wake-up (commands are taken from `cmds` at every pass anyway).
        wake.set_nonblocking(true)?;
        let mut intake = Intake::new(events, inject);
        intake.wake = waker;
        let stats = intake.stats.clone();
        let mut lp = Loop {
            socks: Vec::new(),
            intake,
            first: 0,
        };
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let mut buf = vec![0u8; HEADER_BYTES + datagram::MAX_PAYLOAD + 1];
                loop {
                    while let Ok(c) = rx.try_recv() {
                        match c {
                            Cmd::Socket(s) => lp.socks.push((s, 0)),
                            Cmd::Register(r, done) => {
                                lp.intake.register(r);
                                done();
                            }
                            Cmd::Unregister(coll, done) => {
                                lp.intake.unregister(coll);
                                done();
                            }
                            Cmd::Stop => return,
                        }
                    }
                    if lp.drain(&mut buf) {
                        continue;
                    }
                    // Sleep until a socket or a command needs us (bounded: a held datagram
                    // goes out at the next pass).
                    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
                    let mut fds: Vec<PollFd> = lp
                        .socks
                        .iter()
                        .map(|(s, _)| PollFd::new(s.as_fd(), PollFlags::POLLIN))
                        .collect();
                    fds.push(PollFd::new(woken.as_fd(), PollFlags::POLLIN));
                    let _ = poll(&mut fds, PollTimeout::from(100u16));
                    let mut sink = [0u8; 64];
                    while matches!(woken.read(&mut sink), Ok(n) if n > 0) {}
                }
            })?;
        Ok(RecvWorker {
            cmds,
            wake,
            thread: Some(thread),
            stats,
        })
    }

    fn send(&self, c: Cmd) {
        let _ = self.cmds.send(c);
        // WouldBlock: the pipe is full of wake-ups already.
        let _ = (&self.wake).write(&[1]);
    }

    /// Gives the worker a subgroup socket to receive on.
    pub fn add_socket(&self, s: UdpSocket) {
        self.send(Cmd::Socket(s));
    }

    /// Registers a collective; returns once the worker will land its chunks (a receiver is
    /// ready only then: the root multicasts after every receiver said so).
    pub fn register(&self, r: Registration) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.register_then(
            r,
            Box::new(move || {
                let _ = tx.send(());
            }),
        );
        let _ = rx.recv();
    }

    /// Registers a collective without waiting: `ack` is called once the worker lands its
    /// chunks (the SP's loop never waits for a worker busy landing another's).
    pub fn register_then(&self, r: Registration, ack: Ack) {
        self.send(Cmd::Register(r, ack));
    }

    /// Forgets a collective; returns once no chunk of it will land any more.
    pub fn unregister(&self, coll: u64) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.unregister_then(
            coll,
            Box::new(move || {
                let _ = tx.send(());
            }),
        );
        let _ = rx.recv();
    }

    /// Forgets a collective without waiting: `ack` is called once no chunk of it lands any
    /// more.
    pub fn unregister_then(&self, coll: u64, ack: Ack) {
        self.send(Cmd::Unregister(coll, ack));
    }
}

impl Drop for RecvWorker {
    fn drop(&mut self) {
        self.send(Cmd::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
