//! `canarygate demo`: the incident replay ([`crate::demo`]).

use clap::Args;

use super::common::runtime;
use crate::demo::DemoOptions;

/// Arguments of `canarygate demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Print the numbers as one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Client sessions (each sends 4 requests); fewer makes a quicker run.
    #[arg(long, default_value_t = 48, value_parser = clap::value_parser!(u32).range(1..))]
    sessions: u32,
}

/// Runs the replay and prints what the clients received.
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let report = runtime()?.block_on(crate::demo::run(&DemoOptions {
        sessions: args.sessions as usize,
        ..Default::default()
    }))?;
    if args.json {
        println!("{}", report.json());
    } else {
        print!("{}", report.table());
    }
    Ok(())
}
