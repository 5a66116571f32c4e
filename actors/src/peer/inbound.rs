//! Inbound transfers: memory reserved across the tiers (or spilled) for an offer, and a
//! completed transfer waiting for its turn to be delivered.

use super::*;

impl TransferActor {
    pub(super) fn reserve(
        &mut self,
        id: InboundId,
        len: u64,
        how: Landing,
        ctx: &mut Context<Self>,
    ) {
        // A write into a region of ours that cannot land is refused before a byte moves.
        if let Some(into) = self.session.inbound_into(id)
            && let Err(why) = self.setup.published.check_write(into, len)
        {
            tracing::debug!(peer = %self.peer, id = id.0, why = %why.detail, "write refused");
            self.pulls.sources.remove(&id);
            self.inbound.spans.remove(&id);
            self.session
                .handle_reserve_failed(id, why.reason, why.detail);
            return self.drive(ctx);
        }
        // Streamed bytes, and reads and writes over a UCX that does not move device
        // memory, land in a host tier.
        let lender = match how {
            Landing::Push(transport) => match self.lender(transport) {
                Some(lender) => Some(lender),
                None => {
                    let why = format!("this node no longer serves {transport}");
                    self.session
                        .handle_reserve_failed(id, WireReason::Unsupported, why);
                    return self.drive(ctx);
                }
            },
            _ => None,
        };
        // The transport that reads or writes it, if not the link's streams: where it cannot
        // move device memory, host tiers.
        let by = match how {
            Landing::Pull => self.pulls.sources.get(&id).map(|(s, _)| s.transport),
            Landing::Push(transport) => Some(transport),
            Landing::Stream | Landing::Relayed => None,
        };
        let host_only = by
            .and_then(|t| self.part(t))
            .is_some_and(|part| !part.lands_in_device());
        let tiers = if how == Landing::Stream || host_only {
            self.setup.host_tiers.clone()
        } else {
            self.setup.tiers.clone()
        };
        let deadline = Instant::now() + self.setup.reserve_timeout;
        // A streamed receive overwrites every byte of its buffer, in order, before it
        // completes: its host memory need not be zeroed.
        let fill = if how == Landing::Stream {
            Fill::Overwritten
        } else {
            Fill::Zeroed
        };
        // Placed one at a time, in offer order (so each tier's queue holds this peer's
        // reservations in that order: a try never passes one waiting there), granted side
        // by side (one waiting for a full tier holds up no other's), and each result handled
        // only after the one before it (ready in the same poll as its signal), so grants
        // leave in offer order.
        let (previous_placed, previous_handled) =
            (self.inbound.placing.take(), self.inbound.reserving.take());
        let (placed, next_placed) = oneshot::channel();
        let (handled, next_handled) = oneshot::channel();
        self.inbound.placing = Some(next_placed);
        self.inbound.reserving = Some(next_handled);
        let io = self.setup.io.clone();
        let request = async move {
            if let Some(previous) = previous_placed {
                let _ = previous.await;
            }
            let placement = place_in_tiers_off_actor(&tiers, &[len], deadline, &io, fill).await;
            let _ = placed.send(());
            let got = match placement {
                Ok(placement) => landing_when_granted(placement, &io, lender).await,
                Err(e) => Err(e),
            };
            if let Some(previous) = previous_handled {
                let _ = previous.await;
            }
            let _ = handled.send(());
            got
        };
        ctx.spawn(
            request
                .into_actor(self)
                .map(move |res, act, ctx| act.reserve_ended(id, len, how, res, ctx)),
        );
    }

    /// The reservation for inbound `id` ended: start moving its bytes (pull, lend, or a
    /// region the peer streams into), or fail the transfer with the reason.
    fn reserve_ended(
        &mut self,
        id: InboundId,
        len: u64,
        how: Landing,
        res: Result<Landed, Error>,
        ctx: &mut Context<Self>,
    ) {
        match res {
            Ok(Landed::Lent(lent)) => {
                let Landing::Push(transport) = how else {
                    return self.drive(ctx);
                };
                self.lend(id, transport, lent);
                return self.drive(ctx);
            }
            Ok(Landed::Plain(buffer)) => {
                let landing = buffer.kind();
                if self.setup.tiers.first().is_some_and(|t| t.kind != landing) {
                    metrics::counter!("ferry_spill_bytes_total").increment(len);
                    tracing::debug!(peer = %self.peer, id = id.0, %landing, "receive spilled");
                }
                if how == Landing::Pull {
                    if let Some(spans) = self.inbound.spans.get(&id) {
                        tracing::trace!(
                            target: crate::TRACE_BLOCKS,
                            id = id.0,
                            blocks = spans.blocks,
                            reserve_us = spans.offered.elapsed().as_micros() as u64,
                            %landing,
                            "reserved: pulling"
                        );
                    }
                    if !self.session.handle_reserved_pull(id) {
                        self.pulls.sources.remove(&id);
                    } else {
                        self.start_pull(id, buffer, ctx);
                    }
                    return self.drive(ctx);
                }
                // The region must exist before the grant leaves, since the peer
                // streams as soon as it reads the grant. (A push that spilled to host
                // memory streams too.)
                self.inbound
                    .regions
                    .insert(id.0, InboundRegion::new(buffer));
                if self
                    .session
                    .handle_reserved(Instant::now(), id, landing.to_wire(), None)
                {
                    if let Some(spans) = self.inbound.spans.get_mut(&id) {
                        spans.phase = tracing::debug_span!(parent: &spans.span, "receive");
                    }
                } else {
                    self.inbound.regions.remove(&id.0);
                }
            }
            Err(e) => {
                self.pulls.sources.remove(&id);
                if let Some(spans) = self.inbound.spans.remove(&id) {
                    tracing::debug!(parent: &spans.span, error = %e, "no memory");
                }
                let reason = match &e {
                    Error::NoMemory {
                        cause: crate::error::NoMemoryCause::DeadlinePassed,
                        ..
                    } => WireReason::DeadlineExceeded,
                    Error::NoMemory { .. } => WireReason::TooLarge,
                    _ => WireReason::ShuttingDown,
                };
                self.session
                    .handle_reserve_failed(id, reason, e.to_string());
            }
        }
        self.drive(ctx);
    }

    /// Every byte of inbound `id` is in `buffer` (streamed, pulled or pushed): it waits for
    /// its turn to be delivered, or, a write into a region of ours, is placed there first
    /// (off this thread; `Done` leaves once it is). A transfer abandoned meanwhile drops the
    /// buffer here.
    pub(super) fn completed(&mut self, id: InboundId, buffer: Buffer, ctx: &mut Context<Self>) {
        let Some(into) = self.session.inbound_into(id).cloned() else {
            self.complete(id, buffer);
            return;
        };
        let (published, io) = (Arc::clone(&self.setup.published), self.setup.io.clone());
        let until = tokio::time::Instant::now() + self.setup.reserve_timeout;
        let packed = buffer.len() as u64;
        let completed = Instant::now();
        let abort = Arc::new(std::sync::atomic::AtomicBool::new(false));
        self.inbound.writes_placing.insert(id, Arc::clone(&abort));
        self.session.handle_placing(id);
        let place = {
            let into = into.clone();
            async move {
                let region = (into.region, into.generation);
                published
                    .write_region(region, buffer, &into.layout, until, (&io, Some(abort)))
                    .await
            }
        };
        ctx.spawn(place.into_actor(self).map(move |placed, act, ctx| {
            if act.inbound.writes_placing.remove(&id).is_none() {
                // Abandoned meanwhile: nothing is owed to the peer (if the copy had taken
                // the region's lock before, its places hold the bytes; if not, nothing
                // was placed).
                return act.drive(ctx);
            }
            match placed {
                Ok(landing) => {
                    tracing::trace!(
                        target: crate::TRACE_BLOCKS,
                        id = id.0,
                        bytes = packed,
                        since_pull_us = act
                            .inbound
                            .spans
                            .get(&id)
                            .and_then(|s| s.pulling)
                            .map(|t| t.elapsed().as_micros() as u64),
                        place_us = completed.elapsed().as_micros() as u64,
                        "write placed"
                    );
                    // Delivered to no one: the bytes are where the peer said.
                    if act.complete(id, landing) {
                        act.inbound.written.insert(id);
                    }
                }
                Err(e) => {
                    tracing::warn!(peer = %act.peer, id = id.0, "a write did not land: {e}");
                    // Unregistered meanwhile, or read by peers until the deadline.
                    let reason = match act.setup.published.check_write(&into, packed) {
                        Err(why) => why.reason,
                        Ok(()) if matches!(e, Error::DeadlineExceeded) => {
                            WireReason::DeadlineExceeded
                        }
                        Ok(()) => WireReason::Protocol,
                    };
                    act.inbound.spans.remove(&id);
                    act.session.handle_reserve_failed(id, reason, e.to_string());
                }
            }
            act.drive(ctx);
        }));
    }

    /// Inbound `id`'s bytes are in place: it waits for its turn to be delivered. False
    /// when it is not receiving any more (abandoned meanwhile: the buffer is dropped).
    fn complete(&mut self, id: InboundId, buffer: Buffer) -> bool {
        let receiving = self.session.handle_inbound_complete(id);
        if receiving {
            if let Some(spans) = self.inbound.spans.get_mut(&id) {
                spans.phase = tracing::debug_span!(parent: &spans.span, "deliver");
            }
            self.inbound
                .complete
                .insert(id, (buffer, self.inbound.undelivered.enter()));
        }
        receiving
    }
}

/// The peer's offers we pull, by inbound transfer: where to read (and the layout of the
/// bytes there) until the pull ends, and which pulls run now.
#[derive(Default)]
pub(super) struct Pulls {
    pub(super) sources: HashMap<InboundId, (PullSource, Layout)>,
    /// Pulls whose copy runs now.
    pub(super) pulling: HashSet<InboundId>,
    /// Pulls abandoned while their copy ran: the peer is told once the copy ended.
    pub(super) abandoned: HashSet<InboundId>,
}

impl TransferActor {
    /// Copies pulled transfer `id` out of the peer's memory into `buffer`, by the source's
    /// transport, off this thread; the result comes back to the session.
    pub(super) fn start_pull(&mut self, id: InboundId, buffer: Buffer, ctx: &mut Context<Self>) {
        let Some((source, layout)) = self.pulls.sources.get(&id).cloned() else {
            return;
        };
        self.pulls.pulling.insert(id);
        if let Some(spans) = self.inbound.spans.get_mut(&id) {
            spans.phase = tracing::debug_span!(parent: &spans.span, "pull");
            spans.pulling = Some(Instant::now());
        }
        let transport = source.transport;
        let Some(part) = self.part(transport) else {
            let why = MoveError::new(format!("this node does not serve {transport}"));
            return self.pull_ended(id, Err(why), ctx);
        };
        let pull = part.pull(&source.descriptor, layout, buffer);
        ctx.spawn(
            pull.into_actor(self)
                .map(move |pulled, act, ctx| act.pull_ended(id, pulled, ctx)),
        );
    }

    /// Pull `id` ended: deliver the buffer, or fail the transfer; an abandoned one only
    /// tells the peer it may let go.
    fn pull_ended(
        &mut self,
        id: InboundId,
        pulled: Result<Buffer, MoveError>,
        ctx: &mut Context<Self>,
    ) {
        self.pulls.pulling.remove(&id);
        if let Some(spans) = self.inbound.spans.get(&id) {
            // The copy's own steps are traced by the transport; this is them plus the hops
            // to where it ran and back to this actor.
            tracing::trace!(
                target: crate::TRACE_BLOCKS,
                id = id.0,
                blocks = spans.blocks,
                ok = pulled.is_ok(),
                pull_us = spans.pulling.map(|t| t.elapsed().as_micros() as u64),
                "pull ended"
            );
        }
        if self.pulls.abandoned.remove(&id) {
            // The import is freed; the peer may let go of its buffer. Ours (if any) is
            // dropped here, which frees it.
            self.release_to_peer(id);
            return self.drive(ctx);
        }
        self.pulls.sources.remove(&id);
        match pulled {
            Ok(buffer) => self.completed(id, buffer, ctx),
            Err(why) => {
                tracing::warn!(peer = %self.peer, id = id.0, "pull failed: {why}");
                metrics::counter!("ferry_pull_failures_total").increment(1);
                self.session
                    .handle_reserve_failed(id, WireReason::Unsupported, why.to_string());
            }
        }
        self.drive(ctx);
    }
}

/// Waits for `placement`'s buffer without blocking the actor's thread; for a push, also
/// lends it with `lender` (on a blocking thread of `io`: an export or a registration).
async fn landing_when_granted(
    placement: Placement,
    io: &tokio::runtime::Handle,
    lender: Option<Arc<dyn Lend>>,
) -> Result<Landed, Error> {
    let mut got = placement.granted().await?;
    let buffer = got.pop().ok_or(Error::ShuttingDown)?;
    let Some(lender) = lender else {
        return Ok(Landed::Plain(buffer));
    };
    if !lender.lends(&buffer).await {
        return Ok(Landed::Plain(buffer));
    }
    let lent = io.spawn_blocking(move || lender.lend(buffer));
    lent.await
        .map(|lent| Landed::Lent(lent.map_err(|e| e.to_string())))
        .map_err(|_| Error::ShuttingDown)
}

/// Where an inbound transfer's bytes land, and who puts them there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Landing {
    /// Host memory; the peer streams the bytes over the link.
    Stream,
    /// We copy them out of the peer's memory (a pull).
    Pull,
    /// The peer writes them into our memory lent to it (a push over the transport named),
    /// or streams them when this memory is not lent (host memory its transport lends no
    /// part of).
    Push(ferry_config::TransportName),
    /// Any tier, device memory first; the chunks come through host memory (a transport's
    /// thread copies them in from the peer's ring, or the link's reader does).
    Relayed,
}
