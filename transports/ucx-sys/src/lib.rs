//! ferry's own bindings to UCX's UCP API, loaded at run time.
//!
//! # What it binds
//!
//! About thirty `ucp_*` entry points (and `ucs_status_string`): configuration
//! (`ucp_config_read/modify/release`), contexts (`ucp_init_version`, `ucp_cleanup`,
//! `ucp_context_query`), workers (`ucp_worker_create/destroy/progress/get_address/
//! release_address/get_efd/arm/flush_nbx`), endpoints (`ucp_ep_create`, `ucp_ep_close_nbx`,
//! `ucp_ep_flush_nbx`, `ucp_ep_query` for the lanes' transports), memory (`ucp_mem_map/unmap/query`, `ucp_rkey_pack`,
//! `ucp_rkey_buffer_release`, `ucp_ep_rkey_unpack`, `ucp_rkey_destroy`), one-sided
//! operations (`ucp_put_nbx`, `ucp_get_nbx`), tagged messages (`ucp_tag_send_nbx`,
//! `ucp_tag_recv_nbx`, `ucp_tag_recv_request_test`) and requests
//! (`ucp_request_check_status/cancel/free`). The structs are written by hand against the
//! UCX 1.13 headers; see [`sys::types`] for the layout notes.
//!
//! In three layers (cudarc's `sys` → `result` → `safe`):
//!
//! - [`sys`]: `#[repr(C)]` types, constants and the function table looked up with
//!   `libloading`.
//! - [`result`]: one thin function per call, returning `Result<_, UcxError>` with UCX's
//!   status code kept.
//! - [`safe`] (re-exported at the root): [`Ucx`], [`Context`], [`Worker`], [`Endpoint`],
//!   [`MemoryHandle`], [`RemoteKey`] and [`Request`], which release in UCX's order on drop.
//!
//! ```no_run
//! use std::time::Duration;
//! use ucx_sys::{Features, MemoryHandle, Ucx};
//!
//! # fn main() -> Result<(), ucx_sys::UcxError> {
//! let ucx = Ucx::load(None)?; // FERRY_UCX_LIBRARY, else the system's libucp.so.0
//! let context = ucx
//!     .context()
//!     .features(Features::TAG | Features::RMA)
//!     .set("TLS", "tcp,self")
//!     .build()?;
//! let worker = context.worker()?;
//! let memory = MemoryHandle::allocate(&context, 1 << 20)?;
//! let (address, rkey) = (worker.address()?, memory.pack_rkey()?);
//! // ... send `address`, `rkey` and `memory.address()` to the peer, which does:
//! let endpoint = worker.connect(&address)?;
//! let remote = endpoint.unpack_rkey(&rkey)?;
//! let mut put = endpoint.put(vec![7u8; 4096], memory.address(), &remote)?;
//! put.wait(Duration::from_secs(5))?;
//! endpoint.flush()?.wait(Duration::from_secs(5))?;
//! # Ok(())
//! # }
//! ```
//!
//! # Versions
//!
//! Binds API 1.13 (`ucp_init_version(1, 13, ..)`) and refuses an older UCX with
//! [`LoadError::TooOld`], naming the version found and the file. Known to work (this
//! crate's tests pass against each):
//!
//! - 1.13.1: Debian bookworm's `libucx0` (the CI machine);
//! - 1.16.0: Ubuntu 24.04's `libucx0` (the GPU machines);
//! - 1.22.0: the `libucx-cu12` wheel's `libucx/lib/libucp.so`, loaded by absolute path; on
//!   a GPU machine with `cuda_copy` allowed, [`Context::info`] reports host, CUDA and CUDA
//!   managed memory.
//!
//! UCX keeps its ABI by growing structs only at the end and reading fields only when their
//! mask bit is set, so later versions work. What a later release added is asked for only of
//! that release: [`Endpoint::transports`] (`ucp_ep_query`'s transports, 1.14) answers
//! [`UcxError::NotInRelease`] under 1.13, whose `ucp_ep_query` would ignore the request and
//! report success. Peers must load the same UCX build: remote keys
//! packed by one version generally do not unpack in another.
//!
//! # Load order
//!
//! [`Ucx::load`] loads the first of these that is set, with no fallback from a set path to
//! the next (a different UCX than the one configured would be a silent mismatch):
//!
//! 1. the path the caller passes (ferry passes its `transport.ucx.library` setting);
//! 2. the environment variable `FERRY_UCX_LIBRARY`;
//! 3. the system's `libucp.so.0`, through the dynamic linker's search.
//!
//! A library that does not load is a [`LoadError`] naming what was tried, never a panic.
//! The build needs no UCX, libclang or CUDA. A loaded library is never unloaded (UCX
//! leaves threads and hooks behind).
//!
//! # What it does not do
//!
//! - No listeners or socket-address connections: endpoints are made from worker addresses
//!   the caller exchanges (ferry over its authenticated link).
//! - No active messages, streams, atomics, iov or generic datatypes; no `ucp_mem_advise`,
//!   no user-allocated requests (`request_size` stays 0), no completion callbacks: requests
//!   are completed by polling the worker ([`Request::wait`]) or, with
//!   [`Features::WAKEUP`], by sleeping on [`Worker::event_fd`].
//! - No error mode NONE: every endpoint uses error mode PEER with an error callback, so a
//!   dead peer fails its operations. UCX then needs a transport that can notice a dead peer
//!   (`tcp`; shared memory alone gives `UCS_ERR_UNREACHABLE`).
//! - No validation of worker addresses or packed remote keys: UCX trusts them, so building
//!   them from received bytes is `unsafe` ([`WorkerAddress::from_bytes`],
//!   [`PackedRkey::from_bytes`]); ferry carries them over its authenticated link.
//! - No thread safety beyond UCX's: a worker and its endpoints live on one thread.
//! - It does not choose transports: `UCX_TLS`, `UCX_NET_DEVICES` and the rest come from the
//!   environment or [`ContextBuilder::set`].

#![deny(unsafe_op_in_unsafe_fn)]

pub mod error;
pub mod result;
pub mod safe;
pub mod sys;
pub mod testing;

pub use error::{LibraryLocation, LibrarySource, LoadError, Status, UcxError, Version};
pub use result::TransportEntry;
pub use safe::*;
