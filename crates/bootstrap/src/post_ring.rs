//! The post ring: a single-producer, single-consumer ring in memory a rank and its SP share
//! (a sealed memfd the rank creates and passes on its Unix connection), so that a post reaches
//! a polling SP without a `send`, a wake-up or a `recv`.
//!
//! Layout (all little-endian, offsets in bytes):
//! - `0`: `tail`, `u64`, written by the rank only: entries written so far.
//! - `64`: `head`, `u64`, written by the SP only: entries consumed so far (the rank reads it to
//!   know the free room; the SP never reads it back and keeps its own count).
//! - [`HEADER_BYTES`] + `i * entry_bytes`: entry `i mod slots`: at `0` a `u64`, the number of
//!   socket frames the rank had sent after its `Register` when it wrote the entry
//!   (`sock_seq`); at `8` a `u32`, the payload's length; at [`ENTRY_HEADER_BYTES`], the
//!   payload: one encoded [`crate::wire::HostToSp`], which must be a `Post`.
//! - [`RingShape::mailbox_offset`]: the rank's completion mailbox (`crate::mailbox`),
//!   `mailbox_slots` slots, when the rank put it in the same memory: an SP that maps the ring
//!   then writes completions with plain stores (status and stamps, then the token with a
//!   release store) instead of a `process_vm_writev`.
//! - [`RingShape::arena_offset`] (the next page): the rank's **arena**, `arena_chunks`
//!   chunks of [`ARENA_CHUNK_BYTES`], each a send half and a receive half of
//!   [`ARENA_SIDE_BYTES`]. A rank whose collective is small and served by this SP alone
//!   copies its send side into a chunk's first half, grants both halves (they are its own
//!   memory, at `rank_base` + offset in its address space) and copies its receive side out of
//!   the second half at completion; the SP, which maps the same pages, reaches those grants
//!   with plain loads and stores instead of a `process_vm_readv`/`writev` each. For a rank
//!   that tells the truth a grant wholly inside the arena names the same bytes either way; a
//!   rank that lies about `rank_base` only redirects its own grants into its own memfd.
//!
//! Order: the SP handles a host's messages in the order the rank sent them, over both paths.
//! An entry with `sock_seq = s` was written after the rank's `s`-th socket frame and before
//! its `s + 1`-th, so the SP takes it once it has handled `s` frames, and drains every entry it
//! may take before it handles the next frame.
//!
//! Trust: the memory is the rank's and it may write anything at any time. The consumer copies
//! an entry out before it looks at it, checks every length and counter against the layout,
//! and never trusts `head`: a `tail` behind its own count or more than `slots` ahead of it is
//! [`Next::Corrupt`] (the SP then closes the connection).

use std::sync::atomic::{AtomicU64, Ordering};

pub const HEADER_BYTES: usize = 128;
const TAIL_OFFSET: usize = 0;
const HEAD_OFFSET: usize = 64;
pub const ENTRY_HEADER_BYTES: usize = 16;

/// The rank's default ring: 128 entries of 1 KiB (a post of a communicator of up to a few
/// dozen ranks fits one; a larger one goes on the socket, in order).
pub const DEFAULT_SLOTS: u32 = 128;
pub const DEFAULT_ENTRY_BYTES: u32 = 1024;

/// Bounds the SP accepts: a ring's entries take at most 4 MiB (pages the SP faults in by
/// reading count against its own memory), its mailbox at most `mailbox::MAX_SLOTS` slots.
pub const MAX_SLOTS: u32 = 1024;
pub const MIN_ENTRY_BYTES: u32 = 256;
pub const MAX_ENTRY_BYTES: u32 = 4096;

/// The arena's geometry: a chunk per small collective outstanding, each side at most
/// [`ARENA_SIDE_BYTES`]; at most [`MAX_ARENA_CHUNKS`] chunks (512 KiB).
pub const ARENA_SIDE_BYTES: u64 = 4096;
pub const ARENA_CHUNK_BYTES: u64 = 2 * ARENA_SIDE_BYTES;
pub const MAX_ARENA_CHUNKS: u32 = 64;
/// The rank's default arena (the shim's free chunks fit one 64-bit word).
pub const DEFAULT_ARENA_CHUNKS: u32 = 32;

/// A ring's geometry, as the rank offers it in its `Register`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RingShape {
    pub slots: u32,
    pub entry_bytes: u32,
    /// Mailbox slots after the entries (0: the mailbox is elsewhere).
    pub mailbox_slots: u32,
    /// Arena chunks after the mailbox (0: no arena).
    pub arena_chunks: u32,
    /// Where the rank mapped the ring in its own address space (its arena grants are at
    /// `rank_base + arena_offset()` on); page-aligned when `arena_chunks > 0`.
    pub rank_base: u64,
}

impl Default for RingShape {
    fn default() -> Self {
        RingShape {
            slots: DEFAULT_SLOTS,
            entry_bytes: DEFAULT_ENTRY_BYTES,
            mailbox_slots: 0,
            arena_chunks: 0,
            rank_base: 0,
        }
    }
}

impl RingShape {
    /// Bytes of the whole ring, its mailbox and arena included.
    pub fn bytes(&self) -> usize {
        if self.arena_chunks == 0 {
            return self.mailbox_end();
        }
        self.arena_offset() + self.arena_bytes() as usize
    }

    fn mailbox_end(&self) -> usize {
        self.mailbox_offset() + self.mailbox_slots as usize * crate::mailbox::SLOT_BYTES as usize
    }

    /// Where the arena starts: the page after the mailbox.
    pub fn arena_offset(&self) -> usize {
        self.mailbox_end().div_ceil(4096) * 4096
    }

    /// Bytes of the arena.
    pub fn arena_bytes(&self) -> u64 {
        self.arena_chunks as u64 * ARENA_CHUNK_BYTES
    }

    /// The offset into the ring of `[addr, addr + len)` in the rank's address space, if that
    /// range lies wholly inside the arena (an empty range never does).
    pub fn arena_at(&self, addr: u64, len: u64) -> Option<usize> {
        let start = self.rank_base.checked_add(self.arena_offset() as u64)?;
        let end = start.checked_add(self.arena_bytes())?;
        let last = addr.checked_add(len)?;
        (len > 0 && addr >= start && last <= end).then(|| (addr - self.rank_base) as usize)
    }

    /// Where the mailbox starts (a multiple of 64: the header and the entries are).
    pub fn mailbox_offset(&self) -> usize {
        HEADER_BYTES + self.slots as usize * self.entry_bytes as usize
    }

    /// The largest payload an entry holds.
    pub fn payload_max(&self) -> usize {
        self.entry_bytes as usize - ENTRY_HEADER_BYTES
    }

    /// Whether the SP takes this shape (bounded, entries whole cache lines).
    pub fn check(&self) -> Result<(), String> {
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return Err(format!(
                "a post ring of {} slots (1..={MAX_SLOTS} accepted)",
                self.slots
            ));
        }
        if !(MIN_ENTRY_BYTES..=MAX_ENTRY_BYTES).contains(&self.entry_bytes)
            || !self.entry_bytes.is_multiple_of(64)
        {
            return Err(format!(
                "post ring entries of {} bytes ({MIN_ENTRY_BYTES}..={MAX_ENTRY_BYTES}, a \
                 multiple of 64, accepted)",
                self.entry_bytes
            ));
        }
        if self.mailbox_slots > crate::mailbox::MAX_SLOTS {
            return Err(format!(
                "a mailbox of {} slots in the post ring (at most {})",
                self.mailbox_slots,
                crate::mailbox::MAX_SLOTS
            ));
        }
        if self.arena_chunks > MAX_ARENA_CHUNKS {
            return Err(format!(
                "an arena of {} chunks in the post ring (at most {MAX_ARENA_CHUNKS})",
                self.arena_chunks
            ));
        }
        if self.arena_chunks > 0 && !self.rank_base.is_multiple_of(4096) {
            return Err(format!(
                "a post ring said to be mapped at {:#x}, not a page boundary",
                self.rank_base
            ));
        }
        Ok(())
    }
}

/// A ring mapped at `base`: the two ends share this code.
struct Ring {
    base: *mut u8,
    shape: RingShape,
}

impl Ring {
    fn counter(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: `base` is 64-byte aligned (a page, see the constructors' contracts), the
        // offsets are within the header, and an AtomicU64 may alias memory another process
        // writes.
        unsafe { &*(self.base.add(offset) as *const AtomicU64) }
    }

    fn entry(&self, n: u64) -> *mut u8 {
        let i = (n % self.shape.slots as u64) as usize;
        // SAFETY: within the mapping: HEADER_BYTES + i * entry_bytes + entry_bytes <= bytes().
        unsafe {
            self.base
                .add(HEADER_BYTES + i * self.shape.entry_bytes as usize)
        }
    }
}

/// The rank's end.
pub struct Producer {
    ring: Ring,
    tail: u64,
    /// The consumer's `head` when last read: the ring has at least `slots - (tail - head)`
    /// free entries, so `head` (a line the SP's core writes) is read again only when that
    /// says full, not on every push.
    head: u64,
}

// SAFETY: the producer owns its end; the mapping outlives it (constructor contract).
unsafe impl Send for Producer {}

impl Producer {
    /// # Safety
    /// `base` is page-aligned, maps `shape.bytes()` bytes read-write, zeroed, and stays mapped
    /// for the producer's life; no other producer writes to it.
    pub unsafe fn new(base: *mut u8, shape: RingShape) -> Producer {
        Producer {
            ring: Ring { base, shape },
            tail: 0,
            head: 0,
        }
    }

    /// Writes `payload` as the next entry, taken after `sock_seq` socket frames. `false`: it
    /// does not fit an entry or the ring is full (the caller sends it on the socket).
    pub fn push(&mut self, sock_seq: u64, payload: &[u8]) -> bool {
        if payload.len() > self.ring.shape.payload_max() {
            return false;
        }
        let slots = self.ring.shape.slots as u64;
        if self.tail.wrapping_sub(self.head) >= slots {
            self.head = self.ring.counter(HEAD_OFFSET).load(Ordering::Acquire);
            // A head the rank's own memory says is past the tail (only a corrupt ring) is
            // taken as no room.
            if self.tail.wrapping_sub(self.head) >= slots {
                return false;
            }
        }
        let e = self.ring.entry(self.tail);
        // SAFETY: the entry is within the mapping and the consumer does not read it until the
        // tail below says it is written.
        unsafe {
            (e as *mut [u8; 8]).write_unaligned(sock_seq.to_le_bytes());
            (e.add(8) as *mut [u8; 4]).write_unaligned((payload.len() as u32).to_le_bytes());
            std::ptr::copy_nonoverlapping(
                payload.as_ptr(),
                e.add(ENTRY_HEADER_BYTES),
                payload.len(),
            );
        }
        self.tail += 1;
        self.ring
            .counter(TAIL_OFFSET)
            .store(self.tail, Ordering::Release);
        true
    }

    /// Entries written and not yet consumed.
    pub fn pending(&self) -> u64 {
        self.tail
            .wrapping_sub(self.ring.counter(HEAD_OFFSET).load(Ordering::Acquire))
    }
}

/// What the consumer found.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    Empty,
    /// The next entry follows socket frames not yet handled: handle those first.
    AfterFrames(u64),
    Entry(Vec<u8>),
    Corrupt(String),
}

/// The SP's end.
pub struct Consumer {
    ring: Ring,
    head: u64,
    /// The buffer the next entry is copied into (given back with [`Consumer::give_back`]).
    spare: Vec<u8>,
}

// SAFETY: as for the producer.
unsafe impl Send for Consumer {}

impl Consumer {
    /// # Safety
    /// `base` is page-aligned and maps `shape.bytes()` bytes read-write for the consumer's
    /// life (what the producer writes there is not trusted).
    pub unsafe fn new(base: *mut u8, shape: RingShape) -> Consumer {
        Consumer {
            ring: Ring { base, shape },
            head: 0,
            spare: Vec::new(),
        }
    }

    /// The next entry if the SP may take it after `frames_handled` socket frames of the rank
    /// (see the module documentation), copied out and consumed.
    pub fn next(&mut self, frames_handled: u64) -> Next {
        let tail = self.ring.counter(TAIL_OFFSET).load(Ordering::Acquire);
        if tail == self.head {
            return Next::Empty;
        }
        let ahead = tail.wrapping_sub(self.head);
        if ahead > self.ring.shape.slots as u64 {
            return Next::Corrupt(format!(
                "the post ring's tail {tail} is not within {} entries after the {} consumed",
                self.ring.shape.slots, self.head
            ));
        }
        let e = self.ring.entry(self.head);
        let mut hdr = [0u8; ENTRY_HEADER_BYTES];
        // SAFETY: the entry header is within the mapping; its bytes may change under us,
        // and every value is checked after this copy.
        unsafe { std::ptr::copy_nonoverlapping(e, hdr.as_mut_ptr(), ENTRY_HEADER_BYTES) };
        let sock_seq = u64::from_le_bytes(hdr[..8].try_into().unwrap());
        let len = u32::from_le_bytes(hdr[8..12].try_into().unwrap()) as usize;
        if sock_seq > frames_handled {
            return Next::AfterFrames(sock_seq);
        }
        if len > self.ring.shape.payload_max() {
            return Next::Corrupt(format!(
                "a post ring entry of {len} bytes (at most {})",
                self.ring.shape.payload_max()
            ));
        }
        let mut payload = std::mem::take(&mut self.spare);
        payload.clear();
        payload.resize(len, 0);
        // SAFETY: `len` is within the entry, checked above.
        unsafe {
            std::ptr::copy_nonoverlapping(e.add(ENTRY_HEADER_BYTES), payload.as_mut_ptr(), len)
        };
        self.head += 1;
        self.ring
            .counter(HEAD_OFFSET)
            .store(self.head, Ordering::Release);
        Next::Entry(payload)
    }

    /// Gives an entry's buffer back for the next entry to be copied into (no allocation per
    /// post once the buffer has grown to the entries' length).
    pub fn give_back(&mut self, buf: Vec<u8>) {
        if buf.capacity() <= self.ring.shape.entry_bytes as usize {
            self.spare = buf;
        }
    }

    /// Entries consumed.
    pub fn consumed(&self) -> u64 {
        self.head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page-aligned, zeroed buffer standing in for the shared mapping.
    struct Buf(Vec<u64>, usize);

    impl Buf {
        fn new(shape: RingShape) -> Buf {
            let words = shape.bytes().div_ceil(8) + 512;
            let v = vec![0u64; words];
            let off = (4096 - (v.as_ptr() as usize % 4096)) % 4096;
            Buf(v, off)
        }
        fn base(&mut self) -> *mut u8 {
            // SAFETY: `off` < 4096 bytes, within the 512 spare words.
            unsafe { (self.0.as_mut_ptr() as *mut u8).add(self.1) }
        }
        /// A producer and a consumer of a ring of `shape` in this buffer (which the caller
        /// keeps while they are used).
        fn ends(&mut self, shape: RingShape) -> (Producer, Consumer) {
            // SAFETY: the buffer is aligned, zeroed and large enough for `shape`, and its
            // memory outlives both ends in every test.
            unsafe {
                (
                    Producer::new(self.base(), shape),
                    Consumer::new(self.base(), shape),
                )
            }
        }
    }

    fn lcg(x: &mut u64) -> u64 {
        *x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *x >> 33
    }

    #[test]
    fn entries_come_out_in_order_and_only_after_their_socket_frames() {
        let seed = 0x5eed_u64;
        println!("seed {seed}");
        let mut r = seed;
        for _ in 0..20 {
            let shape = RingShape {
                slots: 1 + (lcg(&mut r) % 8) as u32,
                entry_bytes: 256 + 64 * (lcg(&mut r) % 4) as u32,
                mailbox_slots: (lcg(&mut r) % 3) as u32,
                ..RingShape::default()
            };
            shape.check().unwrap();
            let mut buf = Buf::new(shape);
            let (mut p, mut c) = buf.ends(shape);
            let (mut sent, mut got, mut frames) = (Vec::new(), Vec::new(), 0u64);
            for step in 0..400u64 {
                match lcg(&mut r) % 3 {
                    0 => {
                        let len = (lcg(&mut r) % (shape.payload_max() as u64 + 40)) as usize;
                        let payload: Vec<u8> = (0..len).map(|i| (i as u64 ^ step) as u8).collect();
                        let room = p.pending() < shape.slots as u64;
                        let fits = len <= shape.payload_max();
                        assert_eq!(p.push(frames, &payload), room && fits, "step {step}");
                        if room && fits {
                            sent.push((frames, payload));
                        }
                    }
                    1 => frames += 1,
                    _ => loop {
                        // The consumer has handled every frame sent so far.
                        match c.next(frames) {
                            Next::Entry(e) => got.push(e),
                            Next::Empty => break,
                            other => panic!("step {step}: {other:?}"),
                        }
                    },
                }
            }
            while let Next::Entry(e) = c.next(frames) {
                got.push(e);
            }
            let want: Vec<Vec<u8>> = sent.iter().map(|(_, p)| p.clone()).collect();
            assert_eq!(got, want);
            assert_eq!(c.consumed(), sent.len() as u64);
        }
    }

    /// An entry's buffer given back is the one the next entry is copied into, holding exactly
    /// that entry (a longer entry before it leaves nothing behind).
    #[test]
    fn a_buffer_given_back_carries_the_next_entry() {
        let shape = RingShape::default();
        let mut buf = Buf::new(shape);
        let (mut p, mut c) = buf.ends(shape);
        assert!(p.push(0, b"a longer entry"));
        assert!(p.push(0, b"b"));
        let Next::Entry(first) = c.next(0) else {
            panic!("no entry")
        };
        assert_eq!(first, b"a longer entry");
        let at = first.as_ptr();
        c.give_back(first);
        let Next::Entry(second) = c.next(0) else {
            panic!("no entry")
        };
        assert_eq!(second, b"b");
        assert_eq!(second.as_ptr(), at);
    }

    #[test]
    fn an_entry_waits_for_the_socket_frames_sent_before_it() {
        let shape = RingShape::default();
        let mut buf = Buf::new(shape);
        let (mut p, mut c) = buf.ends(shape);
        assert!(p.push(0, b"a"));
        assert!(p.push(2, b"b"));
        assert_eq!(c.next(0), Next::Entry(b"a".to_vec()));
        assert_eq!(c.next(1), Next::AfterFrames(2));
        assert_eq!(c.next(2), Next::Entry(b"b".to_vec()));
        assert_eq!(c.next(2), Next::Empty);
    }

    #[test]
    fn a_tail_or_length_the_layout_cannot_hold_is_corrupt() {
        let shape = RingShape {
            slots: 4,
            entry_bytes: 256,
            ..RingShape::default()
        };
        for (tail, len) in [(5u64, 1u32), (u64::MAX, 1), (1, 241), (1, u32::MAX)] {
            let mut buf = Buf::new(shape);
            let base = buf.base();
            // SAFETY: as above.
            let mut c = unsafe { Consumer::new(base, shape) };
            // SAFETY: writes within the header and the first entry of the buffer.
            unsafe {
                (base as *mut u64).write(tail);
                (base.add(HEADER_BYTES + 8) as *mut u32).write(len);
            }
            assert!(
                matches!(c.next(0), Next::Corrupt(_)),
                "tail {tail}, len {len}"
            );
            assert_eq!(c.consumed(), 0);
        }
        // A length that fits is taken.
        let mut buf = Buf::new(shape);
        let base = buf.base();
        // SAFETY: as above.
        let mut c = unsafe { Consumer::new(base, shape) };
        unsafe {
            (base as *mut u64).write(1);
            (base.add(HEADER_BYTES + 8) as *mut u32).write(240);
        }
        assert_eq!(c.next(0), Next::Entry(vec![0; 240]));
    }

    #[test]
    fn shapes_out_of_bounds_are_refused() {
        assert!(RingShape::default().check().is_ok());
        for (slots, entry_bytes, mailbox_slots) in [
            (0, 1024, 0),
            (MAX_SLOTS + 1, 1024, 0),
            (8, 128, 0),
            (8, 1000, 0),
            (8, MAX_ENTRY_BYTES + 64, 0),
            (8, 1024, crate::mailbox::MAX_SLOTS + 1),
        ] {
            let shape = RingShape {
                slots,
                entry_bytes,
                mailbox_slots,
                ..RingShape::default()
            };
            assert!(shape.check().is_err(), "{shape:?}");
        }
        let shape = RingShape {
            mailbox_slots: 3,
            ..RingShape::default()
        };
        assert!(shape.check().is_ok());
        assert_eq!(shape.bytes(), shape.mailbox_offset() + 3 * 64);
        assert_eq!(shape.mailbox_offset() % 64, 0);
    }

    #[test]
    fn the_arena_follows_the_mailbox_on_a_page_and_only_whole_ranges_inside_it_are_its() {
        let shape = RingShape {
            mailbox_slots: 3,
            arena_chunks: 2,
            rank_base: 0x7000_0000,
            ..RingShape::default()
        };
        shape.check().unwrap();
        let mailbox_end = shape.mailbox_offset() + 3 * crate::mailbox::SLOT_BYTES as usize;
        let at = shape.arena_offset();
        assert!(at >= mailbox_end && at.is_multiple_of(4096) && at - mailbox_end < 4096);
        assert_eq!(shape.bytes(), at + 2 * ARENA_CHUNK_BYTES as usize);
        let start = 0x7000_0000 + at as u64;
        let end = start + 2 * ARENA_CHUNK_BYTES;
        assert_eq!(shape.arena_at(start, 1), Some(at));
        assert_eq!(
            shape.arena_at(end - 8, 8),
            Some(at + 2 * ARENA_CHUNK_BYTES as usize - 8)
        );
        for (addr, len) in [
            (start - 1, 2),
            (end - 8, 9),
            (start, 0),
            (end, 1),
            (0, 8),
            (u64::MAX - 3, 8),
        ] {
            assert_eq!(shape.arena_at(addr, len), None, "{addr:#x}+{len}");
        }
        // No arena: nothing is in it, and the ring ends with its mailbox.
        let none = RingShape {
            arena_chunks: 0,
            ..shape
        };
        assert_eq!(none.bytes(), mailbox_end);
        assert_eq!(none.arena_at(start, 1), None);
        // Bounds.
        assert!(RingShape {
            arena_chunks: MAX_ARENA_CHUNKS + 1,
            ..shape
        }
        .check()
        .is_err());
        assert!(RingShape {
            rank_base: 0x7000_0010,
            ..shape
        }
        .check()
        .is_err());
    }
}
