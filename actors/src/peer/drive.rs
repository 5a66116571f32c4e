//! Driving the session: its events become work for the transports, its messages frames
//! on the link, its deadlines a timer.

use super::*;

impl TransferActor {
    /// Carries out everything the session asks for.
    pub(super) fn drive(&mut self, ctx: &mut Context<Self>) {
        let (claims, lane0, taken0) = &self.inbound.claims;
        let lane = claims.lane.load(Ordering::Relaxed).saturating_sub(*lane0);
        let taken = claims.taken.load(Ordering::Relaxed).saturating_sub(*taken0);
        self.session.handle_claims(lane, taken, Instant::now());
        self.drive_parts(ctx);
        loop {
            let mut moved = false;
            if let Some(writer) = self.link.writer.as_ref().filter(|_| self.link.welcomed) {
                while let Some(msg) = self.fetch.out.pop_front() {
                    if writer.try_send(Outgoing::Frame(msg)).is_err() {
                        self.session
                            .handle_link_lost("the link's send queue overflowed or closed");
                        break;
                    }
                }
                while let Some(msg) = self.session.poll_transmit() {
                    moved = true;
                    if let Message::Ping(_) | Message::Pong(_) = msg {
                        // Full: one waits already, which says the same.
                        if let Some(keepalive) = &self.link.keepalive {
                            let _ = keepalive.try_send(msg);
                        }
                        continue;
                    }
                    if let Some((op, why)) = oversized_offer(&msg, self.link.peer_max_frame) {
                        // Refused here, before the writer would refuse it and end the link.
                        self.session.handle_unsendable(op, why);
                        continue;
                    }
                    if let Message::Offer(offer) = &msg {
                        if offer.direction == WireDirection::Pull {
                            self.outbound.offered.insert(OpId(offer.transfer));
                        }
                        tracing::trace!(
                            target: crate::TRACE_BLOCKS,
                            op = offer.transfer,
                            blocks = crate::block_count(&offer.layout),
                            "offer to the writer"
                        );
                    }
                    let out = match msg {
                        Message::Offer(offer) if offer.eager => {
                            match eager_outgoing(&self.outbound.entries, offer) {
                                Ok(out) => out,
                                Err(op) => {
                                    let why = "its bytes are not host memory".to_string();
                                    self.session.handle_unsendable(op, why);
                                    continue;
                                }
                            }
                        }
                        msg => Outgoing::Frame(msg),
                    };
                    if writer.try_send(out).is_err() {
                        self.session
                            .handle_link_lost("the link's send queue overflowed or closed");
                        break;
                    }
                }
            }
            if self.session.is_lost() {
                // The link's read half ends before any caller hears of the loss: a lost
                // session reads nothing more from the peer, whose bytes would only be
                // refused.
                if let Some(reader) = self.link.reader.take() {
                    reader.abort();
                }
            }
            while let Some(ev) = self.session.poll_event() {
                moved = true;
                self.on_event(ev, ctx);
            }
            if !moved {
                break;
            }
        }
        self.heard(Instant::now());
        self.arm_timer(ctx);
        self.publish_eager();
        if self.link.writer.is_some() && self.link.welcomed {
            for tx in self.link.waiters.drain(..) {
                let _ = tx.send(Ok(()));
            }
        }
        if let Some(why) = self.session.lost_reason() {
            let why = why.to_string();
            // Submissions still in the channel when the actor stops fail with it.
            let _ = self.outbound.lost.set(why.clone());
            self.fail_fetches(&why);
            // Submissions still waiting their turn end now, with their buffers.
            let peer = self.peer.clone();
            self.fail_held(|| Error::PeerLost {
                peer: peer.clone(),
                detail: why.clone(),
            });
            for tx in self.link.waiters.drain(..) {
                let _ = tx.send(Err(Error::PeerUnreachable {
                    peer: self.peer.clone(),
                    detail: why.to_string(),
                }));
            }
        }
        if self.session.is_idle() {
            for tx in self.outbound.drained.drain(..) {
                let _ = tx.send(());
            }
        }
        if self.session.is_lost() {
            // The lanes and staging rings end with the link: a sender must not wait on a
            // dead peer's ring, nor keep copying into one nobody reads (the read half ended
            // above; the write half ends once its stream stops).
            self.detach_parts();
            // A registration under way ends first (its send then fails as lost).
            if self.session.is_idle()
                && self.outbound.entries.is_empty()
                && !self.outbound.held.exporting
            {
                ctx.stop();
            }
        }
    }

    pub(super) fn on_event(&mut self, ev: SessionEvent, ctx: &mut Context<Self>) {
        match ev {
            SessionEvent::Stream(op) => self.start_stream(op),
            SessionEvent::StopStream(op) => {
                if let Some(entry) = self.outbound.entries.get(&op) {
                    entry.stop.store(true, Ordering::Release);
                }
            }
            SessionEvent::Finished(op, outcome) => self.finish(op, outcome),
            SessionEvent::Reserve {
                id,
                len,
                pull,
                push,
                relayed,
                layout,
            } => {
                let span =
                    tracing::debug_span!("inbound", id = id.0, peer = %self.peer, bytes = len);
                let phase = tracing::debug_span!(parent: &span, "reserve");
                let blocks = crate::block_count(&layout);
                tracing::trace!(
                    target: crate::TRACE_BLOCKS,
                    id = id.0,
                    blocks,
                    bytes = len,
                    pull = pull.is_some(),
                    "offer taken: reserving"
                );
                self.inbound.spans.insert(
                    id,
                    InboundSpans {
                        span,
                        phase,
                        offered: Instant::now(),
                        pulling: None,
                        blocks,
                    },
                );
                let landing = match (pull, push) {
                    (Some(source), _) => {
                        self.pulls.sources.insert(id, (source, layout));
                        Landing::Pull
                    }
                    (None, Some(transport)) => Landing::Push(transport),
                    (None, None) if relayed => Landing::Relayed,
                    (None, None) => Landing::Stream,
                };
                self.reserve(id, len, landing, ctx);
            }
            SessionEvent::Write(op, target) => self.start_write(op, target, ctx),
            SessionEvent::Written { id, error } => self.on_written(id, error, ctx),
            SessionEvent::Deliver {
                id,
                fetch: Some(fetch),
                transport,
                ..
            } => self.land_fetch(id, fetch, transport),
            SessionEvent::Deliver {
                id,
                tag,
                transport,
                layout,
                fetch: None,
            } => self.deliver(id, tag, transport, layout),
            SessionEvent::Abandon(id) => self.abandon(id, ctx),
        }
    }

    /// Inbound transfer `id` is complete and it is its turn: into the inbox.
    fn deliver(
        &mut self,
        id: InboundId,
        tag: u64,
        transport: ferry_config::TransportName,
        layout: Layout,
    ) {
        let spans = self.inbound.spans.remove(&id);
        if let Some(spans) = &spans {
            tracing::debug!(parent: &spans.span, tag, "delivered");
        }
        let Some((buffer, pending)) = self.inbound.complete.remove(&id) else {
            return;
        };
        if self.inbound.written.remove(&id) {
            // A write into a region of ours: its bytes are there, its landing goes, and
            // what the session counts as delivered is taken at once.
            self.inbound
                .claims
                .0
                .taken
                .fetch_add(buffer.len() as u64, std::sync::atomic::Ordering::Relaxed);
            drop((buffer, pending));
            return;
        }
        if let Some(spans) = &spans {
            tracing::trace!(
                target: crate::TRACE_BLOCKS,
                id = id.0,
                blocks = spans.blocks,
                since_offer_us = spans.offered.elapsed().as_micros() as u64,
                since_pull_us = spans.pulling.map(|t| t.elapsed().as_micros() as u64),
                "delivering"
            );
        }
        // Straight into the inbox (a short lock, no mailbox between): then it no longer
        // counts as on its way, and a lane record from this peer waiting for it goes on.
        (self.setup.inbox).deliver(&self.peer, tag, transport, layout, buffer);
        drop(pending);
    }

    /// Inbound transfer `id` was abandoned: what was reserved for it goes, except a buffer
    /// lent to the peer (kept until it says `Written`) or one being pulled into.
    fn abandon(&mut self, id: InboundId, ctx: &mut Context<Self>) {
        if let Some(spans) = self.inbound.spans.remove(&id) {
            tracing::debug!(parent: &spans.span, "abandoned");
        }
        self.inbound.regions.remove(&id.0);
        self.inbound.complete.remove(&id);
        self.inbound.written.remove(&id);
        // A write being placed lands nowhere now.
        if let Some(abort) = self.inbound.writes_placing.remove(&id) {
            abort.store(true, std::sync::atomic::Ordering::Release);
        }
        // A lent buffer the peer may be writing into is kept until it says Written.
        self.abandon_lent(id, ctx);
        if self.pulls.sources.remove(&id).is_some() {
            if self.pulls.pulling.contains(&id) {
                self.pulls.abandoned.insert(id);
            } else {
                // Never imported: the peer may let go of its buffer now.
                self.release_to_peer(id);
            }
        }
    }

    pub(super) fn arm_timer(&mut self, ctx: &mut Context<Self>) {
        let parts = self.parts.poll_timeout();
        let next = self.session.poll_timeout().into_iter().chain(parts).min();
        self.timer.arm(
            ctx,
            next,
            |a| &mut a.timer,
            |act, now, ctx| {
                act.session.handle_timeout(now);
                // A fresh count first, so that only a link that really moved nothing ends
                // the transfers waiting on it.
                if let Some(activity) = &act.link.activity {
                    act.session.handle_link_progress(activity.bytes(), now);
                }
                act.heard(now);
                let was_lost = act.session.is_lost();
                act.session.handle_stall_check(now);
                // The peer, waited on, went silent: said here, as a link that fails is.
                if !was_lost && let Some(why) = act.session.lost_reason() {
                    tracing::warn!(peer = %act.peer, why, "link down");
                }
                for part in act.parts.iter_mut() {
                    part.handle_timeout(now);
                }
                act.drive(ctx);
            },
        );
    }

    /// Tells the session what the link has received from the peer, and whether this shell
    /// waits on the peer for something the session does not see: a transport's setup step,
    /// or the answer to a fetch whose caller still waits.
    fn heard(&mut self, now: Instant) {
        let Some(activity) = &self.link.activity else {
            return;
        };
        let elsewhere = self.fetch.awaits_peer() || self.parts.await_peer();
        self.session
            .handle_heard(activity.received(), elsewhere, now);
    }

    pub(super) fn finish(&mut self, op: OpId, outcome: Outcome) {
        // A pull never offered cannot be read by the peer, which will not say Done: its
        // view goes now. An offered one stays until the peer lets go.
        if !self.outbound.offered.remove(&op) {
            self.unexport(op);
        }
        let Some(entry) = self.outbound.entries.remove(&op) else {
            return;
        };
        let status = match &outcome {
            Outcome::Completed => "completed",
            Outcome::Failed(_) => "failed",
            Outcome::Cancelled => "cancelled",
        };
        metrics::counter!("ferry_transfers_total", "status" => status).increment(1);
        if outcome == Outcome::Completed {
            let TransferLabels {
                transport,
                direction,
                peer_class,
            } = &entry.labels;
            metrics::counter!("ferry_transfer_bytes_total", "transport" => transport.as_str(),
                "direction" => *direction, "peer_class" => *peer_class)
            .increment(entry.moved());
            metrics::histogram!("ferry_transfer_duration_seconds")
                .record(entry.started.elapsed().as_secs_f64());
        }
        tracing::debug!(parent: &entry.span, ?outcome, "transfer ended");
        if let StreamWhat::Transfer(layout) = &entry.what {
            tracing::trace!(
                target: crate::TRACE_BLOCKS,
                op = op.0,
                blocks = crate::block_count(layout),
                completed = outcome == Outcome::Completed,
                total_us = entry.started.elapsed().as_micros() as u64,
                "send ended (submitted to the peer's Done)"
            );
        }
        let result = match outcome {
            Outcome::Completed => Ok(entry.buffer),
            Outcome::Cancelled => Err(SendError {
                error: Error::Cancelled,
                buffer: Some(entry.buffer),
            }),
            Outcome::Failed(kind) => Err(SendError {
                error: Error::from_fail(&self.peer, kind),
                buffer: Some(entry.buffer),
            }),
        };
        // A caller that stopped waiting drops the buffer, which releases it.
        let _ = entry.reply.send(result);
    }

    /// Tells the peer we no longer read its buffer of transfer `id` (it holds a lease on it
    /// until then). `Done` for a transfer it already ended changes nothing there.
    pub(super) fn release_to_peer(&mut self, id: InboundId) {
        if let Some(w) = &self.link.writer {
            let _ = w.try_send(Outgoing::Frame(Message::Done(Done { transfer: id.0 })));
        }
    }
}

/// An offer whose frame the peer would refuse (larger than its `max_frame`): its op and why.
/// Only a block list makes an offer that large, so only those are measured.
fn oversized_offer(msg: &Message, peer_max_frame: u32) -> Option<(OpId, String)> {
    let Message::Offer(offer) = msg else {
        return None;
    };
    let count = |layout: &Layout| layout.block_list().map_or(0, <[_]>::len);
    let blocks = count(&offer.layout) + offer.into.as_ref().map_or(0, |i| count(&i.layout));
    if blocks == 0 {
        return None;
    }
    let max = u64::from(peer_max_frame);
    // Within a bound found without encoding the list, it fits: the list is encoded once,
    // by the writer. Only an offer near or past the cap is measured exactly.
    if msg
        .payload_len_bound()
        .is_ok_and(|bound| bound as u64 <= max)
    {
        return None;
    }
    let len = msg.payload_len().unwrap_or(usize::MAX);
    (len as u64 > max).then(|| {
        (
            OpId(offer.transfer),
            format!(
                "an offer of {blocks} blocks takes {len} bytes, more than the {peer_max_frame} \
                 the peer takes in a frame (its limits.max_frame): send fewer blocks at once"
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_transports::wire::{Descriptor, Offer, WireMemoryKind, WireTransport};

    fn offer(blocks: u64) -> Message {
        Message::Offer(Offer {
            eager: false,
            fetch: None,
            into: None,
            transfer: 5,
            tag: 1,
            len: blocks * 16,
            source: WireMemoryKind::Device(0),
            transport: WireTransport::Ipc,
            direction: WireDirection::Pull,
            pull: Some(Descriptor(vec![7; 140])),
            layout: Layout::blocks((0..blocks).map(|b| (b * 32, 16))),
        })
    }

    /// An offer is refused exactly when its encoded payload is larger than the peer's cap,
    /// at the cap and on either side of it (the cheap bound decides only when it fits).
    #[test]
    fn an_offer_is_refused_exactly_past_the_cap() {
        for blocks in [1, 2, 3, 17, 1000, 4096] {
            let msg = offer(blocks);
            let exact = msg.payload_len().expect("encodes") as u32;
            for cap in [
                exact - 1,
                exact,
                exact + 1,
                exact + 8,
                exact + 100,
                u32::MAX,
            ] {
                let refused = oversized_offer(&msg, cap);
                assert_eq!(
                    refused.is_some(),
                    exact > cap,
                    "{blocks} blocks of {exact} bytes, cap {cap}"
                );
                if let Some((op, why)) = refused {
                    assert_eq!(op, OpId(5));
                    assert!(why.contains(&format!("takes {exact} bytes")), "{why}");
                }
            }
        }
        // Not a block list: never measured.
        assert!(oversized_offer(&Message::Ping(1), 0).is_none());
    }
}
