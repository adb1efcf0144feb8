//! The SP's end of a host's post ring (`bootstrap::post_ring`): the descriptor the rank
//! passed with its `Register`, checked and mapped.
//!
//! The descriptor is the rank's own: passed over its socket (`SCM_RIGHTS`), it carries the
//! access the rank opened it with, so the SP never reaches memory on the rank's behalf that
//! the rank could not reach itself (a read-only or non-shared file fails the mapping). What
//! the SP requires before mapping it:
//! - a file that takes seals, on tmpfs (a plain memfd; not hugetlbfs, whose pages can be
//!   taken back from under a mapping), sealed against shrinking: truncated under the SP's
//!   mapping it would fault (`SIGBUS`) in the SP's loop;
//! - exactly the size of the shape the rank offered, itself within `RingShape::check`.
//!
//! Everything in the mapping is the rank's to change at any time; `Consumer` copies and
//! checks what it reads. When the rank's completion mailbox is in the ring (its shape says
//! so and the slot counts agree), the SP writes completions there with plain stores; it never
//! reads them back.
//!
//! The rank's arena (`bootstrap::post_ring`, after the mailbox): a grant wholly inside it is
//! reached through this mapping ([`PostRing::arena_addr`]); the mapping is shared
//! ([`ArenaMap`]) with the instances whose keys point into it, so it outlives the connection
//! until the last of them goes.

use bootstrap::mailbox;
use bootstrap::post_ring::{Consumer, Next, RingShape};
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The SP's mapping of a ring, unmapped when the last holder lets go (the connection's
/// [`PostRing`], and every instance with a key into its arena).
#[derive(Debug)]
pub struct ArenaMap {
    base: NonNull<std::ffi::c_void>,
    len: usize,
}

// SAFETY: the mapping is owned by this value alone and unmapped once, in `drop`; the bytes in
// it are the rank's, read and written only through raw pointers.
unsafe impl Send for ArenaMap {}
unsafe impl Sync for ArenaMap {}

impl Drop for ArenaMap {
    fn drop(&mut self) {
        // SAFETY: mapped in `PostRing::map` with this length, unmapped only here.
        let _ = unsafe { munmap(self.base, self.len) };
    }
}

/// A host's post ring, mapped for the connection's life (and beyond, while its arena is used).
pub struct PostRing {
    map: Arc<ArenaMap>,
    base: NonNull<std::ffi::c_void>,
    shape: RingShape,
    consumer: Consumer,
}

// SAFETY: the mapping is kept by `map`; the consumer points into it.
unsafe impl Send for PostRing {}

impl PostRing {
    /// Checks `fd` as the ring of `shape` and maps it. Errors say why, for the host.
    pub fn map(fd: &OwnedFd, shape: RingShape) -> Result<PostRing, String> {
        shape.check()?;
        let seals = fcntl(fd.as_raw_fd(), FcntlArg::F_GET_SEALS)
            .map_err(|e| format!("the post ring's descriptor takes no seals (not a memfd): {e}"))?;
        let seals = SealFlag::from_bits_truncate(seals);
        if !seals.contains(SealFlag::F_SEAL_SHRINK) {
            return Err("the post ring's memfd is not sealed against shrinking".into());
        }
        // Only tmpfs (a plain memfd): a hugetlbfs file takes seals too, but a page of it can
        // be punched out and its pool emptied, and a read of the mapping then faults.
        let fs =
            nix::sys::statfs::fstatfs(fd).map_err(|e| format!("fstatfs of the post ring: {e}"))?;
        if fs.filesystem_type() != nix::sys::statfs::TMPFS_MAGIC {
            return Err(format!(
                "the post ring is not a plain memfd (filesystem type {:#x}, not tmpfs)",
                fs.filesystem_type().0
            ));
        }
        let st = nix::sys::stat::fstat(fd.as_raw_fd())
            .map_err(|e| format!("fstat of the post ring: {e}"))?;
        let len = shape.bytes();
        if st.st_size as u64 != len as u64 {
            return Err(format!(
                "the post ring's memfd holds {} bytes, not the {len} of {} slots of {} bytes",
                st.st_size, shape.slots, shape.entry_bytes
            ));
        }
        let nz = NonZeroUsize::new(len).expect("a ring has a header");
        // SAFETY: a new shared mapping of a file sealed against shrinking, of exactly its
        // size: no existing memory is affected and no access can fault.
        let base = unsafe {
            mmap(
                None,
                nz,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd,
                0,
            )
        }
        .map_err(|e| format!("cannot map the post ring: {e}"))?;
        // SAFETY: page-aligned (mmap), `len` = shape.bytes() bytes, mapped while the `ArenaMap`
        // made of it below lives, which the consumer's `PostRing` holds.
        let consumer = unsafe { Consumer::new(base.as_ptr().cast(), shape) };
        Ok(PostRing {
            map: Arc::new(ArenaMap { base, len }),
            base,
            shape,
            consumer,
        })
    }

    /// Where `[addr, addr + len)` of the rank's address space is in this SP's mapping, if it
    /// lies wholly inside the rank's arena; with the mapping, to keep while a key uses it.
    pub fn arena_addr(&self, addr: u64, len: u64) -> Option<(u64, Arc<ArenaMap>)> {
        let at = self.shape.arena_at(addr, len)?;
        // `arena_at` keeps the range inside the arena, itself inside `shape.bytes()`, the
        // size of the mapping.
        debug_assert!(at as u64 + len <= self.map.len as u64);
        Some((self.base.as_ptr() as u64 + at as u64, self.map.clone()))
    }

    /// The next post the SP may take after `frames_handled` socket frames of the host.
    pub fn next(&mut self, frames_handled: u64) -> Next {
        self.consumer.next(frames_handled)
    }

    /// Gives a taken entry's buffer back (see `Consumer::give_back`).
    pub fn give_back(&mut self, buf: Vec<u8>) {
        self.consumer.give_back(buf)
    }

    /// Entries of the ring.
    pub fn slots(&self) -> u32 {
        self.shape.slots
    }

    /// Whether the host's mailbox of `slots` slots is in the ring.
    pub fn has_mailbox(&self, slots: u32) -> bool {
        slots > 0 && self.shape.mailbox_slots == slots
    }

    /// Writes a completion into mailbox slot `slot` in the ring (`bootstrap::mailbox`): `head`
    /// (status, copies, stamps) from [`mailbox::STATUS_OFFSET`], then the token with a
    /// release store, so a rank that sees the token sees the rest. `false`: no such slot.
    pub fn write_completion(&self, slot: u32, head: &[u8], token: u64) -> bool {
        if slot >= self.shape.mailbox_slots
            || mailbox::STATUS_OFFSET as usize + head.len() > mailbox::SLOT_BYTES as usize
        {
            return false;
        }
        let at = self.shape.mailbox_offset() + mailbox::slot_offset(slot) as usize;
        // SAFETY: the slot lies inside the mapping (checked against the shape, whose size the
        // file was checked to have), and `at` is 64-byte aligned, so the token word is 8-byte
        // aligned for the atomic; the rank may write the same bytes, which only it reads.
        unsafe {
            let p = (self.base.as_ptr() as *mut u8).add(at);
            std::ptr::copy_nonoverlapping(
                head.as_ptr(),
                p.add(mailbox::STATUS_OFFSET as usize),
                head.len(),
            );
            (*(p.add(mailbox::TOKEN_OFFSET as usize) as *const AtomicU64))
                .store(token, Ordering::Release);
        }
        true
    }
}
