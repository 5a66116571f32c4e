//! Gathering what `ferry doctor` looks at. Everything that touches the machine is here and
//! in [`super::pool_test`] (which starts a second process); the diagnosis itself
//! ([`super::diagnose`]) is pure.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry_transports::cuda::{self, CudaProbe};
use ferry_transports::transport::{Capabilities, Viability};

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
    /// UCX.
    pub ucx: Ucx,
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

/// What was found of UCX.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ucx {
    /// Where `libucp.so.0` is, if anywhere.
    pub library: Option<PathBuf>,
    /// Transports `ucx_info -d` lists; `None` when it could not be run.
    pub transports: Option<Vec<String>>,
}

impl Facts {
    /// Reads the facts from this machine. Does not fail: what cannot be read is recorded.
    pub fn gather() -> Self {
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
            ucx: ucx(),
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

/// Where the dynamic loader usually finds libraries, besides `ldconfig`'s cache.
const LIBRARY_DIRS: &[&str] = &[
    "/usr/lib",
    "/usr/lib64",
    "/lib",
    "/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/local/lib",
    "/usr/local/ucx/lib",
    "/opt/ucx/lib",
];

const UCP: &str = "libucp.so.0";

fn ucx() -> Ucx {
    let library = find_library(UCP);
    let transports = library.as_ref().and_then(|_| ucx_transports());
    Ucx {
        library,
        transports,
    }
}

fn find_library(name: &str) -> Option<PathBuf> {
    let env_dirs = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let ucx_home = std::env::var("UCX_HOME")
        .ok()
        .map(|home| format!("{home}/lib"));
    let from_dirs = env_dirs
        .split(':')
        .filter(|d| !d.is_empty())
        .map(str::to_string)
        .chain(ucx_home)
        .chain(LIBRARY_DIRS.iter().map(|d| d.to_string()))
        .map(|dir| Path::new(&dir).join(name))
        .find(|path| path.exists());
    from_dirs.or_else(|| {
        let out = run_for("ldconfig", &["-p"], Duration::from_secs(5))
            .or_else(|| run_for("/sbin/ldconfig", &["-p"], Duration::from_secs(5)))?;
        // "\tlibucp.so.0 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libucp.so.0"
        out.lines()
            .filter(|l| l.trim_start().starts_with(name))
            .find_map(|l| l.split("=>").nth(1))
            .map(|p| PathBuf::from(p.trim()))
    })
}

/// The transport names `ucx_info -d` reports (`# Transport: rc_mlx5`), deduplicated.
fn ucx_transports() -> Option<Vec<String>> {
    let out = run_for("ucx_info", &["-d"], Duration::from_secs(10))?;
    Some(parse_ucx_transports(&out))
}

pub(super) fn parse_ucx_transports(text: &str) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for line in text.lines() {
        let line = line.trim_start_matches(['#', ' ', '\t']);
        if let Some(name) = line.strip_prefix("Transport:") {
            let name = name.trim().to_string();
            if !name.is_empty() && !names.contains(&name) {
                names.push(name);
            }
        }
    }
    names
}

/// Runs a program and returns its stdout, or `None` if it is missing, fails or outlives
/// `limit` (then it is killed).
fn run_for(program: &str, args: &[&str], limit: Duration) -> Option<String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut stdout = child.stdout.take()?;
    // Read on a thread so a chatty program cannot block on a full pipe while we wait.
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let text = reader.join().ok()?;
    status.filter(|s| s.success()).map(|_| text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ucx_info_transports_are_read_once_each() {
        let text = "#\n# Memory domain: self\n#      Transport: self\n#   Device: memory\n\
                    #      Transport: tcp\n#      Transport: tcp\n#      Transport: cuda_copy\n";
        assert_eq!(parse_ucx_transports(text), ["self", "tcp", "cuda_copy"]);
    }

    #[test]
    fn gathering_never_panics() {
        let facts = Facts::gather();
        assert!(!facts.transports.is_empty());
    }
}
