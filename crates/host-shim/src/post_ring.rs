//! The rank's end of its post ring (`bootstrap::post_ring`): a sealed memfd mapped here and
//! passed to the SP with the `Register` frame, so that a post to a polling SP is a copy into
//! shared memory instead of a `send` the SP must notice and `recv`.
//!
//! `SPOFF_POST_RING=0` (or `off`) keeps every post on the socket. The SP says at registration
//! whether it reads the ring (only a polling SP does, on the same kernel); otherwise the ring
//! is dropped and nothing changes.

use bootstrap::post_ring::{Producer, RingShape};
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use nix::sys::mman::{mmap, MapFlags, ProtFlags};
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

/// The ring: its descriptor (passed once, at registration) and the producer writing into the
/// mapping, which stays mapped for the life of the process (the SP's mapping is its own).
pub struct ShimRing {
    pub fd: OwnedFd,
    pub shape: RingShape,
    producer: Producer,
    base: *mut u8,
}

// SAFETY: the mapping is never unmapped; the producer is used under the shim's lock.
unsafe impl Send for ShimRing {}

/// Whether to offer a ring (`SPOFF_POST_RING`, on by default).
pub fn wanted() -> bool {
    !matches!(
        std::env::var("SPOFF_POST_RING")
            .ok()
            .as_deref()
            .map(str::trim),
        Some("0") | Some("off") | Some("no")
    )
}

impl ShimRing {
    /// Creates, sizes, maps and seals (against shrinking, growing and further seals) a ring of
    /// `shape`.
    pub fn create(shape: RingShape) -> Result<ShimRing, String> {
        shape.check()?;
        let fd = memfd_create(
            c"spoff-post-ring",
            MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
        )
        .map_err(|e| format!("memfd_create: {e}"))?;
        let len = shape.bytes();
        nix::unistd::ftruncate(&fd, len as i64).map_err(|e| format!("ftruncate: {e}"))?;
        let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
        fcntl(fd.as_raw_fd(), FcntlArg::F_ADD_SEALS(seals))
            .map_err(|e| format!("sealing the post ring: {e}"))?;
        // SAFETY: a new shared mapping of the whole (sealed) file; no existing memory is
        // affected.
        let base = unsafe {
            mmap(
                None,
                NonZeroUsize::new(len).expect("a ring has a header"),
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )
        }
        .map_err(|e| format!("mapping the post ring: {e}"))?;
        // The arena's grants are addresses of this mapping.
        let shape = RingShape {
            rank_base: base.as_ptr() as u64,
            ..shape
        };
        // SAFETY: page-aligned, `len` bytes, zero-filled (a new memfd), never unmapped; this
        // is the only producer.
        let producer = unsafe { Producer::new(base.as_ptr().cast(), shape) };
        Ok(ShimRing {
            fd,
            shape,
            producer,
            base: base.as_ptr().cast(),
        })
    }

    /// The mailbox inside the ring (`shape.mailbox_slots` slots, zeroed, mapped for good).
    pub fn mailbox(&self) -> *mut u8 {
        // SAFETY: the mailbox lies inside the mapping (`RingShape::bytes`).
        unsafe { self.base.add(self.shape.mailbox_offset()) }
    }

    /// The arena inside the ring (`shape.arena_chunks` chunks, mapped for good), if it has one.
    pub fn arena(&self) -> Option<*mut u8> {
        // SAFETY: the arena lies inside the mapping (`RingShape::bytes`).
        (self.shape.arena_chunks > 0).then(|| unsafe { self.base.add(self.shape.arena_offset()) })
    }

    /// Writes one encoded message; `false`: it goes on the socket (too large, ring full).
    pub fn push(&mut self, sock_frames: u64, payload: &[u8]) -> bool {
        self.producer.push(sock_frames, payload)
    }
}

/// Sends `frame` on the Unix socket `sock` with `fd` attached (`SCM_RIGHTS`), whole.
pub fn send_with_fd(sock: RawFd, frame: &[u8], fd: RawFd) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let fds = [fd];
    let mut sent = 0;
    while sent < frame.len() {
        let iov = [std::io::IoSlice::new(&frame[sent..])];
        // The descriptor goes with the first byte only.
        let cmsg = [ControlMessage::ScmRights(&fds)];
        let cmsgs: &[ControlMessage] = if sent == 0 { &cmsg } else { &[] };
        match sendmsg::<()>(sock, &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
