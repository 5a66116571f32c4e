//! ferry's configuration: the schema (version 1), layered loading, validation, and the
//! transport selection rules.
//!
//! This crate owns what a configuration *says*; it does not open sockets, allocate memory or
//! pick transports at run time (it only answers which rule matches, see
//! [`TransportConfig::first_match`]). Every key is described in `docs/CONFIG.md`.
//!
//! ```
//! use ferry_config::{Config, Locality, MemoryClass};
//!
//! let config = Config::from_toml_str(
//!     r#"
//!     [node]
//!     name = "a"
//!     [security]
//!     danger_insecure = true
//!     "#,
//! )?;
//! let (index, rule) = config
//!     .transport
//!     .first_match(Locality::SameHost, MemoryClass::Host, MemoryClass::Host, 4096)
//!     .expect("a default rule matches everything");
//! // The default "gpu" rule (0) takes only device memory, "remote-gpu" and "remote-host"
//! // (1 and 2) only other hosts; "same-host-host" (3) takes host memory on this host.
//! assert_eq!((index, rule.name.as_str()), (3, "same-host-host"));
//! # Ok::<(), ferry_config::ConfigError>(())
//! ```
//!
//! Loading reads, lowest layer first: built-in defaults, `/etc/ferry/ferry.toml`, the user's
//! `ferry/ferry.toml`, the `--config` file, `FERRY__SECTION__KEY` environment variables, and
//! command-line overrides ([`load`], [`LoadOptions`]). A key that moved is still read under
//! its old name for one release, and the loaded configuration says where
//! ([`Config::deprecated_keys`]).

#![forbid(unsafe_code)]

mod address;
mod error;
mod load;
mod names;
mod provenance;
mod renamed;
mod rule;
mod schema;
mod secret;
mod transport;
mod units;
mod validate;

pub use address::PeerAddress;
pub use error::{ConfigError, KeyOrigin, Origin, ParseError};
pub use load::{LoadOptions, load};
pub use renamed::DeprecatedKey;
pub use rule::{Direction, Locality, MemoryClass, Rule, TransportName};
pub use schema::{
    Config, DiscoveryConfig, DiscoveryMode, DnsName, GpuConfig, LimitsConfig, LogFormat,
    MemoryConfig, NodeConfig, PeerConfig, SecurityConfig, TelemetryConfig,
};
pub use transport::{IpcTuning, StagedTuning, TcpTuning, TransportConfig, UcxMode, UcxTuning};
pub use units::{AutoSize, Budget, format_size, parse_size};

/// The largest `limits.pipeline_depth`: a receiver lets each peer have at least this
/// many transfers open, so that no sender's window is refused.
pub const MAX_PIPELINE_DEPTH: u32 = 1024;
