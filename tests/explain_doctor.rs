//! `ferry explain` and `ferry doctor` end to end, on a machine without a GPU (CI). The pure
//! diagnoses have unit tests next to their code (src/cli/explain.rs, src/cli/doctor.rs).

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{Scratch, Served};

fn ferry(args: &[&str]) -> Output {
    ferry_with_path(args, None)
}

/// `ferry ARGS`, with `PATH` set to `path` when given.
fn ferry_with_path(args: &[&str], path: Option<&Path>) -> Output {
    let mut command = Command::new(common::ferry_bin());
    command.args(args).env("RUST_LOG", "error");
    if let Some(path) = path {
        command.env("PATH", path);
    }
    command.output().expect("run ferry")
}

/// The release the UCX this process loads reports (`ucp_get_version`) and the file it was
/// mapped from: the library `ferry` loads too (`FERRY_UCX_LIBRARY`, else the system's).
/// `None` (the test skips) where UCX does not load, unless `FERRY_UCX_TESTS=1`.
fn loaded_ucx(test: &str) -> Option<(String, String)> {
    let ucx = ucx_sys::testing::ucx_test(test)?;
    let file = ucx.file().expect("the mapped file is in /proc/self/maps");
    Some((ucx.version().to_string(), file.display().to_string()))
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Everything the process said, for assertion messages.
fn said(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A served echo peer `b` and a config for `a` that knows it, with `rules` appended.
fn pair(scratch: &Scratch, rules: &str) -> (Served, std::path::PathBuf) {
    let b = scratch.write("b.toml", &scratch.toml("b", &[], ""));
    let served = Served::start(&b, "echo");
    let a = scratch.write("a.toml", &scratch.toml("a", &[("b", &served.addr)], rules));
    (served, a)
}

fn explain(config: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["explain", "--config"];
    let config = config.to_str().expect("utf-8 temp path");
    args.push(config);
    args.extend_from_slice(&["--peer", "b"]);
    args.extend_from_slice(extra);
    ferry(&args)
}

#[test]
fn explain_reachable_peer_default_rules_chooses_shm() {
    let scratch = Scratch::new();
    let (_b, a) = pair(&scratch, "");
    let out = explain(&a, &["--bytes", "1M", "--memory", "host"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{}", said(&out));
    assert!(text.contains("connected to b"), "{text}");
    // The destination is b's, from its hello, as b's sends are routed.
    assert!(
        text.contains("host memory: what the peer receives into, from its hello"),
        "{text}"
    );
    assert!(
        text.contains("rule #3") && text.contains("\"same-host-host\" matched"),
        "{text}"
    );
    assert!(
        text.contains("chosen") && text.contains("shm, pull"),
        "{text}"
    );
    assert!(text.contains("same-host"), "{text}");
}

#[test]
fn explain_says_why_ipc_is_skipped() {
    let scratch = Scratch::new();
    let rules = "[[transport.rules]]\nname = \"small\"\nmax_bytes = \"4KiB\"\ntransports = [\"tcp\"]\n\n\
                 [[transport.rules]]\nname = \"all\"\ntransports = [\"ipc\", \"tcp\"]\n";
    let (_b, a) = pair(&scratch, rules);
    let out = explain(&a, &["--bytes", "64K", "--memory", "host"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{}", said(&out));
    assert!(
        text.contains("\"small\" did not match: size 64 KiB above max_bytes 4 KiB"),
        "{text}"
    );
    assert!(text.contains("\"all\" matched"), "{text}");
    // Without a GPU ipc is not viable; with one it cannot read host memory.
    assert!(
        text.contains("ipc: not viable on this machine: no CUDA driver")
            || text.contains("ipc: excluded by its declared capabilities"),
        "{text}"
    );
    assert!(text.contains("tcp, push"), "{text}");
}

#[test]
fn explain_a_rule_that_excludes_everything_exits_1() {
    let scratch = Scratch::new();
    let rules = "[[transport.rules]]\nname = \"gpu\"\ntransports = [\"ipc\"]\n";
    let (_b, a) = pair(&scratch, rules);
    let out = explain(&a, &["--bytes", "4096", "--memory", "host"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    assert!(text.contains("ipc: "), "{text}");
    assert!(
        text.contains("no transport of the rule can carry it"),
        "{text}"
    );
}

#[test]
fn explain_a_pull_rule_pushes_over_tcp() {
    let scratch = Scratch::new();
    let rules =
        "[[transport.rules]]\nname = \"pull\"\ndirection = \"pull\"\ntransports = [\"tcp\"]\n";
    let (_b, a) = pair(&scratch, rules);
    let out = explain(&a, &["--bytes", "4096", "--memory", "host"]);
    assert_eq!(out.status.code(), Some(0), "{}", said(&out));
    assert!(stdout(&out).contains("tcp, push"), "{}", stdout(&out));
}

#[test]
fn explain_unreachable_peer_reports_setup_failed() {
    let scratch = Scratch::new();
    // A port nothing listens on: bind one, learn it, close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let a = scratch.write(
        "a.toml",
        &scratch.toml("a", &[("b", &format!("127.0.0.1:{port}"))], ""),
    );
    let out = explain(&a, &["--bytes", "1M", "--memory", "host"]);
    let text = stdout(&out);
    assert!(text.contains("setup failed:"), "{}", said(&out));
    // The route is still explained from this side's declarations.
    assert!(text.contains("tcp, push"), "{text}");
    assert_eq!(out.status.code(), Some(0), "{}", said(&out));
}

#[test]
fn explain_device_memory_says_gpu_transports_are_unavailable() {
    let scratch = Scratch::new();
    let a = scratch.write("a.toml", &scratch.toml("a", &[("b", "127.0.0.1:1")], ""));
    let out = explain(&a, &["--bytes", "1G", "--memory", "device", "--no-connect"]);
    let text = stdout(&out);
    if has_cuda() {
        // A GPU machine: the default rule's ipc carries it.
        assert_eq!(out.status.code(), Some(0), "{}", said(&out));
        assert!(text.contains("chosen   ipc, pull"), "{text}");
        return;
    }
    // Without a link the peer's receive memory is unknown: host is assumed, as a send
    // before the first link routes. staged cannot read device memory without a driver;
    // tcp copies it out (there is none on this machine to send, but the rule is explained).
    assert_eq!(out.status.code(), Some(0), "{}", said(&out));
    assert!(text.contains("GPU transports are not available"), "{text}");
    assert!(text.contains("host memory: assumed"), "{text}");
    assert!(
        text.contains("staged: excluded by its declared capabilities: cannot move device memory"),
        "{text}"
    );
    assert!(text.contains("rule #0  \"gpu\" matched"), "{text}");
    assert!(text.contains("tcp, push"), "{text}");
}

#[test]
fn explain_json_parses() {
    let scratch = Scratch::new();
    let (_b, a) = pair(&scratch, "");
    let out = explain(
        &a,
        &[
            "--bytes",
            "4096",
            "--memory",
            "host",
            "--dst-memory",
            "host",
            "--layout",
            "blocks",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", said(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("explain --json is JSON");
    // Every transport carries block lists: the route is the contiguous one.
    assert_eq!(v["layout"], "blocks");
    assert_eq!(v["chosen"]["transport"], "shm");
    assert_eq!(v["rule"]["name"], "same-host-host");
    assert_eq!(v["dst"], "host");
    assert_eq!(v["dst_from"], "dst-memory");
    assert_eq!(v["setup"]["connected"], true);
}

fn doctor(config: Option<&Path>, extra: &[&str]) -> Output {
    let mut args: Vec<&str> = vec!["doctor"];
    if let Some(c) = config {
        args.extend_from_slice(&["--config", c.to_str().expect("utf-8 temp path")]);
    }
    args.extend_from_slice(extra);
    ferry(&args)
}

/// Whether this machine has a CUDA driver (then the "no CUDA driver" line cannot appear).
fn has_cuda() -> bool {
    [
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "/usr/lib64/libcuda.so.1",
        "/usr/lib/libcuda.so.1",
    ]
    .iter()
    .any(|p| Path::new(p).exists())
}

#[test]
fn doctor_default_config_passes_and_says_no_cuda() {
    let scratch = Scratch::new();
    let a = scratch.write("a.toml", &scratch.toml("a", &[], ""));
    let out = doctor(Some(&a), &[]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{}", said(&out));
    assert!(
        text.contains("rule #4 host") && text.contains("uses tcp"),
        "{text}"
    );
    assert!(
        text.contains("/dev/shm") && text.contains("memlock") && text.contains("ucx"),
        "{text}"
    );
    if !has_cuda() {
        assert!(
            text.contains("no CUDA driver: GPU transports disabled"),
            "{text}"
        );
    }
    // On a GPU machine, how block lists of device memory are copied (batched from CUDA
    // 12.8 on), and that the gather kernel loaded on GPU 0 (the driver compiled its PTX).
    if std::env::var("FERRY_GPU_TESTS").as_deref() == Ok("1") {
        assert!(
            text.contains("block copies") && text.contains("cuMemcpy"),
            "{text}"
        );
        assert!(text.contains("the kernel loaded on GPU 0"), "{text}");
    }
}

#[test]
fn doctor_exits_1_when_the_only_rule_names_ipc() {
    let scratch = Scratch::new();
    let rules = "[[transport.rules]]\nname = \"gpu\"\ntransports = [\"ipc\"]\n";
    let a = scratch.write("a.toml", &scratch.toml("a", &[], rules));
    let out = doctor(Some(&a), &[]);
    let text = stdout(&out);
    if has_cuda() {
        // A GPU machine: ipc runs here, so the rule blocks nothing.
        assert_eq!(out.status.code(), Some(0), "{}", said(&out));
        assert!(
            text.contains("rule #0 gpu") && text.contains("uses ipc"),
            "{text}"
        );
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    assert!(
        text.contains("problem") && text.contains("rule #0 gpu"),
        "{text}"
    );
    let out = doctor(Some(&a), &["--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("doctor --json is JSON");
    assert_eq!(v["blocked"], true);
    let findings = v["findings"].as_array().expect("findings");
    assert!(
        findings.iter().any(|f| f["check"] == "rule #0 gpu"
            && f["status"] == "problem"
            && f["blocks"] == true)
    );
}

#[test]
fn doctor_names_the_loaded_ucx_release_and_file_without_ucx_info() {
    let Some((release, file)) =
        loaded_ucx("doctor_names_the_loaded_ucx_release_and_file_without_ucx_info")
    else {
        return;
    };
    let scratch = Scratch::new();
    let a = scratch.write("a.toml", &scratch.toml("a", &[], ""));
    // No ucx_info: a PATH of one empty directory.
    let no_tools = scratch.path().join("no-tools");
    std::fs::create_dir(&no_tools).expect("an empty directory");
    let args = ["doctor", "--config", a.to_str().expect("utf-8 temp path")];
    let out = ferry_with_path(&args, Some(&no_tools));
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{}", said(&out));
    let ucx = text
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("ucx"))
        .unwrap_or_else(|| panic!("no ucx line: {text}"));
    let named = format!("UCX {release} from {file}");
    assert!(ucx.contains(&named), "no {named:?} in {ucx}");
    // What is unknown, and why.
    assert!(
        ucx.contains(
            "transports unknown (ucx_info is not on PATH): whether it has an RDMA transport"
        ),
        "{ucx}"
    );
    assert!(
        text.contains(&format!("the ucx_info of UCX {release}")),
        "{text}"
    );
    // The same in JSON.
    let out = ferry_with_path(&[&args[..], &["--json"]].concat(), Some(&no_tools));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("doctor --json is JSON");
    let found = v["findings"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["check"] == "ucx"))
        .and_then(|f| f["found"].as_str())
        .unwrap_or_default()
        .to_string();
    assert!(found.contains(&named), "{}", said(&out));
}

#[test]
fn explain_names_the_loaded_ucx_release_for_a_rule_over_ucx() {
    let Some((release, file)) =
        loaded_ucx("explain_names_the_loaded_ucx_release_for_a_rule_over_ucx")
    else {
        return;
    };
    let scratch = Scratch::new();
    let rules = "[[transport.rules]]\nname = \"net\"\ntransports = [\"ucx\", \"tcp\"]\n";
    let a = scratch.write("a.toml", &scratch.toml("a", &[("b", "127.0.0.1:1")], rules));
    let asked = ["--bytes", "1M", "--memory", "host", "--no-connect"];
    let out = explain(&a, &asked);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{}", said(&out));
    let named = format!("UCX {release} from {file}");
    assert!(
        text.lines()
            .any(|l| l.trim_start().starts_with("ucx ") && l.contains(&named)),
        "no ucx line with {named:?}: {text}"
    );
    let out = explain(&a, &[&asked[..], &["--json"]].concat());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("explain --json is JSON");
    assert_eq!(v["ucx"]["release"], release.as_str(), "{}", said(&out));
    assert_eq!(v["ucx"]["file"], file.as_str(), "{}", said(&out));
    // A rule that does not name ucx says nothing of it.
    let a = scratch.write("a.toml", &scratch.toml("a", &[("b", "127.0.0.1:1")], ""));
    let text = stdout(&explain(&a, &asked));
    assert!(!text.contains(&named), "{text}");
}
