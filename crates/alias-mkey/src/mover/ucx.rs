//! The `ucx` mover: RMA through UCX on regions granted by [`crate::host::UcxRegistrar`].
//!
//! # One mover per datapath thread
//!
//! A [`UcxMover`] owns a UCP context and a single-threaded worker, so it is `!Send`: each
//! datapath thread creates its own (inside the thread), exactly as it creates its own
//! [`super::CmaMover`] today.
//!
//! # What a copy does
//!
//! Linux has no third-party RDMA between two other processes, so a host-to-host copy is staged:
//! `ucp_get_nbx` from the source host into the mover's staging buffer, `ucp_put_nbx` from it
//! into the destination host, chunk by chunk, then `ucp_ep_flush_nbx` on the destination so the
//! bytes are in place when `copy` returns. `read` and `write` go through the staging buffer too,
//! so a caller's buffer is never handed to UCX (a request that times out may still touch its
//! buffer later; see below).
//!
//! Before any UCX call every access is checked: the key must be a [`BackendData::Ucx`] key
//! ([`AccessError::Unsupported`] otherwise), [`crate::AliasKey::check`] must pass, and its
//! generation must not be older than the newest generation this mover has seen for the same
//! (owner, region) ([`AccessError::StaleGeneration`]). A refused access creates no endpoint,
//! unpacks no key and moves no byte.
//!
//! # Caches
//!
//! Endpoints are cached by the owner's worker address, unpacked remote keys by (owner, region,
//! generation), both bounded (least recently used half evicted, the evicted endpoints closed). A key arriving with a newer
//! generation drops the older generations' unpacked keys. The generation table is bounded too
//! ([`MAX_GENERATIONS`]); an evicted entry forgets what it knew, so only then can a stale key
//! pass the mover's check (the host has unmapped it: on RDMA hardware the NIC refuses it; with
//! the 1.13 emulation here it is not checked by the host, see [`crate::host::UcxRegistrar`]).
//!
//! Packed keys and worker addresses come from hosts and are parsed by UCX without a length.
//! The mover checks the framing of a packed key (UCX 1.12–1.14 layout: 8-byte memory-domain
//! map, memory type, then one length-prefixed key per map bit) against its length, and hands
//! UCX zero-padded copies of both blobs, so UCX's parsers cannot read past them. What the
//! per-transport key unpackers then do with the contents is UCX's business: the SP trusts the
//! host's UCX to have produced them.
//!
//! # Bounded waits, and the quarantine
//!
//! Every UCX request is waited for at most [`UcxMoverConfig::timeout`] (progressing the mover's
//! worker meanwhile); then the access fails with [`AccessError::Timeout`]. UCX has no
//! cancellation for RMA: a get that timed out may still write its local buffer later. So the
//! request and the staging buffer it uses are moved to a quarantine and the mover continues
//! with a fresh staging buffer. Quarantined requests are polled at the start of every later
//! access and after every completed wait, and released (buffer freed) once UCX completes them. At most
//! [`UcxMoverConfig::max_quarantined`] may be pending: beyond that the mover refuses work
//! ([`AccessError::Ucx`], op `quarantine`) instead of growing. Dropping the mover leaks
//! requests still pending (and their buffers, the worker and context) rather than block or let
//! UCX write freed memory. The endpoint of a host that failed or timed out is dropped from the
//! cache, so the next access reconnects.
//!
//! # Transports (`UCX_TLS`) on this machine
//!
//! The context is configured from the environment (`UCX_TLS`, ...) unless
//! [`UcxMoverConfig::tls`] overrides it. With Debian's UCX 1.13.1 on one machine (transports
//! self, tcp, sysv, posix, cma; no RDMA device), RMA on `ucp_mem_map`ped user memory is
//! emulated over active messages, so **the host must progress its worker**
//! ([`crate::host::UcxRegistrar::progress`]) for every access to complete. Verified by this
//! crate's tests (`tests/ucx_hosts.rs`), with host and SP using the same `UCX_TLS`:
//!
//! | `UCX_TLS` | [`ErrorHandling::Peer`] (default) | [`ErrorHandling::None`] |
//! |---|---|---|
//! | `tcp`, `cma,tcp`, unset (all) | works; a dead host: immediate error | works; a dead host: immediate error if this mover never reached it, else [`AccessError::Timeout`] |
//! | `sm`, `posix`, `sysv` | no transport: `ucp_ep_create` fails, "Destination is unreachable" | works; a dead host as with tcp |
//! | any of them, host not progressing | [`AccessError::Timeout`] | [`AccessError::Timeout`] |
//!
//! (`cma` is listed but never used for RMA by UCX 1.13; on an access to a dead host UCX also
//! logs its failed `connect` as an `ERROR` line: the mover reports the failure.)
//!
//! # Endpoints end with their processes
//!
//! `Peer` endpoints get an error handler (`ucx_sys`): a peer's failure is recorded (counted
//! in [`UcxMoverStats::endpoint_errors`]), a failed endpoint is closed and replaced at its
//! next use, and UCX no longer logs "will not be handled since no error callback is
//! installed". The owner of the mover closes the endpoints of processes that are gone
//! ([`UcxMover::close_endpoints`]: an SP does it when a job ends or a rank's connection
//! closes), with forced closes progressed to completion within [`CLOSE_BOUND`]. The contexts
//! run without UCX's keepalive ([`crate::ucx_config`]).
//!
//! `Peer` is the default because it turns a dead host into an immediate error and closes
//! endpoints without waiting; shared-memory transports cannot detect peer failure, so UCX
//! excludes them in that mode. With `None`, dropping the endpoint of a dead host that has no
//! request pending (cache eviction, or after a failed request) runs a flushing close that may
//! progress for up to [`ucx_sys::CLOSE_WAIT_LIMIT`] (5 s).

use super::Mover;
use crate::{AccessError, AliasKey, BackendData, Owner, Rights};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;
use ucx_sys::{Context, Endpoint, Features, RemoteKey, Request, Worker};

pub use ucx_sys::ErrorHandling;

/// Default bound on every UCX request's wait.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default bound on cached endpoints (one per host worker).
pub const MAX_ENDPOINTS: usize = 1024;
/// Default bound on cached unpacked remote keys.
pub const MAX_RKEYS: usize = 4096;
/// Bound on the (owner, region) → newest generation table.
pub const MAX_GENERATIONS: usize = 1 << 16;
/// Default bound on timed-out requests (each with a staging buffer) kept until UCX completes
/// them.
pub const MAX_QUARANTINED: usize = 4;
/// Longest a [`UcxMover`] progresses its worker for the closes of one batch of endpoints (a
/// job's, a rank's, an eviction's): forced closes of endpoints to peers that are gone complete
/// at once; one still pending after this is left to UCX.
pub const CLOSE_BOUND: Duration = Duration::from_millis(200);
/// Zero bytes appended to the copies of packed keys and worker addresses handed to UCX. A
/// per-transport key is at most 255 bytes (its length prefix is one byte).
const BLOB_PAD: usize = 256;

/// How a [`UcxMover`] is set up.
#[derive(Clone, Debug)]
pub struct UcxMoverConfig {
    /// Staging buffer size: the largest get or put issued at once.
    pub chunk_bytes: usize,
    /// Longest wait for any one UCX request (get, put, flush).
    pub timeout: Duration,
    /// Error-handling mode of the endpoints (see the module docs for what works with which
    /// transports).
    pub error_handling: ErrorHandling,
    /// Overrides `UCX_TLS` for this mover's context; `None` takes it from the environment.
    pub tls: Option<String>,
    pub max_endpoints: usize,
    pub max_rkeys: usize,
    pub max_quarantined: usize,
}

impl Default for UcxMoverConfig {
    fn default() -> Self {
        UcxMoverConfig {
            chunk_bytes: super::DEFAULT_CHUNK_BYTES,
            timeout: DEFAULT_TIMEOUT,
            error_handling: ErrorHandling::Peer,
            tls: None,
            max_endpoints: MAX_ENDPOINTS,
            max_rkeys: MAX_RKEYS,
            max_quarantined: MAX_QUARANTINED,
        }
    }
}

/// Counters and cache sizes, for stats and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UcxMoverStats {
    pub endpoints: usize,
    pub rkeys: usize,
    pub quarantined: usize,
    pub rkey_hits: u64,
    pub rkey_misses: u64,
    pub timeouts: u64,
    /// Endpoints made, and let go of (closed: a job or rank ended, the peer failed, the cache
    /// was full). `endpoints` = `endpoints_opened` - `endpoints_closed`.
    pub endpoints_opened: u64,
    pub endpoints_closed: u64,
    /// Of `endpoints_closed`, those whose close had not completed within [`CLOSE_BOUND`]: left
    /// to UCX.
    pub endpoint_closes_unfinished: u64,
    /// Peer failures UCX reported through the endpoints' error handler (a rank that exited
    /// before its endpoint was closed, an unreachable host): handled, not logged by UCX.
    pub endpoint_errors: u64,
}

/// (owner, region): what a generation belongs to.
type RegionId = (Owner, u64);

struct EpEntry {
    ep: Rc<Endpoint>,
    last_use: u64,
    /// The process the endpoint reaches (the owner of the first key that needed it): its
    /// job and rank end it ([`UcxMover::close_job`], [`UcxMover::close_rank`]).
    owner: Owner,
}

struct RkeyEntry {
    worker_address: Vec<u8>,
    packed: Vec<u8>,
    rkey: RemoteKey,
    last_use: u64,
}

/// A request that did not complete in time, with the staging buffer it may still write.
struct Quarantined {
    req: Request,
    _buf: Option<Box<[u8]>>,
}

/// The `ucx` mover; see the module docs.
pub struct UcxMover {
    cfg: UcxMoverConfig,
    // Drop order: the quarantine is handled in Drop; then keys, endpoints, worker (the Rc
    // handles keep the UCX order right regardless).
    quarantine: Vec<Quarantined>,
    rkeys: HashMap<(RegionId, u32), RkeyEntry>,
    endpoints: HashMap<Vec<u8>, EpEntry>,
    generations: HashMap<RegionId, (u32, u64)>,
    staging: Box<[u8]>,
    worker: Rc<Worker>,
    clock: u64,
    rkey_hits: u64,
    rkey_misses: u64,
    timeouts: u64,
    endpoints_opened: u64,
    endpoints_closed: u64,
    endpoint_closes_unfinished: u64,
}

fn ucx_error(e: ucx_sys::Error, pid: u32) -> AccessError {
    AccessError::Ucx {
        op: e.op,
        pid,
        status: e.status.to_string(),
    }
}

fn ucx_parts(key: &AliasKey) -> Result<(&[u8], &[u8]), AccessError> {
    match &key.grant.backend {
        BackendData::Ucx {
            worker_address,
            rkey,
        } => Ok((worker_address, rkey)),
        BackendData::Cma => Err(AccessError::Unsupported("cma (in the ucx mover)")),
        BackendData::UcxExport { .. } => {
            Err(AccessError::Unsupported("ucx-export (in the ucx mover)"))
        }
    }
}

fn region_id(key: &AliasKey) -> RegionId {
    (key.owner, key.grant.region)
}

/// True if `b` is framed like a key from `ucp_rkey_pack` of UCX 1.12–1.14: a native-endian
/// 64-bit memory-domain map, a memory-type byte, then for every bit of the map a length byte
/// and that many bytes, all inside `b`. (What follows, if anything, UCX 1.13 ignores.)
pub(crate) fn rkey_framing_ok(b: &[u8]) -> bool {
    if b.len() < 9 {
        return false;
    }
    let md_map = u64::from_ne_bytes(b[..8].try_into().expect("8 bytes"));
    if u32::from(b[8]) >= ucx_sys::raw::UCS_MEMORY_TYPE_LAST {
        return false;
    }
    let mut p = 9usize;
    for _ in 0..md_map.count_ones() {
        match b.get(p) {
            Some(&n) => p += 1 + n as usize,
            None => return false,
        }
        if p > b.len() {
            return false;
        }
    }
    true
}

fn padded(b: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(b.len() + BLOB_PAD);
    v.extend_from_slice(b);
    v.resize(b.len() + BLOB_PAD, 0);
    v
}

fn new_staging(chunk_bytes: usize) -> Box<[u8]> {
    vec![0u8; chunk_bytes.max(4096)].into_boxed_slice()
}

/// Which local buffer an operation hands to UCX.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Local {
    Staging,
    None,
}

impl UcxMover {
    /// Creates the context (features RMA | WAKEUP) and worker. Call it on the thread that will
    /// use the mover.
    pub fn new(cfg: UcxMoverConfig) -> Result<Self, AccessError> {
        let features = Features::RMA | Features::WAKEUP;
        let tls: Vec<(&str, &str)> = cfg.tls.iter().map(|t| ("TLS", t.as_str())).collect();
        let context = Context::with_config(features, &crate::ucx_config(&tls))
            .map_err(|e| ucx_error(e, std::process::id()))?;
        let worker = Worker::new(&context).map_err(|e| ucx_error(e, std::process::id()))?;
        Ok(UcxMover {
            staging: new_staging(cfg.chunk_bytes),
            cfg,
            quarantine: Vec::new(),
            rkeys: HashMap::new(),
            endpoints: HashMap::new(),
            generations: HashMap::new(),
            worker,
            clock: 0,
            rkey_hits: 0,
            rkey_misses: 0,
            timeouts: 0,
            endpoints_opened: 0,
            endpoints_closed: 0,
            endpoint_closes_unfinished: 0,
        })
    }

    pub fn config(&self) -> &UcxMoverConfig {
        &self.cfg
    }

    pub fn stats(&self) -> UcxMoverStats {
        UcxMoverStats {
            endpoints: self.endpoints.len(),
            rkeys: self.rkeys.len(),
            quarantined: self.quarantine.len(),
            rkey_hits: self.rkey_hits,
            rkey_misses: self.rkey_misses,
            timeouts: self.timeouts,
            endpoints_opened: self.endpoints_opened,
            endpoints_closed: self.endpoints_closed,
            endpoint_closes_unfinished: self.endpoint_closes_unfinished,
            endpoint_errors: self.worker.endpoint_errors(),
        }
    }

    /// Closes the endpoints whose owner (that of the first key that needed the endpoint: the
    /// process it reaches) `pred` selects, with their unpacked keys, e.g. those of a job that
    /// ended or of a rank whose connection closed: their processes are gone or going, and an
    /// endpoint left open would only fail later. Returns how many were closed. An access that
    /// needs one of them again connects anew.
    pub fn close_endpoints(&mut self, pred: impl Fn(&Owner) -> bool) -> u64 {
        let gone: Vec<Vec<u8>> = self
            .endpoints
            .iter()
            .filter(|(_, e)| pred(&e.owner))
            .map(|(a, _)| a.clone())
            .collect();
        if gone.is_empty() {
            return 0;
        }
        self.rkeys.retain(|_, r| !gone.contains(&r.worker_address));
        let eps = gone
            .iter()
            .filter_map(|a| self.endpoints.remove(a))
            .map(|e| e.ep)
            .collect();
        self.retire(eps)
    }

    /// Closes endpoints taken out of the cache (their keys dropped already), together and
    /// bounded ([`CLOSE_BOUND`]), and counts them.
    fn retire(&mut self, eps: Vec<Rc<Endpoint>>) -> u64 {
        let n = eps.len() as u64;
        if n == 0 {
            return 0;
        }
        let r = ucx_sys::close_all(eps, CLOSE_BOUND);
        self.endpoints_closed += n;
        // Those still used by the access under way (`deferred`) close as it lets go of them.
        self.endpoint_closes_unfinished += r.unfinished;
        n
    }

    /// Every check that needs no UCX call: backend, bounds and rights, generation. Returns the
    /// absolute address in the owner's address space.
    pub fn precheck(
        &self,
        key: &AliasKey,
        offset: u64,
        len: u64,
        need: Rights,
    ) -> Result<u64, AccessError> {
        ucx_parts(key)?;
        let addr = key.check(offset, len, need)?;
        if let Some(&(current, _)) = self.generations.get(&region_id(key)) {
            key.check_generation(current)?;
        }
        Ok(addr)
    }

    /// Records that `generation` is current for `owner`'s `region` (e.g. learned from a
    /// control message): keys of older generations are refused from now on and their unpacked
    /// remote keys are released. Every accepted key notes its own generation too.
    pub fn note_generation(&mut self, owner: Owner, region: u64, generation: u32) {
        self.clock += 1;
        let clock = self.clock;
        let id = (owner, region);
        match self.generations.get_mut(&id) {
            Some(e) if e.0 >= generation => {
                e.1 = clock;
                return;
            }
            Some(e) => *e = (generation, clock),
            None => {
                if self.generations.len() >= MAX_GENERATIONS {
                    evict_half(&mut self.generations, |e| e.1);
                }
                self.generations.insert(id, (generation, clock));
            }
        }
        self.rkeys
            .retain(|(rid, g), _| *rid != id || *g >= generation);
    }

    /// Polls quarantined requests and releases the completed ones; refuses new work while the
    /// quarantine is full.
    fn admit(&mut self, pid: u32) -> Result<(), AccessError> {
        if !self.quarantine.is_empty() {
            self.worker.progress();
            self.reap_quarantine();
        }
        if self.quarantine.len() >= self.cfg.max_quarantined.max(1) {
            return Err(AccessError::Ucx {
                op: "quarantine",
                pid,
                status: format!(
                    "{} timed-out requests still pending: refusing new work",
                    self.quarantine.len()
                ),
            });
        }
        Ok(())
    }

    fn endpoint(
        &mut self,
        worker_address: &[u8],
        owner: Owner,
    ) -> Result<Rc<Endpoint>, AccessError> {
        self.clock += 1;
        if let Some(e) = self.endpoints.get_mut(worker_address) {
            if e.ep.failed().is_none() {
                e.last_use = self.clock;
                return Ok(Rc::clone(&e.ep));
            }
            // UCX reported its peer failed: it moves nothing more. Close it, connect anew.
            self.forget_peer(worker_address);
        }
        let ep = Endpoint::connect_with(
            &self.worker,
            &padded(worker_address),
            self.cfg.error_handling,
        )
        .map_err(|e| ucx_error(e, owner.pid))?;
        self.endpoints_opened += 1;
        if self.endpoints.len() >= self.cfg.max_endpoints.max(1) {
            let mut uses: Vec<u64> = self.endpoints.values().map(|e| e.last_use).collect();
            uses.sort_unstable();
            let cut = uses[uses.len() / 2];
            let old: Vec<Vec<u8>> = self
                .endpoints
                .iter()
                .filter(|(_, e)| e.last_use <= cut)
                .map(|(a, _)| a.clone())
                .collect();
            let eps = old
                .iter()
                .filter_map(|a| self.endpoints.remove(a))
                .map(|e| e.ep)
                .collect();
            let endpoints = &self.endpoints;
            self.rkeys
                .retain(|_, r| endpoints.contains_key(&r.worker_address));
            self.retire(eps);
        }
        self.endpoints.insert(
            worker_address.to_vec(),
            EpEntry {
                ep: Rc::clone(&ep),
                last_use: self.clock,
                owner,
            },
        );
        Ok(ep)
    }

    /// The endpoint and unpacked remote key for `key` (cached).
    fn resolve(&mut self, key: &AliasKey) -> Result<(Rc<Endpoint>, RemoteKey), AccessError> {
        let (worker_address, packed) = ucx_parts(key)?;
        let pid = key.owner.pid;
        let id = (region_id(key), key.grant.generation);
        self.clock += 1;
        if let Some(e) = self.rkeys.get_mut(&id) {
            if e.worker_address == worker_address
                && e.packed == packed
                && e.rkey.endpoint().failed().is_none()
            {
                e.last_use = self.clock;
                self.rkey_hits += 1;
                let rkey = e.rkey.clone();
                // Keep the endpoint's LRU stamp fresh too.
                if let Some(ep) = self.endpoints.get_mut(worker_address) {
                    ep.last_use = self.clock;
                }
                return Ok((Rc::clone(rkey.endpoint()), rkey));
            }
        }
        self.rkey_misses += 1;
        if !rkey_framing_ok(packed) {
            return Err(AccessError::Ucx {
                op: "ucp_ep_rkey_unpack",
                pid,
                status: "malformed packed remote key (refused before UCX saw it)".into(),
            });
        }
        let ep = self.endpoint(worker_address, key.owner)?;
        // SAFETY: the framing was checked above, so UCX's generic parser stays inside the
        // bytes, and the copy is zero-padded by more than any per-transport key can claim.
        // The contents come from the owner's UCX (module docs: the SP trusts them).
        let rkey =
            unsafe { RemoteKey::unpack(&ep, &padded(packed)) }.map_err(|e| ucx_error(e, pid))?;
        if self.rkeys.len() >= self.cfg.max_rkeys.max(1) {
            evict_half(&mut self.rkeys, |e| e.last_use);
        }
        self.rkeys.insert(
            id,
            RkeyEntry {
                worker_address: worker_address.to_vec(),
                packed: packed.to_vec(),
                rkey: rkey.clone(),
                last_use: self.clock,
            },
        );
        Ok((ep, rkey))
    }

    /// Forgets the cached endpoint (and its keys) of a host that failed or timed out.
    fn forget_peer(&mut self, worker_address: &[u8]) {
        self.rkeys.retain(|_, r| r.worker_address != worker_address);
        if let Some(e) = self.endpoints.remove(worker_address) {
            self.retire(vec![e.ep]);
        }
    }

    /// Releases the quarantined requests that completed (well or not): UCX no longer uses
    /// their buffers.
    fn reap_quarantine(&mut self) {
        self.quarantine
            .retain_mut(|q| matches!(q.req.test(), Ok(false)));
    }

    /// Waits for `req` at most the configured timeout. On timeout the request (and, if it uses
    /// it, the staging buffer) goes to the quarantine and a fresh staging buffer replaces it.
    fn finish(
        &mut self,
        mut req: Request,
        local: Local,
        key: &AliasKey,
        op: &'static str,
    ) -> Result<(), AccessError> {
        let pid = key.owner.pid;
        match req.wait_timeout(self.cfg.timeout) {
            Ok(true) => {
                // The wait progressed the worker: quarantined requests may have completed too.
                if !self.quarantine.is_empty() {
                    self.reap_quarantine();
                }
                Ok(())
            }
            Ok(false) => {
                self.timeouts += 1;
                let buf = match local {
                    Local::Staging => Some(std::mem::replace(
                        &mut self.staging,
                        new_staging(self.cfg.chunk_bytes),
                    )),
                    Local::None => None,
                };
                self.quarantine.push(Quarantined { req, _buf: buf });
                if let Ok((wa, _)) = ucx_parts(key) {
                    self.forget_peer(wa);
                }
                Err(AccessError::Timeout {
                    op,
                    pid,
                    after_ms: self.cfg.timeout.as_millis().min(u64::MAX as u128) as u64,
                })
            }
            Err(e) => {
                // The request completed with an error: UCX no longer uses its buffer.
                if let Ok((wa, _)) = ucx_parts(key) {
                    self.forget_peer(wa);
                }
                Err(ucx_error(e, pid))
            }
        }
    }

    fn fail_start(&mut self, e: ucx_sys::Error, key: &AliasKey) -> AccessError {
        if let Ok((wa, _)) = ucx_parts(key) {
            self.forget_peer(wa);
        }
        ucx_error(e, key.owner.pid)
    }

    /// Gets `n` bytes at `remote` into `staging[..n]`.
    fn get_chunk(
        &mut self,
        ep: &Rc<Endpoint>,
        rkey: &RemoteKey,
        remote: u64,
        n: usize,
        key: &AliasKey,
    ) -> Result<(), AccessError> {
        debug_assert!(n <= self.staging.len());
        // SAFETY: the staging buffer is valid for `n` writes and nothing reads or writes it
        // until the request completes: `finish` either sees it complete or moves the buffer,
        // with the request, to the quarantine, where it is only freed after completion (or
        // leaked).
        let req = unsafe { ep.get_nbx(self.staging.as_mut_ptr(), n, remote, rkey) }
            .map_err(|e| self.fail_start(e, key))?;
        self.finish(req, Local::Staging, key, "ucp_get_nbx")
    }

    /// Puts `staging[..n]` at `remote` (local completion only; flush for remote).
    fn put_chunk(
        &mut self,
        ep: &Rc<Endpoint>,
        rkey: &RemoteKey,
        remote: u64,
        n: usize,
        key: &AliasKey,
    ) -> Result<(), AccessError> {
        debug_assert!(n <= self.staging.len());
        // SAFETY: as in get_chunk; the buffer is only read by UCX.
        let req = unsafe { ep.put_nbx(self.staging.as_ptr(), n, remote, rkey) }
            .map_err(|e| self.fail_start(e, key))?;
        self.finish(req, Local::Staging, key, "ucp_put_nbx")
    }

    fn flush(&mut self, ep: &Rc<Endpoint>, key: &AliasKey) -> Result<(), AccessError> {
        let req = ep.flush_nbx().map_err(|e| self.fail_start(e, key))?;
        self.finish(req, Local::None, key, "ucp_ep_flush_nbx")
    }

    fn chunk_len(&self, left: u64) -> usize {
        left.min(self.staging.len() as u64) as usize
    }
}

fn evict_half<K: Clone + Eq + std::hash::Hash, V>(
    map: &mut HashMap<K, V>,
    stamp: impl Fn(&V) -> u64,
) {
    if map.is_empty() {
        return;
    }
    let mut uses: Vec<u64> = map.values().map(&stamp).collect();
    uses.sort_unstable();
    let cut = uses[uses.len() / 2];
    map.retain(|_, v| stamp(v) > cut);
}

impl Mover for UcxMover {
    fn copy(
        &mut self,
        src: &AliasKey,
        src_offset: u64,
        dst: &AliasKey,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), AccessError> {
        let src_addr = self.precheck(src, src_offset, len, Rights::READ)?;
        let dst_addr = self.precheck(dst, dst_offset, len, Rights::WRITE)?;
        if len == 0 {
            return Ok(());
        }
        self.admit(src.owner.pid)?;
        self.note_generation(src.owner, src.grant.region, src.grant.generation);
        self.note_generation(dst.owner, dst.grant.region, dst.grant.generation);
        let (sep, srk) = self.resolve(src)?;
        let (dep, drk) = self.resolve(dst)?;
        let mut moved = 0u64;
        while moved < len {
            let n = self.chunk_len(len - moved);
            self.get_chunk(&sep, &srk, src_addr + moved, n, src)?;
            self.put_chunk(&dep, &drk, dst_addr + moved, n, dst)?;
            moved += n as u64;
        }
        self.flush(&dep, dst)
    }

    fn write(&mut self, dst: &AliasKey, offset: u64, data: &[u8]) -> Result<(), AccessError> {
        let len = data.len() as u64;
        let addr = self.precheck(dst, offset, len, Rights::WRITE)?;
        if len == 0 {
            return Ok(());
        }
        self.admit(dst.owner.pid)?;
        self.note_generation(dst.owner, dst.grant.region, dst.grant.generation);
        let (ep, rkey) = self.resolve(dst)?;
        let mut done = 0usize;
        while done < data.len() {
            let n = self.chunk_len((data.len() - done) as u64);
            self.staging[..n].copy_from_slice(&data[done..done + n]);
            self.put_chunk(&ep, &rkey, addr + done as u64, n, dst)?;
            done += n;
        }
        self.flush(&ep, dst)
    }

    fn read(&mut self, src: &AliasKey, offset: u64, out: &mut [u8]) -> Result<(), AccessError> {
        let len = out.len() as u64;
        let addr = self.precheck(src, offset, len, Rights::READ)?;
        if len == 0 {
            return Ok(());
        }
        self.admit(src.owner.pid)?;
        self.note_generation(src.owner, src.grant.region, src.grant.generation);
        let (ep, rkey) = self.resolve(src)?;
        let mut done = 0usize;
        while done < out.len() {
            let n = self.chunk_len((out.len() - done) as u64);
            self.get_chunk(&ep, &rkey, addr + done as u64, n, src)?;
            out[done..done + n].copy_from_slice(&self.staging[..n]);
            done += n;
        }
        Ok(())
    }
}

impl Drop for UcxMover {
    fn drop(&mut self) {
        for mut q in self.quarantine.drain(..) {
            self.worker.progress();
            if let Ok(false) = q.req.test() {
                // Still in flight: dropping the request would block (and finally abort), and
                // freeing the buffer would let UCX write freed memory. Leak both.
                std::mem::forget(q);
            }
        }
    }
}

impl std::fmt::Debug for UcxMover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxMover")
            .field("cfg", &self.cfg)
            .field("stats", &self.stats())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Grant;

    fn key(backend: BackendData, len: u64, rights: Rights, generation: u32) -> AliasKey {
        AliasKey {
            owner: Owner {
                job: 1,
                world_rank: 3,
                pid: 4242,
                start: 1,
                uid: 0,
                gid: 0,
            },
            grant: Grant {
                region: 9,
                generation,
                addr: 0x10000,
                len,
                rights,
                backend,
            },
        }
    }

    fn ucx_backend(rkey: Vec<u8>) -> BackendData {
        BackendData::Ucx {
            worker_address: vec![0xee; 64],
            rkey,
        }
    }

    fn mover() -> UcxMover {
        UcxMover::new(UcxMoverConfig {
            tls: Some("tcp".into()),
            timeout: Duration::from_millis(200),
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn rkey_framing() {
        let mut k = vec![0u8; 9];
        assert!(rkey_framing_ok(&k), "no memory domain at all");
        k[0] = 0b101; // two domains
        assert!(!rkey_framing_ok(&k));
        k.extend_from_slice(&[2, 0xa, 0xb, 0]);
        assert!(rkey_framing_ok(&k));
        k[9] = 3;
        assert!(!rkey_framing_ok(&k), "first key claims one byte too many");
        k[9] = 2;
        k[8] = 200;
        assert!(!rkey_framing_ok(&k), "unknown memory type");
        assert!(!rkey_framing_ok(&[0; 8]));
    }

    #[test]
    fn refusals_touch_no_ucx_state() {
        let mut m = mover();
        let mut out = [0u8; 8];
        let r = key(ucx_backend(vec![0; 9]), 64, Rights::READ, 0);
        let w = key(ucx_backend(vec![0; 9]), 64, Rights::WRITE, 0);
        let c = key(BackendData::Cma, 64, Rights::READ_WRITE, 0);
        assert_eq!(
            m.read(&c, 0, &mut out),
            Err(AccessError::Unsupported("cma (in the ucx mover)"))
        );
        assert!(matches!(
            m.copy(&r, 0, &c, 0, 8),
            Err(AccessError::Unsupported(_))
        ));
        assert!(matches!(
            m.read(&r, 60, &mut out),
            Err(AccessError::OutOfRange { .. })
        ));
        assert!(matches!(
            m.write(&r, 0, &[1]),
            Err(AccessError::NoRight { .. })
        ));
        assert!(matches!(
            m.copy(&w, 0, &r, 0, 8),
            Err(AccessError::NoRight { .. })
        ));
        assert!(matches!(
            m.copy(&r, u64::MAX, &w, 0, 2),
            Err(AccessError::Overflow { .. })
        ));
        // Zero-length accesses inside the grant succeed without any UCX call.
        assert_eq!(m.read(&r, 64, &mut []), Ok(()));
        assert_eq!(m.copy(&r, 0, &w, 64, 0), Ok(()));
        // A malformed key is refused before UCX parses it (and before an endpoint exists).
        let bad = key(ucx_backend(vec![0xff; 9]), 64, Rights::READ, 0);
        assert!(matches!(
            m.read(&bad, 0, &mut out),
            Err(AccessError::Ucx {
                op: "ucp_ep_rkey_unpack",
                ..
            })
        ));
        assert_eq!(
            m.stats(),
            UcxMoverStats {
                rkey_misses: 1,
                ..Default::default()
            }
        );
    }

    #[test]
    fn generations_only_move_forward() {
        let mut m = mover();
        let k = key(ucx_backend(vec![0; 9]), 64, Rights::READ, 2);
        assert!(m.precheck(&k, 0, 8, Rights::READ).is_ok());
        m.note_generation(k.owner, k.grant.region, 3);
        m.note_generation(k.owner, k.grant.region, 1);
        assert_eq!(
            m.precheck(&k, 0, 8, Rights::READ),
            Err(AccessError::StaleGeneration { have: 3, got: 2 })
        );
        let mut other = k.clone();
        other.grant.region = 10;
        assert!(m.precheck(&other, 0, 8, Rights::READ).is_ok());
    }
}
