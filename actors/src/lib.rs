//! ferry-actors: the coordinator, the allocator of each memory domain and one transfer actor
//! per peer, as thin actix shells over the sans-IO [`core`].
//!
//! [`node::Node`] starts them on their own thread and is what the public API wraps.
#![forbid(unsafe_code)]
pub mod allocator;
pub mod coordinator;
pub mod core;
pub mod data_event;
pub mod direct;
pub mod error;
pub mod fetch;
pub mod gpu;
pub mod inbox;
pub mod lane;
pub mod node;
pub mod peer;
pub mod publish;
pub mod staged;
pub mod timer;

pub use error::{Error, ErrorKind, NoMemoryCause, RefusalReason, SendError};

/// The target of the trace events that time each step of a transfer's layout path (block
/// lists above all; a contiguous transfer's events say `blocks = 0`, to compare with):
/// `RUST_LOG=ferry::blocks=trace` shows them, elapsed times in microseconds. Each is one
/// `tracing::trace!`, which costs a level check and nothing else when disabled.
pub const TRACE_BLOCKS: &str = "ferry::blocks";

/// The blocks of `layout` (0 for any other layout), for the [`TRACE_BLOCKS`] events.
pub(crate) fn block_count(layout: &ferry_transports::wire::Layout) -> usize {
    layout.block_list().map_or(0, <[_]>::len)
}
