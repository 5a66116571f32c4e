//! What a transport declares it can do, so routes are chosen from declarations and never
//! by trying and getting "not supported". Names no transport: the built-in ones are listed
//! in [`crate::registry`].

use ferry_config::{Direction, Locality, MemoryClass, TransportName};

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
