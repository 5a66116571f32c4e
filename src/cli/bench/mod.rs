//! `ferry bench`: measures transfers between two nodes, every figure next to a baseline
//! measured in the same run between the same endpoints, reported as a ratio.
//!
//! On host memory it starts a peer process (`ferry bench --serve-peer CONFIG`), sends a
//! size sweep to it through a node of its own, and asks the peer after each size how many
//! buffers arrived and how many were wrong (`--check`, on by default). The baseline for the
//! tcp transport is a plain socket between the same two processes moving the same bytes.
//! Bandwidth is in GB/s (10^9 bytes per second).

mod pattern;
mod peer;
mod report;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferry::{Buffer, MemoryClass, MemoryKind, Node};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use hdrhistogram::Histogram;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use report::Record;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Smallest size (suffixes K, M, G are powers of 1024).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_bytes)]
    min: u64,
    /// Largest size.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_bytes)]
    max: u64,
    /// Multiply the size by this between steps.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2, value_parser = clap::value_parser!(u64).range(2..))]
    factor: u64,
    /// Timed transfers per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Untimed transfers per size, before the timed ones.
    #[arg(short = 'w', long = "warmup", default_value_t = 5)]
    warmup: u64,
    /// Transfers in flight at once (fewer for large sizes, to bound memory).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=64))]
    window: u64,
    /// Transport to measure.
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// Memory at both ends: host or device.
    #[arg(long, default_value = "host")]
    memory: String,
    /// Buffer layout.
    #[arg(long, default_value = "contiguous")]
    layout: String,
    /// Both directions at once.
    #[arg(long)]
    bidir: bool,
    /// `all`: also print a matrix of every ordered pair at the largest size.
    #[arg(long)]
    pairs: Option<String>,
    /// Skip verifying every transfer (on by default).
    #[arg(long)]
    no_check: bool,
    /// Skip the baseline.
    #[arg(long)]
    no_baseline: bool,
    /// The control link to the local peer: tcp (loopback) or unix.
    #[arg(long, default_value = "tcp")]
    link: String,
    /// Join these running bench peers (started with `ferry bench --serve-peer CONFIG`)
    /// instead of starting one; the first is measured.
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
    /// Write one JSON document with every record.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Write one CSV row per size.
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,
    /// Plot bandwidth against size, ferry and baseline (.svg).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Measure nothing: read a document written by --json and write --plot/--csv from it.
    #[arg(long, value_name = "FILE")]
    from_json: Option<PathBuf>,
    /// Run as the far end of a bench, with this node configuration.
    #[arg(long, value_name = "CONFIG", hide = true)]
    serve_peer: Option<PathBuf>,
}

/// Parses 8, 64K, 1M, 1G (powers of 1024), or anything `ferry_config::parse_size` reads.
fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, unit) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => t.split_at(i),
        None => (t, ""),
    };
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" => Some(0),
        "K" => Some(10),
        "M" => Some(20),
        "G" => Some(30),
        _ => None,
    };
    match (digits.parse::<u64>(), shift) {
        (Ok(n), Some(shift)) => n
            .checked_shl(shift)
            .filter(|v| v >> shift == n)
            .ok_or_else(|| format!("{s}: too large")),
        _ => ferry_config::parse_size(t).map_err(|e| e.to_string()),
    }
}

/// The sizes of the sweep: min, min·f, min·f², … up to max.
fn sizes(min: u64, max: u64, factor: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        out.push(s);
        match s.checked_mul(factor) {
            Some(next) => s = next,
            None => break,
        }
    }
    out
}

/// Bytes in flight at most, per direction, whatever the window.
const IN_FLIGHT_CAP: u64 = 512 << 20;

fn window_for(size: u64, window: u64) -> u64 {
    window.min((IN_FLIGHT_CAP / size.max(1)).max(1))
}

pub fn run(config: Option<PathBuf>, overrides: &[String], args: Args) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    if let Some(peer_config) = &args.serve_peer {
        runtime.block_on(peer::serve(peer_config))?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(json) = &args.from_json {
        let (header, records) = report::read_json(json)?;
        report::print_header(&header);
        records.iter().for_each(report::print_row);
        if let Some(path) = &args.csv {
            report::write_csv(path, &records)?;
        }
        if let Some(path) = &args.plot {
            report::plot(path, &header, &records)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    if args.memory != "host" {
        bail!(
            "--memory {}: device memory needs the GPU transports, which this build does not \
             have yet; measure host memory with --memory host",
            args.memory
        );
    }
    if args.transport != "tcp" {
        bail!(
            "--transport {}: only tcp is built so far (ipc and staged arrive with GPU support)",
            args.transport
        );
    }
    if args.layout != "contiguous" {
        bail!(
            "--layout {}: only contiguous layouts exist so far",
            args.layout
        );
    }
    if args.min > args.max {
        bail!("-b {} is larger than -e {}", args.min, args.max);
    }
    runtime.block_on(orchestrate(config, overrides, args))
}

/// A local peer process, killed when dropped.
struct LocalPeer {
    child: Child,
    dir: tempfile::TempDir,
}

impl Drop for LocalPeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the measured node's peer is.
struct Target {
    name: String,
    baseline: Option<String>,
    local: Option<LocalPeer>,
}

async fn start_local(args: &Args) -> anyhow::Result<(Target, Node)> {
    let dir = tempfile::Builder::new()
        .prefix("ferry-bench-")
        .tempdir()
        .context("cannot create a scratch directory")?;
    let secret = dir.path().join("secret");
    let key: String = (0..4)
        .map(|_| format!("{:016x}", rand::random::<u64>()))
        .collect();
    std::fs::write(&secret, key).context("cannot write the bench secret")?;
    let unix = args.link == "unix";
    let peer_cfg = dir.path().join("peer.toml");
    let mut text = format!(
        "[node]\nname = \"bench-peer\"\nlisten = [\"127.0.0.1:0\"]\n{}\n[security]\nsecret_file = \"{}\"\n",
        if unix {
            format!("socket_dir = \"{}\"\n", dir.path().display())
        } else {
            String::new()
        },
        secret.display()
    );
    std::fs::write(&peer_cfg, &text).context("cannot write the peer config")?;
    let exe = std::env::current_exe().context("cannot find the ferry binary")?;
    let mut child = Command::new(exe)
        .arg("bench")
        .arg("--serve-peer")
        .arg(&peer_cfg)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start the bench peer")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .context("the bench peer did not start")?;
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .map(str::to_string)
    };
    let (Some(tcp), Some(baseline)) = (field("tcp"), field("baseline")) else {
        let _ = child.kill();
        bail!("the bench peer did not start: {line:?}");
    };
    let local = LocalPeer { child, dir };
    let address = if unix {
        format!("unix:{}/bench-peer.sock", local.dir.path().display())
    } else {
        tcp.split(',').next().unwrap_or_default().to_string()
    };
    text = format!(
        "[node]\nname = \"bench\"\nlisten = [\"127.0.0.1:0\"]\n\n[[peers]]\nname = \"bench-peer\"\n\
         address = \"{address}\"\n\n[security]\nsecret_file = \"{}\"\n",
        secret.display()
    );
    let config = ferry::Config::from_toml_str(&text)?;
    let node = Node::start(config).await?;
    let target = Target {
        name: "bench-peer".into(),
        baseline: Some(baseline),
        local: Some(local),
    };
    Ok((target, node))
}

async fn orchestrate(
    config: Option<PathBuf>,
    overrides: &[String],
    args: Args,
) -> anyhow::Result<ExitCode> {
    let (target, node) = if args.peers.is_empty() {
        start_local(&args).await?
    } else {
        let config = super::load_config(config, overrides, vec![])?;
        super::telemetry::init(&config.telemetry);
        let target = Target {
            name: args.peers[0].clone(),
            baseline: None,
            local: None,
        };
        (target, Node::start(config).await?)
    };
    let node = Arc::new(node);
    node.connect(&target.name)
        .await
        .with_context(|| format!("cannot reach the bench peer {}", target.name))?;
    let explanation = node
        .explain(&target.name, args.max, MemoryClass::Host, MemoryClass::Host)
        .await?;
    let list = sizes(args.min, args.max, args.factor);
    let header = report::Header {
        transport: args.transport.clone(),
        memory: args.memory.clone(),
        link: args.link.clone(),
        bidir: args.bidir,
        iters: args.iters,
        warmup: args.warmup,
        route: explanation.to_string(),
        baseline: match (&target.baseline, args.no_baseline) {
            (Some(_), false) => "plain TCP socket between the same two processes".into(),
            _ => "none".into(),
        },
    };
    report::print_header(&header);
    let progress = report::progress(list.len() as u64);
    let mut records = Vec::new();
    for size in list {
        progress.set_message(ferry_config::format_size(size));
        let record = measure(&node, &target, &args, size).await?;
        progress.suspend(|| report::print_row(&record));
        records.push(record);
        progress.inc(1);
    }
    progress.finish_and_clear();

    if args.pairs.as_deref() == Some("all") {
        let size = args.max;
        // With --bidir the record holds both directions together: show one direction's share.
        let share = if args.bidir { 0.5 } else { 1.0 };
        let forward = records.last().map_or(0.0, |r| r.ferry_gbps * share);
        let back = measure_return(&node, &target.name, size, args.iters, args.window).await?;
        report::print_matrix(
            &[node.name().to_string(), target.name.clone()],
            &[vec![None, Some(forward)], vec![Some(back), None]],
            size,
        );
    }
    let wrong: u64 = records.iter().map(|r| r.wrong).sum();
    if let Some(path) = &args.json {
        report::write_json(path, &header, &records)?;
    }
    if let Some(path) = &args.csv {
        report::write_csv(path, &records)?;
    }
    if let Some(path) = &args.plot {
        report::plot(path, &header, &records)?;
    }
    drop(target.local);
    if let Ok(node) = Arc::try_unwrap(node) {
        node.shutdown().await;
    }
    if wrong > 0 {
        eprintln!("ferry bench: {wrong} transfers arrived wrong");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

async fn alloc_filled(node: &Node, size: u64, count: u64) -> anyhow::Result<Vec<Buffer>> {
    let mut out = Vec::new();
    for _ in 0..count {
        let mut b = node.alloc(MemoryKind::Host, usize::try_from(size)?).await?;
        pattern::fill(b.as_mut_slice().context("fresh buffer")?);
        out.push(b);
    }
    Ok(out)
}

/// Sends `count` transfers with at most `buffers.len()` in flight; records each one's time
/// from `send` to completion in `hist` (microseconds).
async fn send_many(
    node: &Node,
    peer: &str,
    buffers: &mut Vec<Buffer>,
    count: u64,
    mut hist: Option<&mut Histogram<u64>>,
) -> anyhow::Result<()> {
    let mut pending = FuturesUnordered::new();
    let mut started = 0;
    while started < count || !pending.is_empty() {
        while started < count
            && let Some(b) = buffers.pop()
        {
            let tag = started;
            pending.push(async move {
                let t = Instant::now();
                let r = node.send(peer, tag, b).await;
                (t.elapsed(), r)
            });
            started += 1;
        }
        if let Some((took, result)) = pending.next().await {
            buffers.push(result.map_err(|e| anyhow::anyhow!("{}", e.error))?);
            if let Some(h) = hist.as_deref_mut() {
                let _ = h.record(took.as_micros().max(1) as u64);
            }
        }
    }
    Ok(())
}

/// Receives `count` buffers sent back by the peer; returns how many were wrong.
async fn receive_returns(node: &Node, peer: &str, count: u64, check: bool) -> anyhow::Result<u64> {
    let mut wrong = 0;
    let mut expected = None;
    for _ in 0..count {
        let r = tokio::time::timeout(
            Duration::from_secs(120),
            node.recv(Some(peer), Some(peer::TAG_RETURN)),
        )
        .await
        .context("the peer stopped sending")??;
        if check {
            let want = *expected.get_or_insert_with(|| pattern::crc(r.buffer.len()));
            if crc32c::crc32c(&r.buffer.bytes()?) != want {
                wrong += 1;
            }
        }
    }
    Ok(wrong)
}

async fn request(node: &Node, peer: &str, tag: u64, words: &[u64]) -> anyhow::Result<()> {
    let mut b = node.alloc(MemoryKind::Host, words.len() * 8).await?;
    let out = b.as_mut_slice().context("fresh buffer")?;
    for (i, w) in words.iter().enumerate() {
        out[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    node.send(peer, tag, b)
        .await
        .map_err(|e| anyhow::anyhow!("{}", e.error))?;
    Ok(())
}

/// The peer's count of received and wrong buffers since its last report.
async fn peer_report(node: &Node, peer: &str) -> anyhow::Result<(u64, u64)> {
    request(node, peer, peer::TAG_REPORT, &[]).await?;
    let r = node.recv(Some(peer), Some(peer::TAG_REPORT)).await?;
    let bytes = r.buffer.bytes()?;
    let word = |i: usize| {
        bytes
            .get(i..i + 8)
            .and_then(|w| w.try_into().ok())
            .map(u64::from_le_bytes)
            .context("short report")
    };
    Ok((word(0)?, word(8)?))
}

async fn measure(node: &Node, target: &Target, args: &Args, size: u64) -> anyhow::Result<Record> {
    let peer = target.name.as_str();
    let window = window_for(size, args.window);
    let mut buffers = alloc_filled(node, size, window).await?;
    send_many(node, peer, &mut buffers, args.warmup, None).await?;
    let mut hist = Histogram::<u64>::new(3).context("histogram")?;
    let check = !args.no_check;
    let started = Instant::now();
    let mut wrong = 0;
    if args.bidir {
        request(node, peer, peer::TAG_SEND, &[size, args.iters, window]).await?;
        let (sent, back) = tokio::join!(
            send_many(node, peer, &mut buffers, args.iters, Some(&mut hist)),
            receive_returns(node, peer, args.iters, check),
        );
        sent?;
        wrong += back?;
    } else {
        send_many(node, peer, &mut buffers, args.iters, Some(&mut hist)).await?;
    }
    let elapsed = started.elapsed().as_secs_f64().max(1e-9);
    let directions = if args.bidir { 2.0 } else { 1.0 };
    let ferry_gbps = directions * (size * args.iters) as f64 / elapsed / 1e9;
    drop(buffers);
    if check {
        let (received, bad) = peer_report(node, peer).await?;
        let expected = args.warmup + args.iters;
        wrong += bad + expected.saturating_sub(received);
    } else {
        let _ = peer_report(node, peer).await?;
    }
    let baseline_gbps = match (&target.baseline, args.no_baseline) {
        (Some(addr), false) => {
            Some(baseline(addr, size, args.iters, args.warmup, window, args.bidir).await?)
        }
        _ => None,
    };
    let pct = |q: f64| hist.value_at_quantile(q) as f64;
    Ok(Record {
        bytes: size,
        iterations: args.iters,
        window,
        ferry_gbps,
        baseline_gbps,
        ratio: baseline_gbps.map(|b| ferry_gbps / b),
        p50_us: pct(0.5),
        p99_us: pct(0.99),
        p999_us: pct(0.999),
        wrong: if check { Some(wrong) } else { None }.unwrap_or(0),
        checked: check,
    })
}

/// Bandwidth of the peer sending to us, for the pair matrix.
async fn measure_return(
    node: &Node,
    peer: &str,
    size: u64,
    iters: u64,
    window: u64,
) -> anyhow::Result<f64> {
    let window = window_for(size, window);
    let started = Instant::now();
    request(node, peer, peer::TAG_SEND, &[size, iters, window]).await?;
    receive_returns(node, peer, iters, false).await?;
    Ok((size * iters) as f64 / started.elapsed().as_secs_f64().max(1e-9) / 1e9)
}

/// The raw socket moving the same bytes between the same processes, with the same number
/// of messages in flight as ferry had: GB/s.
async fn baseline(
    addr: &str,
    size: u64,
    iters: u64,
    warmup: u64,
    window: u64,
    bidir: bool,
) -> anyhow::Result<f64> {
    let len = usize::try_from(size)?;
    let sink = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        s.write_u8(peer::RAW_SINK).await?;
        let payload = vec![0x5Au8; len];
        // Warm up, then time `iters` messages with at most `window` unacknowledged.
        raw_window(&mut s, &payload, warmup, window).await?;
        let started = Instant::now();
        raw_window(&mut s, &payload, iters, window).await?;
        let took = started.elapsed();
        s.write_u64_le(u64::MAX).await?;
        std::io::Result::Ok(took)
    };
    let emit = async {
        if !bidir {
            return std::io::Result::Ok(Duration::ZERO);
        }
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_u8(peer::RAW_EMIT).await?;
        s.write_u64_le(size).await?;
        s.write_u64_le(iters).await?;
        let started = Instant::now();
        let mut scratch = vec![0u8; len];
        for _ in 0..iters {
            let n = s.read_u64_le().await?;
            if n != size {
                return Err(std::io::Error::other("baseline stream out of step"));
            }
            s.read_exact(&mut scratch).await?;
        }
        Ok(started.elapsed())
    };
    let (one, two) = tokio::join!(sink, emit);
    let took = one?.max(two?).as_secs_f64().max(1e-9);
    let directions = if bidir { 2.0 } else { 1.0 };
    Ok(directions * (size * iters) as f64 / took / 1e9)
}

/// Writes `count` messages, reading one acknowledgement per message and never having more
/// than `window` unacknowledged.
async fn raw_window(
    s: &mut tokio::net::TcpStream,
    payload: &[u8],
    count: u64,
    window: u64,
) -> std::io::Result<()> {
    let (mut rd, mut wr) = s.split();
    let write = async {
        let mut unacked = 0u64;
        let mut acked = 0u64;
        for _ in 0..count {
            wr.write_u64_le(payload.len() as u64).await?;
            wr.write_all(payload).await?;
            unacked += 1;
            if unacked >= window {
                rd.read_u8().await?;
                unacked -= 1;
                acked += 1;
            }
        }
        while acked < count {
            rd.read_u8().await?;
            acked += 1;
        }
        std::io::Result::Ok(())
    };
    write.await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_suffixes() {
        assert_eq!(parse_bytes("8"), Ok(8));
        assert_eq!(parse_bytes("64K"), Ok(64 << 10));
        assert_eq!(parse_bytes("1G"), Ok(1 << 30));
        assert_eq!(parse_bytes("2 MiB"), Ok(2 << 20));
        assert!(parse_bytes("lots").is_err());
        assert_eq!(sizes(8, 64, 2), vec![8, 16, 32, 64]);
        assert_eq!(sizes(1, 100, 10), vec![1, 10, 100]);
        assert_eq!(window_for(1 << 30, 8), 1);
        assert_eq!(window_for(8, 8), 8);
    }
}
