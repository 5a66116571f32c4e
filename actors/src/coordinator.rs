//! The coordinator actor of a node: knows the peers, dials them lazily, keeps one transfer
//! actor per peer, chooses each transfer's route, and matches delivered buffers with
//! `recv` calls.
//!
//! One link per peer. When two nodes dial each other at the same moment, both keep the
//! link dialed by the node whose name sorts first, so they agree without a round trip.
//!
//! Peers come from `[[peers]]`, from the nodes that dial this one, and, with
//! `discovery.mode = "dns"`, from DNS: a task on the I/O runtime looks the names up every
//! `discovery.interval` and sends the answers here; [`Discovery`] decides which addresses to
//! probe (a link that only asks who answers) and the coordinator dials each peer learnt
//! that way that has no link. A dial always says whom it is for, and a link that another
//! node answers is dropped, failing that peer's session with both names (`dns.rs` holds
//! the lookups, the probes and their handlers).

mod described;
mod dns;
mod links;
mod messages;
mod routes;

pub(crate) use self::routes::{count_failovers, memory_class};

pub use self::described::describe_metrics;
pub use self::messages::{
    Connect, ConnectedPeers, Dialed, Explain, FetchFrom, Handed, Handover, Handovers, InspectPeer,
    LinkUp, PutTo, SendTo, Shutdown, hand_over,
};

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use ferry_config::{Config, Locality, MemoryClass, PeerAddress};
use ferry_transports::link::{self, Endpoint, LinkOptions, Secret};
use ferry_transports::memory::{Buffer, MemoryKind};
use ferry_transports::transport::{Capabilities, Viability};
use ferry_transports::wire::{Hello, HelloPurpose, WireDirection};

use crate::core::discovery::Discovery;
use crate::core::route::{self, Explanation, RouteQuery};
use crate::error::{Error, SendError};
use crate::inbox::Inbox;
use crate::peer::{
    AwaitLink, Drain, Lost, Op, PeerClass, SessionEnded, SetupSettled, Submit, TransferActor,
    TransferSetup,
};

impl StreamHandler<Handover> for Coordinator {
    fn handle(&mut self, handover: Handover, ctx: &mut Self::Context) {
        let Handover {
            what,
            reply,
            unanswered,
        } = handover;
        let routed = match what {
            Handed::Send(m) => <Self as Handler<SendTo>>::handle(self, m, ctx),
            Handed::Put(m) => <Self as Handler<PutTo>>::handle(self, m, ctx),
        };
        ctx.spawn(routed.into_actor(self).map(move |outcome, _, _| {
            drop(unanswered);
            let _ = reply.send(outcome);
        }));
    }

    /// The node dropped its sender (it stops): nothing more comes.
    fn finished(&mut self, _: &mut Self::Context) {}
}

/// Dialing a peer failed.
#[derive(Debug, Message)]
#[rtype(result = "()")]
struct DialFailed {
    peer: String,
    epoch: u64,
    error: String,
}

/// `Connect`s that may wait for DNS discovery's first answers at once; more fail at once.
const MAX_WAITING_CONNECTS: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LinkState {
    Dialing,
    Up { dialed_by_me: bool },
}

struct Session {
    addr: Addr<TransferActor>,
    /// Where sends to the peer go (the actor reads them in order; see [`Submission`]).
    ///
    /// [`Submission`]: crate::peer::Submission
    submissions: crate::peer::Submissions,
    epoch: u64,
    state: LinkState,
    hello: Option<Hello>,
    /// How each transport's setup with the peer ended, once it did.
    setups: HashMap<ferry_config::TransportName, ferry_transports::transport::setup::SetupOutcome>,
    /// Ends once the latest submission to the peer is in its channel: the next one waits
    /// for it, so they enter the channel in the order the coordinator took them (each
    /// waits for room in a future of its own, which could be woken in any order).
    handed: Option<tokio::sync::oneshot::Receiver<()>>,
}

/// What the coordinator needs to start.
pub struct CoordinatorSetup {
    /// The node's configuration.
    pub config: Arc<Config>,
    /// The shared secret.
    pub secret: Secret,
    /// Link options (frame cap, handshake timeout, counters).
    pub link: LinkOptions,
    /// Template for transfer actors; `deliver` and `ended` are filled in by the coordinator.
    pub transfer: TransferSetupBase,
    /// Where delivered buffers wait for `recv`.
    pub inbox: Arc<Inbox>,
    /// Where this node lands received buffers by default (its first receive tier), as its
    /// hello tells peers.
    pub receives: MemoryKind,
    /// The threads peers' sessions run on, each new session on the next (at least one).
    pub peer_threads: Vec<actix::ArbiterHandle>,
}

/// The hello this node greets a peer with, on links it dials and links it accepts alike:
/// its name, its host identity (`host_id`, see [`crate::node::host_identity`]), the
/// transports viable here, its frame cap, and `receives`, where it lands received buffers
/// by default, which its peers route their sends for.
pub(crate) fn node_hello(
    node: &str,
    host_id: &str,
    receives: MemoryKind,
    max_frame: u32,
    transports: &NodeTransports,
) -> Hello {
    Hello {
        host_id: host_id.to_owned(),
        receives: receives.to_wire(),
        transports: transports.announce(),
        ..link::local_hello(node, Vec::new(), max_frame)
    }
}

/// The parts of [`TransferSetup`] the node provides.
#[derive(Clone)]
pub struct TransferSetupBase {
    /// Session bounds.
    pub limits: crate::core::session::SessionLimits,
    /// Bytes per data frame.
    pub chunk: usize,
    /// How long an inbound transfer waits for memory.
    pub reserve_timeout: Duration,
    /// Where received buffers land, then where they spill, in order.
    pub tiers: Vec<crate::allocator::Tier>,
    /// The same without device tiers, for transfers over a link.
    pub host_tiers: Vec<crate::allocator::Tier>,
    /// The node's GPUs.
    pub gpus: crate::gpu::SharedGpus,
    /// Told when a peer is gone, so what it held is quarantined.
    pub peer_gone: Vec<Recipient<crate::allocator::PeerGone>>,
    /// Exposed regions.
    pub exposed: Arc<dashmap::DashMap<u64, ferry_transports::region::ExposedRegion>>,
    /// I/O runtime.
    pub io: tokio::runtime::Handle,
    /// What the node's sends to each peer take: its fast path (the node's `send` looks
    /// there first) and its routes, which the coordinator publishes while the peer's link
    /// is up, so the node's `send` takes them without asking it ([`crate::direct`]).
    pub peers: Arc<crate::direct::PeerHandles>,
    /// The transports this node serves, started with its settings.
    pub transports: NodeTransports,
    /// This node's host identity: a peer whose hello says the same is on this host.
    pub host_id: Arc<str>,
    /// The buffers this node published, which peers fetch.
    pub published: Arc<crate::publish::Publications>,
}

/// The transports a node serves, as its hello announces them and its routes choose.
#[derive(Clone)]
pub struct NodeTransports {
    /// Each transport's declaration and whether this node can use it (with this node's
    /// settings: ucx is served exactly when its engine started).
    pub catalog: Vec<(Capabilities, Viability)>,
    /// The transports, which make each session's parts.
    pub started: Vec<Arc<dyn ferry_transports::transport::Transport>>,
}

impl NodeTransports {
    /// The node's `started` transports.
    pub fn new(started: Vec<Arc<dyn ferry_transports::transport::Transport>>) -> Self {
        let catalog = (started.iter())
            .map(|t| (t.capabilities().clone(), t.viability()))
            .collect();
        Self { catalog, started }
    }

    /// The transports this node cannot use with a peer that greeted it with `hello`, each
    /// with why (a peer on another UCX release: its addresses and keys do not unpack here).
    /// A transport either end does not serve is not listed: routing says that on its own.
    pub fn unusable_with(&self, hello: &Hello) -> Vec<(ferry_config::TransportName, String)> {
        (self.started.iter())
            .filter(|t| t.viability() == Viability::Viable)
            .filter_map(|t| {
                let theirs = hello.announced(t.name())?;
                t.usable_with(theirs).err().map(|why| (t.name(), why))
            })
            .collect()
    }

    /// What this node's hello says of each transport it serves.
    pub fn announce(&self) -> Vec<ferry_transports::wire::Announce> {
        (self.started.iter())
            .filter(|t| t.viability() == Viability::Viable)
            .map(|t| ferry_transports::wire::Announce {
                transport: t.name().into(),
                terms: t.announce(),
            })
            .collect()
    }

    /// The names of the transports this node serves.
    pub fn served(&self) -> Vec<ferry_config::TransportName> {
        self.catalog
            .iter()
            .filter(|(_, v)| *v == Viability::Viable)
            .map(|(c, _)| c.name)
            .collect()
    }
}

/// The coordinator actor.
pub struct Coordinator {
    setup: CoordinatorSetup,
    catalog: Vec<(Capabilities, Viability)>,
    sessions: HashMap<String, Session>,
    next_epoch: u64,
    inbox: Arc<Inbox>,
    draining: bool,
    /// The peers found by DNS, with `discovery.mode = "dns"`.
    discovery: Option<Discovery>,
    /// `Connect`s to a peer not known yet, waiting for DNS discovery's first answers: the
    /// peer, the error to give if it is not found, and where to answer.
    connects: Vec<WaitingConnect>,
    /// When each peer found by DNS was last dialed for `discovery.connect_all`: one whose
    /// link is down is dialed again at most once a `discovery.interval` (entries only for
    /// peers discovery knows now, so at most `discovery.max_peers`).
    discovered_dials: HashMap<String, std::time::Instant>,
}

/// A `Connect` waiting for DNS discovery: the peer, the error if it is not found, and where
/// to answer with the peer's session.
type WaitingConnect = (
    String,
    Error,
    tokio::sync::oneshot::Sender<Result<Addr<TransferActor>, Error>>,
);

impl Coordinator {
    /// A coordinator for the node described by `setup`.
    pub fn new(setup: CoordinatorSetup) -> Self {
        let config = &setup.config;
        let discovery = (config.discovery.mode == ferry_config::DiscoveryMode::Dns).then(|| {
            Discovery::new(
                &config.node.name,
                config.discovery.dns.len(),
                config.discovery.max_peers,
                dns::MAX_PROBES,
            )
        });
        Self {
            inbox: Arc::clone(&setup.inbox),
            catalog: setup.transfer.transports.catalog.clone(),
            setup,
            sessions: HashMap::new(),
            next_epoch: 1,
            draining: false,
            discovery,
            connects: Vec::new(),
            discovered_dials: HashMap::new(),
        }
    }

    fn name(&self) -> &str {
        &self.setup.config.node.name
    }

    fn hello(&self) -> Hello {
        node_hello(
            self.name(),
            &self.setup.transfer.host_id,
            self.setup.receives,
            self.setup.link.max_frame,
            &self.setup.transfer.transports,
        )
    }

    /// Where to dial `peer`: its `[[peers]]` address, else the address DNS discovery
    /// learnt it at, if DNS still gives that address.
    fn peer_address(&self, peer: &str) -> Option<PeerAddress> {
        self.setup
            .config
            .peers
            .iter()
            .find(|p| p.name == peer)
            .map(|p| p.address.clone())
            .or_else(|| {
                let addr = self.discovery.as_ref()?.address_of(peer)?;
                Some(PeerAddress::Tcp(addr.to_string()))
            })
    }

    fn transfer_setup(&self, ctx: &mut Context<Self>) -> TransferSetup {
        let base = self.setup.transfer.clone();
        TransferSetup {
            node: self.setup.config.node.name.clone(),
            host_id: base.host_id,
            limits: base.limits,
            chunk: base.chunk,
            reserve_timeout: base.reserve_timeout,
            tiers: base.tiers,
            host_tiers: base.host_tiers,
            gpus: base.gpus,
            secret: self.setup.secret.clone(),
            lease_timeout: self.setup.config.memory.export_lease_timeout,
            peer_gone: base.peer_gone,
            ended: ctx.address().recipient(),
            refused: ctx.address().recipient(),
            settled: ctx.address().recipient(),
            exposed: base.exposed,
            counters: Arc::clone(&self.setup.link.counters),
            io: base.io,
            peers: base.peers,
            inbox: Arc::clone(&self.inbox),
            transports: base.transports.started,
            published: base.published,
            serve: ctx.address().recipient(),
        }
    }

    fn new_session(&mut self, peer: &str, state: LinkState, ctx: &mut Context<Self>) -> u64 {
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let mailbox = self.setup.config.limits.mailbox;
        let actor = TransferActor::new(peer.to_string(), epoch, self.transfer_setup(ctx));
        // Bounded by the peer's credit, which every send, put or fetch answer holds.
        let (submissions, submitted) = actor.submissions(self.setup.config.limits.peer_queue);
        let start = move |c: &mut Context<TransferActor>| {
            c.set_mailbox_capacity(mailbox);
            c.add_stream(submitted);
            actor
        };
        // Each session on the next of the peer threads, so that one peer's turns never
        // wait for another's on a thread they share.
        let threads = &self.setup.peer_threads;
        let addr = match usize::try_from(epoch)
            .ok()
            .and_then(|e| threads.get(e % threads.len().max(1)))
        {
            Some(thread) => TransferActor::start_in_arbiter(thread, start),
            None => TransferActor::create(start),
        };
        if let Some(old) = self.sessions.insert(
            peer.to_string(),
            Session {
                addr,
                submissions,
                epoch,
                state,
                hello: None,
                setups: HashMap::new(),
                handed: None,
            },
        ) {
            // The old session's actor fails its ops and stops; its end is ignored.
            send_lost(&old.addr, "replaced by a newer connection");
        }
        self.publish_direct(peer, None);
        epoch
    }

    /// The session for `peer`, dialing it if there is none.
    fn session_for(
        &mut self,
        peer: &str,
        ctx: &mut Context<Self>,
    ) -> Result<Addr<TransferActor>, Error> {
        if let Some(s) = self.sessions.get(peer) {
            return Ok(s.addr.clone());
        }
        let Some(address) = self.peer_address(peer) else {
            let detail = if self.discovery.is_some() {
                "not a configured peer, not found at an address DNS discovery gives now, and not connected"
            } else {
                "not a configured peer, and not connected"
            };
            return Err(Error::PeerUnreachable {
                peer: peer.to_string(),
                detail: detail.into(),
            });
        };
        let epoch = self.new_session(peer, LinkState::Dialing, ctx);
        let endpoint = match address {
            PeerAddress::Tcp(a) => Endpoint::Tcp(a),
            PeerAddress::Unix(p) => Endpoint::Unix(p),
        };
        let secret = self.setup.secret.clone();
        let opts = self.setup.link.clone();
        // The acceptor refuses a link meant for another node, so a wrong address disturbs
        // nothing there; `LinkUp` checks the answer's name on this side.
        let hello = Hello {
            purpose: HelloPurpose::LinkTo(peer.to_string()),
            ..self.hello()
        };
        let connect_timeout = self.setup.config.limits.connect_timeout;
        let me = ctx.address();
        let peer_name = peer.to_string();
        self.setup.transfer.io.spawn(async move {
            let dialing = link::dial(&endpoint, &secret, hello, &opts);
            let result = match tokio::time::timeout(connect_timeout, dialing).await {
                Ok(Ok(link)) => Ok(link),
                Ok(Err(e)) => Err(format!("cannot connect to {endpoint}: {e}")),
                Err(_) => Err(format!(
                    "cannot connect to {endpoint}: no answer within {}",
                    humantime::format_duration(connect_timeout)
                )),
            };
            match result {
                Ok(link) => {
                    let dialed = Dialed {
                        epoch,
                        peer: peer_name,
                        endpoint: endpoint.clone(),
                    };
                    let _ = me
                        .send(LinkUp {
                            link,
                            dialed: Some(dialed),
                        })
                        .await;
                }
                Err(error) => {
                    let _ = me
                        .send(DialFailed {
                            peer: peer_name,
                            epoch,
                            error,
                        })
                        .await;
                }
            }
        });
        self.sessions
            .get(peer)
            .map(|s| s.addr.clone())
            .ok_or(Error::ShuttingDown)
    }

    fn submit(
        &mut self,
        peer: String,
        op: Op,
        buffer: Buffer,
        deadline: Instant,
        ctx: &mut Context<Self>,
    ) -> ResponseFuture<Result<Buffer, SendError>> {
        if self.draining {
            return Box::pin(async move {
                Err(SendError {
                    error: Error::ShuttingDown,
                    buffer: Some(buffer),
                })
            });
        }
        let (handed, next) = tokio::sync::oneshot::channel();
        let submissions = self
            .session_for(&peer, ctx)
            .and_then(|_| self.sessions.get_mut(&peer).ok_or(Error::ShuttingDown))
            .map(|s| (s.submissions.clone(), s.handed.replace(next)));
        let (submissions, before) = match submissions {
            Ok(s) => s,
            Err(error) => {
                return Box::pin(async move {
                    Err(SendError {
                        error,
                        buffer: Some(buffer),
                    })
                });
            }
        };
        let submit = Submit {
            op,
            buffer,
            deadline,
            peer_class: PeerClass::of(self.locality(&peer)),
        };
        Box::pin(async move {
            if let Some(before) = before {
                let _ = before.await;
            }
            let outcome = crate::peer::hand_over(&submissions, submit, &peer).await;
            let _ = handed.send(());
            outcome.await
        })
    }
}

fn send_lost(addr: &Addr<TransferActor>, why: &str) {
    let addr = addr.clone();
    let why = why.to_string();
    actix::spawn(async move {
        let _ = addr.send(Lost(why)).await;
    });
}

impl Actor for Coordinator {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.setup.config.limits.mailbox);
        if self.discovery.is_some() {
            self.start_lookups(ctx);
        }
    }
}

impl Handler<SendTo> for Coordinator {
    type Result = ResponseFuture<Result<Buffer, SendError>>;

    fn handle(&mut self, msg: SendTo, ctx: &mut Self::Context) -> Self::Result {
        // Routed by what moves (the layout's packed bytes), for the memory the peer
        // receives into, from its hello (host until the first link to it is up: the first
        // sends to a peer are routed before its hello arrives).
        let routed = match self.routed(&msg.peer, msg.packed, memory_class(msg.buffer.kind())) {
            Ok(routed) => routed,
            Err(explanation) => {
                let buffer = msg.buffer;
                return Box::pin(async move {
                    Err(SendError {
                        error: Error::NoRoute(explanation.to_string()),
                        buffer: Some(buffer),
                    })
                });
            }
        };
        let mut op = Op::send_routed(routed, msg.tag, msg.layout, msg.fetch, msg.packed);
        if let Some(into) = msg.into {
            op = op.into_region(into);
        }
        self.submit(msg.peer, op, msg.buffer, msg.deadline, ctx)
    }
}

impl Handler<PutTo> for Coordinator {
    type Result = ResponseFuture<Result<Buffer, SendError>>;

    fn handle(&mut self, msg: PutTo, ctx: &mut Self::Context) -> Self::Result {
        let end = msg.offset.checked_add(msg.buffer.len() as u64);
        if end.is_none_or(|e| e > msg.key.len) {
            let buffer = msg.buffer;
            let key = msg.key;
            let offset = msg.offset;
            return Box::pin(async move {
                Err(SendError {
                    error: Error::Usage(format!(
                        "a put of {} bytes at offset {offset} overruns region {} of {} bytes",
                        buffer.len(),
                        key.region,
                        key.len
                    )),
                    buffer: Some(buffer),
                })
            });
        }
        let op = Op::Put {
            key: msg.key,
            offset: msg.offset,
        };
        self.submit(msg.peer, op, msg.buffer, msg.deadline, ctx)
    }
}

impl Handler<FetchFrom> for Coordinator {
    type Result = ResponseFuture<Result<crate::fetch::Landed, Error>>;

    fn handle(&mut self, msg: FetchFrom, ctx: &mut Self::Context) -> Self::Result {
        let ask = crate::peer::AskFetch {
            key: msg.key,
            layout: msg.layout,
            deadline: msg.deadline,
        };
        self.ask_peer(msg.peer, ask, ctx)
    }
}

impl Handler<InspectPeer> for Coordinator {
    type Result = ResponseFuture<Result<Box<dyn std::any::Any + Send>, Error>>;

    fn handle(&mut self, msg: InspectPeer, ctx: &mut Self::Context) -> Self::Result {
        let ask = crate::peer::Inspect {
            transport: msg.transport,
            what: msg.what,
        };
        self.ask_peer(msg.peer, ask, ctx)
    }
}

impl Coordinator {
    /// Asks `peer`'s transfer actor (dialling it if need be) and hands back its answer:
    /// `ShuttingDown` while the node drains, `PeerLost` when the actor stopped first.
    fn ask_peer<M, T>(
        &mut self,
        peer: String,
        ask: M,
        ctx: &mut Context<Self>,
    ) -> ResponseFuture<Result<T, Error>>
    where
        M: Message<Result = Result<T, Error>> + Send + 'static,
        T: Send + 'static,
        crate::peer::TransferActor: Handler<M>,
    {
        if self.draining {
            return Box::pin(async { Err(Error::ShuttingDown) });
        }
        let addr = match self.session_for(&peer, ctx) {
            Ok(a) => a,
            Err(e) => return Box::pin(async move { Err(e) }),
        };
        let asked = addr.send(ask);
        Box::pin(async move {
            asked.await.unwrap_or_else(|_| {
                Err(Error::PeerLost {
                    peer,
                    detail: "its transfer actor stopped".into(),
                })
            })
        })
    }
}

impl Handler<Connect> for Coordinator {
    type Result = ResponseFuture<Result<(), Error>>;

    fn handle(&mut self, msg: Connect, ctx: &mut Self::Context) -> Self::Result {
        let addr = match self.session_for(&msg.peer, ctx) {
            Ok(a) => a,
            // Not known yet, but DNS discovery has not had its first answers: wait for them.
            Err(e @ Error::PeerUnreachable { .. })
                if self.discovery.as_ref().is_some_and(|d| !d.settled())
                    && self.connects.len() < MAX_WAITING_CONNECTS =>
            {
                let (tx, rx) = tokio::sync::oneshot::channel();
                self.connects.push((msg.peer, e.clone(), tx));
                // Bounded: discovery may never settle (addresses that never answer are probed
                // again every round), so a waiting connect gives up after one round and one
                // probe's time, with the error it would have had.
                let wait =
                    self.setup.config.discovery.interval + self.setup.config.limits.connect_timeout;
                return Box::pin(async move {
                    let answer = tokio::time::timeout(wait, rx).await.map_err(|_| e)?;
                    let addr = answer.unwrap_or(Err(Error::ShuttingDown))?;
                    addr.send(AwaitLink)
                        .await
                        .unwrap_or(Err(Error::ShuttingDown))
                });
            }
            Err(e) => return Box::pin(async move { Err(e) }),
        };
        let wait = addr.send(AwaitLink);
        Box::pin(async move { wait.await.unwrap_or(Err(Error::ShuttingDown)) })
    }
}

impl Handler<Explain> for Coordinator {
    type Result = Result<Explanation, Error>;

    fn handle(&mut self, msg: Explain, _: &mut Self::Context) -> Self::Result {
        // The same route a `SendTo` takes (`dst` `None`), or a what-if one.
        Ok(self.explain(&msg.peer, msg.bytes, msg.src, msg.dst))
    }
}

impl Handler<SetupSettled> for Coordinator {
    type Result = ();

    fn handle(&mut self, msg: SetupSettled, _: &mut Self::Context) {
        let Some(s) = self.sessions.get_mut(&msg.peer) else {
            return;
        };
        if s.epoch != msg.epoch {
            return;
        }
        let ok = msg.outcome == ferry_transports::transport::setup::SetupOutcome::Ok;
        s.setups.insert(msg.transport, msg.outcome);
        let table = self.route_table(&msg.peer);
        let lane = self.setup.transfer.peers.lane(&msg.peer, msg.transport);
        // The transport's fast path to the peer (published before this notice) carries what
        // the rules send over it by pull.
        if let Some(lane) = lane.filter(|_| ok) {
            let memory = lane.path.memory();
            let _ = lane.routes.set(table.fast_routes(msg.transport, memory));
        }
        self.publish_direct(&msg.peer, Some(table));
    }
}

impl Handler<SessionEnded> for Coordinator {
    type Result = ();

    fn handle(&mut self, msg: SessionEnded, _: &mut Self::Context) {
        if self
            .sessions
            .get(&msg.peer)
            .is_some_and(|s| s.epoch == msg.epoch)
        {
            self.sessions.remove(&msg.peer);
            self.publish_direct(&msg.peer, None);
            self.count_connected();
        }
    }
}

impl Handler<ConnectedPeers> for Coordinator {
    type Result = MessageResult<ConnectedPeers>;

    fn handle(&mut self, _: ConnectedPeers, _: &mut Self::Context) -> Self::Result {
        MessageResult(
            self.sessions
                .iter()
                .filter(|(_, s)| matches!(s.state, LinkState::Up { .. }))
                .map(|(p, _)| p.clone())
                .collect(),
        )
    }
}

impl Handler<Shutdown> for Coordinator {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Shutdown, _: &mut Self::Context) -> Self::Result {
        self.draining = true;
        self.setup.transfer.peers.clear_routes();
        // Waiting `Connect`s end (as `ShuttingDown`) with their senders.
        self.connects.clear();
        let sessions: Vec<Addr<TransferActor>> =
            self.sessions.values().map(|s| s.addr.clone()).collect();
        self.inbox.stop();
        Box::pin(async move {
            for addr in &sessions {
                let _ = addr.send(Drain).await;
            }
            for addr in &sessions {
                let _ = addr.send(Lost("node shutting down".into())).await;
            }
        })
    }
}
