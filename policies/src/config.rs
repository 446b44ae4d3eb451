//! The policy file: schema, parsing and validation.
//!
//! A policy is TOML. Every table rejects unknown fields, and every error names
//! the file, the line and column, and what is wrong. Cross-references (a route
//! naming a provider, managed auth needing provider keys) are checked at load,
//! so a policy that loads is one the server can run.
//!
//! Reading the file is the caller's job; this module only sees text.

use std::collections::HashSet;
use std::fmt;
use std::ops::Range;

use serde::Deserialize;
use toml::Spanned;

use crate::echo_cost::TokenizerDigits;
use crate::endpoints_config::EndpointsConfig;
use crate::local_config::{LocalConfig, ProbeConfig};
use crate::registry_config::{RegistryConfig, check_env_name};
use crate::topic::TopicConfig;
use crate::verify_config::VerifyConfig;

/// The preset used when no `--config` is given.
pub const DEFAULT_PRESET: &str = include_str!("../presets/default.toml");

/// Shipped presets by name, for `--config preset:NAME` and tests.
pub const PRESETS: &[(&str, &str)] = &[
    ("default", DEFAULT_PRESET),
    ("strict", include_str!("../presets/strict.toml")),
    ("observe", include_str!("../presets/observe.toml")),
];

/// Route pattern that matches every model name.
pub const ANY_MODEL: &str = "*";

/// A policy that failed to load: where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    /// Name of the file (or preset) the text came from.
    pub origin: String,
    /// 1-based line and column of the offending text, when known.
    pub position: Option<(usize, usize)>,
    /// What is wrong, in one sentence.
    pub message: String,
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.position {
            Some((line, column)) => {
                write!(f, "{}:{line}:{column}: {}", self.origin, self.message)
            }
            None => write!(f, "{}: {}", self.origin, self.message),
        }
    }
}

impl std::error::Error for PolicyError {}

/// A validated policy.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// How clients authenticate and where the provider key comes from.
    #[serde(default)]
    pub auth: AuthConfig,
    /// Request size, concurrency and timeout limits.
    #[serde(default)]
    pub limits: Limits,
    /// Upstream providers, by name.
    #[serde(default)]
    pub providers: Vec<ProviderConfig>,
    /// Client model name to provider model, first match wins.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// Answer verification: echo, release and failure action.
    #[serde(default)]
    pub verify: VerifyConfig,
    /// Audit sampling and encryption of samples.
    #[serde(default)]
    pub audit: AuditConfig,
    /// The bundled local engine and which requests it serves.
    #[serde(default)]
    pub local: LocalConfig,
    /// Scheduled context probing.
    #[serde(default)]
    pub probe: ProbeConfig,
    /// Where live canaries are kept: this process, or shared on Redis.
    #[serde(default)]
    pub registry: RegistryConfig,
    /// Endpoints canarygate cannot verify: forwarded or refused.
    #[serde(default)]
    pub endpoints: EndpointsConfig,
    /// The topic check: does the answer fit the question?
    #[serde(default)]
    pub topic: TopicConfig,
    /// The review page `serve` runs beside the proxy.
    #[serde(default)]
    pub review: ReviewConfig,
}

/// `[review]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReviewConfig {
    /// Where `serve` also serves the review page (the admin token comes
    /// from `$CANARYGATE_ADMIN_TOKEN`); unset: off. `serve --review-listen`
    /// overrides it.
    pub listen: Option<std::net::SocketAddr>,
}

/// Sample rate of `[audit]` when none is given (2%).
pub const DEFAULT_AUDIT_SAMPLE_RATE: f64 = 0.02;

/// `[audit] journal_nice` when none is given: the journal writer keeps the
/// process's priority (raising it costs whole answers 5–8 % of their
/// throughput at saturation; bench/README.md, "The journal thread's
/// priority").
pub const DEFAULT_AUDIT_JOURNAL_NICE: i32 = 0;

/// The changes `[audit] journal_nice` accepts: ones that raise the priority.
pub const AUDIT_JOURNAL_NICE_RANGE: std::ops::RangeInclusive<i32> = -20..=0;

/// `[audit]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuditConfig {
    /// Share of passing requests whose text is kept for spot-checks, 0.0 to
    /// 1.0. Failed verdicts are always kept.
    pub sample_rate: Spanned<f64>,
    /// Environment variable holding the 32-byte key (64 hex characters or
    /// base64) that encrypts samples at rest. Unset: samples are stored in clear.
    pub encryption_key_env: Option<Spanned<String>>,
    /// When a request's record must be on disk.
    pub durability: Durability,
    /// Who besides its owner may already have access to the data directory
    /// and its files when `serve` starts (canarygate itself always creates
    /// them owner-only: 0700 and 0600).
    pub data_readable_by: DataReaders,
    /// Change to the audit journal thread's nice value against the
    /// process's, −20 to 0 (the default: none): every durable answer waits
    /// for that thread to wake. Below 0 needs `CAP_SYS_NICE` (or
    /// `RLIMIT_NICE`); without it the thread keeps the process's priority
    /// and `serve` says so.
    pub journal_nice: Spanned<i32>,
}

/// `[audit] data_readable_by`: the access to the data directory and its
/// files that `serve` accepts at start. More is refused with a message that
/// names the path, its mode and the fix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DataReaders {
    /// Nobody but the owner: no permission bit for group or others.
    #[default]
    Owner,
    /// The owner and the file's group: no permission bit for others.
    Group,
    /// Not checked.
    Anyone,
}

/// `[audit] durability`: when a request's record must be on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Durability {
    /// Before the client gets the last byte of its answer; an answer whose
    /// record cannot be written is withheld. Costs an fsync wait per request
    /// (shared by concurrent requests).
    #[default]
    BeforeAnswer,
    /// Queued for the next group commit while the answer goes out (commits
    /// start at most every 50 ms, so records gather): no fsync on the
    /// request's path, but a crash loses the records of the last commit and
    /// those queued for the next, and a failed write cannot withhold an answer
    /// (it is logged and counted in `canarygate_audit_background_failures`).
    Background,
}

impl Default for AuditConfig {
    fn default() -> Self {
        Self {
            sample_rate: Spanned::new(0..0, DEFAULT_AUDIT_SAMPLE_RATE),
            encryption_key_env: None,
            durability: Durability::BeforeAnswer,
            data_readable_by: DataReaders::Owner,
            journal_nice: Spanned::new(0..0, DEFAULT_AUDIT_JOURNAL_NICE),
        }
    }
}

/// Client authentication mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AuthMode {
    /// The client's `Authorization` header is forwarded to the provider.
    #[default]
    Passthrough,
    /// Clients present proxy keys listed (as hashes) in the policy; the proxy
    /// attaches the provider's key from the environment.
    Managed,
}

/// `[auth]`.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// `passthrough` (default) or `managed`.
    #[serde(default)]
    pub mode: AuthMode,
    /// Proxy keys accepted in managed mode, as SHA-256 hashes.
    #[serde(default)]
    pub client_keys: Vec<ClientKey>,
}

/// One accepted proxy key (managed auth).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientKey {
    /// Who holds the key, for logs and audit records.
    pub name: String,
    /// Lowercase hex SHA-256 of the key (`canarygate hash-key` prints it).
    pub sha256: Spanned<String>,
}

/// `[limits]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// Requests served at once; more get HTTP 429. A request takes its slot
    /// once its whole body has arrived.
    pub max_concurrent_requests: usize,
    /// Memory the request bodies being parsed may take at once, in bytes,
    /// as bounded from each body of 16 KiB or more (its bytes and up to 128
    /// per JSON value it may hold). A body over it on its own gets HTTP 413;
    /// one that does not fit beside those in flight, HTTP 429.
    pub max_parsed_bytes: u64,
    /// Client connections open at once. At the cap, the connection idle the
    /// longest (between requests, or still sending its first request's head)
    /// is closed for a new one; when every connection has a request in
    /// flight, new ones wait in the listen queue. Unset: 4096, lowered to
    /// fit the open-file limit.
    pub max_connections: Option<usize>,
    /// Time a client has to send a request's head (request line and
    /// headers): from accepting its connection, or from the first byte of a
    /// later request on it. Then the connection is closed.
    pub client_header_timeout_ms: u64,
    /// Time a client has to send a whole request body, from its head; then
    /// HTTP 408.
    pub client_body_timeout_ms: u64,
    /// Longest silence allowed between two chunks of a request body; then
    /// HTTP 408.
    pub client_body_idle_timeout_ms: u64,
    /// How long a connection may stay open with no request on it (HTTP/1.1
    /// keep-alive, HTTP/2 with no open stream); then it is closed.
    pub client_keepalive_timeout_ms: u64,
    /// How long writing an answer to a client may stay blocked (the client
    /// reads nothing); then the connection is dropped and the request ends.
    pub client_write_timeout_ms: u64,
    /// Time allowed to open a connection to the provider.
    pub connect_timeout_ms: u64,
    /// Time allowed from sending the request to the first byte of the
    /// answer (to a stream's first event), and for a whole answer's body
    /// from its head.
    pub first_byte_timeout_ms: u64,
    /// Longest silence allowed between two chunks of a whole answer, or two
    /// whole events of a stream.
    pub idle_timeout_ms: u64,
    /// How long an `echo-first` stream may send the client nothing while
    /// canarygate holds the provider's events for verification (a reasoning
    /// model thinking before its echo): then the response head goes out,
    /// its verdict pending, and an SSE comment, again every as long while
    /// nothing else goes, so that clients' read timeouts do not fire. 0:
    /// never.
    pub stream_keepalive_ms: u64,
}

/// `limits.max_connections` when the policy sets none (lowered at start to
/// fit the process's open-file limit).
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// The longest any `limits.*_timeout_ms` may be: one day.
pub const MAX_TIMEOUT_MS: u64 = 24 * 60 * 60 * 1000;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 8 * 1024 * 1024,
            max_concurrent_requests: 1024,
            max_parsed_bytes: 1 << 30,
            max_connections: None,
            client_header_timeout_ms: 10_000,
            client_body_timeout_ms: 60_000,
            client_body_idle_timeout_ms: 10_000,
            client_keepalive_timeout_ms: 60_000,
            client_write_timeout_ms: 60_000,
            connect_timeout_ms: 10_000,
            first_byte_timeout_ms: 300_000,
            idle_timeout_ms: 120_000,
            stream_keepalive_ms: 15_000,
        }
    }
}

/// The API a provider speaks, and so which endpoints it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderApi {
    /// OpenAI's: Chat Completions, the Responses API, legacy completions,
    /// embeddings; `Authorization: Bearer`.
    #[default]
    Openai,
    /// Anthropic's Messages API; `x-api-key` and `anthropic-version`.
    Anthropic,
}

impl ProviderApi {
    /// The name used in the policy file.
    pub fn name(self) -> &'static str {
        match self {
            Self::Openai => "openai",
            Self::Anthropic => "anthropic",
        }
    }
}

/// `[[providers]]`: one upstream API.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// Name routes refer to.
    pub name: Spanned<String>,
    /// The API it speaks (default `openai`).
    #[serde(default)]
    pub api: ProviderApi,
    /// Base URL including the version prefix, e.g. `https://api.openai.com/v1`.
    pub base_url: Spanned<String>,
    /// The context window the provider advertises, in tokens.
    pub context_window: Spanned<u64>,
    /// Policy cap on the context trusted to this provider, in tokens (below
    /// the advertised window, e.g. from an incident report).
    #[serde(default)]
    pub max_context_tokens: Option<u64>,
    /// Environment variable holding the provider API key. Required in managed
    /// auth; in passthrough auth the client's key is forwarded instead.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// PEM file of extra CA certificates trusted for this provider, on top of
    /// the bundled web PKI roots (private gateways).
    #[serde(default)]
    pub extra_ca_file: Option<String>,
    /// `tokenizer.json` of the provider's model. With it, prompt tokens are
    /// counted exactly and the `prompt_tokens` check holds the provider to
    /// `verify.exact_tolerance`; without it, to a conservative estimate.
    #[serde(default)]
    pub tokenizer_file: Option<String>,
    /// How the provider's tokenizer splits digits, which sets the output
    /// tokens a request gets for its echo ([`crate::echo_cost`]); without
    /// it, measured with `tokenizer_file`, else guessed from the model name.
    #[serde(default)]
    pub tokenizer_digits: Option<TokenizerDigits>,
    /// Its models' chat templates take a system message (default true).
    /// `false` for templates that refuse one (Gemma 1 and 2, Mistral's
    /// first Instruct models) or drop a `developer` message (most
    /// open-weight templates): a request without a system message of its
    /// own (a `developer` one does not count) gets the head canary in its
    /// first user message rather than in a system message of canarygate's.
    /// Left true, a provider's refusal of that system message is learned
    /// per model (the request goes once more).
    #[serde(default = "default_true")]
    pub system_messages: bool,
}

/// Serde's default for a field that is on unless said otherwise.
fn default_true() -> bool {
    true
}

/// `[[routes]]`: which provider serves a client model name.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Model name the client asks for, or `*` for any.
    pub model: Spanned<String>,
    /// Provider name.
    pub provider: Spanned<String>,
    /// Model name sent upstream; defaults to the client's model name.
    #[serde(default)]
    pub upstream_model: Option<String>,
    /// Context window for this model when it differs from the provider's.
    #[serde(default)]
    pub context_window: Option<u64>,
    /// Policy cap on the context trusted for this model; overrides the
    /// provider's `max_context_tokens`.
    #[serde(default)]
    pub max_context_tokens: Option<u64>,
    /// `model` reported when the local engine serves this route; defaults to
    /// `[local] model_name`.
    #[serde(default)]
    pub local_model: Option<String>,
}

/// Where a client model name goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedRoute<'a> {
    /// Index into [`Policy::providers`].
    pub provider_index: usize,
    /// Provider name.
    pub provider: &'a str,
    /// Model name to send upstream.
    pub upstream_model: &'a str,
    /// Advertised context window for this model, in tokens.
    pub context_window: u64,
    /// Policy cap on the trusted context, in tokens.
    pub max_context_tokens: Option<u64>,
    /// `model` reported in answers the local engine serves for this route.
    pub local_model: &'a str,
}

impl Policy {
    /// Parses and validates policy text. `origin` names the file in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, PolicyError> {
        let policy: Policy = toml::from_str(text).map_err(|error| PolicyError {
            origin: origin.to_owned(),
            position: error.span().map(|span| line_column(text, span.start)),
            message: error.message().trim_end().to_owned(),
        })?;
        policy.validate().map_err(|(span, message)| PolicyError {
            origin: origin.to_owned(),
            position: span.map(|span| line_column(text, span.start)),
            message,
        })?;
        Ok(policy)
    }

    /// The preset called `name`, parsed.
    pub fn preset(name: &str) -> Result<Self, PolicyError> {
        let (_, text) = PRESETS
            .iter()
            .find(|(preset, _)| *preset == name)
            .ok_or_else(|| PolicyError {
                origin: format!("preset:{name}"),
                position: None,
                message: format!(
                    "no such preset; shipped presets: {}",
                    PRESETS
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })?;
        Self::from_toml_str(text, &format!("policies/presets/{name}.toml"))
    }

    /// The position of provider `name` in [`Policy::providers`].
    pub fn provider_index(&self, name: &str) -> Option<usize> {
        self.providers
            .iter()
            .position(|provider| provider.name.get_ref() == name)
    }

    /// The provider called `name`.
    pub fn provider(&self, name: &str) -> Option<&ProviderConfig> {
        self.provider_index(name)
            .map(|index| &self.providers[index])
    }

    /// The route for a client model name, if any route matches: the first
    /// whose model is `model` or `*`, among routes to providers speaking
    /// `api`.
    pub fn route<'a>(&'a self, model: &'a str, api: ProviderApi) -> Option<ResolvedRoute<'a>> {
        self.routes.iter().find_map(|route| {
            let matches = route.model.get_ref() == model || route.model.get_ref() == ANY_MODEL;
            let resolved = self.resolve(route, model).filter(|_| matches)?;
            (self.providers[resolved.provider_index].api == api).then_some(resolved)
        })
    }

    /// Where a request to an API that names no model goes (a stored
    /// response fetched by id): the provider of the wildcard route to
    /// providers speaking `api`, else the first such provider. Its route
    /// names no model.
    pub fn api_route(&self, api: ProviderApi) -> Option<ResolvedRoute<'_>> {
        let provider_index = match self.wildcard_provider(api) {
            Some(name) => self.provider_index(name)?,
            None => self
                .providers
                .iter()
                .position(|provider| provider.api == api)?,
        };
        let provider = &self.providers[provider_index];
        Some(ResolvedRoute {
            provider_index,
            provider: provider.name.get_ref(),
            upstream_model: "",
            context_window: *provider.context_window.get_ref(),
            max_context_tokens: provider.max_context_tokens,
            local_model: &self.local.model_name,
        })
    }

    /// Every named route (wildcards excluded): the client's model name, the
    /// route resolved, and the API of its provider.
    pub fn named_routes(&self) -> impl Iterator<Item = (&str, ResolvedRoute<'_>, ProviderApi)> {
        self.routes
            .iter()
            .filter(|route| route.model.get_ref() != ANY_MODEL)
            .filter_map(|route| {
                let model = route.model.get_ref().as_str();
                let resolved = self.resolve(route, model)?;
                Some((model, resolved, self.providers[resolved.provider_index].api))
            })
    }

    /// `route` resolved for client model `model`.
    fn resolve<'a>(&'a self, route: &'a RouteConfig, model: &'a str) -> Option<ResolvedRoute<'a>> {
        let provider_index = self.provider_index(route.provider.get_ref())?;
        let provider = &self.providers[provider_index];
        Some(ResolvedRoute {
            provider_index,
            provider: provider.name.get_ref(),
            upstream_model: route.upstream_model.as_deref().unwrap_or(model),
            context_window: route
                .context_window
                .unwrap_or(*provider.context_window.get_ref()),
            max_context_tokens: route.max_context_tokens.or(provider.max_context_tokens),
            local_model: route
                .local_model
                .as_deref()
                .unwrap_or(&self.local.model_name),
        })
    }

    /// The API of the providers routes lead to for `model` other than
    /// `api`, if some route would serve it there: to tell a client which
    /// endpoint serves the model.
    pub fn api_serving(&self, model: &str, api: ProviderApi) -> Option<ProviderApi> {
        self.routes.iter().find_map(|route| {
            let matches = route.model.get_ref() == model || route.model.get_ref() == ANY_MODEL;
            let other = self.provider(route.provider.get_ref())?.api;
            (matches && other != api).then_some(other)
        })
    }

    /// The provider of the wildcard route (`model = "*"`, routes come
    /// last) to providers speaking `api`, if there is one.
    pub fn wildcard_provider(&self, api: ProviderApi) -> Option<&str> {
        self.routes
            .iter()
            .filter(|route| route.model.get_ref() == ANY_MODEL)
            .map(|route| route.provider.get_ref().as_str())
            .find(|name| {
                self.provider(name)
                    .is_some_and(|provider| provider.api == api)
            })
    }

    /// Sets the base URL of every provider (`--upstream`: one server that
    /// speaks each API, such as a gateway or the simulator). Errors when two
    /// providers speak the same API (which one was meant?) or the URL is not
    /// http(s).
    pub fn override_upstream(&mut self, base_url: &str) -> Result<(), BaseUrlError> {
        let mut apis = HashSet::new();
        if let Some(twice) = self
            .providers
            .iter()
            .find(|provider| !apis.insert(provider.api))
        {
            return Err(BaseUrlError::NotOnePerApi(twice.api.name()));
        }
        let names: Vec<String> = self
            .providers
            .iter()
            .map(|provider| provider.name.get_ref().clone())
            .collect();
        for name in names {
            self.set_base_url(&name, base_url)?;
        }
        Ok(())
    }

    /// Sets the base URL of provider `name`. Errors when there is no such
    /// provider or the URL is not http(s).
    pub fn set_base_url(&mut self, name: &str, base_url: &str) -> Result<(), BaseUrlError> {
        check_base_url(base_url)?;
        let index = self
            .provider_index(name)
            .ok_or_else(|| BaseUrlError::NoSuchProvider(name.to_owned()))?;
        let provider = &mut self.providers[index];
        provider.base_url = Spanned::new(0..0, base_url.trim_end_matches('/').to_owned());
        Ok(())
    }

    /// Checks what serde cannot: each section, then how they fit together.
    fn validate(&self) -> Result<(), (Option<Range<usize>>, String)> {
        self.validate_limits()?;
        self.validate_audit()?;
        let providers = self.validate_providers()?;
        self.local.validate()?;
        self.probe.validate()?;
        self.registry.validate()?;
        self.endpoints.validate()?;
        self.topic.validate()?;
        self.verify.validate(&providers, self.local.enabled())?;
        self.validate_routes(&providers)?;
        self.validate_auth()
    }

    fn validate_limits(&self) -> Result<(), (Option<Range<usize>>, String)> {
        let limits = &self.limits;
        // Upper bounds: 1 GiB for a body; for counts, Linux's default
        // ceiling on a process's open files (fs.nr_open), which no more
        // connections or provider requests than that could use anyway.
        const MAX_BODY_BYTES: u64 = 1 << 30;
        const MAX_COUNT: u64 = 1 << 20;
        // Parsed request bodies: 1 TiB, far past any host's memory.
        const MAX_PARSED_BYTES: u64 = 1 << 40;
        for (name, value, max) in [
            (
                "limits.max_body_bytes",
                limits.max_body_bytes as u64,
                MAX_BODY_BYTES,
            ),
            (
                "limits.max_concurrent_requests",
                limits.max_concurrent_requests as u64,
                MAX_COUNT,
            ),
            (
                "limits.max_connections",
                limits.max_connections.map_or(1, |value| value as u64),
                MAX_COUNT,
            ),
            (
                "limits.max_parsed_bytes",
                limits.max_parsed_bytes,
                MAX_PARSED_BYTES,
            ),
        ] {
            if value == 0 {
                return Err((None, format!("{name} must be greater than 0")));
            }
            if value > max {
                return Err((None, format!("{name} must be at most {max}, not {value}")));
            }
        }
        for (name, value) in [
            (
                "limits.client_header_timeout_ms",
                limits.client_header_timeout_ms,
            ),
            (
                "limits.client_body_timeout_ms",
                limits.client_body_timeout_ms,
            ),
            (
                "limits.client_body_idle_timeout_ms",
                limits.client_body_idle_timeout_ms,
            ),
            (
                "limits.client_keepalive_timeout_ms",
                limits.client_keepalive_timeout_ms,
            ),
            (
                "limits.client_write_timeout_ms",
                limits.client_write_timeout_ms,
            ),
            ("limits.connect_timeout_ms", limits.connect_timeout_ms),
            ("limits.first_byte_timeout_ms", limits.first_byte_timeout_ms),
            ("limits.idle_timeout_ms", limits.idle_timeout_ms),
        ] {
            if !(1..=MAX_TIMEOUT_MS).contains(&value) {
                return Err((
                    None,
                    format!("{name} must be between 1 and {MAX_TIMEOUT_MS} (one day), not {value}"),
                ));
            }
        }
        if limits.stream_keepalive_ms > MAX_TIMEOUT_MS {
            return Err((
                None,
                format!(
                    "limits.stream_keepalive_ms must be 0 (never) or at most {MAX_TIMEOUT_MS} \
                     (one day), not {}",
                    limits.stream_keepalive_ms
                ),
            ));
        }
        Ok(())
    }

    fn validate_audit(&self) -> Result<(), (Option<Range<usize>>, String)> {
        let audit = &self.audit;
        if !(0.0..=1.0).contains(audit.sample_rate.get_ref()) {
            return Err((
                Some(audit.sample_rate.span()),
                "audit.sample_rate must be between 0.0 and 1.0".into(),
            ));
        }
        if let Some(var) = &audit.encryption_key_env {
            check_env_name("audit.encryption_key_env", var)?;
        }
        if !AUDIT_JOURNAL_NICE_RANGE.contains(audit.journal_nice.get_ref()) {
            return Err((
                Some(audit.journal_nice.span()),
                format!(
                    "audit.journal_nice must be between -20 and 0 (a change that raises the \
                     journal thread's priority), not {}",
                    audit.journal_nice.get_ref()
                ),
            ));
        }
        Ok(())
    }

    /// The providers' names, once each is valid.
    fn validate_providers(&self) -> Result<HashSet<&str>, (Option<Range<usize>>, String)> {
        if self.providers.is_empty() {
            return Err((
                None,
                "a policy needs at least one [[providers]] entry".into(),
            ));
        }
        let mut names = HashSet::new();
        for provider in &self.providers {
            let name = &provider.name;
            if name.get_ref().is_empty() {
                return Err((Some(name.span()), "provider name is empty".into()));
            }
            if !names.insert(name.get_ref().as_str()) {
                return Err((
                    Some(name.span()),
                    format!("provider `{}` is defined twice", name.get_ref()),
                ));
            }
            check_base_url(provider.base_url.get_ref())
                .map_err(|error| (Some(provider.base_url.span()), error.to_string()))?;
            if *provider.context_window.get_ref() == 0 || provider.max_context_tokens == Some(0) {
                return Err((
                    Some(provider.context_window.span()),
                    "context_window and max_context_tokens must be greater than 0".into(),
                ));
            }

            if self.auth.mode == AuthMode::Managed && provider.api_key_env.is_none() {
                return Err((
                    Some(name.span()),
                    format!(
                        "auth.mode is \"managed\", so provider `{}` needs api_key_env \
                         (the environment variable holding its API key)",
                        name.get_ref()
                    ),
                ));
            }
        }
        Ok(names)
    }

    fn validate_routes(&self, names: &HashSet<&str>) -> Result<(), (Option<Range<usize>>, String)> {
        if self.routes.is_empty() {
            return Err((None, "a policy needs at least one [[routes]] entry".into()));
        }
        let mut models = HashSet::new();
        let mut wildcard_seen = false;
        for route in &self.routes {
            let model = route.model.get_ref();
            if model.is_empty() {
                return Err((Some(route.model.span()), "route model is empty".into()));
            }
            // Unknown providers are reported below, with their own message.
            let api = self
                .provider(route.provider.get_ref())
                .map_or(ProviderApi::Openai, |provider| provider.api);
            if !models.insert((model.as_str(), api)) {
                return Err((
                    Some(route.model.span()),
                    format!(
                        "model `{model}` is routed twice to providers of api \"{}\"",
                        api.name()
                    ),
                ));
            }
            if model == ANY_MODEL {
                wildcard_seen = true;
            } else if wildcard_seen {
                return Err((
                    Some(route.model.span()),
                    "wildcard routes `*` must come after every named route (routes after them \
                     are unreachable)"
                        .into(),
                ));
            }
            if !names.contains(route.provider.get_ref().as_str()) {
                return Err((
                    Some(route.provider.span()),
                    format!(
                        "route for `{model}` names provider `{}`, which is not defined",
                        route.provider.get_ref()
                    ),
                ));
            }
            if route.context_window == Some(0) || route.max_context_tokens == Some(0) {
                return Err((
                    Some(route.model.span()),
                    "route context_window and max_context_tokens must be greater than 0".into(),
                ));
            }
            if route.local_model.as_deref().is_some_and(str::is_empty) {
                return Err((
                    Some(route.model.span()),
                    "route local_model is empty".into(),
                ));
            }
        }
        Ok(())
    }

    fn validate_auth(&self) -> Result<(), (Option<Range<usize>>, String)> {
        match self.auth.mode {
            AuthMode::Managed if self.auth.client_keys.is_empty() => Err((
                None,
                "auth.mode is \"managed\" but auth.client_keys is empty: no client could connect"
                    .into(),
            )),
            AuthMode::Passthrough if !self.auth.client_keys.is_empty() => Err((
                Some(self.auth.client_keys[0].sha256.span()),
                "auth.client_keys is only used with auth.mode = \"managed\"".into(),
            )),
            _ => {
                for key in &self.auth.client_keys {
                    let hash = key.sha256.get_ref();
                    if hash.len() != 64
                        || !hash
                            .bytes()
                            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
                    {
                        return Err((
                            Some(key.sha256.span()),
                            format!(
                                "client key `{}`: sha256 must be 64 lowercase hex characters \
                                 (run `canarygate hash-key`)",
                                key.name
                            ),
                        ));
                    }
                }
                Ok(())
            }
        }
    }
}

/// A base URL that cannot replace a provider's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BaseUrlError {
    /// `--upstream` needs a policy with one provider per API.
    #[error(
        "--upstream sets every provider's base URL, but this policy has several providers of \
         api \"{0}\": set their base_url in the policy file instead"
    )]
    NotOnePerApi(&'static str),
    /// No provider of that name.
    #[error("the policy has no provider `{0}`")]
    NoSuchProvider(String),
    /// Not an http(s) URL.
    #[error("base_url `{0}` must start with http:// or https://")]
    NotHttp(String),
    /// No host after the scheme.
    #[error("base_url `{0}` has no host")]
    NoHost(String),
    /// A user name or password before the host (the URL is not quoted: it
    /// holds a secret).
    #[error(
        "a base_url holds a user name or password (user:password@host): canarygate does not \
         send it, and a policy file is no place for a secret; authenticate with the client's \
         key or the provider's api_key_env"
    )]
    UserInfo,
    /// A query or fragment, which the endpoints' paths would be appended to.
    #[error("base_url `{0}` carries a query or fragment; endpoints are appended to its path")]
    QueryOrFragment(String),
}

fn check_base_url(url: &str) -> Result<(), BaseUrlError> {
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or_else(|| BaseUrlError::NotHttp(url.to_owned()))?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return Err(BaseUrlError::UserInfo);
    }
    if rest.is_empty() || rest.starts_with('/') {
        return Err(BaseUrlError::NoHost(url.to_owned()));
    }
    if rest.contains(['?', '#']) {
        return Err(BaseUrlError::QueryOrFragment(url.to_owned()));
    }
    Ok(())
}

/// 1-based line and column of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[[providers]]
name = "sim"
base_url = "http://127.0.0.1:9/v1"
context_window = 1000

[[routes]]
model = "small"
provider = "sim"
upstream_model = "sim-small"

[[routes]]
model = "*"
provider = "sim"
"#;

    fn error_of(text: &str) -> PolicyError {
        Policy::from_toml_str(text, "test.toml").unwrap_err()
    }

    #[test]
    fn every_preset_loads() {
        for (name, _) in PRESETS {
            Policy::preset(name).unwrap();
        }
    }

    #[test]
    fn routes_resolve_first_match_then_wildcard() {
        let policy = Policy::from_toml_str(MINIMAL, "test.toml").unwrap();
        let small = policy.route("small", ProviderApi::Openai).unwrap();
        assert_eq!(small.upstream_model, "sim-small");
        assert_eq!(small.context_window, 1000);
        assert_eq!(
            policy
                .route("other", ProviderApi::Openai)
                .unwrap()
                .upstream_model,
            "other"
        );
        let named: Vec<&str> = policy.named_routes().map(|(model, ..)| model).collect();
        assert_eq!(named, ["small"]);
    }

    #[test]
    fn unknown_field_names_line() {
        let error = error_of(&MINIMAL.replace("context_window = 1000", "context_windw = 1000"));
        assert_eq!(error.position.unwrap().0, 5);
        assert!(error.message.contains("context_windw"), "{error}");
        assert!(error.to_string().starts_with("test.toml:5:"), "{error}");
    }

    #[test]
    fn a_providers_tokenizer_digits_are_one_of_two_kinds() {
        let with = |value: &str| {
            MINIMAL.replace(
                "context_window = 1000",
                &format!("context_window = 1000\ntokenizer_digits = {value}"),
            )
        };
        let policy = Policy::from_toml_str(&with("\"groups-of-three\""), "test.toml").unwrap();
        assert_eq!(
            policy.providers[0].tokenizer_digits,
            Some(TokenizerDigits::GroupsOfThree)
        );
        let policy = Policy::from_toml_str(&with("\"one-per-digit\""), "test.toml").unwrap();
        assert_eq!(
            policy.providers[0].tokenizer_digits,
            Some(TokenizerDigits::OnePerDigit)
        );
        let policy = Policy::from_toml_str(MINIMAL, "test.toml").unwrap();
        assert_eq!(policy.providers[0].tokenizer_digits, None);
        let error = error_of(&with("\"threes\""));
        assert_eq!(error.position.unwrap().0, 6, "{error}");
        assert!(error.message.contains("groups-of-three"), "{error}");
    }

    #[test]
    fn wrong_type_names_line() {
        let error = error_of(&MINIMAL.replace("1000", "\"big\""));
        assert_eq!(error.position.unwrap().0, 5);
    }

    #[test]
    fn undefined_provider_names_route_line() {
        let error = error_of(&MINIMAL.replace(
            "provider = \"sim\"\nupstream",
            "provider = \"nope\"\nupstream",
        ));
        assert_eq!(error.position.unwrap().0, 9);
        assert!(error.message.contains("`nope`"), "{error}");
    }

    #[test]
    fn wildcard_must_be_last() {
        let text = format!("{MINIMAL}\n[[routes]]\nmodel = \"late\"\nprovider = \"sim\"\n");
        let error = error_of(&text);
        assert!(error.message.contains("wildcard"), "{error}");
        // The unreachable route is named.
        assert_eq!(error.position.unwrap().0, 17);
    }

    #[test]
    fn routes_pick_a_provider_of_the_endpoint_api() {
        let text = format!(
            "{MINIMAL}\n[[providers]]\nname = \"claude\"\napi = \"anthropic\"\n\
             base_url = \"http://127.0.0.1:1/v1\"\ncontext_window = 200000\n\
             [[routes]]\nmodel = \"*\"\nprovider = \"claude\"\n"
        );
        let policy = Policy::from_toml_str(&text, "test.toml").unwrap();
        let openai = policy.route("any", ProviderApi::Openai).unwrap();
        assert_eq!(openai.provider, "sim");
        let anthropic = policy.route("any", ProviderApi::Anthropic).unwrap();
        assert_eq!(anthropic.provider, "claude");
        assert_eq!(anthropic.context_window, 200_000);
        assert_eq!(
            policy.wildcard_provider(ProviderApi::Anthropic),
            Some("claude")
        );
        // `small` is named for the OpenAI provider only.
        assert_eq!(
            policy
                .route("small", ProviderApi::Anthropic)
                .unwrap()
                .provider,
            "claude"
        );
        // Two wildcards to the same API: the second is a mistake.
        let twice = format!("{text}\n[[routes]]\nmodel = \"*\"\nprovider = \"sim\"\n");
        assert!(error_of(&twice).message.contains("routed twice"), "{twice}");
        let only_openai = Policy::from_toml_str(MINIMAL, "test.toml").unwrap();
        assert!(only_openai.route("small", ProviderApi::Anthropic).is_none());
        assert_eq!(
            only_openai.api_serving("small", ProviderApi::Anthropic),
            Some(ProviderApi::Openai)
        );
    }

    #[test]
    fn a_keepalive_is_off_at_0_and_at_most_a_day() {
        let with = |ms: u64| format!("[limits]\nstream_keepalive_ms = {ms}\n{MINIMAL}");
        let off = Policy::from_toml_str(&with(0), "test.toml").unwrap();
        assert_eq!(off.limits.stream_keepalive_ms, 0);
        assert_eq!(
            Policy::preset("default")
                .unwrap()
                .limits
                .stream_keepalive_ms,
            15_000
        );
        assert_eq!(Limits::default().stream_keepalive_ms, 15_000);
        let error = error_of(&with(MAX_TIMEOUT_MS + 1));
        assert!(
            error.message.contains("limits.stream_keepalive_ms"),
            "{error:?}"
        );
    }

    #[test]
    fn bad_base_url() {
        let error = error_of(&MINIMAL.replace("http://127.0.0.1:9/v1", "ftp://x"));
        assert_eq!(error.position.unwrap().0, 4);
        // A password is refused without being quoted.
        let error = error_of(&MINIMAL.replace("http://127.0.0.1:9/v1", "https://u:S3cret@x/v1"));
        assert!(error.message.contains("user name or password"), "{error:?}");
        assert!(!error.message.contains("S3cret"), "{error:?}");
        assert_eq!(error.position.unwrap().0, 4);
        for url in ["https://x/v1?api-version=1", "https://x/v1#part"] {
            let error = error_of(&MINIMAL.replace("http://127.0.0.1:9/v1", url));
            assert!(error.message.contains("query or fragment"), "{error:?}");
        }
    }

    #[test]
    fn managed_auth_needs_keys_and_provider_env() {
        let managed = format!("[auth]\nmode = \"managed\"\n{MINIMAL}");
        assert!(error_of(&managed).message.contains("api_key_env"));
        let with_env = managed.replace(
            "context_window = 1000",
            "context_window = 1000\napi_key_env = \"SIM_KEY\"",
        );
        assert!(error_of(&with_env).message.contains("client_keys is empty"));
        let bad_hash = with_env.replace(
            "mode = \"managed\"",
            "mode = \"managed\"\nclient_keys = [{ name = \"cron\", sha256 = \"ABC\" }]",
        );
        assert!(error_of(&bad_hash).message.contains("64 lowercase hex"));
    }

    #[test]
    fn audit_section_defaults_and_validates() {
        let policy = Policy::from_toml_str(MINIMAL, "test.toml").unwrap();
        assert_eq!(
            *policy.audit.sample_rate.get_ref(),
            DEFAULT_AUDIT_SAMPLE_RATE
        );
        assert!(policy.audit.encryption_key_env.is_none());
        let text =
            format!("[audit]\nsample_rate = 0.5\nencryption_key_env = \"CG_AUDIT_KEY\"\n{MINIMAL}");
        let policy = Policy::from_toml_str(&text, "test.toml").unwrap();
        assert_eq!(*policy.audit.sample_rate.get_ref(), 0.5);
        let error = error_of(&text.replace("0.5", "1.5"));
        assert_eq!(error.position.unwrap().0, 2, "{error}");
        let error = error_of(&text.replace("CG_AUDIT_KEY", "not a name"));
        assert_eq!(error.position.unwrap().0, 3, "{error}");
        let error = error_of(&text.replace("sample_rate", "sample_rat"));
        assert!(error.message.contains("sample_rat"), "{error}");
        assert_eq!(
            *policy.audit.journal_nice.get_ref(),
            DEFAULT_AUDIT_JOURNAL_NICE
        );
        let nice = format!("[audit]\njournal_nice = -5\n{MINIMAL}");
        let policy = Policy::from_toml_str(&nice, "test.toml").unwrap();
        assert_eq!(*policy.audit.journal_nice.get_ref(), -5);
        for outside in ["-21", "3"] {
            let error = error_of(&nice.replace("-5", outside));
            assert_eq!(error.position.unwrap().0, 2, "{error}");
            assert!(error.message.contains("journal_nice"), "{error}");
        }
    }

    #[test]
    fn client_deadlines_and_connection_cap_default_and_validate() {
        let policy = Policy::from_toml_str(MINIMAL, "test.toml").unwrap();
        let limits = &policy.limits;
        assert_eq!(limits.max_connections, None);
        assert_eq!(
            (
                limits.client_header_timeout_ms,
                limits.client_body_timeout_ms,
                limits.client_body_idle_timeout_ms,
                limits.client_keepalive_timeout_ms,
                limits.client_write_timeout_ms,
            ),
            (10_000, 60_000, 10_000, 60_000, 60_000)
        );
        assert_eq!(policy.audit.data_readable_by, DataReaders::Owner);
        let text = format!(
            "[limits]\nmax_connections = 64\nclient_body_idle_timeout_ms = 250\n\
             [audit]\ndata_readable_by = \"group\"\n{MINIMAL}"
        );
        let policy = Policy::from_toml_str(&text, "test.toml").unwrap();
        assert_eq!(policy.limits.max_connections, Some(64));
        assert_eq!(policy.limits.client_body_idle_timeout_ms, 250);
        assert_eq!(policy.audit.data_readable_by, DataReaders::Group);
        let error = error_of(&text.replace("= 64", "= 0"));
        assert!(
            error
                .message
                .contains("limits.max_connections must be greater than 0"),
            "{error}"
        );
        // Absurd counts are a policy error, not a panic at start (a tokio
        // semaphore holds at most 2^61 permits).
        for (setting, value) in [
            ("max_connections", "3000000000000000000"),
            ("max_concurrent_requests", "1048577"),
        ] {
            let line = format!("{setting} = {value}\n");
            let error = error_of(&text.replace("max_connections = 64\n", &line));
            assert!(
                error.message.contains(&format!(
                    "limits.{setting} must be at most 1048576, not {value}"
                )),
                "{error}"
            );
        }
        for (value, what) in [("0", "not 0"), ("86400001", "not 86400001")] {
            let error = error_of(&text.replace("= 250", &format!("= {value}")));
            assert!(
                error
                    .message
                    .contains("limits.client_body_idle_timeout_ms must be between 1")
                    && error.message.contains(what),
                "{error}"
            );
        }
        let error = error_of(&text.replace("\"group\"", "\"world\""));
        assert!(error.message.contains("world"), "{error}");
    }

    #[test]
    fn upstream_override_needs_single_provider() {
        let mut policy = Policy::from_toml_str(MINIMAL, "test.toml").unwrap();
        policy
            .override_upstream("http://127.0.0.1:1234/v1/")
            .unwrap();
        assert_eq!(
            policy.providers[0].base_url.get_ref(),
            "http://127.0.0.1:1234/v1"
        );
        assert!(policy.override_upstream("localhost").is_err());
    }
}
