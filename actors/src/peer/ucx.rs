//! The ucx transport's part of a peer ([`PeerPart`]): the endpoint to the peer's UCX worker
//! (connected on first use, from the address in its hello), our buffers registered for the
//! peer to read until it lets go, reads out of the peer's, writes into buffers it lends.
//!
//! Every UCX call that waits (registering, unregistering, connecting, the reads) runs off
//! the actor thread: registrations on a blocking thread (the sends after one wait in the
//! actor's export queue, in order), reads and writes as tasks on the node's I/O runtime.

use super::*;
use ferry_config::TransportName;
use ferry_transports::transport::Viability;
use ferry_transports::ucx::UcxSource;
use ferry_transports::ucx::{EndpointLanes, Engine, UcxPeer, UcxTransportError};

/// The ucx part of one peer's session.
#[derive(Default)]
pub(super) struct UcxState {
    /// The peer's UCX worker address, from its hello (empty: it does not serve ucx).
    pub(super) address: Vec<u8>,
    /// Our endpoint to the peer's worker, made by the first use on this link.
    pub(super) endpoint: EndpointSlot,
    /// Our buffers registered for the peer to read, until it says `Done` or `Cancel`, or
    /// the link goes.
    pub(super) exported: HashMap<OpId, Box<dyn Send>>,
    /// Whether the lanes of our endpoint to the peer were reported (logged, and counted
    /// when emulated over tcp): once per peer, after the first pull that completed.
    lanes_reported: Arc<AtomicBool>,
    /// Whether we said that the peer's ucx pushes stream over the link (once per peer).
    pushes_streamed: Arc<AtomicBool>,
}

/// Our endpoint to the peer's worker: made on first use, made anew on a new link and after
/// a failure (a task that used a failed endpoint forgets it only if no newer one replaced
/// it meanwhile).
#[derive(Clone, Default)]
pub(super) struct EndpointSlot(Arc<std::sync::Mutex<Endpoint>>);

type Endpoint = Arc<tokio::sync::OnceCell<Arc<UcxPeer>>>;

impl EndpointSlot {
    /// The endpoint now (maybe not made yet).
    fn current(&self) -> Endpoint {
        Arc::clone(&self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The next use makes a new endpoint.
    fn reset(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Endpoint::default();
    }

    /// A failed or timed-out endpoint fails everything sent on it afterwards: the next use
    /// connects anew (unless a newer link already replaced `used`).
    fn forget_failed(&self, used: &Endpoint, error: &MoveError) {
        let mut current = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let MoveError::Ucx(e) = error
            && (e.is_peer_failure() || matches!(e, UcxTransportError::TimedOut { .. }))
            && Arc::ptr_eq(&current, used)
        {
            *current = Endpoint::default();
        }
    }
}

/// What lending memory to the peer's ucx pushes takes: the engine, and whether the peer's
/// writes would be one-sided here.
#[derive(Clone)]
pub(super) struct UcxLender {
    pub(super) engine: Arc<Engine>,
    endpoint: Endpoint,
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
    async fn lends(&self, buffer: &Buffer) -> bool {
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

impl Lend for UcxLender {
    fn lends<'a>(&'a self, buffer: &'a Buffer) -> futures::future::BoxFuture<'a, bool> {
        Box::pin(UcxLender::lends(self, buffer))
    }

    fn lend(&self, buffer: Buffer) -> Result<(Box<dyn LentMemory>, PushTarget), String> {
        let lent = (self.engine.lend(buffer))
            .map_err(|e| format!("cannot register the buffer with UCX: {e}"))?;
        let target = PushTarget {
            transport: UcxSource::TRANSPORT,
            descriptor: lent.target().describe().map_err(|e| e.to_string())?,
        };
        Ok((Box::new(LentRegistered(lent)), target))
    }
}

/// Memory registered with our UCX for the peer's `ucp_put`.
#[derive(Debug)]
struct LentRegistered(ferry_transports::ucx::Lent);

impl LentMemory for LentRegistered {
    fn kind(&self) -> ferry_transports::memory::MemoryKind {
        self.0.kind()
    }

    fn give_back_blocks(&self) -> bool {
        true
    }

    fn give_back(self: Box<Self>) -> Buffer {
        self.0.give_back()
    }

    /// Held as long as a cancelled read's registration, whether the push failed or the
    /// session ended: a failed writer's last puts may still be on their way where UCX
    /// applies them here.
    fn retire(self: Box<Self>, _: bool) -> Retired {
        Retired::Hold(Box::new(self.0))
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
        let Some(engine) = self.setup.ucx.clone() else {
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
        let endpoint = self.ucx.endpoint.current();
        let address = self.ucx.address.clone();
        let used = Arc::clone(&endpoint);
        let asked = self.setup.io.spawn(async move {
            let ucx = connected(&endpoint, engine, address).await?;
            if !ucx.lanes().after_first_use {
                ucx.flush()?.await?;
            }
            Ok::<_, MoveError>(ucx.lanes())
        });
        Box::pin(asked.into_actor(self).map(move |joined, act, _| {
            let failed = |detail: String| Error::Transport {
                peer: peer.clone(),
                detail,
            };
            match joined {
                Ok(Ok(lanes)) => Ok(lanes),
                Ok(Err(e)) => {
                    act.ucx.endpoint.forget_failed(&used, &e);
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
        Ok(self
            .ucx
            .endpoint
            .current()
            .get()
            .map_or(0, |e| e.unpacked_keys()))
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

impl PeerPart for UcxState {
    fn transport(&self) -> TransportName {
        UcxSource::TRANSPORT
    }

    /// The peer's (maybe new) worker address; we take its offers when both ends serve ucx
    /// and its UCX is one ours can talk to (another release's keys do not unpack here; its
    /// routes skip ucx for the same reason, in its coordinator).
    fn attach(&mut self, hello: &ferry_transports::wire::Hello, cx: &PartCx) -> bool {
        self.address = (hello.announced(UcxSource::TRANSPORT))
            .unwrap_or_default()
            .to_vec();
        // A peer that reconnects may be a new process: a fresh endpoint on first use.
        self.endpoint.reset();
        cx.setup.ucx.as_ref().is_some_and(|e| {
            !self.address.is_empty() && ucx_unusable_with(e, &self.address).is_none()
        })
    }

    /// Registers the buffer on a blocking thread (the sends behind it wait, in order).
    fn export(&mut self, buffer: &Buffer, layout: &Layout, cx: &PartCx) -> Exporting {
        let Some(engine) = cx.setup.ucx.clone() else {
            return Exporting::Now(Err(Error::unsupported(
                "this node does not serve ucx (transport.ucx.enabled)",
            )));
        };
        let view = buffer.share();
        let layout = layout.clone();
        let registered = cx
            .setup
            .io
            .spawn_blocking(move || engine.export_layout(view, &layout));
        Exporting::Later(Box::pin(async move {
            match registered.await {
                Ok(Ok(exported)) => Ok(Exported {
                    source: PullSource {
                        transport: UcxSource::TRANSPORT,
                        descriptor: exported
                            .source()
                            .describe()
                            .map_err(|e| Error::unsupported(e.to_string()))?,
                    },
                    kept: Some(Box::new(exported)),
                }),
                Ok(Err(e)) => Err(Error::Unsupported {
                    detail: format!("cannot register the buffer with UCX: {e}"),
                    source: None,
                }),
                Err(e) => {
                    tracing::warn!("the UCX registration task failed: {e}");
                    Err(Error::ShuttingDown)
                }
            }
        }))
    }

    fn keep(
        &mut self,
        op: OpId,
        (exported, _): (Exported, &Buffer),
        _: &Addr<TransferActor>,
        _: &PartCx,
    ) {
        if let Some(kept) = exported.kept {
            self.exported.insert(op, kept);
        }
    }

    /// The registration goes now (unmapped on a blocking thread; the buffer is freed after
    /// it).
    fn released(&mut self, op: OpId, cx: &PartCx) {
        if let Some(exported) = self.exported.remove(&op) {
            cx.setup.io.spawn_blocking(move || drop(exported));
        }
    }

    /// Reads the peer started may still be served by our UCX (over tcp, our progress
    /// thread answers them from the buffer, and checks no key), so the registration and
    /// the buffer are held for the longest a read may take before they go.
    fn cancelled(&mut self, op: OpId, cx: &PartCx) {
        if let Some(exported) = self.exported.remove(&op) {
            hold_then_drop(cx.setup, vec![exported]);
        }
    }

    fn lands_in_device(&self, cx: &PartCx) -> bool {
        (cx.setup.ucx.as_ref()).is_some_and(|e| e.moves(ferry_transports::ucx::MemoryType::Cuda))
    }

    /// Reads as a task on the I/O runtime, over our endpoint to the peer (made on first
    /// use); the key is forgotten when the read ends.
    fn pull(
        &mut self,
        source: PullSource,
        layout: Layout,
        buffer: Buffer,
        cx: &PartCx,
    ) -> Moving<Buffer> {
        if source.transport != UcxSource::TRANSPORT {
            return foreign(source.transport);
        }
        let source = match UcxSource::read(&source.descriptor) {
            Ok(source) => source,
            Err(e) => return Box::pin(std::future::ready(Err(MoveError::from(e)))),
        };
        let Some(engine) = cx.setup.ucx.clone() else {
            return off();
        };
        let slot = self.endpoint.clone();
        let endpoint = slot.current();
        let used = Arc::clone(&endpoint);
        let address = self.address.clone();
        let reported = Arc::clone(&self.lanes_reported);
        let peer = cx.peer.to_string();
        let pull = cx.setup.io.spawn(async move {
            let ucx = match connected(&endpoint, engine, address).await {
                Ok(ucx) => ucx,
                Err(e) => return (buffer, Err(e)),
            };
            let (buffer, got) = ucx.get_into(buffer, &source, &layout).await;
            forget_key(&ucx, &source);
            (buffer, got.map_err(MoveError::from))
        });
        Box::pin(async move {
            let pulled = match pull.await {
                Ok((buffer, Ok(()))) => Ok(buffer),
                Ok((_buffer, Err(e))) => Err(e),
                Err(e) => Err(MoveError::Task(e.to_string())),
            };
            match &pulled {
                Err(e) => slot.forget_failed(&used, e),
                Ok(_) => {
                    if let Some(endpoint) = used.get() {
                        report_lanes(&peer, &reported, &endpoint.lanes());
                    }
                }
            }
            pulled
        })
    }

    /// As a task on the I/O runtime: the puts, then a flush of the endpoint, so every byte
    /// is at the peer before it hears `Written`.
    fn write(
        &mut self,
        target: PushTarget,
        (source, layout): (SharedBytes, Layout),
        stop: Arc<AtomicBool>,
        cx: &PartCx,
    ) -> Moving<()> {
        if target.transport != UcxSource::TRANSPORT {
            return foreign(target.transport);
        }
        let target = match UcxSource::read(&target.descriptor) {
            Ok(target) => target,
            Err(e) => return Box::pin(std::future::ready(Err(MoveError::from(e)))),
        };
        let Some(engine) = cx.setup.ucx.clone() else {
            return off();
        };
        let packed = match layout.check(source.len() as u64) {
            Ok(packed) => packed,
            Err(e) => {
                let bad = MoveError::Task(format!("the layout does not fit the buffer: {e}"));
                return Box::pin(std::future::ready(Err(bad)));
            }
        };
        let slot = self.endpoint.clone();
        let endpoint = slot.current();
        let used = Arc::clone(&endpoint);
        let address = self.address.clone();
        let push = cx.setup.io.spawn(async move {
            let ucx = connected(&endpoint, engine, address).await?;
            let put = ucx.put_from(source, &layout, packed, &target, &stop).await;
            forget_key(&ucx, &target);
            put?;
            Ok::<_, MoveError>(())
        });
        Box::pin(async move {
            let pushed = push
                .await
                .unwrap_or_else(|e| Err(MoveError::Task(e.to_string())));
            if let Err(e) = &pushed {
                slot.forget_failed(&used, e);
            }
            pushed
        })
    }

    fn lender(&self, cx: &PartCx) -> Option<Arc<dyn Lend>> {
        Some(Arc::new(UcxLender {
            engine: cx.setup.ucx.clone()?,
            endpoint: self.endpoint.current(),
            address: self.address.clone(),
            emulated_push: cx.setup.ucx_emulated_push,
            peer: cx.peer.to_string(),
            said: Arc::clone(&self.pushes_streamed),
        }))
    }

    /// Every registration goes with the session, after the same hold as a cancelled one.
    fn close(&mut self, _: &PartCx) -> Vec<(u64, Retired)> {
        (self.exported.drain())
            .map(|(op, exported)| (op.0, Retired::Hold(exported)))
            .collect()
    }
}

/// A ucx move on a node whose UCX is gone.
fn off<T: 'static>() -> Moving<T> {
    let off = MoveError::Task("this node no longer serves ucx".into());
    Box::pin(std::future::ready(Err(off)))
}

/// Says, once per peer, which UCX lanes its reads take (logged), and warns and counts
/// when UCX emulates them over tcp. Only lanes asked after the endpoint's first use count
/// (they are final then).
fn report_lanes(peer: &str, reported: &AtomicBool, lanes: &EndpointLanes) {
    if !lanes.after_first_use || reported.swap(true, Ordering::Relaxed) {
        return;
    }
    if let Some(warning) = lanes.warning(&format!("UCX reads from peer {peer}")) {
        metrics::counter!("ferry_ucx_emulated_rma_peers_total").increment(1);
        tracing::warn!(%peer, %lanes, "{warning}");
    } else {
        tracing::info!(%peer, %lanes, "UCX reads from peer {peer}: the endpoint's lanes");
    }
}
