//! Offloading the collectives: `MPI_Alltoallv` / `MPI_Alltoall`, `MPI_Allgatherv` /
//! `MPI_Allgather`, `MPI_Bcast` and `MPI_Allreduce` (blocking and nonblocking; the allreduce
//! only when `SPOFF_ALLREDUCE_DESIGN` asks for the SP tree and its type and operation are
//! ones the SPs reduce, `reduce.rs`).
//!
//! **One decision on every rank.** A call is offloaded when the shim is active (agreed by all
//! ranks at `MPI_Init`), the communicator is an intracommunicator, and the arguments are valid
//! (datatypes MPI can describe, counts that are not negative, a root inside the communicator,
//! a request pointer for a nonblocking call); otherwise the caller runs the native function
//! unchanged. Each of these holds alike on every rank of a correct program, so every member
//! takes the same path. Nothing a rank may legally choose for itself enters the decision: its
//! datatypes (any type map with the right signature: each side is granted directly or packed,
//! `post.rs`), its displacements, `MPI_IN_PLACE` (the send side is then a copy of the
//! rank's part of the receive buffer, taken at the post), or zero counts.
//!
//! An allgather(v) is posted as `CollKind::Allgatherv`: the send side is the one block of
//! `sendcount` elements, the receive side has a block per comm rank, and the descriptor
//! carries the node of each comm rank (its SP's node in the cluster description) for the
//! hierarchical algorithm. An `MPI_Allgather` is the allgatherv with `recvcount` per rank at
//! displacement `i * recvcount`; with `SPOFF_IALLGATHER_DESIGN` set, an `MPI_Iallgather` is the
//! staged allgather (`design.rs`), and with it `mcast` (agreed at `MPI_Init`), both calls are the
//! multicast Allgather. A bcast is one block each way, the root's to send.

use crate::boundary::Commit;
use crate::datatype;
use crate::design::iallgather_staged;
use crate::layout::alltoall_as_v;
use crate::post::{post, post_reduce, Offload, Side};
use crate::recycle::Recycled;
use crate::state::is_active;
use bootstrap::wire::CollKind;
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::{c_int, c_void};

/// The communicator's size and this rank's rank in it when a call on it may be offloaded.
unsafe fn eligible(comm: ffi::MPI_Comm) -> Option<(usize, usize)> {
    if !is_active() || comm == consts::COMM_NULL() {
        return None;
    }
    let (mut inter, mut size, mut rank): (c_int, c_int, c_int) = (0, 0, 0);
    // SAFETY: valid out-pointers; an invalid communicator is reported by an error code.
    unsafe {
        if ffi::PMPI_Comm_test_inter(comm, &mut inter) != consts::SUCCESS() || inter != 0 {
            return None;
        }
        if ffi::PMPI_Comm_size(comm, &mut size) != consts::SUCCESS() || size <= 0 {
            return None;
        }
        if ffi::PMPI_Comm_rank(comm, &mut rank) != consts::SUCCESS() || rank < 0 {
            return None;
        }
    }
    Some((size as usize, rank as usize))
}

fn is_in_place(buf: *const c_void) -> bool {
    std::ptr::eq(buf, consts::IN_PLACE())
}

/// Copies `n` ints from a caller's array; `None` for a null array.
unsafe fn read_ints(p: *const c_int, n: usize) -> Option<Recycled<i64>> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller's array of one entry per peer (MPI precondition).
    Some(Recycled::collect(
        unsafe { std::slice::from_raw_parts(p, n) }
            .iter()
            .map(|&v| v as i64),
    ))
}

/// The counts and displacements of one block of `count` elements at displacement 0.
fn one_block(count: c_int) -> (Recycled<i64>, Recycled<i64>) {
    (Recycled::of(&[count as i64]), Recycled::of(&[0]))
}

/// A side of `ty` over `(counts, displs)` from `buf`; `None` for an invalid type.
unsafe fn side(
    buf: *const c_void,
    (counts, displs): (Recycled<i64>, Recycled<i64>),
    ty: ffi::MPI_Datatype,
) -> Option<Side> {
    Some(Side {
        buf,
        counts,
        displs,
        ty,
        // SAFETY: MPI is initialised while the shim is active.
        geo: unsafe { datatype::geometry(ty)? },
        copy: false,
    })
}

/// The send side of an `MPI_IN_PLACE` call: the blocks `pick` of the receive side, copied
/// through the shim's staging at the post.
fn in_place_send(recv: &Side, pick: impl Fn(usize) -> bool) -> Side {
    let picked = || (0..recv.counts.len()).filter(|&p| pick(p));
    let counts = Recycled::collect(picked().map(|p| recv.counts[p]));
    let displs = Recycled::collect(picked().map(|p| recv.displs[p]));
    Side {
        buf: recv.buf,
        counts,
        displs,
        ty: recv.ty,
        geo: recv.geo,
        copy: true,
    }
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
    let Some((n, _)) = (unsafe { eligible(comm) }) else {
        return Offload::Native;
    };
    // SAFETY: forwarded.
    let (Some(rc), Some(rd)) = (unsafe { (read_ints(recvcounts, n), read_ints(rdispls, n)) })
    else {
        return Offload::Native;
    };
    // SAFETY: forwarded.
    unsafe {
        let Some(recv) = side(recvbuf, (rc, rd), recvtype) else {
            return Offload::Native;
        };
        let send = if is_in_place(sendbuf) {
            // The data for peer p are the receive block p (MPI 2.2 in-place alltoallv).
            in_place_send(&recv, |_| true)
        } else {
            let (Some(sc), Some(sd)) = (read_ints(sendcounts, n), read_ints(sdispls, n)) else {
                return Offload::Native;
            };
            let Some(send) = side(sendbuf, (sc, sd), sendtype) else {
                return Offload::Native;
            };
            send
        };
        post(CollKind::Alltoallv, comm, send, recv, false, None, commit)
    }
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
    let Some((n, _)) = (unsafe { eligible(comm) }) else {
        return Offload::Native;
    };
    // SAFETY: forwarded.
    unsafe {
        let Some(recv) = side(recvbuf, alltoall_as_v(n, recvcount as i64), recvtype) else {
            return Offload::Native;
        };
        let send = if is_in_place(sendbuf) {
            in_place_send(&recv, |_| true)
        } else {
            let Some(send) = side(sendbuf, alltoall_as_v(n, sendcount as i64), sendtype) else {
                return Offload::Native;
            };
            send
        };
        post(CollKind::Alltoallv, comm, send, recv, false, None, commit)
    }
}

/// The send side of an allgather(v): the one block of `sendcount` elements, or with
/// `MPI_IN_PLACE` this rank's block of the receive side.
unsafe fn gather_send(
    sendbuf: *const c_void,
    sendcount: c_int,
    sendtype: ffi::MPI_Datatype,
    recv: &Side,
    me: usize,
) -> Option<Side> {
    if is_in_place(sendbuf) {
        return Some(in_place_send(recv, |p| p == me));
    }
    // SAFETY: forwarded.
    unsafe { side(sendbuf, one_block(sendcount), sendtype) }
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
    let Some((n, me)) = (unsafe { eligible(comm) }) else {
        return Offload::Native;
    };
    // SAFETY: forwarded.
    let (Some(rc), Some(rd)) = (unsafe { (read_ints(recvcounts, n), read_ints(displs, n)) }) else {
        return Offload::Native;
    };
    // SAFETY: forwarded.
    unsafe {
        let Some(recv) = side(recvbuf, (rc, rd), recvtype) else {
            return Offload::Native;
        };
        let Some(send) = gather_send(sendbuf, sendcount, sendtype, &recv, me) else {
            return Offload::Native;
        };
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
    let Some((n, me)) = (unsafe { eligible(comm) }) else {
        return Offload::Native;
    };
    // SAFETY: forwarded.
    unsafe {
        // Block `i` at displacement `i * recvcount`: the alltoall layout of one side.
        let Some(recv) = side(recvbuf, alltoall_as_v(n, recvcount as i64), recvtype) else {
            return Offload::Native;
        };
        let Some(send) = gather_send(sendbuf, sendcount, sendtype, &recv, me) else {
            return Offload::Native;
        };
        // The multicast Allgather (blocking or not) or the staged designs when asked for.
        let kind = if crate::design::allgather_mcast() {
            CollKind::McastAllgather
        } else if !blocking && iallgather_staged() {
            CollKind::StagedAllgather
        } else {
            CollKind::Allgatherv
        };
        post(kind, comm, send, recv, blocking, None, commit)
    }
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
    let Some((n, me)) = (unsafe { eligible(comm) }) else {
        return Offload::Native;
    };
    if root < 0 || root as usize >= n || count < 0 {
        // Native MPI reports the bad root or count.
        return Offload::Native;
    }
    // SAFETY: forwarded.
    unsafe {
        let (Some(data), Some(empty)) = (
            side(buffer, one_block(count), ty),
            side(buffer, one_block(0), ty),
        ) else {
            return Offload::Native;
        };
        let (send, recv) = if me == root as usize {
            (data, empty)
        } else {
            (empty, data)
        };
        post(
            crate::design::bcast_kind(),
            comm,
            send,
            recv,
            blocking,
            Some(root as u32),
            commit,
        )
    }
}

/// # Safety
/// Arguments as for `MPI_Allreduce`.
///
/// Offloaded (as `CollKind::Allreduce` or `CollKind::CanaryAllreduce`, one block each way of
/// `count` elements, with its reduction in the descriptor) when `SPOFF_ALLREDUCE_DESIGN` asks
/// for an offloaded design (`reduce::allreduce_kind`) and the type and operation are ones the
/// SPs reduce (`reduce.rs`); with `MPI_IN_PLACE` the send side is a copy of the receive
/// buffer taken at the post.
#[allow(clippy::too_many_arguments)]
pub unsafe fn allreduce(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: c_int,
    ty: ffi::MPI_Datatype,
    op: ffi::MPI_Op,
    comm: ffi::MPI_Comm,
    blocking: bool,
    commit: &mut Commit,
) -> Offload {
    let Some(kind) = crate::reduce::allreduce_kind() else {
        return Offload::Native;
    };
    if count < 0 {
        return Offload::Native;
    }
    // SAFETY: forwarded.
    let Some(_) = (unsafe { eligible(comm) }) else {
        return Offload::Native;
    };
    // SAFETY: MPI is initialised while the shim is active.
    let Some(reduce) = (unsafe { crate::reduce::reduction(ty, op, count) }) else {
        return Offload::Native;
    };
    // SAFETY: forwarded.
    unsafe {
        let Some(recv) = side(recvbuf, one_block(count), ty) else {
            return Offload::Native;
        };
        let send = if is_in_place(sendbuf) {
            in_place_send(&recv, |_| true)
        } else {
            let Some(send) = side(sendbuf, one_block(count), ty) else {
                return Offload::Native;
            };
            send
        };
        post_reduce(kind, comm, send, recv, blocking, None, Some(reduce), commit)
    }
}
