//! The Prometheus endpoint of a real `ferry serve`: it is scraped after transfers and holds
//! the transfer counters, the memory gauges and the frames it rejected; a bad
//! `telemetry.metrics_listen` is refused before anything starts. Beside it, the health
//! probes: `/healthz` while the process runs, `/readyz` once the node started and until a
//! stop is asked for.

mod common;

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{Scratch, Served, eventually, http_get, patterned};
use ferry::Node;
use ferry_transports::link::{self, Endpoint, LinkCounters, LinkOptions, Secret};

/// `GET /metrics` over a plain socket; the body of a 200 answer.
fn scrape(addr: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to the metrics endpoint");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: ferry\r\nConnection: close\r\n\r\n")
        .expect("request");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("answer");
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "answer head {head:?}");
    assert!(head.contains("text/plain"), "answer head {head:?}");
    body.to_string()
}

/// The value of the sample `name{labels}` (labels exactly as rendered, sorted by the
/// exporter; empty for none), if present.
fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// Starts `ferry serve --config FILE --role ROLE` whose configuration has a
/// `metrics_listen`; returns it with the metrics address from its ready line
/// (`..., metrics http://ADDR/metrics`).
fn serve_with_metrics(config: &Path, role: &str) -> (Served, String) {
    let served = Served::start(config, role);
    let metrics = served
        .ready
        .split("metrics http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| panic!("no metrics address in ready line {:?}", served.ready));
    (served, metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_holds_the_counters_after_transfers() {
    let scratch = Scratch::new();
    // Port 0: the ready line says which port the endpoint got.
    let echo_cfg = scratch.write(
        "echo.toml",
        &scratch.toml(
            "echo",
            &[],
            "[telemetry]\nmetrics_listen = \"127.0.0.1:0\"\n",
        ),
    );
    let (echo, addr) = serve_with_metrics(&echo_cfg, "echo");

    // Before any transfer (the ready line has been printed): the quiet counters are
    // registered at 0 and the gauges are present.
    let body = scrape(&addr);
    for help in [
        "# HELP ferry_failover_total",
        "# HELP ferry_spill_bytes_total",
        "# TYPE ferry_memory_granted_bytes gauge",
    ] {
        assert!(body.contains(help), "{help:?} missing from\n{body}");
    }
    assert_eq!(
        sample(&body, "ferry_failover_total{from=\"ipc\",to=\"staged\"}"),
        Some(0.0),
        "{body}"
    );
    assert_eq!(
        sample(&body, "ferry_spill_bytes_total"),
        Some(0.0),
        "{body}"
    );
    assert!(
        sample(&body, "ferry_memory_budget_bytes{domain=\"host\"}").is_some_and(|v| v > 0.0),
        "{body}"
    );

    // A few buffers there and back: the echo node sends each one back, so its own
    // outbound counters move.
    let node = Node::start(scratch.config("test", &[("echo", &echo.addr)], ""))
        .await
        .expect("node starts");
    let sizes = [1usize, 4096, 100_000, 1 << 20];
    let total: usize = sizes.iter().sum();
    for (tag, &len) in sizes.iter().enumerate() {
        let buffer = patterned(&node, len, tag as u64).await;
        node.send("echo", tag as u64, buffer).await.expect("send");
        let got = node
            .recv(Some("echo"), Some(tag as u64))
            .await
            .expect("echo");
        assert_eq!(got.buffer.len(), len);
    }

    // One garbage frame over an authenticated link.
    let secret = Secret::new(std::fs::read(&scratch.secret).expect("secret"));
    let opts = LinkOptions {
        max_frame: 4 << 20,
        handshake_timeout: Duration::from_secs(2),
        stall_timeout: Duration::from_secs(2),
        counters: Arc::new(LinkCounters::new()),
    };
    let hello = link::local_hello("rogue", vec![ferry::TransportName::Tcp], 4 << 20);
    let mut rogue = link::dial(&Endpoint::Tcp(echo.addr.clone()), &secret, hello, &opts)
        .await
        .expect("authenticated dial");
    rogue
        .writer
        .danger_send_raw(&[0xA5u8; 64])
        .await
        .expect("send garbage");

    // The echo's send completes when our node's Done reaches it: wait for the counters
    // rather than assume they are there at once.
    let mut body = String::new();
    let counted = eventually(Duration::from_secs(5), async || {
        body = scrape(&addr);
        sample(&body, "ferry_transfers_total{status=\"completed\"}")
            .is_some_and(|n| n >= sizes.len() as f64)
            && sample(&body, "ferry_frames_rejected_total{reason=\"bad_magic\"}")
                .is_some_and(|n| n >= 1.0)
    })
    .await;
    assert!(counted, "counters did not arrive:\n{body}");
    drop(rogue);

    for help in [
        "# HELP ferry_transfer_bytes_total",
        "# TYPE ferry_transfer_duration_seconds histogram",
    ] {
        assert!(body.contains(help), "{help:?} missing from\n{body}");
    }
    // Same-host host memory goes by shm (the small ones on its lane, counted alike).
    let bytes = sample(
        &body,
        "ferry_transfer_bytes_total{transport=\"shm\",direction=\"pull\",peer_class=\"same_host\"}",
    );
    assert_eq!(bytes, Some(total as f64), "{body}");
    assert!(
        !body.contains("peer_class=\"any\""),
        "placeholder label left:\n{body}"
    );
    assert_eq!(
        sample(&body, "ferry_transfer_duration_seconds_count"),
        Some(sizes.len() as f64),
        "{body}"
    );
    assert!(
        body.contains("ferry_transfer_duration_seconds_bucket{le=\"+Inf\"}"),
        "duration is not a histogram:\n{body}"
    );
    for gauge in [
        "ferry_memory_granted_bytes{domain=\"host\"}",
        "ferry_memory_free_bytes{domain=\"host\"}",
        "ferry_memory_budget_bytes{domain=\"host\"}",
        "ferry_memory_kept_bytes{domain=\"host\"}",
        "ferry_reservations_waiting{domain=\"host\"}",
    ] {
        assert!(sample(&body, gauge).is_some(), "{gauge} missing:\n{body}");
    }
    assert_eq!(
        sample(&body, "ferry_transfers_total{status=\"failed\"}"),
        Some(0.0),
        "{body}"
    );
    // No label names a transfer or an address.
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        assert!(
            !line.contains("127.0.0.1") && !line.contains("peer=") && !line.contains("id="),
            "high-cardinality label in {line:?}"
        );
    }
    node.shutdown().await;
}

#[test]
fn metrics_endpoint_answers_only_get_metrics() {
    let scratch = Scratch::new();
    let cfg = scratch.write(
        "n.toml",
        &scratch.toml("n", &[], "[telemetry]\nmetrics_listen = \"localhost:0\"\n"),
    );
    let (_served, addr) = serve_with_metrics(&cfg, "none");
    let ask = |request: &[u8]| {
        let mut s = std::net::TcpStream::connect(&addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s.write_all(request).expect("request");
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    };
    assert!(ask(b"GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
    assert!(ask(b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    // A request head that never ends is cut off, and the endpoint still serves.
    assert!(ask(&vec![b'x'; 20_000]).starts_with("HTTP/1.1 431"));
    assert!(scrape(&addr).contains("ferry_transfers_total"));
}

#[test]
fn invalid_metrics_listen_is_refused_before_start() {
    let scratch = Scratch::new();
    for bad in ["nowhere", "metrics.example.com:9464", "127.0.0.1:99999"] {
        let cfg = scratch.write(
            "bad.toml",
            &scratch.toml(
                "n",
                &[],
                &format!("[telemetry]\nmetrics_listen = \"{bad}\"\n"),
            ),
        );
        let out = Command::new(common::ferry_bin())
            .args(["serve", "--config"])
            .arg(&cfg)
            .stdin(Stdio::null())
            .output()
            .expect("run ferry serve");
        assert!(!out.status.success(), "{bad:?} accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("telemetry.metrics_listen"),
            "{bad:?}: error does not name the key: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{bad:?}: printed a ready line");
    }
}

#[test]
fn metrics_address_in_use_fails_start_up() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let scratch = Scratch::new();
    let cfg = scratch.write(
        "n.toml",
        &scratch.toml(
            "n",
            &[],
            &format!("[telemetry]\nmetrics_listen = \"127.0.0.1:{port}\"\n"),
        ),
    );
    let out = Command::new(common::ferry_bin())
        .args(["serve", "--config"])
        .arg(&cfg)
        .stdin(Stdio::null())
        .output()
        .expect("run ferry serve");
    assert!(!out.status.success(), "started on a port in use");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("metrics_listen"), "{stderr}");
}

#[test]
fn json_logs_go_to_stderr_and_the_ready_line_to_stdout() {
    let scratch = Scratch::new();
    let cfg = scratch.write(
        "n.toml",
        &scratch.toml(
            "n",
            &[],
            "[telemetry]\nlog_format = \"json\"\nlog_level = \"info\"\n",
        ),
    );
    let mut child = Command::new(common::ferry_bin())
        .args(["serve", "--config"])
        .arg(&cfg)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut stdout = child.stdout.take().expect("stdout");
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while stdout.read(&mut byte).unwrap_or(0) == 1 && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    let line = String::from_utf8_lossy(&line).to_string();
    assert!(
        line.starts_with("ferry serve: node n ready on tcp "),
        "{line:?}"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let out = child.wait_with_output().expect("wait");
    assert!(out.status.success());
    assert!(out.stdout.is_empty(), "more than the ready line on stdout");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty(), "no log lines");
    for l in lines {
        assert!(
            l.starts_with('{') && l.ends_with('}') && l.contains("\"level\""),
            "not a JSON log line: {l:?}"
        );
    }
}

#[test]
fn health_endpoints_of_a_running_node() {
    let scratch = Scratch::new();
    let cfg = scratch.write(
        "n.toml",
        &scratch.toml("n", &[], "[telemetry]\nmetrics_listen = \"localhost:0\"\n"),
    );
    let (_served, addr) = serve_with_metrics(&cfg, "echo");
    // The ready line is printed once the node started: ready from then on.
    assert_eq!(http_get(&addr, "/healthz"), Some((200, "ok\n".into())));
    assert_eq!(http_get(&addr, "/readyz"), Some((200, "ready\n".into())));
    assert_eq!(
        http_get(&addr, "/readyz?full=1"),
        Some((200, "ready\n".into()))
    );
    let ask = |request: &[u8]| {
        let mut s = std::net::TcpStream::connect(&addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s.write_all(request).expect("request");
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    };
    for path in ["/healthz", "/readyz"] {
        let answer = ask(format!("POST {path} HTTP/1.1\r\n\r\n").as_bytes());
        assert!(answer.starts_with("HTTP/1.1 405"), "POST {path}: {answer}");
    }
    let answer = ask(b"GET /health HTTP/1.1\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    assert!(
        answer.contains("/readyz"),
        "the 404 names the paths: {answer}"
    );
}

/// After SIGTERM, `/readyz` answers 503 `draining` while `/healthz` still answers 200, for
/// as long as the node drains: here until the echo of a buffer the peer has no memory for
/// ends by its deadline (`limits.default_deadline = 3s`); then the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_says_draining_after_sigterm_until_the_process_exits_0() {
    let scratch = Scratch::new();
    let cfg = scratch.write(
        "s.toml",
        &scratch.toml(
            "s",
            &[],
            "[telemetry]\nmetrics_listen = \"localhost:0\"\n\n[limits]\ndefault_deadline = \"3s\"\n",
        ),
    );
    let (mut served, addr) = serve_with_metrics(&cfg, "echo");
    // t may hold 4 MiB: it keeps the 3 MiB it sent, so the echo of them waits for room.
    let node =
        Node::start(scratch.config("t", &[("s", &served.addr)], "[memory]\nhost = \"4MiB\"\n"))
            .await
            .expect("node starts");
    let buffer = patterned(&node, 3 << 20, 1).await;
    let held = node.send("s", 1, buffer).await.expect("send");
    let echo_waits = eventually(Duration::from_secs(5), async || {
        node.host_memory().await.is_ok_and(|m| m.waiting > 0)
    })
    .await;
    assert!(echo_waits, "the echo never waited for t's memory");

    nix::sys::signal::kill(served.pid(), nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let signalled = std::time::Instant::now();
    let probe = addr.clone();
    let draining = eventually(Duration::from_secs(2), async || {
        let a = probe.clone();
        tokio::task::spawn_blocking(move || http_get(&a, "/readyz"))
            .await
            .ok()
            .flatten()
            == Some((503, "draining\n".into()))
    })
    .await;
    assert!(draining, "/readyz never said draining");
    let live = tokio::task::spawn_blocking(move || http_get(&addr, "/healthz"))
        .await
        .expect("probe");
    assert_eq!(live, Some((200, "ok\n".into())), "not live while draining");

    let status = loop {
        if let Some(status) = served.child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(8),
            "serve did not exit after its drain"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status}");
    drop(held);
    node.shutdown().await;
}
