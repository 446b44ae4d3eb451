//! The shared canary registry on a Redis-protocol server (Redis 7, Valkey):
//! the part of [`crate::registry`] that crosses the network.
//!
//! One key per live canary, `PREFIX` + `canary:` + the canary's keyed hash
//! in hex, holding its [`Registration`] as JSON and expiring with it. A
//! value is claimed with `SET … NX PX` (set only if absent), so two
//! instances never hold the same live canary; lookups are one `MGET` per
//! batch. Every round trip has the policy's deadline; the connection is
//! made lazily and remade after any failure (redis-rs's connection
//! manager).
//!
//! **Health, and a breaker.** The registry is *down* from start until the
//! first [`SharedRegistry::check`] passes, and again after any failed round
//! trip; while it is down, requests' round trips fail at once instead of
//! each waiting out the deadline, and only the background heartbeat asks
//! the server (`check`, every second). `check` also keeps two keys. A
//! sentinel, `PREFIX` + `key-check`, holds a value derived one way from the
//! deployment's key: another value there means an instance keyed
//! differently (nothing it registers would be recognised here). And each
//! instance keeps a marker of its own, `PREFIX` + `instance:` + a random
//! id, expiring [`MARKER_TTL`] after its last check: a marker gone missing
//! means the server lost its data (a restart without persistence, a flush,
//! a failover) since this instance last looked. The sentinel cannot tell
//! that: the first instance to notice sets it again, and the others would
//! find it in place. Either way this instance's live canaries may be
//! missing from the server, so the caller claims them again
//! ([`SharedRegistry::reclaim`]) before marking the registry up
//! ([`SharedRegistry::mark_up`]).

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

/// Whether the shared registry is in use.
#[derive(Debug, Clone)]
pub struct Health {
    /// Checked and answering.
    pub up: bool,
    /// Why it is down (without secrets), while down.
    pub error: Option<String>,
}

/// What [`SharedRegistry::check`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    /// This instance's marker was missing: the server may have lost its
    /// live canaries (always true on the instance's first check).
    pub marker_was_missing: bool,
}

/// How long an instance's marker outlives its last check: long past the
/// heartbeat's second, short enough that a stopped instance's goes soon.
const MARKER_TTL: Duration = Duration::from_secs(600);

/// Keys per command of a batch (`MGET`, a reclaim's `SET`s): a hostile
/// answer full of canary-shaped spans must not build one huge command.
const BATCH_KEYS: usize = 512;

/// A client of the shared registry, cheap to use from every request.
pub struct SharedRegistry {
    connection: ConnectionManager,
    prefix: String,
    timeout: Duration,
    up: AtomicBool,
    error: Mutex<Option<String>>,
    /// The sentinel's value: derived one way from the deployment's key.
    key_check: String,
    /// This instance's marker key.
    marker: String,
}

impl SharedRegistry {
    /// A client for `config.url` (authenticating with `password` when
    /// given, trusting `config.ca_file` when set). Connects on first use; an
    /// invalid URL or an unreadable CA file is an error now. `key_check` is
    /// the sentinel's value: the same on every instance of a deployment,
    /// and telling nothing of its key.
    pub fn new(
        config: &RegistryConfig,
        password: Option<String>,
        key_check: String,
    ) -> Result<Self, String> {
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
        let mut id = [0u8; 16];
        getrandom::fill(&mut id).map_err(|error| format!("registry: an instance id: {error}"))?;
        let marker = format!("{}instance:{}", config.key_prefix, hex::encode(id));
        Ok(Self {
            connection,
            prefix: config.key_prefix.clone(),
            timeout,
            up: AtomicBool::new(false),
            error: Mutex::new(Some("not checked yet".to_owned())),
            key_check,
            marker,
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

    /// Claims `entries` again (`SET … NX PX`, their remaining time), in
    /// batches, whether or not the registry is marked up: after an outage or
    /// a server that lost its data. Expired entries are skipped; keys held
    /// already are left as they are.
    pub async fn reclaim(&self, entries: &[(CanaryKey, Registration)]) -> Result<(), Unavailable> {
        let now = now_ms();
        let live: Vec<_> = entries
            .iter()
            .filter(|(_, registration)| registration.expires_at_ms > now)
            .collect();
        for batch in live.chunks(BATCH_KEYS) {
            let mut pipeline = Pipeline::with_capacity(batch.len());
            for (key, registration) in batch {
                let value = serde_json::to_vec(registration)
                    .map_err(|error| Unavailable(format!("encoding a registration: {error}")))?;
                pipeline
                    .cmd("SET")
                    .arg(self.key(key))
                    .arg(value)
                    .arg("NX")
                    .arg("PX")
                    .arg(registration.expires_at_ms.saturating_sub(now).max(1))
                    .ignore();
            }
            let () = self.round_trip(&pipeline).await?;
        }
        Ok(())
    }

    /// The registrations of `keys`, in order (`None`: not live anywhere).
    pub async fn find(&self, keys: &[CanaryKey]) -> Result<Vec<Option<Registration>>, Unavailable> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipeline = Pipeline::with_capacity(keys.len().div_ceil(BATCH_KEYS));
        for batch in keys.chunks(BATCH_KEYS) {
            let command = pipeline.cmd("MGET");
            for key in batch {
                command.arg(self.key(key));
            }
        }
        let batches: Vec<Vec<Option<Vec<u8>>>> = self.run(&pipeline).await?;
        let values: Vec<Option<Vec<u8>>> = batches.into_iter().flatten().collect();
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
                    serde_json::from_slice(&bytes).unwrap_or_else(|_| {
                        tracing::warn!(
                            "a live canary's registration in the registry is unreadable"
                        );
                        unreadable_registration()
                    })
                })
            })
            .collect())
    }

    /// Drops `keys` (canaries minted but never sent). Best effort: they
    /// expire anyway.
    pub async fn release(&self, keys: &[CanaryKey]) {
        if keys.is_empty() {
            return;
        }
        let mut pipeline = Pipeline::with_capacity(1);
        let command = pipeline.cmd("DEL");
        for key in keys {
            command.arg(self.key(key));
        }
        let _: Result<(i64,), _> = self.run(&pipeline).await;
    }

    /// Asks the server whatever the breaker says (the heartbeat): sets the
    /// sentinel if it is missing and reads it back, and sets this
    /// instance's marker if it is missing and its expiry either way. A
    /// sentinel of another key is an error (and marks the registry down).
    pub async fn check(&self) -> Result<Checked, Unavailable> {
        let sentinel = format!("{}key-check", self.prefix);
        let ttl_ms = MARKER_TTL.as_millis() as u64;
        let mut pipeline = Pipeline::with_capacity(4);
        pipeline
            .cmd("SET")
            .arg(&sentinel)
            .arg(&self.key_check)
            .arg("NX")
            .cmd("GET")
            .arg(&sentinel)
            .cmd("SET")
            .arg(&self.marker)
            .arg(1)
            .arg("NX")
            .arg("PX")
            .arg(ttl_ms)
            .cmd("PEXPIRE")
            .arg(&self.marker)
            .arg(ttl_ms);
        let (_, value, marker_set, _): (Option<String>, Option<String>, Option<String>, i64) =
            self.round_trip(&pipeline).await?;
        if value.as_deref() != Some(self.key_check.as_str()) {
            return Err(self.failed(
                "the registry holds another deployment key's sentinel: an instance with a \
                 different registry key (key_env) uses this server and prefix, so neither \
                 recognises the other's canaries"
                    .to_owned(),
            ));
        }
        Ok(Checked {
            marker_was_missing: marker_set.is_some(),
        })
    }

    /// Marks the registry up: requests use it again.
    pub fn mark_up(&self) {
        if !self.up.swap(true, Ordering::Relaxed) {
            tracing::info!("shared canary registry in use");
        }
        *self
            .error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }

    /// Whether the registry is in use.
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

    /// A request's round trip: fails at once while the registry is down
    /// (the heartbeat brings it back).
    async fn run<T: redis::FromRedisValue>(&self, pipeline: &Pipeline) -> Result<T, Unavailable> {
        if !self.up.load(Ordering::Relaxed) {
            let error = self
                .error
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
                .unwrap_or_else(|| "down".to_owned());
            return Err(Unavailable(error));
        }
        self.round_trip(pipeline).await
    }

    /// Runs `pipeline` within the deadline; a failure marks the registry
    /// down.
    async fn round_trip<T: redis::FromRedisValue>(
        &self,
        pipeline: &Pipeline,
    ) -> Result<T, Unavailable> {
        let mut connection = self.connection.clone();
        match tokio::time::timeout(self.timeout, pipeline.query_async::<T>(&mut connection)).await {
            Ok(Ok(value)) => Ok(value),
            // The client's errors name the server's address, never its
            // password.
            Ok(Err(error)) => Err(self.failed(error.to_string())),
            Err(_) => Err(self.failed(format!(
                "no answer within registry.timeout_ms ({} ms)",
                self.timeout.as_millis()
            ))),
        }
    }

    /// Marks the registry down for `detail`; logged when it goes down or
    /// the reason changes (not once per failed heartbeat).
    fn failed(&self, detail: String) -> Unavailable {
        let was_up = self.up.swap(false, Ordering::Relaxed);
        let mut error = self
            .error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if was_up || error.as_deref() != Some(detail.as_str()) {
            tracing::warn!("shared canary registry unavailable: {detail}");
        }
        *error = Some(detail.clone());
        Unavailable(detail)
    }
}

/// What a live canary whose stored registration cannot be read is taken
/// for: a canary of some other request (never an unknown span).
fn unreadable_registration() -> Registration {
    Registration {
        session: "unreadable".to_owned(),
        request: "unreadable".to_owned(),
        expires_at_ms: 0,
    }
}
