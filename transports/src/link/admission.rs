//! Admission of unauthenticated connections: how many may be in their handshake at once, in
//! all and per source address, and which one gives way when a new one arrives.
//!
//! The accept loop never waits for room: it accepts every connection at once and, when the
//! bounds are reached, sheds the oldest pending handshake (of the same source first, then of
//! all). A legitimate peer's handshake takes a few milliseconds, so it completes unless the
//! bound's worth of new connections arrive within those milliseconds; an attacker's idle
//! connections are the oldest and go first. No I/O here: the caller holds one token per
//! pending handshake (something that ends it when dropped or fired) and carries out the
//! sheds this returns.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

/// Identifies one admitted handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PendingId(u64);

/// The bounds on pending handshakes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Pending handshakes at once, in all (at least 1).
    pub total: usize,
    /// Pending handshakes at once from one source (at least 1).
    pub per_source: usize,
}

/// The handshakes in progress, oldest first, each with the caller's token.
#[derive(Debug)]
pub struct Admission<T> {
    limits: AdmissionLimits,
    next: u64,
    pending: BTreeMap<PendingId, (String, T)>,
    by_source: HashMap<String, VecDeque<PendingId>>,
    shed: u64,
}

impl<T> Admission<T> {
    /// No handshake pending; bounds below 1 count as 1.
    pub fn new(limits: AdmissionLimits) -> Self {
        Self {
            limits: AdmissionLimits {
                total: limits.total.max(1),
                per_source: limits.per_source.max(1),
            },
            next: 0,
            pending: BTreeMap::new(),
            by_source: HashMap::new(),
            shed: 0,
        }
    }

    /// Admits a new handshake from `source` holding `token`. Returns its id and the tokens
    /// of the handshakes shed to make room (the source's oldest when the source is at its
    /// bound, then the oldest of all when the total is): the caller ends those.
    pub fn admit(&mut self, source: &str, token: T) -> (PendingId, Vec<T>) {
        let mut shed = Vec::new();
        let at_source = self.by_source.get(source).map_or(0, VecDeque::len);
        if at_source >= self.limits.per_source
            && let Some(oldest) = self.by_source.get(source).and_then(|q| q.front().copied())
            && let Some(token) = self.remove(oldest)
        {
            shed.push(token);
        }
        while self.pending.len() >= self.limits.total {
            let Some(oldest) = self.pending.keys().next().copied() else {
                break;
            };
            if let Some(token) = self.remove(oldest) {
                shed.push(token);
            }
        }
        self.shed += shed.len() as u64;
        let id = PendingId(self.next);
        self.next += 1;
        self.pending.insert(id, (source.to_owned(), token));
        self.by_source
            .entry(source.to_owned())
            .or_default()
            .push_back(id);
        (id, shed)
    }

    /// The handshake `id` ended (succeeded, failed, or was shed): forget it. Returns its
    /// token if it was still pending.
    pub fn finish(&mut self, id: PendingId) -> Option<T> {
        self.remove(id)
    }

    /// Handshakes pending now.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// True when no handshake is pending.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Handshakes shed so far.
    pub fn shed_total(&self) -> u64 {
        self.shed
    }

    fn remove(&mut self, id: PendingId) -> Option<T> {
        let (source, token) = self.pending.remove(&id)?;
        if let Some(queue) = self.by_source.get_mut(&source) {
            queue.retain(|&p| p != id);
            if queue.is_empty() {
                self.by_source.remove(&source);
            }
        }
        Some(token)
    }
}

/// An [`Admission`] shared by an accept loop and the tasks it spawns: each accepted
/// connection takes a [`Ticket`] and runs its handshake under it.
#[derive(Debug, Clone)]
pub struct Gate(Arc<Mutex<Admission<oneshot::Sender<()>>>>);

impl Gate {
    /// A gate with these bounds.
    pub fn new(limits: AdmissionLimits) -> Self {
        Self(Arc::new(Mutex::new(Admission::new(limits))))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Admission<oneshot::Sender<()>>> {
        // A panic under this lock leaves the bookkeeping whole (every change is one insert
        // or remove), so a poisoned lock is still used: accepting must not stop.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Admits a connection from `source`; returns its ticket and how many older pending
    /// ones were shed to make room (their tickets' work ends at once).
    pub fn admit(&self, source: &str) -> (Ticket, usize) {
        let (shed_me, shed) = oneshot::channel();
        let (id, victims) = self.lock().admit(source, shed_me);
        let ticket = Ticket {
            gate: self.clone(),
            id,
            shed,
        };
        (ticket, victims.len())
    }
}

/// One admitted connection's place in its [`Gate`]; dropping it gives the place back.
#[derive(Debug)]
pub struct Ticket {
    gate: Gate,
    id: PendingId,
    shed: oneshot::Receiver<()>,
}

impl Ticket {
    /// Runs `work` (the handshake) unless the connection is shed first, then gives the
    /// place back. `None` when it was shed.
    pub async fn run<F: Future>(mut self, work: F) -> Option<F::Output> {
        tokio::select! {
            out = work => Some(out),
            _ = &mut self.shed => None,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.gate.lock().finish(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(total: usize, per_source: usize) -> Admission<u32> {
        Admission::new(AdmissionLimits { total, per_source })
    }

    #[test]
    fn a_full_source_sheds_its_own_oldest_and_leaves_others_alone() {
        let mut a = admission(100, 2);
        let (_, shed) = a.admit("10.0.0.1", 1);
        assert!(shed.is_empty());
        a.admit("10.0.0.2", 2);
        a.admit("10.0.0.1", 3);
        let (_, shed) = a.admit("10.0.0.1", 4);
        assert_eq!(shed, vec![1]);
        assert_eq!(a.len(), 3);
        let (_, shed) = a.admit("10.0.0.1", 5);
        assert_eq!(shed, vec![3], "the source's oldest, not the other source's");
        assert_eq!(a.shed_total(), 2);
    }

    #[test]
    fn a_full_node_sheds_the_oldest_of_all() {
        let mut a = admission(3, 10);
        a.admit("a", 1);
        a.admit("b", 2);
        a.admit("c", 3);
        let (_, shed) = a.admit("d", 4);
        assert_eq!(shed, vec![1]);
        assert_eq!(a.len(), 3);
    }

    #[test]
    fn finished_handshakes_free_their_place_once() {
        let mut a = admission(2, 2);
        let (first, _) = a.admit("a", 1);
        let (second, _) = a.admit("a", 2);
        assert_eq!(a.finish(first), Some(1));
        assert_eq!(a.finish(first), None);
        let (_, shed) = a.admit("a", 3);
        assert!(shed.is_empty());
        assert_eq!(a.finish(second), Some(2));
        assert_eq!(a.len(), 1);
        assert!(!a.is_empty());
    }

    #[tokio::test]
    async fn a_ticket_runs_its_work_unless_shed_and_gives_its_place_back() {
        let gate = Gate::new(AdmissionLimits {
            total: 1,
            per_source: 1,
        });
        let (first, shed) = gate.admit("a");
        assert_eq!(shed, 0);
        assert_eq!(first.run(async { 7 }).await, Some(7));
        let (old, _) = gate.admit("a");
        let (new, shed) = gate.admit("a");
        assert_eq!(shed, 1, "the bound sheds the older ticket");
        assert_eq!(old.run(std::future::pending::<()>()).await, None);
        drop(new);
        assert!(
            gate.lock().is_empty(),
            "dropped tickets give their place back"
        );
    }

    #[test]
    fn a_flood_never_holds_more_than_the_bounds_and_the_newest_survives() {
        let mut a = admission(64, 8);
        let mut newest = None;
        for i in 0..10_000u32 {
            let source = format!("198.18.0.{}", i % 300);
            let (id, _) = a.admit(&source, i);
            newest = Some(id);
            assert!(a.len() <= 64);
        }
        let Some(newest) = newest else {
            panic!("nothing admitted")
        };
        assert_eq!(a.finish(newest), Some(9_999));
    }
}
