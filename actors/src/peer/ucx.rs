//! The ucx transport's part of a peer: the endpoint to the peer's UCX worker (connected on
//! the first pull from it, from the address in its hello), our buffers registered for the
//! peer to read until it lets go, and pulls out of the peer's.
//!
//! Every UCX call that waits (registering, unregistering, connecting, the reads) runs off
//! the actor thread: registrations on a blocking thread while this actor's mailbox waits
//! (sends keep their order), reads as tasks on the node's I/O runtime.

use super::*;
use ferry_config::TransportName;
use ferry_transports::transport::Viability;
use ferry_transports::ucx::{EndpointLanes, Engine, Exported, UcxPeer, UcxTransportError};
use ferry_transports::wire::UcxSource;

/// The ucx state of one peer.
#[derive(Default)]
pub(super) struct UcxState {
    /// The peer's UCX worker address, from its hello (empty: it does not serve ucx).
    pub(super) address: Vec<u8>,
    /// Our endpoint to the peer's worker, made by the first pull on this link.
    pub(super) endpoint: Arc<tokio::sync::OnceCell<Arc<UcxPeer>>>,
    /// Pull offers from the peer, with the layout of the bytes in its buffer, by inbound
    /// transfer, until the pull ends.
    pub(super) sources: HashMap<InboundId, (UcxSource, Layout)>,
    /// Our buffers registered for the peer to read, until it says `Done` or `Cancel`, or
    /// the link goes.
    pub(super) exported: HashMap<OpId, Exported>,
    /// Whether the lanes of our endpoint to the peer were reported (logged, and counted
    /// when emulated over tcp): once per peer, after the first pull that completed.
    lanes_reported: bool,
    /// Whether we said that the peer's ucx pushes stream over the link (once per peer).
    pushes_streamed: Arc<AtomicBool>,
}

/// What lending memory to the peer's ucx pushes takes: the engine, and whether the peer's
/// writes would be one-sided here.
#[derive(Clone)]
pub(super) struct UcxLender {
    pub(super) engine: Arc<Engine>,
    endpoint: Arc<tokio::sync::OnceCell<Arc<UcxPeer>>>,
    address: Vec<u8>,
    emulated_push: bool,
    peer: String,
    said: Arc<AtomicBool>,
}

impl UcxLender {
    /// Whether `buffer` is lent to the peer's puts: always with
    /// `transport.ucx.emulated_push`, else only where our endpoint's lanes to the peer
    /// make writes into such memory one-sided (the endpoint is made, and flushed so that
    /// its lanes are final, on the first push: [`JUDGE_WITHIN`] at most, else not lent).
    /// Where they would be emulated over tcp, a writer that dies mid-write can abort this
    /// process inside UCX: the push streams over the link instead, said once per peer and
    /// counted (`ferry_ucx_pushes_streamed_total`).
    pub(super) async fn lends(&self, buffer: &Buffer) -> bool {
        if self.emulated_push {
            return true;
        }
        let (memory, name) = if buffer.device_memory().is_some() {
            (ferry_transports::ucx::MemoryType::Cuda, "device")
        } else {
            (ferry_transports::ucx::MemoryType::Host, "host")
        };
        let lanes = match tokio::time::timeout(JUDGE_WITHIN, self.final_lanes()).await {
            Ok(Ok(lanes)) => Some(lanes),
            Ok(Err(e)) => {
                tracing::debug!(peer = %self.peer, "no UCX endpoint to judge a push by: {e}");
                None
            }
            Err(_) => {
                tracing::debug!(peer = %self.peer, "the UCX endpoint's lanes took too long");
                None
            }
        };
        if lanes.as_ref().is_some_and(|l| l.writes_one_sided(memory)) {
            return true;
        }
        metrics::counter!("ferry_ucx_pushes_streamed_total").increment(1);
        if !self.said.swap(true, Ordering::Relaxed) {
            let peer = &self.peer;
            let lanes = lanes.map_or_else(|| "not known".to_string(), |l| l.to_string());
            tracing::warn!(
                %peer,
                "pushes from peer {peer} over ucx stream over ferry's link: its writes \
                 into {name} memory would not be one-sided here ({lanes}), and where \
                 UCX applies a peer's writes itself, a writer that dies mid-write can abort \
                 this process (transport.ucx.emulated_push = true lends memory all the \
                 same)"
            );
        }
        false
    }

    /// Our endpoint's lanes to the peer, final (asked after a first use: a flush when
    /// nothing used the endpoint yet).
    async fn final_lanes(&self) -> Result<EndpointLanes, MoveError> {
        let engine = Arc::clone(&self.engine);
        let ucx = connected(&self.endpoint, engine, self.address.clone()).await?;
        if !ucx.lanes().after_first_use {
            ucx.flush()?.await?;
        }
        Ok(ucx.lanes())
    }
}

/// The longest the first push from a peer waits to learn our endpoint's lanes to it
/// (connecting and flushing the endpoint) before its bytes stream over the link instead.
const JUDGE_WITHIN: Duration = Duration::from_secs(2);

/// Ask for the lanes of this node's UCX endpoint to the peer: the one pulls use, made now
/// (and flushed, so its wireup completes) if no pull made it yet.
#[derive(Debug, Message)]
#[rtype(result = "Result<EndpointLanes, Error>")]
pub struct AskUcxLanes;

impl Handler<AskUcxLanes> for TransferActor {
    type Result = ResponseActFuture<Self, Result<EndpointLanes, Error>>;

    fn handle(&mut self, _: AskUcxLanes, _: &mut Self::Context) -> Self::Result {
        let peer = self.peer.clone();
        let Some(engine) = self.engine().cloned() else {
            let refused =
                Error::unsupported("this node does not serve ucx (transport.ucx.enabled)");
            return Box::pin(actix::fut::ready(Err(refused)));
        };
        if self.ucx.address.is_empty() {
            let refused = Error::unsupported(format!(
                "peer {peer} does not serve ucx (or no link to it came up yet)"
            ));
            return Box::pin(actix::fut::ready(Err(refused)));
        }
        let endpoint = Arc::clone(&self.ucx.endpoint);
        let address = self.ucx.address.clone();
        let asked = self.setup.io.spawn(async move {
            let ucx = connected(&endpoint, engine, address).await?;
            if !ucx.lanes().after_first_use {
                ucx.flush()?.await?;
            }
            Ok::<_, MoveError>(ucx.lanes())
        });
        let used = Arc::clone(&self.ucx.endpoint);
        Box::pin(asked.into_actor(self).map(move |joined, act, _| {
            let failed = |detail: String| Error::Transport {
                peer: peer.clone(),
                detail,
            };
            match joined {
                Ok(Ok(lanes)) => Ok(lanes),
                Ok(Err(e)) => {
                    act.forget_failed_endpoint(&used, &e);
                    Err(failed(format!("the UCX endpoint: {e}")))
                }
                Err(e) => Err(failed(format!("the UCX endpoint task: {e}"))),
            }
        }))
    }
}

/// Ask how many keys of the peer's registrations our UCX endpoint to it holds unpacked (0
/// without an endpoint). Each registration serves one transfer, and its key is forgotten
/// when that transfer ends: between transfers the answer is 0.
#[derive(Debug, Message)]
#[rtype(result = "Result<usize, Error>")]
pub struct AskUcxKeys;

impl Handler<AskUcxKeys> for TransferActor {
    type Result = Result<usize, Error>;

    fn handle(&mut self, _: AskUcxKeys, _: &mut Self::Context) -> Self::Result {
        Ok(self.ucx.endpoint.get().map_or(0, |e| e.unpacked_keys()))
    }
}

/// Our endpoint to the peer's worker at `address`: the one in `endpoint`, or a new one
/// (connected on a blocking thread).
async fn connected(
    endpoint: &tokio::sync::OnceCell<Arc<UcxPeer>>,
    engine: Arc<Engine>,
    address: Vec<u8>,
) -> Result<Arc<UcxPeer>, MoveError> {
    endpoint
        .get_or_try_init(|| async {
            tokio::task::spawn_blocking(move || engine.connect(address))
                .await
                .map_err(|e| MoveError::Task(e.to_string()))?
                .map(Arc::new)
                .map_err(MoveError::from)
        })
        .await
        .map(Arc::clone)
}

/// Drops our endpoint's unpacked copy of the key of the peer's registration `of` once the
/// one transfer it was made for has ended: the peer drops the registration when it hears
/// `Done` or `Written` (each registration serves one transfer), so a key kept would only
/// stand for memory the peer may since have freed, and could never be used rightly again.
fn forget_key(peer: &UcxPeer, of: &UcxSource) {
    if let Ok(key) = peer.remote_key(of.rkey.clone()) {
        // Fails only when the engine stopped, which dropped every key already.
        let _ = peer.forget_rkey(&key);
    }
}

/// Why a pull or a push failed, by the transport that moved the bytes.
#[derive(Debug, thiserror::Error)]
pub(super) enum MoveError {
    /// The ipc copy.
    #[error(transparent)]
    Ipc(#[from] crate::gpu::IpcError),
    /// The UCX read.
    #[error(transparent)]
    Ucx(#[from] UcxTransportError),
    /// The task that ran it.
    #[error("the task that moved the bytes failed: {0}")]
    Task(String),
}

/// Why this node does not serve ucx.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum UcxOff {
    /// `transport.ucx.enabled = "off"`.
    #[error("transport.ucx.enabled is \"off\"")]
    Disabled,
    /// `"auto"` on a machine without an RDMA device.
    #[error("no RDMA device here (transport.ucx.enabled is \"auto\"; \"on\" uses UCX over tcp)")]
    NoRdmaDevice,
    /// The engine did not start.
    #[error("UCX did not start")]
    DidNotStart(#[source] UcxTransportError),
}

/// What a node made of ucx, which it starts with its own configuration: served exactly when
/// its engine started, else not viable for the reason given.
pub(crate) fn ucx_verdict(engine: &Result<Arc<Engine>, UcxOff>) -> (TransportName, Viability) {
    let verdict = match engine {
        Ok(_) => Viability::Viable,
        Err(why) => Viability::NotViable(with_causes(why)),
    };
    (TransportName::Ucx, verdict)
}

/// `error` and its causes, as one line ("a: b: c").
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        line.push_str(": ");
        line.push_str(&c.to_string());
        cause = c.source();
    }
    line
}

/// Why this node (with `engine`) cannot use ucx with a peer that sent `peer_address` in its
/// hello (another UCX release, or bytes that are not an address); `None` when it can, or
/// when the peer does not serve ucx (an empty address: routing says that on its own).
pub(crate) fn ucx_unusable_with(
    engine: &Engine,
    peer_address: &[u8],
) -> Option<(TransportName, String)> {
    if peer_address.is_empty() {
        return None;
    }
    let why = engine.check_address(peer_address).err()?;
    Some((
        TransportName::Ucx,
        format!("the peer's UCX cannot be used: {why}"),
    ))
}

impl TransferActor {
    /// What lending memory to the peer's ucx pushes takes; `None` when this node does not
    /// serve ucx.
    pub(super) fn ucx_lender(&self) -> Option<UcxLender> {
        Some(UcxLender {
            engine: self.engine().cloned()?,
            endpoint: Arc::clone(&self.ucx.endpoint),
            address: self.ucx.address.clone(),
            emulated_push: self.setup.ucx_emulated_push,
            peer: self.peer.clone(),
            said: Arc::clone(&self.ucx.pushes_streamed),
        })
    }

    /// The node's UCX engine, when this node serves ucx.
    pub(super) fn engine(&self) -> Option<&Arc<Engine>> {
        self.setup.ucx.as_ref()
    }

    /// A new link: the peer's (maybe new) worker address, and whether we take its ucx
    /// offers (both ends serve ucx).
    pub(super) fn attach_ucx(&mut self, peer_address: &[u8]) {
        self.ucx.address = peer_address.to_vec();
        // A peer that reconnects may be a new process: a fresh endpoint on first use.
        self.ucx.endpoint = Arc::default();
        // Another UCX release's keys do not unpack here: its offers are refused as
        // unsupported (its routes skip ucx for the same reason, in its coordinator).
        let compatible = self.engine().is_some_and(|e| {
            !self.ucx.address.is_empty() && ucx_unusable_with(e, &self.ucx.address).is_none()
        });
        self.session.set_serves(TransportName::Ucx, compatible);
    }

    /// A send over ucx: its buffer is registered on a blocking thread while this actor's
    /// mailbox waits (later sends queue behind it, in order), then it is queued with the
    /// registration's key in its offer.
    pub(super) fn submit_ucx(
        &mut self,
        msg: Submit,
        reply: oneshot::Sender<Result<Buffer, SendError>>,
        ctx: &mut Context<Self>,
    ) {
        let Some(engine) = self.engine().cloned() else {
            let _ = reply.send(Err(SendError {
                error: Error::unsupported("this node does not serve ucx (transport.ucx.enabled)"),
                buffer: Some(msg.buffer),
            }));
            return;
        };
        let view = msg.buffer.share();
        let layout = match &msg.op {
            Op::Send { layout, .. } => layout.clone(),
            Op::Put { .. } => Layout::Contiguous,
        };
        let registered = self
            .setup
            .io
            .spawn_blocking(move || engine.export_layout(view, &layout));
        ctx.wait(registered.into_actor(self).map(move |joined, act, ctx| {
            let exported = match joined {
                Ok(Ok(exported)) => exported,
                Ok(Err(e)) => {
                    let _ = reply.send(Err(SendError {
                        error: Error::Unsupported {
                            detail: format!("cannot register the buffer with UCX: {e}"),
                            source: None,
                        },
                        buffer: Some(msg.buffer),
                    }));
                    return;
                }
                Err(e) => {
                    let _ = reply.send(Err(SendError {
                        error: Error::ShuttingDown,
                        buffer: Some(msg.buffer),
                    }));
                    tracing::warn!("the UCX registration task failed: {e}");
                    return;
                }
            };
            act.queue_submit_with(msg, Some(exported), reply, ctx);
        }));
    }

    /// The peer finished reading op `op`'s buffer (`Done`): its registration goes now
    /// (unmapped on a blocking thread; the buffer is freed after it).
    pub(super) fn unexport_ucx(&mut self, op: OpId) {
        if let Some(exported) = self.ucx.exported.remove(&op) {
            self.setup.io.spawn_blocking(move || drop(exported));
        }
    }

    /// The peer gave up op `op` (`Cancel`), or the link went: reads it started may still be
    /// served by our UCX (over tcp, our progress thread answers them from the buffer, and
    /// checks no key), so the registration and the buffer are held for the longest a read
    /// may take before they go.
    pub(super) fn quarantine_ucx(&mut self, op: OpId) {
        if let Some(exported) = self.ucx.exported.remove(&op) {
            self.hold_then_drop(vec![exported]);
        }
    }

    /// Every registration goes with the link, after the same hold as a cancelled one.
    pub(super) fn unexport_all_ucx(&mut self) {
        let all: Vec<Exported> = self.ucx.exported.drain().map(|(_, e)| e).collect();
        if !all.is_empty() {
            self.hold_then_drop(all);
        }
    }

    pub(super) fn hold_then_drop<T: Send + 'static>(&self, exported: Vec<T>) {
        let hold = self.setup.ucx_hold;
        self.setup.io.spawn(async move {
            tokio::time::sleep(hold).await;
            let _ = tokio::task::spawn_blocking(move || drop(exported)).await;
        });
    }

    /// A failed or timed-out endpoint fails everything sent on it afterwards: the next use
    /// connects anew (unless a newer link already replaced `used`).
    fn forget_failed_endpoint(
        &mut self,
        used: &Arc<tokio::sync::OnceCell<Arc<UcxPeer>>>,
        error: &MoveError,
    ) {
        if let MoveError::Ucx(e) = error
            && (e.is_peer_failure() || matches!(e, UcxTransportError::TimedOut { .. }))
            && Arc::ptr_eq(&self.ucx.endpoint, used)
        {
            self.ucx.endpoint = Arc::default();
        }
    }

    /// Says, once per peer, which UCX lanes its reads take (logged), and warns and counts
    /// when UCX emulates them over tcp. Only lanes asked after the endpoint's first use
    /// count (they are final then).
    fn report_ucx_lanes(&mut self, lanes: &EndpointLanes) {
        if self.ucx.lanes_reported || !lanes.after_first_use {
            return;
        }
        self.ucx.lanes_reported = true;
        let peer = &self.peer;
        if let Some(warning) = lanes.warning(&format!("UCX reads from peer {peer}")) {
            metrics::counter!("ferry_ucx_emulated_rma_peers_total").increment(1);
            tracing::warn!(%peer, %lanes, "{warning}");
        } else {
            tracing::info!(%peer, %lanes, "UCX reads from peer {peer}: the endpoint's lanes");
        }
    }

    /// Writes op `op`'s bytes into the peer's buffer lent as `target` (a ucx push), as a
    /// task on the I/O runtime: the puts, then a flush of the endpoint, so every byte is
    /// at the peer before it hears `Written`.
    pub(super) fn start_ucx_write(&mut self, op: OpId, target: UcxSource, ctx: &mut Context<Self>) {
        let Some(engine) = self.engine().cloned() else {
            let off = MoveError::Task("this node no longer serves ucx".into());
            return self.written(op, Err(off), ctx);
        };
        let (source, layout, stop) = match self.push_source(op) {
            Ok(started) => started,
            Err(why) => return self.written(op, Err(why), ctx),
        };
        let packed = match layout.check(source.len() as u64) {
            Ok(packed) => packed,
            Err(e) => {
                let bad = MoveError::Task(format!("the layout does not fit the buffer: {e}"));
                return self.written(op, Err(bad), ctx);
            }
        };
        let endpoint = Arc::clone(&self.ucx.endpoint);
        let address = self.ucx.address.clone();
        let push = self.setup.io.spawn(async move {
            let peer = connected(&endpoint, engine, address).await?;
            let put = peer.put_from(source, &layout, packed, &target, &stop).await;
            forget_key(&peer, &target);
            put?;
            Ok::<_, MoveError>(())
        });
        let used = Arc::clone(&self.ucx.endpoint);
        ctx.spawn(push.into_actor(self).map(move |joined, act, ctx| {
            let pushed = joined.unwrap_or_else(|e| Err(MoveError::Task(e.to_string())));
            if let Err(e) = &pushed {
                act.forget_failed_endpoint(&used, e);
            }
            act.written(op, pushed, ctx);
        }));
    }

    /// Reads pulled transfer `id` out of the peer's registered buffer into `buffer`, as a
    /// task on the I/O runtime; the result comes back to the session.
    pub(super) fn start_ucx_pull(
        &mut self,
        id: InboundId,
        buffer: Buffer,
        ctx: &mut Context<Self>,
    ) {
        let Some((source, layout)) = self.ucx.sources.get(&id).cloned() else {
            return;
        };
        let Some(engine) = self.engine().cloned() else {
            return self.pull_ended(
                id,
                Err(MoveError::Task("this node does not serve ucx".into())),
                ctx,
            );
        };
        self.ipc.pulling.insert(id);
        if let Some(spans) = self.inbound_spans.get_mut(&id) {
            spans.phase = tracing::debug_span!(parent: &spans.span, "pull");
            spans.pulling = Some(Instant::now());
        }
        let endpoint = Arc::clone(&self.ucx.endpoint);
        let address = self.ucx.address.clone();
        let pull = self.setup.io.spawn(async move {
            let peer = match connected(&endpoint, engine, address).await {
                Ok(peer) => peer,
                Err(e) => return (buffer, Err(e)),
            };
            let (buffer, got) = peer.get_into(buffer, &source, &layout).await;
            forget_key(&peer, &source);
            (buffer, got.map_err(MoveError::from))
        });
        let used = Arc::clone(&self.ucx.endpoint);
        ctx.spawn(pull.into_actor(self).map(move |joined, act, ctx| {
            let pulled = match joined {
                Ok((buffer, Ok(()))) => Ok(buffer),
                Ok((_buffer, Err(e))) => Err(e),
                Err(e) => Err(MoveError::Task(e.to_string())),
            };
            match &pulled {
                Err(e) => act.forget_failed_endpoint(&used, e),
                Ok(_) => {
                    if let Some(endpoint) = used.get() {
                        act.report_ucx_lanes(&endpoint.lanes());
                    }
                }
            }
            act.pull_ended(id, pulled, ctx);
        }));
    }
}
