//! Command-line interface: one module per subcommand.

mod bench;
mod config_cmd;
mod demo;
mod doctor;
mod explain;
mod metrics_http;
mod serve;
mod telemetry;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use ferry::{Config, LoadOptions};

/// ferry moves buffers between processes and machines.
#[derive(Debug, Parser)]
#[command(name = "ferry", version, about)]
struct Cli {
    /// Configuration file (TOML or YAML), layered over the system and user files.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Set one configuration key, e.g. `--set limits.mailbox=64` (highest layer).
    #[arg(long = "set", global = true, value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a node until SIGTERM or Ctrl-C, then drain and exit.
    Serve(serve::Args),
    /// Start local node processes and push buffers of mixed sizes through a pipeline.
    Demo(demo::Args),
    /// Measure transfers next to a raw baseline between the same endpoints.
    Bench(Box<bench::Args>),
    /// Show which route a transfer to a peer would take, and why.
    Explain(explain::Args),
    /// Check this machine for what ferry's transports need.
    Doctor(doctor::Args),
    /// Check or show the configuration.
    #[command(subcommand)]
    Config(config_cmd::Command),
}

/// The transport that moves device memory by `path`, to name the way around a slower one
/// (`ipc` for the copy engine), or the path in words where none declares it.
fn taking(path: ferry_transports::transport::DevicePath) -> String {
    ferry_transports::registry::taking(path)
        .map_or_else(|| format!("a {path:?} transport"), |name| name.to_string())
}

/// Writes a new secret file at `path` that only its owner may read (mode 0600), as
/// `Config::read_secret` demands. Fails if the file exists.
fn write_secret_file(path: &std::path::Path, secret: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(secret.as_bytes()))
}

/// Parses `KEY=VALUE` overrides.
fn parse_overrides(raw: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    raw.iter()
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .with_context(|| format!("--set {kv}: expected KEY=VALUE"))
        })
        .collect()
}

/// Loads the layered configuration for this invocation.
fn load_config(
    file: Option<PathBuf>,
    overrides: &[String],
    extra: Vec<(String, String)>,
) -> anyhow::Result<Config> {
    let mut opts = LoadOptions {
        file,
        ..LoadOptions::default()
    };
    opts.overrides = extra;
    opts.overrides.extend(parse_overrides(overrides)?);
    Ok(ferry_config::load(&opts)?)
}

/// Runs the command line; the exit code says whether it succeeded.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve::run(cli.config, &cli.overrides, args),
        Command::Demo(args) => demo::run(args),
        Command::Config(cmd) => config_cmd::run(cli.config, &cli.overrides, cmd),
        Command::Bench(args) => bench::run(cli.config, &cli.overrides, *args),
        Command::Explain(args) => explain::run(cli.config, &cli.overrides, args),
        Command::Doctor(args) => doctor::run(cli.config, &cli.overrides, args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ferry: {e:#}");
            ExitCode::FAILURE
        }
    }
}
