//! The inbound side of a session: the peer's offers (eager ones included), their admission
//! in offer order under the per-peer bounds as the application takes what was delivered,
//! the shell's reservations for them, and their delivery in the peer's offer order.

use std::time::Instant;

use ferry_config::TransportName;
use ferry_transports::registry;
use ferry_transports::transport::Carrier;
use ferry_transports::wire::{
    Cancel, Done, Grant, Layout, Message, Offer, WireDirection, WireMemoryKind, WireReason,
};

use super::{
    InPhase, InboundId, InboundOp, MAX_TRANSFER_ID, PeerSession, ProtocolViolation, PullSource,
    PushTarget, SessionEvent,
};

/// Why an offer's layout cannot be taken: malformed, or not `len` packed bytes.
fn layout_mismatch(offer: &Offer) -> Option<String> {
    if offer.layout == Layout::Contiguous {
        return None;
    }
    // The sender's buffer is not known here: only the shape and the packed length.
    match offer.layout.check(u64::MAX) {
        Err(e) => Some(format!("the offer's layout is invalid: {e}")),
        Ok(packed) if packed != offer.len => Some(format!(
            "the offer's layout packs {packed} bytes, the offer says {}",
            offer.len
        )),
        Ok(_) => None,
    }
}

/// How often offers waiting for room look again at what the application took.
const UNCLAIMED_RECHECK: std::time::Duration = std::time::Duration::from_millis(5);

/// Whether `transport` declares `direction` (tcp, for one, only pushes).
fn declares(transport: TransportName, direction: WireDirection) -> bool {
    let wanted = match direction {
        WireDirection::Push => ferry_config::Direction::Push,
        WireDirection::Pull => ferry_config::Direction::Pull,
    };
    registry::declared(transport).directions.contains(&wanted)
}

impl PeerSession {
    /// The application has taken `taken` bytes of this peer's deliveries in all, and the
    /// peer's fast lane (which bypasses the session) delivered `lane` bytes in all: running
    /// totals, as the inbox counts them. What was delivered and not taken still holds
    /// memory and counts against the peer's share; offers waiting for room may go ahead
    /// now. While some still wait, [`Self::poll_timeout`] asks to be told again shortly:
    /// taking a buffer is not an event the session sees.
    pub fn handle_claims(&mut self, lane: u64, taken: u64, now: Instant) {
        self.claims = (lane, taken);
        self.admit_queued();
        self.recheck_at = self
            .inbound
            .values()
            .any(|op| op.phase == InPhase::Queued)
            .then_some(now + UNCLAIMED_RECHECK);
    }

    /// Bytes the peer delivered that the application has not taken yet.
    fn unclaimed(&self) -> u64 {
        let (lane, taken) = self.claims;
        self.delivered.saturating_add(lane).saturating_sub(taken)
    }

    pub(super) fn on_offer(&mut self, offer: Offer) -> Result<(), ProtocolViolation> {
        if let Some((id, op)) = self.take_offer(offer)? {
            self.inbound.insert(id, op);
            self.admit_queued();
        }
        Ok(())
    }

    /// An eager offer whose bytes the shell already placed in memory of its own (within
    /// the eager credit it granted, checked before it read them): the transfer is complete
    /// on arrival, `Done` goes back, and it is delivered in its turn. Returns true when it
    /// was taken (the shell keeps the buffer for [`SessionEvent::Deliver`]), false when it
    /// was refused as any offer can be (draining, too many open), the peer told why in a
    /// `Cancel` (the shell drops the buffer).
    ///
    /// # Errors
    /// The offer breaks the protocol (an id reused or past the largest).
    pub fn handle_eager_offer(&mut self, offer: Offer) -> Result<bool, ProtocolViolation> {
        let Some((id, mut op)) = self.take_offer(offer)? else {
            return Ok(false);
        };
        op.phase = InPhase::Complete;
        op.reserve = None;
        self.inbound.insert(id, op);
        self.transmit
            .push_back(Message::Done(Done { transfer: id.0 }));
        self.deliver_ready();
        Ok(true)
    }

    /// Inbound transfers waiting for room or memory (`Queued` or `Reserving`).
    pub fn inbound_waiting(&self) -> usize {
        self.inbound
            .values()
            .filter(|op| matches!(op.phase, InPhase::Queued | InPhase::Reserving))
            .count()
    }

    /// Bytes the peer holds here against its share ([`SessionLimits::inbound_bytes`]):
    /// what its transfers past `Queued` reserved, and what was delivered and not taken.
    ///
    /// [`SessionLimits::inbound_bytes`]: super::SessionLimits::inbound_bytes
    pub fn inbound_held(&self) -> u64 {
        self.inbound
            .values()
            .filter(|op| op.phase != InPhase::Queued)
            .map(|op| op.len)
            .sum::<u64>()
            .saturating_add(self.unclaimed())
    }

    /// Checks an offer: `None` when refused (its `Cancel` queued), else the inbound
    /// transfer it makes, `Queued`, not yet inserted.
    fn take_offer(
        &mut self,
        offer: Offer,
    ) -> Result<Option<(InboundId, InboundOp)>, ProtocolViolation> {
        let id = InboundId(offer.transfer);
        if offer.transfer >= MAX_TRANSFER_ID {
            return Err(ProtocolViolation(format!(
                "transfer id {} is past the largest a peer may use ({})",
                offer.transfer,
                MAX_TRANSFER_ID - 1
            )));
        }
        if self.inbound.contains_key(&id) {
            return Err(ProtocolViolation(format!(
                "transfer {} offered twice",
                offer.transfer
            )));
        }
        let transport = TransportName::from(offer.transport);
        let carrier = registry::carrier(transport);
        // What a pull reads: the offer's descriptor, read by the offer's transport (which
        // refuses one that is not its own when it pulls).
        let pull = offer.pull.clone().map(|descriptor| PullSource {
            transport,
            descriptor,
        });
        let refuse = if self.draining {
            Some((
                WireReason::ShuttingDown,
                "receiver is shutting down".to_string(),
            ))
        } else if self.inbound.len() >= self.limits.inbound {
            Some((
                WireReason::Protocol,
                format!("more than {} transfers open at once", self.limits.inbound),
            ))
        } else if let Some(why) = layout_mismatch(&offer) {
            Some((WireReason::Protocol, why))
        } else if offer.into.is_some() && (offer.eager || offer.fetch.is_some()) {
            Some((
                WireReason::Protocol,
                "a write into a region is neither eager nor a fetch's answer".to_string(),
            ))
        } else if !declares(transport, offer.direction)
            || !(carrier.fits(offer.direction, pull.is_some())
                && (carrier != Carrier::Memory || self.serves_memory.contains(&transport)))
        {
            Some((
                WireReason::Unsupported,
                format!(
                    "transport {transport} with direction {:?} is not served here",
                    offer.direction
                ),
            ))
        } else {
            None
        };
        if let Some((reason, detail)) = refuse {
            self.transmit.push_back(Message::Cancel(Cancel {
                by_receiver: true,
                transfer: offer.transfer,
                reason,
                detail,
            }));
            return Ok(None);
        }
        let push =
            (carrier.push_lends() && offer.direction == WireDirection::Push).then_some(transport);
        let reserve = SessionEvent::Reserve {
            id,
            len: offer.len,
            pull,
            push,
            relayed: carrier == Carrier::Ring,
            layout: offer.layout.clone(),
        };
        Ok(Some((
            id,
            InboundOp {
                tag: offer.tag,
                fetch: offer.fetch,
                into: offer.into,
                transport,
                layout: offer.layout,
                phase: InPhase::Queued,
                len: offer.len,
                reserve: Some(reserve),
                stalls: false,
                pushed: false,
            },
        )))
    }

    /// Starts reserving queued inbound transfers, in offer order, while the per-peer bounds
    /// leave room: at most [`SessionLimits::grants`] reserving or receiving, and at most
    /// [`SessionLimits::inbound_bytes`] held by transfers not yet delivered. The first that
    /// does not fit stops the others behind it (no overtaking).
    fn admit_queued(&mut self) {
        if !self.inbound.values().any(|op| op.phase == InPhase::Queued) {
            return;
        }
        let mut active = self.inbound.values().filter(|op| op.is_active()).count();
        let mut held = self.inbound_held();
        for op in self.inbound.values_mut() {
            if op.phase != InPhase::Queued {
                continue;
            }
            // An offer larger than the whole share goes alone, once the peer holds nothing
            // else: one transfer is never refused for its size here (the memory budget
            // decides that), and the peer still holds at most one such transfer.
            let alone = active == 0 && held == 0;
            if !alone
                && (active >= self.limits.grants
                    || held.saturating_add(op.len) > self.limits.inbound_bytes)
            {
                break;
            }
            active += 1;
            held = held.saturating_add(op.len);
            op.phase = InPhase::Reserving;
            if let Some(reserve) = op.reserve.take() {
                self.events.push_back(reserve);
            }
        }
    }

    /// Memory for inbound transfer `id` was reserved, and for a push lent as `target`.
    /// Returns false if the transfer was abandoned meanwhile, in which case the shell frees
    /// the memory itself (nothing was lent).
    ///
    /// A transfer that streams (no `target`) waits on the link's stall clock from `now` on:
    /// the link must move a byte at least every [`SessionLimits::stall`] (reported with
    /// [`Self::handle_link_progress`]), or [`Self::handle_stall_check`] ends it.
    ///
    /// [`SessionLimits::stall`]: super::SessionLimits::stall
    pub fn handle_reserved(
        &mut self,
        now: Instant,
        id: InboundId,
        landing: WireMemoryKind,
        target: Option<PushTarget>,
    ) -> bool {
        match self.inbound.get_mut(&id) {
            Some(op) if op.phase == InPhase::Reserving => {
                op.phase = InPhase::Receiving;
                op.stalls = target.is_none();
                op.pushed = true;
                // The grant about to leave is progress: the clock starts no earlier.
                self.progress.1 = self.progress.1.max(Some(now));
                self.transmit.push_back(Message::Grant(Grant {
                    transfer: id.0,
                    landing,
                    lent: target.map(|t| t.descriptor),
                }));
                true
            }
            _ => false,
        }
    }

    /// Memory for pulled transfer `id` was reserved: the shell reads the bytes now and
    /// reports [`Self::handle_inbound_complete`] or [`Self::handle_reserve_failed`]. Returns
    /// false if the transfer was abandoned meanwhile.
    pub fn handle_reserved_pull(&mut self, id: InboundId) -> bool {
        match self.inbound.get_mut(&id) {
            Some(op) if op.phase == InPhase::Reserving => {
                op.phase = InPhase::Receiving;
                true
            }
            _ => false,
        }
    }

    /// No memory could be reserved for inbound transfer `id`, or a pull failed; the peer is
    /// told why.
    pub fn handle_reserve_failed(&mut self, id: InboundId, reason: WireReason, detail: String) {
        if self.inbound.remove(&id).is_some() {
            self.transmit.push_back(Message::Cancel(Cancel {
                by_receiver: true,
                transfer: id.0,
                reason,
                detail,
            }));
            self.deliver_ready();
        }
    }

    /// Inbound transfer `id`'s bytes all arrived and are being placed into a region of
    /// this node's: nothing more comes over the link, so the stall clock no longer applies
    /// (the placement ends by its own deadline).
    pub fn handle_placing(&mut self, id: InboundId) {
        if let Some(op) = self.inbound.get_mut(&id) {
            op.stalls = false;
        }
    }

    /// Where inbound transfer `id` writes, when it is a one-sided write into one of this
    /// node's regions (the shell places its bytes there before it completes it).
    pub fn inbound_into(&self, id: InboundId) -> Option<&ferry_transports::wire::RegionWrite> {
        self.inbound.get(&id).and_then(|op| op.into.as_ref())
    }

    /// Every byte of inbound transfer `id` has been placed. Returns false if it is not
    /// receiving (abandoned meanwhile, or a peer completing a transfer it never offered).
    pub fn handle_inbound_complete(&mut self, id: InboundId) -> bool {
        match self.inbound.get_mut(&id) {
            Some(op) if op.phase == InPhase::Receiving => {
                op.phase = InPhase::Complete;
                op.stalls = false;
                self.transmit
                    .push_back(Message::Done(Done { transfer: id.0 }));
                self.deliver_ready();
                true
            }
            _ => false,
        }
    }

    /// Delivers completed inbound transfers in the peer's offer order.
    pub(super) fn deliver_ready(&mut self) {
        while let Some(entry) = self.inbound.first_entry() {
            if entry.get().phase != InPhase::Complete {
                break;
            }
            let (id, op) = entry.remove_entry();
            // Until the application takes it, it still holds memory.
            self.delivered = self.delivered.saturating_add(op.len);
            self.events.push_back(SessionEvent::Deliver {
                id,
                tag: op.tag,
                transport: op.transport,
                layout: op.layout,
                fetch: op.fetch,
            });
        }
        // Whatever left the share (delivered, abandoned, refused) may let others in.
        self.admit_queued();
    }
}
