//! The tcp transport: host buffers streamed over a control link in chunks.
//!
//! The receiver reserves memory first (the offer/grant exchange), then the sender streams the
//! buffer in chunks of `chunk_size` bytes: each a small [`DataChunk`](crate::wire::DataChunk) frame naming the
//! transfer, offset and length, followed by the bytes themselves as one raw `Payload` frame,
//! written from the sender's buffer as they are. The receiver checks the chunk against the
//! reserved buffer ([`InboundRegion::lend`](crate::region::InboundRegion::lend)) and reads the payload straight into its place
//! ([`Landing::destination`](crate::region::Landing::destination)). A one-sided put streams [`PutChunk`](crate::wire::PutChunk) frames, each followed by
//! its payload, into a region the receiver exposed ([`ExposedRegion::destination`](crate::region::ExposedRegion::destination)). Chunks
//! travel on the same ordered link as control frames, so a transfer's bytes all precede its
//! completion. (The link streams them, and frames their chunk headers:
//! [`crate::link::data_header`], [`crate::link::put_header`].)

use ferry_config::{Direction, Locality, MemoryClass, TransportName};

mod kind;

pub use kind::TcpKind;

use crate::transport::EagerTerms;

mod eager;

use crate::transport::Capabilities;
pub use eager::EagerViolation;

/// What the tcp transport can do.
pub fn capabilities() -> Capabilities {
    Capabilities {
        name: TransportName::Tcp,
        // Device memory is copied to host memory chunk by chunk at the sender; receives
        // land in host memory (the staged transport brings device landing over links).
        sources: &[MemoryClass::Host, MemoryClass::Pinned, MemoryClass::Device],
        memory: &[MemoryClass::Host, MemoryClass::Pinned],
        localities: &[Locality::SameProcess, Locality::SameHost, Locality::Remote],
        directions: &[Direction::Push],
        needs_fd_passing: false,
        one_sided_put: true,
        carrier: crate::transport::Carrier::Link,
        per_peer_setup: false,
        opt_in: false,
        lane: false,
        device_path: crate::transport::DevicePath::HostCopy,
        library: None,
    }
}

/// What a node announces of tcp in its hello: the eager credit it grants its peer. Small
/// tcp pushes of at most `eager_max` bytes may go with their offer, their bytes right
/// behind it, while the eager offers sent and not yet answered (`Done`, a `Grant` or a
/// `Cancel` of the transfer, or the sender's own `Cancel` of it) add up to at most
/// `eager_credit` bytes (its `transport.tcp.eager_max` and `eager_credit`; 0 takes none).
#[derive(
    rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone, Copy, Default, PartialEq, Eq,
)]
#[rkyv(derive(Debug))]
pub struct TcpTerms {
    /// The largest tcp transfer the node takes eagerly.
    pub eager_max: u64,
    /// The bytes of eager offers that may be unanswered at once.
    pub eager_credit: u64,
}

impl TcpTerms {
    /// The transport whose terms they are.
    pub const TRANSPORT: TransportName = TransportName::Tcp;

    /// Its announcement's bytes.
    ///
    /// # Errors
    /// rkyv's (it does not fail for these terms).
    pub fn announce(&self) -> Result<Vec<u8>, crate::transport::DescriptorError> {
        crate::transport::encode(self)
    }

    /// The terms a peer's announcement of tcp holds: none taken eagerly when it says
    /// nothing or what it says is not tcp's terms (an eager offer to it would break the
    /// protocol, so a sender that cannot read them offers none).
    pub fn of(announced: Option<&[u8]>) -> Self {
        announced
            .and_then(|bytes| crate::transport::decode(bytes).ok())
            .unwrap_or_default()
    }
}

/// The tcp transport of one node: the eager credit it grants its peers.
pub struct TcpTransport {
    caps: Capabilities,
    terms: TcpTerms,
}

impl TcpTransport {
    /// The transport, granting `terms` to every peer.
    pub fn new(terms: TcpTerms) -> Self {
        Self {
            caps: capabilities(),
            terms,
        }
    }

    /// The transport `[transport.tcp]` asks for.
    pub fn from_config(config: &ferry_config::Config) -> Self {
        Self::new(TcpTerms {
            eager_max: config.transport.tcp.eager_max,
            eager_credit: config.transport.tcp.eager_credit,
        })
    }
}

impl crate::transport::Transport for TcpTransport {
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn viability(&self) -> crate::transport::Viability {
        crate::transport::Viability::Viable
    }

    fn announce(&self) -> Vec<u8> {
        self.terms.announce().unwrap_or_default()
    }

    fn open(&self, env: crate::transport::PeerEnv) -> Box<dyn crate::transport::PeerTransport> {
        Box::new(TcpPart {
            own: EagerTerms {
                max: self.terms.eager_max,
                credit: self.terms.eager_credit,
            },
            share: env.share,
            peer: None,
            gate: None,
        })
    }
}

/// The tcp part of one peer's session: its bytes stream over the link, which the shell
/// writes and reads; small pushes go eagerly both ways within the credit each hello grants.
struct TcpPart {
    /// What this node takes eagerly (its hello granted the same).
    own: EagerTerms,
    /// The peer's share of this node's memory (`limits.peer_inbound_bytes`).
    share: u64,
    /// What the peer takes eagerly, from its hello.
    peer: Option<EagerTerms>,
    /// The current link's eager credit at this end.
    gate: Option<std::sync::Arc<eager::Gate>>,
}

impl crate::transport::PeerTransport for TcpPart {
    fn transport(&self) -> TransportName {
        TcpTerms::TRANSPORT
    }

    /// What the peer's hello grants (a sender uses no more than its own bounds), and a
    /// fresh credit of ours for the link, before anything is offered on it.
    fn attach(&mut self, link: &crate::transport::Attached<'_>) -> bool {
        let theirs = TcpTerms::of(link.hello.announced(TcpTerms::TRANSPORT));
        let theirs = EagerTerms {
            max: theirs.eager_max,
            credit: theirs.eager_credit,
        };
        self.peer = Some(theirs.bounded(link.hello.max_frame));
        self.gate = Some(std::sync::Arc::new(eager::Gate::new(self.own, self.share)));
        true
    }

    fn peer_eager(&self) -> Option<EagerTerms> {
        self.peer
    }

    fn eager_gate(&self) -> Option<std::sync::Arc<dyn crate::transport::EagerGate>> {
        let gate: std::sync::Arc<dyn crate::transport::EagerGate> = self.gate.clone()?;
        Some(gate)
    }

    fn close(&mut self) -> Vec<(crate::transport::OpId, crate::transport::Retired)> {
        Vec::new()
    }
}
