//! `ferry explain`: which route a transfer to a peer would take, and why.
//!
//! It starts a node from the configuration (listening on an ephemeral loopback port, with no
//! Unix socket, so it never collides with a running `ferry serve` of the same file), dials
//! the peer to learn what it offers and what memory it receives into (unless
//! `--no-connect`), and asks the node to explain the route: the one a send would take now,
//! chosen by the same code, or with `--dst-memory` a what-if one. Around that answer it says why earlier rules did not match, why each transport
//! was passed over, and whether the chosen path is far slower than the hardware allows.
//! Each transport the matching rule names adds its own notes
//! ([`TransportKind::notes`](ferry_transports::transport::TransportKind::notes): the
//! library it loads, its settings, what its path costs here). Everything but the node, the
//! CUDA probe and the transports' notes is pure and tested below.

mod live;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use ferry::{Explanation, Node};
use ferry_actors::core::route::{DstSource, RouteQuery};
use ferry_config::{Locality, MemoryClass, Rule, TransportName, format_size, parse_size};
use ferry_transports::cuda::{self, CudaProbe};
use ferry_transports::transport::{Capabilities, DevicePath, Note, Route, Unsuitable, Viability};
use serde::Serialize;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The peer, by its configured name.
    #[arg(long)]
    peer: String,
    /// Bytes to move: 4096, 64K, 1M, 2G (K, M, G are powers of 1024), or 64MiB, 1GB.
    #[arg(long, value_parser = parse_bytes)]
    bytes: u64,
    /// Memory at this (the sending) end: host, pinned or device.
    #[arg(long, value_parser = parse_memory)]
    memory: MemoryClass,
    /// Memory at the receiving end, to ask what-if; default: what the peer receives into, as
    /// its hello says (the route a send takes), or host memory without a link to the peer.
    #[arg(long = "dst-memory", value_parser = parse_memory)]
    dst_memory: Option<MemoryClass>,
    /// Buffer layout. Every transport carries every layout (it gathers strided rows and
    /// block lists itself), so the route does not depend on it; `--bytes` is what moves
    /// (the packed bytes).
    #[arg(long, value_enum, default_value_t = Layout::Contiguous)]
    layout: Layout,
    /// Dial the peer to learn what it offers and whether setup works (the default).
    #[arg(long, overrides_with = "no_connect")]
    connect: bool,
    /// Do not dial: explain from this side's configuration and declarations only.
    #[arg(long = "no-connect", overrides_with = "connect")]
    no_connect: bool,
    /// Print the explanation as JSON.
    #[arg(long)]
    json: bool,
}

/// A buffer layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Layout {
    /// One run of bytes.
    Contiguous,
    /// Rows at a pitch (`Layout::Strided2D`, `Layout::Strided3D`).
    Strided,
    /// A list of (offset, length) blocks (`Layout::Blocks`).
    Blocks,
}

/// A size for `--bytes`: what [`parse_size`] reads, plus a bare `K`, `M`, `G` or `T`
/// suffix, read as powers of 1024 (as nccl-tests and ucx_perftest do).
fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let expanded = match t.chars().last() {
        Some(c)
            if matches!(c.to_ascii_uppercase(), 'K' | 'M' | 'G' | 'T')
                && t[..t.len() - 1].ends_with(|d: char| d.is_ascii_digit()) =>
        {
            format!("{}{}iB", &t[..t.len() - 1], c.to_ascii_uppercase())
        }
        _ => t.to_string(),
    };
    parse_size(&expanded).map_err(|e| e.0)
}

fn parse_memory(text: &str) -> Result<MemoryClass, String> {
    text.parse().map_err(|e: ferry_config::ParseError| e.0)
}

pub fn run(file: Option<PathBuf>, overrides: &[String], args: Args) -> anyhow::Result<ExitCode> {
    let mut config = super::load_config(file, overrides, Vec::new())?;
    super::telemetry::init_command(&config.telemetry);
    // What the transports' notes read: the configuration as loaded.
    let loaded = config.clone();
    // Never collide with a `ferry serve` started from the same file.
    config.node.listen = vec!["127.0.0.1:0".into()];
    config.node.socket_dir = None;
    // With DNS discovery: find where the peer is, and dial only it.
    config.discovery.connect_all = false;
    let rules = config.transport.rules.clone();
    let src = args.memory;
    // `None`: the node routes for what the peer receives into, as its sends do.
    let dst = args.dst_memory;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    let connect = !args.no_connect;
    let (setup, explanation, live) =
        runtime.block_on(ask_node(config, &args.peer, args.bytes, src, dst, connect))?;
    let device = src == MemoryClass::Device || explanation.query.dst == MemoryClass::Device;
    let gpu = device.then(|| gpu_note(&cuda::probe(), &ferry_transports::registry::catalog()));
    let mut report = Report::new(&args, &rules, &explanation, setup, gpu);
    let rdma = ferry_actors::node::has_rdma_device();
    report.add_notes(route_notes(&loaded, &rules, &explanation, rdma));
    report.add_notes(live);
    let text = if args.json {
        serde_json::to_string_pretty(&report)? + "\n"
    } else {
        report.render()
    };
    // A closed pipe (`ferry explain ... | head`) is not an error worth a panic.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
    Ok(if report.chosen.is_some() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// What the node answered: the link's setup, the route, and what it said live of the
/// route's transport with the link up ([`live::notes`]).
type Answers = (Setup, Explanation, Vec<Note>);

/// Starts the node, dials if asked, asks for the explanation (and what it can say live of
/// the route's transport), and stops the node.
async fn ask_node(
    config: ferry::Config,
    peer: &str,
    bytes: u64,
    src: MemoryClass,
    dst: Option<MemoryClass>,
    connect: bool,
) -> anyhow::Result<Answers> {
    let limit =
        config.limits.connect_timeout + config.limits.handshake_timeout + Duration::from_secs(2);
    let node = Node::start(config)
        .await
        .context("cannot start a node to explain from")?;
    let setup = if connect {
        match tokio::time::timeout(limit, node.connect(peer)).await {
            Ok(Ok(())) => Setup::Connected,
            Ok(Err(e)) => Setup::Failed(e.to_string()),
            Err(_) => Setup::Failed(format!(
                "peer {peer}: no link within {}",
                humantime::format_duration(limit)
            )),
        }
    } else {
        Setup::NotTried
    };
    let explanation = node.explain(peer, bytes, src, dst).await;
    let live = match &explanation {
        Ok(e) if setup == Setup::Connected => live::notes(&node, peer, e, limit).await,
        _ => Vec::new(),
    };
    node.shutdown().await;
    Ok((setup, explanation?, live))
}

/// Whether the link to the peer came up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Setup {
    /// `--no-connect`.
    NotTried,
    /// The link is up; the peer's offers were taken into account.
    Connected,
    /// Dialing failed, with the error.
    Failed(String),
}

/// Why a rule before the matching one did not match. Pure.
pub fn rule_mismatch(rule: &Rule, query: &RouteQuery) -> Vec<String> {
    fn list<T: std::fmt::Display>(items: &[T]) -> String {
        items
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("|")
    }
    let mut why = Vec::new();
    if !rule.locality.is_empty() && !rule.locality.contains(&query.locality) {
        why.push(format!(
            "locality {} not in {}",
            query.locality,
            list(&rule.locality)
        ));
    }
    if !rule.src.is_empty() && !rule.src.contains(&query.src) {
        why.push(format!(
            "source memory {} not in {}",
            query.src,
            list(&rule.src)
        ));
    }
    if !rule.dst.is_empty() && !rule.dst.contains(&query.dst) {
        why.push(format!(
            "destination memory {} not in {}",
            query.dst,
            list(&rule.dst)
        ));
    }
    if query.bytes < rule.min_bytes {
        why.push(format!(
            "size {} below min_bytes {}",
            format_size(query.bytes),
            format_size(rule.min_bytes)
        ));
    }
    if let Some(max) = rule.max_bytes
        && query.bytes > max
    {
        why.push(format!(
            "size {} above max_bytes {}",
            format_size(query.bytes),
            format_size(max)
        ));
    }
    why
}

/// A rule that did not match, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RuleMiss {
    /// Index in `transport.rules`.
    pub index: usize,
    /// Its name.
    pub name: String,
    /// Each condition that failed.
    pub reasons: Vec<String>,
}

/// Walks the rules in order up to the first that matches (or all of them) and says why
/// each one before it did not. Pure.
pub fn rule_misses(rules: &[Rule], query: &RouteQuery) -> Vec<RuleMiss> {
    rules
        .iter()
        .enumerate()
        .map(|(index, rule)| (index, rule, rule_mismatch(rule, query)))
        .take_while(|(_, _, reasons)| !reasons.is_empty())
        .map(|(index, rule, reasons)| RuleMiss {
            index,
            name: rule.name.clone(),
            reasons,
        })
        .collect()
}

/// A transport passed over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skip {
    /// The transport.
    pub transport: String,
    /// `not-built`, `not-viable`, `peer-lacks` or `capabilities`.
    pub kind: &'static str,
    /// Why, in words.
    pub reason: String,
}

/// Classifies and words why a transport was passed over. Pure.
pub fn skip(transport: TransportName, why: &Unsuitable) -> Skip {
    let (kind, reason) = match why {
        Unsuitable::NotViable(text) if text.starts_with("not built yet") => {
            ("not-built", text.clone())
        }
        Unsuitable::NotViable(text) => {
            ("not-viable", format!("not viable on this machine: {text}"))
        }
        Unsuitable::PeerLacks => ("peer-lacks", "the peer does not offer it".to_string()),
        Unsuitable::Locality(l) => (
            "capabilities",
            format!("excluded by its declared capabilities: cannot reach a {l} peer"),
        ),
        Unsuitable::Memory(m) => (
            "capabilities",
            format!("excluded by its declared capabilities: cannot move {m} memory"),
        ),
        Unsuitable::Direction(Some(d)) => (
            "capabilities",
            format!("excluded by its declared capabilities: does not support {d}"),
        ),
        Unsuitable::Direction(None) => (
            "capabilities",
            "excluded by its declared capabilities: declares no direction".to_string(),
        ),
        Unsuitable::SetupFailed(why) => ("setup-failed", format!("setup failed: {why}")),
    };
    Skip {
        transport: transport.to_string(),
        kind,
        reason,
    }
}

/// Copy engine between two H200 GPUs, large transfers (BASELINES.md).
const COPY_ENGINE_GBPS: u32 = 396;
/// Pinned host <-> device, each way, 16 MiB and up (BASELINES.md).
const PINNED_GBPS: u32 = 55;

/// Warnings when the route is expected to run far below what the hardware between the two
/// ends allows. Read from the transports' declared device paths ([`DevicePath`]); what an
/// RDMA path costs without an RDMA device is the transport's to say ([`route_notes`]).
/// Pure.
pub fn performance_warnings(explanation: &Explanation, rules: &[Rule]) -> Vec<String> {
    let q = &explanation.query;
    // Where the bytes really land: a transport that cannot land in the peer's device memory
    // lands in its host memory.
    let landing = explanation.chosen.as_ref().map_or(q.dst, |r| r.landing);
    let device = q.src == MemoryClass::Device || landing == MemoryClass::Device;
    let Some(chosen) = explanation.chosen.as_ref().map(|r| r.transport) else {
        return Vec::new();
    };
    if !device {
        return Vec::new();
    }
    let same_host = matches!(q.locality, Locality::SameHost | Locality::SameProcess);
    let mut out: Vec<String> = path_warning(explanation, chosen, same_host)
        .into_iter()
        .collect();
    let rule = explanation.rule.as_ref().and_then(|(i, _)| rules.get(*i));
    if let Some(rule) = rule
        && path(chosen) == DevicePath::HostCopy
    {
        out.extend(rule_order_warning(rule, chosen, same_host));
    }
    out
}

/// How `transport` declares it moves device memory.
fn path(transport: TransportName) -> DevicePath {
    ferry_transports::registry::declared(transport).device_path
}

use super::taking;

/// What the path of `chosen` costs device memory, where that is far below the hardware.
fn path_warning(
    explanation: &Explanation,
    chosen: TransportName,
    same_host: bool,
) -> Option<String> {
    let copy_engine = taking(DevicePath::CopyEngine);
    let copy_engine_status = || match explanation
        .skipped
        .iter()
        .find(|(t, _)| path(*t) == DevicePath::CopyEngine)
    {
        Some((t, why)) => format!("{t} was passed over: {}", skip(*t, why).reason),
        None => format!("the rule does not list {copy_engine}"),
    };
    Some(match path(chosen) {
        DevicePath::PinnedStaging if same_host => format!(
            "device memory on one host goes through {chosen} (device -> pinned host -> device), \
             bounded by pinned host<->device copies (~{PINNED_GBPS} GB/s each way); \
             {copy_engine} would use the copy engine (~{COPY_ENGINE_GBPS} GB/s between H200 \
             GPUs, about 7x more); {}",
            copy_engine_status()
        ),
        DevicePath::PinnedStaging => format!(
            "device memory to another host goes through {chosen}: two pinned host<->device \
             copies (~{PINNED_GBPS} GB/s each) around the network; {} with GPUDirect RDMA \
             would let the NIC read and write GPU memory directly",
            taking(DevicePath::Rdma)
        ),
        DevicePath::HostCopy => format!(
            "device memory goes over {chosen}: it is copied to host memory first \
             (~{PINNED_GBPS} GB/s pinned) and then through the socket stack, far below the copy \
             engine (~{COPY_ENGINE_GBPS} GB/s between H200 GPUs)"
        ),
        _ => return None,
    })
}

/// Whether `rule` lists `chosen`, a transport that copies device memory through host
/// memory, before every transport with a device path of its own.
fn rule_order_warning(rule: &Rule, chosen: TransportName, same_host: bool) -> Option<String> {
    let host_first = rule
        .transports
        .iter()
        .position(|t| path(*t) == DevicePath::HostCopy);
    let device_first = rule
        .transports
        .iter()
        .position(|t| path(*t) != DevicePath::HostCopy);
    let host_before_device = match (host_first, device_first) {
        (Some(h), Some(d)) => h < d,
        (Some(_), None) => true,
        _ => false,
    };
    if !host_before_device {
        return None;
    }
    let staging = taking(DevicePath::PinnedStaging);
    let better = if same_host {
        format!("{} (or {staging})", taking(DevicePath::CopyEngine))
    } else {
        format!("{} or {staging}", taking(DevicePath::Rdma))
    };
    Some(format!(
        "rule \"{}\" sends device memory through {chosen}, which moves host memory only: device \
         buffers would cross host memory (~{PINNED_GBPS} GB/s pinned) and the socket stack \
         instead of the copy engine (~{COPY_ENGINE_GBPS} GB/s between H200 GPUs); list {better} \
         before {chosen}",
        rule.name
    ))
}

/// What to say about GPU transports when device memory is involved. Pure.
pub fn gpu_note(probe: &CudaProbe, catalog: &[(Capabilities, Viability)]) -> String {
    let unbuilt: Vec<&str> = catalog
        .iter()
        .filter(|(c, v)| c.memory.contains(&MemoryClass::Device) && *v != Viability::Viable)
        .map(|(c, _)| c.name.as_str())
        .collect();
    let any_viable = catalog
        .iter()
        .any(|(c, v)| c.memory.contains(&MemoryClass::Device) && *v == Viability::Viable);
    let driver = match probe {
        CudaProbe::NoDriver => Some("no CUDA driver on this machine".to_string()),
        CudaProbe::Failed { error, .. } => Some(format!("the CUDA driver does not work ({error})")),
        CudaProbe::Ready(d) if d.devices.is_empty() => Some("no GPU is visible".to_string()),
        CudaProbe::Ready(_) => None,
    };
    match (driver, any_viable) {
        (Some(why), _) if unbuilt.is_empty() => {
            format!("GPU transports are not available: {why}")
        }
        (Some(why), _) => format!(
            "GPU transports are not available: {why} (and {} not viable in this build)",
            unbuilt.join(", ")
        ),
        (None, false) => format!(
            "GPU transports are not available: {} not viable in this build",
            unbuilt.join(", ")
        ),
        (None, true) => "GPU transports are available".to_string(),
    }
}

/// What the transports the matching rule names say of the route, for a node with
/// `config` (each asked once, in the rule's order; `rdma`: this machine has an RDMA
/// device). Not pure: a transport may load its library to say which release it is.
pub fn route_notes(
    config: &ferry::Config,
    rules: &[Rule],
    explanation: &Explanation,
    rdma: bool,
) -> Vec<Note> {
    let Some(rule) = explanation.rule.as_ref().and_then(|(i, _)| rules.get(*i)) else {
        return Vec::new();
    };
    let q = &explanation.query;
    let chosen = explanation.chosen.as_ref();
    rule.transports
        .iter()
        .filter_map(|&name| ferry_transports::registry::kind(name).map(|k| (name, k)))
        .flat_map(|(name, kind)| {
            let route = Route {
                locality: q.locality,
                src: q.src,
                landing: chosen.map_or(q.dst, |r| r.landing),
                chosen: chosen.is_some_and(|r| r.transport == name),
                rdma_device: rdma,
            };
            kind.notes(config, &route)
        })
        .collect()
}

/// What `ferry explain` prints, as text or JSON.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    peer: String,
    bytes: u64,
    src: String,
    dst: String,
    /// Where `dst` came from: `dst-memory` (asked), `peer` (its hello) or `assumed` (no link).
    #[serde(serialize_with = "dst_from_key")]
    dst_from: DstSource,
    layout: Layout,
    locality: String,
    setup: SetupReport,
    earlier_rules: Vec<RuleMiss>,
    rule: Option<RuleRef>,
    skipped: Vec<Skip>,
    chosen: Option<Chosen>,
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu: Option<String>,
    /// What the transports the rule names say of the route ([`Note::Fact`]), each under
    /// its own key.
    #[serde(flatten)]
    notes: serde_json::Map<String, serde_json::Value>,
    /// The same, as labelled lines, in the order they came.
    #[serde(skip)]
    note_lines: Vec<(String, String)>,
    warnings: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
struct SetupReport {
    attempted: bool,
    connected: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
struct RuleRef {
    index: usize,
    name: String,
}

#[derive(Debug, Clone, Serialize)]
struct Chosen {
    transport: String,
    direction: String,
    /// Where the bytes land at the peer: `dst`, or host memory for a transport that cannot
    /// land there.
    landing: String,
}

/// How the JSON report names where the destination memory came from.
fn dst_from_key<S: serde::Serializer>(from: &DstSource, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(match from {
        DstSource::Asked => "dst-memory",
        DstSource::Peer => "peer",
        DstSource::Assumed => "assumed",
    })
}

impl Report {
    fn new(
        args: &Args,
        rules: &[Rule],
        e: &Explanation,
        setup: Setup,
        gpu: Option<String>,
    ) -> Self {
        let setup = match setup {
            Setup::NotTried => SetupReport {
                attempted: false,
                connected: false,
                error: None,
            },
            Setup::Connected => SetupReport {
                attempted: true,
                connected: true,
                error: None,
            },
            Setup::Failed(error) => SetupReport {
                attempted: true,
                connected: false,
                error: Some(error),
            },
        };
        Self {
            peer: args.peer.clone(),
            bytes: e.query.bytes,
            src: e.query.src.to_string(),
            dst: e.query.dst.to_string(),
            dst_from: e.query.dst_from,
            layout: args.layout,
            locality: e.query.locality.to_string(),
            setup,
            earlier_rules: rule_misses(rules, &e.query),
            rule: e.rule.as_ref().map(|(index, name)| RuleRef {
                index: *index,
                name: name.clone(),
            }),
            skipped: e.skipped.iter().map(|(t, why)| skip(*t, why)).collect(),
            chosen: e.chosen.as_ref().map(|r| Chosen {
                transport: r.transport.to_string(),
                direction: r.direction.to_string(),
                landing: r.landing.to_string(),
            }),
            gpu,
            notes: serde_json::Map::new(),
            note_lines: Vec::new(),
            warnings: performance_warnings(e, rules),
        }
    }

    /// Adds what transports said of the route: facts as lines (and under their keys in
    /// JSON), warnings with the others.
    fn add_notes(&mut self, notes: Vec<Note>) {
        for note in notes {
            match note {
                Note::Fact { label, text, json } => {
                    self.notes.insert(Note::json_key(&label), json);
                    self.note_lines.push((label, text));
                }
                Note::Warning(text) => self.warnings.push(text),
                _ => {}
            }
        }
    }

    /// The human form: a header, then one labelled, aligned line per fact.
    fn render(&self) -> String {
        let mut lines: Vec<(String, String)> = Vec::new();
        let mut line = |label: &str, text: String| lines.push((label.to_string(), text));
        match (&self.setup.attempted, &self.setup.error) {
            (false, _) => line(
                "link",
                "not tried (--no-connect): from this side's declarations only".into(),
            ),
            (true, None) => line("link", format!("connected to {}", self.peer)),
            (true, Some(error)) => line(
                "link",
                format!(
                    "setup failed: {error}; the route below is from this side's declarations only"
                ),
            ),
        }
        let from = match self.dst_from {
            DstSource::Asked => "asked for with --dst-memory".to_string(),
            other => other.to_string(),
        };
        line("dst", format!("{} memory: {from}", self.dst));
        for miss in &self.earlier_rules {
            line(
                &format!("rule #{}", miss.index),
                format!(
                    "\"{}\" did not match: {}",
                    miss.name,
                    miss.reasons.join("; ")
                ),
            );
        }
        match &self.rule {
            Some(r) => line(
                &format!("rule #{}", r.index),
                format!("\"{}\" matched", r.name),
            ),
            None => line("rule", "no rule matches this transfer".into()),
        }
        for s in &self.skipped {
            line("skipped", format!("{}: {}", s.transport, s.reason));
        }
        match &self.chosen {
            Some(c) if c.landing != self.dst => line(
                "chosen",
                format!(
                    "{}, {}; lands in {} memory: {} cannot land in {} memory",
                    c.transport, c.direction, c.landing, c.transport, self.dst
                ),
            ),
            Some(c) => line("chosen", format!("{}, {}", c.transport, c.direction)),
            None if self.rule.is_some() => line(
                "chosen",
                "none: no transport of the rule can carry it".into(),
            ),
            None => line("chosen", "none: add a rule that matches it".into()),
        }
        if let Some(gpu) = &self.gpu {
            line("gpu", gpu.clone());
        }
        for (label, text) in &self.note_lines {
            line(label, text.clone());
        }
        for w in &self.warnings {
            line("warning", w.clone());
        }
        let width = lines.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
        let mut out = format!(
            "ferry explain: {} {} -> {} to peer {} ({}), {}\n",
            format_size(self.bytes),
            self.src,
            self.dst,
            self.peer,
            self.locality,
            "contiguous"
        );
        for (label, text) in lines {
            out.push_str(&format!("  {label:<width$}  {text}\n"));
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use ferry_actors::core::route::choose;
    use ferry_config::Direction;
    use ferry_transports::registry::catalog;

    /// The catalog of a machine without a CUDA driver, whatever this machine has.
    pub(crate) fn host_only_catalog() -> Vec<(Capabilities, Viability)> {
        let mut out = catalog();
        for (caps, v) in &mut out {
            if caps.name == TransportName::Ipc {
                *v = Viability::NotViable("no CUDA driver: GPU transports disabled".into());
            }
        }
        out
    }

    fn rule(name: &str, transports: Vec<TransportName>) -> Rule {
        Rule {
            name: name.into(),
            transports,
            ..Rule::catch_all()
        }
    }

    fn query(src: MemoryClass, dst: MemoryClass, locality: Locality) -> RouteQuery {
        RouteQuery {
            locality,
            src,
            dst,
            dst_from: DstSource::Asked,
            bytes: 1 << 20,
        }
    }

    #[test]
    fn sizes_take_bare_binary_suffixes() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64K"), Ok(64 << 10));
        assert_eq!(parse_bytes("1m"), Ok(1 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("1MB"), Ok(1_000_000));
        assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
        assert!(parse_bytes("K").is_err());
        assert!(parse_bytes("lots").is_err());
    }

    #[test]
    fn earlier_rules_say_which_condition_failed() {
        let mut small = rule("small", vec![TransportName::Tcp]);
        small.max_bytes = Some(64 << 10);
        let mut remote = rule("remote", vec![TransportName::Tcp]);
        remote.locality = vec![Locality::Remote];
        remote.src = vec![MemoryClass::Device];
        let mut big = rule("big", vec![TransportName::Tcp]);
        big.min_bytes = 1 << 30;
        let rules = vec![small, remote, big, rule("host", vec![TransportName::Tcp])];
        let q = query(MemoryClass::Host, MemoryClass::Host, Locality::SameHost);
        let misses = rule_misses(&rules, &q);
        assert_eq!(misses.len(), 3);
        assert_eq!(misses[0].reasons, ["size 1 MiB above max_bytes 64 KiB"]);
        assert_eq!(
            misses[1].reasons,
            [
                "locality same-host not in remote",
                "source memory host not in device"
            ]
        );
        assert_eq!(misses[2].reasons, ["size 1 MiB below min_bytes 1 GiB"]);
        // No rule matches: every rule is a miss.
        assert_eq!(rule_misses(&rules[..3], &q).len(), 3);
    }

    #[test]
    fn skip_reasons_are_classified() {
        let e = choose(
            &[rule("x", vec![TransportName::Ipc, TransportName::Tcp])],
            &catalog(),
            Some(&[TransportName::Ipc]),
            query(MemoryClass::Host, MemoryClass::Host, Locality::SameHost),
        );
        let kinds: Vec<_> = e.skipped.iter().map(|(t, w)| skip(*t, w).kind).collect();
        // ipc: not viable without a GPU, or unable to read host memory with one.
        assert!(
            kinds == ["not-viable", "peer-lacks"] || kinds == ["capabilities", "peer-lacks"],
            "{kinds:?}"
        );
        let d = skip(
            TransportName::Tcp,
            &Unsuitable::Direction(Some(Direction::Pull)),
        );
        assert_eq!(d.kind, "capabilities");
        assert!(d.reason.contains("does not support pull"), "{}", d.reason);
        let v = skip(TransportName::Ipc, &Unsuitable::NotViable("no GPU".into()));
        assert_eq!(v.reason, "not viable on this machine: no GPU");
    }

    #[test]
    fn device_memory_through_tcp_warns_with_figures() {
        let rules = vec![rule("host", vec![TransportName::Tcp])];
        let e = choose(
            &rules,
            &catalog(),
            None,
            query(MemoryClass::Device, MemoryClass::Device, Locality::SameHost),
        );
        // tcp carries it, landing in the peer's host memory.
        let chosen = e.chosen.as_ref().map(|r| (r.transport, r.landing));
        assert_eq!(chosen, Some((TransportName::Tcp, MemoryClass::Host)));
        let w = performance_warnings(&e, &rules);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(
            w[0].contains("device memory goes over tcp")
                && w[0].contains("396 GB/s")
                && w[0].contains("55 GB/s"),
            "{}",
            w[0]
        );
        assert!(w[1].contains("list ipc (or staged) before tcp"), "{}", w[1]);
        // Host memory over tcp is what tcp is for.
        let e = choose(
            &rules,
            &catalog(),
            None,
            query(MemoryClass::Host, MemoryClass::Host, Locality::SameHost),
        );
        assert!(performance_warnings(&e, &rules).is_empty());
        // So is host memory to a peer that receives into device memory: over tcp it lands
        // in the peer's host memory, and no device memory moves.
        let e = choose(
            &rules,
            &catalog(),
            None,
            query(MemoryClass::Host, MemoryClass::Device, Locality::SameHost),
        );
        assert!(performance_warnings(&e, &rules).is_empty());
    }

    #[test]
    fn device_memory_over_ucx_without_rdma_warns() {
        let rules = vec![rule("remote-gpu", vec![TransportName::Ucx])];
        // A UCX built with CUDA (the wheels'): ucx declares device memory.
        let catalog: Vec<_> = catalog()
            .into_iter()
            .map(|(mut caps, _)| {
                if caps.name == TransportName::Ucx {
                    caps.sources = &[MemoryClass::Host, MemoryClass::Device];
                    caps.memory = &[MemoryClass::Host, MemoryClass::Device];
                }
                (caps, Viability::Viable)
            })
            .collect();
        let e = choose(
            &rules,
            &catalog,
            None,
            query(MemoryClass::Device, MemoryClass::Device, Locality::Remote),
        );
        assert_eq!(
            e.chosen.as_ref().map(|r| r.transport),
            Some(TransportName::Ucx)
        );
        // The declared path says nothing of its own: what RDMA's library does without an
        // RDMA device is the transport's note.
        assert!(performance_warnings(&e, &rules).is_empty());
        let config = ferry::Config::default();
        let warnings = |rdma| {
            route_notes(&config, &rules, &e, rdma)
                .into_iter()
                .filter_map(|n| match n {
                    Note::Warning(w) => Some(w),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        let w = warnings(false);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("without an RDMA device") && w[0].contains("0.4 GB/s"),
            "{}",
            w[0]
        );
        // With an RDMA device the NIC can read GPU memory: nothing to say.
        assert!(warnings(true).is_empty());
    }

    #[test]
    fn the_report_says_which_dst_was_used_where_it_came_from_and_where_bytes_land() {
        let args = Args {
            peer: "b".into(),
            bytes: 1 << 20,
            memory: MemoryClass::Host,
            dst_memory: None,
            layout: Layout::Contiguous,
            connect: true,
            no_connect: false,
            json: false,
        };
        let rules = vec![Rule::catch_all()];
        let report = |dst, dst_from| {
            let q = RouteQuery {
                dst_from,
                ..query(MemoryClass::Host, dst, Locality::SameHost)
            };
            let e = choose(&rules, &catalog(), None, q);
            Report::new(&args, &rules, &e, Setup::Connected, None)
        };
        let peer = report(MemoryClass::Device, DstSource::Peer);
        let text = peer.render();
        assert!(
            text.contains("dst      device memory: what the peer receives into, from its hello"),
            "{text}"
        );
        assert!(
            text.contains("tcp, push; lands in host memory: tcp cannot land in device memory"),
            "{text}"
        );
        let json = serde_json::to_value(&peer).expect("json");
        assert_eq!(json["dst"], "device");
        assert_eq!(json["dst_from"], "peer");
        assert_eq!(json["chosen"]["landing"], "host");
        let asked = report(MemoryClass::Pinned, DstSource::Asked);
        let text = asked.render();
        assert!(
            text.contains("pinned memory: asked for with --dst-memory"),
            "{text}"
        );
        assert!(text.contains("tcp, push\n"), "{text}");
        assert_eq!(
            serde_json::to_value(&asked).expect("json")["dst_from"],
            "dst-memory"
        );
        let assumed = report(MemoryClass::Host, DstSource::Assumed).render();
        assert!(
            assumed.contains("host memory: assumed: without a link"),
            "{assumed}"
        );
    }

    #[test]
    fn staged_on_one_host_warns_that_ipc_would_be_faster() {
        let viable = |mut c: Vec<(Capabilities, Viability)>| {
            for (_, v) in &mut c {
                *v = Viability::Viable;
            }
            c
        };
        let mut catalog = viable(catalog());
        // ipc present but not viable here; staged works (and moves device memory, as it
        // declares where a CUDA driver works, whatever this machine has).
        for (caps, v) in &mut catalog {
            match caps.name {
                TransportName::Ipc => {
                    *v = Viability::NotViable("no peer access between the GPUs".into());
                }
                TransportName::Staged => {
                    const ANY: &[MemoryClass] =
                        &[MemoryClass::Host, MemoryClass::Pinned, MemoryClass::Device];
                    caps.sources = ANY;
                    caps.memory = ANY;
                }
                _ => {}
            }
        }
        let rules = vec![rule("gpu", vec![TransportName::Ipc, TransportName::Staged])];
        let e = choose(
            &rules,
            &catalog,
            None,
            query(MemoryClass::Device, MemoryClass::Device, Locality::SameHost),
        );
        assert_eq!(
            e.chosen.as_ref().map(|r| r.transport),
            Some(TransportName::Staged)
        );
        let w = performance_warnings(&e, &rules);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("ipc was passed over: not viable on this machine: no peer access"));
    }

    #[test]
    fn gpu_note_names_the_missing_driver_and_the_unbuilt_transports() {
        let note = gpu_note(&CudaProbe::NoDriver, &host_only_catalog());
        assert!(
            note.starts_with("GPU transports are not available: no CUDA driver"),
            "{note}"
        );
        // staged runs without a driver (host memory through its ring); ipc does not. ucx
        // declares device memory only where the UCX it loads moves CUDA memory.
        assert!(note.contains("(and ipc"), "{note}");
    }
}
