//! Peers found by DNS: the addresses the names resolve to, who answered at each, which
//! addresses to probe next, and where to dial a peer learnt that way. No I/O: the
//! coordinator looks the names up, probes and dials, and feeds the results in.
//!
//! DNS only says where to dial. An address is probed once (a link whose hello asks only who
//! answers), and the name in the answer's authenticated hello is what the address is known
//! by from then on. An address that leaves DNS is forgotten with what was learnt of it; a
//! peer's live link is the coordinator's business and is not touched here.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

/// What is known of one address that DNS gives now.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Known {
    /// Not probed yet, or its last probe failed (`failures` in a row). `due`: it may be
    /// probed now (a failed one waits for the next round).
    Unknown { failures: u32, due: bool },
    /// A probe is on its way; `failures` as before it.
    Probing { failures: u32 },
    /// The node of this name answered.
    Peer(String),
    /// This node answered: it found itself.
    Myself,
}

/// What a round of lookups changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RoundReport {
    /// Addresses DNS gives that it did not give before.
    pub added: Vec<SocketAddr>,
    /// Addresses DNS no longer gives, with the peer that answered there, if one did.
    pub removed: Vec<(SocketAddr, Option<String>)>,
    /// Addresses left out because of the bound (`discovery.max_peers`).
    pub left_out: usize,
    /// Names (by index) whose lookup failed this round after it had not: their last answer
    /// stays.
    pub failing: Vec<usize>,
    /// Names (by index) whose lookup works again.
    pub recovered: Vec<usize>,
}

/// How a probe ended, for the coordinator to act on and log.
#[derive(Debug, PartialEq, Eq)]
pub enum Probed {
    /// A peer of this name answers there: dial it if it has no link.
    Peer(String),
    /// This node answered: the address is never probed again while DNS gives it.
    Myself,
    /// The probe failed; `first`: the first failure in a row at that address (log it
    /// loudly once, then quietly).
    Failed {
        /// Whether the address's previous probe had not failed.
        first: bool,
    },
    /// The address left DNS (or came back) while the probe was on its way: ignored.
    Stale,
}

/// The addresses of `discovery.dns` and what is known of them.
#[derive(Debug)]
pub struct Discovery {
    me: String,
    max_addresses: usize,
    max_probes: usize,
    /// Each name's last successful answer (`None` until it has one), by index.
    answers: Vec<Option<Vec<SocketAddr>>>,
    /// Whether each name's last lookup failed.
    failing: Vec<bool>,
    addresses: BTreeMap<SocketAddr, Known>,
    /// Probes on their way (an address may have left DNS meanwhile).
    probing: BTreeSet<SocketAddr>,
    /// Rounds of lookups so far.
    rounds: u64,
}

impl Discovery {
    /// Discovery for the node named `me`, looking up `names` names, keeping at most
    /// `max_addresses` addresses and `max_probes` probes on their way at once.
    pub fn new(me: &str, names: usize, max_addresses: usize, max_probes: usize) -> Self {
        Self {
            me: me.to_string(),
            max_addresses,
            max_probes: max_probes.max(1),
            answers: vec![None; names],
            failing: vec![false; names],
            addresses: BTreeMap::new(),
            probing: BTreeSet::new(),
            rounds: 0,
        }
    }

    /// A round of lookups ended: `answers[i]` is name `i`'s answer, `None` when its lookup
    /// failed (its previous answer stays: a DNS outage is no reason to forget peers).
    /// Addresses failed probes left waiting may be probed again from now on.
    pub fn handle_round(&mut self, answers: Vec<Option<Vec<SocketAddr>>>) -> RoundReport {
        let mut report = RoundReport::default();
        self.rounds += 1;
        for (i, answer) in answers.into_iter().enumerate().take(self.answers.len()) {
            match answer {
                Some(addrs) => {
                    if std::mem::replace(&mut self.failing[i], false) {
                        report.recovered.push(i);
                    }
                    self.answers[i] = Some(addrs);
                }
                None => {
                    if !std::mem::replace(&mut self.failing[i], true) {
                        report.failing.push(i);
                    }
                }
            }
        }
        let all: BTreeSet<SocketAddr> = self.answers.iter().flatten().flatten().copied().collect();
        report.left_out = all.len().saturating_sub(self.max_addresses);
        let now: BTreeSet<SocketAddr> = all.into_iter().take(self.max_addresses).collect();
        let before = std::mem::take(&mut self.addresses);
        for (addr, known) in before {
            if now.contains(&addr) {
                self.addresses.insert(addr, known);
            } else {
                let peer = match known {
                    Known::Peer(name) => Some(name),
                    _ => None,
                };
                report.removed.push((addr, peer));
            }
        }
        for addr in now {
            let known = self.addresses.entry(addr).or_insert_with(|| {
                report.added.push(addr);
                Known::Unknown {
                    failures: 0,
                    due: true,
                }
            });
            if let Known::Unknown { due, .. } = known {
                *due = true;
            }
        }
        report
    }

    /// The next address to probe, if one is due and fewer than `max_probes` are on their
    /// way; it counts as on its way from now until [`Self::handle_probed`].
    pub fn poll_probe(&mut self) -> Option<SocketAddr> {
        if self.probing.len() >= self.max_probes {
            return None;
        }
        let probing = &self.probing;
        let (addr, known) = self.addresses.iter_mut().find(|(addr, known)| {
            matches!(known, Known::Unknown { due: true, .. }) && !probing.contains(*addr)
        })?;
        let failures = match known {
            Known::Unknown { failures, .. } => *failures,
            _ => 0,
        };
        *known = Known::Probing { failures };
        self.probing.insert(*addr);
        Some(*addr)
    }

    /// The probe of `addr` ended: `Ok` with the name that answered, or `Err` when it failed.
    pub fn handle_probed(&mut self, addr: SocketAddr, answered: Result<String, ()>) -> Probed {
        self.probing.remove(&addr);
        let Some(known) = self.addresses.get_mut(&addr) else {
            return Probed::Stale;
        };
        let Known::Probing { failures } = *known else {
            return Probed::Stale;
        };
        match answered {
            Ok(name) if name == self.me => {
                *known = Known::Myself;
                Probed::Myself
            }
            Ok(name) => {
                *known = Known::Peer(name.clone());
                Probed::Peer(name)
            }
            Err(()) => {
                *known = Known::Unknown {
                    failures: failures + 1,
                    due: false,
                };
                Probed::Failed {
                    first: failures == 0,
                }
            }
        }
    }

    /// A dial of `addr` found the node named `name` there (another than the one it was
    /// learnt as: the address went to another node). Nothing if DNS no longer gives it.
    pub fn handle_answered(&mut self, addr: SocketAddr, name: &str) {
        if let Some(known) = self.addresses.get_mut(&addr) {
            *known = if name == self.me {
                Known::Myself
            } else {
                Known::Peer(name.to_string())
            };
        }
    }

    /// Every peer learnt at an address DNS gives now, with the address to dial it at (its
    /// first, in address order: IPv4 before IPv6), in name order.
    pub fn peers(&self) -> Vec<(String, SocketAddr)> {
        let mut found: BTreeMap<&str, SocketAddr> = BTreeMap::new();
        for (addr, known) in &self.addresses {
            if let Known::Peer(name) = known {
                found.entry(name.as_str()).or_insert(*addr);
            }
        }
        found
            .into_iter()
            .map(|(name, addr)| (name.to_string(), addr))
            .collect()
    }

    /// Whether `peer` is learnt at `addr` now.
    pub fn is_at(&self, peer: &str, addr: SocketAddr) -> bool {
        matches!(self.addresses.get(&addr), Some(Known::Peer(name)) if name == peer)
    }

    /// Where to dial `peer`, if it was learnt at an address DNS gives now.
    pub fn address_of(&self, peer: &str) -> Option<SocketAddr> {
        self.addresses
            .iter()
            .find(|(_, known)| matches!(known, Known::Peer(name) if name == peer))
            .map(|(addr, _)| *addr)
    }

    /// Whether discovery has had its first round of answers and has no probe on its way:
    /// what it can learn until the next round, it has learnt.
    pub fn settled(&self) -> bool {
        self.rounds > 0
            && self.probing.is_empty()
            && !self
                .addresses
                .values()
                .any(|known| matches!(known, Known::Unknown { due: true, .. }))
    }

    /// How many addresses DNS gives now (after the bound).
    pub fn addresses(&self) -> usize {
        self.addresses.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(last: u8) -> SocketAddr {
        SocketAddr::from(([198, 18, 0, last], 7070))
    }

    fn probe_all(d: &mut Discovery) -> Vec<SocketAddr> {
        std::iter::from_fn(|| d.poll_probe()).collect()
    }

    #[test]
    fn new_addresses_are_probed_once_and_known_by_the_name_that_answers() {
        let mut d = Discovery::new("a", 1, 16, 8);
        let report = d.handle_round(vec![Some(vec![at(1), at(2), at(3)])]);
        assert_eq!(report.added, [at(1), at(2), at(3)]);
        assert_eq!(probe_all(&mut d), [at(1), at(2), at(3)]);
        assert_eq!(d.handle_probed(at(1), Ok("a".into())), Probed::Myself);
        assert_eq!(
            d.handle_probed(at(2), Ok("b".into())),
            Probed::Peer("b".into())
        );
        assert_eq!(
            d.handle_probed(at(3), Ok("c".into())),
            Probed::Peer("c".into())
        );
        assert_eq!(d.peers(), [("b".into(), at(2)), ("c".into(), at(3))]);
        assert_eq!(d.address_of("c"), Some(at(3)));
        assert_eq!(d.address_of("a"), None, "never dial itself");
        // The next round gives the same: nothing new to probe, nothing added.
        assert_eq!(
            d.handle_round(vec![Some(vec![at(3), at(2), at(1)])]),
            RoundReport::default()
        );
        assert_eq!(d.poll_probe(), None);
    }

    #[test]
    fn settled_once_the_first_answers_are_probed() {
        let mut d = Discovery::new("a", 1, 16, 1);
        assert!(!d.settled(), "no answer yet");
        d.handle_round(vec![None]);
        assert!(d.settled(), "a failed lookup has nothing more to give");
        d.handle_round(vec![Some(vec![at(2), at(3)])]);
        assert!(!d.settled());
        assert_eq!(d.poll_probe(), Some(at(2)));
        assert_eq!(d.poll_probe(), None, "one probe at once");
        d.handle_probed(at(2), Err(()));
        assert!(!d.settled(), "at(3) is due");
        assert_eq!(d.poll_probe(), Some(at(3)));
        d.handle_probed(at(3), Ok("c".into()));
        assert!(d.settled());
    }

    #[test]
    fn a_failed_probe_waits_for_the_next_round_and_is_loud_once() {
        let mut d = Discovery::new("a", 1, 16, 8);
        d.handle_round(vec![Some(vec![at(2)])]);
        assert_eq!(d.poll_probe(), Some(at(2)));
        assert_eq!(
            d.handle_probed(at(2), Err(())),
            Probed::Failed { first: true }
        );
        assert_eq!(d.poll_probe(), None, "not again in the same round");
        d.handle_round(vec![Some(vec![at(2)])]);
        assert_eq!(d.poll_probe(), Some(at(2)));
        assert_eq!(
            d.handle_probed(at(2), Err(())),
            Probed::Failed { first: false }
        );
        d.handle_round(vec![Some(vec![at(2)])]);
        assert_eq!(d.poll_probe(), Some(at(2)));
        assert_eq!(
            d.handle_probed(at(2), Ok("b".into())),
            Probed::Peer("b".into())
        );
    }

    #[test]
    fn an_address_that_leaves_is_forgotten_and_probed_anew_when_it_comes_back() {
        let mut d = Discovery::new("a", 1, 16, 8);
        d.handle_round(vec![Some(vec![at(2), at(3)])]);
        probe_all(&mut d);
        d.handle_probed(at(2), Ok("b".into()));
        d.handle_probed(at(3), Ok("c".into()));
        let report = d.handle_round(vec![Some(vec![at(2)])]);
        assert_eq!(report.removed, [(at(3), Some("c".into()))]);
        assert_eq!(d.address_of("c"), None, "not dialled again");
        assert_eq!(d.peers(), [("b".into(), at(2))]);
        // The address comes back, now another node's.
        d.handle_round(vec![Some(vec![at(2), at(3)])]);
        assert_eq!(probe_all(&mut d), [at(3)]);
        assert_eq!(
            d.handle_probed(at(3), Ok("d".into())),
            Probed::Peer("d".into())
        );
        assert_eq!(d.address_of("d"), Some(at(3)));
    }

    #[test]
    fn a_probe_that_outlives_its_address_is_stale() {
        let mut d = Discovery::new("a", 1, 16, 8);
        d.handle_round(vec![Some(vec![at(2)])]);
        assert_eq!(d.poll_probe(), Some(at(2)));
        d.handle_round(vec![Some(vec![])]);
        assert_eq!(d.handle_probed(at(2), Ok("b".into())), Probed::Stale);
        assert_eq!(d.peers(), []);
        // Gone and back while the probe is out: not probed twice at once, then again.
        d.handle_round(vec![Some(vec![at(2)])]);
        assert_eq!(d.poll_probe(), Some(at(2)));
        d.handle_round(vec![Some(vec![])]);
        d.handle_round(vec![Some(vec![at(2)])]);
        assert_eq!(d.poll_probe(), None, "its old probe is still out");
        assert_eq!(d.handle_probed(at(2), Ok("b".into())), Probed::Stale);
        assert_eq!(d.poll_probe(), Some(at(2)));
    }

    #[test]
    fn a_failed_lookup_keeps_the_last_answer() {
        let mut d = Discovery::new("a", 2, 16, 8);
        d.handle_round(vec![Some(vec![at(2)]), Some(vec![at(3)])]);
        probe_all(&mut d);
        d.handle_probed(at(2), Ok("b".into()));
        d.handle_probed(at(3), Ok("c".into()));
        let report = d.handle_round(vec![None, Some(vec![at(3)])]);
        assert_eq!(report.failing, [0]);
        assert!(report.removed.is_empty(), "{report:?}");
        assert_eq!(d.peers().len(), 2);
        let report = d.handle_round(vec![None, Some(vec![at(3)])]);
        assert!(report.failing.is_empty(), "said once");
        let report = d.handle_round(vec![Some(vec![]), Some(vec![at(3)])]);
        assert_eq!(report.recovered, [0]);
        assert_eq!(report.removed, [(at(2), Some("b".into()))]);
    }

    #[test]
    fn addresses_and_probes_are_bounded() {
        let mut d = Discovery::new("a", 2, 3, 2);
        let report = d.handle_round(vec![
            Some(vec![at(5), at(4), at(3)]),
            Some(vec![at(2), at(1), at(3)]),
        ]);
        assert_eq!(report.left_out, 2);
        assert_eq!(d.addresses(), 3);
        assert_eq!(probe_all(&mut d), [at(1), at(2)], "two probes at once");
        d.handle_probed(at(1), Ok("x".into()));
        assert_eq!(probe_all(&mut d), [at(3)]);
    }

    #[test]
    fn a_node_with_two_addresses_is_one_peer_and_can_be_relearnt() {
        let v6: SocketAddr = "[fd00::2]:7070".parse().expect("v6");
        let mut d = Discovery::new("a", 1, 16, 8);
        d.handle_round(vec![Some(vec![v6, at(2)])]);
        probe_all(&mut d);
        d.handle_probed(v6, Ok("b".into()));
        d.handle_probed(at(2), Ok("b".into()));
        assert_eq!(d.peers(), [("b".into(), at(2))], "IPv4 first");
        // A dial of b's IPv4 address found c there.
        d.handle_answered(at(2), "c");
        assert_eq!(d.peers(), [("b".into(), v6), ("c".into(), at(2))]);
        d.handle_answered(at(9), "z");
        assert_eq!(
            d.peers().len(),
            2,
            "an address DNS does not give is not learnt"
        );
    }
}
