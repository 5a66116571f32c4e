//! The node's GPUs as the transports use them: each device with the streams its pulls are
//! copied on, every GPU the process sees, the pools and rings the node serves on its
//! fd-sharing socket, and the lock that keeps a peer's memory from being mapped while
//! copies run. (Each GPU's allocator, its memory domain, is the actors'.)

use std::sync::Arc;

use crate::cuda::{CudaError, Device, Stream};
use crate::fdshare::PoolDirectory;

/// The node's GPUs, shared by its peers' transports.
pub type SharedGpus = Arc<Gpus>;

/// One GPU of the node.
#[derive(Clone)]
pub struct Gpu {
    /// The device.
    pub device: Device,
    /// The stream pulls into this device's memory are copied on.
    pub copy_stream: Stream,
    /// The stream of small pulls (the lane's small records, a socket-path pull of at most
    /// [`crate::ipc::EXPRESS_PULL_MAX`]): apart from `copy_stream`, so that waiting for a few bytes never
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
    /// Pools served on the fd-sharing socket, by name (see [`crate::cuda::pool_name`]).
    pub pools: PoolDirectory,
    /// Fast-lane rings offered to peers, served on the fd-sharing socket by key.
    pub rings: crate::fdshare::RingDirectory,
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
    /// True when this node uses no GPU.
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

    /// The names of the pools this node exports now (one per GPU; see
    /// [`crate::cuda::pool_name`]).
    pub fn pool_names(&self) -> Vec<String> {
        self.pools.names()
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
    ///
    /// # Errors
    /// The driver's, waiting for a stream.
    pub fn drain_copies(&self) -> Result<std::sync::RwLockWriteGuard<'_, ()>, CudaError> {
        let quiet = self.mapping.write().unwrap_or_else(|p| p.into_inner());
        for (_, g) in &self.gpus {
            for stream in [&g.copy_stream, &g.express_stream] {
                stream.synchronize()?;
            }
        }
        Ok(quiet)
    }

    /// Held while a copy is queued (and, for a small copy, waited for): no import starts
    /// meanwhile.
    pub fn copying(&self) -> std::sync::RwLockReadGuard<'_, ()> {
        self.mapping.read().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy stream on `device` if the node uses it, else the first GPU's; the express
    /// stream when `express`. `None` when the node uses no GPU.
    pub fn copy_stream(&self, device: &Device, express: bool) -> Option<Stream> {
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
    }

    /// The first GPU's device (staging slots register as pinned with its context).
    pub fn first_device(&self) -> Option<&Device> {
        self.gpus.first().map(|(_, g)| &g.device)
    }
}
