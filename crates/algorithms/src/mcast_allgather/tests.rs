//! Unit tests of the machine, on a small hand-driven network of SPs that
//! moves real bytes: multicasts land in the registered receive buffers
//! (unless the test drops them), copies copy, timers fire when the network
//! is quiet.

use std::collections::VecDeque;

use super::*;
use crate::sim::rng::Rng;
use crate::test_util::test_key;

const KEY: CollKey = test_key(26, 1);
const MTU: u64 = 4;

/// A buffer: (rank, is the send buffer).
type Tag = (Rank, bool);

#[derive(Clone, Debug)]
enum Work {
    C(Copy<Tag>),
    M(Multicast<Tag>),
}

struct Net {
    sps: BTreeMap<SpId, McastAllgather<Tag>>,
    members: Vec<SpId>,
    len: u64,
    send: Vec<Vec<u8>>,
    recv: Vec<Vec<u8>>,
    lens: Vec<u64>,
    msgs: VecDeque<(SpId, SpId, Msg<Tag>)>,
    work: VecDeque<(SpId, Work)>,
    reg: BTreeMap<SpId, Register<Tag>>,
    /// SPs that ever registered, in order.
    registered: Vec<SpId>,
    done: Vec<(SpId, Rank, Status)>,
    /// (from, to) of every `Final` delivered.
    finals: BTreeSet<(SpId, SpId)>,
    /// SPs in the order their first multicast was emitted, and when each
    /// SP's multicasts were all reported done.
    mcast_order: Vec<SpId>,
    sent: Vec<(SpId, SpId, Msg<Tag>)>,
    /// Whether global PSN `psn` to SP `sp` is lost.
    drop: Box<dyn FnMut(SpId, u64) -> bool>,
    dead: BTreeSet<SpId>,
    now: Nanos,
}

fn cfg(me: SpId, chains: u32) -> Config {
    Config {
        me,
        mtu: MTU,
        subgroups: 2,
        chains,
        link_bytes_per_ns: 1,
        alpha_ns: 1_000,
    }
}

fn block_byte(rank: u64, i: u64) -> u8 {
    (rank * 37 + i * 7 + 3) as u8
}

impl Net {
    /// `members[r]` serves rank `r`; blocks of `len` bytes; `chains`
    /// chains (0: default).
    fn new(members: &[SpId], len: u64, chains: u32) -> Net {
        let p = members.len() as u64;
        let send = (0..p)
            .map(|r| (0..len).map(|i| block_byte(r, i)).collect())
            .collect();
        let recv = (0..p).map(|_| vec![0xEE; (p * len) as usize]).collect();
        let sps = members
            .iter()
            .map(|&sp| (sp, McastAllgather::new(KEY, cfg(sp, chains))))
            .collect();
        Net {
            sps,
            members: members.to_vec(),
            len,
            send,
            recv,
            lens: vec![len; p as usize],
            msgs: VecDeque::new(),
            work: VecDeque::new(),
            reg: BTreeMap::new(),
            registered: Vec::new(),
            done: Vec::new(),
            finals: BTreeSet::new(),
            mcast_order: Vec::new(),
            sent: Vec::new(),
            drop: Box::new(|_, _| false),
            dead: BTreeSet::new(),
            now: 0,
        }
    }

    fn m(&mut self, sp: SpId) -> &mut McastAllgather<Tag> {
        self.sps.get_mut(&sp).unwrap()
    }

    fn ring(&self) -> Vec<SpId> {
        build_ring(&self.members)
    }

    fn right(&self, sp: SpId) -> SpId {
        let r = self.ring();
        let i = r.iter().position(|&s| s == sp).unwrap();
        r[(i + 1) % r.len()]
    }

    fn post(&mut self, rank: Rank) {
        self.now += 10;
        let sp = self.members[rank as usize];
        let post = Post {
            rank,
            members: self.members.clone(),
            send_key: (rank, true),
            recv_key: (rank, false),
            len: self.lens[rank as usize],
        };
        let now = self.now;
        self.m(sp).handle_post(now, post).unwrap();
        self.collect(sp);
    }

    fn post_all(&mut self) {
        for r in 0..self.members.len() as Rank {
            self.post(r);
        }
    }

    fn collect(&mut self, sp: SpId) {
        while let Some(a) = self.m(sp).poll_action() {
            match a {
                Action::Send { to, msg } => {
                    assert_ne!(to, sp);
                    self.sent.push((sp, to, msg.clone()));
                    self.msgs.push_back((sp, to, msg));
                }
                Action::Register(r) => {
                    assert!(self.reg.insert(sp, r).is_none(), "registered twice");
                    self.registered.push(sp);
                }
                Action::Unregister => {
                    assert!(self.reg.remove(&sp).is_some(), "unregistered unregistered");
                }
                Action::Multicast(m) => {
                    // The RNR barrier: every other SP registered first.
                    for s in self.ring() {
                        assert!(
                            s == sp || self.registered.contains(&s),
                            "SP {sp} multicasts before SP {s} registered"
                        );
                    }
                    if self.mcast_order.last() != Some(&sp) {
                        assert!(!self.mcast_order.contains(&sp), "SP {sp} multicast twice");
                        self.mcast_order.push(sp);
                    }
                    self.work.push_back((sp, Work::M(m)))
                }
                Action::Copy(c) => {
                    assert!(c.len > 0);
                    self.work.push_back((sp, Work::C(c)))
                }
                Action::Complete { rank, status } => {
                    assert!(
                        !self.done.iter().any(|&(_, r, _)| r == rank),
                        "rank {rank} completed twice"
                    );
                    assert!(!self.reg.contains_key(&sp), "completed while registered");
                    if status.is_ok() && self.ring().len() > 1 {
                        let right = self.right(sp);
                        assert!(
                            self.finals.contains(&(right, sp)),
                            "rank {rank} completed Ok before SP {right}'s Final"
                        );
                    }
                    self.done.push((sp, rank, status));
                }
            }
        }
    }

    fn live(&self, sp: SpId) -> bool {
        !self.dead.contains(&sp)
    }

    fn buf(&mut self, (rank, send): Tag) -> &mut Vec<u8> {
        if send {
            &mut self.send[rank as usize]
        } else {
            &mut self.recv[rank as usize]
        }
    }

    fn step(&mut self) -> bool {
        if let Some((from, to, msg)) = self.msgs.pop_front() {
            self.now += 1;
            let now = self.now;
            if self.live(to) {
                if matches!(msg, Msg::Final { .. }) {
                    self.finals.insert((from, to));
                }
                self.m(to).handle_msg(now, from, msg).unwrap();
                self.collect(to);
            }
            return true;
        }
        let Some((sp, w)) = self.work.pop_front() else {
            return false;
        };
        self.now += 1;
        let now = self.now;
        if !self.live(sp) {
            return true;
        }
        let id = match w {
            Work::C(c) => {
                assert!(!c.src.1 || c.src_offset == 0, "reads a send buffer at 0");
                assert!(!c.dst.1, "writes a send buffer");
                let ok = self.live(self.members[c.src.0 as usize]);
                if ok {
                    let (a, l) = (c.src_offset as usize, c.len as usize);
                    let bytes = self.buf(c.src)[a..a + l].to_vec();
                    let d = c.dst_offset as usize;
                    self.buf(c.dst)[d..d + l].copy_from_slice(&bytes);
                }
                let st = if ok { Status::Ok } else { Status::AccessError };
                self.m(sp).handle_copy_done(now, c.id, st);
                self.collect(sp);
                return true;
            }
            Work::M(m) => {
                assert!(m.key.1 && m.key.0 == m.block);
                let n = self.len.div_ceil(MTU).max(1);
                for g in m.first_psn..m.first_psn + m.psns {
                    let (b, i) = (g / n, g % n);
                    assert_eq!(b, u64::from(m.block));
                    let at = (i * MTU).min(self.len) as usize;
                    let end = ((i + 1) * MTU).min(self.len) as usize;
                    let to: Vec<SpId> = self.reg.keys().copied().filter(|&s| s != sp).collect();
                    for dst in to {
                        if !self.live(dst) || (self.drop)(dst, g) {
                            continue;
                        }
                        let chunk = self.send[b as usize][at..end].to_vec();
                        let off = (b * self.len) as usize;
                        for &(_, k) in &self.reg[&dst].keys.clone() {
                            self.buf(k)[off + at..off + end].copy_from_slice(&chunk);
                        }
                        self.m(dst).handle_landed(now, g);
                        self.collect(dst);
                    }
                }
                m.id
            }
        };
        self.m(sp).handle_copy_done(now, id, Status::Ok);
        self.collect(sp);
        true
    }

    /// Runs until quiet, firing due timers when nothing else moves.
    fn run(&mut self) {
        for _ in 0..1_000_000 {
            if self.step() {
                continue;
            }
            let next = self
                .sps
                .iter()
                .filter(|(sp, _)| self.live(**sp))
                .filter_map(|(&sp, m)| m.poll_timeout().map(|t| (t, sp)))
                .min();
            let Some((t, sp)) = next else { return };
            self.now = self.now.max(t);
            let now = self.now;
            self.m(sp).handle_timeout(now);
            self.collect(sp);
        }
        panic!("no quiescence");
    }

    fn all_ok(&self) {
        let p = self.members.len();
        assert_eq!(self.done.len(), p, "every rank completes: {:?}", self.done);
        for &(_, r, st) in &self.done {
            assert_eq!(st, Status::Ok, "rank {r}");
        }
        let want: Vec<u8> = self.send.iter().flatten().copied().collect();
        for r in 0..p {
            assert_eq!(self.recv[r], want, "rank {r}'s receive buffer");
        }
        for (sp, m) in &self.sps {
            assert!(m.is_finished(), "SP {sp} finished");
        }
    }

    fn count(&self, f: impl Fn(&Msg<Tag>) -> bool) -> usize {
        self.sent.iter().filter(|(_, _, m)| f(m)).count()
    }
}

#[test]
fn chains_split_the_ring_evenly_and_the_default_is_about_sqrt() {
    assert_eq!(chain_bounds(6, 2), vec![(0, 3), (3, 6)]);
    assert_eq!(chain_bounds(7, 3), vec![(0, 2), (2, 4), (4, 7)]);
    assert_eq!(chain_bounds(3, 9), vec![(0, 1), (1, 2), (2, 3)]);
    assert_eq!(chain_bounds(1, 0), vec![(0, 1)]);
    for k in 1..300usize {
        let m = default_chains(k);
        assert!(m >= 1 && m <= k);
        let r = k as f64;
        assert!((m as f64 - r.sqrt()).abs() <= 0.5 + 1e-9, "k={k} m={m}");
        let b = chain_bounds(k, m);
        assert_eq!(b.len(), m);
        assert_eq!(b[0].0, 0);
        assert_eq!(b[m - 1].1, k);
        let lens: Vec<usize> = b.iter().map(|(a, e)| e - a).collect();
        assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
        assert!(b.windows(2).all(|w| w[0].1 == w[1].0));
    }
}

/// Six SPs (some serving two ranks), 10-byte blocks (3 chunks of 4).
fn six() -> Vec<SpId> {
    vec![0, 1, 1, 2, 3, 4, 5, 5, 0]
}

#[test]
fn without_loss_every_block_is_multicast_once_and_nothing_is_fetched() {
    let mut net = Net::new(&six(), 10, 2);
    net.post_all();
    net.run();
    net.all_ok();
    assert_eq!(net.count(|m| matches!(m, Msg::FetchReq { .. })), 0);
    assert_eq!(net.count(|m| matches!(m, Msg::Final { .. })), 6);
    assert_eq!(net.count(|m| matches!(m, Msg::Open { .. })), 5);
    assert_eq!(net.count(|m| matches!(m, Msg::Ready { .. })), 5);
    assert_eq!(net.count(|m| matches!(m, Msg::Start { .. })), 5);
    // Two chains of three: two activation signals each.
    assert_eq!(net.count(|m| matches!(m, Msg::Go { .. })), 4);
    let mut landed = 0;
    let mut multicast = 0;
    for m in net.sps.values() {
        landed += m.stats().chunks_landed;
        multicast += m.stats().bytes_multicast;
    }
    // Each of the 9 blocks once, to the 5 other SPs: 3 chunks each.
    assert_eq!(multicast, 9 * 10);
    let remote: u64 = net
        .ring()
        .iter()
        .map(|&sp| 9 - net.members.iter().filter(|&&s| s == sp).count() as u64)
        .sum();
    assert_eq!(landed, remote * 3);
}

#[test]
fn the_sequencer_runs_each_chain_one_sp_after_the_other() {
    // Six SPs, one rank each, three chains of two: the heads (0, 2, 4)
    // multicast first, then 1, 3, 5, each after its predecessor's `Go`.
    let mut net = Net::new(&[0, 1, 2, 3, 4, 5], 8, 3);
    net.post_all();
    net.run();
    net.all_ok();
    let pos = |sp: SpId| net.mcast_order.iter().position(|&s| s == sp).unwrap();
    for (head, next) in [(0, 1), (2, 3), (4, 5)] {
        assert!(pos(head) < pos(next), "{:?}", net.mcast_order);
        assert!(
            pos(next) >= 3,
            "a second step starts after the first: {:?}",
            net.mcast_order
        );
        let go = net
            .sent
            .iter()
            .position(|(f, t, m)| *f == head && *t == next && matches!(m, Msg::Go { .. }));
        assert!(go.is_some(), "Go from {head} to {next}");
    }
    assert_eq!(
        net.sps[&3].chain_neighbours(),
        Some((Some(2), None)),
        "chain of SP 3"
    );
}

#[test]
fn lost_chunks_come_around_the_fetch_ring_with_partial_acks() {
    // Chunk 0 of block 0 (SP 0's) and chunk 1 of block 3 (SP 2's) are
    // lost everywhere: every neighbour pair misses a chunk the other was
    // asked for, which an answer-only-when-complete fetch would wait on
    // forever.
    let mut net = Net::new(&six(), 10, 2);
    net.drop = Box::new(|_, g| g == 0 || g == 3 * 3 + 1);
    net.post_all();
    net.run();
    net.all_ok();
    assert_eq!(net.count(|m| matches!(m, Msg::FetchReq { .. })), 6);
    assert!(net.count(|m| matches!(m, Msg::FetchAck { .. })) >= 6);
}

#[test]
fn answering_only_whole_requests_would_wait_in_a_circle() {
    // The loss pattern above under the bcast's rule (answer a request once
    // every requested chunk is in): every SP waits for its left neighbour,
    // all around the ring, and nobody completes.
    set_mutation(Some(Mutation::WholeAcks));
    let mut net = Net::new(&six(), 10, 2);
    net.drop = Box::new(|_, g| g == 0 || g == 3 * 3 + 1);
    net.post_all();
    net.run();
    set_mutation(None);
    assert!(net.done.is_empty(), "{:?}", net.done);
    assert_eq!(net.count(|m| matches!(m, Msg::FetchReq { .. })), 6);
    assert_eq!(net.count(|m| matches!(m, Msg::FetchAck { .. })), 0);
}

#[test]
fn random_losses_are_recovered() {
    for seed in 1..=40u64 {
        eprintln!("seed {seed}");
        let mut g = Rng::new(seed);
        let k = g.range(2, 7) as u32;
        let p = g.range(1, 12) as usize;
        let members: Vec<SpId> = (0..p)
            .map(|r| {
                if r < k as usize {
                    r as u32
                } else {
                    g.below(k as u64) as u32
                }
            })
            .collect();
        let len = g.range(0, 13);
        let ppm = [0u64, 100_000, 500_000, 1_000_000][g.below(4) as usize];
        let chains = g.range(0, 4) as u32;
        let mut net = Net::new(&members, len, chains);
        let mut r = Rng::new(seed ^ 0xFEED);
        net.drop = Box::new(move |_, _| r.chance(ppm, 1_000_000));
        net.post_all();
        net.run();
        net.all_ok();
    }
}

#[test]
fn everything_lost_goes_around_the_ring() {
    let mut net = Net::new(&six(), 10, 0);
    net.drop = Box::new(|_, _| true);
    net.post_all();
    net.run();
    net.all_ok();
    assert_eq!(net.count(|m| matches!(m, Msg::FetchReq { .. })), 6);
    let fetched: u64 = net.sps.values().map(|m| m.stats().chunks_fetched).sum();
    let landed: u64 = net.sps.values().map(|m| m.stats().chunks_landed).sum();
    assert_eq!(landed, 0);
    assert!(fetched > 0);
}

#[test]
fn one_sp_and_zero_byte_blocks() {
    let mut net = Net::new(&[3, 3, 3], 7, 0);
    net.post_all();
    net.run();
    net.all_ok();
    assert!(net.sent.is_empty() && net.registered.is_empty());
    let mut net = Net::new(&six(), 0, 2);
    net.post_all();
    net.run();
    net.all_ok();
}

#[test]
fn a_late_rank_holds_the_barrier() {
    let mut net = Net::new(&six(), 10, 2);
    for r in 1..9 {
        net.post(r);
    }
    net.run();
    assert!(
        net.mcast_order.is_empty(),
        "no multicast before SP 0 is ready"
    );
    assert!(net.done.is_empty());
    net.post(0);
    net.run();
    net.all_ok();
}

#[test]
fn a_length_mismatch_aborts_everywhere() {
    let mut net = Net::new(&six(), 10, 2);
    net.lens[4] = 9;
    net.post_all();
    net.run();
    assert_eq!(net.done.len(), 9);
    assert!(net.done.iter().all(|&(_, _, s)| s == Status::CountMismatch));
    assert!(net.mcast_order.is_empty());
    // Two ranks of one SP disagreeing.
    let mut net = Net::new(&six(), 10, 2);
    net.lens[2] = 11;
    net.post_all();
    net.run();
    assert!(net.done.iter().all(|&(_, _, s)| !s.is_ok()));
    assert_eq!(net.done.len(), 9);
}

#[test]
fn chains_that_disagree_abort() {
    let mut net = Net::new(&six(), 10, 2);
    let me = 3;
    *net.m(me) = McastAllgather::new(KEY, cfg(me, 3));
    net.post_all();
    net.run();
    assert_eq!(net.done.len(), 9);
    assert!(net.done.iter().all(|&(_, _, s)| s == Status::InvalidPost));
}

#[test]
fn an_sp_lost_during_the_fetch_ends_everyone_with_an_error() {
    let mut net = Net::new(&six(), 10, 2);
    net.drop = Box::new(|_, g| g % 2 == 0);
    net.post_all();
    // Run until the first fetch ack is sent, then kill its sender.
    let mut victim = None;
    while victim.is_none() && net.step() {
        victim = net
            .sent
            .iter()
            .find(|(_, _, m)| matches!(m, Msg::FetchAck { .. }))
            .map(|(f, _, _)| *f);
        if net.msgs.is_empty() && net.work.is_empty() {
            let t = net.sps.values().filter_map(|m| m.poll_timeout()).min();
            if let Some(t) = t {
                net.now = net.now.max(t);
                let now = net.now;
                for sp in net.ring() {
                    net.m(sp).handle_timeout(now);
                    net.collect(sp);
                }
            }
        }
    }
    let victim = victim.expect("a fetch was served");
    net.dead.insert(victim);
    net.done.retain(|(sp, _, _)| *sp != victim);
    let now = net.now + 1;
    for sp in net.ring() {
        if sp != victim {
            net.m(sp).handle_peer_lost(now, victim);
            net.collect(sp);
        }
    }
    net.run();
    let survivors = net.members.iter().filter(|&&s| s != victim).count();
    let done: Vec<_> = net.done.iter().filter(|(sp, _, _)| *sp != victim).collect();
    assert_eq!(done.len(), survivors, "{:?}", net.done);
    assert!(done.iter().all(|(_, _, s)| !s.is_ok()));
}

#[test]
fn peers_breaking_the_protocol_are_rejected() {
    let mut net = Net::new(&six(), 10, 2);
    net.post_all();
    let shape = net.sps[&0].view.as_ref().unwrap().shape;
    // SP 3's left is 2, its chain predecessor... chains (0..3), (3..6):
    // SP 3 heads its chain.
    let m = net.m(3);
    let req = Msg::FetchReq {
        shape,
        ranges: vec![(0, 1)],
    };
    assert_eq!(m.handle_msg(1, 1, req), Err(MsgError::BadFetch { sp: 1 }));
    assert_eq!(
        m.handle_msg(1, 2, Msg::Go { shape }),
        Err(MsgError::UnexpectedGo { sp: 2 })
    );
    assert_eq!(
        m.handle_msg(1, 1, Msg::Start { shape }),
        Err(MsgError::NotCoordinator { sp: 1 })
    );
    assert_eq!(
        m.handle_msg(1, 9, Msg::Final { shape }),
        Err(MsgError::NotMember { sp: 9 })
    );
    assert_eq!(
        m.handle_msg(
            1,
            2,
            Msg::FetchAck {
                key: (0, false),
                ranges: vec![(0, 1)]
            }
        ),
        Err(MsgError::UnexpectedAck { sp: 2 })
    );
    assert!(m.abort_status().is_none());
}

#[test]
fn a_failed_copy_aborts_and_no_buffer_is_touched_after_completion() {
    let mut net = Net::new(&six(), 10, 2);
    net.post_all();
    // Fail the first copy of SP 1.
    let at = net
        .work
        .iter()
        .position(|(sp, w)| *sp == 1 && matches!(w, Work::C(_)))
        .unwrap();
    let (_, w) = net.work.remove(at).unwrap();
    let Work::C(c) = w else { unreachable!() };
    net.m(1).handle_copy_done(5, c.id, Status::AccessError);
    net.collect(1);
    net.run();
    assert_eq!(net.done.len(), 9);
    assert!(net.done.iter().all(|&(_, _, s)| !s.is_ok()));
    for (sp, m) in &net.sps {
        assert!(m.is_finished(), "SP {sp}");
    }
}
