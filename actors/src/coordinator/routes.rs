//! Routes: where a peer is, which transport and direction a transfer to it takes (and
//! why), the table of a connected peer's routes the node's sends take directly, and the
//! fallback when a transport's setup with the peer fails.

use super::*;

impl Coordinator {
    /// Where `peer` is: from its hello when connected, else from its configured address.
    pub(super) fn locality(&self, peer: &str) -> Locality {
        if let Some(hello) = self.sessions.get(peer).and_then(|s| s.hello.as_ref()) {
            return if *hello.host_id == *self.setup.transfer.host_id {
                Locality::SameHost
            } else {
                Locality::Remote
            };
        }
        match self.peer_address(peer) {
            Some(PeerAddress::Unix(_)) => Locality::SameHost,
            Some(PeerAddress::Tcp(addr)) => {
                let host = addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h);
                let host = host.trim_start_matches('[').trim_end_matches(']');
                let loopback =
                    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
                if loopback {
                    Locality::SameHost
                } else {
                    Locality::Remote
                }
            }
            None => Locality::Remote,
        }
    }

    /// The route of a transfer to `peer`, and why. `dst`: the memory at the peer's end, for
    /// a what-if question; `None`, as sends ask: what the peer receives into.
    pub(super) fn explain(
        &self,
        peer: &str,
        bytes: u64,
        src: MemoryClass,
        dst: Option<MemoryClass>,
    ) -> Explanation {
        self.route(peer, bytes, src, dst, None)
    }

    /// The route of a send of `bytes` from `src` memory to `peer`, with the fallback its
    /// transport's failed setup would take; or why there is none.
    pub(super) fn routed(
        &self,
        peer: &str,
        bytes: u64,
        src: MemoryClass,
    ) -> Result<crate::direct::Routed, Explanation> {
        let explanation = self.explain(peer, bytes, src, None);
        let Some(route) = explanation.chosen.clone() else {
            return Err(explanation);
        };
        let wire = |d: ferry_config::Direction| match d {
            ferry_config::Direction::Push => WireDirection::Push,
            ferry_config::Direction::Pull => WireDirection::Pull,
        };
        // If the chosen transport's setup with the peer fails, the next of the rule.
        let fallback = ferry_transports::registry::declared(route.transport)
            .per_peer_setup
            .then(|| {
                self.route(peer, bytes, src, None, Some(route.transport))
                    .chosen
            })
            .flatten()
            .map(|r| (r.transport, wire(r.direction)));
        let failed_over = explanation
            .skipped
            .iter()
            .filter(|(_, why)| {
                matches!(why, ferry_transports::transport::Unsuitable::SetupFailed(_))
            })
            .map(|(t, _)| *t)
            .collect();
        Ok(crate::direct::Routed {
            transport: route.transport,
            direction: wire(route.direction),
            fallback,
            failed_over,
        })
    }

    /// The route of every send to `peer`, by source memory and the rules' size ranges.
    pub(super) fn route_table(&self, peer: &str) -> crate::direct::RouteTable {
        let bounds = crate::direct::FastRoutes::bounds(&self.setup.config.transport.rules);
        crate::direct::RouteTable::new(&bounds, |src, bytes| self.routed(peer, bytes, src).ok())
    }

    /// Publishes `peer`'s routes (`table`, when the caller made it already) for the node's
    /// sends to take directly, once its link is up (its hello known); else withdraws them
    /// (its sends come here, which dials).
    pub(super) fn publish_direct(&self, peer: &str, table: Option<crate::direct::RouteTable>) {
        let peers = &self.setup.transfer.peers;
        let Some(s) = self
            .sessions
            .get(peer)
            .filter(|s| s.hello.is_some() && matches!(s.state, LinkState::Up { .. }))
            .filter(|_| !self.draining)
        else {
            peers.set_routes(peer, None);
            return;
        };
        let routes = crate::direct::DirectRoutes {
            submissions: s.submissions.clone(),
            peer_class: PeerClass::of(self.locality(peer)),
            table: table.unwrap_or_else(|| self.route_table(peer)),
        };
        peers.set_routes(peer, Some(routes));
    }

    /// The route of a transfer; with `failed`, as if that transport's setup with the peer
    /// had failed (the route a transfer falls back to). `dst` as for [`Self::explain`].
    pub(super) fn route(
        &self,
        peer: &str,
        bytes: u64,
        src: MemoryClass,
        dst: Option<MemoryClass>,
        failed: Option<ferry_config::TransportName>,
    ) -> Explanation {
        let hello = self.sessions.get(peer).and_then(|s| s.hello.as_ref());
        let offers: Option<Vec<ferry_config::TransportName>> = hello.map(|h| h.served().collect());
        let offers = offers.as_deref();
        // Before the first link to the peer there is no hello: `destination` assumes host.
        let receives = hello.map(|h| memory_class(MemoryKind::from_wire(h.receives)));
        let (dst, dst_from) = route::destination(dst, receives);
        let bad = ferry_transports::transport::setup::SetupOutcome::Bad(
            ferry_transports::transport::setup::SetupFailure::PeerRefused("fallback".into()),
        );
        let settled = self.sessions.get(peer).map(|s| &s.setups);
        // What the peer's hello rules out here (another UCX release, say).
        let unusable: Vec<_> = hello
            .map(|h| self.setup.transfer.transports.unusable_with(h))
            .unwrap_or_default()
            .into_iter()
            .map(|(t, why)| {
                let why = ferry_transports::transport::setup::SetupFailure::Incompatible(why);
                (
                    t,
                    ferry_transports::transport::setup::SetupOutcome::Bad(why),
                )
            })
            .collect();
        let setup = |t: ferry_config::TransportName| {
            if Some(t) == failed {
                Some(bad.clone())
            } else if let Some((_, why)) = unusable.iter().find(|(u, _)| *u == t) {
                Some(why.clone())
            } else if ferry_transports::registry::declared(t).per_peer_setup {
                settled.and_then(|s| s.get(&t)).cloned()
            } else {
                None
            }
        };
        let query = RouteQuery {
            locality: self.locality(peer),
            src,
            dst,
            dst_from,
            bytes,
        };
        let rules = &self.setup.config.transport.rules;
        if hello.is_none() {
            // Before the first link, the peer's transports are not known: an opt-in one
            // (ucx) is assumed missing, so the first sends take the rule's next transport
            // when it has one.
            let assumed: Vec<ferry_config::TransportName> = self
                .catalog
                .iter()
                .filter(|(c, _)| !c.opt_in)
                .map(|(c, _)| c.name)
                .collect();
            let first =
                route::choose_with_setup(rules, &self.catalog, Some(&assumed), &setup, query);
            if first.chosen.is_some() {
                return first;
            }
        }
        route::choose_with_setup(rules, &self.catalog, offers, &setup, query)
    }
}

/// Counts a send's failovers: the transports its rule names first whose setup with the
/// peer failed.
pub(crate) fn count_failovers(routed: &crate::direct::Routed) {
    for skipped in &routed.failed_over {
        metrics::counter!(
            "ferry_failover_total",
            "from" => skipped.as_str(),
            "to" => routed.transport.as_str()
        )
        .increment(1);
    }
}

/// The rules' name for the memory `kind` is.
pub(crate) fn memory_class(kind: MemoryKind) -> MemoryClass {
    match kind {
        MemoryKind::Device(_) => MemoryClass::Device,
        MemoryKind::PinnedHost => MemoryClass::Pinned,
        _ => MemoryClass::Host,
    }
}
