//! The ipc transport's part of a peer ([`PeerPart`]): pulls out of the peer's pools, pushes
//! into buffers the peer lends, and our buffers lent for its pushes; outside the seam, its
//! own control plane: the unmap protocol, the lazy setup and the fast lane.

use super::*;
use ferry_transports::ipc::IpcError;

impl PeerPart for IpcState {
    fn transport(&self) -> ferry_config::TransportName {
        IpcSource::TRANSPORT
    }

    /// Where the peer is (its process, its host); we take its offers when it is on this
    /// host and this node has GPUs.
    fn attach(&mut self, hello: &ferry_transports::wire::Hello, cx: &PartCx) -> bool {
        self.peer_pid = hello.pid;
        self.same_host = *hello.host_id == *cx.setup.host_id;
        self.same_host && !cx.setup.gpus.is_empty()
    }

    /// The buffer's place in its pool, which the peer imports (nothing to import for a
    /// node of this process).
    fn export(&mut self, buffer: &Buffer, _: &Layout, _: &PartCx) -> Exporting {
        let described = ferry_transports::ipc::export_source(buffer, self.in_process())
            .map_err(|e| e.to_string())
            .and_then(|source| source.describe().map_err(|e| e.to_string()));
        Exporting::Now(
            described
                .map(|descriptor| Exported {
                    source: PullSource {
                        transport: IpcSource::TRANSPORT,
                        descriptor,
                    },
                    kept: None,
                })
                .map_err(Error::unsupported),
        )
    }

    fn pulls_pushes(&self) -> bool {
        self.in_process()
    }

    /// The peer reads `buffer` (op `op`) until it says otherwise (Done or Cancel), and may
    /// keep it mapped after: its memory is freed only once the peer unmapped it.
    fn keep(
        &mut self,
        op: OpId,
        (_, buffer): (Exported, &Buffer),
        me: &Addr<TransferActor>,
        cx: &PartCx,
    ) {
        let view = buffer.share();
        if self.in_process() {
            // The peer copies straight from our memory, which it finds here.
            ferry_transports::ipc::offer_in_process(&cx.setup.node, view.clone());
        } else {
            let unmapper: Arc<dyn Unmapper> = self.unmapper(cx.setup, me);
            buffer.note_mapped(unmapper);
        }
        self.exported.insert(op, view);
    }

    fn released(&mut self, op: OpId, cx: &PartCx) {
        if let Some(view) = self.exported.remove(&op) {
            ferry_transports::ipc::withdraw_in_process(&cx.setup.node, &view);
        }
    }

    fn lands_in_device(&self, _: &PartCx) -> bool {
        true
    }

    /// Copies on a blocking thread, however small: a copy is a driver call and a wait.
    /// (Small contiguous pulls from another process take the lane.)
    fn pull(
        &mut self,
        source: PullSource,
        layout: Layout,
        buffer: Buffer,
        cx: &PartCx,
    ) -> Moving<Buffer> {
        if source.transport != IpcSource::TRANSPORT {
            return foreign(source.transport);
        }
        let source = match IpcSource::read(&source.descriptor) {
            Ok(source) => source,
            Err(e) => return Box::pin(std::future::ready(Err(MoveError::from(e)))),
        };
        let pools = Arc::clone(&self.imported);
        let imports = Arc::clone(self.imports.get_or_insert_with(|| {
            Arc::new(std::sync::Mutex::new(
                ferry_transports::ipc::ImportCache::new(
                    cx.peer,
                    ferry_transports::ipc::IMPORT_CACHE_CAPACITY,
                ),
            ))
        }));
        let gpus = Arc::clone(&cx.setup.gpus);
        let exporter = cx.peer.to_string();
        let in_process = self.in_process();
        let express = buffer.len() <= ferry_transports::ipc::EXPRESS_PULL_MAX
            && layout == Layout::Contiguous
            && (in_process || ferry_transports::ipc::is_mapped(&source, &imports));
        let copy = cx.setup.io.spawn_blocking(move || {
            if in_process {
                ferry_transports::ipc::pull_in_process(
                    &exporter, &source, &layout, &gpus, buffer, express,
                )
            } else {
                ferry_transports::ipc::pull(
                    &source, &layout, &pools, &imports, &gpus, buffer, express,
                )
            }
        });
        Box::pin(async move {
            match copy.await {
                Ok(Ok(buffer)) => Ok(buffer),
                Ok(Err((_buffer, why))) => Err(MoveError::from(why)),
                Err(e) => Err(MoveError::Task(e.to_string())),
            }
        })
    }

    /// On a blocking thread: the peer's pool is imported on the first push to its device,
    /// the buffer is imported, copied into and freed.
    fn write(
        &mut self,
        target: PushTarget,
        (source, layout): (SharedBytes, Layout),
        stop: Arc<AtomicBool>,
        cx: &PartCx,
    ) -> Moving<()> {
        if target.transport != IpcSource::TRANSPORT {
            return foreign(target.transport);
        }
        let target = match IpcSource::read(&target.descriptor) {
            Ok(target) => target,
            Err(e) => return Box::pin(std::future::ready(Err(MoveError::from(e)))),
        };
        let pools = Arc::clone(&self.push_pools);
        let peer = cx.peer.to_string();
        let pid = self.peer_pid;
        let secret = cx.setup.secret.clone();
        let gpus = Arc::clone(&cx.setup.gpus);
        let io = cx.setup.io.clone();
        Box::pin(async move {
            let pool = {
                let mut pools = pools.lock().await;
                if !pools.contains_key(&target.device_uuid) {
                    let uuids = std::slice::from_ref(&target.device_uuid);
                    let fetched =
                        ferry_transports::ipc::import_pools(&peer, pid, uuids, &secret, &gpus)
                            .await?;
                    pools.extend(fetched);
                }
                pools
                    .get(&target.device_uuid)
                    .cloned()
                    .ok_or_else(|| IpcError::Gone("the receiver's pool was not imported".into()))?
            };
            io.spawn_blocking(move || {
                ferry_transports::ipc::push(&target, &pool, &gpus, &source, &layout, &stop)
            })
            .await
            .map_err(|e| IpcError::Gone(format!("the push task failed: {e}")))??;
            Ok(())
        })
    }

    fn lender(&self, _: &PartCx) -> Option<Arc<dyn Lend>> {
        Some(Arc::new(IpcLender))
    }

    /// Frees our imports (off the actor thread: it waits for their copies); our buffers the
    /// peer may still read go to quarantine; our freed buffers it may still map are freed
    /// after the lease timeout (a live peer's session with us ends too, which frees its
    /// imports).
    fn close(&mut self, cx: &PartCx) -> Vec<(u64, Retired)> {
        if let Some(imports) = self.imports.take() {
            cx.setup.io.spawn_blocking(move || drop(imports));
        }
        if let Some(unmapper) = self.unmapper.take() {
            let pending = unmapper.close();
            // Wakes the forwarding task, which then finds the actor gone and ends.
            unmapper.wake.notify_one();
            for (_, done) in pending {
                unmapper.free_later(done);
            }
            for (_, done) in self.unmapping.drain() {
                unmapper.free_later(done);
            }
        }
        self.exported
            .drain()
            .map(|(op, view)| {
                ferry_transports::ipc::withdraw_in_process(&cx.setup.node, &view);
                (op.0, Retired::Quarantine(view))
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

    fn lend(&self, buffer: Buffer) -> Result<(Box<dyn LentMemory>, PushTarget), String> {
        let target =
            ferry_transports::ipc::export_source(&buffer, false).map_err(|e| e.to_string())?;
        let target = PushTarget {
            transport: IpcSource::TRANSPORT,
            descriptor: target.describe().map_err(|e| e.to_string())?,
        };
        Ok((Box::new(LentDevice(buffer)), target))
    }
}

/// Device memory lent to the peer's ipc push.
#[derive(Debug)]
struct LentDevice(Buffer);

impl LentMemory for LentDevice {
    fn kind(&self) -> ferry_transports::memory::MemoryKind {
        self.0.kind()
    }

    fn give_back_blocks(&self) -> bool {
        false
    }

    fn give_back(self: Box<Self>) -> Buffer {
        self.0
    }

    /// After a failed push it goes at once (the peer's copy ended before its `Written`);
    /// at the end of the session, to quarantine (the peer may still be copying).
    fn retire(self: Box<Self>, written: bool) -> Retired {
        if written {
            Retired::Gone
        } else {
            Retired::Quarantine(self.0.share())
        }
    }
}

impl IpcState {
    /// This session's unmapper, made on first use, with the task that hands its work to
    /// the actor `me` (it ends with the actor).
    pub(super) fn unmapper(
        &mut self,
        setup: &TransferSetup,
        me: &Addr<TransferActor>,
    ) -> Arc<PeerUnmapper> {
        if let Some(u) = &self.unmapper {
            return Arc::clone(u);
        }
        let unmapper = Arc::new(PeerUnmapper {
            pending: std::sync::Mutex::default(),
            wake: tokio::sync::Notify::new(),
            closed: AtomicBool::new(false),
            io: setup.io.clone(),
            lease_timeout: setup.lease_timeout,
        });
        self.unmapper = Some(Arc::clone(&unmapper));
        let me = me.clone();
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
}

impl TransferActor {
    /// A send over ipc asks the setup with the peer (started by the first): its ticket,
    /// and the verdict when there is one already (go, or fall back saying why).
    pub(super) fn ipc_admission(&mut self) -> (u64, Option<Option<SetupFailure>>) {
        let ticket = self.ipc.next_ticket;
        self.ipc.next_ticket += 1;
        let setup = (self.ipc.setup).get_or_insert_with(|| IpcSetup::new(SetupPolicy::DEFAULT));
        let verdict = match setup.handle_want(Instant::now(), ticket) {
            Admission::Ready(_) => Some(None),
            Admission::Queued => None,
            Admission::FallBack(_, why) => Some(Some(why)),
        };
        (ticket, verdict)
    }

    /// When the setup next needs the timer.
    pub(super) fn ipc_setup_timeout(&self) -> Option<Instant> {
        self.ipc.setup.as_ref().and_then(|s| s.poll_timeout())
    }

    /// The timer fired at `now`.
    pub(super) fn ipc_setup_timer(&mut self, now: Instant) {
        if let Some(setup) = &mut self.ipc.setup {
            setup.handle_timeout(now);
        }
    }

    /// We are the importer: the owner frees buffer `r`, which we unmap (off this thread: a
    /// pull may hold the cache's lock through a copy, and freeing waits for the import's
    /// copies), then say so.
    pub(super) fn on_ipc_unmap(&mut self, r: IpcBufferRef, ctx: &mut Context<Self>) {
        let Some(imports) = self.ipc.imports.clone() else {
            return self.ipc.out.push_back(IpcMessage::Unmapped(r));
        };
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
            act.ipc.out.push_back(IpcMessage::Unmapped(r));
            act.drive(ctx);
        }));
    }

    /// We are the owner: the peer no longer maps buffer `r`, which is freed now.
    pub(super) fn on_ipc_unmapped(&mut self, r: &IpcBufferRef) {
        tracing::debug!(
            buffer = r.buffer,
            "the peer unmapped our buffer; freeing it"
        );
        self.ipc.unmapping.remove(r);
    }

    /// Carries out what the ipc setup asks for: its messages, its checks, and the
    /// submissions it releases.
    pub(super) fn drive_ipc_setup(&mut self, ctx: &mut Context<Self>) {
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
                self.ipc.out.push_back(IpcMessage::Setup(IpcSetupMessage {
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
                let ok = outcome == SetupOutcome::Ok;
                // The lane opens first: the coordinator gives it its routes on this notice,
                // which therefore waits for room in a full mailbox rather than being lost
                // (a lane without routes carries nothing).
                self.open_lane(ok, ctx);
                let notice = IpcSettled {
                    peer: self.peer.clone(),
                    epoch: self.epoch,
                    outcome: outcome.clone(),
                };
                if let Err(actix::prelude::SendError::Full(notice)) =
                    self.setup.settled.try_send(notice)
                {
                    let settled = self.setup.settled.clone();
                    ctx.spawn(
                        async move {
                            let _ = settled.send(notice).await;
                        }
                        .into_actor(self),
                    );
                }
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
                self.held.settled(ticket, failed);
            }
            self.release_held(ctx);
            if !moved {
                return;
            }
        }
    }

    /// The lane ring offered with our setup request (one per setup, whatever the number
    /// of attempts): its key at our fd-sharing socket. None when the lane is off or the peer is
    /// in this process.
    pub(super) fn offer_lane(&mut self) -> Option<String> {
        // Offered before the link may be up (the setup starts with the first transfer):
        // a peer on another host cannot fetch it, and the setup fails its checks anyway.
        if self.setup.lane.max == 0 || self.ipc.in_process() {
            return None;
        }
        if let Some((key, _)) = &self.ipc.lane_offer {
            return Some(key.clone());
        }
        let ring = ferry_transports::link::ring::Ring::create(
            ferry_transports::ipc::lane::LANE_SLOTS,
            ferry_transports::ipc::lane::LANE_SLOT_LEN,
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
    pub(super) fn open_lane(&mut self, ok: bool, ctx: &mut Context<Self>) {
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
        let unmapper: Arc<dyn ferry_transports::memory::Unmapper> =
            self.ipc.unmapper(&self.setup, &ctx.address());
        match ferry_transports::ipc::lane::LaneTx::start(
            &self.peer,
            ring,
            self.setup.lane,
            unmapper,
        ) {
            Ok(tx) => {
                tracing::info!(peer = %self.peer, max = self.setup.lane.max, "fast lane to the peer open");
                let path: Arc<dyn ferry_transports::transport::FastPath> = tx;
                let lane = Arc::new(crate::direct::FastLane::new(path));
                self.setup
                    .lanes
                    .insert(self.peer.clone(), Arc::clone(&lane));
                if let Some(old) = self.ipc.lane_tx.replace(lane) {
                    old.path.close();
                }
            }
            Err(why) => tracing::warn!(
                peer = %self.peer,
                "no fast lane to the peer: its watcher thread did not start: {why}"
            ),
        }
    }

    /// The peer's lane ring arrived with its setup request: our lane thread reads it.
    pub(super) fn attach_lane(&mut self, ring: ferry_transports::link::ring::Ring) {
        let peer = &self.peer;
        let imports = Arc::clone(self.ipc.imports.get_or_insert_with(|| {
            Arc::new(std::sync::Mutex::new(
                ferry_transports::ipc::ImportCache::new(
                    peer,
                    ferry_transports::ipc::IMPORT_CACHE_CAPACITY,
                ),
            ))
        }));
        let deliveries = crate::inbox::PathDeliveries {
            inbox: Arc::clone(&self.setup.inbox),
            peer: self.peer.clone(),
            transport: IpcSource::TRANSPORT,
            undelivered: self.undelivered.clone(),
        };
        let memory = crate::allocator::TierMemory {
            tiers: self.setup.tiers.clone(),
        };
        let cx = ferry_transports::ipc::lane::RxContext {
            peer: self.peer.clone(),
            pools: Arc::clone(&self.ipc.imported),
            imports,
            gpus: Arc::clone(&self.setup.gpus.devices),
            deliveries: Arc::new(deliveries),
            memory: Arc::new(memory),
            share: self.setup.limits.inbound_bytes,
            reserve_timeout: self.setup.reserve_timeout,
            io: self.setup.io.clone(),
            settings: self.setup.lane,
        };
        match ferry_transports::ipc::lane::LaneRx::start(ring, cx) {
            // A previous lane of this session (a repeated setup) stops.
            Ok(rx) => self.ipc.lane_rx = Some(rx),
            Err(why) => {
                tracing::warn!(peer = %self.peer, "cannot read the peer's fast lane: {why}")
            }
        }
    }

    /// The session ends: both ends of the lanes close.
    pub(super) fn end_lanes(&mut self) {
        if let Some((key, _)) = self.ipc.lane_offer.take() {
            self.setup.gpus.rings.remove(&key);
        }
        if let Some(tx) = self.ipc.lane_tx.take() {
            self.setup
                .lanes
                .remove_if(&self.peer, |_, current| Arc::ptr_eq(current, &tx));
            tx.path.close();
        }
        if let Some(rx) = self.ipc.lane_rx.take() {
            rx.stop();
        }
    }

    /// A setup message from the peer.
    pub(super) fn on_ipc_setup(&mut self, msg: IpcSetupMessage, ctx: &mut Context<Self>) {
        let attempt = Attempt(msg.attempt);
        match msg.step {
            // We are the importing side.
            IpcSetupStep::Request(uuids, lane) => {
                if self.setup.gpus.is_empty() {
                    self.ipc.out.push_back(IpcMessage::Setup(IpcSetupMessage {
                        attempt: msg.attempt,
                        step: IpcSetupStep::Reply(Some("the receiver has no GPU".into())),
                    }));
                    return;
                }
                if self.ipc.in_process() {
                    // A node of this process: its memory is ours to copy from already.
                    self.ipc.out.push_back(IpcMessage::Setup(IpcSetupMessage {
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
                        ferry_transports::ipc::import_pools(&peer, pid, &uuids, &secret, &gpus)
                            .await?;
                    Ok::<_, IpcError>((pools, fetch_lane(&peer, pid, lane, &secret).await))
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
                            Some(why.to_string())
                        }
                    };
                    act.ipc.out.push_back(IpcMessage::Setup(IpcSetupMessage {
                        attempt: attempt.0,
                        step: IpcSetupStep::Reply(refused),
                    }));
                    act.drive(ctx);
                }));
            }
            IpcSetupStep::Ack(failed) => match failed {
                None => self.ipc.out.push_back(IpcMessage::Setup(IpcSetupMessage {
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

/// The ipc part of a session: the lazy setup (as the exporting side; the sends waiting for
/// it wait in the shell's `Held`), the peer's pools and buffers we imported (as the importing side), the views of
/// our buffers the peer may still be reading, and the fast lane.
#[derive(Default)]
pub(super) struct IpcState {
    pub(super) setup: Option<IpcSetup<u64>>,
    pub(super) next_ticket: u64,
    /// Messages to the peer's part waiting for the link (a handful at most: one per setup
    /// step, one per buffer to unmap).
    pub(super) out: VecDeque<IpcMessage>,
    /// The peer's pid and whether it runs on this host, from its hello.
    pub(super) peer_pid: u32,
    pub(super) same_host: bool,
    /// The peer's pools, imported when it asked (we pull from them).
    pub(super) imported: Arc<ferry_transports::ipc::ImportedPools>,
    /// Our buffers offered for pulling, kept until the peer says it no longer reads them
    /// (`Done` or `Cancel`); handed to the allocator's quarantine if the peer is lost.
    pub(super) exported: HashMap<OpId, SharedBytes>,
    /// The peer's buffers we keep mapped (importing side).
    pub(super) imports: Option<ferry_transports::ipc::SharedImports>,
    /// Told when one of our buffers the peer may keep mapped is freed (exporting side).
    pub(super) unmapper: Option<Arc<PeerUnmapper>>,
    /// Our freed buffers waiting for the peer to unmap them.
    pub(super) unmapping: HashMap<IpcBufferRef, UnmapDone>,
    /// True while we import the peer's pools (one setup request at a time).
    pub(super) importing: bool,
    /// The lane ring we offer the peer in our setup request (exporting side), under its
    /// key at our fd-sharing socket, until the setup settles.
    pub(super) lane_offer: Option<(String, Arc<ferry_transports::link::ring::Ring>)>,
    /// Our sending end of the lane, once the setup settled with the peer attached.
    pub(super) lane_tx: Option<Arc<crate::direct::FastLane>>,
    /// The receiving end of the peer's lane (importing side).
    pub(super) lane_rx: Option<ferry_transports::ipc::lane::LaneRx>,
    /// The peer's pools we push into (sending side), by device UUID, each fetched on the
    /// first push to it; the lock makes one fetch at a time.
    pub(super) push_pools: Arc<tokio::sync::Mutex<ferry_transports::ipc::ImportedPools>>,
}

impl IpcState {
    /// True when the peer is a node of this very process: it copies from our memory
    /// directly (a peer copy), with nothing to import.
    pub(super) fn in_process(&self) -> bool {
        self.peer_pid == std::process::id()
    }
}

/// Collects our buffers that the peer may keep mapped and that were just freed, for the
/// actor to ask the peer to unmap them. Holds at most what the peer can map (its import
/// cache is bounded).
pub struct PeerUnmapper {
    pub(super) pending: std::sync::Mutex<Vec<(Lease, UnmapDone)>>,
    pub(super) wake: tokio::sync::Notify,
    pub(super) closed: AtomicBool,
    pub(super) io: tokio::runtime::Handle,
    pub(super) lease_timeout: Duration,
}

impl PeerUnmapper {
    /// Frees `done`'s memory after the lease timeout: for a peer we can no longer ask.
    pub(super) fn free_later(&self, done: UnmapDone) {
        let wait = self.lease_timeout;
        self.io.spawn(async move {
            tokio::time::sleep(wait).await;
            drop(done);
        });
    }

    /// No more requests: the session ended. Returns what was still pending.
    pub(super) fn close(&self) -> Vec<(Lease, UnmapDone)> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        self.closed.store(true, Ordering::Release);
        std::mem::take(&mut *pending)
    }

    pub(super) fn take(&self) -> Vec<(Lease, UnmapDone)> {
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
pub(super) struct UnmapRequests;

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
            let r = ferry_transports::ipc::lease_ref(&gpu.device, &lease);
            tracing::debug!(
                buffer = r.buffer,
                "our buffer was freed; asking the peer to unmap it"
            );
            self.ipc.out.push_back(IpcMessage::Unmap(r.clone()));
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

/// Sends frames and streams buffers until the queue closes or the socket fails. Every
/// stream it takes ends with a `StreamEnded`, after its view of the buffer was dropped.
/// Fetches and maps the lane ring the peer offered under `key` (none offered: `None`). A
/// lane that cannot be had is not an ipc failure: the peer sees we did not attach and
/// keeps the slow path.
pub(super) async fn fetch_lane(
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
