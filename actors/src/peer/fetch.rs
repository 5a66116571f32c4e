//! Fetches by key, both ways: ours waiting for the peer's answer, and the peer's that this
//! node serves by sending a read-only handle on the published buffer.

use super::*;
use crate::fetch::Landed;
use ferry_transports::wire::{FetchAsk, FetchRefusal, FetchRefused};

/// Ask the peer for the buffer it published under `key`; resolves with the landed bytes.
#[derive(Debug, Message)]
#[rtype(result = "Result<Landed, Error>")]
pub struct AskFetch {
    /// The key.
    pub key: String,
    /// Which bytes of it.
    pub layout: Layout,
    /// When it must have ended.
    pub deadline: Instant,
}

/// Fetch ids, unique in this process: an answer a peer sends late, after the session that
/// asked ended (it is routed like a send, and may reach a new session), never meets
/// another fetch under the same id.
static NEXT_FETCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The fetches of one peer session.
#[derive(Default)]
pub(super) struct FetchState {
    /// Ours, waiting for the peer's answer, by id, with what was asked (asked again on a
    /// link that replaces one the peer never read).
    pending: HashMap<u64, (oneshot::Sender<Result<Landed, Error>>, FetchAsk)>,
    /// Frames for the peer, sent once the link is up.
    pub(super) out: VecDeque<Message>,
    /// The peer's fetches this node serves now.
    serving: usize,
}

impl FetchState {
    /// True while a fetch of ours waits for the peer's answer and its caller for it.
    pub(super) fn awaits_peer(&self) -> bool {
        self.pending.values().any(|(tx, _)| !tx.is_closed())
    }
}

impl Handler<AskFetch> for TransferActor {
    type Result = ResponseFuture<Result<Landed, Error>>;

    fn handle(&mut self, msg: AskFetch, ctx: &mut Self::Context) -> Self::Result {
        let peer = self.peer.clone();
        if let Some(why) = self.session.lost_reason() {
            let error = Error::PeerLost {
                peer,
                detail: why.to_string(),
            };
            return Box::pin(async move { Err(error) });
        }
        // Fetches whose callers gave up are forgotten first; the rest are bounded.
        let cap = self.setup.limits.queue;
        if self.fetch.pending.len() >= cap {
            self.fetch.pending.retain(|_, (tx, _)| !tx.is_closed());
        }
        if self.fetch.pending.len() >= cap {
            return Box::pin(async move {
                Err(Error::QueueFull(format!(
                    "{cap} fetches from peer {peer} wait for their answer already"
                )))
            });
        }
        let id = NEXT_FETCH.fetch_add(1, Ordering::Relaxed);
        let asked = FetchAsk {
            fetch: id,
            key: msg.key,
            layout: msg.layout,
        };
        let ask = Message::Fetch(asked.clone());
        // A frame the peer would refuse would end the link: refused here instead.
        let len = ask.payload_len().unwrap_or(usize::MAX);
        if len as u64 > u64::from(self.link.peer_max_frame) {
            let max = self.link.peer_max_frame;
            return Box::pin(async move {
                Err(Error::Usage(format!(
                    "a fetch of this layout takes {len} bytes, more than the {max} peer {peer} \
                     takes in a frame (its limits.max_frame): ask for fewer blocks at once"
                )))
            });
        }
        let (tx, rx) = oneshot::channel();
        self.fetch.pending.insert(id, (tx, asked));
        self.fetch.out.push_back(ask);
        self.drive(ctx);
        let deadline = msg.deadline;
        Box::pin(async move {
            match tokio::time::timeout_at(deadline.into(), rx).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(_)) => Err(Error::PeerLost {
                    peer,
                    detail: "the session ended before the peer answered the fetch".into(),
                }),
                Err(_) => Err(Error::DeadlineExceeded),
            }
        })
    }
}

impl TransferActor {
    /// The peer asks for a buffer this node published: refused at once, or sent like any
    /// other send to the peer (its route, its transports), marked as the fetch's answer.
    pub(super) fn serve_fetch(&mut self, ask: FetchAsk, ctx: &mut Context<Self>) {
        if ask.key.len() > ferry_transports::wire::MAX_KEY_LEN {
            // Never echoed: a peer's key of any length is not copied into our answer.
            let detail = format!(
                "a key of {} bytes, more than {}",
                ask.key.len(),
                ferry_transports::wire::MAX_KEY_LEN
            );
            return self.refuse_fetch(ask.fetch, FetchRefusal::UnknownKey, detail);
        }
        // Half the peer's session queue at most: our own sends to it keep the rest.
        let cap = (self.setup.limits.queue / 2).max(1);
        if self.fetch.serving >= cap {
            let detail = format!(
                "this node serves {} fetches for {} at once already",
                self.fetch.serving, self.peer
            );
            return self.refuse_fetch(ask.fetch, FetchRefusal::Busy, detail);
        }
        let (handle, serving) = match self
            .setup
            .published
            .serve(&self.peer, &ask.key, &ask.layout)
        {
            Ok(served) => served,
            Err((reason, detail)) => return self.refuse_fetch(ask.fetch, reason, detail),
        };
        self.fetch.serving += 1;
        let (id, packed) = (ask.fetch, serving.packed());
        let deadline = Instant::now() + self.setup.reserve_timeout;
        // Routed by this peer's own table, published while its link is up, and started
        // here; else (the link is between two, the node drains) by the coordinator, which
        // says why no route goes.
        let src = crate::coordinator::memory_class(handle.kind());
        let direct = self.setup.peers.routes(&self.peer).and_then(|d| {
            let routed = d.table.route(src, packed)?.clone();
            Some((routed, d.peer_class))
        });
        let sent: futures::future::BoxFuture<'static, Result<Result<Buffer, SendError>, ()>> =
            match direct {
                Some((routed, peer_class)) => {
                    let op = Op::send_routed(routed, 0, ask.layout, Some(id), packed);
                    let (reply, outcome) = oneshot::channel();
                    let submit = Submit {
                        op,
                        buffer: handle,
                        deadline,
                        peer_class,
                    };
                    self.hold(submit, reply, ctx);
                    Box::pin(async move { outcome.await.map_err(drop) })
                }
                None => {
                    let send = self.setup.serve.send(crate::coordinator::SendTo {
                        peer: self.peer.clone(),
                        tag: 0,
                        buffer: handle,
                        layout: ask.layout,
                        packed,
                        deadline,
                        fetch: Some(id),
                        into: None,
                    });
                    Box::pin(async move { send.await.map_err(drop) })
                }
            };
        ctx.spawn(sent.into_actor(self).map(move |sent, act, ctx| {
            act.fetch.serving -= 1;
            let failed = match sent {
                Ok(Ok(handle)) => {
                    drop(handle);
                    None
                }
                Ok(Err(e)) if e.error.kind() == crate::ErrorKind::ShuttingDown => Some((
                    FetchRefusal::ShuttingDown,
                    "the exporter is shutting down".to_string(),
                )),
                Ok(Err(e)) => Some((FetchRefusal::Failed, e.error.to_string())),
                Err(_) => Some((
                    FetchRefusal::ShuttingDown,
                    "the exporter is shutting down".to_string(),
                )),
            };
            serving.end(failed.is_none());
            // The fetcher may have seen nothing of it (no route, refused before the offer
            // left): it is told, and forgets a fetch it already ended.
            if let Some((reason, detail)) = failed {
                act.refuse_fetch(id, reason, detail);
                act.drive(ctx);
            }
        }));
    }

    fn refuse_fetch(&mut self, fetch: u64, reason: FetchRefusal, detail: String) {
        metrics::counter!("ferry_fetch_refusals_total", "reason" => refusal_label(reason))
            .increment(1);
        tracing::debug!(peer = %self.peer, fetch, ?reason, %detail, "fetch refused");
        self.fetch
            .out
            .push_back(Message::FetchRefused(FetchRefused {
                fetch,
                reason,
                detail,
            }));
    }

    /// The link was replaced by one the peer dialed, and the old one was never read: our
    /// fetches are asked again (a peer that did read one answers twice; the second answer
    /// finds no fetch and is dropped).
    pub(super) fn ask_fetches_again(&mut self) {
        self.fetch.out.retain(|m| !matches!(m, Message::Fetch(_)));
        self.fetch.pending.retain(|_, (tx, _)| !tx.is_closed());
        let asks = self.fetch.pending.values().map(|(_, ask)| ask.clone());
        self.fetch.out.extend(asks.map(Message::Fetch));
    }

    /// The peer refused one of our fetches.
    pub(super) fn fetch_refused(&mut self, refused: FetchRefused) {
        let Some((tx, _)) = self.fetch.pending.remove(&refused.fetch) else {
            return;
        };
        let peer = self.peer.clone();
        let detail = refused.detail;
        let error = match refused.reason {
            FetchRefusal::UnknownKey => Error::Refused {
                peer,
                reason: crate::error::RefusalReason::UnknownKey,
                detail,
            },
            FetchRefusal::NotAllowed => Error::Refused {
                peer,
                reason: crate::error::RefusalReason::NotAllowed,
                detail,
            },
            FetchRefusal::ShuttingDown => Error::Refused {
                peer,
                reason: crate::error::RefusalReason::ShuttingDown,
                detail,
            },
            FetchRefusal::Layout => Error::Usage(format!("peer {peer}: {detail}")),
            FetchRefusal::Busy => Error::QueueFull(format!("peer {peer}: {detail}")),
            FetchRefusal::Failed => Error::Transport {
                peer,
                detail: format!("the peer could not send the fetched bytes: {detail}"),
            },
        };
        let _ = tx.send(Err(error));
    }

    /// Inbound transfer `id`, the answer to our fetch `fetch`, is complete: to the fetch
    /// (not the inbox), counted as taken at once.
    pub(super) fn land_fetch(
        &mut self,
        id: InboundId,
        fetch: u64,
        transport: ferry_config::TransportName,
    ) {
        if let Some(spans) = self.inbound.spans.remove(&id) {
            tracing::debug!(parent: &spans.span, fetch, "fetched");
        }
        let Some((buffer, _pending)) = self.inbound.complete.remove(&id) else {
            return;
        };
        // What the session counts as delivered and not yet taken: taken now.
        self.inbound
            .claims
            .0
            .taken
            .fetch_add(buffer.len() as u64, Ordering::Relaxed);
        // A caller that gave up drops it here, which frees it.
        if let Some((tx, _)) = self.fetch.pending.remove(&fetch) {
            let _ = tx.send(Ok(Landed { buffer, transport }));
        }
    }

    /// The session is lost: our fetches fail with it.
    pub(super) fn fail_fetches(&mut self, why: &str) {
        for (_, (tx, _)) in self.fetch.pending.drain() {
            let _ = tx.send(Err(Error::PeerLost {
                peer: self.peer.clone(),
                detail: why.to_string(),
            }));
        }
    }
}

fn refusal_label(reason: FetchRefusal) -> &'static str {
    match reason {
        FetchRefusal::UnknownKey => "unknown_key",
        FetchRefusal::NotAllowed => "not_allowed",
        FetchRefusal::Layout => "layout",
        FetchRefusal::Busy => "busy",
        FetchRefusal::ShuttingDown => "shutting_down",
        FetchRefusal::Failed => "failed",
    }
}
