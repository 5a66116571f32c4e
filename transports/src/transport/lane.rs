//! The sending end of a lane (a [`FastPath`] over a [`Ring`] both processes map): the
//! caller's task publishes a record the transport's [`LaneWriter`] makes of the buffer, a
//! watcher thread completes the send when the receiver finished it. The receiving end is
//! the transport's own (it knows what a record names).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use ferry_config::MemoryClass;

use crate::link::ring::{ConsumerRefused, Ring};
use crate::memory::Buffer;
use crate::transport::{Deliveries, FastPath, FastPathError, FastPathFailure};

/// How long a parked lane thread (either end) sleeps before it looks at its stop flag
/// again.
pub const PARK: Duration = Duration::from_millis(20);

/// What a transport's lane puts in its records.
pub trait LaneWriter: Send + Sync {
    /// The transport whose sends it carries (the label of its transfers' metrics).
    fn transport(&self) -> ferry_config::TransportName;

    /// The memory its records name.
    fn memory(&self) -> MemoryClass;

    /// Whether `buffer` (sent whole) may take the lane, by its memory and size.
    fn fits(&self, buffer: &Buffer) -> bool;

    /// The record of `buffer` sent under `tag`, or why it cannot go this way.
    ///
    /// # Errors
    /// Why the buffer cannot be named in a record (it cannot be exported, say).
    fn record(&self, tag: u64, buffer: &Buffer) -> Result<Vec<u8>, String>;

    /// The record of `buffer` is published: the peer may read it from now on.
    fn published(&self, _buffer: &Buffer) {}

    /// The lane closed while the peer may still read `buffer`: it must not be reused
    /// before the peer is done (dropped here by default: the transport's own rules, such
    /// as a peer's unmapping, keep it).
    fn abandon(&self, buffer: Buffer) {
        drop(buffer);
    }
}

/// The receiver's answer to a record: the buffer back, or with why it was not taken.
type Answer = Result<Buffer, (Buffer, ConsumerRefused)>;

type Completion = oneshot::Sender<Answer>;

struct Waiter {
    seq: u64,
    buffer: Buffer,
    /// When its record was published.
    started: Instant,
    done: Completion,
    /// The send's place in the peer's order: held until the receiver finished the record
    /// (or the lane closed), also when the sender stopped waiting, so that no later send
    /// to the peer can overtake a record the receiver may still deliver.
    _turn: Box<dyn Send>,
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
    writer: Box<dyn LaneWriter>,
    /// How long the watcher (and a lone sender) spins for the receiver before it parks.
    spin: Duration,
    state: Mutex<TxState>,
    stop: AtomicBool,
}

impl std::fmt::Debug for LaneTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneTx").field("peer", &self.peer).finish()
    }
}

impl LaneTx {
    /// The sending end over `ring` (whose consumer attached), its records made by
    /// `writer`, and its watcher thread, which spins `spin` after each completion.
    ///
    /// # Errors
    /// When the watcher thread cannot start.
    pub fn start(
        peer: &str,
        ring: Arc<Ring>,
        writer: Box<dyn LaneWriter>,
        spin: Duration,
    ) -> Result<Arc<LaneTx>, std::io::Error> {
        let tx = Arc::new(LaneTx {
            peer: peer.to_string(),
            ring,
            writer,
            spin,
            state: Mutex::default(),
            stop: AtomicBool::new(false),
        });
        let watcher = Arc::clone(&tx);
        std::thread::Builder::new()
            .name("ferry-lane-tx".into())
            .spawn(move || watcher.watch())?;
        Ok(tx)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, TxState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for the receiver's answer to a published record, until `deadline`: the outer
    /// `Err` when it passed, the inner when the lane stopped first.
    async fn answer(
        &self,
        mut done: oneshot::Receiver<Answer>,
        alone: bool,
        deadline: tokio::time::Instant,
    ) -> Result<Result<Answer, ()>, tokio::time::error::Elapsed> {
        // Alone on the lane, the answer usually comes within the spin: polled, the task
        // yielding to others in between, so no thread sleeps and none pays a wake-up for
        // it. With others in flight, throughput counts: polling tasks would only crowd the
        // runtime (measured: 4 KiB with 32 in flight lost a quarter of its rate).
        let spin = if alone { self.spin } else { Duration::ZERO };
        let spin_until = Instant::now() + spin;
        loop {
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
        }
    }

    fn lost(&self, why: &str) -> FastPathFailure {
        FastPathFailure::PeerLost(format!("fast lane: {why}"))
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
                // Counted once every sender of the batch has its answer (and the next send
                // its turn): the metrics' registry is not on the way.
                let mut counts = Vec::with_capacity(finished.len());
                for (outcome, w) in finished {
                    counts.push((w.buffer.len(), w.started, outcome.is_ok()));
                    let result = match outcome {
                        Ok(()) => Ok(w.buffer),
                        Err(why) => Err((w.buffer, why)),
                    };
                    // A sender that gave up drops the buffer here: the peer is done with it.
                    let _ = w.done.send(result);
                }
                for (len, started, completed) in counts {
                    self.count(len, started, completed);
                }
                idle_since = Instant::now();
                continue;
            }

            if self.stop.load(Ordering::SeqCst) {
                return self.fail_all("our session with the peer ended", false);
            }
            if self.ring.is_closed() {
                // The receiver stopped reading after finishing its current record: what it
                // finished before it closed is completed first (look again: it may have
                // finished one since the look above); what it did not finish it never
                // touched, and goes back to the senders.
                if self.ring.tail(reaped).is_ok_and(|t| t > reaped) {
                    continue;
                }
                return self.fail_all("the peer closed the lane", true);
            }
            // Spinning on after the last completion too: a sender that publishes while we
            // spin makes no system call to wake us.
            if idle_since.elapsed() < self.spin {
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

    /// Counts a lane send as the session counts its transfers (`ferry_transfers_total`,
    /// and for one completed its bytes and duration): a send by pull to a same-host peer.
    fn count(&self, len: usize, started: Instant, completed: bool) {
        let status = if completed { "completed" } else { "failed" };
        metrics::counter!("ferry_transfers_total", "status" => status).increment(1);
        if completed {
            let transport = self.writer.transport();
            metrics::counter!("ferry_transfer_bytes_total", "transport" => transport.as_str(),
                "direction" => "pull", "peer_class" => "same_host")
            .increment(len as u64);
            metrics::histogram!("ferry_transfer_duration_seconds")
                .record(started.elapsed().as_secs_f64());
        }
    }

    fn fail_all(&self, why: &str, give_back: bool) {
        let waiting = {
            let mut s = self.state();
            s.closed = Some(why.to_string());
            std::mem::take(&mut s.waiting)
        };
        for w in waiting {
            self.count(w.buffer.len(), w.started, false);
            if give_back {
                let _ = w
                    .done
                    .send(Err((w.buffer, ConsumerRefused(why.to_string()))));
            } else {
                // The peer may still read it: the writer keeps it from reuse (ipc's until
                // the peer unmapped it or its lease timed out) and `done` drops, failing
                // the send.
                self.writer.abandon(w.buffer);
            }
        }
    }
}

impl FastPath for LaneTx {
    fn memory(&self) -> MemoryClass {
        self.writer.memory()
    }

    /// True when `buffer` may take this lane (its writer says so) while the lane is open.
    fn fits(&self, buffer: &Buffer) -> bool {
        !buffer.is_empty() && self.writer.fits(buffer) && self.state().closed.is_none()
    }

    /// Publishes `buffer`'s record under `tag` now, when the ring has a free slot: from
    /// then on the send is the peer's to finish, whether or not the returned future (its
    /// answer: resolves once the peer's inbox holds it, the receiver waking the
    /// application after it finished the record) is polled. Nothing waits here.
    ///
    /// # Errors
    /// `Full` (the buffer back) when every slot is in use; `Unsupported` when the buffer
    /// cannot be exported; `PeerLost` when the lane closed. From the answer:
    /// `DeadlineExceeded` (without the buffer: the peer may still read it), `PeerLost` when
    /// the lane closed first, the peer's reason when it could not take the buffer.
    fn send(
        &self,
        tag: u64,
        buffer: Buffer,
        deadline: Instant,
        turn: Box<dyn Send>,
    ) -> Result<futures::future::BoxFuture<'_, Result<Buffer, FastPathError>>, FastPathError> {
        let failed = |failure, buffer| FastPathError { failure, buffer };
        let started = Instant::now();
        let record = match self.writer.record(tag, &buffer) {
            Ok(r) => r,
            Err(why) => return Err(failed(FastPathFailure::Unsupported(why), Some(buffer))),
        };
        let (done, alone) = {
            let mut s = self.state();
            if let Some(why) = &s.closed {
                let error = self.lost(why);
                drop(s);
                return Err(failed(error, Some(buffer)));
            }
            // No room, or a ring the receiver closed (its watcher has not seen it yet): the
            // send goes the other way.
            if s.next - s.reaped >= u64::from(self.ring.slots()) || self.ring.is_closed() {
                return Err(failed(FastPathFailure::Full, Some(buffer)));
            }
            let seq = s.next;
            if let Err(e) = self.ring.publish(seq, s.reaped, &record) {
                drop(s);
                return Err(failed(self.lost(&e.to_string()), Some(buffer)));
            }
            s.next += 1;
            // The peer may read it from now on.
            self.writer.published(&buffer);
            let (done, wait) = oneshot::channel();
            s.waiting.push_back(Waiter {
                seq,
                buffer,
                started,
                done,
                _turn: turn,
            });
            (wait, s.waiting.len() == 1)
        };
        // The watcher may be parked with nothing outstanding.
        self.ring.wake_producer();
        tracing::trace!(peer = %self.peer, tag, us = started.elapsed().as_micros() as u64, "lane record published");
        let deadline = tokio::time::Instant::from_std(deadline);
        Ok(Box::pin(async move {
            let fail = |failure, buffer| Err(FastPathError { failure, buffer });
            match self.answer(done, alone, deadline).await {
                Ok(Ok(Ok(buffer))) => Ok(buffer),
                Ok(Ok(Err((buffer, why)))) => {
                    fail(FastPathFailure::Refused(why.to_string()), Some(buffer))
                }
                Ok(Err(_)) => fail(self.lost("the lane stopped"), None),
                Err(_) => fail(FastPathFailure::DeadlineExceeded, None),
            }
        }))
    }

    /// Our session with the peer ended: no more sends; those the peer has not finished
    /// fail (their buffers are freed once the peer unmapped them, or its lease ran out).
    fn close(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.ring.close();
    }
}

impl Drop for LaneTx {
    fn drop(&mut self) {
        self.ring.close();
    }
}

/// How often a lane held back by the peer's share looks again.
const SHARE_RECHECK: Duration = Duration::from_micros(200);

/// Whether what a lane delivered and the application did not take (`deliveries`), with
/// `pending` bytes landed for records not delivered yet and `len` more, stays under the
/// peer's `share` (a record larger than the whole share goes once nothing of the lane's is
/// held, as on the socket path). The socket path holds its own deliveries to the share.
pub fn share_allows(deliveries: &dyn Deliveries, share: u64, pending: u64, len: u64) -> bool {
    let held = deliveries.held().saturating_add(pending);
    held == 0 || held.saturating_add(len) <= share
}

/// Why a lane stopped waiting for the peer's share.
#[derive(Debug, thiserror::Error)]
pub enum ShareWait {
    /// This end stopped.
    #[error("the receiver stopped")]
    Stopped,
    /// The application left the share full for this long.
    #[error(
        "the receiver's share for this peer stayed full for {0:?} (limits.peer_inbound_bytes): the application is not taking what arrives"
    )]
    Full(Duration),
}

/// Waits on a lane thread until [`share_allows`] `len` more bytes, for `timeout` at most
/// (like a reservation); then the record fails and the sender gets its buffer back.
///
/// # Errors
/// [`ShareWait`]: `stop` was set, or the share stayed full.
pub fn wait_for_share(
    deliveries: &dyn Deliveries,
    share: u64,
    len: u64,
    timeout: Duration,
    stop: &AtomicBool,
) -> Result<(), ShareWait> {
    let deadline = Instant::now() + timeout;
    while !share_allows(deliveries, share, 0, len) {
        if stop.load(Ordering::SeqCst) {
            return Err(ShareWait::Stopped);
        }
        if Instant::now() >= deadline {
            return Err(ShareWait::Full(timeout));
        }
        std::thread::sleep(SHARE_RECHECK);
    }
    Ok(())
}
