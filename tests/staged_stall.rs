//! A stalled receiver of staged transfers (its process stopped mid-transfer, its ring full)
//! makes the sender wait, never grow memory; the transfer fails at its deadline with the
//! buffer back. Alone in its test process, so that the process's memory is the sender's.

mod common;

use std::time::{Duration, Instant};

use common::{Scratch, Served, eventually, metric, patterned};
use ferry::Node;

fn resident() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_receiver_makes_the_sender_wait_with_bounded_memory() {
    let scratch = Scratch::new();
    let extra = "[transport.staged]\nchunk = \"64 KiB\"\nslots = 2\n\n[[transport.rules]]\n\
                 name = \"all\"\ntransports = [\"staged\"]\n";
    let echo_extra = format!("{extra}\n[telemetry]\nmetrics_listen = \"127.0.0.1:0\"\n");
    let echo_cfg = scratch.write("echo.toml", &scratch.toml("echo", &[], &echo_extra));
    let echo = Served::start(&echo_cfg, "echo");
    let metrics = echo.metrics_addr();
    let node = Node::start(scratch.config("stall", &[("echo", &echo.addr)], extra))
        .await
        .expect("node starts");
    let ring = || metric(&metrics, "ferry_staged_ring_chunks_total").unwrap_or(0.0);
    // Until the echo maps our ring, staged chunks go over the link.
    let mut tag = 100;
    while ring() == 0.0 {
        assert!(tag < 200, "the echo never read our ring");
        let buffer = patterned(&node, 10, tag).await;
        drop(node.send("echo", tag, buffer).await.expect("warm-up"));
        drop(
            node.recv(Some("echo"), Some(tag))
                .await
                .expect("warm-up echo"),
        );
        tag += 1;
    }
    // 256 MiB in chunks of 64 KiB: stop the echo once it has landed some of them.
    let len = 256 << 20;
    let big = patterned(&node, len, 2).await;
    let before = resident();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(3);
    let base = ring();
    let send = node.send_by("echo", 2, big, deadline);
    let stop = async {
        while ring() < base + 64.0 {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        nix::sys::signal::kill(echo.pid(), nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
        ring()
    };
    let (sent, landed) = tokio::join!(send, stop);
    let waited = started.elapsed();
    let grown = resident().saturating_sub(before);
    let err = sent.expect_err("a stalled receiver cannot complete it");
    assert!(
        landed < (len / (64 << 10)) as f64 + base,
        "the echo landed every chunk before it stopped: the test proves nothing"
    );
    assert!(
        waited >= Duration::from_millis(2500),
        "gave up after {waited:?}"
    );
    assert!(waited < Duration::from_secs(10), "waited {waited:?}");
    assert_eq!(err.buffer.map(|b| b.len()), Some(len), "{}", err.error);
    // Two slots of 64 KiB are all the staging there is; allow for the runtime's own noise.
    assert!(
        grown < 8 << 20,
        "memory grew by {grown} bytes while waiting"
    );
    nix::sys::signal::kill(echo.pid(), nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
    assert!(
        eventually(Duration::from_secs(5), async || {
            node.host_memory().await.is_ok_and(|m| m.granted == 0)
        })
        .await,
        "host memory still granted: {:?}",
        node.host_memory().await
    );
    node.shutdown().await;
}
