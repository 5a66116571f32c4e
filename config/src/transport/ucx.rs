//! `[transport.ucx]`: the ucx transport's settings, their defaults and their checks.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::names::config_names;
use crate::units::duration;
use crate::validate::{Violation, fail};

/// `[transport.ucx]`: the ucx transport (UCX's UCP, loaded at run time; RDMA where the
/// machine has it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UcxTuning {
    /// Whether this node serves ucx: `"auto"` (the default) when UCX loads and the machine
    /// has an RDMA device (`/sys/class/infiniband`); `"on"` whenever UCX loads (over tcp
    /// too: UCX emulates its reads there, slower than ferry's own tcp); `"off"` never.
    pub enabled: UcxMode,
    /// The `libucp.so` to load. Default: the environment variable `FERRY_UCX_LIBRARY`,
    /// else the system's `libucp.so.0`. Both ends must load the same UCX build.
    pub library: Option<PathBuf>,
    /// UCX's transport list (`UCX_TLS`), e.g. `"rc,cuda_copy,cuda_ipc,tcp"`. Default:
    /// UCX's own choice. It must include `tcp` or an RDMA transport (`rc`, `dc`, `ud`):
    /// ferry needs UCX to notice a dead peer.
    pub tls: Option<String>,
    /// The network devices UCX may use (`UCX_NET_DEVICES`), e.g. `"mlx5_0:1"` or `"lo"`.
    /// Default: UCX's own choice (all).
    pub net_devices: Option<String>,
    /// Further UCX settings, each named without its `UCX_` prefix (`RNDV_THRESH = "64k"`).
    /// An unknown name or bad value keeps ucx from starting (the log and `ferry explain`
    /// say why). Default none.
    pub env: std::collections::BTreeMap<String, String>,
    /// How long UCX's progress thread polls after the last operation before it sleeps.
    /// Default `"50us"`; at most 10 ms.
    #[serde(with = "duration")]
    pub progress_spin: Duration,
    /// The longest one UCX read may take before the peer's endpoint is closed and its
    /// transfers fail. Default `"30s"`; at least 100 ms.
    #[serde(with = "duration")]
    pub op_timeout: Duration,
    /// Whether this node lends its memory to a peer's ucx push (a rule's `direction =
    /// "push"`) where UCX would emulate the peer's writes in software over tcp (no RDMA,
    /// shared-memory or, for device memory, cuda_ipc lane). There, a writer that dies in
    /// the middle of its writes can abort this process inside UCX (measured with UCX 1.13
    /// and 1.22). Default `false`: such pushes stream over ferry's link instead, said once
    /// per peer in the log.
    pub emulated_push: bool,
}

impl Default for UcxTuning {
    fn default() -> Self {
        UcxTuning {
            enabled: UcxMode::Auto,
            library: None,
            tls: None,
            net_devices: None,
            env: std::collections::BTreeMap::new(),
            progress_spin: Duration::from_micros(50),
            op_timeout: Duration::from_secs(30),
            emulated_push: false,
        }
    }
}

/// Whether a node serves the ucx transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum UcxMode {
    /// When UCX loads and the machine has an RDMA device.
    #[default]
    Auto,
    /// Whenever UCX loads.
    On,
    /// Never.
    Off,
}

config_names! {
    UcxMode { Auto => "auto", On => "on", Off => "off" }
}

impl UcxTuning {
    /// The checks of `[transport.ucx]`.
    pub(crate) fn check(&self) -> Result<(), Violation> {
        let ucx = self;
        if ucx.progress_spin > std::time::Duration::from_millis(10) {
            return fail("transport.ucx.progress_spin", "must be at most 10ms");
        }
        if ucx.op_timeout < std::time::Duration::from_millis(100) {
            return fail("transport.ucx.op_timeout", "must be at least 100ms");
        }
        if let Some(tls) = &ucx.tls {
            // An exclusion list (`^sm`) keeps everything else, tcp or RDMA included; a plain
            // list must name one (`rc`, `rc_mlx5`, `dc_x`, `ud_verbs`, `ib`, `tcp`, `all`).
            let reaches = tls.trim_start().starts_with('^')
                || tls.split(',').map(str::trim).any(|t| {
                    let family = t.split('_').next().unwrap_or(t);
                    matches!(family, "all" | "tcp" | "rc" | "dc" | "ud" | "ib")
                });
            if !reaches {
                return fail(
                    "transport.ucx.tls",
                    format!(
                        "{tls:?} has no transport that notices a dead peer: include tcp or an RDMA transport (rc, dc, ud)"
                    ),
                );
            }
        }
        Ok(())
    }
}
