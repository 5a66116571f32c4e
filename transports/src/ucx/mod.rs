//! The node-wide UCX engine of the ucx transport: one UCX context and worker per node
//! process, driven by one thread, reached through cheap handles.
//!
//! - [`Engine::start`] loads UCX ([`UcxSettings::library`], else `FERRY_UCX_LIBRARY`,
//!   else the system's `libucp.so.0`) and starts the progress thread;
//!   [`Engine::address`] is what a peer needs to [`Engine::connect`] back.
//! - [`Engine::connect`] gives a [`UcxPeer`]: an endpoint in error mode PEER, with
//!   [`UcxPeer::get`], [`UcxPeer::put`] and [`UcxPeer::flush`], each an [`Operation`] to
//!   await or [`Operation::wait`] on, and a bounded cache of the peer's unpacked keys
//!   ([`UcxPeer::forget_rkey`]). [`UcxPeer::lanes`] names the UCX transports the endpoint
//!   uses and whether gets and puts over them are one-sided or emulated over tcp
//!   ([`RmaPath`]; UCX 1.14 and later).
//! - [`Engine::register`] maps memory for peers; its [`Registration::rkey`] and
//!   [`Registration::address`] travel to them over ferry's link.
//!
//! It moves bytes; it does not decide which transfer runs when. [`capabilities`] is its
//! line in the registry; [`Engine::export`] and [`UcxPeer::get_into`] take ferry's buffers;
//! [`loaded`] says which UCX release a node loads, and from which file.
//!
//! # Threading model
//!
//! Every UCX call runs on one thread, `ferry-ucx`, which owns the context, the worker
//! (in UCX's single-thread mode), every endpoint, remote key, registration and request.
//! Callers on any thread (tokio tasks or plain threads) put commands on a bounded queue
//! and signal an eventfd; answers come back on one-shot channels.
//!
//! Why one thread: a UCX worker is not thread-safe unless UCX locks it on every call
//! (`UCS_THREAD_MODE_MULTI`), and it makes progress only when someone calls
//! `ucp_worker_progress`. A dedicated owner needs no locks in UCX, gives progress one
//! place, and lets completions be collected from UCX callbacks in one place. The cost is
//! one hand-off per operation (a queue push and, if the thread sleeps, an eventfd write)
//! and one back (a one-shot send).
//!
//! How it spends the CPU: while any operation is in flight the thread polls UCX without
//! sleeping (over tcp UCX moves bytes only when progressed), and for
//! [`UcxSettings::progress_spin`] after the last completion. Then it arms the worker and
//! sleeps in `poll` on the worker's event descriptor and the eventfd, so an idle engine
//! costs nothing. A peer's death wakes it too (the kernel resets the connection).
//!
//! Failure: every endpoint uses error mode PEER. When UCX reports a peer failed, or an
//! operation runs past [`UcxSettings::op_timeout`], the engine force-closes the endpoint,
//! which makes UCX complete every operation on it with an error; the peer's later
//! operations fail at once. An operation's outcome is sent only once UCX no longer
//! touches its memory, which is what makes lending raw memory to it sound.
//!
//! The queue is bounded ([`UcxSettings::queue_depth`], then
//! [`UcxTransportError::Saturated`]) and so is the work in UCX
//! ([`UcxSettings::max_in_flight`]).
//!
//! This is one of the few modules allowed to use `unsafe` (FFI into UCX, an eventfd);
//! each block says why it is sound.
#![allow(unsafe_code)]

mod buffers;
mod engine;
mod envelope;
mod error;
mod kind;
mod lanes;
mod loaded;
mod notes;
mod operation;
mod peer;
mod probe;
mod queue;
mod rkeys;
mod settings;
mod start;
mod thread;
mod ucp;
mod wake;
mod wire;

pub use buffers::{Exported, Lent, PACK_MAX, PACK_ROWS_BELOW, capabilities, moves_cuda, viability};
pub use engine::{Engine, Registration, UcxPeer};
pub use envelope::{EnvelopeError, EnvelopeKind};
pub use error::{OpKind, PeerFailure, PeerName, UcxTransportError};
pub use kind::UcxKind;
pub use lanes::{EndpointLanes, LanesUnknown, RmaPath};
pub use loaded::{LoadedUcx, loaded};
pub use operation::Operation;
pub use peer::{UcxOff, UcxTransport};
pub use rkeys::RemoteKey;
pub use settings::UcxSettings;
pub use start::{settings as engine_settings, start_engine};
/// Where memory lives, as UCX names it (host or CUDA device memory).
pub use ucx_sys::MemoryType;
pub use ucx_sys::TransportEntry;
/// A UCX release, where a library came from, and why it did not load.
pub use ucx_sys::{LibraryLocation, LibrarySource, LoadError, Version};
pub use wire::UcxSource;
