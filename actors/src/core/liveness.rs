//! Whether a peer this node waits on is still there: the half-open rule.
//!
//! While anything waits on the peer (a grant, a `Done`, a transfer's bytes, a setup step),
//! bytes must keep arriving *from* it; a byte we send proves nothing, since a link can carry
//! one direction and lose the other (a half-open connection). A link quiet for a third of
//! the stall timeout gets a keepalive (a `Ping`, which every node answers with a `Pong`), so
//! that a healthy peer with nothing to say (a receiver in the middle of a long copy) is not
//! taken for a dead one; if nothing at all comes from the peer within the stall timeout of
//! that keepalive, the peer is judged gone. The peer gets the whole timeout to answer
//! because its answer waits behind what we sent before the keepalive (a stream of ours
//! that fills the path's buffers): on a path that holds B bytes at R bytes per second the
//! answer is B / R late, and a keepalive cannot overtake bytes already on their way. So the
//! verdict comes between 4/3 of the timeout after the last byte from the peer (or after the
//! wait began) and a little more where the timer runs late. A link on which nothing waits is
//! never judged, and sends nothing.
//!
//! No I/O and no clock: the owner reports what the link received and whether it waits, and
//! sends the keepalives [`Liveness::poll_keepalive`] asks for.

use std::time::{Duration, Instant};

/// How long a link waiting on its peer stays quiet before a keepalive, in parts of the
/// stall timeout.
const QUIET_PER_STALL: u32 = 3;

/// The clock of one peer's silence while something waits on it.
#[derive(Debug, Clone)]
pub struct Liveness {
    stall: Duration,
    /// Bytes received from the peer in all, as last reported.
    received: u64,
    /// While something waits on the peer: since when nothing came from it.
    quiet: Option<Quiet>,
    /// When to look again, while something waits: never later than the next keepalive or
    /// the verdict, and moved only when looked at (an arrival makes it early, which is
    /// harmless), so that a busy link does not re-arm its owner's timer on every byte.
    wake: Option<Instant>,
    /// The last keepalive's nonce.
    nonce: u64,
}

#[derive(Debug, Clone, Copy)]
struct Quiet {
    /// The later of the last arrival from the peer and the start of the wait.
    since: Instant,
    /// The first keepalive of this silence, which the peer has the stall timeout to answer.
    asked: Option<Instant>,
    /// The last keepalive of this silence.
    pinged: Option<Instant>,
}

impl Liveness {
    /// A peer waited on that must answer a keepalive within `stall`, sent after a third of
    /// it without a byte from the peer.
    pub fn new(stall: Duration) -> Self {
        Self {
            stall,
            received: 0,
            quiet: None,
            wake: None,
            nonce: 0,
        }
    }

    /// The link has received `received` bytes from the peer in all (a running total), and
    /// something does (`waiting`) or does not wait on the peer, at `now`. A count that
    /// changed is a sign of life: the silence starts again. A wait that begins starts it too
    /// (an idle hour before it does not count against it); with nothing waiting there is no
    /// silence to judge. Report every change of `waiting` promptly (the session does on each
    /// of its shell's turns): a wait reported late starts late.
    pub fn handle_heard(&mut self, received: u64, waiting: bool, now: Instant) {
        let arrived = received != self.received;
        self.received = received;
        self.quiet = match self.quiet {
            _ if !waiting => None,
            Some(quiet) if !arrived => Some(quiet),
            _ => Some(Quiet {
                since: now,
                asked: None,
                pinged: None,
            }),
        };
        self.wake = match self.quiet {
            None => None,
            Some(_) => self.wake.or_else(|| self.due()),
        };
    }

    /// Forgets the silence (the link ended or was replaced); the next report starts afresh.
    pub fn reset(&mut self) {
        self.quiet = None;
        self.wake = None;
    }

    /// How long the peer has sent nothing while something waited on it, once it left a
    /// keepalive unanswered for the stall timeout: then the peer is gone, or the link
    /// carries only our direction.
    pub fn silent(&self, now: Instant) -> Option<Duration> {
        let quiet = self.quiet?;
        let asked = quiet.asked?;
        (now >= asked + self.stall).then(|| now.saturating_duration_since(quiet.since))
    }

    /// The nonce of a keepalive to send now: the peer has been quiet, while something waits
    /// on it, for a third of the stall timeout since it was last heard or asked. Looking
    /// also sets when to look next ([`Self::poll_timeout`]).
    pub fn poll_keepalive(&mut self, now: Instant) -> Option<u64> {
        let interval = self.interval();
        let quiet = self.quiet.as_mut()?;
        let ping = now >= quiet.pinged.unwrap_or(quiet.since) + interval;
        if ping {
            quiet.asked = quiet.asked.or(Some(now));
            quiet.pinged = Some(now);
            self.nonce = self.nonce.wrapping_add(1);
        }
        self.wake = self.due();
        ping.then_some(self.nonce)
    }

    /// When to look again ([`Self::silent`], [`Self::poll_keepalive`]) while something
    /// waits: at or before the next keepalive or the verdict.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.wake
    }

    /// The next keepalive, or the verdict if that comes first.
    fn due(&self) -> Option<Instant> {
        let quiet = self.quiet?;
        let keepalive = quiet.pinged.unwrap_or(quiet.since) + self.interval();
        let verdict = quiet.asked.map(|asked| asked + self.stall);
        Some(verdict.map_or(keepalive, |verdict| keepalive.min(verdict)))
    }

    fn interval(&self) -> Duration {
        self.stall / QUIET_PER_STALL
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALL: Duration = Duration::from_secs(3);
    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn a_quiet_peer_is_asked_and_judged_gone_when_it_answers_nothing_for_the_stall_timeout() {
        let t0 = Instant::now();
        let mut l = Liveness::new(STALL);
        l.handle_heard(10, true, t0);
        assert_eq!(l.poll_timeout(), Some(t0 + SECOND));
        assert_eq!(
            l.poll_keepalive(t0 + SECOND - Duration::from_millis(1)),
            None
        );
        assert_eq!(l.poll_keepalive(t0 + SECOND), Some(1));
        assert_eq!(l.poll_keepalive(t0 + SECOND), None, "once");
        // Asked again every third while nothing comes; the first has the timeout to be
        // answered.
        assert_eq!(l.poll_timeout(), Some(t0 + SECOND * 2));
        assert_eq!(l.poll_keepalive(t0 + SECOND * 2), Some(2));
        assert_eq!(l.poll_keepalive(t0 + SECOND * 3), Some(3));
        assert_eq!(
            l.silent(t0 + STALL),
            None,
            "the first keepalive is still unanswered"
        );
        assert_eq!(l.poll_timeout(), Some(t0 + SECOND + STALL));
        assert_eq!(
            l.silent(t0 + SECOND + STALL - Duration::from_millis(1)),
            None
        );
        assert_eq!(l.silent(t0 + SECOND + STALL), Some(SECOND + STALL));
    }

    #[test]
    fn an_answer_starts_the_silence_again_and_an_idle_link_is_never_judged() {
        let t0 = Instant::now();
        let mut l = Liveness::new(STALL);
        // Idle for an hour: nothing to judge, nothing to send.
        l.handle_heard(10, false, t0);
        let t1 = t0 + Duration::from_secs(3600);
        l.handle_heard(10, false, t1);
        assert_eq!(
            (l.silent(t1), l.poll_timeout(), l.poll_keepalive(t1)),
            (None, None, None)
        );
        // A wait begins: its silence starts now, not an hour ago.
        l.handle_heard(10, true, t1);
        assert_eq!(l.poll_keepalive(t1 + SECOND), Some(1));
        assert_eq!(l.silent(t1 + SECOND * 2), None);
        // The pong (any byte) arrives, late: the silence starts again from it. The next
        // look is not moved by an arrival (a busy link would move it on every byte), only
        // by a look.
        let t2 = t1 + Duration::from_millis(3900);
        l.handle_heard(30, true, t2);
        assert_eq!(l.silent(t1 + SECOND + STALL), None);
        assert_eq!(l.poll_timeout(), Some(t1 + SECOND * 2));
        assert_eq!(l.poll_keepalive(t1 + SECOND * 2), None, "heard since");
        assert_eq!(l.poll_timeout(), Some(t2 + SECOND));
        assert_eq!(l.poll_keepalive(t2 + SECOND), Some(2));
        assert_eq!(l.silent(t2 + SECOND + STALL), Some(SECOND + STALL));
        // The wait ends: whatever the silence, nothing is judged.
        l.handle_heard(30, false, t2 + STALL);
        assert_eq!(l.silent(t2 + STALL * 10), None);
    }
}
