//! Logging set-up: level from RUST_LOG, else the configuration, else the run's default;
//! text or JSON on stderr.
//!
//! Logs go to stderr only: stdout carries the lines scripts read (the ready line of
//! `ferry serve`, the tables of `demo`, `bench`, `explain` and `doctor`).
//!
//! The default level depends on the run ([`Run`]): a node (`ferry serve`, a bench peer a
//! user started) logs at `info`, its log being what it has to say; a command that prints a
//! table (`demo`, `bench`, `explain`, `doctor`) logs at `warn`, so that its table is not
//! interleaved with the `info` lines of the nodes it starts. `RUST_LOG` overrides either,
//! and so does `telemetry.log_level` when it is set to something other than its built-in
//! default (`"info"`, which cannot be told apart from a level nobody set).
//!
//! Transfers are traced as spans at `debug` (module `ferry_actors::transfer`): a `transfer`
//! span per outbound op (fields id, peer, transport, direction, bytes) with a child per
//! phase (`grant`, `copy`, `ack`; a put has `queued` instead of `grant`), and an `inbound`
//! span per inbound transfer (id, peer, bytes) with `reserve`, `receive` and `deliver`. A
//! span that closes is logged with its busy and idle time, so
//! `RUST_LOG=ferry_actors::transfer=debug` shows where each transfer spent its time; at
//! the default levels (`info`, `warn`) the spans are disabled and cost nearly nothing.
//!
//! The steps of a layout's path (block lists above all: the sender's offer, the
//! receiver's reservation, import, gather, wait and delivery) are timed by `trace` events
//! under the target `ferry::blocks` (`ferry_actors::TRACE_BLOCKS`), elapsed times in
//! microseconds: `RUST_LOG=warn,ferry::blocks=trace`.

use std::io::IsTerminal;

use ferry_config::{LogFormat, TelemetryConfig};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::FmtSpan;

/// What kind of run the logs belong to: it picks the level used when neither `RUST_LOG`
/// nor the configuration chooses one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Run {
    /// A node whose log is its output (`ferry serve`): `info`.
    Node,
    /// A command that prints a table or report on stdout (`demo`, `bench`, `explain`,
    /// `doctor`): `warn`.
    Command,
}

impl Run {
    /// The level of this run when nothing else sets one.
    pub fn default_level(self) -> &'static str {
        match self {
            Run::Node => "info",
            Run::Command => "warn",
        }
    }
}

/// The filter directive used when `RUST_LOG` is unset (or unusable): the configuration's
/// `log_level` when it differs from its built-in default, else the run's default level.
fn fallback_directive(configured: &str, run: Run) -> String {
    let builtin = TelemetryConfig::default().log_level;
    let configured = configured.trim();
    if configured.is_empty() || configured == builtin {
        run.default_level().to_string()
    } else {
        configured.to_string()
    }
}

/// Installs the global subscriber for a node (default level `info`) once; later calls do
/// nothing.
pub fn init(telemetry: &TelemetryConfig) {
    init_for(telemetry, Run::Node);
}

/// Installs the global subscriber for a command-line run that prints a table (default
/// level `warn`) once; later calls do nothing.
pub fn init_command(telemetry: &TelemetryConfig) {
    init_for(telemetry, Run::Command);
}

/// Installs the global subscriber once, with `run`'s default level; later calls do
/// nothing.
pub fn init_for(telemetry: &TelemetryConfig, run: Run) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(fallback_directive(&telemetry.log_level, run)))
        .unwrap_or_else(|_| EnvFilter::new(run.default_level()));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_default_to_warn_and_nodes_to_info() {
        let unset = TelemetryConfig::default().log_level;
        assert_eq!(fallback_directive(&unset, Run::Command), "warn");
        assert_eq!(fallback_directive(&unset, Run::Node), "info");
        assert_eq!(fallback_directive("", Run::Command), "warn");
    }

    #[test]
    fn a_configured_level_overrides_the_default() {
        for run in [Run::Node, Run::Command] {
            assert_eq!(fallback_directive("debug", run), "debug");
            assert_eq!(
                fallback_directive(" ferry=debug,warn ", run),
                "ferry=debug,warn"
            );
            assert_eq!(fallback_directive("error", run), "error");
        }
    }
}
