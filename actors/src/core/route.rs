//! Route choice: the first rule that matches a transfer names an ordered list of
//! transports; the first one whose declared capabilities suit the transfer, that is viable
//! here and that the peer offers, carries it. Every transport passed over keeps its reason,
//! which `ferry explain` and the log show.

use ferry_config::{Direction, Locality, MemoryClass, Rule, TransportName};
use ferry_transports::transport::{Capabilities, Unsuitable, Viability};

use crate::core::ipc_setup::SetupOutcome;

/// What is being routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteQuery {
    /// Where the peer is.
    pub locality: Locality,
    /// Memory at the sending end.
    pub src: MemoryClass,
    /// Memory at the receiving end.
    pub dst: MemoryClass,
    /// Bytes to move.
    pub bytes: u64,
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
            Some(r) => write!(f, "; chose {} ({:?})", r.transport.as_str(), r.direction),
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
    peer_offers: Option<&[String]>,
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
    peer_offers: Option<&[String]>,
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
                .suits(query.locality, query.src, query.dst, rule.direction)
                .and_then(|()| match peer_offers {
                    Some(list) if !list.iter().any(|t| t == name.as_str()) => {
                        Err(Unsuitable::PeerLacks)
                    }
                    _ => Ok(()),
                })
                .and_then(|()| match setup(name) {
                    Some(SetupOutcome::Bad(why)) => Err(Unsuitable::SetupFailed(why.to_string())),
                    Some(SetupOutcome::Ok) | None => Ok(()),
                }),
        };
        let direction = catalog
            .iter()
            .find(|(c, _)| c.name == name)
            .and_then(|(c, _)| c.direction_for(rule.direction));
        match verdict.map(|()| direction) {
            Ok(Some(direction)) => {
                out.chosen = Some(Route {
                    rule_index: index,
                    rule_name: rule.name.clone(),
                    transport: name,
                    direction,
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
    use ferry_transports::transport::catalog;

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
        let e = choose(&rules, &catalog(), Some(&["ipc".to_string()]), HOST);
        assert_eq!(e.skipped[0].1, Unsuitable::PeerLacks);
    }

    #[test]
    fn failed_setup_falls_back_to_the_next_transport() {
        use crate::core::ipc_setup::SetupFailure;
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
