//! The Wait/Test family over arrays that mix offloaded requests, native requests and
//! `MPI_REQUEST_NULL`.
//!
//! Every call first classifies its handles (`registry.rs`); with none of ours it is handed to
//! the native function unchanged. Otherwise the native subset goes to the matching `PMPI_*`
//! call on a temporary copy of the array in which our positions hold `MPI_REQUEST_NULL`, and
//! the native handles are copied back afterwards (a completed native request comes back as
//! `MPI_REQUEST_NULL`, as PMPI set it). A completed offloaded request is released: its handle
//! becomes `MPI_REQUEST_NULL`, its object is freed, and its status reads as a completed
//! collective (`MPI_ANY_SOURCE`, `MPI_ANY_TAG`, count 0, `MPI_ERROR` its code).
//!
//! Blocking calls loop: look at our requests, test the native subset (which also keeps native
//! MPI progressing: another rank may need our progress on a rendezvous send before it can post
//! its own part of the collective we wait for), and pause with `backoff.rs`. With no native
//! request in the call, `PMPI_Iprobe` drives progress every [`PROGRESS_INTERVAL`]. Every
//! [`CONN_CHECK_INTERVAL`] the SP connection is read, so a refused post or a dead SP ends the
//! wait with an error instead of a hang (`wait/progress.rs`). The single-request calls are
//! here; the array calls and their error reporting are in `wait/multi.rs`, the handling of
//! the call's handles in `wait/handles.rs`.
//!
//! [`PROGRESS_INTERVAL`]: crate::backoff::PROGRESS_INTERVAL
//! [`CONN_CHECK_INTERVAL`]: crate::backoff::CONN_CHECK_INTERVAL
//!
//! Errors go through the error handler of the request's communicator (`boundary::raise`), as
//! native MPI does: a single-request call (Wait, Test, Waitany, Testany) with the request's
//! code; a multi-completion call (Waitall, Testall, Waitsome, Testsome) once per call, with the
//! code the call returns (`MPI_ERR_IN_STATUS`), on the communicator of the first failed request
//! of ours, unless the native part of the call failed too (then `PMPI_*` already invoked the
//! handler, and once per call is all MPI does).

mod handles;
mod multi;
mod progress;

pub use multi::{some, testall, testany, waitall, waitany};

use crate::boundary::{say, Commit, Flow};
use crate::completion::{poll, release};
use crate::request::{by_addr, fill_status, my_rank};
use crate::state::with_shim;
use handles::{claim, claim_slot, complete_one};
use mpi_ffi as ffi;
use mpi_ffi::consts;
use progress::{test_miss, Waiter};
use std::os::raw::c_int;

/// Waits for one of our requests by address and returns its code (the object stays).
fn wait_addr(addr: usize) -> c_int {
    // SAFETY: the caller owns this request of ours.
    let req = unsafe { by_addr(addr) };
    let mut w = Waiter::new();
    loop {
        if let Some(code) = poll(req) {
            return code;
        }
        // SAFETY: MPI is initialised while requests of ours exist.
        unsafe { w.idle(true) };
    }
}

/// Waits for a request just posted by a blocking collective, then frees it.
pub fn wait_and_release(addr: usize) -> c_int {
    let code = wait_addr(addr);
    release(addr);
    code
}

/// # Safety
/// Arguments as for `MPI_Wait`.
pub unsafe fn wait(
    request: *mut ffi::MPI_Request,
    status: *mut ffi::MPI_Status,
    commit: &mut Commit,
) -> Flow {
    // SAFETY: null or a valid handle slot (MPI precondition).
    let Some(addr) = (unsafe { claim_slot(request, commit) }) else {
        // SAFETY: arguments as for MPI_Wait.
        return unsafe { wait_native(request, status, commit) };
    };
    let code = wait_addr(addr);
    // SAFETY: ours, owned by the caller until released below.
    let comm = unsafe { by_addr(addr) }.errhandler_comm();
    // SAFETY: as above.
    unsafe { complete_one(&mut *request, addr, status, code) };
    Flow::checked(comm, code)
}

/// Whether a blocking wait on native requests only must keep this rank progressing instead of
/// blocking in `PMPI_Wait*` (see [`wait_native`]): `ucx` grants, and offloaded collectives of
/// this rank outstanding.
fn host_progress_needed() -> bool {
    use std::sync::atomic::Ordering;
    crate::grants::UCX_ACTIVE.load(Ordering::Acquire)
        && crate::state::TRACKED.load(Ordering::Acquire) > 0
}

/// Tests native requests only (`test`: one `PMPI_Test*` call; true when the blocking call it
/// stands for is done, with the code to return) until done, keeping this rank progressing
/// between tests (see [`wait_native`]).
///
/// # Safety
/// MPI is initialised; `test` calls `PMPI_Test*` on the caller's arguments.
pub(crate) unsafe fn wait_natives(
    commit: &mut Commit,
    mut test: impl FnMut() -> Option<c_int>,
) -> Flow {
    if !host_progress_needed() {
        return Flow::Native;
    }
    commit.mark();
    let mut w = Waiter::new();
    loop {
        if let Some(rc) = test() {
            return Flow::Done(rc);
        }
        // SAFETY: MPI is initialised. The test drove native progress.
        unsafe { w.idle(false) };
    }
}

/// `MPI_Wait` on a native request. Blocking in `PMPI_Wait` would stop this rank's UCX progress,
/// and with the `ucx` backend on UCX 1.13 the SP's accesses to our buffers complete only while
/// we progress (`grants.rs`): a program that waits for a message which its peer sends only
/// after its own offloaded collective completed, while that collective needs the SP's gets from
/// this rank's buffers, would stall until the SP's transfer timeout (10 s) failed the
/// collective. So while offloaded collectives of this rank are outstanding, the request is
/// tested in a loop that keeps UCX (and the SP connection) progressing; otherwise, and with
/// `cma` grants, the call goes to `PMPI_Wait` unchanged.
///
/// # Safety
/// Arguments as for `MPI_Wait`.
unsafe fn wait_native(
    request: *mut ffi::MPI_Request,
    status: *mut ffi::MPI_Status,
    commit: &mut Commit,
) -> Flow {
    if !host_progress_needed() {
        return Flow::Native;
    }
    commit.mark();
    let mut w = Waiter::new();
    loop {
        let mut flag: c_int = 0;
        // SAFETY: the caller's request and status (MPI preconditions); PMPI_Test completes
        // and frees the request as PMPI_Wait would, and invokes its error handler itself.
        let rc = unsafe { ffi::PMPI_Test(request, &mut flag, status) };
        if flag != 0 || rc != consts::SUCCESS() {
            return Flow::Done(rc);
        }
        // SAFETY: MPI is initialised. The test above already drove native progress.
        unsafe { w.idle(false) };
    }
}

/// # Safety
/// Arguments as for `MPI_Test`.
pub unsafe fn test(
    request: *mut ffi::MPI_Request,
    flag: *mut c_int,
    status: *mut ffi::MPI_Status,
    commit: &mut Commit,
) -> Flow {
    if flag.is_null() {
        return Flow::Native;
    }
    // SAFETY: null or a valid handle slot (MPI precondition).
    let Some(addr) = (unsafe { claim_slot(request, commit) }) else {
        return Flow::Native;
    };
    // SAFETY: ours, owned by the caller.
    match poll(unsafe { by_addr(addr) }) {
        Some(code) => {
            // SAFETY: ours, owned by the caller until released below.
            let comm = unsafe { by_addr(addr) }.errhandler_comm();
            // SAFETY: valid handle slot, flag and status (MPI preconditions).
            unsafe {
                complete_one(&mut *request, addr, status, code);
                *flag = 1;
            }
            Flow::checked(comm, code)
        }
        None => {
            // SAFETY: as above.
            unsafe {
                *flag = 0;
                test_miss(false);
            }
            Flow::Done(consts::SUCCESS())
        }
    }
}

/// # Safety
/// Arguments as for `MPI_Request_free`.
pub unsafe fn request_free(request: *mut ffi::MPI_Request, commit: &mut Commit) -> Flow {
    // SAFETY: null or a valid handle slot (MPI precondition).
    let Some(addr) = (unsafe { claim_slot(request, commit) }) else {
        return Flow::Native;
    };
    // SAFETY: ours, owned by the caller until this call gives it up.
    let done = poll(unsafe { by_addr(addr) }).is_some();
    with_shim(|s| {
        if done {
            s.free_request(addr);
        } else {
            // The slot stays taken until the SP completes it; harvested later and at finalize.
            s.registry.detach(addr);
        }
    });
    // SAFETY: as above.
    unsafe { *request = consts::REQUEST_NULL() };
    Flow::Done(consts::SUCCESS())
}

/// # Safety
/// Arguments as for `MPI_Request_get_status`.
pub unsafe fn request_get_status(
    request: ffi::MPI_Request,
    flag: *mut c_int,
    status: *mut ffi::MPI_Status,
    commit: &mut Commit,
) -> Flow {
    if flag.is_null() {
        return Flow::Native;
    }
    let Some(addr) = claim(request, commit) else {
        return Flow::Native;
    };
    // SAFETY: ours, owned by the caller; the request is left as it is.
    match poll(unsafe { by_addr(addr) }) {
        // SAFETY: valid flag and status (MPI preconditions).
        Some(code) => unsafe {
            *flag = 1;
            fill_status(status, code);
        },
        // SAFETY: valid flag; MPI is initialised.
        None => unsafe {
            *flag = 0;
            test_miss(false);
        },
    }
    Flow::Done(consts::SUCCESS())
}

/// # Safety
/// Arguments as for `MPI_Cancel`.
pub unsafe fn cancel(request: *mut ffi::MPI_Request, commit: &mut Commit) -> Flow {
    // SAFETY: null or a valid handle slot (MPI precondition).
    let Some(addr) = (unsafe { claim_slot(request, commit) }) else {
        return Flow::Native;
    };
    say!(
        "rank {}: MPI_Cancel on an offloaded collective request: collectives cannot be cancelled",
        my_rank()
    );
    Flow::Raise {
        // SAFETY: ours, owned by the caller (not released: the request stays).
        comm: unsafe { by_addr(addr) }.errhandler_comm(),
        code: consts::ERR_ARG(),
    }
}

/// Waits until every request the program freed before completion has completed (for
/// `MPI_Finalize`). Ends when the SP completes them or the connection is lost.
///
/// # Safety
/// MPI is initialised.
pub unsafe fn drain_detached() {
    let mut w = Waiter::new();
    loop {
        let left = with_shim(|s| {
            s.harvest();
            s.registry.detached().len()
        })
        .unwrap_or(0);
        if left == 0 {
            return;
        }
        // SAFETY: forwarded.
        unsafe { w.idle(true) };
    }
}
