//! Pushes that borrow the receiver's memory (ipc, ucx). Receiving: a buffer reserved, lent
//! in the grant (an ipc export of device memory, or a UCX registration), kept until the
//! peer says `Written`, then delivered or freed. A lent buffer the peer may still write is
//! never freed at once: abandoned, it waits for `Written` within the lease timeout (else
//! the link goes); on a lost session it is quarantined. How a buffer is lent, given back
//! and retired is its transport's ([`Lend`], [`LentMemory`]). Sending: the target's
//! transport writes (its part's `write`), and [`TransferActor::written`] tells the peer.

use super::*;

/// The buffers lent to the peer.
#[derive(Debug, Default)]
pub(super) struct LentState {
    /// By inbound transfer, until the peer says `Written`.
    pub(super) buffers: HashMap<InboundId, Box<dyn LentMemory>>,
    /// Those whose transfer was abandoned: no longer counted by the session, so bounded
    /// here (a peer past `limits.inbound` of them loses the link).
    pub(super) abandoned: HashSet<InboundId>,
}

/// A landing reserved for an inbound transfer.
pub(super) enum Landed {
    /// The bytes land here: pulled, or streamed over the link.
    Plain(Buffer),
    /// Lent to the peer's push (what goes in the grant), or why it could not be.
    Lent(Result<(Box<dyn LentMemory>, ferry_transports::wire::Descriptor), String>),
}

/// Marks the export ids of buffers lent to a peer's pushes (the peer's transfer ids) apart
/// from those of our own buffers offered for pulling (our op ids): both stay below it.
pub(super) const LENT: u64 = crate::core::session::MAX_TRANSFER_ID;

impl TransferActor {
    /// Who lends the landing of a push over `transport`: `None` when this node cannot (a
    /// ucx push while our UCX is gone; the reservation then fails).
    pub(super) fn lender(
        &mut self,
        transport: ferry_config::TransportName,
    ) -> Option<Arc<dyn Lend>> {
        self.part(transport)?.lender()
    }

    /// Lends `lent`, reserved for inbound push `id`, to the peer: `target` goes in the
    /// grant, and the buffer is kept until the peer says `Written`.
    pub(super) fn lend(
        &mut self,
        id: InboundId,
        transport: ferry_config::TransportName,
        lent: Result<(Box<dyn LentMemory>, ferry_transports::wire::Descriptor), String>,
    ) {
        let (buffer, target) = match lent {
            Ok((buffer, descriptor)) => (
                buffer,
                PushTarget {
                    transport,
                    descriptor,
                },
            ),
            Err(why) => {
                return self
                    .session
                    .handle_reserve_failed(id, WireReason::Unsupported, why);
            }
        };
        let landing = buffer.kind().to_wire();
        if self
            .session
            .handle_reserved(Instant::now(), id, landing, Some(target))
        {
            if let Some(spans) = self.inbound.spans.get_mut(&id) {
                spans.phase = tracing::debug_span!(parent: &spans.span, "pushed");
            }
            self.lent.buffers.insert(id, buffer);
        } else {
            // Abandoned meanwhile: nothing was lent (no grant left); it goes at once, off
            // this thread (a registration's unmapping waits).
            self.setup.io.spawn_blocking(move || drop(buffer));
        }
    }

    /// The peer no longer writes the buffer lent for inbound `id`: the transfer completes
    /// with it (a UCX registration is dropped first, off this thread), or fails and the
    /// buffer is freed.
    pub(super) fn on_written(
        &mut self,
        id: InboundId,
        error: Option<String>,
        ctx: &mut Context<Self>,
    ) {
        let Some(buffer) = self.lent.buffers.remove(&id) else {
            return;
        };
        self.lent.abandoned.remove(&id);
        if let Some(why) = error {
            tracing::debug!(peer = %self.peer, id = id.0, "the peer's push failed: {why}");
            self.free_lent(id, buffer);
            return self.session.handle_reserve_failed(
                id,
                WireReason::Unsupported,
                format!("the push failed: {why}"),
            );
        }
        if !buffer.give_back_blocks() {
            return self.completed(id, buffer.give_back(), ctx);
        }
        let unregistered = self.setup.io.spawn_blocking(move || buffer.give_back());
        ctx.spawn(unregistered.into_actor(self).map(move |joined, act, ctx| {
            match joined {
                Ok(buffer) => act.completed(id, buffer, ctx),
                Err(e) => act.session.handle_reserve_failed(
                    id,
                    WireReason::ShuttingDown,
                    format!("the lent buffer's release task failed: {e}"),
                ),
            }
            act.drive(ctx);
        }));
    }

    /// A lent buffer the peer says it no longer writes goes, as its transport says (device
    /// memory lent over ipc at once: the peer's copy ended before its `Written`; a UCX
    /// registration after the same hold as a cancelled read's, since a failed writer's
    /// last puts may still be on their way where UCX applies them here).
    fn free_lent(&self, id: InboundId, buffer: Box<dyn LentMemory>) {
        let exports = self.retire(vec![(OpId(LENT | id.0), buffer.retire(true))]);
        if !exports.is_empty() {
            actix::spawn(quarantine(exports, self.peer.clone(), self.epoch));
        }
    }

    /// Inbound push `id` was abandoned while its buffer is lent: the peer must give it back
    /// (`Written`) within the lease timeout, or the link goes (its session ends, which ends
    /// its copies) and the buffer is quarantined with the rest.
    pub(super) fn abandon_lent(&mut self, id: InboundId, ctx: &mut Context<Self>) {
        if !self.lent.buffers.contains_key(&id) {
            return;
        }
        self.lent.abandoned.insert(id);
        if self.lent.abandoned.len() > self.setup.limits.inbound {
            tracing::warn!(
                peer = %self.peer,
                "the peer keeps more abandoned lent buffers than it may have \
                 transfers open; dropping the link"
            );
            self.session
                .handle_link_lost("the peer kept too many abandoned lent buffers");
        }
        let link = self.link.number;
        ctx.run_later(self.setup.lease_timeout, move |act, ctx| {
            if act.link.number == link && act.lent.buffers.contains_key(&id) {
                tracing::warn!(
                    peer = %act.peer,
                    id = id.0,
                    "the peer kept a buffer it was pushing into past the lease timeout; \
                     dropping the link"
                );
                act.session
                    .handle_link_lost("the peer did not give back a lent buffer in time");
                act.drive(ctx);
            }
        });
    }

    /// The session ended with buffers lent: the peer may still be writing them. Device
    /// memory lent over ipc goes to its domain's quarantine (returned for `exports`); a
    /// UCX registration is held as long as a cancelled read's before it goes.
    pub(super) fn quarantine_lent(
        &mut self,
    ) -> Vec<(Addr<crate::allocator::Allocator>, OpId, SharedBytes)> {
        let retired = (self.lent.buffers.drain())
            .map(|(id, buffer)| (OpId(LENT | id.0), buffer.retire(false)))
            .collect();
        self.lent.abandoned.clear();
        self.retire(retired)
    }

    /// What a push of `op` writes from: its buffer's bytes, their layout, and its stop flag
    /// (its phase becomes "push"); or why it cannot start (the op ended, or the link went
    /// just after the grant was read: no write on a dead link).
    pub(super) fn push_source(
        &mut self,
        op: OpId,
    ) -> Result<(SharedBytes, Layout, Arc<AtomicBool>), MoveError> {
        let Some(entry) = self.outbound.entries.get_mut(&op) else {
            return Err(MoveError::new("the transfer ended"));
        };
        if let Some(why) = self.session.lost_reason() {
            return Err(MoveError::new(format!("the link is gone: {why}")));
        }
        entry.phase = tracing::debug_span!(parent: &entry.span, "push");
        let layout = match &entry.what {
            StreamWhat::Transfer(layout) => layout.clone(),
            StreamWhat::Put { .. } => Layout::Contiguous,
        };
        Ok((entry.buffer.share(), layout, Arc::clone(&entry.stop)))
    }

    /// Writes op `op`'s bytes into the buffer the peer lent as `target`, by the target's
    /// transport, off this thread; then the peer hears `Written`.
    pub(super) fn start_write(&mut self, op: OpId, target: PushTarget, ctx: &mut Context<Self>) {
        let (source, layout, stop) = match self.push_source(op) {
            Ok(started) => started,
            Err(why) => return self.written(op, Err(why), ctx),
        };
        let transport = target.transport;
        let Some(part) = self.part(transport) else {
            let why = MoveError::new(format!("this node does not serve {transport}"));
            return self.written(op, Err(why), ctx);
        };
        let write = part.write(&target.descriptor, source, layout, stop);
        ctx.spawn(
            write
                .into_actor(self)
                .map(move |pushed, act, ctx| act.written(op, pushed, ctx)),
        );
    }

    /// The push of `op` ended: the peer gets its buffer back (`Written`), and the op waits
    /// for the peer's `Done` or fails.
    pub(super) fn written(
        &mut self,
        op: OpId,
        pushed: Result<(), MoveError>,
        ctx: &mut Context<Self>,
    ) {
        let frame = Message::Written(Written {
            transfer: op.0,
            error: pushed.as_ref().err().map(ToString::to_string),
        });
        let sent = self
            .link
            .writer
            .as_ref()
            .is_some_and(|w| w.try_send(Outgoing::Frame(frame)).is_ok());
        if !sent {
            // The peer's buffer must not stay lent on a link that goes on: it goes.
            self.session
                .handle_link_lost("the link's send queue overflowed or closed");
        }
        match pushed {
            Ok(()) => self.session.handle_stream_ended(op),
            Err(why) => {
                tracing::warn!(peer = %self.peer, id = op.0, "push failed: {why}");
                metrics::counter!("ferry_push_failures_total").increment(1);
                self.session.handle_write_failed(op, why.to_string());
            }
        }
        self.drive(ctx);
    }
}
