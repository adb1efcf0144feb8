//! Fortran programs under MPICH's ABI (`libhost_shim_mpich.so`): `progs/fortran/fcheck.F90`
//! as an `include 'mpif.h'`, a `use mpi` and a `use mpi_f08` program built with
//! `mpifort.mpich`, run by Hydra through the real launcher and real SPs on 2 nodes x 2 ranks.
//! Each result is compared inside the program with native MPICH calls the shim never
//! intercepts (MPICH's Fortran `PMPI_*` call the C `MPI_*` functions, which it does); the SPs'
//! counters prove every eligible call of every rank was offloaded. The launcher finds MPICH
//! from the program's libraries.

mod common;
mod fortran;

use common::*;
use fortran::{fcheck, FLAVOURS};

#[test]
fn mpich_fortran_programs_are_offloaded_and_match_native() {
    use_mpi(Mpi::Mpich);
    let _serial = serial();
    let seed = integration_tests::seed().to_string();
    for flavour in FLAVOURS {
        let prog = fcheck(flavour, "mpifort.mpich");
        let run = launch_with(1, &["--layout", "cyclic"], &[&prog, "2", &seed], &[]);
        assert_offloaded(&run, flavour.name(), 2);
        assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
        eprintln!("{} under MPICH, seed {seed}: offloaded", flavour.name());
    }
}
