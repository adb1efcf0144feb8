//! The compute of `coll-bench fft`, with no MPI: complex numbers, a mixed-radix 1D FFT of any
//! length, the slab decomposition of an N^3 grid over P ranks, the seeded input and a direct
//! 3D DFT of single points to check the result independently of the FFT and of the transpose.

use std::ops::{Add, Mul, Sub};

/// A complex number of two doubles, laid out as (re, im).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct C64 {
    pub re: f64,
    pub im: f64,
}

impl Add for C64 {
    type Output = C64;
    fn add(self, o: C64) -> C64 {
        C64 {
            re: self.re + o.re,
            im: self.im + o.im,
        }
    }
}

impl Sub for C64 {
    type Output = C64;
    fn sub(self, o: C64) -> C64 {
        C64 {
            re: self.re - o.re,
            im: self.im - o.im,
        }
    }
}

impl Mul for C64 {
    type Output = C64;
    fn mul(self, o: C64) -> C64 {
        C64 {
            re: self.re * o.re - self.im * o.im,
            im: self.re * o.im + self.im * o.re,
        }
    }
}

impl C64 {
    pub fn abs(self) -> f64 {
        self.re.hypot(self.im)
    }
}

/// The bytes of a slice of complex numbers (what MPI moves).
pub fn as_bytes(v: &[C64]) -> &[u8] {
    // SAFETY: C64 is two f64 with no padding (repr(C)); u8 has alignment 1; same lifetime.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

/// The bytes of a mutable slice of complex numbers.
pub fn as_bytes_mut(v: &mut [C64]) -> &mut [u8] {
    // SAFETY: as above, and every bit pattern is a valid f64, so writes through the bytes
    // cannot make an invalid C64.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

/// A forward DFT of length `n` (`X[k] = sum_j x[j] e^{-2 pi i jk/n}`), computed as a recursive
/// mixed-radix Cooley-Tukey FFT over the prime factors of `n` (O(n * sum of the factors): a
/// radix-2 FFT for powers of two, a direct DFT for a prime length).
pub struct Fft {
    n: usize,
    /// `w[j] = e^{-2 pi i j / n}`.
    w: Vec<C64>,
    factors: Vec<usize>,
}

impl Fft {
    pub fn new(n: usize) -> Fft {
        assert!(n > 0, "an FFT of length 0");
        let w = (0..n)
            .map(|j| {
                let a = -2.0 * std::f64::consts::PI * j as f64 / n as f64;
                C64 {
                    re: a.cos(),
                    im: a.sin(),
                }
            })
            .collect();
        let mut factors = Vec::new();
        let mut m = n;
        let mut p = 2;
        while m > 1 {
            while m.is_multiple_of(p) {
                factors.push(p);
                m /= p;
            }
            p += 1;
        }
        Fft { n, w, factors }
    }

    /// The transform's length.
    pub fn points(&self) -> usize {
        self.n
    }

    /// `e^{-2 pi i e / n}`.
    pub fn twiddle(&self, e: usize) -> C64 {
        self.w[e % self.n]
    }

    /// Transforms `line` (length n) in place; `scratch` is resized as needed.
    pub fn run(&self, line: &mut [C64], scratch: &mut Vec<C64>) {
        assert_eq!(line.len(), self.n);
        scratch.clear();
        scratch.extend_from_slice(line);
        self.rec(scratch, 0, 1, line, 1, &self.factors);
    }

    /// `out` (length `n / tw_stride`) = DFT of `input[at], input[at + stride], ...`.
    fn rec(
        &self,
        input: &[C64],
        at: usize,
        stride: usize,
        out: &mut [C64],
        tw_stride: usize,
        factors: &[usize],
    ) {
        let n = out.len();
        let Some((&p, rest)) = factors.split_first() else {
            out[0] = input[at];
            return;
        };
        let m = n / p;
        if m == 1 && p == 2 {
            let (a, b) = (input[at], input[at + stride]);
            out[0] = a + b;
            out[1] = a - b;
            return;
        }
        for q in 0..p {
            self.rec(
                input,
                at + q * stride,
                stride * p,
                &mut out[q * m..(q + 1) * m],
                tw_stride * p,
                rest,
            );
        }
        // out[q * m + k] holds Y_q[k]; X[k + m s] = sum_q W_n^{q (k + m s)} Y_q[k].
        if p == 2 {
            // The radix-2 butterfly (W_n^{m} = -1); k * tw_stride < the table's length.
            let (lo, hi) = out.split_at_mut(m);
            for (k, (a, b)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
                let t = *b * self.w[k * tw_stride];
                (*a, *b) = (*a + t, *a - t);
            }
            return;
        }
        let mut y = [C64::default(); 64];
        let mut big = Vec::new();
        let y: &mut [C64] = if p <= 64 {
            &mut y[..p]
        } else {
            big.resize(p, C64::default());
            &mut big
        };
        for k in 0..m {
            for q in 0..p {
                y[q] = out[q * m + k] * self.twiddle(q * k * tw_stride);
            }
            for s in 0..p {
                let mut acc = C64::default();
                for (q, &yq) in y.iter().enumerate() {
                    acc = acc + yq * self.twiddle(q * s * m * tw_stride);
                }
                out[k + m * s] = acc;
            }
        }
    }
}

/// The slab of `n` planes owned by `rank` of `ranks`: blocks of ceil(n / ranks) planes, so the
/// last ranks own fewer planes, or none when ranks * ceil(n / ranks) - n >= ceil(n / ranks)
/// (e.g. n = 4 on 3 ranks: 2, 2, 0). Returns (first plane, planes).
pub fn slab(n: usize, ranks: usize, rank: usize) -> (usize, usize) {
    let b = n.div_ceil(ranks.max(1));
    let lo = (rank * b).min(n);
    let hi = ((rank + 1) * b).min(n);
    (lo, hi - lo)
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The input value of field `f` at (x, y, z) of an n^3 grid, from `seed`: re and im uniform in
/// [-1, 1).
pub fn input(seed: u64, f: usize, n: usize, (x, y, z): (usize, usize, usize)) -> C64 {
    let i = ((f * n + x) * n + y) * n + z;
    let v = mix(mix(seed) ^ i as u64);
    let unit = |b: u64| (b >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
    C64 {
        re: unit(v),
        im: unit(mix(v)),
    }
}

/// Point (kx, ky, kz) of the 3D DFT of field `f`, summed directly over the n^3 inputs.
pub fn dft_point(seed: u64, f: usize, fft: &Fft, (kx, ky, kz): (usize, usize, usize)) -> C64 {
    let n = fft.points();
    let mut acc = C64::default();
    for x in 0..n {
        for y in 0..n {
            let e = kx * x + ky * y;
            for z in 0..n {
                acc = acc + input(seed, f, n, (x, y, z)) * fft.twiddle(e + kz * z);
            }
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[C64]) -> Vec<C64> {
        let n = x.len();
        let f = Fft::new(n);
        (0..n)
            .map(|k| {
                x.iter()
                    .enumerate()
                    .fold(C64::default(), |a, (j, &v)| a + v * f.twiddle(j * k))
            })
            .collect()
    }

    #[test]
    fn fft_matches_the_direct_dft_for_mixed_lengths() {
        for n in [1, 2, 3, 4, 5, 6, 7, 8, 12, 15, 16, 63, 64, 97, 100] {
            let x: Vec<C64> = (0..n).map(|i| input(7, 0, n, (0, 0, i))).collect();
            let want = naive(&x);
            let mut got = x.clone();
            Fft::new(n).run(&mut got, &mut Vec::new());
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (*g - *w).abs() < 1e-9 * n as f64,
                    "n={n} k={k}: {g:?} vs {w:?}"
                );
            }
        }
    }

    #[test]
    fn slabs_cover_the_grid_with_uneven_and_empty_slabs() {
        assert_eq!(
            (0..3).map(|r| slab(4, 3, r)).collect::<Vec<_>>(),
            [(0, 2), (2, 2), (4, 0)]
        );
        assert_eq!(slab(7, 2, 0), (0, 4));
        assert_eq!(slab(7, 2, 1), (4, 3));
        assert_eq!(slab(1, 2, 1), (1, 0));
        for n in 1..20 {
            for p in 1..6 {
                let total: usize = (0..p).map(|r| slab(n, p, r).1).sum();
                assert_eq!(total, n);
            }
        }
    }
}
