//! The peer's pools and buffers this process imported: fetching a peer's pools once, and
//! the cache of the buffers it mapped, kept for the next pull of the same buffer.

use std::collections::HashMap;
use std::sync::Arc;

use crate::cuda::{CudaError, Device, ExportablePool, ImportedBuffer, ImportedPool, IpcMapping};
use crate::fdshare;
use crate::gpus::Gpus;
use crate::link::Secret;

use super::error::{IpcError, at};
use super::handle_cache::{AllocationKey, HandleCache};
use super::{IpcBufferRef, IpcSource};

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
    pub(crate) entries: HashMap<IpcBufferRef, (ImportedBuffer, u64)>,
    pub(crate) tick: u64,
    pub(crate) capacity: usize,
    /// The exporting peer, for the handle cache's keys.
    pub(crate) peer: String,
    pub(crate) legacy: HandleCache<Arc<IpcMapping>>,
    /// Which allocation each of the peer's registrations we read lies in.
    pub(crate) legacy_refs: HashMap<IpcBufferRef, u64>,
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
    pub(crate) _imports: Vec<ImportedBuffer>,
    pub(crate) _mappings: Vec<Arc<IpcMapping>>,
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
    pub(crate) fn closing(&mut self) -> Vec<Arc<IpcMapping>> {
        std::iter::from_fn(|| self.legacy.poll_close()).collect()
    }
}

/// Shared between a transfer actor and its pulls.
pub type SharedImports = Arc<std::sync::Mutex<ImportCache>>;

/// The cache key of a pulled buffer.
pub(crate) fn buffer_ref(source: &IpcSource) -> IpcBufferRef {
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
