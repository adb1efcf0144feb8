//! How a waiting rank spends its time between two looks at its completion flags.
//!
//! The SPs run on the same cores as the ranks (they stand for DPU cores), so a rank that spins
//! without end steals their time. A wait therefore escalates: a few rounds of busy spinning
//! (completions that are already near cost nothing), then `sched_yield` rounds, then sleeps
//! that double from [`SLEEP_MIN`] up to [`SLEEP_MAX`]. Separately from the pauses, the waiter
//! keeps native MPI progressing ([`PROGRESS_INTERVAL`]) and checks its SP connection
//! ([`CONN_CHECK_INTERVAL`]); see `wait.rs`.

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

#[derive(Debug, Default)]
pub struct Backoff {
    round: u32,
    sleep: Option<Duration>,
}

impl Backoff {
    pub fn new() -> Self {
        Self::default()
    }

    /// The next pause to take.
    pub fn next_pause(&mut self) -> Pause {
        self.round = self.round.saturating_add(1);
        if self.round <= SPIN_ROUNDS {
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
            Pause::Sleep(d) => std::thread::sleep(d),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_then_yields_then_sleeps_with_a_cap() {
        let mut b = Backoff::new();
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
