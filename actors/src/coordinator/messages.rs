//! What the coordinator is asked: the messages it handles (sends, puts, fetches, route
//! explanations, inspections, connects, shutdown), and the hand-overs of sends and puts on
//! the channel it reads.

use std::time::Instant;

use actix::prelude::*;
use ferry_config::MemoryClass;
use ferry_transports::link::{Endpoint, Link};
use ferry_transports::memory::Buffer;
use ferry_transports::region::RegionKey;

use crate::core::route::Explanation;
use crate::error::{Error, SendError};

/// Send `buffer` to `peer` under `tag`.
#[derive(Debug, Message)]
#[rtype(result = "Result<Buffer, SendError>")]
pub struct SendTo {
    /// Peer name.
    pub peer: String,
    /// Application tag.
    pub tag: u64,
    /// The data.
    pub buffer: Buffer,
    /// How the bytes to send lie in it (checked against it already).
    pub layout: ferry_transports::wire::Layout,
    /// The layout's packed length in the buffer (what [`Layout::check`] returned):
    /// the bytes that move.
    ///
    /// [`Layout::check`]: ferry_transports::wire::Layout::check
    pub packed: u64,
    /// When it must have ended.
    pub deadline: Instant,
    /// For the answer to the peer's fetch: its id (the peer hands the bytes to that fetch,
    /// not to `recv`).
    pub fetch: Option<u64>,
    /// For a one-sided write: the peer's region and places the bytes go into.
    pub into: Option<ferry_transports::wire::RegionWrite>,
}

/// A send or put the node hands the coordinator to route (before the peer's link is up, or
/// while an earlier one to the peer is still with it).
#[derive(Debug)]
pub enum Handed {
    /// A send.
    Send(SendTo),
    /// A one-sided put.
    Put(PutTo),
}

/// A [`Handed`] message with where its outcome goes, on the channel the coordinator reads
/// (never an actix request, which actix drops unhandled once its caller stops waiting).
#[derive(Debug)]
pub struct Handover {
    /// What to route.
    pub what: Handed,
    /// Where its outcome goes.
    pub reply: tokio::sync::oneshot::Sender<Result<Buffer, SendError>>,
    /// Held until its outcome: while a message to the peer is with the coordinator, the
    /// peer's later sends come this way too (they could pass it otherwise).
    pub unanswered: Option<crate::order::ViaCoordinator>,
}

/// The sending end of the coordinator's hand-overs: bounded by the node's credits.
pub type Handovers = futures::channel::mpsc::Sender<Handover>;

/// Hands `what` to the coordinator behind `handovers` (waiting for room); resolves once it
/// is in the channel, with the future of its outcome, which comes whether or not that
/// future is polled.
pub async fn hand_over(
    handovers: &Handovers,
    what: Handed,
    unanswered: Option<crate::order::ViaCoordinator>,
) -> futures::future::BoxFuture<'static, Result<Buffer, SendError>> {
    let stopped = |buffer| SendError {
        error: Error::ShuttingDown,
        buffer,
    };
    let (reply, outcome) = tokio::sync::oneshot::channel();
    let mut tx = handovers.clone();
    let buffer_of = |h: Handover| match h.what {
        Handed::Send(m) => m.buffer,
        Handed::Put(m) => m.buffer,
    };
    let handover = Handover {
        what,
        reply,
        unanswered,
    };
    if futures::future::poll_fn(|cx| tx.poll_ready(cx))
        .await
        .is_err()
    {
        let failed = Err(stopped(Some(buffer_of(handover))));
        return Box::pin(std::future::ready(failed));
    }
    if let Err(e) = tx.try_send(handover) {
        let failed = Err(stopped(Some(buffer_of(e.into_inner()))));
        return Box::pin(std::future::ready(failed));
    }
    Box::pin(async move { outcome.await.unwrap_or_else(|_| Err(stopped(None))) })
}

/// Fetch what `peer` published under `key` (one flight's request: single flight is the
/// node's, see [`crate::fetch`]).
#[derive(Debug, Message)]
#[rtype(result = "Result<crate::fetch::Landed, Error>")]
pub struct FetchFrom {
    /// Peer name.
    pub peer: String,
    /// The key.
    pub key: String,
    /// Which bytes of it.
    pub layout: ferry_transports::wire::Layout,
    /// When it must have ended.
    pub deadline: Instant,
}

/// Write `buffer` at `offset` into the region `key` that `peer` exposed.
#[derive(Debug, Message)]
#[rtype(result = "Result<Buffer, SendError>")]
pub struct PutTo {
    /// Peer name.
    pub peer: String,
    /// The region.
    pub key: RegionKey,
    /// Where in the region.
    pub offset: u64,
    /// The data.
    pub buffer: Buffer,
    /// When it must have ended.
    pub deadline: Instant,
}

/// Explain the route a transfer to `peer` would take.
#[derive(Debug, Message)]
#[rtype(result = "Result<Explanation, Error>")]
pub struct Explain {
    /// Peer name.
    pub peer: String,
    /// Bytes.
    pub bytes: u64,
    /// Memory at this end.
    pub src: MemoryClass,
    /// Memory at the peer's end, for a what-if question; `None`: what the peer receives
    /// into, as a send is routed (see [`route::destination`]).
    ///
    /// [`route::destination`]: crate::core::route::destination
    pub dst: Option<MemoryClass>,
}

/// What one transport's part of the session with `peer` says of itself for a diagnostic
/// (see [`crate::peer::Inspect`]).
#[derive(Debug, Message)]
#[rtype(result = "Result<Box<dyn std::any::Any + Send>, Error>")]
pub struct InspectPeer {
    /// Peer name.
    pub peer: String,
    /// Which transport's part.
    pub transport: ferry_config::TransportName,
    /// What it is asked (the transport's own word: ucx's `"lanes"`).
    pub what: String,
}

/// A link finished its handshake.
#[derive(Message)]
#[rtype(result = "()")]
pub struct LinkUp {
    /// The link.
    pub link: Link,
    /// What it was dialed for, or `None` when it was accepted.
    pub dialed: Option<Dialed>,
}

/// What a link this node dialed was dialed for.
#[derive(Debug, Clone)]
pub struct Dialed {
    /// The epoch of the session that dialed it.
    pub epoch: u64,
    /// The peer it was dialed for; the node that answered may be another.
    pub peer: String,
    /// Where it was dialed.
    pub endpoint: Endpoint,
}

/// Refuse new work, let every transfer end, close the links.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Shutdown;

/// Connect to `peer` now (if not connected) and wait until the link is up.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), Error>")]
pub struct Connect {
    /// Peer name.
    pub peer: String,
}

/// Names of the peers with a live session.
#[derive(Debug, Message)]
#[rtype(result = "Vec<String>")]
pub struct ConnectedPeers;
