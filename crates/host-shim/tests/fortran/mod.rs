//! The Fortran test programs, `progs/fortran/fcheck.F90` in its three forms and
//! `progs/fortran/freduce.F90`, built with an MPI's Fortran compiler for the mpirun tests.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;

/// How a Fortran program reaches MPI.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Flavour {
    /// `include 'mpif.h'`
    Mpifh,
    /// `use mpi`
    UseMpi,
    /// `use mpi_f08`
    F08,
}

pub const FLAVOURS: [Flavour; 3] = [Flavour::Mpifh, Flavour::UseMpi, Flavour::F08];

impl Flavour {
    /// The program's name in its verdict line.
    pub fn name(self) -> &'static str {
        match self {
            Flavour::Mpifh => "fcheck_mpifh",
            Flavour::UseMpi => "fcheck_mpi",
            Flavour::F08 => "fcheck_f08",
        }
    }

    fn flags(self) -> &'static [&'static str] {
        match self {
            // Without interfaces gfortran (10 and later) refuses one buffer argument given an
            // array in one call and the scalar MPI_IN_PLACE in another, unless told otherwise.
            Flavour::Mpifh => &["-DMPIFH", "-fallow-argument-mismatch", "-w"],
            Flavour::UseMpi => &["-DUSE_MPI"],
            Flavour::F08 => &["-DF08"],
        }
    }
}

/// `progs/fortran/fcheck.F90` compiled for `flavour` with the MPI's Fortran compiler
/// `compiler` (`mpifort`, `mpifort.mpich`), once per test process.
pub fn fcheck(flavour: Flavour, compiler: &'static str) -> String {
    build("fcheck", flavour.name(), flavour, compiler)
}

/// `progs/fortran/freduce.F90` (the SP-tree allreduce from Fortran, `include 'mpif.h'`)
/// compiled with `compiler`, once per test process.
pub fn freduce(compiler: &'static str) -> String {
    build("freduce", "freduce", Flavour::Mpifh, compiler)
}

/// `progs/fortran/<file>.F90` compiled for `flavour` with `compiler` into a program `name`.
fn build(file: &str, name: &'static str, flavour: Flavour, compiler: &'static str) -> String {
    static BUILT: Mutex<BTreeMap<(&str, &str), String>> = Mutex::new(BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    built
        .entry((name, compiler))
        .or_insert_with(|| {
            let src = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join(format!("tests/progs/fortran/{file}.F90"));
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join("host-shim-fortran")
                .join(compiler);
            std::fs::create_dir_all(&dir).unwrap();
            // A private name, then a rename: concurrent test runs never see half a binary.
            let tmp = dir.join(format!("{}.{}", name, std::process::id()));
            // Each compile in a directory of its own: the module flavours write .mod files.
            let work = dir.join(format!("{}.{}.d", name, std::process::id()));
            std::fs::create_dir_all(&work).unwrap();
            let st = Command::new(compiler)
                .current_dir(&work)
                .args(["-O1", "-Wall"])
                .args(flavour.flags())
                .arg("-o")
                .arg(&tmp)
                .arg(&src)
                .status()
                .unwrap_or_else(|e| {
                    panic!("cannot run {compiler} (install gfortran and the MPI: `make deps`): {e}")
                });
            std::fs::remove_dir_all(&work).ok();
            assert!(
                st.success(),
                "{compiler} failed on {} ({flavour:?})",
                src.display()
            );
            let out = dir.join(name);
            std::fs::rename(&tmp, &out).unwrap();
            out.display().to_string()
        })
        .clone()
}
