//! A built-in transport before any node starts it: what it declares, whether it can run
//! here, and what the tools say of it. `ferry doctor` asks each one to check what it is
//! built on ([`TransportKind::probe`]); `ferry explain` and `ferry bench` ask for its notes
//! on a route over it ([`TransportKind::notes`]), and `ferry explain` what its part of a
//! peer's session says live ([`TransportKind::inspections`], through the node's generic
//! inspect, worded by [`TransportKind::inspected`]). So the tools name no transport: what is
//! specific to one lives in its own directory, behind this trait, and
//! [`crate::registry::kinds`] lists them.

use std::any::Any;

use ferry_config::{Config, Locality, MemoryClass};

use super::{Capabilities, Finding, Viability};

/// One built-in transport, as the registry lists it: its declaration and its diagnostics.
/// Nothing here starts it or needs a node.
pub trait TransportKind: Send + Sync + 'static {
    /// What it declares it can do, as routing reads it.
    fn capabilities(&self) -> Capabilities;

    /// Whether it can run on this machine (its library loads, the driver works), probed
    /// once per process where that costs anything.
    fn viability(&self) -> Viability;

    /// `ferry doctor`'s checks of what it is built on (a library's release, its own
    /// transports), as read from this machine for a node with `config`. `wanted`: a rule
    /// the node uses names it, so a problem found is a warning rather than a skip.
    ///
    /// Blocks while it looks (loading a library, running its tools with a time limit);
    /// never fails: what cannot be read is a finding. Empty for a transport built on
    /// nothing beyond what every transport uses.
    fn probe(&self, config: &Config, wanted: bool) -> Vec<Finding> {
        let _ = (config, wanted);
        Vec::new()
    }

    /// What `ferry explain` (and `ferry bench`, above its table) says of `route`, a route
    /// of a rule that names this transport, for a node with `config`: facts of its own
    /// (the library it loads, its settings) and warnings where it runs far below what the
    /// hardware allows for reasons only it knows.
    ///
    /// May block briefly (loading a library the node loads anyway, measuring a setting a
    /// node measures at its first use); never fails.
    fn notes(&self, config: &Config, route: &Route) -> Vec<Note> {
        let _ = (config, route);
        Vec::new()
    }

    /// What `ferry explain` asks a started node's part of the session with the peer, for a
    /// route over this transport with the link up: each a word of the part's
    /// [`PeerTransport::inspect`](super::PeerTransport::inspect) (ucx: `"lanes"`). Empty
    /// for a transport with nothing to say live.
    fn inspections(&self) -> &'static [&'static str] {
        &[]
    }

    /// The notes of what the part of the session with `peer` answered to `what` (one of
    /// [`TransportKind::inspections`]), or why the node could not say. Pure.
    fn inspected(
        &self,
        peer: &str,
        what: &str,
        answer: Result<Box<dyn Any + Send>, String>,
    ) -> Vec<Note> {
        let _ = (peer, what, answer);
        Vec::new()
    }

    /// Describes the transport's own metrics to the installed recorder and sets its
    /// counters to 0, so that a node's first scrape lists them (a node does it at start).
    fn describe_metrics(&self) {}

    /// The settings with which a node serves this transport where it declares
    /// [`Capabilities::opt_in`]: each a dotted key and its value as TOML text
    /// (`("transport.x.enabled", "\"on\"")`). Empty for a transport every node serves.
    fn turned_on(&self) -> &'static [(&'static str, &'static str)] {
        &[]
    }
}

/// A route as a transport's [`TransportKind::notes`] see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// Where the peer is.
    pub locality: Locality,
    /// The memory the bytes leave.
    pub src: MemoryClass,
    /// The memory they land in at the peer.
    pub landing: MemoryClass,
    /// True when this transport carries it; false when the rule names it but another
    /// carries it (before it in the rule, or because it was passed over).
    pub chosen: bool,
    /// True when this machine has an RDMA device.
    pub rdma_device: bool,
}

impl Route {
    /// Whether device memory moves at either end.
    pub fn moves_device_memory(&self) -> bool {
        self.src == MemoryClass::Device || self.landing == MemoryClass::Device
    }
}

/// One thing a transport says of a route.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Note {
    /// A fact: one labelled line of the text report (`label`, then `text`), and in the JSON
    /// one `json` under the key `label` spells with `_` for spaces (`"ucx lanes"` →
    /// `ucx_lanes`).
    Fact {
        /// The line's label.
        label: String,
        /// The line.
        text: String,
        /// What the JSON report holds for it (an object that usually repeats `text`).
        json: serde_json::Value,
    },
    /// A warning: the route runs far below what the hardware allows, or something is to be
    /// fixed; listed with the report's other warnings.
    Warning(String),
}

impl Note {
    /// The key of a [`Note::Fact`] labelled `label` in a JSON report.
    pub fn json_key(label: &str) -> String {
        label.replace(' ', "_")
    }
}
