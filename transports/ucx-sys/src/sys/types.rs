//! The C types of UCP's API, written by hand from the UCX 1.13 headers (`ucp/api/ucp.h`,
//! `ucp/api/ucp_def.h`, `ucs/type/status.h`, `ucs/memory/memory_type.h`).
//!
//! UCX keeps its ABI by growing parameter structs only at their end and reading a field
//! only when its bit is set in `field_mask`. So a struct written against 1.13 works with
//! every later UCX, as long as the mask names exactly the fields that were filled. The
//! offsets below are checked against the 1.13 headers in this module's tests (the numbers
//! come from `offsetof` in a C probe compiled against Debian's `libucx-dev` 1.13.1; the
//! 1.22 headers of the `libucx-cu12` wheel give the same offsets, with longer tails).
//!
//! Each parameter struct that ferry hands to UCX ends with a zeroed `_reserved` tail. A
//! newer UCX whose own struct is longer (1.22's `ucp_request_param_t` is 96 bytes, 1.13's
//! 72) then reads zeros, not whatever lies after ours on the stack, should it ever copy
//! the whole struct.

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `ucs_status_t`. **One byte**: the C enum is declared `UCS_S_PACKED`
/// (`__attribute__((packed))`), so functions return it in `al` and callbacks receive it as
/// an `int8_t`. Reading it as a C `int` would take garbage from the upper bits.
pub type ucs_status_t = i8;
/// `ucs_status_ptr_t`: a request pointer, `NULL` for "done at once", or a status code in
/// the top 100 values of the address space (see [`status_ptr_is_err`]).
pub type ucs_status_ptr_t = *mut c_void;
/// `ucs_memory_type_t` (a plain, 4-byte C enum).
pub type ucs_memory_type_t = c_uint;
/// `ucs_thread_mode_t` (a plain, 4-byte C enum).
pub type ucs_thread_mode_t = c_uint;
/// `ucp_err_handling_mode_t` (a plain, 4-byte C enum).
pub type ucp_err_handling_mode_t = c_uint;
/// `ucp_tag_t`.
pub type ucp_tag_t = u64;
/// `ucp_datatype_t`.
pub type ucp_datatype_t = u64;

macro_rules! opaque {
    ($(#[$doc:meta] $name:ident, $handle:ident;)*) => {$(
        #[$doc]
        #[repr(C)]
        pub struct $name {
            _private: [u8; 0],
            _not_send_sync_unpin: core::marker::PhantomData<(*mut u8, core::marker::PhantomPinned)>,
        }
        #[doc = concat!("A handle: pointer to [`", stringify!($name), "`].")]
        pub type $handle = *mut $name;
    )*};
}

opaque! {
    /// `struct ucp_config`.
    ucp_config, ucp_config_h;
    /// `struct ucp_context`.
    ucp_context, ucp_context_h;
    /// `struct ucp_worker`.
    ucp_worker, ucp_worker_h;
    /// `struct ucp_ep`.
    ucp_ep, ucp_ep_h;
    /// `struct ucp_mem`.
    ucp_mem, ucp_mem_h;
    /// `struct ucp_rkey`.
    ucp_rkey, ucp_rkey_h;
    /// `struct ucp_address` (a packed worker address; its bytes are opaque).
    ucp_address, ucp_address_h;
}

// ---- ucs_status_t values (ucs/type/status.h) ----

/// `UCS_OK`.
pub const UCS_OK: ucs_status_t = 0;
/// `UCS_INPROGRESS`.
pub const UCS_INPROGRESS: ucs_status_t = 1;
/// `UCS_ERR_NO_MESSAGE`.
pub const UCS_ERR_NO_MESSAGE: ucs_status_t = -1;
/// `UCS_ERR_NO_RESOURCE`.
pub const UCS_ERR_NO_RESOURCE: ucs_status_t = -2;
/// `UCS_ERR_IO_ERROR`.
pub const UCS_ERR_IO_ERROR: ucs_status_t = -3;
/// `UCS_ERR_NO_MEMORY`.
pub const UCS_ERR_NO_MEMORY: ucs_status_t = -4;
/// `UCS_ERR_INVALID_PARAM`.
pub const UCS_ERR_INVALID_PARAM: ucs_status_t = -5;
/// `UCS_ERR_UNREACHABLE`.
pub const UCS_ERR_UNREACHABLE: ucs_status_t = -6;
/// `UCS_ERR_INVALID_ADDR`.
pub const UCS_ERR_INVALID_ADDR: ucs_status_t = -7;
/// `UCS_ERR_NOT_IMPLEMENTED`.
pub const UCS_ERR_NOT_IMPLEMENTED: ucs_status_t = -8;
/// `UCS_ERR_MESSAGE_TRUNCATED`.
pub const UCS_ERR_MESSAGE_TRUNCATED: ucs_status_t = -9;
/// `UCS_ERR_NO_PROGRESS`.
pub const UCS_ERR_NO_PROGRESS: ucs_status_t = -10;
/// `UCS_ERR_BUFFER_TOO_SMALL`.
pub const UCS_ERR_BUFFER_TOO_SMALL: ucs_status_t = -11;
/// `UCS_ERR_NO_ELEM`.
pub const UCS_ERR_NO_ELEM: ucs_status_t = -12;
/// `UCS_ERR_SOME_CONNECTS_FAILED`.
pub const UCS_ERR_SOME_CONNECTS_FAILED: ucs_status_t = -13;
/// `UCS_ERR_NO_DEVICE`.
pub const UCS_ERR_NO_DEVICE: ucs_status_t = -14;
/// `UCS_ERR_BUSY`.
pub const UCS_ERR_BUSY: ucs_status_t = -15;
/// `UCS_ERR_CANCELED`.
pub const UCS_ERR_CANCELED: ucs_status_t = -16;
/// `UCS_ERR_SHMEM_SEGMENT`.
pub const UCS_ERR_SHMEM_SEGMENT: ucs_status_t = -17;
/// `UCS_ERR_ALREADY_EXISTS`.
pub const UCS_ERR_ALREADY_EXISTS: ucs_status_t = -18;
/// `UCS_ERR_OUT_OF_RANGE`.
pub const UCS_ERR_OUT_OF_RANGE: ucs_status_t = -19;
/// `UCS_ERR_TIMED_OUT`.
pub const UCS_ERR_TIMED_OUT: ucs_status_t = -20;
/// `UCS_ERR_EXCEEDS_LIMIT`.
pub const UCS_ERR_EXCEEDS_LIMIT: ucs_status_t = -21;
/// `UCS_ERR_UNSUPPORTED`.
pub const UCS_ERR_UNSUPPORTED: ucs_status_t = -22;
/// `UCS_ERR_REJECTED`.
pub const UCS_ERR_REJECTED: ucs_status_t = -23;
/// `UCS_ERR_NOT_CONNECTED`.
pub const UCS_ERR_NOT_CONNECTED: ucs_status_t = -24;
/// `UCS_ERR_CONNECTION_RESET`.
pub const UCS_ERR_CONNECTION_RESET: ucs_status_t = -25;
/// `UCS_ERR_FIRST_LINK_FAILURE`.
pub const UCS_ERR_FIRST_LINK_FAILURE: ucs_status_t = -40;
/// `UCS_ERR_LAST_LINK_FAILURE`.
pub const UCS_ERR_LAST_LINK_FAILURE: ucs_status_t = -59;
/// `UCS_ERR_FIRST_ENDPOINT_FAILURE`.
pub const UCS_ERR_FIRST_ENDPOINT_FAILURE: ucs_status_t = -60;
/// `UCS_ERR_ENDPOINT_TIMEOUT`.
pub const UCS_ERR_ENDPOINT_TIMEOUT: ucs_status_t = -80;
/// `UCS_ERR_LAST_ENDPOINT_FAILURE`.
pub const UCS_ERR_LAST_ENDPOINT_FAILURE: ucs_status_t = -89;
/// `UCS_ERR_LAST`.
pub const UCS_ERR_LAST: ucs_status_t = -100;

/// `UCS_PTR_IS_ERR`: whether a returned `ucs_status_ptr_t` carries an error code.
pub fn status_ptr_is_err(ptr: ucs_status_ptr_t) -> bool {
    // (uintptr_t)ptr >= (uintptr_t)UCS_ERR_LAST, with UCS_ERR_LAST sign-extended.
    ptr as usize >= UCS_ERR_LAST as isize as usize
}

/// `UCS_PTR_STATUS` / `UCS_PTR_RAW_STATUS`: the code inside an error (or `NULL`) pointer.
pub fn status_ptr_status(ptr: ucs_status_ptr_t) -> ucs_status_t {
    // The code is the pointer's value as a small negative integer; truncation is the C
    // macro's own `(ucs_status_t)(intptr_t)ptr`.
    ptr as isize as ucs_status_t
}

// ---- ucs_memory_type_t (ucs/memory/memory_type.h) ----
// Only the values shared by every version: 1.13 ends with ROCM_MANAGED, and later versions
// append RDMA, ZE_* and GAUDI, which moves `UCS_MEMORY_TYPE_UNKNOWN` (= LAST) from 5 to
// 10 in 1.22. Never pass `UNKNOWN` across versions: leave the field's mask bit unset.

/// `UCS_MEMORY_TYPE_HOST`.
pub const UCS_MEMORY_TYPE_HOST: ucs_memory_type_t = 0;
/// `UCS_MEMORY_TYPE_CUDA`.
pub const UCS_MEMORY_TYPE_CUDA: ucs_memory_type_t = 1;
/// `UCS_MEMORY_TYPE_CUDA_MANAGED`.
pub const UCS_MEMORY_TYPE_CUDA_MANAGED: ucs_memory_type_t = 2;
/// `UCS_MEMORY_TYPE_ROCM`.
pub const UCS_MEMORY_TYPE_ROCM: ucs_memory_type_t = 3;
/// `UCS_MEMORY_TYPE_ROCM_MANAGED`.
pub const UCS_MEMORY_TYPE_ROCM_MANAGED: ucs_memory_type_t = 4;

// ---- ucs_thread_mode_t ----

/// `UCS_THREAD_MODE_SINGLE`: only the thread that created the object uses it.
pub const UCS_THREAD_MODE_SINGLE: ucs_thread_mode_t = 0;
/// `UCS_THREAD_MODE_SERIALIZED`: several threads, one at a time.
pub const UCS_THREAD_MODE_SERIALIZED: ucs_thread_mode_t = 1;
/// `UCS_THREAD_MODE_MULTI`: several threads at once.
pub const UCS_THREAD_MODE_MULTI: ucs_thread_mode_t = 2;

// ---- ucp_err_handling_mode_t ----

/// `UCP_ERR_HANDLING_MODE_NONE`.
pub const UCP_ERR_HANDLING_MODE_NONE: ucp_err_handling_mode_t = 0;
/// `UCP_ERR_HANDLING_MODE_PEER`: a failed peer fails the endpoint's operations and calls
/// the endpoint's error handler.
pub const UCP_ERR_HANDLING_MODE_PEER: ucp_err_handling_mode_t = 1;

// ---- enum ucp_feature ----

/// `UCP_FEATURE_TAG`.
pub const UCP_FEATURE_TAG: u64 = 1 << 0;
/// `UCP_FEATURE_RMA`.
pub const UCP_FEATURE_RMA: u64 = 1 << 1;
/// `UCP_FEATURE_AMO32`.
pub const UCP_FEATURE_AMO32: u64 = 1 << 2;
/// `UCP_FEATURE_AMO64`.
pub const UCP_FEATURE_AMO64: u64 = 1 << 3;
/// `UCP_FEATURE_WAKEUP`.
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
/// `UCP_FEATURE_STREAM`.
pub const UCP_FEATURE_STREAM: u64 = 1 << 5;
/// `UCP_FEATURE_AM`.
pub const UCP_FEATURE_AM: u64 = 1 << 6;

// ---- ucp_params_t ----

/// `UCP_PARAM_FIELD_FEATURES`.
pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
/// `UCP_PARAM_FIELD_REQUEST_SIZE`.
pub const UCP_PARAM_FIELD_REQUEST_SIZE: u64 = 1 << 1;
/// `UCP_PARAM_FIELD_REQUEST_INIT`.
pub const UCP_PARAM_FIELD_REQUEST_INIT: u64 = 1 << 2;
/// `UCP_PARAM_FIELD_REQUEST_CLEANUP`.
pub const UCP_PARAM_FIELD_REQUEST_CLEANUP: u64 = 1 << 3;
/// `UCP_PARAM_FIELD_TAG_SENDER_MASK`.
pub const UCP_PARAM_FIELD_TAG_SENDER_MASK: u64 = 1 << 4;
/// `UCP_PARAM_FIELD_MT_WORKERS_SHARED`.
pub const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
/// `UCP_PARAM_FIELD_ESTIMATED_NUM_EPS`.
pub const UCP_PARAM_FIELD_ESTIMATED_NUM_EPS: u64 = 1 << 6;
/// `UCP_PARAM_FIELD_ESTIMATED_NUM_PPN`.
pub const UCP_PARAM_FIELD_ESTIMATED_NUM_PPN: u64 = 1 << 7;
/// `UCP_PARAM_FIELD_NAME`.
pub const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;

/// `ucp_request_init_callback_t` / `ucp_request_cleanup_callback_t`.
pub type ucp_request_init_callback_t = Option<unsafe extern "C" fn(request: *mut c_void)>;

/// `ucp_params_t` (80 bytes in 1.13).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ucp_params_t {
    /// Which of the fields below are set (`UCP_PARAM_FIELD_*`).
    pub field_mask: u64,
    /// `UCP_FEATURE_*`.
    pub features: u64,
    /// Bytes the caller reserves before each request.
    pub request_size: usize,
    /// Called on each new request.
    pub request_init: ucp_request_init_callback_t,
    /// Called on each request before it is released.
    pub request_cleanup: ucp_request_init_callback_t,
    /// Mask of the tag bits that name the sender.
    pub tag_sender_mask: u64,
    /// Non-zero: workers of this context may be used from several threads (the context
    /// takes its own lock).
    pub mt_workers_shared: c_int,
    /// How many endpoints the context expects.
    pub estimated_num_eps: usize,
    /// How many processes per node are expected.
    pub estimated_num_ppn: usize,
    /// The context's name, for logs.
    pub name: *const c_char,
    /// Zeros: room for fields of later versions.
    pub _reserved: [u64; 8],
}

// ---- ucp_context_attr_t ----

/// `UCP_ATTR_FIELD_REQUEST_SIZE`.
pub const UCP_ATTR_FIELD_REQUEST_SIZE: u64 = 1 << 0;
/// `UCP_ATTR_FIELD_THREAD_MODE`.
pub const UCP_ATTR_FIELD_THREAD_MODE: u64 = 1 << 1;
/// `UCP_ATTR_FIELD_MEMORY_TYPES`.
pub const UCP_ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;
/// `UCP_ATTR_FIELD_NAME`.
pub const UCP_ATTR_FIELD_NAME: u64 = 1 << 3;
/// `UCP_ENTITY_NAME_MAX`.
pub const UCP_ENTITY_NAME_MAX: usize = 32;

/// `ucp_context_attr_t` (64 bytes in 1.13; UCX writes only the fields asked for).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ucp_context_attr_t {
    /// Which fields to fill (`UCP_ATTR_FIELD_*`).
    pub field_mask: u64,
    /// Bytes UCX reserves per request.
    pub request_size: usize,
    /// The context's thread mode.
    pub thread_mode: ucs_thread_mode_t,
    /// Bit `n` set: memory of `ucs_memory_type_t` `n` is supported.
    pub memory_types: u64,
    /// The context's name.
    pub name: [c_char; UCP_ENTITY_NAME_MAX],
    /// Room for fields of later versions.
    pub _reserved: [u64; 8],
}

// ---- ucp_worker_params_t ----

/// `UCP_WORKER_PARAM_FIELD_THREAD_MODE`.
pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
/// `UCP_WORKER_PARAM_FIELD_CPU_MASK`.
pub const UCP_WORKER_PARAM_FIELD_CPU_MASK: u64 = 1 << 1;
/// `UCP_WORKER_PARAM_FIELD_EVENTS`.
pub const UCP_WORKER_PARAM_FIELD_EVENTS: u64 = 1 << 2;
/// `UCP_WORKER_PARAM_FIELD_USER_DATA`.
pub const UCP_WORKER_PARAM_FIELD_USER_DATA: u64 = 1 << 3;
/// `UCP_WORKER_PARAM_FIELD_EVENT_FD`.
pub const UCP_WORKER_PARAM_FIELD_EVENT_FD: u64 = 1 << 4;
/// `UCP_WORKER_PARAM_FIELD_FLAGS`.
pub const UCP_WORKER_PARAM_FIELD_FLAGS: u64 = 1 << 5;
/// `UCP_WORKER_PARAM_FIELD_NAME`.
pub const UCP_WORKER_PARAM_FIELD_NAME: u64 = 1 << 6;

/// `ucs_cpu_set_t`: 1024 bits. This is the layout trap of `ucp_worker_params_t`: 128 bytes
/// sit between `thread_mode` and `events`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ucs_cpu_set_t {
    /// The CPU bits.
    pub ucs_bits: [u64; 16],
}

/// `ucp_worker_params_t` (200 bytes in 1.13).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ucp_worker_params_t {
    /// Which fields are set (`UCP_WORKER_PARAM_FIELD_*`).
    pub field_mask: u64,
    /// `UCS_THREAD_MODE_*`.
    pub thread_mode: ucs_thread_mode_t,
    /// CPUs the worker's threads may run on.
    pub cpu_mask: ucs_cpu_set_t,
    /// `UCP_WAKEUP_*` events that wake the event fd.
    pub events: c_uint,
    /// Passed back in callbacks.
    pub user_data: *mut c_void,
    /// An external event fd to use.
    pub event_fd: c_int,
    /// `UCP_WORKER_FLAG_*`.
    pub flags: u64,
    /// The worker's name, for logs.
    pub name: *const c_char,
    /// Alignment of active-message data.
    pub am_alignment: usize,
    /// The client id sent in connection requests.
    pub client_id: u64,
    /// Zeros: room for fields of later versions.
    pub _reserved: [u64; 8],
}

// ---- ucp_ep_params_t ----

/// `UCP_EP_PARAM_FIELD_REMOTE_ADDRESS`.
pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
/// `UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE`.
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
/// `UCP_EP_PARAM_FIELD_ERR_HANDLER`.
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
/// `UCP_EP_PARAM_FIELD_USER_DATA`.
pub const UCP_EP_PARAM_FIELD_USER_DATA: u64 = 1 << 3;
/// `UCP_EP_PARAM_FIELD_SOCK_ADDR`.
pub const UCP_EP_PARAM_FIELD_SOCK_ADDR: u64 = 1 << 4;
/// `UCP_EP_PARAM_FIELD_FLAGS`.
pub const UCP_EP_PARAM_FIELD_FLAGS: u64 = 1 << 5;
/// `UCP_EP_PARAM_FIELD_CONN_REQUEST`.
pub const UCP_EP_PARAM_FIELD_CONN_REQUEST: u64 = 1 << 6;
/// `UCP_EP_PARAM_FIELD_NAME`.
pub const UCP_EP_PARAM_FIELD_NAME: u64 = 1 << 7;

/// `ucp_err_handler_cb_t`. Its status argument is the one-byte `ucs_status_t`.
pub type ucp_err_handler_cb_t =
    Option<unsafe extern "C" fn(arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t)>;

/// `ucp_err_handler_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ucp_err_handler_t {
    /// Called (during worker progress) when the endpoint fails.
    pub cb: ucp_err_handler_cb_t,
    /// Passed to `cb`.
    pub arg: *mut c_void,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ucs_sock_addr_t {
    /// `const struct sockaddr *`.
    pub addr: *const c_void,
    /// `socklen_t`.
    pub addrlen: u32,
}

/// `ucp_ep_params_t` (104 bytes in 1.13).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ucp_ep_params_t {
    /// Which fields are set (`UCP_EP_PARAM_FIELD_*`).
    pub field_mask: u64,
    /// The remote worker's address.
    pub address: *const ucp_address,
    /// `UCP_ERR_HANDLING_MODE_*`.
    pub err_mode: ucp_err_handling_mode_t,
    /// Called when the endpoint fails.
    pub err_handler: ucp_err_handler_t,
    /// The endpoint's user data.
    pub user_data: *mut c_void,
    /// `UCP_EP_PARAMS_FLAGS_*`.
    pub flags: c_uint,
    /// Remote socket address (client–server mode).
    pub sockaddr: ucs_sock_addr_t,
    /// A connection request (server side).
    pub conn_request: *mut c_void,
    /// The endpoint's name, for logs.
    pub name: *const c_char,
    /// Local socket address (client–server mode).
    pub local_sockaddr: ucs_sock_addr_t,
    /// Zeros: room for fields of later versions.
    pub _reserved: [u64; 8],
}

// ---- ucp_ep_close_nbx flags ----

/// `UCP_EP_CLOSE_FLAG_FORCE`: close at once, failing what is in flight; the endpoint must
/// use `UCP_ERR_HANDLING_MODE_PEER`.
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

// ---- ucp_ep_attr_t (ucp_ep_query) ----

/// `UCP_EP_ATTR_FIELD_NAME`.
pub const UCP_EP_ATTR_FIELD_NAME: u64 = 1 << 0;
/// `UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR`.
pub const UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR: u64 = 1 << 1;
/// `UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR`.
pub const UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR: u64 = 1 << 2;
/// `UCP_EP_ATTR_FIELD_TRANSPORTS`: the transport and device of each of the endpoint's
/// lanes. **Since UCX 1.14**: 1.13 has `ucp_ep_query` but ignores this bit and returns
/// `UCS_OK` with `transports` untouched, so the caller must check the version first.
pub const UCP_EP_ATTR_FIELD_TRANSPORTS: u64 = 1 << 3;
/// `UCP_EP_ATTR_FIELD_USER_DATA` (a release after 1.14; ferry never asks for it).
pub const UCP_EP_ATTR_FIELD_USER_DATA: u64 = 1 << 4;

/// `struct sockaddr_storage` (Linux: 128 bytes, 8-byte aligned). Only its size matters
/// here: ferry never asks for the socket-address fields.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct sockaddr_storage {
    /// The bytes.
    pub _bytes: [u64; 16],
}

/// `ucp_transport_entry_t` (since 1.14): one lane's transport and device. Both strings
/// are UCX's, valid until the endpoint is closed. UCX may grow the struct at its end and
/// writes no byte of an entry beyond the `entry_size` the caller gives.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ucp_transport_entry_t {
    /// `const char *`: the transport (`tcp`, `rc_mlx5`, `cuda_ipc`, ...).
    pub transport_name: *const c_char,
    /// `const char *`: the device (`lo`, `mlx5_0:1`, ...).
    pub device_name: *const c_char,
}

/// `ucp_transports_t` (since 1.14): the caller's array of entries.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ucp_transports_t {
    /// The caller's array.
    pub entries: *mut ucp_transport_entry_t,
    /// In: room in `entries`. Out: how many UCX filled.
    pub num_entries: c_uint,
    /// The caller's `sizeof(ucp_transport_entry_t)`: UCX steps through `entries` by it.
    pub entry_size: usize,
}

/// `ucp_ep_attr_t`: 296 bytes in 1.13 (up to `remote_sockaddr`); 1.14 appends
/// `transports`, a later release `user_data`. UCX writes only the fields asked for.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ucp_ep_attr_t {
    /// Which fields to fill (`UCP_EP_ATTR_FIELD_*`).
    pub field_mask: u64,
    /// The endpoint's name.
    pub name: [c_char; UCP_ENTITY_NAME_MAX],
    /// Local socket address (client–server endpoints only).
    pub local_sockaddr: sockaddr_storage,
    /// Remote socket address (client–server endpoints only).
    pub remote_sockaddr: sockaddr_storage,
    /// Since 1.14: the lanes' transports and devices, into the caller's array.
    pub transports: ucp_transports_t,
    /// Later than 1.14: the endpoint's user data.
    pub user_data: *mut c_void,
    /// Room for fields of later versions.
    pub _reserved: [u64; 8],
}

// ---- ucp_mem_map_params_t ----

/// `UCP_MEM_MAP_PARAM_FIELD_ADDRESS`.
pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
/// `UCP_MEM_MAP_PARAM_FIELD_LENGTH`.
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
/// `UCP_MEM_MAP_PARAM_FIELD_FLAGS`.
pub const UCP_MEM_MAP_PARAM_FIELD_FLAGS: u64 = 1 << 2;
/// `UCP_MEM_MAP_PARAM_FIELD_PROT`.
pub const UCP_MEM_MAP_PARAM_FIELD_PROT: u64 = 1 << 3;
/// `UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE`.
pub const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
/// `UCP_MEM_MAP_NONBLOCK`.
pub const UCP_MEM_MAP_NONBLOCK: c_uint = 1 << 0;
/// `UCP_MEM_MAP_ALLOCATE`: UCX allocates the memory; `ucp_mem_unmap` frees it.
pub const UCP_MEM_MAP_ALLOCATE: c_uint = 1 << 1;
/// `UCP_MEM_MAP_FIXED`.
pub const UCP_MEM_MAP_FIXED: c_uint = 1 << 2;
/// `UCP_MEM_MAP_PROT_LOCAL_READ`.
pub const UCP_MEM_MAP_PROT_LOCAL_READ: c_uint = 1 << 0;
/// `UCP_MEM_MAP_PROT_LOCAL_WRITE`.
pub const UCP_MEM_MAP_PROT_LOCAL_WRITE: c_uint = 1 << 1;
/// `UCP_MEM_MAP_PROT_REMOTE_READ`.
pub const UCP_MEM_MAP_PROT_REMOTE_READ: c_uint = 1 << 8;
/// `UCP_MEM_MAP_PROT_REMOTE_WRITE`.
pub const UCP_MEM_MAP_PROT_REMOTE_WRITE: c_uint = 1 << 9;

/// `ucp_mem_map_params_t` (40 bytes in 1.13).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ucp_mem_map_params_t {
    /// Which fields are set (`UCP_MEM_MAP_PARAM_FIELD_*`).
    pub field_mask: u64,
    /// Start of the memory (or a hint, with `UCP_MEM_MAP_ALLOCATE`).
    pub address: *mut c_void,
    /// Bytes.
    pub length: usize,
    /// `UCP_MEM_MAP_*`.
    pub flags: c_uint,
    /// `UCP_MEM_MAP_PROT_*`.
    pub prot: c_uint,
    /// `UCS_MEMORY_TYPE_*`.
    pub memory_type: ucs_memory_type_t,
    /// Zeros: room for fields of later versions.
    pub _reserved: [u64; 8],
}

// ---- ucp_mem_attr_t ----

/// `UCP_MEM_ATTR_FIELD_ADDRESS`.
pub const UCP_MEM_ATTR_FIELD_ADDRESS: u64 = 1 << 0;
/// `UCP_MEM_ATTR_FIELD_LENGTH`.
pub const UCP_MEM_ATTR_FIELD_LENGTH: u64 = 1 << 1;
/// `UCP_MEM_ATTR_FIELD_MEM_TYPE`.
pub const UCP_MEM_ATTR_FIELD_MEM_TYPE: u64 = 1 << 2;

/// `ucp_mem_attr_t` (32 bytes in 1.13; UCX writes only the fields asked for).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ucp_mem_attr_t {
    /// Which fields to fill (`UCP_MEM_ATTR_FIELD_*`).
    pub field_mask: u64,
    /// Start of the mapped memory.
    pub address: *mut c_void,
    /// Bytes mapped.
    pub length: usize,
    /// `UCS_MEMORY_TYPE_*`.
    pub mem_type: ucs_memory_type_t,
    /// Room for fields of later versions.
    pub _reserved: [u64; 8],
}

// ---- ucp_request_param_t ----

/// `UCP_OP_ATTR_FIELD_REQUEST`.
pub const UCP_OP_ATTR_FIELD_REQUEST: u32 = 1 << 0;
/// `UCP_OP_ATTR_FIELD_CALLBACK`.
pub const UCP_OP_ATTR_FIELD_CALLBACK: u32 = 1 << 1;
/// `UCP_OP_ATTR_FIELD_USER_DATA`.
pub const UCP_OP_ATTR_FIELD_USER_DATA: u32 = 1 << 2;
/// `UCP_OP_ATTR_FIELD_DATATYPE`.
pub const UCP_OP_ATTR_FIELD_DATATYPE: u32 = 1 << 3;
/// `UCP_OP_ATTR_FIELD_FLAGS`.
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
/// `UCP_OP_ATTR_FIELD_REPLY_BUFFER`.
pub const UCP_OP_ATTR_FIELD_REPLY_BUFFER: u32 = 1 << 5;
/// `UCP_OP_ATTR_FIELD_MEMORY_TYPE`.
pub const UCP_OP_ATTR_FIELD_MEMORY_TYPE: u32 = 1 << 6;
/// `UCP_OP_ATTR_FIELD_RECV_INFO`.
pub const UCP_OP_ATTR_FIELD_RECV_INFO: u32 = 1 << 7;
/// `UCP_OP_ATTR_FIELD_MEMH`.
pub const UCP_OP_ATTR_FIELD_MEMH: u32 = 1 << 8;
/// `UCP_OP_ATTR_FLAG_NO_IMM_CMPL`: always return a request, even when done at once.
pub const UCP_OP_ATTR_FLAG_NO_IMM_CMPL: u32 = 1 << 16;
/// `UCP_OP_ATTR_FLAG_FAST_CMPL`.
pub const UCP_OP_ATTR_FLAG_FAST_CMPL: u32 = 1 << 17;
/// `UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL`.
pub const UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL: u32 = 1 << 18;

/// `ucp_send_nbx_callback_t`.
pub type ucp_send_nbx_callback_t = Option<
    unsafe extern "C" fn(request: *mut c_void, status: ucs_status_t, user_data: *mut c_void),
>;

/// `struct ucp_tag_recv_info`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ucp_tag_recv_info_t {
    /// The tag the sender used.
    pub sender_tag: ucp_tag_t,
    /// Bytes received.
    pub length: usize,
}

/// The `cb` union of `ucp_request_param_t`: every member is one function pointer, so one
/// nullable pointer stands for all of them.
pub type ucp_request_callback_union = Option<unsafe extern "C" fn()>;

/// The `recv_info` union of `ucp_request_param_t` (`size_t *length` or
/// `ucp_tag_recv_info_t *tag_info`).
#[repr(C)]
#[derive(Clone, Copy)]
pub union ucp_request_recv_info {
    /// For stream receives.
    pub length: *mut usize,
    /// For tag receives.
    pub tag_info: *mut ucp_tag_recv_info_t,
}

impl std::fmt::Debug for ucp_request_recv_info {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // SAFETY: both members are plain pointers of the same size; reading either as an
        // address only formats it.
        let p = unsafe { self.tag_info };
        write!(f, "{p:p}")
    }
}

/// `ucp_request_param_t` (72 bytes in 1.13, 96 in 1.22).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ucp_request_param_t {
    /// Which fields are set and flags (`UCP_OP_ATTR_*`). Note: 32 bits, not 64.
    pub op_attr_mask: u32,
    /// Operation flags (e.g. `UCP_EP_CLOSE_FLAG_FORCE` for `ucp_ep_close_nbx`).
    pub flags: u32,
    /// A caller-allocated request.
    pub request: *mut c_void,
    /// The completion callback.
    pub cb: ucp_request_callback_union,
    /// `ucp_datatype_t`; unset means contiguous bytes.
    pub datatype: ucp_datatype_t,
    /// Passed to the callback.
    pub user_data: *mut c_void,
    /// For atomics.
    pub reply_buffer: *mut c_void,
    /// `UCS_MEMORY_TYPE_*` of the local buffer.
    pub memory_type: ucs_memory_type_t,
    /// Where a receive that completes at once writes what it received.
    pub recv_info: ucp_request_recv_info,
    /// A memory handle covering the local buffer.
    pub memh: ucp_mem_h,
    /// Zeros: room for fields of later versions.
    pub _reserved: [u64; 8],
}

// Zeroed values: every parameter struct starts from all-zero (mask 0, null pointers), and
// the wrappers set the fields and bits they fill.
macro_rules! zeroed_default {
    ($($t:ty),*) => {$(
        impl Default for $t {
            fn default() -> Self {
                // SAFETY: the struct is `repr(C)` and made only of integers, raw pointers,
                // `Option`s of function pointers and arrays of those; all-zero is a valid
                // value of each (0, null, `None`).
                unsafe { std::mem::zeroed() }
            }
        }
    )*};
}
zeroed_default!(
    ucp_params_t,
    ucp_context_attr_t,
    ucp_worker_params_t,
    ucp_ep_params_t,
    ucp_mem_map_params_t,
    ucp_mem_attr_t,
    ucp_request_param_t,
    ucp_ep_attr_t,
    ucp_transport_entry_t
);

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    /// Offsets of the 1.13 headers (C `offsetof`, x86-64 and aarch64 Linux alike).
    #[test]
    fn layouts_match_the_1_13_headers() {
        assert_eq!(size_of::<ucs_status_t>(), 1);
        assert_eq!(size_of::<ucs_memory_type_t>(), 4);

        assert_eq!(offset_of!(ucp_params_t, features), 8);
        assert_eq!(offset_of!(ucp_params_t, request_size), 16);
        assert_eq!(offset_of!(ucp_params_t, request_init), 24);
        assert_eq!(offset_of!(ucp_params_t, request_cleanup), 32);
        assert_eq!(offset_of!(ucp_params_t, tag_sender_mask), 40);
        assert_eq!(offset_of!(ucp_params_t, mt_workers_shared), 48);
        assert_eq!(offset_of!(ucp_params_t, estimated_num_eps), 56);
        assert_eq!(offset_of!(ucp_params_t, estimated_num_ppn), 64);
        assert_eq!(offset_of!(ucp_params_t, name), 72);
        assert_eq!(offset_of!(ucp_params_t, _reserved), 80);

        assert_eq!(offset_of!(ucp_worker_params_t, thread_mode), 8);
        assert_eq!(offset_of!(ucp_worker_params_t, cpu_mask), 16);
        assert_eq!(offset_of!(ucp_worker_params_t, events), 144);
        assert_eq!(offset_of!(ucp_worker_params_t, user_data), 152);
        assert_eq!(offset_of!(ucp_worker_params_t, event_fd), 160);
        assert_eq!(offset_of!(ucp_worker_params_t, flags), 168);
        assert_eq!(offset_of!(ucp_worker_params_t, name), 176);
        assert_eq!(offset_of!(ucp_worker_params_t, am_alignment), 184);
        assert_eq!(offset_of!(ucp_worker_params_t, client_id), 192);
        assert_eq!(offset_of!(ucp_worker_params_t, _reserved), 200);

        assert_eq!(size_of::<ucp_err_handler_t>(), 16);
        assert_eq!(size_of::<ucs_sock_addr_t>(), 16);
        assert_eq!(offset_of!(ucp_ep_params_t, address), 8);
        assert_eq!(offset_of!(ucp_ep_params_t, err_mode), 16);
        assert_eq!(offset_of!(ucp_ep_params_t, err_handler), 24);
        assert_eq!(offset_of!(ucp_ep_params_t, user_data), 40);
        assert_eq!(offset_of!(ucp_ep_params_t, flags), 48);
        assert_eq!(offset_of!(ucp_ep_params_t, sockaddr), 56);
        assert_eq!(offset_of!(ucp_ep_params_t, conn_request), 72);
        assert_eq!(offset_of!(ucp_ep_params_t, name), 80);
        assert_eq!(offset_of!(ucp_ep_params_t, local_sockaddr), 88);
        assert_eq!(offset_of!(ucp_ep_params_t, _reserved), 104);

        assert_eq!(offset_of!(ucp_mem_map_params_t, address), 8);
        assert_eq!(offset_of!(ucp_mem_map_params_t, length), 16);
        assert_eq!(offset_of!(ucp_mem_map_params_t, flags), 24);
        assert_eq!(offset_of!(ucp_mem_map_params_t, prot), 28);
        assert_eq!(offset_of!(ucp_mem_map_params_t, memory_type), 32);
        assert_eq!(offset_of!(ucp_mem_map_params_t, _reserved), 40);

        assert_eq!(offset_of!(ucp_mem_attr_t, address), 8);
        assert_eq!(offset_of!(ucp_mem_attr_t, length), 16);
        assert_eq!(offset_of!(ucp_mem_attr_t, mem_type), 24);

        assert_eq!(offset_of!(ucp_context_attr_t, request_size), 8);
        assert_eq!(offset_of!(ucp_context_attr_t, thread_mode), 16);
        assert_eq!(offset_of!(ucp_context_attr_t, memory_types), 24);
        assert_eq!(offset_of!(ucp_context_attr_t, name), 32);
        assert_eq!(offset_of!(ucp_context_attr_t, _reserved), 64);

        assert_eq!(offset_of!(ucp_request_param_t, op_attr_mask), 0);
        assert_eq!(offset_of!(ucp_request_param_t, flags), 4);
        assert_eq!(offset_of!(ucp_request_param_t, request), 8);
        assert_eq!(offset_of!(ucp_request_param_t, cb), 16);
        assert_eq!(offset_of!(ucp_request_param_t, datatype), 24);
        assert_eq!(offset_of!(ucp_request_param_t, user_data), 32);
        assert_eq!(offset_of!(ucp_request_param_t, reply_buffer), 40);
        assert_eq!(offset_of!(ucp_request_param_t, memory_type), 48);
        assert_eq!(offset_of!(ucp_request_param_t, recv_info), 56);
        assert_eq!(offset_of!(ucp_request_param_t, memh), 64);
        assert_eq!(offset_of!(ucp_request_param_t, _reserved), 72);

        assert_eq!(size_of::<sockaddr_storage>(), 128);
        assert_eq!(offset_of!(ucp_ep_attr_t, name), 8);
        assert_eq!(offset_of!(ucp_ep_attr_t, local_sockaddr), 40);
        assert_eq!(offset_of!(ucp_ep_attr_t, remote_sockaddr), 168);
        // Appended after 1.13 (offsets from the 1.22 headers; 1.14 added `transports`):
        assert_eq!(offset_of!(ucp_ep_attr_t, transports), 296);
        assert_eq!(offset_of!(ucp_ep_attr_t, user_data), 320);
        assert_eq!(size_of::<ucp_transports_t>(), 24);
        assert_eq!(offset_of!(ucp_transports_t, num_entries), 8);
        assert_eq!(offset_of!(ucp_transports_t, entry_size), 16);
        assert_eq!(size_of::<ucp_transport_entry_t>(), 16);
        assert_eq!(offset_of!(ucp_transport_entry_t, device_name), 8);

        assert_eq!(size_of::<ucp_tag_recv_info_t>(), 16);
        assert_eq!(align_of::<ucp_request_param_t>(), 8);
    }

    #[test]
    fn status_pointers_decode_like_the_c_macros() {
        assert!(!status_ptr_is_err(std::ptr::null_mut()));
        assert_eq!(status_ptr_status(std::ptr::null_mut()), UCS_OK);
        let err = UCS_ERR_CONNECTION_RESET as isize as *mut c_void;
        assert!(status_ptr_is_err(err));
        assert_eq!(status_ptr_status(err), UCS_ERR_CONNECTION_RESET);
        let last = UCS_ERR_LAST as isize as *mut c_void;
        assert!(status_ptr_is_err(last));
        let request = 0x7f00_1234_5000_usize as *mut c_void;
        assert!(!status_ptr_is_err(request));
    }
}
