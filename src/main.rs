//! The `canarygate` command line: a thin layer over the workspace crates.
//! Each subcommand is one file under `cli/`; the incident replay that
//! `canarygate demo` runs is [`demo`].

mod cli;
mod demo;

use std::process::ExitCode;

use clap::Parser;

/// mimalloc instead of glibc malloc: the proxy allocates a few hundred small
/// objects per request across worker threads and the audit writer, where
/// glibc's arenas cost about a quarter of the CPU (see bench/README.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    cli::init_logging(&cli.command);
    match cli::run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("canarygate: {error:#}");
            ExitCode::FAILURE
        }
    }
}
