//! `canarygate check-config FILE`: validate a policy and exit.

use clap::Args;

/// Arguments of `canarygate check-config`.
#[derive(Debug, Args)]
pub struct CheckConfigArgs {
    /// Policy file, or `preset:NAME` for a shipped preset.
    file: String,
}

/// Loads the policy; every error names the file, line and column.
pub fn run(args: CheckConfigArgs) -> anyhow::Result<()> {
    super::common::load_policy(Some(&args.file))?;
    println!("{}: ok", args.file);
    Ok(())
}
