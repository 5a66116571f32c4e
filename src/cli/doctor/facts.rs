//! Gathering what `ferry doctor` looks at. Everything that touches the machine is here and
//! in [`super::pool_test`] (which starts a second process); the diagnosis itself
//! ([`super::diagnose`]) is pure.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry_transports::cuda::{self, CudaProbe};
use ferry_transports::transport::{Capabilities, Viability};
use ferry_transports::ucx::{LoadError, LoadedUcx, Version};

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
#[derive(Debug, Clone)]
pub struct Ucx {
    /// The UCX a node loads (`transport.ucx.library`, else `FERRY_UCX_LIBRARY`, else the
    /// system's `libucp.so.0`), as the library reports itself, or why it did not load.
    pub library: Result<LoadedUcx, LoadError>,
    /// Transports `ucx_info -d` lists, or why they are unknown (no `ucx_info` on `PATH`,
    /// or one of another UCX release).
    pub transports: Result<Vec<String>, String>,
}

impl Facts {
    /// Reads the facts from this machine, loading UCX as a node with
    /// `transport.ucx.library = ucx_library` would. Does not fail: what cannot be read is
    /// recorded.
    pub fn gather(ucx_library: Option<&Path>) -> Self {
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
            ucx: ucx(ucx_library),
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

fn ucx(configured: Option<&Path>) -> Ucx {
    let library = ferry_transports::ucx::loaded(configured);
    let transports = match &library {
        Ok(loaded) => ucx_transports(loaded.release),
        Err(_) => Err("UCX does not load".into()),
    };
    Ucx {
        library,
        transports,
    }
}

/// The transports of the loaded UCX `release`, from the `ucx_info` on `PATH` when it is of
/// that release, else why they are unknown.
fn ucx_transports(release: Version) -> Result<Vec<String>, String> {
    let Some(program) = on_path("ucx_info") else {
        return Err("ucx_info is not on PATH".into());
    };
    let version = run_for(&program.to_string_lossy(), &["-v"], Duration::from_secs(10))
        .ok_or_else(|| format!("{} -v failed", program.display()))?;
    match parse_ucx_info_release(&version) {
        Some(theirs) if theirs != release.to_string() => {
            return Err(format!(
                "{} is UCX {theirs}'s, not the loaded {release}'s",
                program.display()
            ));
        }
        _ => {}
    }
    let out = run_for(&program.to_string_lossy(), &["-d"], Duration::from_secs(10))
        .ok_or_else(|| format!("{} -d failed", program.display()))?;
    Ok(parse_ucx_transports(&out))
}

/// The first executable file `name` in a directory of `PATH`.
fn on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|file| {
            std::fs::metadata(file)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The release `ucx_info -v` names: `# Version 1.13.1` (UCX 1.13) or `# Library version:
/// 1.16.0` (later releases).
pub(super) fn parse_ucx_info_release(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let line = line.trim_start_matches(['#', ' ', '\t']);
        let rest = line
            .strip_prefix("Version ")
            .or_else(|| line.strip_prefix("Library version:"))?;
        rest.split_whitespace().next().map(str::to_string)
    })
}

/// The transport names `ucx_info -d` reports (`# Transport: rc_mlx5`), deduplicated.
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
    fn ucx_info_names_its_release_either_way() {
        let old = "# Version 1.13.1\n# Git branch '<unknown>', revision 0000000\n";
        assert_eq!(parse_ucx_info_release(old).as_deref(), Some("1.13.1"));
        let new = "# Library version: 1.16.0\n# Library path: /usr/lib/libucs.so.0\n\
                   # API headers version: 1.16.0\n";
        assert_eq!(parse_ucx_info_release(new).as_deref(), Some("1.16.0"));
        assert_eq!(parse_ucx_info_release("nothing here\n"), None);
    }

    #[test]
    fn gathering_never_panics() {
        let facts = Facts::gather(None);
        assert!(!facts.transports.is_empty());
    }
}
