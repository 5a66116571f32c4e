//! A UCP worker: progress, its address, endpoints, tag receives.

use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::rc::Rc;

use crate::error::UcxError;
use crate::result;
use crate::safe::context::{Context, Features};
use crate::safe::endpoint::Endpoint;
use crate::safe::region::RegionMut;
use crate::safe::request::{Kind, Refused, Request};
use crate::sys::{self, Library};

/// A UCP worker: the progress engine that owns endpoints and in-flight requests.
///
/// **Thread rule:** a worker is created in UCX's single-thread mode and is neither `Send`
/// nor `Sync`: it, its endpoints, remote keys and requests stay on the thread that created
/// it (make the worker on the progress thread). Only its [`Worker::event_fd`] is meant for
/// other threads' `poll`/`epoll`.
///
/// Cheap to clone (shared). Destroyed when the last clone and everything made from it are
/// gone; it keeps its [`Context`] alive.
#[derive(Debug, Clone)]
pub struct Worker {
    pub(crate) inner: Rc<WorkerInner>,
}

#[derive(Debug)]
pub(crate) struct WorkerInner {
    context: Context,
    handle: NonNull<sys::ucp_worker>,
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        // SAFETY: `handle` came from `worker_create` and is destroyed only here, on the
        // worker's thread (`Rc` keeps it there). Endpoints, remote keys and requests hold
        // an `Rc` of this inner value, so they are gone already.
        unsafe { result::worker_destroy(self.context.lib(), self.handle) }
    }
}

/// A worker's packed address: what a peer passes to [`Worker::connect`]. Opaque bytes,
/// valid only for a UCX of the same build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerAddress(Vec<u8>);

impl WorkerAddress {
    /// The bytes to send to a peer.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// An address received from a peer.
    ///
    /// # Safety
    ///
    /// UCX parses a worker address without fully validating it, so malformed bytes can
    /// make [`Worker::connect`] read out of bounds. `bytes` must be exactly what a peer's
    /// [`Worker::address`] returned, carried over a channel that authenticates the peer
    /// and checks integrity (ferry's link), from a UCX of the same build.
    pub unsafe fn from_bytes(bytes: Vec<u8>) -> Self {
        Self(bytes)
    }
}

impl Worker {
    pub(crate) fn new(context: &Context) -> Result<Self, UcxError> {
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        // SAFETY: the context handle is live while `context` is (cloned into the worker
        // below); the mask names only `thread_mode`, which is set.
        let handle = unsafe { result::worker_create(context.lib(), context.handle(), &params) }?;
        Ok(Self {
            inner: Rc::new(WorkerInner {
                context: context.clone(),
                handle,
            }),
        })
    }

    /// The context the worker belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.context
    }

    pub(crate) fn handle(&self) -> NonNull<sys::ucp_worker> {
        self.inner.handle
    }

    pub(crate) fn lib(&self) -> &'static Library {
        self.inner.context.lib()
    }

    /// Runs UCX's progress once (`ucp_worker_progress`): sends, receives, completes
    /// requests, reports failed endpoints. Returns how many events were handled (0: none
    /// were pending). Never blocks.
    pub fn progress(&self) -> u32 {
        // SAFETY: the handle is live while `self` is, and `Worker` is not `Send`, so this
        // is the creating thread (single-thread mode).
        unsafe { result::worker_progress(self.lib(), self.handle()) }
    }

    /// The worker's address, for a peer's [`Worker::connect`].
    ///
    /// # Errors
    ///
    /// UCX's status.
    pub fn address(&self) -> Result<WorkerAddress, UcxError> {
        let lib = self.lib();
        // SAFETY: the handle is live while `self` is.
        let (ptr, len) = unsafe { result::worker_get_address(lib, self.handle()) }?;
        // SAFETY: UCX returned `len` readable bytes at `ptr`, valid until released below.
        let bytes = unsafe { std::slice::from_raw_parts(ptr.as_ptr().cast::<u8>(), len) }.to_vec();
        // SAFETY: `ptr` came from `worker_get_address` on this worker and is released once.
        unsafe { result::worker_release_address(lib, self.handle(), ptr) };
        Ok(WorkerAddress(bytes))
    }

    /// Creates an endpoint to the worker at `remote`, with error handling mode PEER: if
    /// the peer dies or becomes unreachable, the endpoint's operations fail and
    /// [`Endpoint::failure`] reports why. Does not wait for the connection; the first
    /// operation does.
    ///
    /// Note: with error mode PEER, UCX needs a transport that can detect peer failure;
    /// shared memory alone (`UCX_TLS=sm`) cannot and gives `UCS_ERR_UNREACHABLE`: include
    /// `tcp`.
    ///
    /// # Errors
    ///
    /// UCX's status (`UCS_ERR_UNREACHABLE` when no allowed transport reaches the peer).
    pub fn connect(&self, remote: &WorkerAddress) -> Result<Endpoint, UcxError> {
        Endpoint::connect(self, remote)
    }

    /// Posts a receive of a message whose tag matches `tag` on the bits set in `tag_mask`,
    /// into `buffer`. A message longer than the buffer fails with
    /// `UCS_ERR_MESSAGE_TRUNCATED`. Cancellable ([`Request::cancel`]).
    ///
    /// # Errors
    ///
    /// [`Refused`] with the buffer when UCX refuses at once.
    pub fn tag_recv<B: RegionMut>(
        &self,
        mut buffer: B,
        tag: u64,
        tag_mask: u64,
    ) -> Result<Request<B>, Refused<B>> {
        let mut info = sys::ucp_tag_recv_info_t::default();
        let mut param = Request::<B>::param_for(&buffer);
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_RECV_INFO;
        param.recv_info = sys::ucp_request_recv_info {
            tag_info: &mut info,
        };
        let (ptr, len) = (buffer.as_mut_ptr(), buffer.len());
        // SAFETY: the handle is live and on its thread; `buffer` is writable for `len`
        // bytes and stays so until the request completes, because the request takes
        // ownership of it below and never gives it back earlier (`Region` contract);
        // `info` outlives the call, the only time UCX writes it through `param`.
        let r = unsafe {
            result::tag_recv_nbx(
                self.lib(),
                self.handle(),
                ptr.cast(),
                len,
                tag,
                tag_mask,
                &param,
            )
        };
        Request::start(self, Kind::TagRecv(info), buffer, None, None, r)
    }

    /// Flushes every endpoint of the worker: completes when all operations issued before
    /// it completed remotely.
    ///
    /// # Errors
    ///
    /// UCX's status when the flush fails at once.
    pub fn flush(&self) -> Result<Request<()>, UcxError> {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: the handle is live and on its thread; an empty mask.
        let r = unsafe { result::worker_flush_nbx(self.lib(), self.handle(), &param) };
        Request::start(self, Kind::Plain, (), None, None, r).map_err(|e| e.error)
    }

    /// The worker's event file descriptor, for `poll`/`epoll` on any thread (context
    /// feature [`Features::WAKEUP`]). The fd becomes readable when there is work after
    /// [`Worker::arm`] returned `true`. UCX owns it; it lives as long as the worker.
    ///
    /// # Errors
    ///
    /// [`UcxError::Misuse`] without the WAKEUP feature; UCX's status.
    pub fn event_fd(&self) -> Result<BorrowedFd<'_>, UcxError> {
        if !self.context().features().contains(Features::WAKEUP) {
            return Err(UcxError::Misuse(
                "the worker's event fd needs a context with Features::WAKEUP".into(),
            ));
        }
        // SAFETY: the handle is live while `self` is.
        let fd = unsafe { result::worker_get_efd(self.lib(), self.handle()) }?;
        // SAFETY: UCX keeps the fd open until the worker is destroyed, which cannot happen
        // while this borrow of `self` lives.
        Ok(unsafe { BorrowedFd::borrow_raw(fd) })
    }

    /// Arms the event fd (`ucp_worker_arm`). `Ok(true)`: armed, the thread may sleep on
    /// [`Worker::event_fd`]. `Ok(false)`: events are pending; call
    /// [`Worker::progress`] until it returns 0 and arm again.
    ///
    /// # Errors
    ///
    /// [`UcxError::Misuse`] without the WAKEUP feature; UCX's status.
    pub fn arm(&self) -> Result<bool, UcxError> {
        if !self.context().features().contains(Features::WAKEUP) {
            return Err(UcxError::Misuse(
                "arming the worker needs a context with Features::WAKEUP".into(),
            ));
        }
        // SAFETY: the handle is live and on its thread.
        unsafe { result::worker_arm(self.lib(), self.handle()) }
    }
}
