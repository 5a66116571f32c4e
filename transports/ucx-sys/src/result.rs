//! Layer 2: one thin function per UCP call. Each turns the C status into
//! `Result<_, UcxError>` (keeping the code), out-parameters into return values, and
//! `ucs_status_ptr_t` into `Result<Option<request>>`. Handles stay raw: lifetimes and
//! release order are [`crate::safe`]'s job, so most functions are `unsafe` and say what
//! the caller must uphold.

use std::ffi::{CStr, c_int, c_void};
use std::ptr::{self, NonNull};

use crate::error::{Status, UcxError, Version, status_name};
use crate::sys::{self, Library, ucs_status_ptr_t, ucs_status_t};

/// A request UCX returned for an operation that did not complete at once. It must be
/// completed (or cancelled) and then freed with [`request_free`] exactly once.
pub type RequestPtr = NonNull<c_void>;

/// The API version asked of `ucp_init_version`: the headers this crate was written from.
pub const API_VERSION: (u32, u32) = (1, 13);

/// UCX's text for `code` (`ucs_status_string`, from libucs through libucp's dependencies),
/// or this crate's name for it when the symbol is absent.
pub fn status_string(lib: &Library, code: ucs_status_t) -> String {
    if let Some(f) = lib.fns.ucs_status_string {
        // SAFETY: `ucs_status_string` takes any status value and returns a pointer to a
        // static NUL-terminated string (a fixed table, or "Unknown error" for others).
        let text = unsafe { f(code) };
        if !text.is_null() {
            // SAFETY: non-null, NUL-terminated, static (see above).
            return unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned();
        }
    }
    status_name(code).unwrap_or("unknown status").to_owned()
}

/// `Err(UcxError::Call)` for an error code, `Ok(())` for `UCS_OK`.
pub fn check(lib: &Library, call: &'static str, code: ucs_status_t) -> Result<(), UcxError> {
    if code == sys::UCS_OK {
        Ok(())
    } else {
        Err(error(lib, call, code))
    }
}

/// The error for `code` returned by `call`.
pub fn error(lib: &Library, call: &'static str, code: ucs_status_t) -> UcxError {
    UcxError::Call {
        call,
        status: Status::new(code, status_string(lib, code)),
    }
}

/// Decodes a `ucs_status_ptr_t`: `Ok(None)` when the operation completed at once,
/// `Ok(Some(request))` when it is in flight, `Err` when it failed at once.
pub fn status_ptr(
    lib: &Library,
    call: &'static str,
    ptr: ucs_status_ptr_t,
) -> Result<Option<RequestPtr>, UcxError> {
    if sys::status_ptr_is_err(ptr) {
        return Err(error(lib, call, sys::status_ptr_status(ptr)));
    }
    Ok(NonNull::new(ptr))
}

/// `ucp_get_version`.
pub fn get_version(lib: &Library) -> Version {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: three pointers to live locals, which the function only writes.
    unsafe { (lib.fns.ucp_get_version)(&mut major, &mut minor, &mut release) };
    Version {
        major,
        minor,
        release,
    }
}

/// `ucp_config_read(NULL, NULL, &config)`: UCX's configuration from the `UCX_*`
/// environment variables and its config files.
///
/// # Errors
///
/// UCX's status (e.g. a malformed `UCX_*` variable).
pub fn config_read(lib: &Library) -> Result<NonNull<sys::ucp_config>, UcxError> {
    let mut config = ptr::null_mut();
    // SAFETY: NULL prefix and file name are documented defaults; `config` is a live local.
    let code = unsafe { (lib.fns.ucp_config_read)(ptr::null(), ptr::null(), &mut config) };
    check(lib, "ucp_config_read", code)?;
    NonNull::new(config).ok_or_else(|| error(lib, "ucp_config_read", sys::UCS_ERR_NO_MEMORY))
}

/// `ucp_config_release`.
///
/// # Safety
///
/// `config` came from [`config_read`] and is released once.
pub unsafe fn config_release(lib: &Library, config: NonNull<sys::ucp_config>) {
    // SAFETY: the caller's contract.
    unsafe { (lib.fns.ucp_config_release)(config.as_ptr()) }
}

/// `ucp_config_modify(config, name, value)`; `name` without the `UCX_` prefix.
///
/// # Errors
///
/// `UCS_ERR_NO_ELEM` for an unknown name, `UCS_ERR_INVALID_PARAM` for a bad value.
///
/// # Safety
///
/// `config` is live (from [`config_read`], not released).
pub unsafe fn config_modify(
    lib: &Library,
    config: NonNull<sys::ucp_config>,
    name: &CStr,
    value: &CStr,
) -> Result<(), UcxError> {
    // SAFETY: `config` is live (caller); the strings are NUL-terminated and outlive the
    // call, and UCX copies the value.
    let code =
        unsafe { (lib.fns.ucp_config_modify)(config.as_ptr(), name.as_ptr(), value.as_ptr()) };
    check(lib, "ucp_config_modify", code)
}

/// `ucp_init_version(1, 13, params, config, &context)`.
///
/// # Errors
///
/// UCX's status (e.g. `UCS_ERR_NO_DEVICE` when no transport allowed by `UCX_TLS` exists).
///
/// # Safety
///
/// `params` has a `field_mask` naming only fields that hold valid values (strings
/// NUL-terminated, callbacks callable); `config` is live or `None`.
pub unsafe fn init(
    lib: &Library,
    params: &sys::ucp_params_t,
    config: Option<NonNull<sys::ucp_config>>,
) -> Result<NonNull<sys::ucp_context>, UcxError> {
    let mut context = ptr::null_mut();
    let config = config.map_or(ptr::null_mut(), NonNull::as_ptr);
    // SAFETY: the caller vouches for `params` and `config`; `context` is a live local.
    let code = unsafe {
        (lib.fns.ucp_init_version)(API_VERSION.0, API_VERSION.1, params, config, &mut context)
    };
    check(lib, "ucp_init_version", code)?;
    NonNull::new(context).ok_or_else(|| error(lib, "ucp_init_version", sys::UCS_ERR_NO_MEMORY))
}

/// `ucp_cleanup`.
///
/// # Safety
///
/// `context` is live, cleaned up once, and every worker and memory handle made from it is
/// already destroyed.
pub unsafe fn cleanup(lib: &Library, context: NonNull<sys::ucp_context>) {
    // SAFETY: the caller's contract.
    unsafe { (lib.fns.ucp_cleanup)(context.as_ptr()) }
}

/// `ucp_context_query` (optional in the table).
///
/// # Errors
///
/// [`UcxError::Unavailable`] when the library lacks it; UCX's status.
///
/// # Safety
///
/// `context` is live.
pub unsafe fn context_query(
    lib: &Library,
    context: NonNull<sys::ucp_context>,
    attr: &mut sys::ucp_context_attr_t,
) -> Result<(), UcxError> {
    let f = lib.fns.ucp_context_query.ok_or(UcxError::Unavailable {
        call: "ucp_context_query",
    })?;
    // SAFETY: `context` is live (caller); `attr` is a valid struct UCX fills per its mask.
    check(lib, "ucp_context_query", unsafe {
        f(context.as_ptr(), attr)
    })
}

/// `ucp_worker_create`.
///
/// # Errors
///
/// UCX's status.
///
/// # Safety
///
/// `context` is live; `params`' mask names only valid fields.
pub unsafe fn worker_create(
    lib: &Library,
    context: NonNull<sys::ucp_context>,
    params: &sys::ucp_worker_params_t,
) -> Result<NonNull<sys::ucp_worker>, UcxError> {
    let mut worker = ptr::null_mut();
    // SAFETY: the caller's contract; `worker` is a live local.
    let code = unsafe { (lib.fns.ucp_worker_create)(context.as_ptr(), params, &mut worker) };
    check(lib, "ucp_worker_create", code)?;
    NonNull::new(worker).ok_or_else(|| error(lib, "ucp_worker_create", sys::UCS_ERR_NO_MEMORY))
}

/// `ucp_worker_destroy`.
///
/// # Safety
///
/// `worker` is live and destroyed once, on its thread, after its endpoints are closed
/// and its requests freed.
pub unsafe fn worker_destroy(lib: &Library, worker: NonNull<sys::ucp_worker>) {
    // SAFETY: the caller's contract.
    unsafe { (lib.fns.ucp_worker_destroy)(worker.as_ptr()) }
}

/// `ucp_worker_get_address`: the packed address and its length. Release it with
/// [`worker_release_address`].
///
/// # Errors
///
/// UCX's status.
///
/// # Safety
///
/// `worker` is live.
pub unsafe fn worker_get_address(
    lib: &Library,
    worker: NonNull<sys::ucp_worker>,
) -> Result<(NonNull<sys::ucp_address>, usize), UcxError> {
    let mut address = ptr::null_mut();
    let mut length = 0usize;
    // SAFETY: `worker` is live (caller); the out-pointers are live locals.
    let code =
        unsafe { (lib.fns.ucp_worker_get_address)(worker.as_ptr(), &mut address, &mut length) };
    check(lib, "ucp_worker_get_address", code)?;
    let address = NonNull::new(address)
        .ok_or_else(|| error(lib, "ucp_worker_get_address", sys::UCS_ERR_NO_MEMORY))?;
    Ok((address, length))
}

/// `ucp_worker_release_address`.
///
/// # Safety
///
/// `address` came from [`worker_get_address`] on this live `worker` and is released once.
pub unsafe fn worker_release_address(
    lib: &Library,
    worker: NonNull<sys::ucp_worker>,
    address: NonNull<sys::ucp_address>,
) {
    // SAFETY: the caller's contract.
    unsafe { (lib.fns.ucp_worker_release_address)(worker.as_ptr(), address.as_ptr()) }
}

/// `ucp_worker_progress`: how many events were handled.
///
/// # Safety
///
/// `worker` is live and used by this thread only (the worker's thread mode).
pub unsafe fn worker_progress(lib: &Library, worker: NonNull<sys::ucp_worker>) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { (lib.fns.ucp_worker_progress)(worker.as_ptr()) }
}

/// `ucp_worker_get_efd`: the worker's event file descriptor (context needs
/// `UCP_FEATURE_WAKEUP`). UCX owns the fd.
///
/// # Errors
///
/// UCX's status (`UCS_ERR_UNSUPPORTED`-like without the wakeup feature).
///
/// # Safety
///
/// `worker` is live.
pub unsafe fn worker_get_efd(
    lib: &Library,
    worker: NonNull<sys::ucp_worker>,
) -> Result<c_int, UcxError> {
    let mut fd: c_int = -1;
    // SAFETY: `worker` is live (caller); `fd` is a live local.
    let code = unsafe { (lib.fns.ucp_worker_get_efd)(worker.as_ptr(), &mut fd) };
    check(lib, "ucp_worker_get_efd", code)?;
    Ok(fd)
}

/// `ucp_worker_arm`: `Ok(true)` when armed (safe to sleep on the event fd), `Ok(false)` when
/// events are pending (`UCS_ERR_BUSY`: progress again first).
///
/// # Errors
///
/// UCX's status other than `UCS_ERR_BUSY`.
///
/// # Safety
///
/// `worker` is live and used by this thread only.
pub unsafe fn worker_arm(
    lib: &Library,
    worker: NonNull<sys::ucp_worker>,
) -> Result<bool, UcxError> {
    // SAFETY: the caller's contract.
    let code = unsafe { (lib.fns.ucp_worker_arm)(worker.as_ptr()) };
    if code == sys::UCS_ERR_BUSY {
        return Ok(false);
    }
    check(lib, "ucp_worker_arm", code).map(|()| true)
}

/// `ucp_worker_flush_nbx`.
///
/// # Errors
///
/// UCX's status when the flush fails at once.
///
/// # Safety
///
/// `worker` is live and used by this thread only; `param`'s mask names only valid fields.
pub unsafe fn worker_flush_nbx(
    lib: &Library,
    worker: NonNull<sys::ucp_worker>,
    param: &sys::ucp_request_param_t,
) -> Result<Option<RequestPtr>, UcxError> {
    // SAFETY: the caller's contract.
    let p = unsafe { (lib.fns.ucp_worker_flush_nbx)(worker.as_ptr(), param) };
    status_ptr(lib, "ucp_worker_flush_nbx", p)
}

/// `ucp_ep_create`.
///
/// # Errors
///
/// UCX's status (e.g. `UCS_ERR_UNREACHABLE` when no transport reaches the address).
///
/// # Safety
///
/// `worker` is live and used by this thread only; `params`' mask names only valid fields
/// (the address points at a whole worker address; the error handler's `arg` stays valid
/// until the endpoint is closed).
pub unsafe fn ep_create(
    lib: &Library,
    worker: NonNull<sys::ucp_worker>,
    params: &sys::ucp_ep_params_t,
) -> Result<NonNull<sys::ucp_ep>, UcxError> {
    let mut ep = ptr::null_mut();
    // SAFETY: the caller's contract; `ep` is a live local.
    let code = unsafe { (lib.fns.ucp_ep_create)(worker.as_ptr(), params, &mut ep) };
    check(lib, "ucp_ep_create", code)?;
    NonNull::new(ep).ok_or_else(|| error(lib, "ucp_ep_create", sys::UCS_ERR_NO_MEMORY))
}

/// `ucp_ep_close_nbx`. After this the endpoint handle must not be used, whether or not a
/// request is returned.
///
/// # Errors
///
/// UCX's status when closing fails at once.
///
/// # Safety
///
/// `ep` is live, closed once; its remote keys are destroyed.
pub unsafe fn ep_close_nbx(
    lib: &Library,
    ep: NonNull<sys::ucp_ep>,
    param: &sys::ucp_request_param_t,
) -> Result<Option<RequestPtr>, UcxError> {
    // SAFETY: the caller's contract.
    let p = unsafe { (lib.fns.ucp_ep_close_nbx)(ep.as_ptr(), param) };
    status_ptr(lib, "ucp_ep_close_nbx", p)
}

/// `ucp_ep_flush_nbx`: completes when every operation issued on `ep` before it has
/// completed remotely.
///
/// # Errors
///
/// UCX's status when the flush fails at once.
///
/// # Safety
///
/// `ep` is live.
pub unsafe fn ep_flush_nbx(
    lib: &Library,
    ep: NonNull<sys::ucp_ep>,
    param: &sys::ucp_request_param_t,
) -> Result<Option<RequestPtr>, UcxError> {
    // SAFETY: the caller's contract.
    let p = unsafe { (lib.fns.ucp_ep_flush_nbx)(ep.as_ptr(), param) };
    status_ptr(lib, "ucp_ep_flush_nbx", p)
}

/// The first release whose `ucp_ep_query` reports an endpoint's transports
/// (`UCP_EP_ATTR_FIELD_TRANSPORTS`).
pub const EP_TRANSPORTS_SINCE: Version = Version {
    major: 1,
    minor: 14,
    release: 0,
};

/// One lane of an endpoint, as `ucp_ep_query` names it: a UCT transport (`tcp`, `rc_mlx5`,
/// `cuda_ipc`, ...) on a device (`lo`, `mlx5_0:1`, ...). Copied out of UCX's strings.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransportEntry {
    /// The transport's name.
    pub transport: String,
    /// The device's name (empty where UCX gave none).
    pub device: String,
}

/// `ucp_ep_query` with `UCP_EP_ATTR_FIELD_TRANSPORTS`: the transport and device of each of
/// the endpoint's lanes, at most `capacity` of them, in UCX's lane order.
///
/// # Errors
///
/// [`UcxError::NotInRelease`] for a UCX older than [`EP_TRANSPORTS_SINCE`] (1.13 has
/// `ucp_ep_query` but ignores the field, so it is not called); [`UcxError::Unavailable`]
/// when the library lacks `ucp_ep_query`; UCX's status; [`UcxError::Misuse`] when UCX
/// reports more entries than it was given room for.
///
/// # Safety
///
/// `ep` is live and used by this thread only.
pub unsafe fn ep_query_transports(
    lib: &Library,
    ep: NonNull<sys::ucp_ep>,
    capacity: usize,
) -> Result<Vec<TransportEntry>, UcxError> {
    const WHAT: &str = "ucp_ep_query(UCP_EP_ATTR_FIELD_TRANSPORTS)";
    if lib.version < EP_TRANSPORTS_SINCE {
        return Err(UcxError::NotInRelease {
            what: WHAT,
            since: EP_TRANSPORTS_SINCE,
            found: lib.version,
        });
    }
    let f = lib.fns.ucp_ep_query.ok_or(UcxError::Unavailable {
        call: "ucp_ep_query",
    })?;
    let room = u32::try_from(capacity).unwrap_or(u32::MAX);
    // Null names until UCX writes them: an entry it skips reads as empty, not as garbage.
    let mut entries = vec![sys::ucp_transport_entry_t::default(); room as usize];
    let mut attr = sys::ucp_ep_attr_t {
        field_mask: sys::UCP_EP_ATTR_FIELD_TRANSPORTS,
        transports: sys::ucp_transports_t {
            entries: entries.as_mut_ptr(),
            num_entries: room,
            entry_size: std::mem::size_of::<sys::ucp_transport_entry_t>(),
        },
        ..Default::default()
    };
    // SAFETY: `ep` is live on this thread (caller). The library is 1.14 or later (checked
    // above), whose `ucp_ep_attr_t` has `transports` where ours does and which writes only
    // the masked field: at most `num_entries` entries into `entries`, each within the
    // `entry_size` bytes given, which is our entry's size, so inside the vector.
    check(lib, "ucp_ep_query", unsafe { f(ep.as_ptr(), &mut attr) })?;
    let filled = attr.transports.num_entries as usize;
    if filled > entries.len() {
        return Err(UcxError::Misuse(format!(
            "{WHAT} reported {filled} entries for room of {}",
            entries.len()
        )));
    }
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: non-null names UCX wrote are NUL-terminated strings it keeps until
            // the endpoint is closed; the endpoint is live for this call (caller), and the
            // text is copied out here.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    Ok(entries[..filled]
        .iter()
        .map(|e| TransportEntry {
            transport: text(e.transport_name),
            device: text(e.device_name),
        })
        .collect())
}

/// `ucp_mem_map`.
///
/// # Errors
///
/// UCX's status.
///
/// # Safety
///
/// `context` is live; unless `UCP_MEM_MAP_ALLOCATE` is set, `params` names memory that
/// stays allocated until [`mem_unmap`].
pub unsafe fn mem_map(
    lib: &Library,
    context: NonNull<sys::ucp_context>,
    params: &sys::ucp_mem_map_params_t,
) -> Result<NonNull<sys::ucp_mem>, UcxError> {
    let mut memh = ptr::null_mut();
    // SAFETY: the caller's contract; `memh` is a live local.
    let code = unsafe { (lib.fns.ucp_mem_map)(context.as_ptr(), params, &mut memh) };
    check(lib, "ucp_mem_map", code)?;
    NonNull::new(memh).ok_or_else(|| error(lib, "ucp_mem_map", sys::UCS_ERR_NO_MEMORY))
}

/// `ucp_mem_unmap` (frees the memory if UCX allocated it).
///
/// # Errors
///
/// UCX's status.
///
/// # Safety
///
/// `memh` came from [`mem_map`] on this live `context` and is unmapped once; no
/// operation still uses it.
pub unsafe fn mem_unmap(
    lib: &Library,
    context: NonNull<sys::ucp_context>,
    memh: NonNull<sys::ucp_mem>,
) -> Result<(), UcxError> {
    // SAFETY: the caller's contract.
    let code = unsafe { (lib.fns.ucp_mem_unmap)(context.as_ptr(), memh.as_ptr()) };
    check(lib, "ucp_mem_unmap", code)
}

/// `ucp_mem_query`.
///
/// # Errors
///
/// UCX's status.
///
/// # Safety
///
/// `memh` is live.
pub unsafe fn mem_query(
    lib: &Library,
    memh: NonNull<sys::ucp_mem>,
    attr: &mut sys::ucp_mem_attr_t,
) -> Result<(), UcxError> {
    // SAFETY: the caller's contract; `attr` is a valid struct UCX fills per its mask.
    check(lib, "ucp_mem_query", unsafe {
        (lib.fns.ucp_mem_query)(memh.as_ptr(), attr)
    })
}

/// `ucp_rkey_pack`: a UCX-allocated buffer and its length; release it with
/// [`rkey_buffer_release`].
///
/// # Errors
///
/// UCX's status.
///
/// # Safety
///
/// `context` and `memh` (mapped on it) are live.
pub unsafe fn rkey_pack(
    lib: &Library,
    context: NonNull<sys::ucp_context>,
    memh: NonNull<sys::ucp_mem>,
) -> Result<(NonNull<c_void>, usize), UcxError> {
    let mut buffer = ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: the caller's contract; the out-pointers are live locals.
    let code =
        unsafe { (lib.fns.ucp_rkey_pack)(context.as_ptr(), memh.as_ptr(), &mut buffer, &mut size) };
    check(lib, "ucp_rkey_pack", code)?;
    let buffer =
        NonNull::new(buffer).ok_or_else(|| error(lib, "ucp_rkey_pack", sys::UCS_ERR_NO_MEMORY))?;
    Ok((buffer, size))
}

/// `ucp_rkey_buffer_release`.
///
/// # Safety
///
/// `buffer` came from [`rkey_pack`] and is released once.
pub unsafe fn rkey_buffer_release(lib: &Library, buffer: NonNull<c_void>) {
    // SAFETY: the caller's contract.
    unsafe { (lib.fns.ucp_rkey_buffer_release)(buffer.as_ptr()) }
}

/// `ucp_ep_rkey_unpack`.
///
/// # Errors
///
/// UCX's status (e.g. when the packed key is from a UCX build that does not match).
///
/// # Safety
///
/// `ep` is live. `packed` is passed to UCX, which trusts it: it must come from
/// `ucp_rkey_pack` of a peer (over an authenticated channel), not from an attacker.
pub unsafe fn ep_rkey_unpack(
    lib: &Library,
    ep: NonNull<sys::ucp_ep>,
    packed: &[u8],
) -> Result<NonNull<sys::ucp_rkey>, UcxError> {
    let mut rkey = ptr::null_mut();
    // SAFETY: the caller's contract; `packed` is readable for its length during the call
    // (UCX copies what it needs); `rkey` is a live local.
    let code =
        unsafe { (lib.fns.ucp_ep_rkey_unpack)(ep.as_ptr(), packed.as_ptr().cast(), &mut rkey) };
    check(lib, "ucp_ep_rkey_unpack", code)?;
    NonNull::new(rkey).ok_or_else(|| error(lib, "ucp_ep_rkey_unpack", sys::UCS_ERR_NO_MEMORY))
}

/// `ucp_rkey_destroy`.
///
/// # Safety
///
/// `rkey` is live, destroyed once, after every operation using it completed and before
/// the endpoint it was unpacked on is closed.
pub unsafe fn rkey_destroy(lib: &Library, rkey: NonNull<sys::ucp_rkey>) {
    // SAFETY: the caller's contract.
    unsafe { (lib.fns.ucp_rkey_destroy)(rkey.as_ptr()) }
}

/// `ucp_put_nbx`: writes `length` bytes from `buffer` to `remote_addr` in the peer's
/// memory described by `rkey`.
///
/// # Errors
///
/// UCX's status when the put fails at once.
///
/// # Safety
///
/// `ep` and `rkey` (unpacked on `ep`) are live; `buffer` is readable for `length` bytes
/// until the returned request completes (or at once when none is returned).
pub unsafe fn put_nbx(
    lib: &Library,
    ep: NonNull<sys::ucp_ep>,
    buffer: *const c_void,
    length: usize,
    remote_addr: u64,
    rkey: NonNull<sys::ucp_rkey>,
    param: &sys::ucp_request_param_t,
) -> Result<Option<RequestPtr>, UcxError> {
    // SAFETY: the caller's contract.
    let p = unsafe {
        (lib.fns.ucp_put_nbx)(
            ep.as_ptr(),
            buffer,
            length,
            remote_addr,
            rkey.as_ptr(),
            param,
        )
    };
    status_ptr(lib, "ucp_put_nbx", p)
}

/// `ucp_get_nbx`: reads `length` bytes from `remote_addr` into `buffer`.
///
/// # Errors
///
/// UCX's status when the get fails at once.
///
/// # Safety
///
/// As [`put_nbx`], with `buffer` writable and not otherwise accessed until completion.
pub unsafe fn get_nbx(
    lib: &Library,
    ep: NonNull<sys::ucp_ep>,
    buffer: *mut c_void,
    length: usize,
    remote_addr: u64,
    rkey: NonNull<sys::ucp_rkey>,
    param: &sys::ucp_request_param_t,
) -> Result<Option<RequestPtr>, UcxError> {
    // SAFETY: the caller's contract.
    let p = unsafe {
        (lib.fns.ucp_get_nbx)(
            ep.as_ptr(),
            buffer,
            length,
            remote_addr,
            rkey.as_ptr(),
            param,
        )
    };
    status_ptr(lib, "ucp_get_nbx", p)
}

/// `ucp_tag_send_nbx`.
///
/// # Errors
///
/// UCX's status when the send fails at once.
///
/// # Safety
///
/// `ep` is live; `buffer` is readable for `length` bytes until completion.
pub unsafe fn tag_send_nbx(
    lib: &Library,
    ep: NonNull<sys::ucp_ep>,
    buffer: *const c_void,
    length: usize,
    tag: sys::ucp_tag_t,
    param: &sys::ucp_request_param_t,
) -> Result<Option<RequestPtr>, UcxError> {
    // SAFETY: the caller's contract.
    let p = unsafe { (lib.fns.ucp_tag_send_nbx)(ep.as_ptr(), buffer, length, tag, param) };
    status_ptr(lib, "ucp_tag_send_nbx", p)
}

/// `ucp_tag_recv_nbx`: receives a message whose tag matches `tag` under `tag_mask`.
///
/// # Errors
///
/// UCX's status when the receive fails at once.
///
/// # Safety
///
/// `worker` is live and used by this thread only; `buffer` is writable for `length`
/// bytes and not otherwise accessed until completion; a `recv_info` in `param` points at a
/// live `ucp_tag_recv_info_t` for the duration of the call.
pub unsafe fn tag_recv_nbx(
    lib: &Library,
    worker: NonNull<sys::ucp_worker>,
    buffer: *mut c_void,
    length: usize,
    tag: sys::ucp_tag_t,
    tag_mask: sys::ucp_tag_t,
    param: &sys::ucp_request_param_t,
) -> Result<Option<RequestPtr>, UcxError> {
    // SAFETY: the caller's contract.
    let p = unsafe {
        (lib.fns.ucp_tag_recv_nbx)(worker.as_ptr(), buffer, length, tag, tag_mask, param)
    };
    status_ptr(lib, "ucp_tag_recv_nbx", p)
}

/// `ucp_tag_recv_request_test`: `Ok(Some(info))` when the receive completed,
/// `Ok(None)` while in progress.
///
/// # Errors
///
/// The receive's failure (e.g. `UCS_ERR_MESSAGE_TRUNCATED`, `UCS_ERR_CANCELED`).
///
/// # Safety
///
/// `request` is a live (not freed) tag-receive request.
pub unsafe fn tag_recv_request_test(
    lib: &Library,
    request: RequestPtr,
) -> Result<Option<sys::ucp_tag_recv_info_t>, UcxError> {
    let mut info = sys::ucp_tag_recv_info_t::default();
    // SAFETY: the caller's contract; `info` is a live local.
    let code = unsafe { (lib.fns.ucp_tag_recv_request_test)(request.as_ptr(), &mut info) };
    match code {
        sys::UCS_INPROGRESS => Ok(None),
        sys::UCS_OK => Ok(Some(info)),
        code => Err(error(lib, "ucp_tag_recv_request_test", code)),
    }
}

/// `ucp_request_check_status`: `Ok(true)` completed, `Ok(false)` in progress.
///
/// # Errors
///
/// The operation's failure.
///
/// # Safety
///
/// `request` is live (not freed).
pub unsafe fn request_check_status(lib: &Library, request: RequestPtr) -> Result<bool, UcxError> {
    // SAFETY: the caller's contract.
    let code = unsafe { (lib.fns.ucp_request_check_status)(request.as_ptr()) };
    match code {
        sys::UCS_INPROGRESS => Ok(false),
        sys::UCS_OK => Ok(true),
        code => Err(error(lib, "ucp_request_check_status", code)),
    }
}

/// `ucp_request_cancel`: asks UCX to complete the request with `UCS_ERR_CANCELED` if it
/// can (tag receives; operations already on the wire finish normally).
///
/// # Safety
///
/// `worker` is live and owns `request`, which is live.
pub unsafe fn request_cancel(lib: &Library, worker: NonNull<sys::ucp_worker>, request: RequestPtr) {
    // SAFETY: the caller's contract.
    unsafe { (lib.fns.ucp_request_cancel)(worker.as_ptr(), request.as_ptr()) }
}

/// `ucp_request_free`: gives the request back to UCX (which keeps it until it completes,
/// if it has not).
///
/// # Safety
///
/// `request` is live and freed once; it is not used afterwards.
pub unsafe fn request_free(lib: &Library, request: RequestPtr) {
    // SAFETY: the caller's contract.
    unsafe { (lib.fns.ucp_request_free)(request.as_ptr()) }
}
