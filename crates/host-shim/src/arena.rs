//! The arena of the post ring (`bootstrap::post_ring`): chunks of memory this rank shares with
//! its SP, for the small collectives that its SP serves alone. Such a call copies its send
//! side into a chunk and grants the chunk's halves instead of the program's buffers; the SP,
//! which maps the same pages, moves the bytes with plain copies (no `process_vm_readv` or
//! `writev` per block), and the rank copies the received blocks out of the chunk when the call
//! completes, before the request is reported complete (`request.rs`).
//!
//! Only where the SP takes sides from the arena (it says so at registration, `arena_off`) and
//! this rank grants through `cma`, for sides of at most `ARENA_SIDE_BYTES`, and in kinds
//! whose SP-side copies are plain copies between its ranks (see `post.rs`). `SPOFF_ARENA=0`
//! (or `off`) turns it off. A chunk is taken per call and given back when the request
//! completes, also when the SP completed it with an error; a request the shim fails itself
//! (a broken or silent connection, a refusal) keeps its chunk for good (the SP may still be
//! using it), and a call that finds none free goes the usual way.

use bootstrap::post_ring::{ARENA_CHUNK_BYTES, ARENA_SIDE_BYTES};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// The arena's first byte in this process (0: no arena).
static BASE: AtomicUsize = AtomicUsize::new(0);
/// Free chunks, a bit each.
static FREE: AtomicU64 = AtomicU64::new(0);

/// Whether the arena may be used (`SPOFF_ARENA`, on by default).
pub fn wanted() -> bool {
    !matches!(
        std::env::var("SPOFF_ARENA").ok().as_deref().map(str::trim),
        Some("0") | Some("off") | Some("no")
    )
}

/// Opens the arena of `chunks` chunks at `base` (mapped for the life of the process, shared
/// with an SP that reads the ring).
pub fn open(base: *mut u8, chunks: u32) {
    let chunks = chunks.min(64);
    BASE.store(base as usize, Ordering::Release);
    let all = if chunks == 64 {
        u64::MAX
    } else {
        (1u64 << chunks) - 1
    };
    FREE.store(all, Ordering::Release);
}

/// Whether sides of `send` and `recv` bytes fit a chunk.
pub fn fits(send: u64, recv: u64) -> bool {
    send <= ARENA_SIDE_BYTES && recv <= ARENA_SIDE_BYTES
}

/// One chunk, the caller's until dropped.
#[derive(Debug)]
pub struct Chunk {
    index: u32,
    base: usize,
}

impl Chunk {
    /// A free chunk, if the arena is open and has one.
    pub fn take() -> Option<Chunk> {
        let base = BASE.load(Ordering::Acquire);
        if base == 0 {
            return None;
        }
        let mut free = FREE.load(Ordering::Acquire);
        loop {
            if free == 0 {
                return None;
            }
            let index = free.trailing_zeros();
            match FREE.compare_exchange_weak(
                free,
                free & !(1 << index),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(Chunk { index, base }),
                Err(now) => free = now,
            }
        }
    }

    /// The send half.
    pub fn send(&self) -> *mut u8 {
        (self.base + self.index as usize * ARENA_CHUNK_BYTES as usize) as *mut u8
    }

    /// The receive half.
    pub fn recv(&self) -> *mut u8 {
        // SAFETY: both halves lie in the chunk.
        unsafe { self.send().add(ARENA_SIDE_BYTES as usize) }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        FREE.fetch_or(1 << self.index, Ordering::AcqRel);
    }
}

/// A call's use of a chunk: the chunk, and where its received blocks go at completion.
#[derive(Debug)]
pub struct InArena {
    pub chunk: Chunk,
    /// The receive side's region in the program's buffer (or the shim's unpack staging), and
    /// each peer's bytes in it as the SP writes them in the chunk: offset and length of each
    /// block that has bytes, one after the other (a pooled vector: `recycle.rs`).
    pub recv_to: usize,
    pub recv_blocks: crate::recycle::Recycled<u64>,
}

impl InArena {
    /// Copies the received blocks from the chunk to where they belong.
    ///
    /// # Safety
    /// The call completed (the SP wrote the chunk and stopped using it), and the receive
    /// region is the shim's to write until the request is reported complete.
    pub unsafe fn deliver(&self) {
        for block in self.recv_blocks.chunks_exact(2) {
            let (at, len) = (block[0], block[1]);
            // SAFETY: every block lies within the receive side (laid out by `layout.rs`,
            // at most `ARENA_SIDE_BYTES` in all, checked by `fits`), in the chunk's receive
            // half and in the program's region alike.
            unsafe {
                alias_mkey::copy::copy_bytes(
                    self.chunk.recv().add(at as usize),
                    (self.recv_to as *mut u8).add(at as usize),
                    len as usize,
                )
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{OffloadRequest, Staging};
    use bootstrap::wire::CollKind;
    use mpi_ffi::consts;

    fn request_with(chunk: Chunk) -> OffloadRequest {
        let staging = Staging {
            arena: Some(InArena {
                chunk,
                recv_to: 0,
                recv_blocks: Default::default(),
            }),
            ..Staging::default()
        };
        OffloadRequest::new(
            CollKind::Alltoallv,
            Some(0),
            1,
            algorithms::CommId { leader: 0, id: 1 },
            0,
            consts::COMM_WORLD(),
            staging,
        )
    }

    /// Chunks are taken until none is left and come back when dropped; a request failed by
    /// the shim itself keeps its chunk (the SP may still use it), one the SP completed with an
    /// error gives it back.
    #[test]
    fn chunks_come_back_except_from_a_request_the_shim_failed() {
        let mem: &'static mut [u64] = Box::leak(vec![0u64; 2 * 1024].into_boxed_slice());
        open(mem.as_mut_ptr().cast(), 2);
        let (a, b) = (Chunk::take().unwrap(), Chunk::take().unwrap());
        assert_ne!(a.send(), b.send());
        assert_eq!(
            a.recv() as usize - a.send() as usize,
            ARENA_SIDE_BYTES as usize
        );
        assert!(Chunk::take().is_none(), "two chunks only");
        drop(a);
        let a = Chunk::take().expect("a dropped chunk is free again");
        // Failed by the shim (a broken connection): kept for good.
        request_with(a).finish(consts::ERR_OTHER());
        assert!(Chunk::take().is_none(), "the failed request kept its chunk");
        // Failed by the SP's own completion: given back.
        request_with(b).finish_by_sp(consts::ERR_OTHER());
        assert!(
            Chunk::take().is_some(),
            "the SP's failure gives the chunk back"
        );
    }
}
