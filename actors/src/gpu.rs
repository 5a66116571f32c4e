//! The node's GPUs as the actors use them: one memory domain per device (its allocator,
//! over the device's exportable pool), beside what the transports use of each GPU
//! ([`ferry_transports::gpus::Gpus`]: its device, copy streams, the pools and rings served
//! to peers).

use std::sync::Arc;

use ferry_transports::cuda::{CudaError, Device, ExportablePool, Stream};

/// The node's GPUs: what the transports use of them, and each one's allocator. Derefs to
/// the transports' view.
#[derive(Clone, Default)]
pub struct Gpus {
    /// Devices, streams, served pools and rings: what the transports use.
    pub devices: ferry_transports::gpus::SharedGpus,
    /// Each GPU's allocator (its `device{n}` domain), by ordinal.
    pub domains: Vec<(u32, crate::allocator::DomainHandle)>,
}

impl std::ops::Deref for Gpus {
    type Target = ferry_transports::gpus::Gpus;

    fn deref(&self) -> &Self::Target {
        &self.devices
    }
}

impl std::fmt::Debug for Gpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.devices, f)
    }
}

impl Gpus {
    /// The allocator of the GPU with this ordinal, if the node uses it.
    pub fn domain(&self, ordinal: u32) -> Option<&crate::allocator::DomainHandle> {
        self.domains
            .iter()
            .find(|(n, _)| *n == ordinal)
            .map(|(_, d)| d)
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

/// Shared between the node's actors.
pub type SharedGpus = Arc<Gpus>;
