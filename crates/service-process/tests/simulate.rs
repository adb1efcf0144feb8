//! `service-process simulate` runs the allgather or the bcast simulator and reports the
//! properties the designs promise; the allgather output stays as scripts/bench.sh reads it.

mod common;

use common::{json_lines_ok, stdout_ok};
use std::process::Command;

#[test]
fn simulate_reports_minimal_inter_node_bytes_for_both_layouts() {
    let mut args = SMALL_ALLGATHER.to_vec();
    args.push("--json");
    let rows = json_lines_ok(simulate(&args));
    assert_eq!(rows.len(), 4, "2 SP counts x 2 layouts: {rows:?}");
    for r in &rows {
        assert_eq!(r["inter_node_bytes"], r["min_inter_node_bytes"], "{r}");
        assert!(r["min_inter_node_bytes"].as_u64().unwrap() > 0, "{r}");
        assert!(r["mean_completion_us"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert!(
        rows.iter()
            .any(|r| r["no_ready_rank"].as_u64().unwrap() > 0),
        "{rows:?}"
    );
}

#[test]
fn simulate_tail_compares_the_offload_with_a_ring_on_the_same_arrivals() {
    let rows = json_lines_ok(simulate(&[
        "--coll",
        "tail",
        "--nodes",
        "4",
        "--ranks-per-node",
        "4",
        "--sps-per-node",
        "2",
        "--late-ranks",
        "2",
        "--late-delay-us",
        "500",
        "--seeds",
        "2",
        "--cost",
        "post_ns=7000,byte_weight=16",
        "--ring-cost",
        "msg_proc_ns=0",
        "--json",
    ]));
    assert_eq!(rows.len(), 2, "2 layouts: {rows:?}");
    for r in &rows {
        let f = |k: &str| r[k].as_f64().unwrap();
        // The late ranks come 500 us late, within the 20 us skew.
        assert!((500.0..=520.0).contains(&f("mean_last_arrival_us")), "{r}");
        assert!(
            f("mean_offload_tail_us") > 7.0,
            "the post hop is in the tail: {r}"
        );
        assert!(f("mean_ring_tail_us") > 0.0, "{r}");
        let ratio = f("mean_offload_tail_us") / f("mean_ring_tail_us");
        assert!((f("tail_ratio") - ratio).abs() < 1e-9, "{r}");
        assert_eq!(r["cost"]["post_ns"], 7000, "{r}");
        assert_eq!(r["ring_cost"]["byte_weight"], 16, "{r}");
        assert_eq!(r["ring_cost"]["msg_proc_ns"], 0, "{r}");
        assert_eq!(r["cost"]["msg_proc_ns"], 100, "{r}");
    }
}

#[test]
fn simulate_refuses_unknown_cost_fields_and_misplaced_options() {
    for args in [
        &["--cost", "nope=1"][..],
        &["--cost", "post_ns"],
        &["--cost", "byte_weight=0"],
        &["--ring-cost", "post_ns=1"],
        &["--coll", "bcast", "--inflight", "2"],
    ] {
        let mut all = vec!["--nodes", "2", "--ranks-per-node", "2", "--seeds", "1"];
        all.extend_from_slice(args);
        let out = simulate(&all);
        assert!(!out.status.success(), "{args:?} accepted");
    }
}

#[test]
fn simulate_refuses_zero_seeds() {
    let out = simulate(&["--nodes", "2", "--ranks-per-node", "2", "--seeds", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--seeds"));
}

fn simulate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_service-process"))
        .arg("simulate")
        .args(args)
        .output()
        .unwrap()
}

const SMALL_ALLGATHER: [&str; 10] = [
    "--nodes",
    "4",
    "--ranks-per-node",
    "4",
    "--sps-per-node",
    "1,2",
    "--late-ranks",
    "2",
    "--seeds",
    "2",
];

/// The allgather output as printed before `--coll` existed (scripts/bench.sh reads it).
const GOLDEN_ALLGATHER_TABLE: &str = "\
# simulated allgather: 4 nodes x 4 ranks, 64 B per rank, 2 late ranks, 2 seeds from 0x1 (virtual time)
 sps  layout  completion_us     inter_node_B      min_inter_B  no_ready    passed  parked
   1   block          119.9             3840             3840        20         0      20
   1  cyclic          119.9             3840             3840         7         0       7
   2   block          119.9             3840             3840        25         5      20
   2  cyclic          119.9             3840             3840        20        13       7
";

const GOLDEN_ALLGATHER_JSON: &str = r#"{"coll":"allgather","nodes":4,"ranks_per_node":4,"sps_per_node":1,"layout":"block","late_ranks":2,"block_bytes":64,"runs":2,"mean_completion_us":119.94749999999999,"inter_node_bytes":3840,"min_inter_node_bytes":3840,"no_ready_rank":20,"served_after_pass":0,"parked":20}
{"coll":"allgather","nodes":4,"ranks_per_node":4,"sps_per_node":1,"layout":"cyclic","late_ranks":2,"block_bytes":64,"runs":2,"mean_completion_us":119.94749999999999,"inter_node_bytes":3840,"min_inter_node_bytes":3840,"no_ready_rank":7,"served_after_pass":0,"parked":7}
{"coll":"allgather","nodes":4,"ranks_per_node":4,"sps_per_node":2,"layout":"block","late_ranks":2,"block_bytes":64,"runs":2,"mean_completion_us":119.94749999999999,"inter_node_bytes":3840,"min_inter_node_bytes":3840,"no_ready_rank":25,"served_after_pass":5,"parked":20}
{"coll":"allgather","nodes":4,"ranks_per_node":4,"sps_per_node":2,"layout":"cyclic","late_ranks":2,"block_bytes":64,"runs":2,"mean_completion_us":119.94749999999999,"inter_node_bytes":3840,"min_inter_node_bytes":3840,"no_ready_rank":20,"served_after_pass":13,"parked":7}
"#;

#[test]
fn simulate_allgather_output_is_unchanged() {
    assert_eq!(
        stdout_ok(simulate(&SMALL_ALLGATHER)),
        GOLDEN_ALLGATHER_TABLE
    );
    let mut explicit = vec!["--coll", "allgather"];
    explicit.extend(SMALL_ALLGATHER);
    assert_eq!(stdout_ok(simulate(&explicit)), GOLDEN_ALLGATHER_TABLE);
    explicit.push("--json");
    assert_eq!(stdout_ok(simulate(&explicit)), GOLDEN_ALLGATHER_JSON);
}

/// 3 nodes x 4 ranks, 1 and 2 SPs per node, 5000 B in 1 KiB chunks (the last one short).
const SMALL_BCAST: [&str; 16] = [
    "--coll",
    "bcast",
    "--nodes",
    "3",
    "--ranks-per-node",
    "4",
    "--sps-per-node",
    "1,2",
    "--bcast-bytes",
    "5000",
    "--chunk-bytes",
    "1024",
    "--slots",
    "2",
    "--seeds",
    "2",
];

#[test]
fn simulate_bcast_table_has_both_designs_and_minimal_inter_node_bytes() {
    let text = stdout_ok(simulate(&SMALL_BCAST));
    let mut lines = text.lines();
    let title = lines.next().unwrap();
    assert!(
        title.starts_with("# simulated bcast: 3 nodes x 4 ranks, root 0, 5000 B, 1024 B chunks"),
        "{text}"
    );
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "sps",
            "layout",
            "design",
            "completion_us",
            "sp_completion_us",
            "inter_node_B",
            "min_inter_B",
            "hier/flat"
        ],
        "{text}"
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(
        rows.len(),
        8,
        "2 SP counts x 2 layouts x 2 designs:\n{text}"
    );
    let mut seen = Vec::new();
    for pair in rows.chunks(2) {
        let (flat, hier) = (&pair[0], &pair[1]);
        assert_eq!(flat[..2], hier[..2], "{text}");
        assert_eq!((flat[2], hier[2]), ("flat", "hier"), "{text}");
        seen.push((flat[0], flat[1]));
        for r in pair {
            // Each chunk crosses each of the 2 node boundaries once.
            assert_eq!(r[5], "10000", "{text}");
            assert_eq!(r[5], r[6], "{text}");
            assert!(r[3].parse::<f64>().unwrap() > 0.0, "{text}");
            assert!(
                r[3].parse::<f64>().unwrap() >= r[4].parse::<f64>().unwrap(),
                "{text}"
            );
        }
        assert_eq!(flat[7], "-", "{text}");
        let ratio: f64 = hier[7].parse().unwrap();
        let want = hier[3].parse::<f64>().unwrap() / flat[3].parse::<f64>().unwrap();
        assert!((ratio - want).abs() < 0.01, "{text}");
    }
    assert_eq!(
        seen,
        [
            ("1", "block"),
            ("1", "cyclic"),
            ("2", "block"),
            ("2", "cyclic")
        ],
        "{text}"
    );
}

#[test]
fn simulate_bcast_json_rows_parse() {
    let mut args = SMALL_BCAST.to_vec();
    args.extend(["--root", "5", "--late-ranks", "2", "--json"]);
    let rows: Vec<serde_json::Value> = stdout_ok(simulate(&args))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 8, "{rows:?}");
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["coll"], "bcast", "{r}");
        assert_eq!(r["design"], ["flat", "hier"][i % 2], "{r}");
        assert_eq!(r["layout"], ["block", "cyclic"][i / 2 % 2], "{r}");
        assert_eq!(r["sps_per_node"], [1, 2][i / 4], "{r}");
        assert_eq!(r["nodes"], 3, "{r}");
        assert_eq!(r["ranks_per_node"], 4, "{r}");
        assert_eq!(r["root"], 5, "{r}");
        assert_eq!(r["bcast_bytes"], 5000, "{r}");
        assert_eq!(r["chunk_bytes"], 1024, "{r}");
        assert_eq!(r["slots"], 2, "{r}");
        assert_eq!(r["late_ranks"], 2, "{r}");
        assert_eq!(r["runs"], 2, "{r}");
        assert_eq!(r["min_inter_node_bytes"], 10_000, "{r}");
        assert_eq!(r["inter_node_bytes"], r["min_inter_node_bytes"], "{r}");
        let done = r["mean_completion_us"].as_f64().unwrap();
        let sp_done = r["mean_sp_completion_us"].as_f64().unwrap();
        assert!(done > 0.0 && done >= sp_done, "{r}");
        if i % 2 == 0 {
            assert!(r["hier_over_flat"].is_null(), "{r}");
        } else {
            let flat = rows[i - 1]["mean_completion_us"].as_f64().unwrap();
            let ratio = r["hier_over_flat"].as_f64().unwrap();
            assert!((ratio - done / flat).abs() < 1e-9, "{r}");
        }
    }
}

#[test]
fn simulate_bcast_failure_prints_the_seed() {
    // The simulator itself refuses 0 SPs per node (a `SimFailure`, not an option check).
    let out = simulate(&[
        "--coll",
        "bcast",
        "--nodes",
        "2",
        "--ranks-per-node",
        "2",
        "--sps-per-node",
        "0",
        "--seed",
        "7",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("seed=0x0000000000000007"), "{err}");
}

#[test]
fn simulate_refuses_options_of_the_other_collective() {
    for args in [
        &["--root", "1"][..],
        &["--bcast-bytes", "10"],
        &["--chunk-bytes", "10"],
        &["--slots", "2"],
        &["--coll", "bcast", "--block-bytes", "10"],
        &["--coll", "bcast", "--root", "4"],
    ] {
        let mut all = vec!["--nodes", "2", "--ranks-per-node", "2", "--seeds", "1"];
        all.extend(args);
        let out = simulate(&all);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(args[args.len() - 2]), "{args:?}: {err}");
    }
}
