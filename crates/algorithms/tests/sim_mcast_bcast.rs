//! Simulator scenarios for the multicast Ibcast. Each scenario runs fixed
//! seeds plus fresh ones from `SIM_SEED` (or the clock); every seed is
//! printed and failures include it (`SimFailure` starts with it).

mod common;

use algorithms::sim::mcast_bcast::{run, SimConfig, SimReport};
use algorithms::sim::{Common, Layout, NetFaults};

use common::{base_seed, iters, run_logged, seeds, spread};

fn describe(r: &SimReport) -> String {
    format!(
        "virtual {}ns, {} errors, {} datagrams ({} lost, {} dup, {} rnr), {} fetches, {} held by the partition",
        r.end_ns,
        r.error_completions,
        r.fabric.datagrams,
        r.fabric.lost,
        r.fabric.duplicated,
        r.fabric.rnr_drops,
        r.stats.fetch_requests,
        r.fabric.held_by_partition
    )
}

/// 1024 ranks (32 nodes x 32, 4 SPs per node), 40 KB in 1 KiB chunks over
/// 4 subgroups, reordering and 1% duplicates, loss at `loss_ppm`.
fn thousand(seed: u64, loss_ppm: u32) -> SimConfig {
    let mut c = SimConfig::new(seed);
    c.common = Common::new(seed);
    c.nodes = 32;
    c.ranks_per_node = 32;
    c.mtu = 1_024;
    c.subgroups = 4;
    c.len_bytes = Some(40_000);
    c.faults.net = NetFaults {
        loss_ppm,
        dup_ppm: 10_000,
        reorder_ns: 2_000,
        ..NetFaults::default()
    };
    c
}

#[test]
fn mcast_bcast_1024_ranks_at_0_0_1_1_and_10_percent_loss() {
    let name = "mcast_bcast_1024_ranks_at_0_0_1_1_and_10_percent_loss";
    for seed in seeds() {
        for loss_ppm in [0, 1_000, 10_000, 100_000] {
            let c = thousand(seed, loss_ppm);
            let r = run_logged(name, seed, &c, run, describe);
            assert_eq!(r.error_completions, 0, "{name}: seed={seed:#018x}");
            assert!(r.end_ns < 3_000_000, "{name}: seed={seed:#018x}");
        }
    }
}

/// Random clusters, lengths, chunk sizes, subgroups, cutoffs and a random
/// mix of every fault: each run must pass every check of the simulator.
#[test]
fn mcast_bcast_random_clusters_and_faults() {
    let name = "mcast_bcast_random_clusters_and_faults";
    let base = base_seed(name);
    for i in 0..iters(500) {
        let seed = spread(base, i);
        let c = random(seed);
        if let Err(e) = run(&c) {
            panic!("{name}: {e}\n  config: {c:?}");
        }
    }
}

fn random(seed: u64) -> SimConfig {
    let mut g = algorithms::sim::rng::Rng::new(seed);
    let mut c = SimConfig::new(seed);
    c.nodes = g.range(1, 8) as u32;
    c.ranks_per_node = g.range(1, 6) as u32;
    c.sps_per_node = g.range(1, 3) as u32;
    c.layout = if g.chance(1, 2) {
        Layout::Block
    } else {
        Layout::Cyclic
    };
    c.mtu = g.range(1, 200);
    c.subgroups = g.range(1, 8) as u16;
    c.alpha_ns = g.range(0, 200_000);
    c.max_len_bytes = 3_000;
    c.ops = g.range(1, 3) as u32;
    let f = &mut c.faults;
    f.msg_jitter_ns = g.range(0, 5_000);
    f.net.loss_ppm = [0, 1_000, 10_000, 100_000][g.below(4) as usize];
    f.net.dup_ppm = g.range(0, 50_000) as u32;
    f.net.reorder_ns = g.range(0, 5_000);
    if g.chance(1, 4) {
        f.net.rx_staging = g.range(1, 16) as u32;
        f.net.rx_drain_ns = g.range(0, 200);
    }
    if g.chance(1, 4) {
        f.net.partition_cut = g.range(1, 4) as u32;
        f.net.partition_from_ns = g.range(0, 100_000);
        f.net.partition_heal_ns = g.range(0, 500_000);
    }
    if g.chance(1, 4) {
        f.sp_crashes = 1;
        f.crash_window_ns = 300_000;
        f.detect_delay_ns = g.range(0, 20_000);
    }
    if g.chance(1, 4) {
        f.rank_deaths = 1;
        f.death_window_ns = 300_000;
    }
    if g.chance(1, 5) {
        f.copy_error_ppm = 20_000;
    }
    if g.chance(1, 5) {
        f.inconsistent_posts = 1;
    }
    if g.chance(1, 5) {
        f.crash_fetch_server = true;
        f.detect_delay_ns = g.range(0, 20_000);
    }
    c
}
