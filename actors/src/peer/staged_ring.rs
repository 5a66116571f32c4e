//! The staged transport's shared ring with a same-host peer: made at the first staged
//! send, offered at the fd-sharing socket, attached when the peer offers its own.

use super::*;

impl TransferActor {
    /// The first GPU of this node, whose context registers staging slots as pinned.
    pub(super) fn staging_device(&self) -> Option<ferry_transports::cuda::Device> {
        self.setup.gpus.gpus.first().map(|(_, g)| g.device.clone())
    }

    /// The first staged send to a same-host peer on this link: a staging ring for our
    /// staged sends to it, offered at the fd-sharing socket and named to the peer (made lazily:
    /// its slots are page-locked, which a peer that never takes staged should not cost).
    pub(super) fn offer_staged_ring(&mut self, ctx: &mut Context<Self>) {
        let settings = self.setup.staged;
        if self.staged.tx.is_some()
            || self.staged.making
            || !self.staged.same_host
            || !settings.shared_memory
        {
            return;
        }
        // `chunk = "auto"` measures copies the first time (tens of milliseconds): not on
        // the actor thread. Staged sends wait meanwhile (at most `RING_PATIENCE`).
        self.staged.making = true;
        self.staged.since = Some(Instant::now());
        let device = self.staging_device();
        let link = self.link;
        let make = move || {
            let chunk = settings.chunk_bytes(device.as_ref());
            ferry_transports::staged::StagingTx::create(settings.slots, chunk)
                .map(|staging| (staging, chunk, device))
        };
        ctx.spawn(
            self.setup
                .io
                .spawn_blocking(make)
                .into_actor(self)
                .map(move |made, act, ctx| {
                    act.staged.making = false;
                    let made = made
                        .map_err(|e| e.to_string())
                        .and_then(|r| r.map_err(|e| e.to_string()));
                    match made {
                        Ok((staging, chunk, device)) if link == act.link && !act.session.is_lost() => {
                            act.start_staged_tx(staging, chunk, device, ctx);
                        }
                        Ok(_) => {}
                        Err(why) => tracing::warn!(peer = %act.peer, "no staging ring (staged sends go over the link): {why}"),
                    }
                    act.drive(ctx);
                }),
        );
    }

    /// Our staging ring is made: offer it and start its sender thread.
    pub(super) fn start_staged_tx(
        &mut self,
        staging: ferry_transports::staged::StagingTx,
        chunk: usize,
        device: Option<ferry_transports::cuda::Device>,
        ctx: &mut Context<Self>,
    ) {
        let settings = self.setup.staged;
        let key = ferry_transports::staged::ring_key();
        self.setup
            .gpus
            .rings
            .insert(key.clone(), Arc::clone(staging.ring()));
        let started = crate::staged::StagedTx::start(
            &self.peer,
            staging,
            self.setup.limits.in_flight,
            (
                settings.spin,
                self.setup.limits.stall,
                self.activity.clone().unwrap_or_default(),
            ),
            device,
            (ctx.address().recipient(), self.link),
            self.setup.io.clone(),
        );
        match started {
            Ok(tx) => {
                tracing::debug!(peer = %self.peer, chunk, slots = settings.slots, "staging ring offered");
                self.staged
                    .out
                    .push_back(StagedMessage::Ring { key: key.clone() });
                self.staged.tx = Some((tx, key));
            }
            Err(e) => {
                self.setup.gpus.rings.remove(&key);
                tracing::warn!(peer = %self.peer, "no staged sender thread: {e}");
            }
        }
    }

    /// Our staging ring closes (the link changed or the session ends).
    pub(super) fn end_staged_tx(&mut self) {
        if let Some((tx, key)) = self.staged.tx.take() {
            self.setup.gpus.rings.remove(&key);
            tx.close();
        }
    }

    /// The peer named its staging ring: fetch and map it, then read it on a thread of our
    /// own. A ring that cannot be had leaves the peer's staged sends on the link.
    pub(super) fn attach_staged_ring(&mut self, key: String, ctx: &mut Context<Self>) {
        if !self.staged.same_host || !key.starts_with("staged/") {
            tracing::warn!(peer = %self.peer, key, "ignoring a staging ring that is not a same-host peer's");
            return;
        }
        if !self.setup.staged.shared_memory {
            tracing::debug!(peer = %self.peer, "transport.staged.shared_memory = false: the peer's staged sends stay on the link");
            return;
        }
        if let Some(old) = self.staged.rx.take() {
            old.stop();
        }
        let (peer, pid, secret) = (
            self.peer.clone(),
            self.staged.peer_pid,
            self.setup.secret.clone(),
        );
        let fetch = async move {
            let fd = ferry_transports::fdshare::fetch(&peer, pid, &key, &secret)
                .await
                .map_err(|e| e.to_string())?;
            ferry_transports::staged::StagingRx::open(fd).map_err(|e| e.to_string())
        };
        let link = self.link;
        ctx.spawn(
            self.setup
                .io
                .spawn(fetch)
                .into_actor(self)
                .map(move |opened, act, ctx| {
                    let opened = opened.map_err(|e| e.to_string()).and_then(|r| r);
                    let staging = match opened {
                        Ok(staging) if link == act.link => staging,
                        Ok(_) => return,
                        Err(why) => {
                            tracing::warn!(peer = %act.peer, "cannot map the peer's staging ring (its staged sends come over the link): {why}");
                            return;
                        }
                    };
                    let started = crate::staged::StagedRx::start(
                        &act.peer,
                        staging,
                        act.setup.staged.spin,
                        act.staging_device(),
                        (Arc::clone(&act.regions), act.activity.clone().unwrap_or_default()),
                        (ctx.address().recipient(), link),
                        act.setup.io.clone(),
                    );
                    match started {
                        Ok(rx) => act.staged.rx = Some(rx),
                        Err(why) => tracing::warn!(peer = %act.peer, "no staged receiver thread: {why}"),
                    }
                }),
        );
    }
}

/// The staged transport's rings with a same-host peer.
#[derive(Default)]
pub(super) struct StagedState {
    /// Our sending end (its ring offered at the fd-sharing socket under `key` until the peer
    /// fetched it or the link changed).
    pub(super) tx: Option<(crate::staged::StagedTx, String)>,
    /// The receiving end of the peer's ring.
    pub(super) rx: Option<crate::staged::StagedRx>,
    /// True while our ring is being made (off the actor thread).
    pub(super) making: bool,
    /// When the first staged send on this link asked for a ring.
    pub(super) since: Option<Instant>,
    /// Staged sends waiting for the peer to map the ring, in grant order.
    pub(super) waiting: VecDeque<OpId>,
    /// True while a look at `waiting` is scheduled.
    pub(super) polling: bool,
    /// Messages to the peer's part waiting for the link (our ring, once per link).
    pub(super) out: VecDeque<StagedMessage>,
    /// The peer's pid and whether it runs on this host, from its hello.
    pub(super) peer_pid: u32,
    pub(super) same_host: bool,
}

/// How long staged sends wait for a same-host peer to map a staging ring just offered
/// before they go over the link.
pub(super) const RING_PATIENCE: Duration = Duration::from_secs(1);
