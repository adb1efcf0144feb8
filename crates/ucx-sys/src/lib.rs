//! `ucx-sys` is the project's only door to UCX: bindgen bindings to the UCP
//! API in [`raw`], plus a thin single-threaded wrapper (one Rust object per C
//! handle, children holding their parents alive through `Rc`) that is just
//! enough for the service process to RDMA-read and -write host buffers: a
//! context, a worker, endpoints made from worker addresses, memory
//! registration with packed remote keys, and nonblocking or blocking get/put
//! and flush. It never starts threads, never installs callbacks (except the
//! memory hook [`VmUnmappedHook`] on request), never
//! exchanges addresses or keys itself (moving those bytes between processes
//! is the caller's business), never does tag matching, streams or active
//! messages, and never hides a wait without saying so in the docs.
//!
//! # Layering
//!
//! [`raw`] is the bindgen output for `<ucp/api/ucp.h>`, narrowed to the
//! `ucp_*`/`ucs_*` names. C enums are generated as plain integer constants,
//! never Rust enums, so any value the library hands back is representable.
//! The static inline `ucp_init` is not bound; the wrapper calls
//! `ucp_init_version` with the header's API version, as `ucp_init` does.
//! The status-pointer macros are re-implemented in [`status`].
//!
//! The memory hooks of libucm (`ucm_*`, linked as `-lucm`) are bound too;
//! [`memhooks::VmUnmappedHook`] installs a handler for unmapped memory, the
//! one callback this crate installs, and only when asked to.
//!
//! The wrapper types are [`Context`] → [`Worker`] → [`Endpoint`] →
//! [`RemoteKey`], plus [`MemHandle`] (registered memory, child of the
//! context) and [`Request`] (an operation in flight, which keeps its endpoint
//! and key alive). None of them is `Send`: the workers are created in
//! single-thread mode, and a service process drives its worker from its
//! event loop (see [`worker`] for joining a mio loop).
//!
//! # Transports for memory whose owner never progresses
//!
//! A host MPI rank registers its buffer and then does not progress its UCX
//! worker while the service process reads and writes it, so only one-sided
//! paths are usable. With Debian's UCX 1.13.1 on one machine (transports
//! self, tcp, sysv, posix, cma), `tests/two_process.rs` establishes:
//!
//! * **Works without target progress:** memory the target got from
//!   [`MemHandle::allocate`] (UCX allocates it from the sysv or posix memory
//!   domain), reached with `UCX_TLS` = `sysv,posix`, `posix`, `sysv`, `sm`,
//!   or `tcp,sysv,posix` (also the default `all`), on an endpoint with
//!   [`ErrorHandling::None`]. Gets complete immediately as loads from the
//!   attached segment.
//! * **Needs target progress:** memory registered with [`MemHandle::map`]
//!   (any user buffer, which is what an MPI rank hands over). `cma` cannot
//!   be a UCP RMA lane in 1.13 (it has only zero-copy get/put, no put-short
//!   or bcopy, which RMA lanes require), and sysv/posix cannot register
//!   foreign memory, so UCP falls back to software emulation over active
//!   messages (tcp or shm), which only completes while the target
//!   progresses. `UCX_PROTO_ENABLE=y` does not change this in 1.13.
//! * **Needs target progress:** any endpoint with [`ErrorHandling::Peer`]:
//!   sysv/posix cannot detect peer failure, so they are excluded (with only
//!   them enabled, endpoint creation fails with "unreachable") and the
//!   operations run over tcp emulation plus a wire-up/keepalive handshake.
//!
//! So on this machine a host that never progresses must put the data it
//! exposes into UCX-allocated memory. On a BlueField, RDMA transports
//! (`rc`/`dc`) register user memory and are one-sided; the cross-GVMI path
//! additionally needs `UCP_FEATURE_EXPORTED_MEMH` (UCX >= 1.15).
//!
//! # Exported memory handles (UCX >= 1.15)
//!
//! Built against a UCX whose headers have `UCP_MEMH_PACK_FLAG_EXPORT`
//! (`UCX_DIR=$(scripts/ucx-wheel.sh)`: the PyPI wheel `libucx-cu12`, UCX
//! 1.22), [`EXPORT_API`] is true and [`MemHandle::export_pack`] /
//! [`MemHandle::import`] call UCX; [`Endpoint::get_nbx_memh`] /
//! [`Endpoint::put_nbx_memh`] name the local buffer's memory handle (an
//! imported one is how a BlueField SP reaches host memory). With UCX 1.22 on
//! this machine (transports self, tcp, sysv, posix, cma; no InfiniBand
//! device) no memory domain can export: `ucp_memh_pack` with the export flag
//! returns `UCS_ERR_UNSUPPORTED` for user and UCX-allocated memory under every
//! `UCX_TLS` (`tests/export.rs`). Only the mlx5 memory domain of a
//! BlueField (cross-GVMI) exports. `ucp_mem_map` of an exported buffer trusts
//! its contents (bytes of 0xff crash 1.22's importer): callers must check
//! them first.
//!
//! Built against 1.22, the tests written for 1.13's one-sidedness do not
//! all hold: `two_process::registered_user_memory_needs_target_progress`
//! fails because with `UCX_TLS=cma,tcp` a get on registered user memory
//! completes although the target never progresses (cma is an RMA lane
//! there; with `tcp` alone it still waits for the target), and
//! alias-mkey's `host_that_stops_progressing_times_out...` fails likewise.
//! `make test` builds against Debian's 1.13, where they hold; `make
//! ucx-export-test` runs only the export tests against 1.22.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

/// Raw bindgen output for `<ucp/api/ucp.h>` and `<ucm/api/ucm.h>` (`ucp_*`,
/// `ucs_*`, `ucm_*`, `UCP_*`, `UCS_*`, `UCM_*` only).
#[allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code,
    missing_docs,
    unsafe_op_in_unsafe_fn,
    clippy::all
)]
pub mod raw {
    include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
}

mod context;
mod endpoint;
pub mod memhooks;
mod memory;
mod request;
pub mod status;
pub mod worker;

pub use context::{Context, Features};
pub use endpoint::{close_all, CloseReport, Endpoint, ErrorHandling, RemoteKey, CLOSE_WAIT_LIMIT};
pub use memhooks::VmUnmappedHook;
pub use memory::MemHandle;
pub use request::{Request, DROP_WAIT_LIMIT};
pub use status::{Error, Result, Status};
pub use worker::Worker;

/// How the build script found UCX (`UCX_DIR=... X.Y` or `pkg-config ucx X.Y.Z`).
pub const BUILD_PROBE: &str = env!("UCXSYS_BUILD_PROBE");

/// True if built against a UCX with exported memory handles (UCX >= 1.15: `ucp_memh_pack` with
/// `UCP_MEMH_PACK_FLAG_EXPORT`, `ucp_mem_map` of an exported buffer). Without it
/// [`MemHandle::export_pack`] and [`MemHandle::import`] fail with `UCS_ERR_UNSUPPORTED` and the
/// op name says why.
pub const EXPORT_API: bool = cfg!(ucx_export);

/// The version of the UCX library loaded at run time (`ucp_get_version`): (major, minor,
/// release). It may differ from the headers' (see [`BUILD_PROBE`]) if the loader found another
/// UCX (e.g. the system's, for a binary built with `UCX_DIR` but run without its
/// `LD_LIBRARY_PATH`).
pub fn library_version() -> (u32, u32, u32) {
    let (mut major, mut minor, mut release) = (0u32, 0u32, 0u32);
    // SAFETY: three valid out-pointers; the call has no other effect.
    unsafe { raw::ucp_get_version(&mut major, &mut minor, &mut release) };
    (major, minor, release)
}
