//! The UCP worker: the progress engine that endpoints and requests belong to.
//!
//! Workers here are created in `UCS_THREAD_MODE_SINGLE`, so a [`Worker`] and
//! everything hanging off it is `!Send`: use it from one thread.
//!
//! # Joining a mio (or any epoll) loop
//!
//! Create the context with [`Features::WAKEUP`](crate::Features::WAKEUP) and
//! register [`Worker::event_fd`] for readability, e.g. with
//! `mio::unix::SourceFd` (UCX owns the fd: never read from or close it).
//! Then:
//!
//! 1. On readiness, call [`Worker::progress`] until it returns 0.
//! 2. Call [`Worker::arm`]. If it returns `Ok(true)` the fd is armed and you
//!    can go back to waiting. If it returns `Ok(false)` (`UCS_ERR_BUSY`)
//!    events arrived in between: go back to step 1 without waiting.
//!
//! Arm before every wait; a wait without a successful arm may sleep forever.
//! Whether the *peer* has to progress depends on the memory and transport
//! (see the crate docs); the local worker must always be progressed for
//! local requests to complete. An operation may also complete inside the
//! `*_nbx` call itself (a shared-memory get does), so check the returned
//! [`Request`](crate::Request) right away instead of waiting for readiness.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::os::raw::c_void;
use std::ptr;
use std::rc::Rc;
use std::time::Duration;

use crate::context::{Context, Features};
use crate::raw;
use crate::status::{Error, Result, Status};

/// A UCP worker (`ucp_worker_h`), keeping its [`Context`] alive.
pub struct Worker {
    handle: raw::ucp_worker_h,
    context: Rc<Context>,
    /// Where the error handler of this worker's endpoints reports (its address is the
    /// handler's argument: boxed so that it does not move; freed after the worker is
    /// destroyed, so after the last call of the handler).
    errors: Box<EpErrors>,
}

/// What the error handler of a worker's endpoints ([`on_ep_error`]) saw.
#[derive(Default)]
pub(crate) struct EpErrors {
    /// Every failure reported (an endpoint is reported at most once by UCX).
    count: Cell<u64>,
    /// The failed endpoints still alive, by handle (an [`Endpoint`](crate::Endpoint) removes
    /// its own when it is closed, so this holds at most the live endpoints).
    failed: RefCell<HashMap<usize, Status>>,
}

/// The error handler installed on every [`ErrorHandling::Peer`](crate::ErrorHandling)
/// endpoint (`ucp_ep_params_t::err_handler`): UCX calls it, from the worker's progress, when
/// the peer of `ep` failed or became unreachable (a rank that exited, a refused reconnection,
/// a keepalive timeout). It records the failure; the endpoint's owner sees it with
/// [`Endpoint::failed`](crate::Endpoint::failed) and closes the endpoint (a forced close, as
/// UCX requires after an error). Without a handler UCX logs an `ERROR` line ("will not be
/// handled since no error callback is installed") for each such endpoint.
pub(crate) unsafe extern "C" fn on_ep_error(
    arg: *mut c_void,
    ep: raw::ucp_ep_h,
    status: raw::ucs_status_t,
) {
    if arg.is_null() {
        return;
    }
    // SAFETY: `arg` is the address of the boxed `EpErrors` of the worker the endpoint belongs
    // to (set in `Endpoint::connect_with`), alive until after the worker is destroyed; UCX
    // calls the handler on the worker's (only) thread.
    let sink = unsafe { &*(arg as *const EpErrors) };
    sink.count.set(sink.count.get() + 1);
    // Never panic across the FFI boundary: a borrow held elsewhere (not expected: no borrow
    // is held across a progress) only loses the per-endpoint mark, not the count.
    if let Ok(mut failed) = sink.failed.try_borrow_mut() {
        failed.insert(ep as usize, Status(status));
    }
}

impl Worker {
    /// Creates a single-threaded worker on `context`.
    pub fn new(context: &Rc<Context>) -> Result<Rc<Worker>> {
        let params = raw::ucp_worker_params_t {
            field_mask: raw::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: raw::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut handle: raw::ucp_worker_h = ptr::null_mut();
        // SAFETY: the context is alive (we hold an Rc), params is fully
        // initialised and handle is a valid out-pointer.
        let st = unsafe { raw::ucp_worker_create(context.as_raw(), &params, &mut handle) };
        Status(st).check("ucp_worker_create")?;
        Ok(Rc::new(Worker {
            handle,
            context: Rc::clone(context),
            errors: Box::default(),
        }))
    }

    /// How many endpoint failures the error handler of this worker's endpoints was called for
    /// (see [`Endpoint::failed`](crate::Endpoint::failed)).
    pub fn endpoint_errors(&self) -> u64 {
        self.errors.count.get()
    }

    /// The error handler's argument for this worker's endpoints.
    pub(crate) fn error_sink(&self) -> *mut c_void {
        &*self.errors as *const EpErrors as *mut c_void
    }

    /// The failure the error handler reported for `ep`, if any.
    pub(crate) fn ep_failure(&self, ep: raw::ucp_ep_h) -> Option<Status> {
        self.errors.failed.borrow().get(&(ep as usize)).copied()
    }

    /// Forgets what was reported for `ep` (it is being closed).
    pub(crate) fn forget_ep(&self, ep: raw::ucp_ep_h) {
        self.errors.failed.borrow_mut().remove(&(ep as usize));
    }

    /// The context this worker belongs to.
    pub fn context(&self) -> &Rc<Context> {
        &self.context
    }

    /// The raw handle. Valid while `self` is alive.
    pub fn as_raw(&self) -> raw::ucp_worker_h {
        self.handle
    }

    /// This worker's address, as opaque bytes to hand to a peer's
    /// [`Endpoint::connect`](crate::Endpoint::connect).
    pub fn address(&self) -> Result<Vec<u8>> {
        let mut addr: *mut raw::ucp_address_t = ptr::null_mut();
        let mut len: usize = 0;
        // SAFETY: the worker is alive; addr and len are valid out-pointers.
        let st = unsafe { raw::ucp_worker_get_address(self.handle, &mut addr, &mut len) };
        Status(st).check("ucp_worker_get_address")?;
        // SAFETY: on success UCX returns a buffer of `len` readable bytes,
        // which we copy before releasing it exactly once.
        let bytes = unsafe {
            let v = std::slice::from_raw_parts(addr as *const u8, len).to_vec();
            raw::ucp_worker_release_address(self.handle, addr);
            v
        };
        Ok(bytes)
    }

    /// Runs one round of communication progress; returns the number of
    /// events processed (0 means idle).
    pub fn progress(&self) -> u32 {
        // SAFETY: the worker is alive and used from its only thread (the
        // type is !Send).
        unsafe { raw::ucp_worker_progress(self.handle) }
    }

    /// Calls [`Worker::progress`] until it reports no work.
    pub fn progress_until_idle(&self) {
        while self.progress() != 0 {}
    }

    /// The worker's event file descriptor (`ucp_worker_get_efd`). Needs the
    /// context to have [`Features::WAKEUP`]. Owned by UCX: do not close it.
    pub fn event_fd(&self) -> Result<RawFd> {
        if !self.context.features().contains(Features::WAKEUP) {
            return Err(Error::new("ucp_worker_get_efd", Status::ERR_INVALID_PARAM));
        }
        let mut fd: std::os::raw::c_int = -1;
        // SAFETY: the worker is alive and fd is a valid out-pointer.
        let st = unsafe { raw::ucp_worker_get_efd(self.handle, &mut fd) };
        Status(st).check("ucp_worker_get_efd")?;
        Ok(fd)
    }

    /// Waits up to `limit` for the worker to have events, without spinning,
    /// when the context has [`Features::WAKEUP`]: arms the event fd and
    /// sleeps in `poll` on it. Returns at once if events are pending (`arm`
    /// says busy) and does nothing without the feature. Call it only after
    /// [`Worker::progress`] returned 0.
    pub fn sleep_until_events(&self, limit: Duration) {
        if !self.context.features().contains(Features::WAKEUP) || limit.is_zero() {
            return;
        }
        let Ok(fd) = self.event_fd() else { return };
        if !matches!(self.arm(), Ok(true)) {
            return;
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = limit.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd; the fd belongs to the live worker.
        unsafe { libc::poll(&mut pfd, 1, ms) };
    }

    /// Arms the event fd (`ucp_worker_arm`). `Ok(true)`: armed, safe to
    /// wait. `Ok(false)`: `UCS_ERR_BUSY`, events are pending, progress again
    /// before trying to arm.
    pub fn arm(&self) -> Result<bool> {
        // SAFETY: the worker is alive.
        let st = Status(unsafe { raw::ucp_worker_arm(self.handle) });
        if st == Status::ERR_BUSY {
            Ok(false)
        } else {
            st.check("ucp_worker_arm").map(|()| true)
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: endpoints and requests hold an Rc to this worker, so none
        // is alive now; the handle is destroyed exactly once.
        unsafe { raw::ucp_worker_destroy(self.handle) };
    }
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("handle", &self.handle)
            .finish()
    }
}
