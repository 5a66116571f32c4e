//! An operation's completion, as a future or a blocking wait.

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;

use tokio::sync::oneshot;

use super::error::{OpKind, UcxTransportError};

/// The progress thread's answer to one operation.
pub(crate) type Outcome = Result<(), UcxTransportError>;

/// Where the progress thread sends an operation's outcome. It sends it only once UCX no
/// longer touches the operation's memory.
pub(crate) type Reply = oneshot::Sender<Outcome>;

/// A get, put or flush handed to the engine; it completes when UCX has finished with it
/// (and with the caller's memory).
///
/// Await it from async code, or [`Operation::wait`] on a plain thread. Either gives
/// `Ok(())` when the operation succeeded: for a get, the bytes are in the local buffer;
/// for a put, the local buffer may be reused (the bytes are visible at the peer only
/// after a later [`super::UcxPeer::flush`] completes); for a flush, every get and put
/// issued to the peer before it completed at the peer. A failure says why
/// ([`UcxTransportError`]); after any outcome, UCX no longer touches the memory.
///
/// # Cancel safety
///
/// An operation cannot be cancelled: once handed to the engine it runs to its end, which
/// [`super::UcxSettings::op_timeout`] bounds. **Dropping an unfinished `Operation` blocks
/// the dropping thread until the engine reports the outcome**, so that memory lent to it is
/// never released while UCX may still use it. Do not race it against a timeout in
/// `select!`: the engine already enforces one.
#[derive(Debug)]
#[must_use = "an operation runs to its end even when dropped, and dropping it waits for that"]
pub struct Operation {
    kind: OpKind,
    rx: Option<oneshot::Receiver<Outcome>>,
}

impl Operation {
    pub(crate) fn new(kind: OpKind, rx: oneshot::Receiver<Outcome>) -> Self {
        Self { kind, rx: Some(rx) }
    }

    /// What the operation is.
    pub fn kind(&self) -> OpKind {
        self.kind
    }

    /// Blocks the calling thread until the operation completes and returns its outcome.
    /// Usable anywhere, also inside an async runtime (where it blocks that runtime's
    /// thread; await the operation there instead).
    ///
    /// # Errors
    ///
    /// As awaiting the operation.
    pub fn wait(mut self) -> Result<(), UcxTransportError> {
        block_on(&mut self)
    }
}

impl Future for Operation {
    type Output = Result<(), UcxTransportError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let kind = self.kind;
        let Some(rx) = self.rx.as_mut() else {
            return Poll::Ready(Err(UcxTransportError::Misuse(
                "an operation was polled after it completed",
            )));
        };
        let outcome = match Pin::new(rx).poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Ok(outcome)) => outcome,
            // The progress thread dropped the reply without an answer: it ended, and it
            // drops replies only after destroying the worker, so UCX is done with the
            // memory.
            Poll::Ready(Err(_)) => Err(UcxTransportError::EngineStopped { op: Some(kind) }),
        };
        self.rx = None;
        Poll::Ready(outcome)
    }
}

impl Drop for Operation {
    fn drop(&mut self) {
        if let Some(rx) = self.rx.take() {
            let _ = block_on(rx);
        }
    }
}

/// Wakes a parked thread.
struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs `future` to completion on the calling thread, parking it between polls. For the
/// futures of this module, which are woken by the progress thread; needs no runtime (and
/// does not panic inside one, unlike tokio's `blocking_recv`).
pub(crate) fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn wait_returns_what_the_thread_sent() {
        let (tx, rx) = oneshot::channel();
        let op = Operation::new(OpKind::Get(8), rx);
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            let _ = tx.send(Ok(()));
        });
        assert!(op.wait().is_ok());
        sender.join().expect("sender");
    }

    #[test]
    fn a_dropped_reply_reads_as_the_engine_stopping() {
        let (tx, rx) = oneshot::channel::<Outcome>();
        drop(tx);
        let e = Operation::new(OpKind::Put(1), rx)
            .wait()
            .expect_err("no answer");
        assert!(
            matches!(
                e,
                UcxTransportError::EngineStopped {
                    op: Some(OpKind::Put(1))
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn dropping_an_unfinished_operation_waits_for_its_outcome() {
        let (tx, rx) = oneshot::channel();
        let op = Operation::new(OpKind::Flush, rx);
        let start = Instant::now();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let _ = tx.send(Ok(()));
        });
        drop(op);
        assert!(start.elapsed() >= Duration::from_millis(50));
        sender.join().expect("sender");
    }

    #[tokio::test]
    async fn it_can_be_awaited() {
        let (tx, rx) = oneshot::channel();
        let op = Operation::new(OpKind::Flush, rx);
        let _ = tx.send(Ok(()));
        assert!(op.await.is_ok());
    }
}
