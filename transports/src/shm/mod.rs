//! The shm transport: host memory between the processes of one host, read in place.
//!
//! A node's host buffers come from its pool ([`pool`]): sealed memfd segments, each mapped
//! `MAP_SHARED` once by the node and once by each same-host peer that reads from it (fetched
//! over the node's fd-sharing socket, [`crate::fdshare`], under a key made of the pool's id,
//! which the hello announces). A pull is one `memcpy` from the sender's mapping into the
//! receiver's buffer; a push one `memcpy` into the buffer the receiver lends. The rules that
//! keep memory from being reused while a peer may read it are ipc's: an exported buffer is
//! kept until the peer says `Done` (or `Cancel`, then for the lease timeout more), and held
//! for `memory.export_lease_timeout` when the session ends. Segments are never shrunk while
//! the pool lives, so no process ever reads past a mapping (no SIGBUS), and a descriptor
//! that names another pool, a segment of another size or a range past its segment is
//! refused with the cause ([`ShmError`]), never served. Host buffers not in the pool (the
//! pool was full, memory wrapped in place) are not exported: the send takes the rule's next
//! transport.
//!
//! Before the first send to a peer, a setup (`setup.rs`) has the peer map the pool's probe:
//! a peer that cannot (another network namespace: no reachable fd-sharing socket) refuses
//! with the cause, and sends go by the rule's next transport for the session. The setup
//! also opens the lane (`lane.rs`): small sends go through a ring both processes map, with
//! no session round trip. Pool ranges no buffer holds go back to the kernel once the host
//! domain was idle for `memory.keep_idle` (a hole punched in the segment, which keeps its
//! size: a peer's mapping stays valid and reads zeroes there).
//!
//! Only [`segment`] uses `unsafe` (the mapping, and bounded copies through it).

use std::sync::OnceLock;

use ferry_config::{Direction, Locality, MemoryClass, TransportName};

use crate::transport::{Capabilities, Viability};

mod imports;
mod kind;
mod lane;
mod peer;
pub mod pool;
pub mod segment;
mod setup;
mod wire;

pub use kind::ShmKind;
pub use peer::ShmTransport;
pub use wire::{ShmSource, ShmTerms, segment_key};

/// Why shm could not read, write or map memory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// The kernel refused a memfd, a seal, its size or the mapping.
    #[error("shared memory: {0}")]
    System(#[from] nix::Error),
    /// Shared memory from the peer that is not what a pool segment must be (unsealed, of
    /// another size than announced).
    #[error("the peer's shared memory: {0}")]
    Invalid(String),
    /// The peer's descriptor names memory that is not in its pool as this node knows it (a
    /// pool it does not announce, a segment of another size): the peer misbehaves.
    #[error("a stale descriptor from the peer: {0}")]
    Stale(String),
    /// The peer's descriptor names a range past the end of its segment: the peer
    /// misbehaves.
    #[error(
        "a descriptor from the peer out of range: {len} bytes at {offset} in a segment of {segment}"
    )]
    OutOfRange {
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: u64,
        /// The segment's length.
        segment: u64,
    },
    /// The peer's segment could not be fetched from its fd-sharing socket.
    #[error(transparent)]
    Fetch(#[from] crate::fdshare::FetchError),
    /// Our buffer cannot be read or written as the transfer needs (not in the pool, the
    /// wrong length, a layout that does not fit).
    #[error("{0}")]
    Buffer(String),
}

/// The shm transport's declaration: host memory of a same-host peer, pulled by default
/// (the receiver copies from the sender's pool) or pushed when a rule asks (the sender
/// copies into the buffer the receiver lends), landing in host memory.
pub fn capabilities() -> Capabilities {
    Capabilities {
        name: TransportName::Shm,
        sources: &[MemoryClass::Host],
        memory: &[MemoryClass::Host],
        localities: &[Locality::SameHost],
        directions: &[Direction::Pull, Direction::Push],
        needs_fd_passing: true,
        one_sided_put: false,
        carrier: crate::transport::Carrier::Memory,
        per_peer_setup: true,
        opt_in: true,
        lane: true,
        device_path: crate::transport::DevicePath::HostCopy,
        library: None,
    }
}

/// Whether shm can run here: the kernel makes sealed memfds. Probed once per process.
pub fn viability() -> Viability {
    static VERDICT: OnceLock<Viability> = OnceLock::new();
    VERDICT
        .get_or_init(|| match segment::Segment::create(4096) {
            Ok(_) => Viability::Viable,
            Err(e) => Viability::NotViable(format!("no sealed shared memory here: {e}")),
        })
        .clone()
}
