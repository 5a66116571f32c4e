//! `[transport.staged]`: the staged transport's settings, their defaults and their checks.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::MIN_CHUNK;
use crate::units::{AutoSize, duration, format_size, size};
use crate::validate::{Violation, fail};

/// `[transport.staged]`: the staged transport (device → pinned host → link → pinned host
/// → device, pipelined chunk by chunk).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StagedTuning {
    /// Staging slots per direction and peer: chunks in flight between the sender's copy
    /// out and the receiver's copy in. Default 8; 2 to 64.
    pub slots: u32,
    /// Bytes per chunk (and per slot). Default `"auto"`: picked once per process at the
    /// first staged send, from a short measurement of the copy rate at a few sizes (the
    /// smallest within 3% of the best); else 64 KiB to 64 MiB, a multiple of 8 bytes. `slots × chunk` is at most
    /// 1 GiB.
    pub chunk: AutoSize,
    /// Between processes of one host, the slots live in shared memory (a sealed memfd
    /// registered with the GPU driver as pinned on both sides), and a chunk moves by one
    /// copy out and one copy in, without the socket. Default true; false sends every
    /// chunk over the link, as to another host.
    pub shared_memory: bool,
    /// Payload bytes per data frame when the chunks go over the link (another host, or
    /// `shared_memory = false`). Default `"1 MiB"`; at least 4 KiB, and 64 KiB less than
    /// `limits.max_frame` at most.
    #[serde(with = "size")]
    pub link_chunk: u64,
    /// How long a staging thread spins for the next chunk or free slot before it sleeps on
    /// a futex. Longer than one chunk's copy, so a busy transfer never pays a wake-up per
    /// chunk. Default `"2ms"`; at most 100 ms.
    #[serde(with = "duration")]
    pub spin: Duration,
}

impl Default for StagedTuning {
    fn default() -> Self {
        StagedTuning {
            slots: 8,
            chunk: AutoSize::Auto,
            shared_memory: true,
            link_chunk: 1 << 20,
            spin: Duration::from_millis(2),
        }
    }
}

impl StagedTuning {
    /// The checks of `[transport.staged]` alone (`link_chunk` against `limits.max_frame`
    /// is checked with the limits).
    pub(crate) fn check(&self) -> Result<(), Violation> {
        let staged = self;
        if staged.link_chunk < MIN_CHUNK {
            return fail(
                "transport.staged.link_chunk",
                format!(
                    "{} is below the minimum of 4 KiB",
                    format_size(staged.link_chunk)
                ),
            );
        }
        if staged.spin > std::time::Duration::from_millis(100) {
            return fail("transport.staged.spin", "must be at most 100ms");
        }
        if !(2..=64).contains(&staged.slots) {
            return fail(
                "transport.staged.slots",
                format!("{} slots: must be 2 to 64", staged.slots),
            );
        }
        if let crate::AutoSize::Bytes(chunk) = staged.chunk {
            if !(64 << 10..=64 << 20).contains(&chunk) || chunk % 8 != 0 {
                return fail(
                    "transport.staged.chunk",
                    format!(
                        "{}: must be \"auto\" or 64 KiB to 64 MiB, a multiple of 8 bytes",
                        format_size(chunk)
                    ),
                );
            }
            if chunk * u64::from(staged.slots) > 1 << 30 {
                return fail(
                    "transport.staged.chunk",
                    format!(
                        "{} slots of {} make more than 1 GiB of staging per peer",
                        staged.slots,
                        format_size(chunk)
                    ),
                );
            }
        }
        Ok(())
    }
}
