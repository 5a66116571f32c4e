//! Buffers a node published under keys, for its peers to fetch: the table the node's API
//! fills and every peer's transfer actor reads when a fetch arrives.
//!
//! A fetch is served by an ordinary send of a read-only handle on the published buffer
//! ([`Buffer::read_only_handle`]), so it takes the route any send to that peer takes, and
//! several peers read one buffer at once. Unpublishing takes the key out of the table (no
//! new fetch finds it), then waits until the last handle came back: only then does no peer
//! read the memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use ferry_transports::memory::Buffer;
use ferry_transports::wire::{FetchRefusal, Layout, MAX_KEY_LEN};
use tokio::sync::Notify;

use crate::error::Error;

pub mod region;

/// What a published key has served so far (the exporter's side of single flight: a node
/// whose callers fetch a key many times at once asks for it once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PublicationStats {
    /// The published buffer's length in bytes.
    pub len: u64,
    /// Fetches answered with the bytes (every one crossed the link).
    pub served: u64,
    /// Bytes those fetches moved.
    pub bytes_served: u64,
    /// Fetches refused (a layout that does not fit, a peer not allowed).
    pub refused: u64,
    /// Fetches being served now.
    pub reading: u64,
}

/// One published buffer (or registered region).
#[derive(Debug)]
struct Publication {
    /// Written only for a region a write lands in (under the write lock, on a blocking
    /// thread, while no peer reads it); read otherwise, never blocking (`try_read`).
    buffer: std::sync::RwLock<Buffer>,
    /// Its length in bytes.
    len: u64,
    /// For a registered region: who may write it (`None`: an ordinary publication).
    access: Option<region::Access>,
    /// Set once it is out of the table: no write lands in it after that.
    retired: std::sync::atomic::AtomicBool,
    /// The peers that may fetch it; `None`: every peer.
    readers: Option<Vec<String>>,
    served: AtomicU64,
    bytes_served: AtomicU64,
    refused: AtomicU64,
    reading: AtomicU64,
    /// Woken when a fetch being served ends (unpublish waits for the last).
    ended: Arc<Notify>,
}

impl Publication {
    /// True when no handle on its buffer is out (nothing reads it). A buffer locked for a
    /// write counts as read: the write ends soon.
    fn exclusive(&self) -> bool {
        try_read(&self.buffer).is_some_and(|b| b.is_exclusive())
    }
}

/// The read lock of `lock` if it is free now (a poisoned lock is taken as it is).
fn try_read(lock: &std::sync::RwLock<Buffer>) -> Option<std::sync::RwLockReadGuard<'_, Buffer>> {
    match lock.try_read() {
        Ok(guard) => Some(guard),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Checks an application key: not empty, at most [`MAX_KEY_LEN`] bytes.
///
/// # Errors
/// [`Error::Usage`] naming what is wrong.
pub fn check_key(key: &str) -> Result<(), Error> {
    if key.is_empty() {
        return Err(Error::Usage("a key must not be empty".into()));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(Error::Usage(format!(
            "a key takes at most {MAX_KEY_LEN} bytes, this one {}",
            key.len()
        )));
    }
    Ok(())
}

/// The node's published buffers, by key.
#[derive(Debug, Default)]
pub struct Publications {
    by_key: DashMap<String, Arc<Publication>>,
}

/// A fetch being served: the read-only handle to send, and what counts it. Dropped when
/// the send ended (the handle came back or was dropped).
#[derive(Debug)]
pub struct Serving {
    publication: Arc<Publication>,
    len: u64,
}

impl Serving {
    /// The bytes the fetch moves: the layout's packed length in the buffer.
    pub fn packed(&self) -> u64 {
        self.len
    }

    /// The send of the handle ended: counted as served when it moved the bytes.
    pub fn end(self, moved: bool) {
        if moved {
            self.publication.served.fetch_add(1, Ordering::Relaxed);
            self.publication
                .bytes_served
                .fetch_add(self.len, Ordering::Relaxed);
            metrics::counter!("ferry_fetches_served_total").increment(1);
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.publication.reading.fetch_sub(1, Ordering::AcqRel);
        self.publication.ended.notify_waiters();
    }
}

impl Publications {
    /// Publishes `buffer` under `key` for `readers` (every peer when `None`).
    ///
    /// # Errors
    /// [`Error::Usage`] for a bad key or one already published; the buffer comes back.
    pub fn publish(
        &self,
        key: String,
        buffer: Buffer,
        readers: Option<Vec<String>>,
    ) -> Result<(), (Error, Buffer)> {
        if let Err(e) = check_key(&key) {
            return Err((e, buffer));
        }
        if key.starts_with(region::REGION_KEYS) {
            return Err((
                Error::Usage(format!(
                    "keys starting with {:?} name registered regions",
                    region::REGION_KEYS
                )),
                buffer,
            ));
        }
        self.insert(key, buffer, readers, None)
    }

    /// Puts `buffer` in the table under `key` (checked already).
    fn insert(
        &self,
        key: String,
        buffer: Buffer,
        readers: Option<Vec<String>>,
        access: Option<region::Access>,
    ) -> Result<(), (Error, Buffer)> {
        if !buffer.is_exclusive() {
            // Unpublish waits for the buffer to be the only handle again: with another
            // handle out (a shared fetch's) it never would be.
            return Err((
                Error::Usage(
                    "the buffer is shared (a read-only handle): publish a buffer of your own"
                        .into(),
                ),
                buffer,
            ));
        }
        match self.by_key.entry(key) {
            Entry::Occupied(e) => Err((
                Error::Usage(format!(
                    "key {:?} is published already (unpublish it first)",
                    e.key()
                )),
                buffer,
            )),
            Entry::Vacant(e) => {
                metrics::gauge!("ferry_published_bytes").increment(buffer.len() as f64);
                e.insert(Arc::new(Publication {
                    len: buffer.len() as u64,
                    buffer: std::sync::RwLock::new(buffer),
                    access,
                    retired: std::sync::atomic::AtomicBool::new(false),
                    readers,
                    served: AtomicU64::new(0),
                    bytes_served: AtomicU64::new(0),
                    refused: AtomicU64::new(0),
                    reading: AtomicU64::new(0),
                    ended: Arc::default(),
                }));
                Ok(())
            }
        }
    }

    /// A handle on the buffer under `key` for `peer` to read the bytes `layout` names, and
    /// what counts the fetch; or why not.
    ///
    /// # Errors
    /// The refusal to tell the peer, with its detail.
    pub fn serve(
        &self,
        peer: &str,
        key: &str,
        layout: &Layout,
    ) -> Result<(Buffer, Serving), (FetchRefusal, String)> {
        let publication = self
            .by_key
            .get(key)
            .map(|p| Arc::clone(p.value()))
            .ok_or_else(|| {
                (
                    FetchRefusal::UnknownKey,
                    format!("nothing is published under key {key:?}"),
                )
            })?;
        let refuse = |reason, detail| {
            publication.refused.fetch_add(1, Ordering::Relaxed);
            Err((reason, detail))
        };
        if let Some(readers) = &publication.readers
            && !readers.iter().any(|r| r == peer)
        {
            return refuse(
                FetchRefusal::NotAllowed,
                format!("key {key:?} is published for other peers, not for {peer}"),
            );
        }
        let len = match layout.check(publication.len) {
            Ok(len) => len,
            Err(e) => {
                return refuse(
                    FetchRefusal::Layout,
                    format!(
                        "the layout asked for does not fit key {key:?} ({} bytes): {e}",
                        publication.len
                    ),
                );
            }
        };
        // A region being written right now (its lock held for the copy into it) is not
        // waited for on this thread: the peer hears it is busy and asks again.
        let Some(buffer) = try_read(&publication.buffer) else {
            return refuse(
                FetchRefusal::Busy,
                format!("region {key:?} is being written this moment"),
            );
        };
        publication.reading.fetch_add(1, Ordering::AcqRel);
        let handle = buffer.read_only_handle();
        drop(buffer);
        Ok((handle, Serving { publication, len }))
    }

    /// What `key` has served, while it is published.
    pub fn stats(&self, key: &str) -> Option<PublicationStats> {
        self.by_key.get(key).map(|p| PublicationStats {
            len: p.len,
            served: p.served.load(Ordering::Relaxed),
            bytes_served: p.bytes_served.load(Ordering::Relaxed),
            refused: p.refused.load(Ordering::Relaxed),
            reading: p.reading.load(Ordering::Acquire),
        })
    }

    /// The keys published now.
    pub fn keys(&self) -> Vec<String> {
        self.by_key.iter().map(|p| p.key().clone()).collect()
    }

    /// Takes `key` out of the table (no new fetch finds it), waits until no fetch reads
    /// the buffer any more, at most `wait`, and gives it back.
    ///
    /// # Errors
    /// [`Error::Usage`] for a key not published; [`Error::DeadlineExceeded`] when a peer
    /// still reads it after `wait` (the buffer is then freed once the last reader let go).
    pub async fn unpublish(&self, key: &str, wait: std::time::Duration) -> Result<Buffer, Error> {
        let (_, publication) = self
            .by_key
            .remove(key)
            .ok_or_else(|| Error::Usage(format!("nothing is published under key {key:?}")))?;
        publication.retired.store(true, Ordering::Release);
        metrics::gauge!("ferry_published_bytes").decrement(publication.len as f64);
        let until = tokio::time::Instant::now() + wait;
        let notify = Arc::clone(&publication.ended);
        // Only the fetches being served hold it now: its count only goes down.
        let mut publication = Some(publication);
        loop {
            // Made before the check, so an end between the two is not missed.
            let ended = notify.notified();
            if let Some(p) = publication.take_if(|p| Arc::strong_count(p) == 1 && p.exclusive())
                && let Ok(p) = Arc::try_unwrap(p)
            {
                return Ok(p
                    .buffer
                    .into_inner()
                    .unwrap_or_else(std::sync::PoisonError::into_inner));
            }
            // A handle may also come back without a fetch ending (a transport dropping its
            // last view): looked at again every few milliseconds.
            let tick = tokio::time::Instant::now() + std::time::Duration::from_millis(5);
            if tokio::time::Instant::now() >= until {
                return Err(Error::DeadlineExceeded);
            }
            let _ = tokio::time::timeout_at(tick.min(until), ended).await;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use ferry_transports::memory::{BufferId, Generation, Lease, MemoryKind, Releaser};

    struct Free;
    impl Releaser for Free {
        fn release(&self, _: &Lease) {}
    }

    /// `len` bytes of host memory that belong to no budget.
    pub(crate) fn buffer(len: u64) -> Buffer {
        let lease = Lease {
            kind: MemoryKind::Host,
            id: BufferId(1),
            generation: Generation(1),
            len,
        };
        Buffer::new_host(lease, Arc::new(Free))
    }

    #[test]
    fn keys_are_checked_and_unique() {
        let p = Publications::default();
        assert!(p.publish(String::new(), buffer(4), None).is_err());
        assert!(
            p.publish("k".repeat(MAX_KEY_LEN + 1), buffer(4), None)
                .is_err()
        );
        p.publish("a".into(), buffer(4), None).expect("first");
        let (e, back) = p.publish("a".into(), buffer(8), None).expect_err("twice");
        assert!(e.to_string().contains("published already"), "{e}");
        assert_eq!(back.len(), 8, "the buffer comes back");
        let handle = back.read_only_handle();
        let (e, _) = p.publish("b".into(), back, None).expect_err("shared");
        assert!(e.to_string().contains("shared"), "{e}");
        drop(handle);
    }

    #[test]
    fn refusals_name_their_reason() {
        let p = Publications::default();
        p.publish("a".into(), buffer(16), Some(vec!["b".into()]))
            .expect("publish");
        let refusal = |peer, key, layout| {
            p.serve(peer, key, &layout)
                .map(|_| ())
                .expect_err("refused")
                .0
        };
        assert_eq!(
            refusal("b", "x", Layout::Contiguous),
            FetchRefusal::UnknownKey
        );
        assert_eq!(
            refusal("c", "a", Layout::Contiguous),
            FetchRefusal::NotAllowed
        );
        let past = Layout::blocks([(8, 16)]);
        assert_eq!(refusal("b", "a", past), FetchRefusal::Layout);
        assert_eq!(p.stats("a").map(|s| s.refused), Some(2));
    }

    #[tokio::test]
    async fn unpublish_waits_for_its_readers() {
        let p = Arc::new(Publications::default());
        p.publish("a".into(), buffer(16), None).expect("publish");
        let (handle, serving) = p.serve("b", "a", &Layout::Contiguous).expect("serve");
        assert_eq!(p.stats("a").map(|s| s.reading), Some(1));
        let waiting = tokio::spawn({
            let p = Arc::clone(&p);
            async move { p.unpublish("a", std::time::Duration::from_secs(5)).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "a reader still holds it");
        assert!(
            p.serve("b", "a", &Layout::Contiguous).is_err(),
            "gone for new fetches"
        );
        drop(handle);
        serving.end(true);
        let back = waiting.await.expect("joined").expect("unpublished");
        assert!(back.is_exclusive());
        assert_eq!(back.len(), 16);
    }

    #[tokio::test]
    async fn unpublish_gives_up_at_its_deadline() {
        let p = Publications::default();
        p.publish("a".into(), buffer(16), None).expect("publish");
        let (_handle, _serving) = p.serve("b", "a", &Layout::Contiguous).expect("serve");
        let e = p
            .unpublish("a", std::time::Duration::from_millis(30))
            .await
            .expect_err("held");
        assert!(matches!(e, Error::DeadlineExceeded));
    }
}
