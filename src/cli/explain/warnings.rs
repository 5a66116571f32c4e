//! `ferry explain`'s warnings where a route runs far below what the hardware between the
//! two ends allows, read from the transports' declared device paths, and its note on GPU
//! transports. Pure.

use ferry::Explanation;
use ferry_config::{Locality, MemoryClass, Rule, TransportName};
use ferry_transports::cuda::CudaProbe;
use ferry_transports::transport::{Capabilities, DevicePath, Viability};

use super::super::taking;
use super::skip;

/// Copy engine between two H200 GPUs, large transfers (BASELINES.md).
const COPY_ENGINE_GBPS: u32 = 396;
/// Pinned host <-> device, each way, 16 MiB and up (BASELINES.md).
const PINNED_GBPS: u32 = 55;

/// Warnings when the route is expected to run far below what the hardware between the two
/// ends allows. Read from the transports' declared device paths ([`DevicePath`]); what an
/// RDMA path costs without an RDMA device is the transport's to say ([`route_notes`]).
/// Pure.
pub fn performance_warnings(explanation: &Explanation, rules: &[Rule]) -> Vec<String> {
    let q = &explanation.query;
    // Where the bytes really land: a transport that cannot land in the peer's device memory
    // lands in its host memory.
    let landing = explanation.chosen.as_ref().map_or(q.dst, |r| r.landing);
    let device = q.src == MemoryClass::Device || landing == MemoryClass::Device;
    let Some(chosen) = explanation.chosen.as_ref().map(|r| r.transport) else {
        return Vec::new();
    };
    if !device {
        return Vec::new();
    }
    let same_host = matches!(q.locality, Locality::SameHost | Locality::SameProcess);
    let mut out: Vec<String> = path_warning(explanation, chosen, same_host)
        .into_iter()
        .collect();
    let rule = explanation.rule.as_ref().and_then(|(i, _)| rules.get(*i));
    if let Some(rule) = rule
        && path(chosen) == DevicePath::HostCopy
    {
        out.extend(rule_order_warning(rule, chosen, same_host));
    }
    out
}

/// How `transport` declares it moves device memory.
fn path(transport: TransportName) -> DevicePath {
    ferry_transports::registry::declared(transport).device_path
}

/// What the path of `chosen` costs device memory, where that is far below the hardware.
fn path_warning(
    explanation: &Explanation,
    chosen: TransportName,
    same_host: bool,
) -> Option<String> {
    let copy_engine = taking(DevicePath::CopyEngine);
    let copy_engine_status = || match explanation
        .skipped
        .iter()
        .find(|(t, _)| path(*t) == DevicePath::CopyEngine)
    {
        Some((t, why)) => format!("{t} was passed over: {}", skip(*t, why).reason),
        None => format!("the rule does not list {copy_engine}"),
    };
    Some(match path(chosen) {
        DevicePath::PinnedStaging if same_host => format!(
            "device memory on one host goes through {chosen} (device -> pinned host -> device), \
             bounded by pinned host<->device copies (~{PINNED_GBPS} GB/s each way); \
             {copy_engine} would use the copy engine (~{COPY_ENGINE_GBPS} GB/s between H200 \
             GPUs, about 7x more); {}",
            copy_engine_status()
        ),
        DevicePath::PinnedStaging => format!(
            "device memory to another host goes through {chosen}: two pinned host<->device \
             copies (~{PINNED_GBPS} GB/s each) around the network; {} with GPUDirect RDMA \
             would let the NIC read and write GPU memory directly",
            taking(DevicePath::Rdma)
        ),
        DevicePath::HostCopy => format!(
            "device memory goes over {chosen}: it is copied to host memory first \
             (~{PINNED_GBPS} GB/s pinned) and then through the socket stack, far below the copy \
             engine (~{COPY_ENGINE_GBPS} GB/s between H200 GPUs)"
        ),
        _ => return None,
    })
}

/// Whether `rule` lists `chosen`, a transport that copies device memory through host
/// memory, before every transport with a device path of its own.
fn rule_order_warning(rule: &Rule, chosen: TransportName, same_host: bool) -> Option<String> {
    let host_first = rule
        .transports
        .iter()
        .position(|t| path(*t) == DevicePath::HostCopy);
    let device_first = rule
        .transports
        .iter()
        .position(|t| path(*t) != DevicePath::HostCopy);
    let host_before_device = match (host_first, device_first) {
        (Some(h), Some(d)) => h < d,
        (Some(_), None) => true,
        _ => false,
    };
    if !host_before_device {
        return None;
    }
    let staging = taking(DevicePath::PinnedStaging);
    let better = if same_host {
        format!("{} (or {staging})", taking(DevicePath::CopyEngine))
    } else {
        format!("{} or {staging}", taking(DevicePath::Rdma))
    };
    Some(format!(
        "rule \"{}\" sends device memory through {chosen}, which moves host memory only: device \
         buffers would cross host memory (~{PINNED_GBPS} GB/s pinned) and the socket stack \
         instead of the copy engine (~{COPY_ENGINE_GBPS} GB/s between H200 GPUs); list {better} \
         before {chosen}",
        rule.name
    ))
}

/// What to say about GPU transports when device memory is involved. Pure.
pub fn gpu_note(probe: &CudaProbe, catalog: &[(Capabilities, Viability)]) -> String {
    let unbuilt: Vec<&str> = catalog
        .iter()
        .filter(|(c, v)| c.memory.contains(&MemoryClass::Device) && *v != Viability::Viable)
        .map(|(c, _)| c.name.as_str())
        .collect();
    let any_viable = catalog
        .iter()
        .any(|(c, v)| c.memory.contains(&MemoryClass::Device) && *v == Viability::Viable);
    let driver = match probe {
        CudaProbe::NoDriver => Some("no CUDA driver on this machine".to_string()),
        CudaProbe::Failed { error, .. } => Some(format!("the CUDA driver does not work ({error})")),
        CudaProbe::Ready(d) if d.devices.is_empty() => Some("no GPU is visible".to_string()),
        CudaProbe::Ready(_) => None,
    };
    match (driver, any_viable) {
        (Some(why), _) if unbuilt.is_empty() => {
            format!("GPU transports are not available: {why}")
        }
        (Some(why), _) => format!(
            "GPU transports are not available: {why} (and {} not viable in this build)",
            unbuilt.join(", ")
        ),
        (None, false) => format!(
            "GPU transports are not available: {} not viable in this build",
            unbuilt.join(", ")
        ),
        (None, true) => "GPU transports are available".to_string(),
    }
}
