//! One transport as a node serves it, started with the node's settings: what it declares,
//! whether it runs here, what it tells peers in the hello and whether a peer's word is
//! usable, and the part it makes for each peer's session.

use ferry_config::TransportName;

use super::{Capabilities, PeerEnv, PeerTransport, Viability};

/// One transport of a node (the registry starts one per built-in transport).
pub trait Transport: Send + Sync + 'static {
    /// Its declaration.
    fn capabilities(&self) -> &Capabilities;

    /// Its name.
    fn name(&self) -> TransportName {
        self.capabilities().name
    }

    /// Whether it runs on this node, with this node's settings (ucx: its engine started).
    fn viability(&self) -> Viability;

    /// What a peer needs to reach it here, said in the hello (ucx: the worker address;
    /// tcp: the eager credit this node grants); opaque to everything but this transport.
    fn announce(&self) -> Vec<u8> {
        Vec::new()
    }

    /// Whether a peer that announced `theirs` can be served over it (`Err`: why not; a
    /// peer on another UCX release, say). Only asked of a transport both ends serve.
    ///
    /// # Errors
    /// Why the peer cannot be served over it.
    fn usable_with(&self, _theirs: &[u8]) -> Result<(), String> {
        Ok(())
    }

    /// Its part of one peer's session.
    fn open(&self, env: PeerEnv) -> Box<dyn PeerTransport>;

    /// Host memory it makes shareable, which the node's host domain grants from before the
    /// heap (so the buffers it moves are its own); `None` for a transport that moves any
    /// memory as it is. The node takes the first a transport offers.
    fn host_memory(&self) -> Option<std::sync::Arc<dyn crate::memory::HostSource>> {
        None
    }
}
