//! Simulator scenarios for the staged Iallgather (flat, hierarchical and
//! mixed). Each scenario runs fixed seeds plus some from `SIM_SEED` (or the
//! clock); every seed is printed and failures include it (`SimFailure`
//! starts with it).

mod common;

use std::time::Instant;

use algorithms::sim::staged_allgather::{run, Faults, SimConfig, SimReport};
use algorithms::sim::Layout;
use algorithms::staged_allgather::Design;

use common::{consecutive, extra_seed, fault_scenario, iters, seeds, spread};

fn run_ok(name: &str, cfg: &SimConfig) -> SimReport {
    common::run_ok(name, cfg, run)
}

/// A fault-free run: everyone Ok, the expected bytes across nodes, staging
/// within its bound, and no message ever reached a finished instance (the
/// engine drops those).
fn clean(name: &str, cfg: &SimConfig, r: &SimReport) {
    let s = r.seed;
    assert_eq!(r.error_completions, 0, "{name}: seed={s:#018x} {cfg:?}");
    assert_eq!(
        r.bytes_inter_node, r.expected_inter_node_bytes,
        "{name}: seed={s:#018x}"
    );
    assert!(
        r.stats.max_slots_in_use <= cfg.staging_slots.max(1),
        "{name}: seed={s:#018x}"
    );
    assert_eq!(r.after_finish_dropped, 0, "{name}: seed={s:#018x} {cfg:?}");
}

/// A small random cluster shape from `i`.
fn small(seed: u64, i: u64) -> SimConfig {
    let mut cfg = SimConfig::new(seed);
    cfg.nodes = 1 + (i % 4) as u32;
    cfg.ranks_per_node = 1 + (i / 4 % 6) as u32;
    cfg.sps_per_node = 1 + (i / 3 % 8) as u32;
    cfg.layout = if i & 1 == 0 {
        Layout::Block
    } else {
        Layout::Cyclic
    };
    cfg.design = if (i >> 1) & 1 == 0 {
        Design::Flat
    } else {
        Design::Hier
    };
    cfg.mixed_designs = i.is_multiple_of(5);
    cfg.chunk_bytes = 1 + (i / 5 % 9);
    cfg.staging_slots = 1 + (i / 7 % 4) as u32;
    cfg.max_len_bytes = 30;
    cfg.max_inflight_reads = 1 + (i % 3) as usize;
    cfg.late_ranks = (i % 3) as u32;
    cfg.ops = 2;
    cfg.faults.msg_jitter_ns = 3_000;
    cfg
}

#[test]
fn staged_allgather_small_clusters_many_seeds() {
    let name = "staged_allgather_small_clusters_many_seeds";
    let base = extra_seed();
    eprintln!("{name}: seeds 0..300 and {base:#018x}+i");
    for i in 0..300u64 {
        let seed = if i % 2 == 0 { i } else { consecutive(base, i) };
        let cfg = small(seed, i);
        let r = run_ok(name, &cfg);
        clean(name, &cfg, &r);
    }
}

/// Block lengths 0, 1, one chunk, a multiple and a non-multiple of the
/// chunk, larger and smaller than it; flat, hierarchical and mixed; both
/// layouts.
#[test]
fn staged_allgather_block_sizes_and_designs() {
    let name = "staged_allgather_block_sizes_and_designs";
    for seed in seeds() {
        eprintln!("{name}: seed={seed:#018x}");
        for (design, mixed) in [
            (Design::Flat, false),
            (Design::Hier, false),
            (Design::Flat, true),
        ] {
            for layout in [Layout::Block, Layout::Cyclic] {
                let mut cfg = SimConfig::new(seed);
                cfg.nodes = 3;
                cfg.ranks_per_node = 4;
                cfg.sps_per_node = 2;
                cfg.layout = layout;
                cfg.design = design;
                cfg.mixed_designs = mixed;
                cfg.chunk_bytes = 8;
                cfg.staging_slots = 2;
                cfg.ops = 1;
                for len in [0, 1, 7, 8, 24, 29] {
                    cfg.len_bytes = Some(len);
                    let r = run_ok(name, &cfg);
                    clean(name, &cfg, &r);
                }
            }
        }
    }
}

/// Late ranks on 1 to 8 SPs per node: keys arrive late, chunks wait in
/// full slots (reads stop) and everything resumes when the late ranks post.
#[test]
fn staged_allgather_late_ranks_1_to_8_sps_per_node() {
    let name = "staged_allgather_late_ranks_1_to_8_sps_per_node";
    for seed in seeds() {
        for sps in 1..=8 {
            for design in [Design::Flat, Design::Hier] {
                let mut cfg = SimConfig::new(seed);
                cfg.nodes = 3;
                cfg.ranks_per_node = 8;
                cfg.sps_per_node = sps;
                cfg.design = design;
                cfg.layout = if sps % 2 == 0 {
                    Layout::Cyclic
                } else {
                    Layout::Block
                };
                cfg.len_bytes = Some(37);
                cfg.chunk_bytes = 16;
                cfg.staging_slots = 2;
                cfg.arrival_skew_ns = 100_000;
                cfg.late_ranks = 3;
                cfg.late_delay_ns = 500_000;
                let r = run_ok(name, &cfg);
                clean(name, &cfg, &r);
                assert!(
                    r.stats.writes_waited_for_key > 0,
                    "{name}: seed={seed:#018x} sps={sps} {:?}",
                    r.stats
                );
            }
        }
    }
}

fn faulty(seed: u64, i: u64, f: Faults) -> SimConfig {
    let mut cfg = small(seed, i);
    cfg.nodes = 2 + (i % 3) as u32;
    cfg.ranks_per_node = 2 + (i / 3 % 4) as u32;
    cfg.max_len_bytes = 40;
    cfg.faults = Faults {
        msg_jitter_ns: 2_000,
        ..f
    };
    cfg
}

/// Runs `n` seeds (`seed_of(base, i)`) of [`faulty`] configs with
/// `faults(i)`; returns the base seed and the error completions.
fn faulty_runs(
    name: &str,
    n: u64,
    seed_of: fn(u64, u64) -> u64,
    faults: impl Fn(u64) -> Faults,
) -> (u64, u64) {
    fault_scenario(name, n, seed_of, |seed, i| {
        run_ok(name, &faulty(seed, i, faults(i))).error_completions
    })
}

/// SP crashes (one, or two plus two rank deaths) at random times: every
/// rank of a live SP completes, Ok ones with every block, none Ok after its
/// SP learned of the fault, nothing written after completion; no hang.
#[test]
fn staged_allgather_sp_crash_random_seeds() {
    let name = "staged_allgather_sp_crash_random_seeds";
    let (base, errors) = faulty_runs(name, 120, spread, |i| {
        let (deaths, crashes) = if i % 2 == 0 { (0, 1) } else { (2, 2) };
        Faults {
            sp_crashes: crashes,
            crash_window_ns: 40_000,
            detect_delay_ns: 4_000,
            rank_deaths: deaths,
            death_window_ns: 40_000,
            ..Faults::default()
        }
    });
    assert!(
        errors > 0,
        "{name}: no run was disturbed (base {base:#018x})"
    );
}

#[test]
fn staged_allgather_rank_death_random_seeds() {
    let name = "staged_allgather_rank_death_random_seeds";
    let (base, errors) = faulty_runs(name, 100, spread, |i| Faults {
        rank_deaths: 1 + (i % 2) as u32,
        death_window_ns: 30_000,
        ..Faults::default()
    });
    assert!(
        errors > 0,
        "{name}: no run was disturbed (base {base:#018x})"
    );
}

#[test]
fn staged_allgather_copy_errors() {
    let name = "staged_allgather_copy_errors";
    let (base, errors) = faulty_runs(name, 100, consecutive, |_| Faults {
        copy_error_ppm: 20_000,
        ..Faults::default()
    });
    assert!(errors > 0, "{name}: no copy failed (base {base:#018x})");
}

/// A rank posts another block length, or another comm: no hang, nobody
/// completes Ok (every Ok rank needs every rank's consistent post).
#[test]
fn staged_allgather_inconsistent_posts_abort() {
    let name = "staged_allgather_inconsistent_posts_abort";
    let (base, errors) = faulty_runs(name, 150, consecutive, |i| {
        let k = 1 + (i % 2) as u32;
        Faults {
            inconsistent_len: if i % 3 == 0 { 0 } else { k },
            inconsistent_comm: if i % 3 == 1 { 0 } else { k },
            ..Faults::default()
        }
    });
    assert!(errors > 0, "{name}: base {base:#018x}");
}

fn big(seed: u64, design: Design, sps: u32, len: u64, chunk: u64) -> SimConfig {
    let mut cfg = SimConfig::new(seed);
    cfg.nodes = 32;
    cfg.ranks_per_node = 32;
    cfg.sps_per_node = sps;
    cfg.design = design;
    cfg.ops = 1;
    cfg.len_bytes = Some(len);
    cfg.chunk_bytes = chunk;
    cfg.staging_slots = 4;
    cfg.max_inflight_reads = 8;
    cfg
}

/// 1024 ranks (32 nodes x 32 ranks), 4 SPs per node, random skew and late
/// ranks, per design; 40-byte blocks in one 64-byte chunk each (a million
/// flat writes; multi-chunk blocks are covered by the smaller scenarios),
/// byte-exact in every receive buffer.
#[test]
fn staged_allgather_1024_ranks_32_nodes() {
    let name = "staged_allgather_1024_ranks_32_nodes";
    let seed = seeds()[0];
    for design in [Design::Flat, Design::Hier] {
        let t0 = Instant::now();
        let mut cfg = big(seed, design, 4, 40, 64);
        cfg.late_ranks = 8;
        let r = run_ok(name, &cfg);
        clean(name, &cfg, &r);
        eprintln!(
            "{name}: {design:?} seed={seed:#018x} in {:?}: done at {}ns (SPs {}ns), {} events, {} messages, {} reads, {} writes, {:?}",
            t0.elapsed(),
            r.end_ns,
            r.sp_end_ns,
            r.events,
            r.messages,
            r.reads,
            r.writes,
            r.stats
        );
    }
}

/// Long random search: `SIM_ITERS` (default 20000) seeds from `SIM_SEED`
/// (or the clock) on, random shapes, designs, sizes, and every fault kind.
/// `cargo test --release -p algorithms --test sim_staged_allgather -- --ignored staged_allgather_stress`.
#[test]
#[ignore]
fn staged_allgather_stress() {
    let n = iters(20_000);
    let base = extra_seed();
    eprintln!("staged_allgather_stress: base seed={base:#018x}, {n} seeds");
    for i in 0..n {
        let seed = spread(base, i);
        let mut cfg = small(seed, i.wrapping_mul(7919) ^ (seed >> 7));
        if i.is_multiple_of(4) {
            // Larger clusters now and then.
            cfg.nodes = 2 + (seed >> 11) as u32 % 5;
            cfg.ranks_per_node = 4 + (seed >> 17) as u32 % 7;
            cfg.max_len_bytes = 70;
        }
        let k = seed % 8;
        cfg.faults = Faults {
            msg_jitter_ns: 3_000,
            sp_crashes: (k == 1 || k == 5) as u32 + (k == 5) as u32,
            crash_window_ns: 40_000,
            detect_delay_ns: 4_000,
            rank_deaths: (k == 2 || k == 5) as u32,
            death_window_ns: 40_000,
            copy_error_ppm: if k == 3 { 20_000 } else { 0 },
            inconsistent_len: (k == 4) as u32 * (1 + (seed >> 3) % 2) as u32,
            inconsistent_comm: (k == 6) as u32 * (1 + (seed >> 3) % 2) as u32,
        };
        match run(&cfg) {
            Ok(r)
                if cfg.faults
                    == (Faults {
                        msg_jitter_ns: 3_000,
                        ..Faults::default()
                    }) =>
            {
                clean("staged_allgather_stress", &cfg, &r)
            }
            Ok(_) => {}
            Err(e) => panic!("staged_allgather_stress: {e}\n  config: {cfg:?}"),
        }
    }
}

/// Completion time at 32 nodes x 32 ranks, flat vs hierarchical, 1 to 8
/// SPs per node; everyone posts at 0, 4 staging slots, 8 copies in flight
/// per SP. Prints a table.
/// `cargo test --release -p algorithms --test sim_staged_allgather -- --ignored --nocapture staged_allgather_32x32_figures`.
#[test]
#[ignore]
fn staged_allgather_32x32_figures() {
    let name = "staged_allgather_32x32_figures";
    println!("| block | chunk | SPs/node | flat: done (us) | hier: SPs done (us) | hier: + host copy (us) | hier/flat | flat writes | hier writes |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (len, chunk) in [(64u64 << 10, 64u64 << 10), (1 << 20, 256 << 10)] {
        for sps in [1, 2, 4, 8] {
            let mut t = Vec::new();
            for design in [Design::Flat, Design::Hier] {
                let t0 = Instant::now();
                let mut cfg = big(1, design, sps, len, chunk);
                cfg.arrival_skew_ns = 0;
                cfg.late_ranks = 0;
                let r = run_ok(name, &cfg);
                clean(name, &cfg, &r);
                eprintln!(
                    "{name}: {len} {sps} {design:?}: {:?}, busiest link {}us, {} messages",
                    t0.elapsed(),
                    r.max_link_busy_ns / 1000,
                    r.messages
                );
                t.push(r);
            }
            println!(
                "| {len} | {chunk} | {sps} | {:.1} | {:.1} | {:.1} | {:.3} | {} | {} |",
                t[0].end_ns as f64 / 1e3,
                t[1].sp_end_ns as f64 / 1e3,
                t[1].end_ns as f64 / 1e3,
                t[1].end_ns as f64 / t[0].end_ns as f64,
                t[0].writes,
                t[1].writes
            );
        }
    }
}
