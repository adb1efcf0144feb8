//! The shim under MPICH's ABI (`libhost_shim_mpich.so`): the C test programs built with
//! `mpicc.mpich` and run by Hydra (`mpiexec.mpich`) through the real launcher and real SPs on
//! 2 nodes x 2 ranks. Each program compares every byte with MPICH's own `PMPI_*`; the SPs'
//! counters prove the calls were offloaded (exactly the eligible ones, all completed, no copy
//! failed). This is the representative subset `make test` runs; `make test-mpich` runs every
//! `mpirun_*` test file under MPICH (`SPOFF_TEST_MPI=mpich`).
//!
//! The launcher is never told the MPI here except where the program is a script: it must find
//! MPICH from the program's libraries.

mod common;

use common::*;
use integration_tests::{artifact, run, Finished};
use std::process::Command;

fn mpich() {
    use_mpi(Mpi::Mpich);
}

/// The launcher's job on 2 nodes x 2 ranks with `sps_per_node` SPs per node and no `--mpi`:
/// the launcher must find MPICH in the program ([`launch_with`] names it under MPICH, for
/// scripts).
fn launch_detected(
    sps_per_node: u32,
    layout: &str,
    program: &[&str],
    env: &[(&str, &str)],
) -> Finished {
    launch_detected_with(sps_per_node, layout, &[], program, env)
}

/// [`launch_detected`] with more launcher arguments `extra`.
fn launch_detected_with(
    sps_per_node: u32,
    layout: &str,
    extra: &[&str],
    program: &[&str],
    env: &[(&str, &str)],
) -> Finished {
    let k = sps_per_node.to_string();
    let mut args = vec![
        "--nodes",
        "2",
        "--ranks-per-node",
        "2",
        "--sps-per-node",
        &k,
        "--layout",
        layout,
    ];
    args.extend_from_slice(extra);
    let cmd = integration_tests::launch_cmd(&args, program);
    let run = run(with_env(cmd, env), TIMEOUT);
    eprintln!(
        "{} under the launcher (MPICH): {:?}",
        shown(program),
        run.elapsed
    );
    run
}

/// Every Wait/Test variant mixed with point-to-point and null requests, derived and packed
/// types, `MPI_IN_PLACE`, six collectives outstanding on 4 mailbox slots, a request freed
/// before completion; the launcher picks MPICH, Hydra and the MPICH shim by itself.
#[test]
fn mpich_a2a_check_offloads_with_every_wait_and_test_variant() {
    mpich();
    let _serial = serial();
    let prog = prog("a2a_check");
    let run = launch_detected(
        1,
        "block",
        &[&prog, "2", "free"],
        &[("SPOFF_VERBOSE", "1"), ("SPOFF_MAILBOX_SLOTS", "4")],
    );
    assert_offloaded(&run, "a2a_check", 2);
    let lines = shim_lines(&run.stderr);
    for r in 0..NP {
        assert!(
            lines
                .iter()
                .any(|l| l.contains(&format!("rank {r}: offload active"))
                    && l.contains(", 4 mailbox slots, placed by ")),
            "rank {r} did not activate\n{}",
            run.stderr
        );
    }
}

/// Allgather(v) and alltoall(v) with late ranks, 2 SPs per node, cyclic placement.
#[test]
fn mpich_allgather_and_alltoall_offload_with_late_arrivals() {
    mpich();
    let _serial = serial();
    let prog = prog("ag_check");
    let seed = integration_tests::seed().to_string();
    let run = launch_detected(2, "cyclic", &[&prog, "30", &seed, "late", "mixed"], &[]);
    assert_offloaded(&run, "ag_check", 4);
    assert!(run.sp_total("no_ready_rank") > 0, "{}", run.stderr);
}

/// Broadcast, both staged designs, with a late rank.
#[test]
fn mpich_bcast_offloads_flat_and_hier() {
    mpich();
    let _serial = serial();
    let prog = prog("bcast_check");
    let seed = integration_tests::seed().to_string();
    for (k, layout, design) in [(1, "block", "flat"), (2, "cyclic", "hier")] {
        let run = launch_detected(
            k,
            layout,
            &[&prog, "8", &seed, "late"],
            &[("SPOFF_BCAST_DESIGN", design)],
        );
        assert_offloaded(&run, "bcast_check", 2 * k as usize);
        assert!(run.sp_total("staging_peak_bytes") > 0, "{}", run.stderr);
    }
}

/// The SP-tree allreduce (every predefined op and type, blocking, nonblocking, in place, a
/// split half; `mpirun_allreduce.rs`): against MPICH's `PMPI_Allreduce`, and against MPI's
/// definition where MPICH 4.0.2's compares unsigned types as signed in MIN/MAX
/// (pmodels/mpich#6083).
#[test]
fn mpich_allreduce_sp_tree_offloads() {
    mpich();
    let _serial = serial();
    let prog = prog("allreduce_check");
    let seed = integration_tests::seed().to_string();
    let run = launch_detected(
        2,
        "cyclic",
        &[&prog, "12", &seed],
        &[("SPOFF_ALLREDUCE_DESIGN", "sp-tree")],
    );
    assert_offloaded(&run, "allreduce_check", 4);
    assert!(run.sp_total("messages_sent") > 0, "{}", run.stderr);
}

/// The Canary allreduce (`mpirun_canary.rs`) under MPICH, on a cyclic layout, over a loopback
/// tree of 2 leaves and 2 spines: against MPICH's `PMPI_Allreduce`; the data go through the
/// switches only (no message between SPs).
#[test]
fn mpich_allreduce_canary_offloads() {
    mpich();
    let _serial = serial();
    let prog = prog("allreduce_check");
    let seed = integration_tests::seed().to_string();
    let run = launch_detected_with(
        1,
        "cyclic",
        &["--canary-tree", "2+2"],
        &[&prog, "12", &seed],
        &[("SPOFF_ALLREDUCE_DESIGN", "canary")],
    );
    assert_offloaded(&run, "allreduce_check", 2);
    assert!(run.sp_total("canary_done") > 0, "{}", run.stderr);
    assert_eq!(run.sp_total("canary_failed"), 0, "{}", run.stderr);
    assert_eq!(run.sp_total("messages_sent"), 0, "{}", run.stderr);
}

/// The legal mixes of issue 11 under MPICH: offset data and one message described by
/// different type maps on different ranks (packed, and counted so by the SPs).
#[test]
fn mpich_legal_mixes_offload_and_match_native() {
    mpich();
    let _serial = serial();
    let prog = prog("legal_mix");
    for (mode, k, layout) in [("offsets", 1, "block"), ("mixed", 2, "cyclic")] {
        let run = launch_detected(k, layout, &[&prog, mode], &[]);
        run.assert_ok(&format!("legal_mix {mode}"));
        let mut calls = 0;
        for r in 0..NP {
            let head = format!("legal_mix {mode}: rank {r} ok (");
            calls += run
                .stdout
                .lines()
                .find_map(|l| l.strip_prefix(head.as_str()))
                .and_then(|l| l.strip_suffix(" eligible calls)"))
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("rank {r} did not pass\n{}\n{}", run.stdout, run.stderr));
        }
        assert!(calls > 0);
        assert_eq!(run.sp_total("posts"), calls, "{}", run.stderr);
        assert_eq!(run.sp_total("completions"), calls, "{}", run.stderr);
        assert!(run.sp_total("posts_packed") > 0, "{}", run.stderr);
        assert_eq!(run.sp_total("copies_failed"), 0, "{}", run.stderr);
    }
}

/// The conformance generator under MPICH: random type maps per rank with equal signatures,
/// `MPI_IN_PLACE` on some ranks, sub-communicators, outstanding batches completed by every
/// Wait/Test variant, ranks finalizing early; every byte compared with MPICH's `PMPI_*`.
#[test]
fn mpich_conformance_generator_matches_native_byte_for_byte() {
    mpich();
    let _serial = serial();
    let prog = prog("conform");
    let s = integration_tests::seed().to_string();
    let run = launch_detected(
        1,
        "cyclic",
        &[
            &prog,
            "--cases",
            "80",
            "--seed",
            &s,
            "--timeout",
            "60",
            "--mixed-in-place",
            "--finalize-early",
        ],
        &[
            ("SPOFF_BCAST_DESIGN", "hier"),
            ("SPOFF_IALLGATHER_DESIGN", "flat"),
        ],
    );
    let calls = assert_conform_offloaded(&run, &s.to_string(), NP, 81);
    eprintln!("conform under MPICH, seed {s}: {calls} calls offloaded");
}

/// The checker can fail under MPICH too: `--corrupt` flips a byte per case after the
/// offloaded call, and the program must report it.
#[test]
fn mpich_conformance_checker_catches_a_corrupted_byte() {
    mpich();
    let _serial = serial();
    let prog = prog("conform");
    let run = launch_detected(
        1,
        "block",
        &[&prog, "--cases", "10", "--seed", "7", "--corrupt"],
        &[],
    );
    assert!(!run.ok(), "a corrupted run passed\n{}", run.stdout);
    assert!(
        run.stdout.contains("FAIL"),
        "{}\n{}",
        run.stdout,
        run.stderr
    );
}

/// The MPICH program runs natively (no SPs, no shim) when asked, under Hydra all the same.
#[test]
fn mpich_native_baseline_runs_without_sps() {
    mpich();
    let _serial = serial();
    let prog = prog("a2a_check");
    let cmd = integration_tests::launch_cmd(
        &["--nodes", "2", "--ranks-per-node", "2", "--native"],
        &[&prog, "1"],
    );
    let run = run(with_env(cmd, &[]), TIMEOUT);
    verdict(&run, "a2a_check");
    assert!(run.sp_stats().is_empty(), "{}", run.stderr);
}

/// Without the shim of the program's ABI next to the launcher, the launch stops at once with
/// a line naming the missing file; an unknown `--mpi` is refused by name.
#[test]
fn a_missing_mpich_shim_is_a_clear_error() {
    mpich();
    let prog = prog("a2a_check");
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("sp-without-mpich-shim");
    std::fs::create_dir_all(&dir).unwrap();
    let sp = dir.join("service-process");
    std::fs::copy(artifact("service-process"), &sp).unwrap();
    let _ = std::fs::remove_file(dir.join("libhost_shim_mpich.so"));
    let out = Command::new(&sp)
        .args(["launch", "--nodes", "1", "--ranks-per-node", "2", "--"])
        .arg(&prog)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("libhost_shim_mpich.so for mpich not found"),
        "{stderr}"
    );
    let out = Command::new(&sp)
        .args([
            "launch",
            "--nodes",
            "1",
            "--ranks-per-node",
            "2",
            "--mpi",
            "intel",
            "--",
        ])
        .arg(&prog)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("expected openmpi or mpich"), "{stderr}");
}
