//! Eager tcp transfers at the receiving end: the credit this node granted the peer in its
//! hello, shared by the link's reader and the session's actor. The reader reserves host
//! memory at once (no actor, no queue) when the peer's share has room and no offer of the
//! peer before it still waits for memory, reads the bytes straight into it and hands the
//! transfer to the actor complete; otherwise it reads past the bytes and hands the offer
//! on as any other, which the sender then streams once granted. Either way nothing waits
//! on the actor, and the peer's transfers are delivered in its offer order (the session's).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use super::TcpTerms;
use crate::transport::{EagerGate, EagerTerms};
use crate::wire::{Layout, Offer, WireDirection};

/// An eager offer that breaks the protocol: the peer misbehaved, and its link ends.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EagerViolation {
    /// Only a contiguous, non-empty tcp push with no pull source goes eagerly.
    #[error("transfer {0} offered eagerly is not a contiguous, non-empty tcp push")]
    NotEager(u64),
    /// Larger than this node takes eagerly.
    #[error("an eager offer of {len} bytes, past the {max} this node takes eagerly")]
    TooLarge {
        /// The offer's bytes.
        len: u64,
        /// `transport.tcp.eager_max`.
        max: u64,
    },
    /// Past the credit this node granted.
    #[error(
        "an eager offer of {len} bytes while {unanswered} of the {credit}-byte eager credit \
         are unanswered"
    )]
    PastCredit {
        /// The offer's bytes.
        len: u64,
        /// Eager bytes taken and not answered yet.
        unanswered: u64,
        /// `transport.tcp.eager_credit`.
        credit: u64,
    },
    /// The same transfer id twice while the first is unanswered.
    #[error("transfer {0} offered eagerly twice")]
    Twice(u64),
}

/// The eager transfers the reader took and the actor has not answered yet, by transfer.
#[derive(Default)]
struct Ledger {
    by_transfer: HashMap<u64, u64>,
    bytes: u64,
}

/// One link's eager credit at the receiving end, shared by its reader and the actor.
pub struct Gate {
    /// What this node takes (its hello said the same).
    terms: EagerTerms,
    /// The peer's share of this node's memory (`limits.peer_inbound_bytes`).
    share: u64,
    ledger: std::sync::Mutex<Ledger>,
    /// What the actor last saw, in one word: the peer's offers it handled that were not
    /// taken eagerly (high half, wrapping) and how many of its inbound transfers wait for
    /// room or memory (low half, saturated).
    seen: AtomicU64,
    /// The bytes the peer held here against its share when the actor last looked.
    held: AtomicU64,
}

impl Gate {
    /// A gate granting `terms`, within a share of `share` bytes.
    pub fn new(terms: EagerTerms, share: u64) -> Self {
        Self {
            terms,
            share,
            ledger: std::sync::Mutex::default(),
            seen: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks an eager offer against the protocol and the credit granted. Only the reader
    /// adds to the credit in use, so a check followed by [`Self::take`] on the reader holds.
    fn check(&self, offer: &Offer) -> Result<(), EagerViolation> {
        let eager_kind = offer.len > 0
            && offer.transport == TcpTerms::TRANSPORT.into()
            && offer.direction == WireDirection::Push
            && offer.layout == Layout::Contiguous
            && offer.pull.is_none();
        if !eager_kind {
            return Err(EagerViolation::NotEager(offer.transfer));
        }
        if offer.len > self.terms.max {
            return Err(EagerViolation::TooLarge {
                len: offer.len,
                max: self.terms.max,
            });
        }
        let ledger = self.ledger();
        if ledger.by_transfer.contains_key(&offer.transfer) {
            return Err(EagerViolation::Twice(offer.transfer));
        }
        if ledger.bytes.saturating_add(offer.len) > self.terms.credit {
            return Err(EagerViolation::PastCredit {
                len: offer.len,
                unanswered: ledger.bytes,
                credit: self.terms.credit,
            });
        }
        Ok(())
    }

    /// Whether `len` more bytes may land now: the actor has handled every offer the reader
    /// handed it (`offers` of them, not taken eagerly) and none of the peer's transfers
    /// waits for room or memory (an eager one must not take memory an earlier offer
    /// waits for), and the peer's share has room for it beside what it holds.
    fn room(&self, offers: u32, len: u64) -> bool {
        let seen = self.seen.load(Ordering::Acquire);
        let (handled, waiting) = ((seen >> 32) as u32, seen as u32);
        let taken = self.ledger().bytes;
        handled == offers
            && waiting == 0
            && self
                .held
                .load(Ordering::Acquire)
                .saturating_add(taken)
                .saturating_add(len)
                <= self.share
    }

    /// The reader took eager transfer `id` of `len` bytes (checked by [`Self::check`]).
    fn take(&self, id: u64, len: u64) {
        let mut ledger = self.ledger();
        ledger.by_transfer.insert(id, len);
        ledger.bytes = ledger.bytes.saturating_add(len);
    }

    /// Eager transfer `id` is answered (the actor handled it), or the peer cancelled it:
    /// its credit is free again. Nothing for a transfer not taken. Its bytes still count
    /// against the share as held until the actor publishes its next view (which counts the
    /// transfer itself while it holds the buffer): the reader never sees room the share
    /// does not have.
    fn release(&self, id: u64) {
        let mut ledger = self.ledger();
        if let Some(len) = ledger.by_transfer.remove(&id) {
            ledger.bytes = ledger.bytes.saturating_sub(len);
            self.held.fetch_add(len, Ordering::AcqRel);
        }
    }

    /// The actor's view after its latest turn: `handled` offers not taken eagerly, so many
    /// inbound transfers `waiting` for room or memory, `held` bytes against the share.
    fn publish(&self, handled: u32, waiting: usize, held: u64) {
        let waiting = u32::try_from(waiting).unwrap_or(u32::MAX);
        self.held.store(held, Ordering::Release);
        self.seen.store(
            (u64::from(handled) << 32) | u64::from(waiting),
            Ordering::Release,
        );
    }
}

impl EagerGate for Gate {
    fn check(&self, offer: &Offer) -> Result<(), String> {
        Gate::check(self, offer).map_err(|e| e.to_string())
    }

    fn room(&self, offers: u32, len: u64) -> bool {
        Gate::room(self, offers, len)
    }

    fn take(&self, id: u64, len: u64) {
        Gate::take(self, id, len);
    }

    fn release(&self, id: u64) {
        Gate::release(self, id);
    }

    fn publish(&self, handled: u32, waiting: usize, held: u64) {
        Gate::publish(self, handled, waiting, held);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{WireMemoryKind, WireTransport};

    fn offer(transfer: u64, len: u64) -> Offer {
        Offer {
            eager: true,
            fetch: None,
            into: None,
            transfer,
            tag: 1,
            len,
            source: WireMemoryKind::Host,
            transport: WireTransport::Tcp,
            direction: WireDirection::Push,
            pull: None,
            layout: Layout::Contiguous,
        }
    }

    fn gate() -> Gate {
        Gate::new(
            EagerTerms {
                max: 100,
                credit: 150,
            },
            1000,
        )
    }

    /// A hostile peer's eager offers: too large, past the credit, an id twice, or not a
    /// contiguous tcp push, each refused with its reason; the credit comes back on release.
    #[test]
    fn eager_offers_past_the_terms_are_violations() {
        let g = gate();
        assert_eq!(
            g.check(&offer(1, 101)),
            Err(EagerViolation::TooLarge { len: 101, max: 100 })
        );
        assert_eq!(g.check(&offer(1, 0)), Err(EagerViolation::NotEager(1)));
        let mut pull = offer(1, 10);
        pull.direction = WireDirection::Pull;
        assert_eq!(g.check(&pull), Err(EagerViolation::NotEager(1)));
        let mut strided = offer(1, 10);
        strided.layout = Layout::blocks([(0, 5), (8, 5)]);
        assert_eq!(g.check(&strided), Err(EagerViolation::NotEager(1)));
        assert_eq!(g.check(&offer(1, 100)), Ok(()));
        g.take(1, 100);
        assert_eq!(g.check(&offer(1, 10)), Err(EagerViolation::Twice(1)));
        assert_eq!(
            g.check(&offer(2, 51)),
            Err(EagerViolation::PastCredit {
                len: 51,
                unanswered: 100,
                credit: 150
            })
        );
        assert_eq!(g.check(&offer(2, 50)), Ok(()));
        g.release(1);
        g.release(1);
        assert_eq!(g.check(&offer(2, 100)), Ok(()));
    }

    /// A peer's hello grants what it likes; a sender uses at most its own bounds.
    #[test]
    fn a_peers_eager_terms_are_bounded() {
        let t = |max, credit| EagerTerms { max, credit };
        let frame = 64 << 20;
        assert_eq!(
            t(u64::MAX, u64::MAX).bounded(frame),
            t(EagerTerms::MAX, EagerTerms::MAX_CREDIT)
        );
        assert_eq!(
            t(1 << 20, 4 << 20).bounded(512 << 10),
            t(448 << 10, 4 << 20),
            "one payload frame of the peer's carries it"
        );
        assert_eq!(t(1 << 20, 1 << 10).bounded(frame), EagerTerms::default());
        assert_eq!(t(0, 1 << 20).bounded(frame), EagerTerms::default());
        assert_eq!(t(64 << 10, 1 << 20).bounded(frame), t(64 << 10, 1 << 20));
    }

    /// Room only while the actor has handled every offer handed to it, none waits, and the
    /// share has room beside what is held and what the reader took.
    #[test]
    fn room_waits_for_earlier_offers_and_the_share() {
        let g = gate();
        assert!(g.room(0, 100));
        assert!(!g.room(1, 100), "an offer the actor has not handled yet");
        g.publish(1, 1, 0);
        assert!(!g.room(1, 100), "an offer waits for memory");
        g.publish(1, 0, 850);
        assert!(g.room(1, 100));
        g.take(7, 60);
        assert!(
            !g.room(1, 100),
            "the share: 850 held, 60 taken, 100 more > 1000"
        );
        g.release(7);
        assert!(
            !g.room(1, 150),
            "released bytes count as held until the actor's next view"
        );
        g.publish(1, 0, 850);
        assert!(g.room(1, 150));
    }
}
