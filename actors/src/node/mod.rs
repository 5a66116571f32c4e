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

mod memory;
mod publish;
mod regions;
mod start;

pub use self::regions::{OneSided, Places};
pub use crate::publish::region::Access;

use self::start::*;

/// What a send moves and where it lands: under `tag` (or into a region of the peer's), the
/// `packed` bytes `layout` names.
struct Shape {
    tag: u64,
    layout: Layout,
    packed: u64,
    into: Option<ferry_transports::wire::RegionWrite>,
    /// Over the link (tcp) when the rules give its memory no route (a notification).
    over_link: bool,
}

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
    /// Per peer, what its sends take (one lookup each): their order, its credit, its
    /// fast path (added by its transfer actor) and, while its link is up, its routes and
    /// transfer actor (sends go there without the coordinator's mailbox; see
    /// [`crate::direct`]).
    peers: Arc<crate::direct::PeerHandles>,
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
            peers: Arc::new(crate::direct::PeerHandles::new(config.limits.peer_queue)),
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
            peers: shared.peers,
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
        // Small buffers to a same-host peer take a fast lane when nothing to that peer goes
        // the slow way or by another lane (then they queue behind it, keeping the order).
        let handle = self.peers.handle(peer);
        if let Some(lane) = (layout == Layout::Contiguous)
            .then(|| handle.lane_for(&buffer))
            .flatten()
            && let Some(turn) = handle.order.try_lane(usize::MAX, lane.transport)
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
        let shape = Shape {
            tag,
            layout,
            packed,
            into: None,
            over_link: false,
        };
        self.send_routed(peer, &handle, buffer, shape, deadline)
            .await
    }

    /// Sends `buffer` shaped as `shape` says by the peer's routes, to its transfer actor
    /// when its link is up (without the coordinator's mailbox), else by the coordinator.
    async fn send_routed(
        &self,
        peer: &str,
        handle: &crate::direct::PeerHandle,
        buffer: Buffer,
        shape: Shape,
        deadline: Instant,
    ) -> Result<Buffer, SendError> {
        let Shape {
            tag,
            layout,
            packed,
            into,
            over_link,
        } = shape;
        // The peer's routes, when its link is up: the send goes to its transfer actor
        // without the coordinator's mailbox.
        let src = crate::coordinator::memory_class(buffer.kind());
        let direct = handle.routes().and_then(|d| {
            let routed = match d.table.route(src, packed) {
                Some(routed) => routed.clone(),
                // A notification the rules give no route goes over the link itself.
                None if over_link => crate::direct::Routed {
                    transport: ferry_transports::registry::LINK,
                    direction: ferry_transports::wire::WireDirection::Push,
                    fallback: None,
                    failed_over: Vec::new(),
                },
                None => return None,
            };
            Some((d.submissions.clone(), d.peer_class, routed))
        });
        // The layout moves into whichever message is made.
        let to = peer.to_string();
        let make = move |buffer, may_go_direct: bool| match direct.filter(|_| may_go_direct) {
            Some((submissions, peer_class, routed)) => {
                let mut op = crate::peer::Op::send_routed(routed, tag, layout, None, packed);
                if let Some(into) = into {
                    op = op.into_region(into);
                }
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
                into,
            })),
        };
        self.with_credit(peer, handle, deadline, buffer, make).await
    }

    /// True when sends to `peer` go to its transfer actor without the coordinator's mailbox
    /// (its link is up and its routes are known; see [`crate::direct`]).
    pub fn routes_directly(&self, peer: &str) -> bool {
        self.peers.routes(peer).is_some()
    }

    /// True when small buffers to `peer` take a same-host fast lane (a transport's setup
    /// with it made one; see `transport.ipc.lane_max`, `transport.shm.lane_max`).
    pub fn has_fast_lane(&self, peer: &str) -> bool {
        self.peers.has_lane(peer)
    }

    /// Waits for credit to `peer` until `deadline`, then hands the message `make` makes of
    /// the buffer to where it goes ([`Via`]); the credit is held until the op ended. `make`
    /// may send to the peer's transfer actor itself (it is told so) only when no message to
    /// the coordinator for the peer is still unanswered: the coordinator might not have
    /// passed it on yet, and the order would break.
    async fn with_credit(
        &self,
        peer: &str,
        handle: &crate::direct::PeerHandle,
        deadline: Instant,
        buffer: Buffer,
        make: impl FnOnce(Buffer, bool) -> Via + Send + 'static,
    ) -> Result<Buffer, SendError> {
        let commit = commit(
            Arc::clone(&handle.order),
            Arc::clone(&handle.credits),
            self.handovers.clone(),
            peer.to_string(),
            (deadline, buffer, make),
        );
        // The turn is held until the outcome, as the credit is: a fast-path send asked for
        // after this one starts only once this one ended at the peer (it could overtake it
        // otherwise; the peer's fast path orders after slow transfers that completed).
        // Also when this future is dropped: the transfer runs on, and so does the wait.
        let io = self.io.as_ref().map(|io| io.handle().clone());
        let held = {
            let io = io.clone();
            move |(outcome, permit, turn)| HeldToTheEnd {
                outcome: Some(outcome),
                held: Some(Box::new((permit, turn))),
                io,
            }
        };
        let mut commit = Box::pin(async move { commit.await.map(held) });
        // Most sends are handed over in their first poll, here. One that must wait first
        // (for its turn, the peer's credit, room in the channel) waits in a task of the
        // node's: once polled, a send runs to its end whether or not this future is polled
        // again (the task's output, dropped with no one to take it, waits on).
        let committed = match futures::poll!(commit.as_mut()) {
            std::task::Poll::Ready(committed) => committed,
            std::task::Poll::Pending => match &io {
                Some(io) => io.spawn(commit).await.unwrap_or_else(|_| {
                    Err(SendError {
                        error: Error::ShuttingDown,
                        buffer: None,
                    })
                }),
                None => commit.await,
            },
        };
        committed?.await
    }

    /// `peer`'s credit: the sends, puts and fetches it may have outstanding.
    fn credits(&self, peer: &str) -> Arc<Semaphore> {
        Arc::clone(&self.peers.handle(peer).credits)
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
        let handle = self.peers.handle(peer);
        self.with_credit(peer, &handle, deadline, buffer, make)
            .await
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
        crate::order::OrderGuard,
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
    Ok((handed, permit, turn))
}

/// A handed-over send's outcome, with what it holds until the transfer ended (the peer's
/// credit, the send's turn): dropped before that, it hands both to a task of the node's
/// runtime that waits for the outcome, so a dropped send keeps its place to the end.
struct HeldToTheEnd {
    outcome: Option<futures::future::BoxFuture<'static, Result<Buffer, SendError>>>,
    held: Option<Box<dyn Send>>,
    io: Option<tokio::runtime::Handle>,
}

impl std::future::Future for HeldToTheEnd {
    type Output = Result<Buffer, SendError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let Some(outcome) = self.outcome.as_mut() else {
            return std::task::Poll::Ready(Err(SendError {
                error: Error::ShuttingDown,
                buffer: None,
            }));
        };
        let done = std::task::ready!(outcome.as_mut().poll(cx));
        self.outcome = None;
        self.held = None;
        std::task::Poll::Ready(done)
    }
}

impl Drop for HeldToTheEnd {
    fn drop(&mut self) {
        let (Some(outcome), Some(held)) = (self.outcome.take(), self.held.take()) else {
            return;
        };
        let wait = async move {
            drop(outcome.await);
            drop(held);
        };
        match (self.io.take()).or_else(|| tokio::runtime::Handle::try_current().ok()) {
            Some(io) => drop(io.spawn(wait)),
            // No runtime left: the node is gone, and its sends with it.
            None => drop(wait),
        }
    }
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
