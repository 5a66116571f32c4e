//! Where delivered buffers wait for `recv`: a [`Mailroom`] shared, behind one lock, by the
//! coordinator (which delivers) and the node's API (which receives), so a `recv` needs no
//! actor hop and is cancel safe.
//!
//! A waiting `recv` owns a slot. Delivery puts a buffer into the first live matching slot
//! and wakes it; a `recv` whose future is dropped closes its slot under the lock and gives
//! back a buffer that had already landed in it, to the next matching receiver. No buffer is
//! lost to a caller that went away.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use dashmap::DashMap;
use ferry_config::TransportName;
use ferry_transports::memory::Buffer;
use ferry_transports::wire::Layout;
use tokio::sync::Notify;

use crate::core::mailroom::Mailroom;
use crate::error::Error;

/// A received buffer.
#[derive(Debug)]
pub struct Received {
    /// The data.
    pub buffer: Buffer,
    /// Who sent it.
    pub peer: String,
    /// Its tag.
    pub tag: u64,
    /// The transport it came over (its `Display` and [`TransportName::as_str`] say `"tcp"`,
    /// `"ipc"`, ...): says whether the fast path was taken.
    pub transport: TransportName,
    /// How the bytes lay in the sender's buffer. `buffer` holds them packed (the rows one
    /// after the other); [`Layout::scatter`] puts them back in that shape.
    pub layout: Layout,
}

/// A buffer waiting for a `recv`, with what the receive reports about it.
#[derive(Debug)]
struct Item {
    buffer: Buffer,
    transport: TransportName,
    layout: Layout,
    /// Delivered by the peer's lane (counted in [`Claims::lane_taken`] when taken).
    lane: bool,
}

impl Item {
    fn received(self, peer: String, tag: u64) -> Received {
        Received {
            buffer: self.buffer,
            peer,
            tag,
            transport: self.transport,
            layout: self.layout,
        }
    }
}

/// Buffers waiting for a `recv` (with the transport each came over), and parked receives.
type Room = Mailroom<Item, Arc<Slot>>;

#[derive(Debug, Default)]
struct Slot {
    item: Mutex<Option<Received>>,
    wake: Notify,
    closed: AtomicBool,
}

impl Slot {
    fn put(&self, item: Received) {
        self.fill(item);
        self.wake.notify_one();
    }

    /// Puts `item` in without waking the receive (a [`Wake`] does that later): a receive
    /// that polls takes it at once, and one dropped meanwhile gives it back.
    fn fill(&self, item: Received) {
        if let Ok(mut s) = self.item.lock() {
            *s = Some(item);
        }
    }

    fn take(&self) -> Option<Received> {
        self.item.lock().ok().and_then(|mut s| s.take())
    }

    fn is_live(slot: &Arc<Slot>) -> bool {
        !slot.closed.load(Ordering::Acquire)
    }
}

/// The wake-up of a receive that a delivery was handed to ([`Inbox::deliver_lane`] returns it):
/// done when this goes (a futex call, ~2 µs on the H100, that the sender need not wait for).
#[must_use = "dropping it wakes the receive at once"]
#[derive(Debug)]
pub struct Wake(Option<Arc<Slot>>);

impl Drop for Wake {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            slot.wake.notify_one();
        }
    }
}

/// Running totals, in bytes, of one peer's deliveries that a `recv` may take: together
/// with what its actor delivered, they say how much the peer holds in the inbox.
#[derive(Debug, Default)]
pub struct Claims {
    /// Delivered by the peer's fast lane (which bypasses its actor).
    pub lane: AtomicU64,
    /// Taken by `recv` calls, whatever delivered them.
    pub taken: AtomicU64,
    /// Of what the lane delivered, what `recv` took (or a waiting `recv` was handed): the
    /// lane holds its own deliveries to the peer's share with it.
    pub lane_taken: AtomicU64,
}

/// Delivered buffers and the `recv` calls waiting for them.
#[derive(Debug)]
pub struct Inbox {
    room: Mutex<Room>,
    stopped: AtomicBool,
    /// How long a waiting receive polls its slot before it sleeps.
    spin: std::time::Duration,
    /// Per peer, what its fast lane delivered and what `recv` took, for the peer's share
    /// of this node's memory (what the peer's actor delivered, it counts itself).
    claims: DashMap<String, Arc<Claims>>,
}

impl Inbox {
    /// An inbox that parks at most `waiters_cap` receives; a waiting receive polls its
    /// slot for `spin` before it sleeps (`node.recv_spin`).
    pub fn new(waiters_cap: usize, spin: std::time::Duration) -> Self {
        Self {
            room: Mutex::new(Mailroom::new(waiters_cap)),
            stopped: AtomicBool::new(false),
            spin,
            claims: DashMap::new(),
        }
    }

    /// `peer`'s counts of bytes its fast lane delivered and `recv` took (shared: they
    /// grow as buffers arrive and are taken).
    pub fn claims(&self, peer: &str) -> Arc<Claims> {
        Arc::clone(self.claims.entry(peer.to_string()).or_default().value())
    }

    fn taken(&self, peer: &str, len: usize) {
        self.claims(peer)
            .taken
            .fetch_add(len as u64, Ordering::Relaxed);
    }

    fn room(&self) -> Result<MutexGuard<'_, Room>, Error> {
        // A panic while holding the lock leaves the mailroom consistent (every operation
        // is a single push or remove), so a poisoned lock is still usable.
        Ok(self.room.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// A buffer from `peer` under `tag` arrived, in the peer's order: its bytes packed, as
    /// they lay in the sender's buffer by `layout`.
    pub fn deliver(
        &self,
        peer: &str,
        tag: u64,
        transport: TransportName,
        layout: Layout,
        buffer: Buffer,
    ) {
        let item = Item {
            buffer,
            transport,
            layout,
            lane: false,
        };
        drop(self.put(peer, tag, item));
    }

    /// A contiguous buffer from `peer`'s lane arrived, standing in for a pull over
    /// `transport`: as [`Self::deliver`], and counted in the peer's [`Claims::lane`] (and
    /// `lane_taken` once taken). Its place in the peer's order is taken now; a receive
    /// waiting for it is woken when the returned [`Wake`] goes (the lane first tells the
    /// sender that its bytes arrived).
    pub fn deliver_lane(
        &self,
        peer: &str,
        tag: u64,
        transport: TransportName,
        buffer: Buffer,
    ) -> Wake {
        self.claims(peer)
            .lane
            .fetch_add(buffer.len() as u64, Ordering::Relaxed);
        let item = Item {
            buffer,
            transport,
            layout: Layout::Contiguous,
            lane: true,
        };
        self.put(peer, tag, item)
    }

    /// Queues `item`, or hands it to the first live receive waiting for it, which the
    /// returned [`Wake`] wakes (after the inbox's lock is released).
    fn put(&self, peer: &str, tag: u64, item: Item) -> Wake {
        let Ok(mut room) = self.room() else {
            return Wake(None);
        };
        let Some((slot, item)) = room.deliver(peer, tag, item, Slot::is_live) else {
            return Wake(None);
        };
        if item.lane {
            self.lane_taken(peer, item.buffer.len());
        }
        slot.fill(item.received(peer.to_string(), tag));
        Wake(Some(slot))
    }

    fn lane_taken(&self, peer: &str, len: usize) {
        self.claims(peer)
            .lane_taken
            .fetch_add(len as u64, Ordering::Relaxed);
    }

    /// The oldest buffer from `from` (or anyone) under `tag` (or any tag), waiting for one.
    ///
    /// # Cancel safety
    /// Cancel safe: a buffer that reached this call after its future was dropped goes to
    /// the next matching `recv`, ahead of later arrivals.
    pub async fn recv(&self, from: Option<&str>, tag: Option<u64>) -> Result<Received, Error> {
        if self.stopped.load(Ordering::Acquire) {
            return Err(Error::ShuttingDown);
        }
        let slot = Arc::new(Slot::default());
        match self
            .room()?
            .recv(from, tag, Arc::clone(&slot), Slot::is_live)
        {
            Ok(Some((peer, tag, item))) => {
                self.taken(&peer, item.buffer.len());
                if item.lane {
                    self.lane_taken(&peer, item.buffer.len());
                }
                return Ok(item.received(peer, tag));
            }
            Ok(None) => {}
            Err((too_many, _)) => return Err(Error::QueueFull(too_many.to_string())),
        }
        let mut guard = Parked {
            inbox: self,
            slot,
            armed: true,
        };
        // Polled first for a while when asked to (a sleeping task pays a wake-up).
        let started = std::time::Instant::now();
        while started.elapsed() < self.spin {
            if let Some(item) = guard.slot.take() {
                guard.disarm();
                self.taken(&item.peer, item.buffer.len());
                return Ok(item);
            }
            std::hint::spin_loop();
        }
        loop {
            if let Some(item) = guard.slot.take() {
                guard.disarm();
                self.taken(&item.peer, item.buffer.len());
                return Ok(item);
            }
            if self.stopped.load(Ordering::Acquire) {
                return Err(Error::ShuttingDown);
            }
            guard.slot.wake.notified().await;
        }
    }

    /// Stops: waiting receives end with `ShuttingDown`; undelivered buffers are freed.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        let Ok(mut room) = self.room() else { return };
        drop(room.drain());
        for slot in room.drain_waiters() {
            slot.wake.notify_one();
        }
    }
}

/// A parked receive; dropping it before it got its buffer closes the slot and gives back
/// whatever landed in it.
struct Parked<'a> {
    inbox: &'a Inbox,
    slot: Arc<Slot>,
    armed: bool,
}

impl Parked<'_> {
    /// The receive got its buffer: nothing to give back.
    fn disarm(&mut self) {
        self.slot.closed.store(true, Ordering::Release);
        self.armed = false;
    }
}

impl Drop for Parked<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(mut room) = self.inbox.room() else {
            return;
        };
        self.slot.closed.store(true, Ordering::Release);
        if let Some(got) = self.slot.take() {
            let item = Item {
                buffer: got.buffer,
                transport: got.transport,
                layout: got.layout,
                // A lane delivery was counted taken when it reached the slot.
                lane: false,
            };
            if let Some((next, item)) = room.requeue(&got.peer, got.tag, item, Slot::is_live) {
                next.put(item.received(got.peer, got.tag));
            }
        }
    }
}

/// The inbox as one peer's fast path delivers into it ([`Deliveries`]): after the slow
/// transfers of the peer that completed before, counted in the peer's [`Claims::lane`].
///
/// [`Deliveries`]: ferry_transports::transport::Deliveries
pub struct PathDeliveries {
    /// The inbox.
    pub inbox: Arc<Inbox>,
    /// The peer.
    pub peer: String,
    /// The peer's slow transfers on their way to the inbox.
    pub undelivered: crate::order::Undelivered,
}

impl ferry_transports::transport::Deliveries for PathDeliveries {
    fn deliver_in_order(
        &self,
        transport: TransportName,
        tag: u64,
        buffer: Buffer,
        stop: &AtomicBool,
    ) -> Option<Box<dyn Send>> {
        if !self.undelivered.wait_clear(stop) {
            return None;
        }
        let wake = (self.inbox).deliver_lane(&self.peer, tag, transport, buffer);
        Some(Box::new(wake))
    }

    fn held(&self) -> u64 {
        let claims = self.inbox.claims(&self.peer);
        claims
            .lane
            .load(Ordering::Relaxed)
            .saturating_sub(claims.lane_taken.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_transports::memory::{BufferId, Generation, Lease, MemoryKind, Releaser};

    struct Nobody;
    impl Releaser for Nobody {
        fn release(&self, _: &Lease) {}
    }

    fn buffer(len: u64) -> Buffer {
        let lease = Lease {
            kind: MemoryKind::Host,
            id: BufferId(1),
            generation: Generation(1),
            len,
        };
        Buffer::new_host(lease, Arc::new(Nobody))
    }

    /// What the lane holds of a peer's share is what it delivered less what `recv` took of
    /// its deliveries: the socket path's deliveries, taken or not, do not count there.
    #[tokio::test]
    async fn the_lane_counts_what_recv_takes_of_its_own_deliveries() {
        let inbox = Inbox::new(8, std::time::Duration::ZERO);
        let claims = inbox.claims("p");
        let held =
            || claims.lane.load(Ordering::Relaxed) - claims.lane_taken.load(Ordering::Relaxed);
        inbox.deliver("p", 1, TransportName::Tcp, Layout::Contiguous, buffer(100));
        drop(inbox.deliver_lane("p", 2, TransportName::Ipc, buffer(10)));
        assert_eq!(held(), 10);
        let got = inbox.recv(Some("p"), Some(1)).await.expect("tcp's");
        assert_eq!(got.buffer.len(), 100);
        assert_eq!(
            held(),
            10,
            "taking a socket delivery frees none of the lane's share"
        );
        let got = inbox.recv(Some("p"), Some(2)).await.expect("the lane's");
        assert_eq!((got.transport, got.buffer.len()), (TransportName::Ipc, 10));
        assert_eq!(held(), 0);
        // Handed straight to a waiting receive: counted taken then.
        let waiting = inbox.recv(Some("p"), Some(3));
        tokio::pin!(waiting);
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        drop(inbox.deliver_lane("p", 3, TransportName::Ipc, buffer(7)));
        assert_eq!(held(), 0);
        assert_eq!(waiting.await.expect("handed").buffer.len(), 7);
        assert_eq!(claims.taken.load(Ordering::Relaxed), 117);
    }

    /// A lane delivery handed to a waiting receive takes its place in the order at once,
    /// its wake-up comes later: the receive wakes only then, a later delivery cannot pass
    /// it, and a receive dropped before the wake gives the buffer to the next one.
    #[tokio::test]
    async fn a_lane_delivery_is_placed_before_its_receive_is_woken() {
        let inbox = Inbox::new(8, std::time::Duration::ZERO);
        let waiting = inbox.recv(Some("p"), None);
        tokio::pin!(waiting);
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        let wake = inbox.deliver_lane("p", 1, TransportName::Ipc, buffer(5));
        inbox.deliver("p", 2, TransportName::Tcp, Layout::Contiguous, buffer(6));
        drop(wake);
        let got = waiting.await.expect("woken");
        assert_eq!((got.tag, got.buffer.len()), (1, 5), "the lane's, first");
        assert_eq!(inbox.recv(Some("p"), None).await.expect("next").tag, 2);

        // Dropped between placing and waking: nothing lost.
        let mut dropped = Box::pin(inbox.recv(Some("p"), None));
        assert!(futures::poll!(dropped.as_mut()).is_pending());
        let wake = inbox.deliver_lane("p", 3, TransportName::Ipc, buffer(9));
        drop(dropped);
        drop(wake);
        let got = inbox.recv(Some("p"), None).await.expect("given back");
        assert_eq!((got.tag, got.buffer.len()), (3, 9));
    }
}
