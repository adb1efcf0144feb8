//! What the simulators share: virtual time and the event queue, SP inboxes
//! and processing time, message delivery over the [`CostModel`] (latency,
//! per-link serialisation, jitter), SP crashes with delayed detection, host
//! rank deaths, the per-SP [`CopyLimiter`] and copy cost/byte accounting;
//! and, for collectives that use them, the network faults of [`NetFaults`]
//! (a partition of the SP-to-SP channel that heals) and the multicast
//! fabric: datagrams multicast by an SP's send worker, lost, duplicated or
//! reordered on the way, dropped by a receiver whose staging is full, and
//! drained by its receive worker into the collective
//! ([`Collective::on_datagram`]); plus the collectives' timers
//! ([`Input::Timer`]). Each collective implements [`Collective`] for what is
//! its own: which collectives a fault disturbs and how an input is
//! processed.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::rng::Rng;
use super::{place_rank, Common, NetFaults, Outcome, SimFailure};
use crate::sched::CopyLimiter;
use crate::{Nanos, Rank, SpId, Status};

/// An input of an SP; `M` is the message envelope, `C` a copy.
pub(crate) enum Input<M, C> {
    Post {
        op: usize,
        rank: Rank,
    },
    Msg {
        from: SpId,
        msg: M,
    },
    CopyDone {
        op: usize,
        copy: C,
        fail: bool,
    },
    PeerLost {
        lost: SpId,
    },
    RankLost {
        world: u32,
    },
    /// The SP's receive workers landed chunk `psn` of collective `op` (a
    /// collective using the fabric delivers it from `on_datagram`).
    Landed {
        op: usize,
        psn: u64,
    },
    /// A timer of collective `op` the collective scheduled is due.
    Timer {
        op: usize,
    },
}

pub(crate) enum Ev<M, C> {
    /// An input reaches an SP's inbox.
    Input {
        sp: SpId,
        input: Input<M, C>,
    },
    /// The SP takes the next input from its inbox.
    SpRun {
        sp: SpId,
    },
    Crash {
        sp: SpId,
    },
    RankDeath {
        world: u32,
    },
    /// Datagram `psn` of collective `op` reaches SP `sp`'s receive staging.
    Datagram {
        sp: SpId,
        op: usize,
        psn: u64,
    },
    /// SP `sp`'s receive worker takes the datagram out of staging.
    Drained {
        sp: SpId,
        op: usize,
        psn: u64,
    },
}

/// An SP's receive side of the fabric: datagrams in its staging, and when
/// its receive worker is free.
#[derive(Clone, Copy, Debug, Default)]
struct Rx {
    staged: u32,
    free_at: Nanos,
}

/// What the fabric did in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FabricCounts {
    /// Datagrams put on the wire (one per receiver each).
    pub datagrams: u64,
    pub lost: u64,
    pub duplicated: u64,
    /// Dropped for want of receive staging (receiver not ready).
    pub rnr_drops: u64,
    /// Taken out of staging by a receive worker.
    pub drained: u64,
    /// Messages between SPs held back by the partition.
    pub held_by_partition: u64,
}

pub(crate) struct SpState<M, C> {
    alive: bool,
    busy_until: Nanos,
    run_scheduled: bool,
    inbox: VecDeque<Input<M, C>>,
    pub limiter: CopyLimiter<(usize, C)>,
    pub known_lost: BTreeSet<SpId>,
}

/// Driver state common to the simulators.
pub(crate) struct Core<M, C> {
    pub p: Common,
    msg_jitter_ns: Nanos,
    detect_delay_ns: Nanos,
    pub rng: Rng,
    pub now: Nanos,
    seq: u64,
    pub events: u64,
    queue: BTreeMap<(Nanos, u64), Ev<M, C>>,
    pub sps: Vec<SpState<M, C>>,
    /// Directed node-to-node link -> time it is free to send.
    link_free: BTreeMap<(u32, u32), Nanos>,
    pub rank_node: Vec<u32>,
    pub rank_sp: Vec<SpId>,
    pub host_dead: Vec<bool>,
    pub crashed: Vec<SpId>,
    pub dead: Vec<u32>,
    pub messages: u64,
    pub copies: u64,
    pub bytes_intra: u64,
    pub bytes_inter: u64,
    pub max_in_flight: usize,
    /// The latest time a host rank called a collective ([`Core::schedule_post`]).
    pub last_arrival_ns: Nanos,
    pub net: NetFaults,
    rx: Vec<Rx>,
    /// Per SP: when its multicast send worker is free.
    mcast_free: Vec<Nanos>,
    pub fabric: FabricCounts,
}

impl<M, C> Core<M, C> {
    /// The core for `p` with messages delayed by up to `msg_jitter_ns` and
    /// crashes detected after `detect_delay_ns` to twice that, and the setup
    /// generator (the run's generator is forked from it first).
    pub fn new(
        p: Common,
        (msg_jitter_ns, detect_delay_ns): (Nanos, Nanos),
    ) -> Result<(Core<M, C>, Rng), SimFailure> {
        if p.nodes == 0 || p.ranks_per_node == 0 || p.sps_per_node == 0 {
            return Err(SimFailure {
                seed: p.seed,
                what: "invalid config: nodes, ranks_per_node, sps_per_node must be > 0".into(),
            });
        }
        let mut setup = Rng::new(p.seed);
        let rng = setup.fork();
        let w = p.nodes * p.ranks_per_node;
        let (rank_node, rank_sp) = (0..w)
            .map(|r| place_rank(p.layout, p.nodes, p.ranks_per_node, p.sps_per_node, r))
            .unzip();
        let sps = (0..p.nodes * p.sps_per_node)
            .map(|_| SpState {
                alive: true,
                busy_until: 0,
                run_scheduled: false,
                inbox: VecDeque::new(),
                limiter: CopyLimiter::new(p.max_inflight_reads),
                known_lost: BTreeSet::new(),
            })
            .collect();
        let core = Core {
            p,
            msg_jitter_ns,
            detect_delay_ns,
            rng,
            now: 0,
            seq: 0,
            events: 0,
            queue: BTreeMap::new(),
            sps,
            link_free: BTreeMap::new(),
            rank_node,
            rank_sp,
            host_dead: vec![false; w as usize],
            crashed: Vec::new(),
            dead: Vec::new(),
            messages: 0,
            copies: 0,
            bytes_intra: 0,
            bytes_inter: 0,
            max_in_flight: 0,
            last_arrival_ns: 0,
            net: NetFaults::default(),
            rx: vec![Rx::default(); (p.nodes * p.sps_per_node) as usize],
            mcast_free: vec![0; (p.nodes * p.sps_per_node) as usize],
            fabric: FabricCounts::default(),
        };
        Ok((core, setup))
    }

    pub fn sp_count(&self) -> u32 {
        self.p.sp_count()
    }

    /// What every report says of this run, with its `error_completions`.
    pub fn outcome(&self, error_completions: u64) -> Outcome {
        Outcome {
            seed: self.p.seed,
            world_size: self.p.world_size(),
            sps: self.sp_count(),
            events: self.events,
            messages: self.messages,
            max_in_flight: self.max_in_flight,
            error_completions,
            crashed_sps: self.crashed.clone(),
            dead_ranks: self.dead.clone(),
        }
    }

    pub fn fail(&self, what: impl Into<String>) -> SimFailure {
        SimFailure {
            seed: self.p.seed,
            what: format!("t={}ns: {}", self.now, what.into()),
        }
    }

    pub fn schedule(&mut self, at: Nanos, ev: Ev<M, C>) {
        self.seq += 1;
        self.queue.insert((at, self.seq), ev);
    }

    /// Host rank `world` posts comm rank `rank` of collective `op` at `at`:
    /// its SP takes the post `cost.post_ns` later.
    pub fn schedule_post(&mut self, at: Nanos, world: u32, op: usize, rank: Rank) {
        let sp = self.rank_sp[world as usize];
        self.last_arrival_ns = self.last_arrival_ns.max(at);
        self.schedule(
            at + self.p.cost.post_ns,
            Ev::Input {
                sp,
                input: Input::Post { op, rank },
            },
        );
    }

    /// SP crashes and host rank deaths at random times (at least one SP
    /// survives).
    pub fn schedule_faults(
        &mut self,
        setup: &mut Rng,
        (sp_crashes, crash_window_ns): (u32, Nanos),
        (rank_deaths, death_window_ns): (u32, Nanos),
    ) {
        let sp_count = self.sp_count();
        let crashes = (sp_crashes as u64).min(sp_count as u64 - 1);
        let mut all_sps: Vec<SpId> = (0..sp_count).collect();
        setup.shuffle(&mut all_sps);
        for &sp in all_sps.iter().take(crashes as usize) {
            let t = setup.range(0, crash_window_ns);
            self.schedule(t, Ev::Crash { sp });
        }
        let mut all_ranks: Vec<u32> = (0..self.rank_sp.len() as u32).collect();
        setup.shuffle(&mut all_ranks);
        for &world in all_ranks.iter().take(rank_deaths as usize) {
            let t = setup.range(0, death_window_ns);
            self.schedule(t, Ev::RankDeath { world });
        }
    }

    /// Every world rank posts each of the `ops` collectives of the world
    /// comm at `op * op_gap_ns` + uniform `0..=arrival_skew_ns`, plus
    /// `late_delay_ns` for `late_ranks` world ranks picked at random.
    pub fn schedule_world_posts(&mut self, setup: &mut Rng) {
        let w = self.rank_sp.len() as u32;
        for (op, times) in world_arrivals(&self.p, w, setup).into_iter().enumerate() {
            for (r, t) in (0..w).zip(times) {
                self.schedule_post(t, r, op, r);
            }
        }
    }

    /// Staging slot `slot` of SP `sp` in collective `op` (`staging` holds
    /// each SP's `slots` slots, made by `fresh` on first use), or a failure
    /// if `slot` is beyond the bound.
    pub fn staging_slot<'s, T>(
        &self,
        staging: &'s mut BTreeMap<SpId, Vec<T>>,
        (op, sp, slot): (usize, SpId, u32),
        slots: usize,
        fresh: impl Fn() -> T,
    ) -> Result<&'s mut T, SimFailure> {
        if slot as usize >= slots {
            return Err(self.fail(format!(
                "op {op}: SP {sp} uses staging slot {slot}, bound {slots}"
            )));
        }
        let v = staging
            .entry(sp)
            .or_insert_with(|| (0..slots).map(|_| fresh()).collect());
        Ok(&mut v[slot as usize])
    }

    /// Checks that SP `sp` may complete comm rank `rank` (a world rank) of
    /// collective `op` with `status`: the rank is `sp`'s and `posted`, it
    /// did not complete before (`before`: when and how), and it is not Ok
    /// once `sp` was `notified` of a fault touching the collective.
    pub fn check_completion(
        &self,
        (op, sp, rank): (usize, SpId, Rank),
        status: Status,
        posted: bool,
        before: Option<(Nanos, Status)>,
        notified: bool,
    ) -> Result<(), SimFailure> {
        if self.rank_sp[rank as usize] != sp || !posted {
            return Err(self.fail(format!(
                "op {op}: SP {sp} completed rank {rank} (not its own or not posted)"
            )));
        }
        if let Some((t, s)) = before {
            return Err(self.fail(format!(
                "op {op}: rank {rank} completed twice (at {t}ns with {s}, now {status})"
            )));
        }
        if status.is_ok() && notified {
            return Err(self.fail(format!(
                "op {op}: rank {rank} completed Ok after SP {sp} learned of a fault"
            )));
        }
        Ok(())
    }

    pub fn sp_node(&self, sp: SpId) -> u32 {
        sp / self.p.sps_per_node
    }

    /// Send `msg` (`wire` bytes on top of the header) from `sp` to `to`,
    /// leaving `sp` at `out`: the directed node link serialises messages.
    pub fn send(
        &mut self,
        op: usize,
        sp: SpId,
        to: SpId,
        wire: u64,
        out: Nanos,
        msg: M,
    ) -> Result<(), SimFailure> {
        if to == sp {
            return Err(self.fail(format!("op {op}: SP {sp} sent a message to itself")));
        }
        if to >= self.sp_count() {
            return Err(self.fail(format!("op {op}: SP {sp} sent to unknown SP {to}")));
        }
        self.messages += 1;
        let (link, lat, bw) = self.link(sp, to);
        let wire = self.p.cost.msg_header_bytes + wire;
        let go = self.net.departure(link, out);
        if go != out {
            self.fabric.held_by_partition += 1;
        }
        let free = self.link_free.entry(link).or_insert(0);
        let departed = (*free).max(go) + wire.div_ceil(bw.max(1));
        *free = departed;
        let jitter = self.rng.range(0, self.msg_jitter_ns);
        self.schedule(
            departed + lat + jitter,
            Ev::Input {
                sp: to,
                input: Input::Msg { from: sp, msg },
            },
        );
        Ok(())
    }

    /// The directed node link from SP `sp` to SP `to`, its latency and its
    /// bandwidth (bytes per ns).
    fn link(&self, sp: SpId, to: SpId) -> ((u32, u32), Nanos, u64) {
        let link = (self.sp_node(sp), self.sp_node(to));
        let c = &self.p.cost;
        let (lat, bw) = if link.0 == link.1 {
            (c.intra_node_latency_ns, c.intra_node_bytes_per_ns)
        } else {
            (c.inter_node_latency_ns, c.inter_node_bytes_per_ns)
        };
        (link, lat, bw)
    }

    /// Bulk bytes from `sp` to SP `to` (a staged chunk moved between SPs)
    /// leaving no earlier than `out`: they take the directed node link in
    /// turn with messages, at its bandwidth. Returns when the last byte has
    /// arrived (latency included).
    pub fn transfer(&mut self, sp: SpId, to: SpId, bytes: u64, out: Nanos) -> Nanos {
        let (link, lat, bw) = self.link(sp, to);
        let bytes = bytes * self.p.cost.byte_weight;
        let free = self.link_free.entry(link).or_insert(0);
        let departed = (*free).max(out) + bytes.div_ceil(bw.max(1));
        *free = departed;
        departed + lat
    }

    /// The next copy the SP's limiter admits, checking its bound.
    pub fn next_copy(&mut self, sp: SpId) -> Result<Option<(usize, C)>, SimFailure> {
        let Some(next) = self.sps[sp as usize].limiter.pop_startable() else {
            return Ok(None);
        };
        let lim = &self.sps[sp as usize].limiter;
        if lim.in_flight() > lim.max_inflight() {
            return Err(self.fail(format!("SP {sp}: {} copies in flight", lim.in_flight())));
        }
        self.max_in_flight = self.max_in_flight.max(lim.in_flight());
        Ok(Some(next))
    }

    /// Duration of a copy of `len` bytes from a buffer on `src_node` run by
    /// `sp`.
    pub fn copy_cost(&self, src_node: u32, sp: SpId, len: u64) -> Nanos {
        let c = &self.p.cost;
        let (fixed, bw) = if src_node == self.sp_node(sp) {
            (c.copy_fixed_intra_ns, c.intra_node_bytes_per_ns)
        } else {
            (c.copy_fixed_inter_ns, c.inter_node_bytes_per_ns)
        };
        fixed + (len * c.byte_weight).div_ceil(bw.max(1))
    }

    /// Account a copy of `len` bytes from world rank `src` to `dst`.
    pub fn count_copy(&mut self, src: u32, dst: u32, len: u64) {
        if self.rank_node[src as usize] == self.rank_node[dst as usize] {
            self.bytes_intra += len;
        } else {
            self.bytes_inter += len;
        }
        self.copies += 1;
    }

    /// Whether SP `sp` has not crashed.
    pub fn is_alive(&self, sp: SpId) -> bool {
        self.sps[sp as usize].alive
    }

    /// Network faults for this run (all off unless set).
    pub fn set_net(&mut self, net: NetFaults) {
        self.net = net;
    }

    /// Schedules `input` into SP `sp`'s inbox at `at` (e.g. `Landed` from
    /// `on_datagram`, a `Timer`).
    pub fn schedule_input(&mut self, at: Nanos, sp: SpId, input: Input<M, C>) {
        self.schedule(at, Ev::Input { sp, input });
    }

    /// SP `sp`'s send worker multicasts datagram `psn` of collective `op`
    /// (`bytes` of payload) to the SPs `to`, no earlier than `out`, after
    /// the datagrams it sent before: each receiver gets it after the link's
    /// latency, unless it is lost, maybe twice, maybe reordered
    /// ([`NetFaults`]). Returns when it left the sender.
    pub fn multicast(
        &mut self,
        (op, sp, psn): (usize, SpId, u64),
        bytes: u64,
        to: &[SpId],
        out: Nanos,
    ) -> Nanos {
        let c = self.p.cost;
        let wire = c.msg_header_bytes + bytes * c.byte_weight;
        let free = &mut self.mcast_free[sp as usize];
        let departed = (*free).max(out) + wire.div_ceil(c.inter_node_bytes_per_ns.max(1));
        *free = departed;
        let n = self.net;
        for &dst in to {
            self.fabric.datagrams += 1;
            if n.loss_ppm > 0 && self.rng.chance(n.loss_ppm.into(), 1_000_000) {
                self.fabric.lost += 1;
                continue;
            }
            let copies = if n.dup_ppm > 0 && self.rng.chance(n.dup_ppm.into(), 1_000_000) {
                self.fabric.duplicated += 1;
                2
            } else {
                1
            };
            let (_, lat, _) = self.link(sp, dst);
            for _ in 0..copies {
                let at = departed + lat + self.rng.range(0, n.reorder_ns);
                self.schedule(at, Ev::Datagram { sp: dst, op, psn });
            }
        }
        departed
    }

    /// A datagram reaches SP `sp`: into staging, or dropped if it is full
    /// (or the SP is dead); its receive worker drains it in turn.
    fn datagram_arrives(&mut self, sp: SpId, op: usize, psn: u64) {
        if !self.sps[sp as usize].alive {
            return;
        }
        let (cap, drain) = (self.net.rx_staging, self.net.rx_drain_ns);
        let now = self.now;
        let rx = &mut self.rx[sp as usize];
        if cap > 0 && rx.staged >= cap {
            self.fabric.rnr_drops += 1;
            return;
        }
        rx.staged += 1;
        let at = rx.free_at.max(now) + drain;
        rx.free_at = at;
        self.schedule(at, Ev::Drained { sp, op, psn });
    }

    fn deliver(&mut self, sp: SpId, input: Input<M, C>) {
        let t = self.now;
        let s = &mut self.sps[sp as usize];
        if !s.alive {
            return;
        }
        s.inbox.push_back(input);
        if !s.run_scheduled {
            s.run_scheduled = true;
            let at = s.busy_until.max(t);
            self.schedule(at, Ev::SpRun { sp });
        }
    }

    fn take_input(&mut self, sp: SpId) -> Option<Input<M, C>> {
        let t = self.now;
        let s = &mut self.sps[sp as usize];
        s.run_scheduled = false;
        if !s.alive {
            return None;
        }
        let input = s.inbox.pop_front()?;
        s.busy_until = t + self.p.cost.msg_proc_ns;
        if !s.inbox.is_empty() {
            s.run_scheduled = true;
            let at = s.busy_until;
            self.schedule(at, Ev::SpRun { sp });
        }
        Some(input)
    }

    fn crash(&mut self, sp: SpId) {
        let s = &mut self.sps[sp as usize];
        s.alive = false;
        s.inbox.clear();
        s.limiter.clear_queued().for_each(drop);
        self.crashed.push(sp);
        let delay = self.detect_delay_ns;
        for other in 0..self.sp_count() {
            if other != sp && self.sps[other as usize].alive {
                let at = self.now + delay + self.rng.range(0, delay);
                self.schedule(
                    at,
                    Ev::Input {
                        sp: other,
                        input: Input::PeerLost { lost: sp },
                    },
                );
            }
        }
    }

    fn rank_death(&mut self, world: u32) {
        self.host_dead[world as usize] = true;
        self.dead.push(world);
        let sp = self.rank_sp[world as usize];
        self.schedule(
            self.now,
            Ev::Input {
                sp,
                input: Input::RankLost { world },
            },
        );
    }
}

/// When each of the `w` world ranks calls each of the `p.ops` collectives
/// of the world comm (`[op][rank]`), drawn from `setup` as
/// [`Core::schedule_world_posts`] describes (a simulator without a [`Core`]
/// draws the same times from the same generator state).
pub(crate) fn world_arrivals(p: &Common, w: u32, setup: &mut Rng) -> Vec<Vec<Nanos>> {
    let late: BTreeSet<u32> = {
        let mut all: Vec<u32> = (0..w).collect();
        setup.shuffle(&mut all);
        all.into_iter().take(p.late_ranks as usize).collect()
    };
    (0..p.ops as usize)
        .map(|op| {
            (0..w)
                .map(|r| {
                    let late_ns = if late.contains(&r) {
                        p.late_delay_ns
                    } else {
                        0
                    };
                    op as Nanos * p.op_gap_ns + setup.range(0, p.arrival_skew_ns) + late_ns
                })
                .collect()
        })
        .collect()
}

/// What a collective's simulator adds to the [`Core`].
pub(crate) trait Collective {
    type Msg;
    type Copy;

    fn core(&mut self) -> &mut Core<Self::Msg, Self::Copy>;

    /// World rank of comm rank `rank` of collective `op` (by default every
    /// collective is on the world comm).
    fn world_of(&self, _op: usize, rank: Rank) -> u32 {
        rank
    }

    /// SP `sp` crashed: mark the collectives it disturbs.
    fn on_crash(&mut self, sp: SpId);

    /// Host rank `world` died: mark the collectives it disturbs.
    fn on_rank_death(&mut self, world: u32);

    /// The SP takes `input` from its inbox at `core().now`.
    fn process(&mut self, sp: SpId, input: Input<Self::Msg, Self::Copy>) -> Result<(), SimFailure>;

    /// SP `sp`'s receive worker took datagram `psn` of collective `op` out
    /// of staging at `core().now`: land it (and schedule `Input::Landed`),
    /// or drop it. Only collectives that multicast get datagrams.
    fn on_datagram(&mut self, sp: SpId, op: usize, psn: u64) -> Result<(), SimFailure> {
        let _ = psn;
        Err(self.core().fail(format!(
            "op {op}: a datagram for SP {sp} in a simulator without a fabric"
        )))
    }

    /// The run passed `max_events` or `max_virtual_ns`.
    fn over_budget(core: &Core<Self::Msg, Self::Copy>) -> SimFailure {
        if core.events > core.p.max_events {
            core.fail(format!(
                "no termination within {} events",
                core.p.max_events
            ))
        } else {
            core.fail(format!(
                "no termination within {}ns of virtual time",
                core.p.max_virtual_ns
            ))
        }
    }
}

/// Process events until the queue drains.
pub(crate) fn run_events<S: Collective>(sim: &mut S) -> Result<(), SimFailure> {
    loop {
        let core = sim.core();
        let Some(((t, _), ev)) = core.queue.pop_first() else {
            return Ok(());
        };
        core.now = t;
        core.events += 1;
        if core.events > core.p.max_events || t > core.p.max_virtual_ns {
            return Err(S::over_budget(core));
        }
        match ev {
            Ev::Input { sp, input } => {
                if let Input::Post { op, rank } = &input {
                    let w = sim.world_of(*op, *rank);
                    if sim.core().host_dead[w as usize] {
                        continue;
                    }
                }
                sim.core().deliver(sp, input);
            }
            Ev::SpRun { sp } => {
                if let Some(input) = sim.core().take_input(sp) {
                    sim.process(sp, input)?;
                }
            }
            Ev::Crash { sp } => {
                sim.core().crash(sp);
                sim.on_crash(sp);
            }
            Ev::RankDeath { world } => {
                sim.core().rank_death(world);
                sim.on_rank_death(world);
            }
            Ev::Datagram { sp, op, psn } => sim.core().datagram_arrives(sp, op, psn),
            Ev::Drained { sp, op, psn } => {
                let core = sim.core();
                core.rx[sp as usize].staged -= 1;
                core.fabric.drained += 1;
                if core.sps[sp as usize].alive {
                    sim.on_datagram(sp, op, psn)?;
                }
            }
        }
    }
}

/// Runs `cfg` with seeds 1 to 4 with mutation `m` switched on through
/// `set`; every seed must fail with a message containing one of `want`.
/// Returns the first failure.
#[cfg(test)]
pub(crate) fn caught<M: Copy + std::fmt::Debug, C, R: std::fmt::Debug>(
    m: M,
    set: fn(Option<M>),
    cfg: C,
    run: fn(&C) -> Result<R, SimFailure>,
    want: &[&str],
) -> String
where
    C: Copy + std::ops::DerefMut<Target = Common>,
{
    set(Some(m));
    let mut first = None;
    for seed in 1..=4 {
        let mut c = cfg;
        c.seed = seed;
        let res = run(&c);
        let e = match res {
            Ok(r) => {
                set(None);
                panic!("{m:?} not caught with seed {seed}: {r:?}");
            }
            Err(e) => e.to_string(),
        };
        if !want.iter().any(|w| e.contains(w)) {
            set(None);
            panic!("{m:?} caught by an unexpected check: {e}");
        }
        first.get_or_insert(e);
    }
    set(None);
    let e = first.unwrap();
    eprintln!("{m:?}: {e}");
    e
}
