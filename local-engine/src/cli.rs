//! `canarygate engine ...` subcommands.

use clap::Subcommand;

/// Subcommands of `canarygate engine`.
#[derive(Debug, Subcommand)]
pub enum EngineCommand {}

/// Runs one `canarygate engine` subcommand.
pub fn run(command: EngineCommand) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match command {}
}
