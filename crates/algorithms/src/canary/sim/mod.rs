//! A packet-level discrete-event simulator of the paper's network (§5.2) driving the Canary
//! machines of this module: a two-level fat tree (by default 32 leaf switches with 32 hosts
//! and 32 up-ports each, 32 spines, 1024 hosts), 100 Gb/s links, up/down routing with the
//! paper's adaptive up-port choice for all traffic, per-port FIFO output queues, finite
//! buffers with lossless back-pressure for every packet.
//!
//! Four allreduces run on the same placements: the host ring (bandwidth-optimal, [17]), the
//! in-network allreduce on 1 or `k` static trees (blocks round-robin over the trees, each
//! rooted at a random spine, as the paper's baselines), and Canary. Every result is checked
//! against a reference computed here: host `h`'s element `j` is `a_h * g(j) + b_h` (wrapping
//! `u32`, `g` a hash), so the sum is `(Σa) * g(j) + Σb`, known without summing 1024 vectors;
//! each block a host receives is compared byte for byte on arrival.
//!
//! Background traffic: every host outside the allreduces sends messages of `bg_msg` bytes
//! back to back at line rate; message `k` of every such host goes by the `k`-th random
//! permutation of them (the paper's "each host sends a message to a randomly selected host
//! and receives a message from another randomly selected host", peers changing throughout);
//! [`BgPattern::Uniform`] draws every message's destination on its own instead, so hosts
//! may receive from several senders at once.
//!
//! Routing (§5.2, and SST merlin's `topo_fattree`, the simulator the paper modified): every
//! packet going up, background and ring included, takes the default up-port, the destination
//! modulo the number of spines (merlin's `dest % up_ports` at the bottom level), unless that
//! port's queue is more than half of `buffer`, then the up-port with the fewest queued bytes
//! (ties to the default); a spine has one port down to each leaf. Canary's switch applies
//! the same rule to its packets; a static tree's packets follow the tree.
//!
//! # Simplified against the paper (SST)
//! - Links are lossless with credit flow control (as SST's merlin): a port transmits only
//!   while the next switch holds less than `buffer` bytes received on that link; a packet
//!   gives its credit back when it leaves that switch. An allreduce packet absorbed into a
//!   descriptor gives it back at once; one the switch forwards, or whose arrival makes it
//!   send (a straggler, a unicast, the aggregate it completed, a broadcast's copies, which
//!   share it), holds it until that has left, like any other packet. Only the aggregates a
//!   switch's timer flushes hold none (they come out of descriptor memory). Congestion
//!   therefore shows as full queues and back-pressure, never as drops; packets are dropped
//!   only by the faults ([`Faults`]): a rate applied to Canary packets, a killed spine
//!   (everything sent to it is lost, its neighbours see the link down).
//! - Buffers are per input link (the credits); the output queues are not bounded by
//!   themselves (merlin has output buffers too, and input FIFOs with head-of-line blocking;
//!   here a packet waits in its output queue, holding its input link's credit). The
//!   occupancy the up-port choice reads (the "50 % of capacity") is the output queue's
//!   bytes against `buffer`. Two options bring the model closer to merlin's routers:
//!   `out_buf` (the rule reads queues capped at an output buffer) and `hol` (input FIFOs:
//!   a unicast packet waits at the head of its input until its output queue has room, and
//!   holds back what is behind it). Both are off by default; docs/BENCHMARKS.md N says what
//!   each changed.
//! - Hosts compute in zero time and the ring has no per-step set-up cost, so the ring's
//!   small-message runtime is latency only (the paper's ring pays a setup per phase).
//! - A switch aggregates at line rate in zero time; one hop costs serialisation plus
//!   `latency`. The static trees reuse the Canary switch with installed rules and no time
//!   window; their leader sends its data too (the root switch sees all `n`).
//! - A host's NIC has two send queues: what it sends as a leader (broadcasts, restorations,
//!   answers) goes before its queued data packets.
//! - Time is in whole nanoseconds (a 1081-byte packet takes 87 ns at 100 Gb/s).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use super::host::{BlockSource, Host, HostConfig, HostEvent};
use super::packet::{Head, Packet};
use super::switch::{PortLoad, Switch, SwitchConfig, TreeRule};
use super::{Addr, BlockId, Port};
use crate::allreduce::{Elem, Op, Reduce};
use crate::sim::rng::{splitmix64, Rng};
use crate::Nanos;

const SUM: Reduce = Reduce {
    op: Op::Sum,
    elem: Elem::U32,
};

mod config;
pub use config::{Algo, BgPattern, Faults, Job, JobReport, NetConfig, Report, Scenario};

// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Pkt {
    Canary(Packet),
    Ring {
        job: u32,
        dst: u32,
        step: u32,
        idx: u32,
        data: Vec<u8>,
    },
    Bg {
        dst: u32,
    },
}

impl Pkt {
    fn dst(&self) -> Option<u32> {
        match self {
            Pkt::Canary(_) => None,
            Pkt::Ring { dst, .. } | Pkt::Bg { dst } => Some(*dst),
        }
    }
}

struct QItem {
    pkt: Pkt,
    wire: u64,
    /// The link whose credit this packet holds, (node, port) of the sender, and how many
    /// bytes of it (a copy of a broadcast holds its share of the packet it came from).
    credit: Option<(u32, u16, u64)>,
}

/// What the up-port rule sees of a queue of `bytes` ([`NetConfig::out_buf`]).
fn sensed(bytes: u64, out_buf: Option<u64>) -> u64 {
    out_buf.map_or(bytes, |b| bytes.min(b))
}

struct PortQ {
    q: VecDeque<QItem>,
    bytes: u64,
    busy: bool,
    /// Bytes held in the peer's buffer, received on this link.
    credit_used: u64,
    peer: (u32, u16),
    /// The peer is a host (it absorbs at once: no credit limit).
    to_host: bool,
    sent_bytes: u64,
    /// Packets at the head of `q` that went in as priority (a host's leader packets).
    prio: usize,
}

enum Role {
    Idle,
    Bg {
        idx: usize,
        msg: usize,
        dst: u32,
        left: usize,
    },
    Member {
        job: usize,
        host: Box<Host>,
        src: Source,
        done: bool,
    },
    Ring(RingHost),
}

struct RingHost {
    job: usize,
    pos: usize,
    got: u64,
    total: u64,
    done: bool,
    src: Source,
}

struct Node {
    ports: Vec<PortQ>,
    /// Input FIFOs by port ([`NetConfig::hol`]; switches only): packets not yet taken.
    inq: Vec<VecDeque<QItem>>,
    /// Per input port: its head waits for room in an output queue.
    blocked: Vec<bool>,
    /// Per output port: the input ports whose heads wait for room in it.
    waiters: Vec<Vec<u16>>,
    loads: Vec<PortLoad>,
    switch: Option<Box<Switch>>,
    role: Role,
    alive: bool,
    timer: Option<Nanos>,
}

impl Node {
    /// A live, idle node with `ports`; a switch's every port starts with `load`, a host's
    /// (`None`) keeps no loads.
    fn new(ports: Vec<PortQ>, load: Option<PortLoad>, switch: Option<Switch>) -> Node {
        let loads = load.map_or_else(Vec::new, |l| vec![l; ports.len()]);
        Node {
            inq: vec![],
            blocked: vec![],
            waiters: vec![],
            loads,
            ports,
            switch: switch.map(Box::new),
            role: Role::Idle,
            alive: true,
            timer: None,
        }
    }
}

/// A host's input: `a * g(j) + b` for element `j`.
#[derive(Clone, Copy)]
struct Source {
    a: u32,
    b: u32,
    seed: u64,
}

fn g(seed: u64, j: usize) -> u32 {
    splitmix64(seed ^ (j as u64).wrapping_mul(0x9E37_79B9)) as u32
}

impl BlockSource for Source {
    fn fill(&self, offset: usize, out: &mut [u8]) {
        for (k, c) in out.chunks_exact_mut(4).enumerate() {
            let j = offset / 4 + k;
            c.copy_from_slice(
                &self
                    .a
                    .wrapping_mul(g(self.seed, j))
                    .wrapping_add(self.b)
                    .to_ne_bytes(),
            );
        }
    }
}

struct JobRef {
    seed: u64,
    a: u32,
    b: u32,
}

impl JobRef {
    fn matches(&self, offset: usize, data: &[u8]) -> bool {
        data.chunks_exact(4).enumerate().all(|(k, c)| {
            let j = offset / 4 + k;
            let want = self.a.wrapping_mul(g(self.seed, j)).wrapping_add(self.b);
            c == want.to_ne_bytes()
        })
    }
}

#[derive(PartialEq, Eq)]
enum Ev {
    TxDone { node: u32, port: u16 },
    Arrive { node: u32, port: u16 },
    Timer { node: u32 },
    Kill,
    Forge,
}

struct Item {
    t: Nanos,
    seq: u64,
    ev: Ev,
    pkt: Option<(Pkt, u64, u32, u16)>,
}

impl PartialEq for Item {
    fn eq(&self, o: &Self) -> bool {
        (self.t, self.seq) == (o.t, o.seq)
    }
}
impl Eq for Item {}
impl PartialOrd for Item {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Item {
    fn cmp(&self, o: &Self) -> Ordering {
        (o.t, o.seq).cmp(&(self.t, self.seq))
    }
}

struct Sim {
    net: NetConfig,
    nodes: Vec<Node>,
    heap: BinaryHeap<Item>,
    seq: u64,
    now: Nanos,
    events: u64,
    rng: Rng,
    faults: Faults,
    jobs: Vec<Job>,
    refs: Vec<JobRef>,
    reports: Vec<JobReport>,
    finished: Vec<usize>,
    bg: Vec<u32>,
    dropped: u64,
    coll_of_job: Vec<u32>,
    tags: Vec<u64>,
    perms: Vec<Vec<u32>>,
    /// Check the buffer accounting after every event ([`Sim::audit_buffers`]; tests).
    audit: bool,
    /// Input ports whose heads may move now (room came in the output they wait for).
    wake: Vec<(u32, u16)>,
    hol_waits: u64,
    hol_held: u64,
}

/// Run one scenario to the end (every member finished) or to `max_time`.
pub fn run(sc: &Scenario) -> Report {
    let mut sim = Sim::build(sc);
    sim.run();
    sim.report()
}

impl Sim {
    fn h(&self) -> u32 {
        self.net.hosts() as u32
    }
    fn leaf_node(&self, l: usize) -> u32 {
        self.h() + l as u32
    }
    fn spine_node(&self, s: usize) -> u32 {
        self.h() + self.net.leaves as u32 + s as u32
    }
    fn leaf_of(&self, host: u32) -> usize {
        host as usize / self.net.hosts_per_leaf
    }

    fn build(sc: &Scenario) -> Sim {
        let net = sc.net.clone();
        let (nh, nl, ns, hpl) = (net.hosts(), net.leaves, net.spines, net.hosts_per_leaf);
        let mut rng = Rng::new(sc.seed);
        let port = |peer: (u32, u16), to_host: bool| PortQ {
            q: VecDeque::new(),
            bytes: 0,
            busy: false,
            credit_used: 0,
            peer,
            to_host,
            sent_bytes: 0,
            prio: 0,
        };
        let load = PortLoad {
            queued: 0,
            capacity: net.out_buf.unwrap_or(net.buffer),
            up: true,
        };
        let mut nodes = Vec::with_capacity(nh + nl + ns);
        for h in 0..nh {
            let leaf = (nh + h / hpl) as u32;
            nodes.push(Node::new(
                vec![port((leaf, (h % hpl) as u16), false)],
                None,
                None,
            ));
        }
        // Static tree roots, per job and tree.
        let trees = match sc.algo {
            Algo::StaticTrees(k) => k as usize,
            _ => 0,
        };
        let roots: Vec<Vec<usize>> = sc
            .jobs
            .iter()
            .map(|_| {
                let mut s: Vec<usize> = (0..ns).collect();
                rng.shuffle(&mut s);
                (0..trees).map(|t| s[t % ns]).collect()
            })
            .collect();
        let colls: Vec<u32> = (0..sc.jobs.len() as u32).map(|j| 100 + j).collect();
        for l in 0..nl {
            let mut ports: Vec<PortQ> = (0..hpl)
                .map(|k| port(((l * hpl + k) as u32, 0), true))
                .collect();
            ports.extend((0..ns).map(|s| port(((nh + nl + s) as u32, l as u16), false)));
            let mut tr = HashMap::new();
            for (j, job) in sc.jobs.iter().enumerate() {
                let here = job
                    .members
                    .iter()
                    .filter(|&&m| m as usize / hpl == l)
                    .count() as u16;
                for (t, &r) in roots[j].iter().enumerate() {
                    tr.insert(
                        (colls[j], t as u8),
                        TreeRule {
                            up: Some((hpl + r) as Port),
                            expected: here,
                        },
                    );
                }
            }
            let sw = Switch::new(SwitchConfig {
                addr: (nh + l) as Addr,
                slots: net.slots,
                timeout: net.timeout,
                hold: net.hold,
                up_ports: (hpl..hpl + ns).map(|p| p as Port).collect(),
                // hosts below, and the spines' own addresses (targets of restorations)
                down: (0..hpl)
                    .map(|k| ((l * hpl + k) as Addr, k as Port))
                    .chain((0..ns).map(|s| ((nh + nl + s) as Addr, (hpl + s) as Port)))
                    .collect(),
                trees: tr,
            });
            nodes.push(Node::new(ports, Some(load), Some(sw)));
        }
        for s in 0..ns {
            let ports: Vec<PortQ> = (0..nl)
                .map(|l| port(((nh + l) as u32, (hpl + s) as u16), false))
                .collect();
            let mut tr = HashMap::new();
            for (j, job) in sc.jobs.iter().enumerate() {
                for (t, &r) in roots[j].iter().enumerate() {
                    if r == s {
                        tr.insert(
                            (colls[j], t as u8),
                            TreeRule {
                                up: None,
                                expected: job.members.len() as u16,
                            },
                        );
                    }
                }
            }
            let mut down: HashMap<Addr, Port> =
                (0..nh).map(|h| (h as Addr, (h / hpl) as Port)).collect();
            down.extend((0..nl).map(|l| ((nh + l) as Addr, l as Port)));
            let sw = Switch::new(SwitchConfig {
                addr: (nh + nl + s) as Addr,
                slots: net.slots,
                timeout: net.timeout,
                hold: net.hold,
                up_ports: vec![],
                down,
                trees: tr,
            });
            nodes.push(Node::new(ports, Some(load), Some(sw)));
        }
        let mut refs = Vec::new();
        let mut tags = Vec::new();
        for (j, job) in sc.jobs.iter().enumerate() {
            let seed = rng.next_u64();
            let tag = rng.next_u64() | 1;
            tags.push(tag);
            let (mut sa, mut sb) = (0u32, 0u32);
            for (i, &m) in job.members.iter().enumerate() {
                let src = Source {
                    a: rng.next_u64() as u32 | 1,
                    b: rng.next_u64() as u32,
                    seed,
                };
                sa = sa.wrapping_add(src.a);
                sb = sb.wrapping_add(src.b);
                let n = &mut nodes[m as usize];
                assert!(matches!(n.role, Role::Idle), "host {m} in two jobs");
                n.role = match sc.algo {
                    Algo::Ring => Role::Ring(RingHost {
                        job: j,
                        pos: i,
                        got: 0,
                        total: 0,
                        done: false,
                        src,
                    }),
                    _ => Role::Member {
                        job: j,
                        host: Box::new(Host::new(HostConfig {
                            coll: colls[j],
                            tag,
                            reduce: SUM,
                            members: job.members.clone(),
                            me: i,
                            len: job.len,
                            block_bytes: net.payload,
                            window: match sc.algo {
                                Algo::StaticTrees(_) => net.tree_window.unwrap_or(net.window),
                                _ => net.window,
                            },
                            static_trees: match sc.algo {
                                Algo::StaticTrees(k) => Some(k),
                                _ => None,
                            },
                            retx_timeout: net.retx_timeout,
                            max_requests: net.max_requests,
                            retx_backoff: 0,
                            restart_holdoff: net.restart_holdoff,
                            max_attempts: net.max_attempts,
                            wait_for_late: false,
                        })),
                        src,
                        done: false,
                    },
                };
            }
            refs.push(JobRef { seed, a: sa, b: sb });
        }
        for (idx, &b) in sc.background.iter().enumerate() {
            let n = &mut nodes[b as usize];
            assert!(
                matches!(n.role, Role::Idle),
                "background host {b} is a member"
            );
            n.role = Role::Bg {
                idx,
                msg: 0,
                dst: b,
                left: 0,
            };
        }
        for n in nodes.iter_mut().filter(|n| n.switch.is_some()) {
            let k = n.ports.len();
            n.inq = (0..k).map(|_| VecDeque::new()).collect();
            n.blocked = vec![false; k];
            n.waiters = vec![vec![]; k];
        }
        Sim {
            wake: vec![],
            hol_waits: 0,
            hol_held: 0,
            reports: vec![JobReport::default(); sc.jobs.len()],
            finished: vec![0; sc.jobs.len()],
            net,
            nodes,
            heap: BinaryHeap::new(),
            seq: 0,
            now: 0,
            events: 0,
            rng,
            faults: sc.faults.clone(),
            jobs: sc.jobs.clone(),
            refs,
            bg: sc.background.clone(),
            dropped: 0,
            coll_of_job: colls,
            tags,
            perms: Vec::new(),
            audit: false,
        }
    }

    fn push(&mut self, t: Nanos, ev: Ev, pkt: Option<(Pkt, u64, u32, u16)>) {
        self.seq += 1;
        self.heap.push(Item {
            t,
            seq: self.seq,
            ev,
            pkt,
        });
    }

    fn wire(&self, p: &Pkt) -> u64 {
        let payload = match p {
            Pkt::Canary(c) => c.data_len() + self.net.header,
            Pkt::Ring { data, .. } => data.len() + self.net.header,
            Pkt::Bg { .. } => self.net.payload + self.net.header,
        };
        payload as u64
    }

    fn ser(&self, bytes: u64) -> Nanos {
        (bytes * 8).div_ceil(self.net.gbps)
    }

    /// Queue a packet on an output port; `credit` is the link it holds a credit of.
    fn enqueue(&mut self, node: u32, port: u16, pkt: Pkt, credit: Option<(u32, u16, u64)>) {
        let wire = self.wire(&pkt);
        // A host's NIC sends what it does as a leader (broadcasts, answers) before its queued
        // data: two send queues, so a leader's broadcast does not wait behind its window.
        let prio = node < self.h()
            && matches!(&pkt, Pkt::Canary(p) if !matches!(p, Packet::Reduce { .. } | Packet::Retx { .. }));
        let n = &mut self.nodes[node as usize];
        let q = &mut n.ports[port as usize];
        if prio {
            q.q.insert(q.prio, QItem { pkt, wire, credit });
            q.prio += 1;
        } else {
            q.q.push_back(QItem { pkt, wire, credit });
        }
        q.bytes += wire;
        if let Some(l) = n.loads.get_mut(port as usize) {
            l.queued = sensed(q.bytes, self.net.out_buf);
        }
        self.try_send(node, port);
    }

    fn release(&mut self, credit: Option<(u32, u16, u64)>) {
        if let Some((n, p, bytes)) = credit {
            let q = &mut self.nodes[n as usize].ports[p as usize];
            assert!(q.credit_used >= bytes, "credit returned twice");
            q.credit_used -= bytes;
            self.try_send(n, p);
        }
    }

    fn try_send(&mut self, node: u32, port: u16) {
        let buffer = self.net.buffer;
        let n = &mut self.nodes[node as usize];
        if !n.alive {
            return;
        }
        let q = &mut n.ports[port as usize];
        if q.busy {
            return;
        }
        let Some(front) = q.q.front() else { return };
        if !q.to_host && q.credit_used + front.wire > buffer && q.credit_used > 0 {
            return;
        }
        let it = q.q.pop_front().unwrap();
        q.prio = q.prio.saturating_sub(1);
        q.bytes -= it.wire;
        q.busy = true;
        q.sent_bytes += it.wire;
        if !q.to_host {
            q.credit_used += it.wire;
        }
        let peer = q.peer;
        let room = q.bytes < self.net.out_buf.unwrap_or(buffer);
        if let Some(l) = n.loads.get_mut(port as usize) {
            l.queued = sensed(q.bytes, self.net.out_buf);
        }
        if room {
            if let Some(w) = n.waiters.get_mut(port as usize) {
                for ip in w.drain(..) {
                    n.blocked[ip as usize] = false;
                    self.wake.push((node, ip));
                }
            }
        }
        let ser = self.ser(it.wire);
        let now = self.now;
        self.release(it.credit);
        self.push(now + ser, Ev::TxDone { node, port }, None);
        let lat = self.net.latency;
        self.push(
            now + ser + lat,
            Ev::Arrive {
                node: peer.0,
                port: peer.1,
            },
            Some((it.pkt, it.wire, node, port)),
        );
    }

    fn schedule_timer(&mut self, node: u32) {
        let n = &self.nodes[node as usize];
        let d = match (&n.switch, &n.role) {
            (Some(s), _) => s.next_deadline(),
            (None, Role::Member { host, .. }) => host.next_deadline(),
            _ => None,
        };
        if let Some(d) = d {
            let d = d.max(self.now);
            if n.timer.is_none_or(|t| d < t) {
                self.nodes[node as usize].timer = Some(d);
                self.push(d, Ev::Timer { node }, None);
            }
        }
    }

    fn run(&mut self) {
        // start
        let nh = self.h();
        for h in 0..nh {
            self.start_host(h);
        }
        if let Some((_, t)) = self.faults.kill_spine {
            self.push(t, Ev::Kill, None);
        }
        if let Some(t) = self.faults.forge_at {
            self.push(t, Ev::Forge, None);
        }
        let total: usize = self.jobs.iter().map(|j| j.members.len()).sum();
        while let Some(it) = self.heap.pop() {
            if self.finished.iter().sum::<usize>() == total {
                break;
            }
            if it.t > self.net.max_time {
                break;
            }
            self.now = it.t;
            self.events += 1;
            match it.ev {
                Ev::TxDone { node, port } => {
                    self.nodes[node as usize].ports[port as usize].busy = false;
                    self.try_send(node, port);
                    if port == 0 && self.nodes[node as usize].switch.is_none() {
                        self.feed_bg(node);
                    }
                }
                Ev::Arrive { node, port } => {
                    let (pkt, wire, from, from_port) = it.pkt.unwrap();
                    self.arrive(node, port, pkt, wire, (from, from_port));
                }
                Ev::Timer { node } => {
                    if self.nodes[node as usize].timer != Some(it.t) {
                        continue;
                    }
                    self.nodes[node as usize].timer = None;
                    if !self.nodes[node as usize].alive {
                        continue;
                    }
                    self.timer(node);
                    self.schedule_timer(node);
                }
                Ev::Kill => self.kill(),
                Ev::Forge => self.forge(),
            }
            while let Some((node, port)) = self.wake.pop() {
                self.advance(node, port);
            }
            if self.audit {
                self.audit_buffers();
            }
        }
    }

    /// The finite-buffer rules hold: every link's used credit is exactly the bytes its
    /// packets still hold (in flight, or queued in the next switch, a broadcast's copies
    /// holding shares), never more than `buffer` (one larger packet alone excepted); and
    /// whatever a switch queues holds the credit of the link it came over, except the
    /// aggregates its timers flush (they come from descriptor memory, not from a buffer).
    fn audit_buffers(&self) {
        let mut held: HashMap<(u32, u16), u64> = HashMap::new();
        let cap = self.net.out_buf.unwrap_or(self.net.buffer);
        for (i, n) in self.nodes.iter().enumerate() {
            // Every input FIFO that holds packets waits, at its head, for an output that is
            // full and knows it waits (so a wake-up cannot be lost).
            for (p, q) in n.inq.iter().enumerate() {
                let Some(head) = q.front() else { continue };
                let p = p as u16;
                assert!(
                    n.alive || q.is_empty(),
                    "node {i}: a dead switch holds packets"
                );
                assert!(
                    head.pkt.dst().is_some() && n.blocked[p as usize],
                    "node {i} input {p}: its head could move and did not"
                );
                let w = n.waiters.iter().position(|w| w.contains(&p));
                let w = w.unwrap_or_else(|| {
                    panic!("node {i} input {p}: blocked, waiting for no output")
                });
                assert!(
                    n.ports[w].bytes >= cap,
                    "node {i} input {p}: waits for output {w}, which has room"
                );
            }
        }
        for n in &self.nodes {
            for it in n.inq.iter().flatten() {
                let (cn, cp, b) = it
                    .credit
                    .expect("a packet in an input FIFO holds its buffer");
                *held.entry((cn, cp)).or_default() += b;
            }
        }
        for (i, n) in self.nodes.iter().enumerate() {
            for q in &n.ports {
                for it in &q.q {
                    match it.credit {
                        Some((cn, cp, b)) => *held.entry((cn, cp)).or_default() += b,
                        None if n.switch.is_some() => assert!(
                            matches!(it.pkt, Pkt::Canary(Packet::Reduce { .. })),
                            "node {i}: a forwarded packet holds no input buffer"
                        ),
                        None => {}
                    }
                }
            }
        }
        for it in self.heap.iter() {
            if let (Ev::Arrive { .. }, Some((_, wire, from, port))) = (&it.ev, &it.pkt) {
                if !self.nodes[*from as usize].ports[*port as usize].to_host {
                    *held.entry((*from, *port)).or_default() += wire;
                }
            }
        }
        let largest = (self.net.payload + self.net.header) as u64 * 2;
        for (i, n) in self.nodes.iter().enumerate() {
            for (p, q) in n.ports.iter().enumerate() {
                if q.to_host {
                    continue;
                }
                let h = held.get(&(i as u32, p as u16)).copied().unwrap_or(0);
                assert_eq!(
                    q.credit_used, h,
                    "link ({i}, {p}): credit against bytes held"
                );
                assert!(
                    q.credit_used <= self.net.buffer.max(largest),
                    "link ({i}, {p})"
                );
            }
        }
    }

    fn start_host(&mut self, h: u32) {
        let now = self.now;
        let n = &mut self.nodes[h as usize];
        match &mut n.role {
            Role::Member { host, src, .. } => {
                let src = *src;
                let out = host.start(now, &src);
                for p in out {
                    self.enqueue(h, 0, Pkt::Canary(p), None);
                }
                self.member_events(h);
                self.schedule_timer(h);
            }
            Role::Ring(r) => {
                let (job, pos, src) = (r.job, r.pos, r.src);
                let n_members = self.jobs[job].members.len();
                let total = self.ring_total(job);
                if let Role::Ring(r) = &mut self.nodes[h as usize].role {
                    r.total = total;
                }
                if n_members == 1 {
                    self.ring_finish(h);
                    return;
                }
                // step 0: own chunk `pos`
                let c = pos;
                for idx in 0..self.ring_pkts(job, c) {
                    let data = self.ring_own(job, &src, c, idx);
                    let dst = self.jobs[job].members[(pos + 1) % n_members];
                    self.enqueue(
                        h,
                        0,
                        Pkt::Ring {
                            job: job as u32,
                            dst,
                            step: 0,
                            idx,
                            data,
                        },
                        None,
                    );
                }
            }
            Role::Bg { .. } => self.feed_bg(h),
            Role::Idle => {}
        }
    }

    fn feed_bg(&mut self, h: u32) {
        let payload = self.net.payload;
        let msg = self.net.bg_msg.max(payload);
        let nbg = self.bg.len() as u64;
        let Role::Bg {
            idx,
            msg: k,
            dst,
            left,
        } = self.nodes[h as usize].role
        else {
            return;
        };
        if !self.nodes[h as usize].ports[0].q.is_empty() || nbg < 2 {
            return;
        }
        let (mut d, mut l, mut k) = (dst, left, k);
        if l == 0 {
            d = self.bg_dest(idx, k);
            k += 1;
            l = msg.div_ceil(payload);
        }
        l -= 1;
        if let Role::Bg { dst, left, msg, .. } = &mut self.nodes[h as usize].role {
            *dst = d;
            *left = l;
            *msg = k;
        }
        self.enqueue(h, 0, Pkt::Bg { dst: d }, None);
    }

    /// The destination of message `k` of background host `idx` (an index into `self.bg`).
    fn bg_dest(&mut self, idx: usize, k: usize) -> u32 {
        let nbg = self.bg.len();
        debug_assert!(nbg >= 2, "a background host needs another to send to");
        if self.net.bg_pattern == BgPattern::Uniform {
            // Any other background host, drawn for this message alone.
            let o = self.rng.below(nbg as u64 - 1) as usize;
            return self.bg[if o >= idx { o + 1 } else { o }];
        }
        // Message `k` of every background host goes to the `k`-th random permutation of
        // them: each sends to one host and receives from one, peers change per message.
        while self.perms.len() <= k {
            let mut p: Vec<u32> = (0..nbg as u32).collect();
            self.rng.shuffle(&mut p);
            for i in 0..p.len() {
                if p[i] as usize == i {
                    let j = (i + 1) % p.len();
                    p.swap(i, j);
                }
            }
            self.perms.push(p);
        }
        self.bg[self.perms[k][idx] as usize]
    }

    fn kill(&mut self) {
        let (s, _) = self.faults.kill_spine.unwrap();
        let node = self.spine_node(s);
        self.nodes[node as usize].alive = false;
        for p in 0..self.nodes[node as usize].ports.len() {
            let n = &mut self.nodes[node as usize];
            let mut items: Vec<QItem> = n.ports[p].q.drain(..).collect();
            if let Some(q) = n.inq.get_mut(p) {
                items.extend(q.drain(..));
            }
            self.nodes[node as usize].ports[p].bytes = 0;
            self.nodes[node as usize].ports[p].prio = 0;
            for it in items {
                self.dropped += 1;
                self.release(it.credit);
            }
        }
        let hpl = self.net.hosts_per_leaf;
        for l in 0..self.net.leaves {
            let ln = self.leaf_node(l);
            self.nodes[ln as usize].loads[hpl + s].up = false;
        }
    }

    fn forge(&mut self) {
        // A host outside every job, else nothing to do.
        let Some(&h) = self.bg.first() else { return };
        for j in 0..self.jobs.len() {
            let coll = self.coll_of_job[j];
            let members = self.jobs[j].members.clone();
            let n = members.len();
            let len = self.jobs[j].len;
            let blocks = len.div_ceil(self.net.payload) as u32;
            let tag = self.tags[j] ^ 0xdead_beef;
            for b in 0..blocks.min(64) {
                let leader = members[b as usize % n];
                let blen = (len - b as usize * self.net.payload).min(self.net.payload);
                let head = Head {
                    id: BlockId {
                        coll,
                        block: b,
                        attempt: 0,
                    },
                    tag,
                    dst: leader,
                };
                let p = Packet::Reduce {
                    head,
                    counter: 1,
                    hosts: (n - 1).max(1) as u16,
                    reduce: SUM,
                    tree: None,
                    data: vec![0xAB; blen],
                };
                self.enqueue(h, 0, Pkt::Canary(p), None);
                let victim = members[(b as usize + 1) % n];
                let p = Packet::Result {
                    head: Head {
                        dst: victim,
                        ..head
                    },
                    data: vec![0xCD; blen],
                };
                self.enqueue(h, 0, Pkt::Canary(p), None);
                let p = Packet::Bcast {
                    head,
                    data: vec![0xEF; blen],
                };
                self.enqueue(h, 0, Pkt::Canary(p), None);
            }
        }
    }

    fn arrive(&mut self, node: u32, port: u16, pkt: Pkt, wire: u64, from: (u32, u16)) {
        // A link into a host holds no credit (the host absorbs at once).
        let credit = (!self.nodes[from.0 as usize].ports[from.1 as usize].to_host)
            .then_some((from.0, from.1, wire));
        if !self.nodes[node as usize].alive {
            self.dropped += 1;
            self.release(credit);
            return;
        }
        if let (Pkt::Canary(_), ppm) = (&pkt, self.faults.drop_ppm) {
            if ppm > 0 && self.rng.chance(ppm as u64, 1_000_000) {
                self.dropped += 1;
                self.release(credit);
                return;
            }
        }
        if self.nodes[node as usize].switch.is_some() {
            if self.net.hol {
                self.nodes[node as usize].inq[port as usize].push_back(QItem { pkt, wire, credit });
                self.advance(node, port);
                return;
            }
            self.take(node, port, pkt, wire, from, credit);
            return;
        }
        // a host
        self.host_in(node, pkt);
    }

    /// Moves the packets at the head of input `port` of switch `node` on ([`NetConfig::hol`])
    /// until one must wait for room in its output queue.
    fn advance(&mut self, node: u32, port: u16) {
        let cap = self.net.out_buf.unwrap_or(self.net.buffer);
        loop {
            let n = &self.nodes[node as usize];
            if !n.alive || n.blocked[port as usize] {
                return;
            }
            let Some(head) = n.inq[port as usize].front() else {
                return;
            };
            if let Some(dst) = head.pkt.dst() {
                if let Some(op) = self.route(node, dst) {
                    let n = &mut self.nodes[node as usize];
                    if n.ports[op as usize].bytes >= cap {
                        n.blocked[port as usize] = true;
                        n.waiters[op as usize].push(port);
                        self.hol_waits += 1;
                        let next = self.nodes[node as usize].inq[port as usize].get(1);
                        let next_dst = next.map(|it| it.pkt.dst());
                        let held = match next_dst {
                            None => false,
                            Some(None) => true,
                            Some(Some(d)) => self.route(node, d).is_some_and(|o| {
                                self.nodes[node as usize].ports[o as usize].bytes < cap
                            }),
                        };
                        self.hol_held += held as u64;
                        return;
                    }
                }
            }
            let it = self.nodes[node as usize].inq[port as usize]
                .pop_front()
                .unwrap();
            let from = self.nodes[node as usize].ports[port as usize].peer;
            self.take(node, port, it.pkt, it.wire, from, it.credit);
        }
    }

    /// Switch `node` takes `pkt`, which came in on `port` from `from`, holding `credit`: the
    /// switch machine's packets go through it, the others are routed.
    fn take(
        &mut self,
        node: u32,
        port: u16,
        pkt: Pkt,
        wire: u64,
        from: (u32, u16),
        credit: Option<(u32, u16, u64)>,
    ) {
        match pkt {
            Pkt::Canary(p) => {
                let now = self.now;
                let n = &mut self.nodes[node as usize];
                let out = n.switch.as_mut().unwrap().on_packet(now, port, p, &n.loads);
                // A packet absorbed into a descriptor frees its input buffer at once; one
                // that makes the switch send (a straggler, a unicast, the aggregate it
                // completed, the copies of a broadcast) holds it until what it caused has
                // left, shared among the copies, like any other packet (finite buffers).
                if out.is_empty() {
                    self.release(credit);
                }
                let k = out.len() as u64;
                for (i, (op, p)) in out.into_iter().enumerate() {
                    let i = i as u64;
                    let share = wire / k.max(1) + if i + 1 == k { wire % k.max(1) } else { 0 };
                    self.enqueue(node, op, Pkt::Canary(p), Some((from.0, from.1, share)));
                }
                self.schedule_timer(node);
            }
            other => {
                let dst = other.dst().unwrap();
                match self.route(node, dst) {
                    Some(op) => self.enqueue(node, op, other, credit),
                    None => {
                        self.dropped += 1;
                        self.release(credit);
                    }
                }
            }
        }
    }

    fn host_in(&mut self, node: u32, pkt: Pkt) {
        match pkt {
            Pkt::Canary(p) => {
                let now = self.now;
                if let Role::Member { host, src, .. } = &mut self.nodes[node as usize].role {
                    let src = *src;
                    let out = host.on_packet(now, p, &src);
                    for p in out {
                        self.enqueue(node, 0, Pkt::Canary(p), None);
                    }
                    self.member_events(node);
                    self.schedule_timer(node);
                }
            }
            Pkt::Ring {
                job,
                step,
                idx,
                data,
                ..
            } => self.ring_recv(node, job as usize, step, idx, data),
            Pkt::Bg { .. } => {}
        }
    }

    fn timer(&mut self, node: u32) {
        let now = self.now;
        let n = &mut self.nodes[node as usize];
        if let Some(sw) = n.switch.as_mut() {
            let out = sw.on_timer(now, &n.loads);
            for (op, p) in out {
                self.enqueue(node, op, Pkt::Canary(p), None);
            }
        } else if let Role::Member { host, src, .. } = &mut n.role {
            let src = *src;
            let out = host.on_timer(now, &src);
            for p in out {
                self.enqueue(node, 0, Pkt::Canary(p), None);
            }
            self.member_events(node);
        }
    }

    fn member_events(&mut self, node: u32) {
        let now = self.now;
        let Role::Member {
            job, host, done, ..
        } = &mut self.nodes[node as usize].role
        else {
            return;
        };
        let j = *job;
        while let Some(e) = host.poll_event() {
            match e {
                HostEvent::Block { offset, data, .. } => {
                    let r = &mut self.reports[j];
                    r.checked_bytes += data.len() as u64;
                    if !self.refs[j].matches(offset, &data) {
                        r.wrong_blocks += 1;
                    }
                }
                HostEvent::Done => {
                    if !*done {
                        *done = true;
                        self.reports[j].ok_hosts += 1;
                        self.reports[j].runtime = self.reports[j].runtime.max(now);
                        self.finished[j] += 1;
                    }
                }
                HostEvent::Failed(e) => {
                    if !*done {
                        *done = true;
                        self.reports[j].failed.push((node, e));
                        self.reports[j].runtime = self.reports[j].runtime.max(now);
                        self.finished[j] += 1;
                    }
                }
            }
        }
    }

    /// Up/down routing for packets the switch machine does not handle.
    fn route(&mut self, node: u32, dst: u32) -> Option<u16> {
        let (nh, hpl, ns) = (self.h(), self.net.hosts_per_leaf, self.net.spines);
        if node < nh + self.net.leaves as u32 {
            let l = (node - nh) as usize;
            if self.leaf_of(dst) == l {
                return Some((dst as usize % hpl) as u16);
            }
            let n = &self.nodes[node as usize];
            let def = hpl + (dst as u64 % ns as u64) as usize;
            let ld = n.loads[def];
            if ld.up && (ld.queued * 2 <= ld.capacity || !self.net.unicast_adaptive) {
                return Some(def as u16);
            }
            (hpl..hpl + ns)
                .filter(|&p| n.loads[p].up)
                .min_by_key(|&p| (n.loads[p].queued, p != def))
                .map(|p| p as u16)
        } else {
            Some(self.leaf_of(dst) as u16)
        }
    }

    // ---- ring ----

    fn ring_chunk(&self, job: usize, c: usize) -> std::ops::Range<usize> {
        let n = self.jobs[job].members.len();
        let len = self.jobs[job].len;
        let cs = len.div_ceil(n).div_ceil(4) * 4;
        let lo = (c * cs).min(len);
        lo..((c + 1) * cs).min(len)
    }

    fn ring_pkts(&self, job: usize, c: usize) -> u32 {
        self.ring_chunk(job, c)
            .len()
            .div_ceil(self.net.payload)
            .max(1) as u32
    }

    fn ring_total(&self, job: usize) -> u64 {
        let n = self.jobs[job].members.len();
        (0..n).map(|c| self.ring_pkts(job, c) as u64).sum()
    }

    fn ring_range(&self, job: usize, c: usize, idx: u32) -> std::ops::Range<usize> {
        let r = self.ring_chunk(job, c);
        let lo = (r.start + idx as usize * self.net.payload).min(r.end);
        lo..(lo + self.net.payload).min(r.end)
    }

    fn ring_own(&self, job: usize, src: &Source, c: usize, idx: u32) -> Vec<u8> {
        let r = self.ring_range(job, c, idx);
        let mut v = vec![0; r.len()];
        src.fill(r.start, &mut v);
        v
    }

    fn ring_recv(&mut self, node: u32, job: usize, step: u32, idx: u32, mut data: Vec<u8>) {
        let Role::Ring(r) = &self.nodes[node as usize].role else {
            return;
        };
        let (pos, src) = (r.pos, r.src);
        let n = self.jobs[job].members.len();
        let pred = (pos + n - 1) % n;
        let c = (pred + n - (step as usize % n)) % n;
        let succ = self.jobs[job].members[(pos + 1) % n];
        let s = step as usize;
        let range = self.ring_range(job, c, idx);
        let mut check = false;
        let next = if s < n - 1 {
            let own = self.ring_own(job, &src, c, idx);
            for (a, b) in data.chunks_exact_mut(4).zip(own.chunks_exact(4)) {
                let v = u32::from_ne_bytes(a.try_into().unwrap())
                    .wrapping_add(u32::from_ne_bytes(b.try_into().unwrap()));
                a.copy_from_slice(&v.to_ne_bytes());
            }
            if s == n - 2 {
                check = true;
            }
            Some(s + 1)
        } else {
            check = true;
            if s < 2 * n - 3 {
                Some(s + 1)
            } else {
                None
            }
        };
        if check {
            let rep = &mut self.reports[job];
            rep.checked_bytes += data.len() as u64;
            if !self.refs[job].matches(range.start, &data) {
                rep.wrong_blocks += 1;
            }
            if let Role::Ring(r) = &mut self.nodes[node as usize].role {
                r.got += 1;
            }
        }
        if let Some(ns) = next {
            self.enqueue(
                node,
                0,
                Pkt::Ring {
                    job: job as u32,
                    dst: succ,
                    step: ns as u32,
                    idx,
                    data,
                },
                None,
            );
        }
        if let Role::Ring(r) = &self.nodes[node as usize].role {
            if r.got == r.total {
                self.ring_finish(node);
            }
        }
    }

    fn ring_finish(&mut self, node: u32) {
        let now = self.now;
        if let Role::Ring(r) = &mut self.nodes[node as usize].role {
            if !r.done {
                r.done = true;
                let j = r.job;
                self.reports[j].ok_hosts += 1;
                self.reports[j].runtime = self.reports[j].runtime.max(now);
                self.finished[j] += 1;
            }
        }
    }

    fn report(mut self) -> Report {
        let total: usize = self.jobs.iter().map(|j| j.members.len()).sum();
        let hung = self.finished.iter().sum::<usize>() < total;
        for (j, r) in self.reports.iter_mut().enumerate() {
            r.unfinished = self.jobs[j].members.len() - self.finished[j];
            r.goodput_gbps = if r.runtime > 0 {
                self.jobs[j].len as f64 * 8.0 / r.runtime as f64
            } else {
                0.0
            };
        }
        let mut rep = Report {
            jobs: std::mem::take(&mut self.reports),
            events: self.events,
            end: self.now,
            hung,
            dropped: self.dropped,
            hol_waits: self.hol_waits,
            hol_held: self.hol_held,
            ..Report::default()
        };
        for n in &self.nodes {
            if let Some(s) = &n.switch {
                rep.switches.absorb(&s.stats());
            }
            if let Role::Member { host, .. } = &n.role {
                rep.hosts.absorb(&host.stats());
            }
            for p in &n.ports {
                rep.link_bytes += p.sent_bytes;
                rep.links += 1;
            }
        }
        rep
    }
}

#[cfg(test)]
mod tests;
