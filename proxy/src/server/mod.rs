//! The HTTP server: starting (secrets, audit store, registry, providers'
//! clients, local engine, probe results), binding, and serving until shut
//! down. Everything a client connection goes through before the pipeline
//! lives in this layer: the router and middleware ([`router`]), admission
//! ([`admission`]: slots, credentials, body limits), and the background
//! tasks ([`tasks`]).

mod admission;
mod router;
mod tasks;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::serve::ListenerExt;
use canarygate_audit::{AuditError, AuditLog, AuditOptions};
use canarygate_policies::config::Policy;
use canarygate_policies::probe::ProbeResult;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::engine::{LocalEngine, LocalEngineError};
use crate::identity::Authenticator;
use crate::metrics::Metrics;
use crate::probe_results::ProbeBook;
use crate::registry::CanaryBook;
use crate::state::AppState;
use crate::upstream::{UpstreamError, Upstreams};

/// What `canarygate serve` needs.
pub struct ServeOptions {
    /// The validated policy (with any `--upstream` override applied).
    pub policy: Policy,
    /// Where to listen.
    pub listen: SocketAddr,
    /// The data directory: per-install secret and audit store.
    pub data_dir: PathBuf,
}

/// Why `serve` could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A provider's client could not be built.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// `[audit]` names a key that is not usable.
    #[error("[audit]: {0}")]
    AuditConfig(AuditError),
    /// The data directory cannot be created.
    #[error("cannot create data dir {}: {source}", path.display())]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The audit store cannot be opened.
    #[error("audit store in {}: {source}", path.display())]
    Audit {
        /// The data directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: AuditError,
    },
    /// The local engine did not start.
    #[error(transparent)]
    LocalEngine(#[from] LocalEngineError),
    /// The listening address cannot be bound.
    #[error("cannot listen on {address}: {source}")]
    Listen {
        /// The address.
        address: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A start-up task panicked.
    #[error("{0} failed: {1}")]
    Task(&'static str, String),
}

/// A bound, not yet running server.
pub struct Server {
    listener: TcpListener,
    router: Router,
    startup: Startup,
}

/// What `serve` found at start, for its first lines of output.
#[derive(Debug, Clone)]
pub struct Startup {
    /// The local engine: served context window and KV pool, in tokens.
    pub local_engine: Option<(usize, usize)>,
    /// Stored probe results.
    pub probes: Vec<Arc<ProbeResult>>,
}

impl Server {
    /// Loads secrets, builds provider clients and binds the listener.
    pub async fn bind(options: ServeOptions) -> Result<Self, StartError> {
        let upstreams = Upstreams::build(&options.policy)?;
        let audit = open_audit_log(&options).await?;
        let registry = CanaryBook::open(audit.clone()).map_err(|source| StartError::Audit {
            path: options.data_dir.clone(),
            source,
        })?;
        tasks::spawn_registry_sweeper(Arc::downgrade(&registry));
        let local_config = options.policy.local.clone();
        let local = tokio::task::spawn_blocking(move || LocalEngine::start(&local_config))
            .await
            .map_err(|error| StartError::Task("starting the local engine", error.to_string()))??;
        let probes = Arc::new(ProbeBook::open(&options.data_dir));
        let startup = Startup {
            local_engine: local
                .as_ref()
                .map(|engine| (engine.context_window(), engine.pool_tokens())),
            probes: probes.all(),
        };
        let listener =
            TcpListener::bind(options.listen)
                .await
                .map_err(|source| StartError::Listen {
                    address: options.listen,
                    source,
                })?;
        let state = Arc::new(AppState {
            auth: Authenticator::new(&options.policy.auth, audit.secrets().secret("session")),
            registry,
            audit,
            slots: Arc::new(Semaphore::new(
                options.policy.limits.max_concurrent_requests,
            )),
            metrics: Arc::new(Metrics::new()),
            upstreams,
            local,
            probes,
            policy: options.policy,
        });
        tasks::spawn_probe_tasks(Arc::downgrade(&state), options.data_dir.clone());
        tasks::spawn_reachability_check(Arc::downgrade(&state));
        Ok(Self {
            listener,
            router: router::router(state),
            startup,
        })
    }

    /// What was found at start: the local engine, stored probe results.
    pub fn startup(&self) -> &Startup {
        &self.startup
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` resolves, then finishes the requests in flight.
    pub async fn run(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        // No Nagle: a streamed token must leave at once, not wait for an ACK.
        let listener = self.listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, self.router)
            .with_graceful_shutdown(shutdown)
            .await
    }
}

/// Opens the audit store of the data directory (blocking: it checks the file).
async fn open_audit_log(options: &ServeOptions) -> Result<AuditLog, StartError> {
    let audit_options =
        AuditOptions::from_policy(&options.policy.audit).map_err(StartError::AuditConfig)?;
    let dir = options.data_dir.clone();
    std::fs::create_dir_all(&dir).map_err(|source| StartError::DataDir {
        path: dir.clone(),
        source,
    })?;
    tokio::task::spawn_blocking(move || {
        AuditLog::open(&dir, audit_options)
            .map_err(|source| StartError::Audit { path: dir, source })
    })
    .await
    .map_err(|error| StartError::Task("opening the audit store", error.to_string()))?
}
