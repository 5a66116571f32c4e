//! Control links: authenticated, framed connections between two nodes over TCP or a Unix
//! domain socket.
//!
//! Opening a link, on either side, is: connect or accept, then authenticate (mutual
//! HMAC challenge over a shared [`Secret`], see [`auth`]), then exchange [`Hello`] frames.
//! No byte from the peer is decoded as a frame before authentication succeeded, and the
//! whole opening runs under [`LinkOptions::handshake_timeout`]. The result is a [`Link`]:
//! the peer's `Hello` and the two halves of the connection, which can be moved to
//! different tasks.
//!
//! A server accepts with [`Listener::accept`] and runs [`accept_handshake`] for each
//! connection in a task of its own, so a slow or hostile client never holds up the others.
//!
//! Every refusal is counted in the node's [`LinkCounters`] and in the `metrics` counters
//! `ferry_auth_failures_total` and `ferry_frames_rejected_total{reason}`.

mod activity;
pub mod admission;
pub mod auth;
mod counters;
pub mod fdpass;
mod handshake;
mod listener;
pub mod ring;

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};

use crate::wire::{
    Frame, FrameError, FrameHeader, FrameKind, FrameReader, HEADER_LEN, Hello, Message, ReadError,
    parse_header,
};
pub use activity::Activity;
pub use auth::Secret;
pub use counters::LinkCounters;
pub use handshake::{accept_handshake, dial, host_id, local_hello};
pub use listener::{Accepted, Listener};

/// Read half of either socket kind.
pub(crate) type BoxRead = Box<dyn AsyncRead + Send + Unpin>;
/// Write half of either socket kind.
pub(crate) type BoxWrite = Box<dyn AsyncWrite + Send + Unpin>;

/// Buffer size of each half of a link: many small frames go out, or come in, in one
/// system call.
const LINK_BUFFER: usize = 256 * 1024;

/// Where a link's peer listens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// TCP, as `host:port` (a name is resolved when dialing).
    Tcp(String),
    /// A Unix domain socket at this path (same host only).
    Unix(PathBuf),
}

impl Endpoint {
    /// The socket address of a TCP endpoint given as `ip:port` (not a host name).
    pub fn socket_addr(&self) -> Option<std::net::SocketAddr> {
        match self {
            Self::Tcp(addr) => addr.parse().ok(),
            Self::Unix(_) => None,
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(addr) => write!(f, "tcp:{addr}"),
            Self::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// Settings for opening and reading links. One per node; cheap to clone.
#[derive(Debug, Clone)]
pub struct LinkOptions {
    /// Largest frame payload accepted from a peer, in bytes; also advertised to the peer in
    /// our `Hello` by [`local_hello`]. Default 16 MiB.
    pub max_frame: u32,
    /// Limit for connecting (when dialing), authenticating and exchanging `Hello`, together.
    /// Default 5 s.
    pub handshake_timeout: Duration,
    /// Longest time without a byte of progress inside a frame, in either direction: a peer
    /// that starts a frame and goes quiet, or stops reading while we write one, ends the
    /// link ([`FrameError::Stalled`], or [`LinkError::Io`] of kind `TimedOut` for a write).
    /// Idle time between frames is not bounded by it here (a node that waits on its peer
    /// bounds it above the link, with keepalives). Default 5 s (`limits.stall_timeout`).
    pub stall_timeout: Duration,
    /// The node's counters, shared by all its links.
    pub counters: Arc<LinkCounters>,
}

impl Default for LinkOptions {
    fn default() -> Self {
        Self {
            max_frame: 16 * 1024 * 1024,
            handshake_timeout: Duration::from_secs(5),
            stall_timeout: Duration::from_secs(5),
            counters: Arc::new(LinkCounters::new()),
        }
    }
}

/// Why a link could not be opened or used.
///
/// `Clone` (I/O errors are behind an `Arc`) so that one failure can fail every transfer
/// waiting on the link. [`LinkError::is_peer_fault`] tells a misbehaving peer from a
/// transport failure.
#[non_exhaustive]
#[derive(Debug, Clone, thiserror::Error)]
pub enum LinkError {
    /// The socket failed (connect refused, reset, ...): a transport failure.
    #[error("link I/O error: {0}")]
    Io(Arc<io::Error>),
    /// The peer did not prove it holds our secret, or is not a ferry peer.
    #[error("authentication with {peer} failed: {detail}")]
    AuthFailed {
        /// Who we were talking to.
        peer: String,
        /// What went wrong.
        detail: String,
    },
    /// Connecting, authenticating or the `Hello` exchange took longer than
    /// [`LinkOptions::handshake_timeout`].
    #[error("handshake with {peer} timed out")]
    HandshakeTimeout {
        /// Who we were talking to.
        peer: String,
    },
    /// The peer sent a bad frame (the peer misbehaved, or the bytes were damaged).
    #[error("peer sent a bad frame: {0}")]
    Frame(FrameError),
    /// The peer speaks another protocol version.
    #[error("protocol version mismatch: we speak {ours}, the peer speaks {theirs}")]
    VersionMismatch {
        /// Our [`PROTOCOL_VERSION`](crate::wire::PROTOCOL_VERSION).
        ours: u16,
        /// The peer's.
        theirs: u16,
    },
    /// The peer closed the connection where a frame was required.
    #[error("the link was closed by the peer")]
    Closed,
    /// The peer sent a valid frame of the wrong kind for this point of the protocol.
    #[error("expected a {expected:?} frame, the peer sent {got:?}")]
    UnexpectedMessage {
        /// What the protocol required.
        expected: FrameKind,
        /// What arrived.
        got: FrameKind,
    },
    /// A frame we were asked to send was refused before any byte of it was written: it
    /// could not be encoded, is malformed, or is larger than the peer accepts
    /// ([`FrameError::TooLong`]). The caller's error; the link is still usable.
    #[error("cannot send frame: {0}")]
    Send(FrameError),
}

impl LinkError {
    /// True when the peer is to blame (bad frames, failed authentication, wrong version,
    /// unexpected messages, a handshake that stalled); false for transport failures, a
    /// closed link and our own send errors.
    pub fn is_peer_fault(&self) -> bool {
        matches!(
            self,
            Self::AuthFailed { .. }
                | Self::HandshakeTimeout { .. }
                | Self::Frame(_)
                | Self::VersionMismatch { .. }
                | Self::UnexpectedMessage { .. }
        )
    }
}

impl From<io::Error> for LinkError {
    fn from(e: io::Error) -> Self {
        Self::Io(Arc::new(e))
    }
}

impl From<ReadError> for LinkError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Io(e) => Self::Io(e),
            ReadError::Frame(FrameError::VersionMismatch { ours, theirs }) => {
                Self::VersionMismatch { ours, theirs }
            }
            ReadError::Frame(e) => Self::Frame(e),
        }
    }
}

/// An open, authenticated link.
#[derive(Debug)]
pub struct Link {
    /// The peer's greeting (its name, version, host, transports and frame cap).
    pub peer_hello: Hello,
    /// Who the peer is, as text for logs (address and, for Unix sockets, pid).
    pub peer: String,
    /// Bytes moved over the socket so far, both ways and from the peer (handshake
    /// included; keepalive frames counted apart, see [`Activity`]).
    pub activity: Activity,
    /// Receives the peer's frames.
    pub reader: LinkReader,
    /// Sends frames to the peer.
    pub writer: LinkWriter,
}

/// The receiving half of a [`Link`].
pub struct LinkReader {
    frames: FrameReader<BufReader<BoxRead>>,
    counters: Arc<LinkCounters>,
    /// Where keepalive frames read are left out of the link's progress.
    activity: Activity,
    peer: String,
    failed: Option<LinkError>,
}

impl fmt::Debug for LinkReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinkReader")
            .field("peer", &self.peer)
            .field("max_frame", &self.frames.max_frame())
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl LinkReader {
    fn new(read: BoxRead, opts: &LinkOptions, activity: Activity, peer: String) -> Self {
        let mut frames =
            FrameReader::new(BufReader::with_capacity(LINK_BUFFER, read), opts.max_frame);
        frames.set_stall_timeout(Some(opts.stall_timeout));
        Self {
            frames,
            counters: Arc::clone(&opts.counters),
            activity,
            peer,
            failed: None,
        }
    }

    /// The largest frame this reader accepts (`limits.max_frame`).
    pub fn max_frame(&self) -> u32 {
        self.frames.max_frame()
    }

    /// Receives the next frame, checked (length cap, CRC, rkyv validation, kind).
    ///
    /// Returns `Ok(None)` when the peer closed the connection between frames. Fails with
    /// [`LinkError::Frame`] when the peer sent a bad frame (counted under its reason; a
    /// frame begun and then left without a byte for [`LinkOptions::stall_timeout`] is
    /// [`FrameError::Stalled`]) and [`LinkError::Io`] when the socket failed. After any
    /// error every later call returns the same error: on a byte stream, a frame that fails
    /// its checks means the bytes around it cannot be trusted either, so the link is done.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a partly received frame stays buffered and the next call finishes it.
    pub async fn next(&mut self) -> Result<Option<Frame>, LinkError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        match self.frames.read().await {
            Ok(Some(frame)) => {
                self.counters.record_frame_ok();
                if is_keepalive(frame.kind()) {
                    self.activity
                        .add_keepalive(frame.header().frame_len() as u64);
                }
                Ok(Some(frame))
            }
            Ok(None) => Ok(None),
            Err(e) => {
                if let ReadError::Frame(fe) = &e {
                    self.counters.record_rejected(fe);
                    tracing::warn!(peer = %self.peer, reason = fe.reason(), "bad frame from peer: {fe}");
                }
                let e = LinkError::from(e);
                self.failed = Some(e.clone());
                Err(e)
            }
        }
    }

    /// Reads the [`FrameKind::Payload`] frame that must follow a `Data` or `Put` frame
    /// announcing a chunk of `dst.len()` bytes, straight into `dst` (the chunk's place in
    /// its destination buffer).
    ///
    /// The payload's header is checked (magic, version, kind, length equal to `dst.len()`
    /// and within our `max_frame`) before a byte of it is read; the CRC once every byte is
    /// in `dst`. Fails with [`LinkError::Frame`] (counted under its reason; on
    /// [`FrameError::CrcMismatch`] `dst` holds damaged bytes that must not be used) and
    /// [`LinkError::Io`] when the socket failed. After any error the link is done and
    /// every later call returns the same error.
    ///
    /// # Cancel safety
    ///
    /// Not cancel-safe: dropped midway, it leaves the link out of sync, and every later
    /// read fails.
    pub async fn read_payload_into(&mut self, dst: &mut [u8]) -> Result<(), LinkError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let result = self.frames.read_payload_into(dst).await;
        self.payload_read(result)
    }

    /// Reads the [`FrameKind::Payload`] frame of `len` bytes that must follow a `Data` or
    /// `Put` frame, and throws the bytes away (a small buffer, a piece at a time): for a
    /// chunk of a transfer cancelled meanwhile or of a refused put, so that the link stays
    /// in step. Same checks, errors, counting and cancel safety as
    /// [`LinkReader::read_payload_into`].
    pub async fn discard_payload(&mut self, len: u32) -> Result<(), LinkError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let result = self.frames.discard_payload(len as usize).await;
        self.payload_read(result)
    }

    /// Counts a payload read's outcome; any error ends the link.
    fn payload_read(&mut self, result: Result<(), ReadError>) -> Result<(), LinkError> {
        let e = match result {
            Ok(()) => {
                self.counters.record_frame_ok();
                return Ok(());
            }
            Err(e) => e,
        };
        if let ReadError::Frame(fe) = &e {
            self.counters.record_rejected(fe);
            tracing::warn!(peer = %self.peer, reason = fe.reason(), "bad payload frame from peer: {fe}");
        }
        let e = LinkError::from(e);
        self.failed = Some(e.clone());
        Err(e)
    }
}

/// The sending half of a [`Link`].
pub struct LinkWriter {
    inner: BoxWrite,
    /// Frames fed and not yet written, at most [`LINK_BUFFER`] bytes. What would not fit
    /// goes out with them in vectored writes, straight from the caller's slices: a chunk's
    /// small header frames and its large payload leave in one system call (before, the
    /// buffered headers were written alone first: a small segment, and a wake-up of the
    /// peer's reader, per chunk).
    buffer: Vec<u8>,
    /// The peer's advertised cap on frame payloads (ours until its `Hello` arrived).
    peer_max_frame: u32,
    /// Set while a frame is partly written; if a send is cancelled or fails midway, the
    /// stream is out of sync and every later send fails.
    mid_frame: bool,
    /// Longest wait for the socket to take a byte of a frame being written.
    stall: Duration,
    /// Where keepalive frames written are left out of the link's progress.
    activity: Activity,
    peer: String,
}

impl fmt::Debug for LinkWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinkWriter")
            .field("peer", &self.peer)
            .field("peer_max_frame", &self.peer_max_frame)
            .field("mid_frame", &self.mid_frame)
            .finish_non_exhaustive()
    }
}

impl LinkWriter {
    fn new(write: BoxWrite, stall: Duration, activity: Activity, peer: String) -> Self {
        Self {
            inner: write,
            buffer: Vec::with_capacity(LINK_BUFFER),
            peer_max_frame: u32::MAX,
            mid_frame: false,
            stall,
            activity,
            peer,
        }
    }

    /// The largest payload the peer accepts, from its `Hello`.
    pub fn peer_max_frame(&self) -> u32 {
        self.peer_max_frame
    }

    fn check_usable(&self) -> Result<(), LinkError> {
        if self.mid_frame {
            return Err(LinkError::Io(Arc::new(io::Error::other(
                "an earlier send was cancelled or failed mid-frame; the link is unusable",
            ))));
        }
        Ok(())
    }

    fn check_cap(&self, len: u64) -> Result<(), LinkError> {
        if len > u64::from(self.peer_max_frame) {
            return Err(LinkError::Send(FrameError::TooLong {
                len,
                cap: u64::from(self.peer_max_frame),
            }));
        }
        Ok(())
    }

    /// Writes `parts` as one frame (or several whole frames): into the buffer when they fit
    /// there, else out with what is buffered in vectored writes; each write bounded by the
    /// stall timeout: a peer that stops reading ends the link rather than holding the
    /// writer (and the transfers behind it) for ever.
    async fn write_parts(&mut self, parts: &[&[u8]], flush: bool) -> Result<(), LinkError> {
        self.mid_frame = true;
        let len = parts.iter().fold(0usize, |n, p| n.saturating_add(p.len()));
        if self.buffer.len().saturating_add(len) <= LINK_BUFFER {
            for part in parts {
                self.buffer.extend_from_slice(part);
            }
            if flush {
                self.write_buffered().await?;
            }
        } else {
            write_out(&mut self.inner, self.stall, &mut self.buffer, parts).await?;
        }
        if flush {
            within_stall(self.stall, self.inner.flush()).await?;
        }
        self.mid_frame = false;
        Ok(())
    }

    /// Writes out what is buffered.
    async fn write_buffered(&mut self) -> io::Result<()> {
        write_out(&mut self.inner, self.stall, &mut self.buffer, &[]).await
    }

    async fn write_message(&mut self, msg: &Message, flush: bool) -> Result<(), LinkError> {
        self.check_usable()?;
        let payload = rkyv::to_bytes::<rkyv::rancor::Error>(msg)
            .map_err(|e| LinkError::Send(FrameError::Encode(e.to_string())))?;
        self.check_cap(payload.len() as u64)?;
        let header = FrameHeader::for_payload(msg.kind(), &payload).map_err(LinkError::Send)?;
        self.write_parts(&[&header.to_bytes(), &payload], flush)
            .await?;
        if is_keepalive(msg.kind()) {
            self.activity.add_keepalive(header.frame_len() as u64);
        }
        Ok(())
    }

    /// Sends `msg` as one frame and flushes it to the socket.
    ///
    /// Fails with [`LinkError::Send`] (nothing written; the link stays usable) if the message
    /// cannot be encoded or is larger than the peer's `max_frame`, and with
    /// [`LinkError::Io`] if the socket fails.
    ///
    /// # Cancel safety
    ///
    /// Not cancel-safe: a send dropped midway may leave part of a frame written; every
    /// later send then fails with [`LinkError::Io`].
    pub async fn send(&mut self, msg: &Message) -> Result<(), LinkError> {
        self.write_message(msg, true).await
    }

    /// Like [`LinkWriter::send`] but leaves the frame in the write buffer (it goes out when
    /// the buffer fills or on [`LinkWriter::flush`]): batches many small frames into few
    /// writes. Same errors and cancel safety as `send`.
    pub async fn feed(&mut self, msg: &Message) -> Result<(), LinkError> {
        self.write_message(msg, false).await
    }

    /// Buffers a chunk: `header` (a [`Message::Data`] or [`Message::Put`] whose `len` is
    /// `bytes.len()`, or an eager [`Message::Offer`] of `bytes.len()`) as one frame, then `bytes` as the [`FrameKind::Payload`] frame that
    /// follows it. The bytes are written from the caller's slice as they are (the CRC is
    /// computed over them in place), never copied into an archive. Like
    /// [`LinkWriter::feed`], nothing is flushed; large payloads go to the socket directly
    /// once the write buffer cannot hold them.
    ///
    /// Fails with [`LinkError::Send`] (nothing written; the link stays usable) if `header`
    /// is not a `Data`, `Put` or eager `Offer` message, its `len` differs from `bytes.len()`, it cannot be
    /// encoded, or either frame is larger than the peer's `max_frame`; with
    /// [`LinkError::Io`] if the socket fails. Not cancel-safe, like `send`.
    pub async fn feed_chunk(&mut self, header: &Message, bytes: &[u8]) -> Result<(), LinkError> {
        let payload_header =
            FrameHeader::for_payload(FrameKind::Payload, bytes).map_err(LinkError::Send)?;
        self.feed_chunk_framed(header, bytes, payload_header).await
    }

    /// Like [`LinkWriter::feed_chunk`], with the payload frame's header (and so its CRC)
    /// computed beforehand by [`FrameHeader::for_payload`] over these very bytes as
    /// [`FrameKind::Payload`]: a stream checksums its next chunk on another thread while
    /// this one is written. Its kind and length are checked here, not its CRC: a header
    /// made for other bytes has the peer refuse the payload and drop the link. Same errors
    /// and cancel safety as `feed_chunk` (also [`LinkError::Send`] for a header of another
    /// kind or length).
    pub async fn feed_chunk_framed(
        &mut self,
        header: &Message,
        bytes: &[u8],
        payload_header: FrameHeader,
    ) -> Result<(), LinkError> {
        self.check_usable()?;
        if payload_header.kind != FrameKind::Payload || payload_header.len as usize != bytes.len() {
            return Err(LinkError::Send(FrameError::Encode(format!(
                "a {:?} header of {} bytes for a payload of {}",
                payload_header.kind,
                payload_header.len,
                bytes.len()
            ))));
        }
        let announced = match header {
            Message::Data(chunk) => u64::from(chunk.len),
            Message::Put(chunk) => u64::from(chunk.len),
            Message::Offer(offer) if offer.eager => offer.len,
            other => {
                return Err(LinkError::Send(FrameError::Encode(format!(
                    "a {:?} frame announces no payload",
                    other.kind()
                ))));
            }
        };
        if announced != bytes.len() as u64 {
            return Err(LinkError::Send(FrameError::Encode(format!(
                "the header announces {announced} bytes, the chunk has {}",
                bytes.len()
            ))));
        }
        self.check_cap(bytes.len() as u64)?;
        let archived = rkyv::to_bytes::<rkyv::rancor::Error>(header)
            .map_err(|e| LinkError::Send(FrameError::Encode(e.to_string())))?;
        self.check_cap(archived.len() as u64)?;
        let message_header =
            FrameHeader::for_payload(header.kind(), &archived).map_err(LinkError::Send)?;
        self.write_parts(
            &[
                &message_header.to_bytes(),
                &archived,
                &payload_header.to_bytes(),
                bytes,
            ],
            false,
        )
        .await
    }

    /// Sends one frame that was encoded beforehand ([`encode`](crate::wire::encode)), and
    /// flushes. Useful to send one message to many peers while encoding it once.
    ///
    /// The header is checked (magic, our version, known kind, length equal to what follows
    /// and within the peer's cap) but not the CRC or payload. Fails with
    /// [`LinkError::Send`] if the check fails (nothing written), [`LinkError::Io`] if the
    /// socket fails. Not cancel-safe, like `send`.
    pub async fn send_encoded(&mut self, frame: &[u8]) -> Result<(), LinkError> {
        self.check_usable()?;
        let Some(raw_header) = frame.first_chunk::<HEADER_LEN>() else {
            return Err(LinkError::Send(FrameError::Truncated {
                needed: HEADER_LEN,
                got: frame.len(),
            }));
        };
        let header = parse_header(raw_header, u32::MAX).map_err(LinkError::Send)?;
        if header.frame_len() != frame.len() {
            return Err(LinkError::Send(FrameError::Truncated {
                needed: header.frame_len(),
                got: frame.len(),
            }));
        }
        self.check_cap(u64::from(header.len))?;
        self.write_parts(&[frame], true).await
    }

    /// Writes out whatever [`LinkWriter::feed`] left buffered. Fails with
    /// [`LinkError::Io`] (of kind `TimedOut` when the peer takes no byte for
    /// [`LinkOptions::stall_timeout`]). Cancel-safe in the sense that a later `flush` finishes the job.
    pub async fn flush(&mut self) -> Result<(), LinkError> {
        self.check_usable()?;
        self.write_buffered().await?;
        within_stall(self.stall, self.inner.flush()).await?;
        Ok(())
    }

    /// Flushes, then closes our direction of the connection (the peer's reader sees a clean
    /// end of stream). Fails with [`LinkError::Io`].
    pub async fn shutdown(&mut self) -> Result<(), LinkError> {
        self.write_buffered().await?;
        within_stall(self.stall, self.inner.shutdown()).await?;
        Ok(())
    }
}

/// Whether frames of `kind` are keepalives: a [`Message::Ping`] and the peer's
/// [`Message::Pong`] prove that the peer is there, not that a transfer moved.
fn is_keepalive(kind: FrameKind) -> bool {
    matches!(kind, FrameKind::Ping | FrameKind::Pong)
}

/// Runs one write step on the socket, failing with `TimedOut` when it takes no byte for
/// `stall`.
async fn within_stall<T>(
    stall: Duration,
    step: impl std::future::Future<Output = io::Result<T>>,
) -> io::Result<T> {
    match tokio::time::timeout(stall, step).await {
        Ok(done) => done,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the peer took no byte for {stall:?}: it stopped reading"),
        )),
    }
}

/// Writes what `buffer` holds, then every byte of `parts`, in order, in as few vectored
/// writes as the socket takes, each bounded by `stall`. The bytes of `buffer` leave it as
/// they are written, so a call dropped midway leaves there only what was not (a later
/// flush finishes the job).
async fn write_out(
    inner: &mut BoxWrite,
    stall: Duration,
    buffer: &mut Vec<u8>,
    parts: &[&[u8]],
) -> io::Result<()> {
    // The first part not yet written whole, and how much of it was.
    let (mut at, mut done) = (0, 0);
    loop {
        while parts.get(at).is_some_and(|p| done >= p.len()) {
            at += 1;
            done = 0;
        }
        let rest = parts.get(at..).unwrap_or_default();
        if buffer.is_empty() && rest.is_empty() {
            return Ok(());
        }
        let slices: Vec<io::IoSlice<'_>> = std::iter::once(&buffer[..])
            .chain(
                rest.iter()
                    .enumerate()
                    .map(|(i, p)| if i == 0 { &p[done..] } else { *p }),
            )
            .filter(|b| !b.is_empty())
            .map(io::IoSlice::new)
            .collect();
        let mut n = within_stall(stall, inner.write_vectored(&slices)).await?;
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::WriteZero));
        }
        let buffered = n.min(buffer.len());
        buffer.drain(..buffered);
        n -= buffered;
        // Past the parts written whole, into the next one.
        while let Some(p) = parts.get(at)
            && n > 0
        {
            let left = p.len() - done;
            if n < left {
                done += n;
                break;
            }
            n -= left;
            at += 1;
            done = 0;
        }
    }
}

impl LinkWriter {
    /// Writes `bytes` as they are, with no check at all, and flushes: for tests that play a
    /// hostile or broken peer. Never use it to send real frames.
    pub async fn danger_send_raw(&mut self, bytes: &[u8]) -> Result<(), LinkError> {
        self.write_parts(&[bytes], true).await
    }
}

/// The header frame of one chunk `(offset, len)` of an outbound transfer; its bytes follow
/// as a payload frame ([`LinkWriter::feed_chunk`]).
///
/// `len` must fit a frame (it is at most the configured chunk size); a larger one is
/// clamped, and the writer then refuses the chunk because the lengths differ.
pub fn data_header(transfer: u64, chunk: (usize, usize)) -> Message {
    let (offset, len) = chunk;
    Message::Data(crate::wire::DataChunk {
        transfer,
        offset: offset as u64,
        len: u32::try_from(len).unwrap_or(u32::MAX),
    })
}

/// The header frame of one chunk `(offset, len)` of a one-sided put, `offset` counted from
/// the start of the put's buffer; its bytes follow as a payload frame. Same `len` rule as
/// [`data_header`].
pub fn put_header(
    put: u64,
    key: crate::region::RegionKey,
    region_offset: u64,
    chunk: (usize, usize),
    last: bool,
) -> Message {
    let (offset, len) = chunk;
    Message::Put(crate::wire::PutChunk {
        put,
        region: key.region,
        generation: key.generation,
        offset: region_offset + offset as u64,
        len: u32::try_from(len).unwrap_or(u32::MAX),
        last,
    })
}

#[cfg(test)]
mod tests;
