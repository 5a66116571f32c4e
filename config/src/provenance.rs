//! Where each key of a configuration came from, kept with the configuration so that checks
//! made after loading (the secret file, the GPUs a node opens) name the file, variable or
//! flag to fix.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use crate::error::{ConfigError, KeyOrigin, Origin};
use crate::renamed::{DeprecatedKey, Renamed};
use crate::schema::Config;

/// The keys one layer sets, and the line of each value where the text was TOML.
#[derive(Debug, Clone)]
pub(crate) struct LayerKeys {
    pub(crate) origin: Origin,
    /// The dotted keys this layer sets: tables are expanded, arrays count as one key.
    pub(crate) keys: Vec<String>,
    /// The line of every value of the layer's TOML text, tables, arrays and their items
    /// included (`transport.rules[1].max_bytes`); empty for YAML and single values.
    pub(crate) lines: BTreeMap<String, u32>,
}

/// The layers a configuration was merged from, lowest first.
///
/// Not part of what the configuration says: two configurations with the same values are
/// equal wherever their values came from, and [`Config::to_toml`](crate::Config::to_toml)
/// writes none of it. A value changed in code after loading keeps the origin of the
/// value it replaced.
#[derive(Clone)]
pub(crate) struct Provenance {
    layers: Arc<[LayerKeys]>,
    /// The origin of a key that no layer sets: [`Origin::Defaults`] for a loaded
    /// configuration, [`Origin::Inline`] for a string, [`Origin::Program`] for one built
    /// in code (then nothing is known).
    unset: Origin,
    /// The keys set under an old name, whose new name is blamed on where the old one was
    /// set.
    deprecated: Vec<DeprecatedKey>,
}

impl Default for Provenance {
    /// A configuration built in code.
    fn default() -> Self {
        Provenance {
            layers: Arc::from(Vec::new()),
            unset: Origin::Program,
            deprecated: Vec::new(),
        }
    }
}

impl PartialEq for Provenance {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl fmt::Debug for Provenance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.layers.iter().map(|layer| &layer.origin))
            .finish()
    }
}

impl Provenance {
    pub(crate) fn new(layers: Vec<LayerKeys>, unset: Origin) -> Self {
        Provenance {
            layers: Arc::from(layers),
            unset,
            deprecated: Vec::new(),
        }
    }

    /// The keys set under an old name, in the order [`Provenance::rename`] found them.
    pub(crate) fn deprecated(&self) -> &[DeprecatedKey] {
        &self.deprecated
    }

    /// Notes that the value of `renamed.old`, which a layer set, now is `renamed.new`'s.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] about the old name, naming where both came from, when a
    /// layer sets the new name too.
    pub(crate) fn rename(&mut self, renamed: Renamed) -> Result<(), ConfigError> {
        let (_, old) = self.blame(renamed.old);
        let new = renamed.new;
        let both = self
            .layers
            .iter()
            .any(|layer| layer.keys.iter().any(|set| within(set, new)));
        if both {
            let others = self.others(&old, [new]);
            return Err(ConfigError::Invalid {
                origin: old.origin,
                line: old.line,
                key: old.key,
                detail: format!(
                    "the old name of {new}, which is set too; set only {new} (the old name is read for one release only)"
                ),
                others,
            });
        }
        self.deprecated.push(DeprecatedKey { old, new });
        Ok(())
    }

    /// The layer that set `key` (or part of it, or a table holding it), as `(rank, where)`:
    /// rank 0 when no layer did, else higher for a higher layer. A key that took the value
    /// of an old name is blamed on where that was set, under the old name.
    pub(crate) fn blame(&self, key: &str) -> (usize, KeyOrigin) {
        let old = self.deprecated.iter().find_map(|deprecated| {
            let rest = key.strip_prefix(deprecated.new)?;
            within(key, deprecated.new).then(|| format!("{}{rest}", deprecated.old.key))
        });
        let key = old.as_deref().unwrap_or(key);
        let found = self
            .layers
            .iter()
            .enumerate()
            .rev()
            .find(|(_, layer)| layer.keys.iter().any(|set| related(set, key)));
        let (rank, origin, line) = match found {
            Some((i, layer)) => (i + 1, layer.origin.clone(), line_of(&layer.lines, key)),
            None => (0, self.unset.clone(), None),
        };
        let key = key.to_string();
        (rank, KeyOrigin { key, origin, line })
    }

    /// Where each of `keys` came from: the key the highest layer set (of equals, the
    /// first: the key the check is about), and the [`others`](Self::others).
    pub(crate) fn sources<S: AsRef<str>>(&self, keys: &[S]) -> (KeyOrigin, Vec<KeyOrigin>) {
        let mut blamed: Vec<(usize, KeyOrigin)> =
            keys.iter().map(|key| self.blame(key.as_ref())).collect();
        // The first of the highest rank (`max_by_key` would take the last).
        let best =
            blamed
                .iter()
                .enumerate()
                .fold(
                    None,
                    |best: Option<(usize, usize)>, (i, (rank, _))| match best {
                        Some((_, top)) if top >= *rank => best,
                        _ => Some((i, *rank)),
                    },
                );
        let Some((best, _)) = best else {
            return (self.blame("").1, Vec::new());
        };
        let (_, main) = blamed.remove(best);
        let others = self.others(&main, blamed.into_iter().map(|(_, other)| other.key));
        (main, others)
    }

    /// Where the keys of a check other than `main` came from: those whose origin says
    /// something `main`'s does not (another layer, or a line).
    pub(crate) fn others(
        &self,
        main: &KeyOrigin,
        keys: impl IntoIterator<Item = impl AsRef<str>>,
    ) -> Vec<KeyOrigin> {
        keys.into_iter()
            .map(|key| self.blame(key.as_ref()).1)
            .filter(|other| {
                other.key != main.key
                    && other.origin != Origin::Program
                    && (other.origin != main.origin || other.line.is_some())
            })
            .collect()
    }

    /// The error of a check of `keys` (the first is the one it is about) that failed with
    /// `detail`.
    pub(crate) fn error<S: AsRef<str>>(&self, keys: &[S], detail: String) -> ConfigError {
        let (main, others) = self.sources(keys);
        ConfigError::Invalid {
            origin: main.origin,
            line: main.line,
            key: main.key,
            detail,
            others,
        }
    }
}

impl Config {
    /// Where the value of `key` (dotted, `transport.rules[1].max_bytes`) came from: the
    /// highest layer [`load`](crate::load) found setting it, with the line where that
    /// layer is TOML; [`Origin::Defaults`] when no layer set it; [`Origin::Program`] for a
    /// configuration built in code. Pure.
    pub fn origin_of(&self, key: &str) -> KeyOrigin {
        self.provenance.blame(key).1
    }

    /// The error for a check made after loading (the GPUs `gpu.devices` names are not
    /// there) that failed with `detail`: a [`ConfigError::Invalid`] naming `keys[0]` and
    /// where it came from, or, when a higher layer set one of the other keys the check
    /// read, that one; the others' origins follow. Pure.
    pub fn invalid(&self, keys: &[&str], detail: impl Into<String>) -> ConfigError {
        self.provenance.error(keys, detail.into())
    }
}

/// Whether setting key `set` sets (part of) key `key`, or the other way round.
pub(crate) fn related(set: &str, key: &str) -> bool {
    within(key, set) || within(set, key)
}

/// Whether key `long` is key `short` or a part of it (`transport.rules[0].name` of
/// `transport.rules`).
fn within(long: &str, short: &str) -> bool {
    long.strip_prefix(short)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
}

/// The line of `key`'s value, else of the nearest value holding it
/// (`transport.rules[1]` for `transport.rules[1].max_bytes` when only the table is known).
fn line_of(lines: &BTreeMap<String, u32>, key: &str) -> Option<u32> {
    let mut key = key;
    loop {
        if let Some(line) = lines.get(key) {
            return Some(*line);
        }
        key = &key[..key.rfind(['.', '['])?];
    }
}

/// The line of every key in a TOML document, by dotted key (`transport.rules[1].max_bytes`),
/// and of each item of an array (`node.listen[1]`); empty if it does not parse.
pub(crate) fn toml_lines(text: &str) -> BTreeMap<String, u32> {
    let mut lines = BTreeMap::new();
    if let Ok(document) = toml_edit::ImDocument::parse(text) {
        let line = |span: Option<std::ops::Range<usize>>| {
            let before = text.get(..span?.start)?;
            u32::try_from(before.matches('\n').count() + 1).ok()
        };
        walk_table(document.as_table(), "", &line, &mut lines);
    }
    lines
}

type LineOf<'a> = dyn Fn(Option<std::ops::Range<usize>>) -> Option<u32> + 'a;

fn walk_table(
    table: &toml_edit::Table,
    path: &str,
    line: &LineOf<'_>,
    out: &mut BTreeMap<String, u32>,
) {
    for (name, item) in table.iter() {
        let path = join(path, name);
        // An implicit table (`[a.b]`'s `a`) has no key of its own in the text.
        if let Some(at) = line(table.key(name).and_then(toml_edit::Key::span)) {
            out.insert(path.clone(), at);
        }
        walk_item(item, &path, line, out);
    }
}

fn walk_item(
    item: &toml_edit::Item,
    path: &str,
    line: &LineOf<'_>,
    out: &mut BTreeMap<String, u32>,
) {
    match item {
        toml_edit::Item::Table(table) => walk_table(table, path, line, out),
        toml_edit::Item::ArrayOfTables(tables) => {
            for (i, table) in tables.iter().enumerate() {
                let path = format!("{path}[{i}]");
                if let Some(at) = line(table.span()) {
                    out.insert(path.clone(), at);
                }
                walk_table(table, &path, line, out);
            }
        }
        toml_edit::Item::Value(value) => walk_value(value, path, line, out),
        toml_edit::Item::None => {}
    }
}

fn walk_value(
    value: &toml_edit::Value,
    path: &str,
    line: &LineOf<'_>,
    out: &mut BTreeMap<String, u32>,
) {
    match value {
        toml_edit::Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let path = format!("{path}[{i}]");
                if let Some(at) = line(item.span()) {
                    out.insert(path.clone(), at);
                }
                walk_value(item, &path, line, out);
            }
        }
        toml_edit::Value::InlineTable(table) => {
            for (name, item) in table.iter() {
                let path = join(path, name);
                if let Some(at) = line(table.key(name).and_then(toml_edit::Key::span)) {
                    out.insert(path.clone(), at);
                }
                walk_value(item, &path, line, out);
            }
        }
        _ => {}
    }
}

fn join(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_string()
    } else {
        format!("{path}.{name}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_relate_by_prefix() {
        assert!(related("transport.rules", "transport.rules[0].max_bytes"));
        assert!(related("node.listen", "node.listen[1]"));
        assert!(related("limits.mailbox", "limits"));
        assert!(!related("limits.mailbox", "limits.mailbox_extra"));
        assert!(!related("node.name", "peers[0].name"));
    }

    #[test]
    fn every_value_has_its_line() {
        let text = "security.danger_insecure = true\n\
                    [limits]\n\
                    # a comment\n\
                    mailbox = 3\n\
                    [[transport.rules]]\n\
                    name = \"a\"\n\
                    [[transport.rules]]\n\
                    name = \"b\"\n\
                    max_bytes = \"1 MiB\"\n\
                    [node]\n\
                    listen = [\n  \"127.0.0.1:1\",\n  \"127.0.0.1:2\",\n]\n";
        let lines = toml_lines(text);
        let at = |key: &str| line_of(&lines, key);
        assert_eq!(at("security.danger_insecure"), Some(1));
        assert_eq!(at("limits.mailbox"), Some(4));
        assert_eq!(at("transport.rules[1].max_bytes"), Some(9));
        assert_eq!(at("transport.rules[0].name"), Some(6));
        assert_eq!(at("node.listen[1]"), Some(13));
        // A key the text does not hold takes the line of the nearest value holding it.
        assert_eq!(at("transport.rules[1].min_bytes"), at("transport.rules[1]"));
        assert_eq!(at("peers"), None);
        assert!(toml_lines("not = [toml").is_empty());
    }

    #[test]
    fn the_highest_layer_that_sets_a_key_is_blamed() {
        let layer = |origin: Origin, keys: &[&str], lines: &[(&str, u32)]| LayerKeys {
            origin,
            keys: keys.iter().map(|k| k.to_string()).collect(),
            lines: lines.iter().map(|(k, n)| (k.to_string(), *n)).collect(),
        };
        let file = Origin::File("a.toml".into());
        let env = Origin::Env("FERRY__LIMITS__MAILBOX".into());
        let provenance = Provenance::new(
            vec![
                layer(
                    file.clone(),
                    &["limits.mailbox", "node.name"],
                    &[("limits.mailbox", 3), ("node.name", 5)],
                ),
                layer(env.clone(), &["limits.mailbox"], &[]),
            ],
            Origin::Defaults,
        );
        let blamed = |key: &str| {
            let (rank, at) = provenance.blame(key);
            (rank, at.origin, at.line)
        };
        assert_eq!(blamed("limits.mailbox"), (2, env, None));
        assert_eq!(blamed("node.name"), (1, file, Some(5)));
        assert_eq!(blamed("limits.peer_queue"), (0, Origin::Defaults, None));
        assert_eq!(
            Provenance::default().blame("node.name").1.origin,
            Origin::Program
        );
    }
}
