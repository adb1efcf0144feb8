//! Build script for `ucx-sys`: find UCX, tell cargo how to link it, and run
//! bindgen over `wrapper.h`.
//!
//! Probe order (the first one that succeeds wins):
//!
//! 1. `UCX_DIR` environment variable: headers from `$UCX_DIR/include`,
//!    libraries from `$UCX_DIR/lib` (`ucp`, `uct`, `ucs`, `ucm`). The directory must
//!    contain `include/ucp/api/ucp.h`.
//! 2. pkg-config package `ucx`, at least version 1.12 (Debian: `libucx-dev`).
//!
//! If every probe fails the build panics with the reason each one failed.
//!
//! Exported memory handles: if the `ucp.h` found has `UCP_MEMH_PACK_FLAG_EXPORT` (UCX >= 1.15),
//! the crate is built with `--cfg ucx_export` and binds `ucp_memh_pack` and friends
//! (`ucx_sys::EXPORT_API` says which). Debian's 1.13 does not have it; `scripts/ucx-wheel.sh`
//! installs a UCX that does (`UCX_DIR=$(scripts/ucx-wheel.sh)`).
//!
//! With `UCX_DIR`, this crate's own binaries and tests get an rpath to `$UCX_DIR/lib`, so they
//! load that UCX and not the system's; dependents run with `LD_LIBRARY_PATH=$UCX_DIR/lib` (or
//! from a target directory containing it, which cargo adds to the search path itself).

use std::env;
use std::path::{Path, PathBuf};

const MIN_UCX_VERSION: &str = "1.12";

/// A way of finding UCX: what it found, or why it did not.
type Probe = fn() -> Result<Found, String>;

struct Found {
    include_paths: Vec<PathBuf>,
    how: String,
}

fn probe_ucx_dir() -> Result<Found, String> {
    let dir = match env::var_os("UCX_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => return Err("UCX_DIR is not set".to_string()),
    };
    let include = dir.join("include");
    let lib = dir.join("lib");
    let header = include.join("ucp/api/ucp.h");
    if !header.is_file() {
        return Err(format!(
            "UCX_DIR={} but {} does not exist",
            dir.display(),
            header.display()
        ));
    }
    if !lib.is_dir() {
        return Err(format!(
            "UCX_DIR={} but {} is not a directory",
            dir.display(),
            lib.display()
        ));
    }
    println!("cargo:rustc-link-search=native={}", lib.display());
    // This crate's own binaries and tests: load this UCX, not the system's.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // `ucm`: the memory hooks (`ucm_set_event_handler`), bound in `ucx_sys::memhooks`.
    for l in ["ucp", "uct", "ucs", "ucm"] {
        println!("cargo:rustc-link-lib={l}");
    }
    let version = header_version(&include).unwrap_or_else(|| "(version unknown)".into());
    Ok(Found {
        include_paths: vec![include],
        how: format!("UCX_DIR={} {version}", dir.display()),
    })
}

/// `major.minor` from `ucp/api/ucp_version.h` under `include`.
fn header_version(include: &Path) -> Option<String> {
    let text = std::fs::read_to_string(include.join("ucp/api/ucp_version.h")).ok()?;
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("#define") && w.next() == Some(name))
                .then(|| w.next().map(str::to_string))
                .flatten()
        })
    };
    Some(format!(
        "{}.{}",
        field("UCP_API_MAJOR")?,
        field("UCP_API_MINOR")?
    ))
}

/// True if the `ucp.h` found first on `include_paths` (then the system directories) declares
/// the exported-memory-handle API (UCX >= 1.15).
fn has_export_api(include_paths: &[PathBuf]) -> bool {
    let system = [
        PathBuf::from("/usr/include"),
        PathBuf::from("/usr/local/include"),
    ];
    include_paths
        .iter()
        .chain(system.iter())
        .map(|p| p.join("ucp/api/ucp.h"))
        .find(|h| h.is_file())
        .and_then(|h| {
            println!("cargo:rerun-if-changed={}", h.display());
            std::fs::read_to_string(h).ok()
        })
        .is_some_and(|t| t.contains("UCP_MEMH_PACK_FLAG_EXPORT"))
}

fn probe_pkg_config() -> Result<Found, String> {
    match pkg_config::Config::new()
        .atleast_version(MIN_UCX_VERSION)
        .probe("ucx")
    {
        Ok(lib) => Ok(Found {
            include_paths: lib.include_paths.clone(),
            how: format!("pkg-config ucx {}", lib.version),
        }),
        Err(e) => Err(format!("pkg-config ucx >= {MIN_UCX_VERSION}: {e}")),
    }
}

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=UCX_DIR");

    let probes: [(&str, Probe); 2] = [("UCX_DIR", probe_ucx_dir), ("pkg-config", probe_pkg_config)];
    let mut reasons = Vec::new();
    let mut found = None;
    for (name, probe) in probes {
        match probe() {
            Ok(f) => {
                found = Some(f);
                break;
            }
            Err(e) => reasons.push(format!("  - {name}: {e}")),
        }
    }
    let found = found.unwrap_or_else(|| {
        panic!(
            "ucx-sys: could not find UCX (>= {MIN_UCX_VERSION}). Probes tried, in order:\n{}\n\
             Install the development package (Debian/Ubuntu: `apt-get install libucx-dev`), \
             or set UCX_DIR to a UCX install prefix containing include/ucp/api/ucp.h and lib/.",
            reasons.join("\n")
        )
    });
    // Exposed as `ucx_sys::BUILD_PROBE` so a binary can say which UCX it was built against.
    println!("cargo:rustc-env=UCXSYS_BUILD_PROBE={}", found.how);
    println!("cargo:rustc-check-cfg=cfg(ucx_export)");
    if has_export_api(&found.include_paths) {
        println!("cargo:rustc-cfg=ucx_export");
        // For dependents' build scripts: DEP_UCP_EXPORT=1.
        println!("cargo:export=1");
    }
    for p in &found.include_paths {
        println!("cargo:include={}", p.display());
    }

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .allowlist_function("ucp_.*|ucm_.*|ucs_status_string")
        .allowlist_type("uc[psm]_.*")
        .allowlist_var("UC[PSM]_.*")
        // Never generate Rust enums from C enums: a value the C side returns
        // that is not listed in the header would be undefined behaviour.
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(true)
        .generate_comments(false);
    for p in &found.include_paths {
        builder = builder.clang_arg(format!("-I{}", Path::new(p).display()));
    }
    let bindings = builder
        .generate()
        .expect("ucx-sys: bindgen failed on wrapper.h");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("bindings.rs");
    bindings
        .write_to_file(&out)
        .expect("ucx-sys: could not write bindings.rs");
}
