//! Frames: the 16-byte header that carries one rkyv-archived [`Message`], or one chunk of
//! raw bytes, over a byte stream.
//!
//! ```text
//! offset  size  field
//!      0     4  magic   b"FRY\x01"
//!      4     2  version u16 LE  (PROTOCOL_VERSION)
//!      6     2  kind    u16 LE  (FrameKind)
//!      8     4  length  u32 LE  (payload bytes that follow the header)
//!     12     4  crc32c  u32 LE  over header bytes 0..12, then the payload
//!     16   len  payload (rkyv archive of a Message; raw bytes for FrameKind::Payload)
//! ```
//!
//! Bytes from a peer are hostile until checked, in this order: magic, version, kind, length
//! against the caller's cap (before anything is allocated for the payload), then, once the
//! whole payload is there, the CRC (before the payload is looked at), then rkyv's validating
//! access, then that the archived message is of the kind the header names. Every failure is
//! a [`FrameError`]; nothing here panics on peer input.
//!
//! A [`FrameKind::Payload`] frame carries the bytes of the `Data` or `Put` chunk announced
//! by the frame before it. It has no archive: [`FrameReader::read_payload_into`] reads it
//! straight into the caller's memory once its header passed the checks above and its kind
//! and length are the ones announced, then checks the CRC. Read with [`FrameReader::read`]
//! or [`decode`] instead (a payload nobody announced), it is checked by its CRC only, and
//! [`Frame::message`] refuses it.

mod reader;

pub use reader::{FrameReader, ReadError, read_frame};

use std::io;
use std::sync::Arc;

use rkyv::rancor;
use rkyv::util::AlignedVec;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::message::{ArchivedMessage, FrameKind, Message, PROTOCOL_VERSION};

/// Length of a frame header in bytes.
pub const HEADER_LEN: usize = 16;

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"FRY\x01";

/// Bytes of the header that the CRC covers (everything before the CRC field).
const CRC_COVERED: usize = 12;

/// The first payload buffer a reader allocates; it grows (doubling) as bytes actually arrive,
/// so a peer cannot make us allocate a whole `max_frame` by sending one header.
const INITIAL_READ_CHUNK: usize = 64 * 1024;

/// Size of the buffer a discarded payload is read through, a piece at a time.
const DISCARD_CHUNK: usize = 64 * 1024;

/// Why a frame was refused (or, for [`FrameError::Encode`], could not be built).
///
/// Every variant except `Encode` means the peer sent bytes that are not a valid frame: the
/// peer misbehaved (or the bytes were damaged on the way).
#[non_exhaustive]
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum FrameError {
    /// The frame does not start with [`MAGIC`]: not a ferry peer, or the stream is out of sync.
    #[error("bad frame magic {0:02x?} (expected {MAGIC:02x?})")]
    BadMagic([u8; 4]),
    /// The peer speaks another protocol version.
    #[error("protocol version mismatch: we speak {ours}, the peer sent {theirs}")]
    VersionMismatch {
        /// Our [`PROTOCOL_VERSION`].
        ours: u16,
        /// The version in the peer's frame.
        theirs: u16,
    },
    /// The header names a frame kind this build does not know.
    #[error("unknown frame kind {0}")]
    UnknownKind(u16),
    /// The declared payload length exceeds the cap; nothing was allocated for it.
    #[error("frame payload of {len} bytes exceeds the cap of {cap} bytes")]
    TooLong {
        /// Declared (or, when encoding, actual) payload length.
        len: u64,
        /// The cap in force.
        cap: u64,
    },
    /// The input ended before the frame did.
    #[error("truncated frame: needed {needed} bytes, got {got}")]
    Truncated {
        /// Bytes the frame needs (header included, once the header is known).
        needed: usize,
        /// Bytes that were available.
        got: usize,
    },
    /// The CRC in the header does not match the header and payload.
    #[error("frame CRC mismatch: header says {expected:#010x}, bytes give {actual:#010x}")]
    CrcMismatch {
        /// CRC carried in the header.
        expected: u32,
        /// CRC computed over the received bytes.
        actual: u32,
    },
    /// The payload is not a valid archived [`Message`] (rkyv validation failed).
    #[error("invalid frame payload: {0}")]
    Invalid(String),
    /// The payload is a valid message, but of another kind than the header says.
    #[error("frame header says kind {header} but the payload is kind {payload}")]
    KindMismatch {
        /// Kind named in the header.
        header: u16,
        /// Kind of the archived message.
        payload: u16,
    },
    /// Our own message could not be encoded (serialization failed or it is too large).
    /// This is a local error, never the peer's fault.
    #[error("cannot encode frame: {0}")]
    Encode(String),
    /// The peer started a frame and then sent no byte of it for the reader's stall timeout
    /// ([`FrameReader::set_stall_timeout`]): a stalled or hostile peer; the stream is given
    /// up.
    #[error("the peer sent no byte for {waited:?} inside a frame ({got} of {needed} bytes in)")]
    Stalled {
        /// How long nothing arrived.
        waited: std::time::Duration,
        /// Bytes of the frame received.
        got: usize,
        /// Bytes the frame needs (as far as known).
        needed: usize,
    },
}

impl FrameError {
    /// Every label [`FrameError::reason`] can return, in a fixed order (used to index
    /// per-reason counters).
    pub const REASONS: [&'static str; 10] = [
        "bad_magic",
        "version",
        "unknown_kind",
        "too_long",
        "truncated",
        "crc",
        "invalid",
        "kind_mismatch",
        "encode",
        "stalled",
    ];

    /// A short, stable label for this error, for metrics (`reason="crc"`, ...).
    pub fn reason(&self) -> &'static str {
        Self::REASONS[self.reason_index()]
    }

    /// Position of [`FrameError::reason`] in [`FrameError::REASONS`].
    pub fn reason_index(&self) -> usize {
        match self {
            Self::BadMagic(_) => 0,
            Self::VersionMismatch { .. } => 1,
            Self::UnknownKind(_) => 2,
            Self::TooLong { .. } => 3,
            Self::Truncated { .. } => 4,
            Self::CrcMismatch { .. } => 5,
            Self::Invalid(_) => 6,
            Self::KindMismatch { .. } => 7,
            Self::Encode(_) => 8,
            Self::Stalled { .. } => 9,
        }
    }

    /// True when a stream reader that hit this error consumed exactly the bad frame and is
    /// positioned at the start of the next one, so it may keep reading (CRC, validation and
    /// kind errors: the header was sound). False when the stream is out of sync or ended.
    ///
    /// A CRC error caused by a damaged length field is reported as recoverable too; the
    /// next read then fails on the magic and the stream is given up.
    ///
    /// This describes whole frames read with [`FrameReader::read`]. A raw payload read with
    /// [`FrameReader::read_payload_into`] is refused on its header before its bytes are
    /// consumed, so there only a CRC mismatch leaves the stream in step.
    pub fn is_recoverable(&self) -> bool {
        matches!(
            self,
            Self::CrcMismatch { .. } | Self::Invalid(_) | Self::KindMismatch { .. }
        )
    }
}

/// A parsed and checked frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Protocol version of the sender (equal to ours once [`parse_header`] accepted it).
    pub version: u16,
    /// Kind of the message in the payload.
    pub kind: FrameKind,
    /// Payload length in bytes.
    pub len: u32,
    /// CRC32C over header bytes 0..12 followed by the payload.
    pub crc: u32,
}

impl FrameHeader {
    /// The header for `payload` sent as `kind` at our [`PROTOCOL_VERSION`], CRC computed.
    ///
    /// Fails with [`FrameError::Encode`] when the payload does not fit the u32 length field.
    pub fn for_payload(kind: FrameKind, payload: &[u8]) -> Result<Self, FrameError> {
        let len = u32::try_from(payload.len()).map_err(|_| {
            FrameError::Encode(format!(
                "payload of {} bytes does not fit a frame",
                payload.len()
            ))
        })?;
        let mut header = Self {
            version: PROTOCOL_VERSION,
            kind,
            len,
            crc: 0,
        };
        header.crc = frame_crc(&header.to_bytes(), payload);
        Ok(header)
    }

    /// The header's 16 wire bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&self.version.to_le_bytes());
        out[6..8].copy_from_slice(&(self.kind as u16).to_le_bytes());
        out[8..12].copy_from_slice(&self.len.to_le_bytes());
        out[12..16].copy_from_slice(&self.crc.to_le_bytes());
        out
    }

    /// Header plus payload length in bytes.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.len as usize
    }
}

/// CRC32C over the first 12 header bytes, then the payload.
fn frame_crc(header: &[u8; HEADER_LEN], payload: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&header[..CRC_COVERED]), payload)
}

fn u16_at(bytes: &[u8; HEADER_LEN], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

fn u32_at(bytes: &[u8; HEADER_LEN], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Parses and checks a header: magic, then version, then kind, then `len <= max_frame`.
///
/// Returns the header; the CRC is only read here, it is checked once the payload is there.
/// Fails with [`FrameError::BadMagic`], [`FrameError::VersionMismatch`] (naming both
/// versions), [`FrameError::UnknownKind`] or [`FrameError::TooLong`]. Allocates nothing.
pub fn parse_header(bytes: &[u8; HEADER_LEN], max_frame: u32) -> Result<FrameHeader, FrameError> {
    let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let version = u16_at(bytes, 4);
    if version != PROTOCOL_VERSION {
        return Err(FrameError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: version,
        });
    }
    let raw_kind = u16_at(bytes, 6);
    let kind = FrameKind::from_u16(raw_kind).ok_or(FrameError::UnknownKind(raw_kind))?;
    let len = u32_at(bytes, 8);
    if len > max_frame {
        return Err(FrameError::TooLong {
            len: u64::from(len),
            cap: u64::from(max_frame),
        });
    }
    Ok(FrameHeader {
        version,
        kind,
        len,
        crc: u32_at(bytes, 12),
    })
}

/// A checked frame: its header and its payload, which is a valid archived [`Message`] of
/// the header's kind. Only [`decode`], [`read_frame`] and [`FrameReader`] make one.
#[derive(Debug, Clone)]
pub struct Frame {
    header: FrameHeader,
    payload: AlignedVec,
}

impl Frame {
    /// Checks a complete payload: CRC, then (unless it is raw bytes) rkyv validation, then
    /// kind agreement.
    fn from_checked_header(
        header: FrameHeader,
        raw_header: &[u8; HEADER_LEN],
        payload: AlignedVec,
    ) -> Result<Self, FrameError> {
        check_crc(&header, raw_header, &payload)?;
        let frame = Self { header, payload };
        frame.validate()?;
        Ok(frame)
    }

    /// Runs the checks past the CRC: none for raw bytes, [`Frame::message`] for the rest.
    fn validate(&self) -> Result<(), FrameError> {
        if self.header.kind != FrameKind::Payload {
            self.message()?;
        }
        Ok(())
    }

    /// The frame's header.
    pub fn header(&self) -> &FrameHeader {
        &self.header
    }

    /// The frame's kind (same as the archived message's).
    pub fn kind(&self) -> FrameKind {
        self.header.kind
    }

    /// The raw payload bytes (an rkyv archive, 16-byte aligned; the chunk's bytes for a
    /// [`FrameKind::Payload`] frame).
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The archived message, read in place (zero-copy).
    ///
    /// Runs rkyv's validating access each call (the crate forbids `unsafe`, so the
    /// unchecked access is not available); a frame made by this module always passes, but
    /// the result is still a `Result`. Fails with [`FrameError::Invalid`] or
    /// [`FrameError::KindMismatch`]; always with `Invalid` for a [`FrameKind::Payload`]
    /// frame, which carries raw bytes and no message.
    pub fn message(&self) -> Result<&ArchivedMessage, FrameError> {
        if self.header.kind == FrameKind::Payload {
            return Err(FrameError::Invalid(
                "a payload frame that no Data or Put frame announced".into(),
            ));
        }
        let archived = rkyv::access::<ArchivedMessage, rancor::Error>(&self.payload)
            .map_err(|e| FrameError::Invalid(e.to_string()))?;
        let payload_kind = archived.kind();
        if payload_kind != self.header.kind {
            return Err(FrameError::KindMismatch {
                header: self.header.kind as u16,
                payload: payload_kind as u16,
            });
        }
        Ok(archived)
    }

    /// The message deserialized into an owned [`Message`] (copies every field).
    ///
    /// Fails like [`Frame::message`].
    pub fn to_owned_message(&self) -> Result<Message, FrameError> {
        owned_message(self.message()?)
    }
}

/// A message of a frame, as [`Frame::message`] gave it, deserialized into an owned
/// [`Message`]: [`Frame::to_owned_message`] without checking the archive once more (an
/// offer's block list is walked once fewer).
///
/// # Errors
/// [`FrameError::Invalid`] when rkyv cannot deserialize it.
pub fn owned_message(archived: &ArchivedMessage) -> Result<Message, FrameError> {
    rkyv::deserialize::<Message, rancor::Error>(archived)
        .map_err(|e| FrameError::Invalid(e.to_string()))
}

fn check_crc(
    header: &FrameHeader,
    raw_header: &[u8; HEADER_LEN],
    payload: &[u8],
) -> Result<(), FrameError> {
    let actual = frame_crc(raw_header, payload);
    if actual != header.crc {
        return Err(FrameError::CrcMismatch {
            expected: header.crc,
            actual,
        });
    }
    Ok(())
}

/// Serializes `msg` into its rkyv payload.
fn archive(msg: &Message) -> Result<AlignedVec, FrameError> {
    rkyv::to_bytes::<rancor::Error>(msg).map_err(|e| FrameError::Encode(e.to_string()))
}

/// Encodes `msg` as one complete frame (header and payload).
///
/// Fails with [`FrameError::Encode`] if serialization fails or the payload exceeds
/// `u32::MAX` bytes. The receiver's own cap is not known here; see `LinkWriter` for the
/// check against the peer's advertised `max_frame`.
pub fn encode(msg: &Message) -> Result<Vec<u8>, FrameError> {
    let mut out = Vec::new();
    encode_into(msg, &mut out)?;
    Ok(out)
}

/// Appends one complete frame for `msg` to `out` (useful to batch several frames into one
/// write). On error `out` is left as it was.
pub fn encode_into(msg: &Message, out: &mut Vec<u8>) -> Result<(), FrameError> {
    let payload = archive(msg)?;
    let header = FrameHeader::for_payload(msg.kind(), &payload)?;
    out.reserve(HEADER_LEN + payload.len());
    out.extend_from_slice(&header.to_bytes());
    out.extend_from_slice(&payload);
    Ok(())
}

/// Encodes `bytes` as one complete [`FrameKind::Payload`] frame.
///
/// Fails with [`FrameError::Encode`] if `bytes` exceeds `u32::MAX` bytes. Links do not
/// copy payloads this way (`LinkWriter::feed_chunk` writes them from the caller's slice);
/// this is for tests and tools.
pub fn encode_payload(bytes: &[u8]) -> Result<Vec<u8>, FrameError> {
    let mut out = Vec::new();
    encode_payload_into(bytes, &mut out)?;
    Ok(out)
}

/// Appends one complete [`FrameKind::Payload`] frame carrying `bytes` to `out`. On error
/// `out` is left as it was.
pub fn encode_payload_into(bytes: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    let header = FrameHeader::for_payload(FrameKind::Payload, bytes)?;
    out.reserve(HEADER_LEN + bytes.len());
    out.extend_from_slice(&header.to_bytes());
    out.extend_from_slice(bytes);
    Ok(())
}

/// Decodes the first frame of a complete buffer.
///
/// Returns the frame and how many bytes it took; bytes after it are left alone. Checks in
/// this order: header ([`parse_header`]), enough bytes ([`FrameError::Truncated`], with
/// `needed` the whole frame's length once the header is known), CRC, validating access,
/// kind agreement (the last two not for a [`FrameKind::Payload`] frame, whose bytes are
/// raw). The payload is copied into an aligned buffer only after the CRC passed.
pub fn decode(bytes: &[u8], max_frame: u32) -> Result<(Frame, usize), FrameError> {
    let Some(raw_header) = bytes.first_chunk::<HEADER_LEN>() else {
        return Err(FrameError::Truncated {
            needed: HEADER_LEN,
            got: bytes.len(),
        });
    };
    let header = parse_header(raw_header, max_frame)?;
    let total = header.frame_len();
    let Some(payload) = bytes.get(HEADER_LEN..total) else {
        return Err(FrameError::Truncated {
            needed: total,
            got: bytes.len(),
        });
    };
    check_crc(&header, raw_header, payload)?;
    let mut aligned = AlignedVec::with_capacity(payload.len());
    aligned.extend_from_slice(payload);
    let frame = Frame {
        header,
        payload: aligned,
    };
    frame.validate()?;
    Ok((frame, total))
}

/// Encodes `msg` and writes it to `w` as one frame, then flushes.
///
/// Fails with [`WriteError::Encode`] if the message cannot be encoded (nothing is written
/// then) or [`WriteError::Io`] if the stream fails.
///
/// # Cancel safety
///
/// Not cancel-safe: a dropped future may have written part of the frame, after which the
/// stream is out of sync and must be closed.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    msg: &Message,
) -> Result<(), WriteError> {
    let payload = archive(msg)?;
    let header = FrameHeader::for_payload(msg.kind(), &payload)?;
    w.write_all(&header.to_bytes()).await?;
    w.write_all(&payload).await?;
    w.flush().await?;
    Ok(())
}

/// Why writing a frame failed.
#[non_exhaustive]
#[derive(Debug, Clone, thiserror::Error)]
pub enum WriteError {
    /// The message could not be encoded (a local error).
    #[error(transparent)]
    Encode(#[from] FrameError),
    /// The underlying stream failed.
    #[error("I/O error writing a frame: {0}")]
    Io(Arc<io::Error>),
}

impl From<io::Error> for WriteError {
    fn from(e: io::Error) -> Self {
        Self::Io(Arc::new(e))
    }
}

#[cfg(test)]
mod tests;
