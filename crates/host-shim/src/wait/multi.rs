//! The multi-request calls (Waitall/Testall, Waitany/Testany, Waitsome/Testsome) and how a
//! call that mixes our requests with native ones reports errors.

use super::handles::{
    all_ours_done, claim_all, complete_one, first_done_ours, ignores, native_subset, status_at,
    write_back_natives,
};
use super::progress::{test_miss, Waiter};
use crate::boundary::{Commit, Flow};
use crate::completion::poll;
use crate::registry::Class;
use crate::request::by_addr;
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::c_int;

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
        // Native requests only: see `wait::wait_natives`.
        // SAFETY: MPI is initialised; the caller's arguments.
        return unsafe {
            super::wait_natives(commit, || {
                let mut flag: c_int = 0;
                let rc = ffi::PMPI_Testall(count, requests, &mut flag, statuses);
                (flag != 0 || rc != consts::SUCCESS()).then_some(rc)
            })
        };
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
        if flag.is_some() {
            return Flow::Native;
        }
        // Waitany on native requests only: see `wait::wait_natives`.
        // SAFETY: MPI is initialised; the caller's arguments.
        return unsafe {
            super::wait_natives(commit, || {
                let mut done: c_int = 0;
                let rc = ffi::PMPI_Testany(count, requests, index, &mut done, status);
                (done != 0 || rc != consts::SUCCESS()).then_some(rc)
            })
        };
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
        if !blocking {
            return Flow::Native;
        }
        // Waitsome on native requests only: see `wait::wait_natives`.
        // SAFETY: MPI is initialised; the caller's arguments.
        return unsafe {
            super::wait_natives(commit, || {
                let rc = ffi::PMPI_Testsome(incount, requests, outcount, indices, statuses);
                (*outcount != 0 || rc != consts::SUCCESS()).then_some(rc)
            })
        };
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
}
