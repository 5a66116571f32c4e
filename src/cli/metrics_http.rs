//! The Prometheus and health endpoints of `ferry serve` (`telemetry.metrics_listen`).
//!
//! The library records through the `metrics` facade only; this module installs the
//! Prometheus recorder for the process and serves its text rendering at `GET /metrics`.
//! Beside it, for probes (Kubernetes' liveness and readiness): `GET /healthz` answers 200
//! whenever the process's event loop runs (this answer is made on it), and `GET /readyz`
//! answers 200 once the node started (its listeners bound, its GPUs opened, its
//! configuration valid) and 503 before that and from the moment a stop is asked for (while
//! the node drains); see [`Health`].
//! The listener is a few lines over tokio rather than the exporter's hyper listener, so it
//! binds before the node starts (a bad address fails start-up), supports port 0, and
//! reports the address it really bound for the ready line.
//!
//! Every connection gets one answer and is closed; a request head larger than
//! [`MAX_REQUEST`] or slower than [`REQUEST_TIMEOUT`] is dropped, and at most
//! [`MAX_CONNECTIONS`] are served at once, so a scraper that misbehaves costs a socket,
//! not the node.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use anyhow::Context;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Largest request head read, in bytes.
const MAX_REQUEST: usize = 8 * 1024;
/// Time a client has to send its request head and read the answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; more wait in the kernel's accept queue.
const MAX_CONNECTIONS: usize = 16;
/// How often histograms are drained even when nobody scrapes.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);
/// Buckets of `ferry_transfer_duration_seconds`: 10 µs to 100 s.
const DURATION_BUCKETS: [f64; 15] = [
    1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0,
];

/// Content type of the Prometheus text format.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
/// Content type of every other answer.
const PLAIN_TEXT: &str = "text/plain; charset=utf-8";

/// Where the served node is in its life, as `/readyz` reports it. Starts as starting;
/// `ferry serve` marks it ready once the node started and draining once a stop was asked
/// for. Shared between the server task and `ferry serve`; lock-free.
#[derive(Debug, Default)]
pub struct Health {
    phase: AtomicU8,
}

/// The phases of [`Health`], in the order they come.
const STARTING: u8 = 0;
const READY: u8 = 1;
const DRAINING: u8 = 2;

impl Health {
    /// The node started: listeners bound, GPUs opened, configuration valid.
    pub fn set_ready(&self) {
        // Never back from draining to ready.
        let _ = self
            .phase
            .compare_exchange(STARTING, READY, Ordering::AcqRel, Ordering::Acquire);
    }

    /// A stop was asked for: the node takes no new work and drains.
    pub fn set_draining(&self) {
        self.phase.store(DRAINING, Ordering::Release);
    }

    /// `/readyz`'s answer: its status line and body.
    fn readiness(&self) -> (&'static str, &'static str) {
        match self.phase.load(Ordering::Acquire) {
            READY => ("200 OK", "ready\n"),
            DRAINING => ("503 Service Unavailable", "draining\n"),
            _ => ("503 Service Unavailable", "starting\n"),
        }
    }
}

/// Binds `listen` (`"IP:port"` or `"localhost:port"`, port 0 for any), installs the
/// Prometheus recorder as the process's global recorder, describes ferry's metrics and
/// serves them, with `/healthz` and `/readyz` (answered from `health`), on the current
/// tokio runtime. Returns the address it bound.
///
/// Call it once per process, before the node starts, so that nothing the node records is
/// lost. Fails if the address cannot be bound or a recorder is already installed.
pub async fn start(listen: &str, health: Arc<Health>) -> anyhow::Result<SocketAddr> {
    let addr = parse(listen)?;
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("telemetry.metrics_listen: cannot listen on {listen}"))?;
    let bound = listener.local_addr().context("metrics listener address")?;
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("ferry_transfer_duration_seconds".into()),
            &DURATION_BUCKETS,
        )
        .context("metrics histogram buckets")?
        .install_recorder()
        .context("cannot install the metrics recorder")?;
    ferry_actors::coordinator::describe_metrics();

    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(UPKEEP_EVERY);
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    tokio::spawn(serve(listener, handle, health));
    tracing::info!(%bound, "metrics endpoint listening");
    Ok(bound)
}

/// `"IP:port"`, `"[IPv6]:port"` or `"localhost:port"` (loopback, IPv4); the configuration
/// has already refused anything else, but a clear error beats a panic.
fn parse(listen: &str) -> anyhow::Result<SocketAddr> {
    if let Ok(addr) = listen.parse::<SocketAddr>() {
        return Ok(addr);
    }
    match listen.rsplit_once(':') {
        Some((host, port)) if host.eq_ignore_ascii_case("localhost") => {
            let port: u16 = port
                .parse()
                .with_context(|| format!("telemetry.metrics_listen {listen:?}: bad port"))?;
            Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
        }
        _ => anyhow::bail!(
            "telemetry.metrics_listen {listen:?}: expected \"IP:port\" or \"localhost:port\""
        ),
    }
}

async fn serve(listener: TcpListener, handle: PrometheusHandle, health: Arc<Health>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors, usually: wait a little rather than spin.
                tracing::warn!(error = %e, "metrics endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let handle = handle.clone();
        let health = Arc::clone(&health);
        tokio::spawn(async move {
            let _ = tokio::time::timeout(REQUEST_TIMEOUT, answer(stream, &handle, &health)).await;
            drop(permit);
        });
    }
}

/// Reads one request head and writes one response.
async fn answer(
    mut stream: TcpStream,
    handle: &PrometheusHandle,
    health: &Health,
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() >= MAX_REQUEST {
            return respond(
                &mut stream,
                "431 Request Header Fields Too Large",
                PLAIN_TEXT,
                "",
            )
            .await;
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&chunk[..n]);
    }
    let line = head
        .split(|&b| b == b'\r')
        .next()
        .map(String::from_utf8_lossy)
        .unwrap_or_default();
    let mut parts = line.split(' ');
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => {
            handle.run_upkeep();
            respond(&mut stream, "200 OK", PROMETHEUS_TEXT, &handle.render()).await
        }
        ("GET", "/healthz") => respond(&mut stream, "200 OK", PLAIN_TEXT, "ok\n").await,
        ("GET", "/readyz") => {
            let (status, body) = health.readiness();
            respond(&mut stream, status, PLAIN_TEXT, body).await
        }
        (_, "/metrics" | "/healthz" | "/readyz") => {
            respond(&mut stream, "405 Method Not Allowed", PLAIN_TEXT, "").await
        }
        _ => {
            let hint = "try /metrics, /healthz or /readyz\n";
            respond(&mut stream, "404 Not Found", PLAIN_TEXT, hint).await
        }
    }
}

async fn respond(
    stream: &mut TcpStream,
    status: &str,
    content_type: &str,
    body: &str,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `GET path` over a real socket to `addr`: the whole answer.
    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let request = format!("GET {path} HTTP/1.1\r\nHost: ferry\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.expect("read");
        answer
    }

    #[tokio::test]
    async fn readiness_follows_the_phase_and_liveness_is_always_ok() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let health = Arc::new(Health::default());
        let handle = PrometheusBuilder::new().build_recorder().handle();
        tokio::spawn(serve(listener, handle, Arc::clone(&health)));
        let expect = async |path: &str, status: &str, body: &str| {
            let answer = get(addr, path).await;
            assert!(
                answer.starts_with(&format!("HTTP/1.1 {status}")),
                "{path}: {answer}"
            );
            assert!(
                answer.ends_with(&format!("\r\n\r\n{body}")),
                "{path}: {answer}"
            );
        };
        expect("/readyz", "503", "starting\n").await;
        expect("/healthz", "200", "ok\n").await;
        health.set_ready();
        expect("/readyz", "200", "ready\n").await;
        expect("/readyz?verbose", "200", "ready\n").await;
        health.set_draining();
        expect("/readyz", "503", "draining\n").await;
        expect("/healthz", "200", "ok\n").await;
        // Draining is final.
        health.set_ready();
        expect("/readyz", "503", "draining\n").await;
    }

    #[test]
    fn listen_addresses() {
        assert_eq!(
            parse("127.0.0.1:9464").ok(),
            Some(SocketAddr::from(([127, 0, 0, 1], 9464)))
        );
        assert_eq!(
            parse("localhost:0").ok(),
            Some(SocketAddr::from(([127, 0, 0, 1], 0)))
        );
        assert!(parse("[::1]:9464").is_ok());
        assert!(parse("example.com:9464").is_err());
        assert!(parse("localhost:http").is_err());
    }
}
