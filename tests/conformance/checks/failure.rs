//! How transfers end when they do not simply succeed: dropped futures, a deadline, a
//! killed peer, a hostile frame.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{Buffer, Direction, Error, Node, SendError};
use ferry_transports::link::{Endpoint, Link};
use ferry_transports::wire::Message;

use super::{Baseline, assert_echo, filled, pattern};
use crate::combos::Combo;
use crate::common::{Scratch, eventually, hand_driven_link, next_message};
use crate::pair::{Pair, Role, Tweaks, budget_key};

/// The public API has no way to cancel a transfer: a dropped send future is documented to
/// run to its end (`Node::send`, "Cancel safety"). Sends dropped right after their first
/// poll still deliver, byte-exact and in order, and free their buffers.
pub async fn dropped_sends_still_arrive(combo: Combo, _first: bool) {
    let pair = Pair::start(&combo, Role::Echo, &Tweaks::default()).await;
    pair.warm_up().await;
    let baseline = Baseline::take(&pair.node, &combo).await;
    let node = &pair.node;
    let sizes = [(1usize << 20) + 3, 7, 0];
    let mut wants = Vec::new();
    for (k, len) in sizes.into_iter().enumerate() {
        let want = pattern(len, 10 + k as u64);
        let buffer = filled(node, combo.src_kind(), &want).await;
        let mut send = Box::pin(node.send(&pair.peer, 10 + k as u64, buffer));
        // Polled once (its place in the order taken, its transfer begun), then dropped.
        let _ = futures::poll!(send.as_mut());
        drop(send);
        wants.push((10 + k as u64, want));
    }
    let want = pattern(4096, 20);
    let buffer = filled(node, combo.src_kind(), &want).await;
    drop(
        node.send(&pair.peer, 20, buffer)
            .await
            .unwrap_or_else(|e| panic!("{combo}: the send after the dropped ones: {e}")),
    );
    wants.push((20, want));
    let mut tags = Vec::new();
    for (tag, want) in &wants {
        let got = tokio::time::timeout(Duration::from_secs(3), node.recv(Some(&pair.peer), None))
            .await
            .unwrap_or_else(|_| {
                panic!("{combo}: dropped sends must still arrive, in order; came {tags:?}, then nothing for 3 s")
            })
            .expect("recv");
        tags.push(got.tag);
        assert_eq!(
            got.tag, *tag,
            "{combo}: dropped sends must still arrive, in order; came {tags:?}"
        );
        assert_echo(&combo, &got, want, &format!("dropped send {tag}"));
    }
    baseline.assert_back(node, &combo).await;
}

/// Receives given up on at every moment, while buffers keep arriving, lose none and
/// deliver none twice (`Node::recv` is cancel safe).
pub async fn dropped_receives_lose_nothing(combo: Combo, _first: bool) {
    const COUNT: u64 = 30;
    let pair = Pair::start(&combo, Role::Echo, &Tweaks::default()).await;
    pair.warm_up().await;
    let baseline = Baseline::take(&pair.node, &combo).await;
    let node = &pair.node;
    let sends = async {
        for tag in 100..100 + COUNT {
            let buffer = filled(node, combo.src_kind(), &pattern(4096, tag)).await;
            drop(node.send(&pair.peer, tag, buffer).await.expect("send"));
        }
    };
    let receives = async {
        let mut got: BTreeMap<u64, usize> = BTreeMap::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut k = 0u64;
        while got.values().sum::<usize>() < COUNT as usize && Instant::now() < deadline {
            k += 1;
            let wait = Duration::from_micros(50 + (k % 7) * 100);
            if let Ok(r) = tokio::time::timeout(wait, node.recv(Some(&pair.peer), None)).await {
                let r = r.expect("recv");
                *got.entry(r.tag).or_default() += 1;
            }
        }
        got
    };
    let ((), got) = tokio::join!(sends, receives);
    let lost: Vec<u64> = (100..100 + COUNT)
        .filter(|t| !got.contains_key(t))
        .collect();
    let twice: Vec<u64> = got
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(t, _)| *t)
        .collect();
    assert!(
        lost.is_empty() && twice.is_empty(),
        "{combo}: dropped receives lost {lost:?}, delivered twice {twice:?}"
    );
    baseline.assert_back(node, &combo).await;
}

/// A send to the victim that ended: its tag, its result, when.
type Ended = (u64, Result<Buffer, SendError>, Instant);

/// Bytes each transfer to the victim carries; the victim has room for one.
const PIECE: usize = 4 << 20;
/// How long the deadline check gives its transfer.
const DEADLINE: Duration = Duration::from_millis(300);

/// A victim that never receives, with memory for one transfer: the first lands; one with a
/// deadline then waits for memory and fails at its deadline (`DeadlineExceeded`, the buffer
/// back); the victim is killed with three more waiting, which fail as `PeerLost` within 2 s,
/// as do sends made after the kill (`PeerLost` or `PeerUnreachable`; over the fast lane
/// when one is open); this node's memory comes back. (A far node of this process cannot be killed: there, the
/// deadline only.) With GPU memory, a second victim is also killed amid large copies.
pub async fn deadline_then_killed_peer(combo: Combo, _first: bool) {
    let tweaks = Tweaks {
        far_memory: vec![format!("{} = \"6 MiB\"", budget_key(combo.dst))],
        ..Tweaks::default()
    };
    let mut pair = Pair::start(&combo, Role::Victim, &tweaks).await;
    let baseline = Baseline::take(&pair.node, &combo).await;
    let killable = pair.seen().is_none();
    let node = Arc::clone(&pair.node);
    let (done_tx, mut done) = tokio::sync::mpsc::unbounded_channel::<Ended>();
    let count = if killable { 4 } else { 1 };
    let mut buffers = Vec::new();
    for _ in 0..count {
        buffers.push(node.alloc(combo.src_kind(), PIECE).await.expect("alloc"));
    }
    // Sent in this order (each polled once as it is made), all driven by one task.
    let driver = {
        let node = Arc::clone(&node);
        let peer = pair.peer.clone();
        tokio::spawn(async move {
            let mut sends = Vec::new();
            for (tag, buffer) in buffers.into_iter().enumerate() {
                let node = Arc::clone(&node);
                let peer = peer.clone();
                let done = done_tx.clone();
                let mut send = Box::pin(async move {
                    let result = node.send(&peer, tag as u64, buffer).await;
                    let _ = done.send((tag as u64, result, Instant::now()));
                });
                let _ = futures::poll!(send.as_mut());
                sends.push(send);
            }
            futures::future::join_all(sends).await;
        })
    };
    let next = async |done: &mut tokio::sync::mpsc::UnboundedReceiver<Ended>| {
        tokio::time::timeout(Duration::from_secs(30), done.recv())
            .await
            .unwrap_or_else(|_| panic!("{combo}: a send to the victim did not end"))
            .expect("the driver reports every send")
    };
    let (tag, first, _) = next(&mut done).await;
    assert_eq!(tag, 0, "{combo}: the first transfer did not end first");
    drop(first.unwrap_or_else(|e| panic!("{combo}: the first transfer: {e}")));

    // The deadline: no memory at the victim until it passes.
    let buffer = node.alloc(combo.src_kind(), PIECE).await.expect("alloc");
    let started = Instant::now();
    let err = node
        .send_by(&pair.peer, 9, buffer, started + DEADLINE)
        .await
        .expect_err("a transfer the peer has no memory for ends at its deadline");
    let took = started.elapsed();
    assert!(
        matches!(err.error, Error::DeadlineExceeded),
        "{combo}: {}",
        err.error
    );
    assert!(
        took >= DEADLINE - Duration::from_millis(20) && took < Duration::from_secs(2),
        "{combo}: a deadline of {DEADLINE:?} ended the transfer after {took:?}"
    );
    // Given back, unless it went over the peer's fast path (device pulls to a same-host
    // peer whose setup made one): a record the peer took may still be read, so the path
    // keeps the buffer until the peer answers (`FastPath::send`).
    let fast = combo.src == ferry::MemoryClass::Device
        && combo.direction == Direction::Pull
        && node.has_fast_lane(&pair.peer);
    match err.buffer.map(|b| b.len()) {
        None if fast => {}
        back => assert_eq!(back, Some(PIECE), "{combo}: buffer back"),
    }

    if killable {
        // Small GPU buffers to a same-host peer may take the fast lane (when the setup made
        // one): then the sends after the kill below go over it.
        let lane = combo.src == ferry::MemoryClass::Device
            && eventually(Duration::from_secs(1), async || {
                node.has_fast_lane(&pair.peer)
            })
            .await;
        assert!(pair.kill());
        let killed = Instant::now();
        for _ in 1..count {
            let (tag, result, at) = next(&mut done).await;
            let err = result.expect_err("a transfer waiting on a killed peer fails");
            assert!(
                matches!(err.error, Error::PeerLost { .. }),
                "{combo}: tag {tag}: {}",
                err.error
            );
            // A buffer offered to be pulled may be mapped by the dead peer: it is freed
            // when its lease runs out, not given back.
            if combo.direction == Direction::Push {
                assert!(
                    err.buffer.is_some(),
                    "{combo}: tag {tag}: the buffer comes back"
                );
            }
            let after = at.duration_since(killed);
            assert!(
                after < Duration::from_secs(2),
                "{combo}: tag {tag} failed {after:?} after the kill"
            );
        }
        // Sends made after the kill fail too, within 2 s of it.
        for tag in 20..24u64 {
            let buffer = filled(&node, combo.src_kind(), &pattern(8, tag)).await;
            let err = node
                .send(&pair.peer, tag, buffer)
                .await
                .expect_err("a send to a killed peer fails");
            assert!(
                matches!(
                    err.error,
                    Error::PeerLost { .. } | Error::PeerUnreachable { .. }
                ),
                "{combo}: a send after the kill{}: {}",
                if lane { " (fast lane)" } else { "" },
                err.error
            );
        }
        let after = killed.elapsed();
        assert!(
            after < Duration::from_secs(2),
            "{combo}: the sends after the kill ended {after:?} after it"
        );
        if lane {
            println!("{combo}: the sends after the kill took the fast lane");
        }
    } else {
        println!("{combo}: the far node is in this process and cannot be killed: deadline only");
    }
    driver.await.expect("the driver");
    drop(node);
    baseline.assert_back(&pair.node, &combo).await;
    if killable && combo.touches_device() {
        killed_amid_copies(&combo).await;
    }
}

/// A receiving peer killed while 16 transfers of 256 MiB of GPU memory (4 GiB) are being
/// copied: every send ends within 2 s of the kill, some of them failed by it, and GPU
/// memory comes back.
async fn killed_amid_copies(combo: &Combo) {
    let pair = Pair::start(combo, Role::Echo, &Tweaks::default()).await;
    // The transport's setup first, so that the kill lands among copies.
    pair.warm_up().await;
    let baseline = Baseline::take(&pair.node, combo).await;
    let chunk = pattern(64 << 20, 2);
    let mut buffers = Vec::new();
    for _ in 0..16 {
        let mut b = pair
            .node
            .alloc(combo.src_kind(), 256 << 20)
            .await
            .expect("alloc");
        for k in 0..4 {
            b.write(k * chunk.len(), &chunk).expect("fill");
        }
        buffers.push(b);
    }
    let mut sends = Vec::new();
    for (i, b) in buffers.into_iter().enumerate() {
        let node = Arc::clone(&pair.node);
        let peer = pair.peer.clone();
        sends.push(tokio::spawn(async move {
            node.send(&peer, i as u64, b)
                .await
                .map(drop)
                .map_err(|e| e.error)
        }));
    }
    let mut pair = pair;
    assert!(pair.kill());
    let killed = Instant::now();
    let mut failed = 0;
    for s in sends {
        if let Err(e) = s.await.expect("join") {
            assert!(
                matches!(e, Error::PeerLost { .. }),
                "{combo}: amid copies: {e}"
            );
            failed += 1;
        }
    }
    let took = killed.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "{combo}: the sends took {took:?} to end after the kill amid copies"
    );
    assert!(failed > 0, "{combo}: the kill amid copies cut off no send");
    // Echoes that came back before the kill wait in the inbox: taken and dropped.
    while let Ok(Ok(got)) =
        tokio::time::timeout(Duration::from_millis(200), pair.node.recv(None, None)).await
    {
        drop(got);
    }
    baseline.assert_back(&pair.node, combo).await;
}

/// An authenticated peer announcing the transport answers this node's first message of a
/// transfer over it with a corrupt frame: the node ends that link at once (counting the
/// frame), the transfer fails within 2 s as `PeerLost`, and memory comes back.
pub async fn corrupt_frame_ends_the_link_and_its_transfer(combo: Combo, _first: bool) {
    let scratch = Scratch::new();
    let rogue_name = format!("rogue{}", crate::pair::next_id());
    let hub_name = format!("hub{}", crate::pair::next_id());
    let dir = scratch.path().join("sockets");
    std::fs::create_dir_all(&dir).expect("socket dir");
    // The rogue is a configured peer that dials in; nothing listens at its address.
    let text = crate::pair::node_toml(
        &scratch,
        &hub_name,
        &[(&rogue_name, "127.0.0.1:9")],
        &combo,
        &Tweaks::default(),
        &dir,
    );
    let config = ferry::Config::from_toml_str(&text).expect("the hub's config");
    let hub = Node::start(config).await.expect("the hub starts");
    let baseline = Baseline::take(&hub, &combo).await;
    let mut rogue = rogue(&scratch, &hub, &rogue_name, &combo).await;

    let send = async {
        let buffer = filled(&hub, combo.src_kind(), &pattern(100_000, 1)).await;
        let started = Instant::now();
        let result = hub.send(&rogue_name, 1, buffer).await;
        (result, started.elapsed())
    };
    let corrupt = async {
        let first = next_message(&mut rogue, Duration::from_secs(5)).await;
        assert!(
            first.is_some(),
            "{combo}: the hub hung up before sending anything"
        );
        let mut bytes = ferry_transports::wire::encode(&Message::Ping(7)).expect("encode");
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        rogue
            .writer
            .danger_send_raw(&bytes)
            .await
            .expect("write the corrupt frame");
        // The hub hangs up.
        next_message(&mut rogue, Duration::from_secs(5)).await
    };
    let ((result, took), after) = tokio::join!(send, corrupt);
    let err = result.expect_err("a transfer answered by a corrupt frame failed");
    assert!(
        matches!(err.error, Error::PeerLost { .. }),
        "{combo}: {}",
        err.error
    );
    assert!(
        took < Duration::from_secs(2),
        "{combo}: the send ended {took:?} after it began"
    );
    assert!(
        after.is_none(),
        "{combo}: the link went on after a corrupt frame: {after:?}"
    );
    assert_eq!(hub.link_counters().frames_rejected("crc"), 1, "{combo}");
    drop(err);
    baseline.assert_back(&hub, &combo).await;
    hub.shutdown().await;
}

/// An authenticated link to `hub` that introduces itself as `name`, announces the
/// combination's transport and is driven by hand: over the Unix socket when the transport
/// passes file descriptors, else over TCP.
async fn rogue(scratch: &Scratch, hub: &Node, name: &str, combo: &Combo) -> Link {
    let target = match hub.unix_path() {
        Some(path) if combo.caps.needs_fd_passing => Endpoint::Unix(path.to_path_buf()),
        _ => Endpoint::Tcp(hub.tcp_addrs()[0].clone()),
    };
    hand_driven_link(&scratch.secret, hub, target, name, vec![combo.caps.name]).await
}
