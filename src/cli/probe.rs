//! `canarygate probe`: measure the context a provider really serves.

use std::path::PathBuf;

use anyhow::Context;
use canarygate_proxy::probe::{self, ProbeTarget};
use canarygate_proxy::{provider_api_key, store_probe_result};
use clap::Args;

use super::common::{load_policy, runtime};

/// Arguments of `canarygate probe`.
#[derive(Debug, Args)]
pub struct ProbeArgs {
    /// Policy file, or `preset:NAME`. Default: the embedded `default` preset.
    #[arg(long)]
    config: Option<String>,
    /// Data directory; the result is stored in DATA/probes/, where `serve` reads it.
    #[arg(long, default_value = "canarygate-data")]
    data: PathBuf,
    /// Provider to probe (may be left out when the policy has one).
    #[arg(long)]
    provider: Option<String>,
    /// Model to probe, as clients name it (may be left out when one named route leads to the provider).
    #[arg(long)]
    model: Option<String>,
    /// Replace the provider's base URL, as `serve --upstream` does.
    #[arg(long)]
    upstream: Option<String>,
    /// Most prompt tokens to spend. Default: `[probe] budget_tokens` of the policy.
    #[arg(long)]
    budget_tokens: Option<u64>,
    /// Environment variable with the provider API key, when the policy does not manage one.
    /// Default: the provider's api_key_env, else OPENAI_API_KEY.
    #[arg(long)]
    api_key_env: Option<String>,
    /// Send the requests. Without it, only the cost is printed.
    #[arg(long)]
    yes: bool,
    /// Print the result as one JSON object.
    #[arg(long)]
    json: bool,
}

/// Prints the probe's cost; with `--yes`, runs it and stores the result.
pub fn run(args: ProbeArgs) -> anyhow::Result<()> {
    let mut policy = load_policy(args.config.as_deref())?;
    let target =
        ProbeTarget::from_policy(&policy, args.provider.as_deref(), args.model.as_deref())?;
    if let Some(upstream) = &args.upstream {
        policy.set_base_url(&target.provider, upstream)?;
    }
    let provider = policy
        .provider(&target.provider)
        .context("the probed provider left the policy")?;
    let budget = args.budget_tokens.unwrap_or(policy.probe.budget_tokens);
    let cost = target.cost_bound();
    eprintln!(
        "probe of provider `{}` ({}), model `{}`: advertised window {} tokens",
        target.provider,
        provider.base_url.get_ref(),
        target.model,
        target.advertised_window_tokens
    );
    eprintln!(
        "cost: at most {} requests, {} prompt tokens and {} completion tokens (budget {budget} \
         prompt tokens)",
        cost.requests, cost.prompt_tokens, cost.completion_tokens
    );
    if !args.yes {
        eprintln!("nothing sent: run again with --yes to probe");
        return Ok(());
    }
    let api_key = match provider_api_key(provider, args.api_key_env.as_deref())? {
        Some(key) => Some(key),
        None => std::env::var("OPENAI_API_KEY").ok(),
    };
    eprintln!(
        "{:>13}  {:>6}  {:>8}  {:>15}  result",
        "prompt_tokens", "status", "recalled", "reported_prompt"
    );
    let result = runtime()?.block_on(probe::run(
        &policy,
        &target,
        api_key.as_deref(),
        budget,
        |step| {
            eprintln!(
                "{:>13}  {:>6}  {:>8}  {:>15}  {}",
                step.prompt_tokens,
                step.status,
                format!("{}/{}", step.recalled, step.needles),
                step.prompt_tokens_reported
                    .map_or_else(|| "-".to_owned(), |n| n.to_string()),
                step.problem.as_deref().unwrap_or("ok")
            );
        },
    ))?;
    let stored = store_probe_result(&args.data, &result)?;
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        println!(
            "effective limit: {} tokens of an advertised {}; over-window request: {}; {}",
            result.effective_limit_tokens,
            result.advertised_window_tokens,
            result
                .over_window_status
                .map_or_else(|| "not sent".to_owned(), |s| format!("HTTP {s}")),
            if result.trusted {
                "trusted with its whole window"
            } else {
                "NOT trusted beyond the effective limit"
            }
        );
    }
    eprintln!(
        "spent {} prompt tokens; stored in {} (serve picks it up within 30 s)",
        result.tokens_spent,
        stored.display()
    );
    Ok(())
}
