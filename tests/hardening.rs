//! What an attacker without the secret, and an authenticated peer that misbehaves, can do to
//! a node: real nodes on loopback, raw sockets and a hand-driven authenticated link playing
//! the hostile side.

mod common;

use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{Scratch, eventually, hand_driven_link, next_message, patterned};
use ferry::Node;
use ferry_transports::link::{self, Endpoint, Link, LinkCounters, LinkOptions, Secret};
use ferry_transports::wire::{
    DataChunk, FrameHeader, FrameKind, HelloPurpose, Layout, Message, Offer, WireDirection,
    WireMemoryKind, WireReason,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Connections held against the node before a real peer dials.
const HELD: usize = 1500;

async fn hub(scratch: &Scratch, extra: &str) -> Node {
    // "rogue" is a configured peer that dials in; nothing listens at its address.
    let config = scratch.config("hub", &[("rogue", "127.0.0.1:9")], extra);
    Node::start(config).await.expect("hub starts")
}

/// An authenticated link to `node` that introduces itself as "rogue", driven by hand.
async fn rogue(scratch: &Scratch, node: &Node) -> Link {
    let target = Endpoint::Tcp(node.tcp_addrs()[0].clone());
    hand_driven_link(
        &scratch.secret,
        node,
        target,
        "rogue",
        vec![ferry::TransportName::Tcp],
    )
    .await
}

fn offer(transfer: u64, len: u64) -> Message {
    Message::Offer(Offer {
        eager: false,
        fetch: None,
        into: None,
        transfer,
        tag: transfer,
        len,
        source: WireMemoryKind::Host,
        transport: ferry_transports::wire::WireTransport::Tcp,
        direction: WireDirection::Push,
        pull: None,
        layout: Layout::Contiguous,
    })
}

/// Waits for the grant of `transfer`.
async fn granted(link: &mut Link, transfer: u64) {
    match next_message(link, Duration::from_secs(5)).await {
        Some(Message::Grant(g)) if g.transfer == transfer => {}
        other => panic!("expected the grant of {transfer}, got {other:?}"),
    }
}

async fn host_granted(node: &Node) -> u64 {
    node.host_memory().await.expect("stats").granted
}

async fn memory_back_to(node: &Node, baseline: u64, limit: Duration) -> bool {
    eventually(limit, async || host_granted(node).await == baseline).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_slow_connections_by_the_thousand_do_not_keep_a_real_peer_out() {
    let scratch = Scratch::new();
    let hub = hub(&scratch, "").await;
    let target = hub.tcp_addrs()[0].clone();
    // Held open and never finished: half say nothing, half send one byte of a preamble and
    // stop (past the first-byte check, into the handshake).
    let mut held = Vec::with_capacity(HELD);
    for i in 0..HELD {
        let Ok(mut stream) = tokio::net::TcpStream::connect(&target).await else {
            continue;
        };
        if i % 2 == 1 {
            let _ = stream.write_all(b"F").await;
        }
        held.push(stream);
    }
    assert!(
        held.len() > HELD * 9 / 10,
        "only {} connections",
        held.len()
    );
    // A real peer joins within its normal time (a handshake on loopback takes
    // milliseconds; the handshake timeout is 5 s).
    let late = Node::start(scratch.config("late", &[("hub", &target)], ""))
        .await
        .expect("late starts");
    let started = Instant::now();
    late.connect("hub")
        .await
        .expect("a real peer connects while the attack lasts");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "joining took {took:?}");
    let buffer = patterned(&late, 4096, 7).await;
    late.send("hub", 7, buffer).await.expect("and sends");
    assert!(hub.recv(Some("late"), Some(7)).await.is_ok());
    drop(held);
    late.shutdown().await;
    hub.shutdown().await;
}

/// Idle connections an attacker keeps open against a node while real peers dial: each
/// one the node closes is opened again.
const IDLE: usize = 500;

/// Connections the attacker opens a second at most: enough that far more than
/// `limits.handshakes_per_source` (32) arrive while a real peer's handshake is under way,
/// and few enough to leave the machine's CPUs to the node and the peers.
const ATTACK_RATE: u64 = 2_000;

/// Real peers that dial, one after another, during the attack.
const DIALS: usize = 100;

/// How long the node's bytes take to reach a real peer: a peer some way off, whose
/// handshake takes round trips that a flood of connections fills.
const FAR: Duration = Duration::from_millis(40);

/// Keeps `IDLE` connections to `target` open that never say a word, opening again each
/// one the node closes (at most [`ATTACK_RATE`] a second), until `stop`; `opened` counts
/// the connections opened. The attack runs on a runtime of its own, in a thread of its
/// own, as an attacker would in a process of its own.
fn idle_attack(
    target: &str,
    stop: &Arc<AtomicBool>,
    opened: &Arc<AtomicU64>,
) -> std::thread::JoinHandle<()> {
    let (target, stop, opened) = (target.to_owned(), Arc::clone(stop), Arc::clone(opened));
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("the attack's runtime");
        runtime.block_on(async move {
            let open = Arc::new(tokio::sync::Semaphore::new(IDLE));
            let tick = Duration::from_millis(2);
            let per_tick = ATTACK_RATE * 2 / 1000;
            let mut ticks = tokio::time::interval(tick);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            while !stop.load(Ordering::Relaxed) {
                ticks.tick().await;
                for _ in 0..per_tick {
                    let Ok(slot) = Arc::clone(&open).try_acquire_owned() else {
                        break;
                    };
                    let (target, stop, opened) =
                        (target.clone(), Arc::clone(&stop), Arc::clone(&opened));
                    tokio::spawn(async move {
                        let Ok(mut stream) = tokio::net::TcpStream::connect(&target).await else {
                            return;
                        };
                        opened.fetch_add(1, Ordering::Relaxed);
                        // Held until the node closes it (EOF or a reset), or the attack ends.
                        let mut byte = [0u8; 1];
                        tokio::select! {
                            _ = stream.read(&mut byte) => {}
                            _ = async {
                                while !stop.load(Ordering::Relaxed) {
                                    tokio::time::sleep(Duration::from_millis(20)).await;
                                }
                            } => {}
                        }
                        drop(slot);
                    });
                }
            }
        });
    })
}

/// A relay to `target` for peers [`FAR`] away: what a peer sends goes on at once, what the
/// node sends reaches the peer `FAR` later. Returns the relay's address.
async fn far_relay(target: String) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the relay");
    let addr = listener.local_addr().expect("relay address").to_string();
    tokio::spawn(async move {
        while let Ok((mut peer, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                // What the peer sends first (its preamble) goes out with the connection to
                // the node, from one thread in one go, as a peer's own first write does.
                let mut first = vec![0u8; 4096];
                let Ok(n) = peer.read(&mut first).await else {
                    return;
                };
                first.truncate(n);
                let connected = tokio::task::spawn_blocking(move || {
                    let mut node = std::net::TcpStream::connect(&target)?;
                    node.write_all(&first)?;
                    node.set_nodelay(true)?;
                    node.set_nonblocking(true)?;
                    std::io::Result::Ok(node)
                })
                .await;
                let Ok(Ok(node)) = connected else {
                    return;
                };
                let Ok(node) = tokio::net::TcpStream::from_std(node) else {
                    return;
                };
                let _ = peer.set_nodelay(true);
                let (mut peer_read, mut peer_write) = peer.into_split();
                let (mut node_read, mut node_write) = node.into_split();
                let up = tokio::io::copy(&mut peer_read, &mut node_write);
                let down = async {
                    let (tx, mut rx) = tokio::sync::mpsc::channel::<(Instant, Vec<u8>)>(64);
                    let read = async {
                        let mut chunk = vec![0u8; 64 << 10];
                        while let Ok(n) = node_read.read(&mut chunk).await {
                            if n == 0
                                || tx
                                    .send((Instant::now(), chunk[..n].to_vec()))
                                    .await
                                    .is_err()
                            {
                                break;
                            }
                        }
                        drop(tx);
                    };
                    let write = async {
                        while let Some((at, bytes)) = rx.recv().await {
                            tokio::time::sleep_until((at + FAR).into()).await;
                            if peer_write.write_all(&bytes).await.is_err() {
                                break;
                            }
                        }
                        let _ = peer_write.shutdown().await;
                    };
                    tokio::join!(read, write);
                };
                let _ = tokio::join!(up, down);
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_complete_preamble_is_never_shed_for_idle_connections() {
    // The attacker's sockets, the node's side of those it holds, and the rest of this
    // binary's tests, which run at the same time.
    let limit = common::raise_fd_limit(8192);
    assert!(
        limit >= (HELD + 2 * IDLE + 512) as u64,
        "the open-files limit is {limit}: too low to hold {IDLE} connections"
    );
    let scratch = Scratch::new();
    let hub = hub(&scratch, "").await;
    let target = hub.tcp_addrs()[0].clone();
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicU64::new(0));
    let attack = idle_attack(&target, &stop, &opened);
    // Under way once the node has closed some: more opened than are held.
    let under_way = eventually(Duration::from_secs(20), async || {
        opened.load(Ordering::Relaxed) > 2 * IDLE as u64
    })
    .await;
    assert!(under_way, "the attack never got going");

    // Real peers, each a real dialer through the whole handshake (preamble, proof, hello),
    // FAR away through the relay and from the attacker's own address.
    let relay = Endpoint::Tcp(far_relay(target.clone()).await);
    let secret = Secret::new(std::fs::read(&scratch.secret).expect("secret"));
    let opts = LinkOptions {
        max_frame: 4 << 20,
        handshake_timeout: Duration::from_secs(5),
        stall_timeout: Duration::from_secs(30),
        counters: Arc::new(LinkCounters::new()),
    };
    let mut failed = Vec::new();
    let (started, attacked) = (Instant::now(), opened.load(Ordering::Relaxed));
    for i in 0..DIALS {
        let mut hello = link::local_hello(format!("prober-{i}"), vec![], 4 << 20);
        hello.purpose = HelloPurpose::Probe;
        match link::dial(&relay, &secret, hello, &opts).await {
            Ok(answered) => assert_eq!(answered.peer_hello.node, "hub"),
            Err(e) => failed.push(format!("dial {i}: {e}")),
        }
    }
    let took = started.elapsed();
    let attacked = opened.load(Ordering::Relaxed) - attacked;
    stop.store(true, Ordering::Relaxed);
    let _ = tokio::task::spawn_blocking(move || attack.join()).await;
    assert!(
        failed.is_empty(),
        "{} of {DIALS} real handshakes failed while {attacked} idle connections were opened \
         (in {took:?}): {failed:#?}",
        failed.len()
    );
    println!("{DIALS} real handshakes in {took:?} while {attacked} idle connections were opened");
    hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_control_frame_ends_the_link_and_its_transfers_at_once() {
    let scratch = Scratch::new();
    let hub = hub(&scratch, "").await;
    let mut rogue = rogue(&scratch, &hub).await;
    // The hub sends (default deadline: 30 s); the rogue answers the offer with a grant
    // whose CRC does not match.
    let send = {
        let buffer = patterned(&hub, 10_000, 1).await;
        let hub = &hub;
        async move {
            let started = Instant::now();
            let result = hub.send("rogue", 1, buffer).await;
            (result.map(drop), started.elapsed())
        }
    };
    let corrupt = async {
        let transfer = match next_message(&mut rogue, Duration::from_secs(5)).await {
            Some(Message::Offer(o)) => o.transfer,
            other => panic!("expected an offer, got {other:?}"),
        };
        let grant = Message::Grant(ferry_transports::wire::Grant {
            transfer,
            landing: WireMemoryKind::Host,
            lent: None,
        });
        let mut bytes = ferry_transports::wire::encode(&grant).expect("encode");
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        rogue
            .writer
            .danger_send_raw(&bytes)
            .await
            .expect("write the corrupt grant");
        // The node hangs up.
        next_message(&mut rogue, Duration::from_secs(5)).await
    };
    let ((result, took), after) = tokio::join!(send, corrupt);
    assert!(
        result.is_err(),
        "a transfer answered by a corrupt frame succeeded"
    );
    assert!(
        took < Duration::from_secs(3),
        "the send ended after {took:?}"
    );
    assert!(
        after.is_none(),
        "the link went on after a corrupt frame: {after:?}"
    );
    assert_eq!(hub.link_counters().frames_rejected("crc"), 1);
    hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_mid_payload_loses_its_link_and_its_reservation() {
    let scratch = Scratch::new();
    let hub = hub(&scratch, "[limits]\nstall_timeout = \"1s\"").await;
    let baseline = host_granted(&hub).await;
    let mut rogue = rogue(&scratch, &hub).await;
    rogue.writer.send(&offer(1, 8 << 20)).await.expect("offer");
    granted(&mut rogue, 1).await;
    assert_eq!(host_granted(&hub).await, baseline + (8 << 20));
    // A data header, then half of its payload frame, and the connection held open.
    let bytes = vec![0x5Au8; 1 << 20];
    rogue
        .writer
        .send(&Message::Data(DataChunk {
            transfer: 1,
            offset: 0,
            len: bytes.len() as u32,
        }))
        .await
        .expect("data header");
    let header = FrameHeader::for_payload(FrameKind::Payload, &bytes).expect("header");
    let mut half = header.to_bytes().to_vec();
    half.extend_from_slice(&bytes[..bytes.len() / 2]);
    rogue.writer.danger_send_raw(&half).await.expect("half");
    let started = Instant::now();
    assert!(
        memory_back_to(&hub, baseline, Duration::from_secs(5)).await,
        "the reservation is still held after {:?}",
        started.elapsed()
    );
    // The transfer's own stall clock may tell us first; then the link ends.
    loop {
        match next_message(&mut rogue, Duration::from_secs(5)).await {
            None => break,
            Some(Message::Cancel(c)) if c.reason == WireReason::Stalled => {}
            Some(other) => panic!("the node kept the link of a peer stalled mid-frame: {other:?}"),
        }
    }
    assert_eq!(hub.link_counters().frames_rejected("stalled"), 1);
    hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_granted_transfer_that_gets_no_bytes_is_ended_and_the_link_kept() {
    let scratch = Scratch::new();
    let hub = hub(&scratch, "[limits]\nstall_timeout = \"1s\"").await;
    let baseline = host_granted(&hub).await;
    let mut rogue = rogue(&scratch, &hub).await;
    rogue.writer.send(&offer(1, 8 << 20)).await.expect("offer");
    granted(&mut rogue, 1).await;
    let started = Instant::now();
    // Nothing follows the grant: the node gives up, tells us why and frees the memory.
    match next_message(&mut rogue, Duration::from_secs(5)).await {
        Some(Message::Cancel(c)) => {
            assert!(c.by_receiver && c.transfer == 1, "{c:?}");
            assert_eq!(c.reason, WireReason::Stalled, "{c:?}");
        }
        other => panic!("expected a stall cancel, got {other:?}"),
    }
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert!(memory_back_to(&hub, baseline, Duration::from_secs(2)).await);
    // The link is still good: a proper transfer goes through.
    rogue.writer.send(&offer(2, 5)).await.expect("offer");
    granted(&mut rogue, 2).await;
    rogue
        .writer
        .feed_chunk(
            &Message::Data(DataChunk {
                transfer: 2,
                offset: 0,
                len: 5,
            }),
            b"hello",
        )
        .await
        .expect("chunk");
    rogue.writer.flush().await.expect("flush");
    let got = hub.recv(Some("rogue"), Some(2)).await.expect("delivered");
    assert_eq!(got.buffer.to_vec().expect("host"), b"hello");
    hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_cannot_hold_more_than_its_share_of_memory() {
    let scratch = Scratch::new();
    let hub = hub(
        &scratch,
        "[limits]\npeer_inbound_bytes = \"2MiB\"\npeer_grants = 64",
    )
    .await;
    let baseline = host_granted(&hub).await;
    let mut rogue = rogue(&scratch, &hub).await;
    // Three of 1 MiB: two are granted, the third waits for room.
    for t in 2..=4 {
        rogue.writer.send(&offer(t, 1 << 20)).await.expect("offer");
    }
    granted(&mut rogue, 2).await;
    granted(&mut rogue, 3).await;
    let third = tokio::time::timeout(Duration::from_millis(500), rogue.reader.next()).await;
    assert!(
        third.is_err(),
        "a third grant went past the share: {third:?}"
    );
    assert_eq!(host_granted(&hub).await, baseline + (2 << 20));
    // Transfer 2 completes and is taken: the third is granted.
    let bytes = vec![3u8; 1 << 20];
    rogue
        .writer
        .feed_chunk(
            &Message::Data(DataChunk {
                transfer: 2,
                offset: 0,
                len: bytes.len() as u32,
            }),
            &bytes,
        )
        .await
        .expect("chunk");
    rogue.writer.flush().await.expect("flush");
    match next_message(&mut rogue, Duration::from_secs(5)).await {
        Some(Message::Done(d)) => assert_eq!(d.transfer, 2),
        other => panic!("expected Done, got {other:?}"),
    }
    // Delivered but not taken by the application: it still holds memory, so it still
    // counts against the peer's share.
    let fourth = tokio::time::timeout(Duration::from_millis(500), rogue.reader.next()).await;
    assert!(
        fourth.is_err(),
        "granted past the share while a delivery waits: {fourth:?}"
    );
    // Taken: the fourth is granted.
    let got = hub.recv(Some("rogue"), Some(2)).await.expect("delivered");
    assert_eq!(got.buffer.len(), 1 << 20);
    drop(got);
    granted(&mut rogue, 4).await;
    hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_transfers_queued_behind_others_are_not_stalled() {
    // A short stall timeout, many transfers granted at once in both directions: each waits
    // for the ones streamed before it (and for the other direction's stream on the same
    // link), longer than the stall timeout, while the link keeps moving.
    let scratch = Scratch::new();
    let extra = "[limits]\nstall_timeout = \"1s\"";
    let b = Node::start(scratch.config("b", &[], extra))
        .await
        .expect("b starts");
    let a = Node::start(scratch.config("a", &[("b", &b.tcp_addrs()[0])], extra))
        .await
        .expect("a starts");
    a.connect("b").await.expect("link");
    let big = async {
        let sends = (0..8u64).map(|i| {
            let a = &a;
            async move {
                let buffer = patterned(a, 64 << 20, i).await;
                a.send("b", i, buffer).await.map(drop)
            }
        });
        futures::future::join_all(sends).await
    };
    let small = async {
        let mut results = Vec::new();
        for i in 100..120u64 {
            let buffer = patterned(&b, 4096, i).await;
            results.push(b.send("a", i, buffer).await.map(drop));
        }
        results
    };
    let started = Instant::now();
    let (big, small) = tokio::join!(big, small);
    let took = started.elapsed();
    for (i, r) in big.iter().enumerate() {
        assert!(r.is_ok(), "big send {i} failed after {took:?}: {r:?}");
    }
    for (i, r) in small.iter().enumerate() {
        assert!(r.is_ok(), "small send {i} failed after {took:?}: {r:?}");
    }
    for i in 0..8u64 {
        let got = b.recv(Some("a"), Some(i)).await.expect("big delivered");
        assert_eq!(got.buffer.len(), 64 << 20);
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_reading_loses_both_halves_of_its_link() {
    let scratch = Scratch::new();
    let hub = hub(&scratch, "[limits]\nstall_timeout = \"1s\"").await;
    let mut rogue = rogue(&scratch, &hub).await;
    // The rogue grants the offer and then reads nothing: our stream of 64 MiB fills the
    // socket and the write stalls.
    let buffer = patterned(&hub, 64 << 20, 1).await;
    let started = Instant::now();
    let send = tokio::time::timeout(Duration::from_secs(10), hub.send("rogue", 1, buffer));
    let grant = async {
        let transfer = match next_message(&mut rogue, Duration::from_secs(5)).await {
            Some(Message::Offer(o)) => o.transfer,
            other => panic!("expected an offer, got {other:?}"),
        };
        rogue
            .writer
            .send(&Message::Grant(ferry_transports::wire::Grant {
                transfer,
                landing: WireMemoryKind::Host,
                lent: None,
            }))
            .await
            .expect("grant");
    };
    let (sent, ()) = tokio::join!(send, grant);
    let sent = sent.expect("the send ended");
    assert!(
        sent.is_err(),
        "a send to a peer that reads nothing succeeded"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // The link's read half went with it: a bad frame sent now is never read.
    let mut bytes = ferry_transports::wire::encode(&Message::Ping(1)).expect("encode");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    let _ = rogue.writer.danger_send_raw(&bytes).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        hub.link_counters().frames_rejected("crc"),
        0,
        "the node still reads the link it gave up"
    );
    hub.shutdown().await;
}

/// An eager offer of `len` bytes (its payload follows it at once).
fn eager_offer(transfer: u64, len: u64) -> Message {
    let Message::Offer(offer) = offer(transfer, len) else {
        unreachable!("offer() makes an offer")
    };
    Message::Offer(Offer {
        eager: true,
        ..offer
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eager_transfer_from_a_hand_driven_peer_lands_without_a_grant() {
    let scratch = Scratch::new();
    let hub = hub(&scratch, "").await;
    let mut rogue = rogue(&scratch, &hub).await;
    let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    rogue
        .writer
        .feed_chunk(&eager_offer(1, bytes.len() as u64), &bytes)
        .await
        .expect("eager offer");
    rogue.writer.flush().await.expect("flush");
    match next_message(&mut rogue, Duration::from_secs(5)).await {
        Some(Message::Done(d)) if d.transfer == 1 => {}
        other => panic!("expected Done for the eager transfer, got {other:?}"),
    }
    let got = tokio::time::timeout(Duration::from_secs(5), hub.recv(Some("rogue"), Some(1)))
        .await
        .expect("delivered")
        .expect("recv");
    assert_eq!(got.buffer.to_vec().expect("host bytes"), bytes);
    hub.shutdown().await;
}

/// An eager offer larger than the node takes eagerly, or whose payload is not as long as
/// the offer says, ends the link at once, and nothing it reserved stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eager_offer_past_the_credit_or_of_a_wrong_length_ends_the_link() {
    let scratch = Scratch::new();
    let hub = hub(
        &scratch,
        "[transport.tcp]\neager_max = \"64KiB\"\neager_credit = \"64KiB\"",
    )
    .await;
    let baseline = host_granted(&hub).await;
    // Past eager_max (and the whole credit).
    let mut rogue_link = rogue(&scratch, &hub).await;
    let big = vec![1u8; (64 << 10) + 1];
    rogue_link
        .writer
        .feed_chunk(&eager_offer(1, big.len() as u64), &big)
        .await
        .expect("eager offer");
    rogue_link.writer.flush().await.expect("flush");
    assert!(
        next_message(&mut rogue_link, Duration::from_secs(5))
            .await
            .is_none(),
        "the node kept a link that sent an eager offer past its credit"
    );
    // A payload shorter than the eager offer says.
    let mut rogue_link = rogue(&scratch, &hub).await;
    rogue_link
        .writer
        .send(&eager_offer(1, 1000))
        .await
        .expect("eager offer");
    let short = vec![2u8; 999];
    let header = FrameHeader::for_payload(FrameKind::Payload, &short).expect("header");
    let mut frame = header.to_bytes().to_vec();
    frame.extend_from_slice(&short);
    rogue_link
        .writer
        .danger_send_raw(&frame)
        .await
        .expect("payload");
    assert!(
        next_message(&mut rogue_link, Duration::from_secs(5))
            .await
            .is_none(),
        "the node kept a link whose eager payload had the wrong length"
    );
    assert!(
        memory_back_to(&hub, baseline, Duration::from_secs(5)).await,
        "memory of a refused eager transfer is still held"
    );
    hub.shutdown().await;
}

/// A hand-driven peer "rogue" whose hello grants the node eager credit.
async fn rogue_granting(scratch: &Scratch, node: &Node, eager_max: u64, credit: u64) -> Link {
    let target = Endpoint::Tcp(node.tcp_addrs()[0].clone());
    let terms = ferry_transports::tcp::TcpTerms {
        eager_max,
        eager_credit: credit,
    };
    let hello = ferry_transports::wire::Hello {
        transports: vec![ferry_transports::wire::Announce {
            transport: ferry_transports::wire::WireTransport::Tcp,
            terms: terms.announce().expect("tcp's terms encode"),
        }],
        ..ferry_transports::link::local_hello("rogue", Vec::new(), 4 << 20)
    };
    common::hand_driven_link_with(&scratch.secret, node, target, hello).await
}

/// The next offer from the node, and its bytes when it is eager (they follow it at once).
async fn offer_and_bytes(link: &mut Link) -> (Offer, Option<Vec<u8>>) {
    let offer = match next_message(link, Duration::from_secs(5)).await {
        Some(Message::Offer(o)) => o,
        other => panic!("expected an offer, got {other:?}"),
    };
    if !offer.eager {
        return (offer, None);
    }
    let mut bytes = vec![0u8; offer.len as usize];
    link.reader
        .read_payload_into(&mut bytes)
        .await
        .expect("the eager bytes follow their offer");
    (offer, Some(bytes))
}

/// A small send goes with its offer while it fits the peer's eager credit, and is offered
/// as usual past it; a grant for an eager offer (the peer read the bytes past) makes the
/// sender stream them again, and each send completes once the peer says `Done`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_sends_go_with_their_offer_within_the_peer_credit() {
    let scratch = Scratch::new();
    let hub = std::sync::Arc::new(hub(&scratch, "").await);
    let mut rogue = rogue_granting(&scratch, &hub, 64 << 10, 100 << 10).await;
    // Sent one after the other without waiting: 60 KiB eager, the next 60 KiB past the
    // 100 KiB credit.
    let first = patterned(&hub, 60 << 10, 1).await;
    let second = patterned(&hub, 60 << 10, 2).await;
    let third = patterned(&hub, 60 << 10, 3).await;
    let expect: Vec<Vec<u8>> = [&first, &second, &third]
        .iter()
        .map(|b| b.to_vec().expect("host"))
        .collect();
    let (n1, n2, n3) = (hub.clone(), hub.clone(), hub.clone());
    // Each send runs as a task of its own while the peer is played here.
    let s1 = tokio::spawn(async move { n1.send("rogue", 1, first).await.map(drop) });
    let (o1, b1) = offer_and_bytes(&mut rogue).await;
    assert!(o1.eager, "a send within the credit goes eagerly");
    assert_eq!(b1.as_deref(), Some(&expect[0][..]));
    let s2 = tokio::spawn(async move { n2.send("rogue", 2, second).await.map(drop) });
    let (o2, b2) = offer_and_bytes(&mut rogue).await;
    assert!(!o2.eager && b2.is_none(), "past the credit: a plain offer");
    // The first is taken; the credit is free again, and the third goes eagerly.
    rogue
        .writer
        .send(&Message::Done(ferry_transports::wire::Done {
            transfer: o1.transfer,
        }))
        .await
        .expect("done");
    s1.await
        .expect("task")
        .expect("the eager send completes on Done");
    let s3 = tokio::spawn(async move { n3.send("rogue", 3, third).await.map(drop) });
    let (o3, b3) = offer_and_bytes(&mut rogue).await;
    assert!(o3.eager && b3.is_some());
    // Both answered with grants: the second as usual, the third as if its bytes were read
    // past. Each streams its bytes, in order.
    for (offer, bytes) in [(&o2, &expect[1]), (&o3, &expect[2])] {
        rogue
            .writer
            .send(&Message::Grant(ferry_transports::wire::Grant {
                transfer: offer.transfer,
                landing: WireMemoryKind::Host,
                lent: None,
            }))
            .await
            .expect("grant");
        let chunk = match next_message(&mut rogue, Duration::from_secs(5)).await {
            Some(Message::Data(d)) => d,
            other => panic!("expected the data of {}, got {other:?}", offer.transfer),
        };
        assert_eq!(
            (chunk.transfer, chunk.len as usize),
            (offer.transfer, bytes.len())
        );
        let mut got = vec![0u8; bytes.len()];
        rogue
            .reader
            .read_payload_into(&mut got)
            .await
            .expect("payload");
        assert_eq!(&got, bytes);
        rogue
            .writer
            .send(&Message::Done(ferry_transports::wire::Done {
                transfer: offer.transfer,
            }))
            .await
            .expect("done");
    }
    s2.await.expect("task").expect("the plain send completes");
    s3.await
        .expect("task")
        .expect("the eager send read past completes once streamed");
    if let Ok(hub) = std::sync::Arc::try_unwrap(hub) {
        hub.shutdown().await;
    }
}

/// A receiver whose memory is full reads eager bytes past and grants them later, in
/// order: nothing is lost and nothing waits unbounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_offers_meeting_full_memory_wait_for_their_grant_in_order() {
    let scratch = Scratch::new();
    let hub = hub(&scratch, "[memory]\nhost = \"256KiB\"").await;
    let baseline = host_granted(&hub).await;
    let mut rogue = rogue(&scratch, &hub).await;
    const LEN: usize = 60 << 10;
    let bytes = |i: u64| vec![i as u8; LEN];
    // Four fill the budget (taken eagerly, answered Done); the fifth finds no memory and
    // the sixth an earlier offer still waiting: both read past.
    for i in 1..=6u64 {
        rogue
            .writer
            .feed_chunk(&eager_offer(i, LEN as u64), &bytes(i))
            .await
            .expect("eager offer");
        rogue.writer.flush().await.expect("flush");
        if i <= 4 {
            match next_message(&mut rogue, Duration::from_secs(5)).await {
                Some(Message::Done(d)) if d.transfer == i => {}
                other => panic!("expected Done for eager {i}, got {other:?}"),
            }
        }
    }
    // Both wait for memory before any is freed (else the reader, seeing room, would take
    // the fifth eagerly).
    assert!(
        eventually(Duration::from_secs(5), async || {
            hub.host_memory().await.expect("stats").waiting == 2
        })
        .await,
        "the fifth and sixth offers never waited for memory"
    );
    // Each recv frees one; the oldest waiting offer is granted, streamed and done.
    for (taken, waiting) in [(1u64, 5u64), (2, 6)] {
        let got = hub.recv(Some("rogue"), Some(taken)).await.expect("recv");
        assert_eq!(got.buffer.to_vec().expect("host"), bytes(taken));
        drop(got);
        granted(&mut rogue, waiting).await;
        rogue
            .writer
            .feed_chunk(
                &Message::Data(DataChunk {
                    transfer: waiting,
                    offset: 0,
                    len: LEN as u32,
                }),
                &bytes(waiting),
            )
            .await
            .expect("data");
        rogue.writer.flush().await.expect("flush");
        match next_message(&mut rogue, Duration::from_secs(5)).await {
            Some(Message::Done(d)) if d.transfer == waiting => {}
            other => panic!("expected Done for {waiting}, got {other:?}"),
        }
    }
    for i in 3..=6u64 {
        let got = hub.recv(Some("rogue"), None).await.expect("recv");
        assert_eq!(got.tag, i, "delivered out of order");
        assert_eq!(got.buffer.to_vec().expect("host"), bytes(i));
    }
    assert!(
        memory_back_to(&hub, baseline, Duration::from_secs(5)).await,
        "memory still held after every buffer was taken"
    );
    hub.shutdown().await;
}
