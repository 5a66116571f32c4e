//! `ferry doctor` (being built).

use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct Args {}

pub fn run(
    _config: Option<std::path::PathBuf>,
    _overrides: &[String],
    _args: Args,
) -> anyhow::Result<ExitCode> {
    anyhow::bail!("ferry doctor is not built yet")
}
