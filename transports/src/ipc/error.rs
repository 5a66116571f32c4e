//! Why an ipc import, export or copy failed.

use crate::cuda::CudaError;

/// Why an ipc import, export or copy failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum IpcError {
    /// A CUDA driver call failed at this step.
    #[error("{step}: {source}")]
    Driver {
        /// What was being done.
        step: &'static str,
        /// The driver's error.
        #[source]
        source: CudaError,
    },
    /// What the peer sent cannot be used (a range, layout or handle that does not fit).
    #[error("{0}")]
    BadDescriptor(String),
    /// The memory is gone: the peer freed it, the offer ended, the transfer stopped.
    #[error("{0}")]
    Gone(String),
    /// This machine or buffer cannot do it (not device memory, a GPU not visible here).
    #[error("{0}")]
    Unsupported(String),
    /// The peer's pool descriptor could not be fetched.
    #[error("fetching the peer's pool: {0}")]
    Fetch(String),
}

/// Maps a driver error at `step` into an [`IpcError`].
pub(crate) fn at(step: &'static str) -> impl FnOnce(CudaError) -> IpcError {
    move |source| IpcError::Driver { step, source }
}

/// The error of a node that uses no GPU, asked for a copy stream.
pub(crate) fn no_stream() -> IpcError {
    IpcError::Unsupported("this node uses no GPU: no copy stream".into())
}
