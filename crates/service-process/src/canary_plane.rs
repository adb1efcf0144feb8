//! An SP's Canary data path (issue 27 part 4): one UDP socket on the SP's link to its leaf
//! switch (bound to its own address, connected to the leaf's port, so only the leaf's
//! datagrams reach it) and one worker thread that runs an [`algorithms::canary::Host`]
//! machine per allreduce on it: the SP's one contribution (its ranks' data, already reduced
//! among them) goes in with [`Plane::start`], the reduced vector or the reason of the failure
//! comes out of [`Plane::poll`].
//!
//! - Packets of an allreduce not started here yet (a faster member's, or a leader's answer)
//!   are kept, at most [`EARLY_MAX`] datagrams in all, and fed to its machine when it starts;
//!   beyond that they are dropped and counted (the senders' retransmissions recover them).
//! - A machine that finished is kept [`PlaneConfig::linger`] more: as the leader of its share
//!   of the blocks it answers the other members' retransmission requests meanwhile.
//! - A retransmission request for an allreduce not started here (this SP's ranks are late)
//!   is answered with [`Packet::Wait`]: the requester keeps waiting rather than take this SP
//!   for unreachable. Not for one that ended here and was dropped (the last [`FORGOTTEN_MAX`]
//!   ids are remembered): a requester still asking then gets no answer and fails, rather than
//!   wait for ever.
//! - Datagrams that are not Canary packets, or of another job's tag, are counted and dropped
//!   (the machine checks the tag).
//!
//! The SP's Canary allreduce (`drivers::canary_allreduce`) reaches it through its family's
//! resources (`crate::canary_resources`), which start one machine per chunk and wake the SP's
//! loop when one ends ([`Plane::with_waker`]).

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use algorithms::canary::{Host, HostConfig, HostEvent, Packet};
use anyhow::{Context, Result};
use crossbeam_channel::{Receiver, Sender};

/// Datagrams kept for allreduces not started here yet, all together.
pub const EARLY_MAX: usize = 4096;
/// Ids of ended (or dropped) allreduces remembered, not to answer requests for them with
/// `Wait`.
pub const FORGOTTEN_MAX: usize = 65536;

/// Where the plane sits.
#[derive(Clone, Debug)]
pub struct PlaneConfig {
    /// The SP's socket address on its leaf link.
    pub local: SocketAddr,
    /// The leaf switch's port at the other end.
    pub leaf: SocketAddr,
    /// How long a finished machine still answers retransmission requests.
    pub linger: Duration,
}

/// What an allreduce ended with on this SP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlaneEvent {
    Done { coll: u32, result: Vec<u8> },
    Failed { coll: u32, why: String },
}

/// Counters of the plane.
#[derive(Debug, Default)]
pub struct PlaneStats {
    pub rx: AtomicU64,
    pub tx: AtomicU64,
    pub malformed: AtomicU64,
    pub early_kept: AtomicU64,
    pub early_dropped: AtomicU64,
    pub waits_sent: AtomicU64,
    pub send_errors: AtomicU64,
}

enum Cmd {
    Start {
        cfg: Box<HostConfig>,
        input: Vec<u8>,
    },
    Forget {
        coll: u32,
    },
    Stop,
}

/// The socket and its worker; see the module docs.
pub struct Plane {
    cmds: Sender<Cmd>,
    events: Receiver<PlaneEvent>,
    wake: i32,
    worker: Option<JoinHandle<()>>,
    pub stats: Arc<PlaneStats>,
}

/// The receive buffer of an SP's Canary socket.
pub const PLANE_RCVBUF: usize = 4 << 20;

impl Plane {
    pub fn new(cfg: PlaneConfig) -> Result<Plane> {
        let sock =
            UdpSocket::bind(cfg.local).with_context(|| format!("canary: binding {}", cfg.local))?;
        Plane::with_socket(sock, cfg)
    }

    /// The same on a socket already bound to `cfg.local` (e.g. passed by a launcher).
    pub fn with_socket(sock: UdpSocket, cfg: PlaneConfig) -> Result<Plane> {
        Plane::with_waker(sock, cfg, None)
    }

    /// The same, calling `wake` after each ended allreduce is queued for [`Plane::poll`] (the
    /// SP's loop waker).
    pub fn with_waker(
        sock: UdpSocket,
        cfg: PlaneConfig,
        wake: Option<Arc<mio::Waker>>,
    ) -> Result<Plane> {
        sock.connect(cfg.leaf)
            .with_context(|| format!("canary: connecting to the leaf at {}", cfg.leaf))?;
        sock.set_nonblocking(true)?;
        // The results of a window of blocks arrive in a burst: room for them (see the switch's
        // --rcvbuf-kib).
        crate::canary_switch::grow_rcvbuf(&sock, PLANE_RCVBUF);
        let mut fds = [0; 2];
        // SAFETY: `fds` is valid for two ints.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error()).context("canary: wake pipe");
        }
        let (cmds, cmd_rx) = crossbeam_channel::unbounded();
        let (ev_tx, events) = crossbeam_channel::unbounded();
        let stats = Arc::new(PlaneStats::default());
        let st = stats.clone();
        let wake_rd = fds[0];
        let worker = std::thread::Builder::new()
            .name("canary-plane".into())
            .spawn(move || {
                Worker {
                    sock,
                    wake: wake_rd,
                    cmds: cmd_rx,
                    events: ev_tx,
                    stats: st,
                    wake_loop: wake,
                    linger: cfg.linger,
                    start: Instant::now(),
                    running: HashMap::new(),
                    early: HashMap::new(),
                    early_n: 0,
                    forgotten: Default::default(),
                    forgotten_order: Default::default(),
                }
                .run();
                // SAFETY: the read end is this thread's alone.
                unsafe { libc::close(wake_rd) };
            })?;
        Ok(Plane {
            cmds,
            events,
            wake: fds[1],
            worker: Some(worker),
            stats,
        })
    }

    fn nudge(&self) {
        let b = 1u8;
        // SAFETY: write(2) of one valid byte to the pipe this struct owns.
        unsafe { libc::write(self.wake, (&b as *const u8).cast(), 1) };
    }

    /// Starts allreduce `cfg.coll` with this SP's contribution `input` (`cfg.len` bytes).
    pub fn start(&self, cfg: HostConfig, input: Vec<u8>) {
        assert_eq!(cfg.len, input.len(), "the contribution's length");
        let _ = self.cmds.send(Cmd::Start {
            cfg: Box::new(cfg),
            input,
        });
        self.nudge();
    }

    /// Drops allreduce `coll` here at once (its instance is gone).
    pub fn forget(&self, coll: u32) {
        let _ = self.cmds.send(Cmd::Forget { coll });
        self.nudge();
    }

    /// The next ended allreduce, if any.
    pub fn poll(&self) -> Option<PlaneEvent> {
        self.events.try_recv().ok()
    }

    /// Waits up to `timeout` for the next ended allreduce.
    pub fn wait(&self, timeout: Duration) -> Option<PlaneEvent> {
        self.events.recv_timeout(timeout).ok()
    }
}

impl Drop for Plane {
    fn drop(&mut self) {
        let _ = self.cmds.send(Cmd::Stop);
        self.nudge();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
        // SAFETY: the write end is this struct's alone; the worker is gone.
        unsafe { libc::close(self.wake) };
    }
}

struct Running {
    host: Host,
    input: Vec<u8>,
    result: Vec<u8>,
    /// Set once it ended: dropped at this time.
    until: Option<Instant>,
}

struct Worker {
    sock: UdpSocket,
    wake: i32,
    cmds: Receiver<Cmd>,
    events: Sender<PlaneEvent>,
    stats: Arc<PlaneStats>,
    wake_loop: Option<Arc<mio::Waker>>,
    linger: Duration,
    start: Instant,
    running: HashMap<u32, Running>,
    early: HashMap<u32, Vec<Packet>>,
    early_n: usize,
    forgotten: std::collections::HashSet<u32>,
    forgotten_order: std::collections::VecDeque<u32>,
}

impl Worker {
    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn send(&self, pkts: Vec<Packet>) {
        for p in pkts {
            match self.sock.send(&p.encode()) {
                Ok(_) => self.stats.tx.fetch_add(1, Ordering::Relaxed),
                Err(_) => self.stats.send_errors.fetch_add(1, Ordering::Relaxed),
            };
        }
    }

    /// Collects what machine `coll` reported; sends its end once.
    fn events_of(&mut self, coll: u32) {
        let Some(r) = self.running.get_mut(&coll) else {
            return;
        };
        while let Some(ev) = r.host.poll_event() {
            let end = match ev {
                HostEvent::Block { offset, data, .. } => {
                    r.result[offset..offset + data.len()].copy_from_slice(&data);
                    None
                }
                HostEvent::Done => Some(PlaneEvent::Done {
                    coll,
                    result: std::mem::take(&mut r.result),
                }),
                HostEvent::Failed(e) => Some(PlaneEvent::Failed {
                    coll,
                    why: format!("canary allreduce: {e}"),
                }),
            };
            // One end per allreduce: a machine that finished may still report (a late
            // result or abort while it lingers), which changes nothing here any more.
            if let (Some(end), None) = (end, r.until) {
                r.until = Some(Instant::now() + self.linger);
                let _ = self.events.send(end);
                if let Some(w) = &self.wake_loop {
                    let _ = w.wake();
                }
            }
        }
    }

    /// Allreduce `coll` is dropped here: requests for it get no `Wait` any more.
    fn forget_id(&mut self, coll: u32) {
        if self.forgotten.insert(coll) {
            self.forgotten_order.push_back(coll);
            if self.forgotten_order.len() > FORGOTTEN_MAX {
                if let Some(old) = self.forgotten_order.pop_front() {
                    self.forgotten.remove(&old);
                }
            }
        }
    }

    fn on_packet(&mut self, pkt: Packet) {
        let coll = pkt.head().id.coll;
        let now = self.now();
        if let (Packet::Retx { head, host }, false) = (&pkt, self.running.contains_key(&coll)) {
            if !self.forgotten.contains(&coll) {
                self.stats.waits_sent.fetch_add(1, Ordering::Relaxed);
                let wait = Packet::Wait {
                    head: algorithms::canary::Head {
                        dst: *host,
                        ..*head
                    },
                };
                self.send(vec![wait]);
            }
        }
        match self.running.get_mut(&coll) {
            Some(r) => {
                let out = r.host.on_packet(now, pkt, &r.input);
                self.send(out);
                self.events_of(coll);
            }
            None if self.early_n < EARLY_MAX => {
                self.early.entry(coll).or_default().push(pkt);
                self.early_n += 1;
                self.stats.early_kept.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                self.stats.early_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn command(&mut self, c: Cmd) -> bool {
        match c {
            Cmd::Start { cfg, input } => {
                let coll = cfg.coll;
                let now = self.now();
                let mut host = Host::new(*cfg);
                let out = host.start(now, &input);
                let len = input.len();
                self.running.insert(
                    coll,
                    Running {
                        host,
                        input,
                        result: vec![0; len],
                        until: None,
                    },
                );
                self.send(out);
                self.events_of(coll);
                if let Some(early) = self.early.remove(&coll) {
                    self.early_n -= early.len();
                    for p in early {
                        self.on_packet(p);
                    }
                }
            }
            Cmd::Forget { coll } => {
                self.running.remove(&coll);
                self.forget_id(coll);
                if let Some(e) = self.early.remove(&coll) {
                    self.early_n -= e.len();
                }
            }
            Cmd::Stop => return false,
        }
        true
    }

    fn run(mut self) {
        let mut buf = vec![0u8; 65536];
        loop {
            // Commands first (a start before the packets that wait for it).
            while let Ok(c) = self.cmds.try_recv() {
                if !self.command(c) {
                    return;
                }
            }
            loop {
                match self.sock.recv(&mut buf) {
                    Ok(n) => {
                        self.stats.rx.fetch_add(1, Ordering::Relaxed);
                        match Packet::decode(&buf[..n]) {
                            Ok(p) => self.on_packet(p),
                            Err(_) => {
                                self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    // An ICMP error of the leaf's port (the switch is gone): only loss here;
                    // the machines' retransmission bounds end the allreduce.
                    Err(_) => {}
                }
            }
            let now = self.now();
            let due: Vec<u32> = self
                .running
                .iter()
                .filter(|(_, r)| r.host.next_deadline().is_some_and(|d| d <= now))
                .map(|(&c, _)| c)
                .collect();
            for coll in due {
                let r = self.running.get_mut(&coll).unwrap();
                let out = r.host.on_timer(now, &r.input);
                self.send(out);
                self.events_of(coll);
            }
            let t = Instant::now();
            let gone: Vec<u32> = self
                .running
                .iter()
                .filter(|(_, r)| r.until.is_some_and(|u| u <= t))
                .map(|(&c, _)| c)
                .collect();
            for c in gone {
                self.running.remove(&c);
                self.forget_id(c);
            }
            let next = self
                .running
                .values()
                .filter_map(|r| r.host.next_deadline())
                .min()
                .map(|d| d.saturating_sub(self.now()))
                .unwrap_or(100_000_000)
                .min(100_000_000);
            let mut fds = [
                libc::pollfd {
                    fd: self.sock.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.wake,
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            let ts = libc::timespec {
                tv_sec: (next / 1_000_000_000) as libc::time_t,
                tv_nsec: (next % 1_000_000_000) as libc::c_long,
            };
            // SAFETY: two valid pollfds, a valid timespec, no sigmask.
            unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
            if fds[1].revents != 0 {
                let mut b = [0u8; 64];
                // SAFETY: `b` is valid for writes of its length.
                while unsafe { libc::read(self.wake, b.as_mut_ptr().cast(), b.len()) } > 0 {}
            }
        }
    }
}
