//! Deterministic simulators driving the state machines of this crate.
//!
//! Everything is derived from a seed: virtual time lives in the driver, the
//! state machines only see `now` arguments, and randomness comes from the
//! small generator in [`rng`]. Checkers live here, outside the algorithm
//! code.

use std::fmt;

pub mod alltoallv;
pub mod rng;

/// A failed simulation run. `Display` always starts with the seed so a
/// failing test prints how to reproduce it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimFailure {
    pub seed: u64,
    pub what: String,
}

impl fmt::Display for SimFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seed={:#018x} : {}", self.seed, self.what)
    }
}

impl std::error::Error for SimFailure {}
