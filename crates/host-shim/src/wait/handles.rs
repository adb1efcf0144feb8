//! The handles of one Wait/Test call: which are ours (claiming the call for the shim), the
//! native subset handed to `PMPI_*` and written back, the status arrays, and the release of a
//! completed request of ours.

use crate::boundary::Commit;
use crate::completion::{poll, release};
use crate::registry::Class;
use crate::request::{by_addr, fill_status};
use crate::state::{is_active, with_shim, TRACKED};
use mpi_ffi as ffi;
use mpi_ffi::{abi, consts};
use std::os::raw::c_int;
use std::sync::atomic::Ordering;

/// Classifies `handles`; `None` when none is ours (the call is then native).
pub(super) fn classify(handles: &[ffi::MPI_Request]) -> Option<Vec<Class>> {
    if TRACKED.load(Ordering::Acquire) == 0 {
        return None;
    }
    let null = abi::handle_bits(consts::REQUEST_NULL());
    let classes = with_shim(|s| {
        handles
            .iter()
            .map(|&h| s.registry.classify(abi::handle_bits(h), null))
            .collect::<Vec<_>>()
    })?;
    classes
        .iter()
        .any(|c| matches!(c, Class::Ours(_)))
        .then_some(classes)
}

/// The object address if `handle` is ours.
pub(super) fn ours(handle: ffi::MPI_Request) -> Option<usize> {
    match classify(std::slice::from_ref(&handle))?.first() {
        Some(Class::Ours(a)) => Some(*a),
        _ => None,
    }
}

/// The start of every single-request call: `None` (native) unless the shim is active and
/// `handle` is ours; then the call is committed and this is the object's address.
pub(super) fn claim(handle: ffi::MPI_Request, commit: &mut Commit) -> Option<usize> {
    if !is_active() {
        return None;
    }
    let addr = ours(handle)?;
    commit.mark();
    Some(addr)
}

/// [`claim`] for the handle in the caller's slot `request`; `None` (native) for a null slot.
///
/// # Safety
/// `request` is null or the caller's valid handle slot.
pub(super) unsafe fn claim_slot(
    request: *mut ffi::MPI_Request,
    commit: &mut Commit,
) -> Option<usize> {
    if request.is_null() {
        return None;
    }
    // SAFETY: a valid handle slot (precondition).
    claim(unsafe { *request }, commit)
}

/// The start of every array call: `None` (native) unless the shim is active and one of the
/// `count` handles at `requests` is ours; then the call is committed and these are the
/// caller's handles and their classes.
///
/// # Safety
/// `requests` is null or the caller's array of `count` handles.
pub(super) unsafe fn claim_all<'a>(
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

pub(super) fn status_at(statuses: *mut ffi::MPI_Status, i: usize) -> *mut ffi::MPI_Status {
    if statuses.is_null() || statuses == consts::STATUSES_IGNORE() {
        consts::STATUS_IGNORE()
    } else {
        // SAFETY: the caller's array has one status per request and `i` is in range.
        unsafe { statuses.add(i) }
    }
}

pub(super) fn ignores(statuses: *mut ffi::MPI_Status) -> bool {
    statuses.is_null() || statuses == consts::STATUSES_IGNORE()
}

/// A copy of the handles with our positions set to `MPI_REQUEST_NULL`.
pub(super) fn native_subset(
    handles: &[ffi::MPI_Request],
    classes: &[Class],
) -> Vec<ffi::MPI_Request> {
    handles
        .iter()
        .zip(classes)
        .map(|(&h, c)| match c {
            Class::Ours(_) => consts::REQUEST_NULL(),
            _ => h,
        })
        .collect()
}

pub(super) fn write_back_natives(
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
pub(super) unsafe fn complete_one(
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

pub(super) fn all_ours_done(classes: &[Class]) -> bool {
    classes.iter().all(|c| match *c {
        // SAFETY: ours, owned by the caller's array.
        Class::Ours(a) => poll(unsafe { by_addr(a) }).is_some(),
        _ => true,
    })
}

/// Index and code of the first completed request of ours.
pub(super) fn first_done_ours(classes: &[Class]) -> Option<(usize, usize, c_int)> {
    classes.iter().enumerate().find_map(|(i, c)| match *c {
        // SAFETY: ours, owned by the caller's array.
        Class::Ours(a) => poll(unsafe { by_addr(a) }).map(|code| (i, a, code)),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_subset_masks_ours_and_write_back_skips_them() {
        let null = consts::REQUEST_NULL();
        let a: ffi::MPI_Request = abi::handle_from_bits(0x1000);
        let b: ffi::MPI_Request = abi::handle_from_bits(0x2000);
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
