//! Copies between device memory, host slices and pinned host memory, and the bookkeeping
//! that keeps memory allocated until the copies that use it have finished.

mod boxes;

use boxes::Runs;
pub use boxes::{
    BlockCopies, block_copies, copy_boxes_async, copy_boxes_to_host, scatter_boxes_async,
    scatter_boxes_from_host,
};

use std::sync::{Arc, Mutex};

use super::device::Device;
use super::error::{CudaError, teardown_failed};
use super::raw;
use super::stream::{Event, Stream};

pub(super) mod sealed {
    /// Only this layer's buffer types are device memory: their address and length are
    /// trusted by the copies, so no one else may implement the trait.
    pub trait Sealed {
        fn region(&self) -> (cudarc::driver::sys::CUdeviceptr, usize);
        fn note_use(&self, stream: &super::Stream) -> Result<(), super::CudaError>;
        /// As `note_use`, with the event a batch of copies shares (by default an event of
        /// its own).
        fn note_shared(&self, shared: &mut super::SharedUse<'_>) -> Result<(), super::CudaError> {
            self.note_use(shared.stream)
        }
    }
}

/// Device memory this layer owns or imported: [`DeviceBuffer`](super::DeviceBuffer) and
/// [`ImportedBuffer`](super::ImportedBuffer). Sealed.
///
/// Every copy through this layer is recorded against the buffers it touches, so freeing a
/// buffer (dropping it) is ordered after every copy queued on it, whatever the stream.
pub trait DeviceMemory: sealed::Sealed {
    /// The device the memory resides on.
    fn device(&self) -> &Device;

    /// The device address (unified addressing: unique across the devices of a process).
    /// For logs and identity checks only; an address alone never identifies a buffer.
    fn device_ptr(&self) -> u64 {
        self.region().0
    }

    /// Length in bytes.
    fn len(&self) -> usize {
        self.region().1
    }

    /// True for zero bytes (never, for buffers of this layer).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which streams used a region, and an event on each that captures its latest use. An
/// event may be shared by the buffers one batch of copies touched ([`SharedUse`]); whoever
/// records it again captures a later point of the same stream, which only makes the others
/// wait longer (see [`copy_many_async`] for what sharing asks of its caller).
#[derive(Default)]
pub(super) struct Uses {
    uses: Mutex<Vec<(Stream, Arc<Event>)>>,
}

/// One event recorded on `stream` after a batch of copies, shared by every buffer the
/// batch touched: one record for the batch instead of one per buffer (about 1.5 µs each on
/// an H100).
pub struct SharedUse<'a> {
    stream: &'a Stream,
    event: Arc<Event>,
}

impl<'a> SharedUse<'a> {
    /// The stream the batch was queued on.
    pub(super) fn stream(&self) -> &Stream {
        self.stream
    }
}

impl Uses {
    /// Records that work touching the region, part of the batch `shared`, was just queued
    /// on its stream: the batch's event stands for this region's latest use there.
    pub(super) fn note_shared(&self, shared: &mut SharedUse<'_>) -> Result<(), CudaError> {
        let event = Arc::clone(&shared.event);
        let mut uses = self.uses.lock().unwrap_or_else(|p| p.into_inner());
        match uses.iter_mut().find(|(s, _)| s.same_as(shared.stream)) {
            // Recorded after every earlier use on this stream: it replaces their event.
            Some((_, latest)) => *latest = event,
            None => uses.push((shared.stream.clone(), event)),
        }
        Ok(())
    }

    /// Records that work touching the region was just queued on `stream`.
    pub(super) fn note(&self, stream: &Stream) -> Result<(), CudaError> {
        let mut uses = self.uses.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, event)) = uses.iter().find(|(s, _)| s.same_as(stream)) {
            // Re-recording captures everything queued on the stream so far, earlier uses
            // included.
            return event.record(stream);
        }
        let event = Event::new(stream.device())?;
        event.record(stream)?;
        uses.push((stream.clone(), Arc::new(event)));
        Ok(())
    }

    /// Makes `stream` wait for every recorded use (host does not block).
    pub(super) fn order_before(&self, stream: &Stream) -> Result<(), CudaError> {
        let uses = self.uses.lock().unwrap_or_else(|p| p.into_inner());
        for (s, event) in uses.iter() {
            if !s.same_as(stream) {
                stream.wait(event)?;
            }
        }
        Ok(())
    }

    /// Blocks until every recorded use has completed.
    pub(super) fn wait_all(&self) -> Result<(), CudaError> {
        let uses = self.uses.lock().unwrap_or_else(|p| p.into_inner());
        for (_, event) in uses.iter() {
            event.synchronize()?;
        }
        Ok(())
    }
}

fn range(what: &str, offset: usize, len: usize, size: usize) -> Result<(), CudaError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(CudaError::Misuse(format!(
            "{what} range {offset}+{len} is outside its {size} bytes"
        ))),
    }
}

/// Queues a copy of `len` bytes from `src[src_offset..]` to `dst[dst_offset..]` on `stream`
/// (`cuMemcpyAsync`). Works across devices (unified addressing): with peer access the copy
/// engine moves the bytes directly over NVLink/PCIe. Pool memory of another device needs
/// [`ExportablePool::grant_access`](super::ExportablePool::grant_access) /
/// [`ImportedPool::grant_access`](super::ImportedPool::grant_access) for the stream's device.
///
/// Returns once queued; completion is learnt from the stream or an [`Event`]. Both buffers
/// stay allocated until the copy completes even if dropped earlier.
///
/// # Errors
/// [`CudaError::Misuse`] for a range outside a buffer; a driver error otherwise.
pub fn copy_async(
    dst: &mut impl DeviceMemory,
    dst_offset: usize,
    src: &impl DeviceMemory,
    src_offset: usize,
    len: usize,
    stream: &Stream,
) -> Result<(), CudaError> {
    // SAFETY: the buffers' `Uses`, recorded below, keep both allocated until the copy has
    // passed.
    if unsafe { enqueue(dst, dst_offset, src, src_offset, len, stream) }? {
        dst.note_use(stream)?;
        src.note_use(stream)?;
    }
    Ok(())
}

/// Queues a copy as [`copy_async`] does, then records `event` on `stream` after it and
/// returns it: that one event stands for both buffers' use and tells the caller when the
/// copy ended (one event recorded instead of one per buffer and one of the caller's, about
/// 1.5 µs each on an H100). `event` is of the stream's device; it is recorded also when
/// there was nothing to copy.
///
/// No other thread may queue work touching these buffers on `stream` during the call, as
/// [`copy_many_async`] says (the event, recorded before the buffers are noted, replaces
/// their latest use on the stream).
///
/// # Errors
/// [`CudaError::Misuse`] for a range outside a buffer or an event of another device; a
/// driver error otherwise (should recording the event fail after the copy was queued, each
/// buffer notes a use of its own, so neither is freed before the copy passed).
pub fn copy_async_marked(
    dst: &mut impl DeviceMemory,
    dst_offset: usize,
    src: &impl DeviceMemory,
    src_offset: usize,
    len: usize,
    stream: &Stream,
    event: Event,
) -> Result<Arc<Event>, CudaError> {
    of_stream(&event, stream)?;
    // SAFETY: the uses `mark_uses` notes keep both buffers allocated until the copy has
    // passed.
    let queued = unsafe { enqueue(dst, dst_offset, src, src_offset, len, stream) }?;
    let used: &[&dyn sealed::Sealed] = if queued { &[&*dst, src] } else { &[] };
    mark_uses(stream, event, used)
}

/// Refuses an event of another device than `stream`'s.
fn of_stream(event: &Event, stream: &Stream) -> Result<(), CudaError> {
    if event.device().same_as(stream.device()) {
        Ok(())
    } else {
        Err(CudaError::Misuse(
            "a copy's event is of another device than its stream".into(),
        ))
    }
}

/// Records `event` on `stream` after what was just queued there and notes it as the latest
/// use there of each of `used`; returns it. Should recording fail, each buffer notes a use
/// of its own instead (failing that too, the stream is waited for), so that none is freed
/// before the copies passed, and the error returns.
fn mark_uses(
    stream: &Stream,
    event: Event,
    used: &[&dyn sealed::Sealed],
) -> Result<Arc<Event>, CudaError> {
    if let Err(e) = event.record(stream) {
        if used.iter().try_for_each(|b| b.note_use(stream)).is_err() {
            stream.synchronize()?;
        }
        return Err(e);
    }
    let mut shared = SharedUse {
        stream,
        event: Arc::new(event),
    };
    for b in used {
        b.note_shared(&mut shared)?;
    }
    Ok(shared.event)
}

/// One copy of [`copy_many_async`]: `len` bytes from `src` at `src_offset` to the start of
/// `dst`.
pub struct Pair<'a, D, S> {
    /// Where the bytes go.
    pub dst: &'a mut D,
    /// Where they come from.
    pub src: &'a S,
    /// The first byte of `src` read.
    pub src_offset: usize,
    /// Bytes.
    pub len: usize,
}

/// Queues several independent copies between device memories on `stream`: where every
/// buffer is of the stream's GPU, as one launch of the gather kernel (the copy engine's
/// fixed cost per copy, 5–8 µs on an H100 for a peer's memory, is paid once; a lone copy
/// too), else (or where the kernel does not load) as [`copy_boxes_async`] queues a block
/// list's runs. Returns once queued; every buffer is recorded as used on `stream`, as
/// [`copy_async`] does, by one event, `event` (of the stream's device), recorded after them
/// all: [`Gathered`] returns it, for the caller to wait for, and whether the kernel took
/// them.
///
/// No other thread may queue work touching these buffers on `stream` during the call: the
/// batch's event, recorded before the buffers are noted, replaces each buffer's latest use
/// on the stream, and a use queued and noted meanwhile would be forgotten (ferry's one
/// caller, the lane's gathers, holds the import cache's lock, under which alone imported
/// buffers are used; destinations are borrowed mutably).
///
/// # Errors
/// [`CudaError::Misuse`] for a range outside a buffer or an event of another device; a
/// driver error otherwise.
pub fn copy_many_async<D: DeviceMemory, S: DeviceMemory>(
    pairs: &mut [Pair<'_, D, S>],
    stream: &Stream,
    event: Event,
) -> Result<Gathered, CudaError> {
    of_stream(&event, stream)?;
    let mut runs = Runs {
        one_gpu: true,
        ..Runs::default()
    };
    for p in pairs.iter() {
        range("destination", 0, p.len, p.dst.len())?;
        range("source", p.src_offset, p.len, p.src.len())?;
        if p.len == 0 {
            continue;
        }
        runs.one_gpu &=
            p.src.device().same_as(stream.device()) && p.dst.device().same_as(stream.device());
        runs.dsts.push(p.dst.device_ptr());
        runs.srcs.push(p.src.device_ptr() + p.src_offset as u64);
        runs.sizes.push(p.len);
    }
    if runs.sizes.is_empty() {
        event.record(stream)?;
        return Ok(Gathered {
            kernel: false,
            ended: Arc::new(event),
        });
    }
    stream.bind()?;
    // SAFETY: every run lies inside its live buffer (checked above); the uses recorded
    // below keep them allocated until the copies passed; destinations are distinct
    // buffers (each borrowed mutably once); the stream's context is current (bound above).
    let queued = unsafe { runs.flush(stream, 1) };
    // Recorded whatever was queued, also when a later copy failed to queue: every buffer
    // stays allocated until what did get queued has passed. One event for them all.
    let used: Vec<&dyn sealed::Sealed> = pairs
        .iter()
        .flat_map(|p| [&*p.dst as &dyn sealed::Sealed, p.src])
        .collect();
    let ended = mark_uses(stream, event, &used)?;
    Ok(Gathered {
        kernel: queued?,
        ended,
    })
}

/// What [`copy_many_async`] queued.
#[derive(Debug)]
pub struct Gathered {
    /// Whether the gather kernel took the copies (else the copy engine did, one by one).
    pub kernel: bool,
    /// The event recorded after them all (the caller's to wait for).
    pub ended: Arc<Event>,
}

/// How [`copy_and_wait`] waits for its copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// In the driver (`cuStreamSynchronize`): the thread may sleep, and pays a wake-up.
    Synchronize,
    /// Polling the stream from this thread ([`Stream::spin`]): for copies of a few
    /// microseconds, where the wake-up would cost as much as the copy (an 8-byte peer copy
    /// on the H200 x2: 6.9–8.1 µs polled, 10.6–15.0 µs synchronised).
    Spin,
}

/// Copies `len` bytes from `src[src_offset..]` to the start of `dst` and blocks until the
/// copy has completed, waiting as `wait` says. Both stay borrowed until then, so no use
/// needs recording: the cheapest copy for a few bytes (no event created or recorded).
///
/// # Errors
/// [`CudaError::Misuse`] for a range outside either buffer; a driver error otherwise.
pub fn copy_and_wait(
    dst: &mut impl DeviceMemory,
    src: &impl DeviceMemory,
    src_offset: usize,
    len: usize,
    stream: &Stream,
    wait: Wait,
) -> Result<(), CudaError> {
    // SAFETY: both stay borrowed, and so allocated, until the stream has drained.
    if unsafe { enqueue(dst, 0, src, src_offset, len, stream) }? {
        match wait {
            Wait::Synchronize => stream.synchronize()?,
            Wait::Spin => stream.spin()?,
        }
    }
    Ok(())
}

/// Checks both ranges and queues the copy on `stream`; false when there was nothing to copy.
///
/// # Safety
/// The caller keeps both allocations alive until the copy has completed on `stream`.
unsafe fn enqueue(
    dst: &mut impl DeviceMemory,
    dst_offset: usize,
    src: &impl DeviceMemory,
    src_offset: usize,
    len: usize,
    stream: &Stream,
) -> Result<bool, CudaError> {
    let (dptr, dlen) = dst.region();
    let (sptr, slen) = src.region();
    range("destination", dst_offset, len, dlen)?;
    range("source", src_offset, len, slen)?;
    if len == 0 {
        return Ok(false);
    }
    stream.bind()?;
    // SAFETY: both ranges lie inside live allocations (checked above), kept alive by the
    // caller until the copy completes, and `stream` is alive for the call.
    unsafe {
        raw::memcpy_async(
            dptr + dst_offset as u64,
            sptr + src_offset as u64,
            len,
            stream.handle(),
        )
    }?;
    Ok(true)
}

/// Copies `src` into `dst[offset..]` and blocks until the copy has completed (the host slice
/// may be pageable, so the copy is not left running past the borrow).
///
/// # Errors
/// [`CudaError::Misuse`] for a range outside the buffer; a driver error otherwise.
pub fn copy_from_host(
    dst: &mut impl DeviceMemory,
    offset: usize,
    src: &[u8],
    stream: &Stream,
) -> Result<(), CudaError> {
    let (dptr, dlen) = dst.region();
    range("destination", offset, src.len(), dlen)?;
    if src.is_empty() {
        return Ok(());
    }
    stream.bind()?;
    // SAFETY: the device range is inside a live allocation (checked above); `src` is borrowed
    // until the stream is synchronised below, so it outlives the copy.
    unsafe {
        raw::memcpy_htod_async(
            dptr + offset as u64,
            src.as_ptr(),
            src.len(),
            stream.handle(),
        )
    }?;
    dst.note_use(stream)?;
    stream.synchronize()
}

/// Copies `src[offset..offset + dst.len()]` into `dst` and blocks until it has completed.
///
/// # Errors
/// [`CudaError::Misuse`] for a range outside the buffer; a driver error otherwise.
pub fn copy_to_host(
    dst: &mut [u8],
    src: &impl DeviceMemory,
    offset: usize,
    stream: &Stream,
) -> Result<(), CudaError> {
    let (sptr, slen) = src.region();
    range("source", offset, dst.len(), slen)?;
    if dst.is_empty() {
        return Ok(());
    }
    stream.bind()?;
    // SAFETY: the device range is inside a live allocation (checked above); `dst` is borrowed
    // mutably until the stream is synchronised below, so nothing else touches it meanwhile.
    unsafe {
        raw::memcpy_dtoh_async(
            dst.as_mut_ptr(),
            sptr + offset as u64,
            dst.len(),
            stream.handle(),
        )
    }?;
    src.note_use(stream)?;
    stream.synchronize()
}

/// Fills `dst[offset..offset + len]` with `value` (`cuMemsetD8Async`); returns once queued.
///
/// # Errors
/// [`CudaError::Misuse`] for a range outside the buffer; a driver error otherwise.
pub fn fill_async(
    dst: &mut impl DeviceMemory,
    offset: usize,
    len: usize,
    value: u8,
    stream: &Stream,
) -> Result<(), CudaError> {
    let (dptr, dlen) = dst.region();
    range("destination", offset, len, dlen)?;
    if len == 0 {
        return Ok(());
    }
    stream.bind()?;
    // SAFETY: the range is inside a live allocation, kept until the recorded use passes.
    unsafe { raw::memset_d8_async(dptr + offset as u64, value, len, stream.handle()) }?;
    dst.note_use(stream)
}

/// Page-locked host memory (`cuMemHostAlloc`, portable to every context): the spill tier,
/// and the fast path for host↔device copies (~55 GB/s on the H200 machines).
///
/// Dropping it blocks until the copies queued on it have completed, then frees it
/// (`cuMemFreeHost`).
pub struct PinnedBuffer {
    device: Device,
    ptr: *mut u8,
    len: usize,
    uses: Uses,
}

// SAFETY: the buffer owns its allocation (like a Box<[u8]>); the raw pointer is reached only
// through &self/&mut self methods that follow Rust's borrowing rules.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only reads the memory (after waiting for device writes).
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` bytes of pinned host memory, zeroed. `device` supplies the context for
    /// the allocation (the memory is usable from every device).
    ///
    /// # Errors
    /// [`CudaError::Misuse`] for zero bytes; a driver error (e.g. out of memory) otherwise.
    pub fn new(device: &Device, len: usize) -> Result<PinnedBuffer, CudaError> {
        if len == 0 {
            return Err(CudaError::Misuse("a pinned buffer of zero bytes".into()));
        }
        device.bind()?;
        // SAFETY: a context is current (bound above).
        let ptr = unsafe { raw::mem_host_alloc(len) }?;
        // SAFETY: the driver returned `len` writable bytes at `ptr`, used by nothing else yet.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedBuffer {
            device: device.clone(),
            ptr,
            len,
            uses: Uses::default(),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a pinned buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, after waiting for the copies queued on this buffer (blocks).
    ///
    /// # Errors
    /// A driver error from a queued copy.
    pub fn host(&mut self) -> Result<&[u8], CudaError> {
        self.uses.wait_all()?;
        // SAFETY: `len` initialised bytes owned by self; no copy is in flight (waited above)
        // and none can start while the returned borrow of `self` lives.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }

    /// The bytes, writable, after waiting for the copies queued on this buffer (blocks).
    ///
    /// # Errors
    /// A driver error from a queued copy.
    pub fn host_mut(&mut self) -> Result<&mut [u8], CudaError> {
        self.uses.wait_all()?;
        // SAFETY: as in `host`, and the borrow is exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let done = self.uses.wait_all().and_then(|()| {
            self.device.bind()?;
            // SAFETY: allocated by cuMemHostAlloc, freed once, and every copy using it has
            // completed (waited above).
            unsafe { raw::mem_free_host(self.ptr) }
        });
        if let Err(e) = done {
            // Freeing memory a copy may still write is worse than leaking it.
            teardown_failed!(
                e,
                len = self.len,
                "freeing pinned host memory failed; leaked"
            );
        }
    }
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .finish()
    }
}

/// A shared-memory ring page-locked for the copy engine (`cuMemHostRegister`, portable to
/// every context): copies between a GPU and its slots run at the pinned rate instead of
/// going through the driver's own bounce buffers. Holds the ring, so the mapping outlives
/// the registration; dropping it unregisters (callers drop it only once their copies
/// completed: every copy into or out of a slot is waited for before the slot changes hands).
pub struct PinnedRing {
    ring: std::sync::Arc<crate::link::ring::Ring>,
    device: Device,
}

impl PinnedRing {
    /// Registers the whole of `ring`'s mapping, using `device`'s context.
    ///
    /// # Errors
    /// A driver error (no driver, or the kernel refused to lock that much memory:
    /// `RLIMIT_MEMLOCK`).
    pub fn new(
        device: &Device,
        ring: std::sync::Arc<crate::link::ring::Ring>,
    ) -> Result<PinnedRing, CudaError> {
        device.bind()?;
        let (ptr, len) = ring.mapping();
        // SAFETY: a context is current (bound above); the mapping is live and stays mapped
        // while `self` holds the ring, and is unregistered in `drop` before that.
        unsafe { raw::mem_host_register(ptr, len) }?;
        Ok(PinnedRing {
            ring,
            device: device.clone(),
        })
    }

    /// The ring.
    pub fn ring(&self) -> &std::sync::Arc<crate::link::ring::Ring> {
        &self.ring
    }
}

impl Drop for PinnedRing {
    fn drop(&mut self) {
        let (ptr, _) = self.ring.mapping();
        let done = self.device.bind().and_then(|()| {
            // SAFETY: registered once in `new`; copies through it were waited for.
            unsafe { raw::mem_host_unregister(ptr) }
        });
        if let Err(e) = done {
            teardown_failed!(e, "unregistering a staging ring failed");
        }
    }
}

impl std::fmt::Debug for PinnedRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedRing")
            .field("ring", &self.ring)
            .finish()
    }
}

/// Queues a copy of `len` bytes from pinned `src[src_offset..]` to `dst[dst_offset..]`.
///
/// # Errors
/// [`CudaError::Misuse`] for a range outside a buffer; a driver error otherwise.
pub fn copy_from_pinned_async(
    dst: &mut impl DeviceMemory,
    dst_offset: usize,
    src: &PinnedBuffer,
    src_offset: usize,
    len: usize,
    stream: &Stream,
) -> Result<(), CudaError> {
    let (dptr, dlen) = dst.region();
    range("destination", dst_offset, len, dlen)?;
    range("source", src_offset, len, src.len)?;
    if len == 0 {
        return Ok(());
    }
    stream.bind()?;
    // SAFETY: both ranges are inside live allocations (checked above) that stay allocated
    // until the copy passes (recorded below; both types wait for their uses before freeing).
    // Host writes to `src` need `&mut`, which waits for this use first.
    unsafe {
        raw::memcpy_htod_async(
            dptr + dst_offset as u64,
            src.ptr.add(src_offset),
            len,
            stream.handle(),
        )
    }?;
    dst.note_use(stream)?;
    src.uses.note(stream)
}

/// Queues a copy of `len` bytes from `src[src_offset..]` to pinned `dst[dst_offset..]`.
/// Read the result with [`PinnedBuffer::host`], which waits for it.
///
/// # Errors
/// [`CudaError::Misuse`] for a range outside a buffer; a driver error otherwise.
pub fn copy_to_pinned_async(
    dst: &mut PinnedBuffer,
    dst_offset: usize,
    src: &impl DeviceMemory,
    src_offset: usize,
    len: usize,
    stream: &Stream,
) -> Result<(), CudaError> {
    let (sptr, slen) = src.region();
    range("destination", dst_offset, len, dst.len)?;
    range("source", src_offset, len, slen)?;
    if len == 0 {
        return Ok(());
    }
    stream.bind()?;
    // SAFETY: as in `copy_from_pinned_async`; host reads of `dst` wait for this use first.
    unsafe {
        raw::memcpy_dtoh_async(
            dst.ptr.add(dst_offset),
            sptr + src_offset as u64,
            len,
            stream.handle(),
        )
    }?;
    src.note_use(stream)?;
    dst.uses.note(stream)
}
