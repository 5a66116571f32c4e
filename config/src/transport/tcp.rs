//! `[transport.tcp]`: the tcp transport's settings, their defaults and their checks.

use serde::{Deserialize, Serialize};

use super::MIN_CHUNK;
use crate::units::{format_size, size};
use crate::validate::{Violation, fail};

/// Largest accepted `transport.tcp.eager_max`.
const MAX_EAGER: u64 = 16 << 20;

/// `[transport.tcp]`: TCP transport tuning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TcpTuning {
    /// Payload bytes per data frame. Default `"1 MiB"`; at least 4 KiB, and 64 KiB less than
    /// `limits.max_frame` at most.
    #[serde(with = "size")]
    pub chunk_size: u64,
    /// The largest transfer this node takes eagerly from a peer: the sender writes the
    /// bytes right behind the offer, within this node's eager credit, instead of waiting
    /// for a grant. Default `"64 KiB"`; `0` takes none (every offer waits for its grant).
    /// At most `eager_credit` and 16 MiB.
    #[serde(with = "size")]
    pub eager_max: u64,
    /// The bytes of eager transfers one peer may have on their way to this node at once
    /// (sent, not yet answered). Default `"1 MiB"`.
    #[serde(with = "size")]
    pub eager_credit: u64,
}

impl Default for TcpTuning {
    fn default() -> Self {
        TcpTuning {
            chunk_size: 1 << 20,
            eager_max: 64 << 10,
            eager_credit: 1 << 20,
        }
    }
}

impl TcpTuning {
    /// The checks of `[transport.tcp]` alone (its frame sizes against `limits.max_frame`
    /// are checked with the limits).
    pub(crate) fn check(&self) -> Result<(), Violation> {
        let tcp = self;
        if tcp.chunk_size < MIN_CHUNK {
            return fail(
                "transport.tcp.chunk_size",
                format!(
                    "{} is below the minimum of 4 KiB",
                    format_size(tcp.chunk_size)
                ),
            );
        }
        if tcp.eager_max > tcp.eager_credit || tcp.eager_max > MAX_EAGER {
            return fail(
                "transport.tcp.eager_max",
                format!(
                    "{} is above transport.tcp.eager_credit ({}) or 16 MiB",
                    format_size(tcp.eager_max),
                    format_size(tcp.eager_credit)
                ),
            );
        }
        Ok(())
    }
}
