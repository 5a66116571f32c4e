//! Memory kinds, buffers and leases.
//!
//! A [`Buffer`] is a lease on a region of one memory domain: `(kind, id, generation, len)`.
//! Addresses never identify a buffer. A buffer has one owner at a time; dropping it returns
//! its bytes to the domain's allocator through the [`Releaser`] it was granted with.
//! While a transport streams a buffer it holds a [`SharedBytes`] view, and the buffer cannot
//! be written or given back until that view is dropped.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use crate::cuda::{CudaError, DeviceBuffer, DeviceMemory};

mod host;

use crate::wire::Layout;
use crate::wire::WireMemoryKind;
pub use host::{HostBytes, HostSource, MappedHost};

/// Where a buffer's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Pageable host memory.
    Host,
    /// Page-locked host memory (ordinary host memory counted under its own budget when
    /// there is no CUDA driver).
    PinnedHost,
    /// Memory of the GPU with this CUDA ordinal.
    Device(u32),
}

impl MemoryKind {
    /// The wire form.
    pub fn to_wire(self) -> WireMemoryKind {
        match self {
            Self::Host => WireMemoryKind::Host,
            Self::PinnedHost => WireMemoryKind::PinnedHost,
            Self::Device(n) => WireMemoryKind::Device(n),
        }
    }

    /// From the wire form.
    pub fn from_wire(kind: WireMemoryKind) -> Self {
        match kind {
            WireMemoryKind::Host => Self::Host,
            WireMemoryKind::PinnedHost => Self::PinnedHost,
            WireMemoryKind::Device(n) => Self::Device(n),
        }
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Host => f.write_str("host"),
            Self::PinnedHost => f.write_str("pinned"),
            Self::Device(n) => write!(f, "device{n}"),
        }
    }
}

/// A buffer's id within its domain. Ids are never reused within a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub u64);

/// Bumped each time a domain hands out memory under an id, so a stale key is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u64);

/// What identifies a granted region of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    /// The domain the memory belongs to.
    pub kind: MemoryKind,
    /// The buffer's id.
    pub id: BufferId,
    /// The grant's generation.
    pub generation: Generation,
    /// Length in bytes.
    pub len: u64,
}

/// Gives a lease's memory back to its domain. Implemented by the allocator.
///
/// `release` is called exactly once per lease, from whatever thread drops the last view of
/// the buffer; it must not block.
pub trait Releaser: Send + Sync + 'static {
    /// Returns the lease's bytes to the domain's budget.
    fn release(&self, lease: &Lease);

    /// Returns a host buffer's lease to the domain's budget, with its memory (`bytes`, of
    /// whatever length the buffer had last), which the domain may keep for a later grant
    /// that overwrites it whole. The default frees the memory and calls
    /// [`Releaser::release`]. Same rules as `release`: called once, must not block.
    fn release_host(&self, lease: &Lease, bytes: Box<[u8]>) {
        drop(bytes);
        self.release(lease);
    }

    /// Returns a device buffer's lease to the domain's budget, with its memory, which no
    /// peer keeps mapped: the domain may keep it for a later grant on the stream it was
    /// allocated on that overwrites it whole ([`DeviceBuffer::reuse`]). The default frees
    /// it (stream-ordered after its recorded uses) and calls [`Releaser::release`]. Same
    /// rules as `release`.
    fn release_device(&self, lease: &Lease, memory: DeviceBuffer) {
        drop(memory);
        self.release(lease);
    }
}

/// Where a buffer can get memory in another tier: the node that granted it. Lets
/// [`Buffer::promote`] work without a handle to the node.
pub trait MemoryHome: Send + Sync + 'static {
    /// A buffer of `len` bytes of `kind` memory, waiting for budget until `deadline`
    /// (no spill: it lands in `kind` or fails).
    fn reserve(
        &self,
        kind: MemoryKind,
        len: u64,
        deadline: Instant,
    ) -> Pin<Box<dyn Future<Output = Result<Buffer, ReserveError>> + Send>>;
}

/// Why a [`MemoryHome`] could not reserve a buffer (its own error, kept as the source).
pub type ReserveError = Box<dyn std::error::Error + Send + Sync>;

/// A promotion that did not happen; the buffer is given back untouched.
#[derive(Debug, thiserror::Error)]
#[error("cannot promote the buffer to {kind} memory: {reason}")]
pub struct PromoteError {
    /// The buffer, where it was.
    pub buffer: Buffer,
    /// The tier asked for.
    pub kind: MemoryKind,
    /// Why.
    pub reason: String,
}

/// A buffer's bytes: host memory the CPU reads (the heap's or a source's mapping), or
/// device memory of an exportable pool.
enum Bytes {
    Host(HostBytes),
    Device(DeviceBuffer),
}

struct Storage {
    lease: Lease,
    bytes: Bytes,
    releaser: Arc<dyn Releaser>,
    home: Option<Arc<dyn MemoryHome>>,
    /// Peers that may keep this device memory mapped (ipc): it is freed only after each
    /// of them unmapped it.
    mapped: std::sync::Mutex<Vec<Arc<dyn Unmapper>>>,
}

/// A peer that maps device buffers it pulled, and keeps them mapped for the next pull of
/// the same buffer. Before such a buffer's memory is freed, the peer must unmap it.
pub trait Unmapper: Send + Sync + 'static {
    /// The buffer under `lease` is being freed: have the peer unmap it, then drop `done`
    /// (which frees the memory once every peer that mapped it has done so). Called from
    /// whatever thread drops the buffer; must not block.
    fn unmap(&self, lease: Lease, done: UnmapDone);
}

/// Frees a device buffer's memory, and gives its bytes back to the budget, when the last
/// peer that mapped it dropped its `UnmapDone`. Dropping it is the only way to use it: a
/// peer lost or misbehaving cannot keep the memory forever, only as long as the holder
/// keeps this.
pub struct UnmapDone {
    inner: Arc<DeferredFree>,
}

struct DeferredFree {
    lease: Lease,
    memory: std::sync::Mutex<Option<DeviceBuffer>>,
    releaser: Arc<dyn Releaser>,
}

impl Drop for DeferredFree {
    fn drop(&mut self) {
        let memory = self
            .memory
            .get_mut()
            .map(Option::take)
            .unwrap_or_else(|p| p.into_inner().take());
        // No peer maps it any more: its domain may keep it, or frees it into its pool
        // (and gives the pool's memory to the GPU once none went in for keep_idle).
        match memory {
            Some(memory) => self.releaser.release_device(&self.lease, memory),
            None => self.releaser.release(&self.lease),
        }
    }
}

impl fmt::Debug for UnmapDone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnmapDone")
            .field("lease", &self.inner.lease)
            .finish()
    }
}

/// What memory granted for a receive holds when it is handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// Zeroes for host memory (device memory holds whatever its pool gives).
    Zeroed,
    /// Anything: the caller overwrites every byte before any is read (a streamed receive,
    /// whose chunks arrive in order until the last byte). Host memory may then be memory
    /// of a buffer dropped earlier, with its old bytes, granted without zeroing.
    Overwritten,
}

/// Why bytes could not be read from or written to a buffer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// A transport still holds a view of the buffer.
    #[error("the buffer is shared with a transport and cannot be written")]
    Shared,
    /// The range lies outside the buffer.
    #[error("{len} bytes at offset {offset} overrun a buffer of {size} bytes")]
    OutOfBounds {
        /// Start of the range.
        offset: usize,
        /// Its length.
        len: usize,
        /// The buffer's length.
        size: usize,
    },
    /// The device copy failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A layout does not fit the buffer.
    #[error(transparent)]
    Layout(#[from] crate::wire::LayoutError),
}

impl Drop for Storage {
    fn drop(&mut self) {
        let mapped = std::mem::take(self.mapped.get_mut().unwrap_or_else(|p| p.into_inner()));
        let bytes = std::mem::replace(&mut self.bytes, Bytes::Host(HostBytes::default()));
        match bytes {
            Bytes::Device(memory) if !mapped.is_empty() => {
                // Peers keep it mapped: free it (and give the bytes back) once they all
                // unmapped it. The shared `DeferredFree` does both when the last `UnmapDone`
                // goes.
                let deferred = Arc::new(DeferredFree {
                    lease: self.lease,
                    memory: std::sync::Mutex::new(Some(memory)),
                    releaser: Arc::clone(&self.releaser),
                });
                for peer in mapped {
                    peer.unmap(
                        self.lease,
                        UnmapDone {
                            inner: Arc::clone(&deferred),
                        },
                    );
                }
            }
            Bytes::Host(HostBytes::Heap(bytes)) => self.releaser.release_host(&self.lease, bytes),
            Bytes::Host(mapped) => {
                // Back to its source first: the budget may grant it again at once.
                drop(mapped);
                self.releaser.release(&self.lease);
            }
            Bytes::Device(memory) => self.releaser.release_device(&self.lease, memory),
        }
    }
}

/// A lease on memory, with the bytes it covers.
///
/// Moving a `Buffer` moves the lease; dropping it gives the memory back to its domain.
pub struct Buffer {
    storage: Arc<Storage>,
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("lease", &self.storage.lease)
            .finish()
    }
}

impl Buffer {
    /// Wraps zeroed host memory of `lease.len` bytes granted under `lease`. Used by allocators.
    ///
    /// # Panics
    /// Never for lengths that fit the address space; the allocation itself aborts on
    /// exhaustion like any Rust allocation, which is why budgets are checked first.
    pub fn new_host(lease: Lease, releaser: Arc<dyn Releaser>) -> Self {
        Self::with_home(lease, releaser, None)
    }

    /// Like [`Self::new_host`], for a buffer that can be promoted through `home`.
    pub fn with_home(
        lease: Lease,
        releaser: Arc<dyn Releaser>,
        home: Option<Arc<dyn MemoryHome>>,
    ) -> Self {
        let len = usize::try_from(lease.len).unwrap_or(usize::MAX);
        Self {
            storage: Arc::new(Storage {
                lease,
                bytes: Bytes::Host(HostBytes::Heap(vec![0u8; len].into_boxed_slice())),
                releaser,
                home,
                mapped: std::sync::Mutex::default(),
            }),
        }
    }

    /// Wraps host memory granted under `lease` whose bytes are `bytes` as they are (not
    /// zeroed): memory kept from an earlier buffer ([`Releaser::release_host`]), for a
    /// grant that is overwritten whole before anyone reads it. Used by allocators.
    ///
    /// # Errors
    /// Gives `bytes` back when their length is not `lease.len`.
    pub fn from_host_bytes(
        lease: Lease,
        bytes: Box<[u8]>,
        releaser: Arc<dyn Releaser>,
        home: Option<Arc<dyn MemoryHome>>,
    ) -> Result<Self, Box<[u8]>> {
        if bytes.len() as u64 != lease.len {
            return Err(bytes);
        }
        match Self::from_host(lease, HostBytes::Heap(bytes), releaser, home) {
            Ok(buffer) => Ok(buffer),
            Err(HostBytes::Heap(bytes)) => Err(bytes),
            Err(HostBytes::Mapped { .. }) => Err(Box::default()),
        }
    }

    /// Wraps host memory granted under `lease` whose bytes are `bytes` as they are: the
    /// heap's, or memory a [`HostSource`] lent (given back to it when the buffer drops).
    /// Used by allocators.
    ///
    /// # Errors
    /// Gives `bytes` back when their length is not `lease.len`.
    pub fn from_host(
        lease: Lease,
        bytes: HostBytes,
        releaser: Arc<dyn Releaser>,
        home: Option<Arc<dyn MemoryHome>>,
    ) -> Result<Self, HostBytes> {
        if bytes.len() as u64 != lease.len {
            return Err(bytes);
        }
        Ok(Self {
            storage: Arc::new(Storage {
                lease,
                bytes: Bytes::Host(bytes),
                releaser,
                home,
                mapped: std::sync::Mutex::default(),
            }),
        })
    }

    /// Wraps device memory granted under `lease` (its length is the memory's). Used by the
    /// GPU allocators.
    pub fn new_device(
        mut lease: Lease,
        memory: DeviceBuffer,
        releaser: Arc<dyn Releaser>,
        home: Option<Arc<dyn MemoryHome>>,
    ) -> Self {
        lease.len = memory.len() as u64;
        Self {
            storage: Arc::new(Storage {
                lease,
                bytes: Bytes::Device(memory),
                releaser,
                home,
                mapped: std::sync::Mutex::default(),
            }),
        }
    }

    /// Moves the bytes into `kind` memory (typically back from a tier it spilled to),
    /// waiting for that tier's budget until `deadline`. The copy is byte-exact and the old
    /// memory is released. A buffer already in `kind` comes back as it is.
    ///
    /// # Errors
    /// [`PromoteError`], with the buffer untouched, when the tier cannot grant in time, or
    /// the buffer did not come from a node (or is still shared with a transport).
    ///
    /// # Cancel safety
    /// Dropping the future drops the buffer (its memory is released).
    pub async fn promote(
        self,
        kind: MemoryKind,
        deadline: Instant,
    ) -> Result<Buffer, PromoteError> {
        if self.kind() == kind {
            return Ok(self);
        }
        let fail = |buffer: Buffer, reason: String| PromoteError {
            buffer,
            kind,
            reason,
        };
        let Some(home) = self.storage.home.clone() else {
            return Err(fail(self, "the buffer did not come from a node".into()));
        };
        match home.reserve(kind, self.len() as u64, deadline).await {
            Ok(mut target) => match target.copy_from(&self) {
                Ok(()) => {
                    metrics::counter!("ferry_promoted_bytes_total").increment(target.len() as u64);
                    Ok(target)
                }
                Err(e) => Err(fail(self, e.to_string())),
            },
            Err(reason) => Err(fail(self, reason.to_string())),
        }
    }

    /// Copies every byte of `src` (same length) into this buffer, whatever memory either
    /// lives in; returns once the bytes are in place.
    ///
    /// # Errors
    /// [`MemoryError::Shared`] while a transport holds this buffer,
    /// [`MemoryError::OutOfBounds`] for different lengths, [`MemoryError::Cuda`] when a
    /// device copy fails.
    pub fn copy_from(&mut self, src: &Buffer) -> Result<(), MemoryError> {
        if src.len() != self.len() {
            return Err(MemoryError::OutOfBounds {
                offset: 0,
                len: src.len(),
                size: self.len(),
            });
        }
        match &src.storage.bytes {
            Bytes::Host(bytes) => self.write(0, &bytes[..]),
            Bytes::Device(from) => {
                let dst = Arc::get_mut(&mut self.storage).ok_or(MemoryError::Shared)?;
                match &mut dst.bytes {
                    Bytes::Host(bytes) => {
                        crate::cuda::copy_to_host(bytes, from, 0, &from.stream())?;
                    }
                    Bytes::Device(to) => {
                        let stream = to.stream();
                        crate::cuda::copy_async(to, 0, from, 0, from.len(), &stream)?;
                        stream.synchronize()?;
                    }
                }
                Ok(())
            }
        }
    }

    /// Writes `src` at `offset`, whatever memory the buffer lives in; returns once the bytes
    /// are in place (a device buffer's stream is synchronised).
    ///
    /// # Errors
    /// As [`Self::copy_from`].
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), MemoryError> {
        check_range(offset, src.len(), self.len())?;
        let storage = Arc::get_mut(&mut self.storage).ok_or(MemoryError::Shared)?;
        match &mut storage.bytes {
            Bytes::Host(bytes) => bytes[offset..offset + src.len()].copy_from_slice(src),
            Bytes::Device(dev) => {
                let stream = dev.stream();
                crate::cuda::copy_from_host(dev, offset, src, &stream)?;
            }
        }
        Ok(())
    }

    /// Reads `dst.len()` bytes at `offset` into `dst`, whatever memory the buffer lives in.
    ///
    /// # Errors
    /// [`MemoryError::OutOfBounds`], [`MemoryError::Cuda`].
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), MemoryError> {
        self.share().read(offset, dst)
    }

    /// Puts `packed` (a layout's rows one after the other, as a transfer sent with that
    /// layout arrives) back at `layout`'s places in this buffer, whatever memory either
    /// lives in: receiving into a layout. Bytes between the rows are left as they are. On
    /// a GPU it is a few 3D copies (`cuMemcpy3DAsync`), never a copy per row, and a block
    /// list's blocks are one batch of copies where the driver has `cuMemcpyBatchAsync` (one
    /// copy per block otherwise); returns once the bytes are in place. A block list need not
    /// be the sender's: any list of places in this buffer that packs to `packed.len()`.
    ///
    /// # Errors
    /// [`MemoryError::Layout`] when the layout does not fit this buffer or, a block list,
    /// has blocks that overlap ([`Layout::check_destination`]), before anything is written;
    /// [`MemoryError::OutOfBounds`] when `packed` is not its packed length,
    /// [`MemoryError::Shared`] while a transport holds this buffer, [`MemoryError::Cuda`].
    pub fn scatter_from(&mut self, packed: &Buffer, layout: &Layout) -> Result<(), MemoryError> {
        let len = self.len();
        let n = layout.check_destination(len as u64)?;
        if packed.len() as u64 != n {
            return Err(MemoryError::OutOfBounds {
                offset: 0,
                len: packed.len(),
                size: usize::try_from(n).unwrap_or(usize::MAX),
            });
        }
        let boxes = layout.boxes(len as u64, 0, n)?;
        let storage = Arc::get_mut(&mut self.storage).ok_or(MemoryError::Shared)?;
        match (&mut storage.bytes, &packed.storage.bytes) {
            (Bytes::Host(dst), Bytes::Host(src)) => layout.scatter(src, 0, dst)?,
            (Bytes::Host(dst), Bytes::Device(_)) => layout.scatter(&packed.to_vec()?, 0, dst)?,
            (Bytes::Device(dst), Bytes::Host(src)) => {
                let stream = dst.stream();
                crate::cuda::scatter_boxes_from_host(dst, src, &boxes, &stream)?;
            }
            (Bytes::Device(dst), Bytes::Device(src)) => {
                let stream = dst.stream();
                crate::cuda::scatter_boxes_async(dst, src, 0, &boxes, &stream)?;
                stream.synchronize()?;
            }
        }
        Ok(())
    }

    /// The bytes, whatever memory they live in: borrowed for host memory, copied out for
    /// device memory.
    ///
    /// # Errors
    /// [`MemoryError::Cuda`] when the device copy fails.
    pub fn bytes(&self) -> Result<std::borrow::Cow<'_, [u8]>, MemoryError> {
        match self.as_slice() {
            Some(host) => Ok(std::borrow::Cow::Borrowed(host)),
            None => self.to_vec().map(std::borrow::Cow::Owned),
        }
    }

    /// The whole buffer copied into a `Vec`, whatever memory it lives in.
    ///
    /// # Errors
    /// [`MemoryError::Cuda`] when a device copy fails.
    pub fn to_vec(&self) -> Result<Vec<u8>, MemoryError> {
        let mut out = vec![0u8; self.len()];
        self.read(0, &mut out)?;
        Ok(out)
    }

    /// The device memory, for a buffer that lives on a GPU.
    pub fn device_memory(&self) -> Option<&DeviceBuffer> {
        match &self.storage.bytes {
            Bytes::Device(d) => Some(d),
            Bytes::Host(_) => None,
        }
    }

    /// The memory a [`HostSource`] lent for this buffer; `None` for heap or device memory.
    pub fn source_memory(&self) -> Option<&dyn MappedHost> {
        match &self.storage.bytes {
            Bytes::Host(h) => h.source_memory(),
            Bytes::Device(_) => None,
        }
    }

    /// `peer` may keep this buffer mapped after a transfer: when the buffer is dropped, its
    /// memory is freed only after `peer` unmapped it ([`Unmapper`]). Noting the same peer
    /// twice changes nothing.
    pub fn note_mapped(&self, peer: Arc<dyn Unmapper>) {
        self.storage.note_mapped(peer);
    }

    /// The device memory, writable; `None` for host memory or while a transport still holds
    /// a view of the buffer.
    pub fn device_memory_mut(&mut self) -> Option<&mut DeviceBuffer> {
        match Arc::get_mut(&mut self.storage).map(|s| &mut s.bytes) {
            Some(Bytes::Device(d)) => Some(d),
            _ => None,
        }
    }

    /// Keeps only the first `len` bytes visible ([`Self::len`] says `len`); the lease, and
    /// what the budget counts, stay those of the whole grant. Used to hand out a buffer
    /// allocated ahead for a message of unknown length.
    ///
    /// # Errors
    /// [`MemoryError::Shared`] while a view is alive; [`MemoryError::OutOfBounds`] for a
    /// `len` past the current length.
    pub fn truncate(&mut self, len: usize) -> Result<(), MemoryError> {
        let size = self.len();
        if len > size {
            return Err(MemoryError::OutOfBounds {
                offset: 0,
                len,
                size,
            });
        }
        match Arc::get_mut(&mut self.storage).map(|s| &mut s.bytes) {
            Some(Bytes::Device(d)) => Ok(d.truncate(len)?),
            Some(Bytes::Host(b)) => {
                b.truncate(len);
                Ok(())
            }
            None => Err(MemoryError::Shared),
        }
    }

    /// The buffer's lease.
    pub fn lease(&self) -> Lease {
        self.storage.lease
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.storage.len()
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the bytes live.
    pub fn kind(&self) -> MemoryKind {
        self.storage.lease.kind
    }

    /// The bytes, for host memory (the CPU can read them in place); `None` for device
    /// memory (use [`Self::read`] or [`Self::to_vec`]).
    pub fn as_slice(&self) -> Option<&[u8]> {
        self.storage.host()
    }

    /// The bytes, writable, for host memory; `None` for device memory or while a transport
    /// still holds a view of them.
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        match Arc::get_mut(&mut self.storage).map(|s| &mut s.bytes) {
            Some(Bytes::Host(b)) => Some(&mut b[..]),
            _ => None,
        }
    }

    /// A read-only view for a transport to stream from. The buffer stays unwritable until
    /// every view is dropped.
    pub fn share(&self) -> SharedBytes {
        SharedBytes {
            storage: Arc::clone(&self.storage),
        }
    }

    /// Another handle on the same bytes, for readers that each need a `Buffer` (a published
    /// buffer sent to several peers at once, a fetch shared by several callers). While more
    /// than one handle (or a [`SharedBytes`] view) is alive, none can write: the writes
    /// answer [`MemoryError::Shared`]. The memory goes back to its domain when the last one
    /// is dropped.
    pub fn read_only_handle(&self) -> Buffer {
        Buffer {
            storage: Arc::clone(&self.storage),
        }
    }

    /// True when no [`SharedBytes`] view is alive, so nothing else can touch the bytes.
    pub fn is_exclusive(&self) -> bool {
        Arc::strong_count(&self.storage) == 1
    }
}

/// A read-only view of a buffer's bytes held by a transport while it streams them.
#[derive(Clone)]
pub struct SharedBytes {
    storage: Arc<Storage>,
}

/// `len` bytes at `offset` lie inside `size` bytes.
fn check_range(offset: usize, len: usize, size: usize) -> Result<(), MemoryError> {
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(MemoryError::OutOfBounds { offset, len, size });
    }
    Ok(())
}

impl Storage {
    fn note_mapped(&self, peer: Arc<dyn Unmapper>) {
        let mut mapped = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        if !mapped.iter().any(|m| Arc::ptr_eq(m, &peer)) {
            mapped.push(peer);
        }
    }

    fn len(&self) -> usize {
        match &self.bytes {
            Bytes::Host(b) => b.len(),
            Bytes::Device(d) => d.len(),
        }
    }

    fn host(&self) -> Option<&[u8]> {
        match &self.bytes {
            Bytes::Host(b) => Some(b),
            Bytes::Device(_) => None,
        }
    }
}

impl SharedBytes {
    /// The memory a [`HostSource`] lent for these bytes; `None` for heap or device memory.
    pub fn source_memory(&self) -> Option<&dyn MappedHost> {
        match &self.storage.bytes {
            Bytes::Host(h) => h.source_memory(),
            Bytes::Device(_) => None,
        }
    }

    /// The bytes, for host memory; `None` for device memory.
    pub fn as_slice(&self) -> Option<&[u8]> {
        self.storage.host()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.storage.len()
    }

    /// True for zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The lease the bytes belong to.
    pub fn lease(&self) -> Lease {
        self.storage.lease
    }

    /// The device memory, for a buffer on a GPU.
    pub fn device_memory(&self) -> Option<&DeviceBuffer> {
        match &self.storage.bytes {
            Bytes::Device(d) => Some(d),
            Bytes::Host(_) => None,
        }
    }

    /// Reads `dst.len()` bytes at `offset` into `dst`, whatever memory they live in.
    ///
    /// # Errors
    /// [`MemoryError::OutOfBounds`], [`MemoryError::Cuda`].
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), MemoryError> {
        check_range(offset, dst.len(), self.len())?;
        match &self.storage.bytes {
            Bytes::Host(b) => dst.copy_from_slice(&b[offset..offset + dst.len()]),
            Bytes::Device(d) => crate::cuda::copy_to_host(dst, d, offset, &d.stream())?,
        }
        Ok(())
    }

    /// Reads the packed bytes `[from, from + dst.len())` of `layout` into `dst`, whatever
    /// memory they live in: rows copied one by one from host memory, a few 3D copies from
    /// device memory (see [`Layout::boxes`]).
    ///
    /// # Errors
    /// [`MemoryError::Layout`] when the layout does not fit or the range is past it;
    /// [`MemoryError::Cuda`].
    pub fn read_packed(
        &self,
        layout: &Layout,
        from: u64,
        dst: &mut [u8],
    ) -> Result<(), MemoryError> {
        match &self.storage.bytes {
            Bytes::Host(b) => layout.gather(&b[..self.len()], from, dst)?,
            Bytes::Device(d) => {
                let boxes = layout.boxes(self.len() as u64, from, dst.len() as u64)?;
                crate::cuda::copy_boxes_to_host(dst, d, 0, &boxes, &d.stream())?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedBytes")
            .field("lease", &self.storage.lease)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[derive(Default)]
    struct Count(AtomicU64);
    impl Releaser for Count {
        fn release(&self, lease: &Lease) {
            self.0.fetch_add(lease.len, Ordering::SeqCst);
        }
    }

    fn lease(len: u64) -> Lease {
        Lease {
            kind: MemoryKind::Host,
            id: BufferId(1),
            generation: Generation(1),
            len,
        }
    }

    #[test]
    fn read_only_handles_release_once_and_block_writes() {
        let count = Arc::new(Count::default());
        let mut buf = Buffer::new_host(lease(10), count.clone());
        let other = buf.read_only_handle();
        assert!(buf.as_mut_slice().is_none(), "two handles: neither writes");
        assert!(matches!(buf.write(0, b"x"), Err(MemoryError::Shared)));
        drop(other);
        assert!(buf.is_exclusive());
        assert!(buf.as_mut_slice().is_some(), "the last handle writes again");
        let other = buf.read_only_handle();
        drop(buf);
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            0,
            "one handle still holds it"
        );
        drop(other);
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            10,
            "released once, by the last"
        );
    }

    #[test]
    fn released_once_after_last_view() {
        let count = Arc::new(Count::default());
        let mut buf = Buffer::new_host(lease(10), count.clone());
        let view = buf.share();
        assert!(
            buf.as_mut_slice().is_none(),
            "shared buffer must not be writable"
        );
        drop(buf);
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            0,
            "a view still holds the bytes"
        );
        drop(view);
        assert_eq!(count.0.load(Ordering::SeqCst), 10);
    }
}
