//! The HTTP server: starting (secrets, audit store, registry, providers'
//! clients, local engine, probe results, the open-file limit), binding, and
//! serving until shut down. Everything a client connection goes through
//! before the pipeline lives in this layer: the accept loop and its
//! connection cap ([`listener`]), each connection's deadlines
//! ([`connection`]), the router and middleware ([`router`]), the model
//! lists ([`models`]), admission
//! ([`admission`]: credentials, body deadlines and limits, slots), and the
//! background tasks ([`tasks`]).

mod admission;
mod connection;
mod listener;
mod models;
mod router;
mod tasks;

pub use listener::OpenFiles;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use canarygate_audit::{AuditError, AuditLog, AuditOptions, Secrets};
use canarygate_policies::config::Policy;
use canarygate_policies::probe::ProbeResult;
use canarygate_policies::topic::TopicAction;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::engine::{LocalEngine, LocalEngineError};
use crate::identity::Authenticator;
use crate::metrics::Metrics;
use crate::probe_results::ProbeBook;
use crate::registry::CanaryBook;
use crate::shared_registry::SharedRegistry;
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
    /// The name stamped on this instance's audit records; `None`: the
    /// host's name and the listening port.
    pub instance: Option<String>,
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
    /// The open-file limit leaves no room for `limits.max_connections`.
    #[error("{0}")]
    OpenFiles(String),
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
    /// `[registry]` cannot be used as written.
    #[error("[registry]: {0}")]
    Registry(String),
    /// `[topic] model_dir` cannot be loaded.
    #[error("[topic] model_dir {}: {source}", path.display())]
    Topic {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: canarygate_topic::TopicError,
    },
    /// A start-up task panicked.
    #[error("{0} failed: {1}")]
    Task(&'static str, String),
}

/// A bound, not yet running server.
pub struct Server {
    listener: TcpListener,
    router: Router,
    metrics: Arc<Metrics>,
    deadlines: connection::ConnectionDeadlines,
    startup: Startup,
}

/// What `serve` found at start, for its first lines of output.
#[derive(Debug, Clone)]
pub struct Startup {
    /// The local engine: served context window and KV pool, in tokens.
    pub local_engine: Option<(usize, usize)>,
    /// Stored probe results.
    pub probes: Vec<Arc<ProbeResult>>,
    /// Client connections served at once (`limits.max_connections`, or
    /// the default fitted to the open-file limit).
    pub max_connections: usize,
    /// The open-file limit as found and as raised (None: unreadable).
    pub open_files: Option<OpenFiles>,
    /// Whether audit samples are encrypted at rest.
    pub samples_encrypted: bool,
    /// The share of passing requests whose text is sampled.
    pub sample_rate: f64,
    /// How the audit journal thread's priority came out.
    pub journal_priority: canarygate_audit::JournalPriority,
    /// The topic check: its model and what a low score does.
    pub topic: Option<(String, TopicAction)>,
}

impl Server {
    /// Loads secrets, builds provider clients and binds the listener.
    pub async fn bind(options: ServeOptions) -> Result<Self, StartError> {
        let (max_connections, open_files) = connection_cap(&options.policy)?;
        let upstreams = Upstreams::build(&options.policy)?;
        let audit = open_audit_log(&options).await?;
        let metrics = Arc::new(Metrics::new());
        let sync_metrics = Arc::clone(&metrics);
        audit.observe_journal_syncs(Box::new(move |took| {
            sync_metrics.observe_audit_journal_sync(took.as_secs_f64());
        }));
        let (registry, session_secret) = open_registry(&options, &audit, &metrics)?;
        // Checked once before serving, so a registry that answers is in use
        // from the first request (and one that does not is reported).
        registry.heartbeat().await;
        tasks::spawn_registry_sweeper(Arc::downgrade(&registry));
        tasks::spawn_registry_heartbeat(Arc::downgrade(&registry));
        let local_config = options.policy.local.clone();
        let local = tokio::task::spawn_blocking(move || LocalEngine::start(&local_config))
            .await
            .map_err(|error| StartError::Task("starting the local engine", error.to_string()))??;
        let probes = Arc::new(ProbeBook::open(&options.data_dir));
        let topic_config = options.policy.topic.clone();
        let topic_metrics = Arc::clone(&metrics);
        let topic = tokio::task::spawn_blocking(move || {
            crate::topic::load(&topic_config, &topic_metrics).map_err(|source| StartError::Topic {
                path: topic_config
                    .model_dir
                    .as_ref()
                    .map(|dir| dir.get_ref().clone())
                    .unwrap_or_default(),
                source,
            })
        })
        .await
        .map_err(|error| StartError::Task("loading the topic model", error.to_string()))??
        .map(Arc::new);
        let startup = Startup {
            topic: topic
                .as_ref()
                .map(|check| (check.model_name().to_owned(), check.action())),
            local_engine: local
                .as_ref()
                .map(|engine| (engine.context_window(), engine.pool_tokens())),
            probes: probes.all(),
            max_connections,
            open_files,
            samples_encrypted: audit.encrypts_samples(),
            sample_rate: audit.sample_rate(),
            journal_priority: audit.journal_priority().clone(),
        };
        let listener =
            TcpListener::bind(options.listen)
                .await
                .map_err(|source| StartError::Listen {
                    address: options.listen,
                    source,
                })?;
        let state = Arc::new(AppState {
            auth: Authenticator::new(&options.policy.auth, session_secret),
            registry,
            audit,
            slots: Arc::new(Semaphore::new(
                options.policy.limits.max_concurrent_requests,
            )),
            parsing: Arc::new(Semaphore::new(
                usize::try_from(options.policy.limits.max_parsed_bytes.div_ceil(1024))
                    .unwrap_or(Semaphore::MAX_PERMITS)
                    .min(Semaphore::MAX_PERMITS),
            )),
            metrics,
            upstreams,
            local,
            probes,
            topic,
            policy: options.policy,
        });
        tasks::spawn_probe_tasks(Arc::downgrade(&state), options.data_dir.clone());
        tasks::spawn_reachability_check(Arc::downgrade(&state));
        let limits = &state.policy.limits;
        let deadlines = connection::ConnectionDeadlines {
            header: Duration::from_millis(limits.client_header_timeout_ms),
            keepalive: Duration::from_millis(limits.client_keepalive_timeout_ms),
            write: Duration::from_millis(limits.client_write_timeout_ms),
        };
        Ok(Self {
            listener,
            metrics: state.metrics.clone(),
            router: router::router(state),
            deadlines,
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
        let shared = connection::Shared::new(self.router, self.deadlines, self.metrics.clone());
        listener::serve(
            self.listener,
            shared,
            self.startup.max_connections,
            self.metrics,
            shutdown,
        )
        .await
    }
}

/// Raises the soft open-file limit to the hard one (logging both) and
/// fits `limits.max_connections` below it.
fn connection_cap(policy: &Policy) -> Result<(usize, Option<OpenFiles>), StartError> {
    match listener::raise_open_file_limit() {
        Ok(files) => {
            tracing::info!(
                soft = files.soft,
                soft_before = files.soft_before,
                hard = files.hard,
                "open-file limit"
            );
            let max = listener::open_file_budget(&policy.limits, files.soft)
                .map_err(StartError::OpenFiles)?;
            let files_wanted = (max as u64)
                .saturating_add(policy.limits.max_concurrent_requests as u64)
                .saturating_add(listener::RESERVED_FILES);
            if files_wanted > files.soft {
                tracing::warn!(
                    "limits.max_concurrent_requests = {} does not fit the open-file limit of {} \
                     beside {max} client connections: requests beyond about {} in flight may \
                     fail to connect to the provider; raise the limit (`ulimit -n`, systemd's \
                     LimitNOFILE) or lower limits.max_concurrent_requests",
                    policy.limits.max_concurrent_requests,
                    files.soft,
                    files
                        .soft
                        .saturating_sub(max as u64 + listener::RESERVED_FILES)
                );
            }
            if policy.limits.max_connections.is_none()
                && max < canarygate_policies::config::DEFAULT_MAX_CONNECTIONS
            {
                tracing::warn!(
                    "limits.max_connections: {max} client connections, below the default {}, \
                     to fit the open-file limit of {}",
                    canarygate_policies::config::DEFAULT_MAX_CONNECTIONS,
                    files.soft
                );
            }
            Ok((max, Some(files)))
        }
        Err(error) => {
            tracing::warn!("cannot read the open-file limit: {error}");
            let max = policy
                .limits
                .max_connections
                .unwrap_or(canarygate_policies::config::DEFAULT_MAX_CONNECTIONS);
            Ok((max, None))
        }
    }
}

/// The canary registry `[registry]` asks for, with the secret sessions are
/// keyed with. A shared registry keys canaries and sessions with the
/// deployment's key (`key_env`), so every instance agrees on both; alone,
/// the install's secrets do.
fn open_registry(
    options: &ServeOptions,
    audit: &AuditLog,
    metrics: &Arc<Metrics>,
) -> Result<(Arc<CanaryBook>, [u8; 32]), StartError> {
    let config = &options.policy.registry;
    let (secrets, shared) = if config.shared() {
        let key_var = config
            .key_env
            .as_ref()
            .ok_or_else(|| StartError::Registry("registry.key_env is not set".into()))?;
        let key = read_env(key_var.get_ref())?;
        let key = canarygate_audit::parse_key(&key).ok_or_else(|| {
            StartError::Registry(format!(
                "${} must be 32 bytes, as 64 hex characters or base64",
                key_var.get_ref()
            ))
        })?;
        let password = match &config.password_env {
            Some(var) => Some(read_env(var.get_ref())?),
            None => None,
        };
        let secrets = Secrets::from_master(key);
        // The sentinel's value: one way from the key, the same on every
        // instance keyed alike.
        let key_check = hex::encode(secrets.secret("registry-key-check"));
        let client =
            SharedRegistry::new(config, password, key_check).map_err(StartError::Registry)?;
        (secrets, Some((client, config.on_unavailable)))
    } else {
        (audit.secrets().clone(), None)
    };
    let registry = CanaryBook::open(
        audit.clone(),
        &secrets.secret("canary"),
        shared,
        metrics.clone(),
    )
    .map_err(|source| StartError::Audit {
        path: options.data_dir.clone(),
        source,
    })?;
    Ok((registry, secrets.secret("session")))
}

/// The value of environment variable `name`, which the policy names.
fn read_env(name: &str) -> Result<String, StartError> {
    std::env::var(name).map_err(|_| {
        StartError::Registry(format!(
            "the policy names ${name}, which is not set (or not UTF-8)"
        ))
    })
}

/// This instance's name: `--instance`, or the host's name and the port.
fn instance_name(options: &ServeOptions) -> String {
    options.instance.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|name| name.trim().to_owned())
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| "localhost".to_owned());
        match options.listen.port() {
            0 => format!("{host}-{}", std::process::id()),
            port => format!("{host}:{port}"),
        }
    })
}

/// Opens the audit store of the data directory (blocking: it checks the file).
async fn open_audit_log(options: &ServeOptions) -> Result<AuditLog, StartError> {
    let mut audit_options =
        AuditOptions::from_policy(&options.policy.audit).map_err(StartError::AuditConfig)?;
    audit_options.instance = Some(instance_name(options));
    let dir = options.data_dir.clone();
    // Owner-only whatever the umask; an existing directory is checked by
    // `AuditLog::open`.
    canarygate_audit::files::create_private_dir_all(&dir).map_err(|source| {
        StartError::DataDir {
            path: dir.clone(),
            source,
        }
    })?;
    tokio::task::spawn_blocking(move || {
        AuditLog::open(&dir, audit_options)
            .map_err(|source| StartError::Audit { path: dir, source })
    })
    .await
    .map_err(|error| StartError::Task("opening the audit store", error.to_string()))?
}
