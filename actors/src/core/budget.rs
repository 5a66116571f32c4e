//! A memory domain's budget and its queue of reservations. No I/O; time is a parameter.
//!
//! A reservation asks for all the parts of one message at once and gets all or none: a
//! waiting reservation holds nothing, so receivers that each need several parts can never
//! hold part of their inputs while waiting for the rest. Waiting reservations are served in
//! arrival order (no starvation of large ones), the queue is bounded, and each waits until
//! its deadline at most.

use std::collections::VecDeque;
use std::time::Instant;

/// Identifies one reservation request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReservationId(pub u64);

/// What became of a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationEvent {
    /// Every part was granted.
    Granted(ReservationId),
    /// Its deadline passed while it waited.
    TimedOut(ReservationId),
}

/// Why a reservation was refused at once.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReserveError {
    /// It asks for more than the whole budget.
    #[error("{total} bytes requested, more than the domain's whole budget of {capacity} bytes")]
    TooLarge {
        /// Bytes asked for.
        total: u64,
        /// The budget.
        capacity: u64,
    },
    /// The wait queue is at its configured bound.
    #[error("{0} reservations already waiting")]
    QueueFull(usize),
}

/// Whether a reservation was granted at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserved {
    /// Granted now.
    Now,
    /// Queued; a [`ReservationEvent`] follows.
    Queued,
}

#[derive(Debug)]
struct Waiter {
    id: ReservationId,
    total: u64,
    deadline: Instant,
}

/// Counters of a domain, for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BudgetStats {
    /// The budget, bytes.
    pub capacity: u64,
    /// Bytes granted and not yet released.
    pub granted: u64,
    /// Reservations waiting.
    pub waiting: usize,
    /// Largest number ever waiting at once.
    pub peak_waiting: usize,
}

/// A domain's budget with its bounded queue of all-or-nothing reservations.
#[derive(Debug)]
pub struct Budget {
    capacity: u64,
    granted: u64,
    queue: VecDeque<Waiter>,
    queue_cap: usize,
    peak_waiting: usize,
    events: VecDeque<ReservationEvent>,
}

impl Budget {
    /// A budget of `capacity` bytes with room for `queue_cap` waiting reservations.
    pub fn new(capacity: u64, queue_cap: usize) -> Self {
        Self {
            capacity,
            granted: 0,
            queue: VecDeque::new(),
            queue_cap,
            peak_waiting: 0,
            events: VecDeque::new(),
        }
    }

    /// Asks for every part at once. Granted now if it fits and nobody waits ahead of it;
    /// otherwise queued until `deadline`.
    pub fn handle_reserve(
        &mut self,
        now: Instant,
        id: ReservationId,
        parts: &[u64],
        deadline: Instant,
    ) -> Result<Reserved, ReserveError> {
        let total = self.fitting_total(parts)?;
        self.handle_timeout(now);
        if self.queue.is_empty() && self.granted + total <= self.capacity {
            self.granted += total;
            return Ok(Reserved::Now);
        }
        if self.queue.len() >= self.queue_cap {
            return Err(ReserveError::QueueFull(self.queue_cap));
        }
        self.queue.push_back(Waiter {
            id,
            total,
            deadline,
        });
        self.peak_waiting = self.peak_waiting.max(self.queue.len());
        Ok(Reserved::Queued)
    }

    /// The parts' total, or `TooLarge` when it exceeds the whole budget (it could never fit).
    fn fitting_total(&self, parts: &[u64]) -> Result<u64, ReserveError> {
        let total = parts
            .iter()
            .try_fold(0u64, |acc, p| acc.checked_add(*p))
            .unwrap_or(u64::MAX);
        if total > self.capacity {
            return Err(ReserveError::TooLarge {
                total,
                capacity: self.capacity,
            });
        }
        Ok(total)
    }

    /// Gives `bytes` back and grants whatever now fits, in order.
    pub fn handle_release(&mut self, bytes: u64) {
        debug_assert!(bytes <= self.granted, "released more than granted");
        self.granted = self.granted.saturating_sub(bytes);
        self.grant_waiting();
    }

    /// The requester gave up on a waiting reservation. Returns false if it was not waiting.
    pub fn handle_withdraw(&mut self, id: ReservationId) -> bool {
        let before = self.queue.len();
        self.queue.retain(|w| w.id != id);
        let removed = self.queue.len() != before;
        if removed {
            self.grant_waiting();
        }
        removed
    }

    /// Grants every part at once if that is possible now, without queueing: used to try a
    /// tier before spilling to the next. Honors arrival order: nothing is granted while
    /// others wait.
    pub fn handle_try_reserve(&mut self, parts: &[u64]) -> Result<bool, ReserveError> {
        let total = self.fitting_total(parts)?;
        if self.queue.is_empty() && self.granted + total <= self.capacity {
            self.granted += total;
            return Ok(true);
        }
        Ok(false)
    }

    /// Expires waiting reservations whose deadline is at or before `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let mut expired = false;
        self.queue.retain(|w| {
            let live = w.deadline > now;
            if !live {
                self.events.push_back(ReservationEvent::TimedOut(w.id));
                expired = true;
            }
            live
        });
        if expired {
            self.grant_waiting();
        }
    }

    fn grant_waiting(&mut self) {
        while let Some(head) = self.queue.front() {
            if self.granted + head.total > self.capacity {
                break;
            }
            self.granted += head.total;
            let id = head.id;
            self.queue.pop_front();
            self.events.push_back(ReservationEvent::Granted(id));
        }
    }

    /// Next outcome of a queued reservation.
    pub fn poll_event(&mut self) -> Option<ReservationEvent> {
        self.events.pop_front()
    }

    /// The earliest deadline among waiting reservations.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.queue.iter().map(|w| w.deadline).min()
    }

    /// Current counters.
    pub fn stats(&self) -> BudgetStats {
        BudgetStats {
            capacity: self.capacity,
            granted: self.granted,
            waiting: self.queue.len(),
            peak_waiting: self.peak_waiting,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;
    use std::time::Duration;

    #[test]
    fn all_or_nothing_and_fifo() {
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(10);
        let mut b = Budget::new(100, 8);
        assert_eq!(
            b.handle_reserve(t0, ReservationId(1), &[30, 30], far),
            Ok(Reserved::Now)
        );
        // 50 does not fit beside 60: it waits holding nothing.
        assert_eq!(
            b.handle_reserve(t0, ReservationId(2), &[25, 25], far),
            Ok(Reserved::Queued)
        );
        assert_eq!(b.stats().granted, 60);
        // A small one may not overtake the waiting one.
        assert_eq!(
            b.handle_reserve(t0, ReservationId(3), &[1], far),
            Ok(Reserved::Queued)
        );
        b.handle_release(60);
        assert_eq!(
            b.poll_event(),
            Some(ReservationEvent::Granted(ReservationId(2)))
        );
        assert_eq!(
            b.poll_event(),
            Some(ReservationEvent::Granted(ReservationId(3)))
        );
        assert_eq!(b.stats().granted, 51);
    }

    #[test]
    fn too_large_and_queue_bound_and_deadline() {
        let t0 = Instant::now();
        let mut b = Budget::new(10, 1);
        assert!(matches!(
            b.handle_reserve(t0, ReservationId(1), &[11], t0),
            Err(ReserveError::TooLarge { .. })
        ));
        b.handle_reserve(t0, ReservationId(2), &[10], t0).ok();
        let d = t0 + Duration::from_millis(5);
        assert_eq!(
            b.handle_reserve(t0, ReservationId(3), &[5], d),
            Ok(Reserved::Queued)
        );
        assert_eq!(
            b.handle_reserve(t0, ReservationId(4), &[5], d),
            Err(ReserveError::QueueFull(1))
        );
        assert_eq!(b.poll_timeout(), Some(d));
        b.handle_timeout(d);
        assert_eq!(
            b.poll_event(),
            Some(ReservationEvent::TimedOut(ReservationId(3)))
        );
        assert_eq!(b.stats().granted, 10);
    }

    proptest! {
        /// Budgets are never exceeded, reservations are all or nothing, and every queued
        /// reservation ends exactly once (granted or timed out).
        #[test]
        fn invariants(ops in proptest::collection::vec((0u8..4, 1u64..40, 1u64..4, 0u64..50), 1..200)) {
            let t0 = Instant::now();
            let mut b = Budget::new(100, 16);
            let mut held: HashMap<u64, u64> = HashMap::new();
            let mut queued: HashMap<u64, u64> = HashMap::new();
            let mut ended: HashMap<u64, u32> = HashMap::new();
            let mut now = t0;
            for (i, (op, size, parts, ttl)) in ops.into_iter().enumerate() {
                let id = i as u64;
                match op {
                    0 | 1 => {
                        let split = vec![size; parts as usize];
                        let deadline = now + Duration::from_millis(ttl);
                        match b.handle_reserve(now, ReservationId(id), &split, deadline) {
                            Ok(Reserved::Now) => { held.insert(id, size * parts); }
                            Ok(Reserved::Queued) => { queued.insert(id, size * parts); }
                            Err(_) => {}
                        }
                    }
                    2 => {
                        if let Some(k) = held.keys().next().copied() {
                            let bytes = held.remove(&k).unwrap_or(0);
                            b.handle_release(bytes);
                        }
                    }
                    _ => {
                        now += Duration::from_millis(ttl);
                        b.handle_timeout(now);
                    }
                }
                while let Some(ev) = b.poll_event() {
                    let (ReservationEvent::Granted(r) | ReservationEvent::TimedOut(r)) = ev;
                    *ended.entry(r.0).or_default() += 1;
                    let total = queued.remove(&r.0);
                    prop_assert!(total.is_some(), "event for a reservation not waiting");
                    if let (ReservationEvent::Granted(_), Some(t)) = (ev, total) {
                        held.insert(r.0, t);
                    }
                }
                let stats = b.stats();
                prop_assert!(stats.granted <= stats.capacity);
                prop_assert_eq!(stats.granted, held.values().sum::<u64>());
                prop_assert_eq!(stats.waiting, queued.len());
                prop_assert!(stats.waiting <= 16);
            }
            prop_assert!(ended.values().all(|n| *n == 1));
        }
    }
}
