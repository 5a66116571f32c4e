//! What the data plane's threads and tasks (a link's reader and writer, the staged
//! transport's ring threads, later a UCX progress thread) report to their peer's actor: one
//! message type, so that they depend on it and not on the actor.

use actix::Message;
use ferry_transports::memory::Buffer;

use crate::core::session::OpId;

/// One event of a peer's data plane, for the peer's actor.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub enum DataEvent {
    /// Every byte of inbound transfer `id` is in `buffer`.
    InboundDone {
        /// The inbound transfer (the sender's transfer id).
        id: u64,
        /// Its filled receive buffer.
        buffer: Buffer,
    },
    /// A chunk of inbound transfer `id` could not be placed (a copy failed): that transfer
    /// fails, the link goes on.
    InboundFailed {
        /// The inbound transfer.
        id: u64,
        /// Why.
        why: String,
    },
    /// Outbound op `op`'s stream ended: every byte is on its way, or it stopped. Its view
    /// of the buffer is dropped. `broken` says why the channel that carried it failed,
    /// when it did, which takes the link (`link`) down.
    StreamEnded {
        /// The op.
        op: OpId,
        /// Why the channel broke, if it did.
        broken: Option<String>,
        /// The link the channel was made for.
        link: u64,
    },
    /// The peer broke the channel made for `link` (a bad ring record): the link goes down,
    /// counted as a protocol violation.
    PeerBroke {
        /// The link the channel was made for.
        link: u64,
        /// What the peer did.
        why: String,
    },
}
