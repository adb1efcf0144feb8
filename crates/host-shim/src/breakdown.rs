//! Where this rank's offloaded calls spent their time (`bootstrap::stamps`): every call that
//! completed through the mailbox adds its stages here, and a program (a benchmark) that knows
//! of the shim reads them through two C functions, found with `dlsym` (a program run natively
//! finds none): [`spoff_breakdown_reset`] and [`spoff_breakdown_read`].

use bootstrap::stamps::{self, Breakdown, SpStamps, STAGES};
use std::sync::Mutex;

static BREAKDOWN: Mutex<Option<Breakdown>> = Mutex::new(None);

/// Adds one call completed through its mailbox slot: the rank sent it at `sent`, the SP's
/// stamps `sp`, the rank saw the token at `noticed`. Returns the `notice` stage (written to
/// seen, 0 if unknown), which the next post tells the SP.
pub fn record(sent: u64, sp: &SpStamps, noticed: u64) -> u64 {
    // A mailbox is only served to a rank on the SP's kernel: one clock.
    let s = stamps::stages(sent, sp, noticed, true);
    let notice = s.and_then(|s| s[stamps::NOTICE]).unwrap_or(0);
    let mut b = BREAKDOWN.lock().unwrap_or_else(|e| e.into_inner());
    b.get_or_insert_with(Breakdown::default).record(s);
    notice
}

/// Forgets what was recorded so far.
#[no_mangle]
pub extern "C" fn spoff_breakdown_reset() {
    *BREAKDOWN.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

/// Writes, for each of the `n` first stages (`post`, `accept`, `issue`, `copy`, `complete`,
/// `notice`, `total`; at most 7), its median and 99th percentile in ns into `p50_ns[i]` and
/// `p99_ns[i]`, and its count into `calls[i]`; returns the calls whose stamps were missing or
/// out of order.
///
/// # Safety
/// `p50_ns`, `p99_ns` and `calls` point to `n` writable `u64`s each.
#[no_mangle]
pub unsafe extern "C" fn spoff_breakdown_read(
    p50_ns: *mut u64,
    p99_ns: *mut u64,
    calls: *mut u64,
    n: usize,
) -> u64 {
    let b = BREAKDOWN.lock().unwrap_or_else(|e| e.into_inner());
    let b = b.clone().unwrap_or_default();
    for (i, h) in b.stages.iter().enumerate().take(n.min(STAGES.len())) {
        // SAFETY: i < n, and the caller gave n elements each.
        unsafe {
            *p50_ns.add(i) = h.percentile(50.0);
            *p99_ns.add(i) = h.percentile(99.0);
            *calls.add(i) = h.count();
        }
    }
    b.disordered
}
