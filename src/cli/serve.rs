//! `canarygate serve`: the verifying proxy.

use std::net::SocketAddr;
use std::path::PathBuf;

use canarygate_audit::JournalPriority;
use canarygate_policies::config::DataReaders;
use canarygate_policies::topic::TopicAction;
use canarygate_proxy::{ServeOptions, Server, Startup};
use clap::Args;

use super::audit::DEFAULT_KEY_ENV;
use super::common::{announce, load_policy, runtime_with_workers, shutdown_signal};
use super::review::ReviewSetup;

/// Arguments of `canarygate serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
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
    /// Name stamped on this instance's audit records, so that several
    /// instances' logs merge (`audit export --data A --data B`). Default:
    /// the host's name and the listening port.
    #[arg(long, env = "CANARYGATE_INSTANCE")]
    instance: Option<String>,
    /// Also serve the review page (what `audit ui` serves) on this address,
    /// in this process; the admin token comes from $CANARYGATE_ADMIN_TOKEN.
    /// Overrides the policy's `[review] listen`; off unless one is given.
    #[arg(long, value_name = "ADDR")]
    review_listen: Option<SocketAddr>,
    /// Threads that serve requests (the async runtime's workers), 1 to
    /// 1024. Default: one per CPU. Fewer leave CPUs to the jobs on the same
    /// host and cost less CPU per request there (bench/README.md, 12-05);
    /// the audit log's writers and the topic scorer have threads of their own.
    #[arg(long, env = "CANARYGATE_WORKER_THREADS", value_name = "N",
          value_parser = clap::value_parser!(u16).range(1..=1024))]
    worker_threads: Option<u16>,
}

/// Serves until Ctrl-C or SIGTERM.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let mut policy = load_policy(args.config.as_deref())?;
    if let Some(upstream) = &args.upstream {
        policy.override_upstream(upstream)?;
    }
    let providers: Vec<String> = policy
        .providers
        .iter()
        .map(|p| format!("{} -> {}", p.name.get_ref(), p.base_url.get_ref()))
        .collect();
    let local_dir = policy.local.model_dir().map(str::to_owned);
    let readers = policy.audit.data_readable_by;
    let data = args.data.clone();
    // The page decrypts samples with the key the log encrypts them with.
    let review = args
        .review_listen
        .or(policy.review.listen)
        .map(|listen| {
            let key_env = policy
                .audit
                .encryption_key_env
                .as_ref()
                .map_or(DEFAULT_KEY_ENV, |var| var.get_ref().as_str());
            ReviewSetup::from_env(key_env, listen).map(|setup| (setup, listen))
        })
        .transpose()?;
    let runtime = runtime_with_workers(args.worker_threads.map(usize::from))?;
    let workers = runtime.metrics().num_workers();
    runtime.block_on(async move {
        survive_file_size_limit();
        let server = Server::bind(ServeOptions {
            policy,
            listen: args.listen,
            data_dir: args.data,
            instance: args.instance,
        })
        .await?;
        let address = server.local_addr()?;
        announce(&format!("canarygate listening on http://{address}"));
        tracing::info!(providers = ?providers, "serving");
        tracing::info!("worker threads serving requests: {workers}");
        report_startup(server.startup(), local_dir.as_deref());
        report_audit(server.startup(), &data, readers);
        if let Some((setup, listen)) = review {
            let page = setup.bind(&data, listen).await?;
            tokio::spawn(async move {
                if let Err(error) = page.run(shutdown_signal()).await {
                    tracing::error!(%error, "review page stopped");
                }
            });
        }
        server.run(shutdown_signal()).await?;
        Ok(())
    })
}

/// Gives SIGXFSZ a handler of the process's own. A write past the
/// file-size limit (`ulimit -f`, systemd's `LimitFSIZE=`) raises it, and its
/// default action ends the process, requests in flight and all; handled, the
/// write fails (`EFBIG`) and the audit log reports it as it reports a full
/// disk.
fn survive_file_size_limit() {
    #[cfg(unix)]
    if let Err(error) =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::from_raw(libc::SIGXFSZ))
    {
        tracing::warn!(%error, "cannot handle SIGXFSZ: a write past the file-size limit ends the process");
    }
}

/// Says, once, what the audit store keeps in clear, and who may read it.
fn report_audit(startup: &Startup, data: &std::path::Path, readers: DataReaders) {
    let store = data.join(canarygate_audit::STORE_FILE);
    let readable_by = match readers {
        DataReaders::Owner => "readable by the owner only",
        DataReaders::Group => "readable by the owner and its group ([audit] data_readable_by)",
        DataReaders::Anyone => {
            "with the access its files have ([audit] data_readable_by = \"anyone\": not checked)"
        }
    };
    if startup.samples_encrypted {
        tracing::info!(
            "audit: samples (prompt and answer text) are encrypted in {}; records \
             (hashes, model, token counts, checks, timings) are in clear, {readable_by}",
            store.display()
        );
    } else {
        tracing::warn!(
            "audit: no [audit] encryption_key_env, so {} keeps in clear the prompt and \
             answer text (canaries redacted) of every failed or blocked request and of \
             {}% of the others, {readable_by}; records (hashes, model, \
             token counts, checks, timings) are in clear either way",
            store.display(),
            startup.sample_rate * 100.0
        );
    }
    match &startup.journal_priority {
        JournalPriority::Unchanged => {}
        JournalPriority::Raised { nice } => {
            tracing::info!(nice, "audit: the journal thread runs at a raised priority");
        }
        JournalPriority::Refused(reason) => tracing::info!(
            %reason,
            "audit: the journal thread keeps the process's priority ([audit] journal_nice \
             needs CAP_SYS_NICE or an RLIMIT_NICE that allows it; set it to 0 to not ask)"
        ),
    }
    tracing::info!(
        max_connections = startup.max_connections,
        "client connections served at once"
    );
}

/// Says what `serve` runs with: the local engine (or its absence) and probe
/// results. (The server itself checks, in the background, that each provider
/// answers at all.)
fn report_startup(startup: &Startup, local_dir: Option<&str>) {
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
    match &startup.topic {
        Some((model, action)) => tracing::info!(
            "topic check: model {model}, a low score {}",
            match action {
                TopicAction::Record => "is recorded and sampled (scored after the answer)",
                TopicAction::Flag => "flags the answer (scored before it is delivered)",
                TopicAction::Block => "fails the verdict (scored before it is delivered)",
            }
        ),
        None => tracing::info!("topic check: off ([topic] model_dir is not set)"),
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
