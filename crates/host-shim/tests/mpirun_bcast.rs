//! Real `mpirun` jobs of randomized broadcasts (`bcast_check`: flat and hierarchical designs,
//! 1 and 2 SPs per node, a late rank, polling SPs, chunks moved as UCX puts or TCP frames, a
//! segment too small for two messages at once), through the real launcher and real SPs on
//! 2 nodes x 2 ranks.

mod common;

use common::*;
use integration_tests::Finished;

/// `bcast_check` (randomized MPI_Bcast / MPI_Ibcast from every root, 0 bytes to several MiB
/// with sizes off the chunk size, sub-communicators, several outstanding, each compared byte
/// for byte with `PMPI_Bcast`; a non-contiguous type going native) on 2 nodes x 2 ranks with
/// `sps_per_node` SPs per node, `layout`, the design forced by `SPOFF_BCAST_DESIGN=design` and
/// `extra` program arguments. Checks the verdict and the SP accounting as [`assert_offloaded`]
/// does, that chunks moved between the SPs, and for `hier` that the ranks copied out of the
/// segment (with 2 SPs per node: out of regions their node's leader wrote for the other SP)
/// and that the node segments' names are gone at the end; returns the run.
fn bcast_check_offloads(sps_per_node: u32, layout: &str, design: &str, extra: &[&str]) -> Finished {
    bcast_check_offloads_with(sps_per_node, &["--layout", layout], design, extra)
}

/// [`bcast_check_offloads`] with launcher arguments `launcher`.
fn bcast_check_offloads_with(
    sps_per_node: u32,
    launcher: &[&str],
    design: &str,
    extra: &[&str],
) -> Finished {
    let _serial = serial();
    let shm_before = shm_segments();
    let prog = prog("bcast_check");
    let seed = integration_tests::seed().to_string();
    let mut program = vec![prog.as_str(), "12", &seed];
    program.extend_from_slice(extra);
    let run = launch_with(
        sps_per_node,
        launcher,
        &program,
        &[("SPOFF_BCAST_DESIGN", design)],
    );
    assert_offloaded(&run, "bcast_check", 2 * sps_per_node as usize);
    assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
    assert!(run.sp_total("chunks_moved") > 0, "{}", run.stderr);
    assert_eq!(run.sp_total("staging_refused"), 0, "{}", run.stderr);
    match design {
        "hier" => assert!(run.sp_total("host_copies") > 0, "{}", run.stderr),
        _ => assert_eq!(run.sp_total("host_copies"), 0, "{}", run.stderr),
    }
    let shared = run.sp_total("regions_shared");
    if design == "hier" && sps_per_node > 1 {
        assert!(shared > 0, "no SP read its leader's region\n{}", run.stderr);
    } else {
        assert_eq!(shared, 0, "{}", run.stderr);
    }
    let left: Vec<_> = shm_segments().difference(&shm_before).cloned().collect();
    assert!(left.is_empty(), "segment names left behind: {left:?}");
    eprintln!(
        "bcast_check seed {seed} {design}: chunks moved {}, host copies {}, regions shared {shared}",
        run.sp_total("chunks_moved"),
        run.sp_total("host_copies")
    );
    run
}

#[test]
fn bcast_flat_offloads_one_sp_per_node_block() {
    bcast_check_offloads(1, "block", "flat", &["big"]);
}

#[test]
fn bcast_flat_offloads_two_sps_per_node_cyclic_with_a_late_rank() {
    let run = bcast_check_offloads(2, "cyclic", "flat", &["late"]);
    assert_eq!(run.sp_total("empty_polls"), 0, "{}", run.stderr);
}

#[test]
fn polling_sps_offload_bcast_with_a_late_rank() {
    // `serve --poll-us` (SPs on reserved cores, as on a DPU): the loop never waits on its
    // connections, and everything still arrives, a late rank included.
    for design in ["flat", "hier"] {
        let run = bcast_check_offloads_with(
            2,
            &["--layout", "cyclic", "--sp-arg=--poll-us=100"],
            design,
            &["late"],
        );
        assert!(run.sp_total("empty_polls") > 0, "{}", run.stderr);
        // The chunks went as UCX puts, which complete only while the target SP progresses
        // its worker: a polling SP must do that without arming it.
        let moved = run.sp_total("chunks_moved");
        assert_eq!(run.sp_total("chunks_moved_ucx"), moved, "{}", run.stderr);
        assert!(!run.stderr.contains("UCX is off"), "{}", run.stderr);
    }
}

#[test]
fn bcast_hier_offloads_one_sp_per_node_cyclic_with_a_late_rank() {
    bcast_check_offloads(1, "cyclic", "hier", &["big", "late"]);
}

#[test]
fn bcast_hier_offloads_two_sps_per_node_block() {
    bcast_check_offloads(2, "block", "hier", &[]);
}

#[test]
fn bcast_chunks_move_between_sps_as_ucx_puts() {
    // By default (--ucx=auto, UCX available) the SPs grant their staging slots through UCX:
    // every chunk goes from one SP's staging into the next one's as a UCX put (its message
    // follows over TCP). With --ucx=off, or when UCX cannot initialise in the SPs (auto then
    // says so once per SP), the chunks travel as frames on the SPs' TCP connections.
    for design in ["flat", "hier"] {
        for (how, extra, env) in [
            ("default", None, None),
            ("off", Some("--sp-arg=--ucx=off"), None),
            (
                "no UCX",
                Some("--sp-arg=--ucx=auto"),
                Some(("UCX_TLS", "no_such_transport")),
            ),
        ] {
            let _serial = serial();
            let prog = prog("bcast_check");
            let seed = integration_tests::seed().to_string();
            let mut vars = vec![("SPOFF_BCAST_DESIGN", design)];
            vars.extend(env);
            let mut program = vec![prog.as_str(), "8", &seed, "big", "late"];
            // MPICH itself runs on UCX: the ranks get the working UCX back (only the SPs
            // are meant to be without it).
            if mpi() == Mpi::Mpich && env.is_some() {
                program.splice(0..0, ["sh", "-c", "unset UCX_TLS; exec \"$@\"", "sh"]);
            }
            let run = launch_with(1, &extra.into_iter().collect::<Vec<_>>(), &program, &vars);
            assert_offloaded(&run, "bcast_check", 2);
            let moved = run.sp_total("chunks_moved");
            assert!(moved > 0, "{how}\n{}", run.stderr);
            let warned = run.stderr.matches("UCX is off").count();
            if how == "default" {
                assert_eq!(run.sp_total("chunks_moved_ucx"), moved, "{}", run.stderr);
                assert_eq!(run.sp_total("bytes_staged_in"), 0, "{}", run.stderr);
                assert_eq!(warned, 0, "{}", run.stderr);
            } else {
                assert_eq!(run.sp_total("chunks_moved_ucx"), 0, "{how}\n{}", run.stderr);
                assert!(run.sp_total("bytes_staged_in") > 0, "{how}\n{}", run.stderr);
                let want = if how == "no UCX" { 2 } else { 0 };
                assert_eq!(warned, want, "{how}\n{}", run.stderr);
            }
        }
    }
}

#[test]
fn bcast_hier_without_room_in_the_segment_is_delivered_flat() {
    // Every message fits the 64 KiB segment part of an SP alone but no two at once: a leader
    // whose part is taken by an outstanding Ibcast delivers the next one flat (writing its
    // ranks' buffers itself and, with 2 SPs per node, sending the chunks on to the other SP,
    // which writes its ranks' buffers), and the results are still right.
    for sps in [1, 2] {
        let _serial = serial();
        let prog = prog("bcast_check");
        let seed = integration_tests::seed().to_string();
        let run = launch_with(
            sps,
            &[],
            &[prog.as_str(), "12", &seed, "fit=65536"],
            &[
                ("SPOFF_BCAST_DESIGN", "hier"),
                ("SPOFF_SEGMENT_BYTES", "65536"),
            ],
        );
        assert_offloaded(&run, "bcast_check", 2 * sps as usize);
        assert!(run.sp_total("hier_delivered_flat") > 0, "{}", run.stderr);
        assert!(run.sp_total("host_copies") > 0, "{}", run.stderr);
        if sps == 2 {
            assert!(run.sp_total("regions_shared") > 0, "{}", run.stderr);
        }
    }
}
