//! Starting a node: the secret, the listeners, the GPUs, the actor thread with its memory
//! domains and coordinator, the UCX engine, and the fd-sharing socket. [`super::Node::start`]
//! runs these steps in order.

use super::*;

/// The node's I/O runtime while [`super::Node::start`] runs: if the start fails, it shuts
/// down in the background (dropping a tokio runtime inside an async context, where
/// `Node::start` is awaited, panics instead of returning the error).
pub(super) struct StartingRuntime(pub(super) Option<tokio::runtime::Runtime>);

impl StartingRuntime {
    /// The runtime, for the started node to own.
    pub(super) fn into_inner(mut self) -> tokio::runtime::Runtime {
        self.0.take().expect("the runtime is taken once")
    }
}

impl std::ops::Deref for StartingRuntime {
    type Target = tokio::runtime::Runtime;

    fn deref(&self) -> &tokio::runtime::Runtime {
        self.0.as_ref().expect("the runtime is there until taken")
    }
}

impl Drop for StartingRuntime {
    fn drop(&mut self) {
        if let Some(io) = self.0.take() {
            io.shutdown_background();
        }
    }
}

/// A GPU this node will use: the device, its pool and streams, and its budget.
pub(super) struct OpenedGpu {
    pub(super) ordinal: u32,
    pub(super) device: ferry_transports::cuda::Device,
    pub(super) pool: ferry_transports::cuda::ExportablePool,
    pub(super) streams: crate::gpu::GpuStreams,
    pub(super) budget: u64,
}

/// Opens the GPUs `config.gpu.devices` names (every visible one when omitted), each with an
/// exportable pool. Without a CUDA driver: none, unless the configuration names some.
pub(super) fn open_gpus(
    config: &Config,
) -> Result<(Vec<OpenedGpu>, Vec<ferry_transports::cuda::Device>), Error> {
    use ferry_transports::cuda::{CudaProbe, Device, probe};
    let named = config.gpu.devices.clone();
    let driver = match probe() {
        CudaProbe::Ready(driver) => driver,
        other => {
            let why = match other {
                CudaProbe::NoDriver => "no CUDA driver: GPU transports disabled".to_string(),
                CudaProbe::Failed { error, .. } => {
                    format!("the CUDA driver does not work: {error}")
                }
                CudaProbe::Ready(_) => String::new(),
            };
            return match named {
                Some(list) if !list.is_empty() => Err(config
                    .invalid(&["gpu.devices"], format!("names GPUs {list:?}, but {why}"))
                    .into()),
                _ => {
                    tracing::info!("{why}; host memory only");
                    Ok((Vec::new(), Vec::new()))
                }
            };
        }
    };
    let visible = Device::all().map_err(|e| Error::start("opening the GPUs", e))?;
    let wanted: Vec<u32> = named.unwrap_or_else(|| (0..visible.len() as u32).collect());
    let mut out = Vec::new();
    for ordinal in wanted {
        let Some(device) = visible.get(ordinal as usize).cloned() else {
            let detail = format!(
                "names GPU {ordinal}, but this process sees {} GPU(s)",
                visible.len()
            );
            return Err(config.invalid(&["gpu.devices"], detail).into());
        };
        let total = driver
            .devices
            .get(ordinal as usize)
            .map_or(0, |d| d.total_memory);
        let (pool, streams) = crate::gpu::open_pool(&device).map_err(|e| {
            Error::start(
                format!("GPU {ordinal}: cannot create an exportable memory pool"),
                e,
            )
        })?;
        // Every GPU we use may read this pool (a transfer between two GPUs of the node).
        for other in &visible {
            if ferry_transports::cuda::peer_access(other, &device).unwrap_or(false) {
                let _ = pool.grant_access(other);
            }
        }
        out.push(OpenedGpu {
            ordinal,
            device,
            pool,
            streams,
            budget: config.memory.device.resolve(total),
        });
    }
    Ok((out, visible))
}

pub(super) fn total_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(8 << 30, |kb| kb * 1024)
}

/// The link secret `config` names (read and checked), or the insecure one with a warning.
pub(super) fn node_secret(config: &Config) -> Result<Secret, Error> {
    Ok(match config.read_secret()? {
        Some(bytes) => Secret::new(bytes),
        None => {
            tracing::warn!(
                "SECURITY: security.danger_insecure is set: peers are not authenticated; \
                 anyone who can reach this node's listeners can send to it"
            );
            Secret::insecure()
        }
    })
}

/// Binds every configured listener on `io`: the tcp addresses, then the Unix socket in
/// `node.socket_dir` (returned with its path).
pub(super) async fn bind_listeners(
    io: &tokio::runtime::Runtime,
    config: &Config,
) -> Result<(Vec<Listener>, Option<PathBuf>), Error> {
    let mut listeners = Vec::new();
    for addr in &config.node.listen {
        let bind = io.spawn({
            let addr = addr.clone();
            async move { Listener::bind_tcp(&addr).await }
        });
        let listener = bind
            .await
            .map_err(|e| Error::start("the listener's task", e))?
            .map_err(|e| Error::start(format!("cannot listen on {addr}"), e))?;
        listeners.push(listener);
    }
    let Some(dir) = &config.node.socket_dir else {
        return Ok((listeners, None));
    };
    let path = dir.join(format!("{}.sock", config.node.name));
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::start(format!("cannot create {}", dir.display()), e))?;
    let bind = io.spawn({
        let path = path.clone();
        async move { Listener::bind_unix(&path).await }
    });
    let listener = bind
        .await
        .map_err(|e| Error::start("the listener's task", e))?
        .map_err(|e| Error::start(format!("cannot listen on {}", path.display()), e))?;
    listeners.push(listener);
    Ok((listeners, Some(path)))
}

/// Opens the fd-sharing socket where same-host peers fetch our pools' descriptors (the ipc
/// transport) and our staging rings (the staged transport, with or without GPUs). A socket
/// that cannot open only costs those transports, with a warning.
pub(super) async fn serve_fd_sharing(
    io: &tokio::runtime::Runtime,
    name: &str,
    secret: &Secret,
    shared: &Shared,
) -> Result<(), Error> {
    let bound = io.spawn({
        let name = name.to_string();
        async move { ferry_transports::fdshare::bind(&name) }
    });
    match bound
        .await
        .map_err(|e| Error::start("the pool socket's task", e))?
    {
        Ok(listener) => {
            io.spawn(ferry_transports::fdshare::serve(
                listener,
                secret.clone(),
                Arc::clone(&shared.gpu_pools),
                Arc::clone(&shared.lane_rings),
            ));
        }
        Err(e) => tracing::warn!(
            "cannot open the fd-sharing socket ({e}): same-host peers cannot map this node's \
             memory pools or rings (transports that need them fall back or go over the link)"
        ),
    }
    Ok(())
}

/// What the node's handles and its actors share.
#[derive(Clone)]
pub(super) struct Shared {
    pub(super) exposed: Arc<DashMap<u64, ExposedRegion>>,
    pub(super) inbox: Arc<Inbox>,
    pub(super) gpu_pools: ferry_transports::fdshare::PoolDirectory,
    pub(super) lane_rings: ferry_transports::fdshare::RingDirectory,
    pub(super) peers: Arc<crate::direct::PeerHandles>,
    pub(super) published: Arc<crate::publish::Publications>,
}

/// What the actor thread is started with.
pub(super) struct ActorParts {
    pub(super) config: Arc<Config>,
    pub(super) secret: Secret,
    pub(super) link: LinkOptions,
    pub(super) io: tokio::runtime::Handle,
    pub(super) opened: Vec<OpenedGpu>,
    pub(super) visible: Vec<ferry_transports::cuda::Device>,
    pub(super) shared: Shared,
}

/// The actors, as the node's handle holds them.
pub(super) struct Started {
    pub(super) coordinator: Addr<Coordinator>,
    /// Where sends and puts go to be routed by the coordinator.
    pub(super) handovers: crate::coordinator::Handovers,
    pub(super) host: DomainHandle,
    pub(super) pinned: DomainHandle,
    pub(super) gpus: crate::gpu::SharedGpus,
    pub(super) receives: MemoryKind,
    pub(super) transports: crate::coordinator::NodeTransports,
    pub(super) host_id: Arc<str>,
    pub(super) system: System,
    /// The threads peers' sessions run on (`node.peer_threads`), joined when the node stops.
    pub(super) peer_threads: Vec<actix::Arbiter>,
}

/// Starts the actor thread: its actix system runs the allocators and the coordinator,
/// which are sent back on the returned channel once started.
pub(super) fn spawn_actors(
    parts: ActorParts,
) -> Result<
    (
        std::thread::JoinHandle<()>,
        tokio::sync::oneshot::Receiver<Started>,
    ),
    Error,
> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let thread = std::thread::Builder::new()
        .name(format!("ferry-{}", parts.config.node.name))
        .spawn(move || {
            let system = System::new();
            let started = system.block_on(start_actors(parts));
            let _ = tx.send(started);
            let _ = system.run();
        })
        .map_err(|e| Error::start("cannot start the actor thread", e))?;
    Ok((thread, rx))
}

/// Starts the memory domains and the coordinator (on the actor thread).
pub(super) async fn start_actors(parts: ActorParts) -> Started {
    let ActorParts {
        config,
        secret,
        link,
        io,
        opened,
        visible,
        shared,
    } = parts;
    let limits = &config.limits;
    let (mailbox, queue) = (limits.mailbox, limits.reservation_queue);
    let lease = config.memory.export_lease_timeout;
    let keeping = keeping(&config);
    let domain = |kind, budget| {
        Allocator::new(kind, budget, queue, lease)
            .keeping(keeping)
            .launch(mailbox)
    };
    let host = domain(MemoryKind::Host, config.memory.host.resolve(total_memory()));
    let pinned = domain(
        MemoryKind::PinnedHost,
        config.memory.pinned.resolve(total_memory()),
    );
    let gpus = Arc::new(start_gpus(opened, visible, &config, &shared));
    let mut all_tiers = vec![host.tier(), pinned.tier()];
    for (_, domain) in &gpus.domains {
        all_tiers.push(domain.tier());
    }
    let home = Arc::new(NodeMemory { tiers: all_tiers });
    let domains: Vec<&Addr<Allocator>> = [&host.actor, &pinned.actor]
        .into_iter()
        .chain(gpus.domains.iter().map(|(_, d)| &d.actor))
        .collect();
    for a in &domains {
        let _ = a.send(SetHome(home.clone())).await;
    }
    let receive_tiers = receive_tiers(&config, &host, &pinned, &gpus);
    // Where receives land first: what every hello of this node tells peers, who route
    // their sends for it.
    let receives = receive_tiers.first().map_or(MemoryKind::Host, |t| t.kind);
    let mut host_tiers: Vec<Tier> = receive_tiers
        .iter()
        .filter(|t| !matches!(t.kind, MemoryKind::Device(_)))
        .cloned()
        .collect();
    if host_tiers.is_empty() {
        host_tiers.push(host.tier());
    }
    // A registration the peer may still read or write is held as long as memory a lost
    // ipc peer may map: each of its UCX operations is at most 16 MiB, served or applied
    // here within milliseconds of arriving (op_timeout bounds the peer's wait for an
    // answer, not how long ours takes), so the lease (10 s by default) covers them.
    let started = ferry_transports::registry::start(&config, gpus.first_device());
    if let Some(source) = started.iter().find_map(|t| t.host_memory()) {
        host.domain.use_host_source(source);
    }
    let transports = crate::coordinator::NodeTransports::new(started);
    let host_id = host_identity(&config);
    let transfer = TransferSetupBase {
        limits: session_limits(limits),
        chunk: usize::try_from(config.link_chunk()).unwrap_or(1 << 20),
        reserve_timeout: limits.default_deadline,
        tiers: receive_tiers,
        host_tiers,
        gpus: Arc::clone(&gpus),
        peer_gone: domains.iter().map(|a| (*a).clone().recipient()).collect(),
        exposed: shared.exposed,
        io,
        peers: shared.peers,
        transports: transports.clone(),
        host_id: Arc::clone(&host_id),
        published: shared.published,
    };
    // Bounded by the node's credits (each hand-over holds one of its peer's).
    let (handovers, handed) = futures::channel::mpsc::channel(config.limits.peer_queue);
    let peer_threads: Vec<actix::Arbiter> = (0..config.node.peer_threads)
        .map(|_| actix::Arbiter::new())
        .collect();
    let coordinator = Coordinator::new(CoordinatorSetup {
        peer_threads: peer_threads.iter().map(actix::Arbiter::handle).collect(),
        config: Arc::clone(&config),
        secret,
        link,
        transfer,
        inbox: shared.inbox,
        receives,
    });
    let coordinator = Coordinator::create(move |ctx| {
        ctx.add_stream(handed);
        coordinator
    });
    Started {
        coordinator,
        handovers,
        host,
        pinned,
        gpus,
        receives,
        transports,
        host_id,
        system: System::current(),
        peer_threads,
    }
}

/// How every domain keeps memory of dropped buffers (`memory.keep_idle`, `keep_max`).
fn keeping(config: &Config) -> crate::allocator::Keeping {
    crate::allocator::Keeping {
        idle: config.memory.keep_idle,
        max: config.memory.keep_max,
    }
}

/// One allocator per opened GPU (its pool registered at the fd-sharing socket), with the
/// GPU's copy streams.
pub(super) fn start_gpus(
    opened: Vec<OpenedGpu>,
    visible: Vec<ferry_transports::cuda::Device>,
    config: &Config,
    shared: &Shared,
) -> crate::gpu::Gpus {
    let (mailbox, queue) = (config.limits.mailbox, config.limits.reservation_queue);
    let lease = config.memory.export_lease_timeout;
    let (gpus, domains) = opened
        .into_iter()
        .map(|g| {
            let kind = MemoryKind::Device(g.ordinal);
            let pool = crate::allocator::DevicePool::new(
                g.pool,
                g.streams.alloc,
                vec![g.streams.copy.clone(), g.streams.express.clone()],
            )
            .exported_in(Arc::clone(&shared.gpu_pools));
            let budget = g.budget;
            let allocator = Allocator::new(kind, budget, queue, lease)
                .with_device(pool)
                .keeping(keeping(config))
                .launch(mailbox);
            let gpu = ferry_transports::gpus::Gpu {
                device: g.device,
                copy_stream: g.streams.copy,
                express_stream: g.streams.express,
            };
            ((g.ordinal, gpu), (g.ordinal, allocator))
        })
        .unzip();
    let devices = ferry_transports::gpus::Gpus {
        gpus,
        visible,
        pools: Arc::clone(&shared.gpu_pools),
        rings: Arc::clone(&shared.lane_rings),
        mapping: Arc::default(),
    };
    crate::gpu::Gpus {
        devices: Arc::new(devices),
        domains,
    }
}

/// The receive tiers: where receives land (`memory.receive_into`), then where they spill.
pub(super) fn receive_tiers(
    config: &Config,
    host: &DomainHandle,
    pinned: &DomainHandle,
    gpus: &crate::gpu::Gpus,
) -> Vec<Tier> {
    std::iter::once(config.memory.receive_into)
        .chain(config.memory.spill.iter().copied())
        .map(|class| match class {
            MemoryClass::Host => host.tier(),
            MemoryClass::Pinned => pinned.tier(),
            MemoryClass::Device => match gpus.domains.first() {
                Some((_, d)) => d.tier(),
                None => {
                    tracing::warn!(
                        "memory.receive_into is \"device\" but this node has no GPU: \
                         receiving into host memory"
                    );
                    host.tier()
                }
            },
        })
        .collect()
}

/// The per-peer session bounds `[limits]` sets.
pub(super) fn session_limits(limits: &ferry_config::LimitsConfig) -> SessionLimits {
    SessionLimits {
        queue: limits.peer_queue,
        in_flight: limits.pipeline_depth as usize,
        // At least any sender's pipeline (its window bounds what it has open here),
        // whatever our own queue bound.
        inbound: limits
            .peer_queue
            .max(ferry_config::MAX_PIPELINE_DEPTH as usize),
        grants: limits.peer_grants,
        inbound_bytes: limits.peer_inbound_bytes,
        stall: limits.stall_timeout,
    }
}

/// The node's memory, for [`Buffer::promote`]: a reservation in one tier, no spill.
pub(super) struct NodeMemory {
    tiers: Vec<Tier>,
}

impl MemoryHome for NodeMemory {
    fn reserve(
        &self,
        kind: MemoryKind,
        len: u64,
        deadline: Instant,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<Buffer, ferry_transports::memory::ReserveError>>
                + Send,
        >,
    > {
        let tier = self.tiers.iter().find(|t| t.kind == kind).cloned();
        Box::pin(async move {
            let Some(tier) = tier else {
                return Err(
                    Error::unsupported(format!("no {kind} memory domain on this node")).into(),
                );
            };
            let mut got = reserve_in_tiers(&[tier], &[len], deadline).await?;
            got.pop().ok_or_else(|| "nothing granted".into())
        })
    }
}
