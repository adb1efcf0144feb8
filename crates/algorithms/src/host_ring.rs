//! A host-based ring Allgatherv: the baseline the offloaded, hierarchical
//! [`Allgatherv`](crate::allgatherv::Allgatherv) is compared with when ranks
//! arrive late (`sim::host_ring`). No SP takes part: each host rank runs one
//! [`HostRing`] inside its MPI call, as Open MPI's ring allgatherv does.
//!
//! The ring, for `size` ranks: in step `s` (`0..size - 1`) rank `r` sends
//! block `(r - s) mod size` (its own block in step 0, then the block it
//! received in the step before) to rank `r + 1` and receives block
//! `(r - s - 1) mod size` from rank `r - 1`, a send-receive pair. Step
//! `s + 1` starts when both halves of step `s` are done, and nothing starts
//! before the rank entered the call ([`HostRing::handle_post`]): a host ring
//! only progresses while its rank is in the call. After the last step the
//! rank completes.
//!
//! The driver posts the two halves of each step as the machine asks
//! ([`Action::Send`], [`Action::Recv`]); how a send meets its receive (a
//! rendezvous: the data moves once both are posted) and how long it takes is
//! the driver's. It reports each half done ([`HostRing::handle_send_done`],
//! [`HostRing::handle_recv_done`]) and pulls the next actions with
//! [`HostRing::poll_action`] after every input.

use std::collections::VecDeque;
use std::fmt;

use crate::{Nanos, Rank};

/// What the ring asks of its driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Action {
    /// Send block `block` (whose data this rank holds) to rank `to` as the
    /// send half of step `step`.
    Send { to: Rank, step: u32, block: Rank },
    /// Receive block `block` from rank `from` as the receive half of step
    /// `step`.
    Recv { from: Rank, step: u32, block: Rank },
    /// Every block is in this rank's buffer: the call returns.
    Complete,
}

/// A driver reported something the ring did not ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingError {
    /// An input before the rank entered the call.
    NotPosted,
    /// A second post.
    PostedTwice,
    /// A half of a step that is not in flight (or reported twice).
    NotInFlight { step: u32, send: bool },
}

impl fmt::Display for RingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RingError::NotPosted => write!(f, "input before the post"),
            RingError::PostedTwice => write!(f, "posted twice"),
            RingError::NotInFlight { step, send } => write!(
                f,
                "{} of step {step} reported done but not in flight",
                if *send { "send" } else { "receive" }
            ),
        }
    }
}

impl std::error::Error for RingError {}

/// One rank's side of a ring Allgatherv of `size` ranks.
#[derive(Clone, Debug)]
pub struct HostRing {
    me: Rank,
    size: u32,
    posted: bool,
    /// The step in flight (`size - 1` once finished).
    step: u32,
    send_done: bool,
    recv_done: bool,
    finished: bool,
    actions: VecDeque<Action>,
}

impl HostRing {
    /// Rank `me` of `size` (at least 1, `me < size`).
    pub fn new(me: Rank, size: u32) -> HostRing {
        assert!(size >= 1 && me < size, "rank {me} of {size}");
        HostRing {
            me,
            size,
            posted: false,
            step: 0,
            send_done: false,
            recv_done: false,
            finished: false,
            actions: VecDeque::new(),
        }
    }

    /// The rank entered the call at `now`.
    pub fn handle_post(&mut self, _now: Nanos) -> Result<(), RingError> {
        if self.posted {
            return Err(RingError::PostedTwice);
        }
        self.posted = true;
        if self.size == 1 {
            self.finish();
        } else {
            self.start_step();
        }
        Ok(())
    }

    /// The send half of `step` is done (the receiver has the data).
    pub fn handle_send_done(&mut self, _now: Nanos, step: u32) -> Result<(), RingError> {
        self.half_done(step, true)
    }

    /// The receive half of `step` is done (the block is in this rank's
    /// buffer).
    pub fn handle_recv_done(&mut self, _now: Nanos, step: u32) -> Result<(), RingError> {
        self.half_done(step, false)
    }

    /// The next action, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// The block rank `r` sends in step `s` of a ring of `size`.
    pub fn block_sent(r: Rank, s: u32, size: u32) -> Rank {
        (r + size - s % size) % size
    }

    fn half_done(&mut self, step: u32, send: bool) -> Result<(), RingError> {
        if !self.posted {
            return Err(RingError::NotPosted);
        }
        let flag = if send {
            &mut self.send_done
        } else {
            &mut self.recv_done
        };
        if self.finished || step != self.step || *flag {
            return Err(RingError::NotInFlight { step, send });
        }
        *flag = true;
        if self.send_done && self.recv_done {
            self.step += 1;
            if self.step + 1 == self.size {
                self.finish();
            } else {
                self.start_step();
            }
        }
        Ok(())
    }

    fn start_step(&mut self) {
        let (n, s) = (self.size, self.step);
        self.send_done = false;
        self.recv_done = false;
        self.actions.push_back(Action::Send {
            to: (self.me + 1) % n,
            step: s,
            block: Self::block_sent(self.me, s, n),
        });
        let from = (self.me + n - 1) % n;
        self.actions.push_back(Action::Recv {
            from,
            step: s,
            block: Self::block_sent(from, s, n),
        });
    }

    fn finish(&mut self) {
        self.finished = true;
        self.actions.push_back(Action::Complete);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(r: &mut HostRing) -> Vec<Action> {
        std::iter::from_fn(|| r.poll_action()).collect()
    }

    #[test]
    fn nothing_moves_before_the_post_and_each_step_waits_for_both_halves() {
        let mut r = HostRing::new(1, 3);
        assert_eq!(drain(&mut r), []);
        assert_eq!(r.handle_send_done(0, 0), Err(RingError::NotPosted));
        r.handle_post(5).unwrap();
        assert_eq!(
            drain(&mut r),
            [
                Action::Send {
                    to: 2,
                    step: 0,
                    block: 1
                },
                Action::Recv {
                    from: 0,
                    step: 0,
                    block: 0
                }
            ]
        );
        r.handle_send_done(6, 0).unwrap();
        assert_eq!(drain(&mut r), [], "the receive of step 0 is still open");
        assert_eq!(
            r.handle_send_done(6, 0),
            Err(RingError::NotInFlight {
                step: 0,
                send: true
            })
        );
        r.handle_recv_done(7, 0).unwrap();
        // Step 1 forwards the block received in step 0.
        assert_eq!(
            drain(&mut r),
            [
                Action::Send {
                    to: 2,
                    step: 1,
                    block: 0
                },
                Action::Recv {
                    from: 0,
                    step: 1,
                    block: 2
                }
            ]
        );
        r.handle_recv_done(8, 1).unwrap();
        r.handle_send_done(9, 1).unwrap();
        assert_eq!(drain(&mut r), [Action::Complete]);
        assert!(r.is_finished());
    }

    #[test]
    fn a_ring_of_one_completes_at_the_post() {
        let mut r = HostRing::new(0, 1);
        r.handle_post(0).unwrap();
        assert_eq!(drain(&mut r), [Action::Complete]);
        assert_eq!(r.handle_post(0), Err(RingError::PostedTwice));
    }
}
