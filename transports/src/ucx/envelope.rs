//! The envelope around the opaque bytes UCX hands to peers (worker addresses and packed
//! remote keys).
//!
//! UCX parses a worker address or a packed key without knowing its length and without
//! validating it, so bytes that are not one (truncated, corrupted, or from another UCX
//! release, whose formats differ) can make it read out of bounds. The engine therefore
//! never gives UCX bytes it did not wrap itself: each comes in an envelope naming what it
//! is, the UCX release that made it, its length and a CRC32C, and is checked before UCX
//! sees it. This turns garbage and version mismatches into errors; it does not make a
//! deliberately crafted envelope safe, which is why addresses and keys travel only over
//! ferry's authenticated link.
//!
//! Layout (little-endian), 19 bytes then the label then the payload:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `FUCX` |
//! | 4 | kind: 1 worker address, 2 remote key |
//! | 5 | format, 1 |
//! | 6, 7, 8..10 | UCX major, minor, release (`u16`) |
//! | 10 | label length |
//! | 11..15 | payload length (`u32`) |
//! | 15..19 | CRC32C of every other byte (header without this field, label, payload) |

use std::fmt;

use ucx_sys::Version;

const MAGIC: &[u8; 4] = b"FUCX";
const FORMAT: u8 = 1;
/// Bytes before the label.
pub(crate) const HEADER_LEN: usize = 19;
const CRC_AT: usize = 15;
/// The largest payload accepted (UCX addresses are a few hundred bytes to a few KiB, keys
/// tens to hundreds of bytes).
pub(crate) const MAX_PAYLOAD: usize = 1 << 20;

/// What an envelope holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EnvelopeKind {
    /// A worker address (`ucp_worker_get_address`).
    WorkerAddress,
    /// A packed remote key (`ucp_rkey_pack`).
    RemoteKey,
}

impl EnvelopeKind {
    fn code(self) -> u8 {
        match self {
            EnvelopeKind::WorkerAddress => 1,
            EnvelopeKind::RemoteKey => 2,
        }
    }
}

impl fmt::Display for EnvelopeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EnvelopeKind::WorkerAddress => "a worker address",
            EnvelopeKind::RemoteKey => "a remote key",
        })
    }
}

/// Why bytes are not a usable envelope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// Shorter than the header.
    #[error("{len} bytes is too short to be one (a ferry UCX envelope has {HEADER_LEN})")]
    TooShort {
        /// Bytes given.
        len: usize,
    },
    /// The first bytes are not `FUCX`.
    #[error("not made by a ferry UCX engine (bad magic)")]
    BadMagic,
    /// A known envelope of another kind, or an unknown kind.
    #[error("expected {expected}, found kind {found}")]
    WrongKind {
        /// What the caller expected.
        expected: EnvelopeKind,
        /// The kind byte found.
        found: u8,
    },
    /// A format this build does not read.
    #[error("envelope format {0} is not supported (this build reads format {FORMAT})")]
    UnknownFormat(u8),
    /// The lengths in the header do not add up to the bytes given.
    #[error("the header says {declared} bytes, {actual} were given (truncated or padded)")]
    Length {
        /// Length the header declares.
        declared: usize,
        /// Bytes given.
        actual: usize,
    },
    /// The payload is empty or larger than any UCX address or key.
    #[error("payload of {0} bytes is out of range")]
    PayloadSize(usize),
    /// The CRC does not match: corrupted on the way.
    #[error("checksum mismatch (corrupted)")]
    Checksum,
    /// Made by another UCX release, whose addresses and keys this one cannot read.
    #[error("made by UCX {peer}, this process runs UCX {ours}: peers must load the same UCX build")]
    UcxVersion {
        /// The peer's UCX.
        peer: Version,
        /// This process's UCX.
        ours: Version,
    },
}

/// Wraps `payload` (UCX's bytes) of `kind` with `label`, for UCX release `ucx`. The label
/// is cut to 255 bytes (at a character boundary). A payload over [`MAX_PAYLOAD`] (never
/// UCX's own) is sealed anyway and refused by [`open`] on the other side.
pub(crate) fn seal(kind: EnvelopeKind, ucx: Version, label: &str, payload: &[u8]) -> Vec<u8> {
    let mut cut = label.len().min(255);
    while !label.is_char_boundary(cut) {
        cut -= 1;
    }
    let label = &label.as_bytes()[..cut];
    let mut out = Vec::with_capacity(HEADER_LEN + label.len() + payload.len());
    out.extend_from_slice(MAGIC);
    out.push(kind.code());
    out.push(FORMAT);
    out.push(u8::try_from(ucx.major).unwrap_or(u8::MAX));
    out.push(u8::try_from(ucx.minor).unwrap_or(u8::MAX));
    out.extend_from_slice(&u16::try_from(ucx.release).unwrap_or(u16::MAX).to_le_bytes());
    out.push(label.len() as u8); // at most 255 (cut above)
    out.extend_from_slice(
        &u32::try_from(payload.len())
            .unwrap_or(u32::MAX)
            .to_le_bytes(),
    );
    out.extend_from_slice(&[0; 4]); // CRC, below
    out.extend_from_slice(label);
    out.extend_from_slice(payload);
    let crc = checksum(&out);
    out[CRC_AT..HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    out
}

/// A checked envelope: borrowed views of its label and payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Opened<'a> {
    /// The label (lossy UTF-8 is the caller's choice).
    pub label: &'a [u8],
    /// UCX's bytes.
    pub payload: &'a [u8],
    /// The envelope's CRC, usable as a hash of the whole.
    pub crc: u32,
}

/// Checks `bytes` as an envelope of `kind` made by UCX release `ours`.
///
/// # Errors
///
/// [`EnvelopeError`] saying which check failed.
pub(crate) fn open(
    kind: EnvelopeKind,
    ours: Version,
    bytes: &[u8],
) -> Result<Opened<'_>, EnvelopeError> {
    if bytes.len() < HEADER_LEN {
        return Err(EnvelopeError::TooShort { len: bytes.len() });
    }
    if &bytes[..4] != MAGIC {
        return Err(EnvelopeError::BadMagic);
    }
    if bytes[4] != kind.code() {
        return Err(EnvelopeError::WrongKind {
            expected: kind,
            found: bytes[4],
        });
    }
    if bytes[5] != FORMAT {
        return Err(EnvelopeError::UnknownFormat(bytes[5]));
    }
    let label_len = usize::from(bytes[10]);
    let payload_len = u32::from_le_bytes([bytes[11], bytes[12], bytes[13], bytes[14]]) as usize;
    let declared = HEADER_LEN + label_len + payload_len;
    if declared != bytes.len() {
        return Err(EnvelopeError::Length {
            declared,
            actual: bytes.len(),
        });
    }
    if payload_len == 0 || payload_len > MAX_PAYLOAD {
        return Err(EnvelopeError::PayloadSize(payload_len));
    }
    let crc = u32::from_le_bytes([bytes[15], bytes[16], bytes[17], bytes[18]]);
    if checksum(bytes) != crc {
        return Err(EnvelopeError::Checksum);
    }
    let peer = Version {
        major: u32::from(bytes[6]),
        minor: u32::from(bytes[7]),
        release: u32::from(u16::from_le_bytes([bytes[8], bytes[9]])),
    };
    let ours_saturated = Version {
        major: ours.major.min(u32::from(u8::MAX)),
        minor: ours.minor.min(u32::from(u8::MAX)),
        release: ours.release.min(u32::from(u16::MAX)),
    };
    if peer != ours_saturated {
        return Err(EnvelopeError::UcxVersion { peer, ours });
    }
    Ok(Opened {
        label: &bytes[HEADER_LEN..HEADER_LEN + label_len],
        payload: &bytes[HEADER_LEN + label_len..],
        crc,
    })
}

/// CRC32C of `bytes` without the CRC field.
fn checksum(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&bytes[..CRC_AT]);
    crc32c::crc32c_append(crc, &bytes[HEADER_LEN..])
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: Version = Version {
        major: 1,
        minor: 13,
        release: 1,
    };

    #[test]
    fn a_sealed_envelope_opens_to_its_label_and_payload() {
        let bytes = seal(EnvelopeKind::WorkerAddress, V, "host pid 7", b"ucx bytes");
        let opened = open(EnvelopeKind::WorkerAddress, V, &bytes).expect("opens");
        assert_eq!(opened.label, b"host pid 7");
        assert_eq!(opened.payload, b"ucx bytes");
        assert_eq!(bytes.len(), HEADER_LEN + 10 + 9);
    }

    #[test]
    fn garbage_and_damage_are_refused_with_the_reason() {
        let good = seal(EnvelopeKind::RemoteKey, V, "", &[7; 40]);
        let open_rkey = |b: &[u8]| open(EnvelopeKind::RemoteKey, V, b).map(|_| ());
        assert_eq!(open_rkey(&[]), Err(EnvelopeError::TooShort { len: 0 }));
        assert_eq!(open_rkey(&[0xAB; 64]), Err(EnvelopeError::BadMagic));
        assert!(matches!(
            open(EnvelopeKind::WorkerAddress, V, &good),
            Err(EnvelopeError::WrongKind { found: 2, .. })
        ));
        assert!(matches!(
            open_rkey(&good[..good.len() - 1]),
            Err(EnvelopeError::Length { .. })
        ));
        let mut padded = good.clone();
        padded.push(0);
        assert!(matches!(
            open_rkey(&padded),
            Err(EnvelopeError::Length { .. })
        ));
        for at in [6, 11, 16, HEADER_LEN, good.len() - 1] {
            let mut flipped = good.clone();
            flipped[at] ^= 0x10;
            assert!(open_rkey(&flipped).is_err(), "a flip at {at} passed");
        }
        let mut flipped = good.clone();
        flipped[HEADER_LEN + 3] ^= 1;
        assert_eq!(open_rkey(&flipped), Err(EnvelopeError::Checksum));
        let empty = seal(EnvelopeKind::RemoteKey, V, "", &[]);
        assert_eq!(open_rkey(&empty), Err(EnvelopeError::PayloadSize(0)));
    }

    #[test]
    fn another_ucx_release_is_named() {
        let theirs = Version {
            major: 1,
            minor: 22,
            release: 0,
        };
        let bytes = seal(EnvelopeKind::WorkerAddress, theirs, "x", b"a");
        let e = open(EnvelopeKind::WorkerAddress, V, &bytes).expect_err("refused");
        assert_eq!(
            e,
            EnvelopeError::UcxVersion {
                peer: theirs,
                ours: V
            }
        );
        assert!(e.to_string().contains("1.22.0"), "{e}");
    }

    #[test]
    fn a_long_label_is_cut_at_a_character_boundary() {
        let label = "é".repeat(200); // 400 bytes
        let bytes = seal(EnvelopeKind::WorkerAddress, V, &label, b"a");
        let opened = open(EnvelopeKind::WorkerAddress, V, &bytes).expect("opens");
        assert_eq!(opened.label.len(), 254);
        assert!(std::str::from_utf8(opened.label).is_ok());
    }
}
