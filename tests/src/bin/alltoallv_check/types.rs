//! Datatypes and communicators.

use crate::fail::abort;
use crate::rng::Rng;
use integration_tests::splitmix::mix;
use mpi_ffi::consts as c;
use mpi_ffi::{MPI_Comm, MPI_Datatype};
use std::os::raw::c_int;

pub struct Ty {
    pub name: &'static str,
    pub dt: MPI_Datatype,
    pub extent: usize,
    /// (offset, length) of the bytes one element covers, within its extent.
    pub segs: Vec<(usize, usize)>,
    pub derived: bool,
}

pub fn make_types() -> Vec<Ty> {
    let mut contig = c::DATATYPE_NULL();
    mpi!(MPI_Type_contiguous(3, c::INT(), &mut contig));
    mpi!(MPI_Type_commit(&mut contig));
    let mut vector = c::DATATYPE_NULL();
    mpi!(MPI_Type_vector(2, 1, 2, c::INT(), &mut vector));
    mpi!(MPI_Type_commit(&mut vector));
    let types = vec![
        Ty {
            name: "MPI_BYTE",
            dt: c::BYTE(),
            extent: 1,
            segs: vec![(0, 1)],
            derived: false,
        },
        Ty {
            name: "MPI_INT",
            dt: c::INT(),
            extent: 4,
            segs: vec![(0, 4)],
            derived: false,
        },
        Ty {
            name: "MPI_DOUBLE",
            dt: c::DOUBLE(),
            extent: 8,
            segs: vec![(0, 8)],
            derived: false,
        },
        Ty {
            name: "contiguous(3,MPI_INT)",
            dt: contig,
            extent: 12,
            segs: vec![(0, 12)],
            derived: true,
        },
        Ty {
            name: "vector(2,1,2,MPI_INT)",
            dt: vector,
            extent: 12,
            segs: vec![(0, 4), (8, 4)],
            derived: true,
        },
    ];
    // The layouts above are what this program assumes; make sure the library agrees.
    for t in &types {
        let (mut lb, mut extent, mut size) = (0, 0, 0);
        mpi!(MPI_Type_get_extent(t.dt, &mut lb, &mut extent));
        mpi!(MPI_Type_size(t.dt, &mut size));
        let seg_bytes: usize = t.segs.iter().map(|s| s.1).sum();
        if lb != 0 || extent as usize != t.extent || size as usize != seg_bytes {
            eprintln!(
                "alltoallv_check: datatype {} has lb={lb} extent={extent} size={size}, expected 0/{}/{seg_bytes}",
                t.name, t.extent
            );
            abort(4);
        }
    }
    types
}

/// Picks a datatype: BYTE 25%, INT 20%, DOUBLE 20%, contiguous 20%, vector 15%.
pub fn pick_type(r: &mut Rng) -> usize {
    match r.below(100) {
        0..=24 => 0,
        25..=44 => 1,
        45..=64 => 2,
        65..=84 => 3,
        _ => 4,
    }
}

pub struct CommInfo {
    pub name: String,
    pub comm: MPI_Comm,
    pub rank: usize,
    pub size: usize,
    /// Identifies this rank's sub-communicator among those created by the same call (all its
    /// members agree on it), so data streams of different sub-communicators differ.
    pub color: u64,
}

pub fn comm_info(name: String, comm: MPI_Comm, color: u64) -> CommInfo {
    mpi!(MPI_Comm_set_errhandler(comm, c::ERRORS_RETURN()));
    let (mut rank, mut size) = (0, 0);
    mpi!(MPI_Comm_rank(comm, &mut rank));
    mpi!(MPI_Comm_size(comm, &mut size));
    CommInfo {
        name,
        comm,
        rank: rank as usize,
        size: size as usize,
        color,
    }
}

pub fn dup(base: &CommInfo, name: String) -> CommInfo {
    let mut comm = c::COMM_NULL();
    mpi!(MPI_Comm_dup(base.comm, &mut comm));
    comm_info(name, comm, base.color)
}

/// `MPI_Comm_split` of world with colors and keys drawn from `stream` (the same on all ranks).
pub fn split(world: &CommInfo, stream: &[u64], reversed_key: bool, label: &str) -> CommInfo {
    let p = world.size as u64;
    let ncolors = Rng::derive(stream).range(1, p.min(3));
    let color_of = |r: u64| {
        let mut s = stream.to_vec();
        s.push(r);
        Rng::derive(&s).below(ncolors)
    };
    let color = color_of(world.rank as u64);
    let key = if reversed_key {
        (p - world.rank as u64) as c_int
    } else {
        let mut s = stream.to_vec();
        s.extend([u64::MAX, world.rank as u64]);
        Rng::derive(&s).below(1000) as c_int
    };
    let mut comm = c::COMM_NULL();
    mpi!(MPI_Comm_split(world.comm, color as c_int, key, &mut comm));
    let keyname = if reversed_key { "reversed" } else { "random" };
    comm_info(
        format!("{label}(color={color},key={keyname})"),
        comm,
        mix(color ^ mix(stream[stream.len() - 1])),
    )
}

pub fn free_comm(ci: CommInfo) {
    let mut comm = ci.comm;
    mpi!(MPI_Comm_free(&mut comm));
}
