//! Admission control shared by all collective instances of one SP.

use std::collections::VecDeque;

/// Bounded FIFO admission gate: at most `max_inflight` items are "in flight"
/// at a time, the rest wait in arrival order.
///
/// The SP engine and the simulator push every `Copy` emitted by any
/// collective instance here and only start the ones `pop_startable` hands
/// out, which bounds the RDMA reads one SP has outstanding across all
/// instances. A `max_inflight` of 0 would never admit anything and is
/// clamped to 1.
#[derive(Clone, Debug)]
pub struct CopyLimiter<T> {
    max_inflight: usize,
    in_flight: usize,
    queue: VecDeque<T>,
}

impl<T> CopyLimiter<T> {
    /// `max_inflight` 0 is clamped to 1.
    pub fn new(max_inflight: usize) -> Self {
        CopyLimiter {
            max_inflight: max_inflight.max(1),
            in_flight: 0,
            queue: VecDeque::new(),
        }
    }

    /// Queue an item behind everything already queued.
    pub fn push(&mut self, item: T) {
        self.queue.push_back(item);
    }

    /// The oldest queued item, if fewer than `max_inflight` items are in
    /// flight; the returned item counts as in flight until `finished`.
    pub fn pop_startable(&mut self) -> Option<T> {
        if self.in_flight >= self.max_inflight {
            return None;
        }
        let item = self.queue.pop_front()?;
        self.in_flight += 1;
        Some(item)
    }

    /// One in-flight item is done. Calling it with nothing in flight is a
    /// driver bug (debug assertion; ignored in release builds).
    pub fn finished(&mut self) {
        debug_assert!(
            self.in_flight > 0,
            "CopyLimiter::finished with nothing in flight"
        );
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    pub fn max_inflight(&self) -> usize {
        self.max_inflight
    }

    /// Drop every queued (not yet started) item, e.g. when the SP shuts
    /// down; in-flight accounting is unchanged.
    pub fn clear_queued(&mut self) -> impl Iterator<Item = T> + '_ {
        self.queue.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_max_in_fifo_order() {
        let mut l = CopyLimiter::new(2);
        for i in 0..5 {
            l.push(i);
        }
        assert_eq!(l.queued(), 5);
        assert_eq!(l.pop_startable(), Some(0));
        assert_eq!(l.pop_startable(), Some(1));
        assert_eq!(l.pop_startable(), None);
        assert_eq!(l.in_flight(), 2);
        assert_eq!(l.queued(), 3);
        l.finished();
        assert_eq!(l.pop_startable(), Some(2));
        assert_eq!(l.pop_startable(), None);
        l.finished();
        l.finished();
        assert_eq!(l.pop_startable(), Some(3));
        assert_eq!(l.pop_startable(), Some(4));
        assert_eq!(l.pop_startable(), None);
        assert_eq!(l.queued(), 0);
        assert_eq!(l.in_flight(), 2);
    }

    #[test]
    fn empty_queue_does_not_count_in_flight() {
        let mut l: CopyLimiter<u8> = CopyLimiter::new(1);
        assert_eq!(l.pop_startable(), None);
        assert_eq!(l.in_flight(), 0);
    }

    #[test]
    fn zero_is_clamped_to_one() {
        let mut l = CopyLimiter::new(0);
        assert_eq!(l.max_inflight(), 1);
        l.push('a');
        l.push('b');
        assert_eq!(l.pop_startable(), Some('a'));
        assert_eq!(l.pop_startable(), None);
        assert_eq!(l.clear_queued().collect::<Vec<_>>(), vec!['b']);
    }
}
