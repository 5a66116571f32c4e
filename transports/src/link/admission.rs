//! Admission of unauthenticated connections: how many may be in their handshake at once, in
//! all and per source address, and which one gives way when a new one arrives.
//!
//! The accept loop never waits for room: it accepts every connection at once and, when the
//! bounds are reached, sheds a pending handshake (of the same source first, then of all).
//! Which one depends on how far each has come: a connection that has said nothing yet
//! (idle) goes before one that has sent part of its preamble (partial), the oldest first.
//! A connection whose preamble is complete and well-formed leaves that set: it is never
//! shed for a connection that has not got as far. Those connections are bounded apart, by
//! the same numbers, and one gives way only to another complete preamble (the oldest
//! first). A legitimate peer sends its whole preamble as soon as it connects, so an
//! attacker's idle or trickling connections, however many, never push it out; an attacker
//! that sends whole preambles and then stalls competes only with other whole preambles, and
//! the oldest of those goes first.
//!
//! How far a connection has come is what its handshake reported, and, for the one about to
//! be shed, what its socket holds at that moment ([`Peek`]): a preamble that arrived while
//! its handshake task had not run yet (an accept loop taking a flood of connections runs
//! ahead of the tasks it spawns) still counts. No I/O here beyond that look: the caller holds
//! one token per pending handshake (something that ends it when dropped or fired), reports
//! each one's progress and carries out the sheds this returns.

use std::collections::BTreeMap;
use std::future::Future;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

use super::listener::peek_stage;

/// Identifies one admitted handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PendingId(u64);

/// The bounds on pending handshakes. Connections still sending their preamble and those
/// whose preamble is complete are bounded apart, each by these numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Pending handshakes at once, in all (at least 1).
    pub total: usize,
    /// Pending handshakes at once from one source (at least 1).
    pub per_source: usize,
}

/// How far a pending handshake has come, as far as its peer's first bytes show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// Nothing received yet.
    Idle,
    /// Some bytes received, not yet a whole, well-formed preamble.
    Partial,
    /// A whole, well-formed preamble received: out of reach of connections that have not
    /// got as far.
    Preamble,
}

impl Stage {
    /// The set the stage counts in: still sending (idle or partial), or past its preamble.
    fn past_preamble(self) -> bool {
        self == Stage::Preamble
    }
}

/// A pending handshake's token, looked at again just before it would be shed.
pub trait Peek {
    /// How far the peer has come by what it has sent so far, without waiting and without
    /// taking the bytes; `None` when that cannot be told.
    fn peek(&self) -> Option<Stage>;
}

#[derive(Debug)]
struct Entry<T> {
    source: String,
    stage: Stage,
    token: T,
}

/// The handshakes in progress, oldest first, each with its stage and the caller's token.
#[derive(Debug)]
pub struct Admission<T> {
    limits: AdmissionLimits,
    next: u64,
    pending: BTreeMap<PendingId, Entry<T>>,
    shed: u64,
}

impl<T: Peek> Admission<T> {
    /// No handshake pending; bounds below 1 count as 1.
    pub fn new(limits: AdmissionLimits) -> Self {
        Self {
            limits: AdmissionLimits {
                total: limits.total.max(1),
                per_source: limits.per_source.max(1),
            },
            next: 0,
            pending: BTreeMap::new(),
            shed: 0,
        }
    }

    /// Admits a new handshake from `source` at `stage` holding `token`. Returns its id and
    /// the tokens of the handshakes shed to make room in its set (the source's when the
    /// source is at its bound, then any when the total is; idle before partial, the oldest
    /// first; only others past their preamble for one admitted past it): the caller ends
    /// those.
    pub fn admit(&mut self, source: &str, stage: Stage, token: T) -> (PendingId, Vec<T>) {
        let shed = self.make_room(source, stage.past_preamble());
        let id = PendingId(self.next);
        self.next += 1;
        self.pending.insert(
            id,
            Entry {
                source: source.to_owned(),
                stage,
                token,
            },
        );
        (id, shed)
    }

    /// The handshake `id` has come as far as `stage` (a stage it has passed already changes
    /// nothing). Reaching [`Stage::Preamble`] moves it into the set of those past their
    /// preamble, keeping its age; returns the tokens shed there to make room (the caller
    /// ends those). Nothing when `id` is no longer pending.
    pub fn advance(&mut self, id: PendingId, stage: Stage) -> Vec<T> {
        let Some(entry) = self.pending.get_mut(&id) else {
            return Vec::new();
        };
        if stage <= entry.stage {
            return Vec::new();
        }
        if stage.past_preamble() {
            return self.past_its_preamble(id);
        }
        entry.stage = stage;
        Vec::new()
    }

    /// The handshake `id` ended (succeeded, failed, or was shed): forget it. Returns its
    /// token if it was still pending.
    pub fn finish(&mut self, id: PendingId) -> Option<T> {
        self.pending.remove(&id).map(|e| e.token)
    }

    /// Handshakes pending now, in both sets.
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

    /// Moves `id` into the set of those past their preamble, keeping its age: the tokens
    /// shed there to make room.
    fn past_its_preamble(&mut self, id: PendingId) -> Vec<T> {
        let Some(mut entry) = self.pending.remove(&id) else {
            return Vec::new();
        };
        let shed = self.make_room(&entry.source, true);
        entry.stage = Stage::Preamble;
        self.pending.insert(id, entry);
        shed
    }

    /// Makes the room one more handshake of `source` in the set `past_preamble` needs:
    /// below the source's bound, then below the total.
    fn make_room(&mut self, source: &str, past_preamble: bool) -> Vec<T> {
        let mut shed = Vec::new();
        while self.count(past_preamble, Some(source)) >= self.limits.per_source
            && self.give_way(past_preamble, Some(source), &mut shed)
        {}
        while self.count(past_preamble, None) >= self.limits.total
            && self.give_way(past_preamble, None, &mut shed)
        {}
        shed
    }

    /// One step towards room in the set `past_preamble` (of `source` when given): its
    /// oldest at the earliest stage is shed (its token pushed on `shed`), unless its socket
    /// shows it has got further than known, when it moves on instead (out of the set, for a
    /// whole preamble). False when the set is empty.
    fn give_way(&mut self, past_preamble: bool, source: Option<&str>, shed: &mut Vec<T>) -> bool {
        let Some(id) = self.victim(past_preamble, source) else {
            return false;
        };
        let Some(entry) = self.pending.get_mut(&id) else {
            return false;
        };
        match entry.token.peek() {
            Some(seen) if seen > entry.stage && seen.past_preamble() => {
                let moved_on = self.past_its_preamble(id);
                shed.extend(moved_on);
            }
            Some(seen) if seen > entry.stage => entry.stage = seen,
            _ => {
                if let Some(token) = self.finish(id) {
                    self.shed += 1;
                    shed.push(token);
                }
            }
        }
        true
    }

    /// The handshakes of the set `past_preamble` (of `source` when given).
    fn set<'a>(
        &'a self,
        past_preamble: bool,
        source: Option<&'a str>,
    ) -> impl Iterator<Item = (&'a PendingId, &'a Entry<T>)> + Clone + 'a {
        self.pending.iter().filter(move |(_, e)| {
            e.stage.past_preamble() == past_preamble && source.is_none_or(|s| e.source == s)
        })
    }

    fn count(&self, past_preamble: bool, source: Option<&str>) -> usize {
        self.set(past_preamble, source).count()
    }

    /// The one to shed next from the set `past_preamble` (of `source` when given): the
    /// oldest at the earliest stage.
    fn victim(&self, past_preamble: bool, source: Option<&str>) -> Option<PendingId> {
        let set = self.set(past_preamble, source);
        let earliest = set.clone().map(|(_, e)| e.stage).min()?;
        set.clone()
            .find(|(_, e)| e.stage == earliest)
            .map(|(id, _)| *id)
    }
}

/// What a [`Gate`] holds for one pending connection: the sender that sheds it, and a
/// duplicate of its socket to look at before it is shed.
#[derive(Debug)]
struct Held {
    /// Dropped (with the entry) to end the connection's handshake.
    _shed: oneshot::Sender<()>,
    socket: Option<OwnedFd>,
}

impl Peek for Held {
    fn peek(&self) -> Option<Stage> {
        self.socket.as_ref().map(|fd| peek_stage(fd.as_fd()))
    }
}

/// An [`Admission`] shared by an accept loop and the tasks it spawns: each accepted
/// connection takes a [`Ticket`] and runs its handshake under it.
#[derive(Debug, Clone)]
pub struct Gate {
    admission: Arc<Mutex<Admission<Held>>>,
    /// The counter that sheds are added to, if any.
    shed_metric: Option<&'static str>,
}

impl Gate {
    /// A gate with these bounds; every shed is added to the counter `shed_metric` when
    /// one is given.
    pub fn new(limits: AdmissionLimits, shed_metric: Option<&'static str>) -> Self {
        Self {
            admission: Arc::new(Mutex::new(Admission::new(limits))),
            shed_metric,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Admission<Held>> {
        // A panic under this lock leaves the bookkeeping whole (every change is one insert
        // or remove), so a poisoned lock is still used: accepting must not stop.
        self.admission
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts `victims` as shed; dropping them ends their tickets' work.
    fn shed(&self, victims: Vec<Held>) -> usize {
        if let Some(metric) = self.shed_metric
            && !victims.is_empty()
        {
            metrics::counter!(metric).increment(victims.len() as u64);
        }
        victims.len()
    }

    /// Admits a connection from `source` of which nothing is known (it counts as idle
    /// until its handshake reports otherwise); returns its ticket and how many older
    /// pending ones were shed to make room (their tickets' work ends at once).
    pub fn admit(&self, source: &str) -> (Ticket, usize) {
        self.admit_at(source, Stage::Idle, None)
    }

    /// Admits an accepted connection at the stage its first bytes show
    /// ([`Accepted::stage`](super::Accepted::stage)), keeping a duplicate of its socket
    /// (one more file descriptor while it is pending) to look at again before shedding it,
    /// and has its handshake report its progress here (its first byte in
    /// [`Accepted::first_byte`](super::Accepted::first_byte), its whole preamble in
    /// [`accept_handshake`](super::accept_handshake)). Returns its ticket and how many
    /// pending ones were shed to make room.
    pub fn admit_accepted(&self, accepted: &mut super::Accepted) -> (Ticket, usize) {
        let (ticket, shed) =
            self.admit_at(accepted.source(), accepted.stage(), accepted.socket_copy());
        accepted.report_to(ticket.progress());
        (ticket, shed)
    }

    fn admit_at(&self, source: &str, stage: Stage, socket: Option<OwnedFd>) -> (Ticket, usize) {
        let (shed_me, shed) = oneshot::channel();
        let held = Held {
            _shed: shed_me,
            socket,
        };
        let (id, victims) = self.lock().admit(source, stage, held);
        let ticket = Ticket {
            progress: Progress {
                gate: self.clone(),
                id,
            },
            shed,
        };
        (ticket, self.shed(victims))
    }
}

/// Where a [`Ticket`]'s handshake reports how far it has come.
#[derive(Debug, Clone)]
pub struct Progress {
    gate: Gate,
    id: PendingId,
}

impl Progress {
    /// The handshake has come as far as `stage`; returns how many pending ones were shed
    /// to make room for it among those past their preamble. Nothing once it has ended.
    pub fn reached(&self, stage: Stage) -> usize {
        let victims = self.gate.lock().advance(self.id, stage);
        self.gate.shed(victims)
    }
}

/// One admitted connection's place in its [`Gate`]; dropping it gives the place back.
#[derive(Debug)]
pub struct Ticket {
    progress: Progress,
    shed: oneshot::Receiver<()>,
}

impl Ticket {
    /// Where the handshake reports its progress (see [`Progress::reached`]).
    pub fn progress(&self) -> Progress {
        self.progress.clone()
    }

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
        // Also closes the copy of its socket.
        self.progress.gate.lock().finish(self.progress.id);
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;

    /// Tokens of the state-machine tests: their sockets tell nothing.
    impl Peek for u32 {
        fn peek(&self) -> Option<Stage> {
            None
        }
    }

    fn admission(total: usize, per_source: usize) -> Admission<u32> {
        Admission::new(AdmissionLimits { total, per_source })
    }

    #[test]
    fn a_full_source_sheds_its_own_oldest_and_leaves_others_alone() {
        let mut a = admission(100, 2);
        let (_, shed) = a.admit("10.0.0.1", Stage::Idle, 1);
        assert!(shed.is_empty());
        a.admit("10.0.0.2", Stage::Idle, 2);
        a.admit("10.0.0.1", Stage::Idle, 3);
        let (_, shed) = a.admit("10.0.0.1", Stage::Idle, 4);
        assert_eq!(shed, vec![1]);
        assert_eq!(a.len(), 3);
        let (_, shed) = a.admit("10.0.0.1", Stage::Idle, 5);
        assert_eq!(shed, vec![3], "the source's oldest, not the other source's");
        assert_eq!(a.shed_total(), 2);
    }

    #[test]
    fn a_full_node_sheds_the_oldest_of_all() {
        let mut a = admission(3, 10);
        a.admit("a", Stage::Idle, 1);
        a.admit("b", Stage::Idle, 2);
        a.admit("c", Stage::Idle, 3);
        let (_, shed) = a.admit("d", Stage::Idle, 4);
        assert_eq!(shed, vec![1]);
        assert_eq!(a.len(), 3);
    }

    #[test]
    fn idle_connections_go_before_partial_ones_the_oldest_first() {
        let mut a = admission(3, 3);
        let (first, _) = a.admit("a", Stage::Idle, 1);
        a.admit("a", Stage::Idle, 2);
        a.admit("a", Stage::Idle, 3);
        assert!(a.advance(first, Stage::Partial).is_empty());
        let (_, shed) = a.admit("a", Stage::Idle, 4);
        assert_eq!(
            shed,
            vec![2],
            "the oldest idle one, not the older partial one"
        );
        let (_, shed) = a.admit("a", Stage::Idle, 5);
        assert_eq!(shed, vec![3]);
        let (_, shed) = a.admit("a", Stage::Idle, 6);
        assert_eq!(shed, vec![4]);
        let (_, shed) = a.admit("a", Stage::Partial, 7);
        assert_eq!(shed, vec![5], "idle first whatever the newcomer's stage");
        let (eight, shed) = a.admit("a", Stage::Idle, 8);
        assert_eq!(shed, vec![6]);
        assert!(a.advance(eight, Stage::Partial).is_empty());
        let (_, shed) = a.admit("a", Stage::Idle, 9);
        assert_eq!(shed, vec![1], "with none idle, the oldest partial goes");
    }

    #[test]
    fn a_complete_preamble_is_never_shed_for_a_connection_that_has_not_got_as_far() {
        let mut a = admission(2, 2);
        let (real, _) = a.admit("a", Stage::Idle, 0);
        assert!(a.advance(real, Stage::Preamble).is_empty());
        let (early, _) = a.admit("a", Stage::Preamble, 1);
        // A flood of idle and partial connections sheds only among themselves.
        for i in 2..1_000 {
            let stage = if i % 2 == 0 {
                Stage::Idle
            } else {
                Stage::Partial
            };
            let (_, shed) = a.admit("a", stage, i);
            assert!(shed.iter().all(|t| *t >= 2), "shed {shed:?} for {i}");
        }
        assert_eq!(a.len(), 4, "both sets full");
        // Another complete preamble sheds the oldest of those past theirs.
        let (_, shed) = a.admit("a", Stage::Preamble, 1_000);
        assert_eq!(shed, vec![0]);
        assert_eq!(a.finish(early), Some(1));
        // A partial connection that completes its preamble moves over, keeping its age.
        let (late, _) = a.admit("b", Stage::Partial, 1_001);
        assert_eq!(a.advance(late, Stage::Preamble), Vec::<u32>::new());
        let (_, shed) = a.admit("c", Stage::Preamble, 1_002);
        assert_eq!(shed, vec![1_000], "the oldest past its preamble");
        assert!(a.advance(late, Stage::Partial).is_empty(), "no way back");
        let (_, shed) = a.admit("c", Stage::Idle, 1_003);
        assert!(!shed.contains(&1_001), "{shed:?}");
        assert_eq!(a.finish(late), Some(1_001));
    }

    /// A token whose socket shows what the test put there.
    #[derive(Debug)]
    struct Seen(u32, Rc<Cell<Option<Stage>>>);

    impl Peek for Seen {
        fn peek(&self) -> Option<Stage> {
            self.1.get()
        }
    }

    #[test]
    fn what_a_socket_holds_is_looked_at_before_it_is_shed() {
        let mut a = Admission::new(AdmissionLimits {
            total: 2,
            per_source: 2,
        });
        let socket = |stage| Rc::new(Cell::new(stage));
        let real = socket(Some(Stage::Idle));
        let trickle = socket(Some(Stage::Idle));
        a.admit("a", Stage::Idle, Seen(0, Rc::clone(&real)));
        a.admit("a", Stage::Idle, Seen(1, Rc::clone(&trickle)));
        // The real peer's whole preamble and the other's first byte arrive before either
        // handshake ran: the oldest moves past its preamble instead of being shed.
        real.set(Some(Stage::Preamble));
        trickle.set(Some(Stage::Partial));
        let (_, shed) = a.admit("a", Stage::Idle, Seen(2, socket(Some(Stage::Idle))));
        assert!(shed.is_empty(), "room made by moving it on");
        let (_, shed) = a.admit("a", Stage::Idle, Seen(3, socket(None)));
        let shed: Vec<u32> = shed.iter().map(|s| s.0).collect();
        assert_eq!(shed, [2], "the idle one before the one seen partial");
        for i in 4..100 {
            let (_, shed) = a.admit("a", Stage::Idle, Seen(i, socket(None)));
            assert!(shed.iter().all(|s| s.0 > 0), "{i}");
        }
        assert_eq!(a.shed_total(), 97);
    }

    #[test]
    fn finished_handshakes_free_their_place_once() {
        let mut a = admission(2, 2);
        let (first, _) = a.admit("a", Stage::Idle, 1);
        let (second, _) = a.admit("a", Stage::Idle, 2);
        assert_eq!(a.finish(first), Some(1));
        assert_eq!(a.finish(first), None);
        assert!(a.advance(first, Stage::Preamble).is_empty());
        let (_, shed) = a.admit("a", Stage::Idle, 3);
        assert!(shed.is_empty());
        assert_eq!(a.finish(second), Some(2));
        assert_eq!(a.len(), 1);
        assert!(!a.is_empty());
    }

    #[tokio::test]
    async fn a_ticket_runs_its_work_unless_shed_and_gives_its_place_back() {
        let gate = Gate::new(
            AdmissionLimits {
                total: 1,
                per_source: 1,
            },
            None,
        );
        let (first, shed) = gate.admit("a");
        assert_eq!(shed, 0);
        assert_eq!(first.run(async { 7 }).await, Some(7));
        let (old, _) = gate.admit("a");
        let (new, shed) = gate.admit("a");
        assert_eq!(shed, 1, "the bound sheds the older ticket");
        assert_eq!(old.run(std::future::pending::<()>()).await, None);
        // Past its preamble, the new one makes room among those alone.
        let (older, _) = gate.admit_at("b", Stage::Preamble, None);
        assert_eq!(new.progress().reached(Stage::Preamble), 1);
        assert_eq!(older.run(std::future::pending::<()>()).await, None);
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
            let stage = [Stage::Idle, Stage::Partial, Stage::Preamble][i as usize % 3];
            let (id, _) = a.admit(&source, stage, i);
            newest = Some(id);
            assert!(a.len() <= 2 * 64);
        }
        let Some(newest) = newest else {
            panic!("nothing admitted")
        };
        assert_eq!(a.finish(newest), Some(9_999));
    }
}
