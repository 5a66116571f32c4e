//! The ucx transport's wire type: a buffer as a pull reads it or a push writes it, inside
//! an offer's or a grant's [`Descriptor`].

use ferry_config::TransportName;
use rkyv::{Archive, Deserialize, Serialize};

use crate::transport::{Descriptor, DescriptorError};

/// Where a ucx pull reads a buffer: its address in the sender's process and the packed
/// remote key of its registration (in the ucx transport's envelope).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct UcxSource {
    /// The buffer's address at the sender.
    pub address: u64,
    /// The registration's packed remote key.
    pub rkey: Vec<u8>,
    /// The sender gathered the offer's layout into one contiguous buffer (registered in
    /// its place): the receiver reads the packed bytes as one run, not a get per row.
    pub packed: bool,
}

impl UcxSource {
    /// The transport whose pulls read it (an offer of another carries none).
    pub const TRANSPORT: TransportName = TransportName::Ucx;

    /// The descriptor an offer or a grant carries it in.
    ///
    /// # Errors
    /// rkyv's (it does not fail for a source).
    pub fn describe(&self) -> Result<Descriptor, DescriptorError> {
        Descriptor::encode(self)
    }

    /// The source a peer's descriptor holds, validated (its key is checked again, in its
    /// envelope, before UCX sees it).
    ///
    /// # Errors
    /// Why the bytes are not a ucx source (the peer broke the protocol).
    pub fn read(descriptor: &Descriptor) -> Result<Self, DescriptorError> {
        descriptor.decode()
    }
}
