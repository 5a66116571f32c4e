//! The staged transport between real processes, host memory at both ends, through the
//! shared-memory ring of staging slots: many sends at once arrive in order. (Every size and
//! layout, through the ring and over the link: `conformance/`. A stalled receiver:
//! `staged_stall.rs`, alone in its process so that its memory can be measured.)

mod common;

use common::{Scratch, Served, patterned};
use ferry::Node;

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
