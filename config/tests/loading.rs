//! Loading files and layers: the examples, every kind of bad file, and layering order.
//! No test reads /etc or the user's configuration directory.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ferry_config::{
    Budget, Config, ConfigError, Direction, KeyOrigin, LoadOptions, Locality, MemoryClass, Origin,
    PeerAddress, TransportName, load,
};
use tempfile::TempDir;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The smallest valid file: the insecure flag, as a top-level dotted key so that any table
/// can follow.
const BASE: &str = "security.danger_insecure = true\n";

fn write(dir: &TempDir, name: &str, text: &str) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).expect("write to a temporary directory");
    path
}

fn load_only(path: &Path) -> Result<Config, ConfigError> {
    load(&LoadOptions::only_file(path))
}

/// Loads `BASE` + `extra` as a file and expects an error naming `key` and the file.
fn expect_bad(extra: &str, key: &str) -> ConfigError {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = write(&dir, "bad.toml", &format!("{BASE}{extra}"));
    let err = load_only(&path).expect_err(extra);
    let message = err.to_string();
    assert!(
        message.contains(&format!("config file {}", path.display())),
        "error does not name the file: {message}"
    );
    assert!(
        message.contains(&format!("key {key}:")),
        "error does not name key {key}: {message}"
    );
    assert_eq!(err.key(), Some(key), "{message}");
    err
}

fn examples_dir() -> PathBuf {
    // Where cargo built the test, else (a bundle carried to a GPU machine) the working tree.
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    if built.exists() {
        built
    } else {
        Path::new("config/examples").to_path_buf()
    }
}

#[test]
fn every_example_loads_and_validates() -> TestResult {
    let mut count = 0;
    for entry in std::fs::read_dir(examples_dir())? {
        let path = entry?.path();
        let extension = path.extension().and_then(|e| e.to_str());
        if matches!(extension, Some("toml" | "yaml" | "yml")) {
            let config = load_only(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            config.validate()?;
            // What `ferry config show` prints reads back to the same configuration.
            assert_eq!(
                Config::from_toml_str(&config.to_toml()?)?,
                config,
                "{}",
                path.display()
            );
            count += 1;
        }
    }
    assert!(count >= 5, "expected at least 5 examples, found {count}");
    Ok(())
}

#[test]
fn full_example_states_the_defaults() -> TestResult {
    let mut config = load_only(&examples_dir().join("full.toml"))?;
    // The two keys that full.toml marks as not their default.
    config.node.name = Config::default().node.name;
    config.security.secret_file = None;
    assert_eq!(config, Config::default());
    Ok(())
}

#[test]
fn yaml_example_reads_like_toml() -> TestResult {
    let config = load_only(&examples_dir().join("pipeline.yaml"))?;
    assert_eq!(config.node.name, "stage-1");
    assert_eq!(config.memory.host, Budget::Bytes(64 << 30));
    assert_eq!(config.transport.tcp.chunk_size, 4 << 20);
    assert_eq!(config.limits.default_deadline, Duration::from_secs(120));
    assert_eq!(
        config.peers[1].address,
        PeerAddress::Unix("/run/ferry/consumer.sock".into())
    );
    let (index, rule) = config
        .transport
        .first_match(
            Locality::Remote,
            MemoryClass::Device,
            MemoryClass::Device,
            8 << 20,
        )
        .ok_or("a rule should match")?;
    assert_eq!((index, rule.name.as_str()), (1, "gpu-remote-large"));
    assert_eq!(rule.transports[0], TransportName::Ucx);
    Ok(())
}

#[test]
fn two_node_examples_point_at_each_other() -> TestResult {
    let a = load_only(&examples_dir().join("two-nodes-a.toml"))?;
    let b = load_only(&examples_dir().join("two-nodes-b.toml"))?;
    assert_eq!(a.peers[0].name, b.node.name);
    assert_eq!(b.peers[0].name, a.node.name);
    assert_eq!(a.security.secret_file, b.security.secret_file);
    let (_, rule) = a
        .transport
        .first_match(
            Locality::SameHost,
            MemoryClass::Device,
            MemoryClass::Device,
            1,
        )
        .ok_or("a rule should match")?;
    assert_eq!(rule.direction, Some(Direction::Pull));
    Ok(())
}

#[test]
fn an_empty_file_needs_only_a_security_choice() -> TestResult {
    let dir = tempfile::tempdir()?;
    let empty = write(&dir, "empty.toml", "");
    let err = load_only(&empty).expect_err("no secret");
    assert!(
        err.to_string().contains(
            "security.secret_file is not set; set it, or set security.danger_insecure = true for a test setup"
        ),
        "{err}"
    );
    assert_eq!(err.key(), Some("security.secret_file"));
    let config = load_only(&write(
        &dir,
        "ok.toml",
        "[security]\ndanger_insecure = true\n",
    ))?;
    assert_eq!(config.transport.rules.len(), 5);
    Ok(())
}

#[test]
fn a_key_no_layer_sets_is_blamed_on_the_file_read() -> TestResult {
    let dir = tempfile::tempdir()?;
    // An empty file (or one of comments only) sets nothing, and the error says so.
    for (name, text) in [("empty.toml", ""), ("comments.toml", "# nothing yet\n")] {
        let path = write(&dir, name, text);
        let err = load_only(&path).expect_err(name);
        assert_eq!(err.origin(), Some(&Origin::File(path.clone())), "{err}");
        assert_eq!(err.key(), Some("security.secret_file"), "{err}");
        let message = err.to_string();
        assert!(
            message.starts_with(&format!(
                "config file {}: key security.secret_file: ",
                path.display()
            )),
            "{message}"
        );
        assert!(message.ends_with("; the file sets no keys"), "{message}");
    }
    // A file that sets other keys is named without the remark.
    let named = write(&dir, "named.toml", "[node]\nname = \"a\"\n");
    let err = load_only(&named).expect_err("no secret");
    assert_eq!(err.origin(), Some(&Origin::File(named.clone())), "{err}");
    assert!(!err.to_string().contains("sets no keys"), "{err}");
    // Several files: the highest is named, the others listed.
    let system = write(&dir, "system.toml", "[limits]\nmailbox = 9\n");
    let opts = LoadOptions {
        system_file: Some(system.clone()),
        user_file: Some(dir.path().join("absent.toml")),
        file: Some(named.clone()),
        env: false,
        env_vars: None,
        overrides: Vec::new(),
    };
    let err = load(&opts).expect_err("no secret");
    assert_eq!(err.origin(), Some(&Origin::File(named)), "{err}");
    assert!(
        err.to_string().ends_with(&format!(
            "; not set in config file {} either",
            system.display()
        )),
        "{err}"
    );
    // No file at all: the defaults, and where files were looked for.
    let opts = LoadOptions {
        file: None,
        system_file: Some(dir.path().join("no-system.toml")),
        ..opts
    };
    let err = load(&opts).expect_err("no secret");
    assert_eq!(err.origin(), Some(&Origin::Defaults), "{err}");
    assert!(
        err.to_string().contains(&format!(
            "no configuration file was read (looked for {}, {})",
            dir.path().join("no-system.toml").display(),
            dir.path().join("absent.toml").display()
        )),
        "{err}"
    );
    Ok(())
}

#[test]
fn numbers_too_large_are_named() {
    for (extra, key) in [
        (
            "[limits]\nmailbox = 99999999999999999999999\n",
            "limits.mailbox",
        ),
        // Above i64::MAX, the largest TOML integer, though it fits a u64.
        (
            "[limits]\nmailbox = 9999999999999999999\n",
            "limits.mailbox",
        ),
        (
            "limits.peer_queue = 99999999999999999999 # c\n",
            "limits.peer_queue",
        ),
        (
            "[limits]\nmax_frame = { x = 99999999999999999999 }\n",
            "limits.max_frame.x",
        ),
        (
            "[[transport.rules]]\nname = \"a\"\ntransports = [\"tcp\"]\n\
             [[transport.rules]]\nname = \"b\"\ntransports = [\"tcp\"]\nmax_bytes = 99999999999999999999\n",
            "transport.rules[1].max_bytes",
        ),
        (
            "[gpu]\ndevices = [\n  0,\n  99999999999999999999,\n]\n",
            "gpu.devices[1]",
        ),
    ] {
        let err = expect_bad(extra, key);
        assert!(matches!(err, ConfigError::Invalid { .. }), "{err:?}");
        let message = err.to_string();
        assert!(message.contains("99999999999"), "{message}");
        assert!(message.contains("number too large"), "{message}");
        assert!(message.contains("(line "), "{message}");
    }
    // Inline text, and other values the TOML parser refuses before the schema sees them.
    let err =
        Config::from_toml_str("[limits]\nmailbox = 99999999999999999999\n").expect_err("too large");
    assert_eq!(err.key(), Some("limits.mailbox"), "{err}");
    assert_eq!(err.origin(), Some(&Origin::Inline), "{err}");
    expect_bad("[node]\nname = unquoted\n", "node.name");
    // A broken document, not a refused value, is still a parse error with a line.
    let err = Config::from_toml_str("[limits]\nmailbox = 3\nmailbox = 4\n").expect_err("twice");
    assert!(matches!(err, ConfigError::Parse { .. }), "{err:?}");
}

#[test]
fn numbers_too_large_from_yaml_and_variables_are_named() -> TestResult {
    let dir = tempfile::tempdir()?;
    let yaml = write(
        &dir,
        "big.yaml",
        "security:\n  danger_insecure: true\nlimits:\n  mailbox: 99999999999999999999999\n",
    );
    let err = load_only(&yaml).expect_err("too large");
    assert_eq!(err.key(), Some("limits.mailbox"), "{err}");
    assert_eq!(err.origin(), Some(&Origin::File(yaml)), "{err}");
    assert!(err.to_string().contains("out of range"), "{err}");
    // YAML reads these as floats, which would saturate to u64::MAX without a word.
    for value in ["-99999999999999999999999", "1e30"] {
        let path = write(
            &dir,
            "big.yml",
            &format!("security:\n  danger_insecure: true\ngpu:\n  devices: [0, {value}]\n"),
        );
        let err = load_only(&path).expect_err(value);
        assert_eq!(err.key(), Some("gpu.devices[1]"), "{err}");
    }
    let base = write(&dir, "base.toml", BASE);
    for value in ["99999999999999999999999", "-99999999999999999999999"] {
        let mut opts = LoadOptions::only_file(&base);
        opts.env = true;
        opts.env_vars = Some(vec![("FERRY__LIMITS__MAILBOX".into(), value.into())]);
        let err = load(&opts).expect_err(value);
        assert_eq!(err.key(), Some("limits.mailbox"), "{err}");
        assert_eq!(
            err.to_string(),
            format!(
                "environment variable FERRY__LIMITS__MAILBOX: key limits.mailbox: number {value} is out of range for this key"
            )
        );
        let mut opts = LoadOptions::only_file(&base);
        opts.overrides = vec![("limits.mailbox".into(), value.into())];
        let err = load(&opts).expect_err(value);
        assert_eq!(err.key(), Some("limits.mailbox"), "{err}");
        assert_eq!(err.origin(), Some(&Origin::CommandLine), "{err}");
    }
    Ok(())
}

#[test]
fn unknown_keys_are_named() {
    let err = expect_bad("bogus = 1\n", "bogus");
    assert!(err.to_string().contains("unknown field `bogus`"), "{err}");
    expect_bad("[limits]\nmailboxx = 3\n", "limits.mailboxx");
    // Moved to `limits.pipeline_depth`: the old key is refused, not silently ignored.
    expect_bad(
        "[transport.tcp]\npipeline_depth = 8\n",
        "transport.tcp.pipeline_depth",
    );
    expect_bad(
        "[transport.tcp]\nchunk = \"1 MiB\"\n",
        "transport.tcp.chunk",
    );
    expect_bad(
        "[[transport.rules]]\nname = \"r\"\ntransports = [\"tcp\"]\nspeed = 3\n",
        "transport.rules[0].speed",
    );
}

#[test]
fn wrong_types_are_named() {
    let err = expect_bad("[limits]\nmailbox = \"many\"\n", "limits.mailbox");
    assert!(err.to_string().contains("line 3"), "{err}");
    expect_bad(
        "[node]\ndanger_listen_any = \"yes\"\n",
        "node.danger_listen_any",
    );
    expect_bad("[node]\nlisten = \"127.0.0.1:1\"\n", "node.listen");
}

#[test]
fn bad_sizes_are_named() {
    let err = expect_bad("[limits]\nmax_frame = \"12 parsecs\"\n", "limits.max_frame");
    assert!(
        err.to_string().contains("invalid size \"12 parsecs\""),
        "{err}"
    );
    expect_bad(
        "[transport.tcp]\nchunk_size = -1\n",
        "transport.tcp.chunk_size",
    );
    expect_bad("[memory]\nhost = \"0%\"\n", "memory.host");
    expect_bad("[memory]\nhost = \"150%\"\n", "memory.host");
}

#[test]
fn bad_durations_are_named() {
    let err = expect_bad(
        "[limits]\ndefault_deadline = \"soon\"\n",
        "limits.default_deadline",
    );
    assert!(
        err.to_string().contains("invalid duration \"soon\""),
        "{err}"
    );
    expect_bad("[limits]\nconnect_timeout = 5\n", "limits.connect_timeout");
}

#[test]
fn bad_rules_are_named() {
    let rule = |body: &str| format!("[[transport.rules]]\nname = \"r\"\n{body}\n");
    let err = expect_bad(
        &rule("transports = [\"tcp\", \"carrier-pigeon\"]"),
        "transport.rules[0].transports[1]",
    );
    assert!(err.to_string().contains("carrier-pigeon"), "{err}");
    let err = expect_bad(
        &rule("transports = [\"tcp\"]\nmin_bytes = \"2 MiB\"\nmax_bytes = \"1 MiB\""),
        "transport.rules[0].max_bytes",
    );
    assert!(err.to_string().contains("min_bytes"), "{err}");
    expect_bad(&rule("transports = []"), "transport.rules[0].transports");
    expect_bad(
        &rule("transports = [\"ipc\", \"ipc\"]"),
        "transport.rules[0].transports",
    );
    expect_bad(
        &rule("transports = [\"tcp\"]\nlocality = [\"nearby\"]"),
        "transport.rules[0].locality[0]",
    );
    expect_bad("transport.rules = []\n", "transport.rules");
}

#[test]
fn listening_everywhere_needs_the_danger_flag() -> TestResult {
    let err = expect_bad("[node]\nlisten = [\"0.0.0.0:7070\"]\n", "node.listen[0]");
    assert!(err.to_string().contains("danger_listen_any"), "{err}");
    expect_bad("[node]\nlisten = [\"[::]:7070\"]\n", "node.listen[0]");
    expect_bad(
        "[node]\nlisten = [\"example.com:7070\"]\n",
        "node.listen[0]",
    );
    let dir = tempfile::tempdir()?;
    let path = write(
        &dir,
        "any.toml",
        &format!("{BASE}[node]\nlisten = [\"0.0.0.0:7070\"]\ndanger_listen_any = true\n"),
    );
    assert_eq!(load_only(&path)?.node.listen, ["0.0.0.0:7070"]);
    Ok(())
}

#[test]
fn keys_that_depend_on_each_other_are_both_named() {
    let err = expect_bad("[limits]\nmax_frame = \"1 MiB\"\n", "limits.max_frame");
    assert!(
        err.to_string().contains("transport.tcp.chunk_size"),
        "{err}"
    );
}

#[test]
fn budgets_read_percentages_and_sizes() -> TestResult {
    let dir = tempfile::tempdir()?;
    for (text, budget) in [
        ("\"80%\"", Budget::Percent(80.0)),
        ("\"12.5%\"", Budget::Percent(12.5)),
        ("\"64 MiB\"", Budget::Bytes(64 << 20)),
        ("\"1GiB\"", Budget::Bytes(1 << 30)),
        ("4096", Budget::Bytes(4096)),
    ] {
        let path = write(
            &dir,
            "budget.toml",
            &format!("{BASE}[memory]\nhost = {text}\n"),
        );
        assert_eq!(load_only(&path)?.memory.host, budget, "{text}");
    }
    assert_eq!(Budget::Percent(80.0).resolve(1000), 800);
    Ok(())
}

#[test]
fn syntax_errors_name_the_file_and_line() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = write(&dir, "broken.toml", "[node]\nname = \"a\"\nlisten = [\n");
    let err = load_only(&path).expect_err("broken");
    assert!(matches!(err, ConfigError::Parse { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
    assert!(err.to_string().contains("line"), "{err}");
    let yaml = write(&dir, "broken.yaml", "node: [\n");
    let err = load_only(&yaml).expect_err("broken");
    assert!(matches!(err, ConfigError::Parse { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&yaml.display().to_string()),
        "{err}"
    );
    let json = write(&dir, "x.json", "{}");
    assert!(matches!(load_only(&json), Err(ConfigError::Parse { .. })));
    Ok(())
}

#[test]
fn yaml_errors_name_the_key_and_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = write(
        &dir,
        "bad.yml",
        "node:\n  name: a\nsecurity:\n  danger_insecure: true\nlimits:\n  mailboxx: 3\n",
    );
    let err = load_only(&path).expect_err("unknown key");
    assert_eq!(err.key(), Some("limits.mailboxx"));
    assert_eq!(err.origin(), Some(&Origin::File(path.clone())));
    let path = write(
        &dir,
        "bad2.yml",
        "security:\n  danger_insecure: true\nlimits:\n  default_deadline: soon\n",
    );
    let err = load_only(&path).expect_err("bad duration");
    assert_eq!(err.key(), Some("limits.default_deadline"));
    assert!(
        err.to_string().contains("invalid duration \"soon\""),
        "{err}"
    );
    let path = write(
        &dir,
        "bad3.yaml",
        "transport:\n  rules:\n    - name: r\n      transports: [tcp, carrier-pigeon]\n",
    );
    let err = load_only(&path).expect_err("bad transport");
    assert_eq!(err.key(), Some("transport.rules[0].transports[1]"));
    assert!(
        err.to_string().contains("unknown variant `carrier-pigeon`"),
        "{err}"
    );
    Ok(())
}

#[test]
fn missing_files() -> TestResult {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("nope.toml");
    let err = load_only(&missing).expect_err("--config must exist");
    assert!(matches!(err, ConfigError::Io { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );
    // Optional layers that do not exist are skipped.
    let opts = LoadOptions {
        system_file: Some(missing.clone()),
        user_file: Some(dir.path().join("also-nope.toml")),
        file: Some(write(&dir, "ok.toml", BASE)),
        env: false,
        env_vars: None,
        overrides: Vec::new(),
    };
    assert!(load(&opts)?.security.danger_insecure);
    Ok(())
}

/// Options with every layer in a temporary directory, each setting `limits.mailbox`.
fn layered(dir: &TempDir) -> LoadOptions {
    LoadOptions {
        system_file: Some(write(
            dir,
            "system.toml",
            &format!(
                "{BASE}[limits]\nmailbox = 1\npeer_queue = 7\n[node]\nlisten = [\"127.0.0.1:1\", \"127.0.0.1:2\"]\n"
            ),
        )),
        user_file: Some(write(dir, "user.toml", "[limits]\nmailbox = 2\n")),
        file: Some(write(
            dir,
            "file.yaml",
            "limits:\n  mailbox: 3\nnode:\n  listen: [\"127.0.0.1:3\"]\n",
        )),
        env: true,
        env_vars: Some(vec![
            ("FERRY__LIMITS__MAILBOX".into(), "4".into()),
            ("PATH".into(), "/bin".into()),
            ("FERRY_GPU_TESTS".into(), "1".into()),
        ]),
        overrides: vec![("limits.mailbox".into(), "5".into())],
    }
}

#[test]
fn layers_apply_in_order() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut opts = layered(&dir);
    let config = load(&opts)?;
    assert_eq!(config.limits.mailbox, 5);
    // Tables merge key by key: the system file's peer_queue survives.
    assert_eq!(config.limits.peer_queue, 7);
    // Arrays are replaced whole.
    assert_eq!(config.node.listen, ["127.0.0.1:3"]);
    opts.overrides.clear();
    assert_eq!(load(&opts)?.limits.mailbox, 4);
    opts.env = false;
    assert_eq!(load(&opts)?.limits.mailbox, 3);
    opts.file = None;
    assert_eq!(load(&opts)?.limits.mailbox, 2);
    opts.user_file = None;
    assert_eq!(load(&opts)?.limits.mailbox, 1);
    // The last override wins.
    opts.overrides = vec![
        ("limits.mailbox".into(), "8".into()),
        ("limits.mailbox".into(), "9".into()),
    ];
    assert_eq!(load(&opts)?.limits.mailbox, 9);
    Ok(())
}

#[test]
fn environment_values_take_the_fields_type() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut opts = LoadOptions::only_file(write(&dir, "base.toml", BASE));
    opts.env = true;
    opts.env_vars = Some(vec![
        ("FERRY__NODE__NAME".into(), "from-env".into()),
        (
            "FERRY__NODE__LISTEN".into(),
            "[\"127.0.0.1:1\", \"[::1]:2\"]".into(),
        ),
        ("FERRY__NODE__SOCKET_DIR".into(), "/run/x".into()),
        // Digits only, with a leading zero: it stays a string, kept as written.
        ("FERRY__NODE__HOST_ID".into(), "0123".into()),
        ("FERRY__TRANSPORT__TCP__CHUNK_SIZE".into(), "512KiB".into()),
        ("FERRY__LIMITS__CONNECT_TIMEOUT".into(), "250ms".into()),
        ("FERRY__MEMORY__HOST".into(), "10%".into()),
        ("FERRY__TELEMETRY__LOG_FORMAT".into(), "json".into()),
        (
            "FERRY__TELEMETRY__METRICS_LISTEN".into(),
            "[::1]:9464".into(),
        ),
    ]);
    let config = load(&opts)?;
    assert_eq!(config.node.name, "from-env");
    assert_eq!(config.node.listen, ["127.0.0.1:1", "[::1]:2"]);
    assert_eq!(config.node.socket_dir, Some("/run/x".into()));
    assert_eq!(config.node.host_id.as_deref(), Some("0123"));
    assert_eq!(config.transport.tcp.chunk_size, 512 << 10);
    assert_eq!(config.limits.connect_timeout, Duration::from_millis(250));
    assert_eq!(config.memory.host, Budget::Percent(10.0));
    assert_eq!(
        config.telemetry.metrics_listen.as_deref(),
        Some("[::1]:9464")
    );
    Ok(())
}

/// DNS discovery from a file, and the way a Kubernetes pod sets it: the pod's name and
/// the Service from the environment.
#[test]
fn dns_discovery_loads_from_files_and_environment() -> TestResult {
    use ferry_config::{DiscoveryMode, DnsName};
    let config = load_only(&examples_dir().join("dns-discovery.yaml"))?;
    assert_eq!(config.discovery.mode, DiscoveryMode::Dns);
    assert_eq!(
        config.discovery.dns,
        [DnsName {
            name: "ferry.ferry.svc.cluster.local.".into(),
            port: 7070
        }]
    );
    assert_eq!(config.discovery.interval, Duration::from_secs(10));

    let dir = tempfile::tempdir()?;
    let mut opts = LoadOptions::only_file(write(&dir, "base.toml", BASE));
    opts.env = true;
    opts.env_vars = Some(vec![
        ("FERRY__NODE__NAME".into(), "ferry-7f9c4".into()),
        ("FERRY__DISCOVERY__MODE".into(), "dns".into()),
        (
            "FERRY__DISCOVERY__DNS".into(),
            "[{ name = \"ferry.ns.svc.cluster.local\", port = 7070 }]".into(),
        ),
        ("FERRY__DISCOVERY__INTERVAL".into(), "2s".into()),
    ]);
    let config = load(&opts)?;
    assert_eq!(config.node.name, "ferry-7f9c4");
    assert_eq!(config.discovery.dns[0].name, "ferry.ns.svc.cluster.local");
    assert_eq!(config.discovery.dns[0].port, 7070);
    assert_eq!(config.discovery.interval, Duration::from_secs(2));

    let mode = "[discovery]\nmode = \"dns\"\n";
    expect_bad(
        &format!("{mode}dns = [{{ name = \"a.example\", port = 70000 }}]\n"),
        "discovery.dns[0].port",
    );
    expect_bad(
        &format!("{mode}dns = [{{ name = \"a.example\", port = 0 }}]\n"),
        "discovery.dns[0].port",
    );
    expect_bad(
        &format!("{mode}dns = [{{ name = \"a.example\" }}]\n"),
        "discovery.dns[0]",
    );
    expect_bad(
        &format!("{mode}dns = [{{ name = \"a.example\", port = 1, weight = 2 }}]\n"),
        "discovery.dns[0].weight",
    );
    expect_bad(
        &format!("{mode}dns = [{{ name = \"\", port = 1 }}]\n"),
        "discovery.dns[0].name",
    );
    expect_bad(
        &format!("{mode}dns = [{{ name = \"a.example\", port = 1 }}]\ninterval = \"100ms\"\n"),
        "discovery.interval",
    );
    expect_bad(mode, "discovery.mode");
    Ok(())
}

#[test]
fn environment_errors_name_the_variable() -> TestResult {
    let dir = tempfile::tempdir()?;
    let base = write(&dir, "base.toml", BASE);
    for (name, value, key) in [
        ("FERRY__LIMITS__MAILBOX", "many", "limits.mailbox"),
        ("FERRY__LIMITS__MAILBOXX", "3", "limits.mailboxx"),
        (
            "FERRY__LIMITS__DEFAULT_DEADLINE",
            "soon",
            "limits.default_deadline",
        ),
        ("FERRY__LIMITS__MAX_FRAME", "12 parsecs", "limits.max_frame"),
        ("FERRY__LIMITS__MAILBOX", "0", "limits.mailbox"),
        ("FERRY__NODE__LISTEN", "[\"0.0.0.0:1\"]", "node.listen[0]"),
        ("FERRY__LIMITS____MAILBOX", "1", "FERRY__LIMITS____MAILBOX"),
    ] {
        let mut opts = LoadOptions::only_file(&base);
        opts.env = true;
        opts.env_vars = Some(vec![(name.into(), value.into())]);
        let err = load(&opts).expect_err(name);
        let message = err.to_string();
        assert!(
            message.contains(&format!("environment variable {name}")),
            "{message}"
        );
        assert_eq!(err.key(), Some(key), "{message}");
    }
    Ok(())
}

#[test]
fn validation_errors_blame_the_layer_that_set_the_key() -> TestResult {
    let dir = tempfile::tempdir()?;
    let system = write(&dir, "system.toml", "[limits]\nmax_frame = \"1 MiB\"\n");
    let opts = LoadOptions {
        system_file: Some(system.clone()),
        user_file: None,
        file: Some(write(&dir, "file.toml", BASE)),
        env: false,
        env_vars: None,
        overrides: Vec::new(),
    };
    let err = load(&opts).expect_err("chunk does not fit");
    assert_eq!(err.origin(), Some(&Origin::File(system)));
    assert_eq!(err.key(), Some("limits.max_frame"));

    let mut opts = LoadOptions::only_file(write(&dir, "base.toml", BASE));
    opts.overrides = vec![("node.listen".into(), "[\"0.0.0.0:7070\"]".into())];
    let err = load(&opts).expect_err("listen any");
    assert_eq!(err.origin(), Some(&Origin::CommandLine));
    assert!(
        err.to_string()
            .starts_with("command line: key node.listen[0]: "),
        "{err}"
    );
    Ok(())
}

#[test]
fn command_line_errors_say_so() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut opts = LoadOptions::only_file(write(&dir, "base.toml", BASE));
    opts.overrides = vec![("limits.default_deadline".into(), "soon".into())];
    let err = load(&opts).expect_err("bad duration");
    assert!(
        err.to_string()
            .starts_with("command line: key limits.default_deadline: invalid duration \"soon\""),
        "{err}"
    );
    opts.overrides = vec![("transport.rules[0].direction".into(), "pull".into())];
    assert_eq!(
        load(&opts).expect_err("index").origin(),
        Some(&Origin::CommandLine)
    );
    opts.overrides = vec![("limits.max_frame".into(), "8 MiB".into())];
    assert_eq!(load(&opts)?.limits.max_frame, 8 << 20);
    Ok(())
}

#[test]
fn inline_toml() -> TestResult {
    let config = Config::from_toml_str(&format!("{BASE}[node]\nname = \"a\"\n"))?;
    assert_eq!(config.node.name, "a");
    let err = Config::from_toml_str(&format!("{BASE}[limits]\nmailbox = 0\n")).expect_err("0");
    assert!(
        err.to_string()
            .starts_with("inline configuration, line 3: key limits.mailbox: "),
        "{err}"
    );
    Ok(())
}

#[test]
fn shown_configuration_reads_back() -> TestResult {
    let mut config = Config::from_toml_str(BASE)?;
    config.transport.rules[0].max_bytes = Some(3 << 30);
    config.transport.rules[0].min_bytes = 1_000_001;
    config.limits.default_deadline = Duration::from_millis(1500);
    config.memory.host = Budget::Percent(33.3);
    let text = config.to_toml()?;
    assert!(text.contains("max_bytes = \"3 GiB\""), "{text}");
    assert!(text.contains("default_deadline = \"1s 500ms\""), "{text}");
    assert_eq!(Config::from_toml_str(&text)?, config);
    Ok(())
}

/// Writes a secret file of `text` with `mode`, whatever the umask.
fn write_secret(dir: &TempDir, name: &str, text: &str, mode: u32) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = write(dir, name, text);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    path
}

/// A valid file but for the secret: a layer above names it.
const NO_SECRET_YET: &str = "[node]\nname = \"n\"\n";

/// Loads `opts` (which must be valid) and reads its secret file, which must be refused.
fn refused_secret(opts: &LoadOptions) -> ConfigError {
    let config = load(opts).expect("the configuration loads");
    config
        .read_secret()
        .expect_err("the secret file is refused")
}

#[test]
fn a_secret_file_error_names_the_file_and_line_that_set_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let short = write_secret(&dir, "short", "5byte", 0o600);
    let path = write(
        &dir,
        "n.toml",
        &format!(
            "{NO_SECRET_YET}\n[security]\nsecret_file = \"{}\"\n",
            short.display()
        ),
    );
    let err = refused_secret(&LoadOptions::only_file(&path));
    assert_eq!(err.origin(), Some(&Origin::File(path.clone())), "{err}");
    assert!(
        err.to_string().starts_with(&format!(
            "config file {}, line 5: key security.secret_file: secret file {}: the secret is 5 bytes",
            path.display(),
            short.display()
        )),
        "{err}"
    );
    // A missing file and a YAML file (no line there) alike.
    let missing = dir.path().join("missing");
    let yaml = write(
        &dir,
        "n.yaml",
        &format!("security:\n  secret_file: {}\n", missing.display()),
    );
    let err = refused_secret(&LoadOptions::only_file(&yaml));
    assert!(
        err.to_string().starts_with(&format!(
            "config file {}: key security.secret_file: secret file {}: cannot read",
            yaml.display(),
            missing.display()
        )),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_secret_file_error_names_the_environment_variable_that_set_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let good = write_secret(&dir, "good", "sixteen bytes or more", 0o600);
    let short = write_secret(&dir, "short", "5byte", 0o600);
    // The file names a good secret; the variable, above it, a short one.
    let path = write(
        &dir,
        "n.toml",
        &format!("[security]\nsecret_file = \"{}\"\n", good.display()),
    );
    let mut opts = LoadOptions::only_file(&path);
    opts.env = true;
    let name = "FERRY__SECURITY__SECRET_FILE";
    opts.env_vars = Some(vec![(name.into(), short.display().to_string())]);
    let err = refused_secret(&opts);
    assert_eq!(err.origin(), Some(&Origin::Env(name.into())), "{err}");
    assert!(
        err.to_string().starts_with(&format!(
            "environment variable {name}: key security.secret_file: secret file {}: ",
            short.display()
        )),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_secret_file_error_names_the_command_line_that_set_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = write(&dir, "n.toml", NO_SECRET_YET);
    let missing = dir.path().join("missing");
    let mut opts = LoadOptions::only_file(&path);
    opts.overrides = vec![("security.secret_file".into(), missing.display().to_string())];
    let err = refused_secret(&opts);
    assert_eq!(err.origin(), Some(&Origin::CommandLine), "{err}");
    assert!(
        err.to_string().starts_with(&format!(
            "command line: key security.secret_file: secret file {}: cannot read",
            missing.display()
        )),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_secret_file_mode_error_names_where_the_opt_out_was_left_off() -> TestResult {
    let dir = tempfile::tempdir()?;
    let open = write_secret(&dir, "open", "sixteen bytes or more", 0o644);
    let text = format!("[security]\nsecret_file = \"{}\"\n", open.display());
    let path = write(&dir, "n.toml", &text);
    // No layer sets the opt-out: the built-in default (false) is named.
    let err = refused_secret(&LoadOptions::only_file(&path));
    let opt_out = "security.danger_secret_file_any_mode";
    let message = err.to_string();
    assert!(
        message.starts_with(&format!(
            "config file {}, line 2: key security.secret_file: secret file {}: mode 0644",
            path.display(),
            open.display()
        )),
        "{message}"
    );
    assert!(
        message.ends_with(&format!("; {opt_out} from built-in defaults")),
        "{message}"
    );
    // Set to false in the file, it is named with its line; in a variable, by its name.
    let path = write(
        &dir,
        "n.toml",
        &format!("{text}danger_secret_file_any_mode = false\n"),
    );
    let err = refused_secret(&LoadOptions::only_file(&path));
    assert!(
        err.to_string().ends_with(&format!(
            "; {opt_out} from config file {}, line 3",
            path.display()
        )),
        "{err}"
    );
    let mut opts = LoadOptions::only_file(&path);
    opts.env = true;
    let name = "FERRY__SECURITY__DANGER_SECRET_FILE_ANY_MODE";
    opts.env_vars = Some(vec![(name.into(), "false".into())]);
    let err = refused_secret(&opts);
    assert!(
        err.to_string()
            .ends_with(&format!("; {opt_out} from environment variable {name}")),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_check_of_two_keys_names_where_each_came_from() -> TestResult {
    let dir = tempfile::tempdir()?;
    // limits.max_frame from the file, transport.tcp.chunk_size from the defaults.
    let path = write(
        &dir,
        "n.toml",
        &format!("{BASE}[limits]\nmax_frame = \"1 MiB\"\n"),
    );
    let err = load_only(&path).expect_err("the chunk does not fit");
    assert_eq!(err.key(), Some("limits.max_frame"), "{err}");
    assert_eq!(err.line(), Some(3), "{err}");
    assert_eq!(
        err.others(),
        [KeyOrigin {
            key: "transport.tcp.chunk_size".into(),
            origin: Origin::Defaults,
            line: None
        }],
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.starts_with(&format!(
            "config file {}, line 3: key limits.max_frame: ",
            path.display()
        )),
        "{message}"
    );
    assert!(
        message.ends_with("; transport.tcp.chunk_size from built-in defaults"),
        "{message}"
    );
    // The chunk size from a variable, above the file: the variable is the error's origin,
    // and the file's line is named for the other key.
    let path = write(
        &dir,
        "n.toml",
        &format!("{BASE}[limits]\nmax_frame = \"4 MiB\"\n"),
    );
    let mut opts = LoadOptions::only_file(&path);
    opts.env = true;
    let name = "FERRY__TRANSPORT__TCP__CHUNK_SIZE";
    opts.env_vars = Some(vec![(name.into(), "8 MiB".into())]);
    let err = load(&opts).expect_err("the chunk does not fit");
    assert_eq!(err.origin(), Some(&Origin::Env(name.into())), "{err}");
    assert_eq!(err.key(), Some("transport.tcp.chunk_size"), "{err}");
    assert!(
        err.to_string().ends_with(&format!(
            "; limits.max_frame from config file {}, line 3",
            path.display()
        )),
        "{err}"
    );
    // The same from the command line.
    let mut opts = LoadOptions::only_file(&path);
    opts.overrides = vec![("transport.tcp.chunk_size".into(), "8 MiB".into())];
    let err = load(&opts).expect_err("the chunk does not fit");
    assert!(
        err.to_string()
            .starts_with("command line: key transport.tcp.chunk_size: "),
        "{err}"
    );
    assert_eq!(err.others().len(), 1, "{err}");
    Ok(())
}

#[test]
fn a_check_made_after_loading_names_the_layer() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = write(&dir, "n.toml", &format!("{BASE}[gpu]\ndevices = [0, 7]\n"));
    let config = load_only(&path)?;
    let err = config.invalid(
        &["gpu.devices"],
        "names GPU 7, but this process sees 1 GPU(s)",
    );
    assert_eq!(
        err.to_string(),
        format!(
            "config file {}, line 3: key gpu.devices: names GPU 7, but this process sees 1 GPU(s)",
            path.display()
        )
    );
    assert_eq!(config.origin_of("gpu.devices[1]").line, Some(3));
    assert_eq!(config.origin_of("limits.mailbox").origin, Origin::Defaults);
    // Built in code, nothing is known.
    assert_eq!(
        Config::default().origin_of("gpu.devices").origin,
        Origin::Program
    );
    // Where the values came from is not part of what the configuration says.
    let mut same = Config::default();
    same.security.danger_insecure = true;
    same.gpu.devices = Some(vec![0, 7]);
    same.node.name = config.node.name.clone();
    assert_eq!(same, config);
    Ok(())
}

#[test]
fn recv_spin_is_a_node_key() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = write(
        &dir,
        "n.toml",
        &format!("{BASE}[node]\nrecv_spin = \"50us\"\n"),
    );
    let config = load_only(&path)?;
    assert_eq!(config.node.recv_spin, Duration::from_micros(50));
    assert!(config.deprecated_keys().is_empty());
    assert_eq!(Config::default().node.recv_spin, Duration::ZERO);
    // `ferry config show` writes it where it is read.
    let text = config.to_toml()?;
    assert_eq!(text.matches("recv_spin").count(), 1, "{text}");
    assert_eq!(Config::from_toml_str(&text)?, config);
    let err = expect_bad("[node]\nrecv_spin = \"2ms\"\n", "node.recv_spin");
    assert_eq!(err.line(), Some(3), "{err}");
    assert!(err.to_string().ends_with("must be at most 1ms"), "{err}");
    Ok(())
}

/// `transport.ipc.recv_spin`, its name until 2026-12-01, is read for one release: its value
/// goes to `node.recv_spin`, and the configuration notes where the old name was set.
#[test]
fn the_old_name_of_recv_spin_is_read_and_noted() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = write(
        &dir,
        "old.toml",
        &format!("{BASE}[transport.ipc]\nlane_max = 0\nrecv_spin = \"50us\"\n"),
    );
    let config = load_only(&path)?;
    assert_eq!(config.node.recv_spin, Duration::from_micros(50));
    assert_eq!(config.transport.ipc.lane_max, 0);
    let [deprecated] = config.deprecated_keys() else {
        panic!("one deprecated key: {:?}", config.deprecated_keys());
    };
    assert_eq!(
        deprecated.old,
        KeyOrigin {
            key: "transport.ipc.recv_spin".into(),
            origin: Origin::File(path.clone()),
            line: Some(4),
        }
    );
    assert_eq!(deprecated.new, "node.recv_spin");
    assert_eq!(
        deprecated.to_string(),
        format!(
            "config file {}, line 4: key transport.ipc.recv_spin is deprecated: write \
             node.recv_spin (the old name is read for one release only)",
            path.display()
        )
    );
    // The value is where the new name is: written there, read back without a note.
    let text = config.to_toml()?;
    assert_eq!(text.matches("recv_spin").count(), 1, "{text}");
    let shown = Config::from_toml_str(&text)?;
    assert_eq!(shown, config);
    assert!(shown.deprecated_keys().is_empty());
    // Where the value came from is where the old name was set.
    assert_eq!(config.origin_of("node.recv_spin"), deprecated.old);

    // A bad value under the old name is reported under the name the file wrote.
    let err = expect_bad(
        "[transport.ipc]\nrecv_spin = \"2ms\"\n",
        "transport.ipc.recv_spin",
    );
    assert_eq!(err.line(), Some(3), "{err}");
    assert!(err.to_string().ends_with("must be at most 1ms"), "{err}");

    // From the environment and inline too.
    let mut opts = LoadOptions::only_file(write(&dir, "base.toml", BASE));
    opts.env = true;
    let name = "FERRY__TRANSPORT__IPC__RECV_SPIN";
    opts.env_vars = Some(vec![(name.into(), "20us".into())]);
    let config = load(&opts)?;
    assert_eq!(config.node.recv_spin, Duration::from_micros(20));
    assert_eq!(
        config.deprecated_keys()[0].old.origin,
        Origin::Env(name.into())
    );
    let inline = Config::from_toml_str(&format!("{BASE}transport.ipc.recv_spin = \"1ms\"\n"))?;
    assert_eq!(inline.node.recv_spin, Duration::from_millis(1));
    assert_eq!(inline.deprecated_keys()[0].old.line, Some(2));
    Ok(())
}

#[test]
fn recv_spin_under_both_names_is_an_error_naming_both() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = write(
        &dir,
        "both.toml",
        &format!("{BASE}[node]\nrecv_spin = \"5us\"\n[transport.ipc]\nrecv_spin = \"50us\"\n"),
    );
    let err = load_only(&path).expect_err("both names");
    assert_eq!(err.key(), Some("transport.ipc.recv_spin"), "{err}");
    assert_eq!(err.line(), Some(5), "{err}");
    assert_eq!(
        err.others(),
        [KeyOrigin {
            key: "node.recv_spin".into(),
            origin: Origin::File(path.clone()),
            line: Some(3),
        }]
    );
    let message = err.to_string();
    assert!(
        message.starts_with(&format!(
            "config file {}, line 5: key transport.ipc.recv_spin: the old name of \
             node.recv_spin, which is set too; set only node.recv_spin",
            path.display()
        )),
        "{message}"
    );
    assert!(
        message.ends_with(&format!(
            "; node.recv_spin from config file {}, line 3",
            path.display()
        )),
        "{message}"
    );

    // In two layers as well: which one was meant is a guess.
    let old = write(
        &dir,
        "old.toml",
        &format!("{BASE}[transport.ipc]\nrecv_spin = \"50us\"\n"),
    );
    let mut opts = LoadOptions::only_file(&old);
    opts.overrides = vec![("node.recv_spin".into(), "5us".into())];
    let err = load(&opts).expect_err("both names");
    assert_eq!(err.origin(), Some(&Origin::File(old)), "{err}");
    assert_eq!(err.key(), Some("transport.ipc.recv_spin"), "{err}");
    assert!(
        err.to_string()
            .ends_with("; node.recv_spin from command line"),
        "{err}"
    );
    Ok(())
}
