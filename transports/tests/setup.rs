//! Scenarios on the lazy setup machine (ipc's today), in virtual time: a scripted peer answers (or
//! not) each attempt; the happy path, each failure ending in Bad with its reason after the
//! bounded retries, timeouts, late answers after Bad, and a property test that every setup
//! ends exactly once within the bound.

use std::time::{Duration, Instant};

use ferry_transports::transport::setup::{
    Admission, Attempt, PeerReply, Setup, SetupEvent, SetupFailure, SetupOutcome, SetupPhase,
    SetupPolicy, SetupTransmit,
};
use proptest::prelude::*;

const POLICY: SetupPolicy = SetupPolicy {
    max_attempts: 3,
    attempt_timeout: Duration::from_millis(50),
};

/// What the scripted peer and the local checks do on one attempt.
#[derive(Debug, Clone)]
enum Script {
    /// The peer never answers the request.
    Silent,
    /// The peer refuses.
    Refuse,
    /// The peer accepts; the local checks fail with this.
    CheckFails(SetupFailure),
    /// The peer accepts and the checks pass, but the confirmation never comes.
    NoConfirm,
    /// Everything works.
    Works,
}

/// One setup, its shell and the scripted peer, in virtual time.
struct World {
    now: Instant,
    setup: Setup<u32>,
    /// Script per attempt (the last repeats).
    script: Vec<Script>,
    sent: Vec<SetupTransmit>,
    proceeded: Vec<u32>,
    fell_back: Vec<(u32, SetupFailure)>,
    settled: Vec<SetupOutcome>,
}

impl World {
    fn new(script: Vec<Script>) -> Self {
        Self {
            now: Instant::now(),
            setup: Setup::new(POLICY),
            script,
            sent: Vec::new(),
            proceeded: Vec::new(),
            fell_back: Vec::new(),
            settled: Vec::new(),
        }
    }

    fn script_for(&self, attempt: Attempt) -> Script {
        let i = (attempt.0 as usize - 1).min(self.script.len() - 1);
        self.script[i].clone()
    }

    /// Delivers every output, lets the peer and the checks answer per the script, until
    /// nothing moves without time passing.
    fn settle(&mut self) {
        loop {
            let mut moved = false;
            while let Some(t) = self.setup.poll_transmit() {
                moved = true;
                self.sent.push(t.clone());
                match t {
                    SetupTransmit::Request(a) => match self.script_for(a) {
                        Script::Silent => {}
                        Script::Refuse => self.setup.handle_reply(
                            self.now,
                            a,
                            PeerReply::Refused("draining".into()),
                        ),
                        _ => self.setup.handle_reply(self.now, a, PeerReply::Accepted),
                    },
                    SetupTransmit::Ack(a) => {
                        if matches!(self.script_for(a), Script::Works) {
                            self.setup.handle_confirm(a);
                        }
                    }
                    SetupTransmit::Nack(..) => {}
                }
            }
            while let Some(e) = self.setup.poll_event() {
                moved = true;
                match e {
                    SetupEvent::Check(a) => {
                        let result = match self.script_for(a) {
                            Script::CheckFails(why) => Err(why),
                            _ => Ok(()),
                        };
                        self.setup.handle_checks(self.now, a, result);
                    }
                    SetupEvent::Settled(o) => self.settled.push(o),
                    SetupEvent::Proceed(op) => self.proceeded.push(op),
                    SetupEvent::FallBack(op, why) => self.fell_back.push((op, why)),
                }
            }
            if !moved {
                return;
            }
        }
    }

    /// Runs to the end: settles, then jumps to each deadline.
    fn run(&mut self) {
        self.settle();
        while let Some(at) = self.setup.poll_timeout() {
            assert!(at >= self.now, "deadline in the past");
            self.now = at;
            self.setup.handle_timeout(self.now);
            self.settle();
        }
    }

    fn want(&mut self, op: u32) -> Admission<u32> {
        let a = self.setup.handle_want(self.now, op);
        self.settle();
        a
    }

    fn requests(&self) -> usize {
        self.sent
            .iter()
            .filter(|t| matches!(t, SetupTransmit::Request(_)))
            .count()
    }
}

#[test]
fn happy_path_sets_up_once_and_releases_the_queue() {
    let mut w = World::new(vec![Script::Works]);
    let t0 = w.now;
    // The peer answers at once in this world, so the first want settles within settle().
    assert_eq!(w.setup.handle_want(w.now, 1), Admission::Queued);
    assert_eq!(w.setup.handle_want(w.now, 2), Admission::Queued);
    w.run();
    assert_eq!(w.setup.phase(), &SetupPhase::Ok);
    assert_eq!(w.now, t0, "no time passed");
    assert_eq!(w.proceeded, [1, 2]);
    assert_eq!(w.settled, [SetupOutcome::Ok]);
    assert_eq!(
        w.sent,
        [
            SetupTransmit::Request(Attempt(1)),
            SetupTransmit::Ack(Attempt(1))
        ]
    );
    assert_eq!(w.want(3), Admission::Ready(3));
    assert_eq!(w.requests(), 1, "no second setup");
}

#[test]
fn a_slow_peer_within_the_deadline_is_fine() {
    let mut w = World::new(vec![Script::Silent]);
    w.want(1);
    w.now += POLICY.attempt_timeout / 2;
    w.setup.handle_timeout(w.now);
    w.setup.handle_reply(w.now, Attempt(1), PeerReply::Accepted);
    w.script = vec![Script::Works];
    w.settle();
    assert_eq!(w.setup.outcome(), Some(SetupOutcome::Ok));
    assert_eq!(w.proceeded, [1]);
}

/// Each failure ends in Bad with its reason; a failure that may pass is retried up to the
/// bound, the others end setup at once; every queued transfer falls back with the reason.
#[test]
fn each_failure_ends_bad_with_its_reason() {
    let cases = [
        (
            Script::CheckFails(SetupFailure::NotSameHost),
            SetupFailure::NotSameHost,
            1,
        ),
        (
            Script::CheckFails(SetupFailure::NoPeerAccess { src: 0, dst: 1 }),
            SetupFailure::NoPeerAccess { src: 0, dst: 1 },
            1,
        ),
        (
            Script::CheckFails(SetupFailure::ImportFailed(
                "CUDA_ERROR_INVALID_HANDLE".into(),
            )),
            SetupFailure::ImportFailed("CUDA_ERROR_INVALID_HANDLE".into()),
            3,
        ),
        (
            Script::Refuse,
            SetupFailure::PeerRefused("draining".into()),
            1,
        ),
        (Script::Silent, SetupFailure::Timeout, 3),
        (Script::NoConfirm, SetupFailure::Timeout, 3),
    ];
    for (script, reason, attempts) in cases {
        let mut w = World::new(vec![script.clone()]);
        // Both queue before the (instant) peer answers.
        assert_eq!(w.setup.handle_want(w.now, 1), Admission::Queued);
        assert_eq!(w.setup.handle_want(w.now, 2), Admission::Queued);
        w.run();
        assert_eq!(
            w.setup.phase(),
            &SetupPhase::Bad(reason.clone()),
            "{script:?}"
        );
        assert_eq!(w.setup.attempts(), attempts, "{script:?}");
        assert_eq!(w.requests(), attempts as usize, "{script:?}");
        assert_eq!(w.settled, [SetupOutcome::Bad(reason.clone())], "{script:?}");
        assert_eq!(w.fell_back, [(1, reason.clone()), (2, reason.clone())]);
        assert!(w.proceeded.is_empty());
        // Later transfers fall back at once, and setup does not start again.
        assert_eq!(w.want(3), Admission::FallBack(3, reason.clone()));
        assert_eq!(w.requests(), attempts as usize);
    }
}

#[test]
fn timeouts_take_exactly_the_bound_in_virtual_time() {
    let mut w = World::new(vec![Script::Silent]);
    let t0 = w.now;
    w.want(1);
    w.run();
    assert_eq!(w.now - t0, POLICY.attempt_timeout * POLICY.max_attempts);
    assert_eq!(w.setup.poll_timeout(), None);
}

#[test]
fn a_retry_can_succeed() {
    let mut w = World::new(vec![
        Script::Silent,
        Script::CheckFails(SetupFailure::ImportFailed("not ready".into())),
        Script::Works,
    ]);
    w.want(1);
    w.run();
    assert_eq!(w.setup.outcome(), Some(SetupOutcome::Ok));
    assert_eq!(w.setup.attempts(), 3);
    assert_eq!(w.proceeded, [1]);
    assert!(w.sent.contains(&SetupTransmit::Nack(
        Attempt(2),
        SetupFailure::ImportFailed("not ready".into())
    )));
}

#[test]
fn late_answers_after_bad_are_ignored() {
    let mut w = World::new(vec![Script::NoConfirm]);
    w.want(1);
    w.run();
    assert_eq!(w.setup.phase(), &SetupPhase::Bad(SetupFailure::Timeout));
    // The peer's late confirmation, reply and our late check result, for every attempt.
    for a in 1..=4 {
        w.setup.handle_confirm(Attempt(a));
        w.setup.handle_reply(w.now, Attempt(a), PeerReply::Accepted);
        w.setup.handle_checks(w.now, Attempt(a), Ok(()));
        w.setup.handle_timeout(w.now + Duration::from_secs(60));
    }
    assert_eq!(w.setup.phase(), &SetupPhase::Bad(SetupFailure::Timeout));
    assert_eq!(w.setup.poll_transmit(), None);
    assert_eq!(w.setup.poll_event(), None);
}

#[test]
fn a_late_answer_to_an_earlier_attempt_does_not_advance_the_current_one() {
    let mut w = World::new(vec![Script::Silent]);
    w.want(1);
    w.now += POLICY.attempt_timeout;
    w.setup.handle_timeout(w.now);
    w.settle();
    assert!(matches!(
        w.setup.phase(),
        SetupPhase::Sent {
            attempt: Attempt(2),
            ..
        }
    ));
    w.setup.handle_reply(w.now, Attempt(1), PeerReply::Accepted);
    assert!(matches!(w.setup.phase(), SetupPhase::Sent { .. }));
    w.setup.handle_reply(w.now, Attempt(2), PeerReply::Accepted);
    assert!(matches!(w.setup.phase(), SetupPhase::Acking { .. }));
}

fn script() -> impl Strategy<Value = Script> {
    prop_oneof![
        Just(Script::Silent),
        Just(Script::Refuse),
        Just(Script::CheckFails(SetupFailure::NotSameHost)),
        Just(Script::CheckFails(SetupFailure::NoPeerAccess {
            src: 1,
            dst: 0
        })),
        Just(Script::CheckFails(SetupFailure::ImportFailed("x".into()))),
        Just(Script::NoConfirm),
        Just(Script::Works),
    ]
}

proptest! {
    /// Whatever the peer does on each attempt, and whenever transfers ask: setup ends in
    /// exactly one of Ok or Bad, never sends more requests than the bound, and every
    /// transfer comes out exactly once (ready, proceeded or fallen back).
    #[test]
    fn every_setup_ends_once_within_the_bound(
        max_attempts in 1u32..5,
        scripts in prop::collection::vec(script(), 1..6),
        wants in prop::collection::vec(0u64..200, 1..6),
    ) {
        let policy = SetupPolicy { max_attempts, attempt_timeout: Duration::from_millis(50) };
        let mut w = World::new(scripts);
        w.setup = Setup::new(policy);
        let t0 = w.now;
        let mut answered = Vec::new();
        let mut wants = wants;
        wants.sort_unstable();
        for (op, at) in wants.iter().enumerate() {
            let at = t0 + Duration::from_millis(*at);
            // Advance to `at`, firing deadlines on the way.
            while let Some(d) = w.setup.poll_timeout().filter(|d| *d <= at) {
                w.now = d;
                w.setup.handle_timeout(d);
                w.settle();
            }
            w.now = at;
            match w.want(op as u32) {
                Admission::Ready(o) | Admission::FallBack(o, _) => answered.push(o),
                Admission::Queued => {}
            }
        }
        w.run();
        prop_assert!(w.setup.outcome().is_some());
        prop_assert_eq!(w.settled.len(), 1);
        prop_assert_eq!(Some(w.settled[0].clone()), w.setup.outcome());
        prop_assert!(w.setup.attempts() <= max_attempts);
        prop_assert_eq!(w.requests() as u32, w.setup.attempts());
        let mut all: Vec<u32> = answered;
        all.extend(w.proceeded.iter().copied());
        all.extend(w.fell_back.iter().map(|(o, _)| *o));
        all.sort_unstable();
        prop_assert_eq!(all, (0..wants.len() as u32).collect::<Vec<_>>());
        prop_assert!(w.now - t0 <= Duration::from_millis(200) + policy.attempt_timeout * max_attempts);
        prop_assert_eq!(w.setup.waiting(), 0);
    }
}
