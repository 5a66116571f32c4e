//! An exportable pool gives the GPU back what it reserved once its buffers are freed and
//! trimmed: after a burst like a node's (8 MiB buffers, eight at a time), with their
//! pointers exported or not. One test binary of its own: it reads the whole GPU's free
//! memory, which another test of the same process would move.
//!
//! Skips itself (and says so) unless `FERRY_GPU_TESTS=1`; with it set, a machine without a
//! usable GPU fails it.

use ferry_transports::cuda::{Device, ExportablePool, Stream};

const MIB: u64 = 1 << 20;
/// What a trimmed pool may keep: a couple of its 2 MiB granules.
const SLACK: u64 = 8 * MIB;

fn gpu() -> Option<Device> {
    if std::env::var("FERRY_GPU_TESTS").as_deref() != Ok("1") {
        println!("skipped: needs a GPU (set FERRY_GPU_TESTS=1 on a GPU machine)");
        return None;
    }
    Some(
        Device::open(0).unwrap_or_else(|e| {
            panic!("FERRY_GPU_TESTS=1 but the CUDA layer cannot open GPU 0: {e}")
        }),
    )
}

/// Four rounds of eight 8 MiB buffers on `stream`, each exported when `export`; all freed.
/// Returns the free memory at the burst's lowest.
fn burst(pool: &ExportablePool, stream: &Stream, export: bool, device: &Device) -> u64 {
    let mut lowest = u64::MAX;
    for _ in 0..4 {
        let buffers: Vec<_> = (0..8)
            .map(|_| pool.alloc(8 << 20, stream).expect("alloc"))
            .collect();
        stream.synchronize().expect("allocated");
        if export {
            for b in &buffers {
                b.export_pointer().expect("export");
            }
        }
        lowest = lowest.min(device.memory_info().expect("cuMemGetInfo").0);
        drop(buffers);
    }
    stream.synchronize().expect("freed");
    lowest
}

#[test]
fn an_exportable_pool_trims_back_to_where_it_was_after_a_burst() {
    let Some(device) = gpu() else { return };
    let free = || device.memory_info().expect("cuMemGetInfo").0;
    let pool = ExportablePool::new(&device).expect("exportable pool");
    let stream = Stream::new(&device).expect("stream");
    // The context and the pool exist before the baseline.
    drop(pool.alloc(4096, &stream).expect("alloc"));
    stream.synchronize().expect("freed");
    pool.trim_to(0).expect("trim");
    let mut report = Vec::new();
    let mut missing = Vec::new();
    for (case, export) in [("never exported", false), ("pointers exported", true)] {
        let before = free();
        let lowest = burst(&pool, &stream, export, &device);
        let untrimmed = free();
        pool.trim_to(0).expect("trim");
        let after = free();
        report.push(format!(
            "{case}: {} MiB free before, {} at the lowest, {} freed untrimmed, {} trimmed",
            before / MIB,
            lowest / MIB,
            untrimmed / MIB,
            after / MIB
        ));
        assert!(
            lowest + 128 * MIB <= before,
            "{case}: the burst took no memory"
        );
        if after + SLACK < before {
            missing.push(format!("{case}: {} MiB", (before - after) / MIB));
        }
    }
    // What one small buffer allocated after the burst and kept holds of it.
    let before = free();
    let lowest = burst(&pool, &stream, true, &device);
    let small = pool.alloc(4096, &stream).expect("alloc");
    stream.synchronize().expect("allocated");
    pool.trim_to(0).expect("trim");
    let with_small = free();
    drop(small);
    stream.synchronize().expect("freed");
    pool.trim_to(0).expect("trim");
    report.push(format!(
        "a 4 KiB buffer kept after the burst: {} MiB free before, {} at the lowest, {} \
         trimmed while it lives, {} once it is freed",
        before / MIB,
        lowest / MIB,
        with_small / MIB,
        free() / MIB
    ));
    println!("{}", report.join("\n"));
    assert!(
        missing.is_empty(),
        "trimmed, the pool kept memory: {missing:?}\n{}",
        report.join("\n")
    );
}
