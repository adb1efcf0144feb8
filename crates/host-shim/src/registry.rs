//! Which `MPI_Request` handles are the shim's.
//!
//! An offloaded request is a heap object. The registry maps the handle given to the program to
//! the object's address, for every object the program still holds a handle to (`live`), and
//! keeps the addresses of those it gave up with `MPI_Request_free` before they completed
//! (`detached`: the shim still owns them until the SP reports completion). A handle is ours
//! exactly when it is in `live`. How handles are named depends on the MPI ABI
//! ([`mpi_ffi::abi::SHIM_REQUESTS`]): under Open MPI the handle is the object's address (a
//! native request is a live Open MPI object, so its address cannot equal that of a live object
//! of ours); under MPICH, whose handles are 32-bit integers, it is drawn from a range MPICH
//! never gives out. `MPI_REQUEST_NULL` is its own class.

use mpi_ffi::abi::{ShimRequests, SHIM_REQUESTS};
use rustc_hash::FxHashMap as HashMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Null,
    Native,
    /// One of ours: the object's address.
    Ours(usize),
}

#[derive(Debug)]
pub struct Registry {
    naming: ShimRequests,
    /// Handle -> object address. (Fx hashing: the keys are this process's own, looked up at
    /// every post, test and wait.)
    live: HashMap<usize, usize>,
    /// Object address -> handle, for the live ones.
    handles: HashMap<usize, usize>,
    detached: Vec<usize>,
    /// Under a handle range: the offset in it of the next handle to try.
    next: usize,
}

impl Default for Registry {
    fn default() -> Self {
        Registry::naming(SHIM_REQUESTS)
    }
}

impl Registry {
    /// An empty registry naming requests by `naming` (the build's ABI by default).
    pub fn naming(naming: ShimRequests) -> Self {
        Registry {
            naming,
            live: HashMap::default(),
            handles: HashMap::default(),
            detached: Vec::new(),
            next: 0,
        }
    }

    /// Registers the object at `addr` and returns the handle to give the program for it.
    pub fn insert(&mut self, addr: usize) -> usize {
        let handle = match self.naming {
            ShimRequests::ObjectAddress => addr,
            ShimRequests::Range { first, count } => {
                assert!(self.live.len() < count, "out of request handles");
                // The first free handle from the cursor on: with far fewer live requests than
                // handles this takes one step or a few.
                loop {
                    let h = first + self.next;
                    self.next = (self.next + 1) % count;
                    if !self.live.contains_key(&h) {
                        break h;
                    }
                }
            }
        };
        assert!(
            self.live.insert(handle, addr).is_none(),
            "request {addr:#x} registered twice"
        );
        assert!(
            self.handles.insert(addr, handle).is_none(),
            "request {addr:#x} registered twice"
        );
        handle
    }

    /// Forgets a live object; false if it was not one.
    pub fn remove(&mut self, addr: usize) -> bool {
        match self.handles.remove(&addr) {
            Some(handle) => {
                self.live.remove(&handle);
                true
            }
            None => false,
        }
    }

    /// Moves a live object to the detached list (the program freed it before completion).
    pub fn detach(&mut self, addr: usize) {
        assert!(self.remove(addr), "detaching unknown request {addr:#x}");
        self.detached.push(addr);
    }

    pub fn classify(&self, handle: usize, null: usize) -> Class {
        if handle == null {
            Class::Null
        } else if let Some(&addr) = self.live.get(&handle) {
            Class::Ours(addr)
        } else {
            Class::Native
        }
    }

    /// Every object the shim still owns or tracks: live, then detached.
    pub fn all(&self) -> impl Iterator<Item = usize> + '_ {
        self.live
            .values()
            .copied()
            .chain(self.detached.iter().copied())
    }

    pub fn detached(&self) -> &[usize] {
        &self.detached
    }

    /// Removes detached entries for which `done` says true and returns them.
    pub fn take_finished_detached(&mut self, mut done: impl FnMut(usize) -> bool) -> Vec<usize> {
        let mut finished = Vec::new();
        self.detached.retain(|&a| {
            if done(a) {
                finished.push(a);
                false
            } else {
                true
            }
        });
        finished
    }

    /// Live plus detached objects.
    pub fn len(&self) -> usize {
        self.live.len() + self.detached.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NULL: usize = 0x5000;

    const RANGE: ShimRequests = ShimRequests::Range {
        first: 0x2c00_0001,
        count: 3,
    };

    #[test]
    fn classifies_null_native_and_ours() {
        let mut r = Registry::naming(ShimRequests::ObjectAddress);
        assert_eq!(r.insert(0x1000), 0x1000);
        assert_eq!(r.insert(0x2000), 0x2000);
        assert_eq!(r.classify(NULL, NULL), Class::Null);
        assert_eq!(r.classify(0x1000, NULL), Class::Ours(0x1000));
        assert_eq!(r.classify(0x1008, NULL), Class::Native);
        assert!(r.remove(0x1000));
        assert!(!r.remove(0x1000));
        assert_eq!(r.classify(0x1000, NULL), Class::Native);
    }

    #[test]
    fn detached_requests_are_no_longer_handles_but_are_tracked() {
        let mut r = Registry::naming(ShimRequests::ObjectAddress);
        r.insert(0x1000);
        r.insert(0x2000);
        r.detach(0x1000);
        assert_eq!(r.classify(0x1000, NULL), Class::Native);
        assert_eq!(r.len(), 2);
        let mut all: Vec<usize> = r.all().collect();
        all.sort();
        assert_eq!(all, [0x1000, 0x2000]);
        assert_eq!(r.take_finished_detached(|_| false), Vec::<usize>::new());
        assert_eq!(r.take_finished_detached(|a| a == 0x1000), [0x1000]);
        assert!(r.detached().is_empty());
        assert_eq!(r.len(), 1);
    }

    #[test]
    #[should_panic(expected = "registered twice")]
    fn double_registration_is_a_bug() {
        let mut r = Registry::naming(ShimRequests::ObjectAddress);
        r.insert(8);
        r.insert(8);
    }

    #[test]
    #[should_panic(expected = "registered twice")]
    fn double_registration_is_a_bug_under_a_handle_range() {
        let mut r = Registry::naming(RANGE);
        r.insert(8);
        r.insert(8);
    }

    #[test]
    fn a_handle_range_names_objects_apart_from_their_addresses() {
        let mut r = Registry::naming(RANGE);
        let a = r.insert(0x1000);
        let b = r.insert(0x2000);
        assert_eq!((a, b), (0x2c00_0001, 0x2c00_0002));
        assert_eq!(r.classify(a, NULL), Class::Ours(0x1000));
        assert_eq!(r.classify(b, NULL), Class::Ours(0x2000));
        // An address is not a handle.
        assert_eq!(r.classify(0x1000, NULL), Class::Native);
        // Freed handles are reused, live ones never: the cursor wraps around the range and
        // skips `b`, still live.
        assert!(r.remove(0x1000));
        let c = r.insert(0x3000);
        assert_eq!(c, 0x2c00_0003);
        let d = r.insert(0x4000);
        assert_eq!(d, a, "the freed handle comes back after the wrap");
        assert_eq!(r.classify(d, NULL), Class::Ours(0x4000));
        r.detach(0x2000);
        assert_eq!(r.classify(b, NULL), Class::Native);
        assert_eq!(r.insert(0x5000), b);
        let mut all: Vec<usize> = r.all().collect();
        all.sort();
        assert_eq!(all, [0x2000, 0x3000, 0x4000, 0x5000]);
    }

    #[test]
    #[should_panic(expected = "out of request handles")]
    fn a_full_handle_range_is_a_bug_not_a_collision() {
        let mut r = Registry::naming(RANGE);
        for a in 1..=4 {
            r.insert(a * 8);
        }
    }
}
