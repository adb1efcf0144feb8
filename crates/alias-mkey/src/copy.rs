//! Copies that stay fast whatever the two addresses are, and the buffers they bounce through.
//!
//! The CPU's string copy (`rep movsb`, which glibc's `memcpy` uses from 2 KiB up and the
//! kernel's `process_vm_readv`/`writev` use at every size) runs many times slower on this
//! machine's AMD EPYC (under KVM) when the destination lies 1 to 31 bytes past the source
//! within a cache line, `(dst - src) mod 64` in `1..=31`. Measured here by the example
//! `copy_offsets`, one core, warm caches (docs/BENCHMARKS.md, O, "Alignment"): `memcpy` of
//! 4 KiB 0.07 us with the offset 0 or 32 and 1.4-1.5 us with 8-24; of 256 KiB 7-14 us
//! against 90 us; `process_vm_readv` of 4 KiB 1.2 us against 2.6 us, of 1 MiB 0.11 ms
//! against 0.45 ms.
//! Such offsets are common: a rank's page-aligned arena chunk against a large buffer from
//! glibc's `malloc` (16 bytes past a page) is one.
//!
//! [`copy_bytes`] copies with 16-byte vector moves where the offset is one of those (the
//! moves do not care: 4 KiB in 0.1-0.2 us at every offset), else with `memcpy`.
//! [`bounce_at`] places a chunk in a bounce buffer so that both the copy in and the copy out
//! avoid them. [`BounceBuf`] is a page-aligned buffer with the room to do so.

use std::ops::{Deref, DerefMut};

/// Bytes from which glibc's `memcpy` takes the string copy here (its default
/// `x86_rep_movsb_threshold`, 2048, with a margin).
const STRING_COPY_FROM: usize = 2048;

/// Whether a string copy from `src` to `dst` falls in the slow case: `(dst - src) mod 64`
/// in `1..=31`.
pub fn slow_offset(src: usize, dst: usize) -> bool {
    (1..32).contains(&(dst.wrapping_sub(src) % 64))
}

/// Copies `len` bytes from `src` to `dst` (which must not overlap).
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src` readable and `dst` writable for `len` bytes,
/// the two ranges disjoint.
pub unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len > STRING_COPY_FROM && slow_offset(src as usize, dst as usize) {
        // SAFETY: the caller's contract.
        unsafe { copy_by_vectors(src, dst, len) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// [`copy_bytes`] between two slices of the same length.
pub fn copy_slice(src: &[u8], dst: &mut [u8]) {
    assert_eq!(
        src.len(),
        dst.len(),
        "copy_slice between slices of different lengths"
    );
    // SAFETY: two borrows, one of them mutable, cannot overlap; both hold `src.len()` bytes.
    unsafe { copy_bytes(src.as_ptr(), dst.as_mut_ptr(), src.len()) }
}

/// 64 bytes per step in four unaligned 16-byte loads, then four stores (SSE2, which every
/// x86_64 has); the tail by `copy_nonoverlapping` (under 64 bytes: no string copy).
#[cfg(target_arch = "x86_64")]
unsafe fn copy_by_vectors(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128};
    let mut i = 0;
    while i + 64 <= len {
        // SAFETY: [i, i + 64) lies within both ranges (the caller's contract); the loads and
        // stores are unaligned ones.
        unsafe {
            let s = src.add(i) as *const __m128i;
            let d = dst.add(i) as *mut __m128i;
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_storeu_si128(d, a);
            _mm_storeu_si128(d.add(1), b);
            _mm_storeu_si128(d.add(2), c);
            _mm_storeu_si128(d.add(3), e);
        }
        i += 64;
    }
    // SAFETY: the rest of both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i) }
}

/// Where in a [`BounceBuf`] (an offset below 64 from its page-aligned start) a chunk read
/// from `src` and then written to `dst` goes, so that neither copy is a slow one: the same
/// offset in its cache line as `src` when `dst` is not 1-31 bytes past `src` (both copies as
/// fast as a direct one), else 32 bytes further (each copy then sees an offset of 32 or more).
pub fn bounce_at(src: usize, dst: usize) -> usize {
    let d = dst.wrapping_sub(src) % 64;
    let a = if (1..32).contains(&d) { d + 32 } else { 0 };
    src.wrapping_add(a) % 64
}

/// One page of plain bytes, aligned to its size.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([u8; PAGE]);

const PAGE: usize = 4096;

/// A zeroed buffer of `len` bytes starting on a page boundary, with 64 bytes more behind
/// them, so that a chunk of up to `len` bytes fits at any [`bounce_at`] offset
/// ([`BounceBuf::at`]).
pub struct BounceBuf {
    pages: Box<[Page]>,
    len: usize,
}

impl BounceBuf {
    pub fn new(len: usize) -> BounceBuf {
        BounceBuf {
            pages: vec![Page([0; PAGE]); (len + 64).div_ceil(PAGE)].into_boxed_slice(),
            len,
        }
    }

    /// `n` bytes (at most the buffer's length) at `off` (below 64) from its start.
    pub fn at(&mut self, off: usize, n: usize) -> &mut [u8] {
        assert!(off < 64 && n <= self.len, "a chunk past its bounce buffer");
        &mut self.all_mut()[off..off + n]
    }

    /// [`BounceBuf::at`], to read.
    pub fn get(&self, off: usize, n: usize) -> &[u8] {
        assert!(off < 64 && n <= self.len, "a chunk past its bounce buffer");
        // SAFETY: as in `all_mut`; [off, off + n) lies within the pages (`len` + 64 bytes).
        unsafe { std::slice::from_raw_parts(self.pages.as_ptr().cast::<u8>().add(off), n) }
    }

    fn all_mut(&mut self) -> &mut [u8] {
        let n = self.pages.len() * PAGE;
        // SAFETY: `pages` holds `n` initialised bytes (`Page` is bytes with no padding),
        // borrowed mutably for as long as `self` is.
        unsafe { std::slice::from_raw_parts_mut(self.pages.as_mut_ptr().cast::<u8>(), n) }
    }
}

impl Deref for BounceBuf {
    type Target = [u8];
    /// The first `len` bytes.
    fn deref(&self) -> &[u8] {
        // SAFETY: as in `all_mut`, `len` of them, borrowed with `self`.
        unsafe { std::slice::from_raw_parts(self.pages.as_ptr().cast::<u8>(), self.len) }
    }
}

impl DerefMut for BounceBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.all_mut()[..len]
    }
}

impl std::fmt::Debug for BounceBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BounceBuf({} bytes at {:p})",
            self.len,
            self.pages.as_ptr()
        )
    }
}

/// Pseudo-random numbers for the tests of this crate (xorshift), from a seed taken from the
/// clock and printed.
#[cfg(test)]
pub(crate) fn random_numbers() -> impl FnMut() -> u64 {
    let mut x = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("seed {x}");
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_bytes_copies_exactly_the_range_at_every_offset() {
        let mut next = random_numbers();
        let src: Vec<u8> = (0..20_000).map(|_| next() as u8).collect();
        for _ in 0..300 {
            let len = [0, 1, 63, 64, 2048, 2049, 4096, 5000, 16_384][next() as usize % 9];
            let (so, d_o) = (next() as usize % 128, next() as usize % 128);
            let mut dst = vec![0xA5u8; len + 256];
            // SAFETY: both ranges lie within their vectors, which are distinct.
            unsafe { copy_bytes(src.as_ptr().add(so), dst.as_mut_ptr().add(d_o), len) };
            assert_eq!(
                &dst[d_o..d_o + len],
                &src[so..so + len],
                "len {len} at {so}->{d_o}"
            );
            assert!(
                dst[..d_o].iter().all(|&b| b == 0xA5),
                "bytes before touched"
            );
            assert!(
                dst[d_o + len..].iter().all(|&b| b == 0xA5),
                "bytes after touched"
            );
        }
    }

    #[test]
    fn the_bounce_offset_keeps_both_copies_out_of_the_slow_case() {
        for src in 0..64usize {
            for dst in 0..64usize {
                let (src, dst) = (4096 * 7 + src, 4096 * 3 + dst);
                let b = 4096 * 11 + bounce_at(src, dst);
                assert!(!slow_offset(src, b), "in: {src} -> {b}");
                assert!(!slow_offset(b, dst), "out: {b} -> {dst}");
                if !slow_offset(src, dst) {
                    assert_eq!(b % 64, src % 64, "an aligned pair bounces aligned");
                }
            }
        }
        assert!(slow_offset(0, 16) && slow_offset(100, 131) && !slow_offset(16, 0));
        assert!(!slow_offset(0, 0) && !slow_offset(0, 32) && !slow_offset(0, 64));
    }

    #[test]
    fn a_bounce_buffer_starts_on_a_page_and_holds_a_chunk_at_every_offset() {
        for len in [1, 4096, 4097, 3 * 4096 + 5] {
            let mut b = BounceBuf::new(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % PAGE, 0);
            assert!(b.iter().all(|&x| x == 0));
            for off in [0, 17, 63] {
                let c = b.at(off, len);
                c.fill(off as u8);
                assert_eq!(c.len(), len);
            }
        }
    }
}
