//! The fd-sharing socket: how a node hands file descriptors (its GPU pools, the staged
//! transport's rings, the ipc lane's rings) to a same-host peer that proved it holds the
//! link's secret.
//!
//! The control link cannot carry a descriptor: its reader reads ahead into a buffer, and a
//! descriptor attached to bytes read by a plain `read` is lost. So every node listens on a
//! second Unix socket, in the abstract namespace (no file to clean up), named after the node
//! and its pid (both in its `Hello`):
//!
//! ```text
//! fetcher                                    owner (fd-sharing socket)
//!   connect ───────────────────────────────────> accept
//!   mutual HMAC challenge (the link's secret) <─> (unbuffered: nothing read ahead)
//!   u16 length + key (a device UUID, or a ring's unguessable key) ──>
//!                               <──────────────  one message: b"+" with the fd,
//!                                                or b"-" and the reason, no fd
//! ```

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};

use crate::cuda::ExportablePool;
use crate::link::admission::{AdmissionLimits, Gate, Progress, Stage};
use crate::link::auth::{Role, authenticate};
use crate::link::{LinkError, Secret, fdpass};

/// The abstract socket name of a node's fd-sharing socket.
pub fn socket_name(node: &str, pid: u32) -> String {
    format!("ferry-pools/{node}/{pid}")
}

/// How long one pool request may take, connection and authentication included.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The pools this node exports (shared by its allocators, which replace a pool, and its
/// transports, which name them to peers and hear of replacements).
pub type PoolDirectory = Arc<Pools>;

/// Retirements [`Pools`] remembers (a peer's part that fell further behind tells its peer
/// of the last ones only; a node retires a GPU's pool at most once per `memory.keep_idle`).
const RETIREMENTS_KEPT: usize = 16;

/// The pools this node exports, by name ([`crate::cuda::pool_name`]: a GPU's UUID and the
/// pool's generation), and the pools it retired, numbered, so that each same-host peer is
/// told to close its import of them (memory exported from a pool goes back to the GPU only
/// once the pool is destroyed here and its import closed there).
pub struct Pools {
    current: DashMap<String, ExportablePool>,
    retired: std::sync::Mutex<Retirements>,
    /// The number of the last retirement.
    count: tokio::sync::watch::Sender<u64>,
}

/// The last [`RETIREMENTS_KEPT`] pools retired, numbered from 1.
#[derive(Debug, Default)]
struct Retirements(std::collections::VecDeque<(u64, String)>);

impl Retirements {
    /// Records `name` as retired; its number.
    fn push(&mut self, name: &str) -> u64 {
        let number = self.0.back().map_or(1, |(n, _)| n + 1);
        if self.0.len() == RETIREMENTS_KEPT {
            self.0.pop_front();
        }
        self.0.push_back((number, name.to_string()));
        number
    }

    /// The pools retired after number `seen` (those still remembered), and the last number.
    fn since(&self, seen: u64) -> (Vec<String>, u64) {
        let names = self
            .0
            .iter()
            .filter(|(n, _)| *n > seen)
            .map(|(_, name)| name.clone())
            .collect();
        (names, self.0.back().map_or(seen, |(n, _)| *n))
    }
}

impl std::fmt::Debug for Pools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pools")
            .field("current", &self.names())
            .field("retirements", &self.retirements())
            .finish()
    }
}

impl Default for Pools {
    fn default() -> Self {
        Self {
            current: DashMap::new(),
            retired: std::sync::Mutex::default(),
            count: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl Pools {
    /// Exports `pool` under its name.
    pub fn insert(&self, pool: ExportablePool) {
        self.current.insert(pool.name().to_string(), pool);
    }

    /// The pool exported as `name`.
    pub fn get(&self, name: &str) -> Option<ExportablePool> {
        self.current.get(name).map(|p| p.clone())
    }

    /// The names of the pools exported now.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.current.iter().map(|e| e.key().clone()).collect();
        names.sort();
        names
    }

    /// `new` is exported instead of the pool named `old`, which is retired (peers are told
    /// to close their imports of it).
    pub fn replace(&self, old: &str, new: ExportablePool) {
        self.current.remove(old);
        self.insert(new);
        let number = self
            .retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(old);
        self.count.send_replace(number);
    }

    /// The pools retired after retirement number `seen`, and the number of the last.
    pub fn retired_since(&self, seen: u64) -> (Vec<String>, u64) {
        self.retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .since(seen)
    }

    /// The number of the last retirement (0: none yet).
    pub fn retirements(&self) -> u64 {
        *self.count.borrow()
    }

    /// Changes whenever a pool is retired.
    pub fn watch(&self) -> tokio::sync::watch::Receiver<u64> {
        self.count.subscribe()
    }
}

/// The shared memory this node offers its same-host peers (rings, pool segments), by the
/// key a transport's message names (unguessable: a prefix and 128 random bits, so a peer
/// fetches only what was offered to it).
pub type RingDirectory = Arc<DashMap<String, Arc<dyn SharedMemory>>>;

/// Memory a same-host peer maps by its descriptor, which the fd-sharing socket hands out.
pub trait SharedMemory: Send + Sync {
    /// The descriptor (a sealed memfd).
    fn descriptor(&self) -> std::os::fd::BorrowedFd<'_>;
}

impl SharedMemory for crate::link::ring::Ring {
    fn descriptor(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd()
    }
}

/// Why a peer's pool could not be fetched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// The peer's fd-sharing socket could not be reached or failed.
    #[error("the peer's fd-sharing socket {name}: {source}")]
    Io {
        /// The socket's abstract name.
        name: String,
        /// The error.
        source: io::Error,
    },
    /// Authentication failed.
    #[error("authenticating with the peer's fd-sharing socket: {0}")]
    Auth(LinkError),
    /// The peer answered with a refusal.
    #[error("the peer refused its pool: {0}")]
    Refused(String),
    /// It took longer than [`REQUEST_TIMEOUT`].
    #[error("the peer's fd-sharing socket did not answer within {REQUEST_TIMEOUT:?}")]
    Timeout,
}

/// Binds this node's fd-sharing socket. Serve it with [`serve`].
///
/// # Errors
/// The socket's error (e.g. the name is taken by another process).
pub fn bind(node: &str) -> io::Result<UnixListener> {
    let name = socket_name(node, std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr)?;
    listener.set_nonblocking(true)?;
    UnixListener::from_std(listener)
}

/// Pool requests in progress at once; past it the oldest idle one is shed (see
/// [`Gate`]).
const REQUESTS: usize = 64;

/// Answers pool requests until the listener fails; each connection in its own task, under
/// [`REQUEST_TIMEOUT`], at most 64 at once still sending their preamble and 64 past it (a
/// new one sheds the oldest that has got no further).
/// Runs on a tokio runtime.
pub async fn serve(
    listener: UnixListener,
    secret: Secret,
    pools: PoolDirectory,
    rings: RingDirectory,
) {
    // Requests in progress are bounded like link handshakes: a new one past the bound
    // sheds the oldest idle one, so idle connections cannot hold the socket.
    let gate = Gate::new(
        AdmissionLimits {
            total: REQUESTS,
            per_source: REQUESTS,
        },
        None,
    );
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "the fd-sharing socket failed; no more pool exports");
                return;
            }
        };
        let (ticket, _) = gate.admit("unix");
        let progress = ticket.progress();
        let secret = secret.clone();
        let pools = Arc::clone(&pools);
        let rings = Arc::clone(&rings);
        tokio::spawn(async move {
            let answer = tokio::time::timeout(
                REQUEST_TIMEOUT,
                answer(stream, &secret, &pools, &rings, progress),
            );
            let answered = ticket.run(answer).await.unwrap_or_else(|| {
                Ok(Err(AnswerError::Refused(
                    "shed: too many pool requests in progress".into(),
                )))
            });
            match answered {
                Ok(Ok(name)) => tracing::debug!(%name, "exported a pool to a peer"),
                Ok(Err(e)) => tracing::warn!(error = %e, "a pool request failed"),
                Err(_) => tracing::warn!("a pool request timed out"),
            }
        });
    }
}

async fn answer(
    mut stream: UnixStream,
    secret: &Secret,
    pools: &Pools,
    rings: &DashMap<String, Arc<dyn SharedMemory>>,
    progress: Progress,
) -> Result<String, AnswerError> {
    let (mut r, mut w) = stream.split();
    let on_preamble = || {
        progress.reached(Stage::Preamble);
    };
    authenticate(
        &mut r,
        &mut w,
        Role::Acceptor,
        secret,
        "pool request",
        on_preamble,
    )
    .await?;
    let len = stream.read_u16_le().await?;
    if len > 256 {
        return Err(AnswerError::Refused(format!(
            "a device name of {len} bytes"
        )));
    }
    let mut name = vec![0u8; usize::from(len)];
    stream.read_exact(&mut name).await?;
    let name = String::from_utf8_lossy(&name).into_owned();
    let exported = match (pools.get(&name), rings.get(&name)) {
        (Some(pool), _) => pool.export_fd().map_err(|e| e.to_string()),
        (None, Some(shared)) => shared
            .descriptor()
            .try_clone_to_owned()
            .map_err(|e| e.to_string()),
        (None, None) => Err(format!("no pool or shared memory named {name} here")),
    };
    match exported {
        Ok(fd) => {
            send_with_fd(&stream, fd.as_fd(), b"+").await?;
            Ok(name)
        }
        Err(why) => {
            let mut reply = b"-".to_vec();
            reply.extend_from_slice(why.as_bytes());
            stream.write_all(&reply).await?;
            Err(AnswerError::Refused(why))
        }
    }
}

async fn send_with_fd(
    stream: &UnixStream,
    fd: std::os::fd::BorrowedFd<'_>,
    payload: &[u8],
) -> io::Result<()> {
    stream
        .async_io(Interest::WRITABLE, || fdpass::send_fd(stream, fd, payload))
        .await
}

/// Why a pool request was not answered with a descriptor.
#[derive(Debug, thiserror::Error)]
enum AnswerError {
    /// The requester did not authenticate.
    #[error(transparent)]
    Auth(#[from] crate::link::LinkError),
    /// The socket failed.
    #[error(transparent)]
    Io(#[from] io::Error),
    /// Nothing of that name to give (told to the requester).
    #[error("{0}")]
    Refused(String),
}

/// Fetches the pool named `uuid` ([`crate::cuda::pool_name`]; or the lane ring under that key) from the same-host
/// node `node` (process `pid`), authenticating with `secret`. Returns the descriptor to
/// import ([`ExportablePool::import_fd`], or [`crate::link::ring::Ring::open`]).
///
/// # Errors
/// [`FetchError`], naming the cause.
pub async fn fetch(
    node: &str,
    pid: u32,
    uuid: &str,
    secret: &Secret,
) -> Result<OwnedFd, FetchError> {
    let name = socket_name(node, pid);
    let io_err = |source: io::Error| FetchError::Io {
        name: name.clone(),
        source,
    };
    let attempt = async {
        let addr =
            std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).map_err(io_err)?;
        let std_stream = std::os::unix::net::UnixStream::connect_addr(&addr).map_err(io_err)?;
        std_stream.set_nonblocking(true).map_err(io_err)?;
        let mut stream = UnixStream::from_std(std_stream).map_err(io_err)?;
        let (mut r, mut w) = stream.split();
        authenticate(
            &mut r,
            &mut w,
            Role::Dialer,
            secret,
            "fd-sharing socket",
            || {},
        )
        .await
        .map_err(FetchError::Auth)?;
        let len = u16::try_from(uuid.len())
            .map_err(|_| FetchError::Refused(format!("device name {uuid} too long")))?;
        let mut request = len.to_le_bytes().to_vec();
        request.extend_from_slice(uuid.as_bytes());
        stream.write_all(&request).await.map_err(io_err)?;
        let mut reply = [0u8; 512];
        let (fd, n) = stream
            .async_io(Interest::READABLE, || {
                fdpass::recv_maybe_fd(&stream, &mut reply)
            })
            .await
            .map_err(io_err)?;
        match (fd, reply.first()) {
            (Some(fd), Some(b'+')) => Ok(fd),
            (_, Some(b'-')) => Err(FetchError::Refused(
                String::from_utf8_lossy(&reply[1..n]).into_owned(),
            )),
            _ => Err(FetchError::Refused(
                "the answer carried no descriptor".into(),
            )),
        }
    };
    tokio::time::timeout(REQUEST_TIMEOUT, attempt)
        .await
        .unwrap_or(Err(FetchError::Timeout))
}

#[cfg(test)]
mod tests {
    use super::{RETIREMENTS_KEPT, Retirements};

    #[test]
    fn retirements_are_numbered_and_told_once_past_what_was_seen() {
        let mut retired = Retirements::default();
        assert_eq!(retired.since(0), (vec![], 0));
        assert_eq!(retired.push("GPU-a#0"), 1);
        assert_eq!(retired.push("GPU-b#0"), 2);
        assert_eq!(
            retired.since(0),
            (vec!["GPU-a#0".into(), "GPU-b#0".into()], 2)
        );
        assert_eq!(retired.since(1), (vec!["GPU-b#0".into()], 2));
        assert_eq!(retired.since(2), (vec![], 2));
    }

    #[test]
    fn retirements_keep_only_the_last_ones() {
        let mut retired = Retirements::default();
        for g in 0..RETIREMENTS_KEPT as u64 + 3 {
            retired.push(&format!("GPU-a#{g}"));
        }
        let (names, last) = retired.since(0);
        assert_eq!(last, RETIREMENTS_KEPT as u64 + 3);
        assert_eq!(names.len(), RETIREMENTS_KEPT);
        assert_eq!(names.first().map(String::as_str), Some("GPU-a#3"));
    }
}
