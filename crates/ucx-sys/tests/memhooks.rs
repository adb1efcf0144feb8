//! libucm's unmap events reach a handler installed with `VmUnmappedHook` (real munmap in this
//! process, real libucm hooks).

use std::sync::atomic::{AtomicU64, Ordering};
use ucx_sys::VmUnmappedHook;

/// The range being watched, and how many events overlapped it.
static WATCH_ADDR: AtomicU64 = AtomicU64::new(0);
static WATCH_LEN: AtomicU64 = AtomicU64::new(0);
static SEEN: AtomicU64 = AtomicU64::new(0);

fn handler(addr: u64, len: u64) {
    // No allocation, no locks: only atomics.
    let (a, l) = (
        WATCH_ADDR.load(Ordering::Acquire),
        WATCH_LEN.load(Ordering::Acquire),
    );
    if l != 0 && addr < a + l && a < addr.saturating_add(len) {
        SEEN.fetch_add(1, Ordering::AcqRel);
    }
}

fn map(len: usize) -> *mut libc::c_void {
    // SAFETY: a fresh anonymous mapping.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p
}

#[test]
fn munmap_is_reported_before_and_not_after_uninstall() {
    let hook = VmUnmappedHook::install(handler, 0).expect("install the VM_UNMAPPED handler");
    VmUnmappedHook::delivered().expect("ucm_test_events: unmap events are delivered");

    let len = 1 << 20;
    let p = map(len);
    WATCH_ADDR.store(p as u64, Ordering::Release);
    WATCH_LEN.store(len as u64, Ordering::Release);
    // SAFETY: our own mapping, unused by anything else.
    assert_eq!(unsafe { libc::munmap(p, len) }, 0);
    assert!(SEEN.load(Ordering::Acquire) >= 1, "munmap was not reported");

    drop(hook);
    let before = SEEN.load(Ordering::Acquire);
    let q = map(len);
    WATCH_ADDR.store(q as u64, Ordering::Release);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::munmap(q, len) }, 0);
    assert_eq!(
        SEEN.load(Ordering::Acquire),
        before,
        "reported after uninstall"
    );
}
