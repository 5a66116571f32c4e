//! `ferry demo`: starts node processes and pushes a few hundred buffers of mixed sizes
//! through a pipeline, `source → stage-1 → … → stage-N → source`, verifying every buffer's
//! checksum where it ends. Exits 0 only if every checksum matched.
//!
//! `--pressure` gives the source, which receives every buffer at the end of the pipeline, a
//! pinned budget far smaller than the data in flight, spilling to a host budget that is
//! limited too, and makes it read slower than the pipeline delivers (`--drain-rate`): the
//! backlog fills pinned memory, some receives spill to host, some wait. Each spilled buffer is promoted back
//! to pinned before its checksum is verified. Exits 0 only if every checksum matched and at
//! least one receive spilled and one was promoted.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferry::{Config, MemoryClass, MemoryKind, Node};
use futures::StreamExt;
use tokio::task::JoinSet;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Buffers to push through the pipeline.
    #[arg(long, default_value_t = 300)]
    buffers: usize,
    /// Largest buffer (the smallest is 1 byte), e.g. 64MiB. Default 64MiB, or 8MiB with
    /// --pressure.
    #[arg(long, value_parser = parse_size)]
    max_size: Option<u64>,
    /// Forwarding stages, each its own process.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=8))]
    stages: u16,
    /// Transfers in flight from the source at once. Default 8, or 32 with --pressure.
    #[arg(long)]
    window: Option<usize>,
    /// Give the source (the receiver at the end of the pipeline) a 16 MiB pinned budget,
    /// spilling to 96 MiB of host memory, and a slow reader, so that far more data is in
    /// flight than fits; promote spilled buffers back to pinned and count spills,
    /// promotions and waits.
    #[arg(long)]
    pressure: bool,
    /// With --pressure: how fast the source reads what it receives, in MB/s. Slower than
    /// the pipeline delivers, so a backlog builds up and fills pinned memory.
    #[arg(long, default_value_t = 20.0, requires = "pressure", value_parser = parse_rate)]
    drain_rate: f64,
    /// Keep buffers in host memory even where there are GPUs (without this, a machine with
    /// GPUs runs the pipeline in device memory, one node process per GPU).
    #[arg(long)]
    host: bool,
}

fn parse_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!("{s:?} is not a rate in MB/s above 0")),
    }
}

/// The source's memory under `--pressure`: receives land in pinned memory, spill to host.
const PRESSURE_PINNED: u64 = 16 << 20;
const PRESSURE_HOST: u64 = 96 << 20;
/// How long a spilled buffer may wait for pinned budget to be promoted.
const PROMOTE_DEADLINE: Duration = Duration::from_secs(10);

fn parse_size(s: &str) -> Result<u64, String> {
    ferry_config::parse_size(s).map_err(|e| e.to_string())
}

/// Size classes: name, smallest, largest, share of the buffers (percent).
const CLASSES: [(&str, u64, u64, usize); 5] = [
    ("1 B - 1 KiB", 1, 1 << 10, 40),
    ("1 - 64 KiB", (1 << 10) + 1, 64 << 10, 25),
    ("64 KiB - 1 MiB", (64 << 10) + 1, 1 << 20, 15),
    ("1 - 16 MiB", (1 << 20) + 1, 16 << 20, 12),
    ("16 - 64 MiB", (16 << 20) + 1, 64 << 20, 8),
];

/// Deterministic pseudo-random numbers (xorshift64*), for sizes and contents.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn fill(&mut self, bytes: &mut [u8]) {
        let mut words = bytes.chunks_exact_mut(8);
        for w in &mut words {
            w.copy_from_slice(&self.next().to_le_bytes());
        }
        let tail = words.into_remainder();
        let last = self.next().to_le_bytes();
        tail.copy_from_slice(&last[..tail.len()]);
    }
}

/// The buffers of each class: (tag, size).
fn plan(buffers: usize, max_size: u64) -> Vec<(&'static str, Vec<(u64, u64)>)> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut tag = 0;
    let mut out = Vec::new();
    for (i, (name, lo, hi, share)) in CLASSES.iter().enumerate() {
        if *lo > max_size {
            continue;
        }
        let hi = (*hi).min(max_size);
        let count = (buffers * share).div_ceil(100).max(1);
        let mut sizes = Vec::new();
        for k in 0..count {
            // Each class includes its bounds; the whole run includes 1 B and max_size.
            let size = match k {
                0 if i == 0 => 1,
                1 => hi,
                _ => lo + rng.next() % (hi - lo + 1),
            };
            sizes.push((tag, size));
            tag += 1;
        }
        out.push((*name, sizes));
    }
    out
}

struct Stage {
    name: String,
    child: Child,
}

impl Drop for Stage {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The log level of the stage processes: they share the terminal with the demo's table,
/// so only warnings and errors (`RUST_LOG`, which they inherit, still overrides it).
const STAGE_LOG_LEVEL: &str = "warn";

/// Writes a node's configuration; `extra` is appended as it is (more tables).
fn write_config(
    dir: &Path,
    name: &str,
    next: &str,
    secret: &Path,
    extra: &str,
) -> anyhow::Result<PathBuf> {
    let path = dir.join(format!("{name}.toml"));
    let text = format!(
        "[node]\nname = \"{name}\"\nlisten = [\"127.0.0.1:0\"]\nsocket_dir = \"{dir}\"\n\n\
         [[peers]]\nname = \"{next}\"\naddress = \"unix:{dir}/{next}.sock\"\n\n\
         [security]\nsecret_file = \"{secret}\"\n\n\
         [telemetry]\nlog_level = \"{STAGE_LOG_LEVEL}\"\n{extra}",
        dir = dir.display(),
        secret = secret.display(),
    );
    std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// Starts a stage process and waits for its ready line.
fn start_stage(config: &Path, name: &str, next: &str) -> anyhow::Result<Stage> {
    let exe = std::env::current_exe().context("cannot find the ferry binary")?;
    let mut child = Command::new(exe)
        .arg("serve")
        .arg("--config")
        .arg(config)
        .arg("--role")
        .arg(format!("forward={next}"))
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start stage {name}"))?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .with_context(|| format!("stage {name} did not start"))?;
    if !line.contains("ready") {
        bail!("stage {name} did not start: {line}");
    }
    Ok(Stage {
        name: name.to_string(),
        child,
    })
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    // The table goes to stdout; logs (warnings and up unless RUST_LOG says otherwise) to
    // stderr.
    super::telemetry::init_command(&ferry_config::TelemetryConfig::default());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    runtime.block_on(demo(args))
}

/// What the source's receiver saw under `--pressure`.
#[derive(Debug, Default, Clone)]
struct PressureCounts {
    /// Buffers received.
    received: usize,
    /// Received buffers that landed in host memory (the spill tier), not pinned.
    spilled: usize,
    /// Spilled buffers moved back into pinned memory.
    promoted: usize,
    /// Spilled buffers that could not be promoted before their deadline (still verified).
    promote_failed: usize,
    /// Received buffers by the transport of their last hop.
    transports: std::collections::BTreeMap<&'static str, usize>,
}

impl PressureCounts {
    fn add(&mut self, other: Self) {
        self.received += other.received;
        self.spilled += other.spilled;
        self.promoted += other.promoted;
        self.promote_failed += other.promote_failed;
        for (t, n) in other.transports {
            *self.transports.entry(t).or_default() += n;
        }
    }
}

async fn demo(args: Args) -> anyhow::Result<ExitCode> {
    let max_size = args
        .max_size
        .unwrap_or(if args.pressure { 8 << 20 } else { 64 << 20 });
    let window = args.window.unwrap_or(if args.pressure { 32 } else { 8 });
    let dir = tempfile::Builder::new()
        .prefix("ferry-demo-")
        .tempdir()
        .context("cannot create a scratch directory")?;
    let secret = dir.path().join("secret");
    let mut rng = Rng(std::process::id() as u64 | 1);
    let secret_text: String = (0..4).map(|_| format!("{:016x}", rng.next())).collect();
    super::write_secret_file(&secret, &secret_text).context("cannot write the demo secret")?;

    let names: Vec<String> = (1..=args.stages).map(|i| format!("stage-{i}")).collect();
    // Under pressure the source, which receives every buffer at the end of the pipeline,
    // receives into a small pinned budget and spills to a limited host budget (which also
    // holds the buffers it sends).
    let source_memory = if args.pressure {
        format!(
            "\n[memory]\nreceive_into = \"pinned\"\npinned = \"{PRESSURE_PINNED}\"\n\
             host = \"{PRESSURE_HOST}\"\nspill = [\"host\"]\n"
        )
    } else {
        String::new()
    };
    // On a GPU machine every node uses one GPU (round robin) and receives into it, so buffers
    // move GPU to GPU; --pressure stays on host memory (its tiers are host tiers).
    let gpus = if args.pressure || args.host {
        0
    } else {
        ferry::cuda::Device::count().unwrap_or(0) as u32
    };
    let gpu_table = |i: u32| {
        if gpus == 0 {
            String::new()
        } else {
            format!(
                "\n[gpu]\ndevices = [{}]\n\n[memory]\nreceive_into = \"device\"\n",
                i % gpus
            )
        }
    };
    let kind = if gpus == 0 {
        MemoryKind::Host
    } else {
        MemoryKind::Device(0)
    };
    let source_memory = format!("{source_memory}{}", gpu_table(0));
    let source_config = write_config(dir.path(), "source", &names[0], &secret, &source_memory)?;
    let config: Config = ferry_config::load(&ferry::LoadOptions::only_file(&source_config))?;
    let node = Arc::new(Node::start(config).await?);

    let mut stages = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let next = names.get(i + 1).map_or("source", String::as_str);
        let path = write_config(dir.path(), name, next, &secret, &gpu_table(i as u32 + 1))?;
        stages.push(start_stage(&path, name, next)?);
    }
    let last = names.last().context("no stages")?.clone();
    println!(
        "ferry demo: {} buffers, 1 B to {}, through source -> {} -> source ({} processes)",
        args.buffers,
        ferry_config::format_size(max_size),
        names.join(" -> "),
        names.len() + 1,
    );
    if gpus == 0 {
        println!("no GPU in use: buffers live in host memory");
    } else {
        println!(
            "{gpus} GPU(s): buffers live in device memory; node i uses GPU i mod {gpus}, and \
             receives into it"
        );
    }
    if args.pressure {
        println!(
            "pressure: the source receives into {} of pinned memory and spills to {} of host \
             memory (which also holds what it sends), and reads what it receives at most \
             {:.0} MB/s; up to {window} sends of up to {} in flight",
            ferry_config::format_size(PRESSURE_PINNED),
            ferry_config::format_size(PRESSURE_HOST),
            args.drain_rate,
            ferry_config::format_size(max_size),
        );
    }
    println!();
    println!(
        "{:<16} {:>6} {:>11} {:>10}  {:<10} why",
        "size class", "count", "bytes", "MB/s", "transport"
    );

    // Under pressure the source reads what it receives at most this fast (bytes/s), slower
    // than the pipeline delivers. Buffers not read yet hold their memory, so the backlog
    // fills pinned memory, then spills to host, then waits. Without a slow reader a pipeline
    // delivers at the pace of its slowest hop and the receiver keeps up, whatever the window.
    let pressure_drain = args.pressure.then_some(args.drain_rate * 1e6);
    let mut failures = 0usize;
    let mut total = 0usize;
    let mut pressure = PressureCounts::default();
    for (class, sizes) in plan(args.buffers, max_size) {
        let bytes: u64 = sizes.iter().map(|(_, s)| s).sum();
        let largest = sizes.iter().map(|(_, s)| *s).max().unwrap_or(1);
        let memory = if gpus == 0 {
            MemoryClass::Host
        } else {
            MemoryClass::Device
        };
        let explanation = node.explain(&names[0], largest, memory, memory).await?;
        let transport = explanation
            .chosen
            .as_ref()
            .map_or("none".to_string(), |r| r.transport.to_string());
        let started = Instant::now();
        let (wrong, count, seen) = run_class(
            &node,
            &names[0],
            &last,
            &sizes,
            window,
            pressure_drain,
            kind,
        )
        .await?;
        let arrived: Vec<String> = seen
            .transports
            .iter()
            .map(|(t, n)| format!("{n} over {t}"))
            .collect();
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        failures += wrong;
        total += count;
        pressure.add(seen);
        println!(
            "{class:<16} {count:>6} {:>11} {:>10.1}  {transport:<10} {explanation}; the last \
             hop carried {}",
            ferry_config::format_size(bytes),
            bytes as f64 / secs / 1e6,
            arrived.join(", "),
        );
    }
    println!();
    let mut pressure_ok = true;
    if args.pressure {
        // The largest number of reservations queued at once in each of the source's
        // domains, over the whole run: receives waiting for either tier, promotions waiting
        // for pinned, and the source's own allocations waiting for host.
        let pinned = node.memory(MemoryKind::PinnedHost).await?.budget;
        let host = node.memory(MemoryKind::Host).await?.budget;
        let checked = if failures == 0 {
            "every checksum verified"
        } else {
            "some checksums did not match"
        };
        println!(
            "pressure: {} received, {} spilled to host, {} promoted back to pinned \
             ({} promotions failed), reservations waited: up to {} at once for pinned, \
             up to {} for host; {checked}",
            pressure.received,
            pressure.spilled,
            pressure.promoted,
            pressure.promote_failed,
            pinned.peak_waiting,
            host.peak_waiting,
        );
        if pressure.spilled == 0 || pressure.promoted == 0 {
            println!("pressure: expected at least one spill and one promotion");
            pressure_ok = false;
        }
    }
    for stage in &mut stages {
        stop(stage);
    }
    if let Ok(node) = Arc::try_unwrap(node) {
        node.shutdown().await;
    }
    if failures == 0 {
        println!("all {total} checksums verified");
    } else {
        println!("{failures} of {total} buffers arrived wrong or not at all");
    }
    if failures == 0 && pressure_ok {
        Ok(ExitCode::SUCCESS)
    } else {
        Ok(ExitCode::FAILURE)
    }
}

/// A received buffer, checked: (tag, length, checksum), and with `promote_to`, where it
/// landed and whether its promotion succeeded.
type Checked = (u64, u64, u32, bool, Option<bool>);

/// Promotes `buffer` to `promote_to` if it landed elsewhere (spilled), then checksums it,
/// after the promotion, so the copy is checked byte for byte.
async fn check(tag: u64, buffer: ferry::Buffer, promote_to: Option<MemoryKind>) -> Checked {
    let (buffer, spilled, promoted) = match promote_to {
        Some(want) if buffer.kind() != want => {
            let deadline = Instant::now() + PROMOTE_DEADLINE;
            match buffer.promote(want, deadline).await {
                Ok(b) if b.kind() == want => (b, true, Some(true)),
                Ok(b) => (b, true, Some(false)),
                Err(e) => {
                    eprintln!("promotion of buffer {tag} failed: {}", e.reason);
                    (e.buffer, true, Some(false))
                }
            }
        }
        _ => (buffer, false, None),
    };
    // A buffer that cannot be read back checksums as 0, which never matches.
    let crc = buffer.bytes().map_or(0, |b| crc32c::crc32c(&b));
    (tag, buffer.len() as u64, crc, spilled, promoted)
}

/// Sends one class through the pipeline and checks what comes back. Under pressure
/// (`drain`: bytes/s) the receiver reads at most that fast, and promotes a buffer that
/// spilled to host back to pinned before checking it. Returns (wrong, count, what the
/// receiver saw).
async fn run_class(
    node: &Arc<Node>,
    first: &str,
    last: &str,
    sizes: &[(u64, u64)],
    window: usize,
    drain: Option<f64>,
    kind: MemoryKind,
) -> anyhow::Result<(usize, usize, PressureCounts)> {
    let promote_to = drain.map(|_| MemoryKind::PinnedHost);
    let mut expected = HashMap::new();
    let receiver = {
        let node = Arc::clone(node);
        let last = last.to_string();
        let count = sizes.len();
        tokio::spawn(async move {
            // Each buffer is checked in its own task: a spilled buffer waiting for pinned
            // budget must not keep the buffers behind it (which may hold that budget) from
            // being received and freed.
            let mut checks = JoinSet::new();
            let mut transports = std::collections::BTreeMap::new();
            let mut next_read = tokio::time::Instant::now();
            for _ in 0..count {
                // A slow reader under pressure: the next read waits for this one's bytes
                // to have been consumed at the drain rate (no credit builds up while idle).
                tokio::time::sleep_until(next_read).await;
                match tokio::time::timeout(Duration::from_secs(60), node.recv(Some(&last), None))
                    .await
                {
                    Ok(Ok(r)) => {
                        *transports.entry(r.transport.as_str()).or_default() += 1;
                        if let Some(rate) = drain {
                            let busy = r.buffer.len() as f64 / rate;
                            next_read = tokio::time::Instant::now().max(next_read)
                                + Duration::from_secs_f64(busy);
                        }
                        checks.spawn(check(r.tag, r.buffer, promote_to));
                    }
                    _ => break,
                }
            }
            let mut got = HashMap::new();
            let mut seen = PressureCounts {
                transports,
                ..PressureCounts::default()
            };
            while let Some(done) = checks.join_next().await {
                let Ok((tag, len, crc, spilled, promoted)) = done else {
                    continue;
                };
                got.insert(tag, (len, crc));
                seen.received += 1;
                seen.spilled += usize::from(spilled);
                match promoted {
                    Some(true) => seen.promoted += 1,
                    Some(false) => seen.promote_failed += 1,
                    None => {}
                }
            }
            (got, seen)
        })
    };
    let mut sends = futures::stream::iter(sizes.iter().copied())
        .map(|(tag, size)| {
            let node = Arc::clone(node);
            let first = first.to_string();
            async move {
                let mut buffer = node.alloc(kind, size as usize).await?;
                let mut bytes = vec![0u8; size as usize];
                Rng(tag.wrapping_mul(0x9E37_79B9) | 1).fill(&mut bytes);
                let crc = crc32c::crc32c(&bytes);
                buffer.write(0, &bytes)?;
                node.send(&first, tag, buffer).await?;
                anyhow::Ok((tag, size, crc))
            }
        })
        .buffer_unordered(window.max(1));
    let mut send_errors = 0;
    while let Some(result) = sends.next().await {
        match result {
            Ok((tag, size, crc)) => {
                expected.insert(tag, (size, crc));
            }
            Err(e) => {
                eprintln!("send failed: {e:#}");
                send_errors += 1;
            }
        }
    }
    let (got, seen) = receiver.await.context("receiver task failed")?;
    let wrong = expected
        .iter()
        .filter(|(tag, want)| got.get(tag) != Some(want))
        .count();
    Ok((wrong + send_errors, sizes.len(), seen))
}

/// Asks a stage to drain and exit; kills it if it does not within a few seconds.
fn stop(stage: &mut Stage) {
    let pid = nix::unistd::Pid::from_raw(stage.child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = stage.child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("stage {} did not stop in time; killing it", stage.name);
}
