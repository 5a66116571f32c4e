//! `ferry.Node`: a ferry node owned by a Python object, with the tokio runtime its futures
//! run on.
//!
//! Blocking methods run their future on the calling thread (`Handle::block_on`) with the
//! GIL released, in slices of [`SLICE`] between which pending signals are checked, so that
//! Ctrl-C interrupts a long `recv`. The `a*` methods run it as a task and resolve an
//! asyncio future ([`crate::asyncio`]). Every operation holds the node through an `Arc`;
//! `close` wakes the receives and fetches waiting, waits for the other operations to end,
//! then shuts the node down.
//!
//! Published keys are recorded here too ([`Held`]): what the binding must give back (a
//! `ferry.Buffer`'s object) or keep alive (a registered tensor) until `unpublish`.

mod core;

use self::core::{Core, FetchAsk, finish_send, finish_unpublish};

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use ferry::{Config, Error, Fetch, Layout, MemoryClass, MemoryKind};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use tokio::runtime::{Handle, Runtime};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use crate::asyncio::{self, OnCancel};
use crate::buffer::{Arrival, Buffer};
use crate::convert::{self, DomainCounters};
use crate::errors::{closed, to_py, usage};
use crate::source::{self, Held, Keep, Sent, Unpublished};

/// How long a blocking call waits between two checks for signals (Ctrl-C).
const SLICE: Duration = Duration::from_millis(100);

/// The default bound on asynchronous operations in flight on one `Node` object.
const DEFAULT_MAX_PENDING: usize = 1024;

/// A ferry node: sends and receives buffers by peer name and tag.
///
/// ``Node(config)`` starts a node from a configuration: TOML text (``str``) or a ``dict``
/// of the same tables; ``Node(config_file=path)`` reads a ``.toml`` or ``.yaml`` file
/// instead (alone: no system file, no environment). Every key is in ferry's
/// ``docs/CONFIG.md``; peers authenticate with a shared secret
/// (``[security] secret_file``, mode 0600) unless ``danger_insecure = true``.
///
/// Use it as a context manager, or call ``close()``::
///
///     with ferry.Node(config) as node:
///         node.send("b", 1, numpy_array)
///         got = node.recv("b", 2, timeout=5.0)
///         array = numpy.frombuffer(got, dtype=numpy.float32)
///
/// A node also publishes buffers under keys for its peers to fetch (``publish``,
/// ``unpublish``), and fetches what they publish (``fetch``): concurrent fetches of one
/// key and layout from one peer share one transfer::
///
///     node.publish("weights/layer0", array)        # on the exporter
///     got = node.fetch("a", "weights/layer0")       # on any peer: a ferry.Buffer
///
/// Blocking methods release the GIL while they wait and can be interrupted with Ctrl-C;
/// the blocking methods that move bytes have an ``a``-prefixed coroutine twin for asyncio
/// (``asend``, ``arecv``, ``afetch``, ``aunpublish``). A ``Node`` may be used from several
/// threads at once.
///
/// ``max_pending`` bounds the asynchronous operations in flight on this object; one more
/// raises ``QueueFull``.
#[pyclass(frozen, module = "ferry", name = "Node")]
pub struct Node {
    core: Arc<Core>,
}

#[pymethods]
impl Node {
    #[new]
    #[pyo3(
        signature = (config=None, *, config_file=None, max_pending=DEFAULT_MAX_PENDING),
        text_signature = "(config=None, *, config_file=None, max_pending=1024)"
    )]
    fn new(
        py: Python<'_>,
        config: Option<&Bound<'_, PyAny>>,
        config_file: Option<&Bound<'_, PyAny>>,
        max_pending: usize,
    ) -> PyResult<Self> {
        let config = load_config(py, config, config_file)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("ferry-python")
            .enable_all()
            .build()
            .map_err(|e| to_py(&Error::start("cannot start the binding's runtime", e)))?;
        let handle = runtime.handle().clone();
        let default_deadline = config.limits.default_deadline;
        // Started outside any tokio context (`Node::start` works from any executor): when
        // it fails after building its I/O runtime, it drops that runtime, which tokio
        // refuses (a panic) inside an asynchronous context such as `block_on`.
        let node = py
            .detach(|| futures::executor::block_on(ferry::Node::start(config)))
            .map_err(|e| to_py(&e))?;
        let (closing, _) = watch::channel(false);
        let core = Core {
            name: node.name().to_string(),
            addresses: node.tcp_addrs().to_vec(),
            receive_class: node.receive_class(),
            node: Mutex::new(Some(Arc::new(node))),
            runtime: Mutex::new(Some(runtime)),
            handle,
            closing,
            default_deadline,
            pending: Arc::new(Semaphore::new(max_pending.max(1))),
            unclaimed: Arc::default(),
            max_pending: max_pending.max(1),
            published: Arc::default(),
        };
        Ok(Self {
            core: Arc::new(core),
        })
    }

    /// The node's name (``node.name`` in the configuration).
    #[getter]
    fn name(&self) -> &str {
        &self.core.name
    }

    /// The TCP addresses the node listens on, with the actual port where ``:0`` was asked.
    #[getter]
    fn addresses(&self) -> Vec<String> {
        self.core.addresses.clone()
    }

    /// The memory class received buffers land in first: ``"host"``, ``"pinned"`` or
    /// ``"device"`` (``memory.receive_into`` as it resolved on this machine).
    #[getter]
    fn receive_into(&self) -> &'static str {
        convert::class_label(self.core.receive_class)
    }

    /// True once ``close()`` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.core
            .node
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }

    /// Sends ``obj`` to ``peer`` under ``tag`` and returns once the peer holds every byte.
    ///
    /// ``obj`` may be a ``ferry.Buffer`` (sent as it is, no copy; it stays usable after),
    /// any C-contiguous object with the buffer protocol (``bytes``, ``bytearray``,
    /// ``numpy.ndarray``...) or a host tensor with ``__dlpack__`` (copied once into a host
    /// buffer of ferry's pool), or a CUDA tensor with ``__dlpack__`` or
    /// ``__cuda_array_interface__`` (registered in place, no copy: the peer reads it; the
    /// tensor must not be written until ``send`` returns).
    ///
    /// Buffers to one peer arrive in the order their sends were made. ``timeout``
    /// (seconds) replaces the node's ``limits.default_deadline``.
    ///
    /// Raises ``PeerUnreachable``, ``PeerLost``, ``Refused`` (``.reason``),
    /// ``DeadlineExceeded``, ``NoMemory``, ``NoRoute``, ``UsageError`` (an object that
    /// cannot be sent, a ``Buffer`` with live views) or ``ShuttingDown``.
    #[pyo3(signature = (peer, tag, obj, *, timeout=None))]
    fn send(
        &self,
        py: Python<'_>,
        peer: String,
        tag: u64,
        obj: &Bound<'_, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let op = self
            .core
            .send_op(peer, tag, obj, Layout::Contiguous, timeout)?;
        let out = self.core.block(py, op, OnCancel::Finish)?;
        finish_send(out)
    }

    /// Sends part of ``obj``: ``rows`` rows of ``row_bytes`` bytes, ``pitch`` bytes apart
    /// (and, with ``depth``, that many planes of ``plane_rows`` rows each), or ``blocks``, a
    /// list of ``(offset, length)`` pairs (at most 65,536, none empty; they may overlap and
    /// come in any order). The peer receives the rows or blocks packed, in order, with the
    /// layout in ``Buffer.layout``. ``obj`` is anything ``send`` takes; a layout that does
    /// not fit it raises ``UsageError`` before anything moves. The deadline is the node's
    /// default. Of a host array only the bytes the layout names are copied (into ferry's
    /// memory, at their offsets up to the layout's last byte): a few blocks of a large
    /// array cost those blocks, not the array.
    #[pyo3(signature = (
        peer, tag, obj, *, rows=None, row_bytes=None, pitch=None, depth=None, plane_rows=None,
        blocks=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn send_layout(
        &self,
        py: Python<'_>,
        peer: String,
        tag: u64,
        obj: &Bound<'_, PyAny>,
        rows: Option<u64>,
        row_bytes: Option<u64>,
        pitch: Option<u64>,
        depth: Option<u64>,
        plane_rows: Option<u64>,
        blocks: Option<Vec<(u64, u64)>>,
    ) -> PyResult<()> {
        let layout = convert::layout_of(
            "send_layout",
            convert::LayoutArgs {
                rows,
                row_bytes,
                pitch,
                depth,
                plane_rows,
                blocks,
            },
        )?;
        let op = self.core.send_op(peer, tag, obj, layout, None)?;
        let out = self.core.block(py, op, OnCancel::Finish)?;
        finish_send(out)
    }

    /// Receives the oldest buffer from ``peer`` (any peer when ``None``) under ``tag`` (any
    /// tag when ``None``), waiting for one up to ``timeout`` seconds (forever when
    /// ``None``). Returns a ``ferry.Buffer``, whose ``peer`` and ``tag`` say which.
    ///
    /// Raises ``DeadlineExceeded`` after ``timeout``, ``ShuttingDown`` when the node is
    /// closed meanwhile, ``QueueFull`` when too many receives wait on the node. Interrupted
    /// (Ctrl-C), nothing is lost: a buffer that arrives later goes to the next receive.
    #[pyo3(signature = (peer=None, tag=None, *, timeout=None))]
    fn recv(
        &self,
        py: Python<'_>,
        peer: Option<String>,
        tag: Option<u64>,
        timeout: Option<f64>,
    ) -> PyResult<Buffer> {
        let op = self.core.recv_op(peer, tag, timeout)?;
        let got = self.core.block(py, op, OnCancel::Abort)?;
        got.map(|got| self.core.arrival(got)).map_err(|e| to_py(&e))
    }

    /// Coroutine twin of ``send``: ``await node.asend(peer, tag, obj)``.
    ///
    /// Cancelling the awaiting task does not stop the transfer (it runs to its end, and
    /// registered GPU memory is unregistered before the tensor is let go).
    #[pyo3(signature = (peer, tag, obj, *, timeout=None))]
    fn asend<'py>(
        &self,
        py: Python<'py>,
        peer: String,
        tag: u64,
        obj: &Bound<'py, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let permit = self.core.permit()?;
        let op = self
            .core
            .send_op(peer, tag, obj, Layout::Contiguous, timeout)?;
        let op = async move {
            let out = op.await;
            drop(permit);
            out
        };
        asyncio::spawn(
            py,
            &self.core.handle,
            op,
            OnCancel::Finish,
            |py, out| finish_send(out).map(|()| py.None()),
            None,
        )
    }

    /// Coroutine twin of ``recv``: ``got = await node.arecv(peer, tag, timeout=...)``.
    /// Cancelling the awaiting task cancels the receive; nothing is lost.
    #[pyo3(signature = (peer=None, tag=None, *, timeout=None))]
    fn arecv<'py>(
        &self,
        py: Python<'py>,
        peer: Option<String>,
        tag: Option<u64>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let permit = self.core.permit()?;
        let op = self.core.recv_op(peer, tag, timeout)?;
        let op = async move {
            let out = op.await;
            drop(permit);
            out
        };
        let core = Arc::clone(&self.core);
        let unclaimed = Arc::clone(&self.core.unclaimed);
        let limit = self.core.max_pending;
        // A receive that completed as its caller cancelled it: the buffer goes back, to the
        // next matching receive (at most `max_pending` wait so; past that, the oldest goes).
        let give_back: asyncio::Unclaimed = Box::new(move |py, value| {
            let Ok(buffer) = value.bind(py).cast::<Buffer>() else {
                return;
            };
            if let Some(got) = buffer.get().reclaim() {
                let mut unclaimed = unclaimed.lock().unwrap_or_else(PoisonError::into_inner);
                if unclaimed.len() >= limit {
                    unclaimed.pop_front();
                }
                unclaimed.push_back(got);
            }
        });
        asyncio::spawn(
            py,
            &self.core.handle,
            op,
            OnCancel::Abort,
            move |py, got| {
                let got = got.map_err(|e| to_py(&e))?;
                Ok(Py::new(py, core.arrival(got))?.into_any())
            },
            Some(give_back),
        )
    }

    /// Publishes ``obj`` under ``key`` for peers to ``fetch``, until ``unpublish(key)``;
    /// with ``peers`` (a list of peer names), for those peers only: another peer's fetch
    /// is refused (``Refused``, ``reason == "not_allowed"``).
    ///
    /// ``obj`` is anything ``send`` takes, and is taken as ``send`` takes it: a
    /// ``ferry.Buffer`` is published as it is (no copy; the object is unusable —
    /// ``released`` — while published, and ``unpublish`` gives the buffer back to it); a
    /// bytes-like object or host tensor is copied once into a host buffer of ferry's pool
    /// (it may change or go after ``publish`` returns); a CUDA tensor is registered in
    /// place (no copy: peers read it; it must not be written or freed until ``unpublish``
    /// returns, and the node holds a reference to it until then). The bytes are read-only
    /// while published. A published buffer stays counted against its memory budget.
    ///
    /// Raises ``UsageError`` for an empty key, one longer than 1,024 bytes, or one
    /// published already (a ``ferry.Buffer`` is then given back to its object), and as
    /// ``send`` for an object it cannot take.
    #[pyo3(signature = (key, obj, peers=None))]
    fn publish(
        &self,
        py: Python<'_>,
        key: String,
        obj: &Bound<'_, PyAny>,
        peers: Option<Vec<String>>,
    ) -> PyResult<()> {
        let op = self
            .core
            .publish_op(source::Listing::Key { key, peers }, obj)?;
        let (result, keep) = self.core.block(py, op, OnCancel::Finish)?;
        drop(keep);
        result.map(drop).map_err(|e| to_py(&e))
    }

    /// Registers ``obj`` as a region peers may read (and, with ``writable=True``, write)
    /// with one-sided ``read`` and ``write``, until ``unregister``; returns its key (24
    /// bytes: give it to the peer). What is registered is as ``publish`` takes it: a
    /// ``ferry.Buffer`` as it is (``released`` meanwhile: ``unregister`` gives the buffer
    /// back, with what peers wrote), a CUDA tensor in place (peers' writes land in the
    /// tensor; it must not be freed until ``unregister`` returns), other host objects
    /// copied once into ferry's pool (``unregister`` returns that copy, with what peers
    /// wrote). A ``ferry.Buffer`` registered when the node is closed stays ``released``.
    /// Interrupted (Ctrl-C), the registration may still complete with its key lost:
    /// ``close`` ends it.
    ///
    /// Raises as ``send`` for an object it cannot take; ``ShuttingDown`` from ``read`` and
    /// ``write`` when the node is closed meanwhile.
    #[pyo3(signature = (obj, *, writable=false))]
    fn register<'py>(
        &self,
        py: Python<'py>,
        obj: &Bound<'_, PyAny>,
        writable: bool,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let access = if writable {
            ferry::Access::ReadWrite
        } else {
            ferry::Access::ReadOnly
        };
        let op = self.core.publish_op(source::Listing::Region(access), obj)?;
        let (result, keep) = self.core.block(py, op, OnCancel::Finish)?;
        drop(keep);
        let key = result
            .map_err(|e| to_py(&e))?
            .ok_or_else(|| usage("registering gave no key".to_string()))?;
        Ok(pyo3::types::PyBytes::new(py, &key.to_bytes()))
    }

    /// Ends region ``key`` (from ``register``): peers' keys are stale at once, then it
    /// waits until no peer reads it and returns what ``unpublish`` returns for the object
    /// registered. ``timeout`` as ``unpublish``'s.
    #[pyo3(signature = (key, *, timeout=None))]
    fn unregister(&self, py: Python<'_>, key: &[u8], timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let region = region_key(key)?;
        let name = source::region_name(&region);
        let (object, op) = self.core.unpublish_op(py, (name, Some(region)), timeout)?;
        let out = self.core.block(py, op, OnCancel::Abort)?;
        finish_unpublish(py, object, out)
    }

    /// Reads the bytes ``remote_blocks`` names (a list of ``(offset, length)``; the whole
    /// region when ``None``) of ``peer``'s region ``remote`` (its key) into the places
    /// ``local_blocks`` names of this node's region ``local``; the two lists may differ in
    /// shape, their bytes must add up alike. Returns once the bytes are in place here,
    /// with the transport that carried them (``"ipc"``, ``"tcp"``...). ``notify``, a
    /// ``(tag, bytes)`` pair, reaches the peer's ``recv`` afterwards.
    ///
    /// Raises ``Refused`` with ``reason == "stale_key"`` for a key of the peer's that
    /// names no region there now; ``UsageError`` for places that do not fit or match, a
    /// local key not registered here; ``DeadlineExceeded`` after ``timeout`` seconds
    /// (``None``: the node's default deadline); else as ``fetch``.
    #[pyo3(signature = (peer, remote, local, *, remote_blocks=None, local_blocks=None, notify=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        py: Python<'_>,
        peer: String,
        remote: &[u8],
        local: &[u8],
        remote_blocks: Option<Vec<(u64, u64)>>,
        local_blocks: Option<Vec<(u64, u64)>>,
        notify: Option<(u64, Vec<u8>)>,
        timeout: Option<f64>,
    ) -> PyResult<String> {
        let (from, into) = (places(remote, remote_blocks)?, places(local, local_blocks)?);
        let options = one_sided(notify, timeout)?;
        let node = self.core.node()?;
        let op = self
            .core
            .until_closed(async move { node.read(&peer, from, into, options).await });
        let done = self.core.block(py, op, OnCancel::Abort)?;
        done.map(|t| t.as_str().to_string()).map_err(|e| to_py(&e))
    }

    /// Coroutine twin of ``read``.
    #[pyo3(signature = (peer, remote, local, *, remote_blocks=None, local_blocks=None, notify=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn aread<'py>(
        &self,
        py: Python<'py>,
        peer: String,
        remote: &[u8],
        local: &[u8],
        remote_blocks: Option<Vec<(u64, u64)>>,
        local_blocks: Option<Vec<(u64, u64)>>,
        notify: Option<(u64, Vec<u8>)>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (from, into) = (places(remote, remote_blocks)?, places(local, local_blocks)?);
        let options = one_sided(notify, timeout)?;
        let node = self.core.node()?;
        let permit = self.core.permit()?;
        let done = self
            .core
            .until_closed(async move { node.read(&peer, from, into, options).await });
        let op = async move {
            let done = done.await;
            drop(permit);
            done
        };
        asyncio::spawn(
            py,
            &self.core.handle,
            op,
            OnCancel::Abort,
            |py, done| {
                let transport = done.map_err(|e| to_py(&e))?;
                Ok(PyString::new(py, transport.as_str()).into_any().unbind())
            },
            None,
        )
    }

    /// Writes the bytes ``local_blocks`` names of this node's region ``local`` into the
    /// places ``remote_blocks`` names of ``peer``'s region ``remote`` (registered there
    /// with ``writable=True``); returns once the peer has them in place. ``notify`` as
    /// ``read``'s. Raises ``Refused`` with ``reason`` ``"stale_key"`` or ``"read_only"``;
    /// else as ``read``.
    #[pyo3(signature = (peer, local, remote, *, local_blocks=None, remote_blocks=None, notify=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        py: Python<'_>,
        peer: String,
        local: &[u8],
        remote: &[u8],
        local_blocks: Option<Vec<(u64, u64)>>,
        remote_blocks: Option<Vec<(u64, u64)>>,
        notify: Option<(u64, Vec<u8>)>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let (from, into) = (places(local, local_blocks)?, places(remote, remote_blocks)?);
        let options = one_sided(notify, timeout)?;
        let node = self.core.node()?;
        let op = self
            .core
            .until_closed(async move { node.write(&peer, from, into, options).await });
        let done = self.core.block(py, op, OnCancel::Finish)?;
        done.map_err(|e| to_py(&e))
    }

    /// Coroutine twin of ``write``.
    #[pyo3(signature = (peer, local, remote, *, local_blocks=None, remote_blocks=None, notify=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn awrite<'py>(
        &self,
        py: Python<'py>,
        peer: String,
        local: &[u8],
        remote: &[u8],
        local_blocks: Option<Vec<(u64, u64)>>,
        remote_blocks: Option<Vec<(u64, u64)>>,
        notify: Option<(u64, Vec<u8>)>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (from, into) = (places(local, local_blocks)?, places(remote, remote_blocks)?);
        let options = one_sided(notify, timeout)?;
        let node = self.core.node()?;
        let permit = self.core.permit()?;
        let done = self
            .core
            .until_closed(async move { node.write(&peer, from, into, options).await });
        let op = async move {
            let done = done.await;
            drop(permit);
            done
        };
        asyncio::spawn(
            py,
            &self.core.handle,
            op,
            OnCancel::Finish,
            |py, done| {
                done.map_err(|e| to_py(&e))?;
                Ok(py.None())
            },
            None,
        )
    }

    /// Ends the publication of ``key``: no new fetch finds it (at once), then waits until
    /// no peer reads it any more and returns the buffer: the very ``ferry.Buffer`` object
    /// that was published (usable again), a new ``ferry.Buffer`` holding the copy of a
    /// bytes-like object, or ``None`` for a CUDA tensor registered in place (the tensor is
    /// the caller's alone again).
    ///
    /// ``timeout`` bounds this call's wait in seconds (``None``: the node's default
    /// deadline plus ``memory.export_lease_timeout``); after it, ``DeadlineExceeded`` —
    /// the key stays unpublished, and the buffer still goes back to its object once the
    /// last reader let go. Interrupted (Ctrl-C), likewise. Raises ``UsageError`` for a key
    /// not published through this ``Node``; ``DeadlineExceeded`` when a peer still reads
    /// after the node's own wait (the buffer is then freed once the last reader let go).
    #[pyo3(signature = (key, *, timeout=None))]
    fn unpublish(&self, py: Python<'_>, key: String, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let (object, op) = self.core.unpublish_op(py, (key, None), timeout)?;
        let out = self.core.block(py, op, OnCancel::Abort)?;
        finish_unpublish(py, object, out)
    }

    /// Coroutine twin of ``unpublish``: ``buf = await node.aunpublish(key)``. Cancelling
    /// the awaiting task cancels the wait only: the key stays unpublished and the buffer
    /// goes back to its object once no peer reads it.
    #[pyo3(signature = (key, *, timeout=None))]
    fn aunpublish<'py>(
        &self,
        py: Python<'py>,
        key: String,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // Before the key is taken out: outside an event loop, nothing happens.
        py.import("asyncio")?.call_method0("get_running_loop")?;
        let permit = self.core.permit()?;
        let (object, op) = self.core.unpublish_op(py, (key, None), timeout)?;
        let op = async move {
            let out = op.await;
            drop(permit);
            out
        };
        asyncio::spawn(
            py,
            &self.core.handle,
            op,
            OnCancel::Abort,
            move |py, out| finish_unpublish(py, object, out),
            None,
        )
    }

    /// What ``key`` has served while published here, or ``None`` for a key not
    /// published: a dict with ``len`` (the buffer's bytes), ``served`` (fetches answered
    /// with the bytes: each crossed the link), ``bytes_served``, ``refused`` (fetches
    /// refused: a layout that does not fit, a peer not allowed) and ``reading`` (fetches
    /// being served now).
    fn publication<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Option<Bound<'py, PyDict>>> {
        let node = self.core.node()?;
        node.publication(key)
            .map(|stats| convert::publication_dict(py, &stats))
            .transpose()
    }

    /// The keys this node publishes now, sorted.
    fn published_keys(&self) -> PyResult<Vec<String>> {
        let mut keys = self.core.node()?.published_keys();
        keys.sort_unstable();
        Ok(keys)
    }

    /// Fetches what ``peer`` published under ``key`` and returns it as a ``ferry.Buffer``
    /// whose ``peer``, ``key``, ``transport`` and ``joined`` say where it came from.
    ///
    /// The whole buffer, or part of it, packed: ``blocks``, a list of ``(offset,
    /// length)`` pairs, or ``rows`` rows of ``row_bytes`` bytes ``pitch`` bytes apart
    /// (with ``depth``, that many planes of ``plane_rows`` rows), as ``send_layout`` takes
    /// them (``Buffer.layout`` says which). The bytes land where the node receives
    /// (``receive_into``), or are copied into ``into`` (``"host"``, ``"pinned"``,
    /// ``"cuda:N"``).
    ///
    /// Concurrent fetches of one (peer, key, layout) on this node share one transfer
    /// (``joined`` is True for those that did not start it); each gets a buffer of its
    /// own (a copy made here), or with ``shared=True`` one read-only buffer shared with
    /// the others (no copy).
    ///
    /// ``timeout`` in seconds (``None``: the node's default deadline). Raises ``Refused``
    /// with ``reason`` ``"unknown_key"`` (nothing published under ``key``) or
    /// ``"not_allowed"`` (published for other peers); ``UsageError`` for a layout that
    /// does not fit the published buffer, a bad key or memory kind; ``DeadlineExceeded``;
    /// ``QueueFull``; ``ShuttingDown`` when the node is closed meanwhile; else as ``recv``.
    /// Interrupted (Ctrl-C), only this call's wait ends: a transfer other fetches share
    /// goes on.
    #[pyo3(signature = (
        peer, key, *, rows=None, row_bytes=None, pitch=None, depth=None, plane_rows=None,
        blocks=None, into=None, shared=false, timeout=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn fetch(
        &self,
        py: Python<'_>,
        peer: String,
        key: String,
        rows: Option<u64>,
        row_bytes: Option<u64>,
        pitch: Option<u64>,
        depth: Option<u64>,
        plane_rows: Option<u64>,
        blocks: Option<Vec<(u64, u64)>>,
        into: Option<&str>,
        shared: bool,
        timeout: Option<f64>,
    ) -> PyResult<Buffer> {
        let layout = convert::LayoutArgs {
            rows,
            row_bytes,
            pitch,
            depth,
            plane_rows,
            blocks,
        };
        let ask = FetchAsk::new(peer, key, layout, into, shared, timeout)?;
        let op = self.core.fetch_op(&ask)?;
        let got = self.core.block(py, op, OnCancel::Abort)?;
        got.map(|got| self.core.fetched(ask, got))
            .map_err(|e| to_py(&e))
    }

    /// Coroutine twin of ``fetch``: ``buf = await node.afetch(peer, key, ...)``.
    /// Cancelling the awaiting task cancels this fetch's wait only (a transfer other
    /// fetches share goes on).
    #[pyo3(signature = (
        peer, key, *, rows=None, row_bytes=None, pitch=None, depth=None, plane_rows=None,
        blocks=None, into=None, shared=false, timeout=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn afetch<'py>(
        &self,
        py: Python<'py>,
        peer: String,
        key: String,
        rows: Option<u64>,
        row_bytes: Option<u64>,
        pitch: Option<u64>,
        depth: Option<u64>,
        plane_rows: Option<u64>,
        blocks: Option<Vec<(u64, u64)>>,
        into: Option<&str>,
        shared: bool,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let layout = convert::LayoutArgs {
            rows,
            row_bytes,
            pitch,
            depth,
            plane_rows,
            blocks,
        };
        let ask = FetchAsk::new(peer, key, layout, into, shared, timeout)?;
        let permit = self.core.permit()?;
        let op = self.core.fetch_op(&ask)?;
        let op = async move {
            let out = op.await;
            drop(permit);
            out
        };
        let core = Arc::clone(&self.core);
        asyncio::spawn(
            py,
            &self.core.handle,
            op,
            OnCancel::Abort,
            move |py, got| {
                let got = got.map_err(|e| to_py(&e))?;
                Ok(Py::new(py, core.fetched(ask, got))?.into_any())
            },
            None,
        )
    }

    /// This node's fetch counters: ``fetches`` asked for, ``flights`` (transfers
    /// started: fetches whose bytes crossed the link), ``joined`` (fetches that shared
    /// another's transfer) and ``bytes_saved`` (bytes those did not move again).
    fn fetch_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.core.node()?.fetch_stats();
        convert::fetch_stats_dict(py, &stats)
    }

    /// Allocates ``nbytes`` of ``kind`` memory from ferry's pool — ``"host"``,
    /// ``"pinned"``, ``"cuda"`` / ``"cuda:N"`` — waiting for budget up to the default
    /// deadline. Fill it in place (``numpy.frombuffer(buf, dtype)[:] = ...`` for host
    /// memory, ``torch.from_dlpack(buf)`` for device memory), drop the views, and send it
    /// without a copy. Device writes queued on the legacy default stream (torch's default)
    /// are waited for by the send; synchronise other streams before sending.
    ///
    /// Raises ``NoMemory`` (``.cause``) when it does not fit in time, ``Unsupported`` for a
    /// GPU this node does not use.
    fn alloc(&self, py: Python<'_>, kind: &str, nbytes: usize) -> PyResult<Buffer> {
        let kind = convert::parse_kind(kind)?;
        let node = self.core.node()?;
        let op = async move { node.alloc(kind, nbytes).await };
        let buffer = self.core.block(py, op, OnCancel::Abort)?;
        buffer.map(Buffer::allocated).map_err(|e| to_py(&e))
    }

    /// How a transfer of ``nbytes`` from ``src`` memory here (``"host"``, ``"pinned"``,
    /// ``"device"``) to ``peer`` would be routed, and why: a dict with the ``rule`` that
    /// matched, the ``transport`` chosen (``None``: no route), the transports ``skipped``
    /// with their reasons, where the bytes would ``land``, and the whole in words
    /// (``summary``). ``dst`` asks what-if for the memory at the peer's end; ``None`` takes
    /// what the peer said it receives into.
    #[pyo3(signature = (peer, nbytes, src="host", dst=None))]
    fn explain<'py>(
        &self,
        py: Python<'py>,
        peer: String,
        nbytes: u64,
        src: &str,
        dst: Option<&str>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let src = convert::parse_class(src)?;
        let dst = dst.map(convert::parse_class).transpose()?;
        let node = self.core.node()?;
        let op = async move { node.explain(&peer, nbytes, src, dst).await };
        let explanation = self
            .core
            .block(py, op, OnCancel::Abort)?
            .map_err(|e| to_py(&e))?;
        convert::explanation_dict(py, &explanation)
    }

    /// Memory counters per domain: ``{"host": {...}, "pinned": {...}, "cuda:0": {...}}``,
    /// each with ``capacity``, ``granted``, ``free``, ``waiting``, ``peak_waiting``,
    /// ``exported``, ``quarantined`` and ``kept`` (bytes, or counts for the waits), and
    /// ``reused`` (grants served from kept memory so far). With ``kind``, that domain's dict
    /// alone. Every buffer given back shows as ``granted`` going down; ``kept`` is memory of
    /// dropped buffers held for later receives, given back once unused for
    /// ``memory.keep_idle``.
    #[pyo3(signature = (kind=None))]
    fn memory<'py>(&self, py: Python<'py>, kind: Option<&str>) -> PyResult<Bound<'py, PyAny>> {
        let single = kind.is_some();
        let kinds = match kind {
            Some(kind) => vec![convert::parse_kind(kind)?],
            None => domains(),
        };
        let node = self.core.node()?;
        let op = async move {
            let mut out = Vec::new();
            for kind in kinds {
                out.push((kind, node.memory(kind).await));
            }
            out
        };
        let stats = self.core.block(py, op, OnCancel::Abort)?;
        let all = PyDict::new(py);
        for (kind, stats) in stats {
            let stats = match stats {
                Ok(stats) => stats,
                // A GPU the node does not use, when listing every domain.
                Err(e) if e.kind() == ferry::ErrorKind::Unsupported && !single => {
                    continue;
                }
                Err(e) => return Err(to_py(&e)),
            };
            let counters = DomainCounters {
                capacity: stats.budget.capacity,
                granted: stats.budget.granted,
                waiting: stats.budget.waiting,
                peak_waiting: stats.budget.peak_waiting,
                exported: stats.exports.exported,
                quarantined: stats.exports.quarantined,
                kept: stats.kept.bytes,
                reused: stats.kept.reused,
            }
            .to_dict(py)?;
            if single {
                return Ok(counters.into_any());
            }
            all.set_item(convert::kind_label(kind), counters)?;
        }
        Ok(all.into_any())
    }

    /// Connects to ``peer`` now (else the first send does), returning once the link is up.
    /// Raises ``PeerUnreachable`` with the reason.
    fn connect(&self, py: Python<'_>, peer: String) -> PyResult<()> {
        let node = self.core.node()?;
        let op = async move { node.connect(&peer).await };
        self.core
            .block(py, op, OnCancel::Abort)?
            .map_err(|e| to_py(&e))
    }

    /// The peers with a live link.
    fn connected_peers(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let node = self.core.node()?;
        let op = async move { node.connected_peers().await };
        self.core
            .block(py, op, OnCancel::Abort)?
            .map_err(|e| to_py(&e))
    }

    /// Stops the node: receives and fetches waiting end with ``ShuttingDown``, transfers
    /// in flight end (each within its deadline), links close, threads stop, publications
    /// end (a published ``ferry.Buffer`` is not given back). Buffers already received stay
    /// valid. Calling it again does nothing.
    fn close(&self, py: Python<'_>) {
        let _ = self.core.closing.send(true);
        let node = self
            .core
            .node
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let mut stopped = true;
        if let Some(node) = node {
            let limit = self.core.default_deadline + Duration::from_secs(1);
            let handle = &self.core.handle;
            stopped = py.detach(|| {
                handle.block_on(async move {
                    let until = tokio::time::Instant::now() + limit;
                    let mut node = node;
                    // Operations in flight hold the node: wait for them to end.
                    loop {
                        match Arc::try_unwrap(node) {
                            Ok(node) => {
                                node.shutdown().await;
                                return true;
                            }
                            Err(shared) if tokio::time::Instant::now() >= until => {
                                // The last operation to end stops it (`Drop`).
                                drop(shared);
                                return false;
                            }
                            Err(shared) => {
                                node = shared;
                                tokio::time::sleep(Duration::from_millis(2)).await;
                            }
                        }
                    }
                })
            });
        }
        // What the binding kept of the keys published: the objects of published
        // `ferry.Buffer`s stay released (their buffers went with the node); registered
        // tensors are kept forever (a peer may have read them until the end).
        let published = std::mem::take(
            &mut *self
                .core
                .published
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        drop(published);
        if !stopped {
            // Operations still run on the runtime: it stops when this object is collected.
            return;
        }
        let runtime = self
            .core
            .runtime
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(runtime) = runtime {
            runtime.shutdown_background();
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferry.Node {:?} on {}{}>",
            self.core.name,
            self.core.addresses.join(", "),
            if self.closed() { ", closed" } else { "" }
        )
    }
}

/// Every domain a node may have: host, pinned, and each GPU the driver shows.
fn domains() -> Vec<MemoryKind> {
    let mut kinds = vec![MemoryKind::Host, MemoryKind::PinnedHost];
    if let ferry::cuda::CudaProbe::Ready(driver) = ferry::cuda::probe() {
        kinds.extend((0..driver.devices.len() as u32).map(MemoryKind::Device));
    }
    kinds
}

/// The configuration from the constructor's arguments: exactly one of `config` (TOML text
/// or a dict) and `config_file` (a path).
fn load_config(
    py: Python<'_>,
    config: Option<&Bound<'_, PyAny>>,
    config_file: Option<&Bound<'_, PyAny>>,
) -> PyResult<Config> {
    let loaded = match (config, config_file) {
        (Some(_), Some(_)) => {
            return Err(usage("give config or config_file, not both"));
        }
        (None, None) => return Err(usage("give a config (TOML text or dict) or a config_file")),
        (Some(config), None) => {
            let text = if let Ok(text) = config.cast::<PyString>() {
                text.to_string()
            } else if let Ok(dict) = config.cast::<PyDict>() {
                convert::dict_to_toml(dict)?
            } else {
                return Err(usage(format!(
                    "config is TOML text or a dict, not {}",
                    config.get_type().name()?
                )));
            };
            py.detach(|| Config::from_toml_str(&text))
        }
        (None, Some(path)) => {
            let path: std::path::PathBuf = path.extract()?;
            py.detach(|| ferry_config::load(&ferry::LoadOptions::only_file(path)))
        }
    };
    loaded.map_err(|e| to_py(&Error::from(e)))
}

/// A region key from its 24 bytes.
fn region_key(key: &[u8]) -> PyResult<ferry::RegionKey> {
    ferry::RegionKey::from_bytes(key).ok_or_else(|| {
        usage(format!(
            "a region key is 24 bytes (from register), not {}",
            key.len()
        ))
    })
}

/// Places in a region: its key, and `(offset, length)` blocks of it (all of it for `None`).
fn places(key: &[u8], blocks: Option<Vec<(u64, u64)>>) -> PyResult<ferry::Places> {
    let region = region_key(key)?;
    Ok(match blocks {
        None => ferry::Places::whole(region),
        Some(blocks) if blocks.is_empty() => {
            return Err(usage("a block list names at least one block".to_string()));
        }
        Some(blocks) => ferry::Places::blocks(region, blocks),
    })
}

/// A one-sided operation's options from its keywords.
fn one_sided(notify: Option<(u64, Vec<u8>)>, timeout: Option<f64>) -> PyResult<ferry::OneSided> {
    let deadline = match timeout {
        Some(t) => Some(
            Instant::now()
                + Duration::try_from_secs_f64(t.max(0.0))
                    .map_err(|_| usage(format!("{t} is not a duration in seconds")))?,
        ),
        None => None,
    };
    Ok(ferry::OneSided { deadline, notify })
}
