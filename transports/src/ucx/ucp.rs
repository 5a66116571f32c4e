//! The progress thread's UCX objects: one context and one worker, the completion and error
//! callbacks, and one thin method per UCP call the engine makes.
//!
//! This uses `ucx_sys::result` (raw handles) rather than `ucx_sys`'s owning types, whose
//! requests keep their endpoint alive: the engine must be able to force-close an endpoint
//! while operations on it are in flight (that is how a missed deadline fails them), and to
//! complete operations from a callback instead of polling each one. Ownership and release
//! order are kept by [`super::thread`] instead: rkeys destroyed before the worker, the
//! worker destroyed before the context, memory unmapped before the context.
//!
//! Everything here runs on the progress thread: the worker is in single-thread mode and
//! [`Ucp`] is neither `Send` nor `Sync` (it holds raw pointers).

use std::cell::Cell;
use std::ffi::{CString, c_void};
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr::NonNull;

use ucx_sys::result::{self, RequestPtr};
use ucx_sys::sys::{self, Library, ucs_status_t};
use ucx_sys::{Ucx, UcxError};

use super::error::UcxTransportError;
use super::queue::LocalBuffer;
use super::settings::UcxSettings;

/// Requests (or endpoints) with the status UCX reported for them, by address.
pub(crate) type EventList = Vec<(usize, ucs_status_t)>;

/// What UCX's callbacks report, for the thread to handle after the call that ran them.
/// Callbacks only append here; they never call UCX or touch anything else.
#[derive(Default)]
pub(crate) struct Events {
    /// Requests that completed: the request and its status.
    completed: Cell<EventList>,
    /// Endpoints that failed: the endpoint and the status.
    failed: Cell<EventList>,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events").finish_non_exhaustive()
    }
}

impl Events {
    fn push(slot: &Cell<EventList>, entry: (usize, ucs_status_t)) {
        let mut list = slot.take();
        list.push(entry);
        slot.set(list);
    }
}

/// `ucp_send_nbx_callback_t` for every request the engine issues.
unsafe extern "C" fn on_request_done(
    request: *mut c_void,
    status: ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: `user_data` is the address of the `Ucp`'s boxed `Events`, set in every
    // request parameter; the box outlives the worker (see `Ucp::drop`), and UCX calls
    // request callbacks only from calls on that worker, on this thread.
    let events = unsafe { &*user_data.cast::<Events>() };
    Events::push(&events.completed, (request as usize, status));
}

/// `ucp_err_handler_cb_t` for every endpoint.
unsafe extern "C" fn on_endpoint_failed(arg: *mut c_void, ep: sys::ucp_ep_h, status: ucs_status_t) {
    // SAFETY: as in `on_request_done`: `arg` is the boxed `Events`, alive until after the
    // worker is destroyed; UCX runs error handlers from worker progress on this thread.
    let events = unsafe { &*arg.cast::<Events>() };
    Events::push(&events.failed, (ep as usize, status));
}

/// The C completion callback, as the `cb` union of `ucp_request_param_t` stores it.
fn request_callback() -> sys::ucp_request_callback_union {
    type SendCallback = unsafe extern "C" fn(*mut c_void, ucs_status_t, *mut c_void);
    let cb: SendCallback = on_request_done;
    // SAFETY: `cb` is a C union of function pointers in `ucp_request_param_t`, all of one
    // size; UCX calls the member for the operation's kind, which for put, get, flush and
    // close is `ucp_send_nbx_callback_t`, the signature of `on_request_done`.
    Some(unsafe { std::mem::transmute::<SendCallback, unsafe extern "C" fn()>(cb) })
}

/// A context and its one worker, created and used on the progress thread.
#[derive(Debug)]
pub(crate) struct Ucp {
    lib: &'static Library,
    context: NonNull<sys::ucp_context>,
    /// `None` once destroyed ([`Ucp::destroy_worker`]).
    worker: Option<NonNull<sys::ucp_worker>>,
    efd: RawFd,
    events: Box<Events>,
    /// The worker's address (UCX's bytes).
    pub(crate) address: Vec<u8>,
    /// Whether the context moves CUDA device memory (its memory types list CUDA; 0 when
    /// the library cannot say).
    pub(crate) moves_cuda: bool,
}

impl Ucp {
    /// Reads UCX's configuration, applies the settings, creates the context (RMA and
    /// WAKEUP) and a single-thread worker, and fetches its event descriptor and address.
    ///
    /// # Errors
    ///
    /// [`UcxTransportError::Setup`] naming the step.
    pub(crate) fn open(ucx: Ucx, settings: &UcxSettings) -> Result<Self, UcxTransportError> {
        let lib = ucx.library();
        let setup = |what: &'static str| move |source| UcxTransportError::Setup { what, source };
        let config = result::config_read(lib).map_err(setup("reading UCX's configuration"))?;
        let mut options: Vec<(&str, &str)> = Vec::new();
        if let Some(tls) = &settings.tls {
            options.push(("TLS", tls));
        }
        options.extend(
            settings
                .options
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str())),
        );
        let mut applied = Ok(());
        for (name, value) in options {
            let (Ok(n), Ok(v)) = (CString::new(name), CString::new(value)) else {
                applied = Err(UcxTransportError::Misuse(
                    "a UCX setting contains a NUL byte",
                ));
                break;
            };
            // SAFETY: `config` is live until released below.
            if let Err(e) = unsafe { result::config_modify(lib, config, &n, &v) } {
                applied = Err(UcxTransportError::Setup {
                    what: "applying a UCX setting (see UcxSettings::tls and options)",
                    source: UcxError::Misuse(format!("UCX_{name}={value}: {e}")),
                });
                break;
            }
        }
        let name = c"ferry";
        let params = sys::ucp_params_t {
            field_mask: sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_NAME,
            features: sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP,
            name: name.as_ptr(),
            ..Default::default()
        };
        let context = applied.and_then(|()| {
            // SAFETY: the mask names the two fields set; the name is a static C string;
            // `config` is live.
            unsafe { result::init(lib, &params, Some(config)) }
                .map_err(setup("creating the UCX context"))
        });
        // SAFETY: `config` came from `config_read` and is released once, here; UCX copied
        // what it needs into the context.
        unsafe { result::config_release(lib, config) };
        let context = context?;

        let mut ucp = Self {
            lib,
            context,
            worker: None,
            efd: -1,
            events: Box::default(),
            address: Vec::new(),
            moves_cuda: false,
        };
        let mut attr = sys::ucp_context_attr_t {
            field_mask: sys::UCP_ATTR_FIELD_MEMORY_TYPES,
            ..Default::default()
        };
        // SAFETY: the context is live; `attr` asks only for the field it has room for. A
        // library without the call (or that fails it) is taken to move host memory only.
        if unsafe { result::context_query(lib, context, &mut attr) }.is_ok() {
            let cuda = ucx_sys::MemoryType::Cuda.to_raw().unwrap_or(u32::MAX);
            ucp.moves_cuda = attr.memory_types & 1u64.checked_shl(cuda).unwrap_or(0) != 0;
        }
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        // SAFETY: the context is live (owned by `ucp`); the mask names `thread_mode` only.
        let worker = unsafe { result::worker_create(lib, context, &params) }
            .map_err(setup("creating the UCX worker"))?;
        ucp.worker = Some(worker);
        // SAFETY: the worker is live; this is its thread.
        ucp.efd = unsafe { result::worker_get_efd(lib, worker) }
            .map_err(setup("getting the worker's event descriptor"))?;
        // SAFETY: the worker is live.
        let (address, len) = unsafe { result::worker_get_address(lib, worker) }
            .map_err(setup("getting the worker's address"))?;
        // SAFETY: UCX returned `len` readable bytes at `address`, valid until released.
        ucp.address =
            unsafe { std::slice::from_raw_parts(address.as_ptr().cast::<u8>(), len) }.to_vec();
        // SAFETY: `address` came from `worker_get_address` on this worker; released once.
        unsafe { result::worker_release_address(lib, worker, address) };
        Ok(ucp)
    }

    fn worker(&self) -> Result<NonNull<sys::ucp_worker>, UcxError> {
        self.worker
            .ok_or_else(|| UcxError::Misuse("the UCX worker is destroyed".into()))
    }

    /// The error for `status` returned by `call`.
    pub(crate) fn error(&self, call: &'static str, status: ucs_status_t) -> UcxError {
        result::error(self.lib, call, status)
    }

    /// `ucp_worker_progress`: events handled (0 once the worker is destroyed).
    pub(crate) fn progress(&self) -> u32 {
        match self.worker {
            // SAFETY: the worker is live and this is its thread (`Ucp` is not `Send`).
            Some(w) => unsafe { result::worker_progress(self.lib, w) },
            None => 0,
        }
    }

    /// `ucp_worker_arm`: `Ok(true)` when the thread may sleep on [`Ucp::event_fd`].
    pub(crate) fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: the worker is live and this is its thread.
        unsafe { result::worker_arm(self.lib, self.worker()?) }
    }

    /// The worker's event descriptor.
    pub(crate) fn event_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: UCX keeps the descriptor open until the worker is destroyed, which needs
        // `&mut self` (`destroy_worker`), so not while this borrow lives. It is only read
        // before then: `open` fails unless it was fetched.
        unsafe { BorrowedFd::borrow_raw(self.efd) }
    }

    /// What the callbacks reported since the last call: endpoint failures, then request
    /// completions.
    pub(crate) fn take_events(&self) -> (EventList, EventList) {
        (self.events.failed.take(), self.events.completed.take())
    }

    fn param(&self) -> sys::ucp_request_param_t {
        sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
            cb: request_callback(),
            user_data: std::ptr::from_ref::<Events>(&self.events).cast_mut().cast(),
            ..Default::default()
        }
    }

    /// `ucp_ep_create` in error mode PEER, failures reported through [`Ucp::take_events`].
    ///
    /// # Safety
    ///
    /// `address` is a whole worker address made by a UCX of this build (UCX reads it
    /// without a length): out of a checked envelope, from a peer authenticated by ferry's
    /// link.
    pub(crate) unsafe fn connect(&self, address: &[u8]) -> Result<NonNull<sys::ucp_ep>, UcxError> {
        let params = sys::ucp_ep_params_t {
            field_mask: sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            address: address.as_ptr().cast(),
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler: sys::ucp_err_handler_t {
                cb: Some(on_endpoint_failed),
                arg: std::ptr::from_ref::<Events>(&self.events).cast_mut().cast(),
            },
            ..Default::default()
        };
        // SAFETY: the worker is live and this is its thread; the mask names the fields
        // set; the address is whole (the caller's contract) and read during the call only;
        // the handler's argument is the boxed `Events`, which outlives the worker and so
        // every endpoint.
        unsafe { result::ep_create(self.lib, self.worker()?, &params) }
    }

    /// `ucp_ep_query` for the endpoint's lanes: each one's transport and device.
    ///
    /// # Safety
    ///
    /// `ep` is a live endpoint of this worker.
    pub(crate) unsafe fn lanes(
        &self,
        ep: NonNull<sys::ucp_ep>,
    ) -> Result<Vec<ucx_sys::TransportEntry>, UcxError> {
        // SAFETY: the caller's contract; this is the worker's thread (`Ucp` is not `Send`).
        unsafe { result::ep_query_transports(self.lib, ep, ucx_sys::Endpoint::MAX_TRANSPORTS) }
    }

    /// `ucp_ep_close_nbx`, forced or in flush mode; `Ok(Some)` is a request to track.
    ///
    /// # Safety
    ///
    /// `ep` is a live endpoint of this worker, closed once; it is not used afterwards.
    pub(crate) unsafe fn close(
        &self,
        ep: NonNull<sys::ucp_ep>,
        force: bool,
    ) -> Result<Option<RequestPtr>, UcxError> {
        let mut param = self.param();
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = if force {
            sys::UCP_EP_CLOSE_FLAG_FORCE
        } else {
            0
        };
        // SAFETY: the caller's contract; FORCE is allowed because every endpoint uses
        // error mode PEER; the callback and its data are valid for the worker's life.
        unsafe { result::ep_close_nbx(self.lib, ep, &param) }
    }

    /// `ucp_ep_rkey_unpack`.
    ///
    /// # Safety
    ///
    /// `ep` is live; `packed` is a key packed by a UCX of this build (checked envelope,
    /// authenticated peer).
    pub(crate) unsafe fn unpack(
        &self,
        ep: NonNull<sys::ucp_ep>,
        packed: &[u8],
    ) -> Result<NonNull<sys::ucp_rkey>, UcxError> {
        // SAFETY: the caller's contract.
        unsafe { result::ep_rkey_unpack(self.lib, ep, packed) }
    }

    /// `ucp_rkey_destroy`.
    ///
    /// # Safety
    ///
    /// `rkey` is live, destroyed once, used by no operation in flight, and the worker is
    /// not destroyed yet (UCX returns the key to the worker's pool).
    pub(crate) unsafe fn destroy_rkey(&self, rkey: NonNull<sys::ucp_rkey>) {
        // SAFETY: the caller's contract.
        unsafe { result::rkey_destroy(self.lib, rkey) }
    }

    /// `ucp_get_nbx` (`put == false`) or `ucp_put_nbx`.
    ///
    /// # Safety
    ///
    /// `ep` and `rkey` (unpacked on it) are live; `local` is valid for `len` bytes (written
    /// by a get, read by a put) and not otherwise accessed until the request completes, or
    /// at once when none is returned.
    pub(crate) unsafe fn rma(
        &self,
        put: bool,
        ep: NonNull<sys::ucp_ep>,
        memory: LocalBuffer,
        remote: u64,
        rkey: NonNull<sys::ucp_rkey>,
    ) -> Result<Option<RequestPtr>, UcxError> {
        let (local, len) = (memory.ptr, memory.len);
        let mut param = self.param();
        if let Some(raw) = memory.memory.to_raw() {
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            param.memory_type = raw;
        }
        if put {
            // SAFETY: the caller's contract.
            unsafe { result::put_nbx(self.lib, ep, local.cast(), len, remote, rkey, &param) }
        } else {
            // SAFETY: the caller's contract.
            unsafe { result::get_nbx(self.lib, ep, local.cast(), len, remote, rkey, &param) }
        }
    }

    /// `ucp_ep_flush_nbx`.
    ///
    /// # Safety
    ///
    /// `ep` is live.
    pub(crate) unsafe fn flush(
        &self,
        ep: NonNull<sys::ucp_ep>,
    ) -> Result<Option<RequestPtr>, UcxError> {
        let param = self.param();
        // SAFETY: the caller's contract.
        unsafe { result::ep_flush_nbx(self.lib, ep, &param) }
    }

    /// `ucp_request_free`.
    ///
    /// # Safety
    ///
    /// `request` was returned by one of this worker's calls, is freed once, and is not
    /// used afterwards (UCX releases it when it completes, if it has not).
    pub(crate) unsafe fn free(&self, request: RequestPtr) {
        // SAFETY: the caller's contract.
        unsafe { result::request_free(self.lib, request) }
    }

    /// `ucp_mem_map` of caller memory, then `ucp_rkey_pack`: the handle and the packed key.
    ///
    /// # Safety
    ///
    /// `memory` (non-null, `len > 0`, of its type) stays allocated until [`Ucp::unmap`].
    pub(crate) unsafe fn map(
        &self,
        memory: LocalBuffer,
    ) -> Result<(NonNull<sys::ucp_mem>, Vec<u8>), UcxError> {
        let mut params = sys::ucp_mem_map_params_t {
            field_mask: sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            address: memory.ptr.cast(),
            length: memory.len,
            ..Default::default()
        };
        if let Some(raw) = memory.memory.to_raw() {
            params.field_mask |= sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
            params.memory_type = raw;
        }
        // SAFETY: the context is live; the mask names the fields set; the memory stays
        // allocated until unmapped (the caller's contract).
        let memh = unsafe { result::mem_map(self.lib, self.context, &params) }?;
        // SAFETY: context and handle are live.
        let packed = match unsafe { result::rkey_pack(self.lib, self.context, memh) } {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: `memh` was just mapped and is unmapped once, here.
                let _ = unsafe { self.unmap(memh) };
                return Err(e);
            }
        };
        let (buffer, size) = packed;
        // SAFETY: UCX returned `size` readable bytes at `buffer`, valid until released.
        let bytes =
            unsafe { std::slice::from_raw_parts(buffer.as_ptr().cast::<u8>(), size) }.to_vec();
        // SAFETY: `buffer` came from `rkey_pack` and is released once, here.
        unsafe { result::rkey_buffer_release(self.lib, buffer) };
        Ok((memh, bytes))
    }

    /// `ucp_mem_unmap`.
    ///
    /// # Safety
    ///
    /// `memh` came from [`Ucp::map`] and is unmapped once.
    pub(crate) unsafe fn unmap(&self, memh: NonNull<sys::ucp_mem>) -> Result<(), UcxError> {
        // SAFETY: the caller's contract; the context is live.
        unsafe { result::mem_unmap(self.lib, self.context, memh) }
    }

    /// Destroys the worker (`ucp_worker_destroy`): afterwards UCX touches no memory of any
    /// operation, finished or not, and runs no callback.
    ///
    /// # Safety
    ///
    /// Every endpoint was closed (or its close request freed) and every rkey destroyed.
    pub(crate) unsafe fn destroy_worker(&mut self) {
        if let Some(worker) = self.worker.take() {
            // SAFETY: the worker is live, destroyed once (taken out of `self`), on its
            // thread; the caller closed its endpoints and destroyed its rkeys.
            unsafe { result::worker_destroy(self.lib, worker) };
        }
    }
}

impl Drop for Ucp {
    fn drop(&mut self) {
        // The thread normally destroys the worker itself, after releasing endpoints, keys
        // and memory; this covers an early return. UCX destroys what is left with it.
        // SAFETY: whatever the thread did not release, UCX releases with the worker; no
        // handle of it is used afterwards because the thread's state is gone too.
        unsafe { self.destroy_worker() };
        // SAFETY: the context is live, cleaned up once, after its worker. `events` is
        // dropped after this, when no callback can run any more.
        unsafe { result::cleanup(self.lib, self.context) };
    }
}
