//! The Prometheus endpoint of `ferry serve` (`telemetry.metrics_listen`).
//!
//! The library records through the `metrics` facade only; this module installs the
//! Prometheus recorder for the process and serves its text rendering at `GET /metrics`.
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

/// Binds `listen` (`"IP:port"` or `"localhost:port"`, port 0 for any), installs the
/// Prometheus recorder as the process's global recorder, describes ferry's metrics and
/// serves them on the current tokio runtime. Returns the address it bound.
///
/// Call it once per process, before the node starts, so that nothing the node records is
/// lost. Fails if the address cannot be bound or a recorder is already installed.
pub async fn start(listen: &str) -> anyhow::Result<SocketAddr> {
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
    tokio::spawn(serve(listener, handle));
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

async fn serve(listener: TcpListener, handle: PrometheusHandle) {
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
        tokio::spawn(async move {
            let _ = tokio::time::timeout(REQUEST_TIMEOUT, answer(stream, &handle)).await;
            drop(permit);
        });
    }
}

/// Reads one request head and writes one response.
async fn answer(mut stream: TcpStream, handle: &PrometheusHandle) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() >= MAX_REQUEST {
            return respond(&mut stream, "431 Request Header Fields Too Large", "").await;
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
            respond(&mut stream, "200 OK", &handle.render()).await
        }
        (_, "/metrics") => respond(&mut stream, "405 Method Not Allowed", "").await,
        _ => respond(&mut stream, "404 Not Found", "try /metrics\n").await,
    }
}

async fn respond(stream: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
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
