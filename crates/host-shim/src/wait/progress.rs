//! Progress while a Wait/Test call finds our requests incomplete: UCX progress, native MPI
//! progress and reading the SP connection, with the pauses of a blocking wait (`backoff.rs`).

use crate::backoff::{Backoff, CONN_CHECK_INTERVAL, PROGRESS_INTERVAL};
use crate::grants::UCX_ACTIVE;
use crate::state::with_shim;
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::cell::Cell;
use std::os::raw::c_int;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Keeps native MPI progressing without completing anything.
unsafe fn native_progress() {
    let mut flag: c_int = 0;
    // SAFETY: valid communicator, out-pointer and the ignore sentinel.
    unsafe {
        ffi::PMPI_Iprobe(
            consts::ANY_SOURCE(),
            consts::ANY_TAG(),
            consts::COMM_WORLD(),
            &mut flag,
            consts::STATUS_IGNORE(),
        );
    }
}

fn service_connection() {
    with_shim(|s| s.service_connection());
}

/// One round of UCX progress with the `ucx` backend (see `grants.rs`): on UCX 1.13 over
/// tcp/shared memory the SP's accesses to our buffers complete only while we progress.
fn ucx_progress() {
    if UCX_ACTIVE.load(Ordering::Acquire) {
        with_shim(|s| s.registrar.progress());
    }
}

/// The pauses, progress and connection checks of one blocking wait.
pub(crate) struct Waiter {
    backoff: Backoff,
    last_progress: Instant,
    last_conn: Instant,
}

impl Waiter {
    pub(crate) fn new() -> Self {
        let now = Instant::now();
        Waiter {
            backoff: Backoff::new(),
            last_progress: now,
            last_conn: now,
        }
    }

    /// After a look that found nothing complete. `drive_progress`: the caller tests no native
    /// request itself, so the waiter keeps MPI progressing.
    ///
    /// # Safety
    /// MPI is initialised.
    pub(crate) unsafe fn idle(&mut self, drive_progress: bool) {
        ucx_progress();
        let now = Instant::now();
        if drive_progress && now - self.last_progress >= PROGRESS_INTERVAL {
            // SAFETY: MPI is initialised while the shim is active.
            unsafe { native_progress() };
            self.last_progress = now;
        }
        // While the SP may hand copies to this rank or complete a request by a message, read
        // the connection at every look.
        if crate::request::connection_needed() || now - self.last_conn >= CONN_CHECK_INTERVAL {
            service_connection();
            self.last_conn = now;
        }
        self.backoff.pause();
    }
}

thread_local! {
    static LAST_TEST_CONN_CHECK: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// After a Test-style call found our requests incomplete: UCX progress, native progress
/// unless the call has just tested native requests itself (`native_tested`), and now and then
/// a look at the connection. UCX progress is never skipped: a program may loop on Testsome
/// with a native request that another rank completes only after its own offloaded collective,
/// which needs the SP's gets from our buffers, which complete only while we progress.
pub(super) unsafe fn test_miss(native_tested: bool) {
    ucx_progress();
    if !native_tested {
        // SAFETY: MPI is initialised while the shim is active.
        unsafe { native_progress() };
    }
    let now = Instant::now();
    let eager = crate::request::connection_needed();
    let due = LAST_TEST_CONN_CHECK
        .try_with(|c| {
            let due = eager || c.get().is_none_or(|t| now - t >= CONN_CHECK_INTERVAL);
            if due {
                c.set(Some(now));
            }
            due
        })
        .unwrap_or(true);
    if due {
        service_connection();
    }
}
