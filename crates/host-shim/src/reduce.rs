//! The offloaded allreduce's choices: whether `MPI_Allreduce`/`MPI_Iallreduce` go to the SPs
//! (`SPOFF_ALLREDUCE_DESIGN`), and which reduction (`algorithms::allreduce::Reduce`) an MPI
//! datatype and operation are.
//!
//! `SPOFF_ALLREDUCE_DESIGN`: unset or `native` keeps the native call; `sp-tree` posts the
//! SP-tree allreduce (`CollKind::Allreduce`: the SPs reduce along a tree, the root's SP
//! broadcasts); `canary` posts the Canary allreduce (`CollKind::CanaryAllreduce`: each SP
//! reduces its ranks' blocks and the Canary switches of the cluster description combine the
//! SPs'); `auto` is `canary` where the cluster has Canary switches, else `sp-tree`. Canary is
//! taken only if every rank asks for it (`canary` or `auto`) and every rank's SP runs it
//! (agreed at `MPI_Init`, [`agree_canary`]); otherwise the SP tree runs, and rank 0 says why
//! once when `canary` was asked for by name. Anything else keeps the native call, said once.
//! Read once; the same on every rank of a correct job, as is everything else that decides:
//! the datatype, the operation, the count and the communicator.
//!
//! Offloaded: the predefined operations `MPI_SUM`, `MPI_PROD`, `MPI_MIN`, `MPI_MAX`,
//! `MPI_LAND`, `MPI_LOR`, `MPI_LXOR`, `MPI_BAND`, `MPI_BOR`, `MPI_BXOR` on the predefined C
//! integer types (`MPI_SIGNED_CHAR`, `MPI_UNSIGNED_CHAR`, `MPI_SHORT`, `MPI_UNSIGNED_SHORT`,
//! `MPI_INT`, `MPI_UNSIGNED`, `MPI_LONG`, `MPI_UNSIGNED_LONG`, `MPI_LONG_LONG`,
//! `MPI_UNSIGNED_LONG_LONG`, `MPI_INT8_T` ... `MPI_UINT64_T`, by their size) and `MPI_FLOAT`,
//! `MPI_DOUBLE`, and from Fortran `MPI_INTEGER`, `MPI_INTEGER4`, `MPI_INTEGER8`, `MPI_REAL`,
//! `MPI_REAL4`, `MPI_REAL8`, `MPI_DOUBLE_PRECISION` (arithmetic and min/max only on floating
//! point: logical and bitwise operations there are not MPI), up to `allreduce::MAX_BYTES` per
//! call. Anything else (user operations,
//! `MPI_MINLOC`/`MPI_MAXLOC`, other or derived types, `MPI_BYTE`, `MPI_CHAR`, `MPI_LOGICAL`,
//! larger messages) runs natively.

use crate::boundary::say;
use algorithms::allreduce::{Elem, Op, Reduce, MAX_BYTES};
use bootstrap::wire::CollKind;
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::c_int;

/// What `SPOFF_ALLREDUCE_DESIGN` asks for on this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asked {
    Native,
    SpTree,
    Canary,
    Auto,
}

/// `SPOFF_ALLREDUCE_DESIGN` on this rank (read once).
pub fn asked() -> Asked {
    static ASKED: std::sync::OnceLock<Asked> = std::sync::OnceLock::new();
    *ASKED.get_or_init(|| {
        let v = std::env::var("SPOFF_ALLREDUCE_DESIGN").ok();
        match v.as_deref().map(str::trim) {
            None | Some("") | Some("native") => Asked::Native,
            Some("sp-tree") => Asked::SpTree,
            Some("canary") => Asked::Canary,
            Some("auto") => Asked::Auto,
            Some(other) => {
                say!("SPOFF_ALLREDUCE_DESIGN={other}: not a design here (native, sp-tree, canary, auto); the native MPI_Allreduce runs");
                Asked::Native
            }
        }
    })
}

/// The job agreed on the Canary design at `MPI_Init` ([`agree_canary`]).
static CANARY_ON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The kind an eligible `MPI_Allreduce`/`MPI_Iallreduce` posts, `None` for the native call.
pub fn allreduce_kind() -> Option<CollKind> {
    match asked() {
        Asked::Native => None,
        _ if CANARY_ON.load(std::sync::atomic::Ordering::Acquire) => {
            Some(CollKind::CanaryAllreduce)
        }
        _ => Some(CollKind::Allreduce),
    }
}

/// Whether the job takes the Canary design: asked for (`canary` or `auto`) on some rank, it
/// is on only if every rank asks for it and every rank's SP runs it (`canary_off`: why this
/// rank's does not); else, when some rank named `canary`, rank 0 says why, once. Collective.
///
/// # Safety
/// MPI is initialised.
pub unsafe fn agree_canary(canary_off: Option<&str>, rank: u32, size: u32) {
    let me = asked();
    let wants = matches!(me, Asked::Canary | Asked::Auto);
    // [ranks asking, ranks naming `canary`]
    let mut asking: [c_int; 2] = [wants as c_int, (me == Asked::Canary) as c_int];
    // SAFETY: in-place reduction over two ints.
    let rc = unsafe {
        ffi::PMPI_Allreduce(
            consts::IN_PLACE(),
            asking.as_mut_ptr().cast(),
            2,
            consts::INT(),
            consts::OP_SUM(),
            consts::COMM_WORLD(),
        )
    };
    if rc != consts::SUCCESS() || asking[0] == 0 {
        return;
    }
    let named = asking[1] > 0;
    let mine = if !wants {
        Some(format!("SPOFF_ALLREDUCE_DESIGN is {me:?} there"))
    } else {
        canary_off.map(|why| format!("its SP runs no Canary allreduce: {why}"))
    };
    // SAFETY: forwarded; every rank calls it, as every rank saw `asking[0] > 0`.
    match unsafe { crate::lifecycle::count_failures(mine.as_deref(), rank) } {
        Ok(None) => CANARY_ON.store(true, std::sync::atomic::Ordering::Release),
        Ok(Some((n, first, why))) => {
            if rank == 0 && named {
                say!(
                    "SPOFF_ALLREDUCE_DESIGN=canary: {n} of {size} ranks cannot take the Canary \
                     design (rank {first}: {why}); every allreduce of this job takes the SP tree"
                );
            }
        }
        Err(rc) => {
            if rank == 0 && named {
                say!(
                    "SPOFF_ALLREDUCE_DESIGN=canary: the ranks could not agree (MPI error {rc}); \
                     every allreduce of this job takes the SP tree"
                );
            }
        }
    }
}

/// How a predefined datatype's elements are represented.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Signed,
    Unsigned,
    Float,
}

fn class_of(ty: ffi::MPI_Datatype) -> Option<Class> {
    // MPICH names optional Fortran types it lacks MPI_DATATYPE_NULL.
    if ty == consts::DATATYPE_NULL() {
        return None;
    }
    let signed = [
        consts::INTEGER(),
        consts::INTEGER4(),
        consts::INTEGER8(),
        consts::SIGNED_CHAR(),
        consts::SHORT(),
        consts::INT(),
        consts::LONG(),
        consts::LONG_LONG(),
        consts::INT8_T(),
        consts::INT16_T(),
        consts::INT32_T(),
        consts::INT64_T(),
    ];
    let unsigned = [
        consts::UNSIGNED_CHAR(),
        consts::UNSIGNED_SHORT(),
        consts::UNSIGNED(),
        consts::UNSIGNED_LONG(),
        consts::UNSIGNED_LONG_LONG(),
        consts::UINT8_T(),
        consts::UINT16_T(),
        consts::UINT32_T(),
        consts::UINT64_T(),
    ];
    if signed.contains(&ty) {
        Some(Class::Signed)
    } else if unsigned.contains(&ty) {
        Some(Class::Unsigned)
    } else if [
        consts::FLOAT(),
        consts::DOUBLE(),
        consts::REAL(),
        consts::REAL4(),
        consts::REAL8(),
        consts::DOUBLE_PRECISION(),
    ]
    .contains(&ty)
    {
        Some(Class::Float)
    } else {
        None
    }
}

fn op_of(op: ffi::MPI_Op) -> Option<Op> {
    let table = [
        (consts::OP_SUM(), Op::Sum),
        (consts::OP_PROD(), Op::Prod),
        (consts::OP_MIN(), Op::Min),
        (consts::OP_MAX(), Op::Max),
        (consts::OP_LAND(), Op::Land),
        (consts::OP_LOR(), Op::Lor),
        (consts::OP_LXOR(), Op::Lxor),
        (consts::OP_BAND(), Op::Band),
        (consts::OP_BOR(), Op::Bor),
        (consts::OP_BXOR(), Op::Bxor),
    ];
    table.iter().find(|(h, _)| *h == op).map(|&(_, o)| o)
}

fn elem_of(class: Class, size: usize) -> Option<Elem> {
    Some(match (class, size) {
        (Class::Signed, 1) => Elem::I8,
        (Class::Signed, 2) => Elem::I16,
        (Class::Signed, 4) => Elem::I32,
        (Class::Signed, 8) => Elem::I64,
        (Class::Unsigned, 1) => Elem::U8,
        (Class::Unsigned, 2) => Elem::U16,
        (Class::Unsigned, 4) => Elem::U32,
        (Class::Unsigned, 8) => Elem::U64,
        (Class::Float, 4) => Elem::F32,
        (Class::Float, 8) => Elem::F64,
        _ => return None,
    })
}

/// The reduction of `count` elements of `ty` by `op`, if the SPs do it (see the module's
/// list; at most `MAX_BYTES`).
///
/// # Safety
/// MPI is initialised.
pub unsafe fn reduction(ty: ffi::MPI_Datatype, op: ffi::MPI_Op, count: c_int) -> Option<Reduce> {
    let class = class_of(ty)?;
    let op = op_of(op)?;
    let mut size: c_int = 0;
    // SAFETY: a predefined datatype and a valid out-pointer.
    if unsafe { ffi::PMPI_Type_size(ty, &mut size) } != consts::SUCCESS() {
        return None;
    }
    let r = Reduce {
        op,
        elem: elem_of(class, usize::try_from(size).ok()?)?,
    };
    let bytes = u64::try_from(count)
        .ok()?
        .checked_mul(r.elem.size() as u64)?;
    (r.is_valid() && bytes <= MAX_BYTES).then_some(r)
}
