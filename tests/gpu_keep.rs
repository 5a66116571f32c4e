//! Device memory a node keeps, or freed into its pool, goes back to the GPU once unused for
//! `memory.keep_idle`: `cuMemGetInfo`'s free memory returns to within a few MiB of where it
//! was before a burst. Skipped (and saying so) without `FERRY_GPU_TESTS=1`.
//!
//! `cuMemGetInfo` counts the whole GPU, so these tests run one at a time (a lock) in a test
//! binary of their own, beside no other test's allocations.

mod common;

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{Scratch, Served};
use ferry::{MemoryKind, Node};
use ferry_actors::allocator::{Allocator, DevicePool, DomainHandle, Fill, Keeping, Stats};

const MIB: u64 = 1 << 20;
/// How far below its free memory before the burst the GPU may stay once everything went
/// back: a couple of the pool's 2 MiB granules.
const SLACK: u64 = 4 * MIB;
/// For two nodes: besides their pools, each keeps a lane's buffers allocated ahead.
const PAIR_SLACK: u64 = 8 * MIB;
const IDLE: Duration = Duration::from_millis(300);

/// One test at a time: each reads the whole GPU's free memory.
static GPU: Mutex<()> = Mutex::new(());

/// Waits until `check` holds, polling every 10 ms, for `limit` at most.
fn eventually_blocking(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A GPU 0 allocator actor keeping memory for `IDLE`, on an actor thread of its own (the
/// test's thread makes device grants, which must never run on the actor's).
fn gpu_domain(
    device: &ferry::cuda::Device,
) -> (DomainHandle, ferry_actors::gpu::GpuStreams, actix::System) {
    let (pool, streams) = ferry_actors::gpu::open_pool(device).expect("pool");
    let domain_pool = DevicePool::new(
        pool,
        streams.alloc.clone(),
        vec![streams.copy.clone(), streams.express.clone()],
    );
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let system = actix::System::new();
        let handle = system.block_on(async move {
            Allocator::new(MemoryKind::Device(0), 2 << 30, 16, Duration::from_secs(1))
                .with_device(domain_pool)
                .keeping(Keeping {
                    idle: IDLE,
                    max: 512 * MIB,
                })
                .launch(16)
        });
        let _ = tx.send((handle, actix::System::current()));
        let _ = system.run();
    });
    let (handle, system) = rx.recv().expect("the actor thread started");
    (handle, streams, system)
}

#[test]
fn device_memory_kept_or_freed_goes_back_to_the_gpu_after_keep_idle() {
    let Some(_gpu) = ferry::testing::gpu_test("device_keep_idle") else {
        return;
    };
    let _one = GPU.lock().unwrap_or_else(|p| p.into_inner());
    let device = ferry::cuda::Device::open(0).expect("GPU 0");
    let (handle, streams, system) = gpu_domain(&device);
    let free = || device.memory_info().expect("cuMemGetInfo").0;
    let stats = || futures::executor::block_on(handle.actor.send(Stats)).expect("stats");
    let before = free();

    // Lane landings (kept when dropped) and buffers too large to keep (freed into the pool,
    // which holds freed memory until it is trimmed).
    let lane = streams.express.clone();
    let grant = |len: u64, fill: Fill| {
        handle
            .domain
            .try_now_on(&[len], Some(&lane), fill)
            .expect("no refusal")
            .expect("fits now")
    };
    let mut held = Vec::new();
    for _ in 0..16 {
        held.extend(grant(16 * MIB, Fill::Overwritten));
    }
    for _ in 0..2 {
        held.extend(grant(128 * MIB, Fill::Zeroed));
    }
    lane.synchronize().expect("sync");
    let during = free();
    assert!(
        during + 500 * MIB <= before,
        "512 MiB granted, free {} -> {} MiB",
        before / MIB,
        during / MIB
    );
    drop(held);
    assert_eq!(stats().kept.bytes, 256 * MIB, "the landings are kept");

    let back = eventually_blocking(Duration::from_secs(10), || free() + SLACK >= before);
    let after = free();
    println!(
        "GPU 0 free: {} MiB before, {} MiB with 512 MiB granted, {} MiB after keep_idle",
        before / MIB,
        during / MIB,
        after / MIB
    );
    assert!(
        back,
        "free memory stayed {} MiB below where it was ({:?})",
        before.saturating_sub(after) / MIB,
        stats()
    );
    assert_eq!(stats().kept.bytes, 0);
    system.stop();
}

/// Node `a` (this process, GPU 0) and a `ferry serve --role sink` child `b` receiving
/// into device memory on GPU 0, both keeping memory for `IDLE`, linked over Unix sockets.
async fn pair(scratch: &Scratch) -> (Node, Served) {
    let dir: PathBuf = scratch.path().join("sockets");
    let extra = format!(
        "[gpu]\ndevices = [0]\n[memory]\nreceive_into = \"device\"\nkeep_idle = \"{}ms\"\n\
         [telemetry]\nmetrics_listen = \"127.0.0.1:0\"\n",
        IDLE.as_millis()
    );
    let text = |name: &str, peer: &str| {
        scratch
            .toml(
                name,
                &[(peer, &format!("unix:{}/{peer}.sock", dir.display()))],
                &extra,
            )
            .replacen(
                "[node]\n",
                &format!("[node]\nsocket_dir = \"{}\"\n", dir.display()),
                1,
            )
    };
    let b = Served::start(&scratch.write("b.toml", &text("b", "a")), "sink");
    let config = ferry::Config::from_toml_str(&text("a", "b")).expect("config a");
    let a = Node::start(config).await.expect("start a");
    (a, b)
}

#[test]
fn a_burst_of_device_transfers_gives_the_gpu_its_memory_back_after_keep_idle() {
    let Some(_gpu) = ferry::testing::gpu_test("device_burst_keep_idle") else {
        return;
    };
    let _one = GPU.lock().unwrap_or_else(|p| p.into_inner());
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime")
        .block_on(device_burst());
}

/// GPU memory each process uses, as `nvidia-smi` reports it (`pid, MiB` lines).
fn gpu_memory_by_process() -> String {
    std::process::Command::new("nvidia-smi")
        .args([
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader",
        ])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_else(|e| format!("nvidia-smi: {e}\n"))
}

/// A burst of device sends from `a` to `b`; then GPU 0's free memory comes back.
async fn device_burst() {
    let scratch = Scratch::new();
    let (a, b) = pair(&scratch).await;
    let device = ferry::cuda::Device::open(0).expect("GPU 0");
    let free = || device.memory_info().expect("cuMemGetInfo").0;
    const LEN: usize = 8 << 20;
    let send = async |tag: u64, len: usize| {
        let buffer = a.alloc(MemoryKind::Device(0), len).await.expect("alloc");
        drop(a.send("b", tag, buffer).await.expect("send"));
    };
    // The link, the lane and the buffers it allocates ahead (once a small record came)
    // exist before the baseline.
    send(0, 4096).await;
    let before = free();
    let apps_before = gpu_memory_by_process();

    // 32 sends of 8 MiB, 8 at a time: both pools grow, both shelves keep memory.
    let mut lowest = before;
    for round in 0..4u64 {
        futures::future::join_all((0..8).map(|i| send(1 + round * 8 + i, LEN))).await;
        lowest = lowest.min(free());
    }
    assert!(
        lowest + 64 * MIB <= before,
        "the burst never took GPU memory ({} -> {} MiB free): the test proves nothing",
        before / MIB,
        lowest / MIB
    );
    let back = common::eventually(Duration::from_secs(15), async || {
        free() + PAIR_SLACK >= before
    })
    .await;
    let after = free();
    println!(
        "GPU 0 free: {} MiB before the burst, {} MiB at its lowest, {} MiB after keep_idle",
        before / MIB,
        lowest / MIB,
        after / MIB
    );
    // Where memory still is, if it is: each node's device domain (a's stats, b's metrics).
    let stats = a.memory(MemoryKind::Device(0)).await;
    let at_b = |what: &str| {
        common::metric(
            &b.metrics_addr(),
            &format!("ferry_memory_{what}_bytes{{domain=\"device0\"}}"),
        )
    };
    println!(
        "a: {stats:?}; b: granted {:?}, exported {:?}, kept {:?}",
        at_b("granted"),
        at_b("exported"),
        at_b("kept")
    );
    // Which process holds GPU memory (a is this one), as the driver counts it, before the
    // burst and now.
    println!(
        "a is pid {}, b pid {}; GPU memory by process before the burst:\n{apps_before}now:\n{}",
        std::process::id(),
        b.pid(),
        gpu_memory_by_process()
    );
    if !back {
        // Who holds what is missing: free memory once b's process is gone, then once a's
        // node stopped too (a's CUDA context stays: this process opened the device).
        let kept = a.memory(MemoryKind::Device(0)).await.map(|m| m.kept);
        drop(b);
        let without_b = free();
        // With b gone (its imports of a's memory with it), a's pool trims again once a
        // buffer went back to it and keep_idle passed.
        drop(a.alloc(MemoryKind::Device(0), 4096).await.expect("alloc"));
        tokio::time::sleep(IDLE * 3).await;
        let retrimmed = free();
        a.shutdown().await;
        let without_a = free();
        panic!(
            "free memory stayed {} MiB below where it was; a kept {kept:?}; free {} MiB with b \
             gone, {} MiB once a's pool trimmed again, {} MiB with a's node stopped too (before \
             the burst {} MiB). A trim gives back no memory whose pointer was exported, which \
             ipc does for every buffer it offers (transports/tests/cuda_trim.rs): it goes back \
             once a's idle pool is replaced and b closed its import of the old one",
            before.saturating_sub(after) / MIB,
            without_b / MIB,
            retrimmed / MIB,
            without_a / MIB,
            before / MIB
        );
    }
    assert_eq!(
        a.memory(MemoryKind::Device(0))
            .await
            .expect("stats")
            .kept
            .bytes,
        0
    );
    // The memory came back with a's pool replaced (b closed its import of the old one):
    // sends go on from the new pool, which b imports on the first buffer naming it, by the
    // lane (small) and by a pull (large).
    send(100, 4096).await;
    send(101, LEN).await;
    futures::future::join_all((0..4).map(|i| send(102 + i, LEN))).await;
    a.shutdown().await;
}
