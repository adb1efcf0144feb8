//! The UCP context: one per process (or per independent user), owning the
//! transport resources and memory registrations.
//!
//! The configuration is read with `ucp_config_read(NULL, NULL, ..)`, so the
//! usual `UCX_*` environment variables (`UCX_TLS`, `UCX_NET_DEVICES`, ...)
//! apply. [`Context::with_config`] additionally overrides individual keys
//! (named without the `UCX_` prefix, e.g. `("TLS", "cma,self")`) through
//! `ucp_config_modify`, which is handier than mutating the process
//! environment in a program that has threads.

use std::ffi::CString;
use std::ops::BitOr;
use std::ptr;
use std::rc::Rc;

use crate::raw;
use crate::status::{Error, Result, Status};

/// Feature bits requested from UCP (`UCP_FEATURE_*`).
///
/// Only the ones this project uses are named. [`Features::EXPORTED_MEMH`]
/// (importing exported memory handles, the BlueField cross-GVMI path) exists
/// only in UCX >= 1.15: built against an older UCX it is the empty set (see
/// [`crate::EXPORT_API`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features(pub u64);

impl Features {
    /// Remote memory access: `ucp_get_nbx` / `ucp_put_nbx` / `ucp_rkey_*`.
    pub const RMA: Features = Features(raw::UCP_FEATURE_RMA as u64);
    /// Active messages (not needed for plain RMA).
    pub const AM: Features = Features(raw::UCP_FEATURE_AM as u64);
    /// Event-fd based wakeup: required for [`crate::Worker::event_fd`] and
    /// [`crate::Worker::arm`].
    pub const WAKEUP: Features = Features(raw::UCP_FEATURE_WAKEUP as u64);
    /// `UCP_FEATURE_EXPORTED_MEMH`: [`crate::MemHandle::import`] of a peer's exported memory
    /// handle. Empty (no bit) when built without the export API.
    #[cfg(ucx_export)]
    pub const EXPORTED_MEMH: Features = Features(raw::UCP_FEATURE_EXPORTED_MEMH as u64);
    /// `UCP_FEATURE_EXPORTED_MEMH`: [`crate::MemHandle::import`] of a peer's exported memory
    /// handle. Empty (no bit) when built without the export API.
    #[cfg(not(ucx_export))]
    pub const EXPORTED_MEMH: Features = Features(0);

    /// True if every bit of `other` is set in `self`.
    pub fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for Features {
    type Output = Features;
    fn bitor(self, rhs: Features) -> Features {
        Features(self.0 | rhs.0)
    }
}

/// An initialised UCP context (`ucp_context_h`). Destroyed with
/// `ucp_cleanup` when the last `Rc` goes away; workers and memory handles
/// hold such an `Rc`.
pub struct Context {
    handle: raw::ucp_context_h,
    features: Features,
}

/// Owns a `ucp_config_t` until dropped.
struct Config(*mut raw::ucp_config_t);

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: self.0 came from a successful ucp_config_read and is
        // released exactly once, here.
        unsafe { raw::ucp_config_release(self.0) };
    }
}

impl Context {
    /// Creates a context with the given features, configured from the
    /// environment.
    pub fn new(features: Features) -> Result<Rc<Context>> {
        Self::with_config(features, &[])
    }

    /// Like [`Context::new`], then overrides configuration keys (without the
    /// `UCX_` prefix) before initialising.
    pub fn with_config(features: Features, overrides: &[(&str, &str)]) -> Result<Rc<Context>> {
        let mut cfg_ptr: *mut raw::ucp_config_t = ptr::null_mut();
        // SAFETY: NULL prefix and file name are documented as "use defaults";
        // cfg_ptr is a valid out-pointer.
        let st = unsafe { raw::ucp_config_read(ptr::null(), ptr::null(), &mut cfg_ptr) };
        Status(st).check("ucp_config_read")?;
        let config = Config(cfg_ptr);

        for (k, v) in overrides {
            let bad = Error::new("ucp_config_modify", Status::ERR_INVALID_PARAM);
            let k = CString::new(*k).map_err(|_| bad)?;
            let v = CString::new(*v).map_err(|_| bad)?;
            // SAFETY: config.0 is a live config; k and v are NUL-terminated
            // and outlive the call (UCX copies the value).
            let st = unsafe { raw::ucp_config_modify(config.0, k.as_ptr(), v.as_ptr()) };
            Status(st).check("ucp_config_modify")?;
        }

        let params = raw::ucp_params_t {
            field_mask: raw::UCP_PARAM_FIELD_FEATURES as u64,
            features: features.0,
            ..Default::default()
        };
        let mut handle: raw::ucp_context_h = ptr::null_mut();
        // SAFETY: ucp_init is a static inline wrapper around this call with
        // the header's API version; params and config are valid for the call
        // and handle is a valid out-pointer.
        let st = unsafe {
            raw::ucp_init_version(
                raw::UCP_API_MAJOR,
                raw::UCP_API_MINOR,
                &params,
                config.0,
                &mut handle,
            )
        };
        Status(st).check("ucp_init")?;
        drop(config);
        Ok(Rc::new(Context { handle, features }))
    }

    /// The raw handle, for calls this wrapper does not cover. Valid while
    /// `self` is alive.
    pub fn as_raw(&self) -> raw::ucp_context_h {
        self.handle
    }

    /// The features this context was created with.
    pub fn features(&self) -> Features {
        self.features
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: handle came from a successful ucp_init and every child
        // (worker, memory handle) holds an Rc to this context, so none is
        // left when this runs.
        unsafe { raw::ucp_cleanup(self.handle) };
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("handle", &self.handle)
            .field("features", &self.features)
            .finish()
    }
}
