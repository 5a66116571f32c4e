//! staged as the registry lists it: its declaration (device memory only where the CUDA
//! driver works), viable everywhere, and its ring's settings as a note on a route over it.

use ferry_config::{AutoSize, Config, format_size};

use crate::transport::{Capabilities, Note, Route, TransportKind, Viability};

/// The staged transport before any node starts it.
#[derive(Debug, Clone, Copy, Default)]
pub struct StagedKind;

impl TransportKind for StagedKind {
    fn describe_metrics(&self) {
        metrics::describe_counter!(
            "ferry_staged_ring_chunks_total",
            "Staged chunks received through a same-host peer's shared-memory ring (not the link)"
        );
        metrics::counter!("ferry_staged_ring_chunks_total").absolute(0);
    }

    fn capabilities(&self) -> Capabilities {
        super::capabilities()
    }

    fn viability(&self) -> Viability {
        Viability::Viable
    }

    /// On a route it carries: its slots, its chunk (what `"auto"` picks in this process,
    /// measured once, on the node's first GPU for device memory) and whether same-host
    /// chunks go through shared memory.
    fn notes(&self, config: &Config, route: &Route) -> Vec<Note> {
        if !route.chosen {
            return Vec::new();
        }
        let tuning = &config.transport.staged;
        let chunk = match tuning.chunk {
            AutoSize::Auto => {
                let device = route
                    .moves_device_memory()
                    .then(|| {
                        config
                            .gpu
                            .devices
                            .as_deref()
                            .map_or(Some(0), |d| d.first().copied())
                    })
                    .flatten()
                    .and_then(|ordinal| crate::cuda::Device::open(ordinal as usize).ok());
                let picked = super::auto_chunk(device.as_ref()) as u64;
                format!("auto = {}", format_size(picked))
            }
            size => size.to_string(),
        };
        let text = ring_text(tuning.slots, &chunk, tuning.shared_memory);
        vec![Note::Fact {
            label: "staged".into(),
            json: serde_json::json!({
                "slots": tuning.slots,
                "chunk": chunk,
                "shared_memory": tuning.shared_memory,
                "text": text,
            }),
            text,
        }]
    }
}

/// `8 slots of auto = 4 MiB, shared memory true`.
fn ring_text(slots: u32, chunk: &str, shared_memory: bool) -> String {
    format!("{slots} slots of {chunk}, shared memory {shared_memory}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_config::{Locality, MemoryClass};

    fn route(chosen: bool) -> Route {
        Route {
            locality: Locality::SameHost,
            src: MemoryClass::Host,
            landing: MemoryClass::Host,
            chosen,
            rdma_device: false,
        }
    }

    #[test]
    fn a_route_over_it_names_the_ring_and_one_that_passes_it_by_nothing() {
        let config = Config::from_toml_str(
            "[node]\nname = \"a\"\n[security]\ndanger_insecure = true\n\
             [transport.staged]\nslots = 4\nchunk = \"2 MiB\"\nshared_memory = false\n",
        )
        .expect("config");
        let notes = StagedKind.notes(&config, &route(true));
        let [Note::Fact { label, text, json }] = &notes[..] else {
            panic!("one fact: {notes:?}");
        };
        assert_eq!(label, "staged");
        assert_eq!(text, "4 slots of 2 MiB, shared memory false");
        assert_eq!(json["slots"], 4);
        assert!(StagedKind.notes(&config, &route(false)).is_empty());
    }
}
