//! Packed sides: the host-side staging of a side that cannot be granted directly.
//!
//! A side whose elements are not one run of bytes in type-map order (a vector, a padded type
//! with several elements, a struct listed out of address order...), and the send side of an
//! `MPI_IN_PLACE` call, go through a contiguous buffer of the shim laid out by
//! `layout::packed_side`: peer after peer, each peer's elements as `MPI_Pack` writes them,
//! which for a homogeneous job is the elements' bytes in type-map order. A send side is packed
//! when the collective is posted; a receive side is unpacked into the program's buffer when
//! the request completes successfully, before the program can see it complete
//! (`request.rs`). The receive type is duplicated at the post and freed after the unpack, so a
//! program may free its type while the collective runs (MPI allows it).
//!
//! `MPI_Pack` and `MPI_Unpack` take `int` sizes: a block is moved in pieces of at most
//! [`PIECE_BYTES`]. Each piece must produce exactly `elements * size` bytes; an MPI whose
//! packed form differs from the raw bytes (a heterogeneous job, `external32`) is refused with
//! an error rather than moved wrong.

use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::{c_int, c_void};

/// Largest piece handed to one `MPI_Pack` / `MPI_Unpack` call.
const PIECE_BYTES: i64 = 1 << 30;

/// One peer's elements in the program's buffer: where the first starts, how many.
#[derive(Clone, Copy, Debug)]
pub struct Block {
    pub addr: usize,
    pub count: i64,
}

/// A datatype handle of the shim's own (a duplicate), freed on drop.
#[derive(Debug)]
pub struct OwnedType(ffi::MPI_Datatype);

impl OwnedType {
    /// # Safety
    /// MPI is initialised; `ty` is a valid datatype.
    pub unsafe fn dup(ty: ffi::MPI_Datatype) -> Result<OwnedType, String> {
        let mut out = consts::DATATYPE_NULL();
        // SAFETY: forwarded; valid out-pointer.
        let rc = unsafe { ffi::PMPI_Type_dup(ty, &mut out) };
        if rc != consts::SUCCESS() {
            return Err(format!("MPI_Type_dup failed (MPI error {rc})"));
        }
        Ok(OwnedType(out))
    }
}

impl Drop for OwnedType {
    fn drop(&mut self) {
        // SAFETY: our own duplicate, freed once. (MPI may be finalised only after every
        // request of ours is gone: `lifecycle::finish` runs before PMPI_Finalize.)
        unsafe { ffi::PMPI_Type_free(&mut self.0) };
    }
}

// SAFETY: a datatype handle is a plain value (a pointer in Open MPI, an int in MPICH) that MPI
// lets any thread use; the shim only uses it under its own lock or from the owning request.
unsafe impl Send for OwnedType {}

/// Moves `block`'s elements to or from `staging[at..]`, piece by piece. `pack`: program
/// buffer → staging; else staging → program buffer.
///
/// # Safety
/// `block` names elements of `ty` that the program made valid for this direction (MPI
/// preconditions of the collective); `staging[at..]` holds `block.count * size` bytes.
unsafe fn move_block(
    pack: bool,
    block: Block,
    ty: ffi::MPI_Datatype,
    size: i64,
    extent: i64,
    staging: &mut [u8],
    at: usize,
) -> Result<(), String> {
    if block.count == 0 || size == 0 {
        return Ok(());
    }
    let per_piece = (PIECE_BYTES / size).max(1);
    let mut done: i64 = 0;
    let mut at = at;
    while done < block.count {
        let n = per_piece.min(block.count - done);
        let bytes = (n * size) as usize;
        let elem = block.addr as isize + (done as isize) * (extent as isize);
        let piece = staging
            .get_mut(at..at + bytes)
            .ok_or("a packed block does not fit its staging buffer")?;
        let mut position: c_int = 0;
        // SAFETY: forwarded preconditions; `piece` is `bytes` long, `n` elements of `ty`
        // start at `elem`. COMM_SELF: the packed form of this process, which in a homogeneous
        // job is the raw bytes every rank uses (checked below).
        let rc = unsafe {
            if pack {
                ffi::PMPI_Pack(
                    elem as *const c_void,
                    n as c_int,
                    ty,
                    piece.as_mut_ptr().cast(),
                    bytes as c_int,
                    &mut position,
                    consts::COMM_SELF(),
                )
            } else {
                ffi::PMPI_Unpack(
                    piece.as_ptr().cast(),
                    bytes as c_int,
                    &mut position,
                    elem as *mut c_void,
                    n as c_int,
                    ty,
                    consts::COMM_SELF(),
                )
            }
        };
        let what = if pack { "MPI_Pack" } else { "MPI_Unpack" };
        if rc != consts::SUCCESS() {
            return Err(format!("{what} failed (MPI error {rc})"));
        }
        if position as usize != bytes {
            return Err(format!(
                "{what} moved {position} bytes for {n} elements of {size} bytes: this MPI's \
                 packed form is not the raw bytes (a heterogeneous job?)"
            ));
        }
        done += n;
        at += bytes;
    }
    Ok(())
}

/// The staging of a send side: `blocks`' elements of `ty`, packed peer after peer at
/// `offsets`, into a buffer of `len` bytes.
///
/// # Safety
/// As for [`move_block`], for every block.
pub unsafe fn pack(
    blocks: &[Block],
    offsets: &[u64],
    ty: ffi::MPI_Datatype,
    size: i64,
    extent: i64,
    len: u64,
) -> Result<Vec<u8>, String> {
    let mut staging = vec![0u8; len as usize];
    for (b, &at) in blocks.iter().zip(offsets) {
        // SAFETY: forwarded.
        unsafe { move_block(true, *b, ty, size, extent, &mut staging, at as usize)? };
    }
    Ok(staging)
}

/// The staging of a receive side and what to unpack from it at completion.
#[derive(Debug)]
pub struct Unpack {
    pub staging: Vec<u8>,
    blocks: Vec<Block>,
    offsets: Vec<u64>,
    ty: OwnedType,
    size: i64,
    extent: i64,
}

impl Unpack {
    /// # Safety
    /// MPI is initialised; `ty` is valid.
    pub unsafe fn new(
        blocks: Vec<Block>,
        offsets: Vec<u64>,
        ty: ffi::MPI_Datatype,
        size: i64,
        extent: i64,
        len: u64,
    ) -> Result<Unpack, String> {
        Ok(Unpack {
            staging: vec![0u8; len as usize],
            blocks,
            offsets,
            // SAFETY: forwarded.
            ty: unsafe { OwnedType::dup(ty)? },
            size,
            extent,
        })
    }

    /// Writes the received bytes into the program's buffer.
    ///
    /// # Safety
    /// The collective completed: the program's receive buffer (the blocks) is the shim's to
    /// write until the request is reported complete.
    pub unsafe fn run(mut self) -> Result<(), String> {
        for (b, &at) in self.blocks.iter().zip(&self.offsets) {
            // SAFETY: forwarded.
            unsafe {
                move_block(
                    false,
                    *b,
                    self.ty.0,
                    self.size,
                    self.extent,
                    &mut self.staging,
                    at as usize,
                )?
            };
        }
        Ok(())
    }
}
