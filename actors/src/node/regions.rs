//! Registered regions and one-sided block transfers between them: memory the application
//! owns (an engine's KV cache) registered in place once, then read from and written into
//! by peers, as block lists on both sides (gather at one end, scatter at the other).
//!
//! A read is a fetch of the peer's region (its layout's bytes, packed, over the route any
//! transfer to the peer takes) placed into this node's region where the local places say;
//! a write is a send of this node's region (its layout's bytes) that the peer places into
//! its region before it answers `Done`, so a write that returned is in place at the peer.
//! An optional notification is an ordinary send under its tag after the data is in place.

use ferry_transports::wire::RegionWrite;

use super::*;
use crate::publish::region::{Access, key_name};

/// Places in a region: the region's key and the blocks of it an operation reads or writes
/// (packed in order). Both sides of an operation name places; their shapes may differ
/// (gather at one end, scatter at the other), their packed lengths must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Places {
    /// The region.
    pub region: RegionKey,
    /// Which bytes of it: [`Layout::Contiguous`] for all of it, a block list, rows.
    pub layout: Layout,
}

impl Places {
    /// The whole region.
    pub fn whole(region: RegionKey) -> Self {
        Self {
            region,
            layout: Layout::Contiguous,
        }
    }

    /// `(offset, len)` blocks of the region.
    pub fn blocks(region: RegionKey, blocks: impl IntoIterator<Item = (u64, u64)>) -> Self {
        Self {
            region,
            layout: Layout::blocks(blocks),
        }
    }

    /// `count` blocks of `len` bytes, the first at `offset`, `stride` bytes apart (NIXL's
    /// strided form).
    pub fn strided(region: RegionKey, offset: u64, len: u64, stride: u64, count: u64) -> Self {
        let at = move |i: u64| offset.saturating_add(i.saturating_mul(stride));
        Self::blocks(region, (0..count).map(move |i| (at(i), len)))
    }
}

/// Options of a one-sided read or write.
#[derive(Debug, Clone, Default)]
pub struct OneSided {
    /// When the operation must have ended; the node's default deadline when `None`.
    pub deadline: Option<Instant>,
    /// A notification for the peer's `recv`: this tag and these bytes, sent once the data
    /// is in place (after a write, in the peer's region; after a read, here) as a send of
    /// host memory, over the route host memory takes to the peer or, where the rules give
    /// it none, over the link itself.
    pub notify: Option<(u64, Vec<u8>)>,
}

impl Node {
    /// Registers `buffer` (memory of this node's, host or device) as a region peers may
    /// read and, with [`Access::ReadWrite`], write; give the key to the peer (it is small:
    /// [`RegionKey::to_bytes`]). The buffer is this node's until [`Self::unregister`].
    ///
    /// # Errors
    /// [`Error::Usage`] for a buffer shared already (a read-only handle); the buffer comes
    /// back.
    pub fn register(&self, buffer: Buffer, access: Access) -> Result<RegionKey, SendError> {
        let key = RegionKey {
            region: self.next_region.fetch_add(1, Ordering::Relaxed),
            generation: buffer.lease().generation.0,
            len: buffer.len() as u64,
        };
        self.published
            .register(&key, buffer, access)
            .map_err(|(error, buffer)| SendError {
                error,
                buffer: Some(buffer),
            })?;
        Ok(key)
    }

    /// Ends region `key`: no peer reads or writes it from now (their key is stale), and
    /// once no peer's read of it is being served, its buffer comes back.
    ///
    /// # Errors
    /// [`Error::Usage`] for a key not registered here; [`Error::DeadlineExceeded`] when a
    /// peer still reads it after the default deadline plus `memory.export_lease_timeout`
    /// (the buffer is freed once the last reader let go).
    pub async fn unregister(&self, key: RegionKey) -> Result<Buffer, Error> {
        let wait = self.config.limits.default_deadline + self.config.memory.export_lease_timeout;
        self.published.unregister(&key, wait).await
    }

    /// Reads the places `from` of `peer`'s region into the places `into` of a region of
    /// this node's. Resolves once the bytes are in place here (then the notification, if
    /// any, goes to the peer), with the transport that carried them. Concurrent reads of
    /// the same places of the same peer's region share one transfer (single flight, as
    /// fetches do); each places the bytes itself.
    ///
    /// # Errors
    /// [`Error::Usage`] before anything moves for places that do not fit their region or
    /// whose packed lengths differ, or a local region not registered;
    /// [`Error::Refused`] with [`crate::RefusalReason::StaleKey`] for a key of the peer's
    /// that names nothing there now; [`Error::DeadlineExceeded`]; else as [`Self::fetch`].
    pub async fn read(
        &self,
        peer: &str,
        from: Places,
        into: Places,
        options: OneSided,
    ) -> Result<ferry_config::TransportName, Error> {
        let packed = matching(&from, &into)?;
        self.published.check_local(&into.region)?;
        let deadline = options.deadline.unwrap_or_else(|| self.default_deadline());
        let key = key_name(from.region.region, from.region.generation);
        let fetch = crate::fetch::Fetch {
            layout: from.layout,
            into: None,
            shared: true,
            deadline: Some(deadline),
        };
        let mut backoff = Duration::from_micros(20);
        let asked = Instant::now();
        let (landed, transport) = loop {
            match self.fetch(peer, &key, fetch.clone()).await {
                Ok(fetched) => break (fetched.buffer, fetched.transport),
                Err(Error::Refused {
                    peer,
                    reason: crate::RefusalReason::UnknownKey,
                    detail,
                }) => {
                    return Err(Error::Refused {
                        peer,
                        reason: crate::RefusalReason::StaleKey,
                        detail,
                    });
                }
                // Written this moment at the peer (or its fetches are many): asked again.
                Err(Error::QueueFull(_)) => {
                    if Instant::now() + backoff >= deadline {
                        return Err(Error::DeadlineExceeded);
                    }
                    self.pause(backoff).await?;
                    backoff = (backoff * 2).min(Duration::from_millis(1));
                }
                Err(e) => return Err(e),
            }
        };
        debug_assert_eq!(landed.len() as u64, packed);
        let fetched = Instant::now();
        let io = self.io_handle()?;
        let until = tokio::time::Instant::from_std(deadline);
        let region = (into.region.region, into.region.generation);
        let placed = self
            .published
            .write_region(region, landed, &into.layout, until, (&io, None))
            .await;
        drop(placed?);
        tracing::trace!(
            target: crate::TRACE_BLOCKS,
            bytes = packed,
            fetch_us = fetched.duration_since(asked).as_micros() as u64,
            place_us = fetched.elapsed().as_micros() as u64,
            "read"
        );
        self.notify(peer, options.notify, deadline).await?;
        Ok(transport)
    }

    /// Writes the places `from` of a region of this node's into the places `into` of
    /// `peer`'s region (registered there with [`Access::ReadWrite`]). Resolves once the
    /// peer has the bytes in place (then the notification, if any, goes to it).
    ///
    /// A write lands once no read of the destination region is served, and the source
    /// region counts as read until the write ends: two nodes writing at once each from
    /// the region the other writes into wait on each other until their deadlines. Send
    /// from one region and receive into another (a KV cache's prefill and decode pools
    /// are).
    ///
    /// # Errors
    /// [`Error::Usage`] before anything moves for places that do not fit their region or
    /// whose packed lengths differ, or a local region not registered;
    /// [`Error::Refused`] with [`crate::RefusalReason::StaleKey`] (the peer's key names
    /// nothing there now) or [`crate::RefusalReason::ReadOnly`]; else as [`Self::send`].
    pub async fn write(
        &self,
        peer: &str,
        from: Places,
        into: Places,
        options: OneSided,
    ) -> Result<(), Error> {
        let packed = matching(&from, &into)?;
        let deadline = options.deadline.unwrap_or_else(|| self.default_deadline());
        let mut backoff = Duration::from_micros(20);
        let (handle, serving) = loop {
            match self.published.read_region(&from.region) {
                Ok(read) => break read,
                // Our own read lands in it this moment.
                Err(Error::QueueFull(_)) if Instant::now() + backoff < deadline => {
                    self.pause(backoff).await?;
                    backoff = (backoff * 2).min(Duration::from_millis(1));
                }
                Err(Error::QueueFull(_)) => return Err(Error::DeadlineExceeded),
                Err(e) => return Err(e),
            }
        };
        let shape = Shape {
            tag: 0,
            layout: from.layout,
            packed,
            into: Some(RegionWrite {
                region: into.region.region,
                generation: into.region.generation,
                layout: into.layout,
            }),
            over_link: false,
        };
        let handle_of = self.peers.handle(peer);
        let asked = Instant::now();
        let sent = self
            .send_routed(peer, &handle_of, handle, shape, deadline)
            .await;
        // The handle back (or gone with the error) before the read of the region ends.
        let sent = sent.map(drop).map_err(|e| e.error);
        drop(serving);
        tracing::trace!(
            target: crate::TRACE_BLOCKS,
            bytes = packed,
            write_us = asked.elapsed().as_micros() as u64,
            "written"
        );
        sent?;
        self.notify(peer, options.notify, deadline).await
    }

    /// Sends `notify`'s bytes under its tag to `peer`, if there is one.
    async fn notify(
        &self,
        peer: &str,
        notify: Option<(u64, Vec<u8>)>,
        deadline: Instant,
    ) -> Result<(), Error> {
        let Some((tag, bytes)) = notify else {
            return Ok(());
        };
        let mut note = self.alloc(MemoryKind::Host, bytes.len()).await?;
        note.write(0, &bytes)
            .map_err(|e| Error::Usage(format!("the notification: {e}")))?;
        let handle = self.peers.handle(peer);
        let shape = Shape {
            tag,
            layout: Layout::Contiguous,
            packed: bytes.len() as u64,
            into: None,
            over_link: true,
        };
        self.send_routed(peer, &handle, note, shape, deadline)
            .await
            .map(drop)
            .map_err(|e| e.error)
    }

    /// The node's I/O runtime.
    fn io_handle(&self) -> Result<tokio::runtime::Handle, Error> {
        self.io
            .as_ref()
            .map(|io| io.handle().clone())
            .ok_or(Error::ShuttingDown)
    }

    /// Waits `wait` on the node's I/O runtime (whatever runtime the caller runs on).
    async fn pause(&self, wait: Duration) -> Result<(), Error> {
        let io = self.io_handle()?;
        io.spawn(tokio::time::sleep(wait))
            .await
            .map_err(|_| Error::ShuttingDown)
    }
}

/// The packed length both places name, or why they do not match.
fn matching(from: &Places, into: &Places) -> Result<u64, Error> {
    let packed = from.layout.check(from.region.len).map_err(|e| {
        Error::Usage(format!(
            "the places read do not fit region {} ({} bytes): {e}",
            from.region.region, from.region.len
        ))
    })?;
    let room = into
        .layout
        .check_destination(into.region.len)
        .map_err(|e| {
            Error::Usage(format!(
                "the places written do not fit region {} ({} bytes): {e}",
                into.region.region, into.region.len
            ))
        })?;
    if packed != room {
        return Err(Error::Usage(format!(
            "the places read hold {packed} bytes, the places written {room}"
        )));
    }
    Ok(packed)
}
