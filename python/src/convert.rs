//! Conversions between Python values and ferry's types: memory kinds, configurations given
//! as dicts, layouts, route explanations, memory counters and publish/fetch counters.

use ferry::{Explanation, Layout, MemoryClass, MemoryKind};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::errors::usage;

/// A memory kind from its Python spelling: `"host"`, `"pinned"`, `"cuda"` / `"device"`
/// (GPU 0) or `"cuda:N"` / `"device:N"`.
pub(crate) fn parse_kind(text: &str) -> PyResult<MemoryKind> {
    let text = text.trim().to_ascii_lowercase();
    match text.as_str() {
        "host" => return Ok(MemoryKind::Host),
        "pinned" => return Ok(MemoryKind::PinnedHost),
        "cuda" | "device" => return Ok(MemoryKind::Device(0)),
        _ => {}
    }
    let ordinal = text
        .strip_prefix("cuda:")
        .or_else(|| text.strip_prefix("device:"))
        .and_then(|n| n.parse::<u32>().ok());
    ordinal.map(MemoryKind::Device).ok_or_else(|| {
        usage(format!(
            "unknown memory kind {text:?}: expected \"host\", \"pinned\", \"cuda\" or \"cuda:N\""
        ))
    })
}

/// A memory class from its configuration name (`"host"`, `"pinned"`, `"device"`).
pub(crate) fn parse_class(text: &str) -> PyResult<MemoryClass> {
    match text.trim().to_ascii_lowercase().as_str() {
        "host" => Ok(MemoryClass::Host),
        "pinned" => Ok(MemoryClass::Pinned),
        "device" | "cuda" => Ok(MemoryClass::Device),
        other => Err(usage(format!(
            "unknown memory class {other:?}: expected \"host\", \"pinned\" or \"device\""
        ))),
    }
}

/// The Python spelling of a memory kind: `"host"`, `"pinned"` or `"cuda:N"`.
pub(crate) fn kind_label(kind: MemoryKind) -> String {
    match kind {
        MemoryKind::Host => "host".into(),
        MemoryKind::PinnedHost => "pinned".into(),
        MemoryKind::Device(n) => format!("cuda:{n}"),
        other => other.to_string(),
    }
}

/// The class a kind of memory belongs to.
pub(crate) fn class_of(kind: MemoryKind) -> MemoryClass {
    match kind {
        MemoryKind::PinnedHost => MemoryClass::Pinned,
        MemoryKind::Device(_) => MemoryClass::Device,
        _ => MemoryClass::Host,
    }
}

/// The configuration name of a memory class.
pub(crate) fn class_label(class: MemoryClass) -> &'static str {
    match class {
        MemoryClass::Host => "host",
        MemoryClass::Pinned => "pinned",
        MemoryClass::Device => "device",
    }
}

/// A configuration given as a Python dict (tables as dicts, arrays as lists, paths as
/// `os.PathLike`), as TOML text for [`ferry::Config::from_toml_str`], which validates it
/// exactly as it validates a file.
pub(crate) fn dict_to_toml(dict: &Bound<'_, PyDict>) -> PyResult<String> {
    let table = table_of(dict)?;
    toml::to_string(&toml::Value::Table(table)).map_err(|e| {
        usage(format!(
            "the configuration dict cannot be written as TOML: {e}"
        ))
    })
}

fn table_of(dict: &Bound<'_, PyDict>) -> PyResult<toml::map::Map<String, toml::Value>> {
    let mut table = toml::map::Map::new();
    for (key, value) in dict.iter() {
        let key: String = key
            .extract()
            .map_err(|_| usage(format!("configuration keys are strings, not {key:?}")))?;
        if value.is_none() {
            continue;
        }
        let value = value_of(&value).map_err(|e| usage(format!("configuration key {key}: {e}")))?;
        table.insert(key, value);
    }
    Ok(table)
}

fn value_of(value: &Bound<'_, PyAny>) -> PyResult<toml::Value> {
    if value.is_instance_of::<PyBool>() {
        return Ok(toml::Value::Boolean(value.extract()?));
    }
    if value.is_instance_of::<PyInt>() {
        return Ok(toml::Value::Integer(value.extract()?));
    }
    if value.is_instance_of::<PyFloat>() {
        return Ok(toml::Value::Float(value.extract()?));
    }
    if value.is_instance_of::<PyString>() {
        return Ok(toml::Value::String(value.extract()?));
    }
    if let Ok(dict) = value.cast::<PyDict>() {
        return Ok(toml::Value::Table(table_of(dict)?));
    }
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        let items = value
            .try_iter()?
            .map(|item| value_of(&item?))
            .collect::<PyResult<Vec<_>>>()?;
        return Ok(toml::Value::Array(items));
    }
    // A path (`pathlib.Path` or anything `os.fspath` takes).
    let os = value.py().import("os")?;
    if let Ok(path) = os.call_method1("fspath", (value,)) {
        return Ok(toml::Value::String(path.extract()?));
    }
    Err(usage(format!(
        "{} values cannot be part of a configuration",
        value.get_type().name()?
    )))
}

/// The layout keyword arguments of `send_layout` and `fetch`: rows at a pitch (planes of
/// them with `depth`), or a list of blocks.
pub(crate) struct LayoutArgs {
    pub rows: Option<u64>,
    pub row_bytes: Option<u64>,
    pub pitch: Option<u64>,
    pub depth: Option<u64>,
    pub plane_rows: Option<u64>,
    pub blocks: Option<Vec<(u64, u64)>>,
}

impl LayoutArgs {
    /// True when no layout keyword was given.
    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_none()
            && [
                self.rows,
                self.row_bytes,
                self.pitch,
                self.depth,
                self.plane_rows,
            ]
            .iter()
            .all(Option::is_none)
    }
}

/// A layout from the layout keyword arguments of `method` (named in the errors):
/// `blocks`, or `rows`, `row_bytes` and `pitch` (with `depth` and `plane_rows` for planes),
/// not both.
pub(crate) fn layout_of(method: &str, args: LayoutArgs) -> PyResult<Layout> {
    let strided = [
        args.rows,
        args.row_bytes,
        args.pitch,
        args.depth,
        args.plane_rows,
    ];
    match (args.blocks, args.rows, args.row_bytes, args.pitch) {
        (Some(blocks), ..) => {
            if strided.iter().any(Option::is_some) {
                return Err(usage(format!(
                    "{method} takes blocks, or rows, row_bytes and pitch: not both"
                )));
            }
            Ok(Layout::blocks(blocks))
        }
        (None, Some(rows), Some(row_bytes), Some(pitch)) => Ok(match args.depth {
            None => Layout::Strided2D {
                rows,
                row_bytes,
                pitch,
            },
            Some(depth) => Layout::Strided3D {
                depth,
                rows,
                row_bytes,
                pitch,
                plane_rows: args.plane_rows.unwrap_or(rows),
            },
        }),
        _ => Err(usage(format!(
            "{method} needs blocks=[(offset, length), ...], or rows, row_bytes and pitch"
        ))),
    }
}

/// A layout as a dict (`None` for the whole buffer).
pub(crate) fn layout_dict<'py>(
    py: Python<'py>,
    layout: &Layout,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    let dict = PyDict::new(py);
    match *layout {
        Layout::Blocks(ref blocks) => {
            let list: Vec<(u64, u64)> = blocks.iter().map(|b| (b.offset, b.len)).collect();
            dict.set_item("blocks", list)?;
        }
        Layout::Strided2D {
            rows,
            row_bytes,
            pitch,
        } => {
            dict.set_item("rows", rows)?;
            dict.set_item("row_bytes", row_bytes)?;
            dict.set_item("pitch", pitch)?;
        }
        Layout::Strided3D {
            depth,
            rows,
            row_bytes,
            pitch,
            plane_rows,
        } => {
            dict.set_item("depth", depth)?;
            dict.set_item("rows", rows)?;
            dict.set_item("row_bytes", row_bytes)?;
            dict.set_item("pitch", pitch)?;
            dict.set_item("plane_rows", plane_rows)?;
        }
        _ => return Ok(None),
    }
    Ok(Some(dict))
}

/// The configuration name of a locality.
fn locality_label(locality: ferry_config::Locality) -> &'static str {
    match locality {
        ferry_config::Locality::SameProcess => "same-process",
        ferry_config::Locality::SameHost => "same-host",
        ferry_config::Locality::Remote => "remote",
    }
}

/// A route explanation as a dict: the query, the rule, the transports passed over with
/// their reasons, the choice, and the whole in words (`"summary"`).
pub(crate) fn explanation_dict<'py>(
    py: Python<'py>,
    explanation: &Explanation,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    let query = &explanation.query;
    dict.set_item("summary", explanation.to_string())?;
    dict.set_item("bytes", query.bytes)?;
    dict.set_item("locality", locality_label(query.locality))?;
    dict.set_item("src", class_label(query.src))?;
    dict.set_item("dst", class_label(query.dst))?;
    dict.set_item("dst_from", query.dst_from.to_string())?;
    dict.set_item("rule", explanation.rule.as_ref().map(|(_, name)| name))?;
    dict.set_item("rule_index", explanation.rule.as_ref().map(|(i, _)| *i))?;
    let skipped = explanation
        .skipped
        .iter()
        .map(|(t, why)| (t.as_str(), why.to_string()))
        .collect::<Vec<_>>();
    dict.set_item("skipped", skipped)?;
    match &explanation.chosen {
        Some(route) => {
            dict.set_item("transport", route.transport.as_str())?;
            dict.set_item("direction", format!("{:?}", route.direction).to_lowercase())?;
            dict.set_item("landing", class_label(route.landing))?;
        }
        None => {
            dict.set_item("transport", py.None())?;
            dict.set_item("direction", py.None())?;
            dict.set_item("landing", py.None())?;
        }
    }
    Ok(dict)
}

/// One memory domain's counters as a dict.
pub(crate) struct DomainCounters {
    pub capacity: u64,
    pub granted: u64,
    pub waiting: usize,
    pub peak_waiting: usize,
    pub exported: u64,
    pub quarantined: u64,
    pub kept: u64,
    pub reused: u64,
}

impl DomainCounters {
    pub(crate) fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        dict.set_item("capacity", self.capacity)?;
        dict.set_item("granted", self.granted)?;
        dict.set_item("free", self.capacity.saturating_sub(self.granted))?;
        dict.set_item("waiting", self.waiting)?;
        dict.set_item("peak_waiting", self.peak_waiting)?;
        dict.set_item("exported", self.exported)?;
        dict.set_item("quarantined", self.quarantined)?;
        dict.set_item("kept", self.kept)?;
        dict.set_item("reused", self.reused)?;
        Ok(dict)
    }
}

/// What a published key has served (`Node.publication`) as a dict.
pub(crate) fn publication_dict<'py>(
    py: Python<'py>,
    stats: &ferry::PublicationStats,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("len", stats.len)?;
    dict.set_item("served", stats.served)?;
    dict.set_item("bytes_served", stats.bytes_served)?;
    dict.set_item("refused", stats.refused)?;
    dict.set_item("reading", stats.reading)?;
    Ok(dict)
}

/// A node's fetch counters (`Node.fetch_stats`) as a dict.
pub(crate) fn fetch_stats_dict<'py>(
    py: Python<'py>,
    stats: &ferry::FetchStats,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("fetches", stats.fetches)?;
    dict.set_item("flights", stats.flights)?;
    dict.set_item("joined", stats.joined)?;
    dict.set_item("bytes_saved", stats.bytes_saved)?;
    Ok(dict)
}
