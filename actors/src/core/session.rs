//! One peer's operations: the ordered queue of outbound transfers and puts, the inbound
//! transfers the peer offers us, and every deadline. No I/O: the shell feeds events in
//! through `handle_*` and carries out what `poll_*` returns.
//!
//! Outbound transfer: `Waiting → AwaitGrant → Streaming → AwaitDone → Completed`, or
//! `Failed`/`Cancelled` from any phase. An eager transfer (a small tcp push within the
//! peer's eager credit, [`EagerTerms`]) goes with its bytes: `Waiting → Eager → Completed`
//! on the peer's `Done`; a `Grant` instead says the peer read past the bytes (no memory at
//! once), and it goes on as any granted transfer (`Streaming`, its bytes sent again). A pulled transfer (ipc) skips the grant and the
//! stream: `Waiting → AwaitDone → Completed`, the peer reading the bytes itself. A pushed
//! ipc transfer's grant lends the receiver's buffer, and `Streaming` is the shell's copy
//! into it, which ends by telling the peer `Written`. A put: `Waiting → Streaming →
//! AwaitAck → Completed`.
//! While a stream runs, a transport still reads the caller's buffer; an op that ends then
//! passes through `Ending` and reports its outcome only once the stream has stopped, so the
//! buffer never goes back to its owner while a copy can still touch it.
//!
//! Inbound transfer: `Reserving → Receiving → Complete → delivered`, in the peer's offer
//! order (an eager one the shell placed on arrival starts `Complete`) (a later transfer that completes first waits for the earlier ones). For a pulled
//! transfer, `Receiving` is the shell's copy out of the peer's memory; no grant is sent.
//! For a pushed ipc transfer, `Receiving` waits for the peer's `Written`; the buffer the
//! grant lent stays lent until then, even when the transfer is abandoned meanwhile (the
//! shell keeps it: the peer may still be copying into it).
//!
//! While anything waits on the peer, the peer must keep being heard (a quiet one answering
//! a keepalive within the stall timeout), or the link ends and everything on it with it
//! ([`super::liveness`]: a half-open link passes no other check).

use ferry_config::TransportName;
use ferry_transports::registry;
use ferry_transports::transport::Carrier;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::liveness::Liveness;

mod inbound;
mod vocabulary;
pub use vocabulary::*;

use ferry_transports::wire::{
    Cancel, Grant, Layout, Message, Offer, WireDirection, WireMemoryKind, WireReason, Written,
};

/// Bounds of one session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// Outbound ops waiting or in flight, at most.
    pub queue: usize,
    /// Outbound ops past `Waiting` at once (the pipeline depth).
    pub in_flight: usize,
    /// Inbound transfers the peer may have open at once.
    pub inbound: usize,
    /// Inbound transfers being reserved or received at once (outstanding grants); later
    /// offers wait their turn.
    pub grants: usize,
    /// Bytes the peer's inbound transfers may hold at once, from reservation to delivery;
    /// an offer larger than this alone is refused as too large.
    pub inbound_bytes: u64,
    /// While granted inbound transfers wait for bytes, the link must move a byte (either
    /// way, keepalives left out) at least this often, or they are ended; and while anything
    /// waits on the peer, a quiet peer must answer a keepalive within it, or the link ends
    /// (see [`super::liveness`]).
    pub stall: Duration,
}

#[derive(Debug)]
enum OpKind {
    Transfer(Box<SendRequest>),
    Put(PutRequest),
}

impl OpKind {
    fn deadline(&self) -> Instant {
        match self {
            Self::Transfer(r) => r.deadline,
            Self::Put(r) => r.deadline,
        }
    }
}

/// Phases of an outbound op; each holds only what the phase needs.
#[derive(Debug)]
enum Phase {
    Waiting(OpKind),
    AwaitGrant(Box<SendRequest>),
    /// Offered with its bytes (eager): `Done` completes it; a `Grant` means the peer read
    /// past the bytes, which then stream as for any grant. Counts against the peer's eager
    /// credit until either, or a `Cancel`, arrives.
    Eager(Box<SendRequest>),
    Streaming {
        op: OpKind,
        confirmed: bool,
    },
    AwaitConfirm(OpKind),
    /// Decided, but the stream still holds the buffer.
    Ending {
        outcome: Outcome,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InPhase {
    /// Offered, waiting for room under the per-peer bounds ([`SessionLimits::grants`],
    /// [`SessionLimits::inbound_bytes`]).
    Queued,
    Reserving,
    /// Granted (or being pulled).
    Receiving,
    Complete,
}

#[derive(Debug)]
struct InboundOp {
    tag: u64,
    /// The fetch it answers, if any.
    fetch: Option<u64>,
    /// The region it writes into, for a one-sided write.
    into: Option<ferry_transports::wire::RegionWrite>,
    transport: TransportName,
    layout: Layout,
    phase: InPhase,
    /// Bytes reserved for it (its packed length).
    len: u64,
    /// What the shell must reserve once it leaves `Queued`.
    reserve: Option<SessionEvent>,
    /// True while it is granted and waits for bytes over the link or the staged ring: the
    /// link's stall clock applies. False for a pull (our own copy) and an ipc push (the
    /// peer's copy into the buffer we lent: nothing crosses the link until `Written`).
    stalls: bool,
    /// True once granted when the peer moves the bytes (over the link or the ring, or into
    /// the buffer we lent): while it receives, it waits on the peer. False for a pull.
    pushed: bool,
}

impl InboundOp {
    /// True while it holds (or is getting) a reservation and counts against the bounds.
    fn is_active(&self) -> bool {
        matches!(self.phase, InPhase::Reserving | InPhase::Receiving)
    }
}

/// One peer's operations and deadlines. See the module docs for the phases.
#[derive(Debug)]
pub struct PeerSession {
    limits: SessionLimits,
    /// The transports that move bytes straight between the two processes' memory
    /// ([`Carrier::Memory`]) this node takes from this peer now (their per-peer setup
    /// succeeded); offers over any other such transport are refused as unsupported.
    serves_memory: Vec<TransportName>,
    next_op: u64,
    ops: BTreeMap<OpId, Phase>,
    inbound: BTreeMap<InboundId, InboundOp>,
    transmit: VecDeque<Message>,
    events: VecDeque<SessionEvent>,
    lost: Option<String>,
    draining: bool,
    /// The link's byte count as last reported, and when it last changed (or a grant left);
    /// no time before the first grant.
    progress: (u64, Option<Instant>),
    /// Bytes this session delivered, in all; and, as last reported, what the peer's fast
    /// lane delivered and what the application took, in all (running totals). Delivered
    /// and not taken still holds memory: it counts against the peer's share.
    delivered: u64,
    claims: (u64, u64),
    /// When to look at `unclaimed` again while offers wait for room.
    recheck_at: Option<Instant>,
    /// What the peer takes eagerly (its hello); none until told.
    eager: EagerTerms,
    /// Whether the peer is still heard while something waits on it.
    liveness: Liveness,
}

impl PeerSession {
    /// An empty session with these bounds.
    pub fn new(limits: SessionLimits) -> Self {
        Self {
            limits,
            serves_memory: Vec::new(),
            next_op: 1,
            ops: BTreeMap::new(),
            inbound: BTreeMap::new(),
            transmit: VecDeque::new(),
            events: VecDeque::new(),
            lost: None,
            draining: false,
            progress: (0, None),
            delivered: 0,
            claims: (0, 0),
            recheck_at: None,
            eager: EagerTerms::default(),
            liveness: Liveness::new(limits.stall),
        }
    }

    /// Whether offers over `transport`, a [`Carrier::Memory`] transport (pull or push), are
    /// accepted; they are refused as unsupported otherwise. Link and ring transports are
    /// always taken.
    pub fn set_serves(&mut self, transport: TransportName, serves: bool) {
        self.serves_memory.retain(|t| *t != transport);
        if serves {
            self.serves_memory.push(transport);
        }
    }

    /// The peer's link came up and its hello says what it takes eagerly: small tcp pushes
    /// offered from now on go with their bytes while they fit (see [`EagerTerms`]).
    pub fn handle_peer_eager(&mut self, terms: EagerTerms) {
        self.eager = terms;
    }

    /// Bytes of our eager offers the peer has not answered yet.
    fn eager_in_use(&self) -> u64 {
        self.ops
            .values()
            .map(|p| match p {
                Phase::Eager(req) => req.len,
                _ => 0,
            })
            .sum()
    }

    /// Whether `req` goes eagerly: a contiguous tcp push from host memory, of at most the
    /// peer's eager size and within what is left of its credit.
    fn goes_eagerly(&self, req: &SendRequest) -> bool {
        req.len > 0
            && req.len <= self.eager.max
            && req.direction == WireDirection::Push
            && registry::carrier(req.transport) == Carrier::Link
            && req.layout == Layout::Contiguous
            && !matches!(req.source, WireMemoryKind::Device(_))
            && req.pull.is_none()
            && req.into.is_none()
            && self.eager_in_use().saturating_add(req.len) <= self.eager.credit
    }

    /// Queues a transfer; it is offered in order once a pipeline slot is free.
    pub fn handle_send(&mut self, now: Instant, req: SendRequest) -> Result<OpId, Refusal> {
        self.enqueue(now, OpKind::Transfer(Box::new(req)))
    }

    /// Queues a one-sided put; it streams in order once a pipeline slot is free.
    pub fn handle_put(&mut self, now: Instant, req: PutRequest) -> Result<OpId, Refusal> {
        self.enqueue(now, OpKind::Put(req))
    }

    fn enqueue(&mut self, now: Instant, op: OpKind) -> Result<OpId, Refusal> {
        if let Some(why) = &self.lost {
            return Err(Refusal::PeerLost(why.clone()));
        }
        if self.draining {
            return Err(Refusal::ShuttingDown);
        }
        if self.ops.len() >= self.limits.queue {
            return Err(Refusal::QueueFull(self.limits.queue));
        }
        let id = OpId(self.next_op);
        self.next_op += 1;
        self.ops.insert(id, Phase::Waiting(op));
        self.handle_timeout(now);
        self.start_waiting();
        Ok(id)
    }

    /// Pipeline slots in use: the span of ids from the oldest op still in flight to the
    /// next one to start, finished ops inside it included. A window that freed a slot as
    /// each op finished would let the peer hold ever more transfers complete but not yet
    /// delivered behind a slow one (it delivers in order); counted this way, the peer
    /// never holds more than `in_flight` of ours open at once.
    fn in_flight(&self) -> usize {
        let Some(oldest) = self
            .ops
            .iter()
            .find(|(_, p)| !matches!(p, Phase::Waiting(_)))
            .map(|(id, _)| id.0)
        else {
            return 0;
        };
        let next = self
            .ops
            .iter()
            .find(|(_, p)| matches!(p, Phase::Waiting(_)))
            .map_or(self.next_op, |(id, _)| id.0);
        usize::try_from(next.saturating_sub(oldest)).unwrap_or(usize::MAX)
    }

    /// Starts waiting ops, in order, while pipeline slots are free.
    fn start_waiting(&mut self) {
        let mut free = self.limits.in_flight.saturating_sub(self.in_flight());
        if free == 0 {
            return;
        }
        let ids: Vec<OpId> = self
            .ops
            .iter()
            .filter(|(_, p)| matches!(p, Phase::Waiting(_)))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if free == 0 {
                break;
            }
            free -= 1;
            let Some(Phase::Waiting(op)) = self.ops.remove(&id) else {
                continue;
            };
            match op {
                OpKind::Transfer(req) => {
                    let eager = self.goes_eagerly(&req);
                    self.transmit.push_back(Message::Offer(Offer {
                        transfer: id.0,
                        tag: req.tag,
                        len: req.len,
                        source: req.source,
                        transport: req.transport.into(),
                        direction: req.direction,
                        pull: req.pull.clone(),
                        layout: req.layout.clone(),
                        fetch: req.fetch,
                        into: req.into.clone(),
                        eager,
                    }));
                    // A pull needs no grant: the peer reads, then says Done.
                    let phase = if eager {
                        Phase::Eager(req)
                    } else if req.direction == WireDirection::Pull {
                        Phase::AwaitConfirm(OpKind::Transfer(req))
                    } else {
                        Phase::AwaitGrant(req)
                    };
                    self.ops.insert(id, phase);
                }
                put @ OpKind::Put(_) => {
                    self.events.push_back(SessionEvent::Stream(id));
                    self.ops.insert(
                        id,
                        Phase::Streaming {
                            op: put,
                            confirmed: false,
                        },
                    );
                }
            }
        }
    }

    /// Ends `id` with `outcome`; through `Ending` if a stream still runs.
    fn finish(&mut self, id: OpId, outcome: Outcome, tell_peer: Option<WireReason>) {
        let Some(phase) = self.ops.remove(&id) else {
            return;
        };
        let is_transfer = match &phase {
            Phase::Waiting(op) | Phase::Streaming { op, .. } | Phase::AwaitConfirm(op) => {
                matches!(op, OpKind::Transfer(_))
            }
            Phase::AwaitGrant(_) | Phase::Eager(_) => true,
            Phase::Ending { .. } => {
                // Already decided: the first outcome stands.
                self.ops.insert(id, phase);
                return;
            }
        };
        let offered = !matches!(phase, Phase::Waiting(_));
        if let (Some(reason), true, true) = (tell_peer, is_transfer, offered) {
            self.transmit.push_back(Message::Cancel(Cancel {
                by_receiver: false,
                transfer: id.0,
                reason,
                detail: String::new(),
            }));
        }
        if let Phase::Streaming { op, .. } = phase {
            self.events.push_back(SessionEvent::StopStream(id));
            drop(op);
            self.ops.insert(id, Phase::Ending { outcome });
        } else {
            self.events.push_back(SessionEvent::Finished(id, outcome));
        }
        self.start_waiting();
    }

    /// The application cancels an op. Returns false if it had already ended.
    pub fn handle_cancel(&mut self, id: OpId) -> bool {
        let live = matches!(
            self.ops.get(&id),
            Some(p) if !matches!(p, Phase::Ending { .. })
        );
        if live {
            self.finish(id, Outcome::Cancelled, Some(WireReason::Cancelled));
        }
        live
    }

    /// The copy of op `id` into the peer's buffer (an ipc push) failed: the op fails with
    /// the reason. The shell told the peer (`Written` with the error) and reports no
    /// `handle_stream_ended` for it.
    pub fn handle_write_failed(&mut self, id: OpId, why: String) {
        self.finish(id, Outcome::Failed(FailKind::Transport(why)), None);
        self.handle_stream_ended(id);
    }

    /// The offer of op `id`, just taken from [`Self::poll_transmit`], cannot go on the link
    /// (larger than the frames the peer takes): the op fails with `why`, and nothing is sent
    /// about it (the peer never saw the offer).
    pub fn handle_unsendable(&mut self, id: OpId, why: String) {
        self.finish(id, Outcome::Failed(FailKind::Unsendable(why)), None);
    }

    /// The transport finished (or stopped) streaming op `id`'s bytes.
    pub fn handle_stream_ended(&mut self, id: OpId) {
        match self.ops.remove(&id) {
            Some(Phase::Streaming { op, confirmed }) => {
                if confirmed {
                    self.events
                        .push_back(SessionEvent::Finished(id, Outcome::Completed));
                    self.start_waiting();
                } else {
                    self.ops.insert(id, Phase::AwaitConfirm(op));
                }
            }
            Some(Phase::Ending { outcome, .. }) => {
                self.events.push_back(SessionEvent::Finished(id, outcome));
                self.start_waiting();
            }
            Some(other) => {
                self.ops.insert(id, other);
            }
            None => {}
        }
    }

    /// A control message from the peer. Data and put chunks never come here: the
    /// transport places them and reports [`Self::handle_inbound_complete`].
    pub fn handle_message(&mut self, msg: Message) -> Result<(), ProtocolViolation> {
        match msg {
            Message::Offer(offer) => self.on_offer(offer),
            Message::Grant(grant) => self.on_grant(&grant),
            Message::Done(done) => {
                self.on_confirm(OpId(done.transfer));
                Ok(())
            }
            Message::Written(written) => {
                self.events.push_back(SessionEvent::Written {
                    id: InboundId(written.transfer),
                    error: written.error,
                });
                Ok(())
            }
            Message::PutAck(ack) => {
                let id = OpId(ack.put);
                match ack.error {
                    None => self.on_confirm(id),
                    Some(detail) => self.finish(
                        id,
                        Outcome::Failed(FailKind::Refused {
                            reason: WireReason::Protocol,
                            detail,
                        }),
                        None,
                    ),
                }
                Ok(())
            }
            Message::Cancel(cancel) => {
                self.on_cancel(cancel);
                Ok(())
            }
            Message::Ping(nonce) => {
                self.transmit.push_back(Message::Pong(nonce));
                Ok(())
            }
            Message::Pong(_) | Message::Goodbye => Ok(()),
            other => Err(ProtocolViolation(format!(
                "unexpected {:?} frame on an established link",
                other.kind()
            ))),
        }
    }

    fn on_grant(&mut self, grant: &Grant) -> Result<(), ProtocolViolation> {
        let id = OpId(grant.transfer);
        match self.ops.remove(&id) {
            // An eager offer granted: the peer read past its bytes; they stream now.
            Some(Phase::AwaitGrant(req) | Phase::Eager(req)) => {
                let pushes = registry::carrier(req.transport).push_lends()
                    && req.direction == WireDirection::Push;
                if grant.lent.is_some() && !pushes {
                    let why = format!(
                        "grant for transfer {} lends a buffer to a transfer over {} ({:?}), \
                         which writes none",
                        id.0, req.transport, req.direction
                    );
                    self.ops.insert(id, Phase::AwaitGrant(req));
                    return Err(ProtocolViolation(why));
                }
                // What the grant lends is the transfer's transport's to read.
                let target = grant.lent.clone().map(|descriptor| PushTarget {
                    transport: req.transport,
                    descriptor,
                });
                self.ops.insert(
                    id,
                    Phase::Streaming {
                        op: OpKind::Transfer(req),
                        confirmed: false,
                    },
                );
                // A push whose landing is not lent (host memory) streams over the link.
                self.events.push_back(match target {
                    Some(target) => SessionEvent::Write(id, target),
                    None => SessionEvent::Stream(id),
                });
                Ok(())
            }
            // Ending comes only from Streaming, so this op was granted already: a second
            // grant that lends a buffer breaks the protocol (answering it Written would let
            // the peer free the buffer the first grant lent while our copy may still run).
            Some(ending @ Phase::Ending { .. }) => {
                self.ops.insert(id, ending);
                if grant.lent.is_some() {
                    return Err(ProtocolViolation(format!(
                        "a second grant lending a buffer for transfer {}",
                        id.0
                    )));
                }
                Ok(())
            }
            // A grant that crossed our cancel (the op ended before it was granted): a lent
            // buffer goes back at once.
            None if id.0 < self.next_op => {
                self.give_back(grant);
                Ok(())
            }
            Some(other) => {
                self.ops.insert(id, other);
                Err(ProtocolViolation(format!(
                    "grant for transfer {} out of turn",
                    id.0
                )))
            }
            None => Err(ProtocolViolation(format!(
                "grant for transfer {} that was never offered",
                id.0
            ))),
        }
    }

    /// A grant that lent a buffer to an op that already ended: the peer gets it back.
    fn give_back(&mut self, grant: &Grant) {
        if grant.lent.is_some() {
            self.transmit.push_back(Message::Written(Written {
                transfer: grant.transfer,
                error: Some("the transfer ended before its grant arrived".into()),
            }));
        }
    }

    fn on_confirm(&mut self, id: OpId) {
        match self.ops.remove(&id) {
            Some(Phase::Streaming { op, .. }) => {
                self.ops.insert(
                    id,
                    Phase::Streaming {
                        op,
                        confirmed: true,
                    },
                );
            }
            Some(Phase::AwaitConfirm(_) | Phase::Eager(_)) => {
                self.events
                    .push_back(SessionEvent::Finished(id, Outcome::Completed));
                self.start_waiting();
            }
            Some(other) => {
                self.ops.insert(id, other);
            }
            None => {}
        }
    }

    fn on_cancel(&mut self, cancel: Cancel) {
        // From the receiver: about our transfer; from the sender: about the peer's.
        let ours = OpId(cancel.transfer);
        if cancel.by_receiver
            && self.ops.contains_key(&ours)
            && !matches!(self.ops.get(&ours), Some(Phase::Waiting(_)))
        {
            self.finish(
                ours,
                Outcome::Failed(FailKind::Refused {
                    reason: cancel.reason,
                    detail: cancel.detail,
                }),
                None,
            );
        }
        let theirs = InboundId(cancel.transfer);
        if !cancel.by_receiver
            && let Some(op) = self.inbound.remove(&theirs)
        {
            // A queued transfer has nothing reserved yet: nothing for the shell to free.
            if op.phase != InPhase::Queued {
                self.events.push_back(SessionEvent::Abandon(theirs));
            }
            self.deliver_ready();
        }
    }

    /// The link (and the staged ring beside it) has moved `bytes` in all so far, counted
    /// by the shell: if that is more than last reported, the stall clock starts again.
    pub fn handle_link_progress(&mut self, bytes: u64, now: Instant) {
        if bytes != self.progress.0 {
            self.progress = (bytes, self.progress.1.max(Some(now)));
        }
    }

    /// When the stall clock runs out, if any granted transfer waits for bytes.
    fn stall_deadline(&self) -> Option<Instant> {
        let since = self.progress.1?;
        self.inbound
            .values()
            .any(|op| op.phase == InPhase::Receiving && op.stalls)
            .then_some(since + self.limits.stall)
    }

    /// True while something of the session waits on the peer: an offer for its grant, a
    /// transfer for its `Done` (a stream of ours included: its `Done` follows it) or a put
    /// for its ack, a granted transfer for its bytes or `Written`. What waits only on this
    /// node (a queued send, a reservation, a pull's own copy, a delivery's turn) does not.
    fn awaits_peer(&self) -> bool {
        self.ops.values().any(|p| {
            matches!(
                p,
                Phase::AwaitGrant(_)
                    | Phase::Eager(_)
                    | Phase::AwaitConfirm(_)
                    | Phase::Streaming {
                        confirmed: false,
                        ..
                    }
            )
        }) || self
            .inbound
            .values()
            .any(|op| op.phase == InPhase::Receiving && op.pushed)
    }

    /// The link has received `received` bytes from the peer in all so far (a running total
    /// the shell counts, keepalives included), at `now`; `elsewhere` says whether the shell
    /// waits on the peer for something the session does not see (a setup step, a fetch's
    /// answer). While anything waits on the peer, it must keep being heard:
    /// [`Self::handle_stall_check`] asks it for a sign of life after a third of
    /// [`SessionLimits::stall`] of quiet, and ends the link when none came within it. Call it whenever the session may
    /// have changed (the shell does at the end of each turn) and right before the check.
    pub fn handle_heard(&mut self, received: u64, elsewhere: bool, now: Instant) {
        if self.lost.is_some() {
            return;
        }
        let waiting = elsewhere || self.awaits_peer();
        self.liveness.handle_heard(received, waiting, now);
    }

    /// Ends the link when the peer, waited on, answered no keepalive within the stall
    /// timeout ([`Self::handle_heard`]): every op fails once as lost, with the reason. Else asks a
    /// quiet peer for a sign of life (a `Ping`) when one is due, and ends every granted
    /// transfer that waits for bytes when the link has moved nothing (keepalives left out)
    /// for the stall timeout: its memory is abandoned and the peer is told why. Call it
    /// right after [`Self::handle_link_progress`] and [`Self::handle_heard`] with fresh
    /// counts, never on stale ones (the shell's timer does all three).
    pub fn handle_stall_check(&mut self, now: Instant) {
        if let Some(silent) = self.liveness.silent(now) {
            let silent =
                Duration::from_millis(u64::try_from(silent.as_millis()).unwrap_or(u64::MAX));
            self.handle_link_lost(&format!(
                "the peer sent nothing for {silent:?} while this node waited on it, and no \
                 answer to a keepalive within limits.stall_timeout ({:?}): it is gone, or \
                 the link carries only our direction",
                self.limits.stall
            ));
            return;
        }
        if let Some(nonce) = self.liveness.poll_keepalive(now) {
            self.transmit.push_back(Message::Ping(nonce));
        }
        if self.stall_deadline().is_none_or(|at| now < at) {
            return;
        }
        let stalled: Vec<InboundId> = self
            .inbound
            .iter()
            .filter(|(_, op)| op.phase == InPhase::Receiving && op.stalls)
            .map(|(id, _)| *id)
            .collect();
        for id in stalled {
            self.inbound.remove(&id);
            self.transmit.push_back(Message::Cancel(Cancel {
                by_receiver: true,
                transfer: id.0,
                reason: WireReason::Stalled,
                detail: format!(
                    "granted, and the link moved no byte for {:?} (limits.stall_timeout)",
                    self.limits.stall
                ),
            }));
            self.events.push_back(SessionEvent::Abandon(id));
        }
        self.deliver_ready();
    }

    /// Expires every op whose deadline is at or before `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let expired: Vec<OpId> = self
            .ops
            .iter()
            .filter(|(_, p)| match p {
                Phase::Waiting(op) | Phase::Streaming { op, .. } | Phase::AwaitConfirm(op) => {
                    op.deadline() <= now
                }
                Phase::AwaitGrant(req) | Phase::Eager(req) => req.deadline <= now,
                Phase::Ending { .. } => false,
            })
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.finish(
                id,
                Outcome::Failed(FailKind::DeadlineExceeded),
                Some(WireReason::DeadlineExceeded),
            );
        }
    }

    /// The link broke: every op fails once (streams first stop), inbound transfers are
    /// abandoned, and new requests are refused.
    pub fn handle_link_lost(&mut self, why: &str) {
        if self.lost.is_some() {
            return;
        }
        self.lost = Some(why.to_string());
        self.liveness.reset();
        self.transmit.clear();
        let ids: Vec<OpId> = self.ops.keys().copied().collect();
        for id in ids {
            self.finish(
                id,
                Outcome::Failed(FailKind::PeerLost(why.to_string())),
                None,
            );
        }
        for id in std::mem::take(&mut self.inbound).into_keys() {
            self.events.push_back(SessionEvent::Abandon(id));
        }
    }

    /// The link was replaced by another one to the same peer, which never read anything
    /// from the old one (both nodes dialed at once and the old link lost the tie-break).
    /// Ops that were offered but not granted are offered again on the new link; an op
    /// further along, or an inbound transfer, cannot exist on such a link, and if one does
    /// it fails as if the peer were lost.
    pub fn handle_relink(&mut self) {
        self.transmit.clear();
        self.liveness.reset();
        let ids: Vec<OpId> = self.ops.keys().copied().collect();
        for id in ids {
            match self.ops.remove(&id) {
                Some(Phase::AwaitGrant(req) | Phase::Eager(req)) => {
                    self.ops.insert(id, Phase::Waiting(OpKind::Transfer(req)));
                }
                // A pull awaits Done right after its offer, which the peer never read.
                Some(Phase::AwaitConfirm(OpKind::Transfer(req)))
                    if req.direction == WireDirection::Pull =>
                {
                    self.ops.insert(id, Phase::Waiting(OpKind::Transfer(req)));
                }
                Some(waiting @ Phase::Waiting(_)) => {
                    self.ops.insert(id, waiting);
                }
                Some(other) => {
                    self.ops.insert(id, other);
                    self.finish(
                        id,
                        Outcome::Failed(FailKind::PeerLost("the link was replaced".into())),
                        None,
                    );
                }
                None => {}
            }
        }
        for id in std::mem::take(&mut self.inbound).into_keys() {
            self.events.push_back(SessionEvent::Abandon(id));
        }
        self.start_waiting();
    }

    /// Stops taking new work; ops already queued run to their end. Offers that arrive from
    /// now on are refused with `ShuttingDown`.
    pub fn handle_drain(&mut self) {
        self.draining = true;
    }

    /// True when nothing is queued, in flight or being received.
    pub fn is_idle(&self) -> bool {
        self.ops.is_empty() && self.inbound.is_empty()
    }

    /// True once the link was lost.
    pub fn is_lost(&self) -> bool {
        self.lost.is_some()
    }

    /// Why the link was lost, once it was.
    pub fn lost_reason(&self) -> Option<&str> {
        self.lost.as_deref()
    }

    /// Next message to send to the peer.
    pub fn poll_transmit(&mut self) -> Option<Message> {
        self.transmit.pop_front()
    }

    /// Next thing the shell must do.
    pub fn poll_event(&mut self) -> Option<SessionEvent> {
        self.events.pop_front()
    }

    /// The earliest deadline of a live op, the stall clock's end while granted transfers
    /// wait for bytes, or the next keepalive or verdict while anything waits on the peer,
    /// for the shell's timer.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let stalls = self
            .stall_deadline()
            .into_iter()
            .chain(self.recheck_at)
            .chain(self.liveness.poll_timeout());
        self.ops
            .values()
            .filter_map(|p| match p {
                Phase::Waiting(op) | Phase::Streaming { op, .. } | Phase::AwaitConfirm(op) => {
                    Some(op.deadline())
                }
                Phase::AwaitGrant(req) | Phase::Eager(req) => Some(req.deadline),
                Phase::Ending { .. } => None,
            })
            .chain(stalls)
            .min()
    }
}
