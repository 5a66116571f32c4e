//! Per-node counters of what the links refused, shared by every link of the node.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::wire::FrameError;

/// Counts handshakes refused and frames accepted or refused, for every link of one node.
///
/// Share one instance through an `Arc` (it is cheap to bump from any task). Each
/// `record_*` method also bumps the matching `metrics` counter
/// (`ferry_auth_failures_total`, `ferry_frames_rejected_total{reason}`), so exporters see
/// the same numbers.
#[derive(Debug, Default)]
pub struct LinkCounters {
    auth_failures: AtomicU64,
    frames_ok: AtomicU64,
    frames_rejected: [AtomicU64; FrameError::REASONS.len()],
}

impl LinkCounters {
    /// Fresh counters, all zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Handshakes refused because of the peer: bad preamble, wrong role, wrong secret,
    /// version mismatch, timeout, or a bad first frame.
    pub fn auth_failures(&self) -> u64 {
        self.auth_failures.load(Ordering::Relaxed)
    }

    /// Frames received and accepted on established links.
    pub fn frames_ok(&self) -> u64 {
        self.frames_ok.load(Ordering::Relaxed)
    }

    /// Frames refused with this [`FrameError::reason`] label (`"crc"`, `"too_long"`, ...);
    /// 0 for a label that does not exist.
    pub fn frames_rejected(&self, reason: &str) -> u64 {
        FrameError::REASONS
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.frames_rejected[i].load(Ordering::Relaxed))
    }

    /// Frames refused, all reasons together.
    pub fn frames_rejected_total(&self) -> u64 {
        self.frames_rejected
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    /// Counts one refused handshake.
    pub fn record_auth_failure(&self) {
        self.auth_failures.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("ferry_auth_failures_total").increment(1);
    }

    /// Counts one refused frame under its reason.
    pub fn record_rejected(&self, error: &FrameError) {
        self.frames_rejected[error.reason_index()].fetch_add(1, Ordering::Relaxed);
        metrics::counter!("ferry_frames_rejected_total", "reason" => error.reason()).increment(1);
    }

    /// Counts one accepted frame.
    pub fn record_frame_ok(&self) {
        self.frames_ok.fetch_add(1, Ordering::Relaxed);
    }
}
