//! A transport's part of one peer's session: the seam between the peer's actor (the shell:
//! the session, the link, timers, spans, the op table) and a transport that moves a
//! transfer's bytes through memory rather than as frames over the link (ipc, ucx).
//!
//! The shell calls a part at each step that depends on the transport, and nowhere else:
//!
//! | step | shell | part |
//! | --- | --- | --- |
//! | a link comes up | [`TransferActor::attach_parts`] | [`PeerPart::attach`] |
//! | a send is pulled | `queue_submit` | [`PeerPart::export`], then [`PeerPart::keep`] |
//! | the peer lets go, or gives up | `FromPeer` (`Done`, `Cancel`) | [`PeerPart::released`], [`PeerPart::cancelled`] |
//! | an offer to pull | `reserve`, then `start_pull` | [`PeerPart::lands_in_device`], then [`PeerPart::pull`] |
//! | a grant lends a buffer | `start_write` | [`PeerPart::write`] |
//! | a push to us | `reserve` | [`PeerPart::lender`] ([`Lend`], [`LentMemory`]) |
//! | the session ends | `stopped` | [`PeerPart::close`] |
//!
//! Long work (a copy, a registration, a read) comes back as a future that the shell spawns
//! and whose result it hands to the session: no part waits on the actor's thread. The parts
//! of a session are listed in one place, [`TransferActor::parts`]. What stays outside the
//! seam: the ipc setup (`per_peer_setup`: the pool import and the fast lane, `peer/ipc.rs`)
//! and the staged ring (`peer/staged_ring.rs`), which are control planes of their own.

use super::*;
use ferry_transports::memory::MemoryKind;

/// A transfer's bytes on their way: a future the shell spawns.
pub(super) type Moving<T> = futures::future::LocalBoxFuture<'static, Result<T, MoveError>>;

/// What a part may use of the session: the peer and the node's setup.
pub(super) struct PartCx<'a> {
    /// The peer's name.
    pub(super) peer: &'a str,
    /// The node's setup.
    pub(super) setup: &'a TransferSetup,
}

/// A transport's part of one peer's session (see the module's table).
pub(super) trait PeerPart {
    /// The transport.
    fn transport(&self) -> ferry_config::TransportName;

    /// A new link, whose peer said `hello`: whether this node takes the peer's offers over
    /// this transport on it.
    fn attach(&mut self, hello: &ferry_transports::wire::Hello, cx: &PartCx) -> bool;

    /// Makes `buffer` readable by the peer for a pull (an export or a registration): now,
    /// or as a future (a blocking registration; the sends behind it wait, in order).
    fn export(&mut self, buffer: &Buffer, layout: &Layout, cx: &PartCx) -> Exporting;

    /// A push over this transport to this peer goes as a pull instead (a node of this
    /// process reads our memory directly over ipc: the same copy, with nothing to lend).
    fn pulls_pushes(&self) -> bool {
        false
    }

    /// Keeps what `export` made for op `op` until the peer lets go (`buffer` is the op's;
    /// `me`, the session's actor, for work that comes back to it later).
    fn keep(
        &mut self,
        op: OpId,
        exported: (Exported, &Buffer),
        me: &Addr<TransferActor>,
        cx: &PartCx,
    );

    /// The peer no longer reads op `op`'s buffer (`Done`, or the op ended before its offer
    /// left): what was kept for it goes.
    fn released(&mut self, op: OpId, cx: &PartCx);

    /// The peer gave op `op` up (`Cancel`): reads it started may still be under way.
    fn cancelled(&mut self, op: OpId, cx: &PartCx) {
        self.released(op, cx);
    }

    /// Whether a transfer this transport reads or writes may land in device memory (else
    /// in a host tier).
    fn lands_in_device(&self, cx: &PartCx) -> bool;

    /// Copies the bytes of `source` (laid out as `layout` in the peer's memory) into
    /// `buffer`.
    fn pull(
        &mut self,
        source: PullSource,
        layout: Layout,
        buffer: Buffer,
        cx: &PartCx,
    ) -> Moving<Buffer>;

    /// Writes `bytes` (laid out as `layout`) into the buffer the peer lent as `target`,
    /// checking `stop` between pieces; resolves once every byte is at the peer.
    fn write(
        &mut self,
        target: PushTarget,
        bytes: (SharedBytes, Layout),
        stop: Arc<AtomicBool>,
        cx: &PartCx,
    ) -> Moving<()>;

    /// What lends our memory to the peer's pushes over this transport; `None` when this
    /// node cannot (its engine is gone).
    fn lender(&self, cx: &PartCx) -> Option<Arc<dyn Lend>>;

    /// The session ends: what the peer may still touch is held or quarantined, each under
    /// the id of the op it was kept for.
    fn close(&mut self, cx: &PartCx) -> Vec<(u64, Retired)>;
}

/// A buffer made readable for the peer's pull: what the offer names, and what must be kept
/// until the peer lets go.
pub(super) struct Exported {
    /// Where the peer reads.
    pub(super) source: PullSource,
    /// The part's own keeping (a registration), if any.
    pub(super) kept: Option<Box<dyn Send>>,
}

/// How [`PeerPart::export`] answers.
pub(super) enum Exporting {
    /// Made.
    Now(Result<Exported, Error>),
    /// Being made.
    Later(futures::future::LocalBoxFuture<'static, Result<Exported, Error>>),
}

/// Lends our memory to a peer's pushes over one transport.
pub(super) trait Lend: Send + Sync {
    /// Whether `buffer` is lent (else the push's bytes stream over the link).
    fn lends<'a>(&'a self, buffer: &'a Buffer) -> futures::future::BoxFuture<'a, bool>;

    /// Lends `buffer` (may block: an export or a registration): what the grant names, or
    /// why it cannot be lent.
    fn lend(&self, buffer: Buffer) -> Result<(Box<dyn LentMemory>, PushTarget), String>;
}

/// One buffer lent to the peer's push, until it says `Written`.
pub(super) trait LentMemory: Send + std::fmt::Debug {
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

/// What goes when something the peer may still touch is given up.
pub(super) enum Retired {
    /// Nothing left to do.
    Gone,
    /// Dropped (on a blocking thread) after the longest a transfer in flight may take
    /// (`memory.export_lease_timeout`): a registration UCX may still serve.
    Hold(Box<dyn Send>),
    /// Device memory the peer may still map: its domain's quarantine takes it.
    Quarantine(SharedBytes),
}

/// Why a pull or a push failed, by the transport that moved the bytes.
#[derive(Debug, thiserror::Error)]
pub(super) enum MoveError {
    /// The ipc copy.
    #[error(transparent)]
    Ipc(#[from] ferry_transports::ipc::IpcError),
    /// The UCX read or write.
    #[error(transparent)]
    Ucx(#[from] ferry_transports::ucx::UcxTransportError),
    /// The peer's descriptor of its buffer is not one the transport reads.
    #[error("the peer's descriptor of its buffer: {0}")]
    Descriptor(#[from] ferry_transports::transport::DescriptorError),
    /// The task that ran it.
    #[error("the task that moved the bytes failed: {0}")]
    Task(String),
}

impl TransferActor {
    /// The transport parts of this session with what they may use: the one list of them.
    /// A transport that moves bytes through memory adds its part here.
    pub(super) fn parts(&mut self) -> ([&mut dyn PeerPart; 2], PartCx<'_>) {
        let cx = PartCx {
            peer: &self.peer,
            setup: &self.setup,
        };
        ([&mut self.ipc, &mut self.ucx], cx)
    }

    /// The part of `transport` with what it may use; `None` for a transport that moves
    /// bytes over the link.
    pub(super) fn part(
        &mut self,
        transport: ferry_config::TransportName,
    ) -> Option<(&mut dyn PeerPart, PartCx<'_>)> {
        let (parts, cx) = self.parts();
        let part = parts.into_iter().find(|p| p.transport() == transport)?;
        Some((part, cx))
    }

    /// A new link: every part hears the peer's hello, and the session learns which
    /// transports take the peer's offers.
    pub(super) fn attach_parts(&mut self, hello: &ferry_transports::wire::Hello) {
        let (parts, cx) = self.parts();
        let serves: Vec<_> = parts
            .into_iter()
            .map(|p| (p.transport(), p.attach(hello, &cx)))
            .collect();
        for (transport, serves) in serves {
            self.session.set_serves(transport, serves);
        }
    }

    /// Hands what went with the session to where it waits out the peer: held
    /// registrations are dropped later; device memory goes to its domain's quarantine
    /// (returned).
    pub(super) fn retire(
        &self,
        retired: Vec<(u64, Retired)>,
    ) -> Vec<(Addr<crate::allocator::Allocator>, OpId, SharedBytes)> {
        let mut exports = Vec::new();
        let mut held = Vec::new();
        for (id, r) in retired {
            match r {
                Retired::Gone => {}
                Retired::Hold(what) => held.push(what),
                Retired::Quarantine(view) => {
                    if let MemoryKind::Device(n) = view.lease().kind
                        && let Some(domain) = self.setup.gpus.domain(n)
                    {
                        exports.push((domain.actor.clone(), OpId(id), view));
                    }
                }
            }
        }
        if !held.is_empty() {
            hold_then_drop(&self.setup, held);
        }
        exports
    }
}

/// Hands `exports` to their domains' quarantine: the peer may still map them (its session
/// `epoch` ends them; the export ids carry it).
pub(super) async fn quarantine(
    exports: Vec<(Addr<crate::allocator::Allocator>, OpId, SharedBytes)>,
    peer: String,
    epoch: u64,
) {
    for (allocator, op, view) in exports {
        let export = Export {
            id: ExportId(epoch << 40 | op.0),
            peer: peer.clone(),
            view,
        };
        let _ = allocator.send(export).await;
    }
}

/// A pull or a write handed to the wrong transport's part (the session names the
/// transport of every source and target, so this is a bug).
pub(super) fn foreign<T: 'static>(transport: ferry_config::TransportName) -> Moving<T> {
    let why = MoveError::Task(format!("a {transport} transfer reached another transport"));
    Box::pin(std::future::ready(Err(why)))
}

/// Drops `what` on a blocking thread after the longest a transfer in flight may take
/// (`memory.export_lease_timeout`): UCX may still serve a read or apply a write into a
/// registration until then.
pub(super) fn hold_then_drop<T: Send + 'static>(setup: &TransferSetup, what: Vec<T>) {
    let hold = setup.ucx_hold;
    setup.io.spawn(async move {
        tokio::time::sleep(hold).await;
        let _ = tokio::task::spawn_blocking(move || drop(what)).await;
    });
}
