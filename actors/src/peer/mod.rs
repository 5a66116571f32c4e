//! The transfer actor of one peer: a shell over [`PeerSession`].
//!
//! It owns the link to the peer. Two tasks on the node's I/O runtime serve the link: the
//! reader decodes frames, places data and put chunks straight into their receive buffers
//! (each chunk's payload frame is read straight into its buffer) and forwards control
//! messages to the actor;
//! the writer sends control frames and streams buffers in chunks from a bounded queue. Bulk
//! bytes therefore never pass through a mailbox, and the actor never waits on a socket.
//!
//! Every queue here is bounded: the actor's mailbox (config `limits.mailbox`), the writer
//! queue (sized from the session's bounds, so a peer that follows the protocol cannot fill
//! it; one that floods us loses its link), and the session's own op queue.

mod drive;
mod eager;
mod fetch;
mod inbound;
mod inspect;
mod link_io;
mod outbound;
mod part;
mod push;

pub use self::fetch::AskFetch;
pub use self::inspect::Inspect;
use self::outbound::Held;
use self::{eager::*, fetch::*, inbound::*, link_io::*, part::*, push::*};

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use dashmap::DashMap;
use ferry_transports::link::{
    Activity, Link, LinkCounters, LinkError, LinkReader, LinkWriter, Secret,
};
use ferry_transports::memory::{Buffer, SharedBytes};
use ferry_transports::region::{self, ExposedRegion, InboundRegion, RegionKey, restore_landing};
use ferry_transports::wire::{
    ArchivedMessage, Done, Layout, Message, PutAck, WireDirection, WireReason, Written,
};
use tokio::sync::{mpsc, oneshot};

use crate::allocator::{self, Export, Fill, PeerGone, Placement, Tier, place_in_tiers_off_actor};
use crate::core::exports::ExportId;
use crate::core::session::{
    InboundId, OpId, Outcome, PeerSession, PullSource, PushTarget, PutRequest, SendRequest,
    SessionEvent, SessionLimits,
};
use crate::data_event::DataEvent;
use crate::error::{Error, SendError};
use crate::timer::DeadlineTimer;
use ferry_transports::transport::setup::{SetupFailure, SetupOutcome};

/// The transfer actor stopped; the coordinator forgets it.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct SessionEnded {
    /// The peer.
    pub peer: String,
    /// The session's epoch, so a newer session for the same peer is not forgotten.
    pub epoch: u64,
}

/// A transport's setup with a peer settled: the coordinator routes by it, and `explain`
/// says it.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct SetupSettled {
    /// The peer.
    pub peer: String,
    /// The session's epoch.
    pub epoch: u64,
    /// The transport.
    pub transport: ferry_config::TransportName,
    /// Ok, or Bad with the reason.
    pub outcome: SetupOutcome,
}

/// How a transfer actor is set up.
#[derive(Clone)]
pub struct TransferSetup {
    /// This node's name.
    pub node: String,
    /// This node's host identity: a peer whose hello says the same is on this host.
    pub host_id: Arc<str>,
    /// Session bounds.
    pub limits: SessionLimits,
    /// Bytes per data frame.
    pub chunk: usize,
    /// How long an inbound transfer may wait for memory.
    pub reserve_timeout: Duration,
    /// Where inbound transfers land, then where they spill, in order.
    pub tiers: Vec<Tier>,
    /// The same without device tiers: where transfers over a link land (tcp reads into
    /// host memory).
    pub host_tiers: Vec<Tier>,
    /// The node's GPUs (empty without any).
    pub gpus: crate::gpu::SharedGpus,
    /// The link secret, which also authenticates pool requests.
    pub secret: Secret,
    /// How long memory a lost peer may still map stays unused (`memory.export_lease_timeout`).
    pub lease_timeout: Duration,
    /// Told when the peer is gone, so what it held is quarantined.
    pub peer_gone: Vec<Recipient<PeerGone>>,
    /// Told when the actor stops.
    pub ended: Recipient<SessionEnded>,
    /// Told when the ipc setup with the peer settles.
    pub settled: Recipient<SetupSettled>,
    /// Told when the peer refuses a link this session dialed.
    pub refused: Recipient<DialRefused>,
    /// Regions exposed for one-sided puts, shared by every peer's reader.
    pub exposed: Arc<DashMap<u64, ExposedRegion>>,
    /// The node's link counters.
    pub counters: Arc<LinkCounters>,
    /// The node's I/O runtime.
    pub io: tokio::runtime::Handle,
    /// What the node's sends to each peer take: this actor publishes its peer's fast path
    /// there when a transport made one, and withdraws it when it stops.
    pub peers: Arc<crate::direct::PeerHandles>,
    /// Where a lane's receiving thread delivers.
    pub inbox: Arc<crate::inbox::Inbox>,
    /// The node's transports, which make this session's parts.
    pub transports: Vec<Arc<dyn ferry_transports::transport::Transport>>,
    /// The buffers this node published, which peers fetch.
    pub published: Arc<crate::publish::Publications>,
    /// Where the answer to a peer's fetch is sent from (routed like any send).
    pub serve: Recipient<crate::coordinator::SendTo>,
}

/// What the application asks of a peer.
#[derive(Debug)]
pub enum Op {
    /// Send a buffer.
    Send {
        /// Application tag.
        tag: u64,
        /// Transport from the route.
        transport: ferry_config::TransportName,
        /// Direction from the route.
        direction: ferry_transports::wire::WireDirection,
        /// What to use instead if the transport's setup with the peer fails: the next
        /// transport of the rule and its direction.
        fallback: Option<(
            ferry_config::TransportName,
            ferry_transports::wire::WireDirection,
        )>,
        /// How the bytes lie in the buffer (checked against it already).
        layout: Layout,
        /// For the answer to the peer's fetch: its id.
        fetch: Option<u64>,
        /// The layout's packed length in the buffer: the bytes that move.
        packed: u64,
        /// For a one-sided write: the peer's region and places the bytes go into.
        into: Option<ferry_transports::wire::RegionWrite>,
    },
    /// Write a buffer into a region the peer exposed.
    Put {
        /// The region.
        key: RegionKey,
        /// Where in the region.
        offset: u64,
    },
}

impl Op {
    /// A send of `packed` bytes laid out as `layout`, under `tag` (for the peer's fetch
    /// `fetch`), by `routed`; counts the failovers the route records, once per send.
    pub fn send_routed(
        routed: crate::direct::Routed,
        tag: u64,
        layout: Layout,
        fetch: Option<u64>,
        packed: u64,
    ) -> Self {
        crate::coordinator::count_failovers(&routed);
        Op::Send {
            tag,
            transport: routed.transport,
            direction: routed.direction,
            fallback: routed.fallback,
            layout,
            fetch,
            packed,
            into: None,
        }
    }

    /// This send, written into the peer's region `into` instead of its inbox.
    pub fn into_region(mut self, region: ferry_transports::wire::RegionWrite) -> Self {
        if let Op::Send { into, .. } = &mut self {
            *into = Some(region);
        }
        self
    }
}

/// Where a peer is, as the `peer_class` label of the transfer metrics says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerClass {
    /// Same host (same process included).
    SameHost,
    /// Another host.
    Remote,
}

impl PeerClass {
    /// The class of a peer at `locality`.
    pub fn of(locality: ferry_config::Locality) -> Self {
        match locality {
            ferry_config::Locality::Remote => Self::Remote,
            _ => Self::SameHost,
        }
    }

    /// The metric label: `"same_host"` or `"remote"`.
    pub fn label(self) -> &'static str {
        match self {
            Self::SameHost => "same_host",
            Self::Remote => "remote",
        }
    }
}

/// Run `op` with `buffer` (handed over as a [`Submission`]); ends giving the buffer back.
#[derive(Debug)]
pub struct Submit {
    /// What to do.
    pub op: Op,
    /// The data.
    pub buffer: Buffer,
    /// When it must have ended.
    pub deadline: Instant,
    /// Where the peer is (for metrics only).
    pub peer_class: PeerClass,
}

/// A submission with where its outcome goes. The node hands it to the peer's actor over a
/// bounded channel the actor reads ([`Submissions`]), never as an actix request: actix
/// drops a request whose caller stopped waiting without handling it, and a send dropped by
/// its caller must still run to its end (its buffer is the transfer's once handed over).
#[derive(Debug)]
pub struct Submission {
    /// What to do.
    pub submit: Submit,
    /// Where its outcome goes (a caller that stopped waiting drops the buffer it gets).
    pub reply: oneshot::Sender<Result<Buffer, SendError>>,
}

/// The sending end of a transfer actor's submissions: bounded by the peer's credit
/// (`limits.peer_queue`), which every submission holds until it ended; and why the
/// actor's session was lost, once it was (a submission still in the channel when the actor
/// stops fails with that reason).
#[derive(Clone, Debug)]
pub struct Submissions {
    tx: futures::channel::mpsc::Sender<Submission>,
    lost: Arc<std::sync::OnceLock<String>>,
}

impl TransferActor {
    /// The channel its submissions come through, at most `bound` waiting: the sending end,
    /// and the stream for the actor's context.
    pub fn submissions(
        &self,
        bound: usize,
    ) -> (Submissions, futures::channel::mpsc::Receiver<Submission>) {
        let (tx, rx) = futures::channel::mpsc::channel(bound);
        let lost = Arc::clone(&self.outbound.lost);
        (Submissions { tx, lost }, rx)
    }
}

/// Hands `submit` to the actor behind `submissions` (waiting for room, which the peer's
/// credit bounds); resolves once it is in the channel, with the future of its outcome.
pub async fn hand_over(
    submissions: &Submissions,
    submit: Submit,
    peer: &str,
) -> futures::future::BoxFuture<'static, Result<Buffer, SendError>> {
    let peer = peer.to_string();
    let why = Arc::clone(&submissions.lost);
    let lost = move |buffer| SendError {
        error: Error::PeerLost {
            peer: peer.clone(),
            detail: why
                .get()
                .cloned()
                .unwrap_or_else(|| "its transfer actor stopped".into()),
        },
        buffer,
    };
    let (reply, outcome) = oneshot::channel();
    let mut tx = submissions.tx.clone();
    // Room first, then the hand-over, which gives the submission back if the actor went.
    if futures::future::poll_fn(|cx| tx.poll_ready(cx))
        .await
        .is_err()
    {
        let failed = Err(lost(Some(submit.buffer)));
        return Box::pin(std::future::ready(failed));
    }
    if let Err(e) = tx.try_send(Submission { submit, reply }) {
        let failed = Err(lost(Some(e.into_inner().submit.buffer)));
        return Box::pin(std::future::ready(failed));
    }
    Box::pin(async move { outcome.await.unwrap_or_else(|_| Err(lost(None))) })
}

/// Hand the actor its link.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Attach {
    /// The link.
    pub link: Link,
    /// True when this node dialed it: then nothing is sent before the peer's `Welcome`.
    pub dialed: bool,
}

/// The peer refused the link this session dialed (another link between the two wins, or
/// the peer is draining). The coordinator waits for the peer's own link.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct DialRefused {
    /// The peer.
    pub peer: String,
    /// The session's epoch.
    pub epoch: u64,
}

/// The link could not be set up, or was replaced: fail everything.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Lost(pub String);

/// Resolves once the link is up and welcomed, or with why it could not be set up.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), Error>")]
pub struct AwaitLink;

/// Stop taking work; resolves once every op has ended, then closes the link.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Drain;

#[derive(Debug, Message)]
#[rtype(result = "()")]
struct FromPeer(Message, u64);

#[derive(Debug, Message)]
#[rtype(result = "()")]
struct PutFinished {
    put: u64,
    error: Option<String>,
}

#[derive(Debug, Message)]
#[rtype(result = "()")]
struct LinkDown {
    why: String,
    /// The peer said goodbye before it closed: it left on purpose.
    clean: bool,
    /// Which of the session's links went down; a replaced link's end is ignored.
    link: u64,
}

enum Outgoing {
    Frame(Message),
    Stream {
        op: OpId,
        what: StreamWhat,
        bytes: SharedBytes,
        stop: Arc<AtomicBool>,
        /// Bytes per data frame.
        chunk: usize,
    },
    /// An eager offer and a copy of its bytes, written as one frame and its payload.
    Eager {
        offer: Message,
        bytes: Vec<u8>,
    },
    Close,
}

#[derive(Clone)]
enum StreamWhat {
    /// A transfer's bytes, gathered from the buffer by the layout.
    Transfer(Layout),
    Put {
        key: RegionKey,
        offset: u64,
    },
}

struct OutEntry {
    buffer: Buffer,
    what: StreamWhat,
    reply: oneshot::Sender<Result<Buffer, SendError>>,
    stop: Arc<AtomicBool>,
    started: Instant,
    /// The bytes the op moves: a layout's packed rows, else the whole buffer.
    moved: u64,
    labels: TransferLabels,
    /// The op's span: opened at submission, closed (dropped) when the op ends.
    span: tracing::Span,
    /// The child span of the phase the op is in: `grant`, `copy` or `ack`.
    phase: tracing::Span,
}

impl OutEntry {
    /// The bytes the op moved: a layout's packed rows, else the whole buffer.
    fn moved(&self) -> u64 {
        self.moved
    }
}

/// The labels of `ferry_transfer_bytes_total`; none names a transfer or an address.
struct TransferLabels {
    transport: ferry_config::TransportName,
    direction: &'static str,
    peer_class: &'static str,
}

/// The span of an inbound transfer and the child span of its phase: `reserve`, `receive`
/// or `deliver`.
struct InboundSpans {
    span: tracing::Span,
    phase: tracing::Span,
    /// When the offer was taken (its `Reserve`), for the [`crate::TRACE_BLOCKS`] timings.
    offered: Instant,
    /// When its pull started, once it did.
    pulling: Option<Instant>,
    /// The offer's blocks (0: not a block list).
    blocks: usize,
}

/// The transfer actor of one peer.
pub struct TransferActor {
    peer: String,
    epoch: u64,
    setup: TransferSetup,
    session: PeerSession,
    /// The current link, and what it needs from this end.
    link: LinkState,
    /// The peer's transfers to us.
    inbound: InboundState,
    /// Our transfers to the peer.
    outbound: OutboundState,
    /// The peer's offers we pull.
    pulls: Pulls,
    /// Each transport's part of the session (opened when the actor starts).
    parts: Parts,
    /// Our buffers lent to the peer's pushes.
    lent: LentState,
    fetch: FetchState,
    timer: DeadlineTimer,
}

/// The current link of a session: its writer and reader, what the peer said of itself in
/// its hello, and who waits for it to come up.
struct LinkState {
    writer: Option<mpsc::Sender<Outgoing>>,
    /// The current link's keepalives (`Ping`, `Pong`), which overtake the writer's queue.
    keepalive: Option<mpsc::Sender<Message>>,
    /// Counts the links this session has had; the current one's number.
    number: u64,
    /// False on a dialed link until the peer's `Welcome`: nothing is sent before it.
    welcomed: bool,
    /// The largest frame the peer takes (its hello's `max_frame`).
    peer_max_frame: u32,
    /// The current link's reader task: ended with the link, so a peer that stopped reading
    /// our writes cannot keep its half of the socket, or feed a lost session.
    reader: Option<tokio::task::AbortHandle>,
    /// The current link's eager credit at this end, and the peer's offers not taken
    /// eagerly that the actor handled on it (see [`EagerGate`]).
    eager: Option<(Arc<dyn EagerGate>, u32)>,
    /// Bytes the current link (and its staged rings) moved, for the stall clock.
    activity: Option<Activity>,
    /// Callers waiting for the link to come up (or for why it cannot).
    waiters: Vec<oneshot::Sender<Result<(), Error>>>,
}

impl Default for LinkState {
    fn default() -> Self {
        Self {
            writer: None,
            keepalive: None,
            number: 0,
            welcomed: false,
            peer_max_frame: u32::MAX,
            reader: None,
            eager: None,
            activity: None,
            waiters: Vec::new(),
        }
    }
}

/// The peer's transfers to us, from their offer to their delivery.
struct InboundState {
    /// Where granted transfers land, by the peer's transfer id.
    regions: Arc<DashMap<u64, InboundRegion>>,
    complete: HashMap<InboundId, (Buffer, crate::order::Pending)>,
    /// Completed writes into a region of ours (in `complete` until their turn, then
    /// delivered to no one).
    written: HashSet<InboundId>,
    /// Writes into a region of ours being placed now, each with the flag that, set when
    /// the transfer is abandoned, keeps its bytes out of the region.
    writes_placing: HashMap<InboundId, Arc<std::sync::atomic::AtomicBool>>,
    /// Completed inbound transfers not yet in the inbox (a lane record waits for them).
    undelivered: crate::order::Undelivered,
    /// Spans of the inbound transfers still open (reserving, receiving or waiting for
    /// their turn to be delivered).
    spans: HashMap<InboundId, InboundSpans>,
    /// Ends when the latest inbound reservation's result is handled: the next one's
    /// result waits for it, so this peer's reservations (made off this actor's thread)
    /// are handled in offer order.
    reserving: Option<oneshot::Receiver<()>>,
    /// Ends when the latest inbound reservation is placed (granted, or queued at its
    /// tiers): the next one is placed after it.
    placing: Option<oneshot::Receiver<()>>,
    /// What this peer's fast lane delivered and the application took (the inbox counts),
    /// and both totals when this session began (it counts from there).
    claims: (Arc<crate::inbox::Claims>, u64, u64),
}

/// Our transfers to the peer, from their submission to their end.
#[derive(Default)]
struct OutboundState {
    entries: HashMap<OpId, OutEntry>,
    /// Our pulls whose offer went to the writer: only those can be read by the peer.
    offered: HashSet<OpId>,
    /// Submissions waiting their turn to enter the session.
    held: Held,
    /// Callers waiting until no transfer of ours is left.
    drained: Vec<oneshot::Sender<()>>,
    /// The fast paths parts opened to the peer (one per transport at most), as published
    /// in the node's table.
    fast_paths: Vec<Arc<crate::direct::FastLane>>,
    /// Why the session was lost, once it was, for the submissions' senders (see
    /// [`Submissions`]).
    lost: Arc<std::sync::OnceLock<String>>,
}

impl TransferActor {
    /// A session with `peer`, waiting for its link.
    pub fn new(peer: String, epoch: u64, setup: TransferSetup) -> Self {
        let claims = setup.inbox.claims(&peer);
        let claims = (
            Arc::clone(&claims),
            claims.lane.load(Ordering::Relaxed),
            claims.taken.load(Ordering::Relaxed),
        );
        Self {
            session: PeerSession::new(setup.limits),
            peer,
            epoch,
            setup,
            link: LinkState::default(),
            inbound: InboundState {
                regions: Arc::default(),
                complete: HashMap::new(),
                written: HashSet::new(),
                writes_placing: HashMap::new(),
                undelivered: crate::order::Undelivered::default(),
                spans: HashMap::new(),
                reserving: None,
                placing: None,
                claims,
            },
            outbound: OutboundState::default(),
            pulls: Pulls::default(),
            parts: Parts::default(),
            lent: LentState::default(),
            fetch: FetchState::default(),
            timer: DeadlineTimer::default(),
        }
    }

    fn writer_capacity(&self) -> usize {
        let l = self.setup.limits;
        4 * (l.in_flight + l.inbound) + 64
    }
}

impl Actor for TransferActor {
    type Context = Context<Self>;

    /// Each transport opens its part of the session, which wakes this actor when its own
    /// work ends.
    fn started(&mut self, ctx: &mut Self::Context) {
        let setup = &self.setup;
        let env = ferry_transports::transport::PeerEnv {
            node: setup.node.clone(),
            peer: self.peer.clone(),
            io: setup.io.clone(),
            gpus: Arc::clone(&setup.gpus.devices),
            secret: setup.secret.clone(),
            memory: Arc::new(crate::allocator::TierMemory {
                tiers: setup.tiers.clone(),
            }),
            host_memory: Arc::new(crate::allocator::TierMemory {
                tiers: setup.host_tiers.clone(),
            }),
            deliveries: Arc::new(crate::inbox::PathDeliveries {
                inbox: Arc::clone(&setup.inbox),
                peer: self.peer.clone(),
                undelivered: self.inbound.undelivered.clone(),
            }),
            share: setup.limits.inbound_bytes,
            reserve_timeout: setup.reserve_timeout,
            lease_timeout: setup.lease_timeout,
            in_flight: setup.limits.in_flight,
            stall: setup.limits.stall,
            wake: waker(ctx.address()),
        };
        self.parts = Parts::open(&setup.transports, &env);
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        self.detach_parts();
        self.fail_held(|| Error::ShuttingDown);
        // What the peer may still read or write of ours is held or quarantined.
        let retired = self.parts.iter_mut().flat_map(|p| p.close()).collect();
        let mut exports = self.retire(retired);
        exports.extend(self.quarantine_lent());
        // Whatever the peer held of our memory is quarantined for the lease timeout.
        let recipients = self.setup.peer_gone.clone();
        let peer = self.peer.clone();
        let epoch = self.epoch;
        actix::spawn(async move {
            quarantine(exports, peer.clone(), epoch).await;
            for recipient in recipients {
                let _ = recipient.send(PeerGone(peer.clone())).await;
            }
        });
        if let Some(reader) = self.link.reader.take() {
            reader.abort();
        }
        self.link.keepalive = None;
        if let Some(w) = self.link.writer.take() {
            let _ = w.try_send(Outgoing::Close);
        }
        self.inbound.regions.clear();
        let ended = SessionEnded {
            peer: self.peer.clone(),
            epoch: self.epoch,
        };
        let recipient = self.setup.ended.clone();
        actix::spawn(async move {
            let _ = recipient.send(ended).await;
        });
    }
}

impl StreamHandler<Submission> for TransferActor {
    fn handle(&mut self, Submission { submit, reply }: Submission, ctx: &mut Self::Context) {
        self.hold(submit, reply, ctx);
    }

    /// Every sender went (the node and the coordinator dropped theirs): the session goes
    /// on with what it holds.
    fn finished(&mut self, _: &mut Self::Context) {}
}

impl Handler<Attach> for TransferActor {
    type Result = ();

    fn handle(&mut self, Attach { link, dialed }: Attach, ctx: &mut Self::Context) {
        if let Some(old) = self.link.writer.take() {
            // A link that lost a simultaneous-dial tie-break: the peer never read it.
            let _ = old.try_send(Outgoing::Close);
            self.session.handle_relink();
            self.ask_fetches_again();
            tracing::info!(peer = %self.peer, "moved to the peer's link");
        }
        self.link.number += 1;
        self.link.peer_max_frame = link.peer_hello.max_frame;
        self.attach_parts(&link.peer_hello);
        // What the peer takes eagerly, before anything is offered on this link.
        let eager = self.parts.iter_mut().find_map(|p| p.peer_eager());
        self.session.handle_peer_eager(eager.unwrap_or_default());
        let (tx, rx) = mpsc::channel(self.writer_capacity());
        self.link.welcomed = !dialed;
        if !dialed {
            // We keep the link the peer dialed: say so before anything else.
            let _ = tx.try_send(Outgoing::Frame(Message::Welcome));
        }
        self.link.writer = Some(tx);
        let (keepalive, keepalives) = mpsc::channel(KEEPALIVES);
        self.link.keepalive = Some(keepalive);
        let me = ctx.address();
        let out = LinkOut {
            writer: link.writer,
            keepalives,
        };
        self.setup
            .io
            .spawn(write_loop(out, rx, me.clone(), self.link.number));
        // The eager credit this node grants the peer on this link, if a transport does.
        let gate = self.parts.iter_mut().find_map(|p| p.eager_gate());
        self.link.eager = gate.clone().map(|g| (g, 0));
        let reader = ReadLoop {
            eager: gate,
            host_tiers: self.setup.host_tiers.clone(),
            me,
            regions: Arc::clone(&self.inbound.regions),
            exposed: Arc::clone(&self.setup.exposed),
            counters: Arc::clone(&self.setup.counters),
            link: self.link.number,
        };
        if let Some(old) = self
            .link
            .reader
            .replace(self.setup.io.spawn(reader.run(link.reader)).abort_handle())
        {
            old.abort();
        }
        self.link.activity = Some(link.activity);
        tracing::info!(peer = %self.peer, "link up");
        self.drive(ctx);
    }
}

impl Handler<DataEvent> for TransferActor {
    type Result = ();
    fn handle(&mut self, event: DataEvent, ctx: &mut Self::Context) {
        match event {
            DataEvent::InboundDone { id, buffer } => {
                self.completed(InboundId(id), buffer, ctx);
            }
            DataEvent::StreamEnded { op, broken, link } => {
                if let Some(why) = broken.filter(|_| link == self.link.number) {
                    self.session
                        .handle_link_lost(&format!("the link's stream failed: {why}"));
                }
                if let Some(entry) = self.outbound.entries.get_mut(&op) {
                    // Every byte is on its way: wait for the peer's Done (or PutAck).
                    entry.phase = tracing::debug_span!(parent: &entry.span, "ack");
                }
                self.session.handle_stream_ended(op);
            }
        }
        self.drive(ctx);
    }
}

impl Handler<Lost> for TransferActor {
    type Result = ();
    fn handle(&mut self, Lost(why): Lost, ctx: &mut Self::Context) {
        self.session.handle_link_lost(&why);
        self.drive(ctx);
    }
}

impl Handler<LinkDown> for TransferActor {
    type Result = ();
    fn handle(&mut self, msg: LinkDown, ctx: &mut Self::Context) {
        if msg.link != self.link.number {
            return;
        }
        if !self.link.welcomed && self.link.writer.is_some() {
            // The peer closed our dial before welcoming it: nothing was sent on it.
            return self.dial_refused(ctx);
        }
        if !self.session.is_lost() {
            if msg.clean {
                tracing::info!(peer = %self.peer, "the peer closed the link");
            } else {
                tracing::warn!(peer = %self.peer, why = %msg.why, "link down");
            }
        }
        self.session.handle_link_lost(&msg.why);
        self.drive(ctx);
    }
}

impl Handler<AwaitLink> for TransferActor {
    type Result = ResponseFuture<Result<(), Error>>;
    fn handle(&mut self, _: AwaitLink, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.link.waiters.push(tx);
        self.drive(ctx);
        Box::pin(async move { rx.await.unwrap_or(Err(Error::ShuttingDown)) })
    }
}

impl Handler<Drain> for TransferActor {
    type Result = ResponseFuture<()>;
    fn handle(&mut self, _: Drain, ctx: &mut Self::Context) -> Self::Result {
        self.session.handle_drain();
        let (tx, rx) = oneshot::channel();
        self.outbound.drained.push(tx);
        self.drive(ctx);
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

impl TransferActor {
    /// The dialed link was refused: drop it, keep every op queued, and let the coordinator
    /// wait for the peer's own link.
    fn dial_refused(&mut self, ctx: &mut Context<Self>) {
        self.link.keepalive = None;
        if let Some(old) = self.link.writer.take() {
            let _ = old.try_send(Outgoing::Close);
        }
        self.link.number += 1;
        tracing::info!(peer = %self.peer, "peer refused our link; waiting for its own");
        let refused = DialRefused {
            peer: self.peer.clone(),
            epoch: self.epoch,
        };
        let recipient = self.setup.refused.clone();
        ctx.spawn(
            async move {
                let _ = recipient.send(refused).await;
            }
            .into_actor(self),
        );
        self.drive(ctx);
    }
}

impl Handler<FromPeer> for TransferActor {
    type Result = ();
    fn handle(&mut self, FromPeer(msg, link): FromPeer, ctx: &mut Self::Context) {
        match msg {
            Message::Welcome if !self.link.welcomed => {
                self.link.welcomed = true;
                return self.drive(ctx);
            }
            Message::Goodbye if !self.link.welcomed => return self.dial_refused(ctx),
            Message::Transport(m) => {
                self.on_transport_message(m);
                return self.drive(ctx);
            }
            Message::Fetch(ask) => {
                self.serve_fetch(ask, ctx);
                return self.drive(ctx);
            }
            Message::FetchRefused(refused) => {
                self.fetch_refused(refused);
                return self.drive(ctx);
            }
            // The peer no longer reads a buffer we offered for pulling.
            Message::Done(Done { transfer }) => {
                self.unexport(OpId(transfer));
            }
            Message::Cancel(ref cancel) if cancel.by_receiver => {
                self.cancelled_by_peer(OpId(cancel.transfer));
            }
            // An offer the reader did not take eagerly: counted for its eager gate (only the
            // current link's reader counts; one replaced may still have frames queued).
            Message::Offer(_) if link == self.link.number => {
                if let Some((_, handled)) = &mut self.link.eager {
                    *handled = handled.wrapping_add(1);
                }
            }
            _ => {}
        }
        if let Err(violation) = self.session.handle_message(msg) {
            tracing::warn!(peer = %self.peer, %violation, "dropping peer");
            note_protocol_violation();
            self.session.handle_link_lost(&violation.to_string());
        }
        self.drive(ctx);
    }
}

impl TransferActor {
    /// A control message of one transport, for its part of this session; one that is not
    /// what its transport reads breaks the protocol.
    fn on_transport_message(&mut self, m: ferry_transports::wire::TransportMessage) {
        let transport = ferry_config::TransportName::from(m.transport);
        let read = match self.part(transport) {
            Some(part) => part.handle_message(&m.body, Instant::now()),
            None => Err(ferry_transports::transport::DescriptorError(format!(
                "this node does not serve {transport}"
            ))),
        };
        if let Err(why) = read {
            let violation = format!("a message for {transport}: {why}");
            tracing::warn!(peer = %self.peer, %violation, "dropping peer");
            note_protocol_violation();
            self.session.handle_link_lost(&violation);
        }
    }
}

impl Handler<PutFinished> for TransferActor {
    type Result = ();
    fn handle(&mut self, msg: PutFinished, ctx: &mut Self::Context) {
        let ack = Message::PutAck(PutAck {
            put: msg.put,
            error: msg.error,
        });
        if let Some(w) = &self.link.writer
            && w.try_send(Outgoing::Frame(ack)).is_err()
        {
            self.session
                .handle_link_lost("the peer sends puts faster than it reads their acks");
        }
        self.drive(ctx);
    }
}

fn note_protocol_violation() {
    metrics::counter!("ferry_frames_rejected_total", "reason" => "protocol").increment(1);
}
