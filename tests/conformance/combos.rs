//! What the suite runs against: every viable transport of the catalog × every (source
//! memory, destination memory, locality, direction) it declares. Nothing here names a
//! transport: one added to `ferry_transports::registry::catalog()` is enumerated too.

use std::fmt;

use ferry::{Direction, MemoryClass, MemoryKind};
use ferry_config::{Locality, TransportName};
use ferry_transports::registry::catalog;
use ferry_transports::transport::{Capabilities, Viability};

/// One combination the suite runs its checks against.
#[derive(Debug, Clone)]
pub struct Combo {
    /// The transport's declaration, as the catalog gives it.
    pub caps: Capabilities,
    pub src: MemoryClass,
    pub dst: MemoryClass,
    pub locality: Locality,
    pub direction: Direction,
}

impl Combo {
    pub fn transport(&self) -> TransportName {
        self.caps.name
    }

    /// The transport's name as rules and `Received::transport` spell it.
    pub fn name(&self) -> &'static str {
        self.caps.name.as_str()
    }

    pub fn src_kind(&self) -> MemoryKind {
        kind(self.src)
    }

    pub fn dst_kind(&self) -> MemoryKind {
        kind(self.dst)
    }

    /// True when GPU memory is at either end.
    pub fn touches_device(&self) -> bool {
        self.src == MemoryClass::Device || self.dst == MemoryClass::Device
    }

    /// True when the far node's echo can come back over the same transport: the buffer it
    /// sends back is in `dst` memory, which the transport must be able to read.
    pub fn echo_returns_over_it(&self) -> bool {
        self.caps.sources.contains(&self.dst)
    }
}

impl fmt::Display for Combo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}→{} {} {}",
            self.name(),
            self.src.as_str(),
            self.dst.as_str(),
            self.locality.as_str(),
            self.direction.as_str()
        )
    }
}

/// The memory a class stands for here: GPU memory is GPU 0's (both nodes use GPU 0; CUDA
/// IPC works between two processes of one GPU).
pub fn kind(class: MemoryClass) -> MemoryKind {
    match class {
        MemoryClass::Host => MemoryKind::Host,
        MemoryClass::Pinned => MemoryKind::PinnedHost,
        MemoryClass::Device => MemoryKind::Device(0),
    }
}

/// Which combinations a test takes: those in host memory only run everywhere; those with
/// GPU memory at either end run under the GPU gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    Host,
    Device,
}

/// Every combination the catalog declares for a viable transport, in catalog order, and a
/// line for each transport passed over.
pub fn enumerate() -> (Vec<Combo>, Vec<String>) {
    let mut combos = Vec::new();
    let mut passed_over = Vec::new();
    for (caps, viability) in catalog() {
        if let Viability::NotViable(why) = viability {
            passed_over.push(format!("{}: not viable here: {why}", caps.name.as_str()));
            continue;
        }
        if caps.directions.is_empty() {
            passed_over.push(format!("{}: declares no direction", caps.name.as_str()));
        }
        for &src in caps.sources {
            for &dst in caps.memory {
                for &locality in caps.localities {
                    for &direction in caps.directions {
                        combos.push(Combo {
                            caps: caps.clone(),
                            src,
                            dst,
                            locality,
                            direction,
                        });
                    }
                }
            }
        }
    }
    (combos, passed_over)
}

/// The environment variable that narrows the suite to some transports (a comma-separated
/// list of names, e.g. `ucx`), to look at one transport's failures.
pub const ONLY_ENV: &str = "FERRY_CONFORMANCE_ONLY";

/// The combinations of `group` (of the transports [`ONLY_ENV`] names, when set), each with whether it is the first of its transport there
/// (the one that also carries the large cases).
pub fn of_group(group: Group) -> Vec<(Combo, bool)> {
    let (all, _) = enumerate();
    let only = std::env::var(ONLY_ENV).ok();
    let mut seen: Vec<TransportName> = Vec::new();
    all.into_iter()
        .filter(|c| c.touches_device() == (group == Group::Device))
        .filter(|c| {
            only.as_deref()
                .is_none_or(|o| o.split(',').any(|t| t == c.name()))
        })
        .map(|c| {
            let first = !seen.contains(&c.transport());
            if first {
                seen.push(c.transport());
            }
            (c, first)
        })
        .collect()
}
