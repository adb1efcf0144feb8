//! The SP tree by hand: SPs exchanging messages in memory, reads and writes on a memory of
//! rank buffers, with failures injected between steps (in the style of `sim/testnet.rs`).

use super::*;
use crate::sim::rng::Rng;
use std::collections::HashMap;

const KEY: CollKey = CollKey {
    job: 1,
    comm: crate::CommId { leader: 0, id: 7 },
    seq: 0,
};

/// A buffer: (comm rank, 's' send or 'r' receive).
type Tag = (Rank, char);

struct Net {
    sps: BTreeMap<SpId, Allreduce<Tag>>,
    dead: BTreeSet<SpId>,
    msgs: VecDeque<(SpId, SpId, Msg)>,
    /// Copies handed out, with a write's bytes as they were when it was (as the driver fills
    /// its buffer then).
    copies: VecDeque<(SpId, Action<Tag>, Vec<u8>)>,
    mem: HashMap<Tag, Vec<u8>>,
    completes: Vec<(SpId, Rank, Status)>,
    /// Reads of these ranks fail.
    bad_read: BTreeSet<Rank>,
    now: Nanos,
    /// Most chunks any SP held in progress at once.
    peak_chunks: usize,
    /// `Between::Network`: the outside aggregation's reduction, and the contributions of
    /// each chunk so far (by SP).
    outside: Option<Reduce>,
    contribs: BTreeMap<u32, BTreeMap<SpId, Vec<u8>>>,
    /// The outside aggregation of this chunk fails at this SP.
    fail_outside: Option<(u32, SpId)>,
}

impl Net {
    fn new(members: &[SpId]) -> Net {
        Net::chunked(members, 1 << 20)
    }

    fn chunked(members: &[SpId], chunk_bytes: u64) -> Net {
        Net::with(members, chunk_bytes, Between::Tree)
    }

    /// SPs combining their chunks outside (`Between::Network`) by `reduce`, in the SPs'
    /// position order.
    fn outside(members: &[SpId], chunk_bytes: u64, reduce: Reduce) -> Net {
        let mut net = Net::with(members, chunk_bytes, Between::Network);
        net.outside = Some(reduce);
        net
    }

    fn with(members: &[SpId], chunk_bytes: u64, between: Between) -> Net {
        Net {
            sps: tree_sps(members)
                .into_iter()
                .map(|sp| {
                    (
                        sp,
                        Allreduce::new(
                            KEY,
                            Config {
                                me: sp,
                                chunk_bytes,
                                between,
                            },
                        ),
                    )
                })
                .collect(),
            dead: BTreeSet::new(),
            msgs: VecDeque::new(),
            copies: VecDeque::new(),
            mem: HashMap::new(),
            completes: Vec::new(),
            bad_read: BTreeSet::new(),
            now: 0,
            peak_chunks: 0,
            outside: None,
            contribs: BTreeMap::new(),
            fail_outside: None,
        }
    }

    fn collect(&mut self, sp: SpId) {
        let held = self.sps[&sp].chunks_in_progress();
        self.peak_chunks = self.peak_chunks.max(held);
        while let Some(a) = self.sps.get_mut(&sp).unwrap().poll_action() {
            match a {
                Action::Send { to, msg } => {
                    assert_ne!(to, sp, "send to self");
                    self.msgs.push_back((sp, to, msg));
                }
                Action::Contribute { chunk, data } => {
                    assert!(self.outside.is_some(), "a contribution in a tree");
                    let prev = self.contribs.entry(chunk).or_default().insert(sp, data);
                    assert!(prev.is_none(), "SP {sp} contributed chunk {chunk} twice");
                }
                Action::Complete { rank, status } => {
                    assert!(
                        !self.completes.iter().any(|&(_, r, _)| r == rank),
                        "rank {rank} completed twice"
                    );
                    self.completes.push((sp, rank, status));
                }
                c => {
                    let bytes = match &c {
                        Action::Write { chunk, .. } => self.sps[&sp]
                            .result(*chunk)
                            .expect("a write before the result")
                            .to_vec(),
                        _ => Vec::new(),
                    };
                    self.copies.push_back((sp, c, bytes));
                }
            }
        }
    }

    fn post(&mut self, sp: SpId, p: Post<Tag>) {
        self.now += 10;
        let now = self.now;
        self.sps.get_mut(&sp).unwrap().handle_post(now, p).unwrap();
        self.collect(sp);
    }

    fn step(&mut self) -> bool {
        self.now += 1;
        let now = self.now;
        if let Some((from, to, msg)) = self.msgs.pop_front() {
            if !self.dead.contains(&to) {
                self.sps
                    .get_mut(&to)
                    .unwrap()
                    .handle_msg(now, from, msg)
                    .unwrap();
                self.collect(to);
            }
            return true;
        }
        if let Some((sp, c, r)) = self.copies.pop_front() {
            if self.dead.contains(&sp) {
                return true;
            }
            let m = self.sps.get_mut(&sp).unwrap();
            match c {
                Action::Read {
                    id,
                    rank,
                    key,
                    offset,
                    len,
                } => {
                    let (at, end) = (offset as usize, (offset + len) as usize);
                    let data = self.mem[&key][at..end].to_vec();
                    let st = if self.bad_read.contains(&rank) {
                        Status::AccessError
                    } else {
                        Status::Ok
                    };
                    m.handle_copy_done(now, id, st, data);
                }
                Action::Write {
                    id,
                    key,
                    chunk,
                    offset,
                    len,
                    ..
                } => {
                    let _ = chunk;
                    assert_eq!(r.len() as u64, len);
                    let buf = self.mem.entry(key).or_default();
                    let end = (offset + len) as usize;
                    if buf.len() < end {
                        buf.resize(end, 0);
                    }
                    buf[offset as usize..end].copy_from_slice(&r);
                    m.handle_copy_done(now, id, Status::Ok, Vec::new());
                }
                _ => unreachable!(),
            }
            self.collect(sp);
            return true;
        }
        // A chunk every live SP contributed: its result to each of them.
        let live: Vec<SpId> = self
            .sps
            .keys()
            .copied()
            .filter(|s| !self.dead.contains(s))
            .collect();
        let full = self
            .contribs
            .iter()
            .find(|(_, c)| c.len() == self.sps.len())
            .map(|(&i, _)| i);
        if let (Some(i), Some(reduce)) = (full, self.outside) {
            let parts = self.contribs.remove(&i).unwrap();
            let mut it = parts.values();
            let mut acc = it.next().cloned().unwrap_or_default();
            for x in it {
                reduce_into(reduce, &mut acc, x).unwrap();
            }
            for sp in live {
                let r = match self.fail_outside {
                    Some((c, at)) if c == i && at == sp => Err(Status::NetworkFailed),
                    _ => Ok(acc.clone()),
                };
                let m = self.sps.get_mut(&sp).unwrap();
                if m.abort_status().is_none() {
                    m.handle_outside(now, i, r).unwrap();
                }
                self.collect(sp);
            }
            return true;
        }
        false
    }

    fn run(&mut self) {
        let mut n = 0;
        while self.step() {
            n += 1;
            assert!(n < 1_000_000, "no end");
        }
    }

    fn status(&self, rank: Rank) -> Option<Status> {
        self.completes
            .iter()
            .find(|&&(_, r, _)| r == rank)
            .map(|&(_, _, s)| s)
    }
}

fn post(members: &[SpId], rank: Rank, len: u64, reduce: Reduce) -> Post<Tag> {
    Post {
        rank,
        members: members.to_vec(),
        send: (rank, 's'),
        recv: (rank, 'r'),
        len,
        reduce,
    }
}

const SUM_I64: Reduce = Reduce {
    op: Op::Sum,
    elem: Elem::I64,
};

fn i64s(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// Random placements (1 to 9 SPs, ranks spread unevenly, posts in random order, messages
/// and copies interleaved as they come): every rank receives the sum of every rank's
/// contribution, and every instance finishes.
#[test]
fn random_trees_sum_every_contribution() {
    let seed = 0xa11_0ed5 ^ std::process::id() as u64;
    println!("seed {seed:#x}");
    let mut rng = Rng::new(seed);
    for round in 0..200 {
        let p = rng.range(1, 20) as usize;
        let nsp = rng.range(1, 9) as u32;
        let members: Vec<SpId> = (0..p).map(|_| rng.below(nsp as u64) as SpId).collect();
        let n = rng.below(40) as usize;
        // One chunk, or 1 to 5 elements a chunk (many chunks through the window).
        let chunk = if rng.chance(1, 2) {
            1 << 20
        } else {
            8 * rng.range(1, 5)
        };
        let mut net = Net::chunked(&members, chunk);
        let mut want = vec![0i64; n];
        for r in 0..p as Rank {
            let v: Vec<i64> = (0..n).map(|_| rng.next_u64() as i64 >> 4).collect();
            for (w, x) in want.iter_mut().zip(&v) {
                *w = w.wrapping_add(*x);
            }
            net.mem.insert((r, 's'), i64s(&v));
        }
        let mut order: Vec<Rank> = (0..p as Rank).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        for r in order {
            net.post(
                members[r as usize],
                post(&members, r, 8 * n as u64, SUM_I64),
            );
            for _ in 0..rng.below(4) {
                net.step();
            }
        }
        net.run();
        for r in 0..p as Rank {
            assert_eq!(
                net.status(r),
                Some(Status::Ok),
                "round {round} seed {seed:#x}"
            );
            if n > 0 {
                assert_eq!(net.mem[&(r, 'r')], i64s(&want), "rank {r} round {round}");
            }
        }
        assert!(net.sps.values().all(|m| m.is_finished()), "round {round}");
        assert!(
            net.peak_chunks <= 2 * WINDOW as usize,
            "an SP held {} chunks at once (round {round})",
            net.peak_chunks
        );
    }
}

/// Floating point: the result is the same bytes on every rank and in every delivery order
/// (the reduction order is fixed by the placement), for one placement run twice with
/// different interleavings.
#[test]
fn float_sums_are_one_value_whatever_the_timing() {
    let seed = 0xf10a7 ^ std::process::id() as u64;
    println!("seed {seed:#x}");
    let mut rng = Rng::new(seed);
    let members: Vec<SpId> = vec![0, 1, 2, 3, 0, 1, 2, 3, 4, 4, 5];
    let r = Reduce {
        op: Op::Sum,
        elem: Elem::F64,
    };
    let vals: Vec<Vec<u8>> = (0..members.len())
        .map(|_| {
            (0..16)
                .flat_map(|_| ((rng.next_u64() >> 11) as f64 * 1e-3).to_ne_bytes())
                .collect()
        })
        .collect();
    let mut results = Vec::new();
    for run in 0..5 {
        // Chunks of 3 elements (the last one shorter) or one block: the same bytes.
        let mut net = Net::chunked(&members, if run % 2 == 0 { 24 } else { 1 << 20 });
        for (i, v) in vals.iter().enumerate() {
            net.mem.insert((i as Rank, 's'), v.clone());
        }
        let mut order: Vec<Rank> = (0..members.len() as Rank).collect();
        if run > 0 {
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
        }
        for q in order {
            net.post(members[q as usize], post(&members, q, 128, r));
            for _ in 0..rng.below(6) {
                net.step();
            }
        }
        net.run();
        for q in 0..members.len() as Rank {
            assert_eq!(net.status(q), Some(Status::Ok));
            assert_eq!(net.mem[&(q, 'r')], net.mem[&(0, 'r')], "rank {q}");
        }
        results.push(net.mem[&(0, 'r')].clone());
    }
    assert!(results.windows(2).all(|w| w[0] == w[1]), "seed {seed:#x}");
}

/// The tree: every position but the root has one parent, which lists it as a child, and the
/// root reaches every position.
#[test]
fn the_binomial_tree_spans_every_position_once() {
    for n in 1..70 {
        let mut seen = vec![false; n];
        let mut stack = vec![0];
        while let Some(i) = stack.pop() {
            assert!(!seen[i], "{i} twice in {n}");
            seen[i] = true;
            let (_, ch) = tree(i, n);
            for c in ch {
                assert_eq!(tree(c, n).0, Some(i));
                stack.push(c);
            }
        }
        assert!(seen.iter().all(|s| *s), "{n}");
    }
}

/// An SP of the tree lost before the result: every rank of the other SPs completes with
/// `PeerFailed` (none hangs), and their instances finish.
#[test]
fn a_lost_sp_fails_every_other_rank() {
    let members = vec![0, 1, 2, 3, 0, 1, 2, 3];
    for dead in 1..4u32 {
        let mut net = Net::new(&members);
        for r in 0..8 {
            net.mem.insert((r, 's'), i64s(&[r as i64]));
        }
        for r in 0..8 {
            if members[r as usize] != dead {
                net.post(members[r as usize], post(&members, r, 8, SUM_I64));
            }
        }
        net.run();
        net.dead.insert(dead);
        let now = net.now;
        for sp in [0, 1, 2, 3] {
            if sp != dead {
                net.sps.get_mut(&sp).unwrap().handle_peer_lost(now, dead);
                net.collect(sp);
            }
        }
        net.run();
        for r in 0..8 {
            let want = (members[r as usize] != dead).then_some(Status::PeerFailed);
            assert_eq!(net.status(r), want, "rank {r}, SP {dead} lost");
        }
        for sp in [0, 1, 2, 3] {
            if sp != dead {
                assert!(net.sps[&sp].is_finished(), "SP {sp}");
            }
        }
    }
}

/// A rank lost before it posted: its SP aborts with `RankFailed` and tells the others, whose
/// ranks complete with it; every instance finishes.
#[test]
fn a_lost_rank_fails_the_allreduce_everywhere() {
    let members = vec![0, 1, 1, 2];
    let mut net = Net::new(&members);
    for r in 0..4 {
        net.mem.insert((r, 's'), i64s(&[1]));
    }
    for r in [0, 1, 3] {
        net.post(members[r as usize], post(&members, r, 8, SUM_I64));
    }
    net.run();
    let now = net.now;
    net.sps.get_mut(&1).unwrap().handle_rank_lost(now, 2);
    net.collect(1);
    net.run();
    for r in [0, 1, 3] {
        assert_eq!(net.status(r), Some(Status::RankFailed), "rank {r}");
    }
    assert_eq!(net.status(2), None);
    assert!(net.sps.values().all(|m| m.is_finished()));
}

/// A failed read of one rank's buffer fails the allreduce on every rank (`AccessError`).
#[test]
fn a_failed_read_fails_every_rank() {
    let members = vec![0, 1, 0, 1];
    let mut net = Net::new(&members);
    net.bad_read.insert(3);
    for r in 0..4 {
        net.mem.insert((r, 's'), i64s(&[1]));
        net.post(members[r as usize], post(&members, r, 8, SUM_I64));
    }
    net.run();
    for r in 0..4 {
        assert_eq!(net.status(r), Some(Status::AccessError), "rank {r}");
    }
    assert!(net.sps.values().all(|m| m.is_finished()));
}

/// Posts that disagree on the reduction across SPs: `CountMismatch` on every rank; within
/// one SP: the second post is refused.
#[test]
fn disagreeing_posts_fail_and_never_mix() {
    let members = vec![0, 1];
    let mut net = Net::new(&members);
    for r in 0..2 {
        net.mem.insert((r, 's'), i64s(&[1]));
    }
    net.post(0, post(&members, 0, 8, SUM_I64));
    let max = Reduce {
        op: Op::Max,
        elem: Elem::I64,
    };
    net.post(1, post(&members, 1, 8, max));
    net.run();
    for r in 0..2 {
        assert_eq!(net.status(r), Some(Status::CountMismatch), "rank {r}");
    }
    let two = vec![0, 0];
    let mut m: Allreduce<Tag> = Allreduce::new(
        KEY,
        Config {
            me: 0,
            chunk_bytes: 64,
            between: Between::Tree,
        },
    );
    m.handle_post(0, post(&two, 0, 8, SUM_I64)).unwrap();
    assert!(m.handle_post(0, post(&two, 1, 8, max)).is_err());
    assert!(m
        .handle_post(0, post(&two, 1, 16, SUM_I64))
        .is_err_and(|e| e.0.contains("differs")));
    let bad = Reduce {
        op: Op::Bxor,
        elem: Elem::F32,
    };
    let mut m: Allreduce<Tag> = Allreduce::new(
        KEY,
        Config {
            me: 0,
            chunk_bytes: 64,
            between: Between::Tree,
        },
    );
    assert!(m.handle_post(0, post(&two, 0, 8, bad)).is_err());
}

/// An abort from the engine (the job failed) before any post: the ranks complete with it as
/// they post.
#[test]
fn an_abort_before_the_posts_completes_them_as_they_come() {
    let members = vec![0, 0, 1];
    let mut net = Net::new(&members);
    let now = net.now;
    net.sps.get_mut(&0).unwrap().abort(now, Status::Aborted);
    net.collect(0);
    for r in 0..3 {
        net.mem.insert((r, 's'), i64s(&[1]));
        net.post(members[r as usize], post(&members, r, 8, SUM_I64));
    }
    net.run();
    // SP 1 learns from its own post nothing of SP 0's abort (SP 0 had no view to tell it):
    // only SP 0's ranks complete here; SP 1 waits for its job's abort (JobAbort).
    assert_eq!(net.status(0), Some(Status::Aborted));
    assert_eq!(net.status(1), Some(Status::Aborted));
    let now = net.now;
    net.sps.get_mut(&1).unwrap().abort(now, Status::Aborted);
    net.collect(1);
    net.run();
    assert_eq!(net.status(2), Some(Status::Aborted));
    assert!(net.sps.values().all(|m| m.is_finished()));
}

/// Before its first post an SP keeps `WINDOW` messages per peer (a child's window of
/// chunks): one more from the same SP is refused.
#[test]
fn a_window_of_early_messages_per_peer() {
    let mut m: Allreduce<Tag> = Allreduce::new(
        KEY,
        Config {
            me: 0,
            chunk_bytes: 64,
            between: Between::Tree,
        },
    );
    let up = |chunk| Msg::Up {
        len: 8 * 64,
        reduce: SUM_I64,
        chunk,
        data: Bytes(vec![0; 64]),
    };
    for c in 0..WINDOW {
        m.handle_msg(0, 1, up(c)).unwrap();
    }
    assert!(m.handle_msg(0, 1, up(WINDOW)).is_err());
    m.handle_msg(0, 2, up(0)).unwrap();
}

/// An abort in the middle of a pipelined allreduce (some chunks written, reads and writes
/// queued or in flight): every posted rank completes with the abort's status once its copies
/// are done, no read or write starts after it, and every instance finishes.
#[test]
fn an_abort_mid_pipeline_ends_every_rank() {
    let seed = 0xab0e7 ^ std::process::id() as u64;
    println!("seed {seed:#x}");
    let mut rng = Rng::new(seed);
    let members = vec![0, 1, 2, 0, 1, 2];
    for round in 0..50 {
        let mut net = Net::chunked(&members, 16);
        for r in 0..6 {
            net.mem.insert((r, 's'), i64s(&[r as i64; 20]));
            net.post(members[r as usize], post(&members, r, 160, SUM_I64));
        }
        for _ in 0..rng.below(60) {
            net.step();
        }
        let now = net.now;
        let sp = rng.below(3) as SpId;
        net.sps.get_mut(&sp).unwrap().abort(now, Status::Aborted);
        net.collect(sp);
        net.run();
        for r in 0..6 {
            let st = net.status(r);
            assert!(
                st == Some(Status::Aborted) || st == Some(Status::Ok),
                "rank {r}: {st:?} (round {round}, seed {seed:#x})"
            );
        }
        // The SP that aborted completes its ranks with the abort's status (or Ok, had they
        // been written completely before).
        assert!(net.sps.values().all(|m| m.is_finished()), "round {round}");
    }
}

/// `Between::Network` (the Canary design's SP side): random placements and chunkings, each SP
/// reducing its local ranks and handing the chunk out, the outside combining every SP's:
/// every rank gets the sum of every contribution, every SP's instance finishes, no `Up` or
/// `Down` travels (no message at all), and an SP holds at most `WINDOW` chunks.
#[test]
fn outside_aggregation_sums_every_contribution() {
    let seed = 0x0007_51de ^ std::process::id() as u64;
    println!("seed {seed:#x}");
    let mut rng = Rng::new(seed);
    for round in 0..200 {
        let p = rng.range(1, 20) as usize;
        let nsp = rng.range(1, 9) as u32;
        let members: Vec<SpId> = (0..p).map(|_| rng.below(nsp as u64) as SpId).collect();
        let n = rng.below(40) as usize;
        let chunk = if rng.chance(1, 2) {
            1 << 20
        } else {
            8 * rng.range(1, 5)
        };
        let mut net = Net::outside(&members, chunk, SUM_I64);
        let mut want = vec![0i64; n];
        for r in 0..p as Rank {
            let v: Vec<i64> = (0..n).map(|_| rng.next_u64() as i64 >> 4).collect();
            for (w, x) in want.iter_mut().zip(&v) {
                *w = w.wrapping_add(*x);
            }
            net.mem.insert((r, 's'), i64s(&v));
        }
        let mut order: Vec<Rank> = (0..p as Rank).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        for r in order {
            net.post(
                members[r as usize],
                post(&members, r, 8 * n as u64, SUM_I64),
            );
            assert!(net.msgs.is_empty(), "a message between SPs (round {round})");
            for _ in 0..rng.below(4) {
                net.step();
            }
        }
        net.run();
        for r in 0..p as Rank {
            assert_eq!(
                net.status(r),
                Some(Status::Ok),
                "round {round} seed {seed:#x}"
            );
            if n > 0 {
                assert_eq!(net.mem[&(r, 'r')], i64s(&want), "rank {r} round {round}");
            }
        }
        assert!(net.sps.values().all(|m| m.is_finished()), "round {round}");
        assert!(net.contribs.is_empty(), "round {round}");
        assert!(
            net.peak_chunks <= WINDOW as usize,
            "an SP held {} chunks at once (round {round})",
            net.peak_chunks
        );
    }
}

/// The outside aggregation of one chunk fails at one SP (Canary: its leader unreachable from
/// there): every rank on every SP completes with `NetworkFailed` (the failing SP tells the
/// others), none with `Ok`, and every instance finishes.
#[test]
fn a_failed_outside_chunk_fails_every_rank() {
    let seed = 0x0fa11 ^ std::process::id() as u64;
    println!("seed {seed:#x}");
    let mut rng = Rng::new(seed);
    for round in 0..50 {
        let members: Vec<SpId> = (0..rng.range(2, 12)).map(|i| (i % 4) as SpId).collect();
        let nsp = tree_sps(&members).len() as u64;
        let mut net = Net::outside(&members, 16, SUM_I64);
        let n = 2 * rng.range(1, 20) as usize;
        for r in 0..members.len() as Rank {
            net.mem.insert((r, 's'), i64s(&vec![r as i64; n]));
        }
        let chunks = (8 * n as u64).div_ceil(16) as u32;
        let at = rng.below(nsp) as SpId;
        net.fail_outside = Some((rng.below(chunks as u64) as u32, at));
        for r in 0..members.len() as Rank {
            net.post(
                members[r as usize],
                post(&members, r, 8 * n as u64, SUM_I64),
            );
        }
        net.run();
        for r in 0..members.len() as Rank {
            assert_eq!(
                net.status(r),
                Some(Status::NetworkFailed),
                "rank {r} round {round} seed {seed:#x}"
            );
        }
        assert!(net.sps.values().all(|m| m.is_finished()), "round {round}");
    }
}

/// A result nobody waits for (a chunk not contributed, or given twice) is refused, and a
/// tree instance takes none.
#[test]
fn an_outside_result_not_waited_for_is_refused() {
    let members = [0, 1];
    let mut net = Net::outside(&members, 16, SUM_I64);
    net.mem.insert((0, 's'), i64s(&[1, 2, 3, 4]));
    net.post(0, post(&members, 0, 32, SUM_I64));
    let m = net.sps.get_mut(&0).unwrap();
    assert!(m.handle_outside(0, 5, Ok(vec![0; 16])).is_err());
    net.run();
    // Chunk 0 is contributed by SP 0 only: its result may come, once.
    let m = net.sps.get_mut(&0).unwrap();
    assert!(m.handle_outside(0, 0, Ok(vec![0; 16])).is_ok());
    assert!(m.handle_outside(0, 0, Ok(vec![0; 16])).is_err());
    let mut tree = Net::new(&members);
    tree.mem.insert((0, 's'), i64s(&[1, 2]));
    tree.post(0, post(&members, 0, 16, SUM_I64));
    tree.run();
    let m = tree.sps.get_mut(&0).unwrap();
    assert!(m.handle_outside(0, 0, Ok(vec![0; 16])).is_err());
}
