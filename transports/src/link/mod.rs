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
mod listener;
pub mod ring;

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpStream, UnixStream};

use crate::wire::{
    Frame, FrameError, FrameHeader, FrameKind, FrameReader, HEADER_LEN, Hello, Message,
    PROTOCOL_VERSION, ReadError, parse_header,
};
pub use activity::Activity;
use activity::Counted;
use admission::Stage;
pub use auth::Secret;
use auth::{Role, authenticate};
pub use counters::LinkCounters;
use listener::Stream;
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
        /// Our [`PROTOCOL_VERSION`].
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

/// The `Hello` this process sends: our node name, [`PROTOCOL_VERSION`], [`host_id`], pid,
/// the transports we serve (announced with no terms of their own) and our frame cap. It
/// says we receive into host memory, which
/// every node can take; a node that receives elsewhere sets [`Hello::receives`] (ferry's
/// nodes do, in one place: `ferry_actors::coordinator::node_hello`).
pub fn local_hello(
    node: impl Into<String>,
    transports: Vec<ferry_config::TransportName>,
    max_frame: u32,
) -> Hello {
    Hello {
        node: node.into(),
        version: PROTOCOL_VERSION,
        host_id: host_id(),
        pid: std::process::id(),
        transports: transports
            .into_iter()
            .map(crate::wire::Announce::bare)
            .collect(),
        max_frame,
        receives: crate::wire::WireMemoryKind::Host,
        purpose: crate::wire::HelloPurpose::Link,
    }
}

/// Identifies this machine, so that peers can tell same-host links from remote ones: the
/// contents of `/etc/machine-id`, else `/proc/sys/kernel/random/boot_id`, else the host
/// name, else `"unknown"`. Every network namespace of the machine (and every container that
/// shares its `/etc/machine-id` or has none) reads the same. A node says `node.host_id`
/// instead when it is set (`ferry_actors::node::host_identity`). Reads a few small files;
/// never fails.
pub fn host_id() -> String {
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    };
    read("/etc/machine-id")
        .or_else(|| read("/proc/sys/kernel/random/boot_id"))
        .or_else(|| read("/proc/sys/kernel/hostname"))
        .or_else(|| read("/etc/hostname"))
        .unwrap_or_else(|| "unknown".to_owned())
}

/// Connects to `endpoint`, authenticates with `secret` and exchanges `Hello`s.
///
/// `hello` is what we tell the peer (see [`local_hello`]). Returns the open [`Link`].
/// Connecting and the whole handshake share [`LinkOptions::handshake_timeout`]. Fails with
/// [`LinkError::Io`] (could not connect, socket failed), [`LinkError::AuthFailed`],
/// [`LinkError::VersionMismatch`], [`LinkError::HandshakeTimeout`], [`LinkError::Frame`] or
/// [`LinkError::UnexpectedMessage`] (bad first frame) or [`LinkError::Closed`] (the peer
/// hung up before its `Hello`). Refusals are counted in `opts.counters`.
///
/// Cancel-safe in the sense that dropping it closes the half-open connection.
pub async fn dial(
    endpoint: &Endpoint,
    secret: &Secret,
    hello: Hello,
    opts: &LinkOptions,
) -> Result<Link, LinkError> {
    let peer = endpoint.to_string();
    let attempt = async {
        let stream = match endpoint {
            Endpoint::Tcp(addr) => {
                let stream = TcpStream::connect(addr.as_str()).await?;
                stream.set_nodelay(true)?;
                Stream::Tcp(stream)
            }
            Endpoint::Unix(path) => Stream::Unix(UnixStream::connect(path).await?),
        };
        open(stream, Role::Dialer, &peer, secret, hello, opts, || {}).await
    };
    finish(
        tokio::time::timeout(opts.handshake_timeout, attempt).await,
        &peer,
        opts,
    )
}

/// Authenticates a connection from [`Listener::accept`] and exchanges `Hello`s.
///
/// Same results, errors and timeout as [`dial`] (the timeout covering authentication and
/// the `Hello` exchange). Run each call in its own task so that a slow or hostile client
/// cannot delay the others. Dropping the future closes the connection. A connection
/// admitted through a gate ([`admission::Gate::admit_accepted`]) reports its whole
/// preamble there as soon as it has arrived, well-formed.
pub async fn accept_handshake(
    accepted: Accepted,
    secret: &Secret,
    hello: Hello,
    opts: &LinkOptions,
) -> Result<Link, LinkError> {
    let Accepted {
        stream,
        peer,
        progress,
        ..
    } = accepted;
    // A whole, well-formed preamble takes the connection out of reach of those that have
    // not got as far (its admission gate's rule).
    let on_preamble = move || {
        if let Some(progress) = progress {
            progress.reached(Stage::Preamble);
        }
    };
    let attempt = open(
        stream,
        Role::Acceptor,
        &peer,
        secret,
        hello,
        opts,
        on_preamble,
    );
    finish(
        tokio::time::timeout(opts.handshake_timeout, attempt).await,
        &peer,
        opts,
    )
}

/// Turns a timed handshake's outcome into the result, counting refusals.
fn finish(
    outcome: Result<Result<Link, LinkError>, tokio::time::error::Elapsed>,
    peer: &str,
    opts: &LinkOptions,
) -> Result<Link, LinkError> {
    let result = outcome.unwrap_or_else(|_| {
        Err(LinkError::HandshakeTimeout {
            peer: peer.to_owned(),
        })
    });
    if let Err(e) = &result {
        if e.is_peer_fault() {
            opts.counters.record_auth_failure();
        }
        // Every caller reports the error at the level it calls for (a dial's failure, a
        // refused connection, a discovery probe's first failure): here only for debugging.
        tracing::debug!(peer, "link handshake failed: {e}");
    }
    result
}

/// Authenticates, then exchanges `Hello`s, on a connected stream.
async fn open(
    stream: Stream,
    role: Role,
    peer: &str,
    secret: &Secret,
    hello: Hello,
    opts: &LinkOptions,
    on_preamble: impl FnOnce(),
) -> Result<Link, LinkError> {
    let (read, write) = stream.into_halves();
    let activity = Activity::default();
    let read: BoxRead = Box::new(Counted::new(read, activity.clone()));
    let write: BoxWrite = Box::new(Counted::new(write, activity.clone()));
    let mut reader = LinkReader::new(read, opts, activity.clone(), peer.into());
    let mut writer = LinkWriter::new(write, opts.stall_timeout, activity.clone(), peer.into());
    authenticate(
        reader.frames_buffer_mut(),
        &mut writer.inner,
        role,
        secret,
        peer,
        on_preamble,
    )
    .await?;

    writer.send(&Message::Hello(hello)).await?;
    let frame = reader.next().await?.ok_or(LinkError::Closed)?;
    if frame.kind() != FrameKind::Hello {
        return Err(LinkError::UnexpectedMessage {
            expected: FrameKind::Hello,
            got: frame.kind(),
        });
    }
    let peer_hello = match frame.to_owned_message().map_err(LinkError::Frame)? {
        Message::Hello(h) => h,
        other => {
            return Err(LinkError::UnexpectedMessage {
                expected: FrameKind::Hello,
                got: other.kind(),
            });
        }
    };
    if peer_hello.version != PROTOCOL_VERSION {
        return Err(LinkError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: peer_hello.version,
        });
    }
    writer.peer_max_frame = peer_hello.max_frame;
    Ok(Link {
        peer_hello,
        peer: peer.to_owned(),
        activity,
        reader,
        writer,
    })
}

impl LinkReader {
    /// The buffered socket under the frame reader, for the handshake (which must read raw
    /// bytes before any frame).
    fn frames_buffer_mut(&mut self) -> &mut BufReader<BoxRead> {
        self.frames.get_mut()
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
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn write_out_sends_the_buffer_then_every_part_through_short_writes() {
        // A pipe that takes at most 7 bytes at a time, and one slice per write.
        let (write, mut read) = tokio::io::duplex(7);
        let mut write: BoxWrite = Box::new(write);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            read.read_to_end(&mut got).await.map(|_| got)
        });
        let mut buffer = b"head:".to_vec();
        let parts: [&[u8]; 4] = [b"0123456789", b"", b"abc", b"defghijklmnopqrstu"];
        let wrote = write_out(&mut write, Duration::from_secs(5), &mut buffer, &parts).await;
        assert!(wrote.is_ok(), "{wrote:?}");
        assert!(buffer.is_empty(), "what was buffered left the buffer");
        drop(write);
        match reader.await {
            Ok(Ok(got)) => assert_eq!(got, b"head:0123456789abcdefghijklmnopqrstu"),
            other => panic!("{other:?}"),
        }
    }
}
