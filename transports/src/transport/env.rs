//! What a transport's part of a peer's session may use of the node, as small traits the
//! node (the actors crate) implements: memory for what the peer sends, in the node's
//! receive tiers ([`ReceiveMemory`]), and the application's inbox, in the peer's order
//! ([`Deliveries`]). A transport never reaches the node's allocators or inbox otherwise.

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use crate::cuda::Stream;
use crate::memory::{Buffer, Fill};

/// Memory for what a peer sends, from the node's receive tiers: where receives land first
/// (device memory where the node receives into a GPU), then where they spill.
pub trait ReceiveMemory: Send + Sync {
    /// `len` bytes in the first tier that grants them now, on the caller's thread with no
    /// message to any actor (device memory allocated in order on `on` when given); `None`
    /// when no tier can now. Blocking for device memory: never on an actor's thread.
    fn now(&self, len: u64, on: Option<&Stream>, fill: Fill) -> Option<Buffer>;

    /// `len` bytes once a tier can grant them, waiting at most until `deadline` (as any
    /// receive would); zeroed host memory when it had to wait.
    ///
    /// # Errors
    /// Why no tier granted them (its words: the deadline passed, larger than every tier,
    /// the node stops).
    fn wait(
        &self,
        len: u64,
        deadline: Instant,
    ) -> futures::future::BoxFuture<'static, Result<Buffer, String>>;

    /// The ordinal of the GPU whose memory receives land in first, if they land in device
    /// memory at all.
    fn device(&self) -> Option<u32>;
}

/// The application's inbox, as one path from one peer delivers into it: in the peer's
/// order across all the paths that carry its transfers.
pub trait Deliveries: Send + Sync {
    /// Hands `buffer`, sent under `tag` over `transport` (what the receive reports), to the
    /// application: once every transfer from the peer that completed before it on another
    /// path is delivered (waits, asleep, until then; `None` when `stop` is set first). A
    /// receive it was handed to is woken when the returned value drops, so the caller can
    /// tell the sender first.
    fn deliver_in_order(
        &self,
        transport: ferry_config::TransportName,
        tag: u64,
        buffer: Buffer,
        stop: &AtomicBool,
    ) -> Option<Box<dyn Send>>;

    /// Bytes this path delivered that the application has not taken yet.
    fn held(&self) -> u64;
}
