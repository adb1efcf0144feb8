//! A Canary host (paper §3.1.3–§3.1.4, §3.3): the sender of its own vector and the leader of
//! the blocks assigned to it, in one object, since every member is both.
//!
//! **Sender.** The vector is cut into blocks of `block_bytes` (one packet each, §3.1.3);
//! block `b` is led by `members[b % n]` (each block its own root, §3.1.3), so the leader's
//! address is the packet's destination. At most `window` blocks are in flight; each has a
//! timer (`retx_timeout`); when it fires the host sends a retransmission request ([`Packet::Retx`])
//! to the block's leader, waiting longer after each unanswered one (`retx_backoff`); after
//! `max_requests` unanswered requests it fails the allreduce
//! ([`HostError::LeaderUnreachable`]) rather than wait for ever. A [`Packet::Restart`] makes it
//! send the block again under the new attempt (once per attempt).
//!
//! **Leader.** It does not send its own data: it sums the counters of the reduce and collided
//! packets of the current attempt; at `n - 1` it reduces its own data in, sends the block down
//! ([`Packet::Bcast`]) and a [`Packet::Restore`] to every switch that reported a collision.
//! A counter above `n - 1` (a duplicate) restarts the block; a retransmission request is
//! answered with the result if complete, with the current attempt if the requester is behind,
//! and otherwise restarts the block (at most once per `restart_holdoff`, §3.3: the leader
//! cannot know which contribution was lost). After `max_attempts` attempts it aborts the
//! block: [`Packet::Abort`] to everyone, and every host reports [`HostError::Aborted`]. A
//! failed switch is only loss to it (§3.3).
//!
//! **Static trees** (`static_trees: Some(k)`, the baselines): block `b` names tree `b % k`
//! and the leader sends its own data as well (the tree's root switch aggregates all `n`, as
//! SHARP's root does), so the count to reach is `n`; the rest is the same.
//!
//! # Driving it
//! [`Host::start`] once, then [`Host::on_packet`] for every packet addressed to this host and
//! [`Host::on_timer`] at [`Host::next_deadline`]; each returns the packets to send (all on
//! the host's one port). [`Host::poll_event`] yields each block's result once, then
//! [`HostEvent::Done`] or a [`HostEvent::Failed`]. The input vector is read through a
//! [`BlockSource`] on every call that may send (the first send, a restart, the leader's own
//! contribution), so it must not change during the allreduce.
//!
//! # Simplified against the paper
//! - The host falls back to nothing after too many attempts: it fails (the paper falls back
//!   to a host-based reduction of that block).
//! - The leader keeps its results until the object is dropped (the paper frees them at the
//!   next allreduce or an explicit completion notice).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

use super::packet::{Head, Packet};
use super::{Addr, BlockId, Port};
use crate::allreduce::{reduce_into, Reduce};
use crate::Nanos;

/// One host's part in one allreduce.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// The allreduce's id (unique among concurrent ones, §3.4).
    pub coll: u32,
    /// The job's secret tag (see [`Head::tag`]).
    pub tag: u64,
    pub reduce: Reduce,
    /// Addresses of all members, the same list on every member.
    pub members: Vec<Addr>,
    /// This host's index in `members`.
    pub me: usize,
    /// Bytes of the vector (whole elements).
    pub len: usize,
    /// Bytes per block (one packet; whole elements).
    pub block_bytes: usize,
    /// Blocks in flight per host.
    pub window: usize,
    /// `None`: Canary. `Some(k)`: `k` static trees, block `b` on tree `b % k` (the baselines).
    pub static_trees: Option<u8>,
    pub retx_timeout: Nanos,
    pub max_requests: u32,
    /// The wait after the `k`-th unanswered request is `retx_timeout << min(k, retx_backoff)`:
    /// on a congested link the requests and the answers queue and drop too, and a constant
    /// timeout gave up on live leaders (TCP backs its timeout off for the same reason). 0: a
    /// constant timeout (the paper's behaviour, the simulator's).
    pub retx_backoff: u32,
    pub restart_holdoff: Nanos,
    pub max_attempts: u16,
    /// Members may start late (MPI ranks arrive when they arrive; not the paper's setting):
    /// a leader answers a request it will not restart the block for yet with
    /// [`Packet::Wait`] rather than ignoring it, a block's `k`-th restart waits
    /// `restart_holdoff << min(k, 6)` after the one before, and a [`Packet::Wait`] makes a
    /// member wait `4 * retx_timeout` before it asks again, its count of unanswered requests
    /// started again. `false`: the paper's behaviour (the simulator's).
    pub wait_for_late: bool,
}

impl HostConfig {
    pub fn blocks(&self) -> u32 {
        self.len.div_ceil(self.block_bytes) as u32
    }

    pub fn leader_of(&self, block: u32) -> usize {
        block as usize % self.members.len()
    }

    /// Byte range of a block in the vector.
    pub fn range(&self, block: u32) -> std::ops::Range<usize> {
        let lo = block as usize * self.block_bytes;
        lo..(lo + self.block_bytes).min(self.len)
    }
}

/// Where the host reads its input from.
pub trait BlockSource {
    /// Fill `out` with the vector's bytes at `offset..offset + out.len()`.
    fn fill(&self, offset: usize, out: &mut [u8]);
}

impl BlockSource for Vec<u8> {
    fn fill(&self, offset: usize, out: &mut [u8]) {
        out.copy_from_slice(&self[offset..offset + out.len()]);
    }
}

impl BlockSource for &[u8] {
    fn fill(&self, offset: usize, out: &mut [u8]) {
        out.copy_from_slice(&self[offset..offset + out.len()]);
    }
}

/// Why the allreduce failed on this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostError {
    /// The block's leader gave it up after `max_attempts`.
    Aborted { block: u32 },
    /// `max_requests` retransmission requests went unanswered.
    LeaderUnreachable { block: u32 },
}

impl core::fmt::Display for HostError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            HostError::Aborted { block } => write!(
                f,
                "block {block} aborted by its leader after too many attempts"
            ),
            HostError::LeaderUnreachable { block } => {
                write!(f, "leader of block {block} unreachable")
            }
        }
    }
}

/// What the host reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostEvent {
    /// The reduced bytes of `block` (at `offset` of the vector), once per block.
    Block {
        block: u32,
        offset: usize,
        data: Vec<u8>,
    },
    /// Every block arrived.
    Done,
    Failed(HostError),
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostStats {
    pub sent: u64,
    pub retx_requests: u64,
    pub resends: u64,
    pub restarts: u64,
    pub results_resent: u64,
    pub ignored: u64,
    pub collided_in: u64,
}

impl HostStats {
    /// Adds `o`'s counters into these (totals over many hosts).
    pub fn absorb(&mut self, o: &HostStats) {
        let HostStats {
            sent,
            retx_requests,
            resends,
            restarts,
            results_resent,
            ignored,
            collided_in,
        } = *o;
        self.sent += sent;
        self.retx_requests += retx_requests;
        self.resends += resends;
        self.restarts += restarts;
        self.results_resent += results_resent;
        self.ignored += ignored;
        self.collided_in += collided_in;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Send {
    Pending,
    Waiting {
        requests: u32,
        deadline: Nanos,
    },
    /// Led by this host: the result comes from the leader part.
    Local,
    Done,
}

#[derive(Clone, Debug)]
struct Led {
    attempt: u16,
    counter: u16,
    acc: Option<Vec<u8>>,
    collided: Vec<(Addr, Port)>,
    started: Nanos,
    result: Option<Vec<u8>>,
    failed: bool,
}

/// One member of a Canary allreduce; see the module docs.
#[derive(Debug)]
pub struct Host {
    cfg: HostConfig,
    send: Vec<Send>,
    attempt: Vec<u16>,
    next: u32,
    in_flight: usize,
    remaining: u32,
    timers: BinaryHeap<Reverse<(Nanos, u32)>>,
    led: BTreeMap<u32, Led>,
    events: VecDeque<HostEvent>,
    failed: bool,
    /// `Done` was queued (once: a packet after it must not queue it again).
    done: bool,
    stats: HostStats,
}

impl Host {
    pub fn new(cfg: HostConfig) -> Host {
        let n = cfg.members.len();
        assert!(
            n >= 1 && cfg.me < n && n <= u16::MAX as usize + 1,
            "members"
        );
        assert!(cfg.block_bytes > 0 && cfg.block_bytes.is_multiple_of(cfg.reduce.elem.size()));
        assert!(
            cfg.block_bytes <= super::packet::MAX_DATA
                && cfg.len.is_multiple_of(cfg.reduce.elem.size())
        );
        assert!(cfg.reduce.is_valid() && cfg.window > 0);
        let nb = cfg.blocks();
        let led = (0..nb)
            .filter(|&b| cfg.leader_of(b) == cfg.me)
            .map(|b| {
                (
                    b,
                    Led {
                        attempt: 0,
                        counter: 0,
                        acc: None,
                        collided: Vec::new(),
                        started: 0,
                        result: None,
                        failed: false,
                    },
                )
            })
            .collect();
        Host {
            send: vec![Send::Pending; nb as usize],
            attempt: vec![0; nb as usize],
            next: 0,
            in_flight: 0,
            remaining: nb,
            timers: BinaryHeap::new(),
            led,
            events: VecDeque::new(),
            failed: false,
            done: false,
            stats: HostStats::default(),
            cfg,
        }
    }

    pub fn config(&self) -> &HostConfig {
        &self.cfg
    }

    pub fn stats(&self) -> HostStats {
        self.stats
    }

    fn addr(&self) -> Addr {
        self.cfg.members[self.cfg.me]
    }

    /// Hosts that send each block: all but the leader under Canary; all, the leader too,
    /// on static trees (the tree's root switch sees every contribution, as in SHARP).
    fn senders(&self) -> u16 {
        let n = self.cfg.members.len();
        (if self.leader_sends() { n } else { n - 1 }) as u16
    }

    fn leader_sends(&self) -> bool {
        self.cfg.static_trees.is_some()
    }

    fn head(&self, block: u32, attempt: u16, dst: Addr) -> Head {
        Head {
            id: BlockId {
                coll: self.cfg.coll,
                block,
                attempt,
            },
            tag: self.cfg.tag,
            dst,
        }
    }

    /// Begin: send the first window of blocks.
    pub fn start(&mut self, now: Nanos, src: &dyn BlockSource) -> Vec<Packet> {
        let mut out = Vec::new();
        if self.cfg.members.len() == 1 && !self.leader_sends() {
            let blocks: Vec<u32> = self.led.keys().copied().collect();
            for b in blocks {
                self.send[b as usize] = Send::Local;
                self.complete(b, src, &mut out);
            }
        }
        self.pump(now, src, &mut out);
        self.check_done();
        out
    }

    /// The earliest time `on_timer` has work (possibly early).
    pub fn next_deadline(&self) -> Option<Nanos> {
        if self.failed {
            return None;
        }
        self.timers.peek().map(|Reverse((t, _))| *t)
    }

    pub fn poll_event(&mut self) -> Option<HostEvent> {
        self.events.pop_front()
    }

    /// True once [`HostEvent::Done`] or [`HostEvent::Failed`] was queued.
    pub fn finished(&self) -> bool {
        self.failed || self.remaining == 0
    }

    pub fn on_timer(&mut self, now: Nanos, src: &dyn BlockSource) -> Vec<Packet> {
        let mut out = Vec::new();
        while let Some(&Reverse((t, b))) = self.timers.peek() {
            if t > now || self.failed {
                break;
            }
            self.timers.pop();
            let Send::Waiting { requests, deadline } = self.send[b as usize] else {
                continue;
            };
            if deadline != t {
                continue;
            }
            if requests >= self.cfg.max_requests {
                self.fail(HostError::LeaderUnreachable { block: b });
                break;
            }
            let deadline =
                now + (self.cfg.retx_timeout << (requests + 1).min(self.cfg.retx_backoff));
            self.send[b as usize] = Send::Waiting {
                requests: requests + 1,
                deadline,
            };
            self.timers.push(Reverse((deadline, b)));
            let leader = self.cfg.members[self.cfg.leader_of(b)];
            self.stats.retx_requests += 1;
            if leader == self.addr() {
                // Our own block on a static tree: ask ourselves.
                self.retx(now, b, self.attempt[b as usize], leader, src, &mut out);
                continue;
            }
            out.push(Packet::Retx {
                head: self.head(b, self.attempt[b as usize], leader),
                host: self.addr(),
            });
        }
        self.pump(now, src, &mut out);
        out
    }

    /// Handle one packet addressed to this host (a foreign or malformed one is ignored).
    pub fn on_packet(&mut self, now: Nanos, pkt: Packet, src: &dyn BlockSource) -> Vec<Packet> {
        let mut out = Vec::new();
        let h = *pkt.head();
        let b = h.id.block;
        if h.id.coll != self.cfg.coll || h.tag != self.cfg.tag || b >= self.cfg.blocks() {
            self.stats.ignored += 1;
            return out;
        }
        let blen = self.cfg.range(b).len();
        match pkt {
            Packet::Reduce {
                counter,
                hosts,
                reduce,
                data,
                ..
            } => self.contribution(
                now,
                b,
                h.id.attempt,
                counter,
                hosts,
                reduce,
                data,
                None,
                src,
                &mut out,
            ),
            Packet::Collided {
                counter,
                hosts,
                reduce,
                switch,
                port,
                data,
                ..
            } => {
                self.stats.collided_in += 1;
                self.contribution(
                    now,
                    b,
                    h.id.attempt,
                    counter,
                    hosts,
                    reduce,
                    data,
                    Some((switch, port)),
                    src,
                    &mut out,
                )
            }
            Packet::Retx { host, .. } if host != self.addr() => {
                self.retx(now, b, h.id.attempt, host, src, &mut out)
            }
            Packet::Bcast { data, .. } | Packet::Result { data, .. } if data.len() == blen => {
                self.result(b, data);
            }
            Packet::Restart { .. } => {
                let a = h.id.attempt;
                if self.cfg.leader_of(b) != self.cfg.me && a > self.attempt[b as usize] {
                    self.attempt[b as usize] = a;
                    if let Send::Waiting { .. } = self.send[b as usize] {
                        self.stats.resends += 1;
                        let deadline = now + self.cfg.retx_timeout;
                        self.send[b as usize] = Send::Waiting {
                            requests: 0,
                            deadline,
                        };
                        self.timers.push(Reverse((deadline, b)));
                        out.push(self.reduce_packet(b, src));
                    }
                } else {
                    self.stats.ignored += 1;
                }
            }
            Packet::Abort { .. } => self.fail(HostError::Aborted { block: b }),
            Packet::Wait { .. } if self.cfg.wait_for_late => {
                if let Send::Waiting { .. } = self.send[b as usize] {
                    let deadline = now + 4 * self.cfg.retx_timeout;
                    self.send[b as usize] = Send::Waiting {
                        requests: 0,
                        deadline,
                    };
                    self.timers.push(Reverse((deadline, b)));
                }
            }
            _ => self.stats.ignored += 1,
        }
        self.pump(now, src, &mut out);
        self.check_done();
        out
    }

    fn reduce_packet(&mut self, b: u32, src: &dyn BlockSource) -> Packet {
        let r = self.cfg.range(b);
        let mut data = vec![0; r.len()];
        src.fill(r.start, &mut data);
        let leader = self.cfg.members[self.cfg.leader_of(b)];
        self.stats.sent += 1;
        Packet::Reduce {
            head: self.head(b, self.attempt[b as usize], leader),
            counter: 1,
            hosts: self.senders(),
            reduce: self.cfg.reduce,
            tree: self.cfg.static_trees.map(|k| (b % k as u32) as u8),
            data,
        }
    }

    fn pump(&mut self, now: Nanos, src: &dyn BlockSource, out: &mut Vec<Packet>) {
        while !self.failed && self.in_flight < self.cfg.window && self.next < self.cfg.blocks() {
            let b = self.next;
            self.next += 1;
            if self.send[b as usize] != Send::Pending {
                continue;
            }
            if self.cfg.leader_of(b) == self.cfg.me && !self.leader_sends() {
                self.send[b as usize] = Send::Local;
                continue;
            }
            let deadline = now + self.cfg.retx_timeout;
            self.send[b as usize] = Send::Waiting {
                requests: 0,
                deadline,
            };
            self.timers.push(Reverse((deadline, b)));
            self.in_flight += 1;
            let p = self.reduce_packet(b, src);
            out.push(p);
        }
    }

    fn result(&mut self, b: u32, data: Vec<u8>) {
        match self.send[b as usize] {
            Send::Done => self.stats.ignored += 1,
            s => {
                if let Send::Waiting { .. } = s {
                    self.in_flight -= 1;
                }
                self.send[b as usize] = Send::Done;
                self.remaining -= 1;
                if !self.failed {
                    self.events.push_back(HostEvent::Block {
                        block: b,
                        offset: self.cfg.range(b).start,
                        data,
                    });
                }
            }
        }
    }

    fn check_done(&mut self) {
        if self.remaining == 0 && !self.failed && !self.done {
            self.done = true;
            self.events.push_back(HostEvent::Done);
        }
    }

    fn fail(&mut self, e: HostError) {
        if !self.failed && self.remaining > 0 {
            self.failed = true;
            self.events.push_back(HostEvent::Failed(e));
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn contribution(
        &mut self,
        now: Nanos,
        b: u32,
        attempt: u16,
        counter: u16,
        hosts: u16,
        reduce: Reduce,
        data: Vec<u8>,
        collided: Option<(Addr, Port)>,
        src: &dyn BlockSource,
        out: &mut Vec<Packet>,
    ) {
        let senders = self.senders();
        let blen = self.cfg.range(b).len();
        let ok_shape = hosts == senders && reduce == self.cfg.reduce && data.len() == blen;
        let Some(led) = self.led.get_mut(&b) else {
            self.stats.ignored += 1;
            return;
        };
        if !ok_shape || led.failed || led.result.is_some() || attempt != led.attempt {
            self.stats.ignored += 1;
            return;
        }
        if led.counter as u32 + counter as u32 > senders as u32 {
            // More contributions than senders: a duplicate reached us. Start over.
            self.restart(now, b, out, src);
            return;
        }
        led.counter += counter;
        match &mut led.acc {
            None => led.acc = Some(data),
            Some(acc) => reduce_into(reduce, acc, &data).expect("checked shape"),
        }
        if let Some(c) = collided {
            led.collided.push(c);
        }
        if led.counter == senders {
            self.complete(b, src, out);
        }
    }

    /// All `n - 1` contributions are in: add ours, broadcast, restore collided subtrees.
    fn complete(&mut self, b: u32, src: &dyn BlockSource, out: &mut Vec<Packet>) {
        let r = self.cfg.range(b);
        let mut own = vec![0; r.len()];
        src.fill(r.start, &mut own);
        let reduce = self.cfg.reduce;
        let me = self.addr();
        let own_is_in = self.leader_sends();
        let led = self.led.get_mut(&b).unwrap();
        let mut acc = led.acc.take().unwrap_or_else(|| vec![0; r.len()]);
        if led.counter == 0 {
            acc.copy_from_slice(&own);
        } else if !own_is_in {
            reduce_into(reduce, &mut acc, &own).expect("block shape");
        }
        let head = Head {
            id: BlockId {
                coll: self.cfg.coll,
                block: b,
                attempt: led.attempt,
            },
            tag: self.cfg.tag,
            dst: me,
        };
        if self.cfg.members.len() > 1 {
            out.push(Packet::Bcast {
                head,
                data: acc.clone(),
            });
        }
        let mut by_switch: BTreeMap<Addr, Vec<Port>> = BTreeMap::new();
        for &(s, p) in &led.collided {
            let v = by_switch.entry(s).or_default();
            if !v.contains(&p) {
                v.push(p);
            }
        }
        for (s, ports) in by_switch {
            out.push(Packet::Restore {
                head: Head { dst: s, ..head },
                ports,
                data: acc.clone(),
            });
        }
        led.result = Some(acc.clone());
        self.result(b, acc);
    }

    fn restart(&mut self, now: Nanos, b: u32, out: &mut Vec<Packet>, src: &dyn BlockSource) {
        self.stats.restarts += 1;
        let max = self.cfg.max_attempts;
        let led = self.led.get_mut(&b).unwrap();
        led.attempt += 1;
        led.counter = 0;
        led.acc = None;
        led.collided.clear();
        led.started = now;
        let attempt = led.attempt;
        let abort = attempt >= max;
        if abort {
            led.failed = true;
        }
        for (i, &m) in self.cfg.members.iter().enumerate() {
            if i != self.cfg.me {
                let head = self.head(b, attempt, m);
                out.push(if abort {
                    Packet::Abort { head }
                } else {
                    Packet::Restart { head }
                });
            }
        }
        if self.leader_sends() {
            self.attempt[b as usize] = attempt;
        }
        if abort {
            self.fail(HostError::Aborted { block: b });
        } else if let (true, Send::Waiting { .. }) = (self.leader_sends(), self.send[b as usize]) {
            // Our own contribution (static trees) goes again too.
            let deadline = now + self.cfg.retx_timeout;
            self.send[b as usize] = Send::Waiting {
                requests: 0,
                deadline,
            };
            self.timers.push(Reverse((deadline, b)));
            let p = self.reduce_packet(b, src);
            out.push(p);
        }
    }

    fn retx(
        &mut self,
        now: Nanos,
        b: u32,
        attempt: u16,
        host: Addr,
        src: &dyn BlockSource,
        out: &mut Vec<Packet>,
    ) {
        if !self.cfg.members.contains(&host) {
            self.stats.ignored += 1;
            return;
        }
        let head = self.head(b, 0, host);
        let Some(led) = self.led.get(&b) else {
            self.stats.ignored += 1;
            return;
        };
        let head = Head {
            id: BlockId {
                attempt: led.attempt,
                ..head.id
            },
            ..head
        };
        let holdoff = if self.cfg.wait_for_late {
            self.cfg.restart_holdoff << led.attempt.min(6)
        } else {
            self.cfg.restart_holdoff
        };
        if let Some(r) = &led.result {
            if host == self.addr() {
                return;
            }
            self.stats.results_resent += 1;
            out.push(Packet::Result {
                head,
                data: r.clone(),
            });
        } else if led.failed {
            out.push(Packet::Abort { head });
        } else if attempt < led.attempt {
            out.push(Packet::Restart { head });
        } else if attempt == led.attempt && now >= led.started + holdoff {
            self.restart(now, b, out, src);
        } else if self.cfg.wait_for_late && host != self.addr() {
            out.push(Packet::Wait { head });
        } else {
            self.stats.ignored += 1;
        }
    }
}
