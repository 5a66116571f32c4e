//! The asyncio flavour: an operation runs as a task on the node's tokio runtime and
//! resolves an `asyncio.Future` of the caller's event loop through
//! `loop.call_soon_threadsafe`, the one thread-safe way into a running loop.
//!
//! Chosen over a general bridge crate (pyo3-async-runtimes): this is the whole bridge, it
//! has no version lock with pyo3 beyond ours, and the two choices that matter here are
//! explicit: which operations a cancelled asyncio future aborts (receives, which are cancel
//! safe) and which run to their end (sends, whose registered memory must be unregistered
//! before the caller's tensor may be freed).

use std::future::Future;
use std::sync::Mutex;

use pyo3::prelude::*;
use tokio::runtime::Handle;
use tokio::task::AbortHandle;

/// What to do with a value whose asyncio future was cancelled after the operation had
/// completed (a receive that got a buffer): give it back.
pub(crate) type Unclaimed = Box<dyn FnOnce(Python<'_>, Py<PyAny>) + Send>;

/// Resolves the asyncio future with the outcome, unless it was cancelled meanwhile (then
/// a value goes to `unclaimed`). Called by the event loop, on its thread.
#[pyclass(frozen)]
struct Resolve {
    future: Py<PyAny>,
    outcome: Mutex<Option<PyResult<Py<PyAny>>>>,
    unclaimed: Mutex<Option<Unclaimed>>,
}

#[pymethods]
impl Resolve {
    fn __call__(&self, py: Python<'_>) -> PyResult<()> {
        let future = self.future.bind(py);
        let outcome = self
            .outcome
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if future.call_method0("done")?.is_truthy()? {
            let unclaimed = self
                .unclaimed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if let (Some(Ok(value)), Some(unclaimed)) = (outcome, unclaimed) {
                unclaimed(py, value);
            }
            return Ok(());
        }
        match outcome {
            Some(Ok(value)) => future.call_method1("set_result", (value,))?,
            Some(Err(error)) => future.call_method1("set_exception", (error.into_value(py),))?,
            None => return Ok(()),
        };
        Ok(())
    }
}

/// Aborts the task when its asyncio future is cancelled (a done-callback).
#[pyclass(frozen)]
struct AbortOnCancel {
    task: AbortHandle,
}

#[pymethods]
impl AbortOnCancel {
    fn __call__(&self, future: &Bound<'_, PyAny>) -> PyResult<()> {
        if future.call_method0("cancelled")?.is_truthy()? {
            self.task.abort();
        }
        Ok(())
    }
}

/// Whether cancelling the asyncio future stops the operation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnCancel {
    /// Abort it (the operation is cancel safe).
    Abort,
    /// Let it run to its end; only its result is dropped.
    Finish,
}

/// Runs `op` on `runtime` and returns an asyncio future of the running loop that resolves
/// with `finish(op's output)`, which runs with the GIL on the runtime's thread. A value
/// that finds the future cancelled goes to `unclaimed`, when given.
///
/// # Errors
/// `RuntimeError` when no event loop runs in this thread.
pub(crate) fn spawn<'py, T, F, C>(
    py: Python<'py>,
    runtime: &Handle,
    op: F,
    on_cancel: OnCancel,
    finish: C,
    unclaimed: Option<Unclaimed>,
) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = T> + Send + 'static,
    T: Send + 'static,
    C: FnOnce(Python<'_>, T) -> PyResult<Py<PyAny>> + Send + 'static,
{
    let event_loop = py
        .import("asyncio")?
        .call_method0("get_running_loop")?
        .unbind();
    let future = event_loop.bind(py).call_method0("create_future")?;
    let target = future.clone().unbind();
    let task = runtime.spawn(async move {
        let output = op.await;
        Python::attach(|py| {
            let outcome = finish(py, output);
            let resolve = Resolve {
                future: target,
                outcome: Mutex::new(Some(outcome)),
                unclaimed: Mutex::new(unclaimed),
            };
            // Fails only when the loop was closed: nobody can wait for the result then.
            let _ = event_loop
                .bind(py)
                .call_method1("call_soon_threadsafe", (resolve,));
        });
    });
    if on_cancel == OnCancel::Abort {
        let abort = AbortOnCancel {
            task: task.abort_handle(),
        };
        future.call_method1("add_done_callback", (abort,))?;
    }
    Ok(future)
}
