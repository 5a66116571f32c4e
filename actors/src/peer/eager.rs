//! Eager transfers at the receiving end: the reader's handling of an eager offer, through
//! the eager credit its transport granted the peer in this node's hello
//! ([`EagerGate`]). The reader reserves host memory at
//! once (no actor, no queue) when the peer's share has room and no offer of the peer before
//! it still waits for memory, reads the bytes straight into it and hands the transfer to
//! the actor complete; otherwise it reads past the bytes and hands the offer on as any
//! other, which the sender then streams once granted. Either way nothing waits on the
//! actor, and the peer's transfers are delivered in its offer order (the session's).

use super::*;
pub(super) use ferry_transports::transport::EagerGate;
use ferry_transports::wire::Offer;

/// An eager transfer the reader took: its bytes are in `buffer`.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(super) struct EagerArrived {
    offer: Offer,
    buffer: Buffer,
    /// The link it came on; one replaced meanwhile is ignored.
    link: u64,
}

impl ReadLoop {
    /// An eager offer: its bytes land in host memory reserved now, or are read past and the
    /// offer goes on as one that waits for its grant. `offers` counts the offers handed to
    /// the actor that were not taken eagerly.
    pub(super) async fn on_eager(
        &self,
        reader: &mut LinkReader,
        mut offer: Offer,
        offers: &mut u32,
    ) -> Result<(), String> {
        let Some(gate) = &self.eager else {
            note_protocol_violation();
            return Err(
                "protocol violation: an eager offer, and this node grants no eager credit".into(),
            );
        };
        if let Err(e) = gate.check(&offer) {
            note_protocol_violation();
            return Err(format!("protocol violation: {e}"));
        }
        // Within `eager_max`, which the configuration keeps to 16 MiB.
        let len = u32::try_from(offer.len).map_err(|e| e.to_string())?;
        let buffer = if gate.room(*offers, offer.len) {
            allocator::reserve_now_to_overwrite(&self.host_tiers, offer.len)
        } else {
            None
        };
        let Some(mut buffer) = buffer else {
            reader
                .discard_payload(len)
                .await
                .map_err(|e| e.to_string())?;
            tracing::trace!(id = offer.transfer, "eager offer: no room now, read past");
            metrics::counter!("ferry_eager_read_past_total").increment(1);
            offer.eager = false;
            *offers = offers.wrapping_add(1);
            return self.forward(Message::Offer(offer)).await;
        };
        gate.take(offer.transfer, offer.len);
        let Some(destination) = buffer.as_mut_slice() else {
            return Err("eager memory is not host memory".into());
        };
        if let Err(e) = reader.read_payload_into(destination).await {
            return Err(format!(
                "eager transfer {} not received: {e}",
                offer.transfer
            ));
        }
        let arrived = EagerArrived {
            offer,
            buffer,
            link: self.link,
        };
        self.hand_over(arrived).await
    }
}

impl Handler<EagerArrived> for TransferActor {
    type Result = ();

    fn handle(&mut self, msg: EagerArrived, ctx: &mut Self::Context) {
        if msg.link != self.link.number {
            return;
        }
        let id = msg.offer.transfer;
        if let Some((gate, _)) = &self.link.eager {
            gate.release(id);
        }
        let landing = msg.buffer.kind();
        if self.setup.tiers.first().is_some_and(|t| t.kind != landing) {
            metrics::counter!("ferry_spill_bytes_total").increment(msg.offer.len);
        }
        match self.session.handle_eager_offer(msg.offer) {
            Ok(true) => {
                tracing::trace!(peer = %self.peer, id, "eager transfer taken");
                let pending = self.inbound.undelivered.enter();
                self.inbound
                    .complete
                    .insert(InboundId(id), (msg.buffer, pending));
            }
            Ok(false) => {}
            Err(violation) => {
                tracing::warn!(peer = %self.peer, %violation, "dropping peer");
                note_protocol_violation();
                self.session.handle_link_lost(&violation.to_string());
            }
        }
        self.drive(ctx);
    }
}

impl TransferActor {
    /// Tells the link's reader what the session holds now (after every turn of the actor),
    /// so that it takes eager transfers only where an offer would be granted at once.
    pub(super) fn publish_eager(&self) {
        if let Some((gate, handled)) = &self.link.eager {
            gate.publish(
                *handled,
                self.session.inbound_waiting(),
                self.session.inbound_held(),
            );
        }
    }
}

/// The offer of an eager op and a copy of its bytes (at most `transport.tcp.eager_max`,
/// host memory): a copy, so that the buffer goes back to the caller at `Done` with no view
/// of it left in the writer. `Err` gives the op back when its bytes are not host memory.
pub(super) fn eager_outgoing(
    outbound: &HashMap<OpId, OutEntry>,
    offer: Offer,
) -> Result<Outgoing, OpId> {
    let op = OpId(offer.transfer);
    let bytes = outbound
        .get(&op)
        .and_then(|e| e.buffer.as_slice())
        .and_then(|b| b.get(..usize::try_from(offer.len).ok()?))
        .map(<[u8]>::to_vec)
        .ok_or(op)?;
    Ok(Outgoing::Eager {
        offer: Message::Offer(offer),
        bytes,
    })
}
