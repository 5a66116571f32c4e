//! A TCP proxy of the test's own that makes a path slow or lossy: it delays every byte
//! (latency), paces them (bandwidth), refuses new connections, and cuts the connections it
//! carries on command, with a FIN or a RST, mid-transfer.
//!
//! It runs as tasks of the test's tokio runtime; one task per connection moves bytes both
//! ways through a delay line: a chunk read at `t` is written no earlier than `t + latency`,
//! and no faster than `rate`. What is queued is bounded (`QUEUE` bytes each way); the proxy
//! stops reading while it is full, so a slow path pushes back on the sender as a real one
//! does.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

/// Bytes read per chunk.
const CHUNK: usize = 64 * 1024;
/// Bytes queued in the delay line, each way.
const QUEUE: usize = 4 << 20;

/// How the path behaves for the bytes it carries from now on.
#[derive(Debug, Clone, Copy, Default)]
pub struct Shape {
    /// Added to every byte's trip, each way.
    pub latency: Duration,
    /// Bytes per second each way; `None`: as fast as the sockets go.
    pub rate: Option<u64>,
    /// Close every new connection at once.
    pub refuse: bool,
}

/// How [`Proxy::cut`] ends the connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Both sockets closed: the peers read the end of the stream (a FIN).
    Close,
    /// Both sockets reset (`SO_LINGER` 0): the peers' next read or write fails.
    Reset,
}

struct Control {
    shape: Mutex<Shape>,
    /// Bumped by each cut, with the kind of the latest.
    cuts: watch::Sender<(u64, Cut)>,
    /// Bytes written towards the upstream server, over every connection.
    upstream_bytes: AtomicU64,
    /// Connections accepted.
    accepted: AtomicU64,
}

/// A proxy listening on an address of the current network namespace, forwarding to one
/// upstream address. Its tasks end with the runtime.
pub struct Proxy {
    /// Where it listens.
    pub addr: SocketAddr,
    control: Arc<Control>,
}

impl Proxy {
    /// Listens on `listen` (port 0: any) and forwards every connection to `upstream`.
    pub async fn start(listen: SocketAddr, upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind(listen).await.expect("proxy binds");
        let addr = listener.local_addr().expect("proxy address");
        let control = Arc::new(Control {
            shape: Mutex::new(Shape::default()),
            cuts: watch::Sender::new((0, Cut::Close)),
            upstream_bytes: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
        });
        tokio::spawn(accept(listener, upstream, Arc::clone(&control)));
        Self { addr, control }
    }

    /// Shapes what the path carries from now on.
    pub fn shape(&self, shape: Shape) {
        *self.control.shape.lock().expect("shape lock") = shape;
    }

    /// Ends every connection the proxy carries now, as `how` says; later ones are not
    /// affected.
    pub fn cut(&self, how: Cut) {
        self.control.cuts.send_modify(|(generation, kind)| {
            *generation += 1;
            *kind = how;
        });
    }

    /// Bytes written towards the upstream server so far.
    pub fn upstream_bytes(&self) -> u64 {
        self.control.upstream_bytes.load(Ordering::Relaxed)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.control.accepted.load(Ordering::Relaxed)
    }
}

async fn accept(listener: TcpListener, upstream: SocketAddr, control: Arc<Control>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        control.accepted.fetch_add(1, Ordering::Relaxed);
        if control.shape.lock().expect("shape lock").refuse {
            drop(client);
            continue;
        }
        let cuts = control.cuts.subscribe();
        tokio::spawn(carry(client, upstream, Arc::clone(&control), cuts));
    }
}

/// Bytes read and not yet written, each chunk with the time it may leave.
#[derive(Default)]
struct DelayLine {
    chunks: VecDeque<(Instant, Vec<u8>)>,
    /// Bytes of the front chunk already written.
    written: usize,
    queued: usize,
    /// Pacing: the earliest time the next byte may leave.
    next_free: Option<Instant>,
    /// The reading side ended.
    eof: bool,
    /// The writing side was shut down after `eof`.
    shut: bool,
}

impl DelayLine {
    fn room(&self) -> bool {
        !self.eof && self.queued < QUEUE
    }

    /// When the front chunk may be written: `None` when there is none.
    fn due(&self) -> Option<Instant> {
        let (at, _) = self.chunks.front()?;
        Some(self.next_free.map_or(*at, |free| free.max(*at)))
    }

    fn push(&mut self, data: &[u8], latency: Duration) {
        self.queued += data.len();
        self.chunks
            .push_back((Instant::now() + latency, data.to_vec()));
    }

    /// Writes what it can of the front chunk to `to`; returns the bytes written.
    fn write_some(&mut self, to: &TcpStream, rate: Option<u64>) -> std::io::Result<usize> {
        let Some((_, chunk)) = self.chunks.front() else {
            return Ok(0);
        };
        let mut slice = &chunk[self.written..];
        if let Some(rate) = rate {
            // At most 10 ms worth at once, so the pace stays smooth.
            let burst = usize::try_from((rate / 100).max(1)).unwrap_or(usize::MAX);
            slice = &slice[..slice.len().min(burst)];
        }
        let n = match to.try_write(slice) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(0),
            Err(e) => return Err(e),
        };
        self.written += n;
        self.queued -= n;
        if self.written == chunk.len() {
            self.chunks.pop_front();
            self.written = 0;
        }
        if let Some(rate) = rate {
            let start = self
                .next_free
                .map_or(Instant::now(), |f| f.max(Instant::now()));
            self.next_free = Some(start + Duration::from_secs_f64(n as f64 / rate as f64));
        }
        Ok(n)
    }
}

/// What a read readiness turned into.
fn read_into(from: &TcpStream, line: &mut DelayLine, latency: Duration) -> std::io::Result<()> {
    let mut buf = vec![0u8; CHUNK];
    match from.try_read(&mut buf) {
        Ok(0) => line.eof = true,
        Ok(n) => line.push(&buf[..n], latency),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        Err(e) => return Err(e),
    }
    Ok(())
}

/// Carries one connection until both directions ended, an error, or a cut.
async fn carry(
    client: TcpStream,
    upstream: SocketAddr,
    control: Arc<Control>,
    mut cuts: watch::Receiver<(u64, Cut)>,
) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let mut client = client;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    // `up`: client to server; `down`: server to client.
    let (mut up, mut down) = (DelayLine::default(), DelayLine::default());
    loop {
        let shape = *control.shape.lock().expect("shape lock");
        let now = Instant::now();
        let up_due = up.due();
        let down_due = down.due();
        let up_ready = up_due.is_some_and(|t| t <= now);
        let down_ready = down_due.is_some_and(|t| t <= now);
        let wake = [up_due, down_due]
            .into_iter()
            .flatten()
            .filter(|t| *t > now)
            .min();
        let step: std::io::Result<()> = tokio::select! {
            changed = cuts.changed() => {
                let how = match changed {
                    Ok(()) => cuts.borrow_and_update().1,
                    Err(_) => Cut::Close,
                };
                if how == Cut::Reset {
                    let _ = client.set_zero_linger();
                    let _ = server.set_zero_linger();
                }
                return;
            }
            r = client.readable(), if up.room() => r.and_then(|()| read_into(&client, &mut up, shape.latency)),
            r = server.readable(), if down.room() => r.and_then(|()| read_into(&server, &mut down, shape.latency)),
            r = server.writable(), if up_ready => r.and_then(|()| {
                let n = up.write_some(&server, shape.rate)?;
                control.upstream_bytes.fetch_add(n as u64, Ordering::Relaxed);
                Ok(())
            }),
            r = client.writable(), if down_ready => r.and_then(|()| down.write_some(&client, shape.rate).map(drop)),
            () = sleep_until(wake), if wake.is_some() => Ok(()),
        };
        if step.is_err() {
            return;
        }
        // Pass each side's end on once everything before it was written.
        if up.eof && up.chunks.is_empty() && !up.shut {
            up.shut = true;
            let _ = server.shutdown().await;
        }
        if down.eof && down.chunks.is_empty() && !down.shut {
            down.shut = true;
            let _ = client.shutdown().await;
        }
        if up.shut && down.shut {
            return;
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
