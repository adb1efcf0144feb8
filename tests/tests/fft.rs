//! `coll-bench fft` (issue 28's application proxy) offloaded: 2 ranks on 1 node, real SP, the
//! shim preloaded. Its transposes (MPI_Ialltoallv with uneven and zero counts) must leave every
//! received byte equal to a native point-to-point transpose and the 3D FFT equal to a direct
//! DFT; a corrupted transpose must be reported.

use integration_tests::*;
use std::time::Duration;

const JOB_TIMEOUT: Duration = Duration::from_secs(240);

/// N = 1: rank 1 owns no plane (zero counts both ways); 4: even slabs; 7: slabs of 4 and 3;
/// 12: slabs of 6 and 6 with a mixed-radix length.
const SIZES: &str = "1,4,7,12";

fn fft_job(seed: u64, extra: &[&str]) -> Finished {
    let bench = artifact("coll-bench").display().to_string();
    let seed = seed.to_string();
    let mut program = vec![
        bench.as_str(),
        "fft",
        "--n",
        SIZES,
        "--fields",
        "3",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--seed",
        &seed,
    ];
    program.extend_from_slice(extra);
    run(
        launch_cmd(&["--nodes", "1", "--ranks-per-node", "2"], &program),
        JOB_TIMEOUT,
    )
}

#[test]
fn mpi_fft_proxy_offloaded_transposes_match_native() {
    let seed = seed();
    let run = fft_job(seed, &[]);
    run.assert_ok("coll-bench fft, offloaded");
    assert!(
        run.stdout.contains("mode=offload"),
        "not offloaded:\n{}",
        run.stdout
    );
    let rows: Vec<&str> = run
        .stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim_start().starts_with('N'))
        .collect();
    assert_eq!(rows.len(), 4, "one row per N:\n{}", run.stdout);
    assert!(
        rows.iter().all(|r| r.trim_end().ends_with("true")),
        "a row did not validate (seed {seed}):\n{}",
        run.stdout
    );
    // Three fields, three timed phases and warmups: every transpose went through the SPs.
    assert!(
        run.sp_total("posts") > 0,
        "the SPs saw no post:\n{}",
        run.stderr
    );
}

#[test]
fn mpi_fft_proxy_reports_a_corrupted_transpose() {
    let seed = seed();
    let run = fft_job(seed, &["--self-test-corrupt"]);
    assert!(
        !run.ok(),
        "a corrupted transpose went unnoticed (seed {seed}):\n{}",
        run.stdout
    );
    assert!(
        run.stderr.contains("VALIDATION FAILED"),
        "no validation message:\n{}",
        run.stderr
    );
}
