//! Memory of dropped buffers a domain keeps for grants that overwrite it whole.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use ferry_transports::cuda::Stream;

/// The smallest host buffer worth keeping on a [`Shelf`]: below it a fresh allocation comes
/// from the heap and costs little. (Device memory of every size is worth keeping: a pool
/// allocation and its free are driver calls of microseconds each.)
const SHELF_MIN: u64 = 64 * 1024;
/// The most host buffers a shelf keeps.
pub(super) const SHELF_BUFFERS: usize = 16;
/// The most device buffers a shelf keeps: a lane's records in flight, and some.
pub(super) const SHELF_DEVICE_BUFFERS: usize = 96;
/// The most device memory a shelf keeps (GPU memory other processes may want), and the
/// largest device buffer worth keeping (above it the copy's time dwarfs the allocation's).
pub(super) const SHELF_DEVICE_BYTES: u64 = 512 << 20;
const SHELF_DEVICE_LARGEST: u64 = 64 << 20;

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

/// Memory of dropped buffers, kept for grants that overwrite it whole: a streamed receive
/// (host memory: no page faults and no zeroing, where a fresh megabyte buffer is a new
/// zeroed allocation) or a lane's landing (device memory allocated on the stream its copy
/// goes on: no allocation and no free, each a driver call of microseconds, contended
/// between the lane's thread and the application's). Its bytes were given back to the
/// budget when their buffer dropped, and the shelf holds at most what the budget has free:
/// kept memory and granted memory together stay within the budget (a grant first frees
/// kept memory that no longer fits, oldest first). At most [`SHELF_BUFFERS`] host buffers,
/// [`SHELF_DEVICE_BUFFERS`] device ones.
#[derive(Debug, Default)]
pub(super) struct Shelf {
    pub(super) kept: Mutex<VecDeque<Kept>>,
    /// The bytes kept, readable without the lock.
    pub(super) bytes: AtomicU64,
}

impl Shelf {
    pub(super) fn kept(&self) -> std::sync::MutexGuard<'_, VecDeque<Kept>> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops the oldest memory kept until `room` more bytes and one more buffer (at most
    /// `most`) fit in `free` bytes; returns what it took out, to be freed outside the locks.
    pub(super) fn make_room(
        kept: &mut VecDeque<Kept>,
        bytes: &AtomicU64,
        room: u64,
        free: u64,
        most: usize,
    ) -> Vec<Kept> {
        let mut evicted = Vec::new();
        let mut total = bytes.load(Ordering::Acquire);
        while total.saturating_add(room) > free || (room > 0 && kept.len() >= most) {
            let Some(old) = kept.pop_front() else { break };
            total = total.saturating_sub(old.len());
            evicted.push(old);
        }
        bytes.store(total, Ordering::Release);
        evicted
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
        let at = kept.iter().rposition(|k| k.len() == len && fits(k))?;
        let taken = kept.remove(at)?;
        self.bytes.fetch_sub(len, Ordering::AcqRel);
        Some(taken)
    }
}
