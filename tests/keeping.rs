//! Memory a node keeps for later receives is a cache with a clock: after a burst of large
//! receives, a real `ferry serve` gives it back once it has been unused for
//! `memory.keep_idle` (its RSS returns near where it was before the burst, and its
//! `ferry_memory_kept_bytes` gauge to 0); with `keep_idle = "0s"` it keeps nothing at all.

mod common;

use std::time::Duration;

use common::{Scratch, Served, eventually, metric, patterned};
use ferry::Node;
use futures::StreamExt;

const MIB: u64 = 1 << 20;
/// Each buffer of the burst: above glibc's largest mmap threshold (32 MiB), so that its
/// memory is a mapping of its own, which a free unmaps at once. The bound below is then
/// about ferry, not about what the C heap keeps of smaller freed chunks.
const LARGE: usize = 64 << 20;
const BURST: u64 = 12;
/// Sends in flight at once.
const WINDOW: usize = 4;
/// How far above its RSS before the burst the sink may stay once its memory went back:
/// one large buffer (the old shelf kept up to 16, 768 MiB of this burst, for ever).
const SLACK: u64 = 64 * MIB;

/// The resident set of process `pid`, in bytes (`VmRSS` of `/proc/PID/status`).
fn rss(pid: nix::unistd::Pid) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .expect("a VmRSS line")
}

/// What a burst did to the sink's resident memory.
struct Burst {
    sink: Served,
    metrics: String,
    baseline: u64,
    peak: u64,
}

/// Starts a sink with `memory` in its configuration, then sends it `BURST` buffers of
/// `LARGE` bytes, `WINDOW` at a time, and waits until it has given every grant back.
async fn burst(scratch: &Scratch, memory: &str) -> Burst {
    let cfg = scratch.write(
        "sink.toml",
        &scratch.toml(
            "sink",
            &[],
            &format!(
                "[memory]\nhost = \"2 GiB\"\n{memory}\n\n\
                 [telemetry]\nmetrics_listen = \"127.0.0.1:0\"\n"
            ),
        ),
    );
    let sink = Served::start(&cfg, "sink");
    let metrics = sink.metrics_addr();
    let node = Node::start(scratch.config("test", &[("sink", &sink.addr)], ""))
        .await
        .expect("node");
    // The link and the sink's threads exist before the baseline is read.
    let warm = patterned(&node, 4096, 0).await;
    node.send("sink", 0, warm).await.expect("warm-up send");
    let baseline = rss(sink.pid());

    let mut peak = baseline;
    let source = patterned(&node, LARGE, 1).await;
    let mut sends = futures::stream::FuturesUnordered::new();
    for tag in 1..=BURST {
        let mut buffer = node
            .alloc(ferry::MemoryKind::Host, LARGE)
            .await
            .expect("alloc");
        buffer
            .as_mut_slice()
            .expect("host")
            .copy_from_slice(source.as_slice().expect("host"));
        sends.push(node.send("sink", tag, buffer));
        if sends.len() >= WINDOW {
            drop(sends.next().await.expect("a send").expect("send"));
            peak = peak.max(rss(sink.pid()));
        }
    }
    while let Some(sent) = sends.next().await {
        drop(sent.expect("send"));
        peak = peak.max(rss(sink.pid()));
    }
    drop(sends);
    node.shutdown().await;
    let granted = |addr: &str| metric(addr, "ferry_memory_granted_bytes{domain=\"host\"}");
    assert!(
        eventually(Duration::from_secs(10), async || granted(&metrics)
            == Some(0.0))
        .await,
        "the sink kept its grants: {:?}",
        granted(&metrics)
    );
    Burst {
        sink,
        metrics,
        baseline,
        peak,
    }
}

fn kept(metrics: &str) -> Option<f64> {
    metric(metrics, "ferry_memory_kept_bytes{domain=\"host\"}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_large_receives_gives_its_memory_back_after_keep_idle() {
    let scratch = Scratch::new();
    let b = burst(&scratch, "keep_idle = \"500ms\"").await;
    let pid = b.sink.pid();
    println!(
        "sink RSS: {} MiB before the burst, {} MiB at its peak",
        b.baseline / MIB,
        b.peak / MIB
    );
    assert!(
        b.peak >= b.baseline + 2 * LARGE as u64,
        "the burst never raised the sink's RSS ({} -> {} MiB): the test proves nothing",
        b.baseline / MIB,
        b.peak / MIB
    );
    let back = eventually(Duration::from_secs(10), async || {
        rss(pid) <= b.baseline + SLACK
    })
    .await;
    let now = rss(pid);
    println!("sink RSS after keep_idle: {} MiB", now / MIB);
    assert!(
        back,
        "the sink's RSS stayed at {} MiB, {} MiB before the burst (kept: {:?} bytes)",
        now / MIB,
        b.baseline / MIB,
        kept(&b.metrics)
    );
    assert_eq!(kept(&b.metrics), Some(0.0), "the kept gauge");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_keep_idle_zero_a_node_keeps_nothing() {
    let scratch = Scratch::new();
    let b = burst(&scratch, "keep_idle = \"0s\"").await;
    // Every grant is back (waited for above): with nothing kept, so is the memory, at once
    // (within a second, half the default keep_idle: the buffers' frees may still be ending).
    let pid = b.sink.pid();
    let back = eventually(Duration::from_secs(1), async || {
        rss(pid) <= b.baseline + SLACK
    })
    .await;
    let now = rss(pid);
    assert!(
        back,
        "RSS {} MiB, {} MiB before the burst, with nothing kept",
        now / MIB,
        b.baseline / MIB
    );
    assert_eq!(kept(&b.metrics), Some(0.0), "the kept gauge");
}
