//! Simulator scenarios for the staged Iallgather (flat, hierarchical and
//! mixed). Each scenario runs fixed seeds plus some from `SIM_SEED` (or the
//! clock); every seed is printed and failures include it (`SimFailure`
//! starts with it).

mod common;

use algorithms::sim::staged_allgather::{run, Faults, SimConfig, SimReport};
use algorithms::sim::Layout;
use algorithms::staged_allgather::Design;

use common::{consecutive, seeds};

common::staged::staged_scenarios! {
    small_clusters: staged_allgather_small_clusters_many_seeds,
    sp_crash: staged_allgather_sp_crash_random_seeds,
    rank_death: staged_allgather_rank_death_random_seeds,
    copy_errors: staged_allgather_copy_errors,
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

fn small_extra(cfg: &mut SimConfig, i: u64) {
    cfg.mixed_designs = i.is_multiple_of(5);
    cfg.max_len_bytes = 30;
}

fn faulty_extra(cfg: &mut SimConfig) {
    cfg.max_len_bytes = 40;
}

fn big_extra(cfg: &mut SimConfig) {
    cfg.max_inflight_reads = 8;
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
                let mut cfg = grid(seed, design, layout);
                cfg.mixed_designs = mixed;
                cfg.chunk_bytes = 8;
                cfg.staging_slots = 2;
                for len in [0, 1, 7, 8, 24, 29] {
                    cfg.len_bytes = Some(len);
                    run_clean(name, &cfg);
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
    let set = |cfg: &mut SimConfig| {
        cfg.len_bytes = Some(37);
        cfg.chunk_bytes = 16;
        cfg.staging_slots = 2;
    };
    late_scenario(name, 3, 3, 100_000, set, |seed, sps, _, r| {
        assert!(
            r.stats.writes_waited_for_key > 0,
            "{name}: seed={seed:#018x} sps={sps} {:?}",
            r.stats
        );
    });
}

/// A rank posts another block length, or another comm: no hang, nobody
/// completes Ok (every Ok rank needs every rank's consistent post).
#[test]
fn staged_allgather_inconsistent_posts_abort() {
    let name = "staged_allgather_inconsistent_posts_abort";
    let inconsistent = |i| {
        let k = 1 + (i % 2) as u32;
        Faults {
            inconsistent_len: if i % 3 == 0 { 0 } else { k },
            inconsistent_comm: if i % 3 == 1 { 0 } else { k },
            ..Faults::default()
        }
    };
    faulty_disturbed(name, 150, consecutive, inconsistent, "no run aborted");
}

/// 1024 ranks (32 nodes x 32 ranks), 4 SPs per node, random skew and late
/// ranks, per design; 40-byte blocks in one 64-byte chunk each (a million
/// flat writes; multi-chunk blocks are covered by the smaller scenarios),
/// byte-exact in every receive buffer.
#[test]
fn staged_allgather_1024_ranks_32_nodes() {
    big_scenario(
        "staged_allgather_1024_ranks_32_nodes",
        40,
        64,
        |_| {},
        |r| {
            format!(
                "{} messages, {} reads, {} writes",
                r.messages, r.reads, r.writes
            )
        },
    );
}

/// Long random search: `SIM_ITERS` (default 20000) seeds from `SIM_SEED`
/// (or the clock) on, random shapes, designs, sizes, and every fault kind.
/// `cargo test --release -p algorithms --test sim_staged_allgather -- --ignored staged_allgather_stress`.
#[test]
#[ignore]
fn staged_allgather_stress() {
    let set = |i: u64, seed: u64, cfg: &mut SimConfig| {
        if i.is_multiple_of(4) {
            // Larger clusters now and then.
            cfg.nodes = 2 + (seed >> 11) as u32 % 5;
            cfg.ranks_per_node = 4 + (seed >> 17) as u32 % 7;
            cfg.max_len_bytes = 70;
        }
        let k = seed % 8;
        cfg.faults = Faults {
            inconsistent_len: (k == 4) as u32 * (1 + (seed >> 3) % 2) as u32,
            inconsistent_comm: (k == 6) as u32 * (1 + (seed >> 3) % 2) as u32,
            ..stress_faults(k)
        };
    };
    let jitter_only = Faults {
        msg_jitter_ns: 3_000,
        ..Faults::default()
    };
    stress("staged_allgather_stress", set, |cfg, r| {
        if cfg.faults == jitter_only {
            clean("staged_allgather_stress", cfg, r)
        }
    });
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
    figures(
        name,
        [(64 << 10, 64 << 10), (1 << 20, 256 << 10)],
        |len, sps, design, elapsed, r| {
            eprintln!(
                "{name}: {len} {sps} {design:?}: {elapsed:?}, busiest link {}us, {} messages",
                r.max_link_busy_ns / 1000,
                r.messages
            );
        },
        |len, chunk, sps, t| {
            println!(
                "| {len} | {chunk} | {sps} | {:.1} | {:.1} | {:.1} | {:.3} | {} | {} |",
                t[0].end_ns as f64 / 1e3,
                t[1].sp_end_ns as f64 / 1e3,
                t[1].end_ns as f64 / 1e3,
                t[1].end_ns as f64 / t[0].end_ns as f64,
                t[0].writes,
                t[1].writes
            );
        },
    );
}
