//! The Wait/Test family over arrays that mix offloaded requests, native requests and
//! `MPI_REQUEST_NULL`.
//!
//! Every call first classifies its handles (`registry.rs`); with none of ours it is handed to
//! the native function unchanged. Otherwise the native subset goes to the matching `PMPI_*`
//! call on a temporary copy of the array in which our positions hold `MPI_REQUEST_NULL`, and
//! the native handles are copied back afterwards (a completed native request comes back as
//! `MPI_REQUEST_NULL`, as PMPI set it). A completed offloaded request is released: its handle
//! becomes `MPI_REQUEST_NULL`, its object is freed, and its status reads as a completed
//! collective (`MPI_ANY_SOURCE`, `MPI_ANY_TAG`, count 0, `MPI_ERROR` its code).
//!
//! Blocking calls loop: look at our requests, test the native subset (which also keeps native
//! MPI progressing: another rank may need our progress on a rendezvous send before it can post
//! its own part of the collective we wait for), and pause with `backoff.rs`. With no native
//! request in the call, `PMPI_Iprobe` drives progress every [`PROGRESS_INTERVAL`]. Every
//! [`CONN_CHECK_INTERVAL`] the SP connection is read, so a refused post or a dead SP ends the
//! wait with an error instead of a hang.
//!
//! Errors go through the error handler of the request's communicator (`boundary::raise`), as
//! native MPI does: a single-request call (Wait, Test, Waitany, Testany) with the request's
//! code; a multi-completion call (Waitall, Testall, Waitsome, Testsome) once per call, with the
//! code the call returns (`MPI_ERR_IN_STATUS`), on the communicator of the first failed request
//! of ours, unless the native part of the call failed too (then `PMPI_*` already invoked the
//! handler, and once per call is all MPI does).

use crate::backoff::{Backoff, CONN_CHECK_INTERVAL, PROGRESS_INTERVAL};
use crate::boundary::{say, Commit, Flow};
use crate::completion::{poll, release};
use crate::grants::UCX_ACTIVE;
use crate::registry::Class;
use crate::request::{by_addr, fill_status, my_rank};
use crate::state::{is_active, with_shim, TRACKED};
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
unsafe fn test_miss(native_tested: bool) {
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

/// Classifies `handles`; `None` when none is ours (the call is then native).
fn classify(handles: &[ffi::MPI_Request]) -> Option<Vec<Class>> {
    if TRACKED.load(Ordering::Acquire) == 0 {
        return None;
    }
    let null = consts::REQUEST_NULL() as usize;
    let classes = with_shim(|s| {
        handles
            .iter()
            .map(|&h| s.registry.classify(h as usize, null))
            .collect::<Vec<_>>()
    })?;
    classes
        .iter()
        .any(|c| matches!(c, Class::Ours(_)))
        .then_some(classes)
}

/// The object address if `handle` is ours.
fn ours(handle: ffi::MPI_Request) -> Option<usize> {
    match classify(std::slice::from_ref(&handle))?.first() {
        Some(Class::Ours(a)) => Some(*a),
        _ => None,
    }
}

/// The start of every single-request call: `None` (native) unless the shim is active and
/// `handle` is ours; then the call is committed and this is the object's address.
fn claim(handle: ffi::MPI_Request, commit: &mut Commit) -> Option<usize> {
    if !is_active() {
        return None;
    }
    let addr = ours(handle)?;
    commit.mark();
    Some(addr)
}

/// The start of every array call: `None` (native) unless the shim is active and one of the
/// `count` handles at `requests` is ours; then the call is committed and these are the
/// caller's handles and their classes.
///
/// # Safety
/// `requests` is null or the caller's array of `count` handles.
unsafe fn claim_all<'a>(
    count: c_int,
    requests: *mut ffi::MPI_Request,
    commit: &mut Commit,
) -> Option<(&'a mut [ffi::MPI_Request], Vec<Class>)> {
    if !is_active() || count <= 0 || requests.is_null() {
        return None;
    }
    // SAFETY: the caller's array of `count` handles (MPI precondition).
    let handles = unsafe { std::slice::from_raw_parts_mut(requests, count as usize) };
    let classes = classify(handles)?;
    commit.mark();
    Some((handles, classes))
}

fn status_at(statuses: *mut ffi::MPI_Status, i: usize) -> *mut ffi::MPI_Status {
    if statuses.is_null() || statuses == consts::STATUSES_IGNORE() {
        consts::STATUS_IGNORE()
    } else {
        // SAFETY: the caller's array has one status per request and `i` is in range.
        unsafe { statuses.add(i) }
    }
}

fn ignores(statuses: *mut ffi::MPI_Status) -> bool {
    statuses.is_null() || statuses == consts::STATUSES_IGNORE()
}

/// A copy of the handles with our positions set to `MPI_REQUEST_NULL`.
fn native_subset(handles: &[ffi::MPI_Request], classes: &[Class]) -> Vec<ffi::MPI_Request> {
    handles
        .iter()
        .zip(classes)
        .map(|(&h, c)| match c {
            Class::Ours(_) => consts::REQUEST_NULL(),
            _ => h,
        })
        .collect()
}

fn write_back_natives(
    handles: &mut [ffi::MPI_Request],
    classes: &[Class],
    natives: &[ffi::MPI_Request],
) {
    for ((h, c), n) in handles.iter_mut().zip(classes).zip(natives) {
        if !matches!(c, Class::Ours(_)) {
            *h = *n;
        }
    }
}

/// Releases a completed request of ours held in `*handle`.
///
/// # Safety
/// `handle` is the caller's valid handle slot and `status` is ignorable or writable.
unsafe fn complete_one(
    handle: &mut ffi::MPI_Request,
    addr: usize,
    status: *mut ffi::MPI_Status,
    code: c_int,
) {
    // SAFETY: forwarded precondition.
    unsafe { fill_status(status, code) };
    *handle = consts::REQUEST_NULL();
    release(addr);
}

/// How a multi-completion call that mixes both kinds reports errors.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Combined {
    Ok,
    /// Return `MPI_ERR_IN_STATUS`. `native_errors_set`: the native call already set the
    /// `MPI_ERROR` fields of its statuses; otherwise the shim sets them to `MPI_SUCCESS`.
    InStatus {
        native_errors_set: bool,
    },
    /// The native call failed as a whole: return its code.
    Fail(c_int),
}

pub(crate) fn combine(native_rc: c_int, ours_failed: bool) -> Combined {
    let (ok, in_status) = (consts::SUCCESS(), consts::ERR_IN_STATUS());
    if native_rc != ok && native_rc != in_status {
        Combined::Fail(native_rc)
    } else if ours_failed || native_rc == in_status {
        Combined::InStatus {
            native_errors_set: native_rc == in_status,
        }
    } else {
        Combined::Ok
    }
}

/// The code a multi-completion call returns (see [`combine`]). For `MPI_ERR_IN_STATUS` after
/// a native call that did not set its statuses' `MPI_ERROR` fields, the statuses at
/// `native_at` (the natively completed ones) get `MPI_SUCCESS` there.
///
/// # Safety
/// `statuses` is ignorable or has an entry at every position of `native_at`.
unsafe fn return_code(
    native_rc: c_int,
    ours_failed: bool,
    statuses: *mut ffi::MPI_Status,
    native_at: impl Iterator<Item = usize>,
) -> c_int {
    match combine(native_rc, ours_failed) {
        Combined::Ok => consts::SUCCESS(),
        Combined::Fail(rc) => rc,
        Combined::InStatus { native_errors_set } => {
            if !native_errors_set && !ignores(statuses) {
                for i in native_at {
                    // SAFETY: forwarded precondition.
                    unsafe { (*statuses.add(i)).MPI_ERROR = consts::SUCCESS() };
                }
            }
            consts::ERR_IN_STATUS()
        }
    }
}

/// The end of a multi-completion call: `rc` as the call returns it, raised on the communicator
/// of the first failed request of ours when only ours failed (`first_failed`; a failed native
/// part has already been through the handler inside `PMPI_*`).
fn multi_flow(rc: c_int, native_rc: c_int, first_failed: Option<ffi::MPI_Comm>) -> Flow {
    match first_failed {
        Some(comm) if native_rc == consts::SUCCESS() && rc != consts::SUCCESS() => {
            Flow::Raise { comm, code: rc }
        }
        _ => Flow::Done(rc),
    }
}

/// Completes every request of a Waitall/Testall whose requests have all completed.
///
/// # Safety
/// The arrays are the caller's (`statuses` ignorable or of `handles.len()` entries).
unsafe fn finish_all(
    handles: &mut [ffi::MPI_Request],
    classes: &[Class],
    natives: &[ffi::MPI_Request],
    statuses: *mut ffi::MPI_Status,
    native_rc: c_int,
) -> Flow {
    write_back_natives(handles, classes, natives);
    let mut ours_failed = false;
    let mut first_failed = None;
    for (i, c) in classes.iter().enumerate() {
        if let Class::Ours(a) = *c {
            // SAFETY: ours, owned by the caller's array.
            let req = unsafe { by_addr(a) };
            let code = req
                .result()
                .expect("finish_all runs once every request completed");
            if code != consts::SUCCESS() {
                ours_failed = true;
                first_failed.get_or_insert_with(|| req.errhandler_comm());
            }
            // SAFETY: forwarded precondition.
            unsafe { complete_one(&mut handles[i], a, status_at(statuses, i), code) };
        }
    }
    let native_at = classes
        .iter()
        .enumerate()
        .filter(|(_, c)| !matches!(c, Class::Ours(_)))
        .map(|(i, _)| i);
    // SAFETY: the caller's statuses; the positions are in range.
    let rc = unsafe { return_code(native_rc, ours_failed, statuses, native_at) };
    multi_flow(rc, native_rc, first_failed)
}

fn all_ours_done(classes: &[Class]) -> bool {
    classes.iter().all(|c| match *c {
        // SAFETY: ours, owned by the caller's array.
        Class::Ours(a) => poll(unsafe { by_addr(a) }).is_some(),
        _ => true,
    })
}

/// Index and code of the first completed request of ours.
fn first_done_ours(classes: &[Class]) -> Option<(usize, usize, c_int)> {
    classes.iter().enumerate().find_map(|(i, c)| match *c {
        // SAFETY: ours, owned by the caller's array.
        Class::Ours(a) => poll(unsafe { by_addr(a) }).map(|code| (i, a, code)),
        _ => None,
    })
}

/// Waits for one of our requests by address and returns its code (the object stays).
fn wait_addr(addr: usize) -> c_int {
    // SAFETY: the caller owns this request of ours.
    let req = unsafe { by_addr(addr) };
    let mut w = Waiter::new();
    loop {
        if let Some(code) = poll(req) {
            return code;
        }
        // SAFETY: MPI is initialised while requests of ours exist.
        unsafe { w.idle(true) };
    }
}

/// Waits for a request just posted by a blocking collective, then frees it.
pub fn wait_and_release(addr: usize) -> c_int {
    let code = wait_addr(addr);
    release(addr);
    code
}

/// # Safety
/// Arguments as for `MPI_Wait`.
pub unsafe fn wait(
    request: *mut ffi::MPI_Request,
    status: *mut ffi::MPI_Status,
    commit: &mut Commit,
) -> Flow {
    if request.is_null() {
        return Flow::Native;
    }
    // SAFETY: a valid handle slot (MPI precondition).
    let Some(addr) = claim(unsafe { *request }, commit) else {
        return Flow::Native;
    };
    let code = wait_addr(addr);
    // SAFETY: ours, owned by the caller until released below.
    let comm = unsafe { by_addr(addr) }.errhandler_comm();
    // SAFETY: as above.
    unsafe { complete_one(&mut *request, addr, status, code) };
    Flow::checked(comm, code)
}

/// # Safety
/// Arguments as for `MPI_Test`.
pub unsafe fn test(
    request: *mut ffi::MPI_Request,
    flag: *mut c_int,
    status: *mut ffi::MPI_Status,
    commit: &mut Commit,
) -> Flow {
    if request.is_null() || flag.is_null() {
        return Flow::Native;
    }
    // SAFETY: a valid handle slot (MPI precondition).
    let Some(addr) = claim(unsafe { *request }, commit) else {
        return Flow::Native;
    };
    // SAFETY: ours, owned by the caller.
    match poll(unsafe { by_addr(addr) }) {
        Some(code) => {
            // SAFETY: ours, owned by the caller until released below.
            let comm = unsafe { by_addr(addr) }.errhandler_comm();
            // SAFETY: valid handle slot, flag and status (MPI preconditions).
            unsafe {
                complete_one(&mut *request, addr, status, code);
                *flag = 1;
            }
            Flow::checked(comm, code)
        }
        None => {
            // SAFETY: as above.
            unsafe {
                *flag = 0;
                test_miss(false);
            }
            Flow::Done(consts::SUCCESS())
        }
    }
}

/// # Safety
/// Arguments as for `MPI_Waitall`.
pub unsafe fn waitall(
    count: c_int,
    requests: *mut ffi::MPI_Request,
    statuses: *mut ffi::MPI_Status,
    commit: &mut Commit,
) -> Flow {
    // SAFETY: the caller's array (MPI precondition).
    let Some((handles, classes)) = (unsafe { claim_all(count, requests, commit) }) else {
        return Flow::Native;
    };
    let mut natives = native_subset(handles, &classes);
    let mut native_pending = classes.contains(&Class::Native);
    let mut native_rc = consts::SUCCESS();
    let mut w = Waiter::new();
    while !all_ours_done(&classes) {
        if native_pending {
            let mut flag: c_int = 0;
            // SAFETY: a temporary array of `count` handles; the caller's statuses.
            let rc = unsafe { ffi::PMPI_Testall(count, natives.as_mut_ptr(), &mut flag, statuses) };
            if rc != consts::SUCCESS() || flag != 0 {
                native_pending = false;
                native_rc = rc;
            }
        }
        // SAFETY: MPI is initialised.
        unsafe { w.idle(!native_pending) };
    }
    if native_pending {
        // SAFETY: as for Testall.
        native_rc = unsafe { ffi::PMPI_Waitall(count, natives.as_mut_ptr(), statuses) };
    }
    // SAFETY: the caller's arrays.
    unsafe { finish_all(handles, &classes, &natives, statuses, native_rc) }
}

/// # Safety
/// Arguments as for `MPI_Testall`.
pub unsafe fn testall(
    count: c_int,
    requests: *mut ffi::MPI_Request,
    flag: *mut c_int,
    statuses: *mut ffi::MPI_Status,
    commit: &mut Commit,
) -> Flow {
    if flag.is_null() {
        return Flow::Native;
    }
    // SAFETY: the caller's array (MPI precondition).
    let Some((handles, classes)) = (unsafe { claim_all(count, requests, commit) }) else {
        return Flow::Native;
    };
    if !all_ours_done(&classes) {
        // All or nothing: nothing is completed while one of ours is still running.
        // SAFETY: valid flag; MPI is initialised.
        unsafe {
            *flag = 0;
            test_miss(false);
        }
        return Flow::Done(consts::SUCCESS());
    }
    let mut natives = native_subset(handles, &classes);
    let mut native_flag: c_int = 0;
    // SAFETY: a temporary array of `count` handles; the caller's statuses.
    let rc = unsafe { ffi::PMPI_Testall(count, natives.as_mut_ptr(), &mut native_flag, statuses) };
    if (rc == consts::SUCCESS() && native_flag == 0) || combine(rc, false) == Combined::Fail(rc) {
        write_back_natives(handles, &classes, &natives);
        // SAFETY: valid flag; MPI is initialised.
        unsafe {
            *flag = 0;
            test_miss(true);
        }
        return Flow::Done(rc);
    }
    // SAFETY: valid flag; the caller's arrays.
    unsafe {
        *flag = 1;
        finish_all(handles, &classes, &natives, statuses, rc)
    }
}

/// # Safety
/// Arguments as for `MPI_Waitany` / `MPI_Testany`.
unsafe fn any(
    count: c_int,
    requests: *mut ffi::MPI_Request,
    index: *mut c_int,
    flag: Option<*mut c_int>,
    status: *mut ffi::MPI_Status,
    commit: &mut Commit,
) -> Flow {
    if index.is_null() || flag.is_some_and(|f| f.is_null()) {
        return Flow::Native;
    }
    // SAFETY: the caller's array (MPI precondition).
    let Some((handles, classes)) = (unsafe { claim_all(count, requests, commit) }) else {
        return Flow::Native;
    };
    let mut natives = native_subset(handles, &classes);
    let mut native_active = classes.contains(&Class::Native);
    let mut w = Waiter::new();
    loop {
        if let Some((i, a, code)) = first_done_ours(&classes) {
            // SAFETY: ours, owned by the caller's array until released below.
            let comm = unsafe { by_addr(a) }.errhandler_comm();
            // SAFETY: the caller's index, flag, status and handle slot.
            unsafe {
                complete_one(&mut handles[i], a, status, code);
                *index = i as c_int;
                if let Some(f) = flag {
                    *f = 1;
                }
            }
            return Flow::checked(comm, code);
        }
        if native_active {
            let (mut idx, mut nflag): (c_int, c_int) = (consts::UNDEFINED(), 0);
            // SAFETY: a temporary array of `count` handles; the caller's status.
            let rc = unsafe {
                ffi::PMPI_Testany(count, natives.as_mut_ptr(), &mut idx, &mut nflag, status)
            };
            write_back_natives(handles, &classes, &natives);
            let completed = nflag != 0 && idx != consts::UNDEFINED() && idx >= 0;
            if rc != consts::SUCCESS() || completed {
                // SAFETY: the caller's index and flag.
                unsafe {
                    *index = idx;
                    if let Some(f) = flag {
                        *f = nflag;
                    }
                }
                return Flow::Done(rc);
            }
            if nflag != 0 {
                // No active native request left; only ours can complete.
                native_active = false;
            }
        }
        if let Some(f) = flag {
            // SAFETY: the caller's index and flag; MPI is initialised.
            unsafe {
                *f = 0;
                *index = consts::UNDEFINED();
                test_miss(native_active);
            }
            return Flow::Done(consts::SUCCESS());
        }
        // SAFETY: MPI is initialised.
        unsafe { w.idle(!native_active) };
    }
}

/// # Safety
/// Arguments as for `MPI_Waitany`.
pub unsafe fn waitany(
    count: c_int,
    requests: *mut ffi::MPI_Request,
    index: *mut c_int,
    status: *mut ffi::MPI_Status,
    commit: &mut Commit,
) -> Flow {
    // SAFETY: forwarded.
    unsafe { any(count, requests, index, None, status, commit) }
}

/// # Safety
/// Arguments as for `MPI_Testany`.
pub unsafe fn testany(
    count: c_int,
    requests: *mut ffi::MPI_Request,
    index: *mut c_int,
    flag: *mut c_int,
    status: *mut ffi::MPI_Status,
    commit: &mut Commit,
) -> Flow {
    // SAFETY: forwarded.
    unsafe { any(count, requests, index, Some(flag), status, commit) }
}

/// One pass of Waitsome/Testsome: `Some(flow)` once something completed (or the native call
/// failed), with the outputs written.
///
/// # Safety
/// The caller's arrays, as for `MPI_Testsome`.
#[allow(clippy::too_many_arguments)]
unsafe fn some_pass(
    handles: &mut [ffi::MPI_Request],
    classes: &[Class],
    natives: &mut [ffi::MPI_Request],
    native_active: &mut bool,
    scratch_indices: &mut [c_int],
    scratch_statuses: &mut [ffi::MPI_Status],
    outcount: *mut c_int,
    indices: *mut c_int,
    statuses: *mut ffi::MPI_Status,
) -> Option<Flow> {
    let n = handles.len() as c_int;
    // (position in the array, index into the native scratch statuses if native)
    let mut reported: Vec<(usize, Option<usize>)> = Vec::new();
    let mut native_rc = consts::SUCCESS();
    if *native_active {
        let mut outc: c_int = 0;
        let st = if ignores(statuses) {
            consts::STATUSES_IGNORE()
        } else {
            scratch_statuses.as_mut_ptr()
        };
        // SAFETY: temporary arrays of `n` entries each.
        let rc = unsafe {
            ffi::PMPI_Testsome(
                n,
                natives.as_mut_ptr(),
                &mut outc,
                scratch_indices.as_mut_ptr(),
                st,
            )
        };
        write_back_natives(handles, classes, natives);
        if let Combined::Fail(rc) = combine(rc, false) {
            // SAFETY: the caller's outcount.
            unsafe { *outcount = outc };
            return Some(Flow::Done(rc));
        }
        if outc == consts::UNDEFINED() {
            *native_active = false;
        } else {
            for (k, &pos) in scratch_indices
                .iter()
                .enumerate()
                .take(outc.max(0) as usize)
            {
                reported.push((pos as usize, Some(k)));
            }
            native_rc = rc;
        }
    }
    for (i, c) in classes.iter().enumerate() {
        // SAFETY: ours, owned by the caller's array.
        if let Class::Ours(a) = *c {
            if poll(unsafe { by_addr(a) }).is_some() {
                reported.push((i, None));
            }
        }
    }
    if reported.is_empty() {
        return None;
    }
    let mut ours_failed = false;
    let mut first_failed = None;
    for (j, &(pos, native)) in reported.iter().enumerate() {
        // SAFETY: the caller's arrays have room for every request of the call.
        unsafe {
            *indices.add(j) = pos as c_int;
            match native {
                Some(k) => {
                    if !ignores(statuses) {
                        *statuses.add(j) = scratch_statuses[k];
                    }
                }
                None => {
                    let Class::Ours(a) = classes[pos] else {
                        unreachable!("reported as ours")
                    };
                    let req = by_addr(a);
                    let code = req.result().expect("polled complete");
                    if code != consts::SUCCESS() {
                        ours_failed = true;
                        first_failed.get_or_insert_with(|| req.errhandler_comm());
                    }
                    complete_one(&mut handles[pos], a, status_at(statuses, j), code);
                }
            }
        }
    }
    // SAFETY: the caller's outcount.
    unsafe { *outcount = reported.len() as c_int };
    let native_at = reported
        .iter()
        .enumerate()
        .filter(|(_, (_, native))| native.is_some())
        .map(|(j, _)| j);
    // SAFETY: the caller's statuses; the positions are in range.
    let rc = unsafe { return_code(native_rc, ours_failed, statuses, native_at) };
    Some(multi_flow(rc, native_rc, first_failed))
}

/// # Safety
/// Arguments as for `MPI_Waitsome` (`blocking`) or `MPI_Testsome`.
pub unsafe fn some(
    blocking: bool,
    incount: c_int,
    requests: *mut ffi::MPI_Request,
    outcount: *mut c_int,
    indices: *mut c_int,
    statuses: *mut ffi::MPI_Status,
    commit: &mut Commit,
) -> Flow {
    if outcount.is_null() || indices.is_null() {
        return Flow::Native;
    }
    // SAFETY: the caller's array (MPI precondition).
    let Some((handles, classes)) = (unsafe { claim_all(incount, requests, commit) }) else {
        return Flow::Native;
    };
    let n = handles.len();
    let mut natives = native_subset(handles, &classes);
    let mut native_active = classes.contains(&Class::Native);
    let mut scratch_indices: Vec<c_int> = vec![0; n];
    let mut scratch_statuses: Vec<ffi::MPI_Status> = if ignores(statuses) {
        Vec::new()
    } else {
        vec![ffi::MPI_Status::default(); n]
    };
    let mut w = Waiter::new();
    loop {
        // SAFETY: the caller's arrays; scratch arrays of `n` entries.
        let done = unsafe {
            some_pass(
                handles,
                &classes,
                &mut natives,
                &mut native_active,
                &mut scratch_indices,
                &mut scratch_statuses,
                outcount,
                indices,
                statuses,
            )
        };
        if let Some(flow) = done {
            return flow;
        }
        if !blocking {
            // SAFETY: the caller's outcount; MPI is initialised.
            unsafe {
                *outcount = 0;
                test_miss(native_active);
            }
            return Flow::Done(consts::SUCCESS());
        }
        // SAFETY: MPI is initialised.
        unsafe { w.idle(!native_active) };
    }
}

/// # Safety
/// Arguments as for `MPI_Request_free`.
pub unsafe fn request_free(request: *mut ffi::MPI_Request, commit: &mut Commit) -> Flow {
    if request.is_null() {
        return Flow::Native;
    }
    // SAFETY: a valid handle slot (MPI precondition).
    let Some(addr) = claim(unsafe { *request }, commit) else {
        return Flow::Native;
    };
    // SAFETY: ours, owned by the caller until this call gives it up.
    let done = poll(unsafe { by_addr(addr) }).is_some();
    with_shim(|s| {
        if done {
            s.free_request(addr);
        } else {
            // The slot stays taken until the SP completes it; harvested later and at finalize.
            s.registry.detach(addr);
        }
    });
    // SAFETY: as above.
    unsafe { *request = consts::REQUEST_NULL() };
    Flow::Done(consts::SUCCESS())
}

/// # Safety
/// Arguments as for `MPI_Request_get_status`.
pub unsafe fn request_get_status(
    request: ffi::MPI_Request,
    flag: *mut c_int,
    status: *mut ffi::MPI_Status,
    commit: &mut Commit,
) -> Flow {
    if flag.is_null() {
        return Flow::Native;
    }
    let Some(addr) = claim(request, commit) else {
        return Flow::Native;
    };
    // SAFETY: ours, owned by the caller; the request is left as it is.
    match poll(unsafe { by_addr(addr) }) {
        // SAFETY: valid flag and status (MPI preconditions).
        Some(code) => unsafe {
            *flag = 1;
            fill_status(status, code);
        },
        // SAFETY: valid flag; MPI is initialised.
        None => unsafe {
            *flag = 0;
            test_miss(false);
        },
    }
    Flow::Done(consts::SUCCESS())
}

/// # Safety
/// Arguments as for `MPI_Cancel`.
pub unsafe fn cancel(request: *mut ffi::MPI_Request, commit: &mut Commit) -> Flow {
    if request.is_null() {
        return Flow::Native;
    }
    // SAFETY: a valid handle slot (MPI precondition).
    let Some(addr) = claim(unsafe { *request }, commit) else {
        return Flow::Native;
    };
    say!(
        "rank {}: MPI_Cancel on an offloaded collective request: collectives cannot be cancelled",
        my_rank()
    );
    Flow::Raise {
        // SAFETY: ours, owned by the caller (not released: the request stays).
        comm: unsafe { by_addr(addr) }.errhandler_comm(),
        code: consts::ERR_ARG(),
    }
}

/// Waits until every request the program freed before completion has completed (for
/// `MPI_Finalize`). Ends when the SP completes them or the connection is lost.
///
/// # Safety
/// MPI is initialised.
pub unsafe fn drain_detached() {
    let mut w = Waiter::new();
    loop {
        let left = with_shim(|s| {
            s.harvest();
            s.registry.detached().len()
        })
        .unwrap_or(0);
        if left == 0 {
            return;
        }
        // SAFETY: forwarded.
        unsafe { w.idle(true) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_combination_follows_mpi() {
        let ok = consts::SUCCESS();
        let in_status = consts::ERR_IN_STATUS();
        let other = consts::ERR_OTHER();
        assert_eq!(combine(ok, false), Combined::Ok);
        assert_eq!(
            combine(ok, true),
            Combined::InStatus {
                native_errors_set: false
            }
        );
        assert_eq!(
            combine(in_status, false),
            Combined::InStatus {
                native_errors_set: true
            }
        );
        assert_eq!(combine(other, true), Combined::Fail(other));
    }

    #[test]
    fn native_subset_masks_ours_and_write_back_skips_them() {
        let null = consts::REQUEST_NULL();
        let a = 0x1000usize as ffi::MPI_Request;
        let b = 0x2000usize as ffi::MPI_Request;
        let handles = [a, null, b];
        let classes = [Class::Ours(0x1000), Class::Null, Class::Native];
        let natives = native_subset(&handles, &classes);
        assert_eq!(natives, [null, null, b]);
        // PMPI completed the native one.
        let mut handles = handles;
        write_back_natives(&mut handles, &classes, &[null, null, null]);
        assert_eq!(handles, [a, null, null]);
    }
}
