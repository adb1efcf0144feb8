//! UCX's memory hooks (libucm): being told when memory leaves the address space.
//!
//! A registration cache must forget a registration when the memory under it is unmapped
//! (`munmap`, `mremap`, `shmdt`, `brk`/`sbrk` shrinking, `madvise(MADV_DONTNEED)`), because
//! the same addresses may come back as different memory. libucm intercepts these calls
//! (by default by patching the C library's entry points, `UCX_MEM_MMAP_HOOK_MODE=bistro`)
//! and calls registered handlers with `UCM_EVENT_VM_UNMAPPED` **before** the memory goes away.
//!
//! [`VmUnmappedHook`] installs one such handler, a plain `fn(addr, len)`, and removes it when
//! dropped. The handler runs inside `munmap` (or `free`, or `brk`), on whatever thread did it,
//! possibly with the allocator's locks held: it must not allocate, free, lock anything the
//! allocator might hold, or panic (a panic aborts the process: it cannot unwind through C).
//! In practice: record the range in preallocated, lock-free storage and return.
//!
//! Whether events are delivered depends on the environment (`UCX_MEM_EVENTS=no` turns them
//! off, another library may have declared them external); [`VmUnmappedHook::delivered`] checks
//! with `ucm_test_events`.

use std::os::raw::{c_int, c_void};

use crate::raw;
use crate::status::{Result, Status};

/// A handler for unmapped memory: `(address, length)` of the range about to be unmapped.
pub type UnmapHandler = fn(u64, u64);

/// An installed `UCM_EVENT_VM_UNMAPPED` handler; removed (`ucm_unset_event_handler`) on drop.
#[derive(Debug)]
pub struct VmUnmappedHook {
    handler: UnmapHandler,
}

unsafe extern "C" fn trampoline(
    event_type: raw::ucm_event_type_t,
    event: *mut raw::ucm_event_t,
    arg: *mut c_void,
) {
    if event_type & raw::UCM_EVENT_VM_UNMAPPED == 0 || event.is_null() || arg.is_null() {
        return;
    }
    // SAFETY: `arg` is the `UnmapHandler` passed to `ucm_set_event_handler` in `install`
    // (a function pointer cast to a data pointer, which Linux ABIs allow), and `event` is the
    // live event of this VM_UNMAPPED call, whose `vm_unmapped` member is the active one.
    let (handler, addr, len) = unsafe {
        let handler: UnmapHandler = std::mem::transmute::<*mut c_void, UnmapHandler>(arg);
        let ev = &(*event).vm_unmapped;
        (handler, ev.address as u64, ev.size as u64)
    };
    handler(addr, len);
}

impl VmUnmappedHook {
    /// Installs `handler` for `UCM_EVENT_VM_UNMAPPED` at `priority` (lower runs first). This
    /// installs libucm's hooks in the process if nothing did before. See the module docs for
    /// what `handler` may do. Installing the same handler twice calls it twice.
    pub fn install(handler: UnmapHandler, priority: i32) -> Result<Self> {
        // SAFETY: the trampoline matches `ucm_event_callback_t`; its argument is a function
        // pointer that lives for the whole program.
        let status = unsafe {
            raw::ucm_set_event_handler(
                raw::UCM_EVENT_VM_UNMAPPED as c_int,
                priority as c_int,
                Some(trampoline),
                handler as *mut c_void,
            )
        };
        Status(status).check("ucm_set_event_handler")?;
        Ok(VmUnmappedHook { handler })
    }

    /// Whether libucm's hooks deliver `UCM_EVENT_VM_UNMAPPED` in this process
    /// (`ucm_test_events`, which unmaps a test page and watches for the event). It may call
    /// every installed handler with that test page's range.
    pub fn delivered() -> Result<()> {
        // SAFETY: plain call; ucm handles the test mapping itself.
        let status = unsafe { raw::ucm_test_events(raw::UCM_EVENT_VM_UNMAPPED as c_int) };
        Status(status).check("ucm_test_events")
    }
}

impl Drop for VmUnmappedHook {
    fn drop(&mut self) {
        // SAFETY: the same (callback, argument) pair that `install` registered.
        unsafe {
            raw::ucm_unset_event_handler(
                raw::UCM_EVENT_VM_UNMAPPED as c_int,
                Some(trampoline),
                self.handler as *mut c_void,
            )
        };
    }
}
