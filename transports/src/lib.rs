//! ferry-transports: memory, the wire format, control links and the transports.
//!
//! This crate owns bytes and sockets: buffers and their leases ([`memory`]), the frame
//! format and messages ([`wire`]), authenticated control links ([`link`]), the CUDA layer
//! ([`cuda`]) and the transports that move payloads, each declared in [`transport`]:
//! [`tcp`] (host memory, anywhere), [`ipc`] (device memory between the processes of one
//! host, pulled by the copy engine) and [`staged`] (any memory through pinned host memory,
//! on one host or between hosts), [`ucx`] (host memory through UCX, pulled; RDMA where
//! the machine has it) and [`shm`] (host memory between the processes of one host, read in
//! place from a shared-memory pool). It makes no decisions about which transfer runs when; that is
//! `ferry-actors`' job.
//!
//! [`ucx`] holds the ucx transport's engine (one UCX worker on its own thread) and its
//! declaration.
//!
//! Only [`cuda`], [`ucx`], [`shm`]'s segments (`shm::segment`), and in [`link`] the
//! descriptor passing (`link::fdpass`) and the shared-memory ring (`link::ring`), may use
//! `unsafe` (each opts in with
//! `#[allow(unsafe_code)]`); everything else is denied it.
#![deny(unsafe_code)]
pub mod cuda;
pub mod fdshare;
pub mod gpus;
pub mod ipc;
pub mod link;
pub mod memory;
pub mod region;
pub mod registry;
pub mod shm;
pub mod staged;
pub mod tcp;
pub mod transport;
pub mod ucx;
pub mod wire;

/// The target of the trace events that time each step of a transfer's layout path (block
/// lists above all; a contiguous transfer's events say `blocks = 0`, to compare with):
/// `RUST_LOG=ferry::blocks=trace` shows them, elapsed times in microseconds. Each is one
/// `tracing::trace!`, which costs a level check and nothing else when disabled.
pub const TRACE_BLOCKS: &str = "ferry::blocks";

/// The blocks of `layout` (0 for any other layout), for the [`TRACE_BLOCKS`] events.
pub fn block_count(layout: &wire::Layout) -> usize {
    layout.block_list().map_or(0, <[_]>::len)
}
