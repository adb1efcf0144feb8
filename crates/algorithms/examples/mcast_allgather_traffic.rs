//! Fabric traffic of the multicast Allgather from the simulator against
//! the paper's model (§II, Fig. 2, Appendix B) and the ring, for P = 32 to
//! 1024 participants (one rank and one SP per node, 4 KiB blocks in one
//! 4 KiB datagram each, no faults, bytes not checked: the receive buffers
//! at P = 1024 would take 4 GiB; `tests/sim_mcast_allgather.rs` checks
//! every byte up to P = 64).
//!
//!     cargo run --release -p algorithms --example mcast_allgather_traffic
//!
//! Columns: bytes injected per rank (multicast payload, fetches) against
//! the ring's `(P - 1) N`; fabric bytes (injected plus received over every
//! node, wire bytes: datagram headers, fetches and SP-to-SP messages
//! included) simulated, and the model's `P^2 N`; the traffic cut, the
//! ring's `2 P (P - 1) N` over the simulated bytes, and the model's
//! `2 - 2/P`. Then the same at 1% datagram loss: what the fetch ring adds.

use std::time::Instant;

use algorithms::sim::mcast_allgather::{paper_model, run, SimConfig};

fn main() {
    table(0);
    println!();
    table(10_000);
}

fn table(loss_ppm: u32) {
    let block: u64 = 4_096;
    println!(
        "N = {block} B per rank, one rank per node, seed 1, datagram loss {} %",
        f64::from(loss_ppm) / 10_000.0
    );
    println!(
        "{:>5} {:>10} {:>10} {:>12} {:>14} {:>14} {:>8} {:>7} {:>7} {:>8}",
        "P",
        "inj/rank",
        "of which",
        "ring/rank",
        "fabric sim",
        "fabric model",
        "dev",
        "cut",
        "model",
        "wall"
    );
    println!("{:>5} {:>10} {:>10}", "", "", "fetched");
    for p in [32u32, 64, 128, 256, 512, 1024] {
        let t0 = Instant::now();
        let mut c = SimConfig::traffic(1, p, block, false);
        c.faults.net.loss_ppm = loss_ppm;
        let r = match run(&c) {
            Ok(r) => r,
            Err(e) => panic!("P={p}: {e}"),
        };
        assert_eq!(r.error_completions, 0);
        let t = &r.traffic;
        let p64 = u64::from(p);
        let fetched = t.fetched_from_rank.iter().sum::<u64>();
        let injected = t.mcast_payload_per_rank.iter().sum::<u64>() + fetched;
        let (mc, ring) = paper_model(p64, block);
        let sim = t.fabric_total();
        println!(
            "{:>5} {:>10} {:>10} {:>12} {:>14} {:>14} {:>+7.2}% {:>7.3} {:>7.3} {:>7.1?}",
            p,
            injected / p64,
            fetched / p64,
            (p64 - 1) * block,
            sim,
            mc,
            (sim as f64 - mc as f64) / mc as f64 * 100.0,
            ring as f64 / sim as f64,
            2.0 - 2.0 / p as f64,
            t0.elapsed()
        );
    }
}
