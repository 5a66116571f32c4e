//! Starting and stopping a node: the actor system on its own thread, an I/O runtime for
//! the links, the listeners, and the API that ordinary async code calls.
//!
//! Every method of [`Node`] is a future that works from any async runtime (tokio or not):
//! it sends a message to an actor through its bounded mailbox and awaits the answer.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use dashmap::DashMap;
use ferry_config::{Config, MemoryClass};
use ferry_transports::cuda::{DeviceBuffer, ExternalMemory};
use ferry_transports::link::admission::{AdmissionLimits, Gate};
use ferry_transports::link::{self, Endpoint, LinkCounters, LinkOptions, Listener, Secret};
use ferry_transports::memory::{
    Buffer, BufferId, Generation, Lease, MemoryHome, MemoryKind, Releaser,
};
use ferry_transports::region::{ExposedRegion, RegionKey};
use ferry_transports::wire::{HelloPurpose, Layout};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::allocator::{
    Allocator, DomainHandle, DomainStats, SetHome, Stats, Tier, reserve_in_tiers,
};
use crate::coordinator::{
    Connect, ConnectedPeers, Coordinator, CoordinatorSetup, Explain, FetchFrom, LinkUp, PutTo,
    SendTo, Shutdown, TransferSetupBase,
};
use crate::core::budget::BudgetStats;
use crate::core::route::Explanation;
use crate::core::session::SessionLimits;
use crate::error::{Error, SendError};
use crate::inbox::{Inbox, Received};

mod start;

use self::start::*;

/// Where a send's message goes (see `Node::with_credit`).
enum Via {
    /// The coordinator, which routes it (dialing the peer first when need be).
    Coordinator(crate::coordinator::Handed),
    /// The peer's transfer actor, the send routed from the peer's table.
    Actor(crate::peer::Submissions, crate::peer::Submit),
}

/// A running ferry node.
pub struct Node {
    name: String,
    config: Arc<Config>,
    coordinator: Addr<Coordinator>,
    /// Where sends and puts go to be routed by the coordinator.
    handovers: crate::coordinator::Handovers,
    inbox: Arc<Inbox>,
    host: DomainHandle,
    pinned: DomainHandle,
    gpus: crate::gpu::SharedGpus,
    /// Where received buffers land first (said in every hello).
    receives: MemoryKind,
    /// The host identity said in every hello (see [`host_identity`]).
    host_id: Arc<str>,
    /// Per peer, the sends and puts it may have outstanding: `send` waits for a permit.
    credit: DashMap<String, Arc<Semaphore>>,
    /// The fast lanes to same-host peers (see [`crate::lane`]), added by the transfer
    /// actors.
    lanes: Arc<DashMap<String, Arc<crate::direct::FastLane>>>,
    /// Each connected peer's routes and transfer actor: sends go there without the
    /// coordinator's mailbox ([`crate::direct`]).
    direct: Arc<DashMap<String, Arc<crate::direct::DirectRoutes>>>,
    /// Per peer, the order between lane sends and the rest.
    order: DashMap<String, Arc<crate::order::Order>>,
    exposed: Arc<DashMap<u64, ExposedRegion>>,
    next_region: AtomicU64,
    /// What this node published for its peers to fetch.
    published: Arc<crate::publish::Publications>,
    /// This node's fetches on their way (single flight).
    flights: Arc<crate::fetch::Flights>,
    counters: Arc<LinkCounters>,
    tcp_addrs: Vec<String>,
    unix_path: Option<PathBuf>,
    system: System,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The threads peers' sessions run on.
    peer_threads: Vec<actix::Arbiter>,
    io: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("name", &self.name)
            .field("listens", &self.tcp_addrs)
            .finish_non_exhaustive()
    }
}

impl Node {
    /// Starts a node: validates `config`, reads the secret, binds the listeners and starts
    /// the actors.
    ///
    /// # Errors
    /// [`Error::Config`] for an invalid configuration or a missing secret (without
    /// `security.danger_insecure`), [`Error::Start`] when a listener cannot bind.
    pub async fn start(config: Config) -> Result<Self, Error> {
        config.validate()?;
        for deprecated in config.deprecated_keys() {
            tracing::warn!("{deprecated}");
        }
        let secret = node_secret(&config)?;
        let config = Arc::new(config);
        let io = StartingRuntime(Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("ferry-io")
                .enable_all()
                .build()
                .map_err(|e| Error::start("cannot start the I/O runtime", e))?,
        ));
        // Bind every listener before anything else runs, so a bad address fails start-up.
        let (listeners, unix_path) = bind_listeners(&io, &config).await?;
        let tcp_addrs = listeners
            .iter()
            .filter_map(|l| match l.endpoint() {
                Ok(Endpoint::Tcp(a)) => Some(a),
                _ => None,
            })
            .collect();

        let counters = Arc::new(LinkCounters::new());
        let link_opts = LinkOptions {
            max_frame: u32::try_from(config.limits.max_frame).unwrap_or(u32::MAX),
            handshake_timeout: config.limits.handshake_timeout,
            stall_timeout: config.limits.stall_timeout,
            counters: Arc::clone(&counters),
        };
        let (opened, visible) = open_gpus(&config)?;
        let shared = Shared {
            exposed: Arc::default(),
            inbox: Arc::new(Inbox::new(config.limits.peer_queue, config.node.recv_spin)),
            gpu_pools: Arc::default(),
            lane_rings: Arc::default(),
            lanes: Arc::default(),
            direct: Arc::default(),
            published: Arc::default(),
        };
        let (thread, rx) = spawn_actors(ActorParts {
            config: Arc::clone(&config),
            secret: secret.clone(),
            link: link_opts.clone(),
            io: io.handle().clone(),
            opened,
            visible,
            shared: shared.clone(),
        })?;
        let started = rx
            .await
            .map_err(|e| Error::start("the actor system did not start", e))?;
        serve_fd_sharing(&io, &config.node.name, &secret, &shared).await?;
        let acceptor = Acceptor {
            coordinator: started.coordinator.clone(),
            gate: Gate::new(
                AdmissionLimits {
                    total: config.limits.handshakes,
                    per_source: config.limits.handshakes_per_source,
                },
                Some("ferry_handshakes_shed_total"),
            ),
            first_byte: config.limits.first_byte_timeout,
            secret,
            opts: link_opts,
            node: config.node.name.clone(),
            receives: started.receives,
            transports: started.transports,
            host_id: Arc::clone(&started.host_id),
        };
        for listener in listeners {
            io.spawn(accept_loop(listener, acceptor.clone()));
        }
        tracing::info!(node = %config.node.name, "node started");
        Ok(Self {
            name: config.node.name.clone(),
            config,
            coordinator: started.coordinator,
            handovers: started.handovers,
            inbox: shared.inbox,
            host: started.host,
            pinned: started.pinned,
            gpus: started.gpus,
            receives: started.receives,
            host_id: started.host_id,
            credit: DashMap::new(),
            lanes: shared.lanes,
            direct: shared.direct,
            order: DashMap::new(),
            exposed: shared.exposed,
            next_region: AtomicU64::new(1),
            published: shared.published,
            flights: Arc::default(),
            counters,
            tcp_addrs,
            unix_path,
            system: started.system,
            thread: Some(thread),
            peer_threads: started.peer_threads,
            io: Some(io.into_inner()),
        })
    }

    /// The memory class this node receives into by default, as its hello tells peers, who
    /// route their sends to it for that class: `memory.receive_into` as it resolved at
    /// start (`"device"` on a node without a GPU is host).
    pub fn receive_class(&self) -> MemoryClass {
        crate::coordinator::memory_class(self.receives)
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The host identity this node tells its peers: `node.host_id`, else the machine's
    /// (see [`host_identity`]). A peer that says the same is same-host, any other remote.
    pub fn host_id(&self) -> &str {
        &self.host_id
    }

    /// The configuration the node runs with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The TCP addresses the node listens on (with the actual port when `:0` was asked).
    pub fn tcp_addrs(&self) -> &[String] {
        &self.tcp_addrs
    }

    /// The Unix socket the node listens on, if any.
    pub fn unix_path(&self) -> Option<&std::path::Path> {
        self.unix_path.as_deref()
    }

    /// Link counters: authentication failures and rejected frames by reason.
    pub fn link_counters(&self) -> &LinkCounters {
        &self.counters
    }

    fn default_deadline(&self) -> Instant {
        Instant::now() + self.config.limits.default_deadline
    }

    fn domain(&self, kind: MemoryKind) -> Result<&DomainHandle, Error> {
        match kind {
            MemoryKind::Host => Ok(&self.host),
            MemoryKind::PinnedHost => Ok(&self.pinned),
            MemoryKind::Device(n) => self.gpus.domain(n).ok_or_else(|| {
                Error::unsupported(format!(
                    "GPU {n} is not one of this node's GPUs ({:?}; see gpu.devices)",
                    self.gpus
                ))
            }),
            other => Err(Error::unsupported(format!(
                "{other} memory is not served here"
            ))),
        }
    }

    /// Allocates `len` bytes of `kind` memory under the domain's budget, waiting for
    /// budget up to the default deadline.
    ///
    /// # Errors
    /// [`Error::NoMemory`] when it does not fit in time; [`Error::Unsupported`] for a kind
    /// this build cannot allocate.
    pub async fn alloc(&self, kind: MemoryKind, len: usize) -> Result<Buffer, Error> {
        let mut parts = self.alloc_parts(kind, &[len as u64]).await?;
        parts.pop().ok_or(Error::ShuttingDown)
    }

    /// Allocates every part at once or none, in `kind` memory, waiting for budget up to the
    /// default deadline. A waiting request holds nothing, so callers that each need several
    /// parts never hold some while waiting for the rest.
    ///
    /// # Errors
    /// As [`Self::alloc`].
    pub async fn alloc_parts(&self, kind: MemoryKind, parts: &[u64]) -> Result<Vec<Buffer>, Error> {
        reserve_in_tiers(&[self.tier(kind)?], parts, self.default_deadline()).await
    }

    /// The tier of `kind` memory: its domain's allocator.
    fn tier(&self, kind: MemoryKind) -> Result<Tier, Error> {
        Ok(self.domain(kind)?.tier())
    }

    /// Makes device memory the caller allocated outside ferry (`cudaMalloc`, a framework's
    /// tensor: described by an [`ExternalMemory`], whose unsafe constructor is the promise
    /// that it stays allocated) a buffer that can be sent. Same-host peers read it through
    /// a legacy CUDA IPC handle, which they keep open (cached by allocation identity, never
    /// by address) for the next transfer of the same allocation. It counts against no budget,
    /// and cannot be received into.
    ///
    /// End the registration with [`Self::unregister_external`], not by dropping the buffer:
    /// only its answer says when the memory may be freed.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a GPU this node does not use; [`Error::Usage`] for memory
    /// the driver does not know, a range past its allocation's end, memory of another GPU,
    /// or memory legacy IPC cannot export (pool or VMM allocations).
    pub fn register_external(&self, memory: ExternalMemory) -> Result<Buffer, Error> {
        let n = memory.device();
        let gpu = self.gpus.get(n).ok_or_else(|| {
            Error::unsupported(format!(
                "GPU {n} is not one of this node's GPUs ({:?}; see gpu.devices)",
                self.gpus
            ))
        })?;
        let device = DeviceBuffer::register_external(memory, &gpu.device, &gpu.copy_stream)
            .map_err(|e| Error::Usage(format!("cannot register the memory: {e}")))?;
        let lease = Lease {
            kind: MemoryKind::Device(n),
            id: BufferId(EXTERNAL_IDS.fetch_add(1, Ordering::Relaxed)),
            generation: Generation(0),
            len: memory.len() as u64,
        };
        Ok(Buffer::new_device(
            lease,
            device,
            Arc::new(Unbudgeted),
            None,
        ))
    }

    /// Ends the registration of [`Self::register_external`]: drops `buffer` and waits until
    /// nothing uses the memory any more (ferry's copies done, every peer's mapping of it
    /// closed). After `Ok` the caller may free the memory. A peer that does not unmap in
    /// time loses its link (`memory.export_lease_timeout`), so this ends within the default
    /// deadline plus that timeout.
    ///
    /// # Errors
    /// [`Error::Usage`] for a buffer that is not registered memory (it is dropped, which
    /// frees it as usual); [`Error::DeadlineExceeded`] when the memory is still in use at
    /// the end: do not free it then.
    pub async fn unregister_external(&self, buffer: Buffer) -> Result<(), Error> {
        let signal = buffer
            .device_memory()
            .and_then(|m| m.release_signal())
            .ok_or_else(|| Error::Usage("the buffer is not registered memory".into()))?;
        drop(buffer);
        let wait = self.config.limits.default_deadline + self.config.memory.export_lease_timeout;
        tokio::time::timeout(wait, signal.wait())
            .await
            .map_err(|_| Error::DeadlineExceeded)
    }

    /// A memory domain's counters: budget, granted, exported, quarantined, waiting, and the
    /// memory of dropped buffers it keeps for later grants (`kept`: bytes now, and how many
    /// grants reused such memory; `memory.keep_idle`, `memory.keep_max`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a GPU the node does not use; [`Error::ShuttingDown`] once
    /// the node stopped.
    pub async fn memory(&self, kind: MemoryKind) -> Result<DomainStats, Error> {
        self.domain(kind)?
            .actor
            .send(Stats)
            .await
            .map_err(|_| Error::ShuttingDown)
    }

    /// Sends `buffer` to `peer` under `tag`, with the default deadline. Resolves to the
    /// buffer once the peer holds every byte.
    ///
    /// **Order.** Buffers to one peer are delivered there in the order their `send`
    /// futures were first polled, whatever their sizes, paths and completion order. Sends
    /// that must stay in order are polled in that order: awaited one by one, or each polled
    /// once as it is made (a spawned task's first poll may come after a later one's).
    ///
    /// # Errors
    /// A [`SendError`] that gives the buffer back where it can.
    ///
    /// # Cancel safety
    /// Dropping the future does not cancel the transfer: it runs to its end and the buffer
    /// is then freed.
    pub async fn send(&self, peer: &str, tag: u64, buffer: Buffer) -> Result<Buffer, SendError> {
        self.send_by(peer, tag, buffer, self.default_deadline())
            .await
    }

    /// [`Self::send`] with an explicit deadline.
    ///
    /// When `limits.peer_queue` transfers to `peer` are already outstanding, this waits for
    /// one of them to end (backpressure), until `deadline`.
    pub async fn send_by(
        &self,
        peer: &str,
        tag: u64,
        buffer: Buffer,
        deadline: Instant,
    ) -> Result<Buffer, SendError> {
        self.send_shaped(peer, tag, buffer, Layout::Contiguous, deadline)
            .await
    }

    /// Sends the bytes of `buffer` that `layout` names (rows at a pitch, planes of them, or a
    /// list of blocks), packed: the peer's [`Received`] holds them one row (or block) after
    /// the other, with the layout. The buffer comes back whole. As [`Self::send`] otherwise
    /// (its deadline is the node's default).
    ///
    /// Device memory is gathered by the copy engine: an ipc pull or push is one 3D copy
    /// (a few at most), or one batch of copies for a block list (one copy per block on a
    /// driver older than CUDA 12.8); tcp gathers each chunk into host memory.
    ///
    /// # Errors
    /// [`Error::Usage`] naming what is wrong with a layout that does not fit the buffer
    /// (for a block list: an empty block, one past the end, more than
    /// [`ferry_transports::wire::MAX_BLOCKS`]), before anything moves, or with a block list
    /// whose offer is larger than the peer's `limits.max_frame`; else as [`Self::send`].
    pub async fn send_layout(
        &self,
        peer: &str,
        tag: u64,
        buffer: Buffer,
        layout: Layout,
    ) -> Result<Buffer, SendError> {
        self.send_shaped(peer, tag, buffer, layout, self.default_deadline())
            .await
    }

    async fn send_shaped(
        &self,
        peer: &str,
        tag: u64,
        mut buffer: Buffer,
        layout: Layout,
        deadline: Instant,
    ) -> Result<Buffer, SendError> {
        // Checked once here; the packed length travels with the send (the coordinator
        // routes by it, the transfer actor offers it), so a block list is not walked again.
        let packed = match layout.check(buffer.len() as u64) {
            Ok(packed) => packed,
            Err(e) => {
                return Err(SendError {
                    error: Error::Usage(format!("the layout does not fit the buffer: {e}")),
                    buffer: Some(buffer),
                });
            }
        };
        // Small device buffers to a same-host peer take the fast lane when nothing to that
        // peer goes the slow way (then they queue behind it, keeping the order).
        let lane = self.lanes.get(peer).map(|l| Arc::clone(l.value()));
        if let Some(lane) = lane.filter(|l| l.fits(&buffer) && layout == Layout::Contiguous)
            && let Some(turn) = self.order(peer).try_lane(usize::MAX)
        {
            let fail = |e: ferry_transports::transport::FastPathError| SendError {
                error: Error::from_fast_path(peer, e.failure),
                buffer: e.buffer,
            };
            // Published now (then it runs to its end), or not at all: a full path gives the
            // buffer back, and it goes the slow way behind the sends already on the path.
            match lane.path.send(tag, buffer, deadline, Box::new(turn)) {
                Ok(answer) => return answer.await.map_err(fail),
                Err(e) if e.failure == ferry_transports::transport::FastPathFailure::Full => {
                    match e.buffer {
                        Some(b) => buffer = b,
                        None => return Err(fail(e)),
                    }
                }
                Err(e) => return Err(fail(e)),
            }
        }
        // The peer's routes, when its link is up: the send goes to its transfer actor
        // without the coordinator's mailbox.
        let src = crate::coordinator::memory_class(buffer.kind());
        let direct = self.direct.get(peer).and_then(|d| {
            let routed = d.table.route(src, packed)?.clone();
            Some((d.submissions.clone(), d.peer_class, routed))
        });
        // The layout moves into whichever message is made.
        let to = peer.to_string();
        let make = move |buffer, may_go_direct: bool| match direct.filter(|_| may_go_direct) {
            Some((submissions, peer_class, routed)) => {
                crate::coordinator::count_failovers(&routed);
                let op = crate::peer::Op::Send {
                    tag,
                    transport: routed.transport,
                    direction: routed.direction,
                    fallback: routed.fallback,
                    layout,
                    fetch: None,
                    packed,
                };
                let submit = crate::peer::Submit {
                    op,
                    buffer,
                    deadline,
                    peer_class,
                };
                Via::Actor(submissions, submit)
            }
            None => Via::Coordinator(crate::coordinator::Handed::Send(SendTo {
                peer: to,
                tag,
                buffer,
                layout,
                packed,
                deadline,
                fetch: None,
            })),
        };
        self.with_credit(peer, deadline, buffer, make).await
    }

    /// True when sends to `peer` go to its transfer actor without the coordinator's mailbox
    /// (its link is up and its routes are known; see [`crate::direct`]).
    pub fn routes_directly(&self, peer: &str) -> bool {
        self.direct.contains_key(peer)
    }

    /// True when small device buffers to `peer` take the same-host fast lane (the ipc
    /// setup with it made one; see `transport.ipc.lane_max`).
    pub fn has_fast_lane(&self, peer: &str) -> bool {
        self.lanes.contains_key(peer)
    }

    fn order(&self, peer: &str) -> Arc<crate::order::Order> {
        if let Some(o) = self.order.get(peer) {
            return Arc::clone(o.value());
        }
        Arc::clone(self.order.entry(peer.to_string()).or_default().value())
    }

    /// Waits for credit to `peer` until `deadline`, then hands the message `make` makes of
    /// the buffer to where it goes ([`Via`]); the credit is held until the op ended. `make`
    /// may send to the peer's transfer actor itself (it is told so) only when no message to
    /// the coordinator for the peer is still unanswered: the coordinator might not have
    /// passed it on yet, and the order would break.
    async fn with_credit(
        &self,
        peer: &str,
        deadline: Instant,
        buffer: Buffer,
        make: impl FnOnce(Buffer, bool) -> Via + Send + 'static,
    ) -> Result<Buffer, SendError> {
        let commit = commit(
            self.order(peer),
            self.credits(peer),
            self.handovers.clone(),
            peer.to_string(),
            (deadline, buffer, make),
        );
        let mut commit = Box::pin(commit);
        // Most sends are handed over in their first poll, here. One that must wait first
        // (for its turn, the peer's credit, room in the channel) waits in a task of the
        // node's: once polled, a send runs to its end whether or not this future is polled
        // again.
        let committed = match futures::poll!(commit.as_mut()) {
            std::task::Poll::Ready(committed) => committed,
            std::task::Poll::Pending => match &self.io {
                Some(io) => io.spawn(commit).await.unwrap_or_else(|_| {
                    Err(SendError {
                        error: Error::ShuttingDown,
                        buffer: None,
                    })
                }),
                None => commit.await,
            },
        };
        let (outcome, _permit) = committed?;
        outcome.await
    }

    /// `peer`'s credit: the sends, puts and fetches it may have outstanding.
    fn credits(&self, peer: &str) -> Arc<Semaphore> {
        self.credit
            .entry(peer.to_string())
            .or_insert_with(|| Arc::new(Semaphore::new(self.config.limits.peer_queue)))
            .clone()
    }

    /// Receives the oldest buffer delivered from `from` (a peer name, or `None` for any)
    /// with `tag` (or `None` for any tag). Waits until one arrives.
    ///
    /// # Cancel safety
    /// Cancel safe: a buffer delivered after the future was dropped goes to the next
    /// matching `recv`.
    pub async fn recv(&self, from: Option<&str>, tag: Option<u64>) -> Result<Received, Error> {
        self.inbox.recv(from, tag).await
    }

    /// Exposes `buffer` for one-sided puts by peers; give the key to the peer, and take the
    /// buffer back with [`Self::withdraw`].
    pub fn expose(&self, buffer: Buffer) -> RegionKey {
        let region = self.next_region.fetch_add(1, Ordering::Relaxed);
        let key = RegionKey {
            region,
            generation: buffer.lease().generation.0,
            len: buffer.len() as u64,
        };
        self.exposed.insert(
            region,
            ExposedRegion {
                buffer,
                generation: key.generation,
            },
        );
        key
    }

    /// Withdraws an exposed region and gives its buffer back; later puts to the key fail.
    ///
    /// # Errors
    /// [`Error::Usage`] for a key that is not exposed (or stale).
    pub fn withdraw(&self, key: RegionKey) -> Result<Buffer, Error> {
        self.exposed
            .remove_if(&key.region, |_, r| r.generation == key.generation)
            .map(|(_, r)| r.buffer)
            .ok_or_else(|| Error::Usage(format!("region {} is not exposed", key.region)))
    }

    /// Writes `buffer` at `offset` into the region `key` that `peer` exposed. Resolves to
    /// the buffer once the peer confirmed every byte landed.
    pub async fn put(
        &self,
        peer: &str,
        key: RegionKey,
        offset: u64,
        buffer: Buffer,
    ) -> Result<Buffer, SendError> {
        let deadline = self.default_deadline();
        let to = peer.to_string();
        let message = move |buffer| PutTo {
            peer: to,
            key,
            offset,
            buffer,
            deadline,
        };
        let make =
            move |buffer, _| Via::Coordinator(crate::coordinator::Handed::Put(message(buffer)));
        self.with_credit(peer, deadline, buffer, make).await
    }

    /// Publishes `buffer` under `key` for every peer to fetch ([`Self::fetch`]) until
    /// [`Self::unpublish`]. The buffer stays granted in its memory domain (it counts against
    /// the budget like any buffer a peer reads); peers read it through read-only handles,
    /// so nothing writes it while it is published.
    ///
    /// # Errors
    /// [`Error::Usage`] for an empty key, one longer than
    /// [`ferry_transports::wire::MAX_KEY_LEN`] bytes, or one published already; the buffer
    /// comes back in the error.
    pub fn publish(&self, key: impl Into<String>, buffer: Buffer) -> Result<(), SendError> {
        self.publish_to(key, buffer, None)
    }

    /// [`Self::publish`] for the named peers only: another peer's fetch is refused
    /// ([`crate::RefusalReason::NotAllowed`]).
    ///
    /// # Errors
    /// As [`Self::publish`].
    pub fn publish_for(
        &self,
        key: impl Into<String>,
        buffer: Buffer,
        peers: &[&str],
    ) -> Result<(), SendError> {
        let peers = peers.iter().map(|p| (*p).to_string()).collect();
        self.publish_to(key, buffer, Some(peers))
    }

    fn publish_to(
        &self,
        key: impl Into<String>,
        buffer: Buffer,
        readers: Option<Vec<String>>,
    ) -> Result<(), SendError> {
        self.published
            .publish(key.into(), buffer, readers)
            .map_err(|(error, buffer)| SendError {
                error,
                buffer: Some(buffer),
            })
    }

    /// Ends the publication of `key`: no new fetch finds it, and this waits until no peer
    /// reads the buffer any more (every fetch being served ended and its hold on the memory
    /// let go: an ipc or ucx read is held until the peer's `Done`, or quarantined for the
    /// lease timeout when the peer died), then gives the buffer back.
    ///
    /// # Errors
    /// [`Error::Usage`] for a key not published; [`Error::DeadlineExceeded`] when a peer
    /// still reads it after the default deadline plus `memory.export_lease_timeout` (the
    /// buffer is then freed once the last reader let go).
    ///
    /// # Cancel safety
    /// The key is gone at the first poll. Dropping the future then does not publish it
    /// again: the buffer is freed once the last reader let go (a caller that needs it back
    /// keeps awaiting).
    pub async fn unpublish(&self, key: &str) -> Result<Buffer, Error> {
        let wait = self.config.limits.default_deadline + self.config.memory.export_lease_timeout;
        self.published.unpublish(key, wait).await
    }

    /// What `key` has served while published (`None` for a key not published): the
    /// exporter's count of the fetches that crossed the link.
    pub fn publication(&self, key: &str) -> Option<crate::publish::PublicationStats> {
        self.published.stats(key)
    }

    /// The keys this node publishes now.
    pub fn published_keys(&self) -> Vec<String> {
        self.published.keys()
    }

    /// Fetches what `peer` published under `key`: the whole buffer, or the bytes
    /// `fetch.layout` names (packed), landing where this node receives (`memory.receive_into`)
    /// or copied into `fetch.into`.
    ///
    /// **Single flight.** Concurrent fetches of the same (peer, key, layout) on this node
    /// share one transfer: the first moves the bytes, the others wait for it and each gets
    /// a copy made here (a device copy on the same GPU, a peer copy to another GPU), or
    /// the one read-only handle with `fetch.shared`. The last caller to take the landed
    /// buffer takes it without a copy. A flight that fails fails every caller with its
    /// error; dropping one caller's future cancels nothing else (the flight goes on).
    ///
    /// # Errors
    /// [`Error::Refused`] with [`crate::RefusalReason::UnknownKey`] or
    /// [`crate::RefusalReason::NotAllowed`]; [`Error::Usage`] for a bad key or a layout that
    /// does not fit the published buffer; [`Error::QueueFull`] when
    /// [`crate::fetch::MAX_JOINERS`] callers wait for the flight already; else as
    /// [`Self::send`] fails (the peer lost, the deadline, no memory for the landing or the
    /// copy).
    pub async fn fetch(
        &self,
        peer: &str,
        key: &str,
        fetch: crate::fetch::Fetch,
    ) -> Result<crate::fetch::Fetched, Error> {
        crate::publish::check_key(key)?;
        if let Some(kind) = fetch.into {
            self.domain(kind)?;
        }
        let deadline = fetch.deadline.unwrap_or_else(|| self.default_deadline());
        let seat = self.flights.seat(peer, key, &fetch.layout)?;
        let joined = !seat.leads;
        if seat.leads
            && let Err(e) = self.start_flight(peer, key, &fetch.layout, deadline)
        {
            // Callers that joined meanwhile must not wait for a flight that never left.
            self.flights.land(peer, key, &fetch.layout, Err(e.clone()));
            return Err(e);
        }
        let share = seat.landed(deadline).await?;
        let transport = share.transport();
        let landed = share.buffer().kind();
        let want = fetch.into.unwrap_or(landed);
        let buffer = if fetch.shared && want == landed {
            share.buffer().read_only_handle()
        } else {
            self.own(share, want, deadline).await?
        };
        Ok(crate::fetch::Fetched {
            buffer,
            transport,
            joined,
            peer: peer.to_string(),
            key: key.to_string(),
            layout: fetch.layout,
        })
    }

    /// The node's fetch counters: fetches, flights (those that crossed the link), joined
    /// fetches and the bytes they saved.
    pub fn fetch_stats(&self) -> crate::fetch::FetchStats {
        self.flights.stats()
    }

    /// Starts the flight of a fetch: a task of its own on the I/O runtime, so that no
    /// caller's cancellation cancels it; it lands the flight whatever happens.
    fn start_flight(
        &self,
        peer: &str,
        key: &str,
        layout: &Layout,
        deadline: Instant,
    ) -> Result<(), Error> {
        let io = self.io.as_ref().ok_or(Error::ShuttingDown)?;
        // Callers that join later may wait longer than the first: the flight takes the
        // node's default deadline at least (each caller still stops waiting at its own).
        let deadline = deadline.max(self.default_deadline());
        let flights = Arc::clone(&self.flights);
        let credits = self.credits(peer);
        let coordinator = self.coordinator.clone();
        let ask = FetchFrom {
            peer: peer.to_string(),
            key: key.to_string(),
            layout: layout.clone(),
            deadline,
        };
        io.spawn(async move {
            let (peer, key, layout) = (ask.peer.clone(), ask.key.clone(), ask.layout.clone());
            let outcome = async {
                let _permit = acquire(credits, deadline).await?;
                coordinator
                    .send(ask)
                    .await
                    .map_err(|_| Error::ShuttingDown)?
            }
            .await;
            flights.land(&peer, &key, &layout, outcome);
        });
        Ok(())
    }

    /// A buffer of the caller's own in `kind` memory with the landed bytes of `share`: the
    /// landed buffer itself when this caller is its last holder (asked before and after
    /// waiting for memory), else a copy, allocated under the domain's budget (waiting for
    /// it until `deadline`) and made off the caller's thread.
    async fn own(
        &self,
        share: Arc<crate::fetch::Share>,
        kind: MemoryKind,
        deadline: Instant,
    ) -> Result<Buffer, Error> {
        use crate::fetch::Share;
        /// How long one wait for memory lasts before the caller looks again whether it
        /// holds the landing alone (the others took theirs, or let go of a moment's view).
        const LOOK_AGAIN: Duration = Duration::from_millis(5);
        // The landing itself serves only a caller that wants its memory.
        let same = share.buffer().kind() == kind;
        let sole = |share| {
            if same {
                Share::into_sole(share)
            } else {
                Err(share)
            }
        };
        let tier = self.tier(kind)?;
        let len = share.buffer().len() as u64;
        let mut share = share;
        let mut copy = loop {
            share = match sole(share) {
                Ok(landed) => return Ok(landed),
                Err(share) => share,
            };
            let now = Instant::now();
            let until = deadline.min(now + LOOK_AGAIN);
            match reserve_in_tiers(std::slice::from_ref(&tier), &[len], until).await {
                Ok(mut got) => break got.pop().ok_or(Error::ShuttingDown)?,
                Err(Error::NoMemory {
                    cause: crate::NoMemoryCause::DeadlinePassed,
                    ..
                }) if until < deadline => continue,
                Err(e) => return Err(e),
            }
        };
        // The others may have taken theirs meanwhile: the reservation goes back then.
        let share = match sole(share) {
            Ok(landed) => return Ok(landed),
            Err(share) => share,
        };
        let io = self.io.as_ref().ok_or(Error::ShuttingDown)?;
        let copied = io
            .spawn_blocking(move || copy.copy_from(share.buffer()).map(|()| copy))
            .await
            .map_err(|_| Error::ShuttingDown)?;
        copied.map_err(|e| Error::Transport {
            peer: self.name.clone(),
            detail: format!("the copy of a fetched buffer failed: {e}"),
        })
    }

    /// How a transfer of `bytes` from `src` memory here to `peer` would be routed, and why.
    ///
    /// `dst`, the memory at the peer's end: `None` asks for the route a send takes now, for
    /// the memory the peer said in its hello it receives into (host memory before the first
    /// link to it: connect first to ask about a peer's real memory); a class asks what-if.
    /// The explanation's query says which it used and where it came from (`dst_from`).
    pub async fn explain(
        &self,
        peer: &str,
        bytes: u64,
        src: MemoryClass,
        dst: impl Into<Option<MemoryClass>>,
    ) -> Result<Explanation, Error> {
        self.coordinator
            .send(Explain {
                peer: peer.to_string(),
                bytes,
                src,
                dst: dst.into(),
            })
            .await
            .map_err(|_| Error::ShuttingDown)?
    }

    /// The host domain's budget counters.
    pub async fn host_memory(&self) -> Result<BudgetStats, Error> {
        Ok(self.memory(MemoryKind::Host).await?.budget)
    }

    /// Connects to `peer` now, if not connected yet, and resolves once the link is up.
    ///
    /// With DNS discovery (`discovery.mode = "dns"`), a peer not known yet is waited for
    /// until discovery has had its first answers and probed them, so a node that has just
    /// started can connect to a peer it finds by DNS.
    ///
    /// # Errors
    /// [`Error::PeerUnreachable`] with the reason (no such peer, connection refused,
    /// authentication failed, another node answered at the peer's address, ...).
    pub async fn connect(&self, peer: &str) -> Result<(), Error> {
        self.coordinator
            .send(Connect {
                peer: peer.to_string(),
            })
            .await
            .map_err(|_| Error::ShuttingDown)?
    }

    /// What one transport's part of the session with `peer` says of itself for a
    /// diagnostic (`what` is the transport's own word: ucx answers `"lanes"` with its
    /// [`ferry_transports::ucx::EndpointLanes`], `"unpacked_keys"` with a `usize`).
    /// Connects (the link) if needed.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the part says nothing of `what` (or this node does not
    /// serve the transport); [`Error::Transport`] when it could not find out; as
    /// [`Node::connect`] for the link.
    pub async fn inspect(
        &self,
        peer: &str,
        transport: ferry_config::TransportName,
        what: &str,
    ) -> Result<Box<dyn std::any::Any + Send>, Error> {
        self.coordinator
            .send(crate::coordinator::InspectPeer {
                peer: peer.to_string(),
                transport,
                what: what.to_string(),
            })
            .await
            .map_err(|_| Error::ShuttingDown)?
    }

    /// Peers with a live link.
    pub async fn connected_peers(&self) -> Result<Vec<String>, Error> {
        self.coordinator
            .send(ConnectedPeers)
            .await
            .map_err(|_| Error::ShuttingDown)
    }

    /// Stops taking new work, lets transfers in flight end (each within its deadline),
    /// closes the links and stops the node's threads.
    pub async fn shutdown(mut self) {
        let drain = self.coordinator.send(Shutdown);
        let limit = self.config.limits.default_deadline + Duration::from_secs(1);
        if tokio::time::timeout(limit, drain).await.is_err() {
            tracing::warn!("shutdown: transfers did not drain in time");
        }
        self.stop();
    }

    fn stop(&mut self) {
        self.system.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // The system stopped them; their sessions end before the I/O runtime does.
        for thread in self.peer_threads.drain(..) {
            thread.stop();
            let _ = thread.join();
        }
        if let Some(io) = self.io.take() {
            io.shutdown_background();
        }
        if let Some(path) = &self.unix_path {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Waits for a permit of `permits` until `deadline`.
async fn acquire(
    permits: Arc<Semaphore>,
    deadline: Instant,
) -> Result<OwnedSemaphorePermit, Error> {
    let wait = permits.acquire_owned();
    match tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), wait).await {
        Ok(Ok(permit)) => Ok(permit),
        Ok(Err(_)) => Err(Error::ShuttingDown),
        Err(_) => Err(Error::DeadlineExceeded),
    }
}

/// A send's way into its peer's actor (or the coordinator): its turn in the peer's order,
/// one of the peer's credits, then the hand-over, after which it runs to its end. Resolves
/// with the future of its outcome and the credit it holds (the turn passes at the
/// hand-over). The turn has a deadline too: a send queued behind one that waits long for
/// credit fails at its own deadline (its ticket is skipped).
async fn commit(
    order: Arc<crate::order::Order>,
    credits: Arc<Semaphore>,
    handovers: crate::coordinator::Handovers,
    peer: String,
    (deadline, buffer, make): (Instant, Buffer, impl FnOnce(Buffer, bool) -> Via),
) -> Result<
    (
        futures::future::BoxFuture<'static, Result<Buffer, SendError>>,
        OwnedSemaphorePermit,
    ),
    SendError,
> {
    let Ok(mut turn) = tokio::time::timeout_at(deadline.into(), order.slow()).await else {
        return Err(SendError {
            error: Error::DeadlineExceeded,
            buffer: Some(buffer),
        });
    };
    let permit = match acquire(credits, deadline).await {
        Ok(p) => p,
        Err(error) => {
            return Err(SendError {
                error,
                buffer: Some(buffer),
            });
        }
    };
    // Handed over before the next send to the peer may hand over its own (the turn passes
    // once it is in the channel), over a channel the receiving actor reads.
    let handed = match make(buffer, order.coordinator_idle()) {
        Via::Actor(submissions, submit) => {
            crate::peer::hand_over(&submissions, submit, &peer).await
        }
        Via::Coordinator(message) => {
            let unanswered = Some(order.via_coordinator());
            crate::coordinator::hand_over(&handovers, message, unanswered).await
        }
    };
    turn.pass();
    Ok((handed, permit))
}

/// What the accept loop needs besides the listener: shared by every listener of a node.
#[derive(Clone)]
struct Acceptor {
    coordinator: Addr<Coordinator>,
    /// The handshakes in progress, bounded.
    gate: Gate,
    first_byte: Duration,
    secret: Secret,
    opts: LinkOptions,
    node: String,
    /// Where the node lands received buffers by default, for its hello.
    receives: MemoryKind,
    /// The transports the node serves, for its hello.
    transports: crate::coordinator::NodeTransports,
    /// The node's host identity, for its hello.
    host_id: Arc<str>,
}

/// Accepts connections as fast as they come and runs each handshake in its own task, so a
/// slow or hostile connection never holds up the others: accepting never waits for room.
/// Handshakes in progress are bounded in all and per source address (`limits.handshakes`,
/// `limits.handshakes_per_source`); a new connection past a bound sheds the oldest pending
/// one that has said nothing (then the oldest that has sent part of its preamble), never
/// one whose preamble arrived whole (see [`Gate`]); a connection that says nothing within
/// `limits.first_byte_timeout` is closed.
async fn accept_loop(listener: Listener, acceptor: Acceptor) {
    loop {
        let (mut accepted, from) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: transient, back off a little.
                tracing::warn!(node = %acceptor.node, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // A peer that sent its whole preamble before we took its connection (a real one
        // does, at once) is admitted past it, out of reach of idle connections.
        let (ticket, shed) = acceptor.gate.admit_accepted(&mut accepted);
        if shed > 0 {
            tracing::debug!(%from, shed, "handshake bound reached: shed the least advanced");
        }
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let handshake = async {
                accepted
                    .first_byte(acceptor.first_byte)
                    .await
                    .map_err(|e| format!("silent connection closed: {e}"))?;
                let hello = crate::coordinator::node_hello(
                    &acceptor.node,
                    &acceptor.host_id,
                    acceptor.receives,
                    acceptor.opts.max_frame,
                    &acceptor.transports,
                );
                link::accept_handshake(accepted, &acceptor.secret, hello, &acceptor.opts)
                    .await
                    .map_err(|e| e.to_string())
            };
            let result = ticket
                .run(handshake)
                .await
                .unwrap_or_else(|| Err("shed: too many handshakes in progress".to_string()));
            match result {
                Ok(mut link) => match &link.peer_hello.purpose {
                    // Only who answers here (DNS discovery): our hello told it.
                    HelloPurpose::Probe => {
                        tracing::debug!(%from, peer = %link.peer_hello.node, "answered a discovery probe");
                        let _ = link.writer.shutdown().await;
                    }
                    // A dial meant for another node: keeping it would give the dialer's
                    // session to the wrong node (the dialer drops it too, and says so).
                    HelloPurpose::LinkTo(wanted) if *wanted != acceptor.node => {
                        tracing::warn!(
                            %from,
                            peer = %link.peer_hello.node,
                            %wanted,
                            "refused a link meant for another node (the peer was told this node's address for {wanted})"
                        );
                        metrics::counter!("ferry_links_refused_total", "reason" => "wrong_node")
                            .increment(1);
                        let _ = link.writer.shutdown().await;
                    }
                    HelloPurpose::Link | HelloPurpose::LinkTo(_) => {
                        let _ = acceptor
                            .coordinator
                            .send(LinkUp { link, dialed: None })
                            .await;
                    }
                },
                Err(e) => tracing::warn!(%from, error = %e, "connection refused"),
            }
        });
    }
}

/// The host identity a node with `config` tells its peers, and compares theirs with to
/// decide whether a peer is on its host: `node.host_id` when set, else the machine's
/// ([`link::host_id`]: `/etc/machine-id`, else the boot id, else the host name). Containers
/// and network namespaces of one machine share the latter; set `node.host_id` where they
/// must count as different hosts, or the same one where they do not share it. Reads a few
/// small files; never fails.
pub fn host_identity(config: &Config) -> Arc<str> {
    match &config.node.host_id {
        Some(id) => Arc::from(id.as_str()),
        None => Arc::from(link::host_id()),
    }
}

/// Ids of registered memory: a range of their own (top bit set), so they never meet the ids
/// a GPU domain's allocator hands out under the same memory kind.
static EXTERNAL_IDS: AtomicU64 = AtomicU64::new(1 << 63);

/// Registered memory counts against no budget: its release gives nothing back.
struct Unbudgeted;

impl Releaser for Unbudgeted {
    fn release(&self, _: &Lease) {}
}
