//! What crosses the wire about a transport is opaque to everything but that transport: a
//! buffer it makes readable for a pull or lends for a push ([`Descriptor`]), what a node
//! says of it in its hello ([`Announce`]), and its own control messages
//! ([`TransportMessage`]). Each is an rkyv archive of a type of the transport's own, which
//! it validates when it reads one ([`Descriptor::decode`], [`decode`]): the session and the
//! shell carry the bytes and never look inside.

use rkyv::{Archive, Deserialize, Serialize};

use crate::wire::WireTransport;

/// Bytes one transport reads: an rkyv archive of a type of its own (ipc's pool export, a
/// UCX address and remote key), validated by that transport before it is trusted.
#[derive(Archive, Serialize, Deserialize, Clone, PartialEq, Eq, Hash, Default)]
#[rkyv(derive(Debug))]
pub struct Descriptor(pub Vec<u8>);

impl std::fmt::Debug for Descriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Descriptor({} bytes)", self.0.len())
    }
}

impl Descriptor {
    /// The descriptor of `value`.
    ///
    /// # Errors
    /// rkyv's, when `value` cannot be archived (it does not fail for the plain structs
    /// transports describe buffers with).
    pub fn encode<T>(value: &T) -> Result<Self, DescriptorError>
    where
        T: for<'a> Serialize<
            rkyv::api::high::HighSerializer<
                rkyv::util::AlignedVec,
                rkyv::ser::allocator::ArenaHandle<'a>,
                rkyv::rancor::Error,
            >,
        >,
    {
        encode(value).map(Self)
    }

    /// The value this descriptor holds, validated first (a peer wrote it).
    ///
    /// # Errors
    /// Why the bytes are not a `T`.
    pub fn decode<T>(&self) -> Result<T, DescriptorError>
    where
        T: Archive,
        T::Archived: for<'a> rkyv::bytecheck::CheckBytes<
                rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>,
            > + Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
    {
        decode(&self.0)
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// What a node says of one transport it serves, in its hello: what a peer needs to reach
/// it there (ucx: its worker address; tcp: the eager credit it grants), in the
/// transport's own terms (`terms` may be empty).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Announce {
    /// The transport.
    pub transport: WireTransport,
    /// Its announcement: bytes only it reads.
    pub terms: Vec<u8>,
}

impl Announce {
    /// `transport` served, with nothing more to say of it.
    pub fn bare(transport: ferry_config::TransportName) -> Self {
        Self {
            transport: transport.into(),
            terms: Vec::new(),
        }
    }
}

/// A control message of one transport (ipc's setup steps and unmap requests, staged's
/// ring): the shell hands `body` to that transport's part of the session.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct TransportMessage {
    /// Whose message it is.
    pub transport: WireTransport,
    /// The message, in that transport's own terms.
    pub body: Vec<u8>,
}

/// A descriptor, announcement or message that is not what its transport reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DescriptorError(pub String);

/// The archive of `value`, as [`Descriptor::encode`] makes it (for announcements and
/// messages too).
///
/// # Errors
/// rkyv's.
pub fn encode<T>(value: &T) -> Result<Vec<u8>, DescriptorError>
where
    T: for<'a> Serialize<
        rkyv::api::high::HighSerializer<
            rkyv::util::AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rkyv::rancor::Error,
        >,
    >,
{
    rkyv::to_bytes::<rkyv::rancor::Error>(value)
        .map(|b| b.to_vec())
        .map_err(|e| DescriptorError(format!("cannot encode: {e}")))
}

/// The value archived in `bytes`, validated first (a peer wrote them).
///
/// # Errors
/// Why the bytes are not a `T`.
pub fn decode<T>(bytes: &[u8]) -> Result<T, DescriptorError>
where
    T: Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
        + Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
{
    // rkyv reads archives in place, which needs them aligned; a descriptor arrives at any
    // offset of its frame.
    let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    rkyv::from_bytes::<T, rkyv::rancor::Error>(&aligned)
        .map_err(|e| DescriptorError(format!("not a valid {}: {e}", short_name::<T>())))
}

/// `T`'s name without its module path.
fn short_name<T>() -> &'static str {
    let name = std::any::type_name::<T>();
    name.rsplit("::").next().unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
    #[rkyv(derive(Debug))]
    struct Sample {
        address: u64,
        key: Vec<u8>,
        name: String,
    }

    #[test]
    fn a_descriptor_decodes_to_what_was_encoded() {
        let sample = Sample {
            address: 0xdead_beef,
            key: vec![1, 2, 3],
            name: "GPU-1234".into(),
        };
        let d = Descriptor::encode(&sample).expect("encodes");
        assert_eq!(d.decode::<Sample>().expect("decodes"), sample);
    }

    /// Bytes from a peer are hostile: a truncated or flipped descriptor is an error, never
    /// a panic, and names the type it was read as.
    #[test]
    fn a_damaged_descriptor_is_refused() {
        let sample = Sample {
            address: 7,
            key: vec![9; 40],
            name: "x".repeat(30),
        };
        let bytes = Descriptor::encode(&sample).expect("encodes").0;
        for cut in 0..bytes.len() {
            let _ = decode::<Sample>(&bytes[..cut]);
        }
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut flipped = bytes.clone();
                flipped[i] ^= 1 << bit;
                let _ = decode::<Sample>(&flipped);
            }
        }
        let err = decode::<Sample>(&[1, 2, 3]).expect_err("too short");
        assert!(err.0.contains("Sample"), "{err}");
    }
}
