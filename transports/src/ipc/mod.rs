//! The ipc transport's pieces below the actors: its declaration and whether it can run
//! here. A buffer crosses ipc as its 64-byte pointer export ([`IpcSource`]);
//! that export grants nothing without the pool it came from, and the pool travels once per
//! peer and device as a file descriptor, through the node's fd-sharing socket
//! ([`crate::fdshare`]).

use std::sync::OnceLock;

mod error;
mod export;
pub mod handle_cache;
mod imports;
mod kind;
pub mod lane;
mod peer;
mod pull;
mod push;
mod wire;

pub use error::IpcError;
pub use export::{
    export_source, lease_ref, offer_in_process, pull_in_process, withdraw_in_process,
};
pub use imports::{
    EXPRESS_PULL_MAX, IMPORT_CACHE_CAPACITY, ImportCache, ImportedPools, LEGACY_CACHE_CAPACITY,
    LEGACY_REGISTRATIONS_MAX, PoolImports, PoolSource, SharedImports, Unmapped, import_pools,
    is_mapped,
};
pub use kind::IpcKind;
pub use peer::IpcTransport;
pub use pull::{QueuedPull, TakeEvent, pull, queue_pull, queue_pulls};
pub use push::push;
pub use wire::*;

use ferry_config::{Direction, Locality, MemoryClass, TransportName};

use crate::cuda::CudaProbe;
use crate::transport::{Capabilities, Viability};

/// The ipc transport's declaration: it moves device memory of a same-host peer, pulling by
/// default (the receiver copies from the sender's exported buffer) or pushing when a rule
/// asks (the sender copies into the receiver's exported buffer), and lands anywhere.
pub fn capabilities() -> Capabilities {
    Capabilities {
        name: TransportName::Ipc,
        sources: &[MemoryClass::Device],
        memory: &[MemoryClass::Device, MemoryClass::Pinned, MemoryClass::Host],
        localities: &[Locality::SameHost],
        directions: &[Direction::Pull, Direction::Push],
        needs_fd_passing: true,
        one_sided_put: false,
        carrier: crate::transport::Carrier::Memory,
        per_peer_setup: true,
        opt_in: false,
        lane: true,
        device_path: crate::transport::DevicePath::CopyEngine,
        library: Some(crate::transport::Library::Cuda),
    }
}

/// Whether ipc can run here: a working CUDA driver with at least one GPU whose memory pools
/// export as POSIX file descriptors. Probed once per process.
pub fn viability() -> Viability {
    static VERDICT: OnceLock<Viability> = OnceLock::new();
    VERDICT
        .get_or_init(|| match crate::cuda::probe() {
            CudaProbe::NoDriver => {
                Viability::NotViable("no CUDA driver: GPU transports disabled".into())
            }
            CudaProbe::Failed { error, .. } => {
                Viability::NotViable(format!("the CUDA driver does not work: {error}"))
            }
            CudaProbe::Ready(driver) if driver.devices.is_empty() => {
                Viability::NotViable("the CUDA driver sees no GPU".into())
            }
            CudaProbe::Ready(driver) if !driver.devices.iter().any(|d| d.pool_posix_fd) => {
                Viability::NotViable(
                    "no GPU here can export its memory pool as a file descriptor".into(),
                )
            }
            CudaProbe::Ready(_) => Viability::Viable,
        })
        .clone()
}

/// A fresh key for a lane ring.
pub fn lane_key() -> String {
    format!("lane/{:032x}", rand::random::<u128>())
}
