//! Canary in the packet-level simulator (issue 27, part 7): every algorithm gives the
//! reference bytes; faults (a spine killed mid-allreduce, random loss, a descriptor table far
//! too small, forged packets from outside the job, total loss) end in the right result or in
//! an error on every member, within bounded simulated time; never a wrong block, never a hang.

use algorithms::canary::sim::{run, Algo, Faults, Job, NetConfig, Report, Scenario};
use algorithms::sim::rng::Rng;

/// 4 leaves x 4 hosts, 4 spines; short timers so that recovery is quick.
fn net() -> NetConfig {
    NetConfig {
        leaves: 4,
        hosts_per_leaf: 4,
        spines: 4,
        window: 16,
        hold: 200_000,
        retx_timeout: 50_000,
        restart_holdoff: 25_000,
        max_requests: 8,
        max_attempts: 12,
        max_time: 1_000_000_000,
        ..NetConfig::default()
    }
}

/// `members` random hosts in one allreduce of `len` bytes, the others congesting.
fn scenario(seed: u64, algo: Algo, members: usize, len: usize) -> Scenario {
    let net = net();
    let mut rng = Rng::new(seed);
    let mut hosts: Vec<u32> = (0..net.hosts() as u32).collect();
    rng.shuffle(&mut hosts);
    Scenario {
        net,
        algo,
        jobs: vec![Job {
            members: hosts[..members].to_vec(),
            len,
        }],
        background: hosts[members..].to_vec(),
        faults: Faults::default(),
        seed,
    }
}

fn summary(r: &Report) -> String {
    let j = &r.jobs[0];
    format!(
        "ok {} failed {:?} unfinished {} wrong {} end {} ns hung {} restarts {} collisions {} dropped {}",
        j.ok_hosts,
        j.failed.iter().take(3).collect::<Vec<_>>(),
        j.unfinished,
        j.wrong_blocks,
        r.end,
        r.hung,
        r.hosts.restarts,
        r.switches.collisions,
        r.dropped
    )
}

const ALGOS: [Algo; 4] = [
    Algo::Ring,
    Algo::StaticTrees(1),
    Algo::StaticTrees(4),
    Algo::Canary,
];

#[test]
fn every_algorithm_gives_the_reference_bytes_under_background_traffic() {
    for seed in 1..4u64 {
        for algo in ALGOS {
            for (members, len) in [(2, 4096), (7, 60_000), (12, 100 * 1024 + 12)] {
                println!("seed {seed} {algo} members {members} len {len}");
                let r = run(&scenario(seed, algo, members, len));
                println!("  {}", summary(&r));
                assert!(r.all_ok(), "{}", summary(&r));
                assert_eq!(
                    r.jobs[0].checked_bytes,
                    (members * len) as u64,
                    "every byte of every member checked"
                );
            }
        }
    }
}

#[test]
fn concurrent_allreduces_share_the_switches() {
    let seed = 7;
    println!("seed {seed}");
    let net = net();
    let mut rng = Rng::new(seed);
    let mut hosts: Vec<u32> = (0..16).collect();
    rng.shuffle(&mut hosts);
    for algo in ALGOS {
        let sc = Scenario {
            net: net.clone(),
            algo,
            jobs: hosts
                .chunks(4)
                .map(|m| Job {
                    members: m.to_vec(),
                    len: 32 * 1024,
                })
                .collect(),
            background: vec![],
            faults: Faults::default(),
            seed,
        };
        let r = run(&sc);
        println!("{algo}: {}", summary(&r));
        assert!(r.all_ok());
    }
}

#[test]
fn a_spine_killed_mid_allreduce_costs_only_retransmissions() {
    for seed in 10..14u64 {
        for spine in 0..4 {
            let mut sc = scenario(seed, Algo::Canary, 10, 200 * 1024);
            sc.faults.kill_spine = Some((spine, 5_000));
            let r = run(&sc);
            println!("seed {seed} spine {spine}: {}", summary(&r));
            assert!(r.all_ok(), "{}", summary(&r));
            assert!(r.end < 20_000_000, "bounded time");
        }
    }
}

#[test]
fn a_static_tree_through_a_killed_spine_ends_right_or_in_an_error_everywhere() {
    for seed in 20..24u64 {
        for spine in 0..4 {
            let mut sc = scenario(seed, Algo::StaticTrees(1), 10, 100 * 1024);
            sc.faults.kill_spine = Some((spine, 5_000));
            let r = run(&sc);
            println!("seed {seed} spine {spine}: {}", summary(&r));
            assert!(r.sound(), "{}", summary(&r));
            let j = &r.jobs[0];
            assert!(
                j.failed.is_empty() || j.failed.len() == 10,
                "all or none fail: {}",
                summary(&r)
            );
            assert!(r.end < 50_000_000, "bounded time");
        }
    }
}

#[test]
fn random_loss_is_recovered_by_restarts() {
    let mut restarts = 0;
    for seed in 30..36u64 {
        for algo in [Algo::Canary, Algo::StaticTrees(4)] {
            let mut sc = scenario(seed, algo, 12, 128 * 1024);
            sc.faults.drop_ppm = 5_000; // 0.5 % of Canary packets, at every hop
            let r = run(&sc);
            println!("seed {seed} {algo}: {}", summary(&r));
            assert!(r.all_ok(), "{}", summary(&r));
            assert!(r.dropped > 0);
            restarts += r.hosts.restarts;
        }
    }
    assert!(restarts > 0, "the leaders' restart path was exercised");
}

#[test]
fn losing_every_packet_ends_in_an_error_on_every_member_in_bounded_time() {
    for seed in 40..43u64 {
        for algo in [Algo::Canary, Algo::StaticTrees(1)] {
            let mut sc = scenario(seed, algo, 6, 16 * 1024);
            sc.faults.drop_ppm = 1_000_000;
            let r = run(&sc);
            println!("seed {seed} {algo}: {}", summary(&r));
            assert!(r.sound(), "{}", summary(&r));
            assert_eq!(r.jobs[0].failed.len(), 6, "{}", summary(&r));
            let n = net();
            let bound = (n.max_requests as u64 + 2) * n.retx_timeout * 2;
            assert!(r.end <= bound, "end {} > {bound}", r.end);
        }
    }
}

#[test]
fn a_descriptor_table_far_too_small_still_reduces_right() {
    for seed in 50..54u64 {
        for slots in [1, 2, 5] {
            let mut sc = scenario(seed, Algo::Canary, 12, 64 * 1024);
            sc.net.slots = slots;
            let r = run(&sc);
            println!("seed {seed} slots {slots}: {}", summary(&r));
            assert!(r.all_ok(), "{}", summary(&r));
            assert!(r.switches.collisions > 0 && r.switches.restores > 0);
        }
    }
}

#[test]
fn forged_packets_from_outside_the_job_change_nothing() {
    for seed in 60..63u64 {
        for algo in [Algo::Canary, Algo::StaticTrees(1)] {
            let mut sc = scenario(seed, algo, 8, 64 * 1024);
            sc.faults.forge_at = Some(2_000);
            let r = run(&sc);
            println!("seed {seed} {algo}: {}", summary(&r));
            assert!(r.all_ok(), "{}", summary(&r));
            assert!(
                r.hosts.ignored > 0,
                "the forged packets reached members and were refused"
            );
        }
    }
}
