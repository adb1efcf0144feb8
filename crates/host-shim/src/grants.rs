//! Grants on the program's buffers: the `cma` backend (default), `ucx` (`SPOFF_BACKEND=ucx`) or
//! `ucx-export` (`SPOFF_BACKEND=ucx-export`, the BlueField alias-key path).
//!
//! The mailbox is always a `cma` grant: the SP writes completion flags into it with
//! `process_vm_writev`. With `ucx`, send and receive buffers are `ucp_mem_map`ped by an
//! [`UcxRegistrar`] and granted with the packed remote key and this rank's worker address; the
//! SP (with UCX on: `serve --ucx`) reads and writes them with `ucp_get_nbx` / `ucp_put_nbx`.
//!
//! # The host must progress (UCX 1.13 here)
//!
//! With Debian's UCX 1.13 over tcp and shared memory, RMA on `ucp_mem_map`ped user memory is
//! emulated over active messages and completes only while this process progresses its worker.
//! Every wait loop of the shim therefore calls [`Grants::progress`] on each pass (the
//! Wait/Test family, slot harvesting, `MPI_Finalize`), and a Wait-family call on native
//! requests only, while offloaded collectives of the rank are outstanding, tests them in such a
//! loop instead of blocking in `PMPI_Wait*` (`wait::wait_natives`). So on this machine the `ucx`
//! backend only moves data while the program is inside MPI: it does not overlap with the
//! program's computation. Other blocking native calls (`MPI_Recv`, `MPI_Barrier`, a collective
//! the shim does not offload) do not progress it: a program blocked in one while the SP needs
//! its buffers stalls that collective until the SP's 10 s transfer bound fails it (a progress
//! thread would lift this; not built). On InfiniBand RC/DC (or with exported memory keys, UCX >= 1.15) the NIC serves
//! the accesses and no progress is needed.
//!
//! # Invalidation
//!
//! Registrations are cached across collectives. libucm's unmap events (`unmapped.rs`) drop
//! those whose memory is freed or remapped, before the next registration. If the events cannot
//! be installed or are not delivered, the shim says so once and caches nothing across
//! collectives: every registration is dropped as soon as no offloaded collective is
//! outstanding.
//!
//! # `ucx-export`
//!
//! The same registrar in exporting mode ([`UcxRegistrar::exporting`]): buffers are granted as
//! exported memory handles that the SP on the DPU imports (cross-GVMI), so the NIC serves the
//! accesses. It needs the shim built against UCX >= 1.15 (`UCX_DIR=$(scripts/ucx-wheel.sh)`) and
//! a device that can export (a BlueField's). At start-up the rank exports one page of its own:
//! where that fails ("this device cannot export memory (needs BlueField cross-GVMI)", or "built
//! without UCX >= 1.15 export support") it says so once and grants with `cma`, as for any
//! refused UCX set-up.
//!
//! The backend is chosen per rank, at `MPI_Init`, from what its SP serves it (`serves.rs`); if
//! UCX cannot initialise the rank says so once and uses `cma`. Mixing is fine: the SP serves
//! each grant with the backend it names (`DynMover`), as long as every SP has UCX on (a job
//! where a rank grants through `ucx` and an SP of the job does not serve it runs natively,
//! said once at `MPI_Init`).

use crate::boundary::say;
use alias_mkey::host::{Registrar, UcxRegistrar};
use alias_mkey::{Grant, Rights};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// True while a `ucx` registrar exists: lets wait loops skip the lock with `cma`.
pub static UCX_ACTIVE: AtomicBool = AtomicBool::new(false);
/// Registrations invalidated because their memory was unmapped.
static INVALIDATED: AtomicU64 = AtomicU64::new(0);

/// Which backend `SPOFF_BACKEND` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Cma,
    Ucx,
    UcxExport,
}

impl Backend {
    /// `cma` (or unset) / `ucx` / `ucx-export`; anything else is reported and taken as `cma`.
    pub fn parse(v: Option<&str>) -> Result<Backend, String> {
        match v.map(str::trim) {
            None | Some("") | Some("cma") => Ok(Backend::Cma),
            Some("ucx") => Ok(Backend::Ucx),
            Some("ucx-export") => Ok(Backend::UcxExport),
            Some(other) => Err(format!(
                "SPOFF_BACKEND={other} is none of cma, ucx, ucx-export; using cma"
            )),
        }
    }
}

/// Whether `UCX_TLS` (`tls`) lets UCX use its TCP transport: unset, naming `tcp` (or `all`),
/// or a `^` list of exclusions without it.
fn tcp_transport_allowed(tls: Option<&str>) -> bool {
    let Some(tls) = tls else {
        return true;
    };
    let (exclude, list) = match tls.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, tls),
    };
    let named = list
        .split(',')
        .map(|t| t.trim().trim_start_matches('\\'))
        .any(|t| t == "tcp" || (!exclude && t == "all"));
    named != exclude
}

/// A registrar for `backend` (`ucx` or `ucx-export`); for `ucx-export`, only if this machine
/// can export (one page is tried). UCX's TCP transport listens in `tcp_ports` (the cluster
/// description's `ucx_tcp_port_range`) unless `UCX_TCP_PORT_RANGE` is set or `UCX_TLS` leaves
/// TCP out: given to this context's configuration, not to the environment, which other threads
/// may be reading. (UCX applies a key `ucp_config_modify` does not know to its transports'
/// configurations without their prefix: the TCP transport's `PORT_RANGE`, which
/// `UCX_TCP_PORT_RANGE` sets; UCX warns about a key no transport took.)
fn ucx_registrar(
    backend: Backend,
    tcp_ports: Option<bootstrap::cluster::PortRange>,
) -> Result<UcxRegistrar, alias_mkey::AccessError> {
    let ports = tcp_ports
        .filter(|_| std::env::var_os("UCX_TCP_PORT_RANGE").is_none())
        .filter(|_| tcp_transport_allowed(std::env::var("UCX_TLS").ok().as_deref()))
        .map(|r| r.to_string());
    let overrides: Vec<(&str, &str)> = ports.iter().map(|r| ("PORT_RANGE", r.as_str())).collect();
    if backend == Backend::UcxExport {
        let r = UcxRegistrar::exporting(&overrides)?;
        r.probe_export()?;
        Ok(r)
    } else {
        UcxRegistrar::with_config(&overrides)
    }
}

/// The `ucx` state of a rank.
struct Ucx {
    registrar: UcxRegistrar,
    /// The installed unmap handler; `None`: no events, nothing cached across collectives.
    hook: Option<ucx_sys::VmUnmappedHook>,
}

// SAFETY: `Ucx` holds UCX objects (single-thread mode, `Rc` handles) that are never shared:
// every `Rc` clone stays inside the registrar, and the whole value lives in the shim's state
// behind its mutex, so it is only ever used by one thread at a time, and moved between threads
// whole. UCX's single-thread mode requires exactly that (no concurrent calls on the worker).
unsafe impl Send for Ucx {}

/// The rank's grant factory.
pub struct Grants {
    cma: Registrar,
    ucx: Option<Ucx>,
}

impl Grants {
    /// With `backend` ucx, tries to set UCX up (its TCP listener in `tcp_ports`, see
    /// [`ucx_registrar`]); on failure says why (once, on this rank) and stays with `cma`. `cma`
    /// already holds the mailbox grant.
    pub fn new(
        cma: Registrar,
        backend: Backend,
        rank: u32,
        tcp_ports: Option<bootstrap::cluster::PortRange>,
    ) -> Grants {
        let ucx = match backend {
            Backend::Cma => None,
            Backend::Ucx | Backend::UcxExport => match ucx_registrar(backend, tcp_ports) {
                Ok(registrar) => {
                    let hook = match crate::unmapped::install() {
                        Ok(h) => Some(h),
                        Err(why) => {
                            say!("rank {rank}: UCX memory events unavailable ({why}); ucx registrations are not cached across collectives");
                            None
                        }
                    };
                    UCX_ACTIVE.store(true, Ordering::Release);
                    Some(Ucx { registrar, hook })
                }
                Err(e) => {
                    let name = if backend == Backend::UcxExport {
                        "ucx-export"
                    } else {
                        "ucx"
                    };
                    say!("rank {rank}: cannot initialise UCX for SPOFF_BACKEND={name} ({e}); using cma grants");
                    None
                }
            },
        };
        Grants { cma, ucx }
    }

    /// The backend in use.
    pub fn backend(&self) -> Backend {
        match &self.ucx {
            Some(u) if u.registrar.exports() => Backend::UcxExport,
            Some(_) => Backend::Ucx,
            None => Backend::Cma,
        }
    }

    /// Whether unmap events keep the `ucx` cache valid (`false` with `cma`).
    pub fn events(&self) -> bool {
        self.ucx.as_ref().is_some_and(|u| u.hook.is_some())
    }

    /// Before registering the buffers of a new collective: applies the unmap events, or
    /// without them, when `idle` (no offloaded collective outstanding), drops every `ucx`
    /// registration.
    pub fn refresh(&mut self, idle: bool) {
        let Some(u) = self.ucx.as_mut() else { return };
        let n = if u.hook.is_some() {
            crate::unmapped::apply(&mut u.registrar)
        } else if idle {
            u.registrar.invalidate(0, u64::MAX);
            0
        } else {
            0
        };
        INVALIDATED.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// A grant on `len` bytes of the program's memory at `addr`. With `ucx`, a failed
    /// `ucp_mem_map` is reported and falls back to a `cma` grant for this buffer.
    pub fn buffer(&mut self, addr: u64, len: u64, rights: Rights) -> Grant {
        if let Some(u) = self.ucx.as_mut() {
            crate::unmapped::watch(addr, len);
            // SAFETY: the program's buffer of a collective in flight: MPI forbids freeing it
            // before the collective completes, and an unmap afterwards invalidates the
            // registration (unmap events, applied by `refresh` before the next registration)
            // or, without events, `refresh` drops it once nothing is outstanding. Until then
            // the registration outlives no memory the program still uses.
            match unsafe { u.registrar.register(addr, len, rights) } {
                Ok(g) => return g,
                Err(e) => {
                    static SAID: AtomicBool = AtomicBool::new(false);
                    if !SAID.swap(true, Ordering::AcqRel) {
                        say!("ucx registration of {len} bytes at {addr:#x} failed ({e}); granting with cma");
                    }
                }
            }
        }
        self.cma.register(addr, len, rights)
    }

    /// A `cma` grant whatever the backend: for the staged collectives' segment, which the SP
    /// writes by cross-memory attach.
    pub fn cma_buffer(&mut self, addr: u64, len: u64, rights: Rights) -> Grant {
        self.cma.register(addr, len, rights)
    }

    /// One round of UCX progress (nothing with `cma`). See the module docs.
    pub fn progress(&self) {
        if let Some(u) = &self.ucx {
            u.registrar.progress();
        }
    }

    /// A line for the verbose report: the backend and, for `ucx`, the cache's counters.
    pub fn report(&self) -> String {
        match &self.ucx {
            None => "cma grants".into(),
            Some(u) => {
                let (hits, misses) = u.registrar.stats();
                format!(
                    "{} grants: {hits} cache hits, {misses} misses, {} invalidated by {} unmap events, memory events {}",
                    if u.registrar.exports() { "ucx-export" } else { "ucx" },
                    INVALIDATED.load(Ordering::Relaxed),
                    crate::unmapped::recorded(),
                    if u.hook.is_some() { "on" } else { "off" }
                )
            }
        }
    }
}

impl Drop for Grants {
    fn drop(&mut self) {
        UCX_ACTIVE.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::tcp_transport_allowed as tcp;

    #[test]
    fn the_port_range_goes_to_ucx_only_where_its_tcp_transport_may_run() {
        assert!(tcp(None));
        assert!(tcp(Some("tcp")));
        assert!(tcp(Some("rc,tcp")));
        assert!(tcp(Some("all")));
        assert!(tcp(Some("^rc")));
        assert!(!tcp(Some("rc,ud")));
        assert!(!tcp(Some("^tcp")));
        assert!(!tcp(Some("^rc,tcp")));
    }
}
