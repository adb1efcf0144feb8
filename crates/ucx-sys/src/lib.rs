//! `ucx-sys` is the project's only door to UCX: bindgen bindings to the UCP
//! API in [`raw`], plus a thin single-threaded wrapper (one Rust object per C
//! handle, children holding their parents alive through `Rc`) that is just
//! enough for the service process to RDMA-read and -write host buffers: a
//! context, a worker, endpoints made from worker addresses, memory
//! registration with packed remote keys, and nonblocking or blocking get/put
//! and flush. It never starts threads, never installs callbacks, never
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
//! worker while the service process reads and writes that buffer, so only
//! transports that do one-sided RMA without target-side software are usable.
//! On a single machine with the transports of Debian's UCX 1.13.1 (self,
//! tcp, sysv, posix, cma), the two-process test in `tests/two_process.rs`
//! establishes:
//!
//! * `UCX_TLS=cma,tcp` (or `cma,tcp,self`): works. Wire-up of the endpoint
//!   goes over tcp without the target's involvement (UCX's unified-mode
//!   address carries everything the initiator needs), and the get/put are
//!   `process_vm_readv`/`process_vm_writev` zero-copy transfers done by the
//!   initiator alone. Needs ptrace permission over the target process
//!   (same uid and `kernel.yama.ptrace_scope` 0 or 1 with a parent/child
//!   relation or `PR_SET_PTRACER`).
//! * `UCX_TLS=tcp` alone: RMA over tcp is emulated with active messages, so
//!   it completes only while the target progresses its worker. Unusable for
//!   a host that never progresses.
//! * `sysv`/`posix` provide no remote keys for user memory mapped with
//!   [`MemHandle::map`], so they do not help for host buffers.
//!
//! On a BlueField the RMA path will be an RDMA transport (`rc`/`dc`, and the
//! cross-GVMI memory export that needs UCX >= 1.15); those are also one-sided.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

/// Raw bindgen output for `<ucp/api/ucp.h>` (`ucp_*`, `ucs_*`, `UCP_*`,
/// `UCS_*` only).
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
mod memory;
mod request;
pub mod status;
pub mod worker;

pub use context::{Context, Features};
pub use endpoint::{Endpoint, ErrorHandling, CLOSE_WAIT_LIMIT};
pub use memory::{MemHandle, RemoteKey};
pub use request::{Request, DROP_WAIT_LIMIT};
pub use status::{Error, Result, Status};
pub use worker::Worker;

/// How the build script found UCX (`UCX_DIR=...` or `pkg-config ucx X.Y.Z`).
pub const BUILD_PROBE: &str = env!("UCXSYS_BUILD_PROBE");
