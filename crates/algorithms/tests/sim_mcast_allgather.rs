//! Simulator scenarios for the multicast Iallgather. Each scenario runs
//! fixed seeds plus fresh ones from `SIM_SEED` (or the clock); every seed is
//! printed and failures include it (`SimFailure` starts with it).

mod common;

use algorithms::sim::mcast_allgather::{paper_model, run, SimConfig, SimReport};
use algorithms::sim::{Common, Layout, NetFaults};

use common::{base_seed, iters, run_logged, seeds, spread};

fn describe(r: &SimReport) -> String {
    format!(
        "virtual {}ns, {} errors, {} datagrams ({} lost, {} dup, {} rnr), {} fetch requests, {} bytes fetched, {} held by the partition",
        r.end_ns,
        r.error_completions,
        r.fabric.datagrams,
        r.fabric.lost,
        r.fabric.duplicated,
        r.fabric.rnr_drops,
        r.stats.fetch_requests,
        r.stats.bytes_fetched,
        r.fabric.held_by_partition
    )
}

/// 1024 ranks (32 nodes x 32, 4 SPs per node), 128-byte blocks in 64-byte
/// chunks over 2 subgroups (every receive buffer 128 KiB), reordering and
/// 1% duplicates, loss at `loss_ppm`; `B_link` is what an SP takes in (a
/// 64-byte chunk per 100 ns input).
fn thousand(seed: u64, loss_ppm: u32) -> SimConfig {
    let mut c = SimConfig::new(seed);
    c.common = Common::new(seed);
    c.nodes = 32;
    c.ranks_per_node = 32;
    c.mtu = 64;
    c.subgroups = 2;
    c.link_bytes_per_ns = 1;
    c.len_bytes = Some(128);
    c.faults.net = NetFaults {
        loss_ppm,
        dup_ppm: 10_000,
        reorder_ns: 2_000,
        ..NetFaults::default()
    };
    c
}

#[test]
fn mcast_allgather_1024_ranks_at_0_0_1_1_and_10_percent_loss() {
    let name = "mcast_allgather_1024_ranks_at_0_0_1_1_and_10_percent_loss";
    for seed in seeds() {
        for loss_ppm in [0, 1_000, 10_000, 100_000] {
            let c = thousand(seed, loss_ppm);
            let r = run_logged(name, seed, &c, run, describe);
            assert_eq!(r.world_size, 1024);
            assert_eq!(r.error_completions, 0, "{name}: seed={seed:#018x}");
            assert!(r.end_ns < 20_000_000, "{name}: seed={seed:#018x}");
            if loss_ppm == 0 {
                assert_eq!(r.stats.fetch_requests, 0, "{name}: seed={seed:#018x}");
            } else {
                assert!(r.stats.chunks_fetched > 0, "{name}: seed={seed:#018x}");
            }
        }
    }
}

#[test]
fn mcast_allgather_1024_ranks_with_finite_staging_a_partition_and_an_sp_crash_in_the_fetch() {
    let name =
        "mcast_allgather_1024_ranks_with_finite_staging_a_partition_and_an_sp_crash_in_the_fetch";
    for seed in seeds() {
        // Receiver-not-ready drops from a small staging ring.
        let mut c = thousand(seed, 0);
        c.faults.net.rx_staging = 64;
        c.faults.net.rx_drain_ns = 20;
        let r = run_logged(name, seed, &c, run, describe);
        assert_eq!(r.error_completions, 0, "{name}: seed={seed:#018x}");
        assert!(r.fabric.rnr_drops > 0 && r.stats.chunks_fetched > 0);
        // A partition of the SP channel that heals: only a delay.
        let mut c = thousand(seed, 10_000);
        c.faults.net.partition_cut = 16;
        c.faults.net.partition_from_ns = 10_000;
        c.faults.net.partition_heal_ns = 500_000;
        let r = run_logged(name, seed, &c, run, describe);
        assert_eq!(r.error_completions, 0, "{name}: seed={seed:#018x}");
        assert!(r.fabric.held_by_partition > 0 && r.end_ns > 500_000);
        // An SP crashes right after it acknowledged a fetch: every rank of
        // the other SPs ends, with an error, in bounded time.
        let mut c = thousand(seed, 100_000);
        c.faults.crash_fetch_server = true;
        c.faults.detect_delay_ns = 20_000;
        let r = run_logged(name, seed, &c, run, describe);
        assert_eq!(r.crashed_sps.len(), 1, "{name}: seed={seed:#018x}");
        assert!(r.error_completions > 0 && r.error_completions <= 1024 - 8);
        assert!(r.end_ns < 20_000_000, "{name}: seed={seed:#018x}");
    }
}

/// Each rank injects its block once (plus what its SP serves to the fetch
/// ring under loss), against the ring's `(P - 1) * N`.
#[test]
fn mcast_allgather_each_rank_injects_its_block_once() {
    let name = "mcast_allgather_each_rank_injects_its_block_once";
    for seed in seeds() {
        for loss_ppm in [0, 10_000] {
            let c = thousand(seed, loss_ppm);
            let r = run_logged(name, seed, &c, run, describe);
            let (p, n) = (r.world_size as u64, 128u64);
            let t = &r.traffic;
            assert!(
                t.mcast_payload_per_rank.iter().all(|&b| b == n),
                "{name}: seed={seed:#018x}"
            );
            let fetched: u64 = t.fetched_from_rank.iter().sum();
            let per_rank = (p * n + fetched) as f64 / p as f64;
            let ring = ((p - 1) * n) as f64;
            eprintln!(
                "{name}: loss {loss_ppm} ppm: injected {per_rank:.1} B per rank (multicast {n} + fetch {:.1}); ring {ring}",
                fetched as f64 / p as f64
            );
            if loss_ppm == 0 {
                assert_eq!(fetched, 0);
            }
            // Under 1% loss, the fetches stay far below the ring's volume.
            assert!(
                per_rank < 0.05 * ring,
                "{name}: seed={seed:#018x}: {per_rank}"
            );
        }
    }
}

/// The paper's fabric-traffic model (§II, Fig. 2, Appendix B): with P
/// participants of N bytes, multicast moves `P * P * N` bytes through the
/// node links (each node injects N, receives `(P - 1) N`), the ring `2 P
/// (P - 1) N`; the cut is `2 - 2/P`. The simulated fabric (wire bytes:
/// datagram headers, fetches and SP-to-SP messages included) matches both
/// within 5% from P = 16.
#[test]
fn mcast_allgather_fabric_traffic_matches_the_papers_model_from_16_nodes() {
    let name = "mcast_allgather_fabric_traffic_matches_the_papers_model_from_16_nodes";
    let seed = seeds()[2];
    for p in [16u32, 32, 64] {
        let block = 16_384;
        let c = SimConfig::traffic(seed, p, block, true);
        let r = run_logged(name, seed, &c, run, describe);
        assert_eq!(r.error_completions, 0);
        let (mc, ring) = paper_model(p as u64, block);
        let sim = r.traffic.fabric_total();
        let dev = (sim as f64 - mc as f64) / mc as f64;
        let cut = ring as f64 / sim as f64;
        let model_cut = 2.0 - 2.0 / p as f64;
        eprintln!(
            "{name}: P={p}: simulated {sim} B, model {mc} B ({:+.2}%), cut {cut:.3} (model {model_cut:.3})",
            dev * 100.0
        );
        assert!(dev.abs() < 0.05, "{name}: P={p}: {dev}");
        assert!((cut - model_cut).abs() / model_cut < 0.05, "{name}: P={p}");
    }
}

/// Random clusters, block lengths, chunk sizes, subgroups, chains, cutoffs
/// and a random mix of every fault: each run must pass every check of the
/// simulator.
#[test]
fn mcast_allgather_random_clusters_and_faults() {
    let name = "mcast_allgather_random_clusters_and_faults";
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
    c.chains = g.range(0, 6) as u32;
    c.alpha_ns = g.range(0, 200_000);
    c.max_len_bytes = 500;
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
