//! The engine's settings.

use std::path::PathBuf;
use std::time::Duration;

use super::error::UcxTransportError;

/// How an [`super::Engine`] loads and drives UCX. `UcxSettings::default()` gives every
/// default listed here; set fields on it (the struct is `#[non_exhaustive]`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct UcxSettings {
    /// The `libucp.so` to load. Default `None`: the environment variable
    /// `FERRY_UCX_LIBRARY`, else the system's `libucp.so.0`. A set path that does not load
    /// is an error (no fallback: peers must load the same UCX build).
    pub library: Option<PathBuf>,
    /// UCX's transport list (`UCX_TLS`). Default `None`: UCX's own choice, which is the
    /// `UCX_TLS` environment variable if set and otherwise `all`.
    ///
    /// Every endpoint uses error mode PEER, so a dead peer fails its operations instead of
    /// hanging them. Under that mode UCX only uses transports that can notice a dead peer:
    /// `tcp`, or RDMA (`rc`, `dc`, `ud`). Shared memory (`sm`, `posix`, `sysv`, `cma`)
    /// alone cannot, and connecting then fails with `UCS_ERR_UNREACHABLE`. `all` includes
    /// `tcp`, which is why the default works everywhere; a list set here must include
    /// `tcp` or an RDMA transport.
    pub tls: Option<String>,
    /// Further UCX settings, each named without its `UCX_` prefix (`("NET_DEVICES",
    /// "lo")`, `("TCP_KEEPIDLE", "5s")`), applied after [`UcxSettings::tls`]. An unknown
    /// name or bad value fails [`super::Engine::start`]. Default none.
    pub options: Vec<(String, String)>,
    /// How this engine names itself in its address, for the peer's error messages.
    /// Default `None`: `<hostname> pid <pid>`.
    pub name: Option<String>,
    /// How long the progress thread keeps polling UCX after the last operation completed
    /// before it sleeps on the worker's event descriptor. Longer costs CPU when traffic
    /// stops; shorter costs a wake-up (a few microseconds) on the next operation after a
    /// pause. Default 50 µs.
    pub progress_spin: Duration,
    /// The longest an operation may take. One that takes longer fails with
    /// [`UcxTransportError::TimedOut`] and the engine force-closes the peer's endpoint,
    /// failing every other operation to that peer. A peer whose process dies is noticed
    /// by UCX much sooner (its kernel resets the TCP connection); this deadline catches a
    /// peer that hangs or a host that vanished. Default 30 s, long enough for 1 GiB at
    /// 50 MB/s.
    pub op_timeout: Duration,
    /// How long closing an endpoint (a dropped [`super::UcxPeer`]) may keep the progress
    /// thread polling, and how long a stopping engine waits for the operations in flight
    /// and the closes to finish before destroying the worker under them. Default 2 s.
    pub close_timeout: Duration,
    /// How many operations may wait for the progress thread before new ones are refused
    /// with [`UcxTransportError::Saturated`]. Default 1024.
    pub queue_depth: usize,
    /// How many operations the engine keeps in flight in UCX at once; further ones wait
    /// in the queue. Default 4096.
    pub max_in_flight: usize,
    /// How many unpacked remote keys each peer keeps; the least recently used one is
    /// destroyed to make room (once no operation uses it). Default 256.
    pub rkey_cache: usize,
    /// The GPU (CUDA ordinal) whose primary context the progress thread makes current
    /// before it creates UCX's context: UCX finds its CUDA device, and copies device memory,
    /// in the current context of the thread it runs on. Default `None`: no context (host
    /// memory only, or a UCX without CUDA).
    pub cuda_device: Option<u32>,
}

impl Default for UcxSettings {
    fn default() -> Self {
        Self {
            library: None,
            tls: None,
            options: Vec::new(),
            name: None,
            progress_spin: Duration::from_micros(50),
            op_timeout: Duration::from_secs(30),
            close_timeout: Duration::from_secs(2),
            queue_depth: 1024,
            max_in_flight: 4096,
            rkey_cache: 256,
            cuda_device: None,
        }
    }
}

impl UcxSettings {
    /// Checks the values that have a valid range.
    ///
    /// # Errors
    ///
    /// [`UcxTransportError::Misuse`] naming the first bad value.
    pub fn validate(&self) -> Result<(), UcxTransportError> {
        let bad = if self.op_timeout.is_zero() {
            "op_timeout must be above 0"
        } else if self.close_timeout.is_zero() {
            "close_timeout must be above 0"
        } else if self.progress_spin > Duration::from_secs(1) {
            "progress_spin must be at most 1 s"
        } else if self.queue_depth == 0 {
            "queue_depth must be at least 1"
        } else if self.max_in_flight == 0 {
            "max_in_flight must be at least 1"
        } else if self.rkey_cache == 0 {
            "rkey_cache must be at least 1"
        } else {
            return Ok(());
        };
        Err(UcxTransportError::Misuse(bad))
    }

    /// The name put in this engine's address: [`UcxSettings::name`], else
    /// `<hostname> pid <pid>`.
    pub fn origin(&self) -> String {
        if let Some(name) = &self.name {
            return name.clone();
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| "unknown-host".to_owned());
        format!("{host} pid {}", std::process::id())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_zeros_are_refused() {
        assert!(UcxSettings::default().validate().is_ok());
        let s = UcxSettings {
            queue_depth: 0,
            ..UcxSettings::default()
        };
        assert!(matches!(
            s.validate(),
            Err(UcxTransportError::Misuse(m)) if m.contains("queue_depth")
        ));
        let s = UcxSettings {
            op_timeout: Duration::ZERO,
            ..UcxSettings::default()
        };
        assert!(s.validate().is_err());
    }

    #[test]
    fn the_default_origin_names_the_process() {
        let origin = UcxSettings::default().origin();
        assert!(
            origin.ends_with(&format!("pid {}", std::process::id())),
            "{origin}"
        );
    }
}
