//! The far end of a bench: a node that verifies every buffer it receives and reports what it
//! saw, plus a raw-socket server for the baseline. Runs as `ferry bench --serve-peer CONFIG`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use ferry::{MemoryKind, Node, Received};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::pattern;

/// Asks the peer how many buffers it received and how many were wrong since the last
/// report; it answers under the same tag with 16 bytes (received, wrong; little endian).
pub const TAG_REPORT: u64 = u64::MAX - 10;
/// Asks the peer to send buffers back: payload is (len, count, window) as 24 bytes.
pub const TAG_SEND: u64 = u64::MAX - 11;
/// Tag of the buffers a peer sends back after [`TAG_SEND`].
pub const TAG_RETURN: u64 = u64::MAX - 12;

/// Raw baseline connection modes, the first byte a client writes.
pub const RAW_SINK: u8 = b'S';
/// The server streams messages to the client.
pub const RAW_EMIT: u8 = b'E';

pub async fn serve(config: &Path) -> anyhow::Result<()> {
    let config = ferry_config::load(&ferry::LoadOptions::only_file(config))?;
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
    let mut received = 0u64;
    let mut wrong = 0u64;
    let mut expected: HashMap<usize, u32> = HashMap::new();
    loop {
        let Received {
            buffer, peer, tag, ..
        } = node.recv(None, None).await?;
        match tag {
            TAG_REPORT => {
                let mut reply = node.alloc(MemoryKind::Host, 16).await?;
                let out = reply.as_mut_slice().context("fresh buffer")?;
                out[..8].copy_from_slice(&received.to_le_bytes());
                out[8..].copy_from_slice(&wrong.to_le_bytes());
                received = 0;
                wrong = 0;
                node.send(&peer, TAG_REPORT, reply).await?;
            }
            TAG_SEND => {
                let words: Vec<u64> = buffer
                    .bytes()?
                    .chunks_exact(8)
                    .filter_map(|c| c.try_into().ok().map(u64::from_le_bytes))
                    .collect();
                let [len, count, window] = words[..] else {
                    anyhow::bail!("bad send request of {} bytes", buffer.len());
                };
                let node = Arc::clone(&node);
                tokio::spawn(async move {
                    if let Err(e) = send_back(&node, &peer, len as usize, count, window).await {
                        tracing::warn!(error = %e, "sending back failed");
                    }
                });
            }
            _ => {
                received += 1;
                let want = *expected
                    .entry(buffer.len())
                    .or_insert_with(|| pattern::crc(buffer.len()));
                if crc32c::crc32c(&buffer.bytes()?) != want {
                    wrong += 1;
                }
            }
        }
    }
}

async fn send_back(
    node: &Node,
    peer: &str,
    len: usize,
    count: u64,
    window: u64,
) -> anyhow::Result<()> {
    use futures::StreamExt;
    let mut buffers = Vec::new();
    for _ in 0..window.clamp(1, count.max(1)) {
        let mut b = node.alloc(MemoryKind::Host, len).await?;
        pattern::fill(b.as_mut_slice().context("fresh buffer")?);
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
