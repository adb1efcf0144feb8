//! What the MPI subcommands (`overlap`, `late`, `traffic`) share: starting and ending MPI,
//! failing, the JSON Lines file of rank 0 and the run's description (mode, nodes).

use coll_bench::mpi::{Mpi, MpiError};
use std::fs::File;
use std::path::PathBuf;

/// `MPI_Init`; `None` (after saying why) if it failed.
pub fn init() -> Option<Mpi> {
    match Mpi::init() {
        Ok(m) => Some(m),
        Err(e) => {
            eprintln!("coll-bench: {e}");
            None
        }
    }
}

/// Reports a failed MPI call and aborts the job (other ranks may be blocked in a collective).
pub fn fail(e: MpiError) -> ! {
    eprintln!("coll-bench: {e}");
    Mpi::abort(1)
}

/// The `--json` file, created (by rank 0); a file that cannot be created aborts the job.
pub fn create_json(path: &Option<PathBuf>) -> Option<File> {
    let path = path.as_ref()?;
    match File::create(path) {
        Ok(f) => Some(f),
        Err(e) => {
            eprintln!("coll-bench: cannot create {}: {e}", path.display());
            Mpi::abort(2);
        }
    }
}

/// `MPI_Finalize`, then the exit code: 0 if everything validated, 1 if not or if MPI failed.
pub fn finish(mpi: Mpi, all_ok: bool) -> i32 {
    if let Err(e) = mpi.finalize() {
        eprintln!("coll-bench: {e}");
        return 1;
    }
    if all_ok {
        0
    } else {
        1
    }
}

/// "offload" if the host shim is preloaded, else "native".
pub fn mode() -> &'static str {
    match std::env::var("LD_PRELOAD") {
        Ok(p) if p.contains("host_shim") => "offload",
        _ => "native",
    }
}

/// The number of nodes of the run: SPOFF_NODES, 1 without it.
pub fn nodes() -> Result<u64, String> {
    match std::env::var("SPOFF_NODES") {
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("SPOFF_NODES={v:?} is not a positive integer")),
        Err(_) => Ok(1),
    }
}
