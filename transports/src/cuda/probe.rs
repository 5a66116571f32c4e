//! What the CUDA driver of this machine offers: presence, version, devices, peer access and
//! the attributes the GPU transports rely on. Read-only: it creates no context and
//! allocates nothing on the GPUs.

use std::ffi::{CStr, c_char, c_int};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys::{self, CUdevice_attribute};

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaProbe {
    /// The driver library (`libcuda.so.1`) cannot be loaded: GPU transports are disabled.
    NoDriver,
    /// The library loads but the driver does not work (`cuInit` or a query failed).
    Failed {
        /// The driver's CUDA version, when it could be read (e.g. `13000` for 13.0).
        cuda_version: Option<i32>,
        /// What failed, with the driver's error code.
        error: String,
    },
    /// The driver works; it may still see no device.
    Ready(CudaDriver),
}

/// A working CUDA driver and its devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDriver {
    /// The highest CUDA version the driver supports, as the driver encodes it
    /// (`1000 * major + 10 * minor`: `13000` is 13.0).
    pub cuda_version: i32,
    /// The kernel module's version line (`/proc/driver/nvidia/version`), when readable.
    pub kernel_module: Option<String>,
    /// The devices, by ordinal.
    pub devices: Vec<CudaDevice>,
    /// `peer_access[i][j]`: device `i` can map device `j`'s memory (false on the diagonal).
    pub peer_access: Vec<Vec<bool>>,
}

/// One GPU and the attributes ferry's transports need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDevice {
    /// Device ordinal (as `CUDA_VISIBLE_DEVICES` numbers them).
    pub ordinal: i32,
    /// Marketing name, e.g. "NVIDIA H200".
    pub name: String,
    /// UUID as nvidia-smi prints it (`GPU-xxxxxxxx-...`).
    pub uuid: String,
    /// PCI bus id, e.g. `0000:18:00.0`.
    pub pci_bus_id: String,
    /// Device memory in bytes.
    pub total_memory: u64,
    /// Virtual memory management (`cuMemCreate`/`cuMemMap`) is supported.
    pub vmm: bool,
    /// Memory can be exported as a POSIX file descriptor (what same-host IPC passes).
    pub posix_fd_handles: bool,
    /// Stream-ordered memory pools are supported.
    pub memory_pools: bool,
    /// Memory pools can be exported as POSIX file descriptors.
    pub pool_posix_fd: bool,
    /// GPUDirect RDMA is supported (a NIC may read and write this GPU's memory).
    pub gpudirect_rdma: bool,
    /// GPUDirect RDMA works with VMM allocations.
    pub gpudirect_rdma_with_vmm: bool,
    /// `cuFlushGPUDirectRDMAWrites` options bit mask (0: no flush support).
    pub rdma_flush_writes_options: i32,
}

impl CudaDriver {
    /// The version as `major.minor`.
    pub fn cuda_version_text(&self) -> String {
        version_text(self.cuda_version)
    }
}

/// `13000` as `"13.0"`.
fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// Probes the CUDA driver. Never panics for a missing library and never blocks for long
/// (the driver's own initialisation, up to a second or two on a large machine).
///
/// A machine with the library but no GPU gives [`CudaProbe::Ready`] with no devices.
pub fn probe() -> CudaProbe {
    if !driver_library_loads() {
        return CudaProbe::NoDriver;
    }
    // The presence check above is what keeps cudarc from panicking; catching a panic is only
    // a second line for a driver so old that it lacks an entry point of the 12.8 bindings.
    std::panic::catch_unwind(probe_loaded_driver).unwrap_or_else(|_| CudaProbe::Failed {
        cuda_version: None,
        error: "the driver lacks an entry point ferry needs (driver older than CUDA 12)".into(),
    })
}

/// True when cudarc can load the driver library (the same names it will try later).
fn driver_library_loads() -> bool {
    // SAFETY: this only tries to dlopen the driver library under cudarc's candidate names and
    // drops the handle. Loading libcuda runs its initialisers, which NVIDIA designs to run in
    // any process; no Rust invariant depends on the library's state.
    unsafe { sys::is_culib_present() }
}

fn probe_loaded_driver() -> CudaProbe {
    let cuda_version = driver_version().ok();
    if let Err(e) = result::init() {
        if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE {
            return CudaProbe::Ready(CudaDriver {
                cuda_version: cuda_version.unwrap_or(0),
                kernel_module: kernel_module(),
                devices: Vec::new(),
                peer_access: Vec::new(),
            });
        }
        return CudaProbe::Failed {
            cuda_version,
            error: format!("cuInit failed: {}", code(&e)),
        };
    }
    match ready_driver(cuda_version) {
        Ok(driver) => CudaProbe::Ready(driver),
        Err((what, e)) => CudaProbe::Failed {
            cuda_version,
            error: format!("{what} failed: {}", code(&e)),
        },
    }
}

type Failure = (&'static str, DriverError);

fn ready_driver(cuda_version: Option<i32>) -> Result<CudaDriver, Failure> {
    let cuda_version = match cuda_version {
        Some(v) => v,
        None => driver_version().map_err(|e| ("cuDriverGetVersion", e))?,
    };
    let count = result::device::get_count().map_err(|e| ("cuDeviceGetCount", e))?;
    let mut handles = Vec::new();
    let mut devices = Vec::new();
    for ordinal in 0..count {
        let dev = result::device::get(ordinal).map_err(|e| ("cuDeviceGet", e))?;
        handles.push(dev);
        devices.push(device(ordinal, dev)?);
    }
    let mut peer_access = vec![vec![false; handles.len()]; handles.len()];
    for (i, &a) in handles.iter().enumerate() {
        for (j, &b) in handles.iter().enumerate() {
            if i != j {
                peer_access[i][j] =
                    can_access_peer(a, b).map_err(|e| ("cuDeviceCanAccessPeer", e))?;
            }
        }
    }
    Ok(CudaDriver {
        cuda_version,
        kernel_module: kernel_module(),
        devices,
        peer_access,
    })
}

fn device(ordinal: i32, dev: sys::CUdevice) -> Result<CudaDevice, Failure> {
    let attr = |a: CUdevice_attribute| {
        // SAFETY: `dev` came from cuDeviceGet after a successful cuInit; the attribute is a
        // plain integer query.
        unsafe { result::device::get_attribute(dev, a) }.map_err(|e| ("cuDeviceGetAttribute", e))
    };
    use CUdevice_attribute::*;
    // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in the pool's handle-type bit mask.
    const POSIX_FD_BIT: i32 = 0x1;
    Ok(CudaDevice {
        ordinal,
        name: result::device::get_name(dev).map_err(|e| ("cuDeviceGetName", e))?,
        uuid: uuid_text(&result::device::get_uuid(dev).map_err(|e| ("cuDeviceGetUuid", e))?),
        pci_bus_id: pci_bus_id(dev).map_err(|e| ("cuDeviceGetPCIBusId", e))?,
        // SAFETY: `dev` came from cuDeviceGet after a successful cuInit.
        total_memory: unsafe { result::device::total_mem(dev) }
            .map_err(|e| ("cuDeviceTotalMem", e))? as u64,
        vmm: attr(CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)? != 0,
        posix_fd_handles: attr(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)?
            != 0,
        memory_pools: attr(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0,
        pool_posix_fd: attr(CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)? & POSIX_FD_BIT
            != 0,
        gpudirect_rdma: attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)? != 0,
        gpudirect_rdma_with_vmm: attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)?
            != 0,
        rdma_flush_writes_options: attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS)?,
    })
}

fn driver_version() -> Result<i32, DriverError> {
    let mut version: c_int = 0;
    // SAFETY: the library is loaded (checked by the caller); the driver writes one int
    // through a pointer to a live local. cuDriverGetVersion needs no cuInit.
    unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
    Ok(version)
}

fn can_access_peer(a: sys::CUdevice, b: sys::CUdevice) -> Result<bool, DriverError> {
    let mut yes: c_int = 0;
    // SAFETY: both devices came from cuDeviceGet after cuInit; the driver writes one int
    // through a pointer to a live local.
    unsafe { sys::cuDeviceCanAccessPeer(&mut yes, a, b) }.result()?;
    Ok(yes != 0)
}

pub(super) fn pci_bus_id(dev: sys::CUdevice) -> Result<String, DriverError> {
    // "dddd:bb:dd.f" is 13 bytes with its NUL; the driver documents 13 as enough.
    let mut buf = [0 as c_char; 32];
    // SAFETY: `dev` came from cuDeviceGet after cuInit; the driver writes at most `len`
    // bytes, NUL included, into the buffer, which lives across the call.
    unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, dev) }.result()?;
    let bytes: Vec<u8> = buf.iter().map(|&c| c as u8).collect();
    Ok(CStr::from_bytes_until_nul(&bytes)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default())
}

/// The driver's UUID bytes as nvidia-smi prints them.
pub(super) fn uuid_text(uuid: &sys::CUuuid) -> String {
    let hex: Vec<String> = uuid
        .bytes
        .iter()
        .map(|&b| format!("{:02x}", b as u8))
        .collect();
    let hex = hex.concat();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// The error code's name, e.g. `CUDA_ERROR_NO_DEVICE`.
fn code(e: &DriverError) -> String {
    format!("{:?}", e.0)
}

fn kernel_module() -> Option<String> {
    let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    module_version(&text)
}

/// The version in the kernel module's banner, whichever wording the module uses:
/// "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 ..." or
/// "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build ...".
fn module_version(text: &str) -> Option<String> {
    let line = text.lines().next()?;
    line.split_whitespace()
        .find(|w| w.contains('.') && w.chars().all(|c| c.is_ascii_digit() || c == '.'))
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_version_is_found_in_either_banner() {
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)  Sun Jul 27 2025\nGCC version: gcc 12";
        let closed = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024";
        assert_eq!(module_version(open).as_deref(), Some("580.65.06"));
        assert_eq!(module_version(closed).as_deref(), Some("535.183.01"));
        assert_eq!(module_version("garbage"), None);
    }

    #[test]
    fn versions_read_as_major_minor() {
        assert_eq!(version_text(13000), "13.0");
        assert_eq!(version_text(12080), "12.8");
    }

    #[test]
    fn uuid_is_grouped_like_nvidia_smi() {
        let uuid = sys::CUuuid {
            bytes: std::array::from_fn(|i| i as c_char),
        };
        assert_eq!(uuid_text(&uuid), "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f");
    }

    /// Runs everywhere: without a driver it must say so, never panic.
    #[test]
    fn probe_never_panics() {
        match probe() {
            CudaProbe::NoDriver | CudaProbe::Failed { .. } | CudaProbe::Ready(_) => {}
        }
    }
}
