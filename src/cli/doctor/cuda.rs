//! What `ferry doctor` checks of the CUDA layer: the driver and its devices, peer access
//! between them, memory pools exportable to another process (with the two-process test),
//! how block lists are copied, and GPUDirect RDMA. These are the driver's, whichever
//! transport uses them; where a finding names the transport that needs a feature, it is
//! the one that declares the device path.

use ferry_config::TransportName;
use ferry_transports::cuda::{BlockCopies, CudaDriver, CudaProbe};
use ferry_transports::transport::{DevicePath, Finding, Library, Status};

use super::PoolTest;
use super::host::human_size;

/// Whether any of `named` declares it is built on `library`.
fn names_library(named: &[TransportName], library: Library) -> bool {
    named
        .iter()
        .any(|t| ferry_transports::registry::declared(*t).library == Some(library))
}

/// The check of the driver itself.
pub(super) const CUDA: &str = "cuda";

pub(super) fn cuda_findings(
    probe: &CudaProbe,
    pool_export: &[PoolTest],
    named: &[TransportName],
) -> Vec<Finding> {
    let gpu_named = names_library(named, Library::Cuda);
    match probe {
        CudaProbe::NoDriver => {
            let status = if gpu_named {
                Status::Warn
            } else {
                Status::Skipped
            };
            vec![
                Finding::new(CUDA, status, "no CUDA driver: GPU transports disabled").remedy(
                    "to move GPU memory, install the NVIDIA driver (CUDA 12 or later), or run \
                     the container with the NVIDIA runtime (--gpus all) so libcuda.so.1 is \
                     mounted",
                ),
            ]
        }
        CudaProbe::Failed {
            cuda_version,
            error,
        } => {
            let version = cuda_version
                .map(|v| format!(" (CUDA {})", version_text(v)))
                .unwrap_or_default();
            vec![
                Finding::new(
                    CUDA,
                    Status::Problem,
                    format!("the CUDA driver{version} loads but does not work: {error}"),
                )
                .remedy(
                    "check nvidia-smi; in a container, that /dev/nvidia* are mounted; after a \
                     driver upgrade, reboot so the kernel module matches the library",
                ),
            ]
        }
        CudaProbe::Ready(driver) => ready_findings(driver, pool_export),
    }
}

fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

fn ready_findings(driver: &CudaDriver, pool_export: &[PoolTest]) -> Vec<Finding> {
    let module = driver
        .kernel_module
        .as_ref()
        .map(|m| format!("driver {m}, "))
        .unwrap_or_default();
    let n = driver.devices.len();
    let mut out = Vec::new();
    let summary = format!(
        "{module}CUDA {}, {n} device{}",
        driver.cuda_version_text(),
        if n == 1 { "" } else { "s" }
    );
    out.push(if driver.cuda_version < 12000 {
        Finding::new(CUDA, Status::Warn, format!("{summary}: older than CUDA 12"))
            .remedy("update the NVIDIA driver to one that supports CUDA 12 or later")
    } else if n == 0 {
        Finding::new(CUDA, Status::Warn, format!("{summary}: no GPU visible")).remedy(
            "check CUDA_VISIBLE_DEVICES, and in a container that GPUs are requested \
             (--gpus all, or an nvidia.com/gpu resource)",
        )
    } else {
        Finding::new(CUDA, Status::Ok, summary)
    });
    for d in &driver.devices {
        out.push(Finding::new(
            format!("gpu {}", d.ordinal),
            Status::Ok,
            format!(
                "{}, {}, pci {}, {}",
                d.name,
                d.uuid,
                d.pci_bus_id,
                human_size(d.total_memory)
            ),
        ));
    }
    if n == 0 {
        return out;
    }
    out.push(peer_access_finding(driver));
    out.push(pool_finding(driver, pool_export));
    out.push(rdma_finding(driver));
    out
}

fn peer_access_finding(driver: &CudaDriver) -> Finding {
    const CHECK: &str = "peer access";
    let n = driver.devices.len();
    if n < 2 {
        return Finding::new(CHECK, Status::Skipped, "needs 2 GPUs");
    }
    let missing: Vec<String> = driver
        .peer_access
        .iter()
        .enumerate()
        .flat_map(|(i, row)| {
            row.iter()
                .enumerate()
                .filter(move |&(j, &ok)| i != j && !ok)
                .map(move |(j, _)| format!("GPU{i}->GPU{j}"))
        })
        .collect();
    if missing.is_empty() {
        return Finding::new(
            CHECK,
            Status::Ok,
            format!("every pair of the {n} GPUs can map each other's memory"),
        );
    }
    Finding::new(
        CHECK,
        Status::Warn,
        format!(
            "no peer access for {}: copies between them go through host memory (~55 GB/s \
             pinned) instead of the copy engine (~396 GB/s between H200s)",
            missing.join(", ")
        ),
    )
    .remedy(
        "check `nvidia-smi topo -m` (NV# or PIX links allow peer access, SYS may not); \
         disable PCIe ACS or set the IOMMU to passthrough; make sure both GPUs are visible \
         to this process",
    )
}

/// The pool export check: what each GPU declares, and the two-process export/import test
/// ([`pool_test`]) on those that declare it.
fn pool_finding(driver: &CudaDriver, tests: &[PoolTest]) -> Finding {
    const CHECK: &str = "pool export";
    let lacking: Vec<String> = driver
        .devices
        .iter()
        .filter(|d| !(d.memory_pools && d.pool_posix_fd && d.posix_fd_handles && d.vmm))
        .map(|d| format!("GPU{}", d.ordinal))
        .collect();
    let failed: Vec<String> = tests
        .iter()
        .filter_map(|t| {
            t.outcome
                .as_ref()
                .err()
                .map(|e| format!("GPU{}: {e}", t.ordinal))
        })
        .collect();
    if lacking.is_empty() && failed.is_empty() {
        if tests.is_empty() {
            return Finding::new(
                CHECK,
                Status::Skipped,
                "every GPU declares VMM and memory pools exportable as POSIX fds; the \
                 two-process export/import test did not run",
            );
        }
        let tested: Vec<String> = tests.iter().map(|t| format!("GPU{}", t.ordinal)).collect();
        return Finding::new(
            CHECK,
            Status::Ok,
            format!(
                "a second process imported a pool and a buffer of {} and read back what was \
                 written (what same-host {} does)",
                tested.join(", "),
                super::super::taking(DevicePath::CopyEngine)
            ),
        );
    }
    let mut found = Vec::new();
    if !lacking.is_empty() {
        found.push(format!(
            "{} cannot export memory pools as POSIX file descriptors (VMM, memory pools or \
             fd handles missing)",
            lacking.join(", ")
        ));
    }
    if !failed.is_empty() {
        found.push(format!(
            "the two-process export/import test failed on {}",
            failed.join("; ")
        ));
    }
    Finding::new(
        CHECK,
        Status::Warn,
        format!(
            "{}: same-host {} cannot use them",
            found.join("; "),
            super::super::taking(DevicePath::CopyEngine)
        ),
    )
    .remedy(format!(
        "update the NVIDIA driver; under vGPU or MIG, pool export may be unavailable: use \
         {} for these GPUs; in a container, make sure every process of the node sees the \
         same GPUs and may pass file descriptors over Unix sockets",
        super::super::taking(DevicePath::PinnedStaging)
    ))
}

/// How block lists (`Layout::Blocks`) of device memory are gathered: one kernel launch on
/// one GPU where the gather kernel loads (`kernel`: it was loaded on the first GPU), one
/// batch of copies per list where the driver has `cuMemcpyBatchAsync` (CUDA 12.8+), else
/// one copy per block.
pub(super) fn block_copies_finding(
    driver: &CudaDriver,
    copies: Option<BlockCopies>,
    kernel: Option<&Result<(), String>>,
) -> Finding {
    const CHECK: &str = "block copies";
    if let (Some(BlockCopies::Batched), Some(Err(why))) = (copies, kernel) {
        return Finding::new(
            CHECK,
            Status::Warn,
            format!(
                "the gather kernel does not load here ({why}): block lists of one GPU are \
                 copied with cuMemcpyBatchAsync, several microseconds a block"
            ),
        )
        .remedy("a driver that compiles PTX for this GPU (any current NVIDIA driver does)");
    }
    match copies {
        Some(BlockCopies::Batched) => Finding::new(
            CHECK,
            Status::Ok,
            "block lists of device memory are gathered by one kernel launch on one GPU (the \
             kernel loaded on GPU 0), and with cuMemcpyBatchAsync between GPUs: one call for \
             all the blocks of a copy",
        ),
        Some(_) => Finding::new(
            CHECK,
            Status::Warn,
            format!(
                "the driver (CUDA {}) has no cuMemcpyBatchAsync: block lists of device memory \
                 are gathered with one cuMemcpyAsync per block (slower for many small blocks)",
                driver.cuda_version_text()
            ),
        )
        .remedy("update the NVIDIA driver to one that supports CUDA 12.8 or later"),
        None => Finding::new(CHECK, Status::Skipped, "not looked up"),
    }
}

fn rdma_finding(driver: &CudaDriver) -> Finding {
    const CHECK: &str = "gpudirect rdma";
    let lacking: Vec<String> = driver
        .devices
        .iter()
        .filter(|d| !d.gpudirect_rdma)
        .map(|d| format!("GPU{}", d.ordinal))
        .collect();
    if lacking.is_empty() {
        let vmm = driver.devices.iter().all(|d| d.gpudirect_rdma_with_vmm);
        let flush = driver
            .devices
            .iter()
            .all(|d| d.rdma_flush_writes_options != 0);
        return Finding::new(
            CHECK,
            Status::Ok,
            format!(
                "supported by every GPU (with VMM: {}, write flush: {}); a NIC and \
                 nvidia-peermem or dma-buf are still needed to use it",
                yes_no(vmm),
                yes_no(flush)
            ),
        );
    }
    Finding::new(
        CHECK,
        Status::Warn,
        format!(
            "not supported by {}: {} moves their memory through host buffers",
            lacking.join(", "),
            super::super::taking(DevicePath::Rdma)
        ),
    )
    .remedy("GPUDirect RDMA needs a data-center GPU, an RDMA NIC on the same PCIe root, and nvidia-peermem loaded (modprobe nvidia_peermem) or dma-buf support")
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}
