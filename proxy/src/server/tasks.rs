//! What `serve` does besides answering requests: drop expired canaries,
//! check the shared canary registry, follow the probe results of its data
//! directory and re-probe on schedule, and say at start which providers do
//! not answer. Each task ends when the
//! server is gone (it holds only a weak reference).

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::Duration;

use canarygate_policies::config::ProviderApi;

use crate::clock::now_ms;
use crate::probe::{self, ProbeTarget};
use crate::probe_results;
use crate::registry::CanaryBook;
use crate::state::AppState;
use crate::upstream::provider_api_key;

/// How often `serve` drops expired canaries from its in-memory registry.
const REGISTRY_PURGE_INTERVAL: Duration = Duration::from_secs(1);

/// How often `serve` drops expired canaries from its audit store: each sweep
/// is a write transaction, queued behind the requests' audit records.
const STORE_SWEEP_INTERVAL: Duration = Duration::from_secs(60);

/// How often `serve` re-reads the probe results of its data directory.
const PROBE_RELOAD_INTERVAL: Duration = Duration::from_secs(30);

/// Drops expired canaries from memory every [`REGISTRY_PURGE_INTERVAL`] and
/// from the store every [`STORE_SWEEP_INTERVAL`], until the registry is gone.
/// A purge removes only what expired since the last one (the registry keeps
/// an expiry index), so each shard's lock is held for microseconds.
pub fn spawn_registry_sweeper(registry: Weak<CanaryBook>) {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(REGISTRY_PURGE_INTERVAL);
        let mut last_store_sweep: Option<tokio::time::Instant> = None;
        loop {
            ticks.tick().await;
            let Some(registry) = registry.upgrade() else {
                return;
            };
            let now = now_ms();
            // Off the runtime's workers, like any lock-taking batch.
            let purging = Arc::clone(&registry);
            let _ = tokio::task::spawn_blocking(move || purging.purge_expired(now)).await;
            if last_store_sweep.is_none_or(|at| at.elapsed() >= STORE_SWEEP_INTERVAL) {
                last_store_sweep = Some(tokio::time::Instant::now());
                if let Err(error) = registry.sweep_store(now).await {
                    tracing::warn!("sweeping expired canaries from the audit store: {error}");
                }
            }
        }
    });
}

/// How often `serve` checks its shared canary registry, if it has one.
const REGISTRY_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// Checks the shared registry every [`REGISTRY_HEARTBEAT_INTERVAL`]
/// ([`CanaryBook::heartbeat`]: it notices an outage and its end without
/// traffic, and claims this instance's canaries again when it comes back),
/// until the registry is gone. A memory-only registry ends it at once.
pub fn spawn_registry_heartbeat(registry: Weak<CanaryBook>) {
    let Some(shared) = registry.upgrade().map(|registry| registry.is_shared()) else {
        return;
    };
    if !shared {
        return;
    }
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(REGISTRY_HEARTBEAT_INTERVAL);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            let Some(registry) = registry.upgrade() else {
                return;
            };
            registry.heartbeat().await;
        }
    });
}

/// Re-reads probe results every [`PROBE_RELOAD_INTERVAL`] (so a
/// `canarygate probe` run while serving takes effect), and re-probes each
/// routed model on `[probe] every_hours`, until the server is gone.
pub fn spawn_probe_tasks(state: Weak<AppState>, data_dir: PathBuf) {
    let reload_state = state.clone();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(PROBE_RELOAD_INTERVAL);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            let Some(state) = reload_state.upgrade() else {
                return;
            };
            let probes = state.probes.clone();
            drop(state);
            let _ = tokio::task::spawn_blocking(move || probes.reload()).await;
        }
    });
    tokio::spawn(async move {
        loop {
            let Some(strong) = state.upgrade() else {
                return;
            };
            let Some(interval) = strong.policy.probe.interval() else {
                return;
            };
            let due = scheduled_probes(&strong, interval);
            drop(strong);
            for target in due {
                let Some(strong) = state.upgrade() else {
                    return;
                };
                let policy = strong.policy.clone();
                let probes = strong.probes.clone();
                drop(strong);
                scheduled_probe(&policy, &target, &data_dir, &probes).await;
            }
            tokio::time::sleep(interval.min(Duration::from_secs(3600))).await;
        }
    });
}

/// Probes `target` now and stores the result where `serve` reads it.
async fn scheduled_probe(
    policy: &canarygate_policies::Policy,
    target: &ProbeTarget,
    data_dir: &std::path::Path,
    probes: &probe_results::ProbeBook,
) {
    // The provider's api_key_env authenticates the probe (also in
    // passthrough auth); without one it goes unauthenticated.
    let api_key = policy
        .provider(&target.provider)
        .and_then(|provider| provider_api_key(provider, None).ok().flatten());
    tracing::info!(provider = %target.provider, model = %target.model, "scheduled context probe");
    let budget = policy.probe.budget_tokens;
    match probe::run(policy, target, api_key.as_deref(), budget, |_| {}).await {
        Ok(result) => {
            tracing::info!(
                provider = %result.provider,
                model = %result.model,
                effective_limit_tokens = result.effective_limit_tokens,
                trusted = result.trusted,
                "context probe finished"
            );
            if let Err(error) = probe_results::store(data_dir, &result) {
                tracing::warn!("storing the probe result: {error}");
            }
            probes.reload();
        }
        Err(error) => tracing::warn!("scheduled context probe failed: {error}"),
    }
}

/// Routed models whose last probe is older than `interval` (or missing).
fn scheduled_probes(state: &AppState, interval: Duration) -> Vec<ProbeTarget> {
    let now = now_ms();
    let mut seen = HashSet::new();
    state
        .policy
        .named_routes()
        .filter(|(_, _, api)| *api == ProviderApi::Openai)
        .map(|(_, route, _)| route)
        .filter(|route| seen.insert((route.provider, route.upstream_model)))
        .filter(|route| {
            state
                .probes
                .get(route.provider, route.upstream_model)
                .is_none_or(|result| {
                    now.saturating_sub(result.probed_at_ms) >= interval.as_millis() as u64
                })
        })
        .map(|route| ProbeTarget {
            provider: route.provider.to_owned(),
            model: route.upstream_model.to_owned(),
            advertised_window_tokens: route.context_window,
        })
        .collect()
}

/// Says, once at start, which providers do not answer at all: the server
/// still serves `/v1/models`, health and metrics, and their requests get 502
/// (or the local engine) until they do.
pub fn spawn_reachability_check(state: Weak<AppState>) {
    tokio::spawn(async move {
        let Some(state) = state.upgrade() else {
            return;
        };
        for upstream in state.upstreams.iter() {
            if let Err(error) = upstream.check_reachable().await {
                let fallback =
                    if state.local.is_some() && state.policy.local.on_upstream_unavailable() {
                        "its requests are served by the local engine until it is"
                    } else {
                        "its requests fail with 502 until it is"
                    };
                tracing::warn!(
                    "provider `{}` is not reachable ({}); {fallback}",
                    upstream.name,
                    error
                );
            }
        }
    });
}
