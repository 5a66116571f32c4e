//! Keys that moved: a configuration may still set one under its old name for one release.
//! Loading moves the value to the new key, remembers where the old name was set (a
//! [`DeprecatedKey`], which `ferry config check` prints and a starting node logs), and
//! refuses a configuration that sets both names.

use std::fmt;

use crate::error::{At, ConfigError, KeyOrigin};
use crate::provenance::Provenance;
use crate::schema::Config;

/// `transport.ipc.recv_spin` drives every `recv()`, not only ipc's: since 2026-12-01 it is
/// `node.recv_spin`.
const RECV_SPIN: Renamed = Renamed {
    old: "transport.ipc.recv_spin",
    new: "node.recv_spin",
};

/// A key's old and new name.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Renamed {
    pub(crate) old: &'static str,
    pub(crate) new: &'static str,
}

/// A key a configuration set under its old name: where, and the name it has now.
///
/// `Display` reads `config file a.toml, line 5: key transport.ipc.recv_spin is deprecated:
/// write node.recv_spin (the old name is read for one release only)`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeprecatedKey {
    /// The old name (`transport.ipc.recv_spin`) and the layer and line that set it.
    pub old: KeyOrigin,
    /// The key's name now (`node.recv_spin`), which took the value.
    pub new: &'static str,
}

impl fmt::Display for DeprecatedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: key {} is deprecated: write {} (the old name is read for one release only)",
            At(&self.old.origin, self.old.line),
            self.old.key,
            self.new
        )
    }
}

impl Config {
    /// The keys this configuration set under an old name, with where each was set, in the
    /// order they were found; empty for a configuration built in code. Pure.
    pub fn deprecated_keys(&self) -> &[DeprecatedKey] {
        self.provenance.deprecated()
    }

    /// Moves each value set under an old name to its new key, and notes it in `provenance`.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] about the old name when a layer sets the new one too (in
    /// the same layer or another: which one was meant is a guess), naming both.
    pub(crate) fn move_renamed(&mut self, provenance: &mut Provenance) -> Result<(), ConfigError> {
        if let Some(spin) = self.transport.ipc.recv_spin.take() {
            provenance.rename(RECV_SPIN)?;
            self.node.recv_spin = spin;
        }
        Ok(())
    }
}
