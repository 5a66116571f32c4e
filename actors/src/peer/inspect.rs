//! Diagnostics a transport's part of the session gives of itself (`ferry explain` asks
//! ucx's part for the lanes of its endpoint, say).

use super::*;

/// Ask one transport's part of this session what it says of `what` (its own word).
#[derive(Debug, Message)]
#[rtype(result = "Result<Box<dyn std::any::Any + Send>, Error>")]
pub struct Inspect {
    /// Which transport's part.
    pub transport: ferry_config::TransportName,
    /// What it is asked.
    pub what: String,
}

impl Handler<Inspect> for TransferActor {
    type Result = ResponseFuture<Result<Box<dyn std::any::Any + Send>, Error>>;

    fn handle(
        &mut self,
        Inspect { transport, what }: Inspect,
        _: &mut Self::Context,
    ) -> Self::Result {
        let peer = self.peer.clone();
        let asked = self.part(transport).and_then(|p| p.inspect(&what));
        let Some(asked) = asked else {
            let refused = Error::unsupported(format!(
                "this node's {transport} part of the session with {peer} says nothing of \
                 {what:?} (or it does not serve {transport})"
            ));
            return Box::pin(std::future::ready(Err(refused)));
        };
        Box::pin(async move {
            asked.await.map_err(|e| Error::Transport {
                peer,
                detail: e.to_string(),
            })
        })
    }
}
