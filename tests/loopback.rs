//! Real `ferry` processes on loopback, host memory: transfers with checksums, one-sided
//! puts, and hostile input that must not disturb other peers. (A peer killed mid-transfer
//! and every layout, for every transport: `conformance/`.)

mod common;

use std::time::{Duration, Instant};

use common::{Scratch, Served, eventually, patterned, send_in_order_while};
use ferry::echo::{TAG_EXPOSE, TAG_WITHDRAW, decode_key, encode_key};
use ferry::{Error, MemoryKind, Node};
use futures::StreamExt;

/// A node in this process plus an echo node in a child process.
async fn with_echo(scratch: &Scratch, extra: &str) -> (Node, Served) {
    let echo_cfg = scratch.write("echo.toml", &scratch.toml("echo", &[], extra));
    let echo = Served::start(&echo_cfg, "echo");
    let node = Node::start(scratch.config("test", &[("echo", &echo.addr)], extra))
        .await
        .expect("node starts");
    (node, echo)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_buffers_round_trip_with_checksums() {
    let scratch = Scratch::new();
    let (node, _echo) = with_echo(&scratch, "[transport.tcp]\nchunk_size = \"64 KiB\"").await;
    let sizes: Vec<usize> = (0..200u64)
        .map(|i| match i % 5 {
            0 => 1 + (i as usize % 7),
            1 => 4096 + i as usize,
            2 => 65536 * 3 + 17,
            3 => (1 << 20) + 5,
            _ => 0,
        })
        .collect();
    let node = &node;
    let results: Vec<(u64, u32)> = futures::stream::iter(sizes.iter().enumerate())
        .map(|(i, &len)| async move {
            let buffer = patterned(node, len, i as u64).await;
            let crc = crc32c::crc32c(buffer.as_slice().expect("host"));
            let sent = node.send("echo", i as u64, buffer).await.expect("send");
            drop(sent);
            (i as u64, crc)
        })
        .buffer_unordered(16)
        .collect()
        .await;
    for (tag, crc) in results {
        let got = node.recv(Some("echo"), Some(tag)).await.expect("echo back");
        assert_eq!(got.peer, "echo");
        assert_eq!(got.buffer.len(), sizes[tag as usize], "tag {tag}");
        assert_eq!(
            crc32c::crc32c(got.buffer.as_slice().expect("host")),
            crc,
            "tag {tag}"
        );
    }
    // Every buffer was dropped: the budget is whole again.
    assert!(
        eventually(Duration::from_secs(2), async || {
            node.host_memory().await.is_ok_and(|m| m.granted == 0)
        })
        .await,
        "host memory still granted: {:?}",
        node.host_memory().await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_tag_arrives_in_send_order() {
    let scratch = Scratch::new();
    let (node, _echo) = with_echo(&scratch, "").await;
    node.connect("echo").await.expect("connect");
    assert!(node.connect("nobody").await.is_err(), "unknown peer");
    for i in 0..50u8 {
        let mut b = node.alloc(MemoryKind::Host, 1).await.expect("alloc");
        b.as_mut_slice().expect("fresh")[0] = i;
        node.send("echo", 7, b).await.expect("send");
    }
    for i in 0..50u8 {
        let got = node.recv(Some("echo"), Some(7)).await.expect("recv");
        assert_eq!(got.buffer.as_slice(), Some(&[i][..]));
    }
}

/// A receiver that polls before it sleeps (`recv_spin`) gets every buffer, whether it lands
/// while the receive polls or after it slept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_receives_get_every_buffer() {
    let scratch = Scratch::new();
    // Both ends poll: `recv_spin` goes into the `[node]` table the scratch file starts with.
    let polling =
        |toml: String| toml.replacen("\n\n[security]", "\nrecv_spin = \"1ms\"\n\n[security]", 1);
    let echo_cfg = scratch.write("echo.toml", &polling(scratch.toml("echo", &[], "")));
    let echo = Served::start(&echo_cfg, "echo");
    let config = polling(scratch.toml("test", &[("echo", &echo.addr)], ""));
    let config = ferry::Config::from_toml_str(&config).expect("valid test config");
    assert_eq!(config.node.recv_spin, Duration::from_millis(1));
    let node = Node::start(config).await.expect("node starts");
    for i in 0..20u64 {
        let len = if i % 2 == 0 { 8 } else { 3 << 20 };
        let b = patterned(&node, len, i).await;
        let crc = crc32c::crc32c(b.as_slice().expect("host"));
        drop(node.send("echo", i, b).await.expect("send"));
        let got = node.recv(Some("echo"), Some(i)).await.expect("echo back");
        assert_eq!(crc32c::crc32c(got.buffer.as_slice().expect("host")), crc);
    }
}

/// Sends made at once, of mixed sizes and under backpressure (a peer queue of 4), arrive
/// in the order they were first polled, there and back: the echo sends each buffer on in
/// the order it came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sends_arrive_in_first_poll_order() {
    let scratch = Scratch::new();
    let (node, _echo) = with_echo(&scratch, "[limits]\npeer_queue = 4").await;
    let sizes = [8usize, 1, 300_000, 4099, (1 << 20) + 3, 100, 8];
    let mut buffers = Vec::new();
    let mut crcs = Vec::new();
    for i in 0..sizes.len() * 15 {
        let b = patterned(&node, sizes[i % sizes.len()], i as u64).await;
        crcs.push(crc32c::crc32c(b.as_slice().expect("host")));
        buffers.push(b);
    }
    let receive = async {
        let mut seen = Vec::new();
        for (i, crc) in crcs.iter().enumerate() {
            let got = node.recv(Some("echo"), None).await.expect("echo back");
            seen.push((
                got.tag,
                got.transport,
                got.buffer.len(),
                node.has_fast_lane("echo"),
            ));
            assert_eq!(
                got.tag,
                i as u64,
                "out of order {:?}",
                &seen[seen.len().saturating_sub(6)..]
            );
            let bytes = got.buffer.as_slice().expect("host");
            assert_eq!(crc32c::crc32c(bytes), *crc, "tag {i} changed");
        }
    };
    let tag = |i: usize| i as u64;
    send_in_order_while(
        &node,
        "echo",
        (buffers, tag),
        Duration::from_secs(60),
        receive,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_to_a_connected_peer_skip_the_coordinator_and_keep_their_order() {
    let scratch = Scratch::new();
    let (node, echo) = with_echo(&scratch, "[limits]\npeer_queue = 8").await;
    assert!(!node.routes_directly("echo"), "no link yet");
    // The first of these go through the coordinator (it dials), the later ones directly
    // once the link is up and the earlier ones were answered.
    let sizes = [8usize, 70_000, 1, (1 << 20) + 3, 4096];
    let mut buffers = Vec::new();
    let mut crcs = Vec::new();
    for i in 0..sizes.len() * 20 {
        let b = patterned(&node, sizes[i % sizes.len()], i as u64).await;
        crcs.push(crc32c::crc32c(b.as_slice().expect("host")));
        buffers.push(b);
    }
    let sends = futures::stream::iter(buffers.into_iter().enumerate())
        .then(|(i, b)| {
            let node = &node;
            async move { node.send("echo", 3, b).await.map(|_| i) }
        })
        .collect::<Vec<_>>();
    let receive = async {
        for (i, crc) in crcs.iter().enumerate() {
            let got = node.recv(Some("echo"), Some(3)).await.expect("echo back");
            let bytes = got.buffer.as_slice().expect("host");
            assert_eq!(
                crc32c::crc32c(bytes),
                *crc,
                "buffer {i} out of order or changed"
            );
        }
    };
    let (sent, ()) = tokio::time::timeout(
        Duration::from_secs(60),
        futures::future::join(sends, receive),
    )
    .await
    .expect("every echo came back in time");
    assert!(sent.iter().all(Result::is_ok), "{sent:?}");
    assert!(
        node.routes_directly("echo"),
        "the link is up: routes published"
    );
    drop(echo);
    assert!(
        eventually(Duration::from_secs(10), async || !node
            .routes_directly("echo"))
        .await,
        "a gone peer's routes are withdrawn"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_into_a_granted_region() {
    let scratch = Scratch::new();
    let (node, _echo) = with_echo(&scratch, "").await;
    // Ask the echo node to expose 1 MiB, and get its key.
    let mut ask = node.alloc(MemoryKind::Host, 8).await.expect("alloc");
    ask.as_mut_slice()
        .expect("fresh")
        .copy_from_slice(&(1u64 << 20).to_le_bytes());
    node.send("echo", TAG_EXPOSE, ask)
        .await
        .expect("expose request");
    let reply = node
        .recv(Some("echo"), Some(TAG_EXPOSE))
        .await
        .expect("key");
    let key = decode_key(reply.buffer.as_slice().expect("host")).expect("a key");
    assert_eq!(key.len, 1 << 20);

    let first = patterned(&node, 300_000, 1).await;
    let second = patterned(&node, 1000, 2).await;
    let expect_first = first.to_vec().expect("host");
    let expect_second = second.to_vec().expect("host");
    node.put("echo", key, 0, first).await.expect("put at 0");
    node.put("echo", key, 700_000, second)
        .await
        .expect("put at 700000");

    // Past the region's end: refused here, before anything moves.
    let too_far = patterned(&node, 10, 3).await;
    let err = node
        .put("echo", key, (1 << 20) - 5, too_far)
        .await
        .expect_err("overrun");
    assert!(matches!(err.error, Error::Usage(_)), "{err}");
    assert!(err.buffer.is_some(), "the buffer comes back");

    // Withdraw and check what landed.
    let mut w = node.alloc(MemoryKind::Host, 24).await.expect("alloc");
    w.as_mut_slice()
        .expect("fresh")
        .copy_from_slice(&encode_key(key));
    node.send("echo", TAG_WITHDRAW, w)
        .await
        .expect("withdraw request");
    let region = node
        .recv(Some("echo"), Some(TAG_WITHDRAW))
        .await
        .expect("region");
    let bytes = region.buffer.as_slice().expect("host");
    assert_eq!(bytes.len(), 1 << 20);
    assert_eq!(&bytes[..300_000], &expect_first[..]);
    assert!(bytes[300_000..700_000].iter().all(|b| *b == 0));
    assert_eq!(&bytes[700_000..701_000], &expect_second[..]);

    // The key is stale now: the peer refuses the put.
    let late = patterned(&node, 10, 4).await;
    let err = node.put("echo", key, 0, late).await.expect_err("stale key");
    assert!(matches!(err.error, Error::Refused { .. }), "{err}");
    assert_eq!(err.kind(), ferry::ErrorKind::Refused);
    assert_eq!(err.error.peer(), Some("echo"));
    assert!(!err.kind().is_transient(), "a stale key stays stale");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_is_refused() {
    let scratch = Scratch::new();
    let other = scratch.other_secret();
    let outsider_cfg = scratch.write(
        "outsider.toml",
        &scratch.toml_with_secret("outsider", &[], "", &other),
    );
    let outsider = Served::start(&outsider_cfg, "echo");
    let node = Node::start(scratch.config("test", &[("outsider", &outsider.addr)], ""))
        .await
        .expect("node");
    let err = node.connect("outsider").await.expect_err("connect refused");
    assert!(err.to_string().contains("auth"), "{err}");
    let buffer = patterned(&node, 100, 1).await;
    let err = node.send("outsider", 1, buffer).await.expect_err("refused");
    let text = err.to_string();
    assert!(
        text.contains("auth"),
        "error should name authentication: {text}"
    );
    assert_eq!(
        node.link_counters().frames_ok(),
        0,
        "no frame was exchanged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_input_is_rejected_and_counted_while_others_are_served() {
    use ferry_transports::link::{self, Endpoint, LinkCounters, LinkOptions, Secret};
    use ferry_transports::wire::{self, Message};
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let scratch = Scratch::new();
    let (node, _echo) = with_echo(&scratch, "").await;
    let target = node.tcp_addrs()[0].clone();
    let secret = Secret::new(std::fs::read(&scratch.secret).expect("secret"));
    let opts = LinkOptions {
        max_frame: 4 << 20,
        handshake_timeout: Duration::from_secs(2),
        stall_timeout: Duration::from_secs(2),
        counters: Arc::new(LinkCounters::new()),
    };
    let counters = node.link_counters();

    // Traffic with the honest peer keeps flowing throughout.
    let node = &node;
    let honest = async {
        for i in 0..60u64 {
            let b = patterned(node, 10_000, i).await;
            let crc = crc32c::crc32c(b.as_slice().expect("host"));
            node.send("echo", i, b).await.expect("honest send");
            let got = node.recv(Some("echo"), Some(i)).await.expect("honest recv");
            assert_eq!(crc32c::crc32c(got.buffer.as_slice().expect("host")), crc);
        }
    };

    let hostile = async {
        // 1. No handshake at all, just junk: refused at authentication.
        let mut raw = tokio::net::TcpStream::connect(&target)
            .await
            .expect("connect");
        raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        // Read until the node hangs up on us.
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut sink)).await;
        drop(raw);
        // 2. The wrong secret.
        let wrong = Secret::new(b"not the secret at all, no".to_vec());
        let hello = link::local_hello("intruder", vec![ferry::TransportName::Tcp], 4 << 20);
        let refused = link::dial(&Endpoint::Tcp(target.clone()), &wrong, hello, &opts).await;
        assert!(refused.is_err(), "wrong secret accepted");

        // 3. Authenticated peers that then send bad frames.
        let valid = wire::encode(&Message::Ping(7)).expect("encode");
        let mut flipped = valid.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x10;
        let mut oversized = valid.clone();
        oversized[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        let truncated = valid[..valid.len() - 3].to_vec();
        let garbage = vec![0xA5u8; 64];
        // A truncated frame is only truncated if the connection ends after it: send it once.
        let cases = [(garbage, 4), (flipped, 4), (oversized, 4), (truncated, 1)];
        for (i, (bad, times)) in cases.into_iter().enumerate() {
            let hello = link::local_hello(
                format!("rogue{i}"),
                vec![ferry::TransportName::Tcp],
                4 << 20,
            );
            let mut l = link::dial(&Endpoint::Tcp(target.clone()), &secret, hello, &opts)
                .await
                .expect("authenticated dial");
            for _ in 0..times {
                if l.writer.danger_send_raw(&bad).await.is_err() {
                    break;
                }
            }
            let _ = l.writer.shutdown().await;
        }
    };
    tokio::join!(honest, hostile);

    assert!(
        eventually(Duration::from_secs(2), async || {
            counters.auth_failures() >= 2
                && counters.frames_rejected("bad_magic") >= 1
                && counters.frames_rejected("crc") >= 1
                && counters.frames_rejected("too_long") >= 1
                && counters.frames_rejected("truncated") >= 1
        })
        .await,
        "auth failures {}, bad_magic {}, crc {}, too_long {}, truncated {}",
        counters.auth_failures(),
        counters.frames_rejected("bad_magic"),
        counters.frames_rejected("crc"),
        counters.frames_rejected("too_long"),
        counters.frames_rejected("truncated"),
    );
    // And the node still serves: the honest peer, and a fresh connection.
    let b = patterned(node, 1 << 20, 99).await;
    node.send("echo", 99, b).await.expect("still serving");
    assert!(node.recv(Some("echo"), Some(99)).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_dialing_each_other_at_once_keep_one_link_and_lose_nothing() {
    for round in 0..10 {
        let scratch = Scratch::new();
        let dir = scratch.path().display().to_string();
        let sock = |n: &str| format!("unix:{dir}/{n}.sock");
        let extra = format!("[node]\nsocket_dir = \"{dir}\"");
        let config = |me: &str, other: &str| {
            let text = scratch.toml(me, &[(other, &sock(other))], "").replacen(
                "[node]\n",
                &format!("{extra}\n"),
                1,
            );
            ferry::Config::from_toml_str(&text).expect("config")
        };
        let a = Node::start(config("alpha", "beta")).await.expect("alpha");
        let b = Node::start(config("beta", "alpha")).await.expect("beta");
        let send = async |from: &Node, to: &str| {
            for tag in 0..5 {
                let buf = patterned(from, 1000, tag).await;
                from.send(to, tag, buf)
                    .await
                    .expect("send during a dial race");
            }
        };
        tokio::join!(send(&a, "beta"), send(&b, "alpha"));
        for tag in 0..5 {
            assert!(
                a.recv(Some("beta"), Some(tag)).await.is_ok(),
                "round {round}"
            );
            assert!(
                b.recv(Some("alpha"), Some(tag)).await.is_ok(),
                "round {round}"
            );
        }
        assert_eq!(
            a.connected_peers().await.expect("peers"),
            vec!["beta".to_string()]
        );
        a.shutdown().await;
        b.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_is_cancel_safe() {
    // Receives given up on all the time, while buffers keep arriving: none may be lost.
    let scratch = Scratch::new();
    let (node, _echo) = with_echo(&scratch, "").await;
    let node = &node;
    let sends = async {
        for tag in 0..60u64 {
            let b = patterned(node, 4096, tag).await;
            node.send("echo", tag, b).await.expect("send");
        }
    };
    let receives = async {
        let mut got = std::collections::BTreeSet::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while got.len() < 60 && Instant::now() < deadline {
            let wait = Duration::from_micros(50 + (got.len() as u64 % 7) * 100);
            if let Ok(r) = tokio::time::timeout(wait, node.recv(Some("echo"), None)).await {
                got.insert(r.expect("recv").tag);
            }
        }
        got
    };
    let ((), got) = tokio::join!(sends, receives);
    assert_eq!(
        got.len(),
        60,
        "lost buffers: {:?}",
        (0..60).filter(|t| !got.contains(t)).collect::<Vec<_>>()
    );
}

/// A peer's locality comes from the host identity in its hello (`node.host_id`, else the
/// machine's), not from its address: an echo on loopback that says another `host_id` is
/// remote, one that says ours is same-host. (Across network namespaces: `multihost.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_id_in_the_hello_decides_locality() {
    use ferry_config::Locality;
    for (echo_host, want) in [
        ("loopback-host-b", Locality::Remote),
        ("loopback-host-a", Locality::SameHost),
    ] {
        let scratch = Scratch::new();
        let echo_toml = scratch
            .toml("echo", &[], "")
            .replace("[node]\n", &format!("[node]\nhost_id = \"{echo_host}\"\n"));
        let echo = Served::start(&scratch.write("echo.toml", &echo_toml), "echo");
        let mut config = scratch.config("test", &[("echo", &echo.addr)], "");
        config.node.host_id = Some("loopback-host-a".into());
        let node = Node::start(config).await.expect("node starts");
        assert_eq!(node.host_id(), "loopback-host-a");
        // Before the hello, a loopback address says same-host.
        let before = node
            .explain("echo", 1 << 20, ferry::MemoryClass::Host, None)
            .await
            .expect("explain");
        assert_eq!(before.query.locality, Locality::SameHost);
        node.connect("echo").await.expect("connect");
        let after = node
            .explain("echo", 1 << 20, ferry::MemoryClass::Host, None)
            .await
            .expect("explain");
        assert_eq!(after.query.locality, want, "echo says {echo_host}: {after}");
        // And the bytes still cross, whatever the answer.
        let buffer = patterned(&node, 100_000, 9).await;
        let crc = crc32c::crc32c(buffer.as_slice().expect("host"));
        drop(node.send("echo", 9, buffer).await.expect("send"));
        let got = node.recv(Some("echo"), Some(9)).await.expect("echo back");
        assert_eq!(crc32c::crc32c(got.buffer.as_slice().expect("host")), crc);
    }
}

/// A block list whose offer is larger than the frames the peer takes (its
/// `limits.max_frame`) is refused at the sender as the caller's error, naming the limit,
/// with the buffer back; the link stays up, and a shorter list crosses byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_list_larger_than_the_peers_frames_is_refused_and_the_link_stays() {
    let scratch = Scratch::new();
    let small = "[limits]\nmax_frame = \"256 KiB\"\n\n\
                 [transport.tcp]\nchunk_size = \"128 KiB\"\n\n\
                 [transport.staged]\nlink_chunk = \"128 KiB\"\n";
    let (node, _echo) = with_echo(&scratch, small).await;
    let pool = patterned(&node, 40_000, 3).await;
    let whole = pool.to_vec().expect("host");
    // 20,000 blocks: an offer of some 320 KB.
    let many = ferry::Layout::blocks((0..20_000u64).map(|i| (i * 2, 1)));
    let err = node
        .send_layout("echo", 1, pool, many)
        .await
        .expect_err("an offer larger than the peer's frames");
    assert!(matches!(err.error, Error::Usage(_)), "{err}");
    assert!(err.to_string().contains("limits.max_frame"), "{err}");
    let pool = err.buffer.expect("the buffer comes back");
    // 10,000 blocks (some 160 KB of offer) go, over the same link.
    let fewer = ferry::Layout::blocks((0..10_000u64).map(|i| ((9_999 - i) * 4, 2)));
    let mut want = vec![0u8; 20_000];
    fewer.gather(&whole, 0, &mut want).expect("gather");
    drop(
        node.send_layout("echo", 2, pool, fewer)
            .await
            .expect("send"),
    );
    let got = tokio::time::timeout(Duration::from_secs(10), node.recv(Some("echo"), Some(2)))
        .await
        .expect("echo in time")
        .expect("recv");
    assert!(got.buffer.to_vec().expect("host") == want, "other bytes");
}

/// A `[[peers]]` entry whose address another node answers: the dial fails at once, naming
/// the node it was for and the node that answered, instead of leaving sends to wait out their
/// deadline; the answering node keeps no session for the mistaken link and still serves the
/// caller under its own name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_that_another_node_answers_fails_naming_both() {
    let scratch = Scratch::new();
    let c_toml = scratch.toml("c", &[], "[telemetry]\nmetrics_listen = \"127.0.0.1:0\"\n");
    let c = Served::start(&scratch.write("c.toml", &c_toml), "echo");
    let c_metrics = c.metrics_addr();
    let connected = |addr: &str| common::metric(addr, "ferry_peers_connected");
    // b's entry gives c's address.
    let node = Node::start(scratch.config("test", &[("b", &c.addr), ("c", &c.addr)], ""))
        .await
        .expect("node starts");
    let started = Instant::now();
    let err = node.connect("b").await.expect_err("c answers, not b");
    let text = err.to_string();
    assert_eq!(err.kind(), ferry::ErrorKind::PeerUnreachable, "{text}");
    assert!(
        text.contains("peer b") && text.contains("node c answered"),
        "the error names both nodes: {text}"
    );
    let buffer = patterned(&node, 1000, 1).await;
    let failed = node
        .send_by("b", 1, buffer, Instant::now() + Duration::from_secs(30))
        .await
        .expect_err("a send to b fails too");
    assert!(
        matches!(
            failed.kind(),
            ferry::ErrorKind::PeerLost | ferry::ErrorKind::PeerUnreachable
        ),
        "{failed}"
    );
    assert!(failed.to_string().contains("node c answered"), "{failed}");
    assert!(failed.buffer.is_some(), "the buffer comes back");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "failed in {:?}, not by a deadline",
        started.elapsed()
    );
    let metrics = c_metrics.clone();
    let c_sessions = tokio::task::spawn_blocking(move || connected(&metrics))
        .await
        .expect("metrics");
    assert_eq!(c_sessions, Some(0.0), "c kept a link meant for b");
    // c refused the link itself (its session gauge alone cannot tell: the dialer drops the
    // link at once too).
    let metrics = c_metrics.clone();
    let refused = tokio::task::spawn_blocking(move || {
        common::metric(&metrics, "ferry_links_refused_total{reason=\"wrong_node\"}")
    })
    .await
    .expect("metrics");
    // (At least once: the send dials b again after the first dial failed.)
    assert!(
        refused.is_some_and(|n| n >= 1.0),
        "c did not refuse the link meant for b: {refused:?}"
    );
    // c itself is served, under its own name, over the same address.
    let buffer = patterned(&node, 1000, 2).await;
    let crc = crc32c::crc32c(buffer.as_slice().expect("host"));
    drop(node.send("c", 2, buffer).await.expect("send to c"));
    let got = node.recv(Some("c"), Some(2)).await.expect("echo from c");
    assert_eq!(crc32c::crc32c(got.buffer.as_slice().expect("host")), crc);
    let metrics = c_metrics.clone();
    let c_sessions = tokio::task::spawn_blocking(move || connected(&metrics))
        .await
        .expect("metrics");
    assert_eq!(c_sessions, Some(1.0));
    assert_eq!(node.connected_peers().await.expect("peers"), ["c"]);
}

/// DNS discovery on loopback: a node configured with a name and a port only (`localhost`,
/// which the system resolver answers from /etc/hosts, perhaps with `::1` too, where nothing
/// listens) finds the echo there, learns its name from its hello, and `connect` waits for
/// that. (Several hosts, a name with many records, hosts that come and go: `multihost.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_found_by_dns_is_dialled_by_the_name_it_answers_with() {
    let scratch = Scratch::new();
    let echo = Served::start(
        &scratch.write("echo.toml", &scratch.toml("echo", &[], "")),
        "echo",
    );
    let port = echo.addr.rsplit_once(':').expect("port").1;
    let discovery = format!(
        "[discovery]\nmode = \"dns\"\ndns = [{{ name = \"localhost\", port = {port} }}]\ninterval = \"1s\"\n"
    );
    let node = Node::start(scratch.config("test", &[], &discovery))
        .await
        .expect("node starts");
    tokio::time::timeout(Duration::from_secs(10), node.connect("echo"))
        .await
        .expect("connect within 10 s")
        .expect("echo found by DNS");
    let buffer = patterned(&node, 100_000, 7).await;
    let crc = crc32c::crc32c(buffer.as_slice().expect("host"));
    drop(node.send("echo", 7, buffer).await.expect("send"));
    let got = node.recv(Some("echo"), Some(7)).await.expect("echo back");
    assert_eq!(crc32c::crc32c(got.buffer.as_slice().expect("host")), crc);
    assert_eq!(node.connected_peers().await.expect("peers"), ["echo"]);
    // A name DNS does not lead to is not waited for past discovery's first answers.
    let err = tokio::time::timeout(Duration::from_secs(10), node.connect("nobody"))
        .await
        .expect("an answer within 10 s")
        .expect_err("nobody is not found");
    assert_eq!(err.kind(), ferry::ErrorKind::PeerUnreachable, "{err}");
    assert!(err.to_string().contains("DNS discovery"), "{err}");
}

/// An address DNS gives goes to another node (a pod's IP reused by a new pod): the dial of
/// the peer learnt there finds another node, fails, and the address is known by the node
/// that answered from then on, which is dialled in its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_dns_gives_that_another_node_takes_is_relearnt() {
    let scratch = Scratch::new();
    let first = Node::start(scratch.config("first", &[], ""))
        .await
        .expect("first starts");
    let at = first.tcp_addrs()[0].clone();
    let (host, port) = at.rsplit_once(':').expect("host:port");
    let discovery = format!(
        "[discovery]\nmode = \"dns\"\ndns = [{{ name = \"{host}\", port = {port} }}]\ninterval = \"1s\"\n"
    );
    let node = Node::start(scratch.config("test", &[], &discovery))
        .await
        .expect("node starts");
    node.connect("first").await.expect("first found by DNS");
    first.shutdown().await;
    // Another node takes the address while DNS still gives it (once first's listener, closed
    // in the background, has let it go).
    let toml = scratch.toml("second", &[], "").replace("127.0.0.1:0", &at);
    let config = ferry::Config::from_toml_str(&toml).expect("config");
    let mut second = None;
    let bound = eventually(Duration::from_secs(5), async || {
        second = Node::start(config.clone()).await.ok();
        second.is_some()
    })
    .await;
    assert!(bound, "second could not listen on {at}");
    let second = second.expect("started");
    let relearnt = eventually(Duration::from_secs(10), async || {
        node.connected_peers().await.is_ok_and(|p| p == ["second"])
    })
    .await;
    assert!(
        relearnt,
        "connected to {:?}",
        node.connected_peers().await.expect("peers")
    );
    let err = node.connect("first").await.expect_err("first is gone");
    assert_eq!(err.kind(), ferry::ErrorKind::PeerUnreachable, "{err}");
    let buffer = patterned(&node, 1000, 3).await;
    drop(
        node.send("second", 3, buffer)
            .await
            .expect("send to second"),
    );
    assert!(second.recv(Some("test"), Some(3)).await.is_ok());
}

/// A node that cannot start (its listen address is taken) says why, from inside an async
/// runtime too (its own I/O runtime is shut down in the background, not dropped there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_listen_returns_the_error() {
    let scratch = Scratch::new();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let at = taken.local_addr().expect("addr").to_string();
    let toml = scratch.toml("test", &[], "").replace("127.0.0.1:0", &at);
    let config = ferry::Config::from_toml_str(&toml).expect("config");
    let err = Node::start(config).await.expect_err("the address is taken");
    assert!(
        err.to_string().contains(&format!("cannot listen on {at}")),
        "{err}"
    );
}
