//! `ferry demo`: starts node processes and pushes a few hundred buffers of mixed sizes
//! through a pipeline, `source → stage-1 → … → stage-N → source`, verifying every buffer's
//! checksum where it ends. Exits 0 only if every checksum matched.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferry::{Config, MemoryClass, MemoryKind, Node};
use futures::StreamExt;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Buffers to push through the pipeline.
    #[arg(long, default_value_t = 300)]
    buffers: usize,
    /// Largest buffer (the smallest is 1 byte), e.g. 64MiB.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    max_size: u64,
    /// Forwarding stages, each its own process.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=8))]
    stages: u16,
    /// Transfers in flight from the source at once.
    #[arg(long, default_value_t = 8)]
    window: usize,
}

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

/// The buffers of one class: (tag, size).
fn plan(args: &Args) -> Vec<(&'static str, Vec<(u64, u64)>)> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut tag = 0;
    let mut out = Vec::new();
    for (i, (name, lo, hi, share)) in CLASSES.iter().enumerate() {
        if *lo > args.max_size {
            continue;
        }
        let hi = (*hi).min(args.max_size);
        let count = (args.buffers * share).div_ceil(100).max(1);
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

fn write_config(dir: &Path, name: &str, next: &str, secret: &Path) -> anyhow::Result<PathBuf> {
    let path = dir.join(format!("{name}.toml"));
    let text = format!(
        "[node]\nname = \"{name}\"\nlisten = [\"127.0.0.1:0\"]\nsocket_dir = \"{dir}\"\n\n\
         [[peers]]\nname = \"{next}\"\naddress = \"unix:{dir}/{next}.sock\"\n\n\
         [security]\nsecret_file = \"{secret}\"\n",
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
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    runtime.block_on(demo(args))
}

async fn demo(args: Args) -> anyhow::Result<ExitCode> {
    let dir = tempfile::Builder::new()
        .prefix("ferry-demo-")
        .tempdir()
        .context("cannot create a scratch directory")?;
    let secret = dir.path().join("secret");
    let mut rng = Rng(std::process::id() as u64 | 1);
    let secret_text: String = (0..4).map(|_| format!("{:016x}", rng.next())).collect();
    std::fs::File::create(&secret)
        .and_then(|mut f| f.write_all(secret_text.as_bytes()))
        .context("cannot write the demo secret")?;

    let names: Vec<String> = (1..=args.stages).map(|i| format!("stage-{i}")).collect();
    let source_config = write_config(dir.path(), "source", &names[0], &secret)?;
    let config: Config = ferry_config::load(&ferry::LoadOptions::only_file(&source_config))?;
    let node = Arc::new(Node::start(config).await?);

    let mut stages = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let next = names.get(i + 1).map_or("source", String::as_str);
        let path = write_config(dir.path(), name, next, &secret)?;
        stages.push(start_stage(&path, name, next)?);
    }
    let last = names.last().context("no stages")?.clone();
    println!(
        "ferry demo: {} buffers, 1 B to {}, through source -> {} -> source ({} processes)",
        args.buffers,
        ferry_config::format_size(args.max_size),
        names.join(" -> "),
        names.len() + 1,
    );
    println!("no GPU support in this build: buffers live in host memory\n");
    println!(
        "{:<16} {:>6} {:>11} {:>10}  {:<10} why",
        "size class", "count", "bytes", "MB/s", "transport"
    );

    let mut failures = 0usize;
    let mut total = 0usize;
    for (class, sizes) in plan(&args) {
        let bytes: u64 = sizes.iter().map(|(_, s)| s).sum();
        let largest = sizes.iter().map(|(_, s)| *s).max().unwrap_or(1);
        let explanation = node
            .explain(&names[0], largest, MemoryClass::Host, MemoryClass::Host)
            .await?;
        let transport = explanation
            .chosen
            .as_ref()
            .map_or("none".to_string(), |r| r.transport.to_string());
        let started = Instant::now();
        let (wrong, count) = run_class(&node, &names[0], &last, &sizes, args.window).await?;
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        failures += wrong;
        total += count;
        println!(
            "{class:<16} {count:>6} {:>11} {:>10.1}  {transport:<10} {explanation}",
            ferry_config::format_size(bytes),
            bytes as f64 / secs / 1e6,
        );
    }
    println!();
    for stage in &mut stages {
        stop(stage);
    }
    if let Ok(node) = Arc::try_unwrap(node) {
        node.shutdown().await;
    }
    if failures == 0 {
        println!("all {total} checksums verified");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("{failures} of {total} buffers arrived wrong or not at all");
        Ok(ExitCode::FAILURE)
    }
}

/// Sends one class through the pipeline and checks what comes back. Returns (wrong, count).
async fn run_class(
    node: &Arc<Node>,
    first: &str,
    last: &str,
    sizes: &[(u64, u64)],
    window: usize,
) -> anyhow::Result<(usize, usize)> {
    let mut expected = HashMap::new();
    let receiver = {
        let node = Arc::clone(node);
        let last = last.to_string();
        let count = sizes.len();
        tokio::spawn(async move {
            let mut got = HashMap::new();
            for _ in 0..count {
                match tokio::time::timeout(Duration::from_secs(60), node.recv(Some(&last), None))
                    .await
                {
                    Ok(Ok(r)) => {
                        got.insert(
                            r.tag,
                            (r.buffer.len() as u64, crc32c::crc32c(r.buffer.as_slice())),
                        );
                    }
                    _ => break,
                }
            }
            got
        })
    };
    let mut sends = futures::stream::iter(sizes.iter().copied())
        .map(|(tag, size)| {
            let node = Arc::clone(node);
            let first = first.to_string();
            async move {
                let mut buffer = node.alloc(MemoryKind::Host, size as usize).await?;
                let slice = buffer.as_mut_slice().context("fresh buffer is shared")?;
                Rng(tag.wrapping_mul(0x9E37_79B9) | 1).fill(slice);
                let crc = crc32c::crc32c(slice);
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
    let got = receiver.await.context("receiver task failed")?;
    let wrong = expected
        .iter()
        .filter(|(tag, want)| got.get(tag) != Some(want))
        .count();
    Ok((wrong + send_errors, sizes.len()))
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
