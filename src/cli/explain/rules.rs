//! Why the rules before the matching one did not match, and why each transport of the
//! matching rule was passed over: the words of `ferry explain`'s `rule #N` and `skipped`
//! lines. Pure.

use ferry_actors::core::route::RouteQuery;
use ferry_config::{Rule, TransportName, format_size};
use ferry_transports::transport::Unsuitable;
use serde::Serialize;

/// Why a rule before the matching one did not match. Pure.
pub fn rule_mismatch(rule: &Rule, query: &RouteQuery) -> Vec<String> {
    fn list<T: std::fmt::Display>(items: &[T]) -> String {
        items
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("|")
    }
    let mut why = Vec::new();
    if !rule.locality.is_empty() && !rule.locality.contains(&query.locality) {
        why.push(format!(
            "locality {} not in {}",
            query.locality,
            list(&rule.locality)
        ));
    }
    if !rule.src.is_empty() && !rule.src.contains(&query.src) {
        why.push(format!(
            "source memory {} not in {}",
            query.src,
            list(&rule.src)
        ));
    }
    if !rule.dst.is_empty() && !rule.dst.contains(&query.dst) {
        why.push(format!(
            "destination memory {} not in {}",
            query.dst,
            list(&rule.dst)
        ));
    }
    if query.bytes < rule.min_bytes {
        why.push(format!(
            "size {} below min_bytes {}",
            format_size(query.bytes),
            format_size(rule.min_bytes)
        ));
    }
    if let Some(max) = rule.max_bytes
        && query.bytes > max
    {
        why.push(format!(
            "size {} above max_bytes {}",
            format_size(query.bytes),
            format_size(max)
        ));
    }
    why
}

/// A rule that did not match, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RuleMiss {
    /// Index in `transport.rules`.
    pub index: usize,
    /// Its name.
    pub name: String,
    /// Each condition that failed.
    pub reasons: Vec<String>,
}

/// Walks the rules in order up to the first that matches (or all of them) and says why
/// each one before it did not. Pure.
pub fn rule_misses(rules: &[Rule], query: &RouteQuery) -> Vec<RuleMiss> {
    rules
        .iter()
        .enumerate()
        .map(|(index, rule)| (index, rule, rule_mismatch(rule, query)))
        .take_while(|(_, _, reasons)| !reasons.is_empty())
        .map(|(index, rule, reasons)| RuleMiss {
            index,
            name: rule.name.clone(),
            reasons,
        })
        .collect()
}

/// A transport passed over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skip {
    /// The transport.
    pub transport: String,
    /// `not-built`, `not-viable`, `peer-lacks` or `capabilities`.
    pub kind: &'static str,
    /// Why, in words.
    pub reason: String,
}

/// Classifies and words why a transport was passed over. Pure.
pub fn skip(transport: TransportName, why: &Unsuitable) -> Skip {
    let (kind, reason) = match why {
        Unsuitable::NotViable(text) if text.starts_with("not built yet") => {
            ("not-built", text.clone())
        }
        Unsuitable::NotViable(text) => {
            ("not-viable", format!("not viable on this machine: {text}"))
        }
        Unsuitable::PeerLacks => ("peer-lacks", "the peer does not offer it".to_string()),
        Unsuitable::Locality(l) => (
            "capabilities",
            format!("excluded by its declared capabilities: cannot reach a {l} peer"),
        ),
        Unsuitable::Memory(m) => (
            "capabilities",
            format!("excluded by its declared capabilities: cannot move {m} memory"),
        ),
        Unsuitable::Direction(Some(d)) => (
            "capabilities",
            format!("excluded by its declared capabilities: does not support {d}"),
        ),
        Unsuitable::Direction(None) => (
            "capabilities",
            "excluded by its declared capabilities: declares no direction".to_string(),
        ),
        Unsuitable::SetupFailed(why) => ("setup-failed", format!("setup failed: {why}")),
    };
    Skip {
        transport: transport.to_string(),
        kind,
        reason,
    }
}
