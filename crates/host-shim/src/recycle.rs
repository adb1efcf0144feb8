//! Vectors a post reuses: the per-peer counts and displacements of a call's sides and of their
//! byte layouts, taken from a pool of the calling thread and given back when dropped, so that
//! a post in a steady loop allocates none of them (the rank's time in MPI per call is a few
//! microseconds, and each allocation and free costs tens of nanoseconds).
//!
//! The pool is per thread (no lock: under `MPI_THREAD_MULTIPLE` each posting thread has its
//! own) and small: [`KEPT`] vectors of each element type, none longer than [`KEPT_LEN`]
//! elements (a communicator of many thousands of ranks allocates per call, as before). A
//! vector dropped on another thread (a request's, finished by a harvesting thread) joins that
//! thread's pool; one dropped while its thread is exiting is freed.

use std::cell::RefCell;
use std::thread::LocalKey;

/// Vectors kept per element type and thread: a post holds at most eight (two sides' counts
/// and displacements, and their byte layouts).
pub const KEPT: usize = 8;
/// Longer vectors are freed rather than kept.
pub const KEPT_LEN: usize = 1 << 16;

/// An element type with a pool.
pub trait Pooled: Copy + 'static {
    fn pool() -> &'static LocalKey<RefCell<Vec<Vec<Self>>>>;
}

thread_local! {
    static I64S: RefCell<Vec<Vec<i64>>> = const { RefCell::new(Vec::new()) };
    static U64S: RefCell<Vec<Vec<u64>>> = const { RefCell::new(Vec::new()) };
}

impl Pooled for i64 {
    fn pool() -> &'static LocalKey<RefCell<Vec<Vec<i64>>>> {
        &I64S
    }
}

impl Pooled for u64 {
    fn pool() -> &'static LocalKey<RefCell<Vec<Vec<u64>>>> {
        &U64S
    }
}

/// A vector from the pool (empty, with whatever capacity it had), given back when dropped.
pub struct Recycled<T: Pooled>(Vec<T>);

impl<T: Pooled> Recycled<T> {
    /// An empty vector from the pool, or a new one.
    pub fn new() -> Self {
        let v = T::pool()
            .try_with(|p| p.try_borrow_mut().ok().and_then(|mut p| p.pop()))
            .ok()
            .flatten()
            .unwrap_or_default();
        Recycled(v)
    }

    /// A vector from the pool holding `items`.
    pub fn collect(items: impl IntoIterator<Item = T>) -> Self {
        let mut v = Self::new();
        v.0.extend(items);
        v
    }

    /// A vector from the pool holding `slice`.
    pub fn of(slice: &[T]) -> Self {
        let mut v = Self::new();
        v.0.extend_from_slice(slice);
        v
    }
}

impl<T: Pooled> Default for Recycled<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Pooled> Drop for Recycled<T> {
    fn drop(&mut self) {
        let mut v = std::mem::take(&mut self.0);
        if v.capacity() == 0 || v.capacity() > KEPT_LEN {
            return;
        }
        v.clear();
        // While the thread exits (its pool gone) or the pool is borrowed, the vector is freed.
        let _ = T::pool().try_with(|p| {
            if let Ok(mut p) = p.try_borrow_mut() {
                if p.len() < KEPT {
                    p.push(v);
                }
            }
        });
    }
}

impl<T: Pooled> std::ops::Deref for Recycled<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.0
    }
}

impl<T: Pooled> std::ops::DerefMut for Recycled<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.0
    }
}

impl<'a, T: Pooled> IntoIterator for &'a Recycled<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl<T: Pooled> From<Vec<T>> for Recycled<T> {
    fn from(v: Vec<T>) -> Self {
        Recycled(v)
    }
}

impl<T: Pooled + std::fmt::Debug> std::fmt::Debug for Recycled<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<T: Pooled + PartialEq> PartialEq for Recycled<T> {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl<T: Pooled + Eq> Eq for Recycled<T> {}

impl<T: Pooled + PartialEq> PartialEq<Vec<T>> for Recycled<T> {
    fn eq(&self, other: &Vec<T>) -> bool {
        &self.0 == other
    }
}

impl<T: Pooled + PartialEq, const N: usize> PartialEq<[T; N]> for Recycled<T> {
    fn eq(&self, other: &[T; N]) -> bool {
        self.0 == other
    }
}

impl<T: Pooled> Clone for Recycled<T> {
    fn clone(&self) -> Self {
        Self::of(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pooled<T: Pooled>() -> usize {
        T::pool().with(|p| p.borrow().len())
    }

    /// A dropped vector's memory is what the next `new` returns, emptied; the pool holds at
    /// most `KEPT`, and a vector longer than `KEPT_LEN` is not kept.
    #[test]
    fn a_dropped_vector_is_the_next_one_taken() {
        let mut a = Recycled::<u64>::collect([1, 2, 3]);
        a.reserve(100);
        let (ptr, cap) = (a.as_ptr(), a.capacity());
        drop(a);
        let b = Recycled::<u64>::new();
        assert!(b.is_empty());
        assert_eq!((b.as_ptr(), b.capacity()), (ptr, cap));
        drop(b);

        let many: Vec<_> = (0..2 * KEPT)
            .map(|i| Recycled::<i64>::of(&[i as i64]))
            .collect();
        drop(many);
        assert_eq!(pooled::<i64>(), KEPT);

        u64::pool().with(|p| p.borrow_mut().clear());
        drop(Recycled::<u64>::from(vec![0; KEPT_LEN + 1]));
        assert_eq!(pooled::<u64>(), 0, "a vector over KEPT_LEN is freed");
        drop(Recycled::<u64>::from(vec![0; 4]));
        assert_eq!(pooled::<u64>(), 1);
    }
}
