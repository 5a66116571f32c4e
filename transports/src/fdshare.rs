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

/// The pools this node exports, by device UUID.
pub type PoolDirectory = Arc<DashMap<String, ExportablePool>>;

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
                Ok(Ok(uuid)) => tracing::debug!(device = %uuid, "exported a pool to a peer"),
                Ok(Err(e)) => tracing::warn!(error = %e, "a pool request failed"),
                Err(_) => tracing::warn!("a pool request timed out"),
            }
        });
    }
}

async fn answer(
    mut stream: UnixStream,
    secret: &Secret,
    pools: &DashMap<String, ExportablePool>,
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
    let mut uuid = vec![0u8; usize::from(len)];
    stream.read_exact(&mut uuid).await?;
    let uuid = String::from_utf8_lossy(&uuid).into_owned();
    let exported = match (pools.get(&uuid), rings.get(&uuid)) {
        (Some(pool), _) => pool.export_fd().map_err(|e| e.to_string()),
        (None, Some(shared)) => shared
            .descriptor()
            .try_clone_to_owned()
            .map_err(|e| e.to_string()),
        (None, None) => Err(format!("no pool or shared memory named {uuid} here")),
    };
    match exported {
        Ok(fd) => {
            send_with_fd(&stream, fd.as_fd(), b"+").await?;
            Ok(uuid)
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

/// Fetches the pool of device `uuid` (or the lane ring under that key) from the same-host
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
