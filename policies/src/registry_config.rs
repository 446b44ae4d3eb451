//! `[registry]`: where the live canaries are kept.
//!
//! The default, `memory`, keeps them in this process: one instance sees only
//! its own canaries. `redis` shares them between every instance pointed at
//! one Redis-protocol server (Redis 7, Valkey), so that instance B
//! recognises instance A's canary in an answer. Instances of one deployment
//! key canaries with one shared secret, read from the environment
//! (`key_env`), never stored in Redis.

use std::ops::Range;

use serde::Deserialize;
use toml::Spanned;

/// Most milliseconds for a registry timeout (one minute: a registry slower
/// than that is down).
const MAX_REGISTRY_TIMEOUT_MS: u64 = 60_000;

/// `[registry] backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RegistryBackend {
    /// This process's memory, persisted through the audit store.
    #[default]
    Memory,
    /// A Redis-protocol server shared by every instance of the deployment.
    Redis,
}

/// `[registry] on_unavailable`: what a request gets while the shared
/// registry cannot be reached (or answers later than `timeout_ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnUnavailable {
    /// Serve with local-only detection (this instance's canaries): the
    /// verdict and the audit record say `registry_degraded`.
    #[default]
    Degrade,
    /// Refuse the request before anything is sent upstream (503
    /// `canarygate_registry_unavailable`); an answer whose canary-shaped
    /// spans cannot be looked up fails `foreign_canary` (then `[verify]
    /// action` decides: blocked with 502 by default, marked under `flag`).
    FailClosed,
}

impl OnUnavailable {
    /// The name the policy writes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Degrade => "degrade",
            Self::FailClosed => "fail-closed",
        }
    }
}

/// `[registry]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistryConfig {
    /// Where live canaries are kept.
    pub backend: RegistryBackend,
    /// `redis://host:port/db` or `rediss://` (TLS) of the shared registry.
    /// No password in it: that comes from `password_env`.
    pub url: Option<Spanned<String>>,
    /// Environment variable holding the Redis password (`AUTH`), if any.
    pub password_env: Option<Spanned<String>>,
    /// PEM file of the CA certificates the registry server's certificate
    /// chains to (`rediss://` only; a private CA). Without it, the bundled
    /// web PKI roots.
    pub ca_file: Option<Spanned<String>>,
    /// Environment variable holding the deployment's registry key: 32
    /// bytes, as 64 hex characters or base64, the same on every instance.
    /// Canaries and sessions are keyed with it so that instances agree.
    pub key_env: Option<Spanned<String>>,
    /// Prefix of every key canarygate writes (several deployments can share
    /// one server).
    pub key_prefix: String,
    /// Deadline of one registry round trip, in milliseconds.
    pub timeout_ms: u64,
    /// Deadline of one connection attempt, in milliseconds.
    pub connect_timeout_ms: u64,
    /// What requests get while the registry is unreachable.
    pub on_unavailable: OnUnavailable,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            backend: RegistryBackend::Memory,
            url: None,
            password_env: None,
            ca_file: None,
            key_env: None,
            key_prefix: "canarygate:".to_owned(),
            timeout_ms: 250,
            connect_timeout_ms: 1_000,
            on_unavailable: OnUnavailable::Degrade,
        }
    }
}

impl RegistryConfig {
    /// Whether the registry is shared between instances.
    pub fn shared(&self) -> bool {
        self.backend == RegistryBackend::Redis
    }

    pub(crate) fn validate(&self) -> Result<(), (Option<Range<usize>>, String)> {
        for (name, value) in [
            ("registry.password_env", &self.password_env),
            ("registry.key_env", &self.key_env),
        ] {
            if let Some(var) = value {
                check_env_name(name, var)?;
            }
        }
        for (name, value) in [
            ("registry.timeout_ms", self.timeout_ms),
            ("registry.connect_timeout_ms", self.connect_timeout_ms),
        ] {
            if !(1..=MAX_REGISTRY_TIMEOUT_MS).contains(&value) {
                return Err((
                    None,
                    format!("{name} must be between 1 and {MAX_REGISTRY_TIMEOUT_MS}, not {value}"),
                ));
            }
        }
        if self.key_prefix.len() > 64 || self.key_prefix.chars().any(char::is_control) {
            return Err((
                None,
                "registry.key_prefix must be at most 64 bytes without control characters".into(),
            ));
        }
        match self.backend {
            RegistryBackend::Memory => {
                if let Some(url) = [&self.url, &self.key_env, &self.password_env, &self.ca_file]
                    .into_iter()
                    .flatten()
                    .next()
                {
                    return Err((
                        Some(url.span()),
                        "registry.url, key_env, password_env and ca_file are for \
                         backend = \"redis\", but registry.backend is \"memory\": set \
                         backend = \"redis\" to share canaries, or remove them"
                            .into(),
                    ));
                }
                Ok(())
            }
            RegistryBackend::Redis => {
                let Some(url) = &self.url else {
                    return Err((
                        None,
                        "registry.backend = \"redis\" needs registry.url \
                         (redis://host:port/db or rediss:// for TLS)"
                            .into(),
                    ));
                };
                check_url(url)?;
                if let Some(ca_file) = &self.ca_file
                    && !url.get_ref().starts_with("rediss://")
                {
                    return Err((
                        Some(ca_file.span()),
                        "registry.ca_file is for TLS: the url must start with rediss://".into(),
                    ));
                }
                if self.key_env.is_none() {
                    return Err((
                        None,
                        "registry.backend = \"redis\" needs registry.key_env: the variable \
                         holding the deployment's shared registry key (32 bytes, hex or \
                         base64, e.g. from `openssl rand -hex 32`)"
                            .into(),
                    ));
                }
                Ok(())
            }
        }
    }
}

/// A `redis://` or `rediss://` URL with a host and no password in it. The
/// password check comes first, so no message quotes a URL that holds one.
fn check_url(url: &Spanned<String>) -> Result<(), (Option<Range<usize>>, String)> {
    let text = url.get_ref();
    let error = |message: String| Err((Some(url.span()), message));
    let (scheme, rest) = text.split_once("://").unwrap_or(("", text));
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let (userinfo, host) = authority.rsplit_once('@').unwrap_or(("", authority));
    if userinfo.contains(':') {
        return error(
            "registry.url holds a password: put it in the variable registry.password_env \
             names (a policy file is no place for a secret)"
                .into(),
        );
    }
    if rest.contains(['?', '#']) {
        return error(format!(
            "registry.url `{text}` has a query or fragment: give only redis[s]://host:port/db"
        ));
    }
    if !matches!(scheme, "redis" | "rediss") {
        return error(format!(
            "registry.url `{text}` must start with redis:// or rediss:// (TLS)"
        ));
    }
    if host.is_empty() {
        return error(format!("registry.url `{text}` names no host"));
    }
    Ok(())
}

/// An environment variable name: letters, digits and `_`, not starting with
/// a digit.
pub(crate) fn check_env_name(
    field: &str,
    var: &Spanned<String>,
) -> Result<(), (Option<Range<usize>>, String)> {
    let name = var.get_ref();
    if name.is_empty()
        || name.starts_with(|c: char| c.is_ascii_digit())
        || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
    {
        return Err((
            Some(var.span()),
            format!("{field} `{name}` is not an environment variable name (letters, digits and _)"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::Policy;

    use super::*;

    const PROVIDER: &str = r#"
[[providers]]
name = "sim"
base_url = "http://127.0.0.1:9/v1"
context_window = 1000

[[routes]]
model = "*"
provider = "sim"
"#;

    fn load(registry: &str) -> Result<Policy, String> {
        Policy::from_toml_str(
            &format!("{PROVIDER}\n[registry]\n{registry}\n"),
            "test.toml",
        )
        .map_err(|error| error.to_string())
    }

    #[test]
    fn memory_is_the_default_and_degrade_its_fallback() {
        let policy = Policy::from_toml_str(PROVIDER, "test.toml").unwrap();
        assert_eq!(policy.registry.backend, RegistryBackend::Memory);
        assert!(!policy.registry.shared());
        assert_eq!(policy.registry.on_unavailable, OnUnavailable::Degrade);
    }

    #[test]
    fn a_redis_registry_loads_with_url_and_key() {
        let policy = load(
            "backend = \"redis\"\nurl = \"rediss://cache.internal:6380/2\"\n\
             key_env = \"KEY\"\npassword_env = \"PASS\"\nca_file = \"/etc/ca.pem\"\n\
             on_unavailable = \"fail-closed\"",
        )
        .unwrap();
        assert!(policy.registry.shared());
        assert_eq!(policy.registry.on_unavailable, OnUnavailable::FailClosed);
        assert_eq!(policy.registry.key_prefix, "canarygate:");
    }

    #[test]
    fn every_mistake_is_named() {
        for (registry, expected) in [
            (
                "backend = \"redis\"\nkey_env = \"KEY\"",
                "needs registry.url",
            ),
            (
                "backend = \"redis\"\nurl = \"redis://h:6379\"",
                "needs registry.key_env",
            ),
            (
                "backend = \"redis\"\nurl = \"http://h:6379\"\nkey_env = \"K\"",
                "must start with redis://",
            ),
            (
                "backend = \"redis\"\nurl = \"redis://:hunter2@h:6379\"\nkey_env = \"K\"",
                "holds a password",
            ),
            (
                "backend = \"redis\"\nurl = \"redis://user:hunter2@h\"\nkey_env = \"K\"",
                "holds a password",
            ),
            (
                "backend = \"redis\"\nurl = \"redis:///0\"\nkey_env = \"K\"",
                "names no host",
            ),
            (
                "backend = \"redis\"\nurl = \"redis://h\"\nkey_env = \"K\"\nca_file = \"ca.pem\"",
                "rediss://",
            ),
            ("url = \"redis://h\"", "backend is \"memory\""),
            ("key_env = \"KEY\"", "backend is \"memory\""),
            (
                "backend = \"redis\"\nurl = \"rediss://h/#x\"\nkey_env = \"K\"",
                "query or fragment",
            ),
            (
                "backend = \"redis\"\nurl = \"redis://h\"\nkey_env = \"1KEY\"",
                "not an environment variable name",
            ),
            ("timeout_ms = 0", "registry.timeout_ms must be between 1"),
            (
                "connect_timeout_ms = 600000",
                "registry.connect_timeout_ms must be between 1",
            ),
            ("key_prefix = \"a\\nb\"", "control characters"),
            ("backend = \"postgres\"", "unknown variant"),
            ("on_unavailable = \"retry\"", "unknown variant"),
        ] {
            let error = load(registry).expect_err(registry);
            assert!(error.contains(expected), "{registry}: {error}");
            assert!(
                !error.contains("hunter2"),
                "a password in an error: {error}"
            );
        }
    }
}
