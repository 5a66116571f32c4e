//! Devices and their primary contexts.

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;

use super::error::{CudaError, teardown_failed};
use super::probe;
use super::raw;

/// One GPU, with a reference on its primary context held for as long as any clone (or any
/// stream, event, pool or buffer made from it) lives.
///
/// Cheap to clone. Every call that needs a context binds this device's primary context to
/// the calling thread first, so a `Device` may be used from any thread.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    ordinal: c_int,
    handle: sys::CUdevice,
    ctx: sys::CUcontext,
    name: String,
    uuid: String,
    pci_bus_id: String,
    /// The run tables of the gathers on this device's streams (none until the first).
    gather: super::gather::Tables,
}

// SAFETY: the driver API is thread-safe; a CUcontext is a handle that may be made current on
// any thread, and DeviceInner never hands out references into driver-owned memory.
unsafe impl Send for DeviceInner {}
// SAFETY: as for Send; every method takes &self and only passes the handles to the driver.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: the tables were made in this context, still retained here (released
        // below, after them).
        unsafe { self.gather.release(self.ctx) };
        // SAFETY: balances the retain in `Device::open`; this is the last reference, and every
        // object made in the context holds a `Device`, so none outlives this release.
        if let Err(e) = unsafe { raw::primary_ctx_release(self.handle) } {
            teardown_failed!(
                e,
                ordinal = self.ordinal,
                "releasing a primary context failed"
            );
        }
    }
}

impl Device {
    /// The number of GPUs the driver sees.
    ///
    /// # Errors
    /// [`CudaError::NoDriver`] without `libcuda`; a driver error otherwise.
    pub fn count() -> Result<usize, CudaError> {
        raw::driver()?;
        Ok(raw::device_count()?.max(0) as usize)
    }

    /// Opens GPU `ordinal` and retains its primary context. Blocks for the context's creation
    /// the first time (tens to hundreds of milliseconds).
    ///
    /// # Errors
    /// [`CudaError::NoDriver`] without `libcuda`, [`CudaError::Misuse`] for an ordinal that
    /// does not exist, a driver error otherwise.
    pub fn open(ordinal: usize) -> Result<Device, CudaError> {
        raw::driver()?;
        let count = raw::device_count()?;
        let ordinal = c_int::try_from(ordinal)
            .ok()
            .filter(|&o| o < count)
            .ok_or_else(|| {
                CudaError::Misuse(format!("no GPU {ordinal}: the driver sees {count}"))
            })?;
        let handle = raw::device_get(ordinal)?;
        let name = result::device::get_name(handle).map_err(|e| CudaError::Driver {
            call: "cuDeviceGetName",
            code: e.0,
        })?;
        let uuid =
            probe::uuid_text(
                &result::device::get_uuid(handle).map_err(|e| CudaError::Driver {
                    call: "cuDeviceGetUuid",
                    code: e.0,
                })?,
            );
        let pci_bus_id = probe::pci_bus_id(handle).map_err(|e| CudaError::Driver {
            call: "cuDeviceGetPCIBusId",
            code: e.0,
        })?;
        // SAFETY: `handle` came from cuDeviceGet; DeviceInner's Drop balances the retain.
        let ctx = unsafe { raw::primary_ctx_retain(handle) }?;
        Ok(Device {
            inner: Arc::new(DeviceInner {
                ordinal,
                handle,
                ctx,
                name,
                uuid,
                pci_bus_id,
                gather: super::gather::Tables::default(),
            }),
        })
    }

    /// Opens every GPU, by ordinal.
    ///
    /// # Errors
    /// As [`Device::open`].
    pub fn all() -> Result<Vec<Device>, CudaError> {
        (0..Device::count()?).map(Device::open).collect()
    }

    /// Opens the GPU whose UUID is `uuid` (as nvidia-smi prints it, `GPU-...`).
    ///
    /// # Errors
    /// [`CudaError::Misuse`] when no GPU has that UUID; as [`Device::open`] otherwise.
    pub fn by_uuid(uuid: &str) -> Result<Device, CudaError> {
        Device::all()?
            .into_iter()
            .find(|d| d.uuid().eq_ignore_ascii_case(uuid))
            .ok_or_else(|| CudaError::Misuse(format!("no GPU has the UUID {uuid}")))
    }

    /// The ordinal (as `CUDA_VISIBLE_DEVICES` numbers the GPUs).
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal as usize
    }

    /// Marketing name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// UUID as nvidia-smi prints it (`GPU-xxxxxxxx-...`): the identity to use across
    /// processes, where ordinals may differ.
    pub fn uuid(&self) -> &str {
        &self.inner.uuid
    }

    /// PCI bus id, e.g. `0000:18:00.0`.
    pub fn pci_bus_id(&self) -> &str {
        &self.inner.pci_bus_id
    }

    /// Makes this device's primary context current on the calling thread.
    ///
    /// # Errors
    /// A driver error.
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context is retained for as long as `self` lives.
        unsafe { raw::ctx_set_current(self.inner.ctx) }
    }

    pub(super) fn ordinal_c(&self) -> c_int {
        self.inner.ordinal
    }

    pub(super) fn handle(&self) -> sys::CUdevice {
        self.inner.handle
    }

    pub(super) fn ctx(&self) -> sys::CUcontext {
        self.inner.ctx
    }

    /// The run tables of the gathers queued on this device's streams.
    pub(super) fn gather_tables(&self) -> &super::gather::Tables {
        &self.inner.gather
    }

    /// Free and total memory of the device in bytes, as the driver counts them
    /// (`cuMemGetInfo`: every process's allocations and reserved pool memory included).
    ///
    /// # Errors
    /// A driver error.
    pub fn memory_info(&self) -> Result<(u64, u64), CudaError> {
        self.bind()?;
        // SAFETY: this device's context is current (bound above).
        unsafe { raw::mem_get_info() }
    }

    /// True when both values are the same GPU.
    pub fn same_as(&self, other: &Device) -> bool {
        self.inner.handle == other.inner.handle
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.inner.ordinal)
            .field("uuid", &self.inner.uuid)
            .field("pci_bus_id", &self.inner.pci_bus_id)
            .finish()
    }
}

/// True when `a` can map `b`'s memory (`cuDeviceCanAccessPeer`); false for the same device.
///
/// # Errors
/// A driver error.
pub fn peer_access(a: &Device, b: &Device) -> Result<bool, CudaError> {
    if a.same_as(b) {
        return Ok(false);
    }
    // SAFETY: both handles came from cuDeviceGet (Device::open).
    unsafe { raw::device_can_access_peer(a.handle(), b.handle()) }
}

/// Lets `from`'s context access memory of `to` allocated with `cuMemAlloc` and friends
/// (`cuCtxEnablePeerAccess`). Already enabled is success. Pool allocations do not follow
/// this setting: use [`ExportablePool::grant_access`](super::ExportablePool::grant_access).
///
/// # Errors
/// [`CudaError::Misuse`] for the same device; a driver error, e.g.
/// `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`, otherwise.
pub fn enable_peer_access(from: &Device, to: &Device) -> Result<(), CudaError> {
    if from.same_as(to) {
        return Err(CudaError::Misuse(
            "peer access from a device to itself".into(),
        ));
    }
    from.bind()?;
    // SAFETY: `from`'s context is current (bound above) and `to`'s is retained by `to`.
    unsafe { raw::ctx_enable_peer_access(to.ctx()) }.map(|_| ())
}
