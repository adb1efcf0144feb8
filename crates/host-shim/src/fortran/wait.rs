//! The Wait/Test family called from Fortran, over requests started in Fortran (offloaded or
//! native, and `MPI_REQUEST_NULL`).
//!
//! Each call converts the Fortran requests to C (`requests.rs`), the statuses with
//! `MPI_Status_f2c` (or `MPI_STATUS(ES)_IGNORE`), runs the shim's C function, then converts
//! back: the request variables whose handle changed, every status (one the call did not write
//! converts back to the bytes it held), indices to Fortran's 1-based ones, flags to `LOGICAL`.
//! With the shim not active and no Fortran variable holding one of its requests, the library's
//! own function runs instead.

use super::abi::{self, Fint, STATUS_SIZE};
use super::requests;
use super::{fortran, run, Outcome};
use crate::state::is_active;
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::c_int;

type Out = *mut Fint;
type In = *const Fint;

/// Whether the shim has a part in this call.
fn ours() -> bool {
    is_active() || requests::any()
}

/// The C side of `n` Fortran requests at `f`, and their values before the call.
struct Requests {
    f: Out,
    before: Vec<ffi::MPI_Request>,
    c: Vec<ffi::MPI_Request>,
}

impl Requests {
    /// # Safety
    /// `f` holds `n` request variables.
    unsafe fn new(f: Out, n: usize) -> Self {
        let before: Vec<_> = (0..n)
            // SAFETY: within the caller's array.
            .map(|i| requests::f2c(unsafe { *f.add(i) }))
            .collect();
        Requests {
            f,
            c: before.clone(),
            before,
        }
    }

    fn ptr(&mut self) -> *mut ffi::MPI_Request {
        self.c.as_mut_ptr()
    }

    /// Rewrites the Fortran variables whose handle the call changed.
    fn back(&self) {
        for (i, (&before, &after)) in self.before.iter().zip(&self.c).enumerate() {
            // SAFETY: within the caller's array (`new`).
            unsafe { requests::update(self.f.add(i), before, after) };
        }
    }
}

/// The C side of `n` Fortran statuses at `f` (`None`: ignored).
struct Statuses {
    f: Out,
    c: Option<Vec<ffi::MPI_Status>>,
}

impl Statuses {
    /// One status, or `MPI_STATUS_IGNORE`.
    ///
    /// # Safety
    /// `f` is the caller's status argument.
    unsafe fn one(f: Out) -> Self {
        let ignore = abi::is_status_ignore(f);
        // SAFETY: forwarded.
        unsafe { Self::new(f, 1, ignore) }
    }

    /// An array of `n`, or `MPI_STATUSES_IGNORE`.
    ///
    /// # Safety
    /// `f` is the caller's status array argument, of `n` statuses.
    unsafe fn array(f: Out, n: usize) -> Self {
        let ignore = abi::is_statuses_ignore(f);
        // SAFETY: forwarded.
        unsafe { Self::new(f, n, ignore) }
    }

    unsafe fn new(f: Out, n: usize, ignore: bool) -> Self {
        let c = (!ignore).then(|| {
            (0..n)
                .map(|i| {
                    let mut c = ffi::MPI_Status::default();
                    // SAFETY: status i of the caller's array.
                    unsafe { abi::status_f2c(f.add(i * STATUS_SIZE), &mut c) };
                    c
                })
                .collect()
        });
        Statuses { f, c }
    }

    /// The C argument: the array, or `MPI_STATUS(ES)_IGNORE`.
    fn ptr(&mut self, single: bool) -> *mut ffi::MPI_Status {
        match &mut self.c {
            Some(c) => c.as_mut_ptr(),
            None if single => consts::STATUS_IGNORE(),
            None => consts::STATUSES_IGNORE(),
        }
    }

    fn back(&self) {
        for (i, c) in self.c.iter().flatten().enumerate() {
            // SAFETY: status i of the caller's array (`new`).
            unsafe { abi::status_c2f(c, self.f.add(i * STATUS_SIZE)) };
        }
    }
}

/// A request count from Fortran; a negative one goes to the native function, which reports it.
unsafe fn count(n: In) -> Option<usize> {
    // SAFETY: the caller's count.
    usize::try_from(unsafe { *n }).ok()
}

/// Stores a C flag as a Fortran `LOGICAL`.
unsafe fn set_flag(f: Out, c: c_int) {
    // SAFETY: the caller's flag.
    unsafe { *f = if c != 0 { abi::TRUE } else { abi::FALSE } };
}

/// A C index as Fortran's (1-based; `MPI_UNDEFINED` stays).
fn index_c2f(i: c_int) -> Fint {
    if i == consts::UNDEFINED() || i < 0 {
        i
    } else {
        i + 1
    }
}

unsafe fn wait(name: &str, native: &dyn Fn(), request: Out, status: Out, ierr: Out) {
    run(name, native, ierr, |committed| {
        if !ours() {
            return Outcome::Native;
        }
        // SAFETY: the caller's arguments (MPI preconditions), here and below.
        let (mut r, mut s) = unsafe { (Requests::new(request, 1), Statuses::one(status)) };
        *committed = true;
        let code = unsafe { crate::MPI_Wait(r.ptr(), s.ptr(true)) };
        r.back();
        s.back();
        Outcome::Done(code)
    })
}

unsafe fn test(name: &str, native: &dyn Fn(), request: Out, flag: Out, status: Out, ierr: Out) {
    run(name, native, ierr, |committed| {
        if !ours() {
            return Outcome::Native;
        }
        // SAFETY: the caller's arguments (MPI preconditions), here and below.
        let (mut r, mut s) = unsafe { (Requests::new(request, 1), Statuses::one(status)) };
        let mut c_flag = 0;
        *committed = true;
        let code = unsafe { crate::MPI_Test(r.ptr(), &mut c_flag, s.ptr(true)) };
        r.back();
        s.back();
        unsafe { set_flag(flag, c_flag) };
        Outcome::Done(code)
    })
}

/// `MPI_WAITALL` (`flag` none) and `MPI_TESTALL`.
unsafe fn all(
    name: &str,
    native: &dyn Fn(),
    n: In,
    requests: Out,
    flag: Option<Out>,
    statuses: Out,
    ierr: Out,
) {
    run(name, native, ierr, |committed| {
        // SAFETY: the caller's arguments (MPI preconditions), here and below.
        let Some(count) = (unsafe { count(n) }).filter(|_| ours()) else {
            return Outcome::Native;
        };
        let (mut r, mut s) = unsafe {
            (
                Requests::new(requests, count),
                Statuses::array(statuses, count),
            )
        };
        let mut c_flag = 0;
        *committed = true;
        let code = match flag {
            None => unsafe { crate::MPI_Waitall(count as c_int, r.ptr(), s.ptr(false)) },
            Some(_) => unsafe {
                crate::MPI_Testall(count as c_int, r.ptr(), &mut c_flag, s.ptr(false))
            },
        };
        r.back();
        s.back();
        if let Some(flag) = flag {
            unsafe { set_flag(flag, c_flag) };
        }
        Outcome::Done(code)
    })
}

unsafe fn waitall(name: &str, native: &dyn Fn(), n: In, requests: Out, statuses: Out, ierr: Out) {
    // SAFETY: the caller's arguments.
    unsafe { all(name, native, n, requests, None, statuses, ierr) }
}

unsafe fn testall(
    name: &str,
    native: &dyn Fn(),
    n: In,
    requests: Out,
    flag: Out,
    statuses: Out,
    ierr: Out,
) {
    // SAFETY: the caller's arguments.
    unsafe { all(name, native, n, requests, Some(flag), statuses, ierr) }
}

/// `MPI_WAITANY` (`flag` none) and `MPI_TESTANY`.
unsafe fn any(
    name: &str,
    native: &dyn Fn(),
    n: In,
    requests: Out,
    index: Out,
    flag: Option<Out>,
    status: Out,
    ierr: Out,
) {
    run(name, native, ierr, |committed| {
        // SAFETY: the caller's arguments (MPI preconditions), here and below.
        let Some(count) = (unsafe { count(n) }).filter(|_| ours()) else {
            return Outcome::Native;
        };
        let (mut r, mut s) = unsafe { (Requests::new(requests, count), Statuses::one(status)) };
        let (mut c_index, mut c_flag) = (consts::UNDEFINED(), 0);
        *committed = true;
        let (n, rp, sp) = (count as c_int, r.ptr(), s.ptr(true));
        let code = match flag {
            None => unsafe { crate::MPI_Waitany(n, rp, &mut c_index, sp) },
            Some(_) => unsafe { crate::MPI_Testany(n, rp, &mut c_index, &mut c_flag, sp) },
        };
        r.back();
        s.back();
        unsafe { *index = index_c2f(c_index) };
        if let Some(flag) = flag {
            unsafe { set_flag(flag, c_flag) };
        }
        Outcome::Done(code)
    })
}

unsafe fn waitany(
    name: &str,
    native: &dyn Fn(),
    n: In,
    requests: Out,
    index: Out,
    status: Out,
    ierr: Out,
) {
    // SAFETY: the caller's arguments.
    unsafe { any(name, native, n, requests, index, None, status, ierr) }
}

unsafe fn testany(
    name: &str,
    native: &dyn Fn(),
    n: In,
    requests: Out,
    index: Out,
    flag: Out,
    status: Out,
    ierr: Out,
) {
    // SAFETY: the caller's arguments.
    unsafe { any(name, native, n, requests, index, Some(flag), status, ierr) }
}

/// `MPI_WAITSOME` (`blocking`) and `MPI_TESTSOME`.
unsafe fn some(
    blocking: bool,
    name: &str,
    native: &dyn Fn(),
    n: In,
    requests: Out,
    outcount: Out,
    indices: Out,
    statuses: Out,
    ierr: Out,
) {
    run(name, native, ierr, |committed| {
        // SAFETY: the caller's arguments (MPI preconditions), here and below.
        let Some(count) = (unsafe { count(n) }).filter(|_| ours()) else {
            return Outcome::Native;
        };
        let (mut r, mut s) = unsafe {
            (
                Requests::new(requests, count),
                Statuses::array(statuses, count),
            )
        };
        let mut c_out = consts::UNDEFINED();
        // The C indices go to the caller's array, then become 1-based in place.
        let call = if blocking {
            crate::MPI_Waitsome
        } else {
            crate::MPI_Testsome
        };
        *committed = true;
        let code = unsafe { call(count as c_int, r.ptr(), &mut c_out, indices, s.ptr(false)) };
        r.back();
        s.back();
        unsafe {
            *outcount = c_out;
            for i in 0..usize::try_from(c_out).unwrap_or(0).min(count) {
                *indices.add(i) = index_c2f(*indices.add(i));
            }
        }
        Outcome::Done(code)
    })
}

unsafe fn waitsome(
    name: &str,
    native: &dyn Fn(),
    n: In,
    requests: Out,
    outcount: Out,
    indices: Out,
    statuses: Out,
    ierr: Out,
) {
    // SAFETY: the caller's arguments.
    unsafe {
        some(
            true, name, native, n, requests, outcount, indices, statuses, ierr,
        )
    }
}

unsafe fn testsome(
    name: &str,
    native: &dyn Fn(),
    n: In,
    requests: Out,
    outcount: Out,
    indices: Out,
    statuses: Out,
    ierr: Out,
) {
    // SAFETY: the caller's arguments.
    unsafe {
        some(
            false, name, native, n, requests, outcount, indices, statuses, ierr,
        )
    }
}

unsafe fn request_free(name: &str, native: &dyn Fn(), request: Out, ierr: Out) {
    run(name, native, ierr, |committed| {
        if !ours() {
            return Outcome::Native;
        }
        // SAFETY: the caller's request variable.
        let mut r = unsafe { Requests::new(request, 1) };
        *committed = true;
        // SAFETY: a request handle of the program.
        let code = unsafe { crate::MPI_Request_free(r.ptr()) };
        r.back();
        Outcome::Done(code)
    })
}

unsafe fn request_get_status(
    name: &str,
    native: &dyn Fn(),
    request: In,
    flag: Out,
    status: Out,
    ierr: Out,
) {
    run(name, native, ierr, |committed| {
        if !ours() {
            return Outcome::Native;
        }
        // SAFETY: the caller's arguments (MPI preconditions), here and below.
        let c = requests::f2c(unsafe { *request });
        let mut s = unsafe { Statuses::one(status) };
        let mut c_flag = 0;
        *committed = true;
        let code = unsafe { crate::MPI_Request_get_status(c, &mut c_flag, s.ptr(true)) };
        s.back();
        unsafe { set_flag(flag, c_flag) };
        Outcome::Done(code)
    })
}

unsafe fn cancel(name: &str, native: &dyn Fn(), request: Out, ierr: Out) {
    run(name, native, ierr, |committed| {
        if !ours() {
            return Outcome::Native;
        }
        // SAFETY: the caller's request variable.
        let mut r = unsafe { Requests::new(request, 1) };
        *committed = true;
        // SAFETY: a request handle of the program.
        let code = unsafe { crate::MPI_Cancel(r.ptr()) };
        r.back();
        Outcome::Done(code)
    })
}

fortran! {
    fn wait = mpi_wait / MPI_WAIT(request: Out, status: Out, ierr: Out);
    fn test = mpi_test / MPI_TEST(request: Out, flag: Out, status: Out, ierr: Out);
    fn waitall = mpi_waitall / MPI_WAITALL(count: In, requests: Out, statuses: Out, ierr: Out);
    fn testall = mpi_testall / MPI_TESTALL(
        count: In, requests: Out, flag: Out, statuses: Out, ierr: Out,
    );
    fn waitany = mpi_waitany / MPI_WAITANY(
        count: In, requests: Out, index: Out, status: Out, ierr: Out,
    );
    fn testany = mpi_testany / MPI_TESTANY(
        count: In, requests: Out, index: Out, flag: Out, status: Out, ierr: Out,
    );
    fn waitsome = mpi_waitsome / MPI_WAITSOME(
        count: In, requests: Out, outcount: Out, indices: Out, statuses: Out, ierr: Out,
    );
    fn testsome = mpi_testsome / MPI_TESTSOME(
        count: In, requests: Out, outcount: Out, indices: Out, statuses: Out, ierr: Out,
    );
    fn request_free = mpi_request_free / MPI_REQUEST_FREE(request: Out, ierr: Out);
    fn request_get_status = mpi_request_get_status / MPI_REQUEST_GET_STATUS(
        request: In, flag: Out, status: Out, ierr: Out,
    );
    fn cancel = mpi_cancel / MPI_CANCEL(request: Out, ierr: Out);
}
