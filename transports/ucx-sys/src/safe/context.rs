//! The loaded library ([`Ucx`]) and a UCP context ([`Context`]).

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{LibraryLocation, LoadError, UcxError, Version};
use crate::result;
use crate::safe::region::MemoryType;
use crate::safe::worker::Worker;
use crate::sys::{self, Library};

/// A loaded UCX. Cheap to copy; the library stays loaded for the life of the process.
#[derive(Debug, Clone, Copy)]
pub struct Ucx {
    lib: &'static Library,
}

impl Ucx {
    /// Loads UCX: `configured` if given, else `FERRY_UCX_LIBRARY` if set, else the
    /// system's `libucp.so.0` (see [`Library::load`]). Blocks while the dynamic linker
    /// maps the library (milliseconds).
    ///
    /// # Errors
    ///
    /// [`LoadError`] naming what was tried: missing file, not a libucp, or UCX < 1.13.
    pub fn load(configured: Option<&Path>) -> Result<Self, LoadError> {
        Library::load(configured).map(|lib| Self { lib })
    }

    /// Loads the library at `location`, with no look at the environment.
    ///
    /// # Errors
    ///
    /// As [`Ucx::load`].
    pub fn load_from(location: LibraryLocation) -> Result<Self, LoadError> {
        Library::load_from(location).map(|lib| Self { lib })
    }

    /// The UCX version (`ucp_get_version`).
    pub fn version(&self) -> Version {
        self.lib.version
    }

    /// UCX's version string (`ucp_get_version_string`), where exported.
    pub fn version_string(&self) -> Option<&'static str> {
        self.lib.version_string.as_deref()
    }

    /// What was asked for.
    pub fn location(&self) -> &'static LibraryLocation {
        &self.lib.location
    }

    /// The file actually mapped (resolved through `/proc/self/maps`), where known.
    pub fn file(&self) -> Option<&'static PathBuf> {
        self.lib.file.as_ref()
    }

    /// The raw library, for the [`crate::result`] layer.
    pub fn library(&self) -> &'static Library {
        self.lib
    }

    /// A builder for a context of this UCX.
    pub fn context(&self) -> ContextBuilder {
        ContextBuilder {
            ucx: *self,
            features: Features::TAG | Features::RMA,
            settings: Vec::new(),
            name: None,
            estimated_endpoints: None,
        }
    }
}

/// The UCP features a context asks for (`UCP_FEATURE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Features(u64);

impl Features {
    /// Tag matching (send/receive).
    pub const TAG: Features = Features(sys::UCP_FEATURE_TAG);
    /// Remote memory access (put/get).
    pub const RMA: Features = Features(sys::UCP_FEATURE_RMA);
    /// 32-bit atomics.
    pub const AMO32: Features = Features(sys::UCP_FEATURE_AMO32);
    /// 64-bit atomics.
    pub const AMO64: Features = Features(sys::UCP_FEATURE_AMO64);
    /// Event-driven progress: [`Worker::event_fd`] and [`Worker::arm`].
    pub const WAKEUP: Features = Features(sys::UCP_FEATURE_WAKEUP);
    /// Streams.
    pub const STREAM: Features = Features(sys::UCP_FEATURE_STREAM);
    /// Active messages.
    pub const AM: Features = Features(sys::UCP_FEATURE_AM);

    /// The raw mask.
    pub fn bits(self) -> u64 {
        self.0
    }

    /// Whether every feature of `other` is in `self`.
    pub fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Features {
    type Output = Features;
    fn bitor(self, rhs: Features) -> Features {
        Features(self.0 | rhs.0)
    }
}

/// Settings for a new [`Context`]. By default: features TAG and RMA, UCX's configuration
/// from its `UCX_*` environment variables.
#[derive(Debug, Clone)]
pub struct ContextBuilder {
    ucx: Ucx,
    features: Features,
    settings: Vec<(String, String)>,
    name: Option<String>,
    estimated_endpoints: Option<usize>,
}

impl ContextBuilder {
    /// The features to ask for (replaces the default TAG | RMA).
    pub fn features(mut self, features: Features) -> Self {
        self.features = features;
        self
    }

    /// Overrides one UCX setting, named without its `UCX_` prefix (`"TLS"`,
    /// `"NET_DEVICES"`), on top of the environment (`ucp_config_modify`).
    pub fn set(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }

    /// The context's name in UCX's logs.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// How many endpoints the context expects (a tuning hint).
    pub fn estimated_endpoints(mut self, n: usize) -> Self {
        self.estimated_endpoints = Some(n);
        self
    }

    /// Reads UCX's configuration, applies the settings and creates the context
    /// (`ucp_config_read`, `ucp_config_modify`, `ucp_init_version(1, 13)`). Blocks while UCX
    /// opens its transports (tens of milliseconds).
    ///
    /// # Errors
    ///
    /// [`UcxError::Misuse`] for a setting with a NUL byte; UCX's status for an unknown
    /// setting (`UCS_ERR_NO_ELEM`), a bad value, or no usable transport.
    pub fn build(self) -> Result<Context, UcxError> {
        let lib = self.ucx.lib;
        let mut settings = Vec::with_capacity(self.settings.len());
        for (name, value) in &self.settings {
            settings.push((cstring(name)?, cstring(value)?));
        }
        let name = self.name.as_deref().map(cstring).transpose()?;

        let config = Config {
            lib,
            handle: result::config_read(lib)?,
        };
        for (name, value) in &settings {
            // SAFETY: `config.handle` is live: `Config` releases it only on drop, after
            // this loop.
            unsafe { result::config_modify(lib, config.handle, name, value) }.map_err(
                |e| match e {
                    UcxError::Call { status, .. } => UcxError::Misuse(format!(
                        "UCX setting {}={}: {status}",
                        name.to_string_lossy(),
                        value.to_string_lossy()
                    )),
                    other => other,
                },
            )?;
        }

        let mut params = sys::ucp_params_t {
            field_mask: sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED,
            features: self.features.bits(),
            // Workers of one context may live on different threads; the context then
            // locks its own state (memory maps, rkey packing), which is what makes
            // `Context` `Sync`.
            mt_workers_shared: 1,
            ..Default::default()
        };
        if let Some(n) = self.estimated_endpoints {
            params.field_mask |= sys::UCP_PARAM_FIELD_ESTIMATED_NUM_EPS;
            params.estimated_num_eps = n;
        }
        if let Some(name) = &name {
            params.field_mask |= sys::UCP_PARAM_FIELD_NAME;
            params.name = name.as_ptr();
        }
        // SAFETY: the mask names exactly the fields set above; `name` outlives the call
        // (UCX copies it); `config.handle` is live until `config` drops below.
        let handle = unsafe { result::init(lib, &params, Some(config.handle)) }?;
        drop(config);
        Ok(Context {
            inner: Arc::new(ContextInner {
                ucx: self.ucx,
                handle,
                features: self.features,
            }),
        })
    }
}

fn cstring(s: &str) -> Result<CString, UcxError> {
    CString::new(s).map_err(|_| UcxError::Misuse(format!("{s:?} contains a NUL byte")))
}

/// A `ucp_config_t`, released on drop.
struct Config {
    lib: &'static Library,
    handle: NonNull<sys::ucp_config>,
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: `handle` came from `config_read` and only this drop releases it.
        unsafe { result::config_release(self.lib, self.handle) }
    }
}

/// A UCP context: the transports UCX opened, memory registration, and the factory of
/// workers. Cheap to clone (shared); cleaned up when the last clone and everything made
/// from it (workers, memory handles) are gone.
///
/// `Send` and `Sync`: it is created with `mt_workers_shared`, so UCX locks the context's
/// shared state itself.
#[derive(Debug, Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

#[derive(Debug)]
struct ContextInner {
    ucx: Ucx,
    handle: NonNull<sys::ucp_context>,
    features: Features,
}

// SAFETY: the context is created with `mt_workers_shared = 1`, under which UCX guards the
// context's shared state (memory maps, rkey packing, worker creation) with its own lock, so
// the handle may be used from any thread and from several at once. Cleanup happens once,
// in `Drop`, when no other reference remains.
unsafe impl Send for ContextInner {}
// SAFETY: as above.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: `handle` came from `init` and is cleaned up only here. Workers and
        // memory handles hold a `Context` clone, so none of them is still alive.
        unsafe { result::cleanup(self.ucx.lib, self.handle) }
    }
}

/// What [`Context::info`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextInfo {
    /// Memory types UCX can move in this context (CUDA only with a UCX built with CUDA, on
    /// a machine with a driver).
    pub memory_types: Vec<MemoryType>,
    /// The raw `memory_types` mask (bits past 1.13's table included).
    pub memory_types_mask: u64,
    /// Bytes UCX reserves per request.
    pub request_size: usize,
}

impl Context {
    /// The library.
    pub fn ucx(&self) -> Ucx {
        self.inner.ucx
    }

    /// The features asked for.
    pub fn features(&self) -> Features {
        self.inner.features
    }

    pub(crate) fn handle(&self) -> NonNull<sys::ucp_context> {
        self.inner.handle
    }

    pub(crate) fn lib(&self) -> &'static Library {
        self.inner.ucx.lib
    }

    /// What the context supports (`ucp_context_query`).
    ///
    /// # Errors
    ///
    /// [`UcxError::Unavailable`] when the library lacks `ucp_context_query`; UCX's status.
    pub fn info(&self) -> Result<ContextInfo, UcxError> {
        let mut attr = sys::ucp_context_attr_t {
            field_mask: sys::UCP_ATTR_FIELD_MEMORY_TYPES | sys::UCP_ATTR_FIELD_REQUEST_SIZE,
            ..Default::default()
        };
        // SAFETY: the handle is live while `self` is; `attr` asks only for the two fields
        // it has room for.
        unsafe { result::context_query(self.lib(), self.handle(), &mut attr) }?;
        Ok(ContextInfo {
            memory_types: MemoryType::from_mask(attr.memory_types),
            memory_types_mask: attr.memory_types,
            request_size: attr.request_size,
        })
    }

    /// Creates a worker on the calling thread. See [`Worker`] for its thread rule.
    ///
    /// # Errors
    ///
    /// UCX's status.
    pub fn worker(&self) -> Result<Worker, UcxError> {
        Worker::new(self)
    }
}
