//! Nonblocking operation handles.
//!
//! A UCP `*_nbx` call either finishes at once (it returns NULL or an error
//! code) or returns a request that completes later, when the worker is
//! progressed. [`Request`] covers both cases. It is polled with
//! [`Request::test`], waited for with [`Request::wait`], and hands the
//! request back to UCX (`ucp_request_free`) as soon as it has completed.
//!
//! Dropping a request that is still in flight does not cancel it: UCX has no
//! general cancellation for RMA, and the local buffer of a get or put must
//! stay untouched until UCX is done with it. So `Drop` progresses the worker
//! until the request completes. If that takes longer than
//! [`DROP_WAIT_LIMIT`], the process is aborted: at that point the only other
//! choices are to let UCX write into memory the caller believes is free, or
//! to hang forever. Wait for requests explicitly to avoid ever getting there.

use std::os::raw::c_void;
use std::rc::Rc;
use std::time::{Duration, Instant};

use crate::raw;
use crate::status::{ptr_is_err, ptr_is_ptr, ptr_status, Error, Result, Status};
use crate::worker::Worker;

/// How long dropping an in-flight [`Request`] progresses the worker before
/// aborting the process.
pub const DROP_WAIT_LIMIT: Duration = Duration::from_secs(60);

/// Idle progress calls [`Request::wait_timeout`] makes before it sleeps on
/// the worker's event fd.
pub const IDLE_SPINS: u32 = 32;
/// Longest single sleep of [`Request::wait_timeout`] (a safety net: the
/// event fd wakes it as soon as the worker has events).
pub const IDLE_SLEEP: Duration = Duration::from_millis(5);

enum State {
    /// Completed; the UCX request (if there was one) is already freed.
    Done(Status),
    /// A live UCX request handle.
    InFlight(*mut c_void),
}

/// A nonblocking UCP operation: already completed, or in flight.
///
/// Holds the worker that must be progressed to complete it, plus whatever
/// the operation needs kept alive (endpoint, remote key).
#[must_use = "an in-flight request blocks in Drop until it completes"]
pub struct Request {
    state: State,
    op: &'static str,
    worker: Rc<Worker>,
    _keep_alive: Box<dyn std::any::Any>,
}

impl Request {
    /// Wraps the `ucs_status_ptr_t` returned by a UCP `*_nbx` call.
    ///
    /// # Safety
    /// `ptr` must be the unmodified return value of a UCP nonblocking call
    /// issued on `worker` without a user-supplied request buffer, not yet
    /// freed. `keep_alive` must hold everything the operation needs alive.
    pub(crate) unsafe fn from_status_ptr(
        ptr: raw::ucs_status_ptr_t,
        op: &'static str,
        worker: Rc<Worker>,
        keep_alive: Box<dyn std::any::Any>,
    ) -> Result<Request> {
        if ptr_is_err(ptr) {
            return Err(Error::new(op, ptr_status(ptr)));
        }
        let state = if ptr_is_ptr(ptr) {
            State::InFlight(ptr)
        } else {
            State::Done(Status::OK)
        };
        Ok(Request {
            state,
            op,
            worker,
            _keep_alive: keep_alive,
        })
    }

    /// True if the operation finished without needing a request (the `*_nbx`
    /// call returned `UCS_OK` directly).
    pub fn completed_immediately(&self) -> bool {
        matches!(self.state, State::Done(_))
    }

    /// Checks for completion without progressing the worker. `Ok(true)`:
    /// completed successfully; `Ok(false)`: still in flight; `Err`: the
    /// operation failed. Once complete the UCX request is freed.
    pub fn test(&mut self) -> Result<bool> {
        let st = match self.state {
            State::Done(st) => st,
            State::InFlight(req) => {
                // SAFETY: req is a live request (freed only below, after
                // which the state is Done).
                let st = Status(unsafe { raw::ucp_request_check_status(req) });
                if st == Status::IN_PROGRESS {
                    return Ok(false);
                }
                // SAFETY: the request has completed and is released exactly
                // once; the state change stops any further use of it.
                unsafe { raw::ucp_request_free(req) };
                self.state = State::Done(st);
                st
            }
        };
        st.check(self.op).map(|()| true)
    }

    /// Progresses the worker until the operation completes.
    ///
    /// This has no time limit: with `UCP_ERR_HANDLING_MODE_PEER` a dead peer
    /// fails the request, but with `NONE` a transport that needs the peer
    /// (e.g. tcp) may never complete. Use [`Request::wait_timeout`] if that
    /// matters.
    pub fn wait(mut self) -> Result<()> {
        loop {
            if self.test()? {
                return Ok(());
            }
            self.worker.progress();
        }
    }

    /// Like [`Request::wait`] but gives up after `limit`, returning
    /// `Ok(false)` with the request still in flight. When the worker stays
    /// idle for a while and its context has [`crate::Features::WAKEUP`], it
    /// sleeps on the worker's event fd (at most [`IDLE_SLEEP`] at a time)
    /// instead of spinning, so a peer that must progress for the request to
    /// complete (RMA emulated over active messages) gets the CPU.
    pub fn wait_timeout(&mut self, limit: Duration) -> Result<bool> {
        let start = Instant::now();
        let mut idle = 0u32;
        loop {
            if self.test()? {
                return Ok(true);
            }
            let spent = start.elapsed();
            if spent >= limit {
                return Ok(false);
            }
            if self.worker.progress() > 0 {
                idle = 0;
            } else {
                idle += 1;
                if idle >= IDLE_SPINS {
                    self.worker
                        .sleep_until_events(IDLE_SLEEP.min(limit - spent));
                    idle = 0;
                }
            }
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if matches!(self.state, State::Done(_)) {
            return;
        }
        match self.wait_timeout(DROP_WAIT_LIMIT) {
            Ok(true) | Err(_) => {}
            Ok(false) => {
                eprintln!(
                    "ucx-sys: {} request still in flight after {:?} in Drop; \
                     aborting rather than let UCX touch a released buffer",
                    self.op, DROP_WAIT_LIMIT
                );
                std::process::abort();
            }
        }
    }
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            State::Done(st) => format!("done: {st}"),
            State::InFlight(p) => format!("in flight: {p:p}"),
        };
        f.debug_struct("Request")
            .field("op", &self.op)
            .field("state", &state)
            .finish()
    }
}
