//! The Fortran entry points: the offloaded collectives, the Wait/Test family and
//! `MPI_Init`/`MPI_Init_thread`/`MPI_Finalize`, called from `mpif.h`, `use mpi` and
//! `use mpi_f08` programs.
//!
//! The MPI libraries' Fortran bindings call the C `PMPI_*` functions (Open MPI) or internal
//! ones directly, so a Fortran program never reaches the shim's C entry points. The shim
//! therefore exports the Fortran symbols too, under every name the library itself exports for
//! them: `mpi_x_`, `mpi_x__`, `mpi_x`, `MPI_X` (the manglings of `mpif.h` and `use mpi`
//! compilers) and `mpi_x_f08_` (Open MPI's `use mpi_f08` subroutines, whose handles are
//! derived types of one integer, passed by reference, and whose `ierror` is optional: a null
//! pointer when absent). Every argument of a Fortran call is a pointer, so one entry serves
//! all the names.
//!
//! An entry converts its arguments as the library's binding does (handles with the library's
//! `f2c`, the Fortran `MPI_IN_PLACE`/`MPI_BOTTOM` into C's, statuses with `MPI_Status_f2c`/
//! `c2f`, requests through `requests.rs`, `abi.rs` holding what differs between libraries),
//! calls the shim's own C entry point (`crate::MPI_*`), which offloads or runs the native
//! `PMPI_*` function exactly as for a C program, and stores the return code in `ierror`.
//! Where the shim has nothing to do (it is not active, and no Fortran request variable may
//! hold one of its requests), or if the conversion panicked before anything was handed to the
//! shim, the call goes to the library's own Fortran symbol of the same name (`dlsym(RTLD_NEXT)`)
//! with the caller's arguments: a native job behaves exactly as without the shim.
//!
//! Module map: `abi` (handle conversion and sentinels), `requests` (Fortran values of the
//! shim's requests), `coll` (the collectives), `wait` (the Wait/Test family), `init`
//! (start-up and shutdown).

mod abi;
mod coll;
mod init;
mod requests;
mod wait;

use crate::boundary::say;
use abi::Fint;
use mpi_ffi::consts;
use std::os::raw::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The MPI library's definition of a Fortran symbol the shim also defines: the next one after
/// the shim in the lookup order (`RTLD_NEXT`), found at the first call.
pub(crate) struct Next {
    name: &'static str,
    addr: AtomicUsize,
}

impl Next {
    /// `name` ends with a NUL.
    pub(crate) const fn new(name: &'static str) -> Self {
        Next {
            name,
            addr: AtomicUsize::new(0),
        }
    }

    /// The address of the library's function. A program that calls a Fortran MPI symbol is
    /// linked with the library defining it, so a missing one is a broken installation: the
    /// process says so and aborts.
    pub(crate) fn get(&self) -> *const c_void {
        let mut addr = self.addr.load(Ordering::Acquire);
        if addr == 0 {
            // SAFETY: a NUL-terminated name.
            addr = unsafe { libc::dlsym(libc::RTLD_NEXT, self.name.as_ptr().cast()) } as usize;
            if addr == 0 {
                say!(
                    "the MPI library defines no {}: cannot run this Fortran call",
                    self.name.trim_end_matches('\0')
                );
                std::process::abort();
            }
            self.addr.store(addr, Ordering::Release);
        }
        addr as *const c_void
    }
}

/// What the shim's part of a Fortran call decided.
pub(crate) enum Outcome {
    /// Run the library's own Fortran function on the caller's arguments.
    Native,
    /// Done; `ierror` gets this code.
    Done(c_int),
}

/// Stores `code` in an `ierror` argument (absent in `mpi_f08` when null).
///
/// # Safety
/// `ierr` is null or the caller's `ierror`.
pub(crate) unsafe fn set_ierr(ierr: *mut Fint, code: c_int) {
    if !ierr.is_null() {
        // SAFETY: the caller's ierror.
        unsafe { *ierr = code };
    }
}

/// Runs the shim's part `body` of the Fortran call `name`: `native` when it says so, or when
/// it panicked before setting its `committed` flag (before it handed anything to the shim's C
/// side); a panic after that ends the call with `MPI_ERR_INTERN`.
pub(crate) fn run(
    name: &str,
    native: &dyn Fn(),
    ierr: *mut Fint,
    body: impl FnOnce(&mut bool) -> Outcome,
) {
    let mut committed = false;
    let code = match catch_unwind(AssertUnwindSafe(|| body(&mut committed))) {
        Ok(Outcome::Native) => return native(),
        Ok(Outcome::Done(code)) => code,
        Err(_) if !committed => {
            say!("internal error (panic) in {name}; running this call natively");
            return native();
        }
        Err(_) => {
            say!("internal error (panic) in {name} after the shim took the call over; returning MPI_ERR_INTERN");
            consts::ERR_INTERN()
        }
    };
    // SAFETY: null or the caller's ierror.
    unsafe { set_ierr(ierr, code) };
}

/// Exports one Fortran call under every name of its library:
///
/// ```text
/// fn <module::function> = <lowercase name> / <UPPERCASE NAME>(<pointer arguments>);
/// ```
///
/// defines `name_`, `name__`, `name`, `NAME` and `name_f08_`, each calling
/// `module::function(symbol, native, <arguments>)`, where `native` runs the library's own
/// definition of that symbol on the same arguments.
macro_rules! fortran {
    ($(
        fn $imp:path = $lower:ident / $upper:ident($($arg:ident: $ty:ty),* $(,)?);
    )*) => {$(
        fortran!(@one $imp, ($($arg: $ty),*), concat!(stringify!($lower), "_"));
        fortran!(@one $imp, ($($arg: $ty),*), concat!(stringify!($lower), "__"));
        fortran!(@one $imp, ($($arg: $ty),*), stringify!($lower));
        fortran!(@one $imp, ($($arg: $ty),*), stringify!($upper));
        fortran!(@one $imp, ($($arg: $ty),*), concat!(stringify!($lower), "_f08_"));
    )*};
    (@one $imp:path, ($($arg:ident: $ty:ty),*), $sym:expr) => {
        const _: () = {
            #[export_name = $sym]
            unsafe extern "C" fn entry($($arg: $ty),*) {
                static NEXT: $crate::fortran::Next = $crate::fortran::Next::new(concat!($sym, "\0"));
                let native = || {
                    // SAFETY: the library's definition of this very symbol: a Fortran
                    // subroutine taking these pointers.
                    let f: unsafe extern "C" fn($($ty),*) =
                        unsafe { std::mem::transmute(NEXT.get()) };
                    // SAFETY: the caller's arguments, passed on unchanged.
                    unsafe { f($($arg),*) }
                };
                // SAFETY: the caller's arguments (the MPI call's preconditions).
                unsafe { $imp($sym, &native, $($arg),*) }
            }
        };
    };
}
pub(crate) use fortran;
