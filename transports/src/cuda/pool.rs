//! Exportable memory pools: allocation, export to another process, and import there.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use super::copy::{DeviceMemory, Uses, sealed};
use super::device::Device;
use super::error::{CudaError, teardown_failed};
use super::external::{ExternalMemory, ReleaseSignal};
use super::raw;
use super::stream::{Stream, StreamInner};

/// The size of a pointer export (`CUmemPoolPtrExportData`).
pub const POINTER_EXPORT_LEN: usize = 64;

/// A stream-ordered memory pool on one device whose memory other processes can import
/// (`cuMemPoolCreate` with POSIX-fd handles, located on the device).
///
/// Its release threshold is set to "never": memory freed back to the pool stays reserved in
/// it, so a later allocation costs no call into the OS and exports stay cheap, until
/// [`ExportablePool::trim_to`] gives it back. Cheap to clone (clones share the pool);
/// buffers keep the pool alive.
#[derive(Clone)]
pub struct ExportablePool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    device: Device,
    handle: sys::CUmemoryPool,
    /// How peers name the pool ([`pool_name`]): its device's UUID and its generation.
    name: String,
    /// Set once a pointer of the pool was exported: memory that was, stays reserved after
    /// it is freed, whatever a trim asks, and the pool's own counters do not show it.
    exported: std::sync::atomic::AtomicBool,
    /// Buffers of the pool alive now (each holds the pool).
    live: std::sync::atomic::AtomicUsize,
    /// Other devices granted access to the pool's memory (a renewed pool grants them too).
    access: std::sync::Mutex<Vec<Device>>,
}

/// How peers name a node's pool on the GPU `uuid`: the UUID and the pool's generation (a
/// node replaces an idle pool that holds memory it cannot give back: see
/// [`ExportablePool::renewed`]).
pub fn pool_name(uuid: &str, generation: u64) -> String {
    format!("{uuid}#{generation}")
}

/// The GPU UUID a [`pool_name`] names (the whole name when it has no generation).
pub fn pool_device(name: &str) -> &str {
    name.rsplit_once('#').map_or(name, |(uuid, _)| uuid)
}

/// What a pool holds of its GPU's memory: reserved from the GPU, and used by live
/// allocations (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`, `..._USED_MEM_CURRENT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolUsage {
    /// Reserved from the GPU.
    pub reserved: u64,
    /// Backing live allocations.
    pub used: u64,
}

// SAFETY: a CUmemoryPool is a driver handle usable from any thread; the driver's pool calls
// are thread-safe.
unsafe impl Send for PoolInner {}
// SAFETY: as for Send.
unsafe impl Sync for PoolInner {}

impl Drop for PoolInner {
    fn drop(&mut self) {
        let done = self.device.bind().and_then(|()| {
            // SAFETY: created by cuMemPoolCreate/ImportFromShareableHandle; the last
            // reference (every buffer holds one), so no allocation of this process is live.
            unsafe { raw::mem_pool_destroy(self.handle) }
        });
        if let Err(e) = done {
            teardown_failed!(e, "destroying a CUDA memory pool failed");
        }
    }
}

impl ExportablePool {
    /// Creates an exportable pool on `device`, and exports it once (the descriptor is closed
    /// at once): the driver exports no pointer of a pool that was never shared
    /// (`cuMemPoolExportPointer` answered `CUDA_ERROR_INVALID_VALUE` on the H200 for a
    /// receiver lending its buffer to a push before any peer had fetched its pool).
    ///
    /// # Errors
    /// A driver error, e.g. `CUDA_ERROR_NOT_SUPPORTED` where the device cannot export pools
    /// as POSIX file descriptors (see the probe's `pool_posix_fd`).
    pub fn new(device: &Device) -> Result<ExportablePool, CudaError> {
        Self::create(device, 0)
    }

    /// A new pool on this pool's device, of the next generation (named apart from this one,
    /// so that peers import it as another pool). For a pool that holds memory no trim gives
    /// back: memory whose pointer was ever exported stays reserved in its pool after it is
    /// freed (measured on the H200: `cuMemPoolTrimTo` keeps it, and the pool's counters do
    /// not show it; it goes back to the GPU only once the pool is destroyed here and every
    /// peer's import of the pool is closed; transports/tests/cuda_trim.rs).
    ///
    /// # Errors
    /// As [`Self::new`].
    pub fn renewed(&self) -> Result<ExportablePool, CudaError> {
        let generation = pool_generation(&self.inner.name).saturating_add(1);
        let renewed = Self::create(&self.inner.device, generation)?;
        let granted = self
            .inner
            .access
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for device in &granted {
            renewed.grant_access(device)?;
        }
        Ok(renewed)
    }

    /// How many buffers of the pool are alive (allocated, not yet dropped).
    pub fn live_buffers(&self) -> usize {
        self.inner.live.load(std::sync::atomic::Ordering::Acquire)
    }

    fn create(device: &Device, generation: u64) -> Result<ExportablePool, CudaError> {
        device.bind()?;
        // SAFETY: the device's context is current (bound above).
        let handle = unsafe { raw::mem_pool_create_exportable(device.ordinal_c()) }?;
        let pool = ExportablePool {
            inner: Arc::new(PoolInner {
                device: device.clone(),
                handle,
                name: pool_name(device.uuid(), generation),
                exported: std::sync::atomic::AtomicBool::new(false),
                live: std::sync::atomic::AtomicUsize::new(0),
                access: std::sync::Mutex::default(),
            }),
        };
        // SAFETY: the pool was just created and is owned by `pool`.
        unsafe { raw::mem_pool_set_release_threshold(handle, u64::MAX) }?;
        drop(pool.export_fd()?);
        Ok(pool)
    }

    /// The device the pool's memory resides on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// How peers name the pool ([`pool_name`]).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// True once a pointer of the pool was exported ([`DeviceBuffer::export_pointer`]):
    /// then freed memory may stay reserved for good (see [`Self::renewed`]).
    pub fn has_exported(&self) -> bool {
        self.inner
            .exported
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// What the pool holds of the GPU's memory now, as the driver counts it (which, on the
    /// H200, leaves out freed memory whose pointer was exported: it says 0 reserved while
    /// that memory stays out of the GPU's free memory).
    ///
    /// # Errors
    /// A driver error.
    pub fn usage(&self) -> Result<PoolUsage, CudaError> {
        self.inner.device.bind()?;
        // SAFETY: the pool is alive for as long as `self`.
        let (reserved, used) = unsafe { raw::mem_pool_usage(self.inner.handle) }?;
        Ok(PoolUsage { reserved, used })
    }

    /// Allocates `len` bytes in stream order on `stream` (`cuMemAllocFromPoolAsync`): the
    /// memory is usable by work queued on `stream` after this call, and by other streams
    /// once they wait for it (an [`Event`](super::Event)). Contents are unspecified.
    ///
    /// The buffer is freed when dropped, with `cuMemFreeAsync` on this same stream, after
    /// waiting (on the GPU, not the host) for every copy through this layer that used it on
    /// other streams. Stream-ordered freeing is what the pool is built for: it never blocks
    /// the dropping thread, and the pool can hand the memory to the next allocation on the
    /// stream at once.
    ///
    /// # Errors
    /// [`CudaError::Misuse`] for zero bytes or a stream of another device; a driver error
    /// (e.g. `CUDA_ERROR_OUT_OF_MEMORY`) otherwise.
    pub fn alloc(&self, len: usize, stream: &Stream) -> Result<DeviceBuffer, CudaError> {
        if len == 0 {
            return Err(CudaError::Misuse("a device buffer of zero bytes".into()));
        }
        if !stream.device().same_as(&self.inner.device) {
            return Err(CudaError::Misuse(format!(
                "allocating from a pool of GPU {} on a stream of GPU {}",
                self.inner.device.ordinal(),
                stream.device().ordinal()
            )));
        }
        stream.bind()?;
        // SAFETY: pool and stream are alive for the call; the buffer below keeps both.
        let ptr =
            unsafe { raw::mem_alloc_from_pool_async(self.inner.handle, len, stream.handle()) }?;
        self.inner
            .live
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Ok(DeviceBuffer {
            origin: Origin::Pool(Arc::clone(&self.inner)),
            home: stream.shared(),
            ptr,
            len,
            capacity: len,
            uses: Uses::default(),
            export: std::sync::OnceLock::new(),
        })
    }

    /// Gives the pool's reserved memory that backs no allocation back to the GPU
    /// (`cuMemPoolTrimTo`), until at most `keep` bytes stay reserved, so that other
    /// processes and allocators can have it; a later allocation reserves memory anew (an
    /// OS call, slower than one the pool serves). Memory whose stream-ordered free has not
    /// been seen to end (wait for its stream first) may stay. Live allocations, and memory
    /// peers imported, are never touched.
    ///
    /// A driver call that may unmap memory: not for an actor's thread.
    ///
    /// # Errors
    /// A driver error.
    pub fn trim_to(&self, keep: usize) -> Result<(), CudaError> {
        self.inner.device.bind()?;
        // SAFETY: the pool is alive for as long as `self`.
        unsafe { raw::mem_pool_trim_to(self.inner.handle, keep) }
    }

    /// Lets `device` read and write this pool's allocations (`cuMemPoolSetAccess`); pool
    /// memory does not follow `cuCtxEnablePeerAccess`. The pool's own device always has
    /// access, so asking for it is a no-op.
    ///
    /// # Errors
    /// A driver error, e.g. when the two devices have no peer access.
    pub fn grant_access(&self, device: &Device) -> Result<(), CudaError> {
        if device.same_as(&self.inner.device) {
            return Ok(());
        }
        self.inner.device.bind()?;
        // SAFETY: the pool is alive for as long as `self`.
        unsafe { raw::mem_pool_set_access_rw(self.inner.handle, device.ordinal_c()) }?;
        let mut access = self.inner.access.lock().unwrap_or_else(|p| p.into_inner());
        if !access.iter().any(|d| d.same_as(device)) {
            access.push(device.clone());
        }
        Ok(())
    }

    /// A new file descriptor for the pool (`cuMemPoolExportToShareableHandle`), to pass to a
    /// same-host peer over a Unix socket (SCM_RIGHTS). Each call makes a new descriptor.
    ///
    /// # Errors
    /// A driver error.
    pub fn export_fd(&self) -> Result<OwnedFd, CudaError> {
        self.inner.device.bind()?;
        // SAFETY: the pool is alive and was created with POSIX-fd handles.
        let fd = unsafe { raw::mem_pool_export_fd(self.inner.handle) }?;
        if fd < 0 {
            return Err(CudaError::Misuse(format!(
                "the driver exported the pool as the invalid descriptor {fd}"
            )));
        }
        // SAFETY: the driver just opened this descriptor for the caller, who owns it; nothing
        // else in the process knows its number.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Imports a peer's pool from the descriptor it exported
    /// (`cuMemPoolImportFromShareableHandle`); the memory resides on `device` (the device of
    /// this process that is the exporter's GPU: match them by UUID). Costs about a
    /// millisecond: do it once per peer and device. The descriptor is closed afterwards (the
    /// driver keeps its own reference).
    ///
    /// # Errors
    /// A driver error, e.g. for a descriptor that is not a pool.
    pub fn import_fd(device: &Device, fd: OwnedFd, name: &str) -> Result<ImportedPool, CudaError> {
        device.bind()?;
        // SAFETY: `fd` is open for the duration of the call (owned here, closed on drop).
        let handle = unsafe { raw::mem_pool_import_fd(fd.as_raw_fd()) }?;
        drop(fd);
        Ok(ImportedPool {
            inner: Arc::new(PoolInner {
                device: device.clone(),
                handle,
                name: name.to_string(),
                exported: std::sync::atomic::AtomicBool::new(false),
                live: std::sync::atomic::AtomicUsize::new(0),
                access: std::sync::Mutex::default(),
            }),
        })
    }
}

/// The generation a [`pool_name`] holds (0 for a name without one).
fn pool_generation(name: &str) -> u64 {
    name.rsplit_once('#')
        .and_then(|(_, g)| g.parse().ok())
        .unwrap_or(0)
}

impl std::fmt::Debug for ExportablePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportablePool")
            .field("device", &self.inner.device.ordinal())
            .field("name", &self.inner.name)
            .finish()
    }
}

/// Device memory of a node: allocated from an [`ExportablePool`] (freed, stream-ordered,
/// when dropped), or memory the user allocated elsewhere and registered
/// ([`DeviceBuffer::register_external`]; never freed here).
pub struct DeviceBuffer {
    origin: Origin,
    home: Arc<StreamInner>,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// The allocation's length (`len` may be less: [`Self::truncate`]).
    capacity: usize,
    uses: Uses,
    /// The pointer export, made once (it names the allocation, which does not change).
    export: std::sync::OnceLock<[u8; POINTER_EXPORT_LEN]>,
}

/// Where a [`DeviceBuffer`]'s memory came from.
enum Origin {
    /// An exportable pool of this process: freed back to it on drop.
    Pool(Arc<PoolInner>),
    /// Registered by the user: never freed here.
    External(External),
}

/// Registered memory: a range of a `cuMemAlloc` allocation the user owns.
struct External {
    device: Device,
    /// The allocation's base, for its legacy IPC handle.
    base: sys::CUdeviceptr,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`: names the allocation for its whole life, unlike
    /// its address, which the driver reuses after a free.
    buffer_id: u64,
    /// Set when the registration ended (the buffer dropped, its copies complete).
    released: Arc<ReleaseSignal>,
}

/// The legacy IPC export of registered memory: the allocation's handle and identity, and
/// where the registered range starts within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LegacyExport {
    /// `cuIpcGetMemHandle`'s 64 bytes.
    pub handle: [u8; 64],
    /// The allocation's buffer id (the importer's cache key, with the exporting peer).
    pub buffer_id: u64,
    /// Offset of the registered range within the allocation.
    pub offset: u64,
}

// SAFETY: owns its allocation like a Box; the device address is only passed to the driver.
unsafe impl Send for DeviceBuffer {}
// SAFETY: shared access only queues reads (copies from it), which the driver makes safe.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// The 64 bytes that let a process which imported this buffer's pool import the buffer
    /// (`cuMemPoolExportPointer`). Not a handle: it grants nothing without the pool's fd.
    ///
    /// The importer must not read the memory before the allocation (and whatever wrote the
    /// data) has completed here: synchronise the stream or an event before sending it. The
    /// importer must free its import before this buffer is dropped (the transfer protocol's
    /// `Done` message).
    ///
    /// # Errors
    /// A driver error.
    /// Made once per buffer and remembered: a buffer sent again exports nothing.
    /// [`CudaError::Misuse`] for registered memory, which is not a pool's: see
    /// [`Self::export_legacy`].
    pub fn export_pointer(&self) -> Result<[u8; POINTER_EXPORT_LEN], CudaError> {
        if let Some(export) = self.export.get() {
            return Ok(*export);
        }
        let Origin::Pool(pool) = &self.origin else {
            return Err(CudaError::Misuse(
                "registered memory is not a pool allocation: it crosses as a legacy IPC handle"
                    .into(),
            ));
        };
        pool.device.bind()?;
        pool.exported
            .store(true, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: a live allocation of an exportable pool, kept alive by `self`.
        let export = unsafe { raw::mem_pool_export_pointer(self.ptr) }?;
        Ok(*self.export.get_or_init(|| export))
    }

    /// Wraps registered memory (`memory`, on `device`) so that it can be sent. Checked
    /// first: the range must lie inside one live allocation of `device` that supports legacy
    /// IPC. `stream` is used for the buffer's own copies (reads, writes) and must be of
    /// `device`. Dropping the buffer frees nothing; it waits for this layer's copies that use
    /// it, then sets the [`ReleaseSignal`] of [`Self::release_signal`].
    ///
    /// # Errors
    /// [`CudaError::Misuse`] for a range outside its allocation, memory of another device
    /// or memory legacy IPC cannot export (pool or VMM memory); a driver error for an
    /// address the driver does not know.
    pub fn register_external(
        memory: ExternalMemory,
        device: &Device,
        stream: &Stream,
    ) -> Result<DeviceBuffer, CudaError> {
        let (ptr, len) = (memory.ptr(), memory.len());
        if memory.device() as usize != device.ordinal() {
            return Err(CudaError::Misuse(format!(
                "registering memory of GPU {} through GPU {}",
                memory.device(),
                device.ordinal()
            )));
        }
        use sys::CUpointer_attribute as A;
        if len == 0 {
            return Err(CudaError::Misuse("registering zero bytes".into()));
        }
        if !stream.device().same_as(device) {
            return Err(CudaError::Misuse(
                "the stream of registered memory must be of its device".into(),
            ));
        }
        device.bind()?;
        // SAFETY: the device's context is current (bound above); an unknown address is an
        // error code, not undefined behaviour.
        let (base, size) = unsafe { raw::mem_get_address_range(ptr) }?;
        let end = (ptr - base).checked_add(len as u64);
        if end.is_none_or(|end| end > size as u64) {
            return Err(CudaError::Misuse(format!(
                "{len} bytes at {ptr:#x} overrun their allocation ({size} bytes at {base:#x})"
            )));
        }
        // SAFETY: as above: attribute queries on an address the driver knows.
        let (ordinal, capable, buffer_id) = unsafe {
            (
                raw::pointer_attribute_u64(ptr, A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)?,
                raw::pointer_attribute_u64(
                    ptr,
                    A::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                )?,
                raw::pointer_attribute_u64(ptr, A::CU_POINTER_ATTRIBUTE_BUFFER_ID)?,
            )
        };
        if ordinal as usize != device.ordinal() {
            return Err(CudaError::Misuse(format!(
                "the memory at {ptr:#x} lives on GPU {ordinal}, not GPU {}",
                device.ordinal()
            )));
        }
        if capable == 0 {
            return Err(CudaError::Misuse(format!(
                "the memory at {ptr:#x} cannot be exported as a legacy IPC handle (memory of a \
                 pool or of the virtual memory API?): allocate it with cuMemAlloc, or with \
                 ferry"
            )));
        }
        Ok(DeviceBuffer {
            origin: Origin::External(External {
                device: device.clone(),
                base,
                buffer_id,
                released: Arc::default(),
            }),
            home: stream.shared(),
            ptr,
            len,
            capacity: len,
            uses: Uses::default(),
            export: std::sync::OnceLock::new(),
        })
    }

    /// The name of the pool this buffer came from ([`pool_name`]); `None` for registered
    /// memory.
    pub fn pool_name(&self) -> Option<&str> {
        match &self.origin {
            Origin::Pool(pool) => Some(&pool.name),
            Origin::External(_) => None,
        }
    }

    /// True for registered memory ([`Self::register_external`]).
    pub fn is_external(&self) -> bool {
        matches!(self.origin, Origin::External(_))
    }

    /// For registered memory: set once the buffer is gone and its copies complete. `None`
    /// for pool memory.
    pub fn release_signal(&self) -> Option<Arc<ReleaseSignal>> {
        match &self.origin {
            Origin::External(external) => Some(Arc::clone(&external.released)),
            Origin::Pool(_) => None,
        }
    }

    /// The legacy IPC export of registered memory (`cuIpcGetMemHandle`), made once.
    ///
    /// # Errors
    /// [`CudaError::Misuse`] for pool memory (see [`Self::export_pointer`]); a driver error.
    pub fn export_legacy(&self) -> Result<LegacyExport, CudaError> {
        let Origin::External(external) = &self.origin else {
            return Err(CudaError::Misuse(
                "pool memory crosses as a pointer export, not a legacy IPC handle".into(),
            ));
        };
        let handle = match self.export.get() {
            Some(handle) => *handle,
            None => {
                external.device.bind()?;
                // SAFETY: `base` is the base of the live allocation the caller of
                // `register_external` keeps allocated while this buffer exists.
                let handle = unsafe { raw::ipc_get_mem_handle(external.base) }?;
                *self.export.get_or_init(|| handle)
            }
        };
        Ok(LegacyExport {
            handle,
            buffer_id: external.buffer_id,
            offset: self.ptr - external.base,
        })
    }

    /// Uses only the first `len` bytes from now on (copies, exports and [`Self::len`] see
    /// `len`); the whole allocation is still freed on drop. Longer than today is refused.
    ///
    /// # Errors
    /// [`CudaError::Misuse`] for a `len` past the current length.
    pub fn truncate(&mut self, len: usize) -> Result<(), CudaError> {
        if len > self.len {
            return Err(CudaError::Misuse(format!(
                "cannot grow a buffer of {} bytes to {len}",
                self.len
            )));
        }
        self.len = len;
        Ok(())
    }

    /// The allocation's length: what [`Self::reuse`] may grow the buffer back to.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether the buffer was allocated on `stream` (and will be freed there).
    pub fn allocated_on(&self, stream: &Stream) -> bool {
        Stream::from_shared(Arc::clone(&self.home)).same_as(stream)
    }

    /// Makes this allocation of `pool`, kept after the buffer that held it was dropped,
    /// ready to serve as new memory of `len` bytes (up to [`Self::capacity`]) for work
    /// queued on `on`, the stream it was allocated on: work queued on `on` from now on
    /// follows every use recorded on other streams, as a stream-ordered free and allocation
    /// on `on` would. Its bytes are the old ones: for memory the caller overwrites whole.
    /// Only the pool's owner may (it alone holds `pool`): a buffer's holder cannot grow it
    /// back over bytes it was not given.
    ///
    /// # Errors
    /// [`CudaError::Misuse`] for memory of another pool or registered memory, another
    /// stream or a `len` past the allocation; a driver error when the stream cannot wait.
    pub fn reuse(
        &mut self,
        pool: &ExportablePool,
        len: usize,
        on: &Stream,
    ) -> Result<(), CudaError> {
        if !matches!(&self.origin, Origin::Pool(p) if Arc::ptr_eq(p, &pool.inner)) {
            return Err(CudaError::Misuse(
                "only memory of this pool is reused through it".into(),
            ));
        }
        if !self.allocated_on(on) {
            return Err(CudaError::Misuse(
                "a pool buffer is reused on the stream it was allocated on".into(),
            ));
        }
        if len == 0 || len > self.capacity {
            return Err(CudaError::Misuse(format!(
                "reusing an allocation of {} bytes for {len}",
                self.capacity
            )));
        }
        self.uses.order_before(on)?;
        self.len = len;
        Ok(())
    }

    /// The buffer's device address, for a library that moves device memory itself (UCX).
    pub(crate) fn address(&self) -> u64 {
        self.ptr
    }

    /// The stream the buffer was allocated on, on which it will be freed.
    pub fn stream(&self) -> Stream {
        Stream::from_shared(Arc::clone(&self.home))
    }
}

impl sealed::Sealed for DeviceBuffer {
    fn region(&self) -> (sys::CUdeviceptr, usize) {
        (self.ptr, self.len)
    }
    fn note_use(&self, stream: &Stream) -> Result<(), CudaError> {
        // Work on the home stream is ordered before the free already.
        if stream.same_as(&Stream::from_shared(Arc::clone(&self.home))) {
            return Ok(());
        }
        self.uses.note(stream)
    }
    fn note_shared(&self, shared: &mut super::copy::SharedUse<'_>) -> Result<(), CudaError> {
        if shared
            .stream()
            .same_as(&Stream::from_shared(Arc::clone(&self.home)))
        {
            return Ok(());
        }
        self.uses.note_shared(shared)
    }
}

impl DeviceMemory for DeviceBuffer {
    fn device(&self) -> &Device {
        match &self.origin {
            Origin::Pool(pool) => &pool.device,
            Origin::External(external) => &external.device,
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Origin::External(external) = &self.origin {
            // Not ours to free: wait until no copy of this layer reads or writes it any
            // more, then tell whoever waits for the registration to end.
            if let Err(e) = self.uses.wait_all() {
                teardown_failed!(
                    e,
                    len = self.len,
                    "waiting for copies of registered memory failed"
                );
            }
            external.released.set();
            return;
        }
        if let Origin::Pool(pool) = &self.origin {
            pool.live.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        }
        let home = Stream::from_shared(Arc::clone(&self.home));
        let done = self.uses.order_before(&home).and_then(|()| {
            home.bind()?;
            // SAFETY: allocated from a pool on this stream's device, freed once; every copy of
            // this layer that used it is ordered before this point on `home` (above).
            unsafe { raw::mem_free_async(self.ptr, home.handle()) }
        });
        if let Err(e) = done {
            teardown_failed!(e, len = self.len, "freeing a pool buffer failed; leaked");
        }
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.device().ordinal())
            .field("external", &matches!(self.origin, Origin::External(_)))
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

/// A peer's pool, imported from its file descriptor. Allocating from it is impossible (the
/// driver forbids it); it only imports the peer's buffers. Cheap to clone.
#[derive(Clone)]
pub struct ImportedPool {
    inner: Arc<PoolInner>,
}

impl ImportedPool {
    /// The device of this process the pool's memory resides on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Imports one of the peer's buffers from its 64-byte export (`cuMemPoolImportPointer`;
    /// ~2 µs after the first one, measured on the H200). `len` is the length the peer
    /// claims; it is checked against the allocation's real size (`cuMemGetAddressRange`),
    /// so a lying peer gets an error instead of a device fault.
    ///
    /// # Errors
    /// [`CudaError::Misuse`] when `len` is zero or exceeds the allocation; a driver error for
    /// bytes that name no live allocation of this pool.
    pub fn import_pointer(
        &self,
        export: &[u8; POINTER_EXPORT_LEN],
        len: usize,
    ) -> Result<ImportedBuffer, CudaError> {
        if len == 0 {
            return Err(CudaError::Misuse("importing a buffer of zero bytes".into()));
        }
        self.inner.device.bind()?;
        // SAFETY: the imported pool is alive for as long as `self`.
        let ptr = unsafe { raw::mem_pool_import_pointer(self.inner.handle, export) }?;
        let buffer = ImportedBuffer {
            pool: Arc::clone(&self.inner),
            ptr,
            len,
            uses: Uses::default(),
        };
        // SAFETY: the device's context is current (bound above).
        let (base, size) = unsafe { raw::mem_get_address_range(ptr) }?;
        let end = (ptr - base).checked_add(len as u64);
        if end.is_none_or(|end| end > size as u64) {
            return Err(CudaError::Misuse(format!(
                "the peer claims {len} bytes in an allocation of {size}"
            )));
        }
        Ok(buffer)
    }

    /// Lets `device` read and write the imported buffers (`cuMemPoolSetAccess`): needed to
    /// copy with a stream of another device than the pool's. An imported pool does not
    /// inherit the exporter's access settings. Asking for the pool's own device is a no-op.
    ///
    /// # Errors
    /// A driver error, e.g. when the two devices have no peer access.
    pub fn grant_access(&self, device: &Device) -> Result<(), CudaError> {
        if device.same_as(&self.inner.device) {
            return Ok(());
        }
        self.inner.device.bind()?;
        // SAFETY: the pool is alive for as long as `self`.
        unsafe { raw::mem_pool_set_access_rw(self.inner.handle, device.ordinal_c()) }?;
        let mut access = self.inner.access.lock().unwrap_or_else(|p| p.into_inner());
        if !access.iter().any(|d| d.same_as(device)) {
            access.push(device.clone());
        }
        Ok(())
    }
}

impl std::fmt::Debug for ImportedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedPool")
            .field("device", &self.inner.device.ordinal())
            .finish()
    }
}

/// A peer's buffer imported into this process. Dropping it blocks until the copies of this
/// layer that used it have completed, then frees the import with `cuMemFree` (synchronous):
/// the driver requires every importer to have freed its import, completely, before the
/// exporter frees the allocation, so when the drop returns the peer may be told (`Done`).
pub struct ImportedBuffer {
    pool: Arc<PoolInner>,
    ptr: sys::CUdeviceptr,
    len: usize,
    uses: Uses,
}

// SAFETY: owns its import like a Box; the device address is only passed to the driver.
unsafe impl Send for ImportedBuffer {}
// SAFETY: shared access only queues reads, which the driver makes safe.
unsafe impl Sync for ImportedBuffer {}

impl sealed::Sealed for ImportedBuffer {
    fn region(&self) -> (sys::CUdeviceptr, usize) {
        (self.ptr, self.len)
    }
    fn note_use(&self, stream: &Stream) -> Result<(), CudaError> {
        self.uses.note(stream)
    }
    fn note_shared(&self, shared: &mut super::copy::SharedUse<'_>) -> Result<(), CudaError> {
        self.uses.note_shared(shared)
    }
}

impl DeviceMemory for ImportedBuffer {
    fn device(&self) -> &Device {
        &self.pool.device
    }
}

impl Drop for ImportedBuffer {
    fn drop(&mut self) {
        let done = self.uses.wait_all().and_then(|()| {
            self.pool.device.bind()?;
            // SAFETY: imported by cuMemPoolImportPointer, freed once, and every copy of this
            // layer that used it has completed (waited above).
            unsafe { raw::mem_free(self.ptr) }
        });
        if let Err(e) = done {
            teardown_failed!(e, len = self.len, "freeing an imported buffer failed");
        }
    }
}

impl std::fmt::Debug for ImportedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedBuffer")
            .field("device", &self.pool.device.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::{pool_device, pool_generation, pool_name};

    #[test]
    fn a_pool_name_holds_its_device_and_generation() {
        let name = pool_name("GPU-1234-abcd", 7);
        assert_eq!(name, "GPU-1234-abcd#7");
        assert_eq!(pool_device(&name), "GPU-1234-abcd");
        assert_eq!(pool_generation(&name), 7);
        // A bare UUID (no generation) is generation 0 of itself.
        assert_eq!(pool_device("GPU-1"), "GPU-1");
        assert_eq!(pool_generation("GPU-1"), 0);
    }
}
