//! The checks, each `async fn(Combo, first_of_its_transport)`, and what they share.

mod blocks;
mod data;
mod failure;
mod fetch;
mod memory;
mod regions;

use std::time::Duration;

use ferry::{Buffer, MemoryKind, Node, Received};

use crate::combos::Combo;
use crate::common::eventually;
use crate::pair::Pair;

pub use blocks::block_lists_arrive_packed;
pub use data::{
    every_layout_arrives_packed, order_holds_under_backpressure,
    order_per_peer_holds_under_mixed_sizes, sizes_arrive_byte_exact,
};
pub use failure::{
    corrupt_frame_ends_the_link_and_its_transfer, deadline_then_killed_peer,
    dropped_receives_lose_nothing, dropped_sends_still_arrive,
};
pub use fetch::fetches_cross_once;
pub use memory::full_tier_spills_and_promotes_back;
pub use regions::{
    one_sided_deadline_then_killed_peer, regions_read_and_write_block_lists,
    writes_add_up_past_the_inbound_share,
};

/// `len` bytes derived from `seed`.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    ferry::cuda::pattern::pattern(seed, len)
}

/// The checksum failure messages show.
pub fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// A buffer of `kind` memory holding `bytes`.
pub async fn filled(node: &Node, kind: MemoryKind, bytes: &[u8]) -> Buffer {
    let mut buffer = node
        .alloc(kind, bytes.len())
        .await
        .unwrap_or_else(|e| panic!("alloc {} bytes of {kind}: {e}", bytes.len()));
    buffer.write(0, bytes).expect("fill the buffer");
    buffer
}

/// Asserts that `got`, an echo of `len` bytes, holds `want` and came as the combination
/// says: over the transport (or tcp, for an echo the transport cannot read), into the
/// destination memory.
pub fn assert_echo(combo: &Combo, got: &Received, want: &[u8], what: &str) {
    let expected = if combo.echo_returns_over_it() {
        combo.name()
    } else {
        "tcp"
    };
    assert_eq!(
        got.transport.as_str(),
        expected,
        "{combo}: {what} came back over"
    );
    assert_eq!(
        got.buffer.kind(),
        combo.dst_kind(),
        "{combo}: {what} landed in"
    );
    assert_eq!(got.buffer.len(), want.len(), "{combo}: {what}: length");
    let bytes = got.buffer.to_vec().expect("read the echo");
    assert!(
        bytes == want,
        "{combo}: {what}: other bytes came back (crc {:08x}, want {:08x})",
        crc(&bytes),
        crc(want)
    );
}

/// Asserts that the far node, when it runs in this process, saw every transfer arrive over
/// the transport in the destination memory.
pub fn assert_forward_legs(pair: &Pair) {
    let combo = &pair.combo;
    for seen in pair.seen().unwrap_or_default() {
        assert_eq!(
            seen.transport,
            combo.name(),
            "{combo}: tag {} arrived over",
            seen.tag
        );
        assert_eq!(
            seen.kind,
            combo.dst_kind(),
            "{combo}: tag {} landed in",
            seen.tag
        );
    }
}

/// What this node had granted in each memory a combination touches.
pub struct Baseline {
    granted: Vec<(MemoryKind, u64)>,
}

fn watched(combo: &Combo) -> Vec<MemoryKind> {
    let mut kinds = vec![MemoryKind::Host, MemoryKind::PinnedHost];
    if combo.touches_device() {
        kinds.push(MemoryKind::Device(0));
    }
    kinds
}

async fn granted(node: &Node, kind: MemoryKind) -> u64 {
    node.memory(kind)
        .await
        .expect("memory stats")
        .budget
        .granted
}

impl Baseline {
    pub async fn take(node: &Node, combo: &Combo) -> Self {
        let mut granted_now = Vec::new();
        for kind in watched(combo) {
            granted_now.push((kind, granted(node, kind).await));
        }
        Self {
            granted: granted_now,
        }
    }

    /// Asserts that every memory is back at the baseline, waiting for it a little (a
    /// buffer a peer held is freed once the peer let go, or its lease ran out: 1 s here);
    /// GPU memory may also hold what a fast lane keeps for the link's life.
    pub async fn assert_back(&self, node: &Node, combo: &Combo) {
        let limit = if combo.touches_device() {
            Duration::from_secs(5)
        } else {
            Duration::from_secs(2)
        };
        // The lane's receiver keeps 4 receive buffers of 64 KiB allocated ahead from its
        // first small record until the link goes (docs/CONFIG.md): GPU memory that the
        // check's traffic may have allocated for the link's life.
        let lane_ahead = if node.config().transport.ipc.lane_max > 0 {
            4 * (64 << 10)
        } else {
            0
        };
        let back = eventually(limit, async || {
            for &(kind, then) in &self.granted {
                let now = granted(node, kind).await;
                let lane = matches!(kind, MemoryKind::Device(_)) && now == then + lane_ahead;
                if now != then && !lane {
                    return false;
                }
            }
            true
        })
        .await;
        if !back {
            let mut now = Vec::new();
            for &(kind, _) in &self.granted {
                now.push((kind, granted(node, kind).await));
            }
            panic!(
                "{combo}: memory not back after {limit:?}: granted {now:?}, at the start {:?}",
                self.granted
            );
        }
    }
}
