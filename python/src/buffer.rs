//! `ferry.Buffer`: a ferry buffer held by Python — one `alloc` returned, or one `recv` or
//! `fetch` delivered with where it came from.
//!
//! Host memory is readable (and, while no transport holds it, writable) in place through
//! the buffer protocol (`memoryview`, `numpy.asarray`, `numpy.frombuffer`) and through
//! DLPack (`numpy.from_dlpack`, `torch.from_dlpack`); device memory through DLPack. Every
//! such view is counted. The memory goes back to ferry's pool when the `Buffer` object and
//! every view of it are gone: a buffer-protocol view holds the object, a DLPack consumer
//! holds the buffer's state from its capsule's deleter.
//!
//! While a view is alive the buffer cannot be sent, published or released (the view would
//! outlive the memory, or read it while a peer writes): `send` raises `UsageError` naming
//! the views.
#![allow(unsafe_code)]

use std::ffi::c_int;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use ferry::{Layout, MemoryKind};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::convert::{kind_label, layout_dict};
use crate::errors::usage;

/// What a buffer's Python object and its DLPack consumers share: the buffer (absent while
/// it is being sent or is published, and once released) and how many views of its memory
/// are alive.
pub(crate) struct State {
    slot: Mutex<Slot>,
}

pub(crate) struct Slot {
    pub(crate) buffer: Option<ferry::Buffer>,
    /// Buffer-protocol views and DLPack capsules alive. While non-zero the buffer stays
    /// where it is, so the addresses they hold stay valid.
    pub(crate) views: usize,
    /// Device memory handed out through DLPack since the last send: another library may
    /// have queued writes to it, which the next send waits for.
    pub(crate) written_elsewhere: bool,
}

impl State {
    pub(crate) fn new(buffer: ferry::Buffer) -> Arc<Self> {
        Arc::new(Self {
            slot: Mutex::new(Slot {
                buffer: Some(buffer),
                views: 0,
                written_elsewhere: false,
            }),
        })
    }

    /// The slot, locked. A panic while it was held (none is expected) leaves it usable.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One view ended.
    pub(crate) fn view_ended(&self) {
        let mut slot = self.lock();
        slot.views = slot.views.saturating_sub(1);
    }
}

/// Where a received or fetched buffer came from.
pub(crate) struct Arrival {
    pub peer: String,
    /// The tag it was sent under; `None` for a fetched buffer.
    pub tag: Option<u64>,
    /// The key it was fetched by; `None` for a received buffer.
    pub key: Option<String>,
    /// For a fetched buffer: it joined another fetch's flight (its bytes did not cross the
    /// link again).
    pub joined: bool,
    pub transport: ferry::TransportName,
    pub layout: Layout,
    pub spilled: bool,
}

/// A ferry buffer: memory from ferry's pools, on the host or a GPU.
///
/// ``Node.alloc`` returns one to fill in place; ``Node.recv`` returns one with the
/// sender (``peer``), the ``tag``, the ``transport`` that carried it and whether it
/// ``spilled`` to another memory tier than the node receives into; ``Node.fetch`` one with
/// the exporter (``peer``), the ``key``, the ``transport`` and whether it ``joined``
/// another fetch's transfer.
///
/// Host memory: ``numpy.asarray(buf)`` / ``numpy.frombuffer(buf, dtype)`` and
/// ``memoryview(buf)`` view it in place (writable while no transfer holds it);
/// ``numpy.from_dlpack(buf)`` too. Device memory: ``torch.from_dlpack(buf)`` or
/// ``cupy.from_dlpack(buf)``, zero-copy on its GPU. Views are ``uint8``: reinterpret with
/// ``.view(dtype)`` / ``.reshape(shape)``.
///
/// The memory returns to ferry's pool when the last reference to the buffer and the last
/// view of it are gone, or at once with ``release()`` (or leaving a ``with`` block) when no
/// view is alive.
#[pyclass(frozen, module = "ferry", name = "Buffer")]
pub struct Buffer {
    state: Arc<State>,
    nbytes: usize,
    kind: MemoryKind,
    arrival: Option<Arrival>,
}

impl Buffer {
    /// A buffer `alloc` returned.
    pub(crate) fn allocated(buffer: ferry::Buffer) -> Self {
        Self {
            nbytes: buffer.len(),
            kind: buffer.kind(),
            state: State::new(buffer),
            arrival: None,
        }
    }

    /// A buffer `recv` or `fetch` returned.
    pub(crate) fn received(buffer: ferry::Buffer, arrival: Arrival) -> Self {
        Self {
            nbytes: buffer.len(),
            kind: buffer.kind(),
            state: State::new(buffer),
            arrival: Some(arrival),
        }
    }

    /// Takes the buffer out to send it; the send puts it back into the state when it ends.
    /// With it, whether another library may have queued writes to its device memory
    /// (through DLPack) that the send must wait for.
    ///
    /// # Errors
    /// `UsageError` while views of it are alive, while it is being sent or is published, or
    /// once released.
    pub(crate) fn take(&self) -> PyResult<(ferry::Buffer, bool)> {
        let mut slot = self.state.lock();
        if slot.views > 0 {
            return Err(usage(format!(
                "the buffer has {} live view(s) (memoryview, numpy array, DLPack consumer): \
                 delete them before sending it, or send a copy",
                slot.views
            )));
        }
        let buffer = slot.buffer.take().ok_or_else(|| {
            usage(
                "the buffer is being sent by another call, is published, or was released"
                    .to_string(),
            )
        })?;
        Ok((buffer, std::mem::take(&mut slot.written_elsewhere)))
    }

    /// The received buffer back as ferry gave it, for a receive whose caller went away
    /// before seeing it. `None` for an allocated or fetched buffer, or one already viewed
    /// or taken.
    pub(crate) fn reclaim(&self) -> Option<ferry::Received> {
        let arrival = self.arrival.as_ref()?;
        let tag = arrival.tag?;
        let mut slot = self.state.lock();
        if slot.views > 0 {
            return None;
        }
        Some(ferry::Received {
            buffer: slot.buffer.take()?,
            peer: arrival.peer.clone(),
            tag,
            transport: arrival.transport,
            layout: arrival.layout.clone(),
        })
    }

    /// The shared state, for a DLPack export.
    pub(crate) fn state(&self) -> &Arc<State> {
        &self.state
    }

    /// Where the memory lives.
    pub(crate) fn memory_kind(&self) -> MemoryKind {
        self.kind
    }
}

#[pymethods]
impl Buffer {
    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    fn __len__(&self) -> usize {
        self.nbytes
    }

    /// Where the bytes live: ``"host"``, ``"pinned"`` or ``"cuda:N"``.
    #[getter]
    fn kind(&self) -> String {
        kind_label(self.kind)
    }

    /// The CUDA ordinal of the GPU the bytes live on, or ``None`` for host memory.
    #[getter]
    fn device(&self) -> Option<u32> {
        match self.kind {
            MemoryKind::Device(n) => Some(n),
            _ => None,
        }
    }

    /// The peer that sent it, or that published it for a fetched buffer (``None`` for a
    /// buffer from ``alloc``).
    #[getter]
    fn peer(&self) -> Option<&str> {
        self.arrival.as_ref().map(|a| a.peer.as_str())
    }

    /// The tag it was sent under (``None`` for a buffer from ``alloc`` or ``fetch``).
    #[getter]
    fn tag(&self) -> Option<u64> {
        self.arrival.as_ref().and_then(|a| a.tag)
    }

    /// The key it was fetched by (``None`` unless it came from ``fetch``).
    #[getter]
    fn key(&self) -> Option<&str> {
        self.arrival.as_ref().and_then(|a| a.key.as_deref())
    }

    /// For a fetched buffer, True when it joined another fetch of the same key and layout
    /// already on its way (single flight: its bytes did not cross the link again); False
    /// otherwise.
    #[getter]
    fn joined(&self) -> bool {
        self.arrival.as_ref().is_some_and(|a| a.joined)
    }

    /// The transport that carried it (``"tcp"``, ``"ipc"``, ``"staged"``, ``"ucx"``), or
    /// ``None`` for a buffer from ``alloc``. A fetch that joined another's transfer names
    /// the transport that transfer came over.
    #[getter]
    fn transport(&self) -> Option<&'static str> {
        self.arrival.as_ref().map(|a| a.transport.as_str())
    }

    /// True when it landed in another memory tier than the node receives into
    /// (``memory.receive_into``; for a fetch with ``into``, than the memory asked for):
    /// spilled to host memory when the GPU had no room, or carried by a transport that
    /// lands in host memory only (tcp).
    #[getter]
    fn spilled(&self) -> bool {
        self.arrival.as_ref().is_some_and(|a| a.spilled)
    }

    /// For a buffer sent with ``send_layout`` (or fetched with a layout), how its rows lay
    /// at the sender (a dict: ``rows``, ``row_bytes``, ``pitch``, and ``depth``,
    /// ``plane_rows`` for planes; or ``blocks``, the ``(offset, length)`` pairs); the buffer
    /// holds them packed, one row or block after the other. ``None`` otherwise.
    #[getter]
    fn layout<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match &self.arrival {
            Some(a) => layout_dict(py, &a.layout),
            None => Ok(None),
        }
    }

    /// True once the memory went back to ferry (``release()``), or while it is being sent
    /// or is published (``Node.publish``; ``Node.unpublish`` gives it back).
    #[getter]
    fn released(&self) -> bool {
        self.state.lock().buffer.is_none()
    }

    /// Gives the memory back to ferry's pool now, instead of when the object is collected.
    ///
    /// Raises ``UsageError`` while views of it (memoryviews, numpy arrays, DLPack
    /// consumers) are alive. Releasing twice is harmless.
    fn release(&self) -> PyResult<()> {
        let buffer = {
            let mut slot = self.state.lock();
            if slot.views > 0 {
                return Err(usage(format!(
                    "the buffer has {} live view(s): delete them first",
                    slot.views
                )));
            }
            slot.buffer.take()
        };
        drop(buffer);
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Leaving a ``with`` block releases the buffer unless views of it are alive (then the
    /// last view releases it).
    fn __exit__(
        &self,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> bool {
        let _ = self.release();
        false
    }

    /// A copy of the bytes, whatever memory they live in.
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let mut out = vec![0u8; self.nbytes];
        {
            let slot = self.state.lock();
            let buffer = slot.buffer.as_ref().ok_or_else(|| {
                usage("the buffer is being sent or is published, or was released")
            })?;
            buffer
                .read(0, &mut out)
                .map_err(|e| usage(format!("cannot read the buffer: {e}")))?;
        }
        Ok(PyBytes::new(py, &out))
    }

    /// Exposes host memory through the buffer protocol: one-dimensional, unsigned bytes,
    /// writable while no transfer holds the buffer.
    ///
    /// # Safety
    /// Called by Python with a `view` to fill, as the buffer protocol says.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let this = slf.get();
        if let MemoryKind::Device(n) = this.kind {
            return Err(PyBufferError::new_err(format!(
                "the buffer lives on GPU {n}: use torch.from_dlpack / cupy.from_dlpack, or \
                 tobytes() for a copy"
            )));
        }
        let mut slot = this.state.lock();
        let Some(buffer) = slot.buffer.as_mut() else {
            return Err(PyBufferError::new_err(
                "the buffer is being sent or is published, or was released",
            ));
        };
        let len = buffer.len();
        // Writable when nothing else holds the bytes; else read-only, and a writable
        // request is refused by PyBuffer_FillInfo.
        let (ptr, readonly) = match buffer.as_mut_slice() {
            Some(bytes) => (bytes.as_mut_ptr(), 0),
            None => match buffer.as_slice() {
                Some(bytes) => (bytes.as_ptr().cast_mut(), 1),
                None => return Err(PyBufferError::new_err("the buffer is not host memory")),
            },
        };
        let len = isize::try_from(len)
            .map_err(|_| PyBufferError::new_err("the buffer is too large to view"))?;
        // SAFETY: `view` is the caller's to fill; `ptr..ptr+len` is the host memory of a
        // buffer that stays in this object's state, at this address, until the view is
        // released: `views` counts the view, and `take`/`release` refuse while it is
        // non-zero. PyBuffer_FillInfo stores a new reference to `slf` in `view.obj`, so the
        // object (and its state) outlives the view.
        let rc =
            unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr.cast(), len, readonly, flags) };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        slot.views += 1;
        Ok(())
    }

    /// One buffer-protocol view ended.
    ///
    /// # Safety
    /// Called by Python once per view `__getbuffer__` filled.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.state.view_ended();
    }

    /// Exports the buffer as a DLPack capsule (host memory as ``kDLCPU``, device memory as
    /// ``kDLCUDA`` on its GPU): one-dimensional ``uint8``, zero-copy. The capsule's deleter
    /// holds the buffer, which returns to ferry's pool only once the consumer let go.
    ///
    /// ``stream`` is accepted and ignored: the bytes are complete when ``recv`` returns.
    /// ``copy=True`` and a ``dl_device`` other than the buffer's are refused
    /// (``BufferError``).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: Bound<'py, Self>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = stream;
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "ferry buffers are exported without a copy (copy=True is not supported)",
            ));
        }
        let this = slf.get();
        let device = crate::dlpack::device_of(this.kind);
        if let Some(asked) = dl_device
            && asked != device
        {
            return Err(PyBufferError::new_err(format!(
                "the buffer lives on DLPack device {device:?}, not {asked:?}"
            )));
        }
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        crate::dlpack::export(slf.py(), this, versioned)
    }

    /// ``(device_type, device_id)`` as DLPack says it: ``(1, 0)`` for host memory,
    /// ``(2, N)`` for GPU N.
    fn __dlpack_device__(&self) -> (i32, i32) {
        crate::dlpack::device_of(self.kind)
    }

    fn __repr__(&self) -> String {
        let state = if self.state.lock().buffer.is_none() {
            ", released"
        } else {
            ""
        };
        match &self.arrival {
            Some(a) => {
                let label = match (&a.key, a.tag) {
                    (Some(key), _) => format!("key {key:?}"),
                    (None, Some(tag)) => format!("tag {tag}"),
                    (None, None) => String::new(),
                };
                format!(
                    "<ferry.Buffer {} bytes of {} from {:?} {label} via {}{}{}{state}>",
                    self.nbytes,
                    kind_label(self.kind),
                    a.peer,
                    a.transport,
                    if a.joined { ", joined" } else { "" },
                    if a.spilled { ", spilled" } else { "" }
                )
            }
            None => format!(
                "<ferry.Buffer {} bytes of {}{state}>",
                self.nbytes,
                kind_label(self.kind)
            ),
        }
    }
}
