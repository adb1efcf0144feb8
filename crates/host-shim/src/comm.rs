//! Communicator identity for offloaded collectives.
//!
//! At its first offloaded collective, a communicator gets a [`CommInfo`]: an id agreed by all
//! its members, the SP serving each member, and the count of offloaded collectives issued on it
//! (the `seq` of the next one). The info is cached as an MPI attribute under a keyval created
//! at start-up with `MPI_COMM_NULL_COPY_FN` (so `MPI_Comm_dup` gives the duplicate its own id)
//! and a delete callback that frees it (on `MPI_Comm_free`, and for the predefined
//! communicators inside `MPI_Finalize`), after pointing the error reporting of requests still
//! outstanding on it to `MPI_COMM_WORLD` (`request.rs`).
//!
//! The id is `CommId { leader, id }`: `leader` is the communicator's lowest world rank, and `id`
//! is drawn by the leader from its own counter and broadcast to the others. Every communicator
//! with that leader contains the leader, whose counter never repeats, so the pair is unique in
//! the job even when the leader's threads set up communicators concurrently. (An `Allreduce(MAX)`
//! of per-rank counters, the first design, can hand two communicators the same id when a member
//! agrees on both at once from two threads.)

use crate::boundary::no_panic;
use crate::state::{topology, with_shim};
use algorithms::{CommId, SpId};
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};

#[derive(Debug)]
pub struct CommInfo {
    pub id: CommId,
    pub comm_rank: u32,
    /// SP serving each comm rank.
    pub members: Vec<SpId>,
    /// World rank of each comm rank.
    pub world_ranks: Vec<u32>,
    /// Node of each comm rank (the node of its SP in the cluster description).
    pub nodes: Vec<u32>,
    /// The most members on one node (what `auto` picks a staged design by).
    pub max_per_node: usize,
    /// `seq` of the next offloaded collective on this communicator.
    pub next_seq: AtomicU64,
}

static KEYVAL: AtomicI32 = AtomicI32::new(i32::MIN);
/// Ids this rank hands out to communicators it leads.
static NEXT_COMM_ID: AtomicU32 = AtomicU32::new(1);

unsafe extern "C" fn delete_info(
    _comm: ffi::MPI_Comm,
    _keyval: c_int,
    attr: *mut c_void,
    _extra: *mut c_void,
) -> c_int {
    if !attr.is_null() {
        no_panic("the communicator attribute destructor", || {
            // SAFETY: every value stored under KEYVAL is a Box<CommInfo> leaked by `info`, and
            // MPI calls this destructor once per stored value.
            let info = unsafe { Box::from_raw(attr as *mut CommInfo) };
            // Requests still outstanding on the freed communicator report errors through
            // MPI_COMM_WORLD from now on. (The shim never frees a communicator while holding
            // its lock; inside MPI_Finalize the state is already gone and this does nothing.)
            with_shim(|s| s.comm_freed(info.id));
        });
    }
    consts::SUCCESS()
}

/// Creates the attribute keyval (at start-up, before offload is agreed).
///
/// # Safety
/// MPI is initialised.
pub unsafe fn create_keyval() -> Result<(), c_int> {
    let mut keyval: c_int = 0;
    // SAFETY: valid callbacks and out-pointer.
    let rc = unsafe {
        ffi::PMPI_Comm_create_keyval(
            consts::COMM_NULL_COPY_FN(),
            Some(delete_info),
            &mut keyval,
            std::ptr::null_mut(),
        )
    };
    if rc != consts::SUCCESS() {
        return Err(rc);
    }
    KEYVAL.store(keyval, Ordering::Release);
    Ok(())
}

/// Why a communicator is not offloaded.
#[derive(Debug)]
pub enum NotOffloaded {
    /// An MPI call failed; the native path will report whatever is wrong.
    Mpi,
    /// A member is not in `MPI_COMM_WORLD` (dynamic processes).
    OutsideWorld,
}

/// The info of `comm`, agreeing on it first if this is the communicator's first offloaded
/// collective (a collective call: every member must reach it for the same collective).
///
/// The returned pointer is valid as long as `comm` is (it is freed with the communicator).
///
/// # Safety
/// MPI is initialised, the shim is active, `comm` is a valid intracommunicator.
pub unsafe fn info(comm: ffi::MPI_Comm) -> Result<*const CommInfo, NotOffloaded> {
    let keyval = KEYVAL.load(Ordering::Acquire);
    let mut found: *mut c_void = std::ptr::null_mut();
    let mut flag: c_int = 0;
    // SAFETY: for Comm_get_attr the attribute_val argument points to a void* that receives
    // the stored value.
    let rc = unsafe {
        ffi::PMPI_Comm_get_attr(
            comm,
            keyval,
            (&mut found as *mut *mut c_void).cast(),
            &mut flag,
        )
    };
    if rc != consts::SUCCESS() {
        return Err(NotOffloaded::Mpi);
    }
    if flag != 0 && !found.is_null() {
        return Ok(found as *const CommInfo);
    }
    // SAFETY: forwarded precondition.
    let info = Box::new(unsafe { agree(comm)? });
    let ptr = Box::into_raw(info);
    // SAFETY: stores the pointer as the attribute value; MPI hands it back to `delete_info`.
    let rc = unsafe { ffi::PMPI_Comm_set_attr(comm, keyval, ptr.cast()) };
    if rc != consts::SUCCESS() {
        // SAFETY: not stored, so still ours alone.
        drop(unsafe { Box::from_raw(ptr) });
        return Err(NotOffloaded::Mpi);
    }
    Ok(ptr)
}

/// A communicator constructor returned `rc` with `*newcomm`: agrees on the new
/// communicator's info at once, where every member of it is making this same call, rather than
/// at its first offloaded collective. Members may reach the first collectives of several
/// communicators in different orders (nonblocking collectives, as MPI allows), and an
/// agreement there, a blocking broadcast inside an `MPI_Ibcast`, then waited in a circle.
/// Does nothing unless the shim is active, the call succeeded and gave an intracommunicator;
/// a failure leaves the agreement to the first collective, as before.
///
/// # Safety
/// MPI is initialised; `newcomm` is the constructor's out-pointer.
pub unsafe fn agree_new(rc: c_int, newcomm: *const ffi::MPI_Comm) {
    if rc != consts::SUCCESS() || newcomm.is_null() || !crate::state::is_active() {
        return;
    }
    no_panic("agreeing on a new communicator", || {
        // SAFETY: the constructor wrote the new handle.
        let comm = unsafe { *newcomm };
        if comm == consts::COMM_NULL() {
            return;
        }
        let mut inter: c_int = 0;
        // SAFETY: a valid communicator and an out-pointer.
        let rc = unsafe { ffi::PMPI_Comm_test_inter(comm, &mut inter) };
        if rc == consts::SUCCESS() && inter == 0 {
            // SAFETY: an intracommunicator every member of which is in this same call.
            let _ = unsafe { info(comm) };
        }
    });
}

/// World ranks of `comm`'s members, in comm rank order.
unsafe fn world_ranks(comm: ffi::MPI_Comm, size: c_int) -> Result<Vec<c_int>, NotOffloaded> {
    let mut group = consts::GROUP_NULL();
    let mut world_group = consts::GROUP_NULL();
    let ranks: Vec<c_int> = (0..size).collect();
    let mut world: Vec<c_int> = vec![0; size as usize];
    // SAFETY: valid communicators and out-pointers; arrays of `size` entries.
    let rc = unsafe {
        let mut rc = ffi::PMPI_Comm_group(comm, &mut group);
        if rc == consts::SUCCESS() {
            rc = ffi::PMPI_Comm_group(consts::COMM_WORLD(), &mut world_group);
        }
        if rc == consts::SUCCESS() {
            rc = ffi::PMPI_Group_translate_ranks(
                group,
                size,
                ranks.as_ptr(),
                world_group,
                world.as_mut_ptr(),
            );
        }
        if group != consts::GROUP_NULL() {
            ffi::PMPI_Group_free(&mut group);
        }
        if world_group != consts::GROUP_NULL() {
            ffi::PMPI_Group_free(&mut world_group);
        }
        rc
    };
    if rc != consts::SUCCESS() {
        return Err(NotOffloaded::Mpi);
    }
    Ok(world)
}

unsafe fn agree(comm: ffi::MPI_Comm) -> Result<CommInfo, NotOffloaded> {
    let (mut size, mut rank) = (0, 0);
    // SAFETY: valid communicator and out-pointers.
    let rc = unsafe {
        let rc = ffi::PMPI_Comm_size(comm, &mut size);
        if rc == consts::SUCCESS() {
            ffi::PMPI_Comm_rank(comm, &mut rank)
        } else {
            rc
        }
    };
    if rc != consts::SUCCESS() {
        return Err(NotOffloaded::Mpi);
    }
    // SAFETY: forwarded precondition.
    let world = unsafe { world_ranks(comm, size)? };
    let topo = topology();
    // Every member computes the same: the translation is the same group on every member.
    let outside = world.iter().any(|&w| w < 0 || w as u32 >= topo.world_size);
    let (leader_comm_rank, leader) = world
        .iter()
        .enumerate()
        .min_by_key(|(_, &w)| w)
        .map(|(i, &w)| (i as c_int, w))
        .unwrap_or((0, 0));
    let mut id: u32 = if rank == leader_comm_rank {
        NEXT_COMM_ID.fetch_add(1, Ordering::AcqRel)
    } else {
        0
    };
    // The broadcast runs even for a communicator with outside members, so that every member
    // executes the same calls; the decision below is then the same everywhere.
    // SAFETY: one u32 in a live variable.
    let rc = unsafe {
        ffi::PMPI_Bcast(
            (&mut id as *mut u32).cast(),
            1,
            consts::UINT32_T(),
            leader_comm_rank,
            comm,
        )
    };
    if rc != consts::SUCCESS() {
        return Err(NotOffloaded::Mpi);
    }
    if outside {
        return Err(NotOffloaded::OutsideWorld);
    }
    let members: Vec<SpId> = world
        .iter()
        .map(|&w| topo.sp_of_world[w as usize])
        .collect();
    // Every SP a rank registered with is in the description (the rank checked its own SP's
    // id against it), so the lookup cannot miss; `u32::MAX` would only make the SP refuse.
    let nodes: Vec<u32> = members
        .iter()
        .map(|&sp| {
            topo.node_of_sp
                .get(sp as usize)
                .copied()
                .unwrap_or(u32::MAX)
        })
        .collect();
    Ok(CommInfo {
        id: CommId {
            leader: leader as u32,
            id,
        },
        comm_rank: rank as u32,
        members,
        world_ranks: world.iter().map(|&w| w as u32).collect(),
        max_per_node: max_per_node(&nodes),
        nodes,
        next_seq: AtomicU64::new(0),
    })
}

/// The most entries of `nodes` naming one node.
pub fn max_per_node(nodes: &[u32]) -> usize {
    let mut per_node = std::collections::HashMap::new();
    for node in nodes {
        *per_node.entry(*node).or_insert(0usize) += 1;
    }
    per_node.into_values().max().unwrap_or(0)
}
