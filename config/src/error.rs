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

/// Where one key's value came from: the layer and, for a TOML file or string, the line.
///
/// `Display` reads `limits.max_frame from config file /etc/ferry/ferry.toml, line 12`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyOrigin {
    /// Dotted path of the key, e.g. `transport.tcp.chunk_size`.
    pub key: String,
    /// The layer that set it ([`Origin::Defaults`] when none did).
    pub origin: Origin,
    /// The line of the file that set it, where known (TOML; not YAML, the environment or
    /// the command line).
    pub line: Option<u32>,
}

impl fmt::Display for KeyOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} from {}", self.key, At(&self.origin, self.line))
    }
}

/// A layer and a line, as an error message starts: `config file a.toml, line 3`.
pub(crate) struct At<'a>(pub(crate) &'a Origin, pub(crate) Option<u32>);

impl fmt::Display for At<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.1 {
            Some(line) => write!(f, "{}, line {line}", self.0),
            None => write!(f, "{}", self.0),
        }
    }
}

/// The other keys of a check, as an error message ends: `; limits.max_frame from ...`.
struct Others<'a>(&'a [KeyOrigin]);

impl fmt::Display for Others<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|other| write!(f, "; {other}"))
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
    ///
    /// A check of several keys (`transport.tcp.chunk_size` against `limits.max_frame`) is
    /// about the one the highest layer set, and names where each of the others came from.
    #[error("{}: key {key}: {detail}{}", At(origin, *line), Others(others))]
    Invalid {
        /// The layer that set the faulty value. For a key that no layer sets (a required
        /// choice left out) [`load`](crate::load) names the highest file it read, where the
        /// key is missing, and [`Origin::Defaults`] only when it read no file.
        origin: Origin,
        /// The line of the file that set the value, where known: a TOML file's value
        /// checked after parsing (a parser's or the schema's error gives its line in
        /// `detail` instead).
        line: Option<u32>,
        /// Dotted path of the key, e.g. `transport.rules[0].max_bytes`.
        key: String,
        /// What is wrong and, where useful, how to fix it.
        detail: String,
        /// For a check of several keys: where the others came from (those whose layer
        /// says something `origin` does not).
        others: Vec<KeyOrigin>,
    },
    /// The file named by `security.secret_file` cannot be used as a secret: checked after
    /// loading, by [`Config::read_secret`](crate::Config::read_secret).
    #[error(
        "{}: key security.secret_file: secret file {}: {detail}{}",
        At(origin, *line),
        path.display(),
        Others(others)
    )]
    Secret {
        /// The layer that set `security.secret_file`.
        origin: Origin,
        /// The line of the file that set it, where known.
        line: Option<u32>,
        /// The secret file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
        /// The I/O error, when the file could not be read.
        source: Option<io::Error>,
        /// The other keys the check read (`security.danger_secret_file_any_mode` for the
        /// file's mode and owner), and where they came from.
        others: Vec<KeyOrigin>,
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
    /// A [`ConfigError::Invalid`] about one key, without a line.
    pub(crate) fn invalid(
        origin: Origin,
        key: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        ConfigError::Invalid {
            origin,
            line: None,
            key: key.into(),
            detail: detail.into(),
            others: Vec::new(),
        }
    }

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
            ConfigError::Parse { origin, .. }
            | ConfigError::Invalid { origin, .. }
            | ConfigError::Secret { origin, .. } => Some(origin),
            _ => None,
        }
    }

    /// The line of the file that set the faulty value, where known.
    pub fn line(&self) -> Option<u32> {
        match self {
            ConfigError::Invalid { line, .. } | ConfigError::Secret { line, .. } => *line,
            _ => None,
        }
    }

    /// For a check of several keys: where the other keys came from.
    pub fn others(&self) -> &[KeyOrigin] {
        match self {
            ConfigError::Invalid { others, .. } | ConfigError::Secret { others, .. } => others,
            _ => &[],
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
