//! Memory exported to peers: who holds what, and when it may be reused. No I/O; time is a
//! parameter.
//!
//! An export keeps a token (in the shell: a view of the buffer's bytes, which keeps them
//! from being freed) until the memory can no longer be touched: the peer released it, or the
//! peer died and its lease timed out. A peer that dies may still have a copy in flight (a
//! DMA engine finishing, a NIC write landing), so its exports are quarantined for the lease
//! timeout before their memory is free again.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Identifies one export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExportId(pub u64);

#[derive(Debug)]
enum State {
    /// The peer holds it.
    Held,
    /// The peer died; free once the lease times out.
    Quarantined { until: Instant },
}

#[derive(Debug)]
struct Export<T> {
    peer: String,
    bytes: u64,
    state: State,
    token: T,
}

/// Counters of one domain's exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExportStats {
    /// Bytes held by live peers.
    pub exported: u64,
    /// Bytes whose peer died, waiting out the lease timeout.
    pub quarantined: u64,
}

/// The exports of one domain, with their tokens.
#[derive(Debug)]
pub struct Exports<T> {
    lease_timeout: Duration,
    entries: HashMap<ExportId, Export<T>>,
    freed: Vec<T>,
}

impl<T> Exports<T> {
    /// An empty table; a dead peer's exports are quarantined for `lease_timeout`.
    pub fn new(lease_timeout: Duration) -> Self {
        Self {
            lease_timeout,
            entries: HashMap::new(),
            freed: Vec::new(),
        }
    }

    /// `peer` now holds `bytes` of memory, kept alive by `token`.
    pub fn handle_export(&mut self, id: ExportId, peer: &str, bytes: u64, token: T) {
        self.entries.insert(
            id,
            Export {
                peer: peer.to_string(),
                bytes,
                state: State::Held,
                token,
            },
        );
    }

    /// The peer released the export: its token is freed. Returns false for an export
    /// that is unknown, or quarantined (a dead peer's release arrives too late to count).
    pub fn handle_release(&mut self, id: ExportId) -> bool {
        match self.entries.get(&id).map(|e| &e.state) {
            Some(State::Held) => {
                if let Some(e) = self.entries.remove(&id) {
                    self.freed.push(e.token);
                }
                true
            }
            _ => false,
        }
    }

    /// `peer` died: everything it held is quarantined until `now + lease_timeout`.
    pub fn handle_peer_lost(&mut self, peer: &str, now: Instant) {
        let until = now + self.lease_timeout;
        for e in self.entries.values_mut() {
            if e.peer == peer && matches!(e.state, State::Held) {
                e.state = State::Quarantined { until };
            }
        }
    }

    /// Frees quarantined exports whose lease has timed out by `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let expired: Vec<ExportId> = self
            .entries
            .iter()
            .filter(|(_, e)| matches!(e.state, State::Quarantined { until } if until <= now))
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            if let Some(e) = self.entries.remove(&id) {
                self.freed.push(e.token);
            }
        }
    }

    /// Tokens that may now be dropped: their memory can no longer be touched.
    pub fn poll_freed(&mut self) -> Option<T> {
        self.freed.pop()
    }

    /// When the next quarantine ends.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.entries
            .values()
            .filter_map(|e| match e.state {
                State::Quarantined { until } => Some(until),
                State::Held => None,
            })
            .min()
    }

    /// Current counters.
    pub fn stats(&self) -> ExportStats {
        let mut s = ExportStats::default();
        for e in self.entries.values() {
            match e.state {
                State::Held => s.exported += e.bytes,
                State::Quarantined { .. } => s.quarantined += e.bytes,
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_export_frees_at_once() {
        let mut x = Exports::new(Duration::from_secs(10));
        x.handle_export(ExportId(1), "b", 100, "view");
        assert_eq!(x.stats().exported, 100);
        assert!(x.handle_release(ExportId(1)));
        assert_eq!(x.poll_freed(), Some("view"));
        assert_eq!(x.stats(), ExportStats::default());
    }

    #[test]
    fn dead_peer_frees_only_after_the_lease() {
        let t0 = Instant::now();
        let mut x = Exports::new(Duration::from_secs(10));
        x.handle_export(ExportId(1), "b", 100, 1);
        x.handle_export(ExportId(2), "c", 50, 2);
        x.handle_peer_lost("b", t0);
        assert_eq!(
            x.stats(),
            ExportStats {
                exported: 50,
                quarantined: 100
            }
        );
        assert_eq!(x.poll_timeout(), Some(t0 + Duration::from_secs(10)));
        // A late release from the dead peer does not shorten the quarantine.
        assert!(!x.handle_release(ExportId(1)));
        x.handle_timeout(t0 + Duration::from_secs(9));
        assert_eq!(
            x.poll_freed(),
            None,
            "freed while a copy could still touch it"
        );
        x.handle_timeout(t0 + Duration::from_secs(10));
        assert_eq!(x.poll_freed(), Some(1));
        assert_eq!(
            x.stats(),
            ExportStats {
                exported: 50,
                quarantined: 0
            }
        );
    }
}
