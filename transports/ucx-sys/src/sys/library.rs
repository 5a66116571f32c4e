//! Opening `libucp` at run time: which file, the version check, the function table.

use std::ffi::{OsStr, OsString};
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};

use super::functions::Functions;
use crate::error::{LibraryLocation, LibrarySource, LoadError, Version};

/// The environment variable naming the `libucp.so` to load when the caller gives no path.
pub const LIBRARY_ENV: &str = "FERRY_UCX_LIBRARY";
/// The soname the system search looks for.
pub const SYSTEM_LIBRARY: &str = "libucp.so.0";
/// The oldest UCX this crate accepts, and the API version it asks `ucp_init_version` for.
pub const MIN_VERSION: Version = Version {
    major: 1,
    minor: 13,
    release: 0,
};

/// One loaded `libucp`: its function table, version and where it came from.
///
/// A `Library` is never unloaded: UCX starts threads, installs memory hooks and registers
/// destructors that would point into unmapped code after `dlclose`, so the handle is kept
/// for the life of the process (loading the same file again only bumps the linker's count).
pub struct Library {
    /// The entry points.
    pub fns: Functions,
    /// What `ucp_get_version` reported.
    pub version: Version,
    /// What `ucp_get_version_string` reported, if the build exports it.
    pub version_string: Option<String>,
    /// What was asked for.
    pub location: LibraryLocation,
    /// The file the linker actually mapped (found through `/proc/self/maps`; `None` where
    /// that cannot be read). For the system search this is the resolved path.
    pub file: Option<PathBuf>,
    _lib: ManuallyDrop<libloading::Library>,
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Library")
            .field("version", &self.version)
            .field("location", &self.location)
            .field("file", &self.file)
            .finish_non_exhaustive()
    }
}

impl Library {
    /// Picks the library to load, first that is set: `configured` (ferry's
    /// `transport.ucx.library`), then `env` (the value of `FERRY_UCX_LIBRARY`; empty counts
    /// as unset), then the system's `libucp.so.0`. A pure function: the caller reads the
    /// environment.
    pub fn locate(configured: Option<&Path>, env: Option<&OsStr>) -> LibraryLocation {
        if let Some(path) = configured {
            return LibraryLocation {
                source: LibrarySource::Configured,
                path: path.to_path_buf(),
            };
        }
        match env {
            Some(v) if !v.is_empty() => LibraryLocation {
                source: LibrarySource::Environment,
                path: PathBuf::from(v),
            },
            _ => LibraryLocation {
                source: LibrarySource::System,
                path: PathBuf::from(SYSTEM_LIBRARY),
            },
        }
    }

    /// Loads the library [`Library::locate`] picks, reading `FERRY_UCX_LIBRARY` from the
    /// environment.
    ///
    /// There is no fallback from a set path to the next source: a configured path that does
    /// not load is an error, because a different UCX build than the one asked for would
    /// produce rkeys and addresses its peers cannot unpack.
    ///
    /// # Errors
    ///
    /// [`LoadError`] naming the location tried: the file does not open, lacks a UCP entry
    /// point, or is a UCX older than 1.13.
    pub fn load(configured: Option<&Path>) -> Result<&'static Library, LoadError> {
        let env: Option<OsString> = std::env::var_os(LIBRARY_ENV);
        Self::load_from(Self::locate(configured, env.as_deref()))
    }

    /// Loads the library at `location`.
    ///
    /// The returned reference is `'static` because the library is never unloaded; each
    /// call leaks one small table.
    ///
    /// # Errors
    ///
    /// As [`Library::load`].
    pub fn load_from(location: LibraryLocation) -> Result<&'static Library, LoadError> {
        // SAFETY: loading a shared library runs its initialisers. The file is UCX (or,
        // if the caller named something else, its initialisers are the caller's choice, the
        // same trust as `LD_PRELOAD`); UCX's initialisers are safe to run in any process.
        let lib = unsafe { libloading::Library::new(location.path.as_os_str()) }.map_err(|e| {
            LoadError::Open {
                location: location.clone(),
                reason: describe(&e),
            }
        })?;

        // The version first, with only `ucp_get_version`, so a UCX too old to have the
        // nbx calls says "too old" rather than "symbol missing".
        // SAFETY: `ucp_get_version(unsigned *, unsigned *, unsigned *)` has had this
        // signature in every UCX release.
        let get_version = unsafe {
            lib.get::<unsafe extern "C" fn(*mut u32, *mut u32, *mut u32)>(b"ucp_get_version\0")
        }
        .map_err(|e| LoadError::MissingSymbol {
            location: location.clone(),
            symbol: "ucp_get_version",
            reason: describe(&e),
        })?;
        let (mut major, mut minor, mut release) = (0u32, 0u32, 0u32);
        // SAFETY: the three pointers are to live locals; the function only writes them.
        unsafe { get_version(&mut major, &mut minor, &mut release) };
        let version = Version {
            major,
            minor,
            release,
        };
        if version < MIN_VERSION {
            return Err(LoadError::TooOld {
                location,
                found: version,
                required: MIN_VERSION,
            });
        }

        // SAFETY: the library is a UCX >= 1.13 (checked above), whose exported symbols
        // have the 1.13 signatures the table declares.
        let fns =
            unsafe { Functions::load(&lib) }.map_err(|(symbol, e)| LoadError::MissingSymbol {
                location: location.clone(),
                symbol,
                reason: describe(&e),
            })?;
        let version_string = fns.ucp_get_version_string.map(|f| {
            // SAFETY: `ucp_get_version_string` returns a pointer to a static NUL-terminated
            // string inside the library, which stays loaded.
            unsafe { std::ffi::CStr::from_ptr(f()) }
                .to_string_lossy()
                .into_owned()
        });
        let file = mapped_file(fns.ucp_get_version as usize);
        Ok(Box::leak(Box::new(Library {
            fns,
            version,
            version_string,
            location,
            file,
            _lib: ManuallyDrop::new(lib),
        })))
    }
}

/// `libloading`'s error with its causes (its `Display` alone says only "dlopen failed";
/// the linker's message is the source).
fn describe(e: &libloading::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// The file mapped at `address` in this process, from `/proc/self/maps`.
fn mapped_file(address: usize) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        let range = parts.next()?;
        let (lo, hi) = range.split_once('-')?;
        let lo = usize::from_str_radix(lo, 16).ok()?;
        let hi = usize::from_str_radix(hi, 16).ok()?;
        if !(lo..hi).contains(&address) {
            return None;
        }
        let path = parts.nth(4)?;
        path.starts_with('/').then(|| PathBuf::from(path))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_set_source_wins() {
        let configured = Path::new("/opt/ucx/lib/libucp.so");
        let env = OsStr::new("/env/libucp.so");
        let l = Library::locate(Some(configured), Some(env));
        assert_eq!(l.source, LibrarySource::Configured);
        assert_eq!(l.path, configured);
        let l = Library::locate(None, Some(env));
        assert_eq!(l.source, LibrarySource::Environment);
        assert_eq!(l.path, Path::new("/env/libucp.so"));
        let l = Library::locate(None, Some(OsStr::new("")));
        assert_eq!(l.source, LibrarySource::System);
        assert_eq!(l.path, Path::new(SYSTEM_LIBRARY));
        assert_eq!(Library::locate(None, None).source, LibrarySource::System);
    }

    #[test]
    fn a_missing_file_is_a_typed_error_naming_it() {
        let location = LibraryLocation {
            source: LibrarySource::Configured,
            path: "/definitely/not/here/libucp.so".into(),
        };
        match Library::load_from(location.clone()) {
            Err(LoadError::Open {
                location: l,
                reason,
            }) => {
                assert_eq!(l, location);
                assert!(!reason.is_empty());
            }
            other => panic!("expected LoadError::Open, got {other:?}"),
        }
    }

    #[test]
    fn the_file_of_a_code_address_is_found() {
        // This test binary's own code lies in a named file mapping.
        let here = mapped_file(mapped_file as *const () as usize);
        assert!(here.is_some_and(|p| p.is_absolute()));
    }
}
