//! `ferry serve`: run a node until SIGTERM or Ctrl-C, then drain and exit 0.
//!
//! Draining: `/readyz` turns 503 at once, the role takes no new buffer, the buffers it is
//! handling finish (each send ends by its deadline), then the node drains its transfers
//! ([`Node::shutdown`]) and the process exits 0.

use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;

use anyhow::Context;
use ferry::echo::{self, TAG_EXPOSE, TAG_WITHDRAW};
use ferry::{MemoryKind, Node, Received};
use tokio::sync::Semaphore;

use super::metrics_http::Health;

/// What a served node does with the buffers it receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Nothing: received buffers wait for an application that never asks (tests use this
    /// to fill a node's budget).
    None,
    /// Send every buffer back to its sender (see `ferry::echo`).
    Echo,
    /// Send every buffer on to this peer, same tag.
    Forward(String),
    /// Receive and drop.
    Sink,
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(Self::None),
            "echo" => Ok(Self::Echo),
            "sink" => Ok(Self::Sink),
            _ => match s.strip_prefix("forward=") {
                Some(peer) if !peer.is_empty() => Ok(Self::Forward(peer.to_string())),
                _ => Err(format!(
                    "unknown role {s:?}: expected none, echo, sink or forward=PEER"
                )),
            },
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Node name (overrides node.name).
    #[arg(long)]
    name: Option<String>,
    /// TCP listen address (overrides node.listen), e.g. 127.0.0.1:0.
    #[arg(long)]
    listen: Option<String>,
    /// What to do with received buffers: none, echo, sink or forward=PEER.
    #[arg(long, default_value = "none")]
    role: Role,
}

/// Buffers a role handles at once.
const ROLE_CONCURRENCY: usize = 32;

pub fn run(file: Option<PathBuf>, overrides: &[String], args: Args) -> anyhow::Result<ExitCode> {
    let mut extra = Vec::new();
    if let Some(name) = args.name {
        extra.push(("node.name".to_string(), name));
    }
    if let Some(listen) = args.listen {
        extra.push(("node.listen".to_string(), format!("[\"{listen}\"]")));
    }
    let config = super::load_config(file, overrides, extra)?;
    super::telemetry::init(&config.telemetry);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    runtime.block_on(serve(config, args.role))
}

async fn serve(config: ferry::Config, role: Role) -> anyhow::Result<ExitCode> {
    // Install the handlers before announcing readiness, so an early SIGTERM drains too.
    let stop = StopSignals::install()?;
    let health = Arc::new(Health::default());
    // The recorder goes in before the node starts, so nothing it records is lost.
    let metrics = match &config.telemetry.metrics_listen {
        Some(listen) => Some(super::metrics_http::start(listen, Arc::clone(&health)).await?),
        None => None,
    };
    let drain_limit = config.limits.default_deadline + DRAIN_MARGIN;
    let node = Arc::new(Node::start(config).await?);
    let mut endpoints = listeners(&node);
    if let Some(addr) = metrics {
        endpoints.push(format!("metrics http://{addr}/metrics"));
    }
    health.set_ready();
    // The ready line: scripts and tests wait for it.
    println!(
        "ferry serve: node {} ready on {}",
        node.name(),
        endpoints.join(", ")
    );
    let slots = Arc::new(Semaphore::new(ROLE_CONCURRENCY));
    let worker = (role != Role::None)
        .then(|| tokio::spawn(run_role(Arc::clone(&node), role, Arc::clone(&slots))));

    stop.wait().await?;
    health.set_draining();
    tracing::info!("stop requested: draining");
    if let Some(w) = worker {
        w.abort();
        let _ = w.await;
    }
    // The buffers the role is handling finish first (each send ends by its deadline, so
    // within `limits.default_deadline`); each holds the node until then.
    let handled = tokio::time::timeout(drain_limit, slots.acquire_many(ROLE_CONCURRENCY as u32));
    if !matches!(handled.await, Ok(Ok(_))) {
        tracing::warn!("drain: the role's buffers did not finish in time");
    }
    match Arc::try_unwrap(node) {
        Ok(node) => node.shutdown().await,
        Err(node) => drop(node),
    }
    Ok(ExitCode::SUCCESS)
}

/// How much longer than `limits.default_deadline` the role's buffers may take to finish
/// once a stop is asked for.
const DRAIN_MARGIN: std::time::Duration = std::time::Duration::from_secs(1);

/// SIGTERM and SIGINT, caught from the moment of installation.
struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("cannot install the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("cannot install the SIGINT handler")?,
        })
    }

    async fn wait(mut self) -> anyhow::Result<()> {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
        Ok(())
    }
}

/// Where the node listens, as the ready line names it: `tcp ADDRESS` for each TCP
/// listener (the socket protocol, not the transport), `unix PATH` for its Unix socket.
fn listeners(node: &Node) -> Vec<String> {
    let mut out: Vec<String> = node
        .tcp_addrs()
        .iter()
        .map(|a| format!("tcp {a}"))
        .collect();
    if let Some(path) = node.unix_path() {
        out.push(format!("unix {}", path.display()));
    }
    out
}

/// Receives buffers and handles them as `role` says, `ROLE_CONCURRENCY` at once: each
/// handling holds a permit of `slots` until it ended.
async fn run_role(node: Arc<Node>, role: Role, slots: Arc<Semaphore>) {
    loop {
        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let received = match node.recv(None, None).await {
            Ok(r) => r,
            Err(e) => {
                tracing::info!(error = %e, "role stops");
                return;
            }
        };
        let node = Arc::clone(&node);
        let role = role.clone();
        let mut handling = Box::pin(async move {
            if let Err(e) = handle(&node, &role, received).await {
                tracing::warn!(error = %e, "role could not handle a buffer");
            }
            // The node first: a drain that got every permit back then owns it alone.
            drop(node);
            drop(permit);
        });
        // Polled once here, before the next buffer is received: a send's place in its
        // peer's order is taken at its first poll, so buffers go on in the order they came
        // (a spawned task's first poll could come after a later one's).
        if futures::poll!(handling.as_mut()).is_pending() {
            tokio::spawn(handling);
        }
    }
}

async fn handle(node: &Node, role: &Role, got: Received) -> anyhow::Result<()> {
    let got = match role {
        Role::Echo => match echo::handle_publishing(node, got).await? {
            Some(got) => got,
            None => return Ok(()),
        },
        _ => got,
    };
    let Received {
        buffer, peer, tag, ..
    } = got;
    match role {
        Role::None | Role::Sink => Ok(()),
        Role::Forward(next) => {
            node.send(next, tag, buffer).await?;
            Ok(())
        }
        Role::Echo if tag == TAG_EXPOSE => {
            let len = buffer
                .bytes()?
                .as_ref()
                .try_into()
                .map(u64::from_le_bytes)
                .map_err(|_| anyhow::anyhow!("expose request of {} bytes, want 8", buffer.len()))?;
            let region = node.alloc(MemoryKind::Host, usize::try_from(len)?).await?;
            let key = node.expose(region);
            let mut reply = node.alloc(MemoryKind::Host, 24).await?;
            reply
                .as_mut_slice()
                .context("fresh buffer is shared")?
                .copy_from_slice(&echo::encode_key(key));
            node.send(&peer, TAG_EXPOSE, reply).await?;
            Ok(())
        }
        Role::Echo if tag == TAG_WITHDRAW => {
            let key = echo::decode_key(&buffer.bytes()?)
                .ok_or_else(|| anyhow::anyhow!("withdraw request is not a 24-byte key"))?;
            let region = node.withdraw(key)?;
            node.send(&peer, TAG_WITHDRAW, region).await?;
            Ok(())
        }
        Role::Echo => {
            node.send(&peer, tag, buffer).await?;
            Ok(())
        }
    }
}
