//! Simulator scenarios for the ring Ialltoallv. Each scenario runs a few
//! fixed seeds plus one from `SIM_SEED` (decimal or 0x-hex) or, if unset,
//! from the system clock; every seed is printed, and failures include it.

mod common;

use algorithms::sim::alltoallv::{run, Faults, Layout, SimConfig, SimReport};
use algorithms::sim::rng::{splitmix64, Rng};
use algorithms::Status;
use common::extra_seed;

const FIXED_SEEDS: [u64; 3] = [1, 0xDEAD_BEEF, 0x5EED_2024_0003];

fn seeds() -> Vec<u64> {
    let mut v = FIXED_SEEDS.to_vec();
    v.push(extra_seed());
    v
}

fn run_ok(name: &str, cfg: &SimConfig) -> SimReport {
    common::run_logged(name, cfg.seed, cfg, run, |r| {
        format!(
            "{}, late={}, max_in_flight={}, errors={}",
            common::copy_run_summary(r.end_ns, r.events, r.messages, r.copies),
            r.late_announcements,
            r.max_in_flight,
            r.error_completions
        )
    })
}

/// Runs every seed of [`seeds`] with the default config adjusted by `set`.
fn scenario(name: &str, set: impl Fn(&mut SimConfig)) -> Vec<SimReport> {
    seeds()
        .into_iter()
        .map(|s| {
            let mut c = SimConfig::new(s);
            set(&mut c);
            run_ok(name, &c)
        })
        .collect()
}

/// Sets the cluster shape of `c`: `nodes` nodes of `ranks_per_node` ranks
/// and `sps_per_node` SPs.
fn shape(c: &mut SimConfig, nodes: u32, ranks_per_node: u32, sps_per_node: u32) {
    c.nodes = nodes;
    c.ranks_per_node = ranks_per_node;
    c.sps_per_node = sps_per_node;
}

/// Whether some rank of some collective of `r` completed with `want`.
fn any_status(r: &SimReport, want: Status) -> bool {
    r.ops
        .iter()
        .flat_map(|o| &o.status)
        .any(|s| *s == Some(want))
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
    for r in scenario("256r_8n", |_| {}) {
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
    cfg.layout = if g.chance(1, 2) {
        Layout::Block
    } else {
        Layout::Cyclic
    };
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
        sp_crashes: if g.chance(1, 4) {
            g.range(1, 2) as u32
        } else {
            0
        },
        crash_window_ns: window,
        detect_delay_ns: g.range(0, 10_000),
        rank_deaths: if g.chance(1, 4) {
            g.range(1, 2) as u32
        } else {
            0
        },
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
        assert!(
            errs > 0,
            "seed={base:#018x}: no run exercised an error path"
        );
    }
}

/// Long random search: `SIM_ITERS` (default 20000) small clusters.
#[test]
#[ignore]
fn alltoallv_small_clusters_stress() {
    let n = common::iters(20_000);
    let errs = small_clusters(extra_seed(), n as usize);
    eprintln!("{errs} of {n} runs had error completions");
}

#[test]
fn alltoallv_cyclic_layout_sub_communicator() {
    let reports = scenario("cyclic_subcomm", |c| {
        shape(c, 16, 16, 2);
        c.layout = Layout::Cyclic;
        c.sub_comms = 2;
        c.ops = 3; // sub-communicator 1, sub-communicator 2, world
    });
    for r in reports {
        all_ok(&r);
        let sub = &r.ops[0].world_ranks;
        assert!(sub.len() < 256 || !sub.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(r.ops[2].world_ranks.len(), 256);
        assert_ne!(r.ops[0].key.comm, r.ops[2].key.comm);
    }
}

#[test]
fn alltoallv_32_nodes_8_sps_per_node() {
    for r in scenario("32n_8sp", |c| shape(c, 32, 8, 8)) {
        assert_eq!(r.sps, 256);
        all_ok(&r);
    }
}

#[test]
fn alltoallv_one_sp_per_node_saturates_copy_limiter() {
    for r in scenario("1sp_per_node", |c| {
        c.sps_per_node = 1;
        c.max_inflight_reads = 4;
    }) {
        all_ok(&r);
        assert_eq!(r.max_in_flight, 4, "seed={:#018x}", r.seed);
    }
}

#[test]
fn alltoallv_overlapping_ops_demultiplexed() {
    for r in scenario("overlap_ops", |c| {
        c.ops = 3;
        c.overlap_ops = true;
        c.op_gap_ns = 2_000;
        c.sub_comms = 1; // ops alternate between a sub-communicator and the world
    }) {
        all_ok(&r);
        // The collectives really overlapped in time.
        let first_done = r.ops[0].done_ns.unwrap();
        let second_post = r.ops[1].post_ns.iter().flatten().min().copied().unwrap();
        assert!(second_post < first_done, "seed={:#018x}", r.seed);
    }
}

#[test]
fn alltoallv_back_to_back_ops() {
    for r in scenario("back_to_back", |c| {
        c.ops = 3;
        c.overlap_ops = false;
        shape(c, 16, 16, 2);
    }) {
        all_ok(&r);
        assert_eq!(
            r.ops.iter().map(|o| o.key.seq).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
    }
}

#[test]
fn alltoallv_message_jitter_reorders_messages() {
    for r in scenario("jitter", |c| {
        c.faults.msg_jitter_ns = 10_000;
        c.sps_per_node = 8;
    }) {
        all_ok(&r);
    }
}

#[test]
fn alltoallv_sp_crash_ends_with_errors() {
    let reports = scenario("sp_crash", |c| {
        c.ops = 2;
        c.overlap_ops = false;
        c.faults.sp_crashes = 2;
        c.faults.crash_window_ns = 1_500_000; // op 0 ends near 1ms
        c.faults.detect_delay_ns = 20_000;
    });
    for r in &reports {
        assert_eq!(r.crashed_sps.len(), 2);
        // The simulator already checked that every rank of a live SP
        // completed exactly once and that none completed Ok after its SP
        // learned of the loss.
        let incomplete = r
            .ops
            .iter()
            .flat_map(|o| &o.status)
            .filter(|s| s.is_none())
            .count();
        assert!(
            incomplete > 0 || r.error_completions > 0,
            "seed={:#018x}",
            r.seed
        );
    }
    assert!(reports.iter().any(|r| r.error_completions > 0));
}

#[test]
fn alltoallv_rank_death_aborts_collective() {
    let reports = scenario("rank_death", |c| {
        c.ops = 2;
        c.faults.rank_deaths = 2;
        c.faults.death_window_ns = 300_000;
    });
    for r in &reports {
        assert_eq!(r.dead_ranks.len(), 2);
        assert!(any_status(r, Status::RankFailed));
    }
}

#[test]
fn alltoallv_count_mismatch_does_not_hang() {
    for r in scenario("count_mismatch", |c| {
        c.faults.count_mismatches = 3;
    }) {
        // Exactly the ranks on both sides of a bad block report
        // CountMismatch (checked by the simulator), everyone completes.
        let n = r.ops[0]
            .status
            .iter()
            .filter(|s| **s == Some(Status::CountMismatch))
            .count();
        assert!((1..=6).contains(&n), "seed={:#018x}: {n}", r.seed);
        assert_eq!(r.error_completions as usize, n);
    }
}

#[test]
fn alltoallv_copy_errors_fail_both_sides() {
    for r in scenario("copy_errors", |c| {
        c.faults.copy_error_ppm = 200;
    }) {
        assert!(r.ops[0].status.iter().all(|s| s.is_some()));
        assert!(any_status(&r, Status::AccessError));
    }
}

/// The interesting paths are really taken: announcements arriving before
/// their destination posted, and SPs hitting the copy limit.
#[test]
fn alltoallv_paths_are_exercised() {
    let reports = scenario("paths", |c| {
        c.late_ranks = 8;
        c.max_inflight_reads = 2;
    });
    assert!(reports.iter().any(|r| r.late_announcements > 0));
    assert!(reports.iter().any(|r| r.max_in_flight == 2));
    for r in &reports {
        all_ok(r);
        assert!(r.max_in_flight <= 2);
    }
}

#[test]
fn alltoallv_runs_are_deterministic() {
    let seed = extra_seed();
    eprintln!("deterministic: seed={seed:#018x}");
    let mut c = SimConfig::new(seed);
    c.nodes = 4;
    c.ranks_per_node = 8;
    c.ops = 2;
    c.faults.msg_jitter_ns = 3_000;
    c.faults.sp_crashes = 1;
    c.faults.crash_window_ns = 50_000;
    c.faults.detect_delay_ns = 5_000;
    let a = run(&c).unwrap_or_else(|e| panic!("{e}"));
    let b = run(&c).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a, b, "seed={seed:#018x}");
    c.seed ^= 1;
    let d = run(&c).unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(a.ops, d.ops, "seed={seed:#018x}");
}

#[test]
fn sim_failure_message_contains_seed() {
    let mut c = SimConfig::new(0xABCDEF);
    c.max_events = 100;
    let e = run(&c).expect_err("100 events are not enough");
    let text = e.to_string();
    assert!(text.starts_with("seed=0x0000000000abcdef : "), "{text}");
    assert!(text.contains("no termination"), "{text}");
}

/// 1024 ranks on 32 nodes; slow in debug builds, run with
/// `cargo test --release -- --ignored`.
#[test]
#[ignore]
fn alltoallv_1024_ranks_32_nodes() {
    for r in scenario("1024r_32n", |c| {
        shape(c, 32, 32, 4);
        c.max_block_bytes = 16;
    }) {
        all_ok(&r);
    }
}
