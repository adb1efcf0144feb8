//! The multicast family's resources in the SP ([`crate::drivers::resources::Resources`]):
//! the fabric's sockets, the receive workers (the DPA receive threads' stand-ins, §III-B) and
//! the send workers (the root's SP multicasting, §III-A), what the multicast drivers ask of
//! them and what they report back.
//!
//! - *Groups and ports per communicator*: a communicator's groups are the fabric's groups of
//!   its slot (a keyed hash of the job and the communicator, modulo [`SLOTS`]), one address
//!   per subgroup; every SP computes the same. Two communicators whose slots collide share
//!   sockets, never bytes: every datagram names its collective (`coll`) and carries its tag.
//! - *The tag* (the collective's secret, as an IB Q_Key): a MAC under the cluster key of the
//!   collective's key, the same on every SP and unknown outside them. A datagram with another
//!   tag, or for a collective not registered here, is dropped and counted by the worker
//!   before anything is written.
//! - *Landing*: a receive worker hands each new chunk to the registration's sink, which
//!   writes it from the worker's receive buffer (its staging) into every local rank's buffer
//!   through a mover of the worker's own thread (its grants' bounds and rights are checked
//!   there), then reports it.
//! - *Sending*: a send worker reads the root's buffer through its own mover, a run of chunks
//!   at a time, and sends each chunk to its subgroup's group.

use super::datagram::{self, Header};
use super::fabric::{self, FabricConfig};
use super::worker::{Event, Injection, RecvWorker, Registration, Sink, WorkerStats};
use crate::drivers::resources::{Payload, Resources};
use algorithms::{CollKey, Status};
use alias_mkey::mover::{DynMover, Mover, MoverConfig};
use alias_mkey::AliasKey;
use bootstrap::auth::ClusterKey;
use bootstrap::kinds::Family;
use crossbeam_channel::{Receiver, Sender};
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::{SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Communicator slots of the fabric (each a port, and an address per subgroup).
pub const SLOTS: u32 = 256;

/// Chunks a send worker reads from the root's buffer at once.
const SEND_RUN_CHUNKS: u64 = 64;

/// What a multicast driver asks of the resources.
pub enum McastReq {
    /// Land the instance's chunks in these buffers from now on; [`McastEvent::Registered`]
    /// once every worker will (the receiver is then ready). Never waits for a worker.
    Register(Landing),
    /// Land nothing more of the instance; [`McastEvent::Unregistered`] once no chunk of it
    /// lands any more. Never waits for a worker.
    Unregister,
    /// Multicast these chunks of the root's buffer; reported with
    /// [`McastEvent::MulticastDone`].
    Multicast(Send),
}

/// Where an instance's datagrams land: `blocks` blocks of `len` bytes (a Bcast has one), each
/// `chunks` chunks of `mtu` bytes (the last maybe shorter); global PSN `g` lands at
/// `(g / chunks) * len + (g % chunks) * mtu` of every buffer in `keys`.
pub struct Landing {
    pub blocks: u64,
    pub chunks: u64,
    pub mtu: u64,
    pub len: u64,
    pub subgroups: u16,
    pub keys: Vec<AliasKey>,
    /// Blocks this SP multicasts itself (an Allgather's local ranks'): not landed here.
    pub own_blocks: Vec<u64>,
}

/// A multicast: global PSNs `first_psn..first_psn + psns` read from bytes `offset..offset +
/// len` of `key`, `mtu` bytes each, to subgroup `subgroup`; `chunks` the instance's PSNs in all
/// (every datagram carries it).
pub struct Send {
    pub id: u64,
    pub key: AliasKey,
    pub subgroup: u16,
    pub first_psn: u64,
    pub psns: u64,
    pub offset: u64,
    pub len: u64,
    pub mtu: u64,
    pub chunks: u64,
}

/// What the resources report to a multicast driver.
#[derive(Debug)]
pub enum McastEvent {
    /// The receive workers land the instance's chunks from now on (its receiver is ready).
    Registered,
    /// No chunk of the instance lands any more.
    Unregistered,
    /// These chunks are in every registered buffer (what landed since the engine last
    /// polled, one event per instance and poll: a driver settles once for all of them).
    Landed(Vec<u64>),
    /// A chunk could not be written into a registered buffer.
    SinkFailed,
    /// A multicast ended.
    MulticastDone { id: u64, status: Status },
}

/// How the multicast resources are set up (`serve --mcast*`).
#[derive(Clone, Debug)]
pub struct PlaneConfig {
    pub fabric: FabricConfig,
    /// Subgroups per collective (`McastParams::subgroups`: every SP of the ring agreed on it
    /// before the root's SP multicasts anything).
    pub subgroups: u16,
    pub recv_workers: usize,
    pub send_workers: usize,
    /// Faults injected on the receive side (tests, benchmarks).
    pub inject: Injection,
    /// Receive buffer of each subgroup socket (bytes).
    pub rcvbuf: usize,
    /// Movers of the worker threads (the SP's datapath's configuration).
    pub movers: MoverConfig,
}

/// A send worker's job.
struct SendJob {
    ck: CollKey,
    m: Send,
    group: SocketAddrV4,
    coll: u64,
    tag: u64,
}

/// Counters of the send side.
#[derive(Default)]
struct SendStats {
    datagrams: AtomicU64,
    bytes: AtomicU64,
    failures: AtomicU64,
}

pub struct Plane {
    cfg: PlaneConfig,
    key: ClusterKey,
    workers: Vec<RecvWorker>,
    events: Receiver<Event>,
    /// Subgroup sockets joined: (slot, subgroup) -> the worker that owns it.
    joined: HashMap<(u32, u16), usize>,
    /// The registered instances by their id on the fabric, and back.
    by_coll: HashMap<u64, CollKey>,
    by_ck: HashMap<CollKey, u64>,
    send: Option<Sender<SendJob>>,
    sent: Receiver<(CollKey, u64, Status)>,
    senders: Vec<JoinHandle<()>>,
    send_stats: Arc<SendStats>,
    registrations: u64,
    join_failures: u64,
    wake: Arc<mio::Waker>,
    /// Workers' acknowledgements: (fabric id, registered or unregistered).
    acks: Receiver<(u64, bool)>,
    ack_tx: Sender<(u64, bool)>,
    /// Registrations and unregistrations waiting for workers: (fabric id, registering) ->
    /// (instance, acknowledgements still to come).
    pending: HashMap<(u64, bool), (CollKey, usize)>,
    /// Events decided without a worker (an unregistration of nothing registered).
    ready: Vec<(CollKey, McastEvent)>,
}

/// This thread's mover (a receive or send worker's; made at first use).
fn with_mover<R>(
    cfg: &MoverConfig,
    f: impl FnOnce(&mut DynMover) -> Result<R, String>,
) -> Result<R, String> {
    thread_local! {
        static MOVER: RefCell<Option<DynMover>> = const { RefCell::new(None) };
    }
    MOVER.with(|m| {
        let mut m = m.borrow_mut();
        if m.is_none() {
            *m = Some(DynMover::new(cfg).map_err(|e| format!("no mover: {e}"))?);
        }
        f(m.as_mut().expect("just made"))
    })
}

/// Where a registered instance's chunks go: every local rank's buffer, as its [`Landing`]
/// says.
struct RankSink {
    keys: Vec<AliasKey>,
    blocks: u64,
    /// Chunks per block.
    chunks: u64,
    mtu: u64,
    /// Bytes per block.
    len: u64,
    movers: MoverConfig,
}

impl RankSink {
    /// Where global PSN `g` lands and how long it is.
    fn place(&self, g: u64) -> Option<(u64, u64)> {
        if g >= self.blocks * self.chunks {
            return None;
        }
        let (b, i) = (g / self.chunks, g % self.chunks);
        let at = i * self.mtu;
        Some((b * self.len + at, self.len.saturating_sub(at).min(self.mtu)))
    }

    fn write(&self, at: u64, data: &[u8]) -> Result<(), String> {
        if data.is_empty() {
            return Ok(());
        }
        let end = at + data.len() as u64;
        with_mover(&self.movers, |m| {
            for k in &self.keys {
                m.write(k, at, data)
                    .map_err(|e| format!("writing bytes {at}..{end}: {e}"))?;
            }
            Ok(())
        })
    }
}

impl Sink for RankSink {
    fn land(&self, psn: u32, payload: &[u8]) -> Result<(), String> {
        match self.place(u64::from(psn)) {
            Some((at, len)) if payload.len() as u64 == len => self.write(at, payload),
            _ => Err(format!(
                "chunk {psn} of {} bytes does not fit {} blocks of {} bytes",
                payload.len(),
                self.blocks,
                self.len
            )),
        }
    }

    /// A run of consecutive chunks, written with one mover call per buffer and block.
    fn land_run(&self, first: u32, unit: usize, data: &[u8]) -> Result<(), String> {
        let count = data.len().div_ceil(unit.max(1)).max(1) as u64;
        if count == 1 {
            return self.land(first, data);
        }
        if unit as u64 != self.mtu {
            // Chunks shorter than the MTU (blocks of one short chunk each): one by one.
            for (i, c) in data.chunks(unit.max(1)).enumerate() {
                self.land(first + i as u32, c)?;
            }
            return Ok(());
        }
        let (mut g, end_g, mut pos) = (u64::from(first), u64::from(first) + count, 0usize);
        while g < end_g {
            let i = g % self.chunks.max(1);
            let k = (self.chunks - i).min(end_g - g);
            let (at, _) = self
                .place(g)
                .ok_or_else(|| format!("chunk {g} beyond {} blocks", self.blocks))?;
            let bytes = ((i + k) * self.mtu).min(self.len) - i * self.mtu;
            let piece = data
                .get(pos..pos + bytes as usize)
                .ok_or_else(|| format!("a run from chunk {first} shorter than its chunks"))?;
            self.write(at, piece)?;
            pos += bytes as usize;
            g += k;
        }
        if pos != data.len() {
            return Err(format!("a run from chunk {first} longer than its chunks"));
        }
        Ok(())
    }
}

impl Plane {
    /// The multicast resources: `recv_workers` receive workers and `send_workers` send
    /// workers; `wake` wakes the SP's loop when they have something for it.
    pub fn start(
        cfg: PlaneConfig,
        key: ClusterKey,
        wake: Arc<mio::Waker>,
    ) -> std::io::Result<Plane> {
        // A fabric the SP cannot send on, join or hear itself on fails here, so that its
        // hosts learn it at registration (and their jobs choose another design), not at a
        // collective.
        probe(&cfg)?;
        let (ev_tx, ev_rx) = crossbeam_channel::unbounded();
        let waker: super::worker::Waker = {
            let w = wake.clone();
            Arc::new(move || {
                let _ = w.wake();
            })
        };
        let mut workers = Vec::new();
        for i in 0..cfg.recv_workers.max(1) {
            let inject = Injection {
                seed: cfg.inject.seed.wrapping_add(i as u64),
                ..cfg.inject
            };
            workers.push(RecvWorker::start_waking(
                &format!("mcast-recv-{i}"),
                ev_tx.clone(),
                inject,
                Some(waker.clone()),
            )?);
        }
        let (job_tx, job_rx) = crossbeam_channel::unbounded::<SendJob>();
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let send_stats = Arc::new(SendStats::default());
        let mut senders = Vec::new();
        for i in 0..cfg.send_workers.max(1) {
            let sock = fabric::sender(&cfg.fabric)?;
            let rx = job_rx.clone();
            let tx: Sender<(CollKey, u64, Status)> = done_tx.clone();
            let wake = wake.clone();
            let movers = cfg.movers.clone();
            let stats = send_stats.clone();
            senders.push(
                std::thread::Builder::new()
                    .name(format!("mcast-send-{i}"))
                    .spawn(move || {
                        for job in rx {
                            let status = match send_run(&sock, &movers, &job, &stats) {
                                Ok(()) => Status::Ok,
                                Err(why) => {
                                    stats.failures.fetch_add(1, Ordering::Relaxed);
                                    tracing::warn!(ck = ?job.ck, "multicast failed: {why}");
                                    Status::AccessError
                                }
                            };
                            if tx.send((job.ck, job.m.id, status)).is_err() {
                                return;
                            }
                            let _ = wake.wake();
                        }
                    })?,
            );
        }
        let (ack_tx, acks) = crossbeam_channel::unbounded();
        Ok(Plane {
            wake,
            acks,
            ack_tx,
            pending: HashMap::new(),
            ready: Vec::new(),
            cfg,
            key,
            workers,
            events: ev_rx,
            joined: HashMap::new(),
            by_coll: HashMap::new(),
            by_ck: HashMap::new(),
            send: Some(job_tx),
            sent: done_rx,
            senders,
            send_stats,
            registrations: 0,
            join_failures: 0,
        })
    }

    /// The communicator slot, fabric id and tag of instance `ck` (the same on every SP).
    fn names(&self, ck: CollKey) -> (u32, u64, u64) {
        // Each field's bytes, not a formatting of the key: the same on every SP, whatever
        // its build.
        let job = ck.job.to_le_bytes();
        let leader = ck.comm.leader.to_le_bytes();
        let id = ck.comm.id.to_le_bytes();
        let seq = ck.seq.to_le_bytes();
        let slot_mac = self.key.mac("spoff mcast slot", &[&job, &leader, &id]);
        let mac = self
            .key
            .mac("spoff mcast coll", &[&job, &leader, &id, &seq]);
        let word = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let slot = (word(slot_mac.as_ref()) % u64::from(SLOTS)) as u32;
        (slot, word(&mac.as_ref()[..8]), word(&mac.as_ref()[8..16]))
    }

    fn group(&self, slot: u32, sub: u16, subgroups: u16) -> SocketAddrV4 {
        self.cfg.fabric.group(slot, sub, subgroups)
    }

    /// Joins the groups of `slot` not joined yet, each socket given to a worker in turn.
    fn join(&mut self, slot: u32, subgroups: u16) -> Result<(), String> {
        for sub in 0..subgroups {
            if self.joined.contains_key(&(slot, sub)) {
                continue;
            }
            let group = self.group(slot, sub, subgroups);
            let s = fabric::receiver(group, self.cfg.fabric.interface, self.cfg.rcvbuf).map_err(
                |e| {
                    self.join_failures += 1;
                    format!("cannot join the multicast group {group}: {e}")
                },
            )?;
            let w = self.joined.len() % self.workers.len();
            self.workers[w].add_socket(s);
            self.joined.insert((slot, sub), w);
        }
        Ok(())
    }

    /// An acknowledgement that calls back into the plane (its channel, then the SP's waker).
    fn ack(&self, coll: u64, registering: bool) -> super::worker::Ack {
        let (tx, wake) = (self.ack_tx.clone(), self.wake.clone());
        Box::new(move || {
            let _ = tx.send((coll, registering));
            let _ = wake.wake();
        })
    }

    /// Has every worker forget `ck`'s registration; [`McastEvent::Unregistered`] follows once
    /// they all did (at once if nothing was registered).
    fn unregister(&mut self, ck: CollKey) {
        match self.by_ck.remove(&ck) {
            Some(coll) => {
                self.pending.remove(&(coll, true));
                self.pending.insert((coll, false), (ck, self.workers.len()));
                for w in &self.workers {
                    w.unregister_then(coll, self.ack(coll, false));
                }
            }
            None => self.ready.push((ck, McastEvent::Unregistered)),
        }
    }
}

/// Joins the fabric's probe group (the slot past the communicators') and multicasts a datagram
/// with a fresh nonce to it: it must come back (`IP_MULTICAST_LOOP`) within 500 ms. This shows
/// the group can be joined and sent to out of the SP's interface; not that other nodes hear it
/// (a fabric that drops everything between nodes leaves the fetch ring to carry every byte).
fn probe(cfg: &PlaneConfig) -> std::io::Result<()> {
    let group = cfg.fabric.group(SLOTS, 0, 1);
    let r = fabric::receiver(group, cfg.fabric.interface, 64 << 10).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("cannot join the multicast group {group}: {e}"),
        )
    })?;
    let s = fabric::sender(&cfg.fabric)?;
    let nonce = bootstrap::auth::random::<16>();
    let mut msg = b"SPMC-probe".to_vec();
    msg.extend_from_slice(&nonce);
    s.send_to(&msg, group)
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot multicast to {group}: {e}")))?;
    let until = std::time::Instant::now() + std::time::Duration::from_millis(500);
    let mut buf = [0u8; 64];
    while std::time::Instant::now() < until {
        match fabric::recv(&r, &mut buf) {
            Ok(n) if buf[..n] == msg[..] => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(std::time::Duration::from_millis(1))
            }
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "a probe multicast to {group} out of {} did not come back within 500 ms \
             (no multicast route?)",
            cfg.fabric.interface
        ),
    ))
}

/// Sends the chunks of one multicast: runs of the root's buffer read through this thread's
/// mover, each chunk one datagram.
fn send_run(
    sock: &UdpSocket,
    movers: &MoverConfig,
    job: &SendJob,
    stats: &SendStats,
) -> Result<(), String> {
    let m = &job.m;
    let chunks = u32::try_from(m.chunks).map_err(|_| "too many chunks".to_string())?;
    let mtu = m.mtu.max(1);
    let mut buf = Vec::new();
    let mut out = Vec::with_capacity(datagram::HEADER_BYTES + mtu as usize);
    let mut psn = m.first_psn;
    let end_psn = m.first_psn + m.psns;
    while psn < end_psn {
        let run = (end_psn - psn).min(SEND_RUN_CHUNKS);
        let from = m.offset + (psn - m.first_psn) * mtu;
        let to = (from + run * mtu).min(m.offset + m.len);
        buf.resize((to - from) as usize, 0);
        if !buf.is_empty() {
            with_mover(movers, |mv| {
                mv.read(&m.key, from, &mut buf)
                    .map_err(|e| format!("reading the root's bytes {from}..{to}: {e}"))
            })?;
        }
        for i in 0..run {
            let a = (i * mtu) as usize;
            let b = ((i + 1) * mtu).min(buf.len() as u64) as usize;
            let payload = &buf[a.min(b)..b];
            let h = Header {
                subgroup: m.subgroup,
                coll: job.coll,
                tag: job.tag,
                psn: (psn + i) as u32,
                chunks,
            };
            datagram::encode(&h, payload, &mut out);
            super::send_datagram(sock, &out, job.group)
                .map_err(|e| format!("sending to {}: {e}", job.group))?;
            stats.datagrams.fetch_add(1, Ordering::Relaxed);
            stats.bytes.fetch_add(out.len() as u64, Ordering::Relaxed);
        }
        psn += run;
    }
    Ok(())
}

impl Resources for Plane {
    fn family(&self) -> Family {
        Family::Multicast
    }

    fn unavailable(&self) -> Option<String> {
        None
    }

    fn request(&mut self, ck: CollKey, req: Payload) -> Result<(), String> {
        let req = req
            .downcast::<McastReq>()
            .map_err(|_| "not a multicast request".to_string())?;
        match *req {
            McastReq::Register(r) => {
                let total = r.blocks.saturating_mul(r.chunks);
                let chunks = u32::try_from(total)
                    .map_err(|_| format!("{total} chunks: too many for one collective"))?;
                let (slot, coll, tag) = self.names(ck);
                if r.subgroups != self.cfg.subgroups {
                    return Err(format!(
                        "{} subgroups asked, this SP's fabric has {}",
                        r.subgroups, self.cfg.subgroups
                    ));
                }
                self.join(slot, self.cfg.subgroups.max(1))?;
                let sink = Arc::new(RankSink {
                    keys: r.keys,
                    blocks: r.blocks,
                    chunks: r.chunks.max(1),
                    mtu: r.mtu.max(1),
                    len: r.len,
                    movers: self.cfg.movers.clone(),
                });
                let per = r.chunks.max(1);
                let skip: Vec<(u32, u32)> = r
                    .own_blocks
                    .iter()
                    .map(|&b| ((b * per) as u32, ((b + 1) * per).min(total) as u32))
                    .collect();
                // Every worker: the instance's subgroups may be spread over all of them.
                self.pending.insert((coll, true), (ck, self.workers.len()));
                for w in &self.workers {
                    w.register_then(
                        Registration {
                            coll,
                            tag,
                            chunks,
                            sink: sink.clone(),
                            skip: skip.clone(),
                        },
                        self.ack(coll, true),
                    );
                }
                self.by_coll.insert(coll, ck);
                self.by_ck.insert(ck, coll);
                self.registrations += 1;
                Ok(())
            }
            McastReq::Unregister => {
                self.unregister(ck);
                Ok(())
            }
            McastReq::Multicast(m) => {
                let (slot, coll, tag) = self.names(ck);
                let group = self.group(slot, m.subgroup, self.cfg.subgroups);
                let job = SendJob {
                    ck,
                    m,
                    group,
                    coll,
                    tag,
                };
                self.send
                    .as_ref()
                    .expect("send workers run while the plane lives")
                    .send(job)
                    .map_err(|_| "the send workers are gone".to_string())
            }
        }
    }

    fn poll(&mut self, out: &mut Vec<(CollKey, Payload)>) {
        // The landings of this poll, per instance (most polls: one or none).
        let mut landed: Vec<(CollKey, Vec<u64>)> = Vec::new();
        while let Ok(ev) = self.events.try_recv() {
            let coll = match &ev {
                Event::Landed { coll, .. } | Event::SinkFailed { coll, .. } => *coll,
            };
            // A chunk landed just before its instance unregistered: nobody waits for it.
            let Some(&ck) = self.by_coll.get(&coll) else {
                continue;
            };
            match ev {
                Event::Landed { psn, .. } => match landed.iter_mut().find(|(c, _)| *c == ck) {
                    Some((_, psns)) => psns.push(u64::from(psn)),
                    None => landed.push((ck, vec![u64::from(psn)])),
                },
                Event::SinkFailed { psn, why, .. } => {
                    tracing::warn!(coll, psn, "landing a multicast chunk failed: {why}");
                    out.push((ck, Box::new(McastEvent::SinkFailed)));
                }
            }
        }
        for (ck, psns) in landed {
            out.push((ck, Box::new(McastEvent::Landed(psns))));
        }
        while let Ok((ck, id, status)) = self.sent.try_recv() {
            out.push((ck, Box::new(McastEvent::MulticastDone { id, status })));
        }
        while let Ok((coll, registering)) = self.acks.try_recv() {
            let Some((ck, left)) = self.pending.get_mut(&(coll, registering)) else {
                continue;
            };
            *left -= 1;
            if *left > 0 {
                continue;
            }
            let ck = *ck;
            self.pending.remove(&(coll, registering));
            if registering {
                out.push((ck, Box::new(McastEvent::Registered)));
            } else {
                // Nothing of it lands any more: its late chunks are nobody's.
                self.by_coll.remove(&coll);
                out.push((ck, Box::new(McastEvent::Unregistered)));
            }
        }
        for (ck, e) in self.ready.drain(..) {
            out.push((ck, Box::new(e)));
        }
    }

    /// The instance went with its job (its ranks are gone): its registration is dropped
    /// without waiting for the workers (an instance that finished had its driver wait for
    /// [`McastEvent::Unregistered`] before its ranks completed).
    fn release(&mut self, ck: CollKey, _cx: &mut crate::drivers::resources::Cx<'_>) {
        if let Some(coll) = self.by_ck.remove(&ck) {
            for w in &self.workers {
                w.unregister_then(coll, Box::new(|| {}));
            }
            self.by_coll.remove(&coll);
        }
        self.pending.retain(|_, (k, _)| *k != ck);
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let mut t = [0u64; 12];
        for w in &self.workers {
            let s = &w.stats;
            for (i, c) in [
                &s.datagrams,
                &s.bytes,
                &s.landed,
                &s.duplicates,
                &s.malformed,
                &s.unknown_coll,
                &s.bad_tag,
                &s.injected_drops,
                &s.reordered,
                &s.overflow_drops,
                &s.sink_failures,
                &s.own_echoes,
            ]
            .into_iter()
            .enumerate()
            {
                t[i] += WorkerStats::get(c);
            }
        }
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("mcast_datagrams_received", t[0]),
            ("mcast_bytes_received", t[1]),
            ("mcast_chunks_landed", t[2]),
            ("mcast_duplicates", t[3]),
            ("mcast_malformed", t[4]),
            ("mcast_unknown_coll", t[5]),
            ("mcast_bad_tag", t[6]),
            ("mcast_injected_drops", t[7]),
            ("mcast_reordered", t[8]),
            ("mcast_overflow_drops", t[9]),
            ("mcast_sink_failures", t[10]),
            ("mcast_own_echoes", t[11]),
            ("mcast_datagrams_sent", g(&self.send_stats.datagrams)),
            ("mcast_bytes_sent", g(&self.send_stats.bytes)),
            ("mcast_send_failures", g(&self.send_stats.failures)),
            ("mcast_registrations", self.registrations),
            ("mcast_join_failures", self.join_failures),
        ]
    }
}

impl Drop for Plane {
    fn drop(&mut self) {
        self.send.take();
        for t in self.senders.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(interface: std::net::Ipv4Addr) -> PlaneConfig {
        PlaneConfig {
            fabric: FabricConfig {
                interface,
                // A port range of this test's own.
                port_base: 46_000 + (std::process::id() % 512) as u16,
                ..FabricConfig::default()
            },
            subgroups: 1,
            recv_workers: 1,
            send_workers: 1,
            inject: Injection::default(),
            rcvbuf: 64 << 10,
            movers: MoverConfig::default(),
        }
    }

    /// The probe passes on loopback here, and fails with its reason where the interface cannot
    /// multicast: a thread of its own in a fresh network namespace, whose loopback is down.
    #[test]
    fn the_probe_hears_itself_on_loopback_and_says_why_where_it_cannot() {
        probe(&cfg(std::net::Ipv4Addr::LOCALHOST)).expect("loopback multicast works here");
        let why = std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                .expect("a network namespace of its own (the tests run as root)");
            probe(&cfg(std::net::Ipv4Addr::LOCALHOST))
        })
        .join()
        .unwrap()
        .expect_err("a probe in a namespace whose loopback is down came back");
        let why = why.to_string();
        assert!(
            why.contains("239.255.") && (why.contains("join") || why.contains("multicast")),
            "{why}"
        );
    }
}
