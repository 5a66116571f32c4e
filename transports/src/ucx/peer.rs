//! The ucx transport as a node serves it ([`UcxTransport`]: its engine, or why there is none)
//! and its part of one peer's session ([`UcxPart`]): the endpoint to the peer's UCX worker
//! (connected on first use, from the address the peer announced), our buffers registered
//! for the peer to read until it lets go, reads out of the peer's, writes into buffers it
//! lends.
//!
//! Every UCX call that waits (registering, unregistering, connecting, the reads) runs off
//! the shell's thread: registrations on a blocking thread (the sends after one wait in the
//! shell, in order), reads and writes as tasks on the node's I/O runtime.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ferry_config::TransportName;

use super::{EndpointLanes, Engine, UcxPeer, UcxSource, UcxTransportError};
use crate::memory::{Buffer, SharedBytes};
use crate::transport::{
    Attached, Capabilities, Descriptor, Exported, Exporting, Lend, LentMemory, Moving, OpId,
    PeerEnv, PeerTransport, Retired, Transport, TransportError, Viability,
};
use crate::wire::Layout;

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

/// The ucx transport of one node: its engine when it started, and the settings its parts
/// use.
pub struct UcxTransport {
    caps: Capabilities,
    engine: Result<Arc<Engine>, UcxOff>,
    /// How long a registration the peer may still read is held after a cancel or a lost
    /// link (`memory.export_lease_timeout`).
    hold: Duration,
    /// `transport.ucx.emulated_push`.
    emulated_push: bool,
}

impl UcxTransport {
    /// The transport over `engine` (or not served, for the reason given); registrations the
    /// peer may still use are held `hold` after a cancel or a lost link, and memory is lent
    /// to emulated pushes when `emulated_push`.
    pub fn new(engine: Result<Arc<Engine>, UcxOff>, hold: Duration, emulated_push: bool) -> Self {
        Self {
            caps: super::capabilities(),
            engine,
            hold,
            emulated_push,
        }
    }

    /// The transport `config` asks for: its engine started (its progress thread in `gpu`'s
    /// primary context, when given), or not served for the reason given.
    pub fn start(config: &ferry_config::Config, gpu: Option<&crate::cuda::Device>) -> Self {
        Self::new(
            super::start::start(config, gpu),
            config.memory.export_lease_timeout,
            config.transport.ucx.emulated_push,
        )
    }

    /// The engine, when this node serves ucx.
    pub fn engine(&self) -> Option<&Arc<Engine>> {
        self.engine.as_ref().ok()
    }
}

impl Transport for UcxTransport {
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    /// Served exactly when its engine started (with the configured library, which the
    /// registry's probe of the default library does not know).
    fn viability(&self) -> Viability {
        match &self.engine {
            Ok(_) => Viability::Viable,
            Err(why) => Viability::NotViable(with_causes(why)),
        }
    }

    fn announce(&self) -> Vec<u8> {
        self.engine().map(|e| e.address()).unwrap_or_default()
    }

    /// Another UCX release, or bytes that are not an address, cannot be used: the keys do
    /// not unpack across releases. A peer that announces nothing serves no ucx (routing
    /// says that on its own).
    fn usable_with(&self, theirs: &[u8]) -> Result<(), String> {
        let Some(engine) = self.engine() else {
            return Ok(());
        };
        if theirs.is_empty() {
            return Ok(());
        }
        engine
            .check_address(theirs)
            .map_err(|why| format!("the peer's UCX cannot be used: {why}"))
    }

    fn open(&self, env: PeerEnv) -> Box<dyn PeerTransport> {
        Box::new(UcxPart {
            engine: self.engine().cloned(),
            hold: self.hold,
            emulated_push: self.emulated_push,
            env,
            address: Vec::new(),
            endpoint: EndpointSlot::default(),
            exported: HashMap::new(),
            lanes_reported: Arc::default(),
            pushes_streamed: Arc::default(),
        })
    }
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

/// The ucx part of one peer's session.
struct UcxPart {
    engine: Option<Arc<Engine>>,
    hold: Duration,
    emulated_push: bool,
    env: PeerEnv,
    /// The peer's UCX worker address, from its hello (empty: it does not serve ucx).
    address: Vec<u8>,
    /// Our endpoint to the peer's worker, made by the first use on this link.
    endpoint: EndpointSlot,
    /// Our buffers registered for the peer to read, until it says `Done` or `Cancel`, or
    /// the link goes.
    exported: HashMap<OpId, Box<dyn Send>>,
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
struct EndpointSlot(Arc<std::sync::Mutex<Endpoint>>);

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
    fn forget_failed(&self, used: &Endpoint, error: &TransportError) {
        let mut current = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = error.cause::<UcxTransportError>()
            && e.is_peer_failure()
            && Arc::ptr_eq(&current, used)
        {
            *current = Endpoint::default();
        }
    }
}

/// Our endpoint to the peer's worker at `address`: the one in `endpoint`, or a new one
/// (connected on a blocking thread).
async fn connected(
    endpoint: &tokio::sync::OnceCell<Arc<UcxPeer>>,
    engine: Arc<Engine>,
    address: Vec<u8>,
) -> Result<Arc<UcxPeer>, TransportError> {
    endpoint
        .get_or_try_init(|| async {
            tokio::task::spawn_blocking(move || engine.connect(address))
                .await
                .map_err(|e| TransportError::because("the UCX connect task", e))?
                .map(Arc::new)
                .map_err(TransportError::of)
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

/// A ucx move on a node whose UCX is gone.
fn off<T: Send + 'static>() -> Moving<T> {
    let off = TransportError::new("this node no longer serves ucx");
    Box::pin(std::future::ready(Err(off)))
}

/// A move over a descriptor that is not a ucx source.
fn unreadable<T: Send + 'static>(e: crate::transport::DescriptorError) -> Moving<T> {
    Box::pin(std::future::ready(Err(TransportError::from(e))))
}

impl UcxPart {
    /// Drops `what` on a blocking thread after the longest a transfer in flight may take:
    /// UCX may still serve a read or apply a write into a registration until then.
    fn hold_then_drop(&self, what: Box<dyn Send>) {
        let hold = self.hold;
        self.env.io.spawn(async move {
            tokio::time::sleep(hold).await;
            let _ = tokio::task::spawn_blocking(move || drop(what)).await;
        });
    }

    /// Our endpoint's lanes to the peer, made now (and flushed, so its wireup completes)
    /// if no pull made it yet.
    fn lanes(&self) -> Moving<EndpointLanes> {
        let Some(engine) = self.engine.clone() else {
            return Box::pin(std::future::ready(Err(TransportError::new(
                "this node does not serve ucx (transport.ucx.enabled)",
            ))));
        };
        if self.address.is_empty() {
            let refused = TransportError::new(format!(
                "peer {} does not serve ucx (or no link to it came up yet)",
                self.env.peer
            ));
            return Box::pin(std::future::ready(Err(refused)));
        }
        let slot = self.endpoint.clone();
        let endpoint = slot.current();
        let used = Arc::clone(&endpoint);
        let address = self.address.clone();
        let asked = self.env.io.spawn(async move {
            let ucx = connected(&endpoint, engine, address).await?;
            if !ucx.lanes().after_first_use {
                ucx.flush()
                    .map_err(TransportError::of)?
                    .await
                    .map_err(TransportError::of)?;
            }
            Ok::<_, TransportError>(ucx.lanes())
        });
        Box::pin(async move {
            let lanes = asked
                .await
                .unwrap_or_else(|e| Err(TransportError::because("the UCX endpoint task", e)));
            if let Err(e) = &lanes {
                slot.forget_failed(&used, e);
            }
            lanes
        })
    }
}

impl PeerTransport for UcxPart {
    fn transport(&self) -> TransportName {
        UcxSource::TRANSPORT
    }

    /// The peer's (maybe new) worker address; we take its offers when both ends serve ucx
    /// and its UCX is one ours can talk to (another release's keys do not unpack here; its
    /// routes skip ucx for the same reason, in its coordinator).
    fn attach(&mut self, link: &Attached<'_>) -> bool {
        self.address = (link.hello.announced(UcxSource::TRANSPORT))
            .unwrap_or_default()
            .to_vec();
        // A peer that reconnects may be a new process: a fresh endpoint on first use.
        self.endpoint.reset();
        self.engine
            .as_ref()
            .is_some_and(|e| !self.address.is_empty() && e.check_address(&self.address).is_ok())
    }

    fn inspect(
        &self,
        what: &str,
    ) -> Option<
        futures::future::BoxFuture<'static, Result<Box<dyn std::any::Any + Send>, TransportError>>,
    > {
        match what {
            // The lanes of our endpoint to the peer: the one pulls use (nothing to say when
            // this node or the peer serves no ucx).
            "lanes" if self.engine.is_some() && !self.address.is_empty() => {
                let lanes = self.lanes();
                Some(Box::pin(async move {
                    lanes
                        .await
                        .map(|l| Box::new(l) as Box<dyn std::any::Any + Send>)
                }))
            }
            // How many keys of the peer's registrations our endpoint holds unpacked (each
            // serves one transfer and is forgotten when it ends: 0 between transfers).
            "unpacked_keys" => {
                let keys = (self.endpoint.current().get()).map_or(0, |e| e.unpacked_keys());
                Some(Box::pin(std::future::ready(Ok(
                    Box::new(keys) as Box<dyn std::any::Any + Send>
                ))))
            }
            _ => None,
        }
    }

    /// Registers the buffer on a blocking thread (the sends behind it wait, in order).
    fn export(&mut self, buffer: &Buffer, layout: &Layout) -> Exporting {
        let Some(engine) = self.engine.clone() else {
            return Exporting::Now(Err(TransportError::new(
                "this node does not serve ucx (transport.ucx.enabled)",
            )));
        };
        let view = buffer.share();
        let layout = layout.clone();
        let registered = self
            .env
            .io
            .spawn_blocking(move || engine.export_layout(view, &layout));
        Exporting::Later(Box::pin(async move {
            let exported = registered
                .await
                .map_err(|e| TransportError::because("the UCX registration task", e))?
                .map_err(|e| TransportError::because("cannot register the buffer with UCX", e))?;
            Ok(Exported {
                descriptor: exported.source().describe()?,
                kept: Some(Box::new(exported)),
            })
        }))
    }

    fn keep(&mut self, op: OpId, kept: Option<Box<dyn Send>>, _: &Buffer) {
        if let Some(kept) = kept {
            self.exported.insert(op, kept);
        }
    }

    /// The registration goes now (unmapped on a blocking thread; the buffer is freed after
    /// it).
    fn released(&mut self, op: OpId) {
        if let Some(exported) = self.exported.remove(&op) {
            self.env.io.spawn_blocking(move || drop(exported));
        }
    }

    /// Reads the peer started may still be served by our UCX (over tcp, our progress
    /// thread answers them from the buffer, and checks no key), so the registration and
    /// the buffer are held for the longest a read may take before they go.
    fn cancelled(&mut self, op: OpId) {
        if let Some(exported) = self.exported.remove(&op) {
            self.hold_then_drop(exported);
        }
    }

    fn lands_in_device(&self) -> bool {
        (self.engine.as_ref()).is_some_and(|e| e.moves(super::MemoryType::Cuda))
    }

    /// Reads as a task on the I/O runtime, over our endpoint to the peer (made on first
    /// use); the key is forgotten when the read ends.
    fn pull(&mut self, source: &Descriptor, layout: Layout, buffer: Buffer) -> Moving<Buffer> {
        let source = match UcxSource::read(source) {
            Ok(source) => source,
            Err(e) => return unreadable(e),
        };
        let Some(engine) = self.engine.clone() else {
            return off();
        };
        let slot = self.endpoint.clone();
        let endpoint = slot.current();
        let used = Arc::clone(&endpoint);
        let address = self.address.clone();
        let reported = Arc::clone(&self.lanes_reported);
        let peer = self.env.peer.clone();
        let pull = self.env.io.spawn(async move {
            let ucx = match connected(&endpoint, engine, address).await {
                Ok(ucx) => ucx,
                Err(e) => return (buffer, Err(e)),
            };
            let (buffer, got) = ucx.get_into(buffer, &source, &layout).await;
            forget_key(&ucx, &source);
            (buffer, got.map_err(TransportError::of))
        });
        Box::pin(async move {
            let pulled = match pull.await {
                Ok((buffer, Ok(()))) => Ok(buffer),
                Ok((_buffer, Err(e))) => Err(e),
                Err(e) => Err(TransportError::because("the UCX read task", e)),
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
        target: &Descriptor,
        source: SharedBytes,
        layout: Layout,
        stop: Arc<AtomicBool>,
    ) -> Moving<()> {
        let target = match UcxSource::read(target) {
            Ok(target) => target,
            Err(e) => return unreadable(e),
        };
        let Some(engine) = self.engine.clone() else {
            return off();
        };
        let packed = match layout.check(source.len() as u64) {
            Ok(packed) => packed,
            Err(e) => {
                let bad = TransportError::because("the layout does not fit the buffer", e);
                return Box::pin(std::future::ready(Err(bad)));
            }
        };
        let slot = self.endpoint.clone();
        let endpoint = slot.current();
        let used = Arc::clone(&endpoint);
        let address = self.address.clone();
        let push = self.env.io.spawn(async move {
            let ucx = connected(&endpoint, engine, address).await?;
            let put = ucx.put_from(source, &layout, packed, &target, &stop).await;
            forget_key(&ucx, &target);
            put.map_err(TransportError::of)
        });
        Box::pin(async move {
            let pushed = push
                .await
                .unwrap_or_else(|e| Err(TransportError::because("the UCX write task", e)));
            if let Err(e) = &pushed {
                slot.forget_failed(&used, e);
            }
            pushed
        })
    }

    fn lender(&self) -> Option<Arc<dyn Lend>> {
        Some(Arc::new(UcxLender {
            engine: self.engine.clone()?,
            endpoint: self.endpoint.current(),
            address: self.address.clone(),
            emulated_push: self.emulated_push,
            peer: self.env.peer.clone(),
            said: Arc::clone(&self.pushes_streamed),
        }))
    }

    /// Every registration goes with the session, after the same hold as a cancelled one.
    fn close(&mut self) -> Vec<(OpId, Retired)> {
        (self.exported.drain())
            .map(|(op, exported)| (op, Retired::Hold(exported)))
            .collect()
    }
}

/// What lending memory to the peer's ucx pushes takes: the engine, and whether the peer's
/// writes would be one-sided here.
struct UcxLender {
    engine: Arc<Engine>,
    endpoint: Endpoint,
    address: Vec<u8>,
    emulated_push: bool,
    peer: String,
    said: Arc<AtomicBool>,
}

/// The longest the first push from a peer waits to learn our endpoint's lanes to it
/// (connecting and flushing the endpoint) before its bytes stream over the link instead.
const JUDGE_WITHIN: Duration = Duration::from_secs(2);

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
            (super::MemoryType::Cuda, "device")
        } else {
            (super::MemoryType::Host, "host")
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
    async fn final_lanes(&self) -> Result<EndpointLanes, TransportError> {
        let engine = Arc::clone(&self.engine);
        let ucx = connected(&self.endpoint, engine, self.address.clone()).await?;
        if !ucx.lanes().after_first_use {
            ucx.flush()
                .map_err(TransportError::of)?
                .await
                .map_err(TransportError::of)?;
        }
        Ok(ucx.lanes())
    }
}

impl Lend for UcxLender {
    fn lends<'a>(&'a self, buffer: &'a Buffer) -> futures::future::BoxFuture<'a, bool> {
        Box::pin(UcxLender::lends(self, buffer))
    }

    fn lend(&self, buffer: Buffer) -> Result<(Box<dyn LentMemory>, Descriptor), TransportError> {
        let lent = (self.engine.lend(buffer))
            .map_err(|e| TransportError::because("cannot register the buffer with UCX", e))?;
        let target = lent.target().describe()?;
        Ok((Box::new(LentRegistered(lent)), target))
    }
}

/// Memory registered with our UCX for the peer's `ucp_put`.
#[derive(Debug)]
struct LentRegistered(super::Lent);

impl LentMemory for LentRegistered {
    fn kind(&self) -> crate::memory::MemoryKind {
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
