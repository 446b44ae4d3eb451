//! What every request shares: the policy and the long-lived parts built from
//! it at start ([`crate::server::Server::bind`] builds it).

use std::sync::Arc;

use canarygate_audit::AuditLog;
use canarygate_policies::config::Policy;
use tokio::sync::Semaphore;

use crate::engine::LocalEngine;
use crate::identity::Authenticator;
use crate::metrics::Metrics;
use crate::probe_results::ProbeBook;
use crate::registry::CanaryBook;
use crate::topic::TopicCheck;
use crate::upstream::Upstreams;

/// Shared state of every request handler.
pub struct AppState {
    /// The validated policy.
    pub policy: Policy,
    /// One client per provider.
    pub upstreams: Upstreams,
    /// Checks credentials, derives sessions.
    pub auth: Authenticator,
    /// The process's metrics.
    pub metrics: Arc<Metrics>,
    /// `limits.max_concurrent_requests` slots.
    pub slots: Arc<Semaphore>,
    /// `limits.max_parsed_bytes`, in KiB: what the requests being parsed
    /// may take at once.
    pub parsing: Arc<Semaphore>,
    /// Every live canary.
    pub registry: Arc<CanaryBook>,
    /// The durable audit store (records, persisted canaries).
    pub audit: AuditLog,
    /// The bundled engine, when `[local]` names a model.
    pub local: Option<LocalEngine>,
    /// Probed context limits from the data directory.
    pub probes: Arc<ProbeBook>,
    /// The topic check, when `[topic]` names a model.
    pub topic: Option<Arc<TopicCheck>>,
}
