//! A path that carries some of a peer's sends without its session (a lane): the node
//! publishes it in its per-peer table when the transport made one, and a send the rules
//! route over that transport (by pull) tries it first. A peer may have one per transport
//! (device memory on one, host memory on another).

use std::time::Instant;

use ferry_config::MemoryClass;

use crate::memory::Buffer;

/// A transport's way around the session for small sends to one peer.
pub trait FastPath: Send + Sync + std::fmt::Debug {
    /// The memory its sends come from: the rules' routes for it say which sizes take it.
    fn memory(&self) -> MemoryClass;

    /// Whether `buffer` (sent whole) may take it now, by its memory and size; the node
    /// checks that the rules route such a send over the transport.
    fn fits(&self, buffer: &Buffer) -> bool;

    /// Sends `buffer` under `tag` now, or not at all: once this returns `Ok`, the send is
    /// the peer's to finish whether or not the returned future (its answer, which resolves
    /// once the peer's inbox holds it) is polled. `turn` (the send's place in the peer's
    /// order) is held until the peer finished with the buffer, so that no later send can
    /// pass it. Nothing waits here.
    ///
    /// # Errors
    /// [`FastPathFailure::Full`] with the buffer when the path has no room now (send it
    /// the other way); else why it cannot go. From the answer: why it did not arrive,
    /// with the buffer when it comes back (not after a deadline: the peer may still read
    /// it).
    #[allow(clippy::type_complexity)]
    fn send(
        &self,
        tag: u64,
        buffer: Buffer,
        deadline: Instant,
        turn: Box<dyn Send>,
    ) -> Result<futures::future::BoxFuture<'_, Result<Buffer, FastPathError>>, FastPathError>;

    /// The session with the peer ended: no more sends; those the peer has not finished
    /// fail.
    fn close(&self);
}

/// Why a send over a [`FastPath`] failed, with its buffer when it comes back.
#[derive(Debug)]
pub struct FastPathError {
    /// Why.
    pub failure: FastPathFailure,
    /// The buffer, unless the peer may still read it.
    pub buffer: Option<Buffer>,
}

/// Why a send over a [`FastPath`] failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FastPathFailure {
    /// The buffer cannot go this way (it cannot be exported, say).
    #[error("{0}")]
    Unsupported(String),
    /// The path has no room now (every slot of its ring is in use).
    #[error("the fast path is full")]
    Full,
    /// The deadline passed first.
    #[error("deadline exceeded")]
    DeadlineExceeded,
    /// The path closed: the peer is gone, or our session with it ended.
    #[error("{0}")]
    PeerLost(String),
    /// The peer could not take the buffer (no memory, a failed copy); its words.
    #[error("the peer did not take it: {0}")]
    Refused(String),
    /// This node stops.
    #[error("shutting down")]
    ShuttingDown,
}
