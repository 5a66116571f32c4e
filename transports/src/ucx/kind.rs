//! ucx as the registry lists it: its declaration (device memory where the UCX it loads
//! moves CUDA memory), viable where UCX loads, served where `transport.ucx.enabled` says
//! so, what `ferry doctor` checks of UCX ([`super::probe`]) and what `ferry explain` notes
//! of a route over it ([`super::notes`]), the lanes of its endpoint to the peer among them.

use std::any::Any;

use ferry_config::Config;

use crate::transport::{Capabilities, Finding, Note, Route, TransportKind, Viability};

/// The ucx transport before any node starts it.
#[derive(Debug, Clone, Copy, Default)]
pub struct UcxKind;

impl TransportKind for UcxKind {
    fn capabilities(&self) -> Capabilities {
        super::capabilities()
    }

    fn viability(&self) -> Viability {
        super::viability()
    }

    fn probe(&self, config: &Config, wanted: bool) -> Vec<Finding> {
        super::probe::probe(config, wanted)
    }

    fn notes(&self, config: &Config, route: &Route) -> Vec<Note> {
        super::notes::notes(config, route)
    }

    fn inspections(&self) -> &'static [&'static str] {
        &["lanes"]
    }

    fn inspected(
        &self,
        peer: &str,
        what: &str,
        answer: Result<Box<dyn Any + Send>, String>,
    ) -> Vec<Note> {
        if what != "lanes" {
            return Vec::new();
        }
        let lanes = answer.and_then(|a| {
            a.downcast::<super::EndpointLanes>()
                .map(|l| *l)
                .map_err(|_| "the ucx part answered the lanes with something else".to_string())
        });
        super::notes::lanes_notes(peer, &lanes)
    }

    fn turned_on(&self) -> &'static [(&'static str, &'static str)] {
        &[("transport.ucx.enabled", "\"on\"")]
    }
}
