//! What `send` (and `publish`) makes of a Python object: a ferry buffer sent as it is, host
//! bytes copied once into a ferry buffer, or a GPU tensor registered in place.
//!
//! The decision and every Python call happen with the GIL held ([`plan`]); the bytes move
//! without it ([`run_send`]). What keeps the object's memory valid meanwhile (its exported
//! buffer, its consumed DLPack tensor, a reference to it) travels beside the operation as a
//! [`Keep`] and is dropped only after it ended.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use ferry::cuda::ExternalMemory;
use ferry::{Error, Layout, MemoryKind, SendError};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::buffer::{Buffer, State};
use crate::dlpack::{self, Place};
use crate::errors::usage;

/// What the bytes are and how they get into a ferry buffer.
pub(crate) enum Plan {
    /// A `ferry.Buffer`, taken out of its object; put back into `state` when the send ends.
    /// `settle`: the GPU whose legacy default stream is synchronised first, because
    /// another library may have written the buffer through DLPack.
    Ferry {
        state: Arc<State>,
        buffer: ferry::Buffer,
        settle: Option<u32>,
    },
    /// Host memory at `ptr`, copied into a host buffer of ferry's pool.
    Host { ptr: usize, len: usize },
    /// GPU memory at `ptr` on `device`, registered in place (`register_external`) once
    /// the producer's pending work on `stream` completed.
    Device {
        ptr: u64,
        len: usize,
        device: u32,
        stream: Option<usize>,
    },
}

/// Holds the memory a [`Plan`] points at valid until dropped (with the GIL: each variant's
/// drop attaches if it needs to).
pub(crate) enum Keep {
    Nothing,
    Exported(#[allow(dead_code)] PyUntypedBuffer),
    DlPack(#[allow(dead_code)] dlpack::Imported),
    Object(#[allow(dead_code)] Py<PyAny>),
}

/// How a send ended, with what the binding must do after.
pub(crate) struct Sent {
    pub result: Result<(), Error>,
    /// The memory may still be read by a peer (the registration did not end in time):
    /// never free it. The caller leaks the [`Keep`].
    pub keep_forever: bool,
}

/// Decides how to send `obj`. Order: a `ferry.Buffer`; a CUDA tensor (`__dlpack__` on a
/// CUDA device, or `__cuda_array_interface__`); anything with the buffer protocol (bytes,
/// bytearray, memoryview, numpy arrays); a host tensor with `__dlpack__` (torch CPU
/// tensors); `__array_interface__`.
pub(crate) fn plan(obj: &Bound<'_, PyAny>) -> PyResult<(Plan, Keep)> {
    if let Ok(buffer) = obj.cast::<Buffer>() {
        let this = buffer.get();
        let state = Arc::clone(this.state());
        let (buffer, written_elsewhere) = this.take()?;
        let settle = match buffer.kind() {
            MemoryKind::Device(n) if written_elsewhere => Some(n),
            _ => None,
        };
        let plan = Plan::Ferry {
            state,
            buffer,
            settle,
        };
        return Ok((plan, Keep::Nothing));
    }
    let dlpack_device = dlpack_device(obj)?;
    if let Some((2, _)) = dlpack_device {
        let imported = dlpack::import(obj, true)?;
        let Place::Cuda(device) = imported.place else {
            return Err(usage(
                "the tensor said it is on a GPU, but exported host memory",
            ));
        };
        if imported.len == 0 {
            // Nothing to register (zero bytes cannot be): an empty host buffer says it.
            return Ok((Plan::Host { ptr: 0, len: 0 }, Keep::DlPack(imported)));
        }
        let plan = Plan::Device {
            ptr: imported.ptr as u64,
            len: imported.len,
            device,
            stream: None,
        };
        return Ok((plan, Keep::DlPack(imported)));
    }
    if let Ok(cai) = obj.getattr("__cuda_array_interface__") {
        return cuda_array_interface(obj, &cai.cast_into::<PyDict>()?);
    }
    if let Ok(exported) = PyUntypedBuffer::get(obj) {
        if !exported.is_c_contiguous() {
            return Err(usage(
                "the object is not C-contiguous: send numpy.ascontiguousarray(x), or use \
                 send_layout",
            ));
        }
        let plan = Plan::Host {
            ptr: exported.buf_ptr() as usize,
            len: exported.len_bytes(),
        };
        return Ok((plan, Keep::Exported(exported)));
    }
    if dlpack_device.is_some() {
        let imported = dlpack::import(obj, false)?;
        let plan = Plan::Host {
            ptr: imported.ptr,
            len: imported.len,
        };
        return Ok((plan, Keep::DlPack(imported)));
    }
    if let Ok(interface) = obj.getattr("__array_interface__") {
        let interface = interface.cast_into::<PyDict>()?;
        let (ptr, len) = described(&interface, "__array_interface__")?;
        let plan = Plan::Host {
            ptr: ptr as usize,
            len,
        };
        return Ok((plan, Keep::Object(obj.clone().unbind())));
    }
    Err(usage(format!(
        "cannot send a {}: send bytes-like objects, numpy arrays, tensors with __dlpack__ or \
         __cuda_array_interface__, or a ferry.Buffer",
        obj.get_type().name()?
    )))
}

/// `obj.__dlpack_device__()`, when it has one.
fn dlpack_device(obj: &Bound<'_, PyAny>) -> PyResult<Option<(i32, i32)>> {
    if !obj.hasattr("__dlpack__")? {
        return Ok(None);
    }
    match obj.call_method0("__dlpack_device__") {
        Ok(device) => {
            let (kind, id): (i32, i32) = device.extract()?;
            Ok(Some((kind, id)))
        }
        Err(_) => Ok(None),
    }
}

/// The address and byte length of an array interface (`__array_interface__` or
/// `__cuda_array_interface__`), which must be C-contiguous.
fn described(interface: &Bound<'_, PyDict>, name: &str) -> PyResult<(u64, usize)> {
    let missing = |key: &str| usage(format!("{name} has no {key:?}"));
    let (ptr, _readonly): (u64, bool) = interface
        .get_item("data")?
        .ok_or_else(|| missing("data"))?
        .extract()?;
    let shape: Vec<i64> = interface
        .get_item("shape")?
        .ok_or_else(|| missing("shape"))?
        .extract()?;
    let typestr: String = interface
        .get_item("typestr")?
        .ok_or_else(|| missing("typestr"))?
        .extract()?;
    let item: usize = typestr
        .get(2..)
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| usage(format!("{name}: cannot read the type {typestr:?}")))?;
    let strides: Option<Vec<i64>> = match interface.get_item("strides")? {
        Some(s) if !s.is_none() => Some(s.extract()?),
        _ => None,
    };
    let strides = strides.map(|bytes| {
        bytes
            .iter()
            .map(|b| b / i64::try_from(item.max(1)).unwrap_or(1))
            .collect::<Vec<_>>()
    });
    if !dlpack::c_contiguous(&shape, strides.as_deref()) {
        return Err(usage(format!(
            "the {name} array is not C-contiguous: send a contiguous copy, or use send_layout"
        )));
    }
    let count = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?))
        .ok_or_else(|| usage(format!("{name}: invalid shape {shape:?}")))?;
    let len = count
        .checked_mul(item)
        .ok_or_else(|| usage(format!("{name}: too large")))?;
    Ok((ptr, len))
}

fn cuda_array_interface(
    obj: &Bound<'_, PyAny>,
    interface: &Bound<'_, PyDict>,
) -> PyResult<(Plan, Keep)> {
    let (ptr, len) = described(interface, "__cuda_array_interface__")?;
    let device = crate::gpu::device_of_pointer(ptr).map_err(|e| {
        usage(format!(
            "cannot tell which GPU holds the __cuda_array_interface__ memory: {e}"
        ))
    })?;
    // Version 3 names the stream the producer writes on. Without the key (version 2), or
    // with `None` (no synchronisation needed, says the producer), the legacy default stream
    // is synchronised anyway: cheap, and safe with producers that say less than they should.
    let stream = match interface.get_item("stream")? {
        Some(s) if !s.is_none() => Some(s.extract::<usize>()?),
        _ => None,
    };
    let plan = Plan::Device {
        ptr,
        len,
        device,
        stream,
    };
    Ok((plan, Keep::Object(obj.clone().unbind())))
}

/// The bytes `layout` names of host memory at `ptr..ptr+len`, copied into a host buffer of
/// ferry's pool at the same offsets (waiting for budget as `alloc` does): the buffer ends
/// where the layout's furthest byte does, and nothing the layout leaves out is read or
/// written (a few blocks of a large array cost those blocks, not the array).
///
/// The memory must stay valid until this ends (its plan's [`Keep`]).
async fn copy_host(
    node: &ferry::Node,
    ptr: usize,
    len: usize,
    layout: &Layout,
) -> Result<ferry::Buffer, Error> {
    let extent = match layout {
        Layout::Contiguous => len as u64,
        layout => layout
            .check(len as u64)
            .and_then(|_| layout.extent())
            .map(|end| end.unwrap_or(len as u64))
            .map_err(|e| Error::Usage(format!("the layout does not fit the array: {e}")))?,
    };
    let whole = layout.is_contiguous();
    let extent =
        usize::try_from(extent).map_err(|_| Error::Usage("a layout past memory".into()))?;
    let mut buffer = node.alloc(MemoryKind::Host, extent).await?;
    let Some(target) = buffer.as_mut_slice() else {
        return Err(Error::Usage("a fresh buffer is shared".into()));
    };
    if target.is_empty() {
        return Ok(buffer);
    }
    // SAFETY: `ptr..ptr+len` is the memory of an exported buffer, a consumed DLPack
    // tensor or an array whose object is held (the plan's `Keep`, which the caller drops
    // only after this future ended): valid and not freed while we read it. A concurrent
    // writer in Python could change bytes under the copy, as with any copy of a shared
    // array; it cannot free them.
    let source = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
    if whole {
        let n = target.len();
        target.copy_from_slice(&source[..n]);
    } else {
        for (at, n) in copied_ranges(layout, len as u64) {
            let (at, n) = (at as usize, n as usize);
            target[at..at + n].copy_from_slice(&source[at..at + n]);
        }
    }
    Ok(buffer)
}

/// The ranges of a buffer of `len` bytes that `layout` names, each byte once: a block list's
/// blocks sorted and merged where they overlap or touch (65,536 blocks that each name the
/// whole array copy it once, not 65,536 times); a strided layout's rows, which never
/// overlap, as they are. The layout fits `len` (checked by the caller).
fn copied_ranges(layout: &Layout, len: u64) -> Box<dyn Iterator<Item = (u64, u64)> + '_> {
    let Some(blocks) = layout.block_list() else {
        return layout.runs(len);
    };
    let mut sorted: Vec<(u64, u64)> = blocks.iter().map(|b| (b.offset, b.len)).collect();
    sorted.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(sorted.len());
    for (at, n) in sorted {
        match merged.last_mut() {
            Some((start, run)) if at <= *start + *run => {
                *run = (*run).max(at + n - *start);
            }
            _ => merged.push((at, n)),
        }
    }
    Box::new(merged.into_iter())
}

/// GPU memory at `ptr..ptr+len` on `device` registered in place
/// ([`ferry::Node::register_external`]) once the producer's pending work on `stream`
/// completed.
///
/// The memory must stay allocated until [`ferry::Node::unregister_external`] answered `Ok`
/// for the buffer this returns: the caller holds the plan's [`Keep`] until then, and never
/// lets it go when that answer does not come.
fn register(
    node: &ferry::Node,
    ptr: u64,
    len: usize,
    device: u32,
    stream: Option<usize>,
) -> Result<ferry::Buffer, Error> {
    crate::gpu::settle(device, stream)
        .map_err(|e| Error::unsupported(format!("waiting for the tensor's producer: {e}")))?;
    // SAFETY: the caller keeps the tensor (its DLPack export or its object, the plan's
    // `Keep`) until `unregister_external` answered that no copy and no peer uses the
    // memory, and forgets it (never frees it) when that answer does not come.
    let memory = unsafe { ExternalMemory::new(ptr, len, device) };
    node.register_external(memory)
}

/// Waits for the writes another library may have queued to a `ferry.Buffer`'s device
/// memory (through DLPack) on `device`'s legacy default stream.
fn settle_ferry(device: Option<u32>) -> Result<(), Error> {
    match device {
        Some(device) => crate::gpu::settle(device, None)
            .map_err(|e| Error::unsupported(format!("waiting for writes to the buffer: {e}"))),
        None => Ok(()),
    }
}

/// Sends what `plan` describes to `peer` under `tag` (with `layout`, until `deadline`):
/// the ferry buffer as it is, host bytes after one copy into a ferry host buffer, GPU
/// memory registered for the time of the send.
///
/// The memory `plan` points at must stay valid until this ends (its [`Keep`]).
pub(crate) async fn run_send(
    node: Arc<ferry::Node>,
    peer: String,
    tag: u64,
    plan: Plan,
    layout: Layout,
    deadline: Option<Instant>,
) -> Sent {
    let send = async |buffer: ferry::Buffer| -> Result<ferry::Buffer, SendError> {
        match (&layout, deadline) {
            (Layout::Contiguous, Some(deadline)) => {
                node.send_by(&peer, tag, buffer, deadline).await
            }
            (Layout::Contiguous, None) => node.send(&peer, tag, buffer).await,
            (layout, _) => node.send_layout(&peer, tag, buffer, layout.clone()).await,
        }
    };
    let done = |result: Result<(), Error>| Sent {
        result,
        keep_forever: false,
    };
    match plan {
        Plan::Ferry {
            state,
            buffer,
            settle,
        } => {
            if let Err(e) = settle_ferry(settle) {
                state.lock().buffer = Some(buffer);
                return done(Err(e));
            }
            match send(buffer).await {
                Ok(buffer) => {
                    state.lock().buffer = Some(buffer);
                    done(Ok(()))
                }
                Err(SendError { error, buffer }) => {
                    if let Some(buffer) = buffer {
                        state.lock().buffer = Some(buffer);
                    }
                    done(Err(error))
                }
            }
        }
        Plan::Host { ptr, len } => {
            let buffer = match copy_host(&node, ptr, len, &layout).await {
                Ok(buffer) => buffer,
                Err(e) => return done(Err(e)),
            };
            done(send(buffer).await.map(drop).map_err(|e| e.error))
        }
        Plan::Device {
            ptr,
            len,
            device,
            stream,
        } => {
            // The plan's `Keep` holds the tensor until this future ended, and it ends only
            // after `unregister_external` answered; when it does not answer in time,
            // `keep_forever` tells the caller never to let the tensor go.
            let registered = match register(&node, ptr, len, device, stream) {
                Ok(buffer) => buffer,
                Err(e) => return done(Err(e)),
            };
            let (result, back) = match send(registered).await {
                Ok(buffer) => (Ok(()), Some(buffer)),
                Err(SendError { error, buffer }) => (Err(error), buffer),
            };
            let Some(back) = back else {
                // The node stopped while holding it; it was dropped, and its release
                // cannot be awaited: keep the tensor.
                return Sent {
                    result,
                    keep_forever: true,
                };
            };
            match node.unregister_external(back).await {
                Ok(()) => done(result),
                Err(e) => Sent {
                    result: result.and(Err(e)),
                    keep_forever: true,
                },
            }
        }
    }
}

/// What the binding keeps of a key it published, until `unpublish`.
pub(crate) enum Held {
    /// A `ferry.Buffer` published as it is: its object, whose state gets the buffer back.
    Object(Py<Buffer>),
    /// A copy of the object's host bytes in ferry's pool: a new `Buffer` on unpublish.
    Copied,
    /// GPU memory registered in place, and what holds it.
    Registered(Registration),
}

/// The [`Keep`] of GPU memory registered in place: let go only by [`Self::release`], once
/// `unregister_external` answered; dropped otherwise, it is leaked (a peer may still read
/// the memory, which must never be freed then).
pub(crate) struct Registration(Option<Keep>);

impl Registration {
    /// The keep, to drop (with the GIL) now that nothing reads the memory.
    pub(crate) fn release(mut self) -> Keep {
        self.0.take().unwrap_or(Keep::Nothing)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(keep) = self.0.take() {
            std::mem::forget(keep);
        }
    }
}

/// How an unpublish ended.
pub(crate) enum Unpublished {
    /// The buffer went back to the `ferry.Buffer` object that was published.
    Returned,
    /// The copy of a bytes-like object's bytes, for a new `ferry.Buffer`.
    Copy(ferry::Buffer),
    /// Registered GPU memory, unregistered: what held the tensor, to let go of.
    Unregistered(Keep),
}

/// Publishes what `plan` describes under `key` (for `peers` only, when given): the ferry
/// buffer as it is, host bytes after one copy into a ferry host buffer, GPU memory
/// registered in place until unpublished. `object` is the `ferry.Buffer` of a
/// [`Plan::Ferry`]. On success the binding's table `published` records the key (what
/// must be kept or given back on unpublish), under its lock with the node's own table,
/// so that the two agree.
///
/// Returns what to drop, with the GIL, once it ended: the plan's [`Keep`] unless the
/// publication holds it.
///
/// The memory `plan` points at must stay valid until this ends (its [`Keep`]).
pub(crate) async fn run_publish(
    node: Arc<ferry::Node>,
    published: Arc<Mutex<HashMap<String, Held>>>,
    listing: Listing,
    (plan, keep, object): (Plan, Keep, Option<Py<Buffer>>),
) -> (Result<Option<ferry::RegionKey>, Error>, Keep) {
    let (buffer, held, keep) = match (plan, object) {
        (
            Plan::Ferry {
                state,
                buffer,
                settle,
            },
            Some(object),
        ) => {
            if let Err(e) = settle_ferry(settle) {
                state.lock().buffer = Some(buffer);
                return (Err(e), keep);
            }
            (buffer, Held::Object(object), keep)
        }
        (Plan::Ferry { state, buffer, .. }, None) => {
            state.lock().buffer = Some(buffer);
            return (
                Err(Error::Usage("a ferry.Buffer without its object".into())),
                keep,
            );
        }
        (Plan::Host { ptr, len }, _) => match copy_host(&node, ptr, len, &Layout::Contiguous).await
        {
            Ok(buffer) => (buffer, Held::Copied, keep),
            Err(e) => return (Err(e), keep),
        },
        (
            Plan::Device {
                ptr,
                len,
                device,
                stream,
            },
            _,
        ) => match register(&node, ptr, len, device, stream) {
            Ok(buffer) => (
                buffer,
                Held::Registered(Registration(Some(keep))),
                Keep::Nothing,
            ),
            Err(e) => return (Err(e), keep),
        },
    };
    let refused = {
        let mut table = published.lock().unwrap_or_else(PoisonError::into_inner);
        let outcome = match &listing {
            Listing::Key { key, peers: None } => node
                .publish(key.clone(), buffer)
                .map(|()| (key.clone(), None)),
            Listing::Key {
                key,
                peers: Some(peers),
            } => {
                let peers: Vec<&str> = peers.iter().map(String::as_str).collect();
                node.publish_for(key.clone(), buffer, &peers)
                    .map(|()| (key.clone(), None))
            }
            Listing::Region(access) => node
                .register(buffer, *access)
                .map(|region| (region_name(&region), Some(region))),
        };
        match outcome {
            Ok((name, region)) => {
                table.insert(name, held);
                Ok(region)
            }
            Err(SendError { error, buffer }) => Err((error, buffer, held)),
        }
    };
    let (error, buffer, held) = match refused {
        Ok(region) => return (Ok(region), keep),
        Err(refused) => refused,
    };
    // Refused (a bad key, one published already): the buffer comes back.
    match (held, buffer) {
        (Held::Object(object), buffer) => {
            if let Some(buffer) = buffer {
                object.get().state().lock().buffer = Some(buffer);
            }
            drop_with_gil(object);
            (Err(error), keep)
        }
        (Held::Registered(registration), Some(buffer)) => {
            if node.unregister_external(buffer).await.is_ok() {
                (Err(error), registration.release())
            } else {
                // Still in use: dropping the registration leaks the tensor.
                (Err(error), keep)
            }
        }
        // A copy (dropped), or registered memory that did not come back (leaked).
        _ => (Err(error), keep),
    }
}

/// Ends the publication of `key`, which the binding recorded as `held`: waits until no
/// peer reads the buffer, then gives it back to its `ferry.Buffer` object, or hands the
/// copy over, or unregisters the GPU memory. The binding's record was taken out of its
/// table by the caller.
pub(crate) async fn run_unpublish(
    node: Arc<ferry::Node>,
    key: String,
    held: Held,
    region: Option<ferry::RegionKey>,
) -> Result<Unpublished, Error> {
    let buffer = match region {
        Some(region) => node.unregister(region).await,
        None => node.unpublish(&key).await,
    };
    match (buffer, held) {
        (Ok(buffer), Held::Object(object)) => {
            object.get().state().lock().buffer = Some(buffer);
            // The object itself is returned by the caller, which holds it too.
            drop_with_gil(object);
            Ok(Unpublished::Returned)
        }
        (Ok(buffer), Held::Copied) => Ok(Unpublished::Copy(buffer)),
        (Ok(buffer), Held::Registered(registration)) => {
            node.unregister_external(buffer).await?;
            Ok(Unpublished::Unregistered(registration.release()))
        }
        // Still read after the wait: the buffer is freed once the last reader let go (a
        // registration leaks its tensor, dropped here).
        (Err(e), held) => {
            if let Held::Object(object) = held {
                drop_with_gil(object);
            }
            Err(e)
        }
    }
}

/// What a buffer is listed as: published under a key (for some peers), or registered as a
/// region.
pub(crate) enum Listing {
    /// `Node::publish` (or `publish_for` the peers).
    Key {
        key: String,
        peers: Option<Vec<String>>,
    },
    /// `Node::register` with this access.
    Region(ferry::Access),
}

/// The binding's table key of a region (apart from any application key: those may not
/// start with `ferry.region/`).
pub(crate) fn region_name(region: &ferry::RegionKey) -> String {
    format!("ferry.region/{}.{}", region.region, region.generation)
}

/// Lets go of a Python object from a thread that may not hold the GIL.
fn drop_with_gil<T>(object: Py<T>) {
    Python::attach(|_| drop(object));
}
