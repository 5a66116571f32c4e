//! The importer's cache of legacy CUDA IPC handles: device memory a peer registered with
//! `register_external` (memory that did not come from ferry's exportable pool) crosses as a
//! legacy IPC handle, and opening one costs about a millisecond, so an opened handle is kept
//! for the next transfer of the same allocation. No I/O: the cache never opens or closes a
//! handle itself; it hands the ones to close to the shell through [`HandleCache::poll_close`].
//!
//! Entries are keyed by allocation identity ([`AllocationKey`]: the exporting peer and the
//! buffer id the driver reports for the allocation, `CU_POINTER_ATTRIBUTE_BUFFER_ID`), never
//! by address: the driver reuses freed virtual addresses, and a handle opened for a freed
//! allocation must never serve a new one.
//!
//! Rules:
//! - an entry in use (reference count above zero) is never evicted nor closed;
//! - the cache holds at most `capacity` entries, except that entries in use may push it over;
//!   then every idle entry is evicted (so there are never more than `capacity` idle entries);
//! - when room is needed, the least recently used idle entry goes first;
//! - an invalidated entry (its exporter freed the allocation, or the peer went away) is never
//!   handed out again and is closed as soon as nobody uses it;
//! - every handle given to the cache comes out of `poll_close` exactly once.

use std::collections::{BTreeMap, HashMap};

/// Identifies one exported allocation: the exporting peer and the buffer id its driver
/// reports for the allocation (unique per allocation for the exporter's lifetime).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AllocationKey {
    /// The exporting peer.
    pub peer: String,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID` of the allocation, as the exporter reported it.
    pub buffer_id: u64,
}

impl AllocationKey {
    /// The key of `peer`'s allocation `buffer_id`.
    pub fn new(peer: impl Into<String>, buffer_id: u64) -> Self {
        Self {
            peer: peer.into(),
            buffer_id,
        }
    }
}

/// The answer of [`HandleCache::acquire`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup<H> {
    /// An open handle; the caller now holds one reference and must [`HandleCache::release`]
    /// it when its copy has ended.
    Hit(H),
    /// Not cached: open the handle, then [`HandleCache::insert`] it.
    Miss,
    /// The exporter freed this allocation (or the peer went away): it must not be opened or
    /// used again. The transfer fails.
    Invalidated,
}

/// Why [`HandleCache::insert`] did not cache a handle. The handle itself is queued for
/// closing either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InsertRefused {
    /// The allocation was invalidated while the handle was being opened.
    Invalidated,
}

#[derive(Debug)]
struct Entry<H> {
    handle: H,
    refs: u32,
    /// Set once the exporter freed the allocation; the entry only waits for its last user.
    invalid: bool,
    /// Its position in the idle order while `refs == 0`.
    idle_tick: Option<u64>,
}

/// A bounded LRU cache of opened handles of type `H`, with reference counts.
#[derive(Debug)]
pub struct HandleCache<H> {
    capacity: usize,
    entries: HashMap<AllocationKey, Entry<H>>,
    /// Idle valid entries, least recently used first.
    idle: BTreeMap<u64, AllocationKey>,
    tick: u64,
    to_close: Vec<H>,
}

/// Counters, for tests and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Entries present (in use, idle, or invalidated but still in use).
    pub entries: usize,
    /// Entries nobody uses.
    pub idle: usize,
    /// Entries in use.
    pub in_use: usize,
    /// Handles waiting for the shell to close them.
    pub to_close: usize,
}

impl<H> HandleCache<H> {
    /// An empty cache that keeps at most `capacity` entries (at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            entries: HashMap::new(),
            idle: BTreeMap::new(),
            tick: 0,
            to_close: Vec::new(),
        }
    }

    /// Looks `key` up. On a hit the entry's reference count goes up by one and it becomes
    /// the most recently used.
    pub fn acquire(&mut self, key: &AllocationKey) -> Lookup<H>
    where
        H: Clone,
    {
        let Some(entry) = self.entries.get_mut(key) else {
            return Lookup::Miss;
        };
        if entry.invalid {
            return Lookup::Invalidated;
        }
        if let Some(tick) = entry.idle_tick.take() {
            self.idle.remove(&tick);
        }
        entry.refs += 1;
        Lookup::Hit(entry.handle.clone())
    }

    /// Caches `handle`, just opened for `key` after a [`Lookup::Miss`]; the caller holds one
    /// reference to it. Returns the handle to use: `handle` itself, or the one already cached
    /// when another transfer opened the same allocation first (then `handle` is queued for
    /// closing and the cached one gains the reference). When `key` was invalidated meanwhile,
    /// `handle` is queued for closing and the transfer must fail.
    pub fn insert(&mut self, key: AllocationKey, handle: H) -> Result<H, InsertRefused>
    where
        H: Clone,
    {
        if let Some(existing) = self.entries.get(&key) {
            let invalid = existing.invalid;
            self.to_close.push(handle);
            if invalid {
                return Err(InsertRefused::Invalidated);
            }
            return match self.acquire(&key) {
                Lookup::Hit(h) => Ok(h),
                // Checked above: present and valid.
                Lookup::Miss | Lookup::Invalidated => Err(InsertRefused::Invalidated),
            };
        }
        self.entries.insert(
            key,
            Entry {
                handle: handle.clone(),
                refs: 1,
                invalid: false,
                idle_tick: None,
            },
        );
        self.evict_over_capacity();
        Ok(handle)
    }

    /// Gives back one reference taken by [`acquire`](Self::acquire) or
    /// [`insert`](Self::insert). An invalidated entry is closed when its last reference goes;
    /// a valid one becomes idle (and may be evicted at once if the cache is over capacity).
    /// Returns false (and changes nothing) when `key` holds no reference: a caller bug.
    pub fn release(&mut self, key: &AllocationKey) -> bool {
        let Some(entry) = self.entries.get_mut(key) else {
            return false;
        };
        if entry.refs == 0 {
            return false;
        }
        entry.refs -= 1;
        if entry.refs > 0 {
            return true;
        }
        if entry.invalid {
            self.close(key);
        } else {
            self.tick += 1;
            entry.idle_tick = Some(self.tick);
            self.idle.insert(self.tick, key.clone());
            self.evict_over_capacity();
        }
        true
    }

    /// The exporter freed `key`'s allocation: the entry is never handed out again, and its
    /// handle is closed now if idle, else when its last user releases it. Returns false when
    /// `key` was not cached.
    pub fn invalidate(&mut self, key: &AllocationKey) -> bool {
        let Some(entry) = self.entries.get_mut(key) else {
            return false;
        };
        entry.invalid = true;
        if let Some(tick) = entry.idle_tick.take() {
            self.idle.remove(&tick);
        }
        if entry.refs == 0 {
            self.close(key);
        }
        true
    }

    /// The peer went away: every entry it exported is invalidated. Returns how many.
    pub fn peer_gone(&mut self, peer: &str) -> usize {
        let keys: Vec<AllocationKey> = self
            .entries
            .iter()
            .filter(|(k, e)| k.peer == peer && !e.invalid)
            .map(|(k, _)| k.clone())
            .collect();
        for key in &keys {
            self.invalidate(key);
        }
        keys.len()
    }

    /// The next handle the shell must close (evicted, or invalidated and no longer used).
    pub fn poll_close(&mut self) -> Option<H> {
        if self.to_close.is_empty() {
            None
        } else {
            Some(self.to_close.remove(0))
        }
    }

    /// The counters now.
    pub fn stats(&self) -> CacheStats {
        let in_use = self.entries.values().filter(|e| e.refs > 0).count();
        CacheStats {
            entries: self.entries.len(),
            idle: self.idle.len(),
            in_use,
            to_close: self.to_close.len(),
        }
    }

    /// The most entries kept when none is in use.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Evicts least recently used idle entries while the cache holds more than `capacity`.
    fn evict_over_capacity(&mut self) {
        while self.entries.len() > self.capacity {
            let Some((_, key)) = self.idle.pop_first() else {
                return;
            };
            if let Some(entry) = self.entries.get_mut(&key) {
                entry.idle_tick = None;
            }
            self.close(&key);
        }
    }

    fn close(&mut self, key: &AllocationKey) {
        if let Some(entry) = self.entries.remove(key) {
            self.to_close.push(entry.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(peer: &str, id: u64) -> AllocationKey {
        AllocationKey::new(peer, id)
    }

    fn drain(c: &mut HandleCache<u32>) -> Vec<u32> {
        std::iter::from_fn(|| c.poll_close()).collect()
    }

    #[test]
    fn miss_insert_hit_release() {
        let mut c = HandleCache::new(2);
        assert_eq!(c.acquire(&key("a", 1)), Lookup::Miss);
        assert_eq!(c.insert(key("a", 1), 10), Ok(10));
        assert_eq!(c.acquire(&key("a", 1)), Lookup::Hit(10));
        assert!(c.release(&key("a", 1)));
        assert!(c.release(&key("a", 1)));
        assert!(!c.release(&key("a", 1)), "no reference left");
        assert!(!c.release(&key("a", 2)), "never cached");
        assert_eq!(c.stats().idle, 1);
        assert_eq!(c.acquire(&key("a", 1)), Lookup::Hit(10));
        assert!(drain(&mut c).is_empty());
    }

    #[test]
    fn the_same_buffer_id_of_another_peer_is_another_allocation() {
        let mut c = HandleCache::new(4);
        c.insert(key("a", 1), 10).ok();
        assert_eq!(c.acquire(&key("b", 1)), Lookup::Miss);
    }

    #[test]
    fn evicts_the_least_recently_used_idle_entry() {
        let mut c = HandleCache::new(2);
        c.insert(key("a", 1), 10).ok();
        c.insert(key("a", 2), 20).ok();
        c.release(&key("a", 1));
        c.release(&key("a", 2));
        // Touch 1: now 2 is the least recently used.
        assert_eq!(c.acquire(&key("a", 1)), Lookup::Hit(10));
        c.release(&key("a", 1));
        c.insert(key("a", 3), 30).ok();
        assert_eq!(drain(&mut c), [20]);
        assert_eq!(c.acquire(&key("a", 2)), Lookup::Miss);
        assert_eq!(c.stats().entries, 2);
    }

    #[test]
    fn entries_in_use_are_never_evicted() {
        let mut c = HandleCache::new(1);
        c.insert(key("a", 1), 10).ok();
        c.insert(key("a", 2), 20).ok();
        assert!(drain(&mut c).is_empty(), "both in use");
        assert_eq!(c.stats().entries, 2);
        // Releasing one while over capacity evicts it at once.
        c.release(&key("a", 1));
        assert_eq!(drain(&mut c), [10]);
        c.release(&key("a", 2));
        assert!(drain(&mut c).is_empty());
        assert_eq!(c.stats().idle, 1);
    }

    #[test]
    fn invalidated_in_use_is_closed_at_its_last_release_and_never_handed_out() {
        let mut c = HandleCache::new(4);
        c.insert(key("a", 1), 10).ok();
        assert_eq!(c.acquire(&key("a", 1)), Lookup::Hit(10));
        assert!(c.invalidate(&key("a", 1)));
        assert_eq!(c.acquire(&key("a", 1)), Lookup::Invalidated);
        assert_eq!(c.insert(key("a", 1), 11), Err(InsertRefused::Invalidated));
        assert_eq!(drain(&mut c), [11], "the refused handle is closed");
        c.release(&key("a", 1));
        assert!(drain(&mut c).is_empty(), "one user left");
        c.release(&key("a", 1));
        assert_eq!(drain(&mut c), [10]);
        assert!(!c.invalidate(&key("a", 1)));
    }

    #[test]
    fn invalidated_idle_is_closed_at_once() {
        let mut c = HandleCache::new(4);
        c.insert(key("a", 1), 10).ok();
        c.release(&key("a", 1));
        c.invalidate(&key("a", 1));
        assert_eq!(drain(&mut c), [10]);
        assert_eq!(c.stats(), CacheStats::default());
    }

    #[test]
    fn a_second_import_of_the_same_allocation_is_closed() {
        let mut c = HandleCache::new(4);
        assert_eq!(c.acquire(&key("a", 1)), Lookup::Miss);
        assert_eq!(c.acquire(&key("a", 1)), Lookup::Miss);
        assert_eq!(c.insert(key("a", 1), 10), Ok(10));
        assert_eq!(c.insert(key("a", 1), 11), Ok(10), "the first one wins");
        assert_eq!(drain(&mut c), [11]);
        assert!(c.release(&key("a", 1)) && c.release(&key("a", 1)));
        assert_eq!(c.stats().idle, 1);
    }

    #[test]
    fn peer_gone_invalidates_only_that_peers_entries() {
        let mut c = HandleCache::new(8);
        c.insert(key("a", 1), 10).ok();
        c.insert(key("a", 2), 20).ok();
        c.insert(key("b", 1), 30).ok();
        c.release(&key("a", 1));
        assert_eq!(c.peer_gone("a"), 2);
        assert_eq!(drain(&mut c), [10]);
        assert_eq!(c.acquire(&key("a", 2)), Lookup::Invalidated);
        assert_eq!(c.acquire(&key("b", 1)), Lookup::Hit(30));
        c.release(&key("a", 2));
        assert_eq!(drain(&mut c), [20]);
        assert_eq!(c.peer_gone("a"), 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Use(u8, u8),
        Release(u8, u8),
        Invalidate(u8, u8),
        PeerGone(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        let k = (0u8..2, 0u8..6);
        prop_oneof![
            4 => k.clone().prop_map(|(p, b)| Op::Use(p, b)),
            4 => k.clone().prop_map(|(p, b)| Op::Release(p, b)),
            1 => k.prop_map(|(p, b)| Op::Invalidate(p, b)),
            1 => (0u8..2).prop_map(Op::PeerGone),
        ]
    }

    proptest! {
        #[test]
        fn invariants_hold(capacity in 1usize..4, ops in prop::collection::vec(op(), 0..80)) {
            let mut c = HandleCache::<u32>::new(capacity);
            let mut next = 0u32;
            // Per handle: inserted, closed, still referenced by the model's users.
            let mut inserted = Vec::new();
            let mut closed = std::collections::HashSet::new();
            // Model of who holds what: key -> handles held (one per reference).
            let mut held: HashMap<AllocationKey, Vec<u32>> = HashMap::new();
            // Handles of invalidated or closed entries: never to be handed out again.
            let mut dead = std::collections::HashSet::new();
            let k = |p: u8, b: u8| key(["a", "b"][p as usize], b as u64);
            let take_closed = |c: &mut HandleCache<u32>, closed: &mut std::collections::HashSet<u32>,
                               dead: &mut std::collections::HashSet<u32>,
                               held: &HashMap<AllocationKey, Vec<u32>>| -> Result<(), TestCaseError> {
                while let Some(h) = c.poll_close() {
                    prop_assert!(closed.insert(h), "handle {h} closed twice");
                    prop_assert!(!held.values().flatten().any(|&x| x == h), "closed {h} while in use");
                    dead.insert(h);
                }
                Ok(())
            };
            for op in ops {
                match op {
                    Op::Use(p, b) => match c.acquire(&k(p, b)) {
                        Lookup::Hit(h) => {
                            prop_assert!(!dead.contains(&h), "dead handle {h} handed out");
                            held.entry(k(p, b)).or_default().push(h);
                        }
                        Lookup::Miss => {
                            next += 1;
                            inserted.push(next);
                            if let Ok(h) = c.insert(k(p, b), next) {
                                prop_assert!(!dead.contains(&h));
                                held.entry(k(p, b)).or_default().push(h);
                            }
                        }
                        Lookup::Invalidated => {}
                    },
                    Op::Release(p, b) => {
                        let had = held.get_mut(&k(p, b)).and_then(|v| v.pop()).is_some();
                        prop_assert_eq!(c.release(&k(p, b)), had);
                    }
                    Op::Invalidate(p, b) => {
                        if let Some(h) = held.get(&k(p, b)).and_then(|v| v.first()) {
                            dead.insert(*h);
                        }
                        c.invalidate(&k(p, b));
                    }
                    Op::PeerGone(p) => {
                        let peer = ["a", "b"][p as usize];
                        for (key, hs) in &held {
                            if key.peer == peer {
                                dead.extend(hs.iter().copied());
                            }
                        }
                        c.peer_gone(peer);
                    }
                }
                take_closed(&mut c, &mut closed, &mut dead, &held)?;
                let s = c.stats();
                let in_use = held.values().filter(|v| !v.is_empty()).count();
                prop_assert_eq!(s.in_use, in_use);
                prop_assert!(s.idle <= capacity, "{s:?}");
                prop_assert!(s.entries <= capacity || s.idle == 0, "{s:?}");
            }
            // Release everything, then invalidate everything: every handle closes exactly once.
            for (key, hs) in held.drain() {
                for _ in hs {
                    prop_assert!(c.release(&key));
                }
            }
            for p in ["a", "b"] {
                c.peer_gone(p);
            }
            take_closed(&mut c, &mut closed, &mut dead, &held)?;
            prop_assert_eq!(c.stats(), CacheStats::default());
            prop_assert_eq!(closed.len(), inserted.len());
        }
    }
}
