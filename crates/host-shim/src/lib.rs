//! `libhost_shim.so` is LD_PRELOADed into unmodified MPI programs and, through PMPI
//! interposition, hands their alltoall(v) and allgather(v) collectives, blocking and
//! nonblocking (`MPI_Alltoallv`, `MPI_Ialltoallv`, `MPI_Alltoall`, `MPI_Ialltoall`,
//! `MPI_Allgatherv`, `MPI_Iallgatherv`, `MPI_Allgather`, `MPI_Iallgather`; `MPI_Bcast`,
//! `MPI_Ibcast`; `MPI_Allreduce`, `MPI_Iallreduce` with `SPOFF_ALLREDUCE_DESIGN=sp-tree`, `canary` or `auto`), to the rank's
//! service process (SP): it posts a descriptor over a Unix socket with grants on the buffers
//! (an allgather(v) as the SP's hierarchical allgatherv, with the node of every member), and
//! completes the request when the SP writes a completion token into the rank's mailbox; it
//! intercepts the whole Wait/Test family so its requests and native ones mix freely. It never
//! changes what a program computes (but for the order in which an offloaded floating-point
//! allreduce combines the ranks' values: a result within the rounding that order allows,
//! the same on every rank; `reduce.rs`): any datatype and `MPI_IN_PLACE` are offloaded (sides that
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
//! default 1024; a collective posted while all are taken completes by a message), `SPOFF_BACKEND=cma|ucx|ucx-export`
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
//! collective), `design` (the staged designs and other per-job settings), `fortran` (the
//! Fortran entry points, which convert their arguments and call the C ones).
#![deny(unsafe_op_in_unsafe_fn)]
// The exported functions keep MPI's names and signatures.
#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

mod arena;
mod boundary;
pub mod breakdown;
mod cma;
mod coll;
mod comm;
mod completion;
mod conn;
mod datatype;
mod design;
mod fortran;
mod grants;
#[cfg(test)]
mod kinds_agree;
mod lifecycle;
mod pack;
mod post;
mod post_ring;
mod reduce;
mod request;
mod segment;
mod serves;
mod state;
mod wait;

pub mod backoff;
pub mod layout;
pub mod recycle;
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

/// Exports communicator constructors that agree on the new communicator's identity at once
/// (`comm::agree_new`): `fn MPI_X = PMPI_X(<arguments>) -> <the new communicator's pointer>;`.
/// The native call runs first and its result is returned as it is. `MPI_Comm_idup` is not among
/// them (nonblocking: its communicator agrees at its first offloaded collective), nor are the
/// Fortran bindings of Open MPI, which call the `PMPI_` constructors directly.
macro_rules! comm_constructor {
    ($(fn $name:ident = $pmpi:ident($($arg:ident: $ty:ty),* $(,)?) -> $new:ident;)*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
            // SAFETY: the caller's arguments, passed on unchanged.
            let rc = unsafe { ffi::$pmpi($($arg),*) };
            // SAFETY: MPI is initialised (the constructor's precondition); `$new` is its
            // out-pointer.
            unsafe { comm::agree_new(rc, $new) };
            rc
        }
    )*};
}

comm_constructor! {
    fn MPI_Comm_dup = PMPI_Comm_dup(comm: ffi::MPI_Comm, newcomm: *mut ffi::MPI_Comm) -> newcomm;
    fn MPI_Comm_dup_with_info = PMPI_Comm_dup_with_info(
        comm: ffi::MPI_Comm, info: ffi::MPI_Info, newcomm: *mut ffi::MPI_Comm,
    ) -> newcomm;
    fn MPI_Comm_split = PMPI_Comm_split(
        comm: ffi::MPI_Comm, color: c_int, key: c_int, newcomm: *mut ffi::MPI_Comm,
    ) -> newcomm;
    fn MPI_Comm_split_type = PMPI_Comm_split_type(
        comm: ffi::MPI_Comm, split_type: c_int, key: c_int, info: ffi::MPI_Info,
        newcomm: *mut ffi::MPI_Comm,
    ) -> newcomm;
    fn MPI_Comm_create = PMPI_Comm_create(
        comm: ffi::MPI_Comm, group: ffi::MPI_Group, newcomm: *mut ffi::MPI_Comm,
    ) -> newcomm;
    fn MPI_Comm_create_group = PMPI_Comm_create_group(
        comm: ffi::MPI_Comm, group: ffi::MPI_Group, tag: c_int, newcomm: *mut ffi::MPI_Comm,
    ) -> newcomm;
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
            // SAFETY: the caller's request slot; `addr` was just posted and is ours.
            unsafe { *request = request::handle_of(addr) };
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

/// Exports the blocking and the nonblocking entry point of one collective:
///
/// ```text
/// fn MPI_X / MPI_IX = PMPI_X / PMPI_IX(<the arguments of MPI_X>) on <its communicator>
///     => |commit, blocking| <the offload attempt, a `coll::` call>;
/// ```
///
/// `MPI_IX` takes the same arguments and then `request`. Each runs through [`boundary`]: the
/// native function is its `PMPI_*` twin on the caller's arguments; the shim's part is the
/// offload attempt (`blocking` tells which of the two runs it), completed by [`complete`]. A
/// nonblocking call with a null `request` is left to the native function, which reports it.
macro_rules! collective {
    ($(
        fn $name:ident / $iname:ident = $pmpi:ident / $ipmpi:ident(
            $($arg:ident: $ty:ty),* $(,)?
        ) on $comm:ident => |$commit:ident, $blocking:ident| $offload:expr;
    )*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
            boundary(
                stringify!($name),
                // SAFETY: the caller's arguments, passed on unchanged.
                || unsafe { ffi::$pmpi($($arg),*) },
                |$commit| {
                    let $blocking = true;
                    // SAFETY: the caller's arguments (MPI preconditions).
                    unsafe { complete($offload, None, $comm) }
                },
            )
        }

        #[no_mangle]
        pub unsafe extern "C" fn $iname(
            $($arg: $ty,)*
            request: *mut ffi::MPI_Request,
        ) -> c_int {
            boundary(
                stringify!($iname),
                // SAFETY: the caller's arguments, passed on unchanged.
                || unsafe { ffi::$ipmpi($($arg,)* request) },
                |$commit| {
                    if request.is_null() {
                        return Flow::Native;
                    }
                    let $blocking = false;
                    // SAFETY: the caller's arguments (MPI preconditions).
                    unsafe { complete($offload, Some(request), $comm) }
                },
            )
        }
    )*};
}

collective! {
    fn MPI_Alltoallv / MPI_Ialltoallv = PMPI_Alltoallv / PMPI_Ialltoallv(
        sendbuf: *const c_void, sendcounts: *const c_int, sdispls: *const c_int,
        sendtype: ffi::MPI_Datatype, recvbuf: *mut c_void, recvcounts: *const c_int,
        rdispls: *const c_int, recvtype: ffi::MPI_Datatype, comm: ffi::MPI_Comm,
    ) on comm => |commit, _blocking| coll::alltoallv(
        sendbuf, sendcounts, sdispls, sendtype, recvbuf, recvcounts, rdispls, recvtype, comm,
        commit,
    );

    fn MPI_Alltoall / MPI_Ialltoall = PMPI_Alltoall / PMPI_Ialltoall(
        sendbuf: *const c_void, sendcount: c_int, sendtype: ffi::MPI_Datatype,
        recvbuf: *mut c_void, recvcount: c_int, recvtype: ffi::MPI_Datatype, comm: ffi::MPI_Comm,
    ) on comm => |commit, _blocking| coll::alltoall(
        sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, commit,
    );

    fn MPI_Allgatherv / MPI_Iallgatherv = PMPI_Allgatherv / PMPI_Iallgatherv(
        sendbuf: *const c_void, sendcount: c_int, sendtype: ffi::MPI_Datatype,
        recvbuf: *mut c_void, recvcounts: *const c_int, displs: *const c_int,
        recvtype: ffi::MPI_Datatype, comm: ffi::MPI_Comm,
    ) on comm => |commit, blocking| coll::allgatherv(
        sendbuf, sendcount, sendtype, recvbuf, recvcounts, displs, recvtype, comm, blocking,
        commit,
    );

    fn MPI_Allgather / MPI_Iallgather = PMPI_Allgather / PMPI_Iallgather(
        sendbuf: *const c_void, sendcount: c_int, sendtype: ffi::MPI_Datatype,
        recvbuf: *mut c_void, recvcount: c_int, recvtype: ffi::MPI_Datatype, comm: ffi::MPI_Comm,
    ) on comm => |commit, blocking| coll::allgather(
        sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, blocking, commit,
    );

    fn MPI_Allreduce / MPI_Iallreduce = PMPI_Allreduce / PMPI_Iallreduce(
        sendbuf: *const c_void, recvbuf: *mut c_void, count: c_int,
        datatype: ffi::MPI_Datatype, op: ffi::MPI_Op, comm: ffi::MPI_Comm,
    ) on comm => |commit, blocking| coll::allreduce(
        sendbuf, recvbuf, count, datatype, op, comm, blocking, commit,
    );

    fn MPI_Bcast / MPI_Ibcast = PMPI_Bcast / PMPI_Ibcast(
        buffer: *mut c_void, count: c_int, datatype: ffi::MPI_Datatype, root: c_int,
        comm: ffi::MPI_Comm,
    ) on comm => |commit, blocking| coll::bcast(
        buffer, count, datatype, root, comm, blocking, commit,
    );
}

/// Exports calls of the Wait/Test family:
///
/// ```text
/// fn MPI_X(<the arguments of MPI_X>) = PMPI_X / <the shim's part, a `wait::` function>;
/// fn MPI_Y(<the arguments of MPI_Y>) = PMPI_Y / wait::f(<arguments before MPI_Y's>);
/// ```
///
/// Each runs through [`boundary`]: the native function is `PMPI_X` on the caller's arguments;
/// the shim's part is called with the leading arguments given (if any), the caller's
/// arguments and the call's [`boundary::Commit`].
macro_rules! request_call {
    ($(
        fn $name:ident($($arg:ident: $ty:ty),* $(,)?)
            = $pmpi:ident / $($shim:ident)::+ $(($($lead:expr),*))?;
    )*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
            boundary(
                stringify!($name),
                // SAFETY: the caller's arguments, passed on unchanged.
                || unsafe { ffi::$pmpi($($arg),*) },
                // SAFETY: as above.
                |commit| unsafe { $($shim)::+($($($lead,)*)? $($arg,)* commit) },
            )
        }
    )*};
}

request_call! {
    fn MPI_Wait(request: *mut ffi::MPI_Request, status: *mut ffi::MPI_Status)
        = PMPI_Wait / wait::wait;

    fn MPI_Test(request: *mut ffi::MPI_Request, flag: *mut c_int, status: *mut ffi::MPI_Status)
        = PMPI_Test / wait::test;

    fn MPI_Waitall(
        count: c_int, array_of_requests: *mut ffi::MPI_Request,
        array_of_statuses: *mut ffi::MPI_Status,
    ) = PMPI_Waitall / wait::waitall;

    fn MPI_Testall(
        count: c_int, array_of_requests: *mut ffi::MPI_Request, flag: *mut c_int,
        array_of_statuses: *mut ffi::MPI_Status,
    ) = PMPI_Testall / wait::testall;

    fn MPI_Waitany(
        count: c_int, array_of_requests: *mut ffi::MPI_Request, index: *mut c_int,
        status: *mut ffi::MPI_Status,
    ) = PMPI_Waitany / wait::waitany;

    fn MPI_Testany(
        count: c_int, array_of_requests: *mut ffi::MPI_Request, index: *mut c_int,
        flag: *mut c_int, status: *mut ffi::MPI_Status,
    ) = PMPI_Testany / wait::testany;

    fn MPI_Waitsome(
        incount: c_int, array_of_requests: *mut ffi::MPI_Request, outcount: *mut c_int,
        array_of_indices: *mut c_int, array_of_statuses: *mut ffi::MPI_Status,
    ) = PMPI_Waitsome / wait::some(true);

    fn MPI_Testsome(
        incount: c_int, array_of_requests: *mut ffi::MPI_Request, outcount: *mut c_int,
        array_of_indices: *mut c_int, array_of_statuses: *mut ffi::MPI_Status,
    ) = PMPI_Testsome / wait::some(false);

    fn MPI_Request_free(request: *mut ffi::MPI_Request)
        = PMPI_Request_free / wait::request_free;

    fn MPI_Request_get_status(
        request: ffi::MPI_Request, flag: *mut c_int, status: *mut ffi::MPI_Status,
    ) = PMPI_Request_get_status / wait::request_get_status;

    fn MPI_Cancel(request: *mut ffi::MPI_Request) = PMPI_Cancel / wait::cancel;
}
