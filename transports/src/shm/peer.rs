//! The shm transport as a node serves it ([`ShmTransport`]: the pool its host domain takes
//! memory from) and its part of one peer's session ([`ShmPart`]): our pool buffers exported
//! for the peer's pulls and kept until it lets go, pulls out of the peer's pool, pushes into
//! buffers the peer lends, and our pool buffers lent for its pushes.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use ferry_config::TransportName;

use super::imports::PeerPool;
use super::pool::{Pool, PoolSettings};
use super::segment::Segment;
use super::setup::{LaneSettings, ShmSetup, Sides};
use super::wire::ShmMessage;
use super::{ShmError, ShmSource, ShmTerms};
use crate::memory::{Buffer, HostSource, MappedHost, SharedBytes};
use crate::transport::{
    Admission, Attached, Capabilities, Descriptor, DescriptorError, Exported, Exporting, Lend,
    LentBuffer, LentMemory, Moving, OpId, PartEvent, PeerEnv, PeerTransport, Retired, Transport,
    TransportError, Viability,
};
use crate::wire::Layout;

/// Copies up to this many bytes run where the pull's future is polled; larger ones on a
/// blocking thread of the node's runtime (a 64 MiB copy takes milliseconds).
pub const INLINE_COPY_MAX: usize = 256 << 10;

/// The shm transport of one node: its pool (none when `transport.shm.enabled` is false).
pub struct ShmTransport {
    caps: Capabilities,
    viability: Viability,
    pool: Option<Arc<Pool>>,
    lane: LaneSettings,
}

impl ShmTransport {
    /// The transport `[transport.shm]` asks for: a pool of `segment_size` segments up to
    /// `max_bytes`, where the machine makes sealed memfds ([`super::viability`]).
    pub fn from_config(config: &ferry_config::Config) -> Self {
        let shm = &config.transport.shm;
        let viability = if shm.enabled {
            super::viability()
        } else {
            Viability::NotViable("transport.shm.enabled is false".into())
        };
        let settings = PoolSettings {
            segment: usize::try_from(shm.segment_size).unwrap_or(usize::MAX),
            max: usize::try_from(shm.max_bytes).unwrap_or(usize::MAX),
        };
        let pool = (viability == Viability::Viable).then(|| Pool::new(settings));
        let lane = LaneSettings {
            max: usize::try_from(shm.lane_max).unwrap_or(usize::MAX),
            spin: shm.lane_spin,
        };
        Self {
            caps: super::capabilities(),
            viability,
            pool,
            lane,
        }
    }

    /// The pool, if the node serves shm.
    pub fn pool(&self) -> Option<&Arc<Pool>> {
        self.pool.as_ref()
    }
}

impl Transport for ShmTransport {
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn viability(&self) -> Viability {
        self.viability.clone()
    }

    /// The pool's id: the key to its segments at our fd-sharing socket.
    fn announce(&self) -> Vec<u8> {
        let Some(pool) = &self.pool else {
            return Vec::new();
        };
        crate::transport::encode(&ShmTerms { pool: *pool.id() }).unwrap_or_default()
    }

    /// A peer's pool matters only for its memory we read or write; an announcement with
    /// no pool serves pulls from ours. One that is not shm's terms at all is refused.
    fn usable_with(&self, theirs: &[u8]) -> Result<(), String> {
        if theirs.is_empty() {
            return Ok(());
        }
        ShmTerms::read(theirs)
            .map(|_| ())
            .map_err(|e| format!("its shm announcement: {e}"))
    }

    fn open(&self, env: PeerEnv) -> Box<dyn PeerTransport> {
        if let Some(pool) = &self.pool {
            pool.serve_in(&env.gpus.rings);
        }
        Box::new(ShmPart {
            env,
            pool: self.pool.clone(),
            peer: None,
            exported: HashMap::new(),
            setup: ShmSetup::new(self.lane),
        })
    }

    fn host_memory(&self) -> Option<Arc<dyn HostSource>> {
        self.pool.clone().map(|p| p as Arc<dyn HostSource>)
    }
}

/// The shm part of one peer's session.
struct ShmPart {
    env: PeerEnv,
    pool: Option<Arc<Pool>>,
    /// The peer's pool, once a link to it on this host came up with its announcement.
    peer: Option<Arc<PeerPool>>,
    /// Our buffers offered for pulling, kept until the peer says it no longer reads them.
    exported: HashMap<OpId, SharedBytes>,
    /// The setup with the peer, and the lanes it opened.
    setup: ShmSetup,
}

impl ShmPart {
    /// The setup, and what it works with: the session's services, our pool and the peer's.
    fn setup(&mut self) -> (&mut ShmSetup, Sides<'_>) {
        let sides = Sides {
            env: &self.env,
            ours: self.pool.as_ref(),
            theirs: self.peer.as_ref(),
        };
        (&mut self.setup, sides)
    }

    fn pump(&mut self, now: Instant) {
        let (setup, sides) = self.setup();
        setup.pump(now, &sides);
    }

    /// Where our pool buffer `view` lies, as a descriptor names it; an empty buffer names
    /// no memory.
    fn describe(&self, view: &SharedBytes) -> Result<ShmSource, ShmError> {
        let pool = self
            .pool
            .as_ref()
            .ok_or_else(|| ShmError::Buffer("this node has no shared-memory pool".into()))?;
        if view.is_empty() {
            return Ok(empty(*pool.id()));
        }
        pool_source(pool, view.source_memory(), view.len()).ok_or_else(|| {
            ShmError::Buffer(
                "the buffer is not in the shared-memory pool (the pool was full, or the memory \
                 is wrapped in place)"
                    .into(),
            )
        })
    }

    /// The peer's pool, or why it cannot be read.
    fn peer(&self) -> Result<Arc<PeerPool>, TransportError> {
        self.peer
            .clone()
            .ok_or_else(|| TransportError::new("the peer announced no shm pool on this host"))
    }

    /// Holds `view` for the lease timeout: the peer may still be reading it.
    fn hold(&self, view: SharedBytes) {
        let wait = self.env.lease_timeout;
        self.env.io.spawn(async move {
            tokio::time::sleep(wait).await;
            drop(view);
        });
    }
}

/// The descriptor of an empty buffer of `pool`.
fn empty(pool: [u8; 16]) -> ShmSource {
    ShmSource {
        pool,
        segment: u32::MAX,
        segment_len: 0,
        offset: 0,
        len: 0,
    }
}

/// A descriptor the peer sent, refused: counted, logged, and the transfer's error.
fn refused(peer: &str, e: ShmError) -> TransportError {
    metrics::counter!("ferry_shm_refused_total").increment(1);
    tracing::warn!(peer, "refused the peer's shm descriptor: {e}");
    TransportError::of(e)
}

/// Runs `copy` here when it is small, else on a blocking thread of `io`.
async fn run_copy<T: Send + 'static>(
    io: &tokio::runtime::Handle,
    len: usize,
    copy: impl FnOnce() -> Result<T, ShmError> + Send + 'static,
) -> Result<T, TransportError> {
    let copied = if len <= INLINE_COPY_MAX {
        copy()
    } else {
        io.spawn_blocking(copy)
            .await
            .map_err(|e| TransportError::because("the shm copy task", e))?
    };
    copied.map_err(TransportError::of)
}

/// Copies `source`'s bytes of `segment`, laid out as `layout` there, into `into` (their
/// packed length): one `memcpy` for a contiguous buffer.
pub(super) fn copy_out(
    segment: &Segment,
    source: &ShmSource,
    layout: &Layout,
    mut into: Buffer,
) -> Result<Buffer, ShmError> {
    let (offset, len) = (source.offset as usize, source.len as usize);
    let dst = into
        .as_mut_slice()
        .ok_or_else(|| ShmError::Buffer("the landing buffer is not writable host memory".into()))?;
    if *layout == Layout::Contiguous {
        if dst.len() != len {
            return Err(ShmError::Buffer(format!(
                "{len} bytes offered for a landing of {}",
                dst.len()
            )));
        }
        segment.copy_out(offset, dst)?;
    } else {
        segment
            .read_with(offset, len, |src| layout.gather(src, 0, dst))?
            .map_err(|e| ShmError::Buffer(format!("the offer's layout: {e}")))?;
    }
    Ok(into)
}

impl PeerTransport for ShmPart {
    fn transport(&self) -> TransportName {
        ShmSource::TRANSPORT
    }

    /// We take the peer's offers over shm when it is on this host and announced its pool.
    fn attach(&mut self, link: &Attached<'_>) -> bool {
        self.setup.attach(link.hello.pid, link.same_host);
        let terms = link
            .hello
            .announced(ShmSource::TRANSPORT)
            .map(ShmTerms::read);
        let terms = match terms {
            Some(Ok(terms)) if link.same_host => terms,
            Some(Err(e)) => {
                tracing::warn!(peer = %self.env.peer, "the peer's shm announcement: {e}");
                self.peer = None;
                return false;
            }
            _ => {
                self.peer = None;
                return false;
            }
        };
        // A new link to the same pool keeps what is mapped of it.
        let same = self.peer.as_ref().is_some_and(|p| *p.id() == terms.pool);
        if !same {
            self.peer = Some(Arc::new(PeerPool::new(
                &self.env.peer,
                link.hello.pid,
                self.env.secret.clone(),
                terms.pool,
            )));
        }
        true
    }

    /// A send over shm asks the setup with the peer (started by the first): the peer must
    /// map our pool's probe first.
    fn admit(&mut self, now: Instant) -> Admission {
        let (setup, sides) = self.setup();
        setup.admit(now, &sides)
    }

    fn handle_message(&mut self, body: &[u8], now: Instant) -> Result<(), DescriptorError> {
        let msg = ShmMessage::read(body)?;
        let (setup, sides) = self.setup();
        setup.on_message(msg, now, &sides);
        Ok(())
    }

    fn poll_message(&mut self) -> Option<Vec<u8>> {
        self.pump(Instant::now());
        let message = self.setup.poll_message()?;
        match message.encode() {
            Ok(body) => Some(body),
            Err(why) => {
                (self.setup.events).push_back(PartEvent::Broke(format!("an shm message: {why}")));
                None
            }
        }
    }

    fn poll_event(&mut self) -> Option<PartEvent> {
        self.pump(Instant::now());
        self.setup.events.pop_front()
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.setup.poll_timeout()
    }

    fn handle_timeout(&mut self, now: Instant) {
        self.setup.handle_timeout(now);
        self.pump(now);
    }

    fn awaits_peer(&self) -> bool {
        self.setup.awaits_peer()
    }

    fn detach(&mut self) {
        self.setup.end_lanes(&self.env);
    }

    /// Where the buffer lies in our pool; a buffer not in it is not exported (the send
    /// takes the rule's next transport).
    fn export(&mut self, buffer: &Buffer, _: &Layout) -> Exporting {
        let described = self
            .describe(&buffer.share())
            .map_err(TransportError::of)
            .and_then(|s| s.describe().map_err(TransportError::from));
        Exporting::Now(described.map(|descriptor| Exported {
            descriptor,
            kept: None,
        }))
    }

    fn keep(&mut self, op: OpId, _: Option<Box<dyn Send>>, buffer: &Buffer) {
        self.exported.insert(op, buffer.share());
    }

    fn released(&mut self, op: OpId) {
        self.exported.remove(&op);
    }

    /// The peer gave up: a copy it started may still read, so the buffer is held for the
    /// lease timeout before its memory can be reused.
    fn cancelled(&mut self, op: OpId) {
        if let Some(view) = self.exported.remove(&op) {
            self.hold(view);
        }
    }

    /// One copy out of the peer's mapping into `into` (the segment mapped the first time a
    /// descriptor names it); a descriptor that names another pool, a segment of another
    /// size or a range past it is refused, saying which.
    fn pull(&mut self, source: &Descriptor, layout: Layout, into: Buffer) -> Moving<Buffer> {
        let source = match ShmSource::read(source) {
            Ok(source) => source,
            Err(e) => return Box::pin(std::future::ready(Err(TransportError::from(e)))),
        };
        let peer = match self.peer() {
            Ok(peer) => peer,
            Err(e) => return Box::pin(std::future::ready(Err(e))),
        };
        let (name, io) = (self.env.peer.clone(), self.env.io.clone());
        if source.len == 0 {
            let empty = layout.check(0).is_ok_and(|n| n == 0) && into.is_empty();
            let done = if empty {
                Ok(into)
            } else {
                Err(refused(
                    &name,
                    ShmError::Buffer("an empty offer for a landing of bytes".into()),
                ))
            };
            return Box::pin(std::future::ready(done));
        }
        // Mapped already and small: the copy runs right here.
        if let Ok(Some(segment)) = peer.segment_now(&source)
            && source.len as usize <= INLINE_COPY_MAX
        {
            let copied = copy_out(&segment, &source, &layout, into).map_err(TransportError::of);
            return Box::pin(std::future::ready(copied));
        }
        Box::pin(async move {
            let segment = peer.segment(&source).await.map_err(|e| refused(&name, e))?;
            let len = source.len as usize;
            run_copy(&io, len, move || copy_out(&segment, &source, &layout, into)).await
        })
    }

    /// One copy of the packed bytes into the buffer the peer lent (its segment mapped the
    /// first time a grant names it).
    fn write(
        &mut self,
        target: &Descriptor,
        bytes: SharedBytes,
        layout: Layout,
        _stop: Arc<AtomicBool>,
    ) -> Moving<()> {
        let target = match ShmSource::read(target) {
            Ok(target) => target,
            Err(e) => return Box::pin(std::future::ready(Err(TransportError::from(e)))),
        };
        let peer = match self.peer() {
            Ok(peer) => peer,
            Err(e) => return Box::pin(std::future::ready(Err(e))),
        };
        let (name, io) = (self.env.peer.clone(), self.env.io.clone());
        Box::pin(async move {
            let packed = layout
                .check(bytes.len() as u64)
                .map_err(|e| TransportError::because("the push's layout", e))?;
            if packed != target.len {
                let e = ShmError::Buffer(format!(
                    "{packed} bytes pushed into a lent buffer of {}",
                    target.len
                ));
                return Err(refused(&name, e));
            }
            if packed == 0 {
                return Ok(());
            }
            let segment = peer.segment(&target).await.map_err(|e| refused(&name, e))?;
            let (offset, len) = (target.offset as usize, target.len as usize);
            run_copy(&io, len, move || {
                segment
                    .write_with(offset, len, |dst| bytes.read_packed(&layout, 0, dst))?
                    .map_err(|e| ShmError::Buffer(format!("the push's bytes: {e}")))
            })
            .await
        })
    }

    fn lender(&self) -> Option<Arc<dyn Lend>> {
        let pool = self.pool.clone()?;
        Some(Arc::new(ShmLender { pool }))
    }

    /// Our buffers the peer may still read are held for the lease timeout; our mapping of
    /// its pool goes once the copies that hold it end.
    fn close(&mut self) -> Vec<(OpId, Retired)> {
        self.setup.end_lanes(&self.env);
        self.peer = None;
        self.exported
            .drain()
            .map(|(op, view)| (op, Retired::Hold(Box::new(view))))
            .collect()
    }
}

/// Lends our pool buffers to the peer's shm pushes; a buffer not in the pool is not lent
/// (the bytes stream over the link).
struct ShmLender {
    pool: Arc<Pool>,
}

impl ShmLender {
    fn source(&self, buffer: &Buffer) -> Option<ShmSource> {
        pool_source(&self.pool, buffer.source_memory(), buffer.len())
    }
}

/// Where the `len` bytes of `memory` lie in `pool`, as a descriptor names them; `None`
/// when they are not the pool's.
pub(super) fn pool_source(
    pool: &Pool,
    memory: Option<&dyn MappedHost>,
    len: usize,
) -> Option<ShmSource> {
    let bytes = memory.and_then(|m| pool.owns(m))?;
    Some(ShmSource {
        pool: *pool.id(),
        segment: bytes.segment(),
        segment_len: bytes.segment_len() as u64,
        offset: bytes.offset() as u64,
        len: len as u64,
    })
}

impl Lend for ShmLender {
    fn lends<'a>(&'a self, buffer: &'a Buffer) -> futures::future::BoxFuture<'a, bool> {
        Box::pin(std::future::ready(self.source(buffer).is_some()))
    }

    fn lend(&self, buffer: Buffer) -> Result<(Box<dyn LentMemory>, Descriptor), TransportError> {
        let source = self
            .source(&buffer)
            .ok_or_else(|| TransportError::new("the buffer is not in the shared-memory pool"))?;
        let descriptor = source.describe()?;
        // Unwritten, held for the lease timeout: the peer may still be copying into it.
        let lent = LentBuffer::new(buffer, |b| Retired::Hold(Box::new(b)));
        Ok((Box::new(lent), descriptor))
    }
}
