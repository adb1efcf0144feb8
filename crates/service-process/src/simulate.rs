//! `service-process simulate`: runs the deterministic simulators of `algorithms` at scales this
//! machine cannot run for real (e.g. 32 nodes x 32 ranks) and prints what the designs promise:
//! completion time against SPs per node, block against cyclic layout, and inter-node bytes
//! against the minimum; for the staged bcast also flat against hierarchical delivery. Virtual
//! time and the cost model are the simulator's (`algorithms::sim::CostModel`); the figures are
//! simulated, not measured.

use algorithms::bcast::Design;
use algorithms::sim::allgatherv::{run, SimConfig};
use algorithms::sim::{bcast, Layout};
use anyhow::{anyhow, bail, Result};
use serde::Serialize;

/// The collective to simulate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Coll {
    /// The hierarchical, load-balanced allgather (`algorithms::sim::allgatherv`).
    Allgather,
    /// The staged bcast, flat and hierarchical (`algorithms::sim::bcast`).
    Bcast,
}

/// Defaults of the bcast options (those of the SP's `serve --stage-chunk-bytes/--stage-slots`
/// for the chunk and the slots).
pub const DEFAULT_BCAST_BYTES: u64 = 1 << 20;
pub const DEFAULT_CHUNK_BYTES: u64 = 256 * 1024;
pub const DEFAULT_SLOTS: u32 = 4;
pub const DEFAULT_ROOT: u32 = 0;
/// Default of `--block-bytes` (allgather).
pub const DEFAULT_BLOCK_BYTES: u64 = 64;

/// The options of `service-process simulate` (its `--help` is made of these comments).
#[derive(Clone, Debug, clap::Args)]
pub struct SimulateOpts {
    /// The collective to simulate.
    #[arg(long, value_enum, default_value = "allgather")]
    pub coll: Coll,
    #[arg(long, default_value_t = 32)]
    pub nodes: u32,
    #[arg(long, default_value_t = 32)]
    pub ranks_per_node: u32,
    /// Comma-separated SPs per node to compare.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub sps_per_node: Vec<u32>,
    /// Comma-separated layouts to compare.
    #[arg(long = "layout", value_name = "LAYOUT", value_delimiter = ',', default_value = "block,cyclic", value_parser = parse_layout)]
    pub layouts: Vec<Layout>,
    /// Allgather only: bytes each rank contributes (the simulator keeps real buffers: keep
    /// it small) [default: 64]
    // `None`: [`DEFAULT_BLOCK_BYTES`]; given with `--coll bcast`, an error.
    #[arg(long)]
    pub block_bytes: Option<u64>,
    /// World ranks that arrive late (the simulator's late-rank delay: 100 us).
    #[arg(long, default_value_t = 0)]
    pub late_ranks: u32,
    /// Bcast only: bytes broadcast (the simulator keeps a real buffer per rank: about nodes x
    /// ranks-per-node x bcast-bytes of memory, 1 GiB and 0.5 to 1.5 s a run at 32x32 and 1 MiB)
    /// [default: 1048576]
    // The bcast options: `None` is the `DEFAULT_*` above; given with `--coll allgather`, an
    // error.
    #[arg(long)]
    pub bcast_bytes: Option<u64>,
    /// Bcast only: bytes per chunk and per staging buffer, as `serve --stage-chunk-bytes`
    /// [default: 262144]
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=2 * 1024 * 1024))]
    pub chunk_bytes: Option<u64>,
    /// Bcast only: staging buffers per SP (the pipeline depth), as `serve --stage-slots`
    /// [default: 4]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub slots: Option<u32>,
    /// Bcast only: the root's world rank [default: 0]
    #[arg(long)]
    pub root: Option<u32>,
    /// Runs per point (seeds seed, seed+1, ...), averaged.
    #[arg(long, default_value_t = 3)]
    pub seeds: u32,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// One JSON object per row instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// A `--layout` value: the names of the cluster description's layouts (`bootstrap::Layout`).
fn parse_layout(s: &str) -> Result<Layout, String> {
    Ok(match s.parse::<bootstrap::Layout>()? {
        bootstrap::Layout::Block => Layout::Block,
        bootstrap::Layout::Cyclic => Layout::Cyclic,
    })
}

/// What a row of either collective starts with: the point simulated.
#[derive(Clone, Copy, Serialize)]
struct Point {
    coll: &'static str,
    nodes: u32,
    ranks_per_node: u32,
    sps_per_node: u32,
    layout: &'static str,
}

impl SimulateOpts {
    /// The point of `coll` with `k` SPs per node and `layout`.
    fn point(&self, coll: &'static str, k: u32, layout: Layout) -> Point {
        Point {
            coll,
            nodes: self.nodes,
            ranks_per_node: self.ranks_per_node,
            sps_per_node: k,
            layout: layout_name(layout),
        }
    }
}

/// The columns of a text table: each a header and a width (right-aligned, one space apart).
type Columns<const N: usize> = [(&'static str, usize); N];

fn print_header<const N: usize>(columns: &Columns<N>) {
    print_row(columns, columns.map(|(name, _)| name.to_string()));
}

fn print_row<const N: usize>(columns: &Columns<N>, cells: [String; N]) {
    let cells: Vec<String> = columns
        .iter()
        .zip(cells)
        .map(|((_, width), cell)| format!("{cell:>width$}"))
        .collect();
    println!("{}", cells.join(" "));
}

const ALLGATHER_COLUMNS: Columns<8> = [
    ("sps", 4),
    ("layout", 7),
    ("completion_us", 14),
    ("inter_node_B", 16),
    ("min_inter_B", 16),
    ("no_ready", 9),
    ("passed", 9),
    ("parked", 7),
];

#[derive(Serialize)]
struct Row {
    #[serde(flatten)]
    point: Point,
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

fn layout_name(layout: Layout) -> &'static str {
    match layout {
        Layout::Block => "block",
        Layout::Cyclic => "cyclic",
    }
}

pub fn simulate(o: &SimulateOpts) -> Result<()> {
    if o.seeds == 0 {
        return Err(anyhow!("--seeds must be at least 1"));
    }
    match o.coll {
        Coll::Allgather => {
            for (set, name) in [
                (o.bcast_bytes.is_some(), "--bcast-bytes"),
                (o.chunk_bytes.is_some(), "--chunk-bytes"),
                (o.slots.is_some(), "--slots"),
                (o.root.is_some(), "--root"),
            ] {
                if set {
                    bail!("{name} applies to --coll bcast only");
                }
            }
            simulate_allgather(o, o.block_bytes.unwrap_or(DEFAULT_BLOCK_BYTES))
        }
        Coll::Bcast => {
            if o.block_bytes.is_some() {
                bail!("--block-bytes applies to --coll allgather only");
            }
            simulate_bcast(o)
        }
    }
}

fn simulate_allgather(o: &SimulateOpts, block_bytes: u64) -> Result<()> {
    if !o.json {
        println!(
            "# simulated allgather: {} nodes x {} ranks, {} B per rank, {} late ranks, {} seeds \
             from {:#x} (virtual time)",
            o.nodes, o.ranks_per_node, block_bytes, o.late_ranks, o.seeds, o.seed
        );
        print_header(&ALLGATHER_COLUMNS);
    }
    for &k in &o.sps_per_node {
        for &layout in &o.layouts {
            let mut row = Row {
                point: o.point("allgather", k, layout),
                late_ranks: o.late_ranks,
                block_bytes,
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
                cfg.max_block_bytes = block_bytes;
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
                print_row(
                    &ALLGATHER_COLUMNS,
                    [
                        k.to_string(),
                        row.point.layout.to_string(),
                        format!("{:.1}", row.mean_completion_us),
                        row.inter_node_bytes.to_string(),
                        row.min_inter_node_bytes.to_string(),
                        row.no_ready_rank.to_string(),
                        row.served_after_pass.to_string(),
                        row.parked.to_string(),
                    ],
                );
            }
        }
    }
    Ok(())
}

const BCAST_COLUMNS: Columns<8> = [
    ("sps", 4),
    ("layout", 7),
    ("design", 6),
    ("completion_us", 14),
    ("sp_completion_us", 17),
    ("inter_node_B", 14),
    ("min_inter_B", 14),
    ("hier/flat", 10),
];

#[derive(Serialize)]
struct BcastRow {
    #[serde(flatten)]
    point: Point,
    design: &'static str,
    root: u32,
    bcast_bytes: u64,
    chunk_bytes: u64,
    slots: u32,
    late_ranks: u32,
    runs: u32,
    /// Mean over seeds of `end_ns`: the last rank with the message in its own buffer (for hier,
    /// after the host's copy out of the node segment).
    mean_completion_us: f64,
    /// Mean over seeds of `sp_end_ns`: the last completion an SP emitted.
    mean_sp_completion_us: f64,
    /// Per run (the largest over seeds; fault-free runs all move the same).
    inter_node_bytes: u64,
    /// Per run: `bcast_bytes * (nodes - 1)`, each chunk crossing each node boundary once.
    min_inter_node_bytes: u64,
    /// hier's mean completion over flat's, on the hier row (`null` on the flat row).
    hier_over_flat: Option<f64>,
}

/// The bcast simulator gives every rank a real buffer of the message's size (1 GiB per run at
/// 32x32 and 1 MiB) and frees them when the run ends. By default glibc serves such blocks with
/// mmap, or trims them off the heap, and hands the memory back to the kernel, so every run paid
/// a page fault per 4 KiB again: most of its time (about 1.3 s of a run's 1.6 s here). Keeping
/// freed memory in the heap lets the runs after the first reuse it (about 0.8 s a run).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() {
    // SAFETY: mallopt only changes glibc's thresholds for later allocations and frees; nothing
    // else allocates concurrently (this is the whole process, single-threaded).
    unsafe {
        // 32 MiB: the largest mmap threshold glibc accepts on 64-bit targets.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory() {}

fn simulate_bcast(o: &SimulateOpts) -> Result<()> {
    let len = o.bcast_bytes.unwrap_or(DEFAULT_BCAST_BYTES);
    let chunk = o.chunk_bytes.unwrap_or(DEFAULT_CHUNK_BYTES);
    let slots = o.slots.unwrap_or(DEFAULT_SLOTS);
    let root = o.root.unwrap_or(DEFAULT_ROOT);
    let world = u64::from(o.nodes) * u64::from(o.ranks_per_node);
    if u64::from(root) >= world {
        bail!(
            "--root {root} is not a rank of {} nodes x {} ranks",
            o.nodes,
            o.ranks_per_node
        );
    }
    if chunk == 0 || slots == 0 {
        bail!("--chunk-bytes and --slots must be at least 1");
    }
    keep_freed_memory();
    if !o.json {
        println!(
            "# simulated bcast: {} nodes x {} ranks, root {}, {} B, {} B chunks, {} slots, {} late \
             ranks, {} seeds from {:#x} (virtual time)",
            o.nodes, o.ranks_per_node, root, len, chunk, slots, o.late_ranks, o.seeds, o.seed
        );
        print_header(&BCAST_COLUMNS);
    }
    for &k in &o.sps_per_node {
        for &layout in &o.layouts {
            let mut rows = Vec::with_capacity(2);
            for design in [Design::Flat, Design::Hier] {
                let mut row = BcastRow {
                    point: o.point("bcast", k, layout),
                    design: match design {
                        Design::Flat => "flat",
                        Design::Hier => "hier",
                    },
                    root,
                    bcast_bytes: len,
                    chunk_bytes: chunk,
                    slots,
                    late_ranks: o.late_ranks,
                    runs: o.seeds,
                    mean_completion_us: 0.0,
                    mean_sp_completion_us: 0.0,
                    inter_node_bytes: 0,
                    min_inter_node_bytes: 0,
                    hier_over_flat: None,
                };
                for i in 0..o.seeds {
                    // As the 32x32 runs of `algorithms/tests/sim_bcast.rs` (`big`): one
                    // collective, a fixed root and length, the simulator's default arrival skew
                    // (20 us); the late ranks are --late-ranks (the simulator's default: 2).
                    let seed = o.seed.wrapping_add(i as u64);
                    let mut cfg = bcast::SimConfig::new(seed);
                    cfg.nodes = o.nodes;
                    cfg.ranks_per_node = o.ranks_per_node;
                    cfg.sps_per_node = k;
                    cfg.layout = layout;
                    cfg.design = design;
                    cfg.ops = 1;
                    cfg.root = Some(root);
                    cfg.len_bytes = Some(len);
                    cfg.chunk_bytes = chunk;
                    cfg.staging_slots = slots;
                    cfg.late_ranks = o.late_ranks;
                    let what = format!(
                        "bcast simulation failed ({} SPs per node, {} layout, {} design)",
                        k, row.point.layout, row.design
                    );
                    let r = bcast::run(&cfg).map_err(|e| anyhow!("{what}: {e}"))?;
                    if r.error_completions != 0 {
                        bail!(
                            "{what}: seed={seed:#018x} : {} ranks completed with an error in a \
                             fault-free run",
                            r.error_completions
                        );
                    }
                    row.mean_completion_us += r.end_ns as f64 / 1e3 / o.seeds as f64;
                    row.mean_sp_completion_us += r.sp_end_ns as f64 / 1e3 / o.seeds as f64;
                    row.inter_node_bytes = row.inter_node_bytes.max(r.bytes_moved_inter_node);
                    row.min_inter_node_bytes = r.min_inter_node_bytes;
                }
                rows.push(row);
            }
            if rows[0].mean_completion_us > 0.0 {
                rows[1].hier_over_flat =
                    Some(rows[1].mean_completion_us / rows[0].mean_completion_us);
            }
            for row in &rows {
                if o.json {
                    println!("{}", serde_json::to_string(row)?);
                } else {
                    print_row(
                        &BCAST_COLUMNS,
                        [
                            k.to_string(),
                            row.point.layout.to_string(),
                            row.design.to_string(),
                            format!("{:.1}", row.mean_completion_us),
                            format!("{:.1}", row.mean_sp_completion_us),
                            row.inter_node_bytes.to_string(),
                            row.min_inter_node_bytes.to_string(),
                            row.hier_over_flat
                                .map_or_else(|| "-".to_string(), |x| format!("{x:.3}")),
                        ],
                    );
                }
            }
        }
    }
    Ok(())
}
