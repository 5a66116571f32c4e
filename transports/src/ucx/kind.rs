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
    fn describe_metrics(&self) {
        metrics::describe_counter!(
            "ferry_ucx_pushes_streamed_total",
            "Pushes over ucx this node received over its link instead of lending memory to the writer's puts, which UCX would have applied itself (no one-sided lane for them; transport.ucx.emulated_push = false)"
        );
        metrics::describe_counter!(
            "ferry_ucx_emulated_rma_peers_total",
            "Peers whose UCX endpoint reads over tcp emulation (~0.4 GB/s): tcp lanes only, or tcp beside cuda_ipc alone (whose gets UCX turns off without NVLink); counted once per peer, after its first ucx pull"
        );
        metrics::counter!("ferry_ucx_emulated_rma_peers_total").absolute(0);
        metrics::counter!("ferry_ucx_pushes_streamed_total").absolute(0);
    }

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
