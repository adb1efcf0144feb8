//! The validation pattern: every byte a sender puts in a block is a function of
//! (sender, receiver, iteration, byte index), so the receiver can check each block exactly,
//! and data left over from an earlier iteration or delivered from the wrong peer is caught.

fn mix(mut z: u64) -> u64 {
    // SplitMix64 finalizer.
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn block_seed(src: u32, dst: u32, iter: u64) -> u64 {
    mix(mix(((src as u64) << 32) | dst as u64) ^ iter.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Fills `block` with what `src` sends to `dst` in iteration `iter`.
/// Byte `i` is byte `i % 8` (little endian) of `mix(seed + i / 8)`.
pub fn fill(block: &mut [u8], src: u32, dst: u32, iter: u64) {
    let seed = block_seed(src, dst, iter);
    for (w, chunk) in block.chunks_mut(8).enumerate() {
        let v = mix(seed.wrapping_add(w as u64)).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// The first byte of `block` that differs from [`fill`]'s pattern: `(offset, expected, got)`.
pub fn first_mismatch(block: &[u8], src: u32, dst: u32, iter: u64) -> Option<(usize, u8, u8)> {
    let seed = block_seed(src, dst, iter);
    for (w, chunk) in block.chunks(8).enumerate() {
        let v = mix(seed.wrapping_add(w as u64)).to_le_bytes();
        if chunk != &v[..chunk.len()] {
            let k = (0..chunk.len()).find(|&k| chunk[k] != v[k]).unwrap_or(0);
            return Some((w * 8 + k, v[k], chunk[k]));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_sensitivity() {
        let mut b = vec![0u8; 1001];
        fill(&mut b, 3, 1, 7);
        assert_eq!(first_mismatch(&b, 3, 1, 7), None);
        assert!(first_mismatch(&b, 1, 3, 7).is_some());
        assert!(first_mismatch(&b, 3, 1, 8).is_some());
        b[1000] ^= 1;
        assert_eq!(first_mismatch(&b, 3, 1, 7).map(|m| m.0), Some(1000));
    }
}
