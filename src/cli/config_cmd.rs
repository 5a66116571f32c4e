//! `ferry config check [FILE]` and `ferry config show`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;
use ferry_config::LoadOptions;

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Exit 0 if FILE (or the layered configuration) is valid; else print why and exit 1.
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
            match ferry_config::load(&LoadOptions::only_file(&path)) {
                Ok(_) => {
                    println!("{}: valid", path.display());
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => {
                    eprintln!("{e}");
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Command::Check { file: None } => match super::load_config(file, overrides, vec![]) {
            Ok(_) => {
                println!("configuration valid");
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => {
                eprintln!("{e:#}");
                Ok(ExitCode::FAILURE)
            }
        },
        Command::Show => {
            let config = super::load_config(file, overrides, vec![])?;
            print!("{}", config.to_toml()?);
            Ok(ExitCode::SUCCESS)
        }
    }
}
