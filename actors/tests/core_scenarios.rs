//! Scenarios on the sans-IO session core: two peers wired in memory, in virtual time.
//! Per-peer ordering, exactly-once terminal states, deadlines and cancellation in every
//! phase, and the loss of the link.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ferry_actors::core::session::{
    FailKind, InboundId, OpId, Outcome, PeerSession, PushTarget, PutRequest, SendRequest,
    SessionEvent, SessionLimits,
};
use ferry_config::TransportName;
use ferry_transports::wire::{
    Descriptor, Layout, MAX_BLOCKS, Message, WireDirection, WireMemoryKind, WireReason,
};
use proptest::prelude::*;

const LIMITS: SessionLimits = limits(64, 4, 64);

/// Bounds with per-peer caps and a stall timeout that these scenarios never reach unless
/// they mean to.
const fn limits(queue: usize, in_flight: usize, inbound: usize) -> SessionLimits {
    SessionLimits {
        queue,
        in_flight,
        inbound,
        grants: inbound,
        inbound_bytes: u64::MAX,
        stall: Duration::from_secs(3600),
    }
}

/// A pair of sessions and the simulated shells around them.
struct Pair {
    now: Instant,
    a: PeerSession,
    b: PeerSession,
    /// Outcomes reported to A's callers, by op.
    finished: HashMap<OpId, Vec<Outcome>>,
    /// Tags delivered to B's application, in order.
    delivered: Vec<u64>,
    /// Streams A's transport is running.
    streaming: Vec<OpId>,
    /// Reservations B's allocator has not answered yet.
    reserving: Vec<InboundId>,
    /// B's inbound transfers whose bytes are flowing.
    receiving: Vec<InboundId>,
    abandoned: Vec<InboundId>,
    /// Messages from A that B saw, for assertions.
    a_sent: Vec<Message>,
    auto_reserve: bool,
    auto_stream: bool,
    /// Messages each side received, as its shell's count of bytes from the peer.
    a_heard: u64,
    b_heard: u64,
    /// A half-open link: what A sends is lost, or what B sends is.
    lose_a_to_b: bool,
    lose_b_to_a: bool,
}

impl Pair {
    fn new(limits: SessionLimits) -> Self {
        Self {
            now: Instant::now(),
            a: PeerSession::new(limits),
            b: PeerSession::new(limits),
            finished: HashMap::new(),
            delivered: Vec::new(),
            streaming: Vec::new(),
            reserving: Vec::new(),
            receiving: Vec::new(),
            abandoned: Vec::new(),
            a_sent: Vec::new(),
            auto_reserve: true,
            auto_stream: true,
            a_heard: 0,
            b_heard: 0,
            lose_a_to_b: false,
            lose_b_to_a: false,
        }
    }

    fn request(&self, tag: u64, ttl: Duration) -> SendRequest {
        host_push(tag, 100, self.now + ttl)
    }

    fn send(&mut self, tag: u64, ttl: Duration) -> OpId {
        let req = self.request(tag, ttl);
        let id = self.a.handle_send(self.now, req).expect("queued");
        self.pump();
        id
    }

    /// Runs both sessions and the simulated shells until nothing moves.
    fn pump(&mut self) {
        loop {
            let mut moved = false;
            while let Some(m) = self.a.poll_transmit() {
                moved = true;
                if self.lose_a_to_b {
                    continue;
                }
                self.b_heard += 1;
                self.a_sent.push(m.clone());
                self.b.handle_message(m).expect("A follows the protocol");
            }
            while let Some(m) = self.b.poll_transmit() {
                moved = true;
                if self.lose_b_to_a {
                    continue;
                }
                self.a_heard += 1;
                self.a.handle_message(m).expect("B follows the protocol");
            }
            while let Some(ev) = self.a.poll_event() {
                moved = true;
                match ev {
                    SessionEvent::Stream(id) => self.streaming.push(id),
                    SessionEvent::StopStream(_) => {}
                    SessionEvent::Finished(id, outcome) => {
                        assert!(!self.streaming.contains(&id), "finished while streaming");
                        self.finished.entry(id).or_default().push(outcome);
                    }
                    other => panic!("sender got {other:?}"),
                }
            }
            while let Some(ev) = self.b.poll_event() {
                moved = true;
                match ev {
                    SessionEvent::Reserve { id, .. } => self.reserving.push(id),
                    SessionEvent::Deliver { tag, .. } => self.delivered.push(tag),
                    SessionEvent::Abandon(id) => {
                        self.abandoned.push(id);
                        self.receiving.retain(|r| *r != id);
                    }
                    other => panic!("receiver got {other:?}"),
                }
            }
            if self.auto_reserve {
                for id in std::mem::take(&mut self.reserving) {
                    moved = true;
                    if self
                        .b
                        .handle_reserved(self.now, id, WireMemoryKind::Host, None)
                    {
                        self.receiving.push(id);
                    }
                }
            }
            if self.auto_stream {
                for id in std::mem::take(&mut self.streaming) {
                    moved = true;
                    self.finish_stream(id);
                }
            }
            if !moved {
                break;
            }
        }
    }

    /// A's transport wrote every chunk of `id`, and B placed them.
    fn finish_stream(&mut self, id: OpId) {
        self.streaming.retain(|s| *s != id);
        let inbound = InboundId(id.0);
        if self.receiving.contains(&inbound) {
            self.receiving.retain(|r| *r != inbound);
            self.b.handle_inbound_complete(inbound);
        }
        self.a.handle_stream_ended(id);
    }

    fn advance(&mut self, by: Duration) {
        self.now += by;
        self.a.handle_timeout(self.now);
        self.b.handle_timeout(self.now);
        self.pump();
    }

    /// Both shells tell their session what their link has received from the peer, as a
    /// shell does at the end of each of its turns.
    fn heard(&mut self) {
        self.a.handle_heard(self.a_heard, false, self.now);
        self.b.handle_heard(self.b_heard, false, self.now);
    }

    /// Time passes and both shells' timers fire: deadlines, then what each link received,
    /// then the stall checks (the link's own progress is not reported: nothing streams).
    fn tick(&mut self, by: Duration) {
        self.now += by;
        self.a.handle_timeout(self.now);
        self.b.handle_timeout(self.now);
        self.heard();
        self.a.handle_stall_check(self.now);
        self.b.handle_stall_check(self.now);
        self.pump();
        self.heard();
    }

    fn outcome(&self, id: OpId) -> Option<&Outcome> {
        let all = self.finished.get(&id)?;
        assert_eq!(all.len(), 1, "op {id:?} ended {} times", all.len());
        all.first()
    }

    fn offers_sent(&self) -> usize {
        self.a_sent
            .iter()
            .filter(|m| matches!(m, Message::Offer(_)))
            .count()
    }
}

const LONG: Duration = Duration::from_secs(30);

#[test]
fn transfers_complete_once_and_arrive_in_order() {
    let mut p = Pair::new(LIMITS);
    let ids: Vec<OpId> = (0..20).map(|i| p.send(i, LONG)).collect();
    for id in &ids {
        assert_eq!(p.outcome(*id), Some(&Outcome::Completed));
    }
    assert_eq!(p.delivered, (0..20).collect::<Vec<_>>());
    assert!(p.a.is_idle() && p.b.is_idle());
}

#[test]
fn later_transfer_completing_first_waits_for_earlier() {
    let mut p = Pair::new(LIMITS);
    p.auto_stream = false;
    let first = p.send(1, LONG);
    let second = p.send(2, LONG);
    p.finish_stream(second);
    p.pump();
    assert!(
        p.delivered.is_empty(),
        "delivered out of order: {:?}",
        p.delivered
    );
    p.finish_stream(first);
    p.pump();
    assert_eq!(p.delivered, vec![1, 2]);
}

#[test]
fn pipeline_depth_bounds_offers() {
    let mut p = Pair::new(SessionLimits {
        in_flight: 2,
        ..LIMITS
    });
    p.auto_stream = false;
    for i in 0..5 {
        p.send(i, LONG);
    }
    assert_eq!(p.offers_sent(), 2);
    let first = p.streaming[0];
    p.finish_stream(first);
    p.pump();
    assert_eq!(p.offers_sent(), 3, "a finished op frees exactly one slot");
}

/// An offer the shell could not put on the link (a block list larger than the peer's
/// frames) fails its op as the caller's, once, tells the peer nothing, and frees its
/// pipeline slot for the next.
#[test]
fn an_unsendable_offer_fails_its_op_alone() {
    let mut s = PeerSession::new(SessionLimits {
        in_flight: 1,
        ..LIMITS
    });
    let now = Instant::now();
    let request = |tag, layout: Layout, len| SendRequest {
        layout,
        ..host_push(tag, len, now + LONG)
    };
    let big = s
        .handle_send(now, request(1, Layout::blocks([(0, 8), (16, 8)]), 16))
        .expect("queued");
    let next = s
        .handle_send(now, request(2, Layout::Contiguous, 100))
        .expect("queued");
    let Some(Message::Offer(offer)) = s.poll_transmit() else {
        panic!("the first offer");
    };
    assert_eq!(OpId(offer.transfer), big);
    s.handle_unsendable(big, "too large for the peer's frames".into());
    assert_eq!(
        s.poll_event(),
        Some(SessionEvent::Finished(
            big,
            Outcome::Failed(FailKind::Unsendable(
                "too large for the peer's frames".into()
            ))
        ))
    );
    // Nothing about it goes to the peer; the next op takes the slot.
    match s.poll_transmit() {
        Some(Message::Offer(o)) => assert_eq!(OpId(o.transfer), next),
        other => panic!("expected the next offer, got {other:?}"),
    }
    assert_eq!(s.poll_transmit(), None);
}

#[test]
fn queue_bound_refuses() {
    let mut p = Pair::new(limits(2, 1, 4));
    p.auto_reserve = false;
    p.send(1, LONG);
    p.send(2, LONG);
    let req = p.request(3, LONG);
    assert!(p.a.handle_send(p.now, req).is_err());
}

/// The phase an op is driven into before it expires or is cancelled.
#[derive(Debug, Clone, Copy)]
enum Where {
    Waiting,
    AwaitGrant,
    Streaming,
    AwaitDone,
}

const PHASES: [Where; 4] = [
    Where::Waiting,
    Where::AwaitGrant,
    Where::Streaming,
    Where::AwaitDone,
];

fn into_phase(p: &mut Pair, at: Where) -> OpId {
    let ttl = Duration::from_millis(100);
    match at {
        Where::Waiting => {
            p.auto_reserve = false;
            // Fill the pipeline with transfers that wait for memory.
            for _ in 0..LIMITS.in_flight {
                p.send(0, LONG);
            }
            p.send(9, ttl)
        }
        Where::AwaitGrant => {
            p.auto_reserve = false;
            p.send(9, ttl)
        }
        Where::Streaming => {
            p.auto_stream = false;
            p.send(9, ttl)
        }
        Where::AwaitDone => {
            p.auto_stream = false;
            let id = p.send(9, ttl);
            // The stream ended but B has not confirmed: B's completion is held back.
            p.streaming.retain(|s| *s != id);
            p.a.handle_stream_ended(id);
            p.pump();
            id
        }
    }
}

#[test]
fn deadline_in_every_phase_ends_once() {
    for at in PHASES {
        let mut p = Pair::new(LIMITS);
        let id = into_phase(&mut p, at);
        assert!(p.outcome(id).is_none(), "{at:?}: ended early");
        p.advance(Duration::from_millis(100));
        if let Where::Streaming = at {
            assert!(
                p.outcome(id).is_none(),
                "reported while the stream holds the buffer"
            );
            p.finish_stream(id);
            p.pump();
        }
        assert_eq!(
            p.outcome(id),
            Some(&Outcome::Failed(FailKind::DeadlineExceeded)),
            "{at:?}"
        );
        let told_peer = p.a_sent.iter().any(|m| {
            matches!(m, Message::Cancel(c) if c.transfer == id.0
                && c.reason == WireReason::DeadlineExceeded)
        });
        assert_eq!(told_peer, !matches!(at, Where::Waiting), "{at:?}");
        assert!(
            !p.delivered.contains(&9),
            "{at:?}: expired transfer delivered"
        );
        p.advance(LONG);
        assert_eq!(p.finished.get(&id).map(Vec::len), Some(1), "{at:?}");
    }
}

#[test]
fn cancel_in_every_phase_ends_once() {
    for at in PHASES {
        let mut p = Pair::new(LIMITS);
        let id = into_phase(&mut p, at);
        assert!(p.a.handle_cancel(id), "{at:?}");
        assert!(!p.a.handle_cancel(id), "{at:?}: cancelled twice");
        p.pump();
        if let Where::Streaming = at {
            p.finish_stream(id);
            p.pump();
        }
        assert_eq!(p.outcome(id), Some(&Outcome::Cancelled), "{at:?}");
        if !matches!(at, Where::Waiting | Where::AwaitDone) {
            assert!(
                p.abandoned.contains(&InboundId(id.0)),
                "{at:?}: receiver kept an abandoned transfer"
            );
        }
    }
}

#[test]
fn receiver_refusal_fails_the_sender() {
    let mut p = Pair::new(LIMITS);
    p.auto_reserve = false;
    let id = p.send(1, LONG);
    let inbound = p.reserving.pop().expect("reserve asked");
    p.b.handle_reserve_failed(inbound, WireReason::TooLarge, "budget".into());
    p.pump();
    assert!(matches!(
        p.outcome(id),
        Some(Outcome::Failed(FailKind::Refused {
            reason: WireReason::TooLarge,
            ..
        }))
    ));
}

#[test]
fn link_loss_fails_everything_once() {
    let mut p = Pair::new(LIMITS);
    p.auto_reserve = false;
    p.auto_stream = false;
    let waiting_grant = p.send(1, LONG);
    let reserved = p.reserving.pop().expect("reserve asked");
    p.b.handle_reserved(p.now, reserved, WireMemoryKind::Host, None);
    p.pump();
    let streaming = p.streaming[0];
    assert_eq!(streaming, waiting_grant);
    // The second waits for its grant when the link goes.
    let second = p.send(2, LONG);
    p.a.handle_link_lost("connection reset");
    p.b.handle_link_lost("connection reset");
    p.pump();
    assert!(
        p.outcome(streaming).is_none(),
        "stream still holds the buffer"
    );
    assert!(matches!(
        p.outcome(second),
        Some(Outcome::Failed(FailKind::PeerLost(_)))
    ));
    p.streaming.clear();
    p.a.handle_stream_ended(streaming);
    p.pump();
    assert!(matches!(
        p.outcome(streaming),
        Some(Outcome::Failed(FailKind::PeerLost(_)))
    ));
    let req = p.request(3, LONG);
    assert!(p.a.handle_send(p.now, req).is_err());
    assert!(p.b.is_idle());
}

#[test]
fn relink_offers_ungranted_transfers_again() {
    let mut p = Pair::new(LIMITS);
    p.auto_reserve = false;
    let first = p.send(1, LONG);
    let second = p.send(2, LONG);
    // The peer never read the old link: a fresh receiver stands in for it.
    p.b = PeerSession::new(LIMITS);
    p.reserving.clear();
    p.a.handle_relink();
    p.auto_reserve = true;
    p.pump();
    assert_eq!(p.outcome(first), Some(&Outcome::Completed));
    assert_eq!(p.outcome(second), Some(&Outcome::Completed));
    assert_eq!(p.delivered, vec![1, 2]);
}

/// The detail of a `PeerLost` that says the peer went silent while waited on.
fn went_silent(outcome: Option<&Outcome>) -> bool {
    matches!(outcome, Some(Outcome::Failed(FailKind::PeerLost(why)))
        if why.contains("sent nothing for") && why.contains("limits.stall_timeout"))
}

/// Pings A sent that B saw.
fn pings(p: &Pair) -> usize {
    p.a_sent
        .iter()
        .filter(|m| matches!(m, Message::Ping(_)))
        .count()
}

#[test]
fn a_sender_that_hears_nothing_while_it_waits_for_done_ends_the_link_once() {
    // The receiver has every byte; its `Done` is lost, and so is everything after it.
    let stall = Duration::from_secs(3);
    let mut p = Pair::new(capped(64, u64::MAX, stall));
    p.auto_stream = false;
    let id = p.send(1, LONG);
    p.heard();
    p.lose_b_to_a = true;
    p.finish_stream(id);
    p.pump();
    assert_eq!(p.delivered, vec![1], "the receiver has it");
    // Quiet for a third of the stall timeout: asked, then asked again each third; the
    // first keepalive has the whole timeout to be answered, and no answer comes.
    for _ in 0..3 {
        p.tick(stall / 3);
        assert_eq!(p.outcome(id), None);
    }
    assert_eq!(pings(&p), 3, "a quiet link is asked for a sign of life");
    p.tick(stall / 3 - Duration::from_millis(1));
    assert_eq!(
        p.outcome(id),
        None,
        "ended before the first keepalive's timeout"
    );
    p.tick(Duration::from_millis(1));
    assert!(went_silent(p.outcome(id)), "{:?}", p.outcome(id));
    assert!(p.a.is_lost() && p.a.is_idle());
    // Once: later checks change nothing, and a new send is refused with the reason.
    p.tick(stall);
    assert!(p.outcome(id).is_some());
    let req = p.request(2, LONG);
    assert!(p.a.handle_send(p.now, req).is_err());
}

#[test]
fn a_sender_that_hears_nothing_while_it_waits_for_a_grant_ends_the_link() {
    // Its offers are lost (or the grants): nothing comes back.
    let stall = Duration::from_secs(3);
    let mut p = Pair::new(capped(64, u64::MAX, stall));
    p.lose_a_to_b = true;
    let ids: Vec<OpId> = (1..=3).map(|t| p.send(t, LONG)).collect();
    p.heard();
    for _ in 0..3 {
        p.tick(stall / 3);
    }
    p.tick(stall / 3 - Duration::from_millis(1));
    assert!(ids.iter().all(|id| p.outcome(*id).is_none()));
    p.tick(Duration::from_millis(1));
    for id in ids {
        assert!(went_silent(p.outcome(id)), "{:?}", p.outcome(id));
    }
}

#[test]
fn a_receiver_whose_lent_buffer_waits_for_a_silent_peer_ends_the_link() {
    // An ipc push: B lent its buffer and waits for `Written`; nothing crosses the link
    // meanwhile, so the link's own stall clock has nothing to say, and what A sends is lost.
    let stall = Duration::from_secs(3);
    let mut p = Push::with(capped(64, u64::MAX, stall));
    let (_, id) = p.offer();
    p.lend(id);
    let received = 1;
    p.b.handle_heard(received, false, p.now);
    let mut pings = 0;
    let mut look = |p: &mut Push, by: Duration| {
        p.now += by;
        p.b.handle_heard(received, false, p.now);
        p.b.handle_stall_check(p.now);
        while let Some(m) = p.b.poll_transmit() {
            pings += usize::from(matches!(m, Message::Ping(_)));
        }
    };
    for _ in 0..3 {
        look(&mut p, stall / 3);
    }
    look(&mut p, stall / 3 - Duration::from_millis(1));
    assert!(!p.b.is_lost());
    look(&mut p, Duration::from_millis(1));
    assert_eq!(pings, 3, "asked each third of the timeout");
    assert!(p.b.is_lost(), "the link ends");
    assert!(
        p.b.lost_reason()
            .is_some_and(|why| why.contains("sent nothing for"))
    );
    assert_eq!(p.b.poll_event(), Some(SessionEvent::Abandon(id)));
}

#[test]
fn a_quiet_peer_that_answers_keepalives_keeps_the_link_while_waited_on() {
    // B takes its time to reserve (a long wait for memory): A waits for the grant and hears
    // nothing but B's answers to its keepalives, for many stall timeouts.
    let stall = Duration::from_secs(3);
    let mut p = Pair::new(capped(64, u64::MAX, stall));
    p.auto_reserve = false;
    let id = p.send(1, Duration::from_secs(3600));
    p.heard();
    for _ in 0..30 {
        p.tick(stall / 3);
    }
    assert!(!p.a.is_lost() && !p.b.is_lost());
    assert_eq!(p.outcome(id), None);
    assert!(
        pings(&p) >= 9,
        "{} keepalives in ten stall timeouts",
        pings(&p)
    );
    p.auto_reserve = true;
    p.pump();
    assert_eq!(p.outcome(id), Some(&Outcome::Completed));
}

#[test]
fn an_idle_link_sends_no_keepalive_and_is_never_judged() {
    let stall = Duration::from_secs(3);
    let mut p = Pair::new(capped(64, u64::MAX, stall));
    let id = p.send(1, LONG);
    assert_eq!(p.outcome(id), Some(&Outcome::Completed));
    p.heard();
    // Both directions lost, nothing waits: an hour goes by.
    p.lose_a_to_b = true;
    p.lose_b_to_a = true;
    let sent = p.a_sent.len();
    for _ in 0..1200 {
        p.tick(stall);
    }
    assert!(!p.a.is_lost() && !p.b.is_lost());
    assert_eq!(p.a.poll_timeout(), None);
    assert!(p.a.poll_transmit().is_none() && p.a_sent.len() == sent);
    // The wait that begins after it starts its own clock: B takes the offer (and never
    // grants), and then nothing more from B arrives.
    p.lose_a_to_b = false;
    p.lose_b_to_a = false;
    p.auto_reserve = false;
    let next = p.send(2, LONG);
    p.heard();
    p.lose_b_to_a = true;
    for _ in 0..3 {
        p.tick(stall / 3);
    }
    p.tick(stall / 3 - Duration::from_millis(1));
    assert_eq!(
        p.outcome(next),
        None,
        "the idle hour counted against the new wait"
    );
    p.tick(Duration::from_millis(1));
    assert!(went_silent(p.outcome(next)), "{:?}", p.outcome(next));
}

#[test]
fn a_peer_that_answers_keepalives_but_sends_no_bytes_still_loses_the_grant_not_the_link() {
    // A is there (it answers B's keepalives) but never streams what B granted: the grant
    // ends by the stall clock of the link's own progress, which keepalives are no part of;
    // the link stays.
    let stall = Duration::from_secs(3);
    let mut p = Pair::new(capped(64, u64::MAX, stall));
    p.auto_stream = false;
    let id = p.send(1, LONG);
    p.heard();
    for _ in 0..2 {
        p.tick(stall / 3);
    }
    assert!(p.abandoned.is_empty());
    p.tick(stall / 3);
    assert_eq!(p.abandoned.len(), 1, "the grant's memory is freed");
    assert!(!p.a.is_lost() && !p.b.is_lost(), "the link stays");
    p.finish_stream(id);
    p.pump();
    assert!(
        matches!(
            p.outcome(id),
            Some(Outcome::Failed(FailKind::Refused {
                reason: WireReason::Stalled,
                ..
            }))
        ),
        "{:?}",
        p.outcome(id)
    );
}

#[test]
fn ping_is_answered() {
    let mut s = PeerSession::new(LIMITS);
    s.handle_message(Message::Ping(9)).expect("valid");
    assert_eq!(s.poll_transmit(), Some(Message::Pong(9)));
}

#[test]
fn puts_complete_on_ack() {
    let mut s = PeerSession::new(LIMITS);
    let now = Instant::now();
    let id = s
        .handle_put(
            now,
            PutRequest {
                len: 10,
                deadline: now + LONG,
            },
        )
        .expect("queued");
    assert_eq!(s.poll_event(), Some(SessionEvent::Stream(id)));
    s.handle_stream_ended(id);
    assert_eq!(s.poll_event(), None);
    s.handle_message(Message::PutAck(ferry_transports::wire::PutAck {
        put: id.0,
        error: None,
    }))
    .expect("valid");
    assert_eq!(
        s.poll_event(),
        Some(SessionEvent::Finished(id, Outcome::Completed))
    );
}

#[test]
fn protocol_violations_are_errors() {
    let mut s = PeerSession::new(LIMITS);
    let grant = Message::Grant(ferry_transports::wire::Grant {
        transfer: 77,
        landing: WireMemoryKind::Host,
        lent: None,
    });
    assert!(
        s.handle_message(grant).is_err(),
        "grant for a transfer never offered"
    );
    let offer = |id| {
        Message::Offer(ferry_transports::wire::Offer {
            eager: false,
            fetch: None,
            into: None,
            transfer: id,
            tag: 0,
            len: 1,
            source: WireMemoryKind::Host,
            transport: TransportName::Tcp.into(),
            direction: WireDirection::Push,
            pull: None,
            layout: Layout::Contiguous,
        })
    };
    assert!(s.handle_message(offer(1)).is_ok());
    assert!(s.handle_message(offer(1)).is_err(), "offered twice");
    let hello = Message::Hello(ferry_transports::wire::Hello {
        node: "x".into(),
        version: 1,
        host_id: String::new(),
        pid: 0,
        transports: vec![],
        max_frame: 0,
        receives: ferry_transports::wire::WireMemoryKind::Host,
        purpose: ferry_transports::wire::HelloPurpose::Link,
    });
    assert!(s.handle_message(hello).is_err());
}

proptest! {
    /// Whatever happens, in whatever order, every op ends exactly once, and what is
    /// delivered is in send order.
    #[test]
    fn every_op_ends_exactly_once(script in proptest::collection::vec(0u8..7, 1..80)) {
        let mut p = Pair::new(limits(16, 3, 16));
        p.auto_reserve = false;
        p.auto_stream = false;
        let mut ops = Vec::new();
        let mut next_tag = 0;
        for step in script {
            match step {
                0 | 1 => {
                    let req = p.request(next_tag, Duration::from_millis(50));
                    if let Ok(id) = p.a.handle_send(p.now, req) {
                        ops.push(id);
                        next_tag += 1;
                    }
                }
                2 => {
                    if let Some(id) = p.reserving.pop()
                        && p.b.handle_reserved(p.now, id, WireMemoryKind::Host, None)
                    {
                        p.receiving.push(id);
                    }
                }
                3 => {
                    if let Some(id) = p.streaming.first().copied() {
                        p.finish_stream(id);
                    }
                }
                4 => {
                    if let Some(id) = ops.get(next_tag as usize / 2).copied() {
                        p.a.handle_cancel(id);
                    }
                }
                5 => p.advance(Duration::from_millis(20)),
                _ => {
                    if let Some(id) = p.reserving.pop() {
                        p.b.handle_reserve_failed(id, WireReason::TooLarge, String::new());
                    }
                }
            }
            p.pump();
        }
        // Let everything run out.
        p.auto_reserve = true;
        p.auto_stream = true;
        p.pump();
        p.advance(Duration::from_secs(1));
        for id in &ops {
            prop_assert_eq!(p.finished.get(id).map(Vec::len), Some(1), "op {:?}", id);
        }
        let mut sorted = p.delivered.clone();
        sorted.sort_unstable();
        prop_assert_eq!(&sorted, &p.delivered);
        prop_assert!(p.a.is_idle());
    }
}

#[test]
fn a_cancel_says_whose_transfer_it_names() {
    // Both sides number their transfers from 1: the peer cancelling its own transfer #1
    // must not end ours, and only a cancel from our receiver ends ours.
    let limits = limits(8, 4, 8);
    let now = Instant::now();
    let mut s = PeerSession::new(limits);
    let id = s
        .handle_send(
            now,
            SendRequest {
                fetch: None,
                into: None,
                tag: 1,
                len: 10,
                source: WireMemoryKind::Host,
                transport: TransportName::Tcp,
                direction: WireDirection::Push,
                pull: None,
                layout: Layout::Contiguous,
                deadline: now + Duration::from_secs(60),
            },
        )
        .expect("queued");
    while s.poll_transmit().is_some() {}
    while s.poll_event().is_some() {}
    let cancel = |by_receiver| {
        Message::Cancel(ferry_transports::wire::Cancel {
            transfer: id.0,
            by_receiver,
            reason: WireReason::Cancelled,
            detail: String::new(),
        })
    };
    s.handle_message(cancel(false)).expect("a cancel");
    let mut ended = false;
    while let Some(ev) = s.poll_event() {
        ended |= matches!(ev, SessionEvent::Finished(op, _) if op == id);
    }
    assert!(!ended, "the peer's cancel of its own transfer ended ours");
    s.handle_message(cancel(true)).expect("a cancel");
    let mut ended = false;
    while let Some(ev) = s.poll_event() {
        ended |= matches!(ev, SessionEvent::Finished(op, Outcome::Failed(_)) if op == id);
    }
    assert!(ended, "our receiver's cancel must end our transfer");
}

/// An ipc push between two bare sessions, the shells played by hand: A sends, B lends.
struct Push {
    now: Instant,
    a: PeerSession,
    b: PeerSession,
}

impl Push {
    fn new() -> Self {
        Self::with(LIMITS)
    }

    fn with(limits: SessionLimits) -> Self {
        let mut b = PeerSession::new(limits);
        b.set_serves(TransportName::Ipc, true);
        Self {
            now: Instant::now(),
            a: PeerSession::new(limits),
            b,
        }
    }

    /// B's lent buffer, as the grant describes it (opaque to the session).
    fn target() -> Descriptor {
        Descriptor(vec![1; 64])
    }

    /// The same, as the session hands it to ipc's part.
    fn lent() -> PushTarget {
        PushTarget {
            transport: TransportName::Ipc,
            descriptor: Self::target(),
        }
    }

    /// A queues an ipc push; B reads the offer and is asked to reserve for a push.
    fn offer(&mut self) -> (OpId, InboundId) {
        let op = self
            .a
            .handle_send(
                self.now,
                SendRequest {
                    fetch: None,
                    into: None,
                    tag: 3,
                    len: 4096,
                    source: WireMemoryKind::Device(0),
                    transport: TransportName::Ipc,
                    direction: WireDirection::Push,
                    pull: None,
                    layout: Layout::Contiguous,
                    deadline: self.now + Duration::from_secs(5),
                },
            )
            .expect("queued");
        let offer = self.a.poll_transmit().expect("offered");
        self.b.handle_message(offer).expect("a valid offer");
        match self.b.poll_event() {
            Some(SessionEvent::Reserve {
                id,
                len: 4096,
                pull: None,
                push: Some(TransportName::Ipc),
                relayed: false,
                layout: Layout::Contiguous,
            }) => (op, id),
            other => panic!("B should reserve for a push, got {other:?}"),
        }
    }

    /// B lends a buffer; A reads the grant. Returns A's event.
    fn lend(&mut self, id: InboundId) -> Option<SessionEvent> {
        assert!(self.b.handle_reserved(
            self.now,
            id,
            WireMemoryKind::Device(1),
            Some(Self::lent())
        ));
        let grant = self.b.poll_transmit().expect("granted");
        assert!(
            matches!(&grant, Message::Grant(g) if g.lent == Some(Self::target())),
            "{grant:?}"
        );
        self.a.handle_message(grant).expect("a valid grant");
        self.a.poll_event()
    }

    fn written(&mut self, op: OpId, error: Option<String>) -> Option<SessionEvent> {
        let written = Message::Written(ferry_transports::wire::Written {
            transfer: op.0,
            error,
        });
        self.b
            .handle_message(written)
            .expect("Written is always valid");
        self.b.poll_event()
    }
}

#[test]
fn an_ipc_push_lends_the_receivers_buffer_until_written() {
    let mut p = Push::new();
    let (op, id) = p.offer();
    assert_eq!(p.lend(id), Some(SessionEvent::Write(op, Push::lent())));
    // A's copy is done: it tells B, and waits for B's Done.
    p.a.handle_stream_ended(op);
    assert_eq!(p.a.poll_event(), None, "A waits for B's Done");
    assert_eq!(
        p.written(op, None),
        Some(SessionEvent::Written { id, error: None })
    );
    // B's shell completes the transfer with the lent buffer.
    assert!(p.b.handle_inbound_complete(id));
    assert!(matches!(
        p.b.poll_event(),
        Some(SessionEvent::Deliver { tag: 3, .. })
    ));
    let done = p.b.poll_transmit().expect("Done");
    p.a.handle_message(done).expect("valid");
    assert_eq!(
        p.a.poll_event(),
        Some(SessionEvent::Finished(op, Outcome::Completed))
    );
}

#[test]
fn a_failed_push_fails_the_send_and_the_receive() {
    let mut p = Push::new();
    let (op, id) = p.offer();
    p.lend(id);
    p.a.handle_write_failed(op, "importing the receiver's buffer: invalid value".into());
    assert_eq!(p.a.poll_event(), Some(SessionEvent::StopStream(op)));
    assert_eq!(
        p.a.poll_event(),
        Some(SessionEvent::Finished(
            op,
            Outcome::Failed(FailKind::Transport(
                "importing the receiver's buffer: invalid value".into()
            ))
        ))
    );
    assert_eq!(p.a.poll_transmit(), None, "the shell's Written says why");
    let event = p.written(op, Some("invalid value".into()));
    assert_eq!(
        event,
        Some(SessionEvent::Written {
            id,
            error: Some("invalid value".into())
        })
    );
    // B's shell frees the buffer and fails the receive: the peer hears it.
    p.b.handle_reserve_failed(id, WireReason::Unsupported, "the push failed".into());
    assert!(matches!(
        p.b.poll_transmit(),
        Some(Message::Cancel(c)) if c.by_receiver && c.transfer == op.0
    ));
}

#[test]
fn a_grant_that_crosses_a_cancel_gives_the_lent_buffer_back() {
    let mut p = Push::new();
    let (op, id) = p.offer();
    assert!(p.a.handle_cancel(op));
    assert!(matches!(p.a.poll_transmit(), Some(Message::Cancel(_))));
    assert_eq!(
        p.a.poll_event(),
        Some(SessionEvent::Finished(op, Outcome::Cancelled))
    );
    // B lent its buffer before it read the cancel: A answers Written at once.
    assert_eq!(p.lend(id), None);
    match p.a.poll_transmit() {
        Some(Message::Written(w)) => {
            assert_eq!(w.transfer, op.0);
            assert!(w.error.is_some_and(|e| e.contains("ended")));
        }
        other => panic!("A should give the buffer back, got {other:?}"),
    }
    // B reads the cancel (abandons) and then the Written (frees the buffer).
    let cancel = Message::Cancel(ferry_transports::wire::Cancel {
        transfer: op.0,
        by_receiver: false,
        reason: WireReason::Cancelled,
        detail: String::new(),
    });
    p.b.handle_message(cancel).expect("valid");
    assert_eq!(p.b.poll_event(), Some(SessionEvent::Abandon(id)));
    assert!(matches!(
        p.written(op, Some("ended".into())),
        Some(SessionEvent::Written { .. })
    ));
    // Nothing to complete any more.
    assert!(!p.b.handle_inbound_complete(id));
}

#[test]
fn push_offers_and_lending_grants_are_checked() {
    // A receiver without ipc refuses a push as unsupported.
    let mut p = Push::new();
    p.b.set_serves(TransportName::Ipc, false);
    let _ = p.a.handle_send(
        p.now,
        SendRequest {
            fetch: None,
            into: None,
            tag: 1,
            len: 8,
            source: WireMemoryKind::Device(0),
            transport: TransportName::Ipc,
            direction: WireDirection::Push,
            pull: None,
            layout: Layout::Contiguous,
            deadline: p.now + Duration::from_secs(1),
        },
    );
    let offer = p.a.poll_transmit().expect("offered");
    p.b.handle_message(offer).expect("refused, not a violation");
    assert!(matches!(
        p.b.poll_transmit(),
        Some(Message::Cancel(c)) if c.reason == WireReason::Unsupported
    ));
    // A grant that lends a buffer to a tcp transfer breaks the protocol.
    let mut s = PeerSession::new(LIMITS);
    let op = s
        .handle_send(
            Instant::now(),
            SendRequest {
                fetch: None,
                into: None,
                tag: 1,
                len: 8,
                source: WireMemoryKind::Host,
                transport: TransportName::Tcp,
                direction: WireDirection::Push,
                pull: None,
                layout: Layout::Contiguous,
                deadline: Instant::now() + Duration::from_secs(1),
            },
        )
        .expect("queued");
    let _ = s.poll_transmit();
    let grant = Message::Grant(ferry_transports::wire::Grant {
        transfer: op.0,
        landing: WireMemoryKind::Device(0),
        lent: Some(Push::target()),
    });
    let err = s.handle_message(grant).expect_err("a lent buffer for tcp");
    assert!(err.to_string().contains("lends a buffer"), "{err}");
    // A push whose landing spilled to host memory is granted without a buffer: it streams.
    let mut p = Push::new();
    let (op, id) = p.offer();
    assert!(p.b.handle_reserved(p.now, id, WireMemoryKind::PinnedHost, None));
    let grant = p.b.poll_transmit().expect("granted");
    p.a.handle_message(grant).expect("valid");
    assert_eq!(p.a.poll_event(), Some(SessionEvent::Stream(op)));
}

/// A ucx push is reserved for and granted with the receiver's registration; a grant that
/// lends a buffer of the other transport, or two buffers at once, breaks the protocol.
#[test]
fn a_grant_lends_only_the_pushing_transports_buffer() {
    let ucx_target = || Descriptor(vec![7; 32]);
    let ucx_lent = || PushTarget {
        transport: TransportName::Ucx,
        descriptor: ucx_target(),
    };
    // B serves ucx: a ucx push offer asks it to reserve and lend for ucx.
    let mut b = PeerSession::new(LIMITS);
    b.set_serves(TransportName::Ucx, true);
    let mut a = PeerSession::new(LIMITS);
    let now = Instant::now();
    let request = |transport| SendRequest {
        fetch: None,
        into: None,
        tag: 1,
        len: 64,
        source: WireMemoryKind::Host,
        transport,
        direction: WireDirection::Push,
        pull: None,
        layout: Layout::Contiguous,
        deadline: now + Duration::from_secs(5),
    };
    let op = a
        .handle_send(now, request(TransportName::Ucx))
        .expect("queued");
    b.handle_message(a.poll_transmit().expect("offered"))
        .expect("a valid offer");
    let id = match b.poll_event() {
        Some(SessionEvent::Reserve {
            id,
            push: Some(TransportName::Ucx),
            pull: None,
            ..
        }) => id,
        other => panic!("B should reserve for a ucx push, got {other:?}"),
    };
    assert!(b.handle_reserved(now, id, WireMemoryKind::Host, Some(ucx_lent())));
    let grant = b.poll_transmit().expect("granted");
    assert!(
        matches!(&grant, Message::Grant(g) if g.lent == Some(ucx_target())),
        "{grant:?}"
    );
    a.handle_message(grant).expect("a valid grant");
    assert_eq!(a.poll_event(), Some(SessionEvent::Write(op, ucx_lent())));
    // What a grant lends is the transfer's transport's to read: the session hands it on
    // as that transport's, whatever its bytes (the transport refuses bytes not its own).
    for transport in [TransportName::Ucx, TransportName::Ipc] {
        let mut s = PeerSession::new(LIMITS);
        let op = s.handle_send(now, request(transport)).expect("queued");
        let _ = s.poll_transmit();
        let grant = Message::Grant(ferry_transports::wire::Grant {
            transfer: op.0,
            landing: WireMemoryKind::Host,
            lent: Some(Descriptor(vec![0xff; 3])),
        });
        s.handle_message(grant).expect("a lent buffer for a push");
        let expected = PushTarget {
            transport,
            descriptor: Descriptor(vec![0xff; 3]),
        };
        assert_eq!(s.poll_event(), Some(SessionEvent::Write(op, expected)));
    }
    // A ucx buffer lent to a ucx pull: a pull awaits no grant at all.
    let mut s = PeerSession::new(LIMITS);
    let pull = SendRequest {
        direction: WireDirection::Pull,
        pull: Some(ucx_target()),
        ..request(TransportName::Ucx)
    };
    let op = s.handle_send(now, pull).expect("queued");
    let _ = s.poll_transmit();
    let grant = Message::Grant(ferry_transports::wire::Grant {
        transfer: op.0,
        landing: WireMemoryKind::Host,
        lent: Some(ucx_target()),
    });
    assert!(s.handle_message(grant).is_err(), "a grant for a pull");
    // A ucx buffer lent to a push that ended before its grant came goes back at once.
    let mut s = PeerSession::new(LIMITS);
    let op = s
        .handle_send(now, request(TransportName::Ucx))
        .expect("queued");
    let _ = s.poll_transmit();
    assert!(s.handle_cancel(op));
    while s.poll_transmit().is_some() {}
    let grant = Message::Grant(ferry_transports::wire::Grant {
        transfer: op.0,
        landing: WireMemoryKind::Host,
        lent: Some(ucx_target()),
    });
    s.handle_message(grant)
        .expect("a late grant is no violation");
    assert!(
        matches!(s.poll_transmit(), Some(Message::Written(w)) if w.transfer == op.0 && w.error.is_some()),
        "the lent buffer goes back"
    );
}

#[test]
fn a_second_lending_grant_and_huge_ids_break_the_protocol() {
    // A grant for an op whose copy is under way (Ending after a cancel) must not be answered
    // Written: that would let the peer free the buffer the first grant lent.
    let mut p = Push::new();
    let (op, id) = p.offer();
    assert_eq!(p.lend(id), Some(SessionEvent::Write(op, Push::lent())));
    assert!(p.a.handle_cancel(op));
    let again = Message::Grant(ferry_transports::wire::Grant {
        transfer: op.0,
        landing: WireMemoryKind::Device(1),
        lent: Some(Push::target()),
    });
    let err =
        p.a.handle_message(again)
            .expect_err("a second lending grant");
    assert!(err.to_string().contains("second grant"), "{err}");
    // Transfer ids at or past 2^39 are refused: quarantined memory is keyed by them.
    let mut s = PeerSession::new(LIMITS);
    let offer = Message::Offer(ferry_transports::wire::Offer {
        eager: false,
        fetch: None,
        into: None,
        transfer: ferry_actors::core::session::MAX_TRANSFER_ID,
        tag: 0,
        len: 8,
        source: WireMemoryKind::Host,
        transport: TransportName::Tcp.into(),
        direction: WireDirection::Push,
        pull: None,
        layout: Layout::Contiguous,
    });
    let err = s.handle_message(offer).expect_err("a huge id");
    assert!(err.to_string().contains("past the largest"), "{err}");
}

#[test]
fn offers_whose_layout_does_not_match_are_refused() {
    let offer = |len, transport: TransportName, layout| {
        Message::Offer(ferry_transports::wire::Offer {
            eager: false,
            fetch: None,
            into: None,
            transfer: 1,
            tag: 0,
            len,
            source: WireMemoryKind::Host,
            transport: transport.into(),
            direction: WireDirection::Push,
            pull: None,
            layout,
        })
    };
    let rows = Layout::Strided2D {
        rows: 4,
        row_bytes: 100,
        pitch: 128,
    };
    let bad = Layout::Strided2D {
        rows: 4,
        row_bytes: 100,
        pitch: 64,
    };
    // A hostile block list: too long, an empty block, an end past 64 bits, or not the
    // length offered. Refused before anything is reserved.
    let too_many = Layout::blocks((0..=MAX_BLOCKS as u64).map(|i| (i * 2, 1)));
    for (msg, why) in [
        (
            offer(399, TransportName::Tcp, rows.clone()),
            "packs 400 bytes, the offer says 399",
        ),
        (offer(400, TransportName::Tcp, bad), "smaller than a row"),
        (
            offer(65_537, TransportName::Tcp, too_many),
            "65537 blocks, more than the 65536",
        ),
        (
            offer(1, TransportName::Tcp, Layout::blocks([(0, 1), (9, 0)])),
            "block 1 is empty",
        ),
        (
            offer(2, TransportName::Tcp, Layout::blocks([(u64::MAX, 2)])),
            "overflows",
        ),
        (
            offer(6, TransportName::Tcp, Layout::blocks([(0, 3), (10, 4)])),
            "packs 7 bytes, the offer says 6",
        ),
    ] {
        let mut s = PeerSession::new(LIMITS);
        s.set_serves(TransportName::Ipc, true);
        s.handle_message(msg).expect("refused, not a violation");
        match s.poll_transmit() {
            Some(Message::Cancel(c)) => assert!(c.detail.contains(why), "{}", c.detail),
            other => panic!("expected a refusal ({why}), got {other:?}"),
        }
        assert_eq!(s.poll_event(), None);
    }
    let mut s = PeerSession::new(LIMITS);
    s.handle_message(offer(400, TransportName::Tcp, rows))
        .expect("valid");
    assert!(matches!(
        s.poll_event(),
        Some(SessionEvent::Reserve { len: 400, .. })
    ));
    // Blocks that overlap at the sender are read twice there: a valid offer.
    let twice = Layout::blocks([(0, 4), (2, 4)]);
    let mut s = PeerSession::new(LIMITS);
    s.handle_message(offer(8, TransportName::Tcp, twice.clone()))
        .expect("valid");
    assert!(matches!(
        s.poll_event(),
        Some(SessionEvent::Reserve { len: 8, layout, .. }) if layout == twice
    ));
}

/// A staged offer is served by any receiver (no ipc needed): it reserves for a staged
/// landing (device memory first) and, once granted, the sender streams; a staged offer
/// that describes a buffer to pull, or asks to pull, is refused as unsupported.
#[test]
fn staged_offers_reserve_for_staging_and_stream() {
    let mut p = Push::new();
    p.b.set_serves(TransportName::Ipc, false);
    let request = |direction, pull| SendRequest {
        fetch: None,
        into: None,
        tag: 1,
        len: 4096,
        source: WireMemoryKind::Device(0),
        transport: TransportName::Staged,
        direction,
        pull,
        layout: Layout::Contiguous,
        deadline: p.now + Duration::from_secs(1),
    };
    let op =
        p.a.handle_send(p.now, request(WireDirection::Push, None))
            .expect("queued");
    let offer = p.a.poll_transmit().expect("offered");
    p.b.handle_message(offer).expect("a valid offer");
    let id = match p.b.poll_event() {
        Some(SessionEvent::Reserve {
            id,
            len: 4096,
            pull: None,
            push: None,
            relayed: true,
            layout: Layout::Contiguous,
        }) => id,
        other => panic!("B should reserve for a staged transfer, got {other:?}"),
    };
    assert!(p.b.handle_reserved(p.now, id, WireMemoryKind::Device(1), None));
    let grant = p.b.poll_transmit().expect("granted");
    p.a.handle_message(grant).expect("valid");
    assert_eq!(p.a.poll_event(), Some(SessionEvent::Stream(op)));
    for (direction, pull) in [
        (WireDirection::Pull, None),
        (WireDirection::Push, Some(Push::target())),
    ] {
        let mut p = Push::new();
        let _ = p.a.handle_send(p.now, request(direction, pull));
        let offer = p.a.poll_transmit().expect("offered");
        p.b.handle_message(offer).expect("refused, not a violation");
        assert!(
            matches!(
                p.b.poll_transmit(),
                Some(Message::Cancel(c)) if c.reason == WireReason::Unsupported
            ),
            "{direction:?}"
        );
    }
}

/// Bounds with a short stall timeout and small per-peer caps.
fn capped(grants: usize, inbound_bytes: u64, stall: Duration) -> SessionLimits {
    SessionLimits {
        grants,
        inbound_bytes,
        stall,
        ..LIMITS
    }
}

#[test]
fn granted_transfers_end_only_when_the_link_moves_nothing_for_the_stall_timeout() {
    let stall = Duration::from_secs(5);
    let mut p = Pair::new(capped(64, u64::MAX, stall));
    p.auto_stream = false;
    // Two granted at once: the sender streams them one after the other, so the second
    // sees no byte of its own while the first streams. Link progress keeps both alive.
    let first = p.send(1, LONG);
    let second = p.send(2, LONG);
    assert_eq!(p.receiving.len(), 2);
    let mut moved = 0;
    for _ in 0..4 {
        p.now += stall - Duration::from_millis(1);
        moved += 1 << 20;
        p.b.handle_link_progress(moved, p.now);
        p.b.handle_stall_check(p.now);
        p.advance(Duration::ZERO);
        assert!(p.abandoned.is_empty(), "ended while the link moved bytes");
    }
    // A send queued at the moment the clock would run out ends nothing by itself: only the
    // shell's check, with a fresh count, does.
    p.now += stall;
    let req = p.request(3, LONG);
    p.a.handle_send(p.now, req).expect("queued");
    p.b.handle_timeout(p.now);
    assert!(p.abandoned.is_empty() && p.b.poll_transmit().is_none());
    // The same count again: the link moved nothing. Both granted transfers end.
    p.b.handle_link_progress(moved, p.now);
    assert!(p.b.poll_timeout().is_some_and(|t| t <= p.now));
    p.b.handle_stall_check(p.now);
    p.pump();
    assert_eq!(p.abandoned.len(), 2, "their memory is freed");
    for id in [first, second] {
        p.finish_stream(id);
        p.pump();
        match p.outcome(id) {
            Some(Outcome::Failed(FailKind::Refused { reason, detail })) => {
                assert_eq!(*reason, WireReason::Stalled);
                assert!(detail.contains("limits.stall_timeout"), "{detail}");
            }
            other => panic!("expected a stall refusal, got {other:?}"),
        }
    }
}

#[test]
fn a_grant_starts_the_stall_clock_no_earlier_than_itself() {
    let stall = Duration::from_secs(5);
    let mut p = Pair::new(capped(64, u64::MAX, stall));
    p.auto_stream = false;
    // The link was idle for an hour before this transfer: its grant is fresh progress.
    p.b.handle_link_progress(7, p.now);
    p.now += Duration::from_secs(3600);
    p.send(1, LONG);
    assert_eq!(p.receiving.len(), 1);
    p.b.handle_link_progress(7, p.now);
    p.b.handle_stall_check(p.now + stall - Duration::from_millis(1));
    p.pump();
    assert!(
        p.abandoned.is_empty(),
        "the idle hour counted against the new grant"
    );
    p.b.handle_stall_check(p.now + stall);
    p.pump();
    assert_eq!(p.abandoned.len(), 1);
}

#[test]
fn outstanding_grants_per_peer_are_bounded_and_later_offers_wait_their_turn() {
    let mut p = Pair::new(capped(2, u64::MAX, LONG));
    p.auto_reserve = false;
    p.auto_stream = false;
    let ids: Vec<OpId> = (0..4).map(|i| p.send(i, LONG)).collect();
    assert_eq!(p.offers_sent(), 4);
    assert_eq!(p.reserving.len(), 2, "only two reservations asked at once");
    for id in std::mem::take(&mut p.reserving) {
        assert!(p.b.handle_reserved(p.now, id, WireMemoryKind::Host, None));
        p.receiving.push(id);
    }
    p.pump();
    assert!(p.reserving.is_empty(), "both grants still outstanding");
    p.finish_stream(ids[0]);
    p.pump();
    assert_eq!(
        p.reserving,
        vec![InboundId(ids[2].0)],
        "the next in offer order"
    );
    p.auto_reserve = true;
    p.auto_stream = true;
    for id in std::mem::take(&mut p.reserving) {
        assert!(p.b.handle_reserved(p.now, id, WireMemoryKind::Host, None));
        p.receiving.push(id);
    }
    p.pump();
    for id in [ids[1], ids[2], ids[3]] {
        if p.outcome(id).is_none() {
            p.finish_stream(id);
            p.pump();
        }
    }
    for id in &ids {
        assert_eq!(p.outcome(*id), Some(&Outcome::Completed));
    }
    assert_eq!(p.delivered, vec![0, 1, 2, 3]);
}

#[test]
fn reserved_bytes_per_peer_are_bounded_and_a_larger_offer_goes_alone() {
    // Each request is 100 bytes: two fit under 250, the third waits.
    let mut p = Pair::new(capped(64, 250, LONG));
    p.auto_reserve = false;
    p.auto_stream = false;
    let ids: Vec<OpId> = (0..3).map(|i| p.send(i, LONG)).collect();
    assert_eq!(p.reserving.len(), 2);
    for id in std::mem::take(&mut p.reserving) {
        assert!(p.b.handle_reserved(p.now, id, WireMemoryKind::Host, None));
        p.receiving.push(id);
    }
    p.pump();
    p.finish_stream(ids[0]);
    p.pump();
    assert_eq!(p.delivered, vec![0]);

    // Delivered but not taken, it still counts: the third waits.
    assert!(
        p.reserving.is_empty(),
        "admitted while a delivery holds memory"
    );
    p.b.handle_claims(0, 100, p.now);
    p.pump();
    assert_eq!(p.reserving, vec![InboundId(ids[2].0)]);
    // One offer larger than the whole share waits until the peer holds nothing else, then
    // goes alone.
    let mut big = p.request(9, LONG);
    big.len = 251;
    p.a.handle_send(p.now, big).expect("queued");
    p.pump();
    let third = p.reserving.remove(0);
    assert!(p.reserving.is_empty(), "the big one waits");
    assert!(p.b.handle_reserved(p.now, third, WireMemoryKind::Host, None));
    p.receiving.push(third);
    p.pump();
    p.finish_stream(ids[1]);
    p.finish_stream(ids[2]);
    p.pump();
    assert_eq!(p.delivered, vec![0, 1, 2]);
    assert!(
        p.reserving.is_empty(),
        "the big one waits for the deliveries to be taken"
    );
    p.b.handle_claims(0, 300, p.now);
    p.pump();
    assert_eq!(p.reserving.len(), 1, "alone now, the big one is reserved");
}

#[test]
fn a_sender_cancelling_a_queued_offer_frees_nothing_and_lets_the_next_in() {
    let mut p = Pair::new(capped(1, u64::MAX, LONG));
    p.auto_reserve = false;
    p.auto_stream = false;
    let first = p.send(1, LONG);
    let second = p.send(2, LONG);
    let third = p.send(3, LONG);
    assert_eq!(p.reserving, vec![InboundId(first.0)]);
    assert!(p.a.handle_cancel(second));
    p.pump();
    assert!(p.abandoned.is_empty(), "nothing was reserved for it");
    assert!(p.b.handle_reserved(p.now, InboundId(first.0), WireMemoryKind::Host, None));
    p.reserving.clear();
    p.receiving.push(InboundId(first.0));
    p.pump();
    p.finish_stream(first);
    p.pump();
    assert_eq!(p.reserving, vec![InboundId(third.0)]);
}

#[test]
fn a_slow_transfer_holds_the_window_so_the_peer_never_holds_more_than_it() {
    let mut p = Pair::new(SessionLimits {
        in_flight: 2,
        ..LIMITS
    });
    p.auto_stream = false;
    let first = p.send(1, LONG);
    let second = p.send(2, LONG);
    p.send(3, LONG);
    assert_eq!(p.offers_sent(), 2);
    // The second ends before the first: the peer still holds it (undelivered, behind the
    // first), so no third offer yet.
    p.finish_stream(second);
    p.pump();
    assert_eq!(p.outcome(second), Some(&Outcome::Completed));
    assert_eq!(
        p.offers_sent(),
        2,
        "a finished op behind a slow one freed a slot"
    );
    // The first ends: both are delivered, and the window moves on by two.
    p.finish_stream(first);
    p.pump();
    assert_eq!(p.delivered, vec![1, 2]);
    assert_eq!(p.offers_sent(), 3);
}

/// A pull offer's descriptor is handed, unread, to the offer's own transport (which alone
/// can tell whether its bytes are its own); a pull offer with none is refused.
#[test]
fn a_pull_offers_descriptor_goes_to_its_own_transport() {
    let offer = |transfer, transport: TransportName, pull| {
        Message::Offer(ferry_transports::wire::Offer {
            eager: false,
            fetch: None,
            into: None,
            transfer,
            tag: 0,
            len: 8,
            source: WireMemoryKind::Device(0),
            transport: transport.into(),
            direction: WireDirection::Pull,
            pull,
            layout: Layout::Contiguous,
        })
    };
    let mut s = PeerSession::new(LIMITS);
    s.set_serves(TransportName::Ipc, true);
    s.set_serves(TransportName::Ucx, true);
    // No descriptor to read: refused as unsupported.
    s.handle_message(offer(1, TransportName::Ipc, None))
        .expect("refused, not a violation");
    assert!(matches!(s.poll_transmit(),
        Some(Message::Cancel(c)) if c.reason == WireReason::Unsupported));
    // Its descriptor goes with the reservation, as the offer's transport's.
    for (transfer, transport) in [(4, TransportName::Ipc), (5, TransportName::Ucx)] {
        let described = Descriptor(vec![transfer as u8; 20]);
        s.handle_message(offer(transfer, transport, Some(described.clone())))
            .expect("valid");
        assert_eq!(s.poll_transmit(), None, "{transport}");
        let Some(SessionEvent::Reserve { pull: Some(p), .. }) = s.poll_event() else {
            panic!("{transport}: no reservation for a pull");
        };
        assert_eq!((p.transport, p.descriptor), (transport, described));
    }
}

/// A contiguous host buffer of `len` bytes pushed over tcp under `tag`.
fn host_push(tag: u64, len: u64, deadline: Instant) -> SendRequest {
    SendRequest {
        fetch: None,
        into: None,
        tag,
        len,
        source: WireMemoryKind::Host,
        transport: TransportName::Tcp,
        direction: WireDirection::Push,
        pull: None,
        layout: Layout::Contiguous,
        deadline,
    }
}

fn drain(s: &mut PeerSession) -> (Vec<Message>, Vec<SessionEvent>) {
    let sent = std::iter::from_fn(|| s.poll_transmit()).collect();
    let events = std::iter::from_fn(|| s.poll_event()).collect();
    (sent, events)
}

/// Within the peer's eager credit and size, a tcp push goes with its bytes and completes
/// on `Done` with no grant; past either, it is a plain offer. A grant for an eager offer
/// (the peer read the bytes past) streams them as for any grant. Device memory and other
/// layouts never go eagerly.
#[test]
fn eager_offers_stay_within_the_peer_credit_and_fall_back_on_a_grant() {
    use ferry_actors::core::session::EagerTerms;
    use ferry_transports::wire::{Done, Grant};
    let now = Instant::now();
    let mut a = PeerSession::new(LIMITS);
    a.handle_peer_eager(EagerTerms {
        max: 100,
        credit: 150,
    });
    let op1 = a
        .handle_send(now, host_push(1, 100, now + LONG))
        .expect("queued");
    let op2 = a
        .handle_send(now, host_push(2, 100, now + LONG))
        .expect("queued");
    let op3 = a
        .handle_send(now, host_push(3, 101, now + LONG))
        .expect("queued");
    let mut device = host_push(4, 10, now + LONG);
    device.source = WireMemoryKind::Device(0);
    a.handle_send(now, device).expect("queued");
    let (sent, events) = drain(&mut a);
    let eager: Vec<bool> = sent
        .iter()
        .map(|m| match m {
            Message::Offer(o) => o.eager,
            other => panic!("expected offers, got {other:?}"),
        })
        .collect();
    assert_eq!(eager, [true, false, false, false]);
    assert!(
        events.is_empty(),
        "an eager offer starts no stream: {events:?}"
    );
    // Done completes the eager one; its credit is free again.
    a.handle_message(Message::Done(Done { transfer: op1.0 }))
        .expect("done");
    let (_, events) = drain(&mut a);
    assert_eq!(events, [SessionEvent::Finished(op1, Outcome::Completed)]);
    let op5 = a
        .handle_send(now, host_push(5, 100, now + LONG))
        .expect("queued");
    let (sent, _) = drain(&mut a);
    assert!(matches!(&sent[..], [Message::Offer(o)] if o.eager && o.transfer == op5.0));
    // A grant for it: the peer read its bytes past; they stream now.
    let grant = |op: OpId| {
        Message::Grant(Grant {
            transfer: op.0,
            landing: WireMemoryKind::Host,
            lent: None,
        })
    };
    a.handle_message(grant(op5)).expect("grant");
    let (_, events) = drain(&mut a);
    assert_eq!(events, [SessionEvent::Stream(op5)]);
    a.handle_stream_ended(op5);
    a.handle_message(Message::Done(Done { transfer: op5.0 }))
        .expect("done");
    let (_, events) = drain(&mut a);
    assert_eq!(events, [SessionEvent::Finished(op5, Outcome::Completed)]);
    // The plain ones go the usual way.
    a.handle_message(grant(op2)).expect("grant");
    a.handle_message(grant(op3)).expect("grant");
    let (_, events) = drain(&mut a);
    assert_eq!(
        events,
        [SessionEvent::Stream(op2), SessionEvent::Stream(op3)]
    );
}

/// At the receiver, an eager transfer is complete on arrival and answered at once, but is
/// delivered only after an earlier offer of the peer (still being granted) is.
#[test]
fn an_eager_transfer_is_delivered_behind_earlier_offers() {
    use ferry_transports::wire::{Done, Offer};
    let now = Instant::now();
    let mut b = PeerSession::new(LIMITS);
    let offer = |transfer: u64, eager: bool| Offer {
        eager,
        fetch: None,
        into: None,
        transfer,
        tag: transfer * 10,
        len: 100,
        source: WireMemoryKind::Host,
        transport: ferry_transports::wire::WireTransport::Tcp,
        direction: WireDirection::Push,
        pull: None,
        layout: Layout::Contiguous,
    };
    b.handle_message(Message::Offer(offer(1, false)))
        .expect("offer");
    assert_eq!(b.inbound_waiting(), 1);
    assert!(b.handle_eager_offer(offer(2, true)).expect("eager offer"));
    let (sent, events) = drain(&mut b);
    assert_eq!(sent, [Message::Done(Done { transfer: 2 })]);
    assert!(
        events
            .iter()
            .all(|e| !matches!(e, SessionEvent::Deliver { .. })),
        "delivered before the earlier offer: {events:?}"
    );
    assert!(b.handle_reserved(now, InboundId(1), WireMemoryKind::Host, None));
    assert_eq!(b.inbound_waiting(), 0);
    assert!(b.handle_inbound_complete(InboundId(1)));
    let (_, events) = drain(&mut b);
    let delivered: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            SessionEvent::Deliver { tag, .. } => Some(*tag),
            _ => None,
        })
        .collect();
    assert_eq!(delivered, [10, 20]);
}

/// A write into a region is offered as any transfer (the session says where it goes), but
/// never eagerly nor as a fetch's answer: such an offer is refused as a protocol breach,
/// before anything is reserved.
#[test]
fn a_write_into_a_region_is_never_eager_nor_a_fetch_answer() {
    use ferry_transports::wire::{Cancel, Offer, RegionWrite, WireReason};
    let mut b = PeerSession::new(LIMITS);
    let into = RegionWrite {
        region: 3,
        generation: 7,
        layout: Layout::blocks([(64, 100)]),
    };
    let offer = |transfer: u64, eager: bool, fetch: Option<u64>| Offer {
        eager,
        fetch,
        into: Some(into.clone()),
        transfer,
        tag: 0,
        len: 100,
        source: WireMemoryKind::Host,
        transport: ferry_transports::wire::WireTransport::Tcp,
        direction: WireDirection::Push,
        pull: None,
        layout: Layout::Contiguous,
    };
    b.handle_message(Message::Offer(offer(1, false, None)))
        .expect("offer");
    assert_eq!(b.inbound_into(InboundId(1)), Some(&into));
    assert!(
        !b.handle_eager_offer(offer(2, true, None))
            .expect("eager offer")
    );
    b.handle_message(Message::Offer(offer(3, false, Some(9))))
        .expect("offer");
    let (sent, _) = drain(&mut b);
    let refused: Vec<(u64, WireReason)> = sent
        .iter()
        .filter_map(|m| match m {
            Message::Cancel(Cancel {
                transfer, reason, ..
            }) => Some((*transfer, *reason)),
            _ => None,
        })
        .collect();
    assert_eq!(
        refused,
        [(2, WireReason::Protocol), (3, WireReason::Protocol)]
    );
    assert_eq!(b.inbound_into(InboundId(2)), None);
}
