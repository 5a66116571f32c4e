//! Layered loading: defaults < system file < user file < `--config` file < environment <
//! command line.
//!
//! Each layer is first checked alone against the strict schema, so an unknown key, a wrong
//! type or a bad size is reported against the file or variable that holds it. Then the layers
//! are merged with the `config` crate (tables merge key by key; an array replaces the whole
//! array below it), deserialized, and validated; a validation error names the highest layer
//! that set the faulty key, and the line where that layer is TOML. The loaded [`Config`]
//! keeps which layer set each key, so that checks made later ([`Config::read_secret`],
//! [`Config::invalid`]) name it too.

use std::io;
use std::path::{Path, PathBuf};

use config::{FileFormat, Map, Source, Value, ValueKind};

use crate::error::{ConfigError, Origin};
use crate::provenance::{LayerKeys, Provenance, toml_lines};
use crate::schema::Config;

/// Default path of the system-wide file.
const SYSTEM_FILE: &str = "/etc/ferry/ferry.toml";
/// Prefix of ferry's environment variables; `__` also separates the key's parts.
const ENV_PREFIX: &str = "FERRY__";

/// What [`load`] reads. `LoadOptions::default()` is what `ferry` does without flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOptions {
    /// System-wide file, read if it exists. Default `/etc/ferry/ferry.toml`.
    pub system_file: Option<PathBuf>,
    /// Per-user file, read if it exists. Default `ferry/ferry.toml` under the user's
    /// configuration directory (`$XDG_CONFIG_HOME` or `~/.config` on Linux).
    pub user_file: Option<PathBuf>,
    /// The `--config` file: must exist; `.toml`, `.yaml` or `.yml`. Default none.
    pub file: Option<PathBuf>,
    /// Read `FERRY__SECTION__KEY` environment variables. Default true.
    pub env: bool,
    /// When `Some` (and `env` is true), these variables are read instead of the process
    /// environment. For tests.
    pub env_vars: Option<Vec<(String, String)>>,
    /// Command-line overrides as `("limits.mailbox", "64")`, applied in order, last wins.
    pub overrides: Vec<(String, String)>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            system_file: Some(PathBuf::from(SYSTEM_FILE)),
            user_file: dirs::config_dir().map(|dir| dir.join("ferry").join("ferry.toml")),
            file: None,
            env: true,
            env_vars: None,
            overrides: Vec::new(),
        }
    }
}

impl LoadOptions {
    /// Built-in defaults and this one file: no system or user file, no environment, no
    /// overrides. What `ferry config check FILE` and tests use.
    pub fn only_file(path: impl Into<PathBuf>) -> Self {
        LoadOptions {
            system_file: None,
            user_file: None,
            file: Some(path.into()),
            env: false,
            env_vars: None,
            overrides: Vec::new(),
        }
    }
}

/// Loads, merges and validates the configuration layers that `opts` names.
///
/// Blocks on file I/O. Reads the process environment when `opts.env` is true and
/// `opts.env_vars` is `None`.
///
/// # Errors
///
/// - [`ConfigError::Io`] if the `--config` file cannot be read, or an optional file exists
///   but cannot be read;
/// - [`ConfigError::Parse`] if a file is not valid TOML or YAML or has another extension;
/// - [`ConfigError::Invalid`] for an unknown key, a wrong type, a bad value, or a failed
///   [`Config::validate`] check, naming the key and the file, variable or command line it
///   came from.
pub fn load(opts: &LoadOptions) -> Result<Config, ConfigError> {
    let mut layers = Vec::new();
    for (path, required) in [
        (&opts.system_file, false),
        (&opts.user_file, false),
        (&opts.file, true),
    ] {
        if let Some(path) = path {
            layers.extend(file_layer(path, required)?);
        }
    }
    if opts.env {
        let vars = match &opts.env_vars {
            Some(vars) => vars.clone(),
            None => process_env()?,
        };
        layers.extend(env_layers(vars)?);
    }
    for (key, value) in &opts.overrides {
        layers.push(key_layer(Origin::CommandLine, key, value)?);
    }
    merge(&layers).map_err(|e| blame_unset(e, &layers, opts))
}

/// Names a file in an error about a key that no layer sets (a required choice left out).
///
/// Such an error used to name "built-in defaults", which reads as if ferry's defaults were at
/// fault, and says nothing of the files that were read. Decided: an empty file is valid TOML
/// and simply sets nothing, so it is not an error of its own; the error about the missing key
/// names the highest file that was read (the `--config` file when there is one), because
/// that is where the key is missing and where the user would add it, says when that file
/// sets no key at all (empty, or only comments), and lists the lower files that were read
/// too. When no file was read at all, the origin stays "built-in defaults" and the error
/// says which optional files were looked for.
fn blame_unset(err: ConfigError, layers: &[Layer], opts: &LoadOptions) -> ConfigError {
    let ConfigError::Invalid {
        origin: Origin::Defaults,
        line,
        key,
        mut detail,
        others,
    } = err
    else {
        return err;
    };
    let files: Vec<&Layer> = layers
        .iter()
        .filter(|layer| matches!(layer.origin, Origin::File(_)))
        .collect();
    let Some((last, below)) = files.split_last() else {
        let looked_for: Vec<String> = [&opts.system_file, &opts.user_file]
            .into_iter()
            .flatten()
            .map(|path| path.display().to_string())
            .collect();
        if looked_for.is_empty() {
            detail.push_str("; no configuration file was read");
        } else {
            detail.push_str(&format!(
                "; no configuration file was read (looked for {})",
                looked_for.join(", ")
            ));
        }
        return ConfigError::Invalid {
            origin: Origin::Defaults,
            line,
            key,
            detail,
            others,
        };
    };
    if last.keys.is_empty() {
        detail.push_str("; the file sets no keys");
    }
    if !below.is_empty() {
        let names: Vec<String> = below.iter().map(|layer| layer.origin.to_string()).collect();
        detail.push_str(&format!("; not set in {} either", names.join(", ")));
    }
    ConfigError::Invalid {
        origin: last.origin.clone(),
        line,
        key,
        detail,
        others,
    }
}

impl Config {
    /// Parses and validates a TOML document held in memory (errors name the origin
    /// `inline configuration`). Does no I/O.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Parse`] for invalid TOML, [`ConfigError::Invalid`] for a schema or
    /// validation error.
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        let mut config = check_toml(text, &Origin::Inline)?;
        // `check_toml` parsed it: the same text cannot fail here.
        let values = config::File::from_str(text, FileFormat::Toml)
            .collect()
            .unwrap_or_default();
        let layer = Layer::new(Origin::Inline, values).with_lines(toml_lines(text));
        // A key the string does not set is blamed on it too (there is no other layer).
        let mut provenance = Provenance::new(vec![layer.keys()], Origin::Inline);
        config.move_renamed(&mut provenance)?;
        config.validate_with(&provenance)?;
        config.provenance = provenance;
        Ok(config)
    }
}

/// One layer, already checked alone against the schema.
struct Layer {
    origin: Origin,
    values: Map<String, Value>,
    /// The dotted keys this layer sets: tables are expanded, arrays count as one key.
    keys: Vec<String>,
    /// The line of each value, where the layer is TOML text.
    lines: std::collections::BTreeMap<String, u32>,
}

impl Layer {
    fn new(origin: Origin, values: Map<String, Value>) -> Layer {
        let mut keys = Vec::new();
        collect_keys("", &values, &mut keys);
        Layer {
            origin,
            values,
            keys,
            lines: Default::default(),
        }
    }

    fn with_lines(mut self, lines: std::collections::BTreeMap<String, u32>) -> Layer {
        self.lines = lines;
        self
    }

    /// What the merged configuration keeps of this layer.
    fn keys(&self) -> LayerKeys {
        LayerKeys {
            origin: self.origin.clone(),
            keys: self.keys.clone(),
            lines: self.lines.clone(),
        }
    }

    /// Deserializes this layer alone against the strict schema.
    fn check_alone(&self) -> Result<(), ConfigError> {
        let mut key = String::new();
        if let Some(number) = unbounded_float("", &self.values, &mut key) {
            return Err(ConfigError::invalid(
                self.origin.clone(),
                key,
                format!("the number is out of range for this key (read as {number:e})"),
            ));
        }
        let built = build(std::slice::from_ref(self))?;
        let provenance = Provenance::new(vec![self.keys()], self.origin.clone());
        deserialize(built, &provenance).map(drop)
    }
}

fn collect_keys(prefix: &str, table: &Map<String, Value>, keys: &mut Vec<String>) {
    for (key, value) in table {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match &value.kind {
            ValueKind::Table(inner) if !inner.is_empty() => collect_keys(&path, inner, keys),
            _ => keys.push(path),
        }
    }
}

/// The first floating-point value in `table` that no integer can hold (beyond ±2^63, or
/// not finite), with its dotted key in `key`.
///
/// YAML reads an integer too large for 64 bits as a float, and the `config` crate would turn
/// it into an integer key's value by saturating (`99999999999999999999999` to `u64::MAX`).
/// No key of the schema takes a float, and no such number is a sensible value of one that
/// does, so refusing these is safe for every key.
fn unbounded_float(prefix: &str, table: &Map<String, Value>, key: &mut String) -> Option<f64> {
    fn walk(path: String, value: &Value, key: &mut String) -> Option<f64> {
        match &value.kind {
            ValueKind::Float(number) if !number.is_finite() || number.abs() >= 2f64.powi(63) => {
                *key = path;
                Some(*number)
            }
            ValueKind::Table(inner) => unbounded_float(&path, inner, key),
            ValueKind::Array(items) => items
                .iter()
                .enumerate()
                .find_map(|(i, item)| walk(format!("{path}[{i}]"), item, key)),
            _ => None,
        }
    }
    table.iter().find_map(|(name, value)| {
        let path = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}.{name}")
        };
        walk(path, value, key)
    })
}

/// A layer's values as a `config` source.
#[derive(Debug, Clone)]
struct LayerSource(Map<String, Value>);

impl Source for LayerSource {
    fn clone_into_box(&self) -> Box<dyn Source + Send + Sync> {
        Box::new(self.clone())
    }

    fn collect(&self) -> Result<Map<String, Value>, config::ConfigError> {
        Ok(self.0.clone())
    }
}

/// Merges layers, lowest first, into one `config::Config`.
fn build(layers: &[Layer]) -> Result<config::Config, ConfigError> {
    let mut builder = config::Config::builder();
    for layer in layers {
        builder = builder.add_source(LayerSource(layer.values.clone()));
    }
    builder.build().map_err(|e| ConfigError::Parse {
        origin: layers.last().map_or(Origin::Defaults, |l| l.origin.clone()),
        detail: plain(&e),
    })
}

fn merge(layers: &[Layer]) -> Result<Config, ConfigError> {
    let mut provenance =
        Provenance::new(layers.iter().map(Layer::keys).collect(), Origin::Defaults);
    let mut config = deserialize(build(layers)?, &provenance)?;
    config.move_renamed(&mut provenance)?;
    config.validate_with(&provenance)?;
    config.provenance = provenance;
    Ok(config)
}

fn deserialize(built: config::Config, provenance: &Provenance) -> Result<Config, ConfigError> {
    serde_path_to_error::deserialize(built).map_err(|e| {
        let (_, at) = provenance.blame(&key_name(e.path()));
        ConfigError::Invalid {
            origin: at.origin,
            line: at.line,
            key: at.key,
            detail: plain(e.inner()),
            others: Vec::new(),
        }
    })
}

fn key_name(path: &serde_path_to_error::Path) -> String {
    match path.to_string() {
        root if root == "." => "(top level)".into(),
        key => key,
    }
}

/// A `config` error's message without the key and origin it appends (we print our own).
fn plain(e: &config::ConfigError) -> String {
    match e {
        config::ConfigError::Type {
            unexpected,
            expected,
            ..
        } => {
            // A number beyond 64 bits from a string (an environment variable, the command
            // line) is "a string" to the `config` crate, whose `Unexpected` is private.
            let unexpected = unexpected.to_string();
            match unexpected
                .strip_prefix("string \"")
                .and_then(|s| s.strip_suffix('"'))
            {
                Some(number) if expected.contains("integer") && is_integer(number) => {
                    format!("number {number} is out of range for this key")
                }
                _ => format!("invalid type: {unexpected}, expected {expected}"),
            }
        }
        config::ConfigError::At { error, .. } => plain(error),
        other => other.to_string(),
    }
}

/// Whether `s` is written as an integer: digits, with an optional sign.
fn is_integer(s: &str) -> bool {
    let digits = s.trim().trim_start_matches(['+', '-']);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

/// Reads one file as a layer; `Ok(None)` if it is optional and does not exist.
fn file_layer(path: &Path, required: bool) -> Result<Option<Layer>, ConfigError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if !required && e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(ConfigError::Io {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let origin = Origin::File(path.to_path_buf());
    let extension = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let (format, lines) = match extension.as_deref() {
        Some("toml") => {
            // The toml crate alone gives line numbers and exact paths; use it first.
            check_toml(&text, &origin)?;
            (FileFormat::Toml, toml_lines(&text))
        }
        Some("yaml" | "yml") => (FileFormat::Yaml, Default::default()),
        _ => {
            return Err(ConfigError::Parse {
                origin,
                detail: "unknown file type; name the file *.toml, *.yaml or *.yml".into(),
            });
        }
    };
    let values = config::File::from_str(&text, format)
        .collect()
        .map_err(|e| ConfigError::Parse {
            origin: origin.clone(),
            detail: plain(&e),
        })?;
    let layer = Layer::new(origin, values).with_lines(lines);
    layer.check_alone()?;
    Ok(Some(layer))
}

/// Parses TOML text strictly against the schema (no validation).
fn check_toml(text: &str, origin: &Origin) -> Result<Config, ConfigError> {
    if let Err(e) = text.parse::<toml::Table>() {
        // A value the parser itself refuses (an integer beyond 64 bits, an impossible date,
        // a bare word) fails here, before serde sees its key: find the key from the span.
        return Err(match refused_value(text, &e) {
            Some((key, token)) => ConfigError::invalid(
                origin.clone(),
                key,
                format!("`{token}`: {}", toml_detail(text, &e)),
            ),
            None => ConfigError::Parse {
                origin: origin.clone(),
                detail: toml_detail(text, &e),
            },
        });
    }
    serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|e| {
        ConfigError::invalid(
            origin.clone(),
            key_name(e.path()),
            toml_detail(text, e.inner()),
        )
    })
}

/// A string no configuration holds, put in place of a refused value by [`refused_value`].
const MARKER: &str = "\u{0}ferry: the refused value\u{0}";

/// The dotted key and the text of the value that the TOML parser refused, if the error is
/// about one value (its span falls on the value) and not about the document's structure.
///
/// The value's token is replaced by a marker string; if the document then parses, the
/// marker's place in it is the key, e.g. `transport.rules[1].max_bytes`. Pure.
fn refused_value(text: &str, e: &toml::de::Error) -> Option<(String, String)> {
    // The span may start inside the value (the month of a date): widen it to the token.
    let in_token = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '+' | '-' | '.' | ':');
    let at = e.span()?.start;
    let start = text.get(..at)?.trim_end_matches(in_token).len();
    let rest = &text[start..];
    let len = rest.find(|c: char| !in_token(c)).unwrap_or(rest.len());
    if len == 0 {
        return None;
    }
    let patched = format!(
        "{}\"{}\"{}",
        &text[..start],
        MARKER.replace('\u{0}', "\\u0000"),
        &rest[len..]
    );
    let table = patched.parse::<toml::Table>().ok()?;
    let mut key = String::new();
    marker_path(&toml::Value::Table(table), &mut key).then(|| (key, rest[..len].to_string()))
}

/// Whether [`MARKER`] is in `value`; if so, `path` is extended to the marker's key.
fn marker_path(value: &toml::Value, path: &mut String) -> bool {
    match value {
        toml::Value::String(s) => s == MARKER,
        toml::Value::Table(table) => table.iter().any(|(name, inner)| {
            let step = if path.is_empty() {
                name.clone()
            } else {
                format!(".{name}")
            };
            descend(path, &step, inner)
        }),
        toml::Value::Array(items) => items
            .iter()
            .enumerate()
            .any(|(i, inner)| descend(path, &format!("[{i}]"), inner)),
        _ => false,
    }
}

/// [`marker_path`] of `inner`, which is at `path` + `step`; `path` is left as it was if the
/// marker is not there.
fn descend(path: &mut String, step: &str, inner: &toml::Value) -> bool {
    let at = path.len();
    path.push_str(step);
    let found = marker_path(inner, path);
    if !found {
        path.truncate(at);
    }
    found
}

/// A TOML error as one line: the message and, when known, the line.
fn toml_detail(text: &str, e: &toml::de::Error) -> String {
    let message = e.message().trim().replace('\n', "; ");
    let line = e
        .span()
        .and_then(|span| text.get(..span.start))
        .map(|before| before.matches('\n').count() + 1);
    match line {
        Some(line) => format!("{message} (line {line})"),
        None => message.to_string(),
    }
}

/// The process's `FERRY__*` variables.
fn process_env() -> Result<Vec<(String, String)>, ConfigError> {
    let mut vars = Vec::new();
    for (name, value) in std::env::vars_os() {
        let name = name.to_string_lossy().into_owned();
        if !name.starts_with(ENV_PREFIX) {
            continue;
        }
        match value.into_string() {
            Ok(value) => vars.push((name, value)),
            Err(_) => {
                let key = env_key(&name).unwrap_or_else(|_| name.clone());
                return Err(ConfigError::invalid(
                    Origin::Env(name),
                    key,
                    "the value is not UTF-8",
                ));
            }
        }
    }
    Ok(vars)
}

/// One layer per `FERRY__*` variable, in name order, so that each error names its variable.
fn env_layers(mut vars: Vec<(String, String)>) -> Result<Vec<Layer>, ConfigError> {
    vars.retain(|(name, _)| name.starts_with(ENV_PREFIX));
    vars.sort();
    vars.into_iter()
        .map(|(name, value)| {
            let key = env_key(&name).map_err(|detail| {
                ConfigError::invalid(Origin::Env(name.clone()), name.clone(), detail.0)
            })?;
            key_layer(Origin::Env(name), &key, &value)
        })
        .collect()
}

/// `FERRY__LIMITS__MAILBOX` → `limits.mailbox`.
fn env_key(name: &str) -> Result<String, crate::ParseError> {
    let rest = name.strip_prefix(ENV_PREFIX).unwrap_or(name);
    let parts: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
    if parts.iter().all(|part| is_key_part(part)) {
        Ok(parts.join("."))
    } else {
        Err("not a ferry setting; write FERRY__SECTION__KEY, as in FERRY__LIMITS__MAILBOX".into())
    }
}

fn is_key_part(part: &str) -> bool {
    !part.is_empty() && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// A layer that sets one dotted key from a string (environment or command line).
///
/// The string is converted to the key's type when deserialized (`"64"` to a number, `"true"`
/// to a boolean). A value starting with `[` or `{` that parses as a TOML array or inline
/// table is read as one (`["127.0.0.1:7070", "127.0.0.1:7071"]`).
fn key_layer(origin: Origin, key: &str, raw: &str) -> Result<Layer, ConfigError> {
    if !key.split('.').all(is_key_part) {
        return Err(ConfigError::invalid(
            origin,
            key,
            "not a valid key; write section.key, as in limits.mailbox (array indexes are not supported: set the whole array)",
        ));
    }
    let mut values = Map::new();
    values.insert(key.to_string(), override_value(raw));
    let layer = Layer::new(origin, values);
    layer.check_alone()?;
    Ok(layer)
}

fn override_value(raw: &str) -> Value {
    if raw.trim_start().starts_with(['[', '{']) {
        let document = format!("value = {raw}");
        if let Ok(mut table) = config::File::from_str(&document, FileFormat::Toml).collect() {
            if let Some(value) = table.remove("value") {
                return value;
            }
        }
    }
    Value::from(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_names_become_keys() {
        assert_eq!(
            env_key("FERRY__LIMITS__MAILBOX").as_deref(),
            Ok("limits.mailbox")
        );
        assert_eq!(
            env_key("FERRY__TRANSPORT__TCP__CHUNK_SIZE").as_deref(),
            Ok("transport.tcp.chunk_size")
        );
        assert!(env_key("FERRY__LIMITS____MAILBOX").is_err());
        assert!(env_key("FERRY__").is_err());
    }

    #[test]
    fn refused_values_are_found_by_key() {
        let refused = |text: &str| {
            let e = text.parse::<toml::Table>().expect_err(text);
            refused_value(text, &e)
        };
        let found = |key: &str, token: &str| Some((key.to_string(), token.to_string()));
        assert_eq!(
            refused("a.b = [{ c = 1 }, { c = [2, 99999999999999999999] }]\n"),
            found("a.b[1].c[1]", "99999999999999999999")
        );
        assert_eq!(
            refused("[x]\nwhen = 1979-13-01\n"),
            found("x.when", "1979-13-01")
        );
        // The structure is broken, not a value: no key.
        assert_eq!(refused("a = 1\na = 2\n"), None);
        assert_eq!(refused("a = [1,\n"), None);
        assert_eq!(refused("s = \"\\q\"\n"), None);
    }

    #[test]
    fn integers_are_told_from_other_strings() {
        assert!(is_integer("99999999999999999999999"));
        assert!(is_integer("-1"));
        assert!(!is_integer("-"));
        assert!(!is_integer("1e30"));
        assert!(!is_integer("many"));
    }

    #[test]
    fn arrays_parse_from_strings() {
        assert!(matches!(
            override_value("[\"a\", \"b\"]").kind,
            ValueKind::Array(_)
        ));
        assert!(matches!(
            override_value("[::1]:9090").kind,
            ValueKind::String(_)
        ));
        assert!(matches!(override_value("64").kind, ValueKind::String(_)));
    }
}
