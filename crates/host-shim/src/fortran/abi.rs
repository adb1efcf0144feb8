//! What differs between the MPI libraries' Fortran sides, in one place: how a Fortran handle
//! becomes a C one, and how the Fortran sentinels (`MPI_IN_PLACE`, `MPI_BOTTOM`,
//! `MPI_STATUS_IGNORE`, `MPI_STATUSES_IGNORE`) are recognised.
//!
//! **Handles.** `mpi-ffi`'s `mpiffi_*_f2c`/`_c2f` take the library's own conversion (functions
//! in Open MPI, where a C handle is a pointer and a Fortran one an index into a table; macros in
//! MPICH, where both are the same integer). `MPI_Fint` is the C `int` in both libraries as
//! Debian builds them (gfortran's default `INTEGER`), so Fortran count and displacement arrays
//! are passed to C unchanged.
//!
//! **Sentinels.** A Fortran sentinel is the address of a variable of the MPI library's Fortran
//! side, compared by address as the library itself does:
//! - Open MPI: the common blocks `mpi_fortran_in_place`, `mpi_fortran_bottom`,
//!   `mpi_fortran_status_ignore`, `mpi_fortran_statuses_ignore`, each under every name mangling
//!   the library exports (`x`, `x_`, `x__`, `X`); `use mpi_f08` binds its constants to the
//!   same symbols.
//! - MPICH: `MPIR_F_MPI_IN_PLACE` and `MPIR_F_MPI_BOTTOM` hold the addresses of the `mpifcmb`
//!   common-block variables (recorded by the Fortran `MPI_Init`), `MPIR_F08_MPI_IN_PLACE` and
//!   `MPIR_F08_MPI_BOTTOM` are the `mpi_f08` ones themselves; `MPI_F_STATUS(ES)_IGNORE` and
//!   `MPI_F08_STATUS(ES)_IGNORE` (the C names MPI defines for Fortran's status sentinels) hold
//!   the others, `MPIR_F08_MPI_STATUS(ES)_IGNORE_OBJ` being the `mpi_f08` objects.
//!
//! Symbols are looked up with `dlsym` in the global scope (the program first, then the
//! libraries in load order), which finds the definition every library's references resolve
//! to; a symbol no loaded library defines is simply not a sentinel.

use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::ffi::CStr;
use std::os::raw::{c_int, c_void};
use std::sync::OnceLock;

/// Fortran's `INTEGER`, the C `MPI_Fint`.
pub type Fint = c_int;

/// The Fortran `.TRUE.` and `.FALSE.` of gfortran (and of both libraries built with it).
pub const TRUE: Fint = 1;
pub const FALSE: Fint = 0;

/// Where a sentinel's address comes from.
#[derive(Clone, Copy)]
enum Source {
    /// The symbol's own address is the sentinel.
    Addr(&'static CStr),
    /// The symbol is a pointer variable holding the sentinel (read at each use: MPICH sets it
    /// in the Fortran `MPI_Init`).
    Value(&'static CStr),
}

/// One sentinel: the symbols it may be, resolved once.
struct Sentinel {
    sources: &'static [Source],
    resolved: OnceLock<Vec<(bool, usize)>>,
}

impl Sentinel {
    const fn new(sources: &'static [Source]) -> Self {
        Sentinel {
            sources,
            resolved: OnceLock::new(),
        }
    }

    /// Whether `p` is this sentinel.
    fn is(&self, p: *const c_void) -> bool {
        if p.is_null() {
            return false;
        }
        let resolved = self.resolved.get_or_init(|| {
            self.sources
                .iter()
                .filter_map(|s| {
                    let (value, name) = match *s {
                        Source::Addr(n) => (false, n),
                        Source::Value(n) => (true, n),
                    };
                    // SAFETY: a NUL-terminated name; RTLD_DEFAULT searches the global scope.
                    let addr = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
                    (!addr.is_null()).then_some((value, addr as usize))
                })
                .collect()
        });
        resolved.iter().any(|&(value, addr)| {
            let sentinel = if value {
                // SAFETY: the symbol is a pointer variable of the MPI library (see `Source`).
                unsafe { std::ptr::read_volatile(addr as *const usize) }
            } else {
                addr
            };
            sentinel != 0 && sentinel == p as usize
        })
    }
}

static IN_PLACE: Sentinel = Sentinel::new(&[
    Source::Addr(c"mpi_fortran_in_place"),
    Source::Addr(c"mpi_fortran_in_place_"),
    Source::Addr(c"mpi_fortran_in_place__"),
    Source::Addr(c"MPI_FORTRAN_IN_PLACE"),
    Source::Value(c"MPIR_F_MPI_IN_PLACE"),
    Source::Addr(c"MPIR_F08_MPI_IN_PLACE"),
]);

static BOTTOM: Sentinel = Sentinel::new(&[
    Source::Addr(c"mpi_fortran_bottom"),
    Source::Addr(c"mpi_fortran_bottom_"),
    Source::Addr(c"mpi_fortran_bottom__"),
    Source::Addr(c"MPI_FORTRAN_BOTTOM"),
    Source::Value(c"MPIR_F_MPI_BOTTOM"),
    Source::Addr(c"MPIR_F08_MPI_BOTTOM"),
]);

static STATUS_IGNORE: Sentinel = Sentinel::new(&[
    Source::Addr(c"mpi_fortran_status_ignore"),
    Source::Addr(c"mpi_fortran_status_ignore_"),
    Source::Addr(c"mpi_fortran_status_ignore__"),
    Source::Addr(c"MPI_FORTRAN_STATUS_IGNORE"),
    Source::Value(c"MPI_F_STATUS_IGNORE"),
    Source::Addr(c"MPIR_F08_MPI_STATUS_IGNORE_OBJ"),
    Source::Value(c"MPI_F08_STATUS_IGNORE"),
]);

static STATUSES_IGNORE: Sentinel = Sentinel::new(&[
    Source::Addr(c"mpi_fortran_statuses_ignore"),
    Source::Addr(c"mpi_fortran_statuses_ignore_"),
    Source::Addr(c"mpi_fortran_statuses_ignore__"),
    Source::Addr(c"MPI_FORTRAN_STATUSES_IGNORE"),
    Source::Value(c"MPI_F_STATUSES_IGNORE"),
    Source::Addr(c"MPIR_F08_MPI_STATUSES_IGNORE_OBJ"),
    Source::Value(c"MPI_F08_STATUSES_IGNORE"),
]);

/// The C buffer argument for a Fortran one: `MPI_IN_PLACE` and `MPI_BOTTOM` become C's,
/// anything else is the buffer itself.
pub fn buffer(p: *mut c_void) -> *mut c_void {
    if IN_PLACE.is(p) {
        consts::IN_PLACE()
    } else if BOTTOM.is(p) {
        // C's MPI_BOTTOM is the null address in both libraries.
        std::ptr::null_mut()
    } else {
        p
    }
}

/// Whether a Fortran status argument is `MPI_STATUS_IGNORE` (or absent).
pub fn is_status_ignore(p: *const Fint) -> bool {
    p.is_null() || STATUS_IGNORE.is(p.cast())
}

/// Whether a Fortran status array argument is `MPI_STATUSES_IGNORE` (or absent).
pub fn is_statuses_ignore(p: *const Fint) -> bool {
    p.is_null() || STATUSES_IGNORE.is(p.cast())
}

/// `MPI_STATUS_SIZE`: the Fortran integers of one status (the C status is the same bytes in
/// both libraries: 6 in Open MPI, 5 in MPICH).
pub const STATUS_SIZE: usize = std::mem::size_of::<ffi::MPI_Status>() / std::mem::size_of::<Fint>();

pub fn comm_f2c(f: Fint) -> ffi::MPI_Comm {
    // SAFETY: a pure conversion; an invalid value gives an invalid handle MPI reports.
    unsafe { ffi::mpiffi_comm_f2c(f) }
}

pub fn op_f2c(f: Fint) -> ffi::MPI_Op {
    // SAFETY: as above.
    unsafe { ffi::mpiffi_op_f2c(f) }
}

pub fn type_f2c(f: Fint) -> ffi::MPI_Datatype {
    // SAFETY: as above.
    unsafe { ffi::mpiffi_type_f2c(f) }
}

/// The library's own request conversion (for the shim's requests see `requests.rs`).
pub fn request_f2c(f: Fint) -> ffi::MPI_Request {
    // SAFETY: as above.
    unsafe { ffi::mpiffi_request_f2c(f) }
}

/// The library's own request conversion: only for a native request or `MPI_REQUEST_NULL`
/// (Open MPI reads the request object).
pub fn request_c2f(c: ffi::MPI_Request) -> Fint {
    // SAFETY: a live native request or the null request (caller's precondition).
    unsafe { ffi::mpiffi_request_c2f(c) }
}

/// Whether requests are integers (MPICH) rather than pointers (Open MPI): then a C handle is
/// its own Fortran handle.
pub const INT_REQUESTS: bool =
    std::mem::size_of::<ffi::MPI_Request>() == std::mem::size_of::<Fint>();

/// A C status from a Fortran one (`MPI_Status_f2c`): the C call starts from the bytes the
/// Fortran status holds, so converting back leaves a status the call did not write as it was.
pub unsafe fn status_f2c(f: *const Fint, c: *mut ffi::MPI_Status) {
    // SAFETY: `f` holds STATUS_SIZE integers, `c` is a C status (caller's precondition).
    unsafe { ffi::PMPI_Status_f2c(f, c) };
}

/// `MPI_Status_c2f`.
pub unsafe fn status_c2f(c: *const ffi::MPI_Status, f: *mut Fint) {
    // SAFETY: as above.
    unsafe { ffi::PMPI_Status_c2f(c, f) };
}
