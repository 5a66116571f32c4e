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

use actix::Addr;
use ferry_transports::cuda::{
    CudaError, Device, DeviceMemory, ExportablePool, ImportedBuffer, ImportedPool,
    POINTER_EXPORT_LEN, Stream, copy_async, copy_to_host,
};
use ferry_transports::ipc::{PoolDirectory, fetch_pool};
use ferry_transports::link::Secret;
use ferry_transports::memory::Buffer;
use ferry_transports::wire::{IpcBufferRef, IpcSource};

use crate::allocator::Allocator;

/// One GPU of the node.
#[derive(Clone)]
pub struct Gpu {
    /// The device.
    pub device: Device,
    /// Its allocator (the `device{n}` domain).
    pub allocator: Addr<Allocator>,
    /// The stream pulls into this device's memory are copied on.
    pub copy_stream: Stream,
}

/// The node's GPUs, by CUDA ordinal, and the pools it exports. Cheap to clone.
#[derive(Clone, Default)]
pub struct Gpus {
    /// The GPUs this node allocates from, by ordinal.
    pub gpus: Vec<(u32, Gpu)>,
    /// Every GPU the process sees (a peer's pool may live on one this node does not use).
    pub visible: Vec<Device>,
    /// Pools served on the pool socket, by device UUID.
    pub pools: PoolDirectory,
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

    /// A copy stream on `device` if the node uses it, else the first GPU's.
    fn stream_for(&self, device: &Device) -> Option<&Stream> {
        self.gpus
            .iter()
            .find(|(_, g)| g.device.same_as(device))
            .or_else(|| self.gpus.first())
            .map(|(_, g)| &g.copy_stream)
    }
}

/// Creates the exportable pool and streams of one GPU.
///
/// # Errors
/// The driver's error.
pub fn open_pool(device: &Device) -> Result<(ExportablePool, Stream, Stream), CudaError> {
    let pool = ExportablePool::new(device)?;
    let alloc_stream = Stream::new(device)?;
    let copy_stream = Stream::new(device)?;
    Ok((pool, alloc_stream, copy_stream))
}

/// A peer's pools imported into this process, by the peer's device UUID.
pub type ImportedPools = HashMap<String, ImportedPool>;

/// The peer's buffers this process imported (mapped), kept for the next pull of the same
/// buffer: importing costs a mapping that grows with the buffer (0.2–0.8 ms for 64 MiB on
/// the H200), the copy itself far less. Bounded; the least recently used goes first. An
/// entry leaves when the owner asks (it is freeing the buffer: answered `IpcUnmapped` once
/// the import is freed) or when evicted (freed under the cache's lock, so nothing can meet
/// it half gone).
pub struct ImportCache {
    entries: HashMap<IpcBufferRef, (ImportedBuffer, u64)>,
    tick: u64,
    capacity: usize,
}

/// Imports kept at most per peer.
pub const IMPORT_CACHE_CAPACITY: usize = 1024;

impl ImportCache {
    /// An empty cache of at most `capacity` imports (at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: HashMap::new(),
            tick: 0,
            capacity: capacity.max(1),
        }
    }

    /// Takes the import of `key` out (to free it), if cached.
    pub fn remove(&mut self, key: &IpcBufferRef) -> Option<ImportedBuffer> {
        self.entries.remove(key).map(|(b, _)| b)
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
) -> Result<ImportedPools, String> {
    let mut out = ImportedPools::new();
    for uuid in uuids {
        let Some(device) = gpus.visible_by_uuid(uuid).cloned() else {
            return Err(format!(
                "the peer's GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?)"
            ));
        };
        let fd = fetch_pool(node, pid, uuid, secret)
            .await
            .map_err(|e| e.to_string())?;
        let ours: Vec<Device> = gpus.gpus.iter().map(|(_, g)| g.device.clone()).collect();
        let imported = tokio::task::spawn_blocking(move || {
            let pool = ExportablePool::import_fd(&device, fd)?;
            for d in &ours {
                pool.grant_access(d)?;
            }
            Ok::<_, CudaError>(pool)
        })
        .await
        .map_err(|e| format!("the import task failed: {e}"))?
        .map_err(|e| format!("importing the pool of {uuid}: {e}"))?;
        out.insert(uuid.clone(), imported);
    }
    Ok(out)
}

/// Reads `len` bytes described by `source` out of the peer's memory into `dst` (device or
/// host memory), and waits until they are there. The buffer's import is taken from
/// `imports`, or made and kept there. Blocking: call it on a blocking thread.
///
/// # Errors
/// Why the bytes could not be read; `dst` comes back with the error.
pub fn pull(
    source: &IpcSource,
    pools: &ImportedPools,
    imports: &std::sync::Mutex<ImportCache>,
    gpus: &Gpus,
    mut dst: Buffer,
) -> Result<Buffer, (Buffer, String)> {
    let len = dst.len();
    let result = (|| {
        let pool = pools.get(&source.device_uuid).ok_or_else(|| {
            format!(
                "the peer's pool of {} was never imported",
                source.device_uuid
            )
        })?;
        let export: &[u8; POINTER_EXPORT_LEN] = source
            .export
            .as_slice()
            .try_into()
            .map_err(|_| format!("a pointer export of {} bytes", source.export.len()))?;
        let offset = usize::try_from(source.offset).map_err(|e| e.to_string())?;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| "offset and length overflow".to_string())?;
        let key = buffer_ref(source);
        let started = std::time::Instant::now();
        let mut cache = imports.lock().unwrap_or_else(|p| p.into_inner());
        cache.tick += 1;
        let tick = cache.tick;
        let hit = cache.entries.contains_key(&key);
        if !hit {
            let imported = pool
                .import_pointer(export, end)
                .map_err(|e| format!("importing the peer's buffer: {e}"))?;
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
            cache.entries.insert(key.clone(), (imported, tick));
        }
        let imported_at = started.elapsed();
        let Some((imported, last)) = cache.entries.get_mut(&key) else {
            return Err("the import vanished".to_string());
        };
        *last = tick;
        // A copy stream of the landing device, or of the peer's for a host landing.
        let device = dst
            .device_memory()
            .map_or(pool.device(), |m| m.device())
            .clone();
        let stream = gpus
            .stream_for(&device)
            .cloned()
            .ok_or_else(|| "no copy stream".to_string())?;
        // Queue the copy under the lock (the import stays put), wait outside it. A host
        // landing is pageable memory: that copy is synchronous.
        match dst.device_memory_mut() {
            Some(memory) => copy_async(memory, 0, &*imported, offset, len, &stream),
            None => {
                let host = dst
                    .as_mut_slice()
                    .ok_or_else(|| "the landing buffer is shared".to_string())?;
                copy_to_host(host, &*imported, offset, &stream)
            }
        }
        .map_err(|e| format!("copying from the peer: {e}"))?;
        drop(cache);
        stream
            .synchronize()
            .map_err(|e| format!("finishing the copy from the peer: {e}"))?;
        tracing::trace!(
            bytes = len,
            cached = hit,
            import_us = imported_at.as_micros() as u64,
            total_us = started.elapsed().as_micros() as u64,
            "pulled"
        );
        Ok(())
    })();
    match result {
        Ok(()) => Ok(dst),
        Err(why) => Err((dst, why)),
    }
}

/// The export of a buffer for an ipc pull: its device's UUID, its lease and the pointer
/// export.
///
/// # Errors
/// When the buffer is not device memory, or the driver refuses the export.
pub fn export_source(buffer: &Buffer) -> Result<IpcSource, String> {
    let memory = buffer
        .device_memory()
        .ok_or_else(|| format!("{} memory cannot cross ipc", buffer.kind()))?;
    let started = std::time::Instant::now();
    let export = memory
        .export_pointer()
        .map_err(|e| format!("exporting the buffer: {e}"))?;
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
        offset: 0,
        export: export.to_vec(),
    })
}

/// Shared, for the transfer actors.
pub type SharedGpus = Arc<Gpus>;
