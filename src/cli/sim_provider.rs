//! `canarygate sim-provider`: the simulated provider (the `canarygate-sim` crate).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use canarygate_sim::{Mode, PrefixCacheConfig, RateLimitConfig, SimConfig};
use clap::Args;

use super::common::{announce, runtime, shutdown_signal};

/// Arguments of `canarygate sim-provider`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Address to listen on (port 0 picks a free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:9000")]
    listen: SocketAddr,
    /// Context window in tokens; larger prompts get HTTP 400 context_length_exceeded.
    #[arg(long, default_value_t = 128_000)]
    context_window: u64,
    /// Most output tokens a request may ask for (max_tokens, max_completion_tokens,
    /// max_output_tokens); more get HTTP 400, as a real model's output cap.
    #[arg(long, default_value_t = SimConfig::default().max_output_tokens)]
    max_output_tokens: u64,
    /// Prefill speed, tokens per second (0: instant).
    #[arg(long, default_value_t = 0.0)]
    prefill_tps: f64,
    /// Decode speed, tokens per second (0: instant).
    #[arg(long, default_value_t = 0.0)]
    decode_tps: f64,
    /// Failure mode: honest, leak-on-overflow, truncate-head, truncate-tail, swap, cut,
    /// stall-first-byte, stall-mid-stream, rate-limited, overloaded.
    #[arg(long, default_value = "honest")]
    mode: Mode,
    /// Prefill KV pool in tokens; in leak-on-overflow, longer prompts are answered from
    /// stale KV. Default: the context window times 681,280 / 1,048,576 (the incident's).
    #[arg(long)]
    pool_tokens: Option<u64>,
    /// Positions per page of the shared KV pool.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    page_tokens: u32,
    /// Prompt prefix caching: shortest cached prefix, in tokens (OpenAI: 1024).
    #[arg(long, default_value_t = PrefixCacheConfig::default().min_tokens,
          value_parser = clap::value_parser!(u64).range(1..))]
    cache_min_tokens: u64,
    /// Cached prefixes grow in steps of this many tokens (OpenAI: 128; a
    /// block-aligned cache such as vLLM's: its block size, with the same minimum).
    #[arg(long, default_value_t = PrefixCacheConfig::default().increment_tokens,
          value_parser = clap::value_parser!(u64).range(1..))]
    cache_increment_tokens: u64,
    /// Prompt tokens the prefix cache holds, least recently used dropped first (0: no caching).
    #[arg(long, default_value_t = PrefixCacheConfig::default().capacity_tokens)]
    cache_capacity_tokens: u64,
    /// Seconds an unused cached prefix is kept.
    #[arg(long, default_value_t = PrefixCacheConfig::default().idle_ttl.as_secs())]
    cache_ttl_secs: u64,
    /// Requests admitted per rate-limit window; more get HTTP 429 rate_limit_exceeded.
    #[arg(long, default_value_t = RateLimitConfig::default().requests)]
    rate_limit_requests: u64,
    /// Tokens (prompt plus max_tokens per choice) admitted per rate-limit window.
    #[arg(long, default_value_t = RateLimitConfig::default().tokens)]
    rate_limit_tokens: u64,
    /// Length of the rate-limit window in milliseconds.
    #[arg(long, default_value_t = RateLimitConfig::default().window.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    rate_limit_window_ms: u64,
    /// Require this API key (`Authorization: Bearer KEY`) on every request.
    #[arg(long)]
    api_key: Option<String>,
    /// Serve HTTPS with this PEM certificate chain (needs --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

/// Serves the simulated provider until Ctrl-C or SIGTERM.
pub fn run(args: SimArgs) -> anyhow::Result<()> {
    let config = SimConfig {
        context_window: args.context_window,
        max_output_tokens: args.max_output_tokens,
        prefill_tps: args.prefill_tps,
        decode_tps: args.decode_tps,
        mode: args.mode,
        api_key: args.api_key.clone(),
        pool_tokens: args.pool_tokens,
        page_tokens: args.page_tokens,
        prefix_cache: (args.cache_capacity_tokens > 0).then(|| PrefixCacheConfig {
            min_tokens: args.cache_min_tokens,
            increment_tokens: args.cache_increment_tokens,
            capacity_tokens: args.cache_capacity_tokens,
            idle_ttl: Duration::from_secs(args.cache_ttl_secs),
        }),
        rate_limit: RateLimitConfig {
            requests: args.rate_limit_requests,
            tokens: args.rate_limit_tokens,
            window: Duration::from_millis(args.rate_limit_window_ms),
        },
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(canarygate_sim::tls::server_config(cert, key)?),
        _ => None,
    };
    runtime()?.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        announce(&format!(
            "sim-provider listening on {scheme}://{}",
            listener.local_addr()?
        ));
        canarygate_sim::serve(listener, config, tls, shutdown_signal()).await?;
        Ok(())
    })
}
