//! SplitMix64 and the seed of randomized tests, shared by the integration tests, by
//! `alltoallv_check` and (included by path) by the SP engine tests in
//! `crates/service-process/tests/common`, which cannot depend on this crate.

/// SplitMix64's increment.
pub const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A SplitMix64 stream from a seed.
pub struct Rng(pub u64);

impl Rng {
    /// The next number of the stream (an endless stream: not an `Iterator`).
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    /// Uniform in `0..n` (0 for n = 0, which still takes a number from the stream).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// `TEST_SEED` if it is set to a number.
pub fn env_seed() -> Option<u64> {
    std::env::var("TEST_SEED").ok()?.parse().ok()
}

/// The clock in nanoseconds (the low 64 bits), for a seed when `TEST_SEED` is not set.
pub fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}
