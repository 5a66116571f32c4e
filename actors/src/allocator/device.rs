//! A GPU domain's memory: its pool, the allocations a grant makes, and giving the pool's
//! unused memory back to the GPU.

use std::time::Instant;

use ferry_transports::cuda::{ExportablePool, Stream};

use super::Domain;
use super::shelf::{Kept, free_kept};

/// Where a GPU domain's memory comes from: its device's exportable pool, allocated in
/// stream order on the domain's own stream.
#[derive(Debug, Clone)]
pub struct DevicePool {
    /// The pool (exportable: same-host peers import it once, then each buffer cheaply).
    pub pool: ExportablePool,
    /// The stream allocations are made (and freed) on.
    pub stream: Stream,
    /// The GPU's other streams that grants may be allocated (and their memory freed) on
    /// (a lane's landing goes on its copy stream): giving the pool's unused memory back
    /// waits for the frees queued there first.
    pub others: Vec<Stream>,
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
            if memory.reuse(&device.pool, n, on).is_ok() {
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
    if let Some(stream) = on.filter(|s| s.device().same_as(device.stream.device())) {
        // Stream-ordered: the caller's next work on `stream` follows the allocation.
        return device.pool.alloc(n, stream);
    }
    let memory = device.pool.alloc(n, &device.stream)?;
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
/// queued on the domain's streams have ended (the pool releases only memory it saw freed).
/// Blocking: never on an actor's thread.
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
        .and_then(|()| device.pool.trim_to(0));
    if let Err(e) = trimmed {
        tracing::warn!(error = %e, "giving a GPU pool's unused memory back failed");
    }
}
