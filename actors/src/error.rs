//! The errors of ferry's actors and public API.

use ferry_transports::memory::MemoryKind;

use crate::core::session::FailKind;

/// Everything that can go wrong in a node, by who is at fault.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// The node could not start (a listener could not bind, a secret could not be read).
    #[error("cannot start node: {0}")]
    Start(String),
    /// The peer is not known and could not be reached.
    #[error("peer {peer}: {detail}")]
    PeerUnreachable {
        /// The peer.
        peer: String,
        /// Why.
        detail: String,
    },
    /// The link to the peer broke, or the peer died, before the operation ended.
    #[error("peer {peer} lost: {detail}")]
    PeerLost {
        /// The peer.
        peer: String,
        /// Why.
        detail: String,
    },
    /// The peer refused the operation.
    #[error("peer {peer} refused: {detail}")]
    Refused {
        /// The peer.
        peer: String,
        /// The peer's reason.
        detail: String,
    },
    /// The operation's deadline passed.
    #[error("deadline exceeded")]
    DeadlineExceeded,
    /// The operation was cancelled.
    #[error("cancelled")]
    Cancelled,
    /// No route: no rule matches, or no transport of the matching rule can carry it.
    #[error("no route: {0}")]
    NoRoute(String),
    /// The per-peer queue is full (backpressure: try again later).
    #[error("queue full: {0}")]
    QueueFull(String),
    /// Memory could not be granted.
    #[error("no {kind} memory for {len} bytes: {detail}")]
    NoMemory {
        /// The domain.
        kind: MemoryKind,
        /// Bytes asked for.
        len: u64,
        /// Why.
        detail: String,
    },
    /// The API was used wrongly (an unknown region key, a put past a region's end...).
    #[error("invalid use: {0}")]
    Usage(String),
    /// This memory kind or feature is not available in this build or on this machine.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The node is shutting down or has stopped.
    #[error("node shutting down")]
    ShuttingDown,
    /// The transport could not move the bytes (a copy into the peer's memory failed).
    #[error("transfer to peer {peer} failed: {detail}")]
    Transport {
        /// The peer.
        peer: String,
        /// What failed.
        detail: String,
    },
}

impl Error {
    /// The error for an operation with peer `peer` that ended with `kind`.
    pub fn from_fail(peer: &str, kind: FailKind) -> Self {
        match kind {
            FailKind::PeerLost(detail) => Self::PeerLost {
                peer: peer.to_string(),
                detail,
            },
            FailKind::DeadlineExceeded => Self::DeadlineExceeded,
            FailKind::Refused { reason, detail } => Self::Refused {
                peer: peer.to_string(),
                detail: format!("{reason:?}: {detail}"),
            },
            FailKind::ShuttingDown => Self::ShuttingDown,
            FailKind::Transport(detail) => Self::Transport {
                peer: peer.to_string(),
                detail,
            },
        }
    }

    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Config(_) => "config",
            Self::Start(_) => "start",
            Self::PeerUnreachable { .. } => "peer_unreachable",
            Self::PeerLost { .. } => "peer_lost",
            Self::Refused { .. } => "refused",
            Self::DeadlineExceeded => "deadline",
            Self::Cancelled => "cancelled",
            Self::NoRoute(_) => "no_route",
            Self::QueueFull(_) => "queue_full",
            Self::NoMemory { .. } => "no_memory",
            Self::Usage(_) => "usage",
            Self::Unsupported(_) => "unsupported",
            Self::ShuttingDown => "shutting_down",
            Self::Transport { .. } => "transport",
        }
    }
}

/// A failed send: the error, and the buffer back when the failure left it untouched.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct SendError {
    /// What went wrong.
    pub error: Error,
    /// The buffer, given back to the caller. `None` only if the node stopped while holding
    /// it (it was freed).
    pub buffer: Option<ferry_transports::memory::Buffer>,
}
