//! Pushes: our buffer written into the one the peer lent.

use crate::cuda::{DeviceMemory, ImportedPool, copy_async, copy_boxes_async};
use crate::gpus::Gpus;
use crate::memory::SharedBytes;
use crate::wire::Layout;

use super::IpcSource;
use super::error::{IpcError, at, no_stream};
use super::pull::*;

/// Writes `source` (our device buffer) into the peer's buffer `target` (an ipc push) and
/// waits until every byte is there. The target is imported from the peer's `pool` with no
/// copy of this node in flight (as a pull's source is), copied into on the copy stream of
/// `source`'s device, and its import is freed before this returns, so the peer may reuse its
/// buffer as soon as it hears `Written`: nothing is cached, and no unmap protocol runs in
/// reverse. Blocking: call it on a blocking thread.
///
/// # Errors
/// Why the bytes could not be written (the target is not pool memory, its import failed,
/// the peer claims a buffer shorter than the transfer, or the copy failed).
pub fn push(
    target: &IpcSource,
    pool: &ImportedPool,
    gpus: &Gpus,
    source: &SharedBytes,
    layout: &Layout,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<(), IpcError> {
    if target.legacy.is_some() {
        return Err(IpcError::BadDescriptor(
            "the receiver lent memory that is not from its pool".into(),
        ));
    }
    let memory = source
        .device_memory()
        .ok_or_else(|| IpcError::Unsupported("only device memory is pushed over ipc".into()))?;
    // What moves: the layout's rows, packed (the whole buffer when contiguous).
    let len = usize::try_from(
        layout
            .check(source.len() as u64)
            .map_err(|e| IpcError::BadDescriptor(format!("the buffer's layout: {e}")))?,
    )
    .map_err(|e| IpcError::Unsupported(e.to_string()))?;
    let boxes = match layout {
        Layout::Contiguous => None,
        strided => Some(
            strided
                .boxes(source.len() as u64, 0, len as u64)
                .map_err(|e| IpcError::BadDescriptor(format!("the buffer's layout: {e}")))?,
        ),
    };
    let export = export_bytes(target)?;
    let (offset, end) = source_range(target, len)?;
    let started = std::time::Instant::now();
    let mut imported = {
        let _quiet = gpus
            .drain_copies()
            .map_err(at("waiting for the copies in flight"))?;
        // The transfer may have ended while this waited for the copies: nothing is written.
        if stop.load(std::sync::atomic::Ordering::Acquire) {
            return Err(IpcError::Gone(
                "the transfer ended before its copy started".into(),
            ));
        }
        pool.import_pointer(export, end)
            .map_err(at("importing the receiver's buffer"))?
    };
    let imported_at = started.elapsed();
    let stream = gpus
        .copy_stream(memory.device(), false)
        .ok_or_else(no_stream)?;
    {
        let _copying = gpus.copying();
        match &boxes {
            None => copy_async(&mut imported, offset, memory, 0, len, &stream),
            Some(boxes) => copy_boxes_async(&mut imported, offset, memory, 0, boxes, &stream),
        }
        .map_err(at("copying into the receiver's buffer"))?;
    }
    stream
        .synchronize()
        .map_err(at("finishing the copy into the receiver's buffer"))?;
    let copied_at = started.elapsed();
    // Freed now (the copy has completed): the receiver may free its buffer once told. Not
    // under the mapping lock, as the owner-requested unmaps of pulled buffers are not: the
    // fault that lock prevents came from imports, and draining before frees did not change
    // it (docs/PERFORMANCE.md, "Fifth run").
    drop(imported);
    tracing::trace!(
        bytes = len,
        import_us = imported_at.as_micros() as u64,
        copy_us = (copied_at - imported_at).as_micros() as u64,
        free_us = (started.elapsed() - copied_at).as_micros() as u64,
        "pushed"
    );
    tracing::trace!(
        target: crate::TRACE_BLOCKS,
        blocks = crate::block_count(layout),
        bytes = len,
        import_us = imported_at.as_micros() as u64,
        copy_us = (copied_at - imported_at).as_micros() as u64,
        "pushed: import, copy (queued and waited for)"
    );
    Ok(())
}
