//! The checks at the end of a run, and the report.

use super::*;
use crate::sim::shared::due_completion;

impl<'a> Sim<'a> {
    pub(super) fn final_checks(&mut self) -> Result<(), SimFailure> {
        let crashed: BTreeSet<SpId> = self.core.crashed.iter().copied().collect();
        for (i, o) in self.ops.iter().enumerate() {
            let want = o.len as usize;
            for r in 0..o.buf.len() {
                let b = &o.buf[r];
                let plen = o.post_len[r] as usize;
                if let Some(j) = (plen..b.len()).find(|&j| b[j] != sentinel(j)) {
                    return Err(self.fail(format!(
                        "op {i}: rank {r}: byte {j} past the message was written"
                    )));
                }
                if r == o.root as usize && b[..want] != o.data[..] {
                    return Err(self.fail(format!("op {i}: the root's buffer changed")));
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
                // Ok: the rank's post agrees with that of the rank it names
                // as root, which names itself, and it holds that root's
                // bytes (normally the real root; with inconsistent posts, a
                // rank wrongly naming itself root serves the ranks of its SP
                // that name it too, as the staged bcast's checker allows).
                let x = o.post_root[r] as usize;
                if o.post_root[x] as usize != x || o.post_len[x] as usize != plen {
                    return Err(self.fail(format!(
                        "op {i} rank {r}: completed Ok with an inconsistent post (root {x}, {plen} bytes)"
                    )));
                }
                let src = &o.buf[x];
                if b[..plen] != src[..plen] {
                    let j = (0..plen).find(|&j| b[j] != src[j]).unwrap();
                    return Err(self.fail(format!(
                        "op {i} rank {r}: completed Ok but byte {j} of {plen} is wrong (chunk {})",
                        j as u64 / self.cfg.mtu.max(1)
                    )));
                }
            }
            if !o.disturbed {
                let sent = o.runs_sent.len() as u64;
                let runs = subgroup_runs(o.n, self.cfg.subgroups.max(1))
                    .iter()
                    .filter(|(a, b)| a < b)
                    .count() as u64;
                let multicast = o.ring.len() > 1;
                if sent != if multicast { runs } else { 0 } {
                    return Err(self.fail(format!(
                        "op {i}: {sent} subgroup runs multicast, want {runs}"
                    )));
                }
                let dgrams = if multicast {
                    o.n * (o.ring.len() as u64 - 1)
                } else {
                    0
                };
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
            stats,
        }
    }
}
