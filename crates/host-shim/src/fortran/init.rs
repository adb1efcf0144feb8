//! `MPI_INIT`, `MPI_INIT_THREAD` and `MPI_FINALIZE` from Fortran: the library's own Fortran
//! function (which also sets up the library's Fortran side, its sentinels among them), with
//! the shim's start-up after it and its shutdown before it, as the C entry points do.

use super::abi::Fint;
use super::fortran;
use crate::boundary::{boundary, Flow};
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::c_int;

type Out = *mut Fint;
type In = *const Fint;

/// Whether MPI is initialised (the Fortran `ierror` of `mpi_f08` may be absent).
fn initialized() -> bool {
    let mut flag: c_int = 0;
    // SAFETY: a valid out-pointer; callable at any time.
    unsafe { ffi::PMPI_Initialized(&mut flag) == consts::SUCCESS() && flag != 0 }
}

/// The native initialisation, then the shim's start-up once MPI is initialised.
fn start_after(name: &'static str, native: &dyn Fn()) {
    let native_rc = || {
        native();
        if initialized() {
            consts::SUCCESS()
        } else {
            consts::ERR_OTHER()
        }
    };
    boundary(name, native_rc, |commit| {
        native();
        commit.mark();
        if initialized() {
            // SAFETY: MPI is initialised, on this thread.
            unsafe { crate::lifecycle::start() };
        }
        Flow::Done(consts::SUCCESS())
    });
}

unsafe fn init(name: &'static str, native: &dyn Fn(), _ierr: Out) {
    start_after(name, native);
}

unsafe fn init_thread(
    name: &'static str,
    native: &dyn Fn(),
    _required: In,
    _provided: Out,
    _ierr: Out,
) {
    start_after(name, native);
}

unsafe fn finalize(name: &'static str, native: &dyn Fn(), _ierr: Out) {
    let native_rc = || {
        native();
        consts::SUCCESS()
    };
    boundary(name, native_rc, |_| {
        if initialized() {
            // SAFETY: MPI is initialised (the caller finalises it next).
            unsafe { crate::lifecycle::finish() };
        }
        Flow::Native
    });
}

fortran! {
    fn init = mpi_init / MPI_INIT(ierr: Out);
    fn init_thread = mpi_init_thread / MPI_INIT_THREAD(
        required: In, provided: Out, ierr: Out,
    );
    fn finalize = mpi_finalize / MPI_FINALIZE(ierr: Out);
}
