//! Step two of "FFI in three steps": one thin function per driver call, returning
//! `Result<_, CudaError>` with the call's name, over `cudarc::driver::sys`. No ownership
//! here; the RAII types in the sibling modules own what these functions create.
//!
//! Every function in this file assumes [`driver`] returned `Ok` first: cudarc's dynamic
//! loading panics when the library or one of its symbols is missing, and [`driver`] is the
//! check that keeps it from getting there.

use std::ffi::{c_int, c_uint, c_void};
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use cudarc::driver::sys::{self, CUresult};

use super::error::{CudaError, check};

/// The driver entry points this layer calls (the names cudarc's loader looks up with the
/// `cuda-12080` bindings). Checked once, so that a driver that lacks one gives an error
/// instead of cudarc's panic.
const ENTRY_POINTS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDeviceGetUuid",
    "cuDeviceGetPCIBusId",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxEnablePeerAccess",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolSetAttribute",
    "cuMemPoolSetAccess",
    "cuMemPoolTrimTo",
    "cuMemAllocFromPoolAsync",
    "cuMemFreeAsync",
    "cuMemFree_v2",
    "cuMemPoolExportToShareableHandle",
    "cuMemPoolImportFromShareableHandle",
    "cuMemPoolExportPointer",
    "cuMemPoolImportPointer",
    "cuMemGetAddressRange_v2",
    "cuMemcpyAsync",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpy3DAsync_v2",
    "cuMemsetD8Async",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemAlloc_v2",
    "cuPointerGetAttribute",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
];

/// Loads and initialises the driver once per process; every public entry point of the CUDA
/// layer calls this before anything else.
///
/// # Errors
/// [`CudaError::NoDriver`] without `libcuda`, [`CudaError::MissingEntryPoint`] for a driver
/// too old for the 12.8 bindings, [`CudaError::Driver`] when `cuInit` fails (for example
/// `CUDA_ERROR_NO_DEVICE`). The outcome is cached: a later call answers the same.
pub fn driver() -> Result<(), CudaError> {
    static READY: OnceLock<Result<(), CudaError>> = OnceLock::new();
    READY.get_or_init(load_and_init).clone()
}

fn load_and_init() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen the library under cudarc's candidate names and drops the
    // handle; NVIDIA's initialisers are designed to run in any process.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    for &name in ENTRY_POINTS {
        // SAFETY: the library is present (checked above), so `culib` loads it instead of
        // panicking. Looking a symbol up does not call it; the fn type is only a placeholder
        // for the address and is never called through.
        let found = unsafe { sys::culib().get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok();
        if !found {
            return Err(CudaError::MissingEntryPoint(name));
        }
    }
    // SAFETY: every entry point is present (checked above); cuInit takes flags 0.
    check("cuInit", unsafe { sys::cuInit(0) })
}

// ---- devices and contexts ------------------------------------------------------------------

pub(super) fn device_count() -> Result<c_int, CudaError> {
    let mut n: c_int = 0;
    // SAFETY: the driver writes one int through a pointer to a live local.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(n)
}

pub(super) fn device_get(ordinal: c_int) -> Result<sys::CUdevice, CudaError> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: the driver writes one device handle through a pointer to a live local; an
    // ordinal out of range is an error code, not undefined behaviour.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;
    Ok(dev)
}

/// # Safety
/// `a` and `b` came from [`device_get`].
pub(super) unsafe fn device_can_access_peer(
    a: sys::CUdevice,
    b: sys::CUdevice,
) -> Result<bool, CudaError> {
    let mut yes: c_int = 0;
    // SAFETY: valid devices (caller); one int written through a pointer to a live local.
    check("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&mut yes, a, b)
    })?;
    Ok(yes != 0)
}

/// # Safety
/// `dev` came from [`device_get`]. Each successful call must be balanced by one
/// [`primary_ctx_release`].
pub(super) unsafe fn primary_ctx_retain(dev: sys::CUdevice) -> Result<sys::CUcontext, CudaError> {
    let mut ctx = MaybeUninit::uninit();
    // SAFETY: valid device (caller); the driver writes the context handle on success only,
    // and we read it only then.
    unsafe {
        check(
            "cuDevicePrimaryCtxRetain",
            sys::cuDevicePrimaryCtxRetain(ctx.as_mut_ptr(), dev),
        )?;
        Ok(ctx.assume_init())
    }
}

/// # Safety
/// Balances one successful [`primary_ctx_retain`] of `dev`; nothing created in the context
/// may be used after the last release.
pub(super) unsafe fn primary_ctx_release(dev: sys::CUdevice) -> Result<(), CudaError> {
    // SAFETY: the caller balances a retain.
    check("cuDevicePrimaryCtxRelease", unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(dev)
    })
}

/// # Safety
/// `ctx` is a live context (a retained primary context).
pub(super) unsafe fn ctx_set_current(ctx: sys::CUcontext) -> Result<(), CudaError> {
    // SAFETY: live context (caller); binding is per thread and touches no Rust memory.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })
}

/// Returns `Ok(false)` when access was already enabled.
///
/// # Safety
/// The current context is live and `peer` is another live context.
pub(super) unsafe fn ctx_enable_peer_access(peer: sys::CUcontext) -> Result<bool, CudaError> {
    // SAFETY: live contexts (caller); flags must be 0.
    match unsafe { sys::cuCtxEnablePeerAccess(peer, 0) } {
        CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(false),
        code => check("cuCtxEnablePeerAccess", code).map(|()| true),
    }
}

// ---- streams and events --------------------------------------------------------------------

/// # Safety
/// The device's context is current on this thread.
pub(super) unsafe fn stream_create() -> Result<sys::CUstream, CudaError> {
    let mut s = MaybeUninit::uninit();
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
    // SAFETY: a context is current (caller); the handle is read only on success.
    unsafe {
        check("cuStreamCreate", sys::cuStreamCreate(s.as_mut_ptr(), flags))?;
        Ok(s.assume_init())
    }
}

/// # Safety
/// `s` came from [`stream_create`], is not used afterwards, and its context is alive.
pub(super) unsafe fn stream_destroy(s: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: caller; the driver finishes pending work before it releases the stream.
    check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(s) })
}

/// # Safety
/// `s` is a live stream.
pub(super) unsafe fn stream_synchronize(s: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: live stream (caller).
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(s)
    })
}

/// `Ok(true)` when everything queued on the stream has completed, `Ok(false)` while not.
///
/// # Safety
/// `s` is a live stream.
pub(super) unsafe fn stream_query(s: sys::CUstream) -> Result<bool, CudaError> {
    // SAFETY: live stream (caller).
    match unsafe { sys::cuStreamQuery(s) } {
        CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        code => check("cuStreamQuery", code).map(|()| true),
    }
}

/// # Safety
/// `s` and `e` are live and belong to contexts that are alive.
pub(super) unsafe fn stream_wait_event(s: sys::CUstream, e: sys::CUevent) -> Result<(), CudaError> {
    // SAFETY: live handles (caller); flags must be 0.
    check("cuStreamWaitEvent", unsafe {
        sys::cuStreamWaitEvent(s, e, 0)
    })
}

/// # Safety
/// The device's context is current on this thread.
pub(super) unsafe fn event_create() -> Result<sys::CUevent, CudaError> {
    let mut e = MaybeUninit::uninit();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
    // SAFETY: a context is current (caller); the handle is read only on success.
    unsafe {
        check("cuEventCreate", sys::cuEventCreate(e.as_mut_ptr(), flags))?;
        Ok(e.assume_init())
    }
}

/// # Safety
/// `e` came from [`event_create`] and is not used afterwards.
pub(super) unsafe fn event_destroy(e: sys::CUevent) -> Result<(), CudaError> {
    // SAFETY: caller.
    check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(e) })
}

/// # Safety
/// `e` and `s` are live and of the same context.
pub(super) unsafe fn event_record(e: sys::CUevent, s: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: caller.
    check("cuEventRecord", unsafe { sys::cuEventRecord(e, s) })
}

/// # Safety
/// `e` is live.
pub(super) unsafe fn event_synchronize(e: sys::CUevent) -> Result<(), CudaError> {
    // SAFETY: caller.
    check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(e) })
}

/// `Ok(true)` when the work the event captured is done, `Ok(false)` while it is not.
///
/// # Safety
/// `e` is live.
pub(super) unsafe fn event_query(e: sys::CUevent) -> Result<bool, CudaError> {
    // SAFETY: caller.
    match unsafe { sys::cuEventQuery(e) } {
        CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        code => check("cuEventQuery", code).map(|()| true),
    }
}

// ---- memory pools --------------------------------------------------------------------------

/// A pool on device `ordinal` whose memory can be exported as POSIX file descriptors.
///
/// # Safety
/// The device's context is current on this thread.
pub(super) unsafe fn mem_pool_create_exportable(
    ordinal: c_int,
) -> Result<sys::CUmemoryPool, CudaError> {
    // SAFETY: CUmemPoolProps is a plain C struct of integers, enums whose 0 is a valid
    // variant (CU_MEM_ALLOCATION_TYPE_INVALID, CU_MEM_LOCATION_TYPE_INVALID), a nullable
    // pointer and reserved bytes that the driver requires to be zero.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    props.location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    };
    let mut pool = MaybeUninit::uninit();
    // SAFETY: `props` is fully initialised and lives across the call; the handle is read
    // only on success.
    unsafe {
        check(
            "cuMemPoolCreate",
            sys::cuMemPoolCreate(pool.as_mut_ptr(), &props),
        )?;
        Ok(pool.assume_init())
    }
}

/// # Safety
/// `pool` is live and not used afterwards.
pub(super) unsafe fn mem_pool_destroy(pool: sys::CUmemoryPool) -> Result<(), CudaError> {
    // SAFETY: caller. Outstanding allocations keep the driver's pool alive until freed.
    check("cuMemPoolDestroy", unsafe { sys::cuMemPoolDestroy(pool) })
}

/// # Safety
/// `pool` is live.
pub(super) unsafe fn mem_pool_set_release_threshold(
    pool: sys::CUmemoryPool,
    bytes: u64,
) -> Result<(), CudaError> {
    let mut value: sys::cuuint64_t = bytes;
    // SAFETY: live pool (caller); this attribute's value is a cuuint64_t, which `value` is,
    // and it lives across the call.
    check("cuMemPoolSetAttribute", unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut value as *mut sys::cuuint64_t).cast::<c_void>(),
        )
    })
}

/// The pool's memory reserved from the GPU and the part of it allocations use now
/// (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`, `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`).
///
/// # Safety
/// `pool` is live.
pub(super) unsafe fn mem_pool_usage(pool: sys::CUmemoryPool) -> Result<(u64, u64), CudaError> {
    let read = |attr| {
        let mut value: sys::cuuint64_t = 0;
        // SAFETY: live pool (caller); these attributes' values are cuuint64_t, which
        // `value` is, and it lives across the call.
        check("cuMemPoolGetAttribute", unsafe {
            sys::cuMemPoolGetAttribute(
                pool,
                attr,
                (&mut value as *mut sys::cuuint64_t).cast::<c_void>(),
            )
        })
        .map(|()| value)
    };
    Ok((
        read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
        read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
    ))
}

/// Releases the pool's reserved memory that backs no allocation until at most
/// `keep` bytes stay reserved (or nothing more can go).
///
/// # Safety
/// `pool` is live.
pub(super) unsafe fn mem_pool_trim_to(
    pool: sys::CUmemoryPool,
    keep: usize,
) -> Result<(), CudaError> {
    // SAFETY: live pool (caller); the driver only unmaps memory no allocation uses.
    check("cuMemPoolTrimTo", unsafe {
        sys::cuMemPoolTrimTo(pool, keep)
    })
}

/// Lets device `ordinal` read and write the pool's allocations.
///
/// # Safety
/// `pool` is live.
pub(super) unsafe fn mem_pool_set_access_rw(
    pool: sys::CUmemoryPool,
    ordinal: c_int,
) -> Result<(), CudaError> {
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: live pool (caller); one descriptor, which lives across the call.
    check("cuMemPoolSetAccess", unsafe {
        sys::cuMemPoolSetAccess(pool, &desc, 1)
    })
}

/// # Safety
/// `pool` and `stream` are live; the memory returned is uninitialised and becomes usable in
/// stream order on `stream`.
pub(super) unsafe fn mem_alloc_from_pool_async(
    pool: sys::CUmemoryPool,
    len: usize,
    stream: sys::CUstream,
) -> Result<sys::CUdeviceptr, CudaError> {
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: live handles (caller); one device pointer written through a live local.
    check("cuMemAllocFromPoolAsync", unsafe {
        sys::cuMemAllocFromPoolAsync(&mut ptr, len, pool, stream)
    })?;
    Ok(ptr)
}

/// # Safety
/// `ptr` came from a pool allocation, is freed once, and every use of it is ordered before
/// this free on `stream`; `stream` is live.
pub(super) unsafe fn mem_free_async(
    ptr: sys::CUdeviceptr,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    // SAFETY: caller.
    check("cuMemFreeAsync", unsafe {
        sys::cuMemFreeAsync(ptr, stream)
    })
}

/// # Safety
/// `ptr` is a live device allocation, freed once, with no work still using it.
pub(super) unsafe fn mem_free(ptr: sys::CUdeviceptr) -> Result<(), CudaError> {
    // SAFETY: caller.
    check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) })
}

/// Returns the new file descriptor (owned by the caller).
///
/// # Safety
/// `pool` is a live pool created with POSIX-fd handles.
pub(super) unsafe fn mem_pool_export_fd(pool: sys::CUmemoryPool) -> Result<c_int, CudaError> {
    let mut fd: c_int = -1;
    // SAFETY: live pool (caller); for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the handle
    // out-parameter points to an int, which `fd` is; flags must be 0.
    check("cuMemPoolExportToShareableHandle", unsafe {
        sys::cuMemPoolExportToShareableHandle(
            (&mut fd as *mut c_int).cast::<c_void>(),
            pool,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    Ok(fd)
}

/// # Safety
/// `fd` is an open file descriptor for the duration of the call. The driver does not take
/// it over: the caller still closes it.
pub(super) unsafe fn mem_pool_import_fd(fd: c_int) -> Result<sys::CUmemoryPool, CudaError> {
    let mut pool = MaybeUninit::uninit();
    // SAFETY: for POSIX-fd handles the handle argument is the descriptor's value carried in
    // the pointer (the driver never dereferences it); flags must be 0. The pool is read only
    // on success. A descriptor that is not a pool is an error code from the driver.
    unsafe {
        check(
            "cuMemPoolImportFromShareableHandle",
            sys::cuMemPoolImportFromShareableHandle(
                pool.as_mut_ptr(),
                fd as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            ),
        )?;
        Ok(pool.assume_init())
    }
}

/// # Safety
/// `ptr` is a live allocation of an exportable pool.
pub(super) unsafe fn mem_pool_export_pointer(ptr: sys::CUdeviceptr) -> Result<[u8; 64], CudaError> {
    let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
    // SAFETY: caller; the driver writes 64 bytes into a live local of that size.
    check("cuMemPoolExportPointer", unsafe {
        sys::cuMemPoolExportPointer(&mut data, ptr)
    })?;
    Ok(data.reserved)
}

/// # Safety
/// `pool` is a live imported pool.
pub(super) unsafe fn mem_pool_import_pointer(
    pool: sys::CUmemoryPool,
    export: &[u8; 64],
) -> Result<sys::CUdeviceptr, CudaError> {
    // The driver takes a mutable pointer but only reads the export data; give it a copy.
    let mut data = sys::CUmemPoolPtrExportData { reserved: *export };
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: live pool (caller); both pointers are to live locals. Bytes that do not name an
    // allocation of this pool are an error code from the driver.
    check("cuMemPoolImportPointer", unsafe {
        sys::cuMemPoolImportPointer(&mut ptr, pool, &mut data)
    })?;
    Ok(ptr)
}

/// Free and total memory of the current context's device.
///
/// # Safety
/// A context is current on this thread.
pub(super) unsafe fn mem_get_info() -> Result<(u64, u64), CudaError> {
    let mut free: usize = 0;
    let mut total: usize = 0;
    // SAFETY: a context is current (caller); two values written through live locals.
    check("cuMemGetInfo", unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

/// The allocation containing `ptr`: its base and size.
///
/// # Safety
/// A context is current on this thread.
pub(super) unsafe fn mem_get_address_range(
    ptr: sys::CUdeviceptr,
) -> Result<(sys::CUdeviceptr, usize), CudaError> {
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: a context is current (caller); two values written through live locals. An
    // address outside every allocation is an error code.
    check("cuMemGetAddressRange", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
    })?;
    Ok((base, size))
}

// ---- copies and host memory ----------------------------------------------------------------

/// # Safety
/// `[src, src+len)` and `[dst, dst+len)` are live device (or unified) memory that stays
/// allocated until the copy completes on `stream`, a live stream.
pub(super) unsafe fn memcpy_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    // SAFETY: caller.
    check("cuMemcpyAsync", unsafe {
        sys::cuMemcpyAsync(dst, src, len, stream)
    })
}

/// Whether the driver has `cuMemcpyBatchAsync` (drivers of CUDA 12.8 and later), looked up
/// once: a driver without it gets one `cuMemcpyAsync` per copy instead. False without a
/// driver.
pub(super) fn has_memcpy_batch() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        // SAFETY: `driver` checked that the library loads, so `culib` does not panic;
        // looking a symbol up does not call it (the fn type is only a placeholder).
        driver().is_ok()
            && unsafe {
                sys::culib()
                    .get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync")
                    .is_ok()
            }
    })
}

/// Queues the copies `dsts[i] <- srcs[i]` of `sizes[i]` bytes as one batch
/// (`cuMemcpyBatchAsync`), each reading its source in stream order. The copies of a batch
/// run in any order. Call only when [`has_memcpy_batch`] said yes.
///
/// # Safety
/// Each `[src, src+size)` and `[dst, dst+size)` is live
/// device (or unified) memory that stays allocated until the batch completes on `stream`,
/// a live stream that is not the legacy default stream; no destination overlaps another
/// copy's source or destination.
pub(super) unsafe fn memcpy_batch_async(
    dsts: &mut [sys::CUdeviceptr],
    srcs: &mut [sys::CUdeviceptr],
    sizes: &mut [usize],
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    if dsts.len() != sizes.len() || srcs.len() != sizes.len() {
        return Err(CudaError::Misuse(
            "a batch of copies with lists of different lengths".into(),
        ));
    }
    // One set of attributes for every copy: stream order, no location hints (they are
    // ignored for memory that is not managed, which ferry never copies).
    let no_hint = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
        id: 0,
    };
    let mut attrs = sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: no_hint,
        dstLocHint: no_hint,
        flags: 0,
    };
    let mut first = [0usize];
    let mut failed = usize::MAX;
    // SAFETY: caller (memory, stream, the symbol's presence); the slices, the attributes
    // and `failed` live through the call, the driver reads `count` entries of each array
    // and one attribute set, and writes one index.
    check("cuMemcpyBatchAsync", unsafe {
        sys::cuMemcpyBatchAsync(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            sizes.len(),
            &mut attrs,
            first.as_mut_ptr(),
            1,
            &mut failed,
            stream,
        )
    })
}

/// Where one side of a [`memcpy_box_async`] is.
#[derive(Debug, Clone, Copy)]
pub(super) enum Place {
    /// Device (or unified) memory at this address.
    Device(sys::CUdeviceptr),
    /// Host memory at this address.
    Host(*mut u8),
}

/// The shape of a [`memcpy_box_async`]: `depth` planes of `height` rows of `width` bytes.
/// Each side has its own pitch (bytes from row to row) and plane height (rows from plane to
/// plane).
#[derive(Debug, Clone, Copy)]
pub(super) struct BoxShape {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub src_pitch: usize,
    pub src_plane_rows: usize,
    pub dst_pitch: usize,
    pub dst_plane_rows: usize,
}

/// One 3D copy (`cuMemcpy3DAsync`): the copy engine gathers and scatters the rows.
///
/// # Safety
/// Every row of the box lies in live memory on both sides (from each start, `depth` planes
/// of `height` rows at the side's pitches), which stays allocated until the copy completes
/// on `stream`, a live stream; host memory is not written by anyone else meanwhile.
pub(super) unsafe fn memcpy_box_async(
    dst: Place,
    src: Place,
    shape: BoxShape,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    // Every field set: the memory-type enum has no zero value, so the struct has no
    // all-zero form.
    let (src_type, src_host, src_device) = match src {
        Place::Device(ptr) => (
            sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            std::ptr::null(),
            ptr,
        ),
        Place::Host(ptr) => (
            sys::CUmemorytype::CU_MEMORYTYPE_HOST,
            ptr.cast::<c_void>().cast_const(),
            0,
        ),
    };
    let (dst_type, dst_host, dst_device) = match dst {
        Place::Device(ptr) => (
            sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            std::ptr::null_mut(),
            ptr,
        ),
        Place::Host(ptr) => (
            sys::CUmemorytype::CU_MEMORYTYPE_HOST,
            ptr.cast::<c_void>(),
            0,
        ),
    };
    let p = sys::CUDA_MEMCPY3D {
        srcXInBytes: 0,
        srcY: 0,
        srcZ: 0,
        srcLOD: 0,
        srcMemoryType: src_type,
        srcHost: src_host,
        srcDevice: src_device,
        srcArray: std::ptr::null_mut(),
        reserved0: std::ptr::null_mut(),
        srcPitch: shape.src_pitch,
        srcHeight: shape.src_plane_rows,
        dstXInBytes: 0,
        dstY: 0,
        dstZ: 0,
        dstLOD: 0,
        dstMemoryType: dst_type,
        dstHost: dst_host,
        dstDevice: dst_device,
        dstArray: std::ptr::null_mut(),
        reserved1: std::ptr::null_mut(),
        dstPitch: shape.dst_pitch,
        dstHeight: shape.dst_plane_rows,
        WidthInBytes: shape.width,
        Height: shape.height,
        Depth: shape.depth,
    };
    // SAFETY: caller; `p` lives through the call (the driver reads it before returning).
    check("cuMemcpy3DAsync", unsafe {
        sys::cuMemcpy3DAsync_v2(&p, stream)
    })
}

/// # Safety
/// `[dst, dst+len)` is live device memory and `src` points to `len` readable host bytes;
/// both stay valid until the copy completes on `stream`.
pub(super) unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const u8,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    // SAFETY: caller.
    check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), len, stream)
    })
}

/// # Safety
/// `[src, src+len)` is live device memory and `dst` points to `len` writable host bytes that
/// nothing else reads or writes until the copy completes on `stream`.
pub(super) unsafe fn memcpy_dtoh_async(
    dst: *mut u8,
    src: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    // SAFETY: caller.
    check("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, len, stream)
    })
}

/// # Safety
/// `[dst, dst+len)` is live device memory until the fill completes on `stream`.
pub(super) unsafe fn memset_d8_async(
    dst: sys::CUdeviceptr,
    value: u8,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    // SAFETY: caller.
    check("cuMemsetD8Async", unsafe {
        sys::cuMemsetD8Async(dst, value, len, stream)
    })
}

/// Page-locked host memory, portable (usable from every context).
///
/// # Safety
/// Some context is current on this thread.
pub(super) unsafe fn mem_host_alloc(len: usize) -> Result<*mut u8, CudaError> {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: a context is current (caller); the driver writes one pointer to a live local.
    check("cuMemHostAlloc", unsafe {
        sys::cuMemHostAlloc(&mut p, len, sys::CU_MEMHOSTALLOC_PORTABLE)
    })?;
    Ok(p.cast::<u8>())
}

/// # Safety
/// `p` came from [`mem_host_alloc`], is freed once, and no copy still uses it.
pub(super) unsafe fn mem_free_host(p: *mut u8) -> Result<(), CudaError> {
    // SAFETY: caller.
    check("cuMemFreeHost", unsafe {
        sys::cuMemFreeHost(p.cast::<c_void>())
    })
}

/// Page-locks `len` bytes of host memory at `p` that the process mapped itself (shared memory),
/// portable to every context, so copies to and from it run at the pinned rate.
///
/// # Safety
/// Some context is current on this thread; `p..p + len` is a live mapping that stays mapped
/// until [`mem_host_unregister`].
pub(super) unsafe fn mem_host_register(p: *mut u8, len: usize) -> Result<(), CudaError> {
    // SAFETY: caller.
    check("cuMemHostRegister", unsafe {
        sys::cuMemHostRegister_v2(p.cast::<c_void>(), len, sys::CU_MEMHOSTREGISTER_PORTABLE)
    })
}

/// # Safety
/// `p` was registered by [`mem_host_register`], once, and no copy still uses it.
pub(super) unsafe fn mem_host_unregister(p: *mut u8) -> Result<(), CudaError> {
    // SAFETY: caller.
    check("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(p.cast::<c_void>())
    })
}

// ---- plain allocations and legacy IPC handles ------------------------------------------------

/// Device memory from `cuMemAlloc` (not a pool): what a framework's allocator hands out.
///
/// # Safety
/// The device's context is current on this thread.
pub(super) unsafe fn mem_alloc(len: usize) -> Result<sys::CUdeviceptr, CudaError> {
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: a context is current (caller); the driver writes one address to a live local.
    check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, len) })?;
    Ok(ptr)
}

/// One 64-bit pointer attribute of `ptr` (`cuPointerGetAttribute`), e.g. the allocation's
/// buffer id or device ordinal.
///
/// # Safety
/// None beyond a loaded driver: an address the driver does not know is an error code.
pub(super) unsafe fn pointer_attribute_u64(
    ptr: sys::CUdeviceptr,
    attribute: sys::CUpointer_attribute,
) -> Result<u64, CudaError> {
    let mut value: u64 = 0;
    // SAFETY: the attributes asked for here are at most 8 bytes wide (BUFFER_ID is a u64;
    // DEVICE_ORDINAL and IS_LEGACY_CUDA_IPC_CAPABLE are 4-byte values written into the low
    // half of the zeroed u64), written through a pointer to a live local.
    check("cuPointerGetAttribute", unsafe {
        sys::cuPointerGetAttribute((&raw mut value).cast::<c_void>(), attribute, ptr)
    })?;
    Ok(value)
}

/// The legacy IPC handle of the allocation starting at `base` (`cuIpcGetMemHandle`).
///
/// # Safety
/// `base` is the base of a live `cuMemAlloc` allocation.
pub(super) unsafe fn ipc_get_mem_handle(base: sys::CUdeviceptr) -> Result<[u8; 64], CudaError> {
    let mut handle = MaybeUninit::<sys::CUipcMemHandle>::zeroed();
    // SAFETY: caller; the driver writes 64 bytes into a live local of that size.
    check("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(handle.as_mut_ptr(), base)
    })?;
    // SAFETY: zero-initialised above and filled by the driver; plain bytes.
    let handle = unsafe { handle.assume_init() };
    Ok(handle.reserved.map(|b| b as u8))
}

/// Maps a peer's allocation from its legacy IPC handle into the current context
/// (`cuIpcOpenMemHandle`, peer access enabled lazily). Returns the mapping's base.
///
/// # Safety
/// A context is current on this thread. Bytes that are not a handle are an error code.
pub(super) unsafe fn ipc_open_mem_handle(handle: &[u8; 64]) -> Result<sys::CUdeviceptr, CudaError> {
    let h = sys::CUipcMemHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: a context is current (caller); the handle is passed by value and the driver
    // writes one address to a live local.
    check("cuIpcOpenMemHandle", unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut ptr,
            h,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint,
        )
    })?;
    Ok(ptr)
}

/// Unmaps what [`ipc_open_mem_handle`] mapped (`cuIpcCloseMemHandle`).
///
/// # Safety
/// `ptr` came from [`ipc_open_mem_handle`], is closed once, and no copy still uses it; the
/// context it was opened in is current.
pub(super) unsafe fn ipc_close_mem_handle(ptr: sys::CUdeviceptr) -> Result<(), CudaError> {
    // SAFETY: caller.
    check("cuIpcCloseMemHandle", unsafe {
        sys::cuIpcCloseMemHandle(ptr)
    })
}
