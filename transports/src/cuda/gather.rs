//! A block list's runs between device memories of one GPU, copied by one kernel launch.
//!
//! The copy engine pays a fixed cost per copy, batched or not: on an H100,
//! `cuMemcpyBatchAsync` of 64 to 4,000 blocks took 5–8 µs a block whatever its size
//! (docs/PERFORMANCE.md, "Block lists over ipc"). A kernel whose thread blocks each copy
//! one run pays the launch once. The kernel is PTX text, compiled by the driver when first
//! used in a context (no CUDA toolkit at build or run time); where it does not load, copies
//! go back to the batch.

use std::collections::HashMap;
use std::ffi::{CString, c_uint, c_void};
use std::sync::Mutex;

use cudarc::driver::sys;

use super::error::{CudaError, check};

/// `ferry_gather(desc, count)`: thread block `b` copies run `b` of `desc` (three `u64`
/// each: destination, source, length), 16 bytes at a time where all three are multiples
/// of 16, else byte by byte.
const PTX: &str = r#"
.version 6.0
.target sm_52
.address_size 64

.visible .entry ferry_gather(
    .param .u64 p_desc,
    .param .u32 p_count
)
{
    .reg .pred %p<4>;
    .reg .b16 %rs<2>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_desc];
    ld.param.u32 %r1, [p_count];
    mov.u32 %r2, %ctaid.x;
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd1, %rd1;
    mul.wide.u32 %rd2, %r2, 24;
    add.s64 %rd3, %rd1, %rd2;
    ld.global.u64 %rd4, [%rd3];
    ld.global.u64 %rd5, [%rd3+8];
    ld.global.u64 %rd6, [%rd3+16];
    cvta.to.global.u64 %rd4, %rd4;
    cvta.to.global.u64 %rd5, %rd5;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %ntid.x;
    cvt.u64.u32 %rd7, %r3;
    cvt.u64.u32 %rd8, %r4;
    or.b64 %rd9, %rd4, %rd5;
    or.b64 %rd9, %rd9, %rd6;
    and.b64 %rd9, %rd9, 15;
    setp.ne.u64 %p2, %rd9, 0;
    @%p2 bra BYTES;
    shr.u64 %rd10, %rd6, 4;
WIDE:
    setp.ge.u64 %p3, %rd7, %rd10;
    @%p3 bra DONE;
    shl.b64 %rd11, %rd7, 4;
    add.s64 %rd12, %rd5, %rd11;
    add.s64 %rd13, %rd4, %rd11;
    ld.global.v4.u32 {%r5, %r6, %r7, %r8}, [%rd12];
    st.global.v4.u32 [%rd13], {%r5, %r6, %r7, %r8};
    add.s64 %rd7, %rd7, %rd8;
    bra.uni WIDE;
BYTES:
    setp.ge.u64 %p3, %rd7, %rd6;
    @%p3 bra DONE;
    add.s64 %rd12, %rd5, %rd7;
    add.s64 %rd13, %rd4, %rd7;
    ld.global.u8 %rs1, [%rd12];
    st.global.u8 [%rd13], %rs1;
    add.s64 %rd7, %rd7, %rd8;
    bra.uni BYTES;
DONE:
    ret;
}
"#;

/// Threads per block: each run is copied by this many threads, 16 bytes each per step.
const THREADS: c_uint = 256;

/// The kernel, by context (as addresses: the handles are only passed to the driver), or
/// `None` where it did not load (the driver's error was logged once). A context that was
/// destroyed (its last user released the primary context) and made again may come back at
/// the same address without the module: a launch that finds the handle invalid forgets the
/// entry and loads again ([`forget`]).
static KERNELS: Mutex<Option<HashMap<usize, Option<usize>>>> = Mutex::new(None);

/// The kernel in the current context, loading it on first use there.
fn kernel() -> Option<sys::CUfunction> {
    let ctx = current_context()?;
    let mut kernels = KERNELS.lock().unwrap_or_else(|p| p.into_inner());
    let found = kernels
        .get_or_insert_with(HashMap::new)
        .entry(ctx)
        .or_insert_with(|| match load() {
            Ok(f) => Some(f as usize),
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "the gather kernel does not load: block lists are copied by the copy engine"
                );
                None
            }
        });
    found.map(|f| f as sys::CUfunction)
}

/// Forgets the kernel of the current context (its handle was found invalid).
fn forget() {
    if let Some(ctx) = current_context() {
        let mut kernels = KERNELS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(map) = kernels.as_mut() {
            map.remove(&ctx);
        }
    }
}

/// The calling thread's current context, as an address (the key of [`KERNELS`]).
fn current_context() -> Option<usize> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one handle into `ctx`.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) }).ok()?;
    (!ctx.is_null()).then_some(ctx as usize)
}

/// Loads the module into the current context (kept for the process's life, as the
/// context's primary reference is) and finds the kernel.
fn load() -> Result<sys::CUfunction, CudaError> {
    let image = CString::new(PTX).map_err(|_| CudaError::Misuse("PTX with a NUL".into()))?;
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `image` is NUL-terminated PTX text that lives through the call.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut module, image.as_ptr().cast::<c_void>())
    })?;
    let name = c"ferry_gather";
    let mut function: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: the module was just loaded; the name is a C string.
    check("cuModuleGetFunction", unsafe {
        sys::cuModuleGetFunction(&mut function, module, name.as_ptr())
    })?;
    Ok(function)
}

/// Queues the runs (`dsts[i]` ← `srcs[i]`, `sizes[i]` bytes) as one kernel launch on
/// `stream`, whose context must be current. `Ok(false)`: the kernel is not available here
/// (nothing was queued).
///
/// # Safety
/// Every run lies in device memory that the stream's GPU can read (sources) and write
/// (destinations), valid until the launch completes on `stream`; destinations disjoint.
pub(super) unsafe fn gather_async(
    dsts: &[sys::CUdeviceptr],
    srcs: &[sys::CUdeviceptr],
    sizes: &[usize],
    stream: sys::CUstream,
) -> Result<bool, CudaError> {
    let count = sizes.len();
    if dsts.len() != count || srcs.len() != count {
        return Err(CudaError::Misuse(
            "a gather with lists of different lengths".into(),
        ));
    }
    let Ok(blocks) = c_uint::try_from(count) else {
        return Ok(false);
    };
    if count == 0 || blocks > i32::MAX as c_uint {
        return Ok(false);
    }
    let Some(function) = kernel() else {
        return Ok(false);
    };
    let desc: Vec<u64> = (0..count)
        .flat_map(|i| [dsts[i], srcs[i], sizes[i] as u64])
        .collect();
    let bytes = desc.len() * std::mem::size_of::<u64>();
    let mut table: sys::CUdeviceptr = 0;
    // SAFETY: writes one address; stream-ordered allocation on a stream of ours.
    check("cuMemAllocAsync", unsafe {
        sys::cuMemAllocAsync(&mut table, bytes, stream)
    })?;
    // SAFETY: `desc` is pageable host memory, which the driver has staged when the call
    // returns; `table` holds `bytes` bytes from the allocation above, in stream order.
    let uploaded = check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(table, desc.as_ptr().cast::<c_void>(), bytes, stream)
    });
    let launch = |function: sys::CUfunction| {
        let mut table_param = table;
        let mut count_param = blocks;
        let mut params = [
            (&raw mut table_param).cast::<c_void>(),
            (&raw mut count_param).cast::<c_void>(),
        ];
        // SAFETY: the kernel takes (u64, u32), the two parameters here, read during the
        // call; it reads `count` runs of the table and copies inside the runs (caller).
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                function,
                blocks,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    };
    let launched = uploaded.and_then(|()| match launch(function) {
        Ok(()) => Ok(true),
        // A kernel of a context that is gone: load it into this one and launch again (or
        // leave the runs to the copy engine when it does not load).
        Err(CudaError::Driver {
            code: sys::CUresult::CUDA_ERROR_INVALID_HANDLE,
            ..
        }) => {
            forget();
            match kernel() {
                Some(again) => launch(again).map(|()| true),
                None => Ok(false),
            }
        }
        Err(e) => Err(e),
    });
    // SAFETY: freed in stream order, after the launch (or the failed upload) that uses it.
    let freed = check("cuMemFreeAsync", unsafe {
        sys::cuMemFreeAsync(table, stream)
    });
    let ran = launched?;
    freed?;
    Ok(ran)
}
