//! Host side: turning buffers into grants.
//!
//! [`Registrar`] hands out one region id per distinct (address, length, rights) and keeps it in
//! a bounded cache, so repeated collectives on the same buffers send the same grant (an SP can
//! keep what it imported for it). [`Registrar::invalidate`] is called when memory in a range is
//! freed or remapped: every cached registration overlapping it gets a new generation, and an SP
//! that still holds the old one refuses it ([`crate::AccessError::StaleGeneration`]).
//!
//! With the `cma` backend a registration holds no kernel or NIC resource, so the cache only
//! saves work on the SP side; the `ucx` backend (which pins and maps) is where the cache and its
//! invalidation carry weight.

use crate::{BackendData, Grant, Rights};
use std::collections::HashMap;

/// Most registrations kept; past this the oldest half is dropped (they are re-created on use).
pub const MAX_CACHED: usize = 4096;

#[derive(Debug)]
struct Entry {
    region: u64,
    generation: u32,
    last_use: u64,
}

/// Produces grants for this process's buffers.
#[derive(Debug, Default)]
pub struct Registrar {
    cache: HashMap<(u64, u64, u8), Entry>,
    next_region: u64,
    clock: u64,
    hits: u64,
    misses: u64,
}

impl Registrar {
    pub fn new() -> Self {
        Self::default()
    }

    /// A grant for `len` bytes at `addr` with `rights`. Zero-length buffers get a valid grant of
    /// length 0 (every access but an empty one at offset 0 is then refused).
    pub fn register(&mut self, addr: u64, len: u64, rights: Rights) -> Grant {
        self.clock += 1;
        let clock = self.clock;
        let key = (addr, len, rights.bits());
        if let Some(e) = self.cache.get_mut(&key) {
            e.last_use = clock;
            self.hits += 1;
            return Grant {
                region: e.region,
                generation: e.generation,
                addr,
                len,
                rights,
                backend: BackendData::Cma,
            };
        }
        self.misses += 1;
        if self.cache.len() >= MAX_CACHED {
            self.evict_oldest_half();
        }
        self.next_region += 1;
        let region = self.next_region;
        self.cache.insert(
            key,
            Entry {
                region,
                generation: 0,
                last_use: clock,
            },
        );
        Grant {
            region,
            generation: 0,
            addr,
            len,
            rights,
            backend: BackendData::Cma,
        }
    }

    /// Memory in `[addr, addr+len)` was freed or remapped: overlapping registrations get a new
    /// generation. Returns how many were invalidated.
    pub fn invalidate(&mut self, addr: u64, len: u64) -> usize {
        let end = addr.saturating_add(len);
        let mut n = 0;
        for ((a, l, _), e) in self.cache.iter_mut() {
            if *a < end && addr < a.saturating_add(*l) {
                e.generation += 1;
                n += 1;
            }
        }
        n
    }

    /// (hits, misses) of the cache, for stats.
    pub fn stats(&self) -> (u64, u64) {
        (self.hits, self.misses)
    }

    fn evict_oldest_half(&mut self) {
        let mut uses: Vec<u64> = self.cache.values().map(|e| e.last_use).collect();
        uses.sort_unstable();
        let cut = uses[uses.len() / 2];
        self.cache.retain(|_, e| e.last_use > cut);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_buffer_same_grant_until_invalidated() {
        let mut r = Registrar::new();
        let a = r.register(0x1000, 64, Rights::READ);
        let b = r.register(0x1000, 64, Rights::READ);
        assert_eq!(a, b);
        let c = r.register(0x1000, 64, Rights::WRITE);
        assert_ne!(a.region, c.region);
        assert_eq!(r.invalidate(0x1030, 1), 2);
        let d = r.register(0x1000, 64, Rights::READ);
        assert_eq!(d.region, a.region);
        assert_eq!(d.generation, a.generation + 1);
        assert_eq!(
            r.invalidate(0x1040, 16),
            0,
            "ranges that only touch do not overlap"
        );
        assert_eq!(r.stats(), (2, 2));
    }

    #[test]
    fn cache_is_bounded() {
        let mut r = Registrar::new();
        for i in 0..(MAX_CACHED as u64 * 3) {
            r.register(i * 8, 8, Rights::READ);
        }
        assert!(r.cache.len() <= MAX_CACHED);
    }
}
