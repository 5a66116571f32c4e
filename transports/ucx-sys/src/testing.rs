//! Gating of tests that need a UCX library. A test calls [`ucx_test`]: where UCX loads, the
//! test runs; where it does not, the test skips (prints why and returns) unless
//! `FERRY_UCX_TESTS=1`, which turns the missing library into a failure, so CI, which
//! installs UCX, can never go green by skipping.
//!
//! ```no_run
//! #[test]
//! fn puts_bytes() {
//!     let Some(ucx) = ucx_sys::testing::ucx_test("puts_bytes") else {
//!         return;
//!     };
//!     assert!(ucx.version().minor >= 13);
//! }
//! ```

use crate::error::LoadError;
use crate::safe::Ucx;

/// The environment variable that makes a missing UCX fail tests instead of skipping them.
pub const UCX_TESTS_ENV: &str = "FERRY_UCX_TESTS";

/// Loads UCX for the test `name` (the usual load order: `FERRY_UCX_LIBRARY`, then the
/// system's `libucp.so.0`).
///
/// Returns `None`, after printing `skipped: <name> needs UCX: <why>`, when UCX does not
/// load and `FERRY_UCX_TESTS` is not `1`.
///
/// # Panics
///
/// When UCX does not load and `FERRY_UCX_TESTS=1`; the message says what was tried.
pub fn ucx_test(name: &str) -> Option<Ucx> {
    let required = std::env::var(UCX_TESTS_ENV).as_deref() == Ok("1");
    match decide(name, required, Ucx::load(None)) {
        Ok(Some(ucx)) => Some(ucx),
        Ok(None) => None,
        Err(why) => panic!("{why}"),
    }
}

/// The gate's decision: the library, a skip (printed), or the failure message.
fn decide(
    name: &str,
    required: bool,
    loaded: Result<Ucx, LoadError>,
) -> Result<Option<Ucx>, String> {
    match loaded {
        Ok(ucx) => Ok(Some(ucx)),
        Err(e) if required => Err(format!("{name}: {UCX_TESTS_ENV}=1 but {e}")),
        Err(e) => {
            println!(
                "skipped: {name} needs UCX: {e} (set {UCX_TESTS_ENV}=1 where UCX is installed \
                 to make this a failure)"
            );
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{LibraryLocation, LibrarySource};

    fn missing() -> LoadError {
        LoadError::Open {
            location: LibraryLocation {
                source: LibrarySource::System,
                path: "libucp.so.0".into(),
            },
            reason: "libucp.so.0: cannot open shared object file".into(),
        }
    }

    #[test]
    fn a_missing_library_skips_unless_required() {
        assert!(matches!(decide("t", false, Err(missing())), Ok(None)));
        let e = decide("t", true, Err(missing())).err().unwrap_or_default();
        assert!(e.contains("FERRY_UCX_TESTS=1"), "{e}");
        assert!(e.contains("libucp.so.0"), "{e}");
    }
}
