//! Memory registration (local side).
//!
//! The owner of a buffer maps it with [`MemHandle::map`] (an existing
//! buffer) or [`MemHandle::allocate`] (UCX allocates it), packs a remote key
//! with [`MemHandle::rkey_pack`], and sends those bytes plus the buffer's
//! address to the peer by any means. The peer turns the bytes into a
//! [`crate::RemoteKey`] for one of its endpoints (`endpoint.rs`, where keys
//! live with the endpoint they are unpacked on) and uses it for get/put.

use std::os::raw::c_void;
use std::ptr;
use std::rc::Rc;

use crate::context::Context;
use crate::raw;
use crate::status::{Error, Result, Status};

/// A registered memory region (`ucp_mem_h`). Unmapped on drop.
pub struct MemHandle {
    handle: raw::ucp_mem_h,
    address: *mut u8,
    len: usize,
    context: Rc<Context>,
}

impl MemHandle {
    /// Registers an existing buffer for remote access.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be a valid allocation that stays allocated (and is
    /// not unmapped or remapped) for as long as the returned handle lives,
    /// and for as long as any peer may still access it through a key packed
    /// from it. Remote peers can read and write it at any time without
    /// synchronising with this process' Rust code: do not hold Rust
    /// references to it while remote writes may happen.
    pub unsafe fn map(context: &Rc<Context>, ptr: *mut u8, len: usize) -> Result<MemHandle> {
        let params = raw::ucp_mem_map_params_t {
            field_mask: (raw::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | raw::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
                as u64,
            address: ptr as *mut c_void,
            length: len,
            ..Default::default()
        };
        // SAFETY: the caller guarantees the region is valid; the context is
        // alive; params is fully initialised.
        unsafe { Self::map_params(context, &params) }
    }

    /// Lets UCX allocate and register `len` bytes (possibly rounded up; see
    /// [`MemHandle::len`]). The memory is freed on drop;
    /// [`MemHandle::address`] gives its location.
    ///
    /// With UCX 1.13 this is the only kind of memory a peer can reach over
    /// shared memory without this process progressing its worker (see the
    /// crate docs).
    pub fn allocate(context: &Rc<Context>, len: usize) -> Result<MemHandle> {
        let params = raw::ucp_mem_map_params_t {
            field_mask: (raw::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | raw::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | raw::UCP_MEM_MAP_PARAM_FIELD_FLAGS) as u64,
            address: ptr::null_mut(),
            length: len,
            flags: raw::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        // SAFETY: with ALLOCATE and a NULL address UCX owns the memory; the
        // context is alive and params is fully initialised.
        unsafe { Self::map_params(context, &params) }
    }

    /// # Safety
    /// `params` must describe memory that is valid to register.
    unsafe fn map_params(
        context: &Rc<Context>,
        params: &raw::ucp_mem_map_params_t,
    ) -> Result<MemHandle> {
        let mut handle: raw::ucp_mem_h = ptr::null_mut();
        // SAFETY: forwarded from the caller; handle is a valid out-pointer.
        let st = unsafe { raw::ucp_mem_map(context.as_raw(), params, &mut handle) };
        Status(st).check("ucp_mem_map")?;
        let mut attr = raw::ucp_mem_attr_t {
            field_mask: (raw::UCP_MEM_ATTR_FIELD_ADDRESS | raw::UCP_MEM_ATTR_FIELD_LENGTH) as u64,
            ..Default::default()
        };
        // SAFETY: handle is the live registration just created; attr is a
        // valid out-struct with the fields we want selected.
        let st = unsafe { raw::ucp_mem_query(handle, &mut attr) };
        if let Err(e) = Status(st).check("ucp_mem_query") {
            // SAFETY: undo the registration created above, exactly once.
            unsafe { raw::ucp_mem_unmap(context.as_raw(), handle) };
            return Err(e);
        }
        Ok(MemHandle {
            handle,
            address: attr.address as *mut u8,
            len: attr.length,
            context: Rc::clone(context),
        })
    }

    /// Start of the registered region (as reported by `ucp_mem_query`).
    pub fn address(&self) -> *mut u8 {
        self.address
    }

    /// Length of the registered region in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The raw handle. Valid while `self` is alive.
    pub fn as_raw(&self) -> raw::ucp_mem_h {
        self.handle
    }

    /// Packs a remote key for this region (`ucp_rkey_pack`): opaque bytes
    /// for a peer's [`RemoteKey::unpack`].
    pub fn rkey_pack(&self) -> Result<Vec<u8>> {
        let mut buf: *mut c_void = ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: context and memh are alive; buf and size are valid
        // out-pointers.
        let st =
            unsafe { raw::ucp_rkey_pack(self.context.as_raw(), self.handle, &mut buf, &mut size) };
        Status(st).check("ucp_rkey_pack")?;
        // SAFETY: on success buf holds `size` bytes, copied and then released
        // exactly once.
        let v = unsafe {
            let v = std::slice::from_raw_parts(buf as *const u8, size).to_vec();
            raw::ucp_rkey_buffer_release(buf);
            v
        };
        Ok(v)
    }
}

/// What [`MemHandle::export_pack`] and [`MemHandle::import`] report when the crate was built
/// without the export API (UCX < 1.15).
#[cfg(not(ucx_export))]
fn no_export_api() -> Error {
    Error::new(
        "ucp_memh_pack/import (ucx-sys built against UCX < 1.15: no export API)",
        Status::ERR_UNSUPPORTED,
    )
}

impl MemHandle {
    /// Packs this registration as an exported memory handle (`ucp_memh_pack` with
    /// `UCP_MEMH_PACK_FLAG_EXPORT`): opaque bytes for a peer's [`MemHandle::import`] on the
    /// same physical device (a BlueField SP aliasing host memory: cross-GVMI). The context
    /// needs no extra feature on this side.
    ///
    /// `UCS_ERR_UNSUPPORTED` where no memory domain of the context can export (everything
    /// but mlx5 devices), and always when built without the export API ([`crate::EXPORT_API`]).
    pub fn export_pack(&self) -> Result<Vec<u8>> {
        #[cfg(ucx_export)]
        {
            let params = raw::ucp_memh_pack_params_t {
                field_mask: raw::UCP_MEMH_PACK_PARAM_FIELD_FLAGS as u64,
                flags: raw::UCP_MEMH_PACK_FLAG_EXPORT as u64,
            };
            let mut buf: *mut c_void = ptr::null_mut();
            let mut size: usize = 0;
            // SAFETY: memh is alive; params is fully initialised; buf and size are valid
            // out-pointers.
            let st = unsafe { raw::ucp_memh_pack(self.handle, &params, &mut buf, &mut size) };
            Status(st).check("ucp_memh_pack")?;
            let release = raw::ucp_memh_buffer_release_params_t { field_mask: 0 };
            // SAFETY: on success buf holds `size` bytes, copied and then released exactly once.
            let v = unsafe {
                let v = std::slice::from_raw_parts(buf as *const u8, size).to_vec();
                raw::ucp_memh_buffer_release(buf, &release);
                v
            };
            Ok(v)
        }
        #[cfg(not(ucx_export))]
        {
            Err(no_export_api())
        }
    }

    /// Maps a peer's exported memory handle (`ucp_mem_map` with
    /// `UCP_MEM_MAP_PARAM_FIELD_EXPORTED_MEMH_BUFFER`): the result is an alias of the peer's
    /// memory, usable as the *local* memory handle of operations
    /// ([`crate::Endpoint::get_nbx_memh`], [`crate::Endpoint::put_nbx_memh`]) whose local
    /// address is the peer's. [`MemHandle::address`] and [`MemHandle::len`] are the peer's
    /// region. The context must have [`crate::Features::EXPORTED_MEMH`].
    ///
    /// # Safety
    /// `exported` must be exactly the bytes a peer's [`MemHandle::export_pack`] produced with a
    /// compatible UCX: `ucp_mem_map` takes no length and trusts the sizes and bit maps in the
    /// buffer (arbitrary bytes make UCX 1.22 read and write out of bounds). Callers check the
    /// framing first and pass a zero-padded copy.
    pub unsafe fn import(context: &Rc<Context>, exported: &[u8]) -> Result<MemHandle> {
        #[cfg(ucx_export)]
        {
            let params = raw::ucp_mem_map_params_t {
                field_mask: raw::UCP_MEM_MAP_PARAM_FIELD_EXPORTED_MEMH_BUFFER as u64,
                exported_memh_buffer: exported.as_ptr() as *const c_void,
                ..Default::default()
            };
            // SAFETY: the caller vouches for the buffer; the context is alive.
            unsafe { Self::map_params(context, &params) }
        }
        #[cfg(not(ucx_export))]
        {
            let _ = (context, exported);
            Err(no_export_api())
        }
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        // SAFETY: the registration is live and unmapped exactly once; the
        // context is kept alive by our Rc.
        let st = unsafe { raw::ucp_mem_unmap(self.context.as_raw(), self.handle) };
        debug_assert!(Status(st).is_ok(), "ucp_mem_unmap: {}", Status(st));
    }
}

impl std::fmt::Debug for MemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemHandle")
            .field("handle", &self.handle)
            .field("address", &self.address)
            .field("len", &self.len)
            .finish()
    }
}
