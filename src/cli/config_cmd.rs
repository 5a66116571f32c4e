//! `ferry config check [FILE]` and `ferry config show`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;
use ferry_config::LoadOptions;

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Exit 0 if FILE (or the layered configuration) is valid and its secret file can be
    /// used; else print why and exit 1.
    Check {
        /// The file to check on its own; without it, the layered configuration is checked.
        file: Option<PathBuf>,
    },
    /// Print the effective merged configuration as TOML.
    Show,
}

pub fn run(file: Option<PathBuf>, overrides: &[String], cmd: Command) -> anyhow::Result<ExitCode> {
    match cmd {
        Command::Check { file: Some(path) } => {
            // The secret file too: `serve` would refuse a missing, short or open one.
            let checked = ferry_config::load(&LoadOptions::only_file(&path))
                .and_then(|config| config.read_secret().map(|_| config));
            match checked {
                Ok(config) => {
                    warn_deprecated(&config);
                    println!("{}: valid", path.display());
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => {
                    eprintln!("{e}");
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Command::Check { file: None } => {
            let checked = super::load_config(file, overrides, vec![])
                .and_then(|config| Ok(config.read_secret().map(|_| config)?));
            match checked {
                Ok(config) => {
                    warn_deprecated(&config);
                    println!("configuration valid");
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => {
                    eprintln!("{e:#}");
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Command::Show => {
            let config = super::load_config(file, overrides, vec![])?;
            warn_deprecated(&config);
            print!("{}", config.to_toml()?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Says on stderr which keys the configuration set under an old name, and where: they are
/// read for one release only.
fn warn_deprecated(config: &ferry_config::Config) {
    for deprecated in config.deprecated_keys() {
        eprintln!("warning: {deprecated}");
    }
}
