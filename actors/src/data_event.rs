//! What the link's tasks (its reader and writer) report to their peer's actor: one message
//! type, so that they depend on it and not on the actor. (A transport's own threads report
//! to its part of the session, which wakes the actor.)

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
}
