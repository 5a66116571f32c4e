//! ipc as the registry lists it: its declaration and whether the CUDA driver lets it run.
//! What it needs of the driver (peer access, exportable pools) is the CUDA layer's to check,
//! which `ferry doctor` does whether or not a rule names ipc.

use crate::transport::{Capabilities, TransportKind, Viability};

/// The ipc transport before any node starts it.
#[derive(Debug, Clone, Copy, Default)]
pub struct IpcKind;

impl TransportKind for IpcKind {
    fn describe_metrics(&self) {
        metrics::describe_counter!(
            "ferry_ipc_setup_total",
            "Lazy ipc setups with a peer that ended, by outcome (ok, bad)"
        );
        for outcome in ["ok", "bad"] {
            metrics::counter!("ferry_ipc_setup_total", "outcome" => outcome).absolute(0);
        }
    }

    fn capabilities(&self) -> Capabilities {
        super::capabilities()
    }

    fn viability(&self) -> Viability {
        super::viability()
    }
}
