//! What a started node can say live of the route's transport, with the link to the peer
//! up: for a transport built on UCX, the lanes of its UCX endpoint to the peer (which of
//! UCX's own transports reads and writes, and whether one-sided).
//!
//! The one place `ferry explain` still reaches a transport by name: the node answers
//! through `Node::ucx_lanes`, an ask the actors make of the ucx part of the peer's session.
//! The words are the transport's ([`ferry_transports::ucx::lanes_notes`]).

use std::time::Duration;

use ferry::{Explanation, Node};
use ferry_transports::transport::{Library, Note};

/// The live notes of the route `explanation` chose to `peer`, each ask bounded by `limit`;
/// none for a route over a transport with nothing to say live.
pub async fn notes(
    node: &Node,
    peer: &str,
    explanation: &Explanation,
    limit: Duration,
) -> Vec<Note> {
    // A route over a transport built on UCX: its endpoint to the peer can name its lanes.
    let over_ucx = explanation.chosen.as_ref().is_some_and(|r| {
        ferry_transports::registry::declared(r.transport).library == Some(Library::Ucx)
    });
    if !over_ucx {
        return Vec::new();
    }
    let answer = match tokio::time::timeout(limit, node.ucx_lanes(peer)).await {
        Ok(answer) => answer.map_err(|e| e.to_string()),
        Err(_) => Err(format!(
            "no answer within {}",
            humantime::format_duration(limit)
        )),
    };
    ferry_transports::ucx::lanes_notes(peer, &answer)
}
