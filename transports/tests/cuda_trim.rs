//! What an exportable pool gives the GPU back after a burst like a node's (8 MiB buffers,
//! eight at a time) once its buffers are freed: trimmed, and destroyed; with their
//! pointers exported or not, and imported by another process. One test binary of its own: it reads the whole GPU's free
//! memory, which another test of the same process would move.
//!
//! Skips itself (and says so) unless `FERRY_GPU_TESTS=1`; with it set, a machine without a
//! usable GPU fails it.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use ferry_transports::cuda::{Device, ExportablePool, Stream};
use ferry_transports::link::fdpass;

mod importer;
use importer::Importer;

/// One test at a time: each reads the whole GPU's free memory.
static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

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

/// What the driver does, measured on the H200: a trim gives back all of a burst's memory
/// whose pointers were never exported, and none of it once they were
/// (`cuMemPoolExportPointer`, imported by no one): that memory goes back only with the
/// pool. The test holds the first and the last; it prints what a trim kept of exported
/// memory.
#[test]
fn a_burst_goes_back_when_trimmed_unless_exported_and_always_with_the_pool() {
    let Some(device) = gpu() else { return };
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let free = || device.memory_info().expect("cuMemGetInfo").0;
    let stream = Stream::new(&device).expect("stream");
    let mut report = Vec::new();
    for (case, export) in [("never exported", false), ("pointers exported", true)] {
        let before = free();
        let pool = ExportablePool::new(&device).expect("exportable pool");
        let lowest = burst(&pool, &stream, export, &device);
        pool.trim_to(0).expect("trim");
        let trimmed = free();
        // What the pool says it holds once trimmed, nothing allocated (printed).
        let usage = pool.usage().expect("usage");
        let pool_exported = pool.has_exported();
        drop(pool);
        let destroyed = free();
        let line = format!(
            "{case}: {} MiB free before, {} at the lowest, {} trimmed ({usage:?}), {} with the \
             pool gone",
            before / MIB,
            lowest / MIB,
            trimmed / MIB,
            destroyed / MIB
        );
        println!("{line}");
        report.push(line);
        let all = report.join("\n");
        assert!(
            lowest + 48 * MIB <= before,
            "the burst took no memory\n{all}"
        );
        if !export {
            assert!(trimmed + SLACK >= before, "a trim kept memory\n{all}");
        } else {
            // The driver's counters leave the stuck memory out (0 reserved on the H200):
            // the pool's own flag says it exported.
            assert!(pool_exported, "the pool does not know it exported\n{all}");
        }
        assert!(
            destroyed + SLACK >= before,
            "the pool's memory stayed after it was destroyed\n{all}"
        );
    }
}

/// As a node's pool is used: another process imports the pool and each buffer of the
/// burst, frees its imports (and says so) before the exporter frees the buffer; then the
/// exporter trims with the importer alive (its imported pool open), which does not give
/// the exported memory back (printed); destroys the pool, which gives it back only once the
/// importer closed its imported pool too (on the H200: 142,041 MiB free with the pool
/// destroyed and the import open, 142,105 = before once it closed it): why a node replaces
/// an idle pool and tells its peers to close their imports of the old one.
#[test]
fn a_burst_a_peer_imported_goes_back_with_the_pool() {
    if let Some(path) = importer::socket() {
        return importer(&path);
    }
    let Some(device) = gpu() else { return };
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let free = || device.memory_info().expect("cuMemGetInfo").0;
    let pool = ExportablePool::new(&device).expect("exportable pool");
    let stream = Stream::new(&device).expect("stream");
    drop(pool.alloc(4096, &stream).expect("alloc"));
    stream.synchronize().expect("freed");
    pool.trim_to(0).expect("trim");

    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("trim.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    // Before the importer's context: what the GPU has free once it and the pool are gone.
    let base = free();
    let mut child = Importer::spawn("a_burst_a_peer_imported_goes_back_with_the_pool", &path);
    let mut sock = child.accept(&listener);
    sock.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let fd = pool.export_fd().expect("export the pool");
    fdpass::send_fd(&sock, fd.as_fd(), b"P").expect("send the pool");
    drop(fd);
    // The importer's context and imported pool exist before the baseline.
    let mut ack = [0u8; 1];
    sock.read_exact(&mut ack).expect("the importer is ready");
    let before = free();
    let mut lowest = u64::MAX;
    for _ in 0..4 {
        let buffers: Vec<_> = (0..8)
            .map(|_| pool.alloc(8 << 20, &stream).expect("alloc"))
            .collect();
        stream.synchronize().expect("allocated");
        let mut msg = Vec::new();
        for b in &buffers {
            msg.extend_from_slice(&b.export_pointer().expect("export"));
        }
        sock.write_all(&[buffers.len() as u8]).expect("count");
        sock.write_all(&msg).expect("exports");
        sock.read_exact(&mut ack)
            .expect("the importer freed its imports");
        lowest = lowest.min(free());
        drop(buffers);
    }
    stream.synchronize().expect("freed");
    pool.trim_to(0).expect("trim");
    let alive = free();
    let report = format!(
        "imported by a peer: {} MiB free before, {} at the lowest, {} trimmed with the importer \
         alive",
        before / MIB,
        lowest / MIB,
        alive / MIB,
    );
    assert!(
        lowest + 48 * MIB <= before,
        "the burst took no memory\n{report}"
    );
    // Destroyed while the importer still holds its imported pool (a node replaces its pool
    // while its peers are alive), then once the importer exited.
    drop(pool);
    let destroyed_alive = free();
    // The importer closes its imported pool, then exits.
    sock.write_all(&[0]).expect("the end");
    sock.read_exact(&mut ack)
        .expect("the importer closed its pool");
    let closed = free();
    sock.write_all(&[0]).expect("exit");
    let status = child.wait();
    assert!(status.success(), "the importer failed: {status}");
    let destroyed = free();
    println!(
        "{report}; {} MiB with the pool destroyed and the importer's imported pool open, {} \
         once it closed that, {} once it exited ({} before the importer started)",
        destroyed_alive / MIB,
        closed / MIB,
        destroyed / MIB,
        base / MIB
    );
    assert!(
        closed + SLACK >= before,
        "the pool's memory stayed after it was destroyed here and its import closed there \
         ({} MiB free)\n{report}",
        closed / MIB
    );
    assert!(
        destroyed + SLACK >= base,
        "the pool's memory stayed after it was destroyed ({} MiB free)\n{report}",
        destroyed / MIB
    );
}

/// The child: imports the pool, then each round's buffers, frees them, says so.
fn importer(path: &str) {
    let mut sock = UnixStream::connect(path).expect("connect");
    sock.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let device = Device::open(0).expect("GPU 0");
    let mut byte = [0u8; 1];
    let fd = fdpass::recv_fd(&sock, &mut byte).expect("the pool").0;
    let pool = ExportablePool::import_fd(&device, fd, "trim").expect("import the pool");
    sock.write_all(&[1]).expect("ready");
    loop {
        sock.read_exact(&mut byte).expect("count");
        if byte[0] == 0 {
            drop(pool);
            sock.write_all(&[1]).expect("closed");
            sock.read_exact(&mut byte).expect("exit");
            break;
        }
        let mut exports = vec![0u8; usize::from(byte[0]) * 64];
        sock.read_exact(&mut exports).expect("exports");
        let imports: Vec<_> = exports
            .chunks(64)
            .map(|e| {
                let export: [u8; 64] = e.try_into().expect("64 bytes");
                pool.import_pointer(&export, 8 << 20).expect("import")
            })
            .collect();
        drop(imports);
        sock.write_all(&[1]).expect("freed");
    }
}
