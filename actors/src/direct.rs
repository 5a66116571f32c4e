//! A peer's routes as its coordinator last worked them out, for [`Node::send`] to take
//! without a trip through the coordinator's mailbox: the peer's transfer actor and, per
//! source memory and range of sizes, the transport, direction and fallback a send takes.
//!
//! The coordinator publishes a peer's table once its link is up (its hello known) and
//! again when the ipc setup with it settles, and withdraws it when the session ends or is
//! replaced. Routing is a pure function of the rules, the declarations and what the peer
//! said ([`crate::core::route`]); rules match sizes by ranges, so one route per range
//! answers every size.
//!
//! [`Node::send`]: crate::node::Node::send

use actix::Addr;
use ferry_config::{MemoryClass, TransportName};
use ferry_transports::wire::WireDirection;

use crate::peer::{PeerClass, TransferActor};

/// The route one send takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    /// The transport.
    pub transport: TransportName,
    /// Its direction.
    pub direction: WireDirection,
    /// What to use if the transport's setup with the peer fails: the rule's next transport.
    pub fallback: Option<(TransportName, WireDirection)>,
    /// Transports the rule names first whose setup with the peer failed (counted as
    /// failovers to `transport` at each send).
    pub failed_over: Vec<TransportName>,
}

/// A peer's routes, and where its sends go.
#[derive(Debug)]
pub struct DirectRoutes {
    /// The peer's transfer actor.
    pub(crate) addr: Addr<TransferActor>,
    /// Where the peer is, for the metrics.
    pub(crate) peer_class: PeerClass,
    /// The routes.
    pub(crate) table: RouteTable,
}

/// The route of every send to one peer, by source memory and range of sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteTable {
    /// By source memory, its ranges.
    ranges: Vec<(MemoryClass, Ranges)>,
}

/// (First size of a range, its route; `None`: no rule routes it), by first size, from 0.
type Ranges = Vec<(u64, Option<Routed>)>;

impl RouteTable {
    /// The table: `route` answers for a source memory and a size (each range's first, from
    /// `bounds`, which start at 0: [`crate::lane::LaneRoutes::bounds`]).
    pub fn new(bounds: &[u64], mut route: impl FnMut(MemoryClass, u64) -> Option<Routed>) -> Self {
        let ranges = [MemoryClass::Host, MemoryClass::Pinned, MemoryClass::Device]
            .into_iter()
            .map(|src| (src, bounds.iter().map(|&b| (b, route(src, b))).collect()))
            .collect();
        Self { ranges }
    }

    /// Which sizes of contiguous device buffer go by pull over the transport that declares
    /// the lane: what the peer's lane may carry.
    pub fn lane_routes(&self) -> crate::lane::LaneRoutes {
        let device = self.ranges.iter().find(|(s, _)| *s == MemoryClass::Device);
        let ranges = device.map_or_else(Vec::new, |(_, ranges)| {
            (ranges.iter())
                .map(|(start, routed)| {
                    let lane = routed.as_ref().is_some_and(|r| {
                        ferry_transports::registry::declared(r.transport).lane
                            && r.direction == WireDirection::Pull
                    });
                    (*start, lane)
                })
                .collect()
        });
        crate::lane::LaneRoutes::new(ranges)
    }

    /// The route of a send of `bytes` from `src` memory; `None` when no rule routes it (the
    /// coordinator then says why).
    pub fn route(&self, src: MemoryClass, bytes: u64) -> Option<&Routed> {
        let (_, ranges) = self.ranges.iter().find(|(s, _)| *s == src)?;
        let i = ranges.partition_point(|(start, _)| *start <= bytes);
        ranges.get(i.checked_sub(1)?)?.1.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_answers_every_size_by_its_range() {
        let routed = |transport, direction| Routed {
            transport,
            direction,
            fallback: None,
            failed_over: Vec::new(),
        };
        // Device memory: ipc pull up to 1 MiB, staged above; host: tcp; pinned: no rule.
        let table = RouteTable::new(&[0, 1 << 20, (1 << 20) + 1], |src, bytes| match src {
            MemoryClass::Device if bytes <= 1 << 20 => {
                Some(routed(TransportName::Ipc, WireDirection::Pull))
            }
            MemoryClass::Device => Some(routed(TransportName::Staged, WireDirection::Push)),
            MemoryClass::Host => Some(routed(TransportName::Tcp, WireDirection::Push)),
            MemoryClass::Pinned => None,
        });
        let of = |src, bytes| table.route(src, bytes).map(|r| r.transport);
        assert_eq!(of(MemoryClass::Device, 0), Some(TransportName::Ipc));
        assert_eq!(of(MemoryClass::Device, 1 << 20), Some(TransportName::Ipc));
        assert_eq!(
            of(MemoryClass::Device, (1 << 20) + 1),
            Some(TransportName::Staged)
        );
        assert_eq!(
            of(MemoryClass::Device, u64::MAX),
            Some(TransportName::Staged)
        );
        assert_eq!(of(MemoryClass::Host, 5), Some(TransportName::Tcp));
        assert_eq!(of(MemoryClass::Pinned, 5), None);
        // The lane carries device pulls over ipc: up to 1 MiB.
        let lane = table.lane_routes();
        assert!(lane.takes(1 << 20) && !lane.takes((1 << 20) + 1));
    }
}
