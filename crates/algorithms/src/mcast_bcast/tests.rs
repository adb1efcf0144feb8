//! Unit tests of the machine, on a small hand-driven network of SPs that
//! moves real bytes: multicasts land in the registered buffers (unless the
//! test drops them), copies copy, timers fire when the network is quiet.

use super::*;
use crate::sim::rng::Rng;
use crate::test_util::test_key;

const KEY: CollKey = test_key(26, 0);
const MTU: u64 = 4;

/// A buffer is named by its rank.
type Tag = Rank;

#[derive(Clone, Debug)]
enum Work {
    C(Copy<Tag>),
    M(Multicast<Tag>),
}

struct Net {
    sps: BTreeMap<SpId, McastBcast<Tag>>,
    members: Vec<SpId>,
    bufs: Vec<Vec<u8>>,
    data: Vec<u8>,
    root: Rank,
    msgs: VecDeque<(SpId, SpId, Msg<Tag>)>,
    work: VecDeque<(SpId, Work)>,
    /// Active registrations.
    reg: BTreeMap<SpId, Register<Tag>>,
    done: Vec<(SpId, Rank, Status)>,
    sent: Vec<(SpId, SpId, Msg<Tag>)>,
    /// Whether the datagram `psn` to SP `sp` is lost.
    drop: Box<dyn FnMut(SpId, u64) -> bool>,
    fail_copies: bool,
    dead: BTreeSet<SpId>,
    now: Nanos,
}

use std::collections::VecDeque;

fn cfg(me: SpId) -> Config {
    Config {
        me,
        mtu: MTU,
        subgroups: 2,
        link_bytes_per_ns: 1,
        alpha_ns: 1_000,
    }
}

impl Net {
    /// `members[r]` serves rank `r`; a `len`-byte broadcast from `root`.
    fn new(members: &[SpId], root: Rank, len: u64) -> Net {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let bufs = (0..members.len())
            .map(|r| {
                if r == root as usize {
                    data.clone()
                } else {
                    vec![0xEE; len as usize]
                }
            })
            .collect();
        let sps = members
            .iter()
            .map(|&sp| (sp, McastBcast::new(KEY, cfg(sp))))
            .collect();
        Net {
            sps,
            members: members.to_vec(),
            bufs,
            data,
            root,
            msgs: VecDeque::new(),
            work: VecDeque::new(),
            reg: BTreeMap::new(),
            done: Vec::new(),
            sent: Vec::new(),
            drop: Box::new(|_, _| false),
            fail_copies: false,
            dead: BTreeSet::new(),
            now: 0,
        }
    }

    fn m(&mut self, sp: SpId) -> &mut McastBcast<Tag> {
        self.sps.get_mut(&sp).unwrap()
    }

    fn post_of(&self, rank: Rank) -> Post<Tag> {
        Post {
            rank,
            root: self.root,
            members: self.members.clone(),
            key: rank,
            len: self.data.len() as u64,
        }
    }

    fn post(&mut self, rank: Rank) {
        self.now += 10;
        let (sp, p, now) = (self.members[rank as usize], self.post_of(rank), self.now);
        self.m(sp).handle_post(now, p).unwrap();
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
                }
                Action::Unregister => {
                    assert!(self.reg.remove(&sp).is_some(), "unregistered unregistered");
                }
                Action::Multicast(m) => self.work.push_back((sp, Work::M(m))),
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
                    self.done.push((sp, rank, status));
                }
            }
        }
    }

    fn live(&self, sp: SpId) -> bool {
        !self.dead.contains(&sp)
    }

    fn step(&mut self) -> bool {
        if let Some((from, to, msg)) = self.msgs.pop_front() {
            self.now += 1;
            let now = self.now;
            if self.live(to) {
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
        let status = if self.fail_copies {
            Status::AccessError
        } else {
            Status::Ok
        };
        let id = match w {
            Work::C(c) => {
                if status.is_ok() {
                    let (a, b) = (c.offset as usize, (c.offset + c.len) as usize);
                    let src = self.bufs[c.src as usize][a..b].to_vec();
                    self.bufs[c.dst as usize][a..b].copy_from_slice(&src);
                }
                c.id
            }
            Work::M(m) => {
                assert_eq!(m.key, self.root);
                for psn in m.first_psn..m.first_psn + m.psns {
                    let at = (psn * m.mtu).min(self.data.len() as u64) as usize;
                    let end = ((psn + 1) * m.mtu).min(self.data.len() as u64) as usize;
                    let to: Vec<SpId> = self.reg.keys().copied().collect();
                    for dst in to {
                        if !self.live(dst) || (self.drop)(dst, psn) {
                            continue;
                        }
                        for &(_, k) in &self.reg[&dst].keys {
                            let chunk = self.data[at..end].to_vec();
                            self.bufs[k as usize][at..end].copy_from_slice(&chunk);
                        }
                        self.m(dst).handle_landed(now, psn);
                        self.collect(dst);
                    }
                }
                m.id
            }
        };
        self.m(sp).handle_copy_done(now, id, status);
        self.collect(sp);
        true
    }

    /// Runs until quiet, firing timers when nothing else is left.
    fn run(&mut self) {
        for _ in 0..100_000 {
            while self.step() {}
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

    fn status(&self, rank: Rank) -> Option<Status> {
        self.done
            .iter()
            .find(|&&(_, r, _)| r == rank)
            .map(|&(_, _, s)| s)
    }

    /// Every rank completed `Ok` with the root's bytes; every instance is
    /// finished.
    fn all_ok(&self) {
        for r in 0..self.members.len() {
            assert_eq!(self.status(r as Rank), Some(Status::Ok), "rank {r}");
            assert_eq!(self.bufs[r], self.data, "rank {r}'s bytes");
        }
        for (sp, m) in &self.sps {
            assert!(m.is_finished(), "SP {sp} not finished");
        }
    }

    fn total(&self) -> Stats {
        let mut s = Stats::default();
        for m in self.sps.values() {
            s.absorb(&m.stats());
        }
        s
    }
}

#[test]
fn ring_starts_at_the_roots_sp_and_runs_match_the_sps_subgroup_map() {
    assert_eq!(build_ring(&[4, 2, 9, 2, 7], 3), vec![2, 4, 7, 9]);
    assert_eq!(build_ring(&[4, 2, 9, 2, 7], 2), vec![9, 2, 4, 7]);
    assert_eq!(build_ring(&[5, 5], 1), vec![5]);
    let mut rng = Rng::new(26);
    for _ in 0..500 {
        let n = rng.range(1, 300);
        let s = rng.range(1, 9) as u16;
        let runs = subgroup_runs(n, s);
        assert_eq!(runs.len(), s as usize);
        assert_eq!(runs[0].0, 0);
        assert_eq!(runs.last().unwrap().1, n);
        for (g, &(a, b)) in runs.iter().enumerate() {
            for psn in a..b {
                // `mcast::subgroup_of` in the SP.
                assert_eq!(psn * u64::from(s) / n, g as u64, "n={n} s={s} psn={psn}");
            }
        }
    }
}

#[test]
fn without_drops_every_rank_gets_the_bytes_and_nothing_is_fetched() {
    // SP 0: ranks 1, 4; SP 1: root 0 and rank 3; SP 2: rank 2.
    let mut net = Net::new(&[1, 0, 2, 1, 0], 0, 10);
    net.post_all();
    net.run();
    net.all_ok();
    assert_eq!(net.m(1).ring(), Some(&[1, 2, 0][..]));
    let s = net.total();
    assert_eq!(s.fetch_requests, 0);
    assert_eq!(s.chunks_multicast, 3);
    // Two leaf SPs, three chunks each.
    assert_eq!(s.chunks_landed, 6);
    assert_eq!(s.local_copies, 1);
    // The final handshake: one `Final` per SP to its left.
    let mut finals: Vec<(SpId, SpId)> = net
        .sent
        .iter()
        .filter(|(_, _, m)| matches!(m, Msg::Final { .. }))
        .map(|&(f, t, _)| (f, t))
        .collect();
    finals.sort();
    assert_eq!(finals, vec![(0, 2), (1, 0), (2, 1)]);
}

#[test]
fn dropped_chunks_are_fetched_from_the_left_neighbour_recursively() {
    let members = [0, 1, 2, 3, 1, 2, 3, 0];
    for seed in 1..=60u64 {
        eprintln!("seed {seed}");
        let mut rng = Rng::new(seed);
        let len = rng.range(0, 60);
        let root = rng.below(8) as Rank;
        let pct = [0, 10, 50, 100][rng.below(4) as usize];
        let mut net = Net::new(&members, root, len);
        let mut drops = Rng::new(seed ^ 0xD0D0);
        net.drop = Box::new(move |_, _| drops.chance(pct, 100));
        let mut order: Vec<Rank> = (0..8).collect();
        rng.shuffle(&mut order);
        for r in order {
            net.post(r);
        }
        net.run();
        net.all_ok();
        let ring = net.m(0).ring().unwrap().to_vec();
        // Every request went to the sender's left neighbour.
        for (from, to, m) in &net.sent {
            if matches!(m, Msg::FetchReq { .. }) {
                let i = ring.iter().position(|s| s == from).unwrap();
                assert!(i > 0, "seed {seed}: the root's SP fetched");
                assert_eq!(*to, ring[i - 1], "seed {seed}");
            }
        }
        if pct == 100 {
            // Nothing landed: every leaf fetched, through the whole ring.
            assert_eq!(net.total().fetch_requests, 3, "seed {seed}");
        }
    }
}

#[test]
fn one_sp_copies_locally_and_sends_nothing() {
    let mut net = Net::new(&[3, 3, 3], 1, 9);
    net.post(0);
    net.post(2);
    assert!(net.done.is_empty(), "nothing before the root posts");
    net.post(1);
    net.run();
    net.all_ok();
    assert!(net.sent.is_empty());
    assert_eq!(net.total().local_copies, 2);
    assert_eq!(net.m(3).poll_timeout(), None);
}

#[test]
fn the_root_waits_for_a_late_rank_of_its_own_sp() {
    // Found by the simulator: the root's buffer is the only source of its
    // SP's other ranks, so the root may not complete before they posted.
    let mut net = Net::new(&[0, 1, 0], 0, 10);
    net.post(0);
    net.post(1);
    net.run();
    assert_eq!(net.status(1), Some(Status::Ok));
    assert_eq!(
        net.status(0),
        None,
        "rank 2 has not copied out of the root yet"
    );
    net.post(2);
    net.run();
    net.all_ok();
}

#[test]
fn a_zero_byte_message_is_one_empty_chunk() {
    let mut net = Net::new(&[0, 1, 2, 1], 2, 0);
    net.post_all();
    net.run();
    net.all_ok();
    let s = net.total();
    assert_eq!(s.chunks_multicast, 1);
    assert_eq!(s.chunks_landed, 2);
    // And with the chunk lost everywhere: fetched, no copy reaches the net.
    let mut net = Net::new(&[0, 1, 2, 1], 2, 0);
    net.drop = Box::new(|_, _| true);
    net.post_all();
    net.run();
    net.all_ok();
    assert_eq!(net.total().chunks_fetched, 2);
}

#[test]
fn the_cutoff_timer_is_len_over_bandwidth_plus_alpha_and_sent_rearms_it() {
    let mut m = McastBcast::<Tag>::new(
        KEY,
        Config {
            link_bytes_per_ns: 2,
            alpha_ns: 500,
            ..cfg(1)
        },
    );
    let post = |rank| Post {
        rank,
        root: 0,
        members: vec![0, 1, 1],
        key: rank,
        len: 101,
    };
    m.handle_post(100, post(1)).unwrap();
    assert_eq!(m.poll_timeout(), None, "not every local rank posted");
    m.handle_post(200, post(2)).unwrap();
    assert_eq!(m.poll_timeout(), Some(200 + 51 + 500));
    let acts: Vec<_> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(matches!(&acts[0], Action::Register(r) if r.chunks == 26 && r.keys.len() == 2));
    assert_eq!(
        acts[1],
        Action::Send {
            to: 0,
            msg: Msg::Ready {
                root: 0,
                len: 101,
                mtu: MTU
            }
        }
    );
    // Early calls do nothing.
    m.handle_timeout(300);
    assert_eq!(m.poll_timeout(), Some(751));
    m.handle_msg(
        400,
        0,
        Msg::Sent {
            root: 0,
            len: 101,
            mtu: MTU,
        },
    )
    .unwrap();
    assert_eq!(m.poll_timeout(), Some(900));
    for psn in (0..26).filter(|p| p % 5 != 3) {
        m.handle_landed(500, psn);
    }
    // Chunks landed less than alpha before the deadline: the multicast is
    // still arriving here, the scan waits until alpha after the last one.
    m.handle_timeout(900);
    assert_eq!(m.poll_timeout(), Some(1000));
    assert_eq!(m.stats().cutoffs_extended, 1);
    assert_eq!(m.poll_action(), None, "no fetch while chunks land");
    m.handle_timeout(1000);
    assert_eq!(m.poll_timeout(), None);
    let acts: Vec<_> = std::iter::from_fn(|| m.poll_action()).collect();
    assert_eq!(
        acts,
        vec![Action::Send {
            to: 0,
            msg: Msg::FetchReq {
                root: 0,
                len: 101,
                mtu: MTU,
                ranges: vec![(3, 4), (8, 9), (13, 14), (18, 19), (23, 24)]
            }
        }]
    );
    assert_eq!(m.stats().cutoffs_missing, 1);
    assert_eq!(m.stats().cutoffs_extended, 1);
}

/// The cutoff is put off only by chunks that are new here, so a trickle of
/// landings cannot hold a leaf forever: at most one extension per chunk, and
/// duplicates or late reports of chunks already in extend nothing.
#[test]
fn the_cutoff_is_put_off_only_by_chunks_new_here() {
    let alpha = 100;
    for seed in 1..=40u64 {
        eprintln!("seed {seed}");
        let mut rng = Rng::new(seed);
        let mut m = McastBcast::<Tag>::new(
            KEY,
            Config {
                link_bytes_per_ns: 1,
                alpha_ns: alpha,
                ..cfg(1)
            },
        );
        let len = 40 * MTU - 3;
        let n = len.div_ceil(MTU);
        m.handle_post(
            0,
            Post {
                rank: 1,
                root: 0,
                members: vec![0, 1],
                key: 1,
                len,
            },
        )
        .unwrap();
        let first = m.poll_timeout().unwrap();
        let (mut now, mut landed, mut last_new, mut steps) = (0, 0, 0, 0);
        // Land new chunks and duplicates at random times until the scan; the
        // last chunk never lands.
        while let Some(deadline) = m.poll_timeout() {
            steps += 1;
            assert!(steps < 100 * n, "seed {seed}: the cutoff never fired");
            if rng.chance(2, 3) {
                now = (now + rng.range(0, alpha)).min(deadline);
                if landed < n - 1 && rng.chance(1, 2) {
                    landed += 1;
                    last_new = now;
                    m.handle_landed(now, landed - 1);
                } else if landed > 0 {
                    m.handle_landed(now, rng.below(landed));
                }
            } else {
                now = deadline;
                m.handle_timeout(now);
            }
        }
        assert!(
            now <= first.max(last_new + alpha),
            "seed {seed}: scanned at {now}, the deadline was {first}, the last new chunk at {last_new}"
        );
        let st = m.stats();
        assert!(
            st.cutoffs_extended <= st.chunks_landed,
            "seed {seed}: {} extensions for {} new chunks",
            st.cutoffs_extended,
            st.chunks_landed
        );
        assert_eq!(st.cutoffs_missing, 1, "seed {seed}: one chunk never landed");
        assert!(
            std::iter::from_fn(|| m.poll_action()).any(|a| matches!(
                a,
                Action::Send {
                    msg: Msg::FetchReq { .. },
                    ..
                }
            )),
            "seed {seed}: the scan fetches"
        );
    }
}

#[test]
fn ranks_wait_for_the_right_neighbours_final() {
    // Ring 0 (root), 1, 2. SP 1 gets everything; SP 2 nothing yet.
    let mut net = Net::new(&[0, 1, 2], 0, 8);
    net.drop = Box::new(|sp, _| sp == 2);
    net.post_all();
    while net.step() {}
    // SP 1 has everything and told the root's SP so: the root is done.
    assert!(net.m(1).has_all());
    assert_eq!(net.status(0), Some(Status::Ok));
    assert_eq!(
        net.status(1),
        None,
        "SP 1 waits for SP 2's Final: SP 2 may read it"
    );
    net.run();
    net.all_ok();
    assert_eq!(net.m(2).stats().chunks_fetched, 2);
    assert_eq!(net.m(1).stats().fetches_served, 1);
}

fn first_error(net: &Net) -> Vec<Status> {
    let mut v: Vec<Status> = net.done.iter().map(|d| d.2).collect();
    v.sort();
    v.dedup();
    v
}

#[test]
fn a_lost_peer_aborts_everyone_without_hanging() {
    let mut net = Net::new(&[0, 1, 2, 1], 0, 12);
    net.drop = Box::new(|sp, _| sp == 2);
    net.post_all();
    while net.step() {}
    // SP 1 dies before SP 2's timer fires.
    net.dead.insert(1);
    for sp in [0, 2] {
        let now = net.now;
        net.m(sp).handle_peer_lost(now, 1);
        net.collect(sp);
    }
    net.run();
    // The root completed once SP 1 had everything; SP 2 cannot.
    assert_eq!(net.status(0), Some(Status::Ok));
    assert_eq!(net.status(2), Some(Status::PeerFailed));
    for sp in [0, 2] {
        assert!(net.m(sp).is_finished(), "SP {sp}");
    }
}

#[test]
fn a_failed_copy_or_multicast_aborts_with_access_error() {
    for fail_at_root in [true, false] {
        let mut net = Net::new(&[0, 0, 1, 2], 0, 12);
        net.fail_copies = true;
        if !fail_at_root {
            net.drop = Box::new(|sp, _| sp == 2);
        }
        net.post_all();
        net.run();
        assert_eq!(first_error(&net), vec![Status::AccessError]);
        assert_eq!(net.done.len(), 4);
        for m in net.sps.values() {
            assert!(m.is_finished());
        }
    }
}

#[test]
fn a_lost_rank_aborts_with_rank_failed_before_and_after_ready() {
    for before in [true, false] {
        let mut net = Net::new(&[0, 1, 1, 2], 0, 12);
        for r in [0, 1, 3] {
            net.post(r);
        }
        if !before {
            net.post(2);
        }
        let now = net.now;
        net.m(1).handle_rank_lost(now, 2);
        net.collect(1);
        net.run();
        assert_eq!(first_error(&net), vec![Status::RankFailed]);
        let expect = if before { 3 } else { 4 };
        assert_eq!(net.done.len(), expect);
        for m in net.sps.values() {
            assert!(m.is_finished());
        }
    }
}

#[test]
fn an_sp_whose_only_rank_died_unposted_still_reaches_everyone() {
    // Found by the simulator's random sweep: such an SP has no view, so it
    // cannot broadcast its abort when it begins.
    // The root, alone on its SP: the leaves' `Ready`s are answered `Abort`.
    let mut net = Net::new(&[0, 1, 2, 2], 0, 12);
    net.m(0).handle_rank_lost(1, 0);
    for r in 1..4 {
        net.post(r);
    }
    net.run();
    assert_eq!(net.done.len(), 3);
    assert_eq!(first_error(&net), vec![Status::RankFailed]);
    // A leaf alone on its SP: the root's `Open` names the ring, and the
    // leaf tells it all.
    let mut net = Net::new(&[0, 1, 2, 0], 0, 12);
    net.m(2).handle_rank_lost(1, 2);
    for r in [0, 1, 3] {
        net.post(r);
    }
    net.run();
    assert_eq!(net.done.len(), 3);
    assert_eq!(first_error(&net), vec![Status::RankFailed]);
    assert!(net
        .sps
        .values()
        .all(|m| m.is_finished() || m.members().is_none()));
}

#[test]
fn disagreeing_posts_abort() {
    // A leaf with another length: the root's SP sees its Ready.
    let mut net = Net::new(&[0, 1, 2], 0, 12);
    net.post(0);
    net.post(1);
    let mut p = net.post_of(2);
    p.len = 11;
    let now = net.now;
    net.m(2).handle_post(now, p).unwrap();
    net.collect(2);
    net.run();
    assert_eq!(first_error(&net), vec![Status::CountMismatch]);
    assert_eq!(net.done.len(), 3);
    // A leaf naming a root on its own SP: it waits for Readys that go
    // elsewhere, but the true root's Open reaches it.
    let mut net = Net::new(&[0, 1, 2], 0, 12);
    net.post(0);
    net.post(1);
    let mut p = net.post_of(2);
    p.root = 2;
    let now = net.now;
    net.m(2).handle_post(now, p).unwrap();
    net.collect(2);
    net.run();
    assert_eq!(first_error(&net), vec![Status::CountMismatch]);
    assert_eq!(net.done.len(), 3);
    // Another MTU: InvalidPost.
    let mut net = Net::new(&[0, 1], 0, 12);
    net.sps
        .insert(1, McastBcast::new(KEY, Config { mtu: 8, ..cfg(1) }));
    net.post_all();
    net.run();
    assert_eq!(first_error(&net), vec![Status::InvalidPost]);
}

#[test]
fn posts_are_checked() {
    let mut m = McastBcast::<Tag>::new(KEY, cfg(1));
    let post = |rank, root, members: &[SpId]| Post {
        rank,
        root,
        members: members.to_vec(),
        key: rank,
        len: 3,
    };
    assert_eq!(
        m.handle_post(0, post(0, 0, &[1, 2])),
        Ok(()),
        "a valid post"
    );
    assert_eq!(
        m.handle_post(0, post(0, 0, &[1, 2])),
        Err(PostError::DuplicatePost { rank: 0 })
    );
    assert_eq!(
        m.handle_post(0, post(1, 0, &[1, 2])),
        Err(PostError::NotMine {
            rank: 1,
            served_by: 2
        })
    );
    assert_eq!(
        m.handle_post(0, post(2, 0, &[1, 2])),
        Err(PostError::RankOutOfRange { rank: 2, size: 2 })
    );
    let mut m = McastBcast::<Tag>::new(KEY, cfg(1));
    assert_eq!(
        m.handle_post(0, post(0, 5, &[1, 2])),
        Err(PostError::RootOutOfRange { root: 5, size: 2 })
    );
    let mut m = McastBcast::<Tag>::new(KEY, cfg(1));
    m.handle_post(0, post(0, 0, &[1, 1, 2])).unwrap();
    assert_eq!(
        m.handle_post(0, post(1, 0, &[1, 1, 3])),
        Err(PostError::MembersDisagree)
    );
}

#[test]
fn messages_are_checked() {
    let view = (0, 8, MTU);
    let (root, len, mtu) = view;
    // SP 2 of ring 0, 1, 2 (left 1, right 0), every rank posted.
    let mut m = McastBcast::<Tag>::new(KEY, cfg(2));
    m.handle_post(
        0,
        Post {
            rank: 2,
            root,
            members: vec![0, 1, 2],
            key: 2,
            len,
        },
    )
    .unwrap();
    let req = |ranges| Msg::FetchReq {
        root,
        len,
        mtu,
        ranges,
    };
    assert_eq!(
        m.handle_msg(1, 9, Msg::Final { root, len, mtu }),
        Err(MsgError::NotMember { sp: 9 })
    );
    assert_eq!(
        m.handle_msg(1, 1, req(vec![(0, 1)])),
        Err(MsgError::BadFetch { sp: 1 }),
        "from the left"
    );
    assert_eq!(
        m.handle_msg(1, 0, req(vec![(0, 3)])),
        Err(MsgError::BadFetch { sp: 0 }),
        "beyond n"
    );
    assert_eq!(
        m.handle_msg(1, 0, req(vec![(1, 2), (0, 1)])),
        Err(MsgError::BadFetch { sp: 0 }),
        "unsorted"
    );
    assert_eq!(
        m.handle_msg(1, 0, req(vec![])),
        Err(MsgError::BadFetch { sp: 0 }),
        "empty"
    );
    assert_eq!(
        m.handle_msg(1, 1, Msg::FetchAck { key: 0 }),
        Err(MsgError::UnexpectedAck { sp: 1 })
    );
    assert_eq!(
        m.handle_msg(1, 1, Msg::Final { root, len, mtu }),
        Err(MsgError::UnexpectedFinal { sp: 1 })
    );
    assert_eq!(
        m.handle_msg(1, 1, Msg::Sent { root, len, mtu }),
        Err(MsgError::NotRoot { sp: 1 })
    );
    let open = |ring: Vec<SpId>| Msg::Open {
        root,
        len,
        mtu,
        subgroups: 2,
        ring,
    };
    assert_eq!(
        m.handle_msg(1, 1, open(vec![0, 1, 2])),
        Err(MsgError::NotRoot { sp: 1 })
    );
    m.handle_msg(1, 0, open(vec![0, 1, 2])).unwrap();
    assert_eq!(
        m.handle_msg(1, 0, open(vec![0, 1, 2])),
        Err(MsgError::Duplicate { sp: 0 })
    );
    m.handle_msg(2, 0, Msg::Final { root, len, mtu }).unwrap();
    assert_eq!(
        m.handle_msg(2, 0, Msg::Final { root, len, mtu }),
        Err(MsgError::Duplicate { sp: 0 })
    );
    assert_eq!(m.abort_status(), None);
    // Before any post: buffered, but bounded.
    let mut m = McastBcast::<Tag>::new(KEY, cfg(2));
    for _ in 0..EARLY {
        m.handle_msg(0, 1, Msg::Final { root, len, mtu }).unwrap();
    }
    assert_eq!(
        m.handle_msg(0, 1, Msg::Final { root, len, mtu }),
        Err(MsgError::TooEarly { sp: 1 })
    );
}

/// `messages::EARLY_PER_SP`.
const EARLY: usize = 6;
