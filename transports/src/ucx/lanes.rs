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

use ucx_sys::{TransportEntry, UcxError};

/// UCT transports that read and write a peer's memory themselves (RDMA NICs, CUDA/ROCm
/// IPC, kernel-assisted or mapped shared memory, the loopback `self`), by name prefix.
/// `ud` has no RDMA: UCX runs RMA over its messages, but on the NIC, not over tcp.
const ONE_SIDED: &[&str] = &[
    "rc", "dc", "ud", "gga", "cuda_ipc", "rocm_ipc", "cma", "knem", "xpmem", "sysv", "posix",
    "self",
];

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
            } else if name == "tcp" {
                tcp = true;
            } else if !LOCAL_COPY.contains(&name) {
                once(&mut unknown);
            }
        }
        if !via.is_empty() {
            RmaPath::OneSided { via }
        } else if tcp && unknown.is_empty() {
            RmaPath::EmulatedOverTcp
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
            RmaPath::Unrecognised { names } if names.is_empty() => {
                f.write_str("no lane that reaches the peer")
            }
            RmaPath::Unrecognised { names } => {
                write!(f, "transports ferry does not judge: {}", names.join(", "))
            }
        }
    }
}

/// An endpoint's lanes, as UCX reported them, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointLanes {
    /// Each lane's transport and device, in UCX's lane order; or why UCX cannot name them
    /// (`unknown (UCX < 1.14)`: 1.13 has no such query).
    pub lanes: Result<Vec<TransportEntry>, String>,
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
            UcxError::NotInRelease { since, found, .. } => {
                format!(
                    "unknown (UCX < {}.{}: {found} cannot say)",
                    since.major, since.minor
                )
            }
            other => format!("unknown ({other})"),
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

    /// Whether UCX emulates gets and puts over tcp on this endpoint.
    pub fn emulated(&self) -> bool {
        self.rma() == Some(RmaPath::EmulatedOverTcp)
    }
}

impl fmt::Display for EndpointLanes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lanes = match &self.lanes {
            Err(why) => return f.write_str(why),
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
            classify(&["tcp", "cuda_ipc", "cuda_copy"]),
            one_sided(&["cuda_ipc"])
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
