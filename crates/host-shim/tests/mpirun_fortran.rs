//! Fortran programs offloaded: `progs/fortran/fcheck.F90` built as an `include 'mpif.h'`, a
//! `use mpi` and a `use mpi_f08` program with the MPI's Fortran compiler, run by the real
//! launcher on real SPs (2 nodes x 2 ranks): every collective the shim offloads, called from
//! Fortran with counts drawn from a printed seed (zeros included), `MPI_IN_PLACE`, derived
//! types, sub-communicators, and every call of the Wait/Test family over arrays mixing
//! offloaded, native and null requests; each result compared inside the program with a
//! native reference (the library's own Fortran `PMPI_*` binding under Open MPI; see
//! `fcheck.F90` for MPICH), and the SPs' counters proving that every eligible
//! call of every rank was offloaded. The same programs with the shim preloaded but not active
//! run through the library's own Fortran functions, unchanged. Under Open MPI by default;
//! `SPOFF_TEST_MPI=mpich` (`make test-mpich`) runs the same tests under MPICH, and
//! `mpirun_fortran_mpich.rs` runs the offloaded programs under MPICH in `make test`.

mod common;
mod fortran;

use common::*;
use fortran::{fcheck, Flavour, FLAVOURS};

/// The Fortran compiler of the MPI the tests run under.
fn compiler() -> &'static str {
    match mpi() {
        Mpi::OpenMpi => "mpifort",
        Mpi::Mpich => "mpifort.mpich",
    }
}

/// `fcheck` of `flavour` under the launcher with `sps_per_node` SPs per node and `layout`:
/// passes by its own verdict, and the SPs posted exactly its eligible calls of every rank.
fn fcheck_offloads(flavour: Flavour, sps_per_node: u32, layout: &str) {
    let _serial = serial();
    let prog = fcheck(flavour, compiler());
    let seed = integration_tests::seed().to_string();
    let run = launch_with(
        sps_per_node,
        &["--layout", layout],
        &[&prog, "2", &seed],
        &[],
    );
    assert_offloaded(&run, flavour.name(), 2 * sps_per_node as usize);
    assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
    eprintln!(
        "{} seed {seed}: {} posts, {} packed",
        flavour.name(),
        run.sp_total("posts"),
        run.sp_total("posts_packed")
    );
    // The strided broadcasts and the derived-type allgathers went packed.
    assert!(run.sp_total("posts_packed") > 0, "{}", run.stderr);
}

#[test]
fn mpifh_program_is_offloaded_and_matches_native() {
    fcheck_offloads(Flavour::Mpifh, 1, "block");
}

#[test]
fn use_mpi_program_is_offloaded_and_matches_native() {
    fcheck_offloads(Flavour::UseMpi, 2, "cyclic");
}

#[test]
fn use_mpi_f08_program_is_offloaded_and_matches_native() {
    fcheck_offloads(Flavour::F08, 1, "cyclic");
}

#[test]
fn fortran_programs_with_an_inactive_shim_run_natively() {
    let _serial = serial();
    let seed = integration_tests::seed().to_string();
    for flavour in FLAVOURS {
        if flavour == Flavour::F08 && mpi() == Mpi::Mpich {
            // MPICH 4.0.2's own mpi_f08 Waitany/Testany/Waitsome/Testsome give 0-based
            // indices: the program fails natively (with the shim active its entries give
            // Fortran's 1-based ones).
            continue;
        }
        let prog = fcheck(flavour, compiler());
        // Preloaded, not configured: every Fortran call goes to the library's own function,
        // and the job says once that nothing is configured.
        let run = mpirun_preloaded(&[&prog, "1", &seed], &[]);
        verdict(&run, flavour.name());
        let lines = shim_lines(&run.stderr);
        assert_eq!(lines.len(), 1, "{}", run.stderr);
        assert!(lines[0].contains("set on none of its"), "{}", run.stderr);
        // Next to real SPs, disabled: nothing reaches them.
        let run = launch(1, &[&prog, "1", &seed], &[("SPOFF_OFFLOAD", "0")]);
        verdict(&run, flavour.name());
        assert_eq!(run.sp_total("posts"), 0, "{}", run.stderr);
        assert_eq!(run.sp_stats().len(), 2, "{}", run.stderr);
    }
}
