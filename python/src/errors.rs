//! ferry's errors as Python exceptions.
//!
//! The exception classes live in `ferry/errors.py` (Python classes can inherit from two
//! bases, so `DeadlineExceeded` is also a `TimeoutError`); this module maps a Rust
//! [`ferry::Error`] to the class registered for its [`ferry::ErrorKind`] label and fills in
//! the attributes that say who is at fault (`kind`, `peer`, `transient`, `reason`, `cause`).

use ferry::{Error, ErrorKind, NoMemoryCause, RefusalReason};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;

/// `ferry.errors._BY_KIND`: label → exception class, looked up once.
static BY_KIND: PyOnceLock<Py<PyDict>> = PyOnceLock::new();

fn classes(py: Python<'_>) -> PyResult<&Bound<'_, PyDict>> {
    BY_KIND
        .get_or_try_init(py, || {
            let module = py.import("ferry.errors")?;
            let table = module.getattr("_BY_KIND")?.cast_into::<PyDict>()?;
            Ok::<_, PyErr>(table.unbind())
        })
        .map(|d| d.bind(py))
}

/// Every refusal reason the binding names (the others read `"other"`).
const REFUSAL_REASONS: [RefusalReason; 11] = [
    RefusalReason::Cancelled,
    RefusalReason::DeadlineExceeded,
    RefusalReason::TooLarge,
    RefusalReason::Unsupported,
    RefusalReason::ShuttingDown,
    RefusalReason::Protocol,
    RefusalReason::Stalled,
    RefusalReason::UnknownKey,
    RefusalReason::NotAllowed,
    RefusalReason::StaleKey,
    RefusalReason::ReadOnly,
];

/// The stable label of a refusal reason (`Refused.reason`).
fn refusal_label(reason: RefusalReason) -> &'static str {
    match reason {
        RefusalReason::Cancelled => "cancelled",
        RefusalReason::DeadlineExceeded => "deadline",
        RefusalReason::TooLarge => "too_large",
        RefusalReason::Unsupported => "unsupported",
        RefusalReason::ShuttingDown => "shutting_down",
        RefusalReason::Protocol => "protocol",
        RefusalReason::Stalled => "stalled",
        RefusalReason::UnknownKey => "unknown_key",
        RefusalReason::NotAllowed => "not_allowed",
        RefusalReason::StaleKey => "stale_key",
        RefusalReason::ReadOnly => "read_only",
        _ => "other",
    }
}

/// The stable label of why memory was not granted (`NoMemory.cause`).
fn no_memory_label(cause: NoMemoryCause) -> &'static str {
    match cause {
        NoMemoryCause::LargerThanBudget => "larger_than_budget",
        NoMemoryCause::DeadlinePassed => "deadline",
        NoMemoryCause::QueueFull => "queue_full",
        NoMemoryCause::DriverRefused => "driver_refused",
        NoMemoryCause::NoTier => "no_tier",
        _ => "other",
    }
}

/// The Python exception for `error`: an instance of the class registered for its kind
/// (the base `ferry.FerryError` for a kind newer than the Python package), whose message is
/// the error's own, with its `source` chain appended.
pub(crate) fn to_py(error: &Error) -> PyErr {
    Python::attach(|py| match build(py, error) {
        Ok(err) => err,
        // Only when `ferry.errors` cannot be imported: still say what went wrong.
        Err(lookup) => PyRuntimeError::new_err(format!("{error} (and {lookup})")),
    })
}

fn build(py: Python<'_>, error: &Error) -> PyResult<PyErr> {
    let kind = error.kind();
    let table = classes(py)?;
    let class = match table.get_item(kind.label())? {
        Some(class) => class,
        None => py.import("ferry.errors")?.getattr("FerryError")?,
    };
    let mut message = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    let exc = class.call1((message,))?;
    exc.setattr("kind", kind.label())?;
    exc.setattr("transient", error.is_transient())?;
    exc.setattr("peer", error.peer())?;
    match error {
        Error::Refused { reason, detail, .. } => {
            exc.setattr("reason", refusal_label(*reason))?;
            exc.setattr("detail", detail)?;
        }
        Error::NoMemory {
            kind, len, cause, ..
        } => {
            exc.setattr("cause", no_memory_label(*cause))?;
            exc.setattr("memory", crate::convert::kind_label(*kind))?;
            exc.setattr("nbytes", *len)?;
        }
        _ => {}
    }
    Ok(PyErr::from_value(exc))
}

/// A misuse of the Python API, as `ferry.UsageError`.
pub(crate) fn usage(detail: impl Into<String>) -> PyErr {
    to_py(&Error::Usage(detail.into()))
}

/// The node was closed, as `ferry.ShuttingDown`.
pub(crate) fn closed() -> PyErr {
    to_py(&Error::ShuttingDown)
}

/// `_ferry._refusal_reasons()`: the label of every refusal reason this build names.
#[pyfunction]
pub(crate) fn _refusal_reasons() -> Vec<&'static str> {
    REFUSAL_REASONS.iter().map(|r| refusal_label(*r)).collect()
}

/// `_ferry._error_kinds()`: the label of every error kind this build can raise.
#[pyfunction]
pub(crate) fn _error_kinds() -> Vec<&'static str> {
    ErrorKind::ALL.iter().map(|k| k.label()).collect()
}
