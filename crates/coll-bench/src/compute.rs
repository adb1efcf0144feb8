//! The compute kernel that stands for application work during a nonblocking collective: a
//! dependent chain of floating-point arithmetic (no memory traffic, no MPI calls, no sleeping),
//! calibrated to take a target duration of the calling thread's CPU time.
//!
//! CPU time, not wall-clock time: where ranks share a core (the benchmarks reserve the other
//! cores for the SPs), a wall-clock calibration measures whatever share of the core the rank
//! had while calibrating, so separate runs (native, then offloaded) would compute different
//! amounts of work. On a core of its own, CPU time and wall-clock time agree.

use std::hint::black_box;
use std::time::Duration;

/// Runs `n` steps of real arithmetic; returns a value that depends on all of them.
#[inline(never)]
pub fn busy(n: u64) -> f64 {
    let n = black_box(n);
    let (mut x, mut y) = (black_box(1.000_000_1f64), black_box(0.5f64));
    for _ in 0..n {
        x = x * 1.000_000_01 + 1e-9;
        y = y * 0.999_999_9 + x * 1e-7;
    }
    black_box(x + y)
}

/// Runs `busy(n)` and returns the CPU time it took.
pub fn timed(n: u64) -> Duration {
    let t0 = thread_cpu_time();
    black_box(busy(n));
    thread_cpu_time().saturating_sub(t0)
}

/// The calling thread's CPU time.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and out-pointer; this clock exists on every Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Finds a step count for which `busy` runs for about `target` seconds: start from a measured
/// rate and refine a few times on the real target (the best of a few runs per guess, so a
/// preemption does not skew it). Returns 0 for a target of 0.
pub fn calibrate(target: f64) -> u64 {
    if target <= 0.0 {
        return 0;
    }
    // Rate from a run of ~1 ms (grow the count until it is long enough to measure).
    let mut n = 1_000u64;
    let mut t = timed(n).as_secs_f64();
    while t < 1e-3 && n < u64::MAX / 4 {
        n *= 2;
        t = timed(n).as_secs_f64();
    }
    let rate = n as f64 / t.max(1e-9);
    let mut steps = ((rate * target) as u64).max(1);
    for _ in 0..4 {
        let best = (0..3)
            .map(|_| timed(steps).as_secs_f64())
            .fold(f64::INFINITY, f64::min);
        let ratio = target / best.max(1e-9);
        if (0.97..=1.03).contains(&ratio) {
            break;
        }
        steps = ((steps as f64 * ratio) as u64).max(1);
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_calibration_clock_counts_cpu_time_not_sleep() {
        // A sleeping thread uses no CPU: a wall clock would count the 50 ms, this one must not.
        let t0 = thread_cpu_time();
        std::thread::sleep(Duration::from_millis(50));
        let slept = thread_cpu_time().saturating_sub(t0);
        assert!(
            slept < Duration::from_millis(10),
            "{slept:?} counted while asleep"
        );
        // And it does count work.
        let mut n = 1_000u64;
        while timed(n) < Duration::from_millis(1) {
            n *= 2;
            assert!(n < 1 << 40, "busy({n}) took no CPU time");
        }
    }
}
