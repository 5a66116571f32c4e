//! Reservations across a receive's tiers: made at once on the caller's thread where one
//! tier can grant, else queued at every tier able to grant later.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use actix::prelude::*;
use ferry_transports::memory::{Buffer, MemoryKind};
use tokio::sync::oneshot;

use super::{Domain, Fill, Reserve};
use crate::error::Error;

/// One requester's claim on a reservation it placed at several tiers: exactly one tier
/// delivers; the requester gives up by closing it.
#[derive(Debug)]
pub struct Claim {
    taken: AtomicBool,
    tx: Mutex<Option<ClaimSender>>,
}

/// Where a claim's buffers go, or why the tier that granted it could not make them.
type ClaimSender = oneshot::Sender<Result<Vec<Buffer>, Error>>;

impl Claim {
    /// A claim and the receiver its buffers (or the granting tier's failure) arrive on.
    pub fn new() -> (Arc<Self>, oneshot::Receiver<Result<Vec<Buffer>, Error>>) {
        let (tx, rx) = oneshot::channel();
        let claim = Arc::new(Self {
            taken: AtomicBool::new(false),
            tx: Mutex::new(Some(tx)),
        });
        (claim, rx)
    }

    /// Marks the claim taken (no other tier delivers to it from now on) and hands over
    /// where its buffers go: `None` when another tier took it, or the requester gave up.
    pub(super) fn take(&self) -> Option<ClaimSender> {
        if self.taken.swap(true, Ordering::AcqRel) {
            return None;
        }
        self.tx.lock().ok().and_then(|mut t| t.take())
    }

    /// The requester stopped waiting.
    pub fn close(&self) {
        self.taken.store(true, Ordering::Release);
    }

    pub(super) fn is_taken(&self) -> bool {
        self.taken.load(Ordering::Acquire)
    }
}

/// One tier a reservation may land in.
#[derive(Clone)]
pub struct Tier {
    /// Its memory kind.
    pub kind: MemoryKind,
    /// Its allocator.
    pub allocator: Recipient<Reserve>,
    /// Its budget and memory, for reservations made at once. Weak: buffers reach their
    /// tiers through the node's memory home, which the domain holds (a strong reference
    /// would keep the domain, and a GPU's pool, alive forever).
    pub domain: std::sync::Weak<Domain>,
}

/// Reserves every part in the first tier that can grant them all now, in order, on the
/// caller's thread with no message to any actor (device memory in order `on` a stream of
/// its GPU, when given: see [`Domain::try_now_on`]); `None` when none can now (then
/// [`reserve_in_tiers`] waits). A tier that refuses (larger than its budget, or its GPU
/// refused the allocation) is passed over, as a tier that is full: the waiting path asks
/// again and names the reason if no tier grants. The buffers hold what `fill` says (with
/// [`Fill::Overwritten`], memory of buffers dropped earlier may come back: device memory
/// only when allocated on `on`). Blocking for device memory: never on the actor thread.
pub fn reserve_now_in_tiers(
    tiers: &[Tier],
    parts: &[u64],
    on: Option<&ferry_transports::cuda::Stream>,
    fill: Fill,
) -> Option<Vec<Buffer>> {
    match try_tiers_now(tiers, parts, on, fill) {
        TriedNow::Granted(buffers) => Some(buffers),
        TriedNow::Not { .. } => None,
    }
}

/// Host memory for `len` bytes about to be written whole (an eager receive), from the
/// first host tier of `tiers` that grants it now, on the caller's thread with no message
/// to any actor; `None` when none can now (full, reservations waiting there, or larger
/// than its budget). Device tiers are passed over: this never waits for a GPU.
pub fn reserve_now_to_overwrite(tiers: &[Tier], len: u64) -> Option<Buffer> {
    let host: Vec<Tier> = tiers
        .iter()
        .filter(|t| !matches!(t.kind, MemoryKind::Device(_)))
        .cloned()
        .collect();
    match try_tiers_now(&host, &[len], None, Fill::Overwritten) {
        TriedNow::Granted(mut buffers) => buffers.pop(),
        TriedNow::Not { .. } => None,
    }
}

/// What one pass over the tiers on the caller's thread gave.
enum TriedNow {
    /// A tier granted every part.
    Granted(Vec<Buffer>),
    /// None could now: the tiers that may later (a reservation queues there), and the last
    /// refusal of one that never can (larger than its budget, its GPU refused, it stopped).
    Not {
        able: Vec<Tier>,
        refusal: Option<Error>,
    },
}

/// Tries each tier in order on this thread (see [`reserve_now_in_tiers`]), for buffers
/// holding what `fill` says.
fn try_tiers_now(
    tiers: &[Tier],
    parts: &[u64],
    on: Option<&ferry_transports::cuda::Stream>,
    fill: Fill,
) -> TriedNow {
    let mut able = Vec::new();
    let mut refusal = None;
    for tier in tiers {
        // A domain gone: the node is shutting down.
        let Some(domain) = tier.domain.upgrade() else {
            refusal = Some(Error::ShuttingDown);
            continue;
        };
        match domain.try_now_on(parts, on, fill) {
            Ok(Some(buffers)) => return TriedNow::Granted(buffers),
            Ok(None) => able.push(tier.clone()),
            Err(e) => refusal = Some(e),
        }
    }
    TriedNow::Not { able, refusal }
}

/// Reserves every part in the first tier that can grant them all now, in order (on this
/// thread, with no message: [`reserve_now_in_tiers`]); if none can, waits at every tier
/// until one can or `deadline` passes. All parts land in one tier. Returns the buffers
/// (their [`Buffer::kind`] says which tier). A device allocation may run on the calling
/// thread: not on the actor thread.
///
/// # Errors
/// [`Error::NoMemory`] when no tier could grant in time, or every tier is smaller than the
/// request; [`Error::ShuttingDown`] when the allocators stopped.
pub async fn reserve_in_tiers(
    tiers: &[Tier],
    parts: &[u64],
    deadline: Instant,
) -> Result<Vec<Buffer>, Error> {
    queue(
        try_tiers_now(tiers, parts, None, Fill::Zeroed),
        parts,
        deadline,
    )
    .await?
    .granted()
    .await
}

/// Places a reservation across `tiers` for a caller on an actor's thread: granted now (a
/// try that may allocate device memory runs on a blocking thread of `io`: the allocation
/// waits for its stream), or queued at every tier able to grant it. Only the placing is
/// ordered: a caller that places its reservations one after another keeps their order in
/// each tier's queue, and may await [`Placement::granted`] side by side. A grant made now
/// holds what `fill` says; one that waited is zeroed host memory either way.
///
/// # Errors
/// As [`reserve_in_tiers`], for a request no tier takes.
pub async fn place_in_tiers_off_actor(
    tiers: &[Tier],
    parts: &[u64],
    deadline: Instant,
    io: &tokio::runtime::Handle,
    fill: Fill,
) -> Result<Placement, Error> {
    let device = tiers
        .iter()
        .any(|t| matches!(t.kind, MemoryKind::Device(_)));
    let tried = if device {
        let (tiers, parts) = (tiers.to_vec(), parts.to_vec());
        io.spawn_blocking(move || try_tiers_now(&tiers, &parts, None, fill))
            .await
            .map_err(|_| Error::ShuttingDown)?
    } else {
        try_tiers_now(tiers, parts, None, fill)
    };
    queue(tried, parts, deadline).await
}

/// A reservation placed: granted already, or queued at the tiers able to grant it.
#[derive(Debug)]
pub enum Placement {
    /// Granted at once.
    Granted(Vec<Buffer>),
    /// Queued until one of the tiers grants, or the deadline.
    Queued(Queued),
}

/// A reservation queued at one or more tiers (see [`Placement`]).
#[derive(Debug)]
pub struct Queued {
    claim: Arc<Claim>,
    rx: oneshot::Receiver<Result<Vec<Buffer>, Error>>,
    kind: MemoryKind,
    total: u64,
    deadline: Instant,
}

impl Placement {
    /// The buffers, once a tier granted them.
    ///
    /// # Errors
    /// [`Error::NoMemory`] when the deadline passed first, or the granting GPU refused the
    /// allocation; [`Error::ShuttingDown`] when the node stopped.
    pub async fn granted(self) -> Result<Vec<Buffer>, Error> {
        let q = match self {
            Placement::Granted(buffers) => return Ok(buffers),
            Placement::Queued(q) => q,
        };
        let waited =
            tokio::time::timeout_at(tokio::time::Instant::from_std(q.deadline), q.rx).await;
        q.claim.close();
        match waited {
            Ok(Ok(made)) => made,
            // Taken by a tier whose making of the buffers never ran: the node stops.
            Ok(Err(_)) => Err(Error::ShuttingDown),
            Err(_) => Err(Error::NoMemory {
                kind: q.kind,
                len: q.total,
                cause: crate::error::NoMemoryCause::DeadlinePassed,
                detail: "deadline passed while waiting for budget".into(),
            }),
        }
    }
}

/// After a pass over the tiers that granted nothing, asks every tier able to grant later
/// to queue the reservation (the first to grant delivers, until `deadline`).
async fn queue(tried: TriedNow, parts: &[u64], deadline: Instant) -> Result<Placement, Error> {
    let total: u64 = parts.iter().fold(0u64, |a, p| a.saturating_add(*p));
    let (able, refusal) = match tried {
        TriedNow::Granted(buffers) => return Ok(Placement::Granted(buffers)),
        TriedNow::Not { able, refusal } => (able, refusal),
    };
    let Some(first) = able.first() else {
        return Err(refusal.unwrap_or(Error::NoMemory {
            kind: MemoryKind::Host,
            len: total,
            cause: crate::error::NoMemoryCause::NoTier,
            detail: "no memory tier configured".into(),
        }));
    };
    let kind = first.kind;
    let (claim, rx) = Claim::new();
    for tier in &able {
        let asked = tier.allocator.send(Reserve {
            parts: parts.to_vec(),
            deadline,
            claim: Arc::clone(&claim),
        });
        // A tier that refuses (queue full) just does not take part.
        let _ = asked.await;
    }
    Ok(Placement::Queued(Queued {
        claim,
        rx,
        kind,
        total,
        deadline,
    }))
}

/// The receive tiers of a node as a transport reserves in them ([`ReceiveMemory`]): what
/// a transport's own thread (a lane's) lands a peer's transfers in.
///
/// [`ReceiveMemory`]: ferry_transports::transport::ReceiveMemory
pub struct TierMemory {
    /// Where receives land first, then where they spill.
    pub tiers: Vec<Tier>,
}

impl ferry_transports::transport::ReceiveMemory for TierMemory {
    fn now(
        &self,
        len: u64,
        on: Option<&ferry_transports::cuda::Stream>,
        fill: Fill,
    ) -> Option<Buffer> {
        reserve_now_in_tiers(&self.tiers, &[len], on, fill)?
            .into_iter()
            .next()
    }

    fn wait(
        &self,
        len: u64,
        deadline: Instant,
    ) -> futures::future::BoxFuture<'static, Result<Buffer, String>> {
        let tiers = self.tiers.clone();
        Box::pin(async move {
            let mut got = reserve_in_tiers(&tiers, &[len], deadline)
                .await
                .map_err(|e| e.to_string())?;
            got.pop().ok_or_else(|| "no memory granted".to_string())
        })
    }

    fn device(&self) -> Option<u32> {
        self.tiers.iter().find_map(|t| match t.kind {
            MemoryKind::Device(n) => Some(n),
            _ => None,
        })
    }
}
