//! A link's activity: every byte read from or written to its socket, counted, so that the
//! transfers on it can tell a slow link from a stalled one, and a node that waits on its
//! peer can tell a quiet peer from one it no longer hears.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes moved over one link so far (shared by its two halves and by whoever watches it):
/// both ways, and received from the peer alone. Only ever grows; compare two readings to
/// see whether anything moved.
#[derive(Debug, Clone, Default)]
pub struct Activity(Arc<Counts>);

#[derive(Debug, Default)]
struct Counts {
    /// Both ways, keepalive frames included.
    moved: AtomicU64,
    /// From the peer, keepalive frames included.
    received: AtomicU64,
    /// Of keepalive frames ([`Ping`](crate::wire::Message::Ping) and
    /// [`Pong`](crate::wire::Message::Pong)), both ways.
    keepalive: AtomicU64,
}

impl Activity {
    /// Bytes moved so far, both ways, keepalive frames left out: what the link did for its
    /// transfers (a keepalive shows here for the moment between its bytes passing the
    /// socket and the link reading or writing it whole).
    pub fn bytes(&self) -> u64 {
        let moved = self.0.moved.load(Ordering::Relaxed);
        moved.saturating_sub(self.0.keepalive.load(Ordering::Relaxed))
    }

    /// Bytes received from the peer so far, keepalive frames included: while anything waits
    /// on the peer, this must grow (its answers to our keepalives make it grow on a quiet
    /// link), or the peer is gone or the link half-open.
    pub fn received(&self) -> u64 {
        self.0.received.load(Ordering::Relaxed)
    }

    /// Counts `n` more bytes sent by a channel beside the socket (such as a shared ring).
    pub fn add(&self, n: u64) {
        self.0.moved.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts `n` more bytes received from the peer by a channel beside the socket.
    pub fn add_received(&self, n: u64) {
        self.0.moved.fetch_add(n, Ordering::Relaxed);
        self.0.received.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts a keepalive frame of `n` bytes, read or written whole, out of [`Self::bytes`].
    pub(crate) fn add_keepalive(&self, n: u64) {
        self.0.keepalive.fetch_add(n, Ordering::Relaxed);
    }
}

/// A socket half that counts what passes through it into an [`Activity`]; what it reads
/// counts as received from the peer.
pub(crate) struct Counted<T> {
    inner: T,
    activity: Activity,
}

impl<T> Counted<T> {
    pub(crate) fn new(inner: T, activity: Activity) -> Self {
        Self { inner, activity }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        if read > 0 {
            self.activity.add_received(read as u64);
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &polled {
            self.activity.add(*n as u64);
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = &polled {
            self.activity.add(*n as u64);
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn both_directions_count_into_one_activity_and_reads_as_received() {
        let (a, b) = tokio::io::duplex(64);
        let activity = Activity::default();
        let mut a = Counted::new(a, activity.clone());
        let mut b = Counted::new(b, activity.clone());
        a.write_all(b"hello").await.expect("write");
        let mut got = [0u8; 5];
        b.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"hello");
        assert_eq!(activity.bytes(), 10, "five written and five read");
        assert_eq!(activity.received(), 5, "five read");
        activity.add(3);
        activity.add_received(2);
        assert_eq!((activity.bytes(), activity.received()), (15, 7));
        // A keepalive of 4 of those bytes: received still, but no progress of the link's.
        activity.add_keepalive(4);
        assert_eq!((activity.bytes(), activity.received()), (11, 7));
    }
}
