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

/// Whether a failure to destroy or release a driver object at teardown is expected rather
/// than a fault: `CUDA_ERROR_DEINITIALIZED` (the driver shut down at process exit, before
/// the last handle was dropped; everything it held is gone with it) and
/// `CUDA_ERROR_CONTEXT_IS_DESTROYED` (the context the object lived in is gone, and the
/// object with it). Nothing leaks in either case, so teardown logs them at debug; any
/// other code still warns.
pub(super) fn teardown_error_is_expected(code: CUresult) -> bool {
    matches!(
        code,
        CUresult::CUDA_ERROR_DEINITIALIZED | CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

impl CudaError {
    /// Whether this error, from a destroy or release call in a `Drop`, is expected at
    /// teardown (see [`teardown_error_is_expected`]).
    pub(super) fn expected_at_teardown(&self) -> bool {
        self.code().is_some_and(teardown_error_is_expected)
    }
}

/// Logs a failed destroy or release in a `Drop`: at debug when the driver or the context is
/// already gone (process exit; see [`teardown_error_is_expected`]), as a warning otherwise.
/// Takes the error, then the fields and message of a `tracing` event.
macro_rules! teardown_failed {
    ($error:expr, $($event:tt)+) => {{
        let error: &$crate::cuda::CudaError = &$error;
        if error.expected_at_teardown() {
            tracing::debug!(error = %error, $($event)+);
        } else {
            tracing::warn!(error = %error, $($event)+);
        }
    }};
}
pub(super) use teardown_failed;

/// Turns a driver return code into a `Result` naming the call.
pub(super) fn check(call: &'static str, code: CUresult) -> Result<(), CudaError> {
    if code == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Driver { call, code })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn teardown_after_the_driver_is_gone_is_expected() {
        assert!(teardown_error_is_expected(
            CUresult::CUDA_ERROR_DEINITIALIZED
        ));
        assert!(teardown_error_is_expected(
            CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED
        ));
        for code in [
            CUresult::CUDA_ERROR_INVALID_VALUE,
            CUresult::CUDA_ERROR_INVALID_HANDLE,
            CUresult::CUDA_ERROR_INVALID_CONTEXT,
            CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
            CUresult::CUDA_ERROR_NOT_INITIALIZED,
        ] {
            assert!(!teardown_error_is_expected(code), "{code:?}");
        }
        let gone = CudaError::Driver {
            call: "cuStreamDestroy",
            code: CUresult::CUDA_ERROR_DEINITIALIZED,
        };
        assert!(gone.expected_at_teardown());
        let bad = CudaError::Driver {
            call: "cuStreamDestroy",
            code: CUresult::CUDA_ERROR_INVALID_HANDLE,
        };
        assert!(!bad.expected_at_teardown());
        assert!(!CudaError::NoDriver.expected_at_teardown());
        assert!(!CudaError::Misuse("x".into()).expected_at_teardown());
    }
}
