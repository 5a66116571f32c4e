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

/// A step of the lazy shm setup with a same-host peer, driven by the sending side (whose
/// pool the peer must map to pull from it): on the generic setup machine
/// ([`crate::transport::setup`]).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub enum ShmSetupStep {
    /// The sender asks the peer to map from its pool: the key of its probe (a small sealed
    /// memfd its fd-sharing socket hands out beside the pool's segments) and of its lane's
    /// ring (none when it offers no lane).
    Request {
        /// The probe's key.
        probe: String,
        /// The lane ring's key.
        lane: Option<String>,
    },
    /// The peer's answer: `None` when it fetched and mapped the probe (and took the lane),
    /// else why not.
    Reply(Option<String>),
    /// The sender's own checks passed (`None`) or failed (the reason).
    Ack(Option<String>),
    /// The peer confirms the ack: sends may use shm.
    Confirm,
}

/// The shm transport's control messages, between the parts of one session at both ends.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct ShmMessage {
    /// The setup attempt the step belongs to (1 for the first).
    pub attempt: u32,
    /// The step.
    pub step: ShmSetupStep,
}

impl ShmMessage {
    /// The message a peer's body holds, validated.
    ///
    /// # Errors
    /// Why the bytes are not an shm message (the peer broke the protocol).
    pub fn read(body: &[u8]) -> Result<Self, DescriptorError> {
        crate::transport::decode(body)
    }

    /// Its body.
    ///
    /// # Errors
    /// rkyv's (it does not fail for these messages).
    pub fn encode(&self) -> Result<Vec<u8>, DescriptorError> {
        crate::transport::encode(self)
    }
}

/// A send on the shm lane: its tag and where its bytes lie in the sender's pool.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ShmLaneRecord {
    /// The send's tag.
    pub tag: u64,
    /// Its bytes.
    pub source: ShmSource,
}

impl ShmLaneRecord {
    /// The record a slot holds, validated.
    ///
    /// # Errors
    /// Why the bytes are not a record (the peer broke the protocol).
    pub fn read(bytes: &[u8]) -> Result<Self, DescriptorError> {
        crate::transport::decode(bytes)
    }

    /// Its bytes in a slot.
    ///
    /// # Errors
    /// rkyv's (it does not fail for a record).
    pub fn encode(&self) -> Result<Vec<u8>, DescriptorError> {
        crate::transport::encode(self)
    }
}

/// The key of a pool's probe at its node's fd-sharing socket.
pub fn probe_key(pool: &[u8; 16]) -> String {
    format!("shm/{:032x}/probe", u128::from_le_bytes(*pool))
}
