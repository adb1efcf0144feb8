//! The checks at the end of a run, and the report.

use super::*;
use crate::sim::shared::due_completion;

impl<'a> Sim<'a> {
    pub(super) fn final_checks(&mut self) -> Result<(), SimFailure> {
        let crashed: BTreeSet<SpId> = self.core.crashed.iter().copied().collect();
        let bytes = self.cfg.check_bytes;
        for (i, o) in self.ops.iter().enumerate() {
            let p = o.post_len.len();
            // Every rank's block, in rank order.
            let want: Vec<u8> = if bytes && !o.inconsistent {
                o.send.iter().flatten().copied().collect()
            } else {
                Vec::new()
            };
            let base = splitmix64(self.cfg.seed ^ splitmix64(i as u64 + 1));
            for r in 0..p {
                let plen = p * o.post_len[r] as usize;
                if bytes {
                    let b = &o.recv[r];
                    if let Some(j) = (plen..b.len()).find(|&j| b[j] != sentinel(j)) {
                        return Err(self.fail(format!(
                            "op {i}: rank {r}: byte {j} past the receive buffer was written"
                        )));
                    }
                    let s = &o.send[r];
                    let same = (0..s.len() as u64)
                        .all(|j| s[j as usize] == splitmix64(base ^ ((r as u64) << 40) ^ j) as u8);
                    if !same {
                        return Err(self.fail(format!("op {i}: rank {r}'s send buffer changed")));
                    }
                }
                let sp = self.core.rank_sp[r];
                let exempt = crashed.contains(&sp) || o.post_ns[r].is_none();
                let who = format_args!("op {i} rank {r} (SP {sp})");
                let done = (o.done[r], exempt);
                let Some(d) =
                    due_completion(&self.core, &self.inst, (i, sp), who, done, o.post_ns[r])?
                else {
                    continue;
                };
                if !d.status.is_ok() {
                    if !o.disturbed {
                        return Err(
                            self.fail(format!("op {i} rank {r}: {} without a fault", d.status))
                        );
                    }
                    continue;
                }
                if o.inconsistent {
                    return Err(self.fail(format!(
                        "op {i} rank {r}: completed Ok though posts disagree on the length"
                    )));
                }
                if bytes && o.recv[r][..plen] != want[..] {
                    let b = &o.recv[r];
                    let j = (0..plen).find(|&j| b[j] != want[j]).unwrap();
                    let len = o.len.max(1) as usize;
                    return Err(self.fail(format!(
                        "op {i} rank {r}: completed Ok but byte {j} of {plen} is wrong (block {}, chunk {})",
                        j / len,
                        (j % len) as u64 / self.cfg.mtu.max(1)
                    )));
                }
            }
            if !o.disturbed {
                let k = o.ring.len() as u64;
                let runs = subgroup_runs(o.n, self.cfg.subgroups.max(1))
                    .iter()
                    .filter(|(a, b)| a < b)
                    .count() as u64;
                let want_runs = if k > 1 { runs * p as u64 } else { 0 };
                if o.runs_sent.len() as u64 != want_runs {
                    return Err(self.fail(format!(
                        "op {i}: {} block runs multicast, want {want_runs}",
                        o.runs_sent.len()
                    )));
                }
                let dgrams = if k > 1 { p as u64 * o.n * (k - 1) } else { 0 };
                if o.datagrams != dgrams {
                    return Err(
                        self.fail(format!("op {i}: {} datagrams, want {dgrams}", o.datagrams))
                    );
                }
            }
        }
        for (&(sp, op), a) in &self.inst {
            if crashed.contains(&sp) {
                continue;
            }
            if a.members().is_some() && !a.is_finished() {
                return Err(self.fail(format!(
                    "op {op}: instance on live SP {sp} not finished at the end (abort={:?}, in flight {})",
                    a.abort_status(),
                    a.copies_in_flight()
                )));
            }
        }
        Ok(())
    }

    pub(super) fn report(&self) -> SimReport {
        let mut stats = Stats::default();
        for a in self.inst.values() {
            stats.absorb(&a.stats());
        }
        let done = self.ops.iter().flat_map(|o| o.done.iter()).flatten();
        let end_ns = done.clone().map(|d| d.at).max().unwrap_or(0);
        let errors = done.filter(|d| !d.status.is_ok()).count() as u64;
        SimReport {
            outcome: self.core.outcome(errors),
            end_ns,
            fabric: self.core.fabric,
            unregistered_drops: self.unregistered_drops,
            copies: self.copies,
            bytes_copied: self.bytes_copied,
            traffic: self.traffic.clone(),
            stats,
        }
    }
}
