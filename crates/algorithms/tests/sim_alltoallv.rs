//! Simulator scenarios for the ring Ialltoallv. Each scenario runs a few
//! fixed seeds plus one from `SIM_SEED` (decimal or 0x-hex) or, if unset,
//! from the system clock; every seed is printed, and failures include it.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use algorithms::sim::alltoallv::{run, Faults, Layout, SimConfig, SimReport};
use algorithms::sim::rng::{splitmix64, Rng};
use algorithms::Status;

const FIXED_SEEDS: [u64; 3] = [1, 0xDEAD_BEEF, 0x5EED_2024_0003];

fn extra_seed() -> u64 {
    match std::env::var("SIM_SEED") {
        Ok(s) => {
            let s = s.trim();
            let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => s.parse(),
            };
            parsed.unwrap_or_else(|e| panic!("SIM_SEED={s:?} is not a number: {e}"))
        }
        Err(_) => {
            let t = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
            t.as_nanos() as u64
        }
    }
}

fn seeds() -> Vec<u64> {
    let mut v = FIXED_SEEDS.to_vec();
    v.push(extra_seed());
    v
}

fn run_ok(name: &str, cfg: &SimConfig) -> SimReport {
    eprintln!("{name}: seed={:#018x}", cfg.seed);
    let t0 = Instant::now();
    match run(cfg) {
        Ok(r) => {
            eprintln!(
                "{name}: seed={:#018x} ok in {:?}: virtual {}ns, {} events, {} msgs, {} copies, late={}, max_in_flight={}, errors={}",
                cfg.seed,
                t0.elapsed(),
                r.end_ns,
                r.events,
                r.messages,
                r.copies,
                r.late_announcements,
                r.max_in_flight,
                r.error_completions
            );
            r
        }
        Err(e) => panic!("{name}: {e}"),
    }
}

fn scenario(name: &str, make: impl Fn(u64) -> SimConfig) -> Vec<SimReport> {
    seeds().into_iter().map(|s| run_ok(name, &make(s))).collect()
}

fn all_ok(r: &SimReport) {
    for op in &r.ops {
        for (rank, st) in op.status.iter().enumerate() {
            assert_eq!(
                *st,
                Some(Status::Ok),
                "seed={:#018x}: op {:?} rank {rank}",
                r.seed,
                op.key
            );
        }
    }
}

#[test]
fn alltoallv_256_ranks_8_nodes_random_skew() {
    for r in scenario("256r_8n", SimConfig::new) {
        assert_eq!(r.world_size, 256);
        all_ok(&r);
        assert!(r.bytes_copied_inter_node > 0 && r.bytes_copied_intra_node > 0);
    }
}

/// A random small cluster with every kind of fault switched on at random.
fn small_random_config(seed: u64) -> SimConfig {
    let mut g = Rng::new(seed);
    let mut cfg = SimConfig::new(seed);
    cfg.nodes = g.range(1, 4) as u32;
    cfg.ranks_per_node = g.range(1, 5) as u32;
    cfg.sps_per_node = g.range(1, 3) as u32;
    cfg.layout = if g.chance(1, 2) { Layout::Block } else { Layout::Cyclic };
    cfg.max_inflight_reads = g.range(0, 3) as usize;
    cfg.max_block_bytes = g.range(0, 16);
    cfg.zero_block_percent = g.range(0, 60) as u32;
    cfg.ops = g.range(1, 4) as u32;
    cfg.overlap_ops = g.chance(1, 2);
    cfg.op_gap_ns = g.range(0, 5_000);
    cfg.sub_comms = g.range(0, 2) as u32;
    cfg.arrival_skew_ns = g.range(0, 30_000);
    cfg.late_ranks = g.range(0, 2) as u32;
    cfg.late_delay_ns = g.range(0, 50_000);
    let window = 40_000;
    cfg.faults = Faults {
        msg_jitter_ns: if g.chance(1, 2) { g.range(0, 5_000) } else { 0 },
        sp_crashes: if g.chance(1, 4) { 1 } else { 0 },
        crash_window_ns: window,
        detect_delay_ns: g.range(0, 10_000),
        rank_deaths: if g.chance(1, 4) { g.range(1, 2) as u32 } else { 0 },
        death_window_ns: window,
        count_mismatches: if g.chance(1, 4) { 1 } else { 0 },
        copy_error_ppm: if g.chance(1, 5) { 50_000 } else { 0 },
    };
    cfg
}

/// Run `n` small random clusters derived from `base`; returns how many runs
/// had error completions.
fn small_clusters(base: u64, n: usize) -> usize {
    eprintln!("small_clusters: base seed={base:#018x} runs={n}");
    let mut x = base;
    let mut with_errors = 0;
    for _ in 0..n {
        x = splitmix64(x);
        let cfg = small_random_config(x);
        let r = match run(&cfg) {
            Ok(r) => r,
            Err(e) => panic!("small_clusters (base {base:#018x}): {e}\nconfig: {cfg:?}"),
        };
        let f = &cfg.faults;
        if f.sp_crashes + f.rank_deaths + f.count_mismatches == 0 && f.copy_error_ppm == 0 {
            all_ok(&r);
        }
        with_errors += (r.error_completions > 0) as usize;
    }
    with_errors
}

/// Many small clusters with every kind of fault, to search the state space
/// widely: 64 runs derived from each seed.
#[test]
fn alltoallv_small_clusters_all_faults_many_seeds() {
    for base in seeds() {
        let errs = small_clusters(base, 64);
        assert!(errs > 0, "seed={base:#018x}: no run exercised an error path");
    }
}

/// Long random search: `SIM_ITERS` (default 20000) small clusters.
#[test]
#[ignore]
fn alltoallv_small_clusters_stress() {
    let n = std::env::var("SIM_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let errs = small_clusters(extra_seed(), n);
    eprintln!("{errs} of {n} runs had error completions");
}
