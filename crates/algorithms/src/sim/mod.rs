//! Deterministic simulators.
