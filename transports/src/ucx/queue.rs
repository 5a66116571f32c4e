//! The road from callers to the progress thread: what they ask for ([`Command`],
//! [`Control`]), the bounded queue it waits in, and the wake-up.
//!
//! Two lanes, one lock:
//!
//! - **ordered** commands (gets, puts, flushes, forgetting a key, closing a peer) run in the
//!   order they were queued, so a flush covers the operations queued before it. Gets, puts,
//!   flushes and forgets count against [`super::UcxSettings::queue_depth`]; when it is
//!   full they are refused ([`UcxTransportError::Saturated`]), never waited for. Closing a
//!   peer does not count: a drop cannot fail, and there is one per peer.
//! - **control** requests (connect, register, unregister, stop) are taken first, whatever
//!   the ordered lane holds. Each comes from a caller blocked on its answer or from a
//!   handle's drop, so the lane holds at most one per blocked thread or live handle.
//!
//! The progress thread sleeps only after announcing it ([`Shared::sleeping`]); a caller
//! that queues something signals the eventfd only then, so a busy thread costs callers no
//! system call.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use tokio::sync::oneshot;

use super::error::{OpKind, UcxTransportError};
use super::lanes::LaneSlot;
use super::operation::Reply;
use super::rkeys::RemoteKey;
use super::wake::Wake;
use ucx_sys::MemoryType;

/// A caller's memory lent to one operation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LocalBuffer {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    /// Where the bytes are, told to UCX rather than left for it to detect: memory from a
    /// CUDA pool made before UCX loaded is not in UCX's memory-type cache, and UCX would
    /// take it for host memory.
    pub(crate) memory: MemoryType,
}

// SAFETY: the pointer is only an address carried to the progress thread, which hands it to
// UCX; the caller of `UcxPeer::get`/`put` (or `Engine::register`) promised, in those
// functions' safety contracts, that the memory stays valid and lent until the operation's
// outcome (or the registration's drop), whichever thread that happens on.
unsafe impl Send for LocalBuffer {}

/// A get, put or flush.
#[derive(Debug)]
pub(crate) struct OpCommand {
    pub(crate) peer: u64,
    pub(crate) kind: OpKind,
    /// The local memory (empty for a flush).
    pub(crate) local: LocalBuffer,
    /// The peer's address (0 for a flush).
    pub(crate) remote: u64,
    /// The peer's key (`None` for a flush).
    pub(crate) rkey: Option<RemoteKey>,
    pub(crate) reply: Reply,
}

/// What runs in queue order.
#[derive(Debug)]
pub(crate) enum Command {
    /// A get, put or flush.
    Op(OpCommand),
    /// Destroy the peer's unpacked copy of a key.
    Forget { peer: u64, key: RemoteKey },
    /// The peer's handle was dropped: close its endpoint once its operations are done.
    DropPeer { peer: u64 },
}

impl Command {
    /// Whether it counts against the queue's capacity. Forgetting a key and dropping a
    /// peer only end UCX state: refused for a full queue, they would leave it behind.
    fn limited(&self) -> bool {
        !matches!(self, Command::DropPeer { .. } | Command::Forget { .. })
    }
}

/// A new endpoint: the peer's number, where its lanes are reported, and its count of
/// unpacked keys.
pub(crate) type Connected = (u64, Arc<LaneSlot>, Arc<std::sync::atomic::AtomicUsize>);

/// What runs before the ordered lane.
#[derive(Debug)]
pub(crate) enum Control {
    /// Create an endpoint to `address` (UCX's bytes, out of a checked envelope); the
    /// answer is the peer's number and where its lanes are reported.
    Connect {
        address: Vec<u8>,
        origin: Arc<str>,
        reply: oneshot::Sender<Result<Connected, UcxTransportError>>,
    },
    /// Map memory and pack its key; the answer is the registration's number and its key
    /// (sealed).
    Register {
        memory: LocalBuffer,
        reply: oneshot::Sender<Result<(u64, Vec<u8>), UcxTransportError>>,
    },
    /// Unmap a registration; the answer says it is done.
    Unregister { id: u64, done: oneshot::Sender<()> },
    /// The engine was dropped.
    Stop,
}

#[derive(Debug, Default)]
struct Queue {
    ordered: VecDeque<Command>,
    /// Ordered commands that count against the capacity.
    limited: usize,
    control: Vec<Control>,
    /// Set once the progress thread stopped taking commands.
    stopped: bool,
}

/// What callers and the progress thread share.
#[derive(Debug)]
pub(crate) struct Shared {
    queue: Mutex<Queue>,
    capacity: usize,
    /// Set by callers after queueing; cleared by the thread before taking.
    pending: AtomicBool,
    /// Set by the thread just before it sleeps.
    sleeping: AtomicBool,
    wake: Wake,
    /// Set once the thread has released every UCX resource.
    finished: Mutex<bool>,
    finished_cv: Condvar,
}

impl Shared {
    pub(crate) fn new(capacity: usize, wake: Wake) -> Self {
        Self {
            queue: Mutex::new(Queue::default()),
            capacity,
            pending: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            wake,
            finished: Mutex::new(false),
            finished_cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // The queue is plain data, consistent between statements, so a panic elsewhere
        // while holding the lock leaves nothing half-done.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues an ordered command.
    ///
    /// # Errors
    ///
    /// [`UcxTransportError::Saturated`] when `queue_depth` limited commands wait already;
    /// [`UcxTransportError::EngineStopped`] once the engine stopped. The command is
    /// dropped (nothing was started).
    pub(crate) fn push(&self, command: Command) -> Result<(), UcxTransportError> {
        {
            let mut q = self.lock();
            if q.stopped {
                let op = match &command {
                    Command::Op(op) => Some(op.kind),
                    _ => None,
                };
                return Err(UcxTransportError::EngineStopped { op });
            }
            if command.limited() {
                if q.limited >= self.capacity {
                    return Err(UcxTransportError::Saturated {
                        capacity: self.capacity,
                    });
                }
                q.limited += 1;
            }
            q.ordered.push_back(command);
        }
        self.notify();
        Ok(())
    }

    /// Queues a control request.
    ///
    /// # Errors
    ///
    /// The request back, once the engine stopped.
    pub(crate) fn control(&self, request: Control) -> Result<(), Control> {
        {
            let mut q = self.lock();
            if q.stopped {
                return Err(request);
            }
            q.control.push(request);
        }
        self.notify();
        Ok(())
    }

    fn notify(&self) {
        self.pending.store(true, Ordering::SeqCst);
        if self.sleeping.swap(false, Ordering::SeqCst) {
            self.wake.signal();
        }
    }

    /// For the thread: whether anything was queued since the last take (and clears the
    /// mark).
    pub(crate) fn take_pending(&self) -> bool {
        self.pending.swap(false, Ordering::SeqCst)
    }

    /// For the thread: every control request, and ordered commands up to the `room`-th
    /// get, put or flush (later ones wait for room in flight).
    pub(crate) fn take(&self, room: usize) -> (Vec<Control>, Vec<Command>) {
        let mut q = self.lock();
        let control = std::mem::take(&mut q.control);
        let mut ordered = Vec::new();
        let mut ops = 0;
        while let Some(front) = q.ordered.front() {
            if matches!(front, Command::Op(_)) {
                if ops == room {
                    break;
                }
                ops += 1;
            }
            let Some(command) = q.ordered.pop_front() else {
                break;
            };
            if command.limited() {
                q.limited -= 1;
            }
            ordered.push(command);
        }
        if !q.ordered.is_empty() {
            // Left for later: keep the mark so the thread comes back for them.
            self.pending.store(true, Ordering::SeqCst);
        }
        (control, ordered)
    }

    /// For the thread, when it stops: refuses everything from now on and takes what
    /// waits.
    pub(crate) fn stop(&self) -> (Vec<Control>, Vec<Command>) {
        let mut q = self.lock();
        q.stopped = true;
        q.limited = 0;
        (
            std::mem::take(&mut q.control),
            std::mem::take(&mut q.ordered).into(),
        )
    }

    /// For the thread, before sleeping: announces the sleep. Returns `false` (and takes
    /// the announcement back) when something was queued meanwhile, so it must not sleep.
    pub(crate) fn announce_sleep(&self) -> bool {
        self.sleeping.store(true, Ordering::SeqCst);
        if self.pending.load(Ordering::SeqCst) {
            self.sleeping.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// For the thread, after sleeping.
    pub(crate) fn woke(&self) {
        self.sleeping.store(false, Ordering::SeqCst);
        self.wake.drain();
    }

    /// The eventfd the thread sleeps on.
    pub(crate) fn wake(&self) -> &Wake {
        &self.wake
    }

    /// For the thread, at its very end: every UCX resource is released.
    pub(crate) fn finish(&self) {
        let mut finished = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        *finished = true;
        self.finished_cv.notify_all();
    }

    /// Blocks until [`Shared::finish`] was called.
    pub(crate) fn wait_finished(&self) {
        let mut finished = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        while !*finished {
            finished = self
                .finished_cv
                .wait(finished)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(capacity: usize) -> Shared {
        Shared::new(capacity, Wake::new().expect("eventfd"))
    }

    fn flush(peer: u64) -> (Command, oneshot::Receiver<super::super::operation::Outcome>) {
        let (reply, rx) = oneshot::channel();
        let op = OpCommand {
            peer,
            kind: OpKind::Flush,
            local: LocalBuffer {
                ptr: std::ptr::null_mut(),
                len: 0,
                memory: MemoryType::Host,
            },
            remote: 0,
            rkey: None,
            reply,
        };
        (Command::Op(op), rx)
    }

    #[test]
    fn a_full_queue_refuses_operations_but_not_closes() {
        let s = shared(2);
        let (a, _ra) = flush(1);
        let (b, _rb) = flush(1);
        let (c, _rc) = flush(1);
        s.push(a).expect("room");
        s.push(b).expect("room");
        assert!(matches!(
            s.push(c),
            Err(UcxTransportError::Saturated { capacity: 2 })
        ));
        s.push(Command::DropPeer { peer: 1 })
            .expect("a close always fits");
        assert!(s.take_pending());
        let (_, taken) = s.take(1);
        assert_eq!(taken.len(), 1, "one operation of room");
        assert!(s.take_pending(), "the rest is still marked");
        let (_, taken) = s.take(10);
        assert_eq!(taken.len(), 2);
        let (d, _rd) = flush(1);
        s.push(d).expect("room again");
    }

    #[test]
    fn a_stopped_queue_refuses_everything() {
        let s = shared(2);
        let (a, _ra) = flush(1);
        s.push(a).expect("room");
        let (_, left) = s.stop();
        assert_eq!(left.len(), 1);
        let (b, _rb) = flush(1);
        assert!(matches!(
            s.push(b),
            Err(UcxTransportError::EngineStopped {
                op: Some(OpKind::Flush)
            })
        ));
        assert!(s.control(Control::Stop).is_err());
    }

    #[test]
    fn the_sleeper_is_signalled_only_when_it_announced_sleep() {
        let s = shared(4);
        assert!(s.announce_sleep());
        s.push(Command::DropPeer { peer: 1 }).expect("queued");
        // The eventfd is readable now: the sleep ends at once.
        let start = std::time::Instant::now();
        super::super::wake::sleep_until_readable(
            &[std::os::fd::AsFd::as_fd(s.wake())],
            Some(std::time::Duration::from_secs(5)),
        )
        .expect("poll");
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
        s.woke();
        assert!(!s.announce_sleep(), "pending work keeps it awake");
    }
}
