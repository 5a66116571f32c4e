//! The sending end of a lane: the caller's task publishes a record, a watcher thread
//! completes the send when the receiver finished it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::{LaneSettings, PARK};
use crate::ipc::LaneRecord;
use crate::link::ring::{ConsumerRefused, Ring};
use crate::memory::{Buffer, MemoryKind, Unmapper};
use crate::transport::{FastPath, FastPathError, FastPathFailure};

/// The receiver's answer to a record: the buffer back, or with why it was not taken.
type Answer = Result<Buffer, (Buffer, ConsumerRefused)>;

type Completion = oneshot::Sender<Answer>;

struct Waiter {
    seq: u64,
    buffer: Buffer,
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
    settings: LaneSettings,
    state: Mutex<TxState>,
    unmapper: Arc<dyn Unmapper>,
    stop: AtomicBool,
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
    ) -> Result<Arc<LaneTx>, std::io::Error> {
        let tx = Arc::new(LaneTx {
            peer: peer.to_string(),
            ring,
            settings,
            state: Mutex::default(),
            unmapper,
            stop: AtomicBool::new(false),
        });
        let watcher = Arc::clone(&tx);
        std::thread::Builder::new()
            .name("ferry-lane-tx".into())
            .spawn(move || watcher.watch())?;
        Ok(tx)
    }

    /// True when `buffer` may take this lane: device memory, of at most
    /// `transport.ipc.lane_max` bytes, while the lane is open.
    pub fn fits(&self, buffer: &Buffer) -> bool {
        matches!(buffer.kind(), MemoryKind::Device(_))
            && !buffer.is_empty()
            && buffer.len() <= self.settings.max
            && self.state().closed.is_none()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, TxState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
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
    #[allow(clippy::type_complexity)]
    pub fn send_now(
        &self,
        tag: u64,
        buffer: Buffer,
        deadline: Instant,
        turn: Box<dyn Send>,
    ) -> Result<futures::future::BoxFuture<'_, Result<Buffer, FastPathError>>, FastPathError> {
        let failed = |failure, buffer| FastPathError { failure, buffer };
        let started = Instant::now();
        let source = match crate::ipc::export_source(&buffer, false) {
            Ok(s) => s,
            Err(why) => {
                let why = FastPathFailure::Unsupported(why.to_string());
                return Err(failed(why, Some(buffer)));
            }
        };
        let record = LaneRecord {
            tag,
            len: buffer.len() as u64,
            source,
        };
        let record = match record.encode() {
            Ok(r) => r,
            Err(why) => {
                let why = FastPathFailure::Unsupported(why.to_string());
                return Err(failed(why, Some(buffer)));
            }
        };
        let (done, alone) = {
            let mut s = self.state();
            if let Some(why) = &s.closed {
                let error = self.lost(why);
                drop(s);
                return Err(failed(error, Some(buffer)));
            }
            if s.next - s.reaped >= u64::from(self.ring.slots()) {
                return Err(failed(FastPathFailure::Full, Some(buffer)));
            }
            let seq = s.next;
            if let Err(e) = self.ring.publish(seq, s.reaped, &record) {
                drop(s);
                return Err(failed(self.lost(&e.to_string()), Some(buffer)));
            }
            s.next += 1;
            // The peer maps it from now on.
            buffer.note_mapped(Arc::clone(&self.unmapper));
            let (done, wait) = oneshot::channel();
            s.waiting.push_back(Waiter {
                seq,
                buffer,
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
        let spin = if alone {
            self.settings.spin
        } else {
            Duration::ZERO
        };
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
    }
}

impl FastPath for LaneTx {
    fn fits(&self, buffer: &Buffer) -> bool {
        LaneTx::fits(self, buffer)
    }

    fn send(
        &self,
        tag: u64,
        buffer: Buffer,
        deadline: Instant,
        turn: Box<dyn Send>,
    ) -> Result<futures::future::BoxFuture<'_, Result<Buffer, FastPathError>>, FastPathError> {
        LaneTx::send_now(self, tag, buffer, deadline, turn)
    }

    fn close(&self) {
        LaneTx::close(self);
    }
}

impl Drop for LaneTx {
    fn drop(&mut self) {
        self.ring.close();
    }
}
