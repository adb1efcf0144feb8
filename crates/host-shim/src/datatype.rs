//! What the shim needs to know of an MPI datatype: its geometry and whether one element's data
//! are one run of bytes in type-map order ([`TypeGeometry::run`]), so that a side can be
//! granted directly; every other side is packed (`layout.rs`, `coll.rs`).
//!
//! The run is decided from the type's constructors, walked with `MPI_Type_get_envelope` /
//! `MPI_Type_get_contents` (depth and block count bounded): a predefined type is a run when it
//! has no gap (`size == true_extent`); a `dup` or `resized` type when its old type is; a
//! contiguous, vector, indexed or struct type when each of its blocks is one run and the
//! blocks, in the order the constructor lists them, follow each other in memory without a gap
//! or an overlap; a subarray when its old type is a run without padding (`extent == size`) and
//! the subarray has no gap (its elements are listed in increasing address order, in C and in
//! Fortran order). Anything else (a darray, an unknown combiner, a type too deep or with too
//! many blocks) is reported as not a run: packing is always correct, a direct grant only when
//! the bytes in memory order are the type-map order.
//!
//! The answer for a derived type is cached on the type as an attribute (keyval created at
//! start-up, not copied by `MPI_Type_dup`, freed with the type). Predefined types are not
//! cached: their answer costs one envelope call, and setting attributes on them is not
//! something every MPI accepts.

use crate::layout::{runs_abut, TypeGeometry};
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicI32, Ordering};

/// Constructors nested deeper than this are not walked (the type is packed).
const MAX_DEPTH: u32 = 16;
/// Blocks looked at, over the whole walk of one type; beyond it the type is packed.
const MAX_BLOCKS: u64 = 1 << 20;

static KEYVAL: AtomicI32 = AtomicI32::new(i32::MIN);
/// Held while the cache is read or written: a thread that replaces a cached value (two threads
/// analysed one type at once) frees the old one in the delete callback, which must not happen
/// while another thread reads it. (The callback itself does not take it: it runs inside
/// `MPI_Type_set_attr` under this lock, or in the program's `MPI_Type_free`, which MPI does not
/// let race with a use of the same type.)
static CACHE: std::sync::Mutex<()> = std::sync::Mutex::new(());

unsafe extern "C" fn delete_cached(
    _ty: ffi::MPI_Datatype,
    _keyval: c_int,
    attr: *mut c_void,
    _extra: *mut c_void,
) -> c_int {
    if !attr.is_null() {
        crate::boundary::no_panic("the datatype attribute destructor", || {
            // SAFETY: every value stored under KEYVAL is a Box<TypeGeometry> leaked by
            // `geometry`, and MPI calls this once per stored value.
            drop(unsafe { Box::from_raw(attr as *mut TypeGeometry) });
        });
    }
    consts::SUCCESS()
}

/// Creates the cache's keyval (at start-up). Without it nothing is cached.
///
/// # Safety
/// MPI is initialised.
pub unsafe fn create_keyval() {
    let mut keyval: c_int = 0;
    // SAFETY: valid callbacks and out-pointer.
    let rc = unsafe {
        ffi::PMPI_Type_create_keyval(
            consts::TYPE_NULL_COPY_FN(),
            Some(delete_cached),
            &mut keyval,
            std::ptr::null_mut(),
        )
    };
    if rc == consts::SUCCESS() {
        KEYVAL.store(keyval, Ordering::Release);
    }
}

/// The geometry of `ty` and whether it is a run; `None` for an invalid type (native MPI then
/// reports it).
///
/// # Safety
/// MPI is initialised.
pub unsafe fn geometry(ty: ffi::MPI_Datatype) -> Option<TypeGeometry> {
    // Not asked of MPI: Open MPI reports MPI_DATATYPE_NULL to the type queries through
    // MPI_COMM_WORLD's handler (fatal by default), not through the call's communicator.
    if ty == consts::DATATYPE_NULL() {
        return None;
    }
    // SAFETY: forwarded.
    let combiner = unsafe { envelope(ty)? }.3;
    let keyval = KEYVAL.load(Ordering::Acquire);
    let cache = combiner != consts::COMBINER_NAMED() && keyval != i32::MIN;
    let _guard = cache.then(|| CACHE.lock().unwrap_or_else(|e| e.into_inner()));
    if cache {
        let mut found: *mut c_void = std::ptr::null_mut();
        let mut flag: c_int = 0;
        // SAFETY: for Type_get_attr the attribute_val argument points to a void* that
        // receives the stored value.
        let rc = unsafe {
            ffi::PMPI_Type_get_attr(
                ty,
                keyval,
                (&mut found as *mut *mut c_void).cast(),
                &mut flag,
            )
        };
        if rc == consts::SUCCESS() && flag != 0 && !found.is_null() {
            // SAFETY: stored by this function below; lives as long as the type.
            return Some(unsafe { *(found as *const TypeGeometry) });
        }
    }
    let mut budget = MAX_BLOCKS;
    // SAFETY: forwarded.
    let g = unsafe { walk(ty, 0, &mut budget)? };
    if cache {
        let boxed = Box::into_raw(Box::new(g));
        // SAFETY: a valid derived type and keyval; on success MPI owns the pointer until the
        // delete callback frees it.
        if unsafe { ffi::PMPI_Type_set_attr(ty, keyval, boxed.cast()) } != consts::SUCCESS() {
            // SAFETY: not stored: still ours.
            drop(unsafe { Box::from_raw(boxed) });
        }
    }
    Some(g)
}

/// `(integers, addresses, datatypes, combiner)` of `ty`.
unsafe fn envelope(ty: ffi::MPI_Datatype) -> Option<(usize, usize, usize, c_int)> {
    let (mut ni, mut na, mut nd, mut combiner): (c_int, c_int, c_int, c_int) = (0, 0, 0, 0);
    // SAFETY: valid out-pointers; an invalid type is reported by an error code.
    let rc = unsafe { ffi::PMPI_Type_get_envelope(ty, &mut ni, &mut na, &mut nd, &mut combiner) };
    (rc == consts::SUCCESS() && ni >= 0 && na >= 0 && nd >= 0).then_some((
        ni as usize,
        na as usize,
        nd as usize,
        combiner,
    ))
}

/// Size, bounds and true bounds of `ty`; `run` still to be decided (false).
unsafe fn bounds(ty: ffi::MPI_Datatype) -> Option<TypeGeometry> {
    let mut size: ffi::MPI_Count = 0;
    let (mut lb, mut extent, mut true_lb, mut true_extent): (
        ffi::MPI_Count,
        ffi::MPI_Count,
        ffi::MPI_Count,
        ffi::MPI_Count,
    ) = (0, 0, 0, 0);
    let ok = consts::SUCCESS();
    // SAFETY: valid out-pointers; an invalid datatype is reported by an error code.
    unsafe {
        if ffi::PMPI_Type_size_x(ty, &mut size) != ok
            || ffi::PMPI_Type_get_extent_x(ty, &mut lb, &mut extent) != ok
            || ffi::PMPI_Type_get_true_extent_x(ty, &mut true_lb, &mut true_extent) != ok
            || size == consts::UNDEFINED() as ffi::MPI_Count
        {
            return None;
        }
    }
    Some(TypeGeometry {
        size: size as i64,
        lb,
        extent,
        true_lb,
        true_extent,
        run: false,
    })
}

/// The arguments `ty` was built with, and the types among them to free afterwards.
struct Contents {
    ints: Vec<c_int>,
    addrs: Vec<ffi::MPI_Aint>,
    types: Vec<ffi::MPI_Datatype>,
}

impl Drop for Contents {
    fn drop(&mut self) {
        for t in &mut self.types {
            // Derived types returned by MPI_Type_get_contents are new handles to free;
            // predefined ones must not be freed.
            // SAFETY: a handle MPI_Type_get_contents returned.
            let named = unsafe { envelope(*t) }.is_some_and(|e| e.3 == consts::COMBINER_NAMED());
            if !named {
                // SAFETY: as above; freed once.
                unsafe { ffi::PMPI_Type_free(t) };
            }
        }
    }
}

unsafe fn contents(ty: ffi::MPI_Datatype, ni: usize, na: usize, nd: usize) -> Option<Contents> {
    let mut c = Contents {
        ints: vec![0; ni],
        addrs: vec![0; na],
        types: vec![consts::DATATYPE_NULL(); nd],
    };
    // SAFETY: arrays of exactly the sizes the envelope gave.
    let rc = unsafe {
        ffi::PMPI_Type_get_contents(
            ty,
            ni as c_int,
            na as c_int,
            nd as c_int,
            c.ints.as_mut_ptr(),
            c.addrs.as_mut_ptr(),
            c.types.as_mut_ptr(),
        )
    };
    if rc != consts::SUCCESS() {
        // Nothing was returned: nothing to free.
        c.types.clear();
        return None;
    }
    Some(c)
}

/// [`geometry`] without the cache.
unsafe fn walk(ty: ffi::MPI_Datatype, depth: u32, budget: &mut u64) -> Option<TypeGeometry> {
    // SAFETY: forwarded.
    let mut g = unsafe { bounds(ty)? };
    // SAFETY: forwarded.
    g.run = g.size == 0 || unsafe { is_run(ty, &g, depth, budget) };
    Some(g)
}

/// Whether the data of one element of `ty` (geometry `g`) are one run in type-map order.
unsafe fn is_run(ty: ffi::MPI_Datatype, g: &TypeGeometry, depth: u32, budget: &mut u64) -> bool {
    if depth > MAX_DEPTH {
        return false;
    }
    // SAFETY: forwarded.
    let Some((ni, na, nd, combiner)) = (unsafe { envelope(ty) }) else {
        return false;
    };
    let named = combiner == consts::COMBINER_NAMED()
        || combiner == consts::COMBINER_F90_REAL()
        || combiner == consts::COMBINER_F90_COMPLEX()
        || combiner == consts::COMBINER_F90_INTEGER();
    if named {
        // Predefined types list their parts in increasing address order.
        return g.size == g.true_extent;
    }
    // SAFETY: forwarded.
    let Some(c) = (unsafe { contents(ty, ni, na, nd) }) else {
        return false;
    };
    let Some(&old) = c.types.first() else {
        return false;
    };
    // SAFETY: type handles returned by MPI_Type_get_contents.
    let child = |t: ffi::MPI_Datatype, budget: &mut u64| unsafe { walk(t, depth + 1, budget) };
    let whole = if combiner == consts::COMBINER_DUP() || combiner == consts::COMBINER_RESIZED() {
        return child(old, budget).is_some_and(|o| o.run);
    } else if combiner == consts::COMBINER_SUBARRAY() {
        // Elements in increasing address order, none overlapping (old is not padded): one run
        // exactly when there is no gap.
        return child(old, budget).is_some_and(|o| o.run && o.extent == o.size)
            && g.size == g.true_extent;
    } else if combiner == consts::COMBINER_CONTIGUOUS() {
        let Some(o) = child(old, budget) else {
            return false;
        };
        o.run_of(c.ints.first().copied().unwrap_or(-1) as i64, 0)
    } else if combiner == consts::COMBINER_VECTOR() || combiner == consts::COMBINER_HVECTOR() {
        let Some(o) = child(old, budget) else {
            return false;
        };
        let (count, blocklen) = match c.ints.as_slice() {
            [count, blocklen, ..] => (*count as i64, *blocklen as i64),
            _ => return false,
        };
        let stride_bytes: i128 = if combiner == consts::COMBINER_VECTOR() {
            let Some(&s) = c.ints.get(2) else {
                return false;
            };
            s as i128 * o.extent as i128
        } else {
            let Some(&s) = c.addrs.first() else {
                return false;
            };
            s as i128
        };
        if count < 0 || !spend(budget, count as u64) {
            return false;
        }
        runs_abut((0..count).map(|i| o.run_of(blocklen, i as i128 * stride_bytes)))
    } else if combiner == consts::COMBINER_INDEXED()
        || combiner == consts::COMBINER_HINDEXED()
        || combiner == consts::COMBINER_INDEXED_BLOCK()
        || combiner == consts::COMBINER_HINDEXED_BLOCK()
    {
        let Some(o) = child(old, budget) else {
            return false;
        };
        let Some(blocks) = indexed_blocks(combiner, &c, o.extent) else {
            return false;
        };
        if !spend(budget, blocks.len() as u64) {
            return false;
        }
        runs_abut(blocks.iter().map(|&(bl, at)| o.run_of(bl, at)))
    } else if combiner == consts::COMBINER_STRUCT() {
        let count = c.ints.first().copied().unwrap_or(-1);
        if count < 0
            || c.ints.len() < 1 + count as usize
            || c.addrs.len() < count as usize
            || c.types.len() < count as usize
            || !spend(budget, count as u64)
        {
            return false;
        }
        let mut runs = Vec::with_capacity(count as usize);
        for k in 0..count as usize {
            let Some(o) = child(c.types[k], budget) else {
                return false;
            };
            runs.push(o.run_of(c.ints[1 + k] as i64, c.addrs[k] as i128));
        }
        runs_abut(runs)
    } else {
        // A darray or anything else: packing is always right.
        return false;
    };
    // The one run must be the type's data (it is, for a well-formed type; anything else is
    // packed rather than trusted).
    matches!(whole, Ok(Some((start, len))) if start == g.true_lb as i128 && len == g.size as i128)
}

/// Takes `n` blocks from the walk's budget; false once it is spent.
fn spend(budget: &mut u64, n: u64) -> bool {
    match budget.checked_sub(n) {
        Some(left) => {
            *budget = left;
            true
        }
        None => false,
    }
}

/// The blocks of an (h)indexed(_block) type as `(elements, byte offset)`, in listed order.
fn indexed_blocks(combiner: c_int, c: &Contents, old_extent: i64) -> Option<Vec<(i64, i128)>> {
    let count = *c.ints.first()?;
    if count < 0 {
        return None;
    }
    let n = count as usize;
    let elems = |d: c_int| d as i128 * old_extent as i128;
    if combiner == consts::COMBINER_INDEXED() {
        let (lens, displs) = (c.ints.get(1..1 + n)?, c.ints.get(1 + n..1 + 2 * n)?);
        Some(
            lens.iter()
                .zip(displs)
                .map(|(&l, &d)| (l as i64, elems(d)))
                .collect(),
        )
    } else if combiner == consts::COMBINER_HINDEXED() {
        let (lens, displs) = (c.ints.get(1..1 + n)?, c.addrs.get(..n)?);
        Some(
            lens.iter()
                .zip(displs)
                .map(|(&l, &d)| (l as i64, d as i128))
                .collect(),
        )
    } else if combiner == consts::COMBINER_INDEXED_BLOCK() {
        let (len, displs) = (*c.ints.get(1)?, c.ints.get(2..2 + n)?);
        Some(displs.iter().map(|&d| (len as i64, elems(d))).collect())
    } else {
        let (len, displs) = (*c.ints.get(1)?, c.addrs.get(..n)?);
        Some(displs.iter().map(|&d| (len as i64, d as i128)).collect())
    }
}
