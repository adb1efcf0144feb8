//! The `strided` data layout of `coll-bench overlap --datatype strided`: each element is 8
//! data bytes followed by an 8-byte hole (`MPI_Type_create_resized(MPI_Type_contiguous(8,
//! MPI_BYTE), 0, 16)`), so a block of SIZE data bytes spans 2 x SIZE bytes of its buffer. The
//! program's data are the contiguous pattern blocks of the other layouts, scattered into the
//! data bytes before a collective and gathered out of them after it; the holes must come back
//! untouched.

/// Data bytes per element.
pub const DATA: usize = 8;
/// Bytes per element in the buffer (data and hole).
pub const EXTENT: usize = 16;

/// Writes `data` (a multiple of [`DATA`] bytes) into the data bytes of `wire`.
pub fn scatter(data: &[u8], wire: &mut [u8]) {
    for (d, w) in data.chunks(DATA).zip(wire.chunks_mut(EXTENT)) {
        w[..d.len()].copy_from_slice(d);
    }
}

/// The data bytes of `wire` (`wire.len() / 2` of them), and the offset of the first hole byte
/// that is not `hole` (the holes must be left alone).
pub fn gather(wire: &[u8], hole: u8) -> (Vec<u8>, Option<usize>) {
    let mut data = Vec::with_capacity(wire.len() / 2);
    let mut bad = None;
    for (i, w) in wire.chunks(EXTENT).enumerate() {
        let (d, h) = w.split_at(DATA.min(w.len()));
        data.extend_from_slice(d);
        if bad.is_none() {
            bad = h
                .iter()
                .position(|&b| b != hole)
                .map(|k| i * EXTENT + DATA + k);
        }
    }
    (data, bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_then_gather_is_the_identity_and_catches_written_holes() {
        let data: Vec<u8> = (0..32).collect();
        let mut wire = vec![0xA5; 64];
        scatter(&data, &mut wire);
        assert_eq!(&wire[..8], &data[..8]);
        assert_eq!(&wire[8..16], &[0xA5; 8]);
        assert_eq!(&wire[16..24], &data[8..16]);
        assert_eq!(gather(&wire, 0xA5), (data.clone(), None));
        wire[40] ^= 1;
        assert_eq!(gather(&wire, 0xA5).1, Some(40));
    }
}
