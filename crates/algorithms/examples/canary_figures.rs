//! The Canary paper's simulated figures (§5.2) from `algorithms::canary::sim`: per point,
//! min/median/max over random placements, and the simulator's own speed.
//!
//! `cargo run --release -p algorithms --example canary_figures -- [--fig 7a|8|9|10a]
//!  [--placements 5] [--first-placement 0] [--seed S] [--points a,b,c] [--leaves 32] [--algos ring,st1,st4,canary]
//!  [--window blocks|st=B,canary=B] [--timeout ns] [--buffer bytes] [--unicast adaptive|static]
//!  [--out-buf bytes] [--hol on|off] [--bg perm|uniform]`
//!
//! `--window` is the blocks each member keeps in flight, for every design or per design (`st`:
//! the static trees; the ring has none); by default 64 for the trees and 512 for Canary (see
//! `BDP_WINDOWS`).

use std::time::Instant;

use algorithms::canary::sim::{run, Algo, BgPattern, Faults, Job, NetConfig, Report, Scenario};
use algorithms::sim::rng::Rng;

struct Args {
    fig: String,
    placements: usize,
    /// The first placement's number: placement `p` is seeded `seed * 1000 + p`, so a run with
    /// `--first-placement 2 --placements 3` adds placements 2-4 to one of 0-1.
    first_placement: usize,
    seed: u64,
    points: Option<Vec<String>>,
    leaves: usize,
    algos: Option<Vec<String>>,
    /// Blocks in flight per member: (static trees, Canary).
    window: (usize, usize),
    timeout: Option<u64>,
    buffer: Option<u64>,
    bg_static: bool,
    out_buf: Option<u64>,
    hol: bool,
    bg: BgPattern,
}

const USAGE: &str = "usage: canary_figures [--fig 7a|8|9|10a] [--placements 5] [--first-placement 0] [--seed 1] \
[--points a,b,c] [--leaves 32 (as many hosts per leaf and spines: 1024 hosts)] [--algos ring,st1,st4,canary] \
[--window blocks|st=B,canary=B (default st=64,canary=512)] [--timeout ns] [--buffer bytes] \
[--unicast adaptive|static] [--out-buf bytes] [--hol on|off] [--bg perm|uniform]";

fn args() -> Args {
    let mut a = Args {
        fig: "7a".into(),
        placements: 5,
        first_placement: 0,
        seed: 1,
        points: None,
        leaves: 32,
        algos: None,
        window: BDP_WINDOWS,
        timeout: None,
        buffer: None,
        bg_static: false,
        out_buf: None,
        hol: false,
        bg: BgPattern::Permutation,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        let val = v.get(i + 1).cloned().unwrap_or_default();
        match v[i].as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "--fig" => a.fig = val,
            "--placements" => a.placements = val.parse().expect("--placements N"),
            "--first-placement" => a.first_placement = val.parse().expect("--first-placement P"),
            "--seed" => a.seed = val.parse().expect("--seed S"),
            "--points" => a.points = Some(val.split(',').map(String::from).collect()),
            "--leaves" => a.leaves = val.parse().expect("--leaves N"),
            "--window" => a.window = windows(&val),
            "--timeout" => a.timeout = Some(val.parse().expect("--timeout ns")),
            "--buffer" => a.buffer = Some(val.parse().expect("--buffer bytes")),
            "--out-buf" => a.out_buf = Some(val.parse().expect("--out-buf bytes")),
            "--hol" => {
                a.hol = match val.as_str() {
                    "on" => true,
                    "off" => false,
                    _ => panic!("--hol on|off"),
                }
            }
            "--bg" => {
                a.bg = match val.as_str() {
                    "perm" => BgPattern::Permutation,
                    "uniform" => BgPattern::Uniform,
                    _ => panic!("--bg perm|uniform"),
                }
            }
            "--algos" => a.algos = Some(val.split(',').map(String::from).collect()),
            "--unicast" => {
                a.bg_static = match val.as_str() {
                    "adaptive" => false,
                    "static" => true,
                    _ => panic!("--unicast adaptive|static"),
                }
            }
            o => {
                eprintln!("canary_figures: unknown argument {o}\n{USAGE}");
                std::process::exit(2);
            }
        }
        i += 2;
    }
    a
}

/// Blocks in flight per member by default: about the bandwidth-delay product of each design's
/// round trip at the paper's 1024 hosts (the paper, §3.2: "the bandwidth-delay product bounds
/// the number of in-flight blocks"): the fewest tried that reached 95 % of the goodput of the
/// whole vector in flight without congestion (docs/BENCHMARKS.md N, "Blocks in flight").
/// Canary's round trip holds its aggregation windows, so it needs more; at 256 hosts 256
/// blocks were enough for it.
const BDP_WINDOWS: (usize, usize) = (64, 512);

/// `--window B` (every design) or `--window st=B,canary=B` (either may be left out).
fn windows(val: &str) -> (usize, usize) {
    let blocks = |v: &str| -> usize {
        match v.parse() {
            Ok(b) if b > 0 => b,
            _ => panic!("--window: {v:?} is not a number of blocks above 0"),
        }
    };
    if !val.contains('=') {
        let b = blocks(val);
        return (b, b);
    }
    let mut w = BDP_WINDOWS;
    for part in val.split(',') {
        match part.split_once('=') {
            Some(("st", v)) => w.0 = blocks(v),
            Some(("canary", v)) => w.1 = blocks(v),
            _ => panic!("--window blocks, or st=blocks,canary=blocks; not {part:?}"),
        }
    }
    w
}

fn algos(a: &Args) -> Vec<Algo> {
    let all = [
        Algo::Ring,
        Algo::StaticTrees(1),
        Algo::StaticTrees(4),
        Algo::Canary,
    ];
    match &a.algos {
        None => all.to_vec(),
        Some(names) => all
            .into_iter()
            .filter(|x| {
                let n = match x {
                    Algo::Ring => "ring",
                    Algo::StaticTrees(1) => "st1",
                    Algo::StaticTrees(_) => "st4",
                    Algo::Canary => "canary",
                };
                names.iter().any(|m| m == n)
            })
            .collect(),
    }
}

struct Speed {
    events: u64,
    wall: f64,
}

/// `share` of the hosts in `jobs` equal allreduces of `len` bytes, the rest congesting (or idle).
fn scenario(
    net: &NetConfig,
    algo: Algo,
    share: f64,
    jobs: usize,
    len: usize,
    congest: bool,
    seed: u64,
) -> Scenario {
    let mut rng = Rng::new(seed);
    let mut hosts: Vec<u32> = (0..net.hosts() as u32).collect();
    rng.shuffle(&mut hosts);
    let k = ((net.hosts() as f64 * share).round() as usize).max(2 * jobs);
    let per = k / jobs;
    let jobs: Vec<Job> = (0..jobs)
        .map(|j| Job {
            members: hosts[j * per..(j + 1) * per].to_vec(),
            len,
        })
        .collect();
    let background = if congest {
        hosts[per * jobs.len()..].to_vec()
    } else {
        vec![]
    };
    Scenario {
        net: net.clone(),
        algo,
        jobs,
        background,
        faults: Faults::default(),
        seed: rng.next_u64(),
    }
}

fn one(sc: &Scenario, speed: &mut Speed) -> Report {
    let t = Instant::now();
    let r = run(sc);
    speed.wall += t.elapsed().as_secs_f64();
    speed.events += r.events;
    assert!(
        r.sound(),
        "{} seed {}: a wrong block or a hang: {:?}",
        sc.algo,
        sc.seed,
        r.jobs
            .iter()
            .map(|j| (j.ok_hosts, j.failed.len(), j.wrong_blocks, j.unfinished))
            .collect::<Vec<_>>()
    );
    r
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

fn main() {
    let a = args();
    // `--leaves N`: a smaller full-bisection tree, N leaves x N hosts, N spines.
    let mut net = NetConfig {
        leaves: a.leaves,
        hosts_per_leaf: a.leaves,
        spines: a.leaves,
        ..NetConfig::default()
    };
    (net.tree_window, net.window) = (Some(a.window.0), a.window.1);
    net.timeout = a.timeout.unwrap_or(net.timeout);
    net.buffer = a.buffer.unwrap_or(net.buffer);
    net.unicast_adaptive = !a.bg_static;
    net.out_buf = a.out_buf;
    net.hol = a.hol;
    net.bg_pattern = a.bg;
    println!(
        "# fig {} | {} leaves x {} hosts, {} spines, {} Gb/s, {} ns/hop, {} KiB credits/link, canary window {} ns, blocks in flight per member {} (static trees) {} (canary), background/ring up-ports {}, up-port rule reads {}, {}, background destinations {} | placements {} from {} seed {}",
        a.fig,
        net.leaves,
        net.hosts_per_leaf,
        net.spines,
        net.gbps,
        net.latency,
        net.buffer / 1024,
        net.timeout,
        a.window.0,
        a.window.1,
        if net.unicast_adaptive { "adaptive" } else { "static (dest mod k)" },
        match net.out_buf {
            Some(b) => format!("queues capped at a {b}-byte output buffer"),
            None => "whole queues".into(),
        },
        if net.hol {
            "input FIFOs with head-of-line blocking"
        } else {
            "routed on arrival"
        },
        match net.bg_pattern {
            BgPattern::Permutation => "a permutation per round",
            BgPattern::Uniform => "uniform per message",
        },
        a.placements,
        a.first_placement,
        a.seed
    );
    let mut speed = Speed {
        events: 0,
        wall: 0.0,
    };
    let algos = algos(&a);
    let mib4 = 4 << 20;
    // (label, share, jobs, len, congest, metric: goodput or runtime)
    let mut points: Vec<(String, f64, usize, usize, bool)> = Vec::new();
    let goodput;
    match a.fig.as_str() {
        "7a" => {
            goodput = true;
            points.push(("no congestion".into(), 0.5, 1, mib4, false));
            points.push(("congestion".into(), 0.5, 1, mib4, true));
        }
        "8" => {
            goodput = true;
            for pct in [5, 10, 25, 50, 75] {
                points.push((
                    format!("{pct}% allreduce"),
                    pct as f64 / 100.0,
                    1,
                    mib4,
                    true,
                ));
            }
        }
        "9" => {
            goodput = false;
            for (name, len) in [
                ("1KiB", 1 << 10),
                ("16KiB", 16 << 10),
                ("256KiB", 256 << 10),
                ("4MiB", mib4),
            ] {
                points.push((format!("{name} no congestion"), 0.2, 1, len, false));
                points.push((format!("{name} congestion"), 0.2, 1, len, true));
            }
        }
        "10a" => {
            goodput = true;
            for jobs in [1, 2, 4, 8, 16, 32] {
                points.push((format!("{jobs} concurrent"), 1.0, jobs, mib4, false));
            }
        }
        f => panic!("unknown figure {f}"),
    }
    if let Some(sel) = &a.points {
        points.retain(|p| sel.iter().any(|s| p.0.starts_with(s.as_str())));
    }
    let unit = if goodput {
        "Gb/s (goodput, mean over jobs)"
    } else {
        "us (runtime)"
    };
    println!("# point | algorithm | min / median / max {unit} | restarts, collisions, jobs failed (sums over placements)");
    for (label, share, jobs, len, congest) in &points {
        let mut medians = Vec::new();
        for &algo in &algos {
            let mut vals = Vec::new();
            let (mut restarts, mut coll, mut failed_jobs, mut hol) = (0, 0, 0, (0, 0));
            for p in a.first_placement..a.first_placement + a.placements {
                let sc = scenario(
                    &net,
                    algo,
                    *share,
                    *jobs,
                    *len,
                    *congest,
                    a.seed.wrapping_mul(1000).wrapping_add(p as u64),
                );
                let r = one(&sc, &mut speed);
                restarts += r.hosts.restarts;
                coll += r.switches.collisions;
                hol = (hol.0 + r.hol_waits, hol.1 + r.hol_held);
                // A job whose members failed (each with an error, never a wrong block: `one`
                // checked) counts in the failed column, not in the goodput.
                failed_jobs += r.jobs.iter().filter(|j| !j.failed.is_empty()).count();
                let ok: Vec<_> = r.jobs.iter().filter(|j| j.failed.is_empty()).collect();
                let v = if goodput {
                    ok.iter().map(|j| j.goodput_gbps).sum::<f64>() / ok.len().max(1) as f64
                } else {
                    r.jobs.iter().map(|j| j.runtime).max().unwrap() as f64 / 1000.0
                };
                vals.push(v);
            }
            let each: Vec<String> = vals.iter().map(|v| format!("{v:.1}")).collect();
            let (lo, med, hi) = stats(vals);
            medians.push((algo, med));
            let hol = if net.hol {
                format!(
                    " | head-of-line waits {}, of which held back a packet that could move {}",
                    hol.0, hol.1
                )
            } else {
                String::new()
            };
            println!("{label} | {algo} | {lo:.1} / {med:.1} / {hi:.1} | {restarts}, {coll}, {failed_jobs}{hol}");
            println!(
                "#   per placement, from placement {}: {}",
                a.first_placement,
                each.join(", ")
            );
            if std::env::var("CANARY_STATS").is_ok() {
                let sc = scenario(
                    &net,
                    algo,
                    *share,
                    *jobs,
                    *len,
                    *congest,
                    a.seed.wrapping_mul(1000),
                );
                let r = run(&sc);
                println!(
                    "#   {:?}\n#   {:?} dropped {} mean link load {:.1}%",
                    r.switches,
                    r.hosts,
                    r.dropped,
                    100.0 * r.link_bytes as f64 * 8.0
                        / net.gbps as f64
                        / r.end as f64
                        / r.links as f64
                );
            }
        }
        let canary = medians.iter().find(|m| m.0 == Algo::Canary).map(|m| m.1);
        if let Some(c) = canary {
            let rel: Vec<String> = medians
                .iter()
                .filter(|m| m.0 != Algo::Canary)
                .map(|m| {
                    format!(
                        "canary/{} = {:.2}",
                        m.0,
                        if goodput { c / m.1 } else { m.1 / c }
                    )
                })
                .collect();
            println!("{label} | speed-up of the median | {}", rel.join(", "));
        }
    }
    println!(
        "# simulator: {} events in {:.1} s wall = {:.2} M events/s",
        speed.events,
        speed.wall,
        speed.events as f64 / speed.wall / 1e6
    );
}
