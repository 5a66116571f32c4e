//! `ferry bench --fetchers N`: single flight, measured. For each size of the run the peer
//! publishes N buffers of it in the bench's memory (each the bench pattern of its length, so
//! every fetched buffer is checked under `--check`, on by default), and this node fetches
//! them three ways, each round starting its fetches at once and waiting for the last, `-n`
//! timed rounds after `-w` untimed ones, next to each other in one table:
//!
//! - `N fetchers, one flight`: N fetches of one key share one flight (the bytes cross the
//!   link once; the others get a copy made here, or with `--shared` the one read-only
//!   handle). Every round must take one flight, and the peer must have served the key once
//!   more: the bench fails otherwise. A round in which a flight landed before this process
//!   had started every fetch (it lost the CPU to the flight, on a loaded machine) is no
//!   round of concurrent fetches: it is run again, and counted under the row.
//! - `N fetchers, N flights`: N fetches of N keys of the same size, one flight each: the
//!   baseline (skipped with `--no-baseline`).
//! - `1 fetcher`: one fetch of one key, for reference.
//!
//! The single-flight gain is the baseline's time per round over the one flight's. In
//! `--json` and `--csv` the rows are series `one-flight`, `flights` and `single` (the
//! window: the fetches of a round; the latencies: a round's), the one flight's baseline the
//! N flights' GB/s, so its ratio is the gain.
//!
//! The peer's side ([`serve`]) answers three requests ([`super::peer::TAG_PUBLISH`],
//! [`super::peer::TAG_PUBLICATION`], [`super::peer::TAG_UNPUBLISH`]) with text: a reply
//! that starts with `error: ` says why it failed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferry::{Fetch, Fetched, MemoryKind, Node};
use ferry_actors::fetch::MAX_JOINERS;
use hdrhistogram::Histogram;

use super::peer::{SEND_DEVICE, SEND_HOST, TAG_PUBLICATION, TAG_PUBLISH, TAG_UNPUBLISH};
use super::report::Record;
use super::{Args, Target, pattern};

/// How long the bench waits for the peer's answer to one request.
const ANSWER_WAIT: Duration = Duration::from_secs(120);

/// What `--fetchers` cannot be combined with, and its bounds that need no node.
pub fn check_args(args: &Args, n: u64) -> anyhow::Result<()> {
    if n == 0 {
        bail!("--fetchers 0: at least one fetcher");
    }
    if n > MAX_JOINERS as u64 {
        bail!("--fetchers {n}: at most {MAX_JOINERS} (the fetches one flight takes)");
    }
    if args.layout != "contiguous" {
        bail!(
            "--fetchers fetches whole buffers: no --layout {}",
            args.layout
        );
    }
    if args.bidir || args.pingpong || args.pairs.is_some() {
        bail!(
            "--fetchers: this node fetches, one direction only (no --bidir, --pingpong, --pairs)"
        );
    }
    if args.plot.is_some() {
        bail!(
            "--fetchers: three rows a size; --plot draws a sweep of one row a size (--json and \
             --csv write the rows)"
        );
    }
    Ok(())
}

/// The bounds of `--fetchers` this node sets: the N flights row has N fetches to the peer
/// outstanding (the exporter serves at most `limits.peer_queue` of one peer at once), and
/// each row holds N buffers of the largest size here at once.
pub async fn check_limits(
    node: &Node,
    target: &Target,
    n: u64,
    largest: u64,
) -> anyhow::Result<()> {
    let queue = node.config().limits.peer_queue as u64;
    if n > queue {
        bail!(
            "--fetchers {n}: at most limits.peer_queue = {queue} (the fetches of one peer \
             served at once); raise it with --set limits.peer_queue=N"
        );
    }
    let budget = node.memory(target.memory).await?.budget.capacity;
    let (section, name) = match target.memory {
        MemoryKind::Device(_) => ("memory.device", "device"),
        _ => ("memory.host", "host"),
    };
    if n.checked_mul(largest).is_none_or(|held| held > budget) {
        bail!(
            "--fetchers {n} -e {largest}: {n} fetched buffers of {} at once do not fit this \
             node's {name} memory budget of {}; lower -e or --fetchers, or raise {section}",
            ferry_config::format_size(largest),
            ferry_config::format_size(budget)
        );
    }
    Ok(())
}

/// The header's baseline.
pub fn baseline_label(args: &Args) -> String {
    let n = args.fetchers.unwrap_or(1);
    if args.no_baseline {
        return "none".into();
    }
    format!(
        "{n} fetches of {n} keys of the same size at once (one flight each), from the same \
         peer in this run"
    )
}

/// The header's latency.
pub fn latency_label(n: u64) -> String {
    format!("a round: {n} fetches (or 1) started at once, until the last resolved")
}

/// One way of fetching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// N fetches of one key.
    OneFlight,
    /// N fetches of N keys.
    Flights,
    /// One fetch.
    Single,
}

impl Way {
    /// The row's series in `--json` and `--csv`.
    fn series(self) -> &'static str {
        match self {
            Way::OneFlight => "one-flight",
            Way::Flights => "flights",
            Way::Single => "single",
        }
    }

    fn label(self, n: u64) -> String {
        let s = if n == 1 { "" } else { "s" };
        match self {
            Way::OneFlight => format!("{n} fetcher{s}, one flight"),
            Way::Flights => format!("{n} fetcher{s}, {n} flight{s}"),
            Way::Single => "1 fetcher".into(),
        }
    }
}

/// One row of the table.
struct Row {
    way: Way,
    /// Fetches a round.
    fetchers: u64,
    /// Flights and joined fetches a round.
    flights: u64,
    joined: u64,
    /// Mean time of a round, microseconds.
    round_us: f64,
    /// Bytes the fetchers got per second, GB/s.
    gbps: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    wrong: u64,
    /// Rounds run again: a flight landed before this process had started every fetch.
    again: u64,
}

impl Row {
    /// The row as `--json` and `--csv` write it: `size` bytes a fetch, the fetches of a round
    /// its window, a round's times its latencies; its baseline filled in by [`run`].
    fn record(&self, size: u64, args: &Args) -> Record {
        Record {
            series: self.way.series().into(),
            bytes: size,
            iterations: args.iters,
            window: self.fetchers,
            ferry_gbps: self.gbps,
            baseline_gbps: None,
            ratio: None,
            p50_us: self.p50_us,
            p99_us: self.p99_us,
            p999_us: self.p999_us,
            wrong: self.wrong,
            checked: !args.no_check,
        }
    }
}

/// Measures every size of the run three ways and prints the rows: their records, the one
/// flight's next to the N flights' GB/s as its baseline (its ratio the single-flight gain).
pub async fn run(
    node: &Node,
    target: &Target,
    args: &Args,
    n: u64,
    sizes: &[u64],
) -> anyhow::Result<Vec<Record>> {
    println!(
        "# fetchers: the peer publishes {n} buffers a size; rounds of fetches started at \
         once, {} timed after {} warm-up a row{}; GB/s = bytes the fetchers got / time",
        args.iters,
        args.warmup,
        if args.shared {
            "; joined fetches take the one read-only handle (--shared)"
        } else {
            "; joined fetches each get a copy"
        }
    );
    println!(
        "{:>28} {:>12} {:>8} {:>7} {:>7} {:>12} {:>10} {:>10} {:>10} {:>10} {:>7}",
        "fetch",
        "bytes",
        "fetchers",
        "flights",
        "joined",
        "round us",
        "GB/s",
        "p50 us",
        "p99 us",
        "p999 us",
        "#wrong"
    );
    let ways: &[Way] = if args.no_baseline {
        &[Way::OneFlight, Way::Single]
    } else {
        &[Way::OneFlight, Way::Flights, Way::Single]
    };
    let mut records = Vec::new();
    for &size in sizes {
        let keys = publish(node, &target.name, size, n, target.send_memory()).await?;
        let mut rows = Vec::new();
        let mut measured = Ok(());
        for &way in ways {
            match measure(node, target, args, n, size, &keys, way).await {
                Ok(row) => {
                    print_row(&row, n, size, args.no_check);
                    if row.again > 0 {
                        println!(
                            "# {} at {size} bytes: {} run again (a flight landed before this \
                             process had started every fetch of the round)",
                            row.way.label(n),
                            if row.again == 1 {
                                "1 round".to_string()
                            } else {
                                format!("{} rounds", row.again)
                            }
                        );
                    }
                    rows.push(row);
                }
                Err(e) => {
                    measured = Err(e);
                    break;
                }
            }
        }
        // Unpublished whatever happened, so a serving peer does not keep them.
        let unpublished = unpublish(node, &target.name, &keys).await;
        measured?;
        unpublished?;
        let flights = rows.iter().find(|r| r.way == Way::Flights).map(|r| r.gbps);
        records.extend(rows.iter().map(|row| {
            let mut record = row.record(size, args);
            if row.way == Way::OneFlight {
                record.baseline_gbps = flights;
                record.ratio = flights.map(|f| row.gbps / f.max(1e-12));
            }
            record
        }));
        let round = |way| rows.iter().find(|r| r.way == way).map(|r| r.round_us);
        if let (Some(one), Some(flights), Some(single)) = (
            round(Way::OneFlight),
            round(Way::Flights),
            round(Way::Single),
        ) {
            println!(
                "# single-flight gain at {size} bytes: {:.2}x (time per round of {}, over {}); \
                 {} take {:.2}x the time of 1 fetcher",
                flights / one.max(1e-9),
                Way::Flights.label(n),
                Way::OneFlight.label(n),
                Way::OneFlight.label(n),
                one / single.max(1e-9)
            );
        }
    }
    Ok(records)
}

fn print_row(row: &Row, n: u64, size: u64, no_check: bool) {
    println!(
        "{:>28} {:>12} {:>8} {:>7} {:>7} {:>12.1} {:>10.3} {:>10.1} {:>10.1} {:>10.1} {:>7}",
        row.way.label(n),
        size,
        row.fetchers,
        row.flights,
        row.joined,
        row.round_us,
        row.gbps,
        row.p50_us,
        row.p99_us,
        row.p999_us,
        if no_check {
            "-".to_string()
        } else {
            row.wrong.to_string()
        }
    );
}

async fn measure(
    node: &Node,
    target: &Target,
    args: &Args,
    n: u64,
    size: u64,
    keys: &[String],
    way: Way,
) -> anyhow::Result<Row> {
    let peer = target.name.as_str();
    // The keys each round fetches, and the distinct ones among them.
    let (asked, distinct): (Vec<&str>, &[String]) = match way {
        Way::OneFlight => (vec![keys[0].as_str(); n as usize], &keys[..1]),
        Way::Flights => (keys.iter().map(String::as_str).collect(), keys),
        Way::Single => (vec![keys[0].as_str()], &keys[..1]),
    };
    let fetchers = asked.len() as u64;
    let flights = distinct.len() as u64;
    let fetch = Fetch {
        shared: args.shared,
        ..Fetch::default()
    };
    let crc = (!args.no_check).then(|| pattern::crc(size as usize));
    let mut served = publication(node, peer, distinct).await?;
    let mut hist = Histogram::<u64>::new(3).context("histogram")?;
    let mut timed = Duration::ZERO;
    let (mut wrong, mut again, mut again_in_a_row) = (0, 0, 0);
    let mut i = 0;
    while i < args.warmup + args.iters {
        let before = node.fetch_stats();
        let started = Instant::now();
        let fetched = fetch_all(node, peer, &asked, &fetch).await;
        let took = started.elapsed();
        let after = node.fetch_stats();
        for f in fetched {
            let f = f.with_context(|| format!("a fetch of {size} bytes from {peer} failed"))?;
            if f.transport != args.transport {
                bail!(
                    "a fetch came over {}, not {}: the route fell back (RUST_LOG=info says why)",
                    f.transport,
                    args.transport
                );
            }
            if let Some(crc) = crc
                && (f.buffer.len() as u64 != size || crc32c::crc32c(&f.buffer.bytes()?) != crc)
            {
                wrong += 1;
            }
        }
        let (took_flights, joined) = (after.flights - before.flights, after.joined - before.joined);
        let now = publication(node, peer, distinct).await?;
        let delta: Vec<u64> = now.iter().zip(&served).map(|(is, was)| is - was).collect();
        served = now;
        if took_flights > flights {
            // Not a round of concurrent fetches: a flight landed before this process had
            // started them all (on a loaded machine the thread that starts them loses the
            // CPU to the flight it started), and those after it flew again. Each flight
            // still crossed once, as the peer's count says.
            if delta.iter().sum::<u64>() != took_flights {
                bail!(
                    "{}: a round of {size} bytes took {took_flights} flights, and the peer \
                     served {} fetches",
                    way.label(n),
                    delta.iter().sum::<u64>()
                );
            }
            again += 1;
            again_in_a_row += 1;
            if again_in_a_row >= AGAIN_AT_MOST {
                bail!(
                    "{}: {AGAIN_AT_MOST} rounds of {size} bytes in a row, a flight landed \
                     before this process had started all {fetchers} fetches (it did not get \
                     the CPU in time: a loaded machine?)",
                    way.label(n)
                );
            }
            continue;
        }
        again_in_a_row = 0;
        if took_flights != flights || joined != fetchers - flights {
            bail!(
                "{}: round {i} of {size} bytes took {took_flights} flights and {joined} joined \
                 fetches, not {flights} and {}{}",
                way.label(n),
                fetchers - flights,
                if way == Way::OneFlight {
                    ": single flight did not hold"
                } else {
                    ""
                }
            );
        }
        if let Some((key, d)) = distinct.iter().zip(&delta).find(|(_, d)| **d != 1) {
            bail!(
                "{}: in round {i} of {size} bytes the peer served key {key} {d} times, not once",
                way.label(n)
            );
        }
        if i >= args.warmup {
            timed += took;
            let _ = hist.record(took.as_micros().max(1) as u64);
        }
        i += 1;
    }
    let secs = timed.as_secs_f64().max(1e-9);
    let pct = |q: f64| hist.value_at_quantile(q) as f64;
    Ok(Row {
        way,
        fetchers,
        flights,
        joined: fetchers - flights,
        round_us: secs * 1e6 / args.iters as f64,
        gbps: (fetchers * size * args.iters) as f64 / secs / 1e9,
        p50_us: pct(0.5),
        p99_us: pct(0.99),
        p999_us: pct(0.999),
        wrong,
        again,
    })
}

/// Rounds run again in a row at most (see [`fetch_all`]) before the bench gives up.
const AGAIN_AT_MOST: u64 = 10;

/// Fetches `keys` at once (each takes its place in a flight at its first poll, and
/// `join_all` polls them all once before any is awaited) and waits for every fetch.
async fn fetch_all(
    node: &Node,
    peer: &str,
    keys: &[&str],
    fetch: &Fetch,
) -> Vec<anyhow::Result<Fetched>> {
    let fetches = keys.iter().map(|key| node.fetch(peer, key, fetch.clone()));
    futures::future::join_all(fetches)
        .await
        .into_iter()
        .map(|f| f.map_err(anyhow::Error::from))
        .collect()
}

/// Asks the peer to publish `count` buffers of `size` bytes in `memory` (a
/// [`super::peer::TAG_SEND`] memory word): their keys.
async fn publish(
    node: &Node,
    peer: &str,
    size: u64,
    count: u64,
    memory: u64,
) -> anyhow::Result<Vec<String>> {
    let words: Vec<u8> = [size, count, memory]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    let answer = ask(node, peer, TAG_PUBLISH, &words).await?;
    let keys: Vec<String> = answer.lines().map(str::to_string).collect();
    if keys.len() as u64 != count {
        bail!(
            "the bench peer published {} buffers, not {count}",
            keys.len()
        );
    }
    Ok(keys)
}

/// How many times the peer served each of `keys`, once no fetch of them is being served.
async fn publication(node: &Node, peer: &str, keys: &[String]) -> anyhow::Result<Vec<u64>> {
    let answer = ask(node, peer, TAG_PUBLICATION, keys.join("\n").as_bytes()).await?;
    let served: Vec<u64> = answer
        .lines()
        .map(|l| l.split_whitespace().nth(1).and_then(|w| w.parse().ok()))
        .collect::<Option<_>>()
        .with_context(|| format!("the bench peer's publication stats do not read: {answer:?}"))?;
    if served.len() != keys.len() {
        bail!(
            "the bench peer answered for {} keys, not {}",
            served.len(),
            keys.len()
        );
    }
    Ok(served)
}

async fn unpublish(node: &Node, peer: &str, keys: &[String]) -> anyhow::Result<()> {
    ask(node, peer, TAG_UNPUBLISH, keys.join("\n").as_bytes()).await?;
    Ok(())
}

/// Sends `payload` to the peer under `tag` and waits for its answer under the same tag.
pub(super) async fn ask(
    node: &Node,
    peer: &str,
    tag: u64,
    payload: &[u8],
) -> anyhow::Result<String> {
    let mut b = node.alloc(MemoryKind::Host, payload.len()).await?;
    b.write(0, payload).context("cannot fill a request")?;
    node.send(peer, tag, b)
        .await
        .map_err(|e| anyhow::anyhow!("{}", e.error))?;
    let answer = tokio::time::timeout(ANSWER_WAIT, node.recv(Some(peer), Some(tag)))
        .await
        .context(
            "the bench peer did not answer a --fetchers request (a peer of a ferry without \
             --fetchers takes it for a transfer)",
        )??;
    let text = String::from_utf8_lossy(&answer.buffer.bytes()?).into_owned();
    if let Some(why) = text.strip_prefix("error: ") {
        bail!("the bench peer: {why}");
    }
    Ok(text)
}

/// The peer's side: unpublishes, in a task of its own, what clients no longer `live`
/// published (a client killed mid-run leaves its keys).
pub fn unpublish_departed(node: &Arc<Node>, keys: Vec<String>, live: &[String]) {
    let gone: Vec<String> = keys
        .into_iter()
        .filter(|key| {
            key.strip_prefix("bench/")
                .and_then(|rest| rest.rsplit_once('/'))
                .is_some_and(|(client, _)| !live.iter().any(|l| l == client))
        })
        .collect();
    if gone.is_empty() {
        return;
    }
    tracing::info!(
        keys = gone.len(),
        "unpublishing what departed clients published"
    );
    let node = Arc::clone(node);
    tokio::spawn(async move {
        for key in gone {
            // Another tick may have unpublished it already.
            let _ = node.unpublish(&key).await;
        }
    });
}

/// The peer's side: answers a [`TAG_PUBLISH`], [`TAG_PUBLICATION`] or [`TAG_UNPUBLISH`]
/// request of `client` (its `payload`); `gpu` is the GPU device memory comes from. The
/// answer's text, or an error to answer with.
pub async fn serve(
    node: &Node,
    client: &str,
    gpu: Option<u32>,
    tag: u64,
    payload: &[u8],
) -> anyhow::Result<String> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let keys = || {
        String::from_utf8_lossy(payload)
            .lines()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    match tag {
        TAG_PUBLISH => {
            let words: Vec<u64> = payload
                .chunks_exact(8)
                .filter_map(|c| c.try_into().ok().map(u64::from_le_bytes))
                .collect();
            let [len, count, memory] = words[..] else {
                bail!("bad publish request of {} bytes", payload.len());
            };
            let kind = match (memory, gpu) {
                (SEND_HOST, _) => MemoryKind::Host,
                (SEND_DEVICE, Some(gpu)) => MemoryKind::Device(gpu),
                (SEND_DEVICE, None) => {
                    bail!("asked to publish device memory, but gpu.devices = []")
                }
                _ => bail!("bad publish request: memory {memory}"),
            };
            let mut published = Vec::new();
            let made = async {
                for _ in 0..count {
                    let mut b = node.alloc(kind, usize::try_from(len)?).await?;
                    pattern::fill_buffer(&mut b)?;
                    let key = format!("bench/{client}/{}", NEXT.fetch_add(1, Ordering::Relaxed));
                    node.publish(key.clone(), b).map_err(|e| e.error)?;
                    published.push(key);
                }
                anyhow::Ok(())
            }
            .await;
            if let Err(e) = made {
                for key in &published {
                    let _ = node.unpublish(key).await;
                }
                return Err(e.context(format!("publishing {count} buffers of {len} bytes")));
            }
            Ok(published.join("\n"))
        }
        TAG_PUBLICATION => {
            let mut lines = Vec::new();
            for key in keys() {
                let until = Instant::now() + ANSWER_WAIT / 2;
                // Settled: no fetch of it being served (a fetch ended at the fetcher may not
                // have ended here yet).
                let stats = loop {
                    let stats = node
                        .publication(&key)
                        .with_context(|| format!("nothing is published under key {key:?}"))?;
                    if stats.reading == 0 || Instant::now() >= until {
                        break stats;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                };
                lines.push(format!(
                    "{} {} {} {} {}",
                    stats.len, stats.served, stats.bytes_served, stats.refused, stats.reading
                ));
            }
            Ok(lines.join("\n"))
        }
        TAG_UNPUBLISH => {
            for key in keys() {
                node.unpublish(&key).await?;
            }
            Ok("ok".into())
        }
        _ => bail!("not a --fetchers request: tag {tag}"),
    }
}
