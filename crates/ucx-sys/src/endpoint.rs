//! Endpoints and the RMA operations issued on them.
//!
//! An [`Endpoint`] is created from a peer worker's address bytes. Gets and
//! puts come in two flavours: `get_nbx`/`put_nbx` return a [`Request`] and
//! are `unsafe` because the local buffer is only raw memory to UCX until the
//! request completes; [`Endpoint::get`]/[`Endpoint::put`] borrow a slice and
//! block, progressing the worker, until the transfer is done.
//!
//! Completion of a put only means the local buffer may be reused. To know the
//! data has reached the remote memory, call [`Endpoint::flush`].

use std::cell::Cell;
use std::os::raw::c_void;
use std::ptr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use crate::memory::MemHandle;
use crate::raw;
use crate::request::Request;
use crate::status::{ptr_is_ptr, ptr_status, Error, Result, Status};
use crate::worker::Worker;

/// UCP error-handling mode of an endpoint (`ucp_err_handling_mode_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorHandling {
    /// `UCP_ERR_HANDLING_MODE_NONE`: no failure detection. Transports are not
    /// restricted (shared memory included), but a dead peer can leave
    /// requests hanging.
    None,
    /// `UCP_ERR_HANDLING_MODE_PEER`: requests fail (instead of hanging) when
    /// the peer dies, and a forced close is well defined. UCX then only
    /// selects transports that can detect peer failure (not sysv/posix) and
    /// runs a wire-up handshake and keepalive that need the peer to progress.
    Peer,
}

/// How long dropping an endpoint progresses the worker for its close request
/// before letting UCX finish it in the background.
pub const CLOSE_WAIT_LIMIT: Duration = Duration::from_secs(5);

/// A connection to a peer worker (`ucp_ep_h`), keeping its [`Worker`] alive.
pub struct Endpoint {
    handle: raw::ucp_ep_h,
    err_mode: ErrorHandling,
    worker: Rc<Worker>,
    /// Closed already by [`close_all`]: `Drop` has nothing left to do.
    closed: Cell<bool>,
}

/// What [`close_all`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CloseReport {
    /// Endpoints whose close completed (well or with an error: UCX released them).
    pub closed: u64,
    /// Endpoints whose close was still pending at the bound: left to UCX, which finishes (or
    /// discards) them as the worker progresses or is destroyed.
    pub unfinished: u64,
    /// Endpoints still referenced elsewhere (a request or key in flight): closed when the
    /// last reference goes, as any dropped endpoint.
    pub deferred: u64,
}

/// Closes `endpoints` together, progressing their workers for at most `limit` in total (not
/// per endpoint): a forced close (`UCP_EP_CLOSE_FLAG_FORCE`) for [`ErrorHandling::Peer`]
/// endpoints (what UCX requires of a failed endpoint, and all an endpoint to a peer that is
/// gone can get), a flushing close otherwise. For a whole job's endpoints at once, where
/// dropping them one by one would wait for each in turn.
pub fn close_all(endpoints: Vec<Rc<Endpoint>>, limit: Duration) -> CloseReport {
    let mut report = CloseReport::default();
    let mut pending: Vec<(Rc<Endpoint>, *mut c_void)> = Vec::new();
    let mut workers: Vec<Rc<Worker>> = Vec::new();
    for ep in endpoints {
        if !workers.iter().any(|w| Rc::ptr_eq(w, &ep.worker)) {
            workers.push(Rc::clone(&ep.worker));
        }
        if Rc::strong_count(&ep) > 1 {
            report.deferred += 1;
            continue;
        }
        match ep.start_close() {
            Some(req) => pending.push((ep, req)),
            None => report.closed += 1,
        }
    }
    let start = Instant::now();
    // UCX finishes a close in the worker's progress (a forced close that completed at once
    // still discards its transport endpoints there, their sockets open until then): progress
    // each worker until idle too, within the same bound, so that nothing of the closed
    // endpoints is left to be found by a later progress (e.g. a message the peer sent just
    // before it exited, which UCX would answer by connecting back to it).
    while !pending.is_empty() {
        pending.retain(|(_, req)| {
            // SAFETY: req is a live close request until freed here, exactly once.
            let st = Status(unsafe { raw::ucp_request_check_status(*req) });
            if st == Status::IN_PROGRESS {
                return true;
            }
            // SAFETY: as above; the request completed.
            unsafe { raw::ucp_request_free(*req) };
            report.closed += 1;
            false
        });
        if pending.is_empty() || start.elapsed() >= limit {
            break;
        }
        for w in &workers {
            w.progress();
        }
    }
    for (_, req) in pending {
        report.unfinished += 1;
        // SAFETY: a request still in flight: UCX releases it on completion. Freed once.
        unsafe { raw::ucp_request_free(req) };
    }
    for w in workers {
        while w.progress() != 0 && start.elapsed() < limit {}
    }
    report
}

impl Endpoint {
    /// Connects to the worker whose [`Worker::address`] is `remote_address`,
    /// with [`ErrorHandling::None`].
    ///
    /// `None` is the default because it is the only mode that reaches a
    /// target that never progresses: `Peer` rules out the shared-memory
    /// transports (they cannot detect peer failure) and adds a keepalive and
    /// wire-up handshake, so RMA then goes over a transport that needs the
    /// target to progress. The endpoint creation itself is local in both
    /// modes; nothing is sent until the first operation.
    pub fn connect(worker: &Rc<Worker>, remote_address: &[u8]) -> Result<Rc<Endpoint>> {
        Self::connect_with(worker, remote_address, ErrorHandling::None)
    }

    /// Like [`Endpoint::connect`] with an explicit error-handling mode.
    pub fn connect_with(
        worker: &Rc<Worker>,
        remote_address: &[u8],
        err_mode: ErrorHandling,
    ) -> Result<Rc<Endpoint>> {
        // UCX parses the address without a length; refuse the obviously
        // truncated case. A well-formed address is at least a few bytes.
        if remote_address.len() < 8 {
            return Err(Error::new("ucp_ep_create", Status::ERR_INVALID_PARAM));
        }
        let mut params = raw::ucp_ep_params_t {
            field_mask: (raw::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | raw::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE) as u64,
            address: remote_address.as_ptr() as *const raw::ucp_address_t,
            err_mode: match err_mode {
                ErrorHandling::None => raw::UCP_ERR_HANDLING_MODE_NONE,
                ErrorHandling::Peer => raw::UCP_ERR_HANDLING_MODE_PEER,
            },
            ..Default::default()
        };
        if err_mode == ErrorHandling::Peer {
            // A peer's failure is handled (recorded, see `Endpoint::failed`), not logged by
            // UCX as an unhandled error.
            params.field_mask |= raw::UCP_EP_PARAM_FIELD_ERR_HANDLER as u64;
            params.err_handler = raw::ucp_err_handler_t {
                cb: Some(crate::worker::on_ep_error),
                arg: worker.error_sink(),
            };
        }
        let mut handle: raw::ucp_ep_h = ptr::null_mut();
        // SAFETY: the worker is alive; params points at remote_address, which
        // outlives the call (UCX copies what it needs); handle is a valid
        // out-pointer.
        let st = unsafe { raw::ucp_ep_create(worker.as_raw(), &params, &mut handle) };
        Status(st).check("ucp_ep_create")?;
        // A report left for an earlier endpoint at the same address (not expected: UCX calls
        // no handler after a close) must not mark this one.
        worker.forget_ep(handle);
        Ok(Rc::new(Endpoint {
            handle,
            err_mode,
            worker: Rc::clone(worker),
            closed: Cell::new(false),
        }))
    }

    /// The failure UCX reported for this endpoint through its error handler (its peer died
    /// or became unreachable), if any. Only [`ErrorHandling::Peer`] endpoints have one. A
    /// failed endpoint moves nothing more: close it (drop it) and connect anew if needed.
    pub fn failed(&self) -> Option<Status> {
        self.worker.ep_failure(self.handle)
    }

    /// Starts closing the endpoint (forced for `Peer`, flushing otherwise); marks it closed.
    /// `Some(request)`: the close is in flight (the caller progresses and frees it).
    fn start_close(&self) -> Option<*mut c_void> {
        debug_assert!(!self.closed.get());
        self.closed.set(true);
        self.worker.forget_ep(self.handle);
        let param = raw::ucp_request_param_t {
            op_attr_mask: raw::UCP_OP_ATTR_FIELD_FLAGS,
            flags: match self.err_mode {
                ErrorHandling::Peer => raw::UCP_EP_CLOSE_FLAG_FORCE,
                ErrorHandling::None => 0,
            },
            ..Default::default()
        };
        // SAFETY: the endpoint is alive and closed exactly once (`closed`); requests and
        // remote keys hold an Rc to it, so none is outstanding when the last Rc goes, and
        // `close_all` only closes endpoints it holds the only Rc of.
        let req = unsafe { raw::ucp_ep_close_nbx(self.handle, &param) };
        if ptr_is_ptr(req) {
            Some(req)
        } else {
            let st = ptr_status(req);
            debug_assert!(
                !st.is_err() || st == Status::ERR_CANCELED,
                "ucp_ep_close_nbx: {st}"
            );
            None
        }
    }

    /// The worker this endpoint belongs to.
    pub fn worker(&self) -> &Rc<Worker> {
        &self.worker
    }

    /// The error-handling mode the endpoint was created with.
    pub fn error_handling(&self) -> ErrorHandling {
        self.err_mode
    }

    /// The raw handle. Valid while `self` is alive.
    pub fn as_raw(&self) -> raw::ucp_ep_h {
        self.handle
    }

    fn check_rkey(self: &Rc<Self>, op: &'static str, rkey: &RemoteKey) -> Result<()> {
        if Rc::ptr_eq(self, rkey.endpoint()) {
            Ok(())
        } else {
            // A key is only valid on the endpoint it was unpacked on.
            Err(Error::new(op, Status::ERR_INVALID_PARAM))
        }
    }

    /// Starts reading `len` bytes at `remote_addr` (covered by `rkey`) into
    /// `local` (`ucp_get_nbx`).
    ///
    /// # Safety
    /// `local..local+len` must be valid for writes and not be read or written
    /// by anything else until the returned request has completed (reported
    /// by [`Request::test`]/[`Request::wait`]) or been dropped.
    pub unsafe fn get_nbx(
        self: &Rc<Self>,
        local: *mut u8,
        len: usize,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Request> {
        // SAFETY: forwarded from the caller.
        unsafe { self.rma(Rma::Get, local, len, None, remote_addr, rkey) }
    }

    /// Like [`Endpoint::get_nbx`], with the local buffer described by `memh`
    /// (`UCP_OP_ATTR_FIELD_MEMH`): an imported exported handle
    /// ([`MemHandle::import`]) makes `local` an address of the exporting
    /// process, written by the device (cross-GVMI). The request keeps `memh`
    /// alive.
    ///
    /// # Safety
    /// As [`Endpoint::get_nbx`], and `local..local+len` must lie inside the
    /// region `memh` covers.
    pub unsafe fn get_nbx_memh(
        self: &Rc<Self>,
        local: *mut u8,
        len: usize,
        memh: &Rc<MemHandle>,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Request> {
        // SAFETY: forwarded from the caller.
        unsafe { self.rma(Rma::Get, local, len, Some(memh), remote_addr, rkey) }
    }

    /// Starts writing `len` bytes from `local` to `remote_addr` (covered by
    /// `rkey`) (`ucp_put_nbx`). Completion means `local` may be reused, not
    /// that the data is remotely visible: see [`Endpoint::flush`].
    ///
    /// # Safety
    /// `local..local+len` must be valid for reads and not be written by
    /// anything else until the returned request has completed or been
    /// dropped.
    pub unsafe fn put_nbx(
        self: &Rc<Self>,
        local: *const u8,
        len: usize,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Request> {
        // SAFETY: forwarded from the caller.
        unsafe { self.rma(Rma::Put, local as *mut u8, len, None, remote_addr, rkey) }
    }

    /// Like [`Endpoint::put_nbx`], with the local buffer described by `memh`
    /// (see [`Endpoint::get_nbx_memh`]). The request keeps `memh` alive.
    ///
    /// # Safety
    /// As [`Endpoint::put_nbx`], and `local..local+len` must lie inside the
    /// region `memh` covers.
    pub unsafe fn put_nbx_memh(
        self: &Rc<Self>,
        local: *const u8,
        len: usize,
        memh: &Rc<MemHandle>,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Request> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.rma(
                Rma::Put,
                local as *mut u8,
                len,
                Some(memh),
                remote_addr,
                rkey,
            )
        }
    }

    /// # Safety
    /// As the public get/put functions.
    unsafe fn rma(
        self: &Rc<Self>,
        op: Rma,
        local: *mut u8,
        len: usize,
        memh: Option<&Rc<MemHandle>>,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Request> {
        let name = match op {
            Rma::Get => "ucp_get_nbx",
            Rma::Put => "ucp_put_nbx",
        };
        self.check_rkey(name, rkey)?;
        let mut param = raw::ucp_request_param_t::default();
        if let Some(m) = memh {
            param.op_attr_mask |= raw::UCP_OP_ATTR_FIELD_MEMH;
            param.memh = m.as_raw();
        }
        let keep: Box<dyn std::any::Any> = match memh {
            None => self.keep(rkey),
            Some(m) => Box::new((Rc::clone(self), rkey.clone(), Rc::clone(m))),
        };
        // SAFETY: ep, rkey (and memh) are alive and kept alive by the request;
        // the caller guarantees the local buffer; param selects contiguous
        // bytes with no callback.
        unsafe {
            let p = match op {
                Rma::Get => raw::ucp_get_nbx(
                    self.handle,
                    local as *mut c_void,
                    len,
                    remote_addr,
                    rkey.as_raw(),
                    &param,
                ),
                Rma::Put => raw::ucp_put_nbx(
                    self.handle,
                    local as *const c_void,
                    len,
                    remote_addr,
                    rkey.as_raw(),
                    &param,
                ),
            };
            Request::from_status_ptr(p, name, Rc::clone(&self.worker), keep)
        }
    }

    fn keep(self: &Rc<Self>, rkey: &RemoteKey) -> Box<dyn std::any::Any> {
        Box::new((Rc::clone(self), rkey.clone()))
    }

    /// Reads `buf.len()` bytes from `remote_addr` into `buf`, progressing the
    /// worker until done.
    pub fn get(self: &Rc<Self>, buf: &mut [u8], remote_addr: u64, rkey: &RemoteKey) -> Result<()> {
        // SAFETY: buf is exclusively borrowed until wait() returns, and the
        // request cannot outlive this call (wait consumes it, and an early
        // return drops it, which blocks until completion).
        let req = unsafe { self.get_nbx(buf.as_mut_ptr(), buf.len(), remote_addr, rkey)? };
        req.wait()
    }

    /// Writes `buf` to `remote_addr`, progressing the worker until the local
    /// buffer is released. Call [`Endpoint::flush`] for remote completion.
    pub fn put(self: &Rc<Self>, buf: &[u8], remote_addr: u64, rkey: &RemoteKey) -> Result<()> {
        // SAFETY: buf is borrowed until the request completes (see get).
        let req = unsafe { self.put_nbx(buf.as_ptr(), buf.len(), remote_addr, rkey)? };
        req.wait()
    }

    /// Starts a flush of all operations issued on this endpoint
    /// (`ucp_ep_flush_nbx`).
    pub fn flush_nbx(self: &Rc<Self>) -> Result<Request> {
        let param = raw::ucp_request_param_t::default();
        // SAFETY: the endpoint is alive and kept alive by the request.
        unsafe {
            let p = raw::ucp_ep_flush_nbx(self.handle, &param);
            Request::from_status_ptr(
                p,
                "ucp_ep_flush_nbx",
                Rc::clone(&self.worker),
                Box::new(Rc::clone(self)),
            )
        }
    }

    /// Blocks until every get/put issued on this endpoint is complete at the
    /// remote side.
    pub fn flush(self: &Rc<Self>) -> Result<()> {
        self.flush_nbx()?.wait()
    }
}

/// Which RMA operation [`Endpoint::rma`] issues.
#[derive(Clone, Copy)]
enum Rma {
    Get,
    Put,
}

impl Drop for Endpoint {
    /// Closes the endpoint: a forced close (`UCP_EP_CLOSE_FLAG_FORCE`) for
    /// [`ErrorHandling::Peer`] endpoints, which UCX documents as requiring
    /// that mode, and a flushing close otherwise. The worker is progressed
    /// for at most [`CLOSE_WAIT_LIMIT`]; a close still pending after that is
    /// left to UCX (it is finished or discarded when the worker is
    /// destroyed).
    fn drop(&mut self) {
        if self.closed.get() {
            return;
        }
        let Some(req) = self.start_close() else {
            return;
        };
        let start = Instant::now();
        loop {
            // SAFETY: req is a live request until freed below.
            let st = Status(unsafe { raw::ucp_request_check_status(req) });
            if st != Status::IN_PROGRESS || start.elapsed() >= CLOSE_WAIT_LIMIT {
                break;
            }
            self.worker.progress();
        }
        // SAFETY: freeing a completed request releases it; freeing one still
        // in flight tells UCX to release it on completion. Done exactly once.
        unsafe { raw::ucp_request_free(req) };
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("handle", &self.handle)
            .field("err_mode", &self.err_mode)
            .finish()
    }
}

struct RkeyInner {
    handle: raw::ucp_rkey_h,
    // Declared after `handle` only for readability: Drop below destroys the
    // rkey before this Rc (and so possibly the endpoint) is released, as UCX
    // requires.
    endpoint: Rc<Endpoint>,
}

impl Drop for RkeyInner {
    fn drop(&mut self) {
        // SAFETY: the rkey is live, destroyed exactly once, and its endpoint
        // is still alive (we hold an Rc). Requests using the key hold a clone
        // of the RemoteKey, so none is outstanding.
        unsafe { raw::ucp_rkey_destroy(self.handle) };
    }
}

/// An unpacked remote key (`ucp_rkey_h`), tied to the endpoint it was
/// unpacked on. Cloning is cheap (shared handle); the key is destroyed when
/// the last clone and every request using it are gone.
#[derive(Clone)]
pub struct RemoteKey {
    inner: Rc<RkeyInner>,
}

/// Smallest packed key UCX 1.13 produces: an 8-byte memory-domain map and a
/// 1-byte memory type.
const MIN_PACKED_RKEY_LEN: usize = 9;

impl RemoteKey {
    /// Unpacks a key packed by a peer's [`MemHandle::rkey_pack`]
    /// (`ucp_ep_rkey_unpack`).
    ///
    /// Inputs shorter than the smallest possible packed key are rejected
    /// with `UCS_ERR_INVALID_PARAM` before UCX sees them.
    ///
    /// # Safety
    /// `packed` must be exactly the bytes some `ucp_rkey_pack` of a
    /// compatible UCX produced. `ucp_ep_rkey_unpack` takes no length: it
    /// trusts the sizes encoded in the buffer, so arbitrary bytes can make it
    /// read past the slice, and the per-transport unpackers act on what they
    /// read (shared-memory transports attach segments named in the key).
    pub unsafe fn unpack(endpoint: &Rc<Endpoint>, packed: &[u8]) -> Result<RemoteKey> {
        if packed.len() < MIN_PACKED_RKEY_LEN {
            return Err(Error::new("ucp_ep_rkey_unpack", Status::ERR_INVALID_PARAM));
        }
        let mut handle: raw::ucp_rkey_h = ptr::null_mut();
        // SAFETY: the endpoint is alive; the caller guarantees packed is a
        // well-formed key; handle is a valid out-pointer.
        let st = unsafe {
            raw::ucp_ep_rkey_unpack(
                endpoint.as_raw(),
                packed.as_ptr() as *const c_void,
                &mut handle,
            )
        };
        Status(st).check("ucp_ep_rkey_unpack")?;
        Ok(RemoteKey {
            inner: Rc::new(RkeyInner {
                handle,
                endpoint: Rc::clone(endpoint),
            }),
        })
    }

    /// The endpoint this key was unpacked on.
    pub fn endpoint(&self) -> &Rc<Endpoint> {
        &self.inner.endpoint
    }

    /// The raw handle. Valid while `self` is alive.
    pub fn as_raw(&self) -> raw::ucp_rkey_h {
        self.inner.handle
    }
}

impl std::fmt::Debug for RemoteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteKey")
            .field("handle", &self.inner.handle)
            .finish()
    }
}
