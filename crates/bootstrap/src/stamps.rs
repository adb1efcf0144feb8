//! Where an offloaded call's time goes: per-stage timestamps of one call, and a histogram per
//! stage.
//!
//! A call is stamped (CLOCK_MONOTONIC, ns) at seven points: the rank sends its post (`sent`,
//! shim); the SP reads it (`seen`); the SP has checked it and fed it to the instance (`ready`);
//! the instance's first copy is issued (`first_copy`) and its last one is done (`last_copy`);
//! the SP starts writing the completion (`written`); the rank sees it (`noticed`, shim). The SP
//! writes its five stamps into the completion's mailbox slot with the status, in the same write
//! ([`crate::mailbox`]), so the hot path gains no syscall; the rank reads them once the token
//! is there. A rank and an SP on one kernel share the clock, so every stage is a difference of
//! two stamps; across machines only the per-side stages are meaningful (the shim then records
//! the SP's stages and the total, not `post` and `notice`).
//!
//! The stages are the differences of consecutive stamps, in this order ([`STAGES`]), and their
//! sum, `total`. A call without a copy (nothing to move) has `first_copy == last_copy ==
//! ready`. A call whose stamps are missing (0) or out of order is not recorded and counted as
//! `disordered`: a stage that went missing shows there.

/// The stages' names, in call order, then the total.
pub const STAGES: [&str; 7] = [
    "post", "accept", "issue", "copy", "complete", "notice", "total",
];
pub const POST: usize = 0;
pub const NOTICE: usize = 5;
pub const TOTAL: usize = 6;

/// CLOCK_MONOTONIC now, in ns (a vDSO read: tens of ns).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `ts` is.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The SP's stamps of one call, as the completion's slot carries them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpStamps {
    pub seen: u64,
    pub ready: u64,
    pub first_copy: u64,
    pub last_copy: u64,
    pub written: u64,
}

impl SpStamps {
    pub const BYTES: usize = 40;

    pub fn to_bytes(self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        for (i, v) in [
            self.seen,
            self.ready,
            self.first_copy,
            self.last_copy,
            self.written,
        ]
        .into_iter()
        .enumerate()
        {
            b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    pub fn from_words(w: [u64; 5]) -> Self {
        SpStamps {
            seen: w[0],
            ready: w[1],
            first_copy: w[2],
            last_copy: w[3],
            written: w[4],
        }
    }

    /// The SP's own stages (`accept`, `issue`, `copy`, `complete`), if its stamps are all
    /// there and in order; a call without copies has them at `ready`.
    pub fn sp_stages(&self) -> Option<[u64; 4]> {
        let (first, last) = if self.first_copy == 0 && self.last_copy == 0 {
            (self.ready, self.ready)
        } else {
            (self.first_copy, self.last_copy)
        };
        let t = [self.seen, self.ready, first, last, self.written];
        if t[0] == 0 || t.windows(2).any(|w| w[1] < w[0]) {
            return None;
        }
        Some([t[1] - t[0], t[2] - t[1], t[3] - t[2], t[4] - t[3]])
    }
}

/// Every stage of a call (indexed as [`STAGES`]) from the rank's stamps and the SP's;
/// `same_clock`: the rank and the SP share a kernel (else `post` and `notice` are `None`,
/// and `total` is the rank's own). `None`: a stamp is missing or out of order.
pub fn stages(
    sent: u64,
    sp: &SpStamps,
    noticed: u64,
    same_clock: bool,
) -> Option<[Option<u64>; 7]> {
    let inner = sp.sp_stages()?;
    if sent == 0 || noticed < sent {
        return None;
    }
    let (post, notice) = if same_clock {
        if sp.seen < sent || noticed < sp.written {
            return None;
        }
        (Some(sp.seen - sent), Some(noticed - sp.written))
    } else {
        (None, None)
    };
    Some([
        post,
        Some(inner[0]),
        Some(inner[1]),
        Some(inner[2]),
        Some(inner[3]),
        notice,
        Some(noticed - sent),
    ])
}

/// Linear buckets of [`Hist`] (100 ns each, up to 100 µs), then eight per power of two from
/// 2^16 ns (65 µs) to 2^48 ns.
const LINEAR: usize = 1000;
const LINEAR_NS: u64 = 100;
const FIRST_OCTAVE: usize = 16;
const LOG: usize = (48 - FIRST_OCTAVE) * 8;

/// A histogram of durations (ns): 100 ns resolution up to 100 µs, 1/8 of a power of two above
/// (within 12 %).
#[derive(Clone, Debug)]
pub struct Hist {
    linear: Box<[u32; LINEAR]>,
    log: [u32; LOG],
    n: u64,
}

impl Default for Hist {
    fn default() -> Self {
        Hist {
            linear: Box::new([0; LINEAR]),
            log: [0; LOG],
            n: 0,
        }
    }
}

impl Hist {
    pub fn add(&mut self, ns: u64) {
        self.n += 1;
        let b = (ns / LINEAR_NS) as usize;
        if b < LINEAR {
            self.linear[b] = self.linear[b].saturating_add(1);
        } else {
            let octave = 63 - ns.leading_zeros() as usize;
            let sub = ((ns >> (octave - 3)) & 7) as usize;
            let l = ((octave - FIRST_OCTAVE) * 8 + sub).min(LOG - 1);
            self.log[l] = self.log[l].saturating_add(1);
        }
    }

    pub fn count(&self) -> u64 {
        self.n
    }

    /// The `p`-th percentile (0..=100) in ns: the upper edge of its bucket (0 when empty).
    pub fn percentile(&self, p: f64) -> u64 {
        if self.n == 0 {
            return 0;
        }
        let want = ((p / 100.0) * self.n as f64).ceil().max(1.0) as u64;
        let mut seen = 0u64;
        for (i, &c) in self.linear.iter().enumerate() {
            seen += c as u64;
            if seen >= want {
                return (i as u64 + 1) * LINEAR_NS;
            }
        }
        for (l, &c) in self.log.iter().enumerate() {
            seen += c as u64;
            if seen >= want {
                let (octave, sub) = (l / 8 + FIRST_OCTAVE, (l % 8) as u64);
                return (9 + sub) << (octave - 3);
            }
        }
        u64::MAX
    }
}

/// A histogram per stage, and the calls whose stamps were missing or out of order.
#[derive(Clone, Debug, Default)]
pub struct Breakdown {
    pub stages: [Hist; 7],
    pub disordered: u64,
}

impl Breakdown {
    /// Records one call's stages (see [`stages`]); `None` counts as disordered.
    pub fn record(&mut self, stages: Option<[Option<u64>; 7]>) {
        match stages {
            Some(s) => {
                for (h, v) in self.stages.iter_mut().zip(s) {
                    if let Some(v) = v {
                        h.add(v);
                    }
                }
            }
            None => self.disordered += 1,
        }
    }

    /// As JSON: per stage `{n, p50_us, p99_us}`, and `disordered`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for (name, h) in STAGES.iter().zip(&self.stages) {
            m.insert(
                name.to_string(),
                serde_json::json!({
                    "n": h.count(),
                    "p50_us": h.percentile(50.0) as f64 / 1000.0,
                    "p99_us": h.percentile(99.0) as f64 / 1000.0,
                }),
            );
        }
        m.insert("disordered".into(), self.disordered.into());
        serde_json::Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_are_the_differences_and_a_disorder_is_caught() {
        let sp = SpStamps {
            seen: 110,
            ready: 120,
            first_copy: 125,
            last_copy: 200,
            written: 210,
        };
        let s = stages(100, &sp, 230, true).unwrap();
        let v: Vec<u64> = s.iter().map(|x| x.unwrap()).collect();
        assert_eq!(v, [10, 10, 5, 75, 10, 20, 130]);
        assert_eq!(v[..6].iter().sum::<u64>(), v[TOTAL]);
        // Across machines: only the per-side stages.
        let s = stages(100, &sp, 230, false).unwrap();
        assert!(s[POST].is_none() && s[NOTICE].is_none() && s[TOTAL] == Some(130));
        // No copy: the copy stages are empty.
        let none = SpStamps {
            first_copy: 0,
            last_copy: 0,
            ..sp
        };
        assert_eq!(stages(100, &none, 230, true).unwrap()[3], Some(0));
        // A stamp lost, or out of order.
        assert!(stages(100, &SpStamps { seen: 0, ..sp }, 230, true).is_none());
        assert!(stages(100, &SpStamps { ready: 300, ..sp }, 400, true).is_none());
        assert!(stages(115, &sp, 230, true).is_none(), "seen before sent");
        let mut b = Breakdown::default();
        b.record(None);
        assert_eq!(b.disordered, 1);
    }

    #[test]
    fn percentiles_come_from_the_buckets() {
        let mut h = Hist::default();
        for ns in 1..=100u64 {
            h.add(ns * 1000);
        }
        assert_eq!(h.percentile(50.0), 50_100);
        assert_eq!(h.percentile(99.0), 99_100);
        h.add(1 << 30);
        assert_eq!(
            h.percentile(100.0),
            9 << 27,
            "the upper edge of 2^30's bucket"
        );
        let mut h = Hist::default();
        h.add(1_048_576);
        let p = h.percentile(50.0);
        assert!((1_048_576..=1_048_576 * 9 / 8).contains(&p), "{p}");
        assert_eq!(Hist::default().percentile(50.0), 0);
        let bytes = SpStamps {
            seen: 1,
            ready: 2,
            first_copy: 3,
            last_copy: 4,
            written: 5,
        }
        .to_bytes();
        let w: Vec<u64> = bytes
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(SpStamps::from_words(w.try_into().unwrap()).written, 5);
    }
}
