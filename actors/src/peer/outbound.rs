//! Outbound transfers: a submitted send becomes an op of the session; a granted op's
//! bytes stream over the link or its transport's own channel; a send whose transport's
//! setup with the peer failed falls back.

use super::*;
use ferry_transports::registry;
use ferry_transports::transport::Admission;

impl TransferActor {
    /// A granted op (or a put, which needs no grant): its bytes start to move, through
    /// its transport's own channel if it has one (staged's ring), else over the link.
    pub(super) fn start_stream(&mut self, op: OpId) {
        let Some(entry) = self.outbound.entries.get_mut(&op) else {
            return;
        };
        entry.phase = tracing::debug_span!(parent: &entry.span, "copy");
        let StreamWhat::Transfer(layout) = &entry.what else {
            return self.stream_over_link(op);
        };
        let (transport, layout) = (entry.labels.transport, layout.clone());
        let (bytes, stop) = (entry.buffer.share(), Arc::clone(&entry.stop));
        let streaming = match self.parts.get(transport) {
            Some(part) => part.stream(op, bytes, &layout, stop, Instant::now()),
            None => ferry_transports::transport::Streaming::OverLink,
        };
        if let ferry_transports::transport::Streaming::OverLink = streaming {
            self.stream_over_link(op);
        }
    }

    /// Hands a granted op's bytes to the link's writer, in frames of its transport's size
    /// (puts': the link's own, `transport.tcp.chunk_size`).
    pub(super) fn stream_over_link(&mut self, op: OpId) {
        let Some(entry) = self.outbound.entries.get(&op) else {
            return;
        };
        let chunk = match entry.what {
            StreamWhat::Transfer(_) => {
                (self.parts.link_chunk(entry.labels.transport)).unwrap_or(self.setup.chunk)
            }
            StreamWhat::Put { .. } => self.setup.chunk,
        };
        let out = Outgoing::Stream {
            op,
            what: entry.what.clone(),
            bytes: entry.buffer.share(),
            stop: Arc::clone(&entry.stop),
            chunk,
        };
        let sent = match &self.link.writer {
            Some(w) => w.try_send(out).is_ok(),
            None => false,
        };
        if !sent {
            self.session
                .handle_link_lost("the link's send queue overflowed or closed");
            self.session.handle_stream_ended(op);
        }
    }

    /// The peer no longer reads the buffer of `op` (or never will): what its transport
    /// kept for it goes.
    pub(super) fn unexport(&mut self, op: OpId) {
        for part in self.parts.iter_mut() {
            part.released(op);
        }
    }

    /// The peer gave up reading the buffer of `op` (`Cancel`): what its transport kept goes,
    /// as the transport says (reads may still be under way).
    pub(super) fn cancelled_by_peer(&mut self, op: OpId) {
        for part in self.parts.iter_mut() {
            part.cancelled(op);
        }
    }

    /// Queues a submission in the session; the outcome goes to `reply`. A pull's buffer is
    /// made readable for the peer first, by its transport (an export, or a registration on
    /// a blocking thread, while later submissions wait in [`Held`]). A push to a node of this
    /// process over ipc goes as a pull. Only [`Held`] releases submissions here, in order.
    pub(super) fn queue_submit(
        &mut self,
        mut msg: Submit,
        reply: oneshot::Sender<Result<Buffer, SendError>>,
        ctx: &mut Context<Self>,
    ) {
        if let Some(why) = self.session.lost_reason() {
            // Nothing to make readable for a peer that is gone.
            let _ = reply.send(Err(SendError {
                error: Error::PeerLost {
                    peer: self.peer.clone(),
                    detail: why.to_string(),
                },
                buffer: Some(msg.buffer),
            }));
            return;
        }
        let Op::Send {
            transport,
            direction,
            layout,
            ..
        } = &mut msg.op
        else {
            return self.queue_submit_with(msg, None, reply, ctx);
        };
        let layout = layout.clone();
        let transport = *transport;
        let Some(part) = self.parts.get(transport) else {
            return self.queue_submit_with(msg, None, reply, ctx);
        };
        if *direction == WireDirection::Push && part.pulls_pushes() {
            *direction = WireDirection::Pull;
        }
        if *direction == WireDirection::Push {
            return self.queue_submit_with(msg, None, reply, ctx);
        }
        let unreadable = move |e: MoveError| Error::Unsupported {
            detail: format!("{transport} cannot make the buffer readable for the peer: {e}"),
            source: None,
        };
        match part.export(&msg.buffer, &layout) {
            Exporting::Now(Ok(exported)) => self.queue_submit_with(msg, Some(exported), reply, ctx),
            // A transport that cannot make this buffer readable (shared host memory the
            // buffer is not in) passes it to the rule's next transport, where there is one.
            Exporting::Now(Err(e))
                if matches!(
                    &msg.op,
                    Op::Send {
                        fallback: Some(_),
                        ..
                    }
                ) =>
            {
                let why = SetupFailure::Incompatible(format!("the buffer: {e}"));
                self.fall_back(msg, reply, &why, ctx);
            }
            Exporting::Now(Err(e)) => {
                let _ = reply.send(Err(SendError {
                    error: unreadable(e),
                    buffer: Some(msg.buffer),
                }));
            }
            Exporting::Later(exporting) => {
                // The actor goes on meanwhile (pulls, grants, timers); later submissions
                // queue behind this one until it is queued in the session.
                self.outbound.held.exporting = true;
                ctx.spawn(exporting.into_actor(self).map(move |exported, act, ctx| {
                    act.outbound.held.exporting = false;
                    match exported {
                        Ok(exported) => act.queue_submit_with(msg, Some(exported), reply, ctx),
                        Err(e) => {
                            let _ = reply.send(Err(SendError {
                                error: unreadable(e),
                                buffer: Some(msg.buffer),
                            }));
                        }
                    }
                    act.release_held(ctx);
                    // A lost session may have waited for this to end.
                    act.drive(ctx);
                }));
            }
        }
    }

    /// Queues a submission in the session, with what makes its buffer readable for the
    /// peer when it is pulled.
    fn queue_submit_with(
        &mut self,
        msg: Submit,
        exported: Option<Exported>,
        reply: oneshot::Sender<Result<Buffer, SendError>>,
        ctx: &mut Context<Self>,
    ) {
        let now = Instant::now();
        let len = msg.buffer.len() as u64;
        let peer_class = msg.peer_class.label();
        let queued = match msg.op {
            Op::Send {
                tag,
                transport,
                direction,
                fallback: _,
                ref layout,
                fetch,
                packed,
                ref into,
            } => self.queue_send(
                now,
                &msg,
                (tag, transport, direction, layout.clone(), fetch, packed),
                into.clone(),
                exported.as_ref().map(|e| PullSource {
                    transport,
                    descriptor: e.descriptor.clone(),
                }),
                peer_class,
            ),
            Op::Put { key, offset } => {
                let queued = self.session.handle_put(
                    now,
                    PutRequest {
                        len,
                        deadline: msg.deadline,
                    },
                );
                // A put always travels over the link.
                let labels = TransferLabels {
                    transport: registry::LINK,
                    direction: "put",
                    peer_class,
                };
                Ok((queued, StreamWhat::Put { key, offset }, labels, len))
            }
        };
        let (queued, what, labels, moved) = match queued {
            Ok(q) => q,
            Err(error) => {
                self.drop_off_thread(exported);
                let _ = reply.send(Err(SendError {
                    error,
                    buffer: Some(msg.buffer),
                }));
                return;
            }
        };
        let id = match queued {
            Ok(id) => id,
            Err(refusal) => {
                self.drop_off_thread(exported);
                let _ = reply.send(Err(SendError {
                    error: self.refusal_error(refusal),
                    buffer: Some(msg.buffer),
                }));
                return;
            }
        };
        if let Some(exported) = exported {
            // The peer reads it until it says Done or Cancel.
            if let Some(part) = self.parts.get(labels.transport) {
                part.keep(id, exported.kept, &msg.buffer);
            }
        }
        self.track(id, msg.buffer, (what, moved), labels, reply, now);
        self.drive(ctx);
    }

    /// Checks a send and queues it in the session: the session's answer, what streams
    /// and the transfer's labels; or why it cannot go (the buffer goes back).
    fn queue_send(
        &mut self,
        now: Instant,
        msg: &Submit,
        (tag, transport, direction, layout, fetch, packed): (
            u64,
            ferry_config::TransportName,
            WireDirection,
            Layout,
            Option<u64>,
            u64,
        ),
        into: Option<ferry_transports::wire::RegionWrite>,
        pull: Option<PullSource>,
        peer_class: &'static str,
    ) -> Result<
        (
            Result<OpId, crate::core::session::Refusal>,
            StreamWhat,
            TransferLabels,
            u64,
        ),
        Error,
    > {
        // What moves: the layout's rows, packed (checked by the node, which gave the
        // length).
        let len = packed;
        let labels = TransferLabels {
            transport,
            direction: match direction {
                WireDirection::Push => "push",
                WireDirection::Pull => "pull",
            },
            peer_class,
        };
        // What a pull reads: made readable by its transport (`queue_submit`).
        let pull = match (direction, pull) {
            (WireDirection::Pull, Some(source)) => Some(source.descriptor),
            (WireDirection::Pull, None) => {
                return Err(Error::unsupported(format!("{transport} does not pull")));
            }
            (WireDirection::Push, _) => None,
        };
        let queued = self.session.handle_send(
            now,
            SendRequest {
                tag,
                len,
                source: msg.buffer.kind().to_wire(),
                transport,
                direction,
                pull,
                layout: layout.clone(),
                deadline: msg.deadline,
                fetch,
                into,
            },
        );
        tracing::trace!(
            target: crate::TRACE_BLOCKS,
            op = queued.as_ref().ok().map(|op| op.0),
            blocks = crate::block_count(&layout),
            bytes = len,
            queue_us = now.elapsed().as_micros() as u64,
            "offer built"
        );
        Ok((queued, StreamWhat::Transfer(layout), labels, len))
    }

    /// Drops what made a buffer readable on a blocking thread (unmapping a registration
    /// waits for UCX's thread).
    fn drop_off_thread(&self, exported: Option<Exported>) {
        if let Some(kept) = exported.and_then(|e| e.kept) {
            self.setup.io.spawn_blocking(move || drop(kept));
        }
    }

    /// The error a send the session refused ends with.
    fn refusal_error(&self, refusal: crate::core::session::Refusal) -> Error {
        match refusal {
            crate::core::session::Refusal::QueueFull(_) => {
                Error::QueueFull(format!("peer {}: {refusal}", self.peer))
            }
            crate::core::session::Refusal::ShuttingDown => Error::ShuttingDown,
            other => Error::PeerLost {
                peer: self.peer.clone(),
                detail: other.to_string(),
            },
        }
    }

    /// Keeps op `id`'s buffer and reply until it ends, with its spans.
    fn track(
        &mut self,
        id: OpId,
        buffer: Buffer,
        (what, moved): (StreamWhat, u64),
        labels: TransferLabels,
        reply: oneshot::Sender<Result<Buffer, SendError>>,
        now: Instant,
    ) {
        let span = tracing::debug_span!(
            "transfer",
            id = id.0,
            peer = %self.peer,
            transport = %labels.transport,
            direction = labels.direction,
            bytes = buffer.len() as u64,
        );
        // A put needs no grant; it waits for its turn, then streams. A pull waits for the
        // peer's copy.
        let phase = match (&what, labels.direction) {
            (StreamWhat::Put { .. }, _) => tracing::debug_span!(parent: &span, "queued"),
            (_, "pull") => tracing::debug_span!(parent: &span, "pull"),
            _ => tracing::debug_span!(parent: &span, "grant"),
        };
        self.outbound.entries.insert(
            id,
            OutEntry {
                buffer,
                what,
                reply,
                stop: Arc::default(),
                started: now,
                moved,
                labels,
                span,
                phase,
            },
        );
    }

    /// The transport's setup with the peer failed: the submission takes the rule's next
    /// transport, or fails saying why there is none.
    pub(super) fn fall_back(
        &mut self,
        mut msg: Submit,
        reply: oneshot::Sender<Result<Buffer, SendError>>,
        why: &SetupFailure,
        ctx: &mut Context<Self>,
    ) {
        let Op::Send {
            transport,
            direction,
            fallback,
            ..
        } = &mut msg.op
        else {
            return self.queue_submit(msg, reply, ctx);
        };
        let from = *transport;
        match fallback.take() {
            Some((next, next_direction)) => {
                metrics::counter!("ferry_failover_total", "from" => from.as_str(), "to" => next.as_str())
                    .increment(1);
                tracing::debug!(peer = %self.peer, %from, to = %next, "falling back: {why}");
                *transport = next;
                *direction = next_direction;
                self.queue_submit(msg, reply, ctx);
            }
            None => {
                let _ = reply.send(Err(SendError {
                    error: Error::NoRoute(format!(
                        "{from} setup with peer {} failed ({why}) and the rule names no other \
                         transport",
                        self.peer
                    )),
                    buffer: Some(msg.buffer),
                }));
            }
        }
    }
}

/// Submissions not in the session yet, in the order they came. The first may wait for the
/// ipc setup with the peer (its verdict), or for the registration of the send before it
/// (`exporting`); those after it, whatever their transport, wait their turn, so a peer's
/// buffers enter the session, and arrive, in send order. At most the peer's
/// `limits.peer_queue` (each holds one of the node's credits for the peer).
#[derive(Default)]
pub(super) struct Held {
    queue: VecDeque<HeldSubmit>,
    /// A send's buffer is being registered (it left the queue; the next waits for it).
    pub(super) exporting: bool,
}

struct HeldSubmit {
    /// Its ticket with its transport's setup with the peer, while it waits for it.
    ticket: Option<(ferry_config::TransportName, u64)>,
    /// Once known: go (`None`), or fall back (why the setup failed).
    verdict: Option<Option<SetupFailure>>,
    msg: Submit,
    reply: oneshot::Sender<Result<Buffer, SendError>>,
}

impl Held {
    /// `transport`'s setup settled for `ticket`'s send.
    pub(super) fn settled(
        &mut self,
        transport: ferry_config::TransportName,
        ticket: u64,
        failed: Option<SetupFailure>,
    ) {
        let found = (self.queue.iter_mut()).find(|h| h.ticket == Some((transport, ticket)));
        if let Some(h) = found {
            h.verdict = Some(failed);
        }
    }
}

impl TransferActor {
    /// A submission from the node: in the queue behind those before it (a send over ipc
    /// with its ticket for the setup), then everything that may go, goes.
    pub(super) fn hold(
        &mut self,
        msg: Submit,
        reply: oneshot::Sender<Result<Buffer, SendError>>,
        ctx: &mut Context<Self>,
    ) {
        // Its transport's setup with the peer (ipc's pool import) admits it: now, later by
        // ticket, or not (it falls back).
        let admitted = match &msg.op {
            Op::Send { transport, .. } => {
                let transport = *transport;
                (self.parts.get(transport)).map(|p| (transport, p.admit(Instant::now())))
            }
            Op::Put { .. } => None,
        };
        let (ticket, verdict) = match admitted {
            None | Some((_, Admission::Ready)) => (None, Some(None)),
            Some((transport, Admission::Queued(ticket))) => (Some((transport, ticket)), None),
            Some((_, Admission::FallBack(why))) => (None, Some(Some(why))),
        };
        self.outbound.held.queue.push_back(HeldSubmit {
            ticket,
            verdict,
            msg,
            reply,
        });
        self.release_held(ctx);
        if !self.outbound.held.queue.is_empty() {
            // A setup to start or go on with (what was released drove the session already).
            self.drive(ctx);
        }
    }

    /// Queues (or falls back) the held submissions from the oldest, up to the first that
    /// waits (for the setup, or for a registration under way).
    pub(super) fn release_held(&mut self, ctx: &mut Context<Self>) {
        while !self.outbound.held.exporting
            && self
                .outbound
                .held
                .queue
                .front()
                .is_some_and(|h| h.verdict.is_some())
        {
            let Some(HeldSubmit {
                msg,
                reply,
                verdict: Some(failed),
                ..
            }) = self.outbound.held.queue.pop_front()
            else {
                break;
            };
            match failed {
                None => self.queue_submit(msg, reply, ctx),
                Some(why) => self.fall_back(msg, reply, &why, ctx),
            }
        }
    }

    /// The held submissions end with `error`, their buffers given back.
    pub(super) fn fail_held(&mut self, error: impl Fn() -> Error) {
        for h in self.outbound.held.queue.drain(..) {
            let _ = h.reply.send(Err(SendError {
                error: error(),
                buffer: Some(h.msg.buffer),
            }));
        }
    }
}
