//! What an endpoint's lanes say about how UCX moves gets and puts to the peer: the
//! transports UCX picked for the endpoint (`ucp_ep_query`, UCX 1.14 and later), and
//! whether one of them reads and writes remote memory itself or UCX emulates RMA over tcp.
//!
//! Why it matters: where no lane can do one-sided RMA, UCX still completes every get and
//! put, silently, by emulating them in software over its tcp active messages: the reader
//! asks, the peer's progress thread copies the bytes into a reply. About 0.4 GB/s
//! (docs/PERFORMANCE.md: UCX 1.22 on the H100; NIXL measured 0.45 GB/s), hundreds of times
//! below RDMA or the copy engine. One way to get there without asking: UCX turns `cuda_ipc`
//! gets off when NVML reports no NVLink between the GPUs. ferry names the lanes and says
//! when this happens.

use std::fmt;
use std::sync::{Mutex, PoisonError};

use ucx_sys::{MemoryType, TransportEntry, UcxError};

/// UCT transports that read and write a peer's memory themselves (RDMA NICs,
/// kernel-assisted or mapped shared memory, the loopback `self`), by name prefix. `ud` has
/// no RDMA: UCX runs RMA over its messages, but on the NIC, not over tcp.
const ONE_SIDED: &[&str] = &[
    "rc", "dc", "ud", "gga", "cma", "knem", "xpmem", "sysv", "posix", "self",
];

/// UCT transports whose puts land in a peer's registered memory without the peer's UCX
/// applying them, by name prefix: RDMA writes (`rc`, `dc`, `gga`) anywhere, and kernel
/// copies into another process's memory (`cma`, `knem`, `xpmem`) for host memory. Not
/// `ud` (RMA over its messages, applied by the target), `sysv`/`posix` (they reach UCX's
/// own segments, not a registered buffer), `self`, nor `cuda_ipc` (UCX emulated device
/// puts over tcp on the H100, no NVLink).
const WRITES_HOST: &[&str] = &["rc", "dc", "gga", "cma", "knem", "xpmem"];

/// As [`WRITES_HOST`], for device memory: RDMA writes only (GPUDirect).
const WRITES_DEVICE: &[&str] = &["rc", "dc", "gga"];

/// GPU IPC transports: one-sided for device memory only, and for gets (ferry's reads) only
/// where UCX enables them: UCX 1.22 turns `cuda_ipc` gets off when NVML reports no NVLink
/// ("cuda-ipc get zcopy disabled as no nvlinks detected"; `UCX_CUDA_IPC_ENABLE_GET_ZCOPY`),
/// keeping the lane. The lane alone proves nothing about reads.
const GPU_IPC: &[&str] = &["cuda_ipc", "rocm_ipc"];

/// UCT transports that copy between memory types inside this process (host and GPU): a
/// lane of theirs carries nothing to the peer, so it neither proves nor rules out a fast
/// path. (`tcp` plus `cuda_copy` is the GPU-over-tcp case: still emulated.)
const LOCAL_COPY: &[&str] = &["cuda_copy", "rocm_copy", "gdr_copy", "ze_copy"];

/// How UCX moves gets and puts over an endpoint, judged from its lanes' transports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RmaPath {
    /// At least one lane's transport reads and writes remote memory itself; `via` names
    /// those transports (each once, in lane order).
    OneSided {
        /// The one-sided transports.
        via: Vec<String>,
    },
    /// Every lane that reaches the peer is `tcp`: UCX emulates gets and puts in software
    /// over its tcp messages (~0.4 GB/s measured).
    EmulatedOverTcp,
    /// `tcp` beside GPU IPC lanes (`via`) alone: reads of host memory are emulated over
    /// tcp, and reads of device memory too unless UCX enabled gets over `via` (NVLink
    /// between the GPUs).
    GpuIpcBesideTcp {
        /// The GPU IPC transports.
        via: Vec<String>,
    },
    /// Lanes of transports this list does not know (a newer UCX's, or none that reach the
    /// peer): not judged. `names` are the unknown ones (each once).
    Unrecognised {
        /// The transports not recognised.
        names: Vec<String>,
    },
}

impl RmaPath {
    /// Judges the transports of an endpoint's lanes (`tcp`, `rc_mlx5`, ...). Pure.
    pub fn classify<'a>(transports: impl IntoIterator<Item = &'a str>) -> RmaPath {
        let mut via: Vec<String> = Vec::new();
        let mut gpu_ipc: Vec<String> = Vec::new();
        let mut unknown: Vec<String> = Vec::new();
        let mut tcp = false;
        for name in transports {
            let once = |list: &mut Vec<String>| {
                if !list.iter().any(|n| n == name) {
                    list.push(name.to_string());
                }
            };
            if ONE_SIDED.iter().any(|p| name.starts_with(p)) {
                once(&mut via);
            } else if GPU_IPC.contains(&name) {
                once(&mut gpu_ipc);
            } else if name == "tcp" {
                tcp = true;
            } else if !LOCAL_COPY.contains(&name) {
                once(&mut unknown);
            }
        }
        if !via.is_empty() {
            RmaPath::OneSided { via }
        } else if !unknown.is_empty() {
            RmaPath::Unrecognised { names: unknown }
        } else if tcp && !gpu_ipc.is_empty() {
            RmaPath::GpuIpcBesideTcp { via: gpu_ipc }
        } else if tcp {
            RmaPath::EmulatedOverTcp
        } else if !gpu_ipc.is_empty() {
            // No tcp lane to emulate over: device memory goes over the IPC lane or fails.
            RmaPath::OneSided { via: gpu_ipc }
        } else {
            RmaPath::Unrecognised { names: unknown }
        }
    }
}

impl fmt::Display for RmaPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RmaPath::OneSided { via } => write!(f, "one-sided RMA over {}", via.join(", ")),
            RmaPath::EmulatedOverTcp => f.write_str(
                "gets and puts emulated in software over tcp (no RDMA, cuda_ipc or \
                 shared-memory lane): expect ~0.4 GB/s",
            ),
            RmaPath::GpuIpcBesideTcp { via } => write!(
                f,
                "reads of host memory emulated in software over tcp (~0.4 GB/s); reads of \
                 device memory over {} only where UCX found NVLink between the GPUs, else \
                 emulated over tcp too",
                via.join(", ")
            ),
            RmaPath::Unrecognised { names } if names.is_empty() => {
                f.write_str("no lane that reaches the peer")
            }
            RmaPath::Unrecognised { names } => {
                write!(f, "transports ferry does not judge: {}", names.join(", "))
            }
        }
    }
}

/// Why UCX could not name an endpoint's lanes.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LanesUnknown {
    /// The UCX loaded predates the query (`ucp_ep_query`'s transports came in 1.14).
    #[error("unknown (UCX < {since}: {found} cannot say)")]
    NotInRelease {
        /// The first release that answers.
        since: String,
        /// The release loaded.
        found: String,
    },
    /// The query failed.
    #[error("unknown ({0})")]
    Failed(#[source] UcxError),
}

/// An endpoint's lanes, as UCX reported them, and when.
#[derive(Debug, Clone)]
pub struct EndpointLanes {
    /// Each lane's transport and device, in UCX's lane order; or why UCX cannot name them
    /// (`unknown (UCX < 1.14)`: 1.13 has no such query).
    pub lanes: Result<Vec<TransportEntry>, LanesUnknown>,
    /// Whether they were asked after the endpoint's first operation completed (its wireup
    /// done); before, they are the lanes UCX chose when it created the endpoint.
    pub after_first_use: bool,
}

impl EndpointLanes {
    /// What `ucp_ep_query` answered, or why it could not.
    pub(crate) fn from_query(
        answer: Result<Vec<TransportEntry>, UcxError>,
        after_first_use: bool,
    ) -> Self {
        let lanes = answer.map_err(|e| match e {
            UcxError::NotInRelease { since, found, .. } => LanesUnknown::NotInRelease {
                since: format!("{}.{}", since.major, since.minor),
                found: found.to_string(),
            },
            other => LanesUnknown::Failed(other),
        });
        Self {
            lanes,
            after_first_use,
        }
    }

    /// How gets and puts move over the endpoint; `None` when the lanes are unknown.
    pub fn rma(&self) -> Option<RmaPath> {
        let lanes = self.lanes.as_ref().ok()?;
        Some(RmaPath::classify(
            lanes.iter().map(|l| l.transport.as_str()),
        ))
    }

    /// The warning to log when UCX emulates reads over tcp on this endpoint (`None` when it
    /// does not, or cannot say), about `reads`, e.g. "UCX reads from peer b".
    pub fn warning(&self, reads: &str) -> Option<String> {
        match self.rma()? {
            RmaPath::EmulatedOverTcp => Some(format!(
                "{reads} go over tcp (software emulation, no RDMA/cuda_ipc lane): expect \
                 ~0.4 GB/s"
            )),
            RmaPath::GpuIpcBesideTcp { via } => Some(format!(
                "{reads} go over tcp (software emulation) for host memory, and for device \
                 memory too unless UCX found NVLink between the GPUs (its one-sided lanes are \
                 {} alone, whose gets UCX turns off without NVLink): expect ~0.4 GB/s",
                via.join(", ")
            )),
            _ => None,
        }
    }

    /// Whether a peer's puts into memory of type `memory` here go one-sided (an RDMA
    /// write, or for host memory a kernel copy: `WRITES_HOST`, `WRITES_DEVICE`) rather
    /// than as messages this process's UCX applies: UCX 1.13 and 1.22 abort the target
    /// process when a writer dies in the middle of such emulated puts (`ucp_put_handler`
    /// meets the failed endpoint: `transports/tests/ucx_engine.rs`). `false` when the
    /// lanes are unknown (UCX < 1.14), and for a `cuda_ipc` lane: on the H100 (no NVLink)
    /// UCX 1.22's protocol table chose "software emulation, tcp/lo" for puts into device
    /// memory. The lanes are those of this node's endpoint to the writer, which UCX picks
    /// from the same transports as the writer's endpoint here.
    pub fn writes_one_sided(&self, memory: MemoryType) -> bool {
        let Ok(lanes) = &self.lanes else {
            return false;
        };
        let writers = match memory {
            MemoryType::Cuda => WRITES_DEVICE,
            _ => WRITES_HOST,
        };
        lanes
            .iter()
            .any(|l| writers.iter().any(|w| l.transport.starts_with(w)))
    }

    /// Whether UCX emulates gets and puts over tcp on this endpoint: for all of them
    /// ([`RmaPath::EmulatedOverTcp`]), or for those of host memory and perhaps device
    /// memory ([`RmaPath::GpuIpcBesideTcp`]).
    pub fn emulated(&self) -> bool {
        matches!(
            self.rma(),
            Some(RmaPath::EmulatedOverTcp | RmaPath::GpuIpcBesideTcp { .. })
        )
    }
}

impl fmt::Display for EndpointLanes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lanes = match &self.lanes {
            Err(why) => return write!(f, "{why}"),
            Ok(lanes) => lanes,
        };
        let names: Vec<String> = lanes
            .iter()
            .map(|l| format!("{}/{}", l.transport, l.device))
            .collect();
        write!(f, "{}", names.join(", "))?;
        if let Some(rma) = self.rma() {
            write!(f, ": {rma}")?;
        }
        Ok(())
    }
}

/// Where the progress thread reports an endpoint's lanes (twice at most: when it creates
/// the endpoint, and after its first operation completes) and the peer's handle reads them.
#[derive(Debug)]
pub(crate) struct LaneSlot(Mutex<EndpointLanes>);

impl LaneSlot {
    pub(crate) fn new(lanes: EndpointLanes) -> Self {
        Self(Mutex::new(lanes))
    }

    pub(crate) fn set(&self, lanes: EndpointLanes) {
        // A panic elsewhere while holding the lock leaves a whole value: take it anyway.
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = lanes;
    }

    pub(crate) fn get(&self) -> EndpointLanes {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classify(names: &[&str]) -> RmaPath {
        RmaPath::classify(names.iter().copied())
    }

    #[test]
    fn tcp_alone_is_emulated() {
        assert_eq!(classify(&["tcp"]), RmaPath::EmulatedOverTcp);
        assert_eq!(classify(&["tcp", "tcp"]), RmaPath::EmulatedOverTcp);
    }

    #[test]
    fn a_local_copy_lane_does_not_hide_tcp() {
        // GPU memory to a peer over tcp: UCX stages through host memory, still emulated.
        assert_eq!(
            classify(&["tcp", "cuda_copy", "gdr_copy"]),
            RmaPath::EmulatedOverTcp
        );
    }

    #[test]
    fn any_one_sided_lane_is_one_sided() {
        let one_sided = |via: &[&str]| RmaPath::OneSided {
            via: via.iter().map(ToString::to_string).collect(),
        };
        assert_eq!(classify(&["rc_mlx5", "tcp"]), one_sided(&["rc_mlx5"]));
        assert_eq!(
            classify(&["dc_mlx5", "ud_mlx5"]),
            one_sided(&["dc_mlx5", "ud_mlx5"])
        );
        assert_eq!(
            classify(&["rc_mlx5", "cuda_ipc", "tcp"]),
            one_sided(&["rc_mlx5"])
        );
        assert_eq!(
            classify(&["rc_verbs", "rc_verbs"]),
            one_sided(&["rc_verbs"])
        );
        for shm in ["sysv", "posix", "cma", "knem", "xpmem", "self"] {
            assert_eq!(classify(&["tcp", shm]), one_sided(&[shm]), "{shm}");
        }
    }

    #[test]
    fn a_cuda_ipc_lane_beside_tcp_does_not_prove_reads_one_sided() {
        // UCX keeps the cuda_ipc lane but turns its gets off without NVLink (NIXL's case).
        let path = classify(&["tcp", "cuda_ipc", "cuda_copy"]);
        assert_eq!(
            path,
            RmaPath::GpuIpcBesideTcp {
                via: vec!["cuda_ipc".into()]
            }
        );
        assert!(
            path.to_string().contains("only where UCX found NVLink"),
            "{path}"
        );
        let lanes = EndpointLanes {
            lanes: Ok(["tcp", "cuda_ipc"]
                .map(|t| TransportEntry {
                    transport: t.into(),
                    device: "x".into(),
                })
                .to_vec()),
            after_first_use: true,
        };
        assert!(lanes.emulated());
        // Without tcp there is nothing to emulate over.
        assert_eq!(
            classify(&["cuda_ipc"]),
            RmaPath::OneSided {
                via: vec!["cuda_ipc".into()]
            }
        );
    }

    #[test]
    fn writes_are_one_sided_only_where_no_target_applies_them() {
        let lanes = |names: &[&str]| EndpointLanes {
            lanes: Ok(names
                .iter()
                .map(|t| TransportEntry {
                    transport: (*t).into(),
                    device: "x".into(),
                })
                .collect()),
            after_first_use: true,
        };
        let (host, cuda) = (MemoryType::Host, MemoryType::Cuda);
        for memory in [host, cuda] {
            assert!(!lanes(&["tcp"]).writes_one_sided(memory));
            assert!(!lanes(&["tcp", "cuda_copy"]).writes_one_sided(memory));
            assert!(lanes(&["rc_mlx5", "tcp"]).writes_one_sided(memory));
            assert!(lanes(&["dc_mlx5"]).writes_one_sided(memory));
            // cuda_ipc: UCX emulated puts into device memory (H100, 1.22, no NVLink).
            assert!(!lanes(&["tcp", "cuda_ipc"]).writes_one_sided(memory));
            // ud's RMA runs over its messages; posix/sysv reach UCX's own segments.
            for name in ["ud_mlx5", "ud_verbs", "posix", "sysv", "self", "srd"] {
                assert!(!lanes(&["tcp", name]).writes_one_sided(memory), "{name}");
            }
        }
        // A kernel copy writes host memory, not device memory.
        assert!(lanes(&["tcp", "cma"]).writes_one_sided(host));
        assert!(!lanes(&["tcp", "cuda_ipc", "cma"]).writes_one_sided(cuda));
        // Lanes UCX cannot name (1.13): not lent.
        let unknown = EndpointLanes {
            lanes: Err(LanesUnknown::NotInRelease {
                since: "1.14".into(),
                found: "1.13.1".into(),
            }),
            after_first_use: true,
        };
        assert!(!unknown.writes_one_sided(MemoryType::Host));
    }

    #[test]
    fn unknown_transports_are_not_judged() {
        assert_eq!(
            classify(&["tcp", "srd"]),
            RmaPath::Unrecognised {
                names: vec!["srd".into()]
            }
        );
        assert_eq!(
            classify(&["cuda_copy"]),
            RmaPath::Unrecognised { names: vec![] }
        );
        assert_eq!(classify(&[]), RmaPath::Unrecognised { names: vec![] });
        // A name that merely contains "tcp" is not tcp.
        assert!(matches!(
            classify(&["tcp_sockcm"]),
            RmaPath::Unrecognised { .. }
        ));
    }

    #[test]
    fn lanes_say_what_they_are() {
        let lanes = EndpointLanes {
            lanes: Ok(vec![TransportEntry {
                transport: "tcp".into(),
                device: "lo".into(),
            }]),
            after_first_use: true,
        };
        assert!(lanes.emulated());
        let text = lanes.to_string();
        assert!(text.starts_with("tcp/lo: gets and puts emulated"), "{text}");
        assert!(text.contains("~0.4 GB/s"), "{text}");

        let old = EndpointLanes::from_query(
            Err(UcxError::NotInRelease {
                what: "ucp_ep_query",
                since: ucx_sys::result::EP_TRANSPORTS_SINCE,
                found: ucx_sys::Version {
                    major: 1,
                    minor: 13,
                    release: 1,
                },
            }),
            false,
        );
        assert_eq!(old.rma(), None);
        assert!(!old.emulated());
        assert_eq!(old.to_string(), "unknown (UCX < 1.14: 1.13.1 cannot say)");
    }
}
