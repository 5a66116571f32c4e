//! DLPack, both ways: exporting a ferry buffer as a capsule (`Buffer.__dlpack__`), and
//! reading the capsule another library's tensor exports, to send it.
//!
//! The structs are DLPack's C ABI (`dlpack.h`, versions 0.8 and 1.x), written from the
//! specification. A capsule named `"dltensor"` holds a `DLManagedTensor`, one named
//! `"dltensor_versioned"` a `DLManagedTensorVersioned`; a consumer renames it to
//! `"used_dltensor"` (`"used_dltensor_versioned"`) and calls the tensor's deleter when done
//! with it, and a capsule collected unconsumed calls the deleter itself.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_void};
use std::sync::Arc;

use ferry::MemoryKind;
use ferry::cuda::DeviceMemory;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::buffer::{Buffer, State};

const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_CUDA_HOST: i32 = 3;
const KDL_CUDA_MANAGED: i32 = 13;
/// `kDLUInt`.
const KDL_UINT: u8 = 1;
/// `DLPACK_FLAG_BITMASK_READ_ONLY`.
const FLAG_READ_ONLY: u64 = 1;

const NAME: &CStr = c"dltensor";
const USED_NAME: &CStr = c"used_dltensor";
const NAME_VERSIONED: &CStr = c"dltensor_versioned";

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

#[repr(C)]
struct DlPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DlManagedTensorVersioned {
    version: DlPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

/// DLPack's `(device_type, device_id)` for a kind of memory. Pinned memory is ordinary
/// host memory to a reader: `kDLCPU`.
pub(crate) fn device_of(kind: MemoryKind) -> (i32, i32) {
    match kind {
        MemoryKind::Device(n) => (KDL_CUDA, i32::try_from(n).unwrap_or(i32::MAX)),
        _ => (KDL_CPU, 0),
    }
}

/// What an exported capsule owns: the tensor it points at (first, so a pointer to the
/// tensor is a pointer to this), its shape, and a hold on the buffer.
#[repr(C)]
struct Export<M> {
    managed: M,
    shape: [i64; 1],
    strides: [i64; 1],
    /// Dropped by the deleter: the view ends, and the buffer may go back to the pool.
    state: Arc<State>,
}

impl<M> Drop for Export<M> {
    fn drop(&mut self) {
        self.state.view_ended();
    }
}

/// The address and length of a buffer's bytes, and whether they may be written, counted as
/// one more view. `None` while the buffer is being sent or released.
fn hold(state: &Arc<State>) -> PyResult<(*mut c_void, usize, bool)> {
    let mut slot = state.lock();
    let Some(buffer) = slot.buffer.as_mut() else {
        return Err(PyBufferError::new_err(
            "the buffer is being sent or is published, or was released",
        ));
    };
    let len = buffer.len();
    let on_device = buffer.device_memory().is_some();
    // A handle shared with other holders (a shared fetch) is read-only on a GPU too.
    let exclusive = buffer.is_exclusive();
    let (ptr, writable) = if let Some(device) = buffer.device_memory() {
        (device.device_ptr() as usize as *mut c_void, exclusive)
    } else if let Some(bytes) = buffer.as_mut_slice() {
        (bytes.as_mut_ptr().cast(), true)
    } else if let Some(bytes) = buffer.as_slice() {
        (bytes.as_ptr().cast_mut().cast(), false)
    } else {
        return Err(PyBufferError::new_err("the buffer has no memory to export"));
    };
    slot.views += 1;
    slot.written_elsewhere |= on_device && writable;
    Ok((ptr, len, writable))
}

fn tensor(data: *mut c_void, device: DlDevice, shape: *mut i64, strides: *mut i64) -> DlTensor {
    DlTensor {
        data,
        device,
        ndim: 1,
        dtype: DlDataType {
            code: KDL_UINT,
            bits: 8,
            lanes: 1,
        },
        shape,
        strides,
        byte_offset: 0,
    }
}

/// A capsule of `buffer`'s bytes: `"dltensor_versioned"` (DLPack 1.0) when `versioned`,
/// else `"dltensor"`.
pub(crate) fn export<'py>(
    py: Python<'py>,
    buffer: &Buffer,
    versioned: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let state = Arc::clone(buffer.state());
    let (data, len, writable) = hold(&state)?;
    let (device_type, device_id) = device_of(buffer.memory_kind());
    let device = DlDevice {
        device_type,
        device_id,
    };
    let len = i64::try_from(len).unwrap_or(i64::MAX);
    if versioned {
        let export = Box::new(Export {
            managed: DlManagedTensorVersioned {
                version: DlPackVersion { major: 1, minor: 0 },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_versioned),
                flags: if writable { 0 } else { FLAG_READ_ONLY },
                dl_tensor: tensor(data, device, std::ptr::null_mut(), std::ptr::null_mut()),
            },
            shape: [len],
            strides: [1],
            state,
        });
        let raw = Box::into_raw(export);
        // SAFETY: `raw` is a live, uniquely owned allocation; the pointers stored point
        // into it, which does not move until the deleter frees it.
        unsafe {
            (*raw).managed.manager_ctx = raw.cast();
            (*raw).managed.dl_tensor.shape = (&raw mut (*raw).shape).cast();
            (*raw).managed.dl_tensor.strides = (&raw mut (*raw).strides).cast();
        }
        // SAFETY: `raw` points at its `managed` field first (`repr(C)`); the capsule
        // destructor frees it unless a consumer took it.
        unsafe { capsule(py, raw.cast(), NAME_VERSIONED, Some(capsule_versioned)) }
    } else {
        let export = Box::new(Export {
            managed: DlManagedTensor {
                dl_tensor: tensor(data, device, std::ptr::null_mut(), std::ptr::null_mut()),
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_legacy),
            },
            shape: [len],
            strides: [1],
            state,
        });
        let raw = Box::into_raw(export);
        // SAFETY: as above.
        unsafe {
            (*raw).managed.manager_ctx = raw.cast();
            (*raw).managed.dl_tensor.shape = (&raw mut (*raw).shape).cast();
            (*raw).managed.dl_tensor.strides = (&raw mut (*raw).strides).cast();
        }
        // SAFETY: as above.
        unsafe { capsule(py, raw.cast(), NAME, Some(capsule_legacy)) }
    }
}

/// Wraps `pointer` (a managed tensor) in a capsule named `name`; on failure, runs the
/// destructor's work at once.
///
/// # Safety
/// `pointer` is a managed tensor of the kind `destructor` expects, owned by nobody else.
unsafe fn capsule<'py>(
    py: Python<'py>,
    pointer: *mut c_void,
    name: &'static CStr,
    destructor: Option<ffi::PyCapsule_Destructor>,
) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: `name` is 'static, as a capsule's name must be; the GIL is held.
    let capsule = unsafe { ffi::PyCapsule_New(pointer, name.as_ptr(), destructor) };
    if capsule.is_null() {
        // SAFETY: no capsule took `pointer`; free it as the capsule would have.
        unsafe {
            if name == NAME {
                delete_legacy(pointer.cast());
            } else {
                delete_versioned(pointer.cast());
            }
        }
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference, just returned by PyCapsule_New.
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
}

/// The deleter of an exported legacy tensor: frees the export, ending the view.
///
/// # Safety
/// `managed` came from [`export`] and is deleted once.
unsafe extern "C" fn delete_legacy(managed: *mut DlManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: the tensor is the first field of the `Export` allocated by `export`, its
    // `manager_ctx`; the consumer calls the deleter once.
    drop(unsafe { Box::from_raw(managed.cast::<Export<DlManagedTensor>>()) });
}

/// The deleter of an exported versioned tensor.
///
/// # Safety
/// As [`delete_legacy`].
unsafe extern "C" fn delete_versioned(managed: *mut DlManagedTensorVersioned) {
    if managed.is_null() {
        return;
    }
    // SAFETY: as in `delete_legacy`.
    drop(unsafe { Box::from_raw(managed.cast::<Export<DlManagedTensorVersioned>>()) });
}

/// A legacy capsule collected: if no consumer took the tensor (the name is unchanged),
/// delete it.
///
/// # Safety
/// Called by Python with the capsule being destroyed, the GIL held.
unsafe extern "C" fn capsule_legacy(capsule: *mut ffi::PyObject) {
    // SAFETY: `capsule` is a live capsule; IsValid only compares its name.
    if unsafe { ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) } == 1 {
        // SAFETY: a valid capsule of this name holds the tensor `export` made.
        let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()) };
        // SAFETY: nobody consumed it, so nobody deleted it.
        unsafe { delete_legacy(managed.cast()) };
    }
}

/// A versioned capsule collected: as [`capsule_legacy`].
///
/// # Safety
/// As [`capsule_legacy`].
unsafe extern "C" fn capsule_versioned(capsule: *mut ffi::PyObject) {
    // SAFETY: as in `capsule_legacy`.
    if unsafe { ffi::PyCapsule_IsValid(capsule, NAME_VERSIONED.as_ptr()) } == 1 {
        // SAFETY: as in `capsule_legacy`.
        let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, NAME_VERSIONED.as_ptr()) };
        // SAFETY: as in `capsule_legacy`.
        unsafe { delete_versioned(managed.cast()) };
    }
}

/// Where a tensor imported from another library lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// Memory the CPU reads (host, pinned or managed).
    Host,
    /// Memory of the GPU with this ordinal.
    Cuda(u32),
}

/// A tensor another library exported to us (its capsule consumed): its bytes stay valid
/// until this is dropped, which calls the producer's deleter.
pub(crate) struct Imported {
    managed: *mut DlManagedTensor,
    /// Address of the first byte.
    pub(crate) ptr: usize,
    /// Bytes, C-contiguous.
    pub(crate) len: usize,
    pub(crate) place: Place,
}

// SAFETY: the tensor is owned by this value alone (the capsule was consumed); DLPack lets
// its deleter be called from any thread, and `drop` calls it with the GIL held, as
// producers that touch Python objects expect.
unsafe impl Send for Imported {}

impl Drop for Imported {
    fn drop(&mut self) {
        let managed = self.managed;
        Python::attach(|_| {
            // SAFETY: `managed` was taken from a capsule we renamed as consumed; its deleter
            // runs exactly once, here.
            unsafe {
                if let Some(deleter) = (*managed).deleter {
                    deleter(managed);
                }
            }
        });
    }
}

/// Takes the tensor of `obj.__dlpack__(...)` (asked for a legacy capsule, which every
/// producer makes). For a CUDA tensor, `stream=1` asks the producer to order its pending
/// work before the legacy default stream, which the sender then synchronises
/// (`crate::gpu::settle`).
///
/// # Errors
/// `BufferError` for a tensor that is not C-contiguous, or on a device ferry cannot read.
pub(crate) fn import(obj: &Bound<'_, PyAny>, cuda: bool) -> PyResult<Imported> {
    let py = obj.py();
    let kwargs = pyo3::types::PyDict::new(py);
    if cuda {
        kwargs.set_item("stream", 1)?;
    }
    let capsule = obj.call_method("__dlpack__", (), Some(&kwargs))?;
    // SAFETY: a capsule the producer just made (or any object: GetPointer checks the type
    // and the name, and sets an error on a mismatch).
    let managed = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), NAME.as_ptr()) }
        .cast::<DlManagedTensor>();
    if managed.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: mark it consumed so that the capsule's destructor leaves the tensor to us.
    if unsafe { ffi::PyCapsule_SetName(capsule.as_ptr(), USED_NAME.as_ptr()) } != 0 {
        return Err(PyErr::fetch(py));
    }
    let mut imported = Imported {
        managed,
        ptr: 0,
        len: 0,
        place: Place::Host,
    };
    // SAFETY: the producer's tensor, valid until its deleter runs (when `imported` drops).
    let t = unsafe { &(*managed).dl_tensor };
    imported.place = match t.device.device_type {
        KDL_CPU | KDL_CUDA_HOST | KDL_CUDA_MANAGED => Place::Host,
        KDL_CUDA => Place::Cuda(u32::try_from(t.device.device_id).unwrap_or(0)),
        other => {
            return Err(PyBufferError::new_err(format!(
                "DLPack device type {other} is neither host memory nor a CUDA GPU"
            )));
        }
    };
    let ndim = usize::try_from(t.ndim).unwrap_or(0);
    let shape: &[i64] = if ndim == 0 || t.shape.is_null() {
        &[]
    } else {
        // SAFETY: DLPack: `shape` holds `ndim` entries.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let strides: Option<&[i64]> = if ndim == 0 || t.strides.is_null() {
        None
    } else {
        // SAFETY: DLPack: `strides`, when not null, holds `ndim` entries.
        Some(unsafe { std::slice::from_raw_parts(t.strides, ndim) })
    };
    let item = (usize::from(t.dtype.bits) * usize::from(t.dtype.lanes)).div_ceil(8);
    if !c_contiguous(shape, strides) {
        return Err(PyBufferError::new_err(
            "the tensor is not C-contiguous: send .contiguous() / numpy.ascontiguousarray(x), \
             or use send_layout",
        ));
    }
    let count = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?))
        .ok_or_else(|| PyBufferError::new_err("the tensor's shape is invalid"))?;
    imported.len = count
        .checked_mul(item)
        .ok_or_else(|| PyBufferError::new_err("the tensor is too large"))?;
    imported.ptr = (t.data as usize)
        .checked_add(usize::try_from(t.byte_offset).unwrap_or(usize::MAX))
        .ok_or_else(|| PyBufferError::new_err("the tensor's address is invalid"))?;
    Ok(imported)
}

/// True when elements laid with `strides` (in elements; `None`: compact) are C-contiguous.
/// Dimensions of extent 1 may have any stride.
pub(crate) fn c_contiguous(shape: &[i64], strides: Option<&[i64]>) -> bool {
    let Some(strides) = strides else {
        return true;
    };
    let mut expected = 1i64;
    for (&extent, &stride) in shape.iter().zip(strides).rev() {
        if extent == 0 {
            return true;
        }
        if extent != 1 && stride != expected {
            return false;
        }
        expected = expected.saturating_mul(extent);
    }
    true
}
