//! The progress thread: it owns the worker, every endpoint, remote key, registration and
//! request, takes commands from the queue, issues them, progresses UCX, turns completions
//! into replies, enforces deadlines, and sleeps when idle.
//!
//! Invariants:
//!
//! - A reply is sent only once UCX no longer touches the operation's memory: its request
//!   completed, it completed at once, it was refused at once, or the worker is destroyed.
//! - A remote key is destroyed only when no operation in flight uses it, and before the
//!   worker is destroyed.
//! - A failed peer's endpoint is force-closed at once (that completes, with an error,
//!   every operation on it); later operations to it fail without reaching UCX.
//! - UCX callbacks only record events; they are handled after the call that ran them,
//!   and always before new endpoints are created (so an endpoint address UCX reuses is
//!   never confused with a closed one).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::SyncSender;
use std::time::{Duration, Instant};

use ucx_sys::result::RequestPtr;
use ucx_sys::sys::{self, ucs_status_t};
use ucx_sys::{Ucx, UcxError};

use super::envelope::{self, EnvelopeKind};
use super::error::{OpKind, PeerFailure, PeerName, UcxTransportError};
use super::lanes::{EndpointLanes, LaneSlot};
use super::operation::Reply;
use super::queue::{Command, Control, OpCommand, Shared};
use super::rkeys::{RkeyCache, RkeyId};
use super::settings::UcxSettings;
use super::ucp::Ucp;
use super::wake::sleep_until_readable;

/// How many times one loop turn calls `ucp_worker_progress` while it reports events,
/// before looking at the queue again.
const PROGRESS_BURST: usize = 64;

/// What the thread sends back once started: the sealed worker address.
pub(crate) type Started = Result<(Vec<u8>, bool), UcxTransportError>;

/// The thread's body. Creates UCX's objects, reports the address (or the failure) on
/// `started`, then serves the queue until the engine is dropped.
pub(crate) fn run(
    ucx: Ucx,
    settings: UcxSettings,
    shared: Arc<Shared>,
    started: SyncSender<Started>,
) {
    let cuda = match settings.cuda_device.map(bind_cuda).transpose() {
        Ok(cuda) => cuda,
        Err(e) => {
            let _ = started.send(Err(UcxTransportError::Cuda(e)));
            shared.stop();
            shared.finish();
            return;
        }
    };
    let ucp = match Ucp::open(ucx, &settings) {
        Ok(ucp) => ucp,
        Err(e) => {
            let _ = started.send(Err(e));
            shared.stop();
            shared.finish();
            return;
        }
    };
    let address = envelope::seal(
        EnvelopeKind::WorkerAddress,
        ucx.version(),
        &settings.origin(),
        &ucp.address,
    );
    let moves_cuda = ucp.moves_cuda;
    let mut thread = ProgressThread::new(ucp, settings, shared, ucx);
    thread.cuda = cuda;
    if started.send(Ok((address, moves_cuda))).is_ok() {
        thread.serve();
    }
    // `thread`'s drop releases everything and marks the shared state finished.
}

/// Opens GPU `ordinal` and makes its primary context current on this thread.
fn bind_cuda(ordinal: u32) -> Result<crate::cuda::Device, crate::cuda::CudaError> {
    let device = crate::cuda::Device::open(ordinal as usize)?;
    device.bind()?;
    Ok(device)
}

/// One peer's endpoint and keys.
struct Peer {
    name: PeerName,
    /// `None` once closed (failed or dropped).
    ep: Option<NonNull<sys::ucp_ep>>,
    failure: Option<PeerFailure>,
    rkeys: RkeyCache<NonNull<sys::ucp_rkey>>,
    /// Operations issued to UCX and not completed.
    in_flight: usize,
    /// The handle was dropped: remove the peer once nothing is in flight.
    dropped: bool,
    /// The endpoint's lanes, as the peer's handle reads them.
    lanes: Arc<LaneSlot>,
    /// Whether the lanes were asked again after the first operation completed.
    lanes_settled: bool,
    /// How many of the peer's keys are unpacked and not yet destroyed, as the peer's
    /// handle reads it.
    keys: Arc<AtomicUsize>,
}

/// An operation in UCX.
struct InFlight {
    peer: u64,
    kind: OpKind,
    rkey: Option<RkeyId>,
    reply: Reply,
    deadline: (Instant, u64),
    timed_out: bool,
}

impl InFlight {
    fn call(&self) -> &'static str {
        match self.kind {
            OpKind::Get(_) => "ucp_get_nbx",
            OpKind::Put(_) => "ucp_put_nbx",
            OpKind::Flush => "ucp_ep_flush_nbx",
        }
    }
}

/// A close request in UCX.
struct Closing {
    deadline: Instant,
}

struct ProgressThread {
    ucp: Ucp,
    settings: UcxSettings,
    shared: Arc<Shared>,
    ucx: Ucx,
    peers: HashMap<u64, Peer>,
    /// Open endpoints, by address, for error callbacks.
    endpoints: HashMap<usize, u64>,
    next_peer: u64,
    registrations: HashMap<u64, NonNull<sys::ucp_mem>>,
    next_registration: u64,
    /// Operations in UCX, by request.
    ops: HashMap<usize, InFlight>,
    /// Deadlines of `ops`: (deadline, sequence) → request.
    deadlines: BTreeMap<(Instant, u64), usize>,
    next_seq: u64,
    /// Close requests in UCX, by request.
    closes: HashMap<usize, Closing>,
    last_activity: Instant,
    stop: bool,
    released: bool,
    /// The GPU whose primary context is current here ([`UcxSettings::cuda_device`]), held
    /// so the context stays alive while UCX may copy in it.
    cuda: Option<crate::cuda::Device>,
}

impl ProgressThread {
    fn new(ucp: Ucp, settings: UcxSettings, shared: Arc<Shared>, ucx: Ucx) -> Self {
        Self {
            ucp,
            settings,
            shared,
            ucx,
            peers: HashMap::new(),
            endpoints: HashMap::new(),
            next_peer: 1,
            registrations: HashMap::new(),
            next_registration: 1,
            ops: HashMap::new(),
            deadlines: BTreeMap::new(),
            next_seq: 0,
            closes: HashMap::new(),
            last_activity: Instant::now(),
            stop: false,
            released: false,
            cuda: None,
        }
    }

    /// The loop: take commands, progress, handle events and deadlines; spin while work is
    /// in flight (and `progress_spin` after it), sleep otherwise.
    fn serve(&mut self) {
        loop {
            let mut active = self.intake();
            if self.stop {
                return;
            }
            for _ in 0..PROGRESS_BURST {
                if self.ucp.progress() == 0 {
                    break;
                }
                active = true;
            }
            active |= self.handle_events();
            let now = Instant::now();
            self.expire(now);
            if active {
                self.last_activity = now;
            }
            let spinning = now.duration_since(self.last_activity) < self.settings.progress_spin;
            if !self.busy(now) && !spinning {
                self.sleep();
            }
        }
    }

    /// Whether something in UCX needs the thread to keep progressing.
    fn busy(&self, now: Instant) -> bool {
        !self.ops.is_empty() || self.closes.values().any(|c| c.deadline > now)
    }

    /// Sleeps on the eventfd and the worker's event descriptor, unless work arrived or
    /// UCX has events pending.
    fn sleep(&mut self) {
        if !self.shared.announce_sleep() {
            return;
        }
        match self.ucp.arm() {
            Ok(true) => {
                let fds = [self.shared.wake().as_fd(), self.ucp.event_fd()];
                if let Err(e) = sleep_until_readable(&fds, None) {
                    tracing::warn!(error = %e, "ucx progress thread: poll failed");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            Ok(false) => {} // events pending: progress again
            Err(e) => {
                tracing::warn!(error = %e, "ucx progress thread: ucp_worker_arm failed");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.shared.woke();
    }

    /// Takes and runs what callers queued. Returns whether there was anything.
    fn intake(&mut self) -> bool {
        if !self.shared.take_pending() {
            return false;
        }
        // Settle callbacks first, so a new endpoint that reuses a closed one's address is
        // not blamed for the old one's failure.
        self.handle_events();
        let room = self.settings.max_in_flight.saturating_sub(self.ops.len());
        let (control, ordered) = self.shared.take(room);
        for request in control {
            self.control(request);
        }
        if self.stop {
            refuse(ordered);
            return true;
        }
        for command in ordered {
            match command {
                Command::Op(op) => self.issue(op),
                Command::Forget { peer, key } => {
                    if let Some(p) = self.peers.get_mut(&peer)
                        && let Some(rkey) = p.rkeys.forget(&key)
                    {
                        // SAFETY: handed back by the cache: unused, destroyed once; the
                        // worker is live.
                        unsafe { self.ucp.destroy_rkey(rkey) };
                        p.keys.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                Command::DropPeer { peer } => {
                    if let Some(p) = self.peers.get_mut(&peer) {
                        p.dropped = true;
                    }
                    self.settle_peer(peer);
                }
            }
        }
        true
    }

    fn control(&mut self, request: Control) {
        match request {
            Control::Connect {
                address,
                origin,
                reply,
            } => {
                // SAFETY: `address` is the payload of an envelope checked by
                // `Engine::connect` (magic, kind, lengths, CRC32C, same UCX release), so
                // it is a whole worker address as a ferry engine of this UCX sealed it; the
                // envelope reached the caller over ferry's authenticated link.
                let answer = match unsafe { self.ucp.connect(&address) } {
                    Ok(ep) => {
                        let id = self.next_peer;
                        self.next_peer += 1;
                        // SAFETY: the endpoint was just created on this worker.
                        let chosen = unsafe { self.ucp.lanes(ep) };
                        let lanes =
                            Arc::new(LaneSlot::new(EndpointLanes::from_query(chosen, false)));
                        let keys = Arc::new(AtomicUsize::new(0));
                        self.endpoints.insert(ep.as_ptr() as usize, id);
                        self.peers.insert(
                            id,
                            Peer {
                                name: PeerName { id, origin },
                                ep: Some(ep),
                                failure: None,
                                rkeys: RkeyCache::new(self.settings.rkey_cache),
                                in_flight: 0,
                                dropped: false,
                                lanes: lanes.clone(),
                                lanes_settled: false,
                                keys: Arc::clone(&keys),
                            },
                        );
                        Ok((id, lanes, keys))
                    }
                    Err(source) => Err(UcxTransportError::Connect { origin, source }),
                };
                let _ = reply.send(answer);
            }
            Control::Register { memory, reply } => {
                // SAFETY: `Engine::register`'s caller promised the memory stays allocated
                // (and is of the type it named) until the registration is dropped, whose
                // drop waits for the unmap below; it checked the pointer is non-null and
                // the length non-zero.
                let answer = match unsafe { self.ucp.map(memory) } {
                    Ok((memh, packed)) => {
                        let id = self.next_registration;
                        self.next_registration += 1;
                        self.registrations.insert(id, memh);
                        let sealed = envelope::seal(
                            EnvelopeKind::RemoteKey,
                            self.ucx.version(),
                            "",
                            &packed,
                        );
                        Ok((id, sealed))
                    }
                    Err(source) => Err(UcxTransportError::Register {
                        address: memory.ptr as u64,
                        len: memory.len,
                        source,
                    }),
                };
                let _ = reply.send(answer);
            }
            Control::Unregister { id, done } => {
                if let Some(memh) = self.registrations.remove(&id) {
                    // SAFETY: mapped by `map`, removed from the table, so unmapped once.
                    if let Err(e) = unsafe { self.ucp.unmap(memh) } {
                        tracing::warn!(error = %e, "ucx: ucp_mem_unmap failed");
                    }
                }
                let _ = done.send(());
            }
            Control::Stop => self.stop = true,
        }
    }

    /// Issues one get, put or flush, or answers it at once.
    fn issue(&mut self, op: OpCommand) {
        let Some(peer) = self.peers.get_mut(&op.peer) else {
            let _ = op.reply.send(Err(UcxTransportError::Misuse(
                "the peer was already closed",
            )));
            return;
        };
        let ep = match (&peer.failure, peer.ep) {
            (Some(cause), _) => {
                let _ = op.reply.send(Err(UcxTransportError::PeerFailed {
                    op: op.kind,
                    peer: peer.name.clone(),
                    cause: cause.clone(),
                }));
                return;
            }
            (None, Some(ep)) => ep,
            (None, None) => {
                let _ = op.reply.send(Err(UcxTransportError::Misuse(
                    "the peer was already closed",
                )));
                return;
            }
        };
        let (put, len) = match op.kind {
            OpKind::Get(len) => (false, len),
            OpKind::Put(len) => (true, len),
            OpKind::Flush => {
                // SAFETY: the endpoint is live (not closed: `ep` is `Some`).
                let started = unsafe { self.ucp.flush(ep) };
                self.started(op.peer, op.kind, None, op.reply, started);
                return;
            }
        };
        if len == 0 {
            // Nothing to move, nothing for UCX to do.
            let _ = op.reply.send(Ok(()));
            return;
        }
        let Some(key) = op.rkey.as_ref().filter(|k| !k.is_empty()) else {
            let _ = op.reply.send(Err(UcxTransportError::Misuse(
                "an empty remote key covers no bytes",
            )));
            return;
        };
        let (rkey_id, rkey) = match peer.rkeys.lookup(key) {
            Some(found) => found,
            None => {
                // SAFETY: the endpoint is live; the payload is out of an envelope checked
                // by `RemoteKey::new` (same UCX release, intact), from a peer authenticated
                // by ferry's link.
                match unsafe { self.ucp.unpack(ep, key.payload()) } {
                    Ok(rkey) => {
                        peer.keys.fetch_add(1, Ordering::Relaxed);
                        let (id, evicted) = peer.rkeys.insert(key.clone(), rkey);
                        if let Some(old) = evicted {
                            // SAFETY: handed back by the cache: unused, destroyed once.
                            unsafe { self.ucp.destroy_rkey(old) };
                            peer.keys.fetch_sub(1, Ordering::Relaxed);
                        }
                        (id, rkey)
                    }
                    Err(source) => {
                        let _ = op.reply.send(Err(UcxTransportError::Unpack {
                            op: op.kind,
                            peer: peer.name.clone(),
                            source,
                        }));
                        return;
                    }
                }
            }
        };
        // SAFETY: endpoint and key are live (the key was unpacked on this endpoint and is
        // counted as used until the operation completes); the caller of `UcxPeer::get`/
        // `put` promised the local memory stays valid and lent until the reply, which is
        // sent only when UCX is done with it.
        let started = unsafe { self.ucp.rma(put, ep, op.local, op.remote, rkey) };
        self.started(op.peer, op.kind, Some(rkey_id), op.reply, started);
    }

    /// Records what an `*_nbx` call returned: a request to track, or an outcome to send.
    fn started(
        &mut self,
        peer: u64,
        kind: OpKind,
        rkey: Option<RkeyId>,
        reply: Reply,
        started: Result<Option<RequestPtr>, UcxError>,
    ) {
        match started {
            Ok(Some(request)) => {
                let seq = self.next_seq;
                self.next_seq += 1;
                let deadline = (Instant::now() + self.settings.op_timeout, seq);
                let key = request.as_ptr() as usize;
                self.deadlines.insert(deadline, key);
                self.ops.insert(
                    key,
                    InFlight {
                        peer,
                        kind,
                        rkey,
                        reply,
                        deadline,
                        timed_out: false,
                    },
                );
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.in_flight += 1;
                }
            }
            Ok(None) => {
                self.release_rkey(peer, rkey);
                self.settle_lanes(peer);
                let _ = reply.send(Ok(()));
            }
            Err(source) => {
                self.release_rkey(peer, rkey);
                let outcome = self.failed(peer, kind, source);
                let _ = reply.send(Err(outcome));
                self.settle_peer(peer);
            }
        }
    }

    /// The error for an operation that UCX failed with `source`; fails the peer when the
    /// error says it is gone.
    fn failed(&mut self, peer: u64, kind: OpKind, source: UcxError) -> UcxTransportError {
        let Some(p) = self.peers.get(&peer) else {
            return UcxTransportError::Operation {
                op: kind,
                peer: PeerName {
                    id: peer,
                    origin: "closed".into(),
                },
                source,
            };
        };
        let name = p.name.clone();
        if let Some(cause) = &p.failure {
            return UcxTransportError::PeerFailed {
                op: kind,
                peer: name,
                cause: cause.clone(),
            };
        }
        if source.is_peer_failure() {
            let cause = PeerFailure::Ucx(source);
            self.fail_peer(peer, cause.clone());
            return UcxTransportError::PeerFailed {
                op: kind,
                peer: name,
                cause,
            };
        }
        UcxTransportError::Operation {
            op: kind,
            peer: name,
            source,
        }
    }

    /// Marks the peer failed and force-closes its endpoint, which makes UCX complete every
    /// operation on it (with an error).
    fn fail_peer(&mut self, peer: u64, cause: PeerFailure) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        if p.failure.is_some() {
            return;
        }
        tracing::debug!(peer = %p.name, cause = %cause, "ucx: peer failed; closing its endpoint");
        p.failure = Some(cause);
        if let Some(ep) = p.ep.take() {
            self.endpoints.remove(&(ep.as_ptr() as usize));
            self.close(ep, true);
        }
        self.settle_peer(peer);
    }

    /// Closes an endpoint (it must be out of `peers` and `endpoints` already).
    fn close(&mut self, ep: NonNull<sys::ucp_ep>, force: bool) {
        // SAFETY: the endpoint is live and closed once: every caller took it out of its
        // peer first.
        match unsafe { self.ucp.close(ep, force) } {
            Ok(Some(request)) => {
                self.closes.insert(
                    request.as_ptr() as usize,
                    Closing {
                        deadline: Instant::now() + self.settings.close_timeout,
                    },
                );
            }
            Ok(None) => {}
            Err(e) => tracing::debug!(error = %e, "ucx: closing an endpoint failed at once"),
        }
    }

    /// Once nothing is in flight to a peer: destroys its keys if it failed, and removes
    /// it (closing the endpoint) if its handle was dropped.
    fn settle_peer(&mut self, peer: u64) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        if p.in_flight > 0 || !(p.dropped || p.failure.is_some()) {
            return;
        }
        for rkey in p.rkeys.drain() {
            // SAFETY: nothing is in flight to the peer, so no operation uses its keys;
            // each is destroyed once (drained out of the cache); the worker is live.
            unsafe { self.ucp.destroy_rkey(rkey) };
            p.keys.fetch_sub(1, Ordering::Relaxed);
        }
        if !p.dropped {
            return;
        }
        let ep = p.ep.take();
        let healthy = p.failure.is_none();
        self.peers.remove(&peer);
        if let Some(ep) = ep {
            self.endpoints.remove(&(ep.as_ptr() as usize));
            // A healthy peer gets an orderly close (it sees a disconnect, not a failure).
            self.close(ep, !healthy);
        }
    }

    /// After a peer's first operation completed (its wireup done): asks UCX for the
    /// endpoint's lanes again, which are then final, and logs them.
    fn settle_lanes(&mut self, peer: u64) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        let Some(ep) = p.ep.filter(|_| !p.lanes_settled) else {
            return;
        };
        p.lanes_settled = true;
        // SAFETY: the endpoint is live (`ep` is cleared when it is closed) and this is its
        // worker's thread.
        let lanes = EndpointLanes::from_query(unsafe { self.ucp.lanes(ep) }, true);
        tracing::debug!(peer = %p.name, %lanes, "ucx: the endpoint's lanes");
        p.lanes.set(lanes);
    }

    fn release_rkey(&mut self, peer: u64, rkey: Option<RkeyId>) {
        let Some(id) = rkey else { return };
        if let Some(p) = self.peers.get_mut(&peer)
            && let Some(rkey) = p.rkeys.release(id)
        {
            // SAFETY: handed back by the cache: its last user completed; destroyed once.
            unsafe { self.ucp.destroy_rkey(rkey) };
            p.keys.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Handles what callbacks recorded, until no more was recorded. Returns whether there
    /// was anything.
    fn handle_events(&mut self) -> bool {
        let mut any = false;
        loop {
            let (failed, completed) = self.ucp.take_events();
            if failed.is_empty() && completed.is_empty() {
                return any;
            }
            any = true;
            for (ep, status) in failed {
                if let Some(&peer) = self.endpoints.get(&ep) {
                    let cause = PeerFailure::Ucx(self.ucp.error("endpoint error callback", status));
                    self.fail_peer(peer, cause);
                }
            }
            for (request, status) in completed {
                self.completed(request, status);
            }
        }
    }

    /// A request completed with `status`.
    fn completed(&mut self, request: usize, status: ucs_status_t) {
        let Some(ptr) = NonNull::new(request as *mut std::ffi::c_void) else {
            return;
        };
        if let Some(op) = self.ops.remove(&request) {
            // SAFETY: the request was returned by an `*_nbx` call on this worker, is
            // freed once (it left `ops`), and completed (its callback ran).
            unsafe { self.ucp.free(ptr) };
            self.deadlines.remove(&op.deadline);
            if let Some(p) = self.peers.get_mut(&op.peer) {
                p.in_flight -= 1;
            }
            self.release_rkey(op.peer, op.rkey);
            let outcome = if status == sys::UCS_OK {
                self.settle_lanes(op.peer);
                Ok(())
            } else if op.timed_out {
                Err(UcxTransportError::TimedOut {
                    op: op.kind,
                    peer: self.peer_name(op.peer),
                    after: self.settings.op_timeout,
                })
            } else {
                let source = self.ucp.error(op.call(), status);
                Err(self.failed(op.peer, op.kind, source))
            };
            let _ = op.reply.send(outcome);
            self.settle_peer(op.peer);
        } else if self.closes.remove(&request).is_some() {
            // SAFETY: a close request of this worker, completed, freed once.
            unsafe { self.ucp.free(ptr) };
        }
        // Anything else was freed before it completed (at shutdown); UCX releases it.
    }

    fn peer_name(&self, peer: u64) -> PeerName {
        self.peers.get(&peer).map_or_else(
            || PeerName {
                id: peer,
                origin: "closed".into(),
            },
            |p| p.name.clone(),
        )
    }

    /// Fails the peers of operations past their deadline.
    fn expire(&mut self, now: Instant) {
        while let Some((&(deadline, seq), &request)) = self.deadlines.first_key_value() {
            if deadline > now {
                break;
            }
            self.deadlines.remove(&(deadline, seq));
            let Some(op) = self.ops.get_mut(&request) else {
                continue;
            };
            op.timed_out = true;
            let (peer, kind) = (op.peer, op.kind);
            tracing::debug!(op = %kind, "ucx: operation past its deadline");
            self.fail_peer(
                peer,
                PeerFailure::TimedOut {
                    op: kind,
                    after: self.settings.op_timeout,
                },
            );
        }
    }

    /// Stops: fails what waits in the queue, closes every endpoint, gives UCX up to
    /// `close_timeout` to complete what was in flight (those operations get their usual
    /// outcome), then releases everything in UCX's order and fails what is left with
    /// "engine stopped". Idempotent.
    ///
    /// Healthy endpoints are closed in flush mode, not forced: a forced close fails the
    /// peer's side of the connection while it may still owe us get replies or put acks,
    /// and UCX 1.13's software RMA (what tcp uses) aborts the peer's process when such a
    /// reply meets a failed endpoint (`ucs_fatal` in `ucp_request_try_send`).
    fn release(&mut self) {
        if self.released {
            return;
        }
        self.released = true;
        let (control, ordered) = self.shared.stop();
        refuse(ordered);
        let peers: Vec<u64> = self.peers.keys().copied().collect();
        for peer in peers {
            let Some(p) = self.peers.get_mut(&peer) else {
                continue;
            };
            p.dropped = true;
            let force = p.failure.is_some();
            if let Some(ep) = p.ep.take() {
                self.endpoints.remove(&(ep.as_ptr() as usize));
                self.close(ep, force);
            }
            self.settle_peer(peer);
        }
        let deadline = Instant::now() + self.settings.close_timeout;
        while (!self.ops.is_empty() || !self.closes.is_empty()) && Instant::now() < deadline {
            self.ucp.progress();
            self.handle_events();
        }
        // What UCX did not complete in time: give the requests back (UCX keeps them until
        // the worker goes) and answer once the worker is destroyed.
        let mut late: Vec<(Reply, OpKind)> = Vec::new();
        for (request, op) in self.ops.drain() {
            if let Some(ptr) = NonNull::new(request as *mut std::ffi::c_void) {
                // SAFETY: a live request of this worker, freed once (drained), not used
                // again.
                unsafe { self.ucp.free(ptr) };
            }
            late.push((op.reply, op.kind));
        }
        if !late.is_empty() {
            tracing::warn!(
                pending = late.len(),
                "ucx: operations did not finish within close_timeout at shutdown"
            );
        }
        for (request, _) in self.closes.drain() {
            if let Some(ptr) = NonNull::new(request as *mut std::ffi::c_void) {
                // SAFETY: as above.
                unsafe { self.ucp.free(ptr) };
            }
        }
        for (_, mut p) in self.peers.drain() {
            if p.in_flight > 0 {
                // Keys that unfinished requests may still use go with the worker.
                continue;
            }
            for rkey in p.rkeys.drain() {
                // SAFETY: unused (nothing in flight to the peer), destroyed once, before
                // the worker.
                unsafe { self.ucp.destroy_rkey(rkey) };
            }
        }
        for (_, memh) in self.registrations.drain() {
            // SAFETY: mapped by `map`, unmapped once (drained).
            if let Err(e) = unsafe { self.ucp.unmap(memh) } {
                tracing::warn!(error = %e, "ucx: ucp_mem_unmap failed");
            }
        }
        // SAFETY: every endpoint was closed and its close request freed; every key not
        // used by an unfinished request was destroyed, and those go with the worker.
        unsafe { self.ucp.destroy_worker() };
        for (reply, kind) in late {
            let _ = reply.send(Err(UcxTransportError::EngineStopped { op: Some(kind) }));
        }
        for request in control {
            match request {
                Control::Connect { reply, .. } => {
                    let _ = reply.send(Err(UcxTransportError::EngineStopped { op: None }));
                }
                Control::Register { reply, .. } => {
                    let _ = reply.send(Err(UcxTransportError::EngineStopped { op: None }));
                }
                // Everything is unmapped now.
                Control::Unregister { done, .. } => {
                    let _ = done.send(());
                }
                Control::Stop => {}
            }
        }
    }
}

/// Fails operations that never reached UCX because the engine is stopping.
fn refuse(commands: Vec<Command>) {
    for command in commands {
        if let Command::Op(op) = command {
            let _ = op
                .reply
                .send(Err(UcxTransportError::EngineStopped { op: Some(op.kind) }));
        }
    }
}

impl Drop for ProgressThread {
    fn drop(&mut self) {
        self.release();
        self.shared.finish();
    }
}
