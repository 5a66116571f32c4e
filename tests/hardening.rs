//! What an attacker without the secret, and an authenticated peer that misbehaves, can do to
//! a node: real nodes on loopback, raw sockets and a hand-driven authenticated link playing
//! the hostile side.

mod common;

use std::time::{Duration, Instant};

use common::{Scratch, eventually, hand_driven_link, next_message, patterned};
use ferry::Node;
use ferry_transports::link::{Endpoint, Link};
use ferry_transports::wire::{
    DataChunk, FrameHeader, FrameKind, Layout, Message, Offer, WireDirection, WireMemoryKind,
    WireReason,
};
use tokio::io::AsyncWriteExt;

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
        transfer,
        tag: transfer,
        len,
        source: WireMemoryKind::Host,
        transport: ferry_transports::wire::WireTransport::Tcp,
        direction: WireDirection::Push,
        ipc: None,
        ucx: None,
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
            target: None,
            ucx: None,
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
                target: None,
                ucx: None,
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
