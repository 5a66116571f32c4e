//! The built-in transports, one line each in [`kinds`]: their declarations, whether each
//! can run here, and what the tools say of them. A new transport is a directory beside
//! `tcp/`, `ipc/`, `staged/`, `ucx/` and `shm/` and one line here.

use ferry_config::TransportName;

use crate::transport::{Capabilities, Carrier, DevicePath, TransportKind, Viability};

/// The transport whose bytes travel on the control link itself, in its frames: what a put
/// (which always streams over the link) is counted under.
pub const LINK: TransportName = TransportName::Tcp;

/// The transports this build knows, before any node starts them, in the order routing
/// and the tools list them.
pub fn kinds() -> &'static [&'static dyn TransportKind] {
    static KINDS: [&dyn TransportKind; 5] = [
        &crate::tcp::TcpKind,
        &crate::ipc::IpcKind,
        &crate::staged::StagedKind,
        &crate::ucx::UcxKind,
        &crate::shm::ShmKind,
    ];
    &KINDS
}

/// The transport named `name`, if this build has it.
pub fn kind(name: TransportName) -> Option<&'static dyn TransportKind> {
    kinds()
        .iter()
        .zip(declarations())
        .find(|(_, c)| c.name == name)
        .map(|(k, _)| *k)
}

/// The transports this build knows, with their declarations and viability here.
pub fn catalog() -> Vec<(Capabilities, Viability)> {
    kinds()
        .iter()
        .map(|k| (k.capabilities(), k.viability()))
        .collect()
}

/// Names of the transports viable here, as announced in a hello.
pub fn viable_names() -> Vec<TransportName> {
    catalog()
        .into_iter()
        .filter(|(_, v)| *v == Viability::Viable)
        .map(|(c, _)| c.name)
        .collect()
}

/// Every transport's declaration, in the catalog's order (whether or not it is viable
/// here); made once per process.
pub fn declarations() -> &'static [Capabilities] {
    static DECLARED: std::sync::OnceLock<Vec<Capabilities>> = std::sync::OnceLock::new();
    DECLARED.get_or_init(|| kinds().iter().map(|k| k.capabilities()).collect())
}

/// The declaration of `name` (whether or not it is viable here).
pub fn declared(name: TransportName) -> Capabilities {
    declarations()
        .iter()
        .find(|c| c.name == name)
        .cloned()
        .unwrap_or_else(crate::tcp::capabilities)
}

/// The first transport that declares it moves device memory by `path` (to name the way
/// around a slower path), if any does.
pub fn taking(path: DevicePath) -> Option<TransportName> {
    declarations()
        .iter()
        .find(|c| c.device_path == path)
        .map(|c| c.name)
}

/// How `name`'s bytes travel.
pub fn carrier(name: TransportName) -> Carrier {
    declared(name).carrier
}

/// The built-in transports as one node serves them, started with its `config` (a GPU's
/// primary context, `gpu`, for the ones that work in one), one line each, in the catalog's
/// order.
pub fn start(
    config: &ferry_config::Config,
    gpu: Option<&crate::cuda::Device>,
) -> Vec<std::sync::Arc<dyn crate::transport::Transport>> {
    vec![
        std::sync::Arc::new(crate::tcp::TcpTransport::from_config(config)),
        std::sync::Arc::new(crate::ipc::IpcTransport::from_config(config)),
        std::sync::Arc::new(crate::staged::StagedTransport::from_config(config)),
        std::sync::Arc::new(crate::ucx::UcxTransport::start(config, gpu)),
        std::sync::Arc::new(crate::shm::ShmTransport::from_config(config)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::WireDirection::{Pull, Push};
    use ferry_config::{Direction, Locality, MemoryClass};

    #[test]
    fn every_name_is_declared_once_and_travels_as_itself() {
        for name in TransportName::NAMES {
            let name: TransportName = name.parse().expect("a name");
            let found: Vec<_> = catalog()
                .into_iter()
                .filter(|(c, _)| c.name == name)
                .collect();
            assert_eq!(found.len(), 1, "{name}");
            assert_eq!(declared(name).name, name);
            assert_eq!(kind(name).map(|k| k.capabilities().name), Some(name));
            let wire = crate::wire::WireTransport::from(name);
            assert_eq!(TransportName::from(wire), name);
        }
    }

    #[test]
    fn carriers_say_which_offers_are_well_formed() {
        assert!(Carrier::Link.fits(Push, false));
        assert!(!Carrier::Link.fits(Push, true));
        assert!(!Carrier::Ring.fits(Pull, true));
        assert!(Carrier::Memory.fits(Pull, true));
        assert!(!Carrier::Memory.fits(Pull, false));
        assert!(Carrier::Memory.fits(Push, false));
        assert!(Carrier::Memory.push_lends() && !Carrier::Link.push_lends());
        assert_eq!(carrier(TransportName::Tcp), Carrier::Link);
        assert_eq!(carrier(TransportName::Staged), Carrier::Ring);
        assert_eq!(carrier(TransportName::Ipc), Carrier::Memory);
    }

    #[test]
    fn the_link_transport_travels_on_the_link() {
        assert_eq!(carrier(LINK), Carrier::Link);
        assert_eq!(declared(LINK).device_path, DevicePath::HostCopy);
        assert_eq!(taking(DevicePath::HostCopy), Some(LINK));
        assert_eq!(taking(DevicePath::CopyEngine), Some(TransportName::Ipc));
    }

    /// The declarations that node-level code acts on without naming a transport agree with
    /// the rest of each declaration.
    #[test]
    fn every_declaration_is_consistent() {
        for c in declarations() {
            let name = c.name;
            if c.lane {
                // A lane is a ring both processes of one host map; it carries pulls of the
                // transport's own memory straight between their buffers.
                assert_eq!(c.localities, &[Locality::SameHost], "{name}");
                assert_eq!(c.carrier, Carrier::Memory, "{name}");
                assert!(c.directions.contains(&Direction::Pull), "{name}");
                assert!(!c.sources.is_empty(), "{name}");
            }
            match c.device_path {
                DevicePath::HostCopy => {
                    assert!(!c.memory.contains(&MemoryClass::Device), "{name}")
                }
                DevicePath::CopyEngine => {
                    assert!(!c.localities.contains(&Locality::Remote), "{name}");
                    assert_eq!(c.carrier, Carrier::Memory, "{name}");
                }
                DevicePath::PinnedStaging => assert_eq!(c.carrier, Carrier::Ring, "{name}"),
                DevicePath::Rdma => assert!(c.localities.contains(&Locality::Remote), "{name}"),
            }
        }
        // A peer may have a lane per transport that declares one (each delivers under its
        // own transport's name, and says which memory it carries: `FastPath::memory`).
    }
}
