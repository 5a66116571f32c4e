//! The staged transport between processes of one host: a ring of staging slots in shared
//! memory per direction, filled by a sender thread and emptied by a receiver thread (see
//! `crate::staged`).
//!
//! The sender's part makes the ring at its first staged send to a same-host peer, offers it
//! at its fd-sharing socket and names it to the peer (`StagedMessage::Ring`); the peer's
//! part fetches and maps it, and its receiver thread says it reads it. Until then (or when
//! it cannot), staged transfers stream over the link, landing in the same regions. The
//! sender thread copies each granted transfer's packed bytes into the slots, one chunk at a
//! time, waiting for free slots; the receiver thread copies each chunk into the transfer's
//! reserved buffer (host or device memory) and, after the last, hands the buffer to its
//! session like the link's reader does (through the part's [`Reports`], which wake the
//! shell).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use ferry_config::AutoSize;

use super::{StagedError, StagingRx, StagingTx};
use crate::link::Activity;
use crate::memory::SharedBytes;
use crate::region::InboundRegion;
use crate::transport::OpId;
use crate::wire::{DataChunk, Layout};

/// What a staged thread reports to its part: the bytes of a stream are all in the ring
/// (or the ring broke), an inbound transfer is complete or failed, the peer broke its ring.
/// Each names the link its ring was made for.
pub(super) enum Report {
    /// Op `op`'s stream ended; `broken` says why the ring failed, when it did.
    StreamEnded {
        op: OpId,
        broken: Option<String>,
        link: u64,
    },
    /// Every byte of inbound transfer `id` is in `buffer`.
    InboundDone {
        id: u64,
        buffer: crate::memory::Buffer,
    },
    /// A chunk of inbound transfer `id` could not be placed: that transfer fails.
    InboundFailed { id: u64, why: String },
    /// The peer broke the ring made for `link`.
    PeerBroke { link: u64, why: String },
}

/// Where the staged threads report, then wake the shell. Bounded by what the threads can
/// have to say: one report per job the sender thread holds (at most the session's pipeline
/// depth) and one per inbound transfer granted (the session's bound on those), plus one.
#[derive(Clone)]
pub(super) struct Reports {
    pub(super) queue: Arc<std::sync::Mutex<std::collections::VecDeque<Report>>>,
    pub(super) wake: crate::transport::Wake,
}

impl Reports {
    fn put(&self, report: Report) {
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(report);
        (self.wake)();
    }

    pub(super) fn take(&self) -> Vec<Report> {
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        queue.drain(..).collect()
    }
}

/// `[transport.staged]`, as the part uses it.
#[derive(Debug, Clone, Copy)]
pub struct StagedSettings {
    /// Slots per ring.
    pub slots: u32,
    /// Bytes per chunk, or `auto`.
    pub chunk: AutoSize,
    /// Whether same-host peers share the slots.
    pub shared_memory: bool,
    /// Bytes per data frame when the chunks go over the link.
    pub link_chunk: usize,
    /// How long a staged thread spins for its next chunk or slot before it parks (longer
    /// than a chunk's copy, so that a busy transfer never pays a futex wake-up per chunk).
    pub spin: Duration,
}

impl StagedSettings {
    /// Bytes per chunk: the configured size, or what `auto` measured in this process.
    pub fn chunk_bytes(&self, device: Option<&crate::cuda::Device>) -> usize {
        match self.chunk {
            AutoSize::Bytes(b) => usize::try_from(b).unwrap_or(4 << 20),
            AutoSize::Auto => super::auto_chunk(device),
        }
    }
}

/// One granted transfer for the sender thread.
pub(super) struct Job {
    /// The op.
    pub op: OpId,
    /// The layout of its bytes in the buffer.
    pub layout: Layout,
    /// A view of the buffer, dropped once every chunk is in a slot.
    pub bytes: SharedBytes,
    /// Set when the op is cancelled or its deadline passes.
    pub stop: Arc<AtomicBool>,
}

/// The sending end: a thread that copies granted transfers into the ring, in grant order.
pub(super) struct StagedTx {
    jobs: std::sync::mpsc::SyncSender<Job>,
    ring: Arc<crate::link::ring::Ring>,
}

impl StagedTx {
    /// Starts the sender thread over `staging`; it reports as each job's stream ends. At
    /// most `depth` jobs wait for it (the session's pipeline bounds them anyway).
    ///
    /// # Errors
    /// The thread could not be spawned.
    pub(super) fn start(
        peer: &str,
        mut staging: StagingTx,
        depth: usize,
        (spin, stall, activity): (Duration, Duration, Activity),
        device: Option<crate::cuda::Device>,
        (reports, link): (Reports, u64),
    ) -> std::io::Result<StagedTx> {
        staging.set_stall_timeout(Some(stall));
        let (jobs, rx) = std::sync::mpsc::sync_channel::<Job>(depth.max(1));
        let ring = Arc::clone(staging.ring());
        let peer = peer.to_string();
        std::thread::Builder::new()
            .name("ferry-staged-tx".into())
            .spawn(move || {
                let mut device = device;
                while let Ok(job) = rx.recv() {
                    // Page-locked at the first job (jobs come only once the peer reads the
                    // ring): a peer that never maps it costs no pinned memory.
                    if let Some(device) = device.take()
                        && let Err(e) = staging.pin(&device)
                    {
                        tracing::warn!(
                            peer,
                            "staging slots stay pageable (copies are slower): {e}"
                        );
                    }
                    let sent = send_job(&mut staging, &job, spin, &activity);
                    let Job { op, bytes, .. } = job;
                    drop(bytes);
                    let broken = match sent {
                        Ok(()) | Err(StagedError::Stopped) => None,
                        Err(e) => Some(e.to_string()),
                    };
                    if let Some(why) = &broken {
                        tracing::warn!(peer, op = op.0, "staged send failed: {why}");
                    }
                    reports.put(Report::StreamEnded { op, broken, link });
                }
                // Closes the ring.
                drop(staging);
            })?;
        Ok(StagedTx { jobs, ring })
    }

    /// True once the peer's receiver thread reads the ring.
    pub(super) fn is_attached(&self) -> bool {
        self.ring.is_attached() && !self.ring.is_closed()
    }

    /// Hands a granted transfer to the thread; gives it back when the thread is gone or
    /// its queue is full.
    pub(super) fn submit(&self, job: Job) -> Result<(), Job> {
        self.jobs.try_send(job).map_err(|e| match e {
            std::sync::mpsc::TrySendError::Full(j)
            | std::sync::mpsc::TrySendError::Disconnected(j) => j,
        })
    }

    /// Closes the ring: the thread's waits end, and so does the peer's receiver thread.
    pub(super) fn close(&self) {
        self.ring.close();
    }
}

/// Copies one job's packed bytes into the ring.
fn send_job(
    staging: &mut StagingTx,
    job: &Job,
    spin: Duration,
    activity: &Activity,
) -> Result<(), StagedError> {
    let len = job
        .layout
        .check(job.bytes.len() as u64)
        .map_err(|e| StagedError::Copy(e.to_string()))?;
    let contiguous = job.layout.is_contiguous();
    staging.send(job.op.0, len, &job.stop, spin, |offset, slot| {
        // A chunk copied into the ring is progress on the link, as a chunk written is.
        activity.add(slot.len() as u64);
        if contiguous {
            let offset = usize::try_from(offset)?;
            job.bytes.read(offset, slot)
        } else {
            job.bytes.read_packed(&job.layout, offset, slot)
        }
        .map_err(Into::into)
    })
}

/// The receiving end: a thread that lands chunks from the peer's ring.
pub(super) struct StagedRx {
    stop: Arc<AtomicBool>,
}

impl StagedRx {
    /// Starts the receiver thread over `staging`; chunks land in `regions`, a completed
    /// transfer is reported, and a broken ring takes the link down.
    ///
    /// # Errors
    /// The thread could not be spawned.
    pub(super) fn start(
        peer: &str,
        mut staging: StagingRx,
        spin: Duration,
        device: Option<crate::cuda::Device>,
        (regions, activity): (Arc<DashMap<u64, InboundRegion>>, Activity),
        (reports, link): (Reports, u64),
    ) -> std::io::Result<StagedRx> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let peer = peer.to_string();
        std::thread::Builder::new()
            .name("ferry-staged-rx".into())
            .spawn(move || {
                if let Some(device) = &device
                    && let Err(e) = staging.pin(device)
                {
                    tracing::warn!(peer, "staging slots stay pageable (copies are slower): {e}");
                }
                let broken = loop {
                    if stopped.load(Ordering::Acquire) {
                        break None;
                    }
                    let landed = staging.next(spin, |header, bytes| {
                        let chunk = DataChunk {
                            transfer: header.transfer,
                            offset: header.offset,
                            len: header.len,
                        };
                        activity.add_received(bytes.len() as u64);
                        land(&regions, &chunk, bytes, &reports).map_err(Into::into)
                    });
                    match landed {
                        Ok(_) => {}
                        Err(StagedError::Closed) => break None,
                        Err(e) => break Some(e.to_string()),
                    }
                };
                // Closes the ring first: the peer's sender stops waiting on it.
                drop(staging);
                if let Some(why) = broken {
                    tracing::warn!(peer, "the peer's staging ring broke: {why}");
                    reports.put(Report::PeerBroke { link, why });
                }
            })?;
        Ok(StagedRx { stop })
    }

    /// Ends the thread (at its next chunk or park).
    pub(super) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl Drop for StagedRx {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Lands one chunk in its transfer's region. A chunk of a transfer abandoned meanwhile is
/// skipped; one outside its buffer breaks the protocol (the error ends the ring); a copy
/// that fails fails that transfer only.
fn land(
    regions: &DashMap<u64, InboundRegion>,
    chunk: &DataChunk,
    bytes: &[u8],
    reports: &Reports,
) -> Result<(), crate::region::PlaceError> {
    let id = chunk.transfer;
    // Lent out of the map while the bytes are copied, so the map is never locked across
    // a copy (the link's reader may land a chunk of another transfer meanwhile).
    let mut landing = match regions.get_mut(&id).map(|mut r| r.lend(chunk)) {
        Some(Ok(landing)) => landing,
        Some(Err(e)) => return Err(e),
        None => return Ok(()),
    };
    if let Err(e) = landing.write(bytes) {
        regions.remove(&id);
        drop(landing);
        let why = format!("copying a staged chunk in: {e}");
        reports.put(Report::InboundFailed { id, why });
        return Ok(());
    }
    metrics::counter!("ferry_staged_ring_chunks_total").increment(1);
    if let Some(buffer) = crate::region::restore_landing(regions, id, landing) {
        reports.put(Report::InboundDone { id, buffer });
    }
    Ok(())
}
