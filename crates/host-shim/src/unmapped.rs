//! Unmapped memory, as reported by UCX's memory hooks (libucm), for the `ucx` grant cache.
//!
//! A `ucx` grant holds a `ucp_mem_map` registration that the registrar caches by (address,
//! length, rights), so repeated collectives on the same buffers reuse it. When the program
//! frees or remaps such memory the registration must go: the same addresses may come back as
//! other memory. libucm calls [`record`] **before** the memory is unmapped (`munmap`,
//! `mremap`, `brk` shrinking, `madvise(MADV_DONTNEED)`, including the ones `free` does), on the
//! thread that unmaps, possibly with the allocator's locks held. So [`record`] neither
//! allocates nor locks: it appends the range to a fixed ring of [`RING`] entries (a
//! compare-and-swap reservation, then a per-entry sequence number that publishes it), and when
//! the ring is full it raises an overflow flag meaning "invalidate everything". Ranges outside
//! the span of addresses ever registered ([`watch`]) are ignored, so the allocator's and UCX's
//! own traffic rarely fills the ring.
//!
//! The shim drains the ring ([`apply`], under its lock: the only consumer) right before every
//! `ucx` registration, calling `UcxRegistrar::invalidate` on each range: the registration is
//! unmapped and its generation bumped, and the next `register` of that buffer maps it anew.
//! Ordering: a buffer the program passes to a collective was mapped after every unmap of its
//! addresses' previous memory returned, and each unmap published its range before it
//! happened, so the drain before the registration sees it.
//!
//! Limitation: an overflow invalidates every registration at the next post, including those
//! of collectives still in flight. On UCX 1.13 here that is harmless (the emulated RMA is served
//! by this process by address, not through the registration); on RDMA hardware the release of
//! in-use registrations would have to wait until they are idle, as UCX's own rcache does.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Entries in the ring.
pub const RING: usize = 1024;

struct Entry {
    /// `i + 1` once entry `i` (ring position `i % RING`) is written; read before the range.
    seq: AtomicU64,
    addr: AtomicU64,
    len: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Entry = Entry {
    seq: AtomicU64::new(0),
    addr: AtomicU64::new(0),
    len: AtomicU64::new(0),
};

static ENTRIES: [Entry; RING] = [EMPTY; RING];
/// Entries reserved by producers (monotonic).
static WRITE: AtomicU64 = AtomicU64::new(0);
/// Entries consumed (monotonic; only the consumer stores it).
static READ: AtomicU64 = AtomicU64::new(0);
/// A range was dropped because the ring was full: everything must be invalidated.
static OVERFLOW: AtomicBool = AtomicBool::new(false);
/// Unmap events seen inside the watched span (for the verbose report and tests).
static RECORDED: AtomicU64 = AtomicU64::new(0);
/// The span `[LO, HI)` of every address ever registered; empty while `LO >= HI`.
static LO: AtomicU64 = AtomicU64::new(u64::MAX);
static HI: AtomicU64 = AtomicU64::new(0);

/// Widens the watched span to cover `[addr, addr+len)`. Called before registering it.
pub fn watch(addr: u64, len: u64) {
    LO.fetch_min(addr, Ordering::SeqCst);
    HI.fetch_max(addr.saturating_add(len), Ordering::SeqCst);
}

/// The unmap handler: records `[addr, addr+len)` if it meets the watched span. Lock-free,
/// allocation-free, panic-free.
pub fn record(addr: u64, len: u64) {
    let end = addr.saturating_add(len);
    if len == 0 || end <= LO.load(Ordering::SeqCst) || addr >= HI.load(Ordering::SeqCst) {
        return;
    }
    RECORDED.fetch_add(1, Ordering::Relaxed);
    let mut w = WRITE.load(Ordering::Acquire);
    loop {
        if w.wrapping_sub(READ.load(Ordering::Acquire)) >= RING as u64 {
            OVERFLOW.store(true, Ordering::Release);
            return;
        }
        match WRITE.compare_exchange_weak(w, w + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => break,
            Err(now) => w = now,
        }
    }
    let e = &ENTRIES[(w % RING as u64) as usize];
    e.addr.store(addr, Ordering::Relaxed);
    e.len.store(len, Ordering::Relaxed);
    e.seq.store(w + 1, Ordering::Release);
}

/// Drains the ring: `f(addr, len)` for every published range, or `f(0, u64::MAX)` once if
/// the ring overflowed. An entry reserved but not yet published (its unmap has not happened
/// yet) stops the consumer position there; published entries after it are applied now and
/// again later, which is harmless (an extra invalidation). Single consumer: call under the
/// shim's lock.
pub fn drain(mut f: impl FnMut(u64, u64)) {
    if OVERFLOW.swap(false, Ordering::AcqRel) {
        f(0, u64::MAX);
    }
    let (start, w) = (READ.load(Ordering::Acquire), WRITE.load(Ordering::Acquire));
    // The first entry not yet published, if any: the consumer position stops there.
    let mut stuck: Option<u64> = None;
    for i in start..w {
        let e = &ENTRIES[(i % RING as u64) as usize];
        if e.seq.load(Ordering::Acquire) == i + 1 {
            f(
                e.addr.load(Ordering::Relaxed),
                e.len.load(Ordering::Relaxed),
            );
        } else {
            stuck.get_or_insert(i);
        }
    }
    READ.store(stuck.unwrap_or(w), Ordering::Release);
}

/// Unmap events recorded so far (inside the watched span).
pub fn recorded() -> u64 {
    RECORDED.load(Ordering::Relaxed)
}

/// Installs [`record`] as libucm's `UCM_EVENT_VM_UNMAPPED` handler and checks that events
/// are delivered (`ucm_test_events`). `Err` says why the cache cannot rely on it.
pub fn install() -> Result<ucx_sys::VmUnmappedHook, String> {
    let hook = ucx_sys::VmUnmappedHook::install(record, 0).map_err(|e| e.to_string())?;
    ucx_sys::VmUnmappedHook::delivered().map_err(|e| e.to_string())?;
    Ok(hook)
}

/// Applies every recorded unmap to `reg` (see [`drain`]); returns how many registrations
/// were invalidated.
pub fn apply(reg: &mut alias_mkey::host::UcxRegistrar) -> usize {
    let mut n = 0;
    drain(|addr, len| n += reg.invalidate(addr, len));
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test for the whole ring: it is global state with a single consumer.
    #[test]
    fn ring_records_watched_ranges_and_overflows_to_everything() {
        watch(0x10_000, 0x1000);
        let mut got = Vec::new();
        drain(|a, l| got.push((a, l)));
        got.clear();
        record(0x1000, 0x1000); // below the span
        record(0x20_000, 0x1000); // above
        record(0x10_800, 0x1000); // overlapping
        drain(|a, l| got.push((a, l)));
        assert_eq!(got, vec![(0x10_800, 0x1000)]);
        got.clear();
        for _ in 0..RING + 5 {
            record(0x10_000, 8);
        }
        drain(|a, l| got.push((a, l)));
        assert_eq!(
            got[0],
            (0, u64::MAX),
            "overflow invalidates everything first"
        );
        assert_eq!(got.len(), 1 + RING);
        got.clear();
        drain(|a, l| got.push((a, l)));
        assert!(got.is_empty());
    }
}
