//! Status codes and the crate's error type.
//!
//! UCX reports results as `ucs_status_t`, a packed C enum that is one signed
//! byte wide: zero is success, one is "in progress" and negative values are
//! errors. The bindings keep it as a plain integer rather than a Rust enum,
//! because a value the library returns that this header version does not list
//! would be undefined behaviour in a Rust enum. [`Status`] wraps that integer.
//!
//! Nonblocking calls return a `ucs_status_ptr_t`, which is either NULL (done),
//! a small negative number cast to a pointer (an error), or a request handle.
//! The C macros that tell these apart (`UCS_PTR_IS_ERR`, `UCS_PTR_IS_PTR`,
//! `UCS_PTR_STATUS`) cannot be bound by bindgen, so they are re-implemented
//! here from `ucs/type/status.h`.

use std::ffi::CStr;
use std::fmt;

use crate::raw;

/// A UCX status code (`ucs_status_t`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status(pub raw::ucs_status_t);

impl Status {
    /// `UCS_OK`.
    pub const OK: Status = Status(raw::UCS_OK);
    /// `UCS_INPROGRESS`: the operation has not completed yet.
    pub const IN_PROGRESS: Status = Status(raw::UCS_INPROGRESS);
    /// `UCS_ERR_BUSY`: returned by `ucp_worker_arm` when events are pending.
    pub const ERR_BUSY: Status = Status(raw::UCS_ERR_BUSY);
    /// `UCS_ERR_INVALID_PARAM`.
    pub const ERR_INVALID_PARAM: Status = Status(raw::UCS_ERR_INVALID_PARAM);
    /// `UCS_ERR_CANCELED`.
    pub const ERR_CANCELED: Status = Status(raw::UCS_ERR_CANCELED);
    /// `UCS_ERR_UNREACHABLE`.
    pub const ERR_UNREACHABLE: Status = Status(raw::UCS_ERR_UNREACHABLE);
    /// `UCS_ERR_UNSUPPORTED`: e.g. `ucp_memh_pack` with the export flag where no memory domain
    /// can export.
    pub const ERR_UNSUPPORTED: Status = Status(raw::UCS_ERR_UNSUPPORTED);

    /// True for `UCS_OK` only.
    pub fn is_ok(self) -> bool {
        self.0 == raw::UCS_OK
    }

    /// True for every negative code (`UCS_STATUS_IS_ERR`).
    pub fn is_err(self) -> bool {
        self.0 < 0
    }

    /// The raw integer value.
    pub fn code(self) -> i8 {
        self.0
    }

    /// The library's text for this code (`ucs_status_string`).
    pub fn as_str(self) -> &'static str {
        // SAFETY: ucs_status_string accepts any value (unknown codes map to a
        // generic "Unknown error" string) and returns a pointer to a static,
        // NUL-terminated string that is never freed.
        let s = unsafe { CStr::from_ptr(raw::ucs_status_string(self.0)) };
        s.to_str().unwrap_or("(non-UTF-8 UCX status string)")
    }

    /// Turns this status into `Ok(())` or an [`Error`] naming `op`.
    pub fn check(self, op: &'static str) -> Result<()> {
        if self.is_ok() {
            Ok(())
        } else {
            Err(Error { op, status: self })
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.as_str(), self.0)
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Status({}, {:?})", self.0, self.as_str())
    }
}

/// A failed UCX call: which operation, and the status it returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Error {
    /// Name of the UCX function (or wrapper operation) that failed.
    pub op: &'static str,
    /// The status it returned.
    pub status: Status,
}

impl Error {
    /// An error that did not come from UCX itself but is reported with a UCX
    /// status code (for example an argument the wrapper rejects up front).
    pub fn new(op: &'static str, status: Status) -> Self {
        Error { op, status }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.op, self.status)
    }
}

impl std::error::Error for Error {}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;

/// `(uintptr_t)UCS_ERR_LAST`: the enumerator is an `int` of value -100, so
/// the cast sign-extends to the top of the address space.
const ERR_LAST_AS_UPTR: usize = raw::UCS_ERR_LAST as isize as usize;

/// `UCS_PTR_IS_ERR`: the pointer encodes an error code.
pub fn ptr_is_err(p: raw::ucs_status_ptr_t) -> bool {
    (p as usize) >= ERR_LAST_AS_UPTR
}

/// `UCS_PTR_IS_PTR`: the pointer is a real request handle (neither NULL nor
/// an encoded error).
pub fn ptr_is_ptr(p: raw::ucs_status_ptr_t) -> bool {
    (p as usize).wrapping_sub(1) < ERR_LAST_AS_UPTR.wrapping_sub(1)
}

/// `UCS_PTR_STATUS`: `IN_PROGRESS` for a request handle, otherwise the
/// encoded status (`OK` for NULL).
pub fn ptr_status(p: raw::ucs_status_ptr_t) -> Status {
    if ptr_is_ptr(p) {
        Status::IN_PROGRESS
    } else {
        // UCS_PTR_RAW_STATUS: (ucs_status_t)(intptr_t)ptr, a truncating cast.
        Status(p as isize as raw::ucs_status_t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_uses_ucs_status_string() {
        assert_eq!(Status::OK.to_string(), "Success (0)");
        assert!(Status::ERR_BUSY.to_string().contains("Device is busy"));
        assert!(Status::ERR_BUSY.to_string().ends_with("(-15)"));
        // A value the header does not list must not crash.
        assert!(!Status(-99).as_str().is_empty());
        let e = Status::ERR_INVALID_PARAM.check("ucp_frob").unwrap_err();
        assert_eq!(e.to_string(), "ucp_frob failed: Invalid parameter (-5)");
        assert!(Status::OK.check("x").is_ok());
        assert!(Status::ERR_CANCELED.is_err() && !Status::IN_PROGRESS.is_err());
    }

    #[test]
    fn status_pointer_macros() {
        let null = std::ptr::null_mut();
        assert!(!ptr_is_err(null) && !ptr_is_ptr(null));
        assert_eq!(ptr_status(null), Status::OK);

        for code in [
            raw::UCS_ERR_NO_MESSAGE,
            raw::UCS_ERR_BUSY,
            raw::UCS_ERR_LAST,
        ] {
            let p = code as isize as usize as raw::ucs_status_ptr_t;
            assert!(ptr_is_err(p), "{code}");
            assert!(!ptr_is_ptr(p), "{code}");
            assert_eq!(ptr_status(p), Status(code));
        }

        let mut x = 0u64;
        let p = &mut x as *mut u64 as raw::ucs_status_ptr_t;
        assert!(ptr_is_ptr(p) && !ptr_is_err(p));
        assert_eq!(ptr_status(p), Status::IN_PROGRESS);
    }
}
