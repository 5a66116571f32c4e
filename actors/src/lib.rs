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
pub mod node;
pub mod order;
pub mod peer;
pub mod publish;
pub mod timer;

pub use error::{Error, ErrorKind, NoMemoryCause, RefusalReason, SendError};

pub use ferry_transports::TRACE_BLOCKS;
pub(crate) use ferry_transports::block_count;
