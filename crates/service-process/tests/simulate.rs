//! `service-process simulate` runs the allgather simulator and reports the properties the
//! hierarchical design promises.

use std::process::Command;

#[test]
fn simulate_reports_minimal_inter_node_bytes_for_both_layouts() {
    let out = Command::new(env!("CARGO_BIN_EXE_service-process"))
        .args([
            "simulate",
            "--nodes",
            "4",
            "--ranks-per-node",
            "4",
            "--sps-per-node",
            "1,2",
        ])
        .args(["--late-ranks", "2", "--seeds", "2", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
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
fn simulate_refuses_zero_seeds() {
    let out = Command::new(env!("CARGO_BIN_EXE_service-process"))
        .args([
            "simulate",
            "--nodes",
            "2",
            "--ranks-per-node",
            "2",
            "--seeds",
            "0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--seeds"));
}
