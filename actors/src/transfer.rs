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

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use dashmap::DashMap;
use ferry_transports::link::{Link, LinkCounters, LinkError, LinkReader, LinkWriter, Secret};
use ferry_transports::memory::{Buffer, SharedBytes};
use ferry_transports::memory::{Lease, UnmapDone, Unmapper};
use ferry_transports::region::{self, ExposedRegion, InboundRegion, RegionKey, restore_landing};
use ferry_transports::tcp;
use ferry_transports::wire::{
    ArchivedMessage, Done, IpcBufferRef, IpcSetupMessage, IpcSetupStep, IpcSource, Layout, Message,
    PutAck, StagedRing, WireDirection, WireReason, Written,
};
use tokio::sync::{mpsc, oneshot};

use crate::allocator::{Export, PeerGone, Tier, reserve_in_tiers};
use crate::core::exports::ExportId;
use crate::core::ipc_setup::{
    Admission, Attempt, IpcSetup, PeerReply, SetupEvent, SetupFailure, SetupOutcome, SetupPolicy,
    SetupTransmit,
};
use crate::core::session::{
    InboundId, OpId, Outcome, PeerSession, PutRequest, SendRequest, SessionEvent, SessionLimits,
};
use crate::data_event::DataEvent;
use crate::error::{Error, SendError};
use crate::timer::DeadlineTimer;

/// A buffer delivered to the application, in the peer's send order.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Delivered {
    /// The sending peer.
    pub peer: String,
    /// The sender's tag.
    pub tag: u64,
    /// The transport it came over.
    pub transport: &'static str,
    /// How the bytes lay at the sender (they arrive packed).
    pub layout: Layout,
    /// The data.
    pub buffer: Buffer,
    /// Counts it as on its way to the inbox until the coordinator put it there (fast-lane
    /// records from the same peer wait for that, see [`crate::lane`]).
    pub pending: crate::lane::Pending,
}

/// The transfer actor stopped; the coordinator forgets it.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct SessionEnded {
    /// The peer.
    pub peer: String,
    /// The session's epoch, so a newer session for the same peer is not forgotten.
    pub epoch: u64,
}

/// The ipc setup with a peer settled: the coordinator routes by it, and `explain` says it.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct IpcSettled {
    /// The peer.
    pub peer: String,
    /// The session's epoch.
    pub epoch: u64,
    /// Ok, or Bad with the reason.
    pub outcome: SetupOutcome,
}

/// How a transfer actor is set up.
#[derive(Clone)]
pub struct TransferSetup {
    /// This node's name.
    pub node: String,
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
    /// Where delivered buffers go.
    pub deliver: Recipient<Delivered>,
    /// Told when the actor stops.
    pub ended: Recipient<SessionEnded>,
    /// Told when the ipc setup with the peer settles.
    pub settled: Recipient<IpcSettled>,
    /// Told when the peer refuses a link this session dialed.
    pub refused: Recipient<DialRefused>,
    /// Regions exposed for one-sided puts, shared by every peer's reader.
    pub exposed: Arc<DashMap<u64, ExposedRegion>>,
    /// The node's link counters.
    pub counters: Arc<LinkCounters>,
    /// The node's I/O runtime.
    pub io: tokio::runtime::Handle,
    /// The fast lanes to same-host peers, by peer: this actor adds its peer's when the ipc
    /// setup made one, and removes it when it stops.
    pub lanes: Arc<DashMap<String, Arc<crate::lane::LaneTx>>>,
    /// Where a lane's receiving thread delivers.
    pub inbox: Arc<crate::inbox::Inbox>,
    /// `transport.ipc.lane_max` and `lane_spin`.
    pub lane: crate::lane::LaneSettings,
    /// `[transport.staged]`.
    pub staged: crate::staged::StagedSettings,
}

/// What the application asks of a peer.
#[derive(Debug)]
pub enum Op {
    /// Send a buffer.
    Send {
        /// Application tag.
        tag: u64,
        /// Transport label from the route.
        transport: String,
        /// Direction from the route.
        direction: ferry_transports::wire::WireDirection,
        /// What to use instead if the transport's setup with the peer fails: the next
        /// transport of the rule and its direction.
        fallback: Option<(String, ferry_transports::wire::WireDirection)>,
        /// How the bytes lie in the buffer (checked against it already).
        layout: Layout,
    },
    /// Write a buffer into a region the peer exposed.
    Put {
        /// The region.
        key: RegionKey,
        /// Where in the region.
        offset: u64,
    },
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

/// Run `op` with `buffer`; resolves when it ended, giving the buffer back.
#[derive(Debug, Message)]
#[rtype(result = "Result<Buffer, SendError>")]
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
struct FromPeer(Message);

#[derive(Debug, Message)]
#[rtype(result = "()")]
struct PutFinished {
    put: u64,
    error: Option<String>,
}

/// The staged transport's rings with a same-host peer.
#[derive(Default)]
struct StagedState {
    /// Our sending end (its ring offered at the fd-sharing socket under `key` until the peer
    /// fetched it or the link changed).
    tx: Option<(crate::staged::StagedTx, String)>,
    /// The receiving end of the peer's ring.
    rx: Option<crate::staged::StagedRx>,
    /// True while our ring is being made (off the actor thread).
    making: bool,
    /// When the first staged send on this link asked for a ring.
    since: Option<Instant>,
    /// Staged sends waiting for the peer to map the ring, in grant order.
    waiting: VecDeque<OpId>,
    /// True while a look at `waiting` is scheduled.
    polling: bool,
}

/// How long staged sends wait for a same-host peer to map a staging ring just offered
/// before they go over the link.
const RING_PATIENCE: Duration = Duration::from_secs(1);

#[derive(Debug, Message)]
#[rtype(result = "()")]
struct LinkDown {
    why: String,
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
    },
    Close,
}

#[derive(Clone, Copy)]
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
    labels: TransferLabels,
    /// The op's span: opened at submission, closed (dropped) when the op ends.
    span: tracing::Span,
    /// The child span of the phase the op is in: `grant`, `copy` or `ack`.
    phase: tracing::Span,
}

impl OutEntry {
    /// The bytes the op moved: a layout's packed rows, else the whole buffer.
    fn moved(&self) -> u64 {
        let len = self.buffer.len() as u64;
        match self.what {
            StreamWhat::Transfer(layout) => layout.check(len).unwrap_or(len),
            StreamWhat::Put { .. } => len,
        }
    }
}

/// The labels of `ferry_transfer_bytes_total`; none names a transfer or an address.
struct TransferLabels {
    transport: String,
    direction: &'static str,
    peer_class: &'static str,
}

/// The span of an inbound transfer and the child span of its phase: `reserve`, `receive`
/// or `deliver`.
struct InboundSpans {
    span: tracing::Span,
    phase: tracing::Span,
}

/// The transfer actor of one peer.
pub struct TransferActor {
    peer: String,
    epoch: u64,
    setup: TransferSetup,
    session: PeerSession,
    writer: Option<mpsc::Sender<Outgoing>>,
    /// Counts the links this session has had; the current one's number.
    link: u64,
    /// False on a dialed link until the peer's `Welcome`: nothing is sent before it.
    welcomed: bool,
    regions: Arc<DashMap<u64, InboundRegion>>,
    outbound: HashMap<OpId, OutEntry>,
    complete: HashMap<InboundId, (Buffer, crate::lane::Pending)>,
    /// Completed inbound transfers not yet in the inbox (a lane record waits for them).
    undelivered: crate::lane::Undelivered,
    /// Spans of the inbound transfers still open (reserving, receiving or waiting for
    /// their turn to be delivered).
    inbound_spans: HashMap<InboundId, InboundSpans>,
    drained: Vec<oneshot::Sender<()>>,
    link_waiters: Vec<oneshot::Sender<Result<(), Error>>>,
    timer: DeadlineTimer,
    ipc: IpcState,
    staged: StagedState,
}

/// The ipc side of a session: the lazy setup (as the exporting side), submissions waiting
/// for it, the peer's pools we imported (as the importing side), pulls under way, and the
/// views of our buffers the peer may still be reading.
#[derive(Default)]
struct IpcState {
    setup: Option<IpcSetup<u64>>,
    waiting: HashMap<u64, (Submit, oneshot::Sender<Result<Buffer, SendError>>)>,
    next_ticket: u64,
    /// Setup messages waiting for the link (a handful at most, one per setup step).
    out: VecDeque<Message>,
    /// The peer's pid and whether it runs on this host, from its hello.
    peer_pid: u32,
    same_host: bool,
    /// The peer's pools, imported when it asked (we pull from them).
    imported: Arc<crate::gpu::ImportedPools>,
    /// Offers to pull, with the layout of the bytes in the peer's buffer, by inbound
    /// transfer, until the pull ends.
    sources: HashMap<InboundId, (IpcSource, Layout)>,
    /// Pulls whose copy runs now.
    pulling: HashSet<InboundId>,
    /// Pulls abandoned while their copy ran: the peer is told once the copy ended.
    abandoned: HashSet<InboundId>,
    /// Our buffers offered for pulling, kept until the peer says it no longer reads them
    /// (`Done` or `Cancel`); handed to the allocator's quarantine if the peer is lost.
    exported: HashMap<OpId, SharedBytes>,
    /// Pulls whose offer went to the writer: only those can be read by the peer.
    offered: HashSet<OpId>,
    /// The peer's buffers we keep mapped (importing side).
    imports: Option<crate::gpu::SharedImports>,
    /// Told when one of our buffers the peer may keep mapped is freed (exporting side).
    unmapper: Option<Arc<PeerUnmapper>>,
    /// Our freed buffers waiting for the peer to unmap them.
    unmapping: HashMap<IpcBufferRef, UnmapDone>,
    /// True while we import the peer's pools (one setup request at a time).
    importing: bool,
    /// The lane ring we offer the peer in our setup request (exporting side), under its
    /// key at our fd-sharing socket, until the setup settles.
    lane_offer: Option<(String, Arc<ferry_transports::link::ring::Ring>)>,
    /// Our sending end of the lane, once the setup settled with the peer attached.
    lane_tx: Option<Arc<crate::lane::LaneTx>>,
    /// The receiving end of the peer's lane (importing side).
    lane_rx: Option<crate::lane::LaneRx>,
    /// Our buffers lent to the peer for its pushes (receiving side), by inbound transfer,
    /// until it says `Written`; quarantined if the session ends first.
    lent: HashMap<InboundId, Buffer>,
    /// Those of `lent` whose transfer was abandoned: no longer counted by the session, so
    /// bounded here (a peer past `limits.inbound` of them loses the link).
    lent_abandoned: HashSet<InboundId>,
    /// The peer's pools we push into (sending side), by device UUID, each fetched on the
    /// first push to it; the lock makes one fetch at a time.
    push_pools: Arc<tokio::sync::Mutex<crate::gpu::ImportedPools>>,
}

impl IpcState {
    /// True when the peer is a node of this very process: it copies from our memory
    /// directly (a peer copy), with nothing to import.
    fn in_process(&self) -> bool {
        self.peer_pid == std::process::id()
    }
}

/// Collects our buffers that the peer may keep mapped and that were just freed, for the
/// actor to ask the peer to unmap them. Holds at most what the peer can map (its import
/// cache is bounded).
pub struct PeerUnmapper {
    pending: std::sync::Mutex<Vec<(Lease, UnmapDone)>>,
    wake: tokio::sync::Notify,
    closed: AtomicBool,
    io: tokio::runtime::Handle,
    lease_timeout: Duration,
}

impl PeerUnmapper {
    /// Frees `done`'s memory after the lease timeout: for a peer we can no longer ask.
    fn free_later(&self, done: UnmapDone) {
        let wait = self.lease_timeout;
        self.io.spawn(async move {
            tokio::time::sleep(wait).await;
            drop(done);
        });
    }

    /// No more requests: the session ended. Returns what was still pending.
    fn close(&self) -> Vec<(Lease, UnmapDone)> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        self.closed.store(true, Ordering::Release);
        std::mem::take(&mut *pending)
    }

    fn take(&self) -> Vec<(Lease, UnmapDone)> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Unmapper for PeerUnmapper {
    fn unmap(&self, lease: Lease, done: UnmapDone) {
        // Checked under the lock `close` takes, so nothing lands after the last `take`.
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if self.closed.load(Ordering::Acquire) {
            drop(pending);
            return self.free_later(done);
        }
        pending.push((lease, done));
        drop(pending);
        self.wake.notify_one();
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct UnmapRequests;

impl TransferActor {
    /// A session with `peer`, waiting for its link.
    pub fn new(peer: String, epoch: u64, setup: TransferSetup) -> Self {
        Self {
            session: PeerSession::new(setup.limits),
            peer,
            epoch,
            setup,
            writer: None,
            link: 0,
            welcomed: false,
            regions: Arc::default(),
            outbound: HashMap::new(),
            complete: HashMap::new(),
            undelivered: crate::lane::Undelivered::default(),
            inbound_spans: HashMap::new(),
            drained: Vec::new(),
            link_waiters: Vec::new(),
            timer: DeadlineTimer::default(),
            staged: StagedState::default(),
            ipc: IpcState::default(),
        }
    }

    fn writer_capacity(&self) -> usize {
        let l = self.setup.limits;
        4 * (l.in_flight + l.inbound) + 64
    }

    /// Carries out everything the session asks for.
    fn drive(&mut self, ctx: &mut Context<Self>) {
        self.drive_ipc_setup(ctx);
        loop {
            let mut moved = false;
            if let Some(writer) = self.writer.as_ref().filter(|_| self.welcomed) {
                while let Some(msg) = self.ipc.out.pop_front() {
                    if writer.try_send(Outgoing::Frame(msg)).is_err() {
                        self.session
                            .handle_link_lost("the link's send queue overflowed or closed");
                        break;
                    }
                }
                while let Some(msg) = self.session.poll_transmit() {
                    moved = true;
                    if let Message::Offer(offer) = &msg
                        && offer.direction == WireDirection::Pull
                    {
                        self.ipc.offered.insert(OpId(offer.transfer));
                    }
                    if writer.try_send(Outgoing::Frame(msg)).is_err() {
                        self.session
                            .handle_link_lost("the link's send queue overflowed or closed");
                        break;
                    }
                }
            }
            while let Some(ev) = self.session.poll_event() {
                moved = true;
                self.on_event(ev, ctx);
            }
            if !moved {
                break;
            }
        }
        self.arm_timer(ctx);
        if self.writer.is_some() && self.welcomed {
            for tx in self.link_waiters.drain(..) {
                let _ = tx.send(Ok(()));
            }
        }
        if let Some(why) = self.session.lost_reason() {
            // Submissions still waiting for ipc setup end now, with their buffers.
            for (_, (msg, reply)) in self.ipc.waiting.drain() {
                let _ = reply.send(Err(SendError {
                    error: Error::PeerLost {
                        peer: self.peer.clone(),
                        detail: why.to_string(),
                    },
                    buffer: Some(msg.buffer),
                }));
            }
            for tx in self.link_waiters.drain(..) {
                let _ = tx.send(Err(Error::PeerUnreachable {
                    peer: self.peer.clone(),
                    detail: why.to_string(),
                }));
            }
        }
        if self.session.is_idle() {
            for tx in self.drained.drain(..) {
                let _ = tx.send(());
            }
        }
        if self.session.is_lost() {
            // The lanes and staging rings end with the link: a sender must not wait on a
            // dead peer's ring, nor keep copying into one nobody reads.
            self.end_lanes();
            self.end_staged_tx();
            if let Some(rx) = self.staged.rx.take() {
                rx.stop();
            }
            if self.session.is_idle() && self.outbound.is_empty() {
                ctx.stop();
            }
        }
    }

    fn on_event(&mut self, ev: SessionEvent, ctx: &mut Context<Self>) {
        match ev {
            SessionEvent::Stream(op) => self.start_stream(op, ctx),
            SessionEvent::StopStream(op) => {
                if let Some(entry) = self.outbound.get(&op) {
                    entry.stop.store(true, Ordering::Release);
                }
            }
            SessionEvent::Finished(op, outcome) => self.finish(op, outcome),
            SessionEvent::Reserve {
                id,
                len,
                pull,
                push,
                staged,
                layout,
            } => {
                let span =
                    tracing::debug_span!("inbound", id = id.0, peer = %self.peer, bytes = len);
                let phase = tracing::debug_span!(parent: &span, "reserve");
                self.inbound_spans.insert(id, InboundSpans { span, phase });
                let landing = match (pull, push) {
                    (Some(source), _) => {
                        self.ipc.sources.insert(id, (source, layout));
                        Landing::Pull
                    }
                    (None, true) => Landing::Push,
                    (None, false) if staged => Landing::Staged,
                    (None, false) => Landing::Stream,
                };
                self.reserve(id, len, landing, ctx);
            }
            SessionEvent::Write(op, target) => self.start_write(op, target, ctx),
            SessionEvent::Written { id, error } => self.on_written(id, error),
            SessionEvent::Deliver {
                id,
                tag,
                transport,
                layout,
            } => {
                if let Some(spans) = self.inbound_spans.remove(&id) {
                    tracing::debug!(parent: &spans.span, tag, "delivered");
                }
                if let Some((buffer, pending)) = self.complete.remove(&id) {
                    let delivered = Delivered {
                        peer: self.peer.clone(),
                        tag,
                        transport: transport_label(&transport),
                        layout,
                        buffer,
                        pending,
                    };
                    // Queued in the coordinator's mailbox (first in, first out) when it has
                    // room. When it is full, queued at once all the same through a fresh
                    // sender (the shared one, parked, would hold it until polled, and held
                    // deliveries are polled newest first), and this actor waits until the
                    // coordinator took it before handling anything else: the order is kept
                    // and the mailbox overruns by at most one session batch. The
                    // coordinator never waits on us.
                    match self.setup.deliver.try_send(delivered) {
                        Ok(()) | Err(actix::prelude::SendError::Closed(_)) => {}
                        Err(actix::prelude::SendError::Full(delivered)) => {
                            let send = self.setup.deliver.clone().send(delivered);
                            ctx.wait(
                                async move {
                                    let _ = send.await;
                                }
                                .into_actor(self),
                            );
                        }
                    }
                }
            }
            SessionEvent::Abandon(id) => {
                if let Some(spans) = self.inbound_spans.remove(&id) {
                    tracing::debug!(parent: &spans.span, "abandoned");
                }
                self.regions.remove(&id.0);
                self.complete.remove(&id);
                if self.ipc.lent.contains_key(&id) {
                    // The peer may be copying into it: kept until it says Written.
                    self.ipc.lent_abandoned.insert(id);
                    if self.ipc.lent_abandoned.len() > self.setup.limits.inbound {
                        tracing::warn!(
                            peer = %self.peer,
                            "the peer keeps more abandoned lent buffers than it may have \
                             transfers open; dropping the link"
                        );
                        self.session
                            .handle_link_lost("the peer kept too many abandoned lent buffers");
                    }
                    self.watch_lent(id, ctx);
                }
                if self.ipc.sources.remove(&id).is_some() {
                    if self.ipc.pulling.contains(&id) {
                        self.ipc.abandoned.insert(id);
                    } else {
                        // Never imported: the peer may let go of its buffer now.
                        self.release_to_peer(id);
                    }
                }
            }
        }
    }

    /// Tells the peer we no longer read its buffer of transfer `id` (it holds a lease on it
    /// until then). `Done` for a transfer it already ended changes nothing there.
    fn release_to_peer(&mut self, id: InboundId) {
        if let Some(w) = &self.writer {
            let _ = w.try_send(Outgoing::Frame(Message::Done(Done { transfer: id.0 })));
        }
    }

    fn start_stream(&mut self, op: OpId, ctx: &mut Context<Self>) {
        if self
            .outbound
            .get(&op)
            .is_some_and(|e| e.labels.transport == "staged")
        {
            self.offer_staged_ring(ctx);
            // The link is many times slower than the ring: a staged send waits a little for
            // the peer to map a ring just offered (in order with the others waiting).
            if self.ring_pending() || !self.staged.waiting.is_empty() {
                self.staged.waiting.push_back(op);
                return self.poll_staged_waiting(ctx);
            }
        }
        self.stream_now(op);
    }

    /// True while our staging ring is being made or offered and not yet mapped by the
    /// peer, for at most [`RING_PATIENCE`] since the first staged send asked for it.
    fn ring_pending(&self) -> bool {
        let unmapped = self.staged.making
            || self
                .staged
                .tx
                .as_ref()
                .is_some_and(|(tx, _)| !tx.is_attached());
        unmapped
            && !self.session.is_lost()
            && self
                .staged
                .since
                .is_some_and(|t| t.elapsed() < RING_PATIENCE)
    }

    /// Looks again at the staged sends waiting for the ring, a millisecond from now: they
    /// go once it is mapped (or the wait is over: then over the link); a stopped one ends.
    fn poll_staged_waiting(&mut self, ctx: &mut Context<Self>) {
        if self.staged.polling {
            return;
        }
        self.staged.polling = true;
        ctx.run_later(Duration::from_millis(1), |act, ctx| {
            act.staged.polling = false;
            let pending = act.ring_pending();
            let waiting = std::mem::take(&mut act.staged.waiting);
            for op in waiting {
                let stopped = act
                    .outbound
                    .get(&op)
                    .is_none_or(|e| e.stop.load(Ordering::Acquire));
                if stopped {
                    act.session.handle_stream_ended(op);
                } else if pending {
                    act.staged.waiting.push_back(op);
                } else {
                    act.stream_now(op);
                }
            }
            if !act.staged.waiting.is_empty() {
                act.poll_staged_waiting(ctx);
            }
            act.drive(ctx);
        });
    }

    /// Hands a granted op's bytes to whoever moves them: our staging ring's thread, or the
    /// link's writer.
    fn stream_now(&mut self, op: OpId) {
        let Some(entry) = self.outbound.get_mut(&op) else {
            return;
        };
        // Granted (or a put, which needs no grant): the bytes start to move.
        entry.phase = tracing::debug_span!(parent: &entry.span, "copy");
        // A staged transfer to a peer reading our ring goes through it; else (another
        // host, or the ring not read yet) over the link, where the peer lands it alike.
        if let (StreamWhat::Transfer(layout), Some((tx, _))) = (entry.what, &self.staged.tx)
            && entry.labels.transport == "staged"
            && tx.is_attached()
        {
            let job = crate::staged::Job {
                op,
                layout,
                bytes: entry.buffer.share(),
                stop: Arc::clone(&entry.stop),
            };
            if tx.submit(job).is_err() {
                self.session
                    .handle_link_lost("the staged sender thread is gone or overrun");
                self.session.handle_stream_ended(op);
            }
            return;
        }
        let out = Outgoing::Stream {
            op,
            what: entry.what,
            bytes: entry.buffer.share(),
            stop: Arc::clone(&entry.stop),
        };
        let sent = match &self.writer {
            Some(w) => w.try_send(out).is_ok(),
            None => false,
        };
        if !sent {
            self.session
                .handle_link_lost("the link's send queue overflowed or closed");
            self.session.handle_stream_ended(op);
        }
    }

    /// The peer no longer reads the buffer of `op`: its view goes.
    fn unexport(&mut self, op: OpId) {
        if let Some(view) = self.ipc.exported.remove(&op) {
            crate::gpu::withdraw_in_process(&self.setup.node, &view);
        }
    }

    fn finish(&mut self, op: OpId, outcome: Outcome) {
        // A pull never offered cannot be read by the peer, which will not say Done: its
        // view goes now. An offered one stays until the peer lets go.
        if !self.ipc.offered.remove(&op) {
            self.unexport(op);
        }
        let Some(entry) = self.outbound.remove(&op) else {
            return;
        };
        let status = match &outcome {
            Outcome::Completed => "completed",
            Outcome::Failed(_) => "failed",
            Outcome::Cancelled => "cancelled",
        };
        metrics::counter!("ferry_transfers_total", "status" => status).increment(1);
        if outcome == Outcome::Completed {
            let TransferLabels {
                transport,
                direction,
                peer_class,
            } = &entry.labels;
            metrics::counter!("ferry_transfer_bytes_total", "transport" => transport.clone(),
                "direction" => *direction, "peer_class" => *peer_class)
            .increment(entry.moved());
            metrics::histogram!("ferry_transfer_duration_seconds")
                .record(entry.started.elapsed().as_secs_f64());
        }
        tracing::debug!(parent: &entry.span, ?outcome, "transfer ended");
        let result = match outcome {
            Outcome::Completed => Ok(entry.buffer),
            Outcome::Cancelled => Err(SendError {
                error: Error::Cancelled,
                buffer: Some(entry.buffer),
            }),
            Outcome::Failed(kind) => Err(SendError {
                error: Error::from_fail(&self.peer, kind),
                buffer: Some(entry.buffer),
            }),
        };
        // A caller that stopped waiting drops the buffer, which releases it.
        let _ = entry.reply.send(result);
    }

    fn reserve(&mut self, id: InboundId, len: u64, how: Landing, ctx: &mut Context<Self>) {
        let tiers = if how == Landing::Stream {
            self.setup.host_tiers.clone()
        } else {
            self.setup.tiers.clone()
        };
        let deadline = Instant::now() + self.setup.reserve_timeout;
        let request = async move {
            let mut got = reserve_in_tiers(&tiers, &[len], deadline).await?;
            got.pop().ok_or(Error::ShuttingDown)
        };
        ctx.spawn(request.into_actor(self).map(move |res, act, ctx| {
            match res {
                Ok(buffer) => {
                    let landing = buffer.kind();
                    if act.setup.tiers.first().is_some_and(|t| t.kind != landing) {
                        metrics::counter!("ferry_spill_bytes_total").increment(len);
                        tracing::debug!(peer = %act.peer, id = id.0, %landing, "receive spilled");
                    }
                    if how == Landing::Pull {
                        if act.session.handle_reserved_pull(id) {
                            act.start_pull(id, buffer, ctx);
                        } else {
                            act.ipc.sources.remove(&id);
                        }
                        return act.drive(ctx);
                    }
                    if how == Landing::Push && buffer.device_memory().is_some() {
                        act.lend(id, buffer);
                        return act.drive(ctx);
                    }
                    // The region must exist before the grant leaves, since the peer
                    // streams as soon as it reads the grant. (A push that spilled to host
                    // memory streams too.)
                    act.regions.insert(id.0, InboundRegion::new(buffer));
                    if act
                        .session
                        .handle_reserved(Instant::now(), id, landing.to_wire(), None)
                    {
                        if let Some(spans) = act.inbound_spans.get_mut(&id) {
                            spans.phase = tracing::debug_span!(parent: &spans.span, "receive");
                        }
                    } else {
                        act.regions.remove(&id.0);
                    }
                }
                Err(e) => {
                    act.ipc.sources.remove(&id);
                    if let Some(spans) = act.inbound_spans.remove(&id) {
                        tracing::debug!(parent: &spans.span, error = %e, "no memory");
                    }
                    let reason = match &e {
                        Error::NoMemory { detail, .. } if detail.contains("deadline") => {
                            WireReason::DeadlineExceeded
                        }
                        Error::NoMemory { .. } => WireReason::TooLarge,
                        _ => WireReason::ShuttingDown,
                    };
                    act.session.handle_reserve_failed(id, reason, e.to_string());
                }
            }
            act.drive(ctx);
        }));
    }

    fn arm_timer(&mut self, ctx: &mut Context<Self>) {
        let setup = self.ipc.setup.as_ref().and_then(|s| s.poll_timeout());
        let next = self.session.poll_timeout().into_iter().chain(setup).min();
        self.timer.arm(
            ctx,
            next,
            |a| &mut a.timer,
            |act, now, ctx| {
                // Progress first, so that only a transfer that really stalled is ended.
                let receiving: Vec<InboundId> = act.session.receiving().collect();
                for id in receiving {
                    if let Some(region) = act.regions.get(&id.0) {
                        act.session
                            .handle_inbound_progress(id, region.received(), now);
                    }
                }
                act.session.handle_timeout(now);
                if let Some(setup) = &mut act.ipc.setup {
                    setup.handle_timeout(now);
                }
                act.drive(ctx);
            },
        );
    }

    /// Copies pulled transfer `id` out of the peer's memory into `buffer`, on a blocking
    /// thread; the result comes back to the session.
    fn start_pull(&mut self, id: InboundId, buffer: Buffer, ctx: &mut Context<Self>) {
        let Some((source, layout)) = self.ipc.sources.get(&id).cloned() else {
            return;
        };
        self.ipc.pulling.insert(id);
        if let Some(spans) = self.inbound_spans.get_mut(&id) {
            spans.phase = tracing::debug_span!(parent: &spans.span, "pull");
        }
        let pools = Arc::clone(&self.ipc.imported);
        let peer = &self.peer;
        let imports = Arc::clone(self.ipc.imports.get_or_insert_with(|| {
            Arc::new(std::sync::Mutex::new(crate::gpu::ImportCache::new(
                peer,
                crate::gpu::IMPORT_CACHE_CAPACITY,
            )))
        }));
        let gpus = Arc::clone(&self.setup.gpus);
        let exporter = self.peer.clone();
        let in_process = self.ipc.in_process();
        // Small copies from memory mapped already take a few microseconds: on this thread.
        let inline = buffer.len() <= crate::gpu::INLINE_PULL_MAX
            && layout == Layout::Contiguous
            && (in_process || crate::gpu::is_mapped(&source, &imports));
        let copy = move |express: bool| {
            if in_process {
                crate::gpu::pull_in_process(&exporter, &source, &layout, &gpus, buffer, express)
            } else {
                crate::gpu::pull(&source, &layout, &pools, &imports, &gpus, buffer, express)
            }
        };
        if inline {
            let pulled = copy(true).map_err(|(_, why)| why);
            return self.pull_ended(id, pulled, ctx);
        }
        let copy = self.setup.io.spawn_blocking(move || copy(false));
        ctx.spawn(copy.into_actor(self).map(move |joined, act, ctx| {
            let pulled = match joined {
                Ok(Ok(buffer)) => Ok(buffer),
                Ok(Err((_buffer, why))) => Err(why),
                Err(e) => Err(format!("the pull task failed: {e}")),
            };
            act.pull_ended(id, pulled, ctx);
        }));
    }

    /// Pull `id` ended: deliver the buffer, or fail the transfer; an abandoned one only
    /// tells the peer it may let go.
    fn pull_ended(
        &mut self,
        id: InboundId,
        pulled: Result<Buffer, String>,
        ctx: &mut Context<Self>,
    ) {
        self.ipc.pulling.remove(&id);
        if self.ipc.abandoned.remove(&id) {
            // The import is freed; the peer may let go of its buffer. Ours (if any) is
            // dropped here, which frees it.
            self.release_to_peer(id);
            return self.drive(ctx);
        }
        self.ipc.sources.remove(&id);
        match pulled {
            Ok(buffer) => self.completed(id, buffer),
            Err(why) => {
                tracing::warn!(peer = %self.peer, id = id.0, "pull failed: {why}");
                metrics::counter!("ferry_pull_failures_total").increment(1);
                self.session
                    .handle_reserve_failed(id, WireReason::Unsupported, why);
            }
        }
        self.drive(ctx);
    }
}

impl TransferActor {
    /// Every byte of inbound `id` is in `buffer` (streamed, pulled or pushed): it waits for
    /// its turn to be delivered. A transfer abandoned meanwhile drops the buffer here.
    fn completed(&mut self, id: InboundId, buffer: Buffer) {
        if self.session.handle_inbound_complete(id) {
            if let Some(spans) = self.inbound_spans.get_mut(&id) {
                spans.phase = tracing::debug_span!(parent: &spans.span, "deliver");
            }
            self.complete.insert(id, (buffer, self.undelivered.enter()));
        }
    }

    /// Lends `buffer`, reserved in device memory for inbound push `id`, to the peer: its
    /// export goes in the grant, and the buffer is kept until the peer says `Written`.
    fn lend(&mut self, id: InboundId, buffer: Buffer) {
        let target = match crate::gpu::export_source(&buffer, false) {
            Ok(target) => target,
            Err(why) => {
                return self
                    .session
                    .handle_reserve_failed(id, WireReason::Unsupported, why);
            }
        };
        // False: abandoned meanwhile, nothing lent; the buffer is freed here.
        if self
            .session
            .handle_reserved(Instant::now(), id, buffer.kind().to_wire(), Some(target))
        {
            if let Some(spans) = self.inbound_spans.get_mut(&id) {
                spans.phase = tracing::debug_span!(parent: &spans.span, "pushed");
            }
            self.ipc.lent.insert(id, buffer);
        }
    }

    /// The peer no longer writes the buffer lent for inbound `id`: the transfer completes
    /// with it, or fails and the buffer is freed.
    fn on_written(&mut self, id: InboundId, error: Option<String>) {
        let Some(buffer) = self.ipc.lent.remove(&id) else {
            return;
        };
        self.ipc.lent_abandoned.remove(&id);
        match error {
            None => self.completed(id, buffer),
            Some(why) => {
                tracing::debug!(peer = %self.peer, id = id.0, "the peer's push failed: {why}");
                self.session.handle_reserve_failed(
                    id,
                    WireReason::Unsupported,
                    format!("the push failed: {why}"),
                );
            }
        }
    }

    /// Inbound push `id` was abandoned while its buffer is lent: the peer must give it back
    /// (`Written`) within the lease timeout, or the link goes (its session ends, which ends
    /// its copies) and the buffer is quarantined with the rest.
    fn watch_lent(&mut self, id: InboundId, ctx: &mut Context<Self>) {
        let link = self.link;
        ctx.run_later(self.setup.lease_timeout, move |act, ctx| {
            if act.link == link && act.ipc.lent.contains_key(&id) {
                tracing::warn!(
                    peer = %act.peer,
                    id = id.0,
                    "the peer kept a buffer it was pushing into past the lease timeout; \
                     dropping the link"
                );
                act.session
                    .handle_link_lost("the peer did not give back a lent buffer in time");
                act.drive(ctx);
            }
        });
    }

    /// Copies op `op`'s bytes into the peer's buffer `target` (an ipc push) on a blocking
    /// thread: the peer's pool is imported on the first push to its device, the buffer is
    /// imported, copied into and freed; then the peer hears `Written`.
    fn start_write(&mut self, op: OpId, target: IpcSource, ctx: &mut Context<Self>) {
        let Some(entry) = self.outbound.get_mut(&op) else {
            return self.written(op, Err("the transfer ended".into()), ctx);
        };
        if let Some(why) = self.session.lost_reason() {
            // The grant was read just before the link went: no copy on a dead link.
            let why = format!("the link is gone: {why}");
            return self.written(op, Err(why), ctx);
        }
        entry.phase = tracing::debug_span!(parent: &entry.span, "push");
        let source = entry.buffer.share();
        let stop = Arc::clone(&entry.stop);
        let layout = match entry.what {
            StreamWhat::Transfer(layout) => layout,
            StreamWhat::Put { .. } => Layout::Contiguous,
        };
        let pools = Arc::clone(&self.ipc.push_pools);
        let peer = self.peer.clone();
        let pid = self.ipc.peer_pid;
        let secret = self.setup.secret.clone();
        let gpus = Arc::clone(&self.setup.gpus);
        let io = self.setup.io.clone();
        let push = async move {
            let pool = {
                let mut pools = pools.lock().await;
                if !pools.contains_key(&target.device_uuid) {
                    let uuids = std::slice::from_ref(&target.device_uuid);
                    let fetched = crate::gpu::import_pools(&peer, pid, uuids, &secret, &gpus)
                        .await
                        .map_err(|e| format!("importing the receiver's pool: {e}"))?;
                    pools.extend(fetched);
                }
                pools
                    .get(&target.device_uuid)
                    .cloned()
                    .ok_or_else(|| "the receiver's pool was not imported".to_string())?
            };
            io.spawn_blocking(move || {
                crate::gpu::push(&target, &pool, &gpus, &source, &layout, &stop)
            })
            .await
            .map_err(|e| format!("the push task failed: {e}"))?
        };
        ctx.spawn(push.into_actor(self).map(move |pushed, act, ctx| {
            act.written(op, pushed, ctx);
        }));
    }

    /// The push of `op` ended: the peer gets its buffer back (`Written`), and the op waits
    /// for the peer's `Done` or fails.
    fn written(&mut self, op: OpId, pushed: Result<(), String>, ctx: &mut Context<Self>) {
        let frame = Message::Written(Written {
            transfer: op.0,
            error: pushed.as_ref().err().cloned(),
        });
        let sent = self
            .writer
            .as_ref()
            .is_some_and(|w| w.try_send(Outgoing::Frame(frame)).is_ok());
        if !sent {
            // The peer's buffer must not stay lent on a link that goes on: it goes.
            self.session
                .handle_link_lost("the link's send queue overflowed or closed");
        }
        match pushed {
            Ok(()) => self.session.handle_stream_ended(op),
            Err(why) => {
                tracing::warn!(peer = %self.peer, id = op.0, "push failed: {why}");
                metrics::counter!("ferry_push_failures_total").increment(1);
                self.session.handle_write_failed(op, why);
            }
        }
        self.drive(ctx);
    }
}

/// Marks the export ids of buffers lent to a peer's pushes (the peer's transfer ids) apart
/// from those of our own buffers offered for pulling (our op ids): both stay below it.
const LENT: u64 = crate::core::session::MAX_TRANSFER_ID;

/// Where an inbound transfer's bytes land, and who puts them there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Landing {
    /// Host memory; the peer streams the bytes over the link.
    Stream,
    /// We copy them out of the peer's memory (ipc pull).
    Pull,
    /// The peer copies them into our memory (ipc push), or streams them when the
    /// reservation spilled to host memory.
    Push,
    /// Any tier, device memory first; the chunks come through host memory (our staged
    /// receiver thread copies them in from the peer's ring, or the link's reader does).
    Staged,
}

impl Actor for TransferActor {
    type Context = Context<Self>;

    fn stopped(&mut self, _: &mut Self::Context) {
        self.end_lanes();
        self.end_staged_tx();
        if let Some(rx) = self.staged.rx.take() {
            rx.stop();
        }
        for (_, (msg, reply)) in self.ipc.waiting.drain() {
            let _ = reply.send(Err(SendError {
                error: Error::ShuttingDown,
                buffer: Some(msg.buffer),
            }));
        }
        // Freeing imports waits for their copies: not on the actor thread.
        if let Some(imports) = self.ipc.imports.take() {
            self.setup.io.spawn_blocking(move || drop(imports));
        }
        // Our freed buffers the peer may still map: freed after the lease timeout (a live
        // peer's session with us ends too, which frees its imports).
        if let Some(unmapper) = self.ipc.unmapper.take() {
            let pending = unmapper.close();
            // Wakes the forwarding task, which then finds the actor gone and ends.
            unmapper.wake.notify_one();
            for (_, done) in pending {
                unmapper.free_later(done);
            }
            for (_, done) in self.ipc.unmapping.drain() {
                unmapper.free_later(done);
            }
        }
        // Buffers the peer may still be reading go to their domain's quarantine first.
        let mut exports = Vec::new();
        for (op, view) in self.ipc.exported.drain() {
            crate::gpu::withdraw_in_process(&self.setup.node, &view);
            let kind = view.lease().kind;
            if let ferry_transports::memory::MemoryKind::Device(n) = kind
                && let Some(gpu) = self.setup.gpus.get(n)
            {
                exports.push((gpu.allocator.clone(), op, view));
            }
        }
        // Buffers lent to the peer for its pushes: it may still be copying into them.
        for (id, buffer) in self.ipc.lent.drain() {
            let view = buffer.share();
            if let ferry_transports::memory::MemoryKind::Device(n) = view.lease().kind
                && let Some(gpu) = self.setup.gpus.get(n)
            {
                exports.push((gpu.allocator.clone(), OpId(LENT | id.0), view));
            }
        }
        // Whatever the peer held of our memory is quarantined for the lease timeout.
        let recipients = self.setup.peer_gone.clone();
        let peer = self.peer.clone();
        let epoch = self.epoch;
        actix::spawn(async move {
            for (allocator, op, view) in exports {
                let export = Export {
                    id: ExportId(epoch << 40 | op.0),
                    peer: peer.clone(),
                    view,
                };
                let _ = allocator.send(export).await;
            }
            for recipient in recipients {
                let _ = recipient.send(PeerGone(peer.clone())).await;
            }
        });
        if let Some(w) = self.writer.take() {
            let _ = w.try_send(Outgoing::Close);
        }
        self.regions.clear();
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

impl Handler<UnmapRequests> for TransferActor {
    type Result = ();
    fn handle(&mut self, _: UnmapRequests, ctx: &mut Self::Context) {
        let Some(unmapper) = self.ipc.unmapper.clone() else {
            return;
        };
        for (lease, done) in unmapper.take() {
            let ferry_transports::memory::MemoryKind::Device(n) = lease.kind else {
                continue;
            };
            let Some(gpu) = self.setup.gpus.get(n) else {
                continue;
            };
            let r = crate::gpu::lease_ref(&gpu.device, &lease);
            tracing::debug!(
                buffer = r.buffer,
                "our buffer was freed; asking the peer to unmap it"
            );
            self.ipc.out.push_back(Message::IpcUnmap(r.clone()));
            self.ipc.unmapping.insert(r.clone(), done);
            // A peer that never answers cannot pin the memory for the session's life; nor
            // may the memory be freed while the peer still maps it. So the link goes: the
            // peer's session ends, which frees its imports, and ours frees the memory after
            // the lease timeout.
            ctx.run_later(self.setup.lease_timeout, move |act, ctx| {
                if act.ipc.unmapping.contains_key(&r) {
                    tracing::warn!(
                        peer = %act.peer,
                        buffer = r.buffer,
                        "the peer did not unmap a freed buffer in time; dropping the link"
                    );
                    act.session
                        .handle_link_lost("the peer did not unmap a freed buffer in time");
                    act.drive(ctx);
                }
            });
        }
        self.drive(ctx);
    }
}

impl Handler<Submit> for TransferActor {
    type Result = ResponseFuture<Result<Buffer, SendError>>;

    fn handle(&mut self, msg: Submit, ctx: &mut Self::Context) -> Self::Result {
        let (reply, rx) = oneshot::channel();
        let wants_ipc = matches!(&msg.op, Op::Send { transport, .. } if transport == "ipc");
        if wants_ipc {
            let ticket = self.ipc.next_ticket;
            self.ipc.next_ticket += 1;
            let setup = self
                .ipc
                .setup
                .get_or_insert_with(|| IpcSetup::new(SetupPolicy::DEFAULT));
            match setup.handle_want(Instant::now(), ticket) {
                Admission::Ready(_) => self.queue_submit(msg, reply, ctx),
                Admission::Queued => {
                    self.ipc.waiting.insert(ticket, (msg, reply));
                    self.drive(ctx);
                }
                Admission::FallBack(_, why) => self.fall_back(msg, reply, &why, ctx),
            }
        } else {
            self.queue_submit(msg, reply, ctx);
        }
        Box::pin(async move {
            rx.await.unwrap_or(Err(SendError {
                error: Error::ShuttingDown,
                buffer: None,
            }))
        })
    }
}

impl TransferActor {
    /// Queues a submission in the session; the outcome goes to `reply`.
    fn queue_submit(
        &mut self,
        msg: Submit,
        reply: oneshot::Sender<Result<Buffer, SendError>>,
        ctx: &mut Context<Self>,
    ) {
        let now = Instant::now();
        let len = msg.buffer.len() as u64;
        let peer_class = msg.peer_class.label();
        let (queued, what, labels) = match msg.op {
            Op::Send {
                tag,
                transport,
                direction,
                fallback: _,
                layout,
            } => {
                // What moves: the layout's rows, packed (checked by the node already).
                let len = match layout.check(len) {
                    Ok(packed) => packed,
                    Err(e) => {
                        let _ = reply.send(Err(SendError {
                            error: Error::Usage(format!("the buffer's layout: {e}")),
                            buffer: Some(msg.buffer),
                        }));
                        return;
                    }
                };
                // A node of this process reads our memory directly: a push to it is pulled
                // (the same single peer copy, with no buffer to lend).
                let direction = if transport == "ipc"
                    && direction == WireDirection::Push
                    && self.ipc.in_process()
                {
                    WireDirection::Pull
                } else {
                    direction
                };
                let labels = TransferLabels {
                    transport: transport.clone(),
                    direction: match direction {
                        WireDirection::Push => "push",
                        WireDirection::Pull => "pull",
                    },
                    peer_class,
                };
                let ipc = if direction == WireDirection::Pull {
                    match crate::gpu::export_source(&msg.buffer, self.ipc.in_process()) {
                        Ok(source) => Some(source),
                        Err(detail) => {
                            let _ = reply.send(Err(SendError {
                                error: Error::Unsupported(detail),
                                buffer: Some(msg.buffer),
                            }));
                            return;
                        }
                    }
                } else {
                    None
                };
                let queued = self.session.handle_send(
                    now,
                    SendRequest {
                        tag,
                        len,
                        source: msg.buffer.kind().to_wire(),
                        transport,
                        direction,
                        ipc,
                        layout,
                        deadline: msg.deadline,
                    },
                );
                (queued, StreamWhat::Transfer(layout), labels)
            }
            Op::Put { key, offset } => {
                let queued = self.session.handle_put(
                    now,
                    PutRequest {
                        len,
                        deadline: msg.deadline,
                    },
                );
                // A put always travels over the tcp link today.
                let labels = TransferLabels {
                    transport: "tcp".into(),
                    direction: "put",
                    peer_class,
                };
                (queued, StreamWhat::Put { key, offset }, labels)
            }
        };
        let id = match queued {
            Ok(id) => id,
            Err(refusal) => {
                let error = match refusal {
                    crate::core::session::Refusal::QueueFull(_) => {
                        Error::QueueFull(format!("peer {}: {refusal}", self.peer))
                    }
                    crate::core::session::Refusal::ShuttingDown => Error::ShuttingDown,
                    other => Error::PeerLost {
                        peer: self.peer.clone(),
                        detail: other.to_string(),
                    },
                };
                let _ = reply.send(Err(SendError {
                    error,
                    buffer: Some(msg.buffer),
                }));
                return;
            }
        };
        if labels.direction == "pull" {
            // The peer reads this buffer until it says otherwise (Done or Cancel), and may
            // keep it mapped after: its memory is freed only once the peer unmapped it.
            let view = msg.buffer.share();
            if self.ipc.in_process() {
                // The peer copies straight from our memory, which it finds here.
                crate::gpu::offer_in_process(&self.setup.node, view.clone());
            } else {
                let unmapper: Arc<dyn Unmapper> = self.unmapper(ctx);
                msg.buffer.note_mapped(unmapper);
            }
            self.ipc.exported.insert(id, view);
        }
        let span = tracing::debug_span!(
            "transfer",
            id = id.0,
            peer = %self.peer,
            transport = %labels.transport,
            direction = labels.direction,
            bytes = len,
        );
        // A put needs no grant; it waits for its turn, then streams. A pull waits for the
        // peer's copy.
        let phase = match (what, labels.direction) {
            (StreamWhat::Put { .. }, _) => tracing::debug_span!(parent: &span, "queued"),
            (_, "pull") => tracing::debug_span!(parent: &span, "pull"),
            _ => tracing::debug_span!(parent: &span, "grant"),
        };
        self.outbound.insert(
            id,
            OutEntry {
                buffer: msg.buffer,
                what,
                reply,
                stop: Arc::default(),
                started: now,
                labels,
                span,
                phase,
            },
        );
        self.drive(ctx);
    }

    /// This session's unmapper, made on first use, with the task that hands its work to
    /// the actor (it ends with the actor).
    fn unmapper(&mut self, ctx: &mut Context<Self>) -> Arc<PeerUnmapper> {
        if let Some(u) = &self.ipc.unmapper {
            return Arc::clone(u);
        }
        let unmapper = Arc::new(PeerUnmapper {
            pending: std::sync::Mutex::default(),
            wake: tokio::sync::Notify::new(),
            closed: AtomicBool::new(false),
            io: self.setup.io.clone(),
            lease_timeout: self.setup.lease_timeout,
        });
        self.ipc.unmapper = Some(Arc::clone(&unmapper));
        let me = ctx.address();
        let watched = Arc::clone(&unmapper);
        actix::spawn(async move {
            loop {
                watched.wake.notified().await;
                if me.send(UnmapRequests).await.is_err() {
                    break;
                }
            }
        });
        unmapper
    }

    /// The transport's setup with the peer failed: the submission takes the rule's next
    /// transport, or fails saying why there is none.
    fn fall_back(
        &mut self,
        mut msg: Submit,
        reply: oneshot::Sender<Result<Buffer, SendError>>,
        why: &SetupFailure,
        ctx: &mut Context<Self>,
    ) {
        let Op::Send {
            transport,
            direction,
            fallback,
            ..
        } = &mut msg.op
        else {
            return self.queue_submit(msg, reply, ctx);
        };
        let from = transport.clone();
        match fallback.take() {
            Some((next, next_direction)) => {
                metrics::counter!("ferry_failover_total", "from" => from.clone(), "to" => next.clone())
                    .increment(1);
                tracing::debug!(peer = %self.peer, %from, to = %next, "falling back: {why}");
                *transport = next;
                *direction = next_direction;
                self.queue_submit(msg, reply, ctx);
            }
            None => {
                let _ = reply.send(Err(SendError {
                    error: Error::NoRoute(format!(
                        "{from} setup with peer {} failed ({why}) and the rule names no other \
                         transport",
                        self.peer
                    )),
                    buffer: Some(msg.buffer),
                }));
            }
        }
    }

    /// Carries out what the ipc setup asks for: its messages, its checks, and the
    /// submissions it releases.
    fn drive_ipc_setup(&mut self, ctx: &mut Context<Self>) {
        loop {
            let Some(setup) = self.ipc.setup.as_mut() else {
                return;
            };
            let mut moved = false;
            let mut transmits = Vec::new();
            while let Some(t) = setup.poll_transmit() {
                transmits.push(t);
            }
            let mut settled = None;
            let mut released = Vec::new();
            while let Some(ev) = setup.poll_event() {
                moved = true;
                match ev {
                    SetupEvent::Check(a) => {
                        // What only this side sees: is the peer on this host?
                        let checks = if self.ipc.same_host {
                            Ok(())
                        } else {
                            Err(SetupFailure::NotSameHost)
                        };
                        setup.handle_checks(Instant::now(), a, checks);
                    }
                    SetupEvent::Settled(outcome) => settled = Some(outcome),
                    SetupEvent::Proceed(ticket) => released.push((ticket, None)),
                    SetupEvent::FallBack(ticket, why) => released.push((ticket, Some(why))),
                }
            }
            for t in transmits {
                moved = true;
                let (attempt, step) = match t {
                    SetupTransmit::Request(a) => {
                        let lane = self.offer_lane();
                        (a, IpcSetupStep::Request(self.setup.gpus.uuids(), lane))
                    }
                    SetupTransmit::Ack(a) => (a, IpcSetupStep::Ack(None)),
                    SetupTransmit::Nack(a, why) => (a, IpcSetupStep::Ack(Some(why.to_string()))),
                };
                self.ipc.out.push_back(Message::IpcSetup(IpcSetupMessage {
                    attempt: attempt.0,
                    step,
                }));
            }
            if let Some(outcome) = settled {
                let label = match &outcome {
                    SetupOutcome::Ok => "ok",
                    SetupOutcome::Bad(_) => "bad",
                };
                metrics::counter!("ferry_ipc_setup_total", "outcome" => label).increment(1);
                // A notice lost to a full mailbox leaves explain one step behind;
                // the transfers themselves are routed here either way.
                let _ = self.setup.settled.try_send(IpcSettled {
                    peer: self.peer.clone(),
                    epoch: self.epoch,
                    outcome: outcome.clone(),
                });
                let ok = outcome == SetupOutcome::Ok;
                self.open_lane(ok, ctx);
                match outcome {
                    SetupOutcome::Ok => {
                        tracing::info!(peer = %self.peer, "ipc set up with the peer");
                    }
                    SetupOutcome::Bad(why) => tracing::warn!(
                        peer = %self.peer,
                        "ipc setup with the peer failed, falling back: {why}"
                    ),
                }
            }
            for (ticket, failed) in released {
                if let Some((msg, reply)) = self.ipc.waiting.remove(&ticket) {
                    match failed {
                        None => self.queue_submit(msg, reply, ctx),
                        Some(why) => self.fall_back(msg, reply, &why, ctx),
                    }
                }
            }
            if !moved {
                return;
            }
        }
    }

    /// The lane ring offered with our setup request (one per setup, whatever the number
    /// of attempts): its key at our fd-sharing socket. None when the lane is off or the peer is
    /// in this process.
    fn offer_lane(&mut self) -> Option<String> {
        // Offered before the link may be up (the setup starts with the first transfer):
        // a peer on another host cannot fetch it, and the setup fails its checks anyway.
        if self.setup.lane.max == 0 || self.ipc.in_process() {
            return None;
        }
        if let Some((key, _)) = &self.ipc.lane_offer {
            return Some(key.clone());
        }
        let ring = ferry_transports::link::ring::Ring::create(
            crate::lane::LANE_SLOTS,
            crate::lane::LANE_SLOT_LEN,
        );
        match ring {
            Ok(ring) => {
                let (key, ring) = (ferry_transports::ipc::lane_key(), Arc::new(ring));
                self.setup.gpus.rings.insert(key.clone(), Arc::clone(&ring));
                self.ipc.lane_offer = Some((key.clone(), ring));
                Some(key)
            }
            Err(e) => {
                tracing::warn!(peer = %self.peer, "no fast lane to the peer: {e}");
                None
            }
        }
    }

    /// The setup settled: the lane we offered opens if it went well and the peer attached.
    fn open_lane(&mut self, ok: bool, ctx: &mut Context<Self>) {
        let Some((key, ring)) = self.ipc.lane_offer.take() else {
            return;
        };
        self.setup.gpus.rings.remove(&key);
        if !ok {
            return;
        }
        if !ring.is_attached() {
            tracing::info!(peer = %self.peer, "the peer did not take the fast lane");
            return;
        }
        let unmapper: Arc<dyn ferry_transports::memory::Unmapper> = self.unmapper(ctx);
        match crate::lane::LaneTx::start(&self.peer, ring, self.setup.lane, unmapper) {
            Ok(tx) => {
                tracing::info!(peer = %self.peer, max = self.setup.lane.max, "fast lane to the peer open");
                self.setup.lanes.insert(self.peer.clone(), Arc::clone(&tx));
                if let Some(old) = self.ipc.lane_tx.replace(tx) {
                    old.close();
                }
            }
            Err(why) => tracing::warn!(peer = %self.peer, "no fast lane to the peer: {why}"),
        }
    }

    /// The peer's lane ring arrived with its setup request: our lane thread reads it.
    fn attach_lane(&mut self, ring: ferry_transports::link::ring::Ring) {
        let peer = &self.peer;
        let imports = Arc::clone(self.ipc.imports.get_or_insert_with(|| {
            Arc::new(std::sync::Mutex::new(crate::gpu::ImportCache::new(
                peer,
                crate::gpu::IMPORT_CACHE_CAPACITY,
            )))
        }));
        let cx = crate::lane::RxContext {
            peer: self.peer.clone(),
            pools: Arc::clone(&self.ipc.imported),
            imports,
            gpus: Arc::clone(&self.setup.gpus),
            inbox: Arc::clone(&self.setup.inbox),
            tiers: self.setup.tiers.clone(),
            undelivered: self.undelivered.clone(),
            reserve_timeout: self.setup.reserve_timeout,
            io: self.setup.io.clone(),
            settings: self.setup.lane,
        };
        match crate::lane::LaneRx::start(ring, cx) {
            // A previous lane of this session (a repeated setup) stops.
            Ok(rx) => self.ipc.lane_rx = Some(rx),
            Err(why) => {
                tracing::warn!(peer = %self.peer, "cannot read the peer's fast lane: {why}")
            }
        }
    }

    /// The session ends: both ends of the lanes close.
    fn end_lanes(&mut self) {
        if let Some((key, _)) = self.ipc.lane_offer.take() {
            self.setup.gpus.rings.remove(&key);
        }
        if let Some(tx) = self.ipc.lane_tx.take() {
            self.setup
                .lanes
                .remove_if(&self.peer, |_, current| Arc::ptr_eq(current, &tx));
            tx.close();
        }
        if let Some(rx) = self.ipc.lane_rx.take() {
            rx.stop();
        }
    }

    /// A setup message from the peer.
    fn on_ipc_setup(&mut self, msg: IpcSetupMessage, ctx: &mut Context<Self>) {
        let attempt = Attempt(msg.attempt);
        match msg.step {
            // We are the importing side.
            IpcSetupStep::Request(uuids, lane) => {
                if self.setup.gpus.is_empty() {
                    self.ipc.out.push_back(Message::IpcSetup(IpcSetupMessage {
                        attempt: msg.attempt,
                        step: IpcSetupStep::Reply(Some("the receiver has no GPU".into())),
                    }));
                    return;
                }
                if self.ipc.in_process() {
                    // A node of this process: its memory is ours to copy from already.
                    self.ipc.out.push_back(Message::IpcSetup(IpcSetupMessage {
                        attempt: msg.attempt,
                        step: IpcSetupStep::Reply(None),
                    }));
                    return;
                }
                if self.ipc.importing {
                    // One import at a time; the peer's attempt times out and it retries.
                    return;
                }
                self.ipc.importing = true;
                let peer = self.peer.clone();
                let pid = self.ipc.peer_pid;
                let secret = self.setup.secret.clone();
                let gpus = Arc::clone(&self.setup.gpus);
                let lane = lane.filter(|_| self.setup.lane.max > 0);
                let import = async move {
                    let pools =
                        crate::gpu::import_pools(&peer, pid, &uuids, &secret, &gpus).await?;
                    Ok::<_, String>((pools, fetch_lane(&peer, pid, lane, &secret).await))
                };
                ctx.spawn(import.into_actor(self).map(move |result, act, ctx| {
                    act.ipc.importing = false;
                    let refused = match result {
                        Ok((pools, ring)) => {
                            act.ipc.imported = Arc::new(pools);
                            if let Some(ring) = ring {
                                act.attach_lane(ring);
                            }
                            None
                        }
                        Err(why) => {
                            tracing::warn!(peer = %act.peer, "cannot import the peer's pools: {why}");
                            Some(why)
                        }
                    };
                    act.ipc.out.push_back(Message::IpcSetup(IpcSetupMessage {
                        attempt: attempt.0,
                        step: IpcSetupStep::Reply(refused),
                    }));
                    act.drive(ctx);
                }));
            }
            IpcSetupStep::Ack(failed) => match failed {
                None => self.ipc.out.push_back(Message::IpcSetup(IpcSetupMessage {
                    attempt: msg.attempt,
                    step: IpcSetupStep::Confirm,
                })),
                Some(why) => {
                    tracing::warn!(peer = %self.peer, "the peer gave up ipc setup: {why}");
                }
            },
            // We are the exporting side.
            IpcSetupStep::Reply(refused) => {
                if let Some(setup) = &mut self.ipc.setup {
                    let reply = match refused {
                        None => PeerReply::Accepted,
                        Some(why) => PeerReply::Refused(why),
                    };
                    setup.handle_reply(Instant::now(), attempt, reply);
                }
            }
            IpcSetupStep::Confirm => {
                if let Some(setup) = &mut self.ipc.setup {
                    setup.handle_confirm(attempt);
                }
            }
        }
    }
}

impl Handler<Attach> for TransferActor {
    type Result = ();

    fn handle(&mut self, Attach { link, dialed }: Attach, ctx: &mut Self::Context) {
        if let Some(old) = self.writer.take() {
            // A link that lost a simultaneous-dial tie-break: the peer never read it.
            let _ = old.try_send(Outgoing::Close);
            self.session.handle_relink();
            tracing::info!(peer = %self.peer, "moved to the peer's link");
        }
        self.link += 1;
        self.ipc.peer_pid = link.peer_hello.pid;
        self.ipc.same_host = link.peer_hello.host_id == ferry_transports::link::host_id();
        self.session
            .set_serves_ipc(self.ipc.same_host && !self.setup.gpus.is_empty());
        let (tx, rx) = mpsc::channel(self.writer_capacity());
        self.welcomed = !dialed;
        if !dialed {
            // We keep the link the peer dialed: say so before anything else.
            let _ = tx.try_send(Outgoing::Frame(Message::Welcome));
        }
        self.writer = Some(tx);
        let me = ctx.address();
        let chunk = self.setup.chunk;
        self.setup
            .io
            .spawn(write_loop(link.writer, rx, me.clone(), chunk, self.link));
        let reader = ReadLoop {
            me,
            regions: Arc::clone(&self.regions),
            exposed: Arc::clone(&self.setup.exposed),
            counters: Arc::clone(&self.setup.counters),
            link: self.link,
        };
        self.setup.io.spawn(reader.run(link.reader));
        tracing::info!(peer = %self.peer, "link up");
        // The previous link's staging ring (if any) closes; the next staged send makes one.
        self.end_staged_tx();
        self.drive(ctx);
    }
}

impl TransferActor {
    /// The first GPU of this node, whose context registers staging slots as pinned.
    fn staging_device(&self) -> Option<ferry_transports::cuda::Device> {
        self.setup.gpus.gpus.first().map(|(_, g)| g.device.clone())
    }

    /// The first staged send to a same-host peer on this link: a staging ring for our
    /// staged sends to it, offered at the fd-sharing socket and named to the peer (made lazily:
    /// its slots are page-locked, which a peer that never takes staged should not cost).
    fn offer_staged_ring(&mut self, ctx: &mut Context<Self>) {
        let settings = self.setup.staged;
        if self.staged.tx.is_some()
            || self.staged.making
            || !self.ipc.same_host
            || !settings.shared_memory
        {
            return;
        }
        // `chunk = "auto"` measures copies the first time (tens of milliseconds): not on
        // the actor thread. Staged sends wait meanwhile (at most `RING_PATIENCE`).
        self.staged.making = true;
        self.staged.since = Some(Instant::now());
        let device = self.staging_device();
        let link = self.link;
        let make = move || {
            let chunk = settings.chunk_bytes(device.as_ref());
            ferry_transports::staged::StagingTx::create(settings.slots, chunk)
                .map(|staging| (staging, chunk, device))
        };
        ctx.spawn(
            self.setup
                .io
                .spawn_blocking(make)
                .into_actor(self)
                .map(move |made, act, ctx| {
                    act.staged.making = false;
                    let made = made
                        .map_err(|e| e.to_string())
                        .and_then(|r| r.map_err(|e| e.to_string()));
                    match made {
                        Ok((staging, chunk, device)) if link == act.link && !act.session.is_lost() => {
                            act.start_staged_tx(staging, chunk, device, ctx);
                        }
                        Ok(_) => {}
                        Err(why) => tracing::warn!(peer = %act.peer, "no staging ring (staged sends go over the link): {why}"),
                    }
                    act.drive(ctx);
                }),
        );
    }

    /// Our staging ring is made: offer it and start its sender thread.
    fn start_staged_tx(
        &mut self,
        staging: ferry_transports::staged::StagingTx,
        chunk: usize,
        device: Option<ferry_transports::cuda::Device>,
        ctx: &mut Context<Self>,
    ) {
        let settings = self.setup.staged;
        let key = ferry_transports::staged::ring_key();
        self.setup
            .gpus
            .rings
            .insert(key.clone(), Arc::clone(staging.ring()));
        let started = crate::staged::StagedTx::start(
            &self.peer,
            staging,
            self.setup.limits.in_flight,
            (settings.spin, self.setup.limits.stall),
            device,
            (ctx.address().recipient(), self.link),
            self.setup.io.clone(),
        );
        match started {
            Ok(tx) => {
                tracing::debug!(peer = %self.peer, chunk, slots = settings.slots, "staging ring offered");
                self.ipc
                    .out
                    .push_back(Message::StagedRing(StagedRing { key: key.clone() }));
                self.staged.tx = Some((tx, key));
            }
            Err(e) => {
                self.setup.gpus.rings.remove(&key);
                tracing::warn!(peer = %self.peer, "no staged sender thread: {e}");
            }
        }
    }

    /// Our staging ring closes (the link changed or the session ends).
    fn end_staged_tx(&mut self) {
        if let Some((tx, key)) = self.staged.tx.take() {
            self.setup.gpus.rings.remove(&key);
            tx.close();
        }
    }

    /// The peer named its staging ring: fetch and map it, then read it on a thread of our
    /// own. A ring that cannot be had leaves the peer's staged sends on the link.
    fn attach_staged_ring(&mut self, key: String, ctx: &mut Context<Self>) {
        if !self.ipc.same_host || !key.starts_with("staged/") {
            tracing::warn!(peer = %self.peer, key, "ignoring a staging ring that is not a same-host peer's");
            return;
        }
        if !self.setup.staged.shared_memory {
            tracing::debug!(peer = %self.peer, "transport.staged.shared_memory = false: the peer's staged sends stay on the link");
            return;
        }
        if let Some(old) = self.staged.rx.take() {
            old.stop();
        }
        let (peer, pid, secret) = (
            self.peer.clone(),
            self.ipc.peer_pid,
            self.setup.secret.clone(),
        );
        let fetch = async move {
            let fd = ferry_transports::fdshare::fetch(&peer, pid, &key, &secret)
                .await
                .map_err(|e| e.to_string())?;
            ferry_transports::staged::StagingRx::open(fd).map_err(|e| e.to_string())
        };
        let link = self.link;
        ctx.spawn(
            self.setup
                .io
                .spawn(fetch)
                .into_actor(self)
                .map(move |opened, act, ctx| {
                    let opened = opened.map_err(|e| e.to_string()).and_then(|r| r);
                    let staging = match opened {
                        Ok(staging) if link == act.link => staging,
                        Ok(_) => return,
                        Err(why) => {
                            tracing::warn!(peer = %act.peer, "cannot map the peer's staging ring (its staged sends come over the link): {why}");
                            return;
                        }
                    };
                    let started = crate::staged::StagedRx::start(
                        &act.peer,
                        staging,
                        act.setup.staged.spin,
                        act.staging_device(),
                        Arc::clone(&act.regions),
                        (ctx.address().recipient(), link),
                        act.setup.io.clone(),
                    );
                    match started {
                        Ok(rx) => act.staged.rx = Some(rx),
                        Err(why) => tracing::warn!(peer = %act.peer, "no staged receiver thread: {why}"),
                    }
                }),
        );
    }
}

impl Handler<DataEvent> for TransferActor {
    type Result = ();
    fn handle(&mut self, event: DataEvent, ctx: &mut Self::Context) {
        match event {
            DataEvent::InboundDone { id, buffer } => self.completed(InboundId(id), buffer),
            DataEvent::InboundFailed { id, why } => {
                tracing::warn!(peer = %self.peer, id, "inbound transfer failed: {why}");
                self.session
                    .handle_reserve_failed(InboundId(id), WireReason::Unsupported, why);
            }
            DataEvent::StreamEnded { op, broken, link } => {
                if let Some(why) = broken.filter(|_| link == self.link) {
                    self.end_staged_tx();
                    self.session
                        .handle_link_lost(&format!("the staging ring failed: {why}"));
                }
                if let Some(entry) = self.outbound.get_mut(&op) {
                    // Every byte is on its way: wait for the peer's Done (or PutAck).
                    entry.phase = tracing::debug_span!(parent: &entry.span, "ack");
                }
                self.session.handle_stream_ended(op);
            }
            DataEvent::PeerBroke { link, why } => {
                if link == self.link {
                    note_protocol_violation();
                    self.staged.rx = None;
                    self.session
                        .handle_link_lost(&format!("the peer broke its staging ring: {why}"));
                }
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
        if msg.link != self.link {
            return;
        }
        if !self.welcomed && self.writer.is_some() {
            // The peer closed our dial before welcoming it: nothing was sent on it.
            return self.dial_refused(ctx);
        }
        if !self.session.is_lost() {
            if msg.why == PEER_LEFT {
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
        self.link_waiters.push(tx);
        self.drive(ctx);
        Box::pin(async move { rx.await.unwrap_or(Err(Error::ShuttingDown)) })
    }
}

impl Handler<Drain> for TransferActor {
    type Result = ResponseFuture<()>;
    fn handle(&mut self, _: Drain, ctx: &mut Self::Context) -> Self::Result {
        self.session.handle_drain();
        let (tx, rx) = oneshot::channel();
        self.drained.push(tx);
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
        if let Some(old) = self.writer.take() {
            let _ = old.try_send(Outgoing::Close);
        }
        self.link += 1;
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
    fn handle(&mut self, FromPeer(msg): FromPeer, ctx: &mut Self::Context) {
        match msg {
            Message::Welcome if !self.welcomed => {
                self.welcomed = true;
                return self.drive(ctx);
            }
            Message::Goodbye if !self.welcomed => return self.dial_refused(ctx),
            Message::StagedRing(StagedRing { key }) => {
                self.attach_staged_ring(key, ctx);
                return self.drive(ctx);
            }
            Message::IpcSetup(setup) => {
                self.on_ipc_setup(setup, ctx);
                return self.drive(ctx);
            }
            // We are the importer: the owner frees this buffer.
            Message::IpcUnmap(r) => {
                match self.ipc.imports.clone() {
                    None => self.ipc.out.push_back(Message::IpcUnmapped(r)),
                    Some(imports) => {
                        // A pull may hold the cache's lock through a copy, and freeing waits
                        // for the import's copies: neither on the actor thread.
                        let key = r.clone();
                        let freed = self.setup.io.spawn_blocking(move || {
                            let unmapped = imports
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .remove(&key);
                            drop(unmapped);
                            tracing::debug!(buffer = key.buffer, "unmapped at the owner's request");
                        });
                        ctx.spawn(freed.into_actor(self).map(move |_, act, ctx| {
                            act.ipc.out.push_back(Message::IpcUnmapped(r));
                            act.drive(ctx);
                        }));
                    }
                }
                return self.drive(ctx);
            }
            // We are the owner: the peer no longer maps this buffer.
            Message::IpcUnmapped(r) => {
                tracing::debug!(
                    buffer = r.buffer,
                    "the peer unmapped our buffer; freeing it"
                );
                self.ipc.unmapping.remove(&r);
                return self.drive(ctx);
            }
            // The peer no longer reads a buffer we offered for pulling.
            Message::Done(Done { transfer }) => {
                self.unexport(OpId(transfer));
            }
            Message::Cancel(ref cancel) if cancel.by_receiver => {
                self.unexport(OpId(cancel.transfer));
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

impl Handler<PutFinished> for TransferActor {
    type Result = ();
    fn handle(&mut self, msg: PutFinished, ctx: &mut Self::Context) {
        let ack = Message::PutAck(PutAck {
            put: msg.put,
            error: msg.error,
        });
        if let Some(w) = &self.writer
            && w.try_send(Outgoing::Frame(ack)).is_err()
        {
            self.session
                .handle_link_lost("the peer sends puts faster than it reads their acks");
        }
        self.drive(ctx);
    }
}

/// Sends frames and streams buffers until the queue closes or the socket fails. Every
/// stream it takes ends with a `StreamEnded`, after its view of the buffer was dropped.
/// Fetches and maps the lane ring the peer offered under `key` (none offered: `None`). A
/// lane that cannot be had is not an ipc failure: the peer sees we did not attach and
/// keeps the slow path.
async fn fetch_lane(
    peer: &str,
    pid: u32,
    key: Option<String>,
    secret: &Secret,
) -> Option<ferry_transports::link::ring::Ring> {
    let key = key?;
    let mapped = match ferry_transports::fdshare::fetch(peer, pid, &key, secret).await {
        Ok(fd) => ferry_transports::link::ring::Ring::open(fd).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    mapped
        .inspect_err(|why| tracing::warn!(peer, "cannot map the peer's fast lane: {why}"))
        .ok()
}

async fn write_loop(
    mut writer: LinkWriter,
    mut rx: mpsc::Receiver<Outgoing>,
    me: Addr<TransferActor>,
    chunk: usize,
    link: u64,
) {
    let mut failure: Option<LinkError> = None;
    while let Some(out) = rx.recv().await {
        match out {
            Outgoing::Frame(msg) => {
                // Frames queued together go out in one write, once the queue is empty.
                let sent = if rx.is_empty() {
                    writer.send(&msg).await
                } else {
                    writer.feed(&msg).await
                };
                if let Err(e) = sent {
                    failure = Some(e);
                    break;
                }
            }
            Outgoing::Stream {
                op,
                what,
                bytes,
                stop,
            } => {
                let result = stream(&mut writer, op, what, &bytes, &stop, chunk).await;
                drop(bytes);
                let _ = me
                    .send(DataEvent::StreamEnded {
                        op,
                        broken: None,
                        link,
                    })
                    .await;
                if let Err(e) = result {
                    failure = Some(e);
                    break;
                }
            }
            Outgoing::Close => {
                let _ = writer.send(&Message::Goodbye).await;
                let _ = writer.shutdown().await;
                break;
            }
        }
    }
    // Streams still queued end now, so their buffers go back to their owners.
    rx.close();
    while let Some(out) = rx.recv().await {
        if let Outgoing::Stream { op, bytes, .. } = out {
            drop(bytes);
            let _ = me
                .send(DataEvent::StreamEnded {
                    op,
                    broken: None,
                    link,
                })
                .await;
        }
    }
    if let Some(e) = failure {
        let _ = me
            .send(LinkDown {
                why: e.to_string(),
                link,
            })
            .await;
    }
}

async fn stream(
    writer: &mut LinkWriter,
    op: OpId,
    what: StreamWhat,
    bytes: &SharedBytes,
    stop: &AtomicBool,
    chunk: usize,
) -> Result<(), LinkError> {
    // What moves: the layout's packed bytes. A strided layout whose rows touch is the
    // buffer's first bytes (no gathering); another is gathered chunk by chunk.
    let (len, layout) = match what {
        StreamWhat::Transfer(layout) => {
            let packed = layout.check(bytes.len() as u64).map_err(io_error)?;
            let packed = usize::try_from(packed).map_err(io_error)?;
            (packed, Some(layout).filter(|l| !l.is_contiguous()))
        }
        StreamWhat::Put { .. } => (bytes.len(), None),
    };
    let parts: Vec<(usize, usize)> = region::chunks(len, chunk).collect();
    let header = |i: usize| match what {
        StreamWhat::Transfer(_) => tcp::data_header(op.0, parts[i]),
        StreamWhat::Put { key, offset } => {
            tcp::put_header(op.0, key, offset, parts[i], i + 1 == parts.len())
        }
    };
    let mut ahead = None;
    let streamed = match bytes.as_slice() {
        Some(host) => stream_host(writer, host, layout, &parts, &header, stop).await,
        None => stream_device(writer, bytes, layout, &parts, &header, stop, &mut ahead).await,
    };
    // A copy still running (the stream stopped or failed) holds a view of the buffer: wait
    // for it, so that the buffer goes back only once nothing reads it.
    if let Some(copy) = ahead.take() {
        let _ = copy.await;
    }
    streamed?;
    writer.flush().await
}

/// Streams `parts` of host memory: straight from the caller's buffer, or (strided rows)
/// gathered into one payload, one chunk at a time.
async fn stream_host(
    writer: &mut LinkWriter,
    host: &[u8],
    layout: Option<Layout>,
    parts: &[(usize, usize)],
    header: &impl Fn(usize) -> Message,
    stop: &AtomicBool,
) -> Result<(), LinkError> {
    let mut staging = Vec::new();
    for (i, &(at, n)) in parts.iter().enumerate() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let payload = match layout {
            Some(layout) => {
                staging.resize(n, 0);
                layout
                    .gather(host, at as u64, &mut staging)
                    .map_err(io_error)?;
                &staging[..]
            }
            None => &host[at..at + n],
        };
        writer.feed_chunk(&header(i), payload).await?;
    }
    Ok(())
}

/// A chunk of device memory being copied out on a blocking thread.
type CopyOut = tokio::task::JoinHandle<Result<Vec<u8>, String>>;

/// Streams `parts` of device memory, each copied out (a few 3D copies for strided rows) on
/// a blocking thread one chunk ahead of the socket: the copy of chunk k+1 runs while chunk
/// k is written. The copy still running when this returns is left in `ahead`.
async fn stream_device(
    writer: &mut LinkWriter,
    bytes: &SharedBytes,
    layout: Option<Layout>,
    parts: &[(usize, usize)],
    header: &impl Fn(usize) -> Message,
    stop: &AtomicBool,
    ahead: &mut Option<CopyOut>,
) -> Result<(), LinkError> {
    let copy_out = |(at, n): (usize, usize), mut into: Vec<u8>| {
        let bytes = bytes.clone();
        tokio::task::spawn_blocking(move || {
            into.resize(n, 0);
            match layout {
                Some(layout) => bytes.read_packed(&layout, at as u64, &mut into),
                None => bytes.read(at, &mut into),
            }
            .map_err(|e| format!("copying the device buffer out: {e}"))?;
            Ok(into)
        })
    };
    *ahead = parts.first().map(|&first| copy_out(first, Vec::new()));
    // Two chunk buffers take turns: one being written, one being filled.
    let mut spare = Vec::new();
    for i in 0..parts.len() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let copy = ahead
            .take()
            .ok_or_else(|| io_error("a chunk was not copied out"))?;
        let copied = copy.await.map_err(io_error)?.map_err(io_error)?;
        if let Some(&next) = parts.get(i + 1) {
            *ahead = Some(copy_out(next, std::mem::take(&mut spare)));
        }
        writer.feed_chunk(&header(i), &copied).await?;
        spare = copied;
    }
    Ok(())
}

/// A failure of the stream that is not the socket's, as the link error it ends with.
fn io_error(e: impl std::fmt::Display) -> LinkError {
    LinkError::Io(Arc::new(std::io::Error::other(e.to_string())))
}

/// Why a link ended when the peer said goodbye and closed it: a clean departure.
const PEER_LEFT: &str = "the peer said goodbye and closed the connection";

struct ReadLoop {
    me: Addr<TransferActor>,
    regions: Arc<DashMap<u64, InboundRegion>>,
    exposed: Arc<DashMap<u64, ExposedRegion>>,
    counters: Arc<LinkCounters>,
    link: u64,
}

impl ReadLoop {
    /// Reads until the link ends; a peer that breaks the protocol is dropped.
    async fn run(self, mut reader: LinkReader) {
        let mut put_errors: HashMap<u64, String> = HashMap::new();
        // A peer that says goodbye before it closes left on purpose.
        let mut said_goodbye = false;
        let mut put_bytes: Vec<u8> = Vec::new();
        let mut scratch: Vec<u8> = Vec::new();
        let why = loop {
            // Any frame that fails its checks ends the link: on a byte stream, the bytes
            // around a bad frame cannot be trusted either, and every transfer on the link
            // fails at once with the reason, rather than waiting for its deadline.
            let frame = match reader.next().await {
                Ok(Some(frame)) => frame,
                Ok(None) if said_goodbye => break PEER_LEFT.to_string(),
                Ok(None) => break "the peer closed the connection".to_string(),
                Err(e) => break format!("{e}"),
            };
            let msg = match frame.message() {
                Ok(m) => m,
                Err(e) => {
                    self.counters.record_rejected(&e);
                    break format!("peer sent a bad frame: {e}");
                }
            };
            said_goodbye |= matches!(msg, ArchivedMessage::Goodbye);
            match msg {
                ArchivedMessage::Data(chunk) => {
                    let chunk = ferry_transports::wire::DataChunk::from(chunk);
                    let id = chunk.transfer;
                    // The buffer is lent out of the map while its bytes arrive, so the map
                    // is never locked across a socket read.
                    let lent = self.regions.get_mut(&id).map(|mut r| r.lend(&chunk));
                    let mut landing = match lent {
                        Some(Ok(landing)) => landing,
                        Some(Err(e)) => {
                            note_protocol_violation();
                            break format!("protocol violation: {e}");
                        }
                        // A chunk of a transfer cancelled meanwhile: read past its bytes.
                        None => match reader.discard_payload(chunk.len).await {
                            Ok(()) => continue,
                            Err(e) => break format!("{e}"),
                        },
                    };
                    // Host memory takes the bytes straight from the socket; device memory
                    // (a staged transfer from another host) through `scratch`, then one
                    // host-to-device copy.
                    let received = if landing.is_host() {
                        reader.read_payload_into(landing.destination()).await
                    } else {
                        // Never larger than a frame (the payload's own header says the same
                        // before a byte is read; checked first so that a lying header
                        // allocates nothing).
                        if chunk.len > reader.max_frame() {
                            note_protocol_violation();
                            break format!(
                                "protocol violation: a chunk of {} bytes, past the largest frame",
                                chunk.len
                            );
                        }
                        scratch.resize(chunk.len as usize, 0);
                        reader.read_payload_into(&mut scratch[..]).await
                    };
                    if let Err(e) = received {
                        // Damaged bytes may now be in the buffer: the transfer must not be
                        // delivered. Dropping the link fails it at both ends and frees the
                        // buffer (the peer sees it lost; nothing is retried here).
                        break format!("chunk of transfer {id} not received: {e}");
                    }
                    // A host-to-device copy waits for the copy engine: the runtime's other
                    // worker takes this one's tasks meanwhile.
                    if !landing.is_host()
                        && let Err(e) = tokio::task::block_in_place(|| {
                            landing.write(&scratch[..chunk.len as usize])
                        })
                    {
                        // Not the peer's fault, but the transfer cannot complete; like a
                        // damaged chunk, it fails at both ends.
                        break format!("copying a chunk of transfer {id} in: {e}");
                    }
                    if let Some(buffer) = restore_landing(&self.regions, id, landing)
                        && self
                            .me
                            .send(DataEvent::InboundDone { id, buffer })
                            .await
                            .is_err()
                    {
                        break "node stopped".into();
                    }
                }
                ArchivedMessage::Put(chunk) => {
                    let chunk = ferry_transports::wire::PutChunk::from(chunk);
                    let put = chunk.put;
                    let len = chunk.len as usize;
                    // Where the bytes go is checked before they are read; a refused put's
                    // bytes are read past. Accepted ones land in `put_bytes` first: the
                    // exposed map is shared with every peer and with `withdraw`, so it is
                    // not locked across a socket read, and damaged bytes never reach it.
                    let checked = exposed_destination(&self.exposed, &chunk, |_| ());
                    let received = match checked {
                        Ok(()) => {
                            if put_bytes.len() < len {
                                put_bytes.resize(len, 0);
                            }
                            reader.read_payload_into(&mut put_bytes[..len]).await
                        }
                        Err(e) => {
                            if let Err(why) = note_put_error(&mut put_errors, put, e) {
                                break why;
                            }
                            reader.discard_payload(chunk.len).await
                        }
                    };
                    let placed = match received {
                        Ok(()) => exposed_destination(&self.exposed, &chunk, |dst| {
                            dst.copy_from_slice(&put_bytes[..len])
                        }),
                        Err(e) => break format!("{e}"),
                    };
                    if let Err(e) = placed
                        && let Err(why) = note_put_error(&mut put_errors, put, e)
                    {
                        break why;
                    }
                    if chunk.last {
                        let error = put_errors.remove(&put);
                        if self.me.send(PutFinished { put, error }).await.is_err() {
                            break "node stopped".into();
                        }
                    }
                }
                _ => {
                    let owned = match frame.to_owned_message() {
                        Ok(m) => m,
                        Err(e) => break format!("undecodable frame: {e}"),
                    };
                    // Queued without waiting for the actor to handle it when its mailbox
                    // has room (first in, first out, so frames keep their order); a full
                    // mailbox makes the reader wait, and with it the socket. Data chunks
                    // never depend on a control frame still queued: a chunk's region exists
                    // before the grant that lets the peer send it.
                    match self.me.try_send(FromPeer(owned)) {
                        Ok(()) => {}
                        Err(actix::prelude::SendError::Full(msg)) => {
                            if self.me.send(msg).await.is_err() {
                                break "node stopped".into();
                            }
                        }
                        Err(actix::prelude::SendError::Closed(_)) => break "node stopped".into(),
                    }
                }
            }
        };
        let link = self.link;
        let _ = self.me.send(LinkDown { why, link }).await;
    }
}

/// The static label of a transport named on the wire.
fn transport_label(name: &str) -> &'static str {
    name.parse::<ferry_config::TransportName>()
        .map_or("unknown", ferry_config::TransportName::as_str)
}

fn note_protocol_violation() {
    metrics::counter!("ferry_frames_rejected_total", "reason" => "protocol").increment(1);
}

/// Runs `place` on where `chunk`'s bytes go in its exposed region, or says why they cannot
/// go there (not exposed, stale generation, out of bounds). Holds the region's map entry
/// only for the call.
fn exposed_destination(
    exposed: &DashMap<u64, ExposedRegion>,
    chunk: &ferry_transports::wire::PutChunk,
    place: impl FnOnce(&mut [u8]),
) -> Result<(), String> {
    let Some(mut region) = exposed.get_mut(&chunk.region) else {
        return Err(format!("region {} is not exposed", chunk.region));
    };
    region
        .destination(chunk)
        .map(place)
        .map_err(|e| e.to_string())
}

/// Remembers the first error of `put`, reported in its ack; fails (ending the link) when
/// too many puts are failing at once.
fn note_put_error(
    put_errors: &mut HashMap<u64, String>,
    put: u64,
    error: String,
) -> Result<(), String> {
    if put_errors.len() >= 1024 && !put_errors.contains_key(&put) {
        return Err("too many failing puts open at once".into());
    }
    put_errors.entry(put).or_insert(error);
    Ok(())
}
