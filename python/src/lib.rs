//! The Python binding of ferry: the extension module `ferry._ferry`, which the `ferry`
//! Python package (`python/ferry/`) re-exports.
//!
//! It owns the translation between Python and ferry's Rust API, and nothing of ferry's
//! behaviour: `node::Node` wraps a [`ferry::Node`] and the tokio runtime its futures run
//! on, `buffer::Buffer` a [`ferry::Buffer`] with the views Python holds of it, and
//! `errors` maps [`ferry::Error`] to one exception class per [`ferry::ErrorKind`].
//!
//! Unlike the rest of the workspace, this crate uses `unsafe`: the buffer protocol
//! (`buffer`), DLPack (`dlpack`), reading the memory of objects being sent (`source`) and
//! two CUDA driver calls (`gpu`) are C interfaces. Each block says why it is sound; the
//! other modules deny it.
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(unsafe_code)]

mod asyncio;
mod buffer;
mod convert;
mod dlpack;
mod errors;
mod gpu;
mod node;
mod source;

use pyo3::prelude::*;

/// The extension module: `Node`, `Buffer`, and the lists of error kinds and refusal
/// reasons for the package's own check.
#[pymodule]
fn _ferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<node::Node>()?;
    m.add_class::<buffer::Buffer>()?;
    m.add_function(wrap_pyfunction!(errors::_error_kinds, m)?)?;
    m.add_function(wrap_pyfunction!(errors::_refusal_reasons, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
