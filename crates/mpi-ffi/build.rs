//! Finds the system MPI and generates bindings for it.
//!
//! `MPI_FLAVOUR=openmpi|mpich` chooses the MPI family (the ABI the bindings and so the host
//! shim are built for); unset, the first MPI the probes find is used, whatever its family.
//!
//! Probe order (every failure reason is printed if all fail):
//! 1. `MPI_DIR`: `$MPI_DIR/include` and `$MPI_DIR/lib`, linking `-lmpi` (`-lmpich` for
//!    `MPI_FLAVOUR=mpich`).
//! 2. The compiler wrapper named by `MPICC` (default `mpicc`; `mpicc.mpich` for
//!    `MPI_FLAVOUR=mpich`, `mpicc.openmpi` for `MPI_FLAVOUR=openmpi` when it exists):
//!    `--showme:compile` and `--showme:link` (Open MPI), then `-show` (MPICH).
//! 3. pkg-config: `ompi-c`, then `mpich` (only the one of `MPI_FLAVOUR` when it is set).
//!
//! The family of the header found is then read from the header itself (the preprocessor on
//! `csrc/flavour.c`: `OPEN_MPI` or `MPICH_VERSION`); a mismatch with `MPI_FLAVOUR` is an
//! error. It becomes `cfg(mpi_flavour = "openmpi" | "mpich")` of this crate and
//! `mpi_ffi::abi::FLAVOUR`.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

struct Found {
    include_dirs: Vec<PathBuf>,
    lib_dirs: Vec<PathBuf>,
    libs: Vec<String>,
    how: String,
}

fn from_flags(flags: &str, how: String) -> Found {
    let mut found = Found {
        include_dirs: vec![],
        lib_dirs: vec![],
        libs: vec![],
        how,
    };
    for word in flags.split_whitespace() {
        if let Some(dir) = word.strip_prefix("-I") {
            found.include_dirs.push(dir.into());
        } else if let Some(dir) = word.strip_prefix("-L") {
            found.lib_dirs.push(dir.into());
        } else if let Some(lib) = word.strip_prefix("-l") {
            found.libs.push(lib.to_string());
        } else if let Some(dir) = word.strip_prefix("-Wl,-rpath,") {
            found.lib_dirs.push(dir.into());
        }
    }
    found
}

/// `MPI_FLAVOUR`, checked: `None` when unset.
fn wanted_flavour() -> Option<&'static str> {
    match env::var("MPI_FLAVOUR").ok()?.as_str() {
        "" => None,
        "openmpi" => Some("openmpi"),
        "mpich" => Some("mpich"),
        other => panic!("MPI_FLAVOUR={other}: expected openmpi or mpich"),
    }
}

fn probe_env() -> Result<Found, String> {
    let dir = env::var("MPI_DIR").map_err(|_| "MPI_DIR is not set".to_string())?;
    let dir = PathBuf::from(dir);
    if !dir.join("include/mpi.h").exists() {
        return Err(format!("MPI_DIR={} has no include/mpi.h", dir.display()));
    }
    Ok(Found {
        include_dirs: vec![dir.join("include")],
        lib_dirs: vec![dir.join("lib")],
        libs: vec![if wanted_flavour() == Some("mpich") {
            "mpich".into()
        } else {
            "mpi".into()
        }],
        how: format!("MPI_DIR={}", dir.display()),
    })
}

fn run(cmd: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("`{cmd} {}` could not run: {e}", args.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "`{cmd} {}` exited with {}",
            args.join(" "),
            out.status
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn probe_wrapper() -> Result<Found, String> {
    let mpicc = env::var("MPICC").unwrap_or_else(|_| {
        match wanted_flavour() {
            Some("mpich") => "mpicc.mpich",
            Some(_) if Path::new("/usr/bin/mpicc.openmpi").exists() => "mpicc.openmpi",
            _ => "mpicc",
        }
        .into()
    });
    match (
        run(&mpicc, &["--showme:compile"]),
        run(&mpicc, &["--showme:link"]),
    ) {
        (Ok(c), Ok(l)) => Ok(from_flags(&format!("{c} {l}"), format!("{mpicc} --showme"))),
        (Err(e), _) | (_, Err(e)) => {
            let show = run(&mpicc, &["-show"]).map_err(|e2| format!("{e}; {e2}"))?;
            Ok(from_flags(&show, format!("{mpicc} -show")))
        }
    }
}

fn probe_pkg_config() -> Result<Found, String> {
    let mut errors = vec![];
    let names: &[&str] = match wanted_flavour() {
        Some("mpich") => &["mpich"],
        Some(_) => &["ompi-c"],
        None => &["ompi-c", "mpich"],
    };
    for &name in names {
        match pkg_config::Config::new().cargo_metadata(false).probe(name) {
            Ok(lib) => {
                return Ok(Found {
                    include_dirs: lib.include_paths,
                    lib_dirs: lib.link_paths,
                    libs: lib.libs,
                    how: format!("pkg-config {name}"),
                })
            }
            Err(e) => errors.push(format!("pkg-config {name}: {e}")),
        }
    }
    Err(errors.join("; "))
}

/// The family of the found `mpi.h` (`openmpi` or `mpich`), from its own macros.
fn flavour_of(found: &Found) -> &'static str {
    let mut pre = cc::Build::new();
    pre.file("csrc/flavour.c").cargo_metadata(false);
    for dir in &found.include_dirs {
        pre.include(dir);
    }
    let out = pre
        .try_expand()
        .unwrap_or_else(|e| panic!("the preprocessor failed on mpi.h ({}): {e}", found.how));
    let out = String::from_utf8_lossy(&out);
    let line = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("MPIFFI_FLAVOUR = "))
        .unwrap_or("unknown");
    match line.trim() {
        "openmpi" => "openmpi",
        "mpich" => "mpich",
        _ => panic!(
            "the mpi.h found ({}) is neither Open MPI (OPEN_MPI) nor of the MPICH family \
             (MPICH_VERSION): its ABI is not supported",
            found.how
        ),
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=MPI_DIR");
    println!("cargo:rerun-if-env-changed=MPICC");
    println!("cargo:rerun-if-env-changed=MPI_FLAVOUR");
    println!("cargo:rerun-if-changed=csrc/flavour.c");
    println!("cargo::rustc-check-cfg=cfg(mpi_flavour, values(\"openmpi\", \"mpich\"))");
    println!("cargo:rerun-if-changed=csrc/mpi_ffi.h");
    println!("cargo:rerun-if-changed=csrc/mpi_ffi.c");

    let mut reasons = vec![];
    let mut found = None;
    for probe in [probe_env, probe_wrapper, probe_pkg_config] {
        match probe() {
            Ok(f) => {
                found = Some(f);
                break;
            }
            Err(e) => reasons.push(e),
        }
    }
    let Some(found) = found else {
        panic!(
            "no MPI installation found. Tried, in order:\n  - {}\nInstall one (Debian/Ubuntu: \
             apt-get install openmpi-bin libopenmpi-dev) or set MPI_DIR.",
            reasons.join("\n  - ")
        );
    };

    // How MPI was found, for `mpi_ffi::FOUND_VIA`.
    println!("cargo:rustc-env=MPI_FFI_FOUND_VIA={}", found.how);

    let flavour = flavour_of(&found);
    if let Some(wanted) = wanted_flavour() {
        if wanted != flavour {
            panic!(
                "MPI_FLAVOUR={wanted}, but the MPI found ({}) is {flavour}; point MPICC or \
                 MPI_DIR at a {wanted} installation",
                found.how
            );
        }
    }
    println!("cargo:rustc-cfg=mpi_flavour=\"{flavour}\"");
    println!("cargo:flavour={flavour}");

    let mut build = cc::Build::new();
    build.file("csrc/mpi_ffi.c").warnings(true);
    for dir in &found.include_dirs {
        build.include(dir);
    }
    build.compile("mpi_ffi_consts");

    for dir in &found.lib_dirs {
        println!("cargo:rustc-link-search=native={}", dir.display());
    }
    for lib in &found.libs {
        println!("cargo:rustc-link-lib={lib}");
    }
    // Lets dependents (the shim, test programs) find the library at run time.
    if let Some(dir) = found.lib_dirs.first() {
        println!("cargo:libdir={}", dir.display());
    }

    let mut bindings = bindgen::Builder::default()
        .header("csrc/mpi_ffi.h")
        .allowlist_function("P?MPI_.*|mpiffi_.*")
        .allowlist_type("MPI_.*|ompi_status_public_t")
        .allowlist_var("MPIFFI_.*|MPI_MAX_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .derive_default(true)
        .layout_tests(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for dir in &found.include_dirs {
        bindings = bindings.clang_arg(format!("-I{}", dir.display()));
    }
    let bindings = bindings.generate().expect("bindgen failed on mpi.h");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("mpi_bindings.rs");
    bindings
        .write_to_file(out)
        .expect("could not write bindings");
}
