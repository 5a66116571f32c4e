//! The shm lane: small host-memory sends to a same-host peer without the session's round
//! trip (offer, grant, `Done` over the socket, each through both actors). The sender's
//! task writes a record ([`ShmLaneRecord`]: the tag and where the buffer lies in its pool)
//! into a ring both processes map ([`crate::transport::lane::LaneTx`], with
//! [`PoolRecords`]); the receiver's lane thread ([`ShmLaneRx`]) reads it, takes a host
//! buffer from its receive tiers, copies the bytes out of its mapping of the sender's pool
//! and delivers the buffer to the inbox in the peer's order; the sender's watcher sees the
//! slot finished and completes the send. Offered with the setup request, taken by the
//! receiver with its probe ([`super::setup`]).
//!
//! Sends up to `transport.shm.lane_max` bytes take it, when the rules send them over shm by
//! pull and nothing to the peer goes the slow way; a buffer not in the pool never does.
//! The rules of ipc's lane hold: the peer's share bounds what the lane delivered and the
//! application did not take; a record the receiver cannot take goes back with its reason;
//! a sender whose deadline passes gets no buffer back (the peer may still copy it: it is
//! held for the lease timeout); when either side's session ends the ring closes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferry_config::MemoryClass;

use super::ShmError;
use super::imports::PeerPool;
use super::peer::{copy_out, pool_source};
use super::pool::Pool;
use super::wire::{ShmLaneRecord, ShmSource};
use crate::link::ring::Ring;
use crate::memory::{Buffer, Fill, MemoryKind};
use crate::transport::lane::{LaneWriter, PARK, ShareWait, wait_for_share};
use crate::transport::{Deliveries, ReceiveMemory};
use crate::wire::Layout;

/// Records in flight on an shm lane.
pub const SLOTS: u32 = 64;
/// Bytes per slot: a record (about 80 bytes) or a reason.
pub const SLOT_LEN: u32 = 512;

/// The records of the shm lane: host buffers of our pool of at most `max` bytes.
pub struct PoolRecords {
    /// Our pool.
    pub pool: Arc<Pool>,
    /// Largest buffer put on the lane.
    pub max: usize,
    /// Where a buffer the peer may still read waits out the lease.
    pub io: tokio::runtime::Handle,
    /// How long (`memory.export_lease_timeout`).
    pub lease: Duration,
}

impl PoolRecords {
    fn source(&self, buffer: &Buffer) -> Option<ShmSource> {
        pool_source(&self.pool, buffer.source_memory(), buffer.len())
    }
}

impl LaneWriter for PoolRecords {
    fn transport(&self) -> ferry_config::TransportName {
        ShmSource::TRANSPORT
    }

    fn memory(&self) -> MemoryClass {
        MemoryClass::Host
    }

    fn fits(&self, buffer: &Buffer) -> bool {
        buffer.kind() == MemoryKind::Host
            && buffer.len() <= self.max
            && self.source(buffer).is_some()
    }

    fn record(&self, tag: u64, buffer: &Buffer) -> Result<Vec<u8>, String> {
        let source = self
            .source(buffer)
            .ok_or("the buffer is not in the shared-memory pool")?;
        (ShmLaneRecord { tag, source }.encode()).map_err(|e| e.to_string())
    }

    /// Held for the lease timeout: the peer may still be copying it.
    fn abandon(&self, buffer: Buffer) {
        let lease = self.lease;
        self.io.spawn(async move {
            tokio::time::sleep(lease).await;
            drop(buffer);
        });
    }
}

/// What the receiving lane thread needs from its session.
pub struct RxContext {
    /// The sending peer.
    pub peer: String,
    /// Its pool, as this node maps it.
    pub pool: Arc<PeerPool>,
    /// Where buffers go: the inbox, in the peer's order across its paths.
    pub deliveries: Arc<dyn Deliveries>,
    /// Where they land: the host receive tiers.
    pub memory: Arc<dyn ReceiveMemory>,
    /// The peer's share of our memory (`limits.peer_inbound_bytes`).
    pub share: u64,
    /// How long a reservation may wait.
    pub reserve_timeout: Duration,
    /// The node's I/O runtime (a segment's first fetch, a reservation that waits).
    pub io: tokio::runtime::Handle,
    /// How long the thread spins for the next record before it parks.
    pub spin: Duration,
}

/// The receiving end of an shm lane: its thread runs until [`ShmLaneRx::stop`] or the ring
/// closes.
pub struct ShmLaneRx {
    stop: Arc<AtomicBool>,
}

impl ShmLaneRx {
    /// Attaches to `ring` and starts the lane's thread.
    ///
    /// # Errors
    /// When the thread cannot start.
    pub fn start(ring: Ring, cx: RxContext) -> std::io::Result<ShmLaneRx> {
        let ring = Arc::new(ring);
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s) = (Arc::clone(&ring), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("ferry-shm-lane".into())
            .spawn(move || receive(&r, &s, &cx))?;
        ring.attach();
        Ok(ShmLaneRx { stop })
    }

    /// Stops the thread after the record it handles now (within the park interval when it
    /// sleeps); it closes the ring as it leaves.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl Drop for ShmLaneRx {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The lane thread: each record in turn is copied, delivered and finished; spins `spin`
/// for the next, then parks on the ring.
fn receive(ring: &Ring, stop: &AtomicBool, cx: &RxContext) {
    let mut next = 0u64;
    let mut record = Vec::with_capacity(ring.room());
    let mut idle_since = Instant::now();
    while !stop.load(Ordering::SeqCst) {
        let head = match ring.published(next) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(peer = %cx.peer, "shm lane closed: {e}");
                break;
            }
        };
        if head == next {
            if ring.is_closed() {
                break;
            }
            if idle_since.elapsed() < cx.spin {
                std::hint::spin_loop();
            } else {
                ring.park_consumer(next, PARK);
            }
            continue;
        }
        let taken = match ring.read(next, &mut record) {
            Ok(()) => take(&record, cx, stop),
            Err(e) => Err(TakeError::BadRecord(e.to_string())),
        };
        // Finished once the buffer has its place in the inbox, before the receive waiting
        // for it is woken (`taken` going): the sender does not wait for that wake-up.
        let outcome = taken.as_ref().map(|_| ()).map_err(ToString::to_string);
        if let Err(why) = &outcome {
            tracing::warn!(peer = %cx.peer, "an shm lane transfer failed: {why}");
            metrics::counter!("ferry_pull_failures_total").increment(1);
        }
        ring.finish(next, outcome.as_ref().copied().map_err(String::as_str));
        next += 1;
        drop(taken);
        idle_since = Instant::now();
    }
    ring.close();
}

/// Why a record was not taken (its words go back to the sender in the ring).
#[derive(Debug, thiserror::Error)]
enum TakeError {
    /// The record is not one.
    #[error("a bad shm lane record: {0}")]
    BadRecord(String),
    /// The record names memory that is not the peer's pool as we know it.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// No memory to land it in.
    #[error("{0}")]
    Memory(String),
    /// This end stopped.
    #[error("the receiver stopped")]
    Stopped,
}

/// Takes one record: its landing, its bytes, its delivery; what wakes its receive when it
/// drops.
fn take(bytes: &[u8], cx: &RxContext, stop: &AtomicBool) -> Result<Box<dyn Send>, TakeError> {
    let started = Instant::now();
    let record = ShmLaneRecord::read(bytes).map_err(|e| TakeError::BadRecord(e.to_string()))?;
    let source = record.source;
    if source.len == 0 {
        return Err(TakeError::BadRecord("an empty shm lane record".into()));
    }
    let segment = match cx.pool.segment_now(&source)? {
        Some(segment) => segment,
        None => cx.io.block_on(cx.pool.segment(&source))?,
    };
    wait_for_share(
        &*cx.deliveries,
        cx.share,
        source.len,
        cx.reserve_timeout,
        stop,
    )
    .map_err(|e| match e {
        ShareWait::Stopped => TakeError::Stopped,
        full => TakeError::Memory(full.to_string()),
    })?;
    let into = match cx.memory.now(source.len, None, Fill::Overwritten) {
        Some(buffer) => buffer,
        None => {
            let deadline = Instant::now() + cx.reserve_timeout;
            (cx.io.block_on(cx.memory.wait(source.len, deadline))).map_err(TakeError::Memory)?
        }
    };
    let len = source.len;
    let landed = copy_out(&segment, &source, &Layout::Contiguous, into)?;
    let copied = started.elapsed();
    let wake = (cx.deliveries)
        .deliver_in_order(ShmSource::TRANSPORT, record.tag, landed, stop)
        .ok_or(TakeError::Stopped)?;
    tracing::trace!(
        peer = %cx.peer,
        bytes = len,
        copy_us = copied.as_micros() as u64,
        deliver_us = (started.elapsed() - copied).as_micros() as u64,
        "shm lane record delivered"
    );
    Ok(wake)
}
