//! The `ucx-export` mover: the BlueField alias-key path, on regions granted by
//! [`crate::host::UcxRegistrar::exporting`].
//!
//! # What it does
//!
//! The host packs its `ucp_mem_map` with `ucp_memh_pack(..., UCP_MEMH_PACK_FLAG_EXPORT)`; the
//! grant carries those bytes ([`BackendData::UcxExport`]). The SP imports them with `ucp_mem_map`
//! and `UCP_MEM_MAP_PARAM_FIELD_EXPORTED_MEMH_BUFFER` (context feature
//! `UCP_FEATURE_EXPORTED_MEMH`): on a BlueField the DPU's device then holds a cross-GVMI alias
//! mkey of the host's memory, and the imported handle names it. The mover uses it as the
//! *local* memory handle of RMA on a loopback endpoint of its own worker, against a staging
//! buffer it registered itself:
//!
//! * `read`: `ucp_put_nbx` from the host's address (local, alias handle) into staging, a flush,
//!   then the bytes are copied out of staging;
//! * `write`: the bytes into staging, then `ucp_get_nbx` from staging into the host's address
//!   (local, alias handle): completion means the bytes are in host memory;
//! * `copy` between two export grants: both, chunk by chunk, with no CPU copy.
//!
//! The host never progresses anything: the device serves the accesses.
//!
//! # Checks before UCX sees anything
//!
//! Every access is checked as in the other movers ([`crate::AliasKey::check`], generations).
//! The exported buffer comes from a host and `ucp_mem_map` trusts it (no length; UCX 1.22 reads
//! and writes out of bounds on a buffer of 0xff bytes), so [`exported_framing`] parses it first
//! with the layout of UCX 1.22's packer (sizes, memory-domain map, one length-prefixed exported
//! key and device id per map bit, all inside the buffer; at most [`MAX_EXPORT_MDS`] keys) and
//! requires that the region it names covers the grant; UCX then gets a zero-padded copy. After
//! the import, `ucp_mem_query` must report that same region. A layout from another UCX version
//! that does not parse is refused (fail closed), never handed over.
//!
//! # On this machine
//!
//! No device here can export (UCX 1.22, transports self, tcp, sysv, posix, cma): hosts cannot
//! make export grants at all ([`AccessError::CannotExport`]), so the import is exercised only
//! with hand-made buffers (UCX refuses them: no local device has their id). The RMA path is
//! exercised with an ordinary registration in place of the imported one (this module's tests).
//!
//! # Bounded waits
//!
//! Every request is waited for at most [`ExportMoverConfig::timeout`]. UCX cannot cancel RMA,
//! so a request that timed out is kept (with the staging buffer it may still touch) and the
//! mover refuses work until it completes; dropping the mover then leaks it rather than block.

use super::Mover;
use crate::{AccessError, AliasKey, BackendData, Owner, Rights};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;
use ucx_sys::{Context, Endpoint, ErrorHandling, Features, MemHandle, RemoteKey, Request, Worker};

/// Most exported keys one buffer may carry (one per memory domain of the exporting context).
pub const MAX_EXPORT_MDS: u32 = 16;
/// Default bound on imported handles kept.
pub const MAX_IMPORTS: usize = 4096;
/// Zero bytes appended to the copy of an exported buffer handed to UCX.
const BLOB_PAD: usize = 256;

/// How an [`ExportMover`] is set up.
#[derive(Clone, Debug)]
pub struct ExportMoverConfig {
    /// Staging buffer size: the largest put or get issued at once.
    pub chunk_bytes: usize,
    /// Longest wait for any one UCX request.
    pub timeout: Duration,
    /// Overrides `UCX_TLS` for this mover's context; `None` takes it from the environment.
    pub tls: Option<String>,
    /// Bound on cached imported handles (least recently used half evicted).
    pub max_imports: usize,
}

impl Default for ExportMoverConfig {
    fn default() -> Self {
        ExportMoverConfig {
            chunk_bytes: super::DEFAULT_CHUNK_BYTES,
            timeout: super::ucx::DEFAULT_TIMEOUT,
            tls: None,
            max_imports: MAX_IMPORTS,
        }
    }
}

/// What [`exported_framing`] read from an exported buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exported {
    /// The exporter's region.
    pub address: u64,
    pub length: u64,
    /// Exported keys in the buffer (one per memory domain).
    pub keys: u32,
    /// Bytes the buffer's framing spans (what follows is ignored).
    pub framed_len: usize,
}

fn size_field(b: &[u8], p: &mut usize) -> Option<usize> {
    let first = *b.get(*p)?;
    *p += 1;
    if first != 0 {
        return Some(first as usize);
    }
    let wide = u16::from_ne_bytes(b.get(*p..*p + 2)?.try_into().ok()?);
    *p += 2;
    (wide != 0).then_some(wide as usize)
}

fn take<const N: usize>(b: &[u8], p: &mut usize) -> Option<[u8; N]> {
    let v = b.get(*p..*p + N)?.try_into().ok()?;
    *p += N;
    Some(v)
}

/// Parses `b` with the layout of UCX 1.22's exported memory handle (`ucp_memh_pack` with the
/// export flag): a size (1 byte, or 0 then 2 bytes) of the common part, 16-bit flags, 64-bit
/// memory-domain map, memory type, then address, length, context id and registration id (64
/// bits each); after the common part, per map bit: a size of the entry, the exported key's
/// length byte and key, the device id's length byte and id, all inside the entry and the buffer.
/// `None` if anything is out of place, empty, or the map has no bit or more than
/// [`MAX_EXPORT_MDS`].
pub fn exported_framing(b: &[u8]) -> Option<Exported> {
    let mut p = 0usize;
    let info_size = size_field(b, &mut p)?;
    let _flags = u16::from_ne_bytes(take::<2>(b, &mut p)?);
    let md_map = u64::from_ne_bytes(take::<8>(b, &mut p)?);
    let mem_type = take::<1>(b, &mut p)?[0];
    let address = u64::from_ne_bytes(take::<8>(b, &mut p)?);
    let length = u64::from_ne_bytes(take::<8>(b, &mut p)?);
    let _uuid = take::<8>(b, &mut p)?;
    let _reg_id = take::<8>(b, &mut p)?;
    let keys = md_map.count_ones();
    if keys == 0
        || keys > MAX_EXPORT_MDS
        || u32::from(mem_type) >= ucx_sys::raw::UCS_MEMORY_TYPE_LAST
        || length == 0
        || address.checked_add(length).is_none()
        || p > info_size
        || info_size > b.len()
    {
        return None;
    }
    p = info_size;
    for _ in 0..keys {
        let start = p;
        let entry = size_field(b, &mut p)?;
        let key_len = take::<1>(b, &mut p)?[0] as usize;
        p += key_len;
        let id_len = *b.get(p)? as usize;
        p += 1 + id_len;
        let end = start.checked_add(entry)?;
        if key_len == 0 || id_len == 0 || p > end || end > b.len() {
            return None;
        }
        p = end;
    }
    Some(Exported {
        address,
        length,
        keys,
        framed_len: p,
    })
}

/// Counters, for stats and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExportMoverStats {
    pub imports: usize,
    pub import_hits: u64,
    pub import_misses: u64,
    pub timeouts: u64,
    pub stuck: usize,
}

type RegionId = (Owner, u64);

struct Import {
    memh: Rc<MemHandle>,
    last_use: u64,
}

/// The `ucx-export` mover; see the module docs. `!Send`: create it on its datapath thread.
pub struct ExportMover {
    cfg: ExportMoverConfig,
    /// Requests that timed out; no new work while any is pending.
    stuck: Vec<Request>,
    imports: HashMap<(RegionId, u32), Import>,
    generations: HashMap<RegionId, u32>,
    staging_rkey: RemoteKey,
    staging: Rc<MemHandle>,
    ep: Rc<Endpoint>,
    worker: Rc<Worker>,
    clock: u64,
    stats: ExportMoverStats,
}

fn ucx_error(e: ucx_sys::Error, pid: u32) -> AccessError {
    AccessError::Ucx {
        op: e.op,
        pid,
        status: e.status.to_string(),
    }
}

fn export_blob(key: &AliasKey) -> Result<&[u8], AccessError> {
    match &key.grant.backend {
        BackendData::UcxExport { memh } => Ok(memh),
        BackendData::Cma => Err(AccessError::Unsupported("cma (in the ucx-export mover)")),
        BackendData::Ucx { .. } => Err(AccessError::Unsupported("ucx (in the ucx-export mover)")),
    }
}

fn bad_export(pid: u32, why: String) -> AccessError {
    AccessError::Ucx {
        op: "exported memory handle",
        pid,
        status: why,
    }
}

impl ExportMover {
    /// Creates the context (features RMA | EXPORTED_MEMH), worker, loopback endpoint and
    /// registered staging buffer. Fails with [`AccessError::ExportNotBuilt`] if ucx-sys was
    /// built against UCX < 1.15.
    pub fn new(cfg: ExportMoverConfig) -> Result<Self, AccessError> {
        if !ucx_sys::EXPORT_API {
            return Err(AccessError::ExportNotBuilt {
                probe: ucx_sys::BUILD_PROBE,
            });
        }
        Self::with_features(cfg, Features::RMA | Features::EXPORTED_MEMH)
    }

    fn with_features(cfg: ExportMoverConfig, features: Features) -> Result<Self, AccessError> {
        let me = std::process::id();
        let context = match &cfg.tls {
            Some(tls) => Context::with_config(features, &[("TLS", tls.as_str())]),
            None => Context::new(features),
        }
        .map_err(|e| ucx_error(e, me))?;
        let worker = Worker::new(&context).map_err(|e| ucx_error(e, me))?;
        let address = worker.address().map_err(|e| ucx_error(e, me))?;
        let ep = Endpoint::connect_with(&worker, &address, ErrorHandling::None)
            .map_err(|e| ucx_error(e, me))?;
        let staging = Rc::new(
            MemHandle::allocate(&context, cfg.chunk_bytes.max(4096))
                .map_err(|e| ucx_error(e, me))?,
        );
        let packed = staging.rkey_pack().map_err(|e| ucx_error(e, me))?;
        // SAFETY: a key this process just packed.
        let staging_rkey =
            unsafe { RemoteKey::unpack(&ep, &packed) }.map_err(|e| ucx_error(e, me))?;
        Ok(ExportMover {
            cfg,
            stuck: Vec::new(),
            imports: HashMap::new(),
            generations: HashMap::new(),
            staging_rkey,
            staging,
            ep,
            worker,
            clock: 0,
            stats: ExportMoverStats::default(),
        })
    }

    pub fn stats(&self) -> ExportMoverStats {
        ExportMoverStats {
            imports: self.imports.len(),
            stuck: self.stuck.len(),
            ..self.stats
        }
    }

    /// Every check that needs no UCX call: backend, bounds and rights, generation, framing of
    /// the exported buffer and that it covers the grant. Returns the absolute address.
    pub fn precheck(
        &self,
        key: &AliasKey,
        offset: u64,
        len: u64,
        need: Rights,
    ) -> Result<u64, AccessError> {
        let blob = export_blob(key)?;
        let addr = key.check(offset, len, need)?;
        if let Some(&current) = self.generations.get(&(key.owner, key.grant.region)) {
            key.check_generation(current)?;
        }
        let pid = key.owner.pid;
        let ex = exported_framing(blob).ok_or_else(|| {
            bad_export(
                pid,
                "malformed (not the layout of UCX 1.22's ucp_memh_pack): refused".into(),
            )
        })?;
        let (g_start, g_end) = (key.grant.addr, key.grant.addr + key.grant.len);
        if g_start < ex.address || g_end > ex.address + ex.length {
            return Err(bad_export(
                pid,
                format!(
                    "it covers [{:#x}, +{}), not the granted [{g_start:#x}, +{})",
                    ex.address, ex.length, key.grant.len
                ),
            ));
        }
        Ok(addr)
    }

    /// Records that `generation` is current for `owner`'s `region`: older keys are refused and
    /// their imported handles released.
    pub fn note_generation(&mut self, owner: Owner, region: u64, generation: u32) {
        let id = (owner, region);
        let cur = self.generations.entry(id).or_insert(generation);
        *cur = (*cur).max(generation);
        let cur = *cur;
        self.imports.retain(|(rid, g), _| *rid != id || *g >= cur);
        // Bounded: past the limit the table starts over, forgetting what it knew; only then can
        // a stale key pass this check (its registration is gone at the host: on the device the
        // import or the access then fails).
        if self.generations.len() > MAX_IMPORTS * 16 {
            self.generations.clear();
        }
    }

    /// Polls timed-out requests; refuses work while any is pending.
    fn admit(&mut self, pid: u32) -> Result<(), AccessError> {
        if !self.stuck.is_empty() {
            self.worker.progress();
            self.stuck
                .retain_mut(|r| !matches!(r.test(), Ok(true) | Err(_)));
        }
        if !self.stuck.is_empty() {
            return Err(AccessError::Ucx {
                op: "quarantine",
                pid,
                status: format!(
                    "{} timed-out requests still pending: refusing new work",
                    self.stuck.len()
                ),
            });
        }
        Ok(())
    }

    /// The imported handle for `key` (cached by owner, region and generation).
    fn alias(&mut self, key: &AliasKey) -> Result<Rc<MemHandle>, AccessError> {
        let pid = key.owner.pid;
        let id = ((key.owner, key.grant.region), key.grant.generation);
        self.note_generation(key.owner, key.grant.region, key.grant.generation);
        self.clock += 1;
        if let Some(i) = self.imports.get_mut(&id) {
            i.last_use = self.clock;
            self.stats.import_hits += 1;
            return Ok(Rc::clone(&i.memh));
        }
        self.stats.import_misses += 1;
        let blob = export_blob(key)?;
        let mut padded = blob.to_vec();
        padded.resize(blob.len() + BLOB_PAD, 0);
        // SAFETY: `precheck` (called by every access before this) parsed the buffer's framing;
        // UCX gets a zero-padded copy that outlives the call.
        let memh = unsafe { MemHandle::import(self.worker.context(), &padded) }
            .map_err(|e| ucx_error(e, pid))?;
        let (a, l) = (memh.address() as u64, memh.len() as u64);
        if key.grant.addr < a || key.grant.addr + key.grant.len > a.saturating_add(l) {
            return Err(bad_export(
                pid,
                format!("the imported handle covers [{a:#x}, +{l}), not the grant"),
            ));
        }
        if self.imports.len() >= self.cfg.max_imports.max(1) {
            let mut uses: Vec<u64> = self.imports.values().map(|i| i.last_use).collect();
            uses.sort_unstable();
            let cut = uses[uses.len() / 2];
            self.imports.retain(|_, i| i.last_use > cut);
        }
        let memh = Rc::new(memh);
        self.imports.insert(
            id,
            Import {
                memh: Rc::clone(&memh),
                last_use: self.clock,
            },
        );
        Ok(memh)
    }

    /// Waits for `req`, bounded; a timeout keeps it in `stuck`.
    fn finish(&mut self, mut req: Request, op: &'static str, pid: u32) -> Result<(), AccessError> {
        match req.wait_timeout(self.cfg.timeout) {
            Ok(true) => Ok(()),
            Ok(false) => {
                self.stats.timeouts += 1;
                self.stuck.push(req);
                Err(AccessError::Timeout {
                    op,
                    pid,
                    after_ms: self.cfg.timeout.as_millis() as u64,
                })
            }
            Err(e) => Err(ucx_error(e, pid)),
        }
    }

    /// `n` bytes at `addr` (inside `memh`) into the staging buffer, remotely complete.
    fn pull_into_staging(
        &mut self,
        memh: &Rc<MemHandle>,
        addr: u64,
        n: usize,
        pid: u32,
    ) -> Result<(), AccessError> {
        // SAFETY: `addr..addr+n` lies inside the alias (checked against the grant, which the
        // alias covers); the staging buffer is only touched by UCX until `finish` returns.
        let req = unsafe {
            self.ep.put_nbx_memh(
                addr as *const u8,
                n,
                memh,
                self.staging.address() as u64,
                &self.staging_rkey,
            )
        }
        .map_err(|e| ucx_error(e, pid))?;
        self.finish(req, "ucp_put_nbx", pid)?;
        let req = self.ep.flush_nbx().map_err(|e| ucx_error(e, pid))?;
        self.finish(req, "ucp_ep_flush_nbx", pid)
    }

    /// `n` bytes of the staging buffer to `addr` (inside `memh`).
    fn push_from_staging(
        &mut self,
        memh: &Rc<MemHandle>,
        addr: u64,
        n: usize,
        pid: u32,
    ) -> Result<(), AccessError> {
        // SAFETY: as in `pull_into_staging`; the get writes the alias only.
        let req = unsafe {
            self.ep.get_nbx_memh(
                addr as *mut u8,
                n,
                memh,
                self.staging.address() as u64,
                &self.staging_rkey,
            )
        }
        .map_err(|e| ucx_error(e, pid))?;
        self.finish(req, "ucp_get_nbx", pid)
    }

    fn staging_slice(&mut self, n: usize) -> &mut [u8] {
        // SAFETY: UCX-allocated staging of at least chunk_bytes >= n bytes, reached by UCX only
        // inside `pull_into_staging`/`push_from_staging`, which have returned (or left the mover refusing
        // work, which never gets here).
        unsafe { std::slice::from_raw_parts_mut(self.staging.address(), n) }
    }

    fn chunk(&self) -> usize {
        self.staging.len()
    }

    /// Makes `key` resolve to `memh` (an ordinary registration of this process standing in
    /// for an imported alias), for tests of the RMA path on machines that cannot export.
    #[cfg(test)]
    fn install_alias(&mut self, key: &AliasKey, memh: MemHandle) {
        let id = ((key.owner, key.grant.region), key.grant.generation);
        let memh = Rc::new(memh);
        self.imports.insert(id, Import { memh, last_use: 0 });
    }
}

impl Mover for ExportMover {
    fn copy(
        &mut self,
        src: &AliasKey,
        src_offset: u64,
        dst: &AliasKey,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), AccessError> {
        let s = self.precheck(src, src_offset, len, Rights::READ)?;
        let d = self.precheck(dst, dst_offset, len, Rights::WRITE)?;
        self.admit(src.owner.pid)?;
        let (sm, dm) = (self.alias(src)?, self.alias(dst)?);
        let mut moved = 0u64;
        while moved < len {
            let n = (len - moved).min(self.chunk() as u64) as usize;
            self.pull_into_staging(&sm, s + moved, n, src.owner.pid)?;
            self.push_from_staging(&dm, d + moved, n, dst.owner.pid)?;
            moved += n as u64;
        }
        Ok(())
    }

    fn write(&mut self, dst: &AliasKey, offset: u64, data: &[u8]) -> Result<(), AccessError> {
        let d = self.precheck(dst, offset, data.len() as u64, Rights::WRITE)?;
        self.admit(dst.owner.pid)?;
        let dm = self.alias(dst)?;
        for (i, part) in data.chunks(self.chunk()).enumerate() {
            self.staging_slice(part.len()).copy_from_slice(part);
            let at = d + (i * self.chunk()) as u64;
            self.push_from_staging(&dm, at, part.len(), dst.owner.pid)?;
        }
        Ok(())
    }

    fn read(&mut self, src: &AliasKey, offset: u64, out: &mut [u8]) -> Result<(), AccessError> {
        let s = self.precheck(src, offset, out.len() as u64, Rights::READ)?;
        self.admit(src.owner.pid)?;
        let sm = self.alias(src)?;
        let chunk = self.chunk();
        for (i, part) in out.chunks_mut(chunk).enumerate() {
            self.pull_into_staging(&sm, s + (i * chunk) as u64, part.len(), src.owner.pid)?;
            part.copy_from_slice(self.staging_slice(part.len()));
        }
        Ok(())
    }
}

impl Drop for ExportMover {
    fn drop(&mut self) {
        if !self.stuck.is_empty() {
            // UCX may still write the staging buffer: leak it (and the requests, with
            // everything they hold) rather than block or free memory UCX may touch.
            std::mem::forget(Rc::clone(&self.staging));
            std::mem::forget(std::mem::take(&mut self.stuck));
        }
    }
}

#[cfg(test)]
#[path = "export_tests.rs"]
mod tests;
