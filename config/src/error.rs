//! Errors of this crate, and where a faulty value came from.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// Where a configuration value came from: one layer of [`load`](crate::load).
///
/// Every [`ConfigError`] that is about a value names its origin, so a user knows which file,
/// variable or flag to fix.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Origin {
    /// The values built into ferry: nothing set the key, and no file was read.
    Defaults,
    /// A configuration file (system, user or `--config`).
    File(PathBuf),
    /// An environment variable, by its full name (`FERRY__LIMITS__MAILBOX`).
    Env(String),
    /// A command-line override.
    CommandLine,
    /// A string passed to [`Config::from_toml_str`](crate::Config::from_toml_str).
    Inline,
    /// A [`Config`](crate::Config) built in code and checked with
    /// [`Config::validate`](crate::Config::validate): no layer information.
    Program,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Defaults => f.write_str("built-in defaults"),
            Origin::File(path) => write!(f, "config file {}", path.display()),
            Origin::Env(name) => write!(f, "environment variable {name}"),
            Origin::CommandLine => f.write_str("command line"),
            Origin::Inline => f.write_str("inline configuration"),
            Origin::Program => f.write_str("configuration"),
        }
    }
}

/// Why a configuration could not be read, parsed or accepted.
///
/// The `Display` form is one line meant for the person who wrote the configuration, e.g.
/// `config file /etc/x.toml: key limits.default_deadline: invalid duration "5 parsecs": ...`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A configuration file that had to be read could not be (missing `--config` file,
    /// permission denied, not UTF-8). Optional layers that do not exist are skipped instead.
    #[error("config file {}: cannot read: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: io::Error,
    },
    /// A file is not well-formed TOML or YAML, or has an unsupported extension.
    #[error("{origin}: {detail}")]
    Parse {
        /// Where the text came from.
        origin: Origin,
        /// What is wrong, with the line where the parser knows it.
        detail: String,
    },
    /// A key is unknown, has the wrong type, or has a value that is not allowed.
    #[error("{origin}: key {key}: {detail}")]
    Invalid {
        /// The layer that set the faulty value. For a key that no layer sets (a required
        /// choice left out) [`load`](crate::load) names the highest file it read, where the
        /// key is missing, and [`Origin::Defaults`] only when it read no file.
        origin: Origin,
        /// Dotted path of the key, e.g. `transport.rules[0].max_bytes`.
        key: String,
        /// What is wrong and, where useful, how to fix it.
        detail: String,
    },
    /// The file named by `security.secret_file` cannot be used as a secret.
    #[error("key security.secret_file: secret file {}: {detail}", path.display())]
    Secret {
        /// The secret file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
        /// The I/O error, when the file could not be read.
        source: Option<io::Error>,
    },
    /// The configuration cannot be written as TOML (a value TOML cannot hold, such as an
    /// integer above `i64::MAX` set in code).
    #[error("cannot write the configuration as TOML: {detail}")]
    Serialize {
        /// What the serializer said.
        detail: String,
    },
}

impl ConfigError {
    /// The dotted key the error is about, if it is about one key.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { key, .. } => Some(key),
            ConfigError::Secret { .. } => Some("security.secret_file"),
            _ => None,
        }
    }

    /// The layer the faulty value came from, if known.
    pub fn origin(&self) -> Option<&Origin> {
        match self {
            ConfigError::Parse { origin, .. } | ConfigError::Invalid { origin, .. } => Some(origin),
            _ => None,
        }
    }
}

/// Why one value's text could not be read (a size, an address, a name): the words for the
/// message, which the loader wraps in a [`ConfigError::Invalid`] naming the key and layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);

impl From<String> for ParseError {
    fn from(text: String) -> Self {
        Self(text)
    }
}

impl From<&str> for ParseError {
    fn from(text: &str) -> Self {
        Self(text.to_string())
    }
}

impl std::ops::Deref for ParseError {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}
