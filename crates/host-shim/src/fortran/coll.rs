//! The offloaded collectives called from Fortran, blocking and nonblocking.
//!
//! Each converts its arguments (`abi.rs`) and calls the shim's C entry point of the same
//! collective, which offloads it or runs `PMPI_*`; a nonblocking one gives the program the
//! Fortran value of the request it got (`requests.rs`). With the shim not active the library's
//! own Fortran function runs instead, unchanged.

use super::abi::{self, Fint};
use super::requests;
use super::{fortran, run, Outcome};
use crate::state::is_active;
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::{c_int, c_void};

type Buf = *mut c_void;
type Ints = *const Fint;
type Handle = *const Fint;
type Out = *mut Fint;

/// Runs `call` (the C entry point on converted arguments) for the Fortran call `name`, or the
/// native Fortran function when the shim is not active. `call` gets the C request to fill
/// when `request` (the Fortran one) is given, whose Fortran value is then stored.
unsafe fn collective(
    name: &str,
    native: &dyn Fn(),
    request: Option<Out>,
    ierr: Out,
    call: impl FnOnce(*mut ffi::MPI_Request) -> c_int,
) {
    run(name, native, ierr, |committed| {
        if !is_active() {
            return Outcome::Native;
        }
        let mut c_request = consts::REQUEST_NULL();
        let c_request_ptr = match request {
            Some(_) => &mut c_request as *mut ffi::MPI_Request,
            None => std::ptr::null_mut(),
        };
        *committed = true;
        let code = call(c_request_ptr);
        if let Some(request) = request {
            if code == consts::SUCCESS() && !request.is_null() {
                // SAFETY: the caller's request variable.
                unsafe { *request = requests::c2f(c_request) };
            }
        }
        Outcome::Done(code)
    })
}

/// `MPI_ALLTOALLV`, `MPI_IALLTOALLV` (with `request`).
unsafe fn alltoallv(
    name: &str,
    native: &dyn Fn(),
    sendbuf: Buf,
    sendcounts: Ints,
    sdispls: Ints,
    sendtype: Handle,
    recvbuf: Buf,
    recvcounts: Ints,
    rdispls: Ints,
    recvtype: Handle,
    comm: Handle,
    request: Option<Out>,
    ierr: Out,
) {
    // SAFETY (every block below): the caller's arguments, as MPI requires them.
    unsafe {
        collective(name, native, request, ierr, |req| {
            let (st, rt, c) = (
                abi::type_f2c(*sendtype),
                abi::type_f2c(*recvtype),
                abi::comm_f2c(*comm),
            );
            let (sb, rb) = (abi::buffer(sendbuf), abi::buffer(recvbuf));
            if req.is_null() {
                crate::MPI_Alltoallv(sb, sendcounts, sdispls, st, rb, recvcounts, rdispls, rt, c)
            } else {
                crate::MPI_Ialltoallv(
                    sb, sendcounts, sdispls, st, rb, recvcounts, rdispls, rt, c, req,
                )
            }
        })
    }
}

/// The C entry points of a collective whose ranks all send and receive one count (`MPI_ALLTOALL`,
/// `MPI_ALLGATHER`): blocking and nonblocking.
type EqualCounts = (
    unsafe extern "C" fn(
        *const c_void,
        c_int,
        ffi::MPI_Datatype,
        *mut c_void,
        c_int,
        ffi::MPI_Datatype,
        ffi::MPI_Comm,
    ) -> c_int,
    unsafe extern "C" fn(
        *const c_void,
        c_int,
        ffi::MPI_Datatype,
        *mut c_void,
        c_int,
        ffi::MPI_Datatype,
        ffi::MPI_Comm,
        *mut ffi::MPI_Request,
    ) -> c_int,
);

/// `MPI_ALLTOALL`/`MPI_ALLGATHER` and their nonblocking forms (with `request`): each side is
/// (buffer, count, type).
unsafe fn equal_counts(
    (blocking, nonblocking): EqualCounts,
    name: &str,
    native: &dyn Fn(),
    (sendbuf, sendcount, sendtype): (Buf, Ints, Handle),
    (recvbuf, recvcount, recvtype): (Buf, Ints, Handle),
    comm: Handle,
    request: Option<Out>,
    ierr: Out,
) {
    // SAFETY: as above.
    unsafe {
        collective(name, native, request, ierr, |req| {
            let (st, rt, c) = (
                abi::type_f2c(*sendtype),
                abi::type_f2c(*recvtype),
                abi::comm_f2c(*comm),
            );
            let (sb, rb) = (abi::buffer(sendbuf), abi::buffer(recvbuf));
            if req.is_null() {
                blocking(sb, *sendcount, st, rb, *recvcount, rt, c)
            } else {
                nonblocking(sb, *sendcount, st, rb, *recvcount, rt, c, req)
            }
        })
    }
}

unsafe fn alltoall(
    name: &str,
    native: &dyn Fn(),
    sendbuf: Buf,
    sendcount: Ints,
    sendtype: Handle,
    recvbuf: Buf,
    recvcount: Ints,
    recvtype: Handle,
    comm: Handle,
    request: Option<Out>,
    ierr: Out,
) {
    // SAFETY: the caller's arguments.
    unsafe {
        equal_counts(
            (crate::MPI_Alltoall, crate::MPI_Ialltoall),
            name,
            native,
            (sendbuf, sendcount, sendtype),
            (recvbuf, recvcount, recvtype),
            comm,
            request,
            ierr,
        )
    }
}

unsafe fn allgatherv(
    name: &str,
    native: &dyn Fn(),
    sendbuf: Buf,
    sendcount: Ints,
    sendtype: Handle,
    recvbuf: Buf,
    recvcounts: Ints,
    displs: Ints,
    recvtype: Handle,
    comm: Handle,
    request: Option<Out>,
    ierr: Out,
) {
    // SAFETY: as above.
    unsafe {
        collective(name, native, request, ierr, |req| {
            let (st, rt, c) = (
                abi::type_f2c(*sendtype),
                abi::type_f2c(*recvtype),
                abi::comm_f2c(*comm),
            );
            let (sb, rb) = (abi::buffer(sendbuf), abi::buffer(recvbuf));
            if req.is_null() {
                crate::MPI_Allgatherv(sb, *sendcount, st, rb, recvcounts, displs, rt, c)
            } else {
                crate::MPI_Iallgatherv(sb, *sendcount, st, rb, recvcounts, displs, rt, c, req)
            }
        })
    }
}

unsafe fn allgather(
    name: &str,
    native: &dyn Fn(),
    sendbuf: Buf,
    sendcount: Ints,
    sendtype: Handle,
    recvbuf: Buf,
    recvcount: Ints,
    recvtype: Handle,
    comm: Handle,
    request: Option<Out>,
    ierr: Out,
) {
    // SAFETY: the caller's arguments.
    unsafe {
        equal_counts(
            (crate::MPI_Allgather, crate::MPI_Iallgather),
            name,
            native,
            (sendbuf, sendcount, sendtype),
            (recvbuf, recvcount, recvtype),
            comm,
            request,
            ierr,
        )
    }
}

unsafe fn bcast(
    name: &str,
    native: &dyn Fn(),
    buffer: Buf,
    count: Ints,
    datatype: Handle,
    root: Ints,
    comm: Handle,
    request: Option<Out>,
    ierr: Out,
) {
    // SAFETY: as above.
    unsafe {
        collective(name, native, request, ierr, |req| {
            let (t, c) = (abi::type_f2c(*datatype), abi::comm_f2c(*comm));
            let b = abi::buffer(buffer);
            if req.is_null() {
                crate::MPI_Bcast(b, *count, t, *root, c)
            } else {
                crate::MPI_Ibcast(b, *count, t, *root, c, req)
            }
        })
    }
}

/// `MPI_ALLREDUCE`, `MPI_IALLREDUCE`: offloaded as from C (`reduce.rs`: the Fortran
/// `INTEGER`, `INTEGER4`, `INTEGER8`, `REAL`, `REAL4`, `REAL8` and `DOUBLE PRECISION` types
/// are mapped; `LOGICAL` and the rest run natively).
unsafe fn allreduce(
    name: &str,
    native: &dyn Fn(),
    sendbuf: Buf,
    recvbuf: Buf,
    count: Ints,
    datatype: Handle,
    op: Handle,
    comm: Handle,
    request: Option<Out>,
    ierr: Out,
) {
    // SAFETY: as above.
    unsafe {
        collective(name, native, request, ierr, |req| {
            let (t, o, c) = (
                abi::type_f2c(*datatype),
                abi::op_f2c(*op),
                abi::comm_f2c(*comm),
            );
            let (sb, rb) = (abi::buffer(sendbuf), abi::buffer(recvbuf));
            if req.is_null() {
                crate::MPI_Allreduce(sb, rb, *count, t, o, c)
            } else {
                crate::MPI_Iallreduce(sb, rb, *count, t, o, c, req)
            }
        })
    }
}

/// The blocking and the nonblocking entry of each collective, with the Fortran argument lists.
macro_rules! blocking_and_nonblocking {
    ($(
        $imp:ident: $lower:ident / $upper:ident, $ilower:ident / $iupper:ident
            ($($arg:ident: $ty:ty),*);
    )*) => {$(
        unsafe fn $lower(name: &str, native: &dyn Fn(), $($arg: $ty,)* ierr: Out) {
            // SAFETY: the caller's arguments.
            unsafe { $imp(name, native, $($arg,)* None, ierr) }
        }
        unsafe fn $ilower(name: &str, native: &dyn Fn(), $($arg: $ty,)* request: Out, ierr: Out) {
            // SAFETY: the caller's arguments.
            unsafe { $imp(name, native, $($arg,)* Some(request), ierr) }
        }
        fortran! {
            fn $lower = $lower / $upper($($arg: $ty,)* ierr: Out);
            fn $ilower = $ilower / $iupper($($arg: $ty,)* request: Out, ierr: Out);
        }
    )*};
}

blocking_and_nonblocking! {
    alltoallv: mpi_alltoallv / MPI_ALLTOALLV, mpi_ialltoallv / MPI_IALLTOALLV(
        sendbuf: Buf, sendcounts: Ints, sdispls: Ints, sendtype: Handle, recvbuf: Buf,
        recvcounts: Ints, rdispls: Ints, recvtype: Handle, comm: Handle
    );
    alltoall: mpi_alltoall / MPI_ALLTOALL, mpi_ialltoall / MPI_IALLTOALL(
        sendbuf: Buf, sendcount: Ints, sendtype: Handle, recvbuf: Buf, recvcount: Ints,
        recvtype: Handle, comm: Handle
    );
    allgatherv: mpi_allgatherv / MPI_ALLGATHERV, mpi_iallgatherv / MPI_IALLGATHERV(
        sendbuf: Buf, sendcount: Ints, sendtype: Handle, recvbuf: Buf, recvcounts: Ints,
        displs: Ints, recvtype: Handle, comm: Handle
    );
    allgather: mpi_allgather / MPI_ALLGATHER, mpi_iallgather / MPI_IALLGATHER(
        sendbuf: Buf, sendcount: Ints, sendtype: Handle, recvbuf: Buf, recvcount: Ints,
        recvtype: Handle, comm: Handle
    );
    bcast: mpi_bcast / MPI_BCAST, mpi_ibcast / MPI_IBCAST(
        buffer: Buf, count: Ints, datatype: Handle, root: Ints, comm: Handle
    );
    allreduce: mpi_allreduce / MPI_ALLREDUCE, mpi_iallreduce / MPI_IALLREDUCE(
        sendbuf: Buf, recvbuf: Buf, count: Ints, datatype: Handle, op: Handle, comm: Handle
    );
}
