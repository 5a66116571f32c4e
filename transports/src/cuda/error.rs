//! The CUDA layer's error type.

use cudarc::driver::sys::CUresult;

/// What went wrong in the CUDA layer.
///
/// `Clone` so that one failure can fail many pending transfers; it keeps the driver's own
/// code ([`CUresult`]) and the name of the call that returned it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The driver library (`libcuda.so.1`) cannot be loaded on this machine.
    #[error("no CUDA driver: GPU transports disabled")]
    NoDriver,
    /// The driver library loads but lacks an entry point of the CUDA 12.8 bindings ferry
    /// uses (a driver older than CUDA 12.8).
    #[error("the CUDA driver lacks {0} (driver older than CUDA 12.8): GPU transports disabled")]
    MissingEntryPoint(&'static str),
    /// A driver call failed.
    #[error("{call} failed: {code:?}")]
    Driver {
        /// The driver function, e.g. `cuMemPoolImportPointer`.
        call: &'static str,
        /// The driver's error code.
        code: CUresult,
    },
    /// The caller asked for something this layer refuses (API misuse): a range outside a
    /// buffer, a stream of another device, a device ordinal that does not exist.
    #[error("invalid use of the CUDA layer: {0}")]
    Misuse(String),
}

impl CudaError {
    /// The driver's error code, for a failed driver call.
    pub fn code(&self) -> Option<CUresult> {
        match self {
            CudaError::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// Turns a driver return code into a `Result` naming the call.
pub(super) fn check(call: &'static str, code: CUresult) -> Result<(), CudaError> {
    if code == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Driver { call, code })
    }
}
