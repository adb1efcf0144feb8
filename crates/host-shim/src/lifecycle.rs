//! Start-up and shutdown: the transitions of the state machine in `state.rs`.
//!
//! The start-up agreement is collective: every rank executes the same sequence of PMPI
//! collectives whatever its own environment says, so ranks with inconsistent settings end
//! disabled together instead of hanging.
//!
//! Where the rank runs comes from MPI, not from a launcher ([`place`]): its node from the
//! `SPOFF_NODE` hint or its host name (`MPI_Get_processor_name`) in the cluster description,
//! its machine from `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`, and one allgather gives every
//! rank every rank's node, from which all compute the same local ranks and SPs
//! (`bootstrap::placement`).
//!
//! Before any of that, a nonblocking barrier with a time bound ([`every_rank_runs_the_shim`])
//! makes sure every rank runs the shim at all: a rank without it (an Open MPI app context
//! without `-x LD_PRELOAD`) never makes the start-up's collectives, and a blocking one would
//! hang the whole job. If one does not, the job is aborted with a line saying why.
//!
//! What the start-up says is said once per job, by rank 0, with the number of ranks concerned
//! and the first one's reason; each rank's own reason only with `SPOFF_VERBOSE=1`.

use crate::boundary::{no_panic, say};
use crate::conn::{self, Conn};
use crate::grants::Backend;
use crate::registry::Registry;
use crate::slots::SlotPool;
use crate::state::{self, is_active, topology, Shim, State, Topology};
use algorithms::SpId;
use alias_mkey::host::Registrar;
use alias_mkey::Rights;
use bootstrap::auth::JobCredential;
use bootstrap::mailbox::{DEFAULT_SLOTS, SLOT_BYTES};
use bootstrap::placement::{self, NodeReport, NodeSource, REPORT_WORDS};
use bootstrap::post_ring::RingShape;
use bootstrap::wire::{Hello, HostHello, HostToSp, Serves, SpToHost};
use bootstrap::{Cluster, Placement};
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::fd::AsRawFd;
use std::os::raw::c_int;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// `SPOFF_VERBOSE`, for the report at `MPI_Finalize`.
static VERBOSE: AtomicBool = AtomicBool::new(false);

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
    if !state::transition(State::Uninit, State::Connecting) {
        return;
    }
    // SAFETY: forwarded precondition.
    let active = no_panic("start-up", || unsafe { start_inner() }).unwrap_or(false);
    let next = if active {
        State::Active
    } else {
        State::Disabled
    };
    state::set_state(next);
}

extern "C" fn after_fork_in_child() {
    // A forked child is not the rank the SP knows; it must never post.
    state::set_state(State::Disabled);
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
    /// The grant backends the SP serves this rank.
    serves: Serves,
    /// Why the SP runs no multicast collective (`None`: it does).
    mcast_off: Option<String>,
    /// Why the SP runs no Canary allreduce (`None`: it does).
    canary_off: Option<String>,
    /// The ring's arena (its first byte and chunks), when the SP takes sides from it.
    arena: Option<(*mut u8, u32)>,
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

    // 0. Does every rank run the shim? Only then may the start-up make blocking collectives.
    let (bound, bad) = init_timeout();
    if let Some(why) = bad.filter(|_| rank == 0) {
        say!("{why}");
    }
    // SAFETY: MPI is initialised.
    match unsafe { every_rank_runs_the_shim(world, bound) } {
        Ok(true) => {}
        Ok(false) => {
            if says_for_its_app_context(rank) {
                say!(
                    "not all of this job's {size} ranks reached the shim's start-up within {} s: \
                     is the shim preloaded in every app context? (Open MPI's -x NAME=value sets \
                     NAME for its own app context only; -x NAME passes mpirun's NAME to all); \
                     aborting the job, which cannot run natively either (see SPOFF_INIT_TIMEOUT_MS)",
                    bound.as_secs_f64()
                );
            }
            // SAFETY: MPI is initialised; aborting never returns to a caller that could use
            // the pending barrier.
            unsafe { ffi::PMPI_Abort(world, 1) };
            return false;
        }
        Err(rc) => {
            say!("rank {rank}: the shim's start-up barrier failed (MPI error {rc}); running natively");
            return false;
        }
    }

    // 1. Does every rank want offload? As a MIN reduction: [all want, none wants, none has
    // SPOFF_CLUSTER, none has SPOFF_JOB_CREDENTIAL, none turned offload off].
    let want = settings.offload && settings.cluster.is_some() && settings.credential.is_some();
    let mut wants: [c_int; 5] = [
        want as c_int,
        !want as c_int,
        settings.cluster.is_none() as c_int,
        settings.credential.is_none() as c_int,
        settings.offload as c_int,
    ];
    // SAFETY: in-place reduction over five ints in a live array.
    let rc = unsafe {
        ffi::PMPI_Allreduce(
            consts::IN_PLACE(),
            wants.as_mut_ptr().cast(),
            wants.len() as c_int,
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
        if rank == 0 {
            if !none_wants {
                say!("offload is off for this job: SPOFF_CLUSTER / SPOFF_JOB_CREDENTIAL / SPOFF_OFFLOAD are not set alike on every rank; running natively");
            } else if wants[4] == 1 {
                // Preloaded, not turned off, but unusable everywhere: the likeliest mistake.
                let missing = match (wants[2] == 1, wants[3] == 1) {
                    (true, true) => "SPOFF_CLUSTER and SPOFF_JOB_CREDENTIAL are",
                    (true, false) => "SPOFF_CLUSTER is",
                    _ => "SPOFF_JOB_CREDENTIAL is",
                };
                say!(
                    "offload is off for this job: {missing} set on none of its {size} ranks; \
                     running natively. Offload needs the cluster description (SPOFF_CLUSTER) and \
                     a job credential (SPOFF_JOB_CREDENTIAL, from `service-process credential`) on \
                     every rank: `service-process launch` sets both, under plain mpirun export \
                     them and pass each with -x NAME (SPOFF_OFFLOAD=0: natively, without this line)"
                );
            }
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

    let cluster_path = settings.cluster.clone().expect("checked by `want`");
    let cluster = Cluster::load(&cluster_path)
        .map_err(|e| format!("cannot use the cluster description: {e}"));
    // SAFETY: MPI is initialised. (Without the datatype cache's keyval, types are analysed at
    // every call.)
    unsafe { crate::datatype::create_keyval() };

    // 3. Where every rank runs, from MPI (collective: every rank makes the same calls, and
    // every rank gets the same answer, so a failure disables the job everywhere).
    // SAFETY: MPI is initialised.
    let (placed, source) = match unsafe { place(cluster.as_ref(), rank, size) } {
        Ok(p) => p,
        Err(Placing { job, local }) => {
            if let Some(why) = local.filter(|_| settings.verbose) {
                say!("rank {rank}: {why}; running natively");
            }
            if rank == 0 {
                say!("offload is off for this job: {job}; running natively");
            }
            return false;
        }
    };
    let cluster = cluster.expect("placed: every rank read the description");

    // 4. Connect and register, each rank on its own.
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
    let me = placed[rank as usize];
    // SAFETY: MPI is initialised.
    let local = match unsafe { crate::comm::create_keyval() } {
        Ok(()) => same_job.and_then(|()| register(&cluster, &credential, rank, size, me)),
        Err(rc) => Err(format!(
            "cannot create a communicator keyval (MPI error {rc})"
        )),
    };

    // 5. Agree: count the ranks that failed, and rank 0 says it for the job with the first
    // one's reason (each rank its own only when verbose: 128 ranks, one line).
    // SAFETY: MPI is initialised; every rank makes the same calls.
    let failed = unsafe { count_failures(local.as_ref().err().map(String::as_str), rank) };
    let reg = match (local, failed) {
        (Ok(reg), Ok(None)) => reg,
        (local, failed) => {
            match &local {
                Err(why) if settings.verbose => say!("rank {rank}: {why}; running natively"),
                _ => {}
            }
            if rank == 0 {
                match failed {
                    Ok(Some((n, first, why))) => say!(
                        "offload is off for this job: {n} of {size} ranks could not use their \
                         service process (rank {first}: {why}); running natively"
                    ),
                    Err(rc) => say!(
                        "offload is off for this job: the ranks could not agree (MPI error {rc}); running natively"
                    ),
                    Ok(None) => {}
                }
            }
            if let Ok(reg) = local {
                reg.conn.close();
            }
            return false;
        }
    };

    // 6. The grant backend, from what each rank's SP serves it (`serves.rs`): agreed by the
    // whole job, which runs natively if some rank has none its SP serves.
    let asked = crate::serves::asked(&settings.backend, rank);
    let at = reg.conn.path.display().to_string();
    let remote = reg.conn.remote();
    // SAFETY: MPI is initialised.
    let grants = unsafe {
        crate::serves::agree(
            asked,
            remote,
            reg.serves,
            reg.registrar,
            reg.sp,
            &at,
            rank,
            size,
            cluster.ucx_tcp_port_range,
        )
    };
    let Some(grants) = grants else {
        reg.conn.close();
        return false;
    };

    // 7. The multicast designs (`SPOFF_BCAST_DESIGN=mcast`, `SPOFF_IALLGATHER_DESIGN=mcast`):
    // each taken only if every rank asks for it and every rank's SP runs multicast; otherwise
    // the collective keeps its other design, and rank 0 says why, once.
    for (kind, asker) in crate::design::MCAST_KINDS {
        // SAFETY: MPI is initialised; every rank makes the same calls.
        unsafe { crate::design::agree_mcast(kind, asker, reg.mcast_off.as_deref(), rank, size) };
    }
    // 8. The Canary allreduce (`SPOFF_ALLREDUCE_DESIGN=canary` or `auto`), likewise: else the
    // SP tree.
    // SAFETY: MPI is initialised; every rank makes the same calls.
    unsafe { crate::reduce::agree_canary(reg.canary_off.as_deref(), rank, size) };
    // 9. The arena, where the SP takes sides from it and this rank grants through `cma`
    // (the only backend whose grants the SP reaches through its mapping): a choice of this
    // rank alone, which changes no other rank's calls.
    if let (Some((base, chunks)), Backend::Cma) = (reg.arena, grants.backend()) {
        crate::arena::open(base, chunks);
    }

    // Who serves whom: the placement every rank computed alike.
    let sp_of_world: Vec<SpId> = placed.iter().map(|p| p.sp).collect();
    state::set_topology(Topology {
        world_rank: rank,
        world_size: size,
        sp_of_world,
        node_of_sp: reg.node_of_sp.clone(),
        segment: reg.segment.clone(),
        remote: reg.conn.remote(),
    });
    if settings.verbose {
        say!(
            "rank {rank}: offload active: job {job:#x}, node {}, local rank {}, SP {} at {}, {} mailbox slots, placed by {}",
            reg.node,
            reg.local_rank,
            reg.sp,
            reg.conn.path.display(),
            state::mailbox_slot_count(),
            match source {
                NodeSource::Hint => "SPOFF_NODE".to_string(),
                NodeSource::HostName => format!(
                    "host name {}",
                    cluster.hosts.get(reg.node as usize).map_or("?", String::as_str)
                ),
                NodeSource::Layout => "the description's layout".to_string(),
            }
        );
    }
    if settings.verbose && grants.backend() == Backend::Ucx {
        say!(
            "rank {rank}: ucx grants, memory events {}",
            if grants.events() { "on" } else { "off" }
        );
    }
    VERBOSE.store(settings.verbose, Ordering::Release);
    state::install(Shim {
        conn: reg.conn,
        slots: SlotPool::new(state::mailbox_slot_count()),
        registrar: grants,
        registry: Registry::default(),
        next_token: 1,
        last_notice_ns: 0,
    });
    // SAFETY: registering a plain extern "C" fn with no captured state.
    unsafe {
        libc::pthread_atfork(None, None, Some(after_fork_in_child));
    }
    true
}

/// Why a job has no placement.
struct Placing {
    /// The job's reason, the same on every rank (rank 0 says it).
    job: String,
    /// This rank's own reason, when it could not tell its node (said only when verbose).
    local: Option<String>,
}

impl Placing {
    fn job(why: String) -> Placing {
        Placing {
            job: why,
            local: None,
        }
    }
}

/// Default of `SPOFF_INIT_TIMEOUT_MS`.
const INIT_TIMEOUT_MS: u64 = 10_000;

/// `SPOFF_INIT_TIMEOUT_MS` (clamped to 100 ms ..= 10 min), the bound of
/// [`every_rank_runs_the_shim`]; with what to say about a value that is not a number.
fn init_timeout() -> (Duration, Option<String>) {
    let Some(v) = std::env::var_os("SPOFF_INIT_TIMEOUT_MS").filter(|v| !v.is_empty()) else {
        return (Duration::from_millis(INIT_TIMEOUT_MS), None);
    };
    match v.to_str().and_then(|v| v.trim().parse::<u64>().ok()) {
        Some(ms) => (Duration::from_millis(ms.clamp(100, 600_000)), None),
        None => (
            Duration::from_millis(INIT_TIMEOUT_MS),
            Some(format!(
                "SPOFF_INIT_TIMEOUT_MS={} is not a number of milliseconds; using {INIT_TIMEOUT_MS}",
                v.to_string_lossy()
            )),
        ),
    }
}

/// Whether every rank of `world` runs the shim, without hanging when some do not: a
/// nonblocking barrier that only ranks with the shim post, polled until `bound`.
///
/// A rank without the shim (an app context not preloaded) never calls into it, and a blocking
/// PMPI collective made only by the shim's ranks would wait forever (their peers are already
/// in the program's own collectives). `MPI_Ibarrier` completes only once every rank posted it;
/// `MPI_Init` returns on every rank at nearly the same time (Open MPI and MPICH end it with
/// a barrier of the launcher's), so in a job where every rank has the shim it completes
/// within milliseconds, and not completing within the bound means a rank is missing.
///
/// The job cannot go on natively then: the barrier stays pending (a collective request cannot
/// be cancelled) and has taken the first nonblocking-collective tag of `MPI_COMM_WORLD` on the
/// shim's ranks only, so the program's first nonblocking collective there (or a communicator
/// creation, which Open MPI agrees on with one) would be matched against it and hang. The
/// caller aborts the job instead, having said why.
///
/// # Safety
/// MPI is initialised and this is the thread that initialised it.
unsafe fn every_rank_runs_the_shim(world: ffi::MPI_Comm, bound: Duration) -> Result<bool, c_int> {
    let mut req = consts::REQUEST_NULL();
    // SAFETY: a live request out-pointer.
    let rc = unsafe { ffi::PMPI_Ibarrier(world, &mut req) };
    if rc != consts::SUCCESS() {
        return Err(rc);
    }
    let start = Instant::now();
    let mut polls: u32 = 0;
    loop {
        let mut done: c_int = 0;
        // SAFETY: the live request of the barrier above.
        let rc = unsafe { ffi::PMPI_Test(&mut req, &mut done, consts::STATUS_IGNORE()) };
        if rc != consts::SUCCESS() {
            return Err(rc);
        }
        if done != 0 {
            return Ok(true);
        }
        if start.elapsed() >= bound {
            return Ok(false);
        }
        polls = polls.saturating_add(1);
        if polls < 1000 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Whether this rank speaks for its app context when not every rank runs the shim (nothing
/// collective can choose one rank then): the first rank of its app context where the launcher
/// says which that is (Open MPI: `OMPI_MCA_orte_app_num`, `OMPI_APP_CTX_NUM_PROCS`), else
/// every rank (Hydra tells a rank nothing of the other app contexts).
fn says_for_its_app_context(rank: u32) -> bool {
    let app = std::env::var("OMPI_MCA_orte_app_num")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok());
    let sizes: Option<Vec<u32>> = std::env::var("OMPI_APP_CTX_NUM_PROCS").ok().and_then(|v| {
        v.split_whitespace()
            .map(|n| n.parse::<u32>().ok())
            .collect()
    });
    match (app, sizes) {
        (Some(app), Some(sizes)) if app < sizes.len() => {
            rank == sizes[..app].iter().fold(0u32, |a, &n| a.saturating_add(n))
        }
        _ => true,
    }
}

/// Longest reason sent to rank 0 for the job's line, in bytes.
const REASON_BYTES: usize = 1024;

/// `first`'s reason (`mine` on that rank), broadcast from it: every rank gets it.
/// Collective: every rank calls it with the same `first`.
///
/// # Safety
/// MPI is initialised.
unsafe fn reason_of(first: u32, mine: Option<&str>) -> Result<String, c_int> {
    let mut buf = [0u8; REASON_BYTES];
    if let Some(why) = mine {
        // Cut on a character boundary: the bytes must stay UTF-8.
        let mut end = why.len().min(REASON_BYTES);
        while !why.is_char_boundary(end) {
            end -= 1;
        }
        buf[..end].copy_from_slice(&why.as_bytes()[..end]);
    }
    // SAFETY: broadcast of REASON_BYTES bytes in a live array.
    let rc = unsafe {
        ffi::PMPI_Bcast(
            buf.as_mut_ptr().cast(),
            REASON_BYTES as c_int,
            consts::BYTE(),
            first as c_int,
            consts::COMM_WORLD(),
        )
    };
    if rc != consts::SUCCESS() {
        return Err(rc);
    }
    let len = buf.iter().position(|&b| b == 0).unwrap_or(REASON_BYTES);
    Ok(String::from_utf8_lossy(&buf[..len]).into_owned())
}

/// How many ranks failed (`mine`: this rank's reason, if it did), the first of them and its
/// reason, the same on every rank; `None` when none did. Collective.
///
/// # Safety
/// MPI is initialised.
pub(crate) unsafe fn count_failures(
    mine: Option<&str>,
    rank: u32,
) -> Result<Option<(u32, u32, String)>, c_int> {
    let world = consts::COMM_WORLD();
    let mut failed: c_int = mine.is_some() as c_int;
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
    if rc != consts::SUCCESS() {
        return Err(rc);
    }
    if failed == 0 {
        return Ok(None);
    }
    // As a C int (a rank is one): MPICH 4.0's MPI_MIN over MPI_UINT32_T compares as signed, so
    // a u32::MAX "none" sentinel came out as the minimum.
    let mut first: c_int = if mine.is_some() {
        rank as c_int
    } else {
        c_int::MAX
    };
    // SAFETY: in-place reduction over one int.
    let rc = unsafe {
        ffi::PMPI_Allreduce(
            consts::IN_PLACE(),
            (&mut first as *mut c_int).cast(),
            1,
            consts::INT(),
            consts::OP_MIN(),
            world,
        )
    };
    if rc != consts::SUCCESS() {
        return Err(rc);
    }
    let first = first as u32;
    // SAFETY: forwarded precondition; every rank has the same `first`.
    let why = unsafe { reason_of(first, mine.filter(|_| first == rank)) }?;
    Ok(Some((failed as u32, first, why)))
}

/// This rank's node, as it can tell on its own: the `SPOFF_NODE` hint, else its host name
/// against the description's hosts, else (an emulated description without host names) the
/// description's layout.
fn own_node(cluster: &Cluster, rank: u32, size: u32) -> (Result<u32, String>, NodeSource) {
    if let Some(hint) = std::env::var("SPOFF_NODE").ok().filter(|v| !v.is_empty()) {
        return (placement::node_of_hint(cluster, &hint), NodeSource::Hint);
    }
    if !cluster.hosts.is_empty() {
        let name = processor_name();
        return (
            name.and_then(|n| placement::node_of_host(cluster, &n)),
            NodeSource::HostName,
        );
    }
    let node = if cluster.nodes == 1 {
        Ok(0)
    } else {
        cluster.placement(rank, size).map(|p| p.node).map_err(|e| {
            format!(
                "{e} (the description names no hosts: give each rank SPOFF_NODE, or list the \
                 nodes' host names)"
            )
        })
    };
    (node, NodeSource::Layout)
}

/// `MPI_Get_processor_name`.
fn processor_name() -> Result<String, String> {
    // Longer than MPI_MAX_PROCESSOR_NAME of Open MPI (256) and MPICH (128).
    let mut buf = vec![0u8; 4096];
    let mut len: c_int = 0;
    // SAFETY: the buffer is longer than any implementation's MPI_MAX_PROCESSOR_NAME.
    let rc = unsafe { ffi::PMPI_Get_processor_name(buf.as_mut_ptr().cast(), &mut len) };
    if rc != consts::SUCCESS() || len <= 0 {
        return Err(format!("MPI_Get_processor_name failed (MPI error {rc})"));
    }
    buf.truncate(len.clamp(0, 4096) as usize);
    Ok(String::from_utf8_lossy(&buf).trim().to_string())
}

/// Places every rank of the job (see `bootstrap::placement`): each rank finds its node on its
/// own, learns its machine (the lowest world rank of its `MPI_COMM_TYPE_SHARED` group), and
/// one allgather gives every rank every report. Collective: the same MPI calls on every rank
/// whatever it found.
///
/// # Safety
/// MPI is initialised.
unsafe fn place(
    cluster: Result<&Cluster, &String>,
    rank: u32,
    size: u32,
) -> Result<(Vec<Placement>, NodeSource), Placing> {
    let world = consts::COMM_WORLD();
    let (node, source) = match cluster {
        Ok(c) => own_node(c, rank, size),
        Err(why) => (Err(why.clone()), NodeSource::Layout),
    };
    // The machine: the lowest world rank sharing memory with this one.
    let mut info: ffi::MPI_Info = unsafe { std::mem::zeroed() };
    let mut shm: ffi::MPI_Comm = consts::COMM_NULL();
    let mut machine: u32 = rank;
    // SAFETY: live out-pointers; the info and the communicator are freed below.
    let rc = unsafe {
        let mut rc = ffi::PMPI_Info_create(&mut info);
        if rc == consts::SUCCESS() {
            rc = ffi::PMPI_Comm_split_type(
                world,
                consts::COMM_TYPE_SHARED(),
                rank as c_int,
                info,
                &mut shm,
            );
            ffi::PMPI_Info_free(&mut info);
        }
        if rc == consts::SUCCESS() {
            rc = ffi::PMPI_Allreduce(
                consts::IN_PLACE(),
                (&mut machine as *mut u32).cast(),
                1,
                consts::UINT32_T(),
                consts::OP_MIN(),
                shm,
            );
            ffi::PMPI_Comm_free(&mut shm);
        }
        rc
    };
    if rc != consts::SUCCESS() {
        return Err(Placing::job(format!(
            "cannot learn which ranks share a machine (MPI error {rc})"
        )));
    }
    let mine = NodeReport {
        node: node.as_ref().ok().copied(),
        machine,
        source,
        // For the check that a layout places ranks of one host only.
        host: processor_name().map_or(0, |n| placement::host_hash(&n)),
    }
    .encode();
    let mut all: Vec<u32> = vec![0; size as usize * REPORT_WORDS];
    // SAFETY: gathers REPORT_WORDS u32 per rank into a buffer of world size x REPORT_WORDS.
    let rc = unsafe {
        ffi::PMPI_Allgather(
            mine.as_ptr().cast(),
            REPORT_WORDS as c_int,
            consts::UINT32_T(),
            all.as_mut_ptr().cast(),
            REPORT_WORDS as c_int,
            consts::UINT32_T(),
            world,
        )
    };
    if rc != consts::SUCCESS() {
        return Err(Placing::job(format!(
            "cannot gather where the ranks run (MPI error {rc})"
        )));
    }
    let reports: Vec<NodeReport> = all
        .chunks_exact(REPORT_WORDS)
        .map(|w| NodeReport::decode(w.try_into().expect("REPORT_WORDS words")))
        .collect();
    // Ranks that could not tell their node: every rank sees the same ones in the reports, and
    // the first one's reason goes to all (collective, same root everywhere).
    let lost: Vec<usize> = (0..reports.len())
        .filter(|&r| reports[r].node.is_none())
        .collect();
    if let Some(&first) = lost.first() {
        let mine = node.as_ref().err().map(String::as_str);
        // SAFETY: MPI is initialised.
        let why = unsafe { reason_of(first as u32, mine.filter(|_| first == rank as usize)) }
            .unwrap_or_else(|rc| format!("its reason was lost (MPI error {rc})"));
        return Err(Placing {
            job: format!(
                "{} of {size} ranks could not tell their node (rank {first}: {why})",
                lost.len()
            ),
            local: node.err(),
        });
    }
    let cluster = cluster.expect("a node was found in it");
    placement::place_ranks(cluster, &reports)
        .map(|p| (p, source))
        .map_err(Placing::job)
}

/// Most mailbox slots accepted from `SPOFF_MAILBOX_SLOTS`.
const MAX_MAILBOX_SLOTS: u32 = bootstrap::mailbox::MAX_SLOTS;

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

/// Connects to the SP of this rank's placement and registers. Errors are one-line reasons.
fn register(
    cluster: &Cluster,
    credential: &str,
    rank: u32,
    size: u32,
    placement: Placement,
) -> Result<Registered, String> {
    let entry = cluster
        .sp(placement.sp)
        .ok_or_else(|| format!("the cluster description has no SP {}", placement.sp))?;
    let transport = std::env::var("SPOFF_HOST_TRANSPORT").ok();
    let target = conn::target(entry, transport.as_deref())?;
    let stream = conn::connect(&target, conn::CONNECT_TOTAL)
        .map_err(|e| format!("no service process reachable at {target} ({e})"))?;
    let conn = Conn::new(stream, &target);
    let path = conn.path.clone();
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
        pid: std::process::id(),
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

    // An SP that cannot attach to this process gets no mailbox: completions come as messages.
    let slots = if conn.remote() { 0 } else { mailbox_slots() };
    // A post ring where the SP shares this kernel and the socket can pass it (Unix), with the
    // mailbox in the same memory: an SP that maps the ring writes completions there with
    // plain stores; one that does not still reaches the mailbox through its grant (`cma`).
    let mut ring = None;
    if crate::post_ring::wanted() && !conn.remote() && conn.unix_fd().is_some() {
        let shape = RingShape {
            mailbox_slots: slots,
            arena_chunks: if crate::arena::wanted() {
                bootstrap::post_ring::DEFAULT_ARENA_CHUNKS
            } else {
                0
            },
            ..RingShape::default()
        };
        match crate::post_ring::ShimRing::create(shape) {
            Ok(r) => ring = Some(r),
            Err(why) if VERBOSE.load(Ordering::Acquire) => {
                say!("rank {rank}: no post ring ({why}); posts go on the socket")
            }
            Err(_) => {}
        }
    }
    let base = match ring.as_ref() {
        Some(r) if slots > 0 => r.mailbox(),
        _ => map_mailbox(slots.max(1))?,
    };
    let mut registrar = Registrar::new();
    let bytes = slots.max(1) as u64 * SLOT_BYTES;
    let mailbox = registrar.register(base as u64, bytes, Rights::READ_WRITE);
    let register = HostToSp::Register {
        // The rank's cores (its affinity mask).
        cores: bootstrap::cpus::allowed(),
        mailbox,
        mailbox_slots: slots,
        post_ring: ring.as_ref().map(|r| r.shape),
    };
    match (&ring, conn.unix_fd()) {
        (Some(r), Some(sock)) => crate::post_ring::send_with_fd(
            sock,
            &bootstrap::wire::encode(&register),
            r.fd.as_raw_fd(),
        )
        .map_err(|e| at("sending registration", &e.into()))?,
        _ => ch
            .send(&register)
            .map_err(|e| at("sending registration", &e))?,
    }
    let reply = ch
        .recv::<SpToHost>()
        .map_err(|e| at("waiting for registration", &e))?;
    let (segment, serves, mcast_off, canary_off, arena_off) = match &reply {
        SpToHost::Registered {
            segment,
            serves,
            mcast_off,
            canary_off,
            post_ring_off,
            arena_off,
            ..
        } => {
            match (ring.take(), post_ring_off) {
                (Some(r), None) => ring = Some(r),
                (Some(_), Some(why)) if VERBOSE.load(Ordering::Acquire) => {
                    say!("rank {rank}: the SP reads no post ring ({why}); posts go on the socket")
                }
                _ => {}
            }
            (
                segment.clone(),
                *serves,
                mcast_off.clone(),
                canary_off.clone(),
                arena_off.clone(),
            )
        }
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
    state::set_mailbox(base, slots);
    let arena = match (ring.as_ref(), &arena_off) {
        (Some(r), None) => r.arena().map(|a| (a, r.shape.arena_chunks)),
        (Some(r), Some(why)) if r.arena().is_some() && VERBOSE.load(Ordering::Acquire) => {
            say!("rank {rank}: the SP takes no side from the arena ({why})");
            None
        }
        _ => None,
    };
    let mut conn = conn;
    conn.set_ring(ring);
    Ok(Registered {
        conn,
        registrar,
        sp,
        node: placement.node,
        local_rank: placement.local_rank,
        node_of_sp: cluster.sps.iter().map(|e| e.node).collect(),
        segment,
        serves,
        mcast_off,
        canary_off,
        arena,
    })
}

/// The shim's part of `MPI_Finalize`, before `PMPI_Finalize`: waits for requests the program
/// freed before they completed, says goodbye to the SP, and disables the shim.
///
/// # Safety
/// MPI is initialised and not yet finalised.
pub unsafe fn finish() {
    if !is_active() {
        state::set_state(State::Disabled);
        return;
    }
    // SAFETY: forwarded precondition (native progress calls while waiting).
    unsafe { crate::wait::drain_detached() };
    state::set_state(State::Disabled);
    if let Some(shim) = state::take() {
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
