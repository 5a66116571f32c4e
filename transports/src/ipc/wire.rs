//! The ipc transport's wire types: a buffer as a pull reads it or a push writes it
//! ([`IpcSource`], inside an offer's or a grant's [`Descriptor`]), a lane record, and its
//! control messages ([`IpcMessage`], carried as a [`crate::wire::Message::Transport`]).

use ferry_config::TransportName;
use rkyv::{Archive, Deserialize, Serialize};

use crate::transport::{Descriptor, DescriptorError, TransportMessage};

/// A buffer of a same-host peer's device memory, as an ipc pull reads it. Pool memory: the
/// pool is named by its device's UUID (imported once per peer and device through the
/// peer's fd-sharing socket), the buffer by its 64-byte pointer export plus its lease. Registered
/// memory (`legacy` set): the allocation's 64-byte legacy IPC handle and its buffer id.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct IpcSource {
    /// UUID of the GPU the buffer lives on (`GPU-...`).
    pub device_uuid: String,
    /// The sender's pool the buffer came from ([`crate::cuda::pool_name`]); empty for
    /// registered memory and for buffers nothing is exported of.
    pub pool: String,
    /// The buffer's id at the sender.
    pub buffer: u64,
    /// The lease's generation at the sender.
    pub generation: u64,
    /// Where the bytes start within the allocation.
    pub offset: u64,
    /// `cuMemPoolExportPointer`'s 64 bytes, or `cuIpcGetMemHandle`'s when `legacy` is set.
    pub export: Vec<u8>,
    /// For memory the sender registered (not from its pool): the allocation's
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`, which keys the receiver's handle cache.
    pub legacy: Option<u64>,
}

impl IpcSource {
    /// The transport whose pulls read it (an offer of another carries none).
    pub const TRANSPORT: TransportName = TransportName::Ipc;

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
    /// Why the bytes are not an ipc source (the peer broke the protocol).
    pub fn read(descriptor: &Descriptor) -> Result<Self, DescriptorError> {
        descriptor.decode()
    }
}

/// One small transfer on the same-host fast lane: what a slot of the lane's shared-memory
/// ring holds (an rkyv archive, validated like a frame before it is read).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct LaneRecord {
    /// The transfer's tag.
    pub tag: u64,
    /// Bytes to copy.
    pub len: u64,
    /// Where to pull them from.
    pub source: IpcSource,
}

impl LaneRecord {
    /// The record's bytes, for a ring slot.
    ///
    /// # Errors
    /// rkyv's, as text (it does not fail for a record of this shape).
    pub fn encode(&self) -> Result<Vec<u8>, rkyv::rancor::Error> {
        rkyv::to_bytes::<rkyv::rancor::Error>(self).map(|b| b.to_vec())
    }

    /// A record from a slot's bytes, validated first (the other process wrote them).
    ///
    /// # Errors
    /// Why the bytes are not a record.
    pub fn decode(bytes: &[u8]) -> Result<LaneRecord, rkyv::rancor::Error> {
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
        aligned.extend_from_slice(bytes);
        rkyv::from_bytes::<LaneRecord, rkyv::rancor::Error>(&aligned)
    }
}

/// Names a buffer a peer pulled over ipc and may keep mapped: its device and lease.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug))]
pub struct IpcBufferRef {
    /// UUID of the GPU the buffer lives on.
    pub device_uuid: String,
    /// The buffer's id at its owner.
    pub buffer: u64,
    /// The lease's generation at its owner.
    pub generation: u64,
}

/// A step of the lazy ipc setup between two same-host peers, driven by the sending side
/// (the exporter); see `ferry_actors::core::ipc_setup`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct IpcSetupMessage {
    /// The attempt this step belongs to (1 for the first).
    pub attempt: u32,
    /// The step.
    pub step: IpcSetupStep,
}

/// The steps of the ipc setup.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub enum IpcSetupStep {
    /// The exporter asks the peer to import its pools: their names (one per GPU, see
    /// [`crate::cuda::pool_name`]), and the key
    /// under which its fd-sharing socket hands out the shared-memory ring of the fast lane (none
    /// when it offers no lane).
    Request(Vec<String>, Option<String>),
    /// The importer's answer: `None` when every pool was imported, else why not.
    Reply(Option<String>),
    /// The exporter's own checks passed (`None`) or failed (the reason).
    Ack(Option<String>),
    /// The importer confirms the ack: transfers may use ipc.
    Confirm,
}

/// The ipc transport's control messages, between the parts of one session at both ends.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub enum IpcMessage {
    /// A step of the lazy ipc setup.
    Setup(IpcSetupMessage),
    /// The buffer's owner is freeing it: unmap it, then answer `Unmapped`.
    Unmap(IpcBufferRef),
    /// The buffer is no longer mapped here (asked for, or evicted on our own).
    Unmapped(IpcBufferRef),
    /// The sender retired its pool of this name (it backs no buffer any more and was
    /// replaced: see [`crate::cuda::ExportablePool::renewed`]): close its import, so that
    /// its memory goes back to the GPU.
    PoolRetired(String),
}

impl IpcMessage {
    /// The link message that carries it.
    ///
    /// # Errors
    /// rkyv's (it does not fail for these messages).
    pub fn to_message(&self) -> Result<crate::wire::Message, DescriptorError> {
        Ok(crate::wire::Message::Transport(TransportMessage {
            transport: IpcSource::TRANSPORT.into(),
            body: crate::transport::encode(self)?,
        }))
    }

    /// The message a peer's body holds, validated.
    ///
    /// # Errors
    /// Why the bytes are not an ipc message (the peer broke the protocol).
    pub fn read(body: &[u8]) -> Result<Self, DescriptorError> {
        crate::transport::decode(body)
    }
}
