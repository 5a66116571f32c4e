//! The tcp transport: host buffers streamed over a control link in chunks.
//!
//! The receiver reserves memory first (the offer/grant exchange), then the sender streams the
//! buffer as [`DataChunk`] frames of `chunk_size` bytes; the receiver copies each chunk in
//! place from the validated archive into the reserved buffer ([`InboundRegion`]). A one-sided
//! put streams [`PutChunk`] frames into a region the receiver exposed. Chunks travel on the
//! same ordered link as control frames, so a transfer's bytes all precede its completion.

use ferry_config::{Direction, Locality, MemoryClass, TransportName};

use crate::memory::{Buffer, SharedBytes};
use crate::transport::Capabilities;
use crate::wire::{ArchivedDataChunk, ArchivedPutChunk, DataChunk, Message, PutChunk};

/// What the tcp transport can do.
pub fn capabilities() -> Capabilities {
    Capabilities {
        name: TransportName::Tcp,
        memory: &[MemoryClass::Host],
        localities: &[Locality::SameProcess, Locality::SameHost, Locality::Remote],
        directions: &[Direction::Push],
        needs_fd_passing: false,
        one_sided_put: true,
    }
}

/// Splits `len` bytes into `(offset, len)` chunks of at most `chunk` bytes. A zero-length
/// payload still yields one empty chunk, so every transfer carries at least one data frame.
pub fn chunks(len: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    let count = len.div_ceil(chunk).max(1);
    (0..count).map(move |i| {
        let off = i * chunk;
        (off, chunk.min(len - off))
    })
}

/// The data frame for one chunk of an outbound transfer.
pub fn data_message(transfer: u64, bytes: &SharedBytes, offset: usize, len: usize) -> Message {
    Message::Data(DataChunk {
        transfer,
        offset: offset as u64,
        bytes: bytes.as_slice()[offset..offset + len].to_vec(),
    })
}

/// The put frame for one chunk of a one-sided put.
pub fn put_message(
    put: u64,
    key: RegionKey,
    bytes: &SharedBytes,
    region_offset: u64,
    chunk: (usize, usize),
    last: bool,
) -> Message {
    let (offset, len) = chunk;
    Message::Put(PutChunk {
        put,
        region: key.region,
        generation: key.generation,
        offset: region_offset + offset as u64,
        last,
        bytes: bytes.as_slice()[offset..offset + len].to_vec(),
    })
}

/// Names a region exposed for one-sided puts: its id and the generation it was exposed
/// under. A key whose region was withdrawn, or re-exposed since, is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionKey {
    /// The region's id on the exposing node.
    pub region: u64,
    /// The generation the region was exposed under.
    pub generation: u64,
    /// The region's length in bytes.
    pub len: u64,
}

/// Why a chunk could not be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlaceError {
    /// The chunk reaches past the end of the buffer: the peer misbehaved.
    #[error("chunk at offset {offset} of {len} bytes overruns a {capacity}-byte buffer")]
    OutOfBounds {
        /// Chunk offset.
        offset: u64,
        /// Chunk length.
        len: u64,
        /// Buffer length.
        capacity: u64,
    },
    /// The region key's generation is stale.
    #[error("region {region} generation {got} is stale (current {current})")]
    StaleGeneration {
        /// The region.
        region: u64,
        /// Generation in the key.
        got: u64,
        /// The region's current generation.
        current: u64,
    },
}

/// A receive buffer being filled by data chunks.
#[derive(Debug)]
pub struct InboundRegion {
    buffer: Buffer,
    received: u64,
}

impl InboundRegion {
    /// Starts filling `buffer`.
    pub fn new(buffer: Buffer) -> Self {
        Self {
            buffer,
            received: 0,
        }
    }

    /// Copies one validated chunk in place; returns true when every byte has arrived.
    pub fn place(&mut self, chunk: &ArchivedDataChunk) -> Result<bool, PlaceError> {
        let offset = chunk.offset.to_native();
        copy_into(&mut self.buffer, offset, chunk.bytes.as_slice())?;
        self.received += chunk.bytes.len() as u64;
        Ok(self.received >= self.buffer.len() as u64)
    }

    /// The buffer, once filled (or abandoned).
    pub fn into_buffer(self) -> Buffer {
        self.buffer
    }
}

/// A region exposed for one-sided puts.
#[derive(Debug)]
pub struct ExposedRegion {
    /// The buffer receiving puts.
    pub buffer: Buffer,
    /// Its generation; keys must match.
    pub generation: u64,
}

impl ExposedRegion {
    /// Copies one validated put chunk in place.
    pub fn place(&mut self, chunk: &ArchivedPutChunk) -> Result<(), PlaceError> {
        let generation = chunk.generation.to_native();
        if generation != self.generation {
            return Err(PlaceError::StaleGeneration {
                region: chunk.region.to_native(),
                got: generation,
                current: self.generation,
            });
        }
        copy_into(
            &mut self.buffer,
            chunk.offset.to_native(),
            chunk.bytes.as_slice(),
        )
    }
}

fn copy_into(buffer: &mut Buffer, offset: u64, bytes: &[u8]) -> Result<(), PlaceError> {
    let capacity = buffer.len() as u64;
    let len = bytes.len() as u64;
    let oob = PlaceError::OutOfBounds {
        offset,
        len,
        capacity,
    };
    let end = offset.checked_add(len).ok_or(oob.clone())?;
    if end > capacity {
        return Err(oob);
    }
    let dst = buffer.as_mut_slice().ok_or(oob)?;
    // Both bounds were checked against the buffer's length above.
    dst[offset as usize..end as usize].copy_from_slice(bytes);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::chunks;

    #[test]
    fn chunks_cover_exactly() {
        for (len, chunk) in [(0, 4), (1, 4), (4, 4), (5, 4), (1 << 20, 65536), (7, 1)] {
            let parts: Vec<_> = chunks(len, chunk).collect();
            let mut next = 0;
            for (off, n) in &parts {
                assert_eq!(*off, next);
                assert!(*n <= chunk);
                next += n;
            }
            assert_eq!(next, len);
            assert!(!parts.is_empty());
        }
    }
}
