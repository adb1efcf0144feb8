//! The pseudo-random streams: SplitMix64, one stream per decision, derived from the seed.

use integration_tests::splitmix::{mix, GOLDEN};

pub struct Rng(u64);

// Stream tags: which decision a stream is for.
pub const S_OP: u64 = 1;
pub const S_COUNTS: u64 = 2;
pub const S_SLAYOUT: u64 = 3;
pub const S_SDATA: u64 = 4;
pub const S_RLAYOUT: u64 = 5;
pub const S_RANK: u64 = 6;
pub const S_RING: u64 = 7;
pub const S_COMMS: u64 = 8;

impl Rng {
    /// A stream determined by `parts` (e.g. `[seed, tag, op, rank]`).
    pub fn derive(parts: &[u64]) -> Rng {
        let mut s = 0x243f_6a88_85a3_08d3u64;
        for &p in parts {
            s = mix(s ^ mix(p.wrapping_add(GOLDEN)));
        }
        Rng(s)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    /// Uniform in `0..n` (0 for n = 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}
