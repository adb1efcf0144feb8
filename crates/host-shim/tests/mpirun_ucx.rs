//! Real `mpirun` jobs that grant with the `ucx` backend (`SPOFF_BACKEND=ucx`, SPs with UCX on):
//! every Wait/Test variant, buffers freed and reallocated between collectives, allgather(v),
//! Testsome progressing UCX while a native request is pending, bcast, and ranks mixing cma and
//! ucx grants, and `ucx-export` falling back to cma where no device can export.

mod common;

use common::*;

/// `program` offloaded with `SPOFF_BACKEND=ucx` (and verbose) on SPs started with `--ucx`:
/// checks it as [`assert_offloaded`] does, that every copy took the ucx path (the SP never
/// runs a ucx copy inline; with cma every copy of these programs is inline), and that every
/// rank saw the setting (each says it grants with ucx, memory events on). Returns each rank's
/// report line from `MPI_Finalize`.
fn ucx_offloads(program: &[&str], name: &str, slots: &str) -> Vec<String> {
    let run = launch_with(
        1,
        &["--sp-arg=--ucx"],
        program,
        &[
            ("SPOFF_BACKEND", "ucx"),
            ("SPOFF_VERBOSE", "1"),
            ("SPOFF_MAILBOX_SLOTS", slots),
        ],
    );
    assert_offloaded(&run, name, 2);
    assert!(run.sp_total("copies_started") > 0, "{}", run.stderr);
    assert_eq!(
        run.sp_total("copies_inline"),
        0,
        "a copy ran inline: not the ucx path\n{}",
        run.stderr
    );
    let lines = shim_lines(&run.stderr);
    (0..NP)
        .map(|r| {
            assert!(
                lines
                    .iter()
                    .any(|l| l.ends_with(&format!("rank {r}: ucx grants, memory events on"))),
                "rank {r} did not grant with ucx\n{}",
                run.stderr
            );
            let report = format!("rank {r}: ucx grants: ");
            lines
                .iter()
                .find(|l| l.contains(&report))
                .unwrap_or_else(|| panic!("no ucx report from rank {r}\n{}", run.stderr))
                .to_string()
        })
        .collect()
}

/// The number before `word` in `line` (`"... 16 invalidated ..."`).
fn count_before(line: &str, word: &str) -> u64 {
    let words: Vec<&str> = line.split([' ', ',']).filter(|w| !w.is_empty()).collect();
    words
        .windows(2)
        .find(|w| w[1] == word)
        .and_then(|w| w[0].parse().ok())
        .unwrap_or_else(|| panic!("no count before {word:?} in {line:?}"))
}

#[test]
fn ucx_backend_offloads_every_wait_and_test_variant() {
    let _serial = serial();
    let prog = prog("a2a_check");
    ucx_offloads(&[&prog, "2", "free"], "a2a_check", "4");
}

#[test]
fn ucx_grants_of_freed_and_reallocated_buffers_are_invalidated() {
    let _serial = serial();
    let prog = prog("realloc_check");
    for line in ucx_offloads(&[&prog, "6"], "realloc_check", "1024") {
        // Every round unmaps the previous round's buffers: their registrations must have been
        // invalidated (new generation, new ucp_mem_map) before the addresses were granted again.
        assert!(count_before(&line, "invalidated") > 0, "{line}");
        assert!(count_before(&line, "unmap") > 0, "{line}");
    }
}

/// Allgather(v) with ucx grants: the receive grant is read-write (the SP serves the node's
/// other ranks from it), which the ucx registration must carry too.
#[test]
fn ucx_backend_offloads_allgather() {
    let _serial = serial();
    let prog = prog("ag_check");
    let seed = integration_tests::seed().to_string();
    ucx_offloads(&[&prog, "10", &seed, "late", "mixed"], "ag_check", "1024");
}

/// Rank 0 loops on `MPI_Testsome` over an offloaded Iallgather and a native receive that rank 1
/// sends only after its own Iallgather completed, which needs the SPs' UCX reads of rank 0's
/// block, which need rank 0 to progress UCX (emulated RMA): its Testsome must, native request
/// pending or not.
#[test]
fn ucx_progress_in_testsome_while_a_native_request_is_pending() {
    let _serial = serial();
    let prog = prog("testsome_dep");
    ucx_offloads(&[&prog, "65536"], "testsome_dep", "1024");
}

#[test]
fn ucx_backend_offloads_bcast() {
    // The default design here (2 ranks per SP) is flat: every staged copy is between a ucx
    // grant and the SP's own staging, none inline.
    let _serial = serial();
    let prog = prog("bcast_check");
    let seed = integration_tests::seed().to_string();
    ucx_offloads(&[&prog, "8", &seed, "late"], "bcast_check", "1024");
}

/// Ranks may grant differently: rank 1 asks for cma, rank 2's UCX cannot initialise (it says
/// so once and uses cma), ranks 0 and 3 use ucx. The SPs serve each grant with its own
/// backend, so mixed cma/ucx copies are correct too. (Under MPICH, which runs on UCX itself,
/// a rank without UCX could not start: there only rank 1 differs, asking for cma.)
#[test]
fn ranks_mixing_cma_and_ucx_grants_agree() {
    let _serial = serial();
    let prog = prog("a2a_check");
    let mpich = mpi() == Mpi::Mpich;
    let script = if mpich {
        "case $PMI_RANK in\n\
         1) export SPOFF_BACKEND=cma;;\n\
         esac\n\
         exec \"$@\""
    } else {
        "case $OMPI_COMM_WORLD_RANK in\n\
         1) export SPOFF_BACKEND=cma;;\n\
         2) export UCX_TLS=no_such_transport;;\n\
         esac\n\
         exec \"$@\""
    };
    let run = launch_with(
        1,
        &["--sp-arg=--ucx"],
        &["sh", "-c", script, "sh", &prog, "2", "free"],
        &[("SPOFF_BACKEND", "ucx"), ("SPOFF_VERBOSE", "1")],
    );
    assert_offloaded(&run, "a2a_check", 2);
    let lines = shim_lines(&run.stderr);
    let said = |needle: &str| lines.iter().filter(|l| l.contains(needle)).count();
    let (ucx_ranks, failed) = if mpich { (3, 0) } else { (2, 1) };
    assert_eq!(
        said("ucx grants, memory events on"),
        ucx_ranks,
        "{}",
        run.stderr
    );
    assert_eq!(
        said("rank 2: cannot initialise UCX"),
        failed,
        "{}",
        run.stderr
    );
    let inline = run.sp_total("copies_inline");
    assert!(
        inline > 0 && inline < run.sp_total("copies_started"),
        "both backends copied\n{}",
        run.stderr
    );
}

/// `SPOFF_BACKEND=ucx-export` where no device can export (any machine without a BlueField), or
/// with a shim built against UCX < 1.15: every rank says why, once, and grants with cma; the
/// job is still offloaded and correct (with cma every copy of this program runs inline).
#[test]
fn ucx_export_where_no_device_can_export_falls_back_to_cma() {
    let _serial = serial();
    let prog = prog("a2a_check");
    let run = launch_with(
        1,
        &["--sp-arg=--ucx"],
        &[&prog, "2", "free"],
        &[("SPOFF_BACKEND", "ucx-export"), ("SPOFF_VERBOSE", "1")],
    );
    assert_offloaded(&run, "a2a_check", 2);
    let why = if ucx_sys::EXPORT_API {
        "this device cannot export memory (needs BlueField cross-GVMI)"
    } else {
        "built without UCX >= 1.15 export support"
    };
    let lines = shim_lines(&run.stderr);
    for r in 0..NP {
        let said = format!("rank {r}: cannot initialise UCX for SPOFF_BACKEND=ucx-export");
        let said: Vec<&&str> = lines
            .iter()
            .filter(|l| l.contains(&said) && l.contains(why) && l.ends_with("using cma grants"))
            .collect();
        assert_eq!(said.len(), 1, "rank {r} said why once\n{}", run.stderr);
        if r == 0 {
            println!("{}", said[0]);
        }
    }
    assert!(run.sp_total("copies_started") > 0, "{}", run.stderr);
    assert_eq!(
        run.sp_total("copies_inline"),
        run.sp_total("copies_started"),
        "every copy took the cma path\n{}",
        run.stderr
    );
}
