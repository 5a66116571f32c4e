//! The two driver calls the binding needs for tensors of other libraries: waiting for the
//! work that produces a tensor, and asking which GPU an address belongs to. Everything else
//! on a GPU goes through ferry's CUDA layer.
//!
//! Reached only for CUDA tensors, after the node opened its GPUs: the driver is loaded
//! then (cudarc loads it at run time; a missing library would panic in cudarc, which
//! [`ferry::cuda::driver`] rules out first).
#![allow(unsafe_code)]

use cudarc::driver::sys;
use ferry::cuda::Device;

/// `CU_STREAM_LEGACY`: the legacy default stream, a macro in `cuda.h`.
const STREAM_LEGACY: usize = 1;

fn check(result: sys::CUresult, what: &str) -> Result<(), String> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {result:?}"))
    }
}

/// Waits until the work queued on `stream` of `device` (a raw `CUstream` as an integer,
/// `None` for the legacy default stream) has completed: the producer's writes to a tensor
/// are then visible to ferry's copies and to peers.
pub(crate) fn settle(device: u32, stream: Option<usize>) -> Result<(), String> {
    ferry::cuda::driver().map_err(|e| e.to_string())?;
    let device = Device::open(device as usize).map_err(|e| e.to_string())?;
    device.bind().map_err(|e| e.to_string())?;
    let stream = stream.unwrap_or(STREAM_LEGACY) as sys::CUstream;
    // SAFETY: the driver is loaded and the device's context is current (bound above); the
    // stream is the legacy default stream or one the producer named for this tensor, and
    // synchronising an unknown handle is an error code, not undefined behaviour.
    check(
        unsafe { sys::cuStreamSynchronize(stream) },
        "cuStreamSynchronize",
    )
}

/// The CUDA ordinal of the GPU whose memory holds `ptr`.
pub(crate) fn device_of_pointer(ptr: u64) -> Result<u32, String> {
    ferry::cuda::driver().map_err(|e| e.to_string())?;
    let any = Device::open(0).map_err(|e| e.to_string())?;
    any.bind().map_err(|e| e.to_string())?;
    let mut ordinal: i32 = -1;
    // SAFETY: the driver is loaded and a context is current; the attribute is an int
    // written to `ordinal`; an address the driver does not know is an error code.
    check(
        unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut ordinal).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr,
            )
        },
        "cuPointerGetAttribute",
    )?;
    u32::try_from(ordinal).map_err(|_| format!("the address {ptr:#x} is not GPU memory"))
}
