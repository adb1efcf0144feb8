//! The reduction itself: `acc = acc op x`, element by element, on byte slices of one
//! predefined element type (native byte order: the SPs and their hosts share one
//! architecture). A pure function, the same in every SP, so that a fixed order of operands
//! gives the same bytes everywhere.
//!
//! Integer arithmetic wraps (what the C operators of the MPI libraries do in practice);
//! logical operations give 1 or 0 of the element type, as C's `&&`, `||` and `!a != !b`;
//! floating-point `MIN`/`MAX` take the second operand only when it compares smaller (larger).

use serde::{Deserialize, Serialize};

/// A predefined reduction operation of MPI (`MPI_SUM` ... `MPI_BXOR`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Op {
    Sum,
    Prod,
    Min,
    Max,
    Land,
    Lor,
    Lxor,
    Band,
    Bor,
    Bxor,
}

/// A predefined element type, by its representation (the shim maps MPI's C types to these
/// by their size).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Elem {
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    F32,
    F64,
}

/// What an allreduce computes: its operation on its element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Reduce {
    pub op: Op,
    pub elem: Elem,
}

impl Op {
    pub const ALL: [Op; 10] = [
        Op::Sum,
        Op::Prod,
        Op::Min,
        Op::Max,
        Op::Land,
        Op::Lor,
        Op::Lxor,
        Op::Band,
        Op::Bor,
        Op::Bxor,
    ];

    /// A logical or bitwise operation (MPI allows them on integers only).
    pub fn integer_only(self) -> bool {
        !matches!(self, Op::Sum | Op::Prod | Op::Min | Op::Max)
    }
}

impl Elem {
    pub const ALL: [Elem; 10] = [
        Elem::I8,
        Elem::I16,
        Elem::I32,
        Elem::I64,
        Elem::U8,
        Elem::U16,
        Elem::U32,
        Elem::U64,
        Elem::F32,
        Elem::F64,
    ];

    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            Elem::I8 | Elem::U8 => 1,
            Elem::I16 | Elem::U16 => 2,
            Elem::I32 | Elem::U32 | Elem::F32 => 4,
            Elem::I64 | Elem::U64 | Elem::F64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, Elem::F32 | Elem::F64)
    }
}

impl Reduce {
    /// A combination MPI defines (no logical or bitwise operation on floating point).
    pub fn is_valid(self) -> bool {
        !(self.elem.is_float() && self.op.integer_only())
    }
}

/// The reduction of two slices of the same length failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceError {
    /// The slices differ in length, or are not whole elements.
    Length { acc: usize, x: usize },
    /// A logical or bitwise operation on floating point.
    Invalid(Reduce),
}

impl core::fmt::Display for ReduceError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            ReduceError::Length { acc, x } => {
                write!(f, "reduce {x} bytes into {acc}: not whole equal elements")
            }
            ReduceError::Invalid(r) => write!(f, "{:?} is not defined on {:?}", r.op, r.elem),
        }
    }
}

macro_rules! int_op {
    ($t:ty, $op:expr, $acc:expr, $x:expr) => {{
        const N: usize = std::mem::size_of::<$t>();
        for (a, b) in $acc.chunks_exact_mut(N).zip($x.chunks_exact(N)) {
            let l = <$t>::from_ne_bytes(a.try_into().unwrap());
            let r = <$t>::from_ne_bytes(b.try_into().unwrap());
            let v: $t = match $op {
                Op::Sum => l.wrapping_add(r),
                Op::Prod => l.wrapping_mul(r),
                Op::Min => l.min(r),
                Op::Max => l.max(r),
                Op::Land => <$t>::from(l != 0 && r != 0),
                Op::Lor => <$t>::from(l != 0 || r != 0),
                Op::Lxor => <$t>::from((l != 0) != (r != 0)),
                Op::Band => l & r,
                Op::Bor => l | r,
                Op::Bxor => l ^ r,
            };
            a.copy_from_slice(&v.to_ne_bytes());
        }
    }};
}

macro_rules! float_op {
    ($t:ty, $op:expr, $acc:expr, $x:expr) => {{
        const N: usize = std::mem::size_of::<$t>();
        for (a, b) in $acc.chunks_exact_mut(N).zip($x.chunks_exact(N)) {
            let l = <$t>::from_ne_bytes(a.try_into().unwrap());
            let r = <$t>::from_ne_bytes(b.try_into().unwrap());
            let v: $t = match $op {
                Op::Sum => l + r,
                Op::Prod => l * r,
                Op::Min => {
                    if r < l {
                        r
                    } else {
                        l
                    }
                }
                Op::Max => {
                    if r > l {
                        r
                    } else {
                        l
                    }
                }
                _ => unreachable!("checked by is_valid"),
            };
            a.copy_from_slice(&v.to_ne_bytes());
        }
    }};
}

/// `acc[i] = acc[i] op x[i]` for every element `i` of `r.elem`.
pub fn reduce_into(r: Reduce, acc: &mut [u8], x: &[u8]) -> Result<(), ReduceError> {
    if acc.len() != x.len() || !acc.len().is_multiple_of(r.elem.size()) {
        return Err(ReduceError::Length {
            acc: acc.len(),
            x: x.len(),
        });
    }
    if !r.is_valid() {
        return Err(ReduceError::Invalid(r));
    }
    let op = r.op;
    match r.elem {
        Elem::I8 => int_op!(i8, op, acc, x),
        Elem::I16 => int_op!(i16, op, acc, x),
        Elem::I32 => int_op!(i32, op, acc, x),
        Elem::I64 => int_op!(i64, op, acc, x),
        Elem::U8 => int_op!(u8, op, acc, x),
        Elem::U16 => int_op!(u16, op, acc, x),
        Elem::U32 => int_op!(u32, op, acc, x),
        Elem::U64 => int_op!(u64, op, acc, x),
        Elem::F32 => float_op!(f32, op, acc, x),
        Elem::F64 => float_op!(f64, op, acc, x),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::rng::Rng;

    /// The reference: each element decoded to a wide value and combined by the textbook
    /// definition of the operation.
    fn reference(r: Reduce, a: &[u8], b: &[u8]) -> Vec<u8> {
        let n = r.elem.size();
        let mut out = Vec::new();
        for (x, y) in a.chunks(n).zip(b.chunks(n)) {
            if r.elem.is_float() {
                let (l, rr) = match r.elem {
                    Elem::F32 => (
                        f32::from_ne_bytes(x.try_into().unwrap()) as f64,
                        f32::from_ne_bytes(y.try_into().unwrap()) as f64,
                    ),
                    _ => (
                        f64::from_ne_bytes(x.try_into().unwrap()),
                        f64::from_ne_bytes(y.try_into().unwrap()),
                    ),
                };
                let v = match r.op {
                    Op::Sum => l + rr,
                    Op::Prod => l * rr,
                    Op::Min => l.min(rr),
                    Op::Max => l.max(rr),
                    _ => unreachable!(),
                };
                // One rounding from the exact f64 result of two f32 (exact for sum and
                // product of two f32 in f64), as f32 arithmetic rounds once.
                match r.elem {
                    Elem::F32 => out.extend_from_slice(&(v as f32).to_ne_bytes()),
                    _ => out.extend_from_slice(&v.to_ne_bytes()),
                }
                continue;
            }
            // Integers as i128 from their bytes, signed or not.
            let signed = matches!(r.elem, Elem::I8 | Elem::I16 | Elem::I32 | Elem::I64);
            let dec = |s: &[u8]| -> i128 {
                let mut w = [0u8; 16];
                w[..n].copy_from_slice(s);
                if signed && s[n - 1] & 0x80 != 0 {
                    w[n..].fill(0xff);
                }
                i128::from_le_bytes(w)
            };
            let (l, rr) = (dec(x), dec(y));
            let t = |b: bool| i128::from(b);
            let v = match r.op {
                Op::Sum => l + rr,
                Op::Prod => l.wrapping_mul(rr),
                Op::Min => l.min(rr),
                Op::Max => l.max(rr),
                Op::Land => t(l != 0 && rr != 0),
                Op::Lor => t(l != 0 || rr != 0),
                Op::Lxor => t((l != 0) != (rr != 0)),
                Op::Band => l & rr,
                Op::Bor => l | rr,
                Op::Bxor => l ^ rr,
            };
            // Truncated to n bytes: the wrapping result.
            out.extend_from_slice(&v.to_le_bytes()[..n]);
        }
        out
    }

    /// Random bytes of `n` elements; floats finite and moderate (from small integers
    /// scaled), integers with many zeros so that logical operations see both truths.
    fn random(rng: &mut Rng, e: Elem, n: usize) -> Vec<u8> {
        let mut v = Vec::new();
        for _ in 0..n {
            match e {
                Elem::F32 => {
                    v.extend_from_slice(&((rng.below(2001) as f32 - 1000.0) / 64.0).to_ne_bytes())
                }
                Elem::F64 => v.extend_from_slice(
                    &((rng.below(2_000_001) as f64 - 1e6) / 1024.0).to_ne_bytes(),
                ),
                _ => {
                    let x = if rng.chance(1, 4) { 0 } else { rng.next_u64() };
                    v.extend_from_slice(&x.to_le_bytes()[..e.size()]);
                }
            }
        }
        v
    }

    /// Every operation on every type it is defined on, against the reference, with random
    /// inputs: the same bytes.
    #[test]
    fn every_op_and_type_matches_the_reference() {
        let seed = 0x5eed_a11d ^ std::process::id() as u64;
        println!("seed {seed:#x}");
        let mut rng = Rng::new(seed);
        for elem in Elem::ALL {
            for op in Op::ALL {
                let r = Reduce { op, elem };
                for _ in 0..20 {
                    let n = rng.below(40) as usize;
                    let a = random(&mut rng, elem, n);
                    let b = random(&mut rng, elem, n);
                    let mut acc = a.clone();
                    let got = reduce_into(r, &mut acc, &b);
                    if !r.is_valid() {
                        assert_eq!(got, Err(ReduceError::Invalid(r)), "seed {seed:#x}");
                        continue;
                    }
                    got.unwrap();
                    assert_eq!(acc, reference(r, &a, &b), "{r:?} seed {seed:#x}");
                }
            }
        }
    }

    /// Slices of different lengths or of partial elements are refused, untouched.
    #[test]
    fn partial_or_unequal_slices_are_refused() {
        let r = Reduce {
            op: Op::Sum,
            elem: Elem::I32,
        };
        let mut acc = vec![1u8; 8];
        assert!(reduce_into(r, &mut acc, &[0u8; 4]).is_err());
        let mut acc6 = vec![1u8; 6];
        assert!(reduce_into(r, &mut acc6, &[0u8; 6]).is_err());
        assert_eq!(acc, vec![1u8; 8]);
    }
}
