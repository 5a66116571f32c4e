//! What a started node can say live of the route's transport, with the link to the peer
//! up: each question its `TransportKind::inspections` lists, asked of the transport's part
//! of the session through [`Node::inspect`], and worded by the transport
//! (`TransportKind::inspected`: ucx names the lanes of its endpoint to the peer).

use std::time::Duration;

use ferry::{Explanation, Node};
use ferry_transports::transport::Note;

/// The live notes of the route `explanation` chose to `peer`, each ask bounded by `limit`;
/// none for a route over a transport with nothing to say live.
pub async fn notes(
    node: &Node,
    peer: &str,
    explanation: &Explanation,
    limit: Duration,
) -> Vec<Note> {
    let Some(chosen) = explanation.chosen.as_ref().map(|r| r.transport) else {
        return Vec::new();
    };
    let Some(kind) = ferry_transports::registry::kind(chosen) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for what in kind.inspections() {
        let answer = match tokio::time::timeout(limit, node.inspect(peer, chosen, what)).await {
            Ok(answer) => answer.map_err(|e| e.to_string()),
            Err(_) => Err(format!(
                "no answer within {}",
                humantime::format_duration(limit)
            )),
        };
        out.extend(kind.inspected(peer, what, answer));
    }
    out
}
