//! What a transport declares it can do, so routes are chosen from declarations and never
//! by trying and getting "not supported". Names no transport: the built-in ones are listed
//! in [`crate::registry`].

use ferry_config::{Direction, Locality, MemoryClass, TransportName};

mod descriptor;
mod eager;
mod env;
mod fast_path;
mod finding;
mod kind;
pub mod lane;
mod node;
mod peer;
pub mod setup;

pub use descriptor::{Announce, Descriptor, DescriptorError, TransportMessage, decode, encode};
pub use eager::{EagerGate, EagerTerms};
pub use env::{Deliveries, ReceiveMemory};
pub use fast_path::{FastPath, FastPathError, FastPathFailure};
pub use finding::{Finding, Status};
pub use kind::{Note, Route, TransportKind};
pub use node::Transport;
pub use peer::{
    Admission, Attached, Exported, Exporting, Lend, LentBuffer, LentMemory, Moving, PartEvent,
    PeerEnv, PeerTransport, Regions, Retired, Streaming, TransportError, Wake,
};

/// Whether the machine has an RDMA device (InfiniBand or RoCE) the kernel lists.
pub fn has_rdma_device() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

/// Identifies an outbound operation (transfer or put) of this node on one link; it is the
/// id carried on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u64);

/// A transport's declared abilities.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// The transport's name, as rules spell it.
    pub name: TransportName,
    /// Memory kinds it can read from at the sending end.
    pub sources: &'static [MemoryClass],
    /// Memory kinds it can land in at the receiving end.
    pub memory: &'static [MemoryClass],
    /// Where the peer may be.
    pub localities: &'static [Locality],
    /// Who may move the bytes, preferred first: a rule's direction is used where the
    /// transport offers it, else the transport's first.
    pub directions: &'static [Direction],
    /// True when it needs file descriptors passed over a Unix socket.
    pub needs_fd_passing: bool,
    /// True when it can write into a region the peer granted without a matching receive.
    pub one_sided_put: bool,
    /// How its bytes travel once the receiver has memory: what a session checks an offer
    /// against (never the transport's name).
    pub carrier: Carrier,
    /// True when it needs a setup with each peer before its first transfer (the lazy setup
    /// machine runs it; routing skips it while that setup has failed).
    pub per_peer_setup: bool,
    /// True when a node serves it only where its configuration turns it on: before a peer's
    /// hello says so, routing assumes the peer lacks it (a receiver that does not serve a
    /// transport refuses the offer, with no fallback).
    pub opt_in: bool,
    /// True when contiguous buffers it pulls from a same-host peer may take a lane of its
    /// own instead (a ring both processes map, with no session round trip), for the sizes
    /// the rules route over it by pull.
    pub lane: bool,
    /// How it moves device memory, which `ferry explain` weighs against the hardware.
    pub device_path: DevicePath,
    /// The run-time library it is built on, which `ferry doctor` checks where a rule names
    /// it; `None`: nothing beyond what every transport uses.
    pub library: Option<Library>,
}

/// How a transport moves device memory between the two nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DevicePath {
    /// Copied to host memory at the sender, then through the socket stack; it lands in host
    /// memory.
    HostCopy,
    /// Through pinned host memory at both ends: a copy out and a copy in, each bounded by
    /// the host<->device link, around a shared ring or the network.
    PinnedStaging,
    /// Between GPUs of one host by their copy engine.
    CopyEngine,
    /// Read out of GPU memory by the NIC (GPUDirect RDMA) where the machine has an RDMA
    /// device; without one, the transport's library stages it through host memory.
    Rdma,
}

/// A run-time library a transport is built on (loaded when the process starts using it,
/// never linked at build time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Library {
    /// The CUDA driver (`libcuda.so.1`).
    Cuda,
    /// UCX (`libucp.so.0`).
    Ucx,
}

/// How a transport's bytes travel between the two nodes once the receiver has memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Carrier {
    /// Streamed over the control link in chunks, pushed by the sender.
    Link,
    /// Through a staging ring shared by the two processes on one host, else over the link
    /// as [`Carrier::Link`]; pushed by the sender.
    Ring,
    /// Straight between the two processes' memory: on a pull the receiver reads the buffer
    /// the offer describes; on a push the sender writes into the buffer the grant lends.
    Memory,
}

impl Carrier {
    /// Whether an offer with `direction`, which describes a source buffer when
    /// `has_source`, is well formed for this carrier.
    pub fn fits(self, direction: crate::wire::WireDirection, has_source: bool) -> bool {
        use crate::wire::WireDirection::{Pull, Push};
        match self {
            Self::Link | Self::Ring => direction == Push && !has_source,
            Self::Memory => match direction {
                Pull => has_source,
                Push => !has_source,
            },
        }
    }

    /// Whether a push over this carrier borrows a buffer the receiver lends in its grant.
    pub fn push_lends(self) -> bool {
        self == Self::Memory
    }
}

/// Whether a transport can run on this machine, and if not, why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Viability {
    /// It can run here.
    Viable,
    /// It cannot; the reason is shown by `ferry explain` and in the log.
    NotViable(String),
}

/// Why a transport was passed over for a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unsuitable {
    /// Not usable on this machine.
    NotViable(String),
    /// The peer did not announce it in its hello.
    PeerLacks,
    /// Cannot reach a peer at this locality.
    Locality(Locality),
    /// Cannot touch this kind of memory.
    Memory(MemoryClass),
    /// Does not support the rule's direction (or declares none at all).
    Direction(Option<Direction>),
    /// Its setup with this peer failed (after its retries); the reason, as the setup
    /// machine states it.
    SetupFailed(String),
}

impl std::fmt::Display for Unsuitable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotViable(why) => write!(f, "not viable on this machine: {why}"),
            Self::PeerLacks => f.write_str("the peer does not offer it"),
            Self::Locality(l) => write!(f, "cannot reach a {l:?} peer"),
            Self::Memory(m) => write!(f, "cannot move {m:?} memory"),
            Self::Direction(Some(d)) => write!(f, "does not support {d:?}"),
            Self::Direction(None) => f.write_str("declares no direction"),
            Self::SetupFailed(why) => write!(f, "setup with the peer failed: {why}"),
        }
    }
}

impl Capabilities {
    /// Checks the declaration against one transfer's needs.
    pub fn suits(
        &self,
        locality: Locality,
        src: MemoryClass,
        dst: MemoryClass,
        direction: Option<Direction>,
    ) -> Result<(), Unsuitable> {
        if !self.localities.contains(&locality) {
            return Err(Unsuitable::Locality(locality));
        }
        if !self.sources.contains(&src) {
            return Err(Unsuitable::Memory(src));
        }
        if !self.memory.contains(&dst) {
            return Err(Unsuitable::Memory(dst));
        }
        self.direction_for(direction)
            .map(|_| ())
            .ok_or(Unsuitable::Direction(direction))
    }

    /// The direction a transfer moves in when a rule asks for `wanted`: `wanted` where the
    /// transport offers it, else (or when the rule names none) its own preferred one; `None`
    /// for a transport that declares no direction.
    pub fn direction_for(&self, wanted: Option<Direction>) -> Option<Direction> {
        match wanted {
            Some(w) if self.directions.contains(&w) => Some(w),
            _ => self.directions.first().copied(),
        }
    }
}
