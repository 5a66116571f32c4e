//! What `ferry explain` says of a route over ucx: the UCX release a node loads and from
//! which file (every node must load the same one: a peer's addresses and keys do not unpack
//! in another), what device memory costs without an RDMA device, and, with the link up,
//! which of UCX's own transports its endpoint to the peer uses.

use ferry_config::{Config, UcxMode};
use serde_json::json;

use super::{EndpointLanes, LoadError, LoadedUcx, RmaPath};
use crate::transport::{DevicePath, Note, Route};

/// UCX reading device memory over tcp, copied through host memory (H100 ×1, UCX 1.22,
/// PERFORMANCE.md).
const UCX_TCP_DEVICE_GBPS: f32 = 0.4;

/// The notes of `route`, a route of a rule that names ucx, for a node with `config`: the
/// release it loads, and where device memory goes over ucx without an RDMA device, what
/// that costs. Loads UCX (as the node does) unless it is turned off.
pub fn notes(config: &Config, route: &Route) -> Vec<Note> {
    let ucx = &config.transport.ucx;
    let mut out = vec![release_note(ucx.enabled, || {
        super::loaded(ucx.library.as_deref())
    })];
    out.extend(without_rdma(route).map(Note::Warning));
    out
}

/// What to say of the UCX a node with `transport.ucx.enabled = enabled` loads (`load`
/// loads it, unless the node loads none). Pure but for `load`.
fn release_note(enabled: UcxMode, load: impl FnOnce() -> Result<LoadedUcx, LoadError>) -> Note {
    let (release, file, text) = if enabled == UcxMode::Off {
        (
            None,
            None,
            "this node loads no UCX: transport.ucx.enabled is \"off\"".to_string(),
        )
    } else {
        match load() {
            Ok(loaded) => (
                Some(loaded.release.to_string()),
                Some(
                    loaded
                        .file
                        .clone()
                        .unwrap_or_else(|| loaded.location.path.clone()),
                ),
                loaded.to_string(),
            ),
            Err(e) => (
                e.release().map(|r| r.to_string()),
                None,
                format!("UCX does not load: {e}"),
            ),
        }
    };
    let mut json = json!({ "release": release, "text": text });
    if let Some(file) = file {
        json["file"] = json!(file);
    }
    Note::Fact {
        label: "ucx".into(),
        text,
        json,
    }
}

/// What device memory over ucx costs on a machine without an RDMA device, where `route`
/// moves it over ucx. Pure.
fn without_rdma(route: &Route) -> Option<String> {
    if !route.chosen || route.rdma_device || !route.moves_device_memory() {
        return None;
    }
    let name = super::capabilities().name;
    let copy_engine = crate::registry::declarations()
        .iter()
        .find(|c| c.device_path == DevicePath::CopyEngine)
        .map_or_else(
            || "a copy-engine transport".to_string(),
            |c| c.name.to_string(),
        );
    let same_host = route.locality != ferry_config::Locality::Remote;
    Some(format!(
        "device memory goes over {name} on a machine without an RDMA device: UCX reads GPU \
         memory over tcp, copied through host memory (~{UCX_TCP_DEVICE_GBPS} GB/s measured), \
         and between GPUs of one host without NVLink it does so too; {}",
        if same_host {
            format!("on one host {copy_engine} uses the copy engine")
        } else {
            "an RDMA NIC with GPUDirect RDMA lets the NIC read GPU memory directly".into()
        }
    ))
}

/// The notes of what a node said of its UCX endpoint to `peer` (`Node::ucx_lanes`, or why
/// it could not say): a fact `ucx lanes`, and a warning when UCX emulates reads over tcp on
/// it. Pure.
pub fn lanes_notes(peer: &str, answer: &Result<EndpointLanes, String>) -> Vec<Note> {
    let lanes = match answer {
        Ok(lanes) => lanes,
        Err(why) => {
            let text = format!("could not ask this node's UCX endpoint to {peer}: {why}");
            return vec![lanes_fact("unknown", Vec::new(), text)];
        }
    };
    let rma = match lanes.rma() {
        None => "unknown",
        Some(RmaPath::OneSided { .. }) => "one-sided",
        Some(RmaPath::EmulatedOverTcp) => "emulated-over-tcp",
        Some(RmaPath::GpuIpcBesideTcp { .. }) => "gpu-ipc-beside-tcp",
        Some(RmaPath::Unrecognised { .. }) => "unrecognised",
    };
    let entries = lanes
        .lanes
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|l| json!({ "transport": l.transport, "device": l.device }))
        .collect();
    // The peer pulls what this node sends over its own endpoint to here; UCX picks its
    // lanes from the same two worker addresses.
    let text = format!("this node's endpoint to {peer}: {lanes}");
    let mut out = vec![lanes_fact(rma, entries, text)];
    out.extend(
        lanes
            .warning(&format!("UCX reads between this node and {peer}"))
            .map(|w| {
                Note::Warning(format!(
                    "{w}; allow an RDMA transport in transport.ucx.tls, or route this through \
                     another transport"
                ))
            }),
    );
    out
}

/// The `ucx lanes` fact: `rma` is `one-sided`, `emulated-over-tcp`, `gpu-ipc-beside-tcp`,
/// `unrecognised`, or `unknown` (UCX < 1.14, or the endpoint could not be asked); `lanes`
/// each lane's UCX transport and device, in UCX's order (empty when unknown).
fn lanes_fact(rma: &str, lanes: Vec<serde_json::Value>, text: String) -> Note {
    Note::Fact {
        label: "ucx lanes".into(),
        json: json!({ "rma": rma, "lanes": lanes, "text": text }),
        text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ucx::{LanesUnknown, LibraryLocation, LibrarySource, TransportEntry, Version};
    use ferry_config::{Locality, MemoryClass};

    fn fact(note: &Note) -> (&str, &str, &serde_json::Value) {
        match note {
            Note::Fact { label, text, json } => (label, text, json),
            other => panic!("not a fact: {other:?}"),
        }
    }

    #[test]
    fn the_ucx_line_names_the_release_even_when_ucx_does_not_load() {
        let off = release_note(UcxMode::Off, || unreachable!("not loaded when off"));
        let (label, text, json) = fact(&off);
        assert_eq!(label, "ucx");
        assert!(text.contains("enabled is \"off\""), "{text}");
        assert_eq!(json["release"], serde_json::Value::Null);
        let old = release_note(UcxMode::On, || {
            Err(LoadError::TooOld {
                location: LibraryLocation {
                    source: LibrarySource::System,
                    path: "libucp.so.0".into(),
                },
                found: Version {
                    major: 1,
                    minor: 12,
                    release: 1,
                },
                required: Version {
                    major: 1,
                    minor: 13,
                    release: 0,
                },
            })
        });
        let (_, text, json) = fact(&old);
        assert_eq!(json["release"], "1.12.1");
        assert!(json.get("file").is_none(), "{json}");
        assert!(text.starts_with("UCX does not load: UCX 1.12.1"), "{text}");
    }

    #[test]
    fn device_memory_over_ucx_without_rdma_warns() {
        let route = Route {
            locality: Locality::Remote,
            src: MemoryClass::Device,
            landing: MemoryClass::Device,
            chosen: true,
            rdma_device: false,
        };
        let w = without_rdma(&route).expect("a warning");
        assert!(
            w.contains("without an RDMA device") && w.contains("0.4 GB/s"),
            "{w}"
        );
        assert!(w.contains("the NIC read GPU memory directly"), "{w}");
        // With an RDMA device the NIC can read GPU memory: nothing to say; nor of host
        // memory, nor of a route that another transport carries.
        for quiet in [
            Route {
                rdma_device: true,
                ..route
            },
            Route {
                src: MemoryClass::Host,
                landing: MemoryClass::Host,
                ..route
            },
            Route {
                chosen: false,
                ..route
            },
        ] {
            assert_eq!(without_rdma(&quiet), None, "{quiet:?}");
        }
    }

    #[test]
    fn ucx_lanes_over_tcp_alone_warn_and_unknown_ones_do_not() {
        let lane = |t: &str, d: &str| TransportEntry {
            transport: t.into(),
            device: d.into(),
        };
        let over_tcp = EndpointLanes {
            lanes: Ok(vec![lane("tcp", "eth0"), lane("cuda_copy", "cuda")]),
            after_first_use: true,
        };
        let notes = lanes_notes("b", &Ok(over_tcp));
        let (label, text, json) = fact(&notes[0]);
        assert_eq!(label, "ucx lanes");
        assert_eq!(json["rma"], "emulated-over-tcp");
        assert_eq!(json["lanes"].as_array().map(Vec::len), Some(2));
        assert_eq!(json["lanes"][0]["device"], "eth0");
        assert!(
            text.starts_with("this node's endpoint to b: tcp/eth0"),
            "{text}"
        );
        let [_, Note::Warning(warning)] = &notes[..] else {
            panic!("a warning: {notes:?}");
        };
        assert!(
            warning.contains("go over tcp (software emulation"),
            "{warning}"
        );

        let rdma = EndpointLanes {
            lanes: Ok(vec![lane("rc_mlx5", "mlx5_0:1"), lane("tcp", "eth0")]),
            after_first_use: true,
        };
        let notes = lanes_notes("b", &Ok(rdma));
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert_eq!(fact(&notes[0]).2["rma"], "one-sided");

        let gpu_ipc = EndpointLanes {
            lanes: Ok(vec![lane("tcp", "lo"), lane("cuda_ipc", "cuda")]),
            after_first_use: true,
        };
        let notes = lanes_notes("b", &Ok(gpu_ipc));
        assert_eq!(fact(&notes[0]).2["rma"], "gpu-ipc-beside-tcp");
        let [_, Note::Warning(warning)] = &notes[..] else {
            panic!("a warning: {notes:?}");
        };
        assert!(warning.contains("unless UCX found NVLink"), "{warning}");

        let old = EndpointLanes {
            lanes: Err(LanesUnknown::NotInRelease {
                since: "1.14".into(),
                found: "1.13.1".into(),
            }),
            after_first_use: true,
        };
        let notes = lanes_notes("b", &Ok(old));
        assert_eq!(notes.len(), 1, "{notes:?}");
        let (_, text, json) = fact(&notes[0]);
        assert_eq!(json["rma"], "unknown");
        assert!(
            text.ends_with("unknown (UCX < 1.14: 1.13.1 cannot say)"),
            "{text}"
        );
        let notes = lanes_notes("b", &Err("no link".into()));
        assert_eq!(notes.len(), 1, "{notes:?}");
        let (_, text, json) = fact(&notes[0]);
        assert_eq!(json["rma"], "unknown");
        assert!(text.contains("no link"), "{text}");
    }
}
