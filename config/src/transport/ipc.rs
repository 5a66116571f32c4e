//! `[transport.ipc]`: the ipc transport's settings, their defaults and their checks.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::units::{duration, duration_option, size};
use crate::validate::{Violation, fail};

/// `[transport.ipc]`: ipc transport tuning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IpcTuning {
    /// Largest device buffer this node sends to a same-host peer on the lane (a
    /// shared-memory ring and a thread per direction instead of the socket and the actors):
    /// contiguous buffers the rules send over ipc by pull. Default 1 TiB: every size; `0`
    /// turns the lane off. A receiver takes records of any size; it keeps 4 buffers of
    /// 64 KiB allocated ahead per peer once a small one arrived.
    #[serde(with = "size")]
    pub lane_max: u64,
    /// How long a lane thread spins for the next record before it sleeps (a busy lane then
    /// makes no system call). Default `"100us"`; `0` sleeps at once.
    #[serde(with = "duration")]
    pub lane_spin: Duration,
    /// Largest lane record a receiver copies with ferry's copy kernel (the records of one
    /// batch into one GPU in one launch) rather than the copy engine (a copy each, a fixed
    /// cost of several microseconds of CPU per copy from a peer's memory; no SMs used).
    /// Default `"1 MiB"`; `0`: every copy by the copy engine. At most 1 GiB.
    #[serde(with = "size")]
    pub gather_max: u64,
    /// The old name of `node.recv_spin` (it drives every `recv()`, not only ipc's), read
    /// for one release: loading moves its value to `node.recv_spin` and notes where it was
    /// set ([`Config::deprecated_keys`](crate::Config::deprecated_keys)); setting both is
    /// an error. `None` in every loaded configuration, never written.
    #[serde(
        default,
        with = "duration_option",
        skip_serializing_if = "Option::is_none"
    )]
    pub(crate) recv_spin: Option<Duration>,
}

impl Default for IpcTuning {
    fn default() -> Self {
        IpcTuning {
            lane_max: 1 << 40,
            lane_spin: Duration::from_micros(100),
            gather_max: 1 << 20,
            recv_spin: None,
        }
    }
}

impl IpcTuning {
    /// The checks of `[transport.ipc]`.
    pub(crate) fn check(&self) -> Result<(), Violation> {
        if self.gather_max > 1 << 30 {
            return fail("transport.ipc.gather_max", "must be at most 1 GiB");
        }
        Ok(())
    }
}
