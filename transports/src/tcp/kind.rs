//! tcp as the registry lists it: its declaration, and viable wherever sockets are. It is
//! built on nothing `ferry doctor` would check and has nothing of its own to note.

use crate::transport::{Capabilities, TransportKind, Viability};

/// The tcp transport before any node starts it.
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpKind;

impl TransportKind for TcpKind {
    fn describe_metrics(&self) {
        metrics::describe_counter!(
            "ferry_eager_read_past_total",
            "Eager tcp offers whose bytes were read past (no room or memory at once): granted later and sent again"
        );
        metrics::counter!("ferry_eager_read_past_total").absolute(0);
    }

    fn capabilities(&self) -> Capabilities {
        super::capabilities()
    }

    fn viability(&self) -> Viability {
        Viability::Viable
    }
}
