//! Logging set-up: level from RUST_LOG, else the configuration; text or JSON on stderr.

use ferry_config::{LogFormat, TelemetryConfig};
use tracing_subscriber::EnvFilter;

/// Installs the global subscriber once; later calls do nothing.
pub fn init(telemetry: &TelemetryConfig) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&telemetry.log_level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match telemetry.log_format {
        LogFormat::Json => builder.json().try_init(),
        _ => builder.try_init(),
    };
}
