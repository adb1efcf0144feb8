use super::*;
use crate::mcast_bcast::{set_mutation, Mutation};
use crate::sim::NetFaults;

/// 1000-byte messages (16 chunks of 64 bytes) over 3 subgroups, with
/// datagrams lost at `loss_ppm`.
fn cfg(seed: u64, loss_ppm: u32) -> SimConfig {
    let mut c = SimConfig::new(seed);
    c.len_bytes = Some(1_000);
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
        all_ok(&r, 1_000_000);
        assert_eq!(r.stats.fetch_requests, 0, "seed {seed}");
        assert_eq!(r.fabric.lost + r.fabric.rnr_drops, 0);
        assert_eq!(r.unregistered_drops, 0, "seed {seed}: RNR barrier");
        assert!(r.stats.chunks_landed > 0);
    }
}

#[test]
fn losses_of_0_1_to_10_percent_are_recovered_through_the_fetch_ring() {
    for (ppm, seeds) in [(1_000, 1..=6), (10_000, 1..=6), (100_000, 1..=6)] {
        for seed in seeds {
            let mut c = cfg(seed, ppm);
            c.faults.net.dup_ppm = 20_000;
            c.faults.net.reorder_ns = 3_000;
            c.faults.msg_jitter_ns = 2_000;
            let r = ok(&c);
            all_ok(&r, 2_000_000);
            if r.fabric.lost > 0 {
                assert!(r.stats.fetch_requests > 0, "seed {seed}: {r:?}");
            }
        }
    }
    // Everything lost: the whole message goes around the fetch ring.
    let r = ok(&cfg(3, 1_000_000));
    all_ok(&r, 5_000_000);
    assert_eq!(r.stats.chunks_landed, 0);
    assert_eq!(
        r.stats.fetch_requests,
        2 * 7,
        "two collectives, seven leaf SPs"
    );
}

#[test]
fn a_thousand_ranks_at_each_loss_rate() {
    for (seed, ppm) in [(11, 0), (12, 1_000), (13, 10_000), (14, 100_000)] {
        let mut c = SimConfig::new(seed);
        c.common = Common::new(seed);
        c.nodes = 32;
        c.ranks_per_node = 32;
        c.mtu = 1_024;
        c.subgroups = 4;
        c.len_bytes = Some(40_000);
        c.faults.net = NetFaults {
            loss_ppm: ppm,
            dup_ppm: 10_000,
            reorder_ns: 2_000,
            ..NetFaults::default()
        };
        let r = ok(&c);
        assert_eq!(r.world_size, 1024);
        all_ok(&r, 3_000_000);
        assert_eq!(r.fabric.datagrams, 40 * 127, "seed {seed}");
        if ppm == 0 {
            assert_eq!(r.stats.fetch_requests, 0);
        }
    }
}

#[test]
fn receiver_not_ready_drops_from_finite_staging_are_recovered() {
    for seed in 1..=4 {
        let mut c = cfg(seed, 0);
        c.len_bytes = Some(4_000);
        c.faults.net.rx_staging = 4;
        c.faults.net.rx_drain_ns = 400;
        let r = ok(&c);
        all_ok(&r, 2_000_000);
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
        all_ok(&r, 2_000_000);
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
        assert!(r.end_ns < 2_000_000, "seed {seed}: ended at {}", r.end_ns);
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
fn one_sp_and_zero_byte_messages() {
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
    all_ok(&r, 2_000_000);
}

/// Runs `c` under `m` for seeds 1 to 4; every seed must fail with a
/// message containing one of `want`. Returns the first failure.
fn caught(m: Mutation, c: SimConfig, want: &[&str]) -> String {
    driver::caught(m, set_mutation, c, run, want)
}

#[test]
fn checkers_catch_a_fetch_that_skips_a_range() {
    let mut c = cfg(0, 100_000);
    c.len_bytes = Some(2_000);
    caught(Mutation::SkipLastRange, c, &["is wrong"]);
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
