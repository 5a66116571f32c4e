//! Memory under pressure: all-or-nothing reservations, spill, promotion, backpressure and
//! recovery, between real processes on loopback (host-backed tiers with small budgets stand
//! in for the GPU tier: `pinned` is the fast tier, `host` the one it spills to).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{Scratch, Served, patterned};
use ferry::{Error, MemoryKind, Node};
use futures::StreamExt;

const MIB: u64 = 1 << 20;

fn tiers(pinned: &str, host: &str, queue: usize) -> String {
    format!(
        "[memory]\npinned = \"{pinned}\"\nhost = \"{host}\"\nreceive_into = \"pinned\"\n\
         spill = [\"host\"]\n\n[limits]\nreservation_queue = {queue}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receivers_needing_several_parts_all_finish() {
    // Each of 24 receivers needs three 8 MiB parts; the budget holds two receivers' worth.
    // Holding some parts while waiting for the rest would live-lock; all-or-nothing cannot.
    let scratch = Scratch::new();
    let node = Arc::new(
        Node::start(scratch.config("r", &[], &tiers("48 MiB", "1 GiB", 64)))
            .await
            .expect("node"),
    );
    let done = futures::stream::iter(0..24)
        .map(|i| {
            let node = Arc::clone(&node);
            async move {
                let parts = node
                    .alloc_parts(MemoryKind::PinnedHost, &[8 * MIB; 3])
                    .await
                    .unwrap_or_else(|e| panic!("receiver {i}: {e}"));
                assert_eq!(parts.len(), 3);
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(parts);
            }
        })
        .buffer_unordered(24)
        .count()
        .await;
    assert_eq!(done, 24);
    let m = node.memory(MemoryKind::PinnedHost).await.expect("stats");
    assert!(
        m.budget.peak_waiting > 0,
        "nobody ever had to wait: the test proves nothing"
    );
    assert!(m.budget.peak_waiting <= 64);
}

/// Samples a receiver's domains in the background, asserting the bounds at every sample.
struct Watch {
    running: Arc<AtomicBool>,
    samples: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Watch {
    fn start(node: &Arc<Node>, queue_cap: usize) -> Self {
        let running = Arc::new(AtomicBool::new(true));
        let samples = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn({
            let (node, running, samples) =
                (Arc::clone(node), Arc::clone(&running), Arc::clone(&samples));
            async move {
                while running.load(Ordering::Acquire) {
                    for kind in [MemoryKind::PinnedHost, MemoryKind::Host] {
                        if let Ok(m) = node.memory(kind).await {
                            assert!(m.budget.granted <= m.budget.capacity, "{kind}: {m:?}");
                            assert!(m.budget.waiting <= queue_cap, "{kind}: {m:?}");
                        }
                    }
                    samples.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        });
        Self {
            running,
            samples,
            task,
        }
    }

    /// Stops sampling; panics if a bound was broken. Returns how many samples were taken.
    async fn stop(self) -> u64 {
        self.running.store(false, Ordering::Release);
        self.task.await.expect("bounds held at every sample");
        self.samples.load(Ordering::Relaxed)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twice_the_load_the_receiver_drains_spills_and_loses_nothing() {
    let scratch = Scratch::new();
    let queue_cap = 32;
    let echo_cfg = scratch.write("echo.toml", &scratch.toml("echo", &[], ""));
    let echo = Served::start(&echo_cfg, "echo");
    let node = Arc::new(
        Node::start(scratch.config(
            "r",
            &[("echo", &echo.addr)],
            &tiers("8 MiB", "24 MiB", queue_cap),
        ))
        .await
        .expect("node"),
    );
    let watch = Watch::start(&node, queue_cap);

    // Offer 2 MiB buffers 8 at a time (at most 16 MiB of the 24 MiB host budget, so the
    // spill tier keeps room); drain one every 40 ms: well under what arrives.
    let count = 40u64;
    let sender = {
        let node = Arc::clone(&node);
        tokio::spawn(async move {
            let mut crcs = Vec::new();
            let mut sends = futures::stream::iter(0..count)
                .map(|tag| {
                    let node = Arc::clone(&node);
                    async move {
                        let b = patterned(&node, 2 * MIB as usize, tag).await;
                        let crc = crc32c::crc32c(&b.bytes().expect("bytes"));
                        node.send("echo", tag, b).await.map(|_| (tag, crc))
                    }
                })
                .buffer_unordered(8);
            while let Some(r) = sends.next().await {
                crcs.push(r.expect("no error reaches a sender under pressure"));
            }
            crcs
        })
    };
    // The drain starts once the receive tier is full...
    let filled = common::eventually(Duration::from_secs(30), async || {
        node.memory(MemoryKind::PinnedHost)
            .await
            .is_ok_and(|m| m.free() < 2 * MIB)
    })
    .await;
    assert!(filled, "the receive tier never filled");
    // ...and once an arrival had to spill: the host tier then holds more than the sends'
    // own buffers (8 of 2 MiB at most). Undrained, the echo's next arrivals can only spill
    // (a drain started earlier could keep up with an echo slowed by a busy machine).
    let spilling = common::eventually(Duration::from_secs(30), async || {
        node.memory(MemoryKind::Host)
            .await
            .is_ok_and(|m| m.budget.granted > 16 * MIB)
    })
    .await;
    assert!(
        spilling,
        "no arrival spilled while the receive tier was full"
    );
    let mut spilled = 0;
    let mut got = Vec::new();
    for _ in 0..count {
        let r = node.recv(Some("echo"), None).await.expect("recv");
        if r.buffer.kind() == MemoryKind::Host {
            spilled += 1;
        }
        got.push((r.tag, crc32c::crc32c(&r.buffer.bytes().expect("bytes"))));
        drop(r);
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    let mut sent = sender.await.expect("sender");
    let samples = watch.stop().await;
    sent.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, sent, "every byte arrives intact");
    assert!(spilled > 0, "spill never engaged");
    assert!(samples > 10, "too few samples");
}

/// Asks the bench peer `s` to send `count` buffers of `len` bytes, `window` at a time.
async fn ask_to_send(node: &Node, len: u64, count: u64, window: u64) {
    let mut ask = node.alloc(MemoryKind::Host, 24).await.expect("alloc");
    let words: Vec<u8> = [len, count, window]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    ask.as_mut_slice().expect("fresh").copy_from_slice(&words);
    let send_request = u64::MAX - 11;
    node.send("s", send_request, ask).await.expect("request");
}

/// Receives from `s` until nothing more arrives within `quiet`; returns how many.
async fn drain(node: &Node, quiet: Duration) -> usize {
    let mut n = 0;
    while let Ok(r) = tokio::time::timeout(quiet, node.recv(Some("s"), None)).await {
        r.expect("recv");
        n += 1;
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_tiers_make_senders_wait_and_recover_within_a_second() {
    let scratch = Scratch::new();
    let peer_cfg = scratch.write("s.toml", &scratch.toml("s", &[], ""));
    // A bench peer sends buffers back on request: it is the sender here.
    let mut child = std::process::Command::new(common::ferry_bin())
        .args(["bench", "--serve-peer"])
        .arg(&peer_cfg)
        .env("RUST_LOG", "error")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("bench peer");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().expect("stdout")),
        &mut line,
    )
    .expect("ready line");
    let addr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("tcp="))
        .expect("tcp address")
        .to_string();
    let queue_cap = 16;
    let extra = tiers("8 MiB", "8 MiB", queue_cap) + "default_deadline = \"2s\"\n";
    let node = Arc::new(
        Node::start(scratch.config("r", &[("s", &addr)], &extra))
            .await
            .expect("node"),
    );
    let watch = Watch::start(&node, queue_cap);

    // 24 × 1 MiB: half again what both tiers hold together. Nobody reads yet.
    ask_to_send(&node, MIB, 24, 8).await;
    let full = common::eventually(Duration::from_secs(5), async || {
        let p = node
            .memory(MemoryKind::PinnedHost)
            .await
            .map(|m| m.free())
            .unwrap_or(1);
        let h = node
            .memory(MemoryKind::Host)
            .await
            .map(|m| m.free())
            .unwrap_or(1);
        p < MIB && h < MIB
    })
    .await;
    assert!(full, "the tiers never filled");
    // Exhausted: an allocation waits, then fails at its deadline with a typed error.
    let started = Instant::now();
    let err = node.alloc(MemoryKind::PinnedHost, MIB as usize).await;
    assert!(
        matches!(
            err,
            Err(Error::NoMemory {
                cause: ferry::NoMemoryCause::DeadlinePassed,
                ..
            })
        ),
        "{err:?}"
    );
    assert!(started.elapsed() >= Duration::from_secs(1), "did not wait");
    // The receives that waited as long timed out the same way at the sender; what landed
    // is all there, within both budgets.
    let landed = drain(&node, Duration::from_millis(300)).await;
    assert!((14..=24).contains(&landed), "{landed} landed");

    // The load dropped: a fresh request is served in full within a second.
    let asked = Instant::now();
    ask_to_send(&node, MIB, 8, 8).await;
    let mut got = 0;
    while got < 8 {
        tokio::time::timeout(Duration::from_secs(1), node.recv(Some("s"), None))
            .await
            .unwrap_or_else(|_| panic!("not recovered within a second: {got} of 8 arrived"))
            .expect("recv");
        got += 1;
    }
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "took {:?}",
        asked.elapsed()
    );
    watch.stop().await;
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spilled_buffer_promotes_back_byte_exact() {
    let scratch = Scratch::new();
    let echo_cfg = scratch.write("echo.toml", &scratch.toml("echo", &[], ""));
    let echo = Served::start(&echo_cfg, "echo");
    let node =
        Node::start(scratch.config("r", &[("echo", &echo.addr)], &tiers("4 MiB", "64 MiB", 16)))
            .await
            .expect("node");
    // Fill the pinned tier so the echo lands in host memory.
    let hog = node
        .alloc(MemoryKind::PinnedHost, 4 * MIB as usize)
        .await
        .expect("hog");
    let b = patterned(&node, 3 * MIB as usize, 7).await;
    let want = b.to_vec().expect("bytes");
    node.send("echo", 1, b).await.expect("send");
    let got = node.recv(Some("echo"), Some(1)).await.expect("recv");
    assert_eq!(got.buffer.kind(), MemoryKind::Host, "should have spilled");
    // Pinned is full: promotion waits, then fails at its deadline, giving the buffer back.
    let soon = Instant::now() + Duration::from_millis(200);
    let err = got
        .buffer
        .promote(MemoryKind::PinnedHost, soon)
        .await
        .expect_err("no room");
    let back = err.buffer;
    assert_eq!(back.as_slice(), Some(&want[..]));
    drop(hog);
    let promoted = back
        .promote(
            MemoryKind::PinnedHost,
            Instant::now() + Duration::from_secs(5),
        )
        .await
        .expect("room now");
    assert_eq!(promoted.kind(), MemoryKind::PinnedHost);
    assert_eq!(
        promoted.as_slice(),
        Some(&want[..]),
        "promotion is byte-exact"
    );
}

/// p50 of `samples`.
fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// Sends of 4 KiB from `b` to `r`, one at a time, each until `r` holds it: their times.
async fn small_round(b: &Node, r: &Node, tags: std::ops::Range<u64>) -> Vec<Duration> {
    let mut took = Vec::new();
    for tag in tags {
        let buffer = patterned(b, 4096, tag).await;
        let started = Instant::now();
        let (sent, got) = tokio::join!(b.send("r", tag, buffer), r.recv(Some("b"), Some(tag)));
        sent.unwrap_or_else(|e| panic!("b's send {tag}: {e}"));
        drop(got.unwrap_or_else(|e| panic!("r's recv of {tag}: {e}")));
        took.push(started.elapsed());
    }
    took
}

/// One peer whose transfers wait at the receiver (its share of the receiver's memory is
/// full and the application takes nothing from it) holds up only itself: another peer's
/// small transfers to the same receiver keep their latency (p50 within a few times what it
/// was before, far from the blocked peer's wait), each session on its own thread
/// (`node.peer_threads`), and the blocked peer's transfers finish once they are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_peer_does_not_delay_another() {
    let scratch = Scratch::new();
    let r = Node::start(scratch.config("r", &[], "[limits]\npeer_inbound_bytes = \"8 MiB\"\n"))
        .await
        .expect("r starts");
    let at = r.tcp_addrs()[0].clone();
    let a = Arc::new(
        Node::start(scratch.config("a", &[("r", &at)], ""))
            .await
            .expect("a starts"),
    );
    let b = Node::start(scratch.config("b", &[("r", &at)], ""))
        .await
        .expect("b starts");
    b.connect("r").await.expect("b's link");
    a.connect("r").await.expect("a's link");
    let _ = small_round(&b, &r, 0..20).await;
    let alone = median(small_round(&b, &r, 20..120).await);

    // a's four transfers of 8 MiB: the first fills its share at r, the others wait.
    let finished = Arc::new(AtomicU64::new(0));
    let sends: Vec<_> = (0..4u64)
        .map(|tag| {
            let (a, finished) = (Arc::clone(&a), Arc::clone(&finished));
            tokio::spawn(async move {
                let buffer = patterned(&a, 8 << 20, 1000 + tag).await;
                let sent = a.send("r", 1000 + tag, buffer).await.map(drop);
                finished.fetch_add(1, Ordering::AcqRel);
                sent
            })
        })
        .collect();
    let held = common::eventually(Duration::from_secs(10), async || {
        r.host_memory().await.is_ok_and(|m| m.granted >= 8 << 20)
    })
    .await;
    assert!(held, "a's first transfer never reached r");
    let beside = median(small_round(&b, &r, 200..300).await);
    assert!(
        finished.load(Ordering::Acquire) <= 1,
        "a's transfers were not held at r: the test proves nothing"
    );
    assert!(
        beside <= alone * 4 + Duration::from_millis(2),
        "b's 4 KiB transfers took {beside:?} (p50) beside a blocked peer, {alone:?} alone"
    );

    // Taken in the order they land (the four were offered in any order).
    let mut tags = Vec::new();
    for _ in 0..4 {
        let got = r.recv(Some("a"), None).await.expect("a's transfer");
        assert_eq!(got.buffer.len(), 8 << 20);
        tags.push(got.tag);
    }
    tags.sort_unstable();
    assert_eq!(tags, [1000, 1001, 1002, 1003]);
    for send in sends {
        send.await.expect("a's task").expect("a's send");
    }
    let back = common::eventually(Duration::from_secs(5), async || {
        r.host_memory().await.is_ok_and(|m| m.granted == 0)
    })
    .await;
    assert!(back, "r still holds memory: {:?}", r.host_memory().await);
    b.shutdown().await;
    if let Ok(a) = Arc::try_unwrap(a) {
        a.shutdown().await;
    }
    r.shutdown().await;
}
