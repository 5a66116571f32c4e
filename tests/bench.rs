//! `ferry bench` on host memory: a short sweep with --check, --json, --csv and --plot.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

/// The columns of every row `--json` and `--csv` write, in every mode, in the CSV's order.
const COLUMNS: [&str; 12] = [
    "series",
    "bytes",
    "iterations",
    "window",
    "ferry_gbps",
    "baseline_gbps",
    "ratio",
    "p50_us",
    "p99_us",
    "p999_us",
    "wrong",
    "checked",
];

/// Checks what a run wrote to `json` and `csv` against the one schema: a document of mode
/// `mode` whose rows are of the series `series`, in order, each with every column and sane
/// values (a positive rate, ordered latencies, the ratio of the rate to the baseline, no
/// transfer wrong, checked as `checked`), and a CSV of the same rows. Returns the rows.
fn rows_in_one_schema(
    json: &Path,
    csv: &Path,
    mode: &str,
    series: &[&str],
    checked: bool,
) -> Vec<serde_json::Value> {
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(json).expect("json written"))
            .expect("valid json");
    assert_eq!(doc["header"]["mode"].as_str(), Some(mode), "{doc}");
    let records = doc["records"].as_array().expect("records").clone();
    let got: Vec<&str> = records
        .iter()
        .filter_map(|r| r["series"].as_str())
        .collect();
    assert_eq!(got, series, "{doc}");
    for r in &records {
        let keys: Vec<&str> = r
            .as_object()
            .expect("a row")
            .keys()
            .map(|k| k.as_str())
            .collect();
        let mut want = COLUMNS.to_vec();
        want.sort_unstable();
        let mut keys = keys;
        keys.sort_unstable();
        assert_eq!(keys, want, "{r}");
        assert!(r["bytes"].as_u64().is_some_and(|b| b > 0), "{r}");
        assert!(r["iterations"].as_u64().is_some_and(|n| n > 0), "{r}");
        assert!(r["window"].as_u64().is_some_and(|w| w > 0), "{r}");
        let ferry = r["ferry_gbps"].as_f64().expect("ferry figure");
        assert!(ferry > 0.0 && ferry.is_finite(), "{r}");
        match (r["baseline_gbps"].as_f64(), r["ratio"].as_f64()) {
            (Some(base), Some(ratio)) => {
                assert!(base > 0.0, "{r}");
                assert!((ratio - ferry / base).abs() < 1e-9 * ratio.max(1.0), "{r}");
            }
            (None, None) => assert!(r["baseline_gbps"].is_null() && r["ratio"].is_null()),
            _ => panic!("a baseline without a ratio, or the reverse: {r}"),
        }
        let p = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k}: {r}"));
        assert!(
            p("p50_us") > 0.0 && p("p50_us") <= p("p99_us") && p("p99_us") <= p("p999_us"),
            "{r}"
        );
        assert_eq!(r["wrong"].as_u64(), Some(0), "{r}");
        assert_eq!(r["checked"].as_bool(), Some(checked), "{r}");
    }

    let csv = std::fs::read_to_string(csv).expect("csv written");
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some(COLUMNS.join(",").as_str()), "{csv}");
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), records.len(), "{csv}");
    for (row, r) in rows.iter().zip(&records) {
        assert_eq!(row.len(), COLUMNS.len(), "{row:?}");
        for (column, field) in COLUMNS.iter().zip(row) {
            let value = &r[*column];
            let same = match value {
                serde_json::Value::Null => field.is_empty(),
                serde_json::Value::String(s) => s == field,
                serde_json::Value::Bool(b) => field.parse() == Ok(*b),
                serde_json::Value::Number(n) => field.parse::<f64>().is_ok_and(|f| {
                    let n = n.as_f64().unwrap_or(f64::NAN);
                    (f - n).abs() <= 1e-6 * n.abs().max(1.0)
                }),
                _ => false,
            };
            assert!(same, "CSV {column} = {field:?}, JSON {value}");
        }
    }
    records
}

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

    let records = rows_in_one_schema(&json, &csv, "sweep", &["contiguous"; 5], true);
    let sizes: Vec<u64> = records.iter().filter_map(|r| r["bytes"].as_u64()).collect();
    assert_eq!(sizes, vec![8, 128, 2048, 32768, 524288]);
    assert!(
        records
            .iter()
            .all(|r| r["baseline_gbps"].as_f64().is_some()),
        "every row next to the socket's"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written"))
            .expect("valid json");
    assert!(
        doc["header"]["route"]
            .as_str()
            .is_some_and(|s| s.contains("tcp"))
    );

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
        (
            vec!["--transport", "carrier-pigeon"],
            "[possible values: tcp, ipc, staged, ucx, shm]",
        ),
        (vec!["--memory", "shared"], "host or device"),
        (
            vec!["--transport", "ucx", "--memory", "device"],
            "does not move device memory",
        ),
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
            "contiguous, strided:ROW:PITCH (e.g. strided:4K:8K) or blocks:SIZE:COUNT",
        ),
        (vec!["--layout", "blocks:4K"], "blocks:SIZE:COUNT (e.g."),
        (vec!["--layout", "blocks:1:65537"], "at most 65536 blocks"),
        (
            vec!["--layout", "blocks:4K:8", "--bidir"],
            "one direction only",
        ),
        (
            vec!["--layout", "blocks:4K:8", "--plot", "x.svg"],
            "--plot draws a size sweep",
        ),
        (vec!["--fetchers", "4097"], "at most 4096"),
        (
            vec!["--fetchers", "4", "--layout", "blocks:4K:8"],
            "no --layout blocks:4K:8",
        ),
        (vec!["--fetchers", "4", "--pingpong"], "one direction only"),
        (
            vec!["--fetchers", "4", "--plot", "x.svg"],
            "--plot draws a sweep",
        ),
        (vec!["--shared"], "--fetchers"),
        (
            vec!["--fetchers", "2000", "-n", "1"],
            "at most limits.peer_queue = 1024",
        ),
        (
            vec!["--set", "memory.host=1MiB", "--fetchers", "8", "-e", "1M"],
            "do not fit this node's host memory budget",
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

/// Runs `ferry bench ARGS` (logs at warn), asserts that it succeeded, and returns its
/// standard output.
fn bench_ok(args: &[&str]) -> String {
    let out = Command::new(common::ferry_bin())
        .arg("bench")
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("run ferry bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `--layout blocks:SIZE:COUNT` over tcp: the blocks' bytes three ways (one block list,
/// contiguous, one transfer per block), each checked by the peer, and the two ratios.
#[test]
fn blocks_layout_prints_three_rows_and_their_ratios() {
    let dir = tempfile::tempdir().expect("dir");
    let (json, csv) = (
        dir.path().join("blocks.json"),
        dir.path().join("blocks.csv"),
    );
    let stdout = bench_ok(&[
        "--layout",
        "blocks:4K:32",
        "-n",
        "3",
        "-w",
        "1",
        "--window",
        "2",
        "--json",
        path(&json),
        "--csv",
        path(&csv),
    ]);
    assert!(
        stdout.contains("# blocks: 32 blocks of 4096 bytes")
            && stdout.contains("of a pool of 524288 bytes"),
        "{stdout}"
    );
    assert!(stdout.contains("tcp"), "{stdout}");
    // Each row: its name, the bytes of a transfer, transfers per copy, the window, GB/s,
    // three latencies, and no transfer wrong.
    for (name, bytes, sends) in [
        ("blocks", "131072", "1"),
        ("contiguous", "131072", "1"),
        ("per block", "4096", "32"),
    ] {
        let fields = named_rows(&stdout, name)
            .into_iter()
            .next()
            .unwrap_or_else(|| panic!("no {name} row in {stdout}"));
        assert_eq!(&fields[..2], [bytes, sends], "{fields:?}");
        let gbps: f64 = fields[3].parse().expect("GB/s");
        assert!(gbps > 0.0, "{fields:?}");
        assert_eq!(fields.last(), Some(&"0"), "{fields:?}: transfers wrong");
    }
    let ratios = stdout
        .lines()
        .find(|l| l.starts_with("# blocks / contiguous"))
        .unwrap_or_else(|| panic!("no ratios in {stdout}"));
    assert!(ratios.contains("one transfer per block"), "{ratios}");

    // The same three rows in the one schema, the contiguous row the others' baseline.
    let rows = rows_in_one_schema(
        &json,
        &csv,
        "blocks",
        &["blocks", "contiguous", "per-block"],
        true,
    );
    let bytes: Vec<u64> = rows.iter().filter_map(|r| r["bytes"].as_u64()).collect();
    assert_eq!(bytes, [131072, 131072, 4096]);
    let contiguous = rows[1]["ferry_gbps"].as_f64();
    assert!(rows[1]["baseline_gbps"].is_null(), "{}", rows[1]);
    assert_eq!(rows[0]["baseline_gbps"].as_f64(), contiguous);
    assert_eq!(rows[2]["baseline_gbps"].as_f64(), contiguous);
    assert_eq!(
        rows[2]["iterations"].as_u64(),
        Some(3 * 32),
        "transfers timed"
    );
    // Read back (no peer, no node): the same rows, the same CSV.
    let again = dir.path().join("again.csv");
    let replay = bench_ok(&["--from-json", path(&json), "--csv", path(&again)]);
    assert!(replay.contains("per-block"), "{replay}");
    assert_eq!(
        std::fs::read_to_string(&again).expect("csv again"),
        std::fs::read_to_string(&csv).expect("csv")
    );
}

/// A path as an argument.
fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// The fields after the name of every table row named `name` (a row that starts with it,
/// then a space), in order.
fn named_rows<'a>(stdout: &'a str, name: &str) -> Vec<Vec<&'a str>> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.trim_start().strip_prefix(name))
        .filter(|rest| rest.starts_with(' '))
        .map(|rest| rest.split_whitespace().collect())
        .collect()
}

/// `--fetchers 4` over tcp: for each size, 4 fetches of one key in one flight a round (the
/// bench itself fails if a round takes more, or the peer served the key more than once),
/// next to 4 fetches of 4 keys and one fetch alone, every fetched buffer checked, and the
/// single-flight gain; `--fetchers 0` is refused before anything starts.
#[test]
fn fetchers_rows_and_the_single_flight_gain() {
    let dir = tempfile::tempdir().expect("dir");
    let (json, csv) = (dir.path().join("fetch.json"), dir.path().join("fetch.csv"));
    let stdout = bench_ok(&[
        "--fetchers",
        "4",
        "-b",
        "4K",
        "-e",
        "256K",
        "-f",
        "64",
        "-n",
        "3",
        "-w",
        "1",
        "--json",
        path(&json),
        "--csv",
        path(&csv),
    ]);
    assert!(stdout.contains("chose tcp"), "{stdout}");
    // Each row: the bytes, fetchers, flights and joined fetches a round, the time of a
    // round, GB/s, two latencies, and no buffer wrong; one row a size.
    for (name, fetchers, flights, joined) in [
        ("4 fetchers, one flight", "4", "1", "3"),
        ("4 fetchers, 4 flights", "4", "4", "0"),
        ("1 fetcher", "1", "1", "0"),
    ] {
        let rows = named_rows(&stdout, name);
        let sizes: Vec<&str> = rows.iter().map(|f| f[0]).collect();
        assert_eq!(sizes, ["4096", "262144"], "{name}: {stdout}");
        for fields in rows {
            assert_eq!(
                &fields[1..4],
                [fetchers, flights, joined],
                "{name}: {fields:?}"
            );
            let round: f64 = fields[4].parse().expect("time of a round");
            let gbps: f64 = fields[5].parse().expect("GB/s");
            assert!(round > 0.0 && gbps > 0.0, "{name}: {fields:?}");
            assert_eq!(
                fields.last(),
                Some(&"0"),
                "{name}: {fields:?}: buffers wrong"
            );
        }
    }
    let gains: Vec<f64> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("# single-flight gain at "))
        .map(|l| {
            let ratio = l.split(": ").nth(1).and_then(|r| r.split('x').next());
            ratio
                .and_then(|r| r.parse().ok())
                .unwrap_or_else(|| panic!("the gain does not parse: {l}"))
        })
        .collect();
    assert_eq!(gains.len(), 2, "{stdout}");
    assert!(gains.iter().all(|g| *g > 0.0), "{gains:?}");

    // The same rows in the one schema: a round's fetches the window, the one flight next
    // to the N flights, its ratio the gain.
    let ways = ["one-flight", "flights", "single"];
    let rows = rows_in_one_schema(&json, &csv, "fetchers", &[ways, ways].concat(), true);
    for (round, gain) in rows.chunks(3).zip(gains) {
        let windows: Vec<u64> = round.iter().filter_map(|r| r["window"].as_u64()).collect();
        assert_eq!(windows, [4, 4, 1], "{round:?}");
        assert_eq!(
            round[0]["baseline_gbps"].as_f64(),
            round[1]["ferry_gbps"].as_f64(),
            "{round:?}"
        );
        let ratio = round[0]["ratio"].as_f64().expect("the gain");
        assert!((ratio - gain).abs() < 0.01, "{ratio} against {gain}");
        assert!(round[1]["ratio"].is_null() && round[2]["ratio"].is_null());
    }

    let out = Command::new(common::ferry_bin())
        .args(["bench", "--fetchers", "0"])
        .stdin(Stdio::null())
        .output()
        .expect("run ferry bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--fetchers 0: at least one fetcher"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
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
    let dir = tempfile::tempdir().expect("dir");
    let (json, csv) = (dir.path().join("bidir.json"), dir.path().join("bidir.csv"));
    let out = Command::new(common::ferry_bin())
        .args([
            "bench", "-b", "1K", "-e", "64K", "-f", "64", "-n", "4", "-w", "1",
        ])
        .args(["--bidir", "--pairs", "all"])
        .args(["--json", path(&json), "--csv", path(&csv)])
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
    rows_in_one_schema(&json, &csv, "sweep", &["contiguous"; 2], true);
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("json");
    assert_eq!(doc["header"]["bidir"].as_bool(), Some(true), "{doc}");
}

/// The sweep's other shapes write the same schema: one transfer at a time sent back
/// (`--pingpong`), and rows of a strided layout (unchecked: the peer checks contiguous
/// patterns).
#[test]
fn pingpong_and_strided_sweeps_write_the_same_rows() {
    let dir = tempfile::tempdir().expect("dir");
    for (name, extra, series, checked) in [
        ("pingpong", &["--pingpong"][..], "contiguous", true),
        (
            "strided",
            &["--layout", "strided:1K:2K", "--no-check"][..],
            "strided:1K:2K",
            false,
        ),
    ] {
        let (json, csv) = (
            dir.path().join(format!("{name}.json")),
            dir.path().join(format!("{name}.csv")),
        );
        let mut args = vec!["-b", "1K", "-e", "16K", "-f", "16", "-n", "3", "-w", "1"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--json", path(&json), "--csv", path(&csv)]);
        bench_ok(&args);
        let rows = rows_in_one_schema(&json, &csv, "sweep", &[series; 2], checked);
        let sizes: Vec<u64> = rows.iter().filter_map(|r| r["bytes"].as_u64()).collect();
        assert_eq!(sizes, [1024, 16384], "{name}");
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("json");
        assert_eq!(
            doc["header"]["pingpong"].as_bool(),
            Some(name == "pingpong"),
            "{doc}"
        );
        assert_eq!(doc["header"]["layout"].as_str(), Some(series), "{doc}");
    }
}

/// `--transport staged` on host memory, through the shared ring and over the link: every
/// row next to the raw socket's, and the route says staged.
/// `--transport ucx` measures ferry over UCX next to UCX's own read loop between the same
/// two processes; skipped (saying so) where UCX does not load, unless FERRY_UCX_TESTS=1.
#[test]
fn ucx_bench_runs_next_to_ucx_s_own_read_loop() {
    if ucx_sys::Ucx::load(None).is_err() {
        assert_ne!(
            std::env::var("FERRY_UCX_TESTS").as_deref(),
            Ok("1"),
            "FERRY_UCX_TESTS=1 but UCX does not load"
        );
        println!("skipped: UCX does not load here (set FERRY_UCX_TESTS=1 to require it)");
        return;
    }
    let dir = tempfile::tempdir().expect("dir");
    let (json, csv) = (dir.path().join("ucx.json"), dir.path().join("ucx.csv"));
    let stdout = bench_ok(&[
        "--transport",
        "ucx",
        "-b",
        "4K",
        "-e",
        "1M",
        "-f",
        "16",
        "-n",
        "8",
        "-w",
        "2",
        "--json",
        path(&json),
        "--csv",
        path(&csv),
    ]);
    let rows = rows_in_one_schema(&json, &csv, "sweep", &["contiguous"; 3], true);
    assert!(rows.iter().all(|r| r["baseline_gbps"].as_f64().is_some()));
    assert!(stdout.contains("chose ucx"), "{stdout}");
    assert!(stdout.contains("UCX's own ucp_get loop"), "{stdout}");
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| !l.starts_with('#') && l.split_whitespace().count() > 4)
        .skip(1)
        .collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    for row in rows {
        let cols: Vec<&str> = row.split_whitespace().collect();
        let base: f64 = cols[3].parse().expect("baseline figure");
        assert!(base > 0.0, "no baseline: {row}");
        assert_eq!(cols.last(), Some(&"0"), "wrong transfers: {row}");
    }
}

#[test]
fn staged_host_bench_runs_next_to_a_raw_socket() {
    let dir = tempfile::tempdir().expect("dir");
    for shared in ["true", "false"] {
        let (json, csv) = (
            dir.path().join(format!("staged-{shared}.json")),
            dir.path().join(format!("staged-{shared}.csv")),
        );
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
            .args(["--json", path(&json), "--csv", path(&csv)])
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
        rows_in_one_schema(&json, &csv, "sweep", &["contiguous"; 3], true);
    }
}

/// A `ferry bench --serve-peer` child: its TCP address, and its log lines as they come
/// (RUST_LOG=info). Killed when dropped.
struct ServePeer {
    child: Child,
    addr: String,
    log: Arc<Mutex<Vec<String>>>,
}

impl ServePeer {
    fn start(config: &Path) -> Self {
        let mut child = Command::new(common::ferry_bin())
            .args(["bench", "--serve-peer"])
            .arg(config)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ferry bench --serve-peer");
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("stderr");
        let lines = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                lines.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        });
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut peer = Self {
            child,
            addr: String::new(),
            log,
        };
        let line = rx.recv_timeout(Duration::from_secs(20)).unwrap_or_default();
        peer.addr = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("tcp="))
            .and_then(|list| list.split(',').next())
            .unwrap_or_else(|| panic!("no ready line: {line:?}\n{}", peer.log()))
            .to_string();
        peer
    }

    fn log(&self) -> String {
        self.log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .join("\n")
    }

    /// Waits, `limit` at most, for a log line holding every one of `needles`; false at
    /// once if the server exited.
    fn wait_for_log(&mut self, needles: &[&str], limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.child.try_wait().expect("try_wait").is_some() {
                return false;
            }
            let found = self
                .log
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .any(|l| needles.iter().all(|n| l.contains(n)));
            if found {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Panics, with its log, if the server exited.
    fn assert_alive(&mut self, when: &str) {
        if let Some(status) = self.child.try_wait().expect("try_wait") {
            panic!("the serving peer exited {when} ({status}):\n{}", self.log());
        }
    }
}

impl Drop for ServePeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits for `child`, `limit` at most: its exit status, or `None` once the time is up.
fn wait_until(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A client bench against the serving peer, its output in files under `dir` (named after
/// `label`).
fn spawn_client(config: &Path, dir: &Path, label: &str, args: &[&str]) -> (Child, PathBuf) {
    let err = dir.join(format!("{label}.err"));
    let child = Command::new(common::ferry_bin())
        .arg("--config")
        .arg(config)
        .args(["bench", "--peers", "bench-peer"])
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join(format!("{label}.out"))).expect("out file"))
        .stderr(std::fs::File::create(&err).expect("err file"))
        .spawn()
        .expect("spawn a client bench");
    (child, err)
}

/// `ferry bench --serve-peer` outlives its clients: benches in a row (each in another mode),
/// and one killed while it sends, leave it serving; the next bench still succeeds.
#[test]
fn serve_peer_survives_clients_that_come_and_go() {
    let scratch = common::Scratch::new();
    let peer_cfg = scratch.write("peer.toml", &scratch.toml("bench-peer", &[], ""));
    let mut server = ServePeer::start(&peer_cfg);
    let client_cfg = scratch.write(
        "client.toml",
        &scratch.toml("client", &[("bench-peer", &server.addr)], ""),
    );
    // Host memory between the two same-host processes goes by shm under the default rules.
    let small = [
        "-b",
        "8",
        "-e",
        "1K",
        "-f",
        "8",
        "-n",
        "3",
        "-w",
        "1",
        "--transport",
        "shm",
    ];
    let run = |server: &mut ServePeer, label: &str, extra: &[&str]| {
        let args: Vec<&str> = small.iter().chain(extra).copied().collect();
        let (mut child, err) = spawn_client(&client_cfg, scratch.path(), label, &args);
        let status = wait_until(&mut child, Duration::from_secs(60));
        if status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let stderr = std::fs::read_to_string(&err).unwrap_or_default();
        assert!(
            status.is_some_and(|s| s.success()),
            "{label}: {status:?}\n{stderr}\nserver:\n{}",
            server.log()
        );
        server.assert_alive(&format!("after {label}"));
    };
    let modes: [&[&str]; 5] = [
        &[],
        &["--pingpong"],
        &["--bidir"],
        &["--pairs", "all"],
        &["--fetchers", "3"],
    ];
    for (i, extra) in modes.iter().cycle().take(10).enumerate() {
        run(&mut server, &format!("client{i}"), extra);
    }

    // Clients killed mid-run (under names of their own): one waiting for a ping's answer
    // (the server's answer fails), one pushing while the server sends back to it. The
    // server notices each left and serves on.
    for (name, mode) in [("doomed-ping", "--pingpong"), ("doomed-bidir", "--bidir")] {
        let config = scratch.write(
            &format!("{name}.toml"),
            &scratch.toml(name, &[("bench-peer", &server.addr)], ""),
        );
        let (mut doomed, _) = spawn_client(
            &config,
            scratch.path(),
            name,
            &[
                "-b",
                "8",
                "-e",
                "64M",
                "-n",
                "200",
                "-w",
                "1",
                "--transport",
                "shm",
                mode,
            ],
        );
        // Under way once it printed its first row (the next size is being sent).
        let out = scratch.path().join(format!("{name}.out"));
        let deadline = Instant::now() + Duration::from_secs(30);
        let under_way = loop {
            let rows = std::fs::read_to_string(&out).unwrap_or_default();
            let is_row = |l: &str| {
                let mut fields = l.split_whitespace();
                fields.next().is_some_and(|f| f.parse::<u64>().is_ok()) && fields.count() > 4
            };
            if rows.lines().any(is_row) {
                break true;
            }
            if Instant::now() >= deadline || doomed.try_wait().expect("try_wait").is_some() {
                break false;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let early_exit = doomed.try_wait().expect("try_wait");
        let _ = doomed.kill();
        let _ = doomed.wait();
        assert!(
            under_way && early_exit.is_none(),
            "{name} never got under way ({early_exit:?}):\n{}",
            server.log()
        );
        let noticed = server.wait_for_log(&["client left", name], Duration::from_secs(30));
        server.assert_alive(&format!("after {name} was killed"));
        assert!(
            noticed,
            "the server did not log that {name} left:\n{}",
            server.log()
        );
    }

    run(&mut server, "last", &[]);

    // Stopped by a signal, as ever.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let stopped = wait_until(&mut server.child, Duration::from_secs(20));
    assert!(
        stopped.is_some_and(|s| !s.success()),
        "SIGTERM did not stop the server: {stopped:?}"
    );
}
