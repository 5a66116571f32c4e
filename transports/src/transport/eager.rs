//! Eager transfers: small pushes over the link whose bytes go right behind their offer,
//! within credit the receiver granted in its hello (one round trip instead of two). The
//! session decides which offers go eagerly by the peer's [`EagerTerms`]; the receiving
//! link's reader takes them through the [`EagerGate`] of the transport that grants them.

use crate::wire::Offer;

/// What a peer takes eagerly, as its hello says: pushes over the link of at most `max`
/// bytes may go with their offer, their bytes right behind it, while the eager offers sent
/// and not yet answered add up to at most `credit` bytes. Zero takes none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EagerTerms {
    /// The largest eager transfer.
    pub max: u64,
    /// The bytes of eager transfers that may be unanswered at once.
    pub credit: u64,
}

impl EagerTerms {
    /// The largest eager transfer a node offers whatever the peer's hello says (the
    /// configuration's own bound on the transport's setting).
    pub const MAX: u64 = 16 << 20;
    /// The most eager credit a node uses whatever the peer's hello grants.
    pub const MAX_CREDIT: u64 = 256 << 20;

    /// What a sender uses of the terms a peer's hello granted: `max` bounded by
    /// [`Self::MAX`] and by what one payload frame of the peer carries (`max_frame`, less
    /// room for its header), `credit` by [`Self::MAX_CREDIT`]; none when the credit does
    /// not hold one transfer. A peer granting more gets no more.
    pub fn bounded(self, max_frame: u32) -> Self {
        let frame = u64::from(max_frame).saturating_sub(64 << 10);
        let max = self.max.min(Self::MAX).min(frame);
        let credit = self.credit.min(Self::MAX_CREDIT);
        if max == 0 || credit < max {
            return Self::default();
        }
        Self { max, credit }
    }
}

/// One link's eager credit at the receiving end, shared by the link's reader (which takes
/// eager transfers without the actor) and the session's actor (which answers them).
pub trait EagerGate: Send + Sync {
    /// Checks an eager offer against the protocol and the credit granted. Only the reader
    /// adds to the credit in use, so a check followed by [`Self::take`] on the reader
    /// holds.
    ///
    /// # Errors
    /// Why the offer breaks the protocol (the peer's link ends).
    fn check(&self, offer: &Offer) -> Result<(), String>;

    /// Whether `len` more bytes may land now: the actor has handled every offer the reader
    /// handed it (`offers` of them, not taken eagerly) and none of the peer's transfers
    /// waits for room or memory, and the peer's share has room for it beside what it holds.
    fn room(&self, offers: u32, len: u64) -> bool;

    /// The reader took eager transfer `id` of `len` bytes (checked by [`Self::check`]).
    fn take(&self, id: u64, len: u64);

    /// Eager transfer `id` is answered, or the peer cancelled it: its credit is free again.
    fn release(&self, id: u64);

    /// The actor's view after its latest turn: `handled` offers not taken eagerly, so many
    /// inbound transfers `waiting` for room or memory, `held` bytes against the share.
    fn publish(&self, handled: u32, waiting: usize, held: u64);
}
