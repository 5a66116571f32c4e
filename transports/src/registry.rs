//! The built-in transports, one line each: their declarations and whether each can run
//! here. A new transport is a directory beside `tcp/`, `ipc`, `staged` and one line here.

use ferry_config::TransportName;

use crate::transport::{Capabilities, Viability};

/// The transports this build knows, with their declarations and viability here.
pub fn catalog() -> Vec<(Capabilities, Viability)> {
    vec![
        (crate::tcp::capabilities(), Viability::Viable),
        (crate::ipc::capabilities(), crate::ipc::viability()),
        (crate::staged::capabilities(), Viability::Viable),
        (crate::ucx::capabilities(), crate::ucx::viability()),
    ]
}

/// Names of the transports viable here, as announced in a hello.
pub fn viable_names() -> Vec<TransportName> {
    catalog()
        .into_iter()
        .filter(|(_, v)| *v == Viability::Viable)
        .map(|(c, _)| c.name)
        .collect()
}

/// The declaration of `name` (whether or not it is viable here).
pub fn declared(name: TransportName) -> Capabilities {
    static DECLARED: std::sync::OnceLock<Vec<Capabilities>> = std::sync::OnceLock::new();
    let all = DECLARED.get_or_init(|| catalog().into_iter().map(|(c, _)| c).collect());
    all.iter()
        .find(|c| c.name == name)
        .cloned()
        .unwrap_or_else(crate::tcp::capabilities)
}

/// How `name`'s bytes travel.
pub fn carrier(name: TransportName) -> crate::transport::Carrier {
    declared(name).carrier
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Carrier;
    use crate::wire::WireDirection::{Pull, Push};

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
}
