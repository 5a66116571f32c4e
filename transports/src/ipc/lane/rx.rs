//! The receiving end of a lane: two threads. The issuing thread reserves each record's
//! landing and queues the copies of a batch (small ones as one gather); the delivering
//! thread waits for each copy, delivers the buffer, finishes its record (the sender's
//! `Done`) and then wakes the receive it was handed to, in order. So the next batch is
//! prepared and queued while the last one is copied and delivered, and the sender does not
//! wait for the application's wake-up.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{LANE_SLOTS, LaneSettings};
use crate::cuda::{CudaError, Device, DeviceMemory, Event};
use crate::gpus::SharedGpus;
use crate::ipc::{ImportedPools, LaneRecord, PoolImports, PoolSource, SharedImports};
use crate::link::ring::Ring;
use crate::memory::{Buffer, Fill};
use crate::transport::lane::{PARK, ShareWait, share_allows, wait_for_share};
use crate::transport::{Deliveries, ReceiveMemory};

/// Receive buffers a lane keeps allocated ahead.
const AHEAD: usize = 4;
/// Their size: records of at most this many bytes land in them; larger ones are reserved
/// when they arrive.
pub const AHEAD_LEN: usize = 64 << 10;

/// What a receiving lane thread needs from its session.
pub struct RxContext {
    /// The sending peer.
    pub peer: String,
    /// Its pools, imported by the ipc setup (or later, when a record names a new one).
    pub pools: Arc<PoolImports>,
    /// Where a pool a record names is fetched from when it was not imported yet.
    pub from: PoolSource,
    /// Its buffers we keep mapped (shared with the actor, which unmaps on request).
    pub imports: SharedImports,
    /// Our GPUs.
    pub gpus: SharedGpus,
    /// Where buffers go: the inbox, in the peer's order across its paths.
    pub deliveries: Arc<dyn Deliveries>,
    /// Where they land (the pulled transfers' tiers).
    pub memory: Arc<dyn ReceiveMemory>,
    /// The peer's share of our memory (`limits.peer_inbound_bytes`): what the lane
    /// delivered and the application did not take stays under it.
    pub share: u64,
    /// How long a reservation may wait.
    pub reserve_timeout: Duration,
    /// The node's I/O runtime (reservations run there).
    pub io: tokio::runtime::Handle,
    /// The lane's settings.
    pub settings: LaneSettings,
}

/// The receiving end of a lane: its thread runs until [`LaneRx::stop`] or the ring closes.
pub struct LaneRx {
    stop: Arc<AtomicBool>,
}

impl LaneRx {
    /// Attaches to `ring` and starts the lane's threads.
    ///
    /// # Errors
    /// When a thread cannot start (the other, if started, closes the ring and ends).
    pub fn start(ring: Ring, cx: RxContext) -> std::io::Result<LaneRx> {
        let ring = Arc::new(ring);
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            cx,
            events: Events::default(),
            flight: InFlight::default(),
        });
        // Bounded by the ring: no more records than its slots are ever queued.
        let (to_deliver, queued) = std::sync::mpsc::sync_channel(LANE_SLOTS as usize);
        let (r, s, sh) = (Arc::clone(&ring), Arc::clone(&stop), Arc::clone(&shared));
        std::thread::Builder::new()
            .name("ferry-lane-done".into())
            .spawn(move || deliver_all(&queued, &r, &s, &sh))?;
        let (r, s) = (Arc::clone(&ring), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("ferry-lane-rx".into())
            .spawn(move || issue(&r, &s, &shared, &to_deliver))?;
        ring.attach();
        Ok(LaneRx { stop })
    }

    /// Stops the thread after the record it handles now (within the park interval when it
    /// sleeps); the thread closes the ring as it leaves, so the sender knows that every
    /// record it did not finish was never read.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl Drop for LaneRx {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Receive buffers of [`AHEAD_LEN`] bytes allocated ahead, topped up while the lane is
/// idle once a small record came (an unused lane costs no memory).
#[derive(Default)]
struct Ahead {
    ready: Vec<Buffer>,
    primed: bool,
}

impl Ahead {
    /// Allocates up to [`AHEAD`] buffers, if it fits now (never waits).
    fn top_up(&mut self, cx: &RxContext) {
        while self.primed && self.ready.len() < AHEAD {
            match reserve(cx, AHEAD_LEN as u64, false, true) {
                Ok(buffer) => self.ready.push(buffer),
                Err(_) => break,
            }
        }
    }
}

/// What both lane threads share.
struct Shared {
    cx: RxContext,
    events: Events,
    flight: InFlight,
}

/// Records the issuing thread queued and the delivering thread did not finish yet, and
/// the bytes they landed: those count against the peer's share until delivered.
#[derive(Default)]
struct InFlight {
    records: AtomicU64,
    bytes: AtomicU64,
    /// The delivering thread left (it finishes nothing more).
    gone: AtomicBool,
}

/// Says, however the delivering thread leaves (a panic included), that it is gone.
struct Leaving<'a>(&'a AtomicBool);

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl InFlight {
    fn add(&self, len: usize) {
        self.bytes.fetch_add(len as u64, Ordering::SeqCst);
        self.records.fetch_add(1, Ordering::SeqCst);
    }

    fn done(&self, len: usize) {
        self.bytes.fetch_sub(len as u64, Ordering::SeqCst);
        self.records.fetch_sub(1, Ordering::SeqCst);
    }

    fn is_empty(&self) -> bool {
        self.records.load(Ordering::SeqCst) == 0
    }

    /// Waits until every queued record was delivered (or `stop`): spins a little, then
    /// naps (the delivering thread may wait for slow transfers of the peer).
    fn drain(&self, stop: &AtomicBool) {
        let started = Instant::now();
        while !self.is_empty() && !stop.load(Ordering::SeqCst) && !self.gone.load(Ordering::SeqCst)
        {
            if started.elapsed() < Duration::from_micros(50) {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

/// A record on its way from the issuing thread to the delivering one: its landing (whose
/// bytes are in flight), or why it was not taken.
type Queued = Result<Landing, TakeError>;

/// The bytes a queued record holds in flight.
fn in_flight(queued: &Queued) -> usize {
    queued.as_ref().map_or(0, |l| l.len)
}

/// The issuing thread: polls the ring, reserves the landings of every record published so
/// far (a batch at most), queues their copies and hands them, in order, to the delivering
/// thread, which is still delivering the previous batch meanwhile.
fn issue(ring: &Ring, stop: &AtomicBool, shared: &Shared, to_deliver: &SyncSender<Queued>) {
    let cx = &shared.cx;
    // The driver compiles the gather kernel at its first load: done here, before the
    // first record waits for it.
    if cx.settings.gather_max > 0
        && let Some(gpu) = cx.memory.device().and_then(|n| cx.gpus.get(n))
    {
        // Refused: logged once by the loader; records are copied one by one.
        let _ = crate::cuda::load_gather_kernel(&gpu.device);
    }
    let mut ahead = Ahead::default();
    let mut top_up = false;
    // The next record to read (the delivering thread finishes them, behind).
    let mut next = 0u64;
    let mut record = Vec::with_capacity(ring.room());
    let mut idle_since = Instant::now();
    loop {
        if stop.load(Ordering::SeqCst) || shared.flight.gone.load(Ordering::SeqCst) {
            break;
        }
        let head = match ring.published(next) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(peer = %cx.peer, "fast lane closed: {e}");
                break;
            }
        };
        if head == next {
            if ring.is_closed() {
                break;
            }
            if idle_since.elapsed() < cx.settings.spin {
                // Once per idle spell: what does not fit now is not asked again until the
                // next record.
                if std::mem::take(&mut top_up) {
                    ahead.top_up(cx);
                }
                std::hint::spin_loop();
            } else {
                ring.park_consumer(next, PARK);
            }
            continue;
        }
        let batch_started = Instant::now();
        let batch = prepare_batch(ring, next, head, shared, &mut ahead, stop, &mut record);
        if batch.is_empty() {
            // The next record waits (for memory or the peer's share) while records queued
            // earlier are not delivered yet: they go first (the application may be waiting
            // for them), then it may wait.
            shared.flight.drain(stop);
            continue;
        }
        let (records, prepared_at) = (batch.len(), batch_started.elapsed());
        for landing in queue(batch, cx, &shared.events) {
            shared.flight.add(in_flight(&landing));
            if to_deliver.send(landing).is_err() {
                // The delivering thread is gone: nothing more can be finished.
                ring.close();
                return;
            }
            next += 1;
        }
        tracing::trace!(
            peer = %cx.peer,
            records,
            published = head - next + records as u64,
            prepare_us = prepared_at.as_micros() as u64,
            queue_us = (batch_started.elapsed() - prepared_at).as_micros() as u64,
            "lane batch"
        );
        idle_since = Instant::now();
        top_up = true;
    }
    // Dropping the channel ends the delivering thread once it finished what was queued; it
    // closes the ring then (or this thread does, when that one is gone already).
    if shared.flight.gone.load(Ordering::SeqCst) {
        ring.close();
    }
}

/// Reads and prepares the records from `next` up to `head` (a batch at most). Only the
/// first may wait for memory or for the peer's share, and only when nothing queued earlier
/// is still undelivered; the batch ends before a record that would wait.
fn prepare_batch(
    ring: &Ring,
    next: u64,
    head: u64,
    shared: &Shared,
    ahead: &mut Ahead,
    stop: &AtomicBool,
    record: &mut Vec<u8>,
) -> Vec<Result<Prepared, TakeError>> {
    let mut batch = Vec::new();
    // Bytes landed and not delivered yet, this batch's included: the share counts them.
    let mut pending = shared.flight.bytes.load(Ordering::SeqCst);
    for seq in next..head.min(next + BATCH) {
        let first = batch.is_empty() && shared.flight.is_empty();
        let prepared = match ring.read(seq, record) {
            Ok(()) => prepare(record, &shared.cx, ahead, stop, first, pending),
            Err(e) => Err(TakeError::BadRecord(e.to_string())),
        };
        match prepared {
            Err(TakeError::NotNow) => break,
            other => {
                if let Ok(p) = &other {
                    pending += p.len as u64;
                }
                batch.push(other);
            }
        }
    }
    batch
}

/// The delivering thread: takes the queued records in order, waits for each copy, delivers
/// it, finishes its record and wakes its receive. Spins `lane_spin` for the next one, then
/// sleeps on the channel. Closes the ring once the issuing thread is gone and everything it
/// queued is finished.
fn deliver_all(queued: &Receiver<Queued>, ring: &Ring, stop: &AtomicBool, shared: &Shared) {
    let _leaving = Leaving(&shared.flight.gone);
    let cx = &shared.cx;
    let mut tail = 0u64;
    let mut idle_since = Instant::now();
    loop {
        let item = match queued.try_recv() {
            Ok(item) => item,
            Err(TryRecvError::Disconnected) => break,
            Err(TryRecvError::Empty) if idle_since.elapsed() < cx.settings.spin => {
                std::hint::spin_loop();
                continue;
            }
            Err(TryRecvError::Empty) => match queued.recv_timeout(PARK) {
                Ok(item) => item,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
            },
        };
        let flight = in_flight(&item);
        let placed = item
            .and_then(|l| copied(l, &shared.events))
            .and_then(|l| deliver(l, cx, stop));
        // The record is finished once the buffer has its place in the inbox, and before the
        // receive waiting for it is woken (`placed` going): the sender's `Done` does not
        // wait for that wake-up.
        let outcome = placed.as_ref().map(|_| ()).map_err(|why| why.to_string());
        if let Err(why) = &outcome {
            tracing::warn!(peer = %cx.peer, "a fast-lane transfer failed: {why}");
            metrics::counter!("ferry_pull_failures_total").increment(1);
        }
        ring.finish(tail, outcome.as_ref().copied().map_err(String::as_str));
        tail += 1;
        drop(placed);
        shared.flight.done(flight);
        idle_since = Instant::now();
    }
    ring.close();
}

/// Records whose copies a lane queues at once.
const BATCH: u64 = 16;

/// Events the lane records after each queued copy, reused (the issuing thread takes them,
/// the delivering thread gives them back). The same event records the copy's buffers' use
/// ([`crate::cuda::copy_async_marked`]), so one given back is taken again only
/// once no buffer refers to it any more (a later use of each replaced it): re-recorded
/// before, it would stand for another point of a stream than the one they need.
#[derive(Default)]
struct Events(Mutex<VecDeque<Arc<Event>>>);

impl Events {
    fn take(&self, device: &Device) -> Result<Event, CudaError> {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // Only this list holds a free one: no one else can clone it meanwhile.
        let free = kept
            .iter()
            .position(|e| Arc::strong_count(e) == 1 && e.device().same_as(device));
        match free.and_then(|i| kept.remove(i)).map(Arc::try_unwrap) {
            Some(Ok(event)) => Ok(event),
            _ => {
                drop(kept);
                Event::new(device)
            }
        }
    }

    /// Keeps `event` for reuse once the buffers its copy touched are done with it (once: the
    /// records of one gather share it); the oldest kept goes when there are more than
    /// enough.
    fn give_back(&self, event: Arc<Event>) {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if kept.iter().any(|e| Arc::ptr_eq(e, &event)) {
            return;
        }
        kept.push_back(event);
        if kept.len() > 4 * BATCH as usize {
            kept.pop_front();
        }
    }
}

/// A record with its landing reserved, its copy not queued yet.
struct Prepared {
    tag: u64,
    len: usize,
    source: crate::ipc::IpcSource,
    dst: Buffer,
    started: Instant,
    reserved: Duration,
}

/// A record whose copy is queued: its landing buffer, and what ends the copy.
struct Landing {
    tag: u64,
    len: usize,
    dst: Buffer,
    /// Recorded after the copy on its stream (shared by the records one gather copied);
    /// `None`: copied already.
    copied: Option<Arc<Event>>,
    started: Instant,
    /// When its landing was reserved, and its copy queued.
    reserved: Duration,
    queued: Duration,
}

/// Why a lane record was not taken (its words go back to the sender in the ring).
#[derive(Debug, thiserror::Error)]
enum TakeError {
    /// The record is not one.
    #[error("a bad lane record: {0}")]
    BadRecord(String),
    /// No memory to land it in.
    #[error("{0}")]
    Memory(String),
    /// The pull failed.
    #[error(transparent)]
    Pull(#[from] crate::ipc::IpcError),
    /// This end stopped.
    #[error("the receiver stopped")]
    Stopped,
    /// The application left the peer's share full (`limits.peer_inbound_bytes`) for this
    /// long.
    #[error(
        "the receiver's share for this peer stayed full for {0:?} (limits.peer_inbound_bytes): the application is not taking what arrives"
    )]
    ShareFull(Duration),
    /// Not in this batch: the record would wait (for memory, or for the peer's share)
    /// while earlier records of the batch are not delivered yet. Never sent to the peer.
    #[error("later")]
    NotNow,
}

/// Reserves one record's landing, `pending` bytes of the batch before it landed and not
/// delivered yet. Only the `first` of a batch may wait for memory or for the peer's share;
/// a later one answers [`TakeError::NotNow`] instead.
fn prepare(
    bytes: &[u8],
    cx: &RxContext,
    ahead: &mut Ahead,
    stop: &AtomicBool,
    first: bool,
    pending: u64,
) -> Result<Prepared, TakeError> {
    let started = Instant::now();
    let record = LaneRecord::decode(bytes).map_err(|e| TakeError::BadRecord(e.to_string()))?;
    let len = usize::try_from(record.len)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| TakeError::BadRecord(format!("a lane record of {} bytes", record.len)))?;
    if !share_allows(&*cx.deliveries, cx.share, pending, record.len) {
        if !first {
            return Err(TakeError::NotNow);
        }
        wait_for_share(
            &*cx.deliveries,
            cx.share,
            record.len,
            cx.reserve_timeout,
            stop,
        )
        .map_err(|e| match e {
            ShareWait::Stopped => TakeError::Stopped,
            ShareWait::Full(waited) => TakeError::ShareFull(waited),
        })?;
    }
    // Memory the peer registered is copied on another stream than the lane's: its landing
    // is allocated ready for every stream, not from the buffers ahead.
    let pooled = record.source.legacy.is_none();
    let ready = (len <= AHEAD_LEN && pooled)
        .then(|| {
            ahead.primed = true;
            ahead.ready.pop()
        })
        .flatten();
    let mut dst = match ready {
        Some(b) => b,
        None => reserve(cx, record.len, first, pooled)?,
    };
    dst.truncate(len)
        .map_err(|e| TakeError::BadRecord(e.to_string()))?;
    Ok(Prepared {
        tag: record.tag,
        len,
        source: record.source,
        dst,
        started,
        reserved: started.elapsed(),
    })
}

/// Queues the copies of a batch: those up to `gather_max` from the peer's pool into one
/// GPU's memory as gathers ([`crate::ipc::queue_pulls`]: one kernel launch instead of a
/// copy engine's copy each; one launch for the small records on the express stream, one
/// for the larger on the copy stream), the others one by one. Each comes back with an
/// event recorded after its copy.
fn queue(
    batch: Vec<Result<Prepared, TakeError>>,
    cx: &RxContext,
    events: &Events,
) -> Vec<Result<Landing, TakeError>> {
    let mut batch = batch;
    let pools = batch_pools(&batch, cx);
    let gathers: Vec<_> = [true, false]
        .into_iter()
        .filter_map(|express| gather(&mut batch, cx, &pools, events, express))
        .collect();
    batch
        .into_iter()
        .map(|p| {
            let p = p?;
            let gathered = gathers
                .iter()
                .find(|g| gatherable(&p, cx, Some(&g.device), g.express))
                .map(|g| Arc::clone(&g.event));
            let (dst, copied) = match gathered {
                Some(event) => (p.dst, Some(event)),
                None => {
                    let express = p.len <= AHEAD_LEN;
                    let queued = crate::ipc::queue_pull(
                        &p.source,
                        &pools,
                        &cx.imports,
                        &cx.gpus,
                        p.dst,
                        express,
                        &|device| events.take(device),
                    )
                    .map_err(|(_, why)| why)?;
                    (queued.dst, queued.ended)
                }
            };
            Ok(Landing {
                tag: p.tag,
                len: p.len,
                dst,
                copied,
                started: p.started,
                reserved: p.reserved,
                queued: p.started.elapsed(),
            })
        })
        .collect()
}

/// The peer's pools for `batch`: with every pool its records name, those not imported yet
/// fetched first (the peer replaced an idle pool; rare: a lane thread may wait for it). A
/// pool that cannot be fetched is left out, and its records fail naming it.
fn batch_pools(batch: &[Result<Prepared, TakeError>], cx: &RxContext) -> Arc<ImportedPools> {
    let mut pools = cx.pools.snapshot();
    let mut failed: Vec<&str> = Vec::new();
    for p in batch.iter().flatten() {
        let name = p.source.pool.as_str();
        if name.is_empty() || pools.contains_key(name) || failed.contains(&name) {
            continue;
        }
        match cx.io.block_on(cx.pools.with(name, &cx.from)) {
            Ok(now) => pools = now,
            Err(e) => {
                // Tried once a batch; its records fail naming the pool.
                tracing::warn!(peer = %cx.peer, pool = %name, error = %e, "cannot import the peer's pool a lane record names");
                failed.push(name);
            }
        }
    }
    pools
}

/// One gather of a batch: its GPU, its stream (express or not) and the event after it.
struct Gathered {
    device: Device,
    express: bool,
    event: Arc<Event>,
}

/// Queues the records of `batch` that may be gathered on the express stream (`express`)
/// or the copy stream, into the GPU of the first of them, as one gather. `None`: fewer than
/// two such records, or the gather failed to queue (logged; those records are copied one
/// by one).
fn gather(
    batch: &mut [Result<Prepared, TakeError>],
    cx: &RxContext,
    pools: &ImportedPools,
    events: &Events,
    express: bool,
) -> Option<Gathered> {
    let device = batch.iter().find_map(|p| match p {
        Ok(p) if gatherable(p, cx, None, express) => {
            p.dst.device_memory().map(|m| m.device().clone())
        }
        _ => None,
    })?;
    let mut items: Vec<_> = batch
        .iter_mut()
        .filter_map(|p| p.as_mut().ok())
        .filter(|p| gatherable(p, cx, Some(&device), express))
        .map(|p| (&p.source, &mut p.dst))
        .collect();
    // One record alone goes to the copy engine: one copy costs less than a launch and its
    // table's upload (window 1 on the H100: 19–29 µs by copy, 29–34 µs by the kernel).
    if items.len() < 2 {
        return None;
    }
    let queued = crate::ipc::queue_pulls(
        &mut items,
        pools,
        &cx.imports,
        &cx.gpus,
        express,
        &|device| events.take(device),
    );
    match queued {
        Ok(event) => Some(Gathered {
            device,
            express,
            event,
        }),
        Err(e) => {
            tracing::debug!(peer = %cx.peer, error = %e, "a lane gather failed");
            None
        }
    }
}

/// Whether a record's copy may join a gather on the express stream (`express`: records
/// of at most [`AHEAD_LEN`]) or the copy stream (larger ones, up to `gather_max`), on
/// `device` when given: from the peer's pool, into device memory.
fn gatherable(p: &Prepared, cx: &RxContext, device: Option<&Device>, express: bool) -> bool {
    p.len <= cx.settings.gather_max
        && (p.len <= AHEAD_LEN) == express
        && p.source.legacy.is_none()
        && p.dst
            .device_memory()
            .is_some_and(|m| device.is_none_or(|d| m.device().same_as(d)))
}

/// Waits for a landing's copy: the landing, with its bytes in place, and when they were.
fn copied(mut landing: Landing, events: &Events) -> Result<(Landing, Duration), TakeError> {
    if let Some(event) = landing.copied.take() {
        let waited = spin_on(&event);
        events.give_back(event);
        waited.map_err(driver("copying from the peer"))?;
    }
    let pulled = landing.started.elapsed();
    Ok((landing, pulled))
}

/// Delivers a landing whose bytes are in place to the inbox, after the slow transfers that
/// completed before it; the receive it was handed to, if any, is woken when the returned
/// [`Wake`] goes.
fn deliver(
    (landing, pulled): (Landing, Duration),
    cx: &RxContext,
    stop: &AtomicBool,
) -> Result<Box<dyn Send>, TakeError> {
    let Landing {
        tag,
        len,
        dst,
        started,
        reserved,
        queued,
        ..
    } = landing;
    let Some(wake) =
        (cx.deliveries).deliver_in_order(crate::ipc::IpcSource::TRANSPORT, tag, dst, stop)
    else {
        return Err(TakeError::Stopped);
    };
    tracing::trace!(
        peer = %cx.peer,
        bytes = len,
        reserve_us = reserved.as_micros() as u64,
        queue_us = (queued - reserved).as_micros() as u64,
        pull_us = (pulled - queued).as_micros() as u64,
        deliver_us = (started.elapsed() - pulled).as_micros() as u64,
        "lane record delivered"
    );
    Ok(wake)
}

/// A driver error at `step` of a lane pull.
fn driver(step: &'static str) -> impl FnOnce(crate::cuda::CudaError) -> TakeError {
    move |source| TakeError::Pull(crate::ipc::IpcError::Driver { step, source })
}

/// Polls `event` until its copy ended (a lane thread is for this), for a second at most,
/// then waits in the driver.
fn spin_on(event: &Event) -> Result<(), crate::cuda::CudaError> {
    let started = Instant::now();
    while !event.query()? {
        if started.elapsed() > Duration::from_secs(1) {
            return event.synchronize();
        }
        std::hint::spin_loop();
    }
    Ok(())
}

/// `len` bytes in the first receive tier that grants them now, on this thread; else, when
/// it may `wait`, waits for memory like any receive would (the sender waits meanwhile).
/// For a copy from the peer's pool (`pooled`), device memory is allocated in order on the
/// stream that copy goes on ([`copy_stream`]): no wait for the allocation, and no use to
/// record for the copy (the buffer is freed on that stream too).
fn reserve(cx: &RxContext, len: u64, wait: bool, pooled: bool) -> Result<Buffer, TakeError> {
    let on = (cx.memory.device())
        .and_then(|n| cx.gpus.get(n))
        .filter(|_| pooled)
        .map(|g| copy_stream(g, len));
    match cx.memory.now(len, on.as_ref(), Fill::Overwritten) {
        Some(got) => Ok(got),
        None if !wait => Err(TakeError::NotNow),
        None => {
            let deadline = Instant::now() + cx.reserve_timeout;
            (cx.io.block_on(cx.memory.wait(len, deadline))).map_err(TakeError::Memory)
        }
    }
}

/// The stream a lane copy of `len` bytes goes on: the express stream for small ones, the
/// copy stream for the rest (small pulls the actor waits for never wait behind them).
fn copy_stream(gpu: &crate::gpus::Gpu, len: u64) -> crate::cuda::Stream {
    if len <= AHEAD_LEN as u64 {
        gpu.express_stream.clone()
    } else {
        gpu.copy_stream.clone()
    }
}
