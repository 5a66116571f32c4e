//! The node's pool of shared host memory: segments ([`Segment`]) made as buffers need
//! them, up to `transport.shm.max_bytes`, each cut into ranges by a first-fit allocator
//! with coalescing ([`Ranges`], pure). The host domain takes its memory from it
//! ([`HostSource`]); a range comes back when its buffer drops. Segments are never shrunk
//! nor unmapped while the pool lives: a peer that maps one keeps every page of it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::fdshare::RingDirectory;
use crate::memory::{Fill, HostSource, MappedHost};

use super::segment::{Lent, Segment};
use super::wire::segment_key;

/// Ranges start and end on this many bytes (a cache line): no two buffers share one.
pub const ALIGN: usize = 64;

/// Free ranges of one segment, by offset, each with whether it still holds the zeroes of a
/// fresh segment. Pure bookkeeping: no memory is touched here.
#[derive(Debug, Clone)]
pub struct Ranges {
    len: usize,
    free: BTreeMap<usize, Free>,
}

/// A free range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Free {
    len: usize,
    /// Never written since the segment was made.
    clean: bool,
}

impl Ranges {
    /// A segment of `len` bytes, all free and clean.
    pub fn new(len: usize) -> Self {
        let mut free = BTreeMap::new();
        if len > 0 {
            free.insert(0, Free { len, clean: true });
        }
        Self { len, free }
    }

    /// `len` rounded up to [`ALIGN`] (`None` past the address space).
    pub fn rounded(len: usize) -> Option<usize> {
        len.max(1).checked_next_multiple_of(ALIGN)
    }

    /// The lowest free range of at least `len` bytes (rounded up to [`ALIGN`]): its offset
    /// and whether it is clean (zeroes). `None` when none is large enough.
    pub fn take(&mut self, len: usize) -> Option<(usize, bool)> {
        let len = Self::rounded(len)?;
        let (&at, &found) = self.free.iter().find(|(_, f)| f.len >= len)?;
        self.free.remove(&at);
        if found.len > len {
            let rest = Free {
                len: found.len - len,
                clean: found.clean,
            };
            self.free.insert(at + len, rest);
        }
        Some((at, found.clean))
    }

    /// Gives back `len` bytes (as asked of [`Self::take`]) at `offset`, written: merged
    /// with the free ranges either side.
    pub fn give(&mut self, offset: usize, len: usize) {
        self.give_as(offset, len, false);
    }

    fn give_as(&mut self, offset: usize, len: usize, clean: bool) {
        let Some(len) = Self::rounded(len) else {
            return;
        };
        let (mut start, mut end, mut clean) = (offset, offset.saturating_add(len), clean);
        if let Some((&before, &prev)) = self.free.range(..offset).next_back()
            && before + prev.len == offset
        {
            self.free.remove(&before);
            start = before;
            clean &= prev.clean;
        }
        if let Some(next) = self.free.remove(&end) {
            end += next.len;
            clean &= next.clean;
        }
        let merged = Free {
            len: end - start,
            clean,
        };
        self.free.insert(start, merged);
    }

    /// Takes out the free ranges written since the segment was made (or last released):
    /// while a release gives their pages back, nothing can be granted there. Each comes
    /// back with [`Self::give_clean`] (or [`Self::give`]).
    pub fn take_written(&mut self) -> Vec<(usize, usize)> {
        let written: Vec<(usize, usize)> = (self.free.iter())
            .filter(|(_, f)| !f.clean)
            .map(|(&at, f)| (at, f.len))
            .collect();
        for (at, _) in &written {
            self.free.remove(at);
        }
        written
    }

    /// Gives back `len` bytes at `offset` that read as zeroes (given back to the kernel):
    /// merged with the free ranges either side, clean if they are too.
    pub fn give_clean(&mut self, offset: usize, len: usize) {
        self.give_as(offset, len, true);
    }

    /// Bytes free.
    pub fn free_bytes(&self) -> usize {
        self.free.values().map(|f| f.len).sum()
    }

    /// The segment's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a segment of no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the free ranges are disjoint, inside the segment, and never adjacent (every
    /// give merged what it could). For tests.
    pub fn is_consistent(&self) -> bool {
        let mut end = None;
        for (&at, f) in &self.free {
            if f.len == 0 || at + f.len > self.len || end.is_some_and(|e| e >= at) {
                return false;
            }
            end = Some(at + f.len);
        }
        true
    }
}

/// A segment's number, the segment, and its written free ranges (offset, length).
type Written = (usize, Arc<Segment>, Vec<(usize, usize)>);

/// How large the pool's segments are and how much of them it makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSettings {
    /// Bytes per segment (a larger buffer gets a segment of its own).
    pub segment: usize,
    /// The most bytes of segments.
    pub max: usize,
}

/// The node's pool. Cheap to share (`Arc`); its buffers hold a weak handle to give their
/// ranges back.
pub struct Pool {
    id: [u8; 16],
    settings: PoolSettings,
    state: Mutex<State>,
    /// Where its segments are served to same-host peers (the node's fd-sharing socket),
    /// once a part of a peer's session told the pool.
    served: OnceLock<RingDirectory>,
    me: Weak<Pool>,
}

#[derive(Default)]
struct State {
    segments: Vec<(Arc<Segment>, Ranges)>,
    bytes: usize,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// A range of the pool lent to one host buffer; back to the pool when dropped.
pub struct PoolBytes {
    lent: Lent,
    segment: u32,
    pool: [u8; 16],
    home: Weak<Pool>,
}

impl PoolBytes {
    /// The pool it belongs to.
    pub fn pool(&self) -> &[u8; 16] {
        &self.pool
    }

    /// Its segment's number in the pool.
    pub fn segment(&self) -> u32 {
        self.segment
    }

    /// Where it starts in the segment.
    pub fn offset(&self) -> usize {
        self.lent.offset()
    }

    /// Its segment's length.
    pub fn segment_len(&self) -> usize {
        self.lent.segment().len()
    }
}

impl MappedHost for PoolBytes {
    fn bytes(&self) -> &[u8] {
        self.lent.bytes()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.lent.bytes_mut()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for PoolBytes {
    fn drop(&mut self) {
        if let Some(pool) = self.home.upgrade() {
            pool.give_back(self.segment, self.lent.offset(), self.lent.bytes().len());
        }
    }
}

impl Pool {
    /// An empty pool with a fresh random id.
    pub fn new(settings: PoolSettings) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            id: rand::random(),
            settings,
            state: Mutex::default(),
            served: OnceLock::new(),
            me: me.clone(),
        })
    }

    /// Its id, which the node's hello announces.
    pub fn id(&self) -> &[u8; 16] {
        &self.id
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serves the pool's segments, those made and those to come, in `directory` (the node's
    /// fd-sharing socket). The first directory given stays.
    pub fn serve_in(&self, directory: &RingDirectory) {
        if self.served.set(Arc::clone(directory)).is_err() {
            return;
        }
        // The probe a peer maps in its setup, to know it can map the pool.
        match Segment::create(super::setup::PROBE_LEN) {
            Ok(probe) => {
                directory.insert(super::wire::probe_key(&self.id), Arc::new(probe) as _);
            }
            Err(e) => tracing::warn!("no probe for the shared-memory pool: {e}"),
        }
        for (n, (segment, _)) in self.state().segments.iter().enumerate() {
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            directory.insert(segment_key(&self.id, n), Arc::clone(segment) as _);
        }
    }

    /// Bytes of segments made so far.
    pub fn bytes(&self) -> usize {
        self.state().bytes
    }

    /// `len` bytes (zeroed where `fill` asks), from a segment with room, else from a new
    /// one while the pool may grow; `None` when it may not (or the kernel refused one).
    pub fn take_bytes(&self, len: usize, fill: Fill) -> Option<PoolBytes> {
        let rounded = Ranges::rounded(len)?;
        let mut state = self.state();
        let found = state
            .segments
            .iter_mut()
            .enumerate()
            .find_map(|(n, (segment, ranges))| {
                ranges
                    .take(rounded)
                    .map(|(at, clean)| (n, Arc::clone(segment), at, clean))
            });
        let (n, segment, at, clean) = match found {
            Some(found) => found,
            None => self.grow(&mut state, rounded)?,
        };
        drop(state);
        let mut lent = Lent::new(segment, at, len)?;
        if fill == Fill::Zeroed && !clean {
            lent.bytes_mut().fill(0);
        }
        Some(PoolBytes {
            lent,
            segment: u32::try_from(n).ok()?,
            pool: self.id,
            home: self.me.clone(),
        })
    }

    /// A new segment for a range of `len` bytes, its range taken.
    fn grow(&self, state: &mut State, len: usize) -> Option<(usize, Arc<Segment>, usize, bool)> {
        let size = len
            .max(self.settings.segment)
            .checked_next_multiple_of(1 << 20)?;
        if state.bytes.checked_add(size)? > self.settings.max {
            return None;
        }
        let segment = match Segment::create(size) {
            Ok(segment) => Arc::new(segment),
            Err(e) => {
                tracing::warn!(bytes = size, "no new shared-memory segment: {e}");
                return None;
            }
        };
        let mut ranges = Ranges::new(size);
        let (at, clean) = ranges.take(len)?;
        let n = state.segments.len();
        if let Some(directory) = self.served.get() {
            let key = segment_key(&self.id, u32::try_from(n).ok()?);
            directory.insert(key, Arc::clone(&segment) as _);
        }
        state.segments.push((Arc::clone(&segment), ranges));
        state.bytes += size;
        metrics::gauge!("ferry_shm_pool_bytes").set(state.bytes as f64);
        Some((n, segment, at, clean))
    }

    fn give_back(&self, segment: u32, offset: usize, len: usize) {
        let mut state = self.state();
        if let Some((_, ranges)) = state.segments.get_mut(segment as usize) {
            ranges.give(offset, len);
        }
    }

    /// Gives the pages of every free range back to the kernel (the host domain asks once
    /// no memory went back to it for `memory.keep_idle`): the segments keep their size, so
    /// a peer that maps one still reads zeroes there, never past a mapping. The ranges are
    /// clean again (a zeroed grant need not write them). Returns the bytes given back.
    pub fn release_free(&self) -> usize {
        // Taken out under the lock, given back to the kernel without it (a hole in
        // gigabytes of shared memory takes a while), then put back, clean.
        let taken: Vec<Written> = {
            let mut state = self.state();
            (state.segments.iter_mut().enumerate())
                .map(|(n, (segment, ranges))| (n, Arc::clone(segment), ranges.take_written()))
                .filter(|(_, _, written)| !written.is_empty())
                .collect()
        };
        let mut released = 0;
        let mut back = Vec::with_capacity(taken.len());
        for (n, segment, written) in taken {
            let done: Vec<(usize, usize, bool)> = (written.into_iter())
                .map(|(at, len)| match segment.release(at, len) {
                    Ok(n) => {
                        released += n;
                        (at, len, true)
                    }
                    Err(e) => {
                        tracing::warn!("giving a shared-memory range back failed: {e}");
                        (at, len, false)
                    }
                })
                .collect();
            back.push((n, done));
        }
        let mut state = self.state();
        for (n, done) in back {
            if let Some((_, ranges)) = state.segments.get_mut(n) {
                for (at, len, clean) in done {
                    if clean {
                        ranges.give_clean(at, len);
                    } else {
                        ranges.give(at, len);
                    }
                }
            }
        }
        drop(state);
        if released > 0 {
            metrics::counter!("ferry_shm_released_bytes_total").increment(released as u64);
            tracing::debug!(bytes = released, "gave idle shared-memory pages back");
        }
        released
    }

    /// The pool's memory behind `memory`, if it is this pool's.
    pub fn owns<'a>(&self, memory: &'a dyn MappedHost) -> Option<&'a PoolBytes> {
        let bytes = memory.as_any().downcast_ref::<PoolBytes>()?;
        (bytes.pool == self.id).then_some(bytes)
    }

    /// Bytes free in segment `n` (for tests).
    pub fn free_in(&self, n: usize) -> Option<usize> {
        self.state().segments.get(n).map(|(_, r)| r.free_bytes())
    }
}

impl HostSource for Pool {
    fn trim(&self) {
        self.release_free();
    }

    fn take(&self, len: usize, fill: Fill) -> Option<Box<dyn MappedHost>> {
        // An empty buffer needs no shared memory (and crosses as an empty descriptor).
        if len == 0 {
            return None;
        }
        self.take_bytes(len, fill)
            .map(|b| Box::new(b) as Box<dyn MappedHost>)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::os::fd::AsRawFd;

    const MIB: usize = 1 << 20;

    fn pool(segment: usize, max: usize) -> Arc<Pool> {
        Pool::new(PoolSettings { segment, max })
    }

    #[test]
    fn ranges_coalesce_back_into_one() {
        let mut r = Ranges::new(4096);
        let a = r.take(100).expect("a");
        let b = r.take(64).expect("b");
        let c = r.take(1).expect("c");
        assert_eq!(
            (a.0, b.0, c.0),
            (0, 128, 192),
            "aligned to 64, lowest first"
        );
        assert!(a.1 && b.1 && c.1, "a fresh segment is clean");
        r.give(b.0, 64);
        r.give(a.0, 100);
        assert!(r.is_consistent());
        // The hole of a and b, 192 bytes, is the first fit again, and written.
        assert_eq!(r.take(192), Some((0, false)));
        r.give(0, 192);
        r.give(c.0, 1);
        assert_eq!(r.free_bytes(), 4096);
        assert_eq!(r.take(4096), Some((0, false)), "one range again");
        assert_eq!(r.take(1), None, "full");
    }

    #[test]
    fn buffers_come_back_and_are_zeroed_when_asked() {
        let pool = pool(MIB, 2 * MIB);
        let mut a = pool.take_bytes(1000, Fill::Zeroed).expect("a");
        a.bytes_mut().fill(7);
        assert_eq!(a.segment(), 0);
        let at = a.offset();
        drop(a);
        assert_eq!(pool.free_in(0), Some(MIB));
        let b = pool.take_bytes(1000, Fill::Overwritten).expect("b");
        assert_eq!(b.offset(), at, "the same range again");
        assert_eq!(b.bytes()[0], 7, "not zeroed: the grant overwrites it");
        drop(b);
        let c = pool.take_bytes(1000, Fill::Zeroed).expect("c");
        assert!(c.bytes().iter().all(|&x| x == 0), "zeroed when asked");
    }

    /// Blocks of the segment's memfd the kernel holds (512 bytes each).
    fn resident(pool: &Pool, n: usize) -> i64 {
        let state = pool.state();
        let fd = state.segments[n].0.fd().as_raw_fd();
        nix::sys::stat::fstat(fd).expect("fstat").st_blocks
    }

    #[test]
    fn idle_ranges_go_back_to_the_kernel_and_read_as_zeroes() {
        let pool = pool(4 * MIB, 8 * MIB);
        let mut a = pool.take_bytes(3 * MIB, Fill::Overwritten).expect("a");
        a.bytes_mut().fill(9);
        let at = a.offset();
        let held = pool.take_bytes(1000, Fill::Overwritten).expect("held");
        let touched = resident(&pool, 0);
        assert!(touched >= (3 * MIB / 512) as i64, "{touched} blocks");
        drop(a);
        assert_eq!(pool.release_free(), 3 * MIB, "the written free range only");
        let after = resident(&pool, 0);
        assert!(after < touched / 8, "still {after} of {touched} blocks");
        assert_eq!(pool.release_free(), 0, "nothing written since");
        // Clean again: a zeroed grant is not written, and reads zeroes all the same.
        let b = pool.take_bytes(3 * MIB, Fill::Overwritten).expect("b");
        assert_eq!(b.offset(), at);
        assert!(b.bytes().iter().all(|&x| x == 0));
        drop((b, held));
    }

    #[test]
    fn the_pool_grows_by_segments_up_to_its_limit() {
        let pool = pool(MIB, 3 * MIB);
        let a = pool
            .take_bytes(MIB, Fill::Zeroed)
            .expect("a fills segment 0");
        let b = pool.take_bytes(10, Fill::Zeroed).expect("b in segment 1");
        assert_eq!((a.segment(), b.segment()), (0, 1));
        // Larger than a segment: one of its own, rounded up to a MiB; past the limit: none.
        assert!(
            pool.take_bytes(2 * MIB, Fill::Zeroed).is_none(),
            "5 MiB > 3 MiB"
        );
        let c = pool
            .take_bytes(MIB - 64, Fill::Zeroed)
            .expect("c fits segment 1");
        assert_eq!(c.segment(), 1);
        assert_eq!(pool.bytes(), 2 * MIB);
        assert!(
            pool.take_bytes(0, Fill::Zeroed).is_some(),
            "rounded up to 64 bytes"
        );
        let other = self::pool(MIB, MIB);
        let theirs = other.take_bytes(10, Fill::Zeroed).expect("theirs");
        assert!(
            pool.owns(&theirs).is_none(),
            "another pool's memory is not ours"
        );
        assert!(pool.owns(&a).is_some());
    }

    #[test]
    fn a_buffer_outliving_its_pool_keeps_its_mapping() {
        let pool = pool(MIB, MIB);
        let mut a = pool.take_bytes(100, Fill::Zeroed).expect("a");
        drop(pool);
        a.bytes_mut()[99] = 1;
        assert_eq!(a.bytes()[99], 1);
    }

    proptest! {
        /// Whatever the order of takes and gives: ranges taken never overlap, never leave
        /// the segment, and all of it is free again at the end.
        #[test]
        fn ranges_never_overlap(ops in proptest::collection::vec((1usize..5000, any::<bool>()), 1..200)) {
            let len = 64 * 1024;
            let mut r = Ranges::new(len);
            let mut held: Vec<(usize, usize)> = Vec::new();
            for (size, give) in ops {
                if give && !held.is_empty() {
                    let (at, n) = held.remove(size % held.len());
                    r.give(at, n);
                } else if let Some((at, _)) = r.take(size) {
                    let end = at + Ranges::rounded(size).expect("small");
                    prop_assert!(end <= len);
                    prop_assert_eq!(at % ALIGN, 0);
                    for &(b, m) in &held {
                        let b_end = b + Ranges::rounded(m).expect("small");
                        prop_assert!(end <= b || b_end <= at, "{at}..{end} overlaps {b}..{b_end}");
                    }
                    held.push((at, size));
                }
                prop_assert!(r.is_consistent());
                let taken: usize = held.iter().map(|&(_, n)| Ranges::rounded(n).expect("small")).sum();
                prop_assert_eq!(r.free_bytes() + taken, len);
            }
            for (at, n) in held {
                r.give(at, n);
            }
            prop_assert_eq!(r.free_bytes(), len);
            prop_assert_eq!(r.take(len).map(|(at, _)| at), Some(0), "one range again");
        }
    }
}
