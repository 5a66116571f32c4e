//! Publications and fetches: what this node publishes for its peers to fetch (for every
//! peer or for some), withdrawing it, and fetching what a peer published, one flight per
//! key at a time.

use super::*;

impl Node {
    /// Publishes `buffer` under `key` for every peer to fetch ([`Self::fetch`]) until
    /// [`Self::unpublish`]. The buffer stays granted in its memory domain (it counts against
    /// the budget like any buffer a peer reads); peers read it through read-only handles,
    /// so nothing writes it while it is published.
    ///
    /// # Errors
    /// [`Error::Usage`] for an empty key, one longer than
    /// [`ferry_transports::wire::MAX_KEY_LEN`] bytes, or one published already; the buffer
    /// comes back in the error.
    pub fn publish(&self, key: impl Into<String>, buffer: Buffer) -> Result<(), SendError> {
        self.publish_to(key, buffer, None)
    }

    /// [`Self::publish`] for the named peers only: another peer's fetch is refused
    /// ([`crate::RefusalReason::NotAllowed`]).
    ///
    /// # Errors
    /// As [`Self::publish`].
    pub fn publish_for(
        &self,
        key: impl Into<String>,
        buffer: Buffer,
        peers: &[&str],
    ) -> Result<(), SendError> {
        let peers = peers.iter().map(|p| (*p).to_string()).collect();
        self.publish_to(key, buffer, Some(peers))
    }

    fn publish_to(
        &self,
        key: impl Into<String>,
        buffer: Buffer,
        readers: Option<Vec<String>>,
    ) -> Result<(), SendError> {
        self.published
            .publish(key.into(), buffer, readers)
            .map_err(|(error, buffer)| SendError {
                error,
                buffer: Some(buffer),
            })
    }

    /// Ends the publication of `key`: no new fetch finds it, and this waits until no peer
    /// reads the buffer any more (every fetch being served ended and its hold on the memory
    /// let go: an ipc or ucx read is held until the peer's `Done`, or quarantined for the
    /// lease timeout when the peer died), then gives the buffer back.
    ///
    /// # Errors
    /// [`Error::Usage`] for a key not published; [`Error::DeadlineExceeded`] when a peer
    /// still reads it after the default deadline plus `memory.export_lease_timeout` (the
    /// buffer is then freed once the last reader let go).
    ///
    /// # Cancel safety
    /// The key is gone at the first poll. Dropping the future then does not publish it
    /// again: the buffer is freed once the last reader let go (a caller that needs it back
    /// keeps awaiting).
    pub async fn unpublish(&self, key: &str) -> Result<Buffer, Error> {
        let wait = self.config.limits.default_deadline + self.config.memory.export_lease_timeout;
        self.published.unpublish(key, wait).await
    }

    /// What `key` has served while published (`None` for a key not published): the
    /// exporter's count of the fetches that crossed the link.
    pub fn publication(&self, key: &str) -> Option<crate::publish::PublicationStats> {
        self.published.stats(key)
    }

    /// The keys this node publishes now.
    pub fn published_keys(&self) -> Vec<String> {
        self.published.keys()
    }

    /// Fetches what `peer` published under `key`: the whole buffer, or the bytes
    /// `fetch.layout` names (packed), landing where this node receives (`memory.receive_into`)
    /// or copied into `fetch.into`.
    ///
    /// **Single flight.** Concurrent fetches of the same (peer, key, layout) on this node
    /// share one transfer: the first moves the bytes, the others wait for it and each gets
    /// a copy made here (a device copy on the same GPU, a peer copy to another GPU), or
    /// the one read-only handle with `fetch.shared`. The last caller to take the landed
    /// buffer takes it without a copy. A flight that fails fails every caller with its
    /// error; dropping one caller's future cancels nothing else (the flight goes on).
    ///
    /// # Errors
    /// [`Error::Refused`] with [`crate::RefusalReason::UnknownKey`] or
    /// [`crate::RefusalReason::NotAllowed`]; [`Error::Usage`] for a bad key or a layout that
    /// does not fit the published buffer; [`Error::QueueFull`] when
    /// [`crate::fetch::MAX_JOINERS`] callers wait for the flight already; else as
    /// [`Self::send`] fails (the peer lost, the deadline, no memory for the landing or the
    /// copy).
    pub async fn fetch(
        &self,
        peer: &str,
        key: &str,
        fetch: crate::fetch::Fetch,
    ) -> Result<crate::fetch::Fetched, Error> {
        crate::publish::check_key(key)?;
        if let Some(kind) = fetch.into {
            self.domain(kind)?;
        }
        let deadline = fetch.deadline.unwrap_or_else(|| self.default_deadline());
        let seat = self.flights.seat(peer, key, &fetch.layout)?;
        let joined = !seat.leads;
        if seat.leads
            && let Err(e) = self.start_flight(peer, key, &fetch.layout, deadline)
        {
            // Callers that joined meanwhile must not wait for a flight that never left.
            self.flights.land(peer, key, &fetch.layout, Err(e.clone()));
            return Err(e);
        }
        let share = seat.landed(deadline).await?;
        let transport = share.transport();
        let landed = share.buffer().kind();
        let want = fetch.into.unwrap_or(landed);
        let buffer = if fetch.shared && want == landed {
            share.buffer().read_only_handle()
        } else {
            self.own(share, want, deadline).await?
        };
        Ok(crate::fetch::Fetched {
            buffer,
            transport,
            joined,
            peer: peer.to_string(),
            key: key.to_string(),
            layout: fetch.layout,
        })
    }

    /// The node's fetch counters: fetches, flights (those that crossed the link), joined
    /// fetches and the bytes they saved.
    pub fn fetch_stats(&self) -> crate::fetch::FetchStats {
        self.flights.stats()
    }

    /// Starts the flight of a fetch: a task of its own on the I/O runtime, so that no
    /// caller's cancellation cancels it; it lands the flight whatever happens.
    fn start_flight(
        &self,
        peer: &str,
        key: &str,
        layout: &Layout,
        deadline: Instant,
    ) -> Result<(), Error> {
        let io = self.io.as_ref().ok_or(Error::ShuttingDown)?;
        // Callers that join later may wait longer than the first: the flight takes the
        // node's default deadline at least (each caller still stops waiting at its own).
        let deadline = deadline.max(self.default_deadline());
        let flights = Arc::clone(&self.flights);
        let credits = self.credits(peer);
        let coordinator = self.coordinator.clone();
        let ask = FetchFrom {
            peer: peer.to_string(),
            key: key.to_string(),
            layout: layout.clone(),
            deadline,
        };
        io.spawn(async move {
            let (peer, key, layout) = (ask.peer.clone(), ask.key.clone(), ask.layout.clone());
            let outcome = async {
                let _permit = acquire(credits, deadline).await?;
                coordinator
                    .send(ask)
                    .await
                    .map_err(|_| Error::ShuttingDown)?
            }
            .await;
            flights.land(&peer, &key, &layout, outcome);
        });
        Ok(())
    }

    /// A buffer of the caller's own in `kind` memory with the landed bytes of `share`: the
    /// landed buffer itself when this caller is its last holder (asked before and after
    /// waiting for memory), else a copy, allocated under the domain's budget (waiting for
    /// it until `deadline`) and made off the caller's thread.
    async fn own(
        &self,
        share: Arc<crate::fetch::Share>,
        kind: MemoryKind,
        deadline: Instant,
    ) -> Result<Buffer, Error> {
        use crate::fetch::Share;
        /// How long one wait for memory lasts before the caller looks again whether it
        /// holds the landing alone (the others took theirs, or let go of a moment's view).
        const LOOK_AGAIN: Duration = Duration::from_millis(5);
        // The landing itself serves only a caller that wants its memory.
        let same = share.buffer().kind() == kind;
        let sole = |share| {
            if same {
                Share::into_sole(share)
            } else {
                Err(share)
            }
        };
        let tier = self.tier(kind)?;
        let len = share.buffer().len() as u64;
        let mut share = share;
        let mut copy = loop {
            share = match sole(share) {
                Ok(landed) => return Ok(landed),
                Err(share) => share,
            };
            let now = Instant::now();
            let until = deadline.min(now + LOOK_AGAIN);
            match reserve_in_tiers(std::slice::from_ref(&tier), &[len], until).await {
                Ok(mut got) => break got.pop().ok_or(Error::ShuttingDown)?,
                Err(Error::NoMemory {
                    cause: crate::NoMemoryCause::DeadlinePassed,
                    ..
                }) if until < deadline => continue,
                Err(e) => return Err(e),
            }
        };
        // The others may have taken theirs meanwhile: the reservation goes back then.
        let share = match sole(share) {
            Ok(landed) => return Ok(landed),
            Err(share) => share,
        };
        let io = self.io.as_ref().ok_or(Error::ShuttingDown)?;
        let copied = io
            .spawn_blocking(move || copy.copy_from(share.buffer()).map(|()| copy))
            .await
            .map_err(|_| Error::ShuttingDown)?;
        copied.map_err(|e| Error::Transport {
            peer: self.name.clone(),
            detail: format!("the copy of a fetched buffer failed: {e}"),
        })
    }
}
