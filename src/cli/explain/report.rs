//! What `ferry explain` prints: the report, as JSON (its fields) or as text (one labelled,
//! aligned line per fact).

use ferry::Explanation;
use ferry_actors::core::route::DstSource;
use ferry_config::{Rule, format_size};
use ferry_transports::transport::Note;
use serde::Serialize;

use super::{Args, Layout, RuleMiss, Setup, Skip, performance_warnings, rule_misses, skip};

/// What `ferry explain` prints, as text or JSON.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    peer: String,
    bytes: u64,
    src: String,
    dst: String,
    /// Where `dst` came from: `dst-memory` (asked), `peer` (its hello) or `assumed` (no link).
    #[serde(serialize_with = "dst_from_key")]
    dst_from: DstSource,
    layout: Layout,
    locality: String,
    setup: SetupReport,
    earlier_rules: Vec<RuleMiss>,
    rule: Option<RuleRef>,
    skipped: Vec<Skip>,
    chosen: Option<Chosen>,
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu: Option<String>,
    /// What the transports the rule names say of the route ([`Note::Fact`]), each under
    /// its own key.
    #[serde(flatten)]
    notes: serde_json::Map<String, serde_json::Value>,
    /// The same, as labelled lines, in the order they came.
    #[serde(skip)]
    note_lines: Vec<(String, String)>,
    warnings: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
struct SetupReport {
    attempted: bool,
    connected: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
struct RuleRef {
    index: usize,
    name: String,
}

#[derive(Debug, Clone, Serialize)]
struct Chosen {
    transport: String,
    direction: String,
    /// Where the bytes land at the peer: `dst`, or host memory for a transport that cannot
    /// land there.
    landing: String,
}

/// How the JSON report names where the destination memory came from.
fn dst_from_key<S: serde::Serializer>(from: &DstSource, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(match from {
        DstSource::Asked => "dst-memory",
        DstSource::Peer => "peer",
        DstSource::Assumed => "assumed",
    })
}

impl Report {
    pub(super) fn new(
        args: &Args,
        rules: &[Rule],
        e: &Explanation,
        setup: Setup,
        gpu: Option<String>,
    ) -> Self {
        let setup = match setup {
            Setup::NotTried => SetupReport {
                attempted: false,
                connected: false,
                error: None,
            },
            Setup::Connected => SetupReport {
                attempted: true,
                connected: true,
                error: None,
            },
            Setup::Failed(error) => SetupReport {
                attempted: true,
                connected: false,
                error: Some(error),
            },
        };
        Self {
            peer: args.peer.clone(),
            bytes: e.query.bytes,
            src: e.query.src.to_string(),
            dst: e.query.dst.to_string(),
            dst_from: e.query.dst_from,
            layout: args.layout,
            locality: e.query.locality.to_string(),
            setup,
            earlier_rules: rule_misses(rules, &e.query),
            rule: e.rule.as_ref().map(|(index, name)| RuleRef {
                index: *index,
                name: name.clone(),
            }),
            skipped: e.skipped.iter().map(|(t, why)| skip(*t, why)).collect(),
            chosen: e.chosen.as_ref().map(|r| Chosen {
                transport: r.transport.to_string(),
                direction: r.direction.to_string(),
                landing: r.landing.to_string(),
            }),
            gpu,
            notes: serde_json::Map::new(),
            note_lines: Vec::new(),
            warnings: performance_warnings(e, rules),
        }
    }

    /// Whether a transport was chosen (the exit status says so).
    pub(super) fn has_route(&self) -> bool {
        self.chosen.is_some()
    }

    /// Adds what transports said of the route: facts as lines (and under their keys in
    /// JSON), warnings with the others.
    pub(super) fn add_notes(&mut self, notes: Vec<Note>) {
        for note in notes {
            match note {
                Note::Fact { label, text, json } => {
                    self.notes.insert(Note::json_key(&label), json);
                    self.note_lines.push((label, text));
                }
                Note::Warning(text) => self.warnings.push(text),
                _ => {}
            }
        }
    }

    /// The human form: a header, then one labelled, aligned line per fact.
    pub(super) fn render(&self) -> String {
        let mut lines: Vec<(String, String)> = Vec::new();
        let mut line = |label: &str, text: String| lines.push((label.to_string(), text));
        match (&self.setup.attempted, &self.setup.error) {
            (false, _) => line(
                "link",
                "not tried (--no-connect): from this side's declarations only".into(),
            ),
            (true, None) => line("link", format!("connected to {}", self.peer)),
            (true, Some(error)) => line(
                "link",
                format!(
                    "setup failed: {error}; the route below is from this side's declarations only"
                ),
            ),
        }
        let from = match self.dst_from {
            DstSource::Asked => "asked for with --dst-memory".to_string(),
            other => other.to_string(),
        };
        line("dst", format!("{} memory: {from}", self.dst));
        for miss in &self.earlier_rules {
            line(
                &format!("rule #{}", miss.index),
                format!(
                    "\"{}\" did not match: {}",
                    miss.name,
                    miss.reasons.join("; ")
                ),
            );
        }
        match &self.rule {
            Some(r) => line(
                &format!("rule #{}", r.index),
                format!("\"{}\" matched", r.name),
            ),
            None => line("rule", "no rule matches this transfer".into()),
        }
        for s in &self.skipped {
            line("skipped", format!("{}: {}", s.transport, s.reason));
        }
        match &self.chosen {
            Some(c) if c.landing != self.dst => line(
                "chosen",
                format!(
                    "{}, {}; lands in {} memory: {} cannot land in {} memory",
                    c.transport, c.direction, c.landing, c.transport, self.dst
                ),
            ),
            Some(c) => line("chosen", format!("{}, {}", c.transport, c.direction)),
            None if self.rule.is_some() => line(
                "chosen",
                "none: no transport of the rule can carry it".into(),
            ),
            None => line("chosen", "none: add a rule that matches it".into()),
        }
        if let Some(gpu) = &self.gpu {
            line("gpu", gpu.clone());
        }
        for (label, text) in &self.note_lines {
            line(label, text.clone());
        }
        for w in &self.warnings {
            line("warning", w.clone());
        }
        let width = lines.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
        let mut out = format!(
            "ferry explain: {} {} -> {} to peer {} ({}), {}\n",
            format_size(self.bytes),
            self.src,
            self.dst,
            self.peer,
            self.locality,
            "contiguous"
        );
        for (label, text) in lines {
            out.push_str(&format!("  {label:<width$}  {text}\n"));
        }
        out
    }
}
