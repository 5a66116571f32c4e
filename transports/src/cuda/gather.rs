//! A block list's runs (or a lane batch's records) between device memories of one GPU,
//! copied by one kernel launch.
//!
//! The copy engine pays a fixed cost per copy, batched or not: on an H100,
//! `cuMemcpyBatchAsync` of 64 to 4,000 blocks took 5–8 µs a block whatever its size
//! (docs/PERFORMANCE.md, "Block lists over ipc"). A kernel whose thread blocks each copy
//! a piece of a run pays the launch once. The kernel is PTX text, compiled by the driver
//! when a device first uses it (no CUDA toolkit at build or run time; unloaded when the
//! device releases its context); where it does not load, copies go back to the batch. The kernel reads the runs from a table of its device's, reused
//! from call to call ([`Tables`]): nothing is allocated, and the host never waits for the
//! stream, to queue a gather (unless every table is still being read).

use std::ffi::{CString, c_uint, c_void};
use std::sync::Mutex;
use std::time::Instant;

use cudarc::driver::sys;

use super::error::{CudaError, check, teardown_failed};
use super::stream::Stream;

/// `ferry_gather(desc, count)`: thread block `b` copies entry `b` of `desc` (three `u64`
/// each: destination, source, length; a run or a piece of one, see [`pieces`]), 16 bytes
/// at a time where all three are multiples of 16, else byte by byte.
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

/// Threads per block: each piece is copied by this many threads, 16 bytes each per step.
const THREADS: c_uint = 256;

/// The most bytes one thread block copies: a longer run is cut into pieces of this many
/// (a piece per block), so that a run of megabytes is spread over the GPU's
/// multiprocessors instead of crawling through one.
const PIECE: u64 = 64 << 10;

/// The pieces of one run (`dst` ← `src`, `len` bytes), each copied by one thread block:
/// [`PIECE`] bytes each, and where both addresses are 16-byte aligned the last piece's
/// odd bytes (its length mod 16) apart, so that every other piece takes the kernel's
/// 16-byte path.
fn pieces(dst: u64, src: u64, len: u64) -> impl Iterator<Item = [u64; 3]> {
    let aligned = (dst | src) % 16 == 0;
    let body = if aligned { len - len % 16 } else { len };
    let whole = (0..body.div_ceil(PIECE)).map(move |i| {
        let at = i * PIECE;
        [dst + at, src + at, PIECE.min(body - at)]
    });
    let tail = (body < len).then(|| [dst + body, src + body, len - body]);
    whole.chain(tail)
}

/// The gather kernel of one device's context: loaded at the first gather, unloaded when
/// the device releases its context ([`Tables::release`]). Kept with the device rather than
/// by context address: a context destroyed (its last user released the primary context)
/// and made again may come back at the same address, and launching the old module's
/// function there crashed inside the driver (a segfault, not an error).
#[derive(Default)]
enum Kernel {
    /// Not tried yet.
    #[default]
    Unloaded,
    /// Loaded: the module (unloaded with the device) and its function.
    Loaded {
        module: sys::CUmodule,
        function: sys::CUfunction,
    },
    /// The driver refused it (logged once): gathers go to the copy engine.
    Refused(CudaError),
}

impl Kernel {
    /// The function, loading the module on first use.
    ///
    /// # Safety
    /// The context of the device that owns the kernel is current.
    unsafe fn function(&mut self) -> Result<sys::CUfunction, CudaError> {
        if let Kernel::Unloaded = self {
            let started = Instant::now();
            let loaded = load();
            tracing::debug!(
                target: "ferry::blocks",
                us = started.elapsed().as_micros() as u64,
                ok = loaded.is_ok(),
                "loaded the gather kernel"
            );
            *self = match loaded {
                Ok((module, function)) => Kernel::Loaded { module, function },
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "the gather kernel does not load: block lists are copied by the copy engine"
                    );
                    Kernel::Refused(e)
                }
            };
        }
        match self {
            Kernel::Loaded { function, .. } => Ok(*function),
            Kernel::Refused(e) => Err(e.clone()),
            Kernel::Unloaded => Err(CudaError::Misuse("the gather kernel was not loaded".into())),
        }
    }
}

/// Loads the gather kernel into `device` (binding its primary context on this thread),
/// once per device: a lane calls it when it starts, so that its first gather does not pay
/// the driver's compilation (165 ms measured on an H100); `ferry doctor` reports the
/// answer. Where it does not load, block lists of one GPU are copied as between GPUs (a
/// batch of copies) and lane records one by one.
///
/// # Errors
/// The driver's, binding the context or loading the module (the PTX JIT's error).
pub fn load_kernel(device: &super::Device) -> Result<(), CudaError> {
    device.bind()?;
    let mut pool = device.gather_tables().lock();
    // SAFETY: the device's context is current (bound above).
    unsafe { pool.kernel.function() }.map(drop)
}

/// Loads the module into the current context and finds the kernel.
fn load() -> Result<(sys::CUmodule, sys::CUfunction), CudaError> {
    let image = CString::new(PTX).map_err(|_| CudaError::Misuse("PTX with a NUL".into()))?;
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `image` is NUL-terminated PTX text that lives through the call.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut module, image.as_ptr().cast::<c_void>())
    })?;
    let name = c"ferry_gather";
    let mut function: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: the module was just loaded; the name is a C string.
    let found = check("cuModuleGetFunction", unsafe {
        sys::cuModuleGetFunction(&mut function, module, name.as_ptr())
    });
    match found {
        Ok(()) => Ok((module, function)),
        Err(e) => {
            // SAFETY: loaded just above; nothing launched from it.
            unsafe { unload(module) };
            Err(e)
        }
    }
}

/// Unloads a module of ours (a failure is logged).
///
/// # Safety
/// Its context is current and no queued launch uses it.
unsafe fn unload(module: sys::CUmodule) {
    // SAFETY: caller.
    if let Err(e) = check("cuModuleUnload", unsafe { sys::cuModuleUnload(module) }) {
        teardown_failed!(e, "unloading the gather kernel failed");
    }
}

/// Bytes of one run in a table: destination, source, length.
const RUN_BYTES: usize = 3 * std::mem::size_of::<u64>();

/// Tables one device keeps at most: a gather that finds them all still read by queued
/// work waits (on the host) for the one used longest ago.
const SLOTS_MAX: usize = 4;

/// The smallest table (170 runs); larger ones are rounded up to a power of two, so a slot
/// grows by doubling and a steady block count never reallocates.
const TABLE_MIN: usize = 4096;

/// The run tables of one device's gathers, reused from call to call: each slot is a
/// page-locked staging table (`cuMemHostAlloc`), uploaded by an asynchronous copy (pinned
/// memory: the host does not wait for the stream, as it would for pageable memory) into
/// a device table (`cuMemAlloc`) the kernel reads, and an event recorded after the launch.
/// A slot is written again only once its event has passed. Nothing is allocated per
/// call: the stream-ordered allocation this replaces came from the device's default pool,
/// which gives its memory back at every synchronisation, so each call mapped memory again.
///
/// Owned by the device (its primary context), which frees the tables before it releases
/// the context ([`Tables::release`]).
#[derive(Default)]
pub(super) struct Tables {
    pool: Mutex<Pool>,
}

#[derive(Default)]
struct Pool {
    slots: Vec<Slot>,
    /// Gathers queued so far; a slot's `used` is the number of the last one that read it.
    launches: u64,
    /// The kernel in the device's context.
    kernel: Kernel,
    /// A slot was given up with its launch perhaps in flight (its event could not be
    /// recorded nor the stream waited for): the module is never unloaded then.
    unsettled: bool,
}

// SAFETY: the module and function handles are only passed to the driver (whose API is
// thread-safe), under the pool's mutex.
unsafe impl Send for Kernel {}

/// One reusable table.
struct Slot {
    /// Page-locked staging of `capacity` bytes (null before the first use).
    host: *mut u8,
    /// The table the kernel reads, `capacity` bytes (0 before the first use).
    device: sys::CUdeviceptr,
    capacity: usize,
    /// Recorded on the stream after the upload and the launch that read the slot.
    event: sys::CUevent,
    /// The number of the last gather that read the slot; 0: none did.
    used: u64,
}

// SAFETY: the slot owns its two allocations (as a Box owns its memory) and its event, and
// is only reached under the pool's mutex; driver handles may be used from any thread.
unsafe impl Send for Slot {}

impl Tables {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Frees every table once the work that reads it has completed (a table whose wait
    /// fails is leaked: it may still be read). Called once, by the device, before it
    /// releases its context.
    ///
    /// # Safety
    /// `ctx` is the context the tables were made in, still retained.
    pub(super) unsafe fn release(&mut self, ctx: sys::CUcontext) {
        let pool = self.pool.get_mut().unwrap_or_else(|p| p.into_inner());
        if pool.slots.is_empty() && !matches!(pool.kernel, Kernel::Loaded { .. }) {
            return;
        }
        // SAFETY: the context is retained (caller).
        if let Err(e) = unsafe { super::raw::ctx_set_current(ctx) } {
            teardown_failed!(
                e,
                "binding a context to free the gather tables failed; leaked"
            );
            return;
        }
        // Every launch is followed by its slot's event: once all have passed, no launch
        // uses the module (unless a slot was given up unsettled).
        let mut settled = !pool.unsettled;
        for slot in pool.slots.drain(..) {
            let done = if slot.used == 0 {
                Ok(())
            } else {
                // SAFETY: the slot's event, created in this context, which is alive.
                unsafe { super::raw::event_synchronize(slot.event) }
            };
            match done {
                // SAFETY: nothing queued reads the table any more (waited for above).
                Ok(()) => unsafe { free_table(slot.host, slot.device) },
                Err(e) => {
                    settled = false;
                    teardown_failed!(
                        e,
                        "waiting for a gather before freeing its table failed; leaked"
                    )
                }
            }
            // SAFETY: created by cuEventCreate in this context; not used afterwards (the
            // driver defers the release past a pending record).
            if let Err(e) = unsafe { super::raw::event_destroy(slot.event) } {
                teardown_failed!(e, "destroying a gather table's event failed");
            }
        }
        if let Kernel::Loaded { module, .. } = std::mem::take(&mut pool.kernel)
            && settled
        {
            // SAFETY: the context is current (bound above); every launch has passed.
            unsafe { unload(module) };
        }
    }
}

impl Pool {
    /// A slot that no queued work reads, holding at least `bytes`: an idle one (one that
    /// fits first), else a new one while there are fewer than [`SLOTS_MAX`], else the one
    /// used longest ago once its work has completed (waited for here). Returns its index
    /// and whether it was waited for.
    ///
    /// # Safety
    /// The context of the device that owns the pool is current.
    unsafe fn slot_for(&mut self, bytes: usize) -> Result<(usize, bool), CudaError> {
        let mut found = None;
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.idle()? {
                if slot.capacity >= bytes {
                    found = Some(i);
                    break;
                }
                found.get_or_insert(i);
            }
        }
        let mut waited = false;
        let index = match found {
            Some(i) => i,
            None if self.slots.len() < SLOTS_MAX => {
                // SAFETY: the context is current (caller).
                self.slots.push(unsafe { Slot::new() }?);
                self.slots.len() - 1
            }
            None => {
                let (i, oldest) = self
                    .slots
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, s)| s.used)
                    .ok_or_else(|| CudaError::Misuse("a gather pool without slots".into()))?;
                // SAFETY: the slot's event lives as long as the slot.
                unsafe { super::raw::event_synchronize(oldest.event) }?;
                waited = true;
                i
            }
        };
        // SAFETY: idle (found idle, new, or waited for); the context is current (caller).
        unsafe { self.slots[index].reserve(bytes) }?;
        Ok((index, waited))
    }
}

impl Slot {
    /// An empty slot with its event.
    ///
    /// # Safety
    /// The context of the device that owns the pool is current.
    unsafe fn new() -> Result<Slot, CudaError> {
        // SAFETY: a context is current (caller).
        let event = unsafe { super::raw::event_create() }?;
        Ok(Slot {
            host: std::ptr::null_mut(),
            device: 0,
            capacity: 0,
            event,
            used: 0,
        })
    }

    /// True when no queued work reads the slot any more.
    fn idle(&self) -> Result<bool, CudaError> {
        if self.used == 0 {
            return Ok(true);
        }
        // SAFETY: the event lives as long as the slot.
        unsafe { super::raw::event_query(self.event) }
    }

    /// Makes the slot hold at least `bytes` (a power of two of them, at least
    /// [`TABLE_MIN`]); the old tables are freed once the new ones are there.
    ///
    /// # Safety
    /// The slot is idle; the context of the device that owns the pool is current.
    unsafe fn reserve(&mut self, bytes: usize) -> Result<(), CudaError> {
        if self.capacity >= bytes {
            return Ok(());
        }
        let capacity = bytes
            .checked_next_power_of_two()
            .unwrap_or(bytes)
            .max(TABLE_MIN);
        // SAFETY: a context is current (caller).
        let host = unsafe { super::raw::mem_host_alloc(capacity) }?;
        // SAFETY: the owning device's context is current (caller).
        let device = match unsafe { super::raw::mem_alloc(capacity) } {
            Ok(device) => device,
            Err(e) => {
                // SAFETY: allocated just above; nothing uses it.
                unsafe { free_table(host, 0) };
                return Err(e);
            }
        };
        let (old_host, old_device) = (self.host, self.device);
        self.host = host;
        self.device = device;
        self.capacity = capacity;
        // SAFETY: the slot is idle (caller): no queued copy or launch reads the old tables.
        unsafe { free_table(old_host, old_device) };
        Ok(())
    }
}

/// Frees a slot's tables (either may be absent); a failure is logged and the memory leaked.
///
/// # Safety
/// Nothing queued reads them; a context is current.
unsafe fn free_table(host: *mut u8, device: sys::CUdeviceptr) {
    if !host.is_null() {
        // SAFETY: from cuMemHostAlloc, freed once, unused (caller).
        if let Err(e) = unsafe { super::raw::mem_free_host(host) } {
            teardown_failed!(e, "freeing a gather table's staging failed; leaked");
        }
    }
    if device != 0 {
        // SAFETY: from cuMemAlloc, freed once, unused (caller).
        if let Err(e) = unsafe { super::raw::mem_free(device) } {
            teardown_failed!(e, "freeing a gather table failed; leaked");
        }
    }
}

/// Launches the kernel over the `blocks` runs of the device table `table` on `stream`.
///
/// # Safety
/// As [`gather_async`]; `function` is of the stream's context; `table` holds `blocks`
/// runs, uploaded in stream order before this.
unsafe fn launch(
    function: sys::CUfunction,
    table: sys::CUdeviceptr,
    blocks: c_uint,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    let mut table_param = table;
    let mut count_param = blocks;
    let mut params = [
        (&raw mut table_param).cast::<c_void>(),
        (&raw mut count_param).cast::<c_void>(),
    ];
    // SAFETY: the kernel takes (u64, u32), the two parameters here, read during the call;
    // it reads `blocks` runs of the table and copies inside the runs (caller).
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
}

/// Queues the runs (`dsts[i]` ← `srcs[i]`, `sizes[i]` bytes) as one kernel launch on
/// `stream`, whose context must be current: the runs, cut into [`pieces`], go into a reused
/// table of the stream's device ([`Tables`]), uploaded and read in stream order. `Ok(false)`: the
/// kernel is not available here (no copy is launched).
///
/// # Safety
/// Every run lies in device memory that the stream's GPU can read (sources) and write
/// (destinations), valid until the launch completes on `stream`; destinations disjoint.
pub(super) unsafe fn gather_async(
    dsts: &[sys::CUdeviceptr],
    srcs: &[sys::CUdeviceptr],
    sizes: &[usize],
    stream: &Stream,
) -> Result<bool, CudaError> {
    let runs = sizes.len();
    if dsts.len() != runs || srcs.len() != runs {
        return Err(CudaError::Misuse(
            "a gather with lists of different lengths".into(),
        ));
    }
    let run = |i: usize| pieces(dsts[i], srcs[i], sizes[i] as u64);
    let count: usize = (0..runs).map(|i| run(i).count()).sum();
    let Ok(blocks) = c_uint::try_from(count) else {
        return Ok(false);
    };
    if count == 0 || blocks > i32::MAX as c_uint {
        return Ok(false);
    }
    let bytes = count
        .checked_mul(RUN_BYTES)
        .ok_or_else(|| CudaError::Misuse(format!("a gather of {count} runs")))?;
    let started = Instant::now();
    let mut pool = stream.device().gather_tables().lock();
    // SAFETY: the stream's context, its device's, is current (caller).
    let Ok(function) = (unsafe { pool.kernel.function() }) else {
        return Ok(false);
    };
    // SAFETY: the stream's context, its device's, is current (caller).
    let (index, waited) = unsafe { pool.slot_for(bytes) }?;
    let slot_at = started.elapsed();
    pool.launches += 1;
    let number = pool.launches;
    let slot = &mut pool.slots[index];
    // SAFETY: the staging holds `capacity >= bytes` bytes of page-locked memory, page
    // aligned (so aligned for u64), that nothing reads or writes: the slot is idle (its last
    // upload completed) and the pool's mutex, held until its event is recorded below, keeps
    // every other gather out of it.
    let table = unsafe { std::slice::from_raw_parts_mut(slot.host.cast::<u64>(), 3 * count) };
    for (entry, piece) in table.chunks_exact_mut(3).zip((0..runs).flat_map(run)) {
        entry.copy_from_slice(&piece);
    }
    let (host, device) = (slot.host, slot.device);
    let filled_at = started.elapsed();
    // SAFETY: both tables are the slot's, `bytes` long at least; the staging is pinned and
    // is not written again until the event recorded below has passed, the device table not
    // freed before then either.
    let uploaded = unsafe { super::raw::memcpy_htod_async(device, host, bytes, stream.handle()) };
    let queued = uploaded.is_ok();
    // SAFETY: the table holds `count` runs, uploaded just before in stream order; the runs
    // are valid as the caller says.
    let launched =
        uploaded.and_then(|()| unsafe { launch(function, device, blocks, stream.handle()) });
    // Whatever was queued reads the slot: its event goes after it.
    let settled = if queued {
        // SAFETY: the stream is live and of the pool's context, which is current.
        unsafe { settle(&mut pool, index, number, stream) }
    } else {
        Ok(())
    };
    drop(pool);
    launched?;
    settled?;
    tracing::trace!(
        target: "ferry::blocks",
        runs,
        pieces = count,
        table_bytes = bytes,
        waited_for_slot = waited,
        slot_us = slot_at.as_micros() as u64,
        fill_us = (filled_at - slot_at).as_micros() as u64,
        queue_us = (started.elapsed() - filled_at).as_micros() as u64,
        "gather queued"
    );
    Ok(true)
}

/// Records slot `index`'s event on `stream` after the work just queued that reads it, as
/// gather number `number`. When the record fails, the stream is waited for instead (the
/// slot is idle again once that returns); when that fails too, the slot is given up (its
/// memory leaked, never freed or written while a queued copy may read it).
///
/// # Safety
/// `stream` is live and of the pool's context, which is current.
unsafe fn settle(
    pool: &mut Pool,
    index: usize,
    number: u64,
    stream: &Stream,
) -> Result<(), CudaError> {
    let slot = &mut pool.slots[index];
    // SAFETY: the slot's event and the stream are live and of the same context (caller).
    match unsafe { super::raw::event_record(slot.event, stream.handle()) } {
        Ok(()) => {
            slot.used = number;
            Ok(())
        }
        Err(e) => {
            // SAFETY: the stream is live (caller).
            if unsafe { super::raw::stream_synchronize(stream.handle()) }.is_err() {
                // Dropping a slot frees nothing: its tables and event are leaked, and the
                // module stays loaded (its launch may still run).
                let _leaked = pool.slots.swap_remove(index);
                pool.unsettled = true;
            }
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{PIECE, pieces};

    /// Pieces cover a run exactly, in order, none longer than [`PIECE`]; aligned runs keep
    /// their odd bytes to a last piece of their own, so every other piece is whole 16-byte
    /// words.
    #[test]
    fn pieces_cover_a_run_exactly() {
        for (dst, src, len) in [
            (0x1000, 0x9000, 0),
            (0x1000, 0x9000, 8),
            (0x1000, 0x9000, PIECE),
            (0x1000, 0x9000, 3 * PIECE + 37),
            (0x1003, 0x9000, 2 * PIECE + 5),
            (0x1000, 0x9000, (1 << 20) + 13),
        ] {
            let got: Vec<[u64; 3]> = pieces(dst, src, len).collect();
            let mut at = 0;
            for (i, &[d, s, n]) in got.iter().enumerate() {
                assert_eq!((d, s), (dst + at, src + at), "piece {i} of {len}");
                assert!(n > 0 && n <= PIECE, "piece {i} of {len}: {n} bytes");
                let last = i + 1 == got.len();
                if (dst | src) % 16 == 0 && !(last && len % 16 != 0) {
                    assert_eq!(n % 16, 0, "piece {i} of {len} is not whole words");
                }
                at += n;
            }
            assert_eq!(at, len, "pieces of {len} bytes");
        }
    }
}
