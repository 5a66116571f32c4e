//! A transport's part of one peer's session: the seam between the peer's actor (the shell:
//! the session, the link, timers, spans, the op table) and one transport. The shell holds
//! one part per transport the node serves, made by the transport ([`Transport::open`]), and
//! calls a part at each step that depends on the transport, and nowhere else:
//!
//! | step | part |
//! | --- | --- |
//! | a link comes up | [`PeerTransport::attach`] |
//! | a send wants the transport | [`PeerTransport::admit`] (its setup with the peer) |
//! | the peer's part says something | [`PeerTransport::handle_message`] |
//! | a send is pulled | [`PeerTransport::export`], then [`PeerTransport::keep`] |
//! | the peer lets go, or gives up | [`PeerTransport::released`], [`PeerTransport::cancelled`] |
//! | an offer to pull | [`PeerTransport::lands_in_device`], then [`PeerTransport::pull`] |
//! | a grant lends a buffer | [`PeerTransport::write`] |
//! | a push to us | [`PeerTransport::lender`] ([`Lend`], [`LentMemory`]) |
//! | a granted send streams | [`PeerTransport::stream`] |
//! | the session ends | [`PeerTransport::close`] |
//!
//! and after each turn it takes what the part has for it: messages for the peer's part
//! ([`PeerTransport::poll_message`], framed as one [`crate::wire::Message::Transport`]),
//! events ([`PeerTransport::poll_event`]) and its next timer
//! ([`PeerTransport::poll_timeout`]). Long work (a copy, a registration, a read) comes back
//! as a future the shell spawns; work a part runs on its own (an import, a thread) tells the
//! shell through its [`PeerEnv::wake`], and the part answers at the next poll. No part waits
//! on the shell's thread, and no part knows another.
//!
//! [`Transport::open`]: super::Transport::open

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use ferry_config::TransportName;

use super::setup::{SetupFailure, SetupOutcome};
use super::{
    Deliveries, Descriptor, DescriptorError, EagerGate, EagerTerms, FastPath, OpId, ReceiveMemory,
};
use crate::gpus::SharedGpus;
use crate::link::{Activity, Secret};
use crate::memory::{Buffer, MemoryKind, SharedBytes};
use crate::region::InboundRegion;
use crate::wire::{Hello, Layout};

/// A transfer's bytes on their way: a future the shell spawns.
pub type Moving<T> = futures::future::BoxFuture<'static, Result<T, TransportError>>;

/// Tells a peer's actor to poll its parts again (work a part ran on its own ended). Cheap
/// and idempotent: wakes that come together are one poll.
pub type Wake = Arc<dyn Fn() + Send + Sync>;

/// The inbound regions of a session, by the peer's transfer id: where a granted transfer's
/// bytes land, whoever writes them (the link's reader, a transport's own thread).
pub type Regions = Arc<dashmap::DashMap<u64, InboundRegion>>;

/// Why a transport could not move the bytes (or make a buffer readable, or lend one). The
/// words say what failed; `source` keeps the transport's own error.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{what}")]
pub struct TransportError {
    what: String,
    #[source]
    source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl TransportError {
    /// An error saying `what`.
    pub fn new(what: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            source: None,
        }
    }

    /// The transport's own error, its words first.
    pub fn of(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self {
            what: error.to_string(),
            source: Some(Arc::new(error)),
        }
    }

    /// `what`, caused by `error`.
    pub fn because(
        what: impl Into<String>,
        error: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            what: format!("{}: {error}", what.into()),
            source: Some(Arc::new(error)),
        }
    }

    /// The transport's own error, if it is a `E`.
    pub fn cause<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.source.as_deref()?.downcast_ref()
    }
}

impl From<DescriptorError> for TransportError {
    fn from(e: DescriptorError) -> Self {
        Self::because("the peer's descriptor of its buffer", e)
    }
}

/// What a part may use of the node: services, never another transport's settings.
#[derive(Clone)]
pub struct PeerEnv {
    /// This node's name.
    pub node: String,
    /// The peer's name.
    pub peer: String,
    /// The node's I/O runtime (long work runs there, blocking work on its blocking pool).
    pub io: tokio::runtime::Handle,
    /// The node's GPUs (empty without any).
    pub gpus: SharedGpus,
    /// The link secret, which also authenticates the fd-sharing socket.
    pub secret: Secret,
    /// The receive tiers, for a part that lands transfers on its own (a lane).
    pub memory: Arc<dyn ReceiveMemory>,
    /// The host receive tiers alone, for a part that lands host transfers on its own.
    pub host_memory: Arc<dyn ReceiveMemory>,
    /// The inbox in the peer's order, for a part that delivers on its own (a lane).
    pub deliveries: Arc<dyn Deliveries>,
    /// The peer's share of this node's memory (`limits.peer_inbound_bytes`).
    pub share: u64,
    /// How long an inbound transfer may wait for memory (`limits.reserve_timeout`).
    pub reserve_timeout: Duration,
    /// How long memory a lost peer may still touch stays unused
    /// (`memory.export_lease_timeout`).
    pub lease_timeout: Duration,
    /// Transfers in flight to the peer at once (`limits.pipeline_depth`).
    pub in_flight: usize,
    /// `limits.stall_timeout`.
    pub stall: Duration,
    /// Tells the shell to poll the part again.
    pub wake: Wake,
}

/// A link that came up, as a part sees it.
pub struct Attached<'a> {
    /// The peer's hello.
    pub hello: &'a Hello,
    /// The peer runs on this host.
    pub same_host: bool,
    /// The link's number in the session (a part's work for an older link is stale).
    pub link: u64,
    /// The link's byte counters (a part moving bytes beside the link adds to them).
    pub activity: Activity,
    /// The session's inbound regions (a part landing chunks on its own writes there).
    pub regions: Regions,
}

/// A send wants the transport: how its setup with the peer answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Go now.
    Ready,
    /// Wait for the setup: [`PartEvent::Proceed`] or [`PartEvent::FallBack`] with this
    /// ticket says how it went.
    Queued(u64),
    /// Take the rule's next transport: the setup failed, for this reason.
    FallBack(SetupFailure),
}

/// What a part asks of the shell.
pub enum PartEvent {
    /// The part's setup with the peer settled: routes follow it, `ferry explain` says it.
    Settled(SetupOutcome),
    /// A send admitted with this ticket may go now.
    Proceed(u64),
    /// A send admitted with this ticket takes the rule's next transport, because of this.
    FallBack(u64, SetupFailure),
    /// The part opened a way around the session for sends to the peer: the node tries it
    /// first (within the rules).
    FastPath(Arc<dyn FastPath>),
    /// The link must end: the peer broke what the part asked of it, or did not answer in
    /// time (the words say which).
    Broke(String),
    /// A granted inbound transfer is complete (its bytes came through the part's channel).
    InboundDone {
        /// The peer's transfer id.
        id: u64,
        /// Where the bytes are.
        buffer: Buffer,
    },
    /// A granted inbound transfer failed in the part's channel.
    InboundFailed {
        /// The peer's transfer id.
        id: u64,
        /// Why.
        why: String,
    },
    /// A stream the part carried ([`Streaming::Started`]) ended: every byte is on its way
    /// (`broken` is `None`), or its channel broke.
    StreamEnded {
        /// The op.
        op: OpId,
        /// Why the channel broke.
        broken: Option<String>,
    },
    /// A stream the part held back ([`Streaming::Held`]) goes over the link after all.
    StreamOverLink(OpId),
}

/// How [`PeerTransport::stream`] answers.
pub enum Streaming {
    /// The shell's link writer streams the bytes (as tcp does).
    OverLink,
    /// The part streams them on its own channel; [`PartEvent::StreamEnded`] follows.
    Started,
    /// The part holds them until its channel is ready (or its patience ends):
    /// [`PartEvent::StreamEnded`] or [`PartEvent::StreamOverLink`] follows.
    Held,
}

/// A buffer made readable for the peer's pull: what the offer carries, and what must be
/// kept until the peer lets go.
pub struct Exported {
    /// Where the peer reads.
    pub descriptor: Descriptor,
    /// The part's own keeping (a registration), if any.
    pub kept: Option<Box<dyn Send>>,
}

/// How [`PeerTransport::export`] answers.
pub enum Exporting {
    /// Made.
    Now(Result<Exported, TransportError>),
    /// Being made (a blocking registration); the sends behind it wait, in order.
    Later(futures::future::BoxFuture<'static, Result<Exported, TransportError>>),
}

/// Lends our memory to a peer's pushes over one transport.
pub trait Lend: Send + Sync {
    /// Whether `buffer` is lent (else the push's bytes stream over the link).
    fn lends<'a>(&'a self, buffer: &'a Buffer) -> futures::future::BoxFuture<'a, bool>;

    /// Lends `buffer` (may block: an export or a registration): what the grant carries, or
    /// why it cannot be lent.
    ///
    /// # Errors
    /// Why the buffer cannot be lent.
    fn lend(&self, buffer: Buffer) -> Result<(Box<dyn LentMemory>, Descriptor), TransportError>;
}

/// One buffer lent to the peer's push, until it says `Written`.
pub trait LentMemory: Send + std::fmt::Debug {
    /// The memory it is.
    fn kind(&self) -> MemoryKind;

    /// Whether [`give_back`](Self::give_back) blocks (a deregistration): then it runs on a
    /// blocking thread.
    fn give_back_blocks(&self) -> bool;

    /// The buffer, lent no more: the peer said `Written`.
    fn give_back(self: Box<Self>) -> Buffer;

    /// It goes unused: the push failed (`written`: the peer said so), or the session ended
    /// while the peer may still write it.
    fn retire(self: Box<Self>, written: bool) -> Retired;
}

/// A buffer lent to the peer's push as it is (nothing registered for it: ipc's device
/// memory, shm's pool memory), given back whole; what becomes of it when the peer may
/// still write it is `unwritten`'s word.
#[derive(Debug)]
pub struct LentBuffer {
    buffer: Buffer,
    unwritten: fn(Buffer) -> Retired,
}

impl LentBuffer {
    /// `buffer`, lent; retired unwritten by `unwritten` (`Retired::Quarantine` of its
    /// bytes, say, or `Retired::Hold` of it).
    pub fn new(buffer: Buffer, unwritten: fn(Buffer) -> Retired) -> Self {
        Self { buffer, unwritten }
    }
}

impl LentMemory for LentBuffer {
    fn kind(&self) -> MemoryKind {
        self.buffer.kind()
    }

    fn give_back_blocks(&self) -> bool {
        false
    }

    fn give_back(self: Box<Self>) -> Buffer {
        self.buffer
    }

    /// After a push the peer said ended, it goes at once (the peer's copy ended before its
    /// `Written`); otherwise as `unwritten` says (the peer may still be copying).
    fn retire(self: Box<Self>, written: bool) -> Retired {
        if written {
            Retired::Gone
        } else {
            (self.unwritten)(self.buffer)
        }
    }
}

/// What goes when something the peer may still touch is given up.
pub enum Retired {
    /// Nothing left to do.
    Gone,
    /// Dropped (on a blocking thread) after the longest a transfer in flight may take
    /// (`memory.export_lease_timeout`): a registration the transport may still serve.
    Hold(Box<dyn Send>),
    /// Device memory the peer may still map: its domain's quarantine takes it.
    Quarantine(SharedBytes),
}

/// One transport's part of one peer's session (see the module's table). Decisions and
/// bookkeeping only: long work comes back as futures the shell spawns, messages as bytes
/// the shell frames, time is passed in.
pub trait PeerTransport: Send {
    /// The transport.
    fn transport(&self) -> TransportName;

    // -- control plane -----------------------------------------------------------------

    /// A new link: whether this node takes the peer's offers over this transport on it.
    fn attach(&mut self, link: &Attached<'_>) -> bool;

    /// A send over this transport wants to go.
    fn admit(&mut self, _now: Instant) -> Admission {
        Admission::Ready
    }

    /// A message from the peer's part (the body of a `Message::Transport`).
    ///
    /// # Errors
    /// When it is not a message of this transport: the peer broke the protocol.
    fn handle_message(&mut self, _body: &[u8], _now: Instant) -> Result<(), DescriptorError> {
        Err(DescriptorError(format!(
            "{} sends no messages of its own",
            self.transport()
        )))
    }

    /// The next message for the peer's part (the body; the shell frames it).
    fn poll_message(&mut self) -> Option<Vec<u8>> {
        None
    }

    /// The next thing the shell must do.
    fn poll_event(&mut self) -> Option<PartEvent> {
        None
    }

    /// When [`handle_timeout`](Self::handle_timeout) must be called next, if ever.
    fn poll_timeout(&self) -> Option<Instant> {
        None
    }

    /// Time passed.
    fn handle_timeout(&mut self, _now: Instant) {}

    /// The link is lost (the session ends once its ops have): what runs beside the link
    /// stops (a lane, a ring), so nobody waits on a dead peer's.
    fn detach(&mut self) {}

    /// True while the part waits on the peer (a setup step): the link's half-open rule
    /// holds it to answering.
    fn awaits_peer(&self) -> bool {
        false
    }

    /// What the part has to say of itself for a diagnostic (`what` names it: ucx's
    /// `"lanes"`, say); `None` when it knows nothing of the kind.
    fn inspect(
        &self,
        _what: &str,
    ) -> Option<
        futures::future::BoxFuture<'static, Result<Box<dyn std::any::Any + Send>, TransportError>>,
    > {
        None
    }

    // -- data plane ---------------------------------------------------------------------

    /// Makes `buffer` readable by the peer for a pull (an export or a registration): now,
    /// or as a future.
    fn export(&mut self, _buffer: &Buffer, _layout: &Layout) -> Exporting {
        let no = TransportError::new(format!("{} does not pull", self.transport()));
        Exporting::Now(Err(no))
    }

    /// A push over this transport to this peer goes as a pull instead (a node of this
    /// process reads our memory directly: the same copy, with nothing to lend).
    fn pulls_pushes(&self) -> bool {
        false
    }

    /// Keeps what `export` made for op `op` (`kept`) until the peer lets go; `buffer` is
    /// the op's.
    fn keep(&mut self, _op: OpId, _kept: Option<Box<dyn Send>>, _buffer: &Buffer) {}

    /// The peer no longer reads op `op`'s buffer (`Done`, or the op ended before its offer
    /// left): what was kept for it goes.
    fn released(&mut self, _op: OpId) {}

    /// The peer gave op `op` up (`Cancel`): reads it started may still be under way.
    fn cancelled(&mut self, op: OpId) {
        self.released(op);
    }

    /// Whether a transfer this transport reads or writes may land in device memory (else
    /// in a host tier).
    fn lands_in_device(&self) -> bool {
        false
    }

    /// Copies the bytes the peer's descriptor `source` names (laid out as `layout` in its
    /// memory) into `into`.
    fn pull(&mut self, _source: &Descriptor, _layout: Layout, _into: Buffer) -> Moving<Buffer> {
        let no = TransportError::new(format!("{} does not pull", self.transport()));
        Box::pin(std::future::ready(Err(no)))
    }

    /// Writes `bytes` (laid out as `layout`) into the buffer the peer lent as `target`,
    /// checking `stop` between pieces; resolves once every byte is at the peer.
    fn write(
        &mut self,
        _target: &Descriptor,
        _bytes: SharedBytes,
        _layout: Layout,
        _stop: Arc<AtomicBool>,
    ) -> Moving<()> {
        let no = TransportError::new(format!("{} writes no lent memory", self.transport()));
        Box::pin(std::future::ready(Err(no)))
    }

    /// What lends our memory to the peer's pushes over this transport; `None` when this
    /// node cannot.
    fn lender(&self) -> Option<Arc<dyn Lend>> {
        None
    }

    /// A granted send of op `op` streams its `bytes` (laid out as `layout`): over the link,
    /// or on the part's own channel.
    fn stream(
        &mut self,
        _op: OpId,
        _bytes: SharedBytes,
        _layout: &Layout,
        _stop: Arc<AtomicBool>,
        _now: Instant,
    ) -> Streaming {
        Streaming::OverLink
    }

    /// What the peer takes eagerly over the link from this transport's sends (its hello's
    /// terms, bounded by what this node uses), once a link is attached.
    fn peer_eager(&self) -> Option<EagerTerms> {
        None
    }

    /// The current link's eager credit at this end, which the link's reader takes the
    /// peer's eager offers through; `None` when this transport grants none.
    fn eager_gate(&self) -> Option<Arc<dyn EagerGate>> {
        None
    }

    /// Bytes per data frame when this transport's sends stream over the link.
    fn link_chunk(&self) -> Option<usize> {
        None
    }

    /// The session ends: what the peer may still touch is held or quarantined, each under
    /// the op it was kept for.
    fn close(&mut self) -> Vec<(OpId, Retired)>;
}
