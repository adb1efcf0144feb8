//! The SP's side of the shared segment of the hierarchical staged designs (see the shim's
//! `segment.rs`): the ranks of one node map one POSIX shared-memory object per job, one equal
//! part per SP of the node; an SP gives each hierarchical instance it writes a region of its
//! own part ([`Arena`]), writes the chunks there once, and hands ranks a copy out of the
//! region (its own ranks, and through its node's other SPs theirs); the region is free again
//! once every reader copied and the instance finished.

/// Regions are aligned to this (cache lines: ranks copy out of neighbouring regions).
const ALIGN: u64 = 64;

/// First-fit allocation of regions of `[base, base + len)` of a segment.
#[derive(Debug)]
pub struct Arena {
    base: u64,
    len: u64,
    /// Allocated (offset, length), sorted by offset.
    used: Vec<(u64, u64)>,
}

impl Arena {
    pub fn new(base: u64, len: u64) -> Arena {
        Arena {
            base,
            len: base.checked_add(len).map_or(0, |_| len),
            used: Vec::new(),
        }
    }

    /// The size of the part this arena manages.
    pub fn capacity(&self) -> u64 {
        self.len
    }

    /// A region of `len` bytes (at least one byte is reserved, so every region is distinct),
    /// as its offset in the segment, or `None` while none is free.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let want = len.max(1).checked_add(ALIGN - 1)? / ALIGN * ALIGN;
        let mut at = self.base;
        let mut idx = 0;
        for (i, &(off, l)) in self.used.iter().enumerate() {
            if off - at >= want {
                break;
            }
            at = off + l;
            idx = i + 1;
        }
        if (self.base + self.len).checked_sub(at)? < want {
            return None;
        }
        self.used.insert(idx, (at, want));
        Some(at)
    }

    pub fn free(&mut self, off: u64) {
        self.used.retain(|&(o, _)| o != off);
    }

    pub fn in_use(&self) -> usize {
        self.used.len()
    }
}

/// Removes the name of the segment of `node` in `job` (if any rank created it).
pub fn unlink(key: &bootstrap::auth::ClusterKey, job: u64, node: u32) {
    if let Ok(name) = std::ffi::CString::new(crate::access::segment_name(key, job, node)) {
        // SAFETY: a valid C string; a missing name is just ENOENT.
        unsafe { libc::shm_unlink(name.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_disjoint_reused_and_bounded() {
        let mut a = Arena::new(0, 1024);
        let x = a.alloc(100).unwrap();
        let y = a.alloc(0).unwrap();
        let z = a.alloc(500).unwrap();
        assert_ne!(x, y);
        assert!(y >= x + 100 && z > y);
        assert!(a.alloc(400).is_none());
        a.free(x);
        assert_eq!(a.alloc(64), Some(x));
        assert_eq!(a.alloc(64), Some(64));
        a.free(z);
        assert!(a.alloc(700).is_some());
        assert!(a.alloc(u64::MAX).is_none());
        assert_eq!(a.in_use(), 4);
    }

    #[test]
    fn a_part_of_the_segment_places_regions_only_inside_it() {
        let mut a = Arena::new(4096, 1024);
        let x = a.alloc(1000).unwrap();
        assert_eq!(x, 4096);
        assert!(
            a.alloc(64).is_none(),
            "the part is full; the next part is not ours"
        );
        a.free(x);
        let mut seen = Vec::new();
        while let Some(o) = a.alloc(10) {
            assert!((4096..4096 + 1024).contains(&o), "{o}");
            seen.push(o);
        }
        assert_eq!(seen.len(), 1024 / 64);
    }
}
