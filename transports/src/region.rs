//! Receive regions shared by the transports: where the chunks of a streamed transfer land
//! ([`InboundRegion`], lent out one chunk at a time as a [`Landing`]), regions exposed for
//! one-sided puts ([`ExposedRegion`], named by a [`RegionKey`]), and how a payload is cut
//! into chunks. The tcp transport's reader and the staged transport's ring receiver both
//! land chunks here.

use std::ops::Range;

use dashmap::DashMap;

use crate::memory::Buffer;
use crate::wire::{DataChunk, PutChunk};

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

impl RegionKey {
    /// Its bytes on the wire or in a file: 24 bytes, little endian (region, generation,
    /// length).
    pub fn to_bytes(&self) -> [u8; 24] {
        let mut bytes = [0; 24];
        bytes[..8].copy_from_slice(&self.region.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.generation.to_le_bytes());
        bytes[16..].copy_from_slice(&self.len.to_le_bytes());
        bytes
    }

    /// A key from [`Self::to_bytes`]'s bytes; `None` unless there are exactly 24.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let word = |i: usize| {
            let at = bytes.get(i * 8..i * 8 + 8)?;
            Some(u64::from_le_bytes(at.try_into().ok()?))
        };
        (bytes.len() == 24).then_some(())?;
        Some(Self {
            region: word(0)?,
            generation: word(1)?,
            len: word(2)?,
        })
    }
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
    /// The buffer is lent out for another chunk, or a view of it is still alive.
    #[error("the receive buffer is busy with another chunk")]
    Busy,
    /// A data chunk does not start where the transfer's bytes so far end: chunks of a
    /// transfer arrive in order, each once, so that a completed buffer holds only bytes the
    /// peer sent (the peer misbehaved).
    #[error("chunk at offset {offset} where the transfer's next byte is {expected}")]
    OutOfOrder {
        /// Chunk offset.
        offset: u64,
        /// The offset the next chunk must start at.
        expected: u64,
    },
    /// No region of that id is exposed (withdrawn, or never exposed).
    #[error("region {0} is not exposed")]
    NotExposed(u64),
}

/// A receive buffer being filled by data chunks.
///
/// Chunks arrive in order, each starting where the one before ended, so a region that
/// completes has had every byte written by the peer: its buffer may start with any
/// contents (recycled memory, not zeroed). The reader fills it one chunk at a time without holding the map it lives in locked
/// across a socket read: [`InboundRegion::lend`] checks the chunk and lends the buffer out
/// as a [`Landing`], the payload is read into [`Landing::destination`], and
/// [`InboundRegion::restore`] takes the buffer back. If the region was dropped meanwhile (the
/// transfer was abandoned), dropping the landing releases the memory instead.
#[derive(Debug)]
pub struct InboundRegion {
    /// `None` while lent out as a [`Landing`].
    buffer: Option<Buffer>,
    received: u64,
}

impl InboundRegion {
    /// Starts filling `buffer`.
    pub fn new(buffer: Buffer) -> Self {
        Self {
            buffer: Some(buffer),
            received: 0,
        }
    }

    /// Checks that `chunk` lies within the buffer and lends the buffer out for its bytes to
    /// be written; give it back with [`InboundRegion::restore`].
    ///
    /// Fails with [`PlaceError::OutOfBounds`] when the chunk overruns the buffer and
    /// [`PlaceError::OutOfOrder`] when it does not start where the bytes so far end (the
    /// peer misbehaved either way), and [`PlaceError::Busy`] when the buffer is already
    /// lent out or not writable. Device memory is lent too: its bytes go in through
    /// [`Landing::write`].
    pub fn lend(&mut self, chunk: &DataChunk) -> Result<Landing, PlaceError> {
        let Some(buffer) = self.buffer.as_mut() else {
            return Err(PlaceError::Busy);
        };
        let range = checked_range(buffer, chunk.offset, u64::from(chunk.len))?;
        if chunk.offset != self.received {
            return Err(PlaceError::OutOfOrder {
                offset: chunk.offset,
                expected: self.received,
            });
        }
        if !buffer.is_exclusive() {
            return Err(PlaceError::Busy);
        }
        let buffer = self.buffer.take().ok_or(PlaceError::Busy)?;
        Ok(Landing { buffer, range })
    }

    /// Takes back the buffer lent for one chunk whose bytes all arrived; returns true when
    /// every byte of the transfer has.
    pub fn restore(&mut self, landing: Landing) -> bool {
        self.received += landing.range.len() as u64;
        let capacity = landing.buffer.len() as u64;
        self.buffer = Some(landing.buffer);
        self.received >= capacity
    }

    /// Bytes placed so far (chunks lent out and not yet restored are not counted).
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The buffer, once filled (or abandoned); `None` while it is lent out.
    pub fn into_buffer(self) -> Option<Buffer> {
        self.buffer
    }
}

/// A receive buffer lent out of its [`InboundRegion`] for one chunk's bytes to be written.
/// Dropping it releases the buffer's memory.
#[derive(Debug)]
pub struct Landing {
    buffer: Buffer,
    range: Range<usize>,
}

impl Landing {
    /// True when the buffer is host memory: the bytes can be read straight into
    /// [`Self::destination`]. Device memory takes them through [`Self::write`].
    pub fn is_host(&self) -> bool {
        self.buffer.as_slice().is_some()
    }

    /// Copies the chunk's bytes (exactly its length) into their place, whatever memory the
    /// buffer lives in (a host-to-device copy, waited for, for device memory).
    ///
    /// # Errors
    /// A length other than the chunk's, or the copy's failure.
    pub fn write(&mut self, bytes: &[u8]) -> Result<(), crate::memory::MemoryError> {
        if bytes.len() != self.range.len() {
            return Err(crate::memory::MemoryError::OutOfBounds {
                offset: self.range.start,
                len: bytes.len(),
                size: self.range.len(),
            });
        }
        self.buffer.write(self.range.start, bytes)
    }

    /// The chunk's place in the buffer: exactly the chunk's length, at its offset; empty
    /// for device memory (see [`Self::is_host`]).
    pub fn destination(&mut self) -> &mut [u8] {
        // `lend` checked the range against the buffer and that the buffer is writable, and
        // the landing owns the buffer, so no view of it can have appeared since.
        match self.buffer.as_mut_slice() {
            Some(bytes) => &mut bytes[self.range.clone()],
            None => &mut [],
        }
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
    /// Where the bytes of `chunk` go in the region, after checking the chunk's generation
    /// and that it lies within the region.
    ///
    /// Fails with [`PlaceError::StaleGeneration`] or [`PlaceError::OutOfBounds`] (also
    /// when the buffer is not writable).
    pub fn destination(&mut self, chunk: &PutChunk) -> Result<&mut [u8], PlaceError> {
        if chunk.generation != self.generation {
            return Err(PlaceError::StaleGeneration {
                region: chunk.region,
                got: chunk.generation,
                current: self.generation,
            });
        }
        let len = u64::from(chunk.len);
        let range = checked_range(&self.buffer, chunk.offset, len)?;
        let capacity = self.buffer.len() as u64;
        let bytes = self.buffer.as_mut_slice().ok_or(PlaceError::OutOfBounds {
            offset: chunk.offset,
            len,
            capacity,
        })?;
        Ok(&mut bytes[range])
    }
}

/// `len` bytes at `offset`, as a range of `buffer`, if they lie within it.
fn checked_range(buffer: &Buffer, offset: u64, len: u64) -> Result<Range<usize>, PlaceError> {
    let capacity = buffer.len() as u64;
    let oob = PlaceError::OutOfBounds {
        offset,
        len,
        capacity,
    };
    let end = offset.checked_add(len).ok_or(oob.clone())?;
    if end > capacity {
        return Err(oob);
    }
    // Both ends are at most the buffer's length, which is a usize.
    Ok(offset as usize..end as usize)
}

/// Gives the buffer lent as `landing` back to inbound transfer `id`'s region in `regions`;
/// returns the buffer, out of the map, once every byte of the transfer is in place. A
/// region abandoned meanwhile is gone from the map: the landing is dropped, which frees the
/// memory.
pub fn restore_landing(
    regions: &DashMap<u64, InboundRegion>,
    id: u64,
    landing: Landing,
) -> Option<Buffer> {
    let complete = regions.get_mut(&id).map(|mut r| r.restore(landing));
    if complete != Some(true) {
        return None;
    }
    regions.remove(&id).and_then(|(_, r)| r.into_buffer())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::memory::{BufferId, Generation, Lease, MemoryKind, Releaser};

    #[derive(Default)]
    struct Released(AtomicU64);
    impl Releaser for Released {
        fn release(&self, lease: &Lease) {
            self.0.fetch_add(lease.len, Ordering::SeqCst);
        }
    }

    fn buffer(len: u64, released: &Arc<Released>) -> Buffer {
        let lease = Lease {
            kind: MemoryKind::Host,
            id: BufferId(1),
            generation: Generation(4),
            len,
        };
        Buffer::new_host(lease, released.clone())
    }

    fn data(offset: u64, len: u32) -> DataChunk {
        DataChunk {
            transfer: 1,
            offset,
            len,
        }
    }

    #[test]
    fn chunks_land_where_they_say_and_complete_the_region() {
        let released = Arc::default();
        let mut region = InboundRegion::new(buffer(10, &released));
        for (offset, bytes) in [(0, &b"012345"[..]), (6, &b"6789"[..])] {
            let chunk = data(offset, bytes.len() as u32);
            let mut landing = match region.lend(&chunk) {
                Ok(l) => l,
                Err(e) => panic!("{e}"),
            };
            assert_eq!(region.lend(&chunk).err(), Some(PlaceError::Busy));
            landing.destination().copy_from_slice(bytes);
            assert_eq!(region.restore(landing), offset == 6);
        }
        let filled = region.into_buffer().map(|b| b.to_vec().expect("host"));
        assert_eq!(filled.as_deref(), Some(&b"0123456789"[..]));
    }

    #[test]
    fn chunks_out_of_order_or_twice_are_refused() {
        let released = Arc::default();
        let mut region = InboundRegion::new(buffer(10, &released));
        assert_eq!(
            region.lend(&data(6, 4)).err(),
            Some(PlaceError::OutOfOrder {
                offset: 6,
                expected: 0
            })
        );
        let landing = region.lend(&data(0, 6)).expect("the first chunk");
        assert!(!region.restore(landing));
        // The same bytes again would complete the count with bytes 6.. never written.
        for (offset, len) in [(0, 6), (2, 4), (8, 2)] {
            assert!(
                matches!(
                    region.lend(&data(offset, len)),
                    Err(PlaceError::OutOfOrder { expected: 6, .. })
                ),
                "{offset}+{len}"
            );
        }
        let landing = region.lend(&data(6, 4)).expect("the next chunk");
        assert!(region.restore(landing));
    }

    #[test]
    fn a_chunk_past_the_end_is_refused_and_a_dropped_landing_frees_memory() {
        let released = Arc::new(Released::default());
        let mut region = InboundRegion::new(buffer(10, &released));
        for chunk in [data(8, 3), data(u64::MAX, 2), data(11, 0)] {
            assert!(matches!(
                region.lend(&chunk),
                Err(PlaceError::OutOfBounds { .. })
            ));
        }
        let landing = region.lend(&data(0, 4));
        assert!(landing.is_ok());
        // The region was abandoned while the landing was out: dropping both frees it.
        drop(region);
        assert_eq!(released.0.load(Ordering::SeqCst), 0);
        drop(landing);
        assert_eq!(released.0.load(Ordering::SeqCst), 10);
    }

    #[test]
    fn a_put_checks_generation_and_bounds() {
        let released = Arc::default();
        let mut region = ExposedRegion {
            buffer: buffer(10, &released),
            generation: 4,
        };
        let put = |generation, offset, len| PutChunk {
            put: 1,
            region: 2,
            generation,
            offset,
            len,
            last: false,
        };
        assert!(matches!(
            region.destination(&put(3, 0, 1)),
            Err(PlaceError::StaleGeneration { got: 3, .. })
        ));
        assert!(matches!(
            region.destination(&put(4, 9, 2)),
            Err(PlaceError::OutOfBounds { .. })
        ));
        match region.destination(&put(4, 7, 3)) {
            Ok(dst) => dst.copy_from_slice(b"abc"),
            Err(e) => panic!("{e}"),
        }
        assert_eq!(&region.buffer.as_slice().expect("host")[7..], b"abc");
    }

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
