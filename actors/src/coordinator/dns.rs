//! DNS discovery, the coordinator's part: the task that looks `discovery.dns` up, the probes
//! of new addresses, and the dials of the peers found there. What to probe and who is where
//! is decided in [`crate::core::discovery`].

use std::net::SocketAddr;

use actix::prelude::*;
use ferry_transports::link::{self, Endpoint};
use ferry_transports::wire::{Hello, HelloPurpose};

use super::Coordinator;
use crate::core::discovery::{Discovery, Probed};

/// A round of DNS lookups (`discovery.dns`) ended: each name's addresses, in order, or
/// why its lookup failed.
#[derive(Debug, Message)]
#[rtype(result = "()")]
struct Resolved(Vec<Result<Vec<SocketAddr>, LookupError>>);

/// Why a name's lookup or an address's probe gave no answer this round.
#[derive(Debug, thiserror::Error)]
enum LookupError {
    /// The resolver failed.
    #[error(transparent)]
    Failed(#[from] std::io::Error),
    /// The dial of a probe failed.
    #[error(transparent)]
    Dial(#[from] ferry_transports::link::LinkError),
    /// The resolver gave no answer in time.
    #[error("no answer from the resolver within {}", humantime::format_duration(*.0))]
    ResolverTimedOut(std::time::Duration),
    /// A probe's dial gave no answer in time.
    #[error("no answer within {}", humantime::format_duration(*.0))]
    TimedOut(std::time::Duration),
}

/// A discovery probe of `addr` ended: the name of the node that answered, or why none did.
#[derive(Debug, Message)]
#[rtype(result = "()")]
struct ProbeEnded {
    addr: SocketAddr,
    result: Result<String, LookupError>,
}

/// The longest one name's lookup may take; a lookup that takes longer fails this round (the
/// name keeps its last answer).
const LOOKUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Probes of discovered addresses on their way at once.
pub(super) const MAX_PROBES: usize = 8;

/// DNS discovery: the lookups, the probes, and the dials of peers found that way.
impl Coordinator {
    /// Starts the task that looks up `discovery.dns` on the I/O runtime, a round at once and
    /// then one every `discovery.interval` after the previous round ended (so at most one
    /// lookup is on its way: a slow resolver delays rounds, it does not pile them up). The
    /// task ends with the coordinator.
    pub(super) fn start_lookups(&self, ctx: &mut Context<Self>) {
        let names = self.setup.config.discovery.dns.clone();
        let interval = self.setup.config.discovery.interval;
        let me = ctx.address();
        self.setup.transfer.io.spawn(async move {
            loop {
                let mut answers = Vec::with_capacity(names.len());
                for entry in &names {
                    // getaddrinfo on tokio's blocking pool: /etc/hosts, then DNS. Bounded: a
                    // resolver that hangs (search domains, ndots) must not hold every later
                    // round, and the connects waiting for the first, back.
                    let lookup = tokio::net::lookup_host((entry.name.as_str(), entry.port));
                    let answer = match tokio::time::timeout(LOOKUP_TIMEOUT, lookup).await {
                        Ok(found) => found
                            .map(|addrs| addrs.collect())
                            .map_err(LookupError::from),
                        Err(_) => Err(LookupError::ResolverTimedOut(LOOKUP_TIMEOUT)),
                    };
                    answers.push(answer);
                }
                if me.send(Resolved(answers)).await.is_err() {
                    return;
                }
                tokio::time::sleep(interval).await;
            }
        });
    }

    /// Probes the discovered addresses that are due, and (`discovery.connect_all`) dials
    /// each discovered peer that has no session. Nothing while draining.
    pub(super) fn discover(&mut self, ctx: &mut Context<Self>) {
        if self.draining {
            return;
        }
        let Some(discovery) = self.discovery.as_mut() else {
            return;
        };
        let probes: Vec<SocketAddr> = std::iter::from_fn(|| discovery.poll_probe()).collect();
        let peers = if self.setup.config.discovery.connect_all {
            discovery.peers()
        } else {
            Vec::new()
        };
        for addr in probes {
            self.probe(addr, ctx);
        }
        let interval = self.setup.config.discovery.interval;
        self.discovered_dials
            .retain(|peer, _| peers.iter().any(|(p, _)| p == peer));
        for (peer, addr) in peers {
            let recently = self
                .discovered_dials
                .get(&peer)
                .is_some_and(|at| at.elapsed() < interval);
            if !self.sessions.contains_key(&peer) && !recently {
                self.discovered_dials
                    .insert(peer.clone(), std::time::Instant::now());
                tracing::debug!(%peer, %addr, "dialing a peer found by DNS");
                if let Err(e) = self.session_for(&peer, ctx) {
                    tracing::debug!(%peer, error = %e, "cannot dial a peer found by DNS");
                }
            }
        }
        // `Connect`s waiting for the first answers: their peer is found, or it is not and
        // discovery has nothing more on its way.
        let settled = self.discovery.as_ref().is_none_or(Discovery::settled);
        for (peer, error, tx) in std::mem::take(&mut self.connects) {
            if tx.is_closed() {
                // It gave up waiting.
                continue;
            }
            if self.sessions.contains_key(&peer) || self.peer_address(&peer).is_some() {
                let _ = tx.send(self.session_for(&peer, ctx));
            } else if settled {
                let _ = tx.send(Err(error));
            } else {
                self.connects.push((peer, error, tx));
            }
        }
    }

    /// Asks who answers at `addr`: a link whose hello says it is a probe, closed as soon as
    /// the answer's hello (after the shared-secret proof) names its node.
    fn probe(&self, addr: SocketAddr, ctx: &mut Context<Self>) {
        let secret = self.setup.secret.clone();
        let opts = self.setup.link.clone();
        let hello = Hello {
            purpose: HelloPurpose::Probe,
            ..self.hello()
        };
        let connect_timeout = self.setup.config.limits.connect_timeout;
        let me = ctx.address();
        self.setup.transfer.io.spawn(async move {
            let endpoint = Endpoint::Tcp(addr.to_string());
            let dialing = link::dial(&endpoint, &secret, hello, &opts);
            let result = match tokio::time::timeout(connect_timeout, dialing).await {
                Ok(Ok(mut link)) => {
                    let name = link.peer_hello.node.clone();
                    // The answer is in: the probe's slot is free whatever the close takes.
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(connect_timeout, link.writer.shutdown()).await;
                    });
                    Ok(name)
                }
                Ok(Err(e)) => Err(LookupError::from(e)),
                Err(_) => Err(LookupError::TimedOut(connect_timeout)),
            };
            let _ = me.send(ProbeEnded { addr, result }).await;
        });
    }
}

impl Handler<Resolved> for Coordinator {
    type Result = ();

    fn handle(&mut self, Resolved(answers): Resolved, ctx: &mut Self::Context) {
        let Some(discovery) = self.discovery.as_mut() else {
            return;
        };
        let names = &self.setup.config.discovery.dns;
        let mut errors: Vec<Option<LookupError>> = (0..answers.len()).map(|_| None).collect();
        let answers = answers
            .into_iter()
            .enumerate()
            .map(|(i, answer)| {
                let outcome = if answer.is_ok() { "ok" } else { "failed" };
                metrics::counter!("ferry_discovery_lookups_total", "outcome" => outcome)
                    .increment(1);
                answer.map_err(|e| errors[i] = Some(e)).ok()
            })
            .collect();
        let report = discovery.handle_round(answers);
        for &i in &report.failing {
            let name = names.get(i).map_or("?", |n| n.name.as_str());
            let error = errors
                .get(i)
                .and_then(Option::as_ref)
                .map(ToString::to_string)
                .unwrap_or_default();
            tracing::warn!(%name, %error, "DNS lookup failed; keeping its last answer");
        }
        for i in &report.recovered {
            let name = names.get(*i).map_or("?", |n| n.name.as_str());
            tracing::info!(%name, "DNS lookup works again");
        }
        for addr in &report.added {
            tracing::info!(%addr, "DNS discovery: new address");
        }
        for (addr, peer) in &report.removed {
            let peer = peer.as_deref().unwrap_or("-");
            tracing::info!(%addr, %peer, "DNS discovery: address gone; its peer is not dialled again");
        }
        if report.left_out > 0 {
            tracing::warn!(
                left_out = report.left_out,
                max_peers = self.setup.config.discovery.max_peers,
                "DNS gives more addresses than discovery.max_peers; the rest are left out"
            );
        }
        metrics::gauge!("ferry_discovery_addresses").set(discovery.addresses() as f64);
        self.discover(ctx);
    }
}

impl Handler<ProbeEnded> for Coordinator {
    type Result = ();

    fn handle(&mut self, msg: ProbeEnded, ctx: &mut Self::Context) {
        let Some(discovery) = self.discovery.as_mut() else {
            return;
        };
        let addr = msg.addr;
        match (
            discovery.handle_probed(addr, msg.result.as_ref().map(Clone::clone).map_err(drop)),
            msg.result,
        ) {
            (Probed::Peer(peer), _) => tracing::info!(%addr, %peer, "DNS discovery: found a peer"),
            (Probed::Myself, _) => tracing::debug!(%addr, "DNS discovery: this node's own address"),
            (Probed::Failed { first: true }, Err(error)) => {
                tracing::warn!(%addr, %error, "DNS discovery: nobody answered a probe; trying again each round");
            }
            (Probed::Failed { .. }, Err(error)) => {
                tracing::debug!(%addr, %error, "DNS discovery: probe failed again");
            }
            _ => {}
        }
        self.discover(ctx);
    }
}
