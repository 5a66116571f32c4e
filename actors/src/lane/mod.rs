//! The same-host lane: device-memory sends to a peer process of this host, without a socket
//! or an actor hop. It is how ipc pulls contiguous device buffers, of every size.
//!
//! The socket path of an ipc send crosses eight thread hand-offs (caller → actor → I/O
//! thread → socket → the peer's I/O thread → its actor, and back for `Done`) and waits for a
//! device allocation through the domain's actor: about 110 µs per round trip on the H200,
//! 150 µs on the H100. The lane replaces that, for contiguous device buffers the routing
//! rules send over ipc by pull (and of at most `transport.ipc.lane_max` bytes), once the ipc
//! setup with the peer is done, with:
//!
//! - a ring of slots in shared memory ([`Ring`](ferry_transports::link::ring::Ring)), one
//!   per direction, made by the sender during the ipc setup and fetched by the receiver
//!   from the sender's fd-sharing socket;
//! - on the sender (`tx.rs`), the caller's own task exports the buffer and writes a
//!   [`LaneRecord`](ferry_transports::ipc::LaneRecord) into the next slot; a watcher
//!   thread sees the receiver finish it and completes the send (the receiver's outcome, or
//!   its reason, comes back in the slot);
//! - on the receiver (`rx.rs`), an issuing thread polls the ring and queues each buffer's
//!   copy (a batch's small ones as one gather), and a delivering thread waits for each copy
//!   and delivers the buffer to the inbox itself, in order, while the next batch is queued. A buffer of at most 64 KiB lands in
//!   memory allocated ahead (after the first such record, 4 buffers of 64 KiB from the
//!   receive tiers, topped up while the lane is idle); a larger one is reserved on the lane
//!   thread ([`reserve_now_in_tiers`](crate::allocator::reserve_now_in_tiers): no actor,
//!   the device allocation made there), or, when no tier can grant it now, waits for
//!   memory like any receive. What the lane delivered and the application did not take
//!   yet counts against the peer's share (`limits.peer_inbound_bytes`): past it, the lane
//!   waits.
//!
//! The threads spin for `transport.ipc.lane_spin` after the last record, then park (on a
//! futex in the ring, or the delivering thread on its channel): a busy lane makes no system
//! call, an idle one costs nothing.
//!
//! **Order** (`order.rs`). A peer's buffers are delivered in send order whichever path
//! carries them: [`Order`] lets a lane send start only while nothing to that peer goes the
//! slow way, and makes a slow send wait until the lane sends before it completed (a lane
//! send completes once the buffer is in the receiver's inbox). On the receiver, a lane
//! record is delivered only once every slow transfer from that peer that completed before
//! it was delivered too ([`Undelivered`]).
//!
//! **Failure.** A sender whose deadline passes gets `DeadlineExceeded` and no buffer: the
//! receiver may still read it, so the watcher keeps it until the record is finished or the
//! lane closes (then it is freed; the peer unmaps it first, like any exported buffer).
//! When either side's session ends the ring is closed; sends not yet finished by the
//! receiver fail with `PeerLost` and get their buffer back.

mod order;
mod rx;
mod tx;

use std::time::Duration;

pub use order::{Order, OrderGuard, Pending, Undelivered};
pub use rx::{AHEAD_LEN, LaneRx, RxContext};
pub use tx::LaneTx;

/// Records in flight per lane.
pub const LANE_SLOTS: u32 = 64;
/// Bytes per slot: a record (an export and a lease, about 200 bytes) or a reason.
pub const LANE_SLOT_LEN: u32 = 512;
/// How long a parked lane thread sleeps before it looks at its stop flag again.
const PARK: Duration = Duration::from_millis(20);

/// The lane's settings (`transport.ipc.lane_max`, `transport.ipc.lane_spin`).
#[derive(Debug, Clone, Copy)]
pub struct LaneSettings {
    /// Largest send this node puts on the lane; 0 turns the lane off. (A receiver takes
    /// records of any size.)
    pub max: usize,
    /// How long a lane thread spins for the next record before it parks.
    pub spin: Duration,
    /// Largest record the receiver copies with the gather kernel (a batch's records in one
    /// launch per stream); 0: every copy by the copy engine.
    pub gather_max: usize,
}

/// Which sizes of contiguous device buffer the routing rules send to the peer over ipc by
/// pull: the lane carries those and no other. Rules match sizes by ranges, so the answer
/// is constant between their bounds: one entry per range, by its first size.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaneRoutes {
    /// (first size of a range, whether the lane carries it), by first size, from 0.
    ranges: Vec<(u64, bool)>,
}

impl LaneRoutes {
    /// The bounds where a rule starts or stops matching (`min_bytes`, `max_bytes + 1`),
    /// from 0: ask the route at each, then [`Self::new`].
    pub fn bounds(rules: &[ferry_config::Rule]) -> Vec<u64> {
        let mut bounds: Vec<u64> = std::iter::once(0)
            .chain(rules.iter().map(|r| r.min_bytes))
            .chain(
                rules
                    .iter()
                    .filter_map(|r| r.max_bytes.and_then(|m| m.checked_add(1))),
            )
            .collect();
        bounds.sort_unstable();
        bounds.dedup();
        bounds
    }

    /// The ranges from their first sizes (as [`Self::bounds`] gave them) and whether the
    /// route at each takes the lane.
    pub fn new(ranges: Vec<(u64, bool)>) -> Self {
        Self { ranges }
    }

    /// Whether a send of `bytes` takes the lane.
    pub fn takes(&self, bytes: u64) -> bool {
        let i = self.ranges.partition_point(|(start, _)| *start <= bytes);
        i > 0 && self.ranges[i - 1].1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_routes_follow_the_rules_size_ranges() {
        let rule = |min: u64, max: Option<u64>| ferry_config::Rule {
            min_bytes: min,
            max_bytes: max,
            ..ferry_config::Rule::same_host_gpu()
        };
        let rules = [rule(4096, Some(1 << 20)), rule(0, None)];
        let bounds = LaneRoutes::bounds(&rules);
        assert_eq!(bounds, vec![0, 4096, (1 << 20) + 1]);
        // Say the first rule sends by push: the lane carries what the second rule covers.
        let routes = LaneRoutes::new(bounds.into_iter().map(|b| (b, b != 4096)).collect());
        for (bytes, lane) in [
            (1, true),
            (4095, true),
            (4096, false),
            (1 << 20, false),
            ((1 << 20) + 1, true),
            (u64::MAX, true),
        ] {
            assert_eq!(routes.takes(bytes), lane, "{bytes} bytes");
        }
        assert!(
            !LaneRoutes::default().takes(8),
            "no routes: nothing takes the lane"
        );
    }
}
