//! shm as the registry lists it: its declaration, whether the kernel lets it run, its
//! metrics, and what `ferry explain` says of a route over it (the pool's settings).

use ferry_config::Config;

use crate::transport::{Capabilities, Note, Route, TransportKind, Viability};

/// The shm transport before any node starts it.
#[derive(Debug, Clone, Copy, Default)]
pub struct ShmKind;

impl TransportKind for ShmKind {
    fn capabilities(&self) -> Capabilities {
        super::capabilities()
    }

    fn viability(&self) -> Viability {
        super::viability()
    }

    fn describe_metrics(&self) {
        metrics::describe_gauge!(
            "ferry_shm_pool_bytes",
            "Bytes of shared-memory segments the node's pool has made (never shrunk while it runs)"
        );
        metrics::describe_counter!(
            "ferry_shm_refused_total",
            "Descriptors from a peer that shm refused (another pool, a stale segment, a range past it)"
        );
        metrics::gauge!("ferry_shm_pool_bytes").set(0.0);
        metrics::counter!("ferry_shm_refused_total").absolute(0);
    }

    fn turned_on(&self) -> &'static [(&'static str, &'static str)] {
        &[("transport.shm.enabled", "true")]
    }

    /// The pool the node's host buffers come from, and a warning when it is turned off.
    fn notes(&self, config: &Config, route: &Route) -> Vec<Note> {
        let shm = &config.transport.shm;
        if !shm.enabled {
            return vec![Note::Warning(
                "transport.shm.enabled is false: same-host host memory goes by the rule's next \
                 transport (a copy through the kernel's socket at each end)"
                    .into(),
            )];
        }
        if !route.chosen {
            return Vec::new();
        }
        let text = format!(
            "host buffers from shared memory: segments of {}, at most {}; the peer copies \
             once from this node's mapping",
            ferry_config::format_size(shm.segment_size),
            ferry_config::format_size(shm.max_bytes)
        );
        vec![Note::Fact {
            label: "shm pool".into(),
            json: serde_json::json!({
                "text": text,
                "segment_size": shm.segment_size,
                "max_bytes": shm.max_bytes,
            }),
            text,
        }]
    }
}
