//! The SP daemon: one mio event loop serving host ranks (Unix socket) and peer SPs (TCP).
//!
//! Readiness rules, as mio documents them and as this loop follows them:
//! - events can be spurious: every handler tries the operation and treats `WouldBlock` as
//!   "nothing to do";
//! - mio is edge-triggered: a readable event is drained until `WouldBlock`, a writable event
//!   flushes the whole out buffer or until `WouldBlock`;
//! - read/write-closed flags are hints: a connection is closed when a read returns 0 bytes or an
//!   error, not when a flag says so.
//!
//! Tokens: [`LISTEN_HOSTS`], [`WAKER`], [`SIGNALS`] are reserved; connection `k` of the slab has
//! token `CONN_BASE + k`. Peer SPs are connected before the loop starts (see [`connect_mesh`]),
//! so "ready" means the whole mesh is up.
//!
//! The engine part: a host's post is checked against its grants, then fed to the collective's
//! state machine (one per `CollKey`, created by the first event that names it, a post or a peer
//! message alike, so early announcements wait in it). The machine's actions are executed at once:
//! messages go to peer connections, copies go through the per-SP [`CopyLimiter`] to the datapath
//! threads, completions are written into the rank's mailbox. Failures never hang a collective: a
//! lost peer SP fails every instance that involves it, a host rank that disconnects without
//! saying goodbye aborts its whole job on every SP (`JobAbort`).

use crate::access::{self, Limits, LogLimit, PeerCred};
use crate::conn::{Conn, ReadEnd, Stream};
use crate::datapath::{CopyJob, Datapath};
use crate::drivers::{self, Act, CollDriver, LocalPost, StagedConfig};
use crate::segment::Arena;
use crate::staging::{Budget, StageSet};
use crate::stats::Stats;
use algorithms::sched::CopyLimiter;
use algorithms::{CollKey, CommId, Nanos, SpId, Status};
use alias_mkey::mover::{CmaMover, Mover};
use alias_mkey::{AliasKey, BackendData, Grant, Owner, Rights};
use bootstrap::auth::{self, ClusterKey};
use bootstrap::mailbox;
use bootstrap::rendezvous::Backoff;
use bootstrap::wire::{
    self, decode, decode_hello, encode, encode_hello, frame, AdminHello, CollKind, CollMsg,
    CopySrc, ErrorCode, Hello, HostHello, HostToSp, PostDesc, SpToHost, SpToSp, StagedDesign,
};
use bootstrap::Cluster;
use mio::net::UnixListener;
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;
use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, info, info_span, warn};

pub const LISTEN_HOSTS: Token = Token(0);
pub const WAKER: Token = Token(1);
pub const SIGNALS: Token = Token(2);
/// The staging UCX worker's event fd (with UCX on, see [`UcxMode`]).
const UCX_EVENTS: Token = Token(3);
const CONN_BASE: usize = 16;
/// The pidfd of host connection `k` (readable once its process exits) has token
/// `PIDFD_BASE + k`.
const PIDFD_BASE: usize = 1 << 40;

/// Collective instances remembered as finished per job, so that a stray late message cannot
/// re-create one; beyond this the oldest are forgotten.
const MAX_FINISHED_PER_JOB: usize = 1 << 16;

/// Whether an SP uses UCX: to serve grants of the `ucx` backend (each datapath thread then
/// owns a UCX worker), and to move the staged collectives' chunks between SPs as UCX puts
/// into the staging of the SP's children in a broadcast tree (otherwise they travel as
/// frames on the SPs' TCP connections).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UcxMode {
    /// On if UCX initialises here; otherwise off, with a warning.
    Auto,
    /// On; the SP fails to start if UCX cannot initialise.
    On,
    /// `serve`'s default: on this machine's UCX 1.13 the staged chunks are slower as puts
    /// than as frames (docs/BENCHMARKS.md).
    Off,
}

impl std::str::FromStr for UcxMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(UcxMode::Auto),
            "on" => Ok(UcxMode::On),
            "off" => Ok(UcxMode::Off),
            _ => Err(format!("expected auto, on or off, not {s:?}")),
        }
    }
}

/// Timer slack of a polling SP (`ServeConfig::poll_interval`), in ns.
const POLL_TIMER_SLACK_NS: libc::c_ulong = 1_000;

pub struct ServeConfig {
    pub sp: SpId,
    pub cluster: Cluster,
    pub peer_listener: std::net::TcpListener,
    pub host_socket: PathBuf,
    pub max_inflight_reads: usize,
    pub datapath_threads: usize,
    pub chunk_bytes: usize,
    /// Copies up to this size run on the event-loop thread instead of a datapath thread: a
    /// handoff to a thread and back costs more than copying a few KiB.
    pub inline_copy_bytes: u64,
    /// UCX for `ucx` grants and for the staged chunks between SPs.
    pub ucx: UcxMode,
    pub connect_backoff: Backoff,
    /// Chunk size and slots per instance of the staged collectives.
    pub staged: StagedConfig,
    /// Staging memory of this SP, all instances together.
    pub staging_bytes: u64,
    /// Look at the connections (and the UCX worker) at this interval instead of sleeping
    /// until something arrives: after a look that finds nothing, sleep this long. For an SP on
    /// a reserved core, as DPU service processes poll: nothing ever waits on a connection, so
    /// a rank's post does not pay for waking the SP.
    pub poll_interval: Option<Duration>,
    /// The cluster's secret: peers, job credentials and admin requests are checked with it.
    pub key: ClusterKey,
    /// Mode of the host socket (0600: only this SP's user may connect; a shared daemon may open
    /// it, job credentials still decide who is served).
    pub socket_mode: u32,
    pub limits: Limits,
    /// Heartbeats: sent to every peer, and to every host with posts outstanding, this often; a
    /// peer that sends nothing for `peer_timeout` is stuck and counts as lost.
    pub heartbeat: Duration,
    pub peer_timeout: Duration,
}

/// Role of a connection.
enum Role {
    /// A host connected; its hello has not arrived yet. Who it is comes from the kernel.
    NewHost {
        peer: PeerCred,
        since: Instant,
    },
    Host(HostState),
    Peer(SpId),
}

struct HostState {
    /// Unique for the SP's lifetime (slab keys are reused; this is not).
    conn_id: u64,
    hello: HostHello,
    /// The job, from the hello's verified credential.
    job: u64,
    peer: PeerCred,
    mailbox: Option<(AliasKey, u32)>,
    said_goodbye: bool,
    /// Posts of this connection not completed yet (bounded by `Limits::max_posts_per_rank`).
    outstanding: usize,
}

/// A local rank's post of one instance: where its completion goes.
#[derive(Clone, Copy)]
struct Posted {
    conn: usize,
    /// The host connection the post came from: a completion for a connection that has since
    /// closed must not reach a new host that got the same slab key.
    conn_id: u64,
    /// The mailbox slot of the completion; `None`: it goes as a `SpToHost::Completed` frame.
    slot: Option<u32>,
    token: u64,
    /// The rank copies the segments already on its node itself (`PostDesc::host_copies`).
    host_copies: bool,
}

/// A copy handed to a host (`SpToHost::Copy`), until it answers or goes.
struct HostCopy {
    ck: CollKey,
    conn: usize,
    conn_id: u64,
    then: AfterHostCopy,
}

/// What a host's answer to a copy finishes.
#[derive(Clone, Copy)]
enum AfterHostCopy {
    /// A copy of the instance's state machine.
    Machine { id: u64 },
    /// The last step of a rank of a hierarchical staged instance: the rank completes (with the
    /// copy's outcome) and one reader of the instance's segment region is done.
    Finish { posted: Posted },
}

/// The region of its job's node segment a hierarchical staged instance uses on this SP.
struct Region {
    off: u64,
    /// The message length (the region may be larger).
    len: u64,
    /// Ranks still copying out of it.
    readers: usize,
    /// The instance finished (no more writes, no more readers to come).
    finished: bool,
    /// `Some(leader)`: the region is the node leader's, which sealed it for this SP's ranks
    /// (a bcast); it is told once they copied. `None`: this SP's own, in its arena.
    owner: Option<SpId>,
    /// This SP's own region: the node's other SPs it was sealed for that have not said their
    /// ranks finished copying.
    borrowers: HashSet<SpId>,
}

struct Instance {
    sm: Box<dyn CollDriver>,
    posted: HashMap<u32, Posted>,
    /// The communicator of the instance as its first local post described it (SP and world
    /// rank of each comm rank): every later local post must say the same.
    shape: Option<(Vec<SpId>, Vec<u32>)>,
    /// How many comm ranks this SP serves in the instance (known from the first local post).
    local_ranks: Option<usize>,
    /// Staging slots of a staged collective (given back to the budget with the instance).
    stages: Option<StageSet>,
}

#[derive(Default)]
struct Job {
    /// World size of the job (from its credential): places any of its ranks on a node.
    world_size: u32,
    hosts: HashSet<usize>,
    /// The world ranks connected here (one connection each).
    ranks: HashSet<u32>,
    failed: Option<Status>,
    finished: HashSet<(CommId, u64)>,
    finished_order: std::collections::VecDeque<(CommId, u64)>,
}

pub struct Server {
    me: SpId,
    cluster: Cluster,
    poll: Poll,
    hosts_listener: UnixListener,
    host_socket: PathBuf,
    conns: Slab<Conn<Role>>,
    /// Serial of the next connection ([`Conn::serial`]).
    next_serial: u64,
    /// Connections to close once the handler that found them broken is done, by key and
    /// serial: a failed write inside a handler must not pull the connection out from under
    /// the handler (its caller may still look at it).
    doomed: Vec<(usize, u64, String)>,
    peer_conn: HashMap<SpId, usize>,
    dead_peers: HashSet<SpId>,
    /// Peers that announced an orderly shutdown.
    leaving_peers: HashSet<SpId>,
    next_conn_id: u64,
    jobs: HashMap<u64, Job>,
    instances: HashMap<CollKey, Instance>,
    limiter: CopyLimiter<CopyJob>,
    copies: HashMap<u64, (CollKey, u64)>,
    /// Copies handed to hosts, by ticket (the same numbering as `copies`).
    host_copies: HashMap<u64, HostCopy>,
    next_ticket: u64,
    datapath: Datapath,
    /// Mover of the loop thread: mailbox writes and inline copies.
    mover: CmaMover,
    inline_copy_bytes: u64,
    /// `ucx` grants are accepted (else only `cma`).
    ucx: bool,
    /// Inline copies finished, waiting to be fed back to their instances.
    inline_done: Vec<crate::datapath::CopyDone>,
    /// Host copies that ended without being handed over, or answered, likewise.
    host_done: Vec<(CollKey, u64, Status)>,
    staged: StagedConfig,
    /// With UCX on: the staging buffers are registered with UCX and granted to the
    /// parent in a staged broadcast's tree, which puts chunks straight into them. Declared before
    /// `budget` so that it unmaps them before the pool frees them.
    stage_ucx: Option<alias_mkey::host::UcxRegistrar>,
    /// See [`ServeConfig::poll_interval`].
    poll_interval: Option<Duration>,
    /// Slots children granted through UCX: (instance, child, slot) -> its key.
    peer_slots: HashMap<(CollKey, SpId, u32), AliasKey>,
    /// Moves running as UCX puts on the datapath, by ticket: the instance, the move, the
    /// child, the `Chunk` message to send it once the bytes are there and their length.
    ucx_moves: HashMap<u64, (CollKey, u64, SpId, CollMsg, u64)>,
    budget: Budget,
    /// Segment regions per job (hierarchical staged designs), and the region of each instance.
    arenas: HashMap<u64, Arena>,
    regions: HashMap<CollKey, Region>,
    /// Hierarchical instances that found no room in the segment: this SP delivers them flat.
    flat_here: HashSet<CollKey>,
    /// The node's other SPs that said a job is gone there (`SpToSp::JobGone`), for jobs still
    /// here; and, for jobs gone here, those still to say so before the node's segment name is
    /// removed.
    gone_at_siblings: HashMap<u64, HashSet<SpId>>,
    unlink_after: HashMap<u64, HashSet<SpId>>,
    signals: crate::signals::SignalPipe,
    start: Instant,
    key: ClusterKey,
    limits: Limits,
    /// Client-caused warnings (bad frames, refused hellos and posts): rate-limited.
    log_limit: LogLimit,
    /// When connections without a hello were last checked for their timeout.
    last_hello_sweep: Instant,
    /// `SPOFF_RECORD_FRAMES`: received frames written to files (the fuzzer's seed corpus).
    recorder: Option<crate::record::Recorder>,
    heartbeat: Duration,
    peer_timeout: Duration,
    last_beat: Instant,
    /// When each peer SP was last heard from (any frame).
    last_heard: HashMap<SpId, Instant>,
    pub stats: Stats,
}

fn now_ns(start: Instant) -> Nanos {
    start.elapsed().as_nanos() as Nanos
}

/// The UCX registrar of this SP's staging, its event fd registered with `poll`.
fn stage_registrar(poll: &Poll) -> anyhow::Result<alias_mkey::host::UcxRegistrar> {
    let reg = alias_mkey::host::UcxRegistrar::new()
        .map_err(|e| anyhow::anyhow!("cannot set up UCX for staging: {e}"))?;
    let fd = reg
        .event_fd()
        .map_err(|e| anyhow::anyhow!("cannot get the UCX event fd: {e}"))?;
    poll.registry().register(
        &mut mio::unix::SourceFd(&fd),
        UCX_EVENTS,
        Interest::READABLE,
    )?;
    Ok(reg)
}

impl Instance {
    /// Every comm rank this SP serves in the instance has posted.
    fn all_local_posted(&self) -> bool {
        self.local_ranks.is_some_and(|n| self.posted.len() >= n)
    }
}

impl Server {
    pub fn new(
        cfg: ServeConfig,
        peers: HashMap<SpId, std::net::TcpStream>,
    ) -> anyhow::Result<Server> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let _ = std::fs::remove_file(&cfg.host_socket);
        let mut hosts_listener = UnixListener::bind(&cfg.host_socket)
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", cfg.host_socket.display()))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(
                &cfg.host_socket,
                std::fs::Permissions::from_mode(cfg.socket_mode),
            )
            .map_err(|e| {
                anyhow::anyhow!("cannot set the mode of {}: {e}", cfg.host_socket.display())
            })?;
        }
        let stale = access::remove_stale_segments(&cfg.key);
        if stale > 0 {
            info!(
                sp = cfg.sp,
                "removed {stale} shared-memory segments left by an earlier run"
            );
        }
        poll.registry()
            .register(&mut hosts_listener, LISTEN_HOSTS, Interest::READABLE)?;
        let signals = crate::signals::SignalPipe::install()?;
        poll.registry()
            .register(&mut signals.source(), SIGNALS, Interest::READABLE)?;
        // With UCX, chunks of the staged collectives move between SPs as UCX puts into the
        // staging of an SP's children (its loop progresses the worker, see `run`).
        let stage_ucx = match cfg.ucx {
            UcxMode::Off => None,
            mode => match stage_registrar(&poll) {
                Ok(reg) => Some(reg),
                Err(e) if mode == UcxMode::Auto => {
                    warn!(
                        sp = cfg.sp,
                        "UCX is off: {e}; staged chunks travel as frames, ucx grants are refused"
                    );
                    None
                }
                Err(e) => return Err(e),
            },
        };
        let start_datapath = |ucx| {
            Datapath::start(
                cfg.datapath_threads,
                alias_mkey::mover::MoverConfig {
                    chunk_bytes: cfg.chunk_bytes,
                    ucx,
                },
                waker.clone(),
            )
        };
        let mut stage_ucx = stage_ucx;
        let datapath = match start_datapath(stage_ucx.is_some()) {
            Ok(d) => d,
            Err(e) if stage_ucx.is_some() && cfg.ucx == UcxMode::Auto => {
                warn!(
                    sp = cfg.sp,
                    "UCX is off: the datapath cannot use it ({e}); staged chunks travel as \
                     frames, ucx grants are refused"
                );
                stage_ucx = None;
                start_datapath(false)
                    .map_err(|e| anyhow::anyhow!("cannot start the datapath: {e}"))?
            }
            Err(e) => return Err(anyhow::anyhow!("cannot start the datapath: {e}")),
        };
        let ucx = stage_ucx.is_some();
        let mut server = Server {
            me: cfg.sp,
            cluster: cfg.cluster,
            poll,
            hosts_listener,
            host_socket: cfg.host_socket,
            conns: Slab::new(),
            next_serial: 0,
            doomed: Vec::new(),
            peer_conn: HashMap::new(),
            dead_peers: HashSet::new(),
            leaving_peers: HashSet::new(),
            next_conn_id: 0,
            jobs: HashMap::new(),
            instances: HashMap::new(),
            limiter: CopyLimiter::new(cfg.max_inflight_reads.max(1)),
            copies: HashMap::new(),
            host_copies: HashMap::new(),
            next_ticket: 0,
            datapath,
            ucx,
            mover: CmaMover::new((cfg.inline_copy_bytes as usize).clamp(4096, 1 << 20)),
            inline_copy_bytes: cfg.inline_copy_bytes,
            inline_done: Vec::new(),
            host_done: Vec::new(),
            staged: cfg.staged,
            stage_ucx,
            peer_slots: HashMap::new(),
            ucx_moves: HashMap::new(),
            budget: Budget::new(cfg.staging_bytes),
            poll_interval: cfg.poll_interval,
            arenas: HashMap::new(),
            regions: HashMap::new(),
            flat_here: HashSet::new(),
            gone_at_siblings: HashMap::new(),
            unlink_after: HashMap::new(),
            signals,
            start: Instant::now(),
            key: cfg.key,
            limits: cfg.limits,
            log_limit: LogLimit::new(20, Duration::from_secs(10)),
            last_hello_sweep: Instant::now(),
            recorder: crate::record::Recorder::from_env(cfg.sp),
            heartbeat: cfg.heartbeat,
            peer_timeout: cfg.peer_timeout,
            last_beat: Instant::now(),
            last_heard: HashMap::new(),
            stats: Stats::default(),
        };
        for (sp, s) in peers {
            s.set_nonblocking(true)?;
            let stream = Stream::Tcp(mio::net::TcpStream::from_std(s));
            let key = server.add_conn(stream, Role::Peer(sp))?;
            server.peer_conn.insert(sp, key);
            server.last_heard.insert(sp, Instant::now());
        }
        Ok(server)
    }

    fn add_conn(&mut self, stream: Stream, role: Role) -> io::Result<usize> {
        let entry = self.conns.vacant_entry();
        let key = entry.key();
        self.next_serial += 1;
        let limit = match role {
            Role::Peer(_) => crate::conn::MAX_PENDING_OUT_BYTES,
            Role::NewHost { .. } | Role::Host(_) => self.limits.max_host_out_bytes,
        };
        let conn = entry.insert(Conn::new(stream, role, self.next_serial).with_out_limit(limit));
        self.poll.registry().register(
            conn.stream.source(),
            Token(CONN_BASE + key),
            Interest::READABLE | Interest::WRITABLE,
        )?;
        Ok(key)
    }

    /// Runs until SIGINT/SIGTERM. Returns the stats.
    pub fn run(mut self) -> anyhow::Result<Stats> {
        let mut events = Events::with_capacity(256);
        info!(sp = self.me, socket = %self.host_socket.display(), "serving");
        if self.poll_interval.is_some() {
            // Naps of a few tens of microseconds: Linux's default timer slack (50 us) would
            // stretch each one by up to that much.
            // SAFETY: prctl with an integer argument; no memory is passed.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, POLL_TIMER_SLACK_NS) };
        }
        loop {
            // Puts of other SPs into this SP's staging complete only while its UCX worker
            // progresses (UCX 1.13 over tcp/shared memory): progress it until idle, then sleep
            // on its event fd as well as on the sockets. `arm` refuses while events are
            // pending: then look again at once. The bound is a safety net only. A polling SP
            // (`poll_interval`) progresses the worker at every look and never arms it.
            let polling = self.poll_interval;
            let timeout = self.stage_ucx.as_ref().map(|reg| {
                while reg.progress() > 0 {}
                if polling.is_some() {
                    return Duration::ZERO;
                }
                match reg.arm() {
                    Ok(true) => Duration::from_millis(50),
                    Ok(false) => Duration::ZERO,
                    // Not expected; poll the worker often rather than spin.
                    Err(_) => Duration::from_millis(1),
                }
            });
            let timeout = if polling.is_some() {
                Some(Duration::ZERO)
            } else {
                // Wake up for the heartbeats, and to close connections whose hello is late.
                let pending = self
                    .conns
                    .iter()
                    .any(|(_, c)| matches!(c.role, Role::NewHost { .. }));
                let wake = if pending {
                    self.heartbeat.min(Duration::from_millis(100))
                } else {
                    self.heartbeat
                };
                Some(timeout.map_or(wake, |t| t.min(wake)))
            };
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e.into());
            }
            if let (Some(nap), true) = (polling, events.is_empty()) {
                self.stats.empty_polls += 1;
                // A nap, not sched_yield: SPs spinning with sched_yield on one CPU were seen to
                // keep it from each other and from their datapath threads for a whole
                // scheduler tick (milliseconds) on Linux 6.18.
                std::thread::sleep(nap);
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTEN_HOSTS => self.accept_hosts(),
                    WAKER | UCX_EVENTS => {}
                    SIGNALS => {
                        if self.signals.drain() {
                            info!(sp = self.me, "stopping on signal");
                            self.say_shutdown();
                            let _ = std::fs::remove_file(&self.host_socket);
                            return Ok(self.stats_now());
                        }
                    }
                    Token(t) if t >= PIDFD_BASE => self.on_pidfd(t - PIDFD_BASE),
                    Token(t) => {
                        let key = t - CONN_BASE;
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.on_readable(key);
                        }
                        if ev.is_writable() {
                            self.flush_conn(key);
                        }
                    }
                }
                self.close_doomed();
            }
            self.sweep_hellos();
            self.heartbeats();
            loop {
                self.on_copies_done();
                self.close_doomed();
                if self.host_done.is_empty() {
                    break;
                }
                self.feed_host_copies_done();
            }
        }
    }

    /// The counters, with the jobs and instances held right now.
    fn stats_now(&self) -> Stats {
        let mut s = self.stats.clone();
        s.jobs_at_exit = self.jobs.len() as u64;
        s.instances_at_exit = self.instances.len() as u64;
        s
    }

    /// Tells every peer this SP is stopping, with a bounded effort to get it out.
    fn say_shutdown(&mut self) {
        let frame = encode(&SpToSp::Shutdown);
        let peers: Vec<usize> = self.peer_conn.values().copied().collect();
        for k in peers {
            if let Some(c) = self.conns.get_mut(k) {
                let _ = c.send(&frame);
                let deadline = Instant::now() + Duration::from_millis(100);
                while c.pending_out() > 0 && Instant::now() < deadline {
                    if c.flush().is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    fn accept_hosts(&mut self) {
        loop {
            match self.hosts_listener.accept() {
                Ok((s, _)) => {
                    let (mut hosts, mut pending) = (0, 0);
                    for (_, c) in self.conns.iter() {
                        match c.role {
                            Role::NewHost { .. } => pending += 1,
                            Role::Host(_) => hosts += 1,
                            Role::Peer(_) => {}
                        }
                    }
                    if hosts + pending >= self.limits.max_hosts
                        || pending >= self.limits.max_pending_hellos
                    {
                        self.stats.hosts_refused += 1;
                        let (max_hosts, max_pending) =
                            (self.limits.max_hosts, self.limits.max_pending_hellos);
                        self.client_warn(|| {
                            format!(
                                "refusing a host connection: {hosts} hosts and {pending} without \
                                 a hello already (limits {max_hosts} and {max_pending})"
                            )
                        });
                        continue;
                    }
                    let peer = match access::peer_cred(&s) {
                        Ok(p) => p,
                        Err(e) => {
                            self.client_warn(|| {
                                format!("cannot identify the process of a host connection: {e}")
                            });
                            continue;
                        }
                    };
                    let since = Instant::now();
                    match self.add_conn(Stream::Unix(s), Role::NewHost { peer, since }) {
                        Ok(key) => self.watch_pidfd(key),
                        Err(e) => warn!("cannot register a host connection: {e}"),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    warn!("accept on the host socket failed: {e}");
                    return;
                }
            }
        }
    }

    /// Registers the pidfd of host connection `key` with the poller: readable once the
    /// connected process has exited, even if another process (a child it forked) still holds
    /// the socket.
    fn watch_pidfd(&mut self, key: usize) {
        let fd = match self.conns.get(key).map(|c| &c.role) {
            Some(Role::NewHost { peer, .. }) => peer.pidfd.as_raw_fd(),
            _ => return,
        };
        let registered = self.poll.registry().register(
            &mut mio::unix::SourceFd(&fd),
            Token(PIDFD_BASE + key),
            Interest::READABLE,
        );
        if let Err(e) = registered {
            warn!(sp = self.me, "cannot watch a host's process: {e}");
        }
    }

    /// The pidfd of host connection `key` became readable: if its process has exited, the
    /// rank is gone, whoever still holds the socket.
    fn on_pidfd(&mut self, key: usize) {
        let gone = match self.conns.get(key).map(|c| &c.role) {
            Some(Role::NewHost { peer, .. }) => !alias_mkey::process::alive(&peer.pidfd),
            Some(Role::Host(h)) => !alias_mkey::process::alive(&h.peer.pidfd),
            _ => false,
        };
        if gone {
            self.close_conn(key, "the rank's process exited");
        }
    }

    /// Closes connections that have not said hello within the limit.
    fn sweep_hellos(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_hello_sweep) < Duration::from_millis(100) {
            return;
        }
        self.last_hello_sweep = now;
        let late: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                matches!(&c.role, Role::NewHost { since, .. }
                    if now.duration_since(*since) > self.limits.hello_timeout)
            })
            .map(|(k, _)| k)
            .collect();
        for k in late {
            self.stats.hellos_timed_out += 1;
            self.close_conn(k, "no hello in time");
        }
    }

    /// Sends the heartbeats that are due, and drops peers that have been silent too long: a
    /// stopped or deadlocked SP keeps its connections open, and only its silence tells.
    fn heartbeats(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_beat) >= self.heartbeat {
            self.last_beat = now;
            // Pins of processes that exited since (a job's ranks may still have been exiting
            // when the job ended here).
            alias_mkey::process::sweep();
            let beat = encode(&SpToSp::Heartbeat);
            let peers: Vec<usize> = self.peer_conn.values().copied().collect();
            for k in peers {
                self.send_frame(k, &beat);
            }
            let beat = encode(&SpToHost::Heartbeat);
            let hosts: Vec<usize> = self
                .conns
                .iter()
                .filter(|(_, c)| matches!(&c.role, Role::Host(h) if h.outstanding > 0))
                .map(|(k, _)| k)
                .collect();
            for k in hosts {
                self.send_frame(k, &beat);
            }
        }
        let silent: Vec<(SpId, Duration)> = self
            .peer_conn
            .keys()
            .filter_map(|sp| {
                let quiet = now.duration_since(*self.last_heard.get(sp)?);
                (quiet > self.peer_timeout).then_some((*sp, quiet))
            })
            .collect();
        for (sp, quiet) in silent {
            if let Some(k) = self.peer_conn.get(&sp).copied() {
                self.stats.peers_silent += 1;
                self.close_conn(
                    k,
                    &format!(
                        "no message or heartbeat for {:.1} s: the SP is stuck",
                        quiet.as_secs_f64()
                    ),
                );
            }
        }
    }

    /// A warning a client can cause, within the log's rate limit.
    fn client_warn(&mut self, msg: impl FnOnce() -> String) {
        let (log, suppressed) = self.log_limit.admit(Instant::now());
        if let Some(n) = suppressed {
            warn!(sp = self.me, "{n} more client warnings were suppressed");
        }
        if log {
            warn!(sp = self.me, "{}", msg());
        }
    }

    fn on_readable(&mut self, key: usize) {
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        let mut frames = Vec::new();
        let end = conn.read_frames(|f| frames.push(f));
        for f in frames {
            self.on_frame(key, f);
            if !self.conns.contains(key) || self.is_doomed(key) {
                return;
            }
        }
        match end {
            Ok(ReadEnd::Open) => {}
            Ok(ReadEnd::Closed) => self.close_conn(key, "closed by the other side"),
            Err(e) => {
                // An oversized or undecodable frame: the stream can no longer be trusted.
                self.send_error(key, None, ErrorCode::BadDescriptor, e.to_string());
                self.close_conn(key, &e.to_string());
            }
        }
    }

    fn flush_conn(&mut self, key: usize) {
        if let Some(c) = self.conns.get_mut(key) {
            if let Err(e) = c.flush() {
                self.close_conn(key, &format!("write failed: {e}"));
            }
        }
    }

    /// Sends `msg` to peer SP `sp` if it is connected (a lost peer needs nothing more).
    fn send_peer(&mut self, sp: SpId, msg: &SpToSp) {
        if let Some(k) = self.peer_conn.get(&sp).copied() {
            self.send_frame(k, &encode(msg));
        }
    }

    fn send_frame(&mut self, key: usize, frame: &[u8]) {
        if let Some(c) = self.conns.get_mut(key) {
            if let Err(e) = c.send(frame) {
                let serial = c.serial;
                if !self.doomed.iter().any(|d| d.0 == key && d.1 == serial) {
                    self.doomed
                        .push((key, serial, format!("write failed: {e}")));
                }
            }
        }
    }

    /// Whether connection `key` is to be closed (see `doomed`).
    fn is_doomed(&self, key: usize) -> bool {
        let serial = self.conns.get(key).map(|c| c.serial);
        self.doomed
            .iter()
            .any(|d| Some(d.1) == serial && d.0 == key)
    }

    /// Closes the connections found broken by the handlers that just ran.
    fn close_doomed(&mut self) {
        while let Some((key, serial, why)) = self.doomed.pop() {
            if self.conns.get(key).is_some_and(|c| c.serial == serial) {
                self.close_conn(key, &why);
            }
        }
    }

    fn send_error(
        &mut self,
        key: usize,
        post: Option<&PostDesc>,
        code: ErrorCode,
        message: String,
    ) {
        self.stats.errors_sent += 1;
        let msg = SpToHost::Error {
            comm: post.map(|p| p.comm),
            seq: post.map(|p| p.seq),
            code,
            message,
        };
        self.send_frame(key, &encode(&msg));
    }

    fn on_frame(&mut self, key: usize, payload: Vec<u8>) {
        if let Some(rec) = &mut self.recorder {
            let c = &self.conns[key];
            let kind = if matches!(c.role, Role::Peer(_)) {
                "peer"
            } else {
                "host"
            };
            rec.record(kind, c.serial, &payload);
        }
        let role = match &self.conns[key].role {
            Role::NewHost { .. } => None,
            Role::Host(_) => Some(true),
            Role::Peer(sp) => {
                self.last_heard.insert(*sp, Instant::now());
                Some(false)
            }
        };
        match role {
            None => self.on_host_hello(key, &payload),
            Some(true) => match decode::<HostToSp>(&payload) {
                Ok(msg) => self.on_host_msg(key, msg),
                Err(e) => {
                    let rank = self.host(key).hello.world_rank;
                    self.client_warn(|| format!("undecodable message from rank {rank}: {e}"));
                    self.send_error(key, None, ErrorCode::BadDescriptor, e.to_string());
                }
            },
            Some(false) => match decode::<SpToSp>(&payload) {
                Ok(msg) => self.on_peer_msg(key, msg),
                Err(e) => warn!(sp = self.me, "undecodable message from a peer SP: {e}"),
            },
        }
    }

    /// The first frame of a host connection: a rank's hello, or an admin request.
    fn on_host_hello(&mut self, key: usize, payload: &[u8]) {
        let Some(Role::NewHost { peer, .. }) = self.conns.get(key).map(|c| &c.role) else {
            return;
        };
        let (pid, uid) = (peer.pid, peer.uid);
        let reject = |s: &mut Self, reason: String| {
            s.stats.hellos_refused += 1;
            let shown = reason.clone();
            s.client_warn(|| format!("refusing host pid {pid} uid {uid}: {shown}"));
            s.send_frame(key, &frame(&encode_hello(&Hello::Reject { reason })));
            s.close_conn(key, "hello refused");
        };
        let hello = match decode_hello(payload) {
            Ok(Hello::Host(h)) => h,
            Ok(Hello::Admin(a)) => {
                if !self.admin_ok(&a) {
                    return reject(
                        self,
                        "the admin request is not proven with the cluster key".into(),
                    );
                }
                // `service-process stats`: the counters now, then goodbye.
                let json = serde_json::to_string(&self.stats_now()).unwrap_or_default();
                self.send_frame(key, &encode(&json));
                self.close_conn(key, "stats sent");
                return;
            }
            Ok(other) => return reject(self, format!("expected a host hello, got {other:?}")),
            Err(e) => return reject(self, e.to_string()),
        };
        let cred = match access::check_hello(&hello, &self.key, uid, &self.limits) {
            Ok(c) => c,
            Err(why) => return reject(self, why.to_string()),
        };
        match self.cluster.placement(hello.world_rank, hello.world_size) {
            Ok(p) if p.sp == self.me => {}
            Ok(p) => {
                return reject(
                    self,
                    format!(
                        "rank {} of {} belongs to SP {}, not SP {}",
                        hello.world_rank, hello.world_size, p.sp, self.me
                    ),
                )
            }
            Err(e) => return reject(self, e.to_string()),
        }
        if self
            .jobs
            .get(&cred.job)
            .is_some_and(|j| j.ranks.contains(&hello.world_rank))
        {
            return reject(
                self,
                format!(
                    "rank {} of this job is already connected to SP {}",
                    hello.world_rank, self.me
                ),
            );
        }
        debug!(
            sp = self.me,
            job = cred.job,
            rank = hello.world_rank,
            pid,
            "host connected"
        );
        let job = self.jobs.entry(cred.job).or_default();
        job.world_size = cred.world_size;
        job.hosts.insert(key);
        job.ranks.insert(hello.world_rank);
        self.next_conn_id += 1;
        let conn_id = self.next_conn_id;
        let conn = &mut self.conns[key];
        let Role::NewHost { peer, .. } = std::mem::replace(&mut conn.role, Role::Peer(SpId::MAX))
        else {
            unreachable!("checked above");
        };
        conn.role = Role::Host(HostState {
            conn_id,
            hello,
            job: cred.job,
            peer,
            mailbox: None,
            said_goodbye: false,
            outstanding: 0,
        });
        self.send_frame(key, &frame(&encode_hello(&Hello::Welcome { sp: self.me })));
    }

    /// Whether an admin request is proven with the cluster key, within a minute of now.
    fn admin_ok(&self, a: &AdminHello) -> bool {
        auth::unix_secs().abs_diff(a.unix_secs) <= 60
            && auth::admin_proof_ok(&self.key, &a.nonce, a.unix_secs, &a.proof)
    }

    fn host(&self, key: usize) -> &HostState {
        match &self.conns[key].role {
            Role::Host(h) => h,
            _ => unreachable!("connection {key} is not a host"),
        }
    }

    fn on_host_msg(&mut self, key: usize, msg: HostToSp) {
        match msg {
            HostToSp::Register {
                cores: _,
                mailbox,
                mailbox_slots,
            } => {
                let h = self.host(key);
                if h.mailbox.is_some() {
                    return self.send_error(
                        key,
                        None,
                        ErrorCode::NotRegistered,
                        "already registered".into(),
                    );
                }
                let need = mailbox::slot_offset(mailbox_slots);
                if mailbox.len < need
                    || !mailbox.rights.contains(Rights::READ_WRITE)
                    || mailbox.backend != BackendData::Cma
                    || mailbox_slots == 0
                {
                    return self.send_error(
                        key,
                        None,
                        ErrorCode::BadDescriptor,
                        format!(
                            "mailbox grant of {} bytes ({}) cannot hold {mailbox_slots} slots \
                             of {} bytes read-write through cma",
                            mailbox.len,
                            mailbox.rights,
                            mailbox::SLOT_BYTES
                        ),
                    );
                }
                let alias = self.alias(key, mailbox);
                let sp = self.me;
                let node = self.cluster.sp(sp).map_or(0, |e| e.node);
                let segment = access::segment_name(&self.key, alias.owner.job, node);
                if let Role::Host(h) = &mut self.conns[key].role {
                    h.mailbox = Some((alias, mailbox_slots));
                }
                self.send_frame(key, &encode(&SpToHost::Registered { sp, segment }));
            }
            HostToSp::Post(desc) => self.on_post(key, *desc),
            HostToSp::Goodbye => {
                if let Role::Host(h) = &mut self.conns[key].role {
                    h.said_goodbye = true;
                }
            }
            HostToSp::CopyDone { ticket, ok } => self.on_host_copy_done(key, ticket, ok),
        }
    }

    fn alias(&self, key: usize, grant: Grant) -> AliasKey {
        let h = self.host(key);
        AliasKey {
            owner: Owner {
                job: h.job,
                world_rank: h.hello.world_rank,
                pid: h.peer.pid,
                start: h.peer.start,
            },
            grant,
        }
    }

    /// Checks a descriptor against itself, the cluster and its grants.
    /// Checks a descriptor (see `validate::check_post`); `world_rank` and `world_size`: the
    /// poster's, from its hello; `ck`: the instance.
    fn check_post(
        &self,
        d: &PostDesc,
        world_rank: u32,
        world_size: u32,
        ck: CollKey,
    ) -> Result<(), (ErrorCode, String)> {
        let shape = self.instances.get(&ck).and_then(|i| i.shape.as_ref());
        crate::validate::check_post(
            d,
            &crate::validate::Poster {
                sp: self.me,
                world_rank,
                world_size,
            },
            &self.cluster,
            self.ucx,
            shape.map(|(m, w)| (m.as_slice(), w.as_slice())),
        )
    }

    fn on_post(&mut self, key: usize, d: PostDesc) {
        self.stats.posts += 1;
        self.stats.posts_packed += (d.send_packed || d.recv_packed) as u64;
        let (job, slots) = {
            let h = self.host(key);
            match &h.mailbox {
                Some((_, slots)) => (h.job, *slots),
                None => {
                    return self.send_error(
                        key,
                        Some(&d),
                        ErrorCode::NotRegistered,
                        "post before register".into(),
                    )
                }
            }
        };
        if let Some(slot) = d.slot.filter(|&s| s >= slots) {
            return self.send_error(
                key,
                Some(&d),
                ErrorCode::BadDescriptor,
                format!("mailbox slot {slot} outside the {slots} registered"),
            );
        }
        let ck = CollKey {
            job,
            comm: d.comm,
            seq: d.seq,
        };
        // Every post from here on gets exactly one completion.
        let (world_rank, outstanding) = {
            let h = self.host(key);
            (h.hello.world_rank, h.outstanding)
        };
        let world_size = self.jobs.get(&job).map_or(0, |j| j.world_size);
        if let Role::Host(h) = &mut self.conns[key].role {
            h.outstanding += 1;
        }
        let open_instances = || self.instances.keys().filter(|k| k.job == job).count();
        let over = if outstanding >= self.limits.max_posts_per_rank {
            Some(format!(
                "{outstanding} posts of this rank are not complete yet (limit {}, serve \
                 --max-posts-per-rank)",
                self.limits.max_posts_per_rank
            ))
        } else if !self.instances.contains_key(&ck)
            && open_instances() >= self.limits.max_instances_per_job
        {
            Some(format!(
                "the job has {} collectives open on SP {} (limit {}, serve \
                 --max-instances-per-job)",
                open_instances(),
                self.me,
                self.limits.max_instances_per_job
            ))
        } else {
            None
        };
        if let Some(why) = over {
            self.stats.posts_refused += 1;
            self.send_error(key, Some(&d), ErrorCode::BadDescriptor, why);
            return self.write_completion(self.posted(key, d.slot, d.token), Status::InvalidPost);
        }
        if let Err((code, message)) = self.check_post(&d, world_rank, world_size, ck) {
            let members_ok = code == ErrorCode::BadDescriptor
                && d.members.len() > d.comm_rank as usize
                && d.members[d.comm_rank as usize] == self.me;
            self.send_error(key, Some(&d), code, message);
            self.write_completion(self.posted(key, d.slot, d.token), Status::InvalidPost);
            // Peers may already be waiting for this rank: if we know who they are, abort the
            // instance for every member rather than leave them hanging.
            if members_ok {
                let mut sps: Vec<SpId> = d.members.clone();
                sps.sort_unstable();
                sps.dedup();
                let status = Status::InvalidPost;
                let abort = (drivers::spec(d.kind).abort_msg)(status);
                let frame = encode(&SpToSp::Coll {
                    key: ck,
                    msg: abort,
                });
                let me = self.me;
                for sp in sps.into_iter().filter(|&sp| sp != me) {
                    if let Some(k) = self.peer_conn.get(&sp).copied() {
                        self.send_frame(k, &frame);
                    }
                }
                let now = now_ns(self.start);
                let inst = self.instance(ck, d.kind);
                inst.sm.abort(now, Status::InvalidPost);
                // This rank will not post this instance again: without this the instance
                // would wait for it forever.
                inst.sm.handle_rank_lost(now, d.comm_rank);
                self.drive(ck);
            }
            return;
        }
        if self
            .jobs
            .get(&job)
            .is_some_and(|j| j.finished.contains(&(d.comm, d.seq)))
        {
            self.send_error(
                key,
                Some(&d),
                ErrorCode::UnknownComm,
                format!("collective {:?} seq {} already finished", d.comm, d.seq),
            );
            return self.write_completion(self.posted(key, d.slot, d.token), Status::InvalidPost);
        }
        // A hierarchical staged instance needs a region of its job's segment on this SP. When
        // none is free, this SP delivers the instance flat: it writes each rank's buffer
        // itself (its ranks granted them for writing), which the ranks cannot tell apart from
        // a copy out of the segment. Waiting for room instead could deadlock: the instance
        // holding the room may need a post that waits elsewhere.
        // Only one SP of a node writes a hierarchical region, which the node's other SPs' ranks
        // copy out of: a bcast's node leader in its tree, a staged allgather's node owner.
        let spec = drivers::spec(d.kind);
        let region_writer = d.staged.is_none() || (spec.region_writer)(&d, self.me);
        let mut shared_at = 0;
        let shared_key = match &d.staged {
            Some(st)
                if st.design == StagedDesign::Hier
                    && region_writer
                    && !self.flat_here.contains(&ck) =>
            {
                let seg = st.segment.clone().expect("checked by check_post");
                let len = (spec.region_len)(&d);
                match self.region_for(ck, &seg, len) {
                    Ok(Some((off, rlen))) => Some({
                        shared_at = off;
                        self.alias(
                            key,
                            Grant {
                                addr: seg.addr + off,
                                len: rlen,
                                ..seg
                            },
                        )
                    }),
                    Ok(None) => {
                        self.stats.hier_delivered_flat += 1;
                        self.flat_here.insert(ck);
                        None
                    }
                    Err(why) => {
                        self.send_error(key, Some(&d), ErrorCode::BadDescriptor, why);
                        return self.write_completion(
                            self.posted(key, d.slot, d.token),
                            Status::InvalidPost,
                        );
                    }
                }
            }
            _ => None,
        };
        let send = self.alias(key, d.send.clone());
        let recv = self.alias(key, d.recv.clone());
        let now = now_ns(self.start);
        let failed = self.jobs.get(&job).and_then(|j| j.failed);
        let dead: Vec<SpId> = d
            .members
            .iter()
            .copied()
            .filter(|sp| self.dead_peers.contains(sp))
            .collect();
        let posted = Posted {
            host_copies: d.host_copies && spec.host_copies,
            ..self.posted(key, d.slot, d.token)
        };
        let me = self.me;
        let inst = self.instance(ck, d.kind);
        inst.local_ranks = Some(d.members.iter().filter(|&&sp| sp == me).count());
        if inst.shape.is_none() {
            inst.shape = Some((d.members.clone(), d.world_ranks.clone()));
        }
        // A node's region writer without room delivers flat (its node's other SPs then get
        // the data); the others are hierarchical as posted.
        let hier = shared_key.is_some()
            || (!region_writer
                && d.staged
                    .as_ref()
                    .is_some_and(|st| st.design == StagedDesign::Hier));
        let comm_rank = d.comm_rank;
        let post = LocalPost {
            desc: d,
            send,
            recv,
            region: shared_key.map(|k| (k, shared_at)),
            hier,
        };
        match inst.sm.handle_post(now, post) {
            Ok(()) => {
                inst.posted.insert(comm_rank, posted);
                if let Some(status) = failed {
                    inst.sm.abort(now, status);
                }
                for sp in dead {
                    inst.sm.handle_peer_lost(now, sp);
                }
                self.drive(ck);
            }
            Err(e) => {
                self.send_error(key, None, ErrorCode::UnknownComm, e);
                self.write_completion(posted, Status::InvalidPost);
            }
        }
    }

    /// The instance of `ck`, created (as a `kind`) by the first event that names it.
    fn instance(&mut self, ck: CollKey, kind: CollKind) -> &mut Instance {
        if !self.instances.contains_key(&ck) {
            let mut inst = Instance {
                sm: drivers::new(kind, ck, self.me, self.staged),
                posted: HashMap::new(),
                shape: None,
                local_ranks: None,
                stages: None,
            };
            if drivers::spec(kind).staging {
                match self
                    .budget
                    .reserve(ck.job, self.staged.slots, self.staged.chunk_bytes)
                {
                    Ok(set) => {
                        self.stats.staging_peak_bytes = self.budget.peak;
                        inst.stages = Some(set);
                    }
                    Err(why) => {
                        warn!(sp = self.me, ?ck, "{why}; the collective fails");
                        self.stats.staging_refused += 1;
                        inst.sm.abort(now_ns(self.start), Status::Aborted);
                    }
                }
            }
            self.instances.insert(ck, inst);
        }
        self.instances.get_mut(&ck).expect("just inserted")
    }

    fn on_peer_msg(&mut self, key: usize, msg: SpToSp) {
        let Role::Peer(from) = self.conns[key].role else {
            return;
        };
        let (ck, m, data) = match msg {
            SpToSp::Coll { key, msg } => (key, msg, None),
            SpToSp::Data { key, msg, data } => (key, msg, Some(data.0)),
            // The frame itself was the news (`on_frame` noted when it came).
            SpToSp::Heartbeat => return,
            SpToSp::Shutdown => {
                debug!(sp = self.me, from, "peer SP is shutting down");
                self.leaving_peers.insert(from);
                return;
            }
            SpToSp::SlotGrants { key, slots } => {
                // Without UCX here the datapath cannot put: the chunks go as frames, which the
                // child takes as well.
                if self.ucx {
                    for (slot, k) in slots {
                        self.peer_slots.insert((key, from, slot), k);
                    }
                }
                return;
            }
            SpToSp::JobAbort { job, reason } => {
                warn!(sp = self.me, from, job, "job aborted: {reason}");
                self.fail_job(job, Status::RankFailed, false);
                return;
            }
            SpToSp::JobGone { job, answer } => {
                // Without the job here (and not waiting to unlink its name), none of its ranks
                // is connected here: say so, so that the sender need not wait for this SP.
                if !answer && !self.jobs.contains_key(&job) && !self.unlink_after.contains_key(&job)
                {
                    self.send_peer(from, &SpToSp::JobGone { job, answer: true });
                    return;
                }
                self.sibling_gone(from, Some(job));
                return;
            }
            SpToSp::RegionReleased { key } => {
                self.region_released(key, from);
                return;
            }
        };
        // Memory keys a peer names must belong to the instance's job: an SP never copies
        // for one job into or out of another job's ranks, whatever a peer says.
        let world = self.jobs.get(&ck.job).map(|j| j.world_size);
        let foreign = m
            .keys()
            .into_iter()
            .find(|k| k.owner.job != ck.job || world.is_some_and(|w| k.owner.world_rank >= w));
        if let Some(k) = foreign {
            warn!(
                sp = self.me,
                from,
                ?ck,
                "a peer named memory of job {} rank {} in this job's collective; aborting it",
                k.owner.job,
                k.owner.world_rank
            );
            let now = now_ns(self.start);
            if let Some(inst) = self.instances.get_mut(&ck) {
                inst.sm.abort(now, Status::PeerFailed);
            }
            self.drive(ck);
            return;
        }
        let inbound = (drivers::spec(drivers::kind_of(&m)).inbound)(&m);
        // A node's region writer lent its region to this SP's ranks: it keeps the region until
        // told they are done with it (at once if this SP has no instance to read it).
        if let Some(at) = inbound.lends_region_at {
            let live = self
                .jobs
                .get(&ck.job)
                .is_some_and(|j| !j.finished.contains(&(ck.comm, ck.seq)));
            if live {
                self.regions.entry(ck).or_insert_with(|| Region {
                    off: at,
                    len: 0,
                    readers: 0,
                    finished: false,
                    owner: Some(from),
                    borrowers: HashSet::new(),
                });
            } else {
                self.send_peer(from, &SpToSp::RegionReleased { key: ck });
            }
        }
        {
            {
                let Some(job) = self.jobs.get(&ck.job) else {
                    // No rank of this job is (any longer) connected here, so none will post:
                    // the job ended or failed here. Answer what expects an answer so that its
                    // sender is not left waiting for it.
                    if self.send_refusals(ck, &m, from, Status::RankFailed) {
                        debug!(sp = self.me, ?ck, "message for a job gone here; refused");
                    }
                    return;
                };
                if job.finished.contains(&(ck.comm, ck.seq)) {
                    debug!(
                        sp = self.me,
                        ?ck,
                        "message for a finished collective; dropped"
                    );
                    if inbound.answer_when_finished {
                        self.send_refusals(ck, &m, from, Status::Aborted);
                    }
                    return;
                }
                if inbound.announce {
                    self.stats.announces_received += 1;
                }
                let now = now_ns(self.start);
                let me = self.me;
                let failed = job.failed;
                let is_new = !self.instances.contains_key(&ck);
                let inst = self.instance(ck, drivers::kind_of(&m));
                if let (true, Some(status)) = (is_new, failed) {
                    inst.sm.abort(now, status);
                }
                // A chunk's bytes go into the staging slot it names, if that slot was granted
                // to the sender and is waiting for it; anything else is a peer's bug, and the
                // instance fails rather than wait for bytes that will not come.
                let landed = match (&data, inbound.fills_slot) {
                    (None, _) => true,
                    (Some(bytes), Some((slot, len))) => {
                        let may = inst.sm.may_fill(from, slot) && bytes.len() as u64 == len;
                        match inst
                            .stages
                            .as_mut()
                            .and_then(|s| s.slots.get_mut(slot as usize))
                        {
                            Some(stage) if may => stage.fill(bytes),
                            _ => false,
                        }
                    }
                    (Some(_), None) => false,
                };
                if landed {
                    if let Err(e) = inst.sm.handle_msg(now, from, m) {
                        warn!(sp = self.me, from, ?ck, "protocol error from a peer: {e}");
                    }
                } else {
                    warn!(
                        sp = me,
                        from,
                        ?ck,
                        "data from a peer that fits no granted staging slot; aborting"
                    );
                    inst.sm.abort(now, Status::PeerFailed);
                }
                if let (true, Some(bytes)) = (landed, &data) {
                    self.stats.bytes_staged_in += bytes.len() as u64;
                }
                self.drive(ck);
            }
        }
    }

    /// Executes every action the instance has.
    fn drive(&mut self, ck: CollKey) {
        let _span = info_span!("drive", ?ck).entered();
        loop {
            let Some(inst) = self.instances.get_mut(&ck) else {
                return;
            };
            let Some(action) = inst.sm.poll_action() else {
                break;
            };
            match action {
                Act::Send {
                    to,
                    msg,
                    lends_region,
                    grants_slots,
                } => {
                    if lends_region {
                        self.stats.regions_shared += 1;
                        if let Some(r) = self.regions.get_mut(&ck) {
                            r.borrowers.insert(to);
                        }
                    }
                    if !grants_slots.is_empty() {
                        self.grant_slots_over_ucx(ck, to, &grants_slots);
                    }
                    let frame = encode(&SpToSp::Coll { key: ck, msg });
                    match self.peer_conn.get(&to).copied() {
                        Some(k) => {
                            self.stats.messages_sent += 1;
                            self.send_frame(k, &frame)
                        }
                        None => {
                            let now = now_ns(self.start);
                            if let Some(inst) = self.instances.get_mut(&ck) {
                                inst.sm.handle_peer_lost(now, to);
                            }
                        }
                    }
                }
                Act::Copy {
                    id,
                    dst_rank,
                    src_key,
                    src_offset,
                    dst_key,
                    dst_offset,
                    len,
                } => {
                    // A rank waiting in a blocking call copies what is already on its node.
                    let dst = inst.posted.get(&dst_rank).copied();
                    let by_host = dst.filter(|p| p.host_copies);
                    if let Some(p) = by_host.filter(|_| self.is_local(&src_key.owner)) {
                        self.hand_to_host(
                            ck, id, p, &src_key, src_offset, &dst_key, dst_offset, len,
                        );
                        continue;
                    }
                    self.queue_copy(ck, id, src_key, src_offset, dst_key, dst_offset, len);
                }
                Act::StageCopy {
                    id,
                    rank: _,
                    src,
                    dst,
                    len,
                } => {
                    let stages = inst.stages.as_ref();
                    let resolve = |loc: drivers::Loc| match loc {
                        drivers::Loc::Host { key, offset } => Some((key, offset)),
                        drivers::Loc::Stage { slot, offset } => stages
                            .and_then(|s| s.slots.get(slot.0 as usize))
                            .map(|s| (s.key().clone(), offset)),
                    };
                    match (resolve(src), resolve(dst)) {
                        (Some((sk, so)), Some((dk, doff))) => {
                            self.queue_copy(ck, id, sk, so, dk, doff, len)
                        }
                        // No staging (refused by the budget): the instance is aborted; its
                        // copies fail.
                        _ => self.host_done.push((ck, id, Status::AccessError)),
                    }
                }
                Act::Move {
                    id,
                    to,
                    src_slot,
                    dst_slot,
                    len,
                    msg,
                } => {
                    // A slot the child granted through UCX: the datapath puts the bytes
                    // there, and the chunk's message follows once they landed.
                    let src = inst
                        .stages
                        .as_ref()
                        .and_then(|s| s.slots.get(src_slot as usize))
                        .map(|s| s.key().clone());
                    if let (Some(src), Some(dst)) =
                        (src, self.peer_slots.remove(&(ck, to, dst_slot)))
                    {
                        let ticket = self.next_ticket;
                        self.next_ticket += 1;
                        self.ucx_moves.insert(ticket, (ck, id, to, msg, len));
                        self.stats.chunks_moved_ucx += 1;
                        self.limiter.push(CopyJob {
                            ticket,
                            src,
                            src_offset: 0,
                            dst,
                            dst_offset: 0,
                            len,
                        });
                        self.start_copies();
                        continue;
                    }
                    let data = inst
                        .stages
                        .as_ref()
                        .and_then(|s| s.slots.get(src_slot as usize))
                        .map(|s| s.bytes(len as usize).to_vec());
                    let status = match (data, self.peer_conn.get(&to).copied()) {
                        (_, None) => Status::PeerFailed,
                        (Some(data), Some(k)) if data.len() as u64 == len => {
                            self.stats.messages_sent += 1;
                            self.stats.chunks_moved += 1;
                            let here = self.cluster.sp(self.me).map(|e| e.node);
                            if self.cluster.sp(to).map(|e| e.node) == here {
                                self.stats.bytes_intra_node += len;
                            } else {
                                self.stats.bytes_inter_node += len;
                            }
                            let data = wire::Bytes(data);
                            self.send_frame(k, &encode(&SpToSp::Data { key: ck, msg, data }));
                            Status::Ok
                        }
                        _ => Status::AccessError,
                    };
                    let now = now_ns(self.start);
                    if let Some(inst) = self.instances.get_mut(&ck) {
                        inst.sm.handle_move_done(now, id, status);
                    }
                }
                Act::Complete {
                    rank,
                    status,
                    from_segment,
                } => {
                    let posted = inst.posted.get(&rank).copied();
                    match posted {
                        Some(p) if from_segment && status.is_ok() => {
                            self.finish_from_segment(ck, p)
                        }
                        Some(p) => self.write_completion(p, status),
                        None => warn!(
                            sp = self.me,
                            ?ck,
                            rank,
                            "completion for a rank never posted"
                        ),
                    }
                }
            }
        }
        if self.instances.get(&ck).is_some_and(|i| i.sm.is_finished()) {
            if let Some(done) = self.instances.remove(&ck) {
                self.stats
                    .add_late_arrivals(ck.job, done.sm.late_arrivals());
            }
            if let Some(r) = self.regions.get_mut(&ck) {
                r.finished = true;
            }
            self.release_region_if_done(ck);
            self.flat_here.remove(&ck);
            self.peer_slots.retain(|(k, _, _), _| *k != ck);
            self.stats.collectives_finished += 1;
            if let Some(job) = self.jobs.get_mut(&ck.job) {
                job.finished.insert((ck.comm, ck.seq));
                job.finished_order.push_back((ck.comm, ck.seq));
                if job.finished_order.len() > MAX_FINISHED_PER_JOB {
                    if let Some(old) = job.finished_order.pop_front() {
                        job.finished.remove(&old);
                    }
                }
            }
            self.forget_job_if_done(ck.job);
        } else if self.jobs.get(&ck.job).is_some_and(|j| j.hosts.is_empty()) {
            self.forget_job_if_done(ck.job);
        }
    }

    /// With UCX here: registers staging slots `slots` of `ck` for writing and sends their keys
    /// to `to`, which then puts its chunks straight into them (without UCX the chunks come as
    /// frames, which the slots take as well).
    fn grant_slots_over_ucx(&mut self, ck: CollKey, to: SpId, slots: &[u32]) {
        let (Some(reg), Some(stages)) = (
            self.stage_ucx.as_mut(),
            self.instances.get(&ck).and_then(|i| i.stages.as_ref()),
        ) else {
            return;
        };
        let mut granted = Vec::new();
        for &s in slots {
            let Some(stage) = stages.slots.get(s as usize) else {
                continue;
            };
            let k = stage.key();
            // SAFETY: staging buffers are never freed while the server lives (they go back to
            // the pool, declared after this registrar, so unmapped first), and a granted slot
            // is not read here until the chunk's message says its bytes landed.
            match unsafe { reg.register(k.grant.addr, k.grant.len, Rights::WRITE) } {
                Ok(g) => granted.push((
                    s,
                    AliasKey {
                        owner: k.owner,
                        grant: g,
                    },
                )),
                Err(e) => warn!(sp = self.me, "cannot grant a staging slot: {e}"),
            }
        }
        if !granted.is_empty() {
            if let Some(k) = self.peer_conn.get(&to).copied() {
                let grants = SpToSp::SlotGrants {
                    key: ck,
                    slots: granted,
                };
                self.send_frame(k, &encode(&grants));
            }
        }
    }

    /// The region of `ck` in its job's segment (described by a rank's grant `seg`): the one
    /// the instance has, or a new one of `len` bytes; `None` if the segment has no room.
    fn region_for(
        &mut self,
        ck: CollKey,
        seg: &Grant,
        len: u64,
    ) -> Result<Option<(u64, u64)>, String> {
        // The segment holds one equal part per SP of the node; this SP places its regions in
        // its own part.
        let parts = u64::from(self.cluster.sps_per_node.max(1));
        let index = self.cluster.sp(self.me).map_or(0, |e| u64::from(e.index));
        if !seg.len.is_multiple_of(parts) {
            return Err(format!(
                "a segment of {} bytes cannot hold one equal part for each of the node's {parts} \
                 SPs",
                seg.len
            ));
        }
        let part = seg.len / parts;
        let arena = self
            .arenas
            .entry(ck.job)
            .or_insert_with(|| Arena::new(index * part, part));
        if arena.capacity() != part {
            return Err(format!(
                "segment of {} bytes, but the job's ranks on this node used {} (SPOFF_SEGMENT_BYTES \
                 differs between ranks)",
                seg.len,
                arena.capacity() * parts
            ));
        }
        if let Some(r) = self.regions.get(&ck) {
            return Ok(Some((r.off, r.len)));
        }
        let Some(off) = arena.alloc(len) else {
            return Ok(None);
        };
        self.regions.insert(
            ck,
            Region {
                off,
                len,
                readers: 0,
                finished: false,
                owner: None,
                borrowers: HashSet::new(),
            },
        );
        Ok(Some((off, len)))
    }

    /// Sends the answers [`drivers::refuse`] gives to `msg` of instance `ck` from SP `from`;
    /// true if there were any.
    fn send_refusals(&mut self, ck: CollKey, msg: &CollMsg, from: SpId, status: Status) -> bool {
        let replies = drivers::refuse(msg, from, status);
        let any = !replies.is_empty();
        for (to, reply) in replies {
            let frame = encode(&SpToSp::Coll {
                key: ck,
                msg: reply,
            });
            if let Some(k) = self.peer_conn.get(&to).copied() {
                self.send_frame(k, &frame);
            }
        }
        any
    }

    /// Queues a copy of instance `ck` (its copy `id`) for the datapath.
    #[allow(clippy::too_many_arguments)]
    fn queue_copy(
        &mut self,
        ck: CollKey,
        id: u64,
        src: AliasKey,
        src_offset: u64,
        dst: AliasKey,
        dst_offset: u64,
        len: u64,
    ) {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.copies.insert(ticket, (ck, id));
        self.limiter.push(CopyJob {
            ticket,
            src,
            src_offset,
            dst,
            dst_offset,
            len,
        });
        self.start_copies();
    }

    /// A chunk put into a child's slot finished: on success its message follows (the put
    /// was flushed, so the bytes are there first), and either way the move is reported.
    fn ucx_move_done(
        &mut self,
        ck: CollKey,
        id: u64,
        to: SpId,
        msg: CollMsg,
        len: u64,
        result: Result<(), alias_mkey::AccessError>,
    ) {
        let status = match (result, self.peer_conn.get(&to).copied()) {
            (Ok(()), Some(k)) => {
                let here = self.cluster.sp(self.me).map(|e| e.node);
                if self.cluster.sp(to).map(|e| e.node) == here {
                    self.stats.bytes_intra_node += len;
                } else {
                    self.stats.bytes_inter_node += len;
                }
                self.stats.messages_sent += 1;
                self.stats.chunks_moved += 1;
                self.send_frame(k, &encode(&SpToSp::Coll { key: ck, msg }));
                Status::Ok
            }
            (Ok(()), None) => Status::PeerFailed,
            (Err(e), _) => {
                warn!(
                    sp = self.me,
                    ?ck,
                    to,
                    "putting a chunk into a child SP failed: {e}"
                );
                self.stats.copies_failed += 1;
                Status::AccessError
            }
        };
        let now = now_ns(self.start);
        if let Some(inst) = self.instances.get_mut(&ck) {
            inst.sm.handle_move_done(now, id, status);
            self.drive(ck);
        }
    }

    /// The owner runs on this SP's node.
    fn is_local(&self, owner: &Owner) -> bool {
        let node = self
            .jobs
            .get(&owner.job)
            .and_then(|j| self.cluster.placement(owner.world_rank, j.world_size).ok())
            .map(|p| p.node);
        node.is_some() && node == self.cluster.sp(self.me).map(|e| e.node)
    }

    /// Asks the host of post `p` to do an intra-node copy into its receive buffer, after
    /// checking both ends against their grants (the host learns only an address of a rank
    /// of its node that the grant covers). Its answer comes as `HostToSp::CopyDone`; a copy
    /// that cannot be handed over finishes at once with an error.
    #[allow(clippy::too_many_arguments)]
    fn hand_to_host(
        &mut self,
        ck: CollKey,
        id: u64,
        p: Posted,
        src: &AliasKey,
        src_offset: u64,
        dst: &AliasKey,
        dst_offset: u64,
        len: u64,
    ) {
        let checked = src
            .check(src_offset, len, Rights::READ)
            .and_then(|addr| dst.check(dst_offset, len, Rights::WRITE).map(|_| addr));
        let status = match checked {
            Ok(addr) => {
                let src = CopySrc::Process {
                    pid: src.owner.pid,
                    addr,
                };
                let then = AfterHostCopy::Machine { id };
                if self.send_host_copy(ck, p, then, src, dst_offset, len) {
                    return;
                }
                Status::RankFailed
            }
            Err(e) => {
                warn!(sp = self.me, ?ck, "host copy refused: {e}");
                self.stats.copies_failed += 1;
                Status::AccessError
            }
        };
        // Fed back outside the instance's `drive`, like an inline copy.
        self.host_done.push((ck, id, status));
    }

    /// Sends the host of `p` a copy into its receive grant; false (nothing sent) if that host
    /// is gone.
    fn send_host_copy(
        &mut self,
        ck: CollKey,
        p: Posted,
        then: AfterHostCopy,
        src: CopySrc,
        dst_offset: u64,
        len: u64,
    ) -> bool {
        let live = matches!(
            self.conns.get(p.conn),
            Some(Conn { role: Role::Host(h), .. }) if h.conn_id == p.conn_id
        );
        if !live {
            return false;
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.stats.host_copies += 1;
        self.stats.host_copy_bytes += len;
        self.host_copies.insert(
            ticket,
            HostCopy {
                ck,
                conn: p.conn,
                conn_id: p.conn_id,
                then,
            },
        );
        let msg = SpToHost::Copy {
            token: p.token,
            ticket,
            src,
            dst_offset,
            len,
        };
        self.send_frame(p.conn, &encode(&msg));
        true
    }

    /// A rank of a hierarchical staged instance has its data in the segment: it copies them
    /// out itself, and completes when it says it did.
    fn finish_from_segment(&mut self, ck: CollKey, p: Posted) {
        // A bcast's ranks copy out of their node leader's region, which may be another SP's
        // (its entry here came with the leader's `Sealed`; the length comes from the view).
        let source = self.instances.get(&ck).and_then(|i| i.sm.segment_source());
        if let Some(r) = self.regions.get_mut(&ck).filter(|r| r.owner.is_some()) {
            match source {
                Some((owner, at, len)) if r.owner == Some(owner) && r.off == at => r.len = len,
                _ => {
                    warn!(
                        sp = self.me,
                        ?ck,
                        "a segment completion out of a region not sealed"
                    );
                    return self.write_completion(p, Status::AccessError);
                }
            }
        }
        let Some((off, len)) = self.regions.get(&ck).map(|r| (r.off, r.len)) else {
            warn!(sp = self.me, ?ck, "a segment completion without a region");
            return self.write_completion(p, Status::AccessError);
        };
        let then = AfterHostCopy::Finish { posted: p };
        if self.send_host_copy(ck, p, then, CopySrc::Segment { offset: off }, 0, len) {
            if let Some(r) = self.regions.get_mut(&ck) {
                r.readers += 1;
            }
        }
        // A host that is gone gets no completion.
    }

    /// One reader of `ck`'s segment region is done; frees the region once the instance
    /// finished and nobody reads it.
    fn region_reader_done(&mut self, ck: CollKey) {
        if let Some(r) = self.regions.get_mut(&ck) {
            r.readers = r.readers.saturating_sub(1);
        }
        self.release_region_if_done(ck);
    }

    fn release_region_if_done(&mut self, ck: CollKey) {
        let done = self
            .regions
            .get(&ck)
            .is_some_and(|r| r.finished && r.readers == 0 && r.borrowers.is_empty());
        if !done {
            return;
        }
        let Some(r) = self.regions.remove(&ck) else {
            return;
        };
        match r.owner {
            Some(owner) => self.send_peer(owner, &SpToSp::RegionReleased { key: ck }),
            None => {
                if let Some(a) = self.arenas.get_mut(&ck.job) {
                    a.free(r.off);
                }
            }
        }
    }

    /// SP `from`'s ranks finished copying out of this SP's region of `ck`.
    fn region_released(&mut self, ck: CollKey, from: SpId) {
        if let Some(r) = self.regions.get_mut(&ck) {
            r.borrowers.remove(&from);
        }
        self.release_region_if_done(ck);
    }

    /// A host answered `SpToHost::Copy`.
    fn on_host_copy_done(&mut self, key: usize, ticket: u64, ok: bool) {
        let conn_id = self.host(key).conn_id;
        match self.host_copies.get(&ticket) {
            Some(c) if c.conn == key && c.conn_id == conn_id => {}
            _ => {
                return self.send_error(
                    key,
                    None,
                    ErrorCode::BadDescriptor,
                    format!("copy ticket {ticket} was not handed to this rank"),
                )
            }
        }
        let Some(c) = self.host_copies.remove(&ticket) else {
            return;
        };
        let status = if ok {
            Status::Ok
        } else {
            self.stats.host_copies_failed += 1;
            Status::AccessError
        };
        match c.then {
            AfterHostCopy::Machine { id } => {
                self.host_done.push((c.ck, id, status));
                self.feed_host_copies_done();
            }
            AfterHostCopy::Finish { posted } => {
                self.write_completion(posted, status);
                self.region_reader_done(c.ck);
            }
        }
    }

    /// Host copies of connection `key` will never be answered: they fail.
    fn drop_host_copies(&mut self, key: usize) {
        let gone: Vec<u64> = self
            .host_copies
            .iter()
            .filter(|(_, c)| c.conn == key)
            .map(|(&t, _)| t)
            .collect();
        for t in gone {
            let Some(c) = self.host_copies.remove(&t) else {
                continue;
            };
            match c.then {
                AfterHostCopy::Machine { id } => {
                    self.host_done.push((c.ck, id, Status::RankFailed))
                }
                AfterHostCopy::Finish { .. } => self.region_reader_done(c.ck),
            }
        }
        self.feed_host_copies_done();
    }

    fn feed_host_copies_done(&mut self) {
        let now = now_ns(self.start);
        while !self.host_done.is_empty() {
            for (ck, id, status) in std::mem::take(&mut self.host_done) {
                if let Some(inst) = self.instances.get_mut(&ck) {
                    inst.sm.handle_copy_done(now, id, status);
                    self.drive(ck);
                }
            }
        }
    }

    fn start_copies(&mut self) {
        while let Some(job) = self.limiter.pop_startable() {
            self.stats.copies_started += 1;
            self.stats.bytes_copied += job.len;
            // A copy crosses nodes when its two ends live on different nodes (this SP's own
            // staging lives here). A put into a child SP's staging is counted when it is done.
            if !self.ucx_moves.contains_key(&job.ticket) {
                let here = self.cluster.sp(self.me).map(|e| e.node);
                let node_of = |k: &AliasKey| {
                    if k.owner.world_rank == crate::staging::STAGE_OWNER_RANK {
                        return here;
                    }
                    self.jobs.get(&k.owner.job).and_then(|j| {
                        self.cluster
                            .placement(k.owner.world_rank, j.world_size)
                            .ok()
                            .map(|p| p.node)
                    })
                };
                if node_of(&job.src) != node_of(&job.dst) {
                    self.stats.bytes_inter_node += job.len;
                } else {
                    self.stats.bytes_intra_node += job.len;
                }
            }
            self.stats.max_inflight = self.stats.max_inflight.max(self.limiter.in_flight() as u64);
            let both_cma = job.src.grant.backend == BackendData::Cma
                && job.dst.grant.backend == BackendData::Cma;
            if job.len <= self.inline_copy_bytes && both_cma {
                self.stats.copies_inline += 1;
                let result =
                    self.mover
                        .copy(&job.src, job.src_offset, &job.dst, job.dst_offset, job.len);
                // Fed back by `on_copies_done`, outside the instance's `drive`.
                self.inline_done.push(crate::datapath::CopyDone {
                    ticket: job.ticket,
                    result,
                });
            } else {
                self.datapath.submit(job);
            }
        }
    }

    /// Feeds finished copies back to their instances, until none is left (an instance may
    /// start more inline copies while it handles one).
    fn on_copies_done(&mut self) {
        loop {
            let mut done = std::mem::take(&mut self.inline_done);
            done.extend(self.datapath.drain());
            if done.is_empty() {
                return;
            }
            self.feed_copies_done(done);
        }
    }

    fn feed_copies_done(&mut self, done: Vec<crate::datapath::CopyDone>) {
        let now = now_ns(self.start);
        for d in done {
            self.limiter.finished();
            if let Some((ck, id, to, msg, len)) = self.ucx_moves.remove(&d.ticket) {
                self.ucx_move_done(ck, id, to, msg, len, d.result);
                continue;
            }
            let Some((ck, id)) = self.copies.remove(&d.ticket) else {
                continue;
            };
            let status = match &d.result {
                Ok(()) => Status::Ok,
                Err(e) => {
                    warn!(sp = self.me, ?ck, "copy failed: {e}");
                    self.stats.copies_failed += 1;
                    Status::AccessError
                }
            };
            if let Some(inst) = self.instances.get_mut(&ck) {
                inst.sm.handle_copy_done(now, id, status);
                self.drive(ck);
            }
        }
        self.start_copies();
    }

    /// Writes a completion into the rank's mailbox: status first, then the token.
    /// Where the completion of a post from host connection `key` goes.
    fn posted(&self, key: usize, slot: Option<u32>, token: u64) -> Posted {
        Posted {
            conn: key,
            conn_id: self.host(key).conn_id,
            slot,
            token,
            host_copies: false,
        }
    }

    fn write_completion(&mut self, p: Posted, status: Status) {
        self.stats.completions += 1;
        let Some(Conn {
            role: Role::Host(h),
            ..
        }) = self.conns.get_mut(p.conn)
        else {
            return;
        };
        if h.conn_id != p.conn_id {
            // That host is gone and another took its slot in the table.
            return;
        }
        h.outstanding = h.outstanding.saturating_sub(1);
        let h = &*h;
        let Some((mb, slots)) = &h.mailbox else {
            return;
        };
        let Some(slot) = p.slot else {
            let done = SpToHost::Completed {
                token: p.token,
                status: mailbox::status_code(status),
            };
            return self.send_frame(p.conn, &encode(&done));
        };
        if slot >= *slots {
            return;
        }
        let base = mailbox::slot_offset(slot);
        let code = mailbox::status_code(status).to_le_bytes();
        let token = p.token.to_le_bytes();
        let res = self
            .mover
            .write(mb, base + mailbox::STATUS_OFFSET, &code)
            .and_then(|_| self.mover.write(mb, base + mailbox::TOKEN_OFFSET, &token));
        if let Err(e) = res {
            warn!(
                sp = self.me,
                rank = h.hello.world_rank,
                "cannot write completion: {e}"
            );
        }
    }

    fn close_conn(&mut self, key: usize, why: &str) {
        if !self.conns.contains(key) {
            return;
        }
        let mut conn = self.conns.remove(key);
        let _ = self.poll.registry().deregister(conn.stream.source());
        match conn.role {
            Role::NewHost { peer, .. } => {
                let _ = self
                    .poll
                    .registry()
                    .deregister(&mut mio::unix::SourceFd(&peer.pidfd.as_raw_fd()));
                alias_mkey::process::unpin(peer.pid, peer.start);
            }
            Role::Peer(sp) => {
                if self.leaving_peers.contains(&sp) {
                    debug!(sp = self.me, peer = sp, "peer SP left");
                } else {
                    warn!(sp = self.me, peer = sp, "peer SP lost: {why}");
                }
                self.peer_conn.remove(&sp);
                self.dead_peers.insert(sp);
                self.sibling_gone(sp, None);
                // Its ranks will not copy out of our regions any more.
                let borrowed: Vec<CollKey> = self
                    .regions
                    .iter()
                    .filter(|(_, r)| r.borrowers.contains(&sp))
                    .map(|(k, _)| *k)
                    .collect();
                for ck in borrowed {
                    self.region_released(ck, sp);
                }
                let now = now_ns(self.start);
                let keys: Vec<CollKey> = self.instances.keys().copied().collect();
                for ck in keys {
                    if let Some(inst) = self.instances.get_mut(&ck) {
                        inst.sm.handle_peer_lost(now, sp);
                    }
                    self.drive(ck);
                }
            }
            Role::Host(h) => {
                let job = h.job;
                let _ = self
                    .poll
                    .registry()
                    .deregister(&mut mio::unix::SourceFd(&h.peer.pidfd.as_raw_fd()));
                alias_mkey::process::unpin(h.peer.pid, h.peer.start);
                if let Some(j) = self.jobs.get_mut(&job) {
                    j.hosts.remove(&key);
                    j.ranks.remove(&h.hello.world_rank);
                }
                if h.said_goodbye {
                    debug!(sp = self.me, job, rank = h.hello.world_rank, "host left");
                } else {
                    warn!(
                        sp = self.me,
                        job,
                        rank = h.hello.world_rank,
                        "host rank disconnected without goodbye ({why}); aborting its job"
                    );
                    self.fail_job(job, Status::RankFailed, true);
                }
                self.drop_host_copies(key);
                if self.jobs.get(&job).is_some_and(|j| j.hosts.is_empty()) {
                    self.abort_unposted(job);
                }
                self.forget_job_if_done(job);
            }
        }
    }

    /// Every rank of `job` has left this SP. An open instance that some of them never posted
    /// can never complete: it is aborted (which tells its other SPs) and dropped once no copy
    /// touches it. The others go on: their ranks here posted (a rank may finalize as soon as
    /// its own part is done, while the instance still needs this SP: an inner SP of a
    /// broadcast tree, a node's reader of another node's blocks).
    fn abort_unposted(&mut self, job: u64) {
        let now = now_ns(self.start);
        let stuck: Vec<CollKey> = self
            .instances
            .iter()
            .filter(|(k, i)| k.job == job && !i.all_local_posted())
            .map(|(k, _)| *k)
            .collect();
        for ck in stuck {
            if let Some(inst) = self.instances.get_mut(&ck) {
                inst.sm.abort(now, Status::RankFailed);
            }
            self.drive(ck);
        }
    }

    /// Frees a job's state once none of its ranks is connected and none of its instances is
    /// left (those of a failed job finish as their copies drain).
    fn forget_job_if_done(&mut self, job: u64) {
        let Some(j) = self.jobs.get(&job) else { return };
        if !j.hosts.is_empty() {
            return;
        }
        // No rank of this job is left here to complete, and a rank that left without posting
        // would keep its instance open forever: drop what no copy still touches and cannot
        // complete (every instance of a failed job; one a local rank never posted).
        let failed = j.failed.is_some();
        self.instances.retain(|k, i| {
            k.job != job || i.sm.copies_in_flight() > 0 || (!failed && i.all_local_posted())
        });
        if !self.instances.keys().any(|k| k.job == job) {
            self.jobs.remove(&job);
            // The pins of the job's processes (remote ranks copied from) go with them.
            alias_mkey::process::sweep();
            // The hierarchical designs' segment of this job: nobody is left to read it here;
            // leaders whose regions this SP's ranks were to read may reuse them.
            let borrowed: Vec<(CollKey, SpId)> = self
                .regions
                .iter()
                .filter(|(k, _)| k.job == job)
                .filter_map(|(k, r)| r.owner.map(|o| (*k, o)))
                .collect();
            for (ck, owner) in borrowed {
                self.send_peer(owner, &SpToSp::RegionReleased { key: ck });
            }
            self.regions.retain(|k, _| k.job != job);
            self.flat_here.retain(|k| k.job != job);
            self.peer_slots.retain(|(k, _, _), _| k.job != job);
            self.arenas.remove(&job);
            self.job_gone_here(job);
        }
    }

    /// The job is gone here: tell the node's other SPs, and remove the node's segment name
    /// once each of them that serves ranks of the job said the same (or is gone). Removing it
    /// earlier would let a rank of another SP that maps it later create a second object under
    /// the same name, and read a region its SP's writer never wrote.
    fn job_gone_here(&mut self, job: u64) {
        let Some(node) = self.cluster.sp(self.me).map(|e| e.node) else {
            return;
        };
        let siblings: HashSet<SpId> = self
            .cluster
            .sps
            .iter()
            .filter(|e| e.node == node && e.id != self.me)
            .map(|e| e.id)
            .collect();
        for &sp in &siblings {
            self.send_peer(sp, &SpToSp::JobGone { job, answer: false });
        }
        // Each sibling answers at once if the job was never there (`JobGone { answer }`).
        let told = self.gone_at_siblings.remove(&job).unwrap_or_default();
        let waiting: HashSet<SpId> = siblings
            .into_iter()
            .filter(|sp| {
                !told.contains(sp)
                    && !self.dead_peers.contains(sp)
                    && !self.leaving_peers.contains(sp)
            })
            .collect();
        if waiting.is_empty() {
            crate::segment::unlink(&self.key, job, node);
        } else {
            self.unlink_after.insert(job, waiting);
        }
    }

    /// SP `sp` of this node has job `job` gone (or is gone itself, `job` None: every job).
    fn sibling_gone(&mut self, sp: SpId, job: Option<u64>) {
        let Some(node) = self.cluster.sp(self.me).map(|e| e.node) else {
            return;
        };
        if self.cluster.sp(sp).map(|e| e.node) != Some(node) {
            return;
        }
        if let Some(job) = job {
            if !self.unlink_after.contains_key(&job) {
                self.gone_at_siblings.entry(job).or_default().insert(sp);
                return;
            }
        }
        let mut done = Vec::new();
        for (&j, waiting) in self.unlink_after.iter_mut() {
            if job.is_none_or(|g| g == j) {
                waiting.remove(&sp);
                if waiting.is_empty() {
                    done.push(j);
                }
            }
        }
        for j in done {
            self.unlink_after.remove(&j);
            crate::segment::unlink(&self.key, j, node);
        }
    }

    /// Aborts every instance of `job` here (and, if `tell_peers`, on every other SP).
    fn fail_job(&mut self, job: u64, status: Status, tell_peers: bool) {
        if let Some(j) = self.jobs.get_mut(&job) {
            if j.failed.is_some() && !tell_peers {
                return;
            }
            j.failed.get_or_insert(status);
        } else {
            return;
        }
        if tell_peers {
            let frame = encode(&SpToSp::JobAbort {
                job,
                reason: format!("a rank left SP {}", self.me),
            });
            let peers: Vec<usize> = self.peer_conn.values().copied().collect();
            for k in peers {
                self.send_frame(k, &frame);
            }
        }
        let now = now_ns(self.start);
        let keys: Vec<CollKey> = self
            .instances
            .keys()
            .filter(|k| k.job == job)
            .copied()
            .collect();
        // Copies of the job that have not started yet will not start: they would touch the
        // memory of ranks that may be gone.
        let queued: Vec<CopyJob> = self.limiter.clear_queued().collect();
        let mut purged = Vec::new();
        for c in queued {
            match self.copies.get(&c.ticket) {
                Some((ck, id)) if ck.job == job => {
                    purged.push((*ck, *id));
                    self.copies.remove(&c.ticket);
                }
                _ => self.limiter.push(c),
            }
        }
        self.stats.copies_purged += purged.len() as u64;
        for (ck, id) in purged {
            if let Some(inst) = self.instances.get_mut(&ck) {
                inst.sm.handle_copy_done(now, id, status);
            }
        }
        for ck in keys {
            if let Some(inst) = self.instances.get_mut(&ck) {
                inst.sm.abort(now, status);
            }
            self.drive(ck);
        }
    }
}
