//! Which UCX a node loads, as the library says of itself: what `ferry doctor` and `ferry
//! explain` name, since every node must load the same release (a peer's addresses and keys
//! do not unpack in another).

use std::fmt;
use std::path::{Path, PathBuf};

use ucx_sys::{LibraryLocation, LibrarySource, LoadError, Ucx, Version};

/// The UCX a node loads, as the library reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedUcx {
    /// The release, from `ucp_get_version`.
    pub release: Version,
    /// `ucp_get_version_string`, where the build exports it.
    pub version_string: Option<String>,
    /// What was asked for, and where that came from (`transport.ucx.library`,
    /// `FERRY_UCX_LIBRARY` or the system's `libucp.so.0`).
    pub location: LibraryLocation,
    /// The file the dynamic linker mapped (from `/proc/self/maps`), where it can be read.
    pub file: Option<PathBuf>,
    /// Whether it moves CUDA device memory (a context of it lists the CUDA memory type).
    pub moves_cuda: bool,
}

impl fmt::Display for LoadedUcx {
    /// `UCX 1.13.1 from /usr/lib/x86_64-linux-gnu/libucp.so.0.0.0 (the system's
    /// libucp.so.0)`: the release, the file, and what named it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UCX {}", self.release)?;
        if let Some(text) = &self.version_string
            && *text != self.release.to_string()
        {
            write!(f, " ({text})")?;
        }
        let file = self.file.as_deref().unwrap_or(&self.location.path);
        write!(f, " from {}", file.display())?;
        match self.location.source {
            LibrarySource::Configured => f.write_str(" (transport.ucx.library)"),
            LibrarySource::Environment => f.write_str(" (FERRY_UCX_LIBRARY)"),
            LibrarySource::System => write!(f, " (the system's {})", self.location.path.display()),
            other => write!(f, " ({other})"),
        }
    }
}

/// Loads the UCX a node with `transport.ucx.library = configured` loads (`None`:
/// `FERRY_UCX_LIBRARY`, else the system's `libucp.so.0`) and asks it what it is.
///
/// Blocks while the library is mapped and a context is made (tens of milliseconds). The
/// library stays loaded for the life of the process, as every loaded UCX does.
///
/// # Errors
///
/// [`LoadError`], naming what was tried and, where the library got as far as reporting
/// it, the release ([`LoadError::release`]).
pub fn loaded(configured: Option<&Path>) -> Result<LoadedUcx, LoadError> {
    let ucx = Ucx::load(configured)?;
    Ok(LoadedUcx {
        release: ucx.version(),
        version_string: ucx.version_string().map(str::to_string),
        location: ucx.location().clone(),
        file: ucx.file().cloned(),
        moves_cuda: context_moves_cuda(ucx),
    })
}

/// Whether a context of `ucx` lists the CUDA memory type (a UCX built with CUDA, on a
/// machine with the driver). Blocks while the context is made.
pub(super) fn context_moves_cuda(ucx: Ucx) -> bool {
    ucx.context()
        .features(ucx_sys::Features::RMA)
        .build()
        .and_then(|c| c.info())
        .is_ok_and(|i| i.memory_types.contains(&ucx_sys::MemoryType::Cuda))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loaded(source: LibrarySource, path: &str, file: Option<&str>) -> LoadedUcx {
        LoadedUcx {
            release: Version {
                major: 1,
                minor: 22,
                release: 0,
            },
            version_string: Some("1.22.0".into()),
            location: LibraryLocation {
                source,
                path: path.into(),
            },
            file: file.map(PathBuf::from),
            moves_cuda: false,
        }
    }

    #[test]
    fn names_the_release_the_file_and_what_named_it() {
        let system = loaded(
            LibrarySource::System,
            "libucp.so.0",
            Some("/usr/lib/libucp.so.0.0.0"),
        );
        assert_eq!(
            system.to_string(),
            "UCX 1.22.0 from /usr/lib/libucp.so.0.0.0 (the system's libucp.so.0)"
        );
        // Without /proc/self/maps, the path asked for; a version string that says more.
        let mut env = loaded(LibrarySource::Environment, "/opt/ucx/libucp.so", None);
        env.version_string = Some("1.22.0-rc1".into());
        assert_eq!(
            env.to_string(),
            "UCX 1.22.0 (1.22.0-rc1) from /opt/ucx/libucp.so (FERRY_UCX_LIBRARY)"
        );
        let configured = loaded(LibrarySource::Configured, "/opt/ucx/libucp.so", None);
        assert!(configured.to_string().ends_with("(transport.ucx.library)"));
    }
}
