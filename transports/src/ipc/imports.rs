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

/// A peer's pools imported into this process, by the pool's name at the peer
/// ([`crate::cuda::pool_name`]).
pub type ImportedPools = HashMap<String, ImportedPool>;

/// The peer's pools this process imported: those its ipc setup asked for, and those a
/// buffer names later (the peer replaced an idle pool: [`ExportablePool::renewed`]), each
/// fetched on first use, one fetch at a time. Read as a snapshot (a pull holds the pools it
/// started with); a pool the peer retired is taken out, and closed once the last snapshot
/// holding it is gone.
#[derive(Default)]
pub struct PoolImports {
    current: std::sync::RwLock<Arc<ImportedPools>>,
    /// Pools the peer retired: never imported again (a fetch under way when the peer's
    /// notice came would otherwise bring one back for good).
    retired: std::sync::Mutex<std::collections::VecDeque<String>>,
    fetching: tokio::sync::Mutex<()>,
}

/// Names of retired pools a [`PoolImports`] remembers (the last ones).
const RETIRED_KEPT: usize = 64;

/// Where to fetch a peer's pools from: its node, process and the link's secret, and our
/// GPUs (that import them).
#[derive(Clone)]
pub struct PoolSource {
    /// The peer's node name.
    pub node: String,
    /// Its process.
    pub pid: u32,
    /// The secret its fd-sharing socket checks.
    pub secret: Secret,
    /// Our GPUs.
    pub gpus: crate::gpus::SharedGpus,
}

impl PoolImports {
    /// The pools imported now.
    pub fn snapshot(&self) -> Arc<ImportedPools> {
        Arc::clone(&self.current.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Adds `pools` (imported by the ipc setup, or fetched for a buffer naming one). A pool
    /// imported already stays (the new import is handed back), as does one the peer
    /// retired meanwhile: drop what comes back off the shell's thread (a driver call).
    #[must_use = "dropping an imported pool is a driver call; do it off the actor thread"]
    pub fn add(&self, pools: ImportedPools) -> Vec<ImportedPool> {
        let retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
        let mut next = ImportedPools::clone(&current);
        let mut surplus = Vec::new();
        for (name, pool) in pools {
            if retired.contains(&name) || next.contains_key(&name) {
                surplus.push(pool);
            } else {
                next.insert(name, pool);
            }
        }
        *current = Arc::new(next);
        surplus
    }

    /// Takes out the pool the peer retired as `name` (and refuses it from now on); drop
    /// it off the shell's thread (a driver call).
    pub fn retire(&self, name: &str) -> Option<ImportedPool> {
        let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
        // Bounded: the last ones (a peer retires a GPU's pool at most once per
        // `memory.keep_idle`; what matters is a fetch under way now).
        if !retired.iter().any(|n| n == name) {
            if retired.len() == RETIRED_KEPT {
                retired.pop_front();
            }
            retired.push_back(name.to_string());
        }
        if !current.contains_key(name) {
            return None;
        }
        let mut next = ImportedPools::clone(&current);
        let pool = next.remove(name);
        *current = Arc::new(next);
        pool
    }

    /// The pools, with `name` among them: imported from `from` first when it is not yet.
    ///
    /// # Errors
    /// Why it could not be imported.
    pub async fn with(
        &self,
        name: &str,
        from: &PoolSource,
    ) -> Result<Arc<ImportedPools>, IpcError> {
        let now = self.snapshot();
        if name.is_empty() || now.contains_key(name) {
            return Ok(now);
        }
        let _one = self.fetching.lock().await;
        let now = self.snapshot();
        if now.contains_key(name) {
            return Ok(now);
        }
        if self
            .retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|n| n == name)
        {
            return Err(IpcError::Gone(format!(
                "the peer retired its pool {name} (the buffer is stale)"
            )));
        }
        let names = [name.to_string()];
        let fetched = import_pools(&from.node, from.pid, &names, &from.secret, &from.gpus)
            .await
            .map_err(|e| IpcError::Fetch(format!("the peer's pool {name}: {e}")))?;
        let surplus = self.add(fetched);
        if !surplus.is_empty() {
            // Retired while it was fetched.
            tokio::task::spawn_blocking(move || drop(surplus));
        }
        Ok(self.snapshot())
    }
}

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

/// Fetches and imports the pools of the peer `node` (process `pid`) named `names`
/// ([`crate::cuda::pool_name`]), and lets every GPU of ours read them. Runs the driver
/// calls on a blocking thread.
///
/// # Errors
/// Why one of them could not be imported, naming the device.
pub async fn import_pools(
    node: &str,
    pid: u32,
    names: &[String],
    secret: &Secret,
    gpus: &Gpus,
) -> Result<ImportedPools, IpcError> {
    let mut out = ImportedPools::new();
    for name in names {
        let uuid = crate::cuda::pool_device(name);
        let Some(device) = gpus.visible_by_uuid(uuid).cloned() else {
            return Err(IpcError::Unsupported(format!(
                "the peer's GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?)"
            )));
        };
        let fd = fdshare::fetch(node, pid, name, secret)
            .await
            .map_err(|e| IpcError::Fetch(e.to_string()))?;
        let ours: Vec<Device> = gpus.gpus.iter().map(|(_, g)| g.device.clone()).collect();
        let pool_name = name.clone();
        let imported = tokio::task::spawn_blocking(move || {
            let pool = ExportablePool::import_fd(&device, fd, &pool_name)?;
            for d in &ours {
                pool.grant_access(d)?;
            }
            Ok::<_, CudaError>(pool)
        })
        .await
        .map_err(|e| IpcError::Gone(format!("the import task failed: {e}")))?
        .map_err(at("importing the peer's pool"))?;
        out.insert(name.clone(), imported);
    }
    Ok(out)
}
