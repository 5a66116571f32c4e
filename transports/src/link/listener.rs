//! Listening sockets and the connections they accept, before authentication.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{MsgFlags, recv};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use super::admission::{Progress, Stage};
use super::auth::{PREAMBLE_LEN, dialer_preamble_stage};
use super::{BoxRead, BoxWrite, Endpoint};

/// A connected socket of either kind.
#[derive(Debug)]
pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Splits into owned, boxed halves (no lock between them).
    pub(crate) fn into_halves(self) -> (BoxRead, BoxWrite) {
        match self {
            Self::Tcp(s) => {
                let (r, w) = s.into_split();
                (Box::new(r), Box::new(w))
            }
            Self::Unix(s) => {
                let (r, w) = s.into_split();
                (Box::new(r), Box::new(w))
            }
        }
    }
}

/// Describes a Unix-socket peer for logs and errors: its pid when the kernel tells it.
pub(crate) fn describe_unix_peer(stream: &UnixStream, path: &Path) -> String {
    match stream.peer_cred().ok().and_then(|c| c.pid()) {
        Some(pid) => format!("unix:{} (pid {pid})", path.display()),
        None => format!("unix:{}", path.display()),
    }
}

/// The admission source of an address: the address itself for IPv4, its /64 prefix for
/// IPv6 (one host usually holds a whole /64, so counting each address apart would let one
/// host be many sources).
fn source_of(ip: std::net::IpAddr) -> String {
    match ip {
        std::net::IpAddr::V4(v4) => v4.to_string(),
        std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => {
                let s = v6.segments();
                format!("{:x}:{:x}:{:x}:{:x}::/64", s[0], s[1], s[2], s[3])
            }
        },
    }
}

/// How far the peer on `socket` has come into a dialer's preamble by what has arrived: one
/// look, without waiting and without taking the bytes. [`Stage::Idle`] when nothing has
/// arrived, the peer has closed, or the socket fails.
pub(crate) fn peek_stage(socket: BorrowedFd<'_>) -> Stage {
    let mut arrived = [0u8; PREAMBLE_LEN];
    match recv(
        socket.as_raw_fd(),
        &mut arrived,
        MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
    ) {
        Ok(n) => dialer_preamble_stage(&arrived[..n]),
        Err(_) => Stage::Idle,
    }
}

/// A connection accepted by a [`Listener`], not yet authenticated. Hand it to
/// [`accept_handshake`](super::accept_handshake), ideally in its own task.
#[derive(Debug)]
pub struct Accepted {
    pub(crate) stream: Stream,
    pub(crate) peer: String,
    source: String,
    /// Where its handshake reports how far it has come, once admitted.
    pub(crate) progress: Option<Progress>,
}

impl Accepted {
    /// The source the connection counts against for admission: the peer's IP address for
    /// TCP (every port of one address is one source), `"unix"` for every Unix-socket peer.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// How far the peer has come into its preamble with what it has sent so far: the stage
    /// to admit it at. Looks at what has arrived without waiting and without reading it
    /// (the bytes stay for the handshake); [`Stage::Idle`] when nothing has arrived, the
    /// peer has closed, or the socket fails (the handshake finds that out).
    pub fn stage(&self) -> Stage {
        peek_stage(self.socket())
    }

    fn socket(&self) -> BorrowedFd<'_> {
        match &self.stream {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
        }
    }

    /// A duplicate of the socket's descriptor (the same connection), to look at what has
    /// arrived while the handshake holds the socket; `None` when the process is out of
    /// descriptors.
    pub(crate) fn socket_copy(&self) -> Option<OwnedFd> {
        self.socket().try_clone_to_owned().ok()
    }

    /// Has the handshake report its progress to `progress` (the connection's place in an
    /// admission gate, [`Gate::admit_accepted`](super::admission::Gate::admit_accepted)):
    /// its first byte ([`first_byte`](Self::first_byte)) and its whole preamble
    /// ([`accept_handshake`](super::accept_handshake)).
    pub(crate) fn report_to(&mut self, progress: Progress) {
        self.progress = Some(progress);
    }

    /// Waits until the peer has sent its first byte (or closed), at most `within`: a
    /// connection that says nothing for that long is not worth a handshake. Reads nothing.
    /// A byte that arrived is reported as [`Stage::Partial`] to the connection's admission
    /// gate, if it has one.
    ///
    /// Fails with `TimedOut` when nothing arrived in time, or the socket error.
    pub async fn first_byte(&self, within: Duration) -> io::Result<()> {
        let wait = async {
            match &self.stream {
                Stream::Tcp(s) => s.peek(&mut [0u8; 1]).await.map(drop),
                Stream::Unix(s) => s.readable().await,
            }
        };
        match tokio::time::timeout(within, wait).await {
            Ok(ready) => {
                if ready.is_ok()
                    && let Some(progress) = &self.progress
                {
                    progress.reached(Stage::Partial);
                }
                ready
            }
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no byte within {within:?}"),
            )),
        }
    }

    /// Who connected, as text for logs and errors (`"tcp:10.0.0.7:51234"`,
    /// `"unix:/run/ferry.sock (pid 4711)"`). Unauthenticated: do not trust it.
    pub fn peer(&self) -> &str {
        &self.peer
    }
}

#[derive(Debug)]
enum Inner {
    Tcp(TcpListener),
    Unix {
        listener: UnixListener,
        path: PathBuf,
        /// (device, inode) of the socket file we created, so that dropping the listener
        /// removes that file and never one that replaced it.
        file_id: Option<(u64, u64)>,
    },
}

/// A bound listening socket, TCP or Unix. Binds only the address it is given.
///
/// Dropping a Unix listener removes its socket file (if it is still the one it created).
#[derive(Debug)]
pub struct Listener {
    inner: Inner,
}

impl Listener {
    /// Binds a TCP listener on `addr` (`"127.0.0.1:7000"`, `"[::1]:0"` for any free port).
    ///
    /// Fails with the socket error (address in use, not available, permission).
    pub async fn bind_tcp(addr: &str) -> io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        Ok(Self {
            inner: Inner::Tcp(listener),
        })
    }

    /// Binds a Unix-socket listener at `path`.
    ///
    /// A socket file already at `path` is removed first if nobody listens on it (left over
    /// by a process that died). Fails with [`io::ErrorKind::AddrInUse`] if a live listener
    /// answers there, [`io::ErrorKind::AlreadyExists`] if `path` is something other than a
    /// socket, or the socket error.
    pub async fn bind_unix(path: impl AsRef<Path>) -> io::Result<Self> {
        let path = path.as_ref();
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                if UnixStream::connect(path).await.is_ok() {
                    return Err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        format!("{} is in use by a live listener", path.display()),
                    ));
                }
                std::fs::remove_file(path)?;
            }
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", path.display()),
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = UnixListener::bind(path)?;
        let file_id = std::fs::symlink_metadata(path)
            .ok()
            .map(|m| (m.dev(), m.ino()));
        Ok(Self {
            inner: Inner::Unix {
                listener,
                path: path.to_owned(),
                file_id,
            },
        })
    }

    /// Binds whichever kind `endpoint` names.
    pub async fn bind(endpoint: &Endpoint) -> io::Result<Self> {
        match endpoint {
            Endpoint::Tcp(addr) => Self::bind_tcp(addr).await,
            Endpoint::Unix(path) => Self::bind_unix(path).await,
        }
    }

    /// Where peers reach this listener (for TCP, with the port actually bound).
    pub fn endpoint(&self) -> io::Result<Endpoint> {
        match &self.inner {
            Inner::Tcp(l) => Ok(Endpoint::Tcp(l.local_addr()?.to_string())),
            Inner::Unix { path, .. } => Ok(Endpoint::Unix(path.clone())),
        }
    }

    /// Waits for the next connection. Returns it with a description of the peer (the same
    /// text as [`Accepted::peer`]). Nothing is read from it yet.
    ///
    /// Fails with the socket error; errors such as running out of file descriptors are
    /// transient, and the caller may keep accepting.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a dropped call accepts nothing.
    pub async fn accept(&self) -> io::Result<(Accepted, String)> {
        let accepted = match &self.inner {
            Inner::Tcp(l) => {
                let (stream, addr) = l.accept().await?;
                stream.set_nodelay(true)?;
                Accepted {
                    stream: Stream::Tcp(stream),
                    peer: format!("tcp:{addr}"),
                    source: source_of(addr.ip()),
                    progress: None,
                }
            }
            Inner::Unix { listener, path, .. } => {
                let (stream, _) = listener.accept().await?;
                let peer = describe_unix_peer(&stream, path);
                Accepted {
                    stream: Stream::Unix(stream),
                    peer,
                    source: "unix".to_owned(),
                    progress: None,
                }
            }
        };
        let peer = accepted.peer.clone();
        Ok((accepted, peer))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Inner::Unix {
            path,
            file_id: Some(id),
            ..
        } = &self.inner
        {
            let still_ours = std::fs::symlink_metadata(path)
                .map(|m| (m.dev(), m.ino()) == *id)
                .unwrap_or(false);
            if still_ours {
                // Best effort: a leftover file is removed by the next bind anyway.
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_host_counts_as_one_source_per_64() {
        let a: std::net::IpAddr = "2001:db8:1:2::7".parse().expect("ip");
        let b: std::net::IpAddr = "2001:db8:1:2:ffff::1".parse().expect("ip");
        let c: std::net::IpAddr = "2001:db8:1:3::7".parse().expect("ip");
        assert_eq!(source_of(a), source_of(b));
        assert_ne!(source_of(a), source_of(c));
        let mapped: std::net::IpAddr = "::ffff:198.18.0.1".parse().expect("ip");
        assert_eq!(source_of(mapped), "198.18.0.1");
        assert_eq!(source_of("198.18.0.1".parse().expect("ip")), "198.18.0.1");
    }
}
