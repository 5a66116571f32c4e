//! `ferry bench --layout blocks:SIZE:COUNT`: COUNT blocks of SIZE bytes at random,
//! non-overlapping places of a pool four times their bytes (a paged KV cache's pages), sent
//! as one transfer with `Layout::Blocks`; next to it, in the same run and to the same peer,
//! the same bytes as one contiguous buffer, and one transfer per block. Three rows of one
//! size, and the two ratios; in `--json` and `--csv` the three rows (series `blocks`,
//! `contiguous`, `per-block`), the contiguous row's GB/s the others' baseline.
//!
//! The pool's blocks hold, in list order, the bench pattern of their packed length, so the
//! peer checks a block list's arrival as it checks any buffer (`--check`, on by default).

use std::time::Instant;

use anyhow::{Context, bail};
use ferry::{Buffer, Layout, MAX_BLOCKS, MemoryKind, Node};
use hdrhistogram::Histogram;
use rand::SeedableRng;
use rand::seq::SliceRandom;

use super::report::Record;
use super::{Args, Target, alloc_filled, parse_bytes, pattern, peer_report, send_many, window_for};

/// The pool holds this many times the blocks' bytes.
const POOL_FACTOR: u64 = 4;

/// The placement's seed: every run scatters the blocks alike.
const SEED: u64 = 19;

/// `--layout blocks:SIZE:COUNT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    /// Bytes of each block.
    pub size: u64,
    /// Blocks.
    pub count: u64,
}

impl Spec {
    /// The bytes that move: every block's.
    pub fn packed(&self) -> u64 {
        self.size * self.count
    }

    /// The pool the blocks lie in.
    pub fn pool(&self) -> u64 {
        self.packed() * POOL_FACTOR
    }

    /// The blocks: `count` distinct slots of `size` bytes of the pool's `count *
    /// POOL_FACTOR`, in a random order (seeded).
    pub fn layout(&self) -> Layout {
        self.layout_seeded(SEED)
    }

    /// As [`Self::layout`], the slots drawn with `seed`.
    pub fn layout_seeded(&self, seed: u64) -> Layout {
        let mut slots: Vec<u64> = (0..self.count * POOL_FACTOR).collect();
        slots.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        Layout::blocks(
            slots[..self.count as usize]
                .iter()
                .map(|&slot| (slot * self.size, self.size)),
        )
    }
}

/// `--layout`: `Some` for `blocks:SIZE:COUNT` (SIZE with the suffixes of `-b`), `None` for
/// any other layout.
pub fn parse(layout: &str) -> anyhow::Result<Option<Spec>> {
    let Some(rest) = layout.strip_prefix("blocks:") else {
        return Ok(None);
    };
    let Some((size, count)) = rest.split_once(':') else {
        bail!("--layout {layout}: blocks:SIZE:COUNT (e.g. blocks:16K:1000)");
    };
    let size = parse_bytes(size).map_err(|e| anyhow::anyhow!("--layout {layout}: {e}"))?;
    let count: u64 = count
        .parse()
        .with_context(|| format!("--layout {layout}: COUNT is a number of blocks"))?;
    if size == 0 || count == 0 {
        bail!("--layout {layout}: at least one block, of at least one byte");
    }
    if count > MAX_BLOCKS as u64 {
        bail!("--layout {layout}: at most {MAX_BLOCKS} blocks in a transfer");
    }
    if size
        .checked_mul(count)
        .and_then(|p| p.checked_mul(POOL_FACTOR))
        .is_none_or(|pool| usize::try_from(pool).is_err())
    {
        bail!("--layout {layout}: the pool of {POOL_FACTOR} times the blocks does not fit memory");
    }
    Ok(Some(Spec { size, count }))
}

/// What `--layout blocks` cannot be combined with, and why.
pub fn check_args(args: &Args) -> anyhow::Result<()> {
    if args.bidir || args.pingpong || args.pairs.is_some() {
        bail!(
            "--layout {}: one direction only (no --bidir, --pingpong, --pairs)",
            args.layout
        );
    }
    if args.plot.is_some() {
        bail!(
            "--layout {}: one size in three rows; --plot draws a size sweep (--json and --csv \
             write the rows)",
            args.layout
        );
    }
    Ok(())
}

/// The header's baseline.
pub fn baseline_label() -> String {
    "the same bytes as one contiguous buffer, to the same peer in this run (the blocks and \
     per-block rows' baseline), and as one transfer per block"
        .into()
}

/// One way of moving the blocks' bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// One transfer of the pool with the block list.
    Blocks,
    /// One transfer of a buffer of the packed bytes.
    Contiguous,
    /// One transfer per block.
    PerBlock,
}

impl Way {
    fn label(self) -> &'static str {
        match self {
            Way::Blocks => "blocks",
            Way::Contiguous => "contiguous",
            Way::PerBlock => "per block",
        }
    }

    /// The row's series in `--json` and `--csv`.
    fn series(self) -> &'static str {
        match self {
            Way::Blocks => "blocks",
            Way::Contiguous => "contiguous",
            Way::PerBlock => "per-block",
        }
    }

    /// Transfers per copy of the blocks' bytes.
    fn sends(self, spec: Spec) -> u64 {
        match self {
            Way::PerBlock => spec.count,
            Way::Blocks | Way::Contiguous => 1,
        }
    }
}

const WAYS: [Way; 3] = [Way::Blocks, Way::Contiguous, Way::PerBlock];

/// Measures the three ways to the target and prints them: their rows, each but the
/// contiguous one next to the contiguous one's GB/s as its baseline.
pub async fn run(
    node: &Node,
    target: &Target,
    args: &Args,
    spec: Spec,
) -> anyhow::Result<Vec<Record>> {
    println!(
        "# blocks: {} blocks of {} bytes at random places (seed {SEED}) of a pool of {} bytes; \
         {} bytes a copy; the blocks' bytes moved three ways, GB/s of those bytes",
        spec.count,
        spec.size,
        spec.pool(),
        spec.packed()
    );
    println!(
        "{:>12} {:>12} {:>6} {:>7} {:>10} {:>10} {:>10} {:>10} {:>7}",
        "layout", "bytes", "sends", "window", "ferry GB/s", "p50 us", "p99 us", "p999 us", "#wrong"
    );
    let mut rows = Vec::new();
    for way in WAYS {
        let row = measure(node, target, args, spec, way).await?;
        println!(
            "{:>12} {:>12} {:>6} {:>7} {:>10.3} {:>10.1} {:>10.1} {:>10.1} {:>7}",
            way.label(),
            row.bytes,
            way.sends(spec),
            row.window,
            row.ferry_gbps,
            row.p50_us,
            row.p99_us,
            row.p999_us,
            if row.checked {
                row.wrong.to_string()
            } else {
                "-".to_string()
            }
        );
        rows.push(row);
    }
    let gbps = |way: Way| {
        rows.iter()
            .find(|r| r.series == way.series())
            .map_or(0.0, |r| r.ferry_gbps)
    };
    let (blocks, contiguous) = (gbps(Way::Blocks), gbps(Way::Contiguous));
    println!(
        "# blocks / contiguous {:.2}; blocks / one transfer per block {:.1}x",
        blocks / contiguous.max(1e-12),
        blocks / gbps(Way::PerBlock).max(1e-12)
    );
    for row in rows
        .iter_mut()
        .filter(|r| r.series != Way::Contiguous.series())
    {
        row.baseline_gbps = Some(contiguous);
        row.ratio = Some(row.ferry_gbps / contiguous.max(1e-12));
    }
    Ok(rows)
}

async fn measure(
    node: &Node,
    target: &Target,
    args: &Args,
    spec: Spec,
    way: Way,
) -> anyhow::Result<Record> {
    let peer = target.name.as_str();
    let sends = way.sends(spec);
    let (layout, bytes, held) = match way {
        Way::Blocks => (spec.layout(), spec.packed(), spec.pool()),
        Way::Contiguous => (Layout::Contiguous, spec.packed(), spec.packed()),
        Way::PerBlock => (Layout::Contiguous, spec.size, spec.size),
    };
    let window = window_for(held, args.window, target.memory);
    let mut buffers = match way {
        Way::Blocks => pools(node, target.memory, spec, &layout, window).await?,
        _ => alloc_filled(node, target.memory, bytes, window).await?,
    };
    let warmup = args.warmup.max(window);
    send_many(node, peer, &mut buffers, &layout, warmup, None).await?;
    let mut hist = Histogram::<u64>::new(3).context("histogram")?;
    let timed = args.iters * sends;
    let started = Instant::now();
    send_many(node, peer, &mut buffers, &layout, timed, Some(&mut hist)).await?;
    let elapsed = started.elapsed().as_secs_f64().max(1e-9);
    drop(buffers);
    let report = peer_report(node, peer).await?;
    if let Some(other) = report
        .transports
        .iter()
        .find(|t| t.as_str() != args.transport.as_str())
    {
        bail!(
            "the peer received {} transfers over {other}, not {}: the route fell back \
             (RUST_LOG=info says why)",
            way.label(),
            args.transport
        );
    }
    let wrong = if args.no_check {
        0
    } else {
        report.wrong + (warmup + timed).saturating_sub(report.received)
    };
    let pct = |q: f64| hist.value_at_quantile(q) as f64;
    Ok(Record {
        series: way.series().into(),
        bytes,
        iterations: timed,
        window,
        ferry_gbps: (spec.packed() * args.iters) as f64 / elapsed / 1e9,
        baseline_gbps: None,
        ratio: None,
        p50_us: pct(0.5),
        p99_us: pct(0.99),
        p999_us: pct(0.999),
        wrong,
        checked: !args.no_check,
    })
}

/// `count` pools of `kind` memory whose blocks (by `layout`), packed, are the bench pattern
/// of the packed length; the bytes between them are not.
async fn pools(
    node: &Node,
    kind: MemoryKind,
    spec: Spec,
    layout: &Layout,
    count: u64,
) -> anyhow::Result<Vec<Buffer>> {
    let mut packed = vec![0u8; usize::try_from(spec.packed())?];
    pattern::fill(&mut packed);
    let mut pool = vec![0xEE; usize::try_from(spec.pool())?];
    layout.scatter(&packed, 0, &mut pool)?;
    let mut out = Vec::new();
    for _ in 0..count {
        let mut b = node.alloc(kind, pool.len()).await?;
        b.write(0, &pool).context("cannot fill a bench pool")?;
        out.push(b);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_option_reads_and_refuses_with_reasons() {
        assert_eq!(parse("contiguous").expect("not blocks"), None);
        assert_eq!(
            parse("blocks:16K:1000").expect("blocks"),
            Some(Spec {
                size: 16 << 10,
                count: 1000
            })
        );
        for (text, why) in [
            ("blocks:16K", "blocks:SIZE:COUNT"),
            ("blocks:0:10", "at least one block"),
            ("blocks:4K:0", "at least one block"),
            ("blocks:4K:many", "COUNT is a number"),
            ("blocks:1:65537", "at most 65536 blocks"),
            ("blocks:4194304G:65536", "does not fit"),
        ] {
            let e = parse(text).expect_err(text).to_string();
            assert!(e.contains(why), "{text}: {e}");
        }
    }

    #[test]
    fn blocks_lie_apart_in_the_pool_in_a_shuffled_order() {
        let spec = Spec {
            size: 4096,
            count: 100,
        };
        let layout = spec.layout();
        assert_eq!(layout.check_destination(spec.pool()), Ok(spec.packed()));
        let offsets: Vec<u64> = layout
            .block_list()
            .expect("blocks")
            .iter()
            .map(|b| b.offset)
            .collect();
        let mut sorted = offsets.clone();
        sorted.sort_unstable();
        assert_ne!(offsets, sorted, "not shuffled");
        assert!(offsets.iter().all(|o| o % 4096 == 0));
        assert_eq!(layout, spec.layout(), "the same places every run");
    }
}
