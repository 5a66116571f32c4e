//! The size sweep of `ferry bench` (contiguous or strided, one way, both ways or ping-pong):
//! one row a size, each next to its baseline (a plain socket, a raw GPU copy, the staging
//! copies or UCX's own loop, measured in the same run).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferry::{Buffer, Direction, Node, TransportName};
use ferry_transports::transport::DevicePath;
use hdrhistogram::Histogram;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::gpu_baseline::{copy_baseline, staging_baseline, strided_baseline};
use super::report::{self, Record};
use super::{
    Args, Baseline, Target, alloc_filled, layout_for, pattern, peer, peer_report, request,
    send_many, window_for,
};

/// The header's baseline of a sweep to `target`.
pub fn baseline_label(args: &Args, target: &Target) -> String {
    match (&target.baseline, args.no_baseline) {
        (Some(b @ (Baseline::Copy(_) | Baseline::Staging(_))), false)
            if args.layout != "contiguous" =>
        {
            format!(
                "{}; for --layout {}: the same rows by raw cuMemcpy3DAsync",
                b.label(args.bidir),
                args.layout
            )
        }
        (Some(b), false) => b.label(args.bidir),
        _ => "none".into(),
    }
}

/// Measures every size of `sizes`, printing each row as it comes: the rows.
pub async fn run(
    node: &Node,
    target: &Target,
    args: &Args,
    sizes: &[u64],
) -> anyhow::Result<Vec<Record>> {
    let progress = report::progress(sizes.len() as u64);
    let mut records = Vec::new();
    for &size in sizes {
        progress.set_message(ferry_config::format_size(size));
        let record = measure(node, target, args, size).await?;
        progress.suspend(|| report::print_row(&record));
        records.push(record);
        progress.inc(1);
    }
    progress.finish_and_clear();
    Ok(records)
}

/// What the latency columns measure, for the header.
pub fn latency_label(transport: TransportName, direction: Option<&str>, pingpong: bool) -> String {
    let declared = ferry_transports::registry::declared(transport);
    let wanted = direction.and_then(|d| d.parse::<Direction>().ok());
    let what = match (declared.device_path, declared.direction_for(wanted)) {
        (DevicePath::CopyEngine, Some(Direction::Push)) => {
            "send() called until the peer's Done: it lent a buffer, our copy engine wrote \
             the bytes into it, and it took them (grant, copy, Written, Done)"
        }
        (DevicePath::CopyEngine, _) => {
            "send() called until the peer's Done: it imported our buffer and its copy engine \
             pulled the bytes (one pull round trip)"
        }
        _ => "send() called until it resolved (the transfer complete)",
    };
    if pingpong {
        return "one-way: half of each round trip (send() called, the peer's recv() returns \
                and it sends the buffer back, our recv() returns), one transfer at a time"
            .into();
    }
    format!("{what}, with up to the row's window in flight (--window 1: one transfer alone)")
}

/// Sends `count` transfers one at a time, each sent back by the peer before the next
/// leaves; records half of each round trip in `hist` (microseconds).
async fn ping_pong(
    node: &Node,
    peer: &str,
    buffers: &mut Vec<Buffer>,
    count: u64,
    mut hist: Option<&mut Histogram<u64>>,
) -> anyhow::Result<()> {
    for _ in 0..count {
        let b = buffers.pop().context("no buffer to send")?;
        let t = Instant::now();
        let b = node
            .send(peer, peer::TAG_PING, b)
            .await
            .map_err(|e| anyhow::anyhow!("{}", e.error))?;
        let back = tokio::time::timeout(
            Duration::from_secs(30),
            node.recv(Some(peer), Some(peer::TAG_PONG)),
        )
        .await
        .context("the peer did not send the ping back")??;
        let took = t.elapsed();
        drop(back);
        buffers.push(b);
        if let Some(h) = hist.as_deref_mut() {
            let _ = h.record((took.as_nanos() / 2000).max(1) as u64);
        }
    }
    Ok(())
}

/// Receives `count` buffers sent back by the peer; returns how many were wrong. Fails on a
/// buffer that came over another transport than `transport`: that direction was not
/// measuring it.
async fn receive_returns(
    node: &Node,
    peer: &str,
    count: u64,
    check: bool,
    transport: TransportName,
) -> anyhow::Result<u64> {
    let mut wrong = 0;
    let mut expected = None;
    for _ in 0..count {
        let r = tokio::time::timeout(
            Duration::from_secs(120),
            node.recv(Some(peer), Some(peer::TAG_RETURN)),
        )
        .await
        .context("the peer stopped sending")??;
        if r.transport != transport {
            bail!(
                "a buffer the peer sent back came over {}, not {transport}: that route fell \
                 back (RUST_LOG=info says why)",
                r.transport
            );
        }
        if check {
            let want = *expected.get_or_insert_with(|| pattern::crc(r.buffer.len()));
            if crc32c::crc32c(&r.buffer.bytes()?) != want {
                wrong += 1;
            }
        }
    }
    Ok(wrong)
}

async fn measure(node: &Node, target: &Target, args: &Args, size: u64) -> anyhow::Result<Record> {
    let peer = target.name.as_str();
    let (layout, len) = layout_for(args, size)?;
    let window = window_for(len, args.window, target.memory);
    let mut buffers = alloc_filled(node, target.memory, len, window).await?;
    let warmup = args.warmup.max(window);
    if args.pingpong {
        ping_pong(node, peer, &mut buffers, warmup, None).await?;
    } else {
        send_many(node, peer, &mut buffers, &layout, warmup, None).await?;
    }
    let mut hist = Histogram::<u64>::new(3).context("histogram")?;
    let check = !args.no_check;
    let started = Instant::now();
    let mut wrong = 0;
    if args.pingpong {
        ping_pong(node, peer, &mut buffers, args.iters, Some(&mut hist)).await?;
    } else if args.bidir {
        let ask = [size, args.iters, window, target.send_memory()];
        request(node, peer, peer::TAG_SEND, &ask).await?;
        let (sent, back) = tokio::join!(
            send_many(
                node,
                peer,
                &mut buffers,
                &layout,
                args.iters,
                Some(&mut hist)
            ),
            receive_returns(node, peer, args.iters, check, args.transport),
        );
        sent?;
        wrong += back?;
    } else {
        send_many(
            node,
            peer,
            &mut buffers,
            &layout,
            args.iters,
            Some(&mut hist),
        )
        .await?;
    }
    let elapsed = started.elapsed().as_secs_f64().max(1e-9);
    let directions = if args.bidir || args.pingpong {
        2.0
    } else {
        1.0
    };
    let ferry_gbps = directions * (size * args.iters) as f64 / elapsed / 1e9;
    drop(buffers);
    let report = peer_report(node, peer).await?;
    if check {
        let expected = warmup + args.iters;
        wrong += report.wrong + expected.saturating_sub(report.received);
    }
    if let Some(other) = report
        .transports
        .iter()
        .find(|t| t.as_str() != args.transport.as_str())
    {
        bail!(
            "the peer received {} buffers over {other}, not {}: the route fell back \
             (RUST_LOG=info says why)",
            ferry_config::format_size(size),
            args.transport
        );
    }
    let baseline_gbps = baseline_gbps(
        node,
        target,
        args,
        (size, warmup, window),
        &layout,
        ferry_gbps,
    )
    .await?;
    let pct = |q: f64| hist.value_at_quantile(q) as f64;
    Ok(Record {
        series: args.layout.clone(),
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

/// The GB/s of `target`'s baseline for a transfer of `size` bytes shaped as `layout`
/// (`warmup` untimed, then `args.iters` timed, `window` in flight), measured now; `None`
/// without one (or with `--no-baseline`). `ferry_gbps`, the row's own, goes into the notes
/// some baselines print.
pub(super) async fn baseline_gbps(
    node: &Node,
    target: &Target,
    args: &Args,
    (size, warmup, window): (u64, u64, u64),
    layout: &ferry::Layout,
    ferry_gbps: f64,
) -> anyhow::Result<Option<f64>> {
    let gbps = match (&target.baseline, args.no_baseline) {
        (Some(Baseline::Socket(addr)), false) => {
            Some(baseline(addr, size, args.iters, warmup, window, args.bidir).await?)
        }
        (Some(Baseline::Memcpy), false) => {
            let (len, iters) = (usize::try_from(size)?, args.iters);
            let gbps = tokio::task::spawn_blocking(move || memcpy_baseline(len, iters, warmup))
                .await
                .context("the memcpy baseline stopped")?;
            Some(gbps)
        }
        (Some(Baseline::RdmaEngine(reader)), false) => Some(
            reader
                .measure(node, size, args.iters, warmup, window)
                .await?,
        ),
        (Some(Baseline::Copy(gpus)), false) if *layout != ferry::Layout::Contiguous => {
            let (gpus, iters, warmup) = (*gpus, args.iters, warmup);
            let shape = layout.clone();
            let (raw, per_row) = tokio::task::spawn_blocking(move || {
                strided_baseline(gpus, shape, iters, warmup, window)
            })
            .await
            .context("the copy baseline stopped")?
            .context("the strided copy baseline failed")?;
            println!(
                "# {size} bytes as {layout:?}: one cuMemcpyAsync per row {per_row:.3} GB/s \
                 (ferry {:.1}x that, the raw 2D copy {:.1}x)",
                ferry_gbps / per_row,
                raw / per_row
            );
            Some(raw)
        }
        (Some(Baseline::Staging(gpus)), false) => {
            let (gpus, iters, warmup) = (*gpus, args.iters, warmup);
            let shape = layout.clone();
            let (down, up, per_row) = tokio::task::spawn_blocking(move || {
                staging_baseline(gpus, shape, size, iters, warmup, window)
            })
            .await
            .context("the staging baseline stopped")?
            .context("the staging baseline failed")?;
            let slower = down.min(up);
            let per_row = per_row
                .map(|r| {
                    format!(
                        "; one cuMemcpyDtoHAsync per row {r:.3} GB/s (ferry {:.1}x that)",
                        ferry_gbps / r
                    )
                })
                .unwrap_or_default();
            println!(
                "# {size} bytes: raw pinned GPU{} -> host {down:.1} GB/s, host -> GPU{} \
                 {up:.1} GB/s{per_row}",
                gpus.ours, gpus.theirs
            );
            Some(slower)
        }
        (Some(Baseline::Copy(gpus)), false) => {
            let (gpus, iters, warmup, bidir) = (*gpus, args.iters, warmup, args.bidir);
            let len = usize::try_from(size)?;
            let gbps = tokio::task::spawn_blocking(move || {
                copy_baseline(gpus, len, iters, warmup, window, bidir)
            })
            .await
            .context("the copy baseline stopped")?
            .with_context(|| {
                format!(
                    "the baseline (cuMemcpyAsync GPU{} -> GPU{}) failed",
                    gpus.ours, gpus.theirs
                )
            })?;
            Some(gbps)
        }
        _ => None,
    };
    Ok(gbps)
}

/// Bandwidth of the peer sending to us, for the pair matrix.
pub async fn measure_return(
    node: &Node,
    target: &Target,
    args: &Args,
    size: u64,
) -> anyhow::Result<f64> {
    let (peer, iters) = (target.name.as_str(), args.iters);
    let window = window_for(size, args.window, target.memory);
    let started = Instant::now();
    let ask = [size, iters, window, target.send_memory()];
    request(node, peer, peer::TAG_SEND, &ask).await?;
    receive_returns(node, peer, iters, false, args.transport).await?;
    Ok((size * iters) as f64 / started.elapsed().as_secs_f64().max(1e-9) / 1e9)
}

/// GB/s of one `memcpy` of `len` bytes between two host buffers (both touched first),
/// `iters` times after `warmup`.
fn memcpy_baseline(len: usize, iters: u64, warmup: u64) -> f64 {
    let src = vec![0x5Au8; len];
    let mut dst = vec![0u8; len];
    for _ in 0..warmup.max(1) {
        dst.copy_from_slice(std::hint::black_box(&src));
    }
    let started = Instant::now();
    for _ in 0..iters.max(1) {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    (len as f64 * iters.max(1) as f64) / secs / 1e9
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
