//! Route choice: the first rule that matches a transfer names an ordered list of
//! transports; the first one whose declared capabilities suit the transfer, that is viable
//! here and that the peer offers, carries it. Every transport passed over keeps its reason,
//! which `ferry explain` and the log show.
//!
//! The memory class at the receiving end is the peer's to say: [`destination`] picks it, for
//! sends and for `ferry explain` alike, so the two cannot disagree.

use ferry_config::{Direction, Locality, MemoryClass, Rule, TransportName};
use ferry_transports::transport::{Capabilities, Unsuitable, Viability};

use ferry_transports::transport::setup::SetupOutcome;

/// What is being routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteQuery {
    /// Where the peer is.
    pub locality: Locality,
    /// Memory at the sending end.
    pub src: MemoryClass,
    /// Memory at the receiving end: what the peer receives into, or what a what-if question
    /// asked for (see [`destination`]). Rules match on it; a transport that cannot land
    /// there lands in host memory instead (see [`Route::landing`]).
    pub dst: MemoryClass,
    /// Where `dst` came from.
    pub dst_from: DstSource,
    /// Bytes to move.
    pub bytes: u64,
}

/// Where the memory class at the receiving end of a [`RouteQuery`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DstSource {
    /// The caller named it (`ferry explain --dst-memory`): a what-if question.
    Asked,
    /// The peer's hello: the class it receives into by default.
    Peer,
    /// Neither: there has been no link to the peer yet, so its hello is unknown, and host
    /// memory, which every node can receive into, is assumed.
    Assumed,
}

impl std::fmt::Display for DstSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Asked => "asked for",
            Self::Peer => "what the peer receives into, from its hello",
            Self::Assumed => "assumed: without a link the peer's receive memory is unknown",
        })
    }
}

/// The memory class a transfer to a peer is routed for at the receiving end, and where it
/// came from: `asked` when given (a what-if question), else `peer_receives`, the class the
/// peer said in its hello it receives into, else host memory (no link to the peer yet: the
/// first send to a peer is routed before its hello arrives). Pure.
///
/// Sends and `ferry explain` both take their destination from here.
pub fn destination(
    asked: Option<MemoryClass>,
    peer_receives: Option<MemoryClass>,
) -> (MemoryClass, DstSource) {
    match (asked, peer_receives) {
        (Some(class), _) => (class, DstSource::Asked),
        (None, Some(class)) => (class, DstSource::Peer),
        (None, None) => (MemoryClass::Host, DstSource::Assumed),
    }
}

/// Where a transport lands the bytes of a transfer to a peer that receives into `dst`:
/// `dst` when the transport declares it can land there, else host memory (the peer then
/// receives into its first host tier, as it does for everything tcp streams to it). Pure.
pub fn landing(caps: &Capabilities, dst: MemoryClass) -> MemoryClass {
    if caps.memory.contains(&dst) {
        dst
    } else {
        MemoryClass::Host
    }
}

/// The chosen path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Index of the matching rule.
    pub rule_index: usize,
    /// Its name.
    pub rule_name: String,
    /// The transport.
    pub transport: TransportName,
    /// The direction.
    pub direction: Direction,
    /// Where the bytes land at the peer: the query's `dst`, or host memory when the
    /// transport cannot land there (see [`landing`]).
    pub landing: MemoryClass,
}

/// How a route was chosen, or why none was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explanation {
    /// The query.
    pub query: RouteQuery,
    /// The rule that matched: index and name.
    pub rule: Option<(usize, String)>,
    /// Transports of that rule passed over, in order, and why.
    pub skipped: Vec<(TransportName, Unsuitable)>,
    /// The choice.
    pub chosen: Option<Route>,
}

impl std::fmt::Display for Explanation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.rule {
            None => write!(f, "no rule matches {:?}", self.query)?,
            Some((i, name)) => write!(f, "rule #{i} \"{name}\" matched")?,
        }
        for (t, why) in &self.skipped {
            write!(f, "; {} skipped: {why}", t.as_str())?;
        }
        match &self.chosen {
            Some(r) => {
                write!(f, "; chose {} ({:?})", r.transport.as_str(), r.direction)?;
                if r.landing != self.query.dst {
                    write!(
                        f,
                        ", landing in {} memory: it cannot land in {} memory",
                        r.landing, self.query.dst
                    )?;
                }
                Ok(())
            }
            None if self.rule.is_some() => write!(f, "; no transport of the rule can carry it"),
            None => Ok(()),
        }
    }
}

/// Chooses a route. `peer_offers` is the list of transports the peer announced, or `None`
/// when the peer is not connected yet (then only this side's declarations count). No
/// transport's setup with the peer counts as failed; see [`choose_with_setup`].
pub fn choose(
    rules: &[Rule],
    catalog: &[(Capabilities, Viability)],
    peer_offers: Option<&[TransportName]>,
    query: RouteQuery,
) -> Explanation {
    choose_with_setup(rules, catalog, peer_offers, &|_| None, query)
}

/// Chooses a route like [`choose`], also passing over every transport whose lazy setup with
/// this peer ended in Bad (`setup(transport)`; `None` when it has not run or not ended, and
/// then the transport may be chosen: the transfer waits for setup, and falls back if it
/// fails). A transport passed over this way is skipped with [`Unsuitable::SetupFailed`].
pub fn choose_with_setup(
    rules: &[Rule],
    catalog: &[(Capabilities, Viability)],
    peer_offers: Option<&[TransportName]>,
    setup: &dyn Fn(TransportName) -> Option<SetupOutcome>,
    query: RouteQuery,
) -> Explanation {
    let mut out = Explanation {
        query,
        rule: None,
        skipped: Vec::new(),
        chosen: None,
    };
    let Some((index, rule)) = rules
        .iter()
        .enumerate()
        .find(|(_, r)| r.matches(query.locality, query.src, query.dst, query.bytes))
    else {
        return out;
    };
    out.rule = Some((index, rule.name.clone()));
    for &name in &rule.transports {
        let verdict = match catalog.iter().find(|(c, _)| c.name == name) {
            None => Err(Unsuitable::NotViable("unknown to this build".into())),
            Some((_, Viability::NotViable(why))) => Err(Unsuitable::NotViable(why.clone())),
            Some((caps, Viability::Viable)) => caps
                .suits(
                    query.locality,
                    query.src,
                    landing(caps, query.dst),
                    rule.direction,
                )
                .and_then(|()| match peer_offers {
                    Some(list) if !list.contains(&name) => Err(Unsuitable::PeerLacks),
                    _ => Ok(()),
                })
                .and_then(|()| match setup(name) {
                    Some(SetupOutcome::Bad(why)) => Err(Unsuitable::SetupFailed(why.to_string())),
                    Some(SetupOutcome::Ok) | None => Ok(()),
                }),
        };
        let caps = catalog.iter().find(|(c, _)| c.name == name).map(|(c, _)| c);
        let direction = caps.and_then(|c| c.direction_for(rule.direction));
        match verdict.map(|()| direction) {
            Ok(Some(direction)) => {
                out.chosen = Some(Route {
                    rule_index: index,
                    rule_name: rule.name.clone(),
                    transport: name,
                    direction,
                    landing: caps.map_or(query.dst, |c| landing(c, query.dst)),
                });
                break;
            }
            Ok(None) => out
                .skipped
                .push((name, Unsuitable::Direction(rule.direction))),
            Err(why) => out.skipped.push((name, why)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_transports::registry::catalog;

    fn rule(name: &str, transports: Vec<TransportName>, direction: Direction) -> Rule {
        Rule {
            name: name.into(),
            locality: vec![],
            src: vec![],
            dst: vec![],
            min_bytes: 0,
            max_bytes: None,
            transports,
            direction: Some(direction),
        }
    }

    const HOST: RouteQuery = RouteQuery {
        locality: Locality::SameHost,
        src: MemoryClass::Host,
        dst: MemoryClass::Host,
        dst_from: DstSource::Asked,
        bytes: 100,
    };

    #[test]
    fn skips_unbuilt_and_picks_tcp() {
        let rules = vec![rule(
            "all",
            vec![TransportName::Ipc, TransportName::Tcp],
            Direction::Push,
        )];
        let e = choose(&rules, &catalog(), None, HOST);
        assert_eq!(
            e.chosen.as_ref().map(|r| r.transport),
            Some(TransportName::Tcp)
        );
        assert_eq!(e.skipped.len(), 1);
        assert!(e.to_string().contains("ipc skipped"), "{e}");
    }

    #[test]
    fn a_transport_without_the_rules_direction_uses_its_own_and_peers_exclude() {
        // tcp only pushes: a pull rule still uses it, pushing.
        let rules = vec![rule("pull", vec![TransportName::Tcp], Direction::Pull)];
        let e = choose(&rules, &catalog(), None, HOST);
        assert_eq!(
            e.chosen.as_ref().map(|r| (r.transport, r.direction)),
            Some((TransportName::Tcp, Direction::Push))
        );
        let rules = vec![rule("push", vec![TransportName::Tcp], Direction::Push)];
        let e = choose(&rules, &catalog(), Some(&[TransportName::Ipc]), HOST);
        assert_eq!(e.skipped[0].1, Unsuitable::PeerLacks);
    }

    #[test]
    fn failed_setup_falls_back_to_the_next_transport() {
        use ferry_transports::transport::setup::SetupFailure;
        // A test catalog: ipc viable and, for this test, able to move host memory, so that
        // ipc and tcp both suit the transfer and only the setup tells them apart.
        let mut catalog = catalog();
        for (caps, v) in &mut catalog {
            if caps.name == TransportName::Ipc {
                *v = Viability::Viable;
                caps.sources = &[MemoryClass::Host, MemoryClass::Device];
                caps.memory = &[MemoryClass::Host, MemoryClass::Device];
            }
        }
        let rules = vec![rule(
            "same-host",
            vec![TransportName::Ipc, TransportName::Tcp],
            Direction::Push,
        )];
        // Setup not run yet (the transfer will wait for it), or Ok: ipc is chosen.
        for outcome in [None, Some(SetupOutcome::Ok)] {
            let e = choose_with_setup(&rules, &catalog, None, &|_| outcome.clone(), HOST);
            assert_eq!(e.chosen.map(|r| r.transport), Some(TransportName::Ipc));
        }
        // Setup Bad: skipped with the reason, tcp chosen.
        let bad = SetupFailure::NoPeerAccess { src: 0, dst: 1 };
        let setup =
            |t: TransportName| (t == TransportName::Ipc).then(|| SetupOutcome::Bad(bad.clone()));
        let e = choose_with_setup(&rules, &catalog, None, &setup, HOST);
        assert_eq!(
            e.chosen.as_ref().map(|r| r.transport),
            Some(TransportName::Tcp)
        );
        assert_eq!(
            e.skipped,
            [(TransportName::Ipc, Unsuitable::SetupFailed(bad.to_string()))]
        );
        let text = e.to_string();
        assert!(
            text.contains(
                "ipc skipped: setup with the peer failed: no peer access from device 0 to device 1"
            ),
            "{text}"
        );
        assert!(text.contains("chose tcp"), "{text}");
        // The plain `choose` knows no setup: ipc again.
        let e = choose(&rules, &catalog, None, HOST);
        assert_eq!(e.chosen.map(|r| r.transport), Some(TransportName::Ipc));
    }

    #[test]
    fn the_destination_is_asked_else_the_peers_else_host() {
        use MemoryClass::*;
        // A what-if question overrides what the peer said.
        assert_eq!(
            destination(Some(Device), Some(Host)),
            (Device, DstSource::Asked)
        );
        assert_eq!(destination(Some(Pinned), None), (Pinned, DstSource::Asked));
        // A send: what the peer receives into.
        for class in [Host, Pinned, Device] {
            assert_eq!(destination(None, Some(class)), (class, DstSource::Peer));
        }
        // Before the first link: host, said to be assumed.
        assert_eq!(destination(None, None), (Host, DstSource::Assumed));
    }

    /// A catalog in which staged moves every kind of memory (as it declares where a CUDA
    /// driver works, whatever this machine has).
    fn staged_anywhere() -> Vec<(Capabilities, Viability)> {
        let mut catalog = catalog();
        for (caps, v) in &mut catalog {
            if caps.name == TransportName::Staged {
                *v = Viability::Viable;
                caps.sources = &[MemoryClass::Host, MemoryClass::Pinned, MemoryClass::Device];
                caps.memory = &[MemoryClass::Host, MemoryClass::Pinned, MemoryClass::Device];
            }
        }
        catalog
    }

    #[test]
    fn a_device_rule_matches_sends_to_a_peer_that_receives_into_device_memory() {
        use MemoryClass::*;
        let mut device = rule("to-device", vec![TransportName::Staged], Direction::Push);
        device.dst = vec![Device];
        let rules = [device, Rule::catch_all()];
        let catalog = staged_anywhere();
        let route = |asked, peer| {
            let (dst, dst_from) = destination(asked, peer);
            let query = RouteQuery {
                dst,
                dst_from,
                ..HOST
            };
            let e = choose(&rules, &catalog, None, query);
            let r = e.chosen.expect("a route");
            (e.rule.map(|(i, _)| i), r.transport, r.landing)
        };
        assert_eq!(
            route(None, Some(Device)),
            (Some(0), TransportName::Staged, Device)
        );
        for peer in [Some(Host), Some(Pinned), None] {
            assert_eq!(
                route(None, peer),
                (Some(1), TransportName::Tcp, peer.unwrap_or(Host))
            );
        }
        // `--dst-memory` asks what would happen either way.
        assert_eq!(
            route(Some(Device), Some(Host)),
            (Some(0), TransportName::Staged, Device)
        );
        assert_eq!(
            route(Some(Host), Some(Device)),
            (Some(1), TransportName::Tcp, Host)
        );
    }

    #[test]
    fn tcp_to_a_peer_that_receives_into_device_memory_lands_in_host_memory() {
        let query = RouteQuery {
            dst: MemoryClass::Device,
            dst_from: DstSource::Peer,
            ..HOST
        };
        let e = choose(&[Rule::catch_all()], &catalog(), None, query);
        let r = e.chosen.as_ref().expect("tcp carries it");
        assert_eq!(
            (r.transport, r.landing),
            (TransportName::Tcp, MemoryClass::Host)
        );
        let text = e.to_string();
        assert!(
            text.contains("chose tcp (Push), landing in host memory: it cannot land in device"),
            "{text}"
        );
    }

    #[test]
    fn every_default_rule_routes_to_a_peer_whatever_it_receives_into() {
        use MemoryClass::*;
        let rules = ferry_config::TransportConfig::default().rules;
        for locality in [Locality::SameHost, Locality::Remote] {
            for src in [Host, Pinned, Device] {
                for peer in [Host, Pinned, Device] {
                    let (dst, dst_from) = destination(None, Some(peer));
                    let query = RouteQuery {
                        locality,
                        src,
                        dst,
                        dst_from,
                        bytes: 1 << 20,
                    };
                    let e = choose(&rules, &catalog(), None, query);
                    assert!(e.chosen.is_some(), "{e}");
                }
            }
        }
    }

    #[test]
    fn first_matching_rule_wins() {
        let mut small = rule("small", vec![TransportName::Tcp], Direction::Push);
        small.max_bytes = Some(10);
        let big = rule("big", vec![TransportName::Tcp], Direction::Push);
        let e = choose(&[small, big], &catalog(), None, HOST);
        assert_eq!(e.rule, Some((1, "big".into())));
        let e = choose(&[], &catalog(), None, HOST);
        assert!(e.rule.is_none() && e.chosen.is_none());
    }
}
