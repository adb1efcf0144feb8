//! The short run of `make deploy-test` (scripts/deploy-test.sh with `DEPLOY_SHORT=1`): a real
//! two-node cluster made of network namespaces (a host and a DPU namespace per node, each with
//! its own host name and address on a test bridge), SPs in the DPU namespaces, a job started by
//! Open MPI's `mpirun` across the host namespaces through an rsh agent; a correctness program
//! byte-compared with `PMPI_*`, the overlap benchmark offloaded and native, an SP and a rank
//! killed mid-run; nothing left behind. Needs root, as the script says loudly if it is not.

use std::path::Path;
use std::process::Command;

/// The directory holding this build's binaries (this test runs from `target/release/deps`).
fn bin_dir() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/release above deps")
        .to_path_buf()
}

#[test]
fn deploy_short_cluster_of_namespaces() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash")
        .arg(root.join("scripts/deploy-test.sh"))
        .current_dir(&root)
        .env("DEPLOY_SHORT", "1")
        .env("BIN", bin_dir())
        .output()
        .expect("running scripts/deploy-test.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{stdout}");
    eprint!("{stderr}");
    assert!(out.status.success(), "deploy-test failed: {:?}", out.status);
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("deploy-test: ") && l.contains(" jobs, "))
        .expect("deploy-test printed no summary line");
    // "deploy-test: N jobs, M offloaded, K faults handled, L left behind, in S s"
    let num = |after: &str| -> u64 {
        let words: Vec<&str> = summary
            .split([' ', ','])
            .filter(|w| !w.is_empty())
            .collect();
        let i = words
            .iter()
            .position(|w| *w == after)
            .unwrap_or_else(|| panic!("no '{after}' in {summary:?}"));
        words[i - 1]
            .parse()
            .unwrap_or_else(|_| panic!("no number before '{after}' in {summary:?}"))
    };
    assert!(num("offloaded") >= 2, "too few offloaded jobs: {summary}");
    // The short run's faults: a rank killed, an SP killed twice (SPs started by mpirun), and
    // the site daemons' two rounds of SPs killed and restarted.
    assert_eq!(num("faults"), 5, "every fault must be handled: {summary}");
    assert!(
        stdout.contains("rejoin-2: SPs 2 3 rejoined")
            && stdout.contains("rejoin-bystander: the job on node 1 ran through 2 rounds"),
        "the site daemons' phase did not show the rejoin"
    );
    assert_eq!(num("left"), 0, "something was left behind: {summary}");
    assert!(
        stdout.contains("SP-SP connections seen: ")
            && !stdout.contains("SP-SP connections seen: 0"),
        "no SP-to-SP TCP connection shown"
    );
}
