//! The native fallback in real `mpirun` jobs: no SP reachable, a shim that is not configured or
//! is disabled next to real SPs, and one unreachable SP that keeps the whole job native. What
//! the job says then, in detail: mpirun_notices.rs.

mod common;

use bootstrap::cluster::{Cluster, Layout, SpEntry};
use common::*;
use std::path::PathBuf;

#[test]
fn no_sp_reachable_prints_one_line_per_job_and_runs_natively() {
    let _serial = serial();
    let prog = prog("a2a_check");
    let dir = std::env::temp_dir().join(format!("host-shim-nosp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sps = (0..2)
        .map(|i| SpEntry {
            id: i,
            node: i,
            index: 0,
            peer_addr: "127.0.0.1:9".parse().unwrap(),
            host_socket: dir.join(format!("absent-{i}.sock")),
            host_addr: None,
        })
        .collect();
    let cluster: PathBuf = dir.join("cluster.json");
    Cluster::new(2, 1, None, Layout::Block, sps)
        .unwrap()
        .save(&cluster)
        .unwrap();
    let cred = some_credential();
    let run = mpirun_preloaded(
        &[&prog, "1"],
        &[
            ("SPOFF_CLUSTER", cluster.to_str().unwrap()),
            ("SPOFF_JOB_CREDENTIAL", &cred),
        ],
    );
    std::fs::remove_dir_all(&dir).ok();
    verdict(&run, "a2a_check");
    // Rank 0 says it for the job (each rank's own line only with SPOFF_VERBOSE=1:
    // mpirun_notices.rs).
    let lines = shim_lines(&run.stderr);
    assert_eq!(lines.len(), 1, "{}", run.stderr);
    assert!(
        lines[0].contains(&format!(
            "offload is off for this job: {NP} of {NP} ranks could not use their service \
             process (rank 0: no service process reachable at"
        )) && lines[0].ends_with("running natively"),
        "{}",
        run.stderr
    );
}

#[test]
fn unconfigured_shim_says_so_once_and_disabled_shim_is_silent() {
    let _serial = serial();
    let prog = prog("a2a_check");
    // No SPOFF_CLUSTER at all: one line for the job (mpirun_notices.rs has the cases).
    let run = mpirun_preloaded(&[&prog, "1"], &[]);
    verdict(&run, "a2a_check");
    let lines = shim_lines(&run.stderr);
    assert_eq!(lines.len(), 1, "{}", run.stderr);
    assert!(
        lines[0].contains("SPOFF_CLUSTER and SPOFF_JOB_CREDENTIAL are set on none of its"),
        "{}",
        run.stderr
    );
    // Real SPs are up and reachable, but SPOFF_OFFLOAD=0.
    let run = launch(1, &[&prog, "1"], &[("SPOFF_OFFLOAD", "0")]);
    verdict(&run, "a2a_check");
    assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
    assert_eq!(run.sp_stats().len(), 2, "{}", run.stderr);
    assert_eq!(run.sp_total("posts"), 0, "offload was disabled");
}

#[test]
fn one_unreachable_sp_keeps_the_whole_job_native() {
    let _serial = serial();
    let prog = prog("a2a_check");
    // Real SPs, but every rank gets a copy of the cluster description in which SP 1's socket
    // is a path where nothing listens: ranks 0 and 1 register with the real SP 0, ranks 2 and
    // 3 reach nothing, and the whole job agrees to run natively.
    let broken = r##"c="$SPOFF_CLUSTER.rank${OMPI_COMM_WORLD_RANK:-$PMI_RANK}"
        sed 's#/sp-1\.sock"#/absent.sock"#' "$SPOFF_CLUSTER" > "$c" && grep -q absent.sock "$c" &&
        SPOFF_CLUSTER="$c" exec "$0" "$@""##;
    let run = launch(1, &["sh", "-c", broken, &prog, "1"], &[]);
    verdict(&run, "a2a_check");
    let lines = shim_lines(&run.stderr);
    assert_eq!(lines.len(), 1, "{}", run.stderr);
    assert!(
        lines[0].contains(
            "offload is off for this job: 2 of 4 ranks could not use their service process \
             (rank 2: no service process reachable"
        ),
        "{}",
        run.stderr
    );
    assert_eq!(run.sp_stats().len(), 2, "{}", run.stderr);
    assert_eq!(run.sp_total("posts"), 0, "{}", run.stderr);
}
