//! Byte layout of one side (send or receive) of a collective: pure arithmetic, no MPI calls.
//!
//! MPI describes a side as a buffer pointer, a datatype and per-peer element counts and
//! displacements (in units of the type's extent). The SP wants bytes: per-peer byte counts and
//! byte displacements relative to a granted region, each peer's bytes in the order of the type
//! map (that order is what MPI matches between ranks: the type *signature*).
//!
//! A side is granted **directly** (the SP reads or writes the program's buffer) when each
//! peer's `count` elements are one run of bytes in type-map order: the type's data are one
//! increasing run of `size` bytes at `true_lb` ([`TypeGeometry::run`], decided from the type's
//! constructors in `datatype.rs`) and either `count <= 1` or consecutive elements abut
//! (`extent == size`). The elements for peer `p` then occupy exactly `[displ[p] * extent +
//! true_lb, + count[p] * size)` from the buffer pointer. The granted region is the smallest
//! range covering every peer's bytes (peers with no bytes are left out), and displacements are
//! rewritten relative to its first byte. Displacements may be negative in MPI (the region then
//! starts before the buffer pointer).
//!
//! Any other side is **packed** (`coll.rs`): its bytes go through a contiguous staging buffer
//! of the shim (`MPI_Pack` before the post, `MPI_Unpack` at completion), laid out by
//! [`packed_side`]: peer after peer, `count[p] * size` bytes each. Either way the SP sees the
//! same bytes in the same order, so ranks that describe one message with different type maps
//! (legal when the signatures match) interoperate, and whether a side is packed is a local
//! matter of each rank that never changes what any other rank does.
//!
//! Every product and sum is computed in `i128` and checked, so a hostile or erroneous argument
//! becomes a [`LayoutError`] and never a wrapped number.

use crate::recycle::Recycled;

/// Geometry of an MPI datatype as `PMPI_Type_size`, `PMPI_Type_get_extent` and
/// `PMPI_Type_get_true_extent` report it (bytes), and whether its data are one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypeGeometry {
    pub size: i64,
    pub lb: i64,
    pub extent: i64,
    pub true_lb: i64,
    pub true_extent: i64,
    /// One element's data, in type-map order, are one run of `size` bytes starting at
    /// `true_lb`: `MPI_INT`, `MPI_Type_contiguous(3, MPI_INT)`, an `hindexed` of one block at
    /// any displacement, a resized `MPI_INT`; not a vector with a gap, nor a struct whose
    /// blocks are listed in decreasing address order (its bytes in memory order would not be
    /// its type-map order).
    pub run: bool,
}

/// `count` elements of a type are not one run of bytes in type-map order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotARun;

impl TypeGeometry {
    /// The bytes of `count` elements whose first element starts `at` bytes from the buffer:
    /// `None` when they are empty, `Some((start, len))` when they are one run in type-map
    /// order.
    pub fn run_of(&self, count: i64, at: i128) -> Result<Option<(i128, i128)>, NotARun> {
        if count < 0 || self.size < 0 {
            return Err(NotARun);
        }
        let len = count as i128 * self.size as i128;
        if len == 0 {
            return Ok(None);
        }
        if !self.run || (count > 1 && self.extent != self.size) {
            return Err(NotARun);
        }
        Ok(Some((at + self.true_lb as i128, len)))
    }
}

/// Whether the non-empty runs, in the order given, follow each other without a gap or an
/// overlap (so together they are one run).
pub fn runs_abut(
    runs: impl IntoIterator<Item = Result<Option<(i128, i128)>, NotARun>>,
) -> Result<Option<(i128, i128)>, NotARun> {
    let mut whole: Option<(i128, i128)> = None;
    for r in runs {
        let Some((start, len)) = r? else { continue };
        whole = match whole {
            None => Some((start, len)),
            Some((s, l)) if s + l == start => Some((s, l + len)),
            Some(_) => return Err(NotARun),
        };
    }
    Ok(whole)
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
    /// Peer `peer`'s elements are not one run of bytes in type-map order: the side is packed.
    NotARun {
        peer: usize,
    },
}

/// One side in bytes, relative to its granted region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SideBytes {
    /// Offset of the region's first byte from the buffer pointer (negative when a displacement
    /// points before the buffer; 0 for a packed side, whose region is the staging buffer).
    pub region_offset: i64,
    pub region_len: u64,
    /// Bytes for each peer.
    pub counts: Recycled<u64>,
    /// Offset of each peer's bytes inside the region (0 for peers with no bytes).
    pub displs: Recycled<u64>,
}

fn fits_i64(v: i128) -> bool {
    v >= i64::MIN as i128 && v <= i64::MAX as i128
}

/// Element counts and displacements of a side granted directly, in bytes relative to the
/// smallest region covering all of them; [`LayoutError::NotARun`] if some peer's elements are
/// not one run (the side must then be packed).
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
    // Two passes over the peers, so that nothing is kept between them: the region covering
    // every peer's bytes (relative to the buffer pointer), then each peer's place in it.
    let run = |peer: usize, count: i64, displ: i64| {
        ty.run_of(count, displ as i128 * ty.extent as i128)
            .map_err(|NotARun| LayoutError::NotARun { peer })
    };
    let (mut lo, mut hi) = (i128::MAX, i128::MIN);
    for (peer, (&count, &displ)) in counts.iter().zip(displs).enumerate() {
        if count < 0 {
            return Err(LayoutError::NegativeCount { peer });
        }
        let Some((start, bytes)) = run(peer, count, displ)? else {
            continue;
        };
        let end = start + bytes;
        if !fits_i64(start) || !fits_i64(end) {
            return Err(LayoutError::Overflow { peer });
        }
        lo = lo.min(start);
        hi = hi.max(end);
    }
    if lo == i128::MAX {
        // Nothing to move on this side: an empty region at the buffer pointer.
        return Ok(SideBytes {
            region_offset: 0,
            region_len: 0,
            counts: Recycled::collect(counts.iter().map(|_| 0)),
            displs: Recycled::collect(counts.iter().map(|_| 0)),
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
        counts: Recycled::new(),
        displs: Recycled::new(),
    };
    for (peer, (&count, &displ)) in counts.iter().zip(displs).enumerate() {
        // The first pass checked every peer.
        let (start, bytes) = run(peer, count, displ)?.unwrap_or((lo, 0));
        // Both fit: 0 <= start - lo < region_len <= i64::MAX and bytes <= region_len.
        out.counts.push(bytes as u64);
        out.displs.push((start - lo) as u64);
    }
    Ok(out)
}

/// The layout of a packed side in its staging buffer: peer after peer, `counts[p] * size`
/// bytes each, in peer order (the order `coll.rs` packs and unpacks them in).
pub fn packed_side(counts: &[i64], size: i64) -> Result<SideBytes, LayoutError> {
    let mut out = SideBytes {
        region_offset: 0,
        region_len: 0,
        counts: Recycled::new(),
        displs: Recycled::new(),
    };
    let mut at: i128 = 0;
    for (peer, &count) in counts.iter().enumerate() {
        if count < 0 || size < 0 {
            return Err(LayoutError::NegativeCount { peer });
        }
        let bytes = count as i128 * size as i128;
        if at + bytes > i64::MAX as i128 {
            return Err(LayoutError::Overflow { peer });
        }
        out.counts.push(bytes as u64);
        out.displs.push(if bytes == 0 { 0 } else { at as u64 });
        at += bytes;
    }
    out.region_len = at as u64;
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
pub fn alltoall_as_v(n: usize, count: i64) -> (Recycled<i64>, Recycled<i64>) {
    let counts = Recycled::collect((0..n).map(|_| count));
    let displs = Recycled::collect((0..n as i64).map(|i| i.saturating_mul(count)));
    (counts, displs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo(
        size: i64,
        lb: i64,
        extent: i64,
        true_lb: i64,
        true_extent: i64,
        run: bool,
    ) -> TypeGeometry {
        TypeGeometry {
            size,
            lb,
            extent,
            true_lb,
            true_extent,
            run,
        }
    }

    fn int() -> TypeGeometry {
        geo(4, 0, 4, 0, 4, true)
    }

    #[test]
    fn which_element_counts_are_one_run() {
        assert_eq!(int().run_of(3, 8), Ok(Some((8, 12))));
        // MPI_Type_contiguous(3, MPI_INT).
        assert_eq!(geo(12, 0, 12, 0, 12, true).run_of(2, 0), Ok(Some((0, 24))));
        // MPI_Type_vector(2, 1, 2, MPI_INT): a gap inside, never a run.
        let vec = geo(8, 0, 12, 0, 12, false);
        assert_eq!(vec.run_of(1, 0), Err(NotARun));
        // MPI_Type_create_resized(MPI_INT, 0, 8): one element is a run, two are not.
        let resized = geo(4, 0, 8, 0, 4, true);
        assert_eq!(resized.run_of(1, 16), Ok(Some((16, 4))));
        assert_eq!(resized.run_of(2, 16), Err(NotARun));
        // An hindexed of one MPI_INT at byte 8: lb = true_lb = 8, extent 4.
        let shifted = geo(4, 8, 4, 8, 4, true);
        assert_eq!(shifted.run_of(2, 4), Ok(Some((12, 8))));
        // A struct {int at 4, int at 0}: 8 bytes without a gap, but not in type-map order.
        let swapped = geo(8, 0, 8, 0, 8, false);
        assert_eq!(swapped.run_of(1, 0), Err(NotARun));
        // Nothing to move is never a reason to pack, whatever the type.
        assert_eq!(vec.run_of(0, 0), Ok(None));
        assert_eq!(geo(0, 0, 0, 0, 0, false).run_of(5, 0), Ok(None));
        assert_eq!(int().run_of(-1, 0), Err(NotARun));
    }

    #[test]
    fn runs_abut_only_in_increasing_order_without_gaps() {
        let r = |s: i128, l: i128| Ok(Some((s, l)));
        assert_eq!(runs_abut([r(4, 4), Ok(None), r(8, 8)]), Ok(Some((4, 12))));
        assert_eq!(runs_abut([r(8, 4), r(4, 4)]), Err(NotARun));
        assert_eq!(runs_abut([r(0, 4), r(8, 4)]), Err(NotARun));
        assert_eq!(runs_abut([r(0, 8), r(4, 4)]), Err(NotARun));
        assert_eq!(runs_abut([Ok(None), Ok(None)]), Ok(None));
        assert_eq!(runs_abut([r(0, 4), Err(NotARun)]), Err(NotARun));
    }

    #[test]
    fn direct_alltoallv_covers_exactly_its_bytes() {
        let s = side_bytes(&[1, 2, 3], &[0, 1, 3], &int()).unwrap();
        assert_eq!(s.region_offset, 0);
        assert_eq!(s.region_len, 24);
        assert_eq!(s.counts, [4, 8, 12]);
        assert_eq!(s.displs, [0, 4, 12]);
    }

    #[test]
    fn a_side_that_is_not_runs_must_be_packed() {
        let resized = geo(4, 0, 8, 0, 4, true);
        // One element per peer: direct, at the element's data.
        let s = side_bytes(&[1, 0, 1], &[0, 9, 2], &resized).unwrap();
        assert_eq!((s.region_offset, s.region_len), (0, 20));
        assert_eq!(s.displs, [0, 0, 16]);
        // Two elements for peer 1: packed.
        assert_eq!(
            side_bytes(&[1, 2], &[0, 2], &resized),
            Err(LayoutError::NotARun { peer: 1 })
        );
        let p = packed_side(&[1, 2, 0, 3], 4).unwrap();
        assert_eq!(p.region_offset, 0);
        assert_eq!(p.region_len, 24);
        assert_eq!(p.counts, [4, 8, 0, 12]);
        assert_eq!(p.displs, [0, 4, 0, 12]);
        assert_eq!(packed_side(&[0, 0], 4).unwrap().region_len, 0);
        assert_eq!(
            packed_side(&[1, -1], 4),
            Err(LayoutError::NegativeCount { peer: 1 })
        );
        assert_eq!(
            packed_side(&[i64::MAX, 1], 2),
            Err(LayoutError::Overflow { peer: 0 })
        );
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
        let empty = geo(0, 0, 0, 0, 0, true);
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
        // A resized type whose lower bound is negative: the data still start at true_lb.
        let neg_lb = geo(4, -4, 8, 0, 4, true);
        let s = side_bytes(&[1, 1], &[0, 1], &neg_lb).unwrap();
        assert_eq!((s.region_offset, s.region_len), (0, 12));
        assert_eq!(s.displs, [0, 8]);
    }

    #[test]
    fn true_lb_shifts_every_peer() {
        // A contiguous type whose data start 4 bytes after its lower bound.
        let shifted = geo(4, 4, 4, 4, 4, true);
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
        let huge = geo(i64::MAX, 0, i64::MAX, 0, i64::MAX, true);
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
