//! Bytes given back by dropped buffers, on their way to the domain's actor, and the word
//! that memory was kept (or freed into a GPU's pool) with no sweep armed for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use ferry_transports::memory::{Lease, Releaser};
use tokio::sync::Notify;

use super::Domain;
use super::shelf::Kept;

/// Counts bytes given back by dropped buffers until the actor collects them.
///
/// The collecting task is woken at once while reservations wait (`wanted`); otherwise once
/// per [`RETURN_COALESCE`] at most (`armed`): a thread dropping a buffer per transfer then
/// pays no wake-up of the actor's thread (an eventfd write) per buffer, and a reservation
/// made on a caller's thread collects what came back itself.
#[derive(Debug, Default)]
pub(super) struct ReturnedBytes {
    pub(super) bytes: AtomicU64,
    pub(super) wake: Notify,
    /// A wake-up is on its way (the collector has not swapped the count since).
    pub(super) armed: AtomicBool,
    /// Reservations wait at the actor: every return may grant one.
    pub(super) wanted: AtomicBool,
    /// Memory was kept, or freed into the domain's pool, with no sweep armed: the actor
    /// arms one.
    pub(super) unswept: AtomicBool,
}

/// How long the collecting task gathers returns before it tells the actor, while no
/// reservation waits (the domain's gauges lag by this much at most).
pub(super) const RETURN_COALESCE: Duration = Duration::from_millis(1);

impl ReturnedBytes {
    pub(super) fn release_bytes(&self, bytes: u64) {
        // SeqCst with `wanted`: the actor sets `wanted`, then reads `bytes`; a release
        // adds to `bytes`, then reads `wanted`: one of the two sees the other.
        self.bytes.fetch_add(bytes, Ordering::SeqCst);
        if self.wanted.load(Ordering::SeqCst) || !self.armed.swap(true, Ordering::SeqCst) {
            self.wake.notify_one();
        }
    }
}

impl ReturnedBytes {
    /// Tells the actor (through the collecting task, as returned bytes) that memory waits
    /// for a sweep no timer is armed for.
    pub(super) fn ask_for_sweep(&self) {
        // SeqCst with `armed`: the collector clears `armed`, then takes `unswept`; this
        // sets `unswept`, then `armed`: the collector either sees the flag or is woken.
        self.unswept.store(true, Ordering::SeqCst);
        if !self.armed.swap(true, Ordering::SeqCst) {
            self.wake.notify_one();
        }
    }
}

impl Releaser for ReturnedBytes {
    fn release(&self, lease: &Lease) {
        self.release_bytes(lease.len);
    }
}

/// How a domain's buffers give their bytes back: to the budget, and host memory worth
/// keeping to the domain's shelf.
#[derive(Debug)]
pub(super) struct DomainReturn {
    pub(super) returned: Arc<ReturnedBytes>,
    pub(super) domain: std::sync::Weak<Domain>,
}

impl Releaser for DomainReturn {
    fn release(&self, lease: &Lease) {
        self.returned.release(lease);
        // Device memory freed without passing by the shelf (peers kept it mapped until
        // now): it went back into the pool.
        if let Some(domain) = self.domain.upgrade() {
            domain.freed_to_pool();
        }
    }

    fn release_host(&self, lease: &Lease, bytes: Box<[u8]>) {
        self.returned.release(lease);
        self.shelve(Kept::Host(bytes));
    }

    fn release_device(&self, lease: &Lease, memory: ferry_transports::cuda::DeviceBuffer) {
        self.returned.release(lease);
        self.shelve(Kept::Device(memory));
    }
}

impl DomainReturn {
    /// Offers memory to the domain's shelf (freed here when not kept).
    fn shelve(&self, memory: Kept) {
        // Small host memory goes back to the heap with no word to the domain (device
        // memory of any size tells it: the pool keeps what is freed into it).
        if matches!(memory, Kept::Host(_)) && !memory.worth_keeping() {
            return;
        }
        if let Some(domain) = self.domain.upgrade() {
            domain.shelve(memory);
        }
    }
}
