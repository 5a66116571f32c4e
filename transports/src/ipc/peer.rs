//! The ipc transport as a node serves it ([`IpcTransport`]) and its part of one peer's
//! session ([`IpcPart`]): the lazy setup with the peer (the pool import and the fast
//! lane, on the generic setup machine), pulls out of the peer's pools, pushes into buffers
//! the peer lends, our buffers lent for its pushes, and the unmap protocol that frees our
//! buffers the peer keeps mapped.
//!
//! Work that waits (importing the peer's pools, fetching its lane, freeing an import) runs
//! on the node's I/O runtime; its result comes back through the part's [`Returns`], and
//! the shell is woken to poll the part again.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_config::TransportName;

use super::lane::{DeviceRecords, LaneRx, LaneSettings, RxContext};
use super::{
    IMPORT_CACHE_CAPACITY, ImportCache, ImportedPools, IpcBufferRef, IpcError, IpcMessage,
    IpcSetupMessage, IpcSetupStep, IpcSource, PoolImports, PoolSource, SharedImports,
};
use crate::link::ring::Ring;
use crate::memory::{Buffer, Lease, MemoryKind, SharedBytes, UnmapDone, Unmapper};
use crate::transport::FastPath;
use crate::transport::lane::LaneTx;
use crate::transport::setup::{Attempt, PartSetup, PeerReply, SetupOutcome, SetupTransmit};
use crate::transport::{
    Admission, Attached, Capabilities, Descriptor, DescriptorError, Exported, Exporting, Lend,
    LentBuffer, LentMemory, Moving, OpId, PartEvent, PeerEnv, PeerTransport, Retired, Transport,
    TransportError, Viability,
};
use crate::wire::Layout;

/// The ipc transport of one node: its lane's settings.
pub struct IpcTransport {
    caps: Capabilities,
    viability: Viability,
    lane: LaneSettings,
}

impl IpcTransport {
    /// The transport, viable as the machine says ([`super::viability`]; a node without a
    /// GPU of its own takes no offers over it, [`PeerTransport::attach`] says); its lane as
    /// `lane` says.
    pub fn new(lane: LaneSettings) -> Self {
        Self {
            caps: super::capabilities(),
            viability: super::viability(),
            lane,
        }
    }

    /// The transport `[transport.ipc]` asks for.
    pub fn from_config(config: &ferry_config::Config) -> Self {
        let ipc = &config.transport.ipc;
        Self::new(LaneSettings {
            max: usize::try_from(ipc.lane_max).unwrap_or(0),
            spin: ipc.lane_spin,
            gather_max: usize::try_from(ipc.gather_max).unwrap_or(0),
        })
    }
}

impl Transport for IpcTransport {
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn viability(&self) -> Viability {
        self.viability.clone()
    }

    fn open(&self, env: PeerEnv) -> Box<dyn PeerTransport> {
        Box::new(IpcPart::new(env, self.lane))
    }
}

/// What work run off the shell's thread hands back to the part.
enum Returned {
    /// The peer's pools (and its lane, if it offered one and we could map it) were
    /// imported for setup attempt `attempt`, or not (why).
    Imported {
        attempt: Attempt,
        result: Result<(ImportedPools, Option<Ring>), String>,
    },
    /// We unmapped the peer's buffer at its request: say so.
    Unmapped(IpcBufferRef),
}

/// Aborts the task it holds when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Where work run off the shell's thread puts its result, then wakes the shell.
#[derive(Clone)]
struct Returns {
    queue: Arc<Mutex<VecDeque<Returned>>>,
    wake: crate::transport::Wake,
}

impl Returns {
    fn put(&self, returned: Returned) {
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(returned);
        (self.wake)();
    }

    fn take(&self) -> Vec<Returned> {
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        queue.drain(..).collect()
    }
}

/// The ipc part of one peer's session.
struct IpcPart {
    env: PeerEnv,
    lane_settings: LaneSettings,
    returns: Returns,
    /// The lazy setup (we are its exporting side: the sends waiting for it wait in the
    /// shell, by ticket).
    setup: PartSetup,
    /// Messages to the peer's part waiting for the link (a handful at most: one per setup
    /// step, one per buffer to unmap).
    out: VecDeque<IpcMessage>,
    /// What the shell must do.
    events: VecDeque<PartEvent>,
    /// The peer's pid and whether it runs on this host, from its hello.
    peer_pid: u32,
    same_host: bool,
    /// The peer's pools, imported when it asked (we pull from them), or on the first push
    /// into one of its buffers, or when a buffer names one we have not imported.
    pools: Arc<PoolImports>,
    /// The peer may hold imports of our pools (it asked us to import its own, or imported
    /// ours for our setup): it hears of the pools we retire.
    peer_may_import: bool,
    /// The number of our last pool retirement the peer heard of (see [`Pools`]).
    ///
    /// [`Pools`]: crate::fdshare::Pools
    retired_seen: u64,
    /// Wakes the shell when this node retires a pool (the peer is told at once).
    _retirements: Option<AbortOnDrop>,
    /// Our buffers offered for pulling, kept until the peer says it no longer reads them
    /// (`Done` or `Cancel`); handed to quarantine if the peer is lost.
    exported: HashMap<OpId, SharedBytes>,
    /// The peer's buffers we keep mapped (importing side).
    imports: Option<SharedImports>,
    /// Told when one of our buffers the peer may keep mapped is freed (exporting side).
    unmapper: Option<Arc<PeerUnmapper>>,
    /// Our freed buffers waiting for the peer to unmap them, with when it must have.
    unmapping: HashMap<IpcBufferRef, (UnmapDone, Instant)>,
    /// True while we import the peer's pools (one setup request at a time).
    importing: bool,
    /// The lane ring we offer the peer in our setup request (exporting side), under its
    /// key at our fd-sharing socket, until the setup settles.
    lane_offer: Option<(String, Arc<Ring>)>,
    /// Our sending end of the lane, once the setup settled with the peer attached.
    lane_tx: Option<Arc<LaneTx>>,
    /// The receiving end of the peer's lane (importing side).
    lane_rx: Option<LaneRx>,
}

impl IpcPart {
    fn new(env: PeerEnv, lane_settings: LaneSettings) -> Self {
        let returns = Returns {
            queue: Arc::default(),
            wake: Arc::clone(&env.wake),
        };
        // Only a node with GPUs exports (and retires) pools.
        let retirements = (!env.gpus.is_empty()).then(|| {
            let mut retired = env.gpus.pools.watch();
            let wake = Arc::clone(&env.wake);
            AbortOnDrop(env.io.spawn(async move {
                while retired.changed().await.is_ok() {
                    wake();
                }
            }))
        });
        let retired_seen = env.gpus.pools.retirements();
        Self {
            env,
            lane_settings,
            returns,
            setup: PartSetup::default(),
            out: VecDeque::new(),
            events: VecDeque::new(),
            peer_pid: 0,
            same_host: false,
            pools: Arc::default(),
            peer_may_import: false,
            retired_seen,
            _retirements: retirements,
            exported: HashMap::new(),
            imports: None,
            unmapper: None,
            unmapping: HashMap::new(),
            importing: false,
            lane_offer: None,
            lane_tx: None,
            lane_rx: None,
        }
    }

    /// Where the peer's pools are fetched from.
    fn pool_source(&self) -> PoolSource {
        PoolSource {
            node: self.env.peer.clone(),
            pid: self.peer_pid,
            secret: self.env.secret.clone(),
            gpus: Arc::clone(&self.env.gpus),
        }
    }

    /// True when the peer is a node of this very process: it copies from our memory
    /// directly (a peer copy), with nothing to import.
    fn in_process(&self) -> bool {
        self.peer_pid == std::process::id()
    }

    /// The peer's buffers we keep mapped, made on first use.
    fn imports(&mut self) -> SharedImports {
        let peer = &self.env.peer;
        Arc::clone(self.imports.get_or_insert_with(|| {
            Arc::new(Mutex::new(ImportCache::new(peer, IMPORT_CACHE_CAPACITY)))
        }))
    }

    /// This session's unmapper, made on first use.
    fn unmapper(&mut self) -> Arc<PeerUnmapper> {
        if let Some(u) = &self.unmapper {
            return Arc::clone(u);
        }
        let unmapper = Arc::new(PeerUnmapper {
            pending: Mutex::default(),
            closed: AtomicBool::new(false),
            io: self.env.io.clone(),
            lease_timeout: self.env.lease_timeout,
            wake: Arc::clone(&self.env.wake),
        });
        self.unmapper = Some(Arc::clone(&unmapper));
        unmapper
    }

    /// Carries out what the setup asks for, and what work run off the shell's thread
    /// handed back.
    fn pump(&mut self, now: Instant) {
        for returned in self.returns.take() {
            match returned {
                Returned::Imported { attempt, result } => self.imported(attempt, result),
                Returned::Unmapped(r) => self.out.push_back(IpcMessage::Unmapped(r)),
            }
        }
        if let Some(unmapper) = self.unmapper.clone() {
            for (lease, done) in unmapper.take() {
                self.ask_unmap(&lease, done, now);
            }
        }
        if self.peer_may_import {
            let (retired, last) = self.env.gpus.pools.retired_since(self.retired_seen);
            self.retired_seen = last;
            self.out
                .extend(retired.into_iter().map(IpcMessage::PoolRetired));
        }
        let (transmits, settled) = self.setup.drive(now, self.same_host, &mut self.events);
        for t in transmits {
            let (attempt, step) = match t {
                SetupTransmit::Request(a) => {
                    // The peer imports our pools for it (whatever our side decides then).
                    self.peer_may_import = true;
                    let lane = self.offer_lane();
                    (a, IpcSetupStep::Request(self.env.gpus.pool_names(), lane))
                }
                SetupTransmit::Ack(a) => (a, IpcSetupStep::Ack(None)),
                SetupTransmit::Nack(a, why) => (a, IpcSetupStep::Ack(Some(why.to_string()))),
            };
            self.out.push_back(IpcMessage::Setup(IpcSetupMessage {
                attempt: attempt.0,
                step,
            }));
        }
        if let Some(outcome) = settled {
            self.settled(outcome);
        }
    }

    /// The setup settled: the lane opens first (the node gives it its routes on the
    /// settled notice), then the shell hears how it went.
    fn settled(&mut self, outcome: SetupOutcome) {
        let label = match &outcome {
            SetupOutcome::Ok => "ok",
            SetupOutcome::Bad(_) => "bad",
        };
        metrics::counter!("ferry_ipc_setup_total", "outcome" => label).increment(1);
        self.open_lane(outcome == SetupOutcome::Ok);
        match &outcome {
            SetupOutcome::Ok => tracing::info!(peer = %self.env.peer, "ipc set up with the peer"),
            SetupOutcome::Bad(why) => tracing::warn!(
                peer = %self.env.peer,
                "ipc setup with the peer failed, falling back: {why}"
            ),
        }
        self.events.push_back(PartEvent::Settled(outcome));
    }

    /// The lane ring offered with our setup request (one per setup, whatever the number
    /// of attempts): its key at our fd-sharing socket. None when the lane is off or the
    /// peer is in this process.
    fn offer_lane(&mut self) -> Option<String> {
        // Offered before the link may be up (the setup starts with the first transfer):
        // a peer on another host cannot fetch it, and the setup fails its checks anyway.
        if self.lane_settings.max == 0 || self.in_process() {
            return None;
        }
        if let Some((key, _)) = &self.lane_offer {
            return Some(key.clone());
        }
        match Ring::create(super::lane::LANE_SLOTS, super::lane::LANE_SLOT_LEN) {
            Ok(ring) => {
                let (key, ring) = (super::lane_key(), Arc::new(ring));
                self.env.gpus.rings.insert(key.clone(), ring.clone());
                self.lane_offer = Some((key.clone(), ring));
                Some(key)
            }
            Err(e) => {
                tracing::warn!(peer = %self.env.peer, "no fast lane to the peer: {e}");
                None
            }
        }
    }

    /// The setup settled: the lane we offered opens if it went well and the peer attached.
    fn open_lane(&mut self, ok: bool) {
        let Some((key, ring)) = self.lane_offer.take() else {
            return;
        };
        self.env.gpus.rings.remove(&key);
        if !ok {
            return;
        }
        if !ring.is_attached() {
            tracing::info!(peer = %self.env.peer, "the peer did not take the fast lane");
            return;
        }
        let unmapper: Arc<dyn Unmapper> = self.unmapper();
        let records = DeviceRecords {
            max: self.lane_settings.max,
            unmapper,
        };
        let spin = self.lane_settings.spin;
        match LaneTx::start(&self.env.peer, ring, Box::new(records), spin) {
            Ok(tx) => {
                tracing::info!(peer = %self.env.peer, max = self.lane_settings.max, "fast lane to the peer open");
                if let Some(old) = self.lane_tx.replace(Arc::clone(&tx)) {
                    old.close();
                }
                self.events.push_back(PartEvent::FastPath(tx));
            }
            Err(why) => tracing::warn!(
                peer = %self.env.peer,
                "no fast lane to the peer: its watcher thread did not start: {why}"
            ),
        }
    }

    /// The peer's lane ring arrived with its setup request: our lane thread reads it.
    fn attach_lane(&mut self, ring: Ring) {
        let cx = RxContext {
            peer: self.env.peer.clone(),
            pools: Arc::clone(&self.pools),
            from: self.pool_source(),
            imports: self.imports(),
            gpus: Arc::clone(&self.env.gpus),
            deliveries: Arc::clone(&self.env.deliveries),
            memory: Arc::clone(&self.env.memory),
            share: self.env.share,
            reserve_timeout: self.env.reserve_timeout,
            io: self.env.io.clone(),
            settings: self.lane_settings,
        };
        match LaneRx::start(ring, cx) {
            // A previous lane of this session (a repeated setup) stops.
            Ok(rx) => self.lane_rx = Some(rx),
            Err(why) => {
                tracing::warn!(peer = %self.env.peer, "cannot read the peer's fast lane: {why}")
            }
        }
    }

    /// Both ends of the lanes close.
    fn end_lanes(&mut self) {
        if let Some((key, _)) = self.lane_offer.take() {
            self.env.gpus.rings.remove(&key);
        }
        if let Some(tx) = self.lane_tx.take() {
            tx.close();
        }
        if let Some(rx) = self.lane_rx.take() {
            rx.stop();
        }
    }

    /// A setup step from the peer.
    fn on_setup(&mut self, msg: IpcSetupMessage, now: Instant) {
        let attempt = Attempt(msg.attempt);
        let reply = |refused: Option<String>| {
            IpcMessage::Setup(IpcSetupMessage {
                attempt: msg.attempt,
                step: IpcSetupStep::Reply(refused),
            })
        };
        match msg.step {
            // We are the importing side.
            IpcSetupStep::Request(names, lane) => {
                // The peer runs ipc with us: it may import our pools too (to push).
                self.peer_may_import = true;
                if self.env.gpus.is_empty() {
                    return self
                        .out
                        .push_back(reply(Some("the receiver has no GPU".into())));
                }
                if self.in_process() {
                    // A node of this process: its memory is ours to copy from already.
                    return self.out.push_back(reply(None));
                }
                if self.importing {
                    // One import at a time; the peer's attempt times out and it retries.
                    return;
                }
                self.importing = true;
                let peer = self.env.peer.clone();
                let pid = self.peer_pid;
                let secret = self.env.secret.clone();
                let gpus = Arc::clone(&self.env.gpus);
                let lane = lane.filter(|_| self.lane_settings.max > 0);
                let returns = self.returns.clone();
                self.env.io.spawn(async move {
                    let imported = super::import_pools(&peer, pid, &names, &secret, &gpus).await;
                    let result = match imported {
                        Ok(pools) => Ok((pools, fetch_lane(&peer, pid, lane, &secret).await)),
                        Err(why) => Err(why.to_string()),
                    };
                    returns.put(Returned::Imported { attempt, result });
                });
            }
            IpcSetupStep::Ack(failed) => match failed {
                None => self.out.push_back(IpcMessage::Setup(IpcSetupMessage {
                    attempt: msg.attempt,
                    step: IpcSetupStep::Confirm,
                })),
                Some(why) => {
                    tracing::warn!(peer = %self.env.peer, "the peer gave up ipc setup: {why}");
                }
            },
            // We are the exporting side.
            IpcSetupStep::Reply(refused) => {
                if let Some(setup) = self.setup.machine() {
                    let reply = match refused {
                        None => PeerReply::Accepted,
                        Some(why) => PeerReply::Refused(why),
                    };
                    setup.handle_reply(now, attempt, reply);
                }
            }
            IpcSetupStep::Confirm => {
                if let Some(setup) = self.setup.machine() {
                    setup.handle_confirm(attempt);
                }
            }
        }
    }

    /// The import for the peer's setup attempt `attempt` ended: answer it.
    fn imported(
        &mut self,
        attempt: Attempt,
        result: Result<(ImportedPools, Option<Ring>), String>,
    ) {
        self.importing = false;
        let refused = match result {
            Ok((pools, ring)) => {
                let surplus = self.pools.add(pools);
                if !surplus.is_empty() {
                    self.env.io.spawn_blocking(move || drop(surplus));
                }
                if let Some(ring) = ring {
                    self.attach_lane(ring);
                }
                None
            }
            Err(why) => {
                tracing::warn!(peer = %self.env.peer, "cannot import the peer's pools: {why}");
                Some(why)
            }
        };
        self.out.push_back(IpcMessage::Setup(IpcSetupMessage {
            attempt: attempt.0,
            step: IpcSetupStep::Reply(refused),
        }));
    }

    /// We are the importer: the owner frees buffer `r`, which we unmap (off the shell's
    /// thread: a pull may hold the cache's lock through a copy, and freeing waits for the
    /// import's copies), then say so.
    fn on_unmap(&mut self, r: IpcBufferRef) {
        let Some(imports) = self.imports.clone() else {
            return self.out.push_back(IpcMessage::Unmapped(r));
        };
        let returns = self.returns.clone();
        self.env.io.spawn_blocking(move || {
            let unmapped = imports.lock().unwrap_or_else(|p| p.into_inner()).remove(&r);
            drop(unmapped);
            tracing::debug!(buffer = r.buffer, "unmapped at the owner's request");
            returns.put(Returned::Unmapped(r));
        });
    }

    /// We are the owner: one of our buffers the peer may keep mapped was freed; ask the
    /// peer to unmap it. A peer that never answers cannot pin the memory for the session's
    /// life; nor may the memory be freed while the peer still maps it. So the link goes at
    /// the lease timeout: the peer's session ends, which frees its imports, and ours frees
    /// the memory after the lease timeout.
    fn ask_unmap(&mut self, lease: &Lease, done: UnmapDone, now: Instant) {
        let MemoryKind::Device(n) = lease.kind else {
            return;
        };
        let Some(gpu) = self.env.gpus.get(n) else {
            return;
        };
        let r = super::lease_ref(&gpu.device, lease);
        tracing::debug!(
            buffer = r.buffer,
            "our buffer was freed; asking the peer to unmap it"
        );
        self.out.push_back(IpcMessage::Unmap(r.clone()));
        self.unmapping
            .insert(r, (done, now + self.env.lease_timeout));
    }
}

impl PeerTransport for IpcPart {
    fn transport(&self) -> TransportName {
        IpcSource::TRANSPORT
    }

    /// Where the peer is (its process, its host); we take its offers when it is on this
    /// host and this node has GPUs.
    fn attach(&mut self, link: &Attached<'_>) -> bool {
        self.peer_pid = link.hello.pid;
        self.same_host = link.same_host;
        self.same_host && !self.env.gpus.is_empty()
    }

    /// A send over ipc asks the setup with the peer (started by the first): go now, wait
    /// (by ticket), or fall back saying why.
    fn admit(&mut self, now: Instant) -> Admission {
        let admitted = self.setup.admit(now);
        self.pump(now);
        admitted
    }

    fn handle_message(&mut self, body: &[u8], now: Instant) -> Result<(), DescriptorError> {
        match IpcMessage::read(body)? {
            IpcMessage::Setup(setup) => self.on_setup(setup, now),
            IpcMessage::Unmap(r) => self.on_unmap(r),
            IpcMessage::Unmapped(r) => {
                tracing::debug!(
                    buffer = r.buffer,
                    "the peer unmapped our buffer; freeing it"
                );
                self.unmapping.remove(&r);
            }
            IpcMessage::PoolRetired(name) => {
                if let Some(pool) = self.pools.retire(&name) {
                    tracing::debug!(peer = %self.env.peer, %name, "the peer retired a pool; closing our import");
                    // Destroying the import is a driver call.
                    self.env.io.spawn_blocking(move || drop(pool));
                }
            }
        }
        self.pump(now);
        Ok(())
    }

    fn poll_message(&mut self) -> Option<Vec<u8>> {
        self.pump(Instant::now());
        let message = self.out.pop_front()?;
        match crate::transport::encode(&message) {
            Ok(body) => Some(body),
            Err(why) => {
                self.events
                    .push_back(PartEvent::Broke(format!("an ipc message: {why}")));
                None
            }
        }
    }

    fn poll_event(&mut self) -> Option<PartEvent> {
        self.pump(Instant::now());
        self.events.pop_front()
    }

    fn poll_timeout(&self) -> Option<Instant> {
        let setup = self.setup.poll_timeout();
        let unmap = self.unmapping.values().map(|(_, by)| *by).min();
        setup.into_iter().chain(unmap).min()
    }

    fn handle_timeout(&mut self, now: Instant) {
        self.setup.handle_timeout(now);
        if let Some((r, _)) = self.unmapping.iter().find(|(_, (_, by))| *by <= now) {
            tracing::warn!(
                peer = %self.env.peer,
                buffer = r.buffer,
                "the peer did not unmap a freed buffer in time; dropping the link"
            );
            // Asked once: the link goes, and `close` frees the memory later.
            for (_, by) in self.unmapping.values_mut() {
                *by = now + Duration::from_secs(3600);
            }
            self.events.push_back(PartEvent::Broke(
                "the peer did not unmap a freed buffer in time".into(),
            ));
        }
        self.pump(now);
    }

    fn awaits_peer(&self) -> bool {
        self.setup.awaits_peer()
    }

    fn detach(&mut self) {
        self.end_lanes();
    }

    /// The buffer's place in its pool, which the peer imports (nothing to import for a
    /// node of this process).
    fn export(&mut self, buffer: &Buffer, _: &Layout) -> Exporting {
        let described = super::export_source(buffer, self.in_process())
            .map_err(TransportError::of)
            .and_then(|source| source.describe().map_err(TransportError::from));
        Exporting::Now(described.map(|descriptor| Exported {
            descriptor,
            kept: None,
        }))
    }

    fn pulls_pushes(&self) -> bool {
        self.in_process()
    }

    /// The peer reads `buffer` (op `op`) until it says otherwise (Done or Cancel), and may
    /// keep it mapped after: its memory is freed only once the peer unmapped it.
    fn keep(&mut self, op: OpId, _: Option<Box<dyn Send>>, buffer: &Buffer) {
        let view = buffer.share();
        if self.in_process() {
            // The peer copies straight from our memory, which it finds here.
            super::offer_in_process(&self.env.node, view.clone());
        } else {
            let unmapper: Arc<dyn Unmapper> = self.unmapper();
            buffer.note_mapped(unmapper);
        }
        self.exported.insert(op, view);
    }

    fn released(&mut self, op: OpId) {
        if let Some(view) = self.exported.remove(&op) {
            super::withdraw_in_process(&self.env.node, &view);
        }
    }

    fn lands_in_device(&self) -> bool {
        true
    }

    /// Copies on a blocking thread, however small: a copy is a driver call and a wait.
    /// (Small contiguous pulls from another process take the lane.)
    fn pull(&mut self, source: &Descriptor, layout: Layout, buffer: Buffer) -> Moving<Buffer> {
        let source = match IpcSource::read(source) {
            Ok(source) => source,
            Err(e) => return Box::pin(std::future::ready(Err(TransportError::from(e)))),
        };
        let imports = self.imports();
        let gpus = Arc::clone(&self.env.gpus);
        let exporter = self.env.peer.clone();
        let in_process = self.in_process();
        let express = buffer.len() <= super::EXPRESS_PULL_MAX
            && layout == Layout::Contiguous
            && (in_process || super::is_mapped(&source, &imports));
        let io = self.env.io.clone();
        let pool = source.pool.clone();
        let start = move |pools: Arc<ImportedPools>| {
            let copy = io.spawn_blocking(move || {
                if in_process {
                    super::pull_in_process(&exporter, &source, &layout, &gpus, buffer, express)
                } else {
                    super::pull(&source, &layout, &pools, &imports, &gpus, buffer, express)
                }
            });
            async move {
                match copy.await {
                    Ok(Ok(buffer)) => Ok(buffer),
                    Ok(Err((_buffer, why))) => Err(TransportError::of(why)),
                    Err(e) => Err(TransportError::because("the ipc copy task", e)),
                }
            }
        };
        // The copy starts now when the buffer's pool is imported (nearly always); else
        // once it is (the peer replaced an idle pool since its setup).
        let pools = self.pools.snapshot();
        if in_process || pool.is_empty() || pools.contains_key(&pool) {
            return Box::pin(start(pools));
        }
        let imported = Arc::clone(&self.pools);
        let from = self.pool_source();
        Box::pin(async move {
            let pools = imported
                .with(&pool, &from)
                .await
                .map_err(TransportError::of)?;
            start(pools).await
        })
    }

    /// On a blocking thread: the peer's pool is imported on the first push to its device,
    /// the buffer is imported, copied into and freed.
    fn write(
        &mut self,
        target: &Descriptor,
        source: SharedBytes,
        layout: Layout,
        stop: Arc<AtomicBool>,
    ) -> Moving<()> {
        let target = match IpcSource::read(target) {
            Ok(target) => target,
            Err(e) => return Box::pin(std::future::ready(Err(TransportError::from(e)))),
        };
        let pools = Arc::clone(&self.pools);
        let from = self.pool_source();
        let gpus = Arc::clone(&self.env.gpus);
        let io = self.env.io.clone();
        Box::pin(async move {
            if target.legacy.is_some() || target.pool.is_empty() {
                return Err(TransportError::of(IpcError::BadDescriptor(
                    "the receiver lent memory that is not from its pool".into(),
                )));
            }
            let pool = pools
                .with(&target.pool, &from)
                .await
                .map_err(TransportError::of)?
                .get(&target.pool)
                .cloned()
                .ok_or_else(|| {
                    TransportError::of(IpcError::Gone(format!(
                        "the receiver's pool {} was not imported",
                        target.pool
                    )))
                })?;
            io.spawn_blocking(move || super::push(&target, &pool, &gpus, &source, &layout, &stop))
                .await
                .map_err(|e| TransportError::because("the ipc push task", e))?
                .map_err(TransportError::of)
        })
    }

    fn lender(&self) -> Option<Arc<dyn Lend>> {
        Some(Arc::new(IpcLender))
    }

    /// Frees our imports (off the shell's thread: it waits for their copies); our buffers
    /// the peer may still read go to quarantine; our freed buffers it may still map are
    /// freed after the lease timeout (a live peer's session with us ends too, which frees
    /// its imports); the lanes close.
    fn close(&mut self) -> Vec<(OpId, Retired)> {
        self.end_lanes();
        if let Some(imports) = self.imports.take() {
            self.env.io.spawn_blocking(move || drop(imports));
        }
        if let Some(unmapper) = self.unmapper.take() {
            for (_, done) in unmapper.close() {
                unmapper.free_later(done);
            }
            for (_, (done, _)) in self.unmapping.drain() {
                unmapper.free_later(done);
            }
        }
        let node = self.env.node.clone();
        self.exported
            .drain()
            .map(|(op, view)| {
                super::withdraw_in_process(&node, &view);
                (op, Retired::Quarantine(view))
            })
            .collect()
    }
}

/// Lends device memory to the peer's ipc pushes: exported for the peer to import. Host
/// memory is not lent (the bytes stream over the link).
struct IpcLender;

impl Lend for IpcLender {
    fn lends<'a>(&'a self, buffer: &'a Buffer) -> futures::future::BoxFuture<'a, bool> {
        Box::pin(std::future::ready(buffer.device_memory().is_some()))
    }

    fn lend(&self, buffer: Buffer) -> Result<(Box<dyn LentMemory>, Descriptor), TransportError> {
        let target = super::export_source(&buffer, false).map_err(TransportError::of)?;
        let target = target.describe()?;
        // At the session's end, to quarantine: the peer may still be copying.
        let lent = LentBuffer::new(buffer, |b| Retired::Quarantine(b.share()));
        Ok((Box::new(lent), target))
    }
}

/// Collects our buffers that the peer may keep mapped and that were just freed, for the
/// part to ask the peer to unmap them (it wakes the shell, which polls the part). Holds at
/// most what the peer can map (its import cache is bounded).
struct PeerUnmapper {
    pending: Mutex<Vec<(Lease, UnmapDone)>>,
    closed: AtomicBool,
    io: tokio::runtime::Handle,
    lease_timeout: Duration,
    wake: crate::transport::Wake,
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
        (self.wake)();
    }
}

/// Fetches and maps the lane ring the peer offered under `key` (none offered: `None`). A
/// lane that cannot be had is not an ipc failure: the peer sees we did not attach and
/// keeps the slow path.
async fn fetch_lane(
    peer: &str,
    pid: u32,
    key: Option<String>,
    secret: &crate::link::Secret,
) -> Option<Ring> {
    let key = key?;
    let mapped = match crate::fdshare::fetch(peer, pid, &key, secret).await {
        Ok(fd) => Ring::open(fd).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    mapped
        .inspect_err(|why| tracing::warn!(peer, "cannot map the peer's fast lane: {why}"))
        .ok()
}
