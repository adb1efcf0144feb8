//! The simulator's own tests: its routing, buffers and background against the model its
//! module docs state, checked after every event where they say "audit".

use super::*;

fn net(leaves: usize, spines: usize) -> NetConfig {
    NetConfig {
        leaves,
        hosts_per_leaf: leaves,
        spines,
        window: 16,
        hold: 200_000,
        retx_timeout: 50_000,
        restart_holdoff: 25_000,
        ..NetConfig::default()
    }
}

/// Background and ring packets leave a leaf by the destination modulo the spines (SST's
/// fat tree) while that port is at most half full, else by the least loaded up-port.
#[test]
fn unicast_up_port_is_destination_mod_spines_unless_over_half_full() {
    for seed in 1..6u64 {
        println!("seed {seed}");
        let mut rng = Rng::new(seed);
        let (nl, ns) = (2 + rng.below(6) as usize, 2 + rng.below(7) as usize);
        let sc = Scenario {
            net: net(nl, ns),
            algo: Algo::Ring,
            jobs: vec![],
            background: vec![],
            faults: Faults::default(),
            seed,
        };
        let mut sim = Sim::build(&sc);
        let hpl = sim.net.hosts_per_leaf;
        for _ in 0..50 {
            let l = rng.below(nl as u64) as usize;
            let dst = loop {
                let d = rng.below(sim.h() as u64) as u32;
                if sim.leaf_of(d) != l {
                    break d;
                }
            };
            let node = sim.leaf_node(l);
            for p in hpl..hpl + ns {
                sim.nodes[node as usize].loads[p].queued = rng.below(sim.net.buffer / 2 + 1);
            }
            let def = hpl + dst as usize % ns;
            assert_eq!(sim.route(node, dst), Some(def as u16), "dst {dst}");
            // the default over half full: the least loaded up-port
            sim.nodes[node as usize].loads[def].queued = sim.net.buffer / 2 + 1;
            let other = hpl + (def - hpl + 1 + rng.below(ns as u64 - 1) as usize) % ns;
            sim.nodes[node as usize].loads[other].queued = 0;
            let got = sim.route(node, dst).unwrap() as usize;
            assert_ne!(got, def, "dst {dst}");
            assert_eq!(sim.nodes[node as usize].loads[got].queued, 0, "dst {dst}");
        }
    }
}

/// With `out_buf` set, the up-port rule sees each queue capped at that output buffer: two
/// ports past it look equal and the default wins, where the whole queues send the packet
/// to the shorter one.
#[test]
fn a_bounded_output_buffer_hides_the_backlog_from_the_up_port_rule() {
    for seed in 1..4u64 {
        println!("seed {seed}");
        let mut rng = Rng::new(seed);
        let (nl, ns) = (2 + rng.below(4) as usize, 2 + rng.below(5) as usize);
        let cap = 2048 + rng.below(4) * 1024;
        let hpl = nl;
        let dst = (hpl + rng.below((nl * hpl - hpl) as u64) as usize) as u32;
        let def = hpl + dst as usize % ns;
        let other = hpl + (def - hpl + 1) % ns;
        let (n_def, n_other) = (64 + rng.below(8), 34 + rng.below(4));
        let mut picks = Vec::new();
        for out_buf in [Some(cap), None] {
            let sc = Scenario {
                net: NetConfig {
                    out_buf,
                    ..net(nl, ns)
                },
                algo: Algo::Ring,
                jobs: vec![],
                background: vec![],
                faults: Faults::default(),
                seed,
            };
            let mut sim = Sim::build(&sc);
            let node = sim.leaf_node(0);
            // The default port gets a backlog past half of `buffer`, the other a shorter
            // one, both past the cap; every other up-port is down.
            for (p, n) in [(def, n_def), (other, n_other)] {
                for _ in 0..n {
                    sim.enqueue(node, p as u16, Pkt::Bg { dst }, None);
                }
                let q = &sim.nodes[node as usize].ports[p];
                let l = sim.nodes[node as usize].loads[p];
                assert!(q.bytes > cap, "the backlog passes the cap");
                assert_eq!(l.queued, sensed(q.bytes, out_buf));
                assert_eq!(l.capacity, out_buf.unwrap_or(sim.net.buffer));
            }
            assert!(sim.nodes[node as usize].ports[def].bytes * 2 > sim.net.buffer);
            for p in hpl..hpl + ns {
                if p != def && p != other {
                    sim.nodes[node as usize].loads[p].up = false;
                }
            }
            picks.push(sim.route(node, dst).unwrap() as usize);
        }
        assert_eq!(
            picks,
            vec![def, other],
            "dst {dst}: capped, then whole queues"
        );
    }
}

/// Under background traffic, the Canary and static-tree packets a switch forwards or
/// copies hold the input buffer they came through until they leave, as background
/// packets do (finite buffers, lossless back-pressure); the accounting balances after
/// every event and the results stay right.
/// One 64 KiB allreduce of `hosts[..members]` with the rest as background, the buffer
/// accounting audited after every event.
fn audited(net: NetConfig, algo: Algo, hosts: &[u32], members: usize, seed: u64) -> Report {
    let sc = Scenario {
        net,
        algo,
        jobs: vec![Job {
            members: hosts[..members].to_vec(),
            len: 64 * 1024,
        }],
        background: hosts[members..].to_vec(),
        faults: Faults::default(),
        seed,
    };
    let mut sim = Sim::build(&sc);
    sim.audit = true;
    sim.run();
    sim.report()
}

#[test]
fn forwarded_allreduce_packets_hold_their_input_buffer() {
    for seed in 1..4u64 {
        for algo in [Algo::StaticTrees(1), Algo::StaticTrees(4), Algo::Canary] {
            println!("seed {seed} {algo}");
            let mut rng = Rng::new(seed);
            let mut n = net(4, 4);
            n.buffer = 4096 + rng.below(8192);
            let mut hosts: Vec<u32> = (0..n.hosts() as u32).collect();
            rng.shuffle(&mut hosts);
            let r = audited(n, algo, &hosts, 8, seed);
            assert!(r.all_ok(), "{:?}", r.jobs[0]);
        }
    }
}

/// With input FIFOs (`hol`), a switch takes each input link's packets in order: under
/// background traffic, heads wait for full outputs and hold back packets behind them
/// whose own outputs have room (counted), every waiting head waits for an output that
/// is full and knows it (the audit after every event), the buffers stay exact, and every
/// design still ends right. Without `hol` nothing waits at an input.
#[test]
fn input_fifos_hold_back_what_is_behind_a_waiting_head() {
    for seed in 1..4u64 {
        for algo in [Algo::Ring, Algo::StaticTrees(1), Algo::Canary] {
            let mut rng = Rng::new(seed);
            let mut n = net(4, 4);
            n.buffer = 8192 + rng.below(8192);
            n.out_buf = Some(2048 + rng.below(4096));
            let mut hosts: Vec<u32> = (0..n.hosts() as u32).collect();
            rng.shuffle(&mut hosts);
            let run = |hol: bool| {
                let mut n = n.clone();
                n.hol = hol;
                let r = audited(n, algo, &hosts, 6, seed);
                assert!(r.all_ok(), "seed {seed} {algo} hol {hol}: {:?}", r.jobs[0]);
                r
            };
            let (with, without) = (run(true), run(false));
            println!(
                "seed {seed} {algo}: {} waits, {} held back; runtime {} ns with, {} without",
                with.hol_waits, with.hol_held, with.jobs[0].runtime, without.jobs[0].runtime
            );
            assert!(with.hol_held > 0 && with.hol_waits >= with.hol_held);
            assert_eq!((without.hol_waits, without.hol_held), (0, 0));
        }
    }
}

/// Under the permutation pattern every round of messages is a permutation of the
/// background hosts without fixed points; under the uniform one no host picks itself,
/// every host is picked, and in most rounds some host is picked by two or more senders
/// (endpoint congestion). Either way every design still ends right under it.
#[test]
fn uniform_background_draws_each_message_on_its_own() {
    for seed in 1..4u64 {
        let mut rng = Rng::new(seed);
        let n = net(4, 4);
        let mut hosts: Vec<u32> = (0..n.hosts() as u32).collect();
        rng.shuffle(&mut hosts);
        let members = 4;
        for pattern in [BgPattern::Permutation, BgPattern::Uniform] {
            let mut n = n.clone();
            n.bg_pattern = pattern;
            let sc = Scenario {
                net: n.clone(),
                algo: Algo::Canary,
                jobs: vec![Job {
                    members: hosts[..members].to_vec(),
                    len: 4096,
                }],
                background: hosts[members..].to_vec(),
                faults: Faults::default(),
                seed,
            };
            let mut sim = Sim::build(&sc);
            let bg = sc.background.clone();
            let mut shared_rounds = 0;
            let mut picked = vec![0u32; n.hosts()];
            for k in 0..50 {
                let mut senders = vec![0u32; n.hosts()];
                for (idx, &h) in bg.iter().enumerate() {
                    let d = sim.bg_dest(idx, k);
                    assert_ne!(d, h, "seed {seed} {pattern:?}: host {h} sends to itself");
                    assert!(bg.contains(&d), "{d} is not a background host");
                    senders[d as usize] += 1;
                    picked[d as usize] += 1;
                }
                if pattern == BgPattern::Permutation {
                    assert!(bg.iter().all(|&h| senders[h as usize] == 1), "round {k}");
                }
                shared_rounds += senders.iter().any(|&c| c > 1) as u32;
            }
            assert!(bg.iter().all(|&h| picked[h as usize] > 0));
            println!(
                "seed {seed} {pattern:?}: {shared_rounds} of 50 rounds with a shared receiver"
            );
            if pattern == BgPattern::Uniform {
                assert!(shared_rounds > 25, "{shared_rounds}");
            }
            for algo in [
                Algo::Ring,
                Algo::StaticTrees(1),
                Algo::StaticTrees(4),
                Algo::Canary,
            ] {
                let r = audited(n.clone(), algo, &hosts, members, seed);
                assert!(
                    r.all_ok(),
                    "seed {seed} {pattern:?} {algo}: {:?}",
                    r.jobs[0]
                );
            }
        }
    }
}

/// `tree_window` sets the static trees' members' window and only theirs; without it
/// every design takes `window`.
#[test]
fn static_trees_take_their_own_window() {
    let n = net(2, 2);
    let hosts: Vec<u32> = (0..n.hosts() as u32).collect();
    for (tree_window, algo, want) in [
        (Some(3), Algo::StaticTrees(1), 3),
        (Some(3), Algo::StaticTrees(4), 3),
        (Some(3), Algo::Canary, 7),
        (None, Algo::StaticTrees(1), 7),
    ] {
        let mut n = n.clone();
        (n.window, n.tree_window) = (7, tree_window);
        let sc = Scenario {
            net: n,
            algo,
            jobs: vec![Job {
                members: hosts.clone(),
                len: 4096,
            }],
            background: vec![],
            faults: Faults::default(),
            seed: 1,
        };
        let sim = Sim::build(&sc);
        for node in &sim.nodes[..hosts.len()] {
            let Role::Member { host, .. } = &node.role else {
                panic!("host not a member")
            };
            assert_eq!(host.config().window, want, "{algo} {tree_window:?}");
        }
        let r = run(&sc);
        assert!(r.all_ok(), "{algo}: {:?}", r.jobs[0]);
    }
}
