//! Which `MPI_Request` handles are the shim's.
//!
//! An offloaded request is a heap object; its handle is the object's address. The registry
//! holds the addresses of every such object the program still holds a handle to (`live`), and of
//! those it gave up with `MPI_Request_free` before they completed (`detached`: the shim still
//! owns them until the SP reports completion). A handle is ours exactly when its value is in
//! `live`: a native request is a live Open MPI object, so its address cannot equal that of a
//! live object of ours. `MPI_REQUEST_NULL` is its own class.

use std::collections::HashSet;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Null,
    Native,
    /// One of ours: the object's address.
    Ours(usize),
}

#[derive(Debug, Default)]
pub struct Registry {
    live: HashSet<usize>,
    detached: Vec<usize>,
}

impl Registry {
    pub fn insert(&mut self, addr: usize) {
        assert!(self.live.insert(addr), "request {addr:#x} registered twice");
    }

    /// Forgets a live handle; false if it was not one.
    pub fn remove(&mut self, addr: usize) -> bool {
        self.live.remove(&addr)
    }

    /// Moves a live handle to the detached list (the program freed it before completion).
    pub fn detach(&mut self, addr: usize) {
        assert!(
            self.live.remove(&addr),
            "detaching unknown request {addr:#x}"
        );
        self.detached.push(addr);
    }

    pub fn classify(&self, handle: usize, null: usize) -> Class {
        if handle == null {
            Class::Null
        } else if self.live.contains(&handle) {
            Class::Ours(handle)
        } else {
            Class::Native
        }
    }

    /// Every object the shim still owns or tracks: live, then detached.
    pub fn all(&self) -> impl Iterator<Item = usize> + '_ {
        self.live
            .iter()
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

    #[test]
    fn classifies_null_native_and_ours() {
        let mut r = Registry::default();
        r.insert(0x1000);
        r.insert(0x2000);
        assert_eq!(r.classify(NULL, NULL), Class::Null);
        assert_eq!(r.classify(0x1000, NULL), Class::Ours(0x1000));
        assert_eq!(r.classify(0x1008, NULL), Class::Native);
        assert!(r.remove(0x1000));
        assert!(!r.remove(0x1000));
        assert_eq!(r.classify(0x1000, NULL), Class::Native);
    }

    #[test]
    fn detached_requests_are_no_longer_handles_but_are_tracked() {
        let mut r = Registry::default();
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
        let mut r = Registry::default();
        r.insert(8);
        r.insert(8);
    }
}
