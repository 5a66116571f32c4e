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

use ferry_config::{MemoryClass, TransportName};
use ferry_transports::wire::WireDirection;

use crate::peer::PeerClass;

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
    /// Where sends to the peer's transfer actor go.
    pub(crate) submissions: crate::peer::Submissions,
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
    /// `bounds`, which start at 0: [`FastRoutes::bounds`]).
    pub fn new(bounds: &[u64], mut route: impl FnMut(MemoryClass, u64) -> Option<Routed>) -> Self {
        let ranges = [MemoryClass::Host, MemoryClass::Pinned, MemoryClass::Device]
            .into_iter()
            .map(|src| (src, bounds.iter().map(|&b| (b, route(src, b))).collect()))
            .collect();
        Self { ranges }
    }

    /// Which sizes of contiguous buffer of `memory` go by pull over `transport`: what the
    /// peer's fast path of that transport may carry.
    pub fn fast_routes(&self, transport: TransportName, memory: MemoryClass) -> FastRoutes {
        let class = self.ranges.iter().find(|(s, _)| *s == memory);
        let ranges = class.map_or_else(Vec::new, |(_, ranges)| {
            (ranges.iter())
                .map(|(start, routed)| {
                    let lane = routed.as_ref().is_some_and(|r| {
                        r.transport == transport && r.direction == WireDirection::Pull
                    });
                    (*start, lane)
                })
                .collect()
        });
        FastRoutes::new(ranges)
    }

    /// The route of a send of `bytes` from `src` memory; `None` when no rule routes it (the
    /// coordinator then says why).
    pub fn route(&self, src: MemoryClass, bytes: u64) -> Option<&Routed> {
        let (_, ranges) = self.ranges.iter().find(|(s, _)| *s == src)?;
        let i = ranges.partition_point(|(start, _)| *start <= bytes);
        ranges.get(i.checked_sub(1)?)?.1.as_ref()
    }
}

/// Which sizes of contiguous buffer (of the path's memory) the routing rules send to the peer by pull over
/// the transport whose fast path the peer has: the fast path carries those and no other. Rules match sizes by ranges, so the answer
/// is constant between their bounds: one entry per range, by its first size.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FastRoutes {
    /// (first size of a range, whether the fast path carries it), by first size, from 0.
    ranges: Vec<(u64, bool)>,
}

impl FastRoutes {
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
    /// route at each takes the fast path.
    pub fn new(ranges: Vec<(u64, bool)>) -> Self {
        Self { ranges }
    }

    /// Whether a send of `bytes` takes the fast path.
    pub fn takes(&self, bytes: u64) -> bool {
        let i = self.ranges.partition_point(|(start, _)| *start <= bytes);
        i > 0 && self.ranges[i - 1].1
    }
}

/// A peer's fast path (a transport made one with it: a lane), published in the
/// node's per-peer table, and which sizes the rules send over it (set once its transport's
/// setup with the peer settled; no send takes it before).
#[derive(Debug)]
pub struct FastLane {
    /// The transport whose sends it carries.
    pub transport: TransportName,
    /// The path.
    pub path: std::sync::Arc<dyn ferry_transports::transport::FastPath>,
    /// Which sizes the rules send this way.
    pub routes: std::sync::OnceLock<FastRoutes>,
}

impl FastLane {
    /// `transport`'s `path`, with no routes yet.
    pub fn new(
        transport: TransportName,
        path: std::sync::Arc<dyn ferry_transports::transport::FastPath>,
    ) -> Self {
        Self {
            transport,
            path,
            routes: std::sync::OnceLock::new(),
        }
    }

    /// True when `buffer`, sent whole, takes this path: the rules route its size here, and
    /// the path takes it now.
    pub fn fits(&self, buffer: &ferry_transports::memory::Buffer) -> bool {
        (self.routes.get()).is_some_and(|r| r.takes(buffer.len() as u64)) && self.path.fits(buffer)
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
        let lane = table.fast_routes(TransportName::Ipc, MemoryClass::Device);
        assert!(lane.takes(1 << 20) && !lane.takes((1 << 20) + 1));
    }

    #[test]
    fn lane_routes_follow_the_rules_size_ranges() {
        let rule = |min: u64, max: Option<u64>| ferry_config::Rule {
            min_bytes: min,
            max_bytes: max,
            ..ferry_config::Rule::same_host_gpu()
        };
        let rules = [rule(4096, Some(1 << 20)), rule(0, None)];
        let bounds = FastRoutes::bounds(&rules);
        assert_eq!(bounds, vec![0, 4096, (1 << 20) + 1]);
        // Say the first rule sends by push: the lane carries what the second rule covers.
        let routes = FastRoutes::new(bounds.into_iter().map(|b| (b, b != 4096)).collect());
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
            !FastRoutes::default().takes(8),
            "no routes: nothing takes the fast path"
        );
    }
}

/// What a node's sends to each peer take, one entry per peer name, so that a send finds
/// all of it by one lookup: its order, its credit, and the peer's fast path and routes
/// (published by the peer's transfer actor and the coordinator, withdrawn when they no
/// longer hold).
#[derive(Debug)]
pub struct PeerHandles {
    peers: dashmap::DashMap<String, std::sync::Arc<PeerHandle>>,
    /// Each peer's credit: `limits.peer_queue`.
    credit: usize,
}

/// What sends to one peer take.
#[derive(Debug)]
pub struct PeerHandle {
    /// The order between its fast path's sends and the rest.
    pub(crate) order: std::sync::Arc<crate::order::Order>,
    /// The sends, puts and fetches it may have outstanding: each waits for a permit.
    pub(crate) credits: std::sync::Arc<tokio::sync::Semaphore>,
    /// Its fast paths, at most one per transport.
    lanes: std::sync::RwLock<Vec<std::sync::Arc<FastLane>>>,
    routes: std::sync::RwLock<Option<std::sync::Arc<DirectRoutes>>>,
}

impl PeerHandle {
    /// The fast path that takes `buffer` (sent whole) now, if one does.
    pub fn lane_for(
        &self,
        buffer: &ferry_transports::memory::Buffer,
    ) -> Option<std::sync::Arc<FastLane>> {
        let lanes = self.lanes.read().unwrap_or_else(|e| e.into_inner());
        lanes.iter().find(|l| l.fits(buffer)).cloned()
    }

    /// Whether a transport made a fast path with it.
    pub fn has_lane(&self) -> bool {
        !self
            .lanes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// Its routes and transfer actor, while its link is up.
    pub fn routes(&self) -> Option<std::sync::Arc<DirectRoutes>> {
        self.routes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl PeerHandles {
    /// No peer yet; each gets `credit` permits.
    pub fn new(credit: usize) -> Self {
        Self {
            peers: dashmap::DashMap::new(),
            credit,
        }
    }

    /// `peer`'s handle, made at its first use.
    pub fn handle(&self, peer: &str) -> std::sync::Arc<PeerHandle> {
        if let Some(h) = self.peers.get(peer) {
            return std::sync::Arc::clone(h.value());
        }
        let made = self.peers.entry(peer.to_string()).or_insert_with(|| {
            std::sync::Arc::new(PeerHandle {
                order: std::sync::Arc::default(),
                credits: std::sync::Arc::new(tokio::sync::Semaphore::new(self.credit)),
                lanes: std::sync::RwLock::default(),
                routes: std::sync::RwLock::default(),
            })
        });
        std::sync::Arc::clone(made.value())
    }

    /// `peer`'s fast path over `transport`, if it has one.
    pub fn lane(&self, peer: &str, transport: TransportName) -> Option<std::sync::Arc<FastLane>> {
        let handle = self.peers.get(peer)?;
        let lanes = handle.lanes.read().unwrap_or_else(|e| e.into_inner());
        lanes.iter().find(|l| l.transport == transport).cloned()
    }

    /// Whether `peer` has a fast path.
    pub fn has_lane(&self, peer: &str) -> bool {
        self.peers.get(peer).is_some_and(|h| h.has_lane())
    }

    /// `peer`'s routes, while published.
    pub fn routes(&self, peer: &str) -> Option<std::sync::Arc<DirectRoutes>> {
        self.peers.get(peer)?.routes()
    }

    /// Publishes `lane` as `peer`'s fast path over its transport (in place of an earlier
    /// one of that transport).
    pub fn set_lane(&self, peer: &str, lane: std::sync::Arc<FastLane>) {
        let handle = self.handle(peer);
        let mut lanes = handle.lanes.write().unwrap_or_else(|e| e.into_inner());
        lanes.retain(|l| l.transport != lane.transport);
        lanes.push(lane);
    }

    /// Withdraws `lane` from `peer`'s fast paths, if it is still there.
    pub fn withdraw_lane(&self, peer: &str, lane: &std::sync::Arc<FastLane>) {
        if let Some(handle) = self.peers.get(peer) {
            let mut lanes = handle.lanes.write().unwrap_or_else(|e| e.into_inner());
            lanes.retain(|l| !std::sync::Arc::ptr_eq(l, lane));
        }
    }

    /// Publishes `peer`'s routes, or (`None`) withdraws them.
    pub fn set_routes(&self, peer: &str, routes: Option<DirectRoutes>) {
        let routes = routes.map(std::sync::Arc::new);
        match (routes, self.peers.get(peer)) {
            (None, None) => {}
            (None, Some(handle)) => {
                *handle.routes.write().unwrap_or_else(|e| e.into_inner()) = None;
            }
            (Some(routes), _) => {
                let handle = self.handle(peer);
                *handle.routes.write().unwrap_or_else(|e| e.into_inner()) = Some(routes);
            }
        }
    }

    /// Withdraws every peer's routes (the node is draining).
    pub fn clear_routes(&self) {
        for handle in self.peers.iter() {
            *handle.routes.write().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
}
