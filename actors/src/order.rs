//! Order between the lane and the slow path, per peer: lane sends start only while no slow
//! send runs, slow sends pass in first-poll order, and a receiver's lane record waits for
//! the slow transfers that completed before it.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// Per peer, how many sends are under way on the lane and on the slow path: at most one of
/// the two is non-zero, so the peer's buffers arrive in send order. Slow sends pass the
/// gate in the order they were first polled (tickets), so waiting for the lane to drain
/// never reorders them.
#[derive(Debug, Default)]
pub struct Order {
    state: Mutex<OrderState>,
    changed: Notify,
    /// Slow sends (and puts, fetches) handed to the coordinator whose answer has not come:
    /// while any has not, the next goes through the coordinator too, since it may not have
    /// passed the earlier ones to the peer's transfer actor yet.
    coordinator: std::sync::atomic::AtomicUsize,
}

#[derive(Debug, Default)]
struct OrderState {
    lane: usize,
    /// The lane of the lane sends under way: another lane's send waits for them (each
    /// lane's receiver delivers on its own thread).
    lane_of: Option<ferry_config::TransportName>,
    slow: usize,
    /// The next slow send's ticket, and the ticket whose turn it is to pass.
    tickets: u64,
    turn: u64,
    /// Tickets whose send was dropped before its turn.
    gave_up: std::collections::BTreeSet<u64>,
}

impl OrderState {
    fn advance(&mut self) {
        self.turn += 1;
        while self.gave_up.remove(&self.turn) {
            self.turn += 1;
        }
    }
}

impl Order {
    /// Whether no message to the coordinator for this peer is still unanswered: then a send
    /// may go to the peer's transfer actor directly and stay in order.
    pub fn coordinator_idle(&self) -> bool {
        self.coordinator.load(Ordering::Acquire) == 0
    }

    /// Counts a message handed to the coordinator until the guard drops (its answer came,
    /// or the caller gave up).
    pub fn via_coordinator(self: &Arc<Self>) -> ViaCoordinator {
        self.coordinator.fetch_add(1, Ordering::AcqRel);
        ViaCoordinator(Arc::clone(self))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, OrderState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a send on `lane`'s fast path, unless a slow one is under way, `max` lane sends
    /// are, or sends on another lane are (then the caller takes the slow path, behind
    /// them). With at most a ring's worth in flight, a lane send finds its slot free and
    /// publishes before its first `await`, so lane records leave in the order the sends
    /// were first polled.
    pub fn try_lane(
        self: &Arc<Self>,
        max: usize,
        lane: ferry_config::TransportName,
    ) -> Option<OrderGuard> {
        let mut s = self.state();
        let other = s.lane > 0 && s.lane_of != Some(lane);
        if s.slow > 0 || s.lane >= max || other {
            return None;
        }
        s.lane += 1;
        s.lane_of = Some(lane);
        Some(OrderGuard {
            order: Arc::clone(self),
            ticket: None,
        })
    }

    /// Starts a slow send, once the lane sends before it completed and the slow sends
    /// before it passed. It counts from its first poll, so lane sends asked for after it
    /// queue behind it. The next slow send waits until this one [passes](OrderGuard::pass)
    /// (or is dropped): the caller passes once its message is queued, so slow sends queue
    /// their messages in ticket order too, whatever order the runtime wakes them in.
    pub async fn slow(self: &Arc<Self>) -> OrderGuard {
        let guard = {
            let mut s = self.state();
            s.slow += 1;
            s.tickets += 1;
            OrderGuard {
                order: Arc::clone(self),
                ticket: Some((s.tickets - 1, false)),
            }
        };
        let Some((ticket, _)) = guard.ticket else {
            return guard;
        };
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let s = self.state();
                if s.lane == 0 && s.turn == ticket {
                    return guard;
                }
            }
            changed.await;
        }
    }
}

/// A send under way (or a slow one waiting for its turn); dropping it ends it.
#[derive(Debug)]
pub struct OrderGuard {
    order: Arc<Order>,
    /// A slow send's ticket and whether it passed; `None` for a lane send.
    ticket: Option<(u64, bool)>,
}

impl OrderGuard {
    /// Lets the next slow send go: this one's message is queued. A no-op for a lane send
    /// and after the first call.
    pub fn pass(&mut self) {
        let Some((ticket, false)) = self.ticket else {
            return;
        };
        self.ticket = Some((ticket, true));
        self.order.state().advance();
        self.order.changed.notify_waiters();
    }
}

impl Drop for OrderGuard {
    fn drop(&mut self) {
        let mut s = self.order.state();
        match self.ticket {
            None => s.lane -= 1,
            Some((ticket, passed)) => {
                s.slow -= 1;
                if !passed {
                    if s.turn == ticket {
                        s.advance();
                    } else {
                        s.gave_up.insert(ticket);
                    }
                }
            }
        }
        drop(s);
        self.order.changed.notify_waiters();
    }
}

/// Counts, on the receiver, slow transfers from one peer that completed (the peer may
/// already know) but are not in the inbox yet. Lane records wait for it to reach zero,
/// asleep (the last one's delivery wakes them).
#[derive(Debug, Default, Clone)]
pub struct Undelivered(Arc<Count>);

#[derive(Debug, Default)]
struct Count {
    pending: Mutex<u64>,
    clear: std::sync::Condvar,
}

impl Count {
    fn pending(&self) -> std::sync::MutexGuard<'_, u64> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Undelivered {
    /// One more completed transfer on its way to the inbox; the guard's drop counts it
    /// delivered (or dropped).
    pub fn enter(&self) -> Pending {
        *self.0.pending() += 1;
        Pending(Arc::clone(&self.0))
    }

    /// Waits until no slow transfer is on its way to the inbox; false when `stop` was set
    /// first (looked at every millisecond).
    pub(crate) fn wait_clear(&self, stop: &std::sync::atomic::AtomicBool) -> bool {
        let mut pending = self.0.pending();
        while *pending > 0 {
            if stop.load(Ordering::SeqCst) {
                return false;
            }
            pending = match self
                .0
                .clear
                .wait_timeout(pending, std::time::Duration::from_millis(1))
            {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
        true
    }
}

/// A message to the coordinator not answered yet (see [`Order::via_coordinator`]).
#[derive(Debug)]
pub struct ViaCoordinator(Arc<Order>);

impl Drop for ViaCoordinator {
    fn drop(&mut self) {
        self.0.coordinator.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A completed slow transfer not yet in the inbox (see [`Undelivered`]).
#[derive(Debug)]
pub struct Pending(Arc<Count>);

impl Drop for Pending {
    fn drop(&mut self) {
        let mut pending = self.0.pending();
        *pending = pending.saturating_sub(1);
        if *pending == 0 {
            self.0.clear.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IPC: ferry_config::TransportName = ferry_config::TransportName::Ipc;
    const SHM: ferry_config::TransportName = ferry_config::TransportName::Shm;

    /// A lane record waits, asleep, until the last slow transfer ahead of it is delivered,
    /// and stops waiting when its thread is told to stop.
    #[test]
    fn a_record_waits_for_the_slow_transfers_ahead_and_no_longer() {
        let undelivered = Undelivered::default();
        let stop = std::sync::atomic::AtomicBool::new(false);
        assert!(undelivered.wait_clear(&stop), "nothing pending: no wait");
        let (a, b) = (undelivered.enter(), undelivered.enter());
        let started = std::time::Instant::now();
        let delivering = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            drop(a);
            std::thread::sleep(std::time::Duration::from_millis(20));
            drop(b);
        });
        assert!(undelivered.wait_clear(&stop));
        assert!(
            started.elapsed() >= std::time::Duration::from_millis(40),
            "returned before the last delivery"
        );
        delivering.join().expect("the delivering thread");
        let _held = undelivered.enter();
        stop.store(true, Ordering::SeqCst);
        assert!(
            !undelivered.wait_clear(&stop),
            "a stopped lane stops waiting"
        );
    }

    #[tokio::test]
    async fn slow_sends_pass_in_ticket_order_even_when_one_gives_up() {
        let order = Arc::new(Order::default());
        let lane = order.try_lane(4, IPC).expect("lane");
        let mut first = Box::pin(order.slow());
        let mut second = Box::pin(order.slow());
        let mut third = Box::pin(order.slow());
        for f in [&mut first, &mut second, &mut third] {
            assert!(futures::poll!(f.as_mut()).is_pending());
        }
        drop(second);
        drop(lane);
        // The third may not pass before the first; the second's ticket is skipped.
        assert!(futures::poll!(third.as_mut()).is_pending());
        let mut first = first.await;
        // Its turn is held until it passes.
        assert!(futures::poll!(third.as_mut()).is_pending());
        first.pass();
        drop(third.await);
        drop(first);
        assert!(order.try_lane(4, IPC).is_some());
    }

    #[tokio::test]
    async fn a_waiting_slow_send_keeps_later_lane_sends_off_the_lane() {
        let order = Arc::new(Order::default());
        let lane = order.try_lane(1, IPC).expect("nothing slow under way");
        assert!(order.try_lane(1, IPC).is_none(), "one lane send at most");
        let slow = tokio::spawn({
            let order = Arc::clone(&order);
            async move { order.slow().await }
        });
        tokio::task::yield_now().await;
        while order.state().slow == 0 {
            tokio::task::yield_now().await;
        }
        assert!(!slow.is_finished(), "the slow send waits for the lane send");
        assert!(
            order.try_lane(2, IPC).is_none(),
            "a later lane send must queue behind it"
        );
        drop(lane);
        let slow = slow.await.expect("the slow send starts");
        assert!(order.try_lane(2, IPC).is_none());
        drop(slow);
        assert!(order.try_lane(2, IPC).is_some(), "the lane is free again");
    }

    #[test]
    fn sends_on_another_lane_wait_for_the_lane_in_use() {
        let order = Arc::new(Order::default());
        let ipc = order.try_lane(8, IPC).expect("nothing under way");
        assert!(
            order.try_lane(8, SHM).is_none(),
            "another lane's receiver could deliver first"
        );
        let again = order
            .try_lane(8, IPC)
            .expect("the same lane keeps its order");
        drop((ipc, again));
        assert!(order.try_lane(8, SHM).is_some(), "no lane send under way");
    }
}
