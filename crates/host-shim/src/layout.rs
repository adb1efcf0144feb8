//! Byte layout of one side (send or receive) of an alltoall(v): pure arithmetic, no MPI calls.
//!
//! MPI describes a side as a buffer pointer, a datatype and per-peer element counts and
//! displacements (in units of the type's extent). The SP wants bytes: per-peer byte counts and
//! byte displacements relative to a granted region. For a "contiguous" datatype (size == true
//! extent == extent) the `count` elements for peer `p` occupy exactly the bytes
//! `[displ[p] * extent + true_lb, + count[p] * size)` from the buffer pointer. The granted
//! region is the smallest range covering every peer's bytes (peers with no bytes are left out),
//! and displacements are rewritten relative to its first byte. Displacements may be negative in
//! MPI (the region then starts before the buffer pointer); every product and sum is computed in
//! `i128` and checked, so a hostile or erroneous argument becomes a [`LayoutError`] (the caller
//! then lets native MPI handle, and report, the call) and never a wrapped number.

/// Geometry of an MPI datatype as `PMPI_Type_size`, `PMPI_Type_get_extent` and
/// `PMPI_Type_get_true_extent` report it (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypeGeometry {
    pub size: i64,
    pub lb: i64,
    pub extent: i64,
    pub true_lb: i64,
    pub true_extent: i64,
}

impl TypeGeometry {
    /// A type whose elements, laid end to end, leave no gap and never overlap: its data are one
    /// block (size == true extent) and consecutive elements follow each other (extent == size).
    /// `MPI_INT` and `MPI_Type_contiguous(3, MPI_INT)` are; vectors and resized types are not.
    pub fn is_contiguous(&self) -> bool {
        self.size >= 0 && self.size == self.true_extent && self.extent == self.size
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutError {
    /// `counts` and `displs` do not have one entry per peer.
    Length {
        counts: usize,
        displs: usize,
    },
    NegativeCount {
        peer: usize,
    },
    /// A byte count, offset or the region does not fit the address space.
    Overflow {
        peer: usize,
    },
}

/// One side in bytes, relative to its granted region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SideBytes {
    /// Offset of the region's first byte from the buffer pointer (negative when a displacement
    /// points before the buffer).
    pub region_offset: i64,
    pub region_len: u64,
    /// Bytes for each peer.
    pub counts: Vec<u64>,
    /// Offset of each peer's bytes inside the region (0 for peers with no bytes).
    pub displs: Vec<u64>,
}

/// Converts element counts and displacements of a contiguous type into bytes relative to the
/// smallest region covering all of them. The caller checks `ty.is_contiguous()` first.
pub fn side_bytes(
    counts: &[i64],
    displs: &[i64],
    ty: &TypeGeometry,
) -> Result<SideBytes, LayoutError> {
    if counts.len() != displs.len() {
        return Err(LayoutError::Length {
            counts: counts.len(),
            displs: displs.len(),
        });
    }
    // Absolute (relative to the buffer pointer) byte ranges per peer.
    let mut ranges: Vec<Option<(i128, i128)>> = Vec::with_capacity(counts.len());
    let (mut lo, mut hi) = (i128::MAX, i128::MIN);
    for (peer, (&count, &displ)) in counts.iter().zip(displs).enumerate() {
        if count < 0 {
            return Err(LayoutError::NegativeCount { peer });
        }
        let bytes = count as i128 * ty.size as i128;
        if bytes == 0 {
            ranges.push(None);
            continue;
        }
        let start = displ as i128 * ty.extent as i128 + ty.true_lb as i128;
        let end = start + bytes;
        let fits = |v: i128| v >= i64::MIN as i128 && v <= i64::MAX as i128;
        if !fits(start) || !fits(end) {
            return Err(LayoutError::Overflow { peer });
        }
        lo = lo.min(start);
        hi = hi.max(end);
        ranges.push(Some((start, bytes)));
    }
    if lo == i128::MAX {
        // Nothing to move on this side: an empty region at the buffer pointer.
        return Ok(SideBytes {
            region_offset: 0,
            region_len: 0,
            counts: vec![0; counts.len()],
            displs: vec![0; counts.len()],
        });
    }
    let region_len = hi - lo;
    if region_len > i64::MAX as i128 {
        return Err(LayoutError::Overflow {
            peer: counts.len().saturating_sub(1),
        });
    }
    let mut out = SideBytes {
        region_offset: lo as i64,
        region_len: region_len as u64,
        counts: Vec::with_capacity(counts.len()),
        displs: Vec::with_capacity(counts.len()),
    };
    for r in ranges {
        let (start, bytes) = r.unwrap_or((lo, 0));
        // Both fit: 0 <= start - lo < region_len <= i64::MAX and bytes <= region_len.
        out.counts.push(bytes as u64);
        out.displs.push((start - lo) as u64);
    }
    Ok(out)
}

/// The absolute address of a region that starts `region_offset` bytes from `buf` and is `len`
/// bytes long, or `None` if it would leave the address space.
pub fn region_addr(buf: u64, region_offset: i64, len: u64) -> Option<u64> {
    let start = buf as i128 + region_offset as i128;
    if start < 0 || start + len as i128 > u64::MAX as i128 {
        return None;
    }
    Some(start as u64)
}

/// Counts and displacements (in elements) of an `MPI_Alltoall` of `count` elements per peer
/// over `n` peers, as the equivalent alltoallv: `count` each, displacement `i * count`.
pub fn alltoall_as_v(n: usize, count: i64) -> (Vec<i64>, Vec<i64>) {
    let counts = vec![count; n];
    let displs = (0..n as i64).map(|i| i.saturating_mul(count)).collect();
    (counts, displs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int() -> TypeGeometry {
        TypeGeometry {
            size: 4,
            lb: 0,
            extent: 4,
            true_lb: 0,
            true_extent: 4,
        }
    }

    #[test]
    fn contiguity_rules() {
        assert!(int().is_contiguous());
        // MPI_Type_contiguous(3, MPI_INT).
        let c3 = TypeGeometry {
            size: 12,
            lb: 0,
            extent: 12,
            true_lb: 0,
            true_extent: 12,
        };
        assert!(c3.is_contiguous());
        // MPI_Type_vector(2, 1, 2, MPI_INT): a gap inside.
        let vec = TypeGeometry {
            size: 8,
            lb: 0,
            extent: 12,
            true_lb: 0,
            true_extent: 12,
        };
        assert!(!vec.is_contiguous());
        // MPI_Type_create_resized(MPI_INT, 0, 8): a gap between elements.
        let resized = TypeGeometry {
            size: 4,
            lb: 0,
            extent: 8,
            true_lb: 0,
            true_extent: 4,
        };
        assert!(!resized.is_contiguous());
    }

    #[test]
    fn packed_alltoallv_covers_exactly_its_bytes() {
        let s = side_bytes(&[1, 2, 3], &[0, 1, 3], &int()).unwrap();
        assert_eq!(s.region_offset, 0);
        assert_eq!(s.region_len, 24);
        assert_eq!(s.counts, [4, 8, 12]);
        assert_eq!(s.displs, [0, 4, 12]);
    }

    #[test]
    fn region_starts_at_the_lowest_used_byte() {
        // Peer 0 sends nothing from displacement 0; the others start at element 10.
        let s = side_bytes(&[0, 2, 1], &[0, 12, 10], &int()).unwrap();
        assert_eq!(s.region_offset, 40);
        assert_eq!(s.region_len, 16);
        assert_eq!(s.counts, [0, 8, 4]);
        assert_eq!(s.displs, [0, 8, 0]);
    }

    #[test]
    fn all_zero_counts_give_an_empty_region() {
        let s = side_bytes(&[0, 0], &[5, -7], &int()).unwrap();
        assert_eq!(s.region_len, 0);
        assert_eq!(s.region_offset, 0);
        assert_eq!(s.counts, [0, 0]);
        assert_eq!(s.displs, [0, 0]);
        // A zero-size type moves nothing whatever the counts.
        let empty = TypeGeometry {
            size: 0,
            lb: 0,
            extent: 0,
            true_lb: 0,
            true_extent: 0,
        };
        assert!(empty.is_contiguous());
        assert_eq!(side_bytes(&[3, 9], &[0, 1], &empty).unwrap().region_len, 0);
    }

    #[test]
    fn negative_displacements_move_the_region_before_the_buffer() {
        let s = side_bytes(&[1, 1], &[-2, 0], &int()).unwrap();
        assert_eq!(s.region_offset, -8);
        assert_eq!(s.region_len, 12);
        assert_eq!(s.displs, [0, 8]);
        assert_eq!(region_addr(0x1000, -8, 12), Some(0x1000 - 8));
        // Before address 0 or past the top: refused, not wrapped.
        assert_eq!(region_addr(4, -8, 12), None);
        assert_eq!(region_addr(u64::MAX - 4, 0, 12), None);
        assert_eq!(region_addr(0, 0, 0), Some(0));
    }

    #[test]
    fn true_lb_shifts_every_peer() {
        // A contiguous type whose data start 4 bytes after its lower bound.
        let shifted = TypeGeometry {
            size: 4,
            lb: 4,
            extent: 4,
            true_lb: 4,
            true_extent: 4,
        };
        let s = side_bytes(&[1, 1], &[0, 1], &shifted).unwrap();
        assert_eq!(s.region_offset, 4);
        assert_eq!(s.displs, [0, 4]);
    }

    #[test]
    fn overlapping_peers_are_allowed_on_the_send_side() {
        let s = side_bytes(&[2, 2], &[0, 0], &int()).unwrap();
        assert_eq!(s.region_len, 8);
        assert_eq!(s.displs, [0, 0]);
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert_eq!(
            side_bytes(&[1, -1], &[0, 0], &int()),
            Err(LayoutError::NegativeCount { peer: 1 })
        );
        assert_eq!(
            side_bytes(&[1], &[0, 0], &int()),
            Err(LayoutError::Length {
                counts: 1,
                displs: 2
            })
        );
        let huge = TypeGeometry {
            size: i64::MAX,
            lb: 0,
            extent: i64::MAX,
            true_lb: 0,
            true_extent: i64::MAX,
        };
        assert_eq!(
            side_bytes(&[0, 2], &[0, 0], &huge),
            Err(LayoutError::Overflow { peer: 1 })
        );
        assert_eq!(
            side_bytes(&[1, 1], &[i64::MIN / 4, i64::MAX / 4], &int()),
            Err(LayoutError::Overflow { peer: 1 })
        );
    }

    #[test]
    fn alltoall_is_an_alltoallv_with_equal_blocks() {
        let (c, d) = alltoall_as_v(3, 5);
        assert_eq!(c, [5, 5, 5]);
        assert_eq!(d, [0, 5, 10]);
        let s = side_bytes(&c, &d, &int()).unwrap();
        assert_eq!(s.region_len, 60);
        assert_eq!(s.displs, [0, 20, 40]);
    }
}
