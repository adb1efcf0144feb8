//! Offloading `MPI_Alltoallv` / `MPI_Alltoall` and `MPI_Allgatherv` / `MPI_Allgather`
//! (blocking and nonblocking).
//!
//! A call is offloaded when the shim is active, the communicator is an intracommunicator,
//! neither buffer is `MPI_IN_PLACE`, and both datatypes are contiguous (`layout.rs`); otherwise
//! the caller runs the native function unchanged. These conditions are the same on every rank
//! of a correct program, so every member takes the same path. (A program whose ranks describe
//! the same data with a contiguous type on one rank and, say, a vector type on another would
//! split; that case is documented as unsupported.)
//!
//! Posting: the communicator's id is agreed at its first offloaded use (`comm.rs`), a mailbox
//! slot is reserved (harvesting completed requests if none is free), the slot's token word is
//! zeroed, the buffers are granted (send READ, receive WRITE, or READ_WRITE for an
//! allgatherv; each the smallest region covering its peers' bytes) and the descriptor goes to
//! the SP. Once the communicator agreement has run the call is committed: the other members
//! offload it too, so a failure from then on (a dead SP connection, every mailbox slot
//! quarantined) is `MPI_ERR_OTHER` with a line on stderr, raised through the communicator's
//! error handler (`boundary::raise`: under the default `MPI_ERRORS_ARE_FATAL` the job aborts,
//! as a native failure would), never turned into a native call that the other members would
//! not match.
//!
//! An allgather(v) is posted as `CollKind::Allgatherv`: the send side is the one block of
//! `sendcount` elements (its grant starts exactly at the block, so its displacement is 0), the
//! receive side has a block per comm rank, and the descriptor carries the node of each comm
//! rank (its SP's node in the cluster description) for the hierarchical algorithm. An
//! `MPI_Allgather` is the allgatherv with `recvcount` per rank at displacement `i * recvcount`.

use crate::boundary::{say, Commit};
use crate::comm;
use crate::layout::{alltoall_as_v, region_addr, side_bytes, TypeGeometry};
use crate::request::OffloadRequest;
use crate::state::{is_active, mailbox_token, topology, with_shim, TRACKED};
use crate::wait::Waiter;
use alias_mkey::Rights;
use bootstrap::wire::{CollKind, HostToSp, PostDesc, Staged, StagedDesign};
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicU32, Ordering};

/// Post failures reported on stderr before going quiet.
const REPORTED_POST_FAILURES: u32 = 3;
static POST_FAILURES: AtomicU32 = AtomicU32::new(0);

/// What became of a call.
pub enum Offload {
    /// Not offloaded: run the native function.
    Native,
    /// Posted: the request object's address.
    Posted(usize),
    /// Offloaded but could not be posted: return this code.
    Failed(c_int),
}

/// One side of the exchange as the program gave it.
struct Side {
    buf: u64,
    counts: Vec<i64>,
    displs: Vec<i64>,
    ty: TypeGeometry,
}

impl Side {
    fn new(buf: *const c_void, (counts, displs): (Vec<i64>, Vec<i64>), ty: TypeGeometry) -> Side {
        Side {
            buf: buf as u64,
            counts,
            displs,
            ty,
        }
    }
}

unsafe fn geometry(ty: ffi::MPI_Datatype) -> Option<TypeGeometry> {
    let mut size: c_int = 0;
    let (mut lb, mut extent, mut true_lb, mut true_extent): (
        ffi::MPI_Aint,
        ffi::MPI_Aint,
        ffi::MPI_Aint,
        ffi::MPI_Aint,
    ) = (0, 0, 0, 0);
    let ok = consts::SUCCESS();
    // SAFETY: valid out-pointers; an invalid datatype is reported by an error code.
    unsafe {
        if ffi::PMPI_Type_size(ty, &mut size) != ok
            || ffi::PMPI_Type_get_extent(ty, &mut lb, &mut extent) != ok
            || ffi::PMPI_Type_get_true_extent(ty, &mut true_lb, &mut true_extent) != ok
        {
            return None;
        }
    }
    Some(TypeGeometry {
        size: size as i64,
        lb: lb as i64,
        extent: extent as i64,
        true_lb: true_lb as i64,
        true_extent: true_extent as i64,
    })
}

/// The checks every entry point shares; the communicator size and both type geometries when
/// the call may be offloaded.
unsafe fn eligible(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendtype: ffi::MPI_Datatype,
    recvtype: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
) -> Option<(usize, TypeGeometry, TypeGeometry)> {
    if !is_active() {
        return None;
    }
    let in_place = consts::IN_PLACE();
    if std::ptr::eq(sendbuf, in_place) || recvbuf == in_place || comm == consts::COMM_NULL() {
        return None;
    }
    let (mut inter, mut size): (c_int, c_int) = (0, 0);
    // SAFETY: valid out-pointers; an invalid communicator is reported by an error code.
    unsafe {
        if ffi::PMPI_Comm_test_inter(comm, &mut inter) != consts::SUCCESS() || inter != 0 {
            return None;
        }
        if ffi::PMPI_Comm_size(comm, &mut size) != consts::SUCCESS() || size <= 0 {
            return None;
        }
    }
    // SAFETY: forwarded.
    let (st, rt) = unsafe { (geometry(sendtype)?, geometry(recvtype)?) };
    (st.is_contiguous() && rt.is_contiguous()).then_some((size as usize, st, rt))
}

/// Copies `n` ints from a caller's array; `None` for a null array.
unsafe fn read_ints(p: *const c_int, n: usize) -> Option<Vec<i64>> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller's array of one entry per peer (MPI precondition).
    Some(
        unsafe { std::slice::from_raw_parts(p, n) }
            .iter()
            .map(|&v| v as i64)
            .collect(),
    )
}

/// # Safety
/// Arguments as for `MPI_Alltoallv`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn alltoallv(
    sendbuf: *const c_void,
    sendcounts: *const c_int,
    sdispls: *const c_int,
    sendtype: ffi::MPI_Datatype,
    recvbuf: *mut c_void,
    recvcounts: *const c_int,
    rdispls: *const c_int,
    recvtype: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
    commit: &mut Commit,
) -> Offload {
    // SAFETY: forwarded.
    let Some((n, st, rt)) = (unsafe { eligible(sendbuf, recvbuf, sendtype, recvtype, comm) })
    else {
        return Offload::Native;
    };
    // SAFETY: forwarded.
    let arrays = unsafe {
        (
            read_ints(sendcounts, n),
            read_ints(sdispls, n),
            read_ints(recvcounts, n),
            read_ints(rdispls, n),
        )
    };
    let (Some(sc), Some(sd), Some(rc), Some(rd)) = arrays else {
        return Offload::Native;
    };
    let send = Side::new(sendbuf, (sc, sd), st);
    let recv = Side::new(recvbuf, (rc, rd), rt);
    // SAFETY: forwarded.
    unsafe { post(CollKind::Alltoallv, comm, send, recv, false, None, commit) }
}

/// # Safety
/// Arguments as for `MPI_Alltoall`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn alltoall(
    sendbuf: *const c_void,
    sendcount: c_int,
    sendtype: ffi::MPI_Datatype,
    recvbuf: *mut c_void,
    recvcount: c_int,
    recvtype: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
    commit: &mut Commit,
) -> Offload {
    // SAFETY: forwarded.
    let Some((n, st, rt)) = (unsafe { eligible(sendbuf, recvbuf, sendtype, recvtype, comm) })
    else {
        return Offload::Native;
    };
    let send = Side::new(sendbuf, alltoall_as_v(n, sendcount as i64), st);
    let recv = Side::new(recvbuf, alltoall_as_v(n, recvcount as i64), rt);
    // SAFETY: forwarded.
    unsafe { post(CollKind::Alltoallv, comm, send, recv, false, None, commit) }
}

/// # Safety
/// Arguments as for `MPI_Allgatherv`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn allgatherv(
    sendbuf: *const c_void,
    sendcount: c_int,
    sendtype: ffi::MPI_Datatype,
    recvbuf: *mut c_void,
    recvcounts: *const c_int,
    displs: *const c_int,
    recvtype: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
    blocking: bool,
    commit: &mut Commit,
) -> Offload {
    // SAFETY: forwarded.
    let Some((n, st, rt)) = (unsafe { eligible(sendbuf, recvbuf, sendtype, recvtype, comm) })
    else {
        return Offload::Native;
    };
    // SAFETY: forwarded.
    let (Some(rc), Some(rd)) = (unsafe { (read_ints(recvcounts, n), read_ints(displs, n)) }) else {
        return Offload::Native;
    };
    let send = Side::new(sendbuf, (vec![sendcount as i64], vec![0]), st);
    let recv = Side::new(recvbuf, (rc, rd), rt);
    // SAFETY: forwarded.
    unsafe {
        post(
            CollKind::Allgatherv,
            comm,
            send,
            recv,
            blocking,
            None,
            commit,
        )
    }
}

/// # Safety
/// Arguments as for `MPI_Allgather`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn allgather(
    sendbuf: *const c_void,
    sendcount: c_int,
    sendtype: ffi::MPI_Datatype,
    recvbuf: *mut c_void,
    recvcount: c_int,
    recvtype: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
    blocking: bool,
    commit: &mut Commit,
) -> Offload {
    // SAFETY: forwarded.
    let Some((n, st, rt)) = (unsafe { eligible(sendbuf, recvbuf, sendtype, recvtype, comm) })
    else {
        return Offload::Native;
    };
    let send = Side::new(sendbuf, (vec![sendcount as i64], vec![0]), st);
    // Block `i` at displacement `i * recvcount`: the alltoall layout of one side.
    let recv = Side::new(recvbuf, alltoall_as_v(n, recvcount as i64), rt);
    // The staged designs (issue 4) when asked for; `root` is unused by them.
    let (kind, root) = if !blocking && iallgather_staged() {
        (CollKind::StagedAllgather, Some(0))
    } else {
        (CollKind::Allgatherv, None)
    };
    // SAFETY: forwarded.
    unsafe { post(kind, comm, send, recv, blocking, root, commit) }
}

/// # Safety
/// Arguments as for `MPI_Bcast`.
pub unsafe fn bcast(
    buffer: *mut c_void,
    count: c_int,
    ty: ffi::MPI_Datatype,
    root: c_int,
    comm: ffi::MPI_Comm,
    blocking: bool,
    commit: &mut Commit,
) -> Offload {
    // SAFETY: forwarded.
    let Some((n, t, _)) = (unsafe { eligible(buffer, buffer, ty, ty, comm) }) else {
        return Offload::Native;
    };
    if root < 0 || root as usize >= n || count < 0 {
        // Native MPI reports the bad root or count.
        return Offload::Native;
    }
    let mut rank: c_int = 0;
    // SAFETY: a valid intracommunicator (checked by `eligible`) and out-pointer.
    if unsafe { ffi::PMPI_Comm_rank(comm, &mut rank) } != consts::SUCCESS() {
        return Offload::Native;
    }
    let data = Side::new(buffer, (vec![count as i64], vec![0]), t);
    let empty = Side::new(buffer, (vec![0], vec![0]), t);
    let (send, recv) = if rank == root {
        (data, empty)
    } else {
        (empty, data)
    };
    // SAFETY: forwarded.
    unsafe {
        post(
            CollKind::Bcast,
            comm,
            send,
            recv,
            blocking,
            Some(root as u32),
            commit,
        )
    }
}

/// The design of a staged collective of `kind` moving `len` bytes to each rank, on a
/// communicator whose members are on the emulated nodes `nodes`. A message larger than the
/// segment part (`SPOFF_SEGMENT_BYTES`) is always `Flat`; otherwise `SPOFF_BCAST_DESIGN` (a
/// bcast) or `SPOFF_IALLGATHER_DESIGN` (a staged iallgather) `=flat|hier` forces one, and
/// `auto` picks `Hier` when some node has at least `SPOFF_HIER_MIN_RANKS` (default
/// [`hier_min_ranks`]) of the members (the hierarchical designs write once per node). The
/// nodes and the length are the same on every rank (and so, in a correct job, is the
/// environment), so every rank decides alike. The variables are read once, at the first
/// `MPI_Ibcast`/`MPI_Bcast` or `MPI_Iallgather` (a post is on the host's critical path).
fn staged_design(kind: CollKind, max_per_node: usize, len: u64) -> StagedDesign {
    let env = staged_env();
    let forced = match kind {
        CollKind::StagedAllgather => env.iallgather.as_deref(),
        _ => env.bcast.as_deref(),
    };
    let min = env.min_ranks.unwrap_or_else(|| hier_min_ranks(kind));
    choose_design(forced, min, max_per_node, len, env.part)
}

/// The environment of the staged designs, as read at first use.
struct StagedEnv {
    /// `SPOFF_BCAST_DESIGN`, `SPOFF_IALLGATHER_DESIGN`, trimmed.
    bcast: Option<String>,
    iallgather: Option<String>,
    /// `SPOFF_HIER_MIN_RANKS`, if set to a number.
    min_ranks: Option<usize>,
    /// The segment part (`SPOFF_SEGMENT_BYTES`).
    part: u64,
}

fn staged_env() -> &'static StagedEnv {
    static ENV: std::sync::OnceLock<StagedEnv> = std::sync::OnceLock::new();
    ENV.get_or_init(|| {
        let var = |k: &str| std::env::var(k).ok().map(|v| v.trim().to_owned());
        StagedEnv {
            bcast: var("SPOFF_BCAST_DESIGN"),
            iallgather: var("SPOFF_IALLGATHER_DESIGN"),
            min_ranks: var("SPOFF_HIER_MIN_RANKS").and_then(|v| v.parse().ok()),
            part: crate::segment::configured_len(),
        }
    })
}

/// [`staged_design`] once the environment is read: `forced` the design variable, `min` the
/// threshold, `max_per_node` the most members on one node, `part` the segment part.
fn choose_design(
    forced: Option<&str>,
    min: usize,
    max_per_node: usize,
    len: u64,
    part: u64,
) -> StagedDesign {
    if len > part {
        return StagedDesign::Flat;
    }
    match forced.map(str::trim) {
        Some("flat") => return StagedDesign::Flat,
        Some("hier") => return StagedDesign::Hier,
        _ => {}
    }
    if max_per_node >= min {
        StagedDesign::Hier
    } else {
        StagedDesign::Flat
    }
}

/// Ranks per node from which `auto` picks the hierarchical design, per collective (the reasons
/// are in docs/BENCHMARKS.md, section G and its notes): measured here, flat mostly costs less
/// at 1, 2 and 4 ranks per node for both collectives (the hierarchical ranks copy the message
/// out themselves in the wait); in the simulator at 32 nodes with 1 SP per node the
/// hierarchical Iallgather wins clearly from 8 ranks per node (its flat design writes every
/// block into every rank), the hierarchical Ibcast only from 32.
pub fn hier_min_ranks(kind: CollKind) -> usize {
    match kind {
        CollKind::StagedAllgather => 8,
        _ => 32,
    }
}

/// `MPI_Iallgather` takes the staged designs when `SPOFF_IALLGATHER_DESIGN` is `flat`, `hier`
/// or `auto` (the staged pair chosen by ranks per node); unset or `lb`, it takes the
/// load-balanced hierarchical allgather (issue 3's), as every other allgather does.
fn iallgather_staged() -> bool {
    matches!(
        staged_env().iallgather.as_deref(),
        Some("flat" | "hier" | "auto")
    )
}

/// A free mailbox slot, harvesting completions (and waiting) while none is free. The wait is
/// bounded: each pass reads the SP connection (a dead SP fails it), and once every slot is
/// quarantined (refused posts whose slots the SP might still write) it fails at once.
fn reserve_slot() -> Result<u32, String> {
    let mut waiter: Option<Waiter> = None;
    loop {
        let got = with_shim(|s| {
            if let Some(why) = &s.conn.broken {
                return Err(why.clone());
            }
            if let Some(slot) = s.slots.take() {
                return Ok(Some(slot));
            }
            s.harvest();
            s.service_connection();
            if let Some(why) = &s.conn.broken {
                return Err(why.clone());
            }
            match s.slots.take() {
                None if s.slots.exhausted() => Err(format!(
                    "all {} mailbox slots are quarantined after refused posts (raise \
                     SPOFF_MAILBOX_SLOTS); no further collective can be offloaded",
                    s.slots.quarantined()
                )),
                slot => Ok(slot),
            }
        })
        .unwrap_or_else(|| Err("the shim is shut down".into()))?;
        if let Some(slot) = got {
            return Ok(slot);
        }
        // Every slot belongs to a running collective; they complete without our help.
        // SAFETY: MPI is initialised while the shim is active.
        unsafe { waiter.get_or_insert_with(Waiter::new).idle(true) };
    }
}

/// Posts one collective of `kind`: `send` has a block per comm rank for an alltoallv, the one
/// block of this rank (at displacement 0) for an allgatherv or a bcast's root. `blocking`: the
/// caller waits for the request inside the call, so in an allgatherv it can copy the segments
/// already on its node itself (unless `SPOFF_HOST_COPIES=0`), sparing the SP that work. `root`:
/// the root of a staged collective (a bcast).
unsafe fn post(
    kind: CollKind,
    comm: ffi::MPI_Comm,
    send: Side,
    recv: Side,
    blocking: bool,
    root: Option<u32>,
    commit: &mut Commit,
) -> Offload {
    let (Ok(s), Ok(r)) = (
        side_bytes(&send.counts, &send.displs, &send.ty),
        side_bytes(&recv.counts, &recv.displs, &recv.ty),
    ) else {
        // Negative counts and the like: native MPI reports them.
        return Offload::Native;
    };
    let (Some(send_addr), Some(recv_addr)) = (
        region_addr(send.buf, s.region_offset, s.region_len),
        region_addr(recv.buf, r.region_offset, r.region_len),
    ) else {
        return Offload::Native;
    };
    // SAFETY: active shim, valid intracommunicator (checked by `eligible`).
    let info = match unsafe { comm::info(comm) } {
        // SAFETY: the info lives as long as `comm`, which outlives this call.
        Ok(p) => unsafe { &*p },
        Err(_) => return Offload::Native,
    };
    // Every member has now agreed on the communicator and offloads this call.
    commit.mark();
    let rank = topology().world_rank;
    let seq = info.next_seq.fetch_add(1, Ordering::AcqRel);
    let fail = |why: &str| {
        // A dead SP fails every later collective too: report the first few, then stay quiet.
        match POST_FAILURES.fetch_add(1, Ordering::AcqRel) {
            n if n < REPORTED_POST_FAILURES => say!(
                "rank {rank}: cannot post {} #{seq} on communicator {}:{}: {why}",
                kind_name(kind),
                info.id.leader,
                info.id.id
            ),
            REPORTED_POST_FAILURES => say!(
                "rank {rank}: further offloaded collectives fail with MPI_ERR_OTHER (not reported)"
            ),
            _ => {}
        }
        Offload::Failed(consts::ERR_OTHER())
    };
    let slot = match reserve_slot() {
        Ok(slot) => slot,
        Err(why) => return fail(&why),
    };
    // An allgatherv's receive buffer is also read: the SP serves the node's other ranks
    // segments out of it.
    let recv_rights = match kind {
        CollKind::Alltoallv | CollKind::Bcast | CollKind::StagedAllgather => Rights::WRITE,
        CollKind::Allgatherv => Rights::READ_WRITE,
    };
    let design =
        root.map(|_| staged_design(kind, info.max_per_node, s.region_len.max(r.region_len)));
    // Hier: SPs write the segment this rank shares with the other ranks of its node, and the
    // rank copies from it into its buffer (the root receives nothing).
    let segment = match design {
        Some(StagedDesign::Hier) => {
            let t = topology();
            let node = t.node_of_sp[t.sp_of_world[t.world_rank as usize] as usize];
            let sps = t.node_of_sp.iter().filter(|&&n| n == node).count() as u64;
            match crate::segment::get(t.job, node, sps) {
                Ok(seg) => Some(seg),
                Err(why) => return fail(&why),
            }
        }
        _ => None,
    };
    let receives_from_segment =
        segment.is_some() && (kind == CollKind::StagedAllgather || root != Some(info.comm_rank));
    let host_copies = (blocking && kind == CollKind::Allgatherv && host_copies_enabled())
        || receives_from_segment;
    let posted = with_shim(|sh| {
        let token = sh.next_token;
        sh.next_token += 1;
        mailbox_token(slot).store(0, Ordering::Release);
        let idle = sh.registry.all().all(|a| {
            // SAFETY: every address in the registry is a live request (see `Shim::harvest`).
            unsafe { &*(a as *const OffloadRequest) }.result().is_some()
        });
        sh.registrar.refresh(idle);
        let desc = PostDesc {
            kind,
            comm: info.id,
            seq,
            comm_rank: info.comm_rank,
            members: info.members.clone(),
            nodes: match kind {
                CollKind::Alltoallv => Vec::new(),
                CollKind::Allgatherv | CollKind::Bcast | CollKind::StagedAllgather => {
                    info.nodes.clone()
                }
            },
            slot,
            token,
            send: sh.registrar.buffer(send_addr, s.region_len, Rights::READ),
            recv: sh.registrar.buffer(recv_addr, r.region_len, recv_rights),
            send_counts: s.counts,
            send_displs: s.displs,
            recv_counts: r.counts,
            recv_displs: r.displs,
            host_copies,
            staged: root.zip(design).map(|(root, design)| Staged {
                root,
                design,
                segment: segment.map(|seg| {
                    sh.registrar
                        .cma_buffer(seg.addr as u64, seg.len, Rights::READ_WRITE)
                }),
            }),
        };
        match sh.conn.send(&HostToSp::Post(Box::new(desc))) {
            Ok(()) => {
                let mut req = OffloadRequest::new(kind, slot, token, info.id, seq, comm);
                if host_copies {
                    req.accept_host_copies((recv_addr as usize, r.region_len));
                }
                let req = Box::into_raw(Box::new(req));
                sh.registry.insert(req as usize);
                TRACKED.fetch_add(1, Ordering::AcqRel);
                Ok(req as usize)
            }
            Err(why) => {
                // The SP may have read part of it: the slot is never reused, and nothing
                // outstanding can complete over a broken stream.
                sh.slots.quarantine(slot);
                sh.fail_matching(|_| true);
                Err(why)
            }
        }
    });
    match posted {
        Some(Ok(addr)) => Offload::Posted(addr),
        Some(Err(why)) => fail(&why),
        None => fail("the shim is shut down"),
    }
}

/// Host-side intra-node copies in blocking allgathervs: on unless `SPOFF_HOST_COPIES=0`.
fn host_copies_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPOFF_HOST_COPIES").map_or(true, |v| v.trim() != "0"))
}

pub fn kind_name(kind: CollKind) -> &'static str {
    match kind {
        CollKind::Alltoallv => "alltoallv",
        CollKind::Allgatherv => "allgatherv",
        CollKind::Bcast => "bcast",
        CollKind::StagedAllgather => "staged allgather",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_hier_by_ranks_per_node_and_never_beyond_the_segment_part() {
        // 2 nodes x 4 ranks, whatever the SPs per node.
        let nodes = [0, 0, 0, 0, 1, 1, 1, 1];
        let most = crate::comm::max_per_node(&nodes);
        assert_eq!(most, 4);
        let pick = |forced, min, len| choose_design(forced, min, most, len, 1 << 20);
        assert_eq!(pick(None, 4, 100), StagedDesign::Hier);
        assert_eq!(pick(Some("auto"), 5, 100), StagedDesign::Flat);
        assert_eq!(pick(None, 8, 100), StagedDesign::Flat);
        assert_eq!(pick(Some(" hier "), 8, 100), StagedDesign::Hier);
        assert_eq!(pick(Some("flat"), 1, 100), StagedDesign::Flat);
        // A message larger than an SP's part of the segment is flat, even if forced.
        assert_eq!(pick(Some("hier"), 1, (1 << 20) + 1), StagedDesign::Flat);
        assert_eq!(pick(None, 1, 1 << 20), StagedDesign::Hier);
        // One crowded node is enough.
        let skewed = crate::comm::max_per_node(&[0, 1, 0, 0]);
        assert_eq!(skewed, 3);
        assert_eq!(choose_design(None, 3, skewed, 1, 64), StagedDesign::Hier);
        assert_eq!(crate::comm::max_per_node(&[]), 0);
    }
}
