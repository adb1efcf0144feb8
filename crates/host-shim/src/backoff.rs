//! How a waiting rank spends its time between two looks at its completion flags.
//!
//! The SPs run on the same cores as the ranks (they stand for DPU cores), so a rank that spins
//! without end steals their time. A wait therefore escalates: a few rounds of busy spinning
//! (completions that are already near cost nothing), then `sched_yield` rounds, then sleeps
//! that double from [`SLEEP_MIN`] up to [`SLEEP_MAX`]. Separately from the pauses, the waiter
//! keeps native MPI progressing ([`PROGRESS_INTERVAL`]) and checks its SP connection
//! ([`CONN_CHECK_INTERVAL`]); see `wait.rs`.
//!
//! `SPOFF_WAIT=spin` keeps the wait spinning (with the same progress and connection checks):
//! for a rank on a core no SP shares (an SP on a DPU, or `launch --rank-cpus` beside
//! `--sp-cpus`, which sets it), where a sleep only delays noticing a completion, by up to
//! [`SLEEP_MAX`]. `backoff` (the default) is the escalation above.

use std::time::Duration;

/// Busy rounds (each [`SPIN_HINTS`] `spin_loop` hints) before yielding.
pub const SPIN_ROUNDS: u32 = 64;
pub const SPIN_HINTS: u32 = 32;
/// `sched_yield` rounds before sleeping.
pub const YIELD_ROUNDS: u32 = 64;
pub const SLEEP_MIN: Duration = Duration::from_micros(2);
pub const SLEEP_MAX: Duration = Duration::from_micros(64);
/// Native progress (`PMPI_Iprobe`) at least this often while waiting on offloaded requests only.
pub const PROGRESS_INTERVAL: Duration = Duration::from_micros(100);
/// How often a waiter reads its SP connection (refusals, a dead SP).
pub const CONN_CHECK_INTERVAL: Duration = Duration::from_millis(1);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pause {
    Spin,
    Yield,
    Sleep(Duration),
}

/// Timer slack while a wait sleeps. Linux's default of 50 µs would turn every short sleep into
/// ~50 µs and add it to the latency of every completion a rank notices while sleeping.
pub const WAIT_TIMER_SLACK_NS: libc::c_ulong = 1_000;

/// How a wait pauses (`SPOFF_WAIT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitPolicy {
    Backoff,
    Spin,
}

impl WaitPolicy {
    /// `SPOFF_WAIT`'s value: unset or empty is `backoff`; anything else than `spin` or
    /// `backoff` is an error naming the variable.
    pub fn parse(v: Option<&str>) -> Result<WaitPolicy, String> {
        match v.map(str::trim) {
            None | Some("") | Some("backoff") => Ok(WaitPolicy::Backoff),
            Some("spin") => Ok(WaitPolicy::Spin),
            Some(o) => Err(format!("SPOFF_WAIT={o:?}: expected spin or backoff")),
        }
    }

    /// The process's policy, read once; a bad value is said once on stderr and taken as
    /// `backoff`.
    pub fn current() -> WaitPolicy {
        static P: std::sync::OnceLock<WaitPolicy> = std::sync::OnceLock::new();
        *P.get_or_init(|| {
            WaitPolicy::parse(std::env::var("SPOFF_WAIT").ok().as_deref()).unwrap_or_else(|e| {
                crate::boundary::say!("{e}; waiting with backoff");
                WaitPolicy::Backoff
            })
        })
    }
}

#[derive(Debug, Default)]
pub struct Backoff {
    /// Spin at every pause (`SPOFF_WAIT=spin`).
    spin: bool,
    round: u32,
    sleep: Option<Duration>,
    /// The thread's timer slack before this wait lowered it, restored on drop.
    saved_slack_ns: Option<libc::c_ulong>,
}

impl Drop for Backoff {
    fn drop(&mut self) {
        if let Some(ns) = self.saved_slack_ns.take() {
            // SAFETY: prctl with an integer argument; no memory is passed.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, ns) };
        }
    }
}

impl Backoff {
    /// A wait by the process's policy ([`WaitPolicy::current`]).
    pub fn new() -> Self {
        Self::with_policy(WaitPolicy::current())
    }

    pub fn with_policy(p: WaitPolicy) -> Self {
        Backoff {
            spin: p == WaitPolicy::Spin,
            ..Self::default()
        }
    }

    /// The next pause to take.
    pub fn next_pause(&mut self) -> Pause {
        self.round = self.round.saturating_add(1);
        if self.spin || self.round <= SPIN_ROUNDS {
            return Pause::Spin;
        }
        if self.round <= SPIN_ROUNDS + YIELD_ROUNDS {
            return Pause::Yield;
        }
        let d = match self.sleep {
            None => SLEEP_MIN,
            Some(d) => (d * 2).min(SLEEP_MAX),
        };
        self.sleep = Some(d);
        Pause::Sleep(d)
    }

    /// Takes the next pause.
    pub fn pause(&mut self) {
        match self.next_pause() {
            Pause::Spin => {
                for _ in 0..SPIN_HINTS {
                    std::hint::spin_loop();
                }
            }
            Pause::Yield => std::thread::yield_now(),
            Pause::Sleep(d) => {
                if self.saved_slack_ns.is_none() {
                    // SAFETY: prctl with integer arguments; no memory is passed.
                    let old = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) };
                    if old >= 0 {
                        self.saved_slack_ns = Some(old as libc::c_ulong);
                        // SAFETY: as above.
                        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, WAIT_TIMER_SLACK_NS) };
                    }
                }
                std::thread::sleep(d)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sleeping_wait_lowers_the_timer_slack_and_restores_it() {
        // SAFETY: prctl with integer arguments.
        let before = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) };
        {
            let mut b = Backoff::with_policy(WaitPolicy::Backoff);
            while !matches!(b.next_pause(), Pause::Sleep(_)) {}
            b.pause();
            let during = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) };
            assert_eq!(during as libc::c_ulong, WAIT_TIMER_SLACK_NS);
        }
        let after = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) };
        assert_eq!(after, before);
    }

    #[test]
    fn the_spin_policy_never_yields_nor_sleeps() {
        let mut b = Backoff::with_policy(WaitPolicy::Spin);
        for _ in 0..10 * (SPIN_ROUNDS + YIELD_ROUNDS) {
            assert_eq!(b.next_pause(), Pause::Spin);
        }
    }

    #[test]
    fn the_wait_policy_is_parsed_or_refused_by_name() {
        assert_eq!(WaitPolicy::parse(None), Ok(WaitPolicy::Backoff));
        assert_eq!(WaitPolicy::parse(Some("")), Ok(WaitPolicy::Backoff));
        assert_eq!(WaitPolicy::parse(Some("backoff")), Ok(WaitPolicy::Backoff));
        assert_eq!(WaitPolicy::parse(Some(" spin ")), Ok(WaitPolicy::Spin));
        let e = WaitPolicy::parse(Some("fast")).unwrap_err();
        assert!(e.contains("SPOFF_WAIT") && e.contains("fast"), "{e}");
    }

    #[test]
    fn spins_then_yields_then_sleeps_with_a_cap() {
        let mut b = Backoff::with_policy(WaitPolicy::Backoff);
        let seq: Vec<Pause> = (0..SPIN_ROUNDS + YIELD_ROUNDS + 20)
            .map(|_| b.next_pause())
            .collect();
        assert!(seq[..SPIN_ROUNDS as usize]
            .iter()
            .all(|p| *p == Pause::Spin));
        let yields = &seq[SPIN_ROUNDS as usize..(SPIN_ROUNDS + YIELD_ROUNDS) as usize];
        assert!(yields.iter().all(|p| *p == Pause::Yield));
        let sleeps: Vec<Duration> = seq[(SPIN_ROUNDS + YIELD_ROUNDS) as usize..]
            .iter()
            .map(|p| match p {
                Pause::Sleep(d) => *d,
                other => panic!("expected a sleep, got {other:?}"),
            })
            .collect();
        assert_eq!(sleeps[0], SLEEP_MIN);
        assert!(sleeps.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(*sleeps.last().unwrap(), SLEEP_MAX);
    }
}
