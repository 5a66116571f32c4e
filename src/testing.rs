//! Gating of GPU tests. CI has no GPU, so a GPU test skips itself unless
//! `FERRY_GPU_TESTS=1`; when that is set, a machine without a working driver or without
//! enough GPUs makes the test fail instead of pass, so a GPU run can never go green by
//! accident.
//!
//! ```no_run
//! #[test]
//! fn copies_between_two_gpus() {
//!     let Some(gpu) = ferry::testing::gpu_test_with("copies_between_two_gpus", 2) else {
//!         return;
//!     };
//!     assert!(gpu.driver.devices.len() >= 2);
//! }
//! ```

use ferry_transports::cuda::{CudaDriver, CudaProbe, probe};

/// The environment variable that turns GPU tests on.
pub const GPU_TESTS_ENV: &str = "FERRY_GPU_TESTS";

/// The environment variable that makes a GPU test fail, rather than skip, on a machine
/// with fewer GPUs than it needs.
pub const GPU_TESTS_ALL_ENV: &str = "FERRY_GPU_TESTS_ALL";

/// A GPU test that may run: the driver and the devices it found.
#[derive(Debug, Clone)]
pub struct GpuTest {
    /// The working driver, with at least the devices the test asked for.
    pub driver: CudaDriver,
}

/// [`gpu_test_with`] for a test that needs one GPU.
pub fn gpu_test(name: &str) -> Option<GpuTest> {
    gpu_test_with(name, 1)
}

/// Decides whether the GPU test `name`, which needs `devices` GPUs, runs.
///
/// Without `FERRY_GPU_TESTS=1`: prints `skipped: <name> needs a GPU; set FERRY_GPU_TESTS=1 on
/// a GPU machine` and returns `None` (the test returns and passes).
///
/// A test that needs more GPUs than a working machine has (two, on a one-GPU machine)
/// skips and says so, unless `FERRY_GPU_TESTS_ALL=1` asks for every GPU test to run (the
/// multi-GPU runs set it): the suite passes on whatever GPU machine is lent, and no run
/// meant for two GPUs goes green on one.
///
/// # Panics
///
/// With `FERRY_GPU_TESTS=1`, when the CUDA driver is missing or broken or sees no GPU, and
/// with `FERRY_GPU_TESTS_ALL=1` too, when it sees fewer than `devices`: the message says
/// which.
pub fn gpu_test_with(name: &str, devices: usize) -> Option<GpuTest> {
    if std::env::var(GPU_TESTS_ENV).as_deref() != Ok("1") {
        println!("skipped: {name} needs a GPU; set {GPU_TESTS_ENV}=1 on a GPU machine");
        return None;
    }
    let all = std::env::var(GPU_TESTS_ALL_ENV).as_deref() == Ok("1");
    let found = probe();
    match require(&found, devices) {
        Ok(driver) => Some(GpuTest { driver }),
        Err(why) if !all && require(&found, 1).is_ok() => {
            println!(
                "skipped: {name}: {why}; run it on a machine with {devices} GPUs \
                 ({GPU_TESTS_ALL_ENV}=1 makes this a failure)"
            );
            None
        }
        Err(why) => panic!("{name}: {GPU_TESTS_ENV}=1 but {why}"),
    }
}

/// The GPU a test's second node uses: 1 where the driver sees two or more, else 0 (also
/// without a working driver). CUDA IPC works between two processes of one GPU, so a test
/// that does not need two GPUs by its nature runs on a one-GPU machine too, with both nodes
/// on GPU 0. Probes the driver (cached after the first call).
pub fn peer_gpu() -> usize {
    match probe() {
        CudaProbe::Ready(d) => peer_ordinal(d.devices.len()),
        _ => 0,
    }
}

/// The second node's GPU when the machine has `devices` GPUs.
fn peer_ordinal(devices: usize) -> usize {
    usize::from(devices >= 2)
}

/// Why a machine cannot run a GPU test.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum NoGpu {
    #[error(
        "no CUDA driver on this machine (libcuda.so.1 does not load): GPU tests cannot run here"
    )]
    NoDriver,
    #[error("the CUDA driver does not work: {0}")]
    Broken(String),
    #[error("the test needs {needed} GPU(s) and the driver sees {found}")]
    TooFew { needed: usize, found: usize },
}

/// The driver when it has at least `devices` GPUs, else why not.
fn require(found: &CudaProbe, devices: usize) -> Result<CudaDriver, NoGpu> {
    match found {
        CudaProbe::NoDriver => Err(NoGpu::NoDriver),
        CudaProbe::Failed { error, .. } => Err(NoGpu::Broken(error.to_string())),
        CudaProbe::Ready(d) if d.devices.len() < devices => Err(NoGpu::TooFew {
            needed: devices,
            found: d.devices.len(),
        }),
        CudaProbe::Ready(d) => Ok(d.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_few_devices_or_no_driver_is_refused() {
        let none = CudaDriver {
            cuda_version: 13000,
            kernel_module: None,
            devices: Vec::new(),
            peer_access: Vec::new(),
        };
        let e = require(&CudaProbe::Ready(none.clone()), 1).err();
        assert_eq!(
            e.map(|e| e.to_string()).as_deref(),
            Some("the test needs 1 GPU(s) and the driver sees 0")
        );
        assert_eq!(require(&CudaProbe::Ready(none.clone()), 0), Ok(none));
        let e = require(&CudaProbe::NoDriver, 1)
            .err()
            .map(|e| e.to_string());
        assert!(
            e.as_deref().unwrap_or_default().contains("no CUDA driver"),
            "{e:?}"
        );
    }

    #[test]
    fn the_second_node_shares_gpu_0_on_a_one_gpu_machine() {
        assert_eq!(peer_ordinal(1), 0);
        assert_eq!(peer_ordinal(2), 1);
        assert_eq!(peer_ordinal(8), 1);
    }
}
