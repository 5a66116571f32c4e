//! The coordinator's links: a link that came up (dialed or accepted, the two of a
//! simultaneous dial settled by name), a dial that failed or that another node answered,
//! and the count of peers with a live link.

use actix::prelude::*;

use ferry_transports::link::Link;

use super::{Coordinator, DialFailed, Dialed, LinkState, LinkUp, send_lost};
use crate::peer::{Attach, DialRefused};

/// The links' bookkeeping: how many are up, and a dial that another node answered.
impl Coordinator {
    /// Sets `ferry_peers_connected`: the peers with a live link.
    pub(super) fn count_connected(&self) {
        let up = self
            .sessions
            .values()
            .filter(|s| matches!(s.state, LinkState::Up { .. }))
            .count();
        metrics::gauge!("ferry_peers_connected").set(up as f64);
    }

    /// A link this node dialed for `dialed.peer` was answered by the node `answered`: the
    /// link is closed (the answering node, told whom the dial was for, keeps no session for
    /// it), the session that dialed fails with both names, and an address DNS discovery gave
    /// is known by the node that answered from now on.
    fn wrong_node_answered(&mut self, mut link: Link, dialed: &Dialed, answered: &str) {
        let why = format!(
            "dialed {} for peer {}, but node {answered} answered there",
            dialed.endpoint, dialed.peer
        );
        tracing::warn!(
            expected = %dialed.peer,
            %answered,
            endpoint = %dialed.endpoint,
            "the wrong node answered a dial: {why}"
        );
        metrics::counter!("ferry_dial_failures_total").increment(1);
        self.setup.transfer.io.spawn(async move {
            let _ = link.writer.shutdown().await;
        });
        // The address the dial took, when DNS discovery gave it (not `[[peers]]`) and the
        // peer is still learnt there (a round may have moved it while the dial was on its
        // way: another address of the peer is not relabelled).
        let is_static = self
            .setup
            .config
            .peers
            .iter()
            .any(|p| p.name == dialed.peer);
        let took = dialed.endpoint.socket_addr();
        if let Some(discovery) = self.discovery.as_mut()
            && !is_static
            && let Some(addr) = took
            && discovery.is_at(&dialed.peer, addr)
        {
            discovery.handle_answered(addr, answered);
        }
        self.end_dialing(&dialed.peer, dialed.epoch, &why);
    }

    /// The session `epoch` of `peer`, still dialing, failed for `why`: its actor fails its
    /// ops with that reason and stops, and the session is forgotten now, not when the actor's
    /// end arrives: a send in between would otherwise reach an actor that is gone and fail
    /// with no reason; it dials again instead.
    pub(super) fn end_dialing(&mut self, peer: &str, epoch: u64, why: &str) {
        if self
            .sessions
            .get(peer)
            .is_some_and(|s| s.epoch == epoch && s.state == LinkState::Dialing)
            && let Some(s) = self.sessions.remove(peer)
        {
            send_lost(&s.addr, why);
            self.publish_direct(peer, None);
            self.count_connected();
        }
    }
}

impl Handler<LinkUp> for Coordinator {
    type Result = ();

    fn handle(&mut self, msg: LinkUp, ctx: &mut Self::Context) {
        let peer = msg.link.peer_hello.node.clone();
        let me = self.name().to_string();
        let io = self.setup.transfer.io.clone();
        let refuse = |mut link: Link, why: &str| {
            tracing::info!(%peer, why, "refusing a link");
            // Goodbye as the first frame tells a dialer it was refused, not cut off.
            io.spawn(async move {
                let _ = link
                    .writer
                    .send(&ferry_transports::wire::Message::Goodbye)
                    .await;
                let _ = link.writer.shutdown().await;
            });
        };
        if let Some(dialed) = &msg.dialed
            && dialed.peer != peer
        {
            self.wrong_node_answered(msg.link, dialed, &peer);
            // A relearnt address: dial the node that answered there now.
            return self.discover(ctx);
        }
        if peer == me {
            return refuse(msg.link, "the peer has this node's own name");
        }
        if self.draining {
            return refuse(msg.link, "shutting down");
        }
        let existing = self.sessions.get(&peer).map(|s| (s.epoch, s.state));
        let attach_to = match (msg.dialed.as_ref().map(|d| d.epoch), existing) {
            // Our own dial came back, and the session still waits for it.
            (Some(epoch), Some((e, LinkState::Dialing))) if epoch == e => Some(e),
            // Our dial lost to a link the peer dialed meanwhile.
            (Some(_), _) => None,
            (None, None) => Some(self.new_session(&peer, LinkState::Dialing, ctx)),
            // Both dialed at once: the link dialed by the lower name wins.
            (None, Some((e, LinkState::Dialing))) => (peer < me).then_some(e),
            // We dialed too and our link is up, but the peer's wins the tie-break: it never
            // read ours, so the session moves to the peer's link and offers again.
            (None, Some((e, LinkState::Up { dialed_by_me: true }))) => (peer < me).then_some(e),
            // The peer reconnected (it restarted, or lost the old link first).
            (
                None,
                Some((
                    _,
                    LinkState::Up {
                        dialed_by_me: false,
                    },
                )),
            ) => Some(self.new_session(&peer, LinkState::Dialing, ctx)),
        };
        let Some(epoch) = attach_to else {
            return refuse(msg.link, "a link to this peer already exists");
        };
        if let Some(s) = self.sessions.get_mut(&peer)
            && s.epoch == epoch
        {
            s.state = LinkState::Up {
                dialed_by_me: msg.dialed.is_some(),
            };
            s.hello = Some(msg.link.peer_hello.clone());
            let addr = s.addr.clone();
            // Queued before the node's sends may go to the actor directly.
            let attach = addr.send(Attach {
                link: msg.link,
                dialed: msg.dialed.is_some(),
            });
            self.publish_direct(&peer, None);
            ctx.spawn(
                async move {
                    let _ = attach.await;
                }
                .into_actor(self),
            );
            self.count_connected();
        }
    }
}

impl Handler<DialFailed> for Coordinator {
    type Result = ();

    fn handle(&mut self, msg: DialFailed, _: &mut Self::Context) {
        tracing::warn!(peer = %msg.peer, error = %msg.error, "dial failed");
        metrics::counter!("ferry_dial_failures_total").increment(1);
        self.end_dialing(&msg.peer, msg.epoch, &msg.error);
    }
}

impl Handler<DialRefused> for Coordinator {
    type Result = ();

    fn handle(&mut self, msg: DialRefused, ctx: &mut Self::Context) {
        let Some(s) = self.sessions.get_mut(&msg.peer) else {
            return;
        };
        if s.epoch != msg.epoch {
            return;
        }
        // The peer keeps a link of its own to us (the tie-break), which is on its way. If it
        // does not come, the session's ops fail.
        s.state = LinkState::Dialing;
        self.count_connected();
        self.publish_direct(&msg.peer, None);
        let wait = self.setup.config.limits.connect_timeout;
        ctx.run_later(wait, move |act, _| {
            act.end_dialing(
                &msg.peer,
                msg.epoch,
                "the peer refused our link and did not connect back in time",
            );
        });
    }
}
