//! The shared canary registry on a Redis-protocol server (Redis 7, Valkey):
//! the part of [`crate::registry`] that crosses the network.
//!
//! One key per live canary, `PREFIX` + `canary:` + the canary's keyed hash
//! in hex, holding its [`Registration`] as JSON and expiring with it. A
//! value is claimed with `SET … NX PX` (set only if absent), so two
//! instances never hold the same live canary; lookups are one `MGET` per
//! batch. Every round trip has the policy's deadline; the connection is
//! made lazily and remade after any failure (redis-rs's connection
//! manager), so a registry that comes back is used again without a restart.
//! [`SharedRegistry::health`] says whether the last round trip worked.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use canarygate_policies::CanaryKey;
use canarygate_policies::registry::Registration;
use canarygate_policies::registry_config::RegistryConfig;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, IntoConnectionInfo, Pipeline, TlsCertificates};

use crate::clock::now_ms;

/// The shared registry could not be asked (unreachable, too slow, or an
/// answer that makes no sense); the text says which, without secrets.
#[derive(Debug, Clone)]
pub struct Unavailable(pub String);

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether the shared registry answered its last round trip.
#[derive(Debug, Clone)]
pub struct Health {
    /// The last round trip worked.
    pub up: bool,
    /// Why the last failed one did, while down.
    pub error: Option<String>,
}

/// A client of the shared registry, cheap to use from every request.
pub struct SharedRegistry {
    connection: ConnectionManager,
    prefix: String,
    timeout: Duration,
    up: AtomicBool,
    error: Mutex<Option<String>>,
}

impl SharedRegistry {
    /// A client for `config.url` (authenticating with `password` when
    /// given, trusting `config.ca_file` when set). Connects on first use; an
    /// invalid URL or an unreadable CA file is an error now.
    pub fn new(config: &RegistryConfig, password: Option<String>) -> Result<Self, String> {
        let url = config
            .url
            .as_ref()
            .map(|url| url.get_ref().as_str())
            .ok_or("registry.url is not set")?;
        let mut info = url
            .into_connection_info()
            .map_err(|error| format!("registry.url: {error}"))?;
        if let Some(password) = password {
            let settings = info.redis_settings().clone().set_password(password);
            info = info.set_redis_settings(settings);
        }
        let client = match &config.ca_file {
            Some(path) => {
                let path = path.get_ref();
                let root_cert = std::fs::read(path)
                    .map_err(|error| format!("registry.ca_file {path}: {error}"))?;
                if !root_cert.starts_with(b"-----BEGIN") {
                    return Err(format!("registry.ca_file {path} is not a PEM file"));
                }
                let certificates = TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root_cert),
                };
                Client::build_with_tls(info, certificates)
            }
            None => Client::open(info),
        }
        .map_err(|error| format!("registry.url: {error}"))?;
        let timeout = Duration::from_millis(config.timeout_ms);
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(config.connect_timeout_ms)))
            .set_response_timeout(Some(timeout))
            // Reconnect attempts are cheap and bounded; a request never waits
            // on them past its own deadline.
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(500));
        let connection = ConnectionManager::new_lazy_with_config(client, manager)
            .map_err(|error| format!("registry: {error}"))?;
        Ok(Self {
            connection,
            prefix: config.key_prefix.clone(),
            timeout,
            up: AtomicBool::new(true),
            error: Mutex::new(None),
        })
    }

    /// Claims each entry's key for its registration, expiring with it;
    /// `false` for a key another request holds already (left as it was).
    pub async fn claim(
        &self,
        entries: &[(CanaryKey, &Registration)],
    ) -> Result<Vec<bool>, Unavailable> {
        let now = now_ms();
        let mut pipeline = Pipeline::with_capacity(entries.len());
        for (key, registration) in entries {
            let value = serde_json::to_vec(registration)
                .map_err(|error| Unavailable(format!("encoding a registration: {error}")))?;
            let ttl_ms = registration.expires_at_ms.saturating_sub(now).max(1);
            pipeline
                .cmd("SET")
                .arg(self.key(key))
                .arg(value)
                .arg("NX")
                .arg("PX")
                .arg(ttl_ms);
        }
        let replies: Vec<Option<String>> = self.run(&pipeline).await?;
        Ok(replies.iter().map(Option::is_some).collect())
    }

    /// The registrations of `keys`, in order (`None`: not live anywhere).
    pub async fn find(&self, keys: &[CanaryKey]) -> Result<Vec<Option<Registration>>, Unavailable> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipeline = Pipeline::with_capacity(1);
        let command = pipeline.cmd("MGET");
        for key in keys {
            command.arg(self.key(key));
        }
        let (values,): (Vec<Option<Vec<u8>>>,) = self.run(&pipeline).await?;
        if values.len() != keys.len() {
            return Err(self.failed(format!(
                "MGET of {} keys answered {} values",
                keys.len(),
                values.len()
            )));
        }
        // A key that exists is a live canary, even when its value cannot be
        // read (another version wrote it): never let it pass as unknown.
        Ok(values
            .into_iter()
            .map(|value| {
                value.map(|bytes| {
                    serde_json::from_slice(&bytes).unwrap_or_else(|_| Registration {
                        session: "unreadable".to_owned(),
                        request: "unreadable".to_owned(),
                        expires_at_ms: 0,
                    })
                })
            })
            .collect())
    }

    /// Drops `keys` (canaries minted but never sent). Best effort: they
    /// expire anyway.
    pub async fn release(&self, keys: &[CanaryKey]) {
        let mut pipeline = Pipeline::with_capacity(1);
        let command = pipeline.cmd("DEL");
        for key in keys {
            command.arg(self.key(key));
        }
        let _: Result<(i64,), _> = self.run(&pipeline).await;
    }

    /// One `PING`, to notice that the registry went away or came back.
    pub async fn ping(&self) -> Result<(), Unavailable> {
        let mut pipeline = Pipeline::with_capacity(1);
        pipeline.cmd("PING");
        let _: (String,) = self.run(&pipeline).await?;
        Ok(())
    }

    /// Whether the last round trip worked.
    pub fn health(&self) -> Health {
        let up = self.up.load(Ordering::Relaxed);
        Health {
            up,
            error: if up {
                None
            } else {
                self.error
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clone()
            },
        }
    }

    fn key(&self, key: &CanaryKey) -> String {
        format!("{}canary:{}", self.prefix, hex::encode(key.0))
    }

    /// Runs `pipeline` within the deadline, recording the outcome.
    async fn run<T: redis::FromRedisValue>(&self, pipeline: &Pipeline) -> Result<T, Unavailable> {
        let mut connection = self.connection.clone();
        match tokio::time::timeout(self.timeout, pipeline.query_async::<T>(&mut connection)).await {
            Ok(Ok(value)) => {
                if !self.up.swap(true, Ordering::Relaxed) {
                    tracing::info!("shared canary registry reachable again");
                }
                Ok(value)
            }
            // The client's errors name the server's address, never its
            // password.
            Ok(Err(error)) => Err(self.failed(error.to_string())),
            Err(_) => Err(self.failed(format!(
                "no answer within registry.timeout_ms ({} ms)",
                self.timeout.as_millis()
            ))),
        }
    }

    fn failed(&self, detail: String) -> Unavailable {
        let was_up = self.up.swap(false, Ordering::Relaxed);
        if was_up {
            tracing::warn!("shared canary registry unavailable: {detail}");
        }
        *self
            .error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(detail.clone());
        Unavailable(detail)
    }
}
