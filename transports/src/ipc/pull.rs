//! Pulls: the peer's buffer (pool memory, or memory it registered) copied into ours on a
//! copy stream of the landing device, waited for here or queued for the caller to wait on.

use std::sync::Arc;

use crate::cuda::{
    CudaError, Device, DeviceMemory, Event, ImportedPool, IpcMapping, POINTER_EXPORT_LEN, Stream,
    Wait, copy_and_wait, copy_async, copy_async_marked, copy_boxes_async, copy_boxes_to_host,
    copy_to_host, enable_peer_access, peer_access,
};
use crate::gpus::Gpus;
use crate::memory::Buffer;
use crate::wire::{Layout, LayoutError, RowBox};

use super::error::{IpcError, at, no_stream};
use super::handle_cache::{AllocationKey, Lookup};
use super::imports::*;
use super::{IpcBufferRef, IpcSource};

/// Reads `len` bytes described by `source` out of the peer's memory into `dst` (device or
/// host memory), and waits until they are there. The buffer's import (or, for memory the
/// peer registered, its allocation's mapping) is taken from `imports`, or made and kept
/// there. Blocking: call it on a blocking thread.
///
/// # Errors
/// Why the bytes could not be read; `dst` comes back with the error.
pub fn pull(
    source: &IpcSource,
    layout: &Layout,
    pools: &ImportedPools,
    imports: &std::sync::Mutex<ImportCache>,
    gpus: &Gpus,
    mut dst: Buffer,
    express: bool,
) -> Result<Buffer, (Buffer, IpcError)> {
    // No bytes: nothing to map or copy (an empty buffer has no device memory to export).
    if dst.is_empty() {
        return Ok(dst);
    }
    let how = if express { How::Express } else { How::Wait };
    let result = match source.legacy {
        None => pull_pooled(source, layout, pools, imports, gpus, &mut dst, how).map(drop),
        Some(buffer_id) => pull_registered(source, layout, buffer_id, imports, gpus, &mut dst),
    };
    match result {
        Ok(()) => Ok(dst),
        Err(why) => Err((dst, why)),
    }
}

/// A pull whose copy was queued and not waited for ([`queue_pull`]).
#[derive(Debug)]
pub struct QueuedPull {
    /// Where the bytes land.
    pub dst: Buffer,
    /// Recorded after the copy; `None` when it was copied and waited for already.
    pub ended: Option<Arc<Event>>,
}

/// Gives the event a queued copy records after itself, of the copy stream's device: the
/// caller's to wait for, and the buffers' record of their use (one event for the three).
pub type TakeEvent<'a> = &'a dyn Fn(&Device) -> Result<Event, CudaError>;

/// A contiguous [`pull`] that queues its copy (on the express stream when `express`, else
/// the copy stream) and returns without waiting: the caller waits for the event it gave
/// (`event`), recorded after the copy ([`QueuedPull::ended`]), so that several pulls are in
/// flight at once. The import stays mapped until the copy ends:
/// the peer cannot free the buffer before we finish its transfer, and an eviction waits
/// for every copy in flight. Memory the peer registered is copied and waited for at once.
/// Blocking (briefly): call it off the actor thread.
///
/// # Errors
/// As [`pull`].
pub fn queue_pull(
    source: &IpcSource,
    pools: &ImportedPools,
    imports: &std::sync::Mutex<ImportCache>,
    gpus: &Gpus,
    dst: Buffer,
    express: bool,
    event: TakeEvent<'_>,
) -> Result<QueuedPull, (Buffer, IpcError)> {
    if dst.is_empty() || source.legacy.is_some() {
        return pull(source, &Layout::Contiguous, pools, imports, gpus, dst, true)
            .map(|dst| QueuedPull { dst, ended: None });
    }
    let mut dst = dst;
    let layout = Layout::Contiguous;
    match pull_pooled(
        source,
        &layout,
        pools,
        imports,
        gpus,
        &mut dst,
        How::Queue(express, event),
    ) {
        Ok(ended) => Ok(QueuedPull { dst, ended }),
        Err(why) => Err((dst, why)),
    }
}

/// Contiguous pulls of several of the peer's pooled buffers, each into the device memory
/// of one GPU of ours, queued at once on that GPU's express stream (`express`) or its copy
/// stream: one launch of the gather kernel where it loads ([`crate::cuda::copy_many_async`]), so the copy
/// engine's fixed cost per copy is paid once. Nothing is waited for: the caller waits for
/// the event it gave (`event`), recorded after them all and returned. The imports stay as
/// [`queue_pull`] says.
///
/// # Errors
/// As [`pull`]; [`IpcError::Unsupported`] for a landing that is not device memory or a
/// source the peer registered (those take [`queue_pull`]). Nothing is queued then.
pub fn queue_pulls(
    items: &mut [(&IpcSource, &mut Buffer)],
    pools: &ImportedPools,
    imports: &std::sync::Mutex<ImportCache>,
    gpus: &Gpus,
    express: bool,
    event: TakeEvent<'_>,
) -> Result<Arc<Event>, IpcError> {
    let device = items
        .first()
        .and_then(|(_, dst)| dst.device_memory())
        .map(|m| m.device().clone())
        .ok_or_else(|| IpcError::Unsupported("pulls into host memory".into()))?;
    let stream = gpus.copy_stream(&device, express).ok_or_else(no_stream)?;
    let mut cache = imports.lock().unwrap_or_else(|p| p.into_inner());
    cache.tick += 1;
    let tick = cache.tick;
    let mut spans = Vec::with_capacity(items.len());
    for (source, dst) in items.iter() {
        if source.legacy.is_some() {
            return Err(IpcError::Unsupported("memory the peer registered".into()));
        }
        let pool = pools.get(&source.pool).ok_or_else(|| {
            IpcError::BadDescriptor(format!(
                "the peer's pool {} was never imported",
                source.pool
            ))
        })?;
        let (offset, end) = source_range(source, dst.len())?;
        let key = buffer_ref(source);
        import_into(&mut cache, &key, pool, export_bytes(source)?, end, gpus)?;
        if let Some((_, last)) = cache.entries.get_mut(&key) {
            *last = tick;
        }
        spans.push((key, offset));
    }
    // Every import is in place (the batch's are the newest, so none evicted another).
    let mut pairs = Vec::with_capacity(items.len());
    for ((_, dst), (key, offset)) in items.iter_mut().zip(&spans) {
        let len = dst.len();
        let dst = dst
            .device_memory_mut()
            .ok_or_else(|| IpcError::Unsupported("a pull into host or shared memory".into()))?;
        let (src, _) = cache
            .entries
            .get(key)
            .ok_or_else(|| IpcError::Gone("the import vanished".into()))?;
        pairs.push(crate::cuda::Pair {
            dst,
            src,
            src_offset: *offset,
            len,
        });
    }
    let event = event(stream.device()).map_err(at("creating an event"))?;
    let _copying = gpus.copying();
    // Under the cache's lock, as `copy_many_async` asks: no other copy from these imports
    // is queued and noted meanwhile.
    let gathered = crate::cuda::copy_many_async(&mut pairs, &stream, event)
        .map_err(at("copying from the peer"))?;
    Ok(gathered.ended)
}

/// How a pooled pull waits for its copy.
#[derive(Clone, Copy)]
pub(crate) enum How<'a> {
    /// A few bytes: polled under the import lock, on the express stream.
    Express,
    /// Queued on the copy stream, waited for outside the lock.
    Wait,
    /// Queued (on the express stream when true, else the copy stream), not waited for:
    /// the event given records its end.
    Queue(bool, TakeEvent<'a>),
}

pub(crate) fn pull_pooled(
    source: &IpcSource,
    layout: &Layout,
    pools: &ImportedPools,
    imports: &std::sync::Mutex<ImportCache>,
    gpus: &Gpus,
    dst: &mut Buffer,
    how: How<'_>,
) -> Result<Option<Arc<Event>>, IpcError> {
    let len = dst.len();
    let pool = pools.get(&source.pool).ok_or_else(|| {
        IpcError::BadDescriptor(format!(
            "the peer's pool {} was never imported",
            source.pool
        ))
    })?;
    let export = export_bytes(source)?;
    let spanning = std::time::Instant::now();
    let (offset, end, boxes) = source_span(source, layout, len)?;
    let span_at = spanning.elapsed();
    let key = buffer_ref(source);
    let started = std::time::Instant::now();
    let mut cache = imports.lock().unwrap_or_else(|p| p.into_inner());
    let locked_at = started.elapsed();
    cache.tick += 1;
    let tick = cache.tick;
    let hit = import_into(&mut cache, &key, pool, export, end, gpus)?;
    let imported_at = started.elapsed();
    // When the copy was queued, once it was (`None`: copied and waited for at once).
    let mut queued_at = None;
    let mut queued = None;
    let Some((imported, last)) = cache.entries.get_mut(&key) else {
        return Err(IpcError::Gone("the import vanished".into()));
    };
    *last = tick;
    if matches!(how, How::Express)
        && boxes.is_none()
        && let Some(memory) = dst.device_memory_mut()
    {
        // A few bytes: copied and waited for under the lock (microseconds), with no event
        // to record on either buffer. Polled, not synchronised (see `Wait::Spin`).
        let stream = gpus
            .copy_stream(memory.device(), true)
            .ok_or_else(no_stream)?;
        let _copying = gpus.copying();
        copy_and_wait(memory, &*imported, offset, len, &stream, Wait::Spin)
            .map_err(at("copying from the peer"))?;
    } else {
        // Queue the copy under the lock (the import stays put), wait outside it.
        let at = imported.device_ptr();
        let (express, mark) = match how {
            How::Express => (true, None),
            How::Wait => (false, None),
            How::Queue(express, event) => (express, Some(event)),
        };
        let (stream, ended) = queue_copy(
            dst,
            &*imported,
            offset,
            boxes.as_deref(),
            gpus,
            express,
            mark,
        )?;
        drop(cache);
        queued_at = Some(started.elapsed());
        if ended.is_some() {
            queued = ended;
        } else {
            finish_copy(&stream).inspect_err(|e| {
                tracing::debug!(
                    error = %e,
                    buffer = key.buffer,
                    at = format_args!("{at:#x}+{offset}"),
                    bytes = len,
                    "a pull's copy failed"
                )
            })?;
        }
    }
    let total = started.elapsed();
    tracing::trace!(
        target: crate::TRACE_BLOCKS,
        blocks = crate::block_count(layout),
        runs = boxes.as_ref().map_or(0, Vec::len),
        bytes = len,
        cached = hit,
        span_us = span_at.as_micros() as u64,
        lock_us = locked_at.as_micros() as u64,
        import_us = (imported_at - locked_at).as_micros() as u64,
        queue_us = queued_at.map(|q| (q - imported_at).as_micros() as u64),
        wait_us = queued_at.map(|q| (total - q).as_micros() as u64),
        total_us = total.as_micros() as u64,
        "pull copied: span (layout to runs), lock, import, queue (the gather), wait (sync)"
    );
    Ok(queued)
}

/// Makes sure `cache` holds an import of the peer's buffer `key` reaching `end` bytes
/// (mapping it, and evicting the import used longest ago when full, with every copy held
/// off meanwhile). Returns whether it was there already.
pub(crate) fn import_into(
    cache: &mut ImportCache,
    key: &IpcBufferRef,
    pool: &ImportedPool,
    export: &[u8; POINTER_EXPORT_LEN],
    end: usize,
    gpus: &Gpus,
) -> Result<bool, IpcError> {
    // An import made for fewer bytes (an earlier pull of this buffer read less of it: a
    // layout that ends sooner) does not serve: it is remapped to reach `end`.
    let hit = cache
        .entries
        .get(key)
        .is_some_and(|(b, _)| DeviceMemory::len(b) >= end);
    if !hit {
        let quiet = gpus
            .drain_copies()
            .map_err(at("waiting for the copies in flight"))?;
        drop(cache.entries.remove(key));
        let imported = pool
            .import_pointer(export, end)
            .map_err(at("importing the peer's buffer"))?;
        tracing::debug!(
            buffer = key.buffer,
            ptr = format_args!("{:#x}", imported.device_ptr()),
            len = end,
            "imported a peer buffer"
        );
        while cache.entries.len() >= cache.capacity {
            let Some(oldest) = cache
                .entries
                .iter()
                .min_by_key(|(_, (_, t))| *t)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            // Freed before the lock is released, so a later pull of the same buffer, or
            // the owner's IpcUnmap, never meets an import that is still going away.
            // The owner learns nothing: it asks when it frees the buffer, and is
            // answered at once.
            drop(cache.entries.remove(&oldest));
        }
        // Evictions unmap too: done while the copies are still held off.
        drop(quiet);
        cache.entries.insert(key.clone(), (imported, cache.tick));
    }
    Ok(hit)
}

/// The pull of memory the peer registered: its allocation is mapped from the legacy IPC
/// handle (or the cached mapping is used), the copy reads the registered range, and the
/// mapping's reference is given back when the copy has completed.
pub(crate) fn pull_registered(
    source: &IpcSource,
    layout: &Layout,
    buffer_id: u64,
    imports: &std::sync::Mutex<ImportCache>,
    gpus: &Gpus,
    dst: &mut Buffer,
) -> Result<(), IpcError> {
    let len = dst.len();
    let handle = export_bytes(source)?;
    let (offset, end, boxes) = source_span(source, layout, len)?;
    let started = std::time::Instant::now();
    let (key, mapping, hit) = {
        let mut cache = imports.lock().unwrap_or_else(|p| p.into_inner());
        let key = AllocationKey::new(cache.peer.clone(), buffer_id);
        let registration = buffer_ref(source);
        if !cache.legacy_refs.contains_key(&registration)
            && cache.legacy_refs.len() >= LEGACY_REGISTRATIONS_MAX
        {
            return Err(IpcError::BadDescriptor(format!(
                "the peer has {LEGACY_REGISTRATIONS_MAX} registrations of its own memory in \
                 use with us already; it must drop some first"
            )));
        }
        cache.legacy_refs.insert(registration, buffer_id);
        match cache.legacy.acquire(&key) {
            Lookup::Hit(mapping) => (key, mapping, true),
            Lookup::Invalidated => {
                return Err(IpcError::Gone(format!(
                    "the peer freed the registered allocation {buffer_id}: it is never mapped again"
                )));
            }
            Lookup::Miss => {
                // Opened under the lock: one open of an allocation at a time per peer (the
                // driver maps a handle once per context).
                let mapping = open_legacy(&mut cache, &key, source, handle, buffer_id, gpus)?;
                (key, mapping, false)
            }
        }
    };
    let opened_at = started.elapsed();
    let copied = (|| {
        if end > mapping.len() {
            return Err(IpcError::BadDescriptor(format!(
                "the peer claims bytes up to {end} in an allocation of {}",
                mapping.len()
            )));
        }
        let queuing = std::time::Instant::now();
        let (stream, _) = queue_copy(dst, &*mapping, offset, boxes.as_deref(), gpus, false, None)?;
        let queued_at = queuing.elapsed();
        finish_copy(&stream)?;
        tracing::trace!(
            target: crate::TRACE_BLOCKS,
            blocks = crate::block_count(layout),
            bytes = len,
            queue_us = queued_at.as_micros() as u64,
            wait_us = (queuing.elapsed() - queued_at).as_micros() as u64,
            "registered pull copied: queue (the gather), wait (sync)"
        );
        Ok(())
    })();
    // The reference goes back whatever happened; a mapping the cache gave up meanwhile is
    // unmapped here, on this blocking thread.
    let closing = {
        let mut cache = imports.lock().unwrap_or_else(|p| p.into_inner());
        cache.legacy.release(&key);
        cache.closing()
    };
    drop(mapping);
    drop(closing);
    copied?;
    tracing::trace!(
        bytes = len,
        cached = hit,
        open_us = opened_at.as_micros() as u64,
        total_us = started.elapsed().as_micros() as u64,
        "pulled registered memory"
    );
    Ok(())
}

/// Maps the peer's registered allocation `buffer_id` from its legacy IPC `handle` (with no
/// copy in flight) and keeps the mapping in `cache` under `key`, with peer access enabled
/// for every GPU of ours that can reach it.
pub(crate) fn open_legacy(
    cache: &mut ImportCache,
    key: &AllocationKey,
    source: &IpcSource,
    handle: &[u8; POINTER_EXPORT_LEN],
    buffer_id: u64,
    gpus: &Gpus,
) -> Result<Arc<IpcMapping>, IpcError> {
    let device = gpus.visible_by_uuid(&source.device_uuid).ok_or_else(|| {
        IpcError::Unsupported(format!(
            "the peer's GPU {} is not visible to this process",
            source.device_uuid
        ))
    })?;
    // Mapped with no copy in flight, as pool memory is (not seen to fault here,
    // but the same kind of mapping change).
    let quiet = gpus
        .drain_copies()
        .map_err(at("waiting for the copies in flight"))?;
    let opened =
        IpcMapping::open(device, handle).map_err(at("opening the peer's legacy IPC handle"))?;
    // A legacy mapping is read through each copying context's peer access (pool
    // memory has its own access setting, granted when imported): enabled once
    // here, for every GPU of ours that can reach the allocation's.
    for (_, ours) in &gpus.gpus {
        if peer_access(&ours.device, device).unwrap_or(false) {
            enable_peer_access(&ours.device, device)
                .map_err(at("enabling peer access for the copy"))?;
        }
    }
    drop(quiet);
    cache
        .legacy
        .insert(key.clone(), Arc::new(opened))
        .map_err(|_| {
            IpcError::Gone(format!(
                "the peer freed the registered allocation {buffer_id}"
            ))
        })
}

pub(crate) fn export_bytes(source: &IpcSource) -> Result<&[u8; POINTER_EXPORT_LEN], IpcError> {
    source
        .export
        .as_slice()
        .try_into()
        .map_err(|_| IpcError::BadDescriptor(format!("an export of {} bytes", source.export.len())))
}

pub(crate) fn end_of(offset: usize, len: usize) -> Result<usize, IpcError> {
    offset
        .checked_add(len)
        .ok_or_else(|| IpcError::BadDescriptor("offset and length overflow".into()))
}

/// The source's offset and the end of `len` bytes from it.
pub(crate) fn source_range(source: &IpcSource, len: usize) -> Result<(usize, usize), IpcError> {
    let offset = usize::try_from(source.offset)
        .map_err(|_| IpcError::BadDescriptor(format!("offset {}", source.offset)))?;
    Ok((offset, end_of(offset, len)?))
}

/// Where the `len` packed bytes of a pull lie in the peer's memory: the source's offset, the
/// end of what is read, and for a strided layout the boxes that gather its rows.
pub(crate) fn source_span(
    source: &IpcSource,
    layout: &Layout,
    len: usize,
) -> Result<(usize, usize, Option<Vec<RowBox>>), IpcError> {
    let (offset, end) = source_range(source, len)?;
    let bad = |e: LayoutError| IpcError::BadDescriptor(format!("the offer's layout: {e}"));
    match layout.extent().map_err(bad)? {
        None => Ok((offset, end, None)),
        Some(span) => {
            let boxes = layout.boxes(span, 0, len as u64).map_err(bad)?;
            let span = usize::try_from(span)
                .map_err(|_| IpcError::BadDescriptor(format!("a span of {span} bytes")))?;
            Ok((offset, end_of(offset, span)?, Some(boxes)))
        }
    }
}

/// Queues the copy of `dst.len()` bytes from `src[offset..]` into `dst`, on a copy stream
/// of the landing device (of the source's for a host landing, which is pageable memory: that
/// copy is synchronous). Returns the stream to wait on and, with `mark`, the event taken
/// from it and recorded after the copy.
pub(crate) fn queue_copy(
    dst: &mut Buffer,
    src: &impl DeviceMemory,
    offset: usize,
    boxes: Option<&[RowBox]>,
    gpus: &Gpus,
    express: bool,
    mark: Option<TakeEvent<'_>>,
) -> Result<(Stream, Option<Arc<Event>>), IpcError> {
    let len = dst.len();
    let device = dst
        .device_memory()
        .map_or(src.device(), |m| m.device())
        .clone();
    let stream = gpus.copy_stream(&device, express).ok_or_else(no_stream)?;
    let _copying = gpus.copying();
    if let (Some(take), Some(memory), None) = (mark, dst.device_memory_mut(), boxes) {
        // The common case: one event for the copy's end and both buffers' use.
        let event = take(stream.device()).map_err(at("creating an event"))?;
        let ended = copy_async_marked(memory, 0, src, offset, len, &stream, event)
            .map_err(at("copying from the peer"))?;
        return Ok((stream, Some(ended)));
    }
    match (dst.device_memory_mut(), boxes) {
        (Some(memory), None) => copy_async(memory, 0, src, offset, len, &stream),
        (Some(memory), Some(boxes)) => copy_boxes_async(memory, 0, src, offset, boxes, &stream),
        (None, boxes) => {
            let host = dst
                .as_mut_slice()
                .ok_or_else(|| IpcError::Gone("the landing buffer is shared".into()))?;
            match boxes {
                None => copy_to_host(host, src, offset, &stream),
                Some(boxes) => copy_boxes_to_host(host, src, offset, boxes, &stream),
            }
        }
    }
    .map_err(at("copying from the peer"))?;
    // Any other copy noted its buffers' uses itself: the caller's event goes after it.
    let ended = match mark {
        Some(take) => {
            let event = take(stream.device()).map_err(at("creating an event"))?;
            event
                .record(&stream)
                .map_err(at("recording the copy's end"))?;
            Some(Arc::new(event))
        }
        None => None,
    };
    Ok((stream, ended))
}

pub(crate) fn finish_copy(stream: &Stream) -> Result<(), IpcError> {
    stream
        .synchronize()
        .map_err(at("finishing the copy from the peer"))
}
