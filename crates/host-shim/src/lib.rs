//! `libhost_shim.so` is LD_PRELOADed into unmodified MPI programs and, through PMPI
//! interposition, hands their alltoall(v) and allgather(v) collectives, blocking and
//! nonblocking (`MPI_Alltoallv`, `MPI_Ialltoallv`, `MPI_Alltoall`, `MPI_Ialltoall`,
//! `MPI_Allgatherv`, `MPI_Iallgatherv`, `MPI_Allgather`, `MPI_Iallgather`), to the rank's
//! service process (SP): it posts a descriptor over a Unix socket with grants on the buffers
//! (an allgather(v) as the SP's hierarchical allgatherv, with the node of every member), and
//! completes the request when the SP writes a completion token into the rank's mailbox; it
//! intercepts the whole Wait/Test family so its requests and native ones mix freely. It never
//! changes what a program computes: any datatype and `MPI_IN_PLACE` are offloaded (sides that
//! are not one run of bytes are packed, `post.rs`), so the offload decision never differs
//! between ranks; what it does not support (an intercommunicator, no SP reachable on some
//! rank) goes to the native `PMPI_*` function unchanged, it never lets a panic cross into C,
//! never starts before
//! `MPI_Init` (no ELF constructor), and never touches memory the program did not name in a
//! call.
//!
//! Environment: `SPOFF_CLUSTER` (path of the cluster description; unset = native),
//! `SPOFF_OFFLOAD=0` (native), `SPOFF_JOB_CREDENTIAL` (the job's identity at the SPs, issued
//! by the launcher; without it the job runs natively),
//! `SPOFF_VERBOSE=1` (a line per rank on activation), `SPOFF_MAILBOX_SLOTS` (completion slots,
//! default 1024; a collective posted while all are taken completes by a message), `SPOFF_BACKEND=cma|ucx`
//! (how the program's buffers are granted, default `cma`; see below).
//!
//! Errors: an offloaded collective that fails (its post, or its completion: a dead SP, a
//! refused post, a failed copy) is reported as a native MPI error is, through the error
//! handler of its communicator (`MPI_Comm_call_errhandler`; Wait/Test on a request use the
//! communicator the request was created on, multi-completion calls invoke it once with
//! `MPI_ERR_IN_STATUS`). Under the default `MPI_ERRORS_ARE_FATAL` the job aborts; under
//! `MPI_ERRORS_RETURN` the code is returned. A connection to the SP that the shim finds broken
//! is shut down at once, so the SP sees the rank go and aborts its job on every SP (`conn.rs`).
//!
//! Memory access permission: at start-up the rank calls `prctl(PR_SET_PTRACER,
//! PR_SET_PTRACER_ANY)`, because with `cma` the SPs of all nodes (several pids, not known in
//! advance) read and write its memory with `process_vm_readv/writev`, which Yama's
//! `ptrace_scope=1` would refuse. The implication: any process of the same user may ptrace the
//! rank while it runs (as under `ptrace_scope=0`). On BlueField the alias-key path (cross-GVMI
//! mkeys on the DPU) replaces CMA and needs no ptrace permission.
//!
//! Backends (`grants.rs`): with `cma` the SP copies with `process_vm_readv/writev`. With `ucx`
//! the send and receive buffers are `ucp_mem_map`ped and granted with a packed remote key and
//! the rank's UCX worker address (the mailbox stays `cma`); every SP must serve UCX grants
//! (the launcher's `--sp-arg=--ucx`). Registrations are cached across collectives and dropped
//! when libucm reports their memory unmapped (`unmapped.rs`; without those events nothing is
//! cached across collectives). On this machine's UCX 1.13 (tcp/shared memory) the SP's
//! accesses are emulated and complete only while the rank progresses its worker, which every
//! wait loop of the shim does on each pass: data moves only while the program is inside MPI,
//! so this backend does not overlap with the program's computation (on InfiniBand RC/DC it
//! would). A rank whose UCX cannot initialise says so once and uses `cma`; the SP serves each
//! grant with the backend it names, so ranks may differ.
//!
//! Module map: `boundary` (the C boundary), `state` (the state machine and shared state; it
//! depends on no module above it), `lifecycle` (start-up and shutdown), `conn` (the SP
//! connection), `comm` (communicator ids), `coll` (the entry points' sides and the offload
//! decision), `request` + `registry` + `slots` (request objects, handle classification, mailbox
//! slots), `completion` (completing tracked requests from the mailbox and the SP's messages),
//! `wait` + `backoff` (the Wait/Test family), `layout` (byte arithmetic),
//! `grants` + `unmapped` (buffer grants, the `ucx` cache's unmap events), `datatype` + `pack`
//! (which sides are runs; packing the others), `post` (laying out, packing and posting one
//! collective), `design` (the staged designs and other per-job settings).
#![deny(unsafe_op_in_unsafe_fn)]
// The exported functions keep MPI's names and signatures.
#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

mod boundary;
mod cma;
mod coll;
mod comm;
mod completion;
mod conn;
mod datatype;
mod design;
mod grants;
mod lifecycle;
mod pack;
mod post;
mod request;
mod segment;
mod state;
mod wait;

pub mod backoff;
pub mod layout;
pub mod registry;
pub mod slots;
pub mod unmapped;

use boundary::{boundary, Flow};
use mpi_ffi as ffi;
use mpi_ffi::consts;
use post::Offload;
use std::os::raw::{c_char, c_int, c_void};

pub use state::{state as shim_state, State};

/// `MPI_Init` / `MPI_Init_thread`: the native initialisation `pmpi`, then, once it succeeded,
/// the shim's start-up.
fn init(name: &'static str, pmpi: impl Fn() -> c_int) -> c_int {
    boundary(name, &pmpi, |commit| {
        let rc = pmpi();
        commit.mark();
        if rc == consts::SUCCESS() {
            // SAFETY: MPI is initialised, on this thread.
            unsafe { lifecycle::start() };
        }
        Flow::Done(rc)
    })
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Init(argc: *mut c_int, argv: *mut *mut *mut c_char) -> c_int {
    // SAFETY: the caller's arguments, passed on unchanged.
    init("MPI_Init", || unsafe { ffi::PMPI_Init(argc, argv) })
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Init_thread(
    argc: *mut c_int,
    argv: *mut *mut *mut c_char,
    required: c_int,
    provided: *mut c_int,
) -> c_int {
    init("MPI_Init_thread", || {
        // SAFETY: the caller's arguments, passed on unchanged.
        unsafe { ffi::PMPI_Init_thread(argc, argv, required, provided) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Finalize() -> c_int {
    boundary(
        "MPI_Finalize",
        // SAFETY: no arguments.
        || unsafe { ffi::PMPI_Finalize() },
        |_| {
            // SAFETY: MPI is initialised (MPI_Finalize precondition).
            unsafe { lifecycle::finish() };
            Flow::Native
        },
    )
}

/// Completes an entry point from the offload outcome: a nonblocking one (`request`, checked
/// non-null before offloading) hands out the posted request, a blocking one waits for it. A
/// failure (of the post, or of the blocking collective) goes through the error handler of
/// `comm`, as a native call's does.
unsafe fn complete(
    outcome: Offload,
    request: Option<*mut ffi::MPI_Request>,
    comm: ffi::MPI_Comm,
) -> Flow {
    match (outcome, request) {
        (Offload::Native, _) => Flow::Native,
        (Offload::Posted(addr), None) => Flow::checked(comm, wait::wait_and_release(addr)),
        (Offload::Posted(addr), Some(request)) => {
            // SAFETY: the caller's request slot.
            unsafe { *request = addr as ffi::MPI_Request };
            Flow::Done(consts::SUCCESS())
        }
        (Offload::Failed(rc), request) => {
            if let Some(request) = request {
                // SAFETY: as above.
                unsafe { *request = consts::REQUEST_NULL() };
            }
            Flow::checked(comm, rc)
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Ialltoallv(
    sendbuf: *const c_void,
    sendcounts: *const c_int,
    sdispls: *const c_int,
    sendtype: ffi::MPI_Datatype,
    recvbuf: *mut c_void,
    recvcounts: *const c_int,
    rdispls: *const c_int,
    recvtype: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
    request: *mut ffi::MPI_Request,
) -> c_int {
    boundary(
        "MPI_Ialltoallv",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe {
            ffi::PMPI_Ialltoallv(
                sendbuf, sendcounts, sdispls, sendtype, recvbuf, recvcounts, rdispls, recvtype,
                comm, request,
            )
        },
        |commit| {
            if request.is_null() {
                return Flow::Native;
            }
            // SAFETY: the caller's arguments (MPI preconditions).
            unsafe {
                let outcome = coll::alltoallv(
                    sendbuf, sendcounts, sdispls, sendtype, recvbuf, recvcounts, rdispls, recvtype,
                    comm, commit,
                );
                complete(outcome, Some(request), comm)
            }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Alltoallv(
    sendbuf: *const c_void,
    sendcounts: *const c_int,
    sdispls: *const c_int,
    sendtype: ffi::MPI_Datatype,
    recvbuf: *mut c_void,
    recvcounts: *const c_int,
    rdispls: *const c_int,
    recvtype: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
) -> c_int {
    boundary(
        "MPI_Alltoallv",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe {
            ffi::PMPI_Alltoallv(
                sendbuf, sendcounts, sdispls, sendtype, recvbuf, recvcounts, rdispls, recvtype,
                comm,
            )
        },
        |commit| {
            // SAFETY: the caller's arguments (MPI preconditions).
            unsafe {
                let outcome = coll::alltoallv(
                    sendbuf, sendcounts, sdispls, sendtype, recvbuf, recvcounts, rdispls, recvtype,
                    comm, commit,
                );
                complete(outcome, None, comm)
            }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Ialltoall(
    sendbuf: *const c_void,
    sendcount: c_int,
    sendtype: ffi::MPI_Datatype,
    recvbuf: *mut c_void,
    recvcount: c_int,
    recvtype: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
    request: *mut ffi::MPI_Request,
) -> c_int {
    boundary(
        "MPI_Ialltoall",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe {
            ffi::PMPI_Ialltoall(
                sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, request,
            )
        },
        |commit| {
            if request.is_null() {
                return Flow::Native;
            }
            // SAFETY: the caller's arguments (MPI preconditions).
            unsafe {
                let outcome = coll::alltoall(
                    sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, commit,
                );
                complete(outcome, Some(request), comm)
            }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Alltoall(
    sendbuf: *const c_void,
    sendcount: c_int,
    sendtype: ffi::MPI_Datatype,
    recvbuf: *mut c_void,
    recvcount: c_int,
    recvtype: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
) -> c_int {
    boundary(
        "MPI_Alltoall",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe {
            ffi::PMPI_Alltoall(
                sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm,
            )
        },
        |commit| {
            // SAFETY: the caller's arguments (MPI preconditions).
            unsafe {
                let outcome = coll::alltoall(
                    sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, commit,
                );
                complete(outcome, None, comm)
            }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Iallgatherv(
    sendbuf: *const c_void,
    sendcount: c_int,
    sendtype: ffi::MPI_Datatype,
    recvbuf: *mut c_void,
    recvcounts: *const c_int,
    displs: *const c_int,
    recvtype: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
    request: *mut ffi::MPI_Request,
) -> c_int {
    boundary(
        "MPI_Iallgatherv",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe {
            ffi::PMPI_Iallgatherv(
                sendbuf, sendcount, sendtype, recvbuf, recvcounts, displs, recvtype, comm, request,
            )
        },
        |commit| {
            if request.is_null() {
                return Flow::Native;
            }
            // SAFETY: the caller's arguments (MPI preconditions).
            unsafe {
                let outcome = coll::allgatherv(
                    sendbuf, sendcount, sendtype, recvbuf, recvcounts, displs, recvtype, comm,
                    false, commit,
                );
                complete(outcome, Some(request), comm)
            }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Allgatherv(
    sendbuf: *const c_void,
    sendcount: c_int,
    sendtype: ffi::MPI_Datatype,
    recvbuf: *mut c_void,
    recvcounts: *const c_int,
    displs: *const c_int,
    recvtype: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
) -> c_int {
    boundary(
        "MPI_Allgatherv",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe {
            ffi::PMPI_Allgatherv(
                sendbuf, sendcount, sendtype, recvbuf, recvcounts, displs, recvtype, comm,
            )
        },
        |commit| {
            // SAFETY: the caller's arguments (MPI preconditions).
            unsafe {
                let outcome = coll::allgatherv(
                    sendbuf, sendcount, sendtype, recvbuf, recvcounts, displs, recvtype, comm,
                    true, commit,
                );
                complete(outcome, None, comm)
            }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Iallgather(
    sendbuf: *const c_void,
    sendcount: c_int,
    sendtype: ffi::MPI_Datatype,
    recvbuf: *mut c_void,
    recvcount: c_int,
    recvtype: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
    request: *mut ffi::MPI_Request,
) -> c_int {
    boundary(
        "MPI_Iallgather",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe {
            ffi::PMPI_Iallgather(
                sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, request,
            )
        },
        |commit| {
            if request.is_null() {
                return Flow::Native;
            }
            // SAFETY: the caller's arguments (MPI preconditions).
            unsafe {
                let outcome = coll::allgather(
                    sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, false, commit,
                );
                complete(outcome, Some(request), comm)
            }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Allgather(
    sendbuf: *const c_void,
    sendcount: c_int,
    sendtype: ffi::MPI_Datatype,
    recvbuf: *mut c_void,
    recvcount: c_int,
    recvtype: ffi::MPI_Datatype,
    comm: ffi::MPI_Comm,
) -> c_int {
    boundary(
        "MPI_Allgather",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe {
            ffi::PMPI_Allgather(
                sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm,
            )
        },
        |commit| {
            // SAFETY: the caller's arguments (MPI preconditions).
            unsafe {
                let outcome = coll::allgather(
                    sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, true, commit,
                );
                complete(outcome, None, comm)
            }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Wait(
    request: *mut ffi::MPI_Request,
    status: *mut ffi::MPI_Status,
) -> c_int {
    boundary(
        "MPI_Wait",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe { ffi::PMPI_Wait(request, status) },
        // SAFETY: as above.
        |commit| unsafe { wait::wait(request, status, commit) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Test(
    request: *mut ffi::MPI_Request,
    flag: *mut c_int,
    status: *mut ffi::MPI_Status,
) -> c_int {
    boundary(
        "MPI_Test",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe { ffi::PMPI_Test(request, flag, status) },
        // SAFETY: as above.
        |commit| unsafe { wait::test(request, flag, status, commit) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Waitall(
    count: c_int,
    array_of_requests: *mut ffi::MPI_Request,
    array_of_statuses: *mut ffi::MPI_Status,
) -> c_int {
    boundary(
        "MPI_Waitall",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe { ffi::PMPI_Waitall(count, array_of_requests, array_of_statuses) },
        // SAFETY: as above.
        |commit| unsafe { wait::waitall(count, array_of_requests, array_of_statuses, commit) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Testall(
    count: c_int,
    array_of_requests: *mut ffi::MPI_Request,
    flag: *mut c_int,
    array_of_statuses: *mut ffi::MPI_Status,
) -> c_int {
    boundary(
        "MPI_Testall",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe { ffi::PMPI_Testall(count, array_of_requests, flag, array_of_statuses) },
        // SAFETY: as above.
        |commit| unsafe {
            wait::testall(count, array_of_requests, flag, array_of_statuses, commit)
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Waitany(
    count: c_int,
    array_of_requests: *mut ffi::MPI_Request,
    index: *mut c_int,
    status: *mut ffi::MPI_Status,
) -> c_int {
    boundary(
        "MPI_Waitany",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe { ffi::PMPI_Waitany(count, array_of_requests, index, status) },
        // SAFETY: as above.
        |commit| unsafe { wait::waitany(count, array_of_requests, index, status, commit) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Testany(
    count: c_int,
    array_of_requests: *mut ffi::MPI_Request,
    index: *mut c_int,
    flag: *mut c_int,
    status: *mut ffi::MPI_Status,
) -> c_int {
    boundary(
        "MPI_Testany",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe { ffi::PMPI_Testany(count, array_of_requests, index, flag, status) },
        // SAFETY: as above.
        |commit| unsafe { wait::testany(count, array_of_requests, index, flag, status, commit) },
    )
}

/// The signature of `PMPI_Waitsome` and `PMPI_Testsome`.
type SomeFn = unsafe extern "C" fn(
    c_int,
    *mut ffi::MPI_Request,
    *mut c_int,
    *mut c_int,
    *mut ffi::MPI_Status,
) -> c_int;

/// `MPI_Waitsome` (`blocking`, native `pmpi`) / `MPI_Testsome`.
unsafe fn some(
    name: &'static str,
    blocking: bool,
    pmpi: SomeFn,
    incount: c_int,
    requests: *mut ffi::MPI_Request,
    outcount: *mut c_int,
    indices: *mut c_int,
    statuses: *mut ffi::MPI_Status,
) -> c_int {
    boundary(
        name,
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe { pmpi(incount, requests, outcount, indices, statuses) },
        // SAFETY: as above.
        |commit| unsafe {
            wait::some(
                blocking, incount, requests, outcount, indices, statuses, commit,
            )
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Waitsome(
    incount: c_int,
    array_of_requests: *mut ffi::MPI_Request,
    outcount: *mut c_int,
    array_of_indices: *mut c_int,
    array_of_statuses: *mut ffi::MPI_Status,
) -> c_int {
    // SAFETY: the caller's arguments, passed on unchanged.
    unsafe {
        some(
            "MPI_Waitsome",
            true,
            ffi::PMPI_Waitsome,
            incount,
            array_of_requests,
            outcount,
            array_of_indices,
            array_of_statuses,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Testsome(
    incount: c_int,
    array_of_requests: *mut ffi::MPI_Request,
    outcount: *mut c_int,
    array_of_indices: *mut c_int,
    array_of_statuses: *mut ffi::MPI_Status,
) -> c_int {
    // SAFETY: the caller's arguments, passed on unchanged.
    unsafe {
        some(
            "MPI_Testsome",
            false,
            ffi::PMPI_Testsome,
            incount,
            array_of_requests,
            outcount,
            array_of_indices,
            array_of_statuses,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Request_free(request: *mut ffi::MPI_Request) -> c_int {
    boundary(
        "MPI_Request_free",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe { ffi::PMPI_Request_free(request) },
        // SAFETY: as above.
        |commit| unsafe { wait::request_free(request, commit) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Request_get_status(
    request: ffi::MPI_Request,
    flag: *mut c_int,
    status: *mut ffi::MPI_Status,
) -> c_int {
    boundary(
        "MPI_Request_get_status",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe { ffi::PMPI_Request_get_status(request, flag, status) },
        // SAFETY: as above.
        |commit| unsafe { wait::request_get_status(request, flag, status, commit) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Cancel(request: *mut ffi::MPI_Request) -> c_int {
    boundary(
        "MPI_Cancel",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe { ffi::PMPI_Cancel(request) },
        // SAFETY: as above.
        |commit| unsafe { wait::cancel(request, commit) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Ibcast(
    buffer: *mut c_void,
    count: c_int,
    datatype: ffi::MPI_Datatype,
    root: c_int,
    comm: ffi::MPI_Comm,
    request: *mut ffi::MPI_Request,
) -> c_int {
    boundary(
        "MPI_Ibcast",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe { ffi::PMPI_Ibcast(buffer, count, datatype, root, comm, request) },
        |commit| {
            if request.is_null() {
                return Flow::Native;
            }
            // SAFETY: the caller's arguments (MPI preconditions).
            unsafe {
                let outcome = coll::bcast(buffer, count, datatype, root, comm, false, commit);
                complete(outcome, Some(request), comm)
            }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn MPI_Bcast(
    buffer: *mut c_void,
    count: c_int,
    datatype: ffi::MPI_Datatype,
    root: c_int,
    comm: ffi::MPI_Comm,
) -> c_int {
    boundary(
        "MPI_Bcast",
        // SAFETY: the caller's arguments, passed on unchanged.
        || unsafe { ffi::PMPI_Bcast(buffer, count, datatype, root, comm) },
        |commit| {
            // SAFETY: the caller's arguments (MPI preconditions).
            unsafe {
                let outcome = coll::bcast(buffer, count, datatype, root, comm, true, commit);
                complete(outcome, None, comm)
            }
        },
    )
}
