//! The SP daemon: one mio event loop serving host ranks (its Unix socket, and a TCP listener when
//! its cluster entry has a `host_addr`) and peer SPs (TCP).
//!
//! Readiness rules, as mio documents them and as this loop follows them:
//! - events can be spurious: every handler tries the operation and treats `WouldBlock` as
//!   "nothing to do";
//! - mio is edge-triggered: a readable event is drained until `WouldBlock`, a writable event
//!   flushes the whole out buffer or until `WouldBlock`;
//! - read/write-closed flags are hints: a connection is closed when a read returns 0 bytes or an
//!   error, not when a flag says so.
//!
//! Tokens: [`LISTEN_HOSTS`], [`LISTEN_HOSTS_TCP`], [`WAKER`], [`SIGNALS`] are reserved; connection `k` of the slab has
//! token `CONN_BASE + k`. Peer SPs are connected before the loop starts (see [`crate::mesh::connect_mesh`]),
//! so "ready" means the whole mesh is up.
//!
//! The engine's parts, one file each, by what they touch:
//! - `transport`: connections (accept, frames in and out, deferred close);
//! - `hosts`: host ranks (hello, registration, their messages, grants as keys, a rank gone);
//! - `post`: a host's post, checked (`crate::validate`), placed and fed to its driver;
//! - `engine`: collective instances and their drivers (`crate::drivers`): created by the first
//!   event that names them, a post or a peer message alike (so early announcements wait in
//!   them), fed peer messages, and driven: every action a driver emits is executed at once;
//! - `copies`: the copy scheduling (the per-SP [`CopyLimiter`], the datapath threads, inline
//!   copies, copies handed to blocked host ranks, UCX moves of chunks);
//! - `resources`: what the collective families own beyond the shared parts
//!   (`crate::drivers::resources`: the staged family's staging and segment regions, the
//!   multicast family's fabric), reached through the registry's hooks with a `Cx`;
//! - `jobs`: goodbyes, failures and forgetting jobs;
//! - `timers`: everything done by the clock (late hellos, heartbeats, drivers' deadlines).
//!
//! Failures never hang a collective: a lost peer SP fails every instance that involves it, a
//! host rank that disconnects without saying goodbye aborts its whole job on every SP
//! (`JobAbort`); a rank that said goodbye after its part was done fails nobody.

mod copies;
mod engine;
mod hosts;
mod instances;
use instances::Slot;
mod jobs;
mod post;
mod resources;
mod timers;
mod transport;

use crate::access::{self, HostPeer, Limits, LogLimit};
use crate::conn::{Conn, ReadEnd, Stream};
use crate::datapath::{CopyJob, Datapath};
use crate::drivers::{self, Act, CollDriver, LocalPost};
use crate::stats::Stats;
use algorithms::sched::CopyLimiter;
use algorithms::{CollKey, Nanos, SpId, Status};
use alias_mkey::mover::{CmaMover, Mover};
use alias_mkey::{AliasKey, BackendData, Grant, Owner, Rights};
use bootstrap::auth::{self, ClusterKey};
use bootstrap::mailbox;
use bootstrap::rendezvous::Backoff;
use bootstrap::wire::{
    self, decode, decode_hello, encode, encode_hello, frame, AdminHello, CollKind, CollMsg,
    CopySrc, ErrorCode, Hello, HostHello, HostToSp, PostDesc, SpToHost, SpToSp,
};
use bootstrap::Cluster;
use mio::net::{TcpListener, UnixListener};
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;
use std::collections::{HashMap, HashSet};

/// A map or set whose keys this SP or the kernel chooses (tickets, connection serials, SP
/// numbers of the cluster file, uids): hashed with foldhash, cheaper per lookup than std's
/// SipHash (not measured alone; the split as a whole in docs/BENCHMARKS.md O), and seeded
/// per map, which is enough where no host picks the keys. A map whose keys a host or its launcher chooses (collective keys, job ids,
/// world ranks, comm ranks) keeps std's keyed SipHash: a host that could make its keys
/// collide would slow every job this SP serves (foldhash does not claim to resist an
/// attacker that watches the SP's timing or order; SipHash's key is meant to).
type SpMap<K, V> = foldhash::HashMap<K, V>;
type SpSet<T> = foldhash::HashSet<T>;
use foldhash::{HashMapExt as _, HashSetExt as _};
use std::io;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, info, info_span, warn};

pub const LISTEN_HOSTS: Token = Token(0);
pub const WAKER: Token = Token(1);
pub const SIGNALS: Token = Token(2);
/// The staging UCX worker's event fd (with UCX on, see [`UcxMode`]): it wakes the loop, whose
/// resources' `progress` serves it.
const UCX_EVENTS: Token = Token(3);
/// The TCP listener for hosts on other machines (or other network namespaces).
pub const LISTEN_HOSTS_TCP: Token = Token(4);

/// Connections one listener hands over in a pass of the event loop; more wait for the next
/// pass, which comes at once. A burst of new connections neither delays the work of those
/// already served for long nor cycles through the connections without a hello in one go.
const ACCEPTS_PER_PASS: usize = 64;

const CONN_BASE: usize = 16;
/// The pidfd of host connection `k` (readable once its process exits) has token
/// `PIDFD_BASE + k`.
const PIDFD_BASE: usize = 1 << 40;

/// Bytes of posts given back (see `held`) after which a closing host connection has the
/// allocator return free memory to the system.
const GIVE_BACK_BYTES: u64 = 64 << 20;

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

bootstrap::from_word!(
    UcxMode,
    ["auto" => UcxMode::Auto, "on" => UcxMode::On, "off" => UcxMode::Off],
    |s, words| format!("expected {words}, not {s:?}")
);

/// Timer slack of a polling SP (`ServeConfig::poll_interval`), in ns.
const POLL_TIMER_SLACK_NS: libc::c_ulong = 1_000;

pub struct ServeConfig {
    pub sp: SpId,
    pub cluster: Cluster,
    pub peer_listener: std::net::TcpListener,
    pub host_socket: PathBuf,
    /// Hosts over TCP (the entry's `host_addr`), already bound: identified by their job
    /// credential only (see `access`).
    pub host_listener: Option<std::net::TcpListener>,
    /// The TCP hosts share this SP's kernel (`serve --hosts-same-kernel`): their hellos name
    /// their pid, which is checked and pinned, and their `cma` grants are served.
    pub hosts_same_kernel: bool,
    pub max_inflight_reads: usize,
    pub datapath_threads: usize,
    /// Datapath copies of at least twice this many bytes are split into parts, one per
    /// datapath thread at most, none shorter than this (0: never split).
    pub split_copy_bytes: u64,
    /// Most parts of a split copy besides the datapath threads' number: the CPUs those
    /// threads have (`usize::MAX`: not pinned).
    pub split_parts: usize,
    pub chunk_bytes: usize,
    /// Copies up to this size run on the event-loop thread instead of a datapath thread: a
    /// handoff to a thread and back costs more than copying a few KiB.
    pub inline_copy_bytes: u64,
    /// UCX for `ucx` grants and for the staged chunks between SPs.
    pub ucx: UcxMode,
    pub connect_backoff: Backoff,
    /// Chunk size and slots per instance of the staged collectives.
    pub staged: drivers::StagedConfig,
    /// The multicast collectives' parameters, and their resources' set-up (`Err`: why this
    /// SP runs no multicast collective, said to its hosts at registration).
    pub mcast: drivers::McastParams,
    pub mcast_plane: Result<crate::mcast::plane::PlaneConfig, String>,
    /// The Canary link's socket, opened at start when the link is in a network namespace
    /// (`canary_resources::open_early`).
    pub canary_socket: Option<Result<std::net::UdpSocket, String>>,
    /// Staging memory of this SP, all instances together.
    pub staging_bytes: u64,
    /// Look at the connections (and the UCX worker) at this interval instead of sleeping
    /// until something arrives: after a look that finds nothing, sleep this long. For an SP on
    /// a reserved core, as DPU service processes poll: nothing ever waits on a connection, so
    /// a rank's post does not pay for waking the SP. `Some(ZERO)`: busy-poll (look again at
    /// once, never sleep; `serve --busy-poll`).
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
        peer: HostPeer,
        since: Instant,
        /// The pass of the event loop ([`Server::pass`]) that accepted it: it cannot be
        /// evicted in that pass, before its first readiness has been looked at.
        accepted_in: u64,
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
    peer: HostPeer,
    mailbox: Option<(AliasKey, u32)>,
    said_goodbye: bool,
    /// Posts of this connection not completed yet (bounded by `Limits::max_posts_per_rank`).
    outstanding: usize,
    /// Its post ring, when it offered one this SP reads (see `bootstrap::post_ring`).
    ring: Option<Box<crate::post_ring::PostRing>>,
    /// Socket frames handled since its `Register` (the ring's entries name how many went
    /// before each of them).
    frames_in: u64,
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
    /// The SP's stamps of the call (`bootstrap::stamps`): `seen` and `ready` set by the post,
    /// the copies' by the instance when it completes the rank (0: none).
    stamps: bootstrap::stamps::SpStamps,
    copies: u32,
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
    /// The last step of a rank whose data are in its node's shared memory (`Act::Complete {
    /// from_segment }`): the rank completes (with the copy's outcome) and one reader of the
    /// memory of `family`'s resources is done.
    Finish {
        posted: Posted,
        family: bootstrap::kinds::Family,
    },
}

struct Instance {
    sm: Box<dyn CollDriver>,
    posted: HashMap<u32, Posted>,
    /// The communicator of the instance as its first local post described it (SP and world
    /// rank of each comm rank): every later local post must say the same.
    shape: Option<(Vec<SpId>, Vec<u32>)>,
    /// How many comm ranks this SP serves in the instance (known from the first local post).
    local_ranks: Option<usize>,
    /// Why its family's resources refused the instance (it was aborted), for the ranks
    /// posting it (`Resources::admit`).
    refused: Option<String>,
    /// The SP memory its local posts hold (given back to the ledger with the instance).
    holds: Vec<crate::held::Hold>,
    /// The post-ring mappings its keys point into (a local rank's arena): kept until the
    /// instance goes, even if the rank's connection went first.
    arenas: Vec<std::sync::Arc<crate::post_ring::ArenaMap>>,
    /// When its first copy started and its last one was seen done (`bootstrap::stamps`, 0:
    /// none yet), and how many were done.
    first_copy_ns: u64,
    last_copy_ns: u64,
    copies_done: u32,
}

/// Most admin requests an SP answers per two minutes (`auth::AdminReplays`): a launcher's
/// watchdog asks each SP at most ten times a second.
const ADMIN_REQUESTS_KEPT: usize = 16384;

#[derive(Default)]
struct Job {
    /// World size of the job (from its credential): places any of its ranks on a node.
    world_size: u32,
    /// The uid its credential names.
    uid: u32,
    hosts: SpSet<usize>,
    /// The world ranks connected here (one connection each).
    ranks: HashSet<u32>,
    /// The SP of each world rank of the job known here: its hello (ranks of this SP) or the
    /// first descriptor that named it; a later descriptor that says otherwise is refused.
    /// Locality (host copies, the byte counters) comes from it, never from a layout.
    sp_of_rank: HashMap<u32, SpId>,
    /// Ranks of `sp_of_rank` that only their hello here named (no descriptor yet): what the
    /// hello claimed goes with its connection, so a hello + goodbye changes nothing the job's
    /// collectives rely on.
    hello_only: HashSet<u32>,
    /// The last descriptor's members and world ranks whose every pair is in `sp_of_rank`
    /// (checked or learned): a post with the same two lists has nothing to check or learn
    /// there, which spares it two lookups per member (a pair a descriptor named is never
    /// removed or changed while the job is known).
    learned: (Vec<SpId>, Vec<u32>),
    failed: Option<Status>,
    /// Peer SPs lost while this job was known here (or already lost when it came): its
    /// collectives that need one fail, even after that SP rejoined (the ranks it served, and
    /// what it held of the job, are gone with it); later jobs use the SP again.
    lost_sps: SpSet<SpId>,
    /// Keyed by the whole `CollKey` (its job is this one) for its one-write hash.
    finished: HashSet<CollKey>,
    finished_order: std::collections::VecDeque<CollKey>,
}

pub struct Server {
    me: SpId,
    cluster: Cluster,
    poll: Poll,
    hosts_listener: UnixListener,
    host_socket: PathBuf,
    hosts_tcp: Option<TcpListener>,
    hosts_same_kernel: bool,
    conns: Slab<Conn<Role>>,
    /// Serial of the next connection ([`Conn::serial`]).
    next_serial: u64,
    /// Passes of the event loop so far.
    pass: u64,
    /// Listeners that said they had connections waiting, and were not emptied yet: the Unix
    /// socket's and the TCP one's. They are accepted from after the pass's reads, at most
    /// [`ACCEPTS_PER_PASS`] each.
    accept_due: [bool; 2],
    /// Connections to close once the handler that found them broken is done, by key and
    /// serial: a failed write inside a handler must not pull the connection out from under
    /// the handler (its caller may still look at it).
    doomed: Vec<(usize, u64, String)>,
    peer_conn: SpMap<SpId, usize>,
    dead_peers: SpSet<SpId>,
    /// Takes back SPs that restart (or start late): see [`crate::mesh::Keeper`].
    keeper: crate::mesh::Keeper,
    /// The SP whose old connection is being closed for a new one (no rejoin is asked for).
    replacing: Option<SpId>,
    /// Peers that announced an orderly shutdown.
    leaving_peers: SpSet<SpId>,
    next_conn_id: u64,
    jobs: HashMap<u64, Job>,
    instances: instances::Instances,
    limiter: CopyLimiter<CopyJob>,
    copies: SpMap<u64, (CollKey, u64)>,
    /// Copies handed to hosts, by ticket (the same numbering as `copies`).
    host_copies: SpMap<u64, HostCopy>,
    next_ticket: u64,
    datapath: Datapath,
    /// Large datapath copies split into parts over the datapath threads.
    splits: crate::datapath::Splits,
    /// Mover of the loop thread: mailbox writes and inline copies.
    mover: CmaMover,
    inline_copy_bytes: u64,
    /// `ucx` grants are accepted (else only `cma`).
    ucx: bool,
    /// Inline copies finished, waiting to be fed back to their instances.
    inline_done: Vec<crate::datapath::CopyDone>,
    /// Host copies that ended without being handed over, or answered, likewise.
    host_done: Vec<(CollKey, u64, Status)>,
    /// What every new instance is configured with (the staged and multicast parameters).
    kind_cfg: drivers::KindConfig,
    /// The resources collective families own beyond the shared ones (`drivers::resources`).
    resources: drivers::resources::Registry,
    /// Frames the resources' hooks queued for peers (`resources::Cx::to_peers`), kept for its
    /// capacity.
    resource_out: Vec<(SpId, SpToSp)>,
    /// See [`ServeConfig::poll_interval`].
    poll_interval: Option<Duration>,
    /// Host connections whose post ring this SP reads, looked at on every pass.
    ring_hosts: Vec<usize>,
    /// When the frames being handled were read (CLOCK_MONOTONIC ns, `bootstrap::stamps`): a
    /// post's `seen` stamp.
    read_at_ns: u64,
    /// Moves running as UCX puts on the datapath, by ticket: the instance, the move, the
    /// child, the `Chunk` message to send it once the bytes are there and their length.
    ucx_moves: SpMap<u64, (CollKey, u64, SpId, CollMsg, u64)>,
    /// The SP memory the posts of each rank, job and uid hold.
    held: crate::held::Ledger,
    signals: crate::signals::SignalPipe,
    start: Instant,
    key: ClusterKey,
    limits: Limits,
    /// Client-caused warnings (bad frames, refused hellos and posts): rate-limited.
    log_limit: LogLimit,
    /// When connections without a hello were last checked for their timeout.
    last_hello_sweep: Instant,
    /// Admin requests answered lately: each is answered once (`admin_check`).
    admin_replays: auth::AdminReplays,
    /// `SPOFF_RECORD_FRAMES`: received frames written to files (the fuzzer's seed corpus).
    recorder: Option<crate::record::Recorder>,
    heartbeat: Duration,
    peer_timeout: Duration,
    last_beat: Instant,
    /// When each peer SP was last heard from (any frame).
    last_heard: SpMap<SpId, Instant>,
    /// When the clock was last checked (`timers::on_timers`).
    last_timers: Instant,
    /// The instances' deadlines (see `timers`).
    deadlines: timers::Deadlines,
    pub stats: Stats,
}

/// Longest an SP that stops spends getting its `Shutdown` frame out to its peers (all of them).
const SHUTDOWN_FLUSH: Duration = Duration::from_millis(100);

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
    pub fn new(cfg: ServeConfig, mesh: crate::mesh::Mesh) -> anyhow::Result<Server> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let keeper = crate::mesh::Keeper::spawn(
            cfg.sp,
            &cfg.cluster,
            cfg.peer_listener.try_clone()?,
            &cfg.key,
            waker.clone(),
        )?;
        let crate::mesh::Mesh { peers, missing } = mesh;
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
        let hosts_tcp = match cfg.host_listener {
            Some(l) => {
                l.set_nonblocking(true)?;
                let mut l = TcpListener::from_std(l);
                poll.registry()
                    .register(&mut l, LISTEN_HOSTS_TCP, Interest::READABLE)?;
                Some(l)
            }
            None => None,
        };
        let signals = crate::signals::SignalPipe::install()?;
        crate::signals::unlink_on_signal(&cfg.host_socket);
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
                    // ucx-export grants: the SP imports the host's exported memory handle
                    // (BlueField cross-GVMI); made on first use, refused with the reason if
                    // this build or device cannot.
                    ucx_export: ucx,
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
        let mut resources = drivers::resources::Registry::default();
        resources.add(Box::new(crate::staged_resources::StagedResources::new(
            cfg.staged,
            cfg.staging_bytes,
            cfg.limits.staging_shares,
            stage_ucx,
        )));
        let mcast_plane = cfg.mcast_plane.and_then(|mut pc| {
            pc.movers = alias_mkey::mover::MoverConfig {
                chunk_bytes: cfg.chunk_bytes,
                ucx,
                ucx_export: ucx,
            };
            crate::mcast::plane::Plane::start(pc, cfg.key.clone(), waker.clone())
                .map_err(|e| format!("the multicast fabric cannot be opened here: {e}"))
        });
        match mcast_plane {
            Ok(p) => resources.add(Box::new(p)),
            Err(why) => {
                info!(sp = cfg.sp, "no multicast collectives: {why}");
                resources.add(Box::new(drivers::resources::Unavailable {
                    family: bootstrap::kinds::Family::Multicast,
                    why,
                }));
            }
        }
        match crate::canary_resources::CanaryResources::open(
            cfg.sp,
            &cfg.cluster,
            &cfg.key,
            waker.clone(),
            cfg.canary_socket,
        ) {
            Ok(r) => resources.add(Box::new(r)),
            Err(why) => {
                if cfg.cluster.canary.is_some() {
                    warn!(sp = cfg.sp, "no Canary allreduce: {why}");
                }
                resources.add(Box::new(drivers::resources::Unavailable {
                    family: bootstrap::kinds::Family::InNetwork,
                    why,
                }));
            }
        }
        let mut server = Server {
            me: cfg.sp,
            cluster: cfg.cluster,
            poll,
            hosts_listener,
            host_socket: cfg.host_socket,
            hosts_tcp,
            hosts_same_kernel: cfg.hosts_same_kernel,
            conns: Slab::new(),
            next_serial: 0,
            pass: 0,
            accept_due: [false; 2],
            doomed: Vec::new(),
            peer_conn: SpMap::new(),
            dead_peers: missing.iter().copied().collect(),
            keeper,
            replacing: None,
            leaving_peers: SpSet::new(),
            next_conn_id: 0,
            jobs: HashMap::new(),
            instances: Default::default(),
            limiter: CopyLimiter::new(cfg.max_inflight_reads.max(1)),
            copies: SpMap::new(),
            host_copies: SpMap::new(),
            next_ticket: 0,
            datapath,
            splits: crate::datapath::Splits::new(
                cfg.split_copy_bytes,
                cfg.datapath_threads.min(cfg.split_parts),
            ),
            ucx,
            mover: CmaMover::new((cfg.inline_copy_bytes as usize).clamp(4096, 1 << 20)),
            inline_copy_bytes: cfg.inline_copy_bytes,
            inline_done: Vec::new(),
            host_done: Vec::new(),
            kind_cfg: drivers::KindConfig {
                staged: cfg.staged,
                mcast: cfg.mcast,
            },
            resources,
            resource_out: Vec::new(),
            ucx_moves: SpMap::new(),
            held: crate::held::Ledger::new(cfg.limits.held),
            poll_interval: cfg.poll_interval,
            ring_hosts: Vec::new(),
            read_at_ns: 0,
            signals,
            start: Instant::now(),
            key: cfg.key,
            limits: cfg.limits,
            log_limit: LogLimit::new(20, Duration::from_secs(10)),
            last_hello_sweep: Instant::now(),
            admin_replays: auth::AdminReplays::new(ADMIN_REQUESTS_KEPT),
            recorder: crate::record::Recorder::from_env(cfg.sp),
            heartbeat: cfg.heartbeat,
            peer_timeout: cfg.peer_timeout,
            last_beat: Instant::now(),
            last_heard: SpMap::new(),
            last_timers: Instant::now(),
            deadlines: timers::Deadlines::default(),
            stats: Stats::default(),
        };
        for (sp, s) in peers {
            s.set_nonblocking(true)?;
            let stream = Stream::Tcp(mio::net::TcpStream::from_std(s));
            let key = server.add_conn(stream, Role::Peer(sp))?;
            server.peer_conn.insert(sp, key);
            server.last_heard.insert(sp, Instant::now());
        }
        for sp in missing {
            server.keeper.rejoin(server.me, sp, Duration::ZERO);
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
        let hello = matches!(role, Role::NewHost { .. });
        let conn = entry.insert(Conn::new(stream, role, self.next_serial).with_out_limit(limit));
        if hello {
            conn.set_max_frame(wire::MAX_HELLO_FRAME_BYTES);
        }
        self.poll.registry().register(
            conn.stream.source(),
            Token(CONN_BASE + key),
            Interest::READABLE | Interest::WRITABLE,
        )?;
        Ok(key)
    }

    /// Runs until SIGINT/SIGTERM. Returns the stats. `on_stop` gets them first thing on the
    /// signal, before anything else is done (the socket removed, the peers told, the datapath
    /// and UCX torn down as `self` goes, all bounded): a launcher may SIGKILL the SP about a
    /// second after SIGTERM (Open MPI's `mpirun`), and the counters must be out by then.
    pub fn run(mut self, on_stop: impl FnOnce(&Stats)) -> anyhow::Result<Stats> {
        let mut events = Events::with_capacity(256);
        let tcp = self.hosts_tcp.as_ref().and_then(|l| l.local_addr().ok());
        info!(sp = self.me, socket = %self.host_socket.display(), tcp = ?tcp, "serving");
        if self.poll_interval.is_some_and(|nap| !nap.is_zero()) {
            // Naps of a few tens of microseconds: Linux's default timer slack (50 us) would
            // stretch each one by up to that much.
            // SAFETY: prctl with an integer argument; no memory is passed.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, POLL_TIMER_SLACK_NS) };
        }
        let mut pass_start = Instant::now();
        loop {
            // The families' resources do their work on this thread first (the staged
            // family's UCX worker of the staging is progressed for at most a slice), and bound
            // the wait; a polling SP (`poll_interval`) never sleeps.
            let polling = self.poll_interval;
            // Three readings of the clock per pass (this one, the next, and the pass's start
            // after the wait, which the timers use): a busy pass is a microsecond or two, and
            // a reading is a noticeable part of it.
            let progress_start = Instant::now();
            let timeout = self.resources.progress(polling.is_some());
            let progress_end = Instant::now();
            let progressed = (progress_end - progress_start).as_micros() as u64;
            self.stats.ucx_progress_max_us = self.stats.ucx_progress_max_us.max(progressed);
            let timeout = if polling.is_some() || self.accept_due.contains(&true) {
                Some(Duration::ZERO)
            } else {
                let wake = self.wake_in();
                Some(timeout.map_or(wake, |t| t.min(wake)))
            };
            let pass = progress_end
                .saturating_duration_since(pass_start)
                .as_micros() as u64;
            self.stats.loop_pass_max_us = self.stats.loop_pass_max_us.max(pass);
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e.into());
            }
            pass_start = Instant::now();
            self.pass += 1;
            if let (Some(nap), true) = (polling, events.is_empty()) {
                self.stats.empty_polls += 1;
                // A nap, not sched_yield: SPs spinning with sched_yield on one CPU were seen to
                // keep it from each other and from their datapath threads for a whole
                // scheduler tick (milliseconds) on Linux 6.18. Busy-polling (a zero nap): no
                // nap, no yield; the SP owns its cores.
                if !nap.is_zero() {
                    std::thread::sleep(nap);
                }
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTEN_HOSTS => self.accept_due[0] = true,
                    LISTEN_HOSTS_TCP => self.accept_due[1] = true,
                    WAKER => self.take_joined_peers(),
                    UCX_EVENTS => {}
                    SIGNALS => {
                        if self.signals.drain() {
                            let stats = self.stats_now();
                            on_stop(&stats);
                            let _ = std::fs::remove_file(&self.host_socket);
                            info!(sp = self.me, "stopping on signal");
                            // No peer may rejoin an SP on its way out.
                            self.keeper.stop();
                            self.say_shutdown();
                            return Ok(stats);
                        }
                    }
                    Token(t) if t >= PIDFD_BASE => self.on_pidfd(t - PIDFD_BASE),
                    Token(t) => {
                        let key = t - CONN_BASE;
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.on_readable(key, ev.is_read_closed() || ev.is_error());
                        }
                        if ev.is_writable() {
                            self.flush_conn(key);
                        }
                    }
                }
                self.close_doomed();
            }
            // New connections after every read of the pass: a hello that had arrived when the
            // pass began is read before a burst of connections could evict its connection.
            if self.accept_due[0] {
                self.accept_due[0] = !self.accept_hosts();
            }
            if self.accept_due[1] {
                self.accept_due[1] = !self.accept_tcp_hosts();
            }
            self.close_doomed();
            // The posts the hosts wrote in their rings since the last pass (none without
            // polling: only a polling SP reads rings).
            self.drain_rings();
            // What the resources finished first: a driver's timer that comes due in the same
            // wake then sees it (a multicast cutoff sees the chunks that landed meanwhile).
            self.on_resource_events();
            self.on_timers(pass_start);
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
        let eps = self.datapath.ucx_endpoints();
        s.ucx_endpoints_opened = eps.opened;
        s.ucx_endpoints_closed = eps.closed;
        s.ucx_endpoints_open = eps.opened.saturating_sub(eps.closed);
        s.ucx_endpoint_closes_unfinished = eps.closes_unfinished;
        s.ucx_endpoint_errors = eps.errors;
        s.jobs_at_exit = self.jobs.len() as u64;
        s.instances_at_exit = self.instances.len() as u64;
        s.families = self.resources.counters().into_iter().collect();
        s
    }

    /// Serves the SPs the mesh keeper took (back): a restarted SP's new connection replaces
    /// what was left of its old one, which ends as a lost peer first (the collectives that
    /// still needed the old one fail).
    fn take_joined_peers(&mut self) {
        while let Ok((sp, s)) = self.keeper.joined.try_recv() {
            if let Some(old) = self.peer_conn.get(&sp).copied() {
                self.replacing = Some(sp);
                self.close_conn(old, "replaced by a new connection: the SP restarted");
                self.replacing = None;
            }
            let added = s.set_nonblocking(true).and_then(|()| {
                let stream = Stream::Tcp(mio::net::TcpStream::from_std(s));
                self.add_conn(stream, Role::Peer(sp))
            });
            match added {
                Ok(key) => {
                    self.peer_conn.insert(sp, key);
                    self.last_heard.insert(sp, Instant::now());
                    self.dead_peers.remove(&sp);
                    self.leaving_peers.remove(&sp);
                    self.stats.peers_joined += 1;
                    info!(sp = self.me, peer = sp, "peer SP joined");
                }
                Err(e) => {
                    warn!(sp = self.me, peer = sp, "cannot serve the joining SP: {e}");
                    self.keeper.rejoin(self.me, sp, Duration::ZERO);
                }
            }
        }
    }

    /// Tells every peer this SP is stopping, with a bounded effort to get it out: at most
    /// [`SHUTDOWN_FLUSH`] for all peers together (not per peer: an SP with many peers, some of
    /// them slow to read, must still stop within a fraction of a second).
    fn say_shutdown(&mut self) {
        let frame = encode(&SpToSp::Shutdown);
        let peers: Vec<usize> = self.peer_conn.values().copied().collect();
        for &k in &peers {
            if let Some(c) = self.conns.get_mut(k) {
                let _ = c.send(&frame);
            }
        }
        let deadline = Instant::now() + SHUTDOWN_FLUSH;
        let mut waiting = peers;
        loop {
            waiting.retain(|&k| {
                self.conns
                    .get_mut(k)
                    .is_some_and(|c| c.pending_out() > 0 && c.flush().is_ok())
            });
            if waiting.is_empty() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
