//! The C boundary: every exported `MPI_*` function runs through [`boundary`].
//!
//! It does three things. (1) Re-entrancy: a thread-local flag is set while the shim runs on
//! this thread; an `MPI_*` call arriving while it is set (from inside MPI or from the shim's own
//! work) goes straight to the native `PMPI_*` function. (2) Panics never cross into C: the
//! shim's work runs under `catch_unwind`. (3) The fallback after a panic: if the shim had not
//! yet done anything native MPI cannot undo (posted to its SP, or consumed one of its own
//! request handles: see [`Commit`]), the call is handed to the native function and the program
//! goes on as if the shim were not there; otherwise the call returns `MPI_ERR_INTERN`.
//! (4) Errors: a call whose offloaded part failed ends with [`Flow::Raise`], and the error goes
//! through the communicator's error handler ([`raise`]) as native MPI does it, after the
//! re-entrancy flag is cleared (a program's own handler may call MPI, the shim included).

use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::cell::Cell;
use std::os::raw::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Writes one line to stderr, prefixed `host-shim: `, ignoring write errors (a closed stderr
/// must not panic inside an MPI call).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        // One write per line, so lines of concurrent ranks do not interleave.
        let line = format!("host-shim: {}\n", format_args!($($arg)*));
        let _ = std::io::stderr().write_all(line.as_bytes());
    }};
}
pub(crate) use say;

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// What the shim's part of a call decided.
pub(crate) enum Flow {
    /// Not for the shim: run the native function with the caller's arguments.
    Native,
    /// Handled; return this code.
    Done(c_int),
    /// Handled, but the call failed with `code`: invoke the error handler of `comm` (which
    /// aborts the job under `MPI_ERRORS_ARE_FATAL`) and return `code`.
    Raise { comm: ffi::MPI_Comm, code: c_int },
}

impl Flow {
    /// `Done(code)` on success, otherwise `Raise` on `comm`.
    pub(crate) fn checked(comm: ffi::MPI_Comm, code: c_int) -> Flow {
        if code == consts::SUCCESS() {
            Flow::Done(code)
        } else {
            Flow::Raise { comm, code }
        }
    }
}

/// Reports `code` through the error handler of `comm`, as a native MPI call that failed does:
/// under `MPI_ERRORS_ARE_FATAL` (the default) this aborts the job, under `MPI_ERRORS_RETURN` it
/// returns, and a program's own handler runs. Returns `code`, what the call returns.
///
/// Without this, a program that ignores return codes (relying on the default handler) would go
/// on with receive buffers the failed collective never filled.
pub(crate) fn raise(comm: ffi::MPI_Comm, code: c_int) -> c_int {
    // SAFETY: `comm` is the communicator of the call, or the one a request was created on
    // (replaced by MPI_COMM_WORLD once the program freed it, see `request.rs`): valid here.
    unsafe { ffi::PMPI_Comm_call_errhandler(comm, code) };
    code
}

/// Records that the call has passed the point of no return for the native fallback.
#[derive(Debug, Default)]
pub(crate) struct Commit {
    committed: bool,
}

impl Commit {
    pub(crate) fn mark(&mut self) {
        self.committed = true;
    }
}

/// Clears the re-entrancy flag when the call leaves the shim, however it leaves.
struct Leave;

impl Drop for Leave {
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|f| f.set(false));
    }
}

/// Runs `shim` for the exported function `name`, or `native` when the shim is already active
/// on this thread, when `shim` says so, or when `shim` panicked before committing.
pub(crate) fn boundary(
    name: &'static str,
    native: impl FnOnce() -> c_int,
    shim: impl FnOnce(&mut Commit) -> Flow,
) -> c_int {
    // `try_with` fails only while this thread's locals are being destroyed: go native then.
    let entered = INSIDE.try_with(|f| !f.replace(true)).unwrap_or(false);
    if !entered {
        return native();
    }
    let _leave = Leave;
    let mut commit = Commit::default();
    match catch_unwind(AssertUnwindSafe(|| shim(&mut commit))) {
        Ok(Flow::Done(rc)) => rc,
        Ok(Flow::Raise { comm, code }) => {
            // Out of the shim first: the handler may call MPI.
            drop(_leave);
            raise(comm, code)
        }
        Ok(Flow::Native) => native(),
        Err(_) if !commit.committed => {
            say!("internal error (panic) in {name}; running this call natively");
            native()
        }
        Err(_) => {
            say!("internal error (panic) in {name} after the shim took the call over; returning MPI_ERR_INTERN");
            consts::ERR_INTERN()
        }
    }
}

/// Runs `f`, turning a panic into `None`: for work outside an exported call (callbacks that MPI
/// invokes, the start-up agreement).
pub(crate) fn no_panic<R>(what: &str, f: impl FnOnce() -> R) -> Option<R> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => Some(r),
        Err(_) => {
            say!("internal error (panic) in {what}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_calls_go_native() {
        let rc = boundary(
            "outer",
            || 1,
            |_| {
                let inner = boundary("inner", || 7, |_| Flow::Done(9));
                Flow::Done(inner * 10)
            },
        );
        assert_eq!(rc, 70);
        // The flag is cleared afterwards.
        assert_eq!(boundary("again", || 1, |_| Flow::Done(2)), 2);
    }

    #[test]
    fn panics_fall_back_or_fail_by_commit() {
        let rc = boundary("uncommitted", || 5, |_| panic!("test panic"));
        assert_eq!(rc, 5);
        let rc = boundary(
            "committed",
            || 5,
            |c| {
                c.mark();
                panic!("test panic")
            },
        );
        assert_eq!(rc, consts::ERR_INTERN());
        assert_eq!(boundary("after", || 1, |_| Flow::Native), 1);
    }
}
