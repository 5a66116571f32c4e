//! Lazy connection setup of one transport towards one peer, after Open MPI's smcuda (the
//! machine is generic: the steps' payloads are the transport's own, ipc's pool import and
//! lane today):
//! nothing is set up until the first transfer wants the transport; then
//!
//! ```text
//! Init ──want──> Sent ──peer's reply──> Acking ──checks pass──> Acked ──peer confirms──> Ok
//!                 │                      │                        │
//!                 └───────── timeout, refusal, failed check ──────┴──> retry (Sent) or Bad
//! ```
//!
//! - **Sent**: we sent our setup request (our device uuids and pool export info).
//! - **Acking**: the peer answered with its own; the shell now checks what only it can see
//!   (the same host, peer access between the two devices, that importing the peer's pool
//!   works) and reports the result.
//! - **Acked**: the checks passed and we sent our ack; the peer's confirmation ends setup.
//! - **Ok**: transfers use the transport. **Bad**: they fall back to the next transport of
//!   their rule; the reason is kept ([`SetupFailure`]) for the log, the metric and
//!   `ferry explain`.
//!
//! Every attempt has a deadline; a failure that may pass (a timeout, a failed import) starts
//! a new attempt, up to [`SetupPolicy::max_attempts`]; a failure that cannot change between
//! attempts (another host, no peer access, the peer's refusal) ends setup at once. Messages
//! carry their attempt number, so a late answer to an earlier attempt, or anything that
//! arrives after Ok or Bad, is ignored.
//!
//! A transfer that wants the transport while setup runs is queued here and comes out as
//! [`SetupEvent::Proceed`] on Ok or [`SetupEvent::FallBack`] on Bad. No I/O and no clock:
//! the shell feeds events in through `handle_*` and carries out what `poll_*` returns.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{Admission as PeerAdmission, PartEvent};

/// Why setup ended in Bad.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SetupFailure {
    /// The peer runs on another host (different boot id or hostname).
    NotSameHost,
    /// Device `src` cannot map device `dst`'s memory.
    NoPeerAccess {
        /// Our device ordinal.
        src: u32,
        /// The peer's device ordinal (as its uuid maps onto our ordinals).
        dst: u32,
    },
    /// Importing the peer's pool or handle failed; the driver's message.
    ImportFailed(String),
    /// An attempt's deadline passed without an answer.
    Timeout,
    /// The peer refused setup; its reason.
    PeerRefused(String),
    /// What the peer said of itself shows the transport cannot work between the two (a
    /// peer on another UCX release); why.
    Incompatible(String),
}

impl SetupFailure {
    /// True when another attempt may succeed: a timeout or a failed import (the peer's pool
    /// may not have been ready). The others do not change between attempts.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Timeout | Self::ImportFailed(_))
    }
}

impl std::fmt::Display for SetupFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotSameHost => f.write_str("the peer is on another host"),
            Self::NoPeerAccess { src, dst } => {
                write!(f, "no peer access from device {src} to device {dst}")
            }
            Self::ImportFailed(why) => write!(f, "importing the peer's memory failed: {why}"),
            Self::Timeout => f.write_str("the peer did not answer in time"),
            Self::PeerRefused(why) => write!(f, "the peer refused: {why}"),
            Self::Incompatible(why) => f.write_str(why),
        }
    }
}

/// How a finished setup ended, as route choice reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetupOutcome {
    /// The transport works with this peer.
    Ok,
    /// It does not; transfers fall back.
    Bad(SetupFailure),
}

/// Bounds of one setup. Constants, not configuration: setup is a handful of control
/// messages and one import, so these only cap how long a broken peer can stall a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetupPolicy {
    /// Attempts before giving up, the first included (at least 1): `max_attempts - 1`
    /// retries.
    pub max_attempts: u32,
    /// How long one attempt may take, from sending the request to the peer's confirmation.
    pub attempt_timeout: Duration,
}

impl SetupPolicy {
    /// Three attempts of one second each. Opening a peer's pool takes about a millisecond
    /// on the H200 machines, so a second is ample and three bound the stall at three seconds.
    pub const DEFAULT: Self = Self {
        max_attempts: 3,
        attempt_timeout: Duration::from_secs(1),
    };
}

impl Default for SetupPolicy {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// The number of one attempt, carried by every setup message (1 for the first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Attempt(pub u32);

/// Where setup stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetupPhase {
    /// Nothing asked for the transport yet.
    Init,
    /// Our request is out; waiting for the peer's reply.
    Sent {
        /// This attempt.
        attempt: Attempt,
        /// When it times out.
        deadline: Instant,
    },
    /// The peer replied; the shell is checking.
    Acking {
        /// This attempt.
        attempt: Attempt,
        /// When it times out.
        deadline: Instant,
    },
    /// Our ack is out; waiting for the peer's confirmation.
    Acked {
        /// This attempt.
        attempt: Attempt,
        /// When it times out.
        deadline: Instant,
    },
    /// Set up.
    Ok,
    /// Failed for good.
    Bad(SetupFailure),
}

/// What the peer answered to our request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerReply {
    /// It accepted and sent its own device and pool information (kept by the shell).
    Accepted,
    /// It refused, for this reason.
    Refused(String),
}

/// A setup message for the shell to send to the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetupTransmit {
    /// Our setup request: the shell adds our device uuids and pool export info.
    Request(Attempt),
    /// Our checks of the peer passed.
    Ack(Attempt),
    /// Our checks of the peer failed: the peer drops what it prepared for this attempt.
    Nack(Attempt, SetupFailure),
}

/// What the shell must do, besides sending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetupEvent<T> {
    /// Check the peer's reply to this attempt (same host, peer access, import of its pool),
    /// then report with [`Setup::handle_checks`].
    Check(Attempt),
    /// Setup ended; log it and count it.
    Settled(SetupOutcome),
    /// A queued transfer may use the transport now.
    Proceed(T),
    /// A queued transfer must take the next transport of its rule, because of this.
    FallBack(T, SetupFailure),
}

/// The answer to [`Setup::handle_want`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission<T> {
    /// Set up: use the transport now.
    Ready(T),
    /// Setup is under way; the transfer is queued and comes back as a [`SetupEvent`].
    Queued,
    /// Setup failed: take the next transport of the rule.
    FallBack(T, SetupFailure),
}

/// The lazy setup of one transport towards one peer. `T` identifies a waiting transfer.
#[derive(Debug)]
pub struct Setup<T> {
    policy: SetupPolicy,
    phase: SetupPhase,
    /// Requests sent so far (the attempt number of the latest).
    attempts: u32,
    waiting: VecDeque<T>,
    transmit: VecDeque<SetupTransmit>,
    events: VecDeque<SetupEvent<T>>,
}

impl<T> Setup<T> {
    /// A setup that has not started.
    pub fn new(policy: SetupPolicy) -> Self {
        Self {
            policy: SetupPolicy {
                max_attempts: policy.max_attempts.max(1),
                ..policy
            },
            phase: SetupPhase::Init,
            attempts: 0,
            waiting: VecDeque::new(),
            transmit: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    /// Where setup stands.
    pub fn phase(&self) -> &SetupPhase {
        &self.phase
    }

    /// Ok or Bad once setup has ended; `None` before and while it runs.
    pub fn outcome(&self) -> Option<SetupOutcome> {
        match &self.phase {
            SetupPhase::Ok => Some(SetupOutcome::Ok),
            SetupPhase::Bad(why) => Some(SetupOutcome::Bad(why.clone())),
            _ => None,
        }
    }

    /// Requests sent so far (retries are this minus one).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Transfers queued while setup runs.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// A transfer wants the transport. The first one starts setup.
    pub fn handle_want(&mut self, now: Instant, op: T) -> Admission<T> {
        match &self.phase {
            SetupPhase::Ok => Admission::Ready(op),
            SetupPhase::Bad(why) => Admission::FallBack(op, why.clone()),
            SetupPhase::Init => {
                self.waiting.push_back(op);
                self.start_attempt(now);
                Admission::Queued
            }
            SetupPhase::Sent { .. } | SetupPhase::Acking { .. } | SetupPhase::Acked { .. } => {
                self.waiting.push_back(op);
                Admission::Queued
            }
        }
    }

    /// The peer answered our request `attempt`. Ignored unless we are waiting for exactly
    /// that answer.
    pub fn handle_reply(&mut self, now: Instant, attempt: Attempt, reply: PeerReply) {
        let SetupPhase::Sent {
            attempt: current,
            deadline,
        } = self.phase
        else {
            return;
        };
        if attempt != current {
            return;
        }
        match reply {
            PeerReply::Accepted => {
                self.phase = SetupPhase::Acking { attempt, deadline };
                self.events.push_back(SetupEvent::Check(attempt));
            }
            PeerReply::Refused(why) => self.fail(now, SetupFailure::PeerRefused(why)),
        }
    }

    /// The shell's checks of attempt `attempt` ended. Ignored unless we are checking exactly
    /// that attempt.
    pub fn handle_checks(
        &mut self,
        now: Instant,
        attempt: Attempt,
        result: Result<(), SetupFailure>,
    ) {
        let SetupPhase::Acking {
            attempt: current,
            deadline,
        } = self.phase
        else {
            return;
        };
        if attempt != current {
            return;
        }
        match result {
            Ok(()) => {
                self.transmit.push_back(SetupTransmit::Ack(attempt));
                self.phase = SetupPhase::Acked { attempt, deadline };
            }
            Err(why) => {
                self.transmit
                    .push_back(SetupTransmit::Nack(attempt, why.clone()));
                self.fail(now, why);
            }
        }
    }

    /// The peer confirmed our ack of `attempt`: setup is done. Ignored unless we are waiting
    /// for exactly that confirmation (a late one after Bad changes nothing).
    pub fn handle_confirm(&mut self, attempt: Attempt) {
        let SetupPhase::Acked {
            attempt: current, ..
        } = self.phase
        else {
            return;
        };
        if attempt != current {
            return;
        }
        self.phase = SetupPhase::Ok;
        self.events.push_back(SetupEvent::Settled(SetupOutcome::Ok));
        while let Some(op) = self.waiting.pop_front() {
            self.events.push_back(SetupEvent::Proceed(op));
        }
    }

    /// Time passed: an attempt whose deadline is at or before `now` times out.
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.phase {
            SetupPhase::Sent { deadline, .. }
            | SetupPhase::Acking { deadline, .. }
            | SetupPhase::Acked { deadline, .. }
                if deadline <= now =>
            {
                self.fail(now, SetupFailure::Timeout)
            }
            _ => {}
        }
    }

    /// The next message to send to the peer.
    pub fn poll_transmit(&mut self) -> Option<SetupTransmit> {
        self.transmit.pop_front()
    }

    /// The next thing the shell must do.
    pub fn poll_event(&mut self) -> Option<SetupEvent<T>> {
        self.events.pop_front()
    }

    /// True while an attempt waits on the peer: for its reply to our request, or for its
    /// confirmation of our ack (not while this side checks the reply).
    pub fn awaits_peer(&self) -> bool {
        matches!(
            self.phase,
            SetupPhase::Sent { .. } | SetupPhase::Acked { .. }
        )
    }

    /// When [`handle_timeout`](Self::handle_timeout) must be called next, if ever.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.phase {
            SetupPhase::Sent { deadline, .. }
            | SetupPhase::Acking { deadline, .. }
            | SetupPhase::Acked { deadline, .. } => Some(deadline),
            SetupPhase::Init | SetupPhase::Ok | SetupPhase::Bad(_) => None,
        }
    }

    fn start_attempt(&mut self, now: Instant) {
        self.attempts += 1;
        let attempt = Attempt(self.attempts);
        self.transmit.push_back(SetupTransmit::Request(attempt));
        self.phase = SetupPhase::Sent {
            attempt,
            deadline: now + self.policy.attempt_timeout,
        };
    }

    /// The current attempt failed: retry if the failure may pass and attempts remain, else
    /// end in Bad and send every waiting transfer to its fallback.
    fn fail(&mut self, now: Instant, why: SetupFailure) {
        if why.is_retryable() && self.attempts < self.policy.max_attempts {
            self.start_attempt(now);
            return;
        }
        self.phase = SetupPhase::Bad(why.clone());
        self.events
            .push_back(SetupEvent::Settled(SetupOutcome::Bad(why.clone())));
        while let Some(op) = self.waiting.pop_front() {
            self.events.push_back(SetupEvent::FallBack(op, why.clone()));
        }
    }
}

/// A transport part's side of its setup with one peer: the machine (made by the first
/// send that wants it), the tickets of the sends waiting for it, and the driving of its
/// events into the part's ([`PartEvent`]).
#[derive(Debug, Default)]
pub struct PartSetup {
    setup: Option<Setup<u64>>,
    next_ticket: u64,
}

impl PartSetup {
    /// A send over the transport asks (the first starts setup): go now, wait (by ticket:
    /// [`PartEvent::Proceed`] or [`PartEvent::FallBack`] follows), or fall back saying why.
    pub fn admit(&mut self, now: Instant) -> PeerAdmission {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let setup = (self.setup).get_or_insert_with(|| Setup::new(SetupPolicy::DEFAULT));
        match setup.handle_want(now, ticket) {
            Admission::Ready(_) => PeerAdmission::Ready,
            Admission::Queued => PeerAdmission::Queued(ticket),
            Admission::FallBack(_, why) => PeerAdmission::FallBack(why),
        }
    }

    /// The machine, once a send asked for it.
    pub fn machine(&mut self) -> Option<&mut Setup<u64>> {
        self.setup.as_mut()
    }

    /// Runs what the machine asks for: each check of the peer's reply (what only this side
    /// sees: is the peer on this host, `same_host`), the sends waiting for it into `events`.
    /// Returns the messages to send, and the outcome when setup ended now.
    pub fn drive(
        &mut self,
        now: Instant,
        same_host: bool,
        events: &mut VecDeque<PartEvent>,
    ) -> (Vec<SetupTransmit>, Option<SetupOutcome>) {
        let check = || {
            if same_host {
                Ok(())
            } else {
                Err(SetupFailure::NotSameHost)
            }
        };
        let (mut transmits, mut settled) = (Vec::new(), None);
        let Some(setup) = self.setup.as_mut() else {
            return (transmits, settled);
        };
        loop {
            let mut moved = false;
            while let Some(t) = setup.poll_transmit() {
                moved = true;
                transmits.push(t);
            }
            while let Some(ev) = setup.poll_event() {
                moved = true;
                match ev {
                    SetupEvent::Check(a) => setup.handle_checks(now, a, check()),
                    SetupEvent::Settled(outcome) => settled = Some(outcome),
                    SetupEvent::Proceed(ticket) => events.push_back(PartEvent::Proceed(ticket)),
                    SetupEvent::FallBack(ticket, why) => {
                        events.push_back(PartEvent::FallBack(ticket, why))
                    }
                }
            }
            if !moved {
                return (transmits, settled);
            }
        }
    }

    /// When [`Self::handle_timeout`] must be called next, if ever.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.setup.as_ref().and_then(Setup::poll_timeout)
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        if let Some(setup) = &mut self.setup {
            setup.handle_timeout(now);
        }
    }

    /// True while an attempt waits on the peer.
    pub fn awaits_peer(&self) -> bool {
        self.setup.as_ref().is_some_and(Setup::awaits_peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: SetupPolicy = SetupPolicy {
        max_attempts: 2,
        attempt_timeout: Duration::from_millis(100),
    };

    fn started() -> (Setup<u32>, Instant) {
        let now = Instant::now();
        let mut s = Setup::new(POLICY);
        assert_eq!(s.handle_want(now, 1), Admission::Queued);
        (s, now)
    }

    #[test]
    fn init_to_sent_on_first_want() {
        let (mut s, now) = started();
        assert!(
            matches!(s.phase(), SetupPhase::Sent { attempt: Attempt(1), deadline } if *deadline == now + POLICY.attempt_timeout)
        );
        assert_eq!(s.poll_transmit(), Some(SetupTransmit::Request(Attempt(1))));
        assert_eq!(s.handle_want(now, 2), Admission::Queued);
        assert_eq!(s.poll_transmit(), None, "one request per attempt");
        assert_eq!(s.waiting(), 2);
    }

    #[test]
    fn sent_to_acking_to_acked_to_ok() {
        let (mut s, now) = started();
        s.handle_reply(now, Attempt(1), PeerReply::Accepted);
        assert!(matches!(s.phase(), SetupPhase::Acking { .. }));
        assert_eq!(s.poll_event(), Some(SetupEvent::Check(Attempt(1))));
        s.handle_checks(now, Attempt(1), Ok(()));
        assert!(matches!(s.phase(), SetupPhase::Acked { .. }));
        s.poll_transmit();
        assert_eq!(s.poll_transmit(), Some(SetupTransmit::Ack(Attempt(1))));
        s.handle_confirm(Attempt(1));
        assert_eq!(s.phase(), &SetupPhase::Ok);
        assert_eq!(s.poll_event(), Some(SetupEvent::Settled(SetupOutcome::Ok)));
        assert_eq!(s.poll_event(), Some(SetupEvent::Proceed(1)));
        assert_eq!(s.handle_want(now, 2), Admission::Ready(2));
        assert_eq!(s.poll_timeout(), None);
    }

    #[test]
    fn refusal_in_sent_is_bad_at_once() {
        let (mut s, now) = started();
        s.handle_reply(now, Attempt(1), PeerReply::Refused("draining".into()));
        let why = SetupFailure::PeerRefused("draining".into());
        assert_eq!(s.phase(), &SetupPhase::Bad(why.clone()));
        assert_eq!(s.attempts(), 1);
        assert_eq!(
            s.poll_event(),
            Some(SetupEvent::Settled(SetupOutcome::Bad(why.clone())))
        );
        assert_eq!(s.poll_event(), Some(SetupEvent::FallBack(1, why.clone())));
        assert_eq!(s.handle_want(now, 2), Admission::FallBack(2, why));
    }

    #[test]
    fn failed_import_in_acking_retries_then_bad() {
        let (mut s, now) = started();
        let failed = SetupFailure::ImportFailed("CUDA_ERROR_INVALID_VALUE".into());
        for n in 1..=2 {
            s.handle_reply(now, Attempt(n), PeerReply::Accepted);
            s.handle_checks(now, Attempt(n), Err(failed.clone()));
        }
        assert_eq!(s.phase(), &SetupPhase::Bad(failed.clone()));
        assert_eq!(s.attempts(), 2);
        let sent: Vec<_> = std::iter::from_fn(|| s.poll_transmit()).collect();
        assert_eq!(
            sent,
            [
                SetupTransmit::Request(Attempt(1)),
                SetupTransmit::Nack(Attempt(1), failed.clone()),
                SetupTransmit::Request(Attempt(2)),
                SetupTransmit::Nack(Attempt(2), failed),
            ]
        );
    }

    #[test]
    fn timeout_in_each_waiting_phase_retries() {
        for phase in 0..3 {
            let (mut s, mut now) = started();
            if phase >= 1 {
                s.handle_reply(now, Attempt(1), PeerReply::Accepted);
            }
            if phase >= 2 {
                s.handle_checks(now, Attempt(1), Ok(()));
            }
            now += POLICY.attempt_timeout - Duration::from_millis(1);
            s.handle_timeout(now);
            assert_eq!(s.attempts(), 1, "not yet");
            now += Duration::from_millis(1);
            s.handle_timeout(now);
            assert!(
                matches!(
                    s.phase(),
                    SetupPhase::Sent {
                        attempt: Attempt(2),
                        ..
                    }
                ),
                "{:?}",
                s.phase()
            );
            assert_eq!(s.poll_timeout(), Some(now + POLICY.attempt_timeout));
        }
    }

    #[test]
    fn answers_to_other_attempts_are_ignored() {
        let (mut s, now) = started();
        s.handle_reply(now, Attempt(7), PeerReply::Accepted);
        s.handle_checks(now, Attempt(1), Ok(()));
        s.handle_confirm(Attempt(1));
        assert!(matches!(s.phase(), SetupPhase::Sent { .. }));
        s.handle_reply(now, Attempt(1), PeerReply::Accepted);
        s.handle_checks(now, Attempt(2), Ok(()));
        s.handle_confirm(Attempt(1));
        assert!(matches!(s.phase(), SetupPhase::Acking { .. }));
    }

    #[test]
    fn at_least_one_attempt() {
        let mut s = Setup::new(SetupPolicy {
            max_attempts: 0,
            attempt_timeout: Duration::from_millis(1),
        });
        let now = Instant::now();
        s.handle_want(now, ());
        s.handle_timeout(now + Duration::from_millis(1));
        assert_eq!(s.phase(), &SetupPhase::Bad(SetupFailure::Timeout));
        assert_eq!(s.attempts(), 1);
    }
}
