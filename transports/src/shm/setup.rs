//! The shm setup with one peer, on the generic machine ([`crate::transport::setup`]): before
//! the first send over shm, the sender asks the peer to fetch its pool's probe (a small
//! sealed memfd served beside the pool's segments) from its fd-sharing socket and map it,
//! and offers its lane's ring with it. A peer that cannot (another network namespace, so
//! no reachable socket; a kernel that refuses the mapping) refuses with the cause and the
//! sends take the rule's next transport (tcp), now and for the rest of the session: a
//! pull that could not map the sender's memory never starts.
//!
//! The sender is the side that drives it; the peer answers. The checks of pushes (the
//! sender maps the peer's pool) are not part of it: a push names the receiver's lent
//! buffer, and a pool that cannot be mapped fails that transfer with the cause.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::imports::PeerPool;
use super::lane::{PoolRecords, RxContext, SLOT_LEN, SLOTS, ShmLaneRx};
use super::pool::Pool;
use super::segment::Segment;
use super::wire::{ShmMessage, ShmSetupStep, probe_key};
use crate::link::ring::Ring;
use crate::transport::FastPath;
use crate::transport::lane::LaneTx;
use crate::transport::setup::{
    Attempt, PartSetup, PeerReply, SetupFailure, SetupOutcome, SetupTransmit,
};
use crate::transport::{Admission, PartEvent, PeerEnv};

/// Bytes of a pool's probe.
pub const PROBE_LEN: usize = 4096;
/// How long the peer's probe of our pool may take: less than an attempt of the setup
/// ([`crate::transport::setup::SetupPolicy::DEFAULT`]), so its answer counts.
const PROBE_TIMEOUT: Duration = Duration::from_millis(800);

/// The lane's settings (`transport.shm.lane_max`, `transport.shm.lane_spin`).
#[derive(Debug, Clone, Copy)]
pub struct LaneSettings {
    /// Largest send this node puts on the lane; 0 turns the lane off (a receiver takes
    /// records of any size).
    pub max: usize,
    /// How long a lane thread spins for the next record before it parks.
    pub spin: Duration,
}

/// What a probe of the peer's pool handed back: our lane thread's ring when the peer
/// offered one, or why the pool cannot be mapped.
type Probed = (Attempt, Result<Option<(String, Ring)>, String>);

/// The setup's side of one peer's shm part, and the lane it opens.
pub struct ShmSetup {
    lane: LaneSettings,
    machine: PartSetup,
    /// Messages for the peer's part (a handful: one per setup step).
    out: VecDeque<ShmMessage>,
    /// What the shell must do.
    pub events: VecDeque<PartEvent>,
    /// Probes that ended off the shell's thread.
    probed: Arc<Mutex<Vec<Probed>>>,
    /// True while a probe for the peer's request runs (one at a time).
    probing: bool,
    /// The peer's pid and whether it runs on this host, from its hello.
    peer_pid: u32,
    same_host: bool,
    /// The lane ring offered with our request, under its key at our fd-sharing socket,
    /// until the setup settles.
    lane_offer: Option<(String, Arc<Ring>)>,
    /// Our sending end of the lane.
    lane_tx: Option<Arc<LaneTx>>,
    /// The receiving end of the peer's lane, and the key its ring came under (a retried
    /// request names the same ring: it is not attached twice).
    lane_rx: Option<(String, ShmLaneRx)>,
}

/// What the setup works with: the session's services, our pool and the peer's (as its
/// hello announced it).
pub struct Sides<'a> {
    /// The session's services.
    pub env: &'a PeerEnv,
    /// Our pool.
    pub ours: Option<&'a Arc<Pool>>,
    /// The peer's pool.
    pub theirs: Option<&'a Arc<PeerPool>>,
}

impl ShmSetup {
    /// Nothing set up yet.
    pub fn new(lane: LaneSettings) -> Self {
        Self {
            lane,
            machine: PartSetup::default(),
            out: VecDeque::new(),
            events: VecDeque::new(),
            probed: Arc::default(),
            probing: false,
            peer_pid: 0,
            same_host: false,
            lane_offer: None,
            lane_tx: None,
            lane_rx: None,
        }
    }

    /// A new link: where the peer is.
    pub fn attach(&mut self, pid: u32, same_host: bool) {
        self.peer_pid = pid;
        self.same_host = same_host;
    }

    /// A send over shm asks: go, wait for the setup, or fall back.
    pub fn admit(&mut self, now: Instant, sides: &Sides<'_>) -> Admission {
        if sides.ours.is_none() {
            // Not routed here (a node without a pool serves no shm), but never left waiting.
            let why = "this node has no shared-memory pool".to_string();
            return Admission::FallBack(SetupFailure::Incompatible(why));
        }
        let admitted = self.machine.admit(now);
        self.pump(now, sides);
        admitted
    }

    /// The next message for the peer's part.
    pub fn poll_message(&mut self) -> Option<ShmMessage> {
        self.out.pop_front()
    }

    /// When the setup must hear of time next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.machine.poll_timeout()
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.machine.handle_timeout(now);
    }

    /// True while an attempt waits on the peer.
    pub fn awaits_peer(&self) -> bool {
        self.machine.awaits_peer()
    }

    /// Carries out what the setup asks for, and what probes handed back.
    pub fn pump(&mut self, now: Instant, sides: &Sides<'_>) {
        let probed = std::mem::take(&mut *self.probed.lock().unwrap_or_else(|p| p.into_inner()));
        for (attempt, result) in probed {
            self.probed(attempt, result, sides);
        }
        let (transmits, settled) = self.machine.drive(now, self.same_host, &mut self.events);
        for t in transmits {
            let (attempt, step) = match t {
                SetupTransmit::Request(a) => {
                    // Without a pool this node routes nothing over shm: never asked.
                    let Some(pool) = sides.ours else { continue };
                    let probe = probe_key(pool.id());
                    let lane = self.offer_lane(sides.env);
                    (a, ShmSetupStep::Request { probe, lane })
                }
                SetupTransmit::Ack(a) => (a, ShmSetupStep::Ack(None)),
                SetupTransmit::Nack(a, why) => (a, ShmSetupStep::Ack(Some(why.to_string()))),
            };
            self.out.push_back(ShmMessage {
                attempt: attempt.0,
                step,
            });
        }
        if let Some(outcome) = settled {
            self.settled(outcome, sides);
        }
    }

    /// A setup step from the peer.
    pub fn on_message(&mut self, msg: ShmMessage, now: Instant, sides: &Sides<'_>) {
        let attempt = Attempt(msg.attempt);
        match msg.step {
            // We are the side that maps.
            ShmSetupStep::Request { probe, lane } => {
                if !self.same_host {
                    return self.reply(attempt, Some("the receiver is on another host".into()));
                }
                if sides.theirs.is_none() {
                    let why = "the receiver saw no shm pool in the sender's hello";
                    return self.reply(attempt, Some(why.into()));
                }
                if std::mem::replace(&mut self.probing, true) {
                    // One probe at a time; the peer's attempt times out and it retries.
                    return;
                }
                // A node whose lane is off reads none; a ring attached already (a retried
                // request) is not attached again.
                let attached = self.lane_rx.as_ref().map(|(key, _)| key.clone());
                let lane = lane.filter(|key| self.lane.max > 0 && Some(key) != attached.as_ref());
                let env = sides.env;
                let (peer, pid, secret) = (env.peer.clone(), self.peer_pid, env.secret.clone());
                let (probed, wake) = (Arc::clone(&self.probed), Arc::clone(&env.wake));
                env.io.spawn(async move {
                    // Answered within the sender's attempt (its retry finds this one over).
                    let probing = probe_pool(&peer, pid, &probe, lane, &secret);
                    let result = match tokio::time::timeout(PROBE_TIMEOUT, probing).await {
                        Ok(result) => result,
                        Err(_) => Err(format!(
                            "the sender's fd-sharing socket did not answer within {PROBE_TIMEOUT:?}"
                        )),
                    };
                    (probed.lock().unwrap_or_else(|p| p.into_inner())).push((attempt, result));
                    wake();
                });
            }
            ShmSetupStep::Ack(None) => self.out.push_back(ShmMessage {
                attempt: msg.attempt,
                step: ShmSetupStep::Confirm,
            }),
            ShmSetupStep::Ack(Some(why)) => {
                tracing::warn!(peer = %sides.env.peer, "the peer gave up shm setup: {why}");
                // It will not send over our reading of its lane.
                if let Some((_, rx)) = self.lane_rx.take() {
                    rx.stop();
                }
            }
            // We are the sending side.
            ShmSetupStep::Reply(refused) => {
                if let Some(machine) = self.machine.machine() {
                    let reply = refused.map_or(PeerReply::Accepted, PeerReply::Refused);
                    machine.handle_reply(now, attempt, reply);
                }
            }
            ShmSetupStep::Confirm => {
                if let Some(machine) = self.machine.machine() {
                    machine.handle_confirm(attempt);
                }
            }
        }
        self.pump(now, sides);
    }

    fn reply(&mut self, attempt: Attempt, refused: Option<String>) {
        self.out.push_back(ShmMessage {
            attempt: attempt.0,
            step: ShmSetupStep::Reply(refused),
        });
    }

    /// The probe for the peer's attempt ended: our lane thread starts on its ring, and the
    /// peer hears how it went.
    fn probed(
        &mut self,
        attempt: Attempt,
        result: Result<Option<(String, Ring)>, String>,
        sides: &Sides<'_>,
    ) {
        self.probing = false;
        let refused = match (result, sides.theirs) {
            (Ok(ring), Some(theirs)) => {
                if let Some((key, ring)) = ring {
                    self.attach_lane(key, ring, sides.env, theirs);
                }
                None
            }
            (Ok(_), None) => Some("the sender's shm pool is gone from its hello".into()),
            (Err(why), _) => {
                tracing::warn!(peer = %sides.env.peer, "cannot map the peer's shm pool: {why}");
                Some(why)
            }
        };
        self.reply(attempt, refused);
    }

    /// The setup settled: the lane opens first (the node gives it its routes on the settled
    /// notice), then the shell hears how it went.
    fn settled(&mut self, outcome: SetupOutcome, sides: &Sides<'_>) {
        let label = match &outcome {
            SetupOutcome::Ok => "ok",
            SetupOutcome::Bad(_) => "bad",
        };
        metrics::counter!("ferry_shm_setup_total", "outcome" => label).increment(1);
        let peer = &sides.env.peer;
        match &outcome {
            SetupOutcome::Ok => {
                tracing::info!(peer = %peer, "shm set up with the peer");
                self.open_lane(sides);
            }
            SetupOutcome::Bad(why) => {
                tracing::warn!(peer = %peer, "shm setup with the peer failed, falling back: {why}");
                self.withdraw_offer(sides.env);
            }
        }
        self.events.push_back(PartEvent::Settled(outcome));
    }

    /// The lane ring offered with our request (one per setup, whatever the number of
    /// attempts): its key at our fd-sharing socket; none when the lane is off.
    fn offer_lane(&mut self, env: &PeerEnv) -> Option<String> {
        if self.lane.max == 0 {
            return None;
        }
        if let Some((key, _)) = &self.lane_offer {
            return Some(key.clone());
        }
        match Ring::create(SLOTS, SLOT_LEN) {
            Ok(ring) => {
                let key = format!("shm-lane/{:032x}", rand::random::<u128>());
                let ring = Arc::new(ring);
                env.gpus.rings.insert(key.clone(), ring.clone());
                self.lane_offer = Some((key.clone(), ring));
                Some(key)
            }
            Err(e) => {
                tracing::warn!(peer = %env.peer, "no shm lane to the peer: {e}");
                None
            }
        }
    }

    fn withdraw_offer(&mut self, env: &PeerEnv) -> Option<Arc<Ring>> {
        let (key, ring) = self.lane_offer.take()?;
        env.gpus.rings.remove(&key);
        Some(ring)
    }

    /// The setup went well: the lane we offered opens if the peer took it.
    fn open_lane(&mut self, sides: &Sides<'_>) {
        let env = sides.env;
        let (Some(ring), Some(pool)) = (self.withdraw_offer(env), sides.ours) else {
            return;
        };
        if !ring.is_attached() {
            tracing::info!(peer = %env.peer, "the peer did not take the shm lane");
            return;
        }
        let records = PoolRecords {
            pool: Arc::clone(pool),
            max: self.lane.max,
            io: env.io.clone(),
            lease: env.lease_timeout,
        };
        match LaneTx::start(&env.peer, ring, Box::new(records), self.lane.spin) {
            Ok(tx) => {
                tracing::info!(peer = %env.peer, max = self.lane.max, "shm lane to the peer open");
                if let Some(old) = self.lane_tx.replace(Arc::clone(&tx)) {
                    old.close();
                }
                self.events.push_back(PartEvent::FastPath(tx));
            }
            Err(why) => tracing::warn!(
                peer = %env.peer,
                "no shm lane to the peer: its watcher thread did not start: {why}"
            ),
        }
    }

    /// The peer's lane ring came with its request: our lane thread reads it.
    fn attach_lane(&mut self, key: String, ring: Ring, env: &PeerEnv, theirs: &Arc<PeerPool>) {
        let cx = RxContext {
            peer: env.peer.clone(),
            pool: Arc::clone(theirs),
            deliveries: Arc::clone(&env.deliveries),
            memory: Arc::clone(&env.host_memory),
            share: env.share,
            reserve_timeout: env.reserve_timeout,
            io: env.io.clone(),
            spin: self.lane.spin,
        };
        match ShmLaneRx::start(ring, cx) {
            // A previous lane of this session (a repeated setup) stops as it drops.
            Ok(rx) => self.lane_rx = Some((key, rx)),
            Err(why) => tracing::warn!(peer = %env.peer, "cannot read the peer's shm lane: {why}"),
        }
    }

    /// The link is lost: both ends of the lanes close.
    pub fn end_lanes(&mut self, env: &PeerEnv) {
        self.withdraw_offer(env);
        if let Some(tx) = self.lane_tx.take() {
            tx.close();
        }
        if let Some((_, rx)) = self.lane_rx.take() {
            rx.stop();
        }
        // A probe still running is forgotten: what it maps is not attached.
        self.probed = Arc::default();
        self.probing = false;
    }
}

/// Fetches the peer's probe and maps it (proof that its pool can be mapped here), then its
/// lane ring when it offered one (a lane that cannot be mapped is only logged: sends take
/// the session).
async fn probe_pool(
    peer: &str,
    pid: u32,
    probe: &str,
    lane: Option<String>,
    secret: &crate::link::Secret,
) -> Result<Option<(String, Ring)>, String> {
    let fd = crate::fdshare::fetch(peer, pid, probe, secret)
        .await
        .map_err(|e| format!("fetching its pool's probe: {e}"))?;
    Segment::open(fd, PROBE_LEN).map_err(|e| format!("mapping its pool's probe: {e}"))?;
    let Some(key) = lane else {
        return Ok(None);
    };
    let mapped = match crate::fdshare::fetch(peer, pid, &key, secret).await {
        Ok(fd) => Ring::open(fd).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    Ok(mapped
        .inspect_err(|why| tracing::warn!(peer, "cannot map the peer's shm lane: {why}"))
        .ok()
        .map(|ring| (key, ring)))
}
