//! `[transport.shm]`: the shm transport's settings, their defaults and their checks.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::units::{duration, format_size, size};
use crate::validate::{Violation, fail};

/// Smallest accepted `transport.shm.segment_size`.
const MIN_SEGMENT: u64 = 1 << 20;
/// Largest accepted `transport.shm.segment_size`.
const MAX_SEGMENT: u64 = 1 << 40;

/// `[transport.shm]`: host memory between processes of one host through a shared-memory
/// pool the node's host buffers come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShmTuning {
    /// Whether the node serves shm: its host buffers come from the pool, and same-host
    /// peers read them in place. Default true; false: host memory comes from the heap and
    /// the default rule's next transport, tcp, sends it.
    pub enabled: bool,
    /// Bytes of each shared-memory segment of the pool (a sealed memfd, mapped once by this
    /// node and once by each same-host peer that pulls from it). A buffer larger than this
    /// has a segment of its own. Default `"64 MiB"`; 1 MiB to 1 TiB.
    #[serde(with = "size")]
    pub segment_size: u64,
    /// The most bytes of segments the pool makes; host buffers past it come from the heap
    /// and go by the rule's next transport. Segments are never shrunk while the node runs
    /// (a peer may map them), so this bounds the shared memory the pool holds at its
    /// high-water mark. Default `"4 GiB"`; at least `segment_size`.
    #[serde(with = "size")]
    pub max_bytes: u64,
    /// Largest host buffer this node sends to a same-host peer on the shm lane (a ring
    /// both processes map: no session round trip) when the rules send it over shm by pull;
    /// larger ones take the session. `"0 B"` turns the lane off. Default `"1 MiB"` (256 KiB until 2026-12-02).
    #[serde(with = "size")]
    pub lane_max: u64,
    /// How long a lane thread spins for the next record before it sleeps. Default
    /// `"100us"`; at most 1 s.
    #[serde(with = "duration")]
    pub lane_spin: Duration,
}

impl Default for ShmTuning {
    fn default() -> Self {
        ShmTuning {
            enabled: true,
            segment_size: 64 << 20,
            max_bytes: 4 << 30,
            lane_max: 1 << 20,
            lane_spin: Duration::from_micros(100),
        }
    }
}

impl ShmTuning {
    /// The checks of `[transport.shm]`.
    pub(crate) fn check(&self) -> Result<(), Violation> {
        if !(MIN_SEGMENT..=MAX_SEGMENT).contains(&self.segment_size) {
            return fail(
                "transport.shm.segment_size",
                format!(
                    "{} is outside 1 MiB to 1 TiB",
                    format_size(self.segment_size)
                ),
            );
        }
        if self.max_bytes < self.segment_size {
            return fail(
                "transport.shm.max_bytes",
                format!(
                    "{} is below transport.shm.segment_size ({})",
                    format_size(self.max_bytes),
                    format_size(self.segment_size)
                ),
            );
        }
        if self.lane_spin > Duration::from_secs(1) {
            return fail(
                "transport.shm.lane_spin",
                format!("{:?} is above 1s", self.lane_spin),
            );
        }
        Ok(())
    }
}
