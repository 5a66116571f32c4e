//! The ipc transport between two processes on a machine with two GPUs: this test process
//! is node `a` on GPU 0, a `ferry serve --role echo` child is node `b` on GPU 1, linked over
//! Unix sockets. Skipped (and saying so) without `FERRY_GPU_TESTS=1`; with it, a machine
//! without two GPUs fails the tests. (A peer killed mid-transfer and every layout, over ipc,
//! tcp and staged with GPU memory: `conformance/`.)

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{Scratch, Served, send_in_order_while};
use ferry::{MemoryKind, Node};

/// Two nodes: `a` (this process) and the echoing child `b`; `a_extra` and `b_extra` are
/// added to their configurations.
struct Pair {
    node: Node,
    child: Served,
    _scratch: Scratch,
}

fn socket_dir(scratch: &Scratch) -> PathBuf {
    scratch.path().join("sockets")
}

async fn pair(a_extra: &str, b_extra: &str) -> Pair {
    pair_with_role(a_extra, b_extra, "echo").await
}

/// Like [`pair`], with `b` serving `role` (`echo` or `sink`).
async fn pair_with_role(a_extra: &str, b_extra: &str, role: &str) -> Pair {
    // RUST_LOG shows node a's log (b's goes to its stderr).
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let scratch = Scratch::new();
    let dir = socket_dir(&scratch);
    let node_extra = |extra: &str| format!("{extra}\n");
    let b_text = scratch
        .toml(
            "b",
            &[("a", &format!("unix:{}/a.sock", dir.display()))],
            &node_extra(b_extra),
        )
        .replacen(
            "[node]\n",
            &format!("[node]\nsocket_dir = \"{}\"\n", dir.display()),
            1,
        );
    let b = scratch.write("b.toml", &b_text);
    let child = Served::start(&b, role);
    let a_text = scratch
        .toml(
            "a",
            &[("b", &format!("unix:{}/b.sock", dir.display()))],
            &node_extra(a_extra),
        )
        .replacen(
            "[node]\n",
            &format!("[node]\nsocket_dir = \"{}\"\n", dir.display()),
            1,
        );
    let config = ferry::Config::from_toml_str(&a_text).expect("config a");
    let node = Node::start(config).await.expect("start a");
    Pair {
        node,
        child,
        _scratch: scratch,
    }
}

const GPU0: &str = "[gpu]\ndevices = [0]\n[memory]\nreceive_into = \"device\"\n";
/// The second node's GPU: GPU 1 where there are two, else GPU 0 beside the first node
/// (CUDA IPC works between two processes of one GPU).
static GPU1: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "[gpu]\ndevices = [{}]\n[memory]\nreceive_into = \"device\"\n",
        ferry::testing::peer_gpu()
    )
});
/// A lane limited to 64 KiB (it carries every size by default): sends on both sides of its
/// limit, some on the lane and some on the socket, must keep their order.
const LANE: &str = "[transport.ipc]\nlane_max = \"64 KiB\"\n";
/// The lane off: every send takes the socket and the actors.
const NO_LANE: &str = "[transport.ipc]\nlane_max = 0\n";
/// Rules that push device memory over ipc (the sender copies into a buffer the receiver
/// lends), with the lane off too (it would not take pushed sizes anyway: it follows the
/// rules). Goes last in a node's extra.
const PUSH: &str = "[transport.ipc]\nlane_max = 0\n\n\
                    [[transport.rules]]\nname = \"gpu\"\nlocality = [\"same-host\"]\n\
                    src = [\"device\"]\ntransports = [\"ipc\", \"tcp\"]\ndirection = \"push\"\n\n\
                    [[transport.rules]]\nname = \"host\"\ntransports = [\"tcp\"]\n";

/// Checks that `node` routes device memory to `peer` as `direction` over ipc.
async fn routes(node: &Node, peer: &str, direction: ferry::Direction) {
    let e = node
        .explain(
            peer,
            1 << 20,
            ferry::MemoryClass::Device,
            ferry::MemoryClass::Device,
        )
        .await
        .expect("explain");
    let chosen = e
        .chosen
        .as_ref()
        .map(|r| (r.transport.as_str(), r.direction));
    assert_eq!(chosen, Some(("ipc", direction)), "{e}");
}

/// `len` bytes derived from `seed` (the CUDA layer's test pattern).
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    ferry::cuda::pattern::pattern(seed, len)
}

async fn device_buffer(node: &Node, bytes: &[u8]) -> ferry::Buffer {
    let mut b = node
        .alloc(MemoryKind::Device(0), bytes.len())
        .await
        .expect("device alloc");
    b.write(0, bytes).expect("write the device buffer");
    b
}

#[tokio::test(flavor = "multi_thread")]
async fn ipc_moves_device_buffers_both_ways_byte_exact() {
    let Some(_gpu) = ferry::testing::gpu_test("ipc_moves_device_buffers_both_ways") else {
        return;
    };
    let p = pair(GPU0, &GPU1).await;
    routes(&p.node, "b", ferry::Direction::Pull).await;
    both_ways_byte_exact(p).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ipc_pushes_device_buffers_both_ways_byte_exact() {
    let Some(_gpu) = ferry::testing::gpu_test("ipc_pushes_device_buffers_both_ways") else {
        return;
    };
    let p = pair(&format!("{GPU0}{PUSH}"), &format!("{}{PUSH}", *GPU1)).await;
    routes(&p.node, "b", ferry::Direction::Push).await;
    both_ways_byte_exact(p).await;
}

/// Sizes from 1 byte to 1 GiB, odd ones among them, a → b → a, checked byte for byte.
async fn both_ways_byte_exact(p: Pair) {
    let sizes = [
        1usize,
        7,
        4099,
        (1 << 20) + 1,
        8 << 20,
        (256 << 20) + 5,
        1 << 30,
    ];
    for (i, &len) in sizes.iter().enumerate() {
        let want = pattern(len, i as u64);
        let b = device_buffer(&p.node, &want).await;
        let back = p.node.send("b", i as u64, b).await.expect("send to b");
        assert_eq!(
            back.to_vec().expect("read back"),
            want,
            "sender's copy changed"
        );
        drop(back);
        let got = tokio::time::timeout(Duration::from_secs(60), p.node.recv(Some("b"), None))
            .await
            .expect("the echo came back in time")
            .expect("recv");
        assert_eq!(got.tag, i as u64);
        assert_eq!(
            got.transport.as_str(),
            "ipc",
            "{len} bytes came back over {}",
            got.transport
        );
        assert_eq!(got.buffer.kind(), MemoryKind::Device(0));
        assert_eq!(got.buffer.len(), len);
        assert!(
            got.buffer.to_vec().expect("read the echo") == want,
            "{len} bytes: a→b→a changed the bytes"
        );
    }
    p.node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_buffers_leave_gpu_memory_where_it_was() {
    let Some(_gpu) = ferry::testing::gpu_test("a_thousand_buffers") else {
        return;
    };
    let dev = ferry::cuda::Device::open(0).expect("GPU 0");
    // A first node run pays what a context keeps for its lifetime (the driver's own
    // allocations for streams and peer copies); the level after it is the baseline.
    round_trips(10).await;
    let (free_before, _) = dev.memory_info().expect("memory info");
    round_trips(1000).await;
    // Freed pool memory goes back to the driver when the pools are destroyed.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (free_after, _) = dev.memory_info().expect("memory info");
        let diff = free_before.abs_diff(free_after);
        if diff <= 1 << 20 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "GPU 0 has {diff} bytes less free after 1000 buffers than before"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts the pair, sends `count` 1 MiB device buffers through the echo and back, checks
/// that every buffer was given back, and tears both nodes down.
async fn round_trips(count: u64) {
    let p = pair(GPU0, &GPU1).await;
    let want = pattern(1 << 20, 3);
    for i in 0..count {
        let b = device_buffer(&p.node, &want).await;
        drop(p.node.send("b", i, b).await.expect("send"));
        let got = p.node.recv(Some("b"), Some(i)).await.expect("recv");
        assert_eq!(got.transport.as_str(), "ipc");
        if i % 100 == 0 {
            assert_eq!(got.buffer.to_vec().expect("read"), want, "buffer {i}");
        }
    }
    // A buffer the peer keeps mapped is freed once the peer unmapped it: soon after.
    device_memory_back(&p.node).await;
    let Pair { node, child, .. } = p;
    node.shutdown().await;
    drop(child);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_gpu_spills_to_pinned_and_promotes_back() {
    let Some(_gpu) = ferry::testing::gpu_test("a_full_gpu_spills") else {
        return;
    };
    spills_and_promotes("").await;
}

/// A push whose landing spilled to pinned host memory streams over the link instead.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_gpu_spills_pushes_to_pinned_and_promotes_back() {
    let Some(_gpu) = ferry::testing::gpu_test("a_full_gpu_spills_pushes") else {
        return;
    };
    spills_and_promotes(PUSH).await;
}

/// `a` with 64 MiB of device budget sends 3 × 20 MiB to `b` and keeps them: the echoes
/// find its GPU full and land in pinned host memory. `rules` go to both nodes.
async fn spills_and_promotes(rules: &str) {
    let a_extra = format!(
        "[gpu]\ndevices = [0]\n[memory]\nreceive_into = \"device\"\n\
         device = \"64 MiB\"\nspill = [\"pinned\"]\n{rules}"
    );
    let p = pair(&a_extra, &format!("{}{rules}", *GPU1)).await;
    let len = 20 << 20;
    let wants: Vec<Vec<u8>> = (0..3).map(|i| pattern(len, 100 + i)).collect();
    // All three allocated before the first leaves, so no echo finds room on the GPU.
    let mut buffers = Vec::new();
    for want in &wants {
        buffers.push(device_buffer(&p.node, want).await);
    }
    let mut sent = Vec::new();
    for (i, b) in buffers.into_iter().enumerate() {
        sent.push(p.node.send("b", i as u64, b).await.expect("send"));
    }
    let mut got = Vec::new();
    for i in 0..3u64 {
        got.push(p.node.recv(Some("b"), Some(i)).await.expect("recv").buffer);
    }
    let spilled: Vec<usize> = (0..3)
        .filter(|&i| got[i].kind() == MemoryKind::PinnedHost)
        .collect();
    assert_eq!(
        spilled.len(),
        3,
        "64 MiB holding 3 × 20 MiB of sent buffers has no room for their echoes"
    );
    for (b, want) in got.iter().zip(&wants) {
        assert!(b.to_vec().expect("read") == *want, "landed bytes differ");
    }
    drop(sent);
    // Room on the GPU again: the spilled buffers come back, byte for byte.
    let mut on_device = Vec::new();
    let mut pinned = Vec::new();
    for (i, b) in got.into_iter().enumerate() {
        if b.kind() == MemoryKind::PinnedHost {
            pinned.push((i, b));
        } else {
            on_device.push(b);
        }
    }
    drop(on_device);
    for (i, b) in pinned {
        let promoted = b
            .promote(
                MemoryKind::Device(0),
                Instant::now() + Duration::from_secs(10),
            )
            .await
            .expect("promote");
        assert_eq!(promoted.kind(), MemoryKind::Device(0));
        assert!(
            promoted.to_vec().expect("read") == wants[i],
            "promotion changed buffer {i}"
        );
    }
    p.node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_peer_without_gpus_falls_back_to_staged() {
    let Some(_gpu) = ferry::testing::gpu_test("a_peer_without_gpus") else {
        return;
    };
    let p = pair(GPU0, "[gpu]\ndevices = []\n").await;
    let want = pattern((3 << 20) + 1, 9);
    let b = device_buffer(&p.node, &want).await;
    drop(p.node.send("b", 5, b).await.expect("send falls back"));
    let got = p.node.recv(Some("b"), Some(5)).await.expect("recv");
    // b landed it in host memory: its echo, host memory to a same-host peer, goes by shm.
    assert_eq!(got.transport.as_str(), "shm");
    assert!(got.buffer.to_vec().expect("read") == want);
    // The node's explanation now says why ipc is passed over for b.
    let why = p
        .node
        .explain(
            "b",
            1 << 20,
            ferry::MemoryClass::Device,
            ferry::MemoryClass::Host,
        )
        .await
        .expect("explain")
        .to_string();
    assert!(
        why.contains("ipc skipped: setup with the peer failed"),
        "{why}"
    );
    // ipc's fallback in the default rule is staged (through shared pinned memory); the
    // echo came back over tcp, the route of b's host memory.
    assert!(why.contains("chose staged"), "{why}");
    p.node.shutdown().await;
}

/// Memory the test allocated itself (`cuMemAlloc`, like a framework's tensor) crosses by its
/// legacy IPC handle: byte-exact at an odd offset, fresh bytes on the second send of the same
/// allocation (the peer's cached mapping reads the memory, not an old copy), and a new
/// allocation after the old one was unregistered and freed is read, not the freed one.
#[tokio::test(flavor = "multi_thread")]
async fn registered_memory_crosses_by_legacy_handle() {
    use ferry::cuda::{Device, DeviceMemory, ExternalMemory, PlainAllocation};
    let Some(_gpu) = ferry::testing::gpu_test("registered_memory_crosses") else {
        return;
    };
    let p = pair(GPU0, &GPU1).await;
    let dev = Device::open(0).expect("GPU 0");
    let offset = 4097u64;
    let len = (1 << 20) + 3;
    let mut tag = 0u64;
    for round in 0..2u64 {
        let alloc = PlainAllocation::new(&dev, 8 << 20).expect("cuMemAlloc");
        // SAFETY: the range lies in `alloc`, which is freed only after unregister_external
        // answered (below).
        let memory = unsafe { ExternalMemory::new(alloc.device_ptr() + offset, len, 0) };
        let mut registered = p.node.register_external(memory).expect("register");
        assert_eq!(registered.kind(), MemoryKind::Device(0));
        for send in 0..2u64 {
            let want = pattern(len, 1000 + round * 10 + send);
            registered.write(0, &want).expect("write registered memory");
            registered = p.node.send("b", tag, registered).await.expect("send");
            let got =
                tokio::time::timeout(Duration::from_secs(30), p.node.recv(Some("b"), Some(tag)))
                    .await
                    .expect("the echo came back in time")
                    .expect("recv");
            tag += 1;
            assert_eq!(got.transport.as_str(), "ipc");
            assert!(
                got.buffer.to_vec().expect("read") == want,
                "round {round}, send {send}: the peer read other bytes than the registered ones"
            );
        }
        tokio::time::timeout(
            Duration::from_secs(10),
            p.node.unregister_external(registered),
        )
        .await
        .expect("unregistered in time")
        .expect("unregister");
        drop(alloc);
    }
    // Refused before anything moves: past the allocation's end, and pool memory.
    let alloc = PlainAllocation::new(&dev, 4096).expect("cuMemAlloc");
    // SAFETY: refused at registration (past the end), so never used.
    let past = unsafe { ExternalMemory::new(alloc.device_ptr() + 1, 4096, 0) };
    let e = p.node.register_external(past).expect_err("past the end");
    assert!(e.to_string().contains("overrun"), "{e}");
    let pool = p
        .node
        .alloc(MemoryKind::Device(0), 4096)
        .await
        .expect("alloc");
    let ptr = pool.device_memory().expect("device").device_ptr();
    // SAFETY: refused at registration (pool memory), so never used.
    let pooled = unsafe { ExternalMemory::new(ptr, 4096, 0) };
    let e = p.node.register_external(pooled).expect_err("pool memory");
    assert!(e.to_string().contains("legacy IPC"), "{e}");
    p.node.shutdown().await;
}

/// A buffer its owner frees while the peer still maps it is not handed out again until the
/// peer unmapped it: with the peer stopped (SIGSTOP) the memory stays granted and a new
/// allocation gets other memory; once the peer runs again it unmaps and the memory comes back.
#[tokio::test(flavor = "multi_thread")]
async fn a_buffer_freed_while_the_peer_maps_it_is_not_reused_under_it() {
    use ferry::cuda::DeviceMemory;
    use nix::sys::signal::{Signal, kill};
    let Some(_gpu) = ferry::testing::gpu_test("freed_while_mapped") else {
        return;
    };
    let a_extra = format!("{GPU0}export_lease_timeout = \"20s\"\n");
    let p = pair_with_role(&a_extra, &GPU1, "sink").await;
    let len = 64 << 20;
    let b = device_buffer(&p.node, &pattern(len, 5)).await;
    let b = p.node.send("b", 1, b).await.expect("send");
    let freed_at = b.device_memory().expect("device").device_ptr();
    let before = p
        .node
        .memory(MemoryKind::Device(0))
        .await
        .expect("stats")
        .budget
        .granted;
    kill(p.child.pid(), Signal::SIGSTOP).expect("stop b");
    drop(b);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = p
        .node
        .memory(MemoryKind::Device(0))
        .await
        .expect("stats")
        .budget
        .granted;
    assert_eq!(held, before, "freed while the peer may still map it");
    let other = p
        .node
        .alloc(MemoryKind::Device(0), len)
        .await
        .expect("alloc");
    assert_ne!(
        other.device_memory().expect("device").device_ptr(),
        freed_at,
        "memory the stopped peer maps was handed out again"
    );
    kill(p.child.pid(), Signal::SIGCONT).expect("continue b");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let granted = p
            .node
            .memory(MemoryKind::Device(0))
            .await
            .expect("stats")
            .budget
            .granted;
        if granted == other.len() as u64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the peer unmapped, but the memory was not given back ({granted} granted)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(other);
    p.node.shutdown().await;
}

/// Two nodes of one process, one per GPU: the receiver copies straight from the sender's
/// memory (a peer copy; nothing is exported or imported), byte-exact, both ways.
#[tokio::test(flavor = "multi_thread")]
async fn two_gpus_in_one_process_copy_directly() {
    let Some(_gpu) = ferry::testing::gpu_test_with("two_gpus_in_one_process", 2) else {
        return;
    };
    let scratch = Scratch::new();
    let dir = socket_dir(&scratch);
    let node = |name: &str, other: &str, gpu: &str| {
        let text = scratch
            .toml(
                name,
                &[(other, &format!("unix:{}/{other}.sock", dir.display()))],
                &format!("{gpu}\n"),
            )
            .replacen(
                "[node]\n",
                &format!("[node]\nsocket_dir = \"{}\"\n", dir.display()),
                1,
            );
        ferry::Config::from_toml_str(&text).expect("config")
    };
    let a = Node::start(node("a", "b", GPU0)).await.expect("start a");
    let b = Node::start(node("b", "a", &GPU1)).await.expect("start b");
    for (i, &len) in [1usize, 4099, (1 << 20) + 1, 64 << 20].iter().enumerate() {
        let want = pattern(len, 300 + i as u64);
        let buf = device_buffer(&a, &want).await;
        drop(a.send("b", i as u64, buf).await.expect("a → b"));
        let got = b.recv(Some("a"), Some(i as u64)).await.expect("b receives");
        assert_eq!(got.transport.as_str(), "ipc");
        assert_eq!(got.buffer.kind(), MemoryKind::Device(1));
        assert!(
            got.buffer.to_vec().expect("read") == want,
            "a → b changed {len} bytes"
        );
        // And back, from GPU 1's memory.
        drop(b.send("a", i as u64, got.buffer).await.expect("b → a"));
        let back = a.recv(Some("b"), Some(i as u64)).await.expect("a receives");
        assert_eq!(back.transport.as_str(), "ipc");
        assert!(
            back.buffer.to_vec().expect("read") == want,
            "b → a changed {len} bytes"
        );
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// A node that uses both GPUs (one pool on each in this process) offers buffers of either
/// to a peer process.
#[tokio::test(flavor = "multi_thread")]
async fn a_node_with_two_gpus_offers_from_either() {
    let Some(_gpu) = ferry::testing::gpu_test_with("a_node_with_two_gpus", 2) else {
        return;
    };
    let both = "[gpu]\ndevices = [0, 1]\n[memory]\nreceive_into = \"device\"\n";
    let p = pair(both, &GPU1).await;
    for (i, n) in [0u32, 1].into_iter().enumerate() {
        let want = pattern(4099, 400 + i as u64);
        let mut buf = p
            .node
            .alloc(MemoryKind::Device(n), want.len())
            .await
            .expect("alloc");
        buf.write(0, &want).expect("write");
        drop(p.node.send("b", i as u64, buf).await.expect("send"));
        let got = p.node.recv(Some("b"), Some(i as u64)).await.expect("echo");
        assert_eq!(got.transport.as_str(), "ipc", "from GPU {n}");
        assert!(got.buffer.to_vec().expect("read") == want, "from GPU {n}");
    }
    p.node.shutdown().await;
}

/// Waits (5 s at most) until node `node` holds no device memory of GPU 0 any more.
async fn device_memory_back(node: &Node) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let stats = node.memory(MemoryKind::Device(0)).await.expect("stats");
        if stats.budget.granted == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "device memory not given back: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `node` has a fast lane to `peer` (it opens when the ipc setup settles).
async fn lane_open(node: &Node, peer: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !node.has_fast_lane(peer) {
        assert!(Instant::now() < deadline, "no fast lane to {peer}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn small_sends_take_the_fast_lane_in_order_with_large_ones() {
    let Some(_gpu) = ferry::testing::gpu_test("fast_lane_order") else {
        return;
    };
    mixed_sends_come_back_in_order(LANE).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn mixed_sends_come_back_in_order_without_the_lane() {
    let Some(_gpu) = ferry::testing::gpu_test("ipc_order") else {
        return;
    };
    mixed_sends_come_back_in_order(NO_LANE).await;
}

/// Sends made while the ipc setup with the peer is still under way, device buffers (over
/// ipc, which wait for it) mixed with host buffers (over tcp, which need none), come back
/// in the order they were made: a host buffer does not pass a device one waiting for the
/// setup, at either end.
#[tokio::test(flavor = "multi_thread")]
async fn sends_made_during_the_ipc_setup_keep_their_order_across_transports() {
    let Some(_gpu) = ferry::testing::gpu_test("setup_order") else {
        return;
    };
    let p = pair(GPU0, &GPU1).await;
    let node = p.node;
    let mut buffers = Vec::new();
    let mut wants = Vec::new();
    for i in 0..24u64 {
        let want = pattern(1000 + i as usize, i + 1);
        let b = if i % 3 == 0 {
            device_buffer(&node, &want).await
        } else {
            let mut b = node
                .alloc(MemoryKind::Host, want.len())
                .await
                .expect("host alloc");
            b.write(0, &want).expect("write the host buffer");
            b
        };
        buffers.push(b);
        wants.push(want);
    }
    let receive = async {
        let mut transports = std::collections::HashSet::new();
        for (i, want) in wants.iter().enumerate() {
            let got = node.recv(Some("b"), None).await.expect("recv");
            assert_eq!(got.tag, i as u64 + 1, "out of order");
            assert!(
                got.buffer.to_vec().expect("read") == *want,
                "transfer {i} changed"
            );
            transports.insert(got.transport.as_str().to_string());
        }
        transports
    };
    // No send yet: the first device buffer starts the setup.
    let tag = |i: usize| i as u64 + 1;
    let transports =
        send_in_order_while(&node, "b", (buffers, tag), Duration::from_secs(60), receive).await;
    assert!(
        transports.contains("ipc") && transports.len() > 1,
        "ipc and another transport taken: {transports:?}"
    );
    node.shutdown().await;
}

/// Sizes on both sides of the lane's limit, many in flight, echoed by `b`: every buffer
/// comes back in send order, byte-exact.
async fn mixed_sends_come_back_in_order(extra: &str) {
    let p = pair(&format!("{GPU0}{extra}"), &format!("{}{extra}", *GPU1)).await;
    // The first send sets ipc up, and with it the lane both ways (when configured).
    let b = device_buffer(&p.node, &pattern(1 << 20, 0)).await;
    drop(p.node.send("b", 0, b).await.expect("first send"));
    drop(p.node.recv(Some("b"), Some(0)).await.expect("first echo"));
    if extra == LANE {
        lane_open(&p.node, "b").await;
    }
    // Lane sizes (up to 64 KiB) mixed with slow-path ones, many in flight: every buffer
    // comes back (b echoes over its own lane to us) in send order, byte-exact.
    let sizes = [
        8usize,
        1,
        4099,
        64 << 10,
        (64 << 10) + 1,
        100,
        3 << 20,
        8,
        8,
    ];
    let node = std::sync::Arc::new(p.node);
    let mut buffers = Vec::new();
    let mut wants = Vec::new();
    for i in 0..sizes.len() * 20 {
        let len = sizes[i % sizes.len()];
        let want = pattern(len, i as u64 + 1);
        buffers.push(device_buffer(&node, &want).await);
        wants.push(want);
    }
    // The send order is that of the sends' first polls: each is polled once as it is made.
    let sends = {
        let node = std::sync::Arc::clone(&node);
        tokio::spawn(async move {
            let mut sends = Vec::new();
            for (i, b) in buffers.into_iter().enumerate() {
                let send = node.send("b", i as u64 + 1, b);
                let mut send = Box::pin(futures::future::maybe_done(send));
                let _ = futures::poll!(send.as_mut());
                sends.push(send);
            }
            futures::future::join_all(sends.iter_mut().map(|s| s.as_mut())).await;
            sends
                .iter_mut()
                .map(|s| match s.as_mut().take_output() {
                    Some(r) => r.map(drop).map_err(|e| e.error),
                    None => Err(ferry::Error::Cancelled),
                })
                .collect::<Vec<_>>()
        })
    };
    for (i, want) in wants.iter().enumerate() {
        let got = tokio::time::timeout(Duration::from_secs(30), node.recv(Some("b"), None))
            .await
            .expect("the echo came back in time")
            .expect("recv");
        assert_eq!(got.tag, i as u64 + 1, "out of order");
        assert_eq!(got.transport.as_str(), "ipc");
        assert_eq!(got.buffer.kind(), MemoryKind::Device(0));
        assert_eq!(got.buffer.len(), want.len());
        assert!(
            got.buffer.to_vec().expect("read") == *want,
            "transfer {i} ({} bytes) changed",
            want.len()
        );
    }
    for sent in sends.await.expect("join") {
        sent.expect("send");
    }
    let Ok(node) = std::sync::Arc::try_unwrap(node) else {
        panic!("node still shared");
    };
    node.shutdown().await;
}

/// Fresh buffers of growing sizes, 16 in flight, each imported by the peer while copies of
/// others run (`ferry bench` between two processes). Mapping a peer's buffer while copies
/// from its pool were in flight made them fault (`CUDA_ERROR_LAUNCH_FAILED`) in about half
/// of such runs; two runs must both pass.
#[test]
fn imports_while_copies_run_never_fault() {
    let Some(_gpu) = ferry::testing::gpu_test("imports_during_copies") else {
        return;
    };
    for run in 1..=2 {
        let out = std::process::Command::new(common::ferry_bin())
            .args([
                "bench",
                "--memory",
                "device",
                "--transport",
                "ipc",
                "--no-check",
                "-b",
                "8M",
                "-e",
                "256M",
                "-f",
                "2",
                "-n",
                "100",
                "--window",
                "16",
            ])
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run ferry bench");
        assert!(
            out.status.success(),
            "run {run}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Fetches of one key by a node with two GPUs: one flight lands on GPU 0 (where the node
/// receives), and callers that ask for GPU 1 get a peer copy there (the fan-out), byte-exact.
#[tokio::test(flavor = "multi_thread")]
async fn one_fetch_fans_out_to_the_other_gpu() {
    let Some(_gpu) = ferry::testing::gpu_test_with("fetch_fan_out", 2) else {
        return;
    };
    let both = "[gpu]\ndevices = [0, 1]\n[memory]\nreceive_into = \"device\"\n";
    let p = pair(both, &GPU1).await;
    let want = pattern((8 << 20) + 5, 450);
    let mut buf = p
        .node
        .alloc(MemoryKind::Device(0), want.len())
        .await
        .expect("alloc");
    buf.write(0, &want).expect("write");
    drop(
        p.node
            .send("b", ferry::echo::TAG_PUBLISH, buf)
            .await
            .expect("send"),
    );
    let answer = p
        .node
        .recv(Some("b"), Some(ferry::echo::TAG_PUBLISH))
        .await
        .expect("key");
    let key = String::from_utf8(answer.buffer.to_vec().expect("read")).expect("UTF-8");
    drop(answer);
    let into = [0u32, 1, 1, 0, 1, 1];
    let fetches = into.iter().map(|&n| {
        p.node.fetch(
            "b",
            &key,
            ferry::Fetch {
                into: Some(MemoryKind::Device(n)),
                ..ferry::Fetch::default()
            },
        )
    });
    let got = futures::future::join_all(fetches).await;
    for (n, fetched) in into.iter().zip(got) {
        let fetched = fetched.unwrap_or_else(|e| panic!("fetch into GPU {n}: {e}"));
        assert_eq!(fetched.buffer.kind(), MemoryKind::Device(*n));
        assert!(
            fetched.buffer.to_vec().expect("read") == want,
            "fetched into GPU {n}"
        );
    }
    let stats = p.node.fetch_stats();
    assert_eq!((stats.flights, stats.joined), (1, 5), "one flight for all");
    p.node.shutdown().await;
}

/// The memory of a dropped device buffer comes back for the next grant of its length that
/// overwrites it whole on the stream it was allocated on (a lane's landing), not for a
/// zeroed grant or another stream's; kept memory never takes budget a grant needs.
#[test]
fn dropped_device_memory_serves_the_next_overwriting_grant_on_its_stream() {
    use ferry::cuda::DeviceMemory;
    use ferry_actors::allocator::{Allocator, DevicePool, Fill};
    let Some(_gpu) = ferry::testing::gpu_test("device_shelf") else {
        return;
    };
    let device = ferry::cuda::Device::open(0).expect("GPU 0");
    let (pool, streams) = ferry_actors::gpu::open_pool(&device).expect("pool");
    const MIB: u64 = 1 << 20;
    let domain = Allocator::new(MemoryKind::Device(0), 4 * MIB, 16, Duration::from_secs(1))
        .with_device(DevicePool::new(
            pool,
            streams.alloc.clone(),
            vec![streams.copy.clone(), streams.express.clone()],
        ))
        .domain();
    let lane = streams.express.clone();
    let grant = |len: u64, on: &ferry::cuda::Stream, fill: Fill| {
        let got = domain
            .try_now_on(&[len], Some(on), fill)
            .expect("no refusal")
            .expect("fits now");
        let b = got.into_iter().next().expect("one buffer");
        let at = b.device_memory().expect("device").device_ptr();
        (b, at)
    };
    let (first, at) = grant(MIB, &lane, Fill::Overwritten);
    drop(first);
    let (again, at_again) = grant(MIB, &lane, Fill::Overwritten);
    assert_eq!(at_again, at, "the kept allocation, not a new one");
    drop(again);
    let (zeroed, at_zeroed) = grant(MIB, &lane, Fill::Zeroed);
    assert_ne!(at_zeroed, at, "a zeroed grant never takes kept memory");
    let (elsewhere, at_elsewhere) = grant(MIB, &streams.copy, Fill::Overwritten);
    assert_ne!(at_elsewhere, at, "kept memory serves only its own stream");
    let (other_len, at_other) = grant(MIB / 2, &lane, Fill::Overwritten);
    assert_ne!(at_other, at, "kept memory serves only its own length");
    drop((zeroed, elsewhere, other_len));
    // 4 MiB of budget, 3.5 MiB of it kept now: a grant of the whole budget still fits (the
    // kept memory is freed to make room).
    let (whole, _) = grant(4 * MIB, &lane, Fill::Zeroed);
    assert_eq!(whole.len(), (4 * MIB) as usize);
    drop(whole);
    streams.alloc.synchronize().expect("sync");
}
