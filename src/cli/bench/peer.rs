//! The far end of a bench: a node that verifies every buffer it receives and reports what it
//! saw, plus a raw-socket server for the baseline. Runs as `ferry bench --serve-peer CONFIG`.

use std::collections::{BTreeSet, HashMap};

use std::sync::Arc;

use anyhow::Context;
use ferry::{MemoryKind, Node, Received};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::pattern;

/// Asks the peer how many buffers it received and how many were wrong since the last
/// report; it answers under the same tag with 16 bytes (received, wrong; little endian)
/// followed by the names of the transports that carried them, comma-separated ASCII.
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

/// Raw baseline connection modes, the first byte a client writes.
pub const RAW_SINK: u8 = b'S';
/// The server streams messages to the client.
pub const RAW_EMIT: u8 = b'E';

/// `check`: verify the checksum of every buffer received (off with `--no-check`: reading
/// device memory back to the host costs far more than an ipc transfer).
pub async fn serve(config: ferry::Config, check: bool) -> anyhow::Result<()> {
    super::super::telemetry::init(&config.telemetry);
    let node = Arc::new(Node::start(config).await?);
    let raw = TcpListener::bind("127.0.0.1:0")
        .await
        .context("cannot bind the baseline socket")?;
    let raw_addr = raw.local_addr()?;
    tokio::spawn(raw_server(raw));
    println!(
        "ferry bench peer: ready node={} tcp={} baseline={raw_addr}",
        node.name(),
        node.tcp_addrs().join(",")
    );
    // The GPU that device-memory send-backs come from: the first the node uses (GPU 0 when
    // gpu.devices is omitted: every GPU); none with gpu.devices = [].
    let gpu = node
        .config()
        .gpu
        .devices
        .as_ref()
        .map_or(Some(0), |d| d.first().copied());
    let mut received = 0u64;
    let mut wrong = 0u64;
    let mut transports = BTreeSet::new();
    let mut expected: HashMap<usize, u32> = HashMap::new();
    let mut pongs: HashMap<(MemoryKind, usize), ferry::Buffer> = HashMap::new();
    loop {
        let Received {
            buffer,
            peer,
            tag,
            transport,
            ..
        } = node.recv(None, None).await?;
        match tag {
            TAG_REPORT => {
                let names = transports.iter().copied().collect::<Vec<&str>>().join(",");
                let mut reply = node.alloc(MemoryKind::Host, 16 + names.len()).await?;
                let out = reply.as_mut_slice().context("fresh buffer")?;
                out[..8].copy_from_slice(&received.to_le_bytes());
                out[8..16].copy_from_slice(&wrong.to_le_bytes());
                out[16..].copy_from_slice(names.as_bytes());
                received = 0;
                wrong = 0;
                transports.clear();
                node.send(&peer, TAG_REPORT, reply).await?;
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
                let kind = match (memory, gpu) {
                    (SEND_HOST, _) => MemoryKind::Host,
                    (SEND_DEVICE, Some(gpu)) => MemoryKind::Device(gpu),
                    (SEND_DEVICE, None) => {
                        tracing::warn!("asked to send device memory back, but gpu.devices = []");
                        continue;
                    }
                    _ => anyhow::bail!("bad send request: memory {memory}"),
                };
                let node = Arc::clone(&node);
                tokio::spawn(async move {
                    let sent = send_back(&node, &peer, kind, len as usize, count, window).await;
                    if let Err(e) = sent {
                        tracing::warn!(error = %e, "sending back failed");
                    }
                });
            }
            TAG_PING => {
                // Answered from a buffer of our own, the same one each time (as a latency
                // test's two fixed buffers): back first, the probe checked after.
                let reply = match pongs.remove(&(buffer.kind(), buffer.len())) {
                    Some(b) => b,
                    None => {
                        let mut b = node.alloc(buffer.kind(), buffer.len()).await?;
                        pattern::fill_buffer(&mut b)?;
                        b
                    }
                };
                let reply = node
                    .send(&peer, TAG_PONG, reply)
                    .await
                    .map_err(|e| anyhow::anyhow!("answering a ping: {}", e.error))?;
                pongs.insert((reply.kind(), reply.len()), reply);
                received += 1;
                transports.insert(transport);
                if check && !pattern_holds(&mut expected, &buffer)? {
                    wrong += 1;
                }
            }
            _ => {
                received += 1;
                transports.insert(transport);
                if check && !pattern_holds(&mut expected, &buffer)? {
                    wrong += 1;
                }
            }
        }
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
            buffers.push(done?);
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
