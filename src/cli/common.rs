//! What the subcommands share: loading a policy, the async runtime, the
//! readiness line and the shutdown signal.

use std::io::Write;

use anyhow::Context;
use canarygate_policies::Policy;

/// Loads the policy named on the command line (a file, or `preset:NAME`),
/// or the default preset.
pub fn load_policy(config: Option<&str>) -> anyhow::Result<Policy> {
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

/// The multi-threaded async runtime, with one worker thread per CPU.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    runtime_with_workers(None)
}

/// The multi-threaded async runtime with `workers` worker threads (one per
/// CPU when `None`).
pub fn runtime_with_workers(workers: Option<usize>) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = workers {
        builder.worker_threads(workers);
    }
    builder
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Prints the readiness line (tests and scripts wait for it) and flushes.
pub fn announce(line: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}

/// Waits for the first SIGINT (Ctrl-C), SIGTERM or SIGHUP: the server then
/// stops accepting and lets the requests in flight finish (each within its
/// own deadlines). A second such signal ends the process at once, those
/// requests with it (every record already acknowledged is durable).
pub async fn shutdown_signal() {
    wait_for_signal().await;
    tracing::info!(
        "shutting down: finishing the requests in flight (a second signal stops at once)"
    );
    tokio::spawn(async {
        wait_for_signal().await;
        tracing::warn!("a second signal: stopping now, with requests still in flight");
        std::process::exit(130);
    });
}

/// The next SIGINT, SIGTERM or SIGHUP (Ctrl-C alone where there are no
/// others).
async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut hangup)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
        ) else {
            return ctrl_c.await.unwrap_or(());
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
            _ = hangup.recv() => {}
        }
    }
    #[cfg(not(unix))]
    ctrl_c.await.unwrap_or(());
}
