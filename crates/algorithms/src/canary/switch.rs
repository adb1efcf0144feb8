//! The Canary switch (paper §3.1–§3.2, §3.5): a fixed table of block descriptors indexed by a
//! hash of the block id, best-effort aggregation inside a time window, the children ports
//! remembered for the broadcast, the up-port chosen by queue occupancy, tree restoration after
//! collisions.
//!
//! # Driving it
//! - [`Switch::on_packet`]`(now, in_port, packet, loads)` for every Canary packet received;
//!   it returns the packets to send, each with its output port.
//! - [`Switch::next_deadline`] is the earliest time at which [`Switch::on_timer`] must be
//!   called (it may be early: a timer of a descriptor freed meanwhile fires as a no-op).
//!   `on_timer(now, loads)` returns packets to send as well.
//! - `loads[port]` ([`PortLoad`]) is the caller's view of each output queue: bytes queued,
//!   its capacity, whether the link is up. The switch reads it only to pick an up-port.
//!
//! # Rules
//! - A reduce packet whose slot is free allocates a descriptor (data, counter, child port,
//!   a timer `timeout` ahead); one with the same id and tag aggregates into it; any other
//!   occupant is a *collision*: the packet goes on to the leader as a [`Packet::Collided`]
//!   carrying this switch's address and the input port (§3.2.1), and the leader later sends a
//!   [`Packet::Restore`] so the subtree still gets the broadcast.
//! - When the timer fires, or once the counter equals the packet's host count (nothing more
//!   can come), the accumulated data goes on towards the leader. The descriptor stays (state
//!   *flushed*): later packets of the block are stragglers, forwarded at once (§3.1.1), their
//!   ports still recorded as children.
//! - A broadcast packet with a descriptor is copied to every child port and frees the
//!   descriptor (§3.1.2); without one it is dropped.
//! - Up-port choice (§5.2): the default up-port unless its queue is more than half full or
//!   its link is down, then the up-port with the fewest queued bytes (ties to the default).
//!   The default is the destination modulo the number of up-ports: §5.2 says only "selected
//!   depending on the packet destination"; its simulator (SST merlin's fat tree,
//!   `topo_fattree::route`) takes `dest % up_ports` at the bottom level, which sends the
//!   hosts of one leaf down through distinct spines (a hash lets them collide).
//! - Static trees (the baselines): a reduce packet naming `tree` follows the installed
//!   [`TreeRule`]: it goes up the rule's port (no choice) and the descriptor is flushed when
//!   the rule's expected count is reached, with no time window.
//!
//! # Simplified against the paper
//! - Soft state has a lifetime: a flushed descriptor (and a static one that never filled) is
//!   freed `hold` after its timer, so blocks lost or restarted under a new attempt do not hold
//!   slots for ever; a broadcast that comes later finds no descriptor, and the hosts below
//!   recover it with a retransmission request.
//! - The switch compares the packet's tag with the descriptor's: packets of the same id from
//!   outside the job collide instead of aggregating.
//! - Children are a list of ports, not a sharded bitmap (§4.2); the time window is a timer
//!   per descriptor, not packet-generator clock packets (§4.3).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::packet::{Head, Packet};
use super::{Addr, BlockId, Port};
use crate::allreduce::{reduce_into, Reduce};
use crate::sim::rng::splitmix64;
use crate::Nanos;

/// A static tree's rule in one switch (installed by the control plane for the baselines).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeRule {
    /// The port to the parent; `None` at the root (which sends towards the leader).
    pub up: Option<Port>,
    /// Host contributions this switch aggregates before flushing.
    pub expected: u16,
}

/// What a switch knows of its ports and its job.
#[derive(Clone, Debug)]
pub struct SwitchConfig {
    /// This switch's address (carried in collided packets, the target of restorations).
    pub addr: Addr,
    /// Descriptor table capacity.
    pub slots: usize,
    /// Aggregation window of a descriptor (paper: "timeout").
    pub timeout: Nanos,
    /// Lifetime of a flushed descriptor whose broadcast never came.
    pub hold: Nanos,
    /// The up-ports (towards the spines); empty at the top level.
    pub up_ports: Vec<Port>,
    /// Addresses reached through one fixed port: hosts below a leaf, hosts and leaves below
    /// a spine, neighbouring switches (targets of restorations). Any other address is
    /// reached through an up-port.
    pub down: HashMap<Addr, Port>,
    /// Static trees, by (allreduce, tree); a rule under ([`ANY_COLL`], tree) applies to every
    /// allreduce without one of its own (a fabric whose every allreduce spans every host, as
    /// the SPs' benchmark of the baseline does).
    pub trees: HashMap<(u32, u8), TreeRule>,
}

/// The allreduce id of a static rule that applies to every allreduce (see
/// [`SwitchConfig::trees`]).
pub const ANY_COLL: u32 = u32::MAX;

/// The caller's view of one output queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortLoad {
    pub queued: u64,
    pub capacity: u64,
    pub up: bool,
}

/// Counters of what the switch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SwitchStats {
    pub aggregated: u64,
    pub flushed: u64,
    pub stragglers: u64,
    pub collisions: u64,
    pub bcasts: u64,
    pub bcast_without_descriptor: u64,
    pub restores: u64,
    pub expired: u64,
    pub unroutable: u64,
    pub adaptive_choices: u64,
}

impl SwitchStats {
    /// Adds `o`'s counters into these (totals over many switches).
    pub fn absorb(&mut self, o: &SwitchStats) {
        let SwitchStats {
            aggregated,
            flushed,
            stragglers,
            collisions,
            bcasts,
            bcast_without_descriptor,
            restores,
            expired,
            unroutable,
            adaptive_choices,
        } = *o;
        self.aggregated += aggregated;
        self.flushed += flushed;
        self.stragglers += stragglers;
        self.collisions += collisions;
        self.bcasts += bcasts;
        self.bcast_without_descriptor += bcast_without_descriptor;
        self.restores += restores;
        self.expired += expired;
        self.unroutable += unroutable;
        self.adaptive_choices += adaptive_choices;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Aggregating,
    Flushed,
}

#[derive(Clone, Debug)]
struct Desc {
    head: Head,
    reduce: Reduce,
    hosts: u16,
    counter: u16,
    tree: Option<u8>,
    expected: Option<u16>,
    len: usize,
    acc: Vec<u8>,
    children: Vec<Port>,
    phase: Phase,
    gen: u64,
}

/// One Canary switch; see the module docs.
#[derive(Debug)]
pub struct Switch {
    cfg: SwitchConfig,
    table: Vec<Option<Desc>>,
    timers: BinaryHeap<Reverse<(Nanos, usize, u64)>>,
    gen: u64,
    stats: SwitchStats,
}

/// The slot of a block id in a table of `slots` entries: a hash of the id (Canary, §3.2);
/// for a block on a static tree a direct mapping, consecutive blocks in consecutive slots, as
/// the baselines reserve their buffers (they never collide while fewer blocks than slots are
/// alive).
pub fn slot_of(id: BlockId, slots: usize, tree: Option<u8>) -> usize {
    if tree.is_some() {
        let base = splitmix64(id.coll as u64 ^ 0x7ee5) % slots as u64;
        return ((base + id.block as u64 + id.attempt as u64 * 7919) % slots as u64) as usize;
    }
    let k = splitmix64((id.coll as u64) << 32 ^ id.block as u64)
        ^ splitmix64(id.attempt as u64 + 0x5151);
    (splitmix64(k) % slots as u64) as usize
}

impl Switch {
    /// The static rule of tree `t` for allreduce `coll`: its own, else the fabric's.
    fn rule(&self, coll: u32, t: u8) -> Option<&TreeRule> {
        self.cfg
            .trees
            .get(&(coll, t))
            .or_else(|| self.cfg.trees.get(&(ANY_COLL, t)))
    }

    pub fn new(cfg: SwitchConfig) -> Switch {
        assert!(cfg.slots > 0, "a switch needs at least one descriptor slot");
        Switch {
            table: vec![None; cfg.slots],
            cfg,
            timers: BinaryHeap::new(),
            gen: 0,
            stats: SwitchStats::default(),
        }
    }

    pub fn config(&self) -> &SwitchConfig {
        &self.cfg
    }

    pub fn stats(&self) -> SwitchStats {
        self.stats
    }

    /// Descriptors currently allocated.
    pub fn occupied(&self) -> usize {
        self.table.iter().filter(|d| d.is_some()).count()
    }

    /// The earliest time `on_timer` has work (possibly none, see the module docs).
    pub fn next_deadline(&self) -> Option<Nanos> {
        self.timers.peek().map(|Reverse((t, _, _))| *t)
    }

    /// Handle one received packet; returns what to send, by output port.
    pub fn on_packet(
        &mut self,
        now: Nanos,
        in_port: Port,
        pkt: Packet,
        loads: &[PortLoad],
    ) -> Vec<(Port, Packet)> {
        let mut out = Vec::new();
        match pkt {
            Packet::Reduce {
                head,
                counter,
                hosts,
                reduce,
                tree,
                data,
            } => self.reduce(
                now, in_port, head, counter, hosts, reduce, tree, data, loads, &mut out,
            ),
            Packet::Bcast { head, data } => {
                let mine = |s: usize| {
                    self.table[s]
                        .as_ref()
                        .is_some_and(|d| d.head.id == head.id && d.head.tag == head.tag)
                };
                let hashed = slot_of(head.id, self.cfg.slots, None);
                let direct = slot_of(head.id, self.cfg.slots, Some(0));
                let found = [hashed, direct].into_iter().find(|&s| mine(s));
                match found {
                    Some(s) => {
                        let d = self.table[s].take().unwrap();
                        self.stats.bcasts += 1;
                        for &p in d.children.iter().filter(|&&p| p != in_port) {
                            out.push((
                                p,
                                Packet::Bcast {
                                    head,
                                    data: data.clone(),
                                },
                            ));
                        }
                    }
                    _ => self.stats.bcast_without_descriptor += 1,
                }
            }
            Packet::Restore { head, ports, data } if head.dst == self.cfg.addr => {
                self.stats.restores += 1;
                for p in ports {
                    if (p as usize) < loads.len() {
                        out.push((
                            p,
                            Packet::Bcast {
                                head,
                                data: data.clone(),
                            },
                        ));
                    }
                }
            }
            other => {
                // Unicasts (and collided packets, the bypass bit) are only routed.
                let dst = other.head().dst;
                match self.route(dst, None, true, loads) {
                    Some(p) => out.push((p, other)),
                    None => self.stats.unroutable += 1,
                }
            }
        }
        out
    }

    /// Fire the timers due at `now`; returns what to send.
    pub fn on_timer(&mut self, now: Nanos, loads: &[PortLoad]) -> Vec<(Port, Packet)> {
        let mut out = Vec::new();
        while let Some(&Reverse((t, s, gen))) = self.timers.peek() {
            if t > now {
                break;
            }
            self.timers.pop();
            let Some(d) = &self.table[s] else { continue };
            if d.gen != gen {
                continue;
            }
            match (d.phase, d.expected) {
                (Phase::Aggregating, None) => self.flush(now, s, loads, &mut out),
                _ => {
                    self.table[s] = None;
                    self.stats.expired += 1;
                }
            }
        }
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &mut self,
        now: Nanos,
        in_port: Port,
        head: Head,
        counter: u16,
        hosts: u16,
        reduce: Reduce,
        tree: Option<u8>,
        data: Vec<u8>,
        loads: &[PortLoad],
        out: &mut Vec<(Port, Packet)>,
    ) {
        let s = slot_of(head.id, self.cfg.slots, tree);
        match &mut self.table[s] {
            None => {
                self.gen += 1;
                let expected = tree
                    .and_then(|t| self.rule(head.id.coll, t))
                    .map(|r| r.expected);
                // A static descriptor waits for its expected count, bounded by `hold`.
                let deadline = now
                    + if expected.is_some() {
                        self.cfg.hold
                    } else {
                        self.cfg.timeout
                    };
                self.table[s] = Some(Desc {
                    head,
                    reduce,
                    hosts,
                    counter,
                    tree,
                    expected,
                    len: data.len(),
                    acc: data,
                    children: vec![in_port],
                    phase: Phase::Aggregating,
                    gen: self.gen,
                });
                self.timers.push(Reverse((deadline, s, self.gen)));
                self.stats.aggregated += 1;
                self.flush_if_full(now, s, loads, out);
            }
            Some(d)
                if d.head.id == head.id
                    && d.head.tag == head.tag
                    && d.head.dst == head.dst
                    && d.reduce == reduce
                    && d.hosts == hosts
                    && d.tree == tree
                    && d.len == data.len() =>
            {
                if !d.children.contains(&in_port) {
                    d.children.push(in_port);
                }
                if d.phase == Phase::Flushed || d.counter as u32 + counter as u32 > hosts as u32 {
                    // A straggler (§3.1.1), or more contributions than hosts (a duplicate):
                    // on to the leader, which counts.
                    self.stats.stragglers += 1;
                    let complete = counter == hosts;
                    let pkt = Packet::Reduce {
                        head,
                        counter,
                        hosts,
                        reduce,
                        tree,
                        data,
                    };
                    self.send_up(pkt, tree, complete, loads, out);
                    return;
                }
                reduce_into(reduce, &mut d.acc, &data).expect("same reduce and length");
                d.counter += counter;
                self.stats.aggregated += 1;
                self.flush_if_full(now, s, loads, out);
            }
            Some(_) => {
                self.stats.collisions += 1;
                let pkt = Packet::Collided {
                    head,
                    counter,
                    hosts,
                    reduce,
                    switch: self.cfg.addr,
                    port: in_port,
                    data,
                };
                match self.route(head.dst, None, true, loads) {
                    Some(p) => out.push((p, pkt)),
                    None => self.stats.unroutable += 1,
                }
            }
        }
    }

    fn flush_if_full(
        &mut self,
        now: Nanos,
        s: usize,
        loads: &[PortLoad],
        out: &mut Vec<(Port, Packet)>,
    ) {
        let d = self.table[s].as_ref().unwrap();
        if d.counter == d.hosts || d.expected.is_some_and(|e| d.counter >= e) {
            self.flush(now, s, loads, out);
        }
    }

    fn flush(&mut self, now: Nanos, s: usize, loads: &[PortLoad], out: &mut Vec<(Port, Packet)>) {
        self.gen += 1;
        let gen = self.gen;
        let d = self.table[s].as_mut().unwrap();
        d.phase = Phase::Flushed;
        d.gen = gen;
        let pkt = Packet::Reduce {
            head: d.head,
            counter: d.counter,
            hosts: d.hosts,
            reduce: d.reduce,
            tree: d.tree,
            data: std::mem::take(&mut d.acc),
        };
        let (tree, complete) = (d.tree, d.counter == d.hosts);
        self.timers.push(Reverse((now + self.cfg.hold, s, gen)));
        self.stats.flushed += 1;
        self.send_up(pkt, tree, complete, loads, out);
    }

    fn send_up(
        &mut self,
        pkt: Packet,
        tree: Option<u8>,
        complete: bool,
        loads: &[PortLoad],
        out: &mut Vec<(Port, Packet)>,
    ) {
        let dst = pkt.head().dst;
        let coll = pkt.head().id.coll;
        let rule = tree.and_then(|t| self.rule(coll, t).copied());
        match self.route(dst, rule, complete, loads) {
            Some(p) => out.push((p, pkt)),
            None => self.stats.unroutable += 1,
        }
    }

    /// The output port towards `dst`: down if `dst` is below, else an up-port. A static
    /// tree's incomplete data goes up its rule's port instead.
    fn route(
        &mut self,
        dst: Addr,
        rule: Option<TreeRule>,
        complete: bool,
        loads: &[PortLoad],
    ) -> Option<Port> {
        if let (Some(TreeRule { up: Some(p), .. }), false) = (rule, complete) {
            return Some(p);
        }
        if let Some(&p) = self.cfg.down.get(&dst) {
            return Some(p);
        }
        if rule.is_some() && !self.cfg.up_ports.is_empty() {
            // A static tree's complete block above its leader's leaf: the default port.
            return Some(self.default_up(dst));
        }
        self.choose_up(dst, loads)
    }

    /// The default up-port towards `dst` (module docs); `up_ports` is not empty.
    fn default_up(&self, dst: Addr) -> Port {
        let ups = &self.cfg.up_ports;
        ups[dst as usize % ups.len()]
    }

    fn choose_up(&mut self, dst: Addr, loads: &[PortLoad]) -> Option<Port> {
        let ups = &self.cfg.up_ports;
        if ups.is_empty() {
            return None;
        }
        let load = |p: Port| {
            loads.get(p as usize).copied().unwrap_or(PortLoad {
                queued: 0,
                capacity: 0,
                up: true,
            })
        };
        let def = self.default_up(dst);
        let l = load(def);
        if l.up && l.queued * 2 <= l.capacity {
            return Some(def);
        }
        self.stats.adaptive_choices += 1;
        ups.iter()
            .copied()
            .filter(|&p| load(p).up)
            .min_by_key(|&p| (load(p).queued, p != def))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allreduce::{Elem, Op};

    const SUM: Reduce = Reduce {
        op: Op::Sum,
        elem: Elem::U32,
    };

    fn leaf(slots: usize) -> Switch {
        // ports 0..4 down to hosts 0..4, ports 4..6 up
        Switch::new(SwitchConfig {
            addr: 100,
            slots,
            timeout: 1_000,
            hold: 100_000,
            up_ports: vec![4, 5],
            down: (0..4).map(|h| (h as Addr, h as Port)).collect(),
            trees: HashMap::new(),
        })
    }

    fn loads() -> Vec<PortLoad> {
        vec![
            PortLoad {
                queued: 0,
                capacity: 1000,
                up: true
            };
            6
        ]
    }

    fn u32s(v: &[u32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    fn red(block: u32, dst: Addr, counter: u16, hosts: u16, v: &[u32]) -> Packet {
        Packet::Reduce {
            head: Head {
                id: BlockId {
                    coll: 1,
                    block,
                    attempt: 0,
                },
                tag: 9,
                dst,
            },
            counter,
            hosts,
            reduce: SUM,
            tree: None,
            data: u32s(v),
        }
    }

    #[test]
    fn aggregates_within_the_window_then_flushes_up_and_broadcasts_to_children() {
        let mut s = leaf(16);
        let l = loads();
        assert!(s.on_packet(0, 0, red(7, 50, 1, 10, &[1, 2]), &l).is_empty());
        assert!(s
            .on_packet(10, 2, red(7, 50, 1, 10, &[10, 20]), &l)
            .is_empty());
        assert_eq!(s.next_deadline(), Some(1_000));
        assert!(s.on_timer(999, &l).is_empty());
        let out = s.on_timer(1_000, &l);
        assert_eq!(out.len(), 1);
        let (p, pkt) = &out[0];
        assert!(*p == 4 || *p == 5);
        match pkt {
            Packet::Reduce { counter, data, .. } => {
                assert_eq!(*counter, 2);
                assert_eq!(data, &u32s(&[11, 22]));
            }
            _ => panic!("{pkt:?}"),
        }
        // a straggler after the window goes on at once, its port remembered
        let out = s.on_packet(2_000, 3, red(7, 50, 1, 10, &[5, 5]), &l);
        assert_eq!(out.len(), 1);
        assert_eq!(s.stats().stragglers, 1);
        // the broadcast comes down from the up-port: copies to the three children
        let head = Head {
            id: BlockId {
                coll: 1,
                block: 7,
                attempt: 0,
            },
            tag: 9,
            dst: 0,
        };
        let out = s.on_packet(
            3_000,
            *p,
            Packet::Bcast {
                head,
                data: u32s(&[1, 1]),
            },
            &l,
        );
        let mut ports: Vec<Port> = out.iter().map(|(p, _)| *p).collect();
        ports.sort();
        assert_eq!(ports, vec![0, 2, 3]);
        assert_eq!(s.occupied(), 0);
        // a second copy (another parent) is dropped
        assert!(s
            .on_packet(
                3_001,
                5,
                Packet::Bcast {
                    head,
                    data: u32s(&[1, 1])
                },
                &l
            )
            .is_empty());
    }

    #[test]
    fn complete_counter_flushes_without_waiting_and_goes_down_to_a_local_leader() {
        let mut s = leaf(16);
        let l = loads();
        assert!(s.on_packet(0, 0, red(1, 3, 1, 2, &[1]), &l).is_empty());
        let out = s.on_packet(5, 1, red(1, 3, 1, 2, &[2]), &l);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, 3, "leader 3 is below port 3");
    }

    #[test]
    fn collision_bypasses_to_the_leader_with_switch_and_port_and_restore_multicasts() {
        let mut s = leaf(1);
        let l = loads();
        assert!(s.on_packet(0, 0, red(1, 50, 1, 10, &[1]), &l).is_empty());
        let out = s.on_packet(1, 2, red(2, 50, 1, 10, &[2]), &l);
        assert_eq!(out.len(), 1);
        match &out[0].1 {
            Packet::Collided {
                switch, port, data, ..
            } => {
                assert_eq!((*switch, *port), (100, 2));
                assert_eq!(data, &u32s(&[2]));
            }
            p => panic!("{p:?}"),
        }
        // same id, other tag (outside the job): also a collision, never aggregated
        let mut forged = red(1, 50, 1, 10, &[1000]);
        if let Packet::Reduce { head, .. } = &mut forged {
            head.tag = 1234;
        }
        assert!(matches!(
            s.on_packet(2, 1, forged, &l)[0].1,
            Packet::Collided { .. }
        ));
        let head = Head {
            id: BlockId {
                coll: 1,
                block: 2,
                attempt: 0,
            },
            tag: 9,
            dst: 100,
        };
        let out = s.on_packet(
            9,
            4,
            Packet::Restore {
                head,
                ports: vec![2],
                data: u32s(&[7]),
            },
            &l,
        );
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, 2);
        assert!(matches!(&out[0].1, Packet::Bcast { .. }));
        assert_eq!(s.stats().collisions, 2);
    }

    #[test]
    fn up_port_is_the_default_unless_over_half_full_then_the_least_loaded() {
        let mut s = leaf(16);
        let mut l = loads();
        let out = s.on_packet(0, 0, red(1, 50, 1, 1, &[1]), &l);
        let def = out[0].0;
        for dst in 10..26 {
            // idle ports: the default, the destination modulo the up-ports (SST's fat tree)
            let out = s.on_packet(0, 0, red(100 + dst, dst, 1, 1, &[1]), &l);
            assert_eq!(out[0].0, 4 + (dst % 2) as Port, "destination {dst}");
        }
        let other = if def == 4 { 5 } else { 4 };
        l[def as usize].queued = 500; // exactly half: still the default
        assert_eq!(s.on_packet(0, 0, red(2, 50, 1, 1, &[1]), &l)[0].0, def);
        l[def as usize].queued = 501;
        l[other as usize].queued = 900;
        assert_eq!(
            s.on_packet(0, 0, red(3, 50, 1, 1, &[1]), &l)[0].0,
            def,
            "the default is still the least loaded"
        );
        l[other as usize].queued = 100;
        assert_eq!(s.on_packet(0, 0, red(4, 50, 1, 1, &[1]), &l)[0].0, other);
        l[other as usize].queued = 0;
        l[def as usize] = PortLoad {
            queued: 0,
            capacity: 1000,
            up: false,
        };
        assert_eq!(
            s.on_packet(0, 0, red(5, 50, 1, 1, &[1]), &l)[0].0,
            other,
            "a down link is avoided"
        );
    }

    #[test]
    fn flushed_descriptors_expire_after_hold_and_static_trees_wait_for_their_count() {
        let mut s = leaf(4);
        s.cfg.trees.insert(
            (1, 0),
            TreeRule {
                up: Some(5),
                expected: 2,
            },
        );
        let l = loads();
        let mut p = red(1, 50, 1, 10, &[1]);
        if let Packet::Reduce { tree, .. } = &mut p {
            *tree = Some(0);
        }
        assert!(s.on_packet(0, 0, p.clone(), &l).is_empty());
        assert!(
            s.on_timer(50_000, &l).is_empty(),
            "no window for a static tree"
        );
        let out = s.on_packet(60_000, 1, p, &l);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, 5, "the tree's port");
        assert_eq!(s.occupied(), 1);
        s.on_timer(60_000 + 100_000, &l);
        assert_eq!(s.occupied(), 0, "soft state expired");
        assert_eq!(s.stats().expired, 1);
    }

    /// A rule under `ANY_COLL` serves every allreduce without one of its own (waits for its
    /// count, goes up its port); an allreduce's own rule still wins.
    #[test]
    fn a_fabric_wide_static_rule_serves_every_allreduce_without_its_own() {
        let mut s = leaf(4);
        s.cfg.trees.insert(
            (ANY_COLL, 0),
            TreeRule {
                up: Some(5),
                expected: 2,
            },
        );
        s.cfg.trees.insert(
            (7, 0),
            TreeRule {
                up: Some(4),
                expected: 1,
            },
        );
        let l = loads();
        let mut p = red(1, 50, 1, 10, &[1]);
        if let Packet::Reduce { tree, .. } = &mut p {
            *tree = Some(0);
        }
        assert!(s.on_packet(0, 0, p.clone(), &l).is_empty(), "waits for 2");
        let out = s.on_packet(10, 1, p.clone(), &l);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, 5, "the fabric's rule's port");
        // Allreduce 7 has its own rule: one contribution, port 4.
        if let Packet::Reduce { head, .. } = &mut p {
            head.id.coll = 7;
        }
        let out = s.on_packet(20, 0, p, &l);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, 4, "the allreduce's own rule");
    }
}
