//! The far end of a bench: a node that verifies every buffer it receives and reports what it
//! saw, plus a raw-socket server for the baseline. Runs as `ferry bench --serve-peer CONFIG`.

use std::collections::{BTreeSet, HashMap};

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferry::{MemoryKind, Node, Received};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::pattern;

/// Asks the peer how many buffers it received from the asking client and how many were
/// wrong since that client's last report; it answers under the same tag with 16 bytes
/// (received, wrong; little endian) followed by the names of the transports that carried
/// them, comma-separated ASCII.
pub const TAG_REPORT: u64 = u64::MAX - 10;
/// Asks the peer to send buffers back: payload is (len, count, window[, memory]) as 24 or
/// 32 bytes, little endian; memory is [`SEND_HOST`] (the default) or [`SEND_DEVICE`].
pub const TAG_SEND: u64 = u64::MAX - 11;
/// [`TAG_SEND`]'s memory word: send back host buffers.
pub const SEND_HOST: u64 = 0;
/// [`TAG_SEND`]'s memory word: send back buffers on the peer's first GPU.
pub const SEND_DEVICE: u64 = 1;
/// Tag of the buffers a peer sends back after [`TAG_SEND`].
pub const TAG_RETURN: u64 = u64::MAX - 12;

/// A latency probe: the peer sends the buffer straight back under [`TAG_PONG`].
pub const TAG_PING: u64 = u64::MAX - 13;
/// Tag of a probe sent back.
pub const TAG_PONG: u64 = u64::MAX - 14;

/// `--fetchers`: asks the peer to publish buffers, payload (len, count, memory) as 24 bytes,
/// little endian (memory as [`TAG_SEND`]'s), each holding the pattern of its length; it
/// answers under the same tag with their keys, one a line.
pub const TAG_PUBLISH: u64 = u64::MAX - 15;
/// `--fetchers`: asks what the keys of the payload (one a line) served; once no fetch of
/// them is being served, the peer answers under the same tag with one line a key: `len
/// served bytes_served refused reading`.
pub const TAG_PUBLICATION: u64 = u64::MAX - 16;
/// `--fetchers`: asks the peer to unpublish the keys of the payload (one a line); it answers
/// `ok` under the same tag. An answer to any of the three that starts with `error: ` says
/// why the request failed.
pub const TAG_UNPUBLISH: u64 = u64::MAX - 17;

/// `--op read|write`: asks the peer to register a region, payload (len, memory) as 16
/// bytes, little endian (memory as [`TAG_SEND`]'s), filled with the pattern; it answers
/// under the same tag with its key as text, `region generation len`.
pub const TAG_REGION: u64 = u64::MAX - 18;
/// `--op read|write`: asks the peer to unregister the region whose key (its 24 bytes) is
/// the payload; it answers `ok` under the same tag.
pub const TAG_UNREGION: u64 = u64::MAX - 19;

/// Raw baseline connection modes, the first byte a client writes.
pub const RAW_SINK: u8 = b'S';
/// The server streams messages to the client.
pub const RAW_EMIT: u8 = b'E';

/// The ready line's field that lists the peer's TCP listening addresses (the socket
/// protocol its control link runs over, not a transport), comma-separated.
pub const LISTEN_FIELD: &str = "tcp";

/// How often the server looks for clients whose link went down, to forget what they sent.
const DEPARTURES_EVERY: Duration = Duration::from_secs(1);

/// `check`: verify the checksum of every buffer received (off with `--no-check`: reading
/// device memory back to the host costs far more than an ipc transfer).
///
/// Serves one client after another, or several at once: a client that leaves, whether it
/// finished or was killed mid-run, ends only its own work (logged); the server stops on an
/// error of its own (its node would not start, it could not bind) or when its node stops.
pub async fn serve(config: ferry::Config, check: bool) -> anyhow::Result<()> {
    super::super::telemetry::init(&config.telemetry);
    let node = Arc::new(Node::start(config).await?);
    let raw = TcpListener::bind("127.0.0.1:0")
        .await
        .context("cannot bind the baseline socket")?;
    let raw_addr = raw.local_addr()?;
    tokio::spawn(raw_server(raw));
    // Kept for the process's life: the engine baseline's engine and registered buffer.
    let engine = super::ucx_raw::serve(&node).await?;
    println!(
        "ferry bench peer: ready node={} {LISTEN_FIELD}={} baseline={raw_addr}{}",
        node.name(),
        node.tcp_addrs().join(","),
        engine
            .as_ref()
            .map(|u| format!(" {}", u.field))
            .unwrap_or_default()
    );
    // The GPU that device-memory send-backs come from: the first the node uses (GPU 0 when
    // gpu.devices is omitted: every GPU); none with gpu.devices = [].
    let gpu = node
        .config()
        .gpu
        .devices
        .as_ref()
        .map_or(Some(0), |d| d.first().copied());
    let mut server = Server {
        node,
        gpu,
        check,
        tallies: HashMap::new(),
        expected: HashMap::new(),
        pongs: HashMap::new(),
    };
    let node = Arc::clone(&server.node);
    let mut departures = tokio::time::interval(DEPARTURES_EVERY);
    departures.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // `recv` is cancel safe: a buffer that lands as the tick wins waits for the next.
        let received = tokio::select! {
            r = node.recv(None, None) => r.context("the bench peer's node stopped")?,
            _ = departures.tick() => {
                server.forget_departed().await?;
                continue;
            }
        };
        let client = received.peer.clone();
        if let Err(e) = server.handle(received).await {
            if node_stopped(&e) {
                return Err(e);
            }
            // Its tally stays: a client still here reports on, one gone is forgotten when
            // its link is seen down.
            log_client_failure(&client, &e, "a request of the client failed; serving on");
        }
    }
}

/// What one client sent since its last report.
#[derive(Default)]
struct Tally {
    received: u64,
    wrong: u64,
    transports: BTreeSet<&'static str>,
}

/// The serving side of the bench peer, shared by every client.
struct Server {
    node: Arc<Node>,
    /// The GPU that device-memory send-backs come from, if any.
    gpu: Option<u32>,
    check: bool,
    /// Per client (by peer name) seen and not gone since.
    tallies: HashMap<String, Tally>,
    /// The pattern's checksum by length.
    expected: HashMap<usize, u32>,
    /// The buffers pings are answered from, by memory and length.
    pongs: HashMap<(MemoryKind, usize), ferry::Buffer>,
}

impl Server {
    /// Handles one message of a client. An error ends only that request, unless
    /// [`node_stopped`] says the node itself is gone.
    async fn handle(&mut self, received: Received) -> anyhow::Result<()> {
        let Received {
            buffer,
            peer,
            tag,
            transport,
            ..
        } = received;
        match tag {
            TAG_REPORT => {
                let tally = std::mem::take(self.tally(&peer));
                let names = tally
                    .transports
                    .iter()
                    .copied()
                    .collect::<Vec<&str>>()
                    .join(",");
                let mut reply = self.node.alloc(MemoryKind::Host, 16 + names.len()).await?;
                let out = reply.as_mut_slice().context("fresh buffer")?;
                out[..8].copy_from_slice(&tally.received.to_le_bytes());
                out[8..16].copy_from_slice(&tally.wrong.to_le_bytes());
                out[16..].copy_from_slice(names.as_bytes());
                // Confirmed in a task of its own: the client may take the reply and leave
                // before its Done reaches us, which fails this send and nothing else.
                let node = Arc::clone(&self.node);
                tokio::spawn(async move {
                    if let Err(e) = node.send(&peer, TAG_REPORT, reply).await {
                        let e = anyhow::Error::new(e.error);
                        log_client_failure(&peer, &e, "the client did not confirm its report");
                    }
                });
            }
            TAG_SEND => {
                let words: Vec<u64> = buffer
                    .bytes()?
                    .chunks_exact(8)
                    .filter_map(|c| c.try_into().ok().map(u64::from_le_bytes))
                    .collect();
                let (len, count, window, memory) = match words[..] {
                    [len, count, window] => (len, count, window, SEND_HOST),
                    [len, count, window, memory] => (len, count, window, memory),
                    _ => anyhow::bail!("bad send request of {} bytes", buffer.len()),
                };
                let kind = match (memory, self.gpu) {
                    (SEND_HOST, _) => MemoryKind::Host,
                    (SEND_DEVICE, Some(gpu)) => MemoryKind::Device(gpu),
                    (SEND_DEVICE, None) => {
                        tracing::warn!("asked to send device memory back, but gpu.devices = []");
                        return Ok(());
                    }
                    _ => anyhow::bail!("bad send request: memory {memory}"),
                };
                let node = Arc::clone(&self.node);
                tokio::spawn(async move {
                    let sent = send_back(&node, &peer, kind, len as usize, count, window).await;
                    if let Err(e) = sent {
                        log_client_failure(&peer, &e, "sending back failed");
                    }
                });
            }
            TAG_PING => {
                // Answered from a buffer of our own, the same one each time (as a latency
                // test's two fixed buffers): back first, the probe checked after.
                let reply = match self.pongs.remove(&(buffer.kind(), buffer.len())) {
                    Some(b) => b,
                    None => {
                        let mut b = self.node.alloc(buffer.kind(), buffer.len()).await?;
                        pattern::fill_buffer(&mut b)?;
                        b
                    }
                };
                match self.node.send(&peer, TAG_PONG, reply).await {
                    Ok(reply) => {
                        self.pongs.insert((reply.kind(), reply.len()), reply);
                    }
                    Err(e) => {
                        if let Some(b) = e.buffer {
                            self.pongs.insert((b.kind(), b.len()), b);
                        }
                        return Err(anyhow::Error::new(e.error).context("answering a ping"));
                    }
                }
                self.count(&peer, transport.as_str(), &buffer)?;
            }
            TAG_PUBLISH | TAG_PUBLICATION | TAG_UNPUBLISH => {
                // Answered from a task of its own: an unpublish waits for its readers.
                let (node, gpu, payload) = (Arc::clone(&self.node), self.gpu, buffer.to_vec()?);
                tokio::spawn(async move {
                    let answer = super::fetch::serve(&node, &peer, gpu, tag, &payload)
                        .await
                        .unwrap_or_else(|e| format!("error: {e:#}"));
                    if let Err(e) = answer_text(&node, &peer, tag, &answer).await {
                        log_client_failure(&peer, &e, "a --fetchers request was not answered");
                    }
                });
            }
            TAG_REGION | TAG_UNREGION => {
                let (node, gpu, payload) = (Arc::clone(&self.node), self.gpu, buffer.to_vec()?);
                tokio::spawn(async move {
                    let answer = super::onesided::serve(&node, &peer, gpu, tag, &payload)
                        .await
                        .unwrap_or_else(|e| format!("error: {e:#}"));
                    if let Err(e) = answer_text(&node, &peer, tag, &answer).await {
                        log_client_failure(&peer, &e, "a region request was not answered");
                    }
                });
            }
            _ => self.count(&peer, transport.as_str(), &buffer)?,
        }
        Ok(())
    }

    /// Counts a buffer `peer` sent, checking it with `--check`.
    fn count(
        &mut self,
        peer: &str,
        transport: &'static str,
        buffer: &ferry::Buffer,
    ) -> anyhow::Result<()> {
        let ok = !self.check || pattern_holds(&mut self.expected, buffer)?;
        let tally = self.tally(peer);
        tally.received += 1;
        tally.transports.insert(transport);
        if !ok {
            tally.wrong += 1;
        }
        Ok(())
    }

    /// The tally of `client`, a fresh one for a client not seen (or gone) since.
    fn tally(&mut self, client: &str) -> &mut Tally {
        if !self.tallies.contains_key(client) {
            tracing::info!(client = %client, "client joined");
        }
        self.tallies.entry(client.to_string()).or_default()
    }

    /// Forgets the tallies of clients whose link is down: they left (finished, or killed),
    /// and a client that comes back under the same name starts afresh.
    async fn forget_departed(&mut self) -> anyhow::Result<()> {
        let published = self.node.published_keys();
        if self.tallies.is_empty() && published.is_empty() {
            return Ok(());
        }
        let live = self
            .node
            .connected_peers()
            .await
            .context("the bench peer's node stopped")?;
        self.tallies.retain(|client, tally| {
            let here = live.contains(client);
            if !here {
                tracing::info!(
                    client = %client,
                    unreported = tally.received,
                    "client left"
                );
            }
            here
        });
        super::fetch::unpublish_departed(&self.node, published, &live);
        super::onesided::unregister_departed(&self.node, &live);
        Ok(())
    }
}

/// Sends `text` to `client` under `tag`.
async fn answer_text(node: &Node, client: &str, tag: u64, text: &str) -> anyhow::Result<()> {
    let mut reply = node.alloc(MemoryKind::Host, text.len()).await?;
    reply.write(0, text.as_bytes())?;
    node.send(client, tag, reply)
        .await
        .map_err(|e| anyhow::Error::new(e.error))?;
    Ok(())
}

/// True when `e` says the node itself stopped (the one failure that ends the server).
fn node_stopped(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<ferry::Error>(),
            Some(ferry::Error::ShuttingDown)
        )
    })
}

/// A failure of one client's request: info when the client went away (it finished or was
/// killed: its link broke, or it stopped), warn otherwise.
fn log_client_failure(client: &str, e: &anyhow::Error, what: &str) {
    let gone = e.chain().any(|c| {
        matches!(
            c.downcast_ref::<ferry::Error>(),
            Some(ferry::Error::PeerLost { .. } | ferry::Error::PeerUnreachable { .. })
        )
    });
    if gone {
        tracing::info!(client = %client, error = %format!("{e:#}"), "{what}: the client left");
    } else {
        tracing::warn!(client = %client, error = %format!("{e:#}"), "{what}");
    }
}

/// True when `buffer` holds the bench pattern (checksums cached by length).
fn pattern_holds(
    expected: &mut HashMap<usize, u32>,
    buffer: &ferry::Buffer,
) -> anyhow::Result<bool> {
    let want = *expected
        .entry(buffer.len())
        .or_insert_with(|| pattern::crc(buffer.len()));
    Ok(crc32c::crc32c(&buffer.bytes()?) == want)
}

async fn send_back(
    node: &Node,
    peer: &str,
    kind: MemoryKind,
    len: usize,
    count: u64,
    window: u64,
) -> anyhow::Result<()> {
    use futures::StreamExt;
    let mut buffers = Vec::new();
    for _ in 0..window.clamp(1, count.max(1)) {
        let mut b = node.alloc(kind, len).await?;
        pattern::fill_buffer(&mut b)?;
        buffers.push(b);
    }
    let mut pending = futures::stream::FuturesUnordered::new();
    let mut sent = 0;
    while sent < count || !pending.is_empty() {
        while sent < count
            && let Some(b) = buffers.pop()
        {
            pending.push(node.send(peer, TAG_RETURN, b));
            sent += 1;
        }
        if let Some(done) = pending.next().await {
            // The bare error, which says whether the client left.
            buffers.push(done.map_err(|e| e.error)?);
        }
    }
    Ok(())
}

/// The baseline: a plain socket. In sink mode the client writes (len, bytes) messages and
/// gets one byte back per message once it is read; in emit mode the client asks for
/// (len, count) and the server writes that many messages.
async fn raw_server(listener: TcpListener) {
    while let Ok((stream, _)) = listener.accept().await {
        tokio::spawn(async move {
            let _ = raw_connection(stream).await;
        });
    }
}

async fn raw_connection(mut stream: TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mode = stream.read_u8().await?;
    let mut scratch = Vec::new();
    match mode {
        RAW_SINK => loop {
            let len = stream.read_u64_le().await?;
            if len == u64::MAX {
                return Ok(());
            }
            let len = usize::try_from(len).map_err(std::io::Error::other)?;
            if scratch.len() < len {
                scratch.resize(len, 0);
            }
            stream.read_exact(&mut scratch[..len]).await?;
            stream.write_u8(1).await?;
        },
        RAW_EMIT => {
            let len =
                usize::try_from(stream.read_u64_le().await?).map_err(std::io::Error::other)?;
            let count = stream.read_u64_le().await?;
            scratch.resize(len, 7);
            for _ in 0..count {
                stream.write_u64_le(len as u64).await?;
                stream.write_all(&scratch).await?;
            }
            stream.flush().await
        }
        _ => Ok(()),
    }
}
