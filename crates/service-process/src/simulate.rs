//! `service-process simulate`: runs the deterministic simulators of `algorithms` at scales this
//! machine cannot run for real (e.g. 32 nodes x 32 ranks) and prints what the designs promise:
//! completion time against SPs per node, block against cyclic layout, and inter-node bytes
//! against the minimum; for the staged bcast also flat against hierarchical delivery. Virtual
//! time and the cost model are the simulator's (`algorithms::sim::CostModel`); the figures are
//! simulated, not measured.

use algorithms::bcast::Design;
use algorithms::sim::allgatherv::{run, SimConfig};
use algorithms::sim::host_ring::run_ring;
use algorithms::sim::{bcast, CostModel, Layout};
use anyhow::{anyhow, bail, Result};
use serde::Serialize;

/// The collective to simulate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Coll {
    /// The hierarchical, load-balanced allgather (`algorithms::sim::allgatherv`).
    Allgather,
    /// The staged bcast, flat and hierarchical (`algorithms::sim::bcast`).
    Bcast,
    /// The tail after the last arrival: the hierarchical allgather against a host-based ring
    /// (`algorithms::sim::host_ring`) on the same blocks and arrivals.
    Tail,
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
    /// Allgather and tail: bytes each rank contributes (the simulator keeps real buffers: keep
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
    /// How late the late ranks are, in microseconds [default: the simulator's, 100]
    #[arg(long)]
    pub late_delay_us: Option<u64>,
    /// Cost model fields to change, `name=value,...` (the fields of
    /// `algorithms::sim::CostModel`: inter_node_latency_ns, intra_node_latency_ns, msg_proc_ns,
    /// copy_fixed_inter_ns, copy_fixed_intra_ns, inter_node_bytes_per_ns,
    /// intra_node_bytes_per_ns, msg_header_bytes, post_ns, byte_weight); the others keep their
    /// defaults.
    #[arg(long, value_name = "FIELD=VALUE,...", value_delimiter = ',')]
    pub cost: Vec<String>,
    /// Tail only: fields changed for the host ring on top of --cost [default: none, the same
    /// cost model as the offloaded allgather]
    #[arg(long, value_name = "FIELD=VALUE,...", value_delimiter = ',')]
    pub ring_cost: Vec<String>,
    /// Allgather and tail: copies in flight per SP [default: the simulator's, 4]
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub inflight: Option<u64>,
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

/// The default cost model with the `name=value` changes of `changes`.
pub fn cost_model(base: CostModel, changes: &[String]) -> Result<CostModel> {
    let mut v = serde_json::to_value(base)?;
    let fields = v.as_object_mut().expect("a struct serializes as a map");
    for c in changes {
        let (name, value) = c
            .split_once('=')
            .ok_or_else(|| anyhow!("--cost {c:?}: expected FIELD=VALUE"))?;
        let value: u64 = value
            .trim()
            .parse()
            .map_err(|_| anyhow!("--cost {c:?}: the value is not a non-negative integer"))?;
        match fields.get_mut(name.trim()) {
            Some(f) => *f = value.into(),
            None => bail!(
                "--cost {c:?}: no such field (the fields: {})",
                fields.keys().cloned().collect::<Vec<_>>().join(", ")
            ),
        }
    }
    let m: CostModel = serde_json::from_value(v)?;
    if m.inter_node_bytes_per_ns == 0 || m.intra_node_bytes_per_ns == 0 || m.byte_weight == 0 {
        bail!("--cost: bandwidths and byte_weight must be at least 1");
    }
    Ok(m)
}

pub fn simulate(o: &SimulateOpts) -> Result<()> {
    if o.seeds == 0 {
        return Err(anyhow!("--seeds must be at least 1"));
    }
    let cost = cost_model(CostModel::default(), &o.cost)?;
    if o.coll != Coll::Tail && !o.ring_cost.is_empty() {
        bail!("--ring-cost applies to --coll tail only");
    }
    if o.coll == Coll::Bcast && (o.inflight.is_some() || o.late_delay_us.is_some()) {
        bail!("--inflight and --late-delay-us apply to --coll allgather and tail only");
    }
    if o.coll != Coll::Bcast {
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
    }
    match o.coll {
        Coll::Tail => {
            let ring_cost = cost_model(cost, &o.ring_cost)?;
            simulate_tail(
                o,
                o.block_bytes.unwrap_or(DEFAULT_BLOCK_BYTES),
                cost,
                ring_cost,
            )
        }
        Coll::Allgather => {
            simulate_allgather(o, o.block_bytes.unwrap_or(DEFAULT_BLOCK_BYTES), cost)
        }
        Coll::Bcast => {
            if o.block_bytes.is_some() {
                bail!("--block-bytes applies to --coll allgather and tail only");
            }
            simulate_bcast(o, cost)
        }
    }
}

/// The allgather simulator's config for one run of `o` (allgather and tail).
fn allgather_config(
    o: &SimulateOpts,
    seed: u64,
    (k, layout): (u32, Layout),
    block_bytes: u64,
    cost: CostModel,
) -> SimConfig {
    let mut cfg = SimConfig::new(seed);
    cfg.nodes = o.nodes;
    cfg.ranks_per_node = o.ranks_per_node;
    cfg.sps_per_node = k;
    cfg.layout = layout;
    cfg.max_block_bytes = block_bytes;
    cfg.equal_counts = true;
    cfg.zero_block_percent = 0;
    cfg.late_ranks = o.late_ranks;
    if let Some(us) = o.late_delay_us {
        cfg.late_delay_ns = us * 1_000;
    }
    if let Some(n) = o.inflight {
        cfg.max_inflight_reads = n as usize;
    }
    cfg.cost = cost;
    cfg
}

const TAIL_COLUMNS: Columns<8> = [
    ("sps", 4),
    ("layout", 7),
    ("last_arrival_us", 16),
    ("offload_tail_us", 16),
    ("ring_tail_us", 13),
    ("tail_ratio", 11),
    ("no_ready", 9),
    ("parked", 7),
];

#[derive(Serialize)]
struct TailRow {
    #[serde(flatten)]
    point: Point,
    late_ranks: u32,
    late_delay_us: f64,
    block_bytes: u64,
    /// Bytes a block stands for in the costs (block_bytes x byte_weight).
    priced_block_bytes: u64,
    max_inflight_reads: usize,
    runs: u32,
    /// Means over the seeds: the last rank's arrival, and each algorithm's last completion
    /// minus it.
    mean_last_arrival_us: f64,
    mean_offload_tail_us: f64,
    mean_ring_tail_us: f64,
    /// mean_offload_tail_us / mean_ring_tail_us (below 1: the offload ends sooner after the
    /// last arrival).
    tail_ratio: f64,
    no_ready_rank: u64,
    parked: u64,
    cost: CostModel,
    ring_cost: CostModel,
}

fn simulate_tail(
    o: &SimulateOpts,
    block_bytes: u64,
    cost: CostModel,
    ring_cost: CostModel,
) -> Result<()> {
    let delay_ns = o
        .late_delay_us
        .map_or(SimConfig::new(0).late_delay_ns, |us| us * 1_000);
    if !o.json {
        println!(
            "# simulated allgather tail after the last arrival: {} nodes x {} ranks, {} B per rank \
             (priced as {} B), {} late ranks {} us late, {} seeds from {:#x} (virtual time); \
             offload = hierarchical allgather, ring = host-based ring",
            o.nodes,
            o.ranks_per_node,
            block_bytes,
            block_bytes * cost.byte_weight,
            o.late_ranks,
            delay_ns / 1_000,
            o.seeds,
            o.seed
        );
        println!("# cost: {cost:?}");
        if ring_cost != cost {
            println!("# ring cost: {ring_cost:?}");
        }
        print_header(&TAIL_COLUMNS);
    }
    for &k in &o.sps_per_node {
        for &layout in &o.layouts {
            let mut row = TailRow {
                point: o.point("tail", k, layout),
                late_ranks: o.late_ranks,
                late_delay_us: delay_ns as f64 / 1e3,
                block_bytes,
                priced_block_bytes: block_bytes * cost.byte_weight,
                max_inflight_reads: 0,
                runs: o.seeds,
                mean_last_arrival_us: 0.0,
                mean_offload_tail_us: 0.0,
                mean_ring_tail_us: 0.0,
                tail_ratio: 0.0,
                no_ready_rank: 0,
                parked: 0,
                cost,
                ring_cost,
            };
            for i in 0..o.seeds {
                let seed = o.seed.wrapping_add(i as u64);
                let cfg = allgather_config(o, seed, (k, layout), block_bytes, cost);
                row.max_inflight_reads = cfg.max_inflight_reads;
                let r = run(&cfg).map_err(|e| anyhow!("simulation failed: {e}"))?;
                let mut ring_cfg = cfg;
                ring_cfg.cost = ring_cost;
                let g = run_ring(&ring_cfg).map_err(|e| anyhow!("ring simulation failed: {e}"))?;
                if g.last_arrival_ns != r.last_arrival_ns {
                    bail!(
                        "seed={seed:#018x} : the ring's last arrival {} ns differs from the                          offload's {} ns",
                        g.last_arrival_ns,
                        r.last_arrival_ns
                    );
                }
                let n = o.seeds as f64;
                row.mean_last_arrival_us += r.last_arrival_ns as f64 / 1e3 / n;
                row.mean_offload_tail_us +=
                    r.end_ns.saturating_sub(r.last_arrival_ns) as f64 / 1e3 / n;
                row.mean_ring_tail_us +=
                    g.end_ns.saturating_sub(g.last_arrival_ns) as f64 / 1e3 / n;
                row.no_ready_rank += r.stats.no_ready_rank;
                row.parked += r.stats.parked;
            }
            if row.mean_ring_tail_us > 0.0 {
                row.tail_ratio = row.mean_offload_tail_us / row.mean_ring_tail_us;
            }
            if o.json {
                println!("{}", serde_json::to_string(&row)?);
            } else {
                print_row(
                    &TAIL_COLUMNS,
                    [
                        k.to_string(),
                        row.point.layout.to_string(),
                        format!("{:.1}", row.mean_last_arrival_us),
                        format!("{:.1}", row.mean_offload_tail_us),
                        format!("{:.1}", row.mean_ring_tail_us),
                        format!("{:.3}", row.tail_ratio),
                        row.no_ready_rank.to_string(),
                        row.parked.to_string(),
                    ],
                );
            }
        }
    }
    Ok(())
}

fn simulate_allgather(o: &SimulateOpts, block_bytes: u64, cost: CostModel) -> Result<()> {
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
                let seed = o.seed.wrapping_add(i as u64);
                let cfg = allgather_config(o, seed, (k, layout), block_bytes, cost);
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

fn simulate_bcast(o: &SimulateOpts, cost: CostModel) -> Result<()> {
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
                    cfg.cost = cost;
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
