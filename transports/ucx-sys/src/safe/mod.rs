//! Layer 3: owning types that release UCX objects in the right order.
//!
//! Ownership runs one way, so drop order is UCX's required order without the caller's
//! help: a [`Request`] holds its buffer, [`RemoteKey`] and [`Endpoint`]; a `RemoteKey`
//! holds its `Endpoint`; an `Endpoint` its [`Worker`]; a `Worker` and a [`MemoryHandle`]
//! their [`Context`]. So rkeys are destroyed before their endpoint, endpoints closed
//! before their worker is destroyed, and the context cleaned up last.
//!
//! Threads: [`Ucx`], [`Context`], [`MemoryHandle`] and [`MappedRegion`] are `Send + Sync`.
//! A [`Worker`] and everything made from it (endpoints, remote keys, requests) stay on the
//! thread that created the worker (UCX's single-thread worker mode; they hold `Rc`s).

mod context;
mod endpoint;
mod memory;
mod region;
mod request;
mod worker;

pub use context::{Context, ContextBuilder, ContextInfo, Features, Ucx};
pub use endpoint::{Endpoint, RemoteKey};
pub use memory::{MappedRegion, MemoryHandle, PackedRkey};
pub use region::{MemoryType, Region, RegionMut};
pub use request::{Refused, Request, Transferred};
pub use worker::{Worker, WorkerAddress};
