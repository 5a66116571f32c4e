//! Checks that go beyond types: names, addresses, ranges, and keys that depend on each other.

use std::collections::HashSet;
use std::time::Duration;

use crate::address::{ListenAddress, check_peer_host_port, parse_listen};
use crate::error::ConfigError;
use crate::names::is_valid_name;
use crate::provenance::Provenance;
use crate::rule::MemoryClass;
use crate::schema::{Config, DiscoveryMode};
use crate::units::{Budget, format_size};

/// Room a frame needs beyond its chunk of payload (header, control fields).
const FRAME_OVERHEAD: u64 = 64 << 10;
/// Largest accepted `limits.max_frame`.
const MAX_FRAME_CAP: u64 = 1 << 30;

/// The message when neither `security.secret_file` nor `security.danger_insecure` is set.
const NO_SECRET: &str = "security.secret_file is not set; set it, or set security.danger_insecure = true for a test setup";

/// A failed check, before its origin is known.
pub(crate) struct Violation {
    /// The keys involved; the first is the one the check is about.
    pub(crate) keys: Vec<String>,
    pub(crate) detail: String,
}

pub(crate) fn fail(key: impl Into<String>, detail: impl Into<String>) -> Result<(), Violation> {
    Err(Violation {
        keys: vec![key.into()],
        detail: detail.into(),
    })
}

impl Config {
    /// Checks everything the types cannot: names, addresses, ranges, rules, security, and
    /// keys that depend on each other. The loaders call it; call it yourself on a `Config`
    /// built in code. Pure: reads no file (see [`Config::read_secret`]).
    ///
    /// # Errors
    ///
    /// The first problem found, as [`ConfigError::Invalid`] naming the key, with origin
    /// [`Origin::Program`](crate::Origin::Program): the loaders name the file or variable
    /// instead, while a configuration checked here may have been changed in code since.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_with(&Provenance::default())
    }

    /// [`Config::validate`], naming the layers of `provenance`.
    pub(crate) fn validate_with(&self, provenance: &Provenance) -> Result<(), ConfigError> {
        match self.check() {
            Ok(()) => Ok(()),
            Err(violation) => Err(provenance.error(&violation.keys, violation.detail)),
        }
    }

    fn check(&self) -> Result<(), Violation> {
        self.check_node()?;
        self.check_peers()?;
        self.check_discovery()?;
        self.check_memory()?;
        self.transport.check()?;
        self.check_limits()?;
        self.check_security()?;
        self.check_telemetry()
    }

    fn check_node(&self) -> Result<(), Violation> {
        let node = &self.node;
        if !is_valid_name(&node.name) {
            return fail("node.name", name_problem(&node.name));
        }
        for (i, entry) in node.listen.iter().enumerate() {
            let key = format!("node.listen[{i}]");
            match parse_listen(entry) {
                Err(msg) => return fail(key, format!("invalid listen address {entry:?}: {msg}")),
                Ok(ListenAddress::Ip(addr))
                    if addr.ip().is_unspecified() && !node.danger_listen_any =>
                {
                    return Err(Violation {
                        keys: vec![key, "node.danger_listen_any".into()],
                        detail: format!(
                            "{entry:?} listens on every interface; name a specific address, or set node.danger_listen_any = true"
                        ),
                    });
                }
                Ok(_) => {}
            }
        }
        if node
            .socket_dir
            .as_ref()
            .is_some_and(|dir| dir.as_os_str().is_empty())
        {
            return fail(
                "node.socket_dir",
                "must not be empty; leave it out for no Unix listener",
            );
        }
        if let Some(id) = &node.host_id {
            if let Some(problem) = host_id_problem(id) {
                return fail("node.host_id", problem);
            }
        }
        if !(1..=64).contains(&node.peer_threads) {
            return fail("node.peer_threads", "must be 1 to 64");
        }
        if node.recv_spin > Duration::from_millis(1) {
            return fail("node.recv_spin", "must be at most 1ms");
        }
        Ok(())
    }

    fn check_peers(&self) -> Result<(), Violation> {
        let mut seen = HashSet::new();
        for (i, peer) in self.peers.iter().enumerate() {
            let key = format!("peers[{i}].name");
            if !is_valid_name(&peer.name) {
                return fail(key, name_problem(&peer.name));
            }
            if peer.name == self.node.name {
                return Err(Violation {
                    keys: vec![key, "node.name".into()],
                    detail: format!("peer {:?} has the same name as this node", peer.name),
                });
            }
            if !seen.insert(peer.name.as_str()) {
                return fail(key, format!("peer {:?} is listed twice", peer.name));
            }
            let problem = match &peer.address {
                crate::PeerAddress::Tcp(host_port) => check_peer_host_port(host_port).err(),
                crate::PeerAddress::Unix(path) if path.as_os_str().is_empty() => {
                    Some("the unix socket path is empty".into())
                }
                crate::PeerAddress::Unix(_) => None,
            };
            if let Some(msg) = problem {
                return fail(
                    format!("peers[{i}].address"),
                    format!("invalid peer address {}: {msg}", peer.address),
                );
            }
        }
        Ok(())
    }

    fn check_discovery(&self) -> Result<(), Violation> {
        let discovery = &self.discovery;
        match (discovery.mode, discovery.dns.is_empty()) {
            (DiscoveryMode::Dns, true) => {
                return Err(Violation {
                    keys: vec!["discovery.dns".into(), "discovery.mode".into()],
                    detail: "discovery.mode is \"dns\" but discovery.dns names no DNS name; add one, as in dns = [{ name = \"ferry.NAMESPACE.svc.cluster.local\", port = 7070 }]".into(),
                });
            }
            (DiscoveryMode::Static, false) => {
                return Err(Violation {
                    keys: vec!["discovery.mode".into(), "discovery.dns".into()],
                    detail: "discovery.dns names DNS names but discovery.mode is \"static\", which looks none up; set discovery.mode = \"dns\"".into(),
                });
            }
            _ => {}
        }
        if discovery.dns.len() > MAX_DNS_NAMES {
            return fail(
                "discovery.dns",
                format!("{} names; at most {MAX_DNS_NAMES}", discovery.dns.len()),
            );
        }
        let mut seen = HashSet::new();
        for (i, entry) in discovery.dns.iter().enumerate() {
            if let Some(problem) = dns_name_problem(&entry.name) {
                return fail(format!("discovery.dns[{i}].name"), problem);
            }
            if entry.port == 0 {
                return fail(
                    format!("discovery.dns[{i}].port"),
                    "port 0 cannot be dialled; give the port the peers listen on",
                );
            }
            if !seen.insert((entry.name.trim_end_matches('.'), entry.port)) {
                return fail(
                    format!("discovery.dns[{i}]"),
                    format!("{}:{} is listed twice", entry.name, entry.port),
                );
            }
        }
        if discovery.interval < MIN_DISCOVERY_INTERVAL {
            return fail(
                "discovery.interval",
                format!(
                    "{} is too short: at least 1s (each round looks every name up again)",
                    humantime::format_duration(discovery.interval)
                ),
            );
        }
        if !(1..=MAX_DISCOVERED).contains(&discovery.max_peers) {
            return fail(
                "discovery.max_peers",
                format!("must be 1 to {MAX_DISCOVERED}"),
            );
        }
        Ok(())
    }

    fn check_memory(&self) -> Result<(), Violation> {
        let memory = &self.memory;
        for (key, budget) in [
            ("memory.host", memory.host),
            ("memory.pinned", memory.pinned),
            ("memory.device", memory.device),
        ] {
            match budget {
                Budget::Bytes(0) => {
                    return fail(key, "a budget of 0 bytes leaves nothing to transfer with");
                }
                Budget::Percent(p) if !(p > 0.0 && p <= 100.0) => {
                    return fail(key, "a percentage must be above 0 and at most 100");
                }
                _ => {}
            }
        }
        for (i, tier) in memory.spill.iter().enumerate() {
            let key = format!("memory.spill[{i}]");
            if *tier == MemoryClass::Device {
                return fail(
                    key,
                    "only host tiers (\"pinned\", \"host\") can take a spill: a full GPU \
                     spills to host memory",
                );
            }
            if *tier == memory.receive_into || memory.spill[..i].contains(tier) {
                return fail(
                    key,
                    format!("{tier} appears twice among memory.receive_into and memory.spill"),
                );
            }
        }
        if memory.export_lease_timeout.is_zero() {
            return fail("memory.export_lease_timeout", "must be longer than zero");
        }
        Ok(())
    }

    fn check_limits(&self) -> Result<(), Violation> {
        let limits = &self.limits;
        if limits.max_frame > MAX_FRAME_CAP {
            return fail(
                "limits.max_frame",
                format!(
                    "{} is above the maximum of 1 GiB",
                    format_size(limits.max_frame)
                ),
            );
        }
        for (key, chunk) in [
            ("transport.tcp.chunk_size", self.transport.tcp.chunk_size),
            ("transport.tcp.eager_max", self.transport.tcp.eager_max),
            (
                "transport.staged.link_chunk",
                self.transport.staged.link_chunk,
            ),
        ] {
            if chunk.saturating_add(FRAME_OVERHEAD) > limits.max_frame {
                return Err(Violation {
                    keys: vec![key.into(), "limits.max_frame".into()],
                    detail: format!(
                        "{key} ({}) plus 64 KiB of framing must fit in limits.max_frame ({}); lower the chunk size or raise limits.max_frame",
                        format_size(chunk),
                        format_size(limits.max_frame)
                    ),
                });
            }
        }
        for (key, value) in [
            ("limits.default_deadline", limits.default_deadline),
            ("limits.handshake_timeout", limits.handshake_timeout),
            ("limits.connect_timeout", limits.connect_timeout),
            ("limits.stall_timeout", limits.stall_timeout),
            ("limits.first_byte_timeout", limits.first_byte_timeout),
        ] {
            if value == Duration::ZERO {
                return fail(key, "must be longer than 0s");
            }
        }
        for (key, value) in [
            ("limits.mailbox", limits.mailbox),
            ("limits.peer_queue", limits.peer_queue),
            ("limits.reservation_queue", limits.reservation_queue),
            ("limits.handshakes", limits.handshakes),
            ("limits.handshakes_per_source", limits.handshakes_per_source),
            ("limits.peer_grants", limits.peer_grants),
        ] {
            if value < 1 {
                return fail(key, "must be at least 1");
            }
        }
        if limits.pipeline_depth < 1 || limits.pipeline_depth > crate::MAX_PIPELINE_DEPTH {
            return fail(
                "limits.pipeline_depth",
                format!("must be 1 to {}", crate::MAX_PIPELINE_DEPTH),
            );
        }
        if limits.peer_inbound_bytes < 1 << 20 {
            return fail(
                "limits.peer_inbound_bytes",
                format!(
                    "{} is below the minimum of 1 MiB",
                    format_size(limits.peer_inbound_bytes)
                ),
            );
        }
        Ok(())
    }

    fn check_security(&self) -> Result<(), Violation> {
        let security = &self.security;
        match (&security.secret_file, security.danger_insecure) {
            (None, false) => fail("security.secret_file", NO_SECRET),
            (Some(_), true) => Err(Violation {
                keys: vec![
                    "security.danger_insecure".into(),
                    "security.secret_file".into(),
                ],
                detail: "set security.secret_file or security.danger_insecure, not both".into(),
            }),
            (Some(path), false) if path.as_os_str().is_empty() => {
                fail("security.secret_file", "must not be empty")
            }
            _ => Ok(()),
        }
    }

    fn check_telemetry(&self) -> Result<(), Violation> {
        let telemetry = &self.telemetry;
        if telemetry.log_level.trim().is_empty() {
            return fail(
                "telemetry.log_level",
                "must not be empty; the default is \"info\"",
            );
        }
        if let Some(addr) = &telemetry.metrics_listen {
            if let Err(msg) = parse_listen(addr) {
                return fail(
                    "telemetry.metrics_listen",
                    format!("invalid listen address {addr:?}: {msg}"),
                );
            }
        }
        Ok(())
    }
}

pub(crate) fn name_problem(name: &str) -> String {
    if name.is_empty() {
        "must not be empty".into()
    } else {
        format!("{name:?} may contain only letters, digits, '.', '_' and '-'")
    }
}

/// Most names in `discovery.dns`.
const MAX_DNS_NAMES: usize = 16;
/// Shortest `discovery.interval`.
const MIN_DISCOVERY_INTERVAL: Duration = Duration::from_secs(1);
/// Largest `discovery.max_peers`.
const MAX_DISCOVERED: usize = 4096;

/// What is wrong with a name of `discovery.dns`, if anything: an IP address, or a host name
/// of at most 253 characters whose dot-separated labels are 1 to 63 of `[A-Za-z0-9_-]`
/// (one trailing dot, which stops the resolver's search list, is allowed).
fn dns_name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("must not be empty; give the DNS name to look up".into());
    }
    if name.parse::<std::net::IpAddr>().is_ok() {
        return None;
    }
    let bare = name.strip_suffix('.').unwrap_or(name);
    if bare.len() > 253 {
        return Some(format!("is {} characters long; at most 253", bare.len()));
    }
    let label_ok = |label: &str| {
        (1..=63).contains(&label.len())
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
    };
    if bare.split('.').all(label_ok) {
        None
    } else {
        Some(format!(
            "{name:?} is not a DNS name: labels of 1 to 63 letters, digits, '-' or '_', joined by dots"
        ))
    }
}

/// Longest `node.host_id`, in bytes.
const MAX_HOST_ID: usize = 255;

/// What is wrong with a `node.host_id`, if anything: it travels in every hello and is
/// compared byte for byte, so it is kept to printable ASCII without spaces.
fn host_id_problem(id: &str) -> Option<String> {
    if id.is_empty() {
        Some("must not be empty; leave it out to use this machine's identity".into())
    } else if id.len() > MAX_HOST_ID {
        Some(format!("is {} bytes long; at most {MAX_HOST_ID}", id.len()))
    } else if !id.bytes().all(|b| b.is_ascii_graphic()) {
        Some(format!(
            "{id:?} may contain only printable ASCII characters, no spaces"
        ))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PeerAddress, PeerConfig, TransportName};

    fn valid() -> Config {
        let mut config = Config::default();
        config.node.name = "a".into();
        config.security.danger_insecure = true;
        config
    }

    fn key_of(config: &Config) -> String {
        match config.validate() {
            Err(ConfigError::Invalid { key, .. }) => key,
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn gather_max_is_bounded() {
        let mut config = valid();
        config.transport.ipc.gather_max = 1 << 30;
        assert!(config.validate().is_ok());
        config.transport.ipc.gather_max = (1 << 30) + 1;
        assert_eq!(key_of(&config), "transport.ipc.gather_max");
    }

    #[test]
    fn peer_threads_are_1_to_64() {
        let mut config = valid();
        for ok in [1, 64] {
            config.node.peer_threads = ok;
            assert!(config.validate().is_ok(), "{ok}");
        }
        for bad in [0, 65] {
            config.node.peer_threads = bad;
            assert_eq!(key_of(&config), "node.peer_threads", "{bad}");
        }
    }

    #[test]
    fn recv_spin_is_bounded() {
        let mut config = valid();
        config.node.recv_spin = std::time::Duration::from_micros(1000);
        assert!(config.validate().is_ok());
        config.node.recv_spin = std::time::Duration::from_micros(1001);
        assert_eq!(key_of(&config), "node.recv_spin");
    }

    #[test]
    fn host_ids_that_pass() {
        for id in [
            "0123456789abcdef0123456789abcdef".to_string(),
            "gpu-node-7.rack_2:a100".to_string(),
            "x".repeat(255),
        ] {
            let mut config = valid();
            config.node.host_id = Some(id.clone());
            assert!(config.validate().is_ok(), "{id:?} refused");
        }
    }

    #[test]
    fn defaults_need_only_a_security_choice() {
        assert!(valid().validate().is_ok());
        let mut config = valid();
        config.security.danger_insecure = false;
        let err = config.validate().expect_err("no secret");
        assert!(err.to_string().contains(NO_SECRET), "{err}");
        config.security.secret_file = Some("/run/secret".into());
        assert!(config.validate().is_ok());
        config.security.danger_insecure = true;
        assert_eq!(key_of(&config), "security.danger_insecure");
    }

    #[test]
    fn each_check_names_its_key() {
        /// A change that breaks a valid config, and the key the error must name.
        type Case = (fn(&mut Config), &'static str);
        let cases: Vec<Case> = vec![
            (|c| c.node.name = "a b".into(), "node.name"),
            (
                |c| c.node.listen = vec!["0.0.0.0:1".into()],
                "node.listen[0]",
            ),
            (
                |c| c.node.listen = vec!["127.0.0.1:1".into(), "[::]:1".into()],
                "node.listen[1]",
            ),
            (
                |c| c.node.listen = vec!["example.com:1".into()],
                "node.listen[0]",
            ),
            (|c| c.node.socket_dir = Some("".into()), "node.socket_dir"),
            (|c| c.node.host_id = Some("".into()), "node.host_id"),
            (|c| c.node.host_id = Some("rack 1".into()), "node.host_id"),
            (|c| c.node.host_id = Some("é".into()), "node.host_id"),
            (|c| c.node.host_id = Some("x".repeat(256)), "node.host_id"),
            (
                |c| c.transport.staged.link_chunk = 1024,
                "transport.staged.link_chunk",
            ),
            (
                |c| c.transport.staged.link_chunk = 4 << 20,
                "transport.staged.link_chunk",
            ),
            (
                |c| c.transport.staged.spin = std::time::Duration::from_secs(1),
                "transport.staged.spin",
            ),
            (|c| c.limits.pipeline_depth = 1025, "limits.pipeline_depth"),
            (|c| c.memory.host = Budget::Bytes(0), "memory.host"),
            (
                |c| c.transport.tcp.chunk_size = 1024,
                "transport.tcp.chunk_size",
            ),
            (
                |c| c.transport.tcp.chunk_size = 4 << 20,
                "transport.tcp.chunk_size",
            ),
            (|c| c.limits.pipeline_depth = 0, "limits.pipeline_depth"),
            (
                |c| c.transport.tcp.eager_max = (1 << 20) + 1,
                "transport.tcp.eager_max",
            ),
            (
                |c| {
                    c.transport.tcp.eager_credit = 64 << 20;
                    c.transport.tcp.eager_max = 32 << 20;
                },
                "transport.tcp.eager_max",
            ),
            (|c| c.transport.rules.clear(), "transport.rules"),
            (
                |c| c.transport.rules[0].transports.clear(),
                "transport.rules[0].transports",
            ),
            (
                |c| c.transport.rules[0].transports = vec![TransportName::Tcp, TransportName::Tcp],
                "transport.rules[0].transports",
            ),
            (
                |c| {
                    c.transport.rules[0].min_bytes = 2;
                    c.transport.rules[0].max_bytes = Some(1);
                },
                "transport.rules[0].max_bytes",
            ),
            (
                |c| c.transport.rules.push(c.transport.rules[0].clone()),
                "transport.rules[5].name",
            ),
            (|c| c.transport.staged.slots = 1, "transport.staged.slots"),
            (
                |c| c.transport.staged.chunk = crate::AutoSize::Bytes(4096),
                "transport.staged.chunk",
            ),
            (
                |c| c.transport.staged.chunk = crate::AutoSize::Bytes(65537),
                "transport.staged.chunk",
            ),
            (
                |c| {
                    c.transport.staged.slots = 64;
                    c.transport.staged.chunk = crate::AutoSize::Bytes(64 << 20);
                },
                "transport.staged.chunk",
            ),
            (|c| c.limits.max_frame = 2 << 30, "limits.max_frame"),
            (|c| c.limits.mailbox = 0, "limits.mailbox"),
            (|c| c.limits.peer_queue = 0, "limits.peer_queue"),
            (
                |c| c.limits.reservation_queue = 0,
                "limits.reservation_queue",
            ),
            (
                |c| c.limits.connect_timeout = Duration::ZERO,
                "limits.connect_timeout",
            ),
            (
                |c| c.telemetry.log_level = String::new(),
                "telemetry.log_level",
            ),
            (
                |c| c.telemetry.metrics_listen = Some("nowhere".into()),
                "telemetry.metrics_listen",
            ),
            (
                |c| {
                    c.peers.push(PeerConfig {
                        name: "a".into(),
                        address: PeerAddress::Tcp("h:1".into()),
                    })
                },
                "peers[0].name",
            ),
            (
                |c| {
                    let peer = PeerConfig {
                        name: "b".into(),
                        address: PeerAddress::Tcp("h:1".into()),
                    };
                    c.peers = vec![peer.clone(), peer];
                },
                "peers[1].name",
            ),
            (
                |c| {
                    c.peers.push(PeerConfig {
                        name: "b".into(),
                        address: PeerAddress::Tcp("h:0".into()),
                    })
                },
                "peers[0].address",
            ),
        ];
        for (mutate, key) in cases {
            let mut config = valid();
            mutate(&mut config);
            assert_eq!(key_of(&config), key);
        }
    }

    fn dns(entries: &[(&str, u16)]) -> crate::DiscoveryConfig {
        crate::DiscoveryConfig {
            mode: DiscoveryMode::Dns,
            dns: entries
                .iter()
                .map(|&(name, port)| crate::DnsName {
                    name: name.into(),
                    port,
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn dns_discovery_that_passes() {
        for name in [
            "ferry-headless.ns.svc.cluster.local",
            "ferry-headless.ns.svc.cluster.local.",
            "localhost",
            "_ferry._tcp.example",
            "198.18.0.1",
            "::1",
        ] {
            let mut config = valid();
            config.discovery = dns(&[(name, 7070)]);
            assert!(config.validate().is_ok(), "{name:?} refused");
        }
        let mut config = valid();
        config.discovery = dns(&[("a.example", 7070), ("a.example", 7071)]);
        config.discovery.interval = Duration::from_secs(1);
        config.discovery.max_peers = 4096;
        assert!(config.validate().is_ok());
    }

    #[test]
    fn dns_discovery_errors_name_their_key() {
        let problem = |discovery: crate::DiscoveryConfig| {
            let mut config = valid();
            config.discovery = discovery;
            match config.validate() {
                Err(ConfigError::Invalid { key, detail, .. }) => (key, detail),
                other => panic!("expected Invalid, got {other:?}"),
            }
        };
        let cases: Vec<(crate::DiscoveryConfig, &str, &str)> = vec![
            (
                dns(&[("", 7070)]),
                "discovery.dns[0].name",
                "must not be empty",
            ),
            (
                dns(&[("a..b", 7070)]),
                "discovery.dns[0].name",
                "not a DNS name",
            ),
            (
                dns(&[("a b", 7070)]),
                "discovery.dns[0].name",
                "not a DNS name",
            ),
            (
                dns(&[(&"x".repeat(64), 7070)]),
                "discovery.dns[0].name",
                "not a DNS name",
            ),
            (
                dns(&[(&["abc"; 64].join("."), 7070)]),
                "discovery.dns[0].name",
                "at most 253",
            ),
            (dns(&[("a.example", 0)]), "discovery.dns[0].port", "port 0"),
            (
                dns(&[("a.example", 1), ("a.example.", 1)]),
                "discovery.dns[1]",
                "listed twice",
            ),
            (dns(&[]), "discovery.dns", "names no DNS name"),
            (
                crate::DiscoveryConfig {
                    mode: DiscoveryMode::Static,
                    ..dns(&[("a.example", 1)])
                },
                "discovery.mode",
                "set discovery.mode = \"dns\"",
            ),
            (
                crate::DiscoveryConfig {
                    interval: Duration::from_millis(999),
                    ..dns(&[("a.example", 1)])
                },
                "discovery.interval",
                "at least 1s",
            ),
            (
                crate::DiscoveryConfig {
                    max_peers: 0,
                    ..dns(&[("a.example", 1)])
                },
                "discovery.max_peers",
                "1 to 4096",
            ),
            (
                crate::DiscoveryConfig {
                    max_peers: 4097,
                    ..dns(&[("a.example", 1)])
                },
                "discovery.max_peers",
                "1 to 4096",
            ),
            (
                dns(&(1..=17).map(|p| ("a.example", p)).collect::<Vec<_>>()),
                "discovery.dns",
                "at most 16",
            ),
        ];
        for (discovery, key, words) in cases {
            let (got, detail) = problem(discovery);
            assert_eq!(got, key, "{detail}");
            assert!(detail.contains(words), "{key}: {detail}");
        }
    }

    #[test]
    fn listen_any_needs_the_danger_flag() {
        let mut config = valid();
        config.node.listen = vec!["0.0.0.0:7070".into(), "127.0.0.1:0".into()];
        config.node.danger_listen_any = true;
        assert!(config.validate().is_ok());
    }

    #[test]
    fn chunk_and_frame_error_names_both_keys() {
        let mut config = valid();
        config.limits.max_frame = 1 << 20;
        let err = config
            .validate()
            .expect_err("chunk does not fit")
            .to_string();
        assert!(err.contains("transport.tcp.chunk_size"), "{err}");
        assert!(err.contains("limits.max_frame"), "{err}");
    }
}
