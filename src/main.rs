//! The `canarygate` command line: a thin layer over the workspace crates.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, anyhow};
use canarygate_policies::Policy;
use clap::{Args, Parser, Subcommand};

/// mimalloc instead of glibc malloc: the proxy allocates a few hundred small
/// objects per request across worker threads and the audit writer, where
/// glibc's arenas cost about a quarter of the CPU (see README, Performance).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// canarygate: a client-side verifying reverse proxy for hosted LLM APIs.
#[derive(Debug, Parser)]
#[command(name = "canarygate", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the verifying proxy.
    Serve(ServeArgs),
    /// Validate a policy file and exit (0 when valid).
    CheckConfig {
        /// Policy file, or `preset:NAME` for a shipped preset.
        file: String,
    },
    /// Print the SHA-256 of a client key read from standard input, for `auth.client_keys`.
    HashKey,
    /// Run the simulated OpenAI-compatible provider (tests, benchmarks, demos).
    SimProvider(SimArgs),
    /// Replay the KV-pool leak incident against a simulated provider, direct and through canarygate.
    Demo {
        /// Print the numbers as one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Client sessions (each sends 4 requests); fewer makes a quicker run.
        #[arg(long, default_value_t = 48, value_parser = clap::value_parser!(u32).range(1..))]
        sessions: u32,
    },
    /// The bundled local prefill/decode engine.
    Engine {
        #[command(subcommand)]
        command: canarygate_engine::cli::EngineCommand,
    },
    /// Read, verify, export, review and prune the audit log.
    Audit(canarygate_proxy::audit::cli::AuditArgs),
    /// Measure the context a provider really serves (needle prompts), for `serve`'s preflight.
    Probe(ProbeArgs),
}

#[derive(Debug, Args)]
struct ProbeArgs {
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

#[derive(Debug, Args)]
struct ServeArgs {
    /// Policy file, or `preset:NAME`. Default: the embedded `default` preset.
    #[arg(long)]
    config: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8787")]
    listen: SocketAddr,
    /// Data directory (install secret, audit log).
    #[arg(long, default_value = "canarygate-data")]
    data: PathBuf,
    /// Replace the base URL of the policy's only provider, e.g. http://127.0.0.1:9000/v1.
    #[arg(long)]
    upstream: Option<String>,
}

#[derive(Debug, Args)]
struct SimArgs {
    /// Address to listen on (port 0 picks a free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:9000")]
    listen: SocketAddr,
    /// Context window in tokens; larger prompts get HTTP 400 context_length_exceeded.
    #[arg(long, default_value_t = 128_000)]
    context_window: u64,
    /// Prefill speed, tokens per second (0: instant).
    #[arg(long, default_value_t = 0.0)]
    prefill_tps: f64,
    /// Decode speed, tokens per second (0: instant).
    #[arg(long, default_value_t = 0.0)]
    decode_tps: f64,
    /// Failure mode: honest, leak-on-overflow, truncate-head, truncate-tail, swap, cut,
    /// stall-first-byte, stall-mid-stream.
    #[arg(long, default_value = "honest")]
    mode: canarygate_proxy::sim::Mode,
    /// Prefill KV pool in tokens; in leak-on-overflow, longer prompts are answered from
    /// stale KV. Default: the context window times 681,280 / 1,048,576 (the incident's).
    #[arg(long)]
    pool_tokens: Option<u64>,
    /// Positions per page of the shared KV pool.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    page_tokens: u32,
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo's in-process proxy would log every block it is there to show.
    let default_log = match cli.command {
        Command::Demo { .. } => "error",
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

    let result = match cli.command {
        Command::Serve(args) => serve(args),
        Command::CheckConfig { file } => load_policy(Some(&file)).map(|_| {
            println!("{file}: ok");
        }),
        Command::HashKey => hash_key(),
        Command::SimProvider(args) => sim_provider(args),
        Command::Demo { json, sessions } => demo(json, sessions as usize),
        Command::Engine { command } => canarygate_engine::cli::run(command).map_err(|e| anyhow!(e)),
        Command::Audit(args) => {
            canarygate_proxy::audit::cli::run(args).map_err(|error| anyhow::anyhow!(error))
        }
        Command::Probe(args) => probe(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("canarygate: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Loads the policy named on the command line, or the default preset.
fn load_policy(config: Option<&str>) -> anyhow::Result<Policy> {
    let policy = match config {
        None => Policy::preset("default")?,
        Some(name) => match name.strip_prefix("preset:") {
            Some(preset) => Policy::preset(preset)?,
            None => {
                let text = std::fs::read_to_string(name)
                    .with_context(|| format!("cannot read policy file {name}"))?;
                Policy::from_toml_str(&text, name)?
            }
        },
    };
    Ok(policy)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut policy = load_policy(args.config.as_deref())?;
    if let Some(upstream) = &args.upstream {
        policy.override_upstream(upstream).map_err(|e| anyhow!(e))?;
    }
    let providers: Vec<String> = policy
        .providers
        .iter()
        .map(|p| format!("{} -> {}", p.name.get_ref(), p.base_url.get_ref()))
        .collect();
    let local_dir = policy.local.model_dir().map(str::to_owned);
    runtime()?.block_on(async move {
        let server = canarygate_proxy::Server::bind(canarygate_proxy::ServeOptions {
            policy,
            listen: args.listen,
            data_dir: args.data,
        })
        .await
        .map_err(|e| anyhow!(e))?;
        let address = server.local_addr()?;
        announce(&format!("canarygate listening on http://{address}"));
        tracing::info!(providers = ?providers, "serving");
        report_startup(server.startup(), &local_dir);
        server.run(shutdown_signal()).await?;
        Ok(())
    })
}

/// Says what `serve` runs with: the local engine (or its absence) and probe
/// results. (The server itself checks, in the background, that each provider
/// answers at all.)
fn report_startup(startup: &canarygate_proxy::Startup, local_dir: &Option<String>) {
    match (&startup.local_engine, local_dir) {
        (Some((window, pool)), Some(dir)) => tracing::info!(
            "local engine: model {dir}, serving a context window of {window} tokens \
             (KV pool {pool} tokens)"
        ),
        _ => tracing::warn!(
            "local engine: none ([local] model_dir is not set); requests over a provider's \
             trusted context are rejected with context_length_exceeded and nothing can fall back"
        ),
    }
    if startup.probes.is_empty() {
        tracing::info!(
            "no context probe results: each provider is trusted with its advertised window \
             (run `canarygate probe`)"
        );
    }
    for probe in &startup.probes {
        tracing::info!(
            "probe result: {}/{} trusted with {} tokens ({})",
            probe.provider,
            probe.model,
            probe.effective_limit_tokens,
            if probe.trusted {
                "its whole advertised window"
            } else {
                "below its advertised window"
            }
        );
    }
}

fn probe(args: ProbeArgs) -> anyhow::Result<()> {
    let mut policy = load_policy(args.config.as_deref())?;
    let target = canarygate_proxy::probe::ProbeTarget::from_policy(
        &policy,
        args.provider.as_deref(),
        args.model.as_deref(),
    )
    .map_err(|e| anyhow!(e))?;
    if let Some(upstream) = &args.upstream {
        policy
            .set_base_url(&target.provider, upstream)
            .map_err(|e| anyhow!(e))?;
    }
    let budget = args.budget_tokens.unwrap_or(policy.probe.budget_tokens);
    let cost = target.cost_bound();
    let base_url = policy
        .providers
        .iter()
        .find(|p| p.name.get_ref() == &target.provider)
        .map(|p| p.base_url.get_ref().clone())
        .unwrap_or_default();
    eprintln!(
        "probe of provider `{}` ({base_url}), model `{}`: advertised window {} tokens",
        target.provider, target.model, target.advertised_window_tokens
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
    let key_var = args.api_key_env.clone().or_else(|| {
        policy
            .providers
            .iter()
            .find(|p| p.name.get_ref() == &target.provider)
            .and_then(|p| p.api_key_env.clone())
    });
    let api_key = match &key_var {
        Some(var) => Some(std::env::var(var).with_context(|| format!("{var} is not set"))?),
        None => std::env::var("OPENAI_API_KEY").ok(),
    };
    eprintln!(
        "{:>13}  {:>6}  {:>8}  {:>15}  result",
        "prompt_tokens", "status", "recalled", "reported_prompt"
    );
    let result = runtime()?.block_on(canarygate_proxy::probe::run(
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
    ));
    let result = result.map_err(|e| anyhow!(e))?;
    let stored = canarygate_proxy::probe::store(&args.data, &result).map_err(|e| anyhow!(e))?;
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

fn sim_provider(args: SimArgs) -> anyhow::Result<()> {
    let config = canarygate_proxy::sim::SimConfig {
        context_window: args.context_window,
        prefill_tps: args.prefill_tps,
        decode_tps: args.decode_tps,
        mode: args.mode,
        api_key: args.api_key.clone(),
        pool_tokens: args.pool_tokens,
        page_tokens: args.page_tokens,
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            Some(canarygate_proxy::tls::server_config(cert, key).map_err(|e| anyhow!(e))?)
        }
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
        canarygate_proxy::sim::serve(listener, config, tls, shutdown_signal()).await?;
        Ok(())
    })
}

fn demo(json: bool, sessions: usize) -> anyhow::Result<()> {
    let report = runtime()?
        .block_on(canarygate_proxy::demo::run(
            &canarygate_proxy::demo::DemoOptions {
                sessions,
                ..Default::default()
            },
        ))
        .map_err(|e| anyhow!(e))?;
    if json {
        println!("{}", report.json());
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

fn hash_key() -> anyhow::Result<()> {
    let mut key = String::new();
    std::io::stdin()
        .read_line(&mut key)
        .context("cannot read the key from standard input")?;
    if key.trim().is_empty() {
        return Err(anyhow!("no key on standard input"));
    }
    println!("{}", canarygate_proxy::identity::client_key_hash(&key));
    Ok(())
}

/// Prints the readiness line (tests and scripts wait for it) and flushes.
fn announce(line: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => return ctrl_c.await.unwrap_or(()),
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    ctrl_c.await.unwrap_or(());
}
