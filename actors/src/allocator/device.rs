//! A GPU domain's memory: its pool, the allocations a grant makes, and giving the pool's
//! unused memory back to the GPU.

use std::sync::{Arc, RwLock};
use std::time::Instant;

use ferry_transports::cuda::{ExportablePool, Stream};
use ferry_transports::fdshare::PoolDirectory;

use super::Domain;
use super::shelf::{Kept, free_kept};

/// Where a GPU domain's memory comes from: its device's exportable pool, allocated in
/// stream order on the domain's own stream.
///
/// A pool whose memory was exported keeps it reserved after it is freed (no trim gives it
/// back: [`ExportablePool::renewed`]), so when the domain gives its unused memory back with
/// nothing allocated from a pool that exported, the pool is replaced by a new one, under a
/// new name in the node's pool directory; peers are told to close their imports of the old
/// one, and its memory goes back to the GPU with them.
#[derive(Debug, Clone)]
pub struct DevicePool {
    /// The pool (exportable: same-host peers import it once, then each buffer cheaply).
    /// Allocations hold the read side; a replacement the write side.
    pool: Arc<RwLock<ExportablePool>>,
    /// Where the node exports its pools, when it does.
    directory: Option<PoolDirectory>,
    /// The stream allocations are made (and freed) on.
    pub stream: Stream,
    /// The GPU's other streams that grants may be allocated (and their memory freed) on
    /// (a lane's landing goes on its copy stream): giving the pool's unused memory back
    /// waits for the frees queued there first.
    pub others: Vec<Stream>,
}

impl DevicePool {
    /// Memory from `pool`, allocated on `stream`; `others` as [`Self::others`].
    pub fn new(pool: ExportablePool, stream: Stream, others: Vec<Stream>) -> Self {
        Self {
            pool: Arc::new(RwLock::new(pool)),
            directory: None,
            stream,
            others,
        }
    }

    /// The pool is exported in `directory` (and replaced there when it is renewed).
    pub fn exported_in(mut self, directory: PoolDirectory) -> Self {
        directory.insert(self.current());
        self.directory = Some(directory);
        self
    }

    /// The pool allocations come from now.
    pub fn current(&self) -> ExportablePool {
        self.pool.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the pool when nothing is allocated from it and it ever exported memory
    /// (which a trim does not give back). Blocking (driver calls).
    ///
    /// # Errors
    /// A driver error (the old pool stays).
    fn renew_if_stuck(&self) -> Result<(), ferry_transports::cuda::CudaError> {
        let mut pool = self.pool.write().unwrap_or_else(|p| p.into_inner());
        // Exported memory stays reserved unseen (the pool's counters leave it out): a pool
        // that exported, with nothing allocated now, is replaced.
        // No buffer of it alive (counted here, exactly), and the driver agrees.
        if !pool.has_exported() || pool.live_buffers() > 0 || pool.usage()?.used > 0 {
            return Ok(());
        }
        let renewed = pool.renewed()?;
        tracing::debug!(
            old = %pool.name(),
            new = %renewed.name(),
            "replacing an idle GPU pool that exported memory"
        );
        if let Some(directory) = &self.directory {
            directory.replace(pool.name(), renewed.clone());
        }
        // The old pool is destroyed here (nothing holds it any more).
        *pool = renewed;
        Ok(())
    }
}

impl Domain {
    /// `len` bytes of this GPU's memory for [`Self::grant`]: `kept` (of that length, made
    /// on `on`) when it can be reused, else a new allocation. The GPU refusing it frees all
    /// kept memory and waits for that and for what `freed_on` names (memory the grant just
    /// freed), then asks once more: kept memory may be what the GPU lacks.
    pub(super) fn device_memory(
        &self,
        device: &DevicePool,
        len: u64,
        on: Option<&Stream>,
        kept: Option<ferry_transports::cuda::DeviceBuffer>,
        freed_on: &mut Vec<Stream>,
    ) -> Result<ferry_transports::cuda::DeviceBuffer, ferry_transports::cuda::CudaError> {
        if let (Some(mut memory), Some(on), Ok(n)) = (kept, on, usize::try_from(len)) {
            // Refused (the stream cannot wait): it is freed, and allocated anew below.
            if memory.reuse(&device.current(), n, on).is_ok() {
                return Ok(memory);
            }
        }
        allocate(device, len, on).or_else(|refused| {
            freed_on.extend(free_kept(self.take_shelf()));
            self.freed_to_pool();
            if freed_on.is_empty() {
                return Err(refused);
            }
            for stream in freed_on.drain(..) {
                stream.synchronize()?;
            }
            allocate(device, len, on)
        })
    }
}

/// `len` bytes from the device's pool: usable from every stream once this returns, or,
/// allocated `on` a stream of the device, by the work queued on it next.
fn allocate(
    device: &DevicePool,
    len: u64,
    on: Option<&ferry_transports::cuda::Stream>,
) -> Result<ferry_transports::cuda::DeviceBuffer, ferry_transports::cuda::CudaError> {
    let n = usize::try_from(len).map_err(|_| {
        ferry_transports::cuda::CudaError::Misuse(format!(
            "{len} bytes do not fit the address space"
        ))
    })?;
    let started = Instant::now();
    // Under the read side: a replacement waits for the allocation (and then sees it).
    let pool = device.pool.read().unwrap_or_else(|p| p.into_inner());
    if let Some(stream) = on.filter(|s| s.device().same_as(device.stream.device())) {
        // Stream-ordered: the caller's next work on `stream` follows the allocation.
        return pool.alloc(n, stream);
    }
    let memory = pool.alloc(n, &device.stream)?;
    drop(pool);
    // Usable from every stream (and exportable) once the allocation is done. Polled: the
    // stream usually holds only allocations and frees whose copies have ended (a buffer
    // dropped mid-copy makes it wait for that copy), so the wait is short and a blocking
    // wait's wake-up would cost more than it (see `cuda::Wait::Spin`).
    device.stream.spin()?;
    tracing::trace!(
        bytes = n,
        us = started.elapsed().as_micros() as u64,
        "device allocation"
    );
    Ok(memory)
}

/// Frees memory a sweep took off the shelf, then has `pool` (a GPU domain's, when the sweep
/// says so) give its unused memory back to the GPU (`cuMemPoolTrimTo`), once the frees
/// queued on the domain's streams have ended (the pool releases only memory it saw freed);
/// a pool left holding memory with nothing allocated is replaced
/// ([`DevicePool::renew_if_stuck`]). Blocking: never on an actor's thread.
pub(super) fn give_back(expired: Vec<Kept>, pool: Option<&DevicePool>) {
    let mut streams = free_kept(expired);
    let Some(device) = pool else { return };
    for stream in std::iter::once(&device.stream).chain(&device.others) {
        if !streams.iter().any(|s| s.same_as(stream)) {
            streams.push(stream.clone());
        }
    }
    let trimmed = streams
        .iter()
        .try_for_each(Stream::synchronize)
        .and_then(|()| device.current().trim_to(0))
        .and_then(|()| device.renew_if_stuck());
    if let Err(e) = trimmed {
        tracing::warn!(error = %e, "giving a GPU pool's unused memory back failed");
    }
}
