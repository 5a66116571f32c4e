//! A one-way ring of fixed-size slots in shared memory between two processes of one host:
//! the control path of the same-host fast lane (small ipc transfers without a socket or an
//! actor hop).
//!
//! The producer creates the ring (a sealed memfd), hands its descriptor to the consumer once
//! (over the fd-sharing socket, SCM_RIGHTS), and both map it. The producer writes a record into
//! slot `seq % slots` and publishes it by raising `head`; the consumer reads records in
//! order, writes each one's outcome into its slot and raises `tail`. A side with nothing to
//! do spins for a while, then parks on a futex word in the ring; the other side wakes it
//! only when it says it is parked, so a busy lane makes no system call at all.
//!
//! The other process is not trusted: every counter it writes is checked against what it
//! may be (`head - tail` never above the slot count, lengths never past a slot), records
//! are copied out before they are decoded, and the memfd is sealed against shrinking, so a
//! hostile peer cannot make us read outside the mapping (a shrunk shared file would be a
//! SIGBUS).
//!
//! This module and [`super::fdpass`] are the link layer's only `unsafe`: mapping the file,
//! atomics that live in the mapping, and the futex calls.
#![allow(unsafe_code)]

use std::ffi::CStr;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::time::Duration;

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MemFdCreateFlag, memfd_create};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};

const MAGIC: u64 = u64::from_le_bytes(*b"FERRYRN1");
/// The header: identity, then each counter on a cache line of its own.
const HEADER: usize = 4096;
const OFF_MAGIC: usize = 0;
const OFF_SLOTS: usize = 8;
const OFF_SLOT_LEN: usize = 12;
const OFF_HEAD: usize = 64;
const OFF_TAIL: usize = 128;
const OFF_CONSUMER_WORD: usize = 192;
const OFF_CONSUMER_PARKED: usize = 196;
const OFF_PRODUCER_WORD: usize = 256;
const OFF_PRODUCER_PARKED: usize = 260;
const OFF_CLOSED: usize = 320;
const OFF_ATTACHED: usize = 384;
/// Each slot starts with the record's length and, once consumed, its status.
const SLOT_HEADER: usize = 8;
/// Largest lane ring accepted from a peer.
pub const LANE_MAX_MAP: usize = 64 << 20;

/// The consumer's reason for not taking a record, in its words (from the slot).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConsumerRefused(pub String);

/// Why a ring could not be made, opened or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RingError {
    /// Creating, sizing, sealing or mapping the shared memory failed.
    #[error("shared memory: {0}")]
    System(#[from] nix::Error),
    /// The descriptor is not a ring this module made, or its shape is wrong.
    #[error("not a ferry ring: {0}")]
    Invalid(String),
    /// The other side wrote a counter or a length it may not write.
    #[error("the peer broke the ring: {0}")]
    Broken(String),
    /// A record does not fit a slot.
    #[error("a record of {len} bytes does not fit a slot of {room}")]
    TooLarge {
        /// The record's length.
        len: usize,
        /// What a slot holds.
        room: usize,
    },
}

/// Which side of the ring this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Writes records (the sender).
    Producer,
    /// Reads them (the receiver).
    Consumer,
}

/// A mapped ring. `Send + Sync`: every access to shared memory is an atomic or a bounded
/// copy; callers keep one producer and one consumer (the lane does).
pub struct Ring {
    base: NonNull<u8>,
    map_len: usize,
    slots: u32,
    slot_len: u32,
    fd: OwnedFd,
    /// Set while [`Ring::fill`] lends a slot out in this process: a second `fill` meanwhile
    /// (from another thread) is refused, so no two callers hold a slot mutably.
    filling: std::sync::atomic::AtomicBool,
    /// Set while [`Ring::with_record`] lends a record out, likewise.
    reading: std::sync::atomic::AtomicBool,
}

// SAFETY: the mapping is owned by the `Ring` and only reached through `&self` methods that
// use atomics for the counters, copies bounded by the slot size for the records, or a slot
// lent to a closure for the length of the call; it is unmapped once, in `Drop`.
unsafe impl Send for Ring {}
// SAFETY: as above: no method hands out a reference into the mapping that outlives the
// call, and the two that lend one (`fill`, `with_record`) refuse a second caller while
// theirs runs, so threads of this process never alias a slot. (The other process can write
// a record we read only by breaking the protocol; see `with_record`.)
unsafe impl Sync for Ring {}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("slots", &self.slots)
            .field("slot_len", &self.slot_len)
            .finish_non_exhaustive()
    }
}

impl Ring {
    /// A new ring of `slots` slots of `slot_len` bytes each (the record plus 8), sealed
    /// against resizing; this process is its producer.
    ///
    /// # Errors
    /// [`RingError::Invalid`] for a zero or too large shape, [`RingError::System`] when the
    /// kernel refuses the memfd or the mapping.
    pub fn create(slots: u32, slot_len: u32) -> Result<Ring, RingError> {
        Ring::create_named(c"ferry-lane", slots, slot_len, LANE_MAX_MAP)
    }

    /// [`Self::create`] with the memfd's name (shown in `/proc/PID/maps`) and the largest
    /// mapping allowed.
    ///
    /// # Errors
    /// As [`Self::create`].
    pub fn create_named(
        name: &CStr,
        slots: u32,
        slot_len: u32,
        max_map: usize,
    ) -> Result<Ring, RingError> {
        let map_len = shape_len(slots, slot_len, max_map)?;
        let fd = memfd_create(
            name,
            MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
        )?;
        nix::unistd::ftruncate(&fd, map_len as i64)?;
        fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            FcntlArg::F_ADD_SEALS(
                SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
            ),
        )?;
        let ring = Ring::map(fd, map_len, slots, slot_len)?;
        ring.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Relaxed);
        ring.u32_at(OFF_SLOTS).store(slots, Ordering::Relaxed);
        ring.u32_at(OFF_SLOT_LEN).store(slot_len, Ordering::Release);
        Ok(ring)
    }

    /// Maps a ring a peer created (its descriptor, from [`Self::fd`]): this process is its
    /// consumer.
    ///
    /// # Errors
    /// [`RingError::Invalid`] for anything but an unshrinkable ring of a sane shape.
    pub fn open(fd: OwnedFd) -> Result<Ring, RingError> {
        Ring::open_at_most(fd, LANE_MAX_MAP)
    }

    /// [`Self::open`] for a ring of at most `max_map` bytes.
    ///
    /// # Errors
    /// As [`Self::open`].
    pub fn open_at_most(fd: OwnedFd, max_map: usize) -> Result<Ring, RingError> {
        let seals = fcntl(std::os::fd::AsRawFd::as_raw_fd(&fd), FcntlArg::F_GET_SEALS)
            .map_err(|e| RingError::Invalid(format!("the descriptor cannot be sealed: {e}")))?;
        let seals = SealFlag::from_bits_truncate(seals);
        if !seals.contains(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_SEAL) {
            return Err(RingError::Invalid(
                "the shared memory is not sealed against shrinking".into(),
            ));
        }
        let size = nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&fd))?.st_size;
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        if !(HEADER..=max_map).contains(&size) {
            return Err(RingError::Invalid(format!("{size} bytes of shared memory")));
        }
        let mut ring = Ring::map(fd, size, 0, 0)?;
        if ring.u64_at(OFF_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(RingError::Invalid("wrong magic".into()));
        }
        let slots = ring.u32_at(OFF_SLOTS).load(Ordering::Acquire);
        let slot_len = ring.u32_at(OFF_SLOT_LEN).load(Ordering::Acquire);
        if shape_len(slots, slot_len, max_map)? != size {
            return Err(RingError::Invalid(format!(
                "{slots} slots of {slot_len} bytes do not make {size} bytes"
            )));
        }
        ring.slots = slots;
        ring.slot_len = slot_len;
        Ok(ring)
    }

    fn map(fd: OwnedFd, map_len: usize, slots: u32, slot_len: u32) -> Result<Ring, RingError> {
        let len = NonZeroUsize::new(map_len).ok_or_else(|| RingError::Invalid("empty".into()))?;
        // SAFETY: a fresh shared mapping of a file we hold open, of the file's sealed size
        // (checked by the caller); nothing else in this process refers to it.
        let base = unsafe {
            mmap(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )
        }?;
        Ok(Ring {
            base: base.cast(),
            map_len,
            slots,
            slot_len,
            fd,
            filling: std::sync::atomic::AtomicBool::new(false),
            reading: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The whole mapping (address and length), to page-lock it for the copy engine.
    pub fn mapping(&self) -> (*mut u8, usize) {
        (self.base.as_ptr(), self.map_len)
    }

    /// The ring's descriptor, to hand to the consumer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// How many records can be in flight.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The largest record a slot holds.
    pub fn room(&self) -> usize {
        self.slot_len as usize - SLOT_HEADER
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off + 8 <= HEADER && off % 8 == 0);
        // SAFETY: `off` is a header offset, 8-aligned within a page-aligned mapping that
        // lives as long as `self`; `AtomicU64` has `u64`'s layout and any bits are valid.
        unsafe { &*self.base.as_ptr().add(off).cast::<AtomicU64>() }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off + 4 <= self.map_len && off % 4 == 0);
        // SAFETY: as `u64_at`, for a 4-aligned offset inside the mapping.
        unsafe { &*self.base.as_ptr().add(off).cast::<AtomicU32>() }
    }

    fn slot_off(&self, seq: u64) -> usize {
        HEADER + (seq % u64::from(self.slots)) as usize * self.slot_len as usize
    }

    /// Copies `len` bytes at `off` (inside the mapping) out.
    fn copy_out(&self, off: usize, out: &mut Vec<u8>, len: usize) {
        debug_assert!(off + len <= self.map_len);
        out.clear();
        out.resize(len, 0);
        // SAFETY: the range is inside the mapping (callers bound `len` by the slot). The
        // other process may write it concurrently only by breaking the protocol; the bytes
        // copied are then garbage, which the decoder that reads them validates.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base.as_ptr().add(off), out.as_mut_ptr(), len);
        }
    }

    fn copy_in(&self, off: usize, bytes: &[u8]) {
        debug_assert!(off + bytes.len() <= self.map_len);
        // SAFETY: as `copy_out`: inside the mapping, in a slot the protocol gives to us now.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.as_ptr().add(off), bytes.len());
        }
    }

    // ---- producer ----

    /// Records published so far (the producer's own counter).
    pub fn head(&self) -> u64 {
        self.u64_at(OFF_HEAD).load(Ordering::Acquire)
    }

    /// Records the consumer has finished, checked: never past `head`, never backwards from
    /// `reaped` (what the producer last saw).
    ///
    /// # Errors
    /// [`RingError::Broken`] when the consumer wrote an impossible count.
    pub fn tail(&self, reaped: u64) -> Result<u64, RingError> {
        let tail = self.u64_at(OFF_TAIL).load(Ordering::Acquire);
        let head = self.head();
        if tail < reaped || tail > head {
            return Err(RingError::Broken(format!(
                "tail {tail} outside [{reaped}, {head}]"
            )));
        }
        Ok(tail)
    }

    /// Writes record `seq` (which must be `head`, with `seq - reaped < slots`) and
    /// publishes it; wakes the consumer if it is parked.
    ///
    /// # Errors
    /// [`RingError::TooLarge`] for a record past [`Self::room`]; [`RingError::Broken`]
    /// when the slot is not free.
    pub fn publish(&self, seq: u64, reaped: u64, record: &[u8]) -> Result<(), RingError> {
        if record.len() > self.room() {
            return Err(RingError::TooLarge {
                len: record.len(),
                room: self.room(),
            });
        }
        if seq != self.head() || seq - reaped.min(seq) >= u64::from(self.slots) {
            return Err(RingError::Broken(format!(
                "slot of record {seq} is not free"
            )));
        }
        let off = self.slot_off(seq);
        self.u32_at(off)
            .store(record.len() as u32, Ordering::Relaxed);
        self.u32_at(off + 4).store(0, Ordering::Relaxed);
        self.copy_in(off + SLOT_HEADER, record);
        self.u64_at(OFF_HEAD).store(seq + 1, Ordering::Release);
        self.wake(OFF_CONSUMER_WORD, OFF_CONSUMER_PARKED);
        Ok(())
    }

    /// Writes record `seq` in place: `fill` gets the slot's room and returns how many bytes
    /// it wrote (at most the room), and the record is published; a `fill` that fails
    /// publishes nothing. Same rules as [`Self::publish`] otherwise. For records too large
    /// to copy twice (the staged transport's chunks, copied straight into the slot by the
    /// copy engine).
    ///
    /// # Errors
    /// [`RingError::Broken`] when the slot is not free, [`RingError::TooLarge`] when `fill`
    /// claims more than the room; `fill`'s own error inside `Ok`.
    pub fn fill<E>(
        &self,
        seq: u64,
        reaped: u64,
        fill: impl FnOnce(&mut [u8]) -> Result<usize, E>,
    ) -> Result<Result<(), E>, RingError> {
        if seq != self.head() || seq - reaped.min(seq) >= u64::from(self.slots) {
            return Err(RingError::Broken(format!(
                "slot of record {seq} is not free"
            )));
        }
        let off = self.slot_off(seq);
        let room = self.room();
        let _lent = Lent::take(&self.filling, "fill")?;
        // SAFETY: the slot lies inside the mapping, and the protocol gives it to us until
        // `head` moves past it: the consumer reads only slots below `head`. No other caller
        // in this process holds it (`_lent`). A consumer that writes it anyway breaks the
        // protocol and only spoils the bytes it will read.
        let slot = unsafe {
            std::slice::from_raw_parts_mut(self.base.as_ptr().add(off + SLOT_HEADER), room)
        };
        let len = match fill(slot) {
            Ok(len) => len,
            Err(e) => return Ok(Err(e)),
        };
        if len > room {
            return Err(RingError::TooLarge { len, room });
        }
        self.u32_at(off).store(len as u32, Ordering::Relaxed);
        self.u32_at(off + 4).store(0, Ordering::Relaxed);
        self.u64_at(OFF_HEAD).store(seq + 1, Ordering::Release);
        self.wake(OFF_CONSUMER_WORD, OFF_CONSUMER_PARKED);
        Ok(Ok(()))
    }

    /// The outcome the consumer wrote for record `seq` (finished: below `tail`): `Ok`, or
    /// its reason (at most a slot's room, lossy UTF-8).
    pub fn outcome(&self, seq: u64) -> Result<(), ConsumerRefused> {
        let off = self.slot_off(seq);
        if self.u32_at(off + 4).load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        let len = (self.u32_at(off).load(Ordering::Acquire) as usize).min(self.room());
        let mut why = Vec::new();
        self.copy_out(off + SLOT_HEADER, &mut why, len);
        Err(ConsumerRefused(String::from_utf8_lossy(&why).into_owned()))
    }

    /// Parks the producer until the consumer finishes a record (`tail` moves past
    /// `seen`), the ring closes, or `timeout` passes.
    pub fn park_producer(&self, seen: u64, timeout: Duration) {
        self.park(OFF_PRODUCER_WORD, OFF_PRODUCER_PARKED, timeout, || {
            self.u64_at(OFF_TAIL).load(Ordering::SeqCst) != seen || self.is_closed()
        });
    }

    /// Wakes a parked producer (its own process's senders call this too, when they queue
    /// work for it).
    pub fn wake_producer(&self) {
        self.wake(OFF_PRODUCER_WORD, OFF_PRODUCER_PARKED);
    }

    // ---- consumer ----

    /// Records published, checked: between `tail` and `tail + slots`.
    ///
    /// # Errors
    /// [`RingError::Broken`] when the producer wrote an impossible count.
    pub fn published(&self, tail: u64) -> Result<u64, RingError> {
        let head = self.head();
        if head < tail || head - tail > u64::from(self.slots) {
            return Err(RingError::Broken(format!(
                "head {head} outside [{tail}, {tail} + {}]",
                self.slots
            )));
        }
        Ok(head)
    }

    /// Copies record `seq` (published, not finished) into `out`.
    ///
    /// # Errors
    /// [`RingError::Broken`] for a length past the slot.
    pub fn read(&self, seq: u64, out: &mut Vec<u8>) -> Result<(), RingError> {
        let (off, len) = self.record(seq)?;
        self.copy_out(off + SLOT_HEADER, out, len);
        Ok(())
    }

    /// Record `seq`'s slot offset and its length, checked against the slot.
    fn record(&self, seq: u64) -> Result<(usize, usize), RingError> {
        let off = self.slot_off(seq);
        let len = self.u32_at(off).load(Ordering::Acquire) as usize;
        if len > self.room() {
            return Err(RingError::Broken(format!(
                "a record of {len} bytes in a slot of {}",
                self.room()
            )));
        }
        Ok((off, len))
    }

    /// Hands record `seq` (published, not finished) to `read` in place, without copying it
    /// out: for records the consumer copies elsewhere once (a staged chunk, straight from
    /// the slot into a GPU's memory). Nothing in it may be trusted: the producer may still
    /// write it (it breaks the protocol if it does), so `read` treats it as plain bytes.
    ///
    /// # Errors
    /// [`RingError::Broken`] for a length past the slot.
    pub fn with_record<R>(&self, seq: u64, read: impl FnOnce(&[u8]) -> R) -> Result<R, RingError> {
        let (off, len) = self.record(seq)?;
        let _lent = Lent::take(&self.reading, "with_record")?;
        // SAFETY: `len` bytes inside the slot, inside the mapping, which lives while `self`
        // is borrowed; any bit pattern is a valid `u8`; no caller in this process writes it
        // (`fill` lends only slots at `head`, which the consumer does not read). The producer
        // process could still write it by breaking the protocol: `read` must treat the bytes
        // as plain data that may change (the staged receiver copies them once, and checks
        // the header it copied out, not the slot).
        let record =
            unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(off + SLOT_HEADER), len) };
        Ok(read(record))
    }

    /// Finishes record `seq` (the next one: `tail`) with `outcome`, and wakes the producer
    /// if it is parked.
    pub fn finish(&self, seq: u64, outcome: Result<(), &str>) {
        let off = self.slot_off(seq);
        match outcome {
            Ok(()) => self.u32_at(off + 4).store(0, Ordering::Relaxed),
            Err(why) => {
                let why = &why.as_bytes()[..why.len().min(self.room())];
                self.copy_in(off + SLOT_HEADER, why);
                self.u32_at(off).store(why.len() as u32, Ordering::Relaxed);
                self.u32_at(off + 4).store(1, Ordering::Relaxed);
            }
        }
        self.u64_at(OFF_TAIL).store(seq + 1, Ordering::Release);
        self.wake(OFF_PRODUCER_WORD, OFF_PRODUCER_PARKED);
    }

    /// Parks the consumer until a record past `tail` is published, the ring closes, or
    /// `timeout` passes.
    pub fn park_consumer(&self, tail: u64, timeout: Duration) {
        self.park(OFF_CONSUMER_WORD, OFF_CONSUMER_PARKED, timeout, || {
            self.u64_at(OFF_HEAD).load(Ordering::SeqCst) != tail || self.is_closed()
        });
    }

    /// The consumer says it reads the ring (its thread runs).
    pub fn attach(&self) {
        self.u32_at(OFF_ATTACHED).store(1, Ordering::SeqCst);
    }

    /// True once the consumer attached.
    pub fn is_attached(&self) -> bool {
        self.u32_at(OFF_ATTACHED).load(Ordering::SeqCst) != 0
    }

    // ---- both ----

    /// Either side is leaving: no more records; wakes both.
    pub fn close(&self) {
        self.u32_at(OFF_CLOSED).store(1, Ordering::SeqCst);
        for (word, parked) in [
            (OFF_CONSUMER_WORD, OFF_CONSUMER_PARKED),
            (OFF_PRODUCER_WORD, OFF_PRODUCER_PARKED),
        ] {
            self.wake(word, parked);
        }
    }

    /// True once either side closed the ring.
    pub fn is_closed(&self) -> bool {
        self.u32_at(OFF_CLOSED).load(Ordering::SeqCst) != 0
    }

    fn park(&self, word: usize, parked: usize, timeout: Duration, ready: impl Fn() -> bool) {
        let (word, parked) = (self.u32_at(word), self.u32_at(parked));
        parked.store(1, Ordering::SeqCst);
        let seen = word.load(Ordering::SeqCst);
        if !ready() {
            futex_wait(word, seen, timeout);
        }
        parked.store(0, Ordering::SeqCst);
    }

    fn wake(&self, word: usize, parked: usize) {
        fence(Ordering::SeqCst);
        if self.u32_at(parked).load(Ordering::SeqCst) != 0 {
            let word = self.u32_at(word);
            word.fetch_add(1, Ordering::SeqCst);
            futex_wake(word);
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; no reference into it outlives
        // `self` (every accessor borrows `self`).
        if let Err(e) = unsafe { munmap(self.base.cast(), self.map_len) } {
            tracing::warn!(error = %e, "unmapping a lane ring failed");
        }
    }
}

/// A slot lent out by `fill` or `with_record`; dropping it lets the next caller in.
struct Lent<'a>(&'a std::sync::atomic::AtomicBool);

impl<'a> Lent<'a> {
    fn take(flag: &'a std::sync::atomic::AtomicBool, what: &str) -> Result<Lent<'a>, RingError> {
        flag.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .map(|_| Lent(flag))
            .map_err(|_| RingError::Broken(format!("{what} called by two threads at once")))
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

fn shape_len(slots: u32, slot_len: u32, max_map: usize) -> Result<usize, RingError> {
    let ok = slots > 0 && slot_len as usize > SLOT_HEADER && slot_len % 8 == 0;
    let len = (slots as usize)
        .checked_mul(slot_len as usize)
        .and_then(|b| b.checked_add(HEADER))
        .filter(|&len| ok && len <= max_map);
    len.ok_or_else(|| RingError::Invalid(format!("{slots} slots of {slot_len} bytes")))
}

/// Sleeps while `word` holds `expected`, at most `timeout`. A shared futex (no
/// `FUTEX_PRIVATE_FLAG`): the word lives in memory both processes map.
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: FUTEX_WAIT reads the 4-byte word at a valid, aligned address and the timespec
    // we own; it returns early on a changed word, a wake, a signal or the timeout, all of
    // which the callers treat alike (they re-check the ring).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            0usize,
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the word's address as a key.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            1i32,
            0usize,
            0usize,
            0u32,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(slots: u32) -> (Ring, Ring) {
        let producer = Ring::create(slots, 64).expect("create");
        let fd = producer.fd().try_clone_to_owned().expect("dup");
        (producer, Ring::open(fd).expect("open"))
    }

    #[test]
    fn records_cross_in_order_with_their_outcomes() {
        let (p, c) = pair(4);
        let mut out = Vec::new();
        for seq in 0..10u64 {
            p.publish(seq, seq, format!("record {seq}").as_bytes())
                .expect("publish");
            assert_eq!(c.published(seq).expect("head"), seq + 1);
            c.read(seq, &mut out).expect("read");
            assert_eq!(out, format!("record {seq}").as_bytes());
            let outcome = if seq % 3 == 0 { Err("no room") } else { Ok(()) };
            c.finish(seq, outcome);
            assert_eq!(p.tail(seq).expect("tail"), seq + 1);
            assert_eq!(
                p.outcome(seq),
                outcome.map_err(|w| ConsumerRefused(w.to_string()))
            );
        }
    }

    #[test]
    fn a_full_ring_refuses_the_next_record() {
        let (p, _c) = pair(2);
        p.publish(0, 0, b"a").expect("first");
        p.publish(1, 0, b"b").expect("second");
        assert!(matches!(p.publish(2, 0, b"c"), Err(RingError::Broken(_))));
        let big = vec![0u8; p.room() + 1];
        assert!(matches!(
            p.publish(2, 2, &big),
            Err(RingError::TooLarge { .. })
        ));
    }

    #[test]
    fn impossible_counters_from_the_peer_are_caught() {
        let (p, c) = pair(2);
        // The "producer" claims five records in a ring of two.
        p.u64_at(OFF_HEAD).store(5, Ordering::Release);
        assert!(matches!(c.published(0), Err(RingError::Broken(_))));
        // The "consumer" claims to have finished more than was published.
        p.u64_at(OFF_HEAD).store(1, Ordering::Release);
        c.u64_at(OFF_TAIL).store(3, Ordering::Release);
        assert!(matches!(p.tail(0), Err(RingError::Broken(_))));
        // A slot length past the slot.
        let off = c.slot_off(0);
        c.u32_at(off).store(10_000, Ordering::Release);
        assert!(matches!(
            c.read(0, &mut Vec::new()),
            Err(RingError::Broken(_))
        ));
    }

    #[test]
    fn unsealed_or_odd_memory_is_refused() {
        let fd = memfd_create(c"not-a-ring", MemFdCreateFlag::MFD_CLOEXEC).expect("memfd");
        nix::unistd::ftruncate(&fd, 8192).expect("size");
        let err = Ring::open(fd).expect_err("unsealed");
        assert!(err.to_string().contains("sealed"), "{err}");
        assert!(Ring::create(0, 64).is_err());
        assert!(Ring::create(4, 7).is_err());
    }

    #[test]
    fn a_parked_consumer_wakes_on_publish_and_on_close() {
        let (p, c) = pair(2);
        let c = std::sync::Arc::new(c);
        let waiter = {
            let c = std::sync::Arc::clone(&c);
            std::thread::spawn(move || {
                let started = std::time::Instant::now();
                while c.published(0).expect("head") == 0 {
                    c.park_consumer(0, Duration::from_secs(10));
                }
                started.elapsed()
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        p.publish(0, 0, b"x").expect("publish");
        let took = waiter.join().expect("thread");
        assert!(took < Duration::from_secs(5), "woke after {took:?}");
        let closer = {
            let c = std::sync::Arc::clone(&c);
            std::thread::spawn(move || {
                while !c.is_closed() {
                    c.park_consumer(1, Duration::from_secs(10));
                }
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        p.close();
        closer.join().expect("closed");
    }
}
