//! Registered regions: memory the application owns, lent in place to its peers for
//! one-sided reads and, where registered writable, writes. A region is a publication under
//! a key of its own ([`key_name`]: its id and the generation of its registration), so a
//! peer's read is a fetch of that key (served by a read-only handle, the transport's own
//! path) and unregistering waits for the reads being served as unpublishing does. A key of
//! an earlier registration names nothing: it is refused, never served.
//!
//! A write lands in a region under the region's write lock, on a blocking thread, once no
//! peer reads it (the readers' handles are out: the bytes are not written under a peer's
//! read); a read asked for meanwhile is refused as busy and asked again by the reader.

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use ferry_transports::memory::{MemoryError, MemoryKind};
use ferry_transports::region::RegionKey;
use ferry_transports::wire::RegionWrite;

use super::*;

/// A write of at most this many bytes of host memory into a host region is copied on the
/// calling thread (no blocking thread's hop).
const INLINE_HOST_COPY: usize = 256 << 10;

/// The prefix of the keys regions are published under; no application key starts with it.
pub const REGION_KEYS: &str = "ferry.region/";

/// What a region's peers may do with it. The node that registered it writes it with its
/// own reads (`Node::read` lands there) whatever the access.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    /// Peers read it; a peer's write is refused ([`crate::RefusalReason::ReadOnly`]).
    #[default]
    ReadOnly,
    /// Peers read and write it.
    ReadWrite,
}

/// The key a region is published under.
pub fn key_name(region: u64, generation: u64) -> String {
    format!("{REGION_KEYS}{region}.{generation}")
}

/// Why a region cannot take a write: the reason a peer hears, and the detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unwritable {
    /// The wire's reason.
    pub reason: ferry_transports::wire::WireReason,
    /// What is wrong, for the log and the writer's error.
    pub detail: String,
}

impl Publications {
    /// Registers `buffer` as region `key` with `access`.
    ///
    /// # Errors
    /// [`Error::Usage`] for a buffer shared already; the buffer comes back.
    pub fn register(
        &self,
        key: &RegionKey,
        buffer: Buffer,
        access: Access,
    ) -> Result<(), (Error, Buffer)> {
        self.insert(
            key_name(key.region, key.generation),
            buffer,
            None,
            Some(access),
        )
    }

    /// Ends region `key`: no peer finds it any more, and once no read of it is served (at
    /// most `wait`) its buffer comes back.
    ///
    /// # Errors
    /// [`Error::Usage`] for a key not registered here; else as [`Self::unpublish`].
    pub async fn unregister(&self, key: &RegionKey, wait: Duration) -> Result<Buffer, Error> {
        let name = key_name(key.region, key.generation);
        if self.by_key.get(&name).is_none_or(|p| p.access.is_none()) {
            return Err(stale(key.region, key.generation));
        }
        self.unpublish(&name, wait).await
    }

    /// Checks that `key` names a region of this node's of its length.
    ///
    /// # Errors
    /// [`Error::Usage`] naming the key.
    pub fn check_local(&self, key: &RegionKey) -> Result<(), Error> {
        self.region(key.region, key.generation)
            .filter(|r| r.len == key.len)
            .map(drop)
            .ok_or_else(|| stale(key.region, key.generation))
    }

    /// The region `region` of `generation`, if registered.
    fn region(&self, region: u64, generation: u64) -> Option<Arc<Publication>> {
        self.by_key
            .get(&key_name(region, generation))
            .filter(|p| p.access.is_some())
            .map(|p| Arc::clone(p.value()))
    }

    /// Whether a peer's write of `packed` bytes into `into` can land: refused before a
    /// byte moves when the region is gone, read-only, or the places do not fit it.
    pub fn check_write(&self, into: &RegionWrite, packed: u64) -> Result<(), Unwritable> {
        use ferry_transports::wire::WireReason;
        let Some(region) = self.region(into.region, into.generation) else {
            return Err(Unwritable {
                reason: WireReason::StaleKey,
                detail: stale(into.region, into.generation).to_string(),
            });
        };
        if region.access != Some(Access::ReadWrite) {
            return Err(Unwritable {
                reason: WireReason::ReadOnly,
                detail: format!("region {} is registered read-only", into.region),
            });
        }
        let fits = into
            .layout
            .check_destination(region.len)
            .map_err(|e| e.to_string())
            .and_then(|n| {
                (n == packed)
                    .then_some(())
                    .ok_or_else(|| format!("its places hold {n} bytes, the write carries {packed}"))
            });
        fits.map_err(|why| Unwritable {
            reason: WireReason::Protocol,
            detail: format!(
                "a write into region {} ({} bytes) that does not fit: {why}",
                into.region, region.len
            ),
        })
    }

    /// A read-only handle on region `key` for a write of this node's own from it, counted
    /// as a read (the region is not written, nor unregistered, until it is dropped).
    ///
    /// # Errors
    /// [`Error::Usage`] for a key not registered here; [`Error::QueueFull`] while a write
    /// lands in it this moment.
    pub fn read_region(&self, key: &RegionKey) -> Result<(Buffer, Serving), Error> {
        let region = self
            .region(key.region, key.generation)
            .filter(|r| r.len == key.len)
            .ok_or_else(|| stale(key.region, key.generation))?;
        let Some(buffer) = super::try_read(&region.buffer) else {
            return Err(Error::QueueFull(format!(
                "region {} is being written this moment",
                key.region
            )));
        };
        region.reading.fetch_add(1, Ordering::AcqRel);
        let handle = buffer.read_only_handle();
        drop(buffer);
        let len = region.len;
        Ok((
            handle,
            Serving {
                publication: region,
                len,
            },
        ))
    }

    /// Places `packed` in region `region` of `generation` where `layout` says (packed bytes
    /// in order), once no read of it is served, at most until `until`; the copy runs on a
    /// blocking thread of `io` (a device copy waits for its stream). Gives `packed` back.
    ///
    /// # Errors
    /// [`Error::Usage`] for a region not registered (or gone meanwhile), places that do
    /// not fit it; [`Error::DeadlineExceeded`] when peers still read it at `until`; the
    /// copy's error.
    pub async fn write_region(
        &self,
        (region, generation): (u64, u64),
        mut packed: Buffer,
        layout: &Layout,
        until: tokio::time::Instant,
        (io, abort): (&tokio::runtime::Handle, Option<Arc<AtomicBool>>),
    ) -> Result<Buffer, Error> {
        let target = self
            .region(region, generation)
            .ok_or_else(|| stale(region, generation))?;
        let asked = std::time::Instant::now();
        let packed_len = packed.len();
        let placed = |how: &str, copy: std::time::Instant| {
            tracing::trace!(
                target: crate::TRACE_BLOCKS,
                region,
                bytes = packed_len,
                how,
                wait_us = copy.duration_since(asked).as_micros() as u64,
                copy_us = copy.elapsed().as_micros() as u64,
                "placed in a region"
            );
        };
        loop {
            // Made before the check, so a read ending between the two is not missed.
            let ended = target.ended.notified();
            if target.reading.load(Ordering::Acquire) == 0 {
                // A small host copy is made here, if the lock is free: a thread's hop would
                // cost more than the copy.
                let copy = std::time::Instant::now();
                let small = packed.len() <= INLINE_HOST_COPY && packed.kind() == MemoryKind::Host;
                let inline = small
                    .then(|| try_write(&target.buffer))
                    .flatten()
                    .filter(|buffer| buffer.kind() == MemoryKind::Host)
                    .map(|buffer| place(&target, buffer, &packed, layout, abort.as_deref()));
                // Placed here (not on a blocking thread): said by the trace.
                let here = inline.is_some();
                let placed_now = match inline {
                    Some(done) => done,
                    None => {
                        let (into, places, abort) =
                            (Arc::clone(&target), layout.clone(), abort.clone());
                        let (back, done) = io
                            .spawn_blocking(move || {
                                let buffer = into
                                    .buffer
                                    .write()
                                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                                let done = place(&into, buffer, &packed, &places, abort.as_deref());
                                (packed, done)
                            })
                            .await
                            .map_err(|_| Error::ShuttingDown)?;
                        packed = back;
                        done
                    }
                };
                match placed_now {
                    Ok(()) => {
                        placed(if here { "inline" } else { "blocking" }, copy);
                        return Ok(packed);
                    }
                    // A handle came out meanwhile: waited for as a read.
                    Err(Unplaced::Busy) => {}
                    Err(Unplaced::Gone) => return Err(stale(region, generation)),
                    Err(Unplaced::Abandoned) => return Err(Error::Cancelled),
                    Err(Unplaced::Failed(e)) => {
                        return Err(Error::Usage(format!(
                            "the bytes cannot go into region {region}: {e}"
                        )));
                    }
                }
            }
            let now = tokio::time::Instant::now();
            if now >= until {
                return Err(Error::DeadlineExceeded);
            }
            // A handle may also come back without a read ending (a transport dropping its
            // last view): looked at again every few milliseconds.
            let tick = now + Duration::from_millis(5);
            let _ = tokio::time::timeout_at(tick.min(until), ended).await;
        }
    }
}

/// Why bytes were not placed in a region this time.
enum Unplaced {
    /// A handle on it is out: waited for.
    Busy,
    /// It was unregistered meanwhile.
    Gone,
    /// The transfer that carried them was abandoned meanwhile.
    Abandoned,
    /// The copy failed.
    Failed(MemoryError),
}

/// Places `packed` into `target`'s buffer (held by `buffer`, its write guard) where
/// `layout` says, unless the region was unregistered or the transfer abandoned meanwhile
/// (looked at under the lock: nothing lands after either).
fn place(
    target: &Publication,
    mut buffer: std::sync::RwLockWriteGuard<'_, Buffer>,
    packed: &Buffer,
    layout: &Layout,
    abort: Option<&AtomicBool>,
) -> Result<(), Unplaced> {
    if target.retired.load(Ordering::Acquire) {
        return Err(Unplaced::Gone);
    }
    if abort.is_some_and(|a| a.load(Ordering::Acquire)) {
        return Err(Unplaced::Abandoned);
    }
    match buffer.scatter_from(packed, layout) {
        Ok(()) => Ok(()),
        Err(MemoryError::Shared) => Err(Unplaced::Busy),
        Err(e) => Err(Unplaced::Failed(e)),
    }
}

/// The write lock of `lock` if it is free now (a poisoned lock is taken as it is: a panic
/// in an earlier copy leaves the bytes as they were written).
fn try_write(lock: &std::sync::RwLock<Buffer>) -> Option<std::sync::RwLockWriteGuard<'_, Buffer>> {
    match lock.try_write() {
        Ok(guard) => Some(guard),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// The error for a region key that names nothing here.
fn stale(region: u64, generation: u64) -> Error {
    Error::Usage(format!(
        "region {region} (generation {generation}) is not registered: unregistered, or a key \
         of an earlier registration"
    ))
}

#[cfg(test)]
mod tests {
    use super::super::tests::buffer;
    use super::*;
    use ferry_transports::wire::WireReason;

    fn key(region: u64, len: u64) -> RegionKey {
        RegionKey {
            region,
            generation: 1,
            len,
        }
    }

    fn into(region: u64, generation: u64, layout: Layout) -> RegionWrite {
        RegionWrite {
            region,
            generation,
            layout,
        }
    }

    #[test]
    fn writes_are_checked_before_anything_moves() {
        let p = Publications::default();
        p.register(&key(1, 64), buffer(64), Access::ReadWrite)
            .expect("register");
        p.register(&key(2, 64), buffer(64), Access::ReadOnly)
            .expect("register");
        let blocks = Layout::blocks([(0, 8), (32, 8)]);
        assert_eq!(p.check_write(&into(1, 1, blocks.clone()), 16), Ok(()));
        let reason = |w: RegionWrite, n| p.check_write(&w, n).expect_err("refused").reason;
        assert_eq!(reason(into(1, 2, blocks.clone()), 16), WireReason::StaleKey);
        assert_eq!(reason(into(3, 1, blocks.clone()), 16), WireReason::StaleKey);
        assert_eq!(reason(into(2, 1, blocks.clone()), 16), WireReason::ReadOnly);
        assert_eq!(reason(into(1, 1, blocks), 24), WireReason::Protocol);
        let overlap = Layout::blocks([(0, 8), (4, 8)]);
        assert_eq!(reason(into(1, 1, overlap), 16), WireReason::Protocol);
        let past = Layout::blocks([(60, 8)]);
        assert_eq!(reason(into(1, 1, past), 8), WireReason::Protocol);
        // An application key may not pose as a region.
        let (e, _) = p
            .publish(key_name(9, 1), buffer(4), None)
            .expect_err("reserved");
        assert!(e.to_string().contains("registered regions"), "{e}");
    }

    #[tokio::test]
    async fn a_write_waits_for_the_reads_and_lands_where_it_says() {
        let p = Arc::new(Publications::default());
        let k = key(1, 16);
        p.register(&k, buffer(16), Access::ReadWrite)
            .expect("register");
        let (handle, serving) = p.read_region(&k).expect("read");
        let io = tokio::runtime::Handle::current();
        let mut packed = buffer(4);
        packed.write(0, &[1, 2, 3, 4]).expect("fill");
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        let write = {
            let p = Arc::clone(&p);
            let io = io.clone();
            tokio::spawn(async move {
                let layout = Layout::blocks([(12, 2), (2, 2)]);
                p.write_region((1, 1), packed, &layout, until, (&io, None))
                    .await
            })
        };
        // Not while the read holds its handle.
        tokio::task::yield_now().await;
        assert!(!write.is_finished());
        drop((handle, serving));
        write.await.expect("task").expect("written");
        let back = p
            .unregister(&k, Duration::from_secs(1))
            .await
            .expect("unregister");
        let bytes = back.to_vec().expect("bytes");
        assert_eq!(&bytes[12..14], &[1, 2]);
        assert_eq!(&bytes[2..4], &[3, 4]);
        assert!(p.unregister(&k, Duration::from_secs(1)).await.is_err());
        let late = p
            .write_region((1, 1), buffer(4), &Layout::Contiguous, until, (&io, None))
            .await;
        assert!(late.is_err_and(|e| e.to_string().contains("not registered")));
    }
}
