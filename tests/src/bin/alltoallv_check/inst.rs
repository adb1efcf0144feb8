//! One collective instance: what every rank agrees on, the counts, the layouts of the buffers
//! and the model of what must arrive.

use crate::fail::abort;
use crate::rng::{Rng, S_COUNTS, S_RLAYOUT, S_SDATA, S_SLAYOUT};
use crate::types::{CommInfo, Ty};
use mpi_ffi::MPI_Comm;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Ialltoallv,
    Alltoallv,
    Ialltoall,
    Alltoall,
}

impl Kind {
    pub fn is_v(self) -> bool {
        matches!(self, Kind::Ialltoallv | Kind::Alltoallv)
    }

    pub fn is_nonblocking(self) -> bool {
        matches!(self, Kind::Ialltoallv | Kind::Ialltoall)
    }
}

/// Bytes after the last block of every buffer, compared like the rest.
pub const SLACK: usize = 16;

pub fn sentinel(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| 0xA5u8 ^ (i as u8).wrapping_mul(29) ^ (i >> 8) as u8)
        .collect()
}

/// Element displacements for blocks of `counts`: identity, reversed or shuffled peer order,
/// random gaps, a random start; with `allow_overlap`, sometimes all blocks at one place
/// (legal for send buffers only). Returns the displacements and the elements the buffer needs.
pub fn layout(r: &mut Rng, counts: &[i32], allow_overlap: bool) -> (Vec<i32>, usize) {
    let n = counts.len();
    let max = counts.iter().copied().max().unwrap_or(0).max(0) as usize;
    if allow_overlap && r.chance(1, 10) {
        let base = r.below(3) as usize;
        return (vec![base as i32; n], base + max);
    }
    let mut order: Vec<usize> = (0..n).collect();
    match r.below(10) {
        0..=3 => {}
        4..=6 => order.reverse(),
        _ => r.shuffle(&mut order),
    }
    let mut displs = vec![0i32; n];
    let mut pos = r.below(3) as usize;
    for j in order {
        if r.chance(1, 2) {
            pos += r.below(4) as usize;
        }
        displs[j] = i32::try_from(pos).unwrap_or_else(|_| {
            eprintln!("alltoallv_check: displacement overflows int; lower --max-count");
            abort(2)
        });
        pos += counts[j] as usize;
    }
    (displs, pos + r.below(2) as usize)
}

/// What every rank agrees on for one instance.
pub struct Plan {
    pub kind: Kind,
    pub comm: usize,
    pub ty: usize,
}

/// The counts matrix `m[i][j]` = elements comm rank i sends to comm rank j.
pub fn count_matrix(
    seed: u64,
    op: u64,
    inst: u64,
    color: u64,
    n: usize,
    kind: Kind,
    max_count: u64,
) -> Vec<Vec<i32>> {
    let mut r = Rng::derive(&[seed, S_COUNTS, op, inst, color, n as u64]);
    let draw = |r: &mut Rng| {
        if r.chance(1, 4) {
            0
        } else {
            r.range(1, max_count.max(1)) as i32
        }
    };
    if max_count == 0 {
        return vec![vec![0; n]; n];
    }
    if !kind.is_v() {
        let cnt = if r.chance(1, 10) {
            0
        } else {
            r.range(1, max_count) as i32
        };
        return vec![vec![cnt; n]; n];
    }
    let mode = r.below(100);
    if mode < 6 {
        return vec![vec![0; n]; n]; // nothing at all
    }
    let mut m: Vec<Vec<i32>> = (0..n)
        .map(|_| (0..n).map(|_| draw(&mut r)).collect())
        .collect();
    if mode < 20 {
        let s = r.below(n as u64) as usize; // a rank that sends nothing
        m[s].iter_mut().for_each(|x| *x = 0);
    }
    if (14..30).contains(&mode) {
        let d = r.below(n as u64) as usize; // a rank that receives nothing
        m.iter_mut().for_each(|row| row[d] = 0);
    }
    if r.chance(1, 5) {
        (0..n).for_each(|i| m[i][i] = 0); // nothing to self
    }
    m
}

/// Send displacements and send buffer of comm rank `r` (any rank can compute any rank's).
#[allow(clippy::too_many_arguments)]
pub fn send_side(
    seed: u64,
    op: u64,
    inst: u64,
    color: u64,
    r: usize,
    counts: &[i32],
    kind: Kind,
    ty: &Ty,
) -> (Vec<i32>, Vec<u8>) {
    let (displs, elems) = if kind.is_v() {
        layout(
            &mut Rng::derive(&[seed, S_SLAYOUT, op, inst, color, r as u64]),
            counts,
            true,
        )
    } else {
        let cnt = counts.first().copied().unwrap_or(0);
        (
            (0..counts.len()).map(|j| j as i32 * cnt).collect(),
            counts.len() * cnt as usize,
        )
    };
    let mut buf = vec![0u8; elems * ty.extent + SLACK];
    Rng::derive(&[seed, S_SDATA, op, inst, color, r as u64]).fill(&mut buf);
    (displs, buf)
}

pub struct Inst {
    pub plan_idx: usize,
    pub kind: Kind,
    pub comm: MPI_Comm,
    pub comm_name: String,
    pub ty: usize,
    pub me: usize,
    pub n: usize,
    pub scounts: Vec<i32>,
    pub sdispls: Vec<i32>,
    pub rcounts: Vec<i32>,
    pub rdispls: Vec<i32>,
    pub send: Vec<u8>,
    pub send_copy: Vec<u8>,
    pub recv: Vec<u8>,
    pub reference: Vec<u8>,
    pub model: Vec<u8>,
}

#[allow(clippy::too_many_arguments)]
pub fn build_inst(
    seed: u64,
    op: u64,
    idx: usize,
    plan: &Plan,
    ci: &CommInfo,
    types: &[Ty],
    max_count: u64,
    want_model: bool,
) -> Inst {
    let (n, me, inst) = (ci.size, ci.rank, idx as u64);
    let ty = &types[plan.ty];
    let m = count_matrix(seed, op, inst, ci.color, n, plan.kind, max_count);
    let scounts = m[me].clone();
    let rcounts: Vec<i32> = (0..n).map(|j| m[j][me]).collect();
    let (sdispls, send) = send_side(seed, op, inst, ci.color, me, &scounts, plan.kind, ty);
    let (rdispls, relems) = if plan.kind.is_v() {
        layout(
            &mut Rng::derive(&[seed, S_RLAYOUT, op, inst, ci.color, me as u64]),
            &rcounts,
            false,
        )
    } else {
        let cnt = rcounts.first().copied().unwrap_or(0);
        ((0..n).map(|j| j as i32 * cnt).collect(), n * cnt as usize)
    };
    let rlen = relems * ty.extent + SLACK;
    let mut model = sentinel(rlen);
    if want_model {
        for j in 0..n {
            if rcounts[j] == 0 {
                continue;
            }
            let (sd, sbuf) = send_side(seed, op, inst, ci.color, j, &m[j], plan.kind, ty);
            let src = sd[me] as usize * ty.extent;
            let dst = rdispls[j] as usize * ty.extent;
            for e in 0..rcounts[j] as usize {
                for &(o, l) in &ty.segs {
                    let (s0, d0) = (src + e * ty.extent + o, dst + e * ty.extent + o);
                    model[d0..d0 + l].copy_from_slice(&sbuf[s0..s0 + l]);
                }
            }
        }
    }
    Inst {
        plan_idx: idx,
        kind: plan.kind,
        comm: ci.comm,
        comm_name: ci.name.clone(),
        ty: plan.ty,
        me,
        n,
        scounts,
        sdispls,
        rcounts,
        rdispls,
        send_copy: send.clone(),
        send,
        recv: sentinel(rlen),
        reference: sentinel(rlen),
        model,
    }
}
