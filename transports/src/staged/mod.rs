//! The staged transport's pieces below the actors: its declaration, the chunk size it
//! picks, and the ring of staging slots through which a same-host peer's chunks move.
//!
//! A staged transfer moves device (or host) memory through host memory, chunk by chunk:
//! the sender copies chunk k+1 out of its buffer (one copy-engine copy; a few 3D copies for
//! a strided layout) while the receiver copies chunk k-1 into its own. Between processes of
//! one host the chunks live in a ring of slots in shared memory ([`StagingTx`],
//! [`StagingRx`]: a sealed memfd, page-locked for the copy engine on both sides), so a
//! chunk moves by one copy out and one copy in, and nothing crosses the socket; to another
//! host they travel as the tcp transport's data frames.
//!
//! ```text
//! sender                    shared memory (slots x chunk)          receiver
//!   D2H chunk k+1 ──────────> [ k-1 | k | k+1 | ... ]  ──────────> H2D chunk k-1
//!   (waits while every slot is full: a stalled receiver never grows memory)
//! ```
//!
//! A slot holds a 64-byte chunk header (transfer, offset, length; written by the peer, so
//! checked like any frame) and the chunk's bytes.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use ferry_config::{Direction, Locality, MemoryClass, TransportName};

use crate::link::ring::{Ring, RingError};
use crate::transport::Capabilities;

mod kind;
mod peer;
mod threads;
mod wire;

pub use kind::StagedKind;
pub use peer::{RING_PATIENCE, StagedTransport};
pub use threads::StagedSettings;
pub use wire::StagedMessage;

/// Bytes before a chunk's data in its slot's record; with the ring's 8-byte slot header
/// the data starts 64 bytes into the slot.
pub const CHUNK_HEADER: usize = 56;
/// Largest staging ring accepted from a peer: `transport.staged` allows 1 GiB of slots.
pub const STAGED_MAX_MAP: usize = (1 << 30) + (64 << 20);
const CHUNK_MAGIC: u32 = u32::from_le_bytes(*b"FSTG");
/// How long a parked side sleeps before it looks at its stop flag again.
const PARK: Duration = Duration::from_millis(20);

/// The staged transport's declaration: any memory at either end, on this host (shared
/// slots) or another (the link), pushed by the sender. Without a working CUDA driver it
/// declares host memory only (there is no device memory to move).
pub fn capabilities() -> Capabilities {
    const ANY: &[MemoryClass] = &[MemoryClass::Host, MemoryClass::Pinned, MemoryClass::Device];
    const HOST: &[MemoryClass] = &[MemoryClass::Host, MemoryClass::Pinned];
    let kinds = if crate::cuda::driver().is_ok() {
        ANY
    } else {
        HOST
    };
    Capabilities {
        name: TransportName::Staged,
        sources: kinds,
        memory: kinds,
        localities: &[Locality::SameHost, Locality::Remote],
        directions: &[Direction::Push],
        needs_fd_passing: false,
        one_sided_put: false,
        carrier: crate::transport::Carrier::Ring,
        per_peer_setup: false,
        opt_in: false,
        lane: false,
        device_path: crate::transport::DevicePath::PinnedStaging,
        library: Some(crate::transport::Library::Cuda),
    }
}

/// A fresh key for a staging ring at the fd-sharing socket (unguessable, like a lane's).
pub fn ring_key() -> String {
    format!("staged/{:032x}", rand::random::<u128>())
}

/// Why staged chunks could not move.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StagedError {
    /// The ring failed or the peer broke it.
    #[error(transparent)]
    Ring(#[from] RingError),
    /// The other side closed the ring (its session ended).
    #[error("the staging ring was closed")]
    Closed,
    /// The transfer was stopped (cancelled, or its deadline passed) between chunks.
    #[error("stopped")]
    Stopped,
    /// Copying a chunk out of the sender's buffer failed.
    #[error("copying a chunk out: {0}")]
    Copy(String),
    /// The receiver could not land a chunk (its reason, from the slot).
    #[error("the receiver could not land a chunk: {0}")]
    Landing(String),
    /// The ring stayed full: the receiver freed no slot for the stall timeout
    /// ([`StagingTx::set_stall_timeout`]).
    #[error("the receiver freed no staging slot for {0:?}: it stalled")]
    Stalled(Duration),
}

/// Why a chunk could not be copied in or out (the caller's error, kept as the source).
pub type ChunkError = Box<dyn std::error::Error + Send + Sync>;

/// One chunk's header, as it sits in its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    /// The transfer (the sender's id, as offered).
    pub transfer: u64,
    /// Where the chunk's bytes go in the transfer's packed bytes.
    pub offset: u64,
    /// How many bytes follow.
    pub len: u32,
}

impl ChunkHeader {
    fn write(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&CHUNK_MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&self.len.to_le_bytes());
        out[8..16].copy_from_slice(&self.transfer.to_le_bytes());
        out[16..24].copy_from_slice(&self.offset.to_le_bytes());
    }

    /// Reads a header written by the peer, and checks that its length is the record's.
    fn read(record: &[u8]) -> Result<ChunkHeader, RingError> {
        let broken = |why: String| RingError::Broken(why);
        let head = record
            .get(..CHUNK_HEADER)
            .ok_or_else(|| broken(format!("a staged record of {} bytes", record.len())))?;
        let word =
            |at: usize| u32::from_le_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
        let long = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&head[at..at + 8]);
            u64::from_le_bytes(b)
        };
        if word(0) != CHUNK_MAGIC {
            return Err(broken("a staged record without its magic".into()));
        }
        let header = ChunkHeader {
            len: word(4),
            transfer: long(8),
            offset: long(16),
        };
        if header.len as usize != record.len() - CHUNK_HEADER {
            return Err(broken(format!(
                "a chunk header of {} bytes in a record of {}",
                header.len,
                record.len() - CHUNK_HEADER
            )));
        }
        Ok(header)
    }
}

/// The sending end of a staging ring: made by the sender, which hands its descriptor to the
/// receiver (over the fd-sharing socket) and fills its slots.
#[derive(Debug)]
pub struct StagingTx {
    ring: Arc<Ring>,
    pinned: Option<crate::cuda::PinnedRing>,
    next: u64,
    reaped: u64,
    /// Longest wait for a free slot with no slot freed meanwhile.
    stall: Option<Duration>,
}

impl StagingTx {
    /// A ring of `slots` slots of `chunk` bytes each (plus their headers).
    ///
    /// # Errors
    /// [`RingError::Invalid`] for a shape past [`STAGED_MAX_MAP`], [`RingError::System`]
    /// when the kernel refuses the memory.
    pub fn create(slots: u32, chunk: usize) -> Result<StagingTx, RingError> {
        let slot_len = chunk
            .checked_add(64)
            .and_then(|l| u32::try_from(l).ok())
            .ok_or_else(|| RingError::Invalid(format!("a chunk of {chunk} bytes")))?;
        let ring = Ring::create_named(c"ferry-staged", slots, slot_len, STAGED_MAX_MAP)?;
        Ok(StagingTx {
            ring: Arc::new(ring),
            pinned: None,
            next: 0,
            reaped: 0,
            stall: None,
        })
    }

    /// The ring, to offer to the receiver at the fd-sharing socket.
    pub fn ring(&self) -> &Arc<Ring> {
        &self.ring
    }

    /// Page-locks the slots for the copy engine (once; with `device`'s context).
    ///
    /// # Errors
    /// The driver's refusal; the slots then stay pageable (copies still work, slower).
    pub fn pin(&mut self, device: &crate::cuda::Device) -> Result<(), crate::cuda::CudaError> {
        pin_once(&mut self.pinned, &self.ring, device)
    }

    /// Bytes per chunk.
    pub fn chunk(&self) -> usize {
        self.ring.room() - CHUNK_HEADER
    }

    /// Sends `len` bytes of `transfer`, chunk by chunk: `fill(offset, slot)` writes the
    /// bytes `[offset, offset + slot.len())` into a slot. Waits while every slot is full
    /// (spinning for `spin`, then parked), so memory never grows; `stop` ends it between
    /// chunks. Returns once every chunk is in a slot (not yet landed: the receiver says so
    /// on the link). At least one chunk is sent, so a zero-byte transfer completes too.
    ///
    /// # Errors
    /// [`StagedError`]: stopped, closed, a broken ring, a failed copy, or a chunk an
    /// earlier receiver refused.
    pub fn send(
        &mut self,
        transfer: u64,
        len: u64,
        stop: &AtomicBool,
        spin: Duration,
        mut fill: impl FnMut(u64, &mut [u8]) -> Result<(), ChunkError>,
    ) -> Result<(), StagedError> {
        let len = usize::try_from(len).map_err(|e| StagedError::Copy(e.to_string()))?;
        for (offset, n) in crate::region::chunks(len, self.chunk()) {
            self.wait_for_slot(stop, spin)?;
            let header = ChunkHeader {
                transfer,
                offset: offset as u64,
                len: u32::try_from(n).map_err(|e| StagedError::Copy(e.to_string()))?,
            };
            let filled = self.ring.fill(self.next, self.reaped, |slot| {
                header.write(slot);
                fill(offset as u64, &mut slot[CHUNK_HEADER..CHUNK_HEADER + n])?;
                Ok::<usize, ChunkError>(CHUNK_HEADER + n)
            })?;
            filled.map_err(|e| StagedError::Copy(e.to_string()))?;
            self.next += 1;
        }
        // Published into a ring the receiver has left: nobody will land it.
        if self.ring.is_closed() {
            return Err(StagedError::Closed);
        }
        Ok(())
    }

    /// Bounds how long [`StagingTx::send`] waits on a full ring while the receiver frees
    /// no slot: past it the send fails with [`StagedError::Stalled`]. `None` (the default)
    /// waits for ever (until stopped or closed).
    pub fn set_stall_timeout(&mut self, stall: Option<Duration>) {
        self.stall = stall;
    }

    /// Waits until slot `next` is free, reading the outcomes of the chunks finished since;
    /// a stopped transfer or a closed ring ends it first, free slot or not, and a receiver
    /// that frees nothing for the stall timeout ends it too.
    fn wait_for_slot(&mut self, stop: &AtomicBool, spin: Duration) -> Result<(), StagedError> {
        let slots = u64::from(self.ring.slots());
        let started = Instant::now();
        let mut progress = (self.reaped, started);
        loop {
            if stop.load(Ordering::Acquire) {
                return Err(StagedError::Stopped);
            }
            if self.ring.is_closed() {
                return Err(StagedError::Closed);
            }
            let tail = self.ring.tail(self.reaped)?;
            let mut refused = None;
            for seq in self.reaped..tail {
                if let Err(why) = self.ring.outcome(seq) {
                    refused.get_or_insert(why);
                }
            }
            self.reaped = tail;
            if let Some(why) = refused {
                return Err(StagedError::Landing(why.0));
            }
            if self.next - self.reaped < slots {
                return Ok(());
            }
            if tail != progress.0 {
                progress = (tail, Instant::now());
            } else if let Some(stall) = self.stall
                && progress.1.elapsed() > stall
            {
                return Err(StagedError::Stalled(stall));
            }
            if started.elapsed() < spin {
                std::hint::spin_loop();
            } else {
                self.ring.park_producer(tail, PARK);
            }
        }
    }
}

/// Dropping an end closes the ring: the other side's waits and thread end.
impl Drop for StagingTx {
    fn drop(&mut self) {
        self.ring.close();
    }
}

/// The receiving end of a staging ring, mapped from the descriptor the sender offered.
#[derive(Debug)]
pub struct StagingRx {
    ring: Arc<Ring>,
    pinned: Option<crate::cuda::PinnedRing>,
    tail: u64,
}

impl StagingRx {
    /// Maps the ring behind `fd` (at most [`STAGED_MAX_MAP`] bytes) and says it reads it.
    ///
    /// # Errors
    /// [`RingError::Invalid`] for anything but a sealed ring of a sane shape.
    pub fn open(fd: OwnedFd) -> Result<StagingRx, RingError> {
        let ring = Ring::open_at_most(fd, STAGED_MAX_MAP)?;
        if ring.room() <= CHUNK_HEADER {
            return Err(RingError::Invalid(format!(
                "slots of {} bytes hold no chunk",
                ring.room()
            )));
        }
        ring.attach();
        Ok(StagingRx {
            ring: Arc::new(ring),
            pinned: None,
            tail: 0,
        })
    }

    /// Page-locks the slots for the copy engine (once; with `device`'s context).
    ///
    /// # Errors
    /// The driver's refusal; the slots then stay pageable.
    pub fn pin(&mut self, device: &crate::cuda::Device) -> Result<(), crate::cuda::CudaError> {
        pin_once(&mut self.pinned, &self.ring, device)
    }

    /// Lands the next chunk, if one comes within `spin` plus one park: `land(header,
    /// bytes)` copies it where it belongs (the header is checked against the record, the
    /// rest is the caller's to check), and its outcome goes back in the slot. Returns
    /// whether a chunk was landed.
    ///
    /// # Errors
    /// [`StagedError::Closed`] once the sender closed the ring and every chunk was landed;
    /// [`StagedError::Ring`] when the sender broke it (a header that does not add up);
    /// `land`'s error, as [`StagedError::Landing`], after finishing the slot with it.
    pub fn next(
        &mut self,
        spin: Duration,
        land: impl FnOnce(ChunkHeader, &[u8]) -> Result<(), ChunkError>,
    ) -> Result<bool, StagedError> {
        let started = Instant::now();
        loop {
            if self.ring.published(self.tail)? > self.tail {
                break;
            }
            if self.ring.is_closed() {
                return Err(StagedError::Closed);
            }
            if started.elapsed() < spin {
                std::hint::spin_loop();
            } else {
                self.ring.park_consumer(self.tail, PARK);
                if self.ring.published(self.tail)? == self.tail {
                    return Ok(false);
                }
            }
        }
        let seq = self.tail;
        let landed = self.ring.with_record(seq, |record| {
            ChunkHeader::read(record).map(|h| (h, land(h, &record[CHUNK_HEADER..])))
        })??;
        self.tail += 1;
        match landed.1 {
            Ok(()) => {
                self.ring.finish(seq, Ok(()));
                Ok(true)
            }
            Err(why) => {
                let why = why.to_string();
                self.ring.finish(seq, Err(&why));
                Err(StagedError::Landing(why))
            }
        }
    }
}

impl Drop for StagingRx {
    fn drop(&mut self) {
        self.ring.close();
    }
}

/// Registers `ring` with the driver unless `pinned` already holds its registration.
fn pin_once(
    pinned: &mut Option<crate::cuda::PinnedRing>,
    ring: &Arc<Ring>,
    device: &crate::cuda::Device,
) -> Result<(), crate::cuda::CudaError> {
    if pinned.is_none() {
        *pinned = Some(crate::cuda::PinnedRing::new(device, Arc::clone(ring))?);
    }
    Ok(())
}

// ---- chunk = "auto" ----

/// Chunk sizes `auto` chooses from.
const AUTO_SIZES: [usize; 5] = [256 << 10, 512 << 10, 1 << 20, 4 << 20, 16 << 20];

/// The chunk size `transport.staged.chunk = "auto"` stands for in this process: measured
/// once, at the first call, then kept. Each candidate size is timed copying out of
/// `device` into pinned memory (or host to host without a GPU), plus the measured cost of
/// handing one chunk across a ring (publish, wake, finish); the smallest size whose rate is
/// within 3% of the best wins (smaller chunks start the pipeline sooner and hold less).
pub fn auto_chunk(device: Option<&crate::cuda::Device>) -> usize {
    static PICKED: OnceLock<usize> = OnceLock::new();
    *PICKED.get_or_init(|| {
        let handoff = measure_handoff().unwrap_or(Duration::from_micros(20));
        let rates: Vec<(usize, f64)> = AUTO_SIZES
            .iter()
            .map(|&size| {
                let copy = device
                    .and_then(|d| measure_device_copy(d, size).ok())
                    .unwrap_or_else(|| measure_host_copy(size));
                (size, size as f64 / (copy + handoff).as_secs_f64())
            })
            .collect();
        let best = rates.iter().map(|&(_, r)| r).fold(0.0, f64::max);
        let picked = rates
            .iter()
            .find(|&&(_, r)| r >= 0.97 * best)
            .map_or(4 << 20, |&(size, _)| size);
        tracing::info!(
            chunk = picked,
            handoff_us = handoff.as_micros() as u64,
            "staged chunk size picked (transport.staged.chunk = \"auto\")"
        );
        picked
    })
}

/// The best of a few host-to-host copies of `size` bytes.
fn measure_host_copy(size: usize) -> Duration {
    let src = vec![1u8; size];
    let mut dst = vec![0u8; size];
    (0..4)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

/// The best of a few copies of `size` bytes out of `device` into pinned memory.
fn measure_device_copy(
    device: &crate::cuda::Device,
    size: usize,
) -> Result<Duration, crate::cuda::CudaError> {
    let stream = crate::cuda::Stream::new(device)?;
    let src = crate::cuda::PlainAllocation::new(device, size)?;
    let mut dst = crate::cuda::PinnedBuffer::new(device, size)?;
    let mut best = Duration::MAX;
    for _ in 0..4 {
        let t = Instant::now();
        crate::cuda::copy_to_pinned_async(&mut dst, 0, &src, 0, size, &stream)?;
        stream.synchronize()?;
        best = best.min(t.elapsed());
    }
    Ok(best)
}

/// The median time to hand a chunk across a ring between two threads and see it finished.
fn measure_handoff() -> Result<Duration, RingError> {
    let tx = Ring::create_named(c"ferry-staged-probe", 2, 128, 1 << 20)?;
    let fd = tx
        .fd()
        .try_clone_to_owned()
        .map_err(|e| RingError::Invalid(e.to_string()))?;
    let rx = Ring::open_at_most(fd, 1 << 20)?;
    const ROUNDS: u64 = 64;
    let consumer = std::thread::spawn(move || {
        for seq in 0..ROUNDS {
            while rx.published(seq).map(|h| h == seq).unwrap_or(false) && !rx.is_closed() {
                rx.park_consumer(seq, PARK);
            }
            rx.finish(seq, Ok(()));
        }
    });
    let mut times = Vec::new();
    for seq in 0..ROUNDS {
        let t = Instant::now();
        tx.publish(seq, seq, b"probe")?;
        while tx.tail(seq)? == seq {
            tx.park_producer(seq, PARK);
        }
        times.push(t.elapsed());
    }
    let _ = consumer.join();
    times.sort();
    Ok(times[times.len() / 2])
}

#[cfg(test)]
mod tests {
    use proptest::strategy::Strategy;

    use super::*;

    fn pair(slots: u32, chunk: usize) -> (StagingTx, StagingRx) {
        let tx = StagingTx::create(slots, chunk).expect("create");
        let fd = tx.ring().fd().try_clone_to_owned().expect("dup");
        (tx, StagingRx::open(fd).expect("open"))
    }

    #[test]
    fn headers_round_trip_and_lies_are_caught() {
        let mut record = vec![0u8; CHUNK_HEADER + 10];
        let h = ChunkHeader {
            transfer: 7,
            offset: 4096,
            len: 10,
        };
        h.write(&mut record);
        assert_eq!(ChunkHeader::read(&record).expect("read"), h);
        assert!(ChunkHeader::read(&record[..CHUNK_HEADER + 9]).is_err());
        assert!(ChunkHeader::read(&record[..10]).is_err());
        record[0] ^= 1;
        assert!(ChunkHeader::read(&record).is_err());
    }

    #[test]
    fn a_full_ring_makes_the_sender_wait_until_stopped() {
        let (mut tx, rx) = pair(2, 64 << 10);
        let stop = AtomicBool::new(false);
        // Two chunks fill both slots; the third waits for a receiver that never reads.
        let started = Instant::now();
        let stopper = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(150));
                stop.store(true, Ordering::Release);
            });
            tx.send(1, 3 * (64 << 10), &stop, Duration::ZERO, |_, dst| {
                dst.fill(1);
                Ok(())
            })
        });
        assert!(matches!(stopper, Err(StagedError::Stopped)), "{stopper:?}");
        assert!(started.elapsed() >= Duration::from_millis(150));
        drop(rx);
    }

    #[test]
    fn a_receiver_that_frees_no_slot_for_the_stall_timeout_ends_the_send() {
        let (mut tx, rx) = pair(2, 64 << 10);
        tx.set_stall_timeout(Some(Duration::from_millis(100)));
        let stop = AtomicBool::new(false);
        let started = Instant::now();
        // Two chunks fill both slots; nobody reads, so the third waits out the timeout.
        let sent = tx.send(1, 3 * (64 << 10), &stop, Duration::ZERO, |_, dst| {
            dst.fill(1);
            Ok(())
        });
        assert!(matches!(sent, Err(StagedError::Stalled(_))), "{sent:?}");
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(100) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        drop(rx);
    }

    #[test]
    fn a_stopped_transfer_or_a_closed_ring_ends_the_send_at_once() {
        let (mut tx, rx) = pair(4, 64 << 10);
        let stop = AtomicBool::new(true);
        let mut copied = 0;
        let sent = tx.send(1, 100 * (64 << 10), &stop, Duration::ZERO, |_, _| {
            copied += 1;
            Ok(())
        });
        assert!(matches!(sent, Err(StagedError::Stopped)), "{sent:?}");
        assert_eq!(copied, 0, "a stopped transfer still copied chunks");
        drop(rx);
        let go = AtomicBool::new(false);
        let sent = tx.send(2, 3 * (64 << 10), &go, Duration::ZERO, |_, _| Ok(()));
        assert!(matches!(sent, Err(StagedError::Closed)), "{sent:?}");
    }

    #[test]
    fn a_refused_chunk_comes_back_to_the_sender() {
        let (mut tx, mut rx) = pair(2, 64 << 10);
        let stop = AtomicBool::new(false);
        tx.send(1, 10, &stop, Duration::ZERO, |_, dst| {
            dst.fill(3);
            Ok(())
        })
        .expect("first");
        let landed = rx.next(Duration::ZERO, |_, _| Err("no such transfer".into()));
        assert!(matches!(landed, Err(StagedError::Landing(_))));
        let again = tx.send(2, 10, &stop, Duration::ZERO, |_, _| Ok(()));
        assert!(
            matches!(&again, Err(StagedError::Landing(why)) if why == "no such transfer"),
            "{again:?}"
        );
    }

    proptest::proptest! {
        /// Transfers of every layout cross a ring of any depth in chunks of any size, between
        /// two threads, byte-exact and in order: what lands is each layout's packed rows.
        #[test]
        fn every_shape_crosses_any_ring_byte_exact(
            transfers in proptest::collection::vec(crate::wire::layout::tests::layouts(), 1..4),
            chunk in (1usize..40).prop_map(|k| k * 8),
            slots in 1u32..5,
        ) {
            let (mut tx, mut rx) = pair(slots, chunk);
            let sources: Vec<(crate::wire::Layout, Vec<u8>)> = transfers
                .iter()
                .enumerate()
                .map(|(t, (layout, len))| {
                    (layout.clone(), (0..*len).map(|i| (i * 13 + t as u64 * 31) as u8).collect())
                })
                .collect();
            let want: Vec<Vec<u8>> = sources
                .iter()
                .map(|(layout, src)| {
                    let packed = layout.check(src.len() as u64).expect("fits") as usize;
                    let mut out = vec![0u8; packed];
                    layout.gather(src, 0, &mut out).expect("gather");
                    out
                })
                .collect();
            let mut got: Vec<Vec<u8>> = want.iter().map(|w| vec![0xEE; w.len()]).collect();
            let mut chunks = vec![0usize; want.len()];
            let stop = AtomicBool::new(false);
            std::thread::scope(|s| {
                s.spawn(|| {
                    for (t, (layout, src)) in sources.iter().enumerate() {
                        let packed = layout.check(src.len() as u64).expect("fits");
                        tx.send(t as u64, packed, &stop, Duration::ZERO, |offset, dst| {
                            layout.gather(src, offset, dst).map_err(Into::into)
                        })
                        .expect("send");
                    }
                });
                let expected: usize = want.iter().map(|w| w.len().div_ceil(chunk).max(1)).sum();
                let mut landed = 0;
                while landed < expected {
                    let moved = rx
                        .next(Duration::ZERO, |h, bytes| {
                            let dst = &mut got[h.transfer as usize];
                            let at = h.offset as usize;
                            dst[at..at + bytes.len()].copy_from_slice(bytes);
                            chunks[h.transfer as usize] += 1;
                            Ok(())
                        })
                        .expect("land");
                    landed += usize::from(moved);
                }
            });
            proptest::prop_assert_eq!(got, want);
            for (n, (layout, src)) in chunks.iter().zip(&sources) {
                let packed = layout.check(src.len() as u64).expect("fits") as usize;
                proptest::prop_assert_eq!(*n, packed.div_ceil(chunk).max(1));
            }
        }
    }

    #[test]
    fn auto_picks_a_listed_size() {
        assert!(AUTO_SIZES.contains(&auto_chunk(None)));
    }
}
