//! `ferry bench --op read|write`: one-sided operations between registered regions, as NIXL
//! and Mooncake measure theirs. The peer registers a region (in `--memory`) and this node
//! one of its own; each operation reads the peer's places into ours (`read`) or writes
//! ours into the peer's (`write`).
//!
//! Contiguous: one row a size of `-b`..`-e`, the first bytes of each region, next to the
//! sweep's baseline for that size (a raw GPU copy, a plain socket, a memcpy). With
//! `--layout blocks:SIZE:COUNT`: the blocks at random places of the peer's region (a
//! pool four times their bytes) to other random places of ours (scattered at both ends: a
//! KV cache's pages), next to the same bytes contiguous between the same regions (the
//! blocks row's baseline). `--window N` keeps N operations in flight (`--window 1`: one
//! at a time). The bytes are not checked here: the conformance suite checks them.

use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, bail};
use ferry::{Access, Layout, MemoryKind, Node, OneSided, Places, RegionKey};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use hdrhistogram::Histogram;

use super::peer::{SEND_DEVICE, SEND_HOST, TAG_REGION, TAG_UNREGION};
use super::report::Record;
use super::{Args, Target, blocks, pattern, window_for};

/// `--op`: what the bench times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Op {
    /// Sends (the default): the sweep, block lists, fetchers.
    Send,
    /// One-sided reads of the peer's region into ours.
    Read,
    /// One-sided writes of our region into the peer's.
    Write,
}

impl Op {
    /// How `--op` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Op::Send => "send",
            Op::Read => "read",
            Op::Write => "write",
        }
    }
}

/// The seed of the places the blocks land at in the other region (the blocks' own is
/// [`blocks::Spec::layout`]'s).
const PLACES_SEED: u64 = 23;

/// What `--op read|write` cannot be combined with, and why.
pub fn check_args(args: &Args) -> anyhow::Result<()> {
    let op = args.op.name();
    if args.bidir || args.pingpong || args.pairs.is_some() || args.fetchers.is_some() {
        bail!(
            "--op {op}: one operation at a time or windowed (no --bidir, --pingpong, --pairs, --fetchers)"
        );
    }
    if args.layout != "contiguous" && blocks::parse(&args.layout)?.is_none() {
        bail!("--op {op}: --layout contiguous or blocks:SIZE:COUNT");
    }
    if blocks::parse(&args.layout)?.is_some() && args.plot.is_some() {
        bail!(
            "--op {op} --layout {}: --plot draws a size sweep",
            args.layout
        );
    }
    Ok(())
}

/// The header's baseline.
pub fn baseline_label(args: &Args, target: &Target, spec: Option<blocks::Spec>) -> String {
    match spec {
        Some(_) => "the same bytes contiguous between the same two regions, in this run".into(),
        None => super::sweep::baseline_label(args, target),
    }
}

/// Measures the rows and prints them.
pub async fn run(
    node: &Node,
    target: &Target,
    args: &Args,
    spec: Option<blocks::Spec>,
    sizes: &[u64],
) -> anyhow::Result<Vec<Record>> {
    let peer = target.name.as_str();
    let len = spec.map_or(args.max, |s| s.pool());
    let remote = ask_region(node, peer, target, len).await?;
    let mut mine = node.alloc(target.memory, usize::try_from(len)?).await?;
    pattern::fill_buffer(&mut mine).context("cannot fill the bench's region")?;
    let local = node
        .register(mine, Access::ReadWrite)
        .map_err(|e| anyhow::anyhow!("{}", e.error))?;
    let rows = rows(node, target, args, spec, sizes, (remote, local)).await;
    let mine = node.unregister(local).await;
    let theirs = ask(node, peer, TAG_UNREGION, &remote.to_bytes()).await;
    let rows = rows?;
    drop(mine?);
    theirs?;
    Ok(rows)
}

async fn rows(
    node: &Node,
    target: &Target,
    args: &Args,
    spec: Option<blocks::Spec>,
    sizes: &[u64],
    (remote, local): (RegionKey, RegionKey),
) -> anyhow::Result<Vec<Record>> {
    let op = args.op.name();
    println!(
        "{:>12} {:>12} {:>7} {:>10} {:>10} {:>7} {:>10} {:>10} {:>10}",
        "op", "bytes", "window", "ferry GB/s", "base GB/s", "ratio", "p50 us", "p99 us", "p999 us"
    );
    let print = |r: &Record| {
        let opt = |v: Option<f64>, p: usize| v.map_or("-".into(), |v| format!("{v:.p$}"));
        println!(
            "{:>12} {:>12} {:>7} {:>10.3} {:>10} {:>7} {:>10.1} {:>10.1} {:>10.1}",
            r.series,
            r.bytes,
            r.window,
            r.ferry_gbps,
            opt(r.baseline_gbps, 3),
            opt(r.ratio, 2),
            r.p50_us,
            r.p99_us,
            r.p999_us
        );
    };
    let mut rows = Vec::new();
    match spec {
        Some(spec) => {
            let theirs = spec.layout();
            let ours = spec.layout_seeded(PLACES_SEED);
            let first = [(0, spec.packed())];
            let ways = [
                (format!("{op}-blocks"), theirs, ours),
                (
                    format!("{op}-contiguous"),
                    Layout::blocks(first),
                    Layout::blocks(first),
                ),
            ];
            for (series, theirs, ours) in ways {
                let places = (
                    Places {
                        region: remote,
                        layout: theirs,
                    },
                    Places {
                        region: local,
                        layout: ours,
                    },
                );
                let row = measure(node, target, args, series, spec.packed(), places).await?;
                rows.push(row);
            }
            let contiguous = rows[1].ferry_gbps;
            rows[0].baseline_gbps = Some(contiguous);
            rows[0].ratio = Some(rows[0].ferry_gbps / contiguous.max(1e-12));
            rows.iter().for_each(print);
            println!(
                "# {} blocks of {} bytes, scattered at both ends: {:.2} of the contiguous {op}",
                spec.count,
                spec.size,
                rows[0].ratio.unwrap_or(0.0)
            );
        }
        None => {
            for &size in sizes {
                let first = Layout::blocks([(0, size)]);
                let places = (
                    Places {
                        region: remote,
                        layout: first.clone(),
                    },
                    Places {
                        region: local,
                        layout: first,
                    },
                );
                let mut row = measure(node, target, args, op.into(), size, places).await?;
                let (warmup, window) = (args.warmup.max(row.window), row.window);
                let shape = (size, warmup, window);
                let base = super::sweep::baseline_gbps(
                    node,
                    target,
                    args,
                    shape,
                    &Layout::Contiguous,
                    row.ferry_gbps,
                )
                .await?;
                row.baseline_gbps = base;
                row.ratio = base.map(|b| row.ferry_gbps / b.max(1e-12));
                print(&row);
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

/// Times `args.iters` operations on `places` (the peer's, ours) after the warm-up.
async fn measure(
    node: &Node,
    target: &Target,
    args: &Args,
    series: String,
    bytes: u64,
    places: (Places, Places),
) -> anyhow::Result<Record> {
    let window = window_for(bytes, args.window, target.memory);
    let peer = target.name.as_str();
    many(
        node,
        peer,
        args.op,
        &places,
        args.warmup.max(window),
        window,
        None,
    )
    .await?;
    let mut hist = Histogram::<u64>::new(3).context("histogram")?;
    let started = Instant::now();
    many(
        node,
        peer,
        args.op,
        &places,
        args.iters,
        window,
        Some(&mut hist),
    )
    .await?;
    let elapsed = started.elapsed().as_secs_f64().max(1e-9);
    let pct = |q: f64| hist.value_at_quantile(q) as f64;
    Ok(Record {
        series,
        bytes,
        iterations: args.iters,
        window,
        ferry_gbps: (bytes * args.iters) as f64 / elapsed / 1e9,
        baseline_gbps: None,
        ratio: None,
        p50_us: pct(0.5),
        p99_us: pct(0.99),
        p999_us: pct(0.999),
        wrong: 0,
        checked: false,
    })
}

/// `count` operations, at most `window` in flight; each one's time in `hist` (µs).
async fn many(
    node: &Node,
    peer: &str,
    op: Op,
    (theirs, ours): &(Places, Places),
    count: u64,
    window: u64,
    mut hist: Option<&mut Histogram<u64>>,
) -> anyhow::Result<()> {
    let mut pending = FuturesUnordered::new();
    let mut started = 0;
    while started < count || !pending.is_empty() {
        while started < count && (pending.len() as u64) < window {
            let (theirs, ours) = (theirs.clone(), ours.clone());
            pending.push(async move {
                let t = Instant::now();
                let done = match op {
                    Op::Read => node
                        .read(peer, theirs, ours, OneSided::default())
                        .await
                        .map(drop),
                    Op::Write | Op::Send => {
                        node.write(peer, ours, theirs, OneSided::default()).await
                    }
                };
                (t.elapsed(), done)
            });
            started += 1;
        }
        if let Some((took, done)) = pending.next().await {
            done.with_context(|| format!("a one-sided {}", op.name()))?;
            if let Some(h) = hist.as_deref_mut() {
                let _ = h.record(took.as_micros().max(1) as u64);
            }
        }
    }
    Ok(())
}

/// Asks the peer for a region of `len` bytes in the bench's memory: its key.
async fn ask_region(
    node: &Node,
    peer: &str,
    target: &Target,
    len: u64,
) -> anyhow::Result<RegionKey> {
    let memory = match target.memory {
        MemoryKind::Device(_) => SEND_DEVICE,
        _ => SEND_HOST,
    };
    let words: Vec<u8> = [len, memory].iter().flat_map(|w| w.to_le_bytes()).collect();
    let answer = ask(node, peer, TAG_REGION, &words).await?;
    parse_key(&answer)
        .with_context(|| format!("the bench peer's region key does not read: {answer:?}"))
}

/// Sends `payload` under `tag` and waits for the answer under the same tag.
async fn ask(node: &Node, peer: &str, tag: u64, payload: &[u8]) -> anyhow::Result<String> {
    super::fetch::ask(node, peer, tag, payload).await
}

/// A key as the peer writes it: `region generation len`.
fn parse_key(text: &str) -> Option<RegionKey> {
    let mut words = text.split_whitespace().map(str::parse::<u64>);
    let key = RegionKey {
        region: words.next()?.ok()?,
        generation: words.next()?.ok()?,
        len: words.next()?.ok()?,
    };
    words.next().is_none().then_some(key)
}

/// The regions the bench peer registered for each client, unregistered when it leaves.
static REGIONS: Mutex<Vec<(String, RegionKey)>> = Mutex::new(Vec::new());

/// The peer's side: a [`TAG_REGION`] request registers a region of the payload's length
/// in its memory word, filled with the bench pattern, and answers its key; a
/// [`TAG_UNREGION`] request (a key's bytes) unregisters it.
pub async fn serve(
    node: &Node,
    client: &str,
    gpu: Option<u32>,
    tag: u64,
    payload: &[u8],
) -> anyhow::Result<String> {
    if tag == TAG_UNREGION {
        let key = RegionKey::from_bytes(payload).context("an unregister request is not a key")?;
        // A client unregisters its own regions only.
        let owned = {
            let mut regions = REGIONS
                .lock()
                .map_err(|_| anyhow::anyhow!("the region table is poisoned"))?;
            let before = regions.len();
            regions.retain(|(owner, k)| !(owner == client && *k == key));
            regions.len() < before
        };
        if !owned {
            bail!("region {} is not one {client} asked for", key.region);
        }
        drop(node.unregister(key).await?);
        return Ok("ok".into());
    }
    let words: Vec<u64> = payload
        .chunks_exact(8)
        .filter_map(|c| c.try_into().ok().map(u64::from_le_bytes))
        .collect();
    let [len, memory] = words[..] else {
        bail!("bad region request of {} bytes", payload.len());
    };
    let kind = match (memory, gpu) {
        (SEND_HOST, _) => MemoryKind::Host,
        (SEND_DEVICE, Some(gpu)) => MemoryKind::Device(gpu),
        (SEND_DEVICE, None) => bail!("asked for a device region, but gpu.devices = []"),
        _ => bail!("bad region request: memory {memory}"),
    };
    let mut buffer = node.alloc(kind, usize::try_from(len)?).await?;
    pattern::fill_buffer(&mut buffer)?;
    let key = node
        .register(buffer, Access::ReadWrite)
        .map_err(|e| anyhow::anyhow!("{}", e.error))?;
    REGIONS
        .lock()
        .map_err(|_| anyhow::anyhow!("the region table is poisoned"))?
        .push((client.to_string(), key));
    Ok(format!("{} {} {}", key.region, key.generation, key.len))
}

/// The peer's side: unregisters, in a task of its own, the regions of clients no longer
/// `live` (a client killed mid-run leaves its region).
pub fn unregister_departed(node: &std::sync::Arc<Node>, live: &[String]) {
    let Ok(mut regions) = REGIONS.lock() else {
        return;
    };
    let (gone, kept): (Vec<_>, Vec<_>) = regions
        .drain(..)
        .partition(|(client, _)| !live.iter().any(|l| l == client));
    *regions = kept;
    if gone.is_empty() {
        return;
    }
    let node = std::sync::Arc::clone(node);
    tokio::spawn(async move {
        for (_, key) in gone {
            let _ = node.unregister(key).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_read_back() {
        let key = RegionKey {
            region: 3,
            generation: 9,
            len: 4096,
        };
        let text = format!("{} {} {}", key.region, key.generation, key.len);
        assert_eq!(parse_key(&text), Some(key));
        assert_eq!(parse_key("3 9"), None);
        assert_eq!(parse_key("3 9 4096 1"), None);
        assert_eq!(parse_key("a b c"), None);
    }
}
