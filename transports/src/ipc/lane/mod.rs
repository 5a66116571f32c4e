//! The same-host lane: device-memory sends to a peer process of this host, without a socket
//! or an actor hop. It is how ipc pulls contiguous device buffers, of every size.
//!
//! The socket path of an ipc send crosses eight thread hand-offs (caller → actor → I/O
//! thread → socket → the peer's I/O thread → its actor, and back for `Done`) and waits for a
//! device allocation through the domain's actor: about 110 µs per round trip on the H200,
//! 150 µs on the H100. The lane replaces that, for contiguous device buffers the routing
//! rules send over ipc by pull (and of at most `transport.ipc.lane_max` bytes), once the ipc
//! setup with the peer is done, with:
//!
//! - a ring of slots in shared memory ([`Ring`](crate::link::ring::Ring)), one
//!   per direction, made by the sender during the ipc setup and fetched by the receiver
//!   from the sender's fd-sharing socket;
//! - on the sender ([`crate::transport::lane::LaneTx`], with this module's
//!   [`DeviceRecords`]), the caller's own task exports the buffer and writes a
//!   [`LaneRecord`] into the next slot; a watcher
//!   thread sees the receiver finish it and completes the send (the receiver's outcome, or
//!   its reason, comes back in the slot);
//! - on the receiver (`rx.rs`), an issuing thread polls the ring and queues each buffer's
//!   copy (a batch's small ones as one gather), and a delivering thread waits for each copy
//!   and delivers the buffer to the inbox itself, in order, while the next batch is queued. A buffer of at most 64 KiB lands in
//!   memory allocated ahead (after the first such record, 4 buffers of 64 KiB from the
//!   receive tiers, topped up while the lane is idle); a larger one is reserved on the lane
//!   thread ([`ReceiveMemory::now`](crate::transport::ReceiveMemory::now): no actor,
//!   the device allocation made there), or, when no tier can grant it now, waits for
//!   memory like any receive. What the lane delivered and the application did not take
//!   yet counts against the peer's share (`limits.peer_inbound_bytes`): past it, the lane
//!   waits.
//!
//! The threads spin for `transport.ipc.lane_spin` after the last record, then park (on a
//! futex in the ring, or the delivering thread on its channel): a busy lane makes no system
//! call, an idle one costs nothing.
//!
//! **Order** (the node's, outside the transport). A peer's buffers are delivered in send
//! order whichever path carries them: the node lets a lane send start only while nothing
//! to that peer goes the slow way, and makes a slow send wait until the lane sends before
//! it completed (a lane send completes once the buffer is in the receiver's inbox; the
//! send's `turn` is held until then). On the receiver, a lane record is delivered only once
//! every slow transfer from that peer that completed before it was delivered too
//! ([`crate::transport::Deliveries::deliver_in_order`]).
//!
//! **Failure.** A sender whose deadline passes gets `DeadlineExceeded` and no buffer: the
//! receiver may still read it, so the watcher keeps it until the record is finished or the
//! lane closes (then it is freed; the peer unmaps it first, like any exported buffer).
//! When either side's session ends the ring is closed; sends not yet finished by the
//! receiver fail with `PeerLost` and get their buffer back.

mod rx;

use std::sync::Arc;
use std::time::Duration;

use ferry_config::MemoryClass;

pub use rx::{AHEAD_LEN, LaneRx, RxContext};

use crate::ipc::LaneRecord;
use crate::memory::{Buffer, MemoryKind, Unmapper};
use crate::transport::lane::LaneWriter;

/// Records in flight per lane.
pub const LANE_SLOTS: u32 = 64;
/// Bytes per slot: a record (an export and a lease, about 200 bytes) or a reason.
pub const LANE_SLOT_LEN: u32 = 512;

/// The lane's settings (`transport.ipc.lane_max`, `transport.ipc.lane_spin`).
#[derive(Debug, Clone, Copy)]
pub struct LaneSettings {
    /// Largest send this node puts on the lane; 0 turns the lane off. (A receiver takes
    /// records of any size.)
    pub max: usize,
    /// How long a lane thread spins for the next record before it parks.
    pub spin: Duration,
    /// Largest record the receiver copies with the gather kernel (a batch's records in one
    /// launch per stream); 0: every copy by the copy engine.
    pub gather_max: usize,
}

/// The records of ipc's lane: contiguous device buffers of at most `transport.ipc.lane_max`
/// bytes, exported; the peer maps each from its record on (`unmapper` is told).
pub struct DeviceRecords {
    /// Largest buffer put on the lane.
    pub max: usize,
    /// Told of each buffer the peer may keep mapped.
    pub unmapper: Arc<dyn Unmapper>,
}

impl LaneWriter for DeviceRecords {
    fn transport(&self) -> ferry_config::TransportName {
        crate::ipc::IpcSource::TRANSPORT
    }

    fn memory(&self) -> MemoryClass {
        MemoryClass::Device
    }

    fn fits(&self, buffer: &Buffer) -> bool {
        matches!(buffer.kind(), MemoryKind::Device(_)) && buffer.len() <= self.max
    }

    fn record(&self, tag: u64, buffer: &Buffer) -> Result<Vec<u8>, String> {
        let source = crate::ipc::export_source(buffer, false).map_err(|e| e.to_string())?;
        let record = LaneRecord {
            tag,
            len: buffer.len() as u64,
            source,
        };
        record.encode().map_err(|e| e.to_string())
    }

    fn published(&self, buffer: &Buffer) {
        buffer.note_mapped(Arc::clone(&self.unmapper));
    }
}
