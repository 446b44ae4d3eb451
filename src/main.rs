//! The `canarygate` command line: a thin layer over the workspace crates.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// canarygate: a client-side verifying reverse proxy for hosted LLM APIs.
#[derive(Debug, Parser)]
#[command(name = "canarygate", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The bundled local prefill/decode engine.
    Engine {
        #[command(subcommand)]
        command: canarygate_engine::cli::EngineCommand,
    },
    /// Read, verify, export, review and prune the audit log.
    Audit(canarygate_proxy::audit::cli::AuditArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result: anyhow::Result<()> = match cli.command {
        Command::Engine { command } => {
            canarygate_engine::cli::run(command).map_err(|error| anyhow::anyhow!(error))
        }
        Command::Audit(args) => {
            canarygate_proxy::audit::cli::run(args).map_err(|error| anyhow::anyhow!(error))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("canarygate: {error:#}");
            ExitCode::FAILURE
        }
    }
}
