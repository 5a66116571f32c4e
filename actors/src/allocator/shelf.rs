//! Memory of dropped buffers a domain keeps for grants that overwrite it whole: a cache
//! with limits (`memory.keep_max`, a count of buffers) and a clock (`memory.keep_idle`).
//!
//! Every decision here takes the time as a parameter; the domain reads the clock once per
//! buffer it keeps, and the allocator actor's sweep once per sweep.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferry_transports::cuda::Stream;

/// The smallest host buffer worth keeping on a [`Shelf`]: below it a fresh allocation comes
/// from the heap and costs little. (Device memory of every size is worth keeping: a pool
/// allocation and its free are driver calls of microseconds each.)
const SHELF_MIN: u64 = 64 * 1024;
/// The most host buffers a shelf keeps (a grant looks through them for its length).
pub(super) const SHELF_BUFFERS: usize = 16;
/// The most device buffers a shelf keeps: a lane's records in flight, and some.
pub(super) const SHELF_DEVICE_BUFFERS: usize = 96;
/// The largest device buffer worth keeping: above it the copy's time dwarfs the
/// allocation's.
const SHELF_DEVICE_LARGEST: u64 = 64 << 20;

/// How much memory of dropped buffers a domain keeps, and for how long
/// (`memory.keep_max`, `memory.keep_idle`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keeping {
    /// Memory unused this long goes back (host memory to the system, device memory out of
    /// the GPU's pool). Zero keeps nothing.
    pub idle: Duration,
    /// The most bytes kept at once. Zero keeps nothing.
    pub max: u64,
}

impl Default for Keeping {
    /// The configuration's defaults: 2 s, 512 MiB.
    fn default() -> Self {
        Keeping {
            idle: Duration::from_secs(2),
            max: 512 << 20,
        }
    }
}

impl Keeping {
    /// Nothing is kept: every dropped buffer's memory is freed at once.
    pub const NOTHING: Keeping = Keeping {
        idle: Duration::ZERO,
        max: 0,
    };

    /// True when memory may be kept at all.
    pub fn keeps(&self) -> bool {
        !self.idle.is_zero() && self.max > 0
    }
}

/// Memory a shelf keeps: a host buffer's bytes, or a device buffer's pool allocation.
#[derive(Debug)]
pub(super) enum Kept {
    Host(Box<[u8]>),
    Device(ferry_transports::cuda::DeviceBuffer),
}

impl Kept {
    /// The bytes it holds.
    pub(super) fn len(&self) -> u64 {
        match self {
            Kept::Host(bytes) => bytes.len() as u64,
            Kept::Device(memory) => memory.capacity() as u64,
        }
    }

    /// Host memory from [`SHELF_MIN`], device memory up to [`SHELF_DEVICE_LARGEST`].
    pub(super) fn worth_keeping(&self) -> bool {
        match self {
            Kept::Host(_) => self.len() >= SHELF_MIN,
            Kept::Device(_) => self.len() <= SHELF_DEVICE_LARGEST,
        }
    }
}

/// Frees kept memory; returns the streams its device memory is freed on, in order on them
/// (wait for those to have it back in the pool).
pub(super) fn free_kept(kept: Vec<Kept>) -> Vec<Stream> {
    let mut streams: Vec<Stream> = Vec::new();
    for kept in kept {
        if let Kept::Device(memory) = kept {
            let stream = memory.stream();
            drop(memory);
            if !streams.iter().any(|s| s.same_as(&stream)) {
                streams.push(stream);
            }
        }
    }
    streams
}

/// Kept memory and when it was kept.
#[derive(Debug)]
struct Entry {
    memory: Kept,
    since: Instant,
}

/// What a sweep at some time found to do.
#[derive(Debug)]
pub(super) struct Swept {
    /// Memory unused for the idle time: to be freed, off the actor's thread.
    pub(super) expired: Vec<Kept>,
    /// The domain's device pool is to give its unused memory back (after `expired` is
    /// freed): nothing else was freed into it for the idle time.
    pub(super) trim: bool,
}

/// Memory of dropped buffers, kept for grants that overwrite it whole: a streamed receive
/// (host memory: no page faults and no zeroing, where a fresh megabyte buffer is a new
/// zeroed allocation) or a lane's landing (device memory allocated on the stream its copy
/// goes on: no allocation and no free, each a driver call of microseconds, contended
/// between the lane's thread and the application's). Its bytes were given back to the
/// budget when their buffer dropped, and the shelf holds at most what the budget has free:
/// kept memory and granted memory together stay within the budget (a grant first frees
/// kept memory that no longer fits, oldest first). At most `memory.keep_max` bytes and
/// [`SHELF_BUFFERS`] host buffers or [`SHELF_DEVICE_BUFFERS`] device ones; memory unused
/// for `memory.keep_idle` goes back at the next sweep ([`Shelf::sweep`]).
///
/// Entries are in the order they were kept, so the oldest is first: keeping is a push at
/// the back, expiry pops from the front, and neither searches.
#[derive(Debug)]
pub(super) struct Shelf {
    kept: Mutex<VecDeque<Entry>>,
    /// The bytes kept, readable without the lock.
    bytes: AtomicU64,
    /// Grants served from kept memory since the domain started.
    reused: AtomicU64,
    /// When memory was last freed into the domain's device pool since the pool's last
    /// trim: nanoseconds after `epoch`, plus one; 0 when nothing was.
    freed: AtomicU64,
    epoch: Instant,
    /// A sweep is armed: memory kept or freed now needs no word to the actor.
    sweeping: AtomicBool,
}

impl Default for Shelf {
    fn default() -> Self {
        Shelf::new(Instant::now())
    }
}

impl Shelf {
    /// An empty shelf whose clock starts at `epoch` (no time passed to it may be earlier).
    pub(super) fn new(epoch: Instant) -> Self {
        Shelf {
            kept: Mutex::default(),
            bytes: AtomicU64::new(0),
            reused: AtomicU64::new(0),
            freed: AtomicU64::new(0),
            epoch,
            sweeping: AtomicBool::new(false),
        }
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, VecDeque<Entry>> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The bytes kept now.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::SeqCst)
    }

    /// Grants served from kept memory so far.
    pub(super) fn reused(&self) -> u64 {
        self.reused.load(Ordering::Relaxed)
    }

    /// Keeps `memory`, dropped at `now`, where at most `room` bytes and `most` buffers may
    /// be kept: the oldest memory goes first to make room. Returns what does not stay (to
    /// be freed outside the caller's locks): `memory` itself when it is larger than `room`.
    pub(super) fn put(&self, memory: Kept, now: Instant, room: u64, most: usize) -> Vec<Kept> {
        let len = memory.len();
        if len > room || most == 0 {
            return vec![memory];
        }
        let mut kept = self.kept();
        let evicted = Self::evict(&mut kept, &self.bytes, room - len, most - 1);
        // In order of time even when threads race here with clocks read before the lock.
        let since = kept.back().map_or(now, |last| last.since.max(now));
        kept.push_back(Entry { memory, since });
        // SeqCst with `sweeping` (see `needs_word`).
        self.bytes.fetch_add(len, Ordering::SeqCst);
        evicted
    }

    /// Drops the oldest kept memory until at most `room` bytes and `most` buffers are left;
    /// returns what it took out.
    fn evict(kept: &mut VecDeque<Entry>, bytes: &AtomicU64, room: u64, most: usize) -> Vec<Kept> {
        let mut evicted = Vec::new();
        let mut total = bytes.load(Ordering::Acquire);
        while total > room || kept.len() > most {
            let Some(old) = kept.pop_front() else { break };
            total = total.saturating_sub(old.memory.len());
            evicted.push(old.memory);
        }
        if !evicted.is_empty() {
            bytes.store(total, Ordering::SeqCst);
        }
        evicted
    }

    /// Takes out the oldest kept memory until at most `room` bytes are kept (a grant just
    /// took the rest of the budget); returns it, to be freed outside the locks.
    pub(super) fn trim_to(&self, room: u64) -> Vec<Kept> {
        if self.bytes.load(Ordering::Acquire) <= room {
            return Vec::new();
        }
        let mut kept = self.kept();
        Self::evict(&mut kept, &self.bytes, room, usize::MAX)
    }

    /// Takes out everything kept (the caller frees it).
    pub(super) fn take_all(&self) -> Vec<Kept> {
        let mut kept = self.kept();
        self.bytes.store(0, Ordering::SeqCst);
        kept.drain(..).map(|e| e.memory).collect()
    }

    /// The most recently kept memory of exactly `len` bytes: host memory, or device
    /// memory made on `on` (none without a stream).
    pub(super) fn take(&self, len: u64, on: Option<&Stream>) -> Option<Kept> {
        let fits = |k: &Kept| match k {
            Kept::Host(_) => true,
            Kept::Device(m) => on.is_some_and(|s| m.allocated_on(s)),
        };
        if self.bytes.load(Ordering::Acquire) < len {
            return None;
        }
        let mut kept = self.kept();
        let at = kept
            .iter()
            .rposition(|e| e.memory.len() == len && fits(&e.memory))?;
        let taken = kept.remove(at)?;
        self.bytes.fetch_sub(len, Ordering::SeqCst);
        self.reused.fetch_add(1, Ordering::Relaxed);
        Some(taken.memory)
    }

    /// Notes that memory was freed into the domain's device pool at `now` (not kept): the
    /// pool gives it back once nothing more was freed into it for the idle time.
    pub(super) fn note_freed(&self, now: Instant) {
        let at = now.saturating_duration_since(self.epoch).as_nanos();
        let at = u64::try_from(at).unwrap_or(u64::MAX - 1) + 1;
        // SeqCst with `sweeping` (see `needs_word`).
        self.freed.store(at, Ordering::SeqCst);
    }

    /// True when memory was just kept or freed (the caller did so before asking) and no
    /// sweep is armed for it: the caller must tell the actor, which arms one. False while a
    /// sweep is armed: that sweep, or the one it arms, sees the memory.
    pub(super) fn needs_word(&self) -> bool {
        !self.sweeping.load(Ordering::SeqCst)
    }

    /// Whether anything waits for a sweep (memory kept, or freed into the pool since its
    /// last trim), readable without the lock.
    fn pending(&self) -> bool {
        self.bytes.load(Ordering::SeqCst) > 0 || self.freed.load(Ordering::SeqCst) != 0
    }

    /// When the next sweep is due for memory unused for `idle`, marking the shelf as swept
    /// from now on (no word to the actor is needed until [`Self::disarm`]); `None` when
    /// nothing waits for one. The actor arms its timer for the answer.
    pub(super) fn arm(&self, idle: Duration) -> Option<Instant> {
        loop {
            self.sweeping.store(true, Ordering::SeqCst);
            if let Some(next) = self.next_due(idle) {
                return Some(next);
            }
            // Nothing to sweep: memory kept from now on asks for a sweep itself. Memory
            // kept while `sweeping` was still set did not: look once more.
            self.sweeping.store(false, Ordering::SeqCst);
            if !self.pending() {
                return None;
            }
        }
    }

    /// When the oldest kept memory, or the pool's freed memory, has been unused for `idle`.
    fn next_due(&self, idle: Duration) -> Option<Instant> {
        if !self.pending() {
            return None;
        }
        let oldest = self.kept().front().map(|e| e.since);
        let freed = match self.freed.load(Ordering::SeqCst) {
            0 => None,
            at => Some(self.epoch + Duration::from_nanos(at - 1)),
        };
        // A keep_idle too long to add to a time never expires.
        oldest
            .into_iter()
            .chain(freed)
            .filter_map(|t| t.checked_add(idle))
            .min()
            .or_else(|| oldest.or(freed).map(|_| far_future()))
    }

    /// The sweep armed by [`Self::arm`] is over: memory kept from now on asks for a sweep.
    pub(super) fn disarm(&self) {
        self.sweeping.store(false, Ordering::SeqCst);
    }

    /// What a sweep at `now` does, for memory unused for `idle`: takes out kept memory that
    /// was kept `idle` ago or earlier, and says whether the pool is to be trimmed (memory
    /// went into it, and none for `idle`, apart from what this sweep frees). The next sweep
    /// is [`Self::arm`]'s answer after [`Self::disarm`].
    pub(super) fn sweep(&self, now: Instant, idle: Duration) -> Swept {
        let expired: Vec<Kept> = {
            let mut kept = self.kept();
            let mut expired = Vec::new();
            while kept
                .front()
                .is_some_and(|e| now.saturating_duration_since(e.since) >= idle)
            {
                if let Some(old) = kept.pop_front() {
                    self.bytes.fetch_sub(old.memory.len(), Ordering::SeqCst);
                    expired.push(old.memory);
                }
            }
            expired
        };
        let freed = self.freed.load(Ordering::SeqCst);
        let quiet = freed == 0
            || now.saturating_duration_since(self.epoch + Duration::from_nanos(freed - 1)) >= idle;
        // Memory freed into the pool after the load above is newer: it stays for the next
        // trim (the exchange fails, and a sweep is armed for it).
        let trim = quiet
            && (!expired.is_empty() || freed != 0)
            && (freed == 0
                || self
                    .freed
                    .compare_exchange(freed, 0, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok());
        Swept { expired, trim }
    }
}

/// A time later than any sweep: for a keep_idle too long to add to now.
fn far_future() -> Instant {
    let now = Instant::now();
    [365 * 24 * 3600, 24 * 3600, 3600]
        .into_iter()
        .find_map(|s| now.checked_add(Duration::from_secs(s)))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn host(len: u64) -> Kept {
        Kept::Host(vec![0u8; len as usize].into_boxed_slice())
    }

    fn lens(kept: &[Kept]) -> Vec<u64> {
        kept.iter().map(Kept::len).collect()
    }

    /// The sweep after `swept`: the time it is due at.
    fn next(shelf: &Shelf, idle: Duration) -> Option<Instant> {
        shelf.disarm();
        shelf.arm(idle)
    }

    #[test]
    fn memory_unused_for_the_idle_time_goes_at_the_sweep_and_only_it() {
        let t0 = Instant::now();
        let idle = Duration::from_secs(2);
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let shelf = Shelf::new(t0);
        assert_eq!(shelf.arm(idle), None, "nothing kept: no sweep");
        assert!(shelf.needs_word());

        assert!(shelf.put(host(MIB), ms(0), 8 * MIB, 16).is_empty());
        assert!(
            shelf.needs_word(),
            "no sweep armed yet: the actor must hear of it"
        );
        assert_eq!(shelf.arm(idle), Some(ms(2000)));
        assert!(!shelf.needs_word(), "a sweep is armed");
        assert!(shelf.put(host(2 * MIB), ms(500), 8 * MIB, 16).is_empty());
        assert!(shelf.put(host(3 * MIB), ms(900), 8 * MIB, 16).is_empty());

        // Early: nothing goes, the next sweep is the oldest's.
        let swept = shelf.sweep(ms(1999), idle);
        assert!(swept.expired.is_empty());
        assert_eq!(next(&shelf, idle), Some(ms(2000)));
        // Taking memory and keeping it again makes it new.
        let again = shelf.take(MIB, None).expect("kept 1 MiB");
        assert!(shelf.put(again, ms(1999), 8 * MIB, 16).is_empty());
        assert_eq!(shelf.reused(), 1);

        let swept = shelf.sweep(ms(2500), idle);
        assert_eq!(
            lens(&swept.expired),
            vec![2 * MIB],
            "kept at 500 ms, and only it"
        );
        assert!(swept.trim, "host: no pool frees to wait for");
        assert_eq!(next(&shelf, idle), Some(ms(2900)));
        assert_eq!(shelf.bytes(), 4 * MIB);

        let swept = shelf.sweep(ms(3999), idle);
        assert_eq!(lens(&swept.expired), vec![3 * MIB, MIB]);
        assert_eq!(shelf.bytes(), 0);
        assert_eq!(next(&shelf, idle), None, "nothing left");
        assert!(
            shelf.needs_word(),
            "no sweep armed: the next memory kept asks for one"
        );
    }

    #[test]
    fn a_pool_is_trimmed_once_nothing_went_into_it_for_the_idle_time() {
        let t0 = Instant::now();
        let idle = Duration::from_millis(100);
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let shelf = Shelf::new(t0);
        shelf.note_freed(ms(10));
        assert_eq!(
            shelf.arm(idle),
            Some(ms(110)),
            "a trim is due after the free"
        );
        shelf.note_freed(ms(50));
        let swept = shelf.sweep(ms(110), idle);
        assert!(!swept.trim, "freed again at 50 ms");
        assert_eq!(next(&shelf, idle), Some(ms(150)));
        let swept = shelf.sweep(ms(150), idle);
        assert!(swept.trim && swept.expired.is_empty());
        assert_eq!(next(&shelf, idle), None, "trimmed: nothing waits");
        let swept = shelf.sweep(ms(400), idle);
        assert!(!swept.trim, "one trim per quiet spell");

        // Memory expiring while the pool is busy with other frees waits for the trim.
        assert!(shelf.put(host(MIB), ms(400), 8 * MIB, 16).is_empty());
        shelf.note_freed(ms(480));
        let swept = shelf.sweep(ms(500), idle);
        assert_eq!(lens(&swept.expired), vec![MIB]);
        assert!(!swept.trim);
        assert_eq!(next(&shelf, idle), Some(ms(580)));
        assert!(shelf.sweep(ms(580), idle).trim);
    }

    #[test]
    fn a_shelf_holds_at_most_its_room_and_count_oldest_out_first() {
        let t0 = Instant::now();
        let shelf = Shelf::new(t0);
        assert!(shelf.put(host(2 * MIB), t0, 5 * MIB, 3).is_empty());
        assert!(shelf.put(host(2 * MIB), t0, 5 * MIB, 3).is_empty());
        assert_eq!(
            lens(&shelf.put(host(3 * MIB), t0, 5 * MIB, 3)),
            vec![2 * MIB]
        );
        assert_eq!(shelf.bytes(), 5 * MIB);
        assert_eq!(
            lens(&shelf.put(host(6 * MIB), t0, 5 * MIB, 3)),
            vec![6 * MIB]
        );
        assert_eq!(shelf.bytes(), 5 * MIB, "larger than the room: not kept");
        for _ in 0..3 {
            drop(shelf.put(host(MIB), t0, 5 * MIB, 3));
        }
        assert_eq!(shelf.bytes(), 3 * MIB, "three buffers at most");
        assert_eq!(lens(&shelf.trim_to(MIB)), vec![MIB, MIB]);
        assert_eq!(lens(&shelf.take_all()), vec![MIB]);
        assert_eq!(shelf.bytes(), 0);
    }

    #[test]
    fn an_idle_time_too_long_to_add_never_expires() {
        let t0 = Instant::now();
        let shelf = Shelf::new(t0);
        assert!(shelf.put(host(MIB), t0, 8 * MIB, 16).is_empty());
        let next = shelf.arm(Duration::MAX).expect("something kept");
        assert!(next > t0 + Duration::from_secs(3000));
        let swept = shelf.sweep(t0 + Duration::from_secs(3600), Duration::MAX);
        assert!(swept.expired.is_empty() && !swept.trim);
    }
}
