//! Errors: [`LoadError`] when UCX cannot be loaded (or is too old), [`UcxError`] for
//! everything after, with UCX's own status code kept in [`Status`].

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::sys::{self, ucs_status_t};

/// Where the library that was (or was to be) loaded came from. The first of these that is
/// set is the one used; see [`crate::sys::Library::load`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LibrarySource {
    /// A path the caller passed (ferry passes its `transport.ucx.library` setting).
    Configured,
    /// The `FERRY_UCX_LIBRARY` environment variable.
    Environment,
    /// The dynamic linker's search for `libucp.so.0` (the system's UCX).
    System,
}

impl fmt::Display for LibrarySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LibrarySource::Configured => "the configured path (transport.ucx.library)",
            LibrarySource::Environment => "the environment variable FERRY_UCX_LIBRARY",
            LibrarySource::System => "the system's library search (no path configured)",
        })
    }
}

/// A library to load: its path (or the bare soname for the system search) and where that
/// came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LibraryLocation {
    /// Where the path came from.
    pub source: LibrarySource,
    /// What was passed to `dlopen`: a path, or `libucp.so.0` for the system search.
    pub path: PathBuf,
}

impl fmt::Display for LibraryLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` (from {})", self.path.display(), self.source)
    }
}

/// A UCX release, as `ucp_get_version` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Release number.
    pub release: u32,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.release)
    }
}

/// Why UCX could not be loaded. Nothing here is fatal to the process: ferry reports it and
/// runs without the ucx transport.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// `dlopen` failed: no such file, not a shared library, or a dependency missing.
    #[error(
        "could not load UCX from {location}: {reason}. Install UCX 1.13 or later \
         (Debian/Ubuntu: libucx0) or point transport.ucx.library or FERRY_UCX_LIBRARY \
         at its libucp.so"
    )]
    Open {
        /// What was tried.
        location: LibraryLocation,
        /// The dynamic linker's message.
        reason: String,
    },
    /// The library loaded but lacks an entry point ferry needs: not a libucp, or a UCX
    /// build without it.
    #[error("{location} is not a usable UCX libucp: symbol `{symbol}` is missing ({reason})")]
    MissingSymbol {
        /// What was loaded.
        location: LibraryLocation,
        /// The first missing symbol.
        symbol: &'static str,
        /// The dynamic linker's message.
        reason: String,
    },
    /// The library is a UCX older than the API this crate binds.
    #[error("UCX {found} loaded from {location} is too old: ferry needs UCX {required} or later")]
    TooOld {
        /// What was loaded.
        location: LibraryLocation,
        /// The version it reported.
        found: Version,
        /// The oldest accepted version.
        required: Version,
    },
}

impl LoadError {
    /// The release the library reported (`ucp_get_version`), where that is why it was
    /// refused (a UCX too old).
    pub fn release(&self) -> Option<Version> {
        match self {
            LoadError::TooOld { found, .. } => Some(*found),
            LoadError::Open { .. } | LoadError::MissingSymbol { .. } => None,
        }
    }

    /// What was tried (or loaded).
    pub fn location(&self) -> &LibraryLocation {
        match self {
            LoadError::Open { location, .. }
            | LoadError::MissingSymbol { location, .. }
            | LoadError::TooOld { location, .. } => location,
        }
    }
}

/// A `ucs_status_t` error code with UCX's text for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    code: ucs_status_t,
    message: String,
}

impl Status {
    /// `code` with `message` (from `ucs_status_string`, or this crate's own table).
    pub fn new(code: ucs_status_t, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// The raw `ucs_status_t`.
    pub fn code(&self) -> ucs_status_t {
        self.code
    }

    /// UCX's description of the code.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The C name of the code (`UCS_ERR_CONNECTION_RESET`), or `UCS_ERR_<n>` for codes
    /// this crate does not know.
    pub fn name(&self) -> std::borrow::Cow<'static, str> {
        match status_name(self.code) {
            Some(n) => n.into(),
            None => format!("UCS_ERR_{}", self.code).into(),
        }
    }

    /// Whether the code says the remote side is gone or unreachable (what error mode PEER
    /// reports when a peer dies): connection reset, unreachable, timeouts, and UCX's link
    /// and endpoint failure ranges.
    pub fn is_peer_failure(&self) -> bool {
        matches!(
            self.code,
            sys::UCS_ERR_CONNECTION_RESET
                | sys::UCS_ERR_UNREACHABLE
                | sys::UCS_ERR_NOT_CONNECTED
                | sys::UCS_ERR_TIMED_OUT
        ) || (sys::UCS_ERR_LAST_ENDPOINT_FAILURE..=sys::UCS_ERR_FIRST_LINK_FAILURE)
            .contains(&self.code)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}: {})", self.name(), self.code, self.message)
    }
}

/// An error from a UCP call or from using this crate's API.
///
/// `Clone`, so one endpoint failure can fail many pending operations.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum UcxError {
    /// UCX could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A UCP call returned an error status (a transport failure, or, where
    /// [`Status::is_peer_failure`], the peer's).
    #[error("{call} failed: {status}")]
    Call {
        /// The C function.
        call: &'static str,
        /// What it returned.
        status: Status,
    },
    /// The loaded UCX lacks an optional entry point.
    #[error("{call} is not available in the loaded UCX")]
    Unavailable {
        /// The C function.
        call: &'static str,
    },
    /// The loaded UCX is older than the release that added what was asked for; UCX was not
    /// called (an older release may accept the call and ignore the request).
    #[error("{what} needs UCX {since} or later; the loaded UCX is {found}")]
    NotInRelease {
        /// What was asked for (the C call and field).
        what: &'static str,
        /// The first release that has it.
        since: Version,
        /// The loaded release.
        found: Version,
    },
    /// The caller used the API wrongly (a bad argument, a range outside a buffer); UCX was
    /// not called.
    #[error("{0}")]
    Misuse(String),
    /// Waiting for an operation ran past its deadline; the operation is still pending.
    #[error("{what} did not complete within {after:?}")]
    TimedOut {
        /// The operation.
        what: &'static str,
        /// How long was waited.
        after: Duration,
    },
}

impl UcxError {
    /// The UCX status code, where UCX returned one.
    pub fn status(&self) -> Option<&Status> {
        match self {
            UcxError::Call { status, .. } => Some(status),
            _ => None,
        }
    }

    /// Whether the error says the peer is gone ([`Status::is_peer_failure`]).
    pub fn is_peer_failure(&self) -> bool {
        self.status().is_some_and(Status::is_peer_failure)
    }

    /// Whether the operation was cancelled (`UCS_ERR_CANCELED`).
    pub fn is_canceled(&self) -> bool {
        self.status()
            .is_some_and(|s| s.code() == sys::UCS_ERR_CANCELED)
    }
}

/// The C name of a status code this crate knows.
pub(crate) fn status_name(code: ucs_status_t) -> Option<&'static str> {
    use sys::*;
    Some(match code {
        UCS_OK => "UCS_OK",
        UCS_INPROGRESS => "UCS_INPROGRESS",
        UCS_ERR_NO_MESSAGE => "UCS_ERR_NO_MESSAGE",
        UCS_ERR_NO_RESOURCE => "UCS_ERR_NO_RESOURCE",
        UCS_ERR_IO_ERROR => "UCS_ERR_IO_ERROR",
        UCS_ERR_NO_MEMORY => "UCS_ERR_NO_MEMORY",
        UCS_ERR_INVALID_PARAM => "UCS_ERR_INVALID_PARAM",
        UCS_ERR_UNREACHABLE => "UCS_ERR_UNREACHABLE",
        UCS_ERR_INVALID_ADDR => "UCS_ERR_INVALID_ADDR",
        UCS_ERR_NOT_IMPLEMENTED => "UCS_ERR_NOT_IMPLEMENTED",
        UCS_ERR_MESSAGE_TRUNCATED => "UCS_ERR_MESSAGE_TRUNCATED",
        UCS_ERR_NO_PROGRESS => "UCS_ERR_NO_PROGRESS",
        UCS_ERR_BUFFER_TOO_SMALL => "UCS_ERR_BUFFER_TOO_SMALL",
        UCS_ERR_NO_ELEM => "UCS_ERR_NO_ELEM",
        UCS_ERR_SOME_CONNECTS_FAILED => "UCS_ERR_SOME_CONNECTS_FAILED",
        UCS_ERR_NO_DEVICE => "UCS_ERR_NO_DEVICE",
        UCS_ERR_BUSY => "UCS_ERR_BUSY",
        UCS_ERR_CANCELED => "UCS_ERR_CANCELED",
        UCS_ERR_SHMEM_SEGMENT => "UCS_ERR_SHMEM_SEGMENT",
        UCS_ERR_ALREADY_EXISTS => "UCS_ERR_ALREADY_EXISTS",
        UCS_ERR_OUT_OF_RANGE => "UCS_ERR_OUT_OF_RANGE",
        UCS_ERR_TIMED_OUT => "UCS_ERR_TIMED_OUT",
        UCS_ERR_EXCEEDS_LIMIT => "UCS_ERR_EXCEEDS_LIMIT",
        UCS_ERR_UNSUPPORTED => "UCS_ERR_UNSUPPORTED",
        UCS_ERR_REJECTED => "UCS_ERR_REJECTED",
        UCS_ERR_NOT_CONNECTED => "UCS_ERR_NOT_CONNECTED",
        UCS_ERR_CONNECTION_RESET => "UCS_ERR_CONNECTION_RESET",
        UCS_ERR_ENDPOINT_TIMEOUT => "UCS_ERR_ENDPOINT_TIMEOUT",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_name_themselves_and_classify_peer_failures() {
        let reset = Status::new(
            sys::UCS_ERR_CONNECTION_RESET,
            "Connection reset by remote peer",
        );
        assert_eq!(reset.name(), "UCS_ERR_CONNECTION_RESET");
        assert!(reset.is_peer_failure());
        assert_eq!(
            reset.to_string(),
            "UCS_ERR_CONNECTION_RESET (-25: Connection reset by remote peer)"
        );
        assert!(Status::new(sys::UCS_ERR_ENDPOINT_TIMEOUT, "").is_peer_failure());
        assert!(Status::new(-45, "link failure").is_peer_failure());
        assert!(!Status::new(sys::UCS_ERR_INVALID_PARAM, "").is_peer_failure());
        assert!(!Status::new(sys::UCS_ERR_CANCELED, "").is_peer_failure());
        assert_eq!(Status::new(-33, "").name(), "UCS_ERR_-33");
    }

    #[test]
    fn a_load_error_names_what_was_tried() {
        let e = LoadError::Open {
            location: LibraryLocation {
                source: LibrarySource::Configured,
                path: "/nowhere/libucp.so".into(),
            },
            reason: "cannot open shared object file".into(),
        };
        let text = e.to_string();
        assert!(text.contains("/nowhere/libucp.so"), "{text}");
        assert!(text.contains("transport.ucx.library"), "{text}");
    }
}
