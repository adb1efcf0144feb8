//! Counters of one SP, printed at exit (and as JSON for tools).

use serde::Serialize;

#[derive(Clone, Debug, Default, Serialize)]
pub struct Stats {
    pub posts: u64,
    pub completions: u64,
    pub collectives_finished: u64,
    pub announces_received: u64,
    pub messages_sent: u64,
    pub copies_started: u64,
    pub copies_failed: u64,
    /// Copies of a failed job dropped before they started.
    pub copies_purged: u64,
    /// Of `copies_started`, those small enough to run on the event-loop thread.
    pub copies_inline: u64,
    pub bytes_copied: u64,
    /// Most copies active at once (bounded by `max_inflight_reads`).
    pub max_inflight: u64,
    pub errors_sent: u64,
    /// Hierarchical collectives (allgatherv): announcements that found no ready rank where they
    /// arrived, how many another SP of the node then served, how many went to the node's
    /// pending list, and how long they waited there (ns).
    pub no_ready_rank: u64,
    pub served_after_pass: u64,
    pub parked: u64,
    pub parked_wait_ns: u64,
    /// Jobs and collective instances still held when the SP stopped: 0 once every job ended.
    pub jobs_at_exit: u64,
    pub instances_at_exit: u64,
}

impl Stats {
    pub fn add_late_arrivals(&mut self, l: crate::machine::LateArrivals) {
        self.no_ready_rank += l.no_ready_rank;
        self.served_after_pass += l.served_after_pass;
        self.parked += l.parked;
        self.parked_wait_ns += l.parked_wait_ns;
    }
}
