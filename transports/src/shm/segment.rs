//! One segment of a shared-memory pool: a sealed memfd mapped `MAP_SHARED` once per
//! process. The owner makes it ([`Segment::create`]) at its full size and seals it against
//! shrinking and growing, so no process that maps it can ever touch a page past its end
//! (a shrunk shared file is a SIGBUS); a peer maps it ([`Segment::open`]) only once it has
//! checked those seals and the size.
//!
//! The only `unsafe` of the transport is here: the mapping, and slices of it for copies in
//! and out, each bounded by the mapping's length and living no longer than the call.
#![allow(unsafe_code)]

use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MemFdCreateFlag, memfd_create};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};

use super::ShmError;

/// A mapped segment.
pub struct Segment {
    base: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping belongs to the `Segment` and is unmapped once, in `Drop`; every access
// goes through `copy_in`/`copy_out` (bounded raw copies) or a [`Lent`] range (held by one
// owner at a time).
unsafe impl Send for Segment {}
// SAFETY: as above: no method keeps a reference into the mapping past its call; a `Lent`
// range is one owner's at a time.
unsafe impl Sync for Segment {}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment").field("len", &self.len).finish()
    }
}

impl Segment {
    /// A new segment of `len` bytes (zeroed, as a fresh memfd is), sealed against resizing.
    ///
    /// # Errors
    /// [`ShmError::System`] when the kernel refuses the memfd, its size or the mapping.
    pub fn create(len: usize) -> Result<Self, ShmError> {
        let size = NonZeroUsize::new(len).ok_or_else(|| ShmError::Invalid("0 bytes".into()))?;
        let fd = memfd_create(
            c"ferry-shm",
            MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
        )?;
        let file_len = i64::try_from(len).map_err(|_| ShmError::Invalid(format!("{len} bytes")))?;
        nix::unistd::ftruncate(&fd, file_len)?;
        fcntl(
            fd.as_raw_fd(),
            FcntlArg::F_ADD_SEALS(
                SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
            ),
        )?;
        Self::map(fd, size)
    }

    /// Maps a segment a peer made (its descriptor, from its fd-sharing socket), of `len`
    /// bytes as its descriptors say.
    ///
    /// # Errors
    /// [`ShmError::Invalid`] for memory not sealed against shrinking, or of another size than
    /// `len`; [`ShmError::System`] when the mapping fails.
    pub fn open(fd: OwnedFd, len: usize) -> Result<Self, ShmError> {
        let seals = fcntl(fd.as_raw_fd(), FcntlArg::F_GET_SEALS)
            .map_err(|e| ShmError::Invalid(format!("the descriptor cannot be sealed: {e}")))?;
        let seals = SealFlag::from_bits_truncate(seals);
        if !seals.contains(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_SEAL) {
            return Err(ShmError::Invalid(
                "the shared memory is not sealed against shrinking".into(),
            ));
        }
        let size = nix::sys::stat::fstat(fd.as_raw_fd())?.st_size;
        if usize::try_from(size).ok() != Some(len) {
            return Err(ShmError::Invalid(format!(
                "a segment of {size} bytes where {len} were announced"
            )));
        }
        let size = NonZeroUsize::new(len).ok_or_else(|| ShmError::Invalid("0 bytes".into()))?;
        Self::map(fd, size)
    }

    fn map(fd: OwnedFd, len: NonZeroUsize) -> Result<Self, ShmError> {
        // SAFETY: a fresh shared mapping of the whole file, which is sealed at `len` bytes
        // (checked or made by the callers), so every page of it stays backed; nothing else
        // in this process aliases it yet.
        let base = unsafe {
            mmap(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd.as_fd(),
                0,
            )
        }?;
        Ok(Self {
            base: base.cast(),
            len: len.get(),
            fd,
        })
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: a segment has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd, for the fd-sharing socket.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Gives `len` bytes at `offset` back to the kernel: their whole pages are freed and
    /// the rest zeroed (a hole punched in the memfd), so they read as zeroes after, in
    /// every process that maps the segment, which keeps its size. Returns the bytes.
    ///
    /// # Errors
    /// [`ShmError::System`] when the kernel refuses (nothing changed);
    /// [`ShmError::OutOfRange`] for bytes past the end.
    pub fn release(&self, offset: usize, len: usize) -> Result<usize, ShmError> {
        if !self.holds(offset, len) {
            return Err(ShmError::OutOfRange {
                offset: offset as u64,
                len: len as u64,
                segment: self.len as u64,
            });
        }
        if len == 0 {
            return Ok(0);
        }
        let as_off = |n: usize| i64::try_from(n).map_err(|_| ShmError::Invalid(format!("{n}")));
        nix::fcntl::fallocate(
            self.fd.as_raw_fd(),
            nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
            as_off(offset)?,
            as_off(len)?,
        )?;
        Ok(len)
    }

    /// Whether `len` bytes at `offset` lie inside the segment.
    pub fn holds(&self, offset: usize, len: usize) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// Copies `dst.len()` bytes at `offset` out of the segment.
    ///
    /// # Errors
    /// [`ShmError::OutOfRange`] when they lie past its end (nothing is copied).
    pub fn copy_out(&self, offset: usize, dst: &mut [u8]) -> Result<(), ShmError> {
        self.check(offset, dst.len())?;
        // SAFETY: `offset..offset + dst.len()` lies inside the mapping (checked above), which
        // lives as long as `self`, and the slice ends with the call; `dst` is our own memory,
        // not in this mapping's range of this process (a caller's buffer of another segment
        // or the heap). The range is a buffer the peer offered and keeps unwritten until we
        // say Done: a peer that writes it anyway makes the bytes wrong, never the access out
        // of bounds.
        let src = unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(offset), dst.len()) };
        copy_spread(src, dst);
        Ok(())
    }

    /// Copies `src` into the segment at `offset`.
    ///
    /// # Errors
    /// [`ShmError::OutOfRange`] when it would reach past its end (nothing is copied).
    pub fn copy_in(&self, offset: usize, src: &[u8]) -> Result<(), ShmError> {
        self.check(offset, src.len())?;
        // SAFETY: inside the mapping (checked above), and the slice ends with the call. The
        // range is a buffer the segment's owner lent to this write alone (its grant): no
        // other slice of it exists in this process meanwhile (a peer's segment is never lent
        // to a buffer of ours), and `src` is memory of this process outside it.
        let dst =
            unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(offset), src.len()) };
        copy_spread(src, dst);
        Ok(())
    }

    /// Runs `read` over the `len` bytes at `offset` (a gather of a layout out of a peer's
    /// buffer).
    ///
    /// # Errors
    /// [`ShmError::OutOfRange`] when they lie past the segment's end (`read` is not run).
    pub fn read_with<R>(
        &self,
        offset: usize,
        len: usize,
        read: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, ShmError> {
        self.check(offset, len)?;
        // SAFETY: inside the mapping (checked above), which lives as long as `self`, and the
        // slice does not outlive the call. The range is a buffer the peer offered and keeps
        // unwritten until we say Done; a peer that writes it anyway makes the bytes wrong,
        // never the access out of bounds.
        let src = unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(offset), len) };
        Ok(read(src))
    }

    /// Runs `write` over the `len` bytes at `offset` (the packed bytes of a push, written
    /// into the buffer a peer lent).
    ///
    /// # Errors
    /// [`ShmError::OutOfRange`] when they lie past the segment's end (`write` is not run).
    pub fn write_with<R>(
        &self,
        offset: usize,
        len: usize,
        write: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, ShmError> {
        self.check(offset, len)?;
        // SAFETY: inside the mapping (checked above) and not past the call; the range is a
        // buffer the peer lent to this push alone (its grant), which nothing else of this
        // process touches: a peer's segment is never lent to a buffer of ours.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(offset), len) };
        Ok(write(dst))
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), ShmError> {
        if self.holds(offset, len) {
            Ok(())
        } else {
            Err(ShmError::OutOfRange {
                offset: offset as u64,
                len: len as u64,
                segment: self.len as u64,
            })
        }
    }
}

/// A range of a segment of this process's pool, lent to one buffer at a time (the pool's
/// allocator hands it out once until it comes back): readable and writable in place.
pub struct Lent {
    segment: Arc<Segment>,
    offset: usize,
    len: usize,
}

impl Lent {
    /// The range `offset..offset + len` of `segment`, or `None` when it is not inside.
    /// The caller lends it to one owner until it is dropped (the pool's allocator does).
    pub(super) fn new(segment: Arc<Segment>, offset: usize, len: usize) -> Option<Self> {
        segment.holds(offset, len).then_some(Self {
            segment,
            offset,
            len,
        })
    }

    /// The segment.
    pub fn segment(&self) -> &Arc<Segment> {
        &self.segment
    }

    /// Where the range starts in its segment.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: inside the mapping (checked in `new`), which the `Arc` keeps mapped as long
        // as `self`; the range is this value's alone in this process (the allocator lends it
        // once), so nothing here writes it while the slice lives. Another process writes it
        // only while it is lent to a push of its own (or by breaking the protocol: the bytes
        // are then wrong, never out of bounds).
        unsafe { std::slice::from_raw_parts(self.segment.base.as_ptr().add(self.offset), self.len) }
    }

    /// The bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes this the only slice of the range.
        unsafe {
            std::slice::from_raw_parts_mut(self.segment.base.as_ptr().add(self.offset), self.len)
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; nothing borrows it any more (the
        // pool's ranges hold an `Arc` of the segment).
        if let Err(e) = unsafe { munmap(self.base.cast(), self.len) } {
            tracing::warn!(error = %e, "cannot unmap a shared-memory segment");
        }
    }
}

impl crate::fdshare::SharedMemory for Segment {
    fn descriptor(&self) -> BorrowedFd<'_> {
        self.fd()
    }
}

/// A copy from this size up is spread over threads: one core's `memcpy` does not reach
/// what the host's memory can move (on the H200 machine, 64 MiB one at a time: 3.3–3.6
/// GB/s by one thread, 6.8–9.7 by four; spreading from 2 MiB, a thread per MiB, gained
/// nothing at 4 MiB, where the landing's reservation costs as much as the copy).
pub const SPREAD_MIN: usize = 8 << 20;
/// The most threads one copy is spread over, each given at least [`SPREAD_CHUNK`] bytes.
pub const SPREAD_THREADS: usize = 4;
/// The least a spread copy's thread is given (a thread costs tens of microseconds to
/// start).
pub const SPREAD_CHUNK: usize = 4 << 20;

/// Copies `src` into `dst` (of one length): one `memcpy` below [`SPREAD_MIN`], else
/// contiguous pieces copied side by side by up to [`SPREAD_THREADS`] threads (this one
/// among them). A piece whose thread cannot start is copied by this one afterwards.
pub fn copy_spread(src: &[u8], dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len(), "a copy between slices of two lengths");
    let len = src.len();
    let threads = (len / SPREAD_CHUNK).clamp(1, SPREAD_THREADS);
    if len < SPREAD_MIN || threads == 1 {
        dst.copy_from_slice(src);
        return;
    }
    let piece = len.div_ceil(threads);
    let mut left = Vec::new();
    std::thread::scope(|scope| {
        let mut pieces = src.chunks(piece).zip(dst.chunks_mut(piece)).enumerate();
        let first = pieces.next();
        for (i, (from, to)) in pieces {
            let spawned = std::thread::Builder::new()
                .name("ferry-shm-copy".into())
                .spawn_scoped(scope, move || to.copy_from_slice(from));
            if let Err(e) = spawned {
                tracing::debug!("a copy thread did not start ({e}): this one copies its piece");
                left.push(i);
            }
        }
        if let Some((_, (from, to))) = first {
            to.copy_from_slice(from);
        }
    });
    for i in left {
        let start = i * piece;
        let end = (start + piece).min(len);
        dst[start..end].copy_from_slice(&src[start..end]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spread_copy_moves_every_byte_to_its_place() -> Result<(), ShmError> {
        for len in [
            SPREAD_MIN - 1,
            SPREAD_MIN,
            SPREAD_MIN + 4093,
            3 * SPREAD_MIN + 1,
        ] {
            let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let mut dst = vec![0u8; len];
            copy_spread(&src, &mut dst);
            assert!(src == dst, "{len} bytes");
        }
        let segment = Segment::create(SPREAD_MIN * 2)?;
        let src: Vec<u8> = (0..SPREAD_MIN + 7).map(|i| (i % 253) as u8).collect();
        segment.copy_in(5, &src)?;
        let mut back = vec![0u8; src.len()];
        segment.copy_out(5, &mut back)?;
        assert!(src == back);
        Ok(())
    }
}
