//! The allocator actor of one memory domain: a shell over [`Budget`].
//!
//! Buffers are released from whatever thread drops them, without a message per buffer:
//! the release adds to an atomic counter and wakes a small task that tells the actor how
//! many bytes came back. Nothing queues, so nothing can overflow.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use ferry_transports::memory::{Buffer, BufferId, Generation, Lease, MemoryKind, Releaser};
use tokio::sync::{Notify, oneshot};

use crate::core::budget::{Budget, BudgetStats, ReservationEvent, ReservationId, Reserved};
use crate::error::Error;

/// Counts bytes given back by dropped buffers until the actor collects them.
#[derive(Debug, Default)]
struct ReturnedBytes {
    bytes: AtomicU64,
    wake: Notify,
}

impl Releaser for ReturnedBytes {
    fn release(&self, lease: &Lease) {
        self.bytes.fetch_add(lease.len, Ordering::AcqRel);
        self.wake.notify_one();
    }
}

/// Ask for one buffer of `len` bytes, waiting at most until `deadline`.
#[derive(Debug, Message)]
#[rtype(result = "Result<Buffer, Error>")]
pub struct Reserve {
    /// Bytes.
    pub len: u64,
    /// When to give up.
    pub deadline: Instant,
}

/// Ask for the domain's counters.
#[derive(Debug, Message)]
#[rtype(result = "BudgetStats")]
pub struct Stats;

#[derive(Debug, Message)]
#[rtype(result = "()")]
struct Returned(u64);

/// The allocator actor of one domain.
pub struct Allocator {
    kind: MemoryKind,
    budget: Budget,
    returned: Arc<ReturnedBytes>,
    next_id: u64,
    waiting: HashMap<ReservationId, (u64, oneshot::Sender<Result<Buffer, Error>>)>,
    timer: Option<SpawnHandle>,
    armed_for: Option<Instant>,
}

impl Allocator {
    /// A domain of `kind` with a budget of `capacity` bytes and room for `queue_cap`
    /// waiting reservations.
    pub fn new(kind: MemoryKind, capacity: u64, queue_cap: usize) -> Self {
        let allocator = Self {
            kind,
            budget: Budget::new(capacity, queue_cap),
            returned: Arc::default(),
            next_id: 1,
            waiting: HashMap::new(),
            timer: None,
            armed_for: None,
        };
        // The gauges exist from the start, before the first grant.
        allocator.publish_gauges();
        allocator
    }

    fn grant(&mut self, len: u64) -> Buffer {
        let id = self.next_id;
        self.next_id += 1;
        let lease = Lease {
            kind: self.kind,
            id: BufferId(id),
            generation: Generation(id),
            len,
        };
        let releaser: Arc<dyn Releaser> = self.returned.clone();
        Buffer::new_host(lease, releaser)
    }

    fn drive(&mut self, ctx: &mut Context<Self>) {
        while let Some(ev) = self.budget.poll_event() {
            match ev {
                ReservationEvent::Granted(id) => {
                    if let Some((len, tx)) = self.waiting.remove(&id) {
                        let buffer = self.grant(len);
                        // A requester that went away drops the buffer, which releases it.
                        let _ = tx.send(Ok(buffer));
                    }
                }
                ReservationEvent::TimedOut(id) => {
                    if let Some((len, tx)) = self.waiting.remove(&id) {
                        let _ = tx.send(Err(Error::NoMemory {
                            kind: self.kind,
                            len,
                            detail: "deadline passed while waiting for budget".into(),
                        }));
                    }
                }
            }
        }
        self.publish_gauges();
        self.arm_timer(ctx);
    }

    /// Sets the domain's memory gauges from the budget.
    fn publish_gauges(&self) {
        let stats = self.budget.stats();
        let domain = self.kind.to_string();
        metrics::gauge!("ferry_memory_budget_bytes", "domain" => domain.clone())
            .set(stats.capacity as f64);
        metrics::gauge!("ferry_memory_granted_bytes", "domain" => domain.clone())
            .set(stats.granted as f64);
        metrics::gauge!("ferry_memory_free_bytes", "domain" => domain.clone())
            .set(stats.capacity.saturating_sub(stats.granted) as f64);
        metrics::gauge!("ferry_reservations_waiting", "domain" => domain).set(stats.waiting as f64);
    }

    fn arm_timer(&mut self, ctx: &mut Context<Self>) {
        let next = self.budget.poll_timeout();
        if next == self.armed_for {
            return;
        }
        if let Some(handle) = self.timer.take() {
            ctx.cancel_future(handle);
        }
        self.armed_for = next;
        if let Some(at) = next {
            let after = at.saturating_duration_since(Instant::now()) + Duration::from_millis(1);
            self.timer = Some(ctx.run_later(after, |act, ctx| {
                act.timer = None;
                act.armed_for = None;
                act.budget.handle_timeout(Instant::now());
                act.drive(ctx);
            }));
        }
    }
}

impl Actor for Allocator {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let returned = Arc::clone(&self.returned);
        let me = ctx.address();
        // Collects returned bytes; ends when the actor stops.
        actix::spawn(async move {
            loop {
                returned.wake.notified().await;
                let bytes = returned.bytes.swap(0, Ordering::AcqRel);
                if bytes > 0 && me.send(Returned(bytes)).await.is_err() {
                    break;
                }
            }
        });
    }
}

impl Handler<Returned> for Allocator {
    type Result = ();
    fn handle(&mut self, msg: Returned, ctx: &mut Self::Context) {
        self.budget.handle_release(msg.0);
        self.drive(ctx);
    }
}

impl Handler<Reserve> for Allocator {
    type Result = ResponseFuture<Result<Buffer, Error>>;

    fn handle(&mut self, msg: Reserve, ctx: &mut Self::Context) -> Self::Result {
        let id = ReservationId(self.next_id);
        self.next_id += 1;
        let now = Instant::now();
        let result = match self
            .budget
            .handle_reserve(now, id, &[msg.len], msg.deadline)
        {
            Ok(Reserved::Now) => Ok(Some(self.grant(msg.len))),
            Ok(Reserved::Queued) => Ok(None),
            Err(e) => Err(Error::NoMemory {
                kind: self.kind,
                len: msg.len,
                detail: e.to_string(),
            }),
        };
        let rx = match result {
            Ok(Some(buffer)) => {
                self.publish_gauges();
                return Box::pin(async move { Ok(buffer) });
            }
            Err(e) => return Box::pin(async move { Err(e) }),
            Ok(None) => {
                let (tx, rx) = oneshot::channel();
                self.waiting.insert(id, (msg.len, tx));
                self.drive(ctx);
                rx
            }
        };
        Box::pin(async move { rx.await.map_err(|_| Error::ShuttingDown)? })
    }
}

impl Handler<Stats> for Allocator {
    type Result = MessageResult<Stats>;
    fn handle(&mut self, _: Stats, ctx: &mut Self::Context) -> Self::Result {
        // Count bytes returned but not yet collected, so a caller that just dropped a
        // buffer sees it back.
        let pending = self.returned.bytes.swap(0, Ordering::AcqRel);
        if pending > 0 {
            self.budget.handle_release(pending);
            self.drive(ctx);
        }
        MessageResult(self.budget.stats())
    }
}
