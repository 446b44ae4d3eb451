//! The subcommands, one file each, and what they share: loading a policy,
//! the async runtime, the readiness line and the shutdown signal.

mod audit;
mod check_config;
mod common;
mod demo;
mod engine;
mod hash_key;
mod probe;
mod review;
mod serve;
mod sim_provider;
mod topic;

use clap::{Parser, Subcommand};

/// canarygate: a client-side verifying reverse proxy for hosted LLM APIs.
#[derive(Debug, Parser)]
#[command(name = "canarygate", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the verifying proxy.
    Serve(serve::ServeArgs),
    /// Validate a policy file and exit (0 when valid).
    CheckConfig(check_config::CheckConfigArgs),
    /// Print the SHA-256 of a client key read from standard input, for `auth.client_keys`.
    HashKey,
    /// Run the simulated OpenAI-compatible provider (tests, benchmarks, demos).
    SimProvider(sim_provider::SimArgs),
    /// Replay the KV-pool leak incident against a simulated provider, direct and through canarygate.
    Demo(demo::DemoArgs),
    /// The bundled local prefill/decode engine.
    Engine {
        #[command(subcommand)]
        command: engine::EngineCommand,
    },
    /// Read, verify, export, review and prune the audit log.
    Audit(audit::AuditArgs),
    /// Measure the context a provider really serves (needle prompts), for `serve`'s preflight.
    Probe(probe::ProbeArgs),
    /// The topic check's model: calibrate its threshold on labelled question/answer pairs.
    Topic {
        #[command(subcommand)]
        command: topic::TopicCommand,
    },
}

/// Logs to standard error, filtered by `CANARYGATE_LOG` (default `info`).
pub fn init_logging(command: &Command) {
    // The demo's in-process proxy would log every block it is there to show.
    let default_log = match command {
        Command::Demo(_) => "error",
        _ => "info",
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CANARYGATE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_log)),
        )
        .init();
}

/// Runs one subcommand.
pub fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve(args) => serve::run(args),
        Command::CheckConfig(args) => check_config::run(args),
        Command::HashKey => hash_key::run(),
        Command::SimProvider(args) => sim_provider::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Engine { command } => engine::run(command),
        Command::Audit(args) => audit::run(args),
        Command::Probe(args) => probe::run(args),
        Command::Topic { command } => topic::run(command),
    }
}
