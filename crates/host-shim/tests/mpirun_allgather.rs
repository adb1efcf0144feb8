//! Real `mpirun` jobs of randomized allgather(v) (`ag_check`, with one consistently late rank,
//! 1 and 2 SPs per node, block and cyclic placement, host copies on and off, the staged
//! designs of `MPI_Iallgather`) and of hierarchical Iallgathers that do not all fit the node
//! segment (`iag_fit`), through the real launcher and real SPs on 2 nodes x 2 ranks.

mod common;

use common::*;
use integration_tests::Finished;

/// `ag_check` (randomized Iallgatherv / Allgatherv / Iallgather / Allgather, each compared
/// byte for byte with `PMPI_Allgatherv`; a non-contiguous type, packed, and `MPI_IN_PLACE`
/// among them) on 2 nodes x 2 ranks with `sps_per_node` SPs per node and `layout`, the last world
/// rank consistently late, `extra` program arguments (`mixed`: a blocking alltoall among the
/// outstanding allgathers of each batch). Checks the verdict and the SP accounting as
/// [`assert_offloaded`] does, and that the blocking calls' ranks did intra-node copies handed
/// to them by the SPs (host copies); returns the run.
fn ag_check_offloads(sps_per_node: u32, layout: &str, extra: &[&str]) -> Finished {
    let run = ag_check_offloads_env(sps_per_node, layout, extra, &[]);
    assert!(run.sp_total("host_copies") > 0, "{}", run.stderr);
    assert_eq!(run.sp_total("host_copies_failed"), 0, "{}", run.stderr);
    run
}

/// [`ag_check_offloads`] with `env` exported to the ranks, without the host-copy checks.
fn ag_check_offloads_env(
    sps_per_node: u32,
    layout: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Finished {
    let _serial = serial();
    let prog = prog("ag_check");
    let seed = integration_tests::seed().to_string();
    let mut program = vec![prog.as_str(), "30", &seed, "late"];
    program.extend_from_slice(extra);
    let run = launch_with(sps_per_node, &["--layout", layout], &program, env);
    assert_offloaded(&run, "ag_check", 2 * sps_per_node as usize);
    assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
    eprintln!(
        "ag_check seed {seed}: no_ready_rank {}, parked {}, served_after_pass {}",
        run.sp_total("no_ready_rank"),
        run.sp_total("parked"),
        run.sp_total("served_after_pass")
    );
    run
}

/// With one rank consistently late, an SP often has no ready rank to serve a segment from and
/// must park it or pass it on: the late-arrival paths ran, and still gave the right bytes.
fn assert_late_arrivals(run: &Finished) {
    assert!(run.sp_total("no_ready_rank") > 0, "{}", run.stderr);
    assert!(
        run.sp_total("parked") + run.sp_total("served_after_pass") > 0,
        "{}",
        run.stderr
    );
}

#[test]
fn allgather_offloads_one_sp_per_node_block() {
    let run = ag_check_offloads(1, "block", &[]);
    assert!(run.sp_total("no_ready_rank") > 0, "{}", run.stderr);
}

#[test]
fn allgather_host_copies_can_be_turned_off() {
    // SPOFF_HOST_COPIES=0: the SPs do every intra-node copy, blocking calls included.
    let run = ag_check_offloads_env(1, "block", &[], &[("SPOFF_HOST_COPIES", "0")]);
    assert_eq!(run.sp_total("host_copies"), 0, "{}", run.stderr);
    assert!(run.sp_total("bytes_intra_node") > 0, "{}", run.stderr);
}

#[test]
fn iallgather_staged_designs_offload_with_late_arrivals() {
    // SPOFF_IALLGATHER_DESIGN: MPI_Iallgather takes the staged designs (the other calls of
    // ag_check stay on the load-balanced one); still byte-identical to PMPI_Allgatherv. With 2
    // SPs per node, the hierarchical design writes one region per node, which the ranks of the
    // node's other SP copy out of too, and the node segments' names are gone at the end.
    for (k, layout, design) in [(1, "cyclic", "flat"), (2, "block", "hier")] {
        let shm_before = shm_segments();
        let run =
            ag_check_offloads_env(k, layout, &["late"], &[("SPOFF_IALLGATHER_DESIGN", design)]);
        assert!(
            run.sp_total("staging_peak_bytes") > 0,
            "no staged instance\n{}",
            run.stderr
        );
        assert_eq!(run.sp_total("staging_refused"), 0, "{}", run.stderr);
        if design == "hier" {
            assert!(run.sp_total("host_copies") > 0, "{}", run.stderr);
            assert!(run.sp_total("regions_shared") > 0, "{}", run.stderr);
        }
        let left: Vec<_> = shm_segments().difference(&shm_before).cloned().collect();
        assert!(left.is_empty(), "segment names left behind: {left:?}");
    }
}

#[test]
fn allgather_and_alltoall_offload_one_sp_per_node_cyclic() {
    ag_check_offloads(1, "cyclic", &["mixed"]);
}

#[test]
fn allgather_offloads_two_sps_per_node_block_with_late_arrivals() {
    let run = ag_check_offloads(2, "block", &[]);
    assert_late_arrivals(&run);
}

#[test]
fn allgather_and_alltoall_offload_two_sps_per_node_cyclic_with_late_arrivals() {
    let run = ag_check_offloads(2, "cyclic", &["mixed"]);
    assert_late_arrivals(&run);
}

#[test]
fn iallgather_hier_owner_without_room_makes_its_node_flat() {
    // Three hierarchical Iallgathers outstanding, each fitting a node owner's 64 KiB part of
    // the segment alone but no two at once: owners deliver some of them flat, and then the
    // node's other SP (2 SPs per node) delivers flat too; the others go through one region
    // per node. Every result is compared with PMPI_Allgather.
    let _serial = serial();
    let prog = prog("iag_fit");
    let run = launch_with(
        2,
        &[],
        &[prog.as_str(), "65536", "4"],
        &[
            ("SPOFF_IALLGATHER_DESIGN", "hier"),
            ("SPOFF_SEGMENT_BYTES", "65536"),
        ],
    );
    assert_offloaded(&run, "iag_fit", 4);
    assert!(run.sp_total("hier_delivered_flat") > 0, "{}", run.stderr);
    assert!(run.sp_total("regions_shared") > 0, "{}", run.stderr);
    assert!(run.sp_total("host_copies") > 0, "{}", run.stderr);
}
