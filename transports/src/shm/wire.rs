//! The shm transport's wire types: what its hello says ([`ShmTerms`]: the pool a peer maps)
//! and a buffer as a pull reads it or a push writes it ([`ShmSource`], inside an offer's or
//! a grant's [`Descriptor`]). Both are validated before use: the peer wrote them.

use ferry_config::TransportName;
use rkyv::{Archive, Deserialize, Serialize};

use crate::transport::{Descriptor, DescriptorError};

/// What a node announces of shm: its pool, whose segments a same-host peer fetches from
/// its fd-sharing socket under keys made of the pool's id ([`segment_key`]).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ShmTerms {
    /// The pool's id: 128 random bits, new with each node.
    pub pool: [u8; 16],
}

impl ShmTerms {
    /// The terms a peer's announcement holds.
    ///
    /// # Errors
    /// Why the bytes are not shm's terms.
    pub fn read(announced: &[u8]) -> Result<Self, DescriptorError> {
        crate::transport::decode(announced)
    }
}

/// A range of a same-host peer's pool: where a pull reads the sender's buffer, or a push
/// writes the receiver's lent one. `len` 0 names no memory at all (an empty buffer).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ShmSource {
    /// The pool (as the owner's hello announced it).
    pub pool: [u8; 16],
    /// The segment's number in the pool.
    pub segment: u32,
    /// The segment's length in bytes (its memfd is sealed at it).
    pub segment_len: u64,
    /// Where the buffer starts in the segment.
    pub offset: u64,
    /// The buffer's length.
    pub len: u64,
}

impl ShmSource {
    /// The transport whose pulls read it.
    pub const TRANSPORT: TransportName = TransportName::Shm;

    /// The descriptor an offer or a grant carries it in.
    ///
    /// # Errors
    /// rkyv's (it does not fail for a source).
    pub fn describe(&self) -> Result<Descriptor, DescriptorError> {
        Descriptor::encode(self)
    }

    /// The source a peer's descriptor holds, validated.
    ///
    /// # Errors
    /// Why the bytes are not an shm source (the peer broke the protocol).
    pub fn read(descriptor: &Descriptor) -> Result<Self, DescriptorError> {
        descriptor.decode()
    }
}

/// The key a pool's segment is served under at its node's fd-sharing socket.
pub fn segment_key(pool: &[u8; 16], segment: u32) -> String {
    format!("shm/{:032x}/{segment}", u128::from_le_bytes(*pool))
}
