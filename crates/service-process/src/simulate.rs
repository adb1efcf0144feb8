//! `service-process simulate`: runs the deterministic simulator of `algorithms` at scales this
//! machine cannot run for real (e.g. 32 nodes x 32 ranks) and prints what the design promises:
//! completion time against SPs per node, block against cyclic layout, and inter-node bytes
//! against the minimum. Virtual time and the cost model are the simulator's
//! (`algorithms::sim::CostModel`); the figures are simulated, not measured.

use algorithms::sim::allgatherv::{run, SimConfig};
use algorithms::sim::Layout;
use anyhow::{anyhow, Result};
use serde::Serialize;

#[derive(Clone, Debug)]
pub struct SimulateOpts {
    pub nodes: u32,
    pub ranks_per_node: u32,
    pub sps_per_node: Vec<u32>,
    pub layouts: Vec<Layout>,
    pub block_bytes: u64,
    pub late_ranks: u32,
    pub seeds: u32,
    pub seed: u64,
    pub json: bool,
}

#[derive(Serialize)]
struct Row {
    coll: &'static str,
    nodes: u32,
    ranks_per_node: u32,
    sps_per_node: u32,
    layout: &'static str,
    late_ranks: u32,
    block_bytes: u64,
    runs: u32,
    mean_completion_us: f64,
    inter_node_bytes: u64,
    min_inter_node_bytes: u64,
    no_ready_rank: u64,
    served_after_pass: u64,
    parked: u64,
}

pub fn simulate(o: &SimulateOpts) -> Result<()> {
    if o.seeds == 0 {
        return Err(anyhow!("--seeds must be at least 1"));
    }
    if !o.json {
        println!(
            "# simulated allgather: {} nodes x {} ranks, {} B per rank, {} late ranks, {} seeds \
             from {:#x} (virtual time)",
            o.nodes, o.ranks_per_node, o.block_bytes, o.late_ranks, o.seeds, o.seed
        );
        println!(
            "{:>4} {:>7} {:>14} {:>16} {:>16} {:>9} {:>9} {:>7}",
            "sps",
            "layout",
            "completion_us",
            "inter_node_B",
            "min_inter_B",
            "no_ready",
            "passed",
            "parked"
        );
    }
    for &k in &o.sps_per_node {
        for &layout in &o.layouts {
            let mut row = Row {
                coll: "allgather",
                nodes: o.nodes,
                ranks_per_node: o.ranks_per_node,
                sps_per_node: k,
                layout: match layout {
                    Layout::Block => "block",
                    Layout::Cyclic => "cyclic",
                },
                late_ranks: o.late_ranks,
                block_bytes: o.block_bytes,
                runs: o.seeds,
                mean_completion_us: 0.0,
                inter_node_bytes: 0,
                min_inter_node_bytes: 0,
                no_ready_rank: 0,
                served_after_pass: 0,
                parked: 0,
            };
            for i in 0..o.seeds {
                let mut cfg = SimConfig::new(o.seed.wrapping_add(i as u64));
                cfg.nodes = o.nodes;
                cfg.ranks_per_node = o.ranks_per_node;
                cfg.sps_per_node = k;
                cfg.layout = layout;
                cfg.max_block_bytes = o.block_bytes;
                cfg.equal_counts = true;
                cfg.zero_block_percent = 0;
                cfg.late_ranks = o.late_ranks;
                let r = run(&cfg).map_err(|e| anyhow!("simulation failed: {e}"))?;
                row.mean_completion_us += r.end_ns as f64 / 1e3 / o.seeds as f64;
                row.inter_node_bytes += r.bytes_copied_inter_node;
                row.min_inter_node_bytes += r.min_inter_node_bytes;
                row.no_ready_rank += r.stats.no_ready_rank;
                row.served_after_pass += r.stats.served_after_pass;
                row.parked += r.stats.parked;
            }
            if o.json {
                println!("{}", serde_json::to_string(&row)?);
            } else {
                println!(
                    "{:>4} {:>7} {:>14.1} {:>16} {:>16} {:>9} {:>9} {:>7}",
                    row.sps_per_node,
                    row.layout,
                    row.mean_completion_us,
                    row.inter_node_bytes,
                    row.min_inter_node_bytes,
                    row.no_ready_rank,
                    row.served_after_pass,
                    row.parked
                );
            }
        }
    }
    Ok(())
}
