//! The staged transport's control message, carried as a
//! [`crate::wire::Message::Transport`].

use ferry_config::TransportName;
use rkyv::{Archive, Deserialize, Serialize};

use crate::transport::{DescriptorError, TransportMessage};

/// The staged transport's control messages, between the parts of one session at both ends.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub enum StagedMessage {
    /// The sender of staged transfers to a same-host peer made a ring of staging slots in
    /// shared memory for them: the receiver fetches it from the sender's fd-sharing socket
    /// under `key` (unguessable), maps it, and reads chunks from it. Until it has (or if it
    /// cannot), chunks come over the link.
    Ring {
        /// The ring's key at the sender's fd-sharing socket.
        key: String,
    },
}

impl StagedMessage {
    /// The transport whose message it is.
    pub const TRANSPORT: TransportName = TransportName::Staged;

    /// The link message that carries it.
    ///
    /// # Errors
    /// rkyv's (it does not fail for these messages).
    pub fn to_message(&self) -> Result<crate::wire::Message, DescriptorError> {
        Ok(crate::wire::Message::Transport(TransportMessage {
            transport: Self::TRANSPORT.into(),
            body: crate::transport::encode(self)?,
        }))
    }

    /// The message a peer's body holds, validated.
    ///
    /// # Errors
    /// Why the bytes are not a staged message (the peer broke the protocol).
    pub fn read(body: &[u8]) -> Result<Self, DescriptorError> {
        crate::transport::decode(body)
    }
}
