//! Helpers shared by the simulator scenario tests: seed selection (fixed
//! seeds plus one from `SIM_SEED` or the clock), seed printing, and the
//! loop of the random fault scenarios.

#![allow(dead_code)]

use std::fmt::Debug;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use algorithms::sim::SimFailure;

pub mod staged;

pub const FIXED_SEEDS: [u64; 2] = [1, 0xDEAD_BEEF];

/// Spreads consecutive indices over the seed space.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// `SIM_SEED` (decimal or `0x` hex), else the clock.
pub fn extra_seed() -> u64 {
    match std::env::var("SIM_SEED") {
        Ok(s) => {
            let s = s.trim();
            match s.strip_prefix("0x") {
                Some(h) => u64::from_str_radix(h, 16).expect("SIM_SEED"),
                None => s.parse().expect("SIM_SEED"),
            }
        }
        Err(_) => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    }
}

/// [`FIXED_SEEDS`] plus [`extra_seed`].
pub fn seeds() -> Vec<u64> {
    let mut v = FIXED_SEEDS.to_vec();
    v.push(extra_seed());
    v
}

/// [`extra_seed`], printed as `{name}: base seed=...`.
pub fn base_seed(name: &str) -> u64 {
    let base = extra_seed();
    eprintln!("{name}: base seed={base:#018x}");
    base
}

/// The `i`th seed of a scenario, spread over the seed space.
pub fn spread(base: u64, i: u64) -> u64 {
    base.wrapping_add(i.wrapping_mul(GOLDEN))
}

/// The `i`th seed of a scenario, consecutive from `base`.
pub fn consecutive(base: u64, i: u64) -> u64 {
    base.wrapping_add(i)
}

/// Runs `cfg` through `run`; a failure panics with the scenario name, the
/// failure (which starts with the seed), the config and the elapsed time.
pub fn run_ok<C: Debug, R>(
    name: &str,
    cfg: &C,
    run: impl FnOnce(&C) -> Result<R, SimFailure>,
) -> R {
    let t0 = Instant::now();
    match run(cfg) {
        Ok(r) => r,
        Err(e) => panic!(
            "{name}: {e}\n  config: {cfg:?}\n  (elapsed {:?})",
            t0.elapsed()
        ),
    }
}

/// Runs `cfg` (seed `seed`) through `run`, printing the seed first and,
/// on success, the time taken and `describe(report)`; a failure panics
/// with the scenario name and the failure (which starts with the seed).
pub fn run_logged<C, R>(
    name: &str,
    seed: u64,
    cfg: &C,
    run: impl FnOnce(&C) -> Result<R, SimFailure>,
    describe: impl FnOnce(&R) -> String,
) -> R {
    eprintln!("{name}: seed={seed:#018x}");
    let t0 = Instant::now();
    match run(cfg) {
        Ok(r) => {
            eprintln!(
                "{name}: seed={seed:#018x} ok in {:?}: {}",
                t0.elapsed(),
                describe(&r)
            );
            r
        }
        Err(e) => panic!("{name}: {e}"),
    }
}

/// How a run of the copy-based simulators (allgatherv, alltoallv) starts its
/// log line: `virtual {end_ns}ns, {events} events, {messages} msgs, {copies}
/// copies`.
pub fn copy_run_summary(end_ns: u64, events: u64, messages: u64, copies: u64) -> String {
    format!("virtual {end_ns}ns, {events} events, {messages} msgs, {copies} copies")
}

/// A random fault scenario: prints its base seed, runs `one(seed_of(base,
/// i), i)` for `i` in `0..n` (each returns its error completions) and
/// returns the base seed and the sum of the error completions.
pub fn fault_scenario(
    name: &str,
    n: u64,
    seed_of: fn(u64, u64) -> u64,
    mut one: impl FnMut(u64, u64) -> u64,
) -> (u64, u64) {
    let base = base_seed(name);
    let mut errors = 0;
    for i in 0..n {
        errors += one(seed_of(base, i), i);
    }
    (base, errors)
}

/// `SIM_ITERS`, else `default`.
pub fn iters(default: u64) -> u64 {
    std::env::var("SIM_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}
