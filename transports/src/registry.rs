//! The built-in transports, one line each: their declarations and whether each can run
//! here. A new transport is a directory beside `tcp/`, `ipc`, `staged` and one line here.

use ferry_config::{Direction, Locality, MemoryClass, TransportName};

use crate::transport::{Capabilities, Viability};

/// The transports this build knows, with their declarations and viability here.
pub fn catalog() -> Vec<(Capabilities, Viability)> {
    let later = |issue: &str| Viability::NotViable(format!("not built yet ({issue})"));
    vec![
        (crate::tcp::capabilities(), Viability::Viable),
        (crate::ipc::capabilities(), crate::ipc::viability()),
        (crate::staged::capabilities(), Viability::Viable),
        (
            Capabilities {
                name: TransportName::Ucx,
                sources: &[MemoryClass::Host, MemoryClass::Pinned, MemoryClass::Device],
                memory: &[MemoryClass::Host, MemoryClass::Pinned, MemoryClass::Device],
                localities: &[Locality::SameHost, Locality::Remote],
                directions: &[Direction::Push, Direction::Pull],
                needs_fd_passing: false,
                one_sided_put: true,
            },
            later("the ucx transport arrives in a later release"),
        ),
    ]
}

/// Names of the transports viable here, as announced in a hello.
pub fn viable_names() -> Vec<String> {
    catalog()
        .into_iter()
        .filter(|(_, v)| *v == Viability::Viable)
        .map(|(c, _)| c.name.as_str().to_string())
        .collect()
}
