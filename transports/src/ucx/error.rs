//! The UCX engine's error type, and the names it gives operations and peers.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ucx_sys::{LoadError, UcxError};

use super::envelope::EnvelopeError;

/// An operation, as errors name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpKind {
    /// A get (a read of the peer's memory) of this many bytes.
    Get(usize),
    /// A put (a write into the peer's memory) of this many bytes.
    Put(usize),
    /// A flush of the endpoint.
    Flush,
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpKind::Get(len) => write!(f, "get of {len} B"),
            OpKind::Put(len) => write!(f, "put of {len} B"),
            OpKind::Flush => f.write_str("flush"),
        }
    }
}

/// A connected peer, as errors name it: the engine's number for the endpoint and the name
/// the peer's engine gave itself in its address (`host pid N` by default). Cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerName {
    /// The engine's number for the endpoint, unique within the engine.
    pub id: u64,
    /// The name carried in the peer's address ([`super::UcxSettings::name`] there).
    pub origin: Arc<str>,
}

impl fmt::Display for PeerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ucx peer #{} ({})", self.id, self.origin)
    }
}

/// Why a peer is considered gone. Once a peer failed, its endpoint is force-closed and
/// every operation to it fails with this cause.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PeerFailure {
    /// UCX reported the endpoint failed (error mode PEER): the peer process died, closed its
    /// endpoint, or its host became unreachable. Keeps UCX's status.
    #[error(transparent)]
    Ucx(UcxError),
    /// An operation to the peer did not complete within
    /// [`super::UcxSettings::op_timeout`]; the engine force-closed the endpoint.
    #[error("{op} did not complete within {after:?}; the endpoint was closed")]
    TimedOut {
        /// The operation that ran past its deadline.
        op: OpKind,
        /// The deadline it ran past.
        after: Duration,
    },
}

/// What went wrong in the UCX engine.
///
/// `Clone` (UCX's own [`UcxError`] is), so one endpoint failure can fail many pending
/// operations. Variants separate the caller's misuse ([`UcxTransportError::Misuse`],
/// [`UcxTransportError::Saturated`]), a peer that sent unusable bytes
/// ([`UcxTransportError::InvalidAddress`], [`UcxTransportError::InvalidRkey`]), a peer
/// that failed ([`UcxTransportError::PeerFailed`], [`UcxTransportError::TimedOut`]), UCX
/// failing locally, and the engine being gone.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum UcxTransportError {
    /// The UCX library could not be loaded (missing, not a libucp, older than 1.13).
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Creating UCX's context or worker failed, or a setting was refused.
    #[error("UCX setup failed ({what}): {source}")]
    Setup {
        /// The step that failed.
        what: &'static str,
        /// UCX's error.
        source: UcxError,
    },
    /// The progress thread or its wake-up descriptor could not be created.
    #[error("could not start the UCX progress thread: {0}")]
    Thread(Arc<std::io::Error>),
    /// The progress thread could not make a GPU's context current
    /// ([`super::UcxSettings::cuda_device`]).
    #[error("the UCX progress thread could not bind the GPU's context: {0}")]
    Cuda(#[source] crate::cuda::CudaError),
    /// Bytes given to [`super::Engine::connect`] are not a worker address made by a ferry
    /// engine running the same UCX release.
    #[error("unusable UCX worker address: {0}")]
    InvalidAddress(#[source] EnvelopeError),
    /// Bytes given to [`super::RemoteKey::new`] are not a remote key packed by a ferry
    /// engine running the same UCX release.
    #[error("unusable UCX remote key: {0}")]
    InvalidRkey(#[source] EnvelopeError),
    /// `ucp_ep_create` refused the peer's address.
    #[error("connecting to {origin} failed: {source}")]
    Connect {
        /// The name in the peer's address.
        origin: Arc<str>,
        /// UCX's error (`UCS_ERR_UNREACHABLE` when no allowed transport reaches the peer:
        /// with error mode PEER, UCX needs `tcp` or an RDMA transport in `UCX_TLS`).
        source: UcxError,
    },
    /// `ucp_mem_map` or `ucp_rkey_pack` failed.
    #[error("registering {len} B at {address:#x} failed: {source}")]
    Register {
        /// Start of the memory.
        address: u64,
        /// Its length.
        len: usize,
        /// UCX's error.
        source: UcxError,
    },
    /// The peer's remote key did not unpack on the endpoint (typically a key packed by a
    /// different UCX build).
    #[error("{op} to {peer}: the remote key does not unpack: {source}")]
    Unpack {
        /// The operation that needed the key.
        op: OpKind,
        /// The peer.
        peer: PeerName,
        /// UCX's error.
        source: UcxError,
    },
    /// UCX failed the operation for a reason other than the peer failing.
    #[error("{op} with {peer} failed: {source}")]
    Operation {
        /// The operation.
        op: OpKind,
        /// The peer.
        peer: PeerName,
        /// UCX's error.
        source: UcxError,
    },
    /// The peer failed (now or before the operation was issued); its endpoint is closed.
    /// Connect again once the peer is back.
    #[error("{op} with {peer} failed: the peer failed: {cause}")]
    PeerFailed {
        /// The operation.
        op: OpKind,
        /// The peer.
        peer: PeerName,
        /// Why the peer is considered gone.
        cause: PeerFailure,
    },
    /// The operation ran past [`super::UcxSettings::op_timeout`]. The engine force-closed
    /// the endpoint, which fails every other operation to the peer too.
    #[error("{op} with {peer} did not complete within {after:?}; the endpoint was closed")]
    TimedOut {
        /// The operation.
        op: OpKind,
        /// The peer.
        peer: PeerName,
        /// The deadline.
        after: Duration,
    },
    /// The caller used the API wrongly (a null pointer with a length, a peer of another
    /// engine); nothing was started.
    #[error("invalid use of the UCX engine: {0}")]
    Misuse(&'static str),
    /// [`super::UcxSettings::queue_depth`] operations are already waiting for the progress
    /// thread; nothing was started. Retry after some complete.
    #[error("the UCX engine's queue is full ({capacity} operations waiting)")]
    Saturated {
        /// The queue's capacity.
        capacity: usize,
    },
    /// The engine was dropped (or its thread ended) before the operation completed. When
    /// an operation gets this error, UCX no longer touches its memory.
    #[error("the UCX engine stopped{}", match .op { Some(op) => format!(" before the {op} completed"), None => String::new() })]
    EngineStopped {
        /// The operation that was pending, if any.
        op: Option<OpKind>,
    },
}

impl UcxTransportError {
    /// Whether the error says the peer is gone or unresponsive (its endpoint is then
    /// closed; reconnect to continue).
    pub fn is_peer_failure(&self) -> bool {
        match self {
            UcxTransportError::PeerFailed { .. } | UcxTransportError::TimedOut { .. } => true,
            UcxTransportError::Operation { source, .. } => source.is_peer_failure(),
            _ => false,
        }
    }

    /// UCX's status code, where UCX returned one.
    pub fn ucx_status(&self) -> Option<&ucx_sys::Status> {
        match self {
            UcxTransportError::Setup { source, .. }
            | UcxTransportError::Connect { source, .. }
            | UcxTransportError::Register { source, .. }
            | UcxTransportError::Unpack { source, .. }
            | UcxTransportError::Operation { source, .. }
            | UcxTransportError::PeerFailed {
                cause: PeerFailure::Ucx(source),
                ..
            } => source.status(),
            _ => None,
        }
    }
}
