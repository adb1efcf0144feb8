//! Everything the engine does by the clock, in one place: late hellos, heartbeats and silent
//! peers, and the drivers' deadlines. The time is passed in (`now_ns`), as to the drivers.

use super::*;

/// The instances' deadlines ([`CollDriver::deadline`]), asked again after every event an
/// instance is driven by. An entry whose instance went is dropped when it comes due.
#[derive(Default)]
pub(super) struct Deadlines {
    at: HashMap<CollKey, Nanos>,
}

impl Deadlines {
    pub(super) fn set(&mut self, ck: CollKey, at: Option<Nanos>) {
        match at {
            Some(t) => self.at.insert(ck, t),
            None => self.at.remove(&ck),
        };
    }

    pub(super) fn next(&self) -> Option<Nanos> {
        self.at.values().copied().min()
    }

    /// The instances whose deadline is `now` or earlier, taken out.
    pub(super) fn take_due(&mut self, now: Nanos) -> Vec<CollKey> {
        let due: Vec<CollKey> = self
            .at
            .iter()
            .filter(|(_, &t)| t <= now)
            .map(|(&ck, _)| ck)
            .collect();
        for ck in &due {
            self.at.remove(ck);
        }
        due
    }
}

impl Server {
    /// What is due by the clock at `now` (the loop's one reading of it per pass): late
    /// hellos, heartbeats, the instances' deadlines.
    pub(super) fn on_timers(&mut self, now: Instant) {
        let gap = now.saturating_duration_since(self.last_timers);
        self.last_timers = now;
        let gap_ms = gap.as_millis() as u64;
        self.stats.timer_gap_max_ms = self.stats.timer_gap_max_ms.max(gap_ms);
        if gap > self.heartbeat * 3 {
            // Not expected: nothing in the loop waits. A held or descheduled SP says so, since
            // its peers may have found it silent meanwhile.
            warn!(
                sp = self.me,
                "the event loop did not look at the clock for {:.1} s (heartbeats every {:?})",
                gap.as_secs_f64(),
                self.heartbeat
            );
        }
        self.sweep_hellos(now);
        self.heartbeats(now);
        let now = now.saturating_duration_since(self.start).as_nanos() as Nanos;
        for ck in self.deadlines.take_due(now) {
            if let Some(inst) = self.instances.get_mut(&ck) {
                inst.sm.tick(now);
                self.drive(ck);
            }
        }
    }

    /// How long the loop may wait for events when it does not poll: until the next heartbeat,
    /// the next check of late hellos (while any connection has not said hello), or the next
    /// instance deadline.
    pub(super) fn wake_in(&self) -> Duration {
        let pending = self
            .conns
            .iter()
            .any(|(_, c)| matches!(c.role, Role::NewHost { .. }));
        let mut wake = if pending {
            self.heartbeat.min(Duration::from_millis(100))
        } else {
            self.heartbeat
        };
        if let Some(t) = self.deadlines.next() {
            let now = now_ns(self.start);
            wake = wake.min(Duration::from_nanos(t.saturating_sub(now)));
        }
        wake
    }

    /// Closes connections that have not said hello within the limit.
    pub(super) fn sweep_hellos(&mut self, now: Instant) {
        if now.duration_since(self.last_hello_sweep) < Duration::from_millis(100) {
            return;
        }
        self.last_hello_sweep = now;
        let late: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                matches!(&c.role, Role::NewHost { since, .. }
                    if now.duration_since(*since) > self.limits.hello_timeout)
            })
            .map(|(k, _)| k)
            .collect();
        for k in late {
            self.stats.hellos_timed_out += 1;
            self.close_conn(k, "no hello in time");
        }
    }

    /// Sends the heartbeats that are due, and drops peers that have been silent too long: a
    /// stopped or deadlocked SP keeps its connections open, and only its silence tells.
    pub(super) fn heartbeats(&mut self, now: Instant) {
        if now.duration_since(self.last_beat) >= self.heartbeat {
            self.last_beat = now;
            // Pins of processes that exited since (a job's ranks may still have been exiting
            // when the job ended here).
            alias_mkey::process::sweep();
            self.end_exec_images();
            let beat = encode(&SpToSp::Heartbeat);
            let peers: Vec<usize> = self.peer_conn.values().copied().collect();
            for k in peers {
                self.send_frame(k, &beat);
            }
            let beat = encode(&SpToHost::Heartbeat);
            let hosts: Vec<usize> = self
                .conns
                .iter()
                .filter(|(_, c)| matches!(&c.role, Role::Host(h) if h.outstanding > 0))
                .map(|(k, _)| k)
                .collect();
            for k in hosts {
                self.send_frame(k, &beat);
            }
        }
        let silent: Vec<SpId> = self
            .peer_conn
            .keys()
            .filter(|sp| {
                self.last_heard
                    .get(sp)
                    .is_some_and(|t| now.duration_since(*t) > self.peer_timeout)
            })
            .copied()
            .collect();
        for sp in silent {
            // Judged on what the peer sent, not on what this loop has read: a loop that was
            // held or descheduled (a loaded machine) finds the peer's heartbeats waiting in
            // its socket. Read them first.
            if let Some(k) = self.peer_conn.get(&sp).copied() {
                self.on_readable(k, true);
                self.close_doomed();
            }
            let Some(quiet) = self.last_heard.get(&sp).map(|t| t.elapsed()) else {
                continue;
            };
            if quiet <= self.peer_timeout {
                continue;
            }
            if let Some(k) = self.peer_conn.get(&sp).copied() {
                self.stats.peers_silent += 1;
                self.close_conn(
                    k,
                    &format!(
                        "no message or heartbeat for {:.1} s: the SP is stuck",
                        quiet.as_secs_f64()
                    ),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Deadlines;
    use algorithms::{CollKey, CommId};

    fn ck(seq: u64) -> CollKey {
        CollKey {
            job: 1,
            comm: CommId { leader: 0, id: 1 },
            seq,
        }
    }

    #[test]
    fn deadlines_come_due_once_in_time_and_can_be_moved_or_cleared() {
        let mut d = Deadlines::default();
        assert_eq!(d.next(), None);
        d.set(ck(1), Some(300));
        d.set(ck(2), Some(100));
        d.set(ck(3), Some(200));
        assert_eq!(d.next(), Some(100));
        // Moved later, and cleared.
        d.set(ck(2), Some(400));
        d.set(ck(3), None);
        assert_eq!(d.next(), Some(300));
        assert!(d.take_due(299).is_empty());
        assert_eq!(d.take_due(300), vec![ck(1)]);
        assert!(d.take_due(350).is_empty(), "taken once");
        assert_eq!(d.take_due(u64::MAX), vec![ck(2)]);
        assert_eq!(d.next(), None);
    }
}
