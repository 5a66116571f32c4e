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
use crate::rule::{Locality, MemoryClass, Rule};
use crate::units::{AutoSize, Budget, duration, size};

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
}

/// `[node]`: this node's identity and listeners.
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
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            name: default_node_name().to_string(),
            listen: vec!["127.0.0.1:7070".into()],
            socket_dir: None,
            danger_listen_any: false,
            host_id: None,
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
        }
    }
}

/// `[transport]`: transport tuning and selection rules.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransportConfig {
    /// Tuning of the TCP transport.
    pub tcp: TcpTuning,
    /// Tuning of the ipc transport.
    pub ipc: IpcTuning,
    /// Tuning of the staged transport.
    pub staged: StagedTuning,
    /// The ucx transport.
    pub ucx: UcxTuning,
    /// Selection rules, first match wins (`[[transport.rules]]`). Default: `"gpu"`, device
    /// memory to a same-host peer over ipc (pull), falling back to staged, then tcp;
    /// `"remote-gpu"`, device memory to another host over ucx, else staged, else tcp;
    /// `"remote-host"`, anything else to another host over ucx, else tcp; then `"host"`,
    /// which matches everything and uses tcp, push. A file that sets rules replaces the
    /// whole list.
    pub rules: Vec<Rule>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            tcp: TcpTuning::default(),
            ipc: IpcTuning::default(),
            staged: StagedTuning::default(),
            ucx: UcxTuning::default(),
            rules: vec![
                Rule::same_host_gpu(),
                Rule::remote_gpu(),
                Rule::remote_host(),
                Rule::catch_all(),
            ],
        }
    }
}

impl TransportConfig {
    /// The first rule that matches a transfer, with its index in `rules`, or `None` if no rule
    /// does. Pure.
    pub fn first_match(
        &self,
        locality: Locality,
        src: MemoryClass,
        dst: MemoryClass,
        bytes: u64,
    ) -> Option<(usize, &Rule)> {
        self.rules
            .iter()
            .enumerate()
            .find(|(_, rule)| rule.matches(locality, src, dst, bytes))
    }
}

/// `[transport.tcp]`: TCP transport tuning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TcpTuning {
    /// Payload bytes per data frame. Default `"1 MiB"`; at least 4 KiB, and 64 KiB less than
    /// `limits.max_frame` at most.
    #[serde(with = "size")]
    pub chunk_size: u64,
    /// The largest transfer this node takes eagerly from a peer: the sender writes the
    /// bytes right behind the offer, within this node's eager credit, instead of waiting
    /// for a grant. Default `"64 KiB"`; `0` takes none (every offer waits for its grant).
    /// At most `eager_credit` and 16 MiB.
    #[serde(with = "size")]
    pub eager_max: u64,
    /// The bytes of eager transfers one peer may have on their way to this node at once
    /// (sent, not yet answered). Default `"1 MiB"`.
    #[serde(with = "size")]
    pub eager_credit: u64,
}

impl Default for TcpTuning {
    fn default() -> Self {
        TcpTuning {
            chunk_size: 1 << 20,
            eager_max: 64 << 10,
            eager_credit: 1 << 20,
        }
    }
}

/// `[transport.ipc]`: ipc transport tuning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IpcTuning {
    /// Largest device buffer this node sends to a same-host peer on the lane (a
    /// shared-memory ring and a thread per direction instead of the socket and the actors):
    /// contiguous buffers the rules send over ipc by pull. Default 1 TiB: every size; `0`
    /// turns the lane off. A receiver takes records of any size; it keeps 4 buffers of
    /// 64 KiB allocated ahead per peer once a small one arrived.
    #[serde(with = "size")]
    pub lane_max: u64,
    /// How long a lane thread spins for the next record before it sleeps (a busy lane then
    /// makes no system call). Default `"100us"`; `0` sleeps at once.
    #[serde(with = "duration")]
    pub lane_spin: Duration,
    /// Largest lane record a receiver copies with ferry's copy kernel (the records of one
    /// batch into one GPU in one launch) rather than the copy engine (a copy each, a fixed
    /// cost of several microseconds of CPU per copy from a peer's memory; no SMs used).
    /// Default `"1 MiB"`; `0`: every copy by the copy engine. At most 1 GiB.
    #[serde(with = "size")]
    pub gather_max: u64,
    /// How long a `recv()` that finds nothing polls for its buffer before it sleeps (its
    /// task then needs a wake-up, some microseconds). Default `"0us"`: sleeps at once. For
    /// latency-sensitive receivers: the polling occupies a runtime worker thread. At most
    /// 1 ms.
    #[serde(with = "duration")]
    pub recv_spin: Duration,
}

impl Default for IpcTuning {
    fn default() -> Self {
        IpcTuning {
            lane_max: 1 << 40,
            lane_spin: Duration::from_micros(100),
            gather_max: 1 << 20,
            recv_spin: Duration::ZERO,
        }
    }
}

/// `[transport.staged]`: the staged transport (device → pinned host → link → pinned host
/// → device, pipelined chunk by chunk).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StagedTuning {
    /// Staging slots per direction and peer: chunks in flight between the sender's copy
    /// out and the receiver's copy in. Default 8; 2 to 64.
    pub slots: u32,
    /// Bytes per chunk (and per slot). Default `"auto"`: picked once per process at the
    /// first staged send, from a short measurement of the copy rate at a few sizes (the
    /// smallest within 3% of the best); else 64 KiB to 64 MiB, a multiple of 8 bytes. `slots × chunk` is at most
    /// 1 GiB.
    pub chunk: AutoSize,
    /// Between processes of one host, the slots live in shared memory (a sealed memfd
    /// registered with the GPU driver as pinned on both sides), and a chunk moves by one
    /// copy out and one copy in, without the socket. Default true; false sends every
    /// chunk over the link, as to another host.
    pub shared_memory: bool,
    /// Payload bytes per data frame when the chunks go over the link (another host, or
    /// `shared_memory = false`). Default `"1 MiB"`; at least 4 KiB, and 64 KiB less than
    /// `limits.max_frame` at most.
    #[serde(with = "size")]
    pub link_chunk: u64,
    /// How long a staging thread spins for the next chunk or free slot before it sleeps on
    /// a futex. Longer than one chunk's copy, so a busy transfer never pays a wake-up per
    /// chunk. Default `"2ms"`; at most 100 ms.
    #[serde(with = "duration")]
    pub spin: Duration,
}

impl Default for StagedTuning {
    fn default() -> Self {
        StagedTuning {
            slots: 8,
            chunk: AutoSize::Auto,
            shared_memory: true,
            link_chunk: 1 << 20,
            spin: Duration::from_millis(2),
        }
    }
}

/// `[transport.ucx]`: the ucx transport (UCX's UCP, loaded at run time; RDMA where the
/// machine has it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UcxTuning {
    /// Whether this node serves ucx: `"auto"` (the default) when UCX loads and the machine
    /// has an RDMA device (`/sys/class/infiniband`); `"on"` whenever UCX loads (over tcp
    /// too: UCX emulates its reads there, slower than ferry's own tcp); `"off"` never.
    pub enabled: UcxMode,
    /// The `libucp.so` to load. Default: the environment variable `FERRY_UCX_LIBRARY`,
    /// else the system's `libucp.so.0`. Both ends must load the same UCX build.
    pub library: Option<PathBuf>,
    /// UCX's transport list (`UCX_TLS`), e.g. `"rc,cuda_copy,cuda_ipc,tcp"`. Default:
    /// UCX's own choice. It must include `tcp` or an RDMA transport (`rc`, `dc`, `ud`):
    /// ferry needs UCX to notice a dead peer.
    pub tls: Option<String>,
    /// The network devices UCX may use (`UCX_NET_DEVICES`), e.g. `"mlx5_0:1"` or `"lo"`.
    /// Default: UCX's own choice (all).
    pub net_devices: Option<String>,
    /// Further UCX settings, each named without its `UCX_` prefix (`RNDV_THRESH = "64k"`).
    /// An unknown name or bad value keeps ucx from starting (the log and `ferry explain`
    /// say why). Default none.
    pub env: std::collections::BTreeMap<String, String>,
    /// How long UCX's progress thread polls after the last operation before it sleeps.
    /// Default `"50us"`; at most 10 ms.
    #[serde(with = "duration")]
    pub progress_spin: Duration,
    /// The longest one UCX read may take before the peer's endpoint is closed and its
    /// transfers fail. Default `"30s"`; at least 100 ms.
    #[serde(with = "duration")]
    pub op_timeout: Duration,
    /// Whether this node lends its memory to a peer's ucx push (a rule's `direction =
    /// "push"`) where UCX would emulate the peer's writes in software over tcp (no RDMA,
    /// shared-memory or, for device memory, cuda_ipc lane). There, a writer that dies in
    /// the middle of its writes can abort this process inside UCX (measured with UCX 1.13
    /// and 1.22). Default `false`: such pushes stream over ferry's link instead, said once
    /// per peer in the log.
    pub emulated_push: bool,
}

impl Default for UcxTuning {
    fn default() -> Self {
        UcxTuning {
            enabled: UcxMode::Auto,
            library: None,
            tls: None,
            net_devices: None,
            env: std::collections::BTreeMap::new(),
            progress_spin: Duration::from_micros(50),
            op_timeout: Duration::from_secs(30),
            emulated_push: false,
        }
    }
}

/// Whether a node serves the ucx transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum UcxMode {
    /// When UCX loads and the machine has an RDMA device.
    #[default]
    Auto,
    /// Whenever UCX loads.
    On,
    /// Never.
    Off,
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
    /// Unauthenticated connections in their handshake at once, in all. When full, the
    /// oldest is shed to make room for a new one. Default 256, at least 1.
    pub handshakes: usize,
    /// Unauthenticated connections in their handshake at once from one source address;
    /// past it that source's oldest is shed. Default 32, at least 1.
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
    UcxMode { Auto => "auto", On => "on", Off => "off" }
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
