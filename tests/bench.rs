//! `ferry bench` on host memory: a short sweep with --check, --json, --csv and --plot.

mod common;

use std::process::{Command, Stdio};

#[test]
fn host_sweep_reports_every_size_next_to_its_baseline() {
    let dir = tempfile::tempdir().expect("dir");
    let json = dir.path().join("bench.json");
    let csv = dir.path().join("bench.csv");
    let svg = dir.path().join("bench.svg");
    let out = Command::new(common::ferry_bin())
        .args([
            "bench", "-b", "8", "-e", "1M", "-f", "16", "-n", "5", "-w", "1",
        ])
        .arg("--json")
        .arg(&json)
        .arg("--csv")
        .arg(&csv)
        .arg("--plot")
        .arg(&svg)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("run ferry bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("#wrong"), "{stdout}");

    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written"))
            .expect("valid json");
    let records = doc["records"].as_array().expect("records");
    let sizes: Vec<u64> = records.iter().filter_map(|r| r["bytes"].as_u64()).collect();
    assert_eq!(sizes, vec![8, 128, 2048, 32768, 524288]);
    for r in records {
        let ferry = r["ferry_gbps"].as_f64().expect("ferry figure");
        let base = r["baseline_gbps"].as_f64().expect("baseline figure");
        let ratio = r["ratio"].as_f64().expect("ratio");
        assert!(ferry > 0.0 && base > 0.0, "{r}");
        assert!((ratio - ferry / base).abs() < 1e-9, "{r}");
        assert_eq!(r["wrong"].as_u64(), Some(0), "{r}");
        assert_eq!(r["checked"].as_bool(), Some(true), "{r}");
        assert!(r["p50_us"].as_f64().is_some_and(|v| v > 0.0), "{r}");
    }
    assert!(
        doc["header"]["route"]
            .as_str()
            .is_some_and(|s| s.contains("tcp"))
    );

    let csv = std::fs::read_to_string(&csv).expect("csv written");
    assert_eq!(csv.lines().count(), 1 + sizes.len(), "{csv}");
    let svg = std::fs::read_to_string(&svg).expect("plot written");
    assert!(
        svg.starts_with("<svg") && svg.contains("ferry"),
        "not an svg plot"
    );
}

#[test]
fn bench_refuses_what_is_not_built_with_a_reason() {
    for (args, needle) in [
        (vec!["--transport", "ipc"], "add --memory device"),
        (vec!["--transport", "carrier-pigeon"], "tcp, ipc or staged"),
        (vec!["--memory", "shared"], "host or device"),
        (vec!["-b", "1M", "-e", "8"], "larger than"),
        // Both local nodes take the rule, and tcp cannot pull.
        (
            vec!["--direction", "pull", "-n", "1"],
            "tcp moves only push",
        ),
        (vec!["--direction", "sideways"], "invalid value"),
        (vec!["--layout", "strided:1K:2K"], "add --no-check"),
        (
            vec!["--layout", "strided:1K:512", "--no-check"],
            "at least the row",
        ),
        (
            vec!["--layout", "diagonal"],
            "contiguous or strided:ROW:PITCH",
        ),
    ] {
        let out = Command::new(common::ferry_bin())
            .arg("bench")
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

/// `--set` shapes a local bench (it was once ignored there): a host budget too small for the
/// row stops it, an invalid limit is refused by name, and a valid transport setting, which
/// the peer process takes too, runs.
#[test]
fn set_overrides_reach_both_local_nodes() {
    let run = |set: &str| {
        Command::new(common::ferry_bin())
            .args([
                "--set", set, "bench", "-b", "1M", "-e", "1M", "-n", "2", "-w", "1",
            ])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .expect("run ferry bench")
    };
    let out = run("memory.host=64KiB");
    assert!(!out.status.success(), "a 64 KiB budget carried 1 MiB");
    let out = run("limits.peer_queue=0");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "peer_queue = 0 was accepted");
    assert!(stderr.contains("peer_queue"), "{stderr}");
    let out = run("transport.tcp.chunk_size=128KiB");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Without a CUDA driver (this test skips itself where one loads), device memory is refused
/// with the driver's reason before any peer starts.
#[test]
fn device_memory_without_a_driver_says_so() {
    if ferry::cuda::driver() != Err(ferry::cuda::CudaError::NoDriver) {
        eprintln!("skipped: a CUDA driver library loads on this machine");
        return;
    }
    for transport in ["ipc", "tcp"] {
        let out = Command::new(common::ferry_bin())
            .args(["bench", "--memory", "device", "--transport", transport])
            .stdin(Stdio::null())
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{transport}: {stderr}");
        assert!(stderr.contains("--memory device"), "{transport}: {stderr}");
        assert!(stderr.contains("no CUDA driver"), "{transport}: {stderr}");
        assert!(!stderr.contains("panicked"), "{transport}: {stderr}");
    }
}

#[test]
fn png_plot() {
    let dir = tempfile::tempdir().expect("dir");
    let png = dir.path().join("bench.png");
    let out = Command::new(common::ferry_bin())
        .args([
            "bench", "-b", "64", "-e", "4K", "-f", "8", "-n", "3", "-w", "0", "--plot",
        ])
        .arg(&png)
        .stdin(Stdio::null())
        .output()
        .expect("run ferry bench");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&png).expect("png written");
    assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
}

#[test]
fn both_directions_and_the_pair_matrix() {
    let out = Command::new(common::ferry_bin())
        .args([
            "bench", "-b", "1K", "-e", "64K", "-f", "64", "-n", "4", "-w", "1",
        ])
        .args(["--bidir", "--pairs", "all"])
        .stdin(Stdio::null())
        .output()
        .expect("run ferry bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("both directions"), "{stdout}");
    assert!(stdout.contains("GB/s from row to column"), "{stdout}");
    assert!(stdout.contains("bench-peer"), "{stdout}");
}

/// `--transport staged` on host memory, through the shared ring and over the link: every
/// row next to the raw socket's, and the route says staged.
#[test]
fn staged_host_bench_runs_next_to_a_raw_socket() {
    for shared in ["true", "false"] {
        let out = Command::new(common::ferry_bin())
            .args(["--set", &format!("transport.staged.shared_memory={shared}")])
            .args([
                "bench",
                "--transport",
                "staged",
                "-b",
                "64K",
                "-e",
                "4M",
                "-f",
                "8",
                "-n",
                "8",
                "-w",
                "2",
            ])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .expect("run ferry bench");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "shared_memory = {shared}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("chose staged"), "{stdout}");
        assert!(stdout.contains("plain TCP socket"), "{stdout}");
        let rows = stdout
            .lines()
            .filter(|l| !l.starts_with('#') && l.split_whitespace().count() > 4)
            .count();
        assert!(rows >= 3, "{stdout}");
    }
}
