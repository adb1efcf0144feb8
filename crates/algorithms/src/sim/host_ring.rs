//! The host-based ring Allgatherv ([`crate::host_ring`]) in virtual time:
//! the baseline of the late-arrival comparison. It runs on the allgatherv
//! simulator's [`SimConfig`]: the same seed gives the same blocks, receive
//! layouts and arrival times as [`super::allgatherv::run`] (the same draws
//! from the same generator), so the two runs differ only in the algorithm.
//!
//! No SP takes part: world rank `r` runs a [`HostRing`] from its arrival on,
//! sending to `r + 1` and receiving from `r - 1`. The cost model is the
//! SP simulators' ([`CostModel`](super::CostModel)): a step's transfer
//! starts once its send and its receive are both posted (a rendezvous, as
//! MPI libraries move large messages) and takes `msg_proc_ns` (the sending
//! rank's cost of a message) + the link's latency + (`msg_header_bytes` +
//! the block's length times `byte_weight`) at the link's bandwidth, the
//! inter-node figures when the two ranks are on different nodes; transfers
//! do not contend with each other, as the SP simulators' copies do not.
//! A rank copies its own block into its receive buffer when it arrives
//! (free). Checks, outside the ring: every receive buffer ends as native
//! allgatherv leaves it, every rank completes exactly once, the run ends.
//! One collective, no faults: other configs are refused.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::allgatherv::{check_recv_of, make_ops, Op, SimConfig};
use super::driver::world_arrivals;
use super::rng::Rng;
use super::{place_rank, SimFailure};
use crate::host_ring::{Action, HostRing};
use crate::{Nanos, Rank, Status};

/// Outcome of a ring run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingReport {
    pub seed: u64,
    pub world_size: u32,
    /// The last rank's completion.
    pub end_ns: Nanos,
    /// The last rank's arrival; `end_ns - last_arrival_ns` is the tail.
    pub last_arrival_ns: Nanos,
    pub transfers: u64,
    pub bytes_inter_node: u64,
}

enum Ev {
    Arrive { rank: Rank },
    Moved(Transfer),
}

#[derive(Clone, Copy, Debug)]
struct Transfer {
    from: Rank,
    to: Rank,
    step: u32,
    block: Rank,
}

struct Ring<'a> {
    cfg: &'a SimConfig,
    now: Nanos,
    seq: u64,
    events: u64,
    queue: BTreeMap<(Nanos, u64), Ev>,
    op: Op,
    rank_node: Vec<u32>,
    rings: Vec<HostRing>,
    /// Posted halves waiting for their other half, by (receiver, step).
    sends: BTreeMap<(Rank, u32), Transfer>,
    recvs: BTreeMap<(Rank, u32), Transfer>,
    transfers: u64,
    bytes_inter: u64,
}

/// Runs the ring on `cfg`'s blocks and arrivals.
pub fn run_ring(cfg: &SimConfig) -> Result<RingReport, SimFailure> {
    let fail = |what: String| SimFailure {
        seed: cfg.seed,
        what,
    };
    if cfg.ops != 1 || cfg.faults != Default::default() {
        return Err(fail("the ring runs one collective without faults".into()));
    }
    if cfg.nodes == 0 || cfg.ranks_per_node == 0 || cfg.sps_per_node == 0 {
        return Err(fail(
            "invalid config: nodes, ranks_per_node, sps_per_node must be > 0".into(),
        ));
    }
    // The draws of the allgatherv simulator: Core::new forks the run's
    // generator first, then the blocks, then the arrivals.
    let mut setup = Rng::new(cfg.seed);
    let _run = setup.fork();
    let mut ops = make_ops(cfg, &mut setup);
    let w = cfg.world_size();
    let arrivals = world_arrivals(&cfg.common, w, &mut setup);
    let mut ring = Ring {
        cfg,
        now: 0,
        seq: 0,
        events: 0,
        queue: BTreeMap::new(),
        op: ops.remove(0),
        rank_node: (0..w)
            .map(|r| {
                place_rank(
                    cfg.layout,
                    cfg.nodes,
                    cfg.ranks_per_node,
                    cfg.sps_per_node,
                    r,
                )
                .0
            })
            .collect(),
        rings: (0..w).map(|r| HostRing::new(r, w)).collect(),
        sends: BTreeMap::new(),
        recvs: BTreeMap::new(),
        transfers: 0,
        bytes_inter: 0,
    };
    for (r, &t) in arrivals[0].iter().enumerate() {
        ring.schedule(t, Ev::Arrive { rank: r as Rank });
    }
    while let Some(((t, _), ev)) = ring.queue.pop_first() {
        ring.now = t;
        ring.events += 1;
        if ring.events > cfg.max_events || t > cfg.max_virtual_ns {
            return Err(ring.fail("no termination within the bounds".into()));
        }
        match ev {
            Ev::Arrive { rank } => {
                let r = rank as usize;
                let (at, len) = (
                    ring.op.recv_displs[r][r] as usize,
                    ring.op.send_buf[r].len(),
                );
                let own = ring.op.send_buf[r].clone();
                ring.op.recv_buf[r][at..at + len].copy_from_slice(&own);
                ring.rings[r]
                    .handle_post(t)
                    .map_err(|e| ring.fail(format!("rank {rank}: {e}")))?;
                ring.drain(rank)?;
            }
            Ev::Moved(x) => {
                ring.land(x);
                let step = x.step;
                ring.rings[x.from as usize]
                    .handle_send_done(t, step)
                    .map_err(|e| ring.fail(format!("rank {}: {e}", x.from)))?;
                ring.rings[x.to as usize]
                    .handle_recv_done(t, step)
                    .map_err(|e| ring.fail(format!("rank {}: {e}", x.to)))?;
                ring.drain(x.from)?;
                ring.drain(x.to)?;
            }
        }
    }
    for r in 0..w as usize {
        if ring.op.done[r].is_none() {
            return Err(ring.fail(format!("rank {r} never completed (deadlock)")));
        }
        check_recv_of(&ring.op, 0, r, true).map_err(|e| ring.fail(e))?;
    }
    Ok(RingReport {
        seed: cfg.seed,
        world_size: w,
        end_ns: ring
            .op
            .done
            .iter()
            .flatten()
            .map(|&(t, _)| t)
            .max()
            .unwrap_or(0),
        last_arrival_ns: arrivals[0].iter().copied().max().unwrap_or(0),
        transfers: ring.transfers,
        bytes_inter_node: ring.bytes_inter,
    })
}

impl Ring<'_> {
    fn fail(&self, what: String) -> SimFailure {
        SimFailure {
            seed: self.cfg.seed,
            what: format!("ring: t={}ns: {what}", self.now),
        }
    }

    fn schedule(&mut self, at: Nanos, ev: Ev) {
        self.seq += 1;
        self.queue.insert((at, self.seq), ev);
    }

    fn drain(&mut self, rank: Rank) -> Result<(), SimFailure> {
        while let Some(a) = self.rings[rank as usize].poll_action() {
            match a {
                Action::Send { to, step, block } => {
                    let x = Transfer {
                        from: rank,
                        to,
                        step,
                        block,
                    };
                    match self.recvs.remove(&(to, step)) {
                        Some(r) if (r.from, r.block) == (rank, block) => self.start(x),
                        Some(r) => {
                            return Err(self.fail(format!("send {x:?} meets receive {r:?}")));
                        }
                        None => {
                            self.sends.insert((to, step), x);
                        }
                    }
                }
                Action::Recv { from, step, block } => {
                    let x = Transfer {
                        from,
                        to: rank,
                        step,
                        block,
                    };
                    match self.sends.remove(&(rank, step)) {
                        Some(s) if (s.from, s.block) == (from, block) => self.start(x),
                        Some(s) => {
                            return Err(self.fail(format!("receive {x:?} meets send {s:?}")));
                        }
                        None => {
                            self.recvs.insert((rank, step), x);
                        }
                    }
                }
                Action::Complete => {
                    let r = rank as usize;
                    if let Some((t, _)) = self.op.done[r] {
                        return Err(self.fail(format!("rank {rank} completed twice (at {t}ns)")));
                    }
                    self.op.done[r] = Some((self.now, Status::Ok));
                }
            }
        }
        Ok(())
    }

    /// Both halves are posted: the data moves now.
    fn start(&mut self, x: Transfer) {
        let c = &self.cfg.cost;
        let len = self.op.send_buf[x.block as usize].len() as u64;
        let inter = self.rank_node[x.from as usize] != self.rank_node[x.to as usize];
        let (lat, bw) = if inter {
            self.bytes_inter += len;
            (c.inter_node_latency_ns, c.inter_node_bytes_per_ns)
        } else {
            (c.intra_node_latency_ns, c.intra_node_bytes_per_ns)
        };
        let wire = c.msg_header_bytes + len * c.byte_weight;
        let at = self.now + c.msg_proc_ns + lat + wire.div_ceil(bw.max(1));
        self.transfers += 1;
        self.schedule(at, Ev::Moved(x));
    }

    /// The block lands in the receiver's buffer, from the sender's.
    fn land(&mut self, x: Transfer) {
        let b = x.block as usize;
        let len = self.op.send_buf[b].len();
        let src = self.op.recv_displs[x.from as usize][b] as usize;
        let dst = self.op.recv_displs[x.to as usize][b] as usize;
        let data = self.op.recv_buf[x.from as usize][src..src + len].to_vec();
        self.op.recv_buf[x.to as usize][dst..dst + len].copy_from_slice(&data);
    }
}

#[cfg(test)]
mod tests {
    use super::super::allgatherv;
    use super::*;

    fn small(seed: u64) -> SimConfig {
        let mut c = SimConfig::new(seed);
        c.nodes = 4;
        c.ranks_per_node = 4;
        c.sps_per_node = 2;
        c.late_ranks = 2;
        c
    }

    #[test]
    fn the_ring_delivers_every_block_and_waits_for_the_last_arrival() {
        for seed in 1..=20 {
            let cfg = small(seed);
            let r = run_ring(&cfg).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(r.transfers, 16 * 15, "seed {seed}");
            assert!(r.end_ns > r.last_arrival_ns, "seed {seed}: {r:?}");
            // The same draws as the offloaded run: the same last arrival.
            let a = allgatherv::run(&cfg).unwrap();
            assert_eq!(a.last_arrival_ns, r.last_arrival_ns, "seed {seed}");
        }
    }

    #[test]
    fn a_post_reaches_its_sp_post_ns_after_the_call() {
        let cfg = small(3);
        let mut slow = cfg;
        slow.cost.post_ns = 50_000;
        let (a, b) = (
            allgatherv::run(&cfg).unwrap(),
            allgatherv::run(&slow).unwrap(),
        );
        assert_eq!(a.last_arrival_ns, b.last_arrival_ns);
        assert!(b.end_ns >= b.last_arrival_ns + 50_000, "{b:?}");
        assert!(b.end_ns > a.end_ns, "{a:?} {b:?}");
    }

    #[test]
    fn the_ring_refuses_what_it_does_not_model() {
        let mut c = small(1);
        c.ops = 2;
        assert!(run_ring(&c).is_err());
    }
}
