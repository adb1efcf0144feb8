use super::*;
use crate::mcast_allgather::{set_mutation, Mutation};
use crate::sim::NetFaults;

/// 200-byte blocks (4 chunks of 64) over 3 subgroups, with datagrams lost
/// at `loss_ppm`.
fn cfg(seed: u64, loss_ppm: u32) -> SimConfig {
    let mut c = SimConfig::new(seed);
    c.len_bytes = Some(200);
    c.faults.net.loss_ppm = loss_ppm;
    c
}

/// Runs `c`; a failure panics with its seed. The report is shown.
fn ok(c: &SimConfig) -> SimReport {
    match run(c) {
        Ok(r) => {
            eprintln!("{r:?}");
            r
        }
        Err(e) => panic!("{e}\nconfig: {c:?}"),
    }
}

/// Every rank completed `Ok` and every run ended within `bound_ns`.
fn all_ok(r: &SimReport, bound_ns: Nanos) {
    assert_eq!(r.error_completions, 0, "seed {}: {r:?}", r.seed);
    assert!(
        r.end_ns <= bound_ns,
        "seed {}: ended at {}ns",
        r.seed,
        r.end_ns
    );
}

#[test]
fn without_loss_every_byte_arrives_by_multicast_alone() {
    for seed in 1..=8 {
        let mut c = cfg(seed, 0);
        c.len_bytes = None;
        let r = ok(&c);
        all_ok(&r, 2_000_000);
        assert_eq!(r.stats.fetch_requests, 0, "seed {seed}");
        assert_eq!(r.fabric.lost + r.fabric.rnr_drops, 0);
        assert_eq!(r.unregistered_drops, 0, "seed {seed}: RNR barrier");
    }
}

#[test]
fn losses_of_0_1_to_10_percent_are_recovered_through_the_fetch_ring() {
    for ppm in [1_000, 10_000, 100_000] {
        for seed in 1..=6 {
            let mut c = cfg(seed, ppm);
            c.faults.net.dup_ppm = 20_000;
            c.faults.net.reorder_ns = 3_000;
            c.faults.msg_jitter_ns = 2_000;
            let r = ok(&c);
            all_ok(&r, 3_000_000);
            if r.fabric.lost > 0 {
                assert!(r.stats.fetch_requests > 0, "seed {seed}: {r:?}");
            }
        }
    }
    // Everything lost: every block goes around the fetch ring.
    let r = ok(&cfg(3, 1_000_000));
    all_ok(&r, 10_000_000);
    assert_eq!(r.stats.chunks_landed, 0);
    assert_eq!(r.stats.fetch_requests, 2 * 8, "two collectives, eight SPs");
}

#[test]
fn receiver_not_ready_drops_from_finite_staging_are_recovered() {
    for seed in 1..=4 {
        let mut c = cfg(seed, 0);
        c.faults.net.rx_staging = 4;
        c.faults.net.rx_drain_ns = 400;
        let r = ok(&c);
        all_ok(&r, 3_000_000);
        assert!(r.fabric.rnr_drops > 0, "seed {seed}: {r:?}");
        assert!(r.stats.fetch_requests > 0);
    }
}

#[test]
fn a_partition_of_the_sp_channel_that_heals_only_delays() {
    for seed in 1..=4 {
        let mut c = cfg(seed, 10_000);
        c.faults.net.partition_cut = 2;
        c.faults.net.partition_from_ns = 5_000;
        c.faults.net.partition_heal_ns = 400_000;
        let r = ok(&c);
        all_ok(&r, 3_000_000);
        assert!(r.fabric.held_by_partition > 0, "seed {seed}");
        assert!(
            r.end_ns > 400_000,
            "nothing completes across the cut before it heals"
        );
    }
}

#[test]
fn an_sp_crash_during_the_fetch_ends_every_rank_in_bounded_time() {
    for seed in 1..=6 {
        let mut c = cfg(seed, 100_000);
        c.faults.crash_fetch_server = true;
        c.faults.detect_delay_ns = 20_000;
        let r = ok(&c);
        assert_eq!(r.crashed_sps.len(), 1, "seed {seed}: {r:?}");
        assert!(r.error_completions > 0);
        assert!(r.end_ns < 3_000_000, "seed {seed}: ended at {}", r.end_ns);
    }
}

#[test]
fn crashes_rank_deaths_and_failed_copies_never_hang() {
    for seed in 1..=10 {
        let mut c = cfg(seed, 10_000);
        c.len_bytes = None;
        c.faults.sp_crashes = (seed % 2) as u32;
        c.faults.crash_window_ns = 300_000;
        c.faults.detect_delay_ns = 10_000;
        c.faults.rank_deaths = 1;
        c.faults.death_window_ns = 300_000;
        c.faults.copy_error_ppm = 50_000;
        let r = ok(&c);
        assert!(r.end_ns < 3_000_000, "seed {seed}");
    }
}

#[test]
fn inconsistent_posts_abort_and_no_rank_completes_ok() {
    for seed in 1..=10 {
        let mut c = cfg(seed, 10_000);
        c.faults.inconsistent_posts = 1;
        let r = ok(&c);
        assert!(r.error_completions > 0, "seed {seed}");
    }
}

#[test]
fn one_sp_and_zero_byte_blocks() {
    let mut c = cfg(5, 100_000);
    c.nodes = 1;
    c.sps_per_node = 1;
    let r = ok(&c);
    all_ok(&r, 1_000_000);
    assert_eq!(r.fabric.datagrams, 0);
    assert_eq!(r.messages, 0);
    let mut c = cfg(6, 300_000);
    c.len_bytes = Some(0);
    let r = ok(&c);
    all_ok(&r, 3_000_000);
}

#[test]
fn chains_from_one_to_every_sp() {
    for chains in [1, 2, 3, 8, 100] {
        let mut c = cfg(7, 10_000);
        c.chains = chains;
        let r = ok(&c);
        all_ok(&r, 3_000_000);
    }
}

/// Runs `c` under `m` for seeds 1 to 4; every seed must fail with a
/// message containing one of `want`. Returns the first failure.
fn caught(m: Mutation, c: SimConfig, want: &[&str]) -> String {
    driver::caught(m, set_mutation, c, run, want)
}

#[test]
fn checkers_catch_a_fetch_that_skips_a_chunk() {
    caught(Mutation::SkipLastChunk, cfg(0, 100_000), &["is wrong"]);
}

#[test]
fn checkers_catch_a_fetch_from_the_wrong_neighbour() {
    caught(
        Mutation::FetchFromRight,
        cfg(0, 100_000),
        &["not from its left neighbour"],
    );
}

#[test]
fn checkers_catch_ranks_completing_before_the_right_neighbours_final() {
    caught(
        Mutation::CompleteBeforeFinal,
        cfg(0, 100_000),
        &["the buffer of rank", "reads and"],
    );
}

#[test]
fn checkers_catch_whole_request_acks_as_a_deadlock() {
    // 1000-byte blocks at 30% loss: every pair of neighbours misses a
    // chunk in common, so every SP waits for its left one.
    let mut c = cfg(0, 300_000);
    c.len_bytes = Some(1_000);
    caught(Mutation::WholeAcks, c, &["deadlock"]);
}

/// A random cluster, block length and mix of faults for `seed`.
pub(crate) fn random_cfg(seed: u64) -> SimConfig {
    use crate::sim::rng::Rng;
    let mut g = Rng::new(seed.wrapping_mul(7919));
    let mut c = SimConfig::new(seed);
    c.nodes = g.range(1, 6) as u32;
    c.ranks_per_node = g.range(1, 6) as u32;
    c.sps_per_node = g.range(1, 3) as u32;
    c.layout = if g.chance(1, 2) {
        crate::sim::Layout::Block
    } else {
        crate::sim::Layout::Cyclic
    };
    c.mtu = g.range(1, 100);
    c.subgroups = g.range(1, 5) as u16;
    c.chains = g.range(0, 5) as u32;
    // Cutoffs from far too early (before the multicast starts) to ample.
    c.alpha_ns = [0, 1_000, 20_000, 150_000][g.below(4) as usize];
    c.max_len_bytes = 300;
    c.ops = g.range(1, 3) as u32;
    c.max_inflight_reads = g.range(1, 4) as usize;
    let f = &mut c.faults;
    f.msg_jitter_ns = g.range(0, 5_000);
    f.net.loss_ppm = [0, 1_000, 100_000, 500_000][g.below(4) as usize];
    f.net.dup_ppm = [0, 50_000][g.below(2) as usize];
    f.net.reorder_ns = g.range(0, 5_000);
    if g.chance(1, 4) {
        f.net.rx_staging = g.range(1, 8) as u32;
        f.net.rx_drain_ns = g.range(0, 300);
    }
    if g.chance(1, 4) {
        f.net.partition_cut = g.range(0, c.common.nodes as u64) as u32;
        f.net.partition_from_ns = g.range(0, 100_000);
        f.net.partition_heal_ns = g.range(0, 400_000);
    }
    if g.chance(1, 3) {
        f.sp_crashes = 1;
        f.crash_window_ns = 300_000;
        f.detect_delay_ns = g.range(0, 20_000);
    }
    if g.chance(1, 3) {
        f.rank_deaths = 1;
        f.death_window_ns = 300_000;
    }
    if g.chance(1, 4) {
        f.copy_error_ppm = 50_000;
    }
    if g.chance(1, 4) {
        f.inconsistent_posts = 1;
    }
    f.crash_fetch_server = g.chance(1, 5);
    if f.crash_fetch_server {
        f.detect_delay_ns = g.range(0, 20_000);
    }
    c
}

#[test]
fn random_clusters_blocks_and_faults_pass_every_check() {
    let seeds = 1..=1_500u64;
    eprintln!("seeds {seeds:?} (replay one: run(&random_cfg(seed)))");
    let mut fails = Vec::new();
    let mut total = Stats::default();
    let (mut fabric, mut clean, mut errors) = (FabricCounts::default(), 0, 0);
    for seed in seeds {
        let c = random_cfg(seed);
        match run(&c) {
            Ok(r) => {
                total.absorb(&r.stats);
                fabric.rnr_drops += r.fabric.rnr_drops;
                fabric.held_by_partition += r.fabric.held_by_partition;
                fabric.duplicated += r.fabric.duplicated;
                if r.error_completions == 0 {
                    clean += 1;
                } else {
                    errors += 1;
                }
            }
            Err(e) => fails.push(format!("{e}\n  {c:?}")),
        }
    }
    for f in fails.iter().take(5) {
        eprintln!("{f}");
    }
    assert!(fails.is_empty(), "{} failures", fails.len());
    eprintln!("{clean} runs all Ok, {errors} with errors; {fabric:?}; {total:?}");
    assert!(clean > 0 && errors > 0);
    assert!(fabric.rnr_drops > 0 && fabric.held_by_partition > 0 && fabric.duplicated > 0);
    assert!(total.fetch_acks_sent > 0 && total.stale_acks > 0);
}

#[test]
fn a_thousand_ranks_at_each_loss_rate() {
    for (seed, ppm) in [(11, 0), (12, 1_000), (13, 10_000), (14, 100_000)] {
        let r = ok(&thousand(seed, ppm));
        assert_eq!(r.world_size, 1024);
        all_ok(&r, 20_000_000);
        if ppm == 0 {
            assert_eq!(r.stats.fetch_requests, 0);
        }
    }
}

/// 1024 ranks (32 nodes x 32, 4 SPs per node), 128-byte blocks in 64-byte
/// chunks over 2 subgroups, reordering and 1% duplicates, loss at `ppm`.
/// `B_link` is what an SP takes in here: a 64-byte chunk per 100 ns input.
pub(crate) fn thousand(seed: u64, ppm: u32) -> SimConfig {
    let mut c = SimConfig::new(seed);
    c.common = Common::new(seed);
    c.nodes = 32;
    c.ranks_per_node = 32;
    c.link_bytes_per_ns = 1;
    c.mtu = 64;
    c.subgroups = 2;
    c.len_bytes = Some(128);
    c.faults.net = NetFaults {
        loss_ppm: ppm,
        dup_ppm: 10_000,
        reorder_ns: 2_000,
        ..NetFaults::default()
    };
    c
}
