//! `coll-bench traffic`: inter-node bytes per Allgatherv call, a ring written here with plain
//! `MPI_Sendrecv` against the (offloaded) `MPI_Allgatherv`, and the minimum. See
//! `coll-bench traffic --help`; the pure parts are in `coll_bench::traffic`.

use crate::run::{self, fail};
use clap::{Args, ValueEnum};
use coll_bench::mpi::{Comm, Datatype, Mpi, MpiError};
use coll_bench::traffic::{
    min_inter_node_bytes, per_call, ring_step, InterNodeCounter, NodeMap, SpTotals,
};
use coll_bench::{parse_size, pattern};
use mpi_ffi::consts;
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const ALL_PEERS: u32 = u32::MAX;
/// Tag of the ring's point-to-point messages.
const RING_TAG: i32 = 0x7261;

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrafficColl {
    /// MPI_Allgatherv, every rank contributes SIZE bytes
    Allgatherv,
    /// MPI_Allgather, every rank contributes SIZE bytes
    Allgather,
}

impl TrafficColl {
    fn name(self) -> &'static str {
        match self {
            TrafficColl::Allgatherv => "allgatherv",
            TrafficColl::Allgather => "allgather",
        }
    }
}

#[derive(Args, Debug)]
pub struct TrafficArgs {
    /// The collective whose offloaded call is measured (blocking). The ring is the same for
    /// both.
    #[arg(long, value_enum)]
    coll: TrafficColl,
    /// Comma-separated sizes in bytes per rank (equal counts); K/M suffixes are 1024-based.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "64K,1M")]
    sizes: Vec<usize>,
    /// Calls per size, for the ring and for the collective; the figures are per call.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Also write one JSON object per size per line (rank 0 only).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// The `service-process` binary whose `stats` reads the SPs' counters [default: env
    /// SPOFF_SERVICE_PROCESS, else `service-process` next to this executable].
    #[arg(long, value_name = "PATH")]
    service_process: Option<PathBuf>,
}

/// Where the ranks live, whether the shim offloads, and how to read the SPs.
struct Env {
    map: NodeMap,
    /// The cluster description and its number of SPs, when the shim offloads.
    offload: Option<(PathBuf, usize)>,
    /// Why there are no SP figures, when `offload` is `None`.
    native_reason: String,
    sp_bin: PathBuf,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn environment(args: &TrafficArgs) -> Result<Env, String> {
    let env_map = NodeMap::from_env_values(
        var("SPOFF_NODES").as_deref(),
        var("SPOFF_RANKS_PER_NODE").as_deref(),
        var("SPOFF_LAYOUT").as_deref(),
    )?;
    let shim = var("LD_PRELOAD").is_some_and(|p| p.contains("host_shim"));
    let off = var("SPOFF_OFFLOAD").is_some_and(|v| v == "0");
    let cluster = var("SPOFF_CLUSTER").map(PathBuf::from);
    let mut map = env_map;
    let mut offload = None;
    if let Some(path) = &cluster {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read SPOFF_CLUSTER={}: {e}", path.display()))?;
        let (m, sps) = NodeMap::from_cluster_json(&text)?;
        // The launcher exports both; if they disagree, the counting here would not be the
        // SPs' (their placement comes from the file).
        if var("SPOFF_NODES").is_some() && (m.nodes != env_map.nodes || m.layout != env_map.layout)
        {
            return Err(format!(
                "{} says {} nodes, {}; the environment says {} nodes, {}",
                path.display(),
                m.nodes,
                m.layout.name(),
                env_map.nodes,
                env_map.layout.name()
            ));
        }
        map = m;
        if shim && !off {
            offload = Some((path.clone(), sps));
        }
    }
    let native_reason = if off {
        "SPOFF_OFFLOAD=0: the shim runs the call natively"
    } else if !shim {
        "the host shim is not preloaded: a native run"
    } else {
        "SPOFF_CLUSTER is not set: the shim runs the call natively"
    }
    .to_string();
    let sp_bin = match (&args.service_process, var("SPOFF_SERVICE_PROCESS")) {
        (Some(p), _) => p.clone(),
        (None, Some(p)) => PathBuf::from(p),
        (None, None) => std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(|d| d.join("service-process")))
            .unwrap_or_else(|| PathBuf::from("service-process")),
    };
    Ok(Env {
        map,
        offload,
        native_reason,
        sp_bin,
    })
}

/// `service-process stats --cluster FILE --json`, summed over the SPs.
fn read_stats(sp_bin: &Path, cluster: &Path, sps: usize) -> Result<SpTotals, String> {
    let out = Command::new(sp_bin)
        .args(["stats", "--json", "--cluster"])
        .arg(cluster)
        // Not the shim (and its libmpi) in a process that is not an MPI rank.
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {} stats: {e}", sp_bin.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} stats failed ({}): {}",
            sp_bin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    SpTotals::parse(&String::from_utf8_lossy(&out.stdout), Some(sps))
}

/// Block `a` for reading and block `b` (a different one) for writing, of `size` bytes each.
fn two_blocks(buf: &mut [u8], a: usize, b: usize, size: usize) -> (&[u8], &mut [u8]) {
    assert_ne!(a, b);
    if a < b {
        let (lo, hi) = buf.split_at_mut(b * size);
        (&lo[a * size..(a + 1) * size], &mut hi[..size])
    } else {
        let (lo, hi) = buf.split_at_mut(a * size);
        (&hi[..size], &mut lo[b * size..(b + 1) * size])
    }
}

fn check_blocks(
    what: &str,
    coll: TrafficColl,
    recv: &[u8],
    size: usize,
    me: usize,
    iter: u64,
) -> bool {
    let n = recv.len() / size.max(1);
    let mut ok = true;
    for peer in 0..n {
        let block = &recv[peer * size..(peer + 1) * size];
        if let Some((off, exp, got)) = pattern::first_mismatch(block, peer as u32, ALL_PEERS, iter)
        {
            eprintln!(
                "coll-bench traffic: VALIDATION FAILED: {what} ({}) bytes={size} rank={me} \
                 peer={peer} offset={off} expected=0x{exp:02x} got=0x{got:02x}",
                coll.name()
            );
            ok = false;
        }
    }
    ok
}

struct Row {
    ring_per_call: u64,
    offload: Result<SpTotals, String>,
    min: u64,
    validated: bool,
}

fn run_size(
    world: Comm,
    env: &Env,
    node_of: &[u32],
    coll: TrafficColl,
    size: usize,
    iters: u32,
) -> Result<Row, MpiError> {
    let me = world.rank()? as usize;
    let n = world.size()? as usize;
    let byte = Datatype::byte()?;
    let mut send = vec![0u8; size.max(1)];
    // Never empty (see `overlap`): MPI rejects sendbuf == recvbuf even for zero counts.
    let mut recv = vec![0u8; (n * size).max(1)];
    let counts = vec![size as i32; n];
    let displs: Vec<i32> = (0..n).map(|j| (j * size) as i32).collect();
    let (left, right) = ((me + n - 1) % n, (me + 1) % n);
    let mut ok = true;

    // 1. The ring: P - 1 steps, each rank passes on what it received in the step before.
    let mut counter = InterNodeCounter::default();
    for it in 0..iters {
        let iter_id = (1u64 << 32) | it as u64;
        pattern::fill(&mut send[..size], me as u32, ALL_PEERS, iter_id);
        recv.fill(0xA5);
        recv[me * size..(me + 1) * size].copy_from_slice(&send[..size]);
        for s in 0..n.saturating_sub(1) {
            let (sb, rb) = ring_step(me, n, s);
            let (out, inp) = two_blocks(&mut recv, sb, rb, size);
            world.sendrecv(out, right as i32, inp, left as i32, RING_TAG)?;
            counter.sent(node_of, me, right, size as u64);
        }
        ok &= check_blocks("ring", coll, &recv[..n * size], size, me, iter_id);
    }
    let ring_total = world.allreduce_u64(counter.bytes, consts::OP_SUM())?;

    // 2. The collective itself, with the SPs' counters read around it by rank 0.
    let stats = |label: &str| -> Option<Result<SpTotals, String>> {
        let (cluster, sps) = env.offload.as_ref()?;
        (me == 0).then(|| {
            read_stats(&env.sp_bin, cluster, *sps)
                .map_err(|e| format!("reading the SP counters {label} the calls: {e}"))
        })
    };
    world.barrier()?;
    let before = stats("before");
    world.barrier()?;
    for it in 0..iters {
        let iter_id = (2u64 << 32) | it as u64;
        pattern::fill(&mut send[..size], me as u32, ALL_PEERS, iter_id);
        recv.fill(0xA5);
        match coll {
            TrafficColl::Allgatherv => {
                world.allgatherv(&send, size as i32, &mut recv, &counts, &displs, &byte)?
            }
            TrafficColl::Allgather => world.allgather(&send, &mut recv, size as i32, &byte)?,
        }
        ok &= check_blocks(coll.name(), coll, &recv[..n * size], size, me, iter_id);
    }
    world.barrier()?;
    let after = stats("after");
    let offload = match (before, after) {
        (Some(b), Some(a)) => b.and_then(|b| a?.since(&b)).and_then(|d| {
            if d.posts == 0 {
                Err(
                    "the SPs received no posts during the calls: the shim did not offload \
                     them"
                        .to_string(),
                )
            } else {
                Ok(d)
            }
        }),
        _ => Err(env.native_reason.clone()),
    };
    let validated = world.all_true(ok)?;
    Ok(Row {
        ring_per_call: ring_total / iters as u64,
        offload,
        min: min_inter_node_bytes(node_of, &vec![size as u64; n]),
        validated,
    })
}

pub fn traffic(args: TrafficArgs) -> i32 {
    let env = match environment(&args) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("coll-bench traffic: {e}");
            return 2;
        }
    };
    let Some(mpi) = run::init() else {
        return 1;
    };
    let world = mpi.world();
    let me = world.rank().unwrap_or_else(|e| fail(e));
    let ranks = world.size().unwrap_or_else(|e| fail(e)) as usize;
    let checked = match args
        .sizes
        .iter()
        .find(|&&s| !matches!(s.checked_mul(ranks), Some(t) if t <= i32::MAX as usize))
    {
        Some(&bad) => Err(format!(
            "size {bad} x {ranks} ranks does not fit MPI int displacements"
        )),
        None => env.map.nodes_of(ranks as u32),
    };
    let node_of = match checked {
        Ok(v) => v,
        Err(e) => {
            if me == 0 {
                eprintln!("coll-bench traffic: {e}");
            }
            let _ = mpi.finalize();
            return 2;
        }
    };
    let mode = if env.offload.is_some() {
        "offload"
    } else {
        "native"
    };
    let mut json = None;
    if me == 0 {
        json = run::create_json(&args.json);
        println!(
            "# coll-bench traffic: coll={} ranks={ranks} nodes={} layout={} mode={mode} \
             iters={}; inter-node bytes per call: ring (MPI_Sendrecv, counted by the ranks), \
             offload (SP counters bytes_inter_node), min (computed: sum of blocks x (nodes with \
             members - 1))",
            args.coll.name(),
            env.map.nodes,
            env.map.layout.name(),
            args.iters
        );
        if env.offload.is_none() {
            println!("# offload_B: none ({})", env.native_reason);
        }
        println!(
            "{:>10} {:>12} {:>12} {:>12} {:>9} {:>12} {:>9}",
            "bytes", "ring_B", "offload_B", "min_B", "ring/min", "offload/min", "validated"
        );
    }
    let mut all_ok = true;
    for &size in &args.sizes {
        let row = run_size(world, &env, &node_of, args.coll, size, args.iters)
            .unwrap_or_else(|e| fail(e));
        all_ok &= row.validated;
        if me != 0 {
            continue;
        }
        let (off, posts, note) = match &row.offload {
            Ok(d) => (
                per_call(d.bytes_inter_node, args.iters),
                per_call(d.posts, args.iters),
                Value::Null,
            ),
            Err(why) => (Value::Null, Value::Null, Value::from(why.as_str())),
        };
        if env.offload.is_some() {
            if let Err(why) = &row.offload {
                eprintln!("coll-bench traffic: no offload figure for {size} bytes: {why}");
            }
        }
        let ratio = |v: Option<f64>| match v {
            Some(v) if row.min > 0 => format!("{:.2}", v / row.min as f64),
            _ => "-".into(),
        };
        println!(
            "{:>10} {:>12} {:>12} {:>12} {:>9} {:>12} {:>9}",
            size,
            row.ring_per_call,
            if off.is_null() {
                "-".to_string()
            } else {
                off.to_string()
            },
            row.min,
            ratio(Some(row.ring_per_call as f64)),
            ratio(off.as_f64()),
            row.validated
        );
        let _ = std::io::stdout().flush();
        if let Some(f) = json.as_mut() {
            let line = serde_json::json!({
                "coll": args.coll.name(),
                "bytes": size,
                "ranks": ranks,
                "nodes": env.map.nodes,
                "layout": env.map.layout.name(),
                "ring_inter_node_bytes": row.ring_per_call,
                "offload_inter_node_bytes": off,
                "min_inter_node_bytes": row.min,
                "validated": row.validated,
                "iters": args.iters,
                "mode": mode,
                "offload_posts": posts,
                "offload_note": note,
            });
            if writeln!(f, "{line}").is_err() {
                eprintln!("coll-bench: writing JSON failed");
                Mpi::abort(2);
            }
        }
    }
    if me == 0 && !all_ok {
        eprintln!("coll-bench traffic: validation failed for at least one size (see above)");
    }
    run::finish(mpi, all_ok)
}
