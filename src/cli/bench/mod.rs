//! `ferry bench`: measures transfers between two nodes, every figure next to a baseline
//! measured in the same run between the same endpoints, reported as a ratio.
//!
//! On host memory it starts a peer process (`ferry bench --serve-peer CONFIG`), sends a
//! size sweep to it through a node of its own, and asks the peer after each size how many
//! buffers arrived and how many were wrong (`--check`, on by default). Both nodes route the
//! bench's memory over the measured transport (`--transport`, checked against what it
//! declares it reads). The baseline is picked from the transport's declared device path: a
//! plain socket between the same two processes moving the same bytes; for an RDMA path, its
//! library's own read (write) loop between them.
//!
//! On device memory (`--memory device`) the measured node uses GPU 0 and the local peer GPU 1
//! (GPU 0 too on a machine with one), both receiving into device memory. The baseline is
//! `cuMemcpyAsync` between the same two GPUs in this process, with the same number of
//! copies in flight (for a staging path, the slower of the two pinned copies around it).
//! Bandwidth is in GB/s (10^9 bytes per second).

mod args;
mod blocks;
mod fetch;
mod gpu_baseline;
mod mode;
mod onesided;
mod pattern;
mod peer;
mod report;
mod sweep;
mod ucx_raw;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use ferry::{Buffer, MemoryClass, MemoryKind, Node};
use ferry_transports::registry;
use ferry_transports::transport::{Carrier, DevicePath, Note, Route};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use hdrhistogram::Histogram;

pub use args::Args;
#[cfg(test)]
use args::sizes;
use args::{ControlLink, parse_bytes};
use mode::Mode;

/// Bytes in flight at most, per direction, whatever the window.
const IN_FLIGHT_CAP: u64 = 512 << 20;

/// The same for device memory: a GPU holds far more, and a window of one would time
/// each large transfer's control round trip alone, which two in flight hide (as they
/// would in any pipeline).
const DEVICE_IN_FLIGHT_CAP: u64 = 4 << 30;

fn window_for(size: u64, window: u64, memory: MemoryKind) -> u64 {
    let cap = match memory {
        MemoryKind::Device(_) => DEVICE_IN_FLIGHT_CAP,
        _ => IN_FLIGHT_CAP,
    };
    window.min((cap / size.max(1)).max(1))
}

pub fn run(config: Option<PathBuf>, overrides: &[String], args: Args) -> anyhow::Result<ExitCode> {
    // Checks that need no runtime and no peer come first.
    if args.serve_peer.is_none() && args.from_json.is_none() {
        check_args(&args)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    if let Some(peer_config) = &args.serve_peer {
        let config = bench_config(peer_config, overrides)?;
        runtime.block_on(peer::serve(config, !args.no_check))?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(json) = &args.from_json {
        let (header, records) = report::read_json(json)?;
        report::print_records(&header, &records);
        if let Some(path) = &args.csv {
            report::write_csv(path, &records)?;
        }
        if let Some(path) = &args.plot {
            report::plot(path, &header, &records)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let gpus = match args.memory.as_str() {
        "device" => Some(gpu_pair()?),
        _ => None,
    };
    runtime.block_on(orchestrate(config, overrides, args, gpus))
}

/// Refuses flags this build cannot measure, each with its reason.
fn check_args(args: &Args) -> anyhow::Result<()> {
    let class = memory_class(&args.memory)?;
    let declared = registry::declared(args.transport);
    if !declared.sources.contains(&class) {
        let t = args.transport;
        let reads: Vec<&str> = declared.sources.iter().map(|m| m.as_str()).collect();
        if class == MemoryClass::Host {
            bail!(
                "--transport {t} reads {} memory only here; add --memory device",
                reads.join("/")
            );
        }
        bail!(
            "--transport {t} --memory {class}: {t} does not move {class} memory here (it reads \
             {} memory); `ferry doctor` says why, or use --memory host",
            reads.join("/")
        );
    }
    if args.op != onesided::Op::Send {
        onesided::check_args(args)?;
    } else if let Some(n) = args.fetchers {
        fetch::check_args(args, n)?;
    } else if blocks::parse(&args.layout)?.is_some() {
        blocks::check_args(args)?;
    } else if let Some((row, _)) = strided(&args.layout)? {
        if !args.no_check {
            bail!(
                "--layout {}: add --no-check (the peer checks contiguous patterns)",
                args.layout
            );
        }
        if args.bidir || args.pingpong {
            bail!(
                "--layout {}: one direction only (no --bidir, --pingpong)",
                args.layout
            );
        }
        if args.min % row != 0 {
            bail!(
                "--layout {}: every size must be whole rows of {row} bytes (-b a multiple of \
                 the row)",
                args.layout
            );
        }
    }
    if args.min > args.max {
        bail!("-b {} is larger than -e {}", args.min, args.max);
    }
    if args.direction.is_some() && !args.peers.is_empty() {
        bail!(
            "--direction sets the rules of a local bench's nodes; with --peers, set the \
             direction in the nodes' rules"
        );
    }
    Ok(())
}

/// `--memory`: host or device.
fn memory_class(memory: &str) -> anyhow::Result<MemoryClass> {
    match memory {
        "host" => Ok(MemoryClass::Host),
        "device" => Ok(MemoryClass::Device),
        other => bail!("--memory {other}: host or device"),
    }
}

/// `--layout`: `None` for contiguous, else the row and the pitch of `strided:ROW:PITCH`.
fn strided(layout: &str) -> anyhow::Result<Option<(u64, u64)>> {
    if layout == "contiguous" {
        return Ok(None);
    }
    let parts: Vec<&str> = layout.split(':').collect();
    let ["strided", row, pitch] = parts[..] else {
        bail!(
            "--layout {layout}: contiguous, strided:ROW:PITCH (e.g. strided:4K:8K) or \
             blocks:SIZE:COUNT (e.g. blocks:16K:1000)"
        );
    };
    let (row, pitch) = (
        parse_bytes(row).map_err(|e| anyhow::anyhow!("--layout {layout}: {e}"))?,
        parse_bytes(pitch).map_err(|e| anyhow::anyhow!("--layout {layout}: {e}"))?,
    );
    if row == 0 || pitch < row {
        bail!("--layout {layout}: the pitch must be at least the row, the row not zero");
    }
    Ok(Some((row, pitch)))
}

/// The layout of a transfer of `size` packed bytes under `--layout`, and the length of the
/// buffer that holds it.
fn layout_for(args: &Args, size: u64) -> anyhow::Result<(ferry::Layout, u64)> {
    match strided(&args.layout)? {
        None => Ok((ferry::Layout::Contiguous, size)),
        Some((row, pitch)) => {
            let rows = size / row;
            if rows == 0 || size % row != 0 {
                bail!(
                    "--layout {}: {size} bytes are not whole rows of {row}",
                    args.layout
                );
            }
            let layout = ferry::Layout::Strided2D {
                rows,
                row_bytes: row,
                pitch,
            };
            let len = layout.extent()?.context("a strided layout has an extent")?;
            Ok((layout, len))
        }
    }
}

/// The rules both nodes of a local bench take: the bench's memory over the measured
/// transport, in `--direction` (else the transport's own); anything else (the bench's own
/// host-memory messages, unless the bench's memory is host memory) over the link's
/// transport. An opt-in transport is turned on at both, whatever the machine (ucx: over
/// tcp without RDMA).
fn bench_rules(args: &Args) -> String {
    let direction = args
        .direction
        .as_ref()
        .map(|d| format!("direction = \"{d}\"\n"))
        .unwrap_or_default();
    let mut text = format!(
        "\n[[transport.rules]]\nname = \"bench\"\nsrc = [\"{}\"]\ntransports = [\"{}\"]\n\
         {direction}\n[[transport.rules]]\nname = \"host\"\ntransports = [\"{}\"]\n",
        args.memory,
        args.transport,
        registry::LINK
    );
    let settings = registry::kind(args.transport).map_or(&[][..], |k| k.turned_on());
    for (key, value) in settings {
        if let Some((section, key)) = key.rsplit_once('.') {
            text.push_str(&format!("\n[{section}]\n{key} = {value}\n"));
        }
    }
    text
}

/// The GPUs of a device-memory bench: the measured node's and the local peer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GpuPair {
    ours: u32,
    theirs: u32,
}

/// GPU 0 for the measured node and GPU 1 for the local peer, or GPU 0 for both on a
/// machine with one GPU. Fails, saying why, without a driver or a GPU.
fn gpu_pair() -> anyhow::Result<GpuPair> {
    let count = ferry::cuda::Device::count().map_err(|e| {
        anyhow::anyhow!("--memory device: {e}; measure host memory with --memory host")
    })?;
    if count == 0 {
        bail!(
            "--memory device: the CUDA driver sees no GPU; measure host memory with --memory host"
        );
    }
    Ok(GpuPair {
        ours: 0,
        theirs: if count >= 2 { 1 } else { 0 },
    })
}

/// The `[gpu]` and `[memory]` tables of a node that uses GPU `ordinal` and receives into it.
fn gpu_table(ordinal: u32) -> String {
    format!("\n[gpu]\ndevices = [{ordinal}]\n\n[memory]\nreceive_into = \"device\"\n")
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

/// What the ferry figures are compared with.
enum Baseline {
    /// A plain socket to the local peer's raw server at this address.
    Socket(String),
    /// `cuMemcpyAsync` between the two GPUs of the bench, in this process.
    Copy(GpuPair),
    /// For a transport that reads host memory of the peer in place: one `memcpy` of the
    /// same bytes between two host buffers of this process.
    Memcpy,
    /// The staged transport's limit: the slower of a raw copy from our GPU into pinned
    /// host memory and one from pinned host memory into theirs, in this process.
    Staging(GpuPair),
    /// For a transport whose device path is RDMA: its library's own read (or write) loop
    /// on the peer's registered buffer, through ferry's engine but none of its protocol.
    RdmaEngine(Arc<ucx_raw::Reader>),
}

impl Baseline {
    fn label(&self, bidir: bool) -> String {
        match self {
            Baseline::Socket(_) => "plain TCP socket between the same two processes".into(),
            Baseline::Memcpy => "one memcpy of the same bytes in one process".into(),
            Baseline::RdmaEngine(reader) => reader.label().into(),
            Baseline::Copy(g) => format!(
                "raw cuMemcpyAsync GPU{} -> GPU{} in one process{}",
                g.ours,
                g.theirs,
                if bidir { ", and back at once" } else { "" }
            ),
            Baseline::Staging(g) => format!(
                "the slower of raw pinned copies GPU{} -> host and host -> GPU{} in one process",
                g.ours, g.theirs
            ),
        }
    }
}

/// Where the measured node's peer is.
struct Target {
    name: String,
    baseline: Option<Baseline>,
    local: Option<LocalPeer>,
    /// The memory the bench's buffers live in, here and at the peer.
    memory: MemoryKind,
}

impl Target {
    /// [`peer::TAG_SEND`]'s memory word for this bench.
    fn send_memory(&self) -> u64 {
        match self.memory {
            MemoryKind::Device(_) => peer::SEND_DEVICE,
            _ => peer::SEND_HOST,
        }
    }
}

/// The `--set` overrides both ends of a local bench take: those that shape transfers
/// (`transport`, `limits`, `memory`, and `node.recv_spin`, how a waiting receive polls),
/// so both run the same settings. Names, addresses, secret and GPUs are the bench's own.
fn transfer_overrides(overrides: &[String]) -> impl Iterator<Item = &String> {
    overrides.iter().filter(|o| {
        ["transport.", "limits.", "memory.", "node.recv_spin"]
            .iter()
            .any(|section| o.trim_start().starts_with(section))
    })
}

/// A local bench node's configuration: the file the bench wrote, with the transfer-shaping
/// `--set` overrides on top (no system, user or environment layers).
fn bench_config(file: &std::path::Path, overrides: &[String]) -> anyhow::Result<ferry::Config> {
    let mut opts = ferry::LoadOptions::only_file(file);
    let chosen: Vec<String> = transfer_overrides(overrides).cloned().collect();
    opts.overrides = super::parse_overrides(&chosen)?;
    Ok(ferry_config::load(&opts)?)
}

async fn start_local(
    args: &Args,
    gpus: Option<GpuPair>,
    overrides: &[String],
) -> anyhow::Result<(Target, Node)> {
    let dir = tempfile::Builder::new()
        .prefix("ferry-bench-")
        .tempdir()
        .context("cannot create a scratch directory")?;
    let secret = dir.path().join("secret");
    let key: String = (0..4)
        .map(|_| format!("{:016x}", rand::random::<u64>()))
        .collect();
    super::write_secret_file(&secret, &key).context("cannot write the bench secret")?;
    let unix = args.link == ControlLink::Unix;
    let declared = registry::declared(args.transport);
    // The library's own loop is the baseline of an RDMA path: the peer registers a buffer.
    let engine_baseline = declared.device_path == DevicePath::Rdma && !args.no_baseline;
    let peer_cfg = dir.path().join("peer.toml");
    // The peer shares the terminal with the bench's table: warnings and up (RUST_LOG, which
    // it inherits, still overrides).
    let mut text = format!(
        "[node]\nname = \"bench-peer\"\nlisten = [\"127.0.0.1:0\"]\n{}\n[security]\nsecret_file = \"{}\"\n\n\
         [telemetry]\nlog_level = \"warn\"\n",
        if unix {
            format!("socket_dir = \"{}\"\n", dir.path().display())
        } else {
            String::new()
        },
        secret.display()
    );
    if let Some(g) = gpus {
        text.push_str(&gpu_table(g.theirs));
    }
    text.push_str(&bench_rules(args));
    std::fs::write(&peer_cfg, &text).context("cannot write the peer config")?;
    let exe = std::env::current_exe().context("cannot find the ferry binary")?;
    let mut child = Command::new(exe)
        .args(transfer_overrides(overrides).flat_map(|o| ["--set", o.as_str()]))
        .arg("bench")
        .arg("--serve-peer")
        .arg(&peer_cfg)
        .args(args.no_check.then_some("--no-check"))
        .envs(
            engine_baseline
                .then(|| ucx_raw::peer_env(args.max, gpus.map(|g| g.theirs)))
                .into_iter()
                .flatten(),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start the bench peer")?;
    let stdout = child.stdout.take().context("no stdout")?;
    // The ready line, past what libraries print on stdout first (UCX logs there).
    let mut line = String::new();
    let mut reader = BufReader::new(stdout);
    let mut skipped = Vec::new();
    loop {
        line.clear();
        let read = reader
            .read_line(&mut line)
            .context("the bench peer did not start")?;
        if read == 0 || line.starts_with("ferry bench peer: ready") || skipped.len() >= 64 {
            break;
        }
        skipped.push(std::mem::take(&mut line));
    }
    if !line.starts_with("ferry bench peer: ready") {
        let _ = child.kill();
        bail!(
            "the bench peer did not start; it printed: {:?}",
            skipped.concat()
        );
    }
    // What the peer prints later goes to our stderr (its writes must not fail).
    std::thread::spawn(move || {
        for noise in skipped.into_iter().map(Ok).chain(reader.lines()) {
            let Ok(noise) = noise else { break };
            eprintln!("bench peer: {}", noise.trim_end());
        }
    });
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .map(str::to_string)
    };
    let (Some(listen), Some(baseline)) = (field(peer::LISTEN_FIELD), field("baseline")) else {
        let _ = child.kill();
        bail!("the bench peer did not start: {line:?}");
    };
    let local = LocalPeer { child, dir };
    let address = if unix {
        format!("unix:{}/bench-peer.sock", local.dir.path().display())
    } else {
        listen.split(',').next().unwrap_or_default().to_string()
    };
    text = format!(
        "[node]\nname = \"bench\"\nlisten = [\"127.0.0.1:0\"]\n\n[[peers]]\nname = \"bench-peer\"\n\
         address = \"{address}\"\n\n[security]\nsecret_file = \"{}\"\n",
        secret.display()
    );
    if let Some(g) = gpus {
        text.push_str(&gpu_table(g.ours));
    }
    text.push_str(&bench_rules(args));
    let bench_cfg = local.dir.path().join("bench.toml");
    std::fs::write(&bench_cfg, &text).context("cannot write the bench config")?;
    let node = Node::start(bench_config(&bench_cfg, overrides)?).await?;
    let engine = match field(ucx_raw::FIELD) {
        Some(f) => Some(Arc::new(ucx_raw::Reader::connect(
            node.config(),
            &f,
            gpus.map(|g| g.ours),
            args.direction.as_deref() == Some("push"),
        )?)),
        None => None,
    };
    let target = Target {
        name: "bench-peer".into(),
        baseline: Some(match (gpus, engine) {
            (_, Some(reader)) => Baseline::RdmaEngine(reader),
            (Some(g), None) if declared.device_path == DevicePath::PinnedStaging => {
                Baseline::Staging(g)
            }
            (Some(g), None) => Baseline::Copy(g),
            (None, None) if declared.carrier == Carrier::Memory => Baseline::Memcpy,
            (None, None) => Baseline::Socket(baseline),
        }),
        local: Some(local),
        memory: gpus.map_or(MemoryKind::Host, |g| MemoryKind::Device(g.ours)),
    };
    Ok((target, node))
}

async fn orchestrate(
    config: Option<PathBuf>,
    overrides: &[String],
    args: Args,
    gpus: Option<GpuPair>,
) -> anyhow::Result<ExitCode> {
    let (target, node) = if args.peers.is_empty() {
        // The bench's own nodes' configurations set no level: warnings and up (RUST_LOG
        // still overrides), so the table reads cleanly.
        super::telemetry::init_command(&ferry_config::TelemetryConfig::default());
        start_local(&args, gpus, overrides).await?
    } else {
        let config = super::load_config(config, overrides, vec![])?;
        super::telemetry::init_command(&config.telemetry);
        // Device memory on the first GPU the configuration names (GPU 0 when it names none);
        // no baseline: the peer's GPU is not known here.
        let memory = match (gpus, config.gpu.devices.as_deref()) {
            (None, _) => MemoryKind::Host,
            (Some(_), Some([])) => {
                bail!("--memory device: the configuration sets gpu.devices = []")
            }
            (Some(_), Some([first, ..])) => MemoryKind::Device(*first),
            (Some(_), None) => MemoryKind::Device(0),
        };
        let target = Target {
            name: args.peers[0].clone(),
            baseline: None,
            local: None,
            memory,
        };
        (target, Node::start(config).await?)
    };
    let node = Arc::new(node);
    node.connect(&target.name)
        .await
        .with_context(|| format!("cannot reach the bench peer {}", target.name))?;
    let class = match target.memory {
        MemoryKind::Device(_) => MemoryClass::Device,
        _ => MemoryClass::Host,
    };
    let mode = Mode::of(&args)?;
    let most = mode.largest(&args);
    let explanation = node.explain(&target.name, most, class, class).await?;
    let chosen = explanation.chosen.as_ref().map(|r| r.transport);
    let direction = explanation.chosen.as_ref().map(|r| r.direction.to_string());
    if let Some(wanted) = &args.direction
        && chosen == Some(args.transport)
        && direction.as_ref() != Some(wanted)
    {
        bail!(
            "--direction {wanted}: {} moves only {}; the route: {explanation}",
            args.transport,
            direction.unwrap_or_default()
        );
    }
    if chosen != Some(args.transport) {
        bail!(
            "--transport {}: ferry would carry {} of {} memory to {} over {}, so the bench \
             would not measure {}; the route: {explanation}",
            args.transport,
            ferry_config::format_size(most),
            args.memory,
            target.name,
            chosen.map_or("nothing", |t| t.as_str()),
            args.transport,
        );
    }
    if let Mode::Fetchers(n) = mode {
        fetch::check_limits(&node, &target, n, args.max).await?;
    }
    let header = report::Header {
        mode: mode.name().into(),
        layout: args.layout.clone(),
        pingpong: args.pingpong,
        transport: args.transport.to_string(),
        memory: args.memory.clone(),
        link: args.link.name().into(),
        bidir: args.bidir,
        iters: args.iters,
        warmup: args.warmup,
        route: explanation.to_string(),
        baseline: mode.baseline_label(&args, &target),
        latency: mode.latency_label(&args),
    };
    mode.print_header(&header);
    // What the measured transport says of this route: its library, its settings.
    let route = Route {
        locality: explanation.query.locality,
        src: class,
        landing: explanation.chosen.as_ref().map_or(class, |r| r.landing),
        chosen: true,
        rdma_device: ferry_transports::transport::has_rdma_device(),
    };
    let notes =
        registry::kind(args.transport).map_or_else(Vec::new, |k| k.notes(node.config(), &route));
    for note in notes {
        match note {
            Note::Fact { label, text, .. } => println!("# {label}: {text}"),
            Note::Warning(text) => println!("# warning: {text}"),
            _ => {}
        }
    }
    if matches!(target.memory, MemoryKind::Device(_)) && !args.no_check {
        println!(
            "# check: the peer copies every device buffer it receives to host memory to verify \
             it, which bounds ferry's figures; --no-check measures the transport alone"
        );
    }
    let records = mode.run(&node, &target, &args).await?;

    if args.pairs.as_deref() == Some("all") {
        let size = args.max;
        // With --bidir the record holds both directions together: show one direction's share.
        let share = if args.bidir { 0.5 } else { 1.0 };
        let forward = records.last().map_or(0.0, |r| r.ferry_gbps * share);
        let back = sweep::measure_return(&node, &target, &args, size).await?;
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
    // Our node leaves first (a clean goodbye), then the local peer stops: neither logs a
    // lost link under the table.
    if let Ok(node) = Arc::try_unwrap(node) {
        node.shutdown().await;
    }
    drop(target.local);
    if wrong > 0 {
        eprintln!("ferry bench: {wrong} transfers arrived wrong");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

async fn alloc_filled(
    node: &Node,
    kind: MemoryKind,
    size: u64,
    count: u64,
) -> anyhow::Result<Vec<Buffer>> {
    let mut out = Vec::new();
    for _ in 0..count {
        let mut b = node.alloc(kind, usize::try_from(size)?).await?;
        pattern::fill_buffer(&mut b).context("cannot fill a bench buffer")?;
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
    layout: &ferry::Layout,
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
            let layout = layout.clone();
            pending.push(async move {
                let t = Instant::now();
                let r = if layout == ferry::Layout::Contiguous {
                    node.send(peer, tag, b).await
                } else {
                    node.send_layout(peer, tag, b, layout).await
                };
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

/// What the peer saw since its last report.
struct PeerReport {
    received: u64,
    wrong: u64,
    /// The transports that carried them (empty from a peer that does not say).
    transports: Vec<String>,
}

async fn peer_report(node: &Node, peer: &str) -> anyhow::Result<PeerReport> {
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
    let transports = String::from_utf8_lossy(bytes.get(16..).unwrap_or_default())
        .split(',')
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect();
    Ok(PeerReport {
        received: word(0)?,
        wrong: word(8)?,
        transports,
    })
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
        assert_eq!(window_for(1 << 30, 8, MemoryKind::Host), 1);
        assert_eq!(window_for(8, 8, MemoryKind::Host), 8);
        assert_eq!(window_for(1 << 30, 8, MemoryKind::Device(0)), 4);
    }

    #[test]
    fn both_ends_take_the_settings_that_shape_transfers() {
        let overrides: Vec<String> = [
            "transport.shm.lane_max=1MiB",
            "node.recv_spin=50us",
            "node.name=mine",
            "security.secret_file=/x",
            "limits.peer_queue=4",
        ]
        .map(String::from)
        .into();
        let taken: Vec<&String> = transfer_overrides(&overrides).collect();
        assert_eq!(
            taken,
            [&overrides[0], &overrides[1], &overrides[4]],
            "names and secrets stay the bench's own"
        );
    }
}
