//! The shm transport between real processes on one host: host buffers from the nodes'
//! shared-memory pools, read in place by the peer. Byte-exact sizes from 1 B to 64 MiB under
//! the default rules (which route same-host host memory to shm), small sends on the lane in
//! order with the rest, pushes into lent buffers, pool pages given back when idle,
//! a peer killed while it pulls (no send hangs, memory it could read is not reused until the
//! lease timeout, then comes back), and descriptors of a hostile peer refused with their
//! cause. (Every check of the conformance suite runs over shm too: `conformance/`.)

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Scratch, Served, eventually, hand_driven_link_with, next_message, patterned};
use ferry::{Error, MemoryClass, MemoryKind, Node, TransportName};
use ferry_transports::link::{Endpoint, Secret};
use ferry_transports::shm::pool::PoolBytes;
use ferry_transports::shm::segment::Segment;
use ferry_transports::shm::{ShmSource, ShmTerms, segment_key};
use ferry_transports::wire::{
    Announce, Layout, Message, Offer, WireDirection, WireMemoryKind, WireTransport,
};

/// A node here (named `name`) and an echo process, with `extra` configuration at both (shm
/// is on by default).
async fn with_echo(scratch: &Scratch, name: &str, extra: &str) -> (Node, Served) {
    with_echo_as(scratch, name, extra, extra).await
}

/// [`with_echo`] with `echo_extra` at the echo.
async fn with_echo_as(
    scratch: &Scratch,
    name: &str,
    extra: &str,
    echo_extra: &str,
) -> (Node, Served) {
    let echo_cfg = scratch.write("echo.toml", &scratch.toml("echo", &[], echo_extra));
    let echo = Served::start(&echo_cfg, "echo");
    let node = Node::start(scratch.config(name, &[("echo", &echo.addr)], extra))
        .await
        .expect("node starts");
    (node, echo)
}

fn crc(buffer: &ferry::Buffer) -> u32 {
    crc32c::crc32c(buffer.as_slice().expect("host memory"))
}

/// Where a pool buffer lies: (segment, offset, length).
fn place(buffer: &ferry::Buffer) -> (u32, usize, usize) {
    let bytes = buffer
        .source_memory()
        .and_then(|m| m.as_any().downcast_ref::<PoolBytes>())
        .expect("a buffer of the shared-memory pool");
    (bytes.segment(), bytes.offset(), buffer.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_buffers_cross_byte_exact_over_shm_by_the_default_rules() {
    let scratch = Scratch::new();
    let (node, _echo) = with_echo(&scratch, "sizes", "").await;
    node.connect("echo").await.expect("connect");
    let explained = node
        .explain("echo", 1 << 20, MemoryClass::Host, MemoryClass::Host)
        .await
        .expect("explain");
    let chosen = explained.chosen.as_ref().expect("a route");
    assert_eq!(chosen.transport, TransportName::Shm, "{explained}");
    assert_eq!(chosen.direction, ferry::Direction::Pull, "{explained}");
    for (i, len) in [1, 7, 64, 4095, 65_536, (1 << 20) + 3, 16 << 20, 64 << 20]
        .into_iter()
        .enumerate()
    {
        let buffer = patterned(&node, len, i as u64).await;
        place(&buffer);
        let want = crc(&buffer);
        drop(node.send("echo", i as u64, buffer).await.expect("send"));
        let got = node.recv(Some("echo"), Some(i as u64)).await.expect("echo");
        assert_eq!(got.buffer.len(), len);
        assert_eq!(crc(&got.buffer), want, "{len} bytes arrived changed");
        assert_eq!(
            got.transport,
            TransportName::Shm,
            "{len} bytes came back by another transport"
        );
        // What landed here is pool memory too: the next send of it goes by shm as well.
        place(&got.buffer);
    }
}

/// Once the setup with the peer ran (the first send over shm), host buffers up to
/// `transport.shm.lane_max` take the lane and larger ones the session; sent together, they
/// arrive (and come back) in send order, byte-exact. With `lane_max = "0 B"` no lane
/// opens and the same sends go by the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_host_sends_take_the_lane_in_order_with_the_rest() {
    for (lane_max, lane) in [("256 KiB", true), ("0 B", false)] {
        let scratch = Scratch::new();
        let extra = format!("[transport.shm]\nlane_max = \"{lane_max}\"\n");
        let (node, _echo) = with_echo_as(&scratch, "lane", &extra, "").await;
        node.connect("echo").await.expect("connect");
        assert!(!node.has_fast_lane("echo"), "a lane before any send");
        let first = patterned(&node, 64, 0).await;
        drop(node.send("echo", 0, first).await.expect("send"));
        node.recv(Some("echo"), Some(0)).await.expect("echo");
        assert_eq!(node.has_fast_lane("echo"), lane, "lane_max = {lane_max}");
        let sizes = [8, 300 << 10, 4096, 1 << 20, 1, 256 << 10, 2 << 20, 100, 7];
        let mut buffers = Vec::new();
        for (i, len) in sizes.into_iter().enumerate() {
            buffers.push(patterned(&node, len, 1 + i as u64).await);
        }
        let want: Vec<u32> = buffers.iter().map(crc).collect();
        let sends =
            (buffers.into_iter().enumerate()).map(|(i, b)| node.send("echo", 100 + i as u64, b));
        for sent in futures::future::join_all(sends).await {
            drop(sent.expect("send"));
        }
        for (i, len) in sizes.into_iter().enumerate() {
            let got = node.recv(Some("echo"), None).await.expect("echo");
            assert_eq!(
                got.tag,
                100 + i as u64,
                "out of order (lane_max = {lane_max})"
            );
            assert_eq!(got.buffer.len(), len);
            assert_eq!(crc(&got.buffer), want[i], "{len} bytes arrived changed");
            assert_eq!(got.transport, TransportName::Shm);
        }
        node.shutdown().await;
    }
}

/// Shared memory process `pid` holds resident (`RssShmem`: its pool's pages and those of
/// the peer's pool it read), in bytes.
fn resident_shared(pid: nix::unistd::Pid) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("RssShmem:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("RssShmem");
    kib << 10
}

/// Pool memory leaves both processes once it was idle for `memory.keep_idle` (its pages
/// go back to the kernel), not only their budgets: a pool never shrinks, but it does not
/// keep its high-water mark resident. The echo's resident shared memory (its own pool's
/// pages and those of ours it read) falls back to almost what it was before the sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_pool_pages_go_back_to_the_kernel_after_keep_idle() {
    let scratch = Scratch::new();
    let idle = "[memory]\nkeep_idle = \"300ms\"\n";
    let (node, echo) = with_echo(&scratch, "idle", idle).await;
    // What the echo maps that is not a pool's is there before and after (on the H200
    // machine 8 MiB stayed, likely the CUDA driver's own shared memory).
    let baseline = resident_shared(echo.pid());
    let len = 16 << 20;
    for tag in 0..4u64 {
        let buffer = patterned(&node, len, tag).await;
        drop(node.send("echo", tag, buffer).await.expect("send"));
    }
    let mut echoes = Vec::new();
    for tag in 0..4u64 {
        echoes.push(node.recv(Some("echo"), Some(tag)).await.expect("echo"));
    }
    let touched = resident_shared(echo.pid()).saturating_sub(baseline);
    assert!(
        touched >= len as u64,
        "the echo never held the bytes: {touched} above its {baseline}"
    );
    drop(echoes);
    let held = || resident_shared(echo.pid()).saturating_sub(baseline);
    let back = eventually(Duration::from_secs(10), async || held() < touched / 8).await;
    assert!(
        back,
        "the echo still holds {} of the {touched} bytes of shared memory it took (above \
         the {baseline} it held before) after keep_idle",
        held()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_write_into_the_buffer_the_receiver_lends() {
    let scratch = Scratch::new();
    let rules =
        "[[transport.rules]]\nname = \"push\"\ntransports = [\"shm\"]\ndirection = \"push\"\n";
    let (node, _echo) = with_echo(&scratch, "push", rules).await;
    for (i, len) in [1, 5000, 3 << 20].into_iter().enumerate() {
        let buffer = patterned(&node, len, 40 + i as u64).await;
        let want = crc(&buffer);
        drop(node.send("echo", i as u64, buffer).await.expect("send"));
        let got = node.recv(Some("echo"), Some(i as u64)).await.expect("echo");
        assert_eq!(crc(&got.buffer), want, "{len} bytes arrived changed");
        assert_eq!(got.transport, TransportName::Shm);
        // It landed in a buffer of our pool (lent to the echo's push), not one the link
        // filled.
        place(&got.buffer);
    }
}

/// The echo is killed while it pulls our buffers: every send ends within 2 s, those it
/// may still have been reading keep their memory out of any new grant until the lease
/// timeout, and then all of it comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_killed_mid_pull_holds_our_memory_until_the_lease_then_gives_it_back() {
    let scratch = Scratch::new();
    let lease = Duration::from_secs(3);
    // Room here for our 24 buffers and three echoes; the echo holds three buffers at most:
    // its echoes wait for our memory, and our other offers for its memory, exported here,
    // when it dies.
    // Every offer leaves at once (a deep pipeline): each send the kill cuts off was
    // offered, so the peer may be reading it.
    let extra = format!(
        "[memory]\nhost = \"220 MiB\"\nexport_lease_timeout = \"{}s\"\n\n\
         [limits]\npipeline_depth = 32\n",
        lease.as_secs()
    );
    let (node, mut echo) =
        with_echo_as(&scratch, "killed", &extra, "[memory]\nhost = \"24 MiB\"\n").await;
    node.connect("echo").await.expect("connect");
    let baseline = node.host_memory().await.expect("stats").granted;
    let len = 8 << 20;
    let node = Arc::new(node);
    let mut sends = Vec::new();
    let mut places = Vec::new();
    let mut buffers = Vec::new();
    for i in 0..24u64 {
        buffers.push(patterned(&node, len, i).await);
    }
    for (i, buffer) in (0..24u64).zip(buffers) {
        places.push(place(&buffer));
        let node = Arc::clone(&node);
        sends.push(tokio::spawn(
            async move { node.send("echo", i, buffer).await },
        ));
    }
    // The first echo back: the echo is pulling the others now.
    let first = node.recv(Some("echo"), None).await.expect("the first echo");
    drop(first);
    echo.child.kill().expect("kill the echo");
    let killed = Instant::now();
    let mut held = Vec::new();
    for (send, at) in sends.into_iter().zip(&places) {
        match send.await.expect("join") {
            Ok(buffer) => drop(buffer),
            Err(e) => {
                assert!(matches!(e.error, Error::PeerLost { .. }), "{}", e.error);
                held.push(*at);
                drop(e.buffer);
            }
        }
    }
    let took = killed.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "the sends took {took:?} to end after the kill"
    );
    assert!(!held.is_empty(), "the kill cut off no send");
    // Echoes that came back before the kill wait in the inbox: taken and dropped.
    while let Ok(Ok(got)) =
        tokio::time::timeout(Duration::from_millis(200), node.recv(None, None)).await
    {
        drop(got);
    }
    // Within the lease, no new grant lies where the peer may still read.
    let held: HashSet<(u32, usize, usize)> = held.into_iter().collect();
    let mut fresh = Vec::new();
    for _ in 0..4 {
        let buffer = node.alloc(MemoryKind::Host, len).await.expect("alloc");
        let (segment, offset, n) = place(&buffer);
        for &(s, o, m) in &held {
            assert!(
                s != segment || offset + n <= o || o + m <= offset,
                "a new grant at {segment}/{offset} reuses memory the dead peer may still read"
            );
        }
        fresh.push(buffer);
    }
    let granted = node.host_memory().await.expect("stats").granted;
    let kept = baseline + (fresh.len() + held.len()) as u64 * len as u64;
    assert!(
        killed.elapsed() < lease && granted >= kept,
        "memory the peer may read was given back before the lease timeout ({granted} granted, \
         {kept} expected, {:?} after the kill)",
        killed.elapsed()
    );
    drop(fresh);
    let back = eventually(lease + Duration::from_secs(3), async || {
        node.host_memory().await.expect("stats").granted == baseline
    })
    .await;
    let now = node.host_memory().await.expect("stats").granted;
    assert!(
        back,
        "memory did not come back after the lease timeout: {now} granted, {baseline} before"
    );
}

/// A hand-driven peer on this host with a pool of one real segment, served at its own
/// fd-sharing socket.
struct RoguePool {
    pool: [u8; 16],
    segment: Arc<Segment>,
    _serving: tokio::task::JoinHandle<()>,
}

fn rogue_pool(scratch: &Scratch, name: &str) -> RoguePool {
    let pool: [u8; 16] = rand::random();
    let segment = Arc::new(Segment::create(1 << 20).expect("a segment"));
    let rings: ferry_transports::fdshare::RingDirectory = Arc::default();
    rings.insert(segment_key(&pool, 0), Arc::clone(&segment) as _);
    let listener = ferry_transports::fdshare::bind(name).expect("bind the rogue's socket");
    let secret = Secret::new(std::fs::read(&scratch.secret).expect("secret"));
    let serving = tokio::spawn(ferry_transports::fdshare::serve(
        listener,
        secret,
        Arc::default(),
        rings,
    ));
    RoguePool {
        pool,
        segment,
        _serving: serving,
    }
}

fn pull_offer(transfer: u64, source: &ShmSource) -> Message {
    Message::Offer(Offer {
        eager: false,
        fetch: None,
        into: None,
        transfer,
        tag: transfer,
        len: source.len,
        source: WireMemoryKind::Host,
        transport: WireTransport::Shm,
        direction: WireDirection::Pull,
        pull: Some(source.describe().expect("describe")),
        layout: Layout::Contiguous,
    })
}

/// What the node answers to a pull offer that it refuses: the message, as text.
async fn refusal(rogue: &mut ferry_transports::link::Link, transfer: u64) -> String {
    loop {
        match next_message(rogue, Duration::from_secs(5)).await {
            Some(Message::Done(d)) if d.transfer == transfer => {
                panic!("the node pulled a hostile descriptor: {d:?}")
            }
            Some(m) if format!("{m:?}").contains(&format!("transfer: {transfer}")) => {
                return format!("{m:?}");
            }
            Some(_) => continue,
            None => panic!("the node hung up on a refused descriptor"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_descriptors_are_refused_with_their_cause_and_good_ones_served() {
    let scratch = Scratch::new();
    let text = scratch
        .toml("shmhub", &[("shmrogue", "127.0.0.1:9")], "")
        .replace(
            "[security]",
            &format!(
                "socket_dir = \"{}\"\n\n[security]",
                scratch.path().display()
            ),
        );
    let config = ferry::Config::from_toml_str(&text).expect("config");
    let hub = Node::start(config).await.expect("hub starts");
    let rogue_pool = rogue_pool(&scratch, "shmrogue");
    let mut hello =
        ferry_transports::link::local_hello("shmrogue", vec![TransportName::Tcp], 4 << 20);
    hello.transports.push(Announce {
        transport: WireTransport::Shm,
        terms: ferry_transports::transport::encode(&ShmTerms {
            pool: rogue_pool.pool,
        })
        .expect("terms"),
    });
    let target = Endpoint::Unix(hub.unix_path().expect("a unix listener").to_path_buf());
    let mut rogue = hand_driven_link_with(&scratch.secret, &hub, target, hello).await;
    let good = |offset: u64, len: u64| ShmSource {
        pool: rogue_pool.pool,
        segment: 0,
        segment_len: 1 << 20,
        offset,
        len,
    };

    // A range past the end of the segment.
    let past = good((1 << 20) - 10, 100);
    rogue
        .writer
        .send(&pull_offer(1, &past))
        .await
        .expect("offer");
    let said = refusal(&mut rogue, 1).await;
    assert!(said.contains("out of range"), "{said}");
    // A pool the peer does not announce.
    let stale = ShmSource {
        pool: [7; 16],
        ..good(0, 100)
    };
    rogue
        .writer
        .send(&pull_offer(2, &stale))
        .await
        .expect("offer");
    let said = refusal(&mut rogue, 2).await;
    assert!(said.contains("stale"), "{said}");
    // The segment at another size than its memfd.
    let resized = ShmSource {
        segment_len: 2 << 20,
        ..good(0, 100)
    };
    rogue
        .writer
        .send(&pull_offer(3, &resized))
        .await
        .expect("offer");
    let said = refusal(&mut rogue, 3).await;
    assert!(said.contains("stale") || said.contains("size"), "{said}");

    // The link is still up, and a good descriptor is read in place.
    let bytes: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    rogue_pool.segment.copy_in(4096, &bytes).expect("fill");
    rogue
        .writer
        .send(&pull_offer(4, &good(4096, 5000)))
        .await
        .expect("offer");
    let got = tokio::time::timeout(Duration::from_secs(5), hub.recv(Some("shmrogue"), Some(4)))
        .await
        .expect("the good pull arrived")
        .expect("recv");
    assert_eq!(got.buffer.as_slice().expect("host"), &bytes[..]);
    assert_eq!(got.transport, TransportName::Shm);
}
