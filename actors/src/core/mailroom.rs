//! Matches delivered buffers with `recv` calls, by sending peer (or any) and tag, in
//! delivery order. No I/O.
//!
//! Delivered items wait until a matching `recv` takes them; their number is bounded by the
//! memory budget that holds them. Waiting `recv` calls are bounded by `waiters_cap`.

use std::collections::VecDeque;

/// A parked `recv`: who it accepts, and how to answer it.
#[derive(Debug)]
struct Waiter<W> {
    from: Option<String>,
    tag: Option<u64>,
    waiter: W,
}

/// Why a `recv` could not wait.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0} receives already waiting")]
pub struct TooManyWaiting(pub usize);

/// Delivered items and parked receivers.
#[derive(Debug)]
pub struct Mailroom<T, W> {
    ready: VecDeque<(String, u64, T)>,
    waiting: VecDeque<Waiter<W>>,
    waiters_cap: usize,
}

impl<T, W> Mailroom<T, W> {
    /// An empty mailroom that parks at most `waiters_cap` receives.
    pub fn new(waiters_cap: usize) -> Self {
        Self {
            ready: VecDeque::new(),
            waiting: VecDeque::new(),
            waiters_cap,
        }
    }

    /// An item arrived from `peer`. If a live waiter matches, it is returned with the item
    /// for the shell to answer; waiters that `is_live` rejects (their caller went away) are
    /// dropped on the way.
    pub fn deliver(
        &mut self,
        peer: &str,
        tag: u64,
        item: T,
        is_live: impl Fn(&W) -> bool,
    ) -> Option<(W, T)> {
        match self.take_waiter(peer, tag, is_live) {
            Some(w) => Some((w, item)),
            None => {
                self.ready.push_back((peer.to_string(), tag, item));
                None
            }
        }
    }

    /// Removes and returns the oldest live waiter that accepts (`peer`, `tag`), dropping
    /// dead waiters on the way.
    fn take_waiter(&mut self, peer: &str, tag: u64, is_live: impl Fn(&W) -> bool) -> Option<W> {
        self.waiting.retain(|w| is_live(&w.waiter));
        let pos = self.waiting.iter().position(|w| {
            w.tag.is_none_or(|t| t == tag) && w.from.as_deref().is_none_or(|f| f == peer)
        })?;
        self.waiting.remove(pos).map(|w| w.waiter)
    }

    /// A `recv` from `from` (or any peer) for `tag` (or any tag): the oldest matching
    /// item with its peer and tag, or the waiter parked until one arrives.
    #[allow(clippy::type_complexity)]
    pub fn recv(
        &mut self,
        from: Option<&str>,
        tag: Option<u64>,
        waiter: W,
        is_live: impl Fn(&W) -> bool,
    ) -> Result<Option<(String, u64, T)>, (TooManyWaiting, W)> {
        let pos = self
            .ready
            .iter()
            .position(|(p, t, _)| tag.is_none_or(|want| want == *t) && from.is_none_or(|f| f == p));
        if let Some(found) = pos.and_then(|p| self.ready.remove(p)) {
            return Ok(Some(found));
        }
        self.waiting.retain(|w| is_live(&w.waiter));
        if self.waiting.len() >= self.waiters_cap {
            return Err((TooManyWaiting(self.waiters_cap), waiter));
        }
        self.waiting.push_back(Waiter {
            from: from.map(str::to_string),
            tag,
            waiter,
        });
        Ok(None)
    }

    /// Gives back an item a receiver took but could not use (its caller went away): it goes
    /// to the next live matching waiter, else to the front of the ready items, ahead of
    /// anything delivered after it.
    pub fn requeue(
        &mut self,
        peer: &str,
        tag: u64,
        item: T,
        is_live: impl Fn(&W) -> bool,
    ) -> Option<(W, T)> {
        match self.take_waiter(peer, tag, is_live) {
            Some(w) => Some((w, item)),
            None => {
                self.ready.push_front((peer.to_string(), tag, item));
                None
            }
        }
    }

    /// Removes every waiter, returning them (to tell them the node stops).
    pub fn drain_waiters(&mut self) -> Vec<W> {
        self.waiting.drain(..).map(|w| w.waiter).collect()
    }

    /// Removes every undelivered item, returning them.
    pub fn drain(&mut self) -> Vec<T> {
        self.ready.drain(..).map(|(_, _, t)| t).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_by_peer_and_tag_in_order() {
        let mut m: Mailroom<u32, u8> = Mailroom::new(2);
        assert!(m.deliver("a", 1, 10, |_| true).is_none());
        assert!(m.deliver("b", 1, 20, |_| true).is_none());
        assert!(m.deliver("a", 1, 11, |_| true).is_none());
        let got = |r: Result<Option<(String, u64, u32)>, _>| r.ok().flatten();
        assert_eq!(
            got(m.recv(Some("b"), Some(1), 0, |_| true)),
            Some(("b".into(), 1, 20))
        );
        assert_eq!(
            got(m.recv(None, Some(1), 0, |_| true)),
            Some(("a".into(), 1, 10))
        );
        assert_eq!(
            got(m.recv(Some("a"), None, 0, |_| true)),
            Some(("a".into(), 1, 11))
        );
        assert_eq!(m.recv(Some("a"), Some(2), 7, |_| true).ok(), Some(None));
        assert_eq!(m.deliver("a", 2, 30, |_| true), Some((7, 30)));
    }

    #[test]
    fn requeued_item_goes_first() {
        let mut m: Mailroom<u32, u8> = Mailroom::new(4);
        assert!(m.deliver("a", 1, 10, |_| true).is_none());
        assert!(m.requeue("a", 1, 9, |_| true).is_none());
        let got = m.recv(None, None, 0, |_| true).ok().flatten();
        assert_eq!(got, Some(("a".into(), 1, 9)));
        assert_eq!(m.recv(None, Some(2), 5, |_| true).ok(), Some(None));
        assert_eq!(m.requeue("a", 2, 8, |_| true), Some((5, 8)));
    }

    #[test]
    fn waiters_bounded_and_dead_ones_skipped() {
        let mut m: Mailroom<u32, u8> = Mailroom::new(1);
        assert!(m.recv(None, Some(1), 1, |_| true).is_ok());
        assert!(m.recv(None, Some(1), 2, |_| true).is_err());
        // Waiter 1 went away: the item goes to waiter 3 instead.
        assert!(m.recv(None, Some(1), 3, |w| *w != 1).is_ok());
        assert_eq!(m.deliver("a", 1, 5, |w| *w != 1), Some((3, 5)));
    }
}
