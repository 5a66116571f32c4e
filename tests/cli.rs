//! The `ferry` command: config check/show, serve's signals and start-up refusals, demo.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Scratch, Served};

fn ferry() -> Command {
    let mut cmd = Command::new(common::ferry_bin());
    cmd.stdin(Stdio::null()).env("RUST_LOG", "warn");
    cmd
}

#[test]
fn config_check_accepts_every_example() {
    // Where cargo built the test, else (a bundle carried to a GPU machine) the working tree.
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples");
    let dir = if built.exists() {
        built
    } else {
        std::path::PathBuf::from("config/examples")
    };
    // `config check` reads the secret file too: point the examples' /etc/ferry/secret at one
    // that exists here.
    let scratch = Scratch::new();
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("examples dir") {
        let example = entry.expect("entry").path();
        let text = std::fs::read_to_string(&example).expect("read example");
        let name = example.file_name().expect("file name").to_string_lossy();
        let path = scratch.write(
            &name,
            &text.replace("/etc/ferry/secret", &scratch.secret.display().to_string()),
        );
        let out = ferry()
            .current_dir(&dir)
            .args(["config", "check"])
            .arg(&path)
            .output()
            .expect("run");
        assert!(
            out.status.success(),
            "{}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        checked += 1;
    }
    assert!(checked >= 3, "only {checked} examples");
}

#[test]
fn config_check_names_the_key_and_file() {
    let scratch = Scratch::new();
    let cases = [
        ("unknown.toml", "[limits]\nmailboxx = 3\n", "mailboxx"),
        (
            "type.toml",
            "[limits]\nmailbox = \"many\"\n",
            "limits.mailbox",
        ),
        (
            "size.toml",
            "[limits]\nmax_frame = \"12 parsecs\"\n",
            "limits.max_frame",
        ),
        (
            "duration.toml",
            "[limits]\ndefault_deadline = \"soon\"\n",
            "limits.default_deadline",
        ),
        (
            "rule.toml",
            "[[transport.rules]]\nname = \"r\"\ntransports = [\"carrier-pigeon\"]\ndirection = \"push\"\n",
            "transport.rules[0].transports",
        ),
        (
            "large.toml",
            "[limits]\nmailbox = 99999999999999999999999\n",
            "limits.mailbox",
        ),
        // An empty file sets nothing: the missing security choice is blamed on it.
        ("empty.toml", "", "security.secret_file"),
    ];
    for (file, text, key) in cases {
        let path = scratch.write(file, text);
        let out = ferry()
            .args(["config", "check"])
            .arg(&path)
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{file}: {stderr}");
        assert!(stderr.contains(key), "{file}: no key {key} in {stderr}");
        assert!(stderr.contains(file), "{file}: file not named in {stderr}");
    }
}

/// `ferry config check` run both ways on `config`: as FILE, and as the `--config` layer
/// (with no user file); returns each run's exit code and stderr.
fn check_both_ways(scratch: &Scratch, config: &std::path::Path) -> [(Option<i32>, String); 2] {
    let file_form = ferry().args(["config", "check"]).arg(config).output();
    let layered = ferry()
        .args(["config", "check", "--config"])
        .arg(config)
        .env("XDG_CONFIG_HOME", scratch.path())
        .output();
    [file_form, layered].map(|out| {
        let out = out.expect("run");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
}

#[test]
fn config_check_reads_the_secret_file() {
    use std::os::unix::fs::PermissionsExt;
    let scratch = Scratch::new();
    let missing = scratch.path().join("no-such-secret");
    let short = scratch.path().join("short-secret");
    common::write_secret(&short, "5byte");
    let open = scratch.path().join("open-secret");
    std::fs::write(&open, "sixteen bytes or more").expect("secret");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    for (secret, why) in [
        (&missing, "cannot read"),
        (&short, "at least 16"),
        (&open, "mode 0644"),
    ] {
        let config = scratch.write("n.toml", &scratch.toml_with_secret("n", &[], "", secret));
        for (code, stderr) in check_both_ways(&scratch, &config) {
            assert_eq!(code, Some(1), "{}: {stderr}", secret.display());
            assert!(
                stderr.contains(&format!("secret file {}: ", secret.display())),
                "the secret file is not named: {stderr}"
            );
            assert!(stderr.contains("security.secret_file"), "{stderr}");
            assert!(stderr.contains(why), "no {why:?} in {stderr}");
        }
    }
    let config = scratch.write("n.toml", &scratch.toml("n", &[], ""));
    for (code, stderr) in check_both_ways(&scratch, &config) {
        assert_eq!(code, Some(0), "{stderr}");
    }
    // The opt-out accepts the open file.
    let text = scratch.toml_with_secret("n", &[], "", &open).replace(
        "[security]\n",
        "[security]\ndanger_secret_file_any_mode = true\n",
    );
    let config = scratch.write("n.toml", &text);
    for (code, stderr) in check_both_ways(&scratch, &config) {
        assert_eq!(code, Some(0), "{stderr}");
    }
}

/// Runs `command` and returns its exit code and stderr.
fn code_and_stderr(command: &mut Command) -> (Option<i32>, String) {
    let out = command.output().expect("run");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn config_check_and_serve_name_the_layer_that_set_a_refused_secret_file() {
    let scratch = Scratch::new();
    let short = scratch.path().join("short-secret");
    common::write_secret(&short, "5byte");
    let refused = format!(
        "key security.secret_file: secret file {}: the secret is 5 bytes",
        short.display()
    );
    // The file, with the line of `secret_file`: checked alone, as the `--config` layer,
    // and by `serve`.
    let config = scratch.write("n.toml", &scratch.toml_with_secret("n", &[], "", &short));
    let from_file = format!("config file {}, line 6: {refused}", config.display());
    // `ferry ARGS --config FILE`, with no user file.
    let with_config = |args: &[&str], file: &std::path::Path| {
        let mut command = ferry();
        command
            .args(args)
            .arg("--config")
            .arg(file)
            .env("XDG_CONFIG_HOME", scratch.path());
        command
    };
    for mut command in [
        {
            let mut alone = ferry();
            alone.args(["config", "check"]).arg(&config);
            alone
        },
        with_config(&["config", "check"], &config),
        with_config(&["serve"], &config),
    ] {
        let (code, stderr) = code_and_stderr(&mut command);
        assert_eq!(code, Some(1), "{command:?}: {stderr}");
        assert!(
            stderr.contains(&from_file),
            "{command:?}: no {from_file:?} in {stderr}"
        );
    }
    // A variable and `--set`, above a file that names a good secret.
    let good = scratch.write("good.toml", &scratch.toml("n", &[], ""));
    let variable = "FERRY__SECURITY__SECRET_FILE";
    for (mut command, origin) in [
        {
            let mut command = with_config(&["config", "check"], &good);
            command.env(variable, &short);
            (command, format!("environment variable {variable}"))
        },
        {
            let mut command = with_config(&["serve"], &good);
            command.env(variable, &short);
            (command, format!("environment variable {variable}"))
        },
        {
            let mut command = with_config(&["config", "check"], &good);
            command
                .arg("--set")
                .arg(format!("security.secret_file={}", short.display()));
            (command, "command line".to_string())
        },
    ] {
        let (code, stderr) = code_and_stderr(&mut command);
        let expected = format!("{origin}: {refused}");
        assert_eq!(code, Some(1), "{command:?}: {stderr}");
        assert!(
            stderr.contains(&expected),
            "{command:?}: no {expected:?} in {stderr}"
        );
    }
}

#[test]
fn serve_names_the_file_and_line_of_gpus_it_cannot_open() {
    let scratch = Scratch::new();
    let config = scratch.write("n.toml", &scratch.toml("n", &[], "[gpu]\ndevices = [99]\n"));
    let (code, stderr) = code_and_stderr(ferry().args(["serve", "--config"]).arg(&config));
    assert_eq!(code, Some(1), "{stderr}");
    // Without a CUDA driver "names GPUs [99], but ..."; with one, "names GPU 99, but ...".
    let expected = format!(
        "config file {}, line 9: key gpu.devices: names GPU",
        config.display()
    );
    assert!(stderr.contains(&expected), "no {expected:?} in {stderr}");
}

#[test]
fn config_check_names_the_file_of_a_layer_that_sets_nothing() {
    let scratch = Scratch::new();
    let empty = scratch.write("empty.toml", "");
    for (code, stderr) in check_both_ways(&scratch, &empty) {
        assert_eq!(code, Some(1), "{stderr}");
        assert!(
            stderr.contains(&format!("config file {}: ", empty.display())),
            "{stderr}"
        );
        assert!(stderr.contains("security.secret_file"), "{stderr}");
        assert!(stderr.contains("the file sets no keys"), "{stderr}");
        assert!(!stderr.contains("built-in defaults"), "{stderr}");
    }
}

#[test]
fn config_check_names_the_variable_of_a_number_too_large() {
    let scratch = Scratch::new();
    let config = scratch.write("n.toml", &scratch.toml("n", &[], ""));
    let out = ferry()
        .args(["config", "check", "--config"])
        .arg(&config)
        .env("XDG_CONFIG_HOME", scratch.path())
        .env("FERRY__LIMITS__MAILBOX", "99999999999999999999999")
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "environment variable FERRY__LIMITS__MAILBOX: key limits.mailbox: number 99999999999999999999999 is out of range"
        ),
        "{stderr}"
    );
}

/// `transport.ipc.recv_spin`, `node.recv_spin` until 2026-12-01, still checks as valid with a
/// warning naming the file, line and new key; both names at once are refused, naming both.
#[test]
fn config_check_warns_of_the_old_name_of_recv_spin() {
    let scratch = Scratch::new();
    let old = scratch.write(
        "old.toml",
        &scratch.toml("n", &[], "[transport.ipc]\nrecv_spin = \"50us\"\n"),
    );
    let line = |path: &std::path::Path, n: u32| format!("config file {}, line {n}", path.display());
    for (code, stderr) in check_both_ways(&scratch, &old) {
        assert_eq!(code, Some(0), "{stderr}");
        assert!(
            stderr.contains(&format!(
                "warning: {}: key transport.ipc.recv_spin is deprecated: write node.recv_spin",
                line(&old, 9)
            )),
            "{stderr}"
        );
    }
    let out = ferry()
        .args(["config", "show", "--config"])
        .arg(&old)
        .env("XDG_CONFIG_HOME", scratch.path())
        .output()
        .expect("run");
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let node = shown
        .split("\n[")
        .find(|t| t.starts_with("node]"))
        .expect("[node]");
    assert!(node.contains("recv_spin = \"50us\""), "{shown}");
    assert_eq!(shown.matches("recv_spin").count(), 1, "{shown}");

    let both = scratch.write(
        "both.toml",
        &scratch
            .toml("n", &[], "[transport.ipc]\nrecv_spin = \"50us\"\n")
            .replacen("\n\n[security]", "\nrecv_spin = \"5us\"\n\n[security]", 1),
    );
    for (code, stderr) in check_both_ways(&scratch, &both) {
        assert_eq!(code, Some(1), "{stderr}");
        assert!(
            stderr.contains(&format!(
                "{}: key transport.ipc.recv_spin: the old name of node.recv_spin, which is set too",
                line(&both, 10)
            )),
            "{stderr}"
        );
        assert!(
            stderr.contains(&format!("; node.recv_spin from {}", line(&both, 4))),
            "{stderr}"
        );
    }
}

#[test]
fn config_show_prints_the_merged_configuration() {
    let scratch = Scratch::new();
    let path = scratch.write("a.toml", &scratch.toml("alpha", &[], ""));
    let out = ferry()
        .args(["config", "show", "--config"])
        .arg(&path)
        .args(["--set", "limits.mailbox=77"])
        .env("FERRY__LIMITS__PEER_QUEUE", "55")
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("name = \"alpha\""), "{stdout}");
    assert!(stdout.contains("mailbox = 77"), "{stdout}");
    assert!(stdout.contains("peer_queue = 55"), "{stdout}");
}

#[test]
fn serve_refuses_to_start_without_a_secret() {
    let scratch = Scratch::new();
    let path = scratch.write(
        "n.toml",
        "[node]\nname = \"n\"\nlisten = [\"127.0.0.1:0\"]\n",
    );
    let out = ferry()
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("secret_file"), "{stderr}");
    assert!(stderr.contains("danger_insecure"), "{stderr}");
}

#[test]
fn serve_refuses_to_listen_on_any_address_without_the_danger_flag() {
    let scratch = Scratch::new();
    let text = scratch
        .toml("n", &[], "")
        .replace("127.0.0.1:0", "0.0.0.0:0");
    let path = scratch.write("n.toml", &text);
    let out = ferry()
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("danger_listen_any"), "{stderr}");
}

#[test]
fn serve_drains_and_exits_0_on_sigterm() {
    let scratch = Scratch::new();
    let path = scratch.write("s.toml", &scratch.toml("s", &[], ""));
    let mut served = Served::start(&path, "echo");
    nix::sys::signal::kill(served.pid(), nix::sys::signal::Signal::SIGTERM).expect("signal");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = served.child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "serve did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
}

#[test]
fn demo_verifies_every_checksum() {
    let out = ferry()
        .args(["demo", "--buffers", "40", "--max-size", "2MiB"])
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("checksums verified"), "{stdout}");
    // tcp in host memory; ipc where there are GPUs.
    assert!(
        stdout.contains("tcp") || stdout.contains("ipc"),
        "the table names the transport: {stdout}"
    );
}

/// The number just before `word` in `text`, e.g. 3 in "3 spilled".
fn count_before(text: &str, word: &str) -> Option<u64> {
    let at = text.find(word)?;
    text[..at].split_whitespace().last()?.parse().ok()
}

#[test]
fn demo_under_pressure_spills_promotes_and_verifies() {
    let started = Instant::now();
    let out = ferry()
        // A slow reader (5 MB/s), so that a backlog builds up even in a debug build on a
        // busy machine.
        .args(["demo", "--pressure", "--buffers", "60", "--drain-rate", "5"])
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("pressure:") && l.contains("received"))
        .unwrap_or_else(|| panic!("no pressure summary: {stdout}"));
    let spilled = count_before(line, " spilled to host").expect("spilled count");
    let promoted = count_before(line, " promoted back").expect("promoted count");
    assert!(spilled > 0, "nothing spilled: {line}");
    assert!(promoted > 0, "nothing promoted: {line}");
    assert!(stdout.contains("checksums verified"), "{stdout}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn demo_prints_its_table_without_info_logs_by_default() {
    // No RUST_LOG, and no user configuration that could set a level: the defaults alone.
    let scratch = Scratch::new();
    let out = ferry()
        .env_remove("RUST_LOG")
        .env_remove("FERRY__TELEMETRY__LOG_LEVEL")
        .env("XDG_CONFIG_HOME", scratch.path())
        .args([
            "demo",
            "--host",
            "--stages",
            "1",
            "--buffers",
            "20",
            "--max-size",
            "64KiB",
        ])
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("checksums verified"), "{stdout}");
    for (name, text) in [("stdout", &stdout), ("stderr", &stderr)] {
        assert!(
            !text.lines().any(|l| l.contains(" INFO ")),
            "INFO lines on {name} by default:\n{text}"
        );
    }
}
