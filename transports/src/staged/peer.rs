//! The staged transport as a node serves it ([`StagedTransport`]) and its part of one
//! peer's session: with a same-host peer, a ring of staging slots per direction in shared
//! memory (ours made at the first staged send and offered at the fd-sharing socket, the
//! peer's mapped when it names it), each emptied or filled by a thread of its own; staged
//! sends wait a little for the peer to map a ring just offered ([`RING_PATIENCE`]), then go
//! over the link, which carries them to another host anyway.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferry_config::TransportName;

use super::threads::{Job, Report, Reports, StagedRx, StagedSettings, StagedTx};
use super::{StagedMessage, StagingRx, StagingTx};
use crate::link::Activity;
use crate::memory::SharedBytes;
use crate::transport::{
    Attached, Capabilities, DescriptorError, OpId, PartEvent, PeerEnv, PeerTransport, Regions,
    Retired, Streaming, Transport, Viability,
};
use crate::wire::Layout;

/// How long staged sends wait for a same-host peer to map a staging ring just offered
/// before they go over the link.
pub const RING_PATIENCE: Duration = Duration::from_secs(1);

/// How often the sends held for the ring look at it.
const RING_LOOK: Duration = Duration::from_millis(1);

/// The staged transport of one node: its settings.
pub struct StagedTransport {
    caps: Capabilities,
    settings: StagedSettings,
}

impl StagedTransport {
    /// The transport with `settings` (`[transport.staged]`).
    pub fn new(settings: StagedSettings) -> Self {
        Self {
            caps: super::capabilities(),
            settings,
        }
    }

    /// The transport `[transport.staged]` asks for.
    pub fn from_config(config: &ferry_config::Config) -> Self {
        let staged = &config.transport.staged;
        Self::new(StagedSettings {
            slots: staged.slots,
            chunk: staged.chunk,
            shared_memory: staged.shared_memory,
            link_chunk: usize::try_from(staged.link_chunk).unwrap_or(1 << 20),
            spin: staged.spin,
        })
    }
}

impl Transport for StagedTransport {
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn viability(&self) -> Viability {
        Viability::Viable
    }

    fn open(&self, env: PeerEnv) -> Box<dyn PeerTransport> {
        let reports = Reports {
            queue: Arc::default(),
            wake: Arc::clone(&env.wake),
        };
        Box::new(StagedPart {
            settings: self.settings,
            env,
            reports,
            returned: Arc::default(),
            link: None,
            tx: None,
            rx: None,
            making: false,
            since: None,
            waiting: VecDeque::new(),
            out: VecDeque::new(),
            events: VecDeque::new(),
        })
    }
}

/// The link a part's rings are made for.
struct Link {
    number: u64,
    same_host: bool,
    pid: u32,
    activity: Activity,
    regions: Regions,
}

/// A send held until our ring is mapped (or the wait is over).
struct Waiting {
    job: Job,
}

/// What the part's own work (made off the shell's thread) hands back.
enum Made {
    /// Our sending ring for the link `link`, or why there is none.
    Tx {
        link: u64,
        made: Result<(StagingTx, usize), String>,
    },
    /// The peer's ring for the link `link`, mapped, or why not.
    Rx {
        link: u64,
        opened: Result<StagingRx, String>,
    },
}

/// The staged part of one peer's session.
struct StagedPart {
    settings: StagedSettings,
    env: PeerEnv,
    reports: Reports,
    returned: Arc<std::sync::Mutex<VecDeque<Made>>>,
    link: Option<Link>,
    /// Our sending end (its ring offered at the fd-sharing socket under its key until the
    /// peer fetched it or the link changed).
    tx: Option<(StagedTx, String)>,
    /// The receiving end of the peer's ring.
    rx: Option<StagedRx>,
    /// True while our ring is being made (off the shell's thread).
    making: bool,
    /// When the first staged send on this link asked for a ring.
    since: Option<Instant>,
    /// Staged sends waiting for the peer to map the ring, in grant order.
    waiting: VecDeque<Waiting>,
    /// Messages to the peer's part waiting for the link (our ring, once per link).
    out: VecDeque<StagedMessage>,
    events: VecDeque<PartEvent>,
}

impl StagedPart {
    /// The current link's number, if one is up.
    fn link_number(&self) -> Option<u64> {
        self.link.as_ref().map(|l| l.number)
    }

    /// Runs `work` off the shell's thread; what it makes comes back at the next poll.
    fn make(&self, work: impl FnOnce() -> Made + Send + 'static) {
        let returned = Arc::clone(&self.returned);
        let wake = Arc::clone(&self.env.wake);
        self.env.io.spawn_blocking(move || {
            let made = work();
            returned
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_back(made);
            wake();
        });
    }

    /// The first staged send to a same-host peer on this link: a staging ring for our
    /// staged sends to it, offered at the fd-sharing socket and named to the peer (made
    /// lazily: its slots are page-locked, which a peer that never takes staged should not
    /// cost). `chunk = "auto"` measures copies the first time (tens of milliseconds): not
    /// on the shell's thread.
    fn offer_ring(&mut self, now: Instant) {
        let Some(link) = &self.link else {
            return;
        };
        if self.tx.is_some() || self.making || !link.same_host || !self.settings.shared_memory {
            return;
        }
        self.making = true;
        self.since = Some(now);
        let (settings, number) = (self.settings, link.number);
        let device = self.env.gpus.first_device().cloned();
        self.make(move || {
            let chunk = settings.chunk_bytes(device.as_ref());
            let made = StagingTx::create(settings.slots, chunk)
                .map(|staging| (staging, chunk))
                .map_err(|e| e.to_string());
            Made::Tx { link: number, made }
        });
    }

    /// Our staging ring is made: offer it and start its sender thread.
    fn start_tx(&mut self, staging: StagingTx, chunk: usize) {
        let Some(link) = &self.link else {
            return;
        };
        let key = super::ring_key();
        self.env
            .gpus
            .rings
            .insert(key.clone(), staging.ring().clone());
        let started = StagedTx::start(
            &self.env.peer,
            staging,
            self.env.in_flight,
            (self.settings.spin, self.env.stall, link.activity.clone()),
            self.env.gpus.first_device().cloned(),
            (self.reports.clone(), link.number),
        );
        match started {
            Ok(tx) => {
                tracing::debug!(peer = %self.env.peer, chunk, slots = self.settings.slots, "staging ring offered");
                self.out.push_back(StagedMessage::Ring { key: key.clone() });
                self.tx = Some((tx, key));
            }
            Err(e) => {
                self.env.gpus.rings.remove(&key);
                tracing::warn!(peer = %self.env.peer, "no staged sender thread: {e}");
            }
        }
    }

    /// Our staging ring closes (the link changed or the session ends).
    fn end_tx(&mut self) {
        if let Some((tx, key)) = self.tx.take() {
            self.env.gpus.rings.remove(&key);
            tx.close();
        }
    }

    /// The peer named its staging ring: fetch and map it, then read it on a thread of our
    /// own. A ring that cannot be had leaves the peer's staged sends on the link.
    fn attach_ring(&mut self, key: String) {
        let Some(link) = &self.link else {
            return;
        };
        if !link.same_host || !key.starts_with("staged/") {
            tracing::warn!(peer = %self.env.peer, key, "ignoring a staging ring that is not a same-host peer's");
            return;
        }
        if !self.settings.shared_memory {
            tracing::debug!(peer = %self.env.peer, "transport.staged.shared_memory = false: the peer's staged sends stay on the link");
            return;
        }
        if let Some(old) = self.rx.take() {
            old.stop();
        }
        let (peer, pid, secret, number) = (
            self.env.peer.clone(),
            link.pid,
            self.env.secret.clone(),
            link.number,
        );
        let returned = Arc::clone(&self.returned);
        let wake = Arc::clone(&self.env.wake);
        self.env.io.spawn(async move {
            let opened = match crate::fdshare::fetch(&peer, pid, &key, &secret).await {
                Ok(fd) => StagingRx::open(fd).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            returned
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_back(Made::Rx {
                    link: number,
                    opened,
                });
            wake();
        });
    }

    /// The peer's ring is mapped: our receiver thread reads it.
    fn start_rx(&mut self, staging: StagingRx) {
        let Some(link) = &self.link else {
            return;
        };
        let started = StagedRx::start(
            &self.env.peer,
            staging,
            self.settings.spin,
            self.env.gpus.first_device().cloned(),
            (Arc::clone(&link.regions), link.activity.clone()),
            (self.reports.clone(), link.number),
        );
        match started {
            Ok(rx) => self.rx = Some(rx),
            Err(why) => tracing::warn!(peer = %self.env.peer, "no staged receiver thread: {why}"),
        }
    }

    /// True while our ring is being made or offered and not yet mapped by the peer, for at
    /// most [`RING_PATIENCE`] since the first staged send asked for it.
    fn ring_pending(&self, now: Instant) -> bool {
        let unmapped = self.making || self.tx.as_ref().is_some_and(|(tx, _)| !tx.is_attached());
        unmapped
            && self.link.is_some()
            && self
                .since
                .is_some_and(|t| now.saturating_duration_since(t) < RING_PATIENCE)
    }

    /// Sends `job` through our ring if the peer reads it, else over the link.
    fn go(&mut self, job: Job) -> Streaming {
        let Some((tx, _)) = self.tx.as_ref().filter(|(tx, _)| tx.is_attached()) else {
            return Streaming::OverLink;
        };
        let op = job.op;
        if tx.submit(job).is_err() {
            self.events.push_back(PartEvent::StreamEnded {
                op,
                broken: Some("the staged sender thread is gone or overrun".into()),
            });
        }
        Streaming::Started
    }

    /// Carries out what came back: rings made or mapped, the threads' reports, and the
    /// sends held for the ring once it is mapped or the wait is over.
    fn pump(&mut self, now: Instant) {
        let made: Vec<_> = {
            let mut returned = self.returned.lock().unwrap_or_else(|p| p.into_inner());
            returned.drain(..).collect()
        };
        for made in made {
            match made {
                Made::Tx { link, made } => {
                    self.making = false;
                    match made {
                        Ok((staging, chunk)) if Some(link) == self.link_number() => {
                            self.start_tx(staging, chunk);
                        }
                        Ok(_) => {}
                        Err(why) => {
                            tracing::warn!(peer = %self.env.peer, "no staging ring (staged sends go over the link): {why}")
                        }
                    }
                }
                Made::Rx { link, opened } => match opened {
                    Ok(staging) if Some(link) == self.link_number() => self.start_rx(staging),
                    Ok(_) => {}
                    Err(why) => {
                        tracing::warn!(peer = %self.env.peer, "cannot map the peer's staging ring (its staged sends come over the link): {why}")
                    }
                },
            }
        }
        let current = self.link_number();
        for report in self.reports.take() {
            let event = match report {
                Report::StreamEnded { op, broken, link } => {
                    let broken = broken.filter(|_| Some(link) == current);
                    if broken.is_some() {
                        self.end_tx();
                    }
                    PartEvent::StreamEnded { op, broken }
                }
                Report::InboundDone { id, buffer } => PartEvent::InboundDone { id, buffer },
                Report::InboundFailed { id, why } => PartEvent::InboundFailed { id, why },
                Report::PeerBroke { link, why } => {
                    if Some(link) != current {
                        continue;
                    }
                    self.rx = None;
                    metrics::counter!("ferry_frames_rejected_total", "reason" => "protocol")
                        .increment(1);
                    PartEvent::Broke(format!("the peer broke its staging ring: {why}"))
                }
            };
            self.events.push_back(event);
        }
        if self.waiting.is_empty() || self.ring_pending(now) {
            return;
        }
        for Waiting { job } in std::mem::take(&mut self.waiting) {
            if job.stop.load(Ordering::Acquire) {
                let op = job.op;
                self.events
                    .push_back(PartEvent::StreamEnded { op, broken: None });
                continue;
            }
            let op = job.op;
            if let Streaming::OverLink = self.go(job) {
                self.events.push_back(PartEvent::StreamOverLink(op));
            }
        }
    }
}

impl PeerTransport for StagedPart {
    fn transport(&self) -> TransportName {
        StagedMessage::TRANSPORT
    }

    /// Any peer is served (over the link at least); on a new link the previous link's
    /// ring closes, and the next staged send makes one.
    fn attach(&mut self, link: &Attached<'_>) -> bool {
        self.end_tx();
        self.since = None;
        self.link = Some(Link {
            number: link.link,
            same_host: link.same_host,
            pid: link.hello.pid,
            activity: link.activity.clone(),
            regions: Arc::clone(&link.regions),
        });
        true
    }

    fn handle_message(&mut self, body: &[u8], now: Instant) -> Result<(), DescriptorError> {
        match StagedMessage::read(body)? {
            StagedMessage::Ring { key } => self.attach_ring(key),
        }
        self.pump(now);
        Ok(())
    }

    fn poll_message(&mut self) -> Option<Vec<u8>> {
        let message = self.out.pop_front()?;
        match crate::transport::encode(&message) {
            Ok(body) => Some(body),
            Err(why) => {
                self.events
                    .push_back(PartEvent::Broke(format!("a staged message: {why}")));
                None
            }
        }
    }

    fn poll_event(&mut self) -> Option<PartEvent> {
        self.pump(Instant::now());
        self.events.pop_front()
    }

    /// While sends wait for the ring: a look every [`RING_LOOK`].
    fn poll_timeout(&self) -> Option<Instant> {
        (!self.waiting.is_empty()).then(|| Instant::now() + RING_LOOK)
    }

    fn handle_timeout(&mut self, now: Instant) {
        self.pump(now);
    }

    fn detach(&mut self) {
        self.end_tx();
        if let Some(rx) = self.rx.take() {
            rx.stop();
        }
        self.link = None;
    }

    /// Through our ring when the peer reads it; held a little for a ring just offered (in
    /// order with the others held); else over the link, where the peer lands it alike.
    fn stream(
        &mut self,
        op: OpId,
        bytes: SharedBytes,
        layout: &Layout,
        stop: Arc<AtomicBool>,
        now: Instant,
    ) -> Streaming {
        self.offer_ring(now);
        let job = Job {
            op,
            layout: layout.clone(),
            bytes,
            stop,
        };
        // The link is many times slower than the ring: a staged send waits a little for
        // the peer to map a ring just offered (in order with the others waiting).
        if self.ring_pending(now) || !self.waiting.is_empty() {
            self.waiting.push_back(Waiting { job });
            return Streaming::Held;
        }
        self.go(job)
    }

    fn link_chunk(&self) -> Option<usize> {
        Some(self.settings.link_chunk)
    }

    fn close(&mut self) -> Vec<(OpId, Retired)> {
        self.detach();
        Vec::new()
    }
}
