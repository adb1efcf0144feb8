//! Byte-for-byte comparison of receive buffers, and the count of mismatches.

use crate::inst::Inst;
use crate::types::Ty;

/// Which peer's block holds byte `off` of the receive buffer, as text.
pub fn locate(inst: &Inst, ext: usize, off: usize) -> String {
    for j in 0..inst.n {
        let (start, cnt) = (inst.rdispls[j] as usize * ext, inst.rcounts[j] as usize);
        if cnt > 0 && off >= start && off < start + cnt * ext {
            let rel = off - start;
            return format!("peer={j} (elem {} byte {})", rel / ext, rel % ext);
        }
    }
    "peer=none (outside every received block)".into()
}

pub struct Checker {
    pub wrank: usize,
    pub mismatches: u64,
    pub printed: u64,
}

pub const PRINT_LIMIT: u64 = 200;
pub const PRINT_PER_BUFFER: u64 = 8;

impl Checker {
    pub fn report(&mut self, line: String) {
        self.mismatches += 1;
        if self.printed < PRINT_LIMIT {
            eprintln!("alltoallv_check: MISMATCH rank={} {line}", self.wrank);
            self.printed += 1;
            if self.printed == PRINT_LIMIT {
                eprintln!(
                    "alltoallv_check: rank {}: further mismatches counted, not printed",
                    self.wrank
                );
            }
        }
    }

    /// Compares two receive buffers of `inst` byte for byte.
    pub fn compare(
        &mut self,
        op: u64,
        inst: &Inst,
        types: &[Ty],
        what: &str,
        exp: &[u8],
        got: &[u8],
    ) {
        let ty = &types[inst.ty];
        let mut shown = 0;
        for off in 0..exp.len().max(got.len()) {
            let (e, g) = (exp.get(off), got.get(off));
            if e == g {
                continue;
            }
            if shown < PRINT_PER_BUFFER {
                shown += 1;
                let fmt = |b: Option<&u8>| b.map_or("none".to_string(), |b| format!("0x{b:02x}"));
                self.report(format!(
                    "op={op} inst={} {:?} comm={} (rank {} of {}) type={} {what}: {} offset={off} expected={} got={}",
                    inst.plan_idx,
                    inst.kind,
                    inst.comm_name,
                    inst.me,
                    inst.n,
                    ty.name,
                    locate(inst, ty.extent, off),
                    fmt(e),
                    fmt(g)
                ));
            } else {
                self.mismatches += 1;
            }
        }
    }
}
