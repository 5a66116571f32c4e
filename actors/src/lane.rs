//! The same-host lane: device-memory sends to a peer process of this host, without a socket
//! or an actor hop. It is how ipc pulls contiguous device buffers, of every size.
//!
//! The socket path of an ipc send crosses eight thread hand-offs (caller → actor → I/O
//! thread → socket → the peer's I/O thread → its actor, and back for `Done`) and waits for a
//! device allocation through the domain's actor: about 110 µs per round trip on the H200,
//! 150 µs on the H100. The lane replaces that, for contiguous device buffers the routing
//! rules send over ipc by pull (and of at most `transport.ipc.lane_max` bytes), once the ipc
//! setup with the peer is done, with:
//!
//! - a ring of slots in shared memory ([`Ring`]), one per direction, made by the sender
//!   during the ipc setup and fetched by the receiver from the sender's fd-sharing socket;
//! - on the sender, the caller's own task exports the buffer and writes a [`LaneRecord`]
//!   into the next slot; a watcher thread sees the receiver finish it and completes the
//!   send (the receiver's outcome, or its reason, comes back in the slot);
//! - on the receiver, a lane thread polls the ring, pulls each buffer with one peer copy
//!   and delivers it to the inbox itself. A buffer of at most 64 KiB lands in memory
//!   allocated ahead (after the first such record, 4 buffers of 64 KiB from the receive
//!   tiers, topped up while the lane is idle); a larger one is reserved on the lane thread
//!   ([`reserve_now_in_tiers`]: no actor, the device allocation made there), or, when no
//!   tier can grant it now, waits for memory like any receive. What the lane delivered and
//!   the application did not take yet counts against the peer's share
//!   (`limits.peer_inbound_bytes`): past it, the lane waits.
//!
//! Both threads spin for `transport.ipc.lane_spin` after the last record, then park on a
//! futex in the ring: a busy lane makes no system call, an idle one costs nothing.
//!
//! **Order.** A peer's buffers are delivered in send order whichever path carries them:
//! [`Order`] lets a lane send start only while nothing to that peer goes the slow way,
//! and makes a slow send wait until the lane sends before it completed (a lane send
//! completes once the buffer is in the receiver's inbox). On the receiver, a lane record is
//! delivered only once every slow transfer from that peer that completed before it was
//! delivered too (`undelivered`).
//!
//! **Failure.** A sender whose deadline passes gets `DeadlineExceeded` and no buffer: the
//! receiver may still read it, so the watcher keeps it until the record is finished or the
//! lane closes (then it is freed; the peer unmaps it first, like any exported buffer).
//! When either side's session ends the ring is closed; sends not yet finished by the
//! receiver fail with `PeerLost` and get their buffer back.

use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_transports::cuda::{Device, DeviceMemory, Event};
use ferry_transports::link::ring::{ConsumerRefused, Ring};
use ferry_transports::memory::{Buffer, MemoryKind, Unmapper};
use ferry_transports::wire::LaneRecord;
use tokio::sync::{Notify, oneshot};

use crate::allocator::{Tier, reserve_in_tiers, reserve_now_in_tiers};
use crate::error::{Error, SendError};
use crate::gpu::{ImportedPools, SharedGpus, SharedImports};
use crate::inbox::Inbox;

/// Records in flight per lane.
pub const LANE_SLOTS: u32 = 64;
/// Bytes per slot: a record (an export and a lease, about 200 bytes) or a reason.
pub const LANE_SLOT_LEN: u32 = 512;
/// Receive buffers a lane keeps allocated ahead.
const AHEAD: usize = 4;
/// Their size: records of at most this many bytes land in them; larger ones are reserved
/// when they arrive.
pub const AHEAD_LEN: usize = 64 << 10;
/// How often a lane held back by the peer's share looks again.
const SHARE_RECHECK: Duration = Duration::from_micros(200);
/// How long a parked lane thread sleeps before it looks at its stop flag again.
const PARK: Duration = Duration::from_millis(20);

/// The lane's settings (`transport.ipc.lane_max`, `transport.ipc.lane_spin`).
#[derive(Debug, Clone, Copy)]
pub struct LaneSettings {
    /// Largest send this node puts on the lane; 0 turns the lane off. (A receiver takes
    /// records of any size.)
    pub max: usize,
    /// How long a lane thread spins for the next record before it parks.
    pub spin: Duration,
}

// ---- order between the lane and the slow path ----

/// Per peer, how many sends are under way on the lane and on the slow path: at most one of
/// the two is non-zero, so the peer's buffers arrive in send order. Slow sends pass the
/// gate in the order they were first polled (tickets), so waiting for the lane to drain
/// never reorders them.
#[derive(Debug, Default)]
pub struct Order {
    state: Mutex<OrderState>,
    changed: Notify,
}

#[derive(Debug, Default)]
struct OrderState {
    lane: usize,
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
    fn state(&self) -> std::sync::MutexGuard<'_, OrderState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a lane send, unless a slow one is under way or `max` lane sends are (then the
    /// caller takes the slow path, behind them). With at most a ring's worth in flight, a
    /// lane send finds its slot free and publishes before its first `await`, so lane
    /// records leave in the order the sends were first polled.
    pub fn try_lane(self: &Arc<Self>, max: usize) -> Option<OrderGuard> {
        let mut s = self.state();
        if s.slow > 0 || s.lane >= max {
            return None;
        }
        s.lane += 1;
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
/// already know) but are not in the inbox yet. Lane records wait for it to reach zero.
#[derive(Debug, Default, Clone)]
pub struct Undelivered(Arc<AtomicU64>);

impl Undelivered {
    /// One more completed transfer on its way to the inbox; the guard's drop counts it
    /// delivered (or dropped).
    pub fn enter(&self) -> Pending {
        self.0.fetch_add(1, Ordering::SeqCst);
        Pending(Arc::clone(&self.0))
    }

    fn is_clear(&self) -> bool {
        self.0.load(Ordering::SeqCst) == 0
    }
}

/// A completed slow transfer not yet in the inbox (see [`Undelivered`]).
#[derive(Debug)]
pub struct Pending(Arc<AtomicU64>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

// ---- which sends the rules give the lane ----

/// Which sizes of contiguous device buffer the routing rules send to the peer over ipc by
/// pull: the lane carries those and no other. Rules match sizes by ranges, so the answer
/// is constant between their bounds: one entry per range, by its first size.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaneRoutes {
    /// (first size of a range, whether the lane carries it), by first size, from 0.
    ranges: Vec<(u64, bool)>,
}

impl LaneRoutes {
    /// The bounds where a rule starts or stops matching (`min_bytes`, `max_bytes + 1`),
    /// from 0: ask the route at each, then [`Self::new`].
    pub fn bounds(rules: &[ferry_config::Rule]) -> Vec<u64> {
        let mut bounds: Vec<u64> = std::iter::once(0)
            .chain(rules.iter().map(|r| r.min_bytes))
            .chain(
                rules
                    .iter()
                    .filter_map(|r| r.max_bytes.and_then(|m| m.checked_add(1))),
            )
            .collect();
        bounds.sort_unstable();
        bounds.dedup();
        bounds
    }

    /// The ranges from their first sizes (as [`Self::bounds`] gave them) and whether the
    /// route at each takes the lane.
    pub fn new(ranges: Vec<(u64, bool)>) -> Self {
        Self { ranges }
    }

    /// Whether a send of `bytes` takes the lane.
    pub fn takes(&self, bytes: u64) -> bool {
        let i = self.ranges.partition_point(|(start, _)| *start <= bytes);
        i > 0 && self.ranges[i - 1].1
    }
}

// ---- sender ----

type Completion = oneshot::Sender<Result<Buffer, (Buffer, ConsumerRefused)>>;

struct Waiter {
    seq: u64,
    buffer: Buffer,
    done: Completion,
}

#[derive(Default)]
struct TxState {
    /// The next record's sequence number.
    next: u64,
    /// Records whose outcome we read: their slots are free again.
    reaped: u64,
    waiting: VecDeque<Waiter>,
    closed: Option<String>,
}

/// The sending end of a lane to one peer.
pub struct LaneTx {
    peer: String,
    ring: Arc<Ring>,
    settings: LaneSettings,
    state: Mutex<TxState>,
    /// A slot was freed, or the lane closed.
    space: Notify,
    unmapper: Arc<dyn Unmapper>,
    stop: AtomicBool,
    /// Set by the coordinator once the ipc setup settled; no send takes the lane before.
    routes: std::sync::OnceLock<LaneRoutes>,
}

impl std::fmt::Debug for LaneTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneTx").field("peer", &self.peer).finish()
    }
}

impl LaneTx {
    /// The sending end over `ring` (whose consumer attached), and its watcher thread.
    /// Buffers sent are noted as mapped by the peer (`unmapper`).
    ///
    /// # Errors
    /// When the watcher thread cannot start.
    pub fn start(
        peer: &str,
        ring: Arc<Ring>,
        settings: LaneSettings,
        unmapper: Arc<dyn Unmapper>,
    ) -> Result<Arc<LaneTx>, String> {
        let tx = Arc::new(LaneTx {
            peer: peer.to_string(),
            ring,
            settings,
            state: Mutex::default(),
            space: Notify::new(),
            unmapper,
            stop: AtomicBool::new(false),
            routes: std::sync::OnceLock::new(),
        });
        let watcher = Arc::clone(&tx);
        std::thread::Builder::new()
            .name("ferry-lane-tx".into())
            .spawn(move || watcher.watch())
            .map_err(|e| format!("cannot start the lane's watcher: {e}"))?;
        Ok(tx)
    }

    /// Which sizes the rules send this way (the first call counts).
    pub fn set_routes(&self, routes: LaneRoutes) {
        let _ = self.routes.set(routes);
    }

    /// True when `buffer` may take this lane.
    pub fn fits(&self, buffer: &Buffer) -> bool {
        matches!(buffer.kind(), MemoryKind::Device(_))
            && !buffer.is_empty()
            && buffer.len() <= self.settings.max
            && self
                .routes
                .get()
                .is_some_and(|r| r.takes(buffer.len() as u64))
            && self.state().closed.is_none()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, TxState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends `buffer` under `tag`; resolves once the peer's inbox holds it.
    ///
    /// # Errors
    /// `DeadlineExceeded` (without the buffer: the peer may still read it), `PeerLost`
    /// when the lane closed first, the peer's reason when it could not take the buffer.
    pub async fn send(
        &self,
        tag: u64,
        buffer: Buffer,
        deadline: Instant,
    ) -> Result<Buffer, SendError> {
        let fail = |error, buffer| Err(SendError { error, buffer });
        let started = Instant::now();
        let source = match crate::gpu::export_source(&buffer, false) {
            Ok(s) => s,
            Err(why) => return fail(Error::unsupported(why.to_string()), Some(buffer)),
        };
        let record = LaneRecord {
            tag,
            len: buffer.len() as u64,
            source,
        };
        let record = match record.encode() {
            Ok(r) => r,
            Err(why) => return fail(Error::unsupported(why.to_string()), Some(buffer)),
        };
        buffer.note_mapped(Arc::clone(&self.unmapper));
        let deadline = tokio::time::Instant::from_std(deadline);
        let mut buffer = Some(buffer);
        let (done, alone) = loop {
            let space = self.space.notified();
            tokio::pin!(space);
            space.as_mut().enable();
            {
                let mut s = self.state();
                if let Some(why) = &s.closed {
                    let error = self.lost(why);
                    drop(s);
                    return fail(error, buffer);
                }
                if s.next - s.reaped < u64::from(self.ring.slots()) {
                    let seq = s.next;
                    if let Err(e) = self.ring.publish(seq, s.reaped, &record) {
                        drop(s);
                        return fail(self.lost(&e.to_string()), buffer);
                    }
                    s.next += 1;
                    let (done, wait) = oneshot::channel();
                    let Some(buffer) = buffer.take() else {
                        return fail(Error::ShuttingDown, None);
                    };
                    s.waiting.push_back(Waiter { seq, buffer, done });
                    break (wait, s.waiting.len() == 1);
                }
            }
            if tokio::time::timeout_at(deadline, space).await.is_err() {
                return fail(Error::DeadlineExceeded, buffer);
            }
        };
        // The watcher may be parked with nothing outstanding.
        self.ring.wake_producer();
        tracing::trace!(peer = %self.peer, tag, us = started.elapsed().as_micros() as u64, "lane record published");
        // Alone on the lane, the answer usually comes within the spin: polled, the task
        // yielding to others in between, so no thread sleeps and none pays a wake-up for
        // it. With others in flight, throughput counts: polling tasks would only crowd the
        // runtime (measured: 4 KiB with 32 in flight lost a quarter of its rate).
        let mut done = done;
        let spin = if alone {
            self.settings.spin
        } else {
            Duration::ZERO
        };
        let spin_until = Instant::now() + spin;
        let answer = loop {
            match done.try_recv() {
                Ok(answer) => break Ok(Ok(answer)),
                Err(oneshot::error::TryRecvError::Closed) => break Ok(Err(())),
                Err(oneshot::error::TryRecvError::Empty) if Instant::now() < spin_until => {
                    tokio::task::yield_now().await;
                }
                Err(oneshot::error::TryRecvError::Empty) => {
                    break tokio::time::timeout_at(deadline, done)
                        .await
                        .map(|r| r.map_err(drop));
                }
            }
        };
        match answer {
            Ok(Ok(Ok(buffer))) => Ok(buffer),
            Ok(Ok(Err((buffer, why)))) => fail(
                Error::Transport {
                    peer: self.peer.clone(),
                    detail: format!("the peer did not take it: {why}"),
                },
                Some(buffer),
            ),
            Ok(Err(_)) => fail(self.lost("the lane stopped"), None),
            Err(_) => fail(Error::DeadlineExceeded, None),
        }
    }

    fn lost(&self, why: &str) -> Error {
        Error::PeerLost {
            peer: self.peer.clone(),
            detail: format!("fast lane: {why}"),
        }
    }

    /// Our session with the peer ended: no more sends; those the peer has not finished
    /// fail (their buffers are freed once the peer unmapped them, or its lease ran out).
    pub fn close(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.ring.close();
    }

    /// The watcher: completes sends as the receiver finishes their records.
    fn watch(&self) {
        let mut idle_since = Instant::now();
        loop {
            let reaped = self.state().reaped;
            let tail = match self.ring.tail(reaped) {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(peer = %self.peer, "fast lane closed: {e}");
                    self.ring.close();
                    return self.fail_all(&e.to_string(), false);
                }
            };
            if tail > reaped {
                let finished: Vec<_> = {
                    let mut s = self.state();
                    let n = usize::try_from(tail - reaped).unwrap_or(usize::MAX);
                    let n = n.min(s.waiting.len());
                    // Outcomes are read before the slots are given back to the senders.
                    let finished = s
                        .waiting
                        .drain(..n)
                        .map(|w| (self.ring.outcome(w.seq), w))
                        .collect();
                    s.reaped = tail;
                    finished
                };
                for (outcome, w) in finished {
                    let result = match outcome {
                        Ok(()) => Ok(w.buffer),
                        Err(why) => Err((w.buffer, why)),
                    };
                    // A sender that gave up drops the buffer here: the peer is done with it.
                    let _ = w.done.send(result);
                }
                self.space.notify_waiters();
                idle_since = Instant::now();
                continue;
            }

            if self.stop.load(Ordering::SeqCst) {
                return self.fail_all("our session with the peer ended", false);
            }
            if self.ring.is_closed() {
                // The receiver stopped reading after finishing its current record: what it
                // did not finish it never touched, and goes back to the senders.
                return self.fail_all("the peer closed the lane", true);
            }
            // Spinning on after the last completion too: a sender that publishes while we
            // spin makes no system call to wake us.
            if idle_since.elapsed() < self.settings.spin {
                std::hint::spin_loop();
                continue;
            }
            self.ring.park_producer(tail, PARK);
            if self.state().next > reaped {
                // Woken by a sender: spin for its completion.
                idle_since = Instant::now();
            }
        }
    }

    fn fail_all(&self, why: &str, give_back: bool) {
        let waiting = {
            let mut s = self.state();
            s.closed = Some(why.to_string());
            std::mem::take(&mut s.waiting)
        };
        for w in waiting {
            if give_back {
                let _ = w
                    .done
                    .send(Err((w.buffer, ConsumerRefused(why.to_string()))));
            }
            // Otherwise the buffer is dropped with `done`: the peer may still read it; it
            // is freed once the peer unmapped it or its lease timed out.
        }
        self.space.notify_waiters();
    }
}

impl Drop for LaneTx {
    fn drop(&mut self) {
        self.ring.close();
    }
}

// ---- receiver ----

/// What a receiving lane thread needs from its transfer actor.
pub struct RxContext {
    /// The sending peer.
    pub peer: String,
    /// Its pools, imported by the ipc setup.
    pub pools: Arc<ImportedPools>,
    /// Its buffers we keep mapped (shared with the actor, which unmaps on request).
    pub imports: SharedImports,
    /// Our GPUs.
    pub gpus: SharedGpus,
    /// Where buffers go.
    pub inbox: Arc<Inbox>,
    /// Where they land (the pulled transfers' tiers).
    pub tiers: Vec<Tier>,
    /// The peer's share of our memory (`limits.peer_inbound_bytes`): what the lane
    /// delivered and the application did not take stays under it.
    pub share: u64,
    /// Slow transfers from this peer on their way to the inbox.
    pub undelivered: Undelivered,
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
    /// Attaches to `ring` and starts the lane thread.
    ///
    /// # Errors
    /// When the thread cannot start.
    pub fn start(ring: Ring, cx: RxContext) -> std::io::Result<LaneRx> {
        let ring = Arc::new(ring);
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s) = (Arc::clone(&ring), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("ferry-lane-rx".into())
            .spawn(move || receive(&r, &s, &cx))?;
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

fn receive(ring: &Ring, stop: &AtomicBool, cx: &RxContext) {
    let mut ahead = Ahead::default();
    let mut top_up = false;
    let mut tail = 0u64;
    let mut record = Vec::with_capacity(ring.room());
    let mut idle_since = Instant::now();
    let mut events = Events::default();
    loop {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let head = match ring.published(tail) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(peer = %cx.peer, "fast lane closed: {e}");
                break;
            }
        };
        if head == tail {
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
                ring.park_consumer(tail, PARK);
            }
            continue;
        }
        // Every record published so far (a batch at most) has its copy queued before the
        // first is waited for, so the copies run back to back; each is then delivered and
        // finished in order as its copy ends.
        let mut batch: Vec<Result<Prepared, TakeError>> = Vec::new();
        for seq in tail..head.min(tail + BATCH) {
            // Bytes this batch landed so far, not delivered yet: the share counts them.
            let pending = batch
                .iter()
                .filter_map(|p| p.as_ref().ok())
                .map(|p| p.len as u64)
                .sum::<u64>();
            let first = batch.is_empty();
            let prepared = match ring.read(seq, &mut record) {
                Ok(()) => prepare(&record, cx, &mut ahead, stop, first, pending),
                Err(e) => Err(TakeError::BadRecord(e.to_string())),
            };
            match prepared {
                // Waiting for memory or for the peer's share with copies in flight: those
                // are delivered first (the application may be waiting for them).
                Err(TakeError::NotNow) => break,
                other => batch.push(other),
            }
        }
        for landing in queue(batch, cx, &mut events) {
            let outcome = landing.and_then(|l| deliver(l, cx, stop, &mut events));
            let outcome = outcome.map_err(|why| why.to_string());
            if let Err(why) = &outcome {
                tracing::warn!(peer = %cx.peer, "a fast-lane transfer failed: {why}");
                metrics::counter!("ferry_pull_failures_total").increment(1);
            }
            ring.finish(tail, outcome.as_ref().map(|_| ()).map_err(String::as_str));
            tail += 1;
        }
        idle_since = Instant::now();
        top_up = true;
    }
    ring.close();
}

/// Records whose copies a lane queues before it waits for the first.
const BATCH: u64 = 16;

/// Events the lane records after each queued copy, reused.
#[derive(Default)]
struct Events(Vec<Event>);

impl Events {
    fn take(&mut self, device: &Device) -> Result<Event, TakeError> {
        match self.0.iter().position(|e| e.device().same_as(device)) {
            Some(i) => Ok(self.0.swap_remove(i)),
            None => Event::new(device).map_err(driver("creating an event")),
        }
    }

    /// Keeps `event` for reuse once its last landing is done with it.
    fn give_back(&mut self, event: Rc<Event>) {
        if let Ok(event) = Rc::try_unwrap(event)
            && self.0.len() < BATCH as usize
        {
            self.0.push(event);
        }
    }
}

/// A record with its landing reserved, its copy not queued yet.
struct Prepared {
    tag: u64,
    len: usize,
    source: ferry_transports::wire::IpcSource,
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
    copied: Option<Rc<Event>>,
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
    #[error(transparent)]
    Memory(#[from] Error),
    /// The reservation granted nothing.
    #[error("no memory granted")]
    NoneGranted,
    /// The pull failed.
    #[error(transparent)]
    Pull(#[from] crate::gpu::IpcError),
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
    if !share_allows(cx, pending, record.len) {
        if !first {
            return Err(TakeError::NotNow);
        }
        wait_for_share(cx, record.len, stop)?;
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

/// Queues the copies of a batch: the small ones into one GPU's memory as one gather
/// ([`crate::gpu::queue_pulls`]: one kernel launch instead of a copy each), the others one
/// by one. Each comes back with an event recorded after its copy.
fn queue(
    batch: Vec<Result<Prepared, TakeError>>,
    cx: &RxContext,
    events: &mut Events,
) -> Vec<Result<Landing, TakeError>> {
    let mut batch = batch;
    let device = batch.iter().find_map(|p| match p {
        Ok(p) if gatherable(p, None) => p.dst.device_memory().map(|m| m.device().clone()),
        _ => None,
    });
    let mut gathered = None;
    if let Some(device) = &device {
        let mut items: Vec<_> = batch
            .iter_mut()
            .filter_map(|p| p.as_mut().ok())
            .filter(|p| gatherable(p, Some(device)))
            .map(|p| (&p.source, &mut p.dst))
            .collect();
        if items.len() > 1 {
            let queued = crate::gpu::queue_pulls(&mut items, &cx.pools, &cx.imports, &cx.gpus)
                .map_err(TakeError::from)
                .and_then(|stream| record(events, &stream));
            match queued {
                Ok(event) => gathered = Some(event),
                // Copied one by one below instead.
                Err(e) => tracing::debug!(peer = %cx.peer, error = %e, "a lane gather failed"),
            }
        }
    }
    batch
        .into_iter()
        .map(|p| {
            let p = p?;
            let copied = match (&gathered, &device) {
                (Some(event), Some(device)) if gatherable(&p, Some(device)) => {
                    Some(Rc::clone(event))
                }
                _ => None,
            };
            let (dst, copied) = match copied {
                Some(event) => (p.dst, Some(event)),
                None => {
                    let express = p.len <= AHEAD_LEN;
                    let queued = crate::gpu::queue_pull(
                        &p.source,
                        &cx.pools,
                        &cx.imports,
                        &cx.gpus,
                        p.dst,
                        express,
                    )
                    .map_err(|(_, why)| why)?;
                    let copied = match &queued.stream {
                        Some(stream) => Some(record(events, stream)?),
                        None => None,
                    };
                    (queued.dst, copied)
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

/// Whether a record's copy may join a batch's gather (on `device`, when given): a small
/// one, from the peer's pool, into device memory.
fn gatherable(p: &Prepared, device: Option<&Device>) -> bool {
    p.len <= AHEAD_LEN
        && p.source.legacy.is_none()
        && p.dst
            .device_memory()
            .is_some_and(|m| device.is_none_or(|d| m.device().same_as(d)))
}

/// An event recorded on `stream` now.
fn record(
    events: &mut Events,
    stream: &ferry_transports::cuda::Stream,
) -> Result<Rc<Event>, TakeError> {
    let event = events.take(stream.device())?;
    event
        .record(stream)
        .map_err(driver("recording the copy's end"))?;
    Ok(Rc::new(event))
}

/// Waits for a landing's copy, then delivers it to the inbox.
fn deliver(
    landing: Landing,
    cx: &RxContext,
    stop: &AtomicBool,
    events: &mut Events,
) -> Result<(), TakeError> {
    let Landing {
        tag,
        len,
        dst,
        copied,
        started,
        reserved,
        queued,
    } = landing;
    if let Some(event) = copied {
        let waited = spin_on(&event);
        events.give_back(event);
        waited.map_err(driver("copying from the peer"))?;
    }
    let pulled = started.elapsed();
    // Slow transfers that completed before this record go first.
    while !cx.undelivered.is_clear() {
        if stop.load(Ordering::SeqCst) {
            return Err(TakeError::Stopped);
        }
        std::thread::yield_now();
    }
    cx.inbox.deliver_lane(&cx.peer, tag, dst);
    tracing::trace!(
        peer = %cx.peer,
        bytes = len,
        reserve_us = reserved.as_micros() as u64,
        queue_us = (queued - reserved).as_micros() as u64,
        pull_us = (pulled - queued).as_micros() as u64,
        deliver_us = (started.elapsed() - pulled).as_micros() as u64,
        "lane record delivered"
    );
    Ok(())
}

/// A driver error at `step` of a lane pull.
fn driver(step: &'static str) -> impl FnOnce(ferry_transports::cuda::CudaError) -> TakeError {
    move |source| TakeError::Pull(crate::gpu::IpcError::Driver { step, source })
}

/// Polls `event` until its copy ended (a lane thread is for this), for a second at most,
/// then waits in the driver.
fn spin_on(event: &Event) -> Result<(), ferry_transports::cuda::CudaError> {
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
    let on = cx
        .tiers
        .iter()
        .find_map(|t| match t.kind {
            MemoryKind::Device(n) => cx.gpus.get(n),
            _ => None,
        })
        .filter(|_| pooled)
        .map(|g| copy_stream(g, len));
    let got = match reserve_now_in_tiers(&cx.tiers, &[len], on.as_ref()) {
        Some(got) => got,
        None if !wait => return Err(TakeError::NotNow),
        None => {
            let deadline = Instant::now() + cx.reserve_timeout;
            cx.io
                .block_on(reserve_in_tiers(&cx.tiers, &[len], deadline))?
        }
    };
    got.into_iter().next().ok_or(TakeError::NoneGranted)
}

/// The stream a lane copy of `len` bytes goes on: the express stream for small ones, the
/// copy stream for the rest (small pulls the actor waits for never wait behind them).
fn copy_stream(gpu: &crate::gpu::Gpu, len: u64) -> ferry_transports::cuda::Stream {
    if len <= AHEAD_LEN as u64 {
        gpu.express_stream.clone()
    } else {
        gpu.copy_stream.clone()
    }
}

/// Whether what the lane delivered and the application did not take, with `pending` bytes
/// landed for records not delivered yet and `len` more, stays under the peer's share (a
/// record larger than the whole share goes once nothing of the lane's is held, as on the
/// socket path). The socket path holds its own deliveries to the share.
fn share_allows(cx: &RxContext, pending: u64, len: u64) -> bool {
    let claims = cx.inbox.claims(&cx.peer);
    let held = claims
        .lane
        .load(Ordering::Relaxed)
        .saturating_sub(claims.lane_taken.load(Ordering::Relaxed))
        .saturating_add(pending);
    held == 0 || held.saturating_add(len) <= cx.share
}

/// Waits until [`share_allows`] `len` more bytes, for `reserve_timeout` at most (like a
/// reservation); then the record fails and the sender gets its buffer back.
fn wait_for_share(cx: &RxContext, len: u64, stop: &AtomicBool) -> Result<(), TakeError> {
    let deadline = Instant::now() + cx.reserve_timeout;
    while !share_allows(cx, 0, len) {
        if stop.load(Ordering::SeqCst) {
            return Err(TakeError::Stopped);
        }
        if Instant::now() >= deadline {
            return Err(TakeError::ShareFull(cx.reserve_timeout));
        }
        std::thread::sleep(SHARE_RECHECK);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_routes_follow_the_rules_size_ranges() {
        let rule = |min: u64, max: Option<u64>| ferry_config::Rule {
            min_bytes: min,
            max_bytes: max,
            ..ferry_config::Rule::same_host_gpu()
        };
        let rules = [rule(4096, Some(1 << 20)), rule(0, None)];
        let bounds = LaneRoutes::bounds(&rules);
        assert_eq!(bounds, vec![0, 4096, (1 << 20) + 1]);
        // Say the first rule sends by push: the lane carries what the second rule covers.
        let routes = LaneRoutes::new(bounds.into_iter().map(|b| (b, b != 4096)).collect());
        for (bytes, lane) in [
            (1, true),
            (4095, true),
            (4096, false),
            (1 << 20, false),
            ((1 << 20) + 1, true),
            (u64::MAX, true),
        ] {
            assert_eq!(routes.takes(bytes), lane, "{bytes} bytes");
        }
        assert!(
            !LaneRoutes::default().takes(8),
            "no routes: nothing takes the lane"
        );
    }

    #[tokio::test]
    async fn slow_sends_pass_in_ticket_order_even_when_one_gives_up() {
        let order = Arc::new(Order::default());
        let lane = order.try_lane(4).expect("lane");
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
        assert!(order.try_lane(4).is_some());
    }

    #[tokio::test]
    async fn a_waiting_slow_send_keeps_later_lane_sends_off_the_lane() {
        let order = Arc::new(Order::default());
        let lane = order.try_lane(1).expect("nothing slow under way");
        assert!(order.try_lane(1).is_none(), "one lane send at most");
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
            order.try_lane(2).is_none(),
            "a later lane send must queue behind it"
        );
        drop(lane);
        let slow = slow.await.expect("the slow send starts");
        assert!(order.try_lane(2).is_none());
        drop(slow);
        assert!(order.try_lane(2).is_some(), "the lane is free again");
    }
}
