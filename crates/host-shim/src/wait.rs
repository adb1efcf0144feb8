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
        return Flow::Native;
    };
    let code = wait_addr(addr);
    // SAFETY: ours, owned by the caller until released below.
    let comm = unsafe { by_addr(addr) }.errhandler_comm();
    // SAFETY: as above.
    unsafe { complete_one(&mut *request, addr, status, code) };
    Flow::checked(comm, code)
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
