//! Endpoints (error mode PEER) and the remote keys unpacked on them.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use crate::error::UcxError;
use crate::result;
use crate::safe::memory::PackedRkey;
use crate::safe::region::{Region, RegionMut};
use crate::safe::request::{Kind, Refused, Request};
use crate::safe::worker::{Worker, WorkerAddress};
use crate::sys::{self, Library, ucs_status_t};

/// How long dropping an endpoint waits for its forced close to complete before leaking
/// what UCX may still touch.
const CLOSE_ON_DROP: Duration = Duration::from_secs(2);

/// A connection to a peer's worker, in error handling mode PEER.
///
/// Dropping an endpoint force-closes it (`ucp_ep_close_nbx` with
/// `UCP_EP_CLOSE_FLAG_FORCE`): operations in flight fail and the peer sees the connection
/// fail. For an orderly close that first completes what was issued, use
/// [`Endpoint::close`]. Remote keys and requests keep the endpoint alive, so it is closed
/// after them (UCX's order: rkeys destroyed before their endpoint).
///
/// Not `Send`: it lives on its worker's thread.
#[derive(Debug)]
pub struct Endpoint {
    pub(crate) inner: Rc<EndpointInner>,
}

#[derive(Debug)]
pub(crate) struct EndpointInner {
    worker: Worker,
    handle: NonNull<sys::ucp_ep>,
    /// Written by [`on_endpoint_error`]; 0 = no failure, else the `ucs_status_t`. Boxed so
    /// its address, given to UCX as the callback's argument, is stable.
    failure: Box<AtomicI32>,
    /// Set once `ucp_ep_close_nbx` was called (by [`Endpoint::close`]).
    closed: bool,
}

/// The endpoint error callback: records the status. Runs during `ucp_worker_progress` on
/// the worker's thread; never unwinds.
unsafe extern "C" fn on_endpoint_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: ucs_status_t) {
    // SAFETY: `arg` is the address of the endpoint's boxed `AtomicI32`, which lives until
    // the endpoint's close has completed (or is leaked), so it outlives every call UCX
    // makes to this callback; an atomic may be written through a shared reference.
    let slot = unsafe { &*arg.cast::<AtomicI32>() };
    slot.store(i32::from(status), Ordering::Release);
}

impl Endpoint {
    pub(crate) fn connect(worker: &Worker, remote: &WorkerAddress) -> Result<Self, UcxError> {
        let failure = Box::new(AtomicI32::new(0));
        let params = sys::ucp_ep_params_t {
            field_mask: sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            address: remote.as_bytes().as_ptr().cast(),
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler: sys::ucp_err_handler_t {
                cb: Some(on_endpoint_error),
                arg: std::ptr::from_ref::<AtomicI32>(&failure).cast_mut().cast(),
            },
            ..Default::default()
        };
        // SAFETY: the worker is live and on its thread. The mask names the three fields
        // set. The address bytes are a whole worker address: `WorkerAddress` is made only
        // by `Worker::address` or by `from_bytes`, whose caller vouched for them; UCX
        // parses them during this call only. The callback's argument is the boxed
        // atomic, moved into the endpoint below and kept until the close completes.
        let handle = unsafe { result::ep_create(worker.lib(), worker.handle(), &params) }?;
        Ok(Self {
            inner: Rc::new(EndpointInner {
                worker: worker.clone(),
                handle,
                failure,
                closed: false,
            }),
        })
    }

    /// The worker the endpoint belongs to.
    pub fn worker(&self) -> &Worker {
        &self.inner.worker
    }

    fn lib(&self) -> &'static Library {
        self.inner.worker.lib()
    }

    /// Why the endpoint failed, once UCX reported it through the error callback (during
    /// [`Worker::progress`]); `None` while it is healthy. A failed endpoint fails every
    /// later operation; drop it (or [`Endpoint::close`] it) and connect again.
    pub fn failure(&self) -> Option<UcxError> {
        match self.inner.failure.load(Ordering::Acquire) {
            0 => None,
            // The slot holds a widened `ucs_status_t`, so it fits back in an `i8`.
            code => Some(result::error(
                self.lib(),
                "endpoint error callback",
                code as ucs_status_t,
            )),
        }
    }

    /// The transport and device of each of the endpoint's lanes (`ucp_ep_query` with
    /// `UCP_EP_ATTR_FIELD_TRANSPORTS`), in UCX's lane order, at most
    /// [`Endpoint::MAX_TRANSPORTS`]. UCX picks the lanes when the endpoint is created from
    /// the two workers' addresses; they hold for its life unless UCX reconfigures it during
    /// wireup, which completes on first use.
    ///
    /// # Errors
    ///
    /// [`UcxError::NotInRelease`] on a UCX older than 1.14 (which cannot say);
    /// [`UcxError::Unavailable`]; UCX's status.
    pub fn transports(&self) -> Result<Vec<result::TransportEntry>, UcxError> {
        // SAFETY: the endpoint is live and on its worker's thread (not `Send`).
        unsafe { result::ep_query_transports(self.lib(), self.inner.handle, Self::MAX_TRANSPORTS) }
    }

    /// The most lanes [`Endpoint::transports`] reports: more than UCX gives one endpoint.
    pub const MAX_TRANSPORTS: usize = 128;

    /// Unpacks a peer's remote key for use on this endpoint.
    ///
    /// # Errors
    ///
    /// UCX's status; keys packed by a different UCX build often fail here.
    pub fn unpack_rkey(&self, packed: &PackedRkey) -> Result<RemoteKey, UcxError> {
        // SAFETY: the endpoint is live; `PackedRkey` comes from `MemoryHandle::pack_rkey`
        // or from `from_bytes`, whose caller vouched that the bytes are a peer's packed key
        // received intact over an authenticated channel.
        let handle =
            unsafe { result::ep_rkey_unpack(self.lib(), self.inner.handle, packed.as_bytes()) }?;
        Ok(RemoteKey {
            inner: Rc::new(RkeyInner {
                endpoint: self.inner.clone(),
                handle,
            }),
        })
    }

    /// Writes `local` to the peer's memory at `remote_addr` (inside the region `rkey`
    /// describes). The request completes when `local` may be reused; the data is visible
    /// at the peer only after a [`Endpoint::flush`] completes.
    ///
    /// # Errors
    ///
    /// [`Refused`] with the buffer when UCX refuses at once (e.g. the endpoint failed).
    pub fn put<B: Region>(
        &self,
        local: B,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Request<B>, Refused<B>> {
        if let Err(e) = self.check_rkey(rkey) {
            return Err(Refused {
                error: e,
                buffer: local,
            });
        }
        let param = Request::<B>::param_for(&local);
        // SAFETY: endpoint and rkey (unpacked on it, checked above) are live and on their
        // thread; `local` is readable for its length until completion because the request
        // takes ownership of it (and of the rkey and endpoint) below.
        let r = unsafe {
            result::put_nbx(
                self.lib(),
                self.inner.handle,
                local.as_ptr().cast(),
                local.len(),
                remote_addr,
                rkey.inner.handle,
                &param,
            )
        };
        Request::start(
            &self.inner.worker,
            Kind::Plain,
            local,
            Some(self.inner.clone()),
            Some(rkey.inner.clone()),
            r,
        )
    }

    /// Reads the peer's memory at `remote_addr` into `local` (its whole length).
    ///
    /// # Errors
    ///
    /// [`Refused`] with the buffer when UCX refuses at once.
    pub fn get<B: RegionMut>(
        &self,
        mut local: B,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Request<B>, Refused<B>> {
        if let Err(e) = self.check_rkey(rkey) {
            return Err(Refused {
                error: e,
                buffer: local,
            });
        }
        let param = Request::<B>::param_for(&local);
        let (ptr, len) = (local.as_mut_ptr(), local.len());
        // SAFETY: as in `put`, and `local` is writable and reachable only through the
        // request until completion (`RegionMut` contract).
        let r = unsafe {
            result::get_nbx(
                self.lib(),
                self.inner.handle,
                ptr.cast(),
                len,
                remote_addr,
                rkey.inner.handle,
                &param,
            )
        };
        Request::start(
            &self.inner.worker,
            Kind::Plain,
            local,
            Some(self.inner.clone()),
            Some(rkey.inner.clone()),
            r,
        )
    }

    /// Sends `buffer` as a tagged message.
    ///
    /// # Errors
    ///
    /// [`Refused`] with the buffer when UCX refuses at once.
    pub fn tag_send<B: Region>(&self, buffer: B, tag: u64) -> Result<Request<B>, Refused<B>> {
        let param = Request::<B>::param_for(&buffer);
        // SAFETY: the endpoint is live and on its thread; `buffer` is readable until
        // completion because the request owns it.
        let r = unsafe {
            result::tag_send_nbx(
                self.lib(),
                self.inner.handle,
                buffer.as_ptr().cast(),
                buffer.len(),
                tag,
                &param,
            )
        };
        Request::start(
            &self.inner.worker,
            Kind::Plain,
            buffer,
            Some(self.inner.clone()),
            None,
            r,
        )
    }

    /// Completes when every operation issued on this endpoint before it has completed at
    /// the peer (puts are then visible there).
    ///
    /// # Errors
    ///
    /// UCX's status when the flush fails at once.
    pub fn flush(&self) -> Result<Request<()>, UcxError> {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: the endpoint is live and on its thread; an empty mask.
        let r = unsafe { result::ep_flush_nbx(self.lib(), self.inner.handle, &param) };
        Request::start(
            &self.inner.worker,
            Kind::Plain,
            (),
            Some(self.inner.clone()),
            None,
            r,
        )
        .map_err(|e| e.error)
    }

    /// Closes the endpoint in flush mode: completes what was issued, then disconnects. The
    /// returned request completes when the close has.
    ///
    /// # Errors
    ///
    /// [`UcxError::Misuse`] while remote keys or requests of this endpoint still exist
    /// (drop or complete them first); UCX's status.
    pub fn close(self) -> Result<Request<()>, UcxError> {
        let mut inner = Rc::try_unwrap(self.inner).map_err(|_| {
            UcxError::Misuse(
                "an endpoint with live remote keys or requests cannot be closed; \
                 drop them first"
                    .into(),
            )
        })?;
        let param = sys::ucp_request_param_t::default();
        inner.closed = true;
        // SAFETY: the endpoint is live and on its thread, and closed once (`closed` keeps
        // `Drop` from closing again); no rkey of it exists (sole owner, checked above).
        let r = unsafe { result::ep_close_nbx(inner.worker.lib(), inner.handle, &param) };
        // The request owns the rest of the endpoint (its failure slot in particular) until
        // the close completes.
        let worker = inner.worker.clone();
        Request::start(&worker, Kind::Plain, (), Some(Rc::new(inner)), None, r).map_err(|e| e.error)
    }

    fn check_rkey(&self, rkey: &RemoteKey) -> Result<(), UcxError> {
        if Rc::ptr_eq(&rkey.inner.endpoint, &self.inner) {
            Ok(())
        } else {
            Err(UcxError::Misuse(
                "the remote key was unpacked on a different endpoint".into(),
            ))
        }
    }
}

impl Drop for EndpointInner {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        let lib = self.worker.lib();
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: the endpoint is live, closed once (here; `closed` is false), on its
        // worker's thread. Its remote keys and requests hold this `Rc`, so they are gone.
        // FORCE is allowed because the endpoint uses error mode PEER.
        let closing = unsafe { result::ep_close_nbx(lib, self.handle, &param) };
        let Ok(Some(request)) = closing else {
            return; // closed at once, or failed at once: either way UCX is done with it
        };
        let deadline = Instant::now() + CLOSE_ON_DROP;
        loop {
            // SAFETY: `request` is live until freed below.
            match unsafe { result::request_check_status(lib, request) } {
                Ok(false) if Instant::now() < deadline => {
                    self.worker.progress();
                }
                Ok(false) => {
                    // UCX may still call the error callback: leave its slot allocated.
                    std::mem::forget(std::mem::replace(
                        &mut self.failure,
                        Box::new(AtomicI32::new(0)),
                    ));
                    break;
                }
                Ok(true) | Err(_) => break,
            }
        }
        // SAFETY: `request` came from `ep_close_nbx`, is freed once; UCX releases it
        // when it completes if it has not.
        unsafe { result::request_free(lib, request) };
    }
}

/// A peer's memory region key, unpacked on an [`Endpoint`]. Destroyed on drop, after
/// every operation that uses it (they hold it) and before its endpoint (it holds that).
#[derive(Debug)]
pub struct RemoteKey {
    pub(crate) inner: Rc<RkeyInner>,
}

#[derive(Debug)]
pub(crate) struct RkeyInner {
    endpoint: Rc<EndpointInner>,
    handle: NonNull<sys::ucp_rkey>,
}

impl Drop for RkeyInner {
    fn drop(&mut self) {
        // SAFETY: the rkey came from `ep_rkey_unpack` and is destroyed once, here.
        // Requests that used it hold this `Rc`, so they completed (or were leaked, and
        // with them this value); the endpoint is alive (held by `self.endpoint`).
        unsafe { result::rkey_destroy(self.endpoint.worker.lib(), self.handle) }
    }
}
