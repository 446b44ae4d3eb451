//! The providers of the policy: one HTTP(S) client each
//! ([`crate::upstream_client`]), the one place an upstream request is built
//! ([`Upstream::request`]), reading its answer with deadlines, and mapping
//! what can go wrong to the client-facing [`ApiError`].
//!
//! Longer than 500 lines: about 80 of them are the unit tests of what is
//! read from a provider's response head (its media type, the headers
//! relayed to the client) and of its errors' canary-shaped text withheld.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use canarygate_policies::EchoCost;
use canarygate_policies::canary::find_canaries;
use canarygate_policies::config::{AuthMode, Policy, ProviderApi, ProviderConfig};
use canarygate_policies::inject::SystemRole;
use http_body_util::Full;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

use crate::clock::RequestClock;
use crate::error::{ApiError, ErrorCode, error_chain};
use crate::identity::key_value;
use crate::system_role::SystemRoles;
use crate::upstream_client::{
    BodyDeadlines, SendError, SendFailure, UpstreamClient, UpstreamRequest, UpstreamResponse,
    read_whole,
};
pub use crate::upstream_setup::{UpstreamError, provider_api_key};
use crate::wire::edit::TokenCounter;

/// The Chat Completions endpoint, relative to a provider's `base_url`.
pub const CHAT_COMPLETIONS: &str = "chat/completions";

/// Request header naming the version of Anthropic's API.
pub const ANTHROPIC_VERSION_HEADER: &str = "anthropic-version";

/// The version of Anthropic's API sent when the client names none: the one
/// Anthropic's SDKs sent until 2026 (`2023-06-01`), which its API still
/// accepts.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// How long [`Upstream::check_reachable`] waits for an answer.
const REACHABLE_TIMEOUT: Duration = Duration::from_secs(5);

/// Every provider of the policy, in policy order (a route's `provider_index`
/// indexes it).
pub struct Upstreams(Vec<Upstream>);

impl Upstreams {
    /// Builds one client per provider of `policy`.
    pub fn build(policy: &Policy) -> Result<Self, UpstreamError> {
        policy
            .providers
            .iter()
            .map(|provider| Upstream::new(provider, policy))
            .collect::<Result<_, _>>()
            .map(Self)
    }

    /// Builds every provider's client as [`Upstreams::build`] does (its
    /// base URL, its `extra_ca_file`, its `tokenizer_file`), without the
    /// provider keys of managed auth, which a check of the policy file may
    /// run without: what `check-config` adds to the policy's own checks.
    pub fn check(policy: &Policy) -> Result<(), UpstreamError> {
        let mut unkeyed = policy.clone();
        unkeyed.auth.mode = AuthMode::Passthrough;
        Self::build(&unkeyed).map(drop)
    }

    /// The provider at `index` in policy order.
    pub fn at(&self, index: usize) -> &Upstream {
        &self.0[index]
    }

    /// The provider called `name`.
    pub fn named(&self, name: &str) -> Result<&Upstream, UpstreamError> {
        self.0
            .iter()
            .find(|upstream| upstream.name == name)
            .ok_or_else(|| UpstreamError::NoSuchProvider(name.to_owned()))
    }

    /// Every provider.
    pub fn iter(&self) -> impl Iterator<Item = &Upstream> {
        self.0.iter()
    }
}

/// One provider: its client (own connection pool and trust roots) and key.
pub struct Upstream {
    /// Provider name from the policy.
    pub name: String,
    /// The API it speaks: which header carries the key.
    pub api: ProviderApi,
    /// `base_url` with a trailing `/`, checked once: endpoints (plain
    /// relative paths, see the router) are appended to it.
    base_url: String,
    /// `base_url/chat/completions`, the most common endpoint, parsed once;
    /// parsing a URL per request is measurable in a profile.
    chat_completions_url: Uri,
    client: UpstreamClient,
    /// Provider key from `api_key_env`, attached in managed auth.
    managed_key: Option<HeaderValue>,
    /// The provider's tokenizer (`tokenizer_file`), for exact prompt counts
    /// and completion cuts.
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    /// What an echo costs this provider for any model: by its policy's
    /// `tokenizer_digits`, else measured once by its tokenizer.
    echo_cost: Option<EchoCost>,
    /// Which of its models take a system message.
    system_roles: SystemRoles,
}

impl Upstream {
    fn new(provider: &ProviderConfig, policy: &Policy) -> Result<Self, UpstreamError> {
        let name = provider.name.get_ref().clone();
        let bad_ca = |path: &str, problem: String| UpstreamError::ExtraCa {
            provider: name.clone(),
            path: path.to_owned(),
            problem,
        };
        let mut extra_roots = Vec::new();
        if let Some(path) = &provider.extra_ca_file {
            let pem = std::fs::read(path)
                .map_err(|error| bad_ca(path, format!("cannot be read: {error}")))?;
            extra_roots = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|error| bad_ca(path, format!("is not PEM: {error}")))?;
            if extra_roots.is_empty() {
                return Err(bad_ca(path, "holds no certificate".into()));
            }
        }
        let connect_timeout = Duration::from_millis(policy.limits.connect_timeout_ms);
        let client = UpstreamClient::new(extra_roots, connect_timeout).map_err(|error| {
            match &provider.extra_ca_file {
                Some(path) => bad_ca(path, format!("holds a certificate rustls refuses: {error}")),
                None => UpstreamError::Client {
                    provider: name.clone(),
                    problem: error.to_string(),
                },
            }
        })?;
        let base_url = format!("{}/", provider.base_url.get_ref().trim_end_matches('/'));
        let bad_url = |problem: String| UpstreamError::BaseUrl {
            provider: name.clone(),
            url: base_url.clone(),
            problem,
        };
        let base = base_url
            .parse::<Uri>()
            .map_err(|error| bad_url(error.to_string()))?;
        if !matches!(base.scheme_str(), Some("http" | "https")) || base.host().is_none() {
            return Err(bad_url(
                "is not an http:// or https:// URL with a host".into(),
            ));
        }
        let chat_completions_url = format!("{base_url}{CHAT_COMPLETIONS}")
            .parse::<Uri>()
            .map_err(|error| bad_url(error.to_string()))?;
        let managed_key = match policy.auth.mode {
            AuthMode::Managed => match provider_api_key(provider, None)? {
                Some(key) => Some(key_value(&key).map_err(|_| UpstreamError::ApiKey {
                    provider: name.clone(),
                    variable: provider.api_key_env.clone().unwrap_or_default(),
                    problem: "is not valid header text",
                })?),
                None => None,
            },
            AuthMode::Passthrough => None,
        };
        let tokenizer = match &provider.tokenizer_file {
            Some(path) => Some(Arc::new(tokenizers::Tokenizer::from_file(path).map_err(
                |error| UpstreamError::Tokenizer {
                    provider: name.clone(),
                    path: path.clone(),
                    problem: error.to_string(),
                },
            )?)),
            None => None,
        };
        let echo_cost = provider
            .tokenizer_digits
            .map(EchoCost::of_digits)
            .or_else(|| {
                let counter = TokenCounter::new(Some(tokenizer.clone()?));
                Some(EchoCost::measured(|text| counter.count(text)))
            });
        Ok(Self {
            tokenizer,
            echo_cost,
            system_roles: SystemRoles::new(provider.system_messages),
            api: provider.api,
            base_url,
            chat_completions_url,
            name,
            client,
            managed_key,
        })
    }

    /// Prompt tokens of `messages` by the provider's own tokenizer, with
    /// OpenAI's chat accounting; `None` without a `tokenizer_file`.
    pub fn count_prompt_tokens(&self, messages: &[serde_json::Value]) -> Option<u64> {
        use canarygate_policies::tokens::{TOKENS_PER_MESSAGE, TOKENS_REPLY_PRIMING, content_text};
        let tokenizer = self.tokenizer.as_ref()?;
        let count = |text: &str| -> Option<u64> {
            Some(tokenizer.encode(text, false).ok()?.get_ids().len() as u64)
        };
        let mut total = TOKENS_REPLY_PRIMING;
        for message in messages {
            total += TOKENS_PER_MESSAGE;
            for field in ["role", "name"] {
                if let Some(text) = message.get(field).and_then(serde_json::Value::as_str) {
                    total += count(text)?;
                }
            }
            if let Some(content) = message.get("content") {
                total += count(&content_text(content))?;
            }
            if let Some(tool_calls) = message.get("tool_calls") {
                total += count(&tool_calls.to_string())?;
            }
        }
        Some(total)
    }

    /// Prompt tokens of `messages`: exact with a `tokenizer_file`, our
    /// estimate ([`canarygate_policies::tokens`]) otherwise.
    pub fn prompt_tokens(&self, messages: &[serde_json::Value]) -> u64 {
        self.count_prompt_tokens(messages)
            .unwrap_or_else(|| canarygate_policies::tokens::count_chat_messages(messages))
    }

    /// A completion-token counter: the provider's tokenizer, else a high
    /// estimate.
    pub fn token_counter(&self) -> TokenCounter {
        TokenCounter::new(self.tokenizer.clone())
    }

    /// What an echo costs `model` (the name sent upstream): as the policy's
    /// `tokenizer_digits` says, else measured by the provider's tokenizer
    /// when it has one, else by the model's family.
    pub fn echo_cost(&self, model: &str) -> EchoCost {
        self.echo_cost.unwrap_or_else(|| EchoCost::for_model(model))
    }

    /// Whether `model` (the name sent upstream) takes a system message: as
    /// the policy's `system_messages` says, unless the provider refused one
    /// for it ([`Upstream::remember_system_refused`]).
    pub fn system_role(&self, model: &str) -> SystemRole {
        self.system_roles.of(model)
    }

    /// Remembers that the provider refused the system message canarygate
    /// added for `model`: its later requests place the head canary in their
    /// first user message.
    pub fn remember_system_refused(&self, model: &str) {
        self.system_roles.remember_refused(model);
    }

    /// The provider's key for managed auth, if configured.
    pub fn managed_key(&self) -> Option<&HeaderValue> {
        self.managed_key.as_ref()
    }

    /// The URL of `endpoint` (a path relative to `base_url`, such as
    /// `chat/completions` or `responses/resp_1`).
    pub fn endpoint_url(&self, endpoint: &str) -> Result<Uri, ApiError> {
        if endpoint == CHAT_COMPLETIONS {
            return Ok(self.chat_completions_url.clone());
        }
        format!("{}{endpoint}", self.base_url)
            .parse()
            .map_err(|error| {
                ApiError::internal(format!(
                    "provider `{}`: endpoint `{endpoint}` does not join its base_url: {error}",
                    self.name
                ))
            })
    }

    /// Headers this provider's API requires of every request canarygate
    /// makes itself (a probe): Anthropic's `anthropic-version`.
    pub fn api_headers(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if self.api == ProviderApi::Anthropic {
            headers.insert(
                ANTHROPIC_VERSION_HEADER,
                HeaderValue::from_static(ANTHROPIC_VERSION),
            );
        }
        headers
    }

    /// Puts `key` in `headers` as this provider's API expects it: OpenAI's
    /// `Authorization: Bearer`, Anthropic's `x-api-key`.
    pub fn add_key(&self, headers: &mut HeaderMap, key: &HeaderValue) {
        match self.api {
            ProviderApi::Openai => {
                let mut bearer = b"Bearer ".to_vec();
                bearer.extend_from_slice(key.as_bytes());
                // A valid header value stays one with a prefix.
                if let Ok(mut value) = HeaderValue::from_bytes(&bearer) {
                    value.set_sensitive(true);
                    headers.append(header::AUTHORIZATION, value);
                }
            }
            ProviderApi::Anthropic => {
                let mut value = key.clone();
                value.set_sensitive(true);
                headers.append("x-api-key", value);
            }
        }
    }

    /// The provider's `GET /models` list (`data`), asked with `key`; the head within `first_byte`, the body with at most
    /// `idle` between chunks (the waits count on `clock`). The provider's own
    /// error answer comes back as [`ModelsError::Provider`], to pass on.
    pub async fn list_models(
        &self,
        clock: &mut RequestClock,
        key: HeaderValue,
        first_byte: Duration,
        idle: Duration,
    ) -> Result<Vec<serde_json::Value>, ModelsError> {
        // Anthropic's list comes in pages of 20 unless asked for more (at
        // most 1,000); OpenAI's is whole.
        let endpoint = match self.api {
            ProviderApi::Openai => "models",
            ProviderApi::Anthropic => "models?limit=1000",
        };
        let url = self
            .endpoint_url(endpoint)
            .map_err(ModelsError::Canarygate)?;
        let mut request = self.request(Method::GET, url, None, Some(&key), false);
        request.headers_mut().extend(self.api_headers());
        let response = match clock
            .wait(tokio::time::timeout(first_byte, self.send(request)))
            .await
        {
            Err(_) => {
                return Err(ModelsError::Canarygate(ApiError::new(
                    ErrorCode::UpstreamTimeout,
                    format!(
                        "Provider `{}` sent no model list within {} ms \
                         (limits.first_byte_timeout_ms).",
                        self.name,
                        first_byte.as_millis()
                    ),
                )));
            }
            Ok(Err(error)) => return Err(ModelsError::Canarygate(self.send_error(&error))),
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        let body = self
            .read_whole(
                clock,
                response,
                BodyDeadlines {
                    idle,
                    whole: first_byte,
                },
            )
            .await
            .map_err(ModelsError::Canarygate)?;
        if !status.is_success() {
            return Err(ModelsError::Provider(status, body));
        }
        let listed = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|list| list.get("data")?.as_array().cloned());
        listed.ok_or_else(|| {
            ModelsError::Canarygate(ApiError::new(
                ErrorCode::UpstreamInvalidJson,
                format!(
                    "Provider `{}` answered GET /models without a `data` list.",
                    self.name
                ),
            ))
        })
    }

    /// Whether the provider answers HTTP at all (any status counts), within
    /// [`REACHABLE_TIMEOUT`]; `Err` says why not.
    pub async fn check_reachable(&self) -> Result<(), String> {
        let url = self
            .endpoint_url("models")
            .map_err(|error| error.to_string())?;
        let request = self.request(Method::GET, url, None, None, false);
        match tokio::time::timeout(REACHABLE_TIMEOUT, self.send(request)).await {
            Err(_) => Err(format!(
                "no answer within {} s",
                REACHABLE_TIMEOUT.as_secs()
            )),
            Ok(Err(error)) => Err(error_chain(&error)),
            Ok(Ok(_)) => Ok(()),
        }
    }

    /// The one upstream request canarygate sends: `method` on `url` (an
    /// [`Upstream::endpoint_url`]) with the JSON `body` when there is one,
    /// `key` (the managed key, or whatever the caller passes on) in the
    /// API's header and `Accept`: `text/event-stream` for a stream, `*/*`
    /// otherwise. Callers add their headers, and send it with
    /// [`Upstream::send`] under their deadline.
    pub fn request(
        &self,
        method: Method,
        url: Uri,
        body: Option<Bytes>,
        key: Option<&HeaderValue>,
        stream: bool,
    ) -> UpstreamRequest {
        let json = body.is_some();
        let mut request = UpstreamRequest::new(Full::new(body.unwrap_or_default()));
        *request.method_mut() = method;
        *request.uri_mut() = url;
        let headers = request.headers_mut();
        if json {
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
        if let Some(key) = key {
            self.add_key(headers, key);
        }
        let accept = if stream { "text/event-stream" } else { "*/*" };
        headers.insert(header::ACCEPT, HeaderValue::from_static(accept));
        // canarygate reads every answer: none compressed (with no
        // Accept-Encoding, any coding is acceptable, RFC 9110, 12.5.3).
        headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        request
    }

    /// Sends `request` on this provider's pool; resolves with the response
    /// head. The caller sets the deadline; connecting has its own.
    pub async fn send(&self, request: UpstreamRequest) -> Result<UpstreamResponse, SendError> {
        self.client.send(request).await
    }

    /// Maps a failed upstream send to the client-facing error (502 or 504).
    pub fn send_error(&self, error: &SendError) -> ApiError {
        let provider = &self.name;
        let detail = error_chain(error);
        match SendFailure::of(error) {
            SendFailure::Timeout => ApiError::new(
                ErrorCode::UpstreamTimeout,
                format!("Provider `{provider}` did not accept the connection in time: {detail}"),
            ),
            SendFailure::Certificate => ApiError::new(
                ErrorCode::UpstreamTlsError,
                format!(
                    "TLS with provider `{provider}` failed: {detail}. For a private CA, set the \
                     provider's extra_ca_file."
                ),
            ),
            SendFailure::Connect => ApiError::new(
                ErrorCode::UpstreamUnreachable,
                format!("Provider `{provider}` is unreachable: {detail}"),
            ),
            SendFailure::Exchange => ApiError::new(
                ErrorCode::UpstreamError,
                format!("Request to provider `{provider}` failed: {detail}"),
            ),
        }
    }

    /// Reads a whole (non-streamed) answer within `deadlines`
    /// ([`crate::upstream_client::read_whole`]); the waits count on `clock`
    /// as waiting on the provider.
    pub async fn read_whole(
        &self,
        clock: &mut RequestClock,
        response: UpstreamResponse,
        deadlines: BodyDeadlines,
    ) -> Result<Bytes, ApiError> {
        read_whole(&self.name, clock, response, deadlines).await
    }

    /// An error answer of the provider (`status`, `body`) that is not in the
    /// client's format, wrapped: its first 200 characters, the provider's status.
    pub fn wrapped_error(&self, status: StatusCode, body: &[u8]) -> ApiError {
        let excerpt: String = String::from_utf8_lossy(body).chars().take(200).collect();
        ApiError::provider_http(
            status,
            format!(
                "Provider `{}` answered HTTP {}: {excerpt}",
                self.name,
                status.as_u16()
            ),
        )
    }
}

/// Why a provider's model list could not be had.
#[derive(Debug)]
pub enum ModelsError {
    /// The provider answered with this error (status, body).
    Provider(StatusCode, Bytes),
    /// It could not be asked, or its answer was not a list.
    Canarygate(ApiError),
}

/// Provider response headers passed on to the client by name.
#[rustfmt::skip]
const RELAYED_HEADERS: [&str; 7] = [
    "retry-after", "retry-after-ms", "x-should-retry", "x-request-id", "request-id",
    "openai-processing-ms", "openai-version",
];

/// Provider response headers passed on to the client by prefix.
const RELAYED_PREFIXES: [&str; 2] = ["x-ratelimit-", "anthropic-ratelimit-"];

/// What of a provider's response head the client gets: rate limits
/// (`x-ratelimit-*`, `anthropic-ratelimit-*`), retry hints (`retry-after`,
/// `retry-after-ms`, `x-should-retry`, which the OpenAI and Anthropic SDKs
/// obey over their own rule), the provider's request id, processing time
/// and API version. An allowlist: hop-by-hop headers, `set-cookie` and anything
/// else the provider (or a CDN in front of it) sends never reach the client.
/// A header whose name or value holds a canary-shaped span is not passed
/// on: SDKs show request ids (and clients log them), and no real one holds
/// a canary.
pub fn relayed_headers(headers: &HeaderMap) -> HeaderMap {
    let mut relayed = HeaderMap::new();
    for (name, value) in headers {
        let text = name.as_str();
        let listed = RELAYED_HEADERS.contains(&text)
            || RELAYED_PREFIXES
                .iter()
                .any(|prefix| text.starts_with(prefix));
        let canary_shaped = |text: &str| find_canaries(text).next().is_some();
        if listed
            && !canary_shaped(text)
            && !canary_shaped(&String::from_utf8_lossy(value.as_bytes()))
        {
            relayed.append(name.clone(), value.clone());
        }
    }
    relayed
}

/// Whether the provider answered a request for a stream with one
/// (`headers`: its response head's): anything but JSON. Servers label a
/// stream `text/event-stream` (in any case: a media type is
/// case-insensitive, RFC 9110, 8.3.1), or not at all, or wrongly
/// (`text/plain`, `application/octet-stream`), and the SDKs read them all;
/// a JSON media type (`application/json`, `…+json`) is a whole answer: an
/// error, or a server that does not stream.
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_none_or(|value| !is_json_media(value))
}

/// Whether a `Content-Type` value names a JSON media type
/// (`application/json` or `…+json`, in any case, with parameters or not).
pub fn is_json_media(value: &HeaderValue) -> bool {
    let media = value
        .as_bytes()
        .split(|byte| *byte == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    media.eq_ignore_ascii_case(b"application/json")
        || media
            .len()
            .checked_sub(5)
            .is_some_and(|at| media[at..].eq_ignore_ascii_case(b"+json"))
}

/// What a string of a provider's error becomes when it holds a
/// canary-shaped span ([`without_canary_text`]).
pub const WITHHELD_ERROR_TEXT: &str =
    "[withheld by canarygate: the provider's error quoted canary-shaped text]";

/// A provider's error `body` with every string that holds a canary-shaped
/// span replaced by [`WITHHELD_ERROR_TEXT`], its JSON otherwise kept (its
/// type and code still the provider's), or, when it is not JSON, withheld
/// whole; `None` when nothing in it is canary-shaped. Clients never see a
/// canary, their own or another request's (an error that quotes a prompt
/// could quote another session's), and no error is verified as an answer
/// is.
pub fn without_canary_text(body: &[u8]) -> Option<Vec<u8>> {
    let text = String::from_utf8_lossy(body);
    find_canaries(&text).next()?;
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Some(WITHHELD_ERROR_TEXT.as_bytes().to_vec());
    };
    withhold_strings(&mut value);
    serde_json::to_vec(&value).ok()
}

/// Replaces every string under `value` that holds a canary-shaped span,
/// and drops every member whose name holds one.
fn withhold_strings(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::String(text) if find_canaries(text).next().is_some() => {
            *text = WITHHELD_ERROR_TEXT.to_owned();
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(withhold_strings),
        serde_json::Value::Object(members) => {
            members.retain(|name, _| find_canaries(name).next().is_none());
            members.values_mut().for_each(withhold_strings);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canary_shaped_text_in_a_providers_error_is_withheld() {
        let clean = br#"{"error":{"message":"Rate limit reached","type":"rate_limit_error"}}"#;
        assert_eq!(without_canary_text(clean), None);
        let quoting = br#"{"error":{"message":"Invalid content: 'Recall [CG123456789012345]'","type":"invalid_request_error","param":"messages","code":null}}"#;
        let withheld: serde_json::Value =
            serde_json::from_slice(&without_canary_text(quoting).unwrap()).unwrap();
        assert_eq!(
            withheld,
            serde_json::json!({"error": {"message": WITHHELD_ERROR_TEXT,
                "type": "invalid_request_error", "param": "messages", "code": null}})
        );
        // A member named after one goes.
        let named = br#"{"error":{"message":"Bad field","type":"invalid_request_error","x_CG123456789012345":1}}"#;
        let withheld: serde_json::Value =
            serde_json::from_slice(&without_canary_text(named).unwrap()).unwrap();
        assert_eq!(
            withheld,
            serde_json::json!({"error": {"message": "Bad field", "type": "invalid_request_error"}})
        );
        assert_eq!(
            without_canary_text(b"<html>quoted cg 123456789012345</html>").unwrap(),
            WITHHELD_ERROR_TEXT.as_bytes()
        );
    }

    #[test]
    fn a_stream_is_anything_but_json() {
        let head = |content_type: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, content_type.parse().unwrap());
            headers
        };
        for stream in [
            "text/event-stream",
            "text/event-stream; charset=utf-8",
            "Text/Event-Stream; charset=UTF-8",
            // Mislabelled, as some gateways send streams.
            "text/plain; charset=utf-8",
            "application/octet-stream",
        ] {
            assert!(is_event_stream(&head(stream)), "{stream}");
        }
        for json in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/problem+json",
        ] {
            assert!(!is_event_stream(&head(json)), "{json}");
        }
        // A server that names no media type for the stream it was asked for.
        assert!(is_event_stream(&HeaderMap::new()));
    }

    #[test]
    fn retry_hints_and_rate_limits_are_relayed_and_nothing_else() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("x-should-retry", "false"),
            ("retry-after", "2"),
            ("x-ratelimit-remaining-requests", "9"),
            ("anthropic-ratelimit-tokens-limit", "100"),
            ("set-cookie", "a=b"),
            ("cf-ray", "1"),
            // Canary-shaped, in a value or in a name: not passed on.
            ("x-request-id", "req_CG123456789012345"),
            ("x-ratelimit-cg123456789012345", "1"),
        ] {
            headers.insert(
                axum::http::HeaderName::from_static(name),
                value.parse().unwrap(),
            );
        }
        let relayed = relayed_headers(&headers);
        let mut names: Vec<&str> = relayed.keys().map(|name| name.as_str()).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            [
                "anthropic-ratelimit-tokens-limit",
                "retry-after",
                "x-ratelimit-remaining-requests",
                "x-should-retry"
            ]
        );
    }
}
