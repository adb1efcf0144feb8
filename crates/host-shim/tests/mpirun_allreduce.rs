//! Real `mpirun` jobs of randomized allreduces (`allreduce_check`) through the real launcher
//! and real SPs on 2 nodes x 2 ranks: the SP-tree allreduce (`SPOFF_ALLREDUCE_DESIGN=sp-tree`
//! or `auto`) against `PMPI_Allreduce`, and the native call when the variable is unset.

mod common;
mod fortran;

use common::*;

/// `allreduce_check` (every predefined op on every predefined integer and floating-point
/// type, counts 0 to 3000, blocking and nonblocking, `MPI_IN_PLACE`, on `MPI_COMM_WORLD` and a
/// split half, then 4 MiB and 3 MiB ones; integers byte for byte equal to `PMPI_Allreduce`,
/// floating-point sums within 2 (n-1) eps sum|x_i| and products within 2 (n-1) eps |p|,
/// min/max exact, every rank rank 0's bytes; `MPI_BYTE` natively) under the launcher with
/// `SPOFF_ALLREDUCE_DESIGN=design` and `sps_per_node` SPs per node: the verdict, and the SPs
/// posted exactly the eligible calls of every rank (the program makes no other offloadable
/// call: those are the allreduce kind's posts), completed them all, with SP-to-SP messages
/// (the tree's `Up`/`Down`).
fn allreduce_check_offloads(sps_per_node: u32, design: &str) {
    allreduce_check_offloads_with(sps_per_node, &[], &[("SPOFF_ALLREDUCE_DESIGN", design)]);
}

/// [`allreduce_check_offloads`] with launcher arguments `launcher` and the environment `env`
/// (which names the design).
fn allreduce_check_offloads_with(sps_per_node: u32, launcher: &[&str], env: &[(&str, &str)]) {
    let _serial = serial();
    let prog = prog("allreduce_check");
    let seed = integration_tests::seed().to_string();
    let run = launch_with(sps_per_node, launcher, &[prog.as_str(), "16", &seed], env);
    let design = env
        .iter()
        .find(|(k, _)| *k == "SPOFF_ALLREDUCE_DESIGN")
        .map_or("", |(_, v)| *v);
    assert_offloaded(&run, "allreduce_check", 2 * sps_per_node as usize);
    assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
    assert!(run.sp_total("messages_sent") > 0, "{}", run.stderr);
    // Calls where PMPI_Allreduce departs from MPI's definition (Open MPI 4.1's saturating
    // 8/16-bit sums, signed unsigned min/max) and the offload was checked against the
    // definition instead.
    let departs = run.stderr.matches("departs from MPI's definition").count();
    eprintln!(
        "allreduce_check seed {seed} {design}, {sps_per_node} SP(s) per node: {} posts, \
         {departs} calls checked against the definition where PMPI departs from it",
        run.sp_total("posts")
    );
}

#[test]
fn mpi_allreduce_sp_tree_one_sp_per_node() {
    allreduce_check_offloads(1, "sp-tree");
}

#[test]
fn mpi_allreduce_sp_tree_two_sps_per_node() {
    allreduce_check_offloads(2, "sp-tree");
}

/// Chunks of 16 KiB (`serve --stage-chunk-bytes`): the large allreduces go through the SPs'
/// pipeline in hundreds of chunks, the small ones in several.
#[test]
fn mpi_allreduce_sp_tree_small_chunks_two_sps_per_node() {
    allreduce_check_offloads_with(
        2,
        &["--sp-arg=--stage-chunk-bytes=16384"],
        &[("SPOFF_ALLREDUCE_DESIGN", "sp-tree")],
    );
}

/// The ranks grant their buffers through UCX (`SPOFF_BACKEND=ucx`, SPs with `--ucx`): the
/// SPs read them into, and write them from, their own buffers over UCX.
#[test]
fn mpi_allreduce_sp_tree_with_ucx_grants() {
    allreduce_check_offloads_with(
        1,
        &["--sp-arg=--ucx"],
        &[
            ("SPOFF_ALLREDUCE_DESIGN", "sp-tree"),
            ("SPOFF_BACKEND", "ucx"),
        ],
    );
}

#[test]
fn mpi_allreduce_auto_is_the_sp_tree() {
    allreduce_check_offloads(1, "auto");
}

/// Unset, `native` or a design that does not exist (`tree`): every allreduce runs natively,
/// right, and no SP sees a post; an unknown value is said once per rank. (`canary` on a
/// cluster without switches: `mpirun_canary.rs`.)
#[test]
fn mpi_allreduce_native_unless_asked() {
    for design in [None, Some("native"), Some("tree")] {
        let _serial = serial();
        let prog = prog("allreduce_check");
        let seed = integration_tests::seed().to_string();
        let env: Vec<(&str, &str)> = design
            .map(|d| ("SPOFF_ALLREDUCE_DESIGN", d))
            .into_iter()
            .collect();
        let run = launch(1, &[prog.as_str(), "4", &seed], &env);
        verdict(&run, "allreduce_check");
        assert_eq!(run.sp_total("posts"), 0, "{design:?}\n{}", run.stderr);
        let said = run.stderr.matches("SPOFF_ALLREDUCE_DESIGN=tree").count();
        let want = if design == Some("tree") {
            NP as usize
        } else {
            0
        };
        assert_eq!(said, want, "{design:?}\n{}", run.stderr);
    }
}

/// From Fortran (`progs/fortran/freduce.F90`, `include 'mpif.h'`: `MPI_ALLREDUCE` and
/// `MPI_IALLREDUCE` on `MPI_INTEGER`, `MPI_INTEGER8`, `MPI_DOUBLE_PRECISION`, `MPI_REAL`, in
/// place, a split half; `MPI_LOGICAL` natively), compared inside the program with the
/// library's own Fortran `PMPI_ALLREDUCE`: the verdict, and every eligible call of every rank
/// posted. Open MPI only: MPICH's Fortran `PMPI_ALLREDUCE` calls the C `MPI_Allreduce`, which
/// the shim intercepts, so the program would have no native reference there (said, and not
/// run, under `SPOFF_TEST_MPI=mpich`).
#[test]
fn mpi_allreduce_sp_tree_from_fortran() {
    if mpi() == Mpi::Mpich {
        eprintln!("mpi_allreduce_sp_tree_from_fortran: Open MPI only (no native Fortran reference under MPICH)");
        return;
    }
    let _serial = serial();
    let prog = fortran::freduce("mpifort");
    let seed = integration_tests::seed().to_string();
    let run = launch(
        1,
        &[prog.as_str(), "6", &seed],
        &[("SPOFF_ALLREDUCE_DESIGN", "sp-tree")],
    );
    assert_offloaded(&run, "freduce", 2);
    assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
}
