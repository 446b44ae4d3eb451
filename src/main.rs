//! The `canarygate` command line: a thin layer over the workspace crates.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, anyhow};
use canarygate_policies::Policy;
use clap::{Args, Parser, Subcommand};

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
    },
    /// The bundled local prefill/decode engine.
    Engine {
        #[command(subcommand)]
        command: canarygate_engine::cli::EngineCommand,
    },
    /// Read, verify, export, review and prune the audit log.
    Audit(canarygate_proxy::audit::cli::AuditArgs),
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
        Command::Demo { json } => demo(json),
        Command::Engine { command } => canarygate_engine::cli::run(command).map_err(|e| anyhow!(e)),
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
        server.run(shutdown_signal()).await?;
        Ok(())
    })
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

fn demo(json: bool) -> anyhow::Result<()> {
    let report = runtime()?
        .block_on(canarygate_proxy::demo::run(
            &canarygate_proxy::demo::DemoOptions::default(),
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
