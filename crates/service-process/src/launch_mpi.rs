//! Which MPI a launched job runs under, and what follows from it: the launcher program and its
//! flags, and the host shim built for that MPI's ABI.
//!
//! Two families are supported, with different ABIs (an Open MPI program cannot load a shim
//! built against MPICH's `mpi.h`, nor the reverse): Open MPI (`mpirun`, `libhost_shim.so`)
//! and the MPICH family (Hydra's `mpiexec.mpich`, `libhost_shim_mpich.so`). Unless `--mpi`
//! says which, the program's own dynamic libraries decide (`ldd`): `libmpich.so.*` or
//! `libmpi.so.12` (MPICH's ABI version, which MVAPICH and Intel MPI also use) is the MPICH
//! family, any other `libmpi.so.*` is Open MPI. A program that links neither (a wrapper
//! script, say) runs under Open MPI, with a note saying so.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// An MPI family, that is an ABI and a launcher.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mpi {
    OpenMpi,
    Mpich,
}

bootstrap::from_word!(Mpi, ["openmpi" => Mpi::OpenMpi, "mpich" => Mpi::Mpich], |s, words| {
    format!("unknown MPI `{s}`: expected {words}")
});

impl Mpi {
    pub fn name(self) -> &'static str {
        match self {
            Mpi::OpenMpi => "openmpi",
            Mpi::Mpich => "mpich",
        }
    }

    /// The file name of the host shim built for this ABI (next to `service-process`).
    pub fn shim_file(self) -> &'static str {
        match self {
            Mpi::OpenMpi => "libhost_shim.so",
            Mpi::Mpich => "libhost_shim_mpich.so",
        }
    }

    /// The launcher used when `--mpirun` does not name one.
    pub fn default_launcher(self) -> &'static str {
        match self {
            Mpi::OpenMpi => "mpirun",
            Mpi::Mpich => "mpiexec.mpich",
        }
    }

    /// The launcher's arguments for `np` ranks, no binding (the launcher's `rank-exec` pins),
    /// as many ranks as asked whatever the core count, and `exported` passed to every rank
    /// from the launcher's environment (values never appear on the command line: the job
    /// credential is a secret).
    pub fn launcher_args(self, np: u32, exported: &[&str]) -> Vec<String> {
        let mut args: Vec<String> = Vec::new();
        match self {
            Mpi::OpenMpi => {
                args.extend(["--oversubscribe", "--bind-to", "none", "-np"].map(String::from));
                args.push(np.to_string());
                for var in exported {
                    args.push("-x".into());
                    args.push((*var).into());
                }
            }
            Mpi::Mpich => {
                // Hydra starts any number of ranks on the local host (no oversubscription
                // check) and binds nothing unless asked.
                args.extend(["-np".to_string(), np.to_string()]);
                args.extend(["-bind-to", "none"].map(String::from));
                if !exported.is_empty() {
                    args.push("-genvlist".into());
                    args.push(exported.join(","));
                }
            }
        }
        args
    }
}

/// The MPI family of the libraries `ldd` lists, if one is recognised.
pub fn family_of_ldd(ldd_output: &str) -> Option<Mpi> {
    let mut found = None;
    for line in ldd_output.lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let this = if name.starts_with("libmpich.so") || name == "libmpi.so.12" {
            Some(Mpi::Mpich)
        } else if name.starts_with("libmpi.so") {
            Some(Mpi::OpenMpi)
        } else {
            None
        };
        if this.is_some() {
            // The C library itself decides; the first one listed is the program's own.
            found = found.or(this);
        }
    }
    found
}

/// `program` as a path: itself if it names a directory, else its first match on `PATH`.
fn resolve(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// The MPI `program` is linked against; `None` when it links no recognised MPI library.
pub fn detect(program: &str) -> Result<Option<Mpi>> {
    let path =
        resolve(program).with_context(|| format!("program `{program}` not found on PATH"))?;
    if !path.is_file() {
        bail!("program {} not found", path.display());
    }
    let out = Command::new("ldd")
        .arg(&path)
        .output()
        .context("running ldd to see which MPI the program uses (pass --mpi to skip it)")?;
    // ldd fails on a file that is not a dynamic executable (a script): no MPI recognised.
    Ok(family_of_ldd(&String::from_utf8_lossy(&out.stdout)))
}

/// The MPI of a job: `--mpi` if given, else detected from `program`.
pub fn choose(given: Option<Mpi>, program: &str) -> Result<Mpi> {
    if let Some(mpi) = given {
        return Ok(mpi);
    }
    Ok(detect(program)?.unwrap_or_else(|| {
        eprintln!(
            "service-process launch: {program} links no MPI library recognised (libmpi.so, \
             libmpich.so); running it under Open MPI (--mpi chooses)"
        );
        Mpi::OpenMpi
    }))
}

/// The shim for `mpi` next to `exe`, which must exist.
pub fn default_shim(exe: &Path, mpi: Mpi) -> Result<PathBuf> {
    let shim = exe.with_file_name(mpi.shim_file());
    if !shim.exists() {
        bail!(
            "host shim {} for {} not found: `make build` builds it{}, or pass --shim",
            shim.display(),
            mpi.name(),
            match mpi {
                Mpi::OpenMpi => " (or `cargo build --release -p host-shim`)",
                Mpi::Mpich => " (or `scripts/build-mpich.sh`)",
            }
        );
    }
    Ok(shim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_from_ldd() {
        let ompi = "\tlinux-vdso.so.1 (0x00007ffc)\n\tlibmpi.so.40 => /lib/x86_64-linux-gnu/libmpi.so.40 (0x1)\n\tlibc.so.6 => /lib/libc.so.6 (0x2)\n";
        assert_eq!(family_of_ldd(ompi), Some(Mpi::OpenMpi));
        let mpich = "\tlibmpich.so.12 => /lib/x86_64-linux-gnu/libmpich.so.12 (0x1)\n";
        assert_eq!(family_of_ldd(mpich), Some(Mpi::Mpich));
        let mvapich = "\tlibmpi.so.12 => /opt/mvapich2/lib/libmpi.so.12 (0x1)\n";
        assert_eq!(family_of_ldd(mvapich), Some(Mpi::Mpich));
        let fortran = "\tlibmpi_mpifh.so.40 => /x (0x1)\n\tlibmpi.so.40 => /y (0x2)\n";
        assert_eq!(family_of_ldd(fortran), Some(Mpi::OpenMpi));
        assert_eq!(family_of_ldd("\tnot a dynamic executable\n"), None);
        assert_eq!(family_of_ldd("\tlibc.so.6 => /lib/libc.so.6 (0x2)\n"), None);
    }

    #[test]
    fn launcher_flags_by_family() {
        let o = Mpi::OpenMpi.launcher_args(4, &["A", "B"]);
        assert_eq!(
            o,
            [
                "--oversubscribe",
                "--bind-to",
                "none",
                "-np",
                "4",
                "-x",
                "A",
                "-x",
                "B"
            ]
        );
        let m = Mpi::Mpich.launcher_args(4, &["A", "B"]);
        assert_eq!(m, ["-np", "4", "-bind-to", "none", "-genvlist", "A,B"]);
        assert!(!m.iter().any(|a| a.contains("oversubscribe")));
    }

    #[test]
    fn names_parse_and_unknown_ones_are_refused() {
        assert_eq!("mpich".parse::<Mpi>(), Ok(Mpi::Mpich));
        assert_eq!("openmpi".parse::<Mpi>(), Ok(Mpi::OpenMpi));
        assert!("intel"
            .parse::<Mpi>()
            .unwrap_err()
            .contains("expected openmpi or mpich"));
    }

    #[test]
    fn a_missing_program_or_shim_is_a_clear_error() {
        let e = detect("/nonexistent/prog").unwrap_err().to_string();
        assert!(e.contains("not found"), "{e}");
        let e = default_shim(Path::new("/nonexistent/service-process"), Mpi::Mpich)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("libhost_shim_mpich.so for mpich not found"),
            "{e}"
        );
    }
}
