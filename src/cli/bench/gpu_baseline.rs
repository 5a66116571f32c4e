//! The raw CUDA baselines the bench measures ferry against, in this process: a copy between
//! the two GPUs, the same rows by one 2D copy or one copy per row, and host staging.

use std::time::Instant;

use anyhow::Context;

use super::GpuPair;

/// One direction of the copy baseline: a source on one GPU, a destination on the other, and
/// a stream of the destination's GPU that copies.
struct CopyLane {
    src: ferry::cuda::DeviceBuffer,
    dst: ferry::cuda::DeviceBuffer,
    stream: ferry::cuda::Stream,
}

/// `cuMemcpyAsync` from GPU `gpus.ours` to GPU `gpus.theirs` (and back at the same time with
/// `bidir`) in this process: `warmup` untimed copies, then `iters` timed ones queued `window`
/// at a time on a stream of the destination GPU, waiting for each batch, as ferry has at most
/// `window` transfers in flight: GB/s. Blocks.
pub(super) fn copy_baseline(
    gpus: GpuPair,
    len: usize,
    iters: u64,
    warmup: u64,
    window: u64,
    bidir: bool,
) -> anyhow::Result<f64> {
    use ferry::cuda::{Device, ExportablePool, Stream};
    let ours = Device::open(gpus.ours as usize)?;
    let theirs = Device::open(gpus.theirs as usize)?;
    let pool_ours = ExportablePool::new(&ours)?;
    let pool_theirs = ExportablePool::new(&theirs)?;
    // Each stream reads the other GPU's pool (no-ops on one GPU).
    pool_ours.grant_access(&theirs)?;
    pool_theirs.grant_access(&ours)?;
    let lane = |from: &ExportablePool, to: &ExportablePool| -> anyhow::Result<CopyLane> {
        let stream = Stream::new(to.device())?;
        let src_stream = Stream::new(from.device())?;
        let src = from.alloc(len, &src_stream)?;
        // The source was allocated in the order of its own stream: done before use here.
        src_stream.synchronize()?;
        let dst = to.alloc(len, &stream)?;
        Ok(CopyLane { src, dst, stream })
    };
    let mut lanes = vec![lane(&pool_ours, &pool_theirs)?];
    if bidir {
        lanes.push(lane(&pool_theirs, &pool_ours)?);
    }
    copy_batches(&mut lanes, warmup, window)?;
    let started = Instant::now();
    copy_batches(&mut lanes, iters, window)?;
    let took = started.elapsed().as_secs_f64().max(1e-9);
    Ok(lanes.len() as f64 * (len as u64 * iters) as f64 / took / 1e9)
}

/// The strided baselines between the same two GPUs: the layout's rows gathered by raw 3D
/// copies (`cuMemcpy3DAsync`, as ferry's copies are) from a source on our GPU into a packed
/// buffer on theirs, and the same rows moved by one `cuMemcpyAsync` each; GB/s of packed
/// bytes, each over `iters` transfers after `warmup`, `window` queued at a time. Blocks.
pub(super) fn strided_baseline(
    gpus: GpuPair,
    layout: ferry::Layout,
    iters: u64,
    warmup: u64,
    window: u64,
) -> anyhow::Result<(f64, f64)> {
    use ferry::cuda::{Device, ExportablePool, Stream};
    let extent = layout.extent()?.context("a strided layout has an extent")?;
    let packed = layout.check(extent)?;
    let boxes = layout.boxes(extent, 0, packed)?;
    let ours = Device::open(gpus.ours as usize)?;
    let theirs = Device::open(gpus.theirs as usize)?;
    let pool_ours = ExportablePool::new(&ours)?;
    let pool_theirs = ExportablePool::new(&theirs)?;
    pool_ours.grant_access(&theirs)?;
    let stream = Stream::new(&theirs)?;
    let src_stream = Stream::new(&ours)?;
    let src = pool_ours.alloc(usize::try_from(extent)?, &src_stream)?;
    src_stream.synchronize()?;
    let mut dst = pool_theirs.alloc(usize::try_from(packed)?, &stream)?;
    let timed = |dst: &mut ferry::cuda::DeviceBuffer,
                 copy: &dyn Fn(&mut ferry::cuda::DeviceBuffer) -> anyhow::Result<()>|
     -> anyhow::Result<f64> {
        for round in [warmup, iters] {
            let started = Instant::now();
            let mut left = round;
            while left > 0 {
                for _ in 0..left.min(window.max(1)) {
                    copy(dst)?;
                }
                stream.synchronize()?;
                left = left.saturating_sub(window.max(1));
            }
            if round == iters {
                let took = started.elapsed().as_secs_f64().max(1e-9);
                return Ok((packed * iters) as f64 / took / 1e9);
            }
        }
        Ok(0.0)
    };
    let raw = timed(&mut dst, &|dst| {
        ferry::cuda::copy_boxes_async(dst, 0, &src, 0, &boxes, &stream)?;
        Ok(())
    })?;
    let rows: Vec<(u64, u64, u64)> = boxes
        .iter()
        .flat_map(|b| b.rows().collect::<Vec<_>>())
        .collect();
    let per_row = timed(&mut dst, &|dst| {
        for &(at, to, n) in &rows {
            ferry::cuda::copy_async(dst, to as usize, &src, at as usize, n as usize, &stream)?;
        }
        Ok(())
    })?;
    Ok((raw, per_row))
}

/// The staged transport's limits between the same two GPUs, in this process: GB/s of raw
/// copies from a buffer on our GPU into pinned host memory (by the layout's 3D copies, as
/// ferry's are, for a strided layout) and from pinned host memory into a buffer on theirs,
/// each over `iters` copies after `warmup`, `window` queued at a time; for a strided
/// layout, also the rows copied out one `cuMemcpyDtoHAsync` each. Blocks.
pub(super) fn staging_baseline(
    gpus: GpuPair,
    layout: ferry::Layout,
    size: u64,
    iters: u64,
    warmup: u64,
    window: u64,
) -> anyhow::Result<(f64, f64, Option<f64>)> {
    use ferry::cuda::{Device, ExportablePool, PinnedBuffer, Stream};
    let extent = layout.extent()?.unwrap_or(size);
    let packed = layout.check(extent)?;
    let boxes = layout.boxes(extent, 0, packed)?;
    let ours = Device::open(gpus.ours as usize)?;
    let theirs = Device::open(gpus.theirs as usize)?;
    let (pool_ours, pool_theirs) = (ExportablePool::new(&ours)?, ExportablePool::new(&theirs)?);
    let (down_stream, up_stream) = (Stream::new(&ours)?, Stream::new(&theirs)?);
    let src = pool_ours.alloc(usize::try_from(extent)?, &down_stream)?;
    let mut dst = pool_theirs.alloc(usize::try_from(packed)?, &up_stream)?;
    let mut pinned = PinnedBuffer::new(&ours, usize::try_from(packed)?)?;
    down_stream.synchronize()?;
    up_stream.synchronize()?;
    let timed =
        |copy: &mut dyn FnMut() -> anyhow::Result<()>, stream: &Stream| -> anyhow::Result<f64> {
            let mut rate = 0.0;
            for round in [warmup, iters] {
                let started = Instant::now();
                let mut left = round;
                while left > 0 {
                    for _ in 0..left.min(window.max(1)) {
                        copy()?;
                    }
                    stream.synchronize()?;
                    left = left.saturating_sub(window.max(1));
                }
                rate = (packed * round) as f64 / started.elapsed().as_secs_f64().max(1e-9) / 1e9;
            }
            Ok(rate)
        };
    let len = usize::try_from(packed)?;
    let contiguous = layout.is_contiguous();
    let down = timed(
        &mut || {
            if contiguous {
                ferry::cuda::copy_to_pinned_async(&mut pinned, 0, &src, 0, len, &down_stream)?;
            } else {
                let host = pinned.host_mut()?;
                ferry::cuda::copy_boxes_to_host(host, &src, 0, &boxes, &down_stream)?;
            }
            Ok(())
        },
        &down_stream,
    )?;
    let up = timed(
        &mut || {
            ferry::cuda::copy_from_pinned_async(&mut dst, 0, &pinned, 0, len, &up_stream)?;
            Ok(())
        },
        &up_stream,
    )?;
    let per_row = if contiguous {
        None
    } else {
        let rows: Vec<(u64, u64, u64)> = boxes
            .iter()
            .flat_map(|b| b.rows().collect::<Vec<_>>())
            .collect();
        Some(timed(
            &mut || {
                for &(at, to, n) in &rows {
                    ferry::cuda::copy_to_pinned_async(
                        &mut pinned,
                        to as usize,
                        &src,
                        at as usize,
                        n as usize,
                        &down_stream,
                    )?;
                }
                Ok(())
            },
            &down_stream,
        )?)
    };
    Ok((down, up, per_row))
}

/// `count` copies on every lane, `window` queued at a time, then waits for them.
fn copy_batches(lanes: &mut [CopyLane], count: u64, window: u64) -> anyhow::Result<()> {
    let mut left = count;
    while left > 0 {
        let batch = left.min(window.max(1));
        for lane in lanes.iter_mut() {
            let len = ferry::cuda::DeviceMemory::len(&lane.src);
            for _ in 0..batch {
                ferry::cuda::copy_async(&mut lane.dst, 0, &lane.src, 0, len, &lane.stream)?;
            }
        }
        for lane in lanes.iter() {
            lane.stream.synchronize()?;
        }
        left -= batch;
    }
    Ok(())
}
