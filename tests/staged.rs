//! The staged transport between real processes, host memory at both ends: through the
//! shared-memory ring of staging slots (host → ring → host), and over the link as to
//! another host; every layout, byte-exact. (A stalled receiver: `staged_stall.rs`, alone
//! in its process so that its memory can be measured.)

mod common;

use common::{Scratch, Served, metric, patterned};
use ferry::{Layout, Node};

/// Every transfer of host memory goes staged, with small chunks and a shallow ring.
fn staged_rules(chunk: &str, slots: u32, shared_memory: bool) -> String {
    format!(
        "[transport.staged]\nchunk = \"{chunk}\"\nslots = {slots}\nshared_memory = {shared_memory}\n\n\
         [[transport.rules]]\nname = \"all\"\ntransports = [\"staged\"]\n"
    )
}

/// A node here and an echo process, both routing everything over staged.
async fn with_staged_echo(scratch: &Scratch, name: &str, extra: &str) -> (Node, Served, String) {
    let echo_extra = format!("{extra}\n[telemetry]\nmetrics_listen = \"127.0.0.1:0\"\n");
    let echo_cfg = scratch.write("echo.toml", &scratch.toml("echo", &[], &echo_extra));
    let echo = Served::start(&echo_cfg, "echo");
    let metrics = echo.metrics_addr();
    // Each test's node has a name of its own: the pool socket a node serves its rings on
    // is named after the node and its process, which the tests share.
    let node = Node::start(scratch.config(name, &[("echo", &echo.addr)], extra))
        .await
        .expect("node starts");
    (node, echo, metrics)
}

/// The layouts of the test, each with the length of the buffer that holds it.
fn layouts() -> Vec<(Layout, usize)> {
    vec![
        (Layout::Contiguous, 0),
        (Layout::Contiguous, 1),
        (Layout::Contiguous, (64 << 10) - 1),
        (Layout::Contiguous, 64 << 10),
        (Layout::Contiguous, (64 << 10) + 1),
        (Layout::Contiguous, (1 << 20) + 5),
    ]
    .into_iter()
    .chain(common::strided_layouts())
    .collect()
}

/// Sends every layout to the echo and checks what comes back (the packed rows), byte for
/// byte, and that staged carried it both ways.
async fn echo_every_layout(node: &Node) {
    for (i, (layout, len)) in layouts().into_iter().enumerate() {
        let want = common::send_layout_checked(node, "echo", i as u64, layout, len).await;
        let got = node.recv(Some("echo"), Some(i as u64)).await.expect("echo");
        assert_eq!(got.transport, "staged", "{layout:?} of {len} bytes");
        assert!(
            got.buffer.to_vec().expect("host") == want,
            "{layout:?} of {len} bytes: other bytes came back"
        );
        // Received into a layout: the rows go back to their places, the gaps stay.
        let mut target = node
            .alloc(ferry::MemoryKind::Host, len)
            .await
            .expect("alloc");
        target.as_mut_slice().expect("host").fill(0xAB);
        target
            .scatter_from(&got.buffer, &layout)
            .expect("scatter into the layout");
        let mut expected = vec![0xAB; len];
        layout.scatter(&want, 0, &mut expected).expect("scatter");
        assert!(
            target.to_vec().expect("host") == expected,
            "{layout:?}: not received into the layout"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_to_ring_to_host_between_processes_is_byte_exact() {
    let scratch = Scratch::new();
    let (node, _echo, metrics) =
        with_staged_echo(&scratch, "ring", &staged_rules("64 KiB", 3, true)).await;
    // The first staged send makes the ring and waits (a little) for the echo to map it:
    // from the very first chunk, everything goes through it.
    let ring = || metric(&metrics, "ferry_staged_ring_chunks_total").unwrap_or(0.0);
    let before = ring();
    echo_every_layout(&node).await;
    // Every chunk the echo received came from the ring, not from the socket.
    let chunks: u64 = layouts()
        .into_iter()
        .map(|(layout, len)| {
            let packed = layout.check(len as u64).expect("fits");
            packed.div_ceil(64 << 10).max(1)
        })
        .sum();
    assert_eq!(
        ring() - before,
        chunks as f64,
        "chunks the echo read from the ring"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_over_the_link_is_byte_exact() {
    let scratch = Scratch::new();
    let (node, _echo, metrics) =
        with_staged_echo(&scratch, "link", &staged_rules("64 KiB", 2, false)).await;
    echo_every_layout(&node).await;
    let chunks = metric(&metrics, "ferry_staged_ring_chunks_total");
    assert_eq!(chunks, Some(0.0), "shared_memory = false still used a ring");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_staged_sends_arrive_in_order() {
    let scratch = Scratch::new();
    let (node, _echo, _) =
        with_staged_echo(&scratch, "order", &staged_rules("64 KiB", 2, true)).await;
    let node = &node;
    let sends = (0..40u64).map(|i| async move {
        let buffer = patterned(node, 100_000 + i as usize * 997, i).await;
        let crc = crc32c::crc32c(buffer.as_slice().expect("host"));
        drop(node.send("echo", 7, buffer).await.expect("send"));
        crc
    });
    let crcs = futures::future::join_all(sends).await;
    for (i, crc) in crcs.into_iter().enumerate() {
        let got = node.recv(Some("echo"), Some(7)).await.expect("echo");
        assert_eq!(got.buffer.len(), 100_000 + i * 997, "out of order");
        assert_eq!(crc32c::crc32c(got.buffer.as_slice().expect("host")), crc);
    }
}
