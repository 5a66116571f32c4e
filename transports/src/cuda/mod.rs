//! The CUDA layer: a safe layer over cudarc's driver bindings.
//!
//! - [`probe`]: whether this machine has a working driver and what its GPUs can do;
//! - [`Device`]: a GPU by ordinal or UUID, holding its primary context; [`peer_access`],
//!   [`enable_peer_access`];
//! - [`Stream`], [`Event`]: RAII, created and destroyed in their device's context;
//! - [`ExportablePool`] → [`DeviceBuffer`]; its fd → [`ImportedPool`] in another process,
//!   a buffer's 64-byte export → [`ImportedBuffer`] there;
//! - memory the user allocated ([`PlainAllocation`], `cuMemAlloc`) registered as a
//!   [`DeviceBuffer`] and crossing as a legacy IPC handle → [`IpcMapping`] in the peer;
//! - copies ([`copy_async`], [`copy_from_host`], [`copy_to_host`], pinned
//!   [`PinnedBuffer`] copies) and [`pattern`] helpers for checksummed tests.
//!
//! It owns driver handles and their lifetimes; it does not decide budgets, leases or routes
//! (the allocator and transfer actors do), and it does not move file descriptors between
//! processes (the link does).
//!
//! The driver is loaded at run time (cudarc's dynamic loading), so the build needs no CUDA.
//! cudarc panics when the library (or one of its symbols) is missing on its first call, so
//! every entry point here checks that the library loads before calling into cudarc
//! ([`probe`] directly, everything else through [`Device::open`] / [`Device::count`], which
//! every other object is made from). Without a driver they return
//! [`CudaError::NoDriver`] ("no CUDA driver: GPU transports disabled").
//!
//! The three FFI steps: `cudarc::driver::sys` (raw), `raw` (one thin function per call,
//! returning `Result<_, CudaError>`), and the RAII types here.
//!
//! This is one of the few modules allowed to use `unsafe` (FFI into the driver); each block
//! says why it is sound.
#![allow(unsafe_code)]

mod copy;
mod device;
mod error;
mod external;
mod gather;
pub use gather::load_kernel as load_gather_kernel;
pub mod pattern;
mod pool;
mod probe;
mod raw;
mod stream;

pub use copy::{
    BlockCopies, DeviceMemory, Gathered, Pair, PinnedBuffer, PinnedRing, Wait, block_copies,
    copy_and_wait, copy_async, copy_async_marked, copy_boxes_async, copy_boxes_to_host,
    copy_from_host, copy_from_pinned_async, copy_many_async, copy_to_host, copy_to_pinned_async,
    fill_async, scatter_boxes_async, scatter_boxes_from_host,
};
pub use device::{Device, enable_peer_access, peer_access};
pub use error::CudaError;
pub use external::{ExternalMemory, IpcMapping, PlainAllocation, ReleaseSignal};
pub use pool::{
    DeviceBuffer, ExportablePool, ImportedBuffer, ImportedPool, LegacyExport, POINTER_EXPORT_LEN,
    PoolUsage, pool_device, pool_name,
};
pub use probe::{CudaDevice, CudaDriver, CudaProbe, probe};
pub use raw::driver;
pub use stream::{Event, SPIN_LIMIT, Stream};
