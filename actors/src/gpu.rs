//! The node's GPUs as the actors use them: one domain per device (its allocator, over the
//! device's exportable pool), a copy stream per device for pulls, the pools other nodes may
//! import, and the importing side of the ipc transport (fetching a peer's pools, and the
//! pull itself: import the buffer, copy it into ours, free the import).
//!
//! The pull runs on a blocking thread: the copy is queued on the receiving device's copy
//! stream and waited for there, so `recv()` never returns before the bytes are complete and
//! visible on the receiver's device, and no actor thread ever blocks on the GPU.

use std::collections::HashMap;
use std::sync::Arc;

use ferry_transports::cuda::{
    CudaError, Device, DeviceMemory, Event, ExportablePool, ImportedBuffer, ImportedPool,
    IpcMapping, POINTER_EXPORT_LEN, Stream, Wait, copy_and_wait, copy_async, copy_async_marked,
    copy_boxes_async, copy_boxes_to_host, copy_to_host, enable_peer_access, peer_access,
};
use ferry_transports::fdshare::{self, PoolDirectory};
use ferry_transports::ipc::{IpcBufferRef, IpcSource};
use ferry_transports::link::Secret;
use ferry_transports::memory::{Buffer, SharedBytes};
use ferry_transports::wire::{Layout, LayoutError, RowBox};

use crate::core::handle_cache::{AllocationKey, HandleCache, Lookup};

/// Why an ipc import, export or copy failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum IpcError {
    /// A CUDA driver call failed at this step.
    #[error("{step}: {source}")]
    Driver {
        /// What was being done.
        step: &'static str,
        /// The driver's error.
        #[source]
        source: CudaError,
    },
    /// What the peer sent cannot be used (a range, layout or handle that does not fit).
    #[error("{0}")]
    BadDescriptor(String),
    /// The memory is gone: the peer freed it, the offer ended, the transfer stopped.
    #[error("{0}")]
    Gone(String),
    /// This machine or buffer cannot do it (not device memory, a GPU not visible here).
    #[error("{0}")]
    Unsupported(String),
    /// The peer's pool descriptor could not be fetched.
    #[error("fetching the peer's pool: {0}")]
    Fetch(String),
}

/// Maps a driver error at `step` into an [`IpcError`].
fn at(step: &'static str) -> impl FnOnce(CudaError) -> IpcError {
    move |source| IpcError::Driver { step, source }
}

/// One GPU of the node.
#[derive(Clone)]
pub struct Gpu {
    /// The device.
    pub device: Device,
    /// Its allocator (the `device{n}` domain).
    pub allocator: crate::allocator::DomainHandle,
    /// The stream pulls into this device's memory are copied on.
    pub copy_stream: Stream,
    /// The stream of small pulls (the lane's small records, a socket-path pull of at most
    /// [`EXPRESS_PULL_MAX`]): apart from `copy_stream`, so that waiting for a few bytes never
    /// waits behind a large copy queued before them.
    pub express_stream: Stream,
}

/// The node's GPUs, by CUDA ordinal, and the pools it exports. Cheap to clone.
#[derive(Clone, Default)]
pub struct Gpus {
    /// The GPUs this node allocates from, by ordinal.
    pub gpus: Vec<(u32, Gpu)>,
    /// Every GPU the process sees (a peer's pool may live on one this node does not use).
    pub visible: Vec<Device>,
    /// Pools served on the fd-sharing socket, by device UUID.
    pub pools: PoolDirectory,
    /// Fast-lane rings offered to peers, served on the fd-sharing socket by key.
    pub rings: ferry_transports::fdshare::RingDirectory,
    /// Copies are queued under its read side; a peer's memory is mapped under its write
    /// side, once the copies in flight have drained (see `Gpus::drain_copies`). One per
    /// node: nodes that share a process do not hold each other's copies off.
    pub mapping: Arc<std::sync::RwLock<()>>,
}

impl std::fmt::Debug for Gpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.gpus.iter().map(|(n, _)| n))
            .finish()
    }
}

impl Gpus {
    /// True when this node has no GPU domain.
    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty()
    }

    /// The GPU with this ordinal, if the node uses it.
    pub fn get(&self, ordinal: u32) -> Option<&Gpu> {
        self.gpus
            .iter()
            .find(|(n, _)| *n == ordinal)
            .map(|(_, g)| g)
    }

    /// UUIDs of the GPUs whose pools this node exports.
    pub fn uuids(&self) -> Vec<String> {
        self.gpus
            .iter()
            .map(|(_, g)| g.device.uuid().to_string())
            .collect()
    }

    /// The device of this process with `uuid`, among every visible GPU.
    pub fn visible_by_uuid(&self, uuid: &str) -> Option<&Device> {
        self.visible.iter().find(|d| d.uuid() == uuid)
    }

    /// Stops new copies (of any peer of this node) from being queued, and waits until no
    /// copy of this node is in flight (every copy and express stream drained); the guard
    /// keeps it so. A peer's memory is mapped only under it: on the H200 x2, importing a
    /// pool pointer while copies from the same imported pool ran made them fail with
    /// `CUDA_ERROR_LAUNCH_FAILED` (a fault that poisons the context) in about half of the
    /// runs of `ferry bench -b 8M -e 256M -f 2 -n 100 --window 16`; with this wait, in none
    /// of 8.
    fn drain_copies(&self) -> Result<std::sync::RwLockWriteGuard<'_, ()>, IpcError> {
        let quiet = self.mapping.write().unwrap_or_else(|p| p.into_inner());
        for (_, g) in &self.gpus {
            for stream in [&g.copy_stream, &g.express_stream] {
                stream
                    .synchronize()
                    .map_err(at("waiting for the copies in flight"))?;
            }
        }
        Ok(quiet)
    }

    /// Held while a copy is queued (and, for a small copy, waited for): no import starts
    /// meanwhile.
    fn copying(&self) -> std::sync::RwLockReadGuard<'_, ()> {
        self.mapping.read().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy stream on `device` if the node uses it, else the first GPU's; the express
    /// stream when `express`.
    fn copy_stream(&self, device: &Device, express: bool) -> Result<Stream, IpcError> {
        self.gpus
            .iter()
            .find(|(_, g)| g.device.same_as(device))
            .or_else(|| self.gpus.first())
            .map(|(_, g)| {
                if express {
                    g.express_stream.clone()
                } else {
                    g.copy_stream.clone()
                }
            })
            .ok_or_else(|| IpcError::Unsupported("this node uses no GPU: no copy stream".into()))
    }
}

/// The streams of one GPU.
pub struct GpuStreams {
    /// Allocations from the pool.
    pub alloc: Stream,
    /// Pulls on blocking threads.
    pub copy: Stream,
    /// Small pulls on the actor thread.
    pub express: Stream,
}

/// Creates the exportable pool and streams of one GPU.
///
/// # Errors
/// The driver's error.
pub fn open_pool(device: &Device) -> Result<(ExportablePool, GpuStreams), CudaError> {
    let pool = ExportablePool::new(device)?;
    let streams = GpuStreams {
        alloc: Stream::new(device)?,
        copy: Stream::new(device)?,
        express: Stream::new(device)?,
    };
    Ok((pool, streams))
}

/// Pulls of at most this many bytes whose source is mapped already are copied on the
/// express stream and their end polled (the copy takes a few microseconds: a wake-up would
/// cost as much); the others wait on the copy stream, outside the imports' lock.
pub const EXPRESS_PULL_MAX: usize = 256 << 10;

/// True when `source` is pool memory whose import `imports` holds now (a pull of it would
/// not import). Never waits for the lock: a busy cache answers false.
pub fn is_mapped(source: &IpcSource, imports: &std::sync::Mutex<ImportCache>) -> bool {
    source.legacy.is_none()
        && imports
            .try_lock()
            .is_ok_and(|cache| cache.entries.contains_key(&buffer_ref(source)))
}

/// A peer's pools imported into this process, by the peer's device UUID.
pub type ImportedPools = HashMap<String, ImportedPool>;

/// The peer's buffers this process imported (mapped), kept for the next pull of the same
/// buffer: importing costs a mapping that grows with the buffer (0.2–0.8 ms for 64 MiB on
/// the H200), the copy itself far less. Bounded; the least recently used goes first. An
/// entry leaves when the owner asks (it is freeing the buffer: answered `IpcUnmapped` once
/// the import is freed) or when evicted (freed under the cache's lock, so nothing can meet
/// it half gone).
///
/// Memory the peer registered (not from its pool) crosses as legacy IPC handles, mapped
/// whole allocations kept in [`HandleCache`] (keyed by the allocation's buffer id, never by
/// address; reference-counted, so a mapping a copy reads is never closed under it).
pub struct ImportCache {
    entries: HashMap<IpcBufferRef, (ImportedBuffer, u64)>,
    tick: u64,
    capacity: usize,
    /// The exporting peer, for the handle cache's keys.
    peer: String,
    legacy: HandleCache<Arc<IpcMapping>>,
    /// Which allocation each of the peer's registrations we read lies in.
    legacy_refs: HashMap<IpcBufferRef, u64>,
}

/// Imports kept at most per peer.
pub const IMPORT_CACHE_CAPACITY: usize = 1024;

/// Legacy IPC mappings (of allocations a peer registered) kept at most per peer.
pub const LEGACY_CACHE_CAPACITY: usize = 64;

/// Registrations of a peer's memory an importer tracks at most (each names the allocation
/// it lies in, so that freeing the last one unmaps the allocation).
pub const LEGACY_REGISTRATIONS_MAX: usize = 4096;

/// What [`ImportCache::remove`] took out; dropping it unmaps (waiting for copies first).
#[must_use = "dropping it unmaps the memory; do it off the actor thread"]
pub struct Unmapped {
    _imports: Vec<ImportedBuffer>,
    _mappings: Vec<Arc<IpcMapping>>,
}

impl ImportCache {
    /// An empty cache of at most `capacity` imports (at least one) and
    /// [`LEGACY_CACHE_CAPACITY`] legacy mappings, of `peer`'s memory.
    pub fn new(peer: &str, capacity: usize) -> Self {
        Self {
            entries: HashMap::new(),
            tick: 0,
            capacity: capacity.max(1),
            peer: peer.to_string(),
            legacy: HandleCache::new(LEGACY_CACHE_CAPACITY),
            legacy_refs: HashMap::new(),
        }
    }

    /// The owner frees the buffer `key`: takes its import out, or, for registered memory,
    /// invalidates the allocation's mapping once no other registration we read lies in it
    /// (closed when the last copy using it ends). Drop the result to unmap.
    pub fn remove(&mut self, key: &IpcBufferRef) -> Unmapped {
        let imports = self
            .entries
            .remove(key)
            .map(|(b, _)| b)
            .into_iter()
            .collect();
        if let Some(buffer_id) = self.legacy_refs.remove(key)
            && !self.legacy_refs.values().any(|&b| b == buffer_id)
        {
            self.legacy
                .invalidate(&AllocationKey::new(self.peer.clone(), buffer_id));
        }
        Unmapped {
            _imports: imports,
            _mappings: self.closing(),
        }
    }

    /// Mappings the handle cache gave up (evicted, or invalidated and unused).
    fn closing(&mut self) -> Vec<Arc<IpcMapping>> {
        std::iter::from_fn(|| self.legacy.poll_close()).collect()
    }
}

/// Shared between a transfer actor and its pulls.
pub type SharedImports = Arc<std::sync::Mutex<ImportCache>>;

/// The cache key of a pulled buffer.
fn buffer_ref(source: &IpcSource) -> IpcBufferRef {
    IpcBufferRef {
        device_uuid: source.device_uuid.clone(),
        buffer: source.buffer,
        generation: source.generation,
    }
}

/// Fetches and imports the pools of the peer `node` (process `pid`) for each of `uuids`,
/// and lets every GPU of ours read them. Runs the driver calls on a blocking thread.
///
/// # Errors
/// Why one of them could not be imported, naming the device.
pub async fn import_pools(
    node: &str,
    pid: u32,
    uuids: &[String],
    secret: &Secret,
    gpus: &Gpus,
) -> Result<ImportedPools, IpcError> {
    let mut out = ImportedPools::new();
    for uuid in uuids {
        let Some(device) = gpus.visible_by_uuid(uuid).cloned() else {
            return Err(IpcError::Unsupported(format!(
                "the peer's GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?)"
            )));
        };
        let fd = fdshare::fetch(node, pid, uuid, secret)
            .await
            .map_err(|e| IpcError::Fetch(e.to_string()))?;
        let ours: Vec<Device> = gpus.gpus.iter().map(|(_, g)| g.device.clone()).collect();
        let imported = tokio::task::spawn_blocking(move || {
            let pool = ExportablePool::import_fd(&device, fd)?;
            for d in &ours {
                pool.grant_access(d)?;
            }
            Ok::<_, CudaError>(pool)
        })
        .await
        .map_err(|e| IpcError::Gone(format!("the import task failed: {e}")))?
        .map_err(at("importing the peer's pool"))?;
        out.insert(uuid.clone(), imported);
    }
    Ok(out)
}

/// Reads `len` bytes described by `source` out of the peer's memory into `dst` (device or
/// host memory), and waits until they are there. The buffer's import (or, for memory the
/// peer registered, its allocation's mapping) is taken from `imports`, or made and kept
/// there. Blocking: call it on a blocking thread.
///
/// # Errors
/// Why the bytes could not be read; `dst` comes back with the error.
pub fn pull(
    source: &IpcSource,
    layout: &Layout,
    pools: &ImportedPools,
    imports: &std::sync::Mutex<ImportCache>,
    gpus: &Gpus,
    mut dst: Buffer,
    express: bool,
) -> Result<Buffer, (Buffer, IpcError)> {
    // No bytes: nothing to map or copy (an empty buffer has no device memory to export).
    if dst.is_empty() {
        return Ok(dst);
    }
    let how = if express { How::Express } else { How::Wait };
    let result = match source.legacy {
        None => pull_pooled(source, layout, pools, imports, gpus, &mut dst, how).map(drop),
        Some(buffer_id) => pull_registered(source, layout, buffer_id, imports, gpus, &mut dst),
    };
    match result {
        Ok(()) => Ok(dst),
        Err(why) => Err((dst, why)),
    }
}

/// A pull whose copy was queued and not waited for ([`queue_pull`]).
#[derive(Debug)]
pub struct QueuedPull {
    /// Where the bytes land.
    pub dst: Buffer,
    /// Recorded after the copy; `None` when it was copied and waited for already.
    pub ended: Option<Arc<Event>>,
}

/// Gives the event a queued copy records after itself, of the copy stream's device: the
/// caller's to wait for, and the buffers' record of their use (one event for the three).
pub type TakeEvent<'a> = &'a dyn Fn(&Device) -> Result<Event, CudaError>;

/// A contiguous [`pull`] that queues its copy (on the express stream when `express`, else
/// the copy stream) and returns without waiting: the caller waits for the event it gave
/// (`event`), recorded after the copy ([`QueuedPull::ended`]), so that several pulls are in
/// flight at once. The import stays mapped until the copy ends:
/// the peer cannot free the buffer before we finish its transfer, and an eviction waits
/// for every copy in flight. Memory the peer registered is copied and waited for at once.
/// Blocking (briefly): call it off the actor thread.
///
/// # Errors
/// As [`pull`].
pub fn queue_pull(
    source: &IpcSource,
    pools: &ImportedPools,
    imports: &std::sync::Mutex<ImportCache>,
    gpus: &Gpus,
    dst: Buffer,
    express: bool,
    event: TakeEvent<'_>,
) -> Result<QueuedPull, (Buffer, IpcError)> {
    if dst.is_empty() || source.legacy.is_some() {
        return pull(source, &Layout::Contiguous, pools, imports, gpus, dst, true)
            .map(|dst| QueuedPull { dst, ended: None });
    }
    let mut dst = dst;
    let layout = Layout::Contiguous;
    match pull_pooled(
        source,
        &layout,
        pools,
        imports,
        gpus,
        &mut dst,
        How::Queue(express, event),
    ) {
        Ok(ended) => Ok(QueuedPull { dst, ended }),
        Err(why) => Err((dst, why)),
    }
}

/// Contiguous pulls of several of the peer's pooled buffers, each into the device memory
/// of one GPU of ours, queued at once on that GPU's express stream (`express`) or its copy
/// stream: one launch of the gather kernel where it loads ([`ferry_transports::cuda::copy_many_async`]), so the copy
/// engine's fixed cost per copy is paid once. Nothing is waited for: the caller waits for
/// the event it gave (`event`), recorded after them all and returned. The imports stay as
/// [`queue_pull`] says.
///
/// # Errors
/// As [`pull`]; [`IpcError::Unsupported`] for a landing that is not device memory or a
/// source the peer registered (those take [`queue_pull`]). Nothing is queued then.
pub fn queue_pulls(
    items: &mut [(&IpcSource, &mut Buffer)],
    pools: &ImportedPools,
    imports: &std::sync::Mutex<ImportCache>,
    gpus: &Gpus,
    express: bool,
    event: TakeEvent<'_>,
) -> Result<Arc<Event>, IpcError> {
    let device = items
        .first()
        .and_then(|(_, dst)| dst.device_memory())
        .map(|m| m.device().clone())
        .ok_or_else(|| IpcError::Unsupported("pulls into host memory".into()))?;
    let stream = gpus.copy_stream(&device, express)?;
    let mut cache = imports.lock().unwrap_or_else(|p| p.into_inner());
    cache.tick += 1;
    let tick = cache.tick;
    let mut spans = Vec::with_capacity(items.len());
    for (source, dst) in items.iter() {
        if source.legacy.is_some() {
            return Err(IpcError::Unsupported("memory the peer registered".into()));
        }
        let pool = pools.get(&source.device_uuid).ok_or_else(|| {
            IpcError::BadDescriptor(format!(
                "the peer's pool of {} was never imported",
                source.device_uuid
            ))
        })?;
        let (offset, end) = source_range(source, dst.len())?;
        let key = buffer_ref(source);
        import_into(&mut cache, &key, pool, export_bytes(source)?, end, gpus)?;
        if let Some((_, last)) = cache.entries.get_mut(&key) {
            *last = tick;
        }
        spans.push((key, offset));
    }
    // Every import is in place (the batch's are the newest, so none evicted another).
    let mut pairs = Vec::with_capacity(items.len());
    for ((_, dst), (key, offset)) in items.iter_mut().zip(&spans) {
        let len = dst.len();
        let dst = dst
            .device_memory_mut()
            .ok_or_else(|| IpcError::Unsupported("a pull into host or shared memory".into()))?;
        let (src, _) = cache
            .entries
            .get(key)
            .ok_or_else(|| IpcError::Gone("the import vanished".into()))?;
        pairs.push(ferry_transports::cuda::Pair {
            dst,
            src,
            src_offset: *offset,
            len,
        });
    }
    let event = event(stream.device()).map_err(at("creating an event"))?;
    let _copying = gpus.copying();
    // Under the cache's lock, as `copy_many_async` asks: no other copy from these imports
    // is queued and noted meanwhile.
    let gathered = ferry_transports::cuda::copy_many_async(&mut pairs, &stream, event)
        .map_err(at("copying from the peer"))?;
    Ok(gathered.ended)
}

/// How a pooled pull waits for its copy.
#[derive(Clone, Copy)]
enum How<'a> {
    /// A few bytes: polled under the import lock, on the express stream.
    Express,
    /// Queued on the copy stream, waited for outside the lock.
    Wait,
    /// Queued (on the express stream when true, else the copy stream), not waited for:
    /// the event given records its end.
    Queue(bool, TakeEvent<'a>),
}

fn pull_pooled(
    source: &IpcSource,
    layout: &Layout,
    pools: &ImportedPools,
    imports: &std::sync::Mutex<ImportCache>,
    gpus: &Gpus,
    dst: &mut Buffer,
    how: How<'_>,
) -> Result<Option<Arc<Event>>, IpcError> {
    let len = dst.len();
    let pool = pools.get(&source.device_uuid).ok_or_else(|| {
        IpcError::BadDescriptor(format!(
            "the peer's pool of {} was never imported",
            source.device_uuid
        ))
    })?;
    let export = export_bytes(source)?;
    let spanning = std::time::Instant::now();
    let (offset, end, boxes) = source_span(source, layout, len)?;
    let span_at = spanning.elapsed();
    let key = buffer_ref(source);
    let started = std::time::Instant::now();
    let mut cache = imports.lock().unwrap_or_else(|p| p.into_inner());
    let locked_at = started.elapsed();
    cache.tick += 1;
    let tick = cache.tick;
    let hit = import_into(&mut cache, &key, pool, export, end, gpus)?;
    let imported_at = started.elapsed();
    // When the copy was queued, once it was (`None`: copied and waited for at once).
    let mut queued_at = None;
    let mut queued = None;
    let Some((imported, last)) = cache.entries.get_mut(&key) else {
        return Err(IpcError::Gone("the import vanished".into()));
    };
    *last = tick;
    if matches!(how, How::Express)
        && boxes.is_none()
        && let Some(memory) = dst.device_memory_mut()
    {
        // A few bytes: copied and waited for under the lock (microseconds), with no event
        // to record on either buffer. Polled, not synchronised (see `Wait::Spin`).
        let stream = gpus.copy_stream(memory.device(), true)?;
        let _copying = gpus.copying();
        copy_and_wait(memory, &*imported, offset, len, &stream, Wait::Spin)
            .map_err(at("copying from the peer"))?;
    } else {
        // Queue the copy under the lock (the import stays put), wait outside it.
        let at = imported.device_ptr();
        let (express, mark) = match how {
            How::Express => (true, None),
            How::Wait => (false, None),
            How::Queue(express, event) => (express, Some(event)),
        };
        let (stream, ended) = queue_copy(
            dst,
            &*imported,
            offset,
            boxes.as_deref(),
            gpus,
            express,
            mark,
        )?;
        drop(cache);
        queued_at = Some(started.elapsed());
        if ended.is_some() {
            queued = ended;
        } else {
            finish_copy(&stream).inspect_err(|e| {
                tracing::debug!(
                    error = %e,
                    buffer = key.buffer,
                    at = format_args!("{at:#x}+{offset}"),
                    bytes = len,
                    "a pull's copy failed"
                )
            })?;
        }
    }
    let total = started.elapsed();
    tracing::trace!(
        target: crate::TRACE_BLOCKS,
        blocks = crate::block_count(layout),
        runs = boxes.as_ref().map_or(0, Vec::len),
        bytes = len,
        cached = hit,
        span_us = span_at.as_micros() as u64,
        lock_us = locked_at.as_micros() as u64,
        import_us = (imported_at - locked_at).as_micros() as u64,
        queue_us = queued_at.map(|q| (q - imported_at).as_micros() as u64),
        wait_us = queued_at.map(|q| (total - q).as_micros() as u64),
        total_us = total.as_micros() as u64,
        "pull copied: span (layout to runs), lock, import, queue (the gather), wait (sync)"
    );
    Ok(queued)
}

/// Makes sure `cache` holds an import of the peer's buffer `key` reaching `end` bytes
/// (mapping it, and evicting the import used longest ago when full, with every copy held
/// off meanwhile). Returns whether it was there already.
fn import_into(
    cache: &mut ImportCache,
    key: &IpcBufferRef,
    pool: &ImportedPool,
    export: &[u8; POINTER_EXPORT_LEN],
    end: usize,
    gpus: &Gpus,
) -> Result<bool, IpcError> {
    // An import made for fewer bytes (an earlier pull of this buffer read less of it: a
    // layout that ends sooner) does not serve: it is remapped to reach `end`.
    let hit = cache
        .entries
        .get(key)
        .is_some_and(|(b, _)| DeviceMemory::len(b) >= end);
    if !hit {
        let quiet = gpus.drain_copies()?;
        drop(cache.entries.remove(key));
        let imported = pool
            .import_pointer(export, end)
            .map_err(at("importing the peer's buffer"))?;
        tracing::debug!(
            buffer = key.buffer,
            ptr = format_args!("{:#x}", imported.device_ptr()),
            len = end,
            "imported a peer buffer"
        );
        while cache.entries.len() >= cache.capacity {
            let Some(oldest) = cache
                .entries
                .iter()
                .min_by_key(|(_, (_, t))| *t)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            // Freed before the lock is released, so a later pull of the same buffer, or
            // the owner's IpcUnmap, never meets an import that is still going away.
            // The owner learns nothing: it asks when it frees the buffer, and is
            // answered at once.
            drop(cache.entries.remove(&oldest));
        }
        // Evictions unmap too: done while the copies are still held off.
        drop(quiet);
        cache.entries.insert(key.clone(), (imported, cache.tick));
    }
    Ok(hit)
}

/// The pull of memory the peer registered: its allocation is mapped from the legacy IPC
/// handle (or the cached mapping is used), the copy reads the registered range, and the
/// mapping's reference is given back when the copy has completed.
fn pull_registered(
    source: &IpcSource,
    layout: &Layout,
    buffer_id: u64,
    imports: &std::sync::Mutex<ImportCache>,
    gpus: &Gpus,
    dst: &mut Buffer,
) -> Result<(), IpcError> {
    let len = dst.len();
    let handle = export_bytes(source)?;
    let (offset, end, boxes) = source_span(source, layout, len)?;
    let started = std::time::Instant::now();
    let (key, mapping, hit) = {
        let mut cache = imports.lock().unwrap_or_else(|p| p.into_inner());
        let key = AllocationKey::new(cache.peer.clone(), buffer_id);
        let registration = buffer_ref(source);
        if !cache.legacy_refs.contains_key(&registration)
            && cache.legacy_refs.len() >= LEGACY_REGISTRATIONS_MAX
        {
            return Err(IpcError::BadDescriptor(format!(
                "the peer has {LEGACY_REGISTRATIONS_MAX} registrations of its own memory in \
                 use with us already; it must drop some first"
            )));
        }
        cache.legacy_refs.insert(registration, buffer_id);
        match cache.legacy.acquire(&key) {
            Lookup::Hit(mapping) => (key, mapping, true),
            Lookup::Invalidated => {
                return Err(IpcError::Gone(format!(
                    "the peer freed the registered allocation {buffer_id}: it is never mapped again"
                )));
            }
            Lookup::Miss => {
                // Opened under the lock: one open of an allocation at a time per peer (the
                // driver maps a handle once per context).
                let mapping = open_legacy(&mut cache, &key, source, handle, buffer_id, gpus)?;
                (key, mapping, false)
            }
        }
    };
    let opened_at = started.elapsed();
    let copied = (|| {
        if end > mapping.len() {
            return Err(IpcError::BadDescriptor(format!(
                "the peer claims bytes up to {end} in an allocation of {}",
                mapping.len()
            )));
        }
        let queuing = std::time::Instant::now();
        let (stream, _) = queue_copy(dst, &*mapping, offset, boxes.as_deref(), gpus, false, None)?;
        let queued_at = queuing.elapsed();
        finish_copy(&stream)?;
        tracing::trace!(
            target: crate::TRACE_BLOCKS,
            blocks = crate::block_count(layout),
            bytes = len,
            queue_us = queued_at.as_micros() as u64,
            wait_us = (queuing.elapsed() - queued_at).as_micros() as u64,
            "registered pull copied: queue (the gather), wait (sync)"
        );
        Ok(())
    })();
    // The reference goes back whatever happened; a mapping the cache gave up meanwhile is
    // unmapped here, on this blocking thread.
    let closing = {
        let mut cache = imports.lock().unwrap_or_else(|p| p.into_inner());
        cache.legacy.release(&key);
        cache.closing()
    };
    drop(mapping);
    drop(closing);
    copied?;
    tracing::trace!(
        bytes = len,
        cached = hit,
        open_us = opened_at.as_micros() as u64,
        total_us = started.elapsed().as_micros() as u64,
        "pulled registered memory"
    );
    Ok(())
}

/// Maps the peer's registered allocation `buffer_id` from its legacy IPC `handle` (with no
/// copy in flight) and keeps the mapping in `cache` under `key`, with peer access enabled
/// for every GPU of ours that can reach it.
fn open_legacy(
    cache: &mut ImportCache,
    key: &AllocationKey,
    source: &IpcSource,
    handle: &[u8; POINTER_EXPORT_LEN],
    buffer_id: u64,
    gpus: &Gpus,
) -> Result<Arc<IpcMapping>, IpcError> {
    let device = gpus.visible_by_uuid(&source.device_uuid).ok_or_else(|| {
        IpcError::Unsupported(format!(
            "the peer's GPU {} is not visible to this process",
            source.device_uuid
        ))
    })?;
    // Mapped with no copy in flight, as pool memory is (not seen to fault here,
    // but the same kind of mapping change).
    let quiet = gpus.drain_copies()?;
    let opened =
        IpcMapping::open(device, handle).map_err(at("opening the peer's legacy IPC handle"))?;
    // A legacy mapping is read through each copying context's peer access (pool
    // memory has its own access setting, granted when imported): enabled once
    // here, for every GPU of ours that can reach the allocation's.
    for (_, ours) in &gpus.gpus {
        if peer_access(&ours.device, device).unwrap_or(false) {
            enable_peer_access(&ours.device, device)
                .map_err(at("enabling peer access for the copy"))?;
        }
    }
    drop(quiet);
    cache
        .legacy
        .insert(key.clone(), Arc::new(opened))
        .map_err(|_| {
            IpcError::Gone(format!(
                "the peer freed the registered allocation {buffer_id}"
            ))
        })
}

/// Writes `source` (our device buffer) into the peer's buffer `target` (an ipc push) and
/// waits until every byte is there. The target is imported from the peer's `pool` with no
/// copy of this node in flight (as a pull's source is), copied into on the copy stream of
/// `source`'s device, and its import is freed before this returns, so the peer may reuse its
/// buffer as soon as it hears `Written`: nothing is cached, and no unmap protocol runs in
/// reverse. Blocking: call it on a blocking thread.
///
/// # Errors
/// Why the bytes could not be written (the target is not pool memory, its import failed,
/// the peer claims a buffer shorter than the transfer, or the copy failed).
pub fn push(
    target: &IpcSource,
    pool: &ImportedPool,
    gpus: &Gpus,
    source: &SharedBytes,
    layout: &Layout,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<(), IpcError> {
    if target.legacy.is_some() {
        return Err(IpcError::BadDescriptor(
            "the receiver lent memory that is not from its pool".into(),
        ));
    }
    let memory = source
        .device_memory()
        .ok_or_else(|| IpcError::Unsupported("only device memory is pushed over ipc".into()))?;
    // What moves: the layout's rows, packed (the whole buffer when contiguous).
    let len = usize::try_from(
        layout
            .check(source.len() as u64)
            .map_err(|e| IpcError::BadDescriptor(format!("the buffer's layout: {e}")))?,
    )
    .map_err(|e| IpcError::Unsupported(e.to_string()))?;
    let boxes = match layout {
        Layout::Contiguous => None,
        strided => Some(
            strided
                .boxes(source.len() as u64, 0, len as u64)
                .map_err(|e| IpcError::BadDescriptor(format!("the buffer's layout: {e}")))?,
        ),
    };
    let export = export_bytes(target)?;
    let (offset, end) = source_range(target, len)?;
    let started = std::time::Instant::now();
    let mut imported = {
        let _quiet = gpus.drain_copies()?;
        // The transfer may have ended while this waited for the copies: nothing is written.
        if stop.load(std::sync::atomic::Ordering::Acquire) {
            return Err(IpcError::Gone(
                "the transfer ended before its copy started".into(),
            ));
        }
        pool.import_pointer(export, end)
            .map_err(at("importing the receiver's buffer"))?
    };
    let imported_at = started.elapsed();
    let stream = gpus.copy_stream(memory.device(), false)?;
    {
        let _copying = gpus.copying();
        match &boxes {
            None => copy_async(&mut imported, offset, memory, 0, len, &stream),
            Some(boxes) => copy_boxes_async(&mut imported, offset, memory, 0, boxes, &stream),
        }
        .map_err(at("copying into the receiver's buffer"))?;
    }
    stream
        .synchronize()
        .map_err(at("finishing the copy into the receiver's buffer"))?;
    let copied_at = started.elapsed();
    // Freed now (the copy has completed): the receiver may free its buffer once told. Not
    // under the mapping lock, as the owner-requested unmaps of pulled buffers are not: the
    // fault that lock prevents came from imports, and draining before frees did not change
    // it (docs/PERFORMANCE.md, "Fifth run").
    drop(imported);
    tracing::trace!(
        bytes = len,
        import_us = imported_at.as_micros() as u64,
        copy_us = (copied_at - imported_at).as_micros() as u64,
        free_us = (started.elapsed() - copied_at).as_micros() as u64,
        "pushed"
    );
    tracing::trace!(
        target: crate::TRACE_BLOCKS,
        blocks = crate::block_count(layout),
        bytes = len,
        import_us = imported_at.as_micros() as u64,
        copy_us = (copied_at - imported_at).as_micros() as u64,
        "pushed: import, copy (queued and waited for)"
    );
    Ok(())
}

fn export_bytes(source: &IpcSource) -> Result<&[u8; POINTER_EXPORT_LEN], IpcError> {
    source
        .export
        .as_slice()
        .try_into()
        .map_err(|_| IpcError::BadDescriptor(format!("an export of {} bytes", source.export.len())))
}

fn end_of(offset: usize, len: usize) -> Result<usize, IpcError> {
    offset
        .checked_add(len)
        .ok_or_else(|| IpcError::BadDescriptor("offset and length overflow".into()))
}

/// The source's offset and the end of `len` bytes from it.
fn source_range(source: &IpcSource, len: usize) -> Result<(usize, usize), IpcError> {
    let offset = usize::try_from(source.offset)
        .map_err(|_| IpcError::BadDescriptor(format!("offset {}", source.offset)))?;
    Ok((offset, end_of(offset, len)?))
}

/// Where the `len` packed bytes of a pull lie in the peer's memory: the source's offset, the
/// end of what is read, and for a strided layout the boxes that gather its rows.
fn source_span(
    source: &IpcSource,
    layout: &Layout,
    len: usize,
) -> Result<(usize, usize, Option<Vec<RowBox>>), IpcError> {
    let (offset, end) = source_range(source, len)?;
    let bad = |e: LayoutError| IpcError::BadDescriptor(format!("the offer's layout: {e}"));
    match layout.extent().map_err(bad)? {
        None => Ok((offset, end, None)),
        Some(span) => {
            let boxes = layout.boxes(span, 0, len as u64).map_err(bad)?;
            let span = usize::try_from(span)
                .map_err(|_| IpcError::BadDescriptor(format!("a span of {span} bytes")))?;
            Ok((offset, end_of(offset, span)?, Some(boxes)))
        }
    }
}

/// Queues the copy of `dst.len()` bytes from `src[offset..]` into `dst`, on a copy stream
/// of the landing device (of the source's for a host landing, which is pageable memory: that
/// copy is synchronous). Returns the stream to wait on and, with `mark`, the event taken
/// from it and recorded after the copy.
fn queue_copy(
    dst: &mut Buffer,
    src: &impl DeviceMemory,
    offset: usize,
    boxes: Option<&[RowBox]>,
    gpus: &Gpus,
    express: bool,
    mark: Option<TakeEvent<'_>>,
) -> Result<(Stream, Option<Arc<Event>>), IpcError> {
    let len = dst.len();
    let device = dst
        .device_memory()
        .map_or(src.device(), |m| m.device())
        .clone();
    let stream = gpus.copy_stream(&device, express)?;
    let _copying = gpus.copying();
    if let (Some(take), Some(memory), None) = (mark, dst.device_memory_mut(), boxes) {
        // The common case: one event for the copy's end and both buffers' use.
        let event = take(stream.device()).map_err(at("creating an event"))?;
        let ended = copy_async_marked(memory, 0, src, offset, len, &stream, event)
            .map_err(at("copying from the peer"))?;
        return Ok((stream, Some(ended)));
    }
    match (dst.device_memory_mut(), boxes) {
        (Some(memory), None) => copy_async(memory, 0, src, offset, len, &stream),
        (Some(memory), Some(boxes)) => copy_boxes_async(memory, 0, src, offset, boxes, &stream),
        (None, boxes) => {
            let host = dst
                .as_mut_slice()
                .ok_or_else(|| IpcError::Gone("the landing buffer is shared".into()))?;
            match boxes {
                None => copy_to_host(host, src, offset, &stream),
                Some(boxes) => copy_boxes_to_host(host, src, offset, boxes, &stream),
            }
        }
    }
    .map_err(at("copying from the peer"))?;
    // Any other copy noted its buffers' uses itself: the caller's event goes after it.
    let ended = match mark {
        Some(take) => {
            let event = take(stream.device()).map_err(at("creating an event"))?;
            event
                .record(&stream)
                .map_err(at("recording the copy's end"))?;
            Some(Arc::new(event))
        }
        None => None,
    };
    Ok((stream, ended))
}

fn finish_copy(stream: &Stream) -> Result<(), IpcError> {
    stream
        .synchronize()
        .map_err(at("finishing the copy from the peer"))
}

/// The export of a buffer for an ipc pull: its device's UUID, its lease and the pointer
/// export (the legacy IPC handle for registered memory). For a node of this process
/// (`in_process`) nothing is exported: it reads the buffer itself.
///
/// # Errors
/// When the buffer is not device memory, or the driver refuses the export.
pub fn export_source(buffer: &Buffer, in_process: bool) -> Result<IpcSource, IpcError> {
    if buffer.is_empty()
        && matches!(
            buffer.kind(),
            ferry_transports::memory::MemoryKind::Device(_)
        )
    {
        // No bytes to read, and no device memory behind an empty buffer: the receiver
        // copies nothing (`pull` returns at once), so the export names nothing.
        let lease = buffer.lease();
        return Ok(IpcSource {
            device_uuid: String::new(),
            buffer: lease.id.0,
            generation: lease.generation.0,
            offset: 0,
            export: Vec::new(),
            legacy: None,
        });
    }
    let memory = buffer.device_memory().ok_or_else(|| {
        IpcError::Unsupported(format!("{} memory cannot cross ipc", buffer.kind()))
    })?;
    let started = std::time::Instant::now();
    let (export, offset, legacy) = if in_process {
        ([0; POINTER_EXPORT_LEN], 0, None)
    } else if memory.is_external() {
        let legacy = memory
            .export_legacy()
            .map_err(at("exporting the registered memory"))?;
        (legacy.handle, legacy.offset, Some(legacy.buffer_id))
    } else {
        let export = memory
            .export_pointer()
            .map_err(at("exporting the buffer"))?;
        (export, 0, None)
    };
    tracing::trace!(
        bytes = memory.len(),
        us = started.elapsed().as_micros() as u64,
        "exported"
    );
    let lease = buffer.lease();
    Ok(IpcSource {
        device_uuid: memory.device().uuid().to_string(),
        buffer: lease.id.0,
        generation: lease.generation.0,
        offset,
        export: export.to_vec(),
        legacy,
    })
}

/// Buffers offered for pulling to a node of this same process, by exporting node and
/// buffer: the receiving node copies straight from them (a peer copy between the two GPUs,
/// or within one), with nothing imported. Each entry lives while its transfers' views do:
/// one buffer may be offered by several transfers at once (a published buffer fetched
/// twice), so an entry counts its offers.
static IN_PROCESS: std::sync::LazyLock<
    dashmap::DashMap<(String, IpcBufferRef), (SharedBytes, usize)>,
> = std::sync::LazyLock::new(dashmap::DashMap::new);

/// How a peer names our device buffer under `lease` on `device` (in offers and unmaps).
pub fn lease_ref(device: &Device, lease: &ferry_transports::memory::Lease) -> IpcBufferRef {
    IpcBufferRef {
        device_uuid: device.uuid().to_string(),
        buffer: lease.id.0,
        generation: lease.generation.0,
    }
}

/// The key of `view`'s buffer, as the receiver names it from the offer.
fn in_process_key(node: &str, view: &SharedBytes) -> Option<(String, IpcBufferRef)> {
    let memory = view.device_memory()?;
    Some((node.to_string(), lease_ref(memory.device(), &view.lease())))
}

/// Makes `view` (offered by `node`) readable by the nodes of this process.
pub fn offer_in_process(node: &str, view: SharedBytes) {
    if let Some(key) = in_process_key(node, &view) {
        IN_PROCESS
            .entry(key)
            .and_modify(|(_, offers)| *offers += 1)
            .or_insert((view, 1));
    }
}

/// The offer of `view` by `node` ended (the peer said Done, cancelled, or is gone).
pub fn withdraw_in_process(node: &str, view: &SharedBytes) {
    if let Some(key) = in_process_key(node, view) {
        IN_PROCESS.remove_if_mut(&key, |_, (_, offers)| {
            *offers = offers.saturating_sub(1);
            *offers == 0
        });
    }
}

/// The pull of a buffer `exporter`, a node of this process, offered: a copy straight from
/// its memory into `dst`, waited for. Blocking (a few microseconds when `express`).
///
/// # Errors
/// When the offer is gone (the transfer ended meanwhile) or the copy fails; `dst` comes
/// back with the error.
pub fn pull_in_process(
    exporter: &str,
    source: &IpcSource,
    layout: &Layout,
    gpus: &Gpus,
    mut dst: Buffer,
    express: bool,
) -> Result<Buffer, (Buffer, IpcError)> {
    if dst.is_empty() {
        return Ok(dst);
    }
    let key = (exporter.to_string(), buffer_ref(source));
    // A clone of the view: the memory stays allocated through the copy whatever happens
    // to the offer meanwhile.
    let Some(view) = IN_PROCESS.get(&key).map(|v| v.0.clone()) else {
        return Err((
            dst,
            IpcError::Gone(format!("{exporter} no longer offers that buffer")),
        ));
    };
    let result = (|| {
        let memory = view.device_memory().ok_or_else(|| {
            IpcError::Unsupported("the offered buffer is not device memory".into())
        })?;
        let started = std::time::Instant::now();
        let (offset, _, boxes) = source_span(source, layout, dst.len())?;
        let span_at = started.elapsed();
        let (stream, _) = queue_copy(
            &mut dst,
            memory,
            offset,
            boxes.as_deref(),
            gpus,
            express,
            None,
        )?;
        let queued_at = started.elapsed();
        finish_copy(&stream)?;
        let total = started.elapsed();
        tracing::trace!(
            target: crate::TRACE_BLOCKS,
            blocks = crate::block_count(layout),
            bytes = dst.len(),
            span_us = span_at.as_micros() as u64,
            queue_us = (queued_at - span_at).as_micros() as u64,
            wait_us = (total - queued_at).as_micros() as u64,
            "in-process pull copied: span (layout to runs), queue (the gather), wait (sync)"
        );
        Ok(())
    })();
    drop(view);
    match result {
        Ok(()) => Ok(dst),
        Err(why) => Err((dst, why)),
    }
}

/// Shared, for the transfer actors.
pub type SharedGpus = Arc<Gpus>;
