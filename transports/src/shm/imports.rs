//! A same-host peer's pool as this node maps it: the segments its descriptors name, each
//! fetched once over the peer's fd-sharing socket and mapped once, kept until the session
//! ends. Every descriptor is checked against what the peer announced and what was mapped
//! before a byte is touched.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::segment::Segment;
use super::wire::segment_key;
use super::{ShmError, ShmSource};
use crate::link::Secret;

/// The most segments of one peer this node maps (a hostile peer cannot make it map
/// without end).
pub const MAPPED_SEGMENTS_MAX: usize = 4096;
/// The largest segment of a peer this node maps (`transport.shm.segment_size`'s bound).
pub const SEGMENT_MAX: u64 = 1 << 40;

/// One peer's pool, mapped segment by segment as its descriptors name them.
pub struct PeerPool {
    peer: String,
    pid: u32,
    secret: Secret,
    /// The pool the peer's hello announced.
    pool: [u8; 16],
    segments: Mutex<HashMap<u32, Arc<Segment>>>,
    /// One fetch at a time (two pulls from a new segment map it once).
    fetching: tokio::sync::Mutex<()>,
}

impl PeerPool {
    /// The pool `pool` of `peer` (process `pid`), none of it mapped yet.
    pub fn new(peer: &str, pid: u32, secret: Secret, pool: [u8; 16]) -> Self {
        Self {
            peer: peer.to_owned(),
            pid,
            secret,
            pool,
            segments: Mutex::default(),
            fetching: tokio::sync::Mutex::new(()),
        }
    }

    /// The pool's id.
    pub fn id(&self) -> &[u8; 16] {
        &self.pool
    }

    fn mapped(&self, source: &ShmSource) -> Result<Option<Arc<Segment>>, ShmError> {
        let segments = self.segments.lock().unwrap_or_else(|p| p.into_inner());
        match segments.get(&source.segment) {
            Some(s) if s.len() as u64 == source.segment_len => Ok(Some(Arc::clone(s))),
            Some(s) => Err(ShmError::Stale(format!(
                "segment {} of {} bytes, mapped at {} bytes",
                source.segment,
                source.segment_len,
                s.len()
            ))),
            None if segments.len() >= MAPPED_SEGMENTS_MAX => Err(ShmError::Stale(format!(
                "segment {}: {MAPPED_SEGMENTS_MAX} of the peer's segments are mapped already",
                source.segment
            ))),
            None => Ok(None),
        }
    }

    /// The segment `source` names, its range checked: mapped now if it was before, else
    /// fetched from the peer and mapped (the first time only).
    ///
    /// # Errors
    /// [`ShmError::Stale`] for a pool the peer does not announce or a segment of another
    /// size than mapped; [`ShmError::OutOfRange`] for a range past the segment;
    /// [`ShmError::Fetch`], [`ShmError::Invalid`] when the segment cannot be had.
    ///
    /// # Cancel safety
    /// Dropping it mid-fetch maps nothing; a later call fetches again.
    pub async fn segment(&self, source: &ShmSource) -> Result<Arc<Segment>, ShmError> {
        let segment = match self.check_pool(source).and_then(|()| self.mapped(source))? {
            Some(segment) => segment,
            None => self.fetch(source).await?,
        };
        Self::check_range(&segment, source)?;
        Ok(segment)
    }

    /// The segment `source` names, if it is mapped already: no wait. `Ok(None)`: it must be
    /// fetched ([`Self::segment`]).
    ///
    /// # Errors
    /// As [`Self::segment`], but never a fetch's.
    pub fn segment_now(&self, source: &ShmSource) -> Result<Option<Arc<Segment>>, ShmError> {
        self.check_pool(source)?;
        let Some(segment) = self.mapped(source)? else {
            return Ok(None);
        };
        Self::check_range(&segment, source)?;
        Ok(Some(segment))
    }

    fn check_pool(&self, source: &ShmSource) -> Result<(), ShmError> {
        if source.pool != self.pool {
            return Err(ShmError::Stale(format!(
                "it names pool {:032x}; the peer announced pool {:032x}",
                u128::from_le_bytes(source.pool),
                u128::from_le_bytes(self.pool)
            )));
        }
        if source.segment_len > SEGMENT_MAX {
            return Err(ShmError::Stale(format!(
                "a segment of {} bytes, past the largest there is",
                source.segment_len
            )));
        }
        Ok(())
    }

    fn check_range(segment: &Segment, source: &ShmSource) -> Result<(), ShmError> {
        let inside = usize::try_from(source.offset)
            .ok()
            .zip(usize::try_from(source.len).ok())
            .is_some_and(|(offset, len)| segment.holds(offset, len));
        if inside {
            Ok(())
        } else {
            Err(ShmError::OutOfRange {
                offset: source.offset,
                len: source.len,
                segment: segment.len() as u64,
            })
        }
    }

    async fn fetch(&self, source: &ShmSource) -> Result<Arc<Segment>, ShmError> {
        let _one = self.fetching.lock().await;
        if let Some(segment) = self.mapped(source)? {
            return Ok(segment);
        }
        let key = segment_key(&self.pool, source.segment);
        let fd = crate::fdshare::fetch(&self.peer, self.pid, &key, &self.secret).await?;
        let len = usize::try_from(source.segment_len)
            .map_err(|_| ShmError::Stale(format!("{} bytes", source.segment_len)))?;
        let segment = Arc::new(Segment::open(fd, len)?);
        tracing::debug!(peer = %self.peer, segment = source.segment, bytes = len, "mapped a segment of the peer's pool");
        self.segments
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(source.segment, Arc::clone(&segment));
        Ok(segment)
    }
}
