//! The configuration schema, version 1, with its defaults.
//!
//! Every struct refuses unknown keys and gives every field a default, so an empty file is a
//! valid (if insecure-by-omission, see [`SecurityConfig`]) configuration.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::address::PeerAddress;
use crate::names::config_names;
use crate::rule::MemoryClass;
use crate::transport::TransportConfig;
use crate::units::{Budget, duration, size};

/// A whole ferry configuration. `Config::default()` is the built-in defaults layer.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// This node: its name and where it listens.
    pub node: NodeConfig,
    /// Peers known in advance (`[[peers]]`).
    pub peers: Vec<PeerConfig>,
    /// How peers are found.
    pub discovery: DiscoveryConfig,
    /// Which GPUs this node uses.
    pub gpu: GpuConfig,
    /// Memory budgets.
    pub memory: MemoryConfig,
    /// Transport tuning and selection rules.
    pub transport: TransportConfig,
    /// Bounds on frames, queues and waits.
    pub limits: LimitsConfig,
    /// Authentication of control links.
    pub security: SecurityConfig,
    /// Logs and metrics.
    pub telemetry: TelemetryConfig,
    /// Which layer set each key ([`load`](crate::load) fills it; see
    /// [`Config::origin_of`](crate::Config::origin_of)). Not part of what the configuration
    /// says: ignored by `==`, not written by [`Config::to_toml`].
    #[serde(skip)]
    pub(crate) provenance: crate::provenance::Provenance,
}

/// `[node]`: this node's identity, its listeners, and how its receives wait.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// Name peers know this node by; `[A-Za-z0-9._-]`. Default: the host name if it is a valid
    /// name, else `"ferry"`.
    pub name: String,
    /// TCP listeners, `"IP:port"` or `"localhost:port"`; port 0 picks a free port. Default
    /// `["127.0.0.1:7070"]`.
    pub listen: Vec<String>,
    /// Directory of the Unix control socket `{socket_dir}/{name}.sock`; `None` (default): no
    /// Unix listener.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_dir: Option<PathBuf>,
    /// Allow listening on `0.0.0.0` or `[::]` (every interface). Default false.
    pub danger_listen_any: bool,
    /// What this node tells peers its host is: two nodes with the same host identity are
    /// same-host (ipc and the staged ring may be used between them), any others remote.
    /// 1 to 255 printable ASCII characters, no spaces. `None` (default): the machine's
    /// identity (`/etc/machine-id`, else the boot id, else the host name), which every
    /// container and network namespace of one machine shares.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_id: Option<String>,
    /// How long a `recv()` that finds nothing polls for its buffer before it sleeps (its
    /// task then needs a wake-up, some microseconds). Default `"0us"`: sleeps at once. For
    /// latency-sensitive receivers: the polling occupies a runtime worker thread. At most
    /// 1 ms. Until 2026-12-01 this was `transport.ipc.recv_spin`; that name is still read,
    /// with a warning, for one release.
    #[serde(with = "duration")]
    pub recv_spin: Duration,
    /// Threads the sessions with peers run on (each peer's session on one of them, in
    /// turn), beside the thread of the coordinator and the memory domains: one peer's slow
    /// turn never holds up the sessions on the other threads. 1 to 64. Default 4.
    pub peer_threads: usize,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            name: default_node_name().to_string(),
            listen: vec!["127.0.0.1:7070".into()],
            socket_dir: None,
            danger_listen_any: false,
            host_id: None,
            recv_spin: Duration::ZERO,
            peer_threads: 4,
        }
    }
}

/// The host name if it is a valid node name, else `"ferry"`. Read once per process.
fn default_node_name() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| {
        ["/proc/sys/kernel/hostname", "/etc/hostname"]
            .iter()
            .filter_map(|path| std::fs::read_to_string(path).ok())
            .chain(std::env::var("HOSTNAME").ok())
            .map(|name| name.trim().to_string())
            .find(|name| crate::names::is_valid_name(name))
            .unwrap_or_else(|| "ferry".to_string())
    })
}

/// `[[peers]]`: a peer known in advance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// The peer's node name; `[A-Za-z0-9._-]`, unique, not this node's name.
    pub name: String,
    /// Where to reach it.
    pub address: PeerAddress,
}

/// `[discovery]`: how peers are found, besides `[[peers]]` and the nodes that dial this one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// `"static"` (the default): only `[[peers]]`. `"dns"`: also the nodes at the
    /// addresses that the names in `dns` resolve to.
    pub mode: DiscoveryMode,
    /// The DNS names whose A/AAAA records list peers (a Kubernetes headless Service), each
    /// with the port its nodes listen on. Looked up through the system resolver, again every
    /// `interval`. A name only says where to dial: who answers is learnt from its
    /// authenticated hello. Default `[]`; at least one with `mode = "dns"`, none otherwise.
    pub dns: Vec<DnsName>,
    /// How often the names are looked up again. Default `"10s"`; at least 1 s.
    #[serde(with = "duration")]
    pub interval: Duration,
    /// Most addresses taken from DNS at once, over all names (a node with an IPv4 and an
    /// IPv6 record counts twice); the rest are left out, with a warning. Default 256; 1 to
    /// 4096.
    pub max_peers: usize,
    /// Keep a link to every peer found by DNS, dialled as soon as it is found and again
    /// after its link breaks while DNS gives its address (true, the default); or only
    /// learn where each peer is, and dial one when a send or `connect` needs it (false:
    /// `ferry explain` runs so, not to open a link to every node of a cluster).
    pub connect_all: bool,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            mode: DiscoveryMode::Static,
            dns: Vec::new(),
            interval: Duration::from_secs(10),
            max_peers: 256,
            connect_all: true,
        }
    }
}

/// One DNS name of `discovery.dns`: `{ name = "ferry.ns.svc.cluster.local", port = 7070 }`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsName {
    /// The name to look up: a host name (`[A-Za-z0-9_-]` labels joined by dots, a trailing
    /// dot allowed) or an IP address.
    pub name: String,
    /// The port the nodes at its addresses listen on (their `node.listen` port); not 0.
    pub port: u16,
}

/// A way to find peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum DiscoveryMode {
    /// Only the peers listed in `[[peers]]` (`"static"`).
    #[default]
    Static,
    /// `[[peers]]`, and the nodes at the addresses of `discovery.dns` (`"dns"`).
    Dns,
}

/// `[gpu]`: the GPUs this node uses.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GpuConfig {
    /// CUDA ordinals of the GPUs this node allocates from and receives into; the first one
    /// is where `memory.receive_into = "device"` lands. Omitted (default): every GPU the
    /// process sees. `[]`: none (host memory only). Run one node per GPU with `[0]`, `[1]`,
    /// ...: every node still sees every GPU, which the ipc transport needs to read a peer's
    /// memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<u32>>,
}

/// `[memory]`: memory budgets, where received buffers land, and where they spill.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// Budget of pageable host memory ferry may hold. Default `"50%"`.
    pub host: Budget,
    /// Budget of pinned (page-locked) host memory. Default `"25%"`. Without a CUDA driver,
    /// pinned memory is ordinary host memory counted under this budget.
    pub pinned: Budget,
    /// Budget of each GPU's memory, a size or a percentage of the GPU's total memory.
    /// Default `"90%"`.
    pub device: Budget,
    /// The tier received buffers land in first: `"host"`, `"pinned"` or `"device"` (the
    /// first GPU of `gpu.devices`; a node without a GPU receives into host memory then).
    /// Default `"host"`.
    pub receive_into: MemoryClass,
    /// The tiers a receive spills to, in order, when `receive_into` cannot grant in time:
    /// e.g. `["host"]` after `receive_into = "pinned"`. Default `[]`: no spill.
    pub spill: Vec<MemoryClass>,
    /// How long memory exported to a peer stays quarantined after that peer died without
    /// releasing it, before it is free again. Default `"10s"`.
    #[serde(with = "duration")]
    pub export_lease_timeout: Duration,
    /// How long memory of dropped buffers stays kept for later grants (the shelf) while
    /// nothing uses it, before it goes back: host memory to the system, device memory out
    /// of the GPU's pool. Default `"2s"`; `"0s"` keeps nothing.
    #[serde(with = "duration")]
    pub keep_idle: Duration,
    /// The most memory of dropped buffers each domain (host, pinned, each GPU) keeps for
    /// later grants; never more than the domain's budget has free either. Default
    /// `"512 MiB"`; `0` keeps nothing.
    #[serde(with = "size")]
    pub keep_max: u64,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            host: Budget::Percent(50.0),
            pinned: Budget::Percent(25.0),
            device: Budget::Percent(90.0),
            receive_into: MemoryClass::Host,
            spill: Vec::new(),
            export_lease_timeout: Duration::from_secs(10),
            keep_idle: Duration::from_secs(2),
            keep_max: 512 << 20,
        }
    }
}

/// `[limits]`: bounds on frames, queues and waits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest frame accepted from a peer, checked before allocating. Default `"4 MiB"`, at
    /// most 1 GiB.
    #[serde(with = "size")]
    pub max_frame: u64,
    /// Deadline of a transfer that sets none. Default `"30s"`.
    #[serde(with = "duration")]
    pub default_deadline: Duration,
    /// Time a peer has to complete the authenticated handshake. Default `"5s"`.
    #[serde(with = "duration")]
    pub handshake_timeout: Duration,
    /// Time to establish a connection to a peer. Default `"5s"`.
    #[serde(with = "duration")]
    pub connect_timeout: Duration,
    /// Bound of each actor's mailbox. Default 256, at least 1.
    pub mailbox: usize,
    /// Bound of the per-peer queue of pending operations. Default 1024, at least 1.
    pub peer_queue: usize,
    /// Bound of each allocator's queue of waiting reservations. Default 1024, at least 1.
    pub reservation_queue: usize,
    /// Longest time a transfer may go without a byte of progress: a frame begun and left
    /// unfinished, a peer that stops reading what we write, an inbound transfer granted
    /// and then not fed. The link (mid-frame) or the transfer ends, its memory is freed
    /// and the peer is told why. Also how long a peer this node waits on has to answer a
    /// keepalive (sent after a third of it without a byte from the peer): past it the link
    /// is taken for half-open or the peer for gone, and the link ends. Default `"5s"`.
    #[serde(with = "duration")]
    pub stall_timeout: Duration,
    /// Unauthenticated connections in their handshake at once, in all: as many still
    /// sending their preamble, and as many again past it. When full, a new connection sheds
    /// the oldest that has sent nothing, then the oldest that has sent part of a preamble,
    /// never one whose preamble arrived whole; one of those gives way only to another.
    /// Default 256, at least 1.
    pub handshakes: usize,
    /// The same from one source address, shed from that source first. Default 32, at
    /// least 1.
    pub handshakes_per_source: usize,
    /// Time an accepted connection has to send its first byte before it is closed.
    /// Default `"1s"`.
    #[serde(with = "duration")]
    pub first_byte_timeout: Duration,
    /// Bytes one peer may hold on this node: reserved for its inbound transfers, and
    /// delivered but not yet taken by a `recv`. An offer that would go past it waits until
    /// earlier ones are taken; a single offer larger than it goes alone once the peer holds
    /// nothing else (the memory budget still decides whether it fits). Default `"4GiB"`.
    #[serde(with = "size")]
    pub peer_inbound_bytes: u64,
    /// Inbound transfers of one peer being reserved or received at once (outstanding
    /// grants); later offers wait their turn. Default 64, at least 1.
    pub peer_grants: usize,
    /// Transfers this node has open with one peer at once, over any transport: offered
    /// and not yet ended, counted from the oldest still open. Later sends wait in the
    /// peer's queue (`peer_queue`). Default 8; 1 to 1024.
    pub pipeline_depth: u32,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_frame: 4 << 20,
            default_deadline: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            mailbox: 256,
            peer_queue: 1024,
            reservation_queue: 1024,
            stall_timeout: Duration::from_secs(5),
            handshakes: 256,
            handshakes_per_source: 32,
            first_byte_timeout: Duration::from_secs(1),
            peer_inbound_bytes: 4 << 30,
            peer_grants: 64,
            pipeline_depth: 8,
        }
    }
}

/// `[security]`: authentication of control links. Exactly one of the two keys must be set.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecurityConfig {
    /// File holding the shared secret (at least 16 bytes; a trailing newline is ignored),
    /// read by [`Config::read_secret`](crate::Config::read_secret). Default none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<PathBuf>,
    /// Run without authentication: anyone who can reach a listener can send and read
    /// buffers. For test setups only. Default false.
    pub danger_insecure: bool,
    /// Accept a `secret_file` that its group or others may read or write (mode `0644`, say).
    /// Default false: such a file is refused, since anyone who can read the secret can join.
    /// For test setups only.
    pub danger_secret_file_any_mode: bool,
}

/// `[telemetry]`: logs and metrics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Log filter, `tracing` env-filter syntax (`"info"`, `"ferry=debug,warn"`). Default
    /// `"info"`.
    pub log_level: String,
    /// Log line format. Default text.
    pub log_format: LogFormat,
    /// Address of the Prometheus metrics endpoint (`"IP:port"` or `"localhost:port"`);
    /// `None` (default): no endpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            log_level: "info".into(),
            log_format: LogFormat::Text,
            metrics_listen: None,
        }
    }
}

/// Format of log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LogFormat {
    /// Human-readable lines (`"text"`, the default).
    #[default]
    Text,
    /// One JSON object per line (`"json"`).
    Json,
}

config_names! {
    DiscoveryMode { Static => "static", Dns => "dns" }
    LogFormat { Text => "text", Json => "json" }
}

impl Config {
    /// Writes the configuration as TOML, in the form the loaders read back (sizes as
    /// `"1 MiB"`, durations as `"30s"`). Used by `ferry config show`.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Serialize`](crate::ConfigError::Serialize) if a value cannot be written
    /// as TOML: a path that is not UTF-8, or a count above `i64::MAX`. Neither can come from a
    /// file.
    pub fn to_toml(&self) -> Result<String, crate::ConfigError> {
        toml::to_string(self).map_err(|e| crate::ConfigError::Serialize {
            detail: e.to_string(),
        })
    }
}
