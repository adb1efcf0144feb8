//! Start-up, shared state and shutdown.
//!
//! The shim's life is an explicit state machine in [`STATE`]:
//!
//! - `Uninit`: loaded, nothing done. Every call is native.
//! - `Connecting`: entered by the intercepted `MPI_Init`/`MPI_Init_thread` once `PMPI_Init*`
//!   has returned. The rank reads its configuration, connects and registers with its SP, and
//!   all ranks agree (collectively, on `MPI_COMM_WORLD`) whether offload is on for the job.
//!   Calls made meanwhile are native.
//! - `Active`: every rank of the job is registered with its SP; the collectives in `coll.rs`
//!   offload.
//! - `Disabled`: offload is off (not configured, an SP unreachable somewhere, after
//!   `MPI_Finalize`, or in a child after `fork`). Every call is native.
//!
//! The transitions happen once, on the thread that called `MPI_Init*` / `MPI_Finalize`. The
//! data the active shim needs are split by how they are used: what never changes after
//! activation ([`Topology`], the mailbox address) is set once and read without locking; what
//! changes (the connection, the slot pool, the request registry, the token counter, the grant
//! cache) sits in [`SHIM`] behind a mutex that is only ever held for short, non-blocking work.
//!
//! The start-up agreement is collective: every rank executes the same sequence of PMPI
//! collectives whatever its own environment says, so ranks with inconsistent settings end
//! disabled together instead of hanging.

use crate::boundary::{no_panic, say};
use crate::conn::{self, Conn};
use crate::grants::{Backend, Grants};
use crate::registry::Registry;
use crate::request::OffloadRequest;
use crate::slots::SlotPool;
use algorithms::SpId;
use alias_mkey::host::Registrar;
use alias_mkey::Rights;
use bootstrap::auth::JobCredential;
use bootstrap::mailbox::{self, DEFAULT_SLOTS, SLOT_BYTES, STATUS_OFFSET, TOKEN_OFFSET};
use bootstrap::wire::{CopySrc, Hello, HostHello, HostToSp, SpToHost};
use bootstrap::Cluster;
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::c_int;
use std::path::PathBuf;
use std::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};
use std::sync::{Mutex, MutexGuard, OnceLock};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum State {
    Uninit = 0,
    Connecting = 1,
    Active = 2,
    Disabled = 3,
}

static STATE: AtomicU8 = AtomicU8::new(State::Uninit as u8);

pub fn state() -> State {
    match STATE.load(Ordering::Acquire) {
        0 => State::Uninit,
        1 => State::Connecting,
        2 => State::Active,
        _ => State::Disabled,
    }
}

#[inline]
pub fn is_active() -> bool {
    STATE.load(Ordering::Acquire) == State::Active as u8
}

/// What never changes once the shim is active.
#[derive(Debug)]
pub struct Topology {
    pub world_rank: u32,
    pub world_size: u32,
    /// The SP serving each world rank.
    pub sp_of_world: Vec<SpId>,
    /// The node of each SP of the cluster description, indexed by SP id.
    pub node_of_sp: Vec<u32>,
    /// The name of the job's segment on this rank's node (hierarchical staged designs), as
    /// its SP named it.
    pub segment: String,
}

static TOPOLOGY: OnceLock<Topology> = OnceLock::new();

/// Only called on paths that run when active.
pub fn topology() -> &'static Topology {
    TOPOLOGY
        .get()
        .expect("topology is set before the shim becomes active")
}

/// Base address of the mailbox (never unmapped once set).
static MAILBOX: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
static MAILBOX_SLOTS: AtomicU32 = AtomicU32::new(0);
/// `SPOFF_VERBOSE`, for the report at `MPI_Finalize`.
static VERBOSE: AtomicBool = AtomicBool::new(false);

/// Number of request objects the shim tracks (live + detached): lets the Wait/Test family skip
/// the lock entirely while it is zero.
pub static TRACKED: AtomicUsize = AtomicUsize::new(0);

/// The completion token word of `slot`.
pub fn mailbox_token(slot: u32) -> &'static AtomicU64 {
    let base = MAILBOX.load(Ordering::Acquire);
    assert!(!base.is_null() && slot < MAILBOX_SLOTS.load(Ordering::Relaxed));
    // SAFETY: the mailbox is a live, never-unmapped, page-aligned mapping of
    // MAILBOX_SLOTS * SLOT_BYTES bytes; the slot is in range (checked above) and the word is
    // 8-aligned (SLOT_BYTES and TOKEN_OFFSET are multiples of 8). Other writers (the SP, via
    // process_vm_writev) are outside Rust's memory model; we only use atomic accesses.
    unsafe { &*(base.add((slot as u64 * SLOT_BYTES + TOKEN_OFFSET) as usize) as *const AtomicU64) }
}

/// The status word of `slot`.
pub fn mailbox_status(slot: u32) -> &'static std::sync::atomic::AtomicU32 {
    let base = MAILBOX.load(Ordering::Acquire);
    assert!(!base.is_null() && slot < MAILBOX_SLOTS.load(Ordering::Relaxed));
    // SAFETY: as in `mailbox_token`; STATUS_OFFSET is 4-aligned and inside the slot.
    unsafe {
        &*(base.add((slot as u64 * SLOT_BYTES + STATUS_OFFSET) as usize)
            as *const std::sync::atomic::AtomicU32)
    }
}

/// The mutable state of the active shim.
pub struct Shim {
    pub conn: Conn,
    pub slots: SlotPool,
    /// Grants on the program's buffers (`cma` or `ucx`; the mailbox is always `cma`).
    pub registrar: Grants,
    pub registry: Registry,
    /// Next completion token (tokens start at 1: 0 means "nothing written").
    pub next_token: u64,
}

static SHIM: Mutex<Option<Shim>> = Mutex::new(None);

fn lock() -> MutexGuard<'static, Option<Shim>> {
    // A panic while locked (caught at the boundary) must not disable the whole shim.
    SHIM.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` on the shim state under the lock; `None` when there is no active state.
pub fn with_shim<R>(f: impl FnOnce(&mut Shim) -> R) -> Option<R> {
    lock().as_mut().map(f)
}

/// The MPI error code for a mailbox status.
pub fn mpi_code(status: u32) -> c_int {
    if status == mailbox::STATUS_OK {
        consts::SUCCESS()
    } else if status == mailbox::status_code(algorithms::Status::CountMismatch) {
        consts::ERR_TRUNCATE()
    } else {
        consts::ERR_OTHER()
    }
}

impl Shim {
    /// Records the mailbox result of `req` (whose token has been seen) and frees its slot.
    /// Idempotent.
    pub fn complete_from_mailbox(&mut self, req: &OffloadRequest) {
        let Some(slot) = req.slot else { return };
        if req.result().is_some() {
            return;
        }
        self.complete_with(req, mailbox_status(slot).load(Ordering::Acquire));
        self.slots.give(slot);
    }

    /// Records the result of `req` from the SP's status word (once).
    fn complete_with(&mut self, req: &OffloadRequest, status: u32) {
        if req.result().is_some() {
            return;
        }
        let code = mpi_code(status);
        if status != mailbox::STATUS_OK {
            let t = topology();
            say!(
                "rank {}: offloaded {} #{} on communicator {}:{} failed: {} (status {status})",
                t.world_rank,
                crate::coll::kind_name(req.kind),
                req.seq,
                req.comm.leader,
                req.comm.id,
                mailbox::status_name(status)
            );
        }
        req.finish(code);
    }

    /// Looks at the mailbox for every tracked request that has not completed yet (after a
    /// round of UCX progress with the `ucx` backend).
    pub fn harvest(&mut self) {
        self.registrar.progress();
        let addrs: Vec<usize> = self.registry.all().collect();
        for a in addrs {
            // SAFETY: every address in the registry is a live OffloadRequest; objects are
            // removed from the registry (under this lock) before they are freed.
            let req = unsafe { &*(a as *const OffloadRequest) };
            let seen = req
                .slot
                .is_some_and(|slot| mailbox_token(slot).load(Ordering::Acquire) == req.token);
            if req.result().is_none() && seen {
                self.complete_from_mailbox(req);
            }
        }
        self.reap_detached();
    }

    /// Frees detached requests that have completed.
    pub fn reap_detached(&mut self) {
        let done = self.registry.take_finished_detached(|a| {
            // SAFETY: as in `harvest`.
            unsafe { &*(a as *const OffloadRequest) }.result().is_some()
        });
        for a in done {
            TRACKED.fetch_sub(1, Ordering::AcqRel);
            // SAFETY: `a` came from Box::into_raw in `coll.rs` and has just left the registry,
            // so nothing else refers to it.
            drop(unsafe { Box::from_raw(a as *mut OffloadRequest) });
        }
    }

    /// Forgets a live handle and frees its object. The caller owns the handle.
    pub fn free_request(&mut self, addr: usize) {
        assert!(
            self.registry.remove(addr),
            "freeing unknown request {addr:#x}"
        );
        TRACKED.fetch_sub(1, Ordering::AcqRel);
        // SAFETY: as in `reap_detached`.
        drop(unsafe { Box::from_raw(addr as *mut OffloadRequest) });
    }

    /// Reads the SP connection: refusals of posts, or the connection's end. Every request the
    /// SP refused, or that can no longer complete, is finished with an error.
    pub fn service_connection(&mut self) {
        let was_broken = self.conn.broken.is_some();
        for msg in self.conn.poll_incoming() {
            match msg {
                SpToHost::Error {
                    comm,
                    seq,
                    code,
                    message,
                } => {
                    say!(
                        "rank {}: the service process refused a request ({code:?}): {message}",
                        topology().world_rank
                    );
                    let (Some(comm), Some(seq)) = (comm, seq) else {
                        // A refusal naming no post (a message the SP could not read): some
                        // request may never complete, and waiting for it would hang. The stream
                        // is not trusted any more: break it (every outstanding request fails).
                        self.conn.mark_broken(format!(
                            "the service process at {} refused a message it could not attribute",
                            self.conn.path.display()
                        ));
                        continue;
                    };
                    self.fail_matching(|r| r.comm == comm && r.seq == seq);
                }
                SpToHost::Registered { .. } | SpToHost::Heartbeat => {}
                SpToHost::Completed { token, status } => {
                    let req = self.registry.all().find(|&a| {
                        // SAFETY: as in `harvest`.
                        let r = unsafe { &*(a as *const OffloadRequest) };
                        r.slot.is_none() && r.token == token
                    });
                    match req {
                        // SAFETY: as in `harvest`.
                        Some(a) => {
                            self.complete_with(unsafe { &*(a as *const OffloadRequest) }, status)
                        }
                        None => self.conn.mark_broken(format!(
                            "the service process at {} completed token {token}, which no \
                             outstanding collective of this rank has",
                            self.conn.path.display()
                        )),
                    }
                }
                SpToHost::Copy {
                    token,
                    ticket,
                    src,
                    dst_offset,
                    len,
                } => {
                    let ok = match self.host_copy(token, src, dst_offset, len) {
                        Ok(()) => true,
                        Err(why) => {
                            say!(
                                "rank {}: intra-node copy for the service process failed: {why}",
                                topology().world_rank
                            );
                            false
                        }
                    };
                    // A failed send breaks the connection, which fails every request.
                    let _ = self.conn.send(&HostToSp::CopyDone { ticket, ok });
                }
            }
        }
        // An SP that says nothing while collectives are outstanding is stuck (it sends
        // heartbeats while it has posts of ours): waiting for it would hang.
        let waiting = self.registry.all().any(|a| {
            // SAFETY: as in `harvest`.
            unsafe { &*(a as *const OffloadRequest) }.result().is_none()
        });
        let silent = self.conn.last_heard.elapsed();
        if waiting && self.conn.broken.is_none() && silent > sp_timeout() {
            self.conn.mark_broken(format!(
                "the service process at {} has sent nothing for {:.1} s (no heartbeat): it is \
                 stuck or gone",
                self.conn.path.display(),
                silent.as_secs_f64()
            ));
        }
        if !was_broken {
            if let Some(why) = self.conn.broken.clone() {
                say!(
                    "rank {}: {why}; outstanding offloaded collectives fail",
                    topology().world_rank
                );
                self.fail_matching(|_| true);
            }
        }
    }

    /// Copies `len` bytes from `src` (another process of this node, or this rank's mapping of
    /// its staged-collective segment) into the receive region of the outstanding request
    /// posted with `token`, at `dst_offset`: the SP's request for an intra-node copy in a
    /// blocking allgatherv, or a hierarchical staged collective. Only a request that accepts
    /// host copies, and only inside its own receive region, is written; a segment is read only
    /// inside its mapping.
    fn host_copy(
        &mut self,
        token: u64,
        src: CopySrc,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), String> {
        let region = self.registry.all().find_map(|a| {
            // SAFETY: as in `harvest`.
            let req = unsafe { &*(a as *const OffloadRequest) };
            (req.token == token && req.result().is_none())
                .then_some(req.host_copy_region)
                .flatten()
        });
        let Some((base, region_len)) = region else {
            return Err(format!(
                "no outstanding blocking collective has token {token}"
            ));
        };
        match dst_offset.checked_add(len) {
            Some(end) if end <= region_len => {}
            _ => {
                return Err(format!(
                    "[{dst_offset}, +{len}) lies outside the {region_len}-byte receive region"
                ))
            }
        }
        let dst = (base as u64 + dst_offset) as usize;
        match src {
            // SAFETY: [dst, dst+len) lies inside the receive region this request granted, which
            // the program may not touch until the request completes.
            CopySrc::Process { pid, addr } => unsafe {
                crate::cma::read_from(pid, addr, dst, len as usize)
            },
            CopySrc::Segment { offset } => {
                let seg = crate::segment::mapped()
                    .ok_or("a copy from the segment, which this rank has not mapped")?;
                let src = seg.range(offset, len)?;
                // SAFETY: `src` lies in the mapped segment and `dst` in the receive region (as
                // above); they do not overlap (the segment is the shim's own mapping).
                unsafe { std::ptr::copy_nonoverlapping(src, dst as *mut u8, len as usize) };
                Ok(())
            }
        }
    }

    /// The program freed the communicator `id`: its requests report errors through
    /// `MPI_COMM_WORLD` from now on (their handle is no longer valid).
    pub fn comm_freed(&mut self, id: algorithms::CommId) {
        for a in self.registry.all() {
            // SAFETY: as in `harvest`.
            let req = unsafe { &*(a as *const OffloadRequest) };
            if req.comm == id {
                req.comm_freed();
            }
        }
    }

    /// Finishes with `MPI_ERR_OTHER` every incomplete tracked request matching `pred`. Their
    /// slots are quarantined: a late write from the SP must not land in a reused slot.
    pub fn fail_matching(&mut self, pred: impl Fn(&OffloadRequest) -> bool) {
        let addrs: Vec<usize> = self.registry.all().collect();
        for a in addrs {
            // SAFETY: as in `harvest`.
            let req = unsafe { &*(a as *const OffloadRequest) };
            if req.result().is_none() && pred(req) {
                req.finish(consts::ERR_OTHER());
                if let Some(slot) = req.slot {
                    self.slots.quarantine(slot);
                }
            }
        }
    }
}

/// How long an SP may send nothing while collectives of this rank are outstanding before the
/// rank gives up on it: `SPOFF_SP_TIMEOUT_MS`, default 15 s (SPs send a heartbeat every
/// second while they have posts of this rank).
fn sp_timeout() -> std::time::Duration {
    static T: OnceLock<std::time::Duration> = OnceLock::new();
    *T.get_or_init(|| {
        let ms = std::env::var("SPOFF_SP_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|&ms| ms > 0)
            .unwrap_or(15_000);
        std::time::Duration::from_millis(ms)
    })
}

/// Settings read from the environment.
#[derive(Debug)]
struct Settings {
    cluster: Option<PathBuf>,
    offload: bool,
    /// `SPOFF_JOB_CREDENTIAL`, as given (the SP checks it).
    credential: Option<String>,
    verbose: bool,
    backend: Result<Backend, String>,
}

impl Settings {
    fn from_env() -> Self {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        Settings {
            cluster: var("SPOFF_CLUSTER").map(PathBuf::from),
            offload: var("SPOFF_OFFLOAD").is_none_or(|v| v != "0"),
            credential: var("SPOFF_JOB_CREDENTIAL").and_then(|v| v.into_string().ok()),
            verbose: var("SPOFF_VERBOSE").is_some_and(|v| v != "0"),
            backend: Backend::parse(var("SPOFF_BACKEND").as_ref().and_then(|v| v.to_str())),
        }
    }
}

/// Runs the start-up after a successful `PMPI_Init*`. Never fails: at worst the shim ends
/// `Disabled`.
///
/// # Safety
/// MPI is initialised and this is the thread that initialised it.
pub unsafe fn start() {
    if STATE
        .compare_exchange(
            State::Uninit as u8,
            State::Connecting as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .is_err()
    {
        return;
    }
    // SAFETY: forwarded precondition.
    let active = no_panic("start-up", || unsafe { start_inner() }).unwrap_or(false);
    let next = if active {
        State::Active
    } else {
        State::Disabled
    };
    STATE.store(next as u8, Ordering::Release);
}

extern "C" fn after_fork_in_child() {
    // A forked child is not the rank the SP knows; it must never post.
    STATE.store(State::Disabled as u8, Ordering::Release);
}

/// A successfully registered rank, before the job-wide agreement.
struct Registered {
    conn: Conn,
    registrar: Registrar,
    sp: SpId,
    node: u32,
    local_rank: u32,
    /// The node of each SP of the cluster description, indexed by SP id.
    node_of_sp: Vec<u32>,
    /// The name of the job's segment on this node, from the SP.
    segment: String,
}

unsafe fn start_inner() -> bool {
    let settings = Settings::from_env();
    let world = consts::COMM_WORLD();
    let (mut rank, mut size) = (0, 0);
    // SAFETY: MPI is initialised; the out-pointers are valid.
    unsafe {
        ffi::PMPI_Comm_rank(world, &mut rank);
        ffi::PMPI_Comm_size(world, &mut size);
    }
    let (rank, size) = (rank as u32, size as u32);

    // 1. Does every rank want offload? [all want, none wants] as a MIN reduction.
    let want = settings.offload && settings.cluster.is_some() && settings.credential.is_some();
    let mut wants: [c_int; 2] = [want as c_int, !want as c_int];
    // SAFETY: in-place reduction over two ints in a live array.
    let rc = unsafe {
        ffi::PMPI_Allreduce(
            consts::IN_PLACE(),
            wants.as_mut_ptr().cast(),
            2,
            consts::INT(),
            consts::OP_MIN(),
            world,
        )
    };
    if rc != consts::SUCCESS() {
        return false;
    }
    let (all_want, none_wants) = (wants[0] == 1, wants[1] == 1);
    if !all_want {
        if !none_wants && rank == 0 {
            say!("offload is off for this job: SPOFF_CLUSTER / SPOFF_JOB_CREDENTIAL / SPOFF_OFFLOAD are not set alike on every rank; running natively");
        }
        return false;
    }

    // 2. The job, from the credential the launcher (or resource manager) issued; every rank
    // must have the same one (checked with rank 0's below: a rank that differs counts as
    // failed in the agreement of step 4).
    let credential = settings.credential.clone().expect("checked by `want`");
    let mine = JobCredential::decode(&credential).map(|c| c.job);
    let mut job: u64 = *mine.as_ref().unwrap_or(&0);
    // SAFETY: broadcast of one u64 in a live variable.
    let rc = unsafe {
        ffi::PMPI_Bcast(
            (&mut job as *mut u64).cast(),
            1,
            consts::UINT64_T(),
            0,
            world,
        )
    };
    if rc != consts::SUCCESS() {
        return false;
    }
    let same_job = match mine {
        Ok(j) if j == job => Ok(()),
        Ok(_) => Err("SPOFF_JOB_CREDENTIAL names another job than rank 0's".to_string()),
        Err(e) => Err(format!("SPOFF_JOB_CREDENTIAL: {e}")),
    };

    // 3. Connect and register, each rank on its own.
    // PR_SET_PTRACER_ANY, not PR_SET_PTRACER(sp_pid): with the `cma` backend the SPs of *all*
    // nodes copy out of and into this rank's memory with process_vm_readv/writev (the SP of
    // every peer, not only our own, several different pids, not known here and possibly
    // restarted), and Yama's ptrace_scope=1 only admits one named tracer. The implication: any
    // process of this user may ptrace this rank (read and write its memory, as a debugger),
    // the permission it would have under ptrace_scope=0; ptrace_scope=2/3 still refuse, and
    // there the cma backend cannot work. On BlueField the alias-key path (DPU cross-GVMI mkeys)
    // replaces CMA and needs no ptrace permission at all. Failure (no Yama) is harmless.
    // SAFETY: plain prctl with integer arguments.
    unsafe {
        libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0);
    }
    let cluster_path = settings.cluster.clone().expect("checked by `want`");
    // SAFETY: MPI is initialised. (Without the datatype cache's keyval, types are analysed at
    // every call.)
    unsafe { crate::datatype::create_keyval() };
    // SAFETY: MPI is initialised.
    let local = match unsafe { crate::comm::create_keyval() } {
        Ok(()) => same_job.and_then(|()| register(&cluster_path, &credential, rank, size)),
        Err(rc) => Err(format!(
            "cannot create a communicator keyval (MPI error {rc})"
        )),
    };

    // 4. Agree: count the ranks that failed.
    let mut failed: c_int = local.is_err() as c_int;
    // SAFETY: in-place reduction over one int.
    let rc = unsafe {
        ffi::PMPI_Allreduce(
            consts::IN_PLACE(),
            (&mut failed as *mut c_int).cast(),
            1,
            consts::INT(),
            consts::OP_SUM(),
            world,
        )
    };
    let agreed = rc == consts::SUCCESS() && failed == 0;
    let reg = match local {
        Err(why) => {
            say!("rank {rank}: {why}; running natively");
            return false;
        }
        Ok(reg) if !agreed => {
            if rank == 0 {
                say!(
                    "offload is off for this job: {failed} rank(s) could not reach their service process; running natively"
                );
            }
            reg.conn.close();
            return false;
        }
        Ok(reg) => reg,
    };

    // 5. Who serves whom.
    let mut sp_of_world: Vec<u32> = vec![0; size as usize];
    let mine: u32 = reg.sp;
    // SAFETY: gathers one u32 per rank into a buffer of world size.
    let rc = unsafe {
        ffi::PMPI_Allgather(
            (&mine as *const u32).cast(),
            1,
            consts::UINT32_T(),
            sp_of_world.as_mut_ptr().cast(),
            1,
            consts::UINT32_T(),
            world,
        )
    };
    if rc != consts::SUCCESS() {
        // Collective failure: every rank sees it alike.
        reg.conn.close();
        return false;
    }

    let _ = TOPOLOGY.set(Topology {
        world_rank: rank,
        world_size: size,
        sp_of_world,
        node_of_sp: reg.node_of_sp.clone(),
        segment: reg.segment.clone(),
    });
    if settings.verbose {
        say!(
            "rank {rank}: offload active: job {job:#x}, node {}, local rank {}, SP {} at {}, {} mailbox slots",
            reg.node,
            reg.local_rank,
            reg.sp,
            reg.conn.path.display(),
            MAILBOX_SLOTS.load(Ordering::Acquire)
        );
    }
    let backend = settings.backend.unwrap_or_else(|why| {
        say!("rank {rank}: {why}");
        Backend::Cma
    });
    let grants = Grants::new(reg.registrar, backend, rank);
    if settings.verbose && grants.backend() == Backend::Ucx {
        say!(
            "rank {rank}: ucx grants, memory events {}",
            if grants.events() { "on" } else { "off" }
        );
    }
    VERBOSE.store(settings.verbose, Ordering::Release);
    *lock() = Some(Shim {
        conn: reg.conn,
        slots: SlotPool::new(MAILBOX_SLOTS.load(Ordering::Acquire)),
        registrar: grants,
        registry: Registry::default(),
        next_token: 1,
    });
    // SAFETY: registering a plain extern "C" fn with no captured state.
    unsafe {
        libc::pthread_atfork(None, None, Some(after_fork_in_child));
    }
    true
}

/// Most mailbox slots accepted from `SPOFF_MAILBOX_SLOTS`.
const MAX_MAILBOX_SLOTS: u32 = 1 << 16;

/// Mailbox slots: `SPOFF_MAILBOX_SLOTS` (1..=65536) or the protocol default. A small value
/// makes posting harvest completions early (useful in tests); it bounds how many collectives a
/// rank can have outstanding at once.
fn mailbox_slots() -> u32 {
    std::env::var("SPOFF_MAILBOX_SLOTS")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .map(|n| n.clamp(1, MAX_MAILBOX_SLOTS))
        .unwrap_or(DEFAULT_SLOTS)
}

/// The rank's cores (its affinity mask), reported to the SP.
fn affinity_cores() -> Vec<u32> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .map(|c| c as u32)
            .collect()
    }
}

/// Maps the mailbox: page-aligned, zeroed, never unmapped (the SP may write to it until it
/// has seen our goodbye, and a mapping reused at the same address would get those writes).
fn map_mailbox(slots: u32) -> Result<*mut u8, String> {
    let len = slots as usize * SLOT_BYTES as usize;
    // SAFETY: an anonymous private mapping; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len.max(1),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!(
            "cannot map a {len}-byte mailbox: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(p.cast())
}

/// Connects to this rank's SP and registers. Errors are one-line reasons.
fn register(
    cluster_path: &std::path::Path,
    credential: &str,
    rank: u32,
    size: u32,
) -> Result<Registered, String> {
    let cluster = Cluster::load(cluster_path)
        .map_err(|e| format!("cannot use the cluster description: {e}"))?;
    let placement = cluster.placement(rank, size).map_err(|e| {
        format!(
            "no place in the cluster description {}: {e}",
            cluster_path.display()
        )
    })?;
    let entry = cluster
        .sp(placement.sp)
        .ok_or_else(|| format!("the cluster description has no SP {}", placement.sp))?;
    let path = entry.host_socket.clone();
    let stream = conn::connect(&path, conn::CONNECT_TOTAL)
        .map_err(|e| format!("no service process reachable at {} ({e})", path.display()))?;
    let conn = Conn::new(stream, path.clone());
    let at = |what: &str, e: &bootstrap::wire::FrameError| {
        format!(
            "service process at {}: {what}: {}",
            path.display(),
            conn::describe(e)
        )
    };
    let mut ch = conn.channel();
    ch.send_hello(&Hello::Host(HostHello {
        credential: credential.to_string(),
        world_rank: rank,
        world_size: size,
        node: placement.node,
        local_rank: placement.local_rank,
    }))
    .map_err(|e| at("sending hello", &e))?;
    let sp = match ch
        .recv_hello()
        .map_err(|e| at("waiting for its welcome", &e))?
    {
        Hello::Welcome { sp } => sp,
        Hello::Reject { reason } => {
            return Err(format!(
                "service process at {} refused this rank: {reason}",
                path.display()
            ))
        }
        other => {
            return Err(format!(
                "service process at {} answered {other:?}",
                path.display()
            ))
        }
    };
    if sp != placement.sp {
        return Err(format!(
            "service process at {} is SP {sp}, the cluster description says SP {}",
            path.display(),
            placement.sp
        ));
    }

    let slots = mailbox_slots();
    let base = map_mailbox(slots)?;
    let mut registrar = Registrar::new();
    let mailbox = registrar.register(base as u64, slots as u64 * SLOT_BYTES, Rights::READ_WRITE);
    ch.send(&HostToSp::Register {
        cores: affinity_cores(),
        mailbox,
        mailbox_slots: slots,
    })
    .map_err(|e| at("sending registration", &e))?;
    let reply = ch
        .recv::<SpToHost>()
        .map_err(|e| at("waiting for registration", &e))?;
    let segment = match &reply {
        SpToHost::Registered { segment, .. } => segment.clone(),
        SpToHost::Error { code, message, .. } => {
            return Err(format!(
                "service process at {} refused the registration ({code:?}): {message}",
                path.display()
            ))
        }
        SpToHost::Copy { .. } | SpToHost::Completed { .. } | SpToHost::Heartbeat => {
            return Err(format!(
                "service process at {} answered the registration with {reply:?}",
                path.display()
            ))
        }
    };
    MAILBOX_SLOTS.store(slots, Ordering::Release);
    MAILBOX.store(base, Ordering::Release);
    Ok(Registered {
        conn,
        registrar,
        sp,
        node: placement.node,
        local_rank: placement.local_rank,
        node_of_sp: cluster.sps.iter().map(|e| e.node).collect(),
        segment,
    })
}

/// The shim's part of `MPI_Finalize`, before `PMPI_Finalize`: waits for requests the program
/// freed before they completed, says goodbye to the SP, and disables the shim.
///
/// # Safety
/// MPI is initialised and not yet finalised.
pub unsafe fn finish() {
    if !is_active() {
        STATE.store(State::Disabled as u8, Ordering::Release);
        return;
    }
    // SAFETY: forwarded precondition (native progress calls while waiting).
    unsafe { crate::wait::drain_detached() };
    STATE.store(State::Disabled as u8, Ordering::Release);
    if let Some(shim) = lock().take() {
        if VERBOSE.load(Ordering::Acquire) && shim.registrar.backend() == Backend::Ucx {
            say!(
                "rank {}: {}",
                topology().world_rank,
                shim.registrar.report()
            );
        }
        shim.conn.close();
        // Live requests the program never completed are leaked on purpose: the SP may still
        // write their slots, and the mailbox stays mapped.
    }
}
