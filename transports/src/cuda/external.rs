//! Device memory that did not come from a ferry pool: plain `cuMemAlloc` allocations (what
//! a framework's allocator hands out), their legacy IPC handles, and the importer's mapping
//! of such a handle.
//!
//! The registration itself is a [`DeviceBuffer`](super::DeviceBuffer)
//! ([`register_external`](super::DeviceBuffer::register_external)); its end is a
//! [`ReleaseSignal`].

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;

use super::copy::{DeviceMemory, Uses, sealed};
use super::device::Device;
use super::error::{CudaError, teardown_failed};
use super::raw;
use super::stream::Stream;

/// Device memory the caller allocated outside ferry (`cudaMalloc`, a framework's tensor),
/// described for [`DeviceBuffer::register_external`](super::DeviceBuffer::register_external).
/// Making one is the unsafe step: it is the caller's promise about the memory's lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExternalMemory {
    ptr: u64,
    len: usize,
    device: u32,
}

impl ExternalMemory {
    /// `len` bytes at device address `ptr` on the GPU with CUDA ordinal `device`.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` was allocated with `cuMemAlloc`/`cudaMalloc` in this process and
    /// stays allocated, and is written by nobody else, until every buffer registered from
    /// this description has signalled its release ([`ReleaseSignal`]; the node's
    /// `unregister_external` waits for it). Freeing it earlier lets a peer's copy read
    /// memory that was handed out again.
    ///
    /// # Panics
    /// Never; a zero length is refused at registration.
    pub unsafe fn new(ptr: u64, len: usize, device: u32) -> Self {
        Self { ptr, len, device }
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for zero bytes (refused at registration).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GPU's CUDA ordinal.
    pub fn device(&self) -> u32 {
        self.device
    }
}

/// Set once when a registration of external memory ended: the buffer is gone, the copies
/// that used it completed, and no peer maps it through ferry any more. Until then the
/// memory must stay allocated.
#[derive(Debug, Default)]
pub struct ReleaseSignal {
    set: AtomicBool,
    notify: tokio::sync::Notify,
}

impl ReleaseSignal {
    /// True once set.
    pub fn is_set(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    /// Waits until set.
    pub async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            if self.is_set() {
                return;
            }
            notified.await;
        }
    }

    pub(super) fn set(&self) {
        self.set.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }
}

/// Device memory from `cuMemAlloc`, freed with `cuMemFree` when dropped: memory the way a
/// framework's allocator hands it out, for registering with ferry (tests, benches, tools).
pub struct PlainAllocation {
    device: Device,
    ptr: sys::CUdeviceptr,
    len: usize,
    uses: Uses,
}

// SAFETY: owns its allocation like a Box; the device address is only passed to the driver.
unsafe impl Send for PlainAllocation {}
// SAFETY: shared access only queues copies, which the driver makes safe.
unsafe impl Sync for PlainAllocation {}

impl PlainAllocation {
    /// `len` bytes of `device` memory (`cuMemAlloc`). Contents are unspecified.
    ///
    /// # Errors
    /// [`CudaError::Misuse`] for zero bytes; a driver error (out of memory) otherwise.
    pub fn new(device: &Device, len: usize) -> Result<PlainAllocation, CudaError> {
        if len == 0 {
            return Err(CudaError::Misuse(
                "a device allocation of zero bytes".into(),
            ));
        }
        device.bind()?;
        // SAFETY: the device's context is current (bound above).
        let ptr = unsafe { raw::mem_alloc(len) }?;
        Ok(PlainAllocation {
            device: device.clone(),
            ptr,
            len,
            uses: Uses::default(),
        })
    }

    /// Fills the allocation with `value` and waits.
    ///
    /// # Errors
    /// A driver error.
    pub fn fill(&mut self, value: u8, stream: &Stream) -> Result<(), CudaError> {
        super::copy::fill_async(self, 0, self.len, value, stream)?;
        stream.synchronize()
    }
}

impl sealed::Sealed for PlainAllocation {
    fn region(&self) -> (sys::CUdeviceptr, usize) {
        (self.ptr, self.len)
    }
    fn note_use(&self, stream: &Stream) -> Result<(), CudaError> {
        self.uses.note(stream)
    }
}

impl DeviceMemory for PlainAllocation {
    fn device(&self) -> &Device {
        &self.device
    }
}

impl Drop for PlainAllocation {
    fn drop(&mut self) {
        let done = self.uses.wait_all().and_then(|()| {
            self.device.bind()?;
            // SAFETY: allocated by cuMemAlloc, freed once, every copy of this layer that used
            // it completed (waited above).
            unsafe { raw::mem_free(self.ptr) }
        });
        if let Err(e) = done {
            teardown_failed!(e, len = self.len, "freeing a device allocation failed");
        }
    }
}

impl std::fmt::Debug for PlainAllocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlainAllocation")
            .field("device", &self.device.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

/// A peer's allocation mapped into this process from its legacy IPC handle
/// (`cuIpcOpenMemHandle`). Dropping it waits for this layer's copies that read it, then
/// unmaps it (`cuIpcCloseMemHandle`): the exporter may free the allocation only after that.
/// Opening costs about a millisecond, so importers cache mappings (by allocation identity,
/// never by address).
pub struct IpcMapping {
    /// The device whose context opened the handle (the allocation's GPU).
    device: Device,
    ptr: sys::CUdeviceptr,
    len: usize,
    uses: Uses,
}

// SAFETY: owns its mapping like a Box; the device address is only passed to the driver.
unsafe impl Send for IpcMapping {}
// SAFETY: shared access only queues reads, which the driver makes safe.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Maps the allocation behind `handle`, which lives on `device` (the exporter's GPU, as
    /// this process sees it: match them by UUID).
    ///
    /// # Errors
    /// A driver error: bytes that are no handle, an allocation already freed, a process on
    /// another host.
    pub fn open(device: &Device, handle: &[u8; 64]) -> Result<IpcMapping, CudaError> {
        device.bind()?;
        // SAFETY: the device's context is current (bound above).
        let ptr = unsafe { raw::ipc_open_mem_handle(handle) }?;
        // SAFETY: as above; the address was just mapped.
        let size = match unsafe { raw::mem_get_address_range(ptr) } {
            Ok((_, size)) => size,
            Err(e) => {
                // SAFETY: opened just above, closed once, never used.
                let _ = unsafe { raw::ipc_close_mem_handle(ptr) };
                return Err(e);
            }
        };
        Ok(IpcMapping {
            device: device.clone(),
            ptr,
            len: size,
            uses: Uses::default(),
        })
    }
}

impl sealed::Sealed for IpcMapping {
    fn region(&self) -> (sys::CUdeviceptr, usize) {
        (self.ptr, self.len)
    }
    fn note_use(&self, stream: &Stream) -> Result<(), CudaError> {
        self.uses.note(stream)
    }
}

impl DeviceMemory for IpcMapping {
    fn device(&self) -> &Device {
        &self.device
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let done = self.uses.wait_all().and_then(|()| {
            self.device.bind()?;
            // SAFETY: opened by cuIpcOpenMemHandle in this device's context (bound above),
            // closed once, and every copy of this layer that read it completed.
            unsafe { raw::ipc_close_mem_handle(self.ptr) }
        });
        if let Err(e) = done {
            teardown_failed!(e, len = self.len, "closing a legacy IPC mapping failed");
        }
    }
}

impl std::fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMapping")
            .field("device", &self.device.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}
