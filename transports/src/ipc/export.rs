//! Exports: our buffer as a peer reads it, and buffers offered to nodes of this process.

use crate::cuda::{Device, DeviceMemory, POINTER_EXPORT_LEN};
use crate::gpus::Gpus;
use crate::memory::{Buffer, SharedBytes};
use crate::wire::Layout;

use super::error::{IpcError, at};
use super::imports::*;
use super::pull::*;
use super::{IpcBufferRef, IpcSource};

/// The export of a buffer for an ipc pull: its device's UUID, its lease and the pointer
/// export (the legacy IPC handle for registered memory). For a node of this process
/// (`in_process`) nothing is exported: it reads the buffer itself.
///
/// # Errors
/// When the buffer is not device memory, or the driver refuses the export.
pub fn export_source(buffer: &Buffer, in_process: bool) -> Result<IpcSource, IpcError> {
    if buffer.is_empty() && matches!(buffer.kind(), crate::memory::MemoryKind::Device(_)) {
        // No bytes to read, and no device memory behind an empty buffer: the receiver
        // copies nothing (`pull` returns at once), so the export names nothing.
        let lease = buffer.lease();
        return Ok(IpcSource {
            device_uuid: String::new(),
            pool: String::new(),
            buffer: lease.id.0,
            generation: lease.generation.0,
            offset: 0,
            export: Vec::new(),
            legacy: None,
        });
    }
    let memory = buffer.device_memory().ok_or_else(|| {
        IpcError::Unsupported(format!("{} memory cannot cross ipc", buffer.kind()))
    })?;
    let started = std::time::Instant::now();
    let (export, offset, legacy) = if in_process {
        ([0; POINTER_EXPORT_LEN], 0, None)
    } else if memory.is_external() {
        let legacy = memory
            .export_legacy()
            .map_err(at("exporting the registered memory"))?;
        (legacy.handle, legacy.offset, Some(legacy.buffer_id))
    } else {
        let export = memory
            .export_pointer()
            .map_err(at("exporting the buffer"))?;
        (export, 0, None)
    };
    tracing::trace!(
        bytes = memory.len(),
        us = started.elapsed().as_micros() as u64,
        "exported"
    );
    let lease = buffer.lease();
    Ok(IpcSource {
        device_uuid: memory.device().uuid().to_string(),
        pool: memory.pool_name().unwrap_or_default().to_string(),
        buffer: lease.id.0,
        generation: lease.generation.0,
        offset,
        export: export.to_vec(),
        legacy,
    })
}

/// Buffers offered for pulling to a node of this same process, by exporting node and
/// buffer: the receiving node copies straight from them (a peer copy between the two GPUs,
/// or within one), with nothing imported. Each entry lives while its transfers' views do:
/// one buffer may be offered by several transfers at once (a published buffer fetched
/// twice), so an entry counts its offers.
static IN_PROCESS: std::sync::LazyLock<
    dashmap::DashMap<(String, IpcBufferRef), (SharedBytes, usize)>,
> = std::sync::LazyLock::new(dashmap::DashMap::new);

/// How a peer names our device buffer under `lease` on `device` (in offers and unmaps).
pub fn lease_ref(device: &Device, lease: &crate::memory::Lease) -> IpcBufferRef {
    IpcBufferRef {
        device_uuid: device.uuid().to_string(),
        buffer: lease.id.0,
        generation: lease.generation.0,
    }
}

/// The key of `view`'s buffer, as the receiver names it from the offer.
pub(crate) fn in_process_key(node: &str, view: &SharedBytes) -> Option<(String, IpcBufferRef)> {
    let memory = view.device_memory()?;
    Some((node.to_string(), lease_ref(memory.device(), &view.lease())))
}

/// Makes `view` (offered by `node`) readable by the nodes of this process.
pub fn offer_in_process(node: &str, view: SharedBytes) {
    if let Some(key) = in_process_key(node, &view) {
        IN_PROCESS
            .entry(key)
            .and_modify(|(_, offers)| *offers += 1)
            .or_insert((view, 1));
    }
}

/// The offer of `view` by `node` ended (the peer said Done, cancelled, or is gone).
pub fn withdraw_in_process(node: &str, view: &SharedBytes) {
    if let Some(key) = in_process_key(node, view) {
        IN_PROCESS.remove_if_mut(&key, |_, (_, offers)| {
            *offers = offers.saturating_sub(1);
            *offers == 0
        });
    }
}

/// The pull of a buffer `exporter`, a node of this process, offered: a copy straight from
/// its memory into `dst`, waited for. Blocking (a few microseconds when `express`).
///
/// # Errors
/// When the offer is gone (the transfer ended meanwhile) or the copy fails; `dst` comes
/// back with the error.
pub fn pull_in_process(
    exporter: &str,
    source: &IpcSource,
    layout: &Layout,
    gpus: &Gpus,
    mut dst: Buffer,
    express: bool,
) -> Result<Buffer, (Buffer, IpcError)> {
    if dst.is_empty() {
        return Ok(dst);
    }
    let key = (exporter.to_string(), buffer_ref(source));
    // A clone of the view: the memory stays allocated through the copy whatever happens
    // to the offer meanwhile.
    let Some(view) = IN_PROCESS.get(&key).map(|v| v.0.clone()) else {
        return Err((
            dst,
            IpcError::Gone(format!("{exporter} no longer offers that buffer")),
        ));
    };
    let result = (|| {
        let memory = view.device_memory().ok_or_else(|| {
            IpcError::Unsupported("the offered buffer is not device memory".into())
        })?;
        let started = std::time::Instant::now();
        let (offset, _, boxes) = source_span(source, layout, dst.len())?;
        let span_at = started.elapsed();
        let (stream, _) = queue_copy(
            &mut dst,
            memory,
            offset,
            boxes.as_deref(),
            gpus,
            express,
            None,
        )?;
        let queued_at = started.elapsed();
        finish_copy(&stream)?;
        let total = started.elapsed();
        tracing::trace!(
            target: crate::TRACE_BLOCKS,
            blocks = crate::block_count(layout),
            bytes = dst.len(),
            span_us = span_at.as_micros() as u64,
            queue_us = (queued_at - span_at).as_micros() as u64,
            wait_us = (total - queued_at).as_micros() as u64,
            "in-process pull copied: span (layout to runs), queue (the gather), wait (sync)"
        );
        Ok(())
    })();
    drop(view);
    match result {
        Ok(()) => Ok(dst),
        Err(why) => Err((dst, why)),
    }
}
