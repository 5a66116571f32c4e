//! Copies of a layout's boxes: strided rows gathered into packed bytes and scattered back
//! ([`copy_boxes_async`], [`scatter_boxes_async`] and their host forms), one 3D copy per box
//! of several rows, and the runs of a block list queued as one batch where the driver has
//! one ([`block_copies`]).

use super::super::stream::Stream;
use super::super::{gather, raw};
use super::{CudaError, DeviceMemory, range};
use crate::wire::RowBox;

/// The 3D-copy shape of `b` read at its pitches and written packed, after checking that it
/// lies inside `slen` bytes from `src_offset` and `dlen` bytes from `dst_offset`.
fn box_shape(
    b: &RowBox,
    src_offset: usize,
    slen: usize,
    dst_offset: usize,
    dlen: usize,
) -> Result<raw::BoxShape, CudaError> {
    let bad = || CudaError::Misuse(format!("a box of rows past its buffer: {b:?}"));
    let n = |v: u64| usize::try_from(v).map_err(|_| bad());
    if b.width == 0 || b.rows == 0 || b.planes == 0 || b.pitch < b.width {
        return Err(bad());
    }
    if b.rows == 1 && b.planes == 1 {
        // One run (a block list's block): no pitches to check, and none of the divisions
        // below, which cost more than the rest at a thousand blocks a copy.
        let (width, src) = (n(b.width)?, n(b.src)?);
        range(
            "source",
            src_offset,
            src.checked_add(width).ok_or_else(bad)?,
            slen,
        )?;
        let at = dst_offset.checked_add(n(b.packed)?).ok_or_else(bad)?;
        range("destination", at, width, dlen)?;
        return Ok(raw::BoxShape {
            width,
            height: 1,
            depth: 1,
            src_pitch: n(b.pitch)?,
            src_plane_rows: 1,
            dst_pitch: width,
            dst_plane_rows: 1,
        });
    }
    if b.plane_pitch % b.pitch != 0 || b.plane_pitch / b.pitch < b.rows {
        return Err(bad());
    }
    // One past the last byte read: the last row of the last plane.
    let last = (b.planes - 1)
        .checked_mul(b.plane_pitch)
        .and_then(|p| p.checked_add((b.rows - 1).checked_mul(b.pitch)?))
        .and_then(|p| p.checked_add(b.src))
        .and_then(|p| p.checked_add(b.width))
        .ok_or_else(bad)?;
    range("source", src_offset, n(last)?, slen)?;
    let at = dst_offset.checked_add(n(b.packed)?).ok_or_else(bad)?;
    range("destination", at, n(b.len())?, dlen)?;
    Ok(raw::BoxShape {
        width: n(b.width)?,
        height: n(b.rows)?,
        depth: n(b.planes)?,
        src_pitch: n(b.pitch)?,
        src_plane_rows: n(b.plane_pitch / b.pitch)?,
        dst_pitch: n(b.width)?,
        dst_plane_rows: n(b.rows)?,
    })
}

/// Where one side of a box copy begins: a device address or a host pointer.
#[derive(Clone, Copy)]
enum Base {
    Device(u64),
    Host(*mut u8),
}

impl Base {
    fn at(self, offset: u64) -> raw::Place {
        match self {
            Base::Device(p) => raw::Place::Device(p + offset),
            // Bounds were checked by `box_shape`; `wrapping_add` only computes the address.
            Base::Host(p) => raw::Place::Host(p.wrapping_add(offset as usize)),
        }
    }
}

/// Which way a box copy goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    /// From the strided rows into packed bytes.
    Gather,
    /// From packed bytes back to the strided rows.
    Scatter,
}

/// Queues the copies of `boxes` between strided rows (`slen` bytes from `strided`) and their
/// packed bytes (`plen` bytes from `packed`), the way `way` says, after checking every box
/// against both memories (see `box_shape`): one 3D copy per box of several rows, a plain copy
/// per run (a box of one row: a part of a row, a block of a block list), the runs between
/// device memories as one batch where the driver has one (see [`block_copies`]). A failure
/// after some copies were queued waits for those before it returns. Returns whether
/// anything was queued.
///
/// # Safety
/// Both memories stay valid (host memory untouched by anyone else) until the copies
/// complete on `stream`.
unsafe fn copy_boxes(
    strided: (Base, usize),
    packed: (Base, usize),
    way: Way,
    boxes: &[RowBox],
    stream: &Stream,
    one_gpu: bool,
) -> Result<bool, CudaError> {
    let ((sbase, slen), (pbase, plen)) = (strided, packed);
    let started = std::time::Instant::now();
    let shapes = boxes
        .iter()
        .map(|b| box_shape(b, 0, slen, 0, plen).map(|s| (b, s)))
        .collect::<Result<Vec<_>, _>>()?;
    if shapes.is_empty() {
        return Ok(false);
    }
    let shaped = started.elapsed();
    stream.bind()?;
    let bound = started.elapsed();
    let mut runs = Runs {
        dsts: Vec::with_capacity(shapes.len()),
        srcs: Vec::with_capacity(shapes.len()),
        sizes: Vec::with_capacity(shapes.len()),
        one_gpu,
    };
    for (b, shape) in shapes {
        let (rows, packed) = (sbase.at(b.src), pbase.at(b.packed));
        let (dst, src, shape) = match way {
            Way::Gather => (packed, rows, shape),
            Way::Scatter => (
                rows,
                packed,
                raw::BoxShape {
                    src_pitch: shape.dst_pitch,
                    src_plane_rows: shape.dst_plane_rows,
                    dst_pitch: shape.src_pitch,
                    dst_plane_rows: shape.src_plane_rows,
                    ..shape
                },
            ),
        };
        let queued = if shape.height == 1 && shape.depth == 1 {
            // SAFETY: the run lies inside both memories (checked above), which stay valid
            // (caller).
            unsafe { runs.add(dst, src, shape.width, stream) }
        } else {
            // SAFETY: the box's rows lie inside both memories (checked above), which stay
            // valid (caller).
            unsafe { raw::memcpy_box_async(dst, src, shape, stream.handle()) }
        };
        if let Err(e) = queued {
            let _ = stream.synchronize();
            return Err(e);
        }
    }
    let added = started.elapsed();
    let count = runs.sizes.len();
    // SAFETY: as each run's, above.
    if let Err(e) = unsafe { runs.flush(stream, 2) } {
        let _ = stream.synchronize();
        return Err(e);
    }
    tracing::trace!(
        target: "ferry::blocks",
        boxes = boxes.len(),
        runs = count,
        shapes_us = shaped.as_micros() as u64,
        bind_us = (bound - shaped).as_micros() as u64,
        add_us = (added - bound).as_micros() as u64,
        flush_us = (started.elapsed() - added).as_micros() as u64,
        "boxes queued: shapes, bind, runs added, flushed (the gather or the batch)"
    );
    Ok(true)
}

/// How the runs of a copy (a block list's blocks) between device memories are queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BlockCopies {
    /// All of one copy's runs in one `cuMemcpyBatchAsync` (drivers of CUDA 12.8 and later).
    Batched,
    /// One `cuMemcpyAsync` per run: the driver has no `cuMemcpyBatchAsync`, or it refused
    /// a batch in this process (logged once).
    PerRun,
}

/// Set when the driver refused a batch: this process copies run by run from then on.
static BATCH_REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// How this process copies a block list's blocks between device memories (what `ferry
/// doctor` reports): [`BlockCopies::Batched`] where the driver has `cuMemcpyBatchAsync`.
pub fn block_copies() -> BlockCopies {
    if raw::has_memcpy_batch() && !BATCH_REFUSED.load(std::sync::atomic::Ordering::Relaxed) {
        BlockCopies::Batched
    } else {
        BlockCopies::PerRun
    }
}

/// The runs of one [`copy_boxes`] between device memories, gathered for one batch; a run
/// with host memory on either side is queued at once.
#[derive(Default)]
pub(super) struct Runs {
    pub(super) dsts: Vec<u64>,
    pub(super) srcs: Vec<u64>,
    pub(super) sizes: Vec<usize>,
    /// Both memories and the stream are of one GPU: the runs may go to the gather kernel.
    pub(super) one_gpu: bool,
}

impl Runs {
    /// # Safety
    /// `[dst, dst+len)` and `[src, src+len)` lie in memory that stays valid until the copies
    /// complete on `stream` (host memory untouched by anyone else meanwhile).
    unsafe fn add(
        &mut self,
        dst: raw::Place,
        src: raw::Place,
        len: usize,
        stream: &Stream,
    ) -> Result<(), CudaError> {
        use raw::Place::{Device, Host};
        let s = stream.handle();
        // SAFETY (each arm): caller.
        match (dst, src) {
            (Device(d), Device(from)) => {
                self.dsts.push(d);
                self.srcs.push(from);
                self.sizes.push(len);
                Ok(())
            }
            (Device(d), Host(from)) => unsafe { raw::memcpy_htod_async(d, from, len, s) },
            (Host(d), Device(from)) => unsafe { raw::memcpy_dtoh_async(d, from, len, s) },
            (Host(_), Host(_)) => Err(CudaError::Misuse(
                "a copy of boxes with host memory on both sides".into(),
            )),
        }
    }

    /// Queues the gathered device runs: as one launch of the gather kernel when `one_gpu`
    /// and there are at least `gather_from` (and it loads), else one batch when the driver
    /// has one and there are several, else one copy each. Returns whether the kernel took
    /// them. A batch the driver refuses is queued again run by run (the same bytes to the
    /// same places), and the process stops batching.
    ///
    /// # Safety
    /// As [`Runs::add`], for every run added; the stream's context is current.
    pub(super) unsafe fn flush(
        mut self,
        stream: &Stream,
        gather_from: usize,
    ) -> Result<bool, CudaError> {
        // SAFETY: caller; `one_gpu` says the stream's GPU holds both memories.
        if self.one_gpu
            && self.sizes.len() >= gather_from.max(1)
            && unsafe { gather::gather_async(&self.dsts, &self.srcs, &self.sizes, stream) }?
        {
            return Ok(true);
        }
        if self.sizes.len() > 1 && block_copies() == BlockCopies::Batched {
            // SAFETY: caller; device memory on both sides, destinations disjoint (packed
            // bytes, or a destination layout checked not to overlap), a stream of ours
            // (never the legacy default stream).
            let batched = unsafe {
                raw::memcpy_batch_async(
                    &mut self.dsts,
                    &mut self.srcs,
                    &mut self.sizes,
                    stream.handle(),
                )
            };
            match batched {
                Ok(()) => return Ok(false),
                Err(e) => {
                    if !BATCH_REFUSED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        tracing::warn!(
                            error = %e,
                            "the driver refused a batch of copies: block lists are copied \
                             one run at a time in this process"
                        );
                    }
                }
            }
        }
        for ((&d, &from), &len) in self.dsts.iter().zip(&self.srcs).zip(&self.sizes) {
            // SAFETY: caller.
            unsafe { raw::memcpy_async(d, from, len, stream.handle()) }?;
        }
        Ok(false)
    }
}

/// `memory` from `offset` on, as a copy side: its base and the bytes left.
fn device_side(memory: &impl DeviceMemory, offset: usize) -> Result<(Base, usize), CudaError> {
    let (ptr, len) = memory.region();
    let left = len
        .checked_sub(offset)
        .ok_or_else(|| CudaError::Misuse(format!("offset {offset} past {len} bytes")))?;
    Ok((Base::Device(ptr + offset as u64), left))
}

/// Gathers the rows of `boxes` (a layout's, see [`crate::wire::Layout::boxes`]) out of
/// `src` from `src_offset` on, packed into `dst` from `dst_offset` on: one 3D copy per box
/// of several rows, the copy engine walking the rows (never a copy per row); the boxes of
/// one row (a block list's blocks) as one batch of copies where the driver has
/// `cuMemcpyBatchAsync` ([`block_copies`]). Returns once queued; both stay allocated until
/// the copies complete.
///
/// # Errors
/// [`CudaError::Misuse`] for a box outside either buffer; a driver error otherwise.
pub fn copy_boxes_async(
    dst: &mut impl DeviceMemory,
    dst_offset: usize,
    src: &impl DeviceMemory,
    src_offset: usize,
    boxes: &[RowBox],
    stream: &Stream,
) -> Result<(), CudaError> {
    let (rows, packed) = (device_side(src, src_offset)?, device_side(dst, dst_offset)?);
    let started = std::time::Instant::now();
    let one_gpu = src.device().same_as(dst.device()) && stream.device().same_as(dst.device());
    let compared = started.elapsed();
    // SAFETY: both are live allocations; the uses recorded below keep them allocated until
    // the copies passed.
    if unsafe { copy_boxes(rows, packed, Way::Gather, boxes, stream, one_gpu) }? {
        let queued = started.elapsed();
        dst.note_use(stream)?;
        src.note_use(stream)?;
        tracing::trace!(
            target: "ferry::blocks",
            one_gpu,
            same_as_us = compared.as_micros() as u64,
            copy_us = (queued - compared).as_micros() as u64,
            note_use_us = (started.elapsed() - queued).as_micros() as u64,
            "gather of boxes queued: devices compared, copies, uses noted"
        );
    }
    Ok(())
}

/// [`copy_boxes_async`] into host memory (`dst`, from its start), waited for.
///
/// # Errors
/// As [`copy_boxes_async`].
pub fn copy_boxes_to_host(
    dst: &mut [u8],
    src: &impl DeviceMemory,
    src_offset: usize,
    boxes: &[RowBox],
    stream: &Stream,
) -> Result<(), CudaError> {
    let rows = device_side(src, src_offset)?;
    let packed = (Base::Host(dst.as_mut_ptr()), dst.len());
    // SAFETY: a live allocation, and `dst`, borrowed mutably until the stream is
    // synchronised (below, or on a failure), so nothing else touches it meanwhile.
    if unsafe { copy_boxes(rows, packed, Way::Gather, boxes, stream, false) }? {
        src.note_use(stream)?;
        stream.synchronize()?;
    }
    Ok(())
}

/// Puts packed bytes back where a layout's boxes say (the inverse of
/// [`copy_boxes_async`]): `src` holds them from `src_offset` on, `dst` is the strided
/// buffer (the places of a block list's blocks: they must not overlap, see
/// [`crate::wire::Layout::check_destination`]). Copied as [`copy_boxes_async`] copies;
/// returns once queued.
///
/// # Errors
/// [`CudaError::Misuse`] for a box outside either buffer; a driver error otherwise.
pub fn scatter_boxes_async(
    dst: &mut impl DeviceMemory,
    src: &impl DeviceMemory,
    src_offset: usize,
    boxes: &[RowBox],
    stream: &Stream,
) -> Result<(), CudaError> {
    let (rows, packed) = (device_side(dst, 0)?, device_side(src, src_offset)?);
    let one_gpu = src.device().same_as(dst.device()) && stream.device().same_as(dst.device());
    // SAFETY: both are live allocations; the uses recorded below keep them allocated until
    // the copies passed.
    if unsafe { copy_boxes(rows, packed, Way::Scatter, boxes, stream, one_gpu) }? {
        dst.note_use(stream)?;
        src.note_use(stream)?;
    }
    Ok(())
}

/// [`scatter_boxes_async`] from packed bytes in host memory (`src`, from its start),
/// waited for.
///
/// # Errors
/// As [`scatter_boxes_async`].
pub fn scatter_boxes_from_host(
    dst: &mut impl DeviceMemory,
    src: &[u8],
    boxes: &[RowBox],
    stream: &Stream,
) -> Result<(), CudaError> {
    let rows = device_side(dst, 0)?;
    // The copies only read through the pointer.
    let packed = (Base::Host(src.as_ptr().cast_mut()), src.len());
    // SAFETY: a live allocation, and `src`, borrowed until the stream is synchronised
    // (below, or on a failure).
    if unsafe { copy_boxes(rows, packed, Way::Scatter, boxes, stream, false) }? {
        dst.note_use(stream)?;
        stream.synchronize()?;
    }
    Ok(())
}
