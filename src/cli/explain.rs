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
mod report;
mod rules;
mod warnings;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use ferry::{Explanation, Node};
use ferry_config::{MemoryClass, Rule, parse_size};
use ferry_transports::cuda;
use ferry_transports::transport::{Note, Route};
use serde::Serialize;

pub use report::Report;
pub use rules::{RuleMiss, Skip, rule_misses, skip};
pub use warnings::{gpu_note, performance_warnings};

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
    let rdma = ferry_transports::transport::has_rdma_device();
    report.add_notes(route_notes(&loaded, &rules, &explanation, rdma));
    report.add_notes(live);
    let text = if args.json {
        serde_json::to_string_pretty(&report)? + "\n"
    } else {
        report.render()
    };
    // A closed pipe (`ferry explain ... | head`) is not an error worth a panic.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
    Ok(if report.has_route() {
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use ferry_actors::core::route::{DstSource, RouteQuery, choose};
    use ferry_config::Direction;
    use ferry_config::{Locality, TransportName};
    use ferry_transports::cuda::CudaProbe;
    use ferry_transports::registry::catalog;
    use ferry_transports::transport::{Capabilities, Unsuitable, Viability};

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
