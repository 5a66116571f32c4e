//! Opening a link: the [`Hello`] this process sends, dialing ([`dial`]) and accepting
//! ([`accept_handshake`]) a connection, and on either side the authentication and the
//! `Hello` exchange under one timeout.

use tokio::io::BufReader;
use tokio::net::{TcpStream, UnixStream};

use super::activity::Counted;
use super::admission::Stage;
use super::auth::{Role, authenticate};
use super::listener::Stream;
use super::{
    Accepted, Activity, BoxRead, BoxWrite, Endpoint, Link, LinkError, LinkOptions, LinkReader,
    LinkWriter, Secret,
};
use crate::wire::{FrameKind, Hello, Message, PROTOCOL_VERSION};

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
///
/// [`Listener::accept`]: super::Listener::accept
/// [`admission::Gate::admit_accepted`]: super::admission::Gate::admit_accepted
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
