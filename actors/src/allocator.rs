//! The allocator actor of one memory domain: a shell over [`Budget`] and [`Exports`].
//!
//! Buffers are released from whatever thread drops them, without a message per buffer:
//! the release adds to an atomic counter and wakes a small task that tells the actor how
//! many bytes came back. Nothing queues, so nothing can overflow.
//!
//! A receive that may spill asks its tiers in order to grant *now*; if none can, it waits
//! at every tier at once with one shared [`Claim`]: the first tier able to grant takes the
//! claim and delivers, the others give their grant back. A waiting reservation holds
//! nothing, and all the parts of one reservation come from one tier or none.
//!
//! Memory of dropped buffers may stay with the domain for a later grant that overwrites it
//! (the shelf, `shelf.rs`), until unused for `memory.keep_idle`: one timer of the actor,
//! armed only while something is kept, sweeps it, and gives a GPU pool's unused memory back
//! (`device.rs`), off the actor's thread. Reservations across tiers are in `tiers.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use actix::prelude::*;
use ferry_transports::cuda::Stream;
use ferry_transports::memory::{
    Buffer, BufferId, Generation, HostBytes, HostSource, Lease, MemoryHome, MemoryKind, Releaser,
    SharedBytes,
};

use crate::core::budget::{Budget, BudgetStats, ReservationEvent, ReservationId, Reserved};
use crate::core::exports::{ExportId, ExportStats, Exports};
use crate::error::Error;
use crate::timer::DeadlineTimer;

mod device;
mod returned;
mod shelf;
mod tiers;

pub use device::DevicePool;
use device::give_back;
use returned::{DomainReturn, RETURN_COALESCE, ReturnedBytes};
pub use shelf::Keeping;
use shelf::{Kept, SHELF_BUFFERS, SHELF_DEVICE_BUFFERS, Shelf, free_kept};
pub use tiers::{
    Claim, Placement, Queued, Tier, TierMemory, place_in_tiers_off_actor, reserve_in_tiers,
    reserve_now_in_tiers, reserve_now_to_overwrite,
};

pub use ferry_transports::memory::Fill;

/// Queue a reservation for buffers of these sizes, all or none, in this domain until
/// `deadline`; the buffers go to the claim (at once when they fit now with nobody waiting).
/// Refused when larger than the domain, or its queue is full.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), Error>")]
pub struct Reserve {
    /// Bytes of each part.
    pub parts: Vec<u64>,
    /// When to give up waiting.
    pub deadline: Instant,
    /// Where the buffers go.
    pub claim: Arc<Claim>,
}

/// A domain's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DomainStats {
    /// The budget and what is granted (exported and quarantined memory count as granted).
    pub budget: BudgetStats,
    /// Exported to peers, and quarantined after a peer died.
    pub exports: ExportStats,
    /// Memory of dropped buffers kept for later grants.
    pub kept: KeptStats,
}

/// Memory of dropped buffers a domain keeps for later grants that overwrite it whole
/// (`memory.keep_idle`, `memory.keep_max`). Kept bytes count as free in the budget: a
/// grant that needs them frees them first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KeptStats {
    /// Bytes kept now.
    pub bytes: u64,
    /// Grants served from kept memory since the domain started (each one a new
    /// allocation, and for host memory its page faults and zeroing, saved).
    pub reused: u64,
}

impl DomainStats {
    /// Bytes free to grant.
    pub fn free(&self) -> u64 {
        self.budget.capacity.saturating_sub(self.budget.granted)
    }
}

/// Ask for the domain's counters.
#[derive(Debug, Message)]
#[rtype(result = "DomainStats")]
pub struct Stats;

/// A peer now holds `view`'s memory; it is not freed before the peer releases it (or dies
/// and its lease times out).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Export {
    /// The export's id, chosen by the caller.
    pub id: ExportId,
    /// The peer.
    pub peer: String,
    /// Keeps the bytes alive.
    pub view: SharedBytes,
}

/// The peer released an export.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct ExportReleased(pub ExportId);

/// A peer died: what it held is quarantined for the lease timeout.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct PeerGone(pub String);

/// Tells the domain the node-wide home its buffers promote through.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetHome(pub Arc<dyn MemoryHome>);

#[derive(Debug, Message)]
#[rtype(result = "()")]
struct Returned(u64);

/// One domain's budget and the way its memory is made, shared by its actor and the
/// threads that reserve at once ([`Domain::try_now_on`]: a lane thread, a blocking copy).
/// The actor alone queues reservations, times them out and tracks exports; a reservation
/// that fits now, with nobody waiting ahead of it, needs no message.
pub struct Domain {
    kind: MemoryKind,
    device: OnceLock<DevicePool>,
    /// Where host memory comes from before the heap (a pool a transport offers).
    host_source: OnceLock<Arc<dyn HostSource>>,
    budget: Mutex<Budget>,
    returned: Arc<ReturnedBytes>,
    /// Memory kept for grants that overwrite it.
    shelf: Shelf,
    /// How much the shelf keeps, and how long (set once, before the actor starts).
    keeping: OnceLock<Keeping>,
    /// Set when the actor stopped: dropped buffers' memory is freed, not kept.
    closed: AtomicBool,
    /// Gives a buffer's bytes back to `returned`, and its memory to `shelf`.
    releaser: Arc<dyn Releaser>,
    home: OnceLock<Arc<dyn MemoryHome>>,
    next_id: AtomicU64,
}

impl std::fmt::Debug for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Domain").field("kind", &self.kind).finish()
    }
}

impl Domain {
    fn budget(&self) -> std::sync::MutexGuard<'_, Budget> {
        self.budget.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Takes host memory from `source` before the heap from now on (a host domain; set once,
    /// before the node grants: a second source is ignored, and says so).
    pub fn use_host_source(&self, source: Arc<dyn HostSource>) {
        if self.host_source.set(source).is_err() {
            tracing::warn!(domain = %self.kind, "a second host memory source is ignored");
        }
    }

    /// Bytes of the budget neither granted nor waiting to be counted back.
    fn free_now(&self, budget: &Budget) -> u64 {
        let stats = budget.stats();
        let returned = self.returned.bytes.load(Ordering::Acquire);
        stats
            .capacity
            .saturating_sub(stats.granted.saturating_sub(returned))
    }

    /// How much memory of dropped buffers the domain keeps, and how long.
    fn keeping(&self) -> Keeping {
        self.keeping.get().copied().unwrap_or_default()
    }

    /// Keeps the memory of a dropped buffer (its lease already given back) on the shelf, if
    /// it is worth keeping and fits `memory.keep_max` and the budget beside what is
    /// granted; else frees it here.
    fn shelve(&self, memory: Kept) {
        let keeping = self.keeping();
        // Once the domain's actor stopped, nothing is kept any more.
        if !memory.worth_keeping() || !keeping.keeps() || self.closed.load(Ordering::Acquire) {
            drop(memory);
            self.freed_to_pool();
            return;
        }
        let most = if self.on_device() {
            SHELF_DEVICE_BUFFERS
        } else {
            SHELF_BUFFERS
        };
        let now = Instant::now();
        let gone = {
            let budget = self.budget();
            let room = self.free_now(&budget).min(keeping.max);
            self.shelf.put(memory, now, room, most)
        };
        let freed = !gone.is_empty();
        // Freed outside the locks.
        drop(gone);
        if freed {
            self.freed_to_pool();
        }
        if self.shelf.needs_word() {
            self.returned.ask_for_sweep();
        }
    }

    /// Notes that memory went back into the domain's pool just now (a device pool, or the
    /// host source's, if any): the pool gives it back (to the GPU, to the kernel) once none
    /// more went in for `memory.keep_idle`.
    fn freed_to_pool(&self) {
        if self.on_device() || self.host_source.get().is_some() {
            self.shelf.note_freed(Instant::now());
            if self.shelf.needs_word() {
                self.returned.ask_for_sweep();
            }
        }
    }

    /// Takes all kept memory off the shelf (the caller frees it).
    fn take_shelf(&self) -> Vec<Kept> {
        self.shelf.take_all()
    }

    /// Frees kept memory that no longer fits beside what is granted (a grant just grew
    /// it), oldest first.
    /// Returns the streams its device memory is freed on.
    fn trim_shelf(&self) -> Vec<Stream> {
        if self.shelf.bytes() == 0 {
            return Vec::new();
        }
        let evicted = {
            let budget = self.budget();
            self.shelf.trim_to(self.free_now(&budget))
        };
        if evicted.is_empty() {
            return Vec::new();
        }
        let streams = free_kept(evicted);
        self.freed_to_pool();
        streams
    }

    /// Reserves every part now, on the caller's thread (a device allocation included),
    /// holding what `fill` says, or
    /// answers `Ok(None)`: the parts do not fit now, or reservations wait ahead of them
    /// (then only the actor's queue keeps their order). Never call it on the actor thread
    /// for device memory: the allocation waits for its stream. Device memory is allocated
    /// in order on `on` when it is a stream of this domain's GPU: usable by work queued on
    /// `on` next, without waiting for the allocation, and by anything else once that work
    /// is waited for (a copy into the buffer on that stream needs no other ordering: the
    /// buffer is freed on it too).
    ///
    /// # Errors
    /// The request is larger than the whole budget, or the GPU refused the allocation.
    pub fn try_now_on(
        &self,
        parts: &[u64],
        on: Option<&ferry_transports::cuda::Stream>,
        fill: Fill,
    ) -> Result<Option<Vec<Buffer>>, Error> {
        match self.take_budget_now(parts) {
            Ok(true) => self.grant(parts, on, fill).map(Some),
            Ok(false) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Counts `parts` as granted when they fit now with nobody waiting ahead (true); the
    /// buffers are then the caller's to make ([`Self::grant`]).
    fn take_budget_now(&self, parts: &[u64]) -> Result<bool, Error> {
        let granted = {
            let mut budget = self.budget();
            if budget.stats().waiting == 0 {
                // Nobody waits, so bytes given back grant nothing the actor must hear of.
                let bytes = self.returned.bytes.swap(0, Ordering::AcqRel);
                if bytes > 0 {
                    budget.handle_release(bytes);
                }
            }
            budget.handle_try_reserve(parts)
        };
        granted.map_err(|e| refusal(self.kind, parts, e))
    }

    /// True when granting makes device memory (a driver call that waits for its stream:
    /// never on the actor thread).
    fn on_device(&self) -> bool {
        self.device.get().is_some()
    }

    /// Makes buffers for `parts`, already counted as granted, holding what `fill` says. A
    /// device allocation can still fail (another process filled the GPU): then every part
    /// is given back and the error says why.
    fn grant(
        &self,
        parts: &[u64],
        on: Option<&ferry_transports::cuda::Stream>,
        fill: Fill,
    ) -> Result<Vec<Buffer>, Error> {
        // Kept memory first goes to the parts it fits; what is left of it must then fit
        // beside what is granted, before any memory is made.
        let mut kept: Vec<Option<Kept>> = parts
            .iter()
            .map(|&len| match fill {
                // Host memory comes from the source first (the shelf keeps heap memory).
                Fill::Overwritten if self.host_source.get().is_none() || self.on_device() => {
                    self.shelf.take(len, on)
                }
                Fill::Overwritten | Fill::Zeroed => None,
            })
            .collect();
        // Where kept memory was just freed: a refused allocation waits for it (below).
        let mut freed_on = self.trim_shelf();
        let mut buffers = Vec::with_capacity(parts.len());
        for (i, &len) in parts.iter().enumerate() {
            let id = self.next_id();
            let lease = Lease {
                kind: self.kind,
                id: BufferId(id),
                generation: Generation(id),
                len,
            };
            let releaser = Arc::clone(&self.releaser);
            let home = self.home.get().cloned();
            let Some(device) = self.device.get() else {
                let sourced = self.host_source.get().and_then(|source| {
                    let memory = source.take(usize::try_from(len).ok()?, fill)?;
                    let bytes = HostBytes::mapped(memory);
                    Buffer::from_host(lease, bytes, Arc::clone(&releaser), home.clone()).ok()
                });
                if let Some(buffer) = sourced {
                    buffers.push(buffer);
                    continue;
                }
                let buffer = match kept[i].take() {
                    Some(Kept::Host(bytes)) => Some(bytes),
                    _ => None,
                }
                .and_then(|bytes| {
                    Buffer::from_host_bytes(lease, bytes, Arc::clone(&releaser), home.clone()).ok()
                })
                .unwrap_or_else(|| Buffer::with_home(lease, releaser, home));
                buffers.push(buffer);
                continue;
            };
            // A zero-length device buffer takes no device memory: host bytes stand in.
            if len == 0 {
                buffers.push(Buffer::with_home(lease, releaser, home));
                continue;
            }
            let reusable = match kept[i].take() {
                Some(Kept::Device(memory)) => Some(memory),
                _ => None,
            };
            let made = self.device_memory(device, len, on, reusable, &mut freed_on);
            match made {
                Ok(memory) => buffers.push(Buffer::new_device(lease, memory, releaser, home)),
                Err(detail) => {
                    // The buffers made so far give their bytes back as they drop; the
                    // parts never made go back the same way, so the actor hears of them
                    // (they may grant a waiting reservation).
                    let never: u64 = parts[i..].iter().sum();
                    self.returned.release_bytes(never);
                    metrics::counter!("ferry_device_alloc_failures_total").increment(1);
                    return Err(Error::NoMemory {
                        kind: self.kind,
                        len,
                        cause: crate::error::NoMemoryCause::DriverRefused,
                        detail: format!("the GPU refused the allocation: {detail}"),
                    });
                }
            }
        }
        Ok(buffers)
    }
}

/// Why a domain refused a reservation outright.
fn refusal(kind: MemoryKind, parts: &[u64], e: crate::core::budget::ReserveError) -> Error {
    use crate::core::budget::ReserveError;
    Error::NoMemory {
        kind,
        len: parts.iter().fold(0u64, |a, p| a.saturating_add(*p)),
        cause: match e {
            ReserveError::TooLarge { .. } => crate::error::NoMemoryCause::LargerThanBudget,
            ReserveError::QueueFull(_) => crate::error::NoMemoryCause::QueueFull,
        },
        detail: e.to_string(),
    }
}

/// The allocator actor of one domain.
pub struct Allocator {
    domain: Arc<Domain>,
    exports: Exports<SharedBytes>,
    next_id: u64,
    waiting: HashMap<ReservationId, (Vec<u64>, Arc<Claim>)>,
    timer: DeadlineTimer,
    /// The sweep of kept memory, armed while memory waits for one.
    sweep: Option<SpawnHandle>,
}

impl Allocator {
    /// A domain of `kind` with a budget of `capacity` bytes, room for `queue_cap` waiting
    /// reservations, and exports quarantined for `lease_timeout` after their peer died.
    pub fn new(kind: MemoryKind, capacity: u64, queue_cap: usize, lease_timeout: Duration) -> Self {
        let returned = Arc::<ReturnedBytes>::default();
        Self {
            domain: Arc::new_cyclic(|me| Domain {
                kind,
                device: OnceLock::new(),
                host_source: OnceLock::new(),
                budget: Mutex::new(Budget::new(capacity, queue_cap)),
                returned: Arc::clone(&returned),
                shelf: Shelf::default(),
                keeping: OnceLock::new(),
                closed: AtomicBool::new(false),
                releaser: Arc::new(DomainReturn {
                    returned,
                    domain: me.clone(),
                }),
                home: OnceLock::new(),
                next_id: AtomicU64::new(1),
            }),
            exports: Exports::new(lease_timeout),
            next_id: 1,
            waiting: HashMap::new(),
            timer: DeadlineTimer::default(),
            sweep: None,
        }
    }

    /// Keeps memory of dropped buffers as `keeping` says (else [`Keeping::default`]).
    pub fn keeping(self, keeping: Keeping) -> Self {
        // A fresh domain: how it keeps is not set yet.
        let _ = self.domain.keeping.set(keeping);
        self
    }

    /// A GPU domain: memory comes from `device`'s pool, under the same budget rules.
    pub fn with_device(self, device: DevicePool) -> Self {
        // A fresh domain: its device is not set yet.
        let _ = self.domain.device.set(device);
        self
    }

    /// The shared part, for reservations made at once off the actor thread.
    pub fn domain(&self) -> Arc<Domain> {
        Arc::clone(&self.domain)
    }

    /// Starts the actor with a mailbox of `mailbox` messages.
    pub fn launch(self, mailbox: usize) -> DomainHandle {
        let domain = self.domain();
        let actor = Allocator::create(move |ctx| {
            ctx.set_mailbox_capacity(mailbox);
            self
        });
        DomainHandle { actor, domain }
    }

    /// Hands `parts` (already counted as granted) to `claim`, or takes them back. Device
    /// memory is made on a blocking thread (the allocation waits for its stream), never on
    /// this actor's; the claim's requester awaits it either way.
    fn deliver(&mut self, parts: Vec<u64>, claim: Arc<Claim>) {
        // Taken here, on the actor: no other tier delivers to it while its buffers are
        // made, and a requester that gives up meanwhile gets them freed.
        let Some(tx) = claim.take() else {
            self.domain.budget().handle_release(parts.iter().sum());
            return;
        };
        let domain = Arc::clone(&self.domain);
        let grant = move || {
            let made = domain.grant(&parts, None, Fill::Zeroed);
            if let Err(e) = &made {
                tracing::warn!(domain = %domain.kind, error = %e, "a waiting reservation failed");
            }
            // Buffers that come back (the requester left) are dropped here, which
            // releases them.
            drop(tx.send(made));
        };
        if self.domain.on_device() {
            drop(tokio::task::spawn_blocking(grant));
        } else {
            grant();
        }
    }

    fn drive(&mut self, ctx: &mut Context<Self>) {
        loop {
            self.grant_waiting();
            // While reservations wait, every return wakes the collector at once. Bytes that
            // came back before it said so are collected here, and may grant at once.
            let wanted = !self.waiting.is_empty();
            let was = self.domain.returned.wanted.swap(wanted, Ordering::SeqCst);
            if !wanted || was || self.domain.returned.bytes.load(Ordering::SeqCst) == 0 {
                break;
            }
            self.collect_returned();
        }
        while let Some(view) = self.exports.poll_freed() {
            drop(view);
        }
        self.publish_gauges();
        self.arm_timer(ctx);
        self.arm_sweep(ctx);
    }

    /// Withdraws the reservations served elsewhere, and delivers those the budget granted.
    fn grant_waiting(&mut self) {
        // Requesters served by another tier, or gone: their places in the queue go.
        let stale: Vec<ReservationId> = self
            .waiting
            .iter()
            .filter(|(_, (_, c))| c.is_taken())
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            // One the budget granted already has its event pending: the event loop below
            // gives that grant back. Only one still queued is withdrawn here.
            let withdrawn = self.domain.budget().handle_withdraw(id);
            if withdrawn {
                self.waiting.remove(&id);
            }
        }
        loop {
            let event = self.domain.budget().poll_event();
            let Some(ev) = event else { break };
            match ev {
                ReservationEvent::Granted(id) => {
                    if let Some((parts, claim)) = self.waiting.remove(&id) {
                        self.deliver(parts, claim);
                    }
                }
                ReservationEvent::TimedOut(id) => {
                    // The requester times out on its own; dropping the claim is enough.
                    self.waiting.remove(&id);
                }
            }
        }
    }

    fn stats(&self) -> DomainStats {
        DomainStats {
            budget: self.domain.budget().stats(),
            exports: self.exports.stats(),
            kept: KeptStats {
                bytes: self.domain.shelf.bytes(),
                reused: self.domain.shelf.reused(),
            },
        }
    }

    /// Sets the domain's memory gauges.
    fn publish_gauges(&self) {
        let stats = self.stats();
        let domain = self.domain.kind.to_string();
        let set = |name: &'static str, value: u64| {
            metrics::gauge!(name, "domain" => domain.clone()).set(value as f64);
        };
        set("ferry_memory_budget_bytes", stats.budget.capacity);
        set("ferry_memory_granted_bytes", stats.budget.granted);
        set("ferry_memory_free_bytes", stats.free());
        set("ferry_memory_exported_bytes", stats.exports.exported);
        set("ferry_memory_quarantined_bytes", stats.exports.quarantined);
        set("ferry_memory_kept_bytes", stats.kept.bytes);
        set("ferry_reservations_waiting", stats.budget.waiting as u64);
    }

    fn arm_timer(&mut self, ctx: &mut Context<Self>) {
        let next = self
            .domain
            .budget()
            .poll_timeout()
            .into_iter()
            .chain(self.exports.poll_timeout())
            .min();
        self.timer.arm(
            ctx,
            next,
            |a| &mut a.timer,
            |act, now, ctx| {
                act.domain.budget().handle_timeout(now);
                act.exports.handle_timeout(now);
                act.drive(ctx);
            },
        );
    }

    /// Arms the sweep of kept memory for when the oldest has been unused for
    /// `memory.keep_idle` (or the pool's freed memory, for a device domain), while
    /// something waits for one: an idle domain has no timer.
    fn arm_sweep(&mut self, ctx: &mut Context<Self>) {
        if self.sweep.is_some() {
            return;
        }
        let Some(at) = self.domain.shelf.arm(self.domain.keeping().idle) else {
            return;
        };
        // A millisecond late rather than early: the memory is never seen as still in use.
        let after = at.saturating_duration_since(Instant::now()) + Duration::from_millis(1);
        self.sweep = Some(ctx.run_later(after, |act, ctx| {
            act.sweep = None;
            act.sweep_kept(Instant::now(), ctx);
        }));
    }

    /// Gives back the memory unused for `memory.keep_idle` at `now`: frees it, and a GPU
    /// domain's pool gives its unused memory to the GPU, both off this thread.
    fn sweep_kept(&mut self, now: Instant, ctx: &mut Context<Self>) {
        let swept = self.domain.shelf.sweep(now, self.domain.keeping().idle);
        self.domain.shelf.disarm();
        let pool = self.domain.device.get().filter(|_| swept.trim).cloned();
        let source = self
            .domain
            .host_source
            .get()
            .filter(|_| swept.trim)
            .cloned();
        if !swept.expired.is_empty() || pool.is_some() || source.is_some() {
            let expired = swept.expired;
            let give_back = move || {
                give_back(expired, pool.as_ref());
                if let Some(source) = source {
                    source.trim();
                }
            };
            match tokio::runtime::Handle::try_current() {
                Ok(io) => drop(io.spawn_blocking(give_back)),
                Err(_) => give_back(),
            }
        }
        self.publish_gauges();
        self.arm_sweep(ctx);
    }

    fn collect_returned(&mut self) {
        let bytes = self.domain.returned.bytes.swap(0, Ordering::AcqRel);
        if bytes > 0 {
            self.domain.budget().handle_release(bytes);
        }
    }
}

impl Actor for Allocator {
    type Context = Context<Self>;

    fn stopped(&mut self, _ctx: &mut Self::Context) {
        // The node is going: memory kept for later grants goes back to the GPU now, not
        // whenever the last handle on the domain does, and what is dropped later is freed.
        // Freeing device memory is a driver call: off the actor's thread.
        self.domain.closed.store(true, Ordering::Release);
        let kept = self.domain.take_shelf();
        match tokio::runtime::Handle::try_current() {
            Ok(io) if !kept.is_empty() => drop(io.spawn_blocking(move || drop(free_kept(kept)))),
            _ => drop(free_kept(kept)),
        }
    }

    fn started(&mut self, ctx: &mut Self::Context) {
        self.publish_gauges();
        let returned = Arc::clone(&self.domain.returned);
        let me = ctx.address();
        // Collects returned bytes; ends when the actor stops.
        actix::spawn(async move {
            loop {
                returned.wake.notified().await;
                if !returned.wanted.load(Ordering::SeqCst) {
                    tokio::time::sleep(RETURN_COALESCE).await;
                }
                returned.armed.store(false, Ordering::SeqCst);
                let bytes = returned.bytes.swap(0, Ordering::AcqRel);
                // Memory kept with no sweep armed: the message arms one.
                let unswept = returned.unswept.swap(false, Ordering::SeqCst);
                if (bytes > 0 || unswept) && me.send(Returned(bytes)).await.is_err() {
                    break;
                }
            }
        });
    }
}

impl Handler<Returned> for Allocator {
    type Result = ();
    fn handle(&mut self, msg: Returned, ctx: &mut Self::Context) {
        if msg.0 > 0 {
            self.domain.budget().handle_release(msg.0);
        }
        self.drive(ctx);
    }
}

impl Handler<Reserve> for Allocator {
    type Result = Result<(), Error>;

    fn handle(&mut self, msg: Reserve, ctx: &mut Self::Context) -> Self::Result {
        self.collect_returned();
        let id = ReservationId(self.next_id);
        self.next_id += 1;
        let reserved =
            self.domain
                .budget()
                .handle_reserve(Instant::now(), id, &msg.parts, msg.deadline);
        let result = match reserved {
            Ok(Reserved::Now) => {
                self.deliver(msg.parts, msg.claim);
                Ok(())
            }
            Ok(Reserved::Queued) => {
                self.waiting.insert(id, (msg.parts, msg.claim));
                Ok(())
            }
            Err(e) => Err(refusal(self.domain.kind, &msg.parts, e)),
        };
        self.drive(ctx);
        result
    }
}

impl Handler<Stats> for Allocator {
    type Result = MessageResult<Stats>;
    fn handle(&mut self, _: Stats, ctx: &mut Self::Context) -> Self::Result {
        // Count bytes returned but not yet collected, so a caller that just dropped a
        // buffer sees it back.
        self.collect_returned();
        self.drive(ctx);
        MessageResult(self.stats())
    }
}

impl Handler<Export> for Allocator {
    type Result = ();
    fn handle(&mut self, msg: Export, ctx: &mut Self::Context) {
        let bytes = msg.view.len() as u64;
        self.exports
            .handle_export(msg.id, &msg.peer, bytes, msg.view);
        self.drive(ctx);
    }
}

impl Handler<ExportReleased> for Allocator {
    type Result = ();
    fn handle(&mut self, msg: ExportReleased, ctx: &mut Self::Context) {
        self.exports.handle_release(msg.0);
        self.drive(ctx);
    }
}

impl Handler<PeerGone> for Allocator {
    type Result = ();
    fn handle(&mut self, msg: PeerGone, ctx: &mut Self::Context) {
        self.exports.handle_peer_lost(&msg.0, Instant::now());
        self.drive(ctx);
    }
}

impl Handler<SetHome> for Allocator {
    type Result = ();
    fn handle(&mut self, msg: SetHome, _: &mut Self::Context) {
        // Set once, at start.
        let _ = self.domain.home.set(msg.0);
    }
}

/// A started domain: its actor, and the part reservations made at once share with it.
#[derive(Debug, Clone)]
pub struct DomainHandle {
    /// The allocator actor.
    pub actor: Addr<Allocator>,
    /// Its budget and memory.
    pub domain: Arc<Domain>,
}

impl DomainHandle {
    /// This domain as a tier of `kind` memory.
    pub fn tier(&self) -> Tier {
        Tier {
            kind: self.domain.kind,
            allocator: self.actor.clone().recipient(),
            domain: Arc::downgrade(&self.domain),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn one(domain: &Domain, len: u64, fill: Fill) -> Buffer {
        match domain.try_now_on(&[len], None, fill) {
            Ok(Some(mut buffers)) if buffers.len() == 1 => buffers.remove(0),
            other => panic!("no grant of {len} bytes: {other:?}"),
        }
    }

    #[test]
    fn memory_kept_for_overwriting_grants_stays_within_the_budget() {
        let domain = Allocator::new(MemoryKind::Host, 4 * MIB, 16, Duration::from_secs(1)).domain();
        let mut first = one(&domain, 2 * MIB, Fill::Overwritten);
        let bytes = first.as_mut_slice().expect("host");
        assert!(bytes.iter().all(|&b| b == 0), "fresh memory is zeroed");
        bytes.fill(7);
        let at = bytes.as_ptr();
        drop(first);
        assert_eq!(domain.shelf.bytes(), 2 * MIB);

        // A zeroed grant never takes kept memory; an overwriting one of the same length does.
        let zeroed = one(&domain, MIB, Fill::Zeroed);
        assert!(zeroed.as_slice().is_some_and(|b| b.iter().all(|&x| x == 0)));
        let again = one(&domain, 2 * MIB, Fill::Overwritten);
        let reused = again.as_slice().expect("host");
        assert_eq!(reused.as_ptr(), at, "the kept memory, not a new allocation");
        assert_eq!(reused[0], 7, "not zeroed again");
        assert_eq!(again.lease().len, 2 * MIB);
        drop(zeroed);

        // Granted and kept together never pass the budget: a grant that needs the room
        // frees what is kept.
        let held = one(&domain, MIB, Fill::Zeroed);
        drop(again);
        assert_eq!(domain.shelf.bytes(), 3 * MIB);
        let more = one(&domain, 2 * MIB, Fill::Zeroed);
        assert_eq!(domain.shelf.bytes(), 0);
        drop((held, more));

        // Small buffers are not worth keeping, and a buffer kept holds no budget.
        drop(one(&domain, 1024, Fill::Overwritten));
        assert!(domain.shelf.bytes() <= 3 * MIB);
        let whole = one(&domain, 4 * MIB, Fill::Zeroed);
        assert_eq!(domain.shelf.bytes(), 0);
        drop(whole);
    }

    #[test]
    fn a_domain_keeps_at_most_keep_max_and_nothing_with_a_zero_idle_time() {
        let domain = Allocator::new(MemoryKind::Host, 64 * MIB, 16, Duration::from_secs(1))
            .keeping(Keeping {
                idle: Duration::from_secs(60),
                max: 3 * MIB,
            })
            .domain();
        drop(one(&domain, 2 * MIB, Fill::Overwritten));
        drop(one(&domain, 2 * MIB, Fill::Overwritten));
        // The second grant took the first one's memory: drop two at once.
        let (a, b) = (
            one(&domain, 2 * MIB, Fill::Overwritten),
            one(&domain, 2 * MIB, Fill::Overwritten),
        );
        drop((a, b));
        assert_eq!(
            domain.shelf.bytes(),
            2 * MIB,
            "3 MiB at most: the older one went"
        );
        drop(one(&domain, 4 * MIB, Fill::Overwritten));
        assert_eq!(
            domain.shelf.bytes(),
            2 * MIB,
            "larger than keep_max: not kept"
        );

        for nothing in [
            Keeping {
                idle: Duration::ZERO,
                max: 512 * MIB,
            },
            Keeping {
                idle: Duration::from_secs(60),
                max: 0,
            },
        ] {
            let domain = Allocator::new(MemoryKind::Host, 64 * MIB, 16, Duration::from_secs(1))
                .keeping(nothing)
                .domain();
            drop(one(&domain, 2 * MIB, Fill::Overwritten));
            assert_eq!(domain.shelf.bytes(), 0, "{nothing:?} keeps nothing");
        }
    }
}
