//! In-flight operations, completed by progressing their worker.

use std::fmt;
use std::rc::Rc;
use std::time::{Duration, Instant};

use crate::error::UcxError;
use crate::result::{self, RequestPtr};
use crate::safe::endpoint::{EndpointInner, RkeyInner};
use crate::safe::region::Region;
use crate::safe::worker::Worker;
use crate::sys;

/// How long dropping a pending request progresses its worker for it to finish (after
/// cancelling it) before leaking its buffer instead.
const FINISH_ON_DROP: Duration = Duration::from_secs(2);

/// What a completed operation moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transferred {
    /// Bytes: the buffer's length for puts, gets and sends; the message's length for a
    /// tag receive; 0 for flushes and closes.
    pub bytes: usize,
    /// The sender's tag, for a tag receive.
    pub tag: Option<u64>,
}

/// The operation's kind, for how its completion is read.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    /// Put, get, send, flush, close.
    Plain,
    /// A tag receive, with what UCX wrote if it completed at once.
    TagRecv(sys::ucp_tag_recv_info_t),
}

#[derive(Debug)]
enum State {
    Pending(RequestPtr),
    Done(Result<Transferred, UcxError>),
}

/// An operation UCX refused at once; the buffer comes back.
pub struct Refused<B> {
    /// Why.
    pub error: UcxError,
    /// The buffer that was to be lent.
    pub buffer: B,
}

impl<B> fmt::Debug for Refused<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Refused")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<B> fmt::Display for Refused<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl<B> std::error::Error for Refused<B> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<B> From<Refused<B>> for UcxError {
    fn from(r: Refused<B>) -> Self {
        r.error
    }
}

/// An operation in flight, owning the buffer it reads or writes (`B`; `()` for flushes
/// and closes), and keeping its endpoint and remote key alive.
///
/// UCX completes it during [`Worker::progress`]: [`Request::wait`] progresses the worker
/// until it completes; [`Request::poll`] only looks. Once complete,
/// [`Request::into_buffer`] gives the buffer back (also after a failure).
///
/// # Dropping
///
/// Dropping a pending request cancels it and progresses the worker (up to 2 s) until UCX
/// lets go of the buffer. If UCX still has not, the buffer, endpoint, remote key and worker
/// are leaked rather than freed under UCX. `mem::forget` on a request is safe for the same
/// reason: the buffer is leaked with it.
pub struct Request<B> {
    worker: Worker,
    kind: Kind,
    bytes: usize,
    state: State,
    buffer: Option<B>,
    endpoint: Option<Rc<EndpointInner>>,
    rkey: Option<Rc<RkeyInner>>,
}

impl<B> fmt::Debug for Request<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("kind", &self.kind)
            .field("bytes", &self.bytes)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl<B> Request<B> {
    /// The request parameters for an operation on `buffer`: its memory type, when known.
    pub(crate) fn param_for(buffer: &B) -> sys::ucp_request_param_t
    where
        B: Region,
    {
        let mut param = sys::ucp_request_param_t::default();
        if let Some(raw) = buffer.memory_type().to_raw() {
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            param.memory_type = raw;
        }
        param
    }

    /// Wraps what an `*_nbx` call returned.
    pub(crate) fn start(
        worker: &Worker,
        kind: Kind,
        buffer: B,
        endpoint: Option<Rc<EndpointInner>>,
        rkey: Option<Rc<RkeyInner>>,
        started: Result<Option<RequestPtr>, UcxError>,
    ) -> Result<Self, Refused<B>>
    where
        B: Bytes,
    {
        let bytes = buffer.byte_len();
        let state = match started {
            Err(error) => return Err(Refused { error, buffer }),
            Ok(Some(ptr)) => State::Pending(ptr),
            Ok(None) => State::Done(Ok(match kind {
                Kind::Plain => Transferred { bytes, tag: None },
                Kind::TagRecv(info) => Transferred {
                    bytes: info.length,
                    tag: Some(info.sender_tag),
                },
            })),
        };
        Ok(Self {
            worker: worker.clone(),
            kind,
            bytes,
            state,
            buffer: Some(buffer),
            endpoint,
            rkey,
        })
    }

    /// Whether the operation completed (successfully or not), without progressing the
    /// worker; `Some` carries the outcome. Never blocks.
    pub fn poll(&mut self) -> Option<Result<Transferred, UcxError>> {
        if let State::Pending(ptr) = self.state {
            let lib = self.worker.lib();
            let outcome = match self.kind {
                // SAFETY: `ptr` is live: it is freed only below, once, on completion.
                Kind::Plain => match unsafe { result::request_check_status(lib, ptr) } {
                    Ok(false) => return None,
                    Ok(true) => Ok(Transferred {
                        bytes: self.bytes,
                        tag: None,
                    }),
                    Err(e) => Err(e),
                },
                // SAFETY: as above; a tag-receive request.
                Kind::TagRecv(_) => match unsafe { result::tag_recv_request_test(lib, ptr) } {
                    Ok(None) => return None,
                    Ok(Some(info)) => Ok(Transferred {
                        bytes: info.length,
                        tag: Some(info.sender_tag),
                    }),
                    Err(e) => Err(e),
                },
            };
            // SAFETY: the request completed; it is freed once and `state` no longer holds it.
            unsafe { result::request_free(lib, ptr) };
            self.state = State::Done(outcome);
        }
        match &self.state {
            State::Done(outcome) => Some(outcome.clone()),
            State::Pending(_) => None,
        }
    }

    /// Progresses the worker until the operation completes or `timeout` passes. Busy-polls
    /// (the calling thread spins in `ucp_worker_progress`).
    ///
    /// # Errors
    ///
    /// The operation's failure (e.g. a peer failure under error mode PEER,
    /// `UCS_ERR_CANCELED`), or [`UcxError::TimedOut`], after which the request is still
    /// pending and may be waited on again.
    pub fn wait(&mut self, timeout: Duration) -> Result<Transferred, UcxError> {
        self.wait_progressing(timeout, || {})
    }

    /// As [`Request::wait`], calling `also` after each progress of the worker: for a
    /// thread that drives more than one worker (two workers in one test process).
    ///
    /// # Errors
    ///
    /// As [`Request::wait`].
    pub fn wait_progressing(
        &mut self,
        timeout: Duration,
        mut also: impl FnMut(),
    ) -> Result<Transferred, UcxError> {
        let start = Instant::now();
        loop {
            if let Some(outcome) = self.poll() {
                return outcome;
            }
            self.worker.progress();
            also();
            if start.elapsed() >= timeout {
                return self.poll().unwrap_or(Err(UcxError::TimedOut {
                    what: "UCX request",
                    after: timeout,
                }));
            }
        }
    }

    /// Asks UCX to cancel the operation (`ucp_request_cancel`). Tag receives then complete
    /// with `UCS_ERR_CANCELED` at the next progress; operations already on the wire finish
    /// normally. Does nothing to a completed request.
    pub fn cancel(&mut self) {
        if let State::Pending(ptr) = self.state {
            // SAFETY: the worker owns the request, which is live (not yet freed).
            unsafe { result::request_cancel(self.worker.lib(), self.worker.handle(), ptr) }
        }
    }

    /// The buffer back, once the operation completed (whatever the outcome); the request
    /// itself while it is pending.
    ///
    /// # Errors
    ///
    /// `Err(self)` while pending.
    // The pending request comes back whole, like tokio's `SendError<T>`; boxing it would
    // cost an allocation on a path that is usually taken once per operation.
    #[allow(clippy::result_large_err)]
    pub fn into_buffer(mut self) -> Result<B, Self> {
        if self.poll().is_none() {
            return Err(self);
        }
        Ok(self
            .buffer
            .take()
            .expect("the buffer is taken only here, once"))
    }
}

impl<B> Drop for Request<B> {
    fn drop(&mut self) {
        let State::Pending(ptr) = self.state else {
            return;
        };
        self.cancel();
        let deadline = Instant::now() + FINISH_ON_DROP;
        while Instant::now() < deadline {
            if self.poll().is_some() {
                return;
            }
            self.worker.progress();
        }
        // UCX still owns the request: free our claim (UCX releases it when it completes)
        // and leak everything it may still touch.
        // SAFETY: `ptr` is live and freed once; it is not used afterwards.
        unsafe { result::request_free(self.worker.lib(), ptr) };
        std::mem::forget(self.buffer.take());
        std::mem::forget(self.endpoint.take());
        std::mem::forget(self.rkey.take());
        std::mem::forget(self.worker.clone());
    }
}

/// The length of what a request lends, for [`Transferred::bytes`].
pub(crate) trait Bytes {
    fn byte_len(&self) -> usize;
}

impl<R: Region> Bytes for R {
    fn byte_len(&self) -> usize {
        self.len()
    }
}

impl Bytes for () {
    fn byte_len(&self) -> usize {
        0
    }
}
