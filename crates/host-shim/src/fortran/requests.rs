//! Fortran handles of the shim's requests.
//!
//! A request the shim hands out is the address of its object (`registry.rs`). Where requests
//! are integers (MPICH's ABI) the C handle is also the Fortran one and the library's own
//! conversion is the identity. Where they are pointers (Open MPI), the library converts through
//! a table of its own request objects, which ours are not: the shim's requests then get Fortran
//! integers of their own, negative ones (Open MPI's are indices from 0, `MPI_REQUEST_NULL`
//! being 0), from the table here. An entry lives from the nonblocking call that made the
//! request until a Fortran Wait/Test call (or `MPI_Request_free`) hands the program another
//! value for that request variable.
//!
//! Every Fortran call of the Wait/Test family converts its requests with [`f2c`], runs the
//! shim's C function, then rewrites with [`update`] exactly the request variables whose C
//! handle changed (a completed request became `MPI_REQUEST_NULL`): a request the call left
//! alone keeps its Fortran value, as the library's own bindings do.

use super::abi::{self, Fint};
use crate::state::with_shim;
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::collections::HashMap;
use std::sync::Mutex;

/// The first Fortran value given to a request of ours; later ones count down from it.
const FIRST: Fint = -1024;

#[derive(Default)]
struct Table {
    by_fint: HashMap<Fint, usize>,
    next: Fint,
}

impl Table {
    /// A Fortran value for `addr`, not in use.
    fn insert(&mut self, addr: usize) -> Fint {
        loop {
            if self.next > FIRST || self.next == Fint::MIN {
                self.next = FIRST;
            }
            let f = self.next;
            self.next -= 1;
            if let std::collections::hash_map::Entry::Vacant(e) = self.by_fint.entry(f) {
                e.insert(addr);
                return f;
            }
        }
    }
}

static TABLE: Mutex<Option<Table>> = Mutex::new(None);

fn with_table<R>(f: impl FnOnce(&mut Table) -> R) -> R {
    let mut t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    f(t.get_or_insert_with(Table::default))
}

/// Whether some Fortran request variable may hold one of our values.
pub fn any() -> bool {
    !abi::INT_REQUESTS && with_table(|t| !t.by_fint.is_empty())
}

/// Whether `c` is a live request of the shim.
fn is_ours(c: ffi::MPI_Request) -> bool {
    let null = consts::REQUEST_NULL() as usize;
    with_shim(|s| {
        matches!(
            s.registry.classify(c as usize, null),
            crate::registry::Class::Ours(_)
        )
    })
    .unwrap_or(false)
}

/// The C handle of a Fortran request.
pub fn f2c(f: Fint) -> ffi::MPI_Request {
    if !abi::INT_REQUESTS && f <= FIRST {
        if let Some(addr) = with_table(|t| t.by_fint.get(&f).copied()) {
            return addr as ffi::MPI_Request;
        }
    }
    abi::request_f2c(f)
}

/// The Fortran handle of a C request the program is being given.
pub fn c2f(c: ffi::MPI_Request) -> Fint {
    if !abi::INT_REQUESTS && is_ours(c) {
        return with_table(|t| t.insert(c as usize));
    }
    abi::request_c2f(c)
}

/// After a call that may have changed the request `before` (the C handle of `*slot`) into
/// `after`: rewrites the Fortran variable if it changed, forgetting our value it held.
///
/// # Safety
/// `slot` is the program's Fortran request variable.
pub unsafe fn update(slot: *mut Fint, before: ffi::MPI_Request, after: ffi::MPI_Request) {
    if before == after {
        return;
    }
    // SAFETY: the caller's request variable.
    let old = unsafe { *slot };
    if !abi::INT_REQUESTS && old <= FIRST {
        with_table(|t| t.by_fint.remove(&old));
    }
    // SAFETY: as above.
    unsafe { *slot = c2f(after) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_negative_distinct_and_reused_only_when_free() {
        let mut t = Table::default();
        let a = t.insert(0x1000);
        let b = t.insert(0x2000);
        assert!(a <= FIRST && b <= FIRST && a != b);
        t.next = a; // wrap onto a value in use: it is skipped
        let c = t.insert(0x3000);
        assert_ne!(c, a);
        assert_ne!(c, b);
        t.by_fint.remove(&a);
        t.next = a;
        assert_eq!(t.insert(0x4000), a);
        t.by_fint.clear();
        t.next = Fint::MIN;
        assert_eq!(t.insert(0x5000), FIRST);
    }
}
