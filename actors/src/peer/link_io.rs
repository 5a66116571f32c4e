//! The link's two tasks: the writer (frames and streamed chunks, device memory copied out
//! one chunk ahead; keepalives overtake them) and the reader (frames to the actor, chunks
//! and puts straight into their regions).

use super::*;
use ferry_transports::wire::{FrameHeader, FrameKind};

/// Keepalives (`Ping`, `Pong`) waiting for the writer, at most: one more is dropped, since
/// one waiting already says what it would.
pub(super) const KEEPALIVES: usize = 2;

/// The link's writer, with the keepalives that overtake what it writes: each goes out,
/// flushed, before the next frame or chunk, so that a long stream of ours never holds back
/// the frame that asks the peer for a sign of life (the peer, only reading, would have
/// nothing else to send, and we would take it for gone).
pub(super) struct LinkOut {
    pub(super) writer: LinkWriter,
    pub(super) keepalives: mpsc::Receiver<Message>,
}

impl LinkOut {
    /// Writes the keepalives waiting, each flushed.
    async fn keepalives(&mut self) -> Result<(), LinkError> {
        while let Ok(keepalive) = self.keepalives.try_recv() {
            self.writer.send(&keepalive).await?;
        }
        Ok(())
    }

    /// [`LinkWriter::feed_chunk`], after the keepalives waiting.
    async fn feed_chunk(&mut self, header: &Message, bytes: &[u8]) -> Result<(), LinkError> {
        self.keepalives().await?;
        self.writer.feed_chunk(header, bytes).await
    }

    /// [`LinkWriter::feed_chunk_framed`], after the keepalives waiting.
    async fn feed_chunk_framed(
        &mut self,
        header: &Message,
        bytes: &[u8],
        framed: FrameHeader,
    ) -> Result<(), LinkError> {
        self.keepalives().await?;
        self.writer.feed_chunk_framed(header, bytes, framed).await
    }
}

pub(super) async fn write_loop(
    mut out: LinkOut,
    mut rx: mpsc::Receiver<Outgoing>,
    me: Addr<TransferActor>,
    link: u64,
) {
    let mut failure: Option<LinkError> = None;
    loop {
        let next = tokio::select! {
            biased;
            Some(keepalive) = out.keepalives.recv() => {
                if let Err(e) = out.writer.send(&keepalive).await {
                    failure = Some(e);
                    break;
                }
                continue;
            }
            next = rx.recv() => next,
        };
        let Some(next) = next else {
            break;
        };
        let writer = &mut out.writer;
        match next {
            Outgoing::Frame(msg) => {
                let writing = std::time::Instant::now();
                // Frames queued together go out in one write, once the queue is empty.
                let sent = if rx.is_empty() {
                    writer.send(&msg).await
                } else {
                    writer.feed(&msg).await
                };
                if let Message::Offer(offer) = &msg {
                    tracing::trace!(
                        target: crate::TRACE_BLOCKS,
                        op = offer.transfer,
                        blocks = crate::block_count(&offer.layout),
                        us = writing.elapsed().as_micros() as u64,
                        "offer encoded and written"
                    );
                }
                if let Err(e) = sent {
                    failure = Some(e);
                    break;
                }
            }
            Outgoing::Stream {
                op,
                what,
                bytes,
                stop,
                chunk,
            } => {
                let result = stream(&mut out, op, what, &bytes, &stop, chunk).await;
                drop(bytes);
                let _ = me
                    .send(DataEvent::StreamEnded {
                        op,
                        broken: None,
                        link,
                    })
                    .await;
                if let Err(e) = result {
                    failure = Some(e);
                    break;
                }
            }
            Outgoing::Eager { offer, bytes } => {
                let mut sent = writer.feed_chunk(&offer, &bytes).await;
                if sent.is_ok() && rx.is_empty() {
                    sent = writer.flush().await;
                }
                if let Err(e) = sent {
                    failure = Some(e);
                    break;
                }
            }
            Outgoing::Close => {
                let _ = writer.send(&Message::Goodbye).await;
                let _ = writer.shutdown().await;
                break;
            }
        }
    }
    // Streams still queued end now, so their buffers go back to their owners.
    rx.close();
    while let Some(out) = rx.recv().await {
        if let Outgoing::Stream { op, bytes, .. } = out {
            drop(bytes);
            let _ = me
                .send(DataEvent::StreamEnded {
                    op,
                    broken: None,
                    link,
                })
                .await;
        }
    }
    if let Some(e) = failure {
        let _ = me
            .send(LinkDown {
                why: e.to_string(),
                link,
                clean: false,
            })
            .await;
    }
}

pub(super) async fn stream(
    writer: &mut LinkOut,
    op: OpId,
    what: StreamWhat,
    bytes: &SharedBytes,
    stop: &AtomicBool,
    chunk: usize,
) -> Result<(), LinkError> {
    // What moves: the layout's packed bytes. A strided layout whose rows touch is the
    // buffer's first bytes (no gathering); another is gathered chunk by chunk.
    let (len, layout) = match &what {
        StreamWhat::Transfer(layout) => {
            let packed = layout.check(bytes.len() as u64).map_err(io_error)?;
            let packed = usize::try_from(packed).map_err(io_error)?;
            (packed, Some(layout.clone()).filter(|l| !l.is_contiguous()))
        }
        StreamWhat::Put { .. } => (bytes.len(), None),
    };
    let parts: Vec<(usize, usize)> = region::chunks(len, chunk).collect();
    let header = |i: usize| match &what {
        StreamWhat::Transfer(_) => ferry_transports::link::data_header(op.0, parts[i]),
        &StreamWhat::Put { key, offset } => {
            ferry_transports::link::put_header(op.0, key, offset, parts[i], i + 1 == parts.len())
        }
    };
    let (mut ahead, mut checksum_ahead) = (None, None);
    let streamed = match (bytes.as_slice(), layout) {
        (Some(_), None) if parts.len() > 1 => {
            stream_host_checksummed_ahead(writer, bytes, &parts, &header, stop, &mut checksum_ahead)
                .await
        }
        (Some(host), layout) => stream_host(writer, host, layout, &parts, &header, stop).await,
        (None, layout) => {
            stream_device(writer, bytes, layout, &parts, &header, stop, &mut ahead).await
        }
    };
    // A copy or checksum still running (the stream stopped or failed) holds a view of the
    // buffer: wait for it, so that the buffer goes back only once nothing reads it.
    if let Some(copy) = ahead.take() {
        let _ = copy.await;
    }
    if let Some(checksum) = checksum_ahead.take() {
        let _ = checksum.await;
    }
    streamed?;
    writer.writer.flush().await
}

/// A chunk's payload frame header, CRC and all, being computed on a blocking thread.
pub(super) type ChecksumAhead =
    tokio::task::JoinHandle<Result<FrameHeader, ferry_transports::wire::FrameError>>;

/// Streams `parts` of contiguous host memory straight from the caller's buffer, each
/// chunk's CRC computed on a blocking thread one chunk ahead of the socket: the CRC of chunk
/// k+1 (a read of its bytes from memory) runs while chunk k is written, so the writing
/// thread only writes. The checksum still running when this returns is left in `ahead`.
pub(super) async fn stream_host_checksummed_ahead(
    writer: &mut LinkOut,
    bytes: &SharedBytes,
    parts: &[(usize, usize)],
    header: &impl Fn(usize) -> Message,
    stop: &AtomicBool,
    ahead: &mut Option<ChecksumAhead>,
) -> Result<(), LinkError> {
    let host = bytes
        .as_slice()
        .ok_or_else(|| io_error("host memory expected"))?;
    let checksum = |(at, n): (usize, usize)| {
        let bytes = bytes.clone();
        tokio::task::spawn_blocking(move || {
            // Out of range only if the parts were not cut from this buffer: then the empty
            // payload's header is refused by its length before anything is written.
            let chunk = bytes
                .as_slice()
                .and_then(|host| host.get(at..at + n))
                .unwrap_or_default();
            FrameHeader::for_payload(FrameKind::Payload, chunk)
        })
    };
    *ahead = parts.first().map(|&first| checksum(first));
    for (i, &(at, n)) in parts.iter().enumerate() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let framed = ahead
            .take()
            .ok_or_else(|| io_error("a chunk was not checksummed"))?
            .await
            .map_err(io_error)?
            .map_err(LinkError::Send)?;
        if let Some(&next) = parts.get(i + 1) {
            *ahead = Some(checksum(next));
        }
        let payload = host
            .get(at..at + n)
            .ok_or_else(|| io_error("a chunk past the buffer"))?;
        writer
            .feed_chunk_framed(&header(i), payload, framed)
            .await?;
    }
    Ok(())
}

/// Streams `parts` of host memory: straight from the caller's buffer, or (strided rows)
/// gathered into one payload, one chunk at a time.
pub(super) async fn stream_host(
    writer: &mut LinkOut,
    host: &[u8],
    layout: Option<Layout>,
    parts: &[(usize, usize)],
    header: &impl Fn(usize) -> Message,
    stop: &AtomicBool,
) -> Result<(), LinkError> {
    let mut staging = Vec::new();
    for (i, &(at, n)) in parts.iter().enumerate() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let payload = match &layout {
            Some(layout) => {
                staging.resize(n, 0);
                layout
                    .gather(host, at as u64, &mut staging)
                    .map_err(io_error)?;
                &staging[..]
            }
            None => &host[at..at + n],
        };
        writer.feed_chunk(&header(i), payload).await?;
    }
    Ok(())
}

/// A chunk of device memory being copied out on a blocking thread.
pub(super) type CopyOut =
    tokio::task::JoinHandle<Result<Vec<u8>, ferry_transports::memory::MemoryError>>;

/// Streams `parts` of device memory, each copied out (a few 3D copies for strided rows) on
/// a blocking thread one chunk ahead of the socket: the copy of chunk k+1 runs while chunk
/// k is written. The copy still running when this returns is left in `ahead`.
pub(super) async fn stream_device(
    writer: &mut LinkOut,
    bytes: &SharedBytes,
    layout: Option<Layout>,
    parts: &[(usize, usize)],
    header: &impl Fn(usize) -> Message,
    stop: &AtomicBool,
    ahead: &mut Option<CopyOut>,
) -> Result<(), LinkError> {
    let copy_out = |(at, n): (usize, usize), mut into: Vec<u8>| {
        let bytes = bytes.clone();
        let layout = layout.clone();
        tokio::task::spawn_blocking(move || {
            into.resize(n, 0);
            match layout {
                Some(layout) => bytes.read_packed(&layout, at as u64, &mut into),
                None => bytes.read(at, &mut into),
            }?;
            Ok(into)
        })
    };
    *ahead = parts.first().map(|&first| copy_out(first, Vec::new()));
    // Two chunk buffers take turns: one being written, one being filled.
    let mut spare = Vec::new();
    for i in 0..parts.len() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let copy = ahead
            .take()
            .ok_or_else(|| io_error("a chunk was not copied out"))?;
        let copied = copy
            .await
            .map_err(io_error)?
            .map_err(|e| io_error(format!("copying the device buffer out: {e}")))?;
        if let Some(&next) = parts.get(i + 1) {
            *ahead = Some(copy_out(next, std::mem::take(&mut spare)));
        }
        writer.feed_chunk(&header(i), &copied).await?;
        spare = copied;
    }
    Ok(())
}

/// A failure of the stream that is not the socket's, as the link error it ends with.
pub(super) fn io_error(e: impl std::fmt::Display) -> LinkError {
    LinkError::Io(Arc::new(std::io::Error::other(e.to_string())))
}

pub(super) struct ReadLoop {
    pub(super) me: Addr<TransferActor>,
    /// The link's eager credit at this end, if this node grants any.
    pub(super) eager: Option<Arc<dyn EagerGate>>,
    /// Where eager transfers land (host memory, reserved at once).
    pub(super) host_tiers: Vec<Tier>,
    pub(super) regions: Arc<DashMap<u64, InboundRegion>>,
    pub(super) exposed: Arc<DashMap<u64, ExposedRegion>>,
    pub(super) counters: Arc<LinkCounters>,
    pub(super) link: u64,
}

/// What the reader keeps between frames.
#[derive(Default)]
struct ReadState {
    /// The first error of each put still arriving.
    put_errors: HashMap<u64, String>,
    /// A put chunk's bytes, before they are placed.
    put_bytes: Vec<u8>,
    /// A chunk bound for device memory, before its copy in.
    scratch: Vec<u8>,
    /// The peer's offers handed to the actor that were not taken eagerly (wrapping).
    offers: u32,
}

/// Why the reader stops: the reason the link ends with.
type Stop = String;

impl ReadLoop {
    /// Reads until the link ends; a peer that breaks the protocol is dropped.
    pub(super) async fn run(self, mut reader: LinkReader) {
        let mut state = ReadState::default();
        // A peer that says goodbye before it closes left on purpose.
        let (mut said_goodbye, mut clean) = (false, false);
        let why = loop {
            // Any frame that fails its checks ends the link: on a byte stream, the bytes
            // around a bad frame cannot be trusted either, and every transfer on the link
            // fails at once with the reason, rather than waiting for its deadline.
            let frame = match reader.next().await {
                Ok(Some(frame)) => frame,
                Ok(None) if said_goodbye => {
                    clean = true;
                    break "the peer said goodbye and closed the connection".to_string();
                }
                Ok(None) => break "the peer closed the connection".to_string(),
                Err(e) => break format!("{e}"),
            };
            let msg = match frame.message() {
                Ok(m) => m,
                Err(e) => {
                    self.counters.record_rejected(&e);
                    break format!("peer sent a bad frame: {e}");
                }
            };
            said_goodbye |= matches!(msg, ArchivedMessage::Goodbye);
            let handled = match msg {
                ArchivedMessage::Data(chunk) => {
                    let chunk = ferry_transports::wire::DataChunk::from(chunk);
                    self.on_data(&mut reader, &chunk, &mut state.scratch).await
                }
                ArchivedMessage::Put(chunk) => {
                    let chunk = ferry_transports::wire::PutChunk::from(chunk);
                    self.on_put(&mut reader, &chunk, &mut state).await
                }
                ArchivedMessage::Offer(offer) if offer.eager => {
                    match ferry_transports::wire::owned_message(msg) {
                        Ok(Message::Offer(offer)) => {
                            self.on_eager(&mut reader, offer, &mut state.offers).await
                        }
                        Ok(_) | Err(_) => Err("undecodable eager offer".to_string()),
                    }
                }
                // Checked by `message` above: deserialized without checking it again.
                _ => match ferry_transports::wire::owned_message(msg) {
                    Ok(owned) => {
                        self.note_in_order(&owned, &mut state.offers);
                        self.forward(owned).await
                    }
                    Err(e) => Err(format!("undecodable frame: {e}")),
                },
            };
            if let Err(why) = handled {
                break why;
            }
        };
        let link = self.link;
        let _ = self.me.send(LinkDown { why, link, clean }).await;
    }

    /// Reads a data chunk's payload into its transfer's buffer (device memory through
    /// `scratch`, then one host-to-device copy); the transfer is done with its last byte.
    async fn on_data(
        &self,
        reader: &mut LinkReader,
        chunk: &ferry_transports::wire::DataChunk,
        scratch: &mut Vec<u8>,
    ) -> Result<(), Stop> {
        let id = chunk.transfer;
        // The buffer is lent out of the map while its bytes arrive, so the map is never
        // locked across a socket read.
        let lent = self.regions.get_mut(&id).map(|mut r| r.lend(chunk));
        let mut landing = match lent {
            Some(Ok(landing)) => landing,
            Some(Err(e)) => {
                note_protocol_violation();
                return Err(format!("protocol violation: {e}"));
            }
            // A chunk of a transfer cancelled meanwhile: read past its bytes.
            None => {
                return reader
                    .discard_payload(chunk.len)
                    .await
                    .map_err(|e| e.to_string());
            }
        };
        // Host memory takes the bytes straight from the socket; device memory (a staged
        // transfer from another host) through `scratch`, then one host-to-device copy.
        let received = if landing.is_host() {
            reader.read_payload_into(landing.destination()).await
        } else {
            // Never larger than a frame (the payload's own header says the same before a
            // byte is read; checked first so that a lying header allocates nothing).
            if chunk.len > reader.max_frame() {
                note_protocol_violation();
                return Err(format!(
                    "protocol violation: a chunk of {} bytes, past the largest frame",
                    chunk.len
                ));
            }
            scratch.resize(chunk.len as usize, 0);
            reader.read_payload_into(&mut scratch[..]).await
        };
        if let Err(e) = received {
            // Damaged bytes may now be in the buffer: the transfer must not be delivered.
            // Dropping the link fails it at both ends and frees the buffer (the peer sees it
            // lost; nothing is retried here).
            return Err(format!("chunk of transfer {id} not received: {e}"));
        }
        // A host-to-device copy waits for the copy engine: the runtime's other worker
        // takes this one's tasks meanwhile.
        if !landing.is_host()
            && let Err(e) =
                tokio::task::block_in_place(|| landing.write(&scratch[..chunk.len as usize]))
        {
            // Not the peer's fault, but the transfer cannot complete; like a damaged
            // chunk, it fails at both ends.
            return Err(format!("copying a chunk of transfer {id} in: {e}"));
        }
        if let Some(buffer) = restore_landing(&self.regions, id, landing)
            && self
                .me
                .send(DataEvent::InboundDone { id, buffer })
                .await
                .is_err()
        {
            return Err("node stopped".into());
        }
        Ok(())
    }

    /// Reads a put chunk into the exposed region it names. Where the bytes go is checked
    /// before they are read; a refused put's bytes are read past. Accepted ones land in
    /// `put_bytes` first: the exposed map is shared with every peer and with `withdraw`, so
    /// it is not locked across a socket read, and damaged bytes never reach it.
    async fn on_put(
        &self,
        reader: &mut LinkReader,
        chunk: &ferry_transports::wire::PutChunk,
        state: &mut ReadState,
    ) -> Result<(), Stop> {
        let put = chunk.put;
        let len = chunk.len as usize;
        let received = match exposed_destination(&self.exposed, chunk, |_| ()) {
            Ok(()) => {
                if state.put_bytes.len() < len {
                    state.put_bytes.resize(len, 0);
                }
                reader.read_payload_into(&mut state.put_bytes[..len]).await
            }
            Err(e) => {
                note_put_error(&mut state.put_errors, put, e).map_err(|e| e.to_string())?;
                reader.discard_payload(chunk.len).await
            }
        };
        received.map_err(|e| e.to_string())?;
        let placed = exposed_destination(&self.exposed, chunk, |dst| {
            dst.copy_from_slice(&state.put_bytes[..len])
        });
        if let Err(e) = placed {
            note_put_error(&mut state.put_errors, put, e).map_err(|e| e.to_string())?;
        }
        if chunk.last {
            let error = state.put_errors.remove(&put);
            if self.me.send(PutFinished { put, error }).await.is_err() {
                return Err("node stopped".into());
            }
        }
        Ok(())
    }

    /// What the eager gate must learn from a control frame in the link's order: an offer
    /// handed to the actor (not taken eagerly) is counted; the peer's own cancel of an
    /// eager transfer frees its credit at once (the peer counts it free as it sends it).
    fn note_in_order(&self, msg: &Message, offers: &mut u32) {
        match msg {
            Message::Offer(_) => *offers = offers.wrapping_add(1),
            Message::Cancel(cancel) if !cancel.by_receiver => {
                if let Some(gate) = &self.eager {
                    gate.release(cancel.transfer);
                }
            }
            _ => {}
        }
    }

    /// Hands a control frame to the actor: queued without waiting for the actor to handle
    /// it when its mailbox has room (first in, first out, so frames keep their order); a
    /// full mailbox makes the reader wait, and with it the socket. Data chunks never depend
    /// on a control frame still queued: a chunk's region exists before the grant that lets
    /// the peer send it.
    pub(super) async fn forward(&self, owned: Message) -> Result<(), Stop> {
        self.hand_over(FromPeer(owned, self.link)).await
    }

    /// Hands `msg` to the actor in the link's order, as [`Self::forward`] does a frame.
    pub(super) async fn hand_over<M>(&self, msg: M) -> Result<(), Stop>
    where
        M: actix::Message<Result = ()> + Send + 'static,
        TransferActor: Handler<M>,
    {
        match self.me.try_send(msg) {
            Ok(()) => Ok(()),
            Err(actix::prelude::SendError::Full(msg)) => self
                .me
                .send(msg)
                .await
                .map_err(|_| "node stopped".to_string()),
            Err(actix::prelude::SendError::Closed(_)) => Err("node stopped".into()),
        }
    }
}

/// Runs `place` on where `chunk`'s bytes go in its exposed region, or says why they cannot
/// go there (not exposed, stale generation, out of bounds). Holds the region's map entry
/// only for the call.
pub(super) fn exposed_destination(
    exposed: &DashMap<u64, ExposedRegion>,
    chunk: &ferry_transports::wire::PutChunk,
    place: impl FnOnce(&mut [u8]),
) -> Result<(), region::PlaceError> {
    let Some(mut region) = exposed.get_mut(&chunk.region) else {
        return Err(region::PlaceError::NotExposed(chunk.region));
    };
    region.destination(chunk).map(place)
}

/// Too many puts failing at once: the peer is flooding us with bad puts.
#[derive(Debug, thiserror::Error)]
#[error("too many failing puts open at once")]
pub(super) struct TooManyFailingPuts;

/// Remembers the first error of `put`, reported in its ack; fails (ending the link) when
/// too many puts are failing at once.
pub(super) fn note_put_error(
    put_errors: &mut HashMap<u64, String>,
    put: u64,
    error: region::PlaceError,
) -> Result<(), TooManyFailingPuts> {
    if put_errors.len() >= 1024 && !put_errors.contains_key(&put) {
        return Err(TooManyFailingPuts);
    }
    put_errors.entry(put).or_insert_with(|| error.to_string());
    Ok(())
}
