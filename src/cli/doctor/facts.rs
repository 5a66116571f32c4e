//! Gathering what `ferry doctor` looks at. Everything that touches the machine is here and
//! in [`super::pool_test`] (which starts a second process); the diagnosis itself
//! ([`super::diagnose`]) is pure.

use std::path::Path;

use ferry_config::{Config, TransportName};
use ferry_transports::cuda::{self, CudaProbe};
use ferry_transports::transport::{Capabilities, Finding, Viability};

/// Below this, `/dev/shm` is too small for NCCL-style tools.
pub const SHM_MIN: u64 = 1 << 30;
/// Below this, pinning host memory for staging and RDMA registration fails early.
pub const MEMLOCK_MIN: u64 = 64 << 20;

/// Everything the doctor knows about the machine: plain data, so tests can make it up.
#[derive(Debug, Clone)]
pub struct Facts {
    /// The CUDA driver and devices.
    pub cuda: CudaProbe,
    /// Size of `/dev/shm` in bytes, or why it could not be read.
    pub shm: Result<u64, String>,
    /// RLIMIT_MEMLOCK, or why it could not be read.
    pub memlock: Result<Memlock, String>,
    /// What each transport found of what it is built on
    /// ([`TransportKind::probe`](ferry_transports::transport::TransportKind::probe)).
    pub probes: Vec<Finding>,
    /// The transports of this build with their declarations and viability here.
    pub transports: Vec<(Capabilities, Viability)>,
    /// The two-process pool export/import test, one entry per GPU that declares exportable
    /// pools; empty when it did not run. [`Facts::gather`] leaves it empty (the test starts
    /// a process): [`super::pool_test::run`] fills it.
    pub pool_export: Vec<super::pool_test::PoolTest>,
    /// How block lists of device memory are copied in this process (`cuMemcpyBatchAsync`,
    /// or one copy per block); `None` without a working driver.
    pub block_copies: Option<cuda::BlockCopies>,
    /// Whether the gather kernel loads on the first GPU (`Err`: the driver's words);
    /// `None` without a GPU.
    pub gather_kernel: Option<Result<(), String>>,
}

/// RLIMIT_MEMLOCK in bytes; `None` is unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memlock {
    /// The limit in force.
    pub soft: Option<u64>,
    /// How far an unprivileged process may raise it.
    pub hard: Option<u64>,
}

impl Facts {
    /// Reads the facts from this machine for a node with `config` whose rules name the
    /// transports `named` (each transport probes what it is built on as such a node would
    /// load it). Does not fail: what cannot be read is recorded.
    pub fn gather(config: &Config, named: &[TransportName]) -> Self {
        let cuda = cuda::probe();
        let block_copies = matches!(cuda, cuda::CudaProbe::Ready(_)).then(cuda::block_copies);
        let gather_kernel = match &cuda {
            cuda::CudaProbe::Ready(driver) if !driver.devices.is_empty() => Some(
                cuda::Device::open(0)
                    .and_then(|d| cuda::load_gather_kernel(&d))
                    .map_err(|e| e.to_string()),
            ),
            _ => None,
        };
        Self {
            cuda,
            shm: shm_size(Path::new("/dev/shm")),
            memlock: memlock(),
            probes: ferry_transports::registry::kinds()
                .iter()
                .flat_map(|k| k.probe(config, named.contains(&k.capabilities().name)))
                .collect(),
            transports: ferry_transports::registry::catalog(),
            pool_export: Vec::new(),
            block_copies,
            gather_kernel,
        }
    }
}

fn shm_size(path: &Path) -> Result<u64, String> {
    let stat = rustix::fs::statvfs(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(stat.f_blocks.saturating_mul(stat.f_frsize))
}

fn memlock() -> Result<Memlock, String> {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock);
    Ok(Memlock {
        soft: limit.current,
        hard: limit.maximum,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathering_never_panics() {
        let config =
            Config::from_toml_str("[node]\nname = \"a\"\n[security]\ndanger_insecure = true\n")
                .expect("test config");
        let facts = Facts::gather(&config, &[]);
        assert!(!facts.transports.is_empty());
    }
}
