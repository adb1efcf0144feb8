//! `service-process switch`: a software Canary switch (issue 27 part 4). One
//! [`algorithms::canary::Switch`] machine on UDP sockets, one socket per switch port, fed by
//! one thread polling them (`ppoll`, nanosecond timeouts, so the machine's aggregation window
//! is not rounded up to a millisecond).
//!
//! # Ports
//! `--port N=LOCAL,PEER`: port `N` of the machine is a UDP socket bound to `LOCAL` and
//! connected to `PEER` (the host's or the neighbouring switch's socket at the other end of the
//! link). A connected socket receives datagrams from `PEER` only: the kernel drops any other
//! source before the daemon sees it. Every datagram received is decoded with
//! [`Packet::decode`]; one that is not a Canary packet is dropped and counted (`malformed`).
//!
//! # Queue occupancy
//! The machine picks an up-port by the occupancy of its output queues (paper §5.2). A port's
//! queue here is the socket's send queue as the kernel reports it (`SIOCOUTQ`: bytes not yet
//! handed to the device) plus a software queue of datagrams the socket refused (`EAGAIN`),
//! bounded by `--queue-kib`; a datagram beyond it is dropped and counted (`queue_drops`), as a
//! switch's full buffer drops. The capacity given to the machine is `SO_SNDBUF` plus that
//! bound. On loopback the kernel queue is empty almost always: congestion shows in a network
//! namespace tree whose links have `tc` queues. There `SIOCOUTQ` still counts only this
//! socket's own bytes, not another sender's packets in the device's qdisc; `--qdisc-load`
//! (which `canary-tree --netns` passes) adds the backlog of each port's device's root qdisc,
//! read over rtnetlink ([`crate::qdisc`]) at most every 200 µs, and for a `tbf` takes its limit
//! as the capacity, so a link that background traffic loads looks loaded to the choice.
//!
//! # Links going down
//! A connected UDP socket learns from the ICMP "port unreachable" of its peer
//! (`ECONNREFUSED`): the port is then reported down to the machine (which then never picks it
//! as an up-port) for `--down-ms`, or until a datagram arrives from the peer again. That is
//! how a leaf routes around a dead spine; a switch that vanishes silently (no ICMP) is only
//! loss, which the hosts recover or report (`algorithms::canary::host`).
//!
//! # Counters
//! Per port: datagrams received and sent, malformed ones, software-queue drops, send errors,
//! times marked down, injected drops, and the kernel's drops of a full receive buffer
//! (`rcvbuf_drops`, from `SO_RXQ_OVFL`; `--rcvbuf-kib` sets the buffer); sums of each, and the
//! machine's counters. `STATS {json}` on stdout at SIGINT/SIGTERM; with `--stats-file`, the same JSON rewritten
//! there (atomically, by rename) at most every 100 ms while counters change, and at exit.
//! `READY switch addr=A ports=P` on stdout once every socket is bound.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use algorithms::canary::packet::MAX_DATA;
use algorithms::canary::{Addr, Packet, Port, PortLoad, Switch, SwitchConfig};
use anyhow::{bail, Context, Result};

/// One `--port N=LOCAL,PEER`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortSpec {
    pub port: Port,
    pub local: SocketAddr,
    pub peer: SocketAddr,
}

impl std::str::FromStr for PortSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<PortSpec, String> {
        let (n, rest) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected N=LOCAL_ADDR:PORT,PEER_ADDR:PORT"))?;
        let (local, peer) = rest
            .split_once(',')
            .ok_or_else(|| format!("{s:?}: expected N=LOCAL_ADDR:PORT,PEER_ADDR:PORT"))?;
        Ok(PortSpec {
            port: n.trim().parse().map_err(|e| format!("{s:?}: port: {e}"))?,
            local: local
                .trim()
                .parse()
                .map_err(|e| format!("{s:?}: local: {e}"))?,
            peer: peer
                .trim()
                .parse()
                .map_err(|e| format!("{s:?}: peer: {e}"))?,
        })
    }
}

/// One `--route ADDR=PORT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteSpec {
    pub addr: Addr,
    pub port: Port,
}

impl std::str::FromStr for RouteSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<RouteSpec, String> {
        let (a, p) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected ADDR=PORT"))?;
        Ok(RouteSpec {
            addr: a
                .trim()
                .parse()
                .map_err(|e| format!("{s:?}: address: {e}"))?,
            port: p.trim().parse().map_err(|e| format!("{s:?}: port: {e}"))?,
        })
    }
}

/// Options of `service-process switch`.
#[derive(clap::Args, Clone, Debug)]
pub struct SwitchOpts {
    /// This switch's Canary address (a number unique among the hosts and switches of the
    /// tree; carried in collided packets and the target of restorations).
    #[arg(long)]
    pub addr: Addr,
    /// A port: `N=LOCAL_ADDR:PORT,PEER_ADDR:PORT`, port N of the switch a UDP socket bound to
    /// LOCAL and connected to PEER (only PEER's datagrams are received on it). Repeat per
    /// port; numbers 0, 1, ... without gaps.
    #[arg(long = "port", value_name = "N=LOCAL,PEER", required = true)]
    pub ports: Vec<PortSpec>,
    /// The up-ports (towards the spines), comma-separated; none at the top level.
    #[arg(long, value_delimiter = ',')]
    pub up: Vec<Port>,
    /// `ADDR=PORT`: the Canary address ADDR (a host, or a switch below or beside this one) is
    /// reached through PORT. Every other address goes up. Repeat per address.
    #[arg(long = "route", value_name = "ADDR=PORT")]
    pub routes: Vec<RouteSpec>,
    /// Descriptor table slots.
    #[arg(long, default_value_t = 4096)]
    pub slots: usize,
    /// Aggregation window of a descriptor, microseconds (the paper's timeout).
    #[arg(long, default_value_t = 200)]
    pub timeout_us: u64,
    /// Lifetime of a flushed descriptor whose broadcast never came, milliseconds.
    #[arg(long, default_value_t = 100)]
    pub hold_ms: u64,
    /// Software queue bound per port (KiB), beyond the socket's send buffer.
    #[arg(long, default_value_t = 1024)]
    pub queue_kib: u64,
    /// Each port's receive buffer (`SO_RCVBUF`; as root `SO_RCVBUFFORCE`, past
    /// `net.core.rmem_max`), the switch's input buffer: a burst beyond it is dropped by the
    /// kernel, counted per port as `rcvbuf_drops`. The kernel's default (about 208 KiB,
    /// counted with each datagram's overhead) dropped a window of 8 KiB blocks.
    #[arg(long, default_value_t = 4096)]
    pub rcvbuf_kib: usize,
    /// How long a port stays down after its peer answered ICMP unreachable, milliseconds.
    #[arg(long, default_value_t = 200)]
    pub down_ms: u64,
    /// Keep the counters (JSON) in this file while running and at exit.
    #[arg(long)]
    pub stats_file: Option<PathBuf>,
    /// Drop this fraction (0 to 1) of the Canary packets to send, at random (counted as
    /// `injected_drops`): loss for tests on loopback, where the kernel drops nothing.
    #[arg(long, default_value_t = 0.0)]
    pub drop_rate: f64,
    /// Seed of --drop-rate (default: the switch's address).
    #[arg(long)]
    pub seed: Option<u64>,
    /// A static tree (the paper's baselines, `canary.params.static_trees`): `T=UP:EXPECTED`,
    /// tree T's packets go up port UP (`root`: this switch is the tree's root and sends the
    /// block towards its leader) once EXPECTED host contributions are aggregated here. One
    /// rule per tree serves every allreduce: the fabric's allreduces must span every host.
    #[arg(long = "tree", value_name = "T=UP:EXPECTED")]
    pub trees: Vec<TreeSpec>,
    /// Count the backlog of each port's device's root qdisc (every sender's packets, read by
    /// rtnetlink at most every 200 us) in the port's load, and for a `tbf` take its limit as
    /// the port's capacity: a link that `tc` shapes and other traffic loads then looks loaded
    /// to the up-port choice. For links with kernel queues (a namespace tree).
    #[arg(long)]
    pub qdisc_load: bool,
}

/// One `--tree T=UP:EXPECTED`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeSpec {
    pub tree: u8,
    pub up: Option<Port>,
    pub expected: u16,
}

impl std::str::FromStr for TreeSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<TreeSpec, String> {
        let bad = || format!("{s:?}: expected T=UP:EXPECTED (UP a port or root)");
        let (t, rest) = s.split_once('=').ok_or_else(bad)?;
        let (up, n) = rest.split_once(':').ok_or_else(bad)?;
        Ok(TreeSpec {
            tree: t.trim().parse().map_err(|e| format!("{s:?}: tree: {e}"))?,
            up: match up.trim() {
                "root" => None,
                p => Some(p.parse().map_err(|e| format!("{s:?}: port: {e}"))?),
            },
            expected: n.trim().parse().map_err(|e| format!("{s:?}: count: {e}"))?,
        })
    }
}

/// What the daemon counts besides the machine's own counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PortCounters {
    pub rx: u64,
    pub tx: u64,
    pub malformed: u64,
    pub queue_drops: u64,
    pub send_errors: u64,
    pub down_events: u64,
    pub injected_drops: u64,
    /// Datagrams the kernel dropped because the port's receive buffer was full (`SO_RXQ_OVFL`:
    /// the socket's count, as of the last datagram received).
    pub rcvbuf_drops: u64,
}

struct Link {
    sock: UdpSocket,
    peer: SocketAddr,
    queue: VecDeque<Vec<u8>>,
    queued: u64,
    sndbuf: u64,
    down_until: Option<Instant>,
    c: PortCounters,
}

/// The running switch (exposed for tests of the loop's parts).
pub struct Daemon {
    m: Switch,
    links: Vec<Link>,
    /// The receive buffers (a datagram's and its control message's), kept between drains.
    rx: RxBufs,
    queue_cap: u64,
    /// --qdisc-load: the reader, each port's device, the last reading and when it was made.
    qdisc: Option<QdiscLoad>,
    down_for: Duration,
    start: Instant,
    /// --drop-rate as a threshold of a u64 draw, and its generator.
    drop_below: u64,
    rng: algorithms::sim::rng::Rng,
}

#[derive(Default)]
struct RxBufs {
    data: Vec<u8>,
    cmsg: Vec<u8>,
}

struct QdiscLoad {
    reader: crate::qdisc::QdiscReader,
    ifindex: Vec<Option<i32>>,
    last: HashMap<i32, crate::qdisc::Qdisc>,
    at: Option<Instant>,
}

fn outq(fd: i32) -> u64 {
    let mut n: libc::c_int = 0;
    // SIOCOUTQ is TIOCOUTQ's number on Linux. SAFETY: it writes one int through the pointer,
    // which is valid.
    let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n as *mut libc::c_int) };
    if r == 0 && n > 0 {
        n as u64
    } else {
        0
    }
}

fn sndbuf(fd: i32) -> u64 {
    let mut v: libc::c_int = 0;
    let mut l = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `l` bytes into `v`, both valid.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&mut v as *mut libc::c_int).cast(),
            &mut l,
        )
    };
    if r == 0 && v > 0 {
        v as u64
    } else {
        0
    }
}

/// Sets `sock`'s receive buffer to `bytes` (forced past `net.core.rmem_max` where the process
/// may, else as far as the limit allows); the size the kernel took (it doubles the request for
/// its bookkeeping).
pub fn grow_rcvbuf(sock: &UdpSocket, bytes: usize) -> usize {
    use nix::sys::socket::{getsockopt, setsockopt, sockopt};
    if setsockopt(sock, sockopt::RcvBufForce, &bytes).is_err() {
        let _ = setsockopt(sock, sockopt::RcvBuf, &bytes);
    }
    getsockopt(sock, sockopt::RcvBuf).unwrap_or(0)
}

impl Daemon {
    pub fn new(o: &SwitchOpts) -> Result<Daemon> {
        let mut specs = o.ports.clone();
        specs.sort_by_key(|p| p.port);
        for (i, p) in specs.iter().enumerate() {
            if p.port as usize != i {
                bail!(
                    "--port numbers must be 0, 1, ... without gaps or repeats (got {:?})",
                    specs.iter().map(|p| p.port).collect::<Vec<_>>()
                );
            }
        }
        let n = specs.len();
        for &u in &o.up {
            if u as usize >= n {
                bail!("--up {u}: no such port");
            }
        }
        let mut down = HashMap::new();
        for r in &o.routes {
            if r.port as usize >= n {
                bail!("--route {}={}: no such port", r.addr, r.port);
            }
            if down.insert(r.addr, r.port).is_some() {
                bail!("--route {}: given twice", r.addr);
            }
        }
        if o.slots == 0 {
            bail!("--slots must be at least 1");
        }
        let mut trees = HashMap::new();
        for t in &o.trees {
            if t.up.is_some_and(|u| u as usize >= n) || t.expected == 0 {
                bail!("--tree {}: no such port, or a count of 0", t.tree);
            }
            let rule = algorithms::canary::TreeRule {
                up: t.up,
                expected: t.expected,
            };
            if trees
                .insert((algorithms::canary::ANY_COLL, t.tree), rule)
                .is_some()
            {
                bail!("--tree {}: given twice", t.tree);
            }
        }
        let mut links = Vec::with_capacity(n);
        for p in &specs {
            let sock = UdpSocket::bind(p.local)
                .with_context(|| format!("port {}: binding {}", p.port, p.local))?;
            sock.connect(p.peer)
                .with_context(|| format!("port {}: connecting to {}", p.port, p.peer))?;
            sock.set_nonblocking(true)?;
            grow_rcvbuf(&sock, o.rcvbuf_kib * 1024);
            // The kernel's count of receive-buffer drops rides with each datagram.
            let _ = nix::sys::socket::setsockopt(&sock, nix::sys::socket::sockopt::RxqOvfl, &1);
            let sndbuf = sndbuf(sock.as_raw_fd());
            links.push(Link {
                sock,
                peer: p.peer,
                queue: VecDeque::new(),
                queued: 0,
                sndbuf,
                down_until: None,
                c: PortCounters::default(),
            });
        }
        let m = Switch::new(SwitchConfig {
            addr: o.addr,
            slots: o.slots,
            timeout: o.timeout_us * 1_000,
            hold: o.hold_ms * 1_000_000,
            up_ports: o.up.clone(),
            down,
            trees,
        });
        let qdisc = if o.qdisc_load {
            Some(QdiscLoad {
                reader: crate::qdisc::QdiscReader::new().context("--qdisc-load: rtnetlink")?,
                ifindex: specs
                    .iter()
                    .map(|p| crate::qdisc::ifindex_of(p.local.ip()))
                    .collect(),
                last: HashMap::new(),
                at: None,
            })
        } else {
            None
        };
        Ok(Daemon {
            m,
            links,
            rx: RxBufs {
                data: vec![0; MAX_DATA + 4096],
                cmsg: nix::cmsg_space!(u32),
            },
            qdisc,
            queue_cap: o.queue_kib * 1024,
            down_for: Duration::from_millis(o.down_ms),
            start: Instant::now(),
            drop_below: (o.drop_rate.clamp(0.0, 1.0) * u64::MAX as f64) as u64,
            rng: algorithms::sim::rng::Rng::new(o.seed.unwrap_or(o.addr as u64)),
        })
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn loads(&mut self) -> Vec<PortLoad> {
        let t = Instant::now();
        let cap = self.queue_cap;
        if let Some(q) = &mut self.qdisc {
            if q.at
                .is_none_or(|a| t.duration_since(a) >= Duration::from_micros(200))
            {
                if let Ok(m) = q.reader.read() {
                    q.last = m;
                }
                q.at = Some(t);
            }
        }
        let qdisc = self.qdisc.as_ref();
        self.links
            .iter_mut()
            .enumerate()
            .map(|(i, l)| {
                if l.down_until.is_some_and(|d| d <= t) {
                    l.down_until = None;
                }
                let dev = qdisc.and_then(|q| q.ifindex[i].and_then(|x| q.last.get(&x)));
                let (queued, capacity) = match dev {
                    // A shaped link: its queue is the tbf's; this switch's own packets in it
                    // are in its backlog too.
                    Some(&crate::qdisc::Qdisc {
                        backlog,
                        limit: Some(limit),
                        ..
                    }) => (backlog + l.queued, limit.max(1)),
                    Some(d) => (
                        d.backlog + outq(l.sock.as_raw_fd()) + l.queued,
                        l.sndbuf + cap,
                    ),
                    None => (outq(l.sock.as_raw_fd()) + l.queued, l.sndbuf + cap),
                };
                PortLoad {
                    queued,
                    capacity,
                    up: l.down_until.is_none(),
                }
            })
            .collect()
    }

    fn mark_down(&mut self, p: usize) {
        let l = &mut self.links[p];
        if l.down_until.is_none() {
            l.c.down_events += 1;
            tracing::info!(port = p, peer = %l.peer, "peer unreachable: port down");
        }
        l.down_until = Some(Instant::now() + self.down_for);
    }

    fn send(&mut self, p: usize, pkt: &Packet) {
        let bytes = pkt.encode();
        self.send_bytes(p, bytes);
    }

    fn send_bytes(&mut self, p: usize, bytes: Vec<u8>) {
        if self.drop_below > 0 && self.rng.next_u64() < self.drop_below {
            self.links[p].c.injected_drops += 1;
            return;
        }
        if !self.links[p].queue.is_empty() {
            self.enqueue(p, bytes);
            return;
        }
        // A pending ICMP error is reported by the first call, which sends nothing: retry once.
        for _ in 0..2 {
            match self.links[p].sock.send(&bytes) {
                Ok(_) => {
                    self.links[p].c.tx += 1;
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.enqueue(p, bytes);
                    return;
                }
                Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => self.mark_down(p),
                Err(e) => {
                    tracing::debug!(port = p, "send: {e}");
                    self.links[p].c.send_errors += 1;
                    return;
                }
            }
        }
        self.links[p].c.send_errors += 1;
    }

    fn enqueue(&mut self, p: usize, bytes: Vec<u8>) {
        let l = &mut self.links[p];
        if l.queued + bytes.len() as u64 > self.queue_cap {
            l.c.queue_drops += 1;
            return;
        }
        l.queued += bytes.len() as u64;
        l.queue.push_back(bytes);
    }

    fn flush_queue(&mut self, p: usize) {
        while let Some(b) = self.links[p].queue.front() {
            match self.links[p].sock.send(b) {
                Ok(_) => self.links[p].c.tx += 1,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    if e.raw_os_error() == Some(libc::ECONNREFUSED) {
                        self.mark_down(p);
                    }
                    self.links[p].c.send_errors += 1;
                }
            }
            let b = self.links[p].queue.pop_front().unwrap();
            self.links[p].queued -= b.len() as u64;
        }
    }

    fn emit(&mut self, out: Vec<(Port, Packet)>) {
        for (p, pkt) in out {
            if (p as usize) < self.links.len() {
                self.send(p as usize, &pkt);
            }
        }
    }

    /// Receives everything waiting on port `p` and feeds it to the machine.
    fn drain(&mut self, p: usize) {
        // Out of `self` while the machine, which borrows `self`, takes each datagram.
        let mut rx = std::mem::take(&mut self.rx);
        self.drain_into(p, &mut rx);
        self.rx = rx;
    }

    /// One datagram of port `p` into `rx`: its length, and the kernel's count of the socket's
    /// receive-buffer drops when it came with one.
    fn recv_counted(&self, p: usize, rx: &mut RxBufs) -> io::Result<(usize, Option<u32>)> {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        let mut iov = [io::IoSliceMut::new(&mut rx.data)];
        let m = recvmsg::<()>(
            self.links[p].sock.as_raw_fd(),
            &mut iov,
            Some(&mut rx.cmsg),
            MsgFlags::MSG_DONTWAIT,
        )
        .map_err(io::Error::from)?;
        let drops = m.cmsgs().ok().and_then(|mut c| {
            c.find_map(|c| match c {
                ControlMessageOwned::RxqOvfl(n) => Some(n),
                _ => None,
            })
        });
        Ok((m.bytes, drops))
    }

    fn drain_into(&mut self, p: usize, rx: &mut RxBufs) {
        loop {
            match self.recv_counted(p, rx) {
                Ok((n, drops)) => {
                    if let Some(d) = drops {
                        self.links[p].c.rcvbuf_drops = u64::from(d);
                    }
                    self.links[p].c.rx += 1;
                    self.links[p].down_until = None;
                    match Packet::decode(&rx.data[..n]) {
                        Ok(pkt) => {
                            let loads = self.loads();
                            let now = self.now();
                            let out = self.m.on_packet(now, p as Port, pkt, &loads);
                            self.emit(out);
                        }
                        Err(e) => {
                            tracing::debug!(port = p, "malformed datagram: {e}");
                            self.links[p].c.malformed += 1;
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => self.mark_down(p),
                Err(e) => {
                    tracing::debug!(port = p, "recv: {e}");
                    return;
                }
            }
        }
    }

    fn fire_timers(&mut self) {
        let now = self.now();
        if self.m.next_deadline().is_some_and(|d| d <= now) {
            let loads = self.loads();
            let out = self.m.on_timer(now, &loads);
            self.emit(out);
        }
    }

    /// The counters as JSON: the machine's, then per port.
    pub fn stats_json(&self) -> serde_json::Value {
        let s = self.m.stats();
        let ports: Vec<_> = self
            .links
            .iter()
            .enumerate()
            .map(|(i, l)| {
                serde_json::json!({
                    "port": i, "peer": l.peer.to_string(), "rx": l.c.rx, "tx": l.c.tx,
                    "malformed": l.c.malformed, "queue_drops": l.c.queue_drops,
                    "send_errors": l.c.send_errors, "down_events": l.c.down_events,
                    "injected_drops": l.c.injected_drops, "rcvbuf_drops": l.c.rcvbuf_drops,
                })
            })
            .collect();
        let sum = |f: fn(&PortCounters) -> u64| self.links.iter().map(|l| f(&l.c)).sum::<u64>();
        serde_json::json!({
            "addr": self.m.config().addr,
            "rx": sum(|c| c.rx), "tx": sum(|c| c.tx), "malformed": sum(|c| c.malformed),
            "queue_drops": sum(|c| c.queue_drops), "send_errors": sum(|c| c.send_errors),
            "injected_drops": sum(|c| c.injected_drops), "rcvbuf_drops": sum(|c| c.rcvbuf_drops),
            "aggregated": s.aggregated, "flushed": s.flushed, "stragglers": s.stragglers,
            "collisions": s.collisions, "bcasts": s.bcasts,
            "bcast_without_descriptor": s.bcast_without_descriptor, "restores": s.restores,
            "expired": s.expired, "unroutable": s.unroutable,
            "adaptive_choices": s.adaptive_choices, "occupied": self.m.occupied(),
            "ports": ports,
        })
    }
}

fn write_stats(path: &std::path::Path, v: &serde_json::Value) {
    let tmp = path.with_extension("tmp");
    if std::fs::write(&tmp, v.to_string()).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

/// Runs the switch until SIGINT/SIGTERM.
pub fn run(o: &SwitchOpts) -> Result<()> {
    let mut d = Daemon::new(o)?;
    let sig = crate::signals::SignalPipe::install().context("signal handlers")?;
    let sig_fd = sig.source();
    let sig_raw = *sig_fd.0;
    println!("READY switch addr={} ports={}", o.addr, d.links.len());
    use std::io::Write;
    let _ = io::stdout().flush();
    let mut sig = sig;
    let mut last_written: Option<serde_json::Value> = None;
    let mut last_write = Instant::now() - Duration::from_secs(1);
    loop {
        let mut fds: Vec<libc::pollfd> = d
            .links
            .iter()
            .map(|l| libc::pollfd {
                fd: l.sock.as_raw_fd(),
                events: libc::POLLIN | if l.queue.is_empty() { 0 } else { libc::POLLOUT },
                revents: 0,
            })
            .collect();
        fds.push(libc::pollfd {
            fd: sig_raw,
            events: libc::POLLIN,
            revents: 0,
        });
        // Wake for the machine's next deadline, and at least every 100 ms (stats file, ports
        // coming back up).
        let now = d.now();
        let wait =
            d.m.next_deadline()
                .map(|t| t.saturating_sub(now))
                .unwrap_or(u64::MAX)
                .min(100_000_000);
        let ts = libc::timespec {
            tv_sec: (wait / 1_000_000_000) as libc::time_t,
            tv_nsec: (wait % 1_000_000_000) as libc::c_long,
        };
        // SAFETY: `fds` is a valid array of its length; `ts` a valid timespec; no sigmask.
        let r = unsafe {
            libc::ppoll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                &ts,
                std::ptr::null(),
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e).context("ppoll");
            }
        }
        if fds.last().unwrap().revents != 0 && sig.drain() {
            break;
        }
        for (p, fd) in fds[..d.links.len()].iter().enumerate() {
            let rev = fd.revents;
            if rev & libc::POLLOUT != 0 {
                d.flush_queue(p);
            }
            if rev & (libc::POLLIN | libc::POLLERR) != 0 {
                d.drain(p);
            }
        }
        d.fire_timers();
        if let Some(path) = &o.stats_file {
            if last_write.elapsed() >= Duration::from_millis(100) {
                let v = d.stats_json();
                if last_written.as_ref() != Some(&v) {
                    write_stats(path, &v);
                    last_written = Some(v);
                }
                last_write = Instant::now();
            }
        }
    }
    let v = d.stats_json();
    if let Some(path) = &o.stats_file {
        write_stats(path, &v);
    }
    println!("STATS {v}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_and_route_specs_parse_and_refuse() {
        let p: PortSpec = "2=127.0.0.1:7000,127.0.0.2:7001".parse().unwrap();
        assert_eq!(p.port, 2);
        assert_eq!(p.local, "127.0.0.1:7000".parse().unwrap());
        assert_eq!(p.peer, "127.0.0.2:7001".parse().unwrap());
        assert!("2=127.0.0.1:7000".parse::<PortSpec>().is_err());
        assert!("x=127.0.0.1:7000,127.0.0.1:7001"
            .parse::<PortSpec>()
            .is_err());
        let r: RouteSpec = "1001=3".parse().unwrap();
        assert_eq!((r.addr, r.port), (1001, 3));
        assert!("1001".parse::<RouteSpec>().is_err());
    }
}
