//! Reading frames from a byte stream: [`FrameReader`], which keeps a partly read frame
//! across cancelled reads and reads payloads straight into the caller's memory, and the
//! one-shot [`read_frame`].

use std::io;
use std::sync::Arc;
use std::time::Duration;

use rkyv::util::AlignedVec;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::{
    CRC_COVERED, DISCARD_CHUNK, Frame, FrameError, FrameHeader, FrameKind, HEADER_LEN,
    INITIAL_READ_CHUNK, parse_header,
};

/// Why reading a frame from a stream failed: the transport, or the peer's bytes.
#[non_exhaustive]
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReadError {
    /// The underlying stream failed (not the peer's bytes).
    #[error("I/O error reading a frame: {0}")]
    Io(Arc<io::Error>),
    /// The peer sent a bad frame, or the stream ended inside one
    /// ([`FrameError::Truncated`]).
    #[error(transparent)]
    Frame(#[from] FrameError),
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        Self::Io(Arc::new(e))
    }
}

/// Reads frames one at a time from a byte stream, keeping partial progress in itself so
/// that [`FrameReader::read`] is cancel-safe.
///
/// After an error that leaves the stream out of sync (see [`FrameError::is_recoverable`])
/// or an I/O error, every later call returns that error again.
#[derive(Debug)]
pub struct FrameReader<R> {
    inner: R,
    max_frame: u32,
    raw_header: [u8; HEADER_LEN],
    header_filled: usize,
    header: Option<FrameHeader>,
    payload: AlignedVec,
    payload_filled: usize,
    /// Set while a raw payload is being read; still set on entry if that read was dropped
    /// midway, which leaves the stream out of sync.
    mid_payload: bool,
    /// Where discarded payloads are read, allocated on first use.
    scratch: Vec<u8>,
    /// Longest wait for the next byte once a frame has begun; `None` waits for ever.
    stall: Option<Duration>,
    failed: Option<ReadError>,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// A reader over `inner` that refuses payloads longer than `max_frame` bytes.
    pub fn new(inner: R, max_frame: u32) -> Self {
        Self {
            inner,
            max_frame,
            raw_header: [0; HEADER_LEN],
            header_filled: 0,
            header: None,
            payload: AlignedVec::new(),
            payload_filled: 0,
            mid_payload: false,
            scratch: Vec::new(),
            stall: None,
            failed: None,
        }
    }

    /// Bounds how long the reader waits for the next byte once a frame has begun (its
    /// first header byte, or a payload frame that a `Data` or `Put` frame announced):
    /// a frame that makes no progress for `stall` fails with [`FrameError::Stalled`], and
    /// the stream is given up. Between frames the reader waits as long as it takes. `None`
    /// (the default) waits for ever.
    pub fn set_stall_timeout(&mut self, stall: Option<Duration>) {
        self.stall = stall;
    }

    /// The payload cap in force.
    pub fn max_frame(&self) -> u32 {
        self.max_frame
    }

    /// Reads the next frame.
    ///
    /// Returns `Ok(None)` when the stream ends cleanly between frames. An end inside a
    /// frame is [`FrameError::Truncated`]. The header is checked before any payload byte is
    /// read or any payload memory allocated; payload memory then grows with the bytes that
    /// actually arrive.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: if the future is dropped before it completes, the bytes read so far are
    /// kept and the next call continues the same frame.
    pub async fn read(&mut self) -> Result<Option<Frame>, ReadError> {
        self.check_in_step()?;
        match self.read_inner().await {
            Err(e) => {
                let recoverable = matches!(&e, ReadError::Frame(f) if f.is_recoverable());
                if !recoverable {
                    self.failed = Some(e.clone());
                }
                Err(e)
            }
            ok => ok,
        }
    }

    /// Fails with the error that ended the stream, if one did, or because a payload read
    /// was dropped midway (which ends it now).
    fn check_in_step(&mut self) -> Result<(), ReadError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if self.mid_payload {
            let e = ReadError::from(io::Error::other(
                "a payload read was dropped midway; the stream is out of sync",
            ));
            self.failed = Some(e.clone());
            return Err(e);
        }
        Ok(())
    }

    /// Reads the next frame, which must be a [`FrameKind::Payload`] frame of exactly
    /// `dst.len()` bytes, straight into `dst`: the chunk that a `Data` or `Put` frame just
    /// announced, read into its destination with no copy in between.
    ///
    /// The header is checked before a payload byte is read: magic, version, length against
    /// the cap, kind ([`FrameError::KindMismatch`] naming the header's kind and `Payload`),
    /// length equal to `dst.len()` ([`FrameError::Invalid`]). The CRC is computed as the
    /// bytes arrive and checked once all are in `dst`.
    ///
    /// Returns `Ok(())` once `dst` holds the whole payload and the CRC matched. On
    /// [`FrameError::CrcMismatch`] `dst` holds bytes that are not what the peer sent (the
    /// caller must not use them), and the stream is at the next frame, so reading may go
    /// on. Every other error (a refused header, an end of stream inside the frame, I/O)
    /// leaves the stream out of sync, and every later call returns it again. Call it only
    /// between frames: after a partly read frame (a cancelled [`FrameReader::read`]) it
    /// fails like that too.
    ///
    /// # Cancel safety
    ///
    /// Not cancel-safe: the bytes already read are gone if the future is dropped, and every
    /// later call then fails.
    pub async fn read_payload_into(&mut self, dst: &mut [u8]) -> Result<(), ReadError> {
        let len = dst.len();
        self.read_payload(len, Some(dst)).await
    }

    /// Reads the next frame, which must be a [`FrameKind::Payload`] frame of exactly `len`
    /// bytes, and throws its bytes away: for a chunk whose destination is gone (a cancelled
    /// transfer) or was refused, so that the stream stays in step. The bytes go through a
    /// small buffer in pieces, whatever `len` is. Same checks, errors and cancel safety as
    /// [`FrameReader::read_payload_into`]; a CRC mismatch is still reported.
    pub async fn discard_payload(&mut self, len: usize) -> Result<(), ReadError> {
        self.read_payload(len, None).await
    }

    async fn read_payload(&mut self, len: usize, dst: Option<&mut [u8]>) -> Result<(), ReadError> {
        self.check_in_step()?;
        if self.header.is_some() || self.header_filled != 0 {
            let e = ReadError::from(io::Error::other(
                "a payload read started inside a partly read frame",
            ));
            self.failed = Some(e.clone());
            return Err(e);
        }
        self.mid_payload = true;
        let result = self.read_payload_inner(len, dst).await;
        self.mid_payload = false;
        if let Err(e) = &result
            && !matches!(e, ReadError::Frame(FrameError::CrcMismatch { .. }))
        {
            self.failed = Some(e.clone());
        }
        result
    }

    /// Reads some bytes of a frame already begun into `buf`, within the stall timeout.
    /// `got` and `needed` describe the frame for the error.
    async fn read_in_frame(
        inner: &mut R,
        buf: &mut [u8],
        stall: Option<Duration>,
        got: usize,
        needed: usize,
    ) -> Result<usize, ReadError> {
        let Some(waited) = stall else {
            return Ok(inner.read(buf).await?);
        };
        match tokio::time::timeout(waited, inner.read(buf)).await {
            Ok(read) => Ok(read?),
            Err(_) => Err(FrameError::Stalled {
                waited,
                got,
                needed,
            }
            .into()),
        }
    }

    async fn read_payload_inner(
        &mut self,
        len: usize,
        dst: Option<&mut [u8]>,
    ) -> Result<(), ReadError> {
        let mut raw = [0u8; HEADER_LEN];
        let mut filled = 0;
        while filled < HEADER_LEN {
            let n = Self::read_in_frame(
                &mut self.inner,
                &mut raw[filled..],
                self.stall,
                filled,
                HEADER_LEN + len,
            )
            .await?;
            if n == 0 {
                return Err(FrameError::Truncated {
                    needed: HEADER_LEN,
                    got: filled,
                }
                .into());
            }
            filled += n;
        }
        let header = parse_header(&raw, self.max_frame)?;
        if header.kind != FrameKind::Payload {
            return Err(FrameError::KindMismatch {
                header: header.kind as u16,
                payload: FrameKind::Payload as u16,
            }
            .into());
        }
        if header.len as usize != len {
            return Err(FrameError::Invalid(format!(
                "payload frame of {} bytes where a chunk of {len} was announced",
                header.len
            ))
            .into());
        }
        let truncated = |done: usize| FrameError::Truncated {
            needed: header.frame_len(),
            got: HEADER_LEN + done,
        };
        let mut crc = crc32c::crc32c(&raw[..CRC_COVERED]);
        let mut done = 0;
        match dst {
            Some(dst) => {
                while done < len {
                    let n = Self::read_in_frame(
                        &mut self.inner,
                        &mut dst[done..],
                        self.stall,
                        HEADER_LEN + done,
                        HEADER_LEN + len,
                    )
                    .await?;
                    if n == 0 {
                        return Err(truncated(done).into());
                    }
                    crc = crc32c::crc32c_append(crc, &dst[done..done + n]);
                    done += n;
                }
            }
            None => {
                if self.scratch.is_empty() {
                    self.scratch = vec![0; DISCARD_CHUNK];
                }
                while done < len {
                    let want = (len - done).min(self.scratch.len());
                    let n = Self::read_in_frame(
                        &mut self.inner,
                        &mut self.scratch[..want],
                        self.stall,
                        HEADER_LEN + done,
                        HEADER_LEN + len,
                    )
                    .await?;
                    if n == 0 {
                        return Err(truncated(done).into());
                    }
                    crc = crc32c::crc32c_append(crc, &self.scratch[..n]);
                    done += n;
                }
            }
        }
        if crc != header.crc {
            return Err(FrameError::CrcMismatch {
                expected: header.crc,
                actual: crc,
            }
            .into());
        }
        Ok(())
    }

    async fn read_inner(&mut self) -> Result<Option<Frame>, ReadError> {
        let header = match self.header {
            Some(header) => header,
            None => {
                while self.header_filled < HEADER_LEN {
                    let buf = &mut self.raw_header[self.header_filled..];
                    // Between frames the wait is unbounded; once a frame began, it is not.
                    let n = if self.header_filled == 0 {
                        self.inner.read(buf).await?
                    } else {
                        Self::read_in_frame(
                            &mut self.inner,
                            buf,
                            self.stall,
                            self.header_filled,
                            HEADER_LEN,
                        )
                        .await?
                    };
                    if n == 0 {
                        if self.header_filled == 0 {
                            return Ok(None);
                        }
                        return Err(FrameError::Truncated {
                            needed: HEADER_LEN,
                            got: self.header_filled,
                        }
                        .into());
                    }
                    self.header_filled += n;
                }
                let header = parse_header(&self.raw_header, self.max_frame)?;
                self.header = Some(header);
                self.payload = AlignedVec::new();
                self.payload_filled = 0;
                header
            }
        };

        let len = header.len as usize;
        while self.payload_filled < len {
            if self.payload.len() == self.payload_filled {
                let grown = (self.payload_filled.saturating_mul(2))
                    .max(INITIAL_READ_CHUNK)
                    .min(len);
                self.payload.resize(grown, 0);
            }
            let n = Self::read_in_frame(
                &mut self.inner,
                &mut self.payload[self.payload_filled..],
                self.stall,
                HEADER_LEN + self.payload_filled,
                header.frame_len(),
            )
            .await?;
            if n == 0 {
                return Err(FrameError::Truncated {
                    needed: header.frame_len(),
                    got: HEADER_LEN + self.payload_filled,
                }
                .into());
            }
            self.payload_filled += n;
        }

        // The frame is complete: reset for the next one before checking this one, so a
        // recoverable error leaves the reader at the next frame boundary.
        self.header = None;
        self.header_filled = 0;
        // `payload` grew to exactly `len` bytes above, never past it.
        let payload = std::mem::take(&mut self.payload);
        Ok(Some(Frame::from_checked_header(
            header,
            &self.raw_header,
            payload,
        )?))
    }

    /// The underlying stream, to read or write raw bytes between frames (a handshake before
    /// the first one). Reading from it while a frame is partly read desynchronizes the
    /// stream.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Gives back the underlying stream. Bytes of a partly read frame are lost.
    pub fn into_inner(self) -> R {
        self.inner
    }
}

/// Reads one frame from `r` with payloads capped at `max_frame` bytes.
///
/// Returns `Ok(None)` on a clean end of stream before the first header byte; an end inside
/// the frame is [`FrameError::Truncated`]. Reads exactly the frame's bytes from `r` (the
/// header, then no more than `len` payload bytes), so a header that fails its checks costs
/// no further read and no allocation.
///
/// # Cancel safety
///
/// Not cancel-safe: bytes already read are lost if the future is dropped. Keep a
/// [`FrameReader`] instead when reading inside `select!`.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_frame: u32,
) -> Result<Option<Frame>, ReadError> {
    FrameReader::new(r, max_frame).read().await
}
