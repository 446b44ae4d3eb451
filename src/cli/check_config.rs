//! `canarygate check-config FILE`: validate a policy and exit.

use clap::Args;

/// Arguments of `canarygate check-config`.
#[derive(Debug, Args)]
pub struct CheckConfigArgs {
    /// Policy file, or `preset:NAME` for a shipped preset.
    file: String,
}

/// Loads the policy (every error names the file, line and column), then
/// builds its providers' clients as `serve` does (their CA and tokenizer
/// files read), without their managed keys.
pub fn run(args: CheckConfigArgs) -> anyhow::Result<()> {
    let policy = super::common::load_policy(Some(&args.file))?;
    canarygate_proxy::Upstreams::check(&policy)
        .map_err(|error| anyhow::anyhow!("{}: {error}", args.file))?;
    println!("{}: ok", args.file);
    Ok(())
}
