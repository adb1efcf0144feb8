//! Host side: turning buffers into grants.
//!
//! [`Registrar`] (backend `cma`, the default) hands out one region id per distinct (address,
//! length, rights) and keeps it in a bounded cache, so repeated collectives on the same buffers
//! send the same grant (an SP can keep what it imported for it). [`Registrar::invalidate`] is
//! called when memory in a range is freed or remapped: every cached registration overlapping it
//! gets a new generation, and an SP that still holds the old one refuses it
//! ([`crate::AccessError::StaleGeneration`]).
//!
//! With the `cma` backend a registration holds no kernel or NIC resource, so the cache only
//! saves work on the SP side. [`UcxRegistrar`] (backend `ucx`, cargo feature `ucx`) keeps the
//! same cache (same key, same bound, same generations) but every entry also holds a
//! `ucp_mem_map` registration and its packed remote key; there the cache saves pinning and
//! invalidation releases the registration.

use crate::{BackendData, Grant, Rights};
use rustc_hash::FxHashMap;

/// Most registrations kept; past this the oldest half is dropped (they are re-created on use).
pub const MAX_CACHED: usize = 4096;

#[derive(Debug)]
struct Entry<T> {
    region: u64,
    generation: u32,
    last_use: u64,
    /// Backend state: `()` for cma, the UCX mapping (if currently mapped) for ucx.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    data: T,
}

/// The registration cache shared by both registrars: (addr, len, rights) → region id and
/// generation, bounded by [`MAX_CACHED`].
#[derive(Debug)]
struct Cache<T> {
    /// Hashed with Fx, not SipHash: the keys are this process's own buffers (no one else can
    /// choose them to collide), and a registration is looked up twice per collective.
    map: FxHashMap<(u64, u64, u8), Entry<T>>,
    next_region: u64,
    clock: u64,
    hits: u64,
    misses: u64,
}

impl<T> Default for Cache<T> {
    fn default() -> Self {
        Cache {
            map: FxHashMap::default(),
            next_region: 0,
            clock: 0,
            hits: 0,
            misses: 0,
        }
    }
}

impl<T: Default> Cache<T> {
    /// The entry for (addr, len, rights), created (with a new region id at generation 0) if
    /// missing. Creating may first evict the least recently used half.
    fn entry(&mut self, addr: u64, len: u64, rights: Rights) -> &mut Entry<T> {
        self.clock += 1;
        let clock = self.clock;
        let key = (addr, len, rights.bits());
        if self.map.contains_key(&key) {
            self.hits += 1;
        } else {
            self.misses += 1;
            if self.map.len() >= MAX_CACHED {
                self.evict_oldest_half();
            }
            self.next_region += 1;
        }
        let region = self.next_region;
        let e = self.map.entry(key).or_insert_with(|| Entry {
            region,
            generation: 0,
            last_use: clock,
            data: T::default(),
        });
        e.last_use = clock;
        e
    }

    /// Bumps the generation of (and calls `f` on) every entry overlapping `[addr, addr+len)`.
    fn invalidate(&mut self, addr: u64, len: u64, mut f: impl FnMut(&mut Entry<T>)) -> usize {
        let end = addr.saturating_add(len);
        let mut n = 0;
        for ((a, l, _), e) in self.map.iter_mut() {
            if *a < end && addr < a.saturating_add(*l) {
                e.generation += 1;
                f(e);
                n += 1;
            }
        }
        n
    }

    fn evict_oldest_half(&mut self) {
        let mut uses: Vec<u64> = self.map.values().map(|e| e.last_use).collect();
        uses.sort_unstable();
        let cut = uses[uses.len() / 2];
        self.map.retain(|_, e| e.last_use > cut);
    }
}

/// Produces `cma` grants for this process's buffers.
#[derive(Debug, Default)]
pub struct Registrar {
    cache: Cache<()>,
}

impl Registrar {
    pub fn new() -> Self {
        Self::default()
    }

    /// A grant for `len` bytes at `addr` with `rights`. Zero-length buffers get a valid grant of
    /// length 0 (every access but an empty one at offset 0 is then refused).
    pub fn register(&mut self, addr: u64, len: u64, rights: Rights) -> Grant {
        let e = self.cache.entry(addr, len, rights);
        Grant {
            region: e.region,
            generation: e.generation,
            addr,
            len,
            rights,
            backend: BackendData::Cma,
        }
    }

    /// Memory in `[addr, addr+len)` was freed or remapped: overlapping registrations get a new
    /// generation. Returns how many were invalidated.
    pub fn invalidate(&mut self, addr: u64, len: u64) -> usize {
        self.cache.invalidate(addr, len, |_| {})
    }

    /// (hits, misses) of the cache, for stats.
    pub fn stats(&self) -> (u64, u64) {
        (self.cache.hits, self.cache.misses)
    }
}

#[cfg(feature = "ucx")]
pub use ucx_backend::UcxRegistrar;

#[cfg(feature = "ucx")]
mod ucx_backend {
    use super::Cache;
    use crate::{AccessError, BackendData, Grant, Rights};
    use std::os::fd::RawFd;
    use std::rc::Rc;
    use ucx_sys::{Context, Features, MemHandle, Worker};

    /// A live `ucp_mem_map` of a user buffer and the remote key (or, exporting, the exported
    /// memory handle) packed from it.
    #[derive(Debug)]
    pub(super) struct Mapping {
        packed: Vec<u8>,
        // Unmapped (`ucp_mem_unmap`) when dropped: on invalidation, eviction or registrar drop.
        _mem: MemHandle,
    }

    fn ucx_error(e: ucx_sys::Error) -> AccessError {
        AccessError::Ucx {
            op: e.op,
            pid: std::process::id(),
            status: e.status.to_string(),
        }
    }

    /// A failed `ucp_memh_pack` with the export flag: `UCS_ERR_UNSUPPORTED` means no memory
    /// domain of this machine can export.
    fn export_error(e: ucx_sys::Error) -> AccessError {
        if !ucx_sys::EXPORT_API {
            AccessError::ExportNotBuilt {
                probe: ucx_sys::BUILD_PROBE,
            }
        } else if e.status == ucx_sys::Status::ERR_UNSUPPORTED {
            AccessError::CannotExport {
                op: e.op,
                status: e.status.to_string(),
            }
        } else {
            ucx_error(e)
        }
    }

    /// Produces `ucx` grants: maps buffers with `ucp_mem_map` and packs their remote keys.
    ///
    /// It owns a UCP context (features RMA | WAKEUP, configured from the `UCX_*` environment,
    /// so `UCX_TLS` applies) and one worker, whose address goes into every grant. Like everything
    /// UCX here it is `!Send`: create it on the thread that will progress it.
    ///
    /// # The host must progress (UCX 1.13, this machine)
    ///
    /// With Debian's UCX 1.13.1 and the transports available here (tcp, sysv/posix shared
    /// memory, cma), an SP's get or put on memory registered by `ucp_mem_map` of a user buffer
    /// is emulated over active messages and completes only while this process runs
    /// [`UcxRegistrar::progress`] (cma is not an RMA lane in 1.13; sysv/posix cannot register
    /// foreign memory). A host waiting for a collective must therefore call `progress` in its
    /// wait loop, or sleep in `poll` on [`UcxRegistrar::event_fd`] after a successful
    /// [`UcxRegistrar::arm`]. On InfiniBand RC/DC, or with UCX >= 1.15 exported memory keys
    /// (the `ucx-export` backend, [`UcxRegistrar::exporting`]), the NIC serves the accesses and
    /// the host need not progress.
    ///
    /// The emulation also means that here the host's UCX does not check remote accesses
    /// against its registrations: exactly as with `cma`, [`crate::AliasKey::check`] in the SP is
    /// the only gate. On RDMA hardware the NIC additionally refuses accesses outside a live
    /// registration.
    ///
    /// # Exporting (`ucx-export`, BlueField cross-GVMI)
    ///
    /// Made with [`UcxRegistrar::exporting`], the registrar packs every mapping with
    /// `ucp_memh_pack(..., UCP_MEMH_PACK_FLAG_EXPORT)` and grants [`BackendData::UcxExport`]: the
    /// SP on the DPU imports it as an alias of this memory and the device serves its accesses,
    /// so this process need not progress. Where no device can export, registering fails with
    /// [`AccessError::CannotExport`]; [`UcxRegistrar::probe_export`] finds that out once.
    pub struct UcxRegistrar {
        // Dropped first: unmaps every registration while the context is alive (each MemHandle
        // also holds the context).
        cache: Cache<Option<Mapping>>,
        worker_address: Vec<u8>,
        worker: Rc<Worker>,
        export: bool,
    }

    impl UcxRegistrar {
        /// A registrar configured from the environment (`UCX_TLS`, `UCX_NET_DEVICES`, ...).
        pub fn new() -> Result<Self, AccessError> {
            Self::with_config(&[])
        }

        /// Like [`UcxRegistrar::new`], with UCX configuration keys overridden (named without
        /// the `UCX_` prefix, e.g. `[("TLS", "tcp")]`).
        pub fn with_config(overrides: &[(&str, &str)]) -> Result<Self, AccessError> {
            Self::open(Features::RMA | Features::WAKEUP, overrides, false)
        }

        /// A UCX context with `features`, its worker and the worker's address.
        fn open(
            features: Features,
            overrides: &[(&str, &str)],
            export: bool,
        ) -> Result<Self, AccessError> {
            let context =
                Context::with_config(features, &crate::ucx_config(overrides)).map_err(ucx_error)?;
            let worker = Worker::new(&context).map_err(ucx_error)?;
            let worker_address = worker.address().map_err(ucx_error)?;
            Ok(UcxRegistrar {
                cache: Cache::default(),
                worker_address,
                worker,
                export,
            })
        }

        /// A registrar for the `ucx-export` backend: grants carry exported memory handles
        /// ([`BackendData::UcxExport`]) instead of remote keys. Fails with
        /// [`AccessError::ExportNotBuilt`] if ucx-sys was built against UCX < 1.15. Creating it
        /// does not yet know whether a device can export: see
        /// [`UcxRegistrar::probe_export`].
        pub fn exporting(overrides: &[(&str, &str)]) -> Result<Self, AccessError> {
            if !ucx_sys::EXPORT_API {
                return Err(AccessError::ExportNotBuilt {
                    probe: ucx_sys::BUILD_PROBE,
                });
            }
            let features = Features::RMA | Features::WAKEUP | Features::EXPORTED_MEMH;
            Self::open(features, overrides, true)
        }

        /// True for a registrar made by [`UcxRegistrar::exporting`].
        pub fn exports(&self) -> bool {
            self.export
        }

        /// Exports one page of this registrar's own (mapped, packed, then unmapped at once):
        /// `Ok` if this machine's devices can export, [`AccessError::CannotExport`] ("this
        /// device cannot export memory (needs BlueField cross-GVMI)") if not. Nothing is cached.
        pub fn probe_export(&self) -> Result<(), AccessError> {
            if !ucx_sys::EXPORT_API {
                return Err(AccessError::ExportNotBuilt {
                    probe: ucx_sys::BUILD_PROBE,
                });
            }
            let mut page = vec![0u8; 4096];
            // SAFETY: `page` outlives `mem`, which is dropped (unmapped) before it.
            let mem = unsafe { MemHandle::map(self.worker.context(), page.as_mut_ptr(), 4096) }
                .map_err(ucx_error)?;
            let packed = mem.export_pack().map_err(export_error);
            drop(mem);
            drop(page);
            packed.map(drop)
        }

        /// A grant for `len` bytes at `addr` with `rights`, backed by a `ucp_mem_map` of that
        /// range (made on first use, reused until invalidated or evicted). Zero-length buffers
        /// get a grant of length 0 with an empty remote key and nothing mapped.
        ///
        /// `rights` are enforced by the SP's [`crate::AliasKey::check`]; the mapping itself is
        /// made with UCX's default protection (local and remote read/write), because
        /// `ucx_sys::MemHandle::map` does not expose `UCP_MEM_MAP_PARAM_FIELD_PROT`.
        ///
        /// # Safety
        /// `[addr, addr+len)` must be memory of this process that stays allocated and mapped
        /// until the registration is released, i.e. until [`UcxRegistrar::invalidate`] was
        /// called on a range overlapping it (or the registrar is dropped). Free or remap the
        /// memory only after invalidating it. Remote SPs may read and write it at any time
        /// while it is registered (within the granted rights): do not hold Rust references to
        /// it while they may write.
        pub unsafe fn register(
            &mut self,
            addr: u64,
            len: u64,
            rights: Rights,
        ) -> Result<Grant, AccessError> {
            let ulen = usize::try_from(len).map_err(|_| AccessError::BadGrant)?;
            addr.checked_add(len).ok_or(AccessError::BadGrant)?;
            let e = self.cache.entry(addr, len, rights);
            let packed = if len == 0 {
                Vec::new()
            } else {
                if e.data.is_none() {
                    // SAFETY: forwarded from the caller: the range is valid, live memory of
                    // this process until invalidated, which drops this handle first.
                    let mem =
                        unsafe { MemHandle::map(self.worker.context(), addr as *mut u8, ulen) }
                            .map_err(ucx_error)?;
                    let packed = if self.export {
                        mem.export_pack().map_err(export_error)?
                    } else {
                        mem.rkey_pack().map_err(ucx_error)?
                    };
                    e.data = Some(Mapping { packed, _mem: mem });
                }
                e.data.as_ref().expect("mapped above").packed.clone()
            };
            let backend = if self.export {
                BackendData::UcxExport { memh: packed }
            } else {
                BackendData::Ucx {
                    worker_address: self.worker_address.clone(),
                    rkey: packed,
                }
            };
            Ok(Grant {
                region: e.region,
                generation: e.generation,
                addr,
                len,
                rights,
                backend,
            })
        }

        /// Memory in `[addr, addr+len)` is about to be freed or remapped: overlapping
        /// registrations are unmapped (`ucp_mem_unmap`) and get a new generation, so an SP that
        /// has seen the new generation refuses keys of the old one
        /// ([`crate::AccessError::StaleGeneration`]). The next `register` of the same range
        /// maps it again. Returns how many registrations were invalidated.
        pub fn invalidate(&mut self, addr: u64, len: u64) -> usize {
            self.cache.invalidate(addr, len, |e| e.data = None)
        }

        /// Runs one round of UCX progress on the worker whose address is in the `ucx` grants;
        /// returns the number of events processed. See the type docs for why a host must call
        /// this while it waits (UCX 1.13 over tcp/shared memory).
        pub fn progress(&self) -> u32 {
            self.worker.progress()
        }

        /// The worker's event fd, to sleep in `poll` instead of spinning on
        /// [`UcxRegistrar::progress`]: progress until it returns 0, then [`UcxRegistrar::arm`];
        /// wait on the fd only if `arm` returned `Ok(true)`. Owned by UCX: never close it.
        pub fn event_fd(&self) -> Result<RawFd, AccessError> {
            self.worker.event_fd().map_err(ucx_error)
        }

        /// Arms the event fd: `Ok(true)` armed, `Ok(false)` events are pending (progress
        /// again before waiting).
        pub fn arm(&self) -> Result<bool, AccessError> {
            self.worker.arm().map_err(ucx_error)
        }

        /// The worker address every grant carries.
        pub fn worker_address(&self) -> &[u8] {
            &self.worker_address
        }

        /// Registrations currently mapped (invalidated ones are not).
        pub fn mapped(&self) -> usize {
            self.cache.map.values().filter(|e| e.data.is_some()).count()
        }

        /// (hits, misses) of the cache, for stats.
        pub fn stats(&self) -> (u64, u64) {
            (self.cache.hits, self.cache.misses)
        }
    }

    impl std::fmt::Debug for UcxRegistrar {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("UcxRegistrar")
                .field("cached", &self.cache.map.len())
                .field("mapped", &self.mapped())
                .finish()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_buffer_same_grant_until_invalidated() {
        let mut r = Registrar::new();
        let a = r.register(0x1000, 64, Rights::READ);
        let b = r.register(0x1000, 64, Rights::READ);
        assert_eq!(a, b);
        let c = r.register(0x1000, 64, Rights::WRITE);
        assert_ne!(a.region, c.region);
        assert_eq!(r.invalidate(0x1030, 1), 2);
        let d = r.register(0x1000, 64, Rights::READ);
        assert_eq!(d.region, a.region);
        assert_eq!(d.generation, a.generation + 1);
        assert_eq!(
            r.invalidate(0x1040, 16),
            0,
            "ranges that only touch do not overlap"
        );
        assert_eq!(r.stats(), (2, 2));
    }

    #[test]
    fn cache_is_bounded() {
        let mut r = Registrar::new();
        for i in 0..(MAX_CACHED as u64 * 3) {
            r.register(i * 8, 8, Rights::READ);
        }
        assert!(r.cache.map.len() <= MAX_CACHED);
    }

    #[cfg(feature = "ucx")]
    #[test]
    fn ucx_registrar_maps_caches_and_unmaps_on_invalidate() {
        let buf = vec![0u8; 8192].into_boxed_slice();
        let base = buf.as_ptr() as u64;
        let mut r = UcxRegistrar::with_config(&[("TLS", "tcp")]).unwrap();
        // SAFETY: `buf` outlives `r` (declared first) and is only freed after `r` is dropped.
        let a = unsafe { r.register(base, 4096, Rights::READ) }.unwrap();
        let b = unsafe { r.register(base, 4096, Rights::READ) }.unwrap();
        assert_eq!(a, b);
        let BackendData::Ucx {
            worker_address,
            rkey,
        } = &a.backend
        else {
            panic!("not a ucx grant: {a:?}")
        };
        assert_eq!(worker_address, r.worker_address());
        assert!(rkey.len() >= 9, "packed rkey {rkey:?}");
        let w = unsafe { r.register(base + 4096, 4096, Rights::WRITE) }.unwrap();
        assert_ne!(w.region, a.region);
        assert_eq!(r.mapped(), 2);

        assert_eq!(r.invalidate(base + 100, 1), 1);
        assert_eq!(r.mapped(), 1);
        let c = unsafe { r.register(base, 4096, Rights::READ) }.unwrap();
        assert_eq!((c.region, c.generation), (a.region, a.generation + 1));
        assert_eq!(r.mapped(), 2);
        assert_eq!(r.stats(), (2, 2));

        let z = unsafe { r.register(base, 0, Rights::READ) }.unwrap();
        assert!(matches!(&z.backend, BackendData::Ucx { rkey, .. } if rkey.is_empty()));
        assert_eq!(r.mapped(), 2, "a zero-length grant maps nothing");
        r.progress();
        drop(r);
        drop(buf);
    }

    #[cfg(feature = "ucx")]
    #[test]
    fn an_exporting_registrar_says_clearly_why_it_cannot_export_here() {
        for tls in ["tcp", "sm", "self"] {
            match (
                ucx_sys::EXPORT_API,
                UcxRegistrar::exporting(&[("TLS", tls)]),
            ) {
                (false, Err(e)) => {
                    let msg = e.to_string();
                    println!("{msg}");
                    assert!(matches!(e, crate::AccessError::ExportNotBuilt { .. }));
                    assert!(
                        msg.contains("built without UCX >= 1.15 export support"),
                        "{msg}"
                    );
                }
                (true, Ok(mut r)) => {
                    assert!(r.exports());
                    let e = r.probe_export().unwrap_err();
                    println!("UCX_TLS={tls}: {e}");
                    assert!(matches!(e, crate::AccessError::CannotExport { .. }), "{e}");
                    assert!(e.to_string().starts_with(
                        "this device cannot export memory (needs BlueField cross-GVMI)"
                    ));
                    let buf = vec![0u8; 8192];
                    // SAFETY: `buf` outlives `r` (dropped first below).
                    let e =
                        unsafe { r.register(buf.as_ptr() as u64, 8192, Rights::READ) }.unwrap_err();
                    assert!(matches!(e, crate::AccessError::CannotExport { .. }), "{e}");
                    assert_eq!(r.mapped(), 0, "a failed export keeps no mapping");
                    drop(r);
                    drop(buf);
                }
                (api, r) => panic!("export API {api}, but the registrar: {r:?}"),
            }
        }
    }
}
