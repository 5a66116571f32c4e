//! The control and data messages that cross a link, as rkyv archives.
//!
//! Every message is one variant of [`Message`]. The frame header carries the variant's
//! [`FrameKind`] too, and decoding checks that both agree, so a frame whose header was
//! tampered with cannot be read as another kind of message.
//!
//! Bulk bytes are not messages: a [`Message::Data`] or [`Message::Put`] frame only describes
//! a chunk, and the chunk's bytes follow it as one raw [`FrameKind::Payload`] frame, so
//! neither side copies them through an archive.

use ferry_config::TransportName;
use rkyv::{Archive, Deserialize, Serialize};

pub use crate::transport::{Announce, Descriptor, TransportMessage};

/// The wire protocol version this build speaks. A peer with another version is refused
/// with an error naming both.
/// 10: lane records of any size (a receiver of version 9 refused those over 64 KiB).
/// 11: a grant may lend a UCX registration for a ucx push.
/// 12: a ucx source may be the sender's packed copy of its layout.
/// 13: eager tcp transfers: a hello grants eager credit and an [`Offer::eager`] carries
/// its bytes.
/// 14: what concerns one transport is opaque: offers and grants carry a [`Descriptor`],
/// a hello [`Announce`]s each transport served, and a transport's control messages travel
/// as [`Message::Transport`].
/// 15: ipc names GPU pools `<uuid>#<generation>` (a descriptor names its buffer's pool), and
/// a node tells its peers of a pool it retired.
/// 16: an offer may write into a registered region of the receiver ([`Offer::into`]).
pub const PROTOCOL_VERSION: u16 = 16;

/// Where a buffer lives, as said on the wire.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub enum WireMemoryKind {
    /// Pageable host memory.
    Host,
    /// Page-locked host memory.
    PinnedHost,
    /// Memory of the GPU with this ordinal on the sending node.
    Device(u32),
}

/// Who moves the bytes once the receiver has memory for them.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub enum WireDirection {
    /// The receiver grants a region and the sender writes into it.
    Push,
    /// The sender exposes its buffer and the receiver reads it.
    Pull,
}

/// A transport, by name, as it travels on the wire (a closed set: a peer that sends another
/// value breaks the protocol; both ends must speak the same [`PROTOCOL_VERSION`]).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub enum WireTransport {
    /// `tcp`.
    Tcp,
    /// `ipc`.
    Ipc,
    /// `staged`.
    Staged,
    /// `ucx`.
    Ucx,
    /// `shm`.
    Shm,
}

impl From<TransportName> for WireTransport {
    fn from(name: TransportName) -> Self {
        match name {
            TransportName::Tcp => Self::Tcp,
            TransportName::Ipc => Self::Ipc,
            TransportName::Staged => Self::Staged,
            TransportName::Ucx => Self::Ucx,
            TransportName::Shm => Self::Shm,
        }
    }
}

impl From<WireTransport> for TransportName {
    fn from(name: WireTransport) -> Self {
        match name {
            WireTransport::Tcp => Self::Tcp,
            WireTransport::Ipc => Self::Ipc,
            WireTransport::Staged => Self::Staged,
            WireTransport::Ucx => Self::Ucx,
            WireTransport::Shm => Self::Shm,
        }
    }
}

impl From<&ArchivedWireTransport> for WireTransport {
    fn from(name: &ArchivedWireTransport) -> Self {
        match name {
            ArchivedWireTransport::Tcp => Self::Tcp,
            ArchivedWireTransport::Ipc => Self::Ipc,
            ArchivedWireTransport::Staged => Self::Staged,
            ArchivedWireTransport::Ucx => Self::Ucx,
            ArchivedWireTransport::Shm => Self::Shm,
        }
    }
}

/// A node's greeting, the first frame on every link after authentication.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Hello {
    /// The sending node's configured name.
    pub node: String,
    /// The sender's [`PROTOCOL_VERSION`].
    pub version: u16,
    /// Identifies the sender's host, to tell same-host peers from remote ones.
    pub host_id: String,
    /// Process id of the sender (same-host peers use it in diagnostics).
    pub pid: u32,
    /// Transports the sender can serve, each with what a peer needs to use it there (in
    /// the transport's own terms).
    pub transports: Vec<Announce>,
    /// The largest frame the sender accepts, in bytes.
    pub max_frame: u32,
    /// Where the sender lands the buffers it receives, by default: its
    /// `memory.receive_into` as it resolved at start (`"device"` on a node without a GPU is
    /// host memory; `Device(n)` names the sender's own GPU `n`). A peer routes its sends to
    /// the sender with this as the destination memory class. Transports that cannot land
    /// there (tcp, for device memory) land in the sender's first host tier instead.
    pub receives: WireMemoryKind,
    /// What the sender wants of this link (see [`HelloPurpose`]).
    pub purpose: HelloPurpose,
}

impl Hello {
    /// Whether the sender serves `transport`.
    pub fn serves(&self, transport: TransportName) -> bool {
        self.announced(transport).is_some()
    }

    /// What the sender announced of `transport` (its own terms), if it serves it.
    pub fn announced(&self, transport: TransportName) -> Option<&[u8]> {
        let wire = WireTransport::from(transport);
        self.transports
            .iter()
            .find(|a| a.transport == wire)
            .map(|a| a.terms.as_slice())
    }

    /// The names of the transports the sender serves, in its order.
    pub fn served(&self) -> impl Iterator<Item = TransportName> + '_ {
        self.transports.iter().map(|a| a.transport.into())
    }
}

/// What the sender of a [`Hello`] wants of the link.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum HelloPurpose {
    /// A link, with no expectation of who answers: every acceptor's hello, and a dialer's
    /// that names no peer (tools and tests).
    Link,
    /// A link to the node of this name: an acceptor of another name refuses it (closes it
    /// without keeping a session), so a dial that reached the wrong node disturbs nothing
    /// there. The dialer checks the answer's name too.
    LinkTo(String),
    /// Only who answers at this address (DNS discovery): the acceptor closes the link after
    /// the hellos and keeps no session for it, so a probe never disturbs a link the two
    /// nodes already have.
    Probe,
}

/// The sender proposes a transfer.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Offer {
    /// Transfer id, unique per sending node and link.
    pub transfer: u64,
    /// The application's tag, matched by the receiver's `recv`.
    pub tag: u64,
    /// Bytes to move.
    pub len: u64,
    /// Where the bytes live at the sender.
    pub source: WireMemoryKind,
    /// Transport chosen by the sender's route rules.
    pub transport: WireTransport,
    /// Who moves the bytes.
    pub direction: WireDirection,
    /// For a pull: where the receiver reads the bytes, in the transport's own terms.
    pub pull: Option<Descriptor>,
    /// How the bytes lie in the sender's buffer; they travel packed, and `len` is their
    /// packed length.
    pub layout: crate::wire::Layout,
    /// For the answer to a [`Message::Fetch`]: that fetch's id. The receiver hands the
    /// bytes to the fetch that asked, not to `recv` (`tag` is then 0).
    pub fetch: Option<u64>,
    /// For a one-sided write: the receiver's registered region the bytes go into, and
    /// where in it. The receiver places them there (not into `recv`'s inbox) before it
    /// answers `Done`, or refuses the transfer naming why (a stale key, a region
    /// registered read-only, a layout that does not fit).
    pub into: Option<RegionWrite>,
    /// An eager tcp push: its `len` bytes follow this frame at once as one raw
    /// [`FrameKind::Payload`] frame, within the eager credit the receiver granted in its
    /// hello. The receiver either takes them (and answers `Done`) or reads past them and
    /// answers with a `Grant` as for any offer, after which the sender streams them again.
    pub eager: bool,
}

/// Where a one-sided write lands at the receiver: its registered region (id and the
/// generation the key names) and the places in it, packed bytes scattered in order.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct RegionWrite {
    /// The region's id at the receiver.
    pub region: u64,
    /// The generation its key names (a key of an earlier registration is refused).
    pub generation: u64,
    /// Where the packed bytes go in the region (checked there not to overlap).
    pub layout: crate::wire::Layout,
}

/// The receiver has reserved memory for a transfer; the sender may stream it, or, for a
/// push over a transport that writes the receiver's memory, write it into the buffer lent.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Grant {
    /// The transfer this grant answers.
    pub transfer: u64,
    /// Where the data will land at the receiver.
    pub landing: WireMemoryKind,
    /// For a push into memory the receiver lends (an export, a registration): the
    /// buffer, in the offer's transport's own terms, lent until the sender answers
    /// [`Message::Written`]. `None`: the bytes stream over the link (a push whose landing
    /// could not be lent, spilled to host memory say, takes that way too).
    pub lent: Option<Descriptor>,
}

/// The sender of a push into a lent buffer no longer touches the receiver's buffer lent in the grant: its
/// copy completed (`error` is `None`, every byte is in place and visible) or failed or never
/// ran. Sent exactly once for every grant that lent a buffer.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Written {
    /// The transfer, as offered.
    pub transfer: u64,
    /// Why the bytes are not there, when they are not.
    pub error: Option<String>,
}

/// Describes one chunk of a transfer's payload. The bytes themselves follow on the link as
/// the next frame, a [`FrameKind::Payload`] frame of exactly `len` bytes, which the receiver
/// reads straight into the reserved buffer.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct DataChunk {
    /// The transfer the bytes belong to.
    pub transfer: u64,
    /// Byte offset of the chunk within the transfer.
    pub offset: u64,
    /// Length of the chunk: the payload length of the `Payload` frame that follows.
    pub len: u32,
}

/// The receiver holds every byte of a transfer; the sender's lease is released.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Done {
    /// The completed transfer.
    pub transfer: u64,
}

/// Why a transfer was cancelled or refused.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub enum WireReason {
    /// The application cancelled it.
    Cancelled,
    /// Its deadline passed.
    DeadlineExceeded,
    /// The receiver cannot hold it (larger than its whole budget).
    TooLarge,
    /// The receiver does not serve the requested transport or direction.
    Unsupported,
    /// The node is shutting down.
    ShuttingDown,
    /// The message broke the protocol.
    Protocol,
    /// The receiver saw no progress for its stall timeout and gave the transfer up.
    Stalled,
    /// A one-sided write named a region the receiver does not hold under that key: it
    /// was unregistered, or the key is of an earlier registration.
    StaleKey,
    /// A one-sided write named a region the receiver registered read-only.
    ReadOnly,
}

/// Either side abandons a transfer.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Cancel {
    /// The sender-side transfer id.
    pub transfer: u64,
    /// True when the transfer's receiver cancels (refuses or gives up): `transfer` is then
    /// the recipient's own transfer; false when its sender cancels it. Both sides number
    /// their transfers from 1, so the id alone cannot say whose it is.
    pub by_receiver: bool,
    /// Why.
    pub reason: WireReason,
    /// Human-readable detail for logs.
    pub detail: String,
}

/// Describes one chunk of a one-sided put into a region the receiving node exposed. The
/// bytes follow on the link as the next frame, a [`FrameKind::Payload`] frame of exactly
/// `len` bytes.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PutChunk {
    /// Put id, unique per sending node and link.
    pub put: u64,
    /// The granted region's id.
    pub region: u64,
    /// The region's generation: a stale key is refused.
    pub generation: u64,
    /// Byte offset within the region.
    pub offset: u64,
    /// Length of the chunk: the payload length of the `Payload` frame that follows.
    pub len: u32,
    /// True on the put's last chunk; the receiver acknowledges then.
    pub last: bool,
}

/// Result of a put, sent after its last chunk.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct PutAck {
    /// The put acknowledged.
    pub put: u64,
    /// `None` when every byte landed, else why the put was refused.
    pub error: Option<String>,
}

/// The receiver asks for the buffer its peer published under `key` (whole, or the blocks
/// of `layout`); the peer answers with an [`Offer`] whose `fetch` is this id, or with
/// [`Message::FetchRefused`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct FetchAsk {
    /// The fetch's id, unique per asking node and link.
    pub fetch: u64,
    /// The application's key (at most [`MAX_KEY_LEN`] bytes).
    pub key: String,
    /// Which bytes of the published buffer: [`crate::wire::Layout::Contiguous`] for all.
    pub layout: crate::wire::Layout,
}

/// The longest key a buffer is published under, in bytes.
pub const MAX_KEY_LEN: usize = 1024;

/// Why a fetch was refused.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub enum FetchRefusal {
    /// Nothing is published under the key.
    UnknownKey,
    /// The key is published for other peers only.
    NotAllowed,
    /// The layout asked for does not fit the published buffer.
    Layout,
    /// The peer serves as many fetches for this node as it may at once.
    Busy,
    /// The peer is shutting down.
    ShuttingDown,
    /// The peer's send of the bytes failed (its detail says why).
    Failed,
}

/// A fetch is refused: nothing will be offered for it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct FetchRefused {
    /// The fetch, as asked.
    pub fetch: u64,
    /// Why, typed.
    pub reason: FetchRefusal,
    /// Why, in words.
    pub detail: String,
}

/// Every message of the ferry wire protocol.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub enum Message {
    /// First frame after authentication.
    Hello(Hello),
    /// A transfer is proposed.
    Offer(Offer),
    /// Memory reserved; stream the data.
    Grant(Grant),
    /// A chunk of a transfer; its bytes follow as a `Payload` frame.
    Data(DataChunk),
    /// All bytes arrived.
    Done(Done),
    /// A transfer is abandoned.
    Cancel(Cancel),
    /// A chunk of a one-sided put; its bytes follow as a `Payload` frame.
    Put(PutChunk),
    /// A one-sided put's result.
    PutAck(PutAck),
    /// Liveness probe.
    Ping(u64),
    /// Answer to a ping, echoing its nonce.
    Pong(u64),
    /// The sender drained its transfers and is closing the link; as the first frame from
    /// an acceptor, it refuses the link (another link to the same peer wins).
    Goodbye,
    /// The acceptor keeps this link; the dialer sends nothing before it.
    Welcome,
    /// A control message of one transport, for its part of the session.
    Transport(TransportMessage),
    /// A push let go of the receiver's buffer lent to it (written, or not).
    Written(Written),
    /// Asks for a published buffer.
    Fetch(FetchAsk),
    /// A fetch is refused.
    FetchRefused(FetchRefused),
}

/// The kind of a frame, carried in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum FrameKind {
    /// [`Message::Hello`]
    Hello = 1,
    /// [`Message::Offer`]
    Offer = 2,
    /// [`Message::Grant`]
    Grant = 3,
    /// [`Message::Data`]
    Data = 4,
    /// [`Message::Done`]
    Done = 5,
    /// [`Message::Cancel`]
    Cancel = 6,
    /// [`Message::Put`]
    Put = 7,
    /// [`Message::PutAck`]
    PutAck = 8,
    /// [`Message::Ping`]
    Ping = 9,
    /// [`Message::Pong`]
    Pong = 10,
    /// [`Message::Goodbye`]
    Goodbye = 11,
    /// [`Message::Welcome`]
    Welcome = 12,
    /// Raw bytes, not a [`Message`]: the chunk announced by the [`Message::Data`] or
    /// [`Message::Put`] frame just before it, exactly as long as that header says. Nothing
    /// in it is interpreted; the frame CRC is its only check.
    Payload = 13,
    /// [`Message::Transport`]
    Transport = 14,
    /// [`Message::Written`]
    Written = 17,
    /// [`Message::Fetch`]
    Fetch = 19,
    /// [`Message::FetchRefused`]
    FetchRefused = 20,
}

impl FrameKind {
    /// The kind with this header value, if any.
    pub fn from_u16(value: u16) -> Option<Self> {
        Some(match value {
            1 => Self::Hello,
            2 => Self::Offer,
            3 => Self::Grant,
            4 => Self::Data,
            5 => Self::Done,
            6 => Self::Cancel,
            7 => Self::Put,
            8 => Self::PutAck,
            9 => Self::Ping,
            10 => Self::Pong,
            11 => Self::Goodbye,
            12 => Self::Welcome,
            13 => Self::Payload,
            14 => Self::Transport,
            17 => Self::Written,
            19 => Self::Fetch,
            20 => Self::FetchRefused,
            _ => return None,
        })
    }
}

/// Bytes [`Message::payload_len_bound`] allows for the padding that aligns an offer's
/// block list (the alignment of an archived block is 8; this is generous).
pub const BLOCKS_SLACK: usize = 64;

impl Message {
    /// The length of the message's rkyv payload, as its frame carries it: what a peer's
    /// `max_frame` caps (a large block list makes a large offer).
    ///
    /// # Errors
    /// rkyv's, when the message cannot be encoded.
    pub fn payload_len(&self) -> Result<usize, rkyv::rancor::Error> {
        rkyv::to_bytes::<rkyv::rancor::Error>(self).map(|b| b.len())
    }

    /// At least [`Self::payload_len`], found without encoding a block list: an offer of
    /// [`crate::wire::Layout::Blocks`] is encoded with no blocks, and each block counts the
    /// bytes it archives to (plus [`BLOCKS_SLACK`] for the list's alignment). Any other
    /// message is encoded. For a cheap "fits the frame" check; [`Self::payload_len`] says
    /// exactly when the bound does not fit.
    ///
    /// # Errors
    /// rkyv's, when the message cannot be encoded.
    pub fn payload_len_bound(&self) -> Result<usize, rkyv::rancor::Error> {
        let Self::Offer(offer) = self else {
            return self.payload_len();
        };
        let count = |layout: &crate::wire::Layout| layout.block_list().map_or(0, <[_]>::len);
        let into = offer.into.as_ref().map_or(0, |into| count(&into.layout));
        let blocks = count(&offer.layout) + into;
        if blocks == 0 {
            return self.payload_len();
        }
        let empty = |layout: &crate::wire::Layout| match layout {
            crate::wire::Layout::Blocks(_) => crate::wire::Layout::Blocks(std::sync::Arc::from([])),
            other => other.clone(),
        };
        let bare = Self::Offer(Offer {
            eager: false,
            layout: empty(&offer.layout),
            pull: offer.pull.clone(),
            into: offer.into.as_ref().map(|into| RegionWrite {
                layout: empty(&into.layout),
                ..*into
            }),
            ..*offer
        });
        let each = std::mem::size_of::<<crate::wire::Block as Archive>::Archived>();
        Ok(bare
            .payload_len()?
            .saturating_add(blocks.saturating_mul(each))
            .saturating_add(BLOCKS_SLACK))
    }

    /// The frame kind this message travels as.
    pub fn kind(&self) -> FrameKind {
        match self {
            Self::Hello(_) => FrameKind::Hello,
            Self::Offer(_) => FrameKind::Offer,
            Self::Grant(_) => FrameKind::Grant,
            Self::Data(_) => FrameKind::Data,
            Self::Done(_) => FrameKind::Done,
            Self::Cancel(_) => FrameKind::Cancel,
            Self::Put(_) => FrameKind::Put,
            Self::PutAck(_) => FrameKind::PutAck,
            Self::Ping(_) => FrameKind::Ping,
            Self::Pong(_) => FrameKind::Pong,
            Self::Goodbye => FrameKind::Goodbye,
            Self::Welcome => FrameKind::Welcome,
            Self::Transport(_) => FrameKind::Transport,
            Self::Written(_) => FrameKind::Written,
            Self::Fetch(_) => FrameKind::Fetch,
            Self::FetchRefused(_) => FrameKind::FetchRefused,
        }
    }
}

impl ArchivedMessage {
    /// The frame kind of this archived message.
    pub fn kind(&self) -> FrameKind {
        match self {
            Self::Hello(_) => FrameKind::Hello,
            Self::Offer(_) => FrameKind::Offer,
            Self::Grant(_) => FrameKind::Grant,
            Self::Data(_) => FrameKind::Data,
            Self::Done(_) => FrameKind::Done,
            Self::Cancel(_) => FrameKind::Cancel,
            Self::Put(_) => FrameKind::Put,
            Self::PutAck(_) => FrameKind::PutAck,
            Self::Ping(_) => FrameKind::Ping,
            Self::Pong(_) => FrameKind::Pong,
            Self::Goodbye => FrameKind::Goodbye,
            Self::Welcome => FrameKind::Welcome,
            Self::Transport(_) => FrameKind::Transport,
            Self::Written(_) => FrameKind::Written,
            Self::Fetch(_) => FrameKind::Fetch,
            Self::FetchRefused(_) => FrameKind::FetchRefused,
        }
    }
}

impl From<&ArchivedDataChunk> for DataChunk {
    fn from(chunk: &ArchivedDataChunk) -> Self {
        Self {
            transfer: chunk.transfer.to_native(),
            offset: chunk.offset.to_native(),
            len: chunk.len.to_native(),
        }
    }
}

impl From<&ArchivedPutChunk> for PutChunk {
    fn from(chunk: &ArchivedPutChunk) -> Self {
        Self {
            put: chunk.put.to_native(),
            region: chunk.region.to_native(),
            generation: chunk.generation.to_native(),
            offset: chunk.offset.to_native(),
            len: chunk.len.to_native(),
            last: chunk.last,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Layout;

    fn offer(blocks: u64, export: usize, ipc: bool) -> Message {
        Message::Offer(Offer {
            eager: false,
            fetch: Some(u64::MAX),
            into: None,
            transfer: 7,
            tag: 9,
            len: blocks * 3,
            source: WireMemoryKind::Device(0),
            transport: WireTransport::Ipc,
            direction: WireDirection::Pull,
            pull: ipc.then(|| Descriptor([export as u8; 3].repeat(export % 7 + export))),
            layout: Layout::blocks((0..blocks).map(|b| (b * 5, 3))),
        })
    }

    /// The bound of an offer's payload is never short of its length (so an offer within
    /// the bound fits a frame the length fits), and never far above it.
    #[test]
    fn an_offers_bound_covers_its_length() {
        for blocks in (0..70).chain([255, 256, 1000, 4097]) {
            for export in [0, 1, 5, 63, 64, 65] {
                for ipc in [false, true] {
                    let msg = offer(blocks, export, ipc);
                    let exact = msg.payload_len().expect("encodes");
                    let bound = msg.payload_len_bound().expect("encodes");
                    assert!(
                        exact <= bound && bound - exact <= 2 * BLOCKS_SLACK,
                        "{blocks} blocks, export {export}, ipc {ipc}: {exact} vs {bound}"
                    );
                }
            }
        }
        // Not an offer of blocks: the length itself.
        let contiguous = Message::Offer(Offer {
            eager: false,
            layout: Layout::Contiguous,
            ..match offer(1, 64, true) {
                Message::Offer(o) => o,
                _ => unreachable!(),
            }
        });
        assert_eq!(
            contiguous.payload_len_bound().expect("encodes"),
            contiguous.payload_len().expect("encodes")
        );
        let ping = Message::Ping(1);
        assert_eq!(ping.payload_len_bound().ok(), ping.payload_len().ok());
    }
}
