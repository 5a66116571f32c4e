//! The ucx transport between two nodes of this process (UCX over tcp on loopback): what the
//! conformance suite does not reach. Skipped, saying so, where UCX does not load, unless
//! FERRY_UCX_TESTS=1 (CI) makes that a failure.

mod common;

use std::time::Duration;

use common::{Scratch, Served, eventually, http_get, patterned, send_in_order_while};
use ferry::Node;
use ferry_transports::ucx::{EndpointLanes, RmaPath};

/// The lanes of `node`'s UCX endpoint to `peer`, as its ucx part says (`Node::inspect`).
async fn ucx_lanes(node: &Node, peer: &str) -> Result<EndpointLanes, ferry::Error> {
    let answer = node
        .inspect(peer, ferry::TransportName::Ucx, "lanes")
        .await?;
    Ok(*answer
        .downcast::<EndpointLanes>()
        .expect("ucx answers its lanes"))
}

/// How many keys of `peer`'s registrations `node`'s UCX endpoint holds unpacked.
async fn ucx_unpacked_keys(node: &Node, peer: &str) -> Result<usize, ferry::Error> {
    let answer = (node.inspect(peer, ferry::TransportName::Ucx, "unpacked_keys")).await?;
    Ok(*answer.downcast::<usize>().expect("ucx answers its keys"))
}

const RULE: &str = "[[transport.rules]]\nname = \"r\"\ntransports = [\"ucx\", \"tcp\"]\n";

/// A node's extra settings: ucx on, over UCX's tcp alone on loopback, routed first.
fn over_tcp_only() -> String {
    format!("[transport.ucx]\nenabled = \"on\"\ntls = \"tcp\"\nnet_devices = \"lo\"\n\n{RULE}")
}

/// Nodes `a` and `b` of this process with `extra` settings, `a` linked to `b`.
async fn linked_pair(scratch: &Scratch, extra: &str) -> (Node, Node) {
    let b = Node::start(scratch.config("b", &[], extra))
        .await
        .expect("b");
    let addr = b.tcp_addrs()[0].clone();
    let a = Node::start(scratch.config("a", &[("b", &addr)], extra))
        .await
        .expect("a");
    a.connect("b").await.expect("link");
    (a, b)
}

fn ucx_here(test: &str) -> bool {
    match ucx_sys::Ucx::load(None) {
        Ok(_) => true,
        Err(e) => {
            assert_ne!(
                std::env::var("FERRY_UCX_TESTS").as_deref(),
                Ok("1"),
                "{test}: FERRY_UCX_TESTS=1 but UCX does not load: {e}"
            );
            println!("skipped: {test}: UCX does not load here: {e}");
            false
        }
    }
}

/// A node serving ucx sends to one that does not: its first sends, routed before the
/// peer's hello says so, take the rule's next transport (tcp) instead of being refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_sends_to_a_peer_without_ucx_go_over_tcp() {
    if !ucx_here("first_sends_to_a_peer_without_ucx_go_over_tcp") {
        return;
    }
    let scratch = Scratch::new();
    let b_extra = format!("[transport.ucx]\nenabled = \"off\"\n\n{RULE}");
    let b = Node::start(scratch.config("b", &[], &b_extra))
        .await
        .expect("b");
    let addr = b.tcp_addrs()[0].clone();
    let a_extra = format!("[transport.ucx]\nenabled = \"on\"\n\n{RULE}");
    let a = Node::start(scratch.config("a", &[("b", &addr)], &a_extra))
        .await
        .expect("a");
    for tag in 1..=3u64 {
        let buffer = patterned(&a, 4096, tag).await;
        a.send("b", tag, buffer).await.expect("send over tcp");
        let got = b.recv(Some("a"), Some(tag)).await.expect("recv");
        assert_eq!(got.transport.as_str(), "tcp", "tag {tag}");
    }
    // No endpoint to a peer that does not serve ucx, and its lanes say so.
    let lanes = ucx_lanes(&a, "b").await.expect_err("b does not serve ucx");
    assert!(lanes.to_string().contains("does not serve ucx"), "{lanes}");
    a.shutdown().await;
    b.shutdown().await;
}

/// Reads that time out (a tiny `op_timeout` against a large transfer) fail their transfer,
/// close the endpoint, and neither crash the process (the sender holds the registration
/// the peer was reading instead of freeing it) nor poison later sends: the next ones
/// connect anew and arrive byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_read_fails_its_transfer_and_later_sends_connect_anew() {
    if !ucx_here("a_timed_out_read_fails_its_transfer_and_later_sends_connect_anew") {
        return;
    }
    let scratch = Scratch::new();
    let extra = format!(
        "[transport.ucx]\nenabled = \"on\"\nop_timeout = \"100ms\"\n\n\
         [memory]\nexport_lease_timeout = \"1s\"\n\n{RULE}"
    );
    let (a, b) = linked_pair(&scratch, &extra).await;
    // Warm: the endpoint exists and works.
    let small = patterned(&a, 4096, 1).await;
    a.send("b", 1, small).await.expect("a small send");
    let got = b.recv(Some("a"), Some(1)).await.expect("recv");
    assert_eq!(got.transport.as_str(), "ucx");
    drop(got);
    // 256 MiB: read in 16 MiB pieces, each of which may or may not finish within 100 ms
    // on a loaded machine. Either outcome is fine; what follows must work.
    let big = patterned(&a, 256 << 20, 2).await;
    let big = a.send("b", 2, big).await;
    println!(
        "the big send: {:?}",
        big.as_ref().map(|_| ()).map_err(|e| e.error.to_string())
    );
    let _ = tokio::time::timeout(Duration::from_secs(5), b.recv(Some("a"), Some(2))).await;
    for tag in 3..=5u64 {
        let small = patterned(&a, 4096, tag).await;
        let expect = patterned(&a, 4096, tag).await;
        a.send("b", tag, small)
            .await
            .unwrap_or_else(|e| panic!("send {tag} after the big one: {e}"));
        let got = b.recv(Some("a"), Some(tag)).await.expect("recv");
        assert_eq!(got.buffer.as_slice(), expect.as_slice(), "tag {tag}");
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// Two UCX releases: this process loads one (`FERRY_UCX_LIBRARY`, else the system's), a
/// `ferry serve` child another (`FERRY_UCX_OTHER_LIBRARY`; CI: the libucx-cu12 1.22 wheel
/// against Debian's 1.13). The peer's UCX address does not unpack here, so ucx is not used
/// with it: `explain` says why, and sends take the rule's next transport (tcp). Skipped,
/// saying so, without `FERRY_UCX_OTHER_LIBRARY`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_on_another_ucx_release_falls_back_to_tcp_with_the_reason() {
    let test = "a_peer_on_another_ucx_release_falls_back_to_tcp_with_the_reason";
    let Some(other) = std::env::var_os("FERRY_UCX_OTHER_LIBRARY") else {
        println!("skipped: {test}: FERRY_UCX_OTHER_LIBRARY names no second UCX");
        return;
    };
    if !ucx_here(test) {
        return;
    }
    let scratch = Scratch::new();
    let extra = format!("[transport.ucx]\nenabled = \"on\"\n\n{RULE}");
    let far = scratch.write("b.toml", &scratch.toml("b", &[], &extra));
    let mut command = std::process::Command::new(common::ferry_bin());
    command
        .args(["serve", "--config"])
        .arg(&far)
        .args(["--role", "echo"])
        .env("FERRY_UCX_LIBRARY", &other);
    let b = common::Served::spawn(command);
    let a = Node::start(scratch.config("a", &[("b", &b.addr)], &extra))
        .await
        .expect("a");
    a.connect("b").await.expect("link");
    let e = a
        .explain("b", 1 << 20, ferry::MemoryClass::Host, None)
        .await
        .expect("explain");
    let chosen = e.chosen.as_ref().map(|r| r.transport);
    assert_eq!(chosen, Some(ferry::TransportName::Tcp), "{e}");
    let text = e.to_string();
    assert!(text.contains("the peer's UCX cannot be used"), "{text}");
    for tag in 1..=3u64 {
        let buffer = patterned(&a, 1 << 20, tag).await;
        drop(a.send("b", tag, buffer).await.expect("send over tcp"));
        let got = a.recv(Some("b"), Some(tag)).await.expect("echo");
        assert_eq!(got.transport.as_str(), "tcp", "tag {tag}");
    }
    a.shutdown().await;
}

/// Over UCX's tcp alone on loopback, a node names the lanes of its endpoint to a peer: on
/// UCX 1.14 and later `tcp` on `lo`, judged as reads emulated over tcp; on 1.13 unknown,
/// said so. After a send the peer pulled, the peer (b) reports its own endpoint (to a) the
/// same way. Runs against whichever UCX this process loads (CI: the system's 1.13, then
/// the libucx-cu12 1.22 wheel through `FERRY_UCX_LIBRARY`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_names_its_ucx_lanes_to_a_peer_over_tcp() {
    let test = "a_node_names_its_ucx_lanes_to_a_peer_over_tcp";
    if !ucx_here(test) {
        return;
    }
    let Ok(ucx) = ucx_sys::Ucx::load(None) else {
        return;
    };
    let scratch = Scratch::new();
    let extra = over_tcp_only();
    let (a, b) = linked_pair(&scratch, &extra).await;
    let probed = ucx_lanes(&a, "b").await.expect("a's lanes to b");
    println!("UCX {}: a -> b: {probed}", ucx.version());
    assert!(
        probed.after_first_use,
        "flushed before answering: {probed:?}"
    );

    let buffer = patterned(&a, 1 << 20, 1).await;
    drop(a.send("b", 1, buffer).await.expect("a send over ucx"));
    let got = b.recv(Some("a"), Some(1)).await.expect("recv");
    assert_eq!(got.transport.as_str(), "ucx");
    drop(got);
    let pulled = ucx_lanes(&b, "a").await.expect("b's lanes to a");
    println!("b -> a, after its pull: {pulled}");

    for lanes in [&probed, &pulled] {
        if ucx.version() < ucx_sys::result::EP_TRANSPORTS_SINCE {
            assert_eq!(lanes.rma(), None, "{lanes:?}");
            assert!(
                lanes.to_string().starts_with("unknown (UCX < 1.14"),
                "{lanes}"
            );
            continue;
        }
        let entries = lanes.lanes.as_ref().expect("UCX >= 1.14 names the lanes");
        assert!(!entries.is_empty(), "{lanes}");
        assert!(
            entries
                .iter()
                .all(|l| l.transport == "tcp" && l.device == "lo"),
            "{lanes}"
        );
        assert_eq!(lanes.rma(), Some(RmaPath::EmulatedOverTcp), "{lanes}");
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// A `ferry serve` echo peer that pulls over UCX's tcp alone warns (on its stderr) and
/// counts the peer once in `ferry_ucx_emulated_rma_peers_total`, however many pulls follow,
/// where UCX can name the lanes (1.14 and later); on 1.13 the counter stays at 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_pulling_over_tcp_only_is_counted_once() {
    let test = "a_peer_pulling_over_tcp_only_is_counted_once";
    if !ucx_here(test) {
        return;
    }
    let Ok(ucx) = ucx_sys::Ucx::load(None) else {
        return;
    };
    let scratch = Scratch::new();
    let extra = over_tcp_only();
    let metrics = "[telemetry]\nmetrics_listen = \"127.0.0.1:0\"\n\n";
    let echo_cfg = scratch.write(
        "echo.toml",
        &scratch.toml("echo", &[], &format!("{metrics}{extra}")),
    );
    // The child loads the UCX this process does (FERRY_UCX_LIBRARY is inherited).
    let echo = Served::start(&echo_cfg, "echo");
    let scrape_at = echo
        .ready
        .split("metrics http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .map(|s| s.trim().to_string())
        .expect("a metrics address in the ready line");
    let counted = || {
        let (_, body) = http_get(&scrape_at, "/metrics").expect("/metrics answers");
        body.lines()
            .find_map(|l| l.strip_prefix("ferry_ucx_emulated_rma_peers_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    assert_eq!(counted(), Some(0.0), "registered at 0 before any pull");
    let a = Node::start(scratch.config("a", &[("echo", &echo.addr)], &extra))
        .await
        .expect("a");
    for tag in 1..=3u64 {
        let buffer = patterned(&a, 1 << 20, tag).await;
        drop(a.send("echo", tag, buffer).await.expect("send over ucx"));
        let got = a.recv(Some("echo"), Some(tag)).await.expect("echo");
        assert_eq!(got.transport.as_str(), "ucx", "tag {tag}");
    }
    let expect = if ucx.version() < ucx_sys::result::EP_TRANSPORTS_SINCE {
        0.0
    } else {
        1.0
    };
    let settled = eventually(Duration::from_secs(5), async || counted() == Some(expect)).await;
    assert!(
        settled,
        "UCX {}: counted {:?}, expected {expect}",
        ucx.version(),
        counted()
    );
    a.shutdown().await;
}

/// `ferry explain` for a route over ucx names the lanes of a UCX endpoint to the peer, and
/// warns when UCX emulates reads over tcp (1.14 and later); on 1.13 it says they are
/// unknown, and why.
#[test]
fn explain_names_the_ucx_lanes_of_a_route_over_ucx() {
    let test = "explain_names_the_ucx_lanes_of_a_route_over_ucx";
    if !ucx_here(test) {
        return;
    }
    let Ok(ucx) = ucx_sys::Ucx::load(None) else {
        return;
    };
    let scratch = Scratch::new();
    let extra = over_tcp_only();
    let b = scratch.write("b.toml", &scratch.toml("b", &[], &extra));
    let served = Served::start(&b, "echo");
    let a = scratch.write("a.toml", &scratch.toml("a", &[("b", &served.addr)], &extra));
    let out = std::process::Command::new(common::ferry_bin())
        .arg("explain")
        .arg("--config")
        .arg(&a)
        .args(["--peer", "b", "--bytes", "1M", "--memory", "host"])
        .env("RUST_LOG", "error")
        .output()
        .expect("run ferry explain");
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("ucx, pull"), "{text}");
    if ucx.version() < ucx_sys::result::EP_TRANSPORTS_SINCE {
        assert!(
            text.contains("this node's endpoint to b: unknown (UCX < 1.14"),
            "{text}"
        );
        assert!(!text.contains("software emulation"), "{text}");
    } else {
        assert!(
            text.contains("this node's endpoint to b: tcp/lo: gets and puts emulated"),
            "{text}"
        );
        assert!(
            text.contains("UCX reads between this node and b go over tcp (software emulation"),
            "{text}"
        );
    }
}

/// Ucx alone, by push: the sender writes (`ucp_put`) into the buffer the receiver lends,
/// over UCX's tcp, where the receiver lends only with `emulated_push` (else the pushes
/// stream over ferry's link).
fn pushed_over_tcp_only(emulated_push: bool) -> String {
    format!(
        "[transport.ucx]\nenabled = \"on\"\ntls = \"tcp\"\nnet_devices = \"lo\"\n\
         emulated_push = {emulated_push}\n\n\
         [[transport.rules]]\nname = \"r\"\ntransports = [\"ucx\"]\ndirection = \"push\"\n"
    )
}

/// Pushes over UCX's tcp (the receiver lends memory there with `emulated_push`): each is
/// delivered only once every byte is in the receiver's buffer, though UCX's puts travel on
/// a connection of their own and the `Written` that says so on ferry's link: the sender
/// flushes its endpoint before `Written`. Many pushes of 4 MiB at once, every byte checked
/// as it is delivered. (On loopback a missing flush went unseen here: UCX's tcp puts
/// completed after the peer had the bytes. It matters where puts complete locally, as
/// RDMA writes do.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_bytes_are_all_there_when_delivered() {
    let test = "pushed_bytes_are_all_there_when_delivered";
    if !ucx_here(test) {
        return;
    }
    let scratch = Scratch::new();
    let extra = pushed_over_tcp_only(true);
    let (a, b) = linked_pair(&scratch, &extra).await;
    let a = std::sync::Arc::new(a);
    let e = a
        .explain("b", 4 << 20, ferry::MemoryClass::Host, None)
        .await
        .expect("explain");
    let chosen = e.chosen.as_ref().map(|r| (r.transport, r.direction));
    assert_eq!(
        chosen,
        Some((ferry::TransportName::Ucx, ferry::Direction::Push)),
        "{e}"
    );
    const LEN: usize = 4 << 20;
    let rounds = 4u64;
    let window = 8u64;
    for round in 0..rounds {
        let mut sends = Vec::new();
        for i in 0..window {
            let tag = round * window + i + 1;
            let buffer = patterned(&a, LEN, tag).await;
            let a = a.clone();
            sends.push(tokio::spawn(async move { a.send("b", tag, buffer).await }));
        }
        for i in 0..window {
            let tag = round * window + i + 1;
            let got = b.recv(Some("a"), Some(tag)).await.expect("recv");
            assert_eq!(got.transport.as_str(), "ucx", "tag {tag}");
            let want = patterned(&b, LEN, tag).await;
            let (got, want) = (got.buffer.as_slice(), want.as_slice());
            assert!(
                got == want,
                "tag {tag}: the pushed bytes differ (first at {:?})",
                got.zip(want)
                    .and_then(|(g, w)| g.iter().zip(w).position(|(x, y)| x != y))
            );
        }
        for send in sends {
            drop(send.await.expect("task").expect("pushed"));
        }
    }
    let a = std::sync::Arc::into_inner(a).expect("no send holds a");
    a.shutdown().await;
    b.shutdown().await;
}

/// A peer killed while it pushes to this node over ucx (a `ferry serve` echo peer pushing
/// back what it got, over UCX's tcp, with the default `emulated_push = false`): this
/// process lends it no memory there (UCX would apply the writes itself, and a writer that
/// dies mid-write can abort this process: `transports/tests/ucx_engine.rs`), so the
/// pushes stream over ferry's link; the process lives on, every send ends, the memory
/// comes back, and the node goes on sending to another peer over UCX.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_killed_mid_push_ends_its_transfers_and_this_node_lives() {
    let test = "a_writer_killed_mid_push_ends_its_transfers_and_this_node_lives";
    if !ucx_here(test) {
        return;
    }
    let scratch = Scratch::new();
    let extra = format!(
        "[memory]\nexport_lease_timeout = \"1s\"\n\n{}",
        pushed_over_tcp_only(false)
    );
    let echo_cfg = scratch.write("echo.toml", &scratch.toml("echo", &[], &extra));
    let mut echo = Served::start(&echo_cfg, "echo");
    let other = Node::start(scratch.config("other", &[], &extra))
        .await
        .expect("other");
    let other_addr = other.tcp_addrs()[0].clone();
    let peers = [("echo", echo.addr.as_str()), ("other", other_addr.as_str())];
    let a = Node::start(scratch.config("a", &peers, &extra))
        .await
        .expect("a");
    let a = std::sync::Arc::new(a);
    let idle = a.host_memory().await.expect("stats").granted;
    const LEN: usize = 64 << 20;
    let mut sends = Vec::new();
    for tag in 1..=8u64 {
        let buffer = patterned(&a, LEN, tag).await;
        let a = std::sync::Arc::clone(&a);
        sends.push(tokio::spawn(
            async move { a.send("echo", tag, buffer).await },
        ));
    }
    // The first echo back means the peer is pushing the rest into our lent buffers.
    let first = a.recv(Some("echo"), Some(1)).await.expect("the first echo");
    drop(first);
    echo.child.kill().expect("SIGKILL");
    let killed = std::time::Instant::now();
    let mut failed = 0;
    for send in sends {
        let ended = tokio::time::timeout(Duration::from_secs(5), send)
            .await
            .expect("a send ends within 5 s of the kill")
            .expect("task");
        failed += usize::from(ended.is_err());
    }
    println!(
        "{failed} of 8 sends failed; all ended {:?} after the kill",
        killed.elapsed()
    );
    // Echoes delivered before the kill wait in the inbox: taken and dropped.
    while let Ok(Ok(got)) =
        tokio::time::timeout(Duration::from_millis(200), a.recv(Some("echo"), None)).await
    {
        drop(got);
    }
    let back = eventually(Duration::from_secs(10), async || {
        a.host_memory().await.is_ok_and(|s| s.granted == idle)
    })
    .await;
    let now = a.host_memory().await.expect("stats").granted;
    assert!(
        back,
        "host memory granted: {now} bytes, {idle} before the sends"
    );
    // This process lived through the kill; its UCX still moves bytes to another peer.
    let buffer = patterned(&a, 1 << 20, 99).await;
    drop(
        a.send("other", 99, buffer)
            .await
            .expect("a send to another peer"),
    );
    let got = other.recv(Some("a"), Some(99)).await.expect("recv");
    assert_eq!(got.transport.as_str(), "ucx");
    drop(got);
    let a = std::sync::Arc::into_inner(a).expect("no send holds a");
    a.shutdown().await;
    other.shutdown().await;
}

/// A key of a peer's registration is used for the one transfer it was made for and no
/// other: each registration lives from its offer (or grant) until the transfer ends, and
/// the endpoint that used its key forgets it then, so no key of memory the peer may since
/// have freed stays unpacked. Pulls (b reads a's buffers) and pushes (a writes b's) alike:
/// after 16 transfers each way, neither endpoint holds a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_forgotten_when_its_transfer_ends() {
    let test = "a_key_is_forgotten_when_its_transfer_ends";
    if !ucx_here(test) {
        return;
    }
    for (extra, reader_of_keys) in [
        (over_tcp_only(), "pull"),
        (pushed_over_tcp_only(true), "push"),
    ] {
        let scratch = Scratch::new();
        let (a, b) = linked_pair(&scratch, &extra).await;
        for tag in 1..=16u64 {
            let buffer = patterned(&a, 256 << 10, tag).await;
            drop(a.send("b", tag, buffer).await.expect("send over ucx"));
            let got = b.recv(Some("a"), Some(tag)).await.expect("recv");
            assert_eq!(got.transport.as_str(), "ucx", "{reader_of_keys} {tag}");
        }
        // The pulling side (b) or the writing side (a) used 16 keys; none is left.
        let (user, peer) = if reader_of_keys == "pull" {
            (&b, "a")
        } else {
            (&a, "b")
        };
        let none_left = eventually(Duration::from_secs(5), async || {
            ucx_unpacked_keys(user, peer).await.is_ok_and(|n| n == 0)
        })
        .await;
        let held = ucx_unpacked_keys(user, peer).await;
        assert!(none_left, "{reader_of_keys}: {held:?} keys still unpacked");
        a.shutdown().await;
        b.shutdown().await;
    }
}

/// Over UCX's tcp alone a receiver lends no memory to a peer's push (UCX would apply the
/// writes itself there): every push streams over ferry's link and is counted in
/// `ferry_ucx_pushes_streamed_total`, one per push, and arrives whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_stream_over_the_link_where_ucx_would_apply_the_writes() {
    let test = "pushes_stream_over_the_link_where_ucx_would_apply_the_writes";
    if !ucx_here(test) {
        return;
    }
    let scratch = Scratch::new();
    let extra = pushed_over_tcp_only(false);
    let metrics = "[telemetry]\nmetrics_listen = \"127.0.0.1:0\"\n\n";
    let sink_cfg = scratch.write(
        "sink.toml",
        &scratch.toml("sink", &[], &format!("{metrics}{extra}")),
    );
    let sink = Served::start(&sink_cfg, "echo");
    let scrape_at = sink.metrics_addr();
    let streamed = || {
        let (_, body) = http_get(&scrape_at, "/metrics").expect("/metrics answers");
        body.lines()
            .find_map(|l| l.strip_prefix("ferry_ucx_pushes_streamed_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    assert_eq!(streamed(), Some(0.0), "registered at 0 before any push");
    let a = Node::start(scratch.config("a", &[("sink", &sink.addr)], &extra))
        .await
        .expect("a");
    a.connect("sink").await.expect("link");
    for tag in 1..=4u64 {
        let buffer = patterned(&a, 1 << 20, tag).await;
        drop(a.send("sink", tag, buffer).await.expect("pushed"));
        // The echo comes back the same way (a streams too) and whole.
        let got = a.recv(Some("sink"), Some(tag)).await.expect("echo");
        let want = patterned(&a, 1 << 20, tag).await;
        assert_eq!(got.buffer.as_slice(), want.as_slice(), "tag {tag}");
    }
    let counted = eventually(Duration::from_secs(5), async || streamed() == Some(4.0)).await;
    assert!(counted, "streamed pushes counted: {:?}", streamed());
    a.shutdown().await;
}

/// Sends whose buffers UCX registers first (pulls over ucx, registered on a blocking thread
/// while the actor goes on) and sends that need nothing (small ones over tcp) arrive in the
/// order they were made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_behind_a_registration_keep_their_order() {
    let test = "sends_behind_a_registration_keep_their_order";
    if !ucx_here(test) {
        return;
    }
    let small_over_tcp = "[[transport.rules]]\nname = \"small\"\nmax_bytes = \"64 KiB\"\n\
                          transports = [\"tcp\"]\n\n";
    let extra = format!(
        "[transport.ucx]\nenabled = \"on\"\ntls = \"tcp\"\nnet_devices = \"lo\"\n\n\
         {small_over_tcp}{RULE}"
    );
    let scratch = Scratch::new();
    let (a, b) = linked_pair(&scratch, &extra).await;
    let sizes = [300_000usize, 8, 1 << 20, 100, 70_000, 1];
    let mut buffers = Vec::new();
    for i in 0..sizes.len() * 8 {
        buffers.push(patterned(&a, sizes[i % sizes.len()], i as u64).await);
    }
    let crcs: Vec<u32> = buffers
        .iter()
        .map(|b| crc32c::crc32c(b.as_slice().expect("host")))
        .collect();
    let receive = async {
        let mut transports = std::collections::HashSet::new();
        for (i, crc) in crcs.iter().enumerate() {
            let got = b.recv(Some("a"), Some(9)).await.expect("recv");
            let bytes = got.buffer.as_slice().expect("host");
            assert_eq!(
                crc32c::crc32c(bytes),
                *crc,
                "buffer {i} out of order or changed"
            );
            transports.insert(got.transport.as_str().to_string());
        }
        transports
    };
    let transports =
        send_in_order_while(&a, "b", (buffers, |_| 9), Duration::from_secs(60), receive).await;
    assert!(
        transports.contains("ucx") && transports.contains("tcp"),
        "both paths taken: {transports:?}"
    );
    a.shutdown().await;
    b.shutdown().await;
}
