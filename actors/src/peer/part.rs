//! The session's transport parts: one [`PeerTransport`] per transport the node serves,
//! made by the node's transports when the session starts, and what the shell does with
//! what they ask of it. The shell names no transport: it finds a part by the name an offer,
//! a grant, a message or a route carries.
//!
//! [`PeerTransport`]: ferry_transports::transport::PeerTransport

use super::*;
use ferry_transports::memory::MemoryKind;
use ferry_transports::transport::{
    Attached, PartEvent, PeerEnv, PeerTransport, Retired, Transport, TransportError,
};

pub(super) use ferry_transports::transport::{Exported, Exporting, Lend, LentMemory};

/// Why a pull or a push failed (the transport's words and cause).
pub(super) type MoveError = TransportError;

/// The parts of one session, one per transport of the node, in the registry's order.
#[derive(Default)]
pub(super) struct Parts(Vec<Box<dyn PeerTransport>>);

impl Parts {
    /// Each of `transports`' part of the session with `peer`.
    pub(super) fn open(transports: &[Arc<dyn Transport>], env: &PeerEnv) -> Self {
        Self(transports.iter().map(|t| t.open(env.clone())).collect())
    }

    /// The part of `transport`, if the node serves it.
    pub(super) fn get(
        &mut self,
        transport: ferry_config::TransportName,
    ) -> Option<&mut dyn PeerTransport> {
        let found = self.0.iter_mut().find(|p| p.transport() == transport)?;
        Some(&mut **found)
    }

    /// Every part.
    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Box<dyn PeerTransport>> {
        self.0.iter_mut()
    }

    /// Whether a part waits on the peer (a setup step).
    pub(super) fn await_peer(&self) -> bool {
        self.0.iter().any(|p| p.awaits_peer())
    }

    /// Bytes per data frame of `transport`'s sends over the link, if it says.
    pub(super) fn link_chunk(&self, transport: ferry_config::TransportName) -> Option<usize> {
        self.0
            .iter()
            .find(|p| p.transport() == transport)?
            .link_chunk()
    }

    /// When a part next needs the timer.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        self.0.iter().filter_map(|p| p.poll_timeout()).min()
    }
}

/// Wakes the session's actor when a part's own work ended: one [`PartsWoke`] in its
/// mailbox at a time. A wake that finds the mailbox full is not needed: the messages there
/// each end in a turn, which polls the parts.
pub(super) fn waker(me: Addr<TransferActor>) -> ferry_transports::transport::Wake {
    let queued = Arc::new(AtomicBool::new(false));
    Arc::new(move || {
        if !queued.swap(true, Ordering::AcqRel) {
            let _ = me.try_send(PartsWoke(Arc::clone(&queued)));
        }
    })
}

/// A part's own work ended: poll the parts.
#[derive(Message)]
#[rtype(result = "()")]
pub(super) struct PartsWoke(Arc<AtomicBool>);

impl Handler<PartsWoke> for TransferActor {
    type Result = ();
    fn handle(&mut self, PartsWoke(queued): PartsWoke, ctx: &mut Self::Context) {
        queued.store(false, Ordering::Release);
        self.drive(ctx);
    }
}

impl TransferActor {
    /// The part of `transport`, if the node serves it.
    pub(super) fn part(
        &mut self,
        transport: ferry_config::TransportName,
    ) -> Option<&mut dyn PeerTransport> {
        self.parts.get(transport)
    }

    /// A new link: every part hears of it, and the session learns which transports take
    /// the peer's offers.
    pub(super) fn attach_parts(&mut self, hello: &ferry_transports::wire::Hello) {
        let same_host = *hello.host_id == *self.setup.host_id;
        let attached = Attached {
            hello,
            same_host,
            link: self.link.number,
            activity: self.link.activity.clone().unwrap_or_default(),
            regions: Arc::clone(&self.inbound.regions),
        };
        let serves: Vec<_> = (self.parts.iter_mut())
            .map(|p| (p.transport(), p.attach(&attached)))
            .collect();
        for (transport, serves) in serves {
            self.session.set_serves(transport, serves);
        }
    }

    /// Takes what the parts have for the shell: their messages to the peer's parts (to the
    /// writer, once the link is welcomed) and their events.
    pub(super) fn drive_parts(&mut self, ctx: &mut Context<Self>) {
        let welcomed = self.link.writer.is_some() && self.link.welcomed;
        let mut messages = Vec::new();
        let mut events = Vec::new();
        for part in self.parts.iter_mut() {
            let transport = part.transport();
            if welcomed {
                while let Some(body) = part.poll_message() {
                    messages.push(Message::Transport(
                        ferry_transports::wire::TransportMessage {
                            transport: transport.into(),
                            body,
                        },
                    ));
                }
            }
            while let Some(event) = part.poll_event() {
                events.push((transport, event));
            }
        }
        for msg in messages {
            let sent = (self.link.writer.as_ref())
                .is_some_and(|w| w.try_send(Outgoing::Frame(msg)).is_ok());
            if !sent {
                self.session
                    .handle_link_lost("the link's send queue overflowed or closed");
                break;
            }
        }
        let released = !events.is_empty();
        for (transport, event) in events {
            self.on_part_event(transport, event, ctx);
        }
        if released {
            self.release_held(ctx);
        }
    }

    /// What a part asked of the shell.
    fn on_part_event(
        &mut self,
        transport: ferry_config::TransportName,
        event: PartEvent,
        ctx: &mut Context<Self>,
    ) {
        match event {
            PartEvent::Settled(outcome) => self.settled(transport, outcome, ctx),
            PartEvent::Proceed(ticket) => self.outbound.held.settled(transport, ticket, None),
            PartEvent::FallBack(ticket, why) => {
                self.outbound.held.settled(transport, ticket, Some(why))
            }
            PartEvent::FastPath(path) => {
                let lane = Arc::new(crate::direct::FastLane::new(transport, path));
                self.setup.peers.set_lane(&self.peer, Arc::clone(&lane));
                let paths = &mut self.outbound.fast_paths;
                if let Some(i) = paths.iter().position(|l| l.transport == transport) {
                    paths.swap_remove(i).path.close();
                }
                paths.push(lane);
            }
            PartEvent::Broke(why) => {
                tracing::warn!(peer = %self.peer, %transport, "dropping the link: {why}");
                self.session
                    .handle_link_lost(&format!("{transport}: {why}"));
            }
            PartEvent::InboundDone { id, buffer } => self.completed(InboundId(id), buffer, ctx),
            PartEvent::InboundFailed { id, why } => {
                tracing::warn!(peer = %self.peer, id, "inbound transfer failed: {why}");
                self.session
                    .handle_reserve_failed(InboundId(id), WireReason::Unsupported, why);
            }
            PartEvent::StreamEnded { op, broken } => {
                if let Some(why) = broken {
                    self.session
                        .handle_link_lost(&format!("the {transport} channel failed: {why}"));
                }
                if let Some(entry) = self.outbound.entries.get_mut(&op) {
                    // Every byte is on its way: wait for the peer's Done (or PutAck).
                    entry.phase = tracing::debug_span!(parent: &entry.span, "ack");
                }
                self.session.handle_stream_ended(op);
            }
            PartEvent::StreamOverLink(op) => self.stream_over_link(op),
        }
    }

    /// A part's setup with the peer settled: the coordinator routes by it (the fast path,
    /// if one opened, was published first: the coordinator gives it its routes on this
    /// notice, which therefore waits for room in a full mailbox rather than being lost).
    fn settled(
        &mut self,
        transport: ferry_config::TransportName,
        outcome: ferry_transports::transport::setup::SetupOutcome,
        ctx: &mut Context<Self>,
    ) {
        let notice = SetupSettled {
            peer: self.peer.clone(),
            epoch: self.epoch,
            transport,
            outcome,
        };
        if let Err(actix::prelude::SendError::Full(notice)) = self.setup.settled.try_send(notice) {
            let settled = self.setup.settled.clone();
            ctx.spawn(
                async move {
                    let _ = settled.send(notice).await;
                }
                .into_actor(self),
            );
        }
    }

    /// The link is lost: what runs beside it stops (a part's lane, its ring), and the
    /// peer's fast path leaves the node's table.
    pub(super) fn detach_parts(&mut self) {
        for part in self.parts.iter_mut() {
            part.detach();
        }
        for lane in std::mem::take(&mut self.outbound.fast_paths) {
            self.setup.peers.withdraw_lane(&self.peer, &lane);
            lane.path.close();
        }
    }

    /// Hands what went with the session to where it waits out the peer: held
    /// registrations are dropped later; device memory goes to its domain's quarantine
    /// (returned).
    pub(super) fn retire(
        &self,
        retired: Vec<(OpId, Retired)>,
    ) -> Vec<(Addr<crate::allocator::Allocator>, OpId, SharedBytes)> {
        let mut exports = Vec::new();
        let mut held = Vec::new();
        for (id, r) in retired {
            match r {
                Retired::Gone => {}
                Retired::Hold(what) => held.push(what),
                Retired::Quarantine(view) => {
                    if let MemoryKind::Device(n) = view.lease().kind
                        && let Some(domain) = self.setup.gpus.domain(n)
                    {
                        exports.push((domain.actor.clone(), id, view));
                    }
                }
            }
        }
        if !held.is_empty() {
            hold_then_drop(&self.setup, held);
        }
        exports
    }
}

/// Hands `exports` to their domains' quarantine: the peer may still map them (its session
/// `epoch` ends them; the export ids carry it).
pub(super) async fn quarantine(
    exports: Vec<(Addr<crate::allocator::Allocator>, OpId, SharedBytes)>,
    peer: String,
    epoch: u64,
) {
    for (allocator, op, view) in exports {
        let export = Export {
            id: ExportId(epoch << 40 | op.0),
            peer: peer.clone(),
            view,
        };
        let _ = allocator.send(export).await;
    }
}

/// Drops `what` on a blocking thread after the longest a transfer in flight may take
/// (`memory.export_lease_timeout`): a transport may still serve a read or apply a write
/// into a registration until then.
pub(super) fn hold_then_drop<T: Send + 'static>(setup: &TransferSetup, what: Vec<T>) {
    let hold = setup.lease_timeout;
    setup.io.spawn(async move {
        tokio::time::sleep(hold).await;
        let _ = tokio::task::spawn_blocking(move || drop(what)).await;
    });
}
