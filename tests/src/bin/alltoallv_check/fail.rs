//! Error handling: every MPI call is checked; a failure aborts the job (the other ranks may be
//! blocked in a collective, so carrying on could hang).

use mpi_ffi::consts as c;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicI64, Ordering};

pub static WORLD_RANK: AtomicI64 = AtomicI64::new(-1);
pub static CURRENT_OP: AtomicI64 = AtomicI64::new(-1);

pub fn mpi_failed(call: &str, rc: c_int) -> ! {
    let mut buf = vec![0u8; mpi_ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: buffer of MPI_MAX_ERROR_STRING bytes.
    let text = if unsafe { mpi_ffi::PMPI_Error_string(rc, buf.as_mut_ptr().cast(), &mut len) }
        == c::SUCCESS()
    {
        String::from_utf8_lossy(&buf[..len.clamp(0, buf.len() as c_int) as usize]).into_owned()
    } else {
        "(no error string)".into()
    };
    eprintln!(
        "alltoallv_check: MPI ERROR: rank {} op {}: {call} returned {rc}: {text}",
        WORLD_RANK.load(Ordering::Relaxed),
        CURRENT_OP.load(Ordering::Relaxed)
    );
    abort(3)
}

pub fn abort(code: c_int) -> ! {
    // SAFETY: plain call; exit if it returns.
    unsafe { mpi_ffi::PMPI_Abort(c::COMM_WORLD(), code) };
    std::process::exit(code)
}

/// Calls an MPI (or PMPI) function and aborts with a message if it does not return success.
macro_rules! mpi {
    ($f:ident ( $($a:expr),* $(,)? )) => {{
        // SAFETY: the callers pass valid handles and buffers that outlive the operation.
        let rc = unsafe { mpi_ffi::$f($($a),*) };
        if rc != mpi_ffi::consts::SUCCESS() {
            $crate::fail::mpi_failed(stringify!($f), rc);
        }
    }};
}
