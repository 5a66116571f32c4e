//! Remote keys: the checked bytes callers hold ([`RemoteKey`]) and each peer's bounded
//! cache of unpacked keys ([`RkeyCache`]).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use ucx_sys::Version;

use super::envelope::{self, EnvelopeKind};
use super::error::UcxTransportError;

/// A peer's packed remote key, as its [`super::Registration::rkey`] returned it, checked
/// and ready for [`super::UcxPeer::get`] and [`super::UcxPeer::put`]. Cheap to clone (the
/// bytes are shared).
///
/// Each peer unpacks a key once and caches the result, keyed by these bytes; see
/// [`super::UcxPeer::forget_rkey`].
#[derive(Debug, Clone)]
pub struct RemoteKey {
    bytes: Arc<[u8]>,
    crc: u32,
}

impl RemoteKey {
    /// Checks `bytes` (a peer's [`super::Registration::rkey`], received over ferry's link)
    /// against this process's UCX release. Empty bytes are the key of a zero-length
    /// registration: it allows only zero-length operations.
    ///
    /// # Errors
    ///
    /// [`UcxTransportError::InvalidRkey`] when the bytes are not a key packed by a ferry
    /// engine on the same UCX release (garbage, truncated, corrupted, other release).
    pub fn new(ucx: Version, bytes: impl Into<Arc<[u8]>>) -> Result<Self, UcxTransportError> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Ok(Self { bytes, crc: 0 });
        }
        let crc = envelope::open(EnvelopeKind::RemoteKey, ucx, &bytes)
            .map_err(UcxTransportError::InvalidRkey)?
            .crc;
        Ok(Self { bytes, crc })
    }

    /// The bytes, envelope included.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Whether this is the key of a zero-length registration (it covers no bytes).
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// UCX's packed key inside the envelope (checked in [`RemoteKey::new`]).
    pub(crate) fn payload(&self) -> &[u8] {
        let label = self.bytes.get(10).map_or(0, |&l| usize::from(l));
        self.bytes
            .get(envelope::HEADER_LEN + label..)
            .unwrap_or_default()
    }
}

impl PartialEq for RemoteKey {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.bytes, &other.bytes) || self.bytes == other.bytes
    }
}

impl Eq for RemoteKey {}

impl Hash for RemoteKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The CRC32C of the whole envelope, computed once in `new`: equal bytes, equal CRC.
        self.crc.hash(state);
    }
}

/// A number for one cached (or retired) unpacked key of a peer.
pub(crate) type RkeyId = u64;

/// One peer's unpacked remote keys `H`, keyed by their packed bytes, with at most
/// `capacity` cached. The cache does not call UCX: it hands back the handles to destroy,
/// and the progress thread destroys them. A key is destroyed only when no operation uses
/// it: one evicted or forgotten while in use is *retired* (no longer found by
/// [`RkeyCache::lookup`]) and handed back by the last [`RkeyCache::release`].
#[derive(Debug)]
pub(crate) struct RkeyCache<H> {
    capacity: usize,
    clock: u64,
    next_id: RkeyId,
    by_key: HashMap<RemoteKey, RkeyId>,
    entries: HashMap<RkeyId, Entry<H>>,
}

#[derive(Debug)]
struct Entry<H> {
    handle: H,
    /// Operations in flight that use the key.
    users: u32,
    last_used: u64,
    /// `None` once retired.
    key: Option<RemoteKey>,
}

impl<H: Copy> RkeyCache<H> {
    /// An empty cache of at most `capacity` keys (at least 1).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            clock: 0,
            next_id: 0,
            by_key: HashMap::new(),
            entries: HashMap::new(),
        }
    }

    /// The cached key for `key`, counted as used by one more operation.
    pub(crate) fn lookup(&mut self, key: &RemoteKey) -> Option<(RkeyId, H)> {
        let id = *self.by_key.get(key)?;
        self.clock += 1;
        let entry = self.entries.get_mut(&id)?;
        entry.users += 1;
        entry.last_used = self.clock;
        Some((id, entry.handle))
    }

    /// Caches `handle`, just unpacked from `key`, counted as used by one operation.
    /// Returns its id and the handles to destroy now (an evicted key nobody uses).
    pub(crate) fn insert(&mut self, key: RemoteKey, handle: H) -> (RkeyId, Option<H>) {
        let mut destroy = None;
        if self.by_key.len() >= self.capacity {
            let oldest = self
                .by_key
                .values()
                .copied()
                .min_by_key(|id| self.entries.get(id).map_or(0, |e| e.last_used));
            if let Some(id) = oldest {
                destroy = self.retire(id);
            }
        }
        self.clock += 1;
        let id = self.next_id;
        self.next_id += 1;
        self.by_key.insert(key.clone(), id);
        self.entries.insert(
            id,
            Entry {
                handle,
                users: 1,
                last_used: self.clock,
                key: Some(key),
            },
        );
        (id, destroy)
    }

    /// One operation using key `id` completed. Returns the handle to destroy if the key
    /// was retired and this was its last user.
    pub(crate) fn release(&mut self, id: RkeyId) -> Option<H> {
        let entry = self.entries.get_mut(&id)?;
        entry.users = entry.users.saturating_sub(1);
        if entry.users == 0 && entry.key.is_none() {
            return self.entries.remove(&id).map(|e| e.handle);
        }
        None
    }

    /// Drops `key` from the cache (the peer's registration went away). Returns the handle
    /// to destroy now, or `None` if the key was not cached or is still in use (then the
    /// last [`RkeyCache::release`] returns it).
    pub(crate) fn forget(&mut self, key: &RemoteKey) -> Option<H> {
        let id = self.by_key.get(key).copied()?;
        self.retire(id)
    }

    /// Every handle, cached or retired, leaving the cache empty: for closing the peer,
    /// once no operation is in flight.
    pub(crate) fn drain(&mut self) -> Vec<H> {
        self.by_key.clear();
        self.entries.drain().map(|(_, e)| e.handle).collect()
    }

    /// How many keys are cached (retired ones not counted).
    #[cfg(test)]
    pub(crate) fn cached(&self) -> usize {
        self.by_key.len()
    }

    fn retire(&mut self, id: RkeyId) -> Option<H> {
        let entry = self.entries.get_mut(&id)?;
        if let Some(key) = entry.key.take() {
            self.by_key.remove(&key);
        }
        if entry.users == 0 {
            return self.entries.remove(&id).map(|e| e.handle);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: Version = Version {
        major: 1,
        minor: 13,
        release: 1,
    };

    fn key(n: u8) -> RemoteKey {
        RemoteKey::new(V, envelope::seal(EnvelopeKind::RemoteKey, V, "", &[n; 16]))
            .expect("a sealed key")
    }

    #[test]
    fn a_key_is_unpacked_once_and_found_again() {
        let mut cache = RkeyCache::<u32>::new(4);
        assert_eq!(cache.lookup(&key(1)), None);
        let (id, destroy) = cache.insert(key(1), 100);
        assert_eq!(destroy, None);
        assert_eq!(cache.lookup(&key(1)), Some((id, 100)));
        assert_eq!(key(1).payload(), &[1; 16]);
    }

    #[test]
    fn the_least_recently_used_key_makes_room_once_unused() {
        let mut cache = RkeyCache::<u32>::new(2);
        let (a, _) = cache.insert(key(1), 1);
        let (b, _) = cache.insert(key(2), 2);
        assert_eq!(cache.release(a), None);
        assert_eq!(cache.release(b), None);
        assert!(cache.lookup(&key(2)).is_some()); // 1 is now the least recently used
        let (_, destroy) = cache.insert(key(3), 3);
        assert_eq!(destroy, Some(1));
        assert_eq!(cache.cached(), 2);
        assert_eq!(cache.lookup(&key(1)), None);
    }

    #[test]
    fn a_key_in_use_is_destroyed_by_its_last_user() {
        let mut cache = RkeyCache::<u32>::new(1);
        let (a, _) = cache.insert(key(1), 1); // in use
        let (b, destroy) = cache.insert(key(2), 2); // evicts 1, still in use
        assert_eq!(destroy, None);
        assert_eq!(cache.lookup(&key(1)), None);
        assert_eq!(cache.release(a), Some(1));
        assert_eq!(cache.forget(&key(2)), None); // in use: retired
        assert_eq!(cache.release(b), Some(2));
        assert_eq!(cache.forget(&key(2)), None); // already gone
        assert!(cache.drain().is_empty());
    }

    #[test]
    fn a_forgotten_key_unpacks_again() {
        let mut cache = RkeyCache::<u32>::new(4);
        let (a, _) = cache.insert(key(1), 1);
        cache.release(a);
        assert_eq!(cache.forget(&key(1)), Some(1));
        assert_eq!(cache.lookup(&key(1)), None);
        let (_, _) = cache.insert(key(1), 5);
        assert_eq!(cache.drain(), vec![5]);
    }

    #[test]
    fn keys_compare_by_bytes() {
        assert_eq!(key(1), key(1));
        assert_ne!(key(1), key(2));
        assert!(RemoteKey::new(V, Vec::new()).expect("empty").is_empty());
        assert!(RemoteKey::new(V, vec![1, 2, 3]).is_err());
    }
}
