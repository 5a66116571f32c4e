//! The session's vocabulary: ids, outcomes, what the application asks, what the shell
//! must do, and why a request or a message is refused.

use std::time::Instant;

use ferry_config::TransportName;
use ferry_transports::wire::{Descriptor, Layout, WireDirection, WireMemoryKind, WireReason};

pub use ferry_transports::transport::OpId;

/// Transfer ids stay below this (2^39; a session numbers its ops from 1 and would need
/// centuries to get there): the shell keys quarantined memory by session, kind and id in
/// one word. A peer that offers a larger id breaks the protocol.
pub const MAX_TRANSFER_ID: u64 = 1 << 39;

/// Identifies an inbound transfer: the id the sending peer gave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InboundId(pub u64);

/// Why an operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailKind {
    /// The link to the peer broke, or the peer died.
    PeerLost(String),
    /// The deadline passed before the operation ended.
    DeadlineExceeded,
    /// The peer refused or abandoned it.
    Refused {
        /// The peer's reason.
        reason: WireReason,
        /// The peer's detail.
        detail: String,
    },
    /// This node is shutting down.
    ShuttingDown,
    /// The transport failed to move the bytes (the copy into the peer's memory).
    Transport(String),
    /// The op cannot be offered to this peer as it is (a block list whose offer is larger
    /// than the frames the peer takes): the caller's to change; the peer never saw it.
    Unsendable(String),
}

impl std::fmt::Display for FailKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::PeerLost(why) => write!(f, "peer lost: {why}"),
            Self::DeadlineExceeded => f.write_str("deadline exceeded"),
            Self::Refused { reason, detail } => write!(f, "refused by peer ({reason:?}): {detail}"),
            Self::ShuttingDown => f.write_str("node shutting down"),
            Self::Transport(why) => write!(f, "the transport failed: {why}"),
            Self::Unsendable(why) => write!(f, "cannot be offered: {why}"),
        }
    }
}

/// The one terminal state every operation ends in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every byte arrived and the peer confirmed it.
    Completed,
    /// It failed, for this reason.
    Failed(FailKind),
    /// The caller cancelled it.
    Cancelled,
}

/// A transfer the application asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendRequest {
    /// Application tag.
    pub tag: u64,
    /// Bytes to move.
    pub len: u64,
    /// Where they are.
    pub source: WireMemoryKind,
    /// Transport chosen by the route.
    pub transport: TransportName,
    /// Direction chosen by the route.
    pub direction: WireDirection,
    /// For a pull: where the peer reads the bytes, as `transport` describes them.
    pub pull: Option<Descriptor>,
    /// How the bytes lie in the buffer (`len` is their packed length).
    pub layout: Layout,
    /// When it must have ended.
    pub deadline: Instant,
    /// For the answer to a peer's fetch: its id (the offer says it).
    pub fetch: Option<u64>,
    /// For a one-sided write: the peer's region and places the bytes go into (the offer
    /// says it; never eager).
    pub into: Option<ferry_transports::wire::RegionWrite>,
}

pub use ferry_transports::transport::EagerTerms;

/// A one-sided put the application asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutRequest {
    /// Bytes to write.
    pub len: u64,
    /// When it must have ended.
    pub deadline: Instant,
}

/// Where a pulled transfer's bytes are read from: the offer's descriptor, which only the
/// transport that reads it looks inside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullSource {
    /// The transport that reads it.
    pub transport: TransportName,
    /// Its descriptor of the peer's buffer.
    pub descriptor: Descriptor,
}

/// The buffer a receiver lends for a push: the grant's descriptor, which only the
/// transport that writes it looks inside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushTarget {
    /// The transport that writes it.
    pub transport: TransportName,
    /// Its descriptor of the peer's buffer.
    pub descriptor: Descriptor,
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEvent {
    /// Stream the op's bytes now (a granted transfer, or a put).
    Stream(OpId),
    /// Write the op's bytes into the peer's buffer lent in its grant (a push over a
    /// transport that writes the peer's memory),
    /// then tell the peer [`Message::Written`](ferry_transports::wire::Message::Written) and report
    /// [`PeerSession::handle_stream_ended`](super::PeerSession::handle_stream_ended) (or [`PeerSession::handle_write_failed`](super::PeerSession::handle_write_failed)).
    Write(OpId, PushTarget),
    /// Stop the op's running stream at the next chunk; `StreamEnded` still follows.
    StopStream(OpId),
    /// The op ended; its buffer can go back to its owner.
    Finished(OpId, Outcome),
    /// The peer offers a transfer: reserve `len` bytes for it.
    Reserve {
        /// The inbound transfer.
        id: InboundId,
        /// Bytes to reserve.
        len: u64,
        /// For a pulled transfer: where to read the bytes once reserved
        /// ([`PeerSession::handle_reserved_pull`](super::PeerSession::handle_reserved_pull)).
        pull: Option<PullSource>,
        /// A push that borrows the receiver's memory: the transport that writes it (ipc,
        /// ucx). Reserve it (device memory where possible) and lend it in the grant.
        push: Option<TransportName>,
        /// A push whose chunks come through host memory beside the link (a ring the two
        /// processes share, or the link itself) and are copied in: reserve device memory
        /// where possible.
        relayed: bool,
        /// How the bytes lie at the sender (`len` is their packed length; a pull gathers
        /// them by it).
        layout: Layout,
    },
    /// The peer no longer writes the buffer the grant of inbound `id` lent it (an ipc
    /// push): `error` is `None` when every byte is in place. The shell frees the buffer or
    /// completes the transfer ([`PeerSession::handle_inbound_complete`](super::PeerSession::handle_inbound_complete)); it may have been
    /// abandoned meanwhile, or never lent anything.
    Written {
        /// The inbound transfer.
        id: InboundId,
        /// Why the bytes are not there.
        error: Option<String>,
    },
    /// An inbound transfer is complete and it is its turn: hand it to the application.
    Deliver {
        /// The inbound transfer.
        id: InboundId,
        /// Its tag.
        tag: u64,
        /// The transport it came over, as the offer named it.
        transport: TransportName,
        /// How the bytes lay at the sender (they arrive packed).
        layout: Layout,
        /// For the answer to one of our fetches: its id (the bytes go to it, not to
        /// `recv`).
        fetch: Option<u64>,
    },
    /// An inbound transfer was abandoned: free whatever was reserved for it.
    Abandon(InboundId),
}

/// Why a request was not queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The per-peer queue is at its configured bound.
    #[error("the queue to this peer is full ({0} operations)")]
    QueueFull(usize),
    /// The link is gone.
    #[error("peer lost: {0}")]
    PeerLost(String),
    /// The node is draining.
    #[error("node shutting down")]
    ShuttingDown,
}

/// A message that breaks the protocol: the peer misbehaved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("protocol violation: {0}")]
pub struct ProtocolViolation(pub String);
