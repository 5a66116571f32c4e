//! The errors of ferry's actors and public API.
//!
//! [`Error`] is what every public call returns. A caller (or a binding in another language)
//! matches on [`Error::kind`], a small `Copy` enum that says who is at fault and whether a
//! retry can help; the variants carry the peer, the typed reason and, where the cause is
//! another error (the operating system, the configuration loader, the CUDA driver), that
//! error as the [`source`](std::error::Error::source).

use std::sync::Arc;

use ferry_config::ConfigError;
use ferry_transports::cuda::CudaError;
use ferry_transports::memory::MemoryKind;
use ferry_transports::wire::WireReason;

use crate::core::session::FailKind;

/// What kind of failure an [`Error`] is: stable, `Copy`, matchable. New kinds may be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The configuration is invalid.
    Config,
    /// The node could not start.
    Start,
    /// The peer is not known or could not be reached.
    PeerUnreachable,
    /// The link to the peer broke, or the peer died, before the operation ended.
    PeerLost,
    /// The peer refused the operation (see [`RefusalReason`]).
    Refused,
    /// The operation's deadline passed.
    DeadlineExceeded,
    /// The operation was cancelled.
    Cancelled,
    /// No transport can carry it.
    NoRoute,
    /// Backpressure: a bounded queue is full; retry later.
    QueueFull,
    /// Memory could not be granted (see [`NoMemoryCause`]).
    NoMemory,
    /// The API was used wrongly.
    Usage,
    /// Not available in this build or on this machine.
    Unsupported,
    /// The node is shutting down or has stopped.
    ShuttingDown,
    /// The transport failed to move the bytes.
    Transport,
}

impl ErrorKind {
    /// Every kind this build knows (a binding maps each to a class of its own).
    pub const ALL: [ErrorKind; 14] = [
        Self::Config,
        Self::Start,
        Self::PeerUnreachable,
        Self::PeerLost,
        Self::Refused,
        Self::DeadlineExceeded,
        Self::Cancelled,
        Self::NoRoute,
        Self::QueueFull,
        Self::NoMemory,
        Self::Usage,
        Self::Unsupported,
        Self::ShuttingDown,
        Self::Transport,
    ];

    /// A short, stable label (metrics, logs, bindings).
    pub fn label(self) -> &'static str {
        match self {
            Self::Config => "config",
            Self::Start => "start",
            Self::PeerUnreachable => "peer_unreachable",
            Self::PeerLost => "peer_lost",
            Self::Refused => "refused",
            Self::DeadlineExceeded => "deadline",
            Self::Cancelled => "cancelled",
            Self::NoRoute => "no_route",
            Self::QueueFull => "queue_full",
            Self::NoMemory => "no_memory",
            Self::Usage => "usage",
            Self::Unsupported => "unsupported",
            Self::ShuttingDown => "shutting_down",
            Self::Transport => "transport",
        }
    }

    /// Whether the same call may succeed if retried later unchanged (backpressure, a
    /// deadline that was too short, a peer that may come back).
    pub fn is_transient(self) -> bool {
        matches!(
            self,
            Self::QueueFull
                | Self::DeadlineExceeded
                | Self::PeerLost
                | Self::PeerUnreachable
                | Self::NoMemory
        )
    }
}

/// Why a peer refused or gave up a transfer, as it said on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RefusalReason {
    /// Its application cancelled it.
    Cancelled,
    /// Its deadline passed (at the peer: it could not reserve memory in time).
    DeadlineExceeded,
    /// It cannot hold it: larger than its whole budget.
    TooLarge,
    /// It does not serve the transport, direction or memory asked for.
    Unsupported,
    /// It is shutting down.
    ShuttingDown,
    /// The message broke the protocol.
    Protocol,
    /// It saw no progress for its stall timeout.
    Stalled,
    /// Nothing is published under the key asked for.
    UnknownKey,
    /// The key is published for other peers only.
    NotAllowed,
    /// The region key names no region registered there now: it was unregistered, or the
    /// key is of an earlier registration (never served).
    StaleKey,
    /// The region is registered read-only: a peer's write is refused.
    ReadOnly,
}

impl From<WireReason> for RefusalReason {
    fn from(reason: WireReason) -> Self {
        match reason {
            WireReason::Cancelled => Self::Cancelled,
            WireReason::DeadlineExceeded => Self::DeadlineExceeded,
            WireReason::TooLarge => Self::TooLarge,
            WireReason::Unsupported => Self::Unsupported,
            WireReason::ShuttingDown => Self::ShuttingDown,
            WireReason::Protocol => Self::Protocol,
            WireReason::Stalled => Self::Stalled,
            WireReason::StaleKey => Self::StaleKey,
            WireReason::ReadOnly => Self::ReadOnly,
        }
    }
}

impl std::fmt::Display for RefusalReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Cancelled => "cancelled",
            Self::DeadlineExceeded => "its deadline passed",
            Self::TooLarge => "too large",
            Self::Unsupported => "unsupported",
            Self::ShuttingDown => "shutting down",
            Self::Protocol => "protocol violation",
            Self::Stalled => "stalled",
            Self::UnknownKey => "unknown key",
            Self::NotAllowed => "not allowed",
            Self::StaleKey => "stale region key",
            Self::ReadOnly => "read-only region",
        })
    }
}

/// Why memory could not be granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NoMemoryCause {
    /// More than the domain's whole budget: it can never fit.
    LargerThanBudget,
    /// The deadline passed while waiting for budget.
    DeadlinePassed,
    /// The domain's wait queue is at its bound.
    QueueFull,
    /// The driver refused the allocation (the GPU is full, or fragmented).
    DriverRefused,
    /// No memory tier is configured for it.
    NoTier,
}

/// Everything that can go wrong in a node, by who is at fault. [`Error::kind`] is the
/// stable way to match.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is invalid.
    #[error("configuration: {detail}")]
    Config {
        /// What is wrong (the loader's whole message when it came from the loader).
        detail: String,
        /// The loader's error, when the configuration came from it (its words are all in
        /// `detail`, so it is not also the `source`: a printed chain says them once).
        loader: Option<Arc<ConfigError>>,
    },
    /// The node could not start (a listener could not bind, a thread could not start).
    /// The cause is the `source` only, as Rust's error chains expect: print the chain
    /// (`{:#}` with anyhow) to see it.
    #[error("cannot start node: {detail}")]
    Start {
        /// What failed.
        detail: String,
        /// The operating system's or driver's error, when there is one.
        #[source]
        source: Option<Arc<dyn std::error::Error + Send + Sync>>,
    },
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
    #[error("peer {peer} refused ({reason}): {detail}")]
    Refused {
        /// The peer.
        peer: String,
        /// The peer's reason.
        reason: RefusalReason,
        /// The peer's words.
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
        /// Why, typed.
        cause: NoMemoryCause,
        /// Why, in words.
        detail: String,
    },
    /// The API was used wrongly (an unknown region key, a put past a region's end...).
    #[error("invalid use: {0}")]
    Usage(String),
    /// This memory kind or feature is not available in this build or on this machine.
    #[error("unsupported: {detail}")]
    Unsupported {
        /// What is missing.
        detail: String,
        /// The driver's error, when a driver call said so.
        #[source]
        source: Option<CudaError>,
    },
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
    /// The kind of failure: the stable way to match an error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Config { .. } => ErrorKind::Config,
            Self::Start { .. } => ErrorKind::Start,
            Self::PeerUnreachable { .. } => ErrorKind::PeerUnreachable,
            Self::PeerLost { .. } => ErrorKind::PeerLost,
            Self::Refused { .. } => ErrorKind::Refused,
            Self::DeadlineExceeded => ErrorKind::DeadlineExceeded,
            Self::Cancelled => ErrorKind::Cancelled,
            Self::NoRoute(_) => ErrorKind::NoRoute,
            Self::QueueFull(_) => ErrorKind::QueueFull,
            Self::NoMemory { .. } => ErrorKind::NoMemory,
            Self::Usage(_) => ErrorKind::Usage,
            Self::Unsupported { .. } => ErrorKind::Unsupported,
            Self::ShuttingDown => ErrorKind::ShuttingDown,
            Self::Transport { .. } => ErrorKind::Transport,
        }
    }

    /// A short label for metrics (the kind's).
    pub fn label(&self) -> &'static str {
        self.kind().label()
    }

    /// Whether the same call may succeed if retried later unchanged: the kind's answer
    /// ([`ErrorKind::is_transient`]), except memory that can never fit (larger than the
    /// whole budget), which no retry helps.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::NoMemory {
                cause: NoMemoryCause::LargerThanBudget | NoMemoryCause::NoTier,
                ..
            } => false,
            other => other.kind().is_transient(),
        }
    }

    /// The peer the error is about, when it is about one.
    pub fn peer(&self) -> Option<&str> {
        match self {
            Self::PeerUnreachable { peer, .. }
            | Self::PeerLost { peer, .. }
            | Self::Refused { peer, .. }
            | Self::Transport { peer, .. } => Some(peer),
            _ => None,
        }
    }

    /// A configuration error in words (no loader error behind it).
    pub fn config(detail: impl Into<String>) -> Self {
        Self::Config {
            detail: detail.into(),
            loader: None,
        }
    }

    /// A start failure caused by `source`.
    pub fn start(
        detail: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Start {
            detail: detail.into(),
            source: Some(Arc::new(source)),
        }
    }

    /// Something missing from this build or machine, in words.
    pub fn unsupported(detail: impl Into<String>) -> Self {
        Self::Unsupported {
            detail: detail.into(),
            source: None,
        }
    }

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
                reason: reason.into(),
                detail,
            },
            FailKind::ShuttingDown => Self::ShuttingDown,
            FailKind::Transport(detail) => Self::Transport {
                peer: peer.to_string(),
                detail,
            },
            FailKind::Unsendable(detail) => Self::Usage(detail),
        }
    }

    /// The error for a send to peer `peer` over its fast path that failed with `failure`.
    pub fn from_fast_path(
        peer: &str,
        failure: ferry_transports::transport::FastPathFailure,
    ) -> Self {
        use ferry_transports::transport::FastPathFailure as F;
        match failure {
            F::Unsupported(why) => Self::unsupported(why),
            F::DeadlineExceeded => Self::DeadlineExceeded,
            F::PeerLost(detail) => Self::PeerLost {
                peer: peer.to_string(),
                detail,
            },
            F::Refused(detail) => Self::Transport {
                peer: peer.to_string(),
                detail: format!("the peer did not take it: {detail}"),
            },
            _ => Self::ShuttingDown,
        }
    }
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Self {
        Self::Config {
            detail: e.to_string(),
            loader: Some(Arc::new(e)),
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

impl SendError {
    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.error.kind()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn every_wire_reason_maps_to_a_refusal_reason_and_keeps_its_kind() {
        for (wire, reason) in [
            (WireReason::Cancelled, RefusalReason::Cancelled),
            (
                WireReason::DeadlineExceeded,
                RefusalReason::DeadlineExceeded,
            ),
            (WireReason::TooLarge, RefusalReason::TooLarge),
            (WireReason::Unsupported, RefusalReason::Unsupported),
            (WireReason::ShuttingDown, RefusalReason::ShuttingDown),
            (WireReason::Protocol, RefusalReason::Protocol),
            (WireReason::Stalled, RefusalReason::Stalled),
            (WireReason::StaleKey, RefusalReason::StaleKey),
            (WireReason::ReadOnly, RefusalReason::ReadOnly),
        ] {
            let e = Error::from_fail(
                "b",
                FailKind::Refused {
                    reason: wire,
                    detail: "why".into(),
                },
            );
            assert_eq!(e.kind(), ErrorKind::Refused);
            assert_eq!(e.peer(), Some("b"));
            assert!(matches!(e, Error::Refused { reason: r, .. } if r == reason));
        }
    }

    #[test]
    fn a_start_error_keeps_its_cause_as_source() {
        let io = std::io::Error::new(std::io::ErrorKind::AddrInUse, "in use");
        let e = Error::start("cannot listen on 127.0.0.1:1", io);
        assert_eq!(e.kind(), ErrorKind::Start);
        // Said once in a printed chain: the cause is the source, not in the message.
        assert_eq!(
            e.to_string(),
            "cannot start node: cannot listen on 127.0.0.1:1"
        );
        let source = e.source().expect("a source");
        assert_eq!(source.to_string(), "in use");
    }

    #[test]
    fn memory_that_can_never_fit_is_not_transient() {
        let no_memory = |cause| Error::NoMemory {
            kind: MemoryKind::Host,
            len: 1,
            cause,
            detail: String::new(),
        };
        assert!(!no_memory(NoMemoryCause::LargerThanBudget).is_transient());
        assert!(no_memory(NoMemoryCause::DeadlinePassed).is_transient());
        assert!(Error::QueueFull("q".into()).is_transient());
        assert!(!Error::Cancelled.is_transient());
    }

    #[test]
    fn labels_are_distinct() {
        use std::collections::HashSet;
        let kinds = ErrorKind::ALL;
        let labels: HashSet<_> = kinds.iter().map(|k| k.label()).collect();
        assert_eq!(labels.len(), kinds.len());
    }
}
