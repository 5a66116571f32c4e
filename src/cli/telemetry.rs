//! Logging set-up: level from RUST_LOG, else the configuration; text or JSON on stderr.
//!
//! Logs go to stderr only: stdout carries the lines scripts read (the ready line of
//! `ferry serve`, the tables of `bench` and `explain`).
//!
//! Transfers are traced as spans at `debug` (module `ferry_actors::transfer`): a `transfer`
//! span per outbound op (fields id, peer, transport, direction, bytes) with a child per
//! phase (`grant`, `copy`, `ack`; a put has `queued` instead of `grant`), and an `inbound`
//! span per inbound transfer (id, peer, bytes) with `reserve`, `receive` and `deliver`. A
//! span that closes is logged with its busy and idle time, so
//! `RUST_LOG=ferry_actors::transfer=debug` shows where each transfer spent its time; at
//! the default level (`info`) the spans are disabled and cost nearly nothing.

use std::io::IsTerminal;

use ferry_config::{LogFormat, TelemetryConfig};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::FmtSpan;

/// Installs the global subscriber once; later calls do nothing.
pub fn init(telemetry: &TelemetryConfig) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&telemetry.log_level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_span_events(FmtSpan::CLOSE)
        // Colours only for a person at a terminal, not in files and log collectors.
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match telemetry.log_format {
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
        _ => builder.try_init(),
    };
}
