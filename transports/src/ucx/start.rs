//! Starting the ucx transport of a node: its engine with the settings `[transport.ucx]`
//! gives, or why the node serves no ucx.

use std::sync::Arc;

use ferry_config::Config;

/// The UCX engine `[transport.ucx]` asks for, or why this node does not serve ucx.
pub fn start(
    config: &Config,
    gpu: Option<&crate::cuda::Device>,
) -> Result<Arc<super::Engine>, super::UcxOff> {
    use super::UcxOff;
    use ferry_config::UcxMode;
    let ucx = &config.transport.ucx;
    match ucx.enabled {
        UcxMode::Off => return Err(UcxOff::Disabled),
        UcxMode::Auto if !crate::transport::has_rdma_device() => return Err(UcxOff::NoRdmaDevice),
        UcxMode::Auto | UcxMode::On => {}
    }
    match start_engine(config, gpu) {
        Ok(engine) => {
            let device = engine.moves(super::MemoryType::Cuda);
            tracing::info!(version = %engine.ucx_version(), device, "ucx transport ready");
            Ok(Arc::new(engine))
        }
        Err(e) => {
            tracing::warn!("the ucx transport is off: {e}");
            Err(UcxOff::DidNotStart(e))
        }
    }
}

/// Starts a UCX engine with the settings `[transport.ucx]` gives; when `gpu` is given, its
/// progress thread works in that GPU's primary context (UCX finds its CUDA device, and
/// copies device memory, in the current context of the thread it runs on).
///
/// # Errors
///
/// As [`super::Engine::start`].
pub fn start_engine(
    config: &Config,
    gpu: Option<&crate::cuda::Device>,
) -> Result<super::Engine, super::UcxTransportError> {
    let mut settings = settings(config);
    settings.cuda_device = gpu.and_then(|d| u32::try_from(d.ordinal()).ok());
    super::Engine::start(&settings)
}

/// The engine settings `[transport.ucx]` gives (with a warning for `on` over UCX's own
/// transport choice): for the node's engine, and for any other engine a tool starts beside
/// it (the bench's baseline).
pub fn settings(config: &Config) -> super::UcxSettings {
    use ferry_config::UcxMode;
    let ucx = &config.transport.ucx;
    // "auto" serves ucx for its RDMA: unless told otherwise, UCX may not use tcp, where it
    // emulates reads in software, listens on ports of its own and checks no key.
    let tls = match (&ucx.tls, ucx.enabled) {
        (Some(tls), _) => Some(tls.clone()),
        (None, UcxMode::Auto) => Some("^tcp".into()),
        (None, _) => None,
    };
    if ucx.enabled == UcxMode::On && tls.is_none() {
        tracing::warn!(
            "transport.ucx.enabled is \"on\" with UCX's own transport choice: over tcp UCX \
             listens on ports of its own, serves reads without checking keys, and may abort \
             this process when a peer dies mid-read; use it where peers are trusted"
        );
    }
    let mut options: Vec<(String, String)> = ucx
        .net_devices
        .iter()
        .map(|d| ("NET_DEVICES".to_string(), d.clone()))
        .chain(ucx.env.iter().map(|(k, v)| (k.clone(), v.clone())))
        .collect();
    // ferry tells UCX the type of every buffer it registers or reads into, so UCX's
    // memory-type cache is never needed; and it is wrong for device memory of a CUDA pool
    // whose allocations it did not see (without the wheel's CUDA hooks, or for memory
    // allocated before UCX loaded), which it then takes for host memory: measured on an
    // H100 with UCX 1.22, `ucp_mem_map` of pool memory failed (UCS_ERR_INVALID_PARAM).
    // UCX applies this setting process-wide (from 1.16 on, a global option): other UCX
    // users of the process see it too. A setting of the user's (`env` here, or
    // `UCX_MEMTYPE_CACHE` in the environment) wins.
    if !ucx.env.contains_key("MEMTYPE_CACHE") && std::env::var_os("UCX_MEMTYPE_CACHE").is_none() {
        options.push(("MEMTYPE_CACHE".to_string(), "n".to_string()));
    }
    super::UcxSettings {
        library: ucx.library.clone(),
        tls,
        options,
        progress_spin: ucx.progress_spin,
        op_timeout: ucx.op_timeout,
        name: Some(config.node.name.clone()),
        ..super::UcxSettings::default()
    }
}
