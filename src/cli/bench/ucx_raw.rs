//! The ucx bench's baseline: UCX's own read (or, for `--direction push`, write) loop
//! between the same two processes, through ferry's UCX engine but none of ferry's protocol.
//! The peer registers one buffer (host memory, or device memory of its GPU for `--memory
//! device`) and says where it is on its ready line; the bench reads it into the same kind
//! of memory with `window` gets in flight, or writes into it from such memory (each write a
//! put and a flush of the endpoint, as a ucx push ends).

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use ferry::{Buffer, Layout, MemoryKind, Node};
use ferry_transports::ucx::UcxSource;
use ferry_transports::ucx::{Engine, Exported, UcxPeer};
use futures::StreamExt;
use futures::stream::FuturesUnordered;

/// The ready line's field that describes the peer's registered buffer (`ucx=...`).
pub const FIELD: &str = "ucx";

/// The environment variable through which the bench tells its peer how large a buffer to
/// register for the baseline.
pub const BYTES_ENV: &str = "FERRY_BENCH_UCX_BYTES";

/// The environment variable through which the bench names the GPU whose memory the peer
/// registers (unset: host memory).
pub const GPU_ENV: &str = "FERRY_BENCH_UCX_GPU";

/// The environment the bench starts its peer with for a baseline of `bytes` in host
/// memory, or in GPU `gpu`'s.
pub fn peer_env(bytes: u64, gpu: Option<u32>) -> Vec<(&'static str, String)> {
    let mut env = vec![(BYTES_ENV, bytes.to_string())];
    env.extend(gpu.map(|g| (GPU_ENV, g.to_string())));
    env
}

/// Host memory, or GPU `gpu`'s.
fn memory(gpu: Option<u32>) -> MemoryKind {
    gpu.map_or(MemoryKind::Host, MemoryKind::Device)
}

/// An engine with the node's settings, working in GPU `gpu`'s context when it has one.
fn engine(config: &ferry::Config, gpu: Option<u32>) -> anyhow::Result<Engine> {
    let device = gpu
        .map(|g| ferry_transports::cuda::Device::open(g as usize))
        .transpose()
        .context("opening the baseline's GPU")?;
    ferry_transports::ucx::start_engine(config, device.as_ref())
        .context("the baseline's UCX engine")
}

/// The peer's half: an engine of its own and one registered host buffer, kept for the
/// process's life, described as `ucx=ADDRESS/RKEY/AT` (hex) for the ready line.
pub struct Served {
    _exported: Exported,
    _engine: Engine,
    /// The ready line's field.
    pub field: String,
}

/// Starts the peer's baseline when the bench asked for one ([`BYTES_ENV`]).
pub async fn serve(node: &Node) -> anyhow::Result<Option<Served>> {
    let Some(bytes) = std::env::var(BYTES_ENV).ok() else {
        return Ok(None);
    };
    let bytes: usize = bytes.parse().context("FERRY_BENCH_UCX_BYTES")?;
    let gpu = match std::env::var(GPU_ENV) {
        Ok(g) => Some(g.parse().context("FERRY_BENCH_UCX_GPU")?),
        Err(_) => None,
    };
    let engine = engine(node.config(), gpu)?;
    let buffer = node.alloc(memory(gpu), bytes.max(1)).await?;
    let exported = engine
        .export(buffer.share())
        .context("registering the baseline buffer")?;
    let source = exported.source();
    let field = format!(
        "{FIELD}={}/{}/{:x}",
        hex(&engine.address()),
        hex(&source.rkey),
        source.address
    );
    Ok(Some(Served {
        _exported: exported,
        _engine: engine,
        field,
    }))
}

/// The bench's half: its own engine, connected to the peer's.
pub struct Reader {
    _engine: Engine,
    peer: Arc<UcxPeer>,
    source: UcxSource,
    gpu: Option<u32>,
    /// Writes into the peer's buffer instead of reading it.
    pub push: bool,
}

impl Reader {
    /// Connects to the peer described by its ready line's `ucx=` field, to read into host
    /// memory, or into GPU `gpu`'s.
    pub fn connect(
        config: &ferry::Config,
        field: &str,
        gpu: Option<u32>,
        push: bool,
    ) -> anyhow::Result<Reader> {
        let mut parts = field.split('/');
        let (Some(address), Some(rkey), Some(at)) = (parts.next(), parts.next(), parts.next())
        else {
            anyhow::bail!("the bench peer's ucx field is malformed: {field:?}");
        };
        let engine = engine(config, gpu)?;
        let peer = engine
            .connect(unhex(address)?)
            .context("connecting to the peer's baseline")?;
        Ok(Reader {
            _engine: engine,
            peer: Arc::new(peer),
            source: UcxSource {
                address: u64::from_str_radix(at, 16).context("the baseline buffer's address")?,
                rkey: unhex(rkey)?,
                packed: false,
            },
            gpu,
            push,
        })
    }

    /// The baseline in words, for the header.
    pub fn label(&self) -> &'static str {
        if self.push {
            "UCX's own ucp_put + flush loop between the same two processes (ferry's engine, \
             none of its protocol), the same memory"
        } else {
            "UCX's own ucp_get loop between the same two processes (ferry's engine, none of \
             its protocol), the same memory"
        }
    }

    /// GB/s of `iters` reads of `size` bytes with up to `window` in flight, after `warmup`.
    pub async fn measure(
        &self,
        node: &Node,
        size: u64,
        iters: u64,
        warmup: u64,
        window: u64,
    ) -> anyhow::Result<f64> {
        let len = usize::try_from(size)?;
        let mut free: Vec<Buffer> = Vec::new();
        for _ in 0..window {
            free.push(node.alloc(memory(self.gpu), len).await?);
        }
        self.run(&mut free, warmup).await?;
        let started = Instant::now();
        self.run(&mut free, iters).await?;
        Ok((size * iters) as f64 / started.elapsed().as_secs_f64().max(1e-9) / 1e9)
    }

    async fn run(&self, free: &mut Vec<Buffer>, count: u64) -> anyhow::Result<()> {
        let mut flying = FuturesUnordered::new();
        let mut started = 0;
        while started < count || !flying.is_empty() {
            while started < count
                && let Some(buffer) = free.pop()
            {
                let (peer, source) = (Arc::clone(&self.peer), self.source.clone());
                let push = self.push;
                flying.push(async move {
                    if !push {
                        return peer.get_into(buffer, &source, &Layout::Contiguous).await;
                    }
                    let len = buffer.len() as u64;
                    let never = std::sync::atomic::AtomicBool::new(false);
                    let put = peer
                        .put_from(buffer.share(), &Layout::Contiguous, len, &source, &never)
                        .await;
                    (buffer, put)
                });
                started += 1;
            }
            if let Some((buffer, got)) = flying.next().await {
                got.context("a baseline read or write")?;
                free.push(buffer);
            }
        }
        Ok(())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> anyhow::Result<Vec<u8>> {
    if text.len() % 2 != 0 {
        anyhow::bail!("odd hex length");
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            text.get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .context("bad hex")
        })
        .collect()
}
